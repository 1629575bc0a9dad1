//! The mock's state and the API's semantics: offers, instances, keys, counters, faults.
//!
//! Every call takes `now`. Instance status is a function of the creation
//! instant and `now`; [`World::settle`] (run first by every call) applies
//! what time has decided since the last call: it ends contracts past their
//! end, starts the sshd and the `onstart` script of an instance that has
//! become `running`, reads what the script wrote and whether it exited, and
//! forgets destroyed instances whose grace period is over. No timer runs in
//! the background; what does run there is the instance's own: its sshd,
//! its `onstart` processes and its SSH proxy (see [`crate::machine`]).
//!
//! One file of over 1,000 lines: every call settles and reads the same private
//! state (offers, instances, keys, counters), and a split would only move
//! that state's fields behind accessors.

use crate::config::{Endpoint, MockConfig, Offer, RateLimits, STORAGE_COST_DEFAULT, Timings};
use crate::faults::{Ambiguity, Death, Faults, Gone, InstanceFault, Selector, SplitMix64, Traits};
use crate::filter;
use crate::machine::{Gpus, Machine};
use crate::restricted::{self, Destroy, KeyUse};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The first instance id; ids grow by one.
const FIRST_INSTANCE_ID: u64 = 24_000_001;
/// The account's user id in rows that carry one.
const USER_ID: u64 = 321_123;
/// Labels longer than this are refused, as by Vast.ai.
const LABEL_LEN_MAX: usize = 256;
/// The smallest disk a create may ask for, GB.
const DISK_MIN_GB: f64 = 8.0;
/// The v1 listing's page size limit.
const PAGE_LEN_MAX: usize = 25;
/// `POST /bundles/` returns at most this many offers without a `limit`.
const SEARCH_LEN_DEFAULT: usize = 64;
/// Keys found in `onstart`/`env` and account keys are capped, like everything.
const KEYS_MAX: usize = 256;
/// Bulk calls take at most this many ids (the official client sends 64 a call).
const BULK_IDS_MAX: usize = 64;
/// Lines an instance's log keeps (the oldest go first).
const LOG_LINES_MAX: usize = 10_000;
/// Lines `request_logs` answers without a `tail` (the client's default).
const LOG_TAIL_DEFAULT: usize = 1000;
/// Results (logs, command outputs) kept for their URLs; the oldest go first.
const RESULTS_MAX: usize = 256;
/// Destroys the destroy log keeps; the oldest go first.
const DESTROYS_MAX: usize = 10_000;
/// An offer's `duration` (seconds its listing has left at the mock's
/// start) when its `extra` names none: 30 days.
const DURATION_DEFAULT_S: f64 = 30.0 * 24.0 * 3600.0;
/// Where a running instance's SSH proxy is (`ssh_host`); its port is the
/// instance's `ssh_port`. Not `public_ipaddr`, so that a client can tell
/// which endpoint it took.
pub const PROXY_HOST: &str = "localhost";

/// An HTTP answer the server writes, and what it does around it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) body: Body,
    pub(crate) after: After,
}

/// A response body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Body {
    Json(Value),
    /// Text with its content type.
    Text(String, &'static str),
}

/// How the server delivers a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Write it.
    Respond,
    /// Write nothing for this long, then close the connection.
    HoldThenCut(Duration),
    /// Close the connection without writing anything.
    Cut,
}

impl Reply {
    pub(crate) fn json(status: u16, body: Value) -> Self {
        Self {
            status,
            body: Body::Json(body),
            after: After::Respond,
        }
    }

    fn ok(body: Value) -> Self {
        Self::json(200, body)
    }

    pub(crate) fn invalid_args(msg: impl Into<String>) -> Self {
        Self::json(
            400,
            json!({"success": false, "error": "invalid_args", "msg": msg.into()}),
        )
    }

    /// The same answer cut off halfway through its JSON, as a broken proxy
    /// or a half-written response leaves it (still a 200).
    fn cut_off(self) -> Self {
        let text = match self.body {
            Body::Json(v) => v.to_string(),
            Body::Text(t, _) => t,
        };
        let mut end = text.len() / 2;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        Self {
            status: self.status,
            body: Body::Text(text[..end].to_owned(), "application/json"),
            after: After::Respond,
        }
    }

    /// A 429: JSON `{"success":false,"error":"rate_limited","msg":…}` (the
    /// official client prints `msg`), or the same words as plain text.
    fn too_frequent(interval: Duration, text: bool) -> Self {
        let msg = format!(
            "API requests too frequent: endpoint threshold={:.2}s",
            interval.as_secs_f64()
        );
        if text {
            Self {
                status: 429,
                body: Body::Text(msg, "text/plain; charset=utf-8"),
                after: After::Respond,
            }
        } else {
            Self::json(
                429,
                json!({"success": false, "error": "rate_limited", "msg": msg}),
            )
        }
    }

    fn server_error(status: u16) -> Self {
        match status {
            502..=504 => {
                let title = match status {
                    502 => "502 Bad Gateway",
                    503 => "503 Service Temporarily Unavailable",
                    _ => "504 Gateway Time-out",
                };
                Self {
                    status,
                    body: Body::Text(
                        format!(
                            "<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n<center><h1>{title}</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
                        ),
                        "text/html",
                    ),
                    after: After::Respond,
                }
            }
            _ => Self::json(
                status,
                json!({"success": false, "error": "server_error", "msg": "Internal server error."}),
            ),
        }
    }
}

/// One API call, decoded from HTTP by the server. The bulk calls carry
/// their ids in the body: `CreateBulk` (`POST /asks/bulk/`) `ids` and one
/// create body, `UpdateBulk` (`PUT /instances/`) `ids` and a `state` (or
/// `label`), `DestroyBulk` (`DELETE /instances/`) `instance_ids`.
#[derive(Debug, Clone)]
pub(crate) enum Call {
    Search { body: Value },
    Create { offer_id: u64, body: Value },
    ListV0,
    ListV1 { query: HashMap<String, String> },
    Show { id: u64 },
    Update { id: u64, body: Value },
    Destroy { id: u64 },
    CreateBulk { body: Value },
    UpdateBulk { body: Value },
    DestroyBulk { body: Value },
    Reboot { id: u64 },
    ChangeBid { id: u64, body: Value },
    Logs { id: u64, body: Value },
    Execute { id: u64, body: Value },
    SshCreate { body: Value },
    SshList,
    SshDelete { id: u64 },
    SshAttach { id: u64, body: Value },
    Filters,
    CurrentUser,
}

impl Call {
    /// The rate-limited endpoint group of the call, if any.
    fn endpoint(&self) -> Option<Endpoint> {
        match self {
            Call::Search { .. } => Some(Endpoint::Search),
            Call::Create { .. } | Call::CreateBulk { .. } => Some(Endpoint::Create),
            Call::ListV0 | Call::ListV1 { .. } => Some(Endpoint::List),
            Call::Show { .. } => Some(Endpoint::Show),
            Call::Update { .. }
            | Call::UpdateBulk { .. }
            | Call::Reboot { .. }
            | Call::ChangeBid { .. } => Some(Endpoint::Label),
            Call::Destroy { .. } | Call::DestroyBulk { .. } => Some(Endpoint::Destroy),
            _ => None,
        }
    }
}

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Created or started: null for `provisioning`, then `loading` for `loading`.
    Booting {
        since: Instant,
        provisioning: Duration,
        loading: Duration,
    },
    Running,
    /// Rebooting (`PUT /instances/reboot/{id}/`): `rebooting` for `duration`,
    /// then running again.
    Rebooting {
        since: Instant,
        duration: Duration,
    },
    /// Loading ended in an OCI runtime error.
    BootFailed,
    /// The `onstart` script exited non-zero: the container exited with it.
    OnstartFailed,
    /// The contract reached its `end_date`: the host stopped the instance,
    /// and it cannot start again.
    Expired,
    Stopped,
    /// An interruptible instance another rental outbid: paused (stopped,
    /// its storage still billed) until its bid wins again.
    Outbid,
    /// Created on an offer that could not be scheduled.
    Unschedulable,
    Dead(Death),
    Destroyed {
        at: Instant,
    },
}

#[derive(Debug)]
struct Instance {
    id: u64,
    offer: Offer,
    label: Option<String>,
    image: String,
    disk: f64,
    onstart: Option<String>,
    env: Vec<(String, String)>,
    runtype: Option<String>,
    bid: Option<f64>,
    start_date: f64,
    /// When the contract ends (its offer's listing end at the create), and
    /// the same as unix seconds (`end_date`); `None`: never.
    ends: Option<(Instant, f64)>,
    /// How the `onstart` script exited, when it failed the container.
    exit_msg: Option<String>,
    listed_from: Instant,
    traits: Traits,
    phase: Phase,
    authorized: Vec<String>,
    /// Its restricted key (`CONTAINER_API_KEY`): it may start, stop or
    /// destroy this instance and nothing else.
    key: String,
    machine: Machine,
    /// What `request_logs` answers: the container's life, as the mock saw it.
    log: VecDeque<String>,
}

