//! The cluster handle: start a cluster, message it, shut it down.

use crate::config::ClusterConfig;
use crate::driver::DriverActor;
use crate::events::{ClusterEvent, ClusterSnapshot, NodeDescription, PlanView};
use crate::glance::Tally;
use crate::msg::{
    ClusterMsg, ClusterRef, DriverArgs, DriverMsg, DriverView, Subscription, SwarmMsg, SwarmRef,
};
use crate::supervisor::{ClusterSupervisor, SupervisorArgs};
use std::sync::Arc;
use swactor_engine::ractor::{Actor, ActorCell, ActorRef, RpcReplyPort, SpawnErr};
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_providers::Provider;
use swactor_provisioning::{
    ApplyError, ClusterShape, DesiredUpdate, Generation, JoinRefused, Liveness, LogicalNodeId,
    NodeAttemptId, PauseError, ReplaceError, ResourceKey, ShutdownMode, ShutdownReport,
};

/// Why a call to a cluster failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The cluster actor could not be started.
    #[error("could not start the cluster actor")]
    Spawn(#[source] SpawnErr),
    /// The cluster actor is gone (shut down or failed).
    #[error("the cluster is not running")]
    NotRunning,
    /// The shape was refused; the cluster is unchanged.
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// The pause was refused (the cluster is being torn down).
    #[error(transparent)]
    Pause(#[from] PauseError),
    /// The replace was refused; nothing changed.
    #[error(transparent)]
    Replace(#[from] ReplaceError),
}

/// A running cluster. Cheap to clone; every clone talks to the same driver actor.
#[derive(Clone, Debug)]
pub struct ClusterHandle {
    actor: ActorRef<DriverMsg>,
    /// Where the driver leaves its last glance (a handle made from a bare
    /// actor ref has none).
    tally: Option<Tally>,
}

/// Starts clusters.
pub struct Cluster;

impl Cluster {
    /// Starts a cluster as a top-level actor (no supervisor).
    ///
    /// # Errors
    /// The actor could not be started (for instance an invalid reconciler config).
    pub async fn start(
        config: ClusterConfig,
        provider: Arc<dyn Provider>,
    ) -> Result<ClusterHandle, ClusterError> {
        Self::start_with(config, provider, None, None).await
    }

    /// Starts a cluster linked to `supervisor` (another actor that will hear
    /// if it fails), optionally publishing to remote telemetry subscribers.
    ///
    /// # Errors
    /// The actor could not be started.
    pub async fn start_with(
        config: ClusterConfig,
        provider: Arc<dyn Provider>,
        supervisor: Option<ActorCell>,
        publisher: Option<Arc<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>>,
    ) -> Result<ClusterHandle, ClusterError> {
        let args = DriverArgs {
            config,
            provider,
            publisher,
            journal: None,
            resume: None,
        };
        Self::spawn(args, supervisor).await
    }

    /// Starts a cluster from full arguments (a journal to write, one to
    /// resume), linked to `supervisor` if one is given.
    ///
    /// # Errors
    /// The actor could not be started (an invalid config, a journal of another run).
    pub async fn spawn(
        mut args: DriverArgs,
        supervisor: Option<ActorCell>,
    ) -> Result<ClusterHandle, ClusterError> {
        let tally = args.config.tally.get_or_insert_with(Tally::default).clone();
        let spawned = match supervisor {
            Some(sup) => DriverActor::spawn_linked(None, DriverActor, args, sup).await,
            None => DriverActor::spawn(None, DriverActor, args).await,
        };
        let (actor, _join) = spawned.map_err(ClusterError::Spawn)?;
        Ok(ClusterHandle {
            actor,
            tally: Some(tally),
        })
    }
}

impl Cluster {
    /// Starts a cluster under a [`ClusterSupervisor`] (linked to
    /// `supervisor`, if given): a failed cluster actor is restarted from
    /// the journal within the budget. The handle talks to the supervisor, so
    /// it keeps working across restarts; `on_exit` in `args` says how the
    /// cluster ended.
    ///
    /// # Errors
    /// The supervisor or the first cluster actor could not be started.
    pub async fn supervised(
        mut args: SupervisorArgs,
        supervisor: Option<ActorCell>,
    ) -> Result<ClusterHandle, ClusterError> {
        let tally = args.config.tally.get_or_insert_with(Tally::default).clone();
        let spawned = match supervisor {
            Some(sup) => ClusterSupervisor::spawn_linked(None, ClusterSupervisor, args, sup).await,
            None => ClusterSupervisor::spawn(None, ClusterSupervisor, args).await,
        };
        let (actor, _join) = spawned.map_err(ClusterError::Spawn)?;
        Ok(ClusterHandle {
            actor,
            tally: Some(tally),
        })
    }
}

impl ClusterHandle {
    /// The driver actor, for supervisors and for messaging it directly.
    pub fn actor(&self) -> &ActorRef<DriverMsg> {
        &self.actor
    }

    /// A ref to the cluster limited to its public messages, for other actors.
    pub fn cluster_ref(&self) -> ClusterRef {
        self.actor.get_derived()
    }

    /// A ref for the swarm endpoint of the application that embeds the cluster.
    pub fn swarm_ref(&self) -> SwarmRef {
        self.actor.get_derived()
    }

    /// A handle for a cluster actor known by its ref (e.g. one a supervisor restarted).
    pub fn from_actor(actor: ActorRef<DriverMsg>) -> Self {
        Self { actor, tally: None }
    }

    async fn call<T: Send + 'static>(
        &self,
        msg: impl FnOnce(RpcReplyPort<T>) -> DriverMsg,
    ) -> Result<T, ClusterError> {
        let (tx, rx) = swactor_engine::ractor::concurrency::oneshot();
        self.actor
            .send_message(msg(tx.into()))
            .map_err(|_| ClusterError::NotRunning)?;
        rx.await.map_err(|_| ClusterError::NotRunning)
    }

    /// Offers a new desired shape.
    ///
    /// # Errors
    /// [`ClusterError::Update`] when the shape breaks validation or the
    /// revision contract (nothing changes), or the cluster is gone.
    pub async fn apply(&self, shape: ClusterShape) -> Result<DesiredUpdate, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::Apply(shape, r)))
            .await??)
    }

    /// Offers `shape` as the next generation, whatever generation it
    /// carries: unchanged if its content is the current shape's, else one
    /// above the current generation. The cluster picks the generation, so
    /// no other apply can take it in between.
    ///
    /// # Errors
    /// As [`ClusterHandle::apply`].
    pub async fn apply_next(&self, shape: ClusterShape) -> Result<DesiredUpdate, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::ApplyNext(shape, r)))
            .await??)
    }

    /// The actions the next pass would take if `shape` were applied (or, for
    /// `None`, on the current shape). Applies nothing.
    ///
    /// # Errors
    /// As [`ClusterHandle::apply`].
    pub async fn plan(&self, shape: Option<ClusterShape>) -> Result<PlanView, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::Plan(shape, r)))
            .await??)
    }

    /// The cluster as it is now.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn snapshot(&self) -> Result<ClusterSnapshot, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Snapshot(r)))
            .await
    }

    /// The cluster's figures and each group's counts, without a copy of
    /// its nodes: what `/metrics` and dashboards read (see
    /// [`crate::glance`]). Costs the driver as much as the shape has
    /// groups, not nodes (unless per-node events are off: then it counts
    /// the nodes).
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn glance(&self) -> Result<crate::ClusterGlance, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Glance(r)))
            .await
    }

    /// The glance the driver left after its last step, read without a
    /// message: it does not wait while the driver works, and is as fresh as
    /// the driver's last step (or last [`ClusterHandle::glance`]). `None`
    /// before the driver's first step, for a handle made from a bare actor
    /// ref, and while per-node events are off.
    pub fn last_glance(&self) -> Option<crate::ClusterGlance> {
        self.tally.as_ref().and_then(Tally::published)
    }

    /// Whether the driver is handling a message right now, so that a
    /// [`ClusterHandle::glance`] asked now would wait for it (a pass over a
    /// large cluster takes a while): a view that would rather not wait
    /// reads [`ClusterHandle::last_glance`] then. `false` for a handle made
    /// from a bare actor ref.
    pub fn busy(&self) -> bool {
        self.tally.as_ref().is_some_and(Tally::is_busy)
    }

    /// The desired state and the shape on record, without the cluster's
    /// state (which [`ClusterHandle::inspect`] copies whole).
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn desired(&self) -> Result<crate::DesiredView, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Desired(r)))
            .await
    }

    /// The current attempt of each of `nodes`, in their order (`None`: the
    /// slot has no node). Costs as much as `nodes` is long.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn attempts(
        &self,
        nodes: Vec<LogicalNodeId>,
    ) -> Result<Vec<Option<NodeAttemptId>>, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Attempts(nodes, r)))
            .await
    }

    /// One node in depth: its current state and last attempts, or `None`
    /// if the cluster never had it (or has forgotten it).
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn describe(
        &self,
        node: LogicalNodeId,
    ) -> Result<Option<NodeDescription>, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Describe(node, r)))
            .await
    }

    /// A copy of the driver's full state, for tests and diagnostics.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn inspect(&self) -> Result<DriverView, ClusterError> {
        self.call(DriverMsg::Inspect).await
    }

    /// Subscribes to the event stream (a snapshot, then every event).
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn subscribe(&self) -> Result<Subscription, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Subscribe(r)))
            .await
    }

    /// Waits until the cluster is converged on its current desired generation.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn converged(&self) -> Result<Generation, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::WaitConverged(r)))
            .await
    }

    /// Waits until the provider's inventory and the journal are adopted, so
    /// that a shape offered next is judged against what really runs.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn adopted(&self) -> Result<(), ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::WaitAdopted(r)))
            .await
    }

    /// Asks whether an agent presenting `key` may join: only the node's
    /// current, active attempt may (a superseded attempt's agent is refused).
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn agent_join(
        &self,
        key: ResourceKey,
    ) -> Result<Result<Liveness, JoinRefused>, ClusterError> {
        self.call(|r| DriverMsg::Swarm(SwarmMsg::Join(key, r)))
            .await
    }

    /// Asserts the joins of agents that are connected and heard, in one
    /// message (what [`Self::agent_join`] does for each); returns those
    /// refused, with why: their attempts are no longer wanted.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn agents_heard(
        &self,
        keys: Vec<ResourceKey>,
    ) -> Result<Vec<(ResourceKey, JoinRefused)>, ClusterError> {
        self.call(|r| DriverMsg::Swarm(SwarmMsg::Heard(keys, r)))
            .await
    }

    /// Whether the agent presenting `key` may hold a link to this cluster
    /// (the join's verdict, without joining): only the node's current,
    /// active attempt may.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn agent_check(
        &self,
        key: ResourceKey,
    ) -> Result<Result<(), JoinRefused>, ClusterError> {
        self.call(|r| DriverMsg::Swarm(SwarmMsg::Check(key, r)))
            .await
    }

    /// Reports that the agent of `key` disconnected, last heard `silent` ago.
    pub fn agent_gone(&self, key: ResourceKey, silent: std::time::Duration) {
        // A cluster that is gone has nothing left to replace.
        let _ = self
            .actor
            .send_message(DriverMsg::Swarm(SwarmMsg::Gone(key, silent)));
    }

    /// Tells the cluster its leadership bound
    /// ([`crate::ClusterConfig::lead`]) moved, so a host that had stopped at
    /// the old one goes on at once.
    pub fn leadership_changed(&self) {
        let _ = self
            .actor
            .send_message(DriverMsg::Cluster(ClusterMsg::Leadership));
    }

    /// Tells the cluster what its rented machines have cost so far, as the
    /// providers count it now (millionths of a dollar); returns the run's
    /// spend, which the journal keeps and which never goes down (see
    /// [`swactor_provisioning::Host::handle_spent`]), with its budget.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn record_spent(
        &self,
        spent_micros: u64,
    ) -> Result<crate::msg::SpentView, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Spent(spent_micros, r)))
            .await
    }

    /// Checks the run's lifetimes at wall-clock `wall_ms` (ms since the
    /// Unix epoch), with a job running or none; the cluster's journal
    /// records what the deadlines count from when that changed (see
    /// [`swactor_provisioning::Host::handle_lifetime`]). The caller tears
    /// the run down when the reply says a deadline has come.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn check_lifetime(
        &self,
        wall_ms: u64,
        jobs_running: bool,
    ) -> Result<crate::msg::LifetimeView, ClusterError> {
        let check = crate::msg::LifetimeCheck {
            wall_ms,
            jobs_running,
        };
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Lifetime(check, r)))
            .await
    }

    /// Pauses reconciling: the cluster goes on folding and showing state,
    /// but dispatches nothing new (no node is created, replaced, scaled away
    /// or advanced) until [`ClusterHandle::resume`]; pending operations
    /// finish, and failed or deleting attempts are still cleaned up. Returns
    /// once the pause is durable (a restarted daemon comes back paused);
    /// `Ok(false)` if it was already paused.
    ///
    /// # Errors
    /// [`ClusterError::Pause`] during a teardown, which overrides a pause;
    /// the cluster is gone.
    pub async fn pause(&self) -> Result<bool, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::Pause(true, r)))
            .await??)
    }

    /// Resumes reconciling after [`ClusterHandle::pause`]; `Ok(false)` if it
    /// was not paused. Returns once the resume is durable.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn resume(&self) -> Result<bool, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::Pause(false, r)))
            .await??)
    }

    /// Replaces `node` on the operator's word: its current attempt fails
    /// with the reason "replaced by the operator" and goes through the
    /// normal cleanup before a new attempt starts. Returns the attempt that
    /// is replaced.
    ///
    /// # Errors
    /// [`ClusterError::Replace`]: an unknown node, one already failed or
    /// leaving, one with an operation in flight, a cluster shutting down;
    /// the cluster is gone.
    pub async fn replace(&self, node: LogicalNodeId) -> Result<NodeAttemptId, ClusterError> {
        Ok(self
            .call(|r| DriverMsg::Cluster(ClusterMsg::Replace(node, r)))
            .await??)
    }

    /// Shuts the cluster down. [`ShutdownMode::Teardown`] returns only when
    /// nothing is left at the provider; [`ShutdownMode::Keep`] returns at once
    /// and leaves every node for a later cluster of the same run to adopt.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn shutdown(&self, mode: ShutdownMode) -> Result<ShutdownReport, ClusterError> {
        self.call(|r| DriverMsg::Cluster(ClusterMsg::Shutdown(mode, r)))
            .await
    }
}
