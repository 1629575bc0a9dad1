//! Bootstrap observers: one engine mux follows every session's stream and
//! hands the driver what they report, in batches.
//!
//! The driver follows each session under a small tag (the node and the
//! observer's number; the driver's own table holds the attempt and the
//! session); the mux hands over every event with that tag, and a stream that
//! ends as `Closed`. All that is ready
//! when the mux wakes goes to the driver in ONE message, so a hundred
//! thousand sessions reporting the same step cost one message, not a
//! hundred thousand. Dropping a session's [`Followed`] handle stops
//! following it; nothing of a session outlives it.

use swactor_engine::ractor::DerivedActorRef;
use swactor_engine::{Followed, Mux};
use swactor_provisioning::{BootstrapEvent, LogicalNodeId};

/// One event of a followed session, and the number of the observer that
/// followed it (the driver numbers the sessions it follows, so the end of
/// one stream is never taken for the end of a later stream of the same
/// session, and what a stopped observer had already read is told apart).
#[derive(Debug)]
pub struct Observed {
    /// The slot.
    pub node: LogicalNodeId,
    /// The observer's number.
    pub observer: u64,
    /// What the session reported (`Closed` when its stream ended).
    pub event: BootstrapEvent,
}

/// What the mux sends the driver: every observation it had, in order per session.
#[derive(Debug)]
pub struct Observations(pub Vec<Observed>);

/// What a followed stream is tagged with: 24 bytes, kept once per followed
/// session and copied into every event handed over.
#[derive(Clone, Copy, Debug)]
pub struct ObserverTag {
    /// The slot.
    pub node: LogicalNodeId,
    /// The observer's number, sent with every event.
    pub number: u64,
}

/// The mux that follows a driver's sessions.
pub type Observers = Mux<ObserverTag, BootstrapEvent>;

/// A followed session; dropping it stops following.
pub type Observer = Followed<ObserverTag, BootstrapEvent>;

/// Starts the mux that reports to `driver`. Must be called inside a tokio runtime.
pub fn observers(driver: DerivedActorRef<Observations>) -> Observers {
    // A stream's `Closed` is its last word, as its end is.
    let last = |e: &BootstrapEvent| *e == BootstrapEvent::Closed;
    Mux::start(
        last,
        move |batch: Vec<(ObserverTag, Option<BootstrapEvent>)>| {
            let observed = batch
                .into_iter()
                .map(|(tag, event)| Observed {
                    node: tag.node,
                    observer: tag.number,
                    event: event.unwrap_or(BootstrapEvent::Closed),
                })
                .collect();
            // The driver being gone means the cluster is shutting down.
            driver.send_message(Observations(observed)).is_ok()
        },
    )
}
