//! The `ssh` provider: a pool of hosts the user already has, one node per host.
//!
//! A group names its pool in its placement (`hosts = ["user@host:port", …]`)
//! and may set, in its parameters, `key` (a private key file; by default the
//! daemon's own, made on first use in `{state}/ssh/id_ed25519`),
//! `trust_on_first_use` (record a host's key on first contact; off by
//! default: every host must be in `{state}/ssh/known_hosts`) and
//! `unreachable_give_up_s` (see below).
//!
//! - **Lease**: a claim on a free host ([`super::remote`]). Before it tries a
//!   host, the provider records which host it is claiming for the key, in
//!   `{state}/ssh/leases/{run}/{node}-a{attempt}.json`; a retried create goes
//!   back to that host (and adopts its claim) rather than claim a second one,
//!   unless that host says it does not hold the claim. No free host is a
//!   failure that says how many hosts are claimed and by whom ("waiting for a
//!   free host"), retried after the usual backoff. The lease id is
//!   `ssh:{user@host:port}`.
//! - **Endpoint**: the host, once it answers SSH; until then it is not ready.
//! - **Bootstrap**: the agent binary is uploaded once per content (sha256) to
//!   `~/.swactor/bin/`, the attempt's credentials go to a 0600 file, and a
//!   wrapper starts the agent in a session of its own, so it outlives the
//!   SSH connection. The session follows the agent's log over SSH, so its
//!   progress streams back as a local agent's does; a restarted daemon
//!   adopts a running agent and follows its log from the start.
//! - **Cancel and destroy** stop the attempt's agent (only the process named
//!   in its `agent.pid` whose working directory is the attempt's), remove its
//!   directory and release the claim if the attempt holds it.
//! - **A host that does not answer.** Cancel and destroy are retried while
//!   the host is away; once it has not answered for `unreachable_give_up_s`
//!   (60 s by default) they succeed, and the provider records the attempt as
//!   abandoned on that host. Its node can then be replaced on another host.
//!   When the host answers again the provider stops what is left of the
//!   attempt there and releases its claim (a background sweep tries every
//!   few seconds); until then the host counts as claimed.
//! - **List**: every host the provider knows (from the shapes it was given
//!   and from its records) is asked for its claim; a claim of the run is a
//!   lease, and its running agent a session. A host that does not answer is
//!   left out of the listing.
//!
//! Over 1,000 lines in one file because every contract method takes the
//! same claims-and-leases state under one lock; the SSH client itself lives
//! apart in `ssh/`.

use super::remote::{self, ALIVE_MARKER, EXIT_MARKER};
use super::{ConnectOptions, KnownHosts, RemoteLine, SshError, SshIdentity, SshSession, SshTarget};
use crate::FaultKind;
use crate::Release;
use crate::credentials::AgentCredentials;
use crate::kit::{KeyGuard, KeyLocks, RecentOutput, Sessions, parse_agent_line};
use crate::lock;
use crate::{BootstrapSession, Inventory, LeaseGrant, OwnedResources, Provider, ProviderError};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use swactor_provisioning::{
    BootstrapEvent, BootstrapStage, LeaseId, NodeEndpoint, NodeTemplate, ParamValue, ResourceKey,
    RunId, SessionId,
};
use tokio::sync::oneshot;

/// Default of [`SshHostsConfig::unreachable_give_up`].
pub const UNREACHABLE_GIVE_UP_DEFAULT: Duration = Duration::from_secs(60);
/// How often abandoned attempts are looked after.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Settings of an [`SshHostsProvider`].
#[derive(Clone, Debug)]
pub struct SshHostsConfig {
    /// The daemon's state directory; the provider keeps its files in `ssh/`.
    pub state_dir: PathBuf,
    /// The swactor binary hosts run as their agent.
    pub agent_binary: PathBuf,
    /// Passed to agents as `--daemon`: how they reach the daemon.
    pub daemon_ticket: crate::DaemonTicket,
    /// The secret agents' credentials derive from.
    pub token_secret: [u8; 32],
    /// How long connecting to a host may take.
    pub connect_timeout: Duration,
    /// How long a stopping agent gets between SIGTERM and SIGKILL.
    pub term_grace: Duration,
    /// How long a host may not answer before cleanups on it are given up
    /// (per group: `unreachable_give_up_s`).
    pub unreachable_give_up: Duration,
    /// The daemon's deployment: its claims carry it, and a host claimed
    /// for the run by another deployment (or by none, when this is `Some`)
    /// is taken, its claim foreign: never adopted or released.
    pub deployment: Option<String>,
}

impl SshHostsConfig {
    /// Defaults for everything but the paths, the ticket and the secret.
    pub fn new(state_dir: impl Into<PathBuf>, agent_binary: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            agent_binary: agent_binary.into(),
            daemon_ticket: crate::DaemonTicket::default(),
            token_secret: [0; 32],
            connect_timeout: Duration::from_secs(10),
            term_grace: Duration::from_secs(5),
            unreachable_give_up: UNREACHABLE_GIVE_UP_DEFAULT,
            deployment: None,
        }
    }
}

/// How one host is reached: its target and the group settings that name it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct HostAccess {
    /// `user@host:port`.
    target: String,
    /// The private key, if not the daemon's own.
    key: Option<PathBuf>,
    /// Whether an unknown host key is recorded on first contact.
    trust_on_first_use: bool,
    /// Seconds a host may not answer before cleanups on it are given up.
    give_up_s: Option<f64>,
}

/// The provider's record of one attempt's lease: the host claimed (or being
/// claimed) for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct LeaseRecord {
    host: HostAccess,
}

/// An attempt given up on a host that did not answer for long enough; what
/// it left there is removed when the host answers again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Abandoned {
    key: ResourceKey,
    host: HostAccess,
}

/// A group's SSH settings, read from its template.
struct Group {
    hosts: Vec<HostAccess>,
    /// Each host's labels (placement key `labels`, a list per host in the
    /// order of `hosts`), by target; hosts without labels are absent.
    labels: BTreeMap<String, Vec<String>>,
}

/// Most labels one host may carry, and the longest label.
const LABELS_MAX: usize = 32;
const LABEL_LEN_MAX: usize = 128;

