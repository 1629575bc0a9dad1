//! The cluster host: every decision a daemon makes around the driver core, sans-IO.
//!
//! The [`Driver`](crate::Driver) decides one pass at a time for the nodes it
//! holds. A daemon decides more than that: what to adopt from a provider's
//! inventory and a journal after a restart (and which adopted attempts have
//! drifted), what an orphaned resource is and when to collect it, when a
//! disconnected agent's grace ends, which operations an executor that crashed
//! was holding, what must be durable before an effect or an acknowledgement,
//! how a shutdown ends, whether reconciling is paused (durably; see
//! [`Host::handle_pause`]), when a group's lost nodes are not replaced (its
//! remediation breaker, see [`Host::breaker`]), what each group holds back
//! and why ([`Host::holds`]), and when to tell waiters the cluster converged.
//! [`Host`] holds all of it, like `quinn-proto`'s `Endpoint` next to its
//! `Connection`: no clock, no I/O, time is an argument, and everything it
//! wants done comes out as data.
//!
//! # Calling order
//! 1. Feed inputs as they arrive (`handle_*`). The first input a fresh host
//!    needs is the provider's inventory ([`Host::handle_inventory`]): no pass
//!    runs before it, so nothing is created that should have been adopted.
//! 2. Drain outputs: `while let Some(out) = host.poll_output(now) { ... }`.
//!    - [`Output::Persist`]: the host MUST NOT be polled past it until the
//!      delta is durable and [`Host::handle_persisted`] was called (polling
//!      returns `None` meanwhile). Everything after it in the stream depends
//!      on it: an attempt's first effect on its record, an acknowledgement on
//!      the shape it acknowledges.
//!    - [`Output::Pass`]: every dispatch in it is already recorded as pending
//!      and MUST be submitted on the lane [`Host::lane_of`] names, or reported
//!      with [`Host::handle_submit_failed`].
//!    - [`Output::List`]: list what the provider holds for the run and
//!      report it with [`Host::handle_inventory`] (the first output of every
//!      host, then a periodic sweep for leaks).
//!    - [`Output::Collect`]: destroy what an orphaned key holds (cancel its
//!      session, then destroy its lease) and report with
//!      [`Host::handle_collected`].
//!    - [`Output::Probe`]: ask the provider whether an away agent's machine
//!      is paused by the provider and report with [`Host::handle_probed`]
//!      (not answering only costs the wait: the node is lost at its grace).
//!    - [`Output::Reply`]: answer the caller who holds that [`Ticket`].
//!    - [`Output::Folded`]: an input the host fed to the core itself (a join,
//!      an early observation, a lost agent, an operation of a crashed
//!      executor); nothing to do, it is there so observers see every fold.
//!    - [`Output::Stop`]: the host is done; drop it.
//! 3. Publish [`Host::poll_event`]s, arm ONE timer at [`Host::poll_timeout`]
//!    and call [`Host::handle_timeout`] when it fires.
//!
//! # Guarantees
//! - **Durable before effect.** No pass runs while a persist is outstanding,
//!   so an attempt's record and the attempt-id reservation that covers it are
//!   durable before its first effect is dispatched. Attempt ids are never
//!   reused, across any number of restarts.
//! - **Adopt, never guess, never resurrect.** After a restart every attempt
//!   the provider lists, and every attempt the journal records whose lease
//!   was never seen created, is adopted and its create re-issued under its
//!   key: a machine that exists is found, one that was never made is made
//!   once. An attempt the journal saw created but the provider no longer
//!   lists is presumed gone and never created again; a sweep after the
//!   provider's visibility window collects it if it was only invisible, and
//!   the host claims convergence only after that sweep. An adopted attempt
//!   whose recorded template is not the desired one (or is unknown) is
//!   replaced. Everything else the provider lists for the run is collected,
//!   at start and by periodic sweeps.
//! - **Ready means live.** A node becomes ready only after its agent joined
//!   *this* host (a stream replaying an old join proves nothing), and a
//!   joined agent gone for longer than its group's grace fails the attempt,
//!   unless its group's breaker is tripped: then it is held (kept, shown
//!   away) until the group is back within its `max_unhealthy`, and then
//!   given its grace again.

use crate::config::ReconcilerConfig;
use crate::core::Reconciler;
use crate::decide::{Change, Plan, ShapeDiff, diff};
use crate::driver::{AdoptEntry, DesiredUpdate, DriverError, Pass, PassStats, UpdateError};
use crate::id::{
    Generation, GroupId, LeaseId, LogicalNodeId, NodeAttemptId, OperationId, ResourceKey, RunId,
    SessionId,
};
use crate::nodemap::NodeTable;
use crate::observe::{
    BootstrapEvent, BootstrapObservation, DiscardReason, FailureClass, Folded, OperationOutcome,
    OperationResult,
};
use crate::rollout::Breaker;
use crate::shape::{ClusterShape, DesiredState, NodeTemplate};
use crate::state::{EffectKind, FailureCause, Intent, ManagedNode, NodeStage};
use crate::time::{Timestamp, earliest};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;

/// The journal format this host writes and reads.
pub const JOURNAL_FORMAT: u32 = 1;

/// Early observations kept per node while its StartBootstrap result is outstanding.
pub const EARLY_OBSERVATIONS_MAX: usize = 64;

/// Settings of a [`Host`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Executor lanes: every operation of an attempt goes to lane
    /// `attempt % lanes`, so one attempt's operations never overlap.
    pub lanes: u32,
    /// Whether a bootstrap stream's `SwactorJoined` proves the agent joined.
    /// A daemon with a swarm endpoint sets it false: only
    /// [`Host::handle_agent_joined`] proves a live join. Hosts without one
    /// (a test with a fake provider) set it true.
    pub stream_joins: bool,
    /// Emit an event for every node change and dispatch (off for very large benchmarks).
    pub node_events: bool,
    /// Attempts remembered per slot for people to look back at (0 for none).
    pub history_len: usize,
    /// The most nodes each provider kind can hold, and why; a shape asking
    /// one for more is refused unless it names its own `capacity`.
    pub capacities: Vec<Capacity>,
    /// How long a new lease may stay invisible to the provider's listing
    /// (or, for a create an earlier daemon sent just before it died, take
    /// to appear). When the first listing misses an attempt the journal
    /// names and would not re-create, the host lists again this long later
    /// before it adopts anything, so a late one is adopted and cleaned up
    /// by the ladder instead of living beside its slot's next attempt.
    pub visibility_window_ms: u64,
    /// Interval of the leak sweeps (list the run, collect what no current
    /// attempt owns); 0 for none beyond the first.
    pub sweep_interval_ms: u64,
    /// An agent that joined an earlier host (its stream says so, but it has
    /// not joined this one) gets at least this long to find this host before
    /// its node fails: it first has to notice the old connection died.
    pub rejoin_window_ms: u64,
    /// With a journal that records nothing (a new one), take each listed
    /// resource of a desired slot as that slot's attempt, running its
    /// desired template, instead of collecting it: what a daemon whose
    /// journal was lost is told to do with `--adopt` (see
    /// [`without_journal`](crate::without_journal)). The latest attempt of
    /// a slot is taken; older ones are collected.
    pub adopt_unrecorded: bool,
    /// What a new journal records as its deployment
    /// ([`JournalMeta::deployment`]); a journal that exists keeps its own.
    pub deployment: Option<String>,
}

/// The rejoin window a host gives by default
/// ([`HostConfig::rejoin_window_ms`]).
pub const DEFAULT_REJOIN_WINDOW_MS: u64 = 15_000;

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            lanes: 16,
            stream_joins: false,
            node_events: true,
            history_len: 4,
            capacities: Vec::new(),
            visibility_window_ms: 60_000,
            sweep_interval_ms: 300_000,
            rejoin_window_ms: DEFAULT_REJOIN_WINDOW_MS,
            adopt_unrecorded: false,
            deployment: None,
        }
    }
}

/// How a joined agent proves it is alive: it sends a heartbeat every
/// `heartbeat_ms`, and one silent for `silence_ms` is taken for gone (its
/// grace then runs from when it was last heard, see
/// [`Host::handle_agent_gone`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    /// Interval between an agent's heartbeats.
    pub heartbeat_ms: u64,
    /// Silence after which the agent counts as disconnected.
    pub silence_ms: u64,
    /// The grace its group grants once it is disconnected: how long after
    /// a silence began its link is worth keeping open in case it is heard
    /// again on it.
    #[serde(default)]
    pub lost_grace_ms: u64,
}

impl Liveness {
    /// The shortest silence taken for a disconnection: shorter ones are
    /// scheduling noise on a loaded machine (a busy 2-core CI runner
    /// starves a process for half a second now and then).
    pub const SILENCE_MIN_MS: u64 = 1_000;
    /// The longest: a stopped agent shows as disconnected within it.
    pub const SILENCE_MAX_MS: u64 = 2_000;
    /// Heartbeats per silence window, so that a few lost or late ones are
    /// not a disconnection.
    pub const BEATS_PER_SILENCE: u64 = 4;

    /// The liveness of an agent whose group grants `lost_grace_ms`: silence
    /// is noticed within half the grace (bounded by the limits above), so a
    /// stopped agent is seen disconnected well before its grace ends.
    pub fn for_grace(lost_grace_ms: u64) -> Self {
        let silence_ms = (lost_grace_ms / 2).clamp(Self::SILENCE_MIN_MS, Self::SILENCE_MAX_MS);
        Self {
            heartbeat_ms: silence_ms / Self::BEATS_PER_SILENCE,
            silence_ms,
            lost_grace_ms,
        }
    }
}

/// Slots without a node whose attempt history is still kept for people.
pub const DEPARTED_HISTORY_MAX: usize = 256;

/// How many nodes a provider can hold, and on what the estimate rests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// The provider kind (`process`, ...) whose groups it limits.
    pub kind: String,
    /// The most nodes.
    pub nodes: u64,
    /// Where the number comes from, for people (e.g. "this machine's
    /// 7.5 GiB of free memory at 64 MiB per agent").
    pub basis: String,
}

/// One attempt of a slot, as people look back at it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The attempt.
    pub attempt: NodeAttemptId,
    /// When it started.
    pub started_at: Timestamp,
    /// When it first became ready, if it did.
    pub ready_at: Option<Timestamp>,
    /// When it ended (destroyed or reaped), if it did.
    pub ended_at: Option<Timestamp>,
    /// The furthest stage it is at (or reached before it ended).
    pub stage: NodeStage,
    /// The last bootstrap fact it reported.
    pub bootstrap: Option<crate::state::BootstrapStage>,
    /// Why it failed, if it did.
    pub failed_reason: Option<String>,
    /// The last error of any kind.
    pub last_error: Option<String>,
    /// What kind of trouble `last_error` was.
    #[serde(default)]
    pub last_cause: Option<FailureCause>,
}

/// A slot's attempts as the host keeps them: the latest inline (most slots
/// only ever have one), the earlier ones, oldest first, behind one pointer
/// (none until there is one). With [`Kept`] that is 72 bytes in the slot's
/// table and no allocation, where a deque of [`AttemptRecord`]s was a
/// 48-byte entry and a 104-byte one.
#[derive(Clone, Debug, Default)]
struct Attempts {
    #[allow(
        clippy::box_collection,
        reason = "one pointer wide (a vector is three): most slots never have an earlier attempt"
    )]
    earlier: Option<Box<Vec<Kept>>>,
    latest: Option<Kept>,
}

impl Attempts {
    fn records(&self) -> Vec<AttemptRecord> {
        self.earlier
            .iter()
            .flat_map(|e| e.iter())
            .chain(&self.latest)
            .map(Kept::record)
            .collect()
    }

    /// Starts `attempt`'s record, keeping at most `len` in all.
    fn start(&mut self, attempt: NodeAttemptId, now: Timestamp, len: usize) {
        let kept = Kept {
            attempt,
            started_at: now,
            ready_at: When::NOT_YET,
            ended_at: When::NOT_YET,
            stage: NodeStage::New,
            bootstrap: None,
            notes: None,
        };
        let earlier_max = len.max(1) - 1;
        if let Some(previous) = self.latest.replace(kept)
            && earlier_max > 0
        {
            self.earlier.get_or_insert_default().push(previous);
        }
        if let Some(earlier) = &mut self.earlier {
            let excess = earlier.len().saturating_sub(earlier_max);
            earlier.drain(..excess);
            if earlier.is_empty() {
                self.earlier = None;
            }
        }
    }
}

// Size budgets, checked when the crate is built: a kept attempt within a
// cache line, and a slot's attempts with one of them inline.
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<Kept>() <= 48);
    assert!(std::mem::size_of::<Attempts>() <= 56);
};

/// An [`AttemptRecord`] with its two texts boxed together (an attempt that
/// never failed nor erred has neither) and its instants a word each: 48
/// bytes instead of 104.
#[derive(Clone, Debug)]
struct Kept {
    attempt: NodeAttemptId,
    started_at: Timestamp,
    ready_at: When,
    ended_at: When,
    stage: NodeStage,
    bootstrap: Option<crate::state::BootstrapStage>,
    notes: Option<Box<Notes>>,
}

/// An instant of a [`Kept`] attempt that may not have come yet, in one
/// word where an `Option<Timestamp>` takes two (`u64::MAX` stands for "not
/// yet": no clock reads that many milliseconds, and a later one is kept as
/// one less).
#[derive(Clone, Copy, Debug)]
struct When(u64);

impl When {
    const NOT_YET: Self = Self(u64::MAX);

    fn get(self) -> Option<Timestamp> {
        (self.0 != u64::MAX).then_some(Timestamp(self.0))
    }

    /// Sets it to `now` unless it is set already.
    fn set_once(&mut self, now: Timestamp) {
        if self.0 == u64::MAX {
            self.0 = now.0.min(u64::MAX - 1);
        }
    }
}

/// The texts of a [`Kept`] attempt.
#[derive(Clone, Debug, Default)]
struct Notes {
    failed_reason: Option<String>,
    last_error: Option<String>,
    last_cause: Option<FailureCause>,
}

impl Kept {
    fn record(&self) -> AttemptRecord {
        let notes = self.notes.as_deref();
        AttemptRecord {
            attempt: self.attempt,
            started_at: self.started_at,
            ready_at: self.ready_at.get(),
            ended_at: self.ended_at.get(),
            stage: self.stage,
            bootstrap: self.bootstrap,
            failed_reason: notes.and_then(|n| n.failed_reason.clone()),
            last_error: notes.and_then(|n| n.last_error.clone()),
            last_cause: notes.and_then(|n| n.last_cause),
        }
    }

    fn failed_reason(&self) -> Option<&str> {
        self.notes.as_deref()?.failed_reason.as_deref()
    }

