//! `swactor up`: the daemon, in the foreground.

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
use swactor_engine::RestartPolicy;
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, ALPN_TELEMETRY, Allowlist, EndpointTicket, GuardedRouterBuilder,
    HandshakeRate, Limits, NetConfig, bind_endpoint,
};
use swactor_engine::telemetry::{NdjsonConfig, NdjsonSink, TelemetryConfig, TelemetryPublisher};
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
}

/// Runs the daemon until it is told to stop. Returns the process exit code.
///
/// # Errors
/// Bad input (shape, state directory) or a failure to start.
pub async fn up(opts: UpOptions) -> Result<i32> {
    let swarm = SwarmRuntime::new()?;
    let mut endpoints = Vec::new();
    let outcome = run(opts, swarm.handle(), &mut endpoints).await;
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
async fn run(
    opts: UpOptions,
    swarm: tokio::runtime::Handle,
    bound: &mut Vec<swactor_engine::iroh::Endpoint>,
) -> Result<i32> {
    let started = std::time::Instant::now();
    // Everything the user could have got wrong is checked before anything starts.
    // Addresses given now win; without any, those of the last daemon of
    // this state directory, so agents on other machines can still reach it.
    let (listen, advertise) = match (opts.listen, opts.advertise) {
        (None, None) => match StateDir::saved_network(&opts.state_dir) {
            Some((listen, advertise)) => {
                if !listen.is_loopback() || advertise.is_some() {
                    eprintln!(
                        "swactor: listening on {listen}{}, as the last daemon of this state \
                         directory did (--listen and --advertise change it)",
                        advertise
                            .map(|ip| format!(" for agents dialing {ip}"))
                            .unwrap_or_default()
                    );
                }
                (listen, advertise)
            }
            None => {
                let saved = opts.state_dir.join(crate::state::NETWORK_FILE);
                if saved.exists() {
                    eprintln!(
                        "swactor: warning: cannot read the saved addresses in {}; listening \
                         on 127.0.0.1 (--listen and --advertise name others)",
                        saved.display()
                    );
                }
                (IpAddr::V4(Ipv4Addr::LOCALHOST), None)
            }
        },
        (listen, advertise) => (listen.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)), advertise),
    };
    if listen.is_unspecified() && advertise.is_none() {
        anyhow::bail!(
            "listening on {listen} (every interface), the daemon cannot tell remote agents \
             which address to dial: name it with --advertise IP; nothing was started"
        );
    }
    let ndjson = ndjson_config()?;
    let file = opts.shape.as_deref().map(ShapeFile::load).transpose()?;
    let checked = file.as_ref().map(|f| f.check(1)).transpose()?;
    // A fresh state directory: the whole shape is new, and whether to go
    // ahead is settled before the directory is even made.
    let fresh = !opts.state_dir.join("journal.redb").exists();
    if fresh {
        // The core's start decision without a journal, asked before
        // anything is made: a mistyped --state-dir is left as it was (or
        // absent). With a journal, it is asked once the journal is read.
        let shape_run = file.as_ref().map(ShapeFile::run_id);
        if let Err(refusal) = swactor_provisioning::decide_start(None, shape_run.as_ref()) {
            return Err(start_refused(&refusal, &opts.state_dir));
        }
    }
    if !fresh && let Some(choice) = opts.unrecorded {
        anyhow::bail!(
            "{} has a journal: --{} is only for a state directory whose journal was lost; \
             nothing was started",
            opts.state_dir.display(),
            match choice {
                Unrecorded::Adopt => "adopt",
                Unrecorded::Fresh => "fresh",
            }
        );
    }
    // Traces of an earlier run in a directory with no journal: its journal
    // was lost. Refused here already when the files say so; the provider's
    // listing is looked at below, once the providers are made.
    let mut traces = swactor_provisioning::Traces {
        files: if fresh {
            run_traces(&opts.state_dir)
        } else {
            Vec::new()
        },
        listed: Vec::new(),
    };
    if fresh {
        swactor_provisioning::without_journal(traces.clone(), opts.unrecorded)?;
    }
    let (agent_binary, keep_agent_binary) =
        choose_agent_binary(&opts.state_dir, opts.agent_binary.as_deref())?;
    // A shape that rents Vast.ai machines needs the key before anything else.
    let vast_key = vast_key(file.as_ref())?;
    if let Some(shape) = checked.as_ref().filter(|_| fresh) {
        confirm_start(None, shape, opts.yes).await?;
    }
    let state = StateDir::create(opts.state_dir.clone())?;
    // The CLI may send SIGHUP to the pid in the lock as soon as it is there
    // (a CLI that finds no ticket yet asks for it): catch it from before
    // then, or its default action would end the daemon.
    let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot catch SIGHUP")?;
    // One daemon per state directory, taken before anything else is touched.
    let _lock = state.lock()?;
    let (journal, resume) = DaemonJournal::open(&state.journal_path())?;
    let journal_health = journal.health();
    let start = Start::decide(resume.as_ref(), file.as_ref(), state.root())?;
    // Which deployment this journal is: every resource a provider makes
    // carries it, and one of the run that carries another is left alone.
    let deployment = state.deployment(resume.as_ref())?;
    if let Some(shape) = checked.as_ref().filter(|_| !fresh) {
        confirm_start(resume.as_ref(), shape, opts.yes).await?;
    }
    let run_id = start.run_id.clone();

    // The web surface first: an --http address that cannot be bound is
    // refused before the endpoint starts, with nothing else to say.
    let http_listener = crate::http::bind(&state, opts.http).await?;
    let http_token = crate::http::token(&state)?;
    // Bound on the agents' runtime: the endpoint's own tasks (its socket,
    // its handshakes) run there.
    let endpoint = {
        let state = state.clone();
        swarm
            .spawn(async move { bind_daemon_endpoint(&state, listen).await })
            .await
            .context("the agents' runtime stopped")??
    };
    bound.push(endpoint.clone());
    // The CLI's own endpoint, on a socket of its own: a flood of handshakes
    // on the agents' endpoint (whose ticket every agent's command line
    // shows) never queues the CLI's handshake behind it.
    let control_endpoint = bind_control_endpoint(&state, listen).await?;
    bound.push(control_endpoint.clone());
    let metrics = crate::metrics::Metrics::new();
    let ticket = EndpointTicket::new(control_endpoint.addr());
    let swarm_ticket = EndpointTicket::new(endpoint.addr());
    // What agents are given: the advertised address, on the bound port.
    state.save_network(listen, advertise)?;
    if let Some(path) = &keep_agent_binary {
        state.save_agent_binary(path)?;
    }
    let agent_ticket = match (advertise, endpoint.bound_sockets().first()) {
        (Some(ip), Some(bound)) => EndpointTicket::new(
            swactor_engine::iroh::EndpointAddr::new(endpoint.id())
                .with_ip_addr(SocketAddr::new(ip, bound.port())),
        ),
        _ => swarm_ticket,
    };
    let cli_id = state.cli_key()?.public();
    let secret_existed = state.root().join("token.secret").exists();
    let secret = state.token_secret()?;
    if !secret_existed && resume.as_ref().is_some_and(|j| !j.slots.is_empty()) {
        eprintln!(
            "swactor: warning: {} was missing; a new secret was made. The agents of the \
             nodes on record hold credentials from the old one and cannot rejoin: their \
             nodes will be replaced once their rejoin window ends",
            state.root().join("token.secret").display()
        );
    }

    let process = ProcessProvider::new(ProcessConfig {
        agent_program: std::env::current_exe().context("cannot find the swactor executable")?,
        agent_args: vec!["agent".to_owned()],
        daemon_ticket: agent_ticket.to_string(),
        token_secret: secret,
        ..ProcessConfig::new(state.root().to_path_buf())
    })
    .context("cannot start the process provider")?;
    let agents = Agents {
        binary: &agent_binary,
        ticket: &agent_ticket,
        secret,
        deployment: deployment.as_deref(),
    };
    let ssh = ssh_provider(&state, &agents, resume.as_ref(), file.as_ref())?;
    let docker = docker_provider(&agents, resume.as_ref(), file.as_ref())?;
    // The most nodes the run holds now or may ask for at start: every one
    // of their agents may have to reconnect at once after this start.
    let fleet = fleet_size(resume.as_ref(), file.as_ref())?;
    // Every provider call is timed and its failures counted for /metrics.
    let metered = |p: Arc<dyn Provider>| crate::http::Metered::wrap(p, metrics.clone());
    let mut providers: Vec<Arc<dyn Provider>> = vec![
        metered(Arc::new(process)),
        metered(Arc::new(ssh.clone())),
        metered(Arc::new(docker)),
    ];
    let vast = vast_provider(vast_key, &state, &agents, resume.as_ref(), file.as_ref()).await?;
    // A restarted daemon waits out the listing lag of the providers its
    // shapes use: a Vast.ai key in the environment must not slow down the
    // restart of a shape that rents nothing.
    let mut visibility_window = Providers::new(providers.clone()).listing_lag();
    if let Some((vast, used)) = &vast {
        providers.push(metered(Arc::new(vast.clone())));
        if *used {
            visibility_window = visibility_window.max(vast.listing_lag());
        }
    }
    let vast = vast.map(|(v, _)| v);
    let provider = Arc::new(Providers::new(providers));
    // A new journal for a run whose resources the provider still lists:
    // refused unless told what to do with them.
    if fresh && opts.unrecorded.is_none() {
        match provider.list(&run_id).await {
            Ok(listed) => {
                traces.listed = listed.into_keys().collect();
                swactor_provisioning::without_journal(traces, None)?;
                // Another deployment's resources of the same run: another
                // daemon's, or those of a state directory that was lost.
                // Left alone, and said.
                let foreign = provider.foreign();
                if !foreign.is_empty() {
                    eprintln!(
                        "swactor: warning: {}",
                        crate::words::foreign_resources(&run_id, &foreign)
                    );
                }
            }
            // A provider that does not answer now (an engine that is down)
            // is the nodes' problem, said per node once they are made; a
            // new run still starts. The state directory held no trace of
            // an earlier run, or the start was refused above.
            Err(e) => eprintln!(
                "swactor: warning: could not check what the provider holds for run {run_id} \
                 ({}); starting it as a new run",
                crate::words::cut_long_words(&e.to_string())
            ),
        }
    }

    let empty = ClusterSnapshot::empty(run_id.to_string());
    let sink = NdjsonSink::open(state.root(), &ndjson)
        .await
        .context("cannot open telemetry.ndjson")?;
    // A snapshot of 100,000 nodes is several MiB; the engine's default
    // frame (1 MiB) would leave `watch` with a stale one.
    let telemetry_config = TelemetryConfig {
        frame_len_max: FRAME_LEN_MAX,
        ..TelemetryConfig::default()
    };
    let publisher: TelemetryPublisher<ClusterSnapshot, ClusterEvent> =
        TelemetryPublisher::new(telemetry_config, &empty)
            .context("cannot start telemetry")?
            .with_ndjson(sink);
    let telemetry = publisher.handler();

    // The daemon measures how long its own event loop leaves work waiting:
    // silence it could not hear is held against no agent (the swarm
    // endpoint and the host both discount it).
    let starvation = swactor_engine::Starvation::new();
    let _measuring = AbortOnDrop(starvation.measure());
    // The agents' runtime too: heartbeats are read there, and a flood (or
    // the machine's other work) that keeps its one thread busy leaves them
    // unread however loud the agents are.
    let _measuring_swarm = {
        let _on_swarm = swarm.enter();
        AbortOnDrop(starvation.measure())
    };
    let _handshakes = AbortOnDrop(tokio::spawn(crate::handshakes::summarise()));
    let mut config = ClusterConfig::new(run_id.clone());
    config.starvation = Some(starvation.clone());
    config.adopt_unrecorded = opts.unrecorded == Some(Unrecorded::Adopt);
    config.deployment.clone_from(&deployment);
    config.visibility_window = visibility_window;
    config.capacities = provider.capacities();
    // The cluster actor is restarted from the journal if it fails; the
    // journal image it resumes from is the one just read.
    drop(resume);
    let (exit_tx, mut exit_rx) = oneshot::channel();
    let args = SupervisorArgs {
        config,
        provider: provider.clone(),
        publisher: Some(Arc::new(publisher)),
        journal: Arc::new(journal),
        restarts: CLUSTER_RESTARTS,
        on_exit: Some(exit_tx),
    };
    let cluster = Cluster::supervised(args, None)
        .await
        .context("cannot start the cluster")?;
    #[cfg(debug_assertions)]
    inject_faults(&cluster);

    // Jobs, resumed from jobs.redb: a job actor for every job with runs
    // under way follows them again.
    let jobs = crate::jobs::service::JobService::open(
        state.root(),
        cluster.clone(),
        secret,
        crate::jobs::service::JobLimits::from_env()?,
    )
    .await?;
    let (blobs_allowed, blobs) = jobs.blobs();
    let (down_tx, mut down_rx) = mpsc::channel::<DownRequest>(4);
    // What the run's rentals cost, against its budget: acted on here.
    let _budget = vast.clone().map(|v| {
        AbortOnDrop(tokio::spawn(watch_budget(
            cluster.clone(),
            v,
            run_id.clone(),
            down_tx.clone(),
        )))
    });
    let (started_tx, started_rx) = tokio::sync::watch::channel(false);
    // One allowlist for the CLI's protocols, so a reloaded key applies to both.
    let cli_allowed = Allowlist::only([cli_id]);
    let control = ControlHandler {
        cluster: cluster.clone(),
        run_id: run_id.clone(),
        down: down_tx,
        started: started_rx,
        provider: provider.clone(),
        vast,
        jobs: jobs.clone(),
        journal: journal_health.clone(),
        metrics: metrics.clone(),
    };
    // Connections that have not joined yet (swarm and jobs together).
    let pre_auth = swactor_engine::net::PreAuth::new(pre_auth_max());
    // The router's accept loop and every handler it starts run on the
    // agents' runtime too.
    let on_swarm = swarm.enter();
    let swarm_router = GuardedRouterBuilder::new(endpoint.clone())
        .serve(
            ALPN_SWARM,
            Allowlist::open(),
            SwarmHandler {
                cluster: cluster.clone(),
                secret,
                refusals: RefusalLog::default(),
                starvation,
                sessions: crate::swarm::Sessions::default(),
                pre_auth: pre_auth.clone(),
            },
        )
        // Agents dial in for jobs as for the swarm; each link is checked
        // like a join.
        .serve(
            crate::jobs::ALPN_JOBS,
            Allowlist::open(),
            jobs.handler(pre_auth),
        )
        // Workspaces: only the keys of agents with a jobs link may connect,
        // and each fetches only the chunks of the run it ships.
        .serve_with_limits(iroh_blobs::ALPN, blobs_allowed, Limits::LINKED, blobs)
        // New handshakes are rationed, so a flood costs the daemon a
        // bounded share of its time; joined agents' links are never counted.
        .handshake_rate(None, handshake_rate(agents_rate(fleet)));
    let swarm_handshakes = swarm_router.handshakes_under_way();
    let router = swarm_router.spawn();
    drop(on_swarm);
    // The CLI's protocols, on the CLI's endpoint, rationed on their own.
    let control_router = GuardedRouterBuilder::new(control_endpoint.clone())
        .serve(ALPN_CONTROL, cli_allowed.clone(), control.clone())
        .serve(ALPN_TELEMETRY, cli_allowed.clone(), telemetry.clone())
        .handshake_rate(None, handshake_rate(HandshakeRate::DEFAULT));
    metrics.watch_handshakes(vec![
        ("swarm", swarm_handshakes),
        ("control", control_router.handshakes_under_way()),
    ]);
    let control_router = control_router.spawn();
    let router = Routers {
        swarm: router,
        control: control_router,
    };
    let http_addr = http_listener.local_addr()?;
    crate::http::serve(
        http_listener,
        Arc::new(crate::http::Web {
            control,
            telemetry,
            metrics,
            token: http_token.clone(),
            state_dir: state.root().to_path_buf(),
            addr: http_addr,
        }),
    );
    state.write_ticket(&ticket)?;
    reload_on_hangup(hangups, state.clone(), ticket.clone(), cli_allowed, cli_id);
    eprintln!(
        "swactor: daemon for run {run_id} on {} (state {})",
        endpoint.addr().id.fmt_short(),
        state.root().display()
    );

    eprintln!("swactor: dashboard at http://{http_addr}/?token={http_token}");
    eprintln!("swactor: {}", start.note);
    let mut finish_teardown = false;
    match &start.what {
        StartWhat::Apply(file) => {
            if let Err(e) = offer_on_start(&cluster, &run_id, &journal_health, file).await {
                // The shape was refused (e.g. over capacity): stop as if this
                // `up` had never run, leaving what an earlier daemon left.
                let _ = cluster.shutdown(ShutdownMode::Keep).await;
                state.remove_ticket();
                router.shutdown().await;
                return Err(e);
            }
        }
        StartWhat::Resume => {}
        StartWhat::FinishTeardown => finish_teardown = true,
    }
    // CLI applies and plans held back while the start shape was offered go now.
    started_tx.send_replace(true);

    let progress = Progress::start(&cluster).await?;
    let mut code = 0;
    let mut keep = opts.keep;
    let mut down_reply = None;
    let mut purge = false;
    if finish_teardown {
        keep = false;
    } else if opts.until_converged {
        let converged = tokio::time::timeout(opts.timeout, wait_converged(&cluster, &mut exit_rx));
        match converged.await {
            Ok(Ok(generation)) => {
                progress.flush().await;
                progress.say(format!(
                    "swactor: converged on generation {} in {:.1} s (daemon peak memory {})",
                    generation.0,
                    started.elapsed().as_secs_f64(),
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
        }
    } else {
        tokio::select! {
            _ = shutdown_signal() => progress.say("\nswactor: stopping"),
            Some((k, p, reply)) = down_rx.recv() => {
                keep = k;
                purge = p;
                down_reply = Some(reply);
            }
            exit = &mut exit_rx => {
                progress.stop().await;
                return Ok(gave_up(exit.ok(), &state, router).await);
            }
        }
    }
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

/// On SIGHUP (sent by the CLI of the daemon's own user when it lost the
/// ticket or its key), writes the ticket again and lets the CLI key now in the
/// state directory in, in place of the old one.
/// A SIGHUP received while the daemon was starting is served once it runs.
fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    state: StateDir,
    ticket: EndpointTicket,
    allowed: Allowlist,
    mut cli: swactor_engine::iroh::EndpointId,
) {
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            if let Err(e) = state.write_ticket(&ticket) {
                tracing::warn!(%e, "cannot write the ticket again");
            }
            match state.cli_key() {
                Ok(key) if key.public() != cli => {
                    allowed.allow(key.public());
                    allowed.revoke(&cli);
                    cli = key.public();
                    eprintln!(
                        "swactor: reloaded the CLI key; the previous one is refused from now on"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(%e, "cannot read the CLI key"),
            }
        }
    });
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

/// What a start does with the journal and the shape it was given.
struct Start {
    run_id: RunId,
    what: StartWhat,
    /// One line saying so.
    note: String,
}

enum StartWhat {
    /// Offer the shape file (as the next generation, on a journal).
    Apply(ShapeFile),
    /// Resume the journal's shape.
    Resume,
    /// The last daemon was tearing down when it stopped: finish that.
    FinishTeardown,
}

impl Start {
    /// What `swactor up [SHAPE]` means for this state directory, as
    /// [`swactor_provisioning::decide_start`] decides it, in words.
    ///
    /// # Errors
    /// A shape of another run than the journal's, or nothing to resume.
    fn decide(
        journal: Option<&JournalImage>,
        file: Option<&ShapeFile>,
        dir: &Path,
    ) -> Result<Self> {
        let shape_run = file.map(ShapeFile::run_id);
        let decision = swactor_provisioning::decide_start(journal, shape_run.as_ref())
            .map_err(|refusal| start_refused(&refusal, dir))?;
        let run_id = decision.run_id().clone();
        let paused_note = |paused: bool| {
            if paused {
                "; it is paused: nothing new is dispatched until `swactor resume`"
            } else {
                ""
            }
        };
        // The core applies a shape only when it was given one.
        let apply = || {
            file.cloned()
                .map(StartWhat::Apply)
                .context("the start decision applies a shape, but none was given")
        };
        let (what, note) = match decision {
            StartDecision::New { run_id } => (
                apply()?,
                format!("starting run {run_id} from {}", dir.display()),
            ),
            StartDecision::Offer {
                run_id,
                generation,
                paused,
            } => (
                apply()?,
                format!(
                    "resuming run {run_id} at generation {} from its journal; \
                     the shape is offered as the next generation{}",
                    generation.0,
                    paused_note(paused)
                ),
            ),
            StartDecision::FinishTeardown { run_id } => (
                StartWhat::FinishTeardown,
                format!(
                    "the last daemon of run {run_id} was tearing its cluster down when it \
                     stopped; finishing the teardown"
                ),
            ),
            StartDecision::Resume {
                run_id,
                generation,
                desired,
                paused,
            } => (
                StartWhat::Resume,
                format!(
                    "resuming run {run_id} at generation {} ({desired} node(s)) from its \
                     journal{}",
                    generation.0,
                    paused_note(paused)
                ),
            ),
        };
        Ok(Self { run_id, what, note })
    }
}

/// Says why a start was refused, naming the state directory `dir`.
fn start_refused(refusal: &StartRefusal, dir: &Path) -> anyhow::Error {
    match refusal {
        StartRefusal::NoJournal => anyhow::anyhow!(
            "there is nothing to resume in {}: no daemon has run here yet. Give a shape, e.g. \
             `swactor up examples/local.toml`",
            dir.display()
        ),
        StartRefusal::OtherRun { journal, shape } => {
            let theirs = crate::words::cut(shape.as_str());
            anyhow::anyhow!(
                "{} belongs to run {journal:?}, and the shape is for run {theirs:?}; a \
                 state directory's run never changes. Use another --state-dir for run \
                 {theirs:?}; nothing was started",
                dir.display(),
            )
        }
        StartRefusal::TornDown { run_id, generation } => anyhow::anyhow!(
            "there is nothing to resume in {}: run {run_id} has no nodes (its cluster was \
             torn down at generation {}). Give a shape to start it again",
            dir.display(),
            generation.0
        ),
    }
}

/// Longest a start waits for the earlier nodes' adoption before it offers
/// its shape.
const ADOPTION_WAIT_MAX: Duration = Duration::from_secs(30);

/// `up SHAPE`: once the earlier daemon's nodes are adopted, applies the
/// shape (its plan was shown before the daemon started), with the same rules
/// as `apply`.
async fn offer_on_start(
    cluster: &ClusterHandle,
    run_id: &RunId,
    journal: &crate::journal::JournalHealth,
    file: &ShapeFile,
) -> Result<()> {
    // A provider that cannot list for this long does not hold the shape
    // back for ever: the host judges it against what it knows then.
    match tokio::time::timeout(ADOPTION_WAIT_MAX, cluster.adopted()).await {
        Ok(adopted) => adopted?,
        Err(_) => tracing::warn!(
            "the earlier nodes were not adopted within {} s; offering the shape anyway",
            ADOPTION_WAIT_MAX.as_secs()
        ),
    }
    match apply_file(cluster, run_id, journal, file).await {
        Ok((generation, true)) => eprintln!("swactor: applied generation {generation}"),
        Ok((generation, false)) => {
            eprintln!("swactor: the shape is generation {generation} already; nothing to change")
        }
        Err(e) => anyhow::bail!("the shape was refused: {e}"),
    }
    Ok(())
}

/// Shows what `shape` changes on the cluster the journal `image` records
/// (none: a fresh state directory) and asks when it destroys, replaces or
/// creates many nodes, unless `yes`. Runs before the daemon starts anything,
/// so a shape the daemon would refuse on capacity is refused here, with the
/// same check and the same words, and nothing starts.
///
/// # Errors
/// The shape grows past its own `capacity` or what the providers can hold,
/// or the change was not confirmed.
async fn confirm_start(
    image: Option<&JournalImage>,
    shape: &swactor_provisioning::ClusterShape,
    yes: bool,
) -> Result<()> {
    let current = image.and_then(|i| i.meta.shape.as_ref());
    let capacities = crate::shapefile::offline_capacities();
    if let Some(refused) = crate::shapefile::capacity_refusal(shape, current, &capacities) {
        anyhow::bail!("{refused}");
    }
    let diff = crate::guard::diff_from_journal(image, shape);
    eprintln!("swactor: {}", crate::guard::summary(&diff));
    if crate::guard::reason_to_ask(&diff).is_some() {
        let shown = crate::guard::examples(&diff, crate::guard::CHANGES_SHOWN);
        for line in crate::guard::listing(&shown, crate::guard::changed(&diff)) {
            eprintln!("{line}");
        }
    }
    crate::guard::ask(&diff, yes).await
}

/// The agent binary remote machines and containers run: the one given now
/// (returned again, absolute, to be kept for the next daemon), else the one
/// the last daemon of this state directory was given (as `--listen` is
/// kept), else the one [`AgentBinary::find`] finds.
///
/// # Errors
/// A binary given now that cannot be read.
fn choose_agent_binary(
    state_dir: &Path,
    given: Option<&Path>,
) -> Result<(AgentBinary, Option<PathBuf>)> {
    if let Some(path) = given {
        let binary = AgentBinary::find(Some(path))?;
        let absolute = std::path::absolute(path)
            .with_context(|| format!("cannot tell where {} is", path.display()))?;
        return Ok((binary, Some(absolute)));
    }
    let Some(saved) = StateDir::saved_agent_binary(state_dir) else {
        return Ok((AgentBinary::find(None)?, None));
    };
    if saved.is_file() {
        eprintln!(
            "swactor: remote machines and containers run the agent binary {}, as the last \
             daemon of this state directory was told (--agent-binary names another)",
            saved.display()
        );
        return Ok((AgentBinary::find(Some(&saved))?, None));
    }
    let found = AgentBinary::find(None)?;
    eprintln!(
        "swactor: warning: the agent binary the last daemon of this state directory was \
         given, {}, is gone; remote machines and containers run {} ({}) instead \
         (--agent-binary names one)",
        saved.display(),
        found.path.display(),
        found.found
    );
    Ok((found, None))
}

/// What the remote providers hand their agents, and the deployment their
/// resources carry.
struct Agents<'a> {
    binary: &'a AgentBinary,
    ticket: &'a EndpointTicket,
    secret: [u8; 32],
    deployment: Option<&'a str>,
}

/// The `ssh` provider, told of every host the journal's and the file's
/// shapes list (so a listing at start asks them before any create).
fn ssh_provider(
    state: &StateDir,
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<SshHostsProvider> {
    let binary = agents.binary;
    let mut config = SshHostsConfig::new(state.root(), binary.path.clone());
    config.daemon_ticket = agents.ticket.to_string();
    config.token_secret = agents.secret;
    config.deployment = agents.deployment.map(str::to_owned);
    let ssh = SshHostsProvider::new(config).context("cannot start the ssh provider")?;
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    let mut remote = false;
    for shape in shapes {
        let Ok(desired) = shape.validate() else {
            continue;
        };
        for g in desired
            .groups
            .iter()
            .filter(|g| g.template.provider.kind == "ssh")
        {
            remote = true;
            ssh.learn_template(&g.template);
        }
    }
    if remote && let Some(warning) = binary.warning() {
        eprintln!("swactor: warning: {warning}");
    }
    Ok(ssh)
}

/// The kinds of the groups of the journal's and the file's shapes.
fn kinds_in_use(resume: Option<&JournalImage>, file: Option<&ShapeFile>) -> Result<Vec<String>> {
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    Ok(shapes
        .flat_map(|s| s.groups.into_iter().map(|g| g.provider.kind))
        .collect())
}

/// The `docker` provider. It reaches the engine only once a `docker` group
/// needs it, so a daemon on a machine without Docker runs other groups.
fn docker_provider(
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<DockerOnDemand> {
    let config = DockerConfig {
        daemon_ticket: agents.ticket.to_string(),
        token_secret: agents.secret,
        deployment: agents.deployment.map(str::to_owned),
        ..DockerConfig::new(agents.binary.path.clone())
    };
    let docker = DockerOnDemand::new(config).context("cannot set up the docker provider")?;
    if kinds_in_use(resume, file)?.iter().any(|k| k == "docker") {
        docker.mark_in_use();
        let binary = agents.binary;
        if !binary.static_linked {
            eprintln!(
                "swactor: warning: the agent binary {} ({}) is dynamically linked, and a \
                 container runs only a static one: docker nodes will fail until one is given. \
                 Build it with scripts/build-static-agent.sh, or name one with --agent-binary",
                binary.path.display(),
                binary.found
            );
        }
    }
    Ok(docker)
}

/// Whether a shape rents Vast.ai machines: the group that does, if any.
fn vast_group(shape: &swactor_provisioning::ClusterShape) -> Option<String> {
    shape
        .groups
        .iter()
        .find(|g| g.provider.kind == "vast")
        .map(|g| g.id.clone())
}

/// The Vast.ai API key (`VAST_API_KEY`, else the official client's key
/// file), when there is one. A shape file that rents Vast.ai machines
/// without one is refused here, before anything is started or rented (a
/// resumed shape is checked by [`vast_provider`], also before anything runs).
fn vast_key(file: Option<&ShapeFile>) -> Result<Option<ApiKey>> {
    match ApiKey::from_env() {
        Ok(key) => Ok(Some(key)),
        Err(e) => match file
            .map(|f| f.to_shape(1))
            .transpose()?
            .and_then(|s| vast_group(&s))
        {
            Some(group) => anyhow::bail!(
                "group {group:?} rents Vast.ai machines, but {e}; nothing was started or rented"
            ),
            None => Ok(None),
        },
    }
}

/// Largest `telemetry.ndjson` before it is rotated, in bytes.
const TELEMETRY_FILE_BYTES_MAX: &str = "SWACTOR_TELEMETRY_FILE_BYTES_MAX";
/// The smallest rotation size accepted.
const TELEMETRY_FILE_BYTES_MIN: u64 = 4096;
/// Rotated `telemetry.ndjson.N` files kept.
const TELEMETRY_FILES_KEPT: &str = "SWACTOR_TELEMETRY_FILES_KEPT";

/// The NDJSON sink's settings: the defaults, or what
/// `SWACTOR_TELEMETRY_FILE_BYTES_MAX` and `SWACTOR_TELEMETRY_FILES_KEPT` say.
fn ndjson_config() -> Result<NdjsonConfig> {
    let mut config = NdjsonConfig::default();
    let number = |name: &str| -> Result<Option<u64>> {
        match std::env::var(name) {
            Err(_) => Ok(None),
            Ok(v) => v.trim().parse().map(Some).with_context(|| {
                format!("{name}={v:?} is not a whole number; nothing was started")
            }),
        }
    };
    if let Some(bytes) = number(TELEMETRY_FILE_BYTES_MAX)? {
        config.file_len_max = bytes;
    }
    if let Some(kept) = number(TELEMETRY_FILES_KEPT)? {
        config.files_kept = usize::try_from(kept).unwrap_or(usize::MAX);
    }
    if config.file_len_max < TELEMETRY_FILE_BYTES_MIN {
        anyhow::bail!(
            "{TELEMETRY_FILE_BYTES_MAX}={} is too small: a file holds at least \
             {TELEMETRY_FILE_BYTES_MIN} bytes; nothing was started",
            config.file_len_max
        );
    }
    // A line longer than a whole file is dropped (and counted), not written.
    config.line_len_max = config
        .line_len_max
        .min(usize::try_from(config.file_len_max).unwrap_or(usize::MAX));
    config.validate().map_err(|e| {
        anyhow::anyhow!("{e} ({TELEMETRY_FILES_KEPT} is at most 1000); nothing was started")
    })?;
    Ok(config)
}

/// Seconds from an environment variable, if set.
fn env_seconds(name: &str) -> Result<Option<Duration>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => {
            let s: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0)
                .with_context(|| format!("{name}={v:?} is not a number of seconds"))?;
            Ok(Some(Duration::from_secs_f64(s)))
        }
    }
}

