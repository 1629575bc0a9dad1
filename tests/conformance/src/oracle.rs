//! The invariant oracle: named black-box guarantees checked after every step.
//!
//! Split the way TigerBeetle's `state_checker` is:
//!
//! - [`Oracle::observe`] looks at one step (an input folded, a pass run, a
//!   submission refused) with the driver's state before and after it;
//! - [`Oracle::check`] looks at the state after every step, on its own;
//! - [`Oracle::on_quiescent`] looks at the driver once it has drained every
//!   pass at an instant (what a settled driver must look like);
//! - [`Oracle::finish`] asserts what must hold at the end of a run.
//!
//! The oracle reads only public, plain data: [`Snapshot`]s of the driver's
//! state and the provider's ground truth through [`ProviderView`]. It knows
//! nothing about how the driver decides, so it can judge a mutated driver, or
//! real actors over a real executor, the same way.
//!
//! Over 1,000 lines in one file: its checkers are split by kind within it,
//! and they share one ledger of what was observed.

use crate::backend::{FakeBackend, KeyStats};
use crate::executor::FakeExecutor;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use swactor_provisioning::{
    ApplyError, BootstrapEvent, BootstrapObservation, BootstrapStage, ClusterShape, ClusterState,
    CollectRequest, DeafGap, DesiredGroup, DesiredState, DesiredUpdate, Dispatch, DriverError,
    DriverStats, EffectKind, EffectRequest, Folded, Generation, GroupId, Intent, JoinRefused,
    JournalImage, LeaseId, Liveness, LogicalNodeId, ManagedNode, NodeAttemptId, NodeStage,
    NodeTemplate, OperationId, OperationOutcome, OperationResult, Pass, PauseError, PolicyShape,
    ReconcilerConfig, ResourceKey, SessionId, ShutdownMode, Timestamp, UpdateError, reconcile_with,
    same_template, stall_during_boot_check_ms,
};

/// Every guarantee the oracle checks. [`Invariant::name`] is what messages print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// Identical traces give identical state (checked by replaying a trace).
    DeterministicReplay,
    /// The driver never returns an error to a host that follows the calling protocol.
    DriverErrorFree,
    /// An attempt id, once seen, never names another incarnation.
    AttemptIdsNeverReused,
    /// An operation id is dispatched once, and never reused for another request.
    OperationIdsNeverReused,
    /// Results of superseded, stale or duplicated operations are discarded and change nothing.
    SupersededResultsDiscarded,
    /// Observations of superseded attempts or dead sessions are discarded and change nothing.
    SupersededObservationsDiscarded,
    /// Every lease and session the driver holds belongs, at the provider, to the node's current attempt.
    FactsBelongToCurrentAttempt,
    /// A node is never sent a second operation while one is pending.
    OnePendingOperationPerNode,
    /// The provider never runs two operations of one attempt at once.
    OneRunningOperationPerAttempt,
    /// Every dispatch is the node's recorded pending operation, with its stored deadline.
    EffectsRecordedPendingBeforeDispatch,
    /// Every dispatch is keyed on (run, slot, current attempt).
    DispatchCarriesCurrentIdentity,
    /// A destroyed node holds no lease, session, endpoint, ambiguity or pending operation.
    DestroyedNodeHoldsNothing,
    /// When an attempt is marked destroyed, the provider holds nothing of it and runs nothing for it.
    DestroyedAttemptLeaksNothing,
    /// Cleanup runs cancel, then destroy, then mark destroyed.
    CleanupOrderCancelDestroyMark,
    /// An ambiguous create is re-issued and adopted before any destructive step.
    AmbiguousCreateAdoptedBeforeDestruction,
    /// At most one lease is ever made, and at most one session is open, per identity.
    NoDoubleCreate,
    /// Only undesired, drifted or failed attempts are deleted (scale-down takes the highest indexes).
    ScaleDownRemovesOnlyHighestIndexes,
    /// Cleanup effects target the node's own resources.
    CleanupTargetsOwnResources,
    /// A slot gets a fresh attempt only after its old one is fully cleaned up and its restart is due.
    ReplacementOnlyAfterFullCleanup,
    /// The desired generation never goes back; regressions, silent changes and foreign runs are refused.
    GenerationMonotonicRegressionsRejected,
    /// A driver drained at an instant plans nothing more at that instant.
    SettledStatePlansNothing,
    /// Draining at one instant ends after a bounded number of passes.
    NoHotLoop,
    /// The driver's timer is the earliest deadline a waiting node has, and moves on once served.
    RequeueAtEarliestWaitingDeadline,
    /// Every failure counts; every retry and restart delay lies in its jitter
    /// window, between the floor and the cap; no effect goes out before its backoff ends.
    BackoffWithinFloorAndCap,
    /// An endpoint that is not ready yet is probed again, and is not a failure.
    EndpointNotReadyIsAProbe,
    /// A failed attempt begins its cleanup in the next pass, without waiting for backoff.
    AttemptFailureCleansUpImmediately,
    /// A failed cancel or destroy keeps the session or lease it failed to remove.
    FailedCleanupKeepsLiveFacts,
    /// Reaching ready resets the failure count.
    ReadyResetsFailures,
    /// A node becomes ready only after its current attempt's stream reported both the join and convergence.
    ReadyOnlyAfterJoinAndConvergence,
    /// A replacement attempt inherits its predecessor's failure count.
    FailuresCarryIntoReplacement,
    /// "Converged" means exactly the desired specs, all ready, nothing undesired or deleting.
    ConvergedMeansExactSpecs,
    /// When converged, the provider holds nothing that no current attempt owns.
    ConvergedLeaksNothing,
    /// After faults stop, the cluster converges within the stated bound of passes and time.
    FairConvergenceWithinBound,
    /// A bootstrap failure, or a stream closing before convergence, fails a live attempt and
    /// counts once; progress refreshes the stall deadline; nothing counts against a deleting or
    /// failed attempt; a stalled stream fails the attempt when (and only when) its deadline passes.
    BootstrapFactsClassified,
    /// The stage ladder follows the facts: CreateLease moves New to LeaseRequested, a lease with
    /// or without endpoint to EndpointKnown or LeaseCreated, a found endpoint to EndpointKnown, a
    /// started bootstrap to BootstrapRunning.
    StageLadderFollowsFacts,
    /// The driver's counters (passes, dispatches, folds, discards, expiries, pass statistics)
    /// match what the host saw happen, and its work queue holds a pass exactly when an
    /// input was folded, a timer served or a shape accepted since the last drain.
    DriverCountersMatchWhatHappened,
    /// Every effect is dispatched for an attempt whose slot record, and an attempt-id
    /// reservation covering it, are already durable in the journal.
    IntentDurableBeforeEffect,
    /// A host started after a crash or a shutdown desires at least the last
    /// acknowledged generation, and hands out attempt ids above every id ever used.
    AcknowledgedShapesSurviveRestarts,
    /// When converged, every node's machine was made from its slot's desired template
    /// (an adopted machine of another template is replaced, never taken as it is).
    ConvergedNodesRunDesiredTemplate,
    /// While paused, a pass inserts, restarts and advances nothing, and
    /// deletes no live attempt: it dispatches only cleanup effects of
    /// deleting attempts and begins the cleanup only of failed ones. The
    /// host says it is paused exactly when the operator's last accepted
    /// pause says so (a teardown overrides it), and an acknowledged pause or
    /// resume survives a crash.
    PausedDispatchesNothingNew,
    /// A pass takes ready nodes of an outdated template down only within
    /// their group's `max_unavailable` (counting the group's desired slots
    /// that are not ready already), lowest slot index first, and none while
    /// a node of the new template is failing (the rollout is stopped).
    RolloutWithinBudget,
    /// A pass gives a slot above its group's `count` a new attempt only as
    /// one of the group's surge slots while the spec's surge rule allows it:
    /// below `count + max_surge` (the offered `max_surge`), while one of the
    /// `count` slots holds a ready, Active node of another template, or,
    /// once a surge slot holds an Active node, until all `count` slots are
    /// ready with the group's template.
    SurgeWithinBudget,
    /// While more of a group's desired slots are unhealthy (failed, or
    /// their agent away) than its `max_unhealthy` allows, no away agent's
    /// node is failed for it (it is held until the group is back within
    /// the limit; an agent is held only when its group is over the limit),
    /// and no failed slot gets a new attempt of the same template.
    BreakerHoldsWhenOverLimit,
    /// A node is failed for its agent's silence only when the agent really
    /// was silent (the world cut it off) for at least its grace while the
    /// host was listening: an agent the host merely could not hear (the
    /// host paused, or was down) keeps its node, and one cut off during a
    /// pause gets its whole grace counted from when the host is back.
    NoAgentBlamedForHostSilence,
    /// A node whose machine the provider paused (an outbid interruptible
    /// rental), in a group that waits for paused machines, is not failed
    /// for its silence before the group's wait has passed since the host
    /// first learnt of the pause; a machine that resumes (its agent back)
    /// keeps its node.
    PausedMachineKeptForItsWait,
    /// A joined agent is welcomed with its group's `orphan_after_s` and a
    /// renewal period shorter than it, and its lease lapses (its agent
    /// ends its node) only when it has gone a whole lease without a
    /// renewal, in which no listening host held a link to it for as long as
    /// a renewal period: the daemon was down, paused, or had lost or cut
    /// the agent off.
    LeaseEndOnlyWhenUnrenewed,
    /// A host restarted with every fault quiet adopts each node that was
    /// ready, with its agent linked, when the last host went, for as long
    /// as that agent is alive: it creates no other attempt for its slot,
    /// re-issues no create its listing showed a lease for, and neither
    /// cancels, destroys nor collects it (until an input that could touch
    /// the slot).
    BackWithinWindowCreatesNothing,
    /// After such a restart, each of those slots whose lease lapsed (its
    /// agent ended its node) gets exactly one new attempt: never a second,
    /// and by the end of the fair tail one.
    LapsedSlotsMadeOnceMore,
    /// A host that leads on an election lease hands out nothing that acts
    /// (a journal write, a pass, a listing, a collection, a probe) at or
    /// past the bound its last renewal gave it (`Host::handle_leadership`).
    NothingActsPastLeadership,
}

impl Invariant {
    /// Every invariant.
    pub const ALL: [Invariant; 49] = [
        Self::DeterministicReplay,
        Self::DriverErrorFree,
        Self::AttemptIdsNeverReused,
        Self::OperationIdsNeverReused,
        Self::SupersededResultsDiscarded,
        Self::SupersededObservationsDiscarded,
        Self::FactsBelongToCurrentAttempt,
        Self::OnePendingOperationPerNode,
        Self::OneRunningOperationPerAttempt,
        Self::EffectsRecordedPendingBeforeDispatch,
        Self::DispatchCarriesCurrentIdentity,
        Self::DestroyedNodeHoldsNothing,
        Self::DestroyedAttemptLeaksNothing,
        Self::CleanupOrderCancelDestroyMark,
        Self::AmbiguousCreateAdoptedBeforeDestruction,
        Self::NoDoubleCreate,
        Self::ScaleDownRemovesOnlyHighestIndexes,
        Self::CleanupTargetsOwnResources,
        Self::ReplacementOnlyAfterFullCleanup,
        Self::GenerationMonotonicRegressionsRejected,
        Self::SettledStatePlansNothing,
        Self::NoHotLoop,
        Self::RequeueAtEarliestWaitingDeadline,
        Self::BackoffWithinFloorAndCap,
        Self::EndpointNotReadyIsAProbe,
        Self::AttemptFailureCleansUpImmediately,
        Self::FailedCleanupKeepsLiveFacts,
        Self::ReadyResetsFailures,
        Self::ReadyOnlyAfterJoinAndConvergence,
        Self::FailuresCarryIntoReplacement,
        Self::ConvergedMeansExactSpecs,
        Self::ConvergedLeaksNothing,
        Self::FairConvergenceWithinBound,
        Self::BootstrapFactsClassified,
        Self::StageLadderFollowsFacts,
        Self::DriverCountersMatchWhatHappened,
        Self::IntentDurableBeforeEffect,
        Self::AcknowledgedShapesSurviveRestarts,
        Self::ConvergedNodesRunDesiredTemplate,
        Self::PausedDispatchesNothingNew,
        Self::RolloutWithinBudget,
        Self::SurgeWithinBudget,
        Self::BreakerHoldsWhenOverLimit,
        Self::NoAgentBlamedForHostSilence,
        Self::PausedMachineKeptForItsWait,
        Self::LeaseEndOnlyWhenUnrenewed,
        Self::BackWithinWindowCreatesNothing,
        Self::LapsedSlotsMadeOnceMore,
        Self::NothingActsPastLeadership,
    ];

