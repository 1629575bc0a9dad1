//! The decider: a pure function from (observed, desired, now) to the next action per node.
//!
//! Nothing here reads a clock, performs I/O or mutates state. Every deadline it
//! compares against was computed and stored when an observation was folded.
//!
//! About 1,000 lines in one file on purpose: the ladder's numbered rows read
//! top to bottom in order, as the spec lists them.

use crate::id::{GroupId, LogicalNodeId, NodeAttemptId};
use crate::rollout::Breaker;
use crate::shape::{DesiredGroup, DesiredState, NodeTemplate, same_template};
use crate::state::{BootstrapStage, ClusterState, EffectKind, Intent, ManagedNode, NodeStage};
use crate::time::{Timestamp, earliest};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

/// The rows of the per-node decision ladder, in priority order (first match wins).
///
/// [`LadderRow::InsertSlot`] is not a row of the ladder proper: a desired slot
/// with no node yet is seen before row 1 and simply inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum LadderRow {
    /// Scale up: a desired slot has no node.
    InsertSlot = 0,
    /// 1. Destroyed and undesired: reap.
    ReapDestroyed = 1,
    /// 2. Destroyed, still desired, restart due: restart with a fresh attempt and the latest spec.
    RestartDestroyed = 2,
    /// 3. Destroyed, restart backoff not due: wait for `restart_at`.
    AwaitRestartBackoff = 3,
    /// 4. Active and undesired, drifted or failed: begin deleting.
    BeginDelete = 4,
    /// 5. An operation is pending: wait for its result or its deadline.
    AwaitPendingOperation = 5,
    /// 6. Deleting with an ambiguous create remembered: re-issue the create so the executor adopts.
    AdoptAmbiguousCreate = 6,
    /// 7. Deleting with a live bootstrap session: cancel it.
    CancelBootstrap = 7,
    /// 8. Deleting with a live lease: destroy it.
    DestroyLease = 8,
    /// 9. Deleting with nothing left to clean: mark destroyed.
    MarkDestroyed = 9,
    /// 10. Retry backoff (or probe interval) not due: wait.
    AwaitRetryBackoff = 10,
    /// 11. Ready: steady state, nothing to do.
    SteadyReady = 11,
    /// 12. No lease: create one.
    CreateLease = 12,
    /// 13. A lease but no endpoint: look it up.
    LookupEndpoint = 13,
    /// 14. Joined and converged: record convergence.
    ObserveConvergence = 14,
    /// 15. Bootstrap running: await stream observations (until the stall deadline).
    AwaitBootstrap = 15,
    /// 16. Lease and endpoint but no session: start bootstrap.
    StartBootstrap = 16,
    /// 17. Ready and drifted, but the group's rollout must wait: wait.
    ///
    /// A refinement of row 4, tried right after it: the group's
    /// `max_unavailable` is spent or its rollout stopped (see [`RolloutGates`]).
    AwaitRolloutBudget = 17,
    /// 18. Destroyed after a failure, restart due, but the group's breaker is tripped: wait.
    ///
    /// A refinement of row 2, tried right after it: while more of the
    /// group is unhealthy than its `max_unhealthy` allows, a failed slot
    /// gets no new attempt of the same template (a new template still
    /// restarts it).
    AwaitBreaker = 18,
}

impl LadderRow {
    /// All rows, in priority order (InsertSlot first). Rows 17 and 18
    /// refine rows 4 and 2, so each comes right after the row it refines.
    pub const ALL: [LadderRow; 19] = [
        Self::InsertSlot,
        Self::ReapDestroyed,
        Self::RestartDestroyed,
        Self::AwaitBreaker,
        Self::AwaitRestartBackoff,
        Self::BeginDelete,
        Self::AwaitRolloutBudget,
        Self::AwaitPendingOperation,
        Self::AdoptAmbiguousCreate,
        Self::CancelBootstrap,
        Self::DestroyLease,
        Self::MarkDestroyed,
        Self::AwaitRetryBackoff,
        Self::SteadyReady,
        Self::CreateLease,
        Self::LookupEndpoint,
        Self::ObserveConvergence,
        Self::AwaitBootstrap,
        Self::StartBootstrap,
    ];

    /// The row's number in the specification's table (0 for InsertSlot).
    pub fn number(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for LadderRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "row {} ({:?})", self.number(), self)
    }
}

/// Why an active attempt is being deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeleteReason {
    /// The slot is no longer desired (scale-down or group removed).
    Undesired,
    /// The desired template differs from the one the attempt was created from.
    SpecDrift,
    /// The attempt failed.
    Failed,
}

