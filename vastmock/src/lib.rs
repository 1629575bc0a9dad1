//! A stateful Vast.ai API mock for tests: real HTTP on loopback, a real sshd per running instance, fault knobs.
//!
//! [`VastMock::start`] serves, on its own thread and tokio runtime, the
//! parts of the Vast.ai REST API that the official `vastai` client (1.9.1)
//! and Swactor's provider use:
//!
//! | Route | Does |
//! |---|---|
//! | `POST /api/v0/bundles/` | search offers whose listing has not ended: filters (`eq` `neq` `lt` `lte` `gt` `gte` `in` `notin`), `order`, `limit`, `type` |
//! | `PUT /api/v0/asks/{offer}/` | create (rent): `image`, `disk`, `label`, `onstart`, `runtype`, `env`, `cancel_unavail`, `price`; an ended listing is 404 `no_such_ask` |
//! | `POST /api/v0/asks/bulk/` | one create per offer in `ids` (≤ 64), same body; `{"success","new_contracts","results"}`, or the first refusal when none committed |
//! | `GET /api/v0/instances/` | v0 listing `{"instances":[…]}` |
//! | `PUT /api/v0/instances/` | `{"ids":[…],"state":…}` (or `label`): the update of each; `{"success","updated","failed"}`, or the first refusal when none succeeded. An instance's own key: `state` of its own id only |
//! | `DELETE /api/v0/instances/` | `{"instance_ids":[…]}`: destroys those that exist; `{"success","destroyed","not_found"}`, 404 when none did. An instance's own key: its own id only |
//! | `GET /api/v1/instances/` | v1 listing: `select_filters`, `order_by`, `limit` (≤ 25), `after_token`, `select_cols`; `next_token`, `total_instances`, `label_counts` |
//! | `GET /api/v0/instances/filters/` | distinct status/verification/GPU combinations (the CLI asks) |
//! | `GET /api/v0/instances/{id}/` | show; `{"instances": null}` when absent |
//! | `PUT /api/v0/instances/{id}/` | `{"label": …}` and/or `{"state": "stopped" \| "running"}`; an instance's own key: `{"state": …}` alone, of its own id |
//! | `DELETE /api/v0/instances/{id}/` | destroy; also with the instance's own key |
//! | `PUT /api/v0/instances/reboot/{id}/` | a running instance is `rebooting` (sshd down, its processes ended) for `Timings::restart`, then `running` on the same port; else 400 `invalid_state` |
//! | `PUT /api/v0/instances/bid_price/{id}/` | `{"price":P}` for an interruptible instance (created with a `price`): `dph_total` becomes P; no price: `min_bid`; under `min_bid`: 400 `invalid_price`; on-demand: 400 |
//! | `PUT /api/v0/instances/request_logs/{id}/` | `{"tail","filter"}`: the instance's log at a `result_url` |
//! | `PUT /api/v0/instances/command/{id}/` | `{"command":"ls …"}` (`ls`, `du`, `rm`; paths inside the instance) run in the home directory of a running instance: the output at a `result_url`, and `writeable_path` |
//! | `GET /results/{token}` | a `result_url`: the text (no key needed, like the storage links the service gives); 404 `NoSuchKey` XML when unknown |
//! | `POST/GET /api/v0/ssh/`, `DELETE /api/v0/ssh/{id}/` | account SSH keys |
//! | `POST /api/v0/instances/{id}/ssh/` | attach a key to one instance (its sshd accepts it at once) |
//! | `GET /api/v0/users/current/` | a fixed user (the CLI asks to learn its role) |
//!
//! Every `/api` route works with and without its trailing slash. Authentication
//! is `Authorization: Bearer KEY` or `?api_key=KEY`, with the account's key
//! or an instance's own key (see below); a missing or wrong key (a
//! destroyed instance's among them) gets 401
//! `{"success":false,"error":"auth_error","msg":"Invalid user key"}`.
//! The base URL ([`VastMock::url`], no trailing slash) works as `VAST_URL`
//! for the official client and for a client appending `/api/v0/...`.
//!
//! # Instances
//! A create whose `image` is not an image reference (lowercase name,
//! `._-/:@`, a tag of letters and digits) is refused with 400
//! `invalid_args`, before anything is rented.
//! An instance is `null` (provisioning), then `loading`, then `running`,
//! with the [`Timings`] of the configuration, counted from the creation
//! instant. The mock's clock moves every instance along every 100 ms, as
//! the service's hosts do on their own (its container starts, its
//! `onstart` runs and its exit is seen with nobody asking), and every call
//! or [`VastMock`] method does the same first, so an answer is never
//! behind the timings.
//! Each instance has a machine directory `{state_dir}/machines/{id}`; when
//! it becomes `running`, an OpenSSH server
//! ([`swactor_providers::ssh::testing::Sshd`]) starts there on a loopback
//! port.
//!
//! SSH has two ways in, as on the service. Every running instance has a
//! *proxy*: `ssh_host` is [`PROXY_HOST`] (`localhost`) and `ssh_port` a
//! loopback port of its own whose connections the mock forwards to the
//! sshd (a small forwarder on the mock's runtime, listening from the first
//! boot to the destroy; while the container is down it accepts and closes).
//! Only an offer with direct ports (`direct_port_count` ≥ 1, 64 unless its
//! `extra` says otherwise) also gives the *direct* endpoint:
//! `public_ipaddr` (`127.0.0.1`) and the sshd's own port in
//! `ports["22/tcp"]`. A running instance on an offer with
//! `direct_port_count: 0` shows `ports: {}`, so a client that insists on
//! direct SSH finds none; a stopped one shows `ports: null`. The default
//! offers all have direct ports (add one without through
//! [`VastMock::add_offer`]). [`InstanceView::ssh_port`] is the sshd's port
//! and [`InstanceView::proxy_port`] the proxy's.
//!
//! The sshd's `authorized_keys` holds the account's keys as of the create, plus
//! every OpenSSH public key (`ssh-ed25519 AAAA…`, `ssh-rsa …`, `ecdsa-sha2-…`,
//! `sk-…`; type and blob, comment dropped) written anywhere in the create's
//! `onstart` or in an `env` value, plus keys attached later. Commands over
//! SSH find an `nvidia-smi` (`{dir}/bin`, first on `PATH`) that reports the
//! offer's GPUs (model, count, memory; its table, `-L` and `--query-gpu`),
//! so a boot check of `nvidia-smi` passes as on a GPU host.
//!
//! At every container start (the first boot, a start after a stop, a
//! reboot, a bid that wins again) the create's `onstart`, if any, runs with
//! `bash -c` in the home directory (`{dir}/home`, also `$HOME`), with
//! `{dir}/bin` first on `PATH` and the create's `env` exported (an object,
//! or the client's `-e K=V` flags; other flags are not variables), and
//! with `CONTAINER_ID` (the instance's id) and `CONTAINER_API_KEY` (its
//! own key), which win over `env` entries of those names. It runs
//! as a process group of its own, next to the sshd, and is not waited
//! for: what it writes (stdout and stderr, at most 256 KiB a start, lines
//! cut at 4 KiB) reaches the instance log as the mock is asked, and so
//! does its exit. Exiting 0, or running on (a server, `sleep 1000 &`),
//! leaves the instance `running`; exiting non-zero ends the container:
//! `actual_status` `exited` (`intended_status` `running`) with a
//! `status_msg` of `Container exited: onstart exited with status N` (or
//! `was killed by signal N`), sshd and processes gone, as a container that
//! ended on its own shows it; a start runs it again. Stopping, rebooting,
//! destroying and dropping the mock kill its whole group, and every other
//! process whose working directory is in the machine directory.
//!
//! Stopping stops the sshd (`ports` null); starting again goes through
//! `loading` for `Timings::restart` and restarts it on the same port;
//! destroying stops it, closes the proxy and removes the directory; the
//! instance then vanishes, or shows `destroyed` for
//! `Timings::destroyed_visible`. A stopped instance shows `actual_status`
//! `stopped` (`intended_status` `stopped`); `exited` is a container that
//! ended on its own ([`Death::Exited`]), whose `onstart` failed, or that
//! could not be scheduled; `offline` a host that stopped reporting
//! ([`Death::Offline`]); `frozen` a host that holds the GPU, bills for
//! it and runs nothing ([`Death::Frozen`]); an outbid interruptible one
//! is `stopped` with `intended_status` `running` until its bid wins
//! again. The offer is `rented` (and not `rentable`) from
//! the create until the destroy. Dropping the [`VastMock`] stops every
//! sshd, proxy and `onstart`.
//!
//! `ssh_port` (the proxy) and the direct port are null until the first
//! boot completes, then stay the same across stops and starts. Account
//! keys added after a create do not reach
//! that instance (the real service says it adds them to current instances;
//! the mock keeps the create-time set so a provider cannot come to rely on
//! that); attach a key to one instance instead.
//!
//! # An instance's own key
//! As the service does, each create (single or bulk) gives the new
//! instance a key of its own: 64 random hex digits from the system's
//! generator, unlike the account's key and every other instance's. Its
//! container sees it as `CONTAINER_API_KEY`, with `CONTAINER_ID`, at every
//! start (see Instances); [`VastMock::instance_key`] tells it to a test.
//! The key may start, stop or destroy that one instance and nothing else:
//! `DELETE /api/v0/instances/{own}/`, `PUT /api/v0/instances/{own}/` with
//! a body of `{"state":"stopped"|"running"}` alone, and the bulk
//! `PUT /api/v0/instances/` (`ids` and `state` alone) and
//! `DELETE /api/v0/instances/` when every id they list is its own. Any
//! other call with it (another instance, a label, a search, a create, a
//! listing, a show, a reboot, logs, SSH keys, the user, …) gets 403
//! `{"success":false,"error":"permission_denied","msg":"Permission denied: this key may only start, stop or destroy instance N"}`
//! and changes nothing; a bulk call that lists another id with its own is
//! refused whole. Once the instance is destroyed the key is unknown (401).
//! Every successful destroy, with the key that made it ([`KeyUse`]), is
//! in [`VastMock::destroys`], and a stderr line names the instance and
//! the kind of key (never the key).
//!
//! # Listings and contracts end
//! An offer's `duration` is the seconds its machine's listing has left: it
//! ends `duration` after the mock's start (or after [`VastMock::add_offer`]),
//! 30 days unless the offer's `extra` names a `duration`, and searches show
//! what is left. An ended listing is not searched, and a create of it is
//! refused as one of an offer that is not available (404, code 3603);
//! [`VastMock::offers`] still lists it, not `rentable`, `duration` 0.
//!
//! An instance's contract ends with its offer's listing as it was at the
//! create: its `end_date` (unix seconds) says when. Then its host stops
//! it, as the service documents for an expired contract: `actual_status`
//! `stopped` with `intended_status` still `running` (its owner did not ask
//! for it, as for an outbid instance) and a `status_msg` saying the
//! contract reached its end date; sshd, `onstart` and processes gone,
//! `ports` null. It cannot start again (400 `invalid_state`), but can be
//! destroyed, which frees the offer. `exited` was not chosen: the service
//! says it stops expired instances, and keeps their data for a while.
//! [`VastMock::expire_offer`] and [`VastMock::expire`] bring either end
//! closer.
//!
//! # Caveats
//! - A machine is not a container: SSH commands run on this machine, as
//!   root, in the machine's home directory (`$HOME`), like any
//!   [`swactor_providers::ssh::testing::Sshd`] host. `image` is only recorded.
//! - `onstart` runs on this machine, as root (see Instances): a script for
//!   a real image may fail here for want of what the image has. Keys in it
//!   are also read at the create, so they log in whatever it does. `env`
//!   reaches `onstart` and `extra_env`, not SSH sessions.
//! - The log (`request_logs`) is the mock's account of the container's
//!   life (`vastmock: container of instance N started from IMAGE …`,
//!   stopped, rebooting, exited, `onstart`'s exit), with `onstart`'s
//!   output between those lines as the mock read it; `daemon_logs` answers
//!   the same lines. Results stay fetchable for the last 256 results.
//! - The proxy is one hop on loopback, not the service's shared proxy
//!   hosts: it neither throttles nor adds latency.
//! - One account with one key, and a key of its own per instance.
//!   Templates, volumes, scheduled jobs and billing are not served;
//!   neither are `recycle`, `prepay` nor `update_template`.
//! - `CONTAINER_ID` and `CONTAINER_API_KEY`, like `env`, reach `onstart`
//!   only, not SSH sessions: an `onstart` that wants them there copies
//!   them to a file.
//! - Nothing is persisted: a restarted binary starts empty (leftover
//!   machine directories in a given `--state-dir` are not adopted).
//!
//! # Search
//! Filters on fields an offer does not have are ignored; a bare value means
//! `eq`; numbers may come as strings and `_` equals a space, as the official
//! CLI sends them. `geolocation` (stored as `"Texas, US"`) is filtered by its
//! two-letter country code, as the CLI documents it: `geolocation in [US,CA]`. `type` `bid`/`interruptible` prices offers at `min_bid`;
//! `allocated_storage` (GB) adds that storage to every `dph_total`, at the
//! offer's `storage_cost` (dollars per GB and month, 0.15 unless its
//! `extra` says otherwise), and an instance's `dph_total` holds the storage
//! of its `disk`, as the service bills it. Without `order`, offers come
//! by `score` descending; without `limit`, at most 64.
//!
//! # Rate limits
//! A minimum interval per endpoint group ([`Endpoint`]) and key
//! ([`RateLimits`], scaled by `RateLimits::scale`); a call inside the interval
//! after the last *accepted* call gets 429
//! `{"success":false,"error":"rate_limited","msg":"API requests too frequent: endpoint threshold=…"}`
//! (the official client prints `msg`; or the same words as plain text, see
//! [`VastMock::rate_limit_text`]), no `Retry-After`. A refused (429) call
//! does not move the window. The listing allows a burst of
//! `RateLimits::list_burst` calls (a token bucket), so that the official
//! client's back-to-back paging passes; [`VastMock::strict_rate_limits`]
//! takes the burst away. A bulk call counts as one call.
//!
//! # Order of checks
//! Authentication (401), then what an instance's own key may do (403),
//! then a pending 429 burst, then the rate limit, then a random 5xx (which
//! changes nothing), then the call itself.
//!
//! # Fault knobs
//! Each knob is a method of [`VastMock`] and an admin route (`POST`, JSON
//! body, no authentication; answers `{"success":true,…}` or 400):
//!
//! | Admin route | Body | Rust |
//! |---|---|---|
//! | `/admin/faults/offer_gone` | `{"offer_id":N,"kind":"not_found"\|"unavailable"\|null}` | [`VastMock::offer_gone`] |
//! | `/admin/faults/rate_burst` | `{"endpoint":"create","count":K}` | [`VastMock::rate_burst`] |
//! | `/admin/faults/malformed` | `{"endpoint":"list","count":K}` | [`VastMock::malformed`] |
//! | `/admin/faults/rate_limit_text` | `{"text":true}` | [`VastMock::rate_limit_text`] |
//! | `/admin/faults/strict_rate_limits` | `{"strict":true}` | [`VastMock::strict_rate_limits`] |
//! | `/admin/faults/slow_loading` | `{"target":T,"loading_ms":N}` | [`VastMock::slow_loading`] |
//! | `/admin/faults/stuck_loading` | `{"target":T}` | [`VastMock::stuck_loading`] |
//! | `/admin/faults/boot_failure` | `{"target":T}` | [`VastMock::boot_failure`] |
//! | `/admin/faults/ssh_never_ready` | `{"target":T}` | [`VastMock::ssh_never_ready`] |
//! | `/admin/faults/expire` | `{"target":{"id":N}\|{"label":"x"},"in_ms":N}` or `{"offer_id":N,"in_ms":N}` | [`VastMock::expire`], [`VastMock::expire_offer`] |
//! | `/admin/faults/kill` | `{"target":{"id":N}\|{"label":"x"},"death":"exited"\|"offline"\|"frozen"\|"vanished"}` | [`VastMock::kill`] |
//! | `/admin/faults/ambiguous_create` | `{"kind":{"timeout":{"hold_ms":N}}\|"drop"\|"bad_gateway"\|"malformed","count":K}` | [`VastMock::ambiguous_create`] |
//! | `/admin/faults/listing_lag` | `{"lag_ms":N}` | [`VastMock::listing_lag`] |
//! | `/admin/faults/flaky_destroy` | `{"count":K,"status":500}` | [`VastMock::flaky_destroy`] |
//! | `/admin/faults/random_5xx` | `{"probability":P,"seed":S}` | [`VastMock::random_5xx`] |
//! | `/admin/faults/clear` | none | [`VastMock::clear_faults`] |
//! | `/admin/offers` | an [`Offer`] | [`VastMock::add_offer`] |
//! | `/admin/ssh_keys` | `{"ssh_key":"ssh-ed25519 …"}` | [`VastMock::add_ssh_key`] |
//! | `/admin/rate_scale` | `{"scale":0.01}` | [`VastMock::set_rate_scale`] |
//! | `/admin/timings` | `{"provisioning_ms":N,"loading_ms":N,"restart_ms":N,"destroyed_visible_ms":N}` | [`VastMock::set_timings`] |
//!
//! A target `T` is a [`Selector`]: `{"id":N}` (an existing instance),
//! `{"label":"x"}` (existing and future instances with the label),
//! `{"next":K}` (the next K creates) or `"all_new"`. `GET /admin/counters`
//! answers `{"creates_total","creates_per_label","live_instances"}` and
//! `GET /admin/state` adds `"instances"` (rows, destroyed ones included)
//! and `"offers"`.

