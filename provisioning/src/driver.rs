//! The driver core: the sole writer of [`ClusterState`], sans-IO.
//!
//! # Calling order
//! A host (an actor, a test harness) owns one [`Driver`] and calls it like this:
//!
//! 1. Feed inputs as they arrive: [`Driver::update_desired`],
//!    [`Driver::handle_result`], [`Driver::handle_bootstrap`],
//!    [`Driver::handle_timeout`] (when the timer from step 3 fires) and
//!    [`Driver::handle_tick`] (a periodic safety net).
//! 2. Drain passes: `while let Some(pass) = driver.poll_pass(now)? { ... }`.
//!    Every [`Dispatch`] in a pass is ALREADY RECORDED AS PENDING. The host
//!    MUST submit each one to an executor (or report it with
//!    [`Driver::handle_submit_failed`]) and then MUST call
//!    [`Driver::finish_pass`]. DO NOT call `poll_pass` again before
//!    `finish_pass`: that is re-entry and is refused.
//! 3. Arm ONE timer at [`Driver::poll_timeout`] and go back to step 1.
//!
//! # Guarantees
//! Trigger semantics are those of a single-key work queue: triggers while a
//! pass is queued collapse into it; a trigger while a pass runs (between
//! `poll_pass` and `finish_pass`) guarantees exactly one follow-up pass.
//!
//! Over 1,000 lines in one file on purpose: the driver core is the sole
//! writer of the cluster state, and every write is kept in one place to
//! audit.

use crate::config::{ConfigError, ReconcilerConfig};
use crate::decide::{
    LadderRow, NodeAction, Plan, PlannedAction, RolloutGates, RolloutStatus, is_converged,
    reconcile_node_gated, reconcile_node_paused, reconcile_with, rollout_holds, walk,
};
use crate::id::{
    Generation, GroupId, LeaseId, LogicalNodeId, NodeAttemptId, NodeEndpoint, OperationId,
    ResourceKey, RunId, SessionId,
};
use crate::nodemap::NodeTable;
use crate::observe::{
    BootstrapObservation, DiscardReason, FailureClass, Folded, OperationOutcome, OperationResult,
    fold_agent_lost, fold_bootstrap, fold_bootstrap_stall, fold_deadline, fold_result,
};
use crate::rollout::Breaker;
use crate::shape::{ClusterShape, DesiredState, NodeTemplate, ShapeError, same_template};
use crate::state::{
    ClusterState, EffectKind, FailureCause, Intent, ManagedNode, NodeStage, PendingOperation,
};
use crate::time::{DeadlineOverflow, Timestamp, earliest};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Why a shape update was refused. The driver's state is unchanged.
#[derive(Clone, Debug, PartialEq, thiserror::Error, Serialize)]
pub enum UpdateError {
    /// The shape itself is invalid.
    #[error("invalid shape: {0}")]
    Invalid(#[from] ShapeError),
    /// The shape is for another run; the run id is fixed for the driver's lifetime.
    #[error("run_id {given:?} does not match this driver's run {expected:?}")]
    RunMismatch {
        /// The driver's run.
        expected: RunId,
        /// The shape's run.
        given: RunId,
    },
    /// The generation went backwards.
    #[error("generation {given} is older than the current generation {current}")]
    GenerationRegressed {
        /// The current generation.
        current: Generation,
        /// The shape's generation.
        given: Generation,
    },
    /// The content changed but the generation did not.
    #[error("the shape changed but its generation {generation} did not; raise the generation")]
    SameGenerationChanged {
        /// The unchanged generation.
        generation: Generation,
    },
}

/// What an accepted shape update did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DesiredUpdate {
    /// The shape was identical to the current one; nothing happened.
    Unchanged(Generation),
    /// The shape became the desired state.
    Accepted(Generation),
}

impl DesiredUpdate {
    /// The generation desired after the update.
    pub fn generation(self) -> Generation {
        match self {
            Self::Unchanged(g) | Self::Accepted(g) => g,
        }
    }
}

/// A misuse of the driver or a limit reached while applying an action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
pub enum DriverError {
    /// `poll_pass` was called while a pass was running.
    #[error("a pass is already running; call finish_pass first")]
    Reentry,
    /// `finish_pass` was called with no pass running.
    #[error("no pass is running")]
    NotRunning,
    /// The attempt-id allocator is exhausted.
    #[error("attempt ids exhausted for {node}")]
    AttemptIdsExhausted {
        /// The slot that needed a new attempt.
        node: LogicalNodeId,
    },
    /// The per-attempt operation sequence is exhausted.
    #[error("operation sequence exhausted for {node}")]
    OperationSeqExhausted {
        /// The slot.
        node: LogicalNodeId,
    },
    /// A deadline overflowed the timestamp range.
    #[error("{node}: {source}")]
    Deadline {
        /// The slot.
        node: LogicalNodeId,
        /// The overflow.
        source: DeadlineOverflow,
    },
    /// The state lacks an input an effect needs (a bug: the decider never asks for it).
    #[error("{node}: {kind:?} needs a {missing} the node does not have")]
    MissingEffectInput {
        /// The slot.
        node: LogicalNodeId,
        /// The effect.
        kind: EffectKind,
        /// What is missing.
        missing: &'static str,
    },
}

/// The provider request of one dispatched effect.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum EffectRequest {
    /// Lease a machine for the key, adopting one that already exists.
    CreateLease {
        /// What to lease.
        template: Arc<NodeTemplate>,
    },
    /// Look up the lease's endpoint.
    LookupEndpoint {
        /// The lease.
        lease: LeaseId,
    },
    /// Start the bootstrap, adopting a running session for the key.
    StartBootstrap {
        /// The lease.
        lease: LeaseId,
        /// Where to reach the machine.
        endpoint: NodeEndpoint,
        /// What to start.
        template: Arc<NodeTemplate>,
    },
    /// Stop the session; already gone is success.
    CancelBootstrap {
        /// The session.
        session: SessionId,
    },
    /// Release the lease; already gone is success.
    DestroyLease {
        /// The lease.
        lease: LeaseId,
        /// Why its attempt failed, when it did (not when it is removed by
        /// a scale-down, a rollout or a teardown): a provider may avoid
        /// the machine for a while.
        #[serde(default)]
        failed: Option<String>,
    },
}

impl EffectRequest {
    /// The effect's kind.
    pub fn kind(&self) -> EffectKind {
        match self {
            Self::CreateLease { .. } => EffectKind::CreateLease,
            Self::LookupEndpoint { .. } => EffectKind::LookupEndpoint,
            Self::StartBootstrap { .. } => EffectKind::StartBootstrap,
            Self::CancelBootstrap { .. } => EffectKind::CancelBootstrap,
            Self::DestroyLease { .. } => EffectKind::DestroyLease,
        }
    }
}