impl Instance {
    fn note(&mut self, line: String) {
        if self.log.len() >= LOG_LINES_MAX {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    fn started_line(&self) -> String {
        format!(
            "vastmock: container of instance {} started from {} ({}x {})",
            self.id, self.image, self.offer.num_gpus, self.offer.gpu_name
        )
    }

    /// The container starts (first boot, start, reboot, a bid won): the
    /// sshd and the proxy, then the `onstart` script.
    fn start_container(&mut self, real_ssh: bool) {
        self.phase = Phase::Running;
        self.exit_msg = None;
        self.machine
            .run(&self.authorized, real_ssh && !self.traits.ssh_never_ready);
        let line = self.started_line();
        self.note(line);
        if let Some(script) = self.onstart.clone().filter(|s| !s.trim().is_empty()) {
            if let Err(e) = self.machine.start_onstart(&script, &self.container_env()) {
                self.note(format!("vastmock: cannot run onstart: {e}"));
            } else {
                self.note("vastmock: running onstart".to_owned());
            }
        }
    }

    /// The container's environment: the create's `env`, then `CONTAINER_ID`
    /// and `CONTAINER_API_KEY`, which win over entries of the same name.
    fn container_env(&self) -> Vec<(String, String)> {
        const OWN: [&str; 2] = ["CONTAINER_ID", "CONTAINER_API_KEY"];
        let mut env: Vec<(String, String)> = self
            .env
            .iter()
            .filter(|(k, _)| !OWN.contains(&k.as_str()))
            .cloned()
            .collect();
        env.push((OWN[0].to_owned(), self.id.to_string()));
        env.push((OWN[1].to_owned(), self.key.clone()));
        env
    }

    /// Reads what the `onstart` run wrote into the log; when it exited
    /// non-zero, the container exits with it.
    fn watch_onstart(&mut self) {
        let news = self.machine.poll_onstart();
        for line in news.lines {
            self.note(line);
        }
        let Some(exit) = news.exit else {
            return;
        };
        if exit.success() {
            self.note("vastmock: onstart exited with status 0".to_owned());
        } else if matches!(self.phase, Phase::Running) {
            let how = exit_words(exit);
            self.note(format!("vastmock: container exited: onstart {how}"));
            self.machine.halt();
            self.phase = Phase::OnstartFailed;
            self.exit_msg = Some(format!("Container exited: onstart {how}"));
        }
    }

    /// Whether its contract has ended by `now`.
    fn expired_by(&self, now: Instant) -> bool {
        self.ends.is_some_and(|(at, _)| now >= at)
    }
}

/// "exited with status N" or "was killed by signal N".
fn exit_words(exit: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (exit.code(), exit.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => "ended".to_owned(),
    }
}

/// What the Rust API shows of an instance.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceView {
    /// The instance (contract) id.
    pub id: u64,
    /// The offer it was created from.
    pub offer_id: u64,
    /// Its label.
    pub label: Option<String>,
    /// `actual_status` now (`None`: still provisioning).
    pub actual_status: Option<String>,
    /// `intended_status` now.
    pub intended_status: String,
    /// Its sshd's port on 127.0.0.1, once it has one: the direct endpoint
    /// (`ports["22/tcp"]`) when its offer has direct ports. The row's
    /// `ssh_port` is the proxy, [`InstanceView::proxy_port`].
    pub ssh_port: Option<u16>,
    /// Its SSH proxy's port on `localhost` (the row's `ssh_host`/`ssh_port`),
    /// from its first boot on; every instance has one.
    pub proxy_port: Option<u16>,
    /// Whether its offer has direct ports (`direct_port_count` ≥ 1), so that
    /// the row names the sshd's port in `ports["22/tcp"]`.
    pub direct: bool,
    /// Its contract's end (`end_date`, unix seconds); `None`: never.
    pub end_date: Option<f64>,
    /// Whether a real sshd answers on that port now.
    pub ssh_up: bool,
    /// The machine directory (removed at destroy).
    pub dir: PathBuf,
    /// The sshd's home directory (`$HOME` of SSH commands), once started.
    pub home: Option<PathBuf>,
    /// The public keys its sshd accepts.
    pub authorized_keys: Vec<String>,
    /// Whether it is destroyed (shown as `destroyed` during the grace period).
    pub destroyed: bool,
    /// Its row as `GET /instances/{id}/` shows it.
    pub row: Value,
}

impl InstanceView {
    /// `root@127.0.0.1:{ssh_port}`, once it has a port (whether or not an
    /// sshd answers there now: see [`InstanceView::ssh_up`]).
    pub fn ssh_target(&self) -> Option<swactor_providers::ssh::SshTarget> {
        Some(swactor_providers::ssh::SshTarget {
            user: "root".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: self.ssh_port?,
        })
    }

    /// `root@localhost:{proxy_port}`: the SSH proxy, once it has one.
    pub fn proxy_target(&self) -> Option<swactor_providers::ssh::SshTarget> {
        Some(swactor_providers::ssh::SshTarget {
            user: "root".to_owned(),
            host: PROXY_HOST.to_owned(),
            port: self.proxy_port?,
        })
    }
}

/// The creation counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) creates_total: u64,
    /// Per label; unlabeled creates count under `""`.
    pub(crate) creates_per_label: BTreeMap<String, u64>,
}

#[derive(Debug, Clone)]
struct SshKey {
    id: u64,
    public_key: String,
    created_at: f64,
}

/// Everything the mock knows.
#[derive(Debug)]
pub(crate) struct World {
    api_key: String,
    timings: Timings,
    rate_limits: RateLimits,
    real_ssh: bool,
    machines_dir: PathBuf,
    /// The runtime SSH proxies run on.
    runtime: tokio::runtime::Handle,
    offers: BTreeMap<u64, Offer>,
    /// offer id → when its listing ends (`None`: never), from its `duration`.
    listing_ends: HashMap<u64, Option<Instant>>,
    /// offer id → instance id renting it.
    rented: HashMap<u64, u64>,
    instances: BTreeMap<u64, Instance>,
    ssh_keys: Vec<SshKey>,
    next_instance_id: u64,
    next_key_id: u64,
    pub(crate) faults: Faults,
    counters: Counters,
    /// (key, endpoint) → when the next call is due if no burst is left
    /// (the "theoretical arrival time" of a token bucket, GCRA).
    due: HashMap<(String, Endpoint), Instant>,
    /// The base URL result URLs (logs, command outputs) are served under.
    base_url: String,
    /// Results by token, oldest first.
    results: VecDeque<(String, String)>,
    tokens: SplitMix64,
    /// Every successful destroy, oldest first (at most [`DESTROYS_MAX`]).
    destroys: VecDeque<Destroy>,
    /// Makes restricted keys only when the system's generator cannot.
    key_fallback: SplitMix64,
}

impl World {
    pub(crate) fn new(
        config: &MockConfig,
        api_key: String,
        machines_dir: PathBuf,
        base_url: String,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        let now = unix_now();
        let start = Instant::now();
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut world = Self {
            api_key,
            timings: config.timings,
            rate_limits: config.rate_limits,
            real_ssh: config.real_ssh,
            machines_dir,
            runtime,
            offers: config.offers.iter().map(|o| (o.id, o.clone())).collect(),
            listing_ends: config
                .offers
                .iter()
                .map(|o| (o.id, listing_end(o, start)))
                .collect(),
            rented: HashMap::new(),
            instances: BTreeMap::new(),
            ssh_keys: Vec::new(),
            next_instance_id: FIRST_INSTANCE_ID,
            next_key_id: 1,
            faults: Faults {
                flaky_destroy_status: 500,
                ..Faults::default()
            },
            counters: Counters::default(),
            due: HashMap::new(),
            base_url,
            results: VecDeque::new(),
            tokens: SplitMix64::new(seed ^ 0x5eed),
            destroys: VecDeque::new(),
            key_fallback: SplitMix64::new(seed.rotate_left(17) ^ u64::from(std::process::id())),
        };
        for key in &config.ssh_keys {
            world.add_ssh_key(key.clone(), now);
        }
        world
    }

    /// Applies what time decided since the last call (see the module doc).
    /// Blocks while sshds start.
    pub(crate) fn settle(&mut self, now: Instant) {
        let real_ssh = self.real_ssh;
        let visible = self.timings.destroyed_visible;
        let mut purge = Vec::new();
        for inst in self.instances.values_mut() {
            if inst.expired_by(now)
                && !matches!(inst.phase, Phase::Expired | Phase::Destroyed { .. })
            {
                inst.machine.halt();
                inst.phase = Phase::Expired;
                inst.note(
                    "vastmock: container stopped: the contract reached its end_date".to_owned(),
                );
            }
            match inst.phase {
                Phase::Booting {
                    since,
                    provisioning,
                    loading,
                } if !inst.traits.stuck && now >= since + provisioning + loading => {
                    if inst.traits.boot_failure {
                        inst.phase = Phase::BootFailed;
                        inst.note(format!("vastmock: {BOOT_FAILURE_MSG}"));
                    } else {
                        inst.start_container(real_ssh);
                    }
                }
                Phase::Rebooting { since, duration } if now >= since + duration => {
                    inst.start_container(real_ssh);
                }
                Phase::Destroyed { at } if now >= at + visible => purge.push(inst.id),
                _ => {}
            }
            if matches!(inst.phase, Phase::Running) {
                inst.watch_onstart();
            }
        }
        for id in purge {
            self.instances.remove(&id);
        }
    }

    /// Which key `key` is: the account's, or the restricted key of an
    /// instance that is not destroyed; `None` for any other (or none).
    fn key_use(&self, key: Option<&str>) -> Option<KeyUse> {
        let key = key?;
        if key == self.api_key {
            return Some(KeyUse::Account);
        }
        self.instances
            .values()
            .find(|i| i.key == key && !matches!(i.phase, Phase::Destroyed { .. }))
            .map(|i| KeyUse::Instance(i.id))
    }

