//! The driver actor: hosts the cluster [`Host`] and routes what it decides.
//!
//! Every decision is the host's (`swactor_provisioning::Host`): this actor
//! decodes a message, hands it to the host, and routes the host's outputs —
//! journal writes to the [`JournalStore`](crate::JournalStore), dispatches to
//! executor workers, replies to the callers who wait for them, events to
//! subscribers — then arms ONE engine timer at the host's next deadline.
//!
//! - **Batching.** An input is folded at once, but the outputs are drained by
//!   one [`DriverMsg::Drive`] at the back of the mailbox (at most one queued),
//!   so a burst of N results costs one pass.
//! - **Durable before acting.** A journal write is awaited before the next
//!   output is taken: an attempt's first effect never goes out before its
//!   record is durable, and an apply is acknowledged only once it is.

use crate::executor::{BATCH_MAX, ExecutorReport, ExecutorWorker, Finished, WorkerArgs, WorkerMsg};
use crate::flight::FlightFrames;
use crate::journal::JournalStore;
use crate::msg::{ClusterMsg, DriverArgs, DriverMsg, DriverView, SwarmMsg, TimerKey};
use crate::observer::{Observations, Observed, Observer, ObserverTag, Observers, observers};
use crate::telemetry::{self, Telemetry, snapshot};
use crate::{ClusterConfig, ClusterEvent, PlanView};
use std::collections::BTreeMap;
use std::sync::Arc;
use swactor_engine::flight::FlightLife;
use swactor_engine::ractor::{
    Actor, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent,
};
use swactor_engine::{ChildEvent, ChildSpec, Children, Clock, Starvation, Timers};
use swactor_providers::{BootstrapEvents, Inventory, OwnedResources};
use swactor_provisioning::flight::{self, Flight};
use swactor_provisioning::{
    ApplyError, BootstrapEvent, BootstrapObservation, DesiredUpdate, Dispatch, Driver, Folded,
    Generation, Host, JournalDelta, Leadership, Listed, LogicalNodeId, NodeAttemptId, NodeTable,
    OperationOutcome, Output, Pass, PauseError, ReplaceError, Reply, SessionId, ShutdownReport,
    Ticket, Timestamp,
};

/// A caller waiting for the host's [`Reply`] to its ticket.
enum Waiting {
    Apply(RpcReplyPort<Result<DesiredUpdate, ApplyError>>),
    Converged(RpcReplyPort<Generation>),
    Adopted(RpcReplyPort<()>),
    Shutdown(RpcReplyPort<ShutdownReport>),
    Pause(RpcReplyPort<Result<bool, PauseError>>),
    Replace(RpcReplyPort<Result<NodeAttemptId, ReplaceError>>),
}

/// The driver actor's state.
pub struct DriverState {
    config: ClusterConfig,
    host: Flight<Driver>,
    /// This life's recording, when the config records.
    flight: Option<FlightLife<FlightFrames>>,
    /// Frames the host's recorder had dropped at the last flush.
    flight_dropped: u64,
    clock: Clock,
    timers: Timers<TimerKey, DriverMsg>,
    armed: Option<Timestamp>,
    workers: Children,
    journal: Option<Arc<dyn JournalStore>>,
    /// The observer of each node's live session (a node has at most one);
    /// dropping one stops it.
    observers: NodeTable<Following>,
    /// The number of the next observer.
    next_observer: u64,
    /// The mux that follows every session and reports to this actor.
    mux: Observers,
    waiting: BTreeMap<Ticket, Waiting>,
    next_ticket: u64,
    drive_queued: bool,
    telemetry: Telemetry,
    /// Messages handled (see [`DriverView::messages`]).
    messages: u64,
    /// The starved total last told to the host.
    starved_seen_ms: u64,
    /// The sequence number of the last delta committed to the journal.
    last_persisted: Option<u64>,
    /// The change number of the leadership bound last told to the host.
    lead_seen: Option<u64>,
}