/// One effect to submit, already recorded as the node's pending operation.
#[must_use]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dispatch {
    /// The operation's identity; executors deduplicate on it.
    pub op: OperationId,
    /// Who owns the external resource.
    pub key: ResourceKey,
    /// The stored deadline after which the driver folds the operation as ambiguous.
    pub deadline: Timestamp,
    /// What to do.
    pub request: EffectRequest,
}

/// One attempt to adopt: its key, and what is known of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdoptEntry {
    /// The attempt.
    pub key: ResourceKey,
    /// The template it was made from, when known: its slot's desired
    /// template, or an older one (with a listed lease, the node resumes and
    /// its group's rollout replaces it within budget); `None` when not
    /// known (it is replaced at once).
    pub template: Option<Arc<NodeTemplate>>,
    /// Its lease, when the provider listed one. A listed lease is taken as
    /// it is (never created again); without one, the create is re-issued
    /// under the key so the provider finds it or makes it once.
    pub lease: Option<LeaseId>,
    /// Its bootstrap session, when the provider listed one.
    pub session: Option<SessionId>,
    /// The slot's failures with this template since it was last ready, as
    /// the journal recorded them ([`RetryState::template_failures`]): they
    /// carry on, so a stopped rollout stays stopped and the backoff goes on
    /// where it was.
    ///
    /// [`RetryState::template_failures`]: crate::RetryState::template_failures
    pub failures: u32,
}

/// What [`Driver::adopt`] did with the keys it was given.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adoption {
    /// Keys that became (or already were) a slot's node.
    pub adopted: Vec<ResourceKey>,
    /// Keys of this run that no node will own: destroy what they hold.
    pub orphans: Vec<ResourceKey>,
    /// Adopted keys of desired slots whose template is not (known to be) the
    /// desired one: they are replaced.
    pub drifted: Vec<ResourceKey>,
    /// Keys of other runs, left alone.
    pub foreign: Vec<ResourceKey>,
}

/// The template of an adopted node whose slot is not desired; it is only ever cleaned up.
fn retired_template() -> Arc<NodeTemplate> {
    Arc::new(NodeTemplate {
        provider: crate::shape::ProviderShape {
            kind: "adopted".to_owned(),
            params: BTreeMap::new(),
            placement: Default::default(),
        },
        boot: crate::shape::BootParams::default(),
        role: "retired".to_owned(),
        join: crate::shape::SwarmJoin::default(),
        limits: crate::shape::NodeLimits::default(),
    })
}

/// Counters of one pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassStats {
    /// Nodes in the state when the pass began.
    pub nodes: usize,
    /// Driver transitions applied.
    pub transitions: usize,
    /// Effects dispatched.
    pub dispatched: usize,
    /// Actions refused with an error.
    pub errors: usize,
}

/// The output of one pass.
#[must_use = "every dispatch is recorded as pending and MUST be submitted"]
#[derive(Debug, Serialize)]
pub struct Pass {
    /// The pass's sequence number, from one.
    pub number: u64,
    /// Effects to submit, each already recorded as pending.
    pub dispatches: Vec<Dispatch>,
    /// Nodes a driver transition changed (inserted, deleting, destroyed,
    /// restarted, reaped or converged), in slot order.
    pub transitioned: Vec<LogicalNodeId>,
    /// Counters.
    pub stats: PassStats,
    /// Actions that could not be applied; their nodes are unchanged.
    pub errors: Vec<DriverError>,
}

/// Lifetime counters of a driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverStats {
    /// Passes run.
    pub passes: u64,
    /// Effects dispatched.
    pub dispatched: u64,
    /// Effects dispatched, by kind (at [`EffectKind::index`]); they add up
    /// to `dispatched`. See [`DriverStats::dispatched_of`].
    pub dispatched_by_kind: [u64; EffectKind::ALL.len()],
    /// Inputs folded into state.
    pub folded: u64,
    /// Inputs discarded as stale, superseded or mismatched.
    pub discarded: u64,
    /// Pending operations expired as ambiguous.
    pub expired: u64,
    /// Triggers that collapsed into an already queued or dirty pass.
    pub collapsed_triggers: u64,
}

impl DriverStats {
    /// Effects of `kind` dispatched.
    pub fn dispatched_of(&self, kind: EffectKind) -> u64 {
        self.dispatched_by_kind[kind.index()]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    Idle,
    Queued,
    Running { dirty: bool },
}

/// Which nodes the next pass must decide.
///
/// A node's decision can only change when its state changes (it is marked
/// dirty), when the desired state changes (everything is re-decided), or when
/// time reaches the deadline it waits on (it is in `wakes`). Every other node
/// would decide exactly what it decided last time, which for a waiting or
/// settled node is "nothing". So a pass decides only dirty and due nodes, and a
/// pass over a settled cluster costs nothing per node. The property test
/// `incremental_passes_equal_full_passes` checks this against [`reconcile`].
#[derive(Clone, Debug, Default)]
struct Eval {
    /// Re-decide every slot (the desired state changed, or an insert failed).
    full: bool,
    /// Nodes whose state changed since they were last decided, in the order
    /// they changed (a node may appear more than once; a pass sorts and
    /// deduplicates them). A vector whose capacity is kept from pass to pass
    /// (given back only after a pass that used a small part of a large one),
    /// so marking a node dirty does not allocate.
    dirty: Vec<LogicalNodeId>,
    /// Waiting nodes, bucketed by the deadline they wait on (a node is in
    /// exactly one bucket, at the position `wake_of` gives). Deadlines
    /// cluster (a pass gives every operation it dispatches the same one),
    /// so there are few buckets and moving a node is a swap.
    wakes: BTreeMap<Timestamp, u32>,
    /// The buckets `wakes` numbers; an emptied one is free for the next
    /// deadline (its number is in `free_buckets`).
    buckets: Vec<WakeBucket>,
    free_buckets: Vec<u32>,
    /// The deadline last given a bucket, and its number: a pass gives the
    /// nodes it dispatches one deadline, so most look-ups end here.
    last_bucket: Option<(Timestamp, u32)>,
    /// The bucket each waiting node is in, and its place in that bucket.
    wake_of: NodeTable<(u32, u32)>,
    /// Ready nodes of an outdated template that row 17 held back: their
    /// decision depends on the rest of their group, so every pass decides
    /// them again (in slot order with the others, as the budget requires).
    held: BTreeSet<LogicalNodeId>,
}

/// The nodes waiting on one deadline.
#[derive(Clone, Debug, Default)]
struct WakeBucket {
    at: Timestamp,
    ids: Vec<LogicalNodeId>,
}

impl Eval {
    fn set_wake(&mut self, id: &LogicalNodeId, wake: Option<Timestamp>) {
        let old = self.wake_of.get(id).copied();
        if old.map(|(b, _)| self.buckets[b as usize].at) == wake {
            return;
        }
        if let Some((b, pos)) = old {
            self.unbucket(b, pos);
        }
        match wake {
            Some(at) => {
                let b = self.bucket_at(at);
                let ids = &mut self.buckets[b as usize].ids;
                let pos = u32::try_from(ids.len()).expect("fewer than 2^32 waiting nodes");
                ids.push(*id);
                // Most nodes move from one bucket to another: changing the
                // entry in place costs less than an insert that replaces it
                // (0.8% of a 10k converge's instructions).
                match self.wake_of.get_mut(id) {
                    Some(w) => *w = (b, pos),
                    None => {
                        self.wake_of.insert(*id, (b, pos));
                    }
                }
            }
            None => {
                self.wake_of.remove(id);
            }
        }
    }