/// A label is printable ASCII without spaces, quotes or backslashes (it is
/// handed to the agent space-separated in `SWACTOR_HOST_LABELS`).
fn check_label(label: &str) -> Result<(), String> {
    if label.is_empty() || label.len() > LABEL_LEN_MAX {
        return Err(format!(
            "label {label:?} must hold 1 to {LABEL_LEN_MAX} characters"
        ));
    }
    if let Some(c) = label
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '"' | '\'' | '\\' | '`' | '$'))
    {
        return Err(format!(
            "label {label:?} holds {c:?}; labels are printable ASCII without spaces, quotes, `$` or backslashes"
        ));
    }
    Ok(())
}

/// A group's `[group.params]`, by name.
type Params = BTreeMap<String, ParamValue>;

/// The error for a group the provider cannot use.
fn invalid(what: String) -> ProviderError {
    ProviderError::definite(FaultKind::Invalid, format!("ssh provider: {what}"))
}

/// The private key every host of the group is reached with (`key`).
fn key_param(params: &Params) -> Result<Option<PathBuf>, ProviderError> {
    match params.get("key") {
        None => Ok(None),
        Some(ParamValue::Str(path)) => Ok(Some(expand_home(path))),
        Some(other) => Err(invalid(format!("`key` must be a file path, not {other}"))),
    }
}

/// Whether unknown host keys are recorded on first contact (`trust_on_first_use`).
fn trust_param(params: &Params) -> Result<bool, ProviderError> {
    match params.get("trust_on_first_use") {
        None => Ok(false),
        Some(ParamValue::Bool(b)) => Ok(*b),
        Some(other) => Err(invalid(format!(
            "`trust_on_first_use` must be true or false, not {other}"
        ))),
    }
}

/// Seconds a host may not answer before cleanups on it are given up (`unreachable_give_up_s`).
fn give_up_param(params: &Params) -> Result<Option<f64>, ProviderError> {
    match params.get("unreachable_give_up_s") {
        None => Ok(None),
        Some(ParamValue::Int(n)) if *n > 0 => Ok(Some(*n as f64)),
        Some(ParamValue::Float(f)) if *f > 0.0 => Ok(Some(*f)),
        Some(other) => Err(invalid(format!(
            "`unreachable_give_up_s` must be a positive number of seconds, not {other}"
        ))),
    }
}

/// Refuses a parameter the provider does not know.
fn check_known_params(params: &Params) -> Result<(), ProviderError> {
    for name in params.keys() {
        if !["key", "trust_on_first_use", "unreachable_give_up_s"].contains(&name.as_str()) {
            return Err(invalid(format!(
                "unknown parameter `{name}` (known: key, trust_on_first_use, unreachable_give_up_s)"
            )));
        }
    }
    Ok(())
}

/// The targets of the hosts the placement lists (`hosts`), at least one.
fn host_targets(template: &NodeTemplate) -> Result<Vec<String>, ProviderError> {
    let listed = match template.provider.placement.get("hosts") {
        Some(ParamValue::List(list)) => list.as_slice(),
        None => &[],
        Some(other) => return Err(invalid(format!("`hosts` must be a list, not {other}"))),
    };
    let mut targets = Vec::with_capacity(listed.len());
    for h in listed {
        let ParamValue::Str(text) = h else {
            return Err(invalid(format!("every host must be a string, not {h}")));
        };
        let target: SshTarget = text
            .parse()
            .map_err(|e| invalid(format!("host {text:?}: {e}")))?;
        targets.push(target.to_string());
    }
    if targets.is_empty() {
        return Err(invalid(
            "the group lists no `hosts` (hosts = [\"user@host:port\", …])".to_owned(),
        ));
    }
    Ok(targets)
}

/// Each host's labels (placement key `labels`, one list per host), by
/// target; hosts without labels are left out.
fn host_labels(
    template: &NodeTemplate,
    hosts: &[HostAccess],
) -> Result<BTreeMap<String, Vec<String>>, ProviderError> {
    let mut labels = BTreeMap::new();
    match template.provider.placement.get("labels") {
        None => {}
        Some(ParamValue::List(per_host)) if per_host.len() == hosts.len() => {
            for (host, list) in hosts.iter().zip(per_host) {
                let these = labels_of_host(&host.target, list)?;
                if !these.is_empty() {
                    labels.insert(host.target.clone(), these);
                }
            }
        }
        Some(other) => {
            return Err(invalid(format!(
                "`labels` must be a list of {} lists, one per host, not {other}",
                hosts.len()
            )));
        }
    }
    Ok(labels)
}

/// The labels `list` gives the host `target`, each checked.
fn labels_of_host(target: &str, list: &ParamValue) -> Result<Vec<String>, ProviderError> {
    let ParamValue::List(list) = list else {
        return Err(invalid(format!(
            "the labels of {target} must be a list, not {list}"
        )));
    };
    let mut these = Vec::with_capacity(list.len());
    for l in list {
        let ParamValue::Str(l) = l else {
            return Err(invalid(format!(
                "every label of {target} must be a string, not {l}"
            )));
        };
        check_label(l).map_err(|e| invalid(format!("host {target}: {e}")))?;
        these.push(l.clone());
    }
    if these.len() > LABELS_MAX {
        return Err(invalid(format!(
            "host {target} has {} labels, more than {LABELS_MAX}",
            these.len()
        )));
    }
    Ok(these)
}

/// Refuses a NUL character in a boot check argument or the environment.
fn check_no_nul(template: &NodeTemplate) -> Result<(), ProviderError> {
    if template
        .boot
        .boot_check
        .iter()
        .chain(template.boot.env.keys())
        .chain(template.boot.env.values())
        .any(|a| a.contains('\0'))
    {
        return Err(invalid(
            "a boot check argument or environment value holds a NUL character".to_owned(),
        ));
    }
    Ok(())
}

impl Group {
    /// The group's hosts and labels, read from `template` and checked.
    fn of(template: &NodeTemplate) -> Result<Self, ProviderError> {
        let params = &template.provider.params;
        let key = key_param(params)?;
        let trust_on_first_use = trust_param(params)?;
        let give_up_s = give_up_param(params)?;
        check_known_params(params)?;
        let hosts: Vec<HostAccess> = host_targets(template)?
            .into_iter()
            .map(|target| HostAccess {
                target,
                key: key.clone(),
                trust_on_first_use,
                give_up_s,
            })
            .collect();
        let labels = host_labels(template, &hosts)?;
        check_no_nul(template)?;
        Ok(Self { hosts, labels })
    }

    /// The labels of the host `target` (none when it has none, or when the
    /// group no longer lists it).
    fn labels_of(&self, target: &str) -> &[String] {
        self.labels.get(target).map_or(&[], Vec::as_slice)
    }
}