    /// Answers an API call presenting `key` (`None`: no key given).
    pub(crate) fn handle(&mut self, key: Option<&str>, call: Call, now: Instant) -> Reply {
        // A destroyed instance's key is no key: it is `Destroyed` from the
        // destroy on, so no settling is needed to see it.
        let Some(by) = self.key_use(key) else {
            return Reply::json(
                401,
                json!({"success": false, "error": "auth_error", "msg": "Invalid user key"}),
            );
        };
        if let KeyUse::Instance(own) = by
            && !restricted::allows(own, &call)
        {
            return restricted::permission_denied(own);
        }
        let key = key.unwrap_or_default();
        self.settle(now);
        if let Some(endpoint) = call.endpoint() {
            let interval = self.rate_limits.interval(endpoint);
            if self.faults.take_burst(endpoint) {
                return Reply::too_frequent(
                    interval.max(Duration::from_millis(100)),
                    self.faults.text_429,
                );
            }
            if !interval.is_zero() {
                let burst = if self.faults.strict_rate_limits {
                    1
                } else {
                    self.rate_limits.burst(endpoint)
                };
                // A token bucket of `burst` calls, one back per interval: a
                // call is accepted unless the bucket's due time is more than
                // `burst - 1` intervals ahead. With a burst of 1 that is a
                // minimum interval after the last accepted call.
                let slot = (key.to_owned(), endpoint);
                let due = self.due.get(&slot).map_or(now, |d| (*d).max(now));
                if due > now + interval * (burst - 1) {
                    return Reply::too_frequent(interval, self.faults.text_429);
                }
                self.due.insert(slot, due + interval);
            }
            if let Some(status) = self.faults.roll_5xx() {
                return Reply::server_error(status);
            }
        }
        let endpoint = call.endpoint();
        let reply = self.answer(call, by, now);
        match endpoint {
            Some(e) if reply.status == 200 && reply.after == After::Respond => {
                if self.faults.take_malformed(e) {
                    reply.cut_off()
                } else {
                    reply
                }
            }
            _ => reply,
        }
    }

    fn answer(&mut self, call: Call, by: KeyUse, now: Instant) -> Reply {
        match call {
            Call::Search { body } => self.search(&body, now),
            Call::Create { offer_id, body } => self.create(offer_id, &body, now),
            Call::ListV0 => Reply::ok(json!({"instances": self.listed(now)})),
            Call::ListV1 { query } => self.list_v1(&query, now),
            Call::Show { id } => {
                let row = self
                    .instances
                    .get(&id)
                    .map_or(Value::Null, |inst| row(inst, now));
                Reply::ok(json!({ "instances": row }))
            }
            Call::Update { id, body } => self.update(id, &body, now),
            Call::Destroy { id } => self.destroy(id, by, now),
            Call::CreateBulk { body } => self.create_bulk(&body, now),
            Call::UpdateBulk { body } => self.update_bulk(&body, now),
            Call::DestroyBulk { body } => self.destroy_bulk(&body, by, now),
            Call::Reboot { id } => self.reboot(id, now),
            Call::ChangeBid { id, body } => self.change_bid(id, &body),
            Call::Logs { id, body } => self.logs(id, &body),
            Call::Execute { id, body } => self.execute(id, &body),
            Call::SshCreate { body } => match body.get("ssh_key").and_then(Value::as_str) {
                Some(k) if looks_like_key(k) => {
                    let key = self.add_ssh_key(k.trim().to_owned(), unix_now());
                    Reply::ok(json!({"success": true, "key": key_row(&key)}))
                }
                _ => Reply::invalid_args("ssh_key must be an OpenSSH public key"),
            },
            Call::SshList => Reply::ok(Value::Array(self.ssh_keys.iter().map(key_row).collect())),
            Call::SshDelete { id } => {
                let before = self.ssh_keys.len();
                self.ssh_keys.retain(|k| k.id != id);
                if self.ssh_keys.len() == before {
                    Reply::json(
                        404,
                        json!({"success": false, "error": "not_found", "msg": "SSH key not found"}),
                    )
                } else {
                    Reply::ok(json!({"success": true}))
                }
            }
            Call::SshAttach { id, body } => self.attach(id, &body),
            Call::Filters => self.filters(now),
            Call::CurrentUser => Reply::ok(json!({
                "id": USER_ID, "username": "vastmock", "email": "mock@localhost",
                "credit": 100.0, "balance": 0.0, "host_agreement_accepted": false,
            })),
        }
    }

    fn search(&self, body: &Value, now: Instant) -> Reply {
        let empty = Map::new();
        let q = match body {
            Value::Object(q) => q,
            Value::Null => &empty,
            _ => return Reply::invalid_args("the search body must be a JSON object"),
        };
        const SPECIAL: [&str; 7] = [
            "order",
            "limit",
            "type",
            "allocated_storage",
            "disable_bundling",
            "select_cols",
            "q",
        ];
        // Interruptible searches price offers at their minimum bid.
        let bid = match q.get("type").and_then(Value::as_str) {
            None | Some("on-demand") | Some("ask") | Some("reserved") => false,
            Some("bid") | Some("interruptible") => true,
            Some(other) => return Reply::invalid_args(format!("unknown search type {other:?}")),
        };
        let mut rows = Vec::new();
        // Prices of a search that names the storage to rent include it.
        let storage = q.get("allocated_storage").and_then(as_f64_lenient);
        for offer in self.offers.values() {
            // A listing that has ended is not searched.
            let Some(mut row) = self.offer_row(offer, now) else {
                continue;
            };
            if bid {
                row["dph_total"] = json!(offer.min_bid);
                row["is_bid"] = json!(true);
            }
            if let Some(gb) = storage.filter(|gb| *gb > 0.0) {
                let base = row["dph_total"].as_f64().unwrap_or(0.0);
                row["dph_total"] = json!(base + storage_dph(offer, gb));
            }
            match filter::matches(&row, q, &SPECIAL) {
                Ok(true) => rows.push(row),
                Ok(false) => {}
                Err(e) => return Reply::invalid_args(e.to_string()),
            }
        }
        let order = match q.get("order") {
            None | Some(Value::Null) => vec![("score".to_owned(), true)],
            Some(Value::Array(keys)) => {
                let mut order = Vec::new();
                for key in keys {
                    match key.as_array().map(Vec::as_slice) {
                        Some([Value::String(col)]) => order.push((col.clone(), false)),
                        Some([Value::String(col), Value::String(dir)]) => {
                            order.push((col.clone(), dir.eq_ignore_ascii_case("desc")))
                        }
                        _ => return Reply::invalid_args(format!("bad order key {key}")),
                    }
                }
                order
            }
            Some(other) => return Reply::invalid_args(format!("bad order {other}")),
        };
        filter::sort_rows(&mut rows, &order);
        let limit = q
            .get("limit")
            .and_then(as_u64_lenient)
            .map_or(SEARCH_LEN_DEFAULT, |l| l as usize);
        rows.truncate(limit);
        Reply::ok(json!({ "offers": rows }))
    }

    fn create(&mut self, offer_id: u64, body: &Value, now: Instant) -> Reply {
        let reply = self.commit_create(offer_id, body, now);
        match reply.body {
            Body::Json(ref v) if reply.status == 200 => {
                let id = v["new_contract"].as_u64().unwrap_or(0);
                self.ambiguous_answer(reply, id)
            }
            _ => reply,
        }
    }

    /// A create: the instance made and `{"success":true,"new_contract":id}`,
    /// or the refusal.
    fn commit_create(&mut self, offer_id: u64, body: &Value, now: Instant) -> Reply {
        let req = match parse_create(body) {
            Ok(req) => req,
            Err(reply) => return reply,
        };
        let gone = self.faults.offers_gone.get(&offer_id).copied();
        let offer = match self.create_offer(offer_id, &req, gone, now) {
            Ok(offer) => offer,
            Err(reply) => return reply,
        };
        let id = self.commit_instance(offer_id, offer, req, gone, now);
        Reply::ok(json!({"success": true, "new_contract": id}))
    }

    /// The offer `req` may rent, or the refusal (offer gone, bid too low, too little disk).
    fn create_offer(
        &self,
        offer_id: u64,
        req: &CreateRequest<'_>,
        gone: Option<Gone>,
        now: Instant,
    ) -> Result<Offer, Reply> {
        let (disk, bid, cancel_unavail) = (req.disk, req.bid, req.cancel_unavail);
        let Some(offer) = self
            .offers
            .get(&offer_id)
            .filter(|_| gone != Some(Gone::NotFound))
            .filter(|o| !self.rented.contains_key(&o.id))
            .filter(|o| !self.listing_ended(o.id, now))
            .cloned()
        else {
            return Err(Reply::json(
                404,
                json!({
                    "success": false,
                    "error": "invalid_args",
                    "msg": format!("error 404/3603: no_such_ask Instance type by id {offer_id} is not available."),
                    "ask_id": offer_id,
                }),
            ));
        };
        if gone == Some(Gone::Unavailable) && cancel_unavail {
            return Err(Reply::json(
                410,
                json!({
                    "success": false,
                    "error": "no_such_ask",
                    "msg": format!("error 410/3907: no_such_ask Instance type by id {offer_id} is no longer available."),
                    "ask_id": offer_id,
                }),
            ));
        }
        if let Some(price) = bid
            && price < offer.min_bid
        {
            return Err(Reply::json(
                400,
                json!({"success": false, "error": "invalid_price",
                       "msg": format!("bid price {price} is below the minimum bid {} for ask {offer_id}", offer.min_bid)}),
            ));
        }
        if disk > offer.disk_space {
            return Err(Reply::invalid_args(format!(
                "disk {disk} GB exceeds the {} GB available on ask {offer_id}",
                offer.disk_space
            )));
        }
        Ok(offer)
    }