/// A node's followed session: what its events are folded as, and the
/// mux's handle on its stream (dropping it stops following).
struct Following {
    number: u64,
    attempt: NodeAttemptId,
    session: SessionId,
    _observer: Observer,
}

/// The most bytes of frames the host buffers between two flushes to the
/// recording (one message's worth; a larger one is dropped and cuts the
/// recording, as a writer that falls behind does).
const FLIGHT_BUFFER_MAX: usize = 64 << 20;

/// What the host's frames may hold in memory before the driver hands them
/// to the writer within a message (a few thousand results): small enough
/// that a chunk is reused rather than grown, and that the writer starts
/// on a long message's frames before it ends.
pub(crate) const FLIGHT_FLUSH_AT: usize = 64 << 10;

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
        let clock = Clock::new();
        let (host, flight) = match &config.flight {
            Some(recorder) => {
                let wall_ms = clock.wall_ms();
                let now = Timestamp::from_millis(clock.now_ms());
                let (mut host, header) = flight::record(
                    driver,
                    config.host(),
                    resume,
                    config.build.clone(),
                    wall_ms,
                    now,
                )?;
                // What one message records stays within the writer's queue.
                host.set_buffer_max(FLIGHT_BUFFER_MAX);
                (host, Some(recorder.begin(header, wall_ms)))
            }
            None => (
                Flight::unrecorded(Host::new(driver, config.host(), resume)?),
                None,
            ),
        };
        let mut workers = Children::new();
        for index in 0..config.executors.max(1) {
            let (provider, me) = (provider.clone(), myself.get_derived::<ExecutorReport>());
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
        // Shared with the drivers before this one under the same supervisor;
        // this one starts with no nodes.
        let tally = config.tally.clone().unwrap_or_default();
        tally.restart();
        let mut state = DriverState {
            host,
            flight,
            flight_dropped: 0,
            clock,
            timers,
            armed: None,
            last_persisted: None,
            lead_seen: None,
            workers,
            journal,
            observers: NodeTable::new(),
            mux: observers(myself.get_derived::<Observations>()),
            next_observer: 0,
            waiting: BTreeMap::new(),
            next_ticket: 0,
            drive_queued: false,
            messages: 0,
            starved_seen_ms: config.starvation.as_ref().map_or(0, Starvation::total_ms),
            telemetry: Telemetry::new(config.event_buffer_len, publisher, tally),
            config,
        };
        let now = state.now();
        state.tell_leadership(now);
        if let Some(shape) = state.config.initial_shape.clone() {
            let (ticket, now) = (state.ticket(), state.now());
            state.host.handle_wall_clock(state.clock.wall_ms(), now);
            state.host.handle_apply(&shape, ticket, now)?;
        }
        state.queue_drive(&myself);
        state.flush_flight();
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DriverMsg>,
        state: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        state.timers.cancel_all();
        state.workers.stop_all(None);
        // Dropping the observers stops them.
        state.observers.clear();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DriverMsg>,
        msg: DriverMsg,
        st: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        // Says it is busy while it handles a message, for whoever would
        // rather read the last glance than wait (see `crate::glance`).
        let _busy = st.telemetry.tally.busy();
        let now = st.now();
        st.messages += 1;
        // Time the daemon measured itself starved since the last message is
        // told to the host before anything it may have delayed.
        st.tell_starved(now);
        st.tell_leadership(now);
        match msg {
            DriverMsg::Cluster(msg) => st.public(msg, now),
            DriverMsg::Swarm(msg) => st.swarm(msg, now),
            DriverMsg::Inspect(reply) => {
                let _ = reply.send(st.view(now));
            }
            DriverMsg::Executor(report) => st.reported(report, now)?,
            DriverMsg::Observed(batch) => st.observed(batch, now)?,
            DriverMsg::Timer(fired) => {
                if !st.timers.accept(&fired) {
                    return Ok(());
                }
                st.timer(fired.key, now);
            }
            DriverMsg::Drive => {
                st.drive_queued = false;
                let driven = st.drive(&myself).await;
                st.flush_flight();
                return driven;
            }
            #[cfg(debug_assertions)]
            DriverMsg::InjectPanic => panic!("a test asked the driver actor to panic"),
        }
        st.queue_drive(&myself);
        st.flush_flight();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DriverMsg>,
        evt: SupervisionEvent,
        st: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        let failed = matches!(evt, SupervisionEvent::ActorFailed(..));
        // An error here is the escalation: the restart budget is spent.
        let outcome = st.workers.handle_event(&myself.get_cell(), &evt).await?;
        if let (true, ChildEvent::Restarted { label, .. }) = (failed, &outcome)
            && let Some(lane) = label.strip_prefix("executor-").and_then(|i| i.parse().ok())
        {
            st.host.handle_lane_lost(lane);
            st.queue_drive(&myself);
            st.flush_flight();
        }
        Ok(())
    }
}