/// What the driver should do for one node in this pass.
#[must_use]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum NodeAction {
    /// Create the slot with a fresh attempt of `template`.
    Insert {
        /// The template of the new attempt.
        template: Arc<NodeTemplate>,
    },
    /// Switch the attempt's intent to Deleting.
    BeginDelete {
        /// Why.
        reason: DeleteReason,
    },
    /// Record that cleanup finished.
    MarkDestroyed,
    /// Start a fresh attempt of `template` in a destroyed, still desired slot.
    Restart {
        /// The template of the new attempt (the latest desired spec).
        template: Arc<NodeTemplate>,
    },
    /// Remove a destroyed, undesired slot.
    Reap,
    /// Record convergence: the node becomes ready.
    ObserveConvergence,
    /// Dispatch a provider effect (recorded pending first).
    Dispatch(EffectKind),
}

impl NodeAction {
    /// True for driver transitions (state changes with no I/O).
    pub fn is_transition(&self) -> bool {
        !matches!(self, Self::Dispatch(_))
    }
}

/// The decision for one node: the row that matched, an action if any, and the
/// instant the node next needs looking at if it is waiting.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeDecision {
    /// The ladder row that matched.
    pub row: LadderRow,
    /// What to do now, if anything.
    pub action: Option<NodeAction>,
    /// When a waiting node's deadline falls, if it waits on one.
    pub wake_at: Option<Timestamp>,
}

impl NodeDecision {
    fn act(row: LadderRow, action: NodeAction) -> Self {
        Self {
            row,
            action: Some(action),
            wake_at: None,
        }
    }

    fn wait(row: LadderRow, wake_at: Option<Timestamp>) -> Self {
        Self {
            row,
            action: None,
            wake_at,
        }
    }
}

/// One planned action.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannedAction {
    /// The slot.
    pub node: LogicalNodeId,
    /// The row that decided it.
    pub row: LadderRow,
    /// What to do.
    pub action: NodeAction,
}

/// The output of one decider pass.
#[must_use]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// At most one action per node, in slot order.
    pub actions: Vec<PlannedAction>,
    /// The earliest deadline among nodes that wait on one.
    pub requeue_at: Option<Timestamp>,
}

/// Decides the next step for one existing node.
///
/// `desired` is the template its slot must run, or `None` when the slot is not
/// desired. The rows are tried in the specification's priority order.
///
/// One refinement of the table: the retry-backoff gate of row 10 also holds
/// back the cleanup *effects* of rows 6–8, because the failure table requires
/// failed cancels and destroys to retry after backoff and the row order alone
/// would retry them at once. [`NodeAction::BeginDelete`] clears the gate, so a
/// fresh cleanup always starts immediately.
pub fn reconcile_node(
    node: &ManagedNode,
    desired: Option<&Arc<NodeTemplate>>,
    now: Timestamp,
) -> NodeDecision {
    use LadderRow as R;
    let rec = &node.record;

    if rec.stage == NodeStage::Destroyed {
        // Rows 1-3.
        return reconcile_destroyed(node, desired, now);
    }

    // Row 4.
    if node.intent == Intent::Active {
        let reason = match desired {
            None => Some(DeleteReason::Undesired),
            Some(t) if !same_template(t, &node.template) => Some(DeleteReason::SpecDrift),
            Some(_) if rec.stage == NodeStage::Failed => Some(DeleteReason::Failed),
            Some(_) => None,
        };
        if let Some(reason) = reason {
            return NodeDecision::act(R::BeginDelete, NodeAction::BeginDelete { reason });
        }
    }

    // Row 5.
    if let Some(p) = &node.pending {
        return NodeDecision::wait(R::AwaitPendingOperation, Some(p.deadline));
    }

    let backoff = node.retry.next_effect_at.filter(|at| *at > now);

    if node.intent == Intent::Deleting {
        // Rows 6-9.
        return reconcile_deleting(node, backoff);
    }

    // Rows 10-16.
    reconcile_active(node, backoff)
}

/// Rows 1-3 of [`reconcile_node`], for a node whose stage is Destroyed.
fn reconcile_destroyed(
    node: &ManagedNode,
    desired: Option<&Arc<NodeTemplate>>,
    now: Timestamp,
) -> NodeDecision {
    use LadderRow as R;
    let rec = &node.record;

    // Row 1.
    let Some(template) = desired else {
        return NodeDecision::act(R::ReapDestroyed, NodeAction::Reap);
    };
    // Row 2 / row 3. The backoff was earned by the node's own template:
    // once the slot wants another one (say, the broken one was fixed),
    // the restart is due at once.
    match rec.restart_at {
        Some(at) if at > now && same_template(template, &node.template) => {
            NodeDecision::wait(R::AwaitRestartBackoff, Some(at))
        }
        _ => NodeDecision::act(
            R::RestartDestroyed,
            NodeAction::Restart {
                template: template.clone(),
            },
        ),
    }
}

