//! Workspace transfer with `iroh-blobs`: the daemon's blob store, and the
//! provider that agents fetch workspace chunks from.
//!
//! Every 1 MiB chunk of a workspace is one blob (its name is its BLAKE3
//! hash, the same hash the manifest lists). The daemon imports a job's
//! chunks into a file store under `<state dir>/jobs/blobs/` when it accepts
//! the job and holds them for as long as the job is shipping. Agents fetch
//! the chunks they lack from the daemon on [`iroh_blobs::ALPN`], and
//! iroh-blobs verifies every 16 KiB piece against the hash tree as it
//! arrives (see `super::agent`).
//!
//! # Who may fetch what
//! - The protocol is served behind an engine allowlist holding the iroh key
//!   of every agent whose jobs link is up (that key is derived for its
//!   attempt and checked when the link is accepted). Anyone else is refused
//!   before the provider reads a byte.
//! - An admitted connection may fetch only the chunks currently granted to
//!   its key: a run grants its workspace's chunks while it ships and revokes
//!   them when the transfer ends ([`Grant`]). Every other request is refused,
//!   and so is any request for more than a single blob (a chunk read as a
//!   hash sequence would name other blobs).
//! - Pushes and observe requests are refused. The agent serves no listener.

use super::Hash;
use super::service::Workspace;
use anyhow::Context;
use iroh_blobs::api::TempTag;
use iroh_blobs::provider::events::{
    AbortReason, ConnectMode, EventMask, EventSender, ObserveMode, ProviderMessage, RequestMode,
    ThrottleMode,
};
use iroh_blobs::store::GcConfig;
use iroh_blobs::store::fs::FsStore;
use iroh_blobs::store::fs::options::{InlineOptions, Options};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_engine::iroh::EndpointId;
use swactor_engine::net::Allowlist;

/// Provider events waiting for an answer; the provider waits when it is full.
const EVENTS_QUEUED_MAX: usize = 64;

/// How often blobs no job holds any more are deleted.
const GC_INTERVAL: Duration = Duration::from_secs(60);

/// Which chunks each agent key may fetch, and which key each connection is.
#[derive(Debug, Default)]
struct Grants {
    by_peer: BTreeMap<EndpointId, BTreeMap<Hash, usize>>,
    connections: HashMap<u64, EndpointId>,
}

impl Grants {
    fn may_connect(&self, peer: &EndpointId) -> bool {
        self.by_peer.get(peer).is_some_and(|h| !h.is_empty())
    }

    fn may_fetch(&self, connection: u64, hash: &Hash) -> bool {
        self.connections
            .get(&connection)
            .and_then(|peer| self.by_peer.get(peer))
            .is_some_and(|granted| granted.contains_key(hash))
    }
}

/// The daemon's blob store and provider.
#[derive(Debug)]
pub(crate) struct Blobs {
    store: FsStore,
    dir: PathBuf,
    grants: Arc<Mutex<Grants>>,
    events: EventSender,
    /// Who may connect at all: the keys of agents with a jobs link.
    pub(crate) allowlist: Allowlist,
    /// Test hook (debug builds): every imported chunk's data file gets a byte
    /// flipped in the store, after its hash tree was computed.
    tamper: bool,
}

impl Blobs {
    /// Opens (or makes) the store under `dir`, and starts answering the
    /// provider's questions about who may fetch what.
    ///
    /// # Errors
    /// The store cannot be opened.
    pub(crate) async fn open(dir: &Path, tamper: bool) -> anyhow::Result<Self> {
        let mut options = Options::new(dir);
        options.gc = Some(GcConfig {
            interval: GC_INTERVAL,
            add_protected: None,
        });
        if tamper {
            // Small chunks would live inside the store's database, where
            // the hook cannot reach them.
            options.inline = InlineOptions::NO_INLINE;
        }
        let store = FsStore::load_with_opts(dir.join("blobs.db"), options)
            .await
            .with_context(|| format!("cannot open the blob store {}", dir.display()))?;
        let mask = EventMask {
            connected: ConnectMode::Intercept,
            get: RequestMode::Intercept,
            get_many: RequestMode::Intercept,
            push: RequestMode::Disabled,
            observe: ObserveMode::Intercept,
            throttle: ThrottleMode::None,
        };
        let (events, rx) = EventSender::channel(EVENTS_QUEUED_MAX, mask);
        let grants = Arc::new(Mutex::new(Grants::default()));
        tokio::spawn(decide(rx, grants.clone()));
        Ok(Self {
            store,
            dir: dir.to_path_buf(),
            grants,
            events,
            allowlist: Allowlist::closed(),
            tamper,
        })
    }

    /// The protocol handler of [`iroh_blobs::ALPN`] (to be served behind
    /// [`Blobs::allowlist`]).
    pub(crate) fn protocol(&self) -> iroh_blobs::BlobsProtocol {
        iroh_blobs::BlobsProtocol::new(&self.store, Some(self.events.clone()))
    }