impl DriverState {
    /// Hands what the host recorded since the last call to this life's
    /// recording (it never waits: see `swactor_engine::flight`).
    fn flush_flight(&mut self) {
        if let Some(life) = &self.flight {
            let frames = self.host.take_frames(life.spare().0);
            life.append(FlightFrames(frames));
            let dropped = self.host.stats().dropped;
            life.dropped_upstream(dropped.saturating_sub(self.flight_dropped));
            self.flight_dropped = dropped;
        }
    }

    /// Hands the frames over within a message once they hold
    /// [`FLIGHT_FLUSH_AT`]: a message can bring a hundred thousand results,
    /// and the writer encodes them while the rest come in.
    #[inline]
    fn flush_flight_if_big(&mut self) {
        if self.host.held() >= FLIGHT_FLUSH_AT {
            self.flush_flight();
        }
    }

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

    fn public(&mut self, msg: ClusterMsg, now: Timestamp) {
        match msg {
            ClusterMsg::Apply(shape, reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Apply(reply));
                // An apply that sets a lifetime counts from its wall clock.
                self.host.handle_wall_clock(self.clock.wall_ms(), now);
                let _ = self.host.handle_apply(&shape, ticket, now);
            }
            ClusterMsg::ApplyNext(shape, reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Apply(reply));
                self.host.handle_wall_clock(self.clock.wall_ms(), now);
                let _ = self.host.handle_apply_next(&shape, ticket, now);
            }
            ClusterMsg::Lifetime(check, reply) => {
                let status = self
                    .host
                    .handle_lifetime(check.wall_ms, check.jobs_running, now);
                let _ = reply.send(crate::msg::LifetimeView {
                    status,
                    shutting_down: self.host.shutting_down().is_some(),
                });
            }
            ClusterMsg::Plan(shape, reply) => {
                let plan = self.host.plan(shape.as_ref(), now);
                let _ = reply.send(plan.map(PlanView::from));
            }
            ClusterMsg::Snapshot(reply) => {
                let _ = reply.send(snapshot(&self.host, now));
            }
            ClusterMsg::Glance(reply) => {
                // What was folded since the last drain is counted first.
                self.telemetry.drain(&mut self.host, now);
                let counted = self.config.node_events;
                let tally = &self.telemetry.tally;
                let glance = crate::glance::glance(&self.host, tally, counted, now);
                if counted {
                    tally.publish(glance.clone());
                }
                let _ = reply.send(glance);
            }
            ClusterMsg::Desired(reply) => {
                let _ = reply.send(crate::msg::DesiredView {
                    desired: self.host.core().desired().clone(),
                    shape: self.host.journal_meta().shape.clone(),
                });
            }
            ClusterMsg::Attempts(nodes, reply) => {
                let state = self.host.core().state();
                let attempts = nodes
                    .iter()
                    .map(|n| state.nodes.get(n).map(|n| n.attempt))
                    .collect();
                let _ = reply.send(attempts);
            }
            ClusterMsg::Describe(node, reply) => {
                let _ = reply.send(telemetry::describe(&self.host, &node, now));
            }
            ClusterMsg::Subscribe(reply) => {
                let _ = reply.send(self.telemetry.subscribe(&self.host, now));
            }
            ClusterMsg::Spent(spent, reply) => {
                let spent_micros = self.host.handle_spent(spent);
                let _ = reply.send(crate::msg::SpentView {
                    spent_micros,
                    budget: self
                        .host
                        .journal_meta()
                        .shape
                        .as_ref()
                        .and_then(|s| s.budget),
                    paused: self.host.is_paused(),
                    shutting_down: self.host.shutting_down().is_some(),
                });
            }
            ClusterMsg::WaitConverged(reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Converged(reply));
                self.host.handle_wait_converged(ticket);
            }
            ClusterMsg::WaitAdopted(reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Adopted(reply));
                self.host.handle_wait_adopted(ticket);
            }
            ClusterMsg::Shutdown(mode, reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Shutdown(reply));
                self.host.handle_shutdown(mode, ticket, now);
            }
            ClusterMsg::Pause(paused, reply) => {
                let ticket = self.ticket();
                self.waiting.insert(ticket, Waiting::Pause(reply));
                let _ = self.host.handle_pause(paused, ticket, now);
            }
            ClusterMsg::Replace(node, reply) => {
                // Answered at once when refused; once durable when taken.
                let ticket = self.ticket();
                match self.host.handle_replace(&node, ticket, now) {
                    Ok(_) => {
                        self.waiting.insert(ticket, Waiting::Replace(reply));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            // Read on every message, this one included.
            ClusterMsg::Leadership => {}
        }
    }

    /// Tells the host the leadership bound, when it moved since it was
    /// last told (a daemon alone on its journal has none: it always leads).
    fn tell_leadership(&mut self, now: Timestamp) {
        let Some(lead) = &self.config.lead else {
            return;
        };
        let changes = lead.changes();
        if self.lead_seen == Some(changes) {
            return;
        }
        self.lead_seen = Some(changes);
        // Not leading yet, or any more: held until the epoch, so not at all.
        let until = lead.until().map_or(0, |at| self.clock.to_ms(at));
        self.host
            .handle_leadership(Leadership::Until(Timestamp::from_millis(until)), now);
    }

    /// Tells the host how long the daemon was starved since it was last told.
    fn tell_starved(&mut self, now: Timestamp) {
        if let Some(starvation) = &self.config.starvation {
            let total = starvation.total_ms();
            if total > self.starved_seen_ms {
                let starved = total - self.starved_seen_ms;
                self.starved_seen_ms = total;
                self.host.handle_starved(starved, now);
            }
        }
    }

    /// Folds what the swarm says of an agent, answering a join or a check.
    fn swarm(&mut self, msg: SwarmMsg, now: Timestamp) {
        match msg {
            SwarmMsg::Join(key, reply) => {
                let _ = reply.send(self.host.handle_agent_joined(&key, now));
            }
            SwarmMsg::Check(key, reply) => {
                let _ = reply.send(self.host.join_verdict(&key).map(|_| ()));
            }
            SwarmMsg::Heard(keys, reply) => {
                let refused = keys
                    .into_iter()
                    .filter_map(|key| match self.host.handle_agent_joined(&key, now) {
                        Ok(_) => None,
                        Err(refusal) => Some((key, refusal)),
                    })
                    .collect();
                let _ = reply.send(refused);
            }
            SwarmMsg::Gone(key, silent) => {
                let silent_ms = u64::try_from(silent.as_millis()).unwrap_or(u64::MAX);
                self.host.handle_agent_gone(&key, silent_ms, now);
            }
        }
    }

    /// The driver as [`DriverMsg::Inspect`] shows it.
    fn view(&self, now: Timestamp) -> DriverView {
        let core = self.host.core();
        DriverView {
            now,
            state: core.state().clone(),
            desired: core.desired().clone(),
            timer: core.poll_timeout(),
            converged: self.host.is_converged(),
            settled: self.host.settled(),
            agents_away: self.host.agents_away(),
            stats: core.stats(),
            shape: self.host.journal_meta().shape.clone(),
            messages: self.messages,
            deaf: self.host.last_deaf_gap(),
        }
    }

    /// Folds the sessions' observations, skipping those of stopped observers.
    fn observed(&mut self, batch: Vec<Observed>, now: Timestamp) -> Result<(), ActorProcessingErr> {
        // In slot order, and within a slot in the order received (a
        // session's own order stays): a large batch then walks the
        // nodes' memory front to back instead of in the order the
        // sessions happened to report. The sort moves small (slot,
        // position) pairs; each observation is moved once.
        let mut order: Vec<(LogicalNodeId, usize)> =
            batch.iter().enumerate().map(|(i, o)| (o.node, i)).collect();
        order.sort();
        let mut batch: Vec<Option<Observed>> = batch.into_iter().map(Some).collect();
        for (_, i) in order {
            let Some(Observed {
                node,
                observer,
                event,
            }) = batch[i].take()
            else {
                continue;
            };
            // What an observer read before it was stopped is not
            // wanted: its session is no longer the node's (or is
            // followed afresh, from the start of its log).
            let Some(f) = self.observers.get(&node).filter(|f| f.number == observer) else {
                continue;
            };
            let obs = BootstrapObservation {
                node,
                attempt: f.attempt,
                session: f.session.clone(),
                event,
            };
            if obs.event == BootstrapEvent::Closed {
                // The stream ended and its observer with it.
                self.observers.remove(&node);
            }
            let _ = self.host.handle_bootstrap(obs, now)?;
            self.flush_flight_if_big();
        }
        Ok(())
    }

    /// Acts on an accepted timer: the host's deadline, its tick, or a snapshot refresh.
    fn timer(&mut self, key: TimerKey, now: Timestamp) {
        match key {
            TimerKey::Requeue => {
                self.armed = None;
                if let Err(e) = self.host.handle_timeout(now) {
                    self.telemetry.warn(e.to_string());
                }
            }
            TimerKey::Tick => self.host.handle_tick(now),
            TimerKey::Snapshot => self.telemetry.refresh(&self.host, now),
        }
    }

    /// Drains the host's outputs and routes them; re-arms the one timer.
    async fn drive(&mut self, myself: &ActorRef<DriverMsg>) -> Result<(), ActorProcessingErr> {
        let now = self.now();
        loop {
            let started = self.clock.now();
            let Some(out) = self.host.poll_output(now) else {
                break;
            };
            if let Output::Pass(pass) = &out {
                let took = self.clock.now().saturating_duration_since(started);
                self.telemetry.pass_took(pass.number, took);
            }
            match out {
                Output::Persist(delta) => self.persist(delta).await?,
                Output::Pass(pass) => self.dispatch_pass(pass, now)?,
                Output::List => {
                    let run = self.config.run_id.clone();
                    if !self.send_to_worker(0, WorkerMsg::List(run)) {
                        let e = "no executor could list the provider's resources".to_owned();
                        self.host.handle_inventory(Err(e), now);
                    }
                }
                Output::Collect(c) => {
                    let lane = self.host.lane_of(c.key.attempt) as usize;
                    let owned = OwnedResources {
                        lease: c.lease,
                        session: c.session,
                    };
                    if !self.send_to_worker(lane, WorkerMsg::Collect(c.key.clone(), owned)) {
                        let e = "no executor could take it".to_owned();
                        self.host.handle_collected(&c.key, Err(e), now);
                    }
                }
                Output::Probe { key, lease } => {
                    let lane = self.host.lane_of(key.attempt) as usize;
                    if !self.send_to_worker(lane, WorkerMsg::Probe(key.clone(), lease)) {
                        let e = "no executor could ask the provider".to_owned();
                        self.host.handle_probed(&key, Err(e), now);
                    }
                }
                Output::Folded(_) => {}
                Output::Reply(ticket, reply) => {
                    // What happened before the answer is published before
                    // it: a teardown's report comes after every node's
                    // `Removed`, so whoever follows the events and waits
                    // for the report has seen them all by then.
                    self.telemetry.drain(&mut self.host, now);
                    self.answer(ticket, reply);
                }
                Output::Stop => {
                    self.telemetry.drain(&mut self.host, now);
                    self.telemetry.refresh(&self.host, now);
                    // Whoever still waits learns the cluster is gone.
                    self.waiting.clear();
                    myself.stop(Some("shut down".to_owned()));
                    return Ok(());
                }
            }
        }
        self.telemetry.drain(&mut self.host, now);
        self.rearm(now);
        self.publish_glance(now);
        Ok(())
    }

    /// Leaves the glance of the cluster after this step where its handles
    /// read it without a message (see [`crate::glance`]); not while per-node
    /// events are off, where a glance counts every node.
    fn publish_glance(&self, now: Timestamp) {
        if self.config.node_events {
            let tally = &self.telemetry.tally;
            tally.publish(crate::glance::glance(&self.host, tally, true, now));
        }
    }

    /// Commits `delta` to the journal, if there is one, and tells the host it is durable.
    async fn persist(&mut self, delta: JournalDelta) -> Result<(), ActorProcessingErr> {
        if let Some(journal) = &self.journal {
            // Acting on intent that is not on record could double-create
            // after a crash: a journal that fails stops the cluster.
            journal
                .commit(&delta)
                .await
                .map_err(|e| swactor_engine::error_chain(&e))?;
        }
        self.host.handle_persisted(delta.seq);
        debug_assert!(
            self.last_persisted.is_none_or(|last| delta.seq > last),
            "journal deltas are committed in sequence, each once"
        );
        self.last_persisted = Some(delta.seq);
        Ok(())
    }

    /// Sends a pass's operations to their workers, fails those none takes, drops stale observers.
    fn dispatch_pass(&mut self, pass: Pass, now: Timestamp) -> Result<(), ActorProcessingErr> {
        // A pass's operations for a worker go in the pass's
        // order, in messages of at most `BATCH_MAX`.
        let host = &self.host;
        let mut batches = Vec::new();
        into_batches(
            pass.dispatches,
            |d| host.lane_of(d.op.attempt) as usize,
            BATCH_MAX,
            |lane, batch| batches.push((lane, batch)),
        );
        for (lane, batch) in batches {
            if let Err(batch) = self.send_batch(lane, batch) {
                let reason = "no executor could take it";
                for d in batch {
                    let _ = self
                        .host
                        .handle_submit_failed(&d.key.node, d.op, reason, now)?;
                }
            }
        }
        for node in &pass.transitioned {
            self.drop_stale_observer(node);
        }
        Ok(())
    }

    fn answer(&mut self, ticket: Ticket, reply: Reply) {
        if let Reply::Applied(Ok(DesiredUpdate::Accepted(_))) = &reply {
            // Room for every slot's observer in one allocation, as the host
            // makes for its own tables.
            let mut streams = 0usize;
            for g in &self.host.core().desired().groups {
                self.observers.reserve(&g.id, g.count);
                // As much as the map reserves (dense slots only).
                streams += g.count.min(swactor_provisioning::DENSE_INDEX_MAX) as usize;
            }
            self.mux.reserve(streams);
        }
        match (self.waiting.remove(&ticket), reply) {
            (Some(Waiting::Apply(port)), Reply::Applied(outcome)) => {
                let _ = port.send(outcome);
            }
            (Some(Waiting::Converged(port)), Reply::Converged(g)) => {
                let _ = port.send(g);
            }
            (Some(Waiting::Adopted(port)), Reply::Adopted) => {
                let _ = port.send(());
            }
            (Some(Waiting::Shutdown(port)), Reply::Shutdown(report)) => {
                let _ = port.send(report);
            }
            (Some(Waiting::Pause(port)), Reply::Paused(outcome)) => {
                let _ = port.send(outcome);
            }
            (Some(Waiting::Replace(port)), Reply::Replaced(attempt)) => {
                let _ = port.send(Ok(attempt));
            }
            // `Stopped`, or a ticket nobody waits on: dropping the port tells
            // the caller the cluster is gone.
            _ => {}
        }
    }

    fn reported(
        &mut self,
        report: ExecutorReport,
        now: Timestamp,
    ) -> Result<(), ActorProcessingErr> {
        match report {
            ExecutorReport::Finished(batch) => {
                for f in batch {
                    self.finished(f, now)?;
                    self.flush_flight_if_big();
                }
            }
            ExecutorReport::Listed(inventory) => {
                let listed = inventory.map(listing).map_err(|e| e.to_string());
                self.host.handle_inventory(listed, now);
            }
            ExecutorReport::Collected(key, outcome) => {
                self.host
                    .handle_collected(&key, outcome.map_err(|e| e.to_string()), now);
            }
            ExecutorReport::Probed(key, paused) => {
                self.host
                    .handle_probed(&key, paused.map_err(|e| e.to_string()), now);
            }
        }
        Ok(())
    }

    fn finished(&mut self, f: Finished, now: Timestamp) -> Result<(), ActorProcessingErr> {
        let (node, op) = (f.result.node, f.result.op);
        let started = match &f.result.outcome {
            OperationOutcome::BootstrapStarted { session } => Some(session.clone()),
            _ => None,
        };
        // Described only for subscribers who asked for per-node events.
        let outcome = self.config.node_events.then(|| describe(&f.result.outcome));
        let folded = self.host.handle_result(f.result, now)? == Folded::Applied;
        if let Some(outcome) = outcome {
            let event = ClusterEvent::Finished {
                node,
                op,
                outcome,
                folded,
            };
            self.telemetry.publish(event);
        }
        if folded {
            if let (Some(session), Some(events)) = (started, f.events) {
                self.start_observer(&node, op.attempt, session, events);
            }
            // A cancelled session's observer goes with it.
            self.drop_stale_observer(&node);
        }
        Ok(())
    }

    fn start_observer(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        session: SessionId,
        events: BootstrapEvents,
    ) {
        // A node observes one session at a time; an adopted session gets a
        // fresh stream and the old reader is stopped.
        self.stop_observer(node);
        let tag = ObserverTag {
            node: *node,
            number: self.next_observer,
        };
        // Not restarted if it ends: a dead stream cannot be resumed. A
        // StartBootstrap re-issued for the node adopts the session afresh;
        // otherwise the stall deadline covers the loss.
        let observer = self.mux.follow(tag, events);
        let following = Following {
            number: self.next_observer,
            attempt,
            session,
            _observer: observer,
        };
        self.observers.insert(*node, following);
        self.next_observer += 1;
    }

    /// Stops `node`'s observer if its record no longer holds the observed
    /// session (the node was reaped or restarted, or the stream closed).
    fn drop_stale_observer(&mut self, node: &LogicalNodeId) {
        let nodes = &self.host.core().state().nodes;
        let live = nodes.get(node).and_then(|n| n.record.session.as_ref());
        if self
            .observers
            .get(node)
            .is_some_and(|f| Some(&f.session) != live)
        {
            self.stop_observer(node);
        }
    }

    fn stop_observer(&mut self, node: &LogicalNodeId) {
        // Dropping it stops it.
        self.observers.remove(node);
    }

    /// Hands `batch` to worker `index`; gives it back if the worker cannot take it.
    fn send_batch(&self, index: usize, batch: Vec<Dispatch>) -> Result<(), Vec<Dispatch>> {
        let Some(worker) = self.workers.get::<WorkerMsg>(&worker_label(index)) else {
            return Err(batch);
        };
        match worker.send_message(WorkerMsg::Execute(batch)) {
            Ok(()) => Ok(()),
            Err(MessagingErr::SendErr(WorkerMsg::Execute(batch))) => Err(batch),
            // The message is lost without coming back (ractor gives it back
            // whenever a live worker's mailbox refuses it): the operations
            // stay pending until their stored deadlines fold them as
            // ambiguous, and the reconciler re-issues them.
            Err(e) => {
                tracing::warn!(
                    worker = index,
                    "a batch of operations was not delivered: {e}"
                );
                Ok(())
            }
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
                    let at = self.clock.at_ms(at.max(now).as_millis());
                    self.timers.arm_at(TimerKey::Requeue, at);
                }
                None => {
                    self.timers.cancel(&TimerKey::Requeue);
                }
            }
            self.armed = next;
        }
        debug_assert_eq!(
            self.armed,
            self.host.poll_timeout(),
            "the one engine timer is armed at the host's earliest deadline"
        );
        if self.telemetry.dirty && !self.timers.is_armed(&TimerKey::Snapshot) {
            let every = self.config.snapshot_refresh;
            self.timers.arm_after(TimerKey::Snapshot, every);
        }
    }
}