/// Rows 6-9 of [`reconcile_node`], for a Deleting node with no pending operation.
fn reconcile_deleting(node: &ManagedNode, backoff: Option<Timestamp>) -> NodeDecision {
    use LadderRow as R;
    let rec = &node.record;

    // Rows 6-8 dispatch effects; each waits out a running backoff first.
    let effect = if let Some(create) = rec.ambiguous {
        Some((R::AdoptAmbiguousCreate, create.effect()))
    } else if rec.session.is_some() {
        Some((R::CancelBootstrap, EffectKind::CancelBootstrap))
    } else if rec.lease.is_some() {
        Some((R::DestroyLease, EffectKind::DestroyLease))
    } else {
        None
    };
    match (effect, backoff) {
        (Some(_), Some(at)) => NodeDecision::wait(R::AwaitRetryBackoff, Some(at)),
        (Some((row, kind)), None) => NodeDecision::act(row, NodeAction::Dispatch(kind)),
        // Row 9.
        (None, _) => NodeDecision::act(R::MarkDestroyed, NodeAction::MarkDestroyed),
    }
}

/// Rows 10-16 of [`reconcile_node`], for an Active node that keeps its slot.
fn reconcile_active(node: &ManagedNode, backoff: Option<Timestamp>) -> NodeDecision {
    use LadderRow as R;
    let rec = &node.record;

    // Row 10.
    if let Some(at) = backoff {
        return NodeDecision::wait(R::AwaitRetryBackoff, Some(at));
    }

    // Row 11.
    if node.is_ready() {
        return NodeDecision::wait(R::SteadyReady, None);
    }

    // Row 12.
    if rec.lease.is_none() {
        return NodeDecision::act(
            R::CreateLease,
            NodeAction::Dispatch(EffectKind::CreateLease),
        );
    }

    // Row 13.
    if rec.endpoint.is_none() {
        return NodeDecision::act(
            R::LookupEndpoint,
            NodeAction::Dispatch(EffectKind::LookupEndpoint),
        );
    }

    // Row 14. A stream that closed cleanly after convergence still counts.
    if rec.stage == NodeStage::SwactorJoined && rec.bootstrap == Some(BootstrapStage::Converged) {
        return NodeDecision::act(R::ObserveConvergence, NodeAction::ObserveConvergence);
    }

    // Row 15.
    if rec.session.is_some() {
        return NodeDecision::wait(R::AwaitBootstrap, rec.bootstrap_deadline);
    }

    // Row 16.
    NodeDecision::act(
        R::StartBootstrap,
        NodeAction::Dispatch(EffectKind::StartBootstrap),
    )
}

/// Whether a paused cluster may still take `action` on `node` (`None` for a
/// slot that has no node yet).
///
/// A paused cluster makes nothing new and changes nothing that lives: no
/// slot is inserted (scale-up) or restarted (replacement), no live attempt
/// begins deleting for a scale-down or a template change, and no effect
/// advances a live attempt (CreateLease, LookupEndpoint, StartBootstrap of
/// an Active node). What finishes work already under way still runs, so
/// that nothing leaks and state stays true:
///
/// - the cleanup of a Deleting attempt, all of it (rows 6 to 9): the
///   re-issued create of row 6 only adopts what an ambiguous create may
///   have made, so that it can be destroyed;
/// - the beginning of the cleanup of a *failed* attempt (row 4 for a node
///   whose stage is Failed, whatever else holds), which is never replaced
///   while paused;
/// - reaping a destroyed slot that is not desired (row 1): bookkeeping of
///   a cleanup that finished;
/// - recording the convergence a stream already reported (row 14).
pub fn allowed_while_paused(node: Option<&ManagedNode>, action: &NodeAction) -> bool {
    match action {
        NodeAction::Insert { .. } | NodeAction::Restart { .. } => false,
        NodeAction::Reap | NodeAction::MarkDestroyed | NodeAction::ObserveConvergence => true,
        NodeAction::BeginDelete { .. } => node.is_some_and(|n| n.record.stage == NodeStage::Failed),
        // Cleanups run; so does an adopted attempt's re-attachment to the
        // endpoint and session it already has (the provider adopts them
        // under the attempt's key), so that a daemon restarted while paused
        // sees its running nodes ready again instead of "creating".
        NodeAction::Dispatch(kind) => node.is_some_and(|n| {
            n.intent == Intent::Deleting
                || (n.record.resuming
                    && matches!(
                        kind,
                        EffectKind::LookupEndpoint | EffectKind::StartBootstrap
                    ))
        }),
    }
}