/// The `vast` provider, when an API key was found, and whether a shape (on
/// record or in the file) uses it; its access is checked (one listing) when
/// one does, so that a refused key is reported before anything is rented.
///
/// Besides `VAST_URL`, three variables tune it (tests point them at a mock):
/// `SWACTOR_VAST_PACING=none` drops the client-side pacing of requests,
/// `SWACTOR_VAST_LISTING_LAG_S` and `SWACTOR_VAST_REQUEST_TIMEOUT_S`.
async fn vast_provider(
    key: Option<ApiKey>,
    state: &StateDir,
    agents: &Agents<'_>,
    resume: Option<&JournalImage>,
    file: Option<&ShapeFile>,
) -> Result<Option<(VastProvider, bool)>> {
    let used = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?)
        .find_map(|s| vast_group(&s));
    let Some(key) = key else {
        if let Some(group) = used {
            anyhow::bail!(
                "group {group:?} of the run on record rents Vast.ai machines, but there is no \
                 Vast.ai API key (set VAST_API_KEY or write ~/.vast_api_key); nothing was started"
            );
        }
        return Ok(None);
    };
    let url = std::env::var("VAST_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| swactor_providers::vast::DEFAULT_URL.to_owned());
    let binary = agents.binary;
    let mut config = VastConfig::new(state.root(), binary.path.clone(), url, key);
    config.daemon_ticket = agents.ticket.to_string();
    config.token_secret = agents.secret;
    config.deployment = agents.deployment.map(str::to_owned);
    if std::env::var("SWACTOR_VAST_PACING").is_ok_and(|v| v.trim() == "none") {
        config.pacing = Pacing::none();
    }
    if let Some(lag) = env_seconds("SWACTOR_VAST_LISTING_LAG_S")? {
        config.listing_lag = lag;
    }
    if let Some(t) = env_seconds("SWACTOR_VAST_REQUEST_TIMEOUT_S")? {
        config.request_timeout = t.max(Duration::from_millis(100));
    }
    let vast = match VastProvider::new(config) {
        Ok(v) => v,
        Err(e) if used.is_none() => {
            // Not needed by any shape yet: the daemon runs without it.
            eprintln!("swactor: warning: the vast provider is off: {e}");
            return Ok(None);
        }
        Err(e) => anyhow::bail!("cannot start the vast provider: {e}; nothing was started"),
    };
    if used.is_some() {
        check_vast_access(&vast).await?;
        if let Some(warning) = binary.warning() {
            eprintln!("swactor: warning: {warning}");
        }
    }
    Ok(Some((vast, used.is_some())))
}

