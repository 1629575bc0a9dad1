//! The driver actor: hosts the reconciler's driver core and is the sole writer of `ClusterState`.
//!
//! `handle` stays thin: it decodes a message, calls the pure core, and turns
//! what the core returns into messages to children. Three habits keep it fast
//! and correct:
//!
//! - **Batching.** Folding an input never runs a pass directly; it queues one
//!   [`DriverMsg::RunPass`] at the back of the mailbox (at most one at a
//!   time). Every message already waiting is folded first, so a burst of N
//!   results costs one pass.
//! - **One timer.** After every pass the actor arms ONE engine timer at the
//!   core's `poll_timeout()`; a slow periodic tick is only a safety net.
//! - **Pending before dispatch.** The core records every operation as pending
//!   before the actor sees it; the actor only routes it to an executor, and a
//!   routing failure folds back as a failed submission.

use crate::events::{ClusterEvent, ClusterSnapshot, NodeSummary, PlanView};
use crate::executor::{ExecutorWorker, Finished, WorkerArgs, WorkerMsg};
use crate::observer::{BootstrapObserver, ObserverArgs};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use swactor_engine::ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_engine::{ChildEvent, ChildSpec, Children, Clock, RestartPolicy, TimerFired, Timers};
use swactor_providers::{Inventory, Provider, ProviderError};
use swactor_provisioning::{
    ClusterShape, DesiredUpdate, Driver, FailureClass, Folded, Generation, LogicalNodeId,
    OperationId, OperationOutcome, OperationResult, ReconcilerConfig, ResourceKey, RunId,
    SessionId, Timestamp, UpdateError,
};
use tokio::sync::broadcast;

/// Settings of a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The run this cluster manages; fixed for its lifetime.
    pub run_id: RunId,
    /// The reconciler's tunables.
    pub reconciler: ReconcilerConfig,
    /// Executor workers, i.e. provider calls that may run at once.
    pub executors: usize,
    /// Restart budget of each executor worker.
    pub executor_restarts: RestartPolicy,
    /// Completed operations each worker remembers for replay.
    pub executor_history_len_max: usize,
    /// Period of the safety-net tick.
    pub tick: Duration,
    /// Events a local subscriber may fall behind before it is told it lagged.
    pub event_buffer_len: usize,
    /// Publish one event per node change (off for very large benchmarks).
    pub node_events: bool,
    /// The first desired shape, if known at start.
    pub initial_shape: Option<ClusterShape>,
    /// How often the remote telemetry snapshot is refreshed while things change.
    pub snapshot_refresh: Duration,
}

impl ClusterConfig {
    /// Defaults for `run_id`.
    pub fn new(run_id: RunId) -> Self {
        Self {
            run_id,
            reconciler: ReconcilerConfig::default(),
            executors: 16,
            // Generous: a provider call that panics is a bug worth escalating,
            // but a handful of them should not take the whole cluster down.
            executor_restarts: RestartPolicy {
                restarts_max: 10,
                window: Duration::from_secs(60),
            },
            executor_history_len_max: 4_096,
            tick: Duration::from_secs(30),
            event_buffer_len: 4_096,
            node_events: true,
            initial_shape: None,
            snapshot_refresh: Duration::from_secs(1),
        }
    }
}

/// How to shut a cluster down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Scale to zero and return only when nothing is left.
    Teardown,
    /// Stop managing; leave every node running for a later cluster of the same run to adopt.
    Keep,
}

/// What a shutdown did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// The mode.
    pub mode: ShutdownMode,
    /// Slots whose nodes were torn down.
    pub destroyed: Vec<LogicalNodeId>,
    /// Slots whose nodes were left running.
    pub kept: Vec<LogicalNodeId>,
}

