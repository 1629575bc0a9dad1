//! The `vast` provider: GPU machines rented on Vast.ai, one instance per node, bootstrapped over SSH.
//!
//! A group sets its offer query and limits in `[group.params]` (see
//! [`KNOWN_PARAMS`]): `max_dph` and an `image` are required; `gpu_name`,
//! `num_gpus`, `min_gpu_ram_gb`, `min_reliability`, `disk_gb`, `region`,
//! `verified`, `load_timeout_s` and `spend_cap_dph` are optional.
//!
//! - **Lease**: an instance labelled `swactor:{run}:{node}:{attempt}` (the
//!   label is also in its `env`, as `SWACTOR_LABEL`). A create first looks
//!   the label up and adopts what it finds; otherwise it searches offers
//!   (cheapest first), skips machines that failed recently, checks the spend
//!   cap and rents the first. The lease id is `vast:{instance id}`.
//! - **An unknown outcome is never re-sent.** Before it rents, the provider
//!   records the attempt durably (`{state}/vast/leases/{run}/{node}-a{n}.json`);
//!   a create that times out, is cut off or answers 5xx stays recorded, and the
//!   next create for that key only looks for the label until
//!   [`VastConfig::listing_lag`] has passed since the first was sent. Only then
//!   may it rent again. A daemon killed mid-create finds the record when it
//!   starts again.
//! - **Capacity**: an offer that is gone or rented (404/3603, 410, "already
//!   rented") or no offer at all is an ordinary definite failure whose text
//!   says so; the machine is skipped by the next creates for
//!   [`VastConfig::bad_machine_ttl`], so the retry goes to another offer.
//! - **Spend cap** (`spend_cap_dph`): the run's live instances at their
//!   `dph_total`, those created but not listed yet and those whose create has
//!   an unknown outcome, plus the offer, must stay within the cap; creates are
//!   serialised so that two of them cannot both fit under it.
//! - **Endpoint**: `null`/`loading` is not ready; `running` with an SSH port is
//!   the endpoint (`ssh:root@host:port`); `exited`, `offline`, `unknown`, a
//!   failed boot, or loading past `load_timeout_s` end the attempt (reported
//!   as [`ProviderError::Gone`]: the instance will never serve; the core still
//!   destroys it), and its machine is skipped by later creates.
//! - **Skipped machines**: a machine is skipped for
//!   [`VastConfig::bad_machine_ttl`] after a create or a lookup fails on it,
//!   and after any node on it fails later (its instance exits, its agent
//!   stays away: the core's destroy says why, [`Provider::destroy_failed_lease`]).
//!   The list, with each reason and expiry, is kept in
//!   `{state}/vast/bad_machines.json`, so a restarted daemon skips them too.
//! - **Bootstrap**: the daemon's SSH key (`{state}/ssh/id_ed25519`) is put in
//!   `~/.ssh/authorized_keys` by the create's `onstart` script; the agent is
//!   then uploaded and started as the `ssh` provider does ([`crate::ssh`]'s
//!   remote layout). Instances are fresh machines whose host keys nobody can
//!   know in advance, so each instance's key is trusted on first use and kept
//!   in a known hosts file of its own (`{state}/vast/known_hosts/{id}`): a
//!   later instance reusing the address does not clash, and a changed key on
//!   the same instance is refused.
//! - **Destroy**: `DELETE`; 404, "not found" and an instance that no longer
//!   shows are success.
//! - **Orphaned**: the `onstart` script keeps the instance's own key (the
//!   service's `CONTAINER_API_KEY`, good for that instance only) where the
//!   agent finds it, and the agent, given the service's URL, destroys its
//!   own instance with it if its lease lapses ([`OwnInstance`]). The
//!   account key never reaches the instance.
//! - **List**: every instance whose label names the run (paged through the
//!   v1 listing), plus instances created but not listed yet.
//!
//! # Caveats
//! The API key is sent as a bearer header and redacted from every message;
//! it never reaches logs, errors or `status`.
//!
//! Over 1,000 lines in one file because the contract's methods share the
//! rental state (skipped machines, labels, costs); the offer model, the API
//! client and the pacing already live in `vast/`.

mod api;
mod model;
mod own;

pub use api::{ApiKey, Pacing};
pub use model::KNOWN_PARAMS;
pub use own::{INSTANCE_FILE, OwnInstance};

use self::api::{Api, ApiError, Endpoint};
use self::model::{CreateFailure, GroupParams, Health, Instance, Offer};
use crate::FaultKind;
use crate::Release;
use crate::credentials::AgentCredentials;
use crate::kit::{KeyGuard, KeyLocks, Sessions};
use crate::lock;
use crate::ssh::remote;
use crate::ssh::{
    ConnectOptions, KnownHosts, SshError, SshIdentity, SshSession, SshTarget, private_dirs,
    read_agent_log, start_relay, write_durably,
};
use crate::{BootstrapSession, Inventory, LeaseGrant, OwnedResources, Provider, ProviderError};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use swactor_provisioning::{
    LeaseId, LogicalNodeId, NodeAttemptId, NodeEndpoint, NodeTemplate, ResourceKey, RunId,
    SessionId,
};

/// The service's address when `VAST_URL` is not set.
pub const DEFAULT_URL: &str = "https://console.vast.ai";
/// Default of [`VastConfig::listing_lag`].
pub const LISTING_LAG_DEFAULT: Duration = Duration::from_secs(60);
/// Most listing pages read (25 instances each).
const LIST_PAGES_MAX: usize = 400;
/// How long a search's offers are reused by later creates.
const OFFERS_FRESH: Duration = Duration::from_secs(10);
/// The user the daemon logs in as.
const SSH_USER: &str = "root";

/// Settings of a [`VastProvider`].
#[derive(Clone, Debug)]
pub struct VastConfig {
    /// The daemon's state directory: the provider keeps its files in
    /// `vast/`, and uses the daemon's SSH key in `ssh/`.
    pub state_dir: PathBuf,
    /// The swactor binary machines run as their agent.
    pub agent_binary: PathBuf,
    /// Passed to agents as `--daemon`.
    pub daemon_ticket: crate::DaemonTicket,
    /// The secret agents' credentials derive from.
    pub token_secret: [u8; 32],
    /// The service (`VAST_URL`), e.g. [`DEFAULT_URL`].
    pub url: String,
    /// The API key.
    pub key: ApiKey,
    /// Per-endpoint pacing.
    pub pacing: Pacing,
    /// How long one request may take before its outcome is unknown.
    pub request_timeout: Duration,
    /// How long a new instance may take to show in listings; also how long
    /// a create with an unknown outcome is looked for before renting again.
    pub listing_lag: Duration,
    /// How long a machine that failed is skipped.
    pub bad_machine_ttl: Duration,
    /// How long an SSH connection may take.
    pub connect_timeout: Duration,
    /// How long a stopping agent gets between SIGTERM and SIGKILL.
    pub term_grace: Duration,
    /// The daemon's deployment: its instances' labels carry it, and an
    /// instance of the run labelled for another (or none, when this is
    /// `Some`) is foreign: never adopted or destroyed.
    pub deployment: Option<String>,
}

impl VastConfig {
    /// Defaults for everything but the paths, the service and the key.
    pub fn new(
        state_dir: impl Into<PathBuf>,
        agent_binary: impl Into<PathBuf>,
        url: impl Into<String>,
        key: ApiKey,
    ) -> Self {
        Self {
            state_dir: state_dir.into(),
            agent_binary: agent_binary.into(),
            daemon_ticket: crate::DaemonTicket::default(),
            token_secret: [0; 32],
            url: url.into(),
            key,
            pacing: Pacing::service(),
            request_timeout: Duration::from_secs(60),
            listing_lag: LISTING_LAG_DEFAULT,
            bad_machine_ttl: Duration::from_secs(30 * 60),
            connect_timeout: Duration::from_secs(10),
            term_grace: Duration::from_secs(5),
            deployment: None,
        }
    }