    fn last_error(&self) -> Option<&str> {
        self.notes.as_deref()?.last_error.as_deref()
    }

    fn last_cause(&self) -> Option<FailureCause> {
        self.notes.as_deref()?.last_cause
    }

    fn notes(&mut self) -> &mut Notes {
        self.notes.get_or_insert_default()
    }
}

/// The durable part of a host, besides its slot records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalMeta {
    /// The run; a journal never changes run.
    pub run_id: RunId,
    /// How many hosts have started on this journal; adopted attempts number
    /// their operations from `epoch << 32`.
    pub epoch: u64,
    /// No attempt id at or above this has been handed out.
    pub attempts_reserved: u64,
    /// The last shape accepted (and acknowledged); `None` before the first.
    pub shape: Option<ClusterShape>,
    /// A teardown was asked for and has not finished.
    pub tearing_down: bool,
    /// Reconciling is paused (`swactor pause`): see [`Host::handle_pause`].
    /// Absent in journals written before pausing existed.
    #[serde(default)]
    pub paused: bool,
    /// Templates of earlier shapes that slots still run: a restarted host
    /// adopts those nodes as they are and rolls them within their group's
    /// budget, instead of replacing them all at once (see [`AdoptEntry`]).
    /// Absent in journals written before it existed.
    #[serde(default)]
    pub retired: Vec<NodeTemplate>,
    /// The deployment this journal is: made once, when the journal is, and
    /// carried by every resource its providers make beside the run, so two
    /// daemons with the same run on one account never take each other's
    /// resources. `None` in journals written before it existed (their
    /// resources carry no deployment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<String>,
    /// Dollars (in millionths) this deployment's rented machines had cost
    /// when last recorded ([`Host::handle_spent`]): a floor for what it has
    /// spent that outlives the provider's own records. 0 in journals
    /// written before it existed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spent_micros: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The least rise in what a run has spent that is written to its journal
/// (a cent): a price runs on continuously, and a write per reading would
/// be a write every few seconds for nothing.
pub const SPENT_RECORD_STEP_MICROS: u64 = 10_000;

/// Which attempt a slot holds, which template it was made from, and whether
/// its lease was ever seen created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRecord {
    /// The attempt.
    pub attempt: NodeAttemptId,
    /// [`NodeTemplate::digest`] of its template.
    pub template: u64,
    /// A CreateLease of this attempt succeeded: its lease existed, so if the
    /// provider no longer lists it, it is gone and must never be made again.
    #[serde(default)]
    pub created: bool,
    /// The slot's failures with this template since it was last ready
    /// ([`RetryState::template_failures`](crate::RetryState::template_failures)),
    /// kept up to date as they happen, so a restarted host's rollout stop
    /// and backoff carry on. Absent (0) in journals written before it existed.
    #[serde(default)]
    pub failures: u32,
    /// The operator asked for this attempt to be replaced
    /// ([`Host::handle_replace`]): a restarted host adopts it as drifted, so
    /// it is cleaned up and started anew, as it would have been.
    #[serde(default)]
    pub replace: bool,
}

/// Everything a journal holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalImage {
    /// Scalars.
    pub meta: JournalMeta,
    /// One record per slot that holds an attempt.
    pub slots: NodeTable<SlotRecord>,
}

impl JournalImage {
    /// What `next` would change on the cluster this journal records, worked
    /// out before any host starts (so before anything is adopted).
    ///
    /// A slot's record names the template digest its attempt was made
    /// from: a slot `next` wants with another template is replaced; one it
    /// does not want is destroyed, unless the journal's own shape no longer
    /// wanted it either (it was being removed already) or a teardown was
    /// under way; a wanted slot with no record is created. What the host
    /// then finds may add work (an agent that died meanwhile is replaced),
    /// never work caused by `next`.
    pub fn diff(&self, next: &DesiredState) -> ShapeDiff {
        let previous = self.meta.shape.as_ref().and_then(|s| s.validate().ok());
        let mut changes: Vec<(LogicalNodeId, Change)> = Vec::new();
        let mut diff = ShapeDiff::default();
        for (id, record) in self.slots.iter() {
            match next.slot(&id) {
                Some(t) if t.digest() != record.template => changes.push((id, Change::Replace)),
                Some(_) => diff.unchanged += 1,
                None if previous.as_ref().is_some_and(|p| p.slot(&id).is_some())
                    && !self.meta.tearing_down =>
                {
                    changes.push((id, Change::Destroy));
                }
                None => {}
            }
        }
        let created: Vec<LogicalNodeId> = next
            .specs()
            .map(|s| s.node)
            .filter(|n| !self.slots.contains_key(n))
            .collect();
        changes.extend(created.into_iter().map(|n| (n, Change::Create)));
        // Slot order, as the daemon lists them.
        changes.sort_by_key(|c| c.0);
        for (node, change) in changes {
            diff.note(&node, change);
        }
        diff
    }

    /// The image of a journal nothing was written to yet.
    pub fn new(run_id: RunId) -> Self {
        Self {
            meta: JournalMeta {
                run_id,
                epoch: 0,
                attempts_reserved: 0,
                shape: None,
                tearing_down: false,
                paused: false,
                retired: Vec::new(),
                deployment: None,
                spent_micros: 0,
            },
            slots: NodeTable::new(),
        }
    }

    /// Applies a committed delta.
    pub fn apply(&mut self, delta: &JournalDelta) {
        if let Some(meta) = &delta.meta {
            self.meta = meta.clone();
        }
        for node in &delta.remove {
            self.slots.remove(node);
        }
        for (node, record) in &delta.put {
            self.slots.insert(*node, *record);
        }
    }
}

/// One durable change, committed as a whole.
#[must_use = "a persist MUST be committed and acknowledged with handle_persisted"]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalDelta {
    /// Its sequence number; acknowledge it with [`Host::handle_persisted`].
    pub seq: u64,
    /// The new scalars, when they changed.
    pub meta: Option<JournalMeta>,
    /// Slot records to write (removals first, then these).
    pub put: Vec<(LogicalNodeId, SlotRecord)>,
    /// Slot records to remove.
    pub remove: Vec<LogicalNodeId>,
}

/// What a provider listed for one key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listed {
    /// The key.
    pub key: ResourceKey,
    /// Its live lease, if any.
    pub lease: Option<LeaseId>,
    /// Its live session, if any.
    pub session: Option<SessionId>,
}

/// Destroy what an orphaned key holds: cancel the session, then destroy the lease.
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectRequest {
    /// The orphaned key.
    pub key: ResourceKey,
    /// Its lease, if the provider listed one.
    pub lease: Option<LeaseId>,
    /// Its session, if the provider listed one.
    pub session: Option<SessionId>,
}

/// Names a caller waiting for a [`Reply`]; chosen by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Ticket(pub u64);

/// How to shut a cluster down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShutdownMode {
    /// Scale to zero and stop only when nothing is left at the provider.
    Teardown,
    /// Stop managing; leave every node running for a later host of the run to adopt.
    Keep,
}

/// What a shutdown did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownReport {
    /// The mode.
    pub mode: ShutdownMode,
    /// Slots whose nodes were torn down.
    pub destroyed: Vec<LogicalNodeId>,
    /// Slots whose nodes were left running: their attempt holds a lease.
    pub kept: Vec<LogicalNodeId>,
    /// Slots on record whose attempt held no lease when the host stopped
    /// (it failed and its machine is gone, or none was made yet): nothing
    /// of theirs was left running, and the next host starts them.
    #[serde(default)]
    pub without_machine: Vec<LogicalNodeId>,
}

/// Why a shape was not applied.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ApplyError {
    /// The shape breaks validation or the revision contract.
    #[error(transparent)]
    Update(#[from] UpdateError),
    /// The cluster is being torn down (or has stopped); it only shrinks now.
    #[error(
        "the cluster is being torn down, so no shape can be applied; start it again once the teardown has finished"
    )]
    ShuttingDown,
    /// The shape asks for more nodes than the provider can hold.
    #[error(
        "the shape asks for {nodes} nodes{surge}, but {basis} allows at most {capacity}; nothing was changed (set `capacity` in the shape to override)"
    )]
    OverCapacity {
        /// Nodes the shape asks for at most (surge slots of a rollout included).
        nodes: u64,
        /// How the surge adds to `nodes`, said for people (empty without one).
        surge: String,
        /// The most allowed.
        capacity: u64,
        /// On what that rests.
        basis: CapacityBasis,
    },
}

/// On what the limit of an [`ApplyError::OverCapacity`] rests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CapacityBasis {
    /// The shape's own top-level `capacity`, which overrides every
    /// provider's estimate.
    Shape,
    /// A provider's estimate, as its [`Capacity::basis`] describes it.
    Provider(String),
}

impl std::fmt::Display for CapacityBasis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shape => f.write_str("the shape's `capacity`"),
            Self::Provider(basis) => f.write_str(basis),
        }
    }
}

/// What a group holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum HoldKind {
    /// Ready nodes of an outdated template wait: the group's
    /// `max_unavailable` is spent, or its rollout stopped on a failing node
    /// (ladder row 17).
    Rollout,
    /// Lost and failed nodes are not replaced: more of the group is
    /// unhealthy than its `max_unhealthy` allows (the breaker is tripped).
    /// Agents away past their grace are held as they are, and failed slots
    /// get no new attempt of the same template (ladder row 18).
    Remediation,
}

/// One thing a group holds back, and why, in words for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupHold {
    /// The group.
    pub group: GroupId,
    /// What is held.
    pub kind: HoldKind,
    /// Why, e.g. `remediation paused: 4 of 6 unhealthy > max 2`.
    pub reason: String,
}

/// Why a pause was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PauseError {
    /// The cluster is being torn down (or has stopped): a teardown overrides
    /// a pause and cannot itself be paused.
    #[error(
        "the cluster is being torn down, and a teardown cannot be paused; it removes every node whatever the pause says"
    )]
    ShuttingDown,
}

/// The answer to a ticket.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// The outcome of an apply; an accepted shape is durable by now.
    Applied(Result<DesiredUpdate, ApplyError>),
    /// The cluster converged on this generation.
    Converged(Generation),
    /// The provider's inventory and the journal are adopted.
    Adopted,
    /// The pause (`true`) or resume (`false`) asked for is durable, or why
    /// it was refused.
    Paused(Result<bool, PauseError>),
    /// The shutdown finished.
    Shutdown(ShutdownReport),
    /// The replace of this attempt asked for is durable: it will be
    /// replaced even if the daemon stops now.
    Replaced(NodeAttemptId),
    /// The host stopped before it could answer.
    Stopped,
}

/// A fold the host made of its own accord (see [`Output::Folded`]).
#[derive(Clone, Debug, PartialEq)]
pub enum HostFold {
    /// An observation: a live join fed to the core, or one that arrived
    /// before its session was known, replayed.
    Observation {
        /// The observation.
        obs: BootstrapObservation,
        /// What folding it did.
        folded: Result<Folded, DriverError>,
    },
    /// An operation of a crashed executor, folded as ambiguous.
    Result {
        /// The synthesised result.
        result: OperationResult,
        /// What folding it did.
        folded: Result<Folded, DriverError>,
    },
    /// A joined agent stayed away past its grace.
    AgentLost {
        /// The slot.
        node: LogicalNodeId,
        /// The attempt.
        attempt: NodeAttemptId,
        /// Why.
        reason: String,
        /// What folding it did.
        folded: Folded,
    },
}

/// Something the host wants done. See the module docs for what each MUST cause.
#[derive(Debug)]
pub enum Output {
    /// Make this delta durable, then call [`Host::handle_persisted`].
    Persist(JournalDelta),
    /// List the provider's resources of the run; call [`Host::handle_inventory`].
    List,
    /// A pass ran; submit its dispatches.
    Pass(Pass),
    /// Destroy an orphan's resources.
    Collect(CollectRequest),
    /// Ask the provider whether the machine of this attempt, whose agent
    /// went away, was paused by the provider itself (an interruptible
    /// rental that was outbid); call [`Host::handle_probed`] with the
    /// answer. Asked only for a group that waits for paused machines
    /// ([`OnPreempt::Wait`](crate::OnPreempt::Wait)).
    Probe {
        /// The attempt.
        key: ResourceKey,
        /// Its machine.
        lease: LeaseId,
    },
    /// A fold the host made itself; nothing to do.
    Folded(HostFold),
    /// Answer a ticket.
    Reply(Ticket, Reply),
    /// The host has stopped.
    Stop,
}

/// Something worth telling people about.
#[derive(Clone, Debug, PartialEq)]
pub enum HostEvent {
    /// A shape became the desired state.
    ShapeAccepted {
        /// Its generation.
        generation: Generation,
        /// Its node count.
        nodes: u64,
    },
    /// The provider's inventory and the journal were adopted.
    Adopted {
        /// Keys that became a slot's node.
        adopted: Vec<ResourceKey>,
        /// Attempts the journal saw created that the provider no longer
        /// lists: presumed gone (never made again), checked by a later sweep.
        presumed_gone: Vec<ResourceKey>,
        /// Adopted keys whose template is not the desired one: they are replaced.
        drifted: Vec<ResourceKey>,
        /// Keys that no slot owns: their resources are collected.
        orphans: Vec<ResourceKey>,
        /// Keys of other runs, left alone.
        foreign: Vec<ResourceKey>,
    },
    /// A sweep found resources no current attempt owns; they are collected.
    Swept {
        /// The orphans found.
        orphans: Vec<ResourceKey>,
    },
    /// An orphan was collected (`error: None`) or a try failed (it is retried).
    Collected {
        /// The orphan.
        key: ResourceKey,
        /// Why the try failed.
        error: Option<String>,
    },
    /// An agent joined.
    AgentJoined(ResourceKey),
    /// A joined agent disconnected; its node fails unless it rejoins before `grace_until`.
    AgentDisconnected {
        /// The agent.
        key: ResourceKey,
        /// When its grace ends.
        grace_until: Timestamp,
    },
    /// The provider paused an away agent's machine (see [`Output::Probe`]):
    /// its node is kept until `wait_until`, or lost at its grace's end as
    /// usual when its group replaces paused machines (`None`).
    Preempted {
        /// The agent.
        key: ResourceKey,
        /// When waiting for the machine ends.
        wait_until: Option<Timestamp>,
    },
    /// A node changed.
    NodeChanged(LogicalNodeId),
    /// An effect was dispatched.
    Dispatched {
        /// The slot.
        node: LogicalNodeId,
        /// The operation.
        op: OperationId,
        /// The effect.
        effect: EffectKind,
    },
    /// A pass ran.
    Pass {
        /// Its number.
        number: u64,
        /// Its counters.
        stats: PassStats,
    },
    /// The cluster converged on a generation.
    Converged {
        /// The generation.
        generation: Generation,
        /// Nodes held.
        nodes: usize,
    },
    /// Reconciling was paused: nothing new is dispatched until it resumes.
    Paused,
    /// Reconciling resumed (asked for, or overridden by a teardown).
    Resumed {
        /// A teardown overrode the pause.
        by_teardown: bool,
    },
    /// A teardown began.
    TeardownStarted {
        /// The empty generation it converges on.
        generation: Generation,
    },
    /// A group began holding something back, or its reason changed
    /// (`reason: Some`), or it stopped holding it (`reason: None`).
    Hold {
        /// The group.
        group: GroupId,
        /// What it holds.
        kind: HoldKind,
        /// Why, while it holds.
        reason: Option<String>,
    },
    /// The host heard nothing for longer than it may (see [`DeafGap`]):
    /// every agent joined or away gets its whole grace again from `gap.to`,
    /// and bootstrap stall deadlines move on by the gap.
    Deaf(DeafGap),
    /// Something went wrong that people should know about.
    Warning(String),
}