    /// Imports every chunk of `ws` into the store; the tags returned keep
    /// them there (dropping them lets the store's collector delete them).
    ///
    /// # Errors
    /// A chunk cannot be read or stored.
    pub(crate) async fn import(&self, ws: &Workspace) -> Result<Vec<TempTag>, String> {
        let mut tags = Vec::with_capacity(ws.order.len());
        for hash in &ws.order {
            let Some((path, offset, len)) = ws.chunks.get(hash) else {
                continue;
            };
            let data = super::runner::read_at(path, *offset, *len)
                .await
                .map_err(|e| format!("cannot read {} of the workspace: {e}", path.display()))?;
            let tag = self
                .store
                .add_bytes(data)
                .temp_tag()
                .await
                .map_err(|e| format!("cannot keep a chunk of the workspace: {e}"))?;
            if tag.hash().as_bytes() != hash {
                return Err(format!(
                    "{} changed while it was read; nothing was shipped",
                    path.display()
                ));
            }
            if self.tamper {
                tamper_with(&self.dir, hash);
            }
            tags.push(tag);
        }
        Ok(tags)
    }

    /// Lets `peer` fetch `hashes` until the returned grant is dropped.
    pub(crate) fn grant(self: &Arc<Self>, peer: EndpointId, hashes: &[Hash]) -> Grant {
        let mut grants = self.grants.lock().unwrap_or_else(PoisonError::into_inner);
        let granted = grants.by_peer.entry(peer).or_default();
        for hash in hashes {
            *granted.entry(*hash).or_default() += 1;
        }
        Grant {
            blobs: self.clone(),
            peer,
            hashes: hashes.to_vec(),
        }
    }
}

/// Chunks one agent key may fetch; revoked when dropped.
#[derive(Debug)]
pub(crate) struct Grant {
    blobs: Arc<Blobs>,
    peer: EndpointId,
    hashes: Vec<Hash>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut grants = self
            .blobs
            .grants
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(granted) = grants.by_peer.get_mut(&self.peer) {
            for hash in &self.hashes {
                if let Some(n) = granted.get_mut(hash) {
                    *n -= 1;
                    if *n == 0 {
                        granted.remove(hash);
                    }
                }
            }
            if granted.is_empty() {
                grants.by_peer.remove(&self.peer);
            }
        }
    }
}

/// Flips a byte of `hash`'s data file in the store (test hook).
fn tamper_with(dir: &Path, hash: &Hash) {
    let path = dir.join("data").join(format!("{}.data", super::hex(hash)));
    match std::fs::read(&path) {
        Ok(mut data) if !data.is_empty() => {
            data[0] ^= 0xff;
            let _ = std::fs::write(&path, data);
        }
        _ => tracing::warn!(path = %path.display(), "SWACTOR_FAULT_TAMPER_BLOBS: no data file"),
    }
}

