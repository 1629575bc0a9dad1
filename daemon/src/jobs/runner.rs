//! The actors that drive jobs, under the daemon.
//!
//! ```text
//! JobsActor                    one per daemon; starts job actors, and records
//!  │                           the runs of one that failed as failed
//!  └── JobActor  job-N         owns job-N's record (the only writer of it to
//!       │                      jobs.redb) and its timeout, an engine timer
//!       └── RunActor (N, node) one per run: ships, starts, follows, collects;
//!            │                 the reattach wait is an engine timer
//!            └── Forwarder     the agent's log and exit, read off the QUIC
//!                              stream and delivered as messages
//! ```
//!
//! The actors are thin: what a run does next is decided by
//! [`RunMachine`](super::machine::RunMachine), and a run actor only performs
//! the actions it is given, in order. Each [`Action::Record`] is a call to
//! the job actor, which writes the record and answers once it is durable;
//! the run actor awaits that answer before the next action, so every state
//! change is in `jobs.redb` before the effect it licenses. Requests to an
//! agent are single bounded awaits ([`REQUEST_WAIT`]); a transfer (the agent
//! fetching chunks from the blob provider, under a [`Grant`] for its key)
//! is followed one answer per message, so a stop is heard between chunks; a
//! log stream is read by a [`Forwarder`] with at most
//! [`LOG_PIECES_IN_FLIGHT`] pieces in the mailbox at once. Waiting for a link is a message from the link registry
//! ([`super::service::Links`]) or the end of the reattach timer; nothing
//! here spawns a task, sleeps or polls.
//!
//! # Supervision
//! A run actor that fails (an error or a panic) becomes a `failed` run in
//! the journal; its agent is asked to kill the run's process group. A job
//! actor that fails takes its run actors with it, and the supervisor records
//! its unfinished runs as `failed` the same way. The daemon goes on either way.
//!
//! Over 1,000 lines in one file because a run actor's handlers mirror the run
//! machine's actions one for one, and its job actor is the only writer of
//! the records they change; the decisions themselves are in `swactor-jobs`.

use super::blobs::Grant;
use super::machine::{Action, Change, Event, Outcome, RunFacts, RunMachine, Stop, timeout_left};
use super::service::{
    ACTOR_CALL_WAIT, JobEvent, JobRecord, JobState, OutputFile, RunRecord, Shared, Workspace,
    unix_now_ms,
};
use super::{FromAgent, JOBS_FRAME_LEN_MAX, LogRecord, Stream, ToAgent, hex, safe_relative};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::net::{recv_frame, send_frame};
use swactor_engine::ractor::rpc::CallResult;
use swactor_engine::ractor::{
    Actor, ActorId, ActorProcessingErr, ActorRef, DerivedActorRef, RpcReplyPort, SupervisionEvent,
};
use swactor_engine::{Forwarder, TimerFired, Timers, run_until};
use swactor_provisioning::LogicalNodeId;
use tokio::io::AsyncWriteExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The longest one request to an agent (or one frame of a transfer) may take.
pub(crate) const REQUEST_WAIT: Duration = Duration::from_secs(30);

/// The longest a request about a run whose actor is gone may take: the
/// actor that asks waits meanwhile, and so do the runs that report to it.
pub(crate) const ABANDON_WAIT: Duration = Duration::from_secs(5);

/// Pieces of log (each at most [`super::DATA_PIECE_LEN`]) read off a stream
/// and not yet handled by its run actor.
pub(crate) const LOG_PIECES_IN_FLIGHT: usize = 8;

// ---------------------------------------------------------------------------
// The supervisor.

/// What the jobs' supervisor is asked.
pub(crate) enum JobsMsg {
    /// Start a job's actor; answers once it runs.
    Start(Box<JobArgs>, RpcReplyPort<Result<(), String>>),
    /// Make a pass of the queue: start what may start.
    Schedule,
    /// Cancel job `.0` if it waits in the queue; answers whether it did.
    CancelQueued(u64, RpcReplyPort<Result<bool, String>>),
    /// A timer fired.
    Timer(TimerFired<QueueTimer>),
}

impl From<TimerFired<QueueTimer>> for JobsMsg {
    fn from(fired: TimerFired<QueueTimer>) -> Self {
        Self::Timer(fired)
    }
}

/// The supervisor's one timer: the earliest timeout of a waiting job.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum QueueTimer {
    /// A waiting job's `--timeout` may have passed.
    Timeout,
}

/// The supervisor of the job actors.
pub(crate) struct JobsActor;

/// The supervisor's state.
pub(crate) struct JobsState {
    shared: Arc<Shared>,
    /// Which job each job actor drives.
    jobs: BTreeMap<ActorId, u64>,
    timers: Timers<QueueTimer, JobsMsg>,
}

impl JobsState {
    /// Starts the actor of job `seq`.
    async fn spawn_job(&mut self, myself: &ActorRef<JobsMsg>, args: JobArgs) -> Result<(), String> {
        let seq = args.seq;
        // No name: actor names are process-wide.
        match Actor::spawn_linked(None, JobActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                self.jobs.insert(actor.get_id(), seq);
                self.shared.set_actor(seq, Some(actor));
                Ok(())
            }
            Err(e) => {
                let why = format!("the job's actor could not start: {e}");
                fail_unfinished(&self.shared, seq, &why).await;
                Err(why)
            }
        }
    }

    /// A pass of the queue; then the timer for the earliest timeout of a
    /// job still waiting.
    async fn schedule(&mut self, myself: &ActorRef<JobsMsg>) {
        for (seq, record, workspace) in super::service::pass(&self.shared).await {
            let args = JobArgs {
                shared: self.shared.clone(),
                seq,
                record,
                workspace,
            };
            if let Err(e) = self.spawn_job(myself, args).await {
                tracing::error!(job = seq, "{e}");
            }
        }
        let now = unix_now_ms();
        let next = self
            .shared
            .waiting()
            .iter()
            .filter_map(|(_, r)| timeout_left(r.timeout_s, r.created_unix_ms, now))
            .min();
        match next {
            Some(left) => {
                self.timers
                    .arm_at(QueueTimer::Timeout, self.shared.clock.now() + left);
            }
            None => {
                self.timers.cancel(&QueueTimer::Timeout);
            }
        }
    }
}

