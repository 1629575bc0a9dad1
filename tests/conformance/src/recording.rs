//! Flight recordings as regression cases: a recorded host life replayed over a fresh host, every answer matched, every step judged by the oracle.
//!
//! A recording (`swactor_provisioning::flight`) holds what a host was built
//! from and every input it was handed, each with a digest of what it
//! answered; nothing of the world around it. [`check_recording`] builds a
//! host the way the header says, around a real [`Driver`] (or any core:
//! [`check_recording_with`]), feeds it the inputs in order, and
//!
//! - requires every answer to digest as recorded: the first that does not
//!   is the case's [`Divergence`], and the replay stops there (past it the
//!   host is no longer the one recorded, so nothing after it means much);
//! - hands the [`Oracle`] what the world would have: a [`Snapshot`] before
//!   and after each input that maps onto a [`StepEvent`] (an apply, a
//!   result, an observation, a join, a timer, a tick, an inventory, a
//!   pause, a shutdown, a collection, and, from the host's own outputs,
//!   every pass and every fold the host made itself), a start from the
//!   journal when the header resumes one, `check` after the inputs that map
//!   onto none, `on_quiescent` whenever an output poll finds the host
//!   drained after handing out passes, and `finish` when the life ends
//!   converged;
//! - stands in for the provider's ground truth with what the recording
//!   itself says the provider did: a lease exists, made for the key and
//!   from the template of the create it answered, from the first answer or
//!   listing that names it; a session from its start's answer or a
//!   listing; either ends with the answer of a cancel or destroy that
//!   removed it, a collection that succeeded, or (a session) its stream's
//!   `Closed`. Nothing ever comes back to life in it: a late duplicate of
//!   an answer, or a listing that lags, does not revive what was removed.
//!
//! Snapshots follow the world's rhythm exactly: the "before" of a step is
//! the state after the last step the oracle saw, or after the last drain,
//! so what an input with no event of its own did (an agent gone, a
//! persisted write, a probe's answer) is judged with the next event, as the
//! world has its oracle judge it.
//!
//! # What a recording can judge
//!
//! The replay itself is `deterministic_replay`, on every answer rather than
//! on an end digest. From the recording alone: `driver_error_free`,
//! `superseded_results_discarded`, `superseded_observations_discarded`,
//! `one_pending_operation_per_node`, `effects_recorded_pending_before_dispatch`,
//! `dispatch_carries_current_identity`, `destroyed_node_holds_nothing`,
//! `cleanup_order_cancel_destroy_mark`,
//! `ambiguous_create_adopted_before_destruction`,
//! `scale_down_removes_only_highest_indexes`, `replacement_only_after_full_cleanup`,
//! `generation_monotonic_regressions_rejected`, `settled_state_plans_nothing`,
//! `no_hot_loop` (32 passes in one drain), `requeue_at_earliest_waiting_deadline`,
//! `backoff_within_floor_and_cap`, `endpoint_not_ready_is_a_probe`,
//! `attempt_failure_cleans_up_immediately`, `failed_cleanup_keeps_live_facts`,
//! `ready_resets_failures`, `ready_only_after_join_and_convergence`,
//! `failures_carry_into_replacement`, `converged_means_exact_specs`,
//! `bootstrap_facts_classified`, `stage_ladder_follows_facts`,
//! `driver_counters_match_what_happened`, `intent_durable_before_effect`
//! (the journal is the header's plus every write the host was told is
//! durable), `paused_dispatches_nothing_new`, `rollout_within_budget`,
//! `surge_within_budget`, `breaker_holds_when_over_limit` (budgets as the
//! applies offered them, or as the resumed journal's shape holds them), and
//! `nothing_acts_past_leadership` (against the bounds the host was told).
//!
//! Against the provider as the recording reports it, so only as far as it
//! reports it: `facts_belong_to_current_attempt`, `cleanup_targets_own_resources`,
//! `no_double_create` and `converged_leaks_nothing` (a lease whose create
//! was never answered, or that a listing of this life never showed, is
//! invisible to them), `destroyed_attempt_leaks_nothing` (live resources
//! only: what the provider was still running is unknown), and
//! `converged_nodes_run_desired_template` (only for leases this life's
//! creates made; a lease first seen in a listing has no known template,
//! and one a re-issued create found is taken to be made from that create's
//! template). `attempt_ids_never_reused` and `operation_ids_never_reused`
//! hold within the life only.
//!
//! # What it cannot
//!
//! - `one_running_operation_per_attempt`: what the provider ran, and when,
//!   is not in the recording (only the answers that came back).
//! - `fair_convergence_within_bound`: nothing says when faults stopped; a
//!   life that ends unconverged (a killed daemon) is no failure.
//! - `acknowledged_shapes_survive_restarts`, `back_within_window_creates_nothing`,
//!   `lapsed_slots_made_once_more`: they span two host lives, and a
//!   recording is one.
//! - `no_agent_blamed_for_host_silence`, `paused_machine_kept_for_its_wait`,
//!   `lease_end_only_when_unrenewed`: they need the truth about agents and
//!   machines (was the agent really cut off, was the machine really paused,
//!   was the lease renewed), which the host never hears and so the
//!   recording never holds.

