//! The cluster actor's messages: the public surface other actors use, and
//! the internal messages of its children, its timers and its host's endpoints.
//!
//! Any actor may hold a [`ClusterRef`] (a typed ref limited to
//! [`ClusterMsg`]) and ask a cluster to apply, plan, report or shut down. The
//! swarm endpoint of the application that embeds the cluster holds a
//! [`SwarmRef`]. Everything else ([`DriverMsg`]'s other variants) is the
//! cluster's own business.

use crate::events::{ClusterEvent, ClusterSnapshot, NodeDescription, PlanView};
use crate::executor::ExecutorReport;
use crate::journal::JournalStore;
use crate::observer::{Observations, Observed};
use std::sync::Arc;
use swactor_engine::TimerFired;
use swactor_engine::ractor::{DerivedActorRef, RpcReplyPort};
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_providers::Provider;
use swactor_provisioning::{
    ApplyError, ClusterShape, DesiredUpdate, Generation, JoinRefused, JournalImage, Liveness,
    LogicalNodeId, PauseError, ReplaceError, ResourceKey, ShutdownMode, ShutdownReport, Timestamp,
};
use tokio::sync::broadcast;

use crate::config::ClusterConfig;

/// The run's spend and what it is held against, without a whole snapshot
/// (see [`ClusterMsg::Spent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpentView {
    /// What the run has spent, in millionths of a dollar: the larger of
    /// what its providers count and what its journal keeps.
    pub spent_micros: u64,
    /// The shape's budget, if it sets one.
    pub budget: Option<swactor_provisioning::budget::Budget>,
    /// Reconciling is paused.
    pub paused: bool,
    /// A shutdown (teardown or keep) is under way.
    pub shutting_down: bool,
}

/// The desired state and the shape on record, without the cluster's state
/// (see [`ClusterMsg::Desired`]).
#[derive(Clone, Debug)]
pub struct DesiredView {
    /// The desired state: each group's slots, template and policy.
    pub desired: swactor_provisioning::DesiredState,
    /// The shape on record (the last accepted one), as it was applied.
    pub shape: Option<ClusterShape>,
}

/// A check of the run's lifetimes (see [`ClusterMsg::Lifetime`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifetimeCheck {
    /// The wall clock, in ms since the Unix epoch, as the caller read it.
    pub wall_ms: u64,
    /// A job runs on some node (submitted and not ended).
    pub jobs_running: bool,
}

/// Where the run stands against its lifetimes (see [`ClusterMsg::Lifetime`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifetimeView {
    /// The verdict and what views say beside it; `None` when the shape
    /// sets no lifetime.
    pub status: Option<swactor_provisioning::lifetime::Status>,
    /// A shutdown (teardown or keep) is under way.
    pub shutting_down: bool,
}

/// What any actor may ask of a cluster.
pub enum ClusterMsg {
    /// Offer a new desired shape; the reply comes once an accepted shape is durable.
    Apply(
        ClusterShape,
        RpcReplyPort<Result<DesiredUpdate, ApplyError>>,
    ),
    /// Preview the next pass, for the current shape or a proposed one.
    Plan(
        Option<ClusterShape>,
        RpcReplyPort<Result<PlanView, ApplyError>>,
    ),
    /// The cluster as it is now.
    Snapshot(RpcReplyPort<ClusterSnapshot>),
    /// The cluster's figures and each group's counts, without its nodes
    /// (see [`crate::glance`]).
    Glance(RpcReplyPort<crate::ClusterGlance>),
    /// The desired state and the shape on record, without the cluster's state.
    Desired(RpcReplyPort<DesiredView>),
    /// The current attempt of each of these slots (`None`: it has no node).
    Attempts(
        Vec<LogicalNodeId>,
        RpcReplyPort<Vec<Option<swactor_provisioning::NodeAttemptId>>>,
    ),
    /// One node in depth (`None` if the cluster never had it, or forgot it).
    Describe(LogicalNodeId, RpcReplyPort<Option<NodeDescription>>),
    /// Subscribe to events.
    Subscribe(RpcReplyPort<Subscription>),
    /// Reply once converged on the current desired generation (or not at all
    /// if the cluster stops first: the port is dropped).
    WaitConverged(RpcReplyPort<Generation>),
    /// Offer a shape as the next generation, whatever generation it carries
    /// (see [`swactor_provisioning::Host::handle_apply_next`]).
    ApplyNext(
        ClusterShape,
        RpcReplyPort<Result<DesiredUpdate, ApplyError>>,
    ),
    /// Reply once the provider's inventory and the journal are adopted (or
    /// not at all if the cluster stops first: the port is dropped).
    WaitAdopted(RpcReplyPort<()>),
    /// Shut the cluster down.
    Shutdown(ShutdownMode, RpcReplyPort<ShutdownReport>),
    /// What the run's rented machines have cost so far, as the providers
    /// count it now (millionths of a dollar); the reply is the run's spend
    /// as the journal keeps it (see [`swactor_provisioning::Host::handle_spent`])
    /// and what it is held against.
    Spent(u64, RpcReplyPort<SpentView>),
    /// A check of the run's lifetimes at the caller's wall clock: the
    /// journal records what changed (see
    /// [`swactor_provisioning::Host::handle_lifetime`]); the reply says
    /// whether a deadline has come.
    Lifetime(LifetimeCheck, RpcReplyPort<LifetimeView>),
    /// Pause (`true`) or resume (`false`) reconciling; the reply (whether
    /// anything changed) comes once the flag is durable.
    Pause(bool, RpcReplyPort<Result<bool, PauseError>>),
    /// The operator asks for a node to be replaced; the reply names the
    /// attempt that will be (see [`swactor_provisioning::Host::handle_replace`]).
    Replace(
        LogicalNodeId,
        RpcReplyPort<Result<swactor_provisioning::NodeAttemptId, ReplaceError>>,
    ),
    /// The leadership bound ([`crate::ClusterConfig::lead`]) moved: the
    /// driver reads it again (it also does on every other message).
    Leadership,
}

