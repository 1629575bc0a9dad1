//! The driver actor: hosts the cluster [`Host`] and routes what it decides.
//!
//! Every decision is the host's (`swactor_provisioning::Host`): this actor
//! decodes a message, hands it to the host, and routes the host's outputs —
//! journal writes to the [`JournalStore`], dispatches to executor workers,
//! replies to the callers who wait for them, events to subscribers — then
//! arms ONE engine timer at the host's next deadline. Two habits keep it fast:
//!
//! - **Batching.** An input is folded at once, but the host's outputs are
//!   drained by one [`DriverMsg::Drive`] at the back of the mailbox (at most
//!   one queued at a time), so a burst of N results costs one pass.
//! - **Durable before acting.** A journal write is awaited before the next
//!   output is taken: an attempt's first effect never goes out before its
//!   record is durable, and an apply is acknowledged only once it is.

use crate::events::{ClusterEvent, ClusterSnapshot, NodeSummary, PlanView};
use crate::executor::{ExecutorReport, ExecutorWorker, Finished, WorkerArgs, WorkerMsg};
use crate::journal::JournalStore;
use crate::observer::{BootstrapObserver, Observed, ObserverArgs};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use swactor_engine::ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_engine::{ChildEvent, ChildSpec, Children, Clock, RestartPolicy, TimerFired, Timers};
use swactor_providers::{Inventory, Provider};
use swactor_provisioning::{
    ApplyError, BootstrapObservation, ClusterShape, DesiredUpdate, Driver, Folded, Generation,
    Host, HostConfig, HostEvent, JoinRefused, JournalImage, Listed, LogicalNodeId,
    OperationOutcome, Output, ReconcilerConfig, Reply, ResourceKey, RunId, SessionId, ShutdownMode,
    ShutdownReport, Ticket, Timestamp,
};
use tokio::sync::broadcast;

/// Settings of a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The run this cluster manages; fixed for its lifetime.
    pub run_id: RunId,
    /// The reconciler's tunables.
    pub reconciler: ReconcilerConfig,
    /// Executor workers, i.e. provider calls that may run at once (the host's lanes).
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
    /// The first desired shape, if known at start (offered after the journal's).
    pub initial_shape: Option<ClusterShape>,
    /// How often the remote telemetry snapshot is refreshed while things change.
    pub snapshot_refresh: Duration,
    /// Whether a bootstrap stream's join report counts as a live join (a
    /// cluster with no swarm endpoint, e.g. over the fake provider).
    pub stream_joins: bool,
    /// How long a new resource may stay invisible to the provider's listing.
    pub visibility_window: Duration,
    /// Interval of the leak sweeps.
    pub sweep_interval: Duration,
    /// How long an agent of an earlier daemon has at least to rejoin this one.
    pub rejoin_window: Duration,
}

impl ClusterConfig {
    /// Defaults for `run_id`.
    pub fn new(run_id: RunId) -> Self {
        let host = HostConfig::default();
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
            stream_joins: host.stream_joins,
            visibility_window: Duration::from_millis(host.visibility_window_ms),
            sweep_interval: Duration::from_millis(host.sweep_interval_ms),
            rejoin_window: Duration::from_millis(host.rejoin_window_ms),
        }
    }

    fn host(&self) -> HostConfig {
        HostConfig {
            lanes: u32::try_from(self.executors.max(1)).unwrap_or(u32::MAX),
            stream_joins: self.stream_joins,
            node_events: self.node_events,
            visibility_window_ms: u64::try_from(self.visibility_window.as_millis())
                .unwrap_or(u64::MAX),
            sweep_interval_ms: u64::try_from(self.sweep_interval.as_millis()).unwrap_or(u64::MAX),
            rejoin_window_ms: u64::try_from(self.rejoin_window.as_millis()).unwrap_or(u64::MAX),
        }
    }
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
    /// Whether the host reports convergence.
    pub converged: bool,
    /// Whether the host has adopted its inventory and has nothing left to collect or verify.
    pub settled: bool,
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
        RpcReplyPort<Result<DesiredUpdate, ApplyError>>,
    ),
    /// Preview the next pass, for the current shape or a proposed one.
    Plan(
        Option<ClusterShape>,
        RpcReplyPort<Result<PlanView, ApplyError>>,
    ),
    /// The cluster as it is now.
    Snapshot(RpcReplyPort<ClusterSnapshot>),
    /// The driver's full state, for tests and diagnostics.
    Inspect(RpcReplyPort<DriverView>),
    /// Subscribe to events.
    Subscribe(RpcReplyPort<Subscription>),
    /// Reply once converged on the current desired generation (or not at all
    /// if the cluster stops first: the port is dropped).
    WaitConverged(RpcReplyPort<Generation>),
    /// Shut the cluster down.
    Shutdown(ShutdownMode, RpcReplyPort<ShutdownReport>),
    /// An executor worker reported.
    Executor(ExecutorReport),
    /// An observer forwarded a bootstrap observation.
    Observed(BootstrapObservation),
    /// An agent presented `key` to join the swarm.
    AgentJoin(ResourceKey, RpcReplyPort<Result<(), JoinRefused>>),
    /// The agent of `key` disconnected.
    AgentGone(ResourceKey),
    /// An engine timer fired.
    Timer(TimerFired<TimerKey>),
    /// Drain the host's outputs.
    Drive,
}

