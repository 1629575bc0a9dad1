//! The actor system that hosts the reconciler: a cluster actor that owns the
//! cluster host (`swactor_provisioning::Host`), with executor workers and
//! bootstrap observers as its children, optionally under a supervisor that
//! restarts it from its journal.
//!
//! ```text
//!   your actor (or none)
//!     │ spawn_linked: Cluster::supervised / Cluster::spawn
//!     ▼
//!   ClusterSupervisor ── restarts the cluster actor from the journal within a budget;
//!     │                  forwards every message, so handles survive restarts
//!     ▼
//!   DriverActor ────────── hosts the Host: the sole writer of ClusterState; routes its
//!     │  outputs (journal writes, dispatches, replies); one engine timer
//!     ├── executor-0 … executor-N   ExecutorWorker: provider I/O, dedup by operation id,
//!     │                              restarted within a budget; a crash folds its
//!     │                              operations as ambiguous (the host decides)
//!     └── observers (one task)       an engine mux that follows every session's
//!                                    stream and reports them in batches
//! ```
//!
//! Other actors talk to a cluster through a [`ClusterRef`], a typed ref
//! limited to the public [`ClusterMsg`]s (apply, plan, snapshot, subscribe,
//! wait for convergence, shut down); a swarm endpoint reports agents through
//! a [`SwarmRef`]. Results, observations, timers and the rest are internal.
//!
//! # Embedding
//! A host actor spawns the cluster linked to itself and hands out refs:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use swactor_actors::*;
//! # use swactor_engine::ractor::{Actor, ActorProcessingErr, ActorRef};
//! # use swactor_providers::fake::FakeProvider;
//! # use swactor_provisioning::RunId;
//! struct App;
//! impl Actor for App {
//!     type Msg = ();
//!     type State = ClusterHandle;
//!     type Arguments = ();
//!     async fn pre_start(&self, me: ActorRef<()>, _: ()) -> Result<ClusterHandle, ActorProcessingErr> {
//!         let run = RunId::new("embedded");
//!         let args = SupervisorArgs {
//!             config: ClusterConfig::new(run.clone()),
//!             provider: Arc::new(FakeProvider::new(Default::default(), Default::default())),
//!             publisher: None,
//!             journal: Arc::new(MemoryJournal::new(run)),
//!             restarts: Default::default(),
//!             on_exit: None,
//!         };
//!         // Linked to the app: if the cluster gives up, the app is told.
//!         let cluster = Cluster::supervised(args, Some(me.get_cell())).await?;
//!         let for_siblings: ClusterRef = cluster.cluster_ref(); // public messages only
//!         # let _ = for_siblings;
//!         Ok(cluster)
//!     }
//! }
//! ```
//!
//! `examples/cluster.rs` is the whole story: a sibling actor applies shapes
//! through its [`ClusterRef`] and a subscriber follows the telemetry over
//! iroh. Children only send typed messages back; the host alone decides.
//! This crate is a policy crate: its `clippy.toml` forbids spawning tasks,
//! sleeping and reading clocks, so all timing goes through engine timers and
//! all I/O through the providers.

mod cluster;
mod config;
mod driver;
mod events;
mod executor;
mod flight;
pub mod glance;
mod journal;
mod msg;
mod observer;
mod supervisor;
mod telemetry;

pub use cluster::{Cluster, ClusterError, ClusterHandle};
pub use config::ClusterConfig;
pub use driver::{DriverActor, DriverState};
pub use events::{
    AgentLink, ClusterEvent, ClusterSnapshot, HaStatus, NodeDescription, NodeSummary, PlanLine,
    PlanView, Rental,
};
pub use executor::{ExecutorReport, ExecutorWorker, Finished, WorkerArgs, WorkerMsg};
pub use flight::{FlightFrames, FlightRecorder};
pub use glance::{ClusterGlance, GroupCounts, GroupGlance};
pub use journal::{CommitError, JournalStore, MemoryJournal};
pub use msg::{
    ClusterMsg, ClusterRef, DesiredView, DriverArgs, DriverMsg, DriverView, LifetimeCheck,
    LifetimeView, SpentView, Subscription, SwarmMsg, SwarmRef, TimerKey,
};
pub use observer::{Observations, Observed, Observer, ObserverTag, Observers, observers};
pub use supervisor::{ClusterSupervisor, SupervisorArgs, SupervisorExit, SupervisorState};
pub use swactor_provisioning::{ApplyError, JoinRefused, ShutdownMode, ShutdownReport};
pub use telemetry::EVENT_LOG_TARGET;
