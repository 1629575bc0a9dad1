//! Which peers may use a protocol, and the router that enforces it per ALPN.

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError, RwLock};

use iroh::endpoint::{Accepting, Connection};
use iroh::protocol::{AcceptError, ProtocolHandler, Router};
use iroh::{Endpoint, EndpointId};

use super::codes;

#[derive(Debug)]
enum Rule {
    Open,
    Only(BTreeSet<EndpointId>),
}

/// The peers allowed on one protocol; a shared handle, so changes apply to
/// connections accepted afterwards.
#[derive(Clone, Debug)]
pub struct Allowlist(Arc<RwLock<Rule>>);

impl Allowlist {
    /// Any authenticated peer may connect; for protocols that authenticate
    /// themselves, such as swarm joins presenting a token.
    #[must_use]
    pub fn open() -> Self {
        Self(Arc::new(RwLock::new(Rule::Open)))
    }

    /// Only the given peers may connect.
    #[must_use]
    pub fn only(peers: impl IntoIterator<Item = EndpointId>) -> Self {
        Self(Arc::new(RwLock::new(Rule::Only(
            peers.into_iter().collect(),
        ))))
    }

    /// Nobody may connect until allowed.
    #[must_use]
    pub fn closed() -> Self {
        Self::only([])
    }

    /// Lets `peer` connect. No effect on an open list.
    pub fn allow(&self, peer: EndpointId) {
        if let Rule::Only(peers) = &mut *self.0.write().unwrap_or_else(PoisonError::into_inner) {
            peers.insert(peer);
        }
    }

    /// Stops letting `peer` connect; returns whether it was listed.
    /// Connections already accepted are not affected.
    pub fn revoke(&self, peer: &EndpointId) -> bool {
        match &mut *self.0.write().unwrap_or_else(PoisonError::into_inner) {
            Rule::Only(peers) => peers.remove(peer),
            Rule::Open => false,
        }
    }

    /// Whether `peer` may connect now.
    #[must_use]
    pub fn is_allowed(&self, peer: &EndpointId) -> bool {
        match &*self.0.read().unwrap_or_else(PoisonError::into_inner) {
            Rule::Open => true,
            Rule::Only(peers) => peers.contains(peer),
        }
    }

    /// Whether the list is open to everyone.
    #[must_use]
    pub fn is_open(&self) -> bool {
        matches!(
            &*self.0.read().unwrap_or_else(PoisonError::into_inner),
            Rule::Open
        )
    }
}

/// The peer is not on the allowlist of the protocol it asked for.
#[derive(Debug, thiserror::Error)]
#[error("peer {peer} is not on the allowlist for {alpn}")]
pub struct NotAllowed {
    /// Who tried.
    pub peer: EndpointId,
    /// The protocol, lossily as text.
    pub alpn: String,
}

/// Wraps a handler so only allowlisted peers reach it.
#[derive(Debug)]
struct Guarded<H> {
    alpn: &'static [u8],
    allowlist: Allowlist,
    inner: H,
}

impl<H: ProtocolHandler> ProtocolHandler for Guarded<H> {
    async fn on_accepting(&self, accepting: Accepting) -> Result<Connection, AcceptError> {
        // Finish the handshake here rather than in the inner handler so that
        // no 0-RTT data can reach it before the peer's identity is checked.
        let conn = accepting.await?;
        let peer = conn.remote_id();
        if !self.allowlist.is_allowed(&peer) {
            let error = NotAllowed {
                peer,
                alpn: String::from_utf8_lossy(self.alpn).into_owned(),
            };
            tracing::warn!(%error, "refusing connection");
            conn.close(codes::CLOSE_NOT_ALLOWED, codes::REASON_NOT_ALLOWED);
            return Err(AcceptError::from_err(error));
        }
        Ok(conn)
    }

    async fn accept(&self, connection: Connection) -> Result<(), AcceptError> {
        self.inner.accept(connection).await
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }
}

/// Builds an iroh [`Router`] whose every protocol has an allowlist.
///
/// A peer offering an ALPN that was not registered fails the TLS handshake;
/// a peer not on that ALPN's allowlist is closed with
/// [`codes::CLOSE_NOT_ALLOWED`] before the handler sees it.
#[derive(Debug)]
pub struct GuardedRouterBuilder {
    inner: iroh::protocol::RouterBuilder,
}

impl GuardedRouterBuilder {
    /// Starts a router for `endpoint`.
    #[must_use]
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            inner: Router::builder(endpoint),
        }
    }

    /// Serves `alpn` with `handler` for peers on `allowlist`.
    ///
    /// The handler's own `on_accepting` is bypassed (no 0-RTT), since the
    /// identity check has to happen after the handshake.
    #[must_use]
    pub fn serve<H: ProtocolHandler>(
        self,
        alpn: &'static [u8],
        allowlist: Allowlist,
        handler: H,
    ) -> Self {
        let guarded = Guarded {
            alpn,
            allowlist,
            inner: handler,
        };
        Self {
            inner: self.inner.accept(alpn, guarded),
        }
    }

    /// Starts accepting. Keep the [`Router`]: dropping it stops the accept
    /// loop; call [`Router::shutdown`] for a clean stop (it closes the endpoint).
    #[must_use = "dropping the router stops accepting"]
    pub fn spawn(self) -> Router {
        self.inner.spawn()
    }
}
