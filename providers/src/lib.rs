//! The provider contract: how Swactor leases machines and bootstraps agents on them.
//!
//! A [`Provider`] performs the five effects the reconciler decides on, plus a
//! listing used to adopt what an earlier daemon left behind. Every call names
//! the [`ResourceKey`] (run, slot, attempt) it acts for, and implementations
//! must honour three rules, which the conformance kit checks:
//!
//! - **Adopt before creating.** `create_lease` and `start_bootstrap` first look
//!   for a resource already made for the same key and return it; the key acts
//!   as an idempotency token, so a retried create never makes a second machine.
//! - **Already absent is success.** `cancel_bootstrap` and `destroy_lease`
//!   succeed when there is nothing left to stop or destroy.
//! - **Classify failures honestly.** [`ProviderError::Definite`] promises the
//!   call had no effect; when that cannot be promised (a lost reply, a
//!   timeout, a crash half-way) the error is [`ProviderError::Ambiguous`], and
//!   the reconciler will re-issue the create so the provider can adopt.
//!   [`ProviderError::Gone`] promises that the lease a call named no longer
//!   exists, so the reconciler replaces the attempt instead of retrying.
//!
//! Providers are execution owners: unlike the policy crates they may spawn,
//! sleep and do I/O.

pub mod credentials;
#[cfg(feature = "docker")]
pub mod docker;
pub mod exit;
#[cfg(feature = "fake")]
pub mod fake;
pub mod gate;
mod kit;
mod multi;
pub mod process;
#[cfg(feature = "ssh")]
pub mod ssh;
#[cfg(feature = "vast")]
pub mod vast;

pub use multi::Providers;

/// Implementors of [`Provider`] use this attribute on their `impl` blocks.
pub use async_trait::async_trait;
/// How a release ended; the core's own type, re-exported for providers.
pub use swactor_provisioning::Release;

use std::collections::BTreeMap;
use swactor_provisioning::{
    BootstrapEvent, LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId,
};

/// The ticket agents are started with (`--daemon`): how they reach their
/// daemon. Clones share one value, which the daemon may change while it
/// runs (the run's daemons taking turns through etcd: a new one joins,
/// and agents made from then on are told of it); each create reads it
/// then.
#[derive(Clone, Debug, Default)]
pub struct DaemonTicket(std::sync::Arc<std::sync::RwLock<String>>);

impl DaemonTicket {
    /// A ticket holding `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Self(std::sync::Arc::new(std::sync::RwLock::new(text.into())))
    }

    /// The ticket now.
    pub fn get(&self) -> String {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the ticket for every later create.
    pub fn set(&self, text: impl Into<String>) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = text.into();
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }
}

impl From<String> for DaemonTicket {
    fn from(text: String) -> Self {
        Self::new(text)
    }
}

impl From<&str> for DaemonTicket {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

/// Locks `m`, also after a panic in another holder: every provider keeps
/// its critical sections to single map or model operations, so a poisoned
/// lock guards nothing half-done.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Environment variables that hold an account's credentials on the
/// daemon's machine (the Vast.ai API key, the etcd credentials of a run
/// kept in etcd). No provider passes them on to a
/// node: a local agent, which otherwise inherits the daemon's environment,
/// starts without them.
pub const ACCOUNT_ENV: &[&str] = &["VAST_API_KEY", "ETCDCTL_USER", "ETCDCTL_PASSWORD"];

/// The exit status of an agent that ended its node by itself because its
/// daemon renewed nothing for a whole lease (the group's `orphan_after_s`):
/// what a provider's own wrapper looks for to clean up after it.
pub const ORPHANED_EXIT: i32 = 3;

/// How a provider call failed: the class (whether the call may have had
/// its effect) is what the host decides on; the [`Fault`] inside says what
/// went wrong, as a [`FaultKind`] to branch on and in words for people.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// The call certainly had no effect.
    #[error("{0}")]
    Definite(Fault),
    /// The call may or may not have had its effect.
    #[error("outcome unknown: {0}")]
    Ambiguous(Fault),
    /// Lookup only: the lease exists but its endpoint is not ready yet.
    #[error("endpoint not ready yet")]
    NotReady,
    /// The lease the call named certainly no longer exists (deleted out of
    /// band, expired). Only for calls that act on an existing lease
    /// (`lookup_endpoint`, `start_bootstrap`); a provider whose listings lag
    /// behind its creates must not say this while a new lease may still be
    /// invisible.
    #[error("the lease is gone: {0}")]
    Gone(Fault),
}