use crate::oracle::{Invariant, Oracle, Snapshot, StepEvent, Violation, independently_converged};
use crate::world::snapshot;
use provider::RecordedProvider;
use std::collections::BTreeMap;
use std::fmt;
use swactor_provisioning::flight::{
    self, Divergence, FlightError, FlightHeader, FlightInput, Frame, Recording,
};
use swactor_provisioning::lifetime::Status;
use swactor_provisioning::{
    ApplyError, BootstrapEvent, ClusterShape, DesiredUpdate, Driver, DriverError, Folded,
    Generation, Host, HostEvent, HostFold, JoinRefused, JournalDelta, JournalImage, Leadership,
    Liveness, NodeAttemptId, Output, PauseError, Reconciler, ReplaceError, Reply, Timestamp,
};

mod provider;

/// Passes one drain (output polls up to one that finds nothing) may hand
/// out before the case calls it a hot loop: the world's bound per instant.
pub const PASSES_PER_DRAIN_MAX: usize = 32;

/// Why a recording could not be checked at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaseError {
    /// The recording, or one of its frames, cannot be read.
    Read(FlightError),
    /// Its host cannot be built again from its header.
    Host(String),
}

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Read(e) => write!(f, "the recording cannot be read: {e}"),
            Self::Host(e) => write!(f, "the recorded host cannot be built again: {e}"),
        }
    }
}

impl std::error::Error for CaseError {}

/// What checking one recording found.
#[derive(Clone, Debug)]
pub struct RecordingReport {
    /// The build that recorded it, as its header says.
    pub build: String,
    /// Whether its host resumed a journal (a restarted host) rather than
    /// starting a new one.
    pub resumed: bool,
    /// Inputs replayed and answered as recorded.
    pub inputs: u64,
    /// Inputs replayed, by kind (`FlightInput::kind`).
    pub kinds: BTreeMap<&'static str, u64>,
    /// Steps the oracle observed.
    pub steps: u64,
    /// Whether the recording ended at a cut marker (its writer dropped
    /// what came after).
    pub cut: bool,
    /// Whether the life ended converged, so the oracle's end-of-run checks
    /// ran.
    pub finished: bool,
    /// The first input the replay answered otherwise, if one was.
    pub divergence: Option<Divergence>,
    /// What the oracle found (at most a handful are kept).
    pub violations: Vec<Violation>,
}

impl RecordingReport {
    /// True when every answer matched and the oracle found nothing.
    pub fn passed(&self) -> bool {
        self.divergence.is_none() && self.violations.is_empty()
    }

    /// `Ok` when the case passed; otherwise what failed first, for people.
    ///
    /// # Errors
    /// The replay diverged or an invariant was violated.
    pub fn verdict(&self) -> Result<(), String> {
        let mut problems: Vec<String> = Vec::new();
        if let Some(d) = &self.divergence {
            problems.push(format!("replay diverged: {d}"));
        }
        problems.extend(self.violations.iter().map(ToString::to_string));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }
}