/// Checks what the provider reads from a template (the hosts, the key, the
/// trust setting), as it would at the first create.
///
/// # Errors
/// The first problem, worded for the shape's author.
pub fn check_template(template: &NodeTemplate) -> Result<(), String> {
    Group::of(template).map(|_| ()).map_err(|e| e.to_string())
}

/// `~/…` made absolute with this user's home.
fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}

struct Shared {
    config: SshHostsConfig,
    /// `{state}/ssh`.
    dir: PathBuf,
    known: KnownHosts,
    /// Keys by file (`None`: the daemon's own).
    identities: Mutex<HashMap<Option<PathBuf>, Arc<SshIdentity>>>,
    /// Every host the provider has been told of, by target.
    hosts: Mutex<BTreeMap<String, HostAccess>>,
    /// Open connections by target.
    connections: Mutex<HashMap<String, SshSession>>,
    /// Since when each host has not answered.
    unreachable_since: Mutex<HashMap<String, Instant>>,
    /// Open session streams.
    sessions: Sessions<()>,
    /// Serialises the calls for one key.
    key_locks: KeyLocks<ResourceKey>,
    /// The agent binary and its sha256, read on first use.
    binary: tokio::sync::OnceCell<(Arc<Vec<u8>>, String)>,
    /// The run's hosts claimed by other deployments, as last listed.
    foreign: Mutex<Vec<crate::ForeignResource>>,
}

/// The `ssh` provider. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct SshHostsProvider {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SshHostsProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshHostsProvider")
            .field("dir", &self.shared.dir)
            .finish_non_exhaustive()
    }
}

impl SshHostsProvider {
    /// A provider keeping its files in `{state_dir}/ssh`. Must be called
    /// within a tokio runtime: it starts the sweep of abandoned attempts.
    ///
    /// # Errors
    /// The directory cannot be made.
    pub fn new(config: SshHostsConfig) -> std::io::Result<Self> {
        let dir = config.state_dir.join("ssh");
        private_dirs(&dir.join("leases"))?;
        let known = KnownHosts::open(&dir.join("known_hosts"));
        let shared = Arc::new(Shared {
            config,
            dir,
            known,
            identities: Mutex::new(HashMap::new()),
            hosts: Mutex::new(BTreeMap::new()),
            connections: Mutex::new(HashMap::new()),
            unreachable_since: Mutex::new(HashMap::new()),
            sessions: Sessions::new(),
            key_locks: KeyLocks::new(),
            foreign: Mutex::new(Vec::new()),
            binary: tokio::sync::OnceCell::new(),
        });
        let provider = Self { shared };
        for (_, record) in provider.records(None) {
            provider.learn(&record.host);
        }
        for a in provider.abandoned() {
            provider.learn(&a.host);
        }
        tokio::spawn(sweep(Arc::downgrade(&provider.shared)));
        Ok(provider)
    }

    /// Tells the provider of the hosts a template's group lists, so that a
    /// listing (before any create) asks them too. A daemon calls it for the
    /// shapes it knows at start.
    pub fn learn_template(&self, template: &NodeTemplate) {
        if let Ok(group) = Group::of(template) {
            for h in &group.hosts {
                self.learn(h);
            }
        }
    }

    /// The daemon's own public key (made on first use), for `authorized_keys`.
    ///
    /// # Errors
    /// The key cannot be read or made.
    pub fn public_key(&self) -> Result<String, SshError> {
        Ok(self.identity(None)?.public_openssh())
    }

