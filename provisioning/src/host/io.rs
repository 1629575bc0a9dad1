//! The types of the host's interface: what it is handed (listings, tickets,
//! links) and what it hands out (outputs, events, replies, refusals).

use super::*;

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
#[derive(Clone, Debug, PartialEq, thiserror::Error, Serialize)]
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

impl From<OverCapacity> for ApplyError {
    fn from(o: OverCapacity) -> Self {
        Self::OverCapacity {
            nodes: o.nodes,
            surge: o.surge,
            capacity: o.capacity,
            basis: o.basis,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
pub enum PauseError {
    /// The cluster is being torn down (or has stopped): a teardown overrides
    /// a pause and cannot itself be paused.
    #[error(
        "the cluster is being torn down, and a teardown cannot be paused; it removes every node whatever the pause says"
    )]
    ShuttingDown,
}

/// The answer to a ticket.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize)]
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
#[derive(Debug, Serialize)]
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

impl Output {
    /// Whether carrying it out acts on the world or the journal (a write,
    /// a dispatch, a listing, a collection, a probe), which a host that does
    /// not lead holds back; a reply, a fold's report or the stop do not.
    pub fn acts(&self) -> bool {
        !matches!(self, Self::Folded(_) | Self::Reply(..) | Self::Stop)
    }
}

/// Something worth telling people about.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// A provider gave a release up (see [`crate::Release::GivenUp`]): the
    /// key's session or lease may still hold a machine until the provider
    /// cleans it up.
    GivenUp {
        /// What was given up.
        key: ResourceKey,
        /// Where and why.
        reason: String,
    },
}

/// Why an agent's join was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
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