#![recursion_limit = "256"] // `json!` rows of ~50 fields (offers, instances).

mod config;
mod faults;
mod filter;
mod machine;
mod restricted;
mod server;
mod world;

pub use config::{Endpoint, MockConfig, Offer, RateLimits, Timings, default_offers};
pub use faults::{Ambiguity, Death, Gone, Selector};
pub use restricted::{Destroy, KeyUse};
pub use world::{InstanceView, PROXY_HOST};

use faults::{InstanceFault, SplitMix64};
use serde_json::{Value, json};
use server::Shared;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use world::World;

/// A knob or configuration value the mock cannot honour; the message says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidArgument(pub String);

/// Why the mock did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is not valid.
    #[error("invalid mock configuration")]
    Config(#[source] InvalidArgument),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The state directory could not be made.
    #[error("cannot make the state directory {path}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The server thread or runtime could not start.
    #[error("cannot start the server thread")]
    Runtime(#[source] std::io::Error),
}

/// A running mock; stops its server and every instance's sshd, proxy and
/// `onstart` when dropped.
///
/// ```
/// use std::time::Duration;
/// use swactor_vastmock::{Ambiguity, MockConfig, Selector, VastMock};
///
/// let mock = VastMock::start(MockConfig::fast())?;
/// // Point the client at it: `VAST_URL`/`--url` = mock.url(), key = mock.api_key().
/// assert!(mock.url().starts_with("http://127.0.0.1:"));
/// mock.ambiguous_create(Ambiguity::Drop, 1);
/// mock.stuck_loading(Selector::Label("run-7/slot-0".into()));
/// mock.listing_lag(Duration::from_millis(500));
/// // … run the code under test, then look:
/// assert_eq!(mock.creates_per_label().get("run-7/slot-0"), None);
/// assert_eq!(mock.live_instances(), 0);
/// # Ok::<(), swactor_vastmock::StartError>(())
/// ```
///
/// Every method is synchronous and may be called from any thread, inside a
/// tokio runtime or not. Methods that look at instances first apply what
/// time has decided (see the crate doc), which can start an sshd and an
/// `onstart` script: they may block for about 100 ms per instance that has
/// just become `running` (never for the script to finish).
#[derive(Debug)]
pub struct VastMock {
    shared: Arc<Shared>,
    url: String,
    api_key: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Holds the state directory when the mock made it.
    _temp: Option<tempfile::TempDir>,
    state_dir: PathBuf,
}

impl VastMock {
    /// Starts the mock: binds the listen address, then serves on a thread of
    /// its own. Returns once it accepts connections.
    ///
    /// # Errors
    /// An invalid configuration, an address that cannot be bound, a state
    /// directory that cannot be made.
    pub fn start(config: MockConfig) -> Result<Self, StartError> {
        config.validate().map_err(StartError::Config)?;
        let (temp, state_dir) = match &config.state_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| StartError::StateDir {
                    path: dir.clone(),
                    source,
                })?;
                (None, dir.clone())
            }
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("swactor-vastmock-")
                    .tempdir()
                    .map_err(|source| StartError::StateDir {
                        path: std::env::temp_dir(),
                        source,
                    })?;
                let dir = temp.path().to_owned();
                (Some(temp), dir)
            }
        };
        let machines = state_dir.join("machines");
        std::fs::create_dir_all(&machines).map_err(|source| StartError::StateDir {
            path: machines.clone(),
            source,
        })?;
        let listener =
            std::net::TcpListener::bind(config.listen).map_err(|source| StartError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(StartError::Runtime)?;
        let api_key = config.api_key.clone().unwrap_or_else(made_up_key);
        let url = format!("http://{addr}");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(StartError::Runtime)?;
        let shared = Arc::new(Shared::new(World::new(
            &config,
            api_key.clone(),
            machines,
            url.clone(),
            runtime.handle().clone(),
        )));
        let app = server::router(shared.clone());
        let clock = shared.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name(format!("vastmock-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async move {
                    // The service's own clock: containers start, fail and
                    // end on time whether or not anyone asks.
                    tokio::spawn(async move {
                        let mut tick = tokio::time::interval(CLOCK_TICK);
                        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        loop {
                            tick.tick().await;
                            let shared = clock.clone();
                            let settled = tokio::task::spawn_blocking(move || {
                                shared.world().settle(Instant::now());
                            });
                            if settled.await.is_err() {
                                return;
                            }
                        }
                    });
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => server::serve(listener, app, stopped).await,
                        Err(e) => eprintln!("swactor-vastmock: cannot serve: {e}"),
                    }
                });
                // Connections still open are dropped; a call still starting
                // an sshd gets a moment to finish.
                runtime.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(StartError::Runtime)?;
        Ok(Self {
            shared,
            url,
            api_key,
            stop: Some(stop),
            thread: Some(thread),
            _temp: temp,
            state_dir,
        })
    }

    /// The base URL, `http://127.0.0.1:PORT` (no trailing slash): what
    /// `VAST_URL` or `--url` takes; the API is under `{url}/api/v0/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The account's API key.
    pub fn api_key(&self) -> &str {
        &self.api_key
    }

    /// The state directory (machine directories are under `machines/`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    // ---- catalogue, keys, limits --------------------------------------------

    /// Adds an offer to the catalogue.
    ///
    /// # Errors
    /// When an offer with its id exists.
    pub fn add_offer(&self, offer: Offer) -> Result<(), InvalidArgument> {
        self.shared
            .world()
            .add_offer(offer, Instant::now())
            .map_err(InvalidArgument)
    }

    /// Every offer as the search lists it (rented ones included, and those
    /// whose listing has ended, with `rentable` false and `duration` 0).
    pub fn offers(&self) -> Vec<Value> {
        self.shared.world().offers_json(Instant::now())
    }

    /// Whether the offer is rented now (`None`: no such offer).
    pub fn offer_rented(&self, offer_id: u64) -> Option<bool> {
        self.shared.world().offer_rented(offer_id)
    }

    /// Adds an account SSH key (`authorized_keys` line); returns its id.
    /// Instances created from now on accept it.
    ///
    /// # Errors
    /// When it is not an OpenSSH public key.
    pub fn add_ssh_key(&self, key: &str) -> Result<u64, InvalidArgument> {
        self.shared
            .world()
            .add_account_key(key)
            .map_err(InvalidArgument)
    }

    /// Sets the factor on every rate-limit interval (0 turns limits off).
    ///
    /// # Errors
    /// A negative or non-finite factor.
    pub fn set_rate_scale(&self, scale: f64) -> Result<(), InvalidArgument> {
        self.shared
            .world()
            .set_rate_scale(scale)
            .map_err(InvalidArgument)
    }

    /// Replaces the rate limits (intervals and scale).
    pub fn set_rate_limits(&self, limits: RateLimits) {
        self.shared.world().set_rate_limits(limits);
    }

    /// Replaces the boot timings for instances created (or started) from now on.
    pub fn set_timings(&self, timings: Timings) {
        self.shared.world().set_timings(timings);
    }

    // ---- fault knobs --------------------------------------------------------

    /// Makes renting `offer_id` fail as `kind` says (see [`Gone`]); `None` clears it.
    pub fn offer_gone(&self, offer_id: u64, kind: Option<Gone>) {
        let mut w = self.shared.world();
        match kind {
            Some(kind) => w.faults.offers_gone.insert(offer_id, kind),
            None => w.faults.offers_gone.remove(&offer_id),
        };
    }

    /// The next `count` calls of `endpoint` (any key) get 429.
    pub fn rate_burst(&self, endpoint: Endpoint, count: u32) {
        self.shared
            .world()
            .faults
            .rate_bursts
            .insert(endpoint, count);
    }

    /// The next `count` answers of `endpoint` that would have been a 200
    /// (any key) are a 200 whose JSON is cut off halfway. For a create the
    /// instance is still made, as with [`Ambiguity::Malformed`].
    pub fn malformed(&self, endpoint: Endpoint, count: u32) {
        self.shared.world().faults.malformed.insert(endpoint, count);
    }

    /// Loading takes `loading` for the targeted instances (a booting one
    /// counts it from its creation).
    pub fn slow_loading(&self, target: Selector, loading: Duration) {
        self.shared.world().instance_fault(
            &target,
            InstanceFault::SlowLoading(loading),
            Instant::now(),
        );
    }

    /// The targeted instances never leave `loading`.
    pub fn stuck_loading(&self, target: Selector) {
        self.shared
            .world()
            .instance_fault(&target, InstanceFault::StuckLoading, Instant::now());
    }

    /// The targeted instances end their loading as `created` with an
    /// "OCI runtime create failed" `status_msg`, and never run.
    pub fn boot_failure(&self, target: Selector) {
        self.shared
            .world()
            .instance_fault(&target, InstanceFault::BootFailure, Instant::now());
    }

    /// The targeted instances run, with ports, but no sshd answers (a running
    /// one loses its sshd now).
    pub fn ssh_never_ready(&self, target: Selector) {
        self.shared
            .world()
            .instance_fault(&target, InstanceFault::SshNeverReady, Instant::now());
    }

    /// Kills the instances `target` names now ([`Selector::Id`] or
    /// [`Selector::Label`]; others name nothing); returns how many died.
    pub fn kill(&self, target: Selector, death: Death) -> usize {
        self.shared.world().kill(&target, death, Instant::now())
    }

    /// The listing of `offer_id` ends `after` from now (its `duration` as
    /// the search shows it counts down to it): from then on searches leave
    /// it out and a create of it is refused as one of an offer that is not
    /// available (404). Instances already renting it keep their contracts.
    ///
    /// # Errors
    /// When there is no such offer.
    pub fn expire_offer(&self, offer_id: u64, after: Duration) -> Result<(), InvalidArgument> {
        self.shared
            .world()
            .expire_offer(offer_id, after, Instant::now())
            .map_err(InvalidArgument)
    }

    /// The contracts of the instances `target` names ([`Selector::Id`] or
    /// [`Selector::Label`]) end `after` from now: their `end_date` says so,
    /// and once it passes each is stopped by its host (`stopped`, processes
    /// and SSH gone, see the crate doc) and cannot start again. Returns how
    /// many.
    pub fn expire(&self, target: Selector, after: Duration) -> usize {
        self.shared
            .world()
            .expire_instances(&target, after, Instant::now())
    }

    /// Outbids the interruptible instances `target` names ([`Selector::Id`]
    /// or [`Selector::Label`]) that run or boot: each shows `stopped` with
    /// its intended status still `running`, its processes stopped and its
    /// SSH gone, billing on, until [`VastMock::bid_wins`]. Returns how many.
    pub fn outbid(&self, target: Selector) -> usize {
        self.shared.world().outbid(&target, Instant::now())
    }

    /// The bids of the outbid instances `target` names win again: they
    /// start again. Returns how many.
    pub fn bid_wins(&self, target: Selector) -> usize {
        self.shared.world().bid_wins(&target, Instant::now())
    }

    /// The next `count` creates commit, then answer as `kind` says.
    pub fn ambiguous_create(&self, kind: Ambiguity, count: u32) {
        let mut w = self.shared.world();
        for _ in 0..count {
            w.faults.ambiguous.push(kind);
        }
    }

    /// Instances created from now on stay out of listings (v0, v1, label
    /// filters) for `lag`; `GET /instances/{id}/` shows them at once.
    pub fn listing_lag(&self, lag: Duration) {
        self.shared.world().faults.listing_lag = lag;
    }

    /// The next `count` destroys answer `status` (5xx) and destroy nothing.
    ///
    /// # Errors
    /// A status outside 500..=599.
    pub fn flaky_destroy(&self, count: u32, status: u16) -> Result<(), InvalidArgument> {
        set_flaky_destroy(&mut self.shared.world(), count, status).map_err(InvalidArgument)
    }

    /// Each rate-limited call fails with 500, 502 or 503 (changing nothing)
    /// with probability `probability`, from a generator seeded with `seed`.
    ///
    /// # Errors
    /// A probability outside [0, 1].
    pub fn random_5xx(&self, probability: f64, seed: u64) -> Result<(), InvalidArgument> {
        set_random_5xx(&mut self.shared.world(), probability, seed).map_err(InvalidArgument)
    }

    /// 429 answers carry plain text (`API requests too frequent …`) instead
    /// of JSON `{"detail": …}` when `text`; Vast.ai answers both ways.
    pub fn rate_limit_text(&self, text: bool) {
        self.shared.world().faults.text_429 = text;
    }

    /// Every endpoint allows one call per interval when `strict`, the
    /// listing included: no burst (see [`RateLimits`]), so the official
    /// client's paging of more than 25 instances meets 429s.
    pub fn strict_rate_limits(&self, strict: bool) {
        self.shared.world().faults.strict_rate_limits = strict;
    }

    /// Clears every knob (instances keep the faults already stamped on them).
    pub fn clear_faults(&self) {
        clear_faults(&mut self.shared.world());
    }

    // ---- counters and state -------------------------------------------------

    /// Committed creates per label, ambiguous ones included; unlabeled
    /// creates count under `""`.
    pub fn creates_per_label(&self) -> BTreeMap<String, u64> {
        self.shared.world().counters().creates_per_label
    }

    /// Committed creates in all.
    pub fn creates_total(&self) -> u64 {
        self.shared.world().counters().creates_total
    }

    /// Instances that exist and are not destroyed.
    pub fn live_instances(&self) -> usize {
        let mut w = self.shared.world();
        w.settle(Instant::now());
        w.live_instances()
    }

    /// Every instance now (destroyed ones still in their grace period included).
    pub fn instances(&self) -> Vec<InstanceView> {
        let mut w = self.shared.world();
        let now = Instant::now();
        w.settle(now);
        w.views(now)
    }

    /// One instance now.
    pub fn instance(&self, id: u64) -> Option<InstanceView> {
        self.instances().into_iter().find(|i| i.id == id)
    }

    /// The restricted key of instance `id` (its `CONTAINER_API_KEY`: it may
    /// start, stop or destroy that instance and nothing else), while the
    /// instance exists and is not destroyed.
    pub fn instance_key(&self, id: u64) -> Option<String> {
        self.shared.world().instance_key(id)
    }

    /// Every successful destroy (single or bulk, through the API), oldest
    /// first, with the key that made it; the last 10,000 are kept. Kills
    /// ([`VastMock::kill`]) are not destroys.
    pub fn destroys(&self) -> Vec<Destroy> {
        self.shared.world().destroys()
    }
}

