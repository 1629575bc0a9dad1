//! `swactor up`: the daemon, in the foreground.
//!
//! This file runs a start from end to end ([`up`]) and serves until told to
//! stop; `start` holds what is checked and decided before anything starts,
//! `fleet` makes the providers, and `serve` binds the endpoints and starts
//! the protocols.

use crate::agentbin::AgentBinary;
use crate::control::{ControlHandler, DownRequest, apply_file};
use crate::journal::DaemonJournal;
use crate::progress::Progress;
use crate::protocol::FRAME_LEN_MAX;
use crate::shapefile::ShapeFile;
use crate::state::StateDir;
use crate::swarm::{RefusalLog, SwarmHandler};
use anyhow::{Context, Result};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::{
    Cluster, ClusterConfig, ClusterEvent, ClusterHandle, ClusterSnapshot, ShutdownMode,
    ShutdownReport, SupervisorArgs, SupervisorExit,
};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, ALPN_TELEMETRY, Allowlist, EndpointTicket, GuardedRouterBuilder,
    HandshakeRate, Limits, NetConfig, bind_endpoint,
};
use swactor_engine::telemetry::{NdjsonConfig, NdjsonSink, TelemetryConfig, TelemetryPublisher};
use swactor_engine::{EngineInstant, RestartPolicy};
use swactor_providers::Provider;
use swactor_providers::Providers;
use swactor_providers::docker::{DockerConfig, DockerOnDemand};
use swactor_providers::process::{ProcessConfig, ProcessProvider};
use swactor_providers::ssh::{SshHostsConfig, SshHostsProvider};
use swactor_providers::vast::{ApiKey, Pacing, VastConfig, VastProvider};
use swactor_provisioning::{
    Generation, JournalImage, RunId, StartDecision, StartRefusal, Unrecorded,
};
use tokio::sync::{mpsc, oneshot};

mod fleet;
pub(crate) mod ha;
mod serve;
mod start;

pub use ha::{DEFAULT_LEASE_TTL, HaOptions};

use fleet::*;
use ha::{GAVE_UP, LOST_LEAD, Term};
use serve::*;
use start::*;

/// Options of `swactor up`.
#[derive(Debug)]
pub struct UpOptions {
    /// The shape to converge on, if any.
    pub shape: Option<PathBuf>,
    /// The state directory.
    pub state_dir: PathBuf,
    /// Exit once converged.
    pub until_converged: bool,
    /// How long to wait for convergence.
    pub timeout: Duration,
    /// Leave nodes running on exit.
    pub keep: bool,
    /// Apply the shape without asking, whatever it changes.
    pub yes: bool,
    /// The address to listen on (default loopback).
    pub listen: Option<IpAddr>,
    /// The address remote agents dial (default: `listen`).
    pub advertise: Option<IpAddr>,
    /// The binary remote hosts run as their agent.
    pub agent_binary: Option<PathBuf>,
    /// Where the web surface (dashboard, metrics) listens; default: the
    /// address the last daemon used, else a free port on 127.0.0.1.
    pub http: Option<SocketAddr>,
    /// `--adopt` or `--fresh`: what to do with an earlier run's resources
    /// when the journal was lost.
    pub unrecorded: Option<Unrecorded>,
    /// Providers the embedding program brings, besides the built-in ones
    /// (the `swactor` binary brings none).
    pub providers: Vec<EmbeddedProvider>,
    /// `--etcd`: the journal in etcd, shared with standby daemons of the
    /// same run (`None`: `journal.redb`, this daemon alone).
    pub ha: Option<HaOptions>,
    /// `--flight-max-mib`: the most bytes the flight recordings under
    /// `{state}/flight/` may take together; 0 records nothing.
    pub flight_max_bytes: u64,
}

/// How many bytes the flight recordings may take unless told otherwise.
pub const FLIGHT_MAX_BYTES_DEFAULT: u64 = swactor_engine::flight::FlightLimits::DISK_MAX_DEFAULT;

/// The flight recorder under `{state}/flight/`, or none when told to keep
/// none or when the directory cannot be made (said, and the daemon runs on:
/// a recording explains, it decides nothing).
fn open_flight(state: &Path, max_bytes: u64) -> Option<swactor_actors::FlightRecorder> {
    if max_bytes == 0 {
        return None;
    }
    let dir = state.join("flight");
    let limits = swactor_engine::flight::FlightLimits::on_disk(max_bytes);
    match swactor_actors::FlightRecorder::open(&dir, limits) {
        Ok(recorder) => Some(recorder),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "no flight recording: its directory cannot be made");
            None
        }
    }
}