impl fmt::Display for RecordingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} host, {} inputs, {} oracle steps{}{}",
            if self.resumed { "resumed" } else { "new" },
            self.inputs,
            self.steps,
            if self.cut { ", cut" } else { "" },
            if self.finished {
                ", ended converged"
            } else {
                ""
            },
        )?;
        match self.verdict() {
            Ok(()) => write!(f, ": passed"),
            Err(e) => write!(f, ": FAILED\n{e}"),
        }
    }
}

/// Checks a recording against the oracle, replayed over a fresh host around
/// a real [`Driver`] configured as its header says.
///
/// # Errors
/// The recording cannot be read or its host cannot be built; a divergence
/// or a violation is not an error but the report's verdict.
pub fn check_recording(bytes: &[u8]) -> Result<RecordingReport, CaseError> {
    check_recording_with(bytes, |header| {
        Driver::new(header.run_id.clone(), header.reconciler.clone()).map_err(|e| e.to_string())
    })
}

/// As [`check_recording`], around the core `make` builds from the header
/// (a wrapped driver, to show that a changed decider is caught).
///
/// # Errors
/// As [`check_recording`].
pub fn check_recording_with<C: Reconciler>(
    bytes: &[u8],
    make: impl FnOnce(&FlightHeader) -> Result<C, String>,
) -> Result<RecordingReport, CaseError> {
    let recording = Recording::read(bytes).map_err(CaseError::Read)?;
    let header = &recording.header;
    let core = make(header).map_err(CaseError::Host)?;
    let host = Host::new(core, header.host.clone(), header.resume.clone())
        .map_err(|e| CaseError::Host(e.to_string()))?;
    let mut case = Case::new(host, header);
    let mut frames = recording.frames();
    for frame in frames.by_ref() {
        let frame = frame.map_err(CaseError::Read)?;
        if !case.step(&frame) {
            break;
        }
    }
    Ok(case.end(header, frames.was_cut()))
}

/// One recording being checked.
struct Case<C: Reconciler> {
    host: Host<C>,
    oracle: Oracle,
    provider: RecordedProvider,
    /// The journal as the host was told it is durable.
    durable: JournalImage,
    /// Journal writes handed out and not yet acknowledged.
    writing: Vec<JournalDelta>,
    /// The state after the last step the oracle saw, or the last drain.
    before: Snapshot,
    now: Timestamp,
    /// Passes handed out since the last poll that found the host drained.
    passes: usize,
    /// What the host was last told of its leadership.
    leadership: Leadership,
    /// The instant of a timer served and not drained since.
    served: Option<Timestamp>,
    inputs: u64,
    kinds: BTreeMap<&'static str, u64>,
    divergence: Option<Divergence>,
}

impl<C: Reconciler> Case<C> {
    fn new(host: Host<C>, header: &FlightHeader) -> Self {
        let now = header.now;
        let before = snapshot(&host, now);
        let mut case = Self {
            oracle: Oracle::new(header.reconciler.clone()),
            provider: RecordedProvider::new(
                header.run_id.clone(),
                header.host.visibility_window_ms,
            ),
            durable: header
                .resume
                .clone()
                .unwrap_or_else(|| JournalImage::new(header.run_id.clone())),
            writing: Vec::new(),
            before,
            now,
            passes: 0,
            leadership: Leadership::Always,
            served: None,
            inputs: 0,
            kinds: BTreeMap::new(),
            divergence: None,
            host,
        };
        if let Some(journal) = &header.resume {
            // A restarted host: the oracle follows the journal it starts
            // from (its pause, its counters, its shape's budgets).
            if let Some(shape) = &journal.meta.shape {
                case.oracle.resumed_shape(shape);
            }
            for (node, slot) in journal.slots.iter() {
                case.oracle.handed_out(node, slot.attempt);
            }
            case.oracle
                .begin_input("a host resumes the recorded journal".to_owned());
            case.record(StepEvent::Restart { durable: journal });
        }
        case
    }