    /// The invariant's name, as messages print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeterministicReplay => "deterministic_replay",
            Self::DriverErrorFree => "driver_error_free",
            Self::AttemptIdsNeverReused => "attempt_ids_never_reused",
            Self::OperationIdsNeverReused => "operation_ids_never_reused",
            Self::SupersededResultsDiscarded => "superseded_results_discarded",
            Self::SupersededObservationsDiscarded => "superseded_observations_discarded",
            Self::FactsBelongToCurrentAttempt => "facts_belong_to_current_attempt",
            Self::OnePendingOperationPerNode => "one_pending_operation_per_node",
            Self::OneRunningOperationPerAttempt => "one_running_operation_per_attempt",
            Self::EffectsRecordedPendingBeforeDispatch => {
                "effects_recorded_pending_before_dispatch"
            }
            Self::DispatchCarriesCurrentIdentity => "dispatch_carries_current_identity",
            Self::DestroyedNodeHoldsNothing => "destroyed_node_holds_nothing",
            Self::DestroyedAttemptLeaksNothing => "destroyed_attempt_leaks_nothing",
            Self::CleanupOrderCancelDestroyMark => "cleanup_order_cancel_destroy_mark",
            Self::AmbiguousCreateAdoptedBeforeDestruction => {
                "ambiguous_create_adopted_before_destruction"
            }
            Self::NoDoubleCreate => "no_double_create",
            Self::ScaleDownRemovesOnlyHighestIndexes => "scale_down_removes_only_highest_indexes",
            Self::CleanupTargetsOwnResources => "cleanup_targets_own_resources",
            Self::ReplacementOnlyAfterFullCleanup => "replacement_only_after_full_cleanup",
            Self::GenerationMonotonicRegressionsRejected => {
                "generation_monotonic_regressions_rejected"
            }
            Self::SettledStatePlansNothing => "settled_state_plans_nothing",
            Self::NoHotLoop => "no_hot_loop",
            Self::RequeueAtEarliestWaitingDeadline => "requeue_at_earliest_waiting_deadline",
            Self::BackoffWithinFloorAndCap => "backoff_within_floor_and_cap",
            Self::EndpointNotReadyIsAProbe => "endpoint_not_ready_is_a_probe",
            Self::AttemptFailureCleansUpImmediately => "attempt_failure_cleans_up_immediately",
            Self::FailedCleanupKeepsLiveFacts => "failed_cleanup_keeps_live_facts",
            Self::ReadyResetsFailures => "ready_resets_failures",
            Self::ReadyOnlyAfterJoinAndConvergence => "ready_only_after_join_and_convergence",
            Self::FailuresCarryIntoReplacement => "failures_carry_into_replacement",
            Self::ConvergedMeansExactSpecs => "converged_means_exact_specs",
            Self::ConvergedLeaksNothing => "converged_leaks_nothing",
            Self::FairConvergenceWithinBound => "fair_convergence_within_bound",
            Self::BootstrapFactsClassified => "bootstrap_facts_classified",
            Self::StageLadderFollowsFacts => "stage_ladder_follows_facts",
            Self::DriverCountersMatchWhatHappened => "driver_counters_match_what_happened",
            Self::IntentDurableBeforeEffect => "intent_durable_before_effect",
            Self::AcknowledgedShapesSurviveRestarts => "acknowledged_shapes_survive_restarts",
            Self::ConvergedNodesRunDesiredTemplate => "converged_nodes_run_desired_template",
            Self::PausedDispatchesNothingNew => "paused_dispatches_nothing_new",
            Self::RolloutWithinBudget => "rollout_within_budget",
            Self::SurgeWithinBudget => "surge_within_budget",
            Self::BreakerHoldsWhenOverLimit => "breaker_holds_when_over_limit",
            Self::NoAgentBlamedForHostSilence => "no_agent_blamed_for_host_silence",
            Self::PausedMachineKeptForItsWait => "paused_machine_kept_for_its_wait",
            Self::LeaseEndOnlyWhenUnrenewed => "lease_end_only_when_unrenewed",
            Self::BackWithinWindowCreatesNothing => "back_within_window_creates_nothing",
            Self::LapsedSlotsMadeOnceMore => "lapsed_slots_made_once_more",
            Self::NothingActsPastLeadership => "nothing_acts_past_leadership",
        }
    }
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One broken guarantee: which, at which step, on which node, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The guarantee.
    pub invariant: Invariant,
    /// The step number (every input, result, observation and pass is a step).
    pub step: u64,
    /// What the step was.
    pub context: String,
    /// The node concerned, if one is.
    pub node: Option<LogicalNodeId>,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant `{}` violated at step {} ({})",
            self.invariant, self.step, self.context
        )?;
        if let Some(node) = &self.node {
            write!(f, " on node {node}")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// What the oracle sees of the driver at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The instant.
    pub now: Timestamp,
    /// The observed state.
    pub state: ClusterState,
    /// The desired state.
    pub desired: DesiredState,
    /// The driver's timer (`poll_timeout`).
    pub timer: Option<Timestamp>,
    /// Whether the driver claims to be converged.
    pub converged_claim: bool,
    /// The driver's lifetime counters.
    pub stats: DriverStats,
    /// Whether a pass is queued, when the host can tell (`None` skips the
    /// work-queue checks, e.g. for a driver inside an actor).
    pub pass_queued: Option<bool>,
    /// Whether the host has adopted the provider's inventory and has no
    /// orphan left to collect (until then "converged" cannot be claimed).
    pub host_settled: bool,
    /// Whether the host is shutting down (or stopped): shapes are refused.
    pub shutting_down: bool,
    /// Agents whose grace is running (away from the host); none may be for
    /// the host to claim convergence.
    pub agents_away: usize,
    /// Whether the host says reconciling is paused.
    pub paused: bool,
    /// Slots whose current attempt's agent is away from the host (its
    /// grace running, or held by its group's breaker).
    pub away: BTreeSet<LogicalNodeId>,
    /// Slots whose agent's grace ended while their group's breaker held it.
    pub held_lost: BTreeSet<LogicalNodeId>,
    /// The host's latest deaf gap ([`Host::last_deaf_gap`](swactor_provisioning::Host::last_deaf_gap)).
    pub deaf: Option<DeafGap>,
}

/// One step, as the oracle observes it.
#[derive(Clone, Copy, Debug)]
pub enum StepEvent<'a> {
    /// A desired-shape update was offered.
    Update {
        /// The shape offered.
        shape: &'a ClusterShape,
        /// What the host answered.
        outcome: &'a Result<DesiredUpdate, ApplyError>,
    },
    /// An operation result was delivered.
    Result {
        /// The result.
        result: &'a OperationResult,
        /// What the driver answered.
        folded: &'a Result<Folded, DriverError>,
    },
    /// A bootstrap observation was delivered.
    Observation {
        /// The observation.
        obs: &'a BootstrapObservation,
        /// What the driver answered.
        folded: &'a Result<Folded, DriverError>,
    },
    /// A dispatch could not be submitted and was reported.
    SubmitFailed {
        /// The dispatch.
        dispatch: &'a Dispatch,
        /// What the driver answered.
        folded: &'a Result<Folded, DriverError>,
    },
    /// The swarm reported an agent lost.
    AgentLost {
        /// The node named.
        node: &'a LogicalNodeId,
        /// The attempt named.
        attempt: NodeAttemptId,
        /// What the driver answered.
        folded: Folded,
    },
    /// The driver's timer fired.
    Timeout {
        /// What the driver answered.
        folded: &'a Result<usize, DriverError>,
    },
    /// A periodic tick.
    Tick,
    /// A pass ran (between `poll_pass` and the first submission).
    Pass {
        /// The pass.
        pass: &'a Pass,
        /// The journal as committed when the pass was handed out.
        durable: &'a JournalImage,
    },
    /// The provider's inventory reached a new host (it may adopt).
    Inventory,
    /// An agent asked to join.
    AgentJoined {
        /// Who it says it is.
        key: &'a ResourceKey,
        /// What the host answered.
        outcome: &'a Result<Liveness, JoinRefused>,
    },
    /// An orphan's resources were destroyed (or not).
    Collect {
        /// What the host asked for.
        request: &'a CollectRequest,
        /// What the provider answered.
        outcome: &'a Result<(), String>,
    },
    /// A new host started from the journal (after a crash or a shutdown).
    Restart {
        /// The journal it started from.
        durable: &'a JournalImage,
    },
    /// The host was asked to shut down.
    Shutdown {
        /// How.
        mode: ShutdownMode,
    },
    /// The operator paused (`paused`) or resumed reconciling.
    Pause {
        /// Paused or resumed.
        paused: bool,
        /// What the host answered (whether anything changed).
        outcome: &'a Result<bool, PauseError>,
    },
}

impl StepEvent<'_> {
    fn label(&self) -> String {
        match self {
            Self::Update { shape, .. } => format!("update to {}", shape.generation),
            Self::Result { result, .. } => {
                format!(
                    "result {} for {}: {:?}",
                    result.op, result.node, result.outcome
                )
            }
            Self::Observation { obs, .. } => format!(
                "observation {:?} from {} of {}/{}",
                obs.event, obs.session.0, obs.node, obs.attempt
            ),
            Self::SubmitFailed { dispatch, .. } => {
                format!("submission of {} failed", dispatch.op)
            }
            Self::AgentLost { node, attempt, .. } => format!("agent of {node}/{attempt} lost"),
            Self::Timeout { .. } => "timer".to_owned(),
            Self::Tick => "tick".to_owned(),
            Self::Pass { pass, .. } => format!("pass {}", pass.number),
            Self::Inventory => "inventory".to_owned(),
            Self::AgentJoined { key, .. } => format!("agent of {key} joins"),
            Self::Collect { request, .. } => format!("collect orphan {}", request.key),
            Self::Restart { .. } => "a new host starts from the journal".to_owned(),
            Self::Shutdown { mode } => format!("shutdown ({mode:?})"),
            Self::Pause { paused: true, .. } => "pause".to_owned(),
            Self::Pause { paused: false, .. } => "resume".to_owned(),
        }
    }
}