    /// The service from `VAST_URL` (else [`DEFAULT_URL`]) and the key as the
    /// official client finds it ([`ApiKey::from_env`]).
    ///
    /// # Errors
    /// No key anywhere.
    pub fn from_env(
        state_dir: impl Into<PathBuf>,
        agent_binary: impl Into<PathBuf>,
    ) -> Result<Self, String> {
        let url = std::env::var("VAST_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        Ok(Self::new(state_dir, agent_binary, url, ApiKey::from_env()?))
    }
}

/// What the provider remembers of one attempt's create.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct CreateRecord {
    label: String,
    offer: u64,
    machine: u64,
    dph: f64,
    /// When the create was sent (ms since the epoch): survives restarts.
    sent_ms: u64,
    /// The instance, once a create said so.
    instance: Option<u64>,
    /// The group's `load_timeout_s`.
    load_timeout_s: f64,
}

impl CreateRecord {
    fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.sent_ms))
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What `status` shows of a node's instance.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceInfo {
    /// The instance.
    pub instance: u64,
    /// The offer it was rented from (0 when adopted without a record).
    pub offer: u64,
    /// Its machine.
    pub machine: u64,
    /// Dollars per hour.
    pub dph: f64,
    /// Its status, as the service last said.
    pub status: String,
}

/// Where the machines to skip are kept, under `{state}/vast`.
const BAD_MACHINES_FILE: &str = "bad_machines.json";
/// Where what ended rentals cost is kept, under `{state}/vast`.
const SPENT_FILE: &str = "spent.json";

/// What the deployment's ended rentals cost: each instance's price from
/// its create to its destroy.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Spent {
    /// The deployment they were rented for: a new deployment (a new
    /// journal) starts from nothing.
    #[serde(default)]
    deployment: Option<String>,
    /// Dollars, in millionths.
    closed_micros: u64,
    /// How many rentals ended.
    closed: u64,
}

/// What `dph` dollars per hour cost over `lasted`, in millionths of a dollar.
fn cost_micros(dph: f64, lasted: Duration) -> u64 {
    swactor_provisioning::budget::usd_micros(dph * lasted.as_secs_f64() / 3600.0)
}

/// A machine to skip: until when (ms since the Unix epoch, wall clock, as
/// it must hold across a restart) and why.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct BadMachine {
    until_unix_ms: u64,
    reason: String,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The machines to skip kept at `path` that are still to be skipped (none
/// when the file is missing or unreadable: it only steers the next rentals).
fn read_bad_machines(path: &std::path::Path) -> BTreeMap<u64, BadMachine> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return BTreeMap::new();
    };
    let mut bad: BTreeMap<u64, BadMachine> = serde_json::from_str(&text).unwrap_or_else(|e| {
        tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable list of machines to skip");
        BTreeMap::new()
    });
    let now = unix_ms(SystemTime::now());
    bad.retain(|_, b| b.until_unix_ms > now);
    bad
}

struct Shared {
    config: VastConfig,
    api: Api,
    /// `{state}/vast`.
    dir: PathBuf,
    identity: Arc<SshIdentity>,
    /// Machines to skip, until when, and why; kept in
    /// `{state}/vast/bad_machines.json` so that a restart skips them too.
    bad_machines: Mutex<BTreeMap<u64, BadMachine>>,
    /// What ended rentals cost; kept in `{state}/vast/spent.json`.
    spent: Mutex<Spent>,
    /// When each instance without a record was first seen (its load timeout
    /// runs from there).
    first_seen: Mutex<HashMap<u64, Instant>>,
    /// The SSH endpoint of each instance, once running.
    endpoints: Mutex<HashMap<u64, String>>,
    connections: Mutex<HashMap<u64, SshSession>>,
    /// Open session streams.
    sessions: Sessions<()>,
    /// What status shows, by key.
    shown: Mutex<BTreeMap<ResourceKey, InstanceInfo>>,
    /// The run's instances of other deployments, as last listed.
    foreign: Mutex<Vec<crate::ForeignResource>>,
    /// Serialises the calls for one key.
    key_locks: KeyLocks<ResourceKey>,
    /// Recent searches, by query: when, and the offers still untried.
    offers: Mutex<HashMap<String, (Instant, Vec<Offer>)>>,
    /// Held from the spend check to the create's answer.
    create_lock: tokio::sync::Mutex<()>,
    binary: tokio::sync::OnceCell<(Arc<Vec<u8>>, String)>,
}

/// The `vast` provider. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct VastProvider {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for VastProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VastProvider")
            .field("url", &self.shared.api.base())
            .field("dir", &self.shared.dir)
            .finish_non_exhaustive()
    }
}

/// Checks what the provider reads from a template, as the first create would.
///
/// # Errors
/// The first problem, worded for the shape's author.
pub fn check_template(template: &NodeTemplate) -> Result<(), String> {
    GroupParams::of(template).map(|_| ())
}

/// A template's `spend_cap_dph`, if it sets a valid one.
pub fn spend_cap_of(template: &NodeTemplate) -> Option<f64> {
    GroupParams::of(template).ok()?.spend_cap_dph
}

fn definite(kind: FaultKind, what: impl std::fmt::Display) -> ProviderError {
    ProviderError::definite(kind, format!("vast: {what}"))
}

/// A read's failure: definite (it changed nothing), worded.
fn read_failed(what: &str, e: &ApiError) -> ProviderError {
    let hint = match e {
        ApiError::Status {
            status: 401 | 403, ..
        } => " (the API key was refused: check VAST_API_KEY)",
        _ => "",
    };
    definite(api_kind(e), format!("{what}: {e}{hint}"))
}

/// What kind of fault an API error is.
fn api_kind(e: &ApiError) -> FaultKind {
    match e {
        ApiError::Status {
            status: 401 | 403, ..
        } => FaultKind::Denied,
        ApiError::Status { status: 429, .. } => FaultKind::RateLimited,
        ApiError::Status {
            status: 400..=499, ..
        } => FaultKind::Refused,
        ApiError::Status { .. } | ApiError::Malformed(_) => FaultKind::Service,
        ApiError::Unsent(_) | ApiError::Lost(_) => FaultKind::Unreachable,
    }
}

fn lease_of(id: u64) -> LeaseId {
    LeaseId::from(format!("vast:{id}"))
}

fn instance_of(lease: &LeaseId) -> Result<u64, ProviderError> {
    lease
        .0
        .strip_prefix("vast:")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            definite(
                FaultKind::Invalid,
                format!("{} is not a vast lease", lease.0),
            )
        })
}

fn session_of(instance: u64, key: &ResourceKey, pid: &str) -> SessionId {
    SessionId::from(format!(
        "vast:{instance}#{}-{}#pid{pid}",
        key.node, key.attempt
    ))
}

/// Whether the service paused `i` though its owner wants it running, and
/// it may resume: an interruptible instance outbid by another rental is
/// `stopped` with its intended status still `running`, and resumes when
/// its bid wins again. A stop its owner asked for says `stopped` in both;
/// an instance whose contract ended (`end_date` before `now_s`) is stopped
/// for good; an on-demand one is never outbid.
fn outbid(i: &Instance, now_s: f64) -> bool {
    let is = |s: &Option<String>, v: &str| s.as_deref().map(str::trim) == Some(v);
    i.is_bid
        && is(&i.actual_status, "stopped")
        && is(&i.intended_status, "running")
        && i.end_date.is_none_or(|end| end > now_s)
}

/// The `onstart` script, run by the service at every start of the
/// container: puts the daemon's key in root's `authorized_keys`, copies
/// the instance's own id and key from the container's environment to
/// [`INSTANCE_FILE`] (owner-only; SSH sessions do not see that
/// environment, and the agent needs them to end its own instance), then
/// starts again the agent a stop ended (a paused interruptible instance
/// that resumed, a reboot), from the wrapper the daemon left, unless the
/// daemon cancelled it or it ended by itself. At the first start there is
/// no wrapper yet and nothing is started.
fn onstart(public_key: &str) -> String {
    let line = crate::ssh::quote(public_key.trim());
    let root = remote::ROOT;
    format!(
        "mkdir -p ~/.ssh && chmod 700 ~/.ssh && touch ~/.ssh/authorized_keys && \
         (grep -qxF {line} ~/.ssh/authorized_keys || printf '%s\\n' {line} >> ~/.ssh/authorized_keys) && \
         chmod 600 ~/.ssh/authorized_keys; \
         if [ -n \"${{CONTAINER_ID:-}}\" ] && [ -n \"${{CONTAINER_API_KEY:-}}\" ]; then \
         (umask 077 && mkdir -p ~/{root} && \
         printf 'CONTAINER_ID=%s\\nCONTAINER_API_KEY=%s\\n' \"$CONTAINER_ID\" \"$CONTAINER_API_KEY\" > ~/{own_file}.tmp && \
         mv ~/{own_file}.tmp ~/{own_file}); fi; \
         for w in \"$HOME\"/{root}/nodes/*/*/run.sh; do \
         d=$(dirname \"$w\"); \
         [ -f \"$w\" ] && [ -f \"$d/{RESUME_CREDENTIALS}\" ] && [ ! -e \"$d/{CANCELLED}\" ] \
         && [ ! -e \"$d/exit_status\" ] || continue; \
         (cd \"$d\" && umask 077 && cp -p {RESUME_CREDENTIALS} agent.credentials && rm -f agent.pid \
         && setsid ./run.sh > /dev/null 2>&1 < /dev/null &); \
         done; true",
        own_file = INSTANCE_FILE,
    )
}