/// A provider's inventory as the host takes it.
fn listing(inventory: Inventory) -> Vec<Listed> {
    let entry = |(key, owned): (_, OwnedResources)| Listed {
        key,
        lease: owned.lease,
        session: owned.session,
    };
    inventory.into_iter().map(entry).collect()
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
        OperationOutcome::BootstrapGivenUp { reason } => format!("bootstrap given up: {reason}"),
        OperationOutcome::LeaseGivenUp { reason } => format!("lease given up: {reason}"),
    }
}

/// Hands `items` to `batch` in batches of at most `max`, each of one lane
/// (`lane_of`) and in the order the items came, each made at its final
/// size (how many each lane has is counted first) and each item moved once.
fn into_batches<T>(
    items: Vec<T>,
    lane_of: impl Fn(&T) -> usize,
    max: usize,
    mut batch: impl FnMut(usize, Vec<T>),
) {
    let max = max.max(1);
    let mut left: Vec<usize> = Vec::new();
    for item in &items {
        let lane = lane_of(item);
        if left.len() <= lane {
            left.resize(lane + 1, 0);
        }
        left[lane] += 1;
    }
    // Each lane's batch being filled, and the size it is made for.
    let mut open: Vec<(Vec<T>, usize)> = left.iter().map(|_| (Vec::new(), 0)).collect();
    for item in items {
        let lane = lane_of(&item);
        let (b, size) = &mut open[lane];
        if b.is_empty() {
            *size = left[lane].min(max);
            *b = Vec::with_capacity(*size);
        }
        b.push(item);
        left[lane] -= 1;
        if b.len() == *size {
            debug_assert!(
                b.len() <= max,
                "a batch never exceeds the most a message carries"
            );
            batch(lane, std::mem::take(b));
        }
    }
    // Every batch was sized to what its lane had left, so none is left
    // half-filled: no operation is held back from its worker.
    debug_assert!(
        open.iter().all(|(b, _)| b.is_empty()),
        "every operation of a pass is sent in the pass"
    );
    debug_assert!(left.iter().all(|&n| n == 0), "every item was counted once");
}