/// The driver's full state at one instant (a copy), for tests and diagnostics.
#[derive(Clone, Debug)]
pub struct DriverView {
    /// The instant, on the driver's clock.
    pub now: Timestamp,
    /// The observed state.
    pub state: swactor_provisioning::ClusterState,
    /// The desired state.
    pub desired: swactor_provisioning::DesiredState,
    /// The core's next deadline (`poll_timeout`).
    pub timer: Option<Timestamp>,
    /// Whether the core reports convergence.
    pub converged: bool,
    /// The core's lifetime counters.
    pub stats: swactor_provisioning::DriverStats,
}

/// A local subscription: the state now, then every event after it.
#[derive(Debug)]
pub struct Subscription {
    /// The cluster when the subscription started.
    pub snapshot: ClusterSnapshot,
    /// Events after the snapshot. A subscriber that falls `event_buffer_len`
    /// behind gets `RecvError::Lagged` and continues; it never slows the driver.
    pub events: broadcast::Receiver<ClusterEvent>,
}

/// Messages of the driver actor.
pub enum DriverMsg {
    /// Offer a new desired shape.
    Apply(
        ClusterShape,
        RpcReplyPort<Result<DesiredUpdate, UpdateError>>,
    ),
    /// Preview the next pass, for the current shape or a proposed one.
    Plan(
        Option<ClusterShape>,
        RpcReplyPort<Result<PlanView, UpdateError>>,
    ),
    /// The cluster as it is now.
    Snapshot(RpcReplyPort<ClusterSnapshot>),
    /// The driver's full state, for tests and diagnostics.
    Inspect(RpcReplyPort<DriverView>),
    /// Subscribe to events.
    Subscribe(RpcReplyPort<Subscription>),
    /// Reply once converged on the current desired generation.
    WaitConverged(RpcReplyPort<Generation>),
    /// Shut the cluster down.
    Shutdown(ShutdownMode, RpcReplyPort<ShutdownReport>),
    /// An executor finished an operation.
    Finished(Finished),
    /// An observer forwarded a bootstrap observation.
    Observed(swactor_provisioning::BootstrapObservation),
    /// The provider's inventory, for adoption.
    Listed(Result<Inventory, ProviderError>),
    /// An orphan was collected (or not).
    Collected(ResourceKey, Result<(), ProviderError>),
    /// An agent presented `key` to join the swarm: accepted only for the
    /// node's current, active attempt.
    AgentJoin(ResourceKey, RpcReplyPort<Result<(), String>>),
    /// The agent of `key` disconnected; unless it rejoins within its group's
    /// grace period, the attempt fails and is replaced.
    AgentGone(ResourceKey),
    /// An engine timer fired.
    Timer(TimerFired<TimerKey>),
    /// Run the passes queued by the inputs folded so far.
    RunPass,
}

impl From<TimerFired<TimerKey>> for DriverMsg {
    fn from(f: TimerFired<TimerKey>) -> Self {
        Self::Timer(f)
    }
}

/// The driver's timers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimerKey {
    /// A disconnected agent's grace period.
    AgentGrace(LogicalNodeId),
    /// The core's next deadline.
    Requeue,
    /// The safety-net tick.
    Tick,
    /// Refresh the remote telemetry snapshot.
    Snapshot,
}