/// [`reconcile_node`] for a paused cluster: the same ladder, with every
/// action [`allowed_while_paused`] refuses held back.
///
/// A held action leaves the node waiting on no deadline of its own (resuming
/// re-decides every node), except that a live attempt whose deletion is held
/// (its slot is undesired or wants another template) goes on down the
/// ladder as if its slot wanted it as it is: it still waits on its pending
/// operation, its backoff and its stall deadline, and its cleanup still
/// begins if it fails.
pub fn reconcile_node_paused(
    node: &ManagedNode,
    desired: Option<&Arc<NodeTemplate>>,
    now: Timestamp,
) -> NodeDecision {
    let mut d = reconcile_node(node, desired, now);
    if d.row == LadderRow::BeginDelete
        && d.action
            .as_ref()
            .is_some_and(|a| !allowed_while_paused(Some(node), a))
    {
        d = reconcile_node(node, Some(&node.template), now);
    }
    match &d.action {
        Some(a) if !allowed_while_paused(Some(node), a) => NodeDecision::wait(d.row, None),
        _ => d,
    }
}

/// The rollout budgets of one pass: which ready nodes of an outdated
/// template may begin deleting (row 4) and which wait (row 17).
///
/// A group's budget is what keeps at least `count - max_unavailable` of its
/// nodes ready: its ready nodes (in its desired slots, surge slots
/// included, whatever their template) plus its resolved `max_unavailable`,
/// minus its `count`. Without a surge that is `max_unavailable` minus the
/// desired slots that are not ready now (missing, starting, failed,
/// deleting: as Cluster API counts them); a ready surge node adds one.
/// Ready nodes of another template than their
/// slot's are admitted in slot order while budget is left, each one taking a
/// unit. None is admitted while the group's rollout is *stopped*: a desired
/// slot holds a node of the new template that is not ready and has failed
/// with that template since its slot was last ready
/// ([`RetryState::template_failures`](crate::RetryState::template_failures):
/// the count carries into the slot's next attempts, so the stop holds
/// through the retries, until that slot becomes ready or another template
/// is applied).
///
/// Nodes MUST be offered in slot order within a pass, and every ready,
/// outdated node of a group must be offered in the same pass (the driver
/// keeps the ones row 17 held as candidates of every pass for that).
///
/// It also holds the restarts of row 18: the groups whose remediation
/// breaker is tripped are given with [`RolloutGates::with_tripped`].
pub struct RolloutGates<'a> {
    state: &'a ClusterState,
    desired: &'a DesiredState,
    current: Option<(GroupId, GroupBudget)>,
    tripped: Option<&'a BTreeSet<GroupId>>,
}

/// One group's rollout budget, as a pass spends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GroupBudget {
    left: u32,
    stopped: bool,
}

impl<'a> RolloutGates<'a> {
    /// The budgets of a pass over `state` toward `desired`.
    pub fn new(state: &'a ClusterState, desired: &'a DesiredState) -> Self {
        Self {
            state,
            desired,
            current: None,
            tripped: None,
        }
    }

    /// The same gates, with the groups whose breaker is tripped.
    pub fn with_tripped(mut self, tripped: &'a BTreeSet<GroupId>) -> Self {
        self.tripped = Some(tripped);
        self
    }

    /// Whether `group`'s remediation breaker is tripped.
    pub fn is_tripped(&self, group: &GroupId) -> bool {
        self.tripped.is_some_and(|t| t.contains(group))
    }

    /// Whether the ready, outdated node of `id` may begin deleting now;
    /// spends a unit of its group's budget if so.
    pub fn admit(&mut self, id: &LogicalNodeId) -> bool {
        if self.current.as_ref().is_none_or(|(g, _)| *g != id.group) {
            let Some(g) = self.desired.group(&id.group) else {
                return true;
            };
            let status = group_status(self.state, g);
            let budget = GroupBudget {
                left: status.budget_left(),
                stopped: status.stopped.is_some(),
            };
            self.current = Some((id.group, budget));
        }
        let Some((_, b)) = self.current.as_mut() else {
            return true;
        };
        if b.stopped || b.left == 0 {
            return false;
        }
        b.left -= 1;
        true
    }
}