    /// Makes the instance a checked create asks for on `offer`; its id.
    fn commit_instance(
        &mut self,
        offer_id: u64,
        offer: Offer,
        req: CreateRequest<'_>,
        gone: Option<Gone>,
        now: Instant,
    ) -> u64 {
        let CreateRequest {
            image,
            template,
            disk,
            label,
            env,
            onstart,
            runtype,
            bid,
            ..
        } = req;
        let id = self.next_instance_id;
        self.next_instance_id += 1;
        let authorized = self.authorized_keys(onstart.as_deref(), &env);
        let key = self.new_instance_key();
        let traits = self.faults.traits_for_new(label.as_deref());
        let phase = if gone == Some(Gone::Unavailable) {
            Phase::Unschedulable
        } else {
            Phase::Booting {
                since: now,
                provisioning: self.timings.provisioning,
                loading: traits.loading.unwrap_or(self.timings.loading),
            }
        };
        let gpus = Gpus {
            name: offer.gpu_name.clone(),
            count: offer.num_gpus,
            ram_mib: offer.gpu_ram,
        };
        // The contract ends with the machine's listing.
        let ends = self
            .listing_ends
            .get(&offer_id)
            .copied()
            .flatten()
            .map(|at| (at, unix_at(at, now)));
        self.rented.insert(offer_id, id);
        self.counters.creates_total += 1;
        *self
            .counters
            .creates_per_label
            .entry(label.clone().unwrap_or_default())
            .or_default() += 1;
        self.instances.insert(
            id,
            Instance {
                id,
                offer,
                label,
                image: if image.is_empty() {
                    template.unwrap_or_default().to_owned()
                } else {
                    image.to_owned()
                },
                disk,
                onstart,
                env,
                runtype,
                bid,
                start_date: unix_now(),
                ends,
                exit_msg: None,
                listed_from: now + self.faults.listing_lag,
                traits,
                phase,
                authorized,
                key,
                machine: Machine::new(
                    self.machines_dir.join(id.to_string()),
                    gpus,
                    self.runtime.clone(),
                ),
                log: VecDeque::new(),
            },
        );
        id
    }

    /// A restricted key for a new instance: random, and unlike the
    /// account's and every other instance's (those in their grace period too).
    fn new_instance_key(&mut self) -> String {
        loop {
            let key = restricted::new_key(&mut self.key_fallback);
            if key != self.api_key && self.instances.values().all(|i| i.key != key) {
                return key;
            }
        }
    }

    /// The keys an instance authorizes: the account's, then those in `onstart` and `env`.
    fn authorized_keys(&self, onstart: Option<&str>, env: &[(String, String)]) -> Vec<String> {
        let mut authorized: Vec<String> =
            self.ssh_keys.iter().map(|k| k.public_key.clone()).collect();
        for text in onstart
            .into_iter()
            .chain(env.iter().map(|(_, v)| v.as_str()))
        {
            for key in keys_in(text) {
                if !authorized.contains(&key) && authorized.len() < KEYS_MAX {
                    authorized.push(key);
                }
            }
        }
        authorized
    }

    /// What the caller of a committed create sees: `reply`, or the next
    /// ambiguity fault (`id` shapes the cut-off JSON).
    fn ambiguous_answer(&mut self, mut reply: Reply, id: u64) -> Reply {
        if !self.faults.ambiguous.is_empty() {
            reply = match self.faults.ambiguous.remove(0) {
                Ambiguity::Timeout { hold } => Reply {
                    after: After::HoldThenCut(hold),
                    ..reply
                },
                Ambiguity::Drop => Reply {
                    after: After::Cut,
                    ..reply
                },
                Ambiguity::BadGateway => Reply::server_error(502),
                Ambiguity::Malformed => Reply {
                    status: 200,
                    body: Body::Text(
                        format!("{{\"success\": true, \"new_contr{}", id % 10),
                        "application/json",
                    ),
                    after: After::Respond,
                },
            };
        }
        reply
    }

    /// Instances a listing shows now, as rows, by id.
    fn listed(&self, now: Instant) -> Vec<Value> {
        self.instances
            .values()
            .filter(|i| now >= i.listed_from)
            .map(|i| row(i, now))
            .collect()
    }