/// A provider an embedding program brings to the daemon: groups name it by
/// `kind` (`provider = "…"` in a shape), as they name the built-in ones.
pub struct EmbeddedProvider {
    /// The kind groups name it by; not a built-in kind.
    pub kind: &'static str,
    /// Makes it, once the daemon knows what its agents need to join it.
    /// Called once per start, before the journal's nodes are adopted.
    pub make: MakeProvider,
}

/// How an [`EmbeddedProvider`] is made.
pub type MakeProvider = Box<dyn FnOnce(&Joining) -> Result<Arc<dyn Provider>> + Send>;

impl std::fmt::Debug for EmbeddedProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedProvider")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// What a provider needs to start agents that join this daemon: what the
/// built-in providers are given too.
#[derive(Clone, Debug)]
pub struct Joining {
    /// The ticket an agent dials (`swactor agent --ticket …`).
    pub ticket: String,
    /// The secret each attempt's join credentials derive from
    /// (`swactor_providers::credentials::AgentCredentials::derive`).
    pub token_secret: [u8; 32],
    /// The deployment every resource of this journal carries, if any.
    pub deployment: Option<String>,
    /// The daemon's state directory; a provider keeps its records under it.
    pub state_dir: PathBuf,
}

/// Runs the daemon until it is told to stop. Returns the process exit code.
///
/// # Errors
/// Bad input (shape, state directory) or a failure to start.
pub async fn up(mut opts: UpOptions) -> Result<i32> {
    if let Some(ha) = opts.ha.take() {
        return ha::up(opts, ha).await;
    }
    run(&mut opts, None).await
}

/// One daemon from start to stop: alone on its journal (`term` is `None`),
/// or for one term of leadership of a run shared through etcd.
async fn run(opts: &mut UpOptions, term: Option<Term>) -> Result<i32> {
    let swarm = SwarmRuntime::new()?;
    let mut endpoints = Vec::new();
    let outcome = start_and_serve(opts, term, swarm.handle(), &mut endpoints).await;
    if outcome.is_err() {
        // A start refused once the endpoints are bound (a provider that
        // cannot start, a shape refused) closes them: dropped open, iroh
        // would log an ERROR of its own below the line that says what was
        // wrong.
        for endpoint in endpoints {
            let _ = tokio::time::timeout(ENDPOINT_CLOSE_MAX, endpoint.close()).await;
        }
    }
    outcome
}

/// How long a refused start waits for its endpoint to close.
const ENDPOINT_CLOSE_MAX: Duration = Duration::from_secs(3);

/// The runtime the agents' endpoint runs on: one thread of its own, apart
/// from the one the driver, the CLI's endpoint and the web surface share.
/// Every connection attempt on the swarm protocols (whose ticket every
/// agent's command line shows) is taken, refused or shaken hands with
/// there, so a flood of them costs the daemon at most that thread and never
/// queues the driver's or the CLI's work behind it.
struct SwarmRuntime(Option<tokio::runtime::Runtime>);

impl SwarmRuntime {
    fn new() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("swactor-swarm")
            .enable_all()
            .build()
            .context("cannot start the agents' runtime")?;
        Ok(Self(Some(runtime)))
    }

    fn handle(&self) -> tokio::runtime::Handle {
        self.0
            .as_ref()
            .map(|rt| rt.handle().clone())
            .expect("the runtime lives until dropped")
    }
}