    /// The number of the bucket of deadline `at`, made if there is none.
    fn bucket_at(&mut self, at: Timestamp) -> u32 {
        if let Some((last, b)) = self.last_bucket
            && last == at
        {
            return b;
        }
        let b = match self.wakes.get(&at) {
            Some(&b) => b,
            None => {
                let bucket = WakeBucket {
                    at,
                    ids: Vec::new(),
                };
                let b = match self.free_buckets.pop() {
                    Some(b) => {
                        self.buckets[b as usize] = bucket;
                        b
                    }
                    None => {
                        self.buckets.push(bucket);
                        u32::try_from(self.buckets.len() - 1).expect("fewer than 2^32 deadlines")
                    }
                };
                self.wakes.insert(at, b);
                b
            }
        };
        self.last_bucket = Some((at, b));
        b
    }

    /// Takes the node at `pos` of bucket `b` out (the bucket's last node
    /// moves into its place).
    fn unbucket(&mut self, b: u32, pos: u32) {
        let bucket = &mut self.buckets[b as usize];
        bucket.ids.swap_remove(pos as usize);
        if let Some(moved) = bucket.ids.get(pos as usize) {
            if let Some(w) = self.wake_of.get_mut(moved) {
                w.1 = pos;
            }
        } else if bucket.ids.is_empty() {
            let at = bucket.at;
            // Its room goes too: a bucket of a large pass is large.
            bucket.ids = Vec::new();
            self.wakes.remove(&at);
            self.free_buckets.push(b);
            if self.last_bucket.is_some_and(|(_, last)| last == b) {
                self.last_bucket = None;
            }
        }
    }

    /// The nodes waiting on deadlines up to `now`.
    fn due(&self, now: Timestamp) -> impl Iterator<Item = &LogicalNodeId> {
        self.wakes
            .range(..=now)
            .flat_map(|(_, &b)| &self.buckets[b as usize].ids)
    }

    /// Dirty nodes, nodes whose deadline is due and nodes held by a
    /// rollout budget, in slot order, into `out` (cleared first; its
    /// capacity is reused, so a pass over a settled cluster does not allocate).
    fn candidates(&self, now: Timestamp, out: &mut Vec<LogicalNodeId>) {
        out.clear();
        out.extend(
            self.dirty
                .iter()
                .chain(self.due(now))
                .chain(&self.held)
                .cloned(),
        );
        // A stable sort, though equal ids are interchangeable: the ids come
        // in a few long sorted runs (results and observations are folded in
        // slot order), which it merges in linear time where an unstable
        // sort does not look for them.
        out.sort();
        out.dedup();
    }

    /// The earliest deadline a node outside `candidates` (sorted) waits on.
    fn earliest_other(&self, candidates: &[LogicalNodeId]) -> Option<Timestamp> {
        self.wakes
            .iter()
            .find(|(_, b)| {
                let ids = &self.buckets[**b as usize].ids;
                ids.iter().any(|id| candidates.binary_search(id).is_err())
            })
            .map(|(at, _)| *at)
    }
}

/// A full pass's plan, every waiting node's wake-up, and the nodes row 17 holds.
type FullDecision = (
    Plan,
    Vec<(Timestamp, LogicalNodeId)>,
    BTreeSet<LogicalNodeId>,
);

/// Buffers a pass reuses, so that deciding a few nodes of a large settled
/// cluster allocates nothing once they have grown to fit.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// The nodes the pass decides.
    candidates: Vec<LogicalNodeId>,
    /// What each decided node now waits on, and whether row 17 holds it.
    updates: Vec<(Option<Timestamp>, bool)>,
}

impl Scratch {
    /// Entries kept between passes however large the largest pass was.
    const KEEP: usize = 4096;

    /// Empties the buffers for the next pass. Their room is kept (a pass
    /// over a settled cluster allocates nothing), but not the room of one
    /// large pass for ever: after a pass that used less than an eighth of
    /// it, it shrinks to what that pass used or [`Scratch::KEEP`] (a
    /// 100k cold start otherwise held 40 B per node here once settled).
    fn clear_after_pass(&mut self) {
        let used = self.candidates.len();
        self.candidates.clear();
        self.updates.clear();
        give_back_room(&mut self.candidates, used);
        give_back_room(&mut self.updates, used);
    }
}

/// Shrinks the emptied buffer `v` after a pass that used `used` entries of
/// it, when that was under an eighth of its room: down to `used`, or
/// [`Scratch::KEEP`] entries. See [`Scratch::clear_after_pass`].
fn give_back_room<T>(v: &mut Vec<T>, used: usize) {
    if v.capacity() > Scratch::KEEP && used < v.capacity() / 8 {
        v.shrink_to(used.max(Scratch::KEEP));
    }
}

/// The sole writer of [`ClusterState`]; see the module docs for the calling order.
#[derive(Clone, Debug)]
pub struct Driver {
    config: ReconcilerConfig,
    desired: DesiredState,
    state: ClusterState,
    queue: Queue,
    requeue_at: Option<Timestamp>,
    stats: DriverStats,
    eval: Eval,
    scratch: Scratch,
    paused: bool,
    tripped: BTreeSet<GroupId>,
    /// The surge slots of each group that has some, as of the last pass
    /// ([`surge`](crate::surge)); a change makes the next pass a full one.
    surges: BTreeMap<GroupId, u32>,
    /// Failures of slots whose last attempt an earlier driver made and
    /// that are gone: the slot's next attempt starts with them (see
    /// [`Driver::carry_failures`]).
    carried: BTreeMap<LogicalNodeId, u32>,
}