    fn list_v1(&self, query: &HashMap<String, String>, now: Instant) -> Reply {
        let filters = match query.get("select_filters").map(|s| s.trim()) {
            None | Some("") => Map::new(),
            Some(s) => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(m)) => m,
                _ => {
                    return Reply::invalid_args(format!(
                        "select_filters is not a JSON object: {s}"
                    ));
                }
            },
        };
        let order = match query.get("order_by").map(|s| s.trim()) {
            None | Some("") => vec![("id".to_owned(), false)],
            Some(s) => match parse_order_by(s) {
                Some(o) => o,
                None => return Reply::invalid_args(format!("bad order_by: {s}")),
            },
        };
        let limit = match query.get("limit") {
            None => PAGE_LEN_MAX,
            Some(s) => match s.trim().trim_matches('"').parse::<usize>() {
                Ok(l) => l.clamp(1, PAGE_LEN_MAX),
                Err(_) => return Reply::invalid_args(format!("bad limit: {s}")),
            },
        };
        let cols: Option<Vec<String>> = query
            .get("select_cols")
            .and_then(|s| serde_json::from_str::<Vec<String>>(s).ok())
            .filter(|c| !c.iter().any(|c| c == "*"));
        let mut rows = Vec::new();
        for r in self.listed(now) {
            match filter::matches(&r, &filters, &[]) {
                Ok(true) => rows.push(r),
                Ok(false) => {}
                Err(e) => return Reply::invalid_args(e.to_string()),
            }
        }
        filter::sort_rows(&mut rows, &order);
        let mut label_counts: BTreeMap<String, u64> = BTreeMap::new();
        for r in &rows {
            let label = r.get("label").and_then(Value::as_str).unwrap_or("");
            *label_counts.entry(label.to_owned()).or_default() += 1;
        }
        let total = rows.len();
        // Tokens: `id:N` resumes after instance N when ordered by id alone
        // (robust to destroys between pages); `at:N` is an offset otherwise.
        let by_id = order.len() == 1 && order[0].0 == "id";
        let start = match page_start(query, &order, &rows) {
            Ok(start) => start,
            Err(reply) => return reply,
        };
        let page: Vec<Value> = rows[start..].iter().take(limit).cloned().collect();
        let end = start + page.len();
        let next_token = if end < rows.len() {
            if by_id {
                let last = page
                    .last()
                    .and_then(|r| r.get("id"))
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                Value::String(format!("id:{last}"))
            } else {
                Value::String(format!("at:{end}"))
            }
        } else {
            Value::Null
        };
        let page = select_cols(page, cols.as_deref());
        Reply::ok(json!({
            "instances": page,
            "next_token": next_token,
            "total_instances": total,
            "label_counts": label_counts,
        }))
    }

    fn filters(&self, now: Instant) -> Reply {
        let mut combos: Vec<Value> = Vec::new();
        for r in self.listed(now) {
            let combo = json!({
                "actual_status": r.get("actual_status"),
                "verification": r.get("verification"),
                "gpu_name": r.get("gpu_name"),
            });
            if !combos.contains(&combo) {
                combos.push(combo);
            }
        }
        Reply::ok(json!({ "filters": combos }))
    }

    fn no_such_instance(id: u64) -> Reply {
        Reply::json(
            404,
            json!({"success": false, "error": "no_such_instance", "msg": format!("Instance {id} not found.")}),
        )
    }

    fn update(&mut self, id: u64, body: &Value, now: Instant) -> Reply {
        let restart = self.timings.restart;
        let real_ssh = self.real_ssh;
        let Some(inst) = self
            .instances
            .get_mut(&id)
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }))
        else {
            return Self::no_such_instance(id);
        };
        let Value::Object(b) = body else {
            return Reply::invalid_args("the request body must be a JSON object");
        };
        let state = match b.get("state") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s == "stopped" || s == "running" => Some(s.as_str()),
            Some(v) => {
                return Reply::invalid_args(format!("state must be stopped or running, got {v}"));
            }
        };
        let label = match b.get("label") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(Value::String(l)) if l.chars().count() <= LABEL_LEN_MAX => Some(Some(l.clone())),
            Some(_) => {
                return Reply::invalid_args(format!(
                    "label must be a string of at most {LABEL_LEN_MAX} characters"
                ));
            }
        };
        if state.is_none() && label.is_none() {
            return Reply::invalid_args("nothing to change: give label or state");
        }
        if let Some(label) = label {
            inst.label = label;
        }
        if state == Some("running") && matches!(inst.phase, Phase::Expired) {
            return Reply::json(
                400,
                json!({"success": false, "error": "invalid_state",
                       "msg": format!("Instance {id} cannot start: its contract has expired.")}),
            );
        }
        match state {
            Some("stopped") => {
                if !matches!(
                    inst.phase,
                    Phase::Unschedulable | Phase::Stopped | Phase::Expired
                ) {
                    inst.phase = Phase::Stopped;
                    inst.note("vastmock: container stopped (instance stopped by user)".to_owned());
                }
                inst.machine.halt();
            }
            Some(_) => match inst.phase {
                Phase::Stopped
                | Phase::Dead(Death::Exited)
                | Phase::BootFailed
                | Phase::OnstartFailed => {
                    inst.phase = Phase::Booting {
                        since: now,
                        provisioning: Duration::ZERO,
                        loading: restart,
                    };
                    // Starting again clears a boot failure; other traits stay.
                    inst.traits.boot_failure = false;
                }
                Phase::Running => inst
                    .machine
                    .run(&inst.authorized, real_ssh && !inst.traits.ssh_never_ready),
                _ => {}
            },
            None => {}
        }
        self.settle(now);
        Reply::ok(json!({"success": true}))
    }

    fn destroy(&mut self, id: u64, by: KeyUse, now: Instant) -> Reply {
        if self.faults.flaky_destroys > 0 {
            self.faults.flaky_destroys -= 1;
            return Reply::server_error(self.faults.flaky_destroy_status);
        }
        let exists = self
            .instances
            .get(&id)
            .is_some_and(|i| !matches!(i.phase, Phase::Destroyed { .. }));
        if !exists {
            return Reply::json(
                404,
                json!({"success": false, "error": "not_found", "msg": "Instance not found"}),
            );
        }
        self.end_instance(id, now, true);
        self.log_destroy(Destroy { instance: id, by });
        Reply::ok(json!({"success": true}))
    }

    /// Records a destroy in the log, and tells of it on stderr.
    fn log_destroy(&mut self, destroy: Destroy) {
        eprintln!("{}", destroy.line());
        if self.destroys.len() >= DESTROYS_MAX {
            self.destroys.pop_front();
        }
        self.destroys.push_back(destroy);
    }

    /// Destroys an instance: frees its offer, stops its sshd, removes its
    /// directory; keeps it listed as `destroyed` when `grace` and the
    /// configuration says so.
    fn end_instance(&mut self, id: u64, now: Instant, grace: bool) {
        let Some(inst) = self.instances.get_mut(&id) else {
            return;
        };
        inst.machine.remove();
        if self.rented.get(&inst.offer.id) == Some(&id) {
            self.rented.remove(&inst.offer.id);
        }
        if grace && !self.timings.destroyed_visible.is_zero() {
            inst.phase = Phase::Destroyed { at: now };
        } else {
            self.instances.remove(&id);
        }
    }

    fn attach(&mut self, id: u64, body: &Value) -> Reply {
        let real_ssh = self.real_ssh;
        let Some(inst) = self
            .instances
            .get_mut(&id)
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }))
        else {
            return Self::no_such_instance(id);
        };
        let Some(key) = body
            .get("ssh_key")
            .and_then(Value::as_str)
            .filter(|k| looks_like_key(k))
        else {
            return Reply::invalid_args("ssh_key must be an OpenSSH public key");
        };
        let key = key.trim().to_owned();
        if !inst.authorized.contains(&key) && inst.authorized.len() < KEYS_MAX {
            inst.authorized.push(key);
        }
        if inst.machine.is_up() {
            inst.machine
                .run(&inst.authorized, real_ssh && !inst.traits.ssh_never_ready);
        }
        Reply::ok(json!({"success": true, "msg": "SSH key attached to instance"}))
    }

    // ---- bulk calls -----------------------------------------------------------

    /// `POST /asks/bulk/`: one create per offer in `ids`, all with the same
    /// body. Answers `{"success", "new_contracts", "results"}` (one result
    /// per offer, as a single create would answer it) when at least one
    /// committed, else the first refusal as it stands.
    fn create_bulk(&mut self, body: &Value, now: Instant) -> Reply {
        let (ids, blob) = match ids_and_rest(body) {
            Ok(split) => split,
            Err(reply) => return reply,
        };
        let mut contracts = Vec::new();
        let mut results = Vec::new();
        let mut first_refusal = None;
        for offer_id in ids {
            let reply = self.commit_create(offer_id, &blob, now);
            match (&reply.body, reply.status) {
                (Body::Json(v), 200) => {
                    contracts.push(v["new_contract"].clone());
                    let mut r = v.clone();
                    r["ask_id"] = json!(offer_id);
                    results.push(r);
                }
                (Body::Json(v), _) => {
                    let mut r = v.clone();
                    r["ask_id"] = json!(offer_id);
                    results.push(r);
                    first_refusal.get_or_insert(reply);
                }
                (Body::Text(..), _) => {
                    first_refusal.get_or_insert(reply);
                }
            }
        }
        let Some(first) = contracts.first().and_then(Value::as_u64) else {
            return first_refusal.unwrap_or_else(|| Reply::invalid_args("nothing created"));
        };
        let all = contracts.len() == results.len();
        let reply = Reply::ok(json!({
            "success": all,
            "new_contracts": contracts,
            "results": results,
        }));
        self.ambiguous_answer(reply, first)
    }

    /// `PUT /instances/`: the update (`state`, `label`) for each id in `ids`.
    fn update_bulk(&mut self, body: &Value, now: Instant) -> Reply {
        let (ids, blob) = match ids_and_rest(body) {
            Ok(split) => split,
            Err(reply) => return reply,
        };
        let mut done = Vec::new();
        let mut failed = Vec::new();
        let mut first_refusal = None;
        for id in ids {
            let reply = self.update(id, &blob, now);
            if reply.status == 200 {
                done.push(id);
            } else {
                failed.push(json!({"id": id, "msg": message(&reply)}));
                first_refusal.get_or_insert(reply);
            }
        }
        match first_refusal {
            Some(refusal) if done.is_empty() => refusal,
            _ => Reply::ok(json!({
                "success": failed.is_empty(),
                "updated": done,
                "failed": failed,
            })),
        }
    }

    /// `DELETE /instances/`: destroys each id in `instance_ids` that exists.
    fn destroy_bulk(&mut self, body: &Value, by: KeyUse, now: Instant) -> Reply {
        let ids = match ids_in(body, "instance_ids") {
            Ok(ids) => ids,
            Err(reply) => return reply,
        };
        if self.faults.flaky_destroys > 0 {
            self.faults.flaky_destroys -= 1;
            return Reply::server_error(self.faults.flaky_destroy_status);
        }
        let (mut done, mut missing) = (Vec::new(), Vec::new());
        for id in ids {
            let exists = self
                .instances
                .get(&id)
                .is_some_and(|i| !matches!(i.phase, Phase::Destroyed { .. }));
            if exists {
                self.end_instance(id, now, true);
                self.log_destroy(Destroy { instance: id, by });
                done.push(id);
            } else {
                missing.push(id);
            }
        }
        if done.is_empty() {
            return Reply::json(
                404,
                json!({"success": false, "error": "not_found",
                       "msg": format!("Instances not found: {missing:?}")}),
            );
        }
        Reply::ok(json!({
            "success": missing.is_empty(),
            "destroyed": done,
            "not_found": missing,
        }))
    }

    // ---- reboot, bid, logs, execute ---------------------------------------------

    /// `PUT /instances/reboot/{id}/`: a running instance is `rebooting` (no
    /// sshd, every process ended) for `Timings::restart`, then runs again.
    fn reboot(&mut self, id: u64, now: Instant) -> Reply {
        let restart = self.timings.restart;
        let Some(inst) = self.live_mut(id) else {
            return Self::no_such_instance(id);
        };
        if !matches!(inst.phase, Phase::Running | Phase::Rebooting { .. }) {
            return not_running(id);
        }
        inst.machine.halt();
        inst.phase = Phase::Rebooting {
            since: now,
            duration: restart,
        };
        inst.note("vastmock: container rebooting".to_owned());
        Reply::ok(json!({"success": true}))
    }

    /// `PUT /instances/bid_price/{id}/`: `{"price": P}` for an interruptible
    /// instance (one created with a `price`); no price means the winning
    /// bid, the offer's `min_bid`.
    fn change_bid(&mut self, id: u64, body: &Value) -> Reply {
        let Some(inst) = self.live_mut(id) else {
            return Self::no_such_instance(id);
        };
        if inst.bid.is_none() {
            return Reply::invalid_args(format!(
                "instance {id} is on-demand: only an interruptible instance has a bid"
            ));
        }
        let min = inst.offer.min_bid;
        let price = match body.get("price") {
            None | Some(Value::Null) => min,
            Some(v) => match as_f64_lenient(v) {
                Some(p) if p >= min => p,
                Some(p) => {
                    return Reply::json(
                        400,
                        json!({"success": false, "error": "invalid_price",
                               "msg": format!("bid price {p} is below the minimum bid {min} for instance {id}")}),
                    );
                }
                None => {
                    return Reply::json(
                        400,
                        json!({"success": false, "error": "invalid_price",
                               "msg": format!("invalid bid price {v}")}),
                    );
                }
            },
        };
        inst.bid = Some(price);
        Reply::ok(json!({"success": true}))
    }

    /// `PUT /instances/request_logs/{id}/`: the instance's log (`tail` last
    /// lines, those containing `filter`) at a `result_url` the mock serves.
    fn logs(&mut self, id: u64, body: &Value) -> Reply {
        let Some(inst) = self.live_mut(id) else {
            return Self::no_such_instance(id);
        };
        let tail = match body.get("tail") {
            None | Some(Value::Null) => LOG_TAIL_DEFAULT,
            Some(v) => match as_u64_lenient(v) {
                Some(n) => n as usize,
                None => return Reply::invalid_args(format!("tail must be a number, got {v}")),
            },
        };
        let filter = body.get("filter").and_then(Value::as_str).unwrap_or("");
        let lines: Vec<&str> = inst
            .log
            .iter()
            .map(String::as_str)
            .filter(|l| l.contains(filter))
            .collect();
        let mut text = lines[lines.len().saturating_sub(tail)..].join("\n");
        text.push('\n');
        let url = self.keep_result(text);
        Reply::ok(json!({
            "success": true,
            "result_url": url,
            "msg": "Logs requested; fetch them from result_url.",
        }))
    }

    /// `PUT /instances/command/{id}/`: `{"command": "ls …"}` (`ls`, `du` or
    /// `rm`, paths inside the instance) run in the machine's home directory
    /// of a running instance; the output at a `result_url`.
    fn execute(&mut self, id: u64, body: &Value) -> Reply {
        let Some(inst) = self.live_mut(id) else {
            return Self::no_such_instance(id);
        };
        if !matches!(inst.phase, Phase::Running) {
            return not_running(id);
        }
        let Some(command) = body.get("command").and_then(Value::as_str) else {
            return Reply::invalid_args("command is required");
        };
        let dir = inst
            .machine
            .home()
            .unwrap_or_else(|| inst.machine.dir().to_owned());
        let output = match run_constrained(&dir, command) {
            Ok(output) => output,
            Err(msg) => return Reply::invalid_args(msg),
        };
        let writeable_path = dir.display().to_string();
        let url = self.keep_result(output);
        Reply::ok(json!({
            "success": true,
            "result_url": url,
            "writeable_path": writeable_path,
        }))
    }

    fn live_mut(&mut self, id: u64) -> Option<&mut Instance> {
        self.instances
            .get_mut(&id)
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }))
    }

    /// Keeps `text` for `GET /results/{token}`; returns its URL.
    fn keep_result(&mut self, text: String) -> String {
        let token = format!(
            "{:016x}{:016x}",
            self.tokens.next_u64(),
            self.tokens.next_u64()
        );
        if self.results.len() >= RESULTS_MAX {
            self.results.pop_front();
        }
        let url = format!("{}/results/{token}", self.base_url);
        self.results.push_back((token, text));
        url
    }

    /// A result kept by `request_logs` or `command`.
    pub(crate) fn result(&self, token: &str) -> Option<String> {
        self.results
            .iter()
            .find(|(t, _)| t == token)
            .map(|(_, text)| text.clone())
    }

    // ---- the Rust/admin API -------------------------------------------------

    fn add_ssh_key(&mut self, public_key: String, created_at: f64) -> SshKey {
        let key = SshKey {
            id: self.next_key_id,
            public_key,
            created_at,
        };
        self.next_key_id += 1;
        if self.ssh_keys.len() < KEYS_MAX {
            self.ssh_keys.push(key.clone());
        }
        key
    }

    /// Adds an account key; `Err` when it does not look like a public key.
    pub(crate) fn add_account_key(&mut self, key: &str) -> Result<u64, String> {
        if !looks_like_key(key) {
            return Err(format!("not an OpenSSH public key: {key:?}"));
        }
        Ok(self.add_ssh_key(key.trim().to_owned(), unix_now()).id)
    }

    pub(crate) fn add_offer(&mut self, offer: Offer, now: Instant) -> Result<(), String> {
        if self.offers.contains_key(&offer.id) {
            return Err(format!("offer {} exists already", offer.id));
        }
        self.listing_ends.insert(offer.id, listing_end(&offer, now));
        self.offers.insert(offer.id, offer);
        Ok(())
    }

    pub(crate) fn set_rate_scale(&mut self, scale: f64) -> Result<(), String> {
        if !(scale.is_finite() && scale >= 0.0) {
            return Err(format!("rate scale must be finite and >= 0, got {scale}"));
        }
        self.rate_limits.scale = scale;
        Ok(())
    }

    pub(crate) fn set_rate_limits(&mut self, limits: RateLimits) {
        self.rate_limits = limits;
    }

    pub(crate) fn set_timings(&mut self, timings: Timings) {
        self.timings = timings;
    }

    /// Applies a per-instance fault to the instances `selector` names now,
    /// and registers it for instances created later.
    pub(crate) fn instance_fault(
        &mut self,
        selector: &Selector,
        fault: InstanceFault,
        now: Instant,
    ) {
        match selector {
            Selector::Id(_) | Selector::Label(_) => {
                for inst in self.instances.values_mut() {
                    if selects(selector, inst) {
                        fault.apply(&mut inst.traits);
                        match (fault, &mut inst.phase) {
                            (InstanceFault::SlowLoading(d), Phase::Booting { loading, .. }) => {
                                *loading = d;
                            }
                            (InstanceFault::SshNeverReady, Phase::Running) => {
                                inst.machine.run(&inst.authorized, false);
                            }
                            _ => {}
                        }
                    }
                }
                if let Selector::Label(l) = selector {
                    self.faults.by_label.push((l.clone(), fault));
                }
            }
            Selector::Next(n) => self.faults.next.push((*n, fault)),
            Selector::AllNew => self.faults.all_new.push(fault),
        }
        self.settle(now);
    }

    /// Kills the instances `selector` names (`Id` or `Label`); returns how many.
    pub(crate) fn kill(&mut self, selector: &Selector, death: Death, now: Instant) -> usize {
        self.settle(now);
        let ids: Vec<u64> = self
            .instances
            .values()
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }) && selects(selector, i))
            .map(|i| i.id)
            .collect();
        for &id in &ids {
            match death {
                Death::Vanished => self.end_instance(id, now, false),
                Death::Exited | Death::Offline | Death::Frozen => {
                    if let Some(inst) = self.instances.get_mut(&id) {
                        inst.machine.halt();
                        inst.phase = Phase::Dead(death);
                        inst.note(match death {
                            Death::Exited => "vastmock: container exited unexpectedly".to_owned(),
                            Death::Frozen => "vastmock: container frozen by its host".to_owned(),
                            _ => "vastmock: machine offline: no heartbeat".to_owned(),
                        });
                    }
                }
            }
        }
        ids.len()
    }

    /// Outbids the interruptible instances `selector` names that run or
    /// boot: each is paused (its container stopped, storage still billed)
    /// until [`World::bid_wins`]. Returns how many.
    pub(crate) fn outbid(&mut self, selector: &Selector, now: Instant) -> usize {
        self.settle(now);
        let mut n = 0;
        for inst in self.instances.values_mut() {
            if inst.bid.is_some()
                && selects(selector, inst)
                && matches!(
                    inst.phase,
                    Phase::Running | Phase::Booting { .. } | Phase::Rebooting { .. }
                )
            {
                inst.machine.halt();
                inst.phase = Phase::Outbid;
                inst.note("vastmock: container stopped: the instance was outbid".to_owned());
                n += 1;
            }
        }
        n
    }

    /// The bids of the outbid instances `selector` names win again: each
    /// starts again as a stopped instance does. Returns how many.
    pub(crate) fn bid_wins(&mut self, selector: &Selector, now: Instant) -> usize {
        let restart = self.timings.restart;
        let mut n = 0;
        for inst in self.instances.values_mut() {
            if matches!(inst.phase, Phase::Outbid) && selects(selector, inst) {
                inst.phase = Phase::Booting {
                    since: now,
                    provisioning: Duration::ZERO,
                    loading: restart,
                };
                n += 1;
            }
        }
        self.settle(now);
        n
    }

    /// Every successful destroy, oldest first.
    pub(crate) fn destroys(&self) -> Vec<Destroy> {
        self.destroys.iter().copied().collect()
    }

    /// The restricted key of instance `id`, while it is not destroyed.
    pub(crate) fn instance_key(&self, id: u64) -> Option<String> {
        self.instances
            .get(&id)
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }))
            .map(|i| i.key.clone())
    }

    pub(crate) fn counters(&self) -> Counters {
        self.counters.clone()
    }

    pub(crate) fn live_instances(&self) -> usize {
        self.instances
            .values()
            .filter(|i| !matches!(i.phase, Phase::Destroyed { .. }))
            .count()
    }

    pub(crate) fn offer_rented(&self, offer_id: u64) -> Option<bool> {
        self.offers
            .get(&offer_id)
            .map(|_| self.rented.contains_key(&offer_id))
    }

    /// Every offer, those whose listing ended included (not rentable,
    /// `duration` 0).
    pub(crate) fn offers_json(&self, now: Instant) -> Vec<Value> {
        self.offers
            .values()
            .map(|o| {
                self.offer_row(o, now).unwrap_or_else(|| {
                    let mut row = o.to_json(self.rented.contains_key(&o.id));
                    row["rentable"] = json!(false);
                    row["duration"] = json!(0.0);
                    row
                })
            })
            .collect()
    }

    /// An offer's search row now: its `duration` is what its listing has
    /// left; `None` once the listing has ended.
    fn offer_row(&self, offer: &Offer, now: Instant) -> Option<Value> {
        let mut row = offer.to_json(self.rented.contains_key(&offer.id));
        match self.listing_ends.get(&offer.id).copied().flatten() {
            Some(end) if now >= end => return None,
            Some(end) => row["duration"] = json!((end - now).as_secs_f64()),
            None => {}
        }
        Some(row)
    }

    fn listing_ended(&self, offer_id: u64, now: Instant) -> bool {
        self.listing_ends
            .get(&offer_id)
            .copied()
            .flatten()
            .is_some_and(|end| now >= end)
    }

    /// The listing of `offer_id` ends `after` from `now`: it is no longer
    /// searched nor rented then. Instances already renting it keep their
    /// contract's end.
    pub(crate) fn expire_offer(
        &mut self,
        offer_id: u64,
        after: Duration,
        now: Instant,
    ) -> Result<(), String> {
        if !self.offers.contains_key(&offer_id) {
            return Err(format!("no offer {offer_id}"));
        }
        self.listing_ends.insert(offer_id, Some(now + after));
        Ok(())
    }

    /// The contracts of the instances `selector` names (`Id` or `Label`,
    /// destroyed ones aside) end `after` from `now`; returns how many.
    pub(crate) fn expire_instances(
        &mut self,
        selector: &Selector,
        after: Duration,
        now: Instant,
    ) -> usize {
        let at = now + after;
        let mut n = 0;
        for inst in self.instances.values_mut() {
            if selects(selector, inst) && !matches!(inst.phase, Phase::Destroyed { .. }) {
                inst.ends = Some((at, unix_at(at, now)));
                n += 1;
            }
        }
        self.settle(now);
        n
    }

    pub(crate) fn views(&self, now: Instant) -> Vec<InstanceView> {
        self.instances
            .values()
            .map(|i| InstanceView {
                id: i.id,
                offer_id: i.offer.id,
                label: i.label.clone(),
                actual_status: status(i, now).actual.map(str::to_owned),
                intended_status: status(i, now).intended.to_owned(),
                ssh_port: i.machine.port(),
                proxy_port: i.machine.proxy_port(),
                direct: direct_ports(&i.offer) > 0,
                end_date: i.ends.map(|(_, unix)| unix),
                ssh_up: i.machine.is_up(),
                dir: i.machine.dir().to_owned(),
                home: i.machine.home(),
                authorized_keys: i.authorized.clone(),
                destroyed: matches!(i.phase, Phase::Destroyed { .. }),
                row: row(i, now),
            })
            .collect()
    }

    /// Stops every sshd (the mock is going away).
    pub(crate) fn shutdown(&mut self) {
        for inst in self.instances.values_mut() {
            inst.machine.remove();
        }
        self.instances.clear();
    }

    pub(crate) fn machines_dir(&self) -> &Path {
        &self.machines_dir
    }
}

