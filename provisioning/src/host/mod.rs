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
//!
//! # Layout
//! This file holds the host's state, its construction and what can be asked
//! of it; each concern of the `impl` lives in a file of its own: `inputs`
//! (every `handle_*`), `output` (`poll_output` and the passes), `records`
//! (journal deltas), `adoption` (inventories, sweeps, orphans), `graces`
//! (away and preempted nodes, group holds) and `lifetimes` (the run's
//! `max_lifetime_s` and `idle_teardown_s`). `io` and `journal` hold the
//! types of the interface and of the durable records.
//!
//! Over 1,000 lines in one file with its tests: the code is under 1,000
//! lines; the rest are unit tests of the attempt history kept next to it.

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

mod adoption;
mod graces;
mod inputs;
mod io;
mod journal;
mod lifetimes;
mod output;
mod records;

use crate::capacity::OverCapacity;
pub use crate::capacity::{Capacity, CapacityBasis};
pub use io::*;
pub use journal::*;

/// The journal format this host writes and reads.
pub const JOURNAL_FORMAT: u32 = 1;

/// Early observations kept per node while its StartBootstrap result is outstanding.
pub const EARLY_OBSERVATIONS_MAX: usize = 64;

/// Settings of a [`Host`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The agent's lease: how long it keeps its node once the daemon stops
    /// renewing it (0: for ever). Counted by the agent on its own clock
    /// from the last renewal it received.
    #[serde(default)]
    pub lease_ms: u64,
    /// How often the daemon renews the lease: at the first heartbeat heard
    /// this long after the last renewal (0: never, for a lease of 0).
    #[serde(default)]
    pub renew_every_ms: u64,
    /// Whether the lease waits for a job the node runs: it then counts from
    /// the later of the last renewal and the end of the last job.
    #[serde(default)]
    pub lease_waits_for_jobs: bool,
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
            lease_ms: 0,
            renew_every_ms: 0,
            lease_waits_for_jobs: false,
        }
    }

    /// Renewals per lease: a few lost or late ones never let a lease lapse
    /// while the daemon runs.
    pub const RENEWALS_PER_LEASE: u64 = 5;
    /// The most time between renewals, however long the lease: a restarted
    /// daemon's first renewal is never far off.
    pub const RENEW_EVERY_MAX_MS: u64 = 60_000;

    /// This liveness with a lease of `orphan_after_s` (0: none). Renewals
    /// ride on heartbeats, so they are never more frequent than those.
    pub fn with_lease(self, orphan_after_s: u32, policy: crate::OrphanPolicy) -> Self {
        let lease_ms = u64::from(orphan_after_s) * 1_000;
        let renew_every_ms = if lease_ms == 0 {
            0
        } else {
            (lease_ms / Self::RENEWALS_PER_LEASE)
                .min(Self::RENEW_EVERY_MAX_MS)
                .max(self.heartbeat_ms)
        };
        debug_assert_eq!(lease_ms == 0, renew_every_ms == 0, "a lease is renewed");
        Self {
            lease_ms,
            renew_every_ms,
            lease_waits_for_jobs: policy == crate::OrphanPolicy::Idle,
            ..self
        }
    }
}

/// Slots without a node whose attempt history is still kept for people.
pub const DEPARTED_HISTORY_MAX: usize = 256;

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
    /// What its provider gave up rather than released, and where: it may
    /// still hold a machine until the provider cleans it up.
    #[serde(default)]
    pub left_behind: Option<String>,
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
    left_behind: Option<String>,
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
            left_behind: notes.and_then(|n| n.left_behind.clone()),
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
    /// Releases a provider gave up ([`HostEvent::GivenUp`]) in this host's life.
    given_up_total: u64,
    /// The most the run was said to have spent ([`Host::handle_spent`]);
    /// the journal holds it once it is a cent past what it holds.
    spent_micros: u64,
    /// The last wall-clock reading handed in, in ms since the Unix epoch,
    /// and the instant it was read at ([`Host::handle_wall_clock`]).
    wall: Option<(Timestamp, u64)>,
    /// A job was running at the last lifetime check ([`Host::handle_lifetime`]).
    jobs_running: bool,
    /// How long this host may act ([`Host::handle_leadership`]).
    leadership: Leadership,
    /// The leadership was found lapsed and no later bound has come: that
    /// was said ([`HostEvent::Warning`]), and no deadline but the
    /// listening watch is reported (nothing due can be served meanwhile).
    lapsed: bool,
}

/// How long a host may act on the world: write its journal, dispatch,
/// list, collect or probe. A daemon alone on its journal always may; one of
/// several replicas sharing a journal may only while it holds the
/// leadership, which the replica layer renews and tells the host
/// ([`Host::handle_leadership`]). The instant is on the host's own clock,
/// and the replica layer sets it short of when another replica could lead,
/// so a host that stops acting at it never acts beside a new leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Leadership {
    /// Alone on its journal: always.
    Always,
    /// Held until this instant (exclusive); from then on the host dispatches
    /// nothing and writes nothing until told of a later one.
    Until(Timestamp),
}

impl Leadership {
    /// Whether a host may act at `now`.
    pub fn holds_at(self, now: Timestamp) -> bool {
        match self {
            Self::Always => true,
            Self::Until(until) => now < until,
        }
    }
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
            wall: None,
            jobs_running: false,
            leadership: Leadership::Always,
            lapsed: false,
            holds: BTreeMap::new(),
            tripped_none: true,
            last_input: None,
            deaf: None,
            starved_ms: 0,
            given_up_total: 0,
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
            .map_err(ApplyError::from)
    }

    /// The earliest instant the host needs waking: the core's deadline, a
    /// grace end, an orphan's retry, and, while it holds any node or agent,
    /// a watch [`ReconcilerConfig::listen_watch_ms`] after its last input
    /// (so that a gap longer than [`ReconcilerConfig::listen_gap_ms`] means
    /// the daemon was not listening; see [`Host::last_deaf_gap`]). While its
    /// leadership is lapsed ([`Host::handle_leadership`]), only that watch.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.stopped {
            return None;
        }
        if self.lapsed {
            // Not leading: a due deadline would only wake the daemon in a
            // loop; what is due is served once a later bound comes.
            return self.watch_at();
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

    #[test]
    fn a_lease_is_renewed_five_times_per_lease_at_most_a_minute_apart_never_faster_than_beats() {
        let beats = Liveness::for_grace(5_000);
        let l = beats.with_lease(3_600, crate::OrphanPolicy::Always);
        assert_eq!((l.lease_ms, l.renew_every_ms), (3_600_000, 60_000));
        let l = beats.with_lease(5, crate::OrphanPolicy::Always);
        assert_eq!((l.lease_ms, l.renew_every_ms), (5_000, 1_000));
        // A lease shorter than a few beats is renewed at every beat.
        let l = beats.with_lease(1, crate::OrphanPolicy::Always);
        assert_eq!((l.lease_ms, l.renew_every_ms), (1_000, 500));
        let l = beats.with_lease(0, crate::OrphanPolicy::Always);
        assert_eq!(
            (l.lease_ms, l.renew_every_ms),
            (0, 0),
            "no lease, no renewal"
        );
        assert_eq!(
            (l.heartbeat_ms, l.silence_ms),
            (beats.heartbeat_ms, beats.silence_ms),
            "a lease changes nothing of the heartbeats"
        );
        assert!(!l.lease_waits_for_jobs);
        assert!(
            beats
                .with_lease(5, crate::OrphanPolicy::Idle)
                .lease_waits_for_jobs
        );
    }
}
