//! A supervisor that keeps a cluster running: it restarts a failed cluster
//! actor from its journal and the provider's inventory, within a budget.
//!
//! ```text
//!   ClusterSupervisor ── forwards every public message to the current cluster actor
//!     └── DriverActor (restarted from the journal on failure; past the budget the
//!                      supervisor gives up and says so; the nodes keep running)
//! ```
//!
//! The supervisor's ref takes the same messages as the cluster actor's, so a
//! [`ClusterHandle`](crate::ClusterHandle) (and any [`ClusterRef`](crate::ClusterRef))
//! made from it keeps working across restarts. A message that reached a
//! cluster actor just before it failed gets no answer (its reply port is
//! dropped, which the caller sees as "not running"); the next one reaches
//! the new actor.
//!
//! # Guarantees
//! A restarted cluster actor never double-creates: it resumes from what its
//! journal made durable and adopts what the provider lists, exactly like a
//! daemon restarted after `kill -9`. Telemetry subscribers stay connected:
//! the publisher belongs to the supervisor, not to the actor that failed.

use crate::config::ClusterConfig;
use crate::driver::DriverActor;
use crate::events::{ClusterEvent, ClusterSnapshot};
use crate::journal::JournalStore;
use crate::msg::{DriverArgs, DriverMsg};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use swactor_engine::ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_engine::{ChildEvent, ChildSpec, Children, RestartPolicy};
use swactor_providers::Provider;
use tokio::sync::oneshot;

/// Start arguments of a [`ClusterSupervisor`].
pub struct SupervisorArgs {
    /// Settings of the cluster (its `initial_shape` is offered on the first start only).
    pub config: ClusterConfig,
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Publishes to remote subscribers, across restarts.
    pub publisher: Option<Arc<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>>,
    /// The journal every start resumes from.
    pub journal: Arc<dyn JournalStore>,
    /// How many failures of the cluster actor are restarted, within which window.
    pub restarts: RestartPolicy,
    /// Told once how the supervised cluster ended.
    pub on_exit: Option<oneshot::Sender<SupervisorExit>>,
}

/// How a supervised cluster ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SupervisorExit {
    /// The cluster shut down (keep or teardown).
    Stopped,
    /// The cluster actor failed more often than the budget allows; the
    /// supervisor stopped and every node was left as it was.
    GaveUp {
        /// What the supervision reported.
        reason: String,
    },
}

/// The supervisor actor.
pub struct ClusterSupervisor;

/// Its state.
pub struct SupervisorState {
    children: Children,
    on_exit: Option<oneshot::Sender<SupervisorExit>>,
}

const CLUSTER: &str = "cluster";

impl Actor for ClusterSupervisor {
    type Msg = DriverMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<DriverMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let SupervisorArgs {
            mut config,
            provider,
            publisher,
            journal,
            restarts,
            on_exit,
        } = args;
        // One tally for every cluster actor this supervisor starts, so what
        // it counts since the supervisor started survives a restart.
        // (`Cluster::supervised` gave it one its handle shares.)
        config.tally.get_or_insert_with(Default::default);
        let first = AtomicBool::new(true);
        let factory = move || {
            let mut config = config.clone();
            if !first.swap(false, Ordering::SeqCst) {
                // After a restart the journal says what is desired.
                config.initial_shape = None;
            }
            let args = DriverArgs {
                config,
                provider: provider.clone(),
                publisher: publisher.clone(),
                journal: Some(journal.clone()),
                resume: journal.image(),
            };
            (DriverActor, args)
        };
        let mut children = Children::new();
        children
            .start(
                &myself.get_cell(),
                ChildSpec::new(CLUSTER, restarts, factory),
            )
            .await?;
        Ok(SupervisorState { children, on_exit })
    }

    async fn handle(
        &self,
        _myself: ActorRef<DriverMsg>,
        msg: DriverMsg,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        // A cluster that is gone drops the message, and with it the reply port.
        if let Some(cluster) = st.children.get::<DriverMsg>(CLUSTER) {
            let _ = cluster.send_message(msg);
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DriverMsg>,
        evt: SupervisionEvent,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match st.children.handle_event(&myself.get_cell(), &evt).await {
            Ok(ChildEvent::Restarted { failures, .. }) => {
                tracing::warn!(
                    failures,
                    "the cluster actor failed; restarted it from its journal"
                );
            }
            Ok(ChildEvent::Stopped { .. }) => {
                if let Some(tx) = st.on_exit.take() {
                    let _ = tx.send(SupervisorExit::Stopped);
                }
                myself.stop(Some("the cluster stopped".to_owned()));
            }
            Ok(_) => {}
            Err(e) => {
                let reason = e.to_string();
                tracing::error!(%reason, "the cluster actor keeps failing; giving up");
                if let Some(tx) = st.on_exit.take() {
                    let _ = tx.send(SupervisorExit::GaveUp { reason });
                }
                myself.stop(Some("restart budget spent".to_owned()));
            }
        }
        Ok(())
    }
}
