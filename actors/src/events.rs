//! What the driver tells the world: snapshots of the cluster and a stream of events.

use serde::{Deserialize, Serialize};
use swactor_provisioning::{
    AttemptRecord, BootstrapStage, ClusterState, DriverStats, EffectKind, FailureCause, Generation,
    GroupHold, HoldKind, Intent, LadderRow, LeaseId, Link, LogicalNodeId, NextStep, NodeAttemptId,
    NodeStage, OperationId, Plan, ResourceKey, ShapeDiff, ShutdownMode, Timestamp,
};

/// Whether a node's agent is connected to this daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentLink {
    /// It has not joined this daemon (yet).
    NotJoined,
    /// It is connected.
    Connected,
    /// It joined, then went away; the node fails unless it is back by `grace_until`.
    Away {
        /// End of its grace.
        grace_until: Timestamp,
    },
}

/// One node as people see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// The slot.
    pub node: LogicalNodeId,
    /// The current attempt.
    pub attempt: NodeAttemptId,
    /// Where on the ladder it is.
    pub stage: NodeStage,
    /// Active or Deleting.
    pub intent: Intent,
    /// Converged and serving, with its agent not away.
    pub ready: bool,
    /// The operation in flight, if any.
    pub pending: Option<EffectKind>,
    /// Failures since the slot was last ready.
    pub failures: u32,
    /// The last error, if any.
    pub last_error: Option<String>,
    /// What kind of trouble the last error was, as the core recorded it
    /// with the error.
    #[serde(default)]
    pub last_cause: Option<FailureCause>,
    /// When the next retry (or restart) may happen, if the node is backing off.
    pub next_retry_at: Option<Timestamp>,
    /// Its agent's connection to this daemon.
    pub agent: AgentLink,
    /// The provider's resource the current attempt holds, if any.
    #[serde(default)]
    pub lease: Option<LeaseId>,
    /// What the provider says of that resource (a container id, a host, an
    /// offer and its price). The cluster leaves it empty; a host that asks
    /// the provider fills it in for people.
    #[serde(default)]
    pub resource: Option<String>,
    /// What happens next to it, and when (the host's `next_step`); every view
    /// words its waits from this.
    #[serde(default)]
    pub next: NextStep,
    /// Seconds its agent keeps the node once its daemon stops renewing its
    /// lease (the group's `orphan_after_s`); 0: for ever. The host fills it
    /// in.
    #[serde(default)]
    pub orphan_after_s: u32,
    /// How long ago this daemon last renewed the lease of the current
    /// attempt's agent, when it has. The cluster leaves it empty; the
    /// daemon, which sends the renewals, fills it in for people.
    #[serde(default)]
    pub lease_renewed_ms_ago: Option<u64>,
}

impl NodeSummary {
    /// Summarises one node of `state`, whose agent link (of its current attempt) is `link`.
    pub fn of(node: &LogicalNodeId, state: &ClusterState, link: Option<Link>) -> Option<Self> {
        let n = state.nodes.get(node)?;
        let agent = match link {
            Some(Link::Connected(a)) if a == n.attempt => AgentLink::Connected,
            Some(Link::Away { attempt, until }) if attempt == n.attempt => {
                AgentLink::Away { grace_until: until }
            }
            _ => AgentLink::NotJoined,
        };
        Some(Self {
            node: *node,
            attempt: n.attempt,
            stage: n.record.stage,
            intent: n.intent,
            ready: Link::shows_ready(link, n),
            pending: n.pending.as_ref().map(|p| p.effect),
            failures: n.retry.consecutive_failures,
            last_error: n.record.last_error().map(str::to_owned),
            last_cause: n.record.last_cause(),
            next_retry_at: n.retry.next_effect_at.or(n.record.restart_at),
            agent,
            lease: n.record.lease.clone(),
            resource: None,
            next: NextStep::Nothing,
            orphan_after_s: 0,
            lease_renewed_ms_ago: None,
        })
    }
}