/// Checks the vast key before anything is rented. A service that cannot be
/// read just now (rate limits, errors, answers cut off) is asked again with
/// a growing wait, each wait said, for up to `SWACTOR_VAST_ACCESS_WAIT_S`
/// (default 600 s); a refused key stops the daemon at once.
async fn check_vast_access(vast: &VastProvider) -> Result<()> {
    use swactor_providers::vast::AccessError;
    let patience = env_seconds("SWACTOR_VAST_ACCESS_WAIT_S")?.unwrap_or(Duration::from_secs(600));
    let started = std::time::Instant::now();
    let mut wait = Duration::from_secs(1);
    let stop = |e: &AccessError| {
        anyhow::anyhow!(
            "{e}; nothing new was rented (instances rented before are left running, \
             and the next `swactor up` adopts them)"
        )
    };
    loop {
        match vast.check_access().await {
            Ok(()) => return Ok(()),
            Err(e @ AccessError::Unavailable(_)) if started.elapsed() + wait <= patience => {
                eprintln!(
                    "swactor: {e}; asking again in {} s (nothing is rented before it answers; \
                     giving up after {} s in all)",
                    wait.as_secs(),
                    patience.as_secs()
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(stop(&e)),
        }
    }
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

/// Binds loopback on the port used last time, so agents of a previous daemon
/// (which kept running) find this one again.
async fn bind_daemon_endpoint(
    state: &StateDir,
    listen: IpAddr,
) -> Result<swactor_engine::iroh::Endpoint> {
    let key = state.daemon_key()?;
    let mut config = NetConfig {
        frame_len_max: FRAME_LEN_MAX,
        // Every protocol here is one request stream a peer opens (swarm,
        // control) or one stream the daemon opens (telemetry).
        incoming_bidi_streams_max: Some(1),
        incoming_uni_streams_max: Some(0),
        ..NetConfig::default()
    };
    if let Some(port) = state.saved_port() {
        config.bind_addr = SocketAddr::new(listen, port);
        match bind_endpoint(&config, key.clone()).await {
            Ok(ep) => return Ok(ep),
            Err(e) => tracing::warn!(%e, port, "the previous port is taken; binding a new one"),
        }
        config.bind_addr = SocketAddr::new(listen, 0);
    } else {
        config.bind_addr = SocketAddr::new(listen, 0);
    }
    let ep = bind_endpoint(&config, key)
        .await
        .context("cannot bind the daemon's endpoint")?;
    if let Some(port) = ep.bound_sockets().first().map(SocketAddr::port) {
        state.save_port(port)?;
    }
    Ok(ep)
}

/// How often the run's spend is held against its budget: with the lead
/// the verdict keeps ([`swactor_provisioning::budget::LEAD_MS`]), a run is
/// acted on before it overspends by more than this much of its rate.
const BUDGET_CHECK: Duration = Duration::from_secs(5);

/// Holds what the run's rented machines cost against its budget every
/// [`BUDGET_CHECK`], as [`swactor_provisioning::budget::verdict`] decides:
/// says so as the end nears, and at the budget tears the run down (as
/// `swactor down` does) or pauses it, whichever its shape says. A paused
/// run that is resumed while still over its budget is paused again; raise
/// `budget_usd` with `apply` to go on.
async fn watch_budget(
    cluster: swactor_actors::ClusterHandle,
    vast: VastProvider,
    run_id: RunId,
    down: mpsc::Sender<DownRequest>,
) {
    use swactor_provisioning::budget::{OnBudget, Verdict, verdict, warning_due};
    let mut warned = None;
    let mut torn_down = false;
    loop {
        tokio::time::sleep(BUDGET_CHECK).await;
        let mut spend = vast.spend(&run_id);
        // The journal keeps it, and what it keeps is a floor: a provider
        // that lost its records does not make the run cheaper.
        let Ok(held) = cluster.record_spent(spend.spent_micros).await else {
            return;
        };
        spend.spent_micros = held.spent_micros;
        let Some(budget) = held.budget else {
            warned = None;
            continue;
        };
        let line = crate::words::budget_line(Some(&budget), Some(&spend)).unwrap_or_default();
        match verdict(&budget, spend) {
            Verdict::Within { left_ms } => {
                let due;
                (warned, due) = warning_due(left_ms, warned);
                if due {
                    eprintln!("swactor: {line}");
                }
            }
            Verdict::Reached => match budget.on_reached {
                OnBudget::Down if !torn_down => {
                    torn_down = true;
                    eprintln!("swactor: {line}; tearing the run down");
                    let (reply, _) = oneshot::channel();
                    let _ = down.send((false, false, reply)).await;
                }
                OnBudget::Pause if !held.paused && !held.shutting_down => {
                    eprintln!("swactor: {line}; pausing the run (raise budget_usd to go on)");
                    if let Err(e) = cluster.pause().await {
                        eprintln!("swactor: could not pause the run at its budget: {e}");
                    }
                }
                _ => {}
            },
        }
    }
}

/// The daemon's two routers: the agents' protocols on the swarm endpoint,
/// the CLI's on the control endpoint.
struct Routers {
    swarm: swactor_engine::iroh::protocol::Router,
    control: swactor_engine::iroh::protocol::Router,
}

impl Routers {
    /// Closes both endpoints.
    async fn shutdown(self) {
        let (a, b) = tokio::join!(self.control.shutdown(), self.swarm.shutdown());
        let _ = (a, b);
    }
}

/// Binds the CLI's endpoint (`control/0`, `telemetry/0`) on `listen`, with
/// a key of its own (`control.key`), on a port the system picks: the CLI
/// finds it in `daemon.ticket`.
async fn bind_control_endpoint(
    state: &StateDir,
    listen: IpAddr,
) -> Result<swactor_engine::iroh::Endpoint> {
    let config = NetConfig {
        frame_len_max: FRAME_LEN_MAX,
        incoming_bidi_streams_max: Some(1),
        incoming_uni_streams_max: Some(0),
        bind_addr: SocketAddr::new(listen, 0),
        ..NetConfig::default()
    };
    bind_endpoint(&config, state.control_key()?)
        .await
        .context("cannot bind the daemon's control endpoint")
}

/// Aborts a task when dropped (the daemon's own helpers end with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What in a state directory without a journal says a run was here: files
/// only a daemon or its nodes leave, for people.
fn run_traces(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for file in [
        "token.secret",
        crate::state::DEPLOYMENT_FILE,
        "telemetry.ndjson",
        "jobs.redb",
        "daemon.ticket",
    ] {
        if dir.join(file).exists() {
            found.push(file.to_owned());
        }
    }
    for sub in ["nodes", "logs", "jobs"] {
        let entries = std::fs::read_dir(dir.join(sub)).map_or(0, Iterator::count);
        if entries > 0 {
            found.push(format!("{sub}/ ({entries} entries)"));
        }
    }
    found
}

/// How many connections may wait to join at once: [`PreAuth::DEFAULT_MAX`],
/// or, in debug builds only, `SWACTOR_FAULT_PREAUTH_MAX` (a test's flood
/// reaches a small cap on a slow machine).
///
/// [`PreAuth::DEFAULT_MAX`]: swactor_engine::net::PreAuth::DEFAULT_MAX
fn pre_auth_max() -> usize {
    #[cfg(debug_assertions)]
    if let Some(n) = std::env::var("SWACTOR_FAULT_PREAUTH_MAX")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
    {
        return n;
    }
    swactor_engine::net::PreAuth::DEFAULT_MAX
}

/// The agents' handshake budget for a run of `fleet` nodes: the default,
/// or enough for every agent's two links (swarm and jobs) in one burst and
/// their stragglers within the rejoin window, whichever is larger. A flood
/// gets no more than the fleet itself may need.
fn agents_rate(fleet: usize) -> HandshakeRate {
    let links = u32::try_from(fleet.saturating_mul(2)).unwrap_or(u32::MAX);
    HandshakeRate {
        per_second: HandshakeRate::DEFAULT.per_second.max(links / 10),
        burst: HandshakeRate::DEFAULT.burst.max(links.saturating_add(20)),
    }
}

/// The most nodes of the journal's shape and of the shape given.
fn fleet_size(resume: Option<&JournalImage>, file: Option<&ShapeFile>) -> Result<usize> {
    let shapes = resume
        .and_then(|j| j.meta.shape.clone())
        .into_iter()
        .chain(file.map(|f| f.to_shape(1)).transpose()?);
    Ok(shapes
        .map(|s| s.groups.iter().map(|g| g.count as usize).sum::<usize>())
        .max()
        .unwrap_or(0))
}

/// `rate`, or, in debug builds only, `SWACTOR_FAULT_HANDSHAKE_RATE=
/// PER_SECOND/BURST` (a flood test measures other budgets with it).
fn handshake_rate(rate: HandshakeRate) -> HandshakeRate {
    #[cfg(debug_assertions)]
    if let Some((per_second, burst)) =
        std::env::var("SWACTOR_FAULT_HANDSHAKE_RATE")
            .ok()
            .and_then(|v| {
                let (a, b) = v.split_once('/')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
    {
        let given = HandshakeRate { per_second, burst };
        if given.is_valid() {
            return given;
        }
    }
    rate
}

#[cfg(test)]
mod tests {
    use super::{HandshakeRate, agents_rate};

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
}
