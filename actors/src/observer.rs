//! Bootstrap observers: one forwarding task per session, handing its stream to the driver.
//!
//! An observer tags every event of its session's stream with the node,
//! attempt and session it belongs to and sends it to the driver. When the
//! stream ends it reports `Closed` and ends; the driver also stops it (by
//! dropping its [`Forwarder`]) when the session is cancelled or its node goes
//! away. Nothing of it outlives the session.
//!
//! It is a plain task rather than an actor: a cluster may follow a hundred
//! thousand sessions at once, and an actor per session cost several
//! kilobytes and two messages per event.

use swactor_engine::Forwarder;
use swactor_engine::ractor::DerivedActorRef;
use swactor_providers::BootstrapEvents;
use swactor_provisioning::{
    BootstrapEvent, BootstrapObservation, LogicalNodeId, NodeAttemptId, SessionId,
};

/// What an observer reports: one observation of its session, and the
/// observer's number (the driver numbers the observers it starts, so the end
/// of one stream is never taken for the end of a later stream of the same
/// session).
#[derive(Debug)]
pub struct Observed(pub BootstrapObservation, pub u64);

/// What an observer follows and where it reports.
pub struct ObserverArgs {
    /// Where observations go.
    pub driver: DerivedActorRef<Observed>,
    /// The slot.
    pub node: LogicalNodeId,
    /// The attempt the session belongs to.
    pub attempt: NodeAttemptId,
    /// The session.
    pub session: SessionId,
    /// The session's stream.
    pub events: BootstrapEvents,
    /// The observer's number, sent with every observation.
    pub number: u64,
}

/// Starts following a session's stream; dropping the returned handle stops it.
/// Must be called inside a tokio runtime.
pub fn observe(args: ObserverArgs) -> Forwarder {
    let ObserverArgs {
        driver,
        node,
        attempt,
        session,
        events,
        number,
    } = args;
    Forwarder::start(events, move |event| {
        let ended = event.is_none() || event == Some(BootstrapEvent::Closed);
        let obs = BootstrapObservation {
            node: node.clone(),
            attempt,
            session: session.clone(),
            event: event.unwrap_or(BootstrapEvent::Closed),
        };
        // The driver being gone means the cluster is shutting down.
        driver.send_message(Observed(obs, number)).is_ok() && !ended
    })
}
