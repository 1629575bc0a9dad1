//! What views read without copying the cluster.
//!
//! The driver keeps a tally: each group's nodes by stage and how many of
//! them are ready, and the slots replaced so far by why, changed node by
//! node as it publishes each node's change (the same `Node`, `Removed`,
//! agent and adoption events subscribers get). A [`ClusterGlance`] reads it
//! beside the cluster's scalars (generation, convergence, pause, holds,
//! counters): its size follows the groups, never the nodes, so `/metrics`
//! and the dashboard's counts cost the same at ten nodes or a hundred
//! thousand. `status` still sends every node; that is its job.
//!
//! Asked for ([`ClusterHandle::glance`](crate::ClusterHandle::glance)), a
//! glance is exact: it is taken by the driver between two messages. The
//! driver also leaves one after each of its steps where a handle reads it
//! without a message ([`ClusterHandle::last_glance`](crate::ClusterHandle::last_glance)),
//! for a view that cannot wait while the driver works through a large
//! pass.

use crate::events::NodeSummary;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use swactor_provisioning::{
    DriverStats, FailureCause, Generation, GroupHold, GroupId, Host, Link, LogicalNodeId,
    NodeAttemptId, NodeStage, NodeTable, Reconciler, ShutdownMode, Timestamp,
};

/// Every stage, in the order [`GroupCounts::stages`] counts them.
pub const STAGES: [NodeStage; 10] = [
    NodeStage::New,
    NodeStage::LeaseRequested,
    NodeStage::LeaseCreated,
    NodeStage::EndpointKnown,
    NodeStage::BootstrapRunning,
    NodeStage::SwactorJoined,
    NodeStage::HandedOff,
    NodeStage::Dormant,
    NodeStage::Failed,
    NodeStage::Destroyed,
];

/// Where `stage` is in [`STAGES`].
const fn stage_index(stage: NodeStage) -> usize {
    match stage {
        NodeStage::New => 0,
        NodeStage::LeaseRequested => 1,
        NodeStage::LeaseCreated => 2,
        NodeStage::EndpointKnown => 3,
        NodeStage::BootstrapRunning => 4,
        NodeStage::SwactorJoined => 5,
        NodeStage::HandedOff => 6,
        NodeStage::Dormant => 7,
        NodeStage::Failed => 8,
        NodeStage::Destroyed => 9,
    }
}

/// Why a slot got a new attempt, in the order
/// [`ClusterGlance::replacements`] counts them: the cause the core recorded
/// with the previous attempt's last error, or `None` when that attempt had
/// none (its template changed).
pub const CAUSES: [Option<FailureCause>; 6] = [
    None,
    Some(FailureCause::Operator),
    Some(FailureCause::Preempted),
    Some(FailureCause::AgentLost),
    Some(FailureCause::Timeout),
    Some(FailureCause::Failure),
];

/// Where `cause` is in [`CAUSES`].
const fn cause_index(cause: Option<FailureCause>) -> usize {
    match cause {
        None => 0,
        Some(FailureCause::Operator) => 1,
        Some(FailureCause::Preempted) => 2,
        Some(FailureCause::AgentLost) => 3,
        Some(FailureCause::Timeout) => 4,
        Some(FailureCause::Failure) => 5,
    }
}

/// One group's nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounts {
    /// Nodes at each stage, in the order of [`STAGES`].
    pub stages: [u64; STAGES.len()],
    /// Nodes that are ready as every view says it ([`Link::shows_ready`]).
    pub ready: u64,
}

impl GroupCounts {
    /// All its nodes.
    pub fn nodes(&self) -> u64 {
        self.stages.iter().sum()
    }

    /// Its nodes at `stage`.
    pub fn at(&self, stage: NodeStage) -> u64 {
        self.stages[stage_index(stage)]
    }

    fn add(&mut self, e: Entry) {
        self.stages[stage_index(e.stage)] += 1;
        self.ready += u64::from(e.ready);
    }

    fn take(&mut self, e: Entry) {
        let at = &mut self.stages[stage_index(e.stage)];
        *at = at.saturating_sub(1);
        self.ready = self.ready.saturating_sub(u64::from(e.ready));
    }
}

/// What the tally remembers of one node: what it counted the node as, so
/// the node can be taken out of those counts when it changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    attempt: NodeAttemptId,
    stage: NodeStage,
    ready: bool,
    cause: Option<FailureCause>,
}

impl Entry {
    /// The node as its published summary shows it.
    pub(crate) fn of(summary: &NodeSummary) -> Self {
        Self {
            attempt: summary.attempt,
            stage: summary.stage,
            ready: summary.ready,
            cause: summary.last_cause,
        }
    }