/// Answers the provider: who may connect, and which requests it may serve.
async fn decide(mut rx: tokio::sync::mpsc::Receiver<ProviderMessage>, grants: Arc<Mutex<Grants>>) {
    let verdict = |ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(AbortReason::Permission)
        }
    };
    while let Some(msg) = rx.recv().await {
        let lock = || grants.lock().unwrap_or_else(PoisonError::into_inner);
        match msg {
            ProviderMessage::ClientConnected(m) => {
                let ok = {
                    let mut g = lock();
                    match m.inner.endpoint_id {
                        Some(peer) if g.may_connect(&peer) => {
                            g.connections.insert(m.inner.connection_id, peer);
                            true
                        }
                        _ => false,
                    }
                };
                let _ = m.tx.send(verdict(ok)).await;
            }
            ProviderMessage::ConnectionClosed(m) => {
                lock().connections.remove(&m.inner.connection_id);
            }
            ProviderMessage::GetRequestReceived(m) => {
                let req = &m.inner.request;
                let ok = req.ranges.is_blob()
                    && lock().may_fetch(m.inner.connection_id, req.hash.as_bytes());
                if !ok {
                    tracing::warn!(hash = %req.hash, "a blob request was refused");
                }
                let _ = m.tx.send(verdict(ok)).await;
            }
            ProviderMessage::GetManyRequestReceived(m) => {
                let ok = {
                    let g = lock();
                    m.inner
                        .request
                        .hashes
                        .iter()
                        .all(|h| g.may_fetch(m.inner.connection_id, h.as_bytes()))
                };
                let _ = m.tx.send(verdict(ok)).await;
            }
            ProviderMessage::PushRequestReceived(m) => {
                let _ = m.tx.send(verdict(false)).await;
            }
            ProviderMessage::ObserveRequestReceived(m) => {
                let _ = m.tx.send(verdict(false)).await;
            }
            // Notifications (not asked for) need no answer.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iroh_blobs::get::request::get_blob;
    use swactor_engine::iroh::SecretKey;
    use swactor_engine::net::{GuardedRouterBuilder, NetConfig, bind_endpoint, connect};

    async fn endpoint() -> swactor_engine::iroh::Endpoint {
        bind_endpoint(&NetConfig::default(), SecretKey::generate())
            .await
            .unwrap()
    }

    /// Real iroh endpoints on loopback, the daemon's real store and router.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_a_linked_key_fetches_and_only_the_chunks_granted_to_it_while_granted() {
        let tmp = tempfile::tempdir().unwrap();
        let blobs = Arc::new(Blobs::open(tmp.path(), false).await.unwrap());
        let first = blobs
            .store
            .add_bytes(&b"first chunk"[..])
            .temp_tag()
            .await
            .unwrap();
        let second = blobs
            .store
            .add_bytes(&b"second chunk"[..])
            .temp_tag()
            .await
            .unwrap();
        let daemon = endpoint().await;
        let _router = GuardedRouterBuilder::new(daemon.clone())
            .serve(iroh_blobs::ALPN, blobs.allowlist.clone(), blobs.protocol())
            .spawn();
        let (agent, stranger) = (endpoint().await, endpoint().await);
        let wait = Duration::from_secs(5);
        // As when the agent's jobs link is accepted, and its run ships.
        blobs.allowlist.allow(agent.id());
        let grant = blobs.grant(agent.id(), &[*first.hash().as_bytes()]);

        let conn = connect(&agent, daemon.addr(), iroh_blobs::ALPN, wait)
            .await
            .unwrap();
        let got = get_blob(conn.clone(), first.hash()).bytes().await.unwrap();
        assert_eq!(&got[..], b"first chunk");
        // A chunk not granted to it is refused.
        assert!(get_blob(conn.clone(), second.hash()).bytes().await.is_err());
        // A key without a jobs link is turned away before the provider.
        if let Ok(c) = connect(&stranger, daemon.addr(), iroh_blobs::ALPN, wait).await {
            assert!(get_blob(c, first.hash()).bytes().await.is_err());
        }
        // Once the transfer is over, not even the granted chunk.
        drop(grant);
        assert!(get_blob(conn.clone(), first.hash()).bytes().await.is_err());
        let again = connect(&agent, daemon.addr(), iroh_blobs::ALPN, wait).await;
        if let Ok(c) = again {
            assert!(get_blob(c, first.hash()).bytes().await.is_err());
        }
    }

    /// Issue 29, item 4: a fetch refused over a cap was reported as
    /// `its bytes do not match their BLAKE3 hash (io: connection lost)`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fetch_refused_over_a_cap_says_so_and_no_hash_mismatch() {
        let tmp = tempfile::tempdir().unwrap();
        let blobs = Arc::new(Blobs::open(tmp.path(), false).await.unwrap());
        let chunk = blobs
            .store
            .add_bytes(&b"a chunk"[..])
            .temp_tag()
            .await
            .unwrap();
        let daemon = endpoint().await;
        let one = swactor_engine::net::Limits {
            connections_max: 1,
            connections_per_peer_max: 1,
            ..swactor_engine::net::Limits::LINKED
        };
        let _router = GuardedRouterBuilder::new(daemon.clone())
            .serve_with_limits(
                iroh_blobs::ALPN,
                blobs.allowlist.clone(),
                one,
                blobs.protocol(),
            )
            .spawn();
        let agent = endpoint().await;
        let wait = Duration::from_secs(5);
        blobs.allowlist.allow(agent.id());
        let _grant = blobs.grant(agent.id(), &[*chunk.hash().as_bytes()]);
        let first = connect(&agent, daemon.addr(), iroh_blobs::ALPN, wait)
            .await
            .unwrap();
        assert_eq!(
            &get_blob(first.clone(), chunk.hash()).bytes().await.unwrap()[..],
            b"a chunk"
        );
        // The first connection holds the only slot: the second is refused.
        let second = connect(&agent, daemon.addr(), iroh_blobs::ALPN, wait)
            .await
            .unwrap();
        let e = get_blob(second.clone(), chunk.hash())
            .bytes()
            .await
            .unwrap_err();
        let _ = tokio::time::timeout(wait, second.closed()).await;
        let said = crate::jobs::agent::fetch_failed(
            &second,
            "worker-0",
            chunk.hash().as_bytes(),
            false,
            e.iroh_error_code().map(u64::from),
            &e.to_string(),
        );
        assert!(
            said.contains("refused") && !said.contains("BLAKE3"),
            "{said}"
        );
    }

    #[test]
    fn a_key_may_fetch_only_what_it_was_granted_while_it_is() {
        let peer = swactor_engine::iroh::SecretKey::from_bytes(&[7; 32]).public();
        let other = swactor_engine::iroh::SecretKey::from_bytes(&[8; 32]).public();
        let mut g = Grants::default();
        g.by_peer.entry(peer).or_default().insert([1; 32], 1);
        assert!(g.may_connect(&peer) && !g.may_connect(&other));
        g.connections.insert(5, peer);
        g.connections.insert(6, other);
        assert!(g.may_fetch(5, &[1; 32]));
        assert!(!g.may_fetch(5, &[2; 32]));
        assert!(!g.may_fetch(6, &[1; 32]));
        assert!(!g.may_fetch(7, &[1; 32]));
    }
}