fn selects(selector: &Selector, inst: &Instance) -> bool {
    match selector {
        Selector::Id(id) => inst.id == *id,
        Selector::Label(l) => inst.label.as_deref() == Some(l.as_str()),
        Selector::Next(_) | Selector::AllNew => false,
    }
}

const BOOT_FAILURE_MSG: &str = "Error response from daemon: failed to create task for container: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: error during container init";

/// The status fields of an instance now.
struct Status {
    actual: Option<&'static str>,
    intended: &'static str,
    cur: &'static str,
    next: &'static str,
    msg: String,
}

impl Status {
    /// The fields in the order the API names them.
    fn new(
        actual: Option<&'static str>,
        intended: &'static str,
        cur: &'static str,
        next: &'static str,
        msg: String,
    ) -> Self {
        Self {
            actual,
            intended,
            cur,
            next,
            msg,
        }
    }
}

fn status(inst: &Instance, now: Instant) -> Status {
    let st = Status::new;
    match inst.phase {
        Phase::Booting {
            since,
            provisioning,
            ..
        } => booting_status(inst, since, provisioning, now),
        Phase::Running => st(
            Some("running"),
            "running",
            "running",
            "running",
            format!("success, running {}", inst.image),
        ),
        Phase::Rebooting { .. } => st(
            Some("rebooting"),
            "running",
            "running",
            "running",
            "Rebooting the container".to_owned(),
        ),
        Phase::BootFailed => st(
            Some("created"),
            "running",
            "stopped",
            "running",
            BOOT_FAILURE_MSG.to_owned(),
        ),
        Phase::Stopped => st(
            Some("stopped"),
            "stopped",
            "stopped",
            "stopped",
            "Instance stopped by user".to_owned(),
        ),
        Phase::Outbid => st(
            Some("stopped"),
            "running",
            "stopped",
            "running",
            "Instance outbid: paused until its bid wins again".to_owned(),
        ),
        Phase::Unschedulable => st(
            Some("exited"),
            "running",
            "stopped",
            "running",
            "Unable to schedule the instance: the machine's resources are no longer available"
                .to_owned(),
        ),
        Phase::OnstartFailed => st(
            Some("exited"),
            "running",
            "stopped",
            "running",
            inst.exit_msg
                .clone()
                .unwrap_or_else(|| "Container exited unexpectedly".to_owned()),
        ),
        Phase::Expired => st(
            Some("stopped"),
            "running",
            "stopped",
            "stopped",
            "Instance stopped: its contract reached its end date; an expired instance cannot start again"
                .to_owned(),
        ),
        Phase::Dead(death) => dead_status(death),
        Phase::Destroyed { .. } => st(
            Some("destroyed"),
            "destroyed",
            "destroyed",
            "destroyed",
            "Instance destroyed".to_owned(),
        ),
    }
}

