//! Observed state: what the driver knows about every slot.

use crate::id::{Generation, LeaseId, NodeAttemptId, NodeEndpoint, OperationId, RunId, SessionId};
use crate::nodemap::NodeMap;
use crate::shape::NodeTemplate;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The observation ladder of one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum NodeStage {
    /// Slot inserted; nothing dispatched yet.
    New,
    /// CreateLease dispatched.
    LeaseRequested,
    /// The provider holds a lease; its endpoint is not known yet.
    LeaseCreated,
    /// Lease and a reachable endpoint recorded.
    EndpointKnown,
    /// A bootstrap session runs; observations flow.
    BootstrapRunning,
    /// The node's agent joined the swarm.
    SwactorJoined,
    /// The host recorded a handoff (reserved; counts as ready).
    HandedOff,
    /// Bootstrap finished; the ready steady state.
    Dormant,
    /// The attempt ended in failure.
    Failed,
    /// Cleanup finished; awaiting reap or restart.
    Destroyed,
}

/// Facts a bootstrap stream reports. The reconciler branches only on the
/// failure and converged classes; the rest is progress for people to see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum BootstrapStage {
    /// Connecting to the machine.
    SshConnect,
    /// Running the group's boot check.
    BootCheck,
    /// Starting the swactor agent.
    SwactorStart,
    /// The agent is joining the swarm.
    Join,
    /// The node reports it is converged.
    Converged,
    /// The machine could not be reached.
    SshConnectFailed,
    /// The boot check failed.
    BootCheckFailed,
    /// The agent did not start.
    SwactorStartFailed,
    /// The agent could not join the swarm.
    JoinFailed,
    /// A joined agent went away, or the stream made no progress in time.
    AgentLost,
}

impl BootstrapStage {
    /// True for the five failure stages.
    pub fn is_failure(self) -> bool {
        matches!(
            self,
            Self::SshConnectFailed
                | Self::BootCheckFailed
                | Self::SwactorStartFailed
                | Self::JoinFailed
                | Self::AgentLost
        )
    }
}

/// Whether a slot's attempt is meant to live or is being torn down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Intent {
    /// The attempt should progress toward ready.
    Active,
    /// The attempt is being cleaned up; this runs to completion once entered.
    Deleting,
}

/// The five provider effects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum EffectKind {
    /// Lease a machine (adopting one already leased for this identity).
    CreateLease,
    /// Find the leased machine's endpoint.
    LookupEndpoint,
    /// Start the bootstrap session (adopting one already running).
    StartBootstrap,
    /// Stop the bootstrap session; already gone is success.
    CancelBootstrap,
    /// Release the lease; already gone is success.
    DestroyLease,
}

impl EffectKind {
    /// Every kind, in declaration order: a kind's place here is its
    /// [`EffectKind::index`].
    pub const ALL: [Self; 5] = [
        Self::CreateLease,
        Self::LookupEndpoint,
        Self::StartBootstrap,
        Self::CancelBootstrap,
        Self::DestroyLease,
    ];

    /// This kind's place in [`EffectKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// True for the effects that bring something into existence, and so must
    /// be re-issued (adopting) when their outcome is unknown.
    pub fn creates(self) -> bool {
        self.as_create().is_some()
    }

    /// The creating effect this is, if it is one.
    pub fn as_create(self) -> Option<AmbiguousCreate> {
        match self {
            Self::CreateLease => Some(AmbiguousCreate::CreateLease),
            Self::StartBootstrap => Some(AmbiguousCreate::StartBootstrap),
            _ => None,
        }
    }
}

/// A creating effect whose outcome is unknown. Only the two effects that
/// bring something into existence can be remembered this way: an unknown
/// cancel or destroy is simply retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum AmbiguousCreate {
    /// A CreateLease that may have made a lease.
    CreateLease,
    /// A StartBootstrap that may have started a session.
    StartBootstrap,
}

impl AmbiguousCreate {
    /// The effect to re-issue so the executor adopts what it may have made.
    pub fn effect(self) -> EffectKind {
        match self {
            Self::CreateLease => EffectKind::CreateLease,
            Self::StartBootstrap => EffectKind::StartBootstrap,
        }
    }
}

/// An operation recorded before dispatch; at most one per node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingOperation {
    /// Its identity.
    pub id: OperationId,
    /// What it does.
    pub effect: EffectKind,
    /// When it was dispatched.
    pub dispatched_at: Timestamp,
    /// When it is folded as ambiguous if no result came; stored at dispatch.
    pub deadline: Timestamp,
    /// Whether a deleting node's cleanup dispatched it (rows 6-8). A failure
    /// of any other operation on a node that has since begun deleting must
    /// not hold its cleanup back.
    pub cleanup: bool,
}