/// The whole cluster as people see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSnapshot {
    /// The run.
    pub run_id: String,
    /// The desired generation.
    pub generation: Generation,
    /// The generation the last pass evaluated.
    pub observed_generation: Option<Generation>,
    /// Whether the cluster is converged on the desired generation.
    pub converged: bool,
    /// Whether the daemon has read the provider's listing of the run and
    /// matched it against its journal (taking over what an earlier daemon
    /// left, if anything: a new run reads an empty listing). Until then no
    /// node is created or judged missing.
    #[serde(default, alias = "adopted")]
    pub inventory_read: bool,
    /// How many slots the desired shape has.
    pub desired_nodes: u64,
    /// Every node, in slot order.
    pub nodes: Vec<NodeSummary>,
    /// Orphaned resources still being collected.
    #[serde(default)]
    pub orphans: usize,
    /// A shutdown under way, if any.
    #[serde(default)]
    pub shutting_down: Option<ShutdownMode>,
    /// The driver's lifetime counters.
    pub stats: DriverStats,
    /// The clock reading the snapshot was taken at.
    pub now: Timestamp,
    /// The machines rented for the nodes, where a provider rents them by
    /// the hour (Vast.ai): filled in by the daemon when it answers a status
    /// request, empty in the cluster's own snapshots.
    #[serde(default)]
    pub rentals: Vec<Rental>,
    /// The deployment the cluster's journal is (`None`: a journal from
    /// before deployments were recorded).
    #[serde(default)]
    pub deployment: Option<String>,
    /// Resources of the run that another deployment made, as the providers
    /// last listed them: filled in by the daemon when it answers a status
    /// request, empty in the cluster's own snapshots.
    #[serde(default)]
    pub foreign: Vec<swactor_providers::ForeignResource>,
    /// The run's dollar budget, from its shape.
    #[serde(default)]
    pub budget: Option<swactor_provisioning::budget::Budget>,
    /// What the run's rented machines have cost and cost per hour: filled
    /// in by the daemon when it answers a status request (where a provider
    /// rents by the hour), empty in the cluster's own snapshots.
    #[serde(default)]
    pub spend: Option<swactor_provisioning::budget::Spend>,
    /// When the run tears itself down (its shape's `max_lifetime_s` or
    /// `idle_teardown_s`), as of the snapshot; `None` when it sets neither,
    /// or before the daemon's first check. (Never skipped when empty:
    /// postcard frames have no field names, so a skipped field would shift
    /// every later one.)
    #[serde(default)]
    pub lifetime: Option<swactor_provisioning::lifetime::Status>,
    /// Reconciling is paused (`swactor pause`): state is folded and shown,
    /// nothing new is dispatched.
    #[serde(default)]
    pub paused: bool,
    /// What groups hold back and why: a rollout waiting on its budget or
    /// stopped on a failing node, remediation paused by a breaker.
    #[serde(default)]
    pub holds: Vec<GroupHold>,
    /// Operations handed to the executor whose results have not come back
    /// (the executor's queue depth).
    #[serde(default)]
    pub in_flight: usize,
    /// Who leads the run and who stands by, when several daemons share it
    /// (`swactor up --etcd`): filled in by the daemon when it answers a
    /// status request; `None` for a daemon alone on its journal.
    #[serde(default)]
    pub ha: Option<HaStatus>,
}

/// The daemons of a run that share its journal in etcd: the one that leads
/// and those that stand by.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HaStatus {
    /// The leader, as people know it (`host (pid N)`).
    pub leader: String,
    /// When it took the lead, wall clock (milliseconds since the Unix epoch).
    pub leading_since_wall_ms: u64,
    /// The standbys, as people know them, in the order they registered.
    pub standbys: Vec<String>,
    /// How long the leader's etcd lease lives without a renewal.
    pub lease_ttl_ms: u64,
    /// How long before its lease could end a leader stops acting.
    pub margin_ms: u64,
    /// How long ago, on the leader's clock, its lease was last renewed.
    pub renewed_ms_ago: u64,
    /// The etcd members, as given.
    pub etcd: String,
    /// Times this replica took the lead since it started.
    pub terms: u64,
    /// Provider calls this term let through its leadership gate.
    pub provider_calls: u64,
    /// Provider calls this term's gate refused (picked up past the bound).
    pub provider_calls_refused: u64,
    /// Journal commits this term sent to etcd.
    pub journal_commits: u64,
}

