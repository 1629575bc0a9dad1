//! The provider of `swactor bench swarm`'s daemon: a lease is a simulated
//! agent that the bench process runs.
//!
//! The daemon runs in a child process of the bench, so its processor time
//! and memory are its own; this provider, inside that daemon, tells the
//! bench over a Unix socket which agents to start and stop (one JSON line
//! each), and hears back from it when one joined or ended. An agent's
//! credentials are derived here, as every provider derives them, and go to
//! the bench over that socket (a file only this user can open, in a
//! directory of its own). Keyed on (run, node, attempt) like every
//! provider: a create or a start for a key it holds adopts what it holds,
//! and stopping what is gone succeeds.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use swactor_engine::stream;
use swactor_providers::credentials::AgentCredentials;
use swactor_providers::{
    BootstrapSession, FaultKind, Inventory, LeaseGrant, OwnedResources, Provider, ProviderError,
    Release, async_trait,
};
use swactor_provisioning::{
    BootstrapEvent, BootstrapStage, LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId,
    SessionId,
};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::UnixStream;

/// The provider kind the bench's shape names.
pub(crate) const KIND: &str = "sim";

/// What the daemon's provider tells the bench.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToBench {
    /// A lease was made for `key` (not an adoption).
    Created { key: ResourceKey },
    /// Start `key`'s agent with these credentials (hex).
    Start {
        key: ResourceKey,
        ticket: String,
        token: String,
        secret: String,
    },
    /// Stop `key`'s agent, if it runs.
    Stop { key: ResourceKey },
}

/// What the bench tells the daemon's provider.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToDaemon {
    /// `key`'s agent joined the daemon (what a real agent prints on stdout).
    Joined { key: ResourceKey },
    /// `key`'s agent ended by itself, for `reason`.
    Ended { key: ResourceKey, reason: String },
}

/// Events a session's stream holds before the daemon reads them.
const STREAM_LEN: usize = 8;

/// What the provider holds for one key.
#[derive(Debug)]
struct Held {
    lease: LeaseId,
    session: Option<SessionId>,
    stream: Option<stream::Sender<BootstrapEvent>>,
    joined: bool,
}

#[derive(Debug, Default)]
struct Model {
    keys: HashMap<ResourceKey, Held>,
    next: u64,
}

/// The simulated provider (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct SimProvider {
    model: Arc<Mutex<Model>>,
    to_bench: tokio::sync::mpsc::UnboundedSender<ToBench>,
    ticket: String,
    token_secret: [u8; 32],
}

impl SimProvider {
    /// A provider talking to the bench on `socket`; starts its reader and
    /// writer.
    pub(crate) fn start(socket: UnixStream, ticket: String, token_secret: [u8; 32]) -> Self {
        let (read, write) = socket.into_split();
        let to_bench = json_lines(
            write,
            "the bench's socket closed; its agents are out of reach",
        );
        let provider = Self {
            model: Arc::default(),
            to_bench,
            ticket,
            token_secret,
        };
        let heard = provider.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<ToDaemon>(&line) {
                    Ok(msg) => heard.heard(msg),
                    Err(e) => tracing::error!(%e, "the bench sent a line this daemon cannot read"),
                }
            }
        });
        provider
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn send(&self, msg: ToBench) -> Result<(), ProviderError> {
        self.to_bench.send(msg).map_err(|_| {
            ProviderError::ambiguous(FaultKind::Unreachable, "the bench's socket is closed")
        })
    }

    /// What the bench said of an agent: its session's stream reports it.
    fn heard(&self, msg: ToDaemon) {
        let mut model = self.lock();
        match msg {
            ToDaemon::Joined { key } => {
                if let Some(held) = model.keys.get_mut(&key) {
                    held.joined = true;
                    if let Some(tx) = &held.stream {
                        let _ = tx.try_send(BootstrapEvent::SwactorJoined);
                        let _ = tx.try_send(BootstrapEvent::Stage(BootstrapStage::Converged));
                    }
                }
            }
            ToDaemon::Ended { key, reason } => {
                if let Some(held) = model.keys.get_mut(&key) {
                    let stage = if held.joined {
                        BootstrapStage::AgentLost
                    } else {
                        BootstrapStage::JoinFailed
                    };
                    if let Some(tx) = held.stream.take() {
                        let _ = tx.try_send(BootstrapEvent::Failed { stage, reason });
                    }
                    held.session = None;
                    held.joined = false;
                }
            }
        }
    }

    /// A fresh stream for a session, restating what it reported so far.
    fn stream_for(held: &mut Held) -> stream::Receiver<BootstrapEvent> {
        let (tx, rx) = stream::channel(STREAM_LEN);
        let _ = tx.try_send(BootstrapEvent::Stage(BootstrapStage::SwactorStart));
        let _ = tx.try_send(BootstrapEvent::Stage(BootstrapStage::Join));
        if held.joined {
            let _ = tx.try_send(BootstrapEvent::SwactorJoined);
            let _ = tx.try_send(BootstrapEvent::Stage(BootstrapStage::Converged));
        }
        // Replacing the sender ends an older reader's stream.
        held.stream = Some(tx);
        rx
    }
}