impl Actor for JobsActor {
    type Msg = JobsMsg;
    type State = JobsState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<JobsMsg>,
        shared: Arc<Shared>,
    ) -> Result<JobsState, ActorProcessingErr> {
        Ok(JobsState {
            shared,
            jobs: BTreeMap::new(),
            timers: Timers::new(myself),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<JobsMsg>,
        st: &mut JobsState,
    ) -> Result<(), ActorProcessingErr> {
        st.timers.cancel_all();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<JobsMsg>,
        msg: JobsMsg,
        st: &mut JobsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            JobsMsg::Start(args, reply) => {
                let _ = reply.send(st.spawn_job(&myself, *args).await);
            }
            JobsMsg::Schedule => st.schedule(&myself).await,
            JobsMsg::CancelQueued(seq, reply) => {
                let waits = st.shared.waiting().iter().any(|(s, _)| *s == seq);
                let ended =
                    waits && super::service::end_queued(&st.shared, seq, Stop::Cancelled).await;
                let _ = reply.send(Ok(ended));
                if ended {
                    // A job behind it may start now.
                    st.schedule(&myself).await;
                }
            }
            JobsMsg::Timer(fired) => {
                if st.timers.accept(&fired) {
                    st.schedule(&myself).await;
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<JobsMsg>,
        evt: SupervisionEvent,
        st: &mut JobsState,
    ) -> Result<(), ActorProcessingErr> {
        // Never stops the supervisor: one job's failure is that job's.
        match evt {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(seq) = st.jobs.remove(&cell.get_id()) {
                    st.shared.set_actor(seq, None);
                    // Its nodes are free (or it went back to the queue).
                    st.shared.ask_schedule();
                }
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                if let Some(seq) = st.jobs.remove(&cell.get_id()) {
                    st.shared.set_actor(seq, None);
                    tracing::error!(job = seq, %err, "a job's actor failed");
                    let why = format!("the daemon's actor for this job failed: {err}");
                    fail_unfinished(&st.shared, seq, &why).await;
                    st.shared.ask_schedule();
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Records every unfinished run of job `seq` as failed for `why`, tells its
/// followers, and asks the agents to kill what may still run.
async fn fail_unfinished(shared: &Shared, seq: u64, why: &str) {
    let Some(mut record) = shared.record(seq) else {
        return;
    };
    let mut events = Vec::new();
    let mut abandoned = Vec::new();
    for idx in 0..record.runs.len() {
        let run = record.runs[idx].clone();
        if let Some(event) = record.apply(
            idx,
            &Change::Finished(Outcome::fail(JobState::Failed, why)),
            unix_now_ms(),
        ) {
            events.push(event);
            abandoned.push(run);
        }
    }
    if let Err(e) = shared.commit(seq, &record).await {
        tracing::error!("{e}");
    }
    for event in events {
        shared.emit(seq, event);
    }
    for run in abandoned {
        abandon(shared, &record.id, &run).await;
    }
    shared.drop_workspace(seq);
    shared.emit(seq, JobEvent::Done(Box::new(record)));
}

/// Asks `run`'s agent to kill it and drop what it kept, as far as it can be
/// reached; for runs whose actor is gone.
async fn abandon(shared: &Shared, job: &str, run: &RunRecord) {
    let Some(conn) = shared.links.get(run.node, run.attempt) else {
        return;
    };
    let (attempt, job) = (run.attempt, job.to_owned());
    let cancel = ToAgent::Cancel {
        attempt,
        job: job.clone(),
    };
    let _ = request_within(shared, &conn, &cancel, ABANDON_WAIT).await;
    let forget = ToAgent::Forget { attempt, job };
    let _ = request_within(shared, &conn, &forget, ABANDON_WAIT).await;
}

// ---------------------------------------------------------------------------
// A job.

/// What a job actor starts from.
pub(crate) struct JobArgs {
    pub(crate) shared: Arc<Shared>,
    pub(crate) seq: u64,
    /// The job as the journal has it.
    pub(crate) record: JobRecord,
    /// The workspace, when this daemon accepted the job (a resumed job has none).
    pub(crate) workspace: Option<Arc<Workspace>>,
}

/// What a job actor is told.
pub(crate) enum JobMsg {
    /// A run's change to record; answered once it is durable.
    Record(RecordRun),
    /// Stop the job: cancel, or its timeout.
    Stop(Stop),
    /// A timer fired.
    Timer(TimerFired<JobTimer>),
}

/// What a run actor may ask of its job actor, and all it may: record a
/// change to its run. A run actor holds a ref derived for this message
/// only, so it cannot stop the job or fire its timers.
pub(crate) struct RecordRun {
    /// Which run.
    idx: usize,
    /// The change.
    change: Change,
    /// Told once the change is in the journal (or why it is not).
    reply: RpcReplyPort<Result<(), String>>,
}

impl From<RecordRun> for JobMsg {
    fn from(record: RecordRun) -> Self {
        Self::Record(record)
    }
}

impl TryFrom<JobMsg> for RecordRun {
    type Error = JobMsg;

    fn try_from(msg: JobMsg) -> Result<Self, JobMsg> {
        match msg {
            JobMsg::Record(record) => Ok(record),
            other => Err(other),
        }
    }
}

impl From<TimerFired<JobTimer>> for JobMsg {
    fn from(fired: TimerFired<JobTimer>) -> Self {
        Self::Timer(fired)
    }
}

/// The timers of a job actor.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum JobTimer {
    /// The job's `--timeout`.
    Timeout,
}

/// A job's actor.
pub(crate) struct JobActor;

/// A job actor's state.
pub(crate) struct JobActorState {
    shared: Arc<Shared>,
    seq: u64,
    record: JobRecord,
    timers: Timers<JobTimer, JobMsg>,
    /// Each live run actor, by id: the run it drives.
    runs: BTreeMap<ActorId, (usize, ActorRef<RunMsg>)>,
    /// Whether the gang's other ranks were told to stop.
    gang_stopped: bool,
}

impl Actor for JobActor {
    type Msg = JobMsg;
    type State = JobActorState;
    type Arguments = JobArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<JobMsg>,
        args: JobArgs,
    ) -> Result<JobActorState, ActorProcessingErr> {
        let JobArgs {
            shared,
            seq,
            record,
            workspace,
        } = args;
        let mut timers = Timers::new(myself.clone());
        // Counted from acceptance, so a restarted daemon counts the time
        // already used (the wall clock is the only one spanning restarts).
        if let Some(left) = timeout_left(record.timeout_s, record.created_unix_ms, unix_now_ms()) {
            timers.arm_at(JobTimer::Timeout, shared.clock.now() + left);
        }
        let mut st = JobActorState {
            shared,
            seq,
            record,
            timers,
            runs: BTreeMap::new(),
            gang_stopped: false,
        };
        let restart = st.record.gang.as_ref().map_or(0, |g| g.restarts);
        let reattach_wait = st.shared.limits.reattach_wait.max(Duration::from_secs(
            st.record.gang.as_ref().map_or(0, |g| g.reattach_s),
        ));
        let setup = st.record.setup.clone().map(|argv| {
            let manifest = workspace.as_ref().map_or(&[][..], |w| &w.manifest[..]);
            super::Setup::new(argv, manifest)
        });
        for idx in 0..st.record.runs.len() {
            let run = st.record.runs[idx].clone();
            if run.state.is_final() {
                continue;
            }
            let args = RunArgs {
                shared: st.shared.clone(),
                job: myself.get_derived(),
                seq,
                idx,
                job_id: st.record.id.clone(),
                argv: st.record.argv.clone(),
                env: st
                    .record
                    .env
                    .iter()
                    .cloned()
                    .chain(swactor_jobs::gang::rank_env(&st.record, idx))
                    .collect(),
                globs: st.record.outputs.clone(),
                outputs_dir: st.record.outputs_dir.clone(),
                run,
                workspace: workspace.clone(),
                restart,
                setup: setup.clone(),
                reattach_wait,
            };
            match Actor::spawn_linked(None, RunActor, args, myself.get_cell()).await {
                Ok((actor, _)) => {
                    st.runs.insert(actor.get_id(), (idx, actor));
                }
                Err(e) => {
                    let outcome = Outcome::fail(
                        JobState::Failed,
                        format!("the run's actor could not start: {e}"),
                    );
                    st.record_change(idx, &Change::Finished(outcome)).await?;
                }
            }
        }
        // A stop on record (the last daemon died while carrying it out) is
        // carried out again.
        if let Some(stop) = st.record.stop.clone() {
            st.tell_runs(&stop);
        }
        // A gang rank that ended badly before the last daemon stopped
        // the others: they are stopped now.
        st.follow_gang();
        if st.runs.is_empty() {
            st.end(&myself).await;
        }
        Ok(st)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<JobMsg>,
        st: &mut JobActorState,
    ) -> Result<(), ActorProcessingErr> {
        st.timers.cancel_all();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<JobMsg>,
        msg: JobMsg,
        st: &mut JobActorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            JobMsg::Record(RecordRun { idx, change, reply }) => {
                let _ = reply.send(st.record_change(idx, &change).await);
            }
            JobMsg::Stop(stop) => st.stop(stop).await,
            JobMsg::Timer(fired) => {
                if !st.timers.accept(&fired) {
                    return Ok(());
                }
                let JobTimer::Timeout = fired.key;
                let t = st.record.timeout_s.unwrap_or_default();
                st.stop(Stop::TimedOut(format!("timed out after {t} s")))
                    .await;
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<JobMsg>,
        evt: SupervisionEvent,
        st: &mut JobActorState,
    ) -> Result<(), ActorProcessingErr> {
        // Overridden so that a run ending or failing never stops the job
        // (ractor's default stops the supervisor with its child).
        let (cell, failure) = match evt {
            SupervisionEvent::ActorTerminated(cell, _, _) => (cell, None),
            SupervisionEvent::ActorFailed(cell, err) => (cell, Some(err.to_string())),
            _ => return Ok(()),
        };
        let Some((idx, _)) = st.runs.remove(&cell.get_id()) else {
            return Ok(());
        };
        let run = st.record.runs[idx].clone();
        if !run.state.is_final() {
            // Only a failure (or a kill) ends a run actor before its run.
            let why = match &failure {
                Some(err) => format!("the daemon's actor for this run failed: {err}"),
                None => "the daemon's actor for this run stopped before the run ended".to_owned(),
            };
            tracing::error!(job = %st.record.id, node = %run.node, "{why}");
            let outcome = Outcome::fail(JobState::Failed, why);
            if let Err(e) = st.record_change(idx, &Change::Finished(outcome)).await {
                tracing::error!("{e}");
            }
            // Whatever it started may still run: the agent kills it.
            abandon(&st.shared, &st.record.id, &run).await;
        }
        if st.runs.is_empty() {
            st.end(&myself).await;
        }
        Ok(())
    }
}

impl JobActorState {
    /// Applies `change` to run `idx`, writes the record, then tells followers.
    async fn record_change(&mut self, idx: usize, change: &Change) -> Result<(), String> {
        let mut next = self.record.clone();
        let event = next.apply(idx, change, unix_now_ms());
        self.shared.commit(self.seq, &next).await?;
        self.record = next;
        if let Some(event) = event {
            self.shared.emit(self.seq, event);
        }
        if matches!(change, Change::Finished(_)) {
            self.follow_gang();
        }
        Ok(())
    }

    /// Stops a gang's other ranks once one ended badly (decided in the
    /// jobs core), once.
    fn follow_gang(&mut self) {
        if self.gang_stopped {
            return;
        }
        if let swactor_jobs::gang::Next::StopOthers(why) = swactor_jobs::gang::next(&self.record) {
            tracing::info!(job = %self.record.id, %why, "stopping the gang's other ranks");
            self.gang_stopped = true;
            self.tell_runs(&Stop::Gang(why));
        }
    }

    async fn stop(&mut self, stop: Stop) {
        if self.record.stop.is_some() {
            return;
        }
        self.timers.cancel(&JobTimer::Timeout);
        let mut next = self.record.clone();
        next.cancelled = Some(match &stop {
            Stop::Cancelled => "cancelled".to_owned(),
            Stop::TimedOut(why) | Stop::Gang(why) => why.clone(),
        });
        next.stop = Some(stop.clone());
        // On record before any run is told.
        match self.shared.commit(self.seq, &next).await {
            Ok(()) => self.record = next,
            Err(e) => tracing::error!("{e}; the job is stopped all the same"),
        }
        tracing::info!(job = %self.record.id, ?stop, "stopping a job");
        self.tell_runs(&stop);
    }

    fn tell_runs(&self, stop: &Stop) {
        for (_, actor) in self.runs.values() {
            let _ = actor.send_message(RunMsg::Stop(stop.clone()));
        }
    }

    /// Every run has ended: the job's end goes on record and to its followers.
    async fn end(&mut self, myself: &ActorRef<JobMsg>) {
        self.timers.cancel_all();
        if let swactor_jobs::gang::Next::Restart(why) = swactor_jobs::gang::next(&self.record) {
            // Back to the queue, every rank anew; the runs that ended are
            // kept as this attempt's.
            if self.shared.faults.abort_before_requeue {
                // Test hook: every rank's end is on record, the restart is not.
                eprintln!("swactor: SWACTOR_FAULT_ABORT_BEFORE_REQUEUE: exiting");
                std::process::exit(86);
            }
            let mut next = self.record.clone();
            swactor_jobs::gang::requeue(&mut next, &why);
            match self.shared.commit(self.seq, &next).await {
                Ok(()) => {
                    tracing::info!(job = %self.record.id, %why, "the gang goes back to the queue");
                    self.shared.emit(
                        self.seq,
                        JobEvent::Queued {
                            job: next.id.clone(),
                            why: format!("queued: {why}"),
                        },
                    );
                    self.record = next;
                    myself.stop(None);
                    return;
                }
                Err(e) => tracing::error!("{e}; the gang is not restarted"),
            }
        }
        tracing::info!(job = %self.record.id, state = self.record.state().word(), "job ended");
        self.shared.drop_workspace(self.seq);
        self.shared
            .emit(self.seq, JobEvent::Done(Box::new(self.record.clone())));
        myself.stop(None);
    }
}

// ---------------------------------------------------------------------------
// A run.

/// What a run actor starts from.
pub(crate) struct RunArgs {
    shared: Arc<Shared>,
    job: DerivedActorRef<RecordRun>,
    seq: u64,
    idx: usize,
    job_id: String,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    globs: Vec<String>,
    /// Where its collected outputs go: `<outputs_dir>/<node>/`.
    outputs_dir: String,
    /// The run as the journal has it.
    run: RunRecord,
    workspace: Option<Arc<Workspace>>,
    /// The gang's restart this run belongs to (0 for other jobs).
    restart: u32,
    /// The job's setup, if any.
    setup: Option<super::Setup>,
    /// How long the run waits for its agent to come back.
    reattach_wait: Duration,
}

/// A frame the agent sent on a log stream, with its place in the window.
pub(crate) type Piece = (Result<FromAgent, String>, OwnedSemaphorePermit);

/// What a run actor is told.
pub(crate) enum RunMsg {
    /// Perform what the machine asked for first.
    Begin,
    /// The job was stopped.
    Stop(Stop),
    /// The run's attempt has a link again.
    LinkUp,
    /// A later attempt of the node linked up; the text says which.
    Superseded(String),
    /// A frame of log stream number `.0`, or its end (`None`).
    Agent(u64, Option<Piece>),
    /// Send the next chunk of the workspace.
    ShipNext,
    /// A timer fired.
    Timer(TimerFired<RunTimer>),
}

impl From<TimerFired<RunTimer>> for RunMsg {
    fn from(fired: TimerFired<RunTimer>) -> Self {
        Self::Timer(fired)
    }
}

/// The timers of a run actor.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum RunTimer {
    /// How long the run waits for its link to come back.
    Reattach,
}

/// A run's actor.
pub(crate) struct RunActor;

/// A transfer of chunks under way: the agent fetches them from the blob
/// provider and reports each one on this stream.
struct Shipping {
    /// Kept open until the agent has answered.
    _send: SendStream,
    recv: RecvStream,
    /// What the agent may fetch meanwhile.
    _grant: Grant,
}

/// A run actor's state.
pub(crate) struct RunActorState {
    a: RunArgs,
    machine: RunMachine,
    timers: Timers<RunTimer, RunMsg>,
    ship: Option<Shipping>,
    /// The log stream being read, and its number.
    attach: Option<(u64, Forwarder)>,
    attaches: u64,
    /// The daemon's copy of the log, and how much of it there is.
    log: tokio::fs::File,
    offset: u64,
    /// The bytes of a record that has not fully arrived yet.
    pending: Vec<u8>,
}

impl Actor for RunActor {
    type Msg = RunMsg;
    type State = RunActorState;
    type Arguments = RunArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RunMsg>,
        a: RunArgs,
    ) -> Result<RunActorState, ActorProcessingErr> {
        let log_path = a.shared.log_path(&a.job_id, a.run.node, a.restart);
        // This daemon's copy of the log starts over: the agent has all of it.
        let log = tokio::fs::File::create(&log_path)
            .await
            .map_err(|e| format!("cannot write {}: {e}", log_path.display()))?;
        let facts = RunFacts {
            node: a.run.node,
            attempt: a.run.attempt,
            wants_outputs: !a.globs.is_empty(),
            reattach_wait: a.reattach_wait,
        };
        let machine = RunMachine::new(facts, a.run.state, a.workspace.is_some());
        a.shared
            .links
            .watch(a.run.node, a.run.attempt, myself.clone());
        myself.send_message(RunMsg::Begin)?;
        Ok(RunActorState {
            timers: Timers::new(myself),
            machine,
            ship: None,
            attach: None,
            attaches: 0,
            log,
            offset: 0,
            pending: Vec::new(),
            a,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<RunMsg>,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        st.a.shared.links.unwatch(myself.get_id());
        st.timers.cancel_all();
        st.attach = None;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RunMsg>,
        msg: RunMsg,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        let event = match msg {
            RunMsg::Begin => None,
            RunMsg::Stop(stop) => Some(Event::Stop(stop)),
            RunMsg::LinkUp => Some(Event::LinkUp),
            RunMsg::Superseded(why) => Some(Event::Superseded(why)),
            RunMsg::Agent(n, piece) => {
                if st.attach.as_ref().is_none_or(|(current, _)| *current != n) {
                    // A stream this actor already gave up.
                    return Ok(());
                }
                st.agent(piece).await?
            }
            RunMsg::ShipNext => st.ship_next(&myself).await,
            RunMsg::Timer(fired) => {
                if !st.timers.accept(&fired) {
                    return Ok(());
                }
                let RunTimer::Reattach = fired.key;
                Some(Event::ReattachExpired)
            }
        };
        st.drive(&myself, event).await
    }
}

impl RunActorState {
    fn node(&self) -> LogicalNodeId {
        self.a.run.node
    }

    fn attempt(&self) -> u64 {
        self.a.run.attempt
    }

    fn link(&self) -> Option<Connection> {
        self.a.shared.links.get(self.node(), self.attempt())
    }

    /// Hands `event` to the machine and performs what it asks, in order.
    async fn drive(
        &mut self,
        myself: &ActorRef<RunMsg>,
        event: Option<Event>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(event) = event {
            self.machine.handle(event);
        }
        while let Some(action) = self.machine.poll_action() {
            if let Some(event) = self.perform(myself, action).await? {
                self.machine.handle(event);
            }
        }
        Ok(())
    }

    /// Performs one action; returns the event it produced at once, if any.
    async fn perform(
        &mut self,
        myself: &ActorRef<RunMsg>,
        action: Action,
    ) -> Result<Option<Event>, ActorProcessingErr> {
        Ok(match action {
            Action::Record(change) => {
                let running = change == Change::Running;
                self.record(change).await?;
                if running && self.a.shared.faults.abort_after_running {
                    // Test hook: the daemon dies between the record and its
                    // effect, as a kill -9 could make it (exit skips every
                    // destructor, like a kill; a core dump would only litter).
                    eprintln!("swactor: SWACTOR_FAULT_ABORT_AFTER_RUNNING: exiting");
                    std::process::exit(86);
                }
                None
            }
            Action::Ship => self.ship(myself).await,
            Action::Start => Some(self.start().await),
            Action::Attach => self.attach(myself).await,
            Action::Cancel => {
                let req = ToAgent::Cancel {
                    attempt: self.attempt(),
                    job: self.a.job_id.clone(),
                };
                match self.link() {
                    Some(conn) if request(&self.a.shared, &conn, &req).await.is_ok() => None,
                    _ => Some(Event::CancelFailed),
                }
            }
            Action::Collect => Some(match self.link() {
                None => Event::CollectFailed(format!(
                    "{} went away before its outputs were collected",
                    self.node()
                )),
                Some(conn) => match self.collect(&conn).await {
                    Ok(files) => Event::Collected(files),
                    Err(e) => Event::CollectFailed(e),
                },
            }),
            Action::ArmReattach => {
                if !self.timers.is_armed(&RunTimer::Reattach) {
                    let wait = self.a.reattach_wait;
                    self.timers.arm_after(RunTimer::Reattach, wait);
                }
                None
            }
            Action::DisarmReattach => {
                self.timers.cancel(&RunTimer::Reattach);
                None
            }
            Action::CheckLink => {
                if self.link().is_some() {
                    Some(Event::LinkUp)
                } else {
                    self.superseded().await.map(Event::Superseded)
                }
            }
            Action::Forget => {
                self.attach = None;
                self.ship = None;
                if let Some(conn) = self.link() {
                    let req = ToAgent::Forget {
                        attempt: self.attempt(),
                        job: self.a.job_id.clone(),
                    };
                    let _ = request(&self.a.shared, &conn, &req).await;
                }
                None
            }
            Action::Done => {
                let _ = self.log.flush().await;
                myself.stop(None);
                None
            }
        })
    }

    /// Has the job actor record `change`; returns once it is durable.
    async fn record(&self, change: Change) -> Result<(), ActorProcessingErr> {
        let idx = self.a.idx;
        let (reply, answer) = swactor_engine::ractor::concurrency::oneshot();
        let sent = self.a.job.send_message(RecordRun {
            idx,
            change,
            reply: reply.into(),
        });
        let answer = match sent {
            Ok(()) => tokio::time::timeout(ACTOR_CALL_WAIT, answer)
                .await
                .map_or(CallResult::Timeout, |got| {
                    got.map_or(CallResult::SenderError, CallResult::Success)
                }),
            Err(_) => CallResult::SenderError,
        };
        match answer {
            CallResult::Success(Ok(())) => Ok(()),
            // Nothing after this may happen: the run actor fails, and its job
            // records (or tries to) the run as failed.
            CallResult::Success(Err(e)) => Err(e.into()),
            CallResult::Timeout | CallResult::SenderError => {
                Err("the job's actor did not record the run's state".into())
            }
        }
    }

    /// Lets the node fetch the workspace's chunks from the blob provider and
    /// asks it to fetch those it lacks.
    async fn ship(&mut self, myself: &ActorRef<RunMsg>) -> Option<Event> {
        let ws = self.a.workspace.clone()?;
        let failed = |error: String, lost: bool| Some(Event::ShipFailed { error, lost });
        let Some(conn) = self.link() else {
            let e = format!(
                "{} attempt {} has no jobs link",
                self.node(),
                self.attempt()
            );
            return failed(e, true);
        };
        if ws.order.is_empty() {
            return Some(Event::Shipped {
                bytes: 0,
                chunks: 0,
            });
        }
        // Only the key of this link, which is the key derived for this
        // attempt, and only these chunks, for as long as the transfer lasts.
        let grant = self.a.shared.blobs.grant(conn.remote_id(), &ws.order);
        let ask = ToAgent::Fetch {
            attempt: self.attempt(),
            chunks: ws.order.clone(),
        };
        let open = async {
            let (mut send, recv) = conn.open_bi().await?;
            send_frame(&mut send, &ask, JOBS_FRAME_LEN_MAX).await?;
            let _ = send.finish();
            anyhow::Ok((send, recv))
        };
        let went = |e: &dyn std::fmt::Display| {
            format!(
                "{} went away while the workspace was shipped: {e}",
                self.node()
            )
        };
        let (send, recv) = match run_until(self.a.shared.clock.now() + REQUEST_WAIT, open).await {
            Ok(Ok(streams)) => streams,
            Ok(Err(e)) => return failed(went(&e), true),
            Err(e) => return failed(went(&e), true),
        };
        self.ship = Some(Shipping {
            _send: send,
            recv,
            _grant: grant,
        });
        // One answer per message, so a stop is heard between chunks.
        let _ = myself.send_message(RunMsg::ShipNext);
        None
    }

    /// Reads the agent's next answer about the transfer.
    async fn ship_next(&mut self, myself: &ActorRef<RunMsg>) -> Option<Event> {
        let node = self.node().to_owned();
        let deadline = self.a.shared.clock.now() + REQUEST_WAIT;
        let ship = self.ship.as_mut()?;
        let next = run_until(
            deadline,
            recv_frame::<FromAgent, _>(&mut ship.recv, JOBS_FRAME_LEN_MAX),
        )
        .await;
        if let Ok(Ok(Some(FromAgent::Stored))) = next {
            let _ = myself.send_message(RunMsg::ShipNext);
            return None;
        }
        // The transfer is over either way: the grant goes with it.
        self.ship = None;
        let went = |e: &dyn std::fmt::Display| {
            format!("{node} went away while the workspace was shipped: {e}")
        };
        let (error, lost) = match next {
            Ok(Ok(Some(FromAgent::Fetched { bytes, chunks }))) => {
                return Some(Event::Shipped { bytes, chunks });
            }
            Ok(Ok(Some(FromAgent::Refused(e)))) => (e, false),
            Ok(Ok(other)) => (format!("unexpected answer {other:?}"), false),
            Ok(Err(e)) => (went(&e), true),
            Err(e) => (went(&e), true),
        };
        Some(Event::ShipFailed { error, lost })
    }

    async fn start(&self) -> Event {
        let Some(conn) = self.link() else {
            return Event::StartLost(format!(
                "{} attempt {} has no jobs link",
                self.node(),
                self.attempt()
            ));
        };
        let start = ToAgent::Start {
            attempt: self.attempt(),
            job: self.a.job_id.clone(),
            manifest: self
                .a
                .workspace
                .as_ref()
                .map(|w| w.manifest.clone())
                .unwrap_or_default(),
            argv: self.a.argv.clone(),
            env: self.a.env.clone(),
            setup: self.a.setup.clone(),
        };
        match request(&self.a.shared, &conn, &start).await {
            Ok(FromAgent::Started) => Event::Started,
            Ok(FromAgent::Refused(e)) => Event::StartRefused(e),
            Ok(other) => Event::StartRefused(format!("unexpected answer {other:?}")),
            Err(e) => Event::StartLost(format!(
                "{} went away while the run was starting: {e}",
                self.node()
            )),
        }
    }

    /// Opens a log stream from the daemon's offset on; its frames come back
    /// as [`RunMsg::Agent`] through a forwarder.
    async fn attach(&mut self, myself: &ActorRef<RunMsg>) -> Option<Event> {
        self.attach = None;
        let Some(conn) = self.link() else {
            return Some(Event::AttachBroke(format!(
                "{} attempt {} has no jobs link",
                self.node(),
                self.attempt()
            )));
        };
        let req = ToAgent::Attach {
            attempt: self.attempt(),
            job: self.a.job_id.clone(),
            offset: self.offset,
        };
        let open = async {
            let (mut send, recv) = conn.open_bi().await?;
            send_frame(&mut send, &req, JOBS_FRAME_LEN_MAX).await?;
            let _ = send.finish();
            anyhow::Ok(recv)
        };
        let recv = match run_until(self.a.shared.clock.now() + REQUEST_WAIT, open).await {
            Ok(Ok(recv)) => recv,
            Ok(Err(e)) => return Some(Event::AttachBroke(e.to_string())),
            Err(e) => return Some(Event::AttachBroke(e.to_string())),
        };
        self.attaches += 1;
        let n = self.attaches;
        let to = myself.clone();
        let forwarder = Forwarder::start_stream(frames(recv), move |piece| {
            to.send_message(RunMsg::Agent(n, piece)).is_ok()
        });
        self.attach = Some((n, forwarder));
        None
    }

    /// A frame of the current log stream, or its end.
    async fn agent(&mut self, piece: Option<Piece>) -> Result<Option<Event>, ActorProcessingErr> {
        let Some((frame, _permit)) = piece else {
            self.attach = None;
            return Ok(Some(Event::AttachBroke("the stream ended".to_owned())));
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => {
                self.attach = None;
                return Ok(Some(Event::AttachBroke(e)));
            }
        };
        Ok(Some(match frame {
            FromAgent::Log(bytes) => {
                self.log_piece(&bytes).await?;
                Event::Log
            }
            FromAgent::Exit(exit) => {
                self.attach = None;
                Event::Exit(exit)
            }
            FromAgent::Unknown => Event::Unknown,
            FromAgent::Refused(e) => Event::Refused(e),
            FromAgent::Died(e) => Event::Died(e),
            other => {
                self.attach = None;
                Event::AttachBroke(format!("unexpected answer {other:?}"))
            }
        }))
    }

    /// Keeps a piece of log and tells followers the records it completes.
    async fn log_piece(&mut self, bytes: &[u8]) -> Result<(), ActorProcessingErr> {
        if let Some(node) = &self.a.shared.faults.run_panics_on
            && *node == self.node().to_string()
        {
            panic!("SWACTOR_FAULT_RUN_PANICS_ON={node}: a run actor panics on its first log");
        }
        let path = self
            .a
            .shared
            .log_path(&self.a.job_id, self.node(), self.a.restart);
        self.log
            .write_all(bytes)
            .await
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        self.offset += bytes.len() as u64;
        self.pending.extend_from_slice(bytes);
        let (records, used) = LogRecord::decode_all(&self.pending);
        self.pending.drain(..used);
        for rec in records {
            self.a.shared.emit(
                self.a.seq,
                JobEvent::Output {
                    node: self.node(),
                    stderr: rec.stream == Stream::Stderr,
                    text: String::from_utf8_lossy(&rec.data).into_owned(),
                },
            );
        }
        Ok(())
    }

    /// Whether the cluster has moved on from this attempt: the node now
    /// runs a later one. (A node missing from the snapshot proves nothing: a
    /// daemon that just restarted may not list it yet; the reattach wait
    /// covers that case.)
    async fn superseded(&self) -> Option<String> {
        let deadline = self.a.shared.clock.now() + REQUEST_WAIT;
        let snap = run_until(deadline, self.a.shared.cluster.snapshot())
            .await
            .ok()?
            .ok()?;
        let (node, attempt) = (self.node(), self.attempt());
        let n = snap.nodes.iter().find(|n| n.node == node)?;
        (n.attempt.0 > attempt).then(|| {
            format!(
                "{node} attempt {attempt} was replaced by attempt {}",
                n.attempt.0
            )
        })
    }

    /// Fetches the run's outputs into `<outputs_dir>/<node>/`, checking each
    /// file against the hash the agent sent; nothing is kept on any error.
    async fn collect(&self, conn: &Connection) -> Result<Vec<OutputFile>, String> {
        let into = Path::new(&self.a.outputs_dir).join(self.node().to_string());
        let _ = tokio::fs::remove_dir_all(&into).await;
        let req = ToAgent::Collect {
            attempt: self.attempt(),
            job: self.a.job_id.clone(),
            globs: self.a.globs.clone(),
            output_max_bytes: self.a.shared.limits.output_max_bytes,
        };
        let result = self.receive_outputs(conn, &req, &into).await;
        if result.is_err() {
            let _ = tokio::fs::remove_dir_all(&into).await;
        }
        result
    }

    async fn receive_outputs(
        &self,
        conn: &Connection,
        req: &ToAgent,
        into: &Path,
    ) -> Result<Vec<OutputFile>, String> {
        let node = self.node();
        let clock = &self.a.shared.clock;
        let max = self.a.shared.limits.output_max_bytes;
        let went = |e: &dyn std::fmt::Display| {
            format!("{node} went away while its outputs were collected: {e}")
        };
        let open = async {
            let (mut send, recv) = conn.open_bi().await?;
            send_frame(&mut send, req, JOBS_FRAME_LEN_MAX).await?;
            let _ = send.finish();
            anyhow::Ok(recv)
        };
        let mut recv = match run_until(clock.now() + REQUEST_WAIT, open).await {
            Ok(Ok(recv)) => recv,
            Ok(Err(e)) => return Err(went(&e)),
            Err(e) => return Err(went(&e)),
        };
        let mut files = Vec::new();
        let mut total = 0u64;
        let mut current: Option<Incoming> = None;
        loop {
            let next = run_until(
                clock.now() + REQUEST_WAIT,
                recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX),
            )
            .await;
            let frame = match next {
                Ok(Ok(frame)) => frame,
                Ok(Err(e)) => return Err(went(&e)),
                Err(e) => return Err(went(&e)),
            };
            match frame {
                Some(FromAgent::File { path, len, hash }) => {
                    if let Some(done) = current.take() {
                        files.push(done.finish(node).await?);
                    }
                    if !safe_relative(&path) {
                        return Err(format!(
                            "{node} named an output {path:?} outside its workspace"
                        ));
                    }
                    current = Some(Incoming::create(into, path, len, hash).await?);
                }
                Some(FromAgent::Data(data)) => {
                    total += data.len() as u64;
                    if total > max {
                        return Err(format!(
                            "the outputs of {node} exceed the limit of {}",
                            crate::words::size_words(max)
                        ));
                    }
                    let Some(file) = current.as_mut() else {
                        return Err(format!("{node} sent output bytes before naming a file"));
                    };
                    file.write(&data).await?;
                }
                Some(FromAgent::Collected) => {
                    if let Some(done) = current.take() {
                        files.push(done.finish(node).await?);
                    }
                    return Ok(files);
                }
                Some(FromAgent::Refused(e)) => return Err(e),
                other => return Err(format!("unexpected answer {other:?}")),
            }
        }
    }
}

/// An output file arriving: written under `.part`, hashed as it comes, and
/// renamed into place only if its bytes match the hash the agent named.
struct Incoming {
    path: String,
    part: std::path::PathBuf,
    dest: std::path::PathBuf,
    file: tokio::fs::File,
    hasher: blake3::Hasher,
    len: u64,
    got: u64,
    hash: super::Hash,
}

impl Incoming {
    async fn create(
        into: &Path,
        path: String,
        len: u64,
        hash: super::Hash,
    ) -> Result<Self, String> {
        let dest = into.join(&path);
        if let Some(parent) = dest.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| format!("cannot make {}: {e}", parent.display()))?;
        }
        let mut part = dest.clone().into_os_string();
        part.push(".part");
        let part = std::path::PathBuf::from(part);
        let file = tokio::fs::File::create(&part)
            .await
            .map_err(|e| format!("cannot write {}: {e}", part.display()))?;
        Ok(Self {
            path,
            part,
            dest,
            file,
            hasher: blake3::Hasher::new(),
            len,
            got: 0,
            hash,
        })
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), String> {
        self.hasher.update(data);
        self.got += data.len() as u64;
        self.file
            .write_all(data)
            .await
            .map_err(|e| format!("cannot write {}: {e}", self.part.display()))
    }

    async fn finish(mut self, node: LogicalNodeId) -> Result<OutputFile, String> {
        let actual = *self.hasher.finalize().as_bytes();
        let written = self
            .file
            .flush()
            .await
            .map_err(|e| format!("cannot write {}: {e}", self.part.display()));
        if self.got != self.len {
            let _ = tokio::fs::remove_file(&self.part).await;
            return Err(format!(
                "output {} from {node} is {} bytes, not the {} it announced; \
                 none of its outputs was kept",
                self.path, self.got, self.len
            ));
        }
        if actual != self.hash {
            let _ = tokio::fs::remove_file(&self.part).await;
            tracing::warn!(path = %self.path, %node, "an output was rejected by hash");
            return Err(format!(
                "output {} from {node} rejected: its bytes hash to {}, not {}; \
                 none of its outputs was kept",
                self.path,
                hex(&actual),
                hex(&self.hash)
            ));
        }
        written?;
        tokio::fs::rename(&self.part, &self.dest)
            .await
            .map_err(|e| format!("cannot write {}: {e}", self.dest.display()))?;
        Ok(OutputFile {
            path: self.path,
            len: self.len,
            blake3: hex(&self.hash),
        })
    }
}

/// The frames of a log stream, each holding one of [`LOG_PIECES_IN_FLIGHT`]
/// permits until its run actor has handled it: the stream is not read
/// further while the window is full. Ends after the first error.
fn frames(recv: RecvStream) -> impl futures_util::Stream<Item = Piece> + Send + 'static {
    let window = Arc::new(Semaphore::new(LOG_PIECES_IN_FLIGHT));
    futures_util::stream::unfold(Some((recv, window)), |state| async move {
        let (mut recv, window) = state?;
        let permit = window.clone().acquire_owned().await.ok()?;
        match recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX).await {
            Ok(Some(frame)) => Some(((Ok(frame), permit), Some((recv, window)))),
            Ok(None) => None,
            Err(e) => Some(((Err(e.to_string()), permit), None)),
        }
    })
}

/// One request, one answer, on a new stream of `conn`, within [`REQUEST_WAIT`].
pub(crate) async fn request(
    shared: &Shared,
    conn: &Connection,
    req: &ToAgent,
) -> anyhow::Result<FromAgent> {
    request_within(shared, conn, req, REQUEST_WAIT).await
}

/// One request, one answer, on a new stream of `conn`, within `wait`.
pub(crate) async fn request_within(
    shared: &Shared,
    conn: &Connection,
    req: &ToAgent,
    wait: Duration,
) -> anyhow::Result<FromAgent> {
    let ask = async {
        let (mut send, mut recv): (SendStream, RecvStream) = conn.open_bi().await?;
        send_frame(&mut send, req, JOBS_FRAME_LEN_MAX).await?;
        let _ = send.finish();
        let answer = recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX)
            .await?
            .ok_or_else(|| anyhow::anyhow!("the agent closed the stream"))?;
        anyhow::Ok(answer)
    };
    run_until(shared.clock.now() + wait, ask)
        .await
        .map_err(|_| anyhow::anyhow!("the agent did not answer within {} s", wait.as_secs()))?
}

pub(crate) async fn read_at(path: &Path, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut f = tokio::fs::File::open(path).await?;
    f.seek(std::io::SeekFrom::Start(offset)).await?;
    let mut data = vec![0u8; len];
    f.read_exact(&mut data).await?;
    Ok(data)
}