impl ClusterSnapshot {
    /// The snapshot of a cluster of `run_id` before anything is known of
    /// it: generation 0, no nodes, nothing read from its provider.
    pub fn empty(run_id: impl Into<String>) -> Self {
        Self {
            run_id: run_id.into(),
            generation: Generation(0),
            observed_generation: None,
            converged: false,
            inventory_read: false,
            desired_nodes: 0,
            nodes: Vec::new(),
            orphans: 0,
            shutting_down: None,
            stats: DriverStats::default(),
            now: Timestamp::default(),
            rentals: Vec::new(),
            deployment: None,
            foreign: Vec::new(),
            budget: None,
            spend: None,
            lifetime: None,
            paused: false,
            holds: Vec::new(),
            in_flight: 0,
            ha: None,
        }
    }
}

/// One node's rented machine, as its provider last saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rental {
    /// The slot.
    pub node: LogicalNodeId,
    /// The attempt the machine serves.
    pub attempt: NodeAttemptId,
    /// The provider kind (`vast`).
    pub provider: String,
    /// The provider's id of the rented machine (the Vast.ai instance).
    pub instance: String,
    /// The offer it was rented from (empty when unknown, e.g. adopted).
    pub offer: String,
    /// The physical machine.
    pub machine: String,
    /// Its price in millionths of a dollar per hour (integral, so the
    /// snapshot stays comparable).
    pub usd_per_hour_micros: u64,
    /// Its status, as the provider last saw it.
    pub status: String,
}

/// Something the driver did or learned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClusterEvent {
    /// A new desired shape was accepted.
    ShapeAccepted {
        /// Its generation.
        generation: Generation,
        /// How many slots it has.
        nodes: u64,
    },
    /// A node changed; the summary is its state afterwards.
    Node(NodeSummary),
    /// A node was removed from the cluster (reaped).
    Removed {
        /// The slot.
        node: LogicalNodeId,
    },
    /// An operation was handed to an executor.
    Dispatched {
        /// The slot.
        node: LogicalNodeId,
        /// The operation.
        op: OperationId,
        /// What it does.
        effect: EffectKind,
    },
    /// An operation's result came back.
    Finished {
        /// The slot.
        node: LogicalNodeId,
        /// The operation.
        op: OperationId,
        /// A one-line description of the outcome.
        outcome: String,
        /// False when the result was stale and discarded.
        folded: bool,
    },
    /// A reconcile pass ran.
    Pass {
        /// Its number.
        number: u64,
        /// Nodes in the cluster.
        nodes: usize,
        /// Transitions applied.
        transitions: usize,
        /// Operations dispatched.
        dispatched: usize,
        /// Microseconds the driver spent in the step that ran the pass
        /// (deciding, and folding what the step folded); 0 when unknown.
        #[serde(default)]
        duration_us: u64,
    },
    /// The cluster converged on a generation.
    Converged {
        /// The generation.
        generation: Generation,
        /// How many nodes are ready.
        nodes: usize,
    },
    /// Something went wrong that people should see (a refused action, an executor crash).
    Warning {
        /// What happened.
        message: String,
    },
    /// The provider's inventory and the journal were adopted after a start.
    Adopted {
        /// Attempts that became a slot's node.
        adopted: Vec<ResourceKey>,
        /// Adopted attempts of another template: they are replaced.
        drifted: Vec<ResourceKey>,
        /// Resources no slot owns: they are collected.
        orphans: Vec<ResourceKey>,
        /// Attempts on record that the provider no longer lists.
        presumed_gone: Vec<ResourceKey>,
    },
    /// A sweep found resources no current attempt owns.
    Swept {
        /// What it found (collected next).
        orphans: Vec<ResourceKey>,
    },
    /// An orphan was collected, or a try failed (it is retried).
    Collected {
        /// The orphan.
        key: ResourceKey,
        /// Why the try failed.
        error: Option<String>,
    },
    /// A provider gave up releasing a session or lease whose machine did
    /// not answer for too long: it may still hold that machine until the
    /// provider cleans it up.
    GivenUp {
        /// What was given up.
        key: ResourceKey,
        /// Where and why.
        reason: String,
    },
    /// An agent joined this daemon.
    AgentJoined {
        /// Who.
        key: ResourceKey,
    },
    /// A joined agent went away; its node fails unless it is back in time.
    AgentDisconnected {
        /// Who.
        key: ResourceKey,
        /// End of its grace.
        grace_until: Timestamp,
        /// Whether a new attempt follows if it is not back (not while
        /// paused, nor while its group's breaker holds it).
        #[serde(default = "yes")]
        replaced: bool,
        /// The cluster's clock when it was noticed: its grace is told
        /// against this, not against a viewer's idea of the clock.
        #[serde(default)]
        at: Timestamp,
    },
    /// The daemon heard nothing at all from `from` to `to` (it was
    /// stopped, asleep or starved): no agent is blamed for that silence,
    /// and the `agents` joined or away each get their grace again from `to`.
    Deaf {
        /// The last input before the gap.
        from: Timestamp,
        /// When the daemon was back.
        to: Timestamp,
        /// Agents given their grace again.
        agents: usize,
    },
    /// A teardown began.
    TeardownStarted {
        /// The empty generation it converges on.
        generation: Generation,
    },
    /// Reconciling was paused: nothing new is dispatched until it resumes.
    Paused,
    /// Reconciling resumed.
    Resumed {
        /// A teardown overrode the pause (rather than `resume`).
        by_teardown: bool,
    },
    /// A group began holding something back or its reason changed
    /// (`reason: Some`), or it stopped holding it (`reason: None`).
    Hold {
        /// The group.
        group: String,
        /// What it holds: a rollout, or remediation of lost nodes.
        kind: HoldKind,
        /// Why, while it holds.
        reason: Option<String>,
    },
    /// An away agent's machine is paused by its provider (an
    /// interruptible rental outbid): its node is kept until `wait_until`
    /// in a group that waits (`on_preempt = "wait"`), else lost at its
    /// grace's end.
    Preempted {
        /// Who.
        key: ResourceKey,
        /// When waiting ends, if its group waits.
        wait_until: Option<Timestamp>,
        /// The cluster's clock when it was learnt.
        at: Timestamp,
    },
}