    /// `node` as `host` holds it now (`None`: it has no node).
    pub(crate) fn in_host<C: Reconciler>(host: &Host<C>, node: &LogicalNodeId) -> Option<Self> {
        let n = host.core().state().nodes.get(node)?;
        Some(Self {
            attempt: n.attempt,
            stage: n.record.stage,
            ready: Link::shows_ready(host.link(node), n),
            cause: n.record.last_cause(),
        })
    }
}

/// The counts themselves (see [`Tally`]).
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// What each node is counted as.
    nodes: NodeTable<Entry>,
    /// Each group that has nodes.
    groups: BTreeMap<GroupId, GroupCounts>,
    /// Slots given a new attempt, at the index of their cause in [`CAUSES`].
    replacements: [u64; CAUSES.len()],
}

impl Counts {
    /// Counts `node` as `now` (`None`: it left the cluster). A later
    /// attempt than the one counted is a replacement, counted by the cause
    /// its previous attempt last showed.
    pub(crate) fn set(&mut self, node: LogicalNodeId, now: Option<Entry>) {
        let before = match now {
            Some(e) => self.nodes.insert(node, e),
            None => self.nodes.remove(&node),
        };
        if before == now {
            return;
        }
        if let Some(before) = before {
            if let Some(g) = self.groups.get_mut(&node.group) {
                g.take(before);
                if g.nodes() == 0 {
                    self.groups.remove(&node.group);
                }
            }
            if now.is_some_and(|e| e.attempt > before.attempt) {
                self.replacements[cause_index(before.cause)] += 1;
            }
        }
        if let Some(e) = now {
            self.groups.entry(node.group).or_default().add(e);
        }
    }

    /// Counts every node of `host` afresh (after an adoption, which takes
    /// a whole inventory in at once): nothing is a replacement.
    pub(crate) fn recount<C: Reconciler>(&mut self, host: &Host<C>) {
        self.nodes.clear();
        self.groups = count(host, |node, e| {
            self.nodes.insert(node, e);
        });
    }

    /// A new driver starts with no nodes; the replacements counted by the
    /// ones before it stay (and so does the last glance, until it leaves
    /// one).
    fn restart(&mut self) {
        self.nodes.clear();
        self.groups.clear();
    }
}

/// Each group's counts by a walk over every node of `host`, handing each
/// node's entry to `each`: what the tally keeps without walking, for a
/// recount and for a cluster that publishes no per-node events.
pub(crate) fn count<C: Reconciler>(
    host: &Host<C>,
    mut each: impl FnMut(LogicalNodeId, Entry),
) -> BTreeMap<GroupId, GroupCounts> {
    let mut groups: BTreeMap<GroupId, GroupCounts> = BTreeMap::new();
    for node in host.core().state().nodes.keys() {
        if let Some(e) = Entry::in_host(host, node) {
            groups.entry(node.group).or_default().add(e);
            each(*node, e);
        }
    }
    groups
}

/// The driver's counts and the last glance it left, shared by the drivers
/// a supervisor starts one after the other (so replacements are counted
/// since the supervisor started, across restarts) and with the handles
/// that started them. Only the driver touches the counts (it holds them
/// through a whole drain of events); a handle only copies the last glance
/// out, under a lock of its own that is held for as long as a copy or a
/// swap of a glance takes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    counts: Mutex<Counts>,
    published: Mutex<Option<ClusterGlance>>,
    /// The driver is handling a message.
    busy: AtomicBool,
}

/// The driver's "busy" while it lives (see [`Tally::busy`]).
pub(crate) struct Busy(Tally);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.0.busy.store(false, Ordering::Release);
    }
}

impl Tally {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Counts> {
        self.0.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn last(&self) -> MutexGuard<'_, Option<ClusterGlance>> {
        self.0
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// See [`Counts::restart`].
    pub(crate) fn restart(&self) {
        self.lock().restart();
    }

    /// Leaves `glance` as the last one (the one it replaces is dropped
    /// after the lock is let go).
    pub(crate) fn publish(&self, glance: ClusterGlance) {
        let before = self.last().replace(glance);
        drop(before);
    }

    /// The last glance the driver left, if it left one.
    pub(crate) fn published(&self) -> Option<ClusterGlance> {
        self.last().clone()
    }

    /// Marks the driver busy (handling a message) until the guard is dropped.
    pub(crate) fn busy(&self) -> Busy {
        self.0.busy.store(true, Ordering::Release);
        Busy(self.clone())
    }