impl From<TimerFired<TimerKey>> for DriverMsg {
    fn from(f: TimerFired<TimerKey>) -> Self {
        Self::Timer(f)
    }
}

impl From<ExecutorReport> for DriverMsg {
    fn from(r: ExecutorReport) -> Self {
        Self::Executor(r)
    }
}

impl TryFrom<DriverMsg> for ExecutorReport {
    type Error = DriverMsg;
    fn try_from(m: DriverMsg) -> Result<Self, DriverMsg> {
        match m {
            DriverMsg::Executor(r) => Ok(r),
            other => Err(other),
        }
    }
}

impl From<Observed> for DriverMsg {
    fn from(o: Observed) -> Self {
        Self::Observed(o.0)
    }
}

impl TryFrom<DriverMsg> for Observed {
    type Error = DriverMsg;
    fn try_from(m: DriverMsg) -> Result<Self, DriverMsg> {
        match m {
            DriverMsg::Observed(o) => Ok(Observed(o)),
            other => Err(other),
        }
    }
}

/// The driver's timers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimerKey {
    /// The host's next deadline.
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
    /// Where journal writes go; `None` keeps nothing (a cluster that is never resumed).
    pub journal: Option<Arc<dyn JournalStore>>,
    /// The journal to resume, if any.
    pub resume: Option<JournalImage>,
}

enum Waiting {
    Apply(RpcReplyPort<Result<DesiredUpdate, ApplyError>>),
    Converged(RpcReplyPort<Generation>),
    Shutdown(RpcReplyPort<ShutdownReport>),
}

