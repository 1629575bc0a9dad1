//! What the daemons of one run share when they take turns on it
//! (`swactor up --etcd`): where each can be reached, and who leads.
//!
//! A daemon alone on its journal has no other replica: [`Replicas::none`]
//! and an empty [`HaView`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use swactor_actors::HaStatus;
use tokio::sync::watch;

/// The agents' (swarm) addresses of every daemon of the run, this one
/// included, as they change: an agent dials them all, and the one that
/// leads answers. Empty for a daemon alone on its journal (its agents dial
/// their ticket's address).
#[derive(Clone, Debug)]
pub struct Replicas(watch::Receiver<Vec<SocketAddr>>);

impl Replicas {
    /// No other replica.
    #[must_use]
    pub fn none() -> Self {
        Self(watch::channel(Vec::new()).1)
    }

    /// The addresses `rx` holds, as they change.
    #[must_use]
    pub fn new(rx: watch::Receiver<Vec<SocketAddr>>) -> Self {
        Self(rx)
    }

    /// The addresses now.
    #[must_use]
    pub fn current(&self) -> Vec<SocketAddr> {
        self.0.borrow().clone()
    }

    /// A receiver of the addresses, to wait for a change on.
    #[must_use]
    pub fn receiver(&self) -> watch::Receiver<Vec<SocketAddr>> {
        self.0.clone()
    }
}

/// Who leads the run and who stands by, for `status`, the dashboard and
/// `/metrics`; `None` for a daemon alone on its journal.
#[derive(Clone, Debug, Default)]
pub struct HaView(Arc<Mutex<Option<HaStatus>>>);

impl HaView {
    /// What is known now.
    #[must_use]
    pub fn get(&self) -> Option<HaStatus> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces what is known.
    pub fn set(&self, status: Option<HaStatus>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }
}