/// Why an agent's join was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JoinRefused {
    /// The key names another run.
    #[error("run {0} is not this cluster's run")]
    OtherRun(RunId),
    /// No node holds that slot.
    #[error("{0} is not a node of this cluster")]
    UnknownNode(LogicalNodeId),
    /// The attempt was replaced by a newer one.
    #[error("attempt {given} of {node} is superseded (current: {current})")]
    Superseded {
        /// The slot.
        node: LogicalNodeId,
        /// The attempt that asked.
        given: NodeAttemptId,
        /// The slot's current attempt.
        current: NodeAttemptId,
    },
    /// The attempt failed or is being deleted.
    #[error("{0} is being deleted")]
    NotActive(LogicalNodeId),
    /// The host has stopped.
    #[error("the cluster has stopped")]
    Stopped,
    /// The journal holds this attempt but the host has not adopted it yet
    /// (it is still waiting for the provider's inventory or a shape): the
    /// agent should ask again shortly. Not a refusal of the attempt.
    #[error("{0} is known but not adopted yet; ask again shortly")]
    NotYet(LogicalNodeId),
}

impl JoinRefused {
    /// Whether the agent should ask again rather than give up.
    pub fn is_transient(&self) -> bool {
        // A stopped host is one that is going away (`down --keep`, a
        // restart): its agents find the next one.
        matches!(self, Self::NotYet(_) | Self::Stopped)
    }
}

/// Why an operator's replace was refused; nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplaceError {
    /// No node holds that slot.
    #[error("{0} is not a node of this cluster")]
    UnknownNode(LogicalNodeId),
    /// The node has failed already (it is being replaced) or is being deleted.
    #[error("{0} is already failed or being deleted; it needs no replacing")]
    NotActive(LogicalNodeId),
    /// An operation on the node is in flight; replacing it now could leave
    /// that operation's result nowhere to go.
    #[error("{node} has an operation in flight ({effect:?}); try again once it finishes")]
    Busy {
        /// The slot.
        node: LogicalNodeId,
        /// The operation in flight.
        effect: crate::EffectKind,
    },
    /// The cluster is shutting down or has stopped.
    #[error("the cluster is shutting down")]
    ShuttingDown,
}

/// The reason an operator's replace gives the failed attempt.
pub const REPLACED_BY_OPERATOR: &str = "replaced by the operator";

/// The reason an attempt fails when its joined agent stayed away past its
/// grace (counted only while the host was listening).
pub const AWAY_PAST_GRACE: &str = "its agent stayed away past its grace";

/// Why a node is failed whose machine its provider paused and did not
/// resume within its group's `preempt_wait_s` (nor its agent's grace).
pub const PAUSED_PAST_WAIT: &str =
    "its machine was paused by its provider (preempted) and did not resume in time";

/// Why a host could not be built.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum HostError {
    /// The journal belongs to another run.
    #[error("the journal belongs to run {journal}, not {given}")]
    OtherRun {
        /// The journal's run.
        journal: RunId,
        /// The core's run.
        given: RunId,
    },
    /// The journal's shape is refused by the core (a journal written by another version?).
    #[error("the journal's shape cannot be applied: {0}")]
    JournalShape(UpdateError),
    /// The core is not fresh.
    #[error("the host needs a fresh core with no nodes and no shape")]
    CoreNotFresh,
    /// The lane count is zero.
    #[error("lanes must be at least 1")]
    NoLanes,
}

/// The agent link of a slot's current attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// The agent is connected to this host.
    Connected(NodeAttemptId),
    /// The agent joined once and is away; the attempt fails at `until`.
    Away {
        /// The attempt.
        attempt: NodeAttemptId,
        /// End of its grace.
        until: Timestamp,
    },
}

impl Link {
    /// Whether `node` counts as ready for people and tools, given its agent
    /// link (`None`: its agent never joined this host): its attempt is ready
    /// and that attempt's agent is not away, since an agent that went away
    /// may be gone. Every view (`status`, `watch`, the dashboard, metrics)
    /// reads readiness from here.
    pub fn shows_ready(link: Option<Link>, node: &ManagedNode) -> bool {
        let away = matches!(link, Some(Link::Away { attempt, .. }) if attempt == node.attempt);
        node.is_ready() && !away
    }
}

/// What happens next to a node, and when, as [`Host::next_step`] tells it:
/// the one answer `status`, `describe`, `watch`, `plan`, `up`'s table and
/// the dashboard all give, so no view promises a retry that will not come.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NextStep {
    /// Nothing: the node is ready (or unknown).
    #[default]
    Nothing,
    /// It moves on by itself: an operation is out, or its agent is being
    /// waited for.
    Working,
    /// Its next try (an effect, or a new attempt) is due at this instant.
    RetryAt(Timestamp),
    /// Its agent is away: the attempt fails at `at` unless the agent is
    /// back; `replaced` says whether a new attempt follows (not while paused).
    LostAt {
        /// When its grace ends.
        at: Timestamp,
        /// Whether a new attempt follows then.
        replaced: bool,
    },
    /// Nothing happens to it until the hold clears.
    Held(HeldBy),
    /// It is being cleaned up and removed (or replaced once that is done).
    Leaving,
}

/// What holds a node back (see [`NextStep::Held`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HeldBy {
    /// Reconciling is paused (`swactor pause`).
    Paused,
    /// Its group's remediation breaker is tripped (`max_unhealthy`).
    Remediation,
    /// Its group's rollout stopped on a failing node, or waits for its budget.
    Rollout,
}

impl fmt::Display for HeldBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Paused => "paused",
            Self::Remediation => "remediation paused",
            Self::Rollout => "rollout stopped",
        })
    }
}

/// A stretch of time in which the host was handed no input at all, longer
/// than [`ReconcilerConfig::listen_gap_ms`]: the daemon around it could not
/// have heard its agents (its process was stopped, its machine slept, its
/// event loop was starved, it was busy elsewhere). Silence in it is nobody's
/// fault, so no agent is judged by it; see [`Host::last_deaf_gap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeafGap {
    /// The last input before the gap.
    pub from: Timestamp,
    /// The first input after it: the host listens again from here.
    pub to: Timestamp,
    /// Agents whose judgement it restarted (joined or away at `to`).
    pub agents: usize,
}

impl DeafGap {
    /// How long the host heard nothing.
    pub fn len_ms(&self) -> u64 {
        self.to.as_millis().saturating_sub(self.from.as_millis())
    }
}

#[derive(Clone, Debug)]
struct Collect {
    request: CollectRequest,
    failures: u32,
    due: Option<Timestamp>,
}

#[derive(Clone, Debug)]
enum Todo {
    Observe(BootstrapObservation),
    FeedJoin(LogicalNodeId),
    LaneLost(OperationId, LogicalNodeId),
    AgentLost(LogicalNodeId, NodeAttemptId, FailureCause, String),
}

/// An attempt the journal names that a listing does not hold.
struct Unlisted {
    key: ResourceKey,
    /// Whether it was ever seen created.
    created: bool,
    /// Whether its slot still wants the template it was made from.
    wanted: bool,
    /// Its slot's failures so far.
    failures: u32,
}

#[derive(Clone, Debug)]
enum Adoption {
    /// Waiting for the provider's inventory.
    Listing,
    /// Inventory in hand, waiting for a shape (or a shutdown) to judge it by.
    Waiting(Vec<Listed>),
    /// The first inventory missed attempts the journal names: waiting for a
    /// second one, taken after the provider's listing lag (the first is
    /// kept in case that one fails).
    Relisting(Vec<Listed>),
    /// Done.
    Done,
}

#[derive(Clone, Debug)]
struct Shutdown {
    mode: ShutdownMode,
    tickets: Vec<Ticket>,
    nodes: BTreeSet<LogicalNodeId>,
}

/// The cluster host. See the module docs for the calling order.
#[derive(Debug)]
pub struct Host<C: Reconciler> {
    core: C,
    config: HostConfig,
    meta: JournalMeta,
    slots: NodeTable<SlotRecord>,
    meta_dirty: bool,
    /// Slots whose record changed since the last flush, in the order they
    /// changed (a slot may be here more than once, or have no record any
    /// more): the flush writes each one's record as it then is. A list, not
    /// a table by slot, so a flush of a few slots near the end of a large
    /// group costs what they do, not the group's length.
    put: Vec<LogicalNodeId>,
    remove: BTreeSet<LogicalNodeId>,
    next_seq: u64,
    awaiting: Option<u64>,
    adoption: Adoption,
    links: NodeTable<Link>,
    graces: BTreeSet<(Timestamp, LogicalNodeId)>,
    early: BTreeMap<LogicalNodeId, Vec<BootstrapObservation>>,
    /// The operation each node has out for execution (its lane is
    /// [`Host::lane_of`] its attempt). A node waits on one operation at a
    /// time, so a newer one replaces an older one still out, whose result
    /// (if it ever comes) the core discards.
    in_flight: NodeTable<OperationId>,
    collects: BTreeMap<ResourceKey, Collect>,
    sweep_at: Option<Timestamp>,
    listing: bool,
    verify: bool,
    /// The adoption was judged on a second listing (see
    /// [`HostConfig::visibility_window_ms`]).
    relisted: bool,
    todo: VecDeque<Todo>,
    outputs: VecDeque<Output>,
    events: VecDeque<HostEvent>,
    waiters: Vec<Ticket>,
    /// Waiting for the adoption ([`Host::handle_wait_adopted`]).
    adopt_waiters: Vec<Ticket>,
    shutdown: Option<Shutdown>,
    converged_reported: Option<Generation>,
    /// The node that kept the last convergence check from passing: the next
    /// one starts there.
    converged_hint: Option<LogicalNodeId>,
    stopped: bool,
    digests: Vec<(Arc<NodeTemplate>, u64)>,
    history: NodeTable<Attempts>,
    /// Away agents whose grace ended while their group's breaker was tripped.
    held_lost: BTreeSet<LogicalNodeId>,
    /// Attempts whose machine the provider was found to have paused, and
    /// since when; forgotten when the agent is back or the attempt ends.
    preempted: BTreeMap<LogicalNodeId, (NodeAttemptId, Timestamp)>,
    /// What each group holds back, as last announced.
    holds: BTreeMap<(GroupId, HoldKind), String>,
    /// No group's breaker was tripped when last told to the core.
    tripped_none: bool,
    /// The latest instant an input was handed in with (see
    /// [`Host::last_deaf_gap`]).
    last_input: Option<Timestamp>,
    /// The latest deaf gap, if there was one.
    deaf: Option<DeafGap>,
    /// Starved time reported in all ([`Host::handle_starved`]).
    starved_ms: u64,
    /// The most the run was said to have spent ([`Host::handle_spent`]);
    /// the journal holds it once it is a cent past what it holds.
    spent_micros: u64,
}

impl<C: Reconciler> Host<C> {
    /// A host around `core`, which must be fresh (no nodes, no shape). With a
    /// journal, the host resumes it: its shape becomes the desired state
    /// again, attempt ids continue above its reservation, and its slot
    /// records are adopted with the provider's inventory.
    ///
    /// # Errors
    /// The journal is another run's or its shape is refused; the core is not fresh.
    pub fn new(
        mut core: C,
        config: HostConfig,
        journal: Option<JournalImage>,
    ) -> Result<Self, HostError> {
        if config.lanes == 0 {
            return Err(HostError::NoLanes);
        }
        let run_id = core.state().run_id.clone();
        if !core.state().nodes.is_empty() || core.desired().generation.0 != 0 {
            return Err(HostError::CoreNotFresh);
        }
        let image = journal.unwrap_or_else(|| {
            let mut image = JournalImage::new(run_id.clone());
            image.meta.deployment.clone_from(&config.deployment);
            image
        });
        if image.meta.run_id != run_id {
            return Err(HostError::OtherRun {
                journal: image.meta.run_id,
                given: run_id,
            });
        }
        let JournalImage { mut meta, slots } = image;
        meta.epoch = meta.epoch.saturating_add(1);
        core.raise_attempt_floor(meta.attempts_reserved);
        // A paused cluster comes back paused, before anything is decided.
        core.set_paused(meta.paused);
        if let Some(shape) = &meta.shape {
            core.update_desired(shape)
                .map_err(HostError::JournalShape)?;
        }
        Ok(Self {
            core,
            config,
            meta,
            slots,
            meta_dirty: true,
            put: Vec::new(),
            remove: BTreeSet::new(),
            next_seq: 1,
            awaiting: None,
            adoption: Adoption::Listing,
            links: NodeTable::new(),
            graces: BTreeSet::new(),
            early: BTreeMap::new(),
            in_flight: NodeTable::new(),
            collects: BTreeMap::new(),
            sweep_at: Some(Timestamp::from_millis(0)),
            listing: false,
            verify: false,
            relisted: false,
            todo: VecDeque::new(),
            outputs: VecDeque::new(),
            events: VecDeque::new(),
            waiters: Vec::new(),
            adopt_waiters: Vec::new(),
            shutdown: None,
            converged_reported: None,
            converged_hint: None,
            stopped: false,
            digests: Vec::new(),
            history: NodeTable::new(),
            held_lost: BTreeSet::new(),
            preempted: BTreeMap::new(),
            spent_micros: 0,
            holds: BTreeMap::new(),
            tripped_none: true,
            last_input: None,
            deaf: None,
            starved_ms: 0,
        })
    }

    // ----- queries -----

    /// The driver core (read-only: only the host writes it).
    pub fn core(&self) -> &C {
        &self.core
    }

    /// The core's configuration.
    pub fn config(&self) -> &ReconcilerConfig {
        self.core.config()
    }