#[cfg(test)]
mod tests {
    use super::into_batches;

    #[test]
    fn batches_keep_each_lanes_order_and_are_no_larger_than_asked() {
        for n in [0u32, 1, 1023, 1024, 1025, 5000] {
            for lanes in [1u32, 3, 8] {
                let mut got: Vec<(usize, Vec<u32>)> = Vec::new();
                let lane_of = |i: &u32| ((i * 7 + i / 5) % lanes) as usize;
                into_batches((0..n).collect(), lane_of, 1024, |lane, b| {
                    got.push((lane, b));
                });
                assert!(got.iter().all(|(_, b)| !b.is_empty() && b.len() <= 1024));
                assert!(
                    got.iter().all(|(_, b)| b.capacity() == b.len()),
                    "made at size"
                );
                for lane in 0..lanes as usize {
                    let joined: Vec<u32> = got
                        .iter()
                        .filter(|(l, _)| *l == lane)
                        .flat_map(|(_, b)| b.iter().copied())
                        .collect();
                    let want: Vec<u32> = (0..n).filter(|i| lane_of(i) == lane).collect();
                    assert_eq!(joined, want, "{n} items, lane {lane} of {lanes}");
                    let count = want.len().div_ceil(1024);
                    assert_eq!(got.iter().filter(|(l, _)| *l == lane).count(), count);
                }
            }
        }
    }
}
