//! The reconciler's conformance kit: a fake provider, a trace harness and an invariant oracle.
//!
//! ```text
//!   trace (proptest) ──► World ──► Reconciler (Driver, or a wrapper)
//!                          │   ◄── passes / dispatches
//!                          ▼
//!                     FakeExecutor ──► FakeBackend (leases, endpoints, sessions)
//!                          │   ◄── results, bootstrap observations (delayed, lost, duplicated)
//!                          ▼
//!                        Oracle  (observe each step, check each step, on quiescence, at the end)
//! ```
//!
//! - [`FakeBackend`] is a deterministic in-memory provider with fault
//!   injection, independent of the harness (a `fake` provider crate can wrap it).
//! - [`FakeExecutor`] runs dispatches against it with the executor contract
//!   (dedup by operation id, one operation per attempt at a time) and an
//!   unreliable way back (lost, ambiguous, late, delayed, duplicated results).
//! - [`World`] steps a [`Reconciler`] and the executor in virtual time, feeding
//!   every step to the [`Oracle`], whose [`Invariant`]s name the guarantees.
//! - [`lease`] holds every joined agent's lease as the daemon renews it; an
//!   agent whose lease lapses ends its node, and a restarted host is held to
//!   what it owes the nodes it finds.
//! - [`trace`] generates inputs; [`battery`] runs seeded, shrinking batteries.
//! - [`recording`] takes a flight recording of one host life (the daemon's,
//!   or a world's: [`WorldConfig::record`]) as a regression case: replayed
//!   over a fresh host, every answer must match and the oracle judges it.
//!
//! See `README.md` beside this crate for the fault model, the fair-tail bound,
//! environment variables and the known gaps of the core.

mod backend;
pub mod battery;
mod digest;
mod executor;
pub mod lease;
mod oracle;
pub mod recording;
mod rng;
pub mod trace;
mod world;

pub use backend::{
    BackendConfig, BackendCounters, FakeBackend, KeyStats, Keys, LeaseGrant, LeaseInfo, Leases,
    LiveResource, Origin, PollEvents, ProviderError, ProviderFault, SessionEvent, SessionGrant,
    SessionInfo, Sessions,
};
pub use digest::Digest;
pub use executor::{
    ArmedDelivery, DeliveryFault, ExecutorConfig, ExecutorStats, FakeExecutor, Output, Submitted,
};
pub use lease::{AgentLeases, LeaseStats, Renewals};
pub use oracle::{
    Invariant, Oracle, ProviderView, Snapshot, StepEvent, Violation, backoff_window,
    earliest_waiting_deadline, independently_converged,
};
pub use rng::SimRng;
pub use trace::{Input, Mode, Trace};
pub use world::{
    BOOT_TIMEOUT_MS, Factory, GRACE_MS, GROUPS, LEADERSHIP_LEASE_MS, LEADERSHIP_MARGIN_MS,
    RECORDING_EPOCH_MS, RUN, Reconciler, RunReport, SHORT_LEASE_S, SWEEP_MS, TailBound, TailReport,
    World, WorldConfig, budget_policy, groups_of, host_config, policies_of, run_trace,
    run_trace_with, shape_of, shape_with,
};