/// A file in an attempt's directory that says the daemon stopped its
/// agent: a restarted container does not start it again.
const CANCELLED: &str = "cancelled";

/// A copy of the agent's credentials (owner-only, in root's home of the
/// instance, gone with the instance) that a restarted container's agent
/// starts from: the agent takes its own file away when it starts.
const RESUME_CREDENTIALS: &str = "resume.credentials";

/// Why the access check failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The service refused the key or the request: asking again will not help.
    #[error("{0}")]
    Refused(String),
    /// The service could not be read just now (rate limited, failing, no
    /// answer, an answer cut off): it may answer later.
    #[error("{0}")]
    Unavailable(String),
}

impl VastProvider {
    /// A provider keeping its files in `{state_dir}/vast`.
    ///
    /// # Errors
    /// A bad `url`, or the directory or the daemon's SSH key cannot be made.
    pub fn new(config: VastConfig) -> Result<Self, String> {
        let api = Api::new(
            &config.url,
            config.key.clone(),
            config.pacing.clone(),
            config.request_timeout,
        )?;
        let dir = config.state_dir.join("vast");
        private_dirs(&dir.join("leases"))
            .and_then(|()| private_dirs(&dir.join("known_hosts")))
            .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let identity = SshIdentity::load_or_generate(&config.state_dir.join("ssh"))
            .map_err(|e| e.to_string())?;
        let bad_machines = read_bad_machines(&dir.join(BAD_MACHINES_FILE));
        let spent = std::fs::read(dir.join(SPENT_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<Spent>(&b).ok())
            .filter(|s| s.deployment == config.deployment)
            .unwrap_or_else(|| Spent {
                deployment: config.deployment.clone(),
                ..Spent::default()
            });
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                api,
                dir,
                identity: Arc::new(identity),
                bad_machines: Mutex::new(bad_machines),
                spent: Mutex::new(spent),
                first_seen: Mutex::new(HashMap::new()),
                endpoints: Mutex::new(HashMap::new()),
                connections: Mutex::new(HashMap::new()),
                sessions: Sessions::new(),
                shown: Mutex::new(BTreeMap::new()),
                foreign: Mutex::new(Vec::new()),
                key_locks: KeyLocks::new(),
                offers: Mutex::new(HashMap::new()),
                create_lock: tokio::sync::Mutex::new(()),
                binary: tokio::sync::OnceCell::new(),
            }),
        })
    }

    /// Checks the key against the service (a listing), so that a wrong key
    /// is reported before anything is rented.
    ///
    /// # Errors
    /// The service refused the key or could not be reached.
    pub async fn check_access(&self) -> Result<(), AccessError> {
        let base = self.shared.api.base();
        self.page(None, None).await.map(|_| ()).map_err(|e| match e {
            ApiError::Status {
                status: 401 | 403, ..
            } => AccessError::Refused(format!(
                "the Vast.ai service at {base} refused the API key ({e}); check VAST_API_KEY or ~/.vast_api_key"
            )),
            // Another client error: a wrong URL, a route that is not there.
            ApiError::Status { status, .. } if (400..500).contains(&status) && status != 408 && status != 429 => {
                AccessError::Refused(format!(
                    "the Vast.ai service at {base} answered in a way Swactor cannot use ({e})"
                ))
            }
            e @ ApiError::Malformed(_) => AccessError::Unavailable(format!(
                "the Vast.ai service at {base} answered in a way Swactor cannot read ({e})"
            )),
            e => AccessError::Unavailable(format!("cannot reach the Vast.ai service at {base}: {e}")),
        })
    }

    /// What `status` shows of each node's instance: the offer, the machine,
    /// $/h and the status, as last seen.
    pub fn instances(&self, run: &RunId) -> Vec<(ResourceKey, InstanceInfo)> {
        lock(&self.shared.shown)
            .iter()
            .filter(|(k, _)| k.run_id == *run)
            .map(|(k, i)| (k.clone(), i.clone()))
            .collect()
    }

    fn remember_shown(&self, key: &ResourceKey, i: &Instance, record: Option<&CreateRecord>) {
        let info = InstanceInfo {
            instance: i.id,
            offer: record.map_or(0, |r| r.offer),
            machine: i.machine_id.or(record.map(|r| r.machine)).unwrap_or(0),
            dph: i.dph_total.or(record.map(|r| r.dph)).unwrap_or(0.0),
            status: i
                .actual_status
                .clone()
                .unwrap_or_else(|| "being set up".to_owned()),
        };
        lock(&self.shared.shown).insert(key.clone(), info);
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

    fn record(&self, key: &ResourceKey) -> Option<CreateRecord> {
        let text = std::fs::read_to_string(self.record_path(key)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Forgets `key`'s create; a rental it names has ended, and what it
    /// cost is added to the run's spend.
    fn forget_record(&self, key: &ResourceKey) {
        if let Some(r) = self.record(key).filter(|r| r.instance.is_some()) {
            let mut spent = lock(&self.shared.spent);
            spent.closed_micros = spent
                .closed_micros
                .saturating_add(cost_micros(r.dph, r.age()));
            spent.closed += 1;
            if let Err(e) = write_durably(&self.shared.dir.join(SPENT_FILE), &*spent) {
                tracing::warn!(error = %e, "cannot keep what ended rentals cost across a restart");
            }
        }
        let _ = std::fs::remove_file(self.record_path(key));
    }

    /// What the run has cost so far (every rental from its create to its
    /// destroy, or to now) and costs per hour now (every rental this
    /// provider made or is making), from its own records: no call out. An
    /// instance adopted without a record (its record lost) is not counted.
    pub fn spend(&self, run: &RunId) -> swactor_provisioning::budget::Spend {
        let mut spend = swactor_provisioning::budget::Spend {
            spent_micros: lock(&self.shared.spent).closed_micros,
            usd_per_hour_micros: 0,
        };
        for (_, r) in self.records(run) {
            spend.usd_per_hour_micros = spend
                .usd_per_hour_micros
                .saturating_add(cost_micros(r.dph, Duration::from_secs(3600)));
            if r.instance.is_some() {
                spend.spent_micros = spend
                    .spent_micros
                    .saturating_add(cost_micros(r.dph, r.age()));
            }
        }
        spend
    }

    /// Every record of `run`.
    fn records(&self, run: &RunId) -> Vec<(ResourceKey, CreateRecord)> {
        let dir = self.shared.dir.join("leases").join(run.as_str());
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            let Some((node, attempt)) = stem.rsplit_once("-a") else {
                continue;
            };
            let (Some(node), Ok(attempt)) = (LogicalNodeId::parse(node), attempt.parse::<u64>())
            else {
                continue;
            };
            let key = ResourceKey {
                run_id: run.clone(),
                node,
                attempt: NodeAttemptId(attempt),
            };
            if let Some(r) = self.record(&key) {
                out.push((key, r));
            }
        }
        out
    }

    fn mark_bad(&self, machine: Option<u64>, why: &str) {
        let Some(m) = machine.filter(|m| *m != 0) else {
            return;
        };
        let until_unix_ms = unix_ms(SystemTime::now() + self.shared.config.bad_machine_ttl);
        tracing::info!(
            machine = m,
            reason = why,
            "skipping a machine for the next creates"
        );
        let mut bad = lock(&self.shared.bad_machines);
        bad.insert(
            m,
            BadMachine {
                until_unix_ms,
                reason: why.to_owned(),
            },
        );
        let now = unix_ms(SystemTime::now());
        bad.retain(|_, b| b.until_unix_ms > now);
        let path = self.shared.dir.join(BAD_MACHINES_FILE);
        // Kept in memory whatever happens; a restart forgets what could
        // not be written, and says so here.
        if let Err(e) = write_durably(&path, &*bad) {
            tracing::warn!(error = %e, "cannot keep the machines to skip across a restart");
        }
    }

    fn is_bad(&self, machine: u64) -> bool {
        let mut bad = lock(&self.shared.bad_machines);
        let now = unix_ms(SystemTime::now());
        bad.retain(|_, b| b.until_unix_ms > now);
        bad.contains_key(&machine)
    }

    /// One page of the v1 listing, filtered to `label` if given.
    async fn page(
        &self,
        label: Option<&str>,
        after: Option<&str>,
    ) -> Result<(Vec<Instance>, Option<String>), ApiError> {
        let mut query = vec![
            ("limit", "25".to_owned()),
            ("order_by", json!([{"col": "id", "dir": "asc"}]).to_string()),
        ];
        if let Some(l) = label {
            query.push(("select_filters", json!({"label": {"eq": l}}).to_string()));
        }
        if let Some(t) = after {
            query.push(("after_token", t.to_owned()));
        }
        let body = self
            .shared
            .api
            .call(
                Endpoint::List,
                reqwest::Method::GET,
                "/api/v1/instances/",
                &query,
                None,
            )
            .await?;
        model::parse_instance_page(&body).map_err(ApiError::Malformed)
    }

    /// Every instance (with `label`, if given), through every page.
    async fn instances_labelled(&self, label: Option<&str>) -> Result<Vec<Instance>, ApiError> {
        let mut out = Vec::new();
        let mut after = None;
        for _ in 0..LIST_PAGES_MAX {
            let (list, next) = self.page(label, after.as_deref()).await?;
            out.extend(list);
            match next {
                Some(t) if Some(&t) != after.as_ref() => after = Some(t),
                _ => return Ok(out),
            }
        }
        tracing::warn!(pages = LIST_PAGES_MAX, "the instance listing was cut short");
        Ok(out)
    }

    /// The live instances of `run` of this deployment, by key (several for
    /// a key only if something went wrong); those of the run with another
    /// deployment are remembered as foreign.
    async fn run_instances(&self, run: &RunId) -> Result<Vec<(ResourceKey, Instance)>, ApiError> {
        let ours = self.shared.config.deployment.as_deref();
        let mut foreign = Vec::new();
        let mine = self
            .instances_labelled(None)
            .await?
            .into_iter()
            .filter(|i| !matches!(model::health(i), Health::Destroyed))
            .filter_map(|i| {
                let (key, deployment) = model::parse_label(i.label.as_deref()?)?;
                if key.run_id != *run {
                    return None;
                }
                if deployment != ours {
                    foreign.push(crate::ForeignResource {
                        provider: "vast".to_owned(),
                        resource: format!("instance {}", i.id),
                        deployment: deployment.map(str::to_owned),
                        key: format!("{}/{}", key.node, key.attempt),
                        usd_per_hour_micros: i
                            .dph_total
                            .map(swactor_provisioning::budget::usd_micros),
                    });
                    return None;
                }
                Some((key, i))
            })
            .collect();
        foreign.sort();
        *lock(&self.shared.foreign) = foreign;
        Ok(mine)
    }

    async fn show(&self, id: u64) -> Result<Option<Instance>, ApiError> {
        let body = self
            .shared
            .api
            .call(
                Endpoint::Show,
                reqwest::Method::GET,
                &format!("/api/v0/instances/{id}/"),
                &[("owner", "me".to_owned())],
                None,
            )
            .await?;
        model::parse_shown(&body).map_err(ApiError::Malformed)
    }

    /// Destroys `id`; absent is success.
    async fn destroy(&self, id: u64) -> Result<(), ProviderError> {
        match own::destroy_once(&self.shared.api, id).await {
            Ok(()) => {}
            // Answered, but not done: it may be destroyed yet; the core retries.
            Err(ApiError::Status { status: 200, body }) => {
                return Err(ProviderError::ambiguous(
                    FaultKind::Service,
                    format!("vast: destroying instance {id}: {body}"),
                ));
            }
            // Refused before anything was done.
            Err(e @ (ApiError::Status { status: ..500, .. } | ApiError::Unsent(_))) => {
                return Err(definite(
                    api_kind(&e),
                    format!("destroying instance {id}: {e}"),
                ));
            }
            // A 5xx or a lost answer: it may be destroyed; the core retries.
            Err(e) => {
                return Err(ProviderError::ambiguous(
                    api_kind(&e),
                    format!("vast: destroying instance {id}: {e}"),
                ));
            }
        }
        self.forget_instance(id);
        Ok(())
    }

    fn forget_instance(&self, id: u64) {
        lock(&self.shared.endpoints).remove(&id);
        lock(&self.shared.first_seen).remove(&id);
        if let Some(s) = lock(&self.shared.connections).remove(&id) {
            tokio::spawn(async move { s.close().await });
        }
        let _ = std::fs::remove_file(self.known_hosts_path(id));
    }

    fn known_hosts_path(&self, id: u64) -> PathBuf {
        self.shared.dir.join("known_hosts").join(id.to_string())
    }

    /// Adopts the instance of `key` if one exists or may still appear.
    /// `Ok(Some)`: adopt it; `Ok(None)`: nothing, rent; `Err`: wait.
    async fn adopt(
        &self,
        key: &ResourceKey,
        label: &str,
    ) -> Result<Option<Instance>, ProviderError> {
        let mut found: Vec<Instance> = self
            .instances_labelled(Some(label))
            .await
            .map_err(|e| read_failed("looking up the label before renting", &e))?
            .into_iter()
            .filter(|i| i.label.as_deref() == Some(label))
            .filter(|i| !matches!(model::health(i), Health::Destroyed))
            .collect();
        found.sort_by_key(|i| i.id);
        if found.len() > 1 {
            // Never expected: only one create per label is ever sent while
            // an earlier one may still show up. Keep the oldest.
            for extra in &found[1..] {
                tracing::warn!(%key, instance = extra.id, "a second instance has this node's label; destroying it");
                if let Err(e) = self.destroy(extra.id).await {
                    tracing::warn!(%key, instance = extra.id, error = %e, "could not destroy the extra instance yet");
                }
            }
        }
        if let Some(i) = found.into_iter().next() {
            return Ok(Some(i));
        }
        let Some(record) = self.record(key) else {
            return Ok(None);
        };
        let lag = self.shared.config.listing_lag;
        if let Some(id) = record.instance {
            // Created for sure: the listing may lag behind.
            return match self.show(id).await {
                Ok(Some(i)) if !matches!(model::health(&i), Health::Destroyed) => Ok(Some(i)),
                Ok(_) if record.age() < lag => Ok(Some(Instance {
                    id,
                    actual_status: None,
                    intended_status: None,
                    label: Some(label.to_owned()),
                    status_msg: None,
                    ssh: None,
                    machine_id: Some(record.machine),
                    dph_total: Some(record.dph),
                    is_bid: false,
                    end_date: None,
                })),
                Ok(_) => {
                    self.forget_record(key);
                    Ok(None)
                }
                Err(e) => Err(read_failed(
                    "looking up the instance of an earlier create",
                    &e,
                )),
            };
        }
        if record.age() < lag {
            return Err(ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!(
                    "vast: an earlier create for {label} (offer {}) has an unknown outcome; it is looked for by label for {}s before another machine is rented ({}s so far)",
                    record.offer,
                    lag.as_secs(),
                    record.age().as_secs()
                ),
            ));
        }
        tracing::info!(%key, "an earlier create with an unknown outcome never showed up; renting anew");
        self.forget_record(key);
        Ok(None)
    }

    /// What the run costs now, per instance, for the spend cap: every live
    /// instance, plus what was created (or may have been) and is not listed.
    async fn run_spend(&self, run: &RunId) -> Result<Vec<f64>, ProviderError> {
        let listed = self
            .run_instances(run)
            .await
            .map_err(|e| read_failed("listing the run's instances for the spend cap", &e))?;
        let mut costs: Vec<f64> = Vec::new();
        let mut seen_keys = std::collections::BTreeSet::new();
        let mut seen_ids = std::collections::BTreeSet::new();
        for (key, i) in &listed {
            let recorded = self.record(key);
            costs.push(i.dph_total.or(recorded.map(|r| r.dph)).unwrap_or(0.0));
            seen_keys.insert(key.clone());
            seen_ids.insert(i.id);
        }
        for (key, r) in self.records(run) {
            let listed =
                r.instance.is_some_and(|id| seen_ids.contains(&id)) || seen_keys.contains(&key);
            if !listed && r.age() < self.shared.config.listing_lag {
                costs.push(r.dph);
            }
        }
        Ok(costs)
    }

    /// The offers that fit `params`, cheapest first. A search answered
    /// less than [`OFFERS_FRESH`] ago is reused (the service allows a search
    /// every few seconds, and a shape of many nodes rents them one after the
    /// other), less the offers rented or failed since.
    async fn search(&self, params: &GroupParams) -> Result<Vec<Offer>, ProviderError> {
        let query = params.offer_query().to_string();
        if let Some((at, offers)) = lock(&self.shared.offers).get(&query)
            && at.elapsed() < OFFERS_FRESH
            && !offers.is_empty()
        {
            return Ok(offers.clone());
        }
        let body = self
            .shared
            .api
            .call(
                Endpoint::Search,
                reqwest::Method::POST,
                "/api/v0/bundles/",
                &[],
                Some(&params.offer_query()),
            )
            .await
            .map_err(|e| read_failed("searching offers", &e))?;
        let mut offers = model::parse_offers(&body).map_err(|e| definite(FaultKind::Invalid, e))?;
        // The service filters too; a price or size it ignored must not slip
        // through. Each offer is priced as it will be rented (a bid's own).
        offers.retain(|o| params.can_win(o));
        for o in &mut offers {
            o.dph_total = params.rented_dph(o);
        }
        lock(&self.shared.offers).insert(query, (Instant::now(), offers.clone()));
        Ok(offers)
    }

    /// Drops `offer` from every cached search: it was just rented, or cannot be.
    fn offer_taken(&self, offer: u64) {
        for (_, offers) in lock(&self.shared.offers).values_mut() {
            offers.retain(|o| o.id != offer);
        }
    }

    /// Rents an instance for `key` (the create lock is held).
    async fn rent(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
        params: &GroupParams,
        label: &str,
    ) -> Result<LeaseGrant, ProviderError> {
        let offer = self.choose_offer(params).await?;
        if let Some(cap) = params.spend_cap_dph {
            self.check_spend_cap(&key.run_id, cap, offer.dph_total)
                .await?;
        }
        let body = self.create_body(template, params, label);
        // Intent first: a crash while the create is in flight finds it.
        let record = CreateRecord {
            label: label.to_owned(),
            offer: offer.id,
            machine: offer.machine_id,
            dph: offer.dph_total,
            sent_ms: now_ms(),
            instance: None,
            load_timeout_s: params.load_timeout.as_secs_f64(),
        };
        write_durably(&self.record_path(key), &record)?;
        tracing::info!(%key, offer = offer.id, machine = offer.machine_id, dph = offer.dph_total, gpu = %offer.gpu_name, "renting an instance");
        // Whatever the answer, this offer is not for the next create.
        self.offer_taken(offer.id);
        let answer = self
            .shared
            .api
            .call(
                Endpoint::Create,
                reqwest::Method::PUT,
                &format!("/api/v0/asks/{}/", offer.id),
                &[],
                Some(&body),
            )
            .await;
        self.create_answered(key, &offer, record, answer)
    }

    /// The cheapest offer for `params` on a machine that has not just
    /// failed; no capacity when there is none.
    async fn choose_offer(&self, params: &GroupParams) -> Result<Offer, ProviderError> {
        let offers = self.search(params).await?;
        let total = offers.len();
        let mut skipped = Vec::new();
        let Some(offer) = offers.into_iter().find(|o| {
            let bad = self.is_bad(o.machine_id);
            if bad {
                skipped.push(o.machine_id);
            }
            !bad
        }) else {
            return Err(definite(
                FaultKind::NoCapacity,
                if total == 0 {
                    format!(
                        "no capacity: no offer matches ({}); retried later",
                        params.describe()
                    )
                } else {
                    format!(
                        "no capacity: the {total} matching offer(s) are on machines that just failed ({}); retried later",
                        skipped
                            .iter()
                            .map(u64::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
            ));
        };
        Ok(offer)
    }

    /// Refuses an offer at `offer_dph` that would take the run over `cap`.
    async fn check_spend_cap(
        &self,
        run: &RunId,
        cap: f64,
        offer_dph: f64,
    ) -> Result<(), ProviderError> {
        let live = self.run_spend(run).await?;
        model::check_spend(cap, &live, offer_dph).map_err(|e| definite(FaultKind::Invalid, e))?;
        Ok(())
    }

    /// The body of the create that rents an instance labelled `label`.
    fn create_body(
        &self,
        template: &NodeTemplate,
        params: &GroupParams,
        label: &str,
    ) -> serde_json::Value {
        let mut env: serde_json::Map<String, serde_json::Value> = template
            .boot
            .env
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        env.insert("SWACTOR_LABEL".to_owned(), json!(label));
        let mut body = json!({
            "client_id": "me",
            "image": params.image,
            "disk": params.disk_gb,
            "label": label,
            "onstart": onstart(&self.shared.identity.public_openssh()),
            "runtype": params.ssh.runtype(),
            "env": env,
            "cancel_unavail": true,
        });
        if let Some(hash) = &params.template_hash {
            body["template_hash_id"] = json!(hash);
        }
        if let Some(bid) = params.bid_dph {
            // An interruptible rental at this bid.
            body["price"] = json!(bid);
        }
        body
    }

    /// What the service's answer to the create for `key` (on `offer`)
    /// means: the lease, or why there is none.
    fn create_answered(
        &self,
        key: &ResourceKey,
        offer: &Offer,
        record: CreateRecord,
        answer: Result<serde_json::Value, ApiError>,
    ) -> Result<LeaseGrant, ProviderError> {
        let where_ = format!(
            "offer {} on machine {} ({} × {}, {:.3} $/h)",
            offer.id, offer.machine_id, offer.num_gpus, offer.gpu_name, offer.dph_total
        );
        match answer {
            Ok(body) => match model::parse_created(&body) {
                Ok(id) => self.rented(key, offer, record, id),
                // A success status without the instance: it may exist.
                Err(e) => Err(ProviderError::ambiguous(
                    FaultKind::Unconfirmed,
                    format!(
                        "vast: renting {where_}: {e}; the label is looked for before renting again"
                    ),
                )),
            },
            Err(ApiError::Status { status, body }) => {
                Err(self.create_refused(key, offer.machine_id, &where_, status, &body))
            }
            Err(e @ ApiError::Unsent(_)) => {
                self.forget_record(key);
                Err(definite(
                    FaultKind::Unreachable,
                    format!("renting {where_}: {e}"),
                ))
            }
            Err(e) => Err(ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!(
                    "vast: renting {where_}: {e}; the label is looked for before renting again"
                ),
            )),
        }
    }

    /// Records instance `id`, created for `key` on `offer`, and leases it.
    fn rented(
        &self,
        key: &ResourceKey,
        offer: &Offer,
        mut record: CreateRecord,
        id: u64,
    ) -> Result<LeaseGrant, ProviderError> {
        record.instance = Some(id);
        write_durably(&self.record_path(key), &record)?;
        tracing::info!(%key, instance = id, "rented an instance");
        lock(&self.shared.shown).insert(
            key.clone(),
            InstanceInfo {
                instance: id,
                offer: offer.id,
                machine: offer.machine_id,
                dph: offer.dph_total,
                status: "being set up".to_owned(),
            },
        );
        Ok(LeaseGrant {
            lease: lease_of(id),
            endpoint: None,
        })
    }

    /// The error for a create refused with `status`: the record is
    /// forgotten unless the refusal leaves the outcome unknown, and a
    /// machine without capacity is marked bad.
    fn create_refused(
        &self,
        key: &ResourceKey,
        machine: u64,
        where_: &str,
        status: u16,
        body: &str,
    ) -> ProviderError {
        let failure = model::classify_create(status, body);
        if !matches!(failure, CreateFailure::Unknown(_)) {
            self.forget_record(key);
        }
        match failure {
            CreateFailure::Capacity(m) => {
                self.mark_bad(Some(machine), &m);
                definite(
                    FaultKind::NoCapacity,
                    format!(
                        "no capacity: {where_} cannot be rented: {m}; the next try uses another offer"
                    ),
                )
            }
            CreateFailure::Refused(m) => definite(
                FaultKind::Refused,
                format!("the service refused to rent {where_}: {m}"),
            ),
            CreateFailure::Auth(m) => definite(
                FaultKind::Denied,
                format!("the service refused the API key: {m}; check VAST_API_KEY"),
            ),
            CreateFailure::RateLimited(m) => definite(
                FaultKind::RateLimited,
                format!("rate limited while renting {where_}: {m}"),
            ),
            CreateFailure::Unknown(m) => ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!(
                    "vast: renting {where_}: {m}; the label is looked for before renting again"
                ),
            ),
        }
    }

    async fn connect(&self, id: u64, target: &str) -> Result<SshSession, SshError> {
        let cached = lock(&self.shared.connections).get(&id).cloned();
        if let Some(s) = cached.filter(|s| !s.is_closed() && s.target() == target) {
            return Ok(s);
        }
        let parsed: SshTarget = target.parse().map_err(|e| SshError::Remote {
            target: target.to_owned(),
            reason: format!("{e}"),
        })?;
        let known = KnownHosts::open(&self.known_hosts_path(id));
        let opts = ConnectOptions {
            connect_timeout: self.shared.config.connect_timeout,
            trust_on_first_use: true,
        };
        let s = SshSession::connect(&parsed, &self.shared.identity, &known, &opts).await?;
        lock(&self.shared.connections).insert(id, s.clone());
        Ok(s)
    }

    async fn run(
        &self,
        id: u64,
        target: &str,
        command: &str,
        stdin: Option<&[u8]>,
    ) -> Result<crate::ssh::ExecOutput, SshError> {
        let session = self.connect(id, target).await?;
        match session.exec(command, stdin).await {
            Err(SshError::Broken { .. }) if session.is_closed() => {
                lock(&self.shared.connections).remove(&id);
                self.connect(id, target).await?.exec(command, stdin).await
            }
            other => other,
        }
    }

    /// The SSH target of a running instance, from the last lookup or asked anew.
    async fn target_of(&self, id: u64) -> Result<Option<String>, ProviderError> {
        if let Some(t) = lock(&self.shared.endpoints).get(&id).cloned() {
            return Ok(Some(t));
        }
        match self.show(id).await {
            Ok(Some(i)) => Ok(match model::health(&i) {
                Health::Running(host, port) => {
                    let t = format!("{SSH_USER}@{}:{port}", bracket(&host));
                    lock(&self.shared.endpoints).insert(id, t.clone());
                    Some(t)
                }
                _ => None,
            }),
            Ok(None) => Ok(None),
            Err(e) => Err(read_failed("looking up the instance", &e)),
        }
    }

    async fn agent_binary(&self) -> Result<(Arc<Vec<u8>>, String), ProviderError> {
        let path = self.shared.config.agent_binary.clone();
        self.shared
            .binary
            .get_or_try_init(|| async move {
                let bytes = tokio::fs::read(&path).await.map_err(|e| {
                    definite(
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

    async fn follow(
        &self,
        id: u64,
        target: &str,
        key: &ResourceKey,
        session: SessionId,
    ) -> Result<BootstrapSession, ProviderError> {
        let ssh = self.connect(id, target).await?;
        let lines = ssh
            .exec_lines(&remote::follow(&remote::node_dir(key)))
            .await?;
        Ok(start_relay(
            &self.shared.sessions,
            session,
            lines,
            format!("instance {id} ({target})"),
        ))
    }

    /// How long `id` has been loading, for its load timeout.
    fn loading_for(&self, id: u64, record: Option<&CreateRecord>) -> Duration {
        match record.filter(|r| r.instance == Some(id)) {
            Some(r) => r.age(),
            None => lock(&self.shared.first_seen)
                .entry(id)
                .or_insert_with(Instant::now)
                .elapsed(),
        }
    }
}

impl VastProvider {
    /// What an instance whose SSH does not answer means for its attempt:
    /// the lease is gone when the instance vanished, was destroyed or
    /// failed (the attempt ends instead of retrying forever); otherwise the
    /// SSH error, to be retried.
    async fn unreachable(&self, key: &ResourceKey, id: u64, err: SshError) -> ProviderError {
        let record = self.record(key).filter(|r| r.instance == Some(id));
        let recent = record
            .as_ref()
            .is_some_and(|r| r.age() < self.shared.config.listing_lag);
        match self.show(id).await {
            Ok(None) if !recent => ProviderError::gone(
                FaultKind::Deleted,
                format!("instance {id} no longer exists ({err})"),
            ),
            Ok(Some(i)) => match model::health(&i) {
                Health::Failed(why) => {
                    self.mark_bad(i.machine_id, &why);
                    ProviderError::gone(
                        FaultKind::MachineFailed,
                        format!("{why}; it is destroyed and the node goes to another offer"),
                    )
                }
                Health::Destroyed => {
                    ProviderError::gone(FaultKind::Deleted, format!("instance {id} was destroyed"))
                }
                _ => err.into(),
            },
            _ => err.into(),
        }
    }

    /// Not ready yet, unless `id` has been short of ready for longer than
    /// its group's `load_timeout_s`: then the attempt ends and the machine
    /// is skipped by later creates.
    fn not_ready_within_load_timeout(
        &self,
        id: u64,
        i: &Instance,
        record: Option<&CreateRecord>,
        status: &str,
    ) -> Result<NodeEndpoint, ProviderError> {
        let limit = record.map_or(model::LOAD_TIMEOUT_DEFAULT, |r| {
            Duration::from_secs_f64(r.load_timeout_s)
        });
        let waited = self.loading_for(id, record);
        if waited > limit {
            let why = format!(
                "instance {id} is still {status} after {}s (load_timeout_s is {}s); it is destroyed and the node goes to another offer",
                waited.as_secs(),
                limit.as_secs()
            );
            self.mark_bad(i.machine_id, &why);
            return Err(ProviderError::gone(FaultKind::LoadTimeout, why));
        }
        Err(ProviderError::NotReady)
    }
}

/// An IPv6 address in brackets, for `user@[addr]:port`.
fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

#[async_trait]
impl Provider for VastProvider {
    fn kind(&self) -> &'static str {
        "vast"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let params = GroupParams::of(template).map_err(|e| definite(FaultKind::Invalid, e))?;
        let _guard = self.lock_key(key).await;
        let label = model::label_of(key, self.shared.config.deployment.as_deref());
        if label.len() > model::LABEL_LEN_MAX {
            return Err(definite(
                FaultKind::Invalid,
                format!(
                    "the label {label:?} is longer than the service's {} characters; use a shorter run or group id",
                    model::LABEL_LEN_MAX
                ),
            ));
        }
        if let Some(i) = self.adopt(key, &label).await? {
            tracing::debug!(%key, instance = i.id, "adopted an instance by its label");
            // The record names the instance from now on (its load timeout
            // runs from the create, or from now for one found without a record).
            let record = match self.record(key) {
                Some(r) if r.instance == Some(i.id) => r,
                old => {
                    let r = CreateRecord {
                        label: label.clone(),
                        offer: old.as_ref().map_or(0, |r| r.offer),
                        machine: i
                            .machine_id
                            .or(old.as_ref().map(|r| r.machine))
                            .unwrap_or(0),
                        dph: i.dph_total.or(old.as_ref().map(|r| r.dph)).unwrap_or(0.0),
                        sent_ms: old.as_ref().map_or_else(now_ms, |r| r.sent_ms),
                        instance: Some(i.id),
                        load_timeout_s: params.load_timeout.as_secs_f64(),
                    };
                    write_durably(&self.record_path(key), &r)?;
                    r
                }
            };
            self.remember_shown(key, &i, Some(&record));
            return Ok(LeaseGrant {
                lease: lease_of(i.id),
                endpoint: None,
            });
        }
        let _create = self.shared.create_lock.lock().await;
        self.rent(key, template, &params, &label).await
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        let id = instance_of(lease)?;
        let record = self.record(key).filter(|r| r.instance == Some(id));
        let shown = self
            .show(id)
            .await
            .map_err(|e| read_failed(&format!("looking up instance {id}"), &e))?;
        let Some(i) = shown else {
            if record
                .as_ref()
                .is_some_and(|r| r.age() < self.shared.config.listing_lag)
            {
                return Err(ProviderError::NotReady);
            }
            return Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("instance {id} no longer exists"),
            ));
        };
        self.remember_shown(key, &i, record.as_ref());
        match model::health(&i) {
            Health::Running(host, port) => {
                let target = format!("{SSH_USER}@{}:{port}", bracket(&host));
                lock(&self.shared.endpoints).insert(id, target.clone());
                // Running is not enough: the endpoint is ready once SSH
                // answers and takes our key (`onstart` may not have run yet).
                match self.connect(id, &target).await {
                    Ok(_) => Ok(NodeEndpoint::from(format!("ssh:{target}"))),
                    Err(
                        e @ (SshError::NotReady { .. }
                        | SshError::Auth { .. }
                        | SshError::Broken { .. }),
                    ) => self.not_ready_within_load_timeout(
                        id,
                        &i,
                        record.as_ref(),
                        &format!("running, but SSH is not ready ({e})"),
                    ),
                    Err(e) => Err(definite(e.fault_kind(), format!("instance {id}: {e}"))),
                }
            }
            Health::Pending(status) => {
                self.not_ready_within_load_timeout(id, &i, record.as_ref(), &status)
            }
            Health::Failed(why) => {
                self.mark_bad(i.machine_id, &why);
                Err(ProviderError::gone(
                    FaultKind::MachineFailed,
                    format!("{why}; it is destroyed and the node goes to another offer"),
                ))
            }
            Health::Destroyed => Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("instance {id} was destroyed"),
            )),
        }
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let id = instance_of(lease)?;
        let target = match endpoint.0.strip_prefix("ssh:") {
            Some(t) => t.to_owned(),
            None => {
                return Err(definite(
                    FaultKind::Invalid,
                    format!("{} is not an SSH endpoint", endpoint.0),
                ));
            }
        };
        let _guard = self.lock_key(key).await;
        let dir = remote::node_dir(key);
        let out = match self.run(id, &target, &remote::agent_pid(&dir), None).await {
            Ok(out) => out,
            Err(e) if !e.is_definite() => return Err(self.unreachable(key, id, e).await),
            Err(e) => return Err(e.into()),
        };
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !pid.is_empty() {
            return self
                .follow(id, &target, key, session_of(id, key, &pid))
                .await;
        }
        let (bytes, sha) = self.agent_binary().await?;
        let binary = remote::binary_path(&sha);
        let ok = self
            .run(id, &target, &remote::binary_matches(&binary, &sha), None)
            .await?;
        if String::from_utf8_lossy(&ok.stdout).trim() != "ok" {
            self.connect(id, &target)
                .await?
                .upload(&binary, &bytes, 0o755)
                .await?;
            tracing::info!(instance = id, %binary, "uploaded the agent binary");
        }
        let credentials = AgentCredentials::derive(&self.shared.config.token_secret, key);
        let out = self
            .run(
                id,
                &target,
                &format!(
                    "{} && cp -p {d}/agent.credentials {d}/{RESUME_CREDENTIALS}",
                    remote::write_credentials(&dir),
                    d = crate::ssh::quote(&dir)
                ),
                Some(credentials.to_text().as_bytes()),
            )
            .await?;
        if !out.success() {
            return Err(definite(
                FaultKind::Refused,
                format!(
                    "cannot write the agent's credentials on instance {id}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        // The agent ends its own instance, with the instance's own key,
        // if its lease lapses (see [`own`]).
        let end_own = [
            format!("--vast-url={}", self.shared.api.base()),
            format!("--vast-instance-file={}", own::INSTANCE_FILE),
        ];
        let wrapper = remote::wrapper(
            key,
            &binary,
            &self.shared.config.daemon_ticket.get(),
            template,
            (&[], self.shared.config.deployment.as_deref(), &end_own),
        );
        self.connect(id, &target)
            .await?
            .upload(&format!("{dir}/run.sh"), wrapper.as_bytes(), 0o700)
            .await?;
        let out = self.run(id, &target, &remote::launch(&dir), None).await?;
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if pid.is_empty() || !pid.chars().all(|c| c.is_ascii_digit()) {
            return Err(ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!(
                    "vast: started the agent on instance {id} but it did not record its pid: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        tracing::debug!(%key, instance = id, pid, "started an agent");
        self.follow(id, &target, key, session_of(id, key, &pid))
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let id: u64 = session
            .0
            .strip_prefix("vast:")
            .and_then(|s| s.split('#').next())
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                definite(
                    FaultKind::Invalid,
                    format!("{} is not a vast session", session.0),
                )
            })?;
        let _guard = self.lock_key(key).await;
        self.shared.sessions.mark_cancelled(session);
        // Nothing runs on an instance that is not running.
        let Some(target) = self.target_of(id).await? else {
            return Ok(Release::Done);
        };
        let grace = self.shared.config.term_grace.as_secs().max(1);
        let out = self
            .run(
                id,
                &target,
                &format!(
                    "touch {}/{CANCELLED} 2>/dev/null; {}",
                    crate::ssh::quote(&remote::node_dir(key)),
                    remote::stop_agent(&remote::node_dir(key), grace)
                ),
                None,
            )
            .await?;
        if String::from_utf8_lossy(&out.stdout).trim() == "stuck" {
            return Err(ProviderError::ambiguous(
                FaultKind::Unstoppable,
                format!("vast: the agent of {key} on instance {id} outlived SIGKILL"),
            ));
        }
        Ok(Release::Done)
    }

    /// Its machine is skipped by later creates, whatever the reason: an
    /// instance that served and then failed may fail the next node too.
    async fn destroy_failed_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        reason: &str,
    ) -> Result<Release, ProviderError> {
        let id = instance_of(lease)?;
        let shown = lock(&self.shared.shown)
            .get(key)
            .filter(|i| i.instance == id)
            .map(|i| i.machine);
        let machine = shown.filter(|m| *m != 0).or_else(|| {
            self.record(key)
                .filter(|r| r.instance == Some(id))
                .map(|r| r.machine)
        });
        self.mark_bad(machine, &format!("{key} failed on it: {reason}"));
        self.destroy_lease(key, lease).await
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let id = instance_of(lease)?;
        let _guard = self.lock_key(key).await;
        self.destroy(id).await?;
        if self.record(key).is_some_and(|r| r.instance == Some(id)) {
            self.forget_record(key);
        }
        lock(&self.shared.shown).remove(key);
        tracing::info!(%key, instance = id, "destroyed an instance");
        Ok(Release::Done)
    }

    async fn paused(&self, key: &ResourceKey, lease: &LeaseId) -> Result<bool, ProviderError> {
        let id = instance_of(lease)?;
        let shown = self
            .show(id)
            .await
            .map_err(|e| read_failed(&format!("showing instance {id}"), &e))?;
        let now_s = now_ms() as f64 / 1000.0;
        let paused = shown.as_ref().is_some_and(|i| outbid(i, now_s));
        if paused {
            tracing::info!(%key, instance = id, "the instance is paused by the service (outbid)");
        }
        Ok(paused)
    }

    fn foreign(&self) -> Vec<crate::ForeignResource> {
        lock(&self.shared.foreign).clone()
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        let listed = self
            .run_instances(run_id)
            .await
            .map_err(|e| read_failed("listing instances", &e))?;
        let mut by_key: BTreeMap<ResourceKey, Instance> = BTreeMap::new();
        for (key, i) in listed {
            match by_key.get(&key) {
                Some(held) if held.id <= i.id => {
                    tracing::warn!(%key, instance = i.id, "a second instance has this node's label");
                }
                _ => {
                    by_key.insert(key, i);
                }
            }
        }
        // Running agents, asked at once.
        let mut asked = tokio::task::JoinSet::new();
        for (key, i) in &by_key {
            if let Health::Running(host, port) = model::health(i) {
                let target = format!("{SSH_USER}@{}:{port}", bracket(&host));
                lock(&self.shared.endpoints).insert(i.id, target.clone());
                let (provider, key, id) = (self.clone(), key.clone(), i.id);
                asked.spawn(async move {
                    let dir = remote::node_dir(&key);
                    let pid = match provider
                        .run(id, &target, &remote::agent_pid(&dir), None)
                        .await
                    {
                        Ok(out) => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
                        Err(_) => String::new(),
                    };
                    (key, id, pid)
                });
            }
        }
        let mut pids = BTreeMap::new();
        while let Some(done) = asked.join_next().await {
            if let Ok((key, id, pid)) = done
                && !pid.is_empty()
            {
                pids.insert(key, (id, pid));
            }
        }
        let mut inventory = Inventory::new();
        for (key, i) in &by_key {
            let record = self.record(key);
            self.remember_shown(key, i, record.as_ref().filter(|r| r.instance == Some(i.id)));
            inventory.insert(
                key.clone(),
                OwnedResources {
                    lease: Some(lease_of(i.id)),
                    session: pids
                        .get(key)
                        .filter(|(id, _)| *id == i.id)
                        .map(|(id, pid)| session_of(*id, key, pid)),
                },
            );
        }
        // Created for sure, not listed yet: listed from the records, so that
        // a restarted daemon adopts them (or collects them).
        for (key, r) in self.records(run_id) {
            if let Some(id) = r.instance
                && !inventory.contains_key(&key)
                && r.age() < self.shared.config.listing_lag
            {
                inventory.insert(
                    key,
                    OwnedResources {
                        lease: Some(lease_of(id)),
                        session: None,
                    },
                );
            }
        }
        Ok(inventory)
    }

    fn listing_lag(&self) -> Duration {
        self.shared.config.listing_lag
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        let id = instance_of(lease).ok()?;
        let shown = lock(&self.shared.shown);
        let i = shown.values().find(|i| i.instance == id)?;
        let offer = if i.offer == 0 {
            String::new()
        } else {
            format!(" · offer {}", i.offer)
        };
        Some(format!(
            "instance {id}{offer} · machine {} · {:.3} $/h · {}",
            i.machine, i.dph, i.status
        ))
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<crate::AgentLogSource, ProviderError> {
        let id = instance_of(lease)?;
        let Some(target) = self.target_of(id).await? else {
            return Err(definite(
                FaultKind::Invalid,
                format!(
                    "vast: instance {id} is not running (or not serving SSH), so its agent log \
                 cannot be read"
                ),
            ));
        };
        let ssh = self.connect(id, &target).await?;
        read_agent_log(&ssh, key, follow, format!("instance {id} ({target})")).await
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with("vast:")
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with("vast:")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ten_thousand_sessions_leave_no_entry_and_no_lock_behind() {
        let state = tempfile::tempdir().unwrap();
        // Never dialled: the sessions are fed from the test.
        let config = VastConfig::new(
            state.path(),
            "/bin/true",
            "http://127.0.0.1:9",
            ApiKey::new("k").unwrap(),
        );
        let p = VastProvider::new(config).unwrap();
        crate::ssh::relay_tests::relay_sessions(&p.shared.sessions, &p.shared.key_locks, 10_000)
            .await;
    }

    #[test]
    fn leases_and_sessions_name_their_instance() {
        assert_eq!(instance_of(&lease_of(42)), Ok(42));
        assert!(instance_of(&LeaseId::from("ssh:root@h:22")).is_err());
        assert!(instance_of(&LeaseId::from("vast:x")).is_err());
        let key = ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("gpu-0").unwrap(),
            attempt: NodeAttemptId(3),
        };
        assert_eq!(session_of(42, &key, "77").0, "vast:42#gpu-0-a3#pid77");
        assert_eq!(bracket("::1"), "[::1]");
        assert_eq!(bracket("127.0.0.1"), "127.0.0.1");
    }

    #[test]
    fn only_an_outbid_bid_instance_within_its_contract_is_paused() {
        let row = |extra: serde_json::Value| {
            let mut v = json!({"id": 7, "actual_status": "stopped", "intended_status": "running",
                               "is_bid": true, "end_date": 2000.0});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            model::parse_instance(&v).unwrap()
        };
        assert!(outbid(&row(json!({})), 1000.0));
        assert!(outbid(&row(json!({"end_date": null})), 1000.0));
        assert!(!outbid(&row(json!({})), 2500.0), "its contract ended");
        assert!(!outbid(&row(json!({"is_bid": false})), 1000.0), "on demand");
        assert!(
            !outbid(&row(json!({"intended_status": "stopped"})), 1000.0),
            "stopped by its owner"
        );
        assert!(
            !outbid(&row(json!({"actual_status": "exited"})), 1000.0),
            "ended by itself"
        );
        assert!(!outbid(&row(json!({"actual_status": "running"})), 1000.0));
    }

    #[test]
    fn the_onstart_script_adds_the_key_once_and_quotes_it() {
        let s = onstart("ssh-ed25519 AAAA swactor");
        assert!(s.contains("'ssh-ed25519 AAAA swactor'"));
        assert!(s.contains("grep -qxF"));
        assert!(s.contains("chmod 600 ~/.ssh/authorized_keys"));
    }

    /// Run the way the service runs it at a container's start: the first
    /// time it only adds the key; once a wrapper is there it starts it
    /// again, unless the attempt was cancelled or ended by itself.
    #[test]
    fn the_onstart_script_keeps_the_instances_own_key_for_its_agent_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let home = tempfile::tempdir().unwrap();
        let run = |env: &[(&str, &str)]| {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(onstart("ssh-ed25519 AAAA swactor"))
                .env("HOME", home.path())
                .env_remove("CONTAINER_ID")
                .env_remove("CONTAINER_API_KEY")
                .envs(env.iter().copied())
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        let file = home.path().join(INSTANCE_FILE);
        run(&[]);
        assert!(!file.exists(), "no key from the service, no file");
        run(&[("CONTAINER_ID", "77"), ("CONTAINER_API_KEY", "k3y")]);
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "CONTAINER_ID=77\nCONTAINER_API_KEY=k3y\n"
        );
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "readable by its owner only");
        let own = OwnInstance::find(&file).unwrap();
        assert_eq!(own.id, 77);
    }

    #[test]
    fn the_onstart_script_starts_a_stopped_agent_again() {
        let home = tempfile::tempdir().unwrap();
        let run = |s: &str| {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(s)
                .env("HOME", home.path())
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        let s = onstart("ssh-ed25519 AAAA swactor");
        run(&s);
        let keys = std::fs::read_to_string(home.path().join(".ssh/authorized_keys")).unwrap();
        assert_eq!(keys, "ssh-ed25519 AAAA swactor\n");
        let dirs: Vec<_> = ["r/w-0-1", "r/w-1-1", "r/w-2-1"]
            .iter()
            .map(|d| home.path().join(remote::ROOT).join("nodes").join(d))
            .collect();
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join(RESUME_CREDENTIALS), "creds").unwrap();
            let wrapper = "#!/bin/sh\ncd \"$(dirname \"$0\")\" || exit 1\necho $$ > agent.pid\necho started > started\n";
            std::fs::write(d.join("run.sh"), wrapper).unwrap();
            std::fs::set_permissions(
                d.join("run.sh"),
                std::os::unix::fs::PermissionsExt::from_mode(0o700),
            )
            .unwrap();
        }
        std::fs::write(dirs[1].join(CANCELLED), "").unwrap();
        std::fs::write(dirs[2].join("exit_status"), "0\n").unwrap();
        run(&s);
        let started = |d: &std::path::Path| {
            (0..50).any(|_| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                d.join("started").exists()
            })
        };
        assert!(started(&dirs[0]), "the stopped agent is started again");
        assert_eq!(
            std::fs::read_to_string(dirs[0].join("agent.credentials")).unwrap(),
            "creds",
            "with its credentials"
        );
        assert!(!started(&dirs[1]), "a cancelled one is not");
        assert!(!dirs[2].join("started").exists(), "one that ended is not");
        let keys = std::fs::read_to_string(home.path().join(".ssh/authorized_keys")).unwrap();
        assert_eq!(keys, "ssh-ed25519 AAAA swactor\n", "the key is added once");
    }
}