/// The driver actor's state.
pub struct DriverState {
    config: ClusterConfig,
    host: Host<Driver>,
    clock: Clock,
    timers: Timers<TimerKey, DriverMsg>,
    armed: Option<Timestamp>,
    workers: Children,
    journal: Option<Arc<dyn JournalStore>>,
    /// The observer of each node's live session (a node has at most one).
    observers: BTreeMap<LogicalNodeId, (SessionId, ActorRef<crate::observer::Next>)>,
    observer_ids: BTreeMap<ActorId, LogicalNodeId>,
    waiting: BTreeMap<Ticket, Waiting>,
    next_ticket: u64,
    drive_queued: bool,
    events: broadcast::Sender<ClusterEvent>,
    publisher: Option<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>,
    snapshot_dirty: bool,
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
            journal,
            resume,
        } = args;
        let driver = Driver::new(config.run_id.clone(), config.reconciler.clone())?;
        let host = Host::new(driver, config.host(), resume)?;
        let clock = Clock::new();
        let mut workers = Children::new();
        for index in 0..config.executors.max(1) {
            let provider = provider.clone();
            let me = myself.get_derived::<ExecutorReport>();
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
            host,
            clock,
            timers,
            armed: None,
            workers,
            journal,
            observers: BTreeMap::new(),
            observer_ids: BTreeMap::new(),
            waiting: BTreeMap::new(),
            next_ticket: 0,
            drive_queued: false,
            events,
            publisher,
            snapshot_dirty: false,
            config,
        };
        if let Some(shape) = state.config.initial_shape.clone() {
            let ticket = state.ticket();
            let now = state.now();
            state.host.handle_apply(&shape, ticket, now)?;
        }
        state.queue_drive(&myself);
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
        let now = st.now();
        match msg {
            DriverMsg::Apply(shape, reply) => {
                let ticket = st.ticket();
                st.waiting.insert(ticket, Waiting::Apply(reply));
                let _ = st.host.handle_apply(&shape, ticket, now);
            }
            DriverMsg::Plan(shape, reply) => {
                let plan = st.host.plan(shape.as_ref(), now);
                let _ = reply.send(plan.map(PlanView::from));
            }
            DriverMsg::Snapshot(reply) => {
                let _ = reply.send(st.snapshot());
            }
            DriverMsg::Inspect(reply) => {
                let core = st.host.core();
                let _ = reply.send(DriverView {
                    now,
                    state: core.state().clone(),
                    desired: core.desired().clone(),
                    timer: core.poll_timeout(),
                    converged: st.host.is_converged(),
                    settled: st.host.settled(),
                    stats: core.stats(),
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
                let ticket = st.ticket();
                st.waiting.insert(ticket, Waiting::Converged(reply));
                st.host.handle_wait_converged(ticket);
            }
            DriverMsg::Shutdown(mode, reply) => {
                let ticket = st.ticket();
                st.waiting.insert(ticket, Waiting::Shutdown(reply));
                st.host.handle_shutdown(mode, ticket, now);
            }
            DriverMsg::Executor(report) => st.reported(&myself, report, now).await?,
            DriverMsg::Observed(obs) => {
                let _ = st.host.handle_bootstrap(obs, now)?;
            }
            DriverMsg::AgentJoin(key, reply) => {
                let _ = reply.send(st.host.handle_agent_joined(&key, now));
            }
            DriverMsg::AgentGone(key) => st.host.handle_agent_gone(&key, now),
            DriverMsg::Timer(fired) => {
                if !st.timers.accept(&fired) {
                    return Ok(());
                }
                match fired.key {
                    TimerKey::Requeue => {
                        st.armed = None;
                        if let Err(e) = st.host.handle_timeout(now) {
                            st.warn(e.to_string());
                        }
                    }
                    TimerKey::Tick => st.host.handle_tick(now),
                    TimerKey::Snapshot => st.refresh_snapshot(),
                }
            }
            DriverMsg::Drive => {
                st.drive_queued = false;
                return st.drive(&myself).await;
            }
        }
        st.queue_drive(&myself);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DriverMsg>,
        evt: SupervisionEvent,
        st: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        // Observers are not restarted: their stream is gone with them. A
        // StartBootstrap re-issued for the node adopts the session afresh;
        // otherwise the stall deadline covers the loss.
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
            let lane = label
                .strip_prefix("executor-")
                .and_then(|i| i.parse::<u32>().ok());
            if let Some(lane) = lane {
                st.host.handle_lane_lost(lane);
                st.queue_drive(&myself);
            }
        }
        Ok(())
    }
}