fn not_held(key: &ResourceKey, lease: &LeaseId) -> ProviderError {
    ProviderError::gone(
        FaultKind::Deleted,
        format!("lease {lease} of {key} does not exist"),
    )
}

#[async_trait]
impl Provider for SimProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        _template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let mut model = self.lock();
        if let Some(held) = model.keys.get(key) {
            return Ok(LeaseGrant {
                lease: held.lease.clone(),
                endpoint: None,
            });
        }
        model.next += 1;
        let lease = LeaseId::from(format!("sim-{}", model.next));
        model.keys.insert(
            key.clone(),
            Held {
                lease: lease.clone(),
                session: None,
                stream: None,
                joined: false,
            },
        );
        drop(model);
        self.send(ToBench::Created { key: key.clone() })?;
        Ok(LeaseGrant {
            lease,
            endpoint: None,
        })
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        match self.lock().keys.get(key) {
            Some(held) if held.lease == *lease => Ok(NodeEndpoint::from(format!("sim:{lease}"))),
            _ => Err(not_held(key, lease)),
        }
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        _endpoint: &NodeEndpoint,
        _template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let mut model = self.lock();
        model.next += 1;
        let fresh = SessionId::from(format!("sim-s{}", model.next));
        let Some(held) = model.keys.get_mut(key).filter(|h| h.lease == *lease) else {
            return Err(not_held(key, lease));
        };
        if let Some(session) = held.session.clone() {
            return Ok(BootstrapSession {
                session,
                events: Self::stream_for(held),
            });
        }
        held.session = Some(fresh.clone());
        held.joined = false;
        let events = Self::stream_for(held);
        drop(model);
        let credentials = AgentCredentials::derive(&self.token_secret, key);
        self.send(ToBench::Start {
            key: key.clone(),
            ticket: self.ticket.clone(),
            token: credentials.token.clone(),
            secret: hex(&credentials.secret_key),
        })?;
        Ok(BootstrapSession {
            session: fresh,
            events,
        })
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let mut model = self.lock();
        let Some(held) = model
            .keys
            .get_mut(key)
            .filter(|h| h.session.as_ref() == Some(session))
        else {
            return Ok(Release::Done);
        };
        held.session = None;
        held.stream = None;
        held.joined = false;
        drop(model);
        self.send(ToBench::Stop { key: key.clone() })?;
        Ok(Release::Done)
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let mut model = self.lock();
        if model.keys.get(key).is_none_or(|h| h.lease != *lease) {
            return Ok(Release::Done);
        }
        model.keys.remove(key);
        drop(model);
        self.send(ToBench::Stop { key: key.clone() })?;
        Ok(Release::Done)
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        Ok(self
            .lock()
            .keys
            .iter()
            .filter(|(key, _)| key.run_id == *run_id)
            .map(|(key, held)| {
                (
                    key.clone(),
                    OwnedResources {
                        lease: Some(held.lease.clone()),
                        session: held.session.clone(),
                    },
                )
            })
            .collect())
    }
}

