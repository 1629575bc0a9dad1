//! The host's durable records as types: the journal's scalars, one record
//! per slot, an image of both, and the deltas that change them.

use super::*;

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
    /// What the run's lifetimes count from ([`Host::handle_lifetime`]):
    /// wall-clock instants, so a restarted daemon keeps the deadlines.
    /// Absent (nothing known) in journals written before lifetimes existed.
    #[serde(default, skip_serializing_if = "is_unanchored")]
    pub lifetime: crate::lifetime::Anchors,
}

fn is_unanchored(a: &crate::lifetime::Anchors) -> bool {
    *a == crate::lifetime::Anchors::default()
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

// Size budget, checked when the crate is built: a slot's record (and its
// `None`) is three words.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Option<SlotRecord>>() == 24);

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
                lifetime: Default::default(),
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