    /// The host's settings.
    pub fn host_config(&self) -> &HostConfig {
        &self.config
    }

    /// The durable scalars as of the last persist handed out (or about to be).
    pub fn journal_meta(&self) -> &JournalMeta {
        &self.meta
    }

    /// The slot records as of the last persist handed out (or about to be).
    pub fn slot_records(&self) -> &NodeTable<SlotRecord> {
        &self.slots
    }

    /// The agent link of `node`'s current attempt, if its agent ever joined this host.
    pub fn link(&self, node: &LogicalNodeId) -> Option<Link> {
        self.links.get(node).copied()
    }

    /// Orphans still being collected.
    pub fn collecting(&self) -> impl Iterator<Item = &ResourceKey> {
        self.collects.keys()
    }

    /// Whether the provider's inventory has been adopted.
    pub fn adopted(&self) -> bool {
        matches!(self.adoption, Adoption::Done)
    }

    /// The shutdown under way, if any.
    pub fn shutting_down(&self) -> Option<ShutdownMode> {
        self.shutdown.as_ref().map(|s| s.mode)
    }

    /// Whether reconciling is paused (see [`Host::handle_pause`]).
    pub fn is_paused(&self) -> bool {
        self.meta.paused
    }

    /// Whether the host has stopped.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The lane every operation of `attempt` goes to.
    pub fn lane_of(&self, attempt: NodeAttemptId) -> u32 {
        (attempt.0 % u64::from(self.config.lanes)) as u32
    }

    /// Converged on the desired shape with nothing left to adopt, verify or
    /// collect, and no agent away: before the inventory is in (and, after a restart that
    /// presumed an attempt gone, before the sweep that checks it), "nothing
    /// else held" is not known.
    pub fn is_converged(&self) -> bool {
        self.convergence().is_ok()
    }

    /// [`Host::is_converged`], naming the node that is not when there is one
    /// (the core's walk starts at the one the last check named).
    fn convergence(&self) -> Result<(), Option<LogicalNodeId>> {
        // An agent that is away may be gone: its node is not counted on
        // until it is back or replaced.
        if !(self.settled() && self.agents_away() == 0) {
            return Err(None);
        }
        self.core.unconverged_from(self.converged_hint.as_ref())
    }

    /// Agents that disconnected (or were heard of only from an earlier
    /// daemon) and whose grace is running, or is over but held by their
    /// group's breaker.
    pub fn agents_away(&self) -> usize {
        self.graces.len() + self.held_lost.len()
    }

    /// Slots whose agent stayed away past its grace while their group's
    /// breaker was tripped: kept as they are (not failed, not replaced)
    /// until the agent returns, or the group is back within its
    /// `max_unhealthy` (then the agent gets its grace again, from then).
    pub fn held_lost(&self) -> impl Iterator<Item = &LogicalNodeId> {
        self.held_lost.iter()
    }

    /// What each group holds back and why, as of the host's last quiet
    /// moment, in group order (see [`HoldKind`]).
    pub fn holds(&self) -> Vec<GroupHold> {
        self.holds
            .iter()
            .map(|((group, kind), reason)| GroupHold {
                group: *group,
                kind: *kind,
                reason: reason.clone(),
            })
            .collect()
    }

    /// The breaker of `group`, when it is tripped (see
    /// [`breaker`](crate::breaker); an agent is away when it disconnected
    /// or went silent, its grace running or held). While the breaker is tripped, an away agent whose grace ends is held
    /// instead of failing its node; everything else goes on (a node whose
    /// own process or stream reports a failure is still failed and
    /// replaced, and rollouts and scaling are not affected).
    pub fn breaker(&self, group: &GroupId) -> Option<Breaker> {
        let away = |id: &LogicalNodeId, attempt: NodeAttemptId| matches!(self.links.get(id), Some(Link::Away { attempt: a, .. }) if *a == attempt);
        self.core.breaker(group, &away)
    }

    /// The inventory is adopted, no attempt presumed gone awaits its check,
    /// and no orphan is left to collect.
    pub fn settled(&self) -> bool {
        self.adopted() && !self.verify && self.collects.is_empty()
    }

    /// Whether a pass is queued in the core.
    pub fn is_pass_queued(&self) -> bool {
        self.core.is_pass_queued()
    }

    /// What the next pass would do on the current shape, or on `shape` if
    /// it were applied, and what the shape changes overall.
    ///
    /// # Errors
    /// `shape` breaks validation, the revision contract or the capacity, or
    /// the cluster is being torn down.
    pub fn plan(
        &self,
        shape: Option<&ClusterShape>,
        now: Timestamp,
    ) -> Result<(Plan, ShapeDiff), ApplyError> {
        match shape {
            None => Ok((
                self.core.plan(now),
                diff(self.core.state(), self.core.desired()),
            )),
            Some(_) if self.shutdown.is_some() || self.stopped => Err(ApplyError::ShuttingDown),
            Some(s) => {
                self.check_capacity(s)?;
                let plan = self.core.plan_shape(s, now)?;
                let next = s.validate().map_err(UpdateError::from)?;
                Ok((plan, diff(self.core.state(), &next)))
            }
        }
    }

    /// Nodes with an operation handed out for execution whose result has not
    /// come back (an older operation of a node that has a newer one out is
    /// not counted: nothing waits on it).
    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    /// The attempts of `node` remembered for people, oldest first.
    pub fn history(&self, node: &LogicalNodeId) -> Option<Vec<AttemptRecord>> {
        self.history.get(node).map(Attempts::records)
    }

    /// Refuses a shape that grows past the capacity (the shape's own, or the provider's).
    ///
    /// A malformed shape or one of another run is left for the revision
    /// contract to refuse, with its own clearer reason.
    fn check_capacity(&self, shape: &ClusterShape) -> Result<(), ApplyError> {
        if shape.run_id != self.meta.run_id {
            return Ok(());
        }
        crate::capacity::check_capacity(shape, self.core.desired(), &self.config.capacities)
    }

