//! Bootstrap observers: one child actor per session, forwarding its stream to the driver.
//!
//! An observer reads one event at a time (each read is one message to
//! itself, so the actor stays responsive between events), tags it with the
//! node, attempt and session it belongs to, and sends it to the driver. When
//! the stream ends it reports `Closed` and stops; the driver also kills it
//! when the session is cancelled or its node goes away. Nothing of it
//! outlives the session.

use swactor_engine::ractor::{Actor, ActorProcessingErr, ActorRef, DerivedActorRef};
use swactor_providers::BootstrapEvents;
use swactor_provisioning::{
    BootstrapEvent, BootstrapObservation, LogicalNodeId, NodeAttemptId, SessionId,
};

/// What an observer reports: one observation of its session.
#[derive(Debug)]
pub struct Observed(pub BootstrapObservation);

/// Start arguments of an observer.
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
}

/// Read the next event.
pub struct Next;

/// The observer actor.
pub struct BootstrapObserver;

impl Actor for BootstrapObserver {
    type Msg = Next;
    type State = ObserverArgs;
    type Arguments = ObserverArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Next>,
        args: ObserverArgs,
    ) -> Result<ObserverArgs, ActorProcessingErr> {
        myself.send_message(Next)?;
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<Next>,
        _next: Next,
        st: &mut ObserverArgs,
    ) -> Result<(), ActorProcessingErr> {
        let event = st.events.recv().await;
        let ended = event.is_none() || event == Some(BootstrapEvent::Closed);
        let obs = BootstrapObservation {
            node: st.node.clone(),
            attempt: st.attempt,
            session: st.session.clone(),
            event: event.unwrap_or(BootstrapEvent::Closed),
        };
        if st.driver.send_message(Observed(obs)).is_err() || ended {
            myself.stop(None);
            return Ok(());
        }
        myself.send_message(Next)?;
        Ok(())
    }
}
