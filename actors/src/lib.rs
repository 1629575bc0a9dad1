//! The actor system that hosts the reconciler: one driver actor owning the
//! cluster state, with executor workers and bootstrap observers as its children.
//!
//! ```text
//!   (your actor, or none)
//!          │ spawn_linked / Cluster::start
//!          ▼
//!   DriverActor ─────────── sole writer of ClusterState (swactor-provisioning's Driver)
//!     │  one engine timer at poll_timeout(), a safety-net tick
//!     │
//!     ├── executor-0 … executor-N   ExecutorWorker: provider I/O, dedup by operation id,
//!     │                              restarted within a budget (engine Children);
//!     │                              a crash folds its operations as ambiguous
//!     └── observer (one per session) BootstrapObserver: follows a session's stream,
//!                                    killed when the session ends or is cancelled
//! ```
//!
//! Children only send typed messages back; the driver alone decides. This
//! crate is a policy crate: its `clippy.toml` forbids spawning tasks,
//! sleeping and reading clocks, so all timing goes through engine timers and
//! all I/O through the providers.

mod cluster;
mod config;
mod driver;
mod events;
mod executor;
mod journal;
mod msg;
mod observer;
mod supervisor;
mod telemetry;

pub use cluster::{Cluster, ClusterError, ClusterHandle};
pub use config::ClusterConfig;
pub use driver::{DriverActor, DriverState};
pub use events::{AgentLink, ClusterEvent, ClusterSnapshot, NodeSummary, PlanLine, PlanView};
pub use executor::{ExecutorReport, ExecutorWorker, Finished, WorkerArgs, WorkerMsg};
pub use journal::{JournalStore, MemoryJournal};
pub use msg::{
    ClusterMsg, ClusterRef, DriverArgs, DriverMsg, DriverView, Subscription, SwarmMsg, SwarmRef,
    TimerKey,
};
pub use observer::{BootstrapObserver, Next, Observed, ObserverArgs};
pub use supervisor::{ClusterSupervisor, SupervisorArgs, SupervisorExit, SupervisorState};
pub use swactor_provisioning::{ApplyError, JoinRefused, ShutdownMode, ShutdownReport};