/// What a swarm endpoint tells a cluster about its agents.
pub enum SwarmMsg {
    /// An agent presented `key` to join: accepted only for the node's
    /// current, active attempt, with how it must prove it is alive.
    Join(ResourceKey, RpcReplyPort<Result<Liveness, JoinRefused>>),
    /// The agent of `key` disconnected, silent for the given time; unless it
    /// rejoins within its grace (counted from when it was last heard), its
    /// node is replaced.
    Gone(ResourceKey, std::time::Duration),
    /// Whether the agent of `key` may hold a link (a jobs link, say): the
    /// join's verdict, without joining.
    Check(ResourceKey, RpcReplyPort<Result<(), JoinRefused>>),
    /// The agents of these keys are connected and heard: each one's join,
    /// asserted again in one message; the answer is those refused, and why.
    Heard(
        Vec<ResourceKey>,
        RpcReplyPort<Vec<(ResourceKey, JoinRefused)>>,
    ),
}

/// A ref to a cluster limited to its public messages.
pub type ClusterRef = DerivedActorRef<ClusterMsg>;

/// A ref to a cluster limited to what a swarm endpoint tells it.
pub type SwarmRef = DerivedActorRef<SwarmMsg>;

/// Every message of the driver actor.
pub enum DriverMsg {
    /// A public request.
    Cluster(ClusterMsg),
    /// News from the swarm endpoint.
    Swarm(SwarmMsg),
    /// The driver's full state, for tests and diagnostics.
    Inspect(swactor_engine::ractor::RpcReplyPort<DriverView>),
    /// An executor worker reported.
    Executor(ExecutorReport),
    /// Bootstrap observations from the observers' mux, each with its observer's number.
    Observed(Vec<Observed>),
    /// An engine timer fired.
    Timer(TimerFired<TimerKey>),
    /// Drain the host's outputs.
    Drive,
    /// Test-only fault: the driver panics while handling it (not in release builds).
    #[cfg(debug_assertions)]
    InjectPanic,
}

macro_rules! variant {
    ($inner:ty, $variant:ident) => {
        impl From<$inner> for DriverMsg {
            fn from(m: $inner) -> Self {
                Self::$variant(m)
            }
        }
        impl TryFrom<DriverMsg> for $inner {
            type Error = DriverMsg;
            fn try_from(m: DriverMsg) -> Result<Self, DriverMsg> {
                match m {
                    DriverMsg::$variant(inner) => Ok(inner),
                    other => Err(other),
                }
            }
        }
    };
}

variant!(ClusterMsg, Cluster);
variant!(SwarmMsg, Swarm);
variant!(ExecutorReport, Executor);
variant!(TimerFired<TimerKey>, Timer);

impl From<Observations> for DriverMsg {
    fn from(o: Observations) -> Self {
        Self::Observed(o.0)
    }
}

impl TryFrom<DriverMsg> for Observations {
    type Error = DriverMsg;
    fn try_from(m: DriverMsg) -> Result<Self, DriverMsg> {
        match m {
            DriverMsg::Observed(o) => Ok(Observations(o)),
            other => Err(other),
        }
    }
}

/// The driver's timers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimerKey {
    /// The host's next deadline.
    Requeue,
    /// The safety-net tick.
    Tick,
    /// Refresh the remote telemetry snapshot.
    Snapshot,
}

/// Start arguments of the driver actor.
pub struct DriverArgs {
    /// Settings.
    pub config: ClusterConfig,
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Publishes to remote subscribers (e.g. a daemon's telemetry endpoint), if any.
    pub publisher: Option<Arc<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>>,
    /// Where journal writes go; `None` keeps nothing (a cluster that is never resumed).
    pub journal: Option<Arc<dyn JournalStore>>,
    /// The journal to resume, if any.
    pub resume: Option<JournalImage>,
}

/// The driver's full state at one instant (a copy), for tests and diagnostics.
#[derive(Clone, Debug)]
pub struct DriverView {
    /// The instant, on the driver's clock.
    pub now: Timestamp,
    /// The observed state.
    pub state: swactor_provisioning::ClusterState,
    /// The desired state.
    pub desired: swactor_provisioning::DesiredState,
    /// The core's next deadline (`poll_timeout`).
    pub timer: Option<Timestamp>,
    /// Whether the host reports convergence.
    pub converged: bool,
    /// Whether the host has adopted its inventory and has nothing left to collect or verify.
    pub settled: bool,
    /// Agents whose grace is running.
    pub agents_away: usize,
    /// The core's lifetime counters.
    pub stats: swactor_provisioning::DriverStats,
    /// The shape on record (the last accepted one), as it was applied.
    pub shape: Option<ClusterShape>,
    /// Messages the driver actor has handled: every one its mailbox took
    /// (a batch of results or observations counts once), its own included.
    pub messages: u64,
    /// The host's latest deaf gap: time it heard nothing at all.
    pub deaf: Option<swactor_provisioning::DeafGap>,
}

/// A local subscription: the state now, then every event after it.
#[derive(Debug)]
pub struct Subscription {
    /// The cluster when the subscription started.
    pub snapshot: ClusterSnapshot,
    /// Events after the snapshot. A subscriber that falls `event_buffer_len`
    /// behind gets `RecvError::Lagged` and continues; it never slows the driver.
    pub events: broadcast::Receiver<ClusterEvent>,
}