/// The provider's ground truth, as the oracle needs it.
///
/// Implemented by [`FakeExecutor`] (and [`FakeBackend`], which has nothing in
/// flight). A real provider under test can implement it over its own records.
pub trait ProviderView {
    /// Who a lease was made for, and whether it is still live.
    fn lease_owner(&self, lease: &LeaseId) -> Option<(&ResourceKey, bool)>;
    /// Who a session was started for, and whether it is still open.
    fn session_owner(&self, session: &SessionId) -> Option<(&ResourceKey, bool)>;
    /// Identities of every live lease and open session.
    fn live_keys(&self) -> Vec<ResourceKey>;
    /// Per-identity counts.
    fn key_stats(&self) -> Vec<(&ResourceKey, KeyStats)>;
    /// Operations of an attempt submitted and not yet applied.
    fn in_flight(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> usize;
    /// The template a lease was made from, when the provider recorded one.
    fn lease_template(&self, lease: &LeaseId) -> Option<&NodeTemplate>;
    /// Times the provider ran two operations of one attempt at once.
    fn overlaps(&self) -> u64;
}

impl ProviderView for FakeBackend {
    fn lease_owner(&self, lease: &LeaseId) -> Option<(&ResourceKey, bool)> {
        self.leases().get(lease).map(|l| (l.key, l.live))
    }
    fn session_owner(&self, session: &SessionId) -> Option<(&ResourceKey, bool)> {
        self.sessions().get(session).map(|s| (s.key, s.open))
    }
    fn live_keys(&self) -> Vec<ResourceKey> {
        self.live_resources().map(|(k, _)| k.clone()).collect()
    }
    fn key_stats(&self) -> Vec<(&ResourceKey, KeyStats)> {
        self.keys().iter().map(|(k, s)| (k, *s)).collect()
    }
    fn in_flight(&self, _: &LogicalNodeId, _: NodeAttemptId) -> usize {
        0
    }
    fn lease_template(&self, lease: &LeaseId) -> Option<&NodeTemplate> {
        self.leases().get(lease)?.template.map(|t| &**t)
    }
    fn overlaps(&self) -> u64 {
        0
    }
}

impl ProviderView for FakeExecutor {
    fn lease_owner(&self, lease: &LeaseId) -> Option<(&ResourceKey, bool)> {
        self.backend().lease_owner(lease)
    }
    fn session_owner(&self, session: &SessionId) -> Option<(&ResourceKey, bool)> {
        self.backend().session_owner(session)
    }
    fn live_keys(&self) -> Vec<ResourceKey> {
        self.backend().live_keys()
    }
    fn key_stats(&self) -> Vec<(&ResourceKey, KeyStats)> {
        ProviderView::key_stats(self.backend())
    }
    fn in_flight(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> usize {
        FakeExecutor::in_flight(self, node, attempt)
    }
    fn lease_template(&self, lease: &LeaseId) -> Option<&NodeTemplate> {
        self.backend().lease_template(lease)
    }
    fn overlaps(&self) -> u64 {
        self.stats().overlaps
    }
}

/// The delay window a backoff after `failures` consecutive failures must fall
/// in, derived from the spec's wording rather than from the core's code: the
/// un-jittered delay doubles from the base up to the cap; the jitter window
/// is `delay * jitter / 1000` wide, placed as high as the cap allows and never
/// below the base.
pub fn backoff_window(config: &ReconcilerConfig, failures: u32) -> (u64, u64) {
    if failures == 0 {
        return (0, 0);
    }
    let mut d = config.backoff_base_ms;
    for _ in 1..failures.min(64) {
        d = d.saturating_mul(2);
        if d >= config.backoff_cap_ms {
            break;
        }
    }
    let d = d.min(config.backoff_cap_ms);
    let w = d / 1000 * u64::from(config.jitter_permille)
        + d % 1000 * u64::from(config.jitter_permille) / 1000;
    let hi = d.saturating_add(w).min(config.backoff_cap_ms);
    let lo = hi.saturating_sub(w).max(config.backoff_base_ms);
    (lo, hi)
}

/// The deadline of an effect, read from the config's fields rather than
/// through `ReconcilerConfig::timeout_ms`, so a mix-up there is caught.
fn timeout_of(config: &ReconcilerConfig, kind: EffectKind) -> u64 {
    let t = &config.timeouts;
    match kind {
        EffectKind::CreateLease => t.create_lease_ms,
        EffectKind::LookupEndpoint => t.lookup_endpoint_ms,
        EffectKind::StartBootstrap => t.start_bootstrap_ms,
        EffectKind::CancelBootstrap => t.cancel_bootstrap_ms,
        EffectKind::DestroyLease => t.destroy_lease_ms,
    }
}

/// The surge slots group `g` may have in `state` by the spec, `max` being
/// its resolved `max_surge`: all of them while one of its `count` slots
/// holds a ready, Active node of another template; once a slot above
/// `count` (and below `count + max`) holds an Active node, all of them
/// until every one of the `count` slots is ready and Active with the
/// group's template; none otherwise.
pub(crate) fn spec_surge(state: &ClusterState, g: &DesiredGroup, max: u32) -> u32 {
    if max == 0 {
        return 0;
    }
    let of_group: Vec<(u32, &ManagedNode)> = state
        .nodes
        .iter()
        .filter(|(id, _)| id.group == g.id)
        .map(|(id, n)| (id.index, n))
        .collect();
    let primary = || of_group.iter().filter(|(i, _)| *i < g.count);
    let rolling = primary().any(|(_, n)| {
        n.intent == Intent::Active && n.is_ready() && !same_template(&n.template, &g.template)
    });
    let up = of_group
        .iter()
        .any(|(i, n)| (g.count..g.count + max).contains(i) && n.intent == Intent::Active);
    let settled = (0..g.count).all(|i| {
        primary().any(|(j, n)| {
            *j == i
                && n.intent == Intent::Active
                && n.is_ready()
                && same_template(&n.template, &g.template)
        })
    });
    if rolling || (up && !settled) { max } else { 0 }
}

/// The template the spec wants slot `id` to run in `state`: its group's,
/// for one of the group's `count` slots or one of its surge slots
/// ([`spec_surge`], with the group's shown `max_surge`).
pub(crate) fn wanted<'a>(
    state: &ClusterState,
    desired: &'a DesiredState,
    id: &LogicalNodeId,
) -> Option<&'a Arc<NodeTemplate>> {
    let g = desired.groups.iter().find(|g| g.id == id.group)?;
    let surge = spec_surge(state, g, g.policy.max_surge_of(g.count));
    (id.index < g.count + surge).then_some(&g.template)
}

/// True when `state` is converged on `desired`, judged from the spec's
/// definition alone: every desired slot holds exactly its desired spec, ready,
/// Active, nothing pending; no other node exists.
pub fn independently_converged(state: &ClusterState, desired: &DesiredState) -> bool {
    let specs: BTreeMap<LogicalNodeId, _> = desired.specs().map(|s| (s.node, s.template)).collect();
    specs.len() == state.nodes.len()
        && state.nodes.iter().all(|(id, n)| {
            specs.get(id).is_some_and(|t| **t == *n.template)
                && n.record.ready
                && n.intent == Intent::Active
                && n.pending.is_none()
                && matches!(n.record.stage, NodeStage::Dormant | NodeStage::HandedOff)
        })
}

/// The earliest deadline any node of a drained driver waits on, derived from
/// the spec's list: pending deadlines, retry backoff and probes, restarts,
/// bootstrap stall deadlines.
pub fn earliest_waiting_deadline(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
) -> Option<Timestamp> {
    state
        .nodes
        .iter()
        .filter_map(|(id, n)| {
            let rec = &n.record;
            if rec.stage == NodeStage::Destroyed {
                // A slot that wants another template restarts at once.
                return rec.restart_at.filter(|t| {
                    *t > now
                        && wanted(state, desired, id).is_some_and(|d| same_template(d, &n.template))
                });
            }
            if let Some(p) = &n.pending {
                return Some(p.deadline);
            }
            if let Some(t) = n.retry.next_effect_at.filter(|t| *t > now) {
                return Some(t);
            }
            let awaiting_stream = n.intent == Intent::Active
                && rec.session.is_some()
                && !(rec.ready && matches!(rec.stage, NodeStage::Dormant | NodeStage::HandedOff));
            if awaiting_stream {
                return rec.bootstrap_deadline;
            }
            None
        })
        .min()
}

/// Whether `SWACTOR_TRACE_STEPS` asks for every step to be printed.
fn verbose() -> bool {
    static VERBOSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VERBOSE.get_or_init(|| std::env::var_os("SWACTOR_TRACE_STEPS").is_some())
}

/// The oracle. Feed it every step; read [`Oracle::violations`].
#[derive(Clone, Debug)]
pub struct Oracle {
    config: ReconcilerConfig,
    violations: Vec<Violation>,
    attempts_seen: BTreeMap<NodeAttemptId, LogicalNodeId>,
    ops_seen: BTreeSet<OperationId>,
    joined: BTreeSet<(LogicalNodeId, NodeAttemptId)>,
    converged: BTreeSet<(LogicalNodeId, NodeAttemptId)>,
    acked: Generation,
    tally: DriverStats,
    step: u64,
    context: String,
    limit: usize,
    /// Paused, as the operator's accepted requests (and teardowns, and the
    /// journal a new host starts from) say.
    paused: bool,
    /// The host acknowledged the last pause or resume as durable.
    pause_acked: bool,
    /// The budgets of every generation a host accepted, by group, as the
    /// shapes offered said (not as the core reports them).
    policies: BTreeMap<Generation, BTreeMap<String, PolicyShape>>,
}

impl Oracle {
    /// An oracle for a driver configured with `config`.
    pub fn new(config: ReconcilerConfig) -> Self {
        Self {
            config,
            violations: Vec::new(),
            attempts_seen: BTreeMap::new(),
            ops_seen: BTreeSet::new(),
            joined: BTreeSet::new(),
            converged: BTreeSet::new(),
            acked: Generation(0),
            tally: DriverStats::default(),
            step: 0,
            context: String::new(),
            limit: 16,
            paused: false,
            pause_acked: false,
            policies: BTreeMap::new(),
        }
    }

    /// Every violation found so far (at most a handful are kept).
    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// True when nothing was violated.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The number of steps seen.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Records a violation found outside the oracle's own checkers (by the
    /// harness, e.g. the fair-convergence bound or a replay mismatch).
    pub fn report(&mut self, invariant: Invariant, node: Option<&LogicalNodeId>, detail: String) {
        if self.violations.len() < self.limit {
            self.violations.push(Violation {
                invariant,
                step: self.step,
                context: self.context.clone(),
                node: node.cloned(),
                detail,
            });
        }
    }

    fn fail(&mut self, invariant: Invariant, node: &LogicalNodeId, detail: impl Into<String>) {
        self.report(invariant, Some(node), detail.into());
    }

    /// The shape a host resumed from its journal, when no shape was offered
    /// to this oracle at its generation (a flight recording of a restarted
    /// host): its budgets are what an earlier host accepted as offered, so
    /// the rollout and breaker checks judge the new host by them.
    pub fn resumed_shape(&mut self, shape: &ClusterShape) {
        let policies = shape
            .groups
            .iter()
            .map(|g| (g.id.clone(), g.policy))
            .collect();
        self.policies.entry(shape.generation).or_insert(policies);
    }

    /// An earlier host handed out `attempt` for slot `node`, as a journal
    /// records it or a provider lists it (for a flight recording, whose
    /// oracle never saw the earlier hosts): adopting it is no reuse, and
    /// handing it out anew is one.
    pub fn handed_out(&mut self, node: LogicalNodeId, attempt: NodeAttemptId) {
        self.attempts_seen.entry(attempt).or_insert(node);
    }

    /// The host acknowledged (as durable) that `generation` is desired.
    pub fn acknowledged(&mut self, generation: Generation) {
        self.acked = self.acked.max(generation);
    }

    /// The host acknowledged the last pause or resume as durable.
    pub fn pause_acknowledged(&mut self) {
        self.pause_acked = true;
    }

    /// Sets the label of the input that the next steps belong to.
    pub fn begin_input(&mut self, label: String) {
        self.context = label;
    }

    /// Observes one step, given the driver before and after it.
    pub fn observe(
        &mut self,
        event: StepEvent<'_>,
        before: &Snapshot,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        self.step += 1;
        let input = std::mem::take(&mut self.context);
        self.context = format!("{input}; {}", event.label());
        if verbose() {
            let nodes: Vec<String> = after
                .state
                .nodes
                .iter()
                .map(|(id, n)| {
                    format!(
                        "{id}/{}:{:?}{}{}",
                        n.attempt,
                        n.record.stage,
                        if n.intent == Intent::Deleting {
                            "(del)"
                        } else {
                            ""
                        },
                        n.pending
                            .as_ref()
                            .map(|p| format!("[{:?}]", p.effect))
                            .unwrap_or_default()
                    )
                })
                .collect();
            eprintln!("step {} {}: {}", self.step, self.context, nodes.join(" "));
        }
        let paused = self.paused;
        self.observe_pause(event, before, after);
        if paused && let StepEvent::Pass { pass, .. } = event {
            self.check_paused_pass(pass, before, after);
        }
        self.observe_budgets(event, before, after);
        self.observe_event(event, before, after, provider);
        if !matches!(event, StepEvent::Restart { .. }) {
            self.observe_transitions(event, before, after, provider);
        }
        self.observe_counters(event, before, after);
        self.check(after, provider);
        self.context = input;
    }

    fn observe_event(
        &mut self,
        event: StepEvent<'_>,
        before: &Snapshot,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        let b = &before.state;
        match event {
            StepEvent::Update { shape, outcome } => {
                self.check_update(shape, outcome, before, after)
            }
            StepEvent::Result { result, folded } => {
                self.observe_result(result, folded, before, after)
            }
            StepEvent::Observation { obs, folded } => {
                self.observe_observation(obs, folded, before, after)
            }
            StepEvent::SubmitFailed { dispatch, folded } => {
                if let Err(e) = folded {
                    self.fail(
                        Invariant::DriverErrorFree,
                        &dispatch.key.node,
                        format!("{e:?}"),
                    );
                }
            }
            StepEvent::Timeout { folded } => self.observe_timeout(folded, before, after),
            StepEvent::Tick => {}
            StepEvent::AgentLost {
                node,
                attempt,
                folded,
            } => self.observe_agent_lost(node, attempt, folded, before, after),
            StepEvent::Pass { pass, durable } => {
                self.check_pass(pass, before, after, provider);
                self.check_durable(pass, durable);
            }
            StepEvent::Inventory | StepEvent::Shutdown { .. } | StepEvent::Pause { .. } => {}
            StepEvent::AgentJoined { key, outcome } => {
                self.observe_agent_joined(key, outcome, before, after)
            }
            StepEvent::Collect { request, .. } => {
                let key = &request.key;
                if b.nodes
                    .get(&key.node)
                    .is_some_and(|n| n.attempt == key.attempt)
                {
                    self.fail(
                        Invariant::CleanupTargetsOwnResources,
                        &key.node,
                        format!("collected {key}, the slot's current attempt"),
                    );
                }
            }
            StepEvent::Restart { durable } => self.observe_restart(durable, after),
        }
    }