    /// Whether the driver is handling a message now: a glance asked now
    /// waits at least for the end of it.
    pub(crate) fn is_busy(&self) -> bool {
        self.0.busy.load(Ordering::Acquire)
    }
}

/// One group in a [`ClusterGlance`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupGlance {
    /// The group.
    pub id: GroupId,
    /// Its slots in the desired shape; `None` for a group the shape no
    /// longer has whose nodes are still leaving.
    pub desired: Option<u32>,
    /// Its nodes now.
    pub counts: GroupCounts,
}

/// The cluster without its nodes: every figure of a
/// [`ClusterSnapshot`](crate::ClusterSnapshot) but the per-node ones, and
/// each group's counts instead. What `/metrics` and the dashboard's counts
/// read; it is as large as the shape's groups, however many nodes they
/// have (see the [module](self)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterGlance {
    /// The run.
    pub run_id: String,
    /// The desired generation.
    pub generation: Generation,
    /// Whether the cluster is converged on the desired generation.
    pub converged: bool,
    /// Whether the provider's listing was read and matched with the journal.
    pub inventory_read: bool,
    /// How many slots the desired shape has.
    pub desired_nodes: u64,
    /// Every group the shape desires or that still has nodes, by id.
    pub groups: Vec<GroupGlance>,
    /// Orphaned resources still being collected.
    pub orphans: usize,
    /// A shutdown under way, if any.
    pub shutting_down: Option<ShutdownMode>,
    /// The driver's lifetime counters.
    pub stats: DriverStats,
    /// The clock reading the glance was taken at.
    pub now: Timestamp,
    /// The run's dollar budget, from its shape.
    pub budget: Option<swactor_provisioning::budget::Budget>,
    /// What the journal holds of the run's spend (the daemon adds what its
    /// providers count now).
    pub spend: Option<swactor_provisioning::budget::Spend>,
    /// When the run tears itself down, as of the glance.
    pub lifetime: Option<swactor_provisioning::lifetime::Status>,
    /// Reconciling is paused.
    pub paused: bool,
    /// What groups hold back and why.
    pub holds: Vec<GroupHold>,
    /// Operations handed to the executor whose results have not come back.
    pub in_flight: usize,
    /// Slots given a new attempt since the cluster's supervisor started
    /// (or, unsupervised, since the cluster did), at the index of their
    /// cause in [`CAUSES`].
    pub replacements: [u64; CAUSES.len()],
}

impl ClusterGlance {
    /// The glance of a cluster of `run_id` before anything is known of
    /// it, as [`ClusterSnapshot::empty`](crate::ClusterSnapshot::empty).
    pub fn empty(run_id: impl Into<String>) -> Self {
        Self {
            run_id: run_id.into(),
            generation: Generation(0),
            converged: false,
            inventory_read: false,
            desired_nodes: 0,
            groups: Vec::new(),
            orphans: 0,
            shutting_down: None,
            stats: DriverStats::default(),
            now: Timestamp::default(),
            budget: None,
            spend: None,
            lifetime: None,
            paused: false,
            holds: Vec::new(),
            in_flight: 0,
            replacements: [0; CAUSES.len()],
        }
    }

    /// All nodes.
    pub fn nodes(&self) -> u64 {
        self.groups.iter().map(|g| g.counts.nodes()).sum()
    }

    /// Ready nodes.
    pub fn ready(&self) -> u64 {
        self.groups.iter().map(|g| g.counts.ready).sum()
    }

    /// The group `id`, if the shape desires it or it has nodes.
    pub fn group(&self, id: &GroupId) -> Option<&GroupGlance> {
        self.groups.iter().find(|g| g.id == *id)
    }
}