/// Per-node retry bookkeeping.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryState {
    /// Failures since the slot was last ready; carried into a replacement attempt.
    pub consecutive_failures: u32,
    /// No effect is dispatched before this instant (backoff or probe interval).
    pub next_effect_at: Option<Timestamp>,
    /// How many of `consecutive_failures` were carried in from attempts of
    /// another template (the slot's template changed since they failed):
    /// the rest are failures of the template the node runs now, which is
    /// what stops a rollout.
    #[serde(default)]
    pub inherited_failures: u32,
}

impl RetryState {
    /// Failures since the slot was last ready with the template it runs now.
    pub fn template_failures(&self) -> u32 {
        self.consecutive_failures
            .saturating_sub(self.inherited_failures)
    }
}

/// Lifecycle facts of one attempt. `repr(C)`: the small fields a pass
/// reads (stage, ready flag) come first, next to the hot fields of
/// [`ManagedNode`] that precede the record.
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Where on the ladder the attempt is.
    pub stage: NodeStage,
    /// The convergence flag: set when convergence is observed, cleared on failure or delete.
    pub ready: bool,
    /// The last bootstrap fact reported.
    pub bootstrap: Option<BootstrapStage>,
    /// A create whose outcome is unknown; re-issued (adopting) before any destructive step.
    pub ambiguous: Option<AmbiguousCreate>,
    /// Adopted by a restarted driver, with a listed lease, and not ready
    /// since: while it re-attaches, a template it runs that is not (or no
    /// longer) its slot's does not replace it at once; it may become ready
    /// again, and then its group's rollout replaces it within budget.
    /// Cleared when it becomes ready.
    #[serde(default)]
    pub resuming: bool,
    /// The provider's lease, while one is live.
    pub lease: Option<LeaseId>,
    /// The machine's endpoint, once known.
    pub endpoint: Option<NodeEndpoint>,
    /// The live bootstrap session, if any.
    pub session: Option<SessionId>,
    /// A bootstrap session that reports nothing until this instant is failed as stalled.
    pub bootstrap_deadline: Option<Timestamp>,
    /// A lease whose endpoint is still not ready at this instant fails the
    /// attempt (an instance stuck loading is replaced, not probed forever).
    pub endpoint_deadline: Option<Timestamp>,
    /// What went wrong with the attempt, if anything did (out of line: a
    /// healthy node carries one pointer, not three strings and a time).
    /// Read it through [`NodeRecord::failed_reason`],
    /// [`NodeRecord::failed_at`] and [`NodeRecord::last_error`].
    #[serde(default)]
    pub trouble: Option<Box<Trouble>>,
    /// When a destroyed, still-desired slot may start its next attempt.
    pub restart_at: Option<Timestamp>,
}

impl NodeRecord {
    /// The record of a fresh attempt.
    pub fn new() -> Self {
        Self {
            stage: NodeStage::New,
            ready: false,
            lease: None,
            endpoint: None,
            session: None,
            bootstrap: None,
            ambiguous: None,
            bootstrap_deadline: None,
            endpoint_deadline: None,
            trouble: None,
            restart_at: None,
            resuming: false,
        }
    }
}

impl NodeRecord {
    /// Why the attempt failed.
    pub fn failed_reason(&self) -> Option<&str> {
        self.trouble.as_ref()?.failed_reason.as_deref()
    }

    /// When the attempt failed.
    pub fn failed_at(&self) -> Option<Timestamp> {
        self.trouble.as_ref()?.failed_at
    }

    /// The most recent error of any kind, for people to read.
    pub fn last_error(&self) -> Option<&str> {
        self.trouble.as_ref()?.last_error.as_deref()
    }

    /// What kind of trouble the most recent error was, decided where it was
    /// recorded; set exactly when [`NodeRecord::last_error`] is.
    pub fn last_cause(&self) -> Option<FailureCause> {
        self.trouble.as_ref()?.last_cause
    }

    /// Records the most recent error and what kind of trouble it was.
    pub fn set_last_error(&mut self, cause: FailureCause, error: String) {
        self.edit_trouble(|t| {
            t.last_error = Some(error);
            t.last_cause = Some(cause);
        });
    }

    /// Forgets the most recent error: the attempt got past it.
    pub fn clear_last_error(&mut self) {
        self.edit_trouble(|t| {
            t.last_error = None;
            t.last_cause = None;
        });
    }