/// The status of a booting instance: none while provisioned, then loading its image.
fn booting_status(inst: &Instance, since: Instant, provisioning: Duration, now: Instant) -> Status {
    let st = Status::new;
    if now < since + provisioning {
        st(None, "running", "stopped", "running", String::new())
    } else {
        st(
            Some("loading"),
            "running",
            "running",
            "running",
            format!("Pulling image {}: downloading layers", inst.image),
        )
    }
}

/// The status of an instance that died as `death` says.
fn dead_status(death: Death) -> Status {
    let st = Status::new;
    match death {
        Death::Exited => st(
            Some("exited"),
            "running",
            "stopped",
            "running",
            "Container exited unexpectedly".to_owned(),
        ),
        Death::Frozen => st(
            Some("frozen"),
            "running",
            "stopped",
            "running",
            "Instance frozen by its host: the GPU is held, nothing runs".to_owned(),
        ),
        _ => st(
            Some("offline"),
            "running",
            "unknown",
            "running",
            "Machine is offline: no heartbeat".to_owned(),
        ),
    }
}

/// What `gb` of storage on `offer` costs per hour: its `storage_cost` is
/// dollars per GB and month (30 days), as the service quotes it.
fn storage_dph(offer: &Offer, gb: f64) -> f64 {
    let per_gb_month = offer
        .extra
        .get("storage_cost")
        .and_then(Value::as_f64)
        .unwrap_or(STORAGE_COST_DEFAULT);
    per_gb_month * gb / (30.0 * 24.0)
}

/// An instance's row, as shows and listings return it.
fn row(inst: &Instance, now: Instant) -> Value {
    let s = status(inst, now);
    let running = matches!(inst.phase, Phase::Running);
    let direct = direct_ports(&inst.offer);
    // Direct SSH (the sshd's own port, mapped) only on a machine with open
    // ports; a running instance on one without has a port map with no 22.
    let ports = match (running, inst.machine.port()) {
        (true, Some(p)) if direct > 0 => {
            json!({"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": p.to_string()}]})
        }
        (true, _) => json!({}),
        _ => Value::Null,
    };
    let o = &inst.offer;
    // The machine's price plus the storage the instance holds, as the
    // service bills it.
    let dph = inst.bid.unwrap_or(o.dph_total) + storage_dph(o, inst.disk);
    json!({
        "id": inst.id,
        "machine_id": o.machine_id,
        "host_id": o.host_id,
        "bundle_id": o.id,
        "actual_status": s.actual,
        "intended_status": s.intended,
        "cur_state": s.cur,
        "next_state": s.next,
        "status_msg": s.msg,
        "label": inst.label,
        "image_uuid": inst.image,
        "image_runtype": inst.runtype,
        "image_args": [],
        "onstart": inst.onstart,
        "extra_env": inst.env.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "start_date": inst.start_date,
        "end_date": inst.ends.map(|(_, unix)| unix),
        "ssh_host": PROXY_HOST,
        "ssh_port": inst.machine.proxy_port(),
        "ssh_idx": "",
        "public_ipaddr": "127.0.0.1",
        "local_ipaddrs": "127.0.0.1",
        "ports": ports,
        "direct_port_count": direct,
        "gpu_name": o.gpu_name,
        "num_gpus": o.num_gpus,
        "gpu_ram": o.gpu_ram,
        "gpu_totalram": o.gpu_ram * u64::from(o.num_gpus),
        "gpu_util": Value::Null,
        "cpu_ram": 64000,
        "cpu_cores_effective": 8.0 * f64::from(o.num_gpus),
        "disk_space": inst.disk,
        "dph_total": dph,
        "dph_base": dph * 0.9,
        "is_bid": inst.bid.is_some(),
        "min_bid": o.min_bid,
        "reliability2": o.reliability2,
        "geolocation": o.geolocation,
        "verification": if o.verified { "verified" } else { "unverified" },
        "inet_up": 800.0,
        "inet_down": 900.0,
        "template_id": Value::Null,
    })
}

/// The ids listed in `body[field]`: 1 to [`BULK_IDS_MAX`] of them, repeats dropped.
/// A bulk body's `ids`, and the body without them: what each id gets.
fn ids_and_rest(body: &Value) -> Result<(Vec<u64>, Value), Reply> {
    let ids = ids_in(body, "ids")?;
    let mut rest = body.clone();
    if let Some(b) = rest.as_object_mut() {
        b.remove("ids");
    }
    Ok((ids, rest))
}

fn ids_in(body: &Value, field: &str) -> Result<Vec<u64>, Reply> {
    let bad = || Reply::invalid_args(format!("{field} must be a list of 1 to {BULK_IDS_MAX} ids"));
    let Some(Value::Array(items)) = body.get(field) else {
        return Err(bad());
    };
    if items.is_empty() || items.len() > BULK_IDS_MAX {
        return Err(bad());
    }
    let mut ids = Vec::new();
    for item in items {
        let id = as_u64_lenient(item).ok_or_else(bad)?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// The `msg` of a JSON reply, or its text.
fn message(reply: &Reply) -> String {
    match &reply.body {
        Body::Json(v) => v
            .get("msg")
            .and_then(Value::as_str)
            .map_or_else(|| v.to_string(), str::to_owned),
        Body::Text(t, _) => t.clone(),
    }
}

fn not_running(id: u64) -> Reply {
    Reply::json(
        400,
        json!({"success": false, "error": "invalid_state",
               "msg": format!("Instance {id} is not running.")}),
    )
}

/// Runs the constrained command of `PUT /instances/command/{id}/` (`ls`,
/// `du` or `rm` and their arguments, no shell) in `dir`; its output, or why
/// it was refused. A path argument must stay inside `dir`, and an option
/// cannot carry a value (`--files0-from=/etc/…`).
fn run_constrained(dir: &Path, command: &str) -> Result<String, String> {
    let mut words = command.split_whitespace();
    let program = words.next().unwrap_or("");
    if !["ls", "du", "rm"].contains(&program) {
        return Err(format!(
            "command {program:?} is not available: use ls, rm or du"
        ));
    }
    let args: Vec<&str> = words.collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    let root = dir
        .canonicalize()
        .map_err(|e| format!("cannot resolve {}: {e}", dir.display()))?;
    if let Some(opt) = args.iter().find(|a| a.starts_with('-') && a.contains('=')) {
        return Err(format!("option {opt:?} is not available"));
    }
    for arg in args.iter().filter(|a| !a.starts_with('-')) {
        let path = Path::new(arg);
        let inside = !path.is_absolute()
            && !path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            && !(program == "rm" && (arg.ends_with('/') || arg.ends_with("/.")))
            && root
                .join(path)
                .parent()
                .and_then(|p| p.canonicalize().ok())
                .is_none_or(|p| p.starts_with(&root));
        if !inside {
            return Err(format!("path {arg:?} is outside the instance"));
        }
    }
    let out = std::process::Command::new(program)
        .args(&args)
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok(text)
}

fn key_row(key: &SshKey) -> Value {
    json!({
        "id": key.id,
        "user_id": USER_ID,
        "public_key": key.public_key,
        "created_at": key.created_at,
        "deleted_at": Value::Null,
    })
}

/// The fields of a create's body, each checked on its own.
struct CreateRequest<'a> {
    image: &'a str,
    template: Option<&'a str>,
    disk: f64,
    label: Option<String>,
    env: Vec<(String, String)>,
    onstart: Option<String>,
    runtype: Option<String>,
    cancel_unavail: bool,
    bid: Option<f64>,
}

/// Reads a create's body, or refuses its first bad field.
fn parse_create(body: &Value) -> Result<CreateRequest<'_>, Reply> {
    let Value::Object(b) = body else {
        return Err(Reply::invalid_args(
            "the request body must be a JSON object",
        ));
    };
    let image = b.get("image").and_then(Value::as_str).unwrap_or("").trim();
    let template = b.get("template_hash_id").and_then(Value::as_str);
    if image.is_empty() && template.is_none() {
        return Err(Reply::invalid_args("image or template_hash_id is required"));
    }
    if !image.is_empty() && !is_image_reference(image) {
        return Err(Reply::invalid_args(format!(
            "invalid image {image:?}: an image reference is lowercase letters, digits and ._-/:@"
        )));
    }
    let disk = match b.get("disk") {
        None | Some(Value::Null) => 10.0,
        Some(v) => match as_f64_lenient(v) {
            Some(d) => d,
            None => {
                return Err(Reply::invalid_args(format!(
                    "disk must be a number, got {v}"
                )));
            }
        },
    };
    if disk < DISK_MIN_GB {
        return Err(Reply::invalid_args(format!(
            "disk must be at least {DISK_MIN_GB} GB, got {disk}"
        )));
    }
    let label = match b.get("label") {
        None | Some(Value::Null) => None,
        Some(Value::String(l)) if l.chars().count() <= LABEL_LEN_MAX => Some(l.clone()),
        Some(Value::String(_)) => {
            return Err(Reply::invalid_args(format!(
                "label must be at most {LABEL_LEN_MAX} characters"
            )));
        }
        Some(v) => {
            return Err(Reply::invalid_args(format!(
                "label must be a string, got {v}"
            )));
        }
    };
    let env = match parse_env(b.get("env")) {
        Ok(env) => env,
        Err(msg) => return Err(Reply::invalid_args(msg)),
    };
    let onstart = b.get("onstart").and_then(Value::as_str).map(str::to_owned);
    let runtype = b.get("runtype").and_then(Value::as_str).map(str::to_owned);
    let cancel_unavail = b
        .get("cancel_unavail")
        .is_some_and(|v| v.as_bool() == Some(true));
    let bid = match b.get("price") {
        None | Some(Value::Null) => None,
        Some(v) => match as_f64_lenient(v) {
            Some(p) if p > 0.0 => Some(p),
            _ => {
                return Err(Reply::json(
                    400,
                    json!({"success": false, "error": "invalid_price",
                           "msg": format!("invalid bid price {v}")}),
                ));
            }
        },
    };
    Ok(CreateRequest {
        image,
        template,
        disk,
        label,
        env,
        onstart,
        runtype,
        cancel_unavail,
        bid,
    })
}