    /// Replays one frame; false once the replay diverged.
    fn step(&mut self, frame: &Frame<'_>) -> bool {
        let input = &frame.input;
        if let Some(now) = input.now() {
            self.now = now;
        }
        *self.kinds.entry(input.kind()).or_default() += 1;
        self.oracle.begin_input(format!(
            "input {} ({}) at {}",
            frame.index,
            input.describe(),
            self.now
        ));
        if let FlightInput::Collected { key, outcome, .. } = input {
            // The world judges a collection once the provider has carried
            // it out and before the host hears how it went.
            let request = self.provider.collecting.get(key.as_ref()).cloned();
            self.provider.learn(input);
            if let Some(request) = request {
                let outcome = outcome.as_ref().as_ref().map(|_| ()).map_err(Clone::clone);
                self.record(StepEvent::Collect {
                    request: &request,
                    outcome: &outcome,
                });
            }
        } else {
            if let FlightInput::Inventory { listed, .. } = input {
                // What the provider lists, an earlier host made for its slot.
                for l in listed.as_ref().iter().flatten() {
                    if l.key.run_id == self.provider.run_id {
                        self.oracle.handed_out(l.key.node, l.key.attempt);
                    }
                }
            }
            self.provider.learn(input);
        }
        let answer = feed(&mut self.host, input);
        let diverged = answer.kept() != frame.answer;
        if diverged {
            self.divergence = Some(Divergence {
                index: frame.index,
                input: input.describe(),
                recorded: frame.answer.describe(),
                replayed: answer.show(),
            });
        } else {
            self.inputs += 1;
        }
        // The oracle judges what the replay answered, even where it is not
        // what was recorded: a divergence that breaks a guarantee says so.
        self.judge(input, answer);
        !diverged
    }

    /// Hands the oracle the step an input and its answer make, if any.
    fn judge(&mut self, input: &FlightInput<'_>, answer: Answer) {
        match (input, answer) {
            (FlightInput::Apply { shape, .. }, Answer::Apply(outcome)) => {
                self.record(StepEvent::Update {
                    shape,
                    outcome: &outcome,
                });
            }
            (FlightInput::ApplyNext { shape, .. }, Answer::Apply(outcome)) => {
                let shape = as_offered(shape, self.before.desired.generation, &outcome);
                self.record(StepEvent::Update {
                    shape: &shape,
                    outcome: &outcome,
                });
            }
            (FlightInput::Pause { paused, .. }, Answer::Pause(outcome)) => {
                self.record(StepEvent::Pause {
                    paused: *paused,
                    outcome: &outcome,
                });
            }
            (FlightInput::Shutdown { mode, .. }, _) => {
                self.record(StepEvent::Shutdown { mode: *mode });
            }
            (FlightInput::Result { result, .. }, Answer::Folded(folded)) => {
                self.record(StepEvent::Result {
                    result,
                    folded: &folded,
                });
            }
            // A daemon's bootstrap streams also say when their agent joined
            // (the world turns that line into a join before the host sees
            // it). Unless the host takes a stream's word for a join, it
            // notes the line and hands it to no core: not an observation.
            (FlightInput::Bootstrap { obs, .. }, Answer::Folded(_))
                if obs.event == BootstrapEvent::SwactorJoined
                    && !self.host.host_config().stream_joins =>
            {
                self.check();
            }
            (FlightInput::Bootstrap { obs, .. }, Answer::Folded(folded)) => {
                self.record(StepEvent::Observation {
                    obs,
                    folded: &folded,
                });
            }
            (FlightInput::SubmitFailed { op, .. }, Answer::Folded(folded)) => {
                match self.provider.ops.get(op).cloned() {
                    Some(dispatch) => self.record(StepEvent::SubmitFailed {
                        dispatch: &dispatch,
                        folded: &folded,
                    }),
                    None => self.check(),
                }
            }
            (FlightInput::AgentJoined { key, .. }, Answer::Join(outcome)) => {
                self.record(StepEvent::AgentJoined {
                    key,
                    outcome: &outcome,
                });
            }
            (FlightInput::Timeout { now }, Answer::Timeout(folded)) => {
                self.record(StepEvent::Timeout { folded: &folded });
                self.served = Some(*now);
            }
            (FlightInput::Tick { .. }, _) => self.record(StepEvent::Tick),
            (FlightInput::Inventory { .. }, _) => self.record(StepEvent::Inventory),
            (FlightInput::Persisted { seq }, _) => {
                for delta in self.writing.iter().filter(|d| d.seq <= *seq) {
                    self.durable.apply(delta);
                }
                self.writing.retain(|d| d.seq > *seq);
            }
            (FlightInput::Leadership { leadership, .. }, _) => {
                self.leadership = *leadership;
                self.check();
            }
            (FlightInput::PollOutput { .. }, Answer::Output(out)) => self.output(out),
            (FlightInput::Collected { .. }, _) => {}
            _ => self.check(),
        }
    }