    /// A result: folded only when it answers the pending operation, and folded right.
    fn observe_result(
        &mut self,
        result: &OperationResult,
        folded: &Result<Folded, DriverError>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let (b, a) = (&before.state, &after.state);
        let now = after.now;
        let Ok(folded) = folded else {
            return self.fail(
                Invariant::DriverErrorFree,
                &result.node,
                format!("{folded:?}"),
            );
        };
        let node_before = b.nodes.get(&result.node);
        let current = node_before
            .and_then(|n| n.pending.as_ref())
            .is_some_and(|p| p.id == result.op);
        // A result that is the host's first input after a deaf gap
        // moves the node's stall deadlines by the gap (the host
        // does that for every node, before folding anything):
        // then only the fold itself is judged.
        let deafened = after.deaf != before.deaf;
        if !current {
            if *folded == Folded::Applied || (!deafened && node_before != a.nodes.get(&result.node))
            {
                self.fail(
                    Invariant::SupersededResultsDiscarded,
                    &result.node,
                    format!(
                        "a result for {} that is not the pending operation was folded ({folded:?})",
                        result.op
                    ),
                );
            }
            return;
        }
        let (Some(nb), Some(na)) = (node_before, a.nodes.get(&result.node)) else {
            return;
        };
        self.check_result_fold(result, nb, na, now);
        if *folded == Folded::Applied {
            self.check_ladder_on_result(result, nb, na, now);
        }
    }

    /// An observation: folded only when it is of the live session, and folded right.
    fn observe_observation(
        &mut self,
        obs: &BootstrapObservation,
        folded: &Result<Folded, DriverError>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let (b, a) = (&before.state, &after.state);
        let now = after.now;
        let Ok(folded) = folded else {
            return self.fail(Invariant::DriverErrorFree, &obs.node, format!("{folded:?}"));
        };
        let node_before = b.nodes.get(&obs.node);
        if *folded == Folded::Discarded(swactor_provisioning::DiscardReason::Queued) {
            // Queued behind the node's earlier reports: judged when the host
            // folds it (its own fold, in order); until then nothing changes.
            if node_before != a.nodes.get(&obs.node) {
                self.fail(
                    Invariant::BootstrapFactsClassified,
                    &obs.node,
                    format!("{:?}: queued, yet the node changed", obs.event),
                );
            }
            return;
        }
        let live = node_before.is_some_and(|n| {
            n.attempt == obs.attempt && n.record.session.as_ref() == Some(&obs.session)
        });
        if live && *folded == Folded::Applied {
            let who = (obs.node, obs.attempt);
            match obs.event {
                BootstrapEvent::SwactorJoined => {
                    self.joined.insert(who);
                }
                BootstrapEvent::Stage(BootstrapStage::Converged) => {
                    self.converged.insert(who);
                }
                _ => {}
            }
        }
        if let (true, Some(nb), Some(na)) = (live, node_before, a.nodes.get(&obs.node)) {
            self.check_observation_fold(obs, nb, na, now);
        }
        if !live && (*folded == Folded::Applied || node_before != a.nodes.get(&obs.node)) {
            self.fail(
                Invariant::SupersededObservationsDiscarded,
                &obs.node,
                format!(
                    "an observation of {}/{} was folded though the node runs {:?}",
                    obs.attempt,
                    obs.session.0,
                    node_before.map(|n| (n.attempt, n.record.session.clone()))
                ),
            );
        }
    }

    /// Served timers: due stall deadlines fail attempts; expired operations fail as ambiguous.
    fn observe_timeout(
        &mut self,
        folded: &Result<usize, DriverError>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let (b, a) = (&before.state, &after.state);
        let now = after.now;
        if let Err(e) = folded {
            self.report(Invariant::DriverErrorFree, None, format!("{e:?}"));
        }
        // A deaf gap noticed at this very step moved every stall
        // deadline still running at its start on by its length.
        let gap = after.deaf.filter(|_| after.deaf != before.deaf);
        for (id, nb) in &b.nodes {
            let Some(na) = a.nodes.get(id) else { continue };
            if nb.pending.is_none() {
                let rb = &nb.record;
                let deadline = rb.bootstrap_deadline.map(|t| match gap {
                    Some(g) if t > g.from => t.saturating_add_ms(g.len_ms()),
                    _ => t,
                });
                let should_stall = nb.intent == Intent::Active
                    && rb.session.is_some()
                    && !rb.ready
                    && rb.stage != NodeStage::Failed
                    && deadline.is_some_and(|t| t <= now);
                let stalled = rb.stage != NodeStage::Failed && na.record.stage == NodeStage::Failed;
                let counted = na.retry.consecutive_failures
                    == nb.retry.consecutive_failures.saturating_add(1);
                if should_stall != stalled || (stalled && !counted) {
                    self.fail(
                        Invariant::BootstrapFactsClassified,
                        id,
                        format!("stall deadline {:?} at {now}: should fail {should_stall}, failed {stalled}", rb.bootstrap_deadline),
                    );
                }
            }
            let Some(p) = &nb.pending else { continue };
            if p.deadline > now || na.pending.is_some() {
                continue;
            }
            // An expired operation folds as an ambiguous failure
            // (one an active attempt left behind when it began
            // deleting counts nothing and delays nothing).
            let interrupted = nb.intent == Intent::Deleting && !p.cleanup;
            let expected = nb.retry.consecutive_failures + u32::from(!interrupted);
            if na.retry.consecutive_failures != expected {
                self.fail(
                    Invariant::BackoffWithinFloorAndCap,
                    id,
                    "an expired operation did not count as a failure",
                );
            }
            if p.effect.creates() && na.record.ambiguous != p.effect.as_create() {
                self.fail(
                    Invariant::AmbiguousCreateAdoptedBeforeDestruction,
                    id,
                    format!("an expired {:?} was not remembered as ambiguous", p.effect),
                );
            }
            if interrupted {
                if na.retry.next_effect_at != nb.retry.next_effect_at {
                    self.fail(
                        Invariant::AttemptFailureCleansUpImmediately,
                        id,
                        "an operation the deleting node's cleanup did not send delayed its cleanup",
                    );
                }
            } else {
                self.check_backoff(id, na, now);
            }
        }
    }

    /// A lost agent: it fails its attempt when that is live, and changes nothing otherwise.
    fn observe_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        folded: Folded,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let (b, a) = (&before.state, &after.state);
        let nb = b.nodes.get(node);
        let live = nb.is_some_and(|n| {
            n.attempt == attempt
                && n.intent == Intent::Active
                && !matches!(n.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        });
        let (Some(nb), Some(na)) = (nb, a.nodes.get(node)) else {
            return;
        };
        let ok = if live {
            folded == Folded::Applied
                && na.record.stage == NodeStage::Failed
                && !na.record.ready
                && na.retry.consecutive_failures == nb.retry.consecutive_failures.saturating_add(1)
                && na.retry.next_effect_at.is_none()
        } else {
            folded != Folded::Applied && na == nb
        };
        if !ok {
            self.fail(
                Invariant::BootstrapFactsClassified,
                node,
                format!("agent lost for {attempt} (live: {live}) answered {folded:?}; stage {:?} -> {:?}", nb.record.stage, na.record.stage),
            );
        }
    }