/// Where one group's rollout stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStatus {
    /// The group.
    pub group: GroupId,
    /// Its desired slots (its `count`, without surge slots).
    pub nodes: u32,
    /// Its ready nodes, surge slots included.
    pub ready: u32,
    /// Surge slots it has now (see [`surge`]).
    pub surge: u32,
    /// How far ready nodes are below `nodes` (0 when a surge makes up for it).
    pub unavailable: u32,
    /// The resolved `max_unavailable`.
    pub max_unavailable: u32,
    /// Ready nodes whose template is not their slot's: still to be replaced.
    pub outdated_ready: u32,
    /// The slot that stopped the rollout, if one did.
    pub stopped: Option<RolloutStop>,
}

/// What stopped a rollout: a node of the new template that keeps failing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStop {
    /// The slot.
    pub node: LogicalNodeId,
    /// Its failures with the new template since it was last ready.
    pub failures: u32,
    /// Why its current attempt failed, or its last error (`None` for a
    /// restarted attempt that has not failed yet).
    pub reason: Option<String>,
}

impl RolloutStatus {
    /// How many more ready nodes may be taken down now: as many as keep
    /// `nodes - max_unavailable` of them ready.
    pub fn budget_left(&self) -> u32 {
        (self.ready + self.max_unavailable).saturating_sub(self.nodes)
    }

    /// True when ready, outdated nodes wait: the budget is spent or the rollout stopped.
    pub fn is_holding(&self) -> bool {
        self.outdated_ready > 0 && (self.stopped.is_some() || self.budget_left() == 0)
    }
}