impl Drop for SwarmRuntime {
    fn drop(&mut self) {
        // Dropped from async code: its tasks are cancelled without waiting
        // (the endpoint was closed before).
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// [`up`]; puts the daemon's endpoint in `bound` as soon as it is bound, for
/// `up` to close if this fails. The agents' endpoint runs on `swarm`.
///
/// In order: everything the user could have got wrong is checked
/// ([`Preflight`]); the state directory is locked and its journal read; the
/// endpoints are bound; the providers are made; the cluster, the jobs and
/// the protocols start; then the daemon serves until it is told to stop
/// ([`serve_until_stopped`]).
async fn start_and_serve(
    opts: &mut UpOptions,
    term: Option<Term>,
    swarm: tokio::runtime::Handle,
    bound: &mut Vec<swactor_engine::iroh::Endpoint>,
) -> Result<i32> {
    let started = std::time::Instant::now();
    let embedded = std::mem::take(&mut opts.providers);
    let more_providers: Vec<&'static str> = embedded.iter().map(|p| p.kind).collect();
    let opts = &*opts;
    // The lock is released last, once everything else has stopped.
    let (_lock, mut opened, read) = open(opts, &more_providers, term.as_ref()).await?;
    let run_id = opened.start.run_id.clone();
    let (prepared, publisher) = prepare(
        opts,
        &swarm,
        bound,
        &mut opened,
        (read.resume.as_ref(), term.as_ref()),
        embedded,
    )
    .await?;
    let provider = prepared.made.provider.clone();
    // In a term, every provider call the cluster makes passes the
    // leadership gate, and the host stops at the same bound.
    let cluster_provider: Arc<dyn Provider> = match &term {
        Some(t) => {
            let gated = swactor_providers::gate::LeaderGated::new(provider.clone(), t.lead.clone());
            let _ = t.gate.set(gated.counts());
            Arc::new(gated)
        }
        None => provider.clone(),
    };

    let (starvation, _measuring) = measure_starvation(&swarm);
    let _handshakes = AbortOnDrop(tokio::spawn(crate::handshakes::summarise()));
    let mut config = ClusterConfig::new(run_id.clone());
    config.starvation = Some(starvation.clone());
    config.adopt_unrecorded = opts.unrecorded == Some(Unrecorded::Adopt);
    config.deployment.clone_from(&opened.deployment);
    config.visibility_window = prepared.made.visibility_window;
    config.capacities = provider.capacities();
    config.lead = term.as_ref().map(|t| t.lead.clone());
    config.build = format!("swactor {}", env!("CARGO_PKG_VERSION"));
    config.flight = open_flight(opened.state.root(), opts.flight_max_bytes);
    let flight = config.flight.clone();
    if let Some(recorder) = &flight {
        prepared.metrics.watch_flight(recorder.clone());
    }
    // The cluster actor is restarted from the journal if it fails; the
    // journal image it resumes from is the one just read.
    drop(read.resume);
    let (cluster, exit_rx) =
        start_cluster(config, cluster_provider, publisher, read.journal).await?;
    if let Some(t) = &term {
        let _ = t.cluster.set(cluster.clone());
        cluster.leadership_changed();
    }

    // Jobs, resumed from jobs.redb: a job actor for every job with runs
    // under way follows them again.
    let jobs = crate::jobs::service::JobService::open(
        opened.state.root(),
        cluster.clone(),
        prepared.secret,
        crate::jobs::service::JobLimits::from_env()?,
    )
    .await?;
    let (down_tx, down_rx) = mpsc::channel::<DownRequest>(4);
    // What the run's rentals cost, against its budget: acted on here.
    let _budget = prepared.made.vast.clone().map(|v| {
        AbortOnDrop(tokio::spawn(watch_budget(
            cluster.clone(),
            v,
            run_id.clone(),
            down_tx.clone(),
        )))
    });
    let (started_tx, started_rx) = tokio::sync::watch::channel(false);
    // How long the run may live, on every provider: acted on here.
    let _lifetime = AbortOnDrop(tokio::spawn(watch_lifetime(
        cluster.clone(),
        jobs.clone(),
        started_rx.clone(),
        down_tx.clone(),
    )));
    let renewals = crate::renewals::Renewals::default();
    let control = ControlHandler {
        cluster: cluster.clone(),
        run_id: run_id.clone(),
        down: down_tx,
        started: started_rx,
        provider: provider.clone(),
        vast: prepared.made.vast.clone(),
        jobs: jobs.clone(),
        journal: opened.journal_health.clone(),
        metrics: prepared.metrics.clone(),
        more_providers,
        renewals: renewals.clone(),
        ha: term.as_ref().map(|t| t.view.clone()).unwrap_or_default(),
    };
    // Every agent's silence is judged by one sweep, which ends with the
    // last handle on the sessions.
    let sessions = crate::swarm::Sessions::new(starvation);
    let _sweep = AbortOnDrop(tokio::spawn(sessions.clone().sweep(cluster.clone())));
    let swarm_handler = SwarmHandler {
        cluster: cluster.clone(),
        secret: prepared.secret,
        refusals: RefusalLog::default(),
        sessions,
        pre_auth: swactor_engine::net::PreAuth::new(pre_auth_max()),
        renewals,
        replicas: term
            .as_ref()
            .map_or_else(crate::replicas::Replicas::none, |t| t.replicas.clone()),
    };
    let core = Core {
        cluster,
        exit: exit_rx,
        down: down_rx,
        jobs,
        control,
        swarm_handler,
        started_tx,
    };
    let jobs = core.jobs.clone();
    let in_term = term.is_some();
    let outcome = listen_and_serve(opts, &swarm, started, (opened, term), prepared, core).await;
    if in_term {
        // The next term opens `jobs.redb` again.
        jobs.stop().await;
    }
    // The recording ends with the life's last input on disk.
    if let Some(recorder) = flight {
        recorder.flushed().await;
    }
    outcome
}

/// What a start checked, read and decided before anything was bound.
struct Opened {
    listen: IpAddr,
    advertise: Option<IpAddr>,
    pre: Preflight,
    state: StateDir,
    /// SIGHUP, caught from before the lock names this daemon's pid.
    hangups: tokio::signal::unix::Signal,
    journal_health: crate::journal::JournalHealth,
    start: Start,
    deployment: Option<String>,
}

/// The journal as [`open`] read it.
struct ReadJournal {
    journal: Arc<dyn swactor_actors::JournalStore>,
    /// The image the cluster resumes from, if there was a journal.
    resume: Option<JournalImage>,
}

/// Checks everything the user could have got wrong, locks the state
/// directory, reads its journal and decides how to start; returns the lock,
/// to be held until the daemon has stopped.
async fn open(
    opts: &UpOptions,
    more_providers: &[&'static str],
    term: Option<&Term>,
) -> Result<(Option<crate::state::DaemonLock>, Opened, ReadJournal)> {
    let (listen, advertise) = network(opts)?;
    let pre = Preflight::check(opts, more_providers, term.map(|t| t.resume.is_none())).await?;
    let state = StateDir::create(opts.state_dir.clone())?;
    // The CLI may send SIGHUP to the pid in the lock as soon as it is there
    // (a CLI that finds no ticket yet asks for it): catch it from before
    // then, or its default action would end the daemon.
    let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot catch SIGHUP")?;
    let (lock, journal, resume, journal_health): (_, Arc<dyn swactor_actors::JournalStore>, _, _) =
        match term {
            // One daemon per state directory, taken before anything else is touched.
            None => {
                let lock = state.lock()?;
                let (journal, resume) = DaemonJournal::open(&state.journal_path())?;
                let health = journal.health();
                (Some(lock), Arc::new(journal), resume, health)
            }
            // A term: the lock is held for the whole process, the journal was
            // read from etcd as the term began.
            Some(t) => (
                None,
                Arc::new(t.journal.clone()),
                t.resume.clone(),
                t.journal.health(),
            ),
        };
    // With standbys, the shape file is applied only to a run that has
    // none yet: a takeover resumes what the journal holds (`swactor apply`
    // changes it).
    let file = match term {
        Some(_) if resume.as_ref().is_some_and(|r| r.meta.shape.is_some()) => None,
        _ => pre.file.as_ref(),
    };
    let start = Start::decide(resume.as_ref(), file, state.root())?;
    // Which deployment this journal is: every resource a provider makes
    // carries it, and one of the run that carries another is left alone.
    let deployment = state.deployment(resume.as_ref())?;
    if let Some(shape) = pre
        .checked
        .as_ref()
        .filter(|_| !pre.fresh && file.is_some())
    {
        confirm_start(resume.as_ref(), shape, opts.yes).await?;
    }
    let opened = Opened {
        listen,
        advertise,
        pre,
        state,
        hangups,
        journal_health,
        start,
        deployment,
    };
    Ok((lock, opened, ReadJournal { journal, resume }))
}

/// What [`prepare`] bound and made: the daemon's surfaces, not served yet,
/// and its providers.
struct Prepared {
    http_listener: tokio::net::TcpListener,
    http_token: String,
    endpoints: Endpoints,
    /// The CLI's key: the only one the CLI's protocols accept.
    cli_id: swactor_engine::iroh::EndpointId,
    /// The secret the agents' join tokens are derived with.
    secret: [u8; 32],
    metrics: Arc<crate::metrics::Metrics>,
    made: MadeProviders,
    telemetry: swactor_engine::telemetry::TelemetryHandler,
}

/// Binds the web surface and the endpoints, keeps what the next daemon
/// reads of them, and makes the providers and the telemetry publisher.
async fn prepare(
    opts: &UpOptions,
    swarm: &tokio::runtime::Handle,
    bound: &mut Vec<swactor_engine::iroh::Endpoint>,
    opened: &mut Opened,
    (resume, term): (Option<&JournalImage>, Option<&Term>),
    embedded: Vec<EmbeddedProvider>,
) -> Result<(Prepared, TelemetryPublisher<ClusterSnapshot, ClusterEvent>)> {
    let state = &opened.state;
    let run_id = &opened.start.run_id;
    // The web surface first: an --http address that cannot be bound is
    // refused before the endpoint starts, with nothing else to say.
    let http_listener = crate::http::bind(state, opts.http).await?;
    let http_token = crate::http::token(state)?;
    let network = (opened.listen, opened.advertise);
    let mut endpoints = Endpoints::bind(state, swarm, network, term, bound).await?;
    if let Some(t) = term {
        // Agents and CLIs are given every daemon of the run: whichever
        // leads answers.
        let agent_ticket = t.agent_ticket(endpoints.swarm.id());
        t.ticket.set(agent_ticket.to_string());
        endpoints.agent_ticket = agent_ticket;
        endpoints.cli_ticket = t.cli_ticket(endpoints.control.id());
    }
    state.save_network(opened.listen, opened.advertise)?;
    if let Some(path) = &opened.pre.keep_agent_binary {
        state.save_agent_binary(path)?;
    }
    let cli_id = state.cli_key()?.public();
    let secret = token_secret(state, resume)?;
    let metrics = crate::metrics::Metrics::new();
    let vast_key = opened.pre.vast_key.take();
    // In a term, the ticket follows the run's daemons as they register.
    let agent_ticket = term.map_or_else(
        || swactor_providers::DaemonTicket::new(endpoints.agent_ticket.to_string()),
        |t| t.ticket.clone(),
    );
    let agents = Agents {
        binary: &opened.pre.agent_binary,
        ticket: &agent_ticket,
        secret,
        deployment: opened.deployment.as_deref(),
    };
    let made = make_providers(
        state,
        &agents,
        resume,
        (opened.pre.file.as_ref(), vast_key),
        (&metrics, embedded),
    )
    .await?;
    // A new journal for a run whose resources the provider still lists:
    // refused unless told what to do with them.
    if opened.pre.fresh && opts.unrecorded.is_none() {
        let traces = std::mem::take(&mut opened.pre.traces);
        check_unrecorded(&made.provider, run_id, traces).await?;
    }
    let publisher = telemetry_publisher(state, &opened.pre.ndjson, run_id).await?;
    let telemetry = publisher.handler();
    let prepared = Prepared {
        http_listener,
        http_token,
        endpoints,
        cli_id,
        secret,
        metrics,
        made,
        telemetry,
    };
    Ok((prepared, publisher))
}

/// Starts the daemon's measures of its own starvation; they stop when the
/// returned guards are dropped.
fn measure_starvation(
    swarm: &tokio::runtime::Handle,
) -> (swactor_engine::Starvation, [AbortOnDrop; 2]) {
    // The daemon measures how long its own event loop leaves work waiting:
    // silence it could not hear is held against no agent (the swarm
    // endpoint and the host both discount it).
    let starvation = swactor_engine::Starvation::new();
    let measuring = AbortOnDrop(starvation.measure());
    // The agents' runtime too: heartbeats are read there, and a flood (or
    // the machine's other work) that keeps its one thread busy leaves them
    // unread however loud the agents are.
    let measuring_swarm = {
        let _on_swarm = swarm.enter();
        AbortOnDrop(starvation.measure())
    };
    (starvation, [measuring_swarm, measuring])
}

/// The started cluster and jobs, and the handlers of the protocols served
/// on them.
struct Core {
    cluster: ClusterHandle,
    /// Told when the cluster actor's supervisor gives up.
    exit: oneshot::Receiver<SupervisorExit>,
    /// `down` requests from the CLI (and from the budget and lifetime watches).
    down: mpsc::Receiver<DownRequest>,
    jobs: crate::jobs::service::JobService,
    control: ControlHandler,
    swarm_handler: SwarmHandler,
    /// Told once the start's shape has been offered.
    started_tx: tokio::sync::watch::Sender<bool>,
}

/// Serves the protocols and the web surface, says where the daemon is,
/// offers the start's shape, then serves until the daemon is told to stop.
async fn listen_and_serve(
    opts: &UpOptions,
    swarm: &tokio::runtime::Handle,
    started: std::time::Instant,
    (opened, term): (Opened, Option<Term>),
    prepared: Prepared,
    core: Core,
) -> Result<i32> {
    let state = opened.state;
    let run_id = &opened.start.run_id;
    let endpoints = &prepared.endpoints;
    let http_token = &prepared.http_token;
    // One allowlist for the CLI's protocols, so a reloaded key applies to both.
    let cli_allowed = Allowlist::only([prepared.cli_id]);
    // In a term, the CLIs of every daemon of the run are let in.
    let admitting = term.as_ref().map(|t| t.admit_clis(cli_allowed.clone()));
    let router = serve_protocols(
        endpoints,
        swarm,
        core.swarm_handler,
        &core.jobs,
        prepared.made.fleet,
        (
            core.control.clone(),
            prepared.telemetry.clone(),
            cli_allowed.clone(),
        ),
        &prepared.metrics,
    );
    let http_addr = prepared.http_listener.local_addr()?;
    let web = crate::http::serve(
        prepared.http_listener,
        Arc::new(crate::http::Web {
            control: core.control,
            telemetry: prepared.telemetry,
            metrics: prepared.metrics,
            token: http_token.clone(),
            state_dir: state.root().to_path_buf(),
            addr: http_addr,
        }),
    );
    state.write_ticket(&endpoints.cli_ticket)?;
    let reloading = reload_on_hangup(
        opened.hangups,
        state.clone(),
        endpoints.cli_ticket.clone(),
        cli_allowed,
        prepared.cli_id,
    );
    eprintln!(
        "swactor: daemon for run {run_id} on {} (state {})",
        endpoints.swarm.addr().id.fmt_short(),
        state.root().display()
    );
    eprintln!("swactor: dashboard at http://{http_addr}/?token={http_token}");
    eprintln!("swactor: {}", opened.start.note);
    let cluster = core.cluster;
    let sizing = AbortOnDrop(tokio::spawn(follow_cluster_size(
        cluster.clone(),
        router.agent_caps.clone(),
        prepared.made.fleet,
    )));
    let finish_teardown = match &opened.start.what {
        StartWhat::Apply(file) => {
            if let Err(e) = offer_on_start(&cluster, run_id, &opened.journal_health, file).await {
                // The shape was refused (e.g. over capacity): stop as if this
                // `up` had never run, leaving what an earlier daemon left.
                let _ = cluster.shutdown(ShutdownMode::Keep).await;
                state.remove_ticket();
                router.shutdown().await;
                return Err(e);
            }
            false
        }
        StartWhat::Resume => false,
        StartWhat::FinishTeardown => true,
    };
    // CLI applies and plans held back while the start shape was offered go now.
    core.started_tx.send_replace(true);
    let running = Running {
        cluster,
        state,
        router,
        ssh: prepared.made.ssh,
        exit: core.exit,
        down: core.down,
        started,
        lost: term.as_ref().map(|t| t.lost.clone()),
        _admitting: admitting,
        _web: (web, reloading),
        _sizing: sizing,
    };
    serve_until_stopped(running, opts, finish_teardown).await
}

/// Starts the cluster under its supervisor, which restarts it from the
/// journal if it fails; the receiver is told when the supervisor gives up.
async fn start_cluster(
    config: ClusterConfig,
    provider: Arc<dyn Provider>,
    publisher: TelemetryPublisher<ClusterSnapshot, ClusterEvent>,
    journal: Arc<dyn swactor_actors::JournalStore>,
) -> Result<(ClusterHandle, oneshot::Receiver<SupervisorExit>)> {
    let (exit_tx, exit_rx) = oneshot::channel();
    let args = SupervisorArgs {
        config,
        provider,
        publisher: Some(Arc::new(publisher)),
        journal,
        restarts: CLUSTER_RESTARTS,
        on_exit: Some(exit_tx),
    };
    let cluster = Cluster::supervised(args, None)
        .await
        .context("cannot start the cluster")?;
    #[cfg(debug_assertions)]
    inject_faults(&cluster);
    Ok((cluster, exit_rx))
}

/// What a started daemon holds while it serves.
struct Running {
    cluster: ClusterHandle,
    state: StateDir,
    router: Routers,
    ssh: SshHostsProvider,
    /// Told when the cluster actor's supervisor gives up.
    exit: oneshot::Receiver<SupervisorExit>,
    /// `down` requests from the CLI (and from the budget and lifetime watches).
    down: mpsc::Receiver<DownRequest>,
    started: std::time::Instant,
    /// In a term: becomes true once this daemon no longer leads.
    lost: Option<tokio::sync::watch::Receiver<bool>>,
    /// In a term: lets the CLIs of the run's other daemons in.
    _admitting: Option<AbortOnDrop>,
    /// The dashboard and `/metrics`, and the SIGHUP reloads, served until
    /// this is dropped.
    _web: (crate::http::WebServer, AbortOnDrop),
    /// Moves the agents' protocols' caps with the cluster's size.
    _sizing: AbortOnDrop,
}

/// Serves until converged (`--until-converged`), a signal or a `down`, then
/// stops the cluster as asked (teardown, or keep) and closes the endpoints.
/// Returns the process exit code.
async fn serve_until_stopped(
    mut running: Running,
    opts: &UpOptions,
    finish_teardown: bool,
) -> Result<i32> {
    let cluster = &running.cluster;
    let progress = Progress::start(cluster).await?;
    let mut code = 0;
    let mut keep = opts.keep;
    let mut down_reply = None;
    let mut purge = false;
    if finish_teardown {
        keep = false;
    } else if opts.until_converged {
        let converged =
            tokio::time::timeout(opts.timeout, wait_converged(cluster, &mut running.exit));
        // A signal or a `down` (from the CLI, a budget or a lifetime) is
        // heard while it waits, not only once it converged.
        let waited = tokio::select! {
            got = converged => Some(got),
            _ = shutdown_signal() => {
                progress.say("\nswactor: stopping before the cluster converged");
                code = 130;
                None
            }
            Some((k, p, reply)) = running.down.recv() => {
                keep = k;
                purge = p;
                down_reply = Some(reply);
                None
            }
        };
        match waited {
            None => {}
            Some(converged) => match converged {
                Ok(Ok(generation)) => {
                    progress.flush().await;
                    progress.say(format!(
                        "swactor: converged on generation {} in {:.1} s (daemon peak memory {})",
                        generation.0,
                        running.started.elapsed().as_secs_f64(),
                        peak_memory()
                    ));
                }
                Ok(Err(e)) => {
                    progress.say(format!("swactor: the cluster stopped: {e}"));
                    code = 1;
                }
                Err(_) => {
                    progress.flush().await;
                    progress.say(format!(
                        "swactor: not converged within {:?}; still waiting on:",
                        opts.timeout
                    ));
                    if let Ok(snap) = cluster.snapshot().await {
                        for n in snap.nodes.iter().filter(|n| !n.ready) {
                            let err = n.last_error.as_deref().unwrap_or("no error reported");
                            let state = crate::words::state_text(n, snap.now);
                            progress.say(format!("  {} ({}, {state}): {err}", n.node, n.attempt));
                        }
                    }
                    code = 1;
                }
            },
        }
    } else {
        let in_term = running.lost.is_some();
        tokio::select! {
            _ = shutdown_signal() => {
                progress.say("\nswactor: stopping");
                // With standbys, stopping one daemon is not stopping the
                // run: its nodes are kept for the one that leads next.
                keep |= in_term;
            }
            Some((k, p, reply)) = running.down.recv() => {
                keep = k;
                purge = p;
                down_reply = Some(reply);
            }
            exit = &mut running.exit => {
                progress.stop().await;
                let code = gave_up(exit.ok(), &running.state, running.router).await;
                return Ok(if in_term { GAVE_UP } else { code });
            }
            () = lead_lost(running.lost.as_mut()) => {
                progress.stop().await;
                let cluster = running.cluster;
                // The host acts on nothing past the bound: a keep stops it
                // with nothing to do; a cluster that does not answer is
                // stopped outright.
                if tokio::time::timeout(Duration::from_secs(3), cluster.shutdown(ShutdownMode::Keep))
                    .await
                    .is_err()
                {
                    cluster.actor().stop(Some("no longer leading".to_owned()));
                }
                running.router.shutdown().await;
                return Ok(LOST_LEAD);
            }
        }
    }
    let Running {
        cluster,
        state,
        router,
        ssh,
        ..
    } = running;
    let mode = if keep {
        ShutdownMode::Keep
    } else {
        ShutdownMode::Teardown
    };
    if mode == ShutdownMode::Teardown {
        progress.say("swactor: tearing down");
    }
    let report = cluster.shutdown(mode).await.context("shutdown failed")?;
    progress.stop().await;
    print_report(&report);
    let mut purged = Vec::new();
    if purge && mode == ShutdownMode::Teardown {
        for (host, done) in ssh.purge().await {
            match &done {
                Ok(()) => eprintln!("swactor: purged {host}"),
                Err(e) => eprintln!("swactor: could not purge {host}: {e}"),
            }
            purged.push((host, done.err()));
        }
    }
    if let Some(reply) = down_reply {
        let _ = reply.send((report, purged));
        // Let the control handler deliver the answer before the endpoint closes.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    state.remove_ticket();
    router.shutdown().await;
    Ok(code)
}

/// Resolves once `lost` says the term's leadership is lost; never
/// without a term.
async fn lead_lost(lost: Option<&mut tokio::sync::watch::Receiver<bool>>) {
    match lost {
        Some(lost) => {
            let _ = lost.wait_for(|lost| *lost).await;
        }
        None => std::future::pending().await,
    }
}

/// How often the cluster actor may fail, and be restarted from its journal,
/// before the daemon gives up (and leaves every node running).
const CLUSTER_RESTARTS: RestartPolicy = RestartPolicy {
    restarts_max: 3,
    window: Duration::from_secs(60),
};

/// Waits for convergence across restarts of the cluster actor (a waiter
/// that was with a failed actor is asked again of its successor).
async fn wait_converged(
    cluster: &ClusterHandle,
    exit: &mut oneshot::Receiver<SupervisorExit>,
) -> Result<Generation, String> {
    loop {
        tokio::select! {
            got = cluster.converged() => match got {
                Ok(generation) => return Ok(generation),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
            exit = &mut *exit => {
                return Err(match exit {
                    Ok(SupervisorExit::GaveUp { reason }) => reason,
                    _ => "the cluster stopped".to_owned(),
                });
            }
        }
    }
}

/// The cluster actor failed past its restart budget: the daemon stops and
/// leaves every node running, so the next `swactor up` adopts them.
async fn gave_up(exit: Option<SupervisorExit>, state: &StateDir, router: Routers) -> i32 {
    let reason = match exit {
        Some(SupervisorExit::GaveUp { reason }) => reason,
        Some(SupervisorExit::Stopped) | None => "the cluster stopped unexpectedly".to_owned(),
    };
    eprintln!(
        "swactor: the cluster actor kept failing ({reason}); the daemon stops and leaves \
         every node running. `swactor up` adopts them again; `swactor status` will not \
         answer until then"
    );
    state.remove_ticket();
    router.shutdown().await;
    3
}

/// Debug builds only: `SWACTOR_FAULT_DRIVER_PANICS=N@MS` makes the cluster
/// actor panic N times, MS milliseconds apart, for tests of its supervision.
#[cfg(debug_assertions)]
fn inject_faults(cluster: &ClusterHandle) {
    let Some((count, every_ms)) = std::env::var("SWACTOR_FAULT_DRIVER_PANICS")
        .ok()
        .and_then(|v| {
            let (n, ms) = v.split_once('@')?;
            Some((n.parse::<u32>().ok()?, ms.parse::<u64>().ok()?))
        })
    else {
        return;
    };
    let actor = cluster.actor().clone();
    tokio::spawn(async move {
        for _ in 0..count {
            tokio::time::sleep(Duration::from_millis(every_ms)).await;
            tracing::warn!("injecting a panic into the cluster actor");
            let _ = actor.send_message(swactor_actors::DriverMsg::InjectPanic);
        }
    });
}

/// The daemon's peak resident memory, from `/proc/self/status`.
fn peak_memory() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l[6..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn print_report(report: &ShutdownReport) {
    use crate::words::names;
    if !report.destroyed.is_empty() {
        eprintln!(
            "swactor: destroyed {} node(s): {}",
            report.destroyed.len(),
            names(&report.destroyed)
        );
    }
    if !report.kept.is_empty() {
        eprintln!(
            "swactor: kept {} node(s) running for the next `swactor up`: {}",
            report.kept.len(),
            names(&report.kept)
        );
    }
    if !report.without_machine.is_empty() {
        eprintln!(
            "swactor: {}",
            crate::words::without_machine(&report.without_machine)
        );
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Aborts a task when dropped (the daemon's own helpers end with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::{HandshakeRate, agents_cap, agents_rate};

    #[test]
    fn the_agents_handshake_budget_follows_the_fleet() {
        assert_eq!(agents_rate(0), HandshakeRate::DEFAULT);
        assert_eq!(agents_rate(4), HandshakeRate::DEFAULT);
        // 1,000 nodes: their 2,000 links in one burst, stragglers at 200/s.
        assert_eq!(
            agents_rate(1_000),
            HandshakeRate {
                per_second: 200,
                burst: 2_020
            }
        );
        assert!(agents_rate(usize::MAX).is_valid());
    }

    #[test]
    fn the_agents_connection_caps_follow_the_cluster_with_headroom() {
        let open = swactor_engine::net::Limits::OPEN.connections_max;
        assert_eq!(agents_cap(0), open);
        assert_eq!(agents_cap(3_000), open, "small clusters keep the default");
        // 10,000 nodes: every agent joined, plus a quarter for overlaps.
        assert_eq!(agents_cap(10_000), 12_564);
        assert_eq!(agents_cap(usize::MAX), usize::MAX);
    }
}