    /// What the host handed out.
    fn output(&mut self, out: Option<Output>) {
        let Some(out) = out else {
            return self.drained();
        };
        if out.acts()
            && let Leadership::Until(until) = self.leadership
            && self.now >= until
        {
            self.oracle.report(
                Invariant::NothingActsPastLeadership,
                None,
                format!(
                    "{} handed out at {} though its leadership ended at {until}",
                    output_name(&out),
                    self.now
                ),
            );
        }
        match out {
            Output::Persist(delta) => self.writing.push(delta),
            Output::Pass(pass) => {
                self.passes += 1;
                let durable = self.durable.clone();
                self.record(StepEvent::Pass {
                    pass: &pass,
                    durable: &durable,
                });
                self.provider.dispatched(&pass);
            }
            Output::Collect(request) => {
                self.provider
                    .collecting
                    .insert(request.key.clone(), request);
            }
            Output::Folded(fold) => self.fold(&fold),
            Output::Reply(_, Reply::Applied(Ok(update))) => {
                self.oracle.acknowledged(update.generation());
            }
            Output::Reply(_, Reply::Paused(Ok(_))) => self.oracle.pause_acknowledged(),
            Output::Reply(..) | Output::List | Output::Probe { .. } | Output::Stop => {}
        }
    }

    /// An output poll found nothing: the host is drained at this instant.
    fn drained(&mut self) {
        let after = snapshot(&self.host, self.now);
        // A host that has not adopted the provider's inventory yet holds
        // its passes (it may wait a listing lag for a second listing): it
        // is not drained, only waiting.
        let holding = !self.host.adopted() && self.host.shutting_down().is_none();
        if self.passes > 0 && !holding {
            self.oracle
                .on_quiescent(&after, self.passes, PASSES_PER_DRAIN_MAX);
        }
        // A timer that fired and was served must move into the future.
        if self.served.take() == Some(self.now)
            && let Some(t) = self.host.poll_timeout().filter(|t| *t <= self.now)
        {
            self.oracle.report(
                Invariant::RequeueAtEarliestWaitingDeadline,
                None,
                format!("the timer fired at {} and still says {t}", self.now),
            );
        }
        self.passes = 0;
        self.before = after;
    }

    /// A fold the host made itself.
    fn fold(&mut self, fold: &HostFold) {
        match fold {
            HostFold::Observation { obs, folded } => {
                self.record(StepEvent::Observation { obs, folded });
            }
            HostFold::Result { result, folded } => {
                self.record(StepEvent::Result { result, folded });
            }
            HostFold::AgentLost {
                node,
                attempt,
                folded,
                ..
            } => self.record(StepEvent::AgentLost {
                node,
                attempt: *attempt,
                folded: *folded,
            }),
        }
    }

    /// Lets the oracle observe one step, from the last state it saw to now.
    fn record(&mut self, event: StepEvent<'_>) {
        let after = snapshot(&self.host, self.now);
        self.oracle
            .observe(event, &self.before, &after, &self.provider);
        self.before = after;
    }