impl Drop for VastMock {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let mut w = self.shared.world();
        w.shutdown();
        let _ = std::fs::remove_dir(w.machines_dir());
    }
}

/// How often the mock's clock moves every instance along on its own.
const CLOCK_TICK: Duration = Duration::from_millis(100);

fn made_up_key() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = SplitMix64::new(nanos ^ u64::from(std::process::id()).rotate_left(32));
    format!("mock{:016x}{:016x}", rng.next_u64(), rng.next_u64())
}

pub(crate) fn set_flaky_destroy(w: &mut World, count: u32, status: u16) -> Result<(), String> {
    if !(500..=599).contains(&status) {
        return Err(format!("flaky destroy status must be 5xx, got {status}"));
    }
    w.faults.flaky_destroys = count;
    w.faults.flaky_destroy_status = status;
    Ok(())
}

pub(crate) fn set_random_5xx(w: &mut World, probability: f64, seed: u64) -> Result<(), String> {
    if !(0.0..=1.0).contains(&probability) {
        return Err(format!("probability must be in [0, 1], got {probability}"));
    }
    w.faults.random_5xx = (probability > 0.0).then(|| (probability, SplitMix64::new(seed)));
    Ok(())
}

pub(crate) fn clear_faults(w: &mut World) {
    w.faults = faults::Faults {
        flaky_destroy_status: 500,
        ..faults::Faults::default()
    };
}

pub(crate) fn admin_counters(w: &mut World) -> Value {
    let c = w.counters();
    json!({
        "creates_total": c.creates_total,
        "creates_per_label": c.creates_per_label,
        "live_instances": w.live_instances(),
    })
}

pub(crate) fn admin_state(w: &mut World, now: Instant) -> Value {
    w.settle(now);
    let mut state = admin_counters(w);
    state["instances"] = w.views(now).into_iter().map(|v| v.row).collect();
    state["offers"] = Value::Array(w.offers_json(now));
    state
}