/// A sender whose every message goes out on `write` as one JSON line, in
/// order, until the other end closes (said once, as `closed`).
pub(crate) fn json_lines<T: Serialize + Send + 'static>(
    mut write: tokio::net::unix::OwnedWriteHalf,
    closed: &'static str,
) -> tokio::sync::mpsc::UnboundedSender<T> {
    let (tx, mut outbox) = tokio::sync::mpsc::unbounded_channel::<T>();
    tokio::spawn(async move {
        let mut line = Vec::new();
        while let Some(msg) = outbox.recv().await {
            line.clear();
            // Only plain data: it serializes.
            let _ = serde_json::to_writer(&mut line, &msg);
            line.push(b'\n');
            if write.write_all(&line).await.is_err() {
                tracing::error!("{closed}");
                return;
            }
        }
    });
    tx
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The bytes of a 64-digit hex key.
pub(crate) fn unhex32(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if text.len() != 64 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId};

    fn key(attempt: u64) -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("bench"),
            node: LogicalNodeId::parse("sim-0").unwrap(),
            attempt: NodeAttemptId(attempt),
        }
    }

    fn template() -> NodeTemplate {
        NodeTemplate {
            provider: swactor_provisioning::ProviderShape {
                kind: KIND.to_owned(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: swactor_provisioning::BootParams::default(),
            role: "worker".to_owned(),
            join: swactor_provisioning::SwarmJoin::default(),
            limits: Default::default(),
        }
    }

    #[test]
    fn a_key_goes_to_hex_and_back() {
        let bytes: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        assert_eq!(unhex32(&hex(&bytes)), Some(bytes));
        assert_eq!(unhex32("00"), None);
        assert_eq!(unhex32(&"zz".repeat(32)), None);
    }

    /// The provider's rules over its socket: a create adopts, a start
    /// sends the bench the attempt's own credentials and its stream says
    /// what the bench heard, and stopping what is gone succeeds.
    #[tokio::test]
    async fn leases_adopt_agents_start_with_their_credentials_and_absent_is_success() {
        let (ours, bench) = UnixStream::pair().unwrap();
        let secret = [7u8; 32];
        let p = SimProvider::start(ours, "ticket".to_owned(), secret);
        let (read, write) = bench.into_split();
        let mut heard = BufReader::new(read).lines();
        let tell = json_lines::<ToDaemon>(write, "closed");
        let mut next = async || -> ToBench {
            serde_json::from_str(&heard.next_line().await.unwrap().unwrap()).unwrap()
        };

        let k = key(1);
        let first = p.create_lease(&k, &template()).await.unwrap();
        assert!(matches!(next().await, ToBench::Created { key } if key == k));
        // Asked again for the same key: the same lease, nothing new made.
        assert_eq!(p.create_lease(&k, &template()).await.unwrap(), first);
        let endpoint = p.lookup_endpoint(&k, &first.lease).await.unwrap();
        let mut session = p
            .start_bootstrap(&k, &first.lease, &endpoint, &template())
            .await
            .unwrap();
        let ToBench::Start {
            key: started,
            token,
            secret: sent,
            ..
        } = next().await
        else {
            panic!("no start");
        };
        let expected = AgentCredentials::derive(&secret, &k);
        assert_eq!(started, k);
        assert_eq!((token, sent), (expected.token, hex(&expected.secret_key)));
        assert_eq!(
            session.events.recv().await,
            Some(BootstrapEvent::Stage(BootstrapStage::SwactorStart))
        );
        assert_eq!(
            session.events.recv().await,
            Some(BootstrapEvent::Stage(BootstrapStage::Join))
        );
        tell.send(ToDaemon::Joined { key: k.clone() }).unwrap();
        assert_eq!(
            session.events.recv().await,
            Some(BootstrapEvent::SwactorJoined)
        );
        let listed = p.list(&k.run_id).await.unwrap();
        assert_eq!(listed[&k].session.as_ref(), Some(&session.session));

        // A lease of another key is not this one's; gone leases are gone.
        let other = key(2);
        assert!(matches!(
            p.lookup_endpoint(&other, &first.lease).await,
            Err(ProviderError::Gone(_))
        ));
        assert_eq!(
            p.destroy_lease(&k, &first.lease).await.unwrap(),
            Release::Done
        );
        assert!(matches!(next().await, ToBench::Stop { key } if key == k));
        // Already absent: success, and the bench is told nothing more.
        assert_eq!(
            p.destroy_lease(&k, &first.lease).await.unwrap(),
            Release::Done
        );
        assert_eq!(
            p.cancel_bootstrap(&k, &session.session).await.unwrap(),
            Release::Done
        );
        assert!(p.list(&k.run_id).await.unwrap().is_empty());
        let create = p.create_lease(&other, &template()).await.unwrap();
        assert_ne!(create.lease, first.lease);
        assert!(matches!(next().await, ToBench::Created { key } if key == other));
    }
}
