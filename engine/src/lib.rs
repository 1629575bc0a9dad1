//! The Swactor engine owns everything that touches time, threads and the
//! network, so that the decision-making crates can stay pure. It provides the
//! clock (virtual under tokio's paused time, so tests jump it at will), a
//! measure of how long the runtime itself left ready work waiting, actor
//! timers whose late firings are filtered by generation, supervision with a
//! restart budget that escalates, a bounded and cancellable pool for blocking
//! calls, a durable journal of intent on redb (fsynced, one writer per file)
//! or in etcd (one fenced transaction per commit),
//! the iroh endpoint with its persisted identity, tickets, per-protocol
//! allowlists and size-limited frames, and the telemetry publisher that streams
//! a snapshot and events to subscribers without ever waiting for them. Policy
//! crates are forbidden by clippy from doing any of this themselves; they take
//! time as an argument and ask the actors, which ask the engine.

pub mod blocking;
pub mod clock;
pub mod deadline;
pub mod etcd;
pub mod flight;
pub mod forward;
pub mod journal;
pub mod lead;
pub mod net;
pub mod starvation;
pub mod stream;
pub mod supervision;
pub mod telemetry;
pub mod timers;

pub use blocking::{
    BlockingCall, BlockingConfig, BlockingError, BlockingPool, BlockingTicket, CancelToken,
};
pub use clock::{Clock, EngineInstant};
pub use deadline::{DeadlinePassed, run_until, yield_to_others};
pub use forward::{Followed, Forwarder, MUX_DRAIN_MAX, Mux};
pub use journal::{Journal, JournalBatch, JournalContents, JournalError};
pub use lead::LeadBound;
pub use starvation::Starvation;
pub use supervision::{ChildEvent, ChildSpec, Children, RestartPolicy, SupervisionError};
pub use timers::{TaskGauge, TimerFired, Timers};

pub use iroh;
pub use ractor;

/// An error with its causes, `outer: cause: root cause`; a cause whose
/// words its effect already says is not repeated.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}