/// The actions the next pass would take, in a form that prints well.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanView {
    /// One line per planned action: slot, ladder row, action.
    pub actions: Vec<PlanLine>,
    /// When the cluster next needs waking, if anything waits.
    pub requeue_at: Option<Timestamp>,
    /// What the shape changes overall, counted per slot.
    pub diff: ShapeDiff,
}

/// One node in depth: where it is now and its last attempts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeDescription {
    /// The slot.
    pub node: LogicalNodeId,
    /// Where it is now, if the slot has a node.
    pub summary: Option<NodeSummary>,
    /// Whether the current shape wants the slot.
    pub desired: bool,
    /// The provider's name for its current lease, if it has one.
    pub lease: Option<String>,
    /// The last bootstrap fact of its current attempt.
    pub bootstrap: Option<BootstrapStage>,
    /// Why its current attempt failed, if it did.
    pub failed_reason: Option<String>,
    /// Its last attempts, oldest first.
    pub attempts: Vec<AttemptRecord>,
    /// The cluster's clock when this was taken.
    pub now: Timestamp,
}

/// One planned action.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanLine {
    /// The slot.
    pub node: LogicalNodeId,
    /// The ladder row that decided it.
    pub row: LadderRow,
    /// The action, in words.
    pub action: String,
}

impl From<(Plan, ShapeDiff)> for PlanView {
    fn from((plan, diff): (Plan, ShapeDiff)) -> Self {
        use swactor_provisioning::NodeAction as A;
        let actions = plan
            .actions
            .into_iter()
            .map(|a| PlanLine {
                node: a.node,
                row: a.row,
                action: match a.action {
                    A::Insert { .. } => "create slot".to_owned(),
                    A::BeginDelete { reason } => format!("begin delete ({reason:?})"),
                    A::MarkDestroyed => "mark destroyed".to_owned(),
                    A::Restart { .. } => "restart with a new attempt".to_owned(),
                    A::Reap => "remove slot".to_owned(),
                    A::ObserveConvergence => "record convergence".to_owned(),
                    A::Dispatch(kind) => format!("dispatch {kind:?}"),
                },
            })
            .collect();
        Self {
            actions,
            requeue_at: plan.requeue_at,
            diff,
        }
    }
}

fn yes() -> bool {
    true
}