impl ProviderError {
    /// A failure that certainly had no effect.
    pub fn definite(kind: FaultKind, message: impl Into<String>) -> Self {
        Self::Definite(Fault::new(kind, message))
    }

    /// A failure that may have had its effect.
    pub fn ambiguous(kind: FaultKind, message: impl Into<String>) -> Self {
        Self::Ambiguous(Fault::new(kind, message))
    }

    /// The lease the call named is gone.
    pub fn gone(kind: FaultKind, message: impl Into<String>) -> Self {
        Self::Gone(Fault::new(kind, message))
    }

    /// The fault, for every class but [`ProviderError::NotReady`].
    pub fn fault(&self) -> Option<&Fault> {
        match self {
            Self::Definite(f) | Self::Ambiguous(f) | Self::Gone(f) => Some(f),
            Self::NotReady => None,
        }
    }

    /// What kind of fault it was; `None` for [`ProviderError::NotReady`],
    /// which is a probe's answer rather than a fault.
    pub fn kind(&self) -> Option<FaultKind> {
        self.fault().map(Fault::kind)
    }
}

/// What went wrong in a provider call.
///
/// Its words are complete: when it was made from another error
/// ([`Fault::caused_by`]), they already include that error's, so a
/// [`ProviderError`] prints once and names no source of its own. The
/// underlying error stays reachable, typed, through
/// [`std::error::Error::source`] on the fault itself.
#[derive(Clone, Debug)]
pub struct Fault {
    kind: FaultKind,
    message: String,
    source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Fault {
    /// A fault of `kind`, in `message`'s words.
    pub fn new(kind: FaultKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A fault of `kind` that `source` caused; the words are `what: source`.
    pub fn caused_by(
        kind: FaultKind,
        what: impl std::fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            message: format!("{what}: {source}"),
            source: Some(std::sync::Arc::new(source)),
        }
    }

    /// A fault of `kind` in `message`'s words, which already say what
    /// `source` does.
    pub fn with_source(
        kind: FaultKind,
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            message: message.into(),
            source: Some(std::sync::Arc::new(source)),
        }
    }

    /// What kind of fault it is.
    pub fn kind(&self) -> FaultKind {
        self.kind
    }

    /// The fault in words.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Fault {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Two faults are the same when their kind and words are: the source is
/// what the words already say, and errors have no equality of their own.
impl PartialEq for Fault {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for Fault {}

/// What kind of thing went wrong in a provider call: what code and tests
/// branch on, and what `/metrics` counts provider errors by. The words of
/// the [`Fault`] say the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum FaultKind {
    /// The request cannot be served as written: a template, setting, key,
    /// id or binary the provider cannot use. It fails again until changed.
    Invalid,
    /// The resource named exists but is not this call's to use: another
    /// key's, another deployment's, or not made by swactor.
    NotOurs,
    /// No room: no free host, no rentable offer, a machine already taken.
    NoCapacity,
    /// Credentials or trust were refused: an API key, an SSH key, a host
    /// key that changed or is unknown.
    Denied,
    /// The provider asked for fewer requests.
    RateLimited,
    /// The provider refused the request as it stands.
    Refused,
    /// The provider or the host did not answer, or the connection broke.
    Unreachable,
    /// The provider's service failed, or answered something unusable.
    Service,
    /// This machine's own files or processes failed.
    Local,
    /// The node's agent would not stop.
    Unstoppable,
    /// A change whose result could not be confirmed: a lost reply, a started
    /// agent that recorded no pid, an earlier create of unknown outcome.
    Unconfirmed,
    /// The resource does not exist (any more): deleted out of band, or
    /// never made.
    Deleted,
    /// The machine will never serve: a failed boot, an instance that
    /// exited, went offline, was frozen or stopped.
    MachineFailed,
    /// The machine was not ready within its group's load timeout.
    LoadTimeout,
}

impl FaultKind {
    /// The kind as one lowercase word, as `/metrics` labels it.
    pub fn word(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::NotOurs => "not_ours",
            Self::NoCapacity => "no_capacity",
            Self::Denied => "denied",
            Self::RateLimited => "rate_limited",
            Self::Refused => "refused",
            Self::Unreachable => "unreachable",
            Self::Service => "service",
            Self::Local => "local",
            Self::Unstoppable => "unstoppable",
            Self::Unconfirmed => "unconfirmed",
            Self::Deleted => "deleted",
            Self::MachineFailed => "machine_failed",
            Self::LoadTimeout => "load_timeout",
        }
    }
}