/// `env` as the API takes it: an object, or the client's docker-flag string
/// (`-e K=V -p 8080:8080`), in which `-e` pairs are kept and other flags
/// become keys with value `"1"`, as the official client does.
fn parse_env(env: Option<&Value>) -> Result<Vec<(String, String)>, String> {
    match env {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(m)) => Ok(m
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect()),
        Some(Value::String(s)) => {
            let mut out = Vec::new();
            let mut words = s.split_whitespace();
            while let Some(flag) = words.next() {
                let Some(arg) = (match flag {
                    "-e" | "-p" | "-h" | "-v" | "-n" => words.next(),
                    _ => None,
                }) else {
                    continue;
                };
                if flag == "-e" {
                    if let Some((k, v)) = arg.split_once('=') {
                        out.push((k.to_owned(), v.trim_matches(['\'', '"']).to_owned()));
                    }
                } else {
                    out.push((format!("{flag} {arg}"), "1".to_owned()));
                }
            }
            Ok(out)
        }
        Some(v) => Err(format!("env must be an object, got {v}")),
    }
}

const KEY_TYPES: [&str; 7] = [
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
];

fn is_blob(s: &str) -> bool {
    s.len() >= 16
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=')
}

fn looks_like_key(s: &str) -> bool {
    let mut words = s.split_whitespace();
    matches!((words.next(), words.next()), (Some(t), Some(b)) if KEY_TYPES.contains(&t) && is_blob(b))
}

/// OpenSSH public keys (`type blob`, comments dropped) written anywhere in `text`.
pub(crate) fn keys_in(text: &str) -> Vec<String> {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '`' | ';' | '>' | '|'))
        .filter(|w| !w.is_empty())
        .collect();
    let mut keys = Vec::new();
    for pair in words.windows(2) {
        if KEY_TYPES.contains(&pair[0]) && is_blob(pair[1]) {
            let key = format!("{} {}", pair[0], pair[1]);
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    keys
}

/// `order_by` as the v1 listing takes it: `[{"col":"id","dir":"asc"}]`, or `[["id","asc"]]`.
fn parse_order_by(s: &str) -> Option<Vec<(String, bool)>> {
    let Value::Array(keys) = serde_json::from_str::<Value>(s).ok()? else {
        return None;
    };
    keys.iter()
        .map(|k| {
            let (col, dir) = match k {
                Value::Object(m) => (
                    m.get("col")?.as_str()?,
                    m.get("dir").and_then(Value::as_str).unwrap_or("asc"),
                ),
                Value::Array(a) => (
                    a.first()?.as_str()?,
                    a.get(1).and_then(Value::as_str).unwrap_or("asc"),
                ),
                _ => return None,
            };
            Some((col.to_owned(), dir.eq_ignore_ascii_case("desc")))
        })
        .collect()
}

/// Where a listing's page starts in `rows` by its `after_token`, or the refusal of a bad token.
fn page_start(
    query: &HashMap<String, String>,
    order: &[(String, bool)],
    rows: &[Value],
) -> Result<usize, Reply> {
    match query.get("after_token").map(|s| s.trim().trim_matches('"')) {
        None | Some("") | Some("null") => Ok(0),
        Some(t) => {
            if let Some(last) = t.strip_prefix("id:").and_then(|n| n.parse::<u64>().ok()) {
                let desc = order.first().is_some_and(|o| o.1);
                Ok(rows
                    .iter()
                    .position(|r| {
                        let id = r.get("id").and_then(Value::as_u64).unwrap_or(0);
                        if desc { id < last } else { id > last }
                    })
                    .unwrap_or(rows.len()))
            } else if let Some(at) = t.strip_prefix("at:").and_then(|n| n.parse::<usize>().ok()) {
                Ok(at.min(rows.len()))
            } else {
                Err(Reply::invalid_args(format!("bad after_token: {t}")))
            }
        }
    }
}

/// `page` with only the columns `cols` names (and `id`), or all of them without `cols`.
fn select_cols(page: Vec<Value>, cols: Option<&[String]>) -> Vec<Value> {
    match cols {
        None => page,
        Some(cols) => page
            .into_iter()
            .map(|r| {
                let mut out = Map::new();
                for c in cols.iter().map(String::as_str).chain(["id"]) {
                    if let Some(v) = r.get(c) {
                        out.insert(c.to_owned(), v.clone());
                    }
                }
                Value::Object(out)
            })
            .collect(),
    }
}

fn as_f64_lenient(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn as_u64_lenient(v: &Value) -> Option<u64> {
    as_f64_lenient(v).filter(|f| *f >= 0.0).map(|f| f as u64)
}

/// How many direct ports `offer`'s machine has (`direct_port_count`, 64
/// unless its `extra` says otherwise).
fn direct_ports(offer: &Offer) -> u64 {
    offer
        .extra
        .get("direct_port_count")
        .and_then(as_u64_lenient)
        .unwrap_or(64)
}

/// When `offer`'s listing, made at `listed`, ends: after its `duration`
/// seconds (its `extra`'s, else 30 days); `None` for one too far away to
/// name.
fn listing_end(offer: &Offer, listed: Instant) -> Option<Instant> {
    let secs = offer
        .extra
        .get("duration")
        .and_then(as_f64_lenient)
        .unwrap_or(DURATION_DEFAULT_S);
    let secs = secs.max(0.0);
    if !secs.is_finite() || secs > 100.0 * 365.0 * 24.0 * 3600.0 {
        return None;
    }
    listed.checked_add(Duration::from_secs_f64(secs))
}

/// `at` as unix seconds, given that it is `now` now.
fn unix_at(at: Instant, now: Instant) -> f64 {
    let base = unix_now();
    if at >= now {
        base + (at - now).as_secs_f64()
    } else {
        base - (now - at).as_secs_f64()
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Whether `image` looks like an image reference the service would take:
/// `[registry/]name[:tag][@digest]` in lowercase letters, digits and
/// `._-/:@` (a tag may hold uppercase letters), at most 255 characters.
fn is_image_reference(image: &str) -> bool {
    let (name, tag) = match image.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => (n, t),
        _ => (image, ""),
    };
    image.len() <= 255
        && !name.is_empty()
        && !name.starts_with(['-', '.', '/'])
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-/:@".contains(c))
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-@:".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_in_onstart_scripts_and_env_values() {
        let onstart = "mkdir -p ~/.ssh; echo 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl me@x' >> ~/.ssh/authorized_keys";
        assert_eq!(
            keys_in(onstart),
            vec![
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
            ]
        );
        assert!(keys_in("ssh-ed25519 short").is_empty());
        assert!(looks_like_key(
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl c"
        ));
    }

    #[test]
    fn env_accepts_objects_and_the_clients_flag_string() {
        let obj = json!({"A": "1", "B": 2});
        assert_eq!(
            parse_env(Some(&obj)).unwrap(),
            vec![("A".into(), "1".into()), ("B".into(), "2".into())]
        );
        let s = json!("-e TZ=UTC -e X='a=b' -p 8080:8080");
        assert_eq!(
            parse_env(Some(&s)).unwrap(),
            vec![
                ("TZ".into(), "UTC".into()),
                ("X".into(), "a=b".into()),
                ("-p 8080:8080".into(), "1".into())
            ]
        );
        assert!(parse_env(Some(&json!(3))).is_err());
    }
}