    /// The earliest instant the host needs waking: the core's deadline, a
    /// grace end, an orphan's retry, and, while it holds any node or agent,
    /// a watch [`ReconcilerConfig::listen_watch_ms`] after its last input
    /// (so that a gap longer than [`ReconcilerConfig::listen_gap_ms`] means
    /// the daemon was not listening; see [`Host::last_deaf_gap`]).
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.stopped {
            return None;
        }
        let grace = self.graces.first().map(|(at, _)| *at);
        let collect = self.collects.values().filter_map(|c| c.due).min();
        let sweep = self.sweep_at.filter(|_| !self.listing);
        earliest(
            earliest(self.core.poll_timeout(), grace),
            earliest(earliest(collect, sweep), self.watch_at()),
        )
    }

    /// When the host next wants an input, if only to know it was listening.
    fn watch_at(&self) -> Option<Timestamp> {
        let watching = !self.links.is_empty() || !self.core.state().nodes.is_empty();
        self.last_input
            .filter(|_| watching)
            .map(|at| at.saturating_add_ms(self.core.config().listen_watch_ms()))
    }

    /// What happens next to `node`, and when (see [`NextStep`]); `None`
    /// for a slot the host holds no node for.
    ///
    /// It reads what the ladder will do: a pause holds every create,
    /// restart and replacement (cleanups still run); a tripped breaker
    /// holds its group's away agents and restarts; a stopped or spent
    /// rollout holds its group's outdated ready nodes.
    pub fn next_step(&self, node: &LogicalNodeId, now: Timestamp) -> Option<NextStep> {
        let n = self.core.state().nodes.get(node)?;
        let paused = self.core.is_paused();
        let desired = self.core.desired().slot(node);
        if n.record.stage == NodeStage::Destroyed {
            // Cleaned up: reaped if its slot is gone, else a new attempt.
            let Some(template) = desired else {
                return Some(NextStep::Leaving);
            };
            if paused {
                return Some(NextStep::Held(HeldBy::Paused));
            }
            if crate::shape::same_template(template, &n.template)
                && self
                    .core
                    .desired()
                    .group(&node.group)
                    .is_some_and(|g| g.policy.max_unhealthy.is_some())
                && self.breaker(&node.group).is_some()
            {
                return Some(NextStep::Held(HeldBy::Remediation));
            }
            return Some(NextStep::RetryAt(
                n.record.restart_at.unwrap_or(now).max(now),
            ));
        }
        if n.intent == Intent::Deleting {
            return Some(match n.retry.next_effect_at {
                Some(at) if at > now && n.pending.is_none() => NextStep::RetryAt(at),
                _ => NextStep::Leaving,
            });
        }
        if let Some(Link::Away { attempt, until }) = self.links.get(node).copied()
            && attempt == n.attempt
        {
            return Some(if self.held_lost.contains(node) {
                NextStep::Held(HeldBy::Remediation)
            } else {
                NextStep::LostAt {
                    at: until,
                    replaced: !paused,
                }
            });
        }
        if n.pending.is_some() {
            return Some(NextStep::Working);
        }
        if n.record.stage == NodeStage::Failed {
            // Its cleanup begins at the next pass, paused or not.
            return Some(NextStep::Leaving);
        }
        if n.is_ready() {
            let outdated = desired.is_some_and(|t| !crate::shape::same_template(t, &n.template));
            if outdated && !paused && self.holds.contains_key(&(node.group, HoldKind::Rollout)) {
                return Some(NextStep::Held(HeldBy::Rollout));
            }
            return Some(if outdated && paused {
                NextStep::Held(HeldBy::Paused)
            } else {
                NextStep::Nothing
            });
        }
        if paused && !n.record.resuming {
            // A live attempt is not advanced while paused (its stream is
            // still heard, and a join still makes it ready).
            return Some(match n.record.stage {
                NodeStage::BootstrapRunning | NodeStage::SwactorJoined => NextStep::Working,
                _ => NextStep::Held(HeldBy::Paused),
            });
        }
        Some(match n.retry.next_effect_at {
            Some(at) if at > now => NextStep::RetryAt(at),
            _ => NextStep::Working,
        })
    }

    /// The latest deaf gap: two inputs further apart than
    /// [`ReconcilerConfig::listen_gap_ms`]. A daemon that listens never
    /// leaves one (the host asks to be woken well within it), so a gap is
    /// time in which nobody could be heard, and its silence is held against
    /// nobody:
    /// - an agent away when the gap ends gets its whole grace again, from
    ///   the gap's end;
    /// - an agent found silent later is judged from the gap's end at the
    ///   earliest, however long ago it was last heard;
    /// - a bootstrap's stall deadline moves on by the gap's length
    ///   ([`Reconciler::handle_unheard`]).
    ///
    /// An agent that really died in the gap is therefore replaced one grace
    /// after the daemon is back, never at once.
    pub fn last_deaf_gap(&self) -> Option<DeafGap> {
        self.deaf
    }

    /// The grace `node`'s group grants a silent agent (0 for no node).
    fn grace_of(&self, node: &LogicalNodeId) -> u64 {
        self.core
            .state()
            .nodes
            .get(node)
            .map_or(0, |n| n.template.join.lost_grace_ms())
    }

    /// From when silence counts: the end of the latest deaf gap.
    fn listening_since(&self) -> Timestamp {
        self.deaf.map_or(Timestamp::from_millis(0), |g| g.to)
    }

    /// Every input passes here first, with its `now`: a gap since the last
    /// one longer than the core's `listen_gap_ms` is a deaf gap.
    fn heard(&mut self, now: Timestamp) {
        let gap_max = self.core.config().listen_gap_ms;
        match self.last_input {
            Some(last) if now <= last => return,
            Some(last) if now.as_millis() - last.as_millis() > gap_max => self.deafened(last, now),
            _ => {}
        }
        self.last_input = Some(now);
    }

    fn deafened(&mut self, from: Timestamp, to: Timestamp) {
        let links: Vec<(LogicalNodeId, Link)> = self.links.iter().map(|(n, l)| (n, *l)).collect();
        let agents = links.len();
        for (node, link) in links {
            let Link::Away { attempt, until } = link else {
                continue;
            };
            if self.held_lost.contains(&node) {
                // No deadline while held; released, it gets a grace anyway.
                continue;
            }
            let grace = self.grace_of(&node);
            let fresh = to.saturating_add_ms(grace);
            if fresh > until {
                self.set_link(
                    &node,
                    Link::Away {
                        attempt,
                        until: fresh,
                    },
                );
            }
        }
        self.core.handle_unheard(from, to);
        let gap = DeafGap { from, to, agents };
        self.deaf = Some(gap);
        self.events.push_back(HostEvent::Deaf(gap));
    }

    /// The host's own deadlines, for diagnostics: (earliest grace, earliest
    /// orphan retry, next sweep).
    pub fn host_deadlines(&self) -> [Option<Timestamp>; 3] {
        [
            self.graces.first().map(|(at, _)| *at),
            self.collects.values().filter_map(|c| c.due).min(),
            self.sweep_at.filter(|_| !self.listing),
        ]
    }

    /// The next event to publish.
    pub fn poll_event(&mut self) -> Option<HostEvent> {
        self.events.pop_front()
    }

    // ----- inputs -----

    /// The provider's inventory for this run (or why it could not be
    /// listed), answering [`Output::List`]. The first one is adopted once a
    /// shape (or a shutdown) says what is desired; later ones are sweeps:
    /// whatever no slot's current attempt owns is collected.
    pub fn handle_inventory(&mut self, listed: Result<Vec<Listed>, String>, now: Timestamp) {
        self.heard(now);
        self.listing = false;
        let listed = match listed {
            Err(e) => {
                self.warn(format!("could not list the provider's resources: {e}"));
                match &mut self.adoption {
                    // The journal's records are still adopted; what the
                    // provider holds beyond them is found by a later sweep.
                    Adoption::Listing => Vec::new(),
                    // Judged on the first listing, and verified by a sweep.
                    Adoption::Relisting(first) => std::mem::take(first),
                    _ => {
                        self.schedule_sweep(now);
                        return;
                    }
                }
            }
            Ok(listed) => {
                if matches!(self.adoption, Adoption::Relisting(_)) {
                    self.relisted = true;
                }
                listed
            }
        };
        match self.adoption {
            Adoption::Listing | Adoption::Relisting(_) => {
                self.adoption = Adoption::Waiting(listed);
                self.adopt_if_ready(now);
            }
            Adoption::Waiting(_) => {}
            Adoption::Done => self.sweep(listed, now),
        }
    }

    /// Offers a shape. Returns the decision at once; the [`Reply`] for
    /// `ticket` follows once an accepted shape is durable.
    ///
    /// # Errors
    /// The shape is refused (the same error is replied).
    pub fn handle_apply(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        self.heard(now);
        let before = self.desired_templates();
        let outcome = if self.shutdown.is_some() || self.stopped {
            Err(ApplyError::ShuttingDown)
        } else {
            self.check_capacity(shape)
                .and_then(|()| self.core.update_desired(shape).map_err(ApplyError::from))
        };
        if let Ok(DesiredUpdate::Accepted(generation)) = outcome {
            // Room for each group's slots in one allocation, as the state
            // has: a doubling vector would copy itself as it grows and keep
            // up to half again of slack.
            for g in &self.core.desired().groups {
                self.slots.reserve(&g.id, g.count);
                self.links.reserve(&g.id, g.count);
                self.in_flight.reserve(&g.id, g.count);
                if self.config.history_len > 0 {
                    self.history.reserve(&g.id, g.count);
                }
            }
            self.retire_templates(&before);
            self.meta.shape = Some(shape.clone());
            self.meta.tearing_down = false;
            self.meta_dirty = true;
            self.events.push_back(HostEvent::ShapeAccepted {
                generation,
                nodes: self.core.desired().node_count(),
            });
            self.adopt_if_ready(now);
        }
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Applied(outcome.clone())));
        outcome
    }

    /// Offers `shape` as the next generation, whatever generation it
    /// carries: a shape with the current shape's content is
    /// [`DesiredUpdate::Unchanged`] at the current generation, any other is
    /// offered at the current generation plus one (at least 1), as
    /// [`Host::handle_apply`] would take it. The generation is read and the
    /// shape offered in one step, so no other apply can come between them.
    ///
    /// # Errors
    /// As [`Host::handle_apply`].
    pub fn handle_apply_next(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        let current = self.core.desired().generation;
        let same = current.0 > 0
            && shape
                .validate()
                .is_ok_and(|next| next.same_content(self.core.desired()));
        let mut next = shape.clone();
        next.generation = if same {
            current
        } else {
            Generation(current.0.saturating_add(1))
        };
        self.handle_apply(&next, ticket, now)
    }

    /// Pauses (`paused`) or resumes reconciling. Returns whether that changed
    /// anything; the [`Reply::Paused`] for `ticket` follows once the flag is
    /// durable, so a daemon killed after the reply comes back as it was left.
    ///
    /// A paused cluster goes on folding every result, observation and agent
    /// report, and shows them, but its passes dispatch nothing new (the
    /// rule is [`allowed_while_paused`](crate::allowed_while_paused)):
    /// operations already pending finish and are folded, a deleting or
    /// failed attempt is still cleaned up, orphans are still collected, and
    /// shapes are still accepted (and made durable) but not acted on until
    /// resumed. The core is paused at once, before the flag is durable: a
    /// pause that a crash loses was never acknowledged, and in the meantime
    /// it only held work back.
    ///
    /// # Errors
    /// [`PauseError::ShuttingDown`]: pausing a teardown (resuming one is a
    /// no-op, since a teardown already overrode the pause).
    pub fn handle_pause(
        &mut self,
        paused: bool,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<bool, PauseError> {
        self.heard(now);
        let outcome = if paused && (self.shutdown.is_some() || self.stopped) {
            Err(PauseError::ShuttingDown)
        } else if self.meta.paused == paused || self.stopped {
            Ok(false)
        } else {
            self.meta.paused = paused;
            self.meta_dirty = true;
            self.core.set_paused(paused);
            self.events.push_back(if paused {
                HostEvent::Paused
            } else {
                HostEvent::Resumed { by_teardown: false }
            });
            Ok(true)
        };
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Paused(outcome)));
        outcome
    }

    /// Asks to be told when the cluster is converged on its current shape.
    pub fn handle_wait_converged(&mut self, ticket: Ticket) {
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
        } else if self.is_converged() && !self.core.is_pass_queued() {
            let generation = self.core.desired().generation;
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Converged(generation)));
        } else {
            self.waiters.push(ticket);
        }
    }

    /// Asks to be told once the provider's inventory and the journal have
    /// been adopted (see [`Host::adopted`]): a start that offers a shape
    /// waits for it, so the shape is judged against what really runs.
    pub fn handle_wait_adopted(&mut self, ticket: Ticket) {
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
        } else if self.adopted() {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Adopted));
        } else {
            self.adopt_waiters.push(ticket);
        }
    }

    /// Shuts the cluster down. [`ShutdownMode::Keep`] stops at once and
    /// leaves every node for a later host; [`ShutdownMode::Teardown`] is made
    /// durable first (a restarted host knows a teardown was asked for), then
    /// scales to zero, collects every orphan and stops when nothing is left.
    pub fn handle_shutdown(&mut self, mode: ShutdownMode, ticket: Ticket, now: Timestamp) {
        self.heard(now);
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
            return;
        }
        if let Some(s) = &mut self.shutdown {
            s.tickets.push(ticket);
            return;
        }
        let nodes: BTreeSet<LogicalNodeId> = self.core.state().nodes.keys().cloned().collect();
        match mode {
            ShutdownMode::Keep => {
                let state = self.core.state();
                let (kept, without_machine) = nodes.into_iter().partition(|id| {
                    state
                        .nodes
                        .get(id)
                        .is_some_and(|n| n.record.lease.is_some())
                });
                let report = ShutdownReport {
                    mode,
                    destroyed: Vec::new(),
                    kept,
                    without_machine,
                };
                self.outputs
                    .push_back(Output::Reply(ticket, Reply::Shutdown(report)));
                self.stop();
            }
            ShutdownMode::Teardown => {
                let generation = Generation(self.core.desired().generation.0.saturating_add(1));
                let empty = ClusterShape {
                    run_id: self.meta.run_id.clone(),
                    generation,
                    groups: Vec::new(),
                    capacity: None,
                    budget: None,
                };
                if let Err(e) = self.core.update_desired(&empty) {
                    // Unreachable: an empty shape of this run at a higher
                    // generation is always valid.
                    self.warn(format!("cannot begin the teardown: {e}"));
                }
                self.meta.shape = Some(empty);
                self.meta.tearing_down = true;
                if self.meta.paused {
                    // The user asked for everything to go: that overrides
                    // the pause, durably with the teardown itself, so a
                    // later `up` is not paused either.
                    self.meta.paused = false;
                    self.core.set_paused(false);
                    self.events
                        .push_back(HostEvent::Resumed { by_teardown: true });
                }
                self.meta_dirty = true;
                self.flush_delta();
                self.events
                    .push_back(HostEvent::TeardownStarted { generation });
                self.shutdown = Some(Shutdown {
                    mode,
                    tickets: vec![ticket],
                    nodes,
                });
                self.adopt_if_ready(now);
            }
        }
    }

    /// A delta was made durable.
    pub fn handle_persisted(&mut self, seq: u64) {
        debug_assert_eq!(
            self.awaiting,
            Some(seq),
            "only the delta the host awaits can be made durable"
        );
        debug_assert!(seq < self.next_seq, "delta {seq} was never issued");
        if self.awaiting == Some(seq) {
            self.awaiting = None;
        }
    }

    /// Folds an operation result.
    ///
    /// # Errors
    /// As [`Reconciler::handle_result`].
    pub fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        self.back_from_flight(&result.node, result.op);
        let node = result.node;
        let started = matches!(result.outcome, OperationOutcome::BootstrapStarted { .. });
        let created = matches!(result.outcome, OperationOutcome::LeaseCreated { .. });
        let attempt = result.op.attempt;
        let folded = self.core.handle_result(result, now)?;
        if folded == Folded::Applied {
            self.node_changed(&node, now);
            if started {
                self.bootstrap_started(&node);
            }
            if created {
                self.record_created(&node, attempt);
            }
        }
        Ok(folded)
    }

    /// A dispatch could not be submitted: it folds as a definite failure.
    ///
    /// # Errors
    /// As [`Reconciler::handle_submit_failed`].
    pub fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        self.back_from_flight(node, op);
        let folded = self.core.handle_submit_failed(node, op, reason, now)?;
        if folded == Folded::Applied {
            self.node_changed(node, now);
        }
        Ok(folded)
    }

    /// `node`'s operation `op` is back (its result, or a refused submit).
    fn back_from_flight(&mut self, node: &LogicalNodeId, op: OperationId) {
        if self.in_flight.get(node) == Some(&op) {
            self.in_flight.remove(node);
        }
    }

    /// Folds a bootstrap stream observation.
    ///
    /// An observation for a session whose StartBootstrap result has not
    /// arrived yet is kept and replayed once it does. A stream's report that
    /// the agent joined proves a live join only with
    /// [`HostConfig::stream_joins`]; otherwise it means the agent joined
    /// once (perhaps an earlier host), so if it is not connected now it gets
    /// its grace to reconnect.
    ///
    /// # Errors
    /// As [`Reconciler::handle_bootstrap`].
    pub fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        if obs.event == BootstrapEvent::SwactorJoined {
            if self.config.stream_joins {
                if let Some(n) = self.core.state().nodes.get(&obs.node)
                    && n.attempt == obs.attempt
                {
                    self.set_link(&obs.node, Link::Connected(obs.attempt));
                }
            } else {
                self.joined_before(&obs.node, obs.attempt, now);
                return Ok(Folded::Discarded(DiscardReason::NotLive));
            }
        }
        let folded = self.core.handle_bootstrap(&obs, now)?;
        match folded {
            Folded::Applied => self.node_changed(&obs.node, now),
            Folded::Discarded(DiscardReason::StaleSession) => self.keep_early(obs),
            Folded::Discarded(_) => {}
        }
        Ok(folded)
    }

    /// An agent presents `key`: accepted only for the slot's current, active
    /// attempt. Its node can become ready from here on.
    ///
    /// # Errors
    /// Why the join is refused; nothing changes.
    pub fn handle_agent_joined(
        &mut self,
        key: &ResourceKey,
        now: Timestamp,
    ) -> Result<Liveness, JoinRefused> {
        self.heard(now);
        let liveness = self.join_verdict(key)?;
        self.set_link(&key.node, Link::Connected(key.attempt));
        self.events.push_back(HostEvent::AgentJoined(key.clone()));
        self.todo.push_back(Todo::FeedJoin(key.node));
        Ok(liveness)
    }

    /// Whether the agent of `key` may join (or keep a link to this host),
    /// exactly as [`Host::handle_agent_joined`] decides it, without linking
    /// it: only the node's current, active attempt may; before adoption, an
    /// attempt the journal holds is told "not yet".
    ///
    /// # Errors
    /// The [`JoinRefused`] a join of `key` would get.
    pub fn join_verdict(&self, key: &ResourceKey) -> Result<Liveness, JoinRefused> {
        if self.stopped {
            return Err(JoinRefused::Stopped);
        }
        if key.run_id != self.meta.run_id {
            return Err(JoinRefused::OtherRun(key.run_id.clone()));
        }
        if !matches!(self.adoption, Adoption::Done)
            && (self.config.adopt_unrecorded
                || self
                    .slots
                    .get(&key.node)
                    .is_some_and(|r| r.attempt == key.attempt))
        {
            // The journal holds this very attempt (or, told to adopt what no
            // journal recorded, the listing may) and adoption has not run
            // yet: the node is not in the core yet, but it is no stranger.
            return Err(JoinRefused::NotYet(key.node));
        }
        let Some(node) = self.core.state().nodes.get(&key.node) else {
            return Err(JoinRefused::UnknownNode(key.node));
        };
        if node.attempt != key.attempt {
            return Err(JoinRefused::Superseded {
                node: key.node,
                given: key.attempt,
                current: node.attempt,
            });
        }
        if node.intent != Intent::Active
            || matches!(node.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        {
            return Err(JoinRefused::NotActive(key.node));
        }
        Ok(Liveness::for_grace(node.template.join.lost_grace_ms()))
    }

    /// The agent of `key` disconnected, having last been heard `silent_ms`
    /// ago: unless it rejoins within its group's grace (counted from when it
    /// was last heard), the attempt fails and is replaced.
    ///
    /// Silence before the end of the latest deaf gap does not count (see
    /// [`Host::last_deaf_gap`]): the grace then runs from the gap's end.
    pub fn handle_agent_gone(&mut self, key: &ResourceKey, silent_ms: u64, now: Timestamp) {
        self.heard(now);
        if self.links.get(&key.node) == Some(&Link::Connected(key.attempt)) {
            let last_heard = Timestamp::from_millis(now.as_millis().saturating_sub(silent_ms));
            let since = last_heard.max(self.listening_since());
            self.start_grace(&key.node, key.attempt, since, 0);
        }
    }

    /// What the run's rented machines have cost so far, as its providers
    /// count it now (`spent_micros`, millionths of a dollar). The larger of
    /// that and what the journal holds is the run's spend
    /// ([`Host::spent_micros`]), so a provider that lost its own records
    /// (a state file deleted, rentals adopted without their create) never
    /// makes the run look cheaper than it was. It is written to the journal
    /// once it has risen [`SPENT_RECORD_STEP_MICROS`] past what the journal
    /// holds. Returns the run's spend.
    pub fn handle_spent(&mut self, spent_micros: u64) -> u64 {
        self.spent_micros = self.spent_micros.max(spent_micros);
        if self.spent_micros
            >= self
                .meta
                .spent_micros
                .saturating_add(SPENT_RECORD_STEP_MICROS)
        {
            self.meta.spent_micros = self.spent_micros;
            self.meta_dirty = true;
        }
        self.spent_micros()
    }

    /// What the run has spent as far as this host knows: the most it was
    /// told ([`Host::handle_spent`]) or its journal holds.
    pub fn spent_micros(&self) -> u64 {
        self.spent_micros.max(self.meta.spent_micros)
    }

    /// The provider's answer to [`Output::Probe`]: whether the machine of
    /// `key`'s attempt is paused by the provider (`Ok(true)`), and so may
    /// resume. A paused machine of a group that waits keeps its node until
    /// the wait, counted from `now`, ends (or its agent's grace, if later);
    /// an agent back before then keeps the node as any rejoin does. A
    /// "paused" for an agent that is back already (or was never away) is
    /// stale and ignored: its machine runs. An error keeps the grace as it
    /// is, and says so.
    pub fn handle_probed(
        &mut self,
        key: &ResourceKey,
        paused: Result<bool, String>,
        now: Timestamp,
    ) {
        self.heard(now);
        let Some(n) = self.core.state().nodes.get(&key.node) else {
            return;
        };
        if n.attempt != key.attempt || n.intent != Intent::Active {
            return;
        }
        match paused {
            Err(e) => {
                self.events.push_back(HostEvent::Warning(format!(
                    "could not learn whether {key}'s machine was paused by its provider: {e}; \
                     it is lost at its grace's end"
                )));
            }
            Ok(false) => {
                if self
                    .preempted
                    .get(&key.node)
                    .is_some_and(|(a, _)| *a == key.attempt)
                {
                    self.preempted.remove(&key.node);
                }
            }
            Ok(true) => {
                let away = matches!(
                    self.links.get(&key.node),
                    Some(Link::Away { attempt, .. }) if *attempt == key.attempt
                );
                if !away {
                    return;
                }
                let since = match self.preempted.get(&key.node) {
                    Some((a, since)) if *a == key.attempt => *since,
                    _ => now,
                };
                self.preempted.insert(key.node, (key.attempt, since));
                let wait_until = self.preempt_until(&key.node, key.attempt);
                if let (Some(paused), Some(Link::Away { attempt, until })) =
                    (wait_until, self.links.get(&key.node).copied())
                    && attempt == key.attempt
                    && !self.held_lost.contains(&key.node)
                    && paused > until
                {
                    self.set_link(
                        &key.node,
                        Link::Away {
                            attempt,
                            until: paused,
                        },
                    );
                }
                self.events.push_back(HostEvent::Preempted {
                    key: key.clone(),
                    wait_until,
                });
            }
        }
    }

    /// The operator asks for `node`'s current attempt to be replaced: it is
    /// failed with the reason [`REPLACED_BY_OPERATOR`], exactly as if its
    /// agent had been lost, so the normal ladder cancels its bootstrap,
    /// destroys its lease and only then starts a new attempt (never two
    /// live attempts for one slot). Returns the attempt that will be
    /// replaced; the fold happens on the next [`Host::poll_output`], and the
    /// [`Reply::Replaced`] for `ticket` follows once the request is durable
    /// (the slot's record says so, and a host started from it replaces the
    /// attempt all the same), so a daemon that stops after the reply still
    /// replaces it.
    ///
    /// # Errors
    /// [`ReplaceError`]: an unknown slot, a node already failed or leaving,
    /// one with an operation in flight, or a cluster shutting down.
    pub fn handle_replace(
        &mut self,
        node: &LogicalNodeId,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<NodeAttemptId, ReplaceError> {
        self.heard(now);
        if self.stopped || self.shutdown.is_some() {
            return Err(ReplaceError::ShuttingDown);
        }
        let Some(n) = self.core.state().nodes.get(node) else {
            return Err(ReplaceError::UnknownNode(*node));
        };
        if n.intent != Intent::Active
            || matches!(n.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        {
            return Err(ReplaceError::NotActive(*node));
        }
        if let Some(p) = &n.pending {
            return Err(ReplaceError::Busy {
                node: *node,
                effect: p.effect,
            });
        }
        let attempt = n.attempt;
        self.todo.push_back(Todo::AgentLost(
            *node,
            attempt,
            FailureCause::Operator,
            REPLACED_BY_OPERATOR.to_owned(),
        ));
        // Durable before it is acknowledged: the slot's record says so, and
        // a host that starts from it replaces the attempt all the same.
        if let Some(r) = self.slots.get_mut(node).filter(|r| r.attempt == attempt) {
            r.replace = true;
            self.put.push(*node);
        }
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Replaced(attempt)));
        Ok(attempt)
    }

    /// The executor lane `lane` crashed: every operation it held folds as ambiguous.
    pub fn handle_lane_lost(&mut self, lane: u32) {
        let lost: Vec<(OperationId, LogicalNodeId)> = self
            .in_flight
            .iter()
            .filter(|(_, op)| self.lane_of(op.attempt) == lane)
            .map(|(node, op)| (*op, node))
            .collect();
        if !lost.is_empty() {
            self.warn(format!(
                "executor lane {lane} crashed holding {} operation(s); folding them as ambiguous",
                lost.len()
            ));
        }
        for (op, node) in lost {
            self.in_flight.remove(&node);
            self.todo.push_back(Todo::LaneLost(op, node));
        }
    }

    /// An orphan's collection finished (or failed, and is retried after backoff).
    pub fn handle_collected(
        &mut self,
        key: &ResourceKey,
        outcome: Result<(), String>,
        now: Timestamp,
    ) {
        self.heard(now);
        let Some(c) = self.collects.get_mut(key) else {
            return;
        };
        match outcome {
            Ok(()) => {
                self.collects.remove(key);
                self.events.push_back(HostEvent::Collected {
                    key: key.clone(),
                    error: None,
                });
            }
            Err(error) => {
                c.failures = c.failures.saturating_add(1);
                let delay = self.core.config().backoff_ms(key.attempt, c.failures);
                c.due = Some(now.saturating_add_ms(delay));
                self.events.push_back(HostEvent::Collected {
                    key: key.clone(),
                    error: Some(error),
                });
            }
        }
    }

    /// The host's timer fired: expires the core's deadlines and agents' graces.
    /// Returns how many core deadlines were folded.
    ///
    /// # Errors
    /// As [`Reconciler::handle_timeout`].
    pub fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        self.heard(now);
        self.expire_graces(now);
        let pending = &self.core.state().nodes;
        self.in_flight.retain(|node, op| {
            pending
                .get(&node)
                .and_then(|n| n.pending.as_ref())
                .is_some_and(|p| p.id == *op)
        });
        if self.core.poll_timeout().is_some_and(|at| at <= now) {
            let expired = self.core.handle_timeout(now)?;
            if expired > 0 {
                // An expiry may have failed attempts; which ones is not said.
                let nodes: Vec<LogicalNodeId> = self.slots.keys().collect();
                for node in &nodes {
                    self.record_failures(node);
                }
            }
            Ok(expired)
        } else {
            Ok(0)
        }
    }

    /// The daemon measured that, since its last report, it left ready work
    /// waiting for `starved_ms` in all before `now` (its event loop was
    /// starved by other work, or its process or machine stopped): time in
    /// which it could not have heard anybody, however loud. Such time
    /// counts against no agent:
    /// - every agent away gets it back on its grace, but never more than a
    ///   whole grace from `now`, so an agent that really died is still
    ///   lost at most one grace after the daemon listens again;
    /// - a running bootstrap's stall deadline moves on by it.
    ///
    /// A stop long enough to leave a deaf gap in the host's inputs (see
    /// [`Host::last_deaf_gap`]) may be reported here as well; the grace rule
    /// is then already met, and a stall deadline may move by it twice,
    /// which errs on the side of the node.
    pub fn handle_starved(&mut self, starved_ms: u64, now: Timestamp) {
        self.heard(now);
        if starved_ms == 0 {
            return;
        }
        self.starved_ms = self.starved_ms.saturating_add(starved_ms);
        let away: Vec<(LogicalNodeId, NodeAttemptId, Timestamp)> = self
            .links
            .iter()
            .filter_map(|(n, l)| match l {
                Link::Away { attempt, until } => Some((n, *attempt, *until)),
                Link::Connected(_) => None,
            })
            .collect();
        for (node, attempt, until) in away {
            if self.held_lost.contains(&node) {
                continue;
            }
            let cap = now.saturating_add_ms(self.grace_of(&node));
            let later = until.saturating_add_ms(starved_ms).min(cap);
            if later > until {
                self.set_link(
                    &node,
                    Link::Away {
                        attempt,
                        until: later,
                    },
                );
            }
        }
        let from = Timestamp::from_millis(now.as_millis().saturating_sub(starved_ms));
        self.core.handle_unheard(from, now);
    }

    /// Milliseconds the daemon reported starved in all
    /// ([`Host::handle_starved`]).
    pub fn starved_ms(&self) -> u64 {
        self.starved_ms
    }

    /// The periodic safety-net tick.
    pub fn handle_tick(&mut self, now: Timestamp) {
        self.heard(now);
        self.expire_graces(now);
        self.core.handle_tick(now);
    }

    // ----- outputs -----

    /// The next output. See the module docs for what each one MUST cause.
    ///
    /// Only one [`Output::Persist`] is out at a time: nothing more comes
    /// until [`Host::handle_persisted`] is told of it.
    pub fn poll_output(&mut self, now: Timestamp) -> Option<Output> {
        self.heard(now);
        loop {
            if self.awaiting.is_some() {
                return None;
            }
            if let Some(out) = self.outputs.pop_front() {
                match &out {
                    Output::Persist(delta) => self.awaiting = Some(delta.seq),
                    Output::Stop => self.stopped = true,
                    _ => {}
                }
                return Some(out);
            }
            if self.stopped {
                return None;
            }
            self.release_held(now);
            if let Some(todo) = self.todo.pop_front() {
                if let Some(fold) = self.run_todo(todo, now) {
                    return Some(Output::Folded(fold));
                }
                continue;
            }
            if self.flush_delta() {
                continue;
            }
            if !self.listing && self.sweep_at.is_some_and(|at| at <= now) {
                self.listing = true;
                self.sweep_at = None;
                return Some(Output::List);
            }
            if let Some(c) = self.due_collect(now) {
                return Some(Output::Collect(c));
            }
            self.sync_tripped();
            if self.passes_allowed() && self.core.is_pass_queued() {
                if self.reserve_attempts() {
                    continue;
                }
                match self.run_pass(now) {
                    Some(pass) => return Some(Output::Pass(pass)),
                    None => continue,
                }
            }
            self.check_progress();
            if self.outputs.is_empty() {
                return None;
            }
        }
    }

    // ----- internals -----

    fn passes_allowed(&self) -> bool {
        matches!(self.adoption, Adoption::Done) || self.shutdown.is_some()
    }

    fn warn(&mut self, message: String) {
        self.events.push_back(HostEvent::Warning(message));
    }

    fn node_changed(&mut self, node: &LogicalNodeId, now: Timestamp) {
        self.record_failures(node);
        // A destroyed attempt has no agent: its link (connected, or away
        // with a grace running) ends with it, before its slot restarts.
        if self
            .core
            .state()
            .nodes
            .get(node)
            .is_none_or(|n| n.record.stage == NodeStage::Destroyed)
        {
            self.clear_link(node);
        }
        if self.config.history_len > 0 {
            self.touch_history(node, now);
        }
        if self.config.node_events {
            self.events.push_back(HostEvent::NodeChanged(*node));
        }
    }

    /// Brings `node`'s attempt history up to date with its state.
    fn touch_history(&mut self, node: &LogicalNodeId, now: Timestamp) {
        let Some(n) = self.core.state().nodes.get(node) else {
            // A slot that left. Its history may already be let go (many
            // slots leave in one pass, and the trim runs on the first of
            // them): it is not made again, empty, to be trimmed once more.
            if let Some(last) = self.history.get_mut(node).and_then(|h| h.latest.as_mut()) {
                last.ended_at.set_once(now);
            }
            self.forget_departed();
            return;
        };
        let history = self.history.get_or_insert_with(node, Attempts::default);
        if history.latest.as_ref().map(|r| r.attempt) != Some(n.attempt) {
            if let Some(last) = &mut history.latest {
                last.ended_at.set_once(now);
            }
            history.start(n.attempt, now, self.config.history_len);
        }
        let Some(r) = &mut history.latest else {
            return;
        };
        r.stage = n.record.stage;
        r.bootstrap = n.record.bootstrap.or(r.bootstrap);
        if n.is_ready() {
            r.ready_at.set_once(now);
        }
        if r.failed_reason().is_none()
            && let Some(reason) = n.record.failed_reason()
        {
            r.notes().failed_reason = Some(reason.to_owned());
        }
        // The node's last error as it is now: one it got past (a create
        // that waited for room, then went through) is not the attempt's
        // last word.
        match n.record.last_error() {
            Some(e) if r.last_error() != Some(e) => r.notes().last_error = Some(e.to_owned()),
            None if r.last_error().is_some() => r.notes().last_error = None,
            _ => {}
        }
        if r.last_cause() != n.record.last_cause() {
            r.notes().last_cause = n.record.last_cause();
        }
        if n.record.stage == NodeStage::Destroyed {
            r.ended_at.set_once(now);
        }
    }

    /// Once twice [`DEPARTED_HISTORY_MAX`] slots that no longer have a node
    /// are remembered (or an eighth as many as have one, if that is more),
    /// forgets the ones that left first down to the limit. In bulk, so that
    /// a large scale-down does not sort once per node, and after a number
    /// of departures that grows with the cluster, since the trim walks every
    /// slot's history: a large cluster leaving one slot at a time would
    /// otherwise be walked whole every few hundred departures.
    fn forget_departed(&mut self) {
        let nodes = &self.core.state().nodes;
        let departed = self.history.len().saturating_sub(nodes.len());
        if departed <= (2 * DEPARTED_HISTORY_MAX).max(nodes.len() / 8) {
            return;
        }
        let mut gone: Vec<(Timestamp, LogicalNodeId)> = self
            .history
            .iter()
            .filter(|(id, _)| !nodes.contains_key(id))
            .map(|(id, h)| {
                let ended = h
                    .latest
                    .as_ref()
                    .and_then(|r| r.ended_at.get())
                    .unwrap_or(Timestamp(0));
                (ended, id)
            })
            .collect();
        gone.sort();
        let excess = gone.len().saturating_sub(DEPARTED_HISTORY_MAX);
        for (_, id) in gone.into_iter().take(excess) {
            self.history.remove(&id);
        }
    }

    fn stop(&mut self) {
        let waiting = std::mem::take(&mut self.waiters);
        for t in waiting
            .into_iter()
            .chain(std::mem::take(&mut self.adopt_waiters))
        {
            self.outputs.push_back(Output::Reply(t, Reply::Stopped));
        }
        self.outputs.push_back(Output::Stop);
    }

    fn digest(&mut self, template: &Arc<NodeTemplate>) -> u64 {
        if let Some((_, d)) = self.digests.iter().find(|(t, _)| Arc::ptr_eq(t, template)) {
            return *d;
        }
        let d = template.digest();
        // A handful of live templates at a time; keep the cache small.
        if self.digests.len() >= 64 {
            self.digests.remove(0);
        }
        self.digests.push((template.clone(), d));
        d
    }

    /// Moves the pending durable changes into the output stream. True if it did.
    fn flush_delta(&mut self) -> bool {
        if !self.meta_dirty && self.put.is_empty() && self.remove.is_empty() {
            return false;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let delta = JournalDelta {
            seq,
            meta: self.meta_dirty.then(|| self.meta.clone()),
            put: self.changed_records(),
            remove: std::mem::take(&mut self.remove).into_iter().collect(),
        };
        self.meta_dirty = false;
        self.outputs.push_back(Output::Persist(delta));
        true
    }

    /// The records of the slots changed since the last flush, once each, in
    /// slot order; a slot changed and then removed has none (its removal is
    /// written instead).
    fn changed_records(&mut self) -> Vec<(LogicalNodeId, SlotRecord)> {
        let mut changed = std::mem::take(&mut self.put);
        // Stable: the list comes in a few sorted runs (a pass's slots, then
        // each result batch's), which a merge sort takes as they are; an
        // unstable sort cost 30 M more instructions at 100k.
        changed.sort();
        changed.dedup();
        changed
            .into_iter()
            .filter_map(|node| Some((node, *self.slots.get(&node)?)))
            .collect()
    }

    /// A lease of `node`'s `attempt` was seen created: a later host must never make it again.
    fn record_created(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) {
        let Some(r) = self.slots.get_mut(node) else {
            return;
        };
        if r.attempt == attempt && !r.created {
            r.created = true;
            self.put.push(*node);
        }
    }

    fn schedule_sweep(&mut self, now: Timestamp) {
        let every = self.config.sweep_interval_ms;
        self.sweep_at = (every > 0).then(|| now.saturating_add_ms(every));
    }

    /// Collects what a listing shows that no slot's current attempt owns.
    fn sweep(&mut self, listed: Vec<Listed>, now: Timestamp) {
        let mut orphans = Vec::new();
        for l in listed {
            if l.key.run_id != self.meta.run_id || self.collects.contains_key(&l.key) {
                continue;
            }
            let owned = self
                .core
                .state()
                .nodes
                .get(&l.key.node)
                .is_some_and(|n| n.attempt == l.key.attempt);
            if owned || (l.lease.is_none() && l.session.is_none()) {
                continue;
            }
            orphans.push(l.key.clone());
            self.collects.insert(
                l.key.clone(),
                Collect {
                    request: CollectRequest {
                        key: l.key,
                        lease: l.lease,
                        session: l.session,
                    },
                    failures: 0,
                    due: Some(now),
                },
            );
        }
        self.verify = false;
        if !orphans.is_empty() {
            self.events.push_back(HostEvent::Swept { orphans });
        }
        self.schedule_sweep(now);
    }

    fn record_slot(&mut self, node: &LogicalNodeId) {
        let current = self
            .core
            .state()
            .nodes
            .get(node)
            .map(|n| (n.attempt, n.template.clone(), n.retry.template_failures()));
        match current {
            Some((attempt, template, failures)) => {
                if self.slots.get(node).is_some_and(|r| r.attempt == attempt) {
                    self.record_failures(node);
                    return;
                }
                let record = SlotRecord {
                    attempt,
                    template: self.digest(&template),
                    created: false,
                    failures,
                    replace: false,
                };
                self.slots.insert(*node, record);
                self.remove.remove(node);
                self.put.push(*node);
            }
            None => {
                if self.slots.remove(node).is_some() {
                    self.remove.insert(*node);
                }
            }
        }
    }

    /// The template of each desired group, in group order.
    fn desired_templates(&self) -> Vec<Arc<NodeTemplate>> {
        self.core
            .desired()
            .groups
            .iter()
            .map(|g| g.template.clone())
            .collect()
    }

    /// Keeps, among the templates desired `before` a shape change and those
    /// retired earlier, the ones some slot record still names and no group
    /// of the desired state does (see [`JournalMeta::retired`]).
    fn retire_templates(&mut self, before: &[Arc<NodeTemplate>]) {
        let named: BTreeSet<u64> = self.slots.values().map(|r| r.template).collect();
        let desired = self.desired_templates();
        let mut skip: BTreeSet<u64> = desired.iter().map(|t| self.digest(t)).collect();
        let earlier = std::mem::take(&mut self.meta.retired);
        let mut kept = Vec::new();
        for t in before.iter().map(|t| (**t).clone()).chain(earlier) {
            let d = t.digest();
            if named.contains(&d) && skip.insert(d) {
                kept.push(t);
            }
        }
        if !kept.is_empty() || !self.meta.retired.is_empty() {
            self.meta_dirty = true;
        }
        self.meta.retired = kept;
    }

    /// Brings the failure count in `node`'s slot record up to date with
    /// its current attempt (a change is journaled like any record).
    fn record_failures(&mut self, node: &LogicalNodeId) {
        let Some(n) = self.core.state().nodes.get(node) else {
            return;
        };
        let (attempt, failures) = (n.attempt, n.retry.template_failures());
        if let Some(r) = self.slots.get_mut(node)
            && r.attempt == attempt
            && r.failures != failures
        {
            r.failures = failures;
            self.put.push(*node);
        }
    }

    /// Before a pass, makes sure every attempt id it may hand out is covered
    /// by a durable reservation. True if a persist had to be queued.
    fn reserve_attempts(&mut self) -> bool {
        // A pass gives at most one new attempt to each desired slot (surge
        // slots included).
        let bound = self.core.desired().peak_node_count().saturating_add(1);
        let next = self.core.state().next_attempt;
        if next.saturating_add(bound) <= self.meta.attempts_reserved {
            return false;
        }
        self.meta.attempts_reserved = next
            .saturating_add(bound.saturating_mul(2))
            .saturating_add(64);
        self.meta_dirty = true;
        self.flush_delta()
    }

    fn run_pass(&mut self, now: Timestamp) -> Option<Pass> {
        let pass = match self.core.poll_pass(now) {
            Ok(Some(pass)) => pass,
            Ok(None) => return None,
            Err(e) => {
                self.warn(format!("a pass could not run: {e}"));
                return None;
            }
        };
        if let Err(e) = self.core.finish_pass() {
            self.warn(format!("a pass could not finish: {e}"));
        }
        for e in &pass.errors {
            self.warn(e.to_string());
        }
        for d in &pass.dispatches {
            self.in_flight.insert(d.key.node, d.op);
            if self.config.node_events {
                self.events.push_back(HostEvent::Dispatched {
                    node: d.key.node,
                    op: d.op,
                    effect: d.request.kind(),
                });
                self.events.push_back(HostEvent::NodeChanged(d.key.node));
            }
        }
        for node in &pass.transitioned {
            self.record_slot(node);
            let attempt = self.core.state().nodes.get(node).map(|n| n.attempt);
            let stale = |a: NodeAttemptId| Some(a) != attempt;
            if let Some(link) = self.links.get(node).copied() {
                let linked = match link {
                    Link::Connected(a) | Link::Away { attempt: a, .. } => a,
                };
                if stale(linked) {
                    self.clear_link(node);
                }
            }
            if self
                .early
                .get(node)
                .and_then(|v| v.first())
                .is_some_and(|o| stale(o.attempt))
            {
                self.early.remove(node);
            }
            self.node_changed(node, now);
        }
        if self.config.node_events || pass.stats.transitions + pass.stats.dispatched > 0 {
            self.events.push_back(HostEvent::Pass {
                number: pass.number,
                stats: pass.stats,
            });
        }
        Some(pass)
    }

    fn due_collect(&mut self, now: Timestamp) -> Option<CollectRequest> {
        let c = self
            .collects
            .values_mut()
            .find(|c| c.due.is_some_and(|at| at <= now))?;
        c.due = None;
        Some(c.request.clone())
    }

    /// [`Host::is_converged`], remembering the node that is not for the
    /// next check.
    fn converged_from_hint(&mut self) -> bool {
        match self.convergence() {
            Ok(()) => {
                self.converged_hint = None;
                true
            }
            Err(hint) => {
                if hint.is_some() {
                    self.converged_hint = hint;
                }
                false
            }
        }
    }

    /// Holds, convergence, waiters and the end of a teardown, once the host is quiet.
    fn check_progress(&mut self) {
        self.update_holds();
        if self.core.is_pass_queued() || !self.todo.is_empty() || !self.converged_from_hint() {
            return;
        }
        let generation = self.core.desired().generation;
        if self.converged_reported != Some(generation) {
            self.converged_reported = Some(generation);
            self.events.push_back(HostEvent::Converged {
                generation,
                nodes: self.core.state().nodes.len(),
            });
        }
        for t in std::mem::take(&mut self.waiters) {
            self.outputs
                .push_back(Output::Reply(t, Reply::Converged(generation)));
        }
        let torn_down = self.core.state().nodes.is_empty();
        if torn_down && let Some(s) = self.shutdown.take_if(|s| s.mode == ShutdownMode::Teardown) {
            self.meta.tearing_down = false;
            self.meta_dirty = true;
            self.flush_delta();
            let report = ShutdownReport {
                mode: s.mode,
                destroyed: s.nodes.into_iter().collect(),
                kept: Vec::new(),
                without_machine: Vec::new(),
            };
            for t in s.tickets {
                self.outputs
                    .push_back(Output::Reply(t, Reply::Shutdown(report.clone())));
            }
            self.stop();
        }
    }

    fn run_todo(&mut self, todo: Todo, now: Timestamp) -> Option<HostFold> {
        match todo {
            Todo::Observe(obs) => {
                let folded = self.core.handle_bootstrap(&obs, now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&obs.node, now);
                }
                Some(HostFold::Observation { obs, folded })
            }
            Todo::FeedJoin(node) => {
                let n = self.core.state().nodes.get(&node)?;
                let live = self.links.get(&node) == Some(&Link::Connected(n.attempt));
                let session = n.record.session.clone()?;
                if !live || n.record.stage != NodeStage::BootstrapRunning {
                    return None;
                }
                let obs = BootstrapObservation {
                    node,
                    attempt: n.attempt,
                    session,
                    event: BootstrapEvent::SwactorJoined,
                };
                let folded = self.core.handle_bootstrap(&obs, now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&node, now);
                }
                Some(HostFold::Observation { obs, folded })
            }
            Todo::LaneLost(op, node) => {
                let still = self
                    .core
                    .state()
                    .nodes
                    .get(&node)
                    .and_then(|n| n.pending.as_ref())
                    .is_some_and(|p| p.id == op);
                if !still {
                    return None;
                }
                let result = OperationResult {
                    node,
                    op,
                    outcome: OperationOutcome::Failed {
                        class: FailureClass::Ambiguous,
                        reason: "the executor crashed mid-operation".to_owned(),
                    },
                };
                let folded = self.core.handle_result(result.clone(), now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&node, now);
                }
                Some(HostFold::Result { result, folded })
            }
            Todo::AgentLost(node, attempt, cause, reason) => {
                let folded = self
                    .core
                    .handle_agent_lost(&node, attempt, cause, &reason, now);
                if folded == Folded::Applied {
                    self.warn(format!("{node}: {reason}; replacing it"));
                    self.node_changed(&node, now);
                }
                Some(HostFold::AgentLost {
                    node,
                    attempt,
                    reason,
                    folded,
                })
            }
        }
    }

    fn bootstrap_started(&mut self, node: &LogicalNodeId) {
        let Some(attempt) = self.core.state().nodes.get(node).map(|n| n.attempt) else {
            return;
        };
        for obs in self.early.remove(node).unwrap_or_default() {
            if obs.attempt == attempt {
                self.todo.push_back(Todo::Observe(obs));
            }
        }
        if self.links.get(node) == Some(&Link::Connected(attempt)) {
            self.todo.push_back(Todo::FeedJoin(*node));
        }
    }

    /// Keeps an observation that arrived before its StartBootstrap result.
    fn keep_early(&mut self, obs: BootstrapObservation) {
        let waiting = self.core.state().nodes.get(&obs.node).is_some_and(|n| {
            n.attempt == obs.attempt
                && n.pending
                    .as_ref()
                    .is_some_and(|p| p.effect == EffectKind::StartBootstrap)
        });
        if !waiting {
            return;
        }
        let kept = self.early.entry(obs.node).or_default();
        if kept.first().is_some_and(|o| o.attempt != obs.attempt) {
            kept.clear();
        }
        if kept.len() < EARLY_OBSERVATIONS_MAX {
            kept.push(obs);
        }
    }

    fn set_link(&mut self, node: &LogicalNodeId, link: Link) {
        self.clear_link(node);
        match link {
            Link::Away { until, .. } => {
                self.graces.insert((until, *node));
            }
            Link::Connected(_) => {
                // Back: whatever paused its machine is over.
                self.preempted.remove(node);
            }
        }
        self.links.insert(*node, link);
    }

    fn clear_link(&mut self, node: &LogicalNodeId) {
        if let Some(Link::Away { until, .. }) = self.links.remove(node) {
            self.graces.remove(&(until, *node));
            self.held_lost.remove(node);
        }
    }

    /// How long `node`'s group waits for a machine its provider paused
    /// (`None`: it does not).
    fn preempt_wait_ms(&self, node: &LogicalNodeId) -> Option<u64> {
        self.core
            .desired()
            .group(&node.group)
            .and_then(|g| g.policy.on_preempt.wait_ms())
    }

    /// The end of the wait for `node`'s paused machine, if this attempt's
    /// machine was found paused and its group waits.
    fn preempt_until(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> Option<Timestamp> {
        let (a, since) = self.preempted.get(node).copied()?;
        (a == attempt).then_some(())?;
        Some(since.saturating_add_ms(self.preempt_wait_ms(node)?))
    }

    fn start_grace(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        now: Timestamp,
        at_least_ms: u64,
    ) {
        let Some(n) = self.core.state().nodes.get(node) else {
            return;
        };
        if n.attempt != attempt || n.intent != Intent::Active {
            return;
        }
        let grace = n.template.join.lost_grace_ms().max(at_least_ms);
        let lease = n.record.lease.clone();
        let mut until = now.saturating_add_ms(grace);
        if let Some(paused) = self.preempt_until(node, attempt) {
            until = until.max(paused);
        }
        self.set_link(node, Link::Away { attempt, until });
        let key = ResourceKey {
            run_id: self.meta.run_id.clone(),
            node: *node,
            attempt,
        };
        if let Some(lease) = lease
            && self.preempt_wait_ms(node).is_some()
        {
            // Whether its machine was paused decides how long it is kept.
            self.outputs.push_back(Output::Probe {
                key: key.clone(),
                lease,
            });
        }
        self.events.push_back(HostEvent::AgentDisconnected {
            key,
            grace_until: until,
        });
    }

    /// A stream says the agent joined, but not this host: give it its grace.
    fn joined_before(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, now: Timestamp) {
        if self.links.contains_key(node) {
            return;
        }
        self.start_grace(node, attempt, now, self.config.rejoin_window_ms);
    }

    fn expire_graces(&mut self, now: Timestamp) {
        while let Some((at, node)) = self.graces.first().cloned().filter(|(at, _)| *at <= now) {
            if self.breaker(&node.group).is_some() {
                // Counted as away (it still is) while the breaker is
                // checked; kept so, with no deadline, until released.
                self.graces.remove(&(at, node));
                self.held_lost.insert(node);
                continue;
            }
            self.graces.remove(&(at, node));
            let Some(Link::Away { attempt, .. }) = self.links.remove(&node) else {
                continue;
            };
            let (cause, reason) = match self.preempted.remove(&node) {
                Some((a, _)) if a == attempt => (FailureCause::Preempted, PAUSED_PAST_WAIT),
                _ => (FailureCause::AgentLost, AWAY_PAST_GRACE),
            };
            self.todo
                .push_back(Todo::AgentLost(node, attempt, cause, reason.to_owned()));
        }
    }

    /// Tells the core which groups' breakers are tripped (it holds their
    /// failed slots' restarts); a change queues a pass.
    fn sync_tripped(&mut self) {
        let limited = self
            .core
            .desired()
            .groups
            .iter()
            .any(|g| g.policy.max_unhealthy.is_some());
        if !limited && self.tripped_none {
            return;
        }
        let tripped: BTreeSet<GroupId> = self
            .core
            .desired()
            .groups
            .iter()
            .filter(|g| g.policy.max_unhealthy.is_some() && self.breaker(&g.id).is_some())
            .map(|g| g.id)
            .collect();
        self.tripped_none = tripped.is_empty();
        self.core.set_tripped(tripped);
    }

    /// Gives the held agents of groups whose breaker is no longer tripped
    /// their grace again, counted from `now`: one that is back by then
    /// keeps its node; one that is not is lost, and replaced, as usual.
    fn release_held(&mut self, now: Timestamp) {
        if self.held_lost.is_empty() {
            return;
        }
        let mut tripped: BTreeMap<GroupId, bool> = BTreeMap::new();
        let held: Vec<LogicalNodeId> = self.held_lost.iter().cloned().collect();
        for node in held {
            let trip = match tripped.get(&node.group) {
                Some(t) => *t,
                None => {
                    let t = self.breaker(&node.group).is_some();
                    tripped.insert(node.group, t);
                    t
                }
            };
            if trip {
                continue;
            }
            self.held_lost.remove(&node);
            let Some(Link::Away { attempt, .. }) = self.links.get(&node).copied() else {
                continue;
            };
            let grace = self.grace_of(&node);
            let until = now.saturating_add_ms(grace);
            self.set_link(&node, Link::Away { attempt, until });
        }
    }

    /// Works out what each group holds back now and announces the changes.
    fn update_holds(&mut self) {
        let mut holds = BTreeMap::new();
        if self.shutdown.is_none() {
            for r in self.core.rollout_holds() {
                holds.insert((r.group, HoldKind::Rollout), r.to_string());
            }
        }
        for g in &self.core.desired().groups {
            if g.policy.max_unhealthy.is_some()
                && let Some(b) = self.breaker(&g.id)
            {
                holds.insert((g.id, HoldKind::Remediation), b.to_string());
            }
        }
        if holds == self.holds {
            return;
        }
        for (key, reason) in &holds {
            if self.holds.get(key) != Some(reason) {
                self.events.push_back(HostEvent::Hold {
                    group: key.0,
                    kind: key.1,
                    reason: Some(reason.clone()),
                });
            }
        }
        for key in self.holds.keys() {
            if !holds.contains_key(key) {
                self.events.push_back(HostEvent::Hold {
                    group: key.0,
                    kind: key.1,
                    reason: None,
                });
            }
        }
        self.holds = holds;
    }

    /// Writes a record for the latest listed attempt of each desired slot,
    /// as if the journal had held it: its desired template, created if it
    /// has a lease (see [`HostConfig::adopt_unrecorded`]).
    fn record_unrecorded(
        &mut self,
        held: &BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)>,
    ) {
        let mut latest: BTreeMap<LogicalNodeId, (NodeAttemptId, bool)> = BTreeMap::new();
        for (key, (lease, _)) in held {
            if key.run_id != self.meta.run_id || self.core.desired().slot(&key.node).is_none() {
                continue;
            }
            let e = latest
                .entry(key.node)
                .or_insert((key.attempt, lease.is_some()));
            if key.attempt > e.0 {
                *e = (key.attempt, lease.is_some());
            }
        }
        let count = latest.len();
        for (node, (attempt, created)) in latest {
            let Some(template) = self.core.desired().slot(&node).cloned() else {
                continue;
            };
            let record = SlotRecord {
                attempt,
                template: self.digest(&template),
                created,
                failures: 0,
                replace: false,
            };
            self.slots.insert(node, record);
            self.put.push(node);
        }
        if count > 0 {
            self.warn(format!(
                "took {count} resource(s) no journal recorded as the shape's nodes (--adopt)"
            ));
        }
    }

    /// Whether the adoption waits for a second listing: the first one
    /// misses an attempt the journal names that adoption would take as
    /// gone (seen created, or made from a template its slot no longer
    /// wants, so not re-created to find out), and the provider's listing
    /// may lag. Taking it as gone at once would start its slot's next
    /// attempt while it may still appear: an earlier daemon's create, sent
    /// just before it died, can land after the restart's listing.
    fn relist_first(&mut self, now: Timestamp) -> bool {
        let window = self.config.visibility_window_ms;
        if self.relisted || window == 0 {
            return false;
        }
        let Adoption::Waiting(listed) = &self.adoption else {
            return false;
        };
        let listed_keys: BTreeSet<ResourceKey> = listed.iter().map(|l| l.key.clone()).collect();
        let missing = self
            .unlisted(&listed_keys)
            .iter()
            .filter(|u| u.created || !u.wanted)
            .count();
        if missing == 0 {
            return false;
        }
        let Adoption::Waiting(first) = std::mem::replace(&mut self.adoption, Adoption::Listing)
        else {
            return false;
        };
        self.adoption = Adoption::Relisting(first);
        self.sweep_at = Some(now.saturating_add_ms(window));
        self.warn(format!(
            "the provider does not list {missing} attempt(s) the journal names; looking again \
             in {} s before deciding anything (a create cut off by the last stop may still land)",
            window as f64 / 1000.0
        ));
        true
    }

    /// The journal's attempts that `listed` does not hold, in slot order.
    fn unlisted(&mut self, listed: &BTreeSet<ResourceKey>) -> Vec<Unlisted> {
        // The digest of each slot's desired template, where it has one.
        let templates: Vec<(LogicalNodeId, Arc<NodeTemplate>)> = self
            .slots
            .keys()
            .filter_map(|node| Some((node, self.core.desired().slot(&node)?.clone())))
            .collect();
        let desired: BTreeMap<LogicalNodeId, u64> = templates
            .into_iter()
            .map(|(node, t)| (node, self.digest(&t)))
            .collect();
        let run = &self.meta.run_id;
        self.slots
            .iter()
            .filter_map(|(node, r)| {
                let key = ResourceKey {
                    run_id: run.clone(),
                    node,
                    attempt: r.attempt,
                };
                (!listed.contains(&key)).then(|| Unlisted {
                    key,
                    created: r.created,
                    wanted: desired.get(&node) == Some(&r.template),
                    failures: r.failures,
                })
            })
            .collect()
    }

    /// Adopts the journal's records and the inventory once both it and a
    /// desired state (a shape, or a teardown) are known.
    fn adopt_if_ready(&mut self, now: Timestamp) {
        let nothing_held =
            matches!(&self.adoption, Adoption::Waiting(l) if l.is_empty()) && self.slots.is_empty();
        let judged =
            self.core.desired().generation.0 > 0 || self.shutdown.is_some() || nothing_held;
        if !judged || !matches!(self.adoption, Adoption::Waiting(_)) {
            return;
        }
        if self.relist_first(now) {
            return;
        }
        let Adoption::Waiting(listed) = std::mem::replace(&mut self.adoption, Adoption::Done)
        else {
            return;
        };
        // What each key holds, as listed; journal records join in below.
        let mut held: BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)> = BTreeMap::new();
        for l in listed {
            held.insert(l.key, (l.lease, l.session));
        }
        if self.config.adopt_unrecorded && self.slots.is_empty() {
            self.record_unrecorded(&held);
        }
        let mut keys: BTreeSet<ResourceKey> = held.keys().cloned().collect();
        let mut presumed_gone = Vec::new();
        let listed_keys: BTreeSet<ResourceKey> = held.keys().cloned().collect();
        for Unlisted {
            key,
            created,
            wanted,
            failures,
        } in self.unlisted(&listed_keys)
        {
            if created {
                // It existed and is not listed: gone (or not visible yet).
                // Making it again would make a second machine of one
                // identity; a sweep finds it if it is only invisible.
                if wanted {
                    // Its slot's next attempt carries on from its failures.
                    self.core.carry_failures(key.node, failures);
                }
                presumed_gone.push(key);
            } else if wanted {
                // Maybe never made, maybe not visible yet: the re-issued
                // create makes it once or finds it by its key.
                keys.insert(key);
            } else {
                // Maybe never made, and not wanted as it would be: its slot
                // is gone or wants another template. Creating it to find
                // out would make a machine only to destroy it (and the
                // template it was made from is not kept), so it is taken
                // as never made; a sweep collects it if it was.
                presumed_gone.push(key);
            }
        }
        for key in &presumed_gone {
            self.slots.remove(&key.node);
            self.remove.insert(key.node);
        }
        // Listed twice already (a listing lag apart): nothing more to verify.
        if !presumed_gone.is_empty() && !self.relisted {
            self.verify = true;
        }
        // Templates slots may run, by digest, each shared by Arc: the older
        // ones the journal kept, and the desired ones (a slot of one group
        // may run what another group wants now).
        let mut known: Vec<(u64, Arc<NodeTemplate>)> = self
            .meta
            .retired
            .iter()
            .map(|t| (t.digest(), Arc::new(t.clone())))
            .collect();
        for t in self.desired_templates() {
            known.push((self.digest(&t), t));
        }
        let mut entries = Vec::with_capacity(keys.len());
        for key in keys {
            let desired = self.core.desired().slot(&key.node).cloned();
            let recorded = self.slots.get(&key.node).copied();
            let template = match (desired, recorded) {
                // Its replacement was asked for and acknowledged: replaced.
                (_, Some(r)) if r.attempt == key.attempt && r.replace => None,
                (Some(d), Some(r)) if r.attempt == key.attempt && r.template == self.digest(&d) => {
                    Some(d)
                }
                (Some(_), Some(r)) if r.attempt == key.attempt => known
                    .iter()
                    .find(|(digest, _)| *digest == r.template)
                    .map(|(_, t)| t.clone()),
                _ => None,
            };
            let (lease, session) = held.get(&key).cloned().unwrap_or_default();
            let failures = recorded
                .filter(|r| r.attempt == key.attempt)
                .map_or(0, |r| r.failures);
            entries.push(AdoptEntry {
                key,
                template,
                lease,
                session,
                failures,
            });
        }
        let report = self.core.adopt(entries, self.meta.epoch << 32);
        for key in &report.adopted {
            self.record_slot(&key.node);
            if held.get(key).is_some_and(|(lease, _)| lease.is_some()) {
                self.record_created(&key.node, key.attempt);
            }
            if let Some(s) = &mut self.shutdown {
                s.nodes.insert(key.node);
            }
        }
        for key in &report.orphans {
            let (lease, session) = held.get(key).cloned().unwrap_or_default();
            if lease.is_none() && session.is_none() {
                // Known only to the journal and not listed: nothing to destroy.
                continue;
            }
            self.collects.insert(
                key.clone(),
                Collect {
                    request: CollectRequest {
                        key: key.clone(),
                        lease,
                        session,
                    },
                    failures: 0,
                    due: Some(now),
                },
            );
        }
        if !report.foreign.is_empty() {
            self.warn(format!(
                "the provider listed {} resource(s) of other runs; they are left alone",
                report.foreign.len()
            ));
        }
        let first = if self.verify {
            self.config.visibility_window_ms
        } else {
            self.config.sweep_interval_ms
        };
        self.sweep_at = (self.verify || first > 0).then(|| now.saturating_add_ms(first));
        self.events.push_back(HostEvent::Adopted {
            adopted: report.adopted,
            presumed_gone,
            drifted: report.drifted,
            orphans: report.orphans,
            foreign: report.foreign,
        });
        for t in std::mem::take(&mut self.adopt_waiters) {
            self.outputs.push_back(Output::Reply(t, Reply::Adopted));
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connected(a) => write!(f, "connected ({a})"),
            Self::Away { attempt, until } => write!(f, "away ({attempt}, grace until {until})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Attempts, Liveness, When};
    use crate::id::NodeAttemptId;
    use crate::state::NodeStage;
    use crate::time::Timestamp;

    #[test]
    fn a_slot_keeps_its_last_attempts_oldest_first_with_their_texts() {
        let mut h = Attempts::default();
        assert!(h.records().is_empty());
        h.start(NodeAttemptId(0), Timestamp(0), 3);
        assert!(h.earlier.is_none(), "one attempt allocates nothing");
        for a in 1..=5 {
            h.start(NodeAttemptId(a), Timestamp(a * 10), 3);
            let r = h.latest.as_mut().expect("just started");
            r.stage = NodeStage::Failed;
            r.notes().failed_reason = Some(format!("boom {a}"));
        }
        let records = h.records();
        let attempts: Vec<u64> = records.iter().map(|r| r.attempt.0).collect();
        assert_eq!(attempts, [3, 4, 5]);
        assert_eq!(records[2].failed_reason.as_deref(), Some("boom 5"));
        assert_eq!(records[2].last_error, None);
        assert_eq!(records[0].started_at, Timestamp(30));
        // One kept: the latest only.
        let mut one = Attempts::default();
        one.start(NodeAttemptId(1), Timestamp(0), 1);
        one.start(NodeAttemptId(2), Timestamp(1), 1);
        assert_eq!(one.records().len(), 1);
        assert!(
            one.earlier.is_none(),
            "nothing earlier is kept, nor room for it"
        );
    }

    #[test]
    fn an_instant_not_yet_come_is_set_once() {
        let mut w = When::NOT_YET;
        assert_eq!(w.get(), None);
        w.set_once(Timestamp(5));
        w.set_once(Timestamp(9));
        assert_eq!(w.get(), Some(Timestamp(5)), "the first instant stays");
        let mut late = When::NOT_YET;
        late.set_once(Timestamp(u64::MAX));
        assert_eq!(late.get(), Some(Timestamp(u64::MAX - 1)), "set, one less");
    }

    #[test]
    fn silence_is_half_the_grace_within_its_bounds_and_beats_come_four_times_per_window() {
        let l = Liveness::for_grace(5_000);
        assert_eq!((l.silence_ms, l.heartbeat_ms), (2_000, 500));
        let l = Liveness::for_grace(3_000);
        assert_eq!((l.silence_ms, l.heartbeat_ms), (1_500, 375));
        let l = Liveness::for_grace(0);
        assert_eq!((l.silence_ms, l.heartbeat_ms), (1_000, 250));
        let l = Liveness::for_grace(u64::MAX);
        assert_eq!(l.silence_ms, Liveness::SILENCE_MAX_MS);
    }
}