    /// Lets the oracle check the state after an input that is no step of
    /// its own (its changes are judged with the next step's).
    fn check(&mut self) {
        let after = snapshot(&self.host, self.now);
        self.oracle.check(&after, &self.provider);
    }

    fn end(mut self, header: &FlightHeader, cut: bool) -> RecordingReport {
        let mut finished = false;
        if self.divergence.is_none() {
            let end = snapshot(&self.host, self.now);
            // As the world's fair tail ends: converged by the spec's
            // definition and by the host's own word (inventory adopted,
            // nothing left to collect, no agent away).
            if end.converged_claim && independently_converged(&end.state, &end.desired) {
                self.oracle.finish(&end, &self.provider);
                finished = true;
            }
        }
        RecordingReport {
            build: header.build.clone(),
            resumed: header.resume.is_some(),
            inputs: self.inputs,
            kinds: self.kinds,
            steps: self.oracle.steps(),
            cut,
            finished,
            divergence: self.divergence,
            violations: self.oracle.violations().to_vec(),
        }
    }
}

/// The shape an apply-next offered, at the generation the host offered it
/// at: the one it answered with, or (refused) the next one.
fn as_offered(
    shape: &ClusterShape,
    current: Generation,
    outcome: &Result<DesiredUpdate, ApplyError>,
) -> ClusterShape {
    let generation = match outcome {
        Ok(update) => update.generation(),
        Err(_) => Generation(current.0.saturating_add(1).max(1)),
    };
    ClusterShape {
        generation,
        ..shape.clone()
    }
}

fn output_name(out: &Output) -> &'static str {
    match out {
        Output::Persist(_) => "a journal write",
        Output::List => "a listing",
        Output::Pass(_) => "a pass",
        Output::Collect(_) => "a collection",
        Output::Probe { .. } => "a probe",
        Output::Folded(_) => "a fold",
        Output::Reply(..) => "a reply",
        Output::Stop => "the stop",
    }
}

/// What a host call returned, typed, so the oracle can read it and its
/// digest can be matched with the recorded one.
enum Answer {
    Unit,
    Apply(Result<DesiredUpdate, ApplyError>),
    Pause(Result<bool, PauseError>),
    Folded(Result<Folded, DriverError>),
    Join(Result<Liveness, JoinRefused>),
    Spent(u64),
    Replace(Result<NodeAttemptId, ReplaceError>),
    Timeout(Result<usize, DriverError>),
    Lifetime(Option<Status>),
    Leads(bool),
    Output(Option<Output>),
    Event(Option<HostEvent>),
}

impl Answer {
    /// What the flight recorder keeps of it: a fold's answer itself, the
    /// digest of any other, exactly as the recorder takes it.
    fn kept(&self) -> flight::Answer {
        use flight::Answer as Kept;
        match self {
            Self::Unit => Kept::of(&()),
            Self::Apply(a) => Kept::of(a),
            Self::Pause(a) => Kept::of(a),
            Self::Folded(a) => Kept::of_fold(a),
            Self::Join(a) => Kept::of(a),
            Self::Spent(a) => Kept::of(a),
            Self::Replace(a) => Kept::of(a),
            Self::Timeout(a) => Kept::of(a),
            Self::Lifetime(a) => Kept::of(a),
            Self::Leads(a) => Kept::of(a),
            Self::Output(a) => Kept::of_output(a),
            Self::Event(a) => Kept::of(a),
        }
    }

    /// The answer for people, cut short.
    fn show(&self) -> String {
        let s = match self {
            Self::Unit => "()".to_owned(),
            Self::Apply(a) => format!("{a:?}"),
            Self::Pause(a) => format!("{a:?}"),
            Self::Folded(a) => format!("{a:?}"),
            Self::Join(a) => format!("{a:?}"),
            Self::Spent(a) => format!("{a:?}"),
            Self::Replace(a) => format!("{a:?}"),
            Self::Timeout(a) => format!("{a:?}"),
            Self::Lifetime(a) => format!("{a:?}"),
            Self::Leads(a) => format!("{a:?}"),
            Self::Output(a) => format!("{a:?}"),
            Self::Event(a) => format!("{a:?}"),
        };
        flight::cut_for_people(s)
    }
}