    /// A join: accepted exactly when of the current attempt; refused, it changes nothing.
    fn observe_agent_joined(
        &mut self,
        key: &ResourceKey,
        outcome: &Result<Liveness, JoinRefused>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let (b, a) = (&before.state, &after.state);
        let current = b.nodes.get(&key.node).is_some_and(|n| {
            n.attempt == key.attempt
                && n.intent == Intent::Active
                && !matches!(n.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        });
        // As for results: a join that is the host's first input
        // after a deaf gap moves stall deadlines by the gap.
        let deafened = after.deaf != before.deaf;
        if current != outcome.is_ok() || (outcome.is_err() && b != a && !deafened) {
            self.fail(
                Invariant::SupersededObservationsDiscarded,
                &key.node,
                format!("the join of {key} (current: {current}) was answered {outcome:?}"),
            );
        }
    }

    /// A new host: it reuses no attempt id and keeps every acknowledged generation.
    fn observe_restart(&mut self, durable: &JournalImage, after: &Snapshot) {
        let a = &after.state;
        self.joined.clear();
        self.converged.clear();
        let last = self.attempts_seen.last_key_value().map(|(a, n)| (*a, *n));
        if let Some((used, node)) = last
            && a.next_attempt <= used.0
        {
            self.fail(
                Invariant::AcknowledgedShapesSurviveRestarts,
                &node,
                format!(
                    "the new host would hand out attempt {} again (journal reserves {})",
                    a.next_attempt, durable.meta.attempts_reserved
                ),
            );
        }
        if after.desired.generation < self.acked {
            self.report(
                Invariant::AcknowledgedShapesSurviveRestarts,
                None,
                format!(
                    "generation {} was acknowledged, the new host desires {}",
                    self.acked, after.desired.generation
                ),
            );
        }
    }

    /// Every dispatch's attempt is durably recorded for its slot, below the
    /// durable attempt-id reservation.
    fn check_durable(&mut self, pass: &Pass, durable: &JournalImage) {
        for d in &pass.dispatches {
            let recorded = durable
                .slots
                .get(&d.key.node)
                .is_some_and(|r| r.attempt == d.key.attempt);
            let reserved = d.key.attempt.0 < durable.meta.attempts_reserved;
            if !recorded || !reserved {
                self.fail(
                    Invariant::IntentDurableBeforeEffect,
                    &d.key.node,
                    format!(
                        "{:?} of {} dispatched; the journal records {:?} and reserves ids below {}",
                        d.request.kind(),
                        d.key,
                        durable.slots.get(&d.key.node),
                        durable.meta.attempts_reserved
                    ),
                );
            }
        }
    }

    fn check_update(
        &mut self,
        shape: &ClusterShape,
        outcome: &Result<DesiredUpdate, ApplyError>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let inv = Invariant::GenerationMonotonicRegressionsRejected;
        let current = before.desired.generation;
        let validated = shape.validate();
        let expected: Result<Option<bool>, &str> = match &validated {
            _ if before.shutting_down => Err("ShuttingDown"),
            Err(_) => Err("Invalid"),
            Ok(_) if shape.run_id != before.state.run_id => Err("RunMismatch"),
            Ok(_)
                if shape.capacity.is_some_and(|c| {
                    shape.node_count() > c && shape.node_count() > before.desired.node_count()
                }) =>
            {
                Err("OverCapacity")
            }
            Ok(_) if shape.generation < current => Err("GenerationRegressed"),
            Ok(next) if shape.generation == current => {
                if next.groups == before.desired.groups {
                    Ok(Some(false))
                } else {
                    Err("SameGenerationChanged")
                }
            }
            Ok(_) => Ok(Some(true)),
        };
        let got = match outcome {
            Err(ApplyError::ShuttingDown) => Err("ShuttingDown"),
            Err(ApplyError::OverCapacity { .. }) => Err("OverCapacity"),
            Err(ApplyError::Update(UpdateError::Invalid(_))) => Err("Invalid"),
            Err(ApplyError::Update(UpdateError::RunMismatch { .. })) => Err("RunMismatch"),
            Err(ApplyError::Update(UpdateError::GenerationRegressed { .. })) => {
                Err("GenerationRegressed")
            }
            Err(ApplyError::Update(UpdateError::SameGenerationChanged { .. })) => {
                Err("SameGenerationChanged")
            }
            Ok(DesiredUpdate::Unchanged(_)) => Ok(Some(false)),
            Ok(DesiredUpdate::Accepted(_)) => Ok(Some(true)),
        };
        let _ = ApplyError::ShuttingDown;
        let mut problems = Vec::new();
        if expected != got {
            problems.push(format!(
                "{} answered {outcome:?}, expected {expected:?}",
                shape.generation
            ));
        }
        let moved = before.desired != after.desired || before.state != after.state;
        match got {
            Ok(Some(true))
                if after.desired.generation != shape.generation
                    || validated
                        .as_ref()
                        .is_ok_and(|v| v.groups != after.desired.groups) =>
            {
                problems.push("an accepted shape did not become the desired state".to_owned());
            }
            Ok(Some(true)) => {}
            _ if moved => {
                problems.push("a refused or unchanged update changed the driver".to_owned())
            }
            _ => {}
        }
        if after.desired.generation < current {
            problems.push(format!(
                "generation went back from {current} to {}",
                after.desired.generation
            ));
        }
        for p in problems {
            self.report(inv, None, p);
        }
    }

    fn check_result_fold(
        &mut self,
        result: &OperationResult,
        nb: &ManagedNode,
        na: &ManagedNode,
        now: Timestamp,
    ) {
        let node = &result.node;
        let kind = nb.pending.as_ref().map(|p| p.effect);
        match &result.outcome {
            OperationOutcome::EndpointNotReady
                if kind == Some(EffectKind::LookupEndpoint)
                    && nb.intent == Intent::Active
                    && nb.record.endpoint_deadline.is_some_and(|d| d <= now) =>
            {
                // Past its group's readiness deadline: the attempt fails.
                let failed = na.record.stage == NodeStage::Failed
                    && na.retry.consecutive_failures == nb.retry.consecutive_failures + 1
                    && na.retry.next_effect_at.is_none();
                if !failed {
                    self.fail(
                        Invariant::EndpointNotReadyIsAProbe,
                        node,
                        format!(
                            "an endpoint still not ready past its deadline {:?} did not fail the attempt",
                            nb.record.endpoint_deadline
                        ),
                    );
                }
            }
            OperationOutcome::EndpointNotReady if kind == Some(EffectKind::LookupEndpoint) => {
                let probe = now
                    .0
                    .checked_add(self.config.probe_interval_ms)
                    .map(Timestamp);
                if na.retry.consecutive_failures != nb.retry.consecutive_failures
                    || na.retry.next_effect_at != probe
                {
                    self.fail(
                        Invariant::EndpointNotReadyIsAProbe,
                        node,
                        format!(
                            "failures {} -> {}, next probe {:?} (expected {probe:?})",
                            nb.retry.consecutive_failures,
                            na.retry.consecutive_failures,
                            na.retry.next_effect_at
                        ),
                    );
                }
            }
            // The active attempt sent it before it began deleting: its
            // failure neither counts nor holds the cleanup back.
            OperationOutcome::Failed { .. }
                if nb.intent == Intent::Deleting
                    && nb.pending.as_ref().is_some_and(|p| !p.cleanup)
                    && na.retry != nb.retry =>
            {
                self.fail(
                    Invariant::AttemptFailureCleansUpImmediately,
                    node,
                    format!(
                        "an interrupted {kind:?} changed the retry state {:?} -> {:?}",
                        nb.retry, na.retry
                    ),
                );
            }
            OperationOutcome::Failed { .. }
                if nb.intent == Intent::Deleting
                    && nb.pending.as_ref().is_some_and(|p| !p.cleanup) => {}
            OperationOutcome::Failed { .. } => self.check_failed_fold(node, kind, nb, na, now),
            _ => {}
        }
    }

    /// A failure's fold: it counts, keeps uncleaned facts, cleans up or backs off, keeps ambiguity.
    fn check_failed_fold(
        &mut self,
        node: &LogicalNodeId,
        kind: Option<EffectKind>,
        nb: &ManagedNode,
        na: &ManagedNode,
        now: Timestamp,
    ) {
        if na.retry.consecutive_failures != nb.retry.consecutive_failures.saturating_add(1) {
            self.fail(
                Invariant::BackoffWithinFloorAndCap,
                node,
                "a failed operation did not count as a failure",
            );
        }
        if matches!(
            kind,
            Some(EffectKind::CancelBootstrap | EffectKind::DestroyLease)
        ) && (na.record.session != nb.record.session || na.record.lease != nb.record.lease)
        {
            self.fail(
                Invariant::FailedCleanupKeepsLiveFacts,
                node,
                format!("a failed {kind:?} dropped the facts it failed to clean"),
            );
        }
        if na.record.stage == NodeStage::Failed && nb.record.stage != NodeStage::Failed {
            if na.retry.next_effect_at.is_some() {
                self.fail(
                    Invariant::AttemptFailureCleansUpImmediately,
                    node,
                    "a failed attempt's cleanup waits for backoff",
                );
            }
        } else {
            self.check_backoff(node, na, now);
        }
        // An unresolved CreateLease may hold a machine; only a success
        // resolves it. (A session dies with its lease, so a dropped
        // StartBootstrap ambiguity is made safe by the DestroyLease.)
        if let (Some(k), Some(prev)) = (kind, nb.record.ambiguous)
            && k == prev.effect()
            && k == EffectKind::CreateLease
            && na.record.ambiguous.is_none()
        {
            self.fail(
                Invariant::AmbiguousCreateAdoptedBeforeDestruction,
                node,
                format!("a failed re-issue of an ambiguous {k:?} forgot the ambiguity before it was adopted"),
            );
        }
    }

    fn check_backoff(&mut self, node: &LogicalNodeId, n: &ManagedNode, now: Timestamp) {
        let Some(at) = n.retry.next_effect_at else {
            return self.fail(
                Invariant::BackoffWithinFloorAndCap,
                node,
                "a failure set no retry deadline",
            );
        };
        let delay = at.saturating_since(now);
        let (lo, hi) = backoff_window(&self.config, n.retry.consecutive_failures);
        if !(lo..=hi).contains(&delay)
            || delay < self.config.backoff_base_ms
            || delay > self.config.backoff_cap_ms
        {
            self.fail(
                Invariant::BackoffWithinFloorAndCap,
                node,
                format!(
                    "retry in {delay} ms after {} failures; window is [{lo}, {hi}]",
                    n.retry.consecutive_failures
                ),
            );
        }
    }

    fn check_pass(
        &mut self,
        pass: &Pass,
        before: &Snapshot,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        for e in &pass.errors {
            self.report(Invariant::DriverErrorFree, None, format!("pass error: {e}"));
        }
        let mut dispatched = BTreeSet::new();
        for d in &pass.dispatches {
            self.check_dispatch(d, &mut dispatched, before, after, provider);
        }
        self.check_pass_deletions(before, after);
    }

    /// One dispatch of a pass: alone, recorded pending, current identity, fresh operation id.
    fn check_dispatch(
        &mut self,
        d: &Dispatch,
        dispatched: &mut BTreeSet<LogicalNodeId>,
        before: &Snapshot,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        let (b, a) = (&before.state, &after.state);
        let now = after.now;
        let id = &d.key.node;
        let kind = d.request.kind();
        if !dispatched.insert(*id) {
            self.fail(
                Invariant::OnePendingOperationPerNode,
                id,
                "two dispatches in one pass",
            );
        }
        let Some(na) = a.nodes.get(id) else {
            self.fail(
                Invariant::EffectsRecordedPendingBeforeDispatch,
                id,
                "dispatch for a node the driver does not hold",
            );
            return;
        };
        let nb = b.nodes.get(id);
        if let Some(p) = nb.and_then(|n| n.pending.as_ref()) {
            self.fail(
                Invariant::OnePendingOperationPerNode,
                id,
                format!("{} dispatched while {} was pending", d.op, p.id),
            );
        }
        let recorded = na.pending.as_ref().is_some_and(|p| {
            p.id == d.op && p.effect == kind && p.deadline == d.deadline && p.dispatched_at == now
        });
        let deadline_ok = now.0.checked_add(timeout_of(&self.config, kind)) == Some(d.deadline.0);
        if !recorded || !deadline_ok {
            self.fail(
                Invariant::EffectsRecordedPendingBeforeDispatch,
                id,
                format!(
                    "{} ({kind:?}) is not the recorded pending operation {:?}",
                    d.op, na.pending
                ),
            );
        }
        if d.key.run_id != a.run_id || d.key.attempt != na.attempt || d.op.attempt != na.attempt {
            self.fail(
                Invariant::DispatchCarriesCurrentIdentity,
                id,
                format!(
                    "dispatch keyed {} / {} for attempt {}",
                    d.key, d.op, na.attempt
                ),
            );
        }
        if !self.ops_seen.insert(d.op) {
            self.fail(
                Invariant::OperationIdsNeverReused,
                id,
                format!("{} dispatched twice", d.op),
            );
        }
        let Some(nb) = nb else { return };
        self.check_dispatch_ladder(d, nb, na, now);
        self.check_dispatch_targets(d, nb, na, provider);
    }

    /// A dispatch moves its node's stage only as its kind says, and never before its backoff ends.
    fn check_dispatch_ladder(
        &mut self,
        d: &Dispatch,
        nb: &ManagedNode,
        na: &ManagedNode,
        now: Timestamp,
    ) {
        let id = &d.key.node;
        let kind = d.request.kind();
        let stage = if kind == EffectKind::CreateLease && nb.record.stage == NodeStage::New {
            NodeStage::LeaseRequested
        } else {
            nb.record.stage
        };
        if na.record.stage != stage {
            self.fail(
                Invariant::StageLadderFollowsFacts,
                id,
                format!(
                    "{kind:?} dispatched moved {:?} to {:?}",
                    nb.record.stage, na.record.stage
                ),
            );
        }
        if let Some(at) = nb.retry.next_effect_at.filter(|at| *at > now) {
            self.fail(
                Invariant::BackoffWithinFloorAndCap,
                id,
                format!("{kind:?} dispatched at {now}, before its backoff ends at {at}"),
            );
        }
    }

    /// Cleanup effects: order, adoption first, own resources only.
    fn check_dispatch_targets(
        &mut self,
        d: &Dispatch,
        nb: &ManagedNode,
        na: &ManagedNode,
        provider: &dyn ProviderView,
    ) {
        let id = &d.key.node;
        let kind = d.request.kind();
        let destructive = matches!(kind, EffectKind::CancelBootstrap | EffectKind::DestroyLease);
        if destructive && nb.intent != Intent::Deleting {
            self.fail(
                Invariant::CleanupOrderCancelDestroyMark,
                id,
                format!("{kind:?} for an Active attempt"),
            );
        }
        if destructive && nb.record.ambiguous.is_some() {
            self.fail(
                Invariant::AmbiguousCreateAdoptedBeforeDestruction,
                id,
                format!(
                    "{kind:?} while an ambiguous {:?} is unresolved",
                    nb.record.ambiguous
                ),
            );
        }
        if kind == EffectKind::DestroyLease && nb.record.session.is_some() {
            self.fail(
                Invariant::CleanupOrderCancelDestroyMark,
                id,
                "DestroyLease while a session is live",
            );
        }
        let target_owner = match &d.request {
            EffectRequest::CancelBootstrap { session } => {
                provider.session_owner(session).map(|(k, _)| k.clone())
            }
            EffectRequest::DestroyLease { lease, .. } | EffectRequest::LookupEndpoint { lease } => {
                provider.lease_owner(lease).map(|(k, _)| k.clone())
            }
            EffectRequest::StartBootstrap { lease, .. } => {
                provider.lease_owner(lease).map(|(k, _)| k.clone())
            }
            EffectRequest::CreateLease { .. } => None,
        };
        if let Some(owner) = target_owner
            && (owner.node != *id || owner.attempt != na.attempt)
        {
            self.fail(
                Invariant::CleanupTargetsOwnResources,
                id,
                format!(
                    "{kind:?} of attempt {} targets a resource of {owner}",
                    na.attempt
                ),
            );
        }
    }

    /// Deletions: only undesired, drifted or failed attempts; failed ones at once.
    fn check_pass_deletions(&mut self, before: &Snapshot, after: &Snapshot) {
        let (b, a) = (&before.state, &after.state);
        for (id, nb) in &b.nodes {
            let Some(na) = a.nodes.get(id) else { continue };
            if nb.intent != Intent::Active || nb.record.stage == NodeStage::Destroyed {
                continue;
            }
            let desired = wanted(b, &after.desired, id);
            let keep = desired.is_some_and(|t| **t == *nb.template)
                && nb.record.stage != NodeStage::Failed;
            if keep && na.intent == Intent::Deleting {
                self.fail(
                    Invariant::ScaleDownRemovesOnlyHighestIndexes,
                    id,
                    format!(
                        "a desired, current, healthy attempt was deleted (group size {:?})",
                        after
                            .desired
                            .groups
                            .iter()
                            .find(|g| g.id == id.group)
                            .map(|g| g.count)
                    ),
                );
            }
            if nb.record.stage == NodeStage::Failed
                && na.attempt == nb.attempt
                && (na.intent != Intent::Deleting || na.retry.next_effect_at.is_some())
            {
                self.fail(
                    Invariant::AttemptFailureCleansUpImmediately,
                    id,
                    "a failed attempt did not begin cleanup in the next pass",
                );
            }
        }
    }

    /// Checks that concern any state change, whatever caused it.
    fn observe_transitions(
        &mut self,
        event: StepEvent<'_>,
        before: &Snapshot,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        let (b, a) = (&before.state, &after.state);
        let now = after.now;
        if a.next_attempt < b.next_attempt {
            self.report(
                Invariant::AttemptIdsNeverReused,
                None,
                "the attempt allocator went back".to_owned(),
            );
        }
        if a.observed_generation < b.observed_generation {
            self.report(
                Invariant::GenerationMonotonicRegressionsRejected,
                None,
                format!(
                    "observed generation went back: {:?} -> {:?}",
                    b.observed_generation, a.observed_generation
                ),
            );
        }
        if after.desired.generation < before.desired.generation {
            self.report(
                Invariant::GenerationMonotonicRegressionsRejected,
                None,
                "desired generation went back".to_owned(),
            );
        }
        for (id, na) in &a.nodes {
            let nb = b.nodes.get(id);
            let new_attempt = nb.is_none_or(|nb| nb.attempt != na.attempt);
            let adopted = matches!(event, StepEvent::Inventory) && nb.is_none();
            if new_attempt {
                self.check_new_attempt(event, id, na, adopted);
            }
            if let (Some(nb), true) = (nb, new_attempt) {
                // A replacement in place.
                self.check_replacement(id, na, nb, before, now);
            }
            let Some(nb) = nb.filter(|nb| nb.attempt == na.attempt) else {
                continue;
            };
            self.check_readiness(id, na, nb);
            if na.record.stage == NodeStage::Destroyed && nb.record.stage != NodeStage::Destroyed {
                self.check_marked_destroyed(id, na, nb, after, provider);
            }
        }
    }

    /// A new attempt: adopted, one handed out for the slot; made, a fresh id in a pass.
    fn check_new_attempt(
        &mut self,
        event: StepEvent<'_>,
        id: &LogicalNodeId,
        na: &ManagedNode,
        adopted: bool,
    ) {
        if adopted {
            // Adoption takes over an attempt an earlier host handed out.
            if self.attempts_seen.get(&na.attempt) != Some(id) {
                self.fail(
                    Invariant::AttemptIdsNeverReused,
                    id,
                    format!(
                        "adopted attempt {}, which was never handed out for this slot (seen for {:?})",
                        na.attempt,
                        self.attempts_seen.get(&na.attempt)
                    ),
                );
            }
        } else {
            if let Some(owner) = self.attempts_seen.insert(na.attempt, *id) {
                self.fail(
                    Invariant::AttemptIdsNeverReused,
                    id,
                    format!("attempt {} was already used by {owner}", na.attempt),
                );
            }
            if !matches!(event, StepEvent::Pass { .. }) {
                self.fail(
                    Invariant::ReplacementOnlyAfterFullCleanup,
                    id,
                    "a new attempt appeared outside a pass",
                );
            }
        }
    }

    /// A replacement in place: only of a cleaned-up attempt due to restart; failures carry over.
    fn check_replacement(
        &mut self,
        id: &LogicalNodeId,
        na: &ManagedNode,
        nb: &ManagedNode,
        before: &Snapshot,
        now: Timestamp,
    ) {
        let rec = &nb.record;
        let clean = rec.stage == NodeStage::Destroyed
            && rec.lease.is_none()
            && rec.session.is_none()
            && nb.pending.is_none();
        // The backoff holds only while the slot wants the same template.
        let changed = wanted(&before.state, &before.desired, id)
            .is_some_and(|d| !same_template(d, &nb.template));
        let due = changed || rec.restart_at.is_none_or(|t| t <= now);
        if !clean || !due {
            self.fail(
                Invariant::ReplacementOnlyAfterFullCleanup,
                id,
                format!(
                    "attempt {} replaced {} at {now} (stage {:?}, restart_at {:?})",
                    na.attempt, nb.attempt, rec.stage, rec.restart_at
                ),
            );
        }
        if na.retry.consecutive_failures != nb.retry.consecutive_failures {
            self.fail(
                Invariant::FailuresCarryIntoReplacement,
                id,
                format!(
                    "{} failures became {}",
                    nb.retry.consecutive_failures, na.retry.consecutive_failures
                ),
            );
        }
    }

    /// An attempt becomes ready only after it joined and converged, and with no failures.
    fn check_readiness(&mut self, id: &LogicalNodeId, na: &ManagedNode, nb: &ManagedNode) {
        let who = (*id, na.attempt);
        if na.is_ready()
            && !nb.is_ready()
            && !(self.joined.contains(&who) && self.converged.contains(&who))
        {
            self.fail(
                Invariant::ReadyOnlyAfterJoinAndConvergence,
                id,
                format!(
                    "attempt {} became ready (joined reported: {}, converged reported: {})",
                    na.attempt,
                    self.joined.contains(&who),
                    self.converged.contains(&who)
                ),
            );
        }
        if na.is_ready() && !nb.is_ready() && na.retry.consecutive_failures != 0 {
            self.fail(
                Invariant::ReadyResetsFailures,
                id,
                format!(
                    "ready with {} failures on record",
                    na.retry.consecutive_failures
                ),
            );
        }
    }

    /// An attempt marked destroyed holds and leaks nothing, and restarts within the backoff.
    fn check_marked_destroyed(
        &mut self,
        id: &LogicalNodeId,
        na: &ManagedNode,
        nb: &ManagedNode,
        after: &Snapshot,
        provider: &dyn ProviderView,
    ) {
        let a = &after.state;
        let now = after.now;
        let rb = &nb.record;
        if rb.lease.is_some() || rb.session.is_some() || nb.pending.is_some() {
            self.fail(
                Invariant::CleanupOrderCancelDestroyMark,
                id,
                "marked destroyed while a lease, session or operation remained",
            );
        }
        if rb.ambiguous.is_some() {
            self.fail(
                Invariant::AmbiguousCreateAdoptedBeforeDestruction,
                id,
                format!(
                    "marked destroyed with an unresolved ambiguous {:?}",
                    rb.ambiguous
                ),
            );
        }
        let key = ResourceKey {
            run_id: a.run_id.clone(),
            node: *id,
            attempt: na.attempt,
        };
        let live = provider.live_keys().iter().filter(|k| **k == key).count();
        let running = provider.in_flight(id, na.attempt);
        if live > 0 || running > 0 {
            self.fail(
                Invariant::DestroyedAttemptLeaksNothing,
                id,
                format!("attempt {} marked destroyed while the provider holds {live} live resource(s) and runs {running} operation(s) for it", na.attempt),
            );
        }
        let delay = na.record.restart_at.map(|t| t.saturating_since(now));
        let (lo, hi) = backoff_window(&self.config, na.retry.consecutive_failures);
        if !delay.is_some_and(|d| (lo..=hi).contains(&d)) {
            self.fail(
                Invariant::BackoffWithinFloorAndCap,
                id,
                format!(
                    "restart in {delay:?} ms after {} failures; window is [{lo}, {hi}]",
                    na.retry.consecutive_failures
                ),
            );
        }
    }

    fn observe_counters(&mut self, event: StepEvent<'_>, before: &Snapshot, after: &Snapshot) {
        let t = &mut self.tally;
        let mut count = |f: &Result<Folded, DriverError>| match f {
            Ok(Folded::Applied) => t.folded += 1,
            // Held by the host, never shown to the driver (yet).
            Ok(Folded::Discarded(swactor_provisioning::DiscardReason::Queued)) => {}
            Ok(Folded::Discarded(_)) => t.discarded += 1,
            Err(_) => {}
        };
        match event {
            StepEvent::Result { folded, .. }
            | StepEvent::Observation { folded, .. }
            | StepEvent::SubmitFailed { folded, .. } => count(folded),
            StepEvent::AgentLost { folded, .. } => count(&Ok(folded)),
            StepEvent::Timeout { folded } => self.count_expired(folded, before, after),
            StepEvent::Restart { .. } => {
                // A new host, a new driver: its counters start over.
                self.tally = after.stats;
                return;
            }
            StepEvent::Inventory
            | StepEvent::AgentJoined { .. }
            | StepEvent::Collect { .. }
            | StepEvent::Shutdown { .. }
            | StepEvent::Pause { .. } => {}
            StepEvent::Pass { pass, .. } => self.count_pass(pass, before, after),
            StepEvent::Update { .. } | StepEvent::Tick => {}
        }
        self.check_pass_queued(event, before, after);
        self.check_tally(after);
    }

    /// Tallies a timeout's expired operations; its folded count must match the nodes changed.
    fn count_expired(
        &mut self,
        folded: &Result<usize, DriverError>,
        before: &Snapshot,
        after: &Snapshot,
    ) {
        let inv = Invariant::DriverCountersMatchWhatHappened;
        let (b, a) = (&before.state, &after.state);
        let mut expired = 0u64;
        let mut changed = 0usize;
        for (id, nb) in &b.nodes {
            let Some(na) = a.nodes.get(id).filter(|na| na.attempt == nb.attempt) else {
                continue;
            };
            let exp = nb.pending.as_ref().is_some_and(|p| p.deadline <= after.now)
                && na.pending.is_none();
            let stalled =
                nb.record.stage != NodeStage::Failed && na.record.stage == NodeStage::Failed;
            expired += u64::from(exp);
            changed += usize::from(exp || stalled);
        }
        self.tally.expired += expired;
        if let Ok(n) = folded
            && *n != changed
        {
            self.report(
                inv,
                None,
                format!("handle_timeout said {n} folded; {changed} nodes changed"),
            );
        }
    }

    /// Tallies a pass, and checks its stats against what it did.
    fn count_pass(&mut self, pass: &Pass, before: &Snapshot, after: &Snapshot) {
        let inv = Invariant::DriverCountersMatchWhatHappened;
        self.tally.passes += 1;
        self.tally.dispatched += pass.dispatches.len() as u64;
        let (b, a) = (&before.state, &after.state);
        let mut transitioned: Vec<&LogicalNodeId> = a
            .nodes
            .iter()
            .filter(|(id, na)| match b.nodes.get(id) {
                None => true,
                Some(nb) => {
                    nb.attempt != na.attempt
                        || nb.intent != na.intent
                        || (na.record.stage == NodeStage::Destroyed)
                            != (nb.record.stage == NodeStage::Destroyed)
                        || (na.record.ready && !nb.record.ready)
                }
            })
            .map(|(id, _)| id)
            .chain(b.nodes.keys().filter(|id| !a.nodes.contains_key(id)))
            .collect();
        transitioned.sort();
        let st = &pass.stats;
        let ok = pass.number == self.tally.passes
            && st.nodes == b.nodes.len()
            && st.dispatched == pass.dispatches.len()
            && st.errors == pass.errors.len()
            && st.transitions == transitioned.len();
        if !ok {
            self.report(
                inv,
                None,
                format!(
                    "pass {} with stats {st:?} ({} dispatches, {} errors, {} nodes before, {} transitions seen)",
                    pass.number,
                    pass.dispatches.len(),
                    pass.errors.len(),
                    b.nodes.len(),
                    transitioned.len()
                ),
            );
        }
    }

    /// Work-queue semantics: a folded input or served timer queues a pass, a discarded one not.
    fn check_pass_queued(&mut self, event: StepEvent<'_>, before: &Snapshot, after: &Snapshot) {
        let inv = Invariant::DriverCountersMatchWhatHappened;
        let queued_ok = match (before.pass_queued, after.pass_queued) {
            (Some(was), Some(is)) => match event {
                StepEvent::Result { folded, .. } | StepEvent::Observation { folded, .. } => {
                    match folded {
                        Ok(Folded::Applied) => is,
                        _ => is == was,
                    }
                }
                StepEvent::AgentLost { folded, .. } => match folded {
                    Folded::Applied => is,
                    Folded::Discarded(_) => is == was,
                },
                // Only a due core deadline queues a pass; the host's own
                // (a grace, a sweep, a retry of a collection) do not.
                StepEvent::Timeout { .. } => is || before.timer.is_none_or(|t| t > after.now),
                // A tick queues a pass exactly when a deadline is due.
                StepEvent::Tick => is == (was || before.timer.is_some_and(|t| t <= after.now)),
                StepEvent::Update {
                    outcome: Ok(DesiredUpdate::Accepted(_)),
                    ..
                } => is,
                _ => true,
            },
            _ => true,
        };
        // A deaf gap noticed at this step may have moved stall deadlines,
        // which queues a pass whatever the input was.
        let deaf_moved = after.deaf != before.deaf && after.pass_queued == Some(true);
        if !queued_ok && !deaf_moved {
            self.report(
                inv,
                None,
                format!(
                    "a pass queued {:?} -> {:?}",
                    before.pass_queued, after.pass_queued
                ),
            );
        }
    }

    /// The driver's counters equal the tally; a drift is reported once.
    fn check_tally(&mut self, after: &Snapshot) {
        let inv = Invariant::DriverCountersMatchWhatHappened;
        let (got, want) = (&after.stats, &self.tally);
        let same = got.passes == want.passes
            && got.dispatched == want.dispatched
            && got.folded == want.folded
            && got.discarded == want.discarded
            && got.expired == want.expired;
        if !same {
            let detail = format!("driver says {got:?}, the host saw {want:?}");
            self.report(inv, None, detail);
            // Report a drift once, not on every later step.
            self.tally = *got;
        }
    }

    fn check_observation_fold(
        &mut self,
        obs: &BootstrapObservation,
        nb: &ManagedNode,
        na: &ManagedNode,
        now: Timestamp,
    ) {
        let inv = Invariant::BootstrapFactsClassified;
        let node = &obs.node;
        let live = nb.intent == Intent::Active && nb.record.stage != NodeStage::Failed;
        let failure_stage = |s: BootstrapStage| {
            matches!(
                s,
                BootstrapStage::SshConnectFailed
                    | BootstrapStage::BootCheckFailed
                    | BootstrapStage::SwactorStartFailed
                    | BootstrapStage::JoinFailed
                    | BootstrapStage::AgentLost
            )
        };
        let converged_before = nb.record.stage == NodeStage::SwactorJoined
            && nb.record.bootstrap == Some(BootstrapStage::Converged);
        let fails = live
            && match &obs.event {
                BootstrapEvent::Failed { .. } => true,
                BootstrapEvent::Stage(s) => failure_stage(*s),
                BootstrapEvent::Closed => !nb.record.ready && !converged_before,
                BootstrapEvent::SwactorJoined => false,
            };
        let stall = now
            .0
            .checked_add(self.config.bootstrap_stall_ms)
            .map(Timestamp);
        let (rb, ra) = (&nb.record, &na.record);
        let mut problems = Vec::new();
        if fails {
            if ra.stage != NodeStage::Failed
                || ra.ready
                || na.retry.consecutive_failures != nb.retry.consecutive_failures.saturating_add(1)
                || na.retry.next_effect_at.is_some()
                || ra.bootstrap_deadline.is_some()
            {
                problems.push(
                    "a failure of a live attempt was not folded as one failure that ends it"
                        .to_owned(),
                );
            }
        } else {
            if na.retry.consecutive_failures != nb.retry.consecutive_failures {
                problems.push(
                    "a fact that is not a failure of a live attempt changed the failure count"
                        .to_owned(),
                );
            }
            let joins = matches!(obs.event, BootstrapEvent::SwactorJoined)
                && live
                && rb.stage == NodeStage::BootstrapRunning;
            let expected_stage = if joins {
                NodeStage::SwactorJoined
            } else {
                rb.stage
            };
            if ra.stage != expected_stage {
                problems.push(format!("stage {:?} became {:?}", rb.stage, ra.stage));
            }
            let boot_check = now
                .0
                .checked_add(stall_during_boot_check_ms(&self.config, nb))
                .map(Timestamp);
            let expected_deadline = match &obs.event {
                BootstrapEvent::Stage(BootstrapStage::BootCheck) if live && !rb.ready => boot_check,
                BootstrapEvent::Stage(_) if live && !rb.ready => stall,
                BootstrapEvent::SwactorJoined if joins => stall,
                BootstrapEvent::Closed => None,
                _ => rb.bootstrap_deadline,
            };
            if ra.bootstrap_deadline != expected_deadline {
                problems.push(format!(
                    "stall deadline {:?} became {:?}, expected {expected_deadline:?}",
                    rb.bootstrap_deadline, ra.bootstrap_deadline
                ));
            }
        }
        if matches!(obs.event, BootstrapEvent::Closed) && ra.session.is_some() {
            problems.push("a closed stream's session is still held".to_owned());
        }
        if let BootstrapEvent::Stage(s) = obs.event
            && ra.bootstrap != Some(s)
        {
            problems.push(format!(
                "the last bootstrap fact is {:?}, not {s:?}",
                ra.bootstrap
            ));
        }
        for p in problems {
            self.fail(inv, node, format!("{:?}: {p}", obs.event));
        }
    }

    fn check_ladder_on_result(
        &mut self,
        result: &OperationResult,
        nb: &ManagedNode,
        na: &ManagedNode,
        now: Timestamp,
    ) {
        let (rb, ra) = (&nb.record, &na.record);
        let stall = now
            .0
            .checked_add(self.config.bootstrap_stall_ms)
            .map(Timestamp);
        let ok = match &result.outcome {
            OperationOutcome::LeaseCreated { lease, endpoint } => {
                let stage = if endpoint.is_some() {
                    NodeStage::EndpointKnown
                } else {
                    NodeStage::LeaseCreated
                };
                ra.stage == stage
                    && ra.lease.as_ref() == Some(lease)
                    && ra.endpoint == *endpoint
                    && ra.ambiguous.is_none()
            }
            OperationOutcome::EndpointFound { endpoint } => {
                let stage = if rb.stage == NodeStage::LeaseCreated {
                    NodeStage::EndpointKnown
                } else {
                    rb.stage
                };
                ra.stage == stage && ra.endpoint.as_ref() == Some(endpoint)
            }
            OperationOutcome::BootstrapStarted { session } => {
                let active = nb.intent == Intent::Active;
                let (stage, deadline) = if active {
                    (NodeStage::BootstrapRunning, stall)
                } else {
                    (rb.stage, rb.bootstrap_deadline)
                };
                ra.stage == stage
                    && ra.bootstrap_deadline == deadline
                    && ra.session.as_ref() == Some(session)
                    && ra.ambiguous.is_none()
            }
            OperationOutcome::BootstrapCancelled | OperationOutcome::BootstrapGivenUp { .. } => {
                ra.session.is_none() && ra.bootstrap_deadline.is_none()
            }
            OperationOutcome::LeaseDestroyed | OperationOutcome::LeaseGivenUp { .. } => {
                ra.lease.is_none() && ra.endpoint.is_none()
            }
            OperationOutcome::EndpointNotReady | OperationOutcome::Failed { .. } => true,
        };
        let success = !matches!(
            result.outcome,
            OperationOutcome::Failed { .. } | OperationOutcome::EndpointNotReady
        );
        if !ok || (success && (na.pending.is_some() || na.retry.next_effect_at.is_some())) {
            self.fail(
                Invariant::StageLadderFollowsFacts,
                &result.node,
                format!(
                    "{:?} moved {:?} to {:?} (pending {:?}, next effect {:?})",
                    result.outcome, rb, ra, na.pending, na.retry.next_effect_at
                ),
            );
        }
    }

    /// Follows the operator's pauses, teardowns and restarts (the oracle's
    /// own idea of whether the host is paused).
    fn observe_pause(&mut self, event: StepEvent<'_>, before: &Snapshot, after: &Snapshot) {
        let inv = Invariant::PausedDispatchesNothingNew;
        match event {
            StepEvent::Pause { paused, outcome } => match outcome {
                Ok(changed) => {
                    if *changed != (self.paused != paused) {
                        self.report(
                            inv,
                            None,
                            format!("the host said changed = {changed} going from paused = {} to {paused}", self.paused),
                        );
                    }
                    self.paused = paused;
                    self.pause_acked = false;
                }
                Err(PauseError::ShuttingDown) => {
                    if !(paused && before.shutting_down) {
                        self.report(
                            inv,
                            None,
                            format!("a pause = {paused} refused outside a teardown"),
                        );
                    }
                }
            },
            StepEvent::Shutdown {
                mode: ShutdownMode::Teardown,
            } if !before.shutting_down => {
                // A teardown overrides the pause.
                self.paused = false;
                self.pause_acked = false;
            }
            StepEvent::Restart { durable } => {
                if self.pause_acked && durable.meta.paused != self.paused {
                    self.report(
                        inv,
                        None,
                        format!(
                            "paused = {} was acknowledged, but the journal says {}",
                            self.paused, durable.meta.paused
                        ),
                    );
                }
                self.paused = durable.meta.paused;
            }
            _ => {}
        }
        if after.paused != self.paused {
            self.report(
                inv,
                None,
                format!(
                    "the host says paused = {}, the operator's requests say {}",
                    after.paused, self.paused
                ),
            );
        }
    }

    /// The budgets the offered shape gave `group` at the generation
    /// `desired` is at, if a host accepted that generation from a shape.
    fn policy(&self, desired: &DesiredState, group: &str) -> Option<PolicyShape> {
        self.policies
            .get(&desired.generation)
            .and_then(|p| p.get(group))
            .copied()
    }

    /// Records accepted budgets; checks rollouts against them and the breaker.
    fn observe_budgets(&mut self, event: StepEvent<'_>, before: &Snapshot, after: &Snapshot) {
        match event {
            StepEvent::Update {
                shape,
                outcome: Ok(update),
            } => {
                let policies = shape
                    .groups
                    .iter()
                    .map(|g| (g.id.clone(), g.policy))
                    .collect();
                // A generation a crash lost before it was durable can be
                // accepted again with other content: the latest one counts.
                self.policies.insert(update.generation(), policies);
            }
            StepEvent::Pass { .. } => {
                self.check_rollout(before, after);
                self.check_breaker_restarts(before, after);
            }
            StepEvent::AgentLost {
                node,
                folded: Folded::Applied,
                ..
            } => self.check_breaker_fold(node, before),
            _ => {}
        }
        // An agent is held only while its group is over its limit.
        let newly: Vec<LogicalNodeId> = after
            .held_lost
            .difference(&before.held_lost)
            .cloned()
            .collect();
        for node in newly {
            let over = self.unhealthy_and_limit(&node.group.to_string(), before, Some(&node));
            if over.is_none_or(|(unhealthy, max)| unhealthy <= max) {
                self.fail(
                    Invariant::BreakerHoldsWhenOverLimit,
                    &node,
                    format!(
                        "held as lost though its group is within its limit (unhealthy, max: {over:?})"
                    ),
                );
            }
        }
    }

    /// (unhealthy desired slots, resolved max_unhealthy) of `group` in
    /// `snap`, counting `also` as unhealthy; `None` when the group has no limit.
    fn unhealthy_and_limit(
        &self,
        group: &str,
        snap: &Snapshot,
        also: Option<&LogicalNodeId>,
    ) -> Option<(u32, u32)> {
        let g = snap
            .desired
            .groups
            .iter()
            .find(|g| g.id.to_string() == group)?;
        let max = self
            .policy(&snap.desired, group)?
            .resolve()
            .max_unhealthy_of(g.count)?;
        let unhealthy = snap
            .state
            .nodes
            .iter()
            .filter(|(id, n)| {
                id.group == g.id
                    && id.index < g.count
                    && (snap.away.contains(*id)
                        || n.record.failed_reason().is_some()
                        || also == Some(*id))
            })
            .count() as u32;
        Some((unhealthy, max))
    }

    /// The groups of `snap` over their `max_unhealthy`.
    fn tripped(&self, snap: &Snapshot) -> BTreeSet<GroupId> {
        snap.desired
            .groups
            .iter()
            .filter(|g| {
                self.unhealthy_and_limit(&g.id.to_string(), snap, None)
                    .is_some_and(|(unhealthy, max)| unhealthy > max)
            })
            .map(|g| g.id)
            .collect()
    }

    /// No failed slot of a group over its limit got a new attempt of the
    /// same template in this pass.
    fn check_breaker_restarts(&mut self, before: &Snapshot, after: &Snapshot) {
        let tripped = self.tripped(before);
        if tripped.is_empty() {
            return;
        }
        for (id, nb) in &before.state.nodes {
            if !tripped.contains(&id.group) || nb.record.failed_reason().is_none() {
                continue;
            }
            let Some(na) = after.state.nodes.get(id) else {
                continue;
            };
            if na.attempt != nb.attempt && same_template(&na.template, &nb.template) {
                let (unhealthy, max) = self
                    .unhealthy_and_limit(&id.group.to_string(), before, None)
                    .unwrap_or_default();
                self.fail(
                    Invariant::BreakerHoldsWhenOverLimit,
                    id,
                    format!(
                        "failed attempt {} restarted as {} while {unhealthy} of group {} were unhealthy, more than its max_unhealthy of {max}",
                        nb.attempt, na.attempt, id.group
                    ),
                );
            }
        }
    }

    /// An away agent's node was failed: its group must have been within its limit.
    fn check_breaker_fold(&mut self, node: &LogicalNodeId, before: &Snapshot) {
        if let Some((unhealthy, max)) =
            self.unhealthy_and_limit(&node.group.to_string(), before, Some(node))
            && unhealthy > max
        {
            self.fail(
                Invariant::BreakerHoldsWhenOverLimit,
                node,
                format!(
                    "a lost agent's node was failed while {unhealthy} of group {} were unhealthy, more than its max_unhealthy of {max}",
                    node.group
                ),
            );
        }
    }

    /// A pass takes ready, outdated nodes down within budget, in slot
    /// order, and none while the rollout is stopped.
    fn check_rollout(&mut self, before: &Snapshot, after: &Snapshot) {
        let inv = Invariant::RolloutWithinBudget;
        for g in &before.desired.groups {
            let Some(policy) = self.policy(&before.desired, &g.id.to_string()) else {
                continue;
            };
            let resolved = policy.resolve();
            let max = resolved.max_unavailable_of(g.count);
            let surge = spec_surge(&before.state, g, resolved.max_surge_of(g.count));
            self.check_surge(g, surge, before, after);
            let mut ready = 0u32;
            let mut taken: Vec<LogicalNodeId> = Vec::new();
            let mut kept: Vec<LogicalNodeId> = Vec::new();
            let mut failing: Option<LogicalNodeId> = None;
            for (id, nb) in before
                .state
                .nodes
                .iter()
                .filter(|(id, _)| id.group == g.id && id.index < g.count + surge)
            {
                let current = same_template(&nb.template, &g.template);
                if !nb.is_ready() {
                    if current && nb.retry.template_failures() > 0 && failing.is_none() {
                        failing = Some(*id);
                    }
                    continue;
                }
                ready += 1;
                if current {
                    continue;
                }
                let down =
                    after.state.nodes.get(id).is_some_and(|na| {
                        na.attempt == nb.attempt && na.intent == Intent::Deleting
                    });
                if down {
                    taken.push(*id);
                } else {
                    kept.push(*id);
                }
            }
            let Some(last) = taken.last() else {
                continue;
            };
            // At least `count - max` stay ready, surge nodes included.
            if ready < taken.len() as u32 + g.count.saturating_sub(max) {
                self.fail(
                    inv,
                    last,
                    format!(
                        "took {} ready node(s) of {} down in one pass with {ready} ready ({surge} surge slot(s)) of {}; max_unavailable is {max}",
                        taken.len(),
                        g.id,
                        g.count
                    ),
                );
            }
            if let Some(skipped) = kept.iter().find(|k| k.index < last.index) {
                self.fail(
                    inv,
                    last,
                    format!("took {last} down before {skipped}, a lower slot of the old template"),
                );
            }
            if let Some(f) = &failing {
                self.fail(
                    inv,
                    last,
                    format!(
                        "took {last} down while {f}, of the new template, was failing (the rollout is stopped)"
                    ),
                );
            }
        }
    }

    /// A pass gives a slot above `g`'s `count` a new attempt only below
    /// `count + surge`, `surge` being what the spec allows in `before`.
    fn check_surge(&mut self, g: &DesiredGroup, surge: u32, before: &Snapshot, after: &Snapshot) {
        for (id, na) in after
            .state
            .nodes
            .iter()
            .filter(|(id, _)| id.group == g.id && id.index >= g.count + surge)
        {
            let new_attempt = before
                .state
                .nodes
                .get(id)
                .is_none_or(|nb| nb.attempt != na.attempt);
            if new_attempt {
                self.fail(
                    Invariant::SurgeWithinBudget,
                    id,
                    format!(
                        "attempt {} made for a slot above {}'s count of {} with {surge} surge slot(s) allowed",
                        na.attempt, g.id, g.count
                    ),
                );
            }
        }
    }

    /// A pass of a paused host: only cleanup of deleting and failed attempts.
    fn check_paused_pass(&mut self, pass: &Pass, before: &Snapshot, after: &Snapshot) {
        let inv = Invariant::PausedDispatchesNothingNew;
        let (b, a) = (&before.state, &after.state);
        for (id, na) in &a.nodes {
            let Some(nb) = b.nodes.get(id) else {
                self.fail(
                    inv,
                    id,
                    format!("slot inserted while paused ({})", na.attempt),
                );
                continue;
            };
            if nb.attempt != na.attempt {
                self.fail(
                    inv,
                    id,
                    format!(
                        "attempt {} replaced by {} while paused",
                        nb.attempt, na.attempt
                    ),
                );
            }
            if nb.intent == Intent::Active
                && na.intent == Intent::Deleting
                && nb.record.stage != NodeStage::Failed
            {
                self.fail(
                    inv,
                    id,
                    format!(
                        "live attempt {} ({:?}) began deleting while paused",
                        nb.attempt, nb.record.stage
                    ),
                );
            }
        }
        for d in &pass.dispatches {
            let id = &d.key.node;
            // An attempt adopted with its lease re-attaches to what runs
            // (its endpoint, its session); that makes nothing new.
            let reattach = |nb: &ManagedNode| {
                nb.record.resuming
                    && matches!(
                        d.request.kind(),
                        EffectKind::LookupEndpoint | EffectKind::StartBootstrap
                    )
            };
            if b.nodes
                .get(id)
                .is_none_or(|nb| nb.intent != Intent::Deleting && !reattach(nb))
            {
                self.fail(
                    inv,
                    id,
                    format!(
                        "{:?} dispatched for a live attempt ({}) while paused",
                        d.request.kind(),
                        d.key.attempt
                    ),
                );
            }
        }
    }

    /// Checks the state after every step, on its own.
    pub fn check(&mut self, after: &Snapshot, provider: &dyn ProviderView) {
        let a = &after.state;
        for (id, n) in &a.nodes {
            self.check_node(id, n, a, provider);
        }
        for (key, stats) in provider.key_stats() {
            if stats.leases_created > 1 || stats.live_leases > 1 || stats.open_sessions > 1 {
                self.fail(
                    Invariant::NoDoubleCreate,
                    &key.node,
                    format!("identity {key}: {stats:?}"),
                );
            }
        }
        if provider.overlaps() > 0 {
            self.report(
                Invariant::OneRunningOperationPerAttempt,
                None,
                format!("{} overlapping operations", provider.overlaps()),
            );
        }
        let converged = independently_converged(a, &after.desired)
            && after.host_settled
            && after.agents_away == 0;
        if converged != after.converged_claim {
            self.report(
                Invariant::ConvergedMeansExactSpecs,
                None,
                format!(
                    "the driver says converged = {}, the spec says {converged}",
                    after.converged_claim
                ),
            );
        }
        if converged {
            self.check_converged(after, provider);
        }
    }

    /// One node on its own: holdings when destroyed, its stall deadline, its facts' owners.
    fn check_node(
        &mut self,
        id: &LogicalNodeId,
        n: &ManagedNode,
        a: &ClusterState,
        provider: &dyn ProviderView,
    ) {
        let rec = &n.record;
        if rec.stage == NodeStage::Destroyed
            && (rec.lease.is_some()
                || rec.session.is_some()
                || rec.endpoint.is_some()
                || rec.ambiguous.is_some()
                || n.pending.is_some())
        {
            self.fail(
                Invariant::DestroyedNodeHoldsNothing,
                id,
                format!("{rec:?} pending {:?}", n.pending),
            );
        }
        // A stall deadline only ever guards a live, unready, active stream.
        if rec.bootstrap_deadline.is_some()
            && !(n.intent == Intent::Active
                && rec.session.is_some()
                && !rec.ready
                && rec.stage != NodeStage::Failed
                && n.pending.is_none())
        {
            self.fail(
                Invariant::BootstrapFactsClassified,
                id,
                format!("a stall deadline outside a live bootstrap: {rec:?}"),
            );
        }
        let lease_owner = rec
            .lease
            .as_ref()
            .map(|l| provider.lease_owner(l).map(|(k, _)| k.clone()));
        let session_owner = rec
            .session
            .as_ref()
            .map(|s| provider.session_owner(s).map(|(k, _)| k.clone()));
        for owner in [lease_owner, session_owner].into_iter().flatten() {
            let ok = owner
                .as_ref()
                .is_some_and(|k| k.node == *id && k.attempt == n.attempt && k.run_id == a.run_id);
            if !ok {
                self.fail(
                    Invariant::FactsBelongToCurrentAttempt,
                    id,
                    format!("attempt {} holds a resource made for {owner:?}", n.attempt),
                );
            }
        }
    }

    /// A converged cluster runs the desired templates and leaks nothing.
    fn check_converged(&mut self, after: &Snapshot, provider: &dyn ProviderView) {
        let a = &after.state;
        for (id, n) in &a.nodes {
            let made_from = n
                .record
                .lease
                .as_ref()
                .and_then(|l| provider.lease_template(l));
            let wanted = after.desired.slot(id);
            if let (Some(made), Some(wanted)) = (made_from, wanted)
                && *made != **wanted
            {
                self.fail(
                    Invariant::ConvergedNodesRunDesiredTemplate,
                    id,
                    format!(
                        "converged, but attempt {}'s machine was made from {:?}, not the desired {:?}",
                        n.attempt, made.boot, wanted.boot
                    ),
                );
            }
        }
        for key in provider.live_keys() {
            let owned = key.run_id == a.run_id
                && a.nodes
                    .get(&key.node)
                    .is_some_and(|n| n.attempt == key.attempt);
            if !owned {
                self.fail(
                    Invariant::ConvergedLeaksNothing,
                    &key.node,
                    format!("converged, but the provider still holds a resource of {key}"),
                );
            }
        }
    }

    /// Checks a driver that has drained every pass at `after.now`.
    pub fn on_quiescent(&mut self, after: &Snapshot, passes: usize, passes_max: usize) {
        if passes > passes_max {
            self.report(
                Invariant::NoHotLoop,
                None,
                format!("{passes} passes at {} and still going", after.now),
            );
        }
        if after.pass_queued == Some(true) && passes <= passes_max {
            self.report(
                Invariant::DriverCountersMatchWhatHappened,
                None,
                "a drained driver still has a pass queued".to_owned(),
            );
        }
        let tripped = self.tripped(after);
        let plan = reconcile_with(
            &after.state,
            &after.desired,
            after.now,
            self.paused,
            &tripped,
        );
        if let Some(first) = plan.actions.first() {
            self.fail(
                Invariant::SettledStatePlansNothing,
                &first.node,
                format!(
                    "a drained driver still plans {:?} ({})",
                    first.action, first.row
                ),
            );
        }
        let expected = earliest_waiting_deadline(&after.state, &after.desired, after.now);
        // Equality only: a deadline may fall due at this very instant and be
        // served right after (the harness checks a served timer moves on).
        if after.timer != expected {
            self.report(
                Invariant::RequeueAtEarliestWaitingDeadline,
                None,
                format!(
                    "timer {:?} at {}, earliest waiting deadline {expected:?}",
                    after.timer, after.now
                ),
            );
        }
    }

    /// End-of-run checks on a run that was driven to convergence: it stays
    /// converged and the provider holds exactly what the current attempts own.
    pub fn finish(&mut self, after: &Snapshot, provider: &dyn ProviderView) {
        self.context = "end of run".to_owned();
        let a = &after.state;
        if !independently_converged(a, &after.desired) {
            self.report(
                Invariant::FairConvergenceWithinBound,
                None,
                "the run ended unconverged".to_owned(),
            );
            return;
        }
        for (id, n) in &a.nodes {
            let owned_live = n
                .record
                .lease
                .as_ref()
                .and_then(|l| provider.lease_owner(l))
                .is_some_and(|(k, live)| live && k.node == *id && k.attempt == n.attempt);
            if !owned_live {
                self.fail(
                    Invariant::ConvergedLeaksNothing,
                    id,
                    format!(
                        "ready attempt {} holds no live lease of its own ({:?})",
                        n.attempt, n.record.lease
                    ),
                );
            }
        }
        let mut leases_per_node: BTreeMap<ResourceKey, usize> = BTreeMap::new();
        for key in provider.live_keys() {
            *leases_per_node.entry(key).or_default() += 1;
        }
        for (key, count) in leases_per_node {
            let owned = a
                .nodes
                .get(&key.node)
                .is_some_and(|n| n.attempt == key.attempt);
            if !owned || count > 2 {
                self.fail(
                    Invariant::ConvergedLeaksNothing,
                    &key.node,
                    format!("{count} live resource(s) of {key} that no current attempt owns"),
                );
            }
        }
    }
}