/// A lease the provider made or adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease.
    pub lease: LeaseId,
    /// Its endpoint, when already known.
    pub endpoint: Option<NodeEndpoint>,
}

/// The stream of facts a bootstrap session reports. It ends when the session
/// does; an explicit [`BootstrapEvent::Closed`] before the end is optional.
pub type BootstrapEvents = swactor_engine::stream::Receiver<BootstrapEvent>;

/// A bootstrap session the provider started or adopted.
#[derive(Debug)]
pub struct BootstrapSession {
    /// The session.
    pub session: SessionId,
    /// Its observations. Adopting a session returns a fresh stream that first
    /// restates the progress the session has already made.
    pub events: BootstrapEvents,
}

/// What a provider holds for one key of a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnedResources {
    /// The live lease, if any.
    pub lease: Option<LeaseId>,
    /// The live bootstrap session, if any.
    pub session: Option<SessionId>,
}

/// Everything a provider holds for one run, by key.
pub type Inventory = BTreeMap<ResourceKey, OwnedResources>;

/// A resource of the run that another deployment made: another daemon with
/// the same run on the same account, engine or hosts, or this state
/// directory's own earlier journal, lost. A provider never adopts,
/// destroys or reuses one; it reports what it saw of them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ForeignResource {
    /// The provider kind (`vast`, `docker`, `ssh`).
    pub provider: String,
    /// The provider's name for it (an instance id, a container, a host).
    pub resource: String,
    /// The deployment its labels name; `None` for a resource made before
    /// deployments were recorded.
    pub deployment: Option<String>,
    /// The slot and attempt it was made for, as `node/aN`.
    pub key: String,
    /// What it costs, in millionths of a dollar per hour, when the provider
    /// knows.
    pub usd_per_hour_micros: Option<u64>,
}

/// A deployment id: eight lowercase hex digits, made once per journal.
///
/// # Errors
/// Anything else, in words.
pub fn check_deployment(id: &str) -> Result<(), String> {
    if id.len() == 8 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(format!(
            "deployment {id:?} is not a deployment id (eight lowercase hex digits, as \
             `swactor status` shows them)"
        ))
    }
}

/// Pieces of an agent's log as they are read where the agent runs; an
/// `Err` piece says why the reading broke off, and is the last.
pub type AgentLogStream = tokio::sync::mpsc::Receiver<Result<String, String>>;

/// Pieces an [`AgentLogStream`] buffers before its reader must catch up.
pub const AGENT_LOG_BUFFER_LEN: usize = 64;

/// Where [`Provider::agent_log`] found an agent's log.
#[derive(Debug)]
pub enum AgentLogSource {
    /// In the daemon's state directory (the `process` provider's nodes, and
    /// the kept ends of their ended attempts' logs): whoever shares that
    /// directory reads it there.
    StateDir,
    /// Read from the machine the agent runs on: everything the log holds,
    /// then, when following, what the agent writes until it ends. The
    /// stream ends with the log; dropping it stops the reading.
    Remote(AgentLogStream),
}