/// Start arguments of the driver actor.
pub struct DriverArgs {
    /// Settings.
    pub config: ClusterConfig,
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Publishes to remote subscribers (the daemon's telemetry endpoint), if any.
    pub publisher: Option<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>,
}

enum Adoption {
    /// Waiting for the provider's inventory.
    Listing,
    /// Inventory in hand, waiting for the first shape.
    Waiting(Inventory),
    /// Done.
    Done,
}

/// The driver actor's state.
pub struct DriverState {
    config: ClusterConfig,
    driver: Driver,
    clock: Clock,
    timers: Timers<TimerKey, DriverMsg>,
    armed_requeue: Option<Timestamp>,
    workers: Children,
    in_flight: BTreeMap<usize, BTreeMap<OperationId, LogicalNodeId>>,
    /// The observer of each node's live session (a node has at most one).
    observers: BTreeMap<LogicalNodeId, (SessionId, ActorRef<crate::observer::Next>)>,
    observer_ids: BTreeMap<ActorId, LogicalNodeId>,
    pass_queued: bool,
    /// Agents that disconnected and have not rejoined, by node.
    gone: BTreeMap<LogicalNodeId, swactor_provisioning::NodeAttemptId>,
    adoption: Adoption,
    events: broadcast::Sender<ClusterEvent>,
    publisher: Option<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>,
    snapshot_dirty: bool,
    converged_reported: Option<Generation>,
    convergence_waiters: Vec<RpcReplyPort<Generation>>,
    shutdown: Option<(
        ShutdownMode,
        Vec<LogicalNodeId>,
        RpcReplyPort<ShutdownReport>,
    )>,
}

/// The driver actor.
pub struct DriverActor;

fn worker_label(i: usize) -> String {
    format!("executor-{i}")
}

impl Actor for DriverActor {
    type Msg = DriverMsg;
    type State = DriverState;
    type Arguments = DriverArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<DriverMsg>,
        args: DriverArgs,
    ) -> Result<DriverState, ActorProcessingErr> {
        let DriverArgs {
            config,
            provider,
            publisher,
        } = args;
        let driver = Driver::new(config.run_id.clone(), config.reconciler.clone())?;
        let clock = Clock::new();
        let mut workers = Children::new();
        let executors = config.executors.max(1);
        for index in 0..executors {
            let provider = provider.clone();
            let me = myself.clone();
            let history = config.executor_history_len_max;
            let spec = ChildSpec::new(worker_label(index), config.executor_restarts, move || {
                let args = WorkerArgs {
                    index,
                    driver: me.clone(),
                    provider: provider.clone(),
                    clock,
                    history_len_max: history,
                };
                (ExecutorWorker, args)
            });
            workers.start(&myself.get_cell(), spec).await?;
        }
        let mut timers = Timers::new(myself.clone());
        timers.arm_periodic(TimerKey::Tick, config.tick);
        let (events, _) = broadcast::channel(config.event_buffer_len.max(1));
        let mut state = DriverState {
            driver,
            clock,
            timers,
            armed_requeue: None,
            workers,
            in_flight: BTreeMap::new(),
            observers: BTreeMap::new(),
            observer_ids: BTreeMap::new(),
            pass_queued: false,
            gone: BTreeMap::new(),
            adoption: Adoption::Listing,
            events,
            publisher,
            snapshot_dirty: false,
            converged_reported: None,
            convergence_waiters: Vec::new(),
            shutdown: None,
            config,
        };
        // Adoption first: ask the provider what this run already holds.
        let run = state.config.run_id.clone();
        state.send_to_worker(0, WorkerMsg::List(run));
        if let Some(shape) = state.config.initial_shape.clone() {
            state.apply(&myself, &shape)?;
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DriverMsg>,
        state: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        state.timers.cancel_all();
        state.workers.stop_all(None);
        for (_, (_, o)) in std::mem::take(&mut state.observers) {
            o.kill();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DriverMsg>,
        msg: DriverMsg,
        st: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DriverMsg::Apply(shape, reply) => {
                let _ = reply.send(st.apply(&myself, &shape));
            }
            DriverMsg::Plan(shape, reply) => {
                let now = st.now();
                let plan = match shape {
                    Some(s) => st.driver.plan_shape(&s, now),
                    None => Ok(st.driver.plan(now)),
                };
                let _ = reply.send(plan.map(PlanView::from));
            }
            DriverMsg::Snapshot(reply) => {
                let _ = reply.send(st.snapshot());
            }
            DriverMsg::Inspect(reply) => {
                let _ = reply.send(DriverView {
                    now: st.now(),
                    state: st.driver.state().clone(),
                    desired: st.driver.desired().clone(),
                    timer: st.driver.poll_timeout(),
                    converged: st.driver.is_converged(),
                    stats: st.driver.stats(),
                });
            }
            DriverMsg::Subscribe(reply) => {
                let events = st.events.subscribe();
                let _ = reply.send(Subscription {
                    snapshot: st.snapshot(),
                    events,
                });
            }
            DriverMsg::WaitConverged(reply) => {
                if st.converged() {
                    let _ = reply.send(st.driver.desired().generation);
                } else {
                    st.convergence_waiters.push(reply);
                }
            }
            DriverMsg::Shutdown(mode, reply) => st.begin_shutdown(&myself, mode, reply)?,
            DriverMsg::Finished(f) => st.finished(&myself, f).await?,
            DriverMsg::Observed(obs) => {
                let node = obs.node.clone();
                let now = st.now();
                if st.driver.handle_bootstrap(obs, now)? == Folded::Applied {
                    st.node_changed(&node);
                    st.queue_pass(&myself);
                }
            }
            DriverMsg::Listed(inventory) => st.listed(&myself, inventory),
            DriverMsg::Collected(key, outcome) => match outcome {
                Ok(()) => tracing::info!(%key, "collected orphaned resources"),
                Err(e) => st.warn(format!("could not collect orphan {key}: {e}")),
            },
            DriverMsg::AgentJoin(key, reply) => {
                let verdict = st.agent_join(&key);
                let _ = reply.send(verdict);
            }
            DriverMsg::AgentGone(key) => st.agent_gone(&key),
            DriverMsg::Timer(fired) => {
                if !st.timers.accept(&fired) {
                    return Ok(());
                }
                let now = st.now();
                match fired.key {
                    TimerKey::AgentGrace(node) => {
                        if let Some(attempt) = st.gone.remove(&node) {
                            let reason = "agent disconnected for longer than its grace period";
                            if st.driver.handle_agent_lost(&node, attempt, reason, now)
                                == Folded::Applied
                            {
                                st.warn(format!("{node}: {reason}; replacing it"));
                                st.node_changed(&node);
                            }
                        }
                    }
                    TimerKey::Requeue => {
                        st.armed_requeue = None;
                        if let Err(e) = st.driver.handle_timeout(now) {
                            st.warn(e.to_string());
                        }
                    }
                    TimerKey::Tick => st.driver.handle_tick(now),
                    TimerKey::Snapshot => st.refresh_snapshot(),
                }
                if st.driver.is_pass_queued() {
                    st.queue_pass(&myself);
                }
            }
            DriverMsg::RunPass => {
                st.pass_queued = false;
                st.run_passes(&myself)?;
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DriverMsg>,
        evt: SupervisionEvent,
        st: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        // Observers are not restarted: their stream is gone with them. The
        // node waits out its bootstrap stall deadline and is replaced.
        let observer = match &evt {
            SupervisionEvent::ActorTerminated(cell, ..)
            | SupervisionEvent::ActorFailed(cell, _) => st.observer_ids.remove(&cell.get_id()),
            _ => None,
        };
        if let Some(node) = observer {
            if let SupervisionEvent::ActorFailed(_, e) = &evt {
                st.warn(format!("the bootstrap observer of {node} failed: {e}"));
            }
            st.observers.remove(&node);
            return Ok(());
        }
        let failed = matches!(evt, SupervisionEvent::ActorFailed(..));
        // An error here is the escalation: the restart budget is spent.
        let outcome = st.workers.handle_event(&myself.get_cell(), &evt).await?;
        if let (true, ChildEvent::Restarted { label, .. }) = (failed, &outcome) {
            let index = label
                .strip_prefix("executor-")
                .and_then(|i| i.parse::<usize>().ok());
            if let Some(index) = index {
                st.worker_crashed(&myself, index)?;
            }
        }
        Ok(())
    }
}

impl DriverState {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.clock.now_ms())
    }

    fn publish(&mut self, event: ClusterEvent) {
        // No receivers is fine: nobody is watching.
        if let Some(p) = &self.publisher {
            if let Err(e) = p.publish(&event) {
                tracing::warn!(%e, "telemetry event could not be published");
            }
            self.snapshot_dirty = true;
        }
        let _ = self.events.send(event);
    }

    fn warn(&mut self, message: String) {
        tracing::warn!("{message}");
        self.publish(ClusterEvent::Warning { message });
    }

    fn node_changed(&mut self, node: &LogicalNodeId) {
        if !self.config.node_events {
            return;
        }
        let event = match NodeSummary::of(node, self.driver.state()) {
            Some(summary) => ClusterEvent::Node(summary),
            None => ClusterEvent::Removed { node: node.clone() },
        };
        self.publish(event);
    }

    fn queue_pass(&mut self, myself: &ActorRef<DriverMsg>) {
        if !self.pass_queued && self.driver.is_pass_queued() {
            self.pass_queued = true;
            // Goes to the back of the mailbox: everything already waiting is
            // folded before the pass runs.
            let _ = myself.send_message(DriverMsg::RunPass);
        }
    }

    fn send_to_worker(&self, index: usize, msg: WorkerMsg) -> bool {
        self.workers
            .get::<WorkerMsg>(&worker_label(index))
            .is_some_and(|w| w.send_message(msg).is_ok())
    }

    fn snapshot(&self) -> ClusterSnapshot {
        let state = self.driver.state();
        ClusterSnapshot {
            run_id: state.run_id.to_string(),
            generation: self.driver.desired().generation,
            observed_generation: state.observed_generation,
            converged: self.converged(),
            desired_nodes: self.driver.desired().node_count(),
            nodes: state
                .nodes
                .keys()
                .filter_map(|id| NodeSummary::of(id, state))
                .collect(),
            stats: self.driver.stats(),
            now: self.now(),
        }
    }

    fn refresh_snapshot(&mut self) {
        if let Some(Err(e)) = self
            .publisher
            .as_ref()
            .map(|p| p.set_snapshot(&self.snapshot()))
        {
            tracing::warn!(%e, "telemetry snapshot could not be published");
        }
        self.snapshot_dirty = false;
    }

    fn apply(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        shape: &ClusterShape,
    ) -> Result<DesiredUpdate, UpdateError> {
        if self.shutdown.is_some() {
            // A cluster being torn down only ever shrinks.
            return Ok(DesiredUpdate::Unchanged(self.driver.desired().generation));
        }
        let update = self.driver.update_desired(shape)?;
        if let DesiredUpdate::Accepted(generation) = update {
            let nodes = self.driver.desired().node_count();
            self.publish(ClusterEvent::ShapeAccepted { generation, nodes });
            self.adopt_if_ready(myself);
            self.queue_pass(myself);
        }
        Ok(update)
    }

    fn listed(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        inventory: Result<Inventory, ProviderError>,
    ) {
        match inventory {
            Ok(inv) => {
                self.adoption = Adoption::Waiting(inv);
                self.adopt_if_ready(myself);
            }
            Err(e) => {
                // Without an inventory nothing can be adopted; carry on so the
                // cluster still converges (creates adopt by key anyway).
                self.warn(format!("could not list the provider's resources: {e}"));
                self.adoption = Adoption::Done;
            }
        }
        self.queue_pass(myself);
        if !self.pass_queued {
            self.after_pass(myself);
        }
    }

    /// Adopts the inventory once both it and the first shape are known.
    fn adopt_if_ready(&mut self, myself: &ActorRef<DriverMsg>) {
        if !self.shape_seen() || !matches!(self.adoption, Adoption::Waiting(_)) {
            return;
        }
        let Adoption::Waiting(inv) = std::mem::replace(&mut self.adoption, Adoption::Done) else {
            return;
        };
        let report = self.driver.adopt(inv.keys().cloned());
        if !report.adopted.is_empty() {
            tracing::info!(
                count = report.adopted.len(),
                "adopted nodes left by an earlier cluster"
            );
        }
        for key in report.orphans {
            let Some(owned) = inv.get(&key).cloned() else {
                continue;
            };
            let index = self.worker_for(key.attempt.0);
            if !self.send_to_worker(index, WorkerMsg::Collect(key.clone(), owned)) {
                self.warn(format!("could not collect orphan {key}: no executor"));
            }
        }
        self.queue_pass(myself);
    }

    fn agent_join(&mut self, key: &ResourceKey) -> Result<(), String> {
        if key.run_id != self.driver.state().run_id {
            return Err(format!("run {} is not this daemon's run", key.run_id));
        }
        let Some(node) = self.driver.state().nodes.get(&key.node) else {
            return Err(format!("{} is not a node of this cluster", key.node));
        };
        if node.attempt != key.attempt {
            return Err(format!(
                "attempt {} of {} is superseded (current: {})",
                key.attempt, key.node, node.attempt
            ));
        }
        if node.intent != swactor_provisioning::Intent::Active {
            return Err(format!("{} is being deleted", key.node));
        }
        if self.gone.remove(&key.node).is_some() {
            self.timers.cancel(&TimerKey::AgentGrace(key.node.clone()));
        }
        Ok(())
    }

    fn agent_gone(&mut self, key: &ResourceKey) {
        let Some(node) = self.driver.state().nodes.get(&key.node) else {
            return;
        };
        if node.attempt != key.attempt || node.intent != swactor_provisioning::Intent::Active {
            return;
        }
        let grace = Duration::from_secs_f64(node.template.join.lost_grace_s);
        self.gone.insert(key.node.clone(), key.attempt);
        self.timers
            .arm_after(TimerKey::AgentGrace(key.node.clone()), grace);
    }

    /// Whether any shape was ever accepted (generation 0 is the implicit empty
    /// shape, which is never accepted, only replaced).
    fn shape_seen(&self) -> bool {
        self.driver.desired().generation.0 > 0
    }

    /// Converged on the desired shape, with nothing left to list or adopt:
    /// before the provider's inventory is in, "nothing held" is not known.
    fn converged(&self) -> bool {
        let adopted = match &self.adoption {
            Adoption::Listing => false,
            Adoption::Waiting(inventory) => inventory.is_empty(),
            Adoption::Done => true,
        };
        adopted && self.driver.is_converged()
    }

    fn worker_for(&self, attempt: u64) -> usize {
        (attempt % self.config.executors.max(1) as u64) as usize
    }

    /// Drains the core's queued passes: routes dispatches, publishes, re-arms the timer.
    fn run_passes(&mut self, myself: &ActorRef<DriverMsg>) -> Result<(), ActorProcessingErr> {
        // Passes wait for the provider's inventory, so nothing is created
        // that should have been adopted.
        if matches!(self.adoption, Adoption::Listing) && self.shutdown.is_none() {
            return Ok(());
        }
        let now = self.now();
        while let Some(pass) = self.driver.poll_pass(now)? {
            for e in &pass.errors {
                let message = e.to_string();
                self.warn(message);
            }
            for d in pass.dispatches {
                let node = d.key.node.clone();
                let op = d.op;
                let effect = d.request.kind();
                let index = self.worker_for(d.key.attempt.0);
                let routed = self
                    .workers
                    .get::<WorkerMsg>(&worker_label(index))
                    .is_some_and(|w| w.send_message(WorkerMsg::Execute(d)).is_ok());
                if routed {
                    self.in_flight
                        .entry(index)
                        .or_default()
                        .insert(op, node.clone());
                    if self.config.node_events {
                        self.publish(ClusterEvent::Dispatched {
                            node: node.clone(),
                            op,
                            effect,
                        });
                    }
                } else {
                    let reason = "no executor could take it";
                    let _ = self.driver.handle_submit_failed(&node, op, reason, now)?;
                }
                self.node_changed(&node);
            }
            for node in &pass.transitioned {
                self.drop_stale_observer(node);
                self.node_changed(node);
            }
            let stats = pass.stats;
            if self.config.node_events || stats.transitions + stats.dispatched > 0 {
                self.publish(ClusterEvent::Pass {
                    number: pass.number,
                    nodes: stats.nodes,
                    transitions: stats.transitions,
                    dispatched: stats.dispatched,
                });
            }
            self.driver.finish_pass()?;
        }
        self.rearm(now);
        self.after_pass(myself);
        Ok(())
    }

    /// Stops `node`'s observer if its record no longer holds the observed
    /// session (the node was reaped or restarted, or the stream closed).
    fn drop_stale_observer(&mut self, node: &LogicalNodeId) {
        let live = self
            .driver
            .state()
            .nodes
            .get(node)
            .and_then(|n| n.record.session.as_ref());
        if self
            .observers
            .get(node)
            .is_some_and(|(s, _)| Some(s) != live)
        {
            self.stop_observer(node);
        }
    }

    fn rearm(&mut self, now: Timestamp) {
        let next = self.driver.poll_timeout();
        if next == self.armed_requeue {
            return;
        }
        match next {
            Some(at) => {
                let at = at.max(now);
                self.timers
                    .arm_at(TimerKey::Requeue, self.clock.at_ms(at.as_millis()));
            }
            None => {
                self.timers.cancel(&TimerKey::Requeue);
            }
        }
        self.armed_requeue = next;
        if self.snapshot_dirty && !self.timers.is_armed(&TimerKey::Snapshot) {
            self.timers
                .arm_after(TimerKey::Snapshot, self.config.snapshot_refresh);
        }
    }

    /// Convergence, waiters and shutdown, checked once the cluster is quiet.
    fn after_pass(&mut self, myself: &ActorRef<DriverMsg>) {
        let quiet =
            self.in_flight.values().all(BTreeMap::is_empty) && !self.driver.is_pass_queued();
        if !quiet {
            return;
        }
        let converged = self.converged();
        let generation = self.driver.desired().generation;
        if converged && self.converged_reported != Some(generation) {
            self.converged_reported = Some(generation);
            let nodes = self.driver.state().nodes.len();
            self.publish(ClusterEvent::Converged { generation, nodes });
            self.refresh_snapshot();
        }
        if converged {
            for w in self.convergence_waiters.drain(..) {
                let _ = w.send(generation);
            }
        }
        let torn_down = converged && self.driver.state().nodes.is_empty();
        if torn_down && matches!(self.shutdown, Some((ShutdownMode::Teardown, ..))) {
            self.finish_shutdown(myself);
        }
    }

    fn begin_shutdown(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        mode: ShutdownMode,
        reply: RpcReplyPort<ShutdownReport>,
    ) -> Result<(), ActorProcessingErr> {
        let nodes: Vec<LogicalNodeId> = self.driver.state().nodes.keys().cloned().collect();
        if self.shutdown.is_some() {
            // Already shutting down; the first caller gets the report.
            return Ok(());
        }
        self.shutdown = Some((mode, nodes, reply));
        match mode {
            ShutdownMode::Keep => self.finish_shutdown(myself),
            ShutdownMode::Teardown => {
                let desired = self.driver.desired();
                let empty = ClusterShape {
                    run_id: desired.run_id.clone(),
                    generation: Generation(desired.generation.0 + 1),
                    groups: Vec::new(),
                };
                self.driver.update_desired(&empty)?;
                // Resources listed but not yet adopted must be torn down too.
                self.adopt_if_ready(myself);
                self.queue_pass(myself);
                if !self.driver.is_pass_queued() {
                    self.after_pass(myself);
                }
            }
        }
        Ok(())
    }

    fn finish_shutdown(&mut self, myself: &ActorRef<DriverMsg>) {
        let Some((mode, nodes, reply)) = self.shutdown.take() else {
            return;
        };
        let report = match mode {
            ShutdownMode::Teardown => ShutdownReport {
                mode,
                destroyed: nodes,
                kept: Vec::new(),
            },
            ShutdownMode::Keep => ShutdownReport {
                mode,
                destroyed: Vec::new(),
                kept: nodes,
            },
        };
        self.timers.cancel_all();
        self.workers.stop_all(None);
        for (_, (_, o)) in std::mem::take(&mut self.observers) {
            o.kill();
        }
        let _ = reply.send(report);
        myself.stop(Some("shut down".to_owned()));
    }

    async fn finished(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        f: Finished,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(ops) = self.in_flight.get_mut(&f.worker) {
            ops.remove(&f.result.op);
        }
        let node = f.result.node.clone();
        let op = f.result.op;
        let started = match &f.result.outcome {
            OperationOutcome::BootstrapStarted { session } => Some(session.clone()),
            _ => None,
        };
        let outcome = describe(&f.result.outcome);
        let now = self.now();
        let folded = self.driver.handle_result(f.result, now)? == Folded::Applied;
        if self.config.node_events {
            self.publish(ClusterEvent::Finished {
                node: node.clone(),
                op,
                outcome,
                folded,
            });
        }
        if folded {
            if let (Some(session), Some(events)) = (started, f.events) {
                self.start_observer(myself, &node, op, session, events)
                    .await;
            }
            // A cancelled session's observer goes with it.
            self.drop_stale_observer(&node);
            self.node_changed(&node);
            self.queue_pass(myself);
        } else {
            self.after_pass(myself);
        }
        Ok(())
    }

    async fn start_observer(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        node: &LogicalNodeId,
        op: OperationId,
        session: SessionId,
        events: swactor_providers::BootstrapEvents,
    ) {
        // A node observes one session at a time; an adopted session gets a
        // fresh stream and the old reader is stopped.
        self.stop_observer(node);
        let args = ObserverArgs {
            driver: myself.clone(),
            node: node.clone(),
            attempt: op.attempt,
            session: session.clone(),
            events,
        };
        // Observers are started linked, without a restart budget: a dead
        // stream cannot be resumed, and the stall deadline covers the loss.
        let cell: ActorCell = myself.get_cell();
        match BootstrapObserver::spawn_linked(None, BootstrapObserver, args, cell).await {
            Ok((actor, _)) => {
                self.observer_ids.insert(actor.get_id(), node.clone());
                self.observers.insert(node.clone(), (session, actor));
            }
            Err(e) => self.warn(format!("could not start an observer for {node}: {e}")),
        }
    }

    fn stop_observer(&mut self, node: &LogicalNodeId) {
        if let Some((_, o)) = self.observers.remove(node) {
            self.observer_ids.remove(&o.get_id());
            o.kill();
        }
    }

    /// Every operation a crashed worker held (running or queued) folds as ambiguous.
    fn worker_crashed(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        index: usize,
    ) -> Result<(), ActorProcessingErr> {
        let lost = self.in_flight.remove(&index).unwrap_or_default();
        self.warn(format!(
            "executor-{index} crashed with {} operations; folding them as ambiguous",
            lost.len()
        ));
        let now = self.now();
        for (op, node) in lost {
            let result = OperationResult {
                node: node.clone(),
                op,
                outcome: OperationOutcome::Failed {
                    class: FailureClass::Ambiguous,
                    reason: "executor crashed mid-operation".to_owned(),
                },
            };
            if self.driver.handle_result(result, now)? == Folded::Applied {
                self.node_changed(&node);
            }
        }
        self.queue_pass(myself);
        Ok(())
    }
}

fn describe(outcome: &OperationOutcome) -> String {
    match outcome {
        OperationOutcome::LeaseCreated { lease, .. } => format!("lease {}", lease.0),
        OperationOutcome::EndpointFound { endpoint } => format!("endpoint {}", endpoint.0),
        OperationOutcome::EndpointNotReady => "endpoint not ready".to_owned(),
        OperationOutcome::BootstrapStarted { session } => format!("session {}", session.0),
        OperationOutcome::BootstrapCancelled => "bootstrap cancelled".to_owned(),
        OperationOutcome::LeaseDestroyed => "lease destroyed".to_owned(),
        OperationOutcome::Failed { class, reason } => format!("{class:?} failure: {reason}"),
    }
}