impl fmt::Display for RolloutStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let waiting = self.outdated_ready;
        match &self.stopped {
            Some(stop) => {
                write!(f, "rollout stopped: node {} ", stop.node)?;
                match &stop.reason {
                    Some(reason) => write!(f, "failed with the new template: {reason}")?,
                    None => write!(
                        f,
                        "has failed {} time(s) with the new template and is retrying",
                        stop.failures
                    )?,
                }
                write!(
                    f,
                    "; {waiting} node(s) of the old template are kept until that node is ready or a fixed template is applied"
                )
            }
            None => {
                write!(
                    f,
                    "rolling out: {waiting} node(s) of the old template wait; {} of max {} unavailable",
                    self.unavailable, self.max_unavailable
                )?;
                if self.surge > 0 {
                    write!(
                        f,
                        "; {} of {} ready with {} surge node(s)",
                        self.ready,
                        self.nodes + self.surge,
                        self.surge
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// Where the rollout of group `g` stands in `state`.
pub fn group_status(state: &ClusterState, g: &DesiredGroup) -> RolloutStatus {
    let surge = surge(state, g);
    let mut ready = 0u32;
    let mut outdated_ready = 0u32;
    let mut stopped = None;
    for (id, n) in state.nodes.group(&g.id) {
        if id.index >= g.count + surge {
            break;
        }
        let current = same_template(&n.template, &g.template);
        if n.is_ready() {
            ready += 1;
            outdated_ready += u32::from(!current);
        } else if current && n.retry.template_failures() > 0 && stopped.is_none() {
            stopped = Some(RolloutStop {
                node: *id,
                failures: n.retry.template_failures(),
                reason: n
                    .record
                    .failed_reason()
                    .or_else(|| n.record.last_error())
                    .map(str::to_owned),
            });
        }
    }
    RolloutStatus {
        group: g.id,
        nodes: g.count,
        ready,
        surge,
        unavailable: g.count.saturating_sub(ready),
        max_unavailable: g.policy.max_unavailable_of(g.count),
        outdated_ready,
        // A failing node stops only a rollout that has nodes left to take.
        stopped: stopped.filter(|_| outdated_ready > 0),
    }
}

/// How many surge slots group `g` has in `state`: slots above its `count`
/// (`worker-6`, `worker-7` for a group of six) that a rollout adds with the
/// group's template, so ready nodes of the old template can be taken down
/// while `count - max_unavailable` stay ready even with `max_unavailable`
/// 0. A surge slot is a slot like any other, with its own identity and one
/// attempt at a time; it is simply desired only while the rollout needs it.
///
/// It is the group's resolved `max_surge` while a rollout runs, 0 otherwise.
/// A rollout runs while one of the group's `count` slots holds a ready,
/// Active node of another template than the group's (there is something to
/// take down), and then, once a surge slot holds an Active node, until every
/// one of the `count` slots is ready with the group's template (so the last
/// replaced node is up before the surge nodes go). Surge slots that are no
/// longer wanted are deleted like any slot a scale-down removes: the
/// highest first, whatever their state.
///
/// A pure function of `state` and `g`: a full pass and an incremental one
/// see the same surge.
pub fn surge(state: &ClusterState, g: &DesiredGroup) -> u32 {
    let max = g.policy.max_surge_of(g.count);
    if max == 0 {
        return 0;
    }
    let mut outdated_ready = false;
    let mut settled = 0u32;
    let mut surging = false;
    for (id, n) in state.nodes.group(&g.id) {
        if id.index >= g.count + max {
            break;
        }
        let active = n.intent == Intent::Active;
        if id.index >= g.count {
            surging |= active;
            continue;
        }
        let current = same_template(&n.template, &g.template);
        outdated_ready |= active && !current && n.is_ready();
        settled += u32::from(current && n.is_ready() && active);
    }
    if outdated_ready || (surging && settled < g.count) {
        max
    } else {
        0
    }
}

/// The groups of `desired` whose rollout holds ready, outdated nodes back
/// in `state` (what row 17 waits on), in group order.
pub fn rollout_holds(state: &ClusterState, desired: &DesiredState) -> Vec<RolloutStatus> {
    desired
        .groups
        .iter()
        .map(|g| group_status(state, g))
        .filter(RolloutStatus::is_holding)
        .collect()
}

/// The remediation breaker of `group`, when it is tripped: more of its
/// desired slots are unhealthy than its `max_unhealthy` allows (`None` when
/// it is within the limit, has no limit, or is not desired).
///
/// A slot is unhealthy when `away(slot, attempt)` says the agent of its
/// current attempt is away (the host knows its agents' links), or when its
/// current attempt failed: stage Failed, or being cleaned up or awaiting its
/// restart after a failure (`failed_reason` is kept until the restart).
pub fn breaker(
    state: &ClusterState,
    desired: &DesiredState,
    group: &GroupId,
    away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
) -> Option<Breaker> {
    let g = desired.group(group)?;
    g.policy.max_unhealthy?;
    let mut unhealthy = 0u32;
    for (id, n) in state.nodes.group(&g.id) {
        if id.index >= g.count {
            break;
        }
        unhealthy += u32::from(away(id, n.attempt) || n.record.failed_reason().is_some());
    }
    Breaker::check(&g.policy, g.count, unhealthy)
}

/// [`reconcile_node`] with rows 17 and 18: a ready node that row 4 would
/// take down for drift waits unless `gates` admits it, and a failed slot
/// that row 2 would restart with the same template waits while its group's
/// breaker is tripped.
pub fn reconcile_node_gated(
    id: &LogicalNodeId,
    node: &ManagedNode,
    desired: Option<&Arc<NodeTemplate>>,
    now: Timestamp,
    gates: &mut RolloutGates<'_>,
) -> NodeDecision {
    // A node a restarted driver adopted re-attaches with its own template,
    // even one its slot no longer wants, until it is ready (then row 17
    // rolls it within budget) or fails (then it is replaced at once).
    let resuming = node.record.resuming
        && node.intent == Intent::Active
        && node.record.stage != NodeStage::Failed
        && desired.is_some();
    let d = if resuming {
        reconcile_node(node, Some(&node.template), now)
    } else {
        reconcile_node(node, desired, now)
    };
    if let Some(NodeAction::Restart { template }) = &d.action
        && node.record.failed_reason().is_some()
        && same_template(template, &node.template)
        && gates.is_tripped(&id.group)
    {
        return NodeDecision::wait(LadderRow::AwaitBreaker, None);
    }
    let drift = matches!(
        d.action,
        Some(NodeAction::BeginDelete {
            reason: DeleteReason::SpecDrift
        })
    );
    if drift && node.is_ready() && !gates.admit(id) {
        return NodeDecision::wait(LadderRow::AwaitRolloutBudget, None);
    }
    d
}

/// One full pass: decides every node and inserts every missing desired slot.
///
/// Walks the observed nodes and the desired groups together in slot order, so
/// a pass costs one step per node and allocates only for the actions it
/// returns; a pass over a settled cluster allocates nothing. Group budgets
/// apply (row 17, [`RolloutGates`]); no breaker is taken as tripped (see
/// [`reconcile_with`] for row 18).
pub fn reconcile(state: &ClusterState, desired: &DesiredState, now: Timestamp) -> Plan {
    plan_with(state, desired, now, false, &BTreeSet::new())
}

/// [`reconcile`] (or, with `paused`, [`reconcile_paused`]) with the
/// groups whose remediation breaker is tripped (row 18).
pub fn reconcile_with(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
    paused: bool,
    tripped: &BTreeSet<GroupId>,
) -> Plan {
    plan_with(state, desired, now, paused, tripped)
}

/// [`reconcile`] for a paused cluster: every node decided by
/// [`reconcile_node_paused`], no slot inserted.
pub fn reconcile_paused(state: &ClusterState, desired: &DesiredState, now: Timestamp) -> Plan {
    plan_with(state, desired, now, true, &BTreeSet::new())
}

fn plan_with(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
    paused: bool,
    tripped: &BTreeSet<GroupId>,
) -> Plan {
    let mut plan = Plan::default();
    walk(state, desired, now, paused, tripped, |id, d| {
        plan.requeue_at = earliest(plan.requeue_at, d.wake_at);
        if let Some(action) = d.action {
            plan.actions.push(PlannedAction {
                node: *id,
                row: d.row,
                action,
            });
        }
    });
    plan
}

/// Whether `node` is ready with exactly its slot's template (the same
/// `Arc`) and waits on nothing: then every row before 11 passes it by, and
/// rows 17 and 18 concern only outdated or failed nodes, so
/// [`reconcile_node_gated`] decides row 11 for it.
#[inline]
fn steady(node: &ManagedNode, desired: Option<&Arc<NodeTemplate>>) -> bool {
    node.record.ready
        && node.intent == Intent::Active
        && matches!(node.record.stage, NodeStage::Dormant | NodeStage::HandedOff)
        && node.pending.is_none()
        && node.retry.next_effect_at.is_none()
        && desired.is_some_and(|t| Arc::ptr_eq(t, &node.template))
}

/// Visits every slot in order with its decision: existing nodes through
/// [`reconcile_node_gated`] (the budgets of rows 17 and 18, `tripped`
/// naming the groups whose breaker is tripped), missing desired slots as
/// [`LadderRow::InsertSlot`]. With `paused`, nodes are decided by
/// [`reconcile_node_paused`] and missing slots wait.
pub(crate) fn walk(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
    paused: bool,
    tripped: &BTreeSet<GroupId>,
    mut visit: impl FnMut(&LogicalNodeId, NodeDecision),
) {
    let mut groups = state.nodes.by_group().peekable();
    let insert =
        |visit: &mut dyn FnMut(&LogicalNodeId, NodeDecision), g: &DesiredGroup, index: u32| {
            let id = LogicalNodeId::new(g.id, index);
            if paused {
                visit(&id, NodeDecision::wait(LadderRow::InsertSlot, None));
                return;
            }
            let action = NodeAction::Insert {
                template: g.template.clone(),
            };
            visit(&id, NodeDecision::act(LadderRow::InsertSlot, action));
        };
    let mut gates = RolloutGates::new(state, desired).with_tripped(tripped);
    let mut reconcile_node =
        |id: &LogicalNodeId, node: &ManagedNode, t: Option<&Arc<NodeTemplate>>, now: Timestamp| {
            if paused {
                reconcile_node_paused(node, t, now)
            } else if steady(node, t) {
                // Most nodes of a large cluster, most of the time: row 11
                // without walking the ladder (the same answer, checked in
                // debug builds).
                let d = NodeDecision::wait(LadderRow::SteadyReady, None);
                debug_assert_eq!(d, reconcile_node_gated(id, node, t, now, &mut gates));
                d
            } else {
                reconcile_node_gated(id, node, t, now, &mut gates)
            }
        };
    for g in &desired.groups {
        // Nodes of groups that sort before this one are not desired at all.
        while let Some((_, nodes)) = groups.next_if(|(id, _)| **id < g.id) {
            for (id, node) in nodes {
                visit(id, reconcile_node(id, node, None, now));
            }
        }
        // Its desired slots: `count`, and the surge slots a rollout adds.
        let extent = g.count + surge(state, g);
        let mut next_missing = 0u32;
        if let Some((_, nodes)) = groups.next_if(|(id, _)| **id == g.id) {
            for (id, node) in nodes {
                for index in next_missing..id.index.min(extent) {
                    insert(&mut visit, g, index);
                }
                next_missing = next_missing.max(id.index.saturating_add(1));
                let t = (id.index < extent).then_some(&g.template);
                visit(id, reconcile_node(id, node, t, now));
            }
        }
        for index in next_missing..extent {
            insert(&mut visit, g, index);
        }
    }
    for (_, nodes) in groups {
        for (id, node) in nodes {
            visit(id, reconcile_node(id, node, None, now));
        }
    }
}

/// True when the cluster is converged on `desired`: every desired slot holds
/// exactly its desired template, ready and Active with nothing pending, and
/// no other node exists. (`observed_generation` alone says nothing about readiness.)
pub fn is_converged(state: &ClusterState, desired: &DesiredState) -> bool {
    unconverged_from(state, desired, None).is_ok()
}

/// What keeps `state` from being converged on `desired`: `Err(Some(node))`
/// names a node that is not (the first one found from `hint` on, then from
/// the first slot up to `hint`), `Err(None)` says the node count differs.
/// The test is [`is_converged`]'s, node for node, in another order: a walk
/// that starts where the last one stopped finds a converge in progress
/// unfinished in a step or two instead of going over every ready node.
///
/// # Errors
/// As above: the state is not converged.
pub(crate) fn unconverged_from(
    state: &ClusterState,
    desired: &DesiredState,
    hint: Option<&LogicalNodeId>,
) -> Result<(), Option<LogicalNodeId>> {
    if state.nodes.len() as u64 != desired.node_count() {
        return Err(None);
    }
    let blocks = |(id, node): &(&LogicalNodeId, &ManagedNode)| {
        !(desired
            .slot(id)
            .is_some_and(|t| same_template(t, &node.template))
            && node.is_ready()
            && node.pending.is_none())
    };
    let found = match hint {
        Some(h) => state
            .nodes
            .iter_from(h)
            .chain(state.nodes.iter().take_while(|(id, _)| *id < h))
            .find(blocks),
        None => state.nodes.iter().find(blocks),
    };
    match found {
        Some((id, _)) => Err(Some(*id)),
        None => Ok(()),
    }
}

/// What applying a desired state would change, counted per slot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeDiff {
    /// Desired slots with no node yet.
    pub create: u64,
    /// Active nodes made from another template than their slot's: replaced.
    pub replace: u64,
    /// Active nodes of slots that are not desired: destroyed.
    pub destroy: u64,
    /// Active nodes that stay as they are.
    pub unchanged: u64,
    /// Up to [`ShapeDiff::EXAMPLES_MAX`] changed slots, in slot order.
    pub examples: Vec<(LogicalNodeId, Change)>,
}

/// How one slot changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A new slot.
    Create,
    /// A node replaced by one of the new template.
    Replace,
    /// A node destroyed.
    Destroy,
}

impl ShapeDiff {
    /// How many changed slots are listed by name.
    pub const EXAMPLES_MAX: usize = 200;

    /// Every slot of `next` created: what a shape changes on a cluster
    /// that holds nothing yet.
    pub fn all_created(next: &DesiredState) -> Self {
        let mut d = Self::default();
        for spec in next.specs() {
            d.note(&spec.node, Change::Create);
        }
        d
    }

    /// True when nothing would change.
    pub fn is_empty(&self) -> bool {
        self.create == 0 && self.replace == 0 && self.destroy == 0
    }

    pub(crate) fn note(&mut self, node: &LogicalNodeId, change: Change) {
        self.note_keeping(node, change, Self::EXAMPLES_MAX);
    }

    /// Counts `change` of `node`, and names it while fewer than
    /// `examples_max` are named.
    fn note_keeping(&mut self, node: &LogicalNodeId, change: Change, examples_max: usize) {
        match change {
            Change::Create => self.create += 1,
            Change::Replace => self.replace += 1,
            Change::Destroy => self.destroy += 1,
        }
        if self.examples.len() < examples_max {
            self.examples.push((*node, change));
        }
    }
}

/// What `desired` changes about `state`, slot by slot. Nodes already being
/// deleted are not counted: this change does not cause their end.
pub fn diff(state: &ClusterState, desired: &DesiredState) -> ShapeDiff {
    diff_keeping(state, desired, ShapeDiff::EXAMPLES_MAX)
}

/// Every slot `desired` changes about `state`, in slot order: the whole
/// list of which [`diff`] names only the first [`ShapeDiff::EXAMPLES_MAX`],
/// by the same rule, so it agrees with that diff's counts.
pub fn every_change(state: &ClusterState, desired: &DesiredState) -> Vec<(LogicalNodeId, Change)> {
    diff_keeping(state, desired, usize::MAX).examples
}

/// [`diff`], naming the first `examples_max` changed slots.
fn diff_keeping(state: &ClusterState, desired: &DesiredState, examples_max: usize) -> ShapeDiff {
    let mut d = ShapeDiff::default();
    walk(
        state,
        desired,
        Timestamp::from_millis(0),
        false,
        &BTreeSet::new(),
        |id, _decision| {
            let node = state.nodes.get(id);
            let active = node.is_some_and(|n| {
                n.intent == Intent::Active && n.record.stage != NodeStage::Destroyed
            });
            let mut note = |change| d.note_keeping(id, change, examples_max);
            match (node, desired.slot(id)) {
                (None, Some(_)) => note(Change::Create),
                // A node of another template, even one already down, comes back
                // with the new one.
                (Some(n), Some(t)) if !same_template(t, &n.template) => note(Change::Replace),
                (Some(n), None) if n.record.stage != NodeStage::Destroyed => note(Change::Destroy),
                (Some(_), Some(_)) if active => d.unchanged += 1,
                _ => {}
            }
        },
    );
    d
}