/// Hands `host` one recorded input, as the recorded host was handed it.
fn feed<C: Reconciler>(host: &mut Host<C>, input: &FlightInput<'_>) -> Answer {
    match input {
        FlightInput::Inventory { listed, now } => {
            host.handle_inventory(listed.as_ref().clone(), *now);
            Answer::Unit
        }
        FlightInput::Apply { shape, ticket, now } => {
            Answer::Apply(host.handle_apply(shape, *ticket, *now))
        }
        FlightInput::ApplyNext { shape, ticket, now } => {
            Answer::Apply(host.handle_apply_next(shape, *ticket, *now))
        }
        FlightInput::Pause {
            paused,
            ticket,
            now,
        } => Answer::Pause(host.handle_pause(*paused, *ticket, *now)),
        FlightInput::WaitConverged { ticket } => {
            host.handle_wait_converged(*ticket);
            Answer::Unit
        }
        FlightInput::WaitAdopted { ticket } => {
            host.handle_wait_adopted(*ticket);
            Answer::Unit
        }
        FlightInput::Shutdown { mode, ticket, now } => {
            host.handle_shutdown(*mode, *ticket, *now);
            Answer::Unit
        }
        FlightInput::Persisted { seq } => {
            host.handle_persisted(*seq);
            Answer::Unit
        }
        FlightInput::Result { result, now } => {
            Answer::Folded(host.handle_result(result.as_ref().clone(), *now))
        }
        FlightInput::SubmitFailed {
            node,
            op,
            reason,
            now,
        } => Answer::Folded(host.handle_submit_failed(node, *op, reason, *now)),
        FlightInput::Bootstrap { obs, now } => {
            Answer::Folded(host.handle_bootstrap(obs.as_ref().clone(), *now))
        }
        FlightInput::AgentJoined { key, now } => Answer::Join(host.handle_agent_joined(key, *now)),
        FlightInput::AgentGone {
            key,
            silent_ms,
            now,
        } => {
            host.handle_agent_gone(key, *silent_ms, *now);
            Answer::Unit
        }
        FlightInput::Leadership { leadership, now } => {
            host.handle_leadership(*leadership, *now);
            Answer::Unit
        }
        FlightInput::Spent { spent_micros } => Answer::Spent(host.handle_spent(*spent_micros)),
        FlightInput::Probed { key, paused, now } => {
            host.handle_probed(key, paused.as_ref().clone(), *now);
            Answer::Unit
        }
        FlightInput::Replace { node, ticket, now } => {
            Answer::Replace(host.handle_replace(node, *ticket, *now))
        }
        FlightInput::LaneLost { lane } => {
            host.handle_lane_lost(*lane);
            Answer::Unit
        }
        FlightInput::Collected { key, outcome, now } => {
            host.handle_collected(key, outcome.as_ref().clone(), *now);
            Answer::Unit
        }
        FlightInput::Timeout { now } => Answer::Timeout(host.handle_timeout(*now)),
        FlightInput::Starved { starved_ms, now } => {
            host.handle_starved(*starved_ms, *now);
            Answer::Unit
        }
        FlightInput::Tick { now } => {
            host.handle_tick(*now);
            Answer::Unit
        }
        FlightInput::WallClock { wall_ms, now } => {
            host.handle_wall_clock(*wall_ms, *now);
            Answer::Unit
        }
        FlightInput::Lifetime {
            wall_ms,
            jobs_running,
            now,
        } => Answer::Lifetime(host.handle_lifetime(*wall_ms, *jobs_running, *now)),
        FlightInput::Leads { now } => Answer::Leads(host.leads(*now)),
        FlightInput::PollOutput { now } => Answer::Output(host.poll_output(*now)),
        FlightInput::PollEvent => Answer::Event(host.poll_event()),
    }
}