impl DriverState {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.clock.now_ms())
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    fn queue_drive(&mut self, myself: &ActorRef<DriverMsg>) {
        if !self.drive_queued {
            self.drive_queued = true;
            // Goes to the back of the mailbox: everything already waiting is
            // folded before the host's outputs are drained.
            let _ = myself.send_message(DriverMsg::Drive);
        }
    }

    /// Drains the host's outputs and routes them; re-arms the one timer.
    async fn drive(&mut self, myself: &ActorRef<DriverMsg>) -> Result<(), ActorProcessingErr> {
        let now = self.now();
        while let Some(out) = self.host.poll_output(now) {
            match out {
                Output::Persist(delta) => {
                    if let Some(journal) = &self.journal {
                        // Acting on intent that is not on record could double-create
                        // after a crash; a journal that fails stops the cluster.
                        journal
                            .commit(&delta)
                            .await
                            .map_err(|e| format!("the journal cannot be written: {e}"))?;
                    }
                    self.host.handle_persisted(delta.seq);
                }
                Output::Pass(pass) => {
                    for d in pass.dispatches {
                        let (node, op) = (d.key.node.clone(), d.op);
                        let lane = self.host.lane_of(d.op.attempt) as usize;
                        if !self.send_to_worker(lane, WorkerMsg::Execute(d)) {
                            let reason = "no executor could take it";
                            let _ = self.host.handle_submit_failed(&node, op, reason, now)?;
                        }
                    }
                    for node in &pass.transitioned {
                        self.drop_stale_observer(node);
                    }
                }
                Output::List => {
                    let run = self.config.run_id.clone();
                    if !self.send_to_worker(0, WorkerMsg::List(run)) {
                        let e = "no executor could list the provider's resources".to_owned();
                        self.host.handle_inventory(Err(e), now);
                    }
                }
                Output::Collect(c) => {
                    let lane = self.host.lane_of(c.key.attempt) as usize;
                    let owned = swactor_providers::OwnedResources {
                        lease: c.lease,
                        session: c.session,
                    };
                    if !self.send_to_worker(lane, WorkerMsg::Collect(c.key.clone(), owned)) {
                        let e = "no executor could take it".to_owned();
                        self.host.handle_collected(&c.key, Err(e), now);
                    }
                }
                Output::Folded(_) => {}
                Output::Reply(ticket, reply) => self.answer(ticket, reply),
                Output::Stop => {
                    self.publish_events();
                    self.refresh_snapshot();
                    // Whoever still waits learns the cluster is gone.
                    self.waiting.clear();
                    myself.stop(Some("shut down".to_owned()));
                    return Ok(());
                }
            }
        }
        self.publish_events();
        self.rearm(now);
        Ok(())
    }

    fn answer(&mut self, ticket: Ticket, reply: Reply) {
        match (self.waiting.remove(&ticket), reply) {
            (Some(Waiting::Apply(port)), Reply::Applied(outcome)) => {
                let _ = port.send(outcome);
            }
            (Some(Waiting::Converged(port)), Reply::Converged(g)) => {
                let _ = port.send(g);
            }
            (Some(Waiting::Shutdown(port)), Reply::Shutdown(report)) => {
                let _ = port.send(report);
            }
            // `Stopped`, or a ticket nobody waits on: dropping the port tells
            // the caller the cluster is gone.
            _ => {}
        }
    }

    async fn reported(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        report: ExecutorReport,
        now: Timestamp,
    ) -> Result<(), ActorProcessingErr> {
        match report {
            ExecutorReport::Finished(f) => self.finished(myself, f, now).await?,
            ExecutorReport::Listed(inventory) => {
                let listed = inventory.map(listing).map_err(|e| e.to_string());
                self.host.handle_inventory(listed, now);
            }
            ExecutorReport::Collected(key, outcome) => {
                self.host
                    .handle_collected(&key, outcome.map_err(|e| e.to_string()), now);
            }
        }
        Ok(())
    }

    async fn finished(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        f: Finished,
        now: Timestamp,
    ) -> Result<(), ActorProcessingErr> {
        let node = f.result.node.clone();
        let op = f.result.op;
        let started = match &f.result.outcome {
            OperationOutcome::BootstrapStarted { session } => Some(session.clone()),
            _ => None,
        };
        let outcome = describe(&f.result.outcome);
        let folded = self.host.handle_result(f.result, now)? == Folded::Applied;
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
                self.start_observer(myself, &node, op.attempt, session, events)
                    .await;
            }
            // A cancelled session's observer goes with it.
            self.drop_stale_observer(&node);
        }
        Ok(())
    }

    async fn start_observer(
        &mut self,
        myself: &ActorRef<DriverMsg>,
        node: &LogicalNodeId,
        attempt: swactor_provisioning::NodeAttemptId,
        session: SessionId,
        events: swactor_providers::BootstrapEvents,
    ) {
        // A node observes one session at a time; an adopted session gets a
        // fresh stream and the old reader is stopped.
        self.stop_observer(node);
        let args = ObserverArgs {
            driver: myself.get_derived::<Observed>(),
            node: node.clone(),
            attempt,
            session: session.clone(),
            events,
        };
        // Observers are started linked, without a restart budget: a dead
        // stream cannot be resumed.
        let cell: ActorCell = myself.get_cell();
        match BootstrapObserver::spawn_linked(None, BootstrapObserver, args, cell).await {
            Ok((actor, _)) => {
                self.observer_ids.insert(actor.get_id(), node.clone());
                self.observers.insert(node.clone(), (session, actor));
            }
            Err(e) => self.warn(format!("could not start an observer for {node}: {e}")),
        }
    }

    /// Stops `node`'s observer if its record no longer holds the observed
    /// session (the node was reaped or restarted, or the stream closed).
    fn drop_stale_observer(&mut self, node: &LogicalNodeId) {
        let live = self
            .host
            .core()
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

    fn stop_observer(&mut self, node: &LogicalNodeId) {
        if let Some((_, o)) = self.observers.remove(node) {
            self.observer_ids.remove(&o.get_id());
            o.kill();
        }
    }

    fn send_to_worker(&self, index: usize, msg: WorkerMsg) -> bool {
        self.workers
            .get::<WorkerMsg>(&worker_label(index))
            .is_some_and(|w| w.send_message(msg).is_ok())
    }

    fn rearm(&mut self, now: Timestamp) {
        let next = self.host.poll_timeout();
        if next != self.armed {
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
            self.armed = next;
        }
        if self.snapshot_dirty && !self.timers.is_armed(&TimerKey::Snapshot) {
            self.timers
                .arm_after(TimerKey::Snapshot, self.config.snapshot_refresh);
        }
    }

    fn publish(&mut self, event: ClusterEvent) {
        if let Some(p) = &self.publisher {
            if let Err(e) = p.publish(&event) {
                tracing::warn!(%e, "telemetry event could not be published");
            }
            self.snapshot_dirty = true;
        }
        // No receivers is fine: nobody is watching.
        let _ = self.events.send(event);
    }

    fn warn(&mut self, message: String) {
        tracing::warn!("{message}");
        self.publish(ClusterEvent::Warning { message });
    }

    /// Turns the host's events into telemetry.
    fn publish_events(&mut self) {
        while let Some(event) = self.host.poll_event() {
            let event = match event {
                HostEvent::NodeChanged(node) => match self.summary(&node) {
                    Some(summary) => ClusterEvent::Node(summary),
                    None => ClusterEvent::Removed { node },
                },
                HostEvent::Warning(message) => {
                    self.warn(message);
                    continue;
                }
                HostEvent::ShapeAccepted { generation, nodes } => {
                    ClusterEvent::ShapeAccepted { generation, nodes }
                }
                HostEvent::Dispatched { node, op, effect } => {
                    ClusterEvent::Dispatched { node, op, effect }
                }
                HostEvent::Pass { number, stats } => ClusterEvent::Pass {
                    number,
                    nodes: stats.nodes,
                    transitions: stats.transitions,
                    dispatched: stats.dispatched,
                },
                HostEvent::Converged { generation, nodes } => {
                    self.refresh_snapshot();
                    ClusterEvent::Converged { generation, nodes }
                }
                HostEvent::Adopted {
                    adopted,
                    drifted,
                    orphans,
                    presumed_gone,
                    foreign: _,
                } => {
                    if !adopted.is_empty() || !orphans.is_empty() {
                        tracing::info!(
                            adopted = adopted.len(),
                            drifted = drifted.len(),
                            orphans = orphans.len(),
                            presumed_gone = presumed_gone.len(),
                            "adopted what an earlier daemon left"
                        );
                    }
                    ClusterEvent::Adopted {
                        adopted,
                        drifted,
                        orphans,
                        presumed_gone,
                    }
                }
                HostEvent::Swept { orphans } => ClusterEvent::Swept { orphans },
                HostEvent::Collected { key, error } => ClusterEvent::Collected { key, error },
                HostEvent::AgentJoined(key) => ClusterEvent::AgentJoined { key },
                HostEvent::AgentDisconnected { key, grace_until } => {
                    ClusterEvent::AgentDisconnected { key, grace_until }
                }
                HostEvent::TeardownStarted { generation } => {
                    ClusterEvent::TeardownStarted { generation }
                }
            };
            self.publish(event);
        }
    }

    fn summary(&self, node: &LogicalNodeId) -> Option<NodeSummary> {
        NodeSummary::of(node, self.host.core().state(), self.host.link(node))
    }

    fn snapshot(&self) -> ClusterSnapshot {
        let core = self.host.core();
        let state = core.state();
        ClusterSnapshot {
            run_id: state.run_id.to_string(),
            generation: core.desired().generation,
            observed_generation: state.observed_generation,
            converged: self.host.is_converged(),
            adopted: self.host.adopted(),
            desired_nodes: core.desired().node_count(),
            nodes: state
                .nodes
                .keys()
                .filter_map(|id| self.summary(id))
                .collect(),
            orphans: self.host.collecting().count(),
            shutting_down: self.host.shutting_down(),
            stats: core.stats(),
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
}

/// A provider's inventory as the host takes it.
fn listing(inventory: Inventory) -> Vec<Listed> {
    inventory
        .into_iter()
        .map(|(key, owned)| Listed {
            key,
            lease: owned.lease,
            session: owned.session,
        })
        .collect()
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