/// The glance of `host` now, its counts from `tally`, or from a walk over
/// every node when the cluster publishes no per-node events (`counted`
/// false: benchmarks switch them off, and the tally follows them).
pub(crate) fn glance<C: Reconciler>(
    host: &Host<C>,
    tally: &Tally,
    counted: bool,
    now: Timestamp,
) -> ClusterGlance {
    let core = host.core();
    let desired = core.desired();
    let counts = tally.lock();
    let walked;
    let by_group = if counted {
        &counts.groups
    } else {
        walked = count(host, |_, _| {});
        &walked
    };
    let mut groups: BTreeMap<GroupId, GroupGlance> = desired
        .groups
        .iter()
        .map(|g| {
            let counts = by_group.get(&g.id).copied().unwrap_or_default();
            let glance = GroupGlance {
                id: g.id,
                desired: Some(g.count),
                counts,
            };
            (g.id, glance)
        })
        .collect();
    for (id, c) in by_group {
        groups.entry(*id).or_insert_with(|| GroupGlance {
            id: *id,
            desired: None,
            counts: *c,
        });
    }
    ClusterGlance {
        run_id: core.state().run_id.to_string(),
        generation: desired.generation,
        converged: host.is_converged(),
        inventory_read: host.adopted(),
        desired_nodes: desired.node_count(),
        groups: groups.into_values().collect(),
        orphans: host.collecting().count(),
        shutting_down: host.shutting_down(),
        stats: core.stats(),
        now,
        budget: host.journal_meta().shape.as_ref().and_then(|s| s.budget),
        spend: (host.spent_micros() > 0).then(|| swactor_provisioning::budget::Spend {
            spent_micros: host.spent_micros(),
            usd_per_hour_micros: 0,
        }),
        lifetime: host.lifetime_status(now),
        paused: host.is_paused(),
        holds: host.holds(),
        in_flight: host.in_flight_count(),
        replacements: counts.replacements,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(attempt: u64, stage: NodeStage, ready: bool, cause: Option<FailureCause>) -> Entry {
        Entry {
            attempt: NodeAttemptId(attempt),
            stage,
            ready,
            cause,
        }
    }

    #[test]
    fn every_stage_and_cause_has_its_own_place() {
        for (i, s) in STAGES.iter().enumerate() {
            assert_eq!(stage_index(*s), i, "{s:?}");
        }
        for (i, c) in CAUSES.iter().enumerate() {
            assert_eq!(cause_index(*c), i, "{c:?}");
        }
    }

    #[test]
    fn a_replacement_is_counted_by_the_cause_of_its_previous_attempt_not_its_wording() {
        let mut counts = Counts::default();
        let node = LogicalNodeId::parse("w-0").unwrap();
        let failed = NodeStage::Failed;
        // Each attempt's last cause, in turn; the next attempt replaces it.
        let steps = [
            (1, Some(FailureCause::Operator)),
            (2, Some(FailureCause::AgentLost)),
            (3, Some(FailureCause::Timeout)),
            (4, None),
            (5, Some(FailureCause::Failure)),
            (6, Some(FailureCause::Preempted)),
            (7, None),
        ];
        for (attempt, cause) in steps {
            counts.set(node, Some(entry(attempt, failed, false, cause)));
        }
        // One of each: attempt 4 had no error, so 5 came from a new template.
        assert_eq!(counts.replacements, [1; 6]);
        // The same attempt seen again is not a replacement, nor is a slot
        // that left and came back.
        counts.set(node, Some(entry(7, NodeStage::Dormant, true, None)));
        counts.set(node, None);
        counts.set(node, Some(entry(8, NodeStage::New, false, None)));
        assert_eq!(counts.replacements, [1; 6]);
    }

    #[test]
    fn the_driver_is_busy_while_its_guard_lives_and_the_last_glance_is_kept() {
        let tally = Tally::default();
        assert!(!tally.is_busy() && tally.published().is_none());
        let busy = tally.busy();
        assert!(tally.clone().is_busy(), "seen through every clone");
        tally.publish(ClusterGlance::empty("r"));
        drop(busy);
        assert!(!tally.is_busy());
        // A new driver starts from no nodes and keeps the last glance.
        tally.lock().set(
            LogicalNodeId::parse("w-0").unwrap(),
            Some(entry(1, NodeStage::New, false, None)),
        );
        tally.restart();
        assert!(tally.lock().groups.is_empty());
        assert_eq!(tally.published().map(|g| g.run_id), Some("r".to_owned()));
    }

    #[test]
    fn a_group_is_counted_while_it_has_nodes() {
        let mut counts = Counts::default();
        let a = LogicalNodeId::parse("w-0").unwrap();
        let b = LogicalNodeId::parse("w-1").unwrap();
        counts.set(a, Some(entry(1, NodeStage::New, false, None)));
        counts.set(b, Some(entry(2, NodeStage::Dormant, true, None)));
        counts.set(a, Some(entry(1, NodeStage::Dormant, true, None)));
        let w = counts.groups[&a.group];
        assert_eq!((w.nodes(), w.ready, w.at(NodeStage::Dormant)), (2, 2, 2));
        counts.set(a, None);
        counts.set(b, Some(entry(2, NodeStage::Dormant, false, None)));
        let w = counts.groups[&a.group];
        assert_eq!((w.nodes(), w.ready), (1, 0));
        counts.set(b, None);
        assert!(counts.groups.is_empty(), "{:?}", counts.groups);
    }
}