    /// Records that the attempt failed at `at`, and why.
    pub fn set_failed(&mut self, reason: String, at: Timestamp) {
        self.edit_trouble(|t| {
            t.failed_reason = Some(reason);
            t.failed_at = Some(at);
        });
    }

    /// Changes the trouble record; an empty one is dropped.
    fn edit_trouble(&mut self, f: impl FnOnce(&mut Trouble)) {
        let mut t = self.trouble.take().unwrap_or_default();
        f(&mut t);
        if *t != Trouble::default() {
            self.trouble = Some(t);
        }
    }
}

/// What went wrong with an attempt: kept out of line in [`NodeRecord`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trouble {
    /// Why the attempt failed.
    pub failed_reason: Option<String>,
    /// When the attempt failed.
    pub failed_at: Option<Timestamp>,
    /// The most recent error of any kind, for people to read.
    pub last_error: Option<String>,
    /// What kind of trouble `last_error` was (absent in states written
    /// before it was recorded).
    #[serde(default)]
    pub last_cause: Option<FailureCause>,
}

/// What kind of trouble an attempt's last error was, decided by the fold
/// that recorded it (never read back from its text).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum FailureCause {
    /// Its agent was lost: its stream reported it gone, or it stayed away past its grace.
    AgentLost,
    /// Something the attempt waited for did not happen before its deadline.
    Timeout,
    /// An operator asked for the attempt to be replaced.
    Operator,
    /// Its provider paused its machine, which did not resume within its group's wait.
    Preempted,
    /// Any other failure: a provider's error, a failed bootstrap step.
    Failure,
}

impl Default for NodeRecord {
    fn default() -> Self {
        Self::new()
    }
}

/// One slot as the driver sees it.
///
/// `repr(C)` keeps the fields a settled pass reads (template, intent, retry,
/// pending, then the record's stage and ready flag) together at the front, so
/// a pass over a large settled cluster touches as few cache lines as possible.
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManagedNode {
    /// The template the attempt was created from.
    pub template: Arc<NodeTemplate>,
    /// Active or Deleting.
    pub intent: Intent,
    /// Backoff state.
    pub retry: RetryState,
    /// The in-flight operation, at most one.
    pub pending: Option<PendingOperation>,
    /// Lifecycle facts.
    pub record: NodeRecord,
    /// The current incarnation.
    pub attempt: NodeAttemptId,
    /// Sequence number of the next operation of this attempt.
    pub next_op_seq: u64,
    /// Unused: makes a slot of the state's map (its 16-byte key and this
    /// node) exactly 256 bytes, four cache lines, so every slot sits at the
    /// same place within its lines and the walk reads each from as few lines
    /// as it can. At 248 bytes the full walk of 100k nodes took 1.6 times as
    /// long (`docs/benchmarks.md`). Not part of the node's state.
    #[serde(skip)]
    _pad: u64,
}

// Size budget, checked when the crate is built: a slot of the cluster state,
// with its key in a node table, is four cache lines (the walk's speed
// depends on it; see the padding above).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Option<crate::nodemap::Entry<ManagedNode>>>() == 256);

impl ManagedNode {
    /// A fresh attempt for a slot.
    pub fn new(
        attempt: NodeAttemptId,
        template: Arc<NodeTemplate>,
        consecutive_failures: u32,
    ) -> Self {
        Self {
            attempt,
            template,
            intent: Intent::Active,
            record: NodeRecord::new(),
            pending: None,
            retry: RetryState {
                consecutive_failures,
                next_effect_at: None,
                inherited_failures: 0,
            },
            next_op_seq: 0,
            _pad: 0,
        }
    }

    /// True when the node is ready: converged, active, nothing in flight.
    pub fn is_ready(&self) -> bool {
        self.record.ready
            && self.intent == Intent::Active
            && matches!(self.record.stage, NodeStage::Dormant | NodeStage::HandedOff)
    }
}

/// Everything the driver knows. Only the driver writes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// The run; fixed for the driver's lifetime.
    pub run_id: RunId,
    /// The generation the last pass evaluated (not a readiness claim).
    pub observed_generation: Option<Generation>,
    /// The next attempt id to hand out; only grows.
    pub next_attempt: u64,
    /// One entry per slot, in slot order.
    pub nodes: NodeMap<ManagedNode>,
}

impl ClusterState {
    /// An empty state whose attempt allocator starts at `first_attempt`.
    pub fn new(run_id: RunId, first_attempt: u64) -> Self {
        Self {
            run_id,
            observed_generation: None,
            next_attempt: first_attempt,
            nodes: NodeMap::new(),
        }
    }
}