    /// Removes the cached agent binaries from every host the provider knows
    /// (and `~/.swactor` itself when nothing else is left in it): what a
    /// teardown leaves behind. Returns each host with what happened.
    pub async fn purge(&self) -> Vec<(String, Result<(), String>)> {
        let hosts: Vec<HostAccess> = lock(&self.shared.hosts).values().cloned().collect();
        let mut out = Vec::new();
        for host in hosts {
            let done = match self.run(&host, &remote::purge()).await {
                Ok(o) if o.success() => Ok(()),
                Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_owned()),
                Err(e) => Err(e.to_string()),
            };
            out.push((host.target, done));
        }
        out
    }

    fn learn(&self, host: &HostAccess) {
        lock(&self.shared.hosts).insert(host.target.clone(), host.clone());
    }

    fn identity(&self, key: Option<&Path>) -> Result<Arc<SshIdentity>, SshError> {
        let k = key.map(Path::to_path_buf);
        if let Some(id) = lock(&self.shared.identities).get(&k) {
            return Ok(id.clone());
        }
        let id = Arc::new(match key {
            Some(path) => SshIdentity::load(path)?,
            None => SshIdentity::load_or_generate(&self.shared.dir)?,
        });
        lock(&self.shared.identities).insert(k, id.clone());
        Ok(id)
    }

    /// An open connection to `host`, made if needed; remembers since when a
    /// host has not answered.
    async fn connect(&self, host: &HostAccess) -> Result<SshSession, SshError> {
        let cached = lock(&self.shared.connections).get(&host.target).cloned();
        if let Some(s) = cached.filter(|s| !s.is_closed()) {
            return Ok(s);
        }
        let target: SshTarget = host.target.parse().map_err(|e| SshError::Remote {
            target: host.target.clone(),
            reason: format!("{e}"),
        })?;
        let identity = self.identity(host.key.as_deref())?;
        let opts = ConnectOptions {
            connect_timeout: self.shared.config.connect_timeout,
            trust_on_first_use: host.trust_on_first_use,
        };
        match SshSession::connect(&target, &identity, &self.shared.known, &opts).await {
            Ok(s) => {
                lock(&self.shared.unreachable_since).remove(&host.target);
                lock(&self.shared.connections).insert(host.target.clone(), s.clone());
                Ok(s)
            }
            Err(e) => {
                if matches!(e, SshError::NotReady { .. }) {
                    lock(&self.shared.unreachable_since)
                        .entry(host.target.clone())
                        .or_insert_with(Instant::now);
                }
                Err(e)
            }
        }
    }

    /// Runs `command` on `host`, reconnecting once if a cached connection
    /// turns out to be dead.
    async fn run(&self, host: &HostAccess, command: &str) -> Result<super::ExecOutput, SshError> {
        self.run_with(host, command, None).await
    }

    async fn run_with(
        &self,
        host: &HostAccess,
        command: &str,
        stdin: Option<&[u8]>,
    ) -> Result<super::ExecOutput, SshError> {
        let session = self.connect(host).await?;
        match session.exec(command, stdin).await {
            Err(broken @ SshError::Broken { .. }) if session.is_closed() => {
                lock(&self.shared.connections).remove(&host.target);
                match self.connect(host).await {
                    Ok(again) => again.exec(command, stdin).await,
                    // The command may have run before the connection broke:
                    // a host that then does not answer is not a host where
                    // nothing ran (a claim written just before an sshd died
                    // must not be taken for a free host).
                    Err(SshError::NotReady { reason, .. }) => Err(SshError::Broken {
                        target: host.target.clone(),
                        reason: format!("{broken}; it did not answer again: {reason}"),
                    }),
                    Err(e) => Err(e),
                }
            }
            other => other,
        }
    }

    /// Whether cleanups on `host` are to be given up: it has not answered
    /// for its give-up time.
    fn given_up(&self, host: &HostAccess) -> bool {
        let limit = self.give_up_after(host);
        lock(&self.shared.unreachable_since)
            .get(&host.target)
            .is_some_and(|since| since.elapsed() >= limit)
    }

    /// How long `host` may not answer before cleanups on it are given up.
    fn give_up_after(&self, host: &HostAccess) -> Duration {
        host.give_up_s.map_or(
            self.shared.config.unreachable_give_up,
            Duration::from_secs_f64,
        )
    }

    /// `what` on `host` is given up: the words the host and people get.
    fn giving_up(&self, host: &HostAccess, what: &str) -> Release {
        Release::GivenUp(format!(
            "{} has not answered for {}s (unreachable_give_up_s), so {what} is given up; \
             it is cleaned up, and the host's claim released, when the host answers again",
            host.target,
            self.give_up_after(host).as_secs()
        ))
    }

    async fn lock_key(&self, key: &ResourceKey) -> KeyGuard<'_, ResourceKey> {
        self.shared.key_locks.lock(key).await
    }

    fn record_path(&self, key: &ResourceKey) -> PathBuf {
        self.shared
            .dir
            .join("leases")
            .join(key.run_id.as_str())
            .join(format!("{}-{}.json", key.node, key.attempt))
    }

    fn record(&self, key: &ResourceKey) -> Option<LeaseRecord> {
        let text = std::fs::read_to_string(self.record_path(key)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Writes `key`'s record durably (before the effect it announces).
    fn write_record(&self, key: &ResourceKey, record: &LeaseRecord) -> Result<(), ProviderError> {
        write_durably(&self.record_path(key), record)
    }

    fn forget_record(&self, key: &ResourceKey) {
        let _ = std::fs::remove_file(self.record_path(key));
    }

    fn abandoned_path(&self, key: &ResourceKey, target: &str) -> PathBuf {
        let target: String = target
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "@.:-_".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.shared
            .dir
            .join("abandoned")
            .join(key.run_id.as_str())
            .join(format!("{}-{}@{target}.json", key.node, key.attempt))
    }

    /// Records, durably, that `key`'s lease on `host` is given up, and drops
    /// its lease record.
    fn abandon(&self, key: &ResourceKey, host: &HostAccess) -> Result<(), ProviderError> {
        let path = self.abandoned_path(key, &host.target);
        let a = Abandoned {
            key: key.clone(),
            host: host.clone(),
        };
        write_durably(&path, &a)?;
        self.forget_record(key);
        Ok(())
    }

    /// Every abandoned attempt, of every run.
    fn abandoned(&self) -> Vec<Abandoned> {
        let root = self.shared.dir.join("abandoned");
        let mut out = Vec::new();
        for run in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for e in std::fs::read_dir(run.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Some(a) = std::fs::read_to_string(e.path())
                    .ok()
                    .and_then(|t| serde_json::from_str::<Abandoned>(&t).ok())
                {
                    out.push(a);
                }
            }
        }
        out
    }

    /// Every record (of `run`, or of every run): key and record.
    fn records(&self, run: Option<&RunId>) -> Vec<(ResourceKey, LeaseRecord)> {
        let root = self.shared.dir.join("leases");
        let runs: Vec<PathBuf> = match run {
            Some(r) => vec![root.join(r.as_str())],
            None => std::fs::read_dir(&root)
                .map(|d| d.flatten().map(|e| e.path()).collect())
                .unwrap_or_default(),
        };
        let mut out = Vec::new();
        for dir in runs {
            let Some(run) = dir.file_name().and_then(|n| n.to_str()).map(RunId::new) else {
                continue;
            };
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name();
                let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                    continue;
                };
                let Some((node, attempt)) = stem.rsplit_once("-a") else {
                    continue;
                };
                let (Some(node), Ok(attempt)) = (
                    swactor_provisioning::LogicalNodeId::parse(node),
                    attempt.parse::<u64>(),
                ) else {
                    continue;
                };
                let key = ResourceKey {
                    run_id: run.clone(),
                    node,
                    attempt: swactor_provisioning::NodeAttemptId(attempt),
                };
                if let Some(record) = self.record(&key) {
                    out.push((key, record));
                }
            }
        }
        out
    }

    fn host_of_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<HostAccess, ProviderError> {
        let target = lease.0.strip_prefix("ssh:").ok_or_else(|| {
            ProviderError::definite(
                FaultKind::Invalid,
                format!("{} is not an ssh lease", lease.0),
            )
        })?;
        if let Some(r) = self.record(key).filter(|r| r.host.target == target) {
            return Ok(r.host);
        }
        lock(&self.shared.hosts).get(target).cloned().ok_or_else(|| {
            ProviderError::definite(FaultKind::Invalid, format!(
                "no shape this daemon knows lists the host {target} (its key and trust settings are unknown)"
            ))
        })
    }

    /// The deployment its claims carry.
    fn deployment(&self) -> Option<&str> {
        self.shared.config.deployment.as_deref()
    }

    /// Tries to claim `host` for `key`: `Ok(true)` when the key holds it,
    /// `Ok(false)` when another does.
    async fn try_claim(
        &self,
        host: &HostAccess,
        key: &ResourceKey,
    ) -> Result<Option<String>, SshError> {
        let out = self
            .run(host, &remote::claim(key, self.deployment()))
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        let first = text.lines().next().unwrap_or("").trim().to_owned();
        if out.status.is_none() {
            return Err(SshError::Broken {
                target: host.target.clone(),
                reason: "the claim command ended without an exit status".to_owned(),
            });
        }
        if !out.success() {
            // Nothing was claimed: the host cannot hold a claim file.
            return Err(SshError::Remote {
                target: host.target.clone(),
                reason: format!(
                    "cannot claim the host: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(if first == remote::claim_line(key, self.deployment()) {
            None
        } else {
            Some(first)
        })
    }

    async fn agent_binary(&self) -> Result<(Arc<Vec<u8>>, String), ProviderError> {
        let path = self.shared.config.agent_binary.clone();
        self.shared
            .binary
            .get_or_try_init(|| async move {
                let bytes = tokio::fs::read(&path).await.map_err(|e| {
                    ProviderError::definite(
                        FaultKind::Local,
                        format!(
                            "cannot read the agent binary {} to upload it: {e}",
                            path.display()
                        ),
                    )
                })?;
                use sha2::Digest;
                let sha: String = sha2::Sha256::digest(&bytes)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                Ok((Arc::new(bytes), sha))
            })
            .await
            .cloned()
    }

    /// Stops `key`'s agent on `host`, removes its directory and releases
    /// its claim.
    async fn clean(&self, host: &HostAccess, key: &ResourceKey) -> Result<(), SshError> {
        let dir = remote::node_dir(key);
        let grace = self.shared.config.term_grace.as_secs().max(1);
        let stop = remote::stop_agent(&dir, grace);
        let out = self
            .run(
                host,
                &remote::unless_claimed_by_another(key, self.deployment(), &stop),
            )
            .await?;
        let said = String::from_utf8_lossy(&out.stdout);
        if said.trim() == remote::FOREIGN_MARKER {
            // Another key or deployment holds the host: nothing there is ours.
            tracing::debug!(%key, host = %host.target, "the host is claimed by another; nothing of ours to clean");
            return Ok(());
        }
        if said.trim() == "stuck" {
            return Err(SshError::Remote {
                target: host.target.clone(),
                reason: format!("the agent of {key} outlived SIGKILL"),
            });
        }
        let out = self
            .run(
                host,
                &format!(
                    "{} && {}",
                    remote::remove_dir(&dir),
                    remote::release(key, self.deployment())
                ),
            )
            .await?;
        if !out.success() {
            return Err(SshError::Remote {
                target: host.target.clone(),
                reason: format!(
                    "cannot remove {dir} or release the claim: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(())
    }

    fn mark_cancelled(&self, session: &SessionId) {
        self.shared.sessions.mark_cancelled(session);
    }

    /// A session stream that follows `key`'s agent on `host`.
    async fn follow(
        &self,
        host: &HostAccess,
        key: &ResourceKey,
        session: SessionId,
    ) -> Result<BootstrapSession, ProviderError> {
        let ssh = self.connect(host).await.map_err(ProviderError::from)?;
        let lines = ssh
            .exec_lines(&remote::follow(&remote::node_dir(key)))
            .await
            .map_err(ProviderError::from)?;
        Ok(start_relay(
            &self.shared.sessions,
            session,
            lines,
            host.target.clone(),
        ))
    }
}

/// Makes `dir` and its missing parents, readable by this user only (they
/// name the hosts and how they are reached).
pub(crate) fn private_dirs(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `value` as JSON to `path`, durably (synced, renamed into place).
pub(crate) fn write_durably(path: &Path, value: &impl Serialize) -> Result<(), ProviderError> {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            private_dirs(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        std::io::Write::write_all(&mut f, &text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(|e| {
        ProviderError::definite(
            FaultKind::Local,
            format!("cannot record {}: {e}", path.display()),
        )
    })
}

/// Registers a stream for `session` and relays a remote follow's `lines`
/// into it until the agent ends, the connection ends or a newer stream
/// replaces it; the stream's entry is forgotten then. `target` names the
/// machine in messages.
pub(crate) fn start_relay(
    sessions: &Sessions<()>,
    session: SessionId,
    lines: super::RemoteLines,
    target: String,
) -> BootstrapSession {
    sessions.stream(
        &session,
        false,
        |_| (),
        |s| relay(lines, s.tx, s.stop, s.cancelled, target),
    )
}

/// Forwards a remote follow's lines as bootstrap events.
async fn relay(
    mut lines: super::RemoteLines,
    tx: swactor_engine::stream::Sender<BootstrapEvent>,
    mut stop: oneshot::Receiver<()>,
    cancelled: Arc<AtomicBool>,
    target: String,
) {
    let mut recent = RecentOutput::default();
    let mut failed = false;
    loop {
        let line = tokio::select! {
            line = lines.lines.recv() => line,
            _ = &mut stop => return,
        };
        let event = match line {
            Some(RemoteLine::Stdout(text)) => {
                if let Some(status) = text.strip_prefix(EXIT_MARKER) {
                    let status = status.trim();
                    let last = if failed || cancelled.load(Ordering::SeqCst) || status == "gone" {
                        BootstrapEvent::Closed
                    } else {
                        let said = recent.clause();
                        // The shell's `$?`: a code, or 128 + the signal that
                        // ended the agent.
                        let how = match status.parse::<i32>() {
                            _ if status == "killed" => {
                                "was killed (it left no exit status)".to_owned()
                            }
                            Ok(code) => crate::exit::Ended::from_shell(code).clause(),
                            Err(_) => format!("ended with the status {status:?}"),
                        };
                        BootstrapEvent::Failed {
                            stage: BootstrapStage::AgentLost,
                            reason: format!("the agent on {target} {how}{said}"),
                        }
                    };
                    let _ = tx.send(last).await;
                    return;
                }
                if text == ALIVE_MARKER {
                    continue;
                }
                match parse_agent_line(&text) {
                    Some(event) => {
                        failed |= matches!(event, BootstrapEvent::Failed { .. });
                        event
                    }
                    None => {
                        recent.remember(&text);
                        continue;
                    }
                }
            }
            Some(RemoteLine::Stderr(text)) => {
                recent.remember(&text);
                continue;
            }
            // The connection ended before the agent did: the stream ends;
            // the agent's own link to the daemon says whether it lives.
            Some(RemoteLine::Exit(_) | RemoteLine::Closed) | None => {
                tracing::debug!(%target, "lost the SSH connection following an agent");
                return;
            }
        };
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

/// Most lines of an agent log sent as one piece.
const LOG_LINES_PER_PIECE: usize = 256;

/// Reads `key`'s agent log on the host `ssh` reaches ([`remote::read_log`]),
/// for [`Provider::agent_log`]; `target` names the host in messages.
pub(crate) async fn read_agent_log(
    ssh: &SshSession,
    key: &ResourceKey,
    follow: bool,
    target: String,
) -> Result<crate::AgentLogSource, ProviderError> {
    let dir = remote::node_dir(key);
    let mut lines = ssh
        .exec_lines(&remote::read_log(&dir, follow))
        .await
        .map_err(ProviderError::from)?;
    let (tx, rx) = tokio::sync::mpsc::channel(crate::AGENT_LOG_BUFFER_LEN);
    tokio::spawn(async move {
        let mut started = false;
        let mut piece = String::new();
        let mut gathered = 0;
        loop {
            let line = tokio::select! {
                line = lines.lines.recv() => line,
                // Nobody reads any more: dropping the lines ends the remote command.
                () = tx.closed() => return,
            };
            let end = match line {
                Some(RemoteLine::Stdout(text)) if !started => {
                    // What the login shell printed before the command ran is not the log.
                    started = text == remote::LOG_START_MARKER;
                    continue;
                }
                Some(RemoteLine::Stdout(text)) => match text.find(EXIT_MARKER) {
                    Some(at) => {
                        piece.push_str(&text[..at]);
                        let status = text[at + EXIT_MARKER.len()..].trim();
                        Some((status == "gone").then(|| {
                            format!(
                                "{target} has no directory ~/{dir} any more: the attempt's \
                                 log went with it"
                            )
                        }))
                    }
                    None if text == ALIVE_MARKER => None,
                    None => {
                        piece.push_str(&text);
                        piece.push('\n');
                        gathered += 1;
                        None
                    }
                },
                // tail's complaints about a log not written yet are no part of it.
                Some(RemoteLine::Stderr(_)) => None,
                Some(RemoteLine::Exit(_) | RemoteLine::Closed) | None => Some(Some(format!(
                    "the SSH connection to {target} ended before the whole log was read"
                ))),
            };
            // A piece goes once a few lines are gathered, when no more
            // have come yet, and at the end.
            let flush = end.is_some() || gathered >= LOG_LINES_PER_PIECE || lines.lines.is_empty();
            if flush && !piece.is_empty() {
                gathered = 0;
                if tx.send(Ok(std::mem::take(&mut piece))).await.is_err() {
                    return;
                }
            }
            if let Some(error) = end {
                if let Some(e) = error {
                    let _ = tx.send(Err(e)).await;
                }
                return;
            }
        }
    });
    Ok(crate::AgentLogSource::Remote(rx))
}

/// Every few seconds, cleans what abandoned attempts left on hosts that
/// answer again.
async fn sweep(shared: Weak<Shared>) {
    loop {
        tokio::time::sleep(SWEEP_INTERVAL).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let provider = SshHostsProvider { shared };
        for a in provider.abandoned() {
            match provider.clean(&a.host, &a.key).await {
                Ok(()) => {
                    tracing::info!(key = %a.key, host = %a.host.target, "cleaned up an abandoned attempt");
                    let _ = std::fs::remove_file(provider.abandoned_path(&a.key, &a.host.target));
                }
                Err(e) => {
                    tracing::debug!(key = %a.key, error = %e, "an abandoned attempt's host is still away")
                }
            }
        }
    }
}

fn session_of(host: &HostAccess, key: &ResourceKey, pid: &str) -> SessionId {
    SessionId::from(format!(
        "ssh:{}#{}-{}#pid{pid}",
        host.target, key.node, key.attempt
    ))
}

/// Hosts of each kind (claimed, not answering, unusable) that a create's
/// "waiting for a free host" names; the others are counted.
const HOSTS_NAMED_MAX: usize = 3;

/// Why a create found no free host among the pool's `pool` hosts: how many
/// are claimed first, then the hosts of each kind with their reasons, up to
/// [`HOSTS_NAMED_MAX`] of a kind and `and N more` for the rest. Hosts not
/// answering for the same reason share it (`a, b (connection refused …)`).
/// One line, whose length does not grow with the pool.
fn no_free_host(
    pool: usize,
    taken: &[String],
    away: &[(String, String)],
    unusable: &[String],
) -> String {
    let more = |n: usize| {
        if n > 0 {
            format!(" and {n} more")
        } else {
            String::new()
        }
    };
    let some = |items: &[String], sep: &str| {
        let shown = &items[..items.len().min(HOSTS_NAMED_MAX)];
        format!("{}{}", shown.join(sep), more(items.len() - shown.len()))
    };
    let mut text = format!(
        "waiting for a free host: {} of the pool's {pool} hosts are claimed",
        taken.len()
    );
    if !taken.is_empty() {
        text.push_str(&format!(" ({})", some(taken, ", ")));
    }
    if !away.is_empty() {
        let mut by_reason: Vec<(&str, Vec<&str>)> = Vec::new();
        for (target, reason) in away {
            match by_reason.iter_mut().find(|(r, _)| r == reason) {
                Some((_, targets)) => targets.push(target),
                None => by_reason.push((reason, vec![target])),
            }
        }
        let mut parts = Vec::new();
        let mut named = 0;
        for (reason, targets) in &by_reason {
            let shown = targets.len().min(HOSTS_NAMED_MAX - named);
            if shown == 0 {
                break;
            }
            named += shown;
            parts.push(format!(
                "{}{} ({reason})",
                targets[..shown].join(", "),
                more(targets.len() - shown)
            ));
        }
        let unnamed: usize = by_reason
            .iter()
            .skip(parts.len())
            .map(|(_, t)| t.len())
            .sum();
        text.push_str(&format!("; not answering: {}", parts.join("; ")));
        if unnamed > 0 {
            text.push_str(&format!("; and {unnamed} more"));
        }
    }
    if !unusable.is_empty() {
        text.push_str(&format!("; cannot be used: {}", some(unusable, "; ")));
    }
    text
}

#[async_trait]
impl Provider for SshHostsProvider {
    fn kind(&self) -> &'static str {
        "ssh"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let group = Group::of(template)?;
        for h in &group.hosts {
            self.learn(h);
        }
        let _guard = self.lock_key(key).await;
        let grant = |host: &HostAccess| LeaseGrant {
            lease: LeaseId::from(format!("ssh:{}", host.target)),
            endpoint: Some(NodeEndpoint::from(format!("ssh:{}", host.target))),
        };
        // A create that was tried before goes back to its host.
        if let Some(record) = self.record(key) {
            match self.try_claim(&record.host, key).await {
                Ok(None) => return Ok(grant(&record.host)),
                // Someone else holds it: the earlier try never claimed it.
                Ok(Some(_)) => self.forget_record(key),
                Err(e) if self.given_up(&record.host) => {
                    tracing::warn!(%key, host = %record.host.target, error = %e, "giving up on the host of an earlier create");
                    self.abandon(key, &record.host)?;
                }
                Err(e) => {
                    return Err(ProviderError::ambiguous(
                        FaultKind::Unreachable,
                        format!(
                            "{e}; it may hold this node's claim from an earlier try, so no other host is claimed until it answers"
                        ),
                    ));
                }
            }
        }
        let mut taken = Vec::new();
        let mut away = Vec::new();
        // Hosts that answer but cannot be used until something is fixed.
        let mut unusable = Vec::new();
        // Spread slots over the pool: each starts looking at its own index.
        let start = key.node.index as usize % group.hosts.len();
        for i in 0..group.hosts.len() {
            let host = &group.hosts[(start + i) % group.hosts.len()];
            // Intent first: a crash after the claim still finds it.
            self.write_record(key, &LeaseRecord { host: host.clone() })?;
            match self.try_claim(host, key).await {
                Ok(None) => {
                    tracing::debug!(%key, host = %host.target, "claimed a host");
                    return Ok(grant(host));
                }
                Ok(Some(holder)) => {
                    self.forget_record(key);
                    let by = remote::parse_claim(&holder).map_or_else(
                        || "something else".to_owned(),
                        |(k, d)| match d {
                            Some(d) => format!("{k} of deployment {d}"),
                            None => k.to_string(),
                        },
                    );
                    taken.push(format!("{} by {by}", host.target));
                }
                Err(SshError::NotReady { reason, .. }) => {
                    // Nothing ran there: the host holds no claim of ours.
                    self.forget_record(key);
                    away.push((host.target.clone(), reason));
                }
                Err(e) if e.is_definite() => {
                    self.forget_record(key);
                    let (target, why) = (host.target.to_string(), e.to_string());
                    unusable.push(if why.contains(&target) {
                        why
                    } else {
                        format!("{target}: {why}")
                    });
                }
                Err(e) => {
                    return Err(ProviderError::ambiguous(
                        FaultKind::Unreachable,
                        format!("claiming {} for {key}: {e}", host.target),
                    ));
                }
            }
        }
        Err(ProviderError::definite(
            FaultKind::NoCapacity,
            no_free_host(group.hosts.len(), &taken, &away, &unusable),
        ))
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        let host = self.host_of_lease(key, lease)?;
        let out = match self.run(&host, &remote::read_claim()).await {
            Ok(out) => out,
            Err(SshError::NotReady { .. }) => return Err(ProviderError::NotReady),
            Err(e) => return Err(e.into()),
        };
        let claim = String::from_utf8_lossy(&out.stdout);
        if claim.lines().next().map(str::trim)
            != Some(remote::claim_line(key, self.deployment()).as_str())
        {
            return Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("{} no longer holds the claim of {key}", host.target),
            ));
        }
        Ok(NodeEndpoint::from(format!("ssh:{}", host.target)))
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        _endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let host = self.host_of_lease(key, lease)?;
        let _guard = self.lock_key(key).await;
        let dir = remote::node_dir(key);
        // Adopt a running agent: follow its log from the start.
        let out = self.run(&host, &remote::agent_pid(&dir)).await?;
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !pid.is_empty() {
            return self.follow(&host, key, session_of(&host, key, &pid)).await;
        }
        let claim = self.run(&host, &remote::read_claim()).await?;
        if String::from_utf8_lossy(&claim.stdout)
            .lines()
            .next()
            .map(str::trim)
            != Some(remote::claim_line(key, self.deployment()).as_str())
        {
            return Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("{} no longer holds the claim of {key}", host.target),
            ));
        }
        let (bytes, sha) = self.agent_binary().await?;
        let binary = remote::binary_path(&sha);
        let ok = self
            .run(&host, &remote::binary_matches(&binary, &sha))
            .await?;
        if String::from_utf8_lossy(&ok.stdout).trim() != "ok" {
            let session = self.connect(&host).await?;
            session.upload(&binary, &bytes, 0o755).await?;
            tracing::info!(host = %host.target, %binary, "uploaded the agent binary");
        }
        let credentials = AgentCredentials::derive(&self.shared.config.token_secret, key);
        let out = self
            .run_with(
                &host,
                &remote::write_credentials(&dir),
                Some(credentials.to_text().as_bytes()),
            )
            .await?;
        if !out.success() {
            return Err(ProviderError::definite(
                FaultKind::Refused,
                format!(
                    "cannot write the agent's credentials on {}: {}",
                    host.target,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        let group = Group::of(template)?;
        let wrapper = remote::wrapper(
            key,
            &binary,
            &self.shared.config.daemon_ticket.get(),
            template,
            (group.labels_of(&host.target), self.deployment(), &[]),
        );
        self.connect(&host)
            .await?
            .upload(&format!("{dir}/run.sh"), wrapper.as_bytes(), 0o700)
            .await?;
        let out = self.run(&host, &remote::launch(&dir)).await?;
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if pid.is_empty() || !pid.chars().all(|c| c.is_ascii_digit()) {
            return Err(ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!(
                    "started the agent on {} but it did not record its pid: {}",
                    host.target,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        tracing::debug!(%key, host = %host.target, pid, "started an agent");
        self.follow(&host, key, session_of(&host, key, &pid)).await
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let target = session
            .0
            .strip_prefix("ssh:")
            .and_then(|s| s.split('#').next())
            .ok_or_else(|| {
                ProviderError::definite(
                    FaultKind::Invalid,
                    format!("{} is not an ssh session", session.0),
                )
            })?;
        let host = self.host_of_lease(key, &LeaseId::from(format!("ssh:{target}")))?;
        let _guard = self.lock_key(key).await;
        self.mark_cancelled(session);
        let grace = self.shared.config.term_grace.as_secs().max(1);
        let stop = remote::stop_agent(&remote::node_dir(key), grace);
        match self
            .run(
                &host,
                &remote::unless_claimed_by_another(key, self.deployment(), &stop),
            )
            .await
        {
            Ok(out) if String::from_utf8_lossy(&out.stdout).trim() == "stuck" => {
                Err(ProviderError::ambiguous(
                    FaultKind::Unstoppable,
                    format!("the agent of {key} on {target} outlived SIGKILL"),
                ))
            }
            Ok(_) => Ok(Release::Done),
            Err(e) if !e.is_definite() && self.given_up(&host) => {
                tracing::warn!(%key, host = %target, "the host has not answered for too long; its agent is left for when it is back");
                Ok(self.giving_up(&host, &format!("stopping the agent of {key}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let host = self.host_of_lease(key, lease)?;
        let _guard = self.lock_key(key).await;
        match self.clean(&host, key).await {
            Ok(()) => {
                self.forget_record(key);
                Ok(Release::Done)
            }
            Err(e) if !e.is_definite() && self.given_up(&host) => {
                tracing::warn!(%key, host = %host.target, error = %e, "the host has not answered for too long; giving its lease up (cleaned when it is back)");
                self.abandon(key, &host)?;
                Ok(self.giving_up(&host, &format!("the lease of {key}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        let abandoned: Vec<(ResourceKey, String)> = self
            .abandoned()
            .into_iter()
            .map(|a| (a.key, a.host.target))
            .collect();
        let hosts: Vec<HostAccess> = lock(&self.shared.hosts).values().cloned().collect();
        // Hosts are asked at once: one that does not answer costs one
        // connect timeout, not one per host.
        let mut asked = tokio::task::JoinSet::new();
        for host in hosts {
            let provider = self.clone();
            asked.spawn(async move {
                // `None`: the host did not answer; `Some(None)`: it holds no claim.
                let Ok(out) = provider.run(&host, &remote::read_claim()).await else {
                    return (host, None);
                };
                let text = String::from_utf8_lossy(&out.stdout);
                let Some((key, deployment)) = text.lines().next().and_then(remote::parse_claim)
                else {
                    return (host, Some(None));
                };
                if deployment.as_deref() != provider.deployment() {
                    // Another deployment's: its agent is none of ours to look at.
                    return (host, Some(Some((key, String::new(), Some(deployment)))));
                }
                let dir = remote::node_dir(&key);
                let pid = match provider.run(&host, &remote::agent_pid(&dir)).await {
                    Ok(out) => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
                    // The claim is known; whether its agent runs is not.
                    Err(_) => String::new(),
                };
                (host, Some(Some((key, pid, None))))
            });
        }
        let mut inventory = Inventory::new();
        let mut foreign = Vec::new();
        let mut silent = Vec::new();
        while let Some(found) = asked.join_next().await {
            let Ok((host, answer)) = found else {
                continue;
            };
            let Some(claim) = answer else {
                silent.push(host.target);
                continue;
            };
            let Some((key, pid, other)) = claim else {
                continue;
            };
            if let Some(deployment) = other {
                if key.run_id == *run_id {
                    foreign.push(crate::ForeignResource {
                        provider: "ssh".to_owned(),
                        resource: format!("host {}", host.target),
                        deployment,
                        key: format!("{}/{}", key.node, key.attempt),
                        usd_per_hour_micros: None,
                    });
                }
                continue;
            }
            if key.run_id != *run_id || abandoned.contains(&(key.clone(), host.target.clone())) {
                continue;
            }
            inventory.insert(
                key.clone(),
                OwnedResources {
                    lease: Some(LeaseId::from(format!("ssh:{}", host.target))),
                    session: (!pid.is_empty()).then(|| session_of(&host, &key, &pid)),
                },
            );
        }
        foreign.sort();
        *lock(&self.shared.foreign) = foreign;
        // A host that did not answer may hold the claims its lease records
        // name (a create cut off by a crash leaves a claim the journal never
        // heard of): listed as leases, they are adopted or collected once the
        // host answers, instead of being forgotten on it.
        for (key, record) in self.records(Some(run_id)) {
            let target = record.host.target;
            if silent.contains(&target)
                && !abandoned.contains(&(key.clone(), target.clone()))
                && !inventory.contains_key(&key)
            {
                inventory.insert(
                    key,
                    OwnedResources {
                        lease: Some(LeaseId::from(format!("ssh:{target}"))),
                        session: None,
                    },
                );
            }
        }
        Ok(inventory)
    }

    fn foreign(&self) -> Vec<crate::ForeignResource> {
        lock(&self.shared.foreign).clone()
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        lease
            .0
            .strip_prefix("ssh:")
            .map(|host| format!("host {host}"))
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<crate::AgentLogSource, ProviderError> {
        let host = self.host_of_lease(key, lease)?;
        let ssh = self.connect(&host).await.map_err(ProviderError::from)?;
        read_agent_log(&ssh, key, follow, host.target).await
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with("ssh:")
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with("ssh:")
    }
}

/// Shared by the ssh and vast providers' tests: sessions relayed through a
/// provider's registry, the way `follow` opens them.
#[cfg(test)]
pub(crate) mod relay_tests {
    use super::*;
    use swactor_provisioning::{BootstrapStage, LogicalNodeId, NodeAttemptId, RunId};
    use tokio::sync::mpsc;

    /// Relays `n` sessions to their end ([`Sessions::run_to_their_end`]),
    /// each opened while holding its key's lock from `locks`: every tenth is
    /// cancelled, the others end with an agent that exits.
    pub(crate) async fn relay_sessions(
        sessions: &Sessions<()>,
        locks: &KeyLocks<ResourceKey>,
        n: u32,
    ) {
        sessions
            .run_to_their_end(n, async |i| {
                let key = ResourceKey {
                    run_id: RunId::new("r"),
                    node: LogicalNodeId::parse("w-0").unwrap(),
                    attempt: NodeAttemptId(u64::from(i) + 1),
                };
                let _guard = locks.lock(&key).await;
                let (tx, rx) = mpsc::channel(4);
                let session = SessionId::from(format!("test:{key}#{i}"));
                let stream = start_relay(
                    sessions,
                    session.clone(),
                    super::super::RemoteLines { lines: rx },
                    "host-x".to_owned(),
                );
                let cancel = i % 10 == 0;
                if cancel {
                    assert!(sessions.mark_cancelled(&session));
                }
                tx.send(RemoteLine::Stdout("booting".to_owned()))
                    .await
                    .unwrap();
                tx.send(RemoteLine::Stdout(format!("{EXIT_MARKER}3")))
                    .await
                    .unwrap();
                let ended = if cancel {
                    BootstrapEvent::Closed
                } else {
                    BootstrapEvent::Failed {
                        stage: BootstrapStage::AgentLost,
                        reason: "the agent on host-x exited with code 3; its last output: booting"
                            .to_owned(),
                    }
                };
                (stream, ended)
            })
            .await;
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn ten_thousand_sessions_leave_no_entry_and_no_lock_behind() {
        let state = tempfile::tempdir().unwrap();
        let p = SshHostsProvider::new(SshHostsConfig::new(state.path(), "/bin/true")).unwrap();
        relay_sessions(&p.shared.sessions, &p.shared.key_locks, 10_000).await;
    }
}