/// A way to lease machines and run the agent on them. See the crate docs for
/// the rules every implementation follows.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// The provider kind named in shapes (`process`, `docker`, `fake`, ...).
    fn kind(&self) -> &'static str;

    /// Leases a machine for `key`, adopting one already leased for it.
    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError>;

    /// The lease's endpoint; [`ProviderError::NotReady`] while it has none yet.
    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError>;

    /// Starts the bootstrap of `key`'s machine, adopting a running session.
    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError>;

    /// Stops a bootstrap session; already gone is success. A provider that
    /// cannot reach the session's machine for longer than it waits may give
    /// it up instead ([`Release::GivenUp`]), and must stop it once the
    /// machine answers.
    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError>;

    /// Releases a lease; already gone is success. A provider that cannot
    /// reach the lease's machine for longer than it waits may give it up
    /// instead ([`Release::GivenUp`]), and must release it once the machine
    /// answers; it then no longer lists it.
    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError>;

    /// Releases the lease of an attempt that failed, for `reason`: a
    /// provider that chooses machines may avoid this one for a while. By
    /// default, [`Provider::destroy_lease`].
    async fn destroy_failed_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        reason: &str,
    ) -> Result<Release, ProviderError> {
        let _ = reason;
        self.destroy_lease(key, lease).await
    }

    /// Everything this provider holds for `run_id`, for adoption and garbage collection.
    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError>;

    /// How long a new lease may take to show up in [`Provider::list`]. A
    /// restarted daemon that misses a lease it knows was created checks
    /// again this long after it started before it calls itself converged.
    fn listing_lag(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// How many nodes this provider can hold, and on what the estimate
    /// rests; `None` when it sets no limit of its own. A shape asking for
    /// more is refused unless it names its own `capacity`.
    fn capacity(&self) -> Option<swactor_provisioning::Capacity> {
        None
    }

    /// What people should see of `lease` in a status, in a few words (a
    /// container id, a host, an offer and its price), from what the provider
    /// already knows: it must not block or call out. `None` when it has
    /// nothing to add to the lease id.
    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        let _ = lease;
        None
    }

    /// The agent log of `key`'s attempt on `lease`, for `swactor logs`:
    /// what it holds now and, with `follow`, what the agent writes until
    /// it ends. Only reads; a lease that is gone is [`ProviderError::Gone`].
    /// The default is a provider that keeps no log anyone can read.
    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<AgentLogSource, ProviderError> {
        let _ = (key, lease, follow);
        Err(ProviderError::definite(
            FaultKind::Invalid,
            format!(
                "the {} provider keeps no agent log that can be read",
                self.kind()
            ),
        ))
    }

    /// Whether the machine of `lease` is paused by the provider itself, so
    /// that it may resume with its disk and agent (an interruptible rental
    /// that another bid outranked). Asked when an agent goes away in a
    /// group that waits for such machines. Providers whose machines are
    /// never paused say no.
    async fn paused(&self, key: &ResourceKey, lease: &LeaseId) -> Result<bool, ProviderError> {
        let _ = (key, lease);
        Ok(false)
    }

    /// Resources of the run that another deployment made, as the last
    /// [`Provider::list`] saw them: never adopted, destroyed or reused,
    /// only reported. From what the provider already knows: it must not
    /// block or call out.
    fn foreign(&self) -> Vec<ForeignResource> {
        Vec::new()
    }

    /// Whether `lease` is one of this provider's (for [`Providers`] to route
    /// calls that name a lease but no template). Each provider's lease ids
    /// have a form of their own.
    fn owns_lease(&self, lease: &LeaseId) -> bool {
        let _ = lease;
        true
    }

    /// Whether `session` is one of this provider's.
    fn owns_session(&self, session: &SessionId) -> bool {
        let _ = session;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_fault_prints_once_and_keeps_its_source_typed() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let e = ProviderError::Definite(Fault::caused_by(FaultKind::Local, "cannot open x", io));
        assert_eq!(e.to_string(), "cannot open x: denied");
        assert_eq!(e.kind(), Some(FaultKind::Local));
        // The error names no source of its own, so a chain prints it once.
        assert!(e.source().is_none());
        let source = e
            .fault()
            .unwrap()
            .source()
            .expect("the fault keeps its source");
        let io = source.downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn each_class_words_its_fault_as_before() {
        let gone = ProviderError::gone(FaultKind::Deleted, "container c does not exist");
        assert_eq!(
            gone.to_string(),
            "the lease is gone: container c does not exist"
        );
        let unknown = ProviderError::ambiguous(FaultKind::Unreachable, "no answer");
        assert_eq!(unknown.to_string(), "outcome unknown: no answer");
        assert_eq!(ProviderError::NotReady.kind(), None);
        assert!(ProviderError::NotReady.fault().is_none());
    }

    #[test]
    fn faults_are_equal_by_kind_and_words() {
        let io = || std::io::Error::other("x");
        assert_eq!(
            Fault::caused_by(FaultKind::Local, "a", io()),
            Fault::new(FaultKind::Local, "a: x")
        );
        assert_ne!(
            Fault::new(FaultKind::Local, "a"),
            Fault::new(FaultKind::Refused, "a")
        );
    }

    #[test]
    fn every_kind_has_its_own_metric_word() {
        let kinds = [
            FaultKind::Invalid,
            FaultKind::NotOurs,
            FaultKind::NoCapacity,
            FaultKind::Denied,
            FaultKind::RateLimited,
            FaultKind::Refused,
            FaultKind::Unreachable,
            FaultKind::Service,
            FaultKind::Local,
            FaultKind::Unstoppable,
            FaultKind::Unconfirmed,
            FaultKind::Deleted,
            FaultKind::MachineFailed,
            FaultKind::LoadTimeout,
        ];
        let words: std::collections::BTreeSet<&str> = kinds.iter().map(|k| k.word()).collect();
        assert_eq!(words.len(), kinds.len());
        assert!(
            words
                .iter()
                .all(|w| w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        );
    }
}