impl Driver {
    /// A driver for `run_id` with nothing desired yet (generation 0 is the empty shape).
    ///
    /// # Errors
    /// `config` is invalid.
    pub fn new(run_id: RunId, config: ReconcilerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            state: ClusterState::new(run_id.clone(), config.first_attempt_id),
            desired: DesiredState::empty(run_id, Generation(0)),
            config,
            queue: Queue::Idle,
            requeue_at: None,
            stats: DriverStats::default(),
            eval: Eval::default(),
            scratch: Scratch::default(),
            paused: false,
            tripped: BTreeSet::new(),
            surges: BTreeMap::new(),
            carried: BTreeMap::new(),
        })
    }

    /// Pauses or resumes reconciling. A paused driver folds every input as
    /// before but its passes take only the actions
    /// [`allowed_while_paused`](crate::allowed_while_paused) lets through:
    /// cleanup of deleting and failed attempts, reaping, recorded
    /// convergence; nothing is inserted, restarted, replaced, scaled down or
    /// advanced. A change re-decides every node in the next pass, which it
    /// queues.
    pub fn set_paused(&mut self, paused: bool) {
        if self.paused == paused {
            return;
        }
        self.paused = paused;
        self.eval.full = true;
        self.trigger();
    }

    /// The groups whose remediation breaker is tripped, as the host works
    /// it out (it knows which agents are away; see
    /// [`breaker`](crate::breaker)): their failed slots get no new attempt
    /// of the same template (ladder row 18). A change re-decides every node
    /// in the next pass, which it queues.
    pub fn set_tripped(&mut self, tripped: BTreeSet<GroupId>) {
        if self.tripped == tripped {
            return;
        }
        self.tripped = tripped;
        self.eval.full = true;
        self.trigger();
    }

    /// The groups whose breaker is tripped (see [`Driver::set_tripped`]).
    pub fn tripped(&self) -> &BTreeSet<GroupId> {
        &self.tripped
    }

    /// Whether reconciling is paused (see [`Driver::set_paused`]).
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The observed state (read-only: only the driver writes it).
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The desired state.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// The configuration.
    pub fn config(&self) -> &ReconcilerConfig {
        &self.config
    }

    /// Lifetime counters.
    pub fn stats(&self) -> DriverStats {
        self.stats
    }

    /// True when the state is converged on the desired shape.
    pub fn is_converged(&self) -> bool {
        is_converged(&self.state, &self.desired)
    }

    /// As [`Driver::is_converged`], naming what is not: `Err(Some(node))`
    /// for a node that is not converged (looked for from `hint` on, then
    /// from the first slot up to it), `Err(None)` when the node count
    /// differs. The test is the same node for node, in another order: a
    /// check that starts where the last one stopped finds a converge in
    /// progress unfinished at once, instead of walking every ready node.
    ///
    /// # Errors
    /// The state is not converged.
    pub fn unconverged_from(
        &self,
        hint: Option<&LogicalNodeId>,
    ) -> Result<(), Option<LogicalNodeId>> {
        crate::decide::unconverged_from(&self.state, &self.desired, hint)
    }

    /// True when a pass is queued (the host should call `poll_pass`).
    pub fn is_pass_queued(&self) -> bool {
        self.queue == Queue::Queued
    }

    /// Checks a shape against the revision contract without applying it.
    ///
    /// # Errors
    /// As [`Driver::update_desired`].
    pub fn check_desired(&self, shape: &ClusterShape) -> Result<(DesiredState, bool), UpdateError> {
        let next = shape.validate()?;
        if next.run_id != self.state.run_id {
            return Err(UpdateError::RunMismatch {
                expected: self.state.run_id.clone(),
                given: next.run_id,
            });
        }
        let current = self.desired.generation;
        let same = next.same_content(&self.desired);
        if next.generation < current {
            return Err(UpdateError::GenerationRegressed {
                current,
                given: next.generation,
            });
        }
        if next.generation == current && !same {
            return Err(UpdateError::SameGenerationChanged {
                generation: current,
            });
        }
        let changed = next.generation > current;
        Ok((next, changed))
    }

    /// Offers a new desired shape under the revision contract: the run id is
    /// fixed; a content change needs a higher generation; an identical
    /// resubmission is a no-op; generations may be skipped.
    ///
    /// # Errors
    /// The shape is invalid or breaks the contract; nothing changes.
    pub fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError> {
        let (mut next, changed) = self.check_desired(shape)?;
        if !changed {
            return Ok(DesiredUpdate::Unchanged(next.generation));
        }
        next.share_templates_with(&self.desired);
        // A node whose slot only moved its placement keeps its attempt, but
        // its next effects see the new placement; one waiting out the
        // backoff of an effect that failed (say, no free host) tries again
        // at once, since the new placement may be what it waited for.
        for (id, node) in self.state.nodes.iter_mut() {
            if let Some(t) = next.slot(id)
                && !Arc::ptr_eq(t, &node.template)
                && same_template(t, &node.template)
            {
                if node.template.provider.placement != t.provider.placement
                    && node.pending.is_none()
                    && !node.is_ready()
                {
                    node.retry.next_effect_at = None;
                }
                node.template = t.clone();
            }
        }
        let generation = next.generation;
        for g in &next.groups {
            // Room for the group's slots in one allocation, not a doubling
            // vector's slack (a third of it, for a large group).
            self.state.nodes.reserve(&g.id, g.count);
        }
        self.desired = next;
        self.carried.clear();
        self.eval.full = true;
        self.trigger();
        Ok(DesiredUpdate::Accepted(generation))
    }

    /// Takes over resources a provider already holds for this run (left by an
    /// earlier driver, e.g. after a restart or a shutdown that kept its nodes).
    ///
    /// Each entry is a key and what is known of it (see [`AdoptEntry`]). An
    /// attempt whose template is not known to be its slot's desired one is
    /// drifted and replaced (or retired, if its slot is not desired).
    ///
    /// For each slot, the newest attempt found becomes the slot's node. A
    /// listed lease is taken as it is; without one the create is remembered
    /// as ambiguous, so the next pass re-issues it under the same key and the
    /// provider hands back what it already has (or makes it, once). The node
    /// carries on from there, or is cleaned up. Older attempts of a slot, and keys of slots that
    /// already have a node, are returned as orphans for the caller to
    /// destroy. The attempt allocator moves past every attempt seen, so no id
    /// is ever handed out twice. Adopted attempts number their operations
    /// from `op_seq_base`, so an operation id of an earlier driver is never
    /// reused.
    ///
    /// Call it after the first shape is applied, so adopted nodes are judged
    /// against their slot's desired template.
    pub fn adopt(&mut self, entries: Vec<AdoptEntry>, op_seq_base: u64) -> Adoption {
        let mut newest: BTreeMap<LogicalNodeId, AdoptEntry> = BTreeMap::new();
        let mut report = Adoption::default();
        for entry in entries {
            let key = &entry.key;
            if key.run_id != self.state.run_id {
                report.foreign.push(entry.key);
                continue;
            }
            self.state.next_attempt = self.state.next_attempt.max(key.attempt.0.saturating_add(1));
            match newest.get(&key.node) {
                Some(e) if e.key.attempt >= key.attempt => report.orphans.push(entry.key),
                Some(_) => {
                    let older = newest.insert(key.node, entry);
                    report.orphans.extend(older.map(|e| e.key));
                }
                None => {
                    newest.insert(key.node, entry);
                }
            }
        }
        for (node, entry) in newest {
            let key = entry.key;
            if self.state.nodes.contains_key(&node) {
                report.orphans.push(key);
                continue;
            }
            // The desired template is shared by Arc. An older one the slot
            // is known to run (with a listed lease) is kept while the node
            // resumes, so its group's rollout replaces it within budget.
            // Every node kept with a listed lease resumes: one whose
            // template a shape changes before it is ready again is rolled
            // like the others, not replaced at once.
            let desired = self.desired.slot(&node);
            let (template, keep) = match (entry.template, desired) {
                (Some(t), Some(d)) if same_template(&t, d) => (d.clone(), true),
                (Some(t), Some(_)) if entry.lease.is_some() => {
                    report.drifted.push(key.clone());
                    (t, true)
                }
                _ => {
                    if desired.is_some() {
                        report.drifted.push(key.clone());
                    }
                    (retired_template(), false)
                }
            };
            let resuming = keep && entry.lease.is_some();
            let mut managed = ManagedNode::new(key.attempt, template, entry.failures);
            if !keep {
                // Failures of a template the slot no longer runs.
                managed.retry.inherited_failures = entry.failures;
            }
            managed.next_op_seq = op_seq_base;
            let rec = &mut managed.record;
            rec.resuming = resuming;
            match entry.lease {
                Some(lease) => {
                    // It exists: take it as it is. Its endpoint is looked up;
                    // a node that is kept re-attaches to its running session
                    // through StartBootstrap, one that goes cancels it first.
                    rec.stage = NodeStage::LeaseCreated;
                    rec.lease = Some(lease);
                    if !keep {
                        rec.session = entry.session;
                    }
                }
                None => {
                    rec.stage = NodeStage::LeaseRequested;
                    rec.ambiguous = Some(crate::state::AmbiguousCreate::CreateLease);
                }
            }
            self.state.nodes.insert(node, managed);
            report.adopted.push(key);
        }
        if !report.adopted.is_empty() {
            self.eval.full = true;
            self.trigger();
        }
        report
    }

    /// The slot `node` held an attempt that failed `failures` times with
    /// the slot's desired template since it was last ready, and that
    /// attempt is gone (an earlier driver made it, the journal says so):
    /// the slot's next attempt starts with those failures, so a rollout
    /// stopped on it stays stopped and its backoff carries on. Forgotten
    /// when another shape is accepted.
    pub fn carry_failures(&mut self, node: LogicalNodeId, failures: u32) {
        if failures > 0 && !self.state.nodes.contains_key(&node) {
            self.carried.insert(node, failures);
        }
    }

    /// Makes sure no attempt id below `floor` is handed out from now on (a
    /// restarted host resumes above every id an earlier one may have used).
    pub fn raise_attempt_floor(&mut self, floor: u64) {
        self.state.next_attempt = self.state.next_attempt.max(floor);
    }

    /// The actions the next pass would take on the current desired state, without applying them.
    pub fn plan(&self, now: Timestamp) -> Plan {
        self.plan_on(&self.desired, now)
    }

    fn plan_on(&self, desired: &DesiredState, now: Timestamp) -> Plan {
        reconcile_with(&self.state, desired, now, self.paused, &self.tripped)
    }

    /// The actions the next pass would take if `shape` were applied, without applying anything.
    ///
    /// # Errors
    /// As [`Driver::update_desired`].
    pub fn plan_shape(&self, shape: &ClusterShape, now: Timestamp) -> Result<Plan, UpdateError> {
        let (next, _) = self.check_desired(shape)?;
        Ok(self.plan_on(&next, now))
    }

    /// Folds an operation result. Late, duplicated, superseded and mismatched
    /// results are discarded.
    ///
    /// # Errors
    /// A deadline computed by the fold overflows; the node is unchanged.
    pub fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.handle_result_ref(&result, now)
    }

    /// [`Driver::handle_result`] on a borrowed result (what it keeps of
    /// it, it copies).
    ///
    /// # Errors
    /// As [`Driver::handle_result`].
    pub fn handle_result_ref(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let Some(node) = self.state.nodes.get_mut(&result.node) else {
            let unknown = Folded::Discarded(DiscardReason::UnknownNode);
            return Ok(self.count(&result.node, unknown));
        };
        let folded =
            fold_result(node, result.op, &result.outcome, &self.config, now).map_err(|source| {
                DriverError::Deadline {
                    node: result.node,
                    source,
                }
            })?;
        Ok(self.count(&result.node, folded))
    }

    /// Reports that a dispatch could not be submitted; it folds as a definite
    /// failure of that operation (the executor never saw it).
    ///
    /// # Errors
    /// As [`Driver::handle_result`].
    pub fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let result = OperationResult {
            node: *node,
            op,
            outcome: OperationOutcome::Failed {
                class: FailureClass::Definite,
                reason: format!("submission failed: {reason}"),
            },
        };
        self.handle_result(result, now)
    }

    /// Folds a bootstrap stream observation. Observations of a superseded
    /// attempt or a session that is not the node's live one are discarded.
    ///
    /// # Errors
    /// The refreshed stall deadline overflows; the node is unchanged.
    pub fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.handle_bootstrap_ref(&obs, now)
    }

    /// [`Driver::handle_bootstrap`] on a borrowed observation (what it
    /// keeps of it, it copies).
    ///
    /// # Errors
    /// As [`Driver::handle_bootstrap`].
    pub fn handle_bootstrap_ref(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let Some(node) = self.state.nodes.get_mut(&obs.node) else {
            let unknown = Folded::Discarded(DiscardReason::UnknownNode);
            return Ok(self.count(&obs.node, unknown));
        };
        let folded = fold_bootstrap(
            node,
            obs.attempt,
            &obs.session,
            &obs.event,
            &self.config,
            now,
        )
        .map_err(|source| DriverError::Deadline {
            node: obs.node,
            source,
        })?;
        Ok(self.count(&obs.node, folded))
    }

    /// A joined agent is gone (its process exited, or it stayed disconnected
    /// past its group's grace period), or the host fails the attempt for
    /// another reason of its own (`cause` says which): fails the attempt so
    /// it is replaced. Inputs for a superseded attempt, or a node that is not
    /// active, are discarded.
    pub fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        cause: FailureCause,
        reason: &str,
        now: Timestamp,
    ) -> Folded {
        let folded = match self.state.nodes.get_mut(node) {
            Some(n) => fold_agent_lost(n, attempt, cause, reason.to_owned(), now),
            None => Folded::Discarded(DiscardReason::UnknownNode),
        };
        self.count(node, folded)
    }

    /// The host's timer fired: expires pending operations and stalled
    /// bootstraps whose stored deadlines have passed, and queues a pass if any
    /// waiting deadline is due. Returns how many deadlines were folded.
    ///
    /// # Errors
    /// A backoff deadline overflows; that node is unchanged, the others are folded.
    pub fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        if self.requeue_at.is_none_or(|at| at > now) {
            return Ok(0);
        }
        let mut folded = 0;
        let mut first_error = None;
        let mut due = std::mem::take(&mut self.scratch.candidates);
        self.eval.candidates(now, &mut due);
        for id in due.drain(..) {
            let Some(node) = self.state.nodes.get_mut(&id) else {
                continue;
            };
            let mut changed = false;
            match fold_deadline(node, &self.config, now) {
                Ok(Some(Folded::Applied)) => {
                    changed = true;
                    self.stats.expired += 1;
                }
                Ok(_) => {}
                Err(source) => {
                    first_error.get_or_insert(DriverError::Deadline { node: id, source });
                }
            }
            changed |= fold_bootstrap_stall(node, now);
            if changed {
                folded += 1;
                self.eval.dirty.push(id);
            }
        }
        self.scratch.candidates = due;
        self.trigger();
        first_error.map_or(Ok(folded), Err)
    }

    /// Nothing was heard from `from` to `to`, not because nothing happened
    /// but because whoever drives this core was not listening (see the
    /// host's deaf gaps). A bootstrap stall deadline that was still running
    /// at `from` moves on by the gap: a stream's silence the daemon could
    /// not hear fails no attempt. Other deadlines stay: an operation that
    /// expires meanwhile only folds as ambiguous and is re-issued (the
    /// provider adopts), and a backoff that ended is merely late.
    pub fn handle_unheard(&mut self, from: Timestamp, to: Timestamp) {
        let gap_ms = to.as_millis().saturating_sub(from.as_millis());
        if gap_ms == 0 {
            return;
        }
        let mut moved = false;
        for (id, node) in self.state.nodes.iter_mut() {
            let rec = &mut node.record;
            if let Some(at) = rec.bootstrap_deadline.filter(|at| *at > from) {
                rec.bootstrap_deadline = Some(at.saturating_add_ms(gap_ms));
                self.eval.dirty.push(*id);
                moved = true;
            }
        }
        if moved {
            self.trigger();
        }
    }

    /// The periodic safety-net tick: queues a pass if a waiting deadline is due.
    pub fn handle_tick(&mut self, now: Timestamp) {
        if self.requeue_at.is_some_and(|at| at <= now) {
            self.trigger();
        }
    }

    /// The earliest stored deadline among waiting nodes, as of the last pass.
    /// Arm ONE timer for it. (A queued pass should be drained first.)
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.requeue_at
    }

    /// Runs one pass if one is queued. Every returned dispatch is already
    /// recorded as pending; see the module docs for what the host MUST do.
    ///
    /// # Errors
    /// [`DriverError::Reentry`] when a pass is already running.
    pub fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError> {
        match self.queue {
            Queue::Running { .. } => return Err(DriverError::Reentry),
            Queue::Idle => return Ok(None),
            Queue::Queued => {}
        }
        self.queue = Queue::Running { dirty: false };
        self.stats.passes += 1;
        let plan = self.decide(now);
        self.state.observed_generation = Some(self.desired.generation);
        let mut pass = Pass {
            number: self.stats.passes,
            // Sized once rather than grown (and copied) over a large pass,
            // for the actions that dispatch: a pass of transitions only
            // (every node marked ready, say) holds no room for dispatches it
            // will not make. An empty plan allocates nothing.
            dispatches: Vec::with_capacity(
                plan.actions
                    .iter()
                    .filter(|a| !a.action.is_transition())
                    .count(),
            ),
            transitioned: Vec::new(),
            stats: PassStats {
                nodes: self.state.nodes.len(),
                ..PassStats::default()
            },
            errors: Vec::new(),
        };
        let mut requeue_at = plan.requeue_at;
        for planned in plan.actions {
            let transition = planned.action.is_transition();
            let id = planned.node;
            let insert = matches!(planned.action, NodeAction::Insert { .. });
            match self.apply(planned.node, planned.action, now) {
                Ok(Some(d)) => {
                    debug_assert_eq!(
                        self.state
                            .nodes
                            .get(&id)
                            .and_then(|n| n.pending.as_ref())
                            .map(|p| p.id),
                        Some(d.op),
                        "a dispatch is recorded pending on its node before it leaves"
                    );
                    // The node now waits on its operation's deadline.
                    self.eval.set_wake(&id, Some(d.deadline));
                    requeue_at = earliest(requeue_at, Some(d.deadline));
                    self.stats.dispatched_by_kind[d.request.kind().index()] += 1;
                    pass.dispatches.push(d);
                    pass.stats.dispatched += 1;
                }
                Ok(None) => {
                    debug_assert!(transition);
                    self.eval.dirty.push(id);
                    pass.transitioned.push(id);
                    pass.stats.transitions += 1;
                }
                Err(e) => {
                    // A full pass would try again next time; so will we.
                    self.eval.full |= insert;
                    self.eval.dirty.push(id);
                    pass.stats.errors += 1;
                    pass.errors.push(e);
                }
            }
        }
        self.stats.dispatched += pass.stats.dispatched as u64;
        debug_assert_eq!(
            self.stats.dispatched,
            self.stats.dispatched_by_kind.iter().sum::<u64>(),
            "the dispatches by kind add up to the dispatches"
        );
        // Every waiting node's wake-up is in the index now (the decided
        // ones' new ones, the dispatched ones' deadlines, everyone else's
        // unchanged): the earliest of them is the next one. Debug builds
        // check it against the plan's own reckoning.
        let next = self.eval.wakes.keys().next().copied();
        debug_assert_eq!(next, requeue_at, "the wake index and the plan disagree");
        self.requeue_at = next;
        if pass.stats.transitions > 0 {
            // A transition completes a node's step; its follow-on action is
            // decided by the next pass, which this guarantees.
            self.queue = Queue::Running { dirty: true };
        }
        Ok(Some(pass))
    }

    /// The plan the next pass would apply at `now`, computed the way the pass
    /// computes it: only dirty and due nodes are decided. It always equals
    /// [`Driver::plan`] (property-tested); it exists so tests can prove that.
    pub fn next_pass_plan(&self, now: Timestamp) -> Plan {
        if self.eval.full || self.surges_stale() {
            self.decide_full(now).0
        } else {
            self.decide_some(now, &mut Scratch::default(), true)
        }
    }

    /// Decides the candidates of this pass and updates the evaluation index
    /// (clears dirt, records new wake-ups).
    fn decide(&mut self, now: Timestamp) -> Plan {
        self.refresh_surges();
        if self.eval.full {
            let (plan, wakes, held) = self.decide_full(now);
            self.eval = Eval::default();
            for (at, id) in wakes {
                self.eval.set_wake(&id, Some(at));
            }
            self.eval.held = held;
            return plan;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        // The pass reads its requeue instant off the wake index once every
        // node's new wake-up is in it (see `poll_pass`).
        let plan = self.decide_some(now, &mut scratch, cfg!(debug_assertions));
        let dirtied = self.eval.dirty.len();
        self.eval.dirty.clear();
        give_back_room(&mut self.eval.dirty, dirtied);
        for (id, &(wake, held)) in scratch.candidates.iter().zip(&scratch.updates) {
            self.eval.set_wake(id, wake);
            if held {
                if !self.eval.held.contains(id) {
                    self.eval.held.insert(*id);
                }
            } else {
                self.eval.held.remove(id);
            }
        }
        scratch.clear_after_pass();
        self.scratch = scratch;
        plan
    }

    /// A full pass's plan, with every node's wake-up and the nodes row 17 holds.
    fn decide_full(&self, now: Timestamp) -> FullDecision {
        let mut plan = Plan::default();
        let mut wakes = Vec::new();
        let mut held = BTreeSet::new();
        walk(
            &self.state,
            &self.desired,
            now,
            self.paused,
            &self.tripped,
            |id, d| {
                plan.requeue_at = earliest(plan.requeue_at, d.wake_at);
                if let Some(at) = d.wake_at {
                    wakes.push((at, *id));
                }
                if d.row == LadderRow::AwaitRolloutBudget {
                    held.insert(*id);
                }
                if let Some(action) = d.action {
                    plan.actions.push(PlannedAction {
                        node: *id,
                        row: d.row,
                        action,
                    });
                }
            },
        );
        (plan, wakes, held)
    }

    /// Decides only the dirty, due and held nodes; leaves them in
    /// `scratch.candidates` and what each now waits on in `scratch.updates`.
    /// `others` adds the earliest wake-up of the nodes not decided to the
    /// plan's `requeue_at` (a scan the pass itself does without).
    fn decide_some(&self, now: Timestamp, scratch: &mut Scratch, others: bool) -> Plan {
        let mut plan = Plan::default();
        self.eval.candidates(now, &mut scratch.candidates);
        scratch.updates.clear();
        scratch.updates.reserve(scratch.candidates.len());
        let mut gates = RolloutGates::new(&self.state, &self.desired).with_tripped(&self.tripped);
        for id in &scratch.candidates {
            let Some(node) = self.state.nodes.get(id) else {
                scratch.updates.push((None, false));
                continue;
            };
            let d = if self.paused {
                reconcile_node_paused(node, self.slot(id), now)
            } else {
                reconcile_node_gated(id, node, self.slot(id), now, &mut gates)
            };
            plan.requeue_at = earliest(plan.requeue_at, d.wake_at);
            let held = d.row == LadderRow::AwaitRolloutBudget;
            scratch.updates.push((d.wake_at, held));
            if let Some(action) = d.action {
                plan.actions.push(PlannedAction {
                    node: *id,
                    row: d.row,
                    action,
                });
            }
        }
        if others {
            let others = self.eval.earliest_other(&scratch.candidates);
            plan.requeue_at = earliest(plan.requeue_at, others);
        }
        plan
    }

    /// Works out each group's surge slots again; a group whose surge
    /// changed gains or loses desired slots, which only a full pass sees.
    /// Costs nothing for groups that cannot surge.
    fn refresh_surges(&mut self) {
        let mut changed = false;
        for g in &self.desired.groups {
            if g.policy.max_surge_of(g.count) == 0 {
                changed |= self.surges.remove(&g.id).is_some();
                continue;
            }
            let now = crate::decide::surge(&self.state, g);
            let before = self.surges.get(&g.id).copied().unwrap_or(0);
            if now != before {
                changed = true;
                if now == 0 {
                    self.surges.remove(&g.id);
                } else {
                    self.surges.insert(g.id, now);
                }
            }
        }
        let desired = &self.desired;
        let before = self.surges.len();
        self.surges.retain(|g, _| desired.group(g).is_some());
        changed |= self.surges.len() != before;
        self.eval.full |= changed;
    }

    /// Whether [`Driver::refresh_surges`] would change anything (and so
    /// make the next pass a full one), without changing anything.
    fn surges_stale(&self) -> bool {
        let desired = &self.desired;
        let moved = desired.groups.iter().any(|g| {
            let now = if g.policy.max_surge_of(g.count) == 0 {
                0
            } else {
                crate::decide::surge(&self.state, g)
            };
            now != self.surges.get(&g.id).copied().unwrap_or(0)
        });
        moved || self.surges.keys().any(|g| desired.group(g).is_none())
    }

    /// The template slot `id` must run: its group's, when `id` is one of
    /// the group's `count` slots or one of its surge slots.
    fn slot(&self, id: &LogicalNodeId) -> Option<&Arc<NodeTemplate>> {
        let g = self.desired.group(&id.group)?;
        let surge = self.surges.get(&id.group).copied().unwrap_or(0);
        (id.index < g.count + surge).then_some(&g.template)
    }

    /// The remediation breaker of `group` if it is tripped; `away` says
    /// whether a slot's agent (of the given attempt) is away. See
    /// [`breaker`](crate::breaker).
    pub fn breaker(
        &self,
        group: &GroupId,
        away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Option<Breaker> {
        crate::decide::breaker(&self.state, &self.desired, group, away)
    }

    /// The groups whose rollout holds ready nodes of an outdated template
    /// back (row 17), as of the last pass; empty, without looking at any
    /// node, when that pass held none.
    pub fn rollout_holds(&self) -> Vec<RolloutStatus> {
        if self.eval.held.is_empty() && !self.eval.full {
            return Vec::new();
        }
        rollout_holds(&self.state, &self.desired)
    }

    /// Ends the running pass; queues the follow-up pass if anything triggered during it.
    ///
    /// # Errors
    /// [`DriverError::NotRunning`] when no pass is running.
    pub fn finish_pass(&mut self) -> Result<(), DriverError> {
        match self.queue {
            Queue::Running { dirty } => {
                self.queue = if dirty { Queue::Queued } else { Queue::Idle };
                Ok(())
            }
            _ => Err(DriverError::NotRunning),
        }
    }

    fn trigger(&mut self) {
        self.queue = match self.queue {
            Queue::Idle => Queue::Queued,
            Queue::Queued => {
                self.stats.collapsed_triggers += 1;
                Queue::Queued
            }
            Queue::Running { dirty } => {
                if dirty {
                    self.stats.collapsed_triggers += 1;
                }
                Queue::Running { dirty: true }
            }
        };
    }

    fn count(&mut self, node: &LogicalNodeId, folded: Folded) -> Folded {
        match folded {
            Folded::Applied => {
                self.stats.folded += 1;
                self.eval.dirty.push(*node);
                self.trigger();
            }
            Folded::Discarded(_) => self.stats.discarded += 1,
        }
        folded
    }

    fn allocate_attempt(&mut self, node: &LogicalNodeId) -> Result<NodeAttemptId, DriverError> {
        let id = self.state.next_attempt;
        self.state.next_attempt = id
            .checked_add(1)
            .ok_or(DriverError::AttemptIdsExhausted { node: *node })?;
        Ok(NodeAttemptId(id))
    }

    /// Applies one planned action. Returns the dispatch for an effect, `None`
    /// for a transition. On error the node is unchanged.
    fn apply(
        &mut self,
        id: LogicalNodeId,
        action: NodeAction,
        now: Timestamp,
    ) -> Result<Option<Dispatch>, DriverError> {
        let deadline_err = |source| DriverError::Deadline { node: id, source };
        match action {
            NodeAction::Insert { template } => {
                let attempt = self.allocate_attempt(&id)?;
                let failures = self.carried.remove(&id).unwrap_or(0);
                self.state
                    .nodes
                    .insert(id, ManagedNode::new(attempt, template, failures));
            }
            NodeAction::Restart { template } => {
                let attempt = self.allocate_attempt(&id)?;
                if let Some(node) = self.state.nodes.get_mut(&id) {
                    let failures = node.retry.consecutive_failures;
                    // Failures of another template are not the new one's.
                    let inherited = if same_template(&node.template, &template) {
                        node.retry.inherited_failures
                    } else {
                        failures
                    };
                    *node = ManagedNode::new(attempt, template, failures);
                    node.retry.inherited_failures = inherited;
                }
            }
            NodeAction::Reap => {
                self.state.nodes.remove(&id);
            }
            NodeAction::BeginDelete { .. } => {
                if let Some(node) = self.state.nodes.get_mut(&id) {
                    node.intent = Intent::Deleting;
                    node.record.ready = false;
                    node.record.bootstrap_deadline = None;
                    node.retry.next_effect_at = None;
                }
            }
            NodeAction::MarkDestroyed => {
                if let Some(node) = self.state.nodes.get_mut(&id) {
                    let delay = self
                        .config
                        .backoff_ms(node.attempt, node.retry.consecutive_failures);
                    let restart_at = now.checked_add_ms(delay).map_err(deadline_err)?;
                    let rec = &mut node.record;
                    rec.stage = NodeStage::Destroyed;
                    rec.ready = false;
                    rec.restart_at = Some(restart_at);
                    node.retry.next_effect_at = None;
                }
            }
            NodeAction::ObserveConvergence => {
                if let Some(node) = self.state.nodes.get_mut(&id) {
                    node.record.stage = NodeStage::Dormant;
                    node.record.ready = true;
                    node.record.resuming = false;
                    node.record.bootstrap_deadline = None;
                    node.record.clear_last_error();
                    node.retry.consecutive_failures = 0;
                    node.retry.inherited_failures = 0;
                    node.retry.next_effect_at = None;
                }
            }
            NodeAction::Dispatch(kind) => return self.dispatch(id, kind, now).map(Some),
        }
        Ok(None)
    }

    fn dispatch(
        &mut self,
        id: LogicalNodeId,
        kind: EffectKind,
        now: Timestamp,
    ) -> Result<Dispatch, DriverError> {
        let timeout = self.config.timeout_ms(kind);
        let run_id = self.state.run_id.clone();
        let Some(node) = self.state.nodes.get_mut(&id) else {
            return Err(DriverError::MissingEffectInput {
                node: id,
                kind,
                missing: "node",
            });
        };
        let deadline = now
            .checked_add_ms(timeout)
            .map_err(|source| DriverError::Deadline { node: id, source })?;
        debug_assert!(
            node.pending.is_none(),
            "{id}: one operation at a time, and {:?} is still pending",
            node.pending.as_ref().map(|p| p.id)
        );
        let seq = node.next_op_seq;
        let next_seq = seq
            .checked_add(1)
            .ok_or(DriverError::OperationSeqExhausted { node: id })?;
        let rec = &node.record;
        let missing = |what| DriverError::MissingEffectInput {
            node: id,
            kind,
            missing: what,
        };
        let request = match kind {
            EffectKind::CreateLease => EffectRequest::CreateLease {
                template: node.template.clone(),
            },
            EffectKind::LookupEndpoint => EffectRequest::LookupEndpoint {
                lease: rec.lease.clone().ok_or_else(|| missing("lease"))?,
            },
            EffectKind::StartBootstrap => EffectRequest::StartBootstrap {
                lease: rec.lease.clone().ok_or_else(|| missing("lease"))?,
                endpoint: rec.endpoint.clone().ok_or_else(|| missing("endpoint"))?,
                template: node.template.clone(),
            },
            EffectKind::CancelBootstrap => EffectRequest::CancelBootstrap {
                session: rec.session.clone().ok_or_else(|| missing("session"))?,
            },
            EffectKind::DestroyLease => EffectRequest::DestroyLease {
                lease: rec.lease.clone().ok_or_else(|| missing("lease"))?,
                failed: rec.failed_reason().map(str::to_owned),
            },
        };
        let op = OperationId {
            attempt: node.attempt,
            seq,
        };
        node.next_op_seq = next_seq;
        node.pending = Some(PendingOperation {
            id: op,
            effect: kind,
            dispatched_at: now,
            deadline,
            cleanup: node.intent == Intent::Deleting,
        });
        if kind == EffectKind::CreateLease && node.record.stage == NodeStage::New {
            node.record.stage = NodeStage::LeaseRequested;
        }
        Ok(Dispatch {
            op,
            key: ResourceKey {
                run_id,
                node: id,
                attempt: node.attempt,
            },
            deadline,
            request,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Scratch;
    use crate::id::LogicalNodeId;

    fn filled(n: usize) -> Scratch {
        let id = LogicalNodeId::parse("w-0").unwrap();
        Scratch {
            candidates: vec![id; n],
            updates: vec![(None, false); n],
        }
    }

    #[test]
    fn scratch_keeps_its_room_for_like_passes_and_gives_a_large_pass_back() {
        let mut s = filled(100_000);
        s.clear_after_pass();
        assert!(
            s.candidates.capacity() >= 100_000,
            "kept after the large pass itself"
        );
        // A pass of half the size keeps it all.
        s.candidates
            .resize(50_000, LogicalNodeId::parse("w-0").unwrap());
        s.clear_after_pass();
        assert!(s.candidates.capacity() >= 100_000);
        // A pass of a few nodes gives all but the kept room back.
        s.candidates.resize(3, LogicalNodeId::parse("w-0").unwrap());
        s.clear_after_pass();
        assert!(s.candidates.is_empty() && s.updates.is_empty());
        assert!(
            s.candidates.capacity() < 100_000 / 8,
            "{}",
            s.candidates.capacity()
        );
        assert!(s.candidates.capacity() >= Scratch::KEEP);
        assert!(s.updates.capacity() < 100_000 / 8);
        // Small buffers are left as they are.
        let mut small = filled(Scratch::KEEP);
        small.clear_after_pass();
        small.clear_after_pass();
        assert!(small.candidates.capacity() >= Scratch::KEEP);
    }
}
