//! The daemon's endpoints, routers and protocols, its telemetry publisher,
//! and the rates and caps its handshakes are held to.

use super::*;

/// The daemon's two endpoints and the tickets that name them.
pub(super) struct Endpoints {
    /// The agents' endpoint (swarm, jobs, blobs), on the agents' runtime.
    pub(super) swarm: swactor_engine::iroh::Endpoint,
    /// The CLI's endpoint (control, telemetry), on a socket of its own.
    pub(super) control: swactor_engine::iroh::Endpoint,
    /// What the CLI is given (`daemon.ticket`).
    pub(super) cli_ticket: EndpointTicket,
    /// What agents are given: the advertised address, on the bound port.
    pub(super) agent_ticket: EndpointTicket,
}

impl Endpoints {
    /// Binds both; each is put in `bound` as soon as it is.
    ///
    /// In a `term`, the ports this daemon gave the run's other daemons are
    /// the only ones their tickets name: each is waited for while it is
    /// taken (see [`bind_at_saved`]), and one bound elsewhere all the same
    /// fails the start with [`ha::PortsMoved`].
    pub(super) async fn bind(
        state: &StateDir,
        swarm: &tokio::runtime::Handle,
        (listen, advertise): (IpAddr, Option<IpAddr>),
        term: Option<&Term>,
        bound: &mut Vec<swactor_engine::iroh::Endpoint>,
    ) -> Result<Self> {
        let patience = term.map_or(Duration::ZERO, |_| ha::PORT_PATIENCE);
        // The CLI's own endpoint, on a socket of its own: a flood of handshakes
        // on the agents' endpoint (whose ticket every agent's command line
        // shows) never queues the CLI's handshake behind it. Bound first: a
        // term whose control port moved ends before agents could reach an
        // endpoint of it.
        let control = bind_control_endpoint(state, listen, patience).await?;
        bound.push(control.clone());
        if let Some(t) = term {
            t.check_control_port(&control)?;
        }
        // Bound on the agents' runtime: the endpoint's own tasks (its socket,
        // its handshakes) run there.
        let endpoint = {
            let state = state.clone();
            swarm
                .spawn(async move { bind_daemon_endpoint(&state, listen, patience).await })
                .await
                .context("the agents' runtime stopped")??
        };
        bound.push(endpoint.clone());
        if let Some(t) = term {
            t.check_swarm_port(&endpoint)?;
        }
        let cli_ticket = EndpointTicket::new(control.addr());
        let agent_ticket = match (advertise, endpoint.bound_sockets().first()) {
            (Some(ip), Some(bound)) => EndpointTicket::new(
                swactor_engine::iroh::EndpointAddr::new(endpoint.id())
                    .with_ip_addr(SocketAddr::new(ip, bound.port())),
            ),
            _ => EndpointTicket::new(endpoint.addr()),
        };
        Ok(Self {
            swarm: endpoint,
            control,
            cli_ticket,
            agent_ticket,
        })
    }
}

/// The telemetry publisher: `watch`, the dashboard and `telemetry.ndjson`.
pub(super) async fn telemetry_publisher(
    state: &StateDir,
    ndjson: &NdjsonConfig,
    run_id: &RunId,
) -> Result<TelemetryPublisher<ClusterSnapshot, ClusterEvent>> {
    let empty = ClusterSnapshot::empty(run_id.to_string());
    let sink = NdjsonSink::open(state.root(), ndjson)
        .await
        .context("cannot open telemetry.ndjson")?;
    // A snapshot of 100,000 nodes is several MiB; the engine's default
    // frame (1 MiB) would leave `watch` with a stale one.
    let telemetry_config = TelemetryConfig {
        frame_len_max: FRAME_LEN_MAX,
        ..TelemetryConfig::default()
    };
    Ok(TelemetryPublisher::new(telemetry_config, &empty)
        .context("cannot start telemetry")?
        .with_ndjson(sink))
}

/// Starts both routers: the agents' protocols (swarm, jobs, blobs) on the
/// agents' endpoint and runtime, the CLI's (control, telemetry) on its own.
pub(super) fn serve_protocols(
    endpoints: &Endpoints,
    swarm: &tokio::runtime::Handle,
    swarm_handler: SwarmHandler,
    jobs: &crate::jobs::service::JobService,
    fleet: usize,
    (control, telemetry, cli_allowed): (
        ControlHandler,
        swactor_engine::telemetry::TelemetryHandler,
        Allowlist,
    ),
    metrics: &crate::metrics::Metrics,
) -> Routers {
    let (blobs_allowed, blobs) = jobs.blobs();
    // The router's accept loop and every handler it starts run on the
    // agents' runtime too.
    let on_swarm = swarm.enter();
    // Every joined agent holds one swarm connection, which is its jobs
    // link too, so the caps follow the cluster's size
    // ([`follow_cluster_size`] moves them on every accepted shape); what a
    // peer that has not joined may hold is bounded apart, by the swarm's
    // pre-authentication places.
    let sized = |limits: Limits| Limits {
        connections_max: agents_cap(fleet),
        ..limits
    };
    let swarm_router = GuardedRouterBuilder::new(endpoints.swarm.clone())
        // A welcomed agent's swarm connection carries its jobs too: there
        // is no `swactor/jobs/0` connection to accept (an agent of another
        // version is refused at the handshake; see docs/jobs.md).
        .serve_with_limits(
            ALPN_SWARM,
            Allowlist::open(),
            sized(Limits::OPEN),
            swarm_handler.with_jobs(jobs.job_links()),
        )
        // Workspaces: only the keys of agents with a jobs link may connect,
        // and each fetches only the chunks of the run it ships.
        .serve_with_limits(
            iroh_blobs::ALPN,
            blobs_allowed,
            sized(Limits::LINKED),
            blobs,
        )
        // New handshakes are rationed, so a flood costs the daemon a
        // bounded share of its time; joined agents' links are never counted.
        .handshake_rate(None, handshake_rate(agents_rate(fleet)));
    let swarm_handshakes = swarm_router.handshakes_under_way();
    let named: Vec<(&'static str, swactor_engine::net::ConnectionCap)> =
        [("swarm", ALPN_SWARM), ("blobs", iroh_blobs::ALPN)]
            .iter()
            .filter_map(|(name, alpn)| swarm_router.connection_cap(alpn).map(|c| (*name, c)))
            .collect();
    let agent_caps = named.iter().map(|(_, c)| c.clone()).collect();
    metrics.watch_agent_caps(named);
    let router = swarm_router.spawn();
    drop(on_swarm);
    // The CLI's protocols, on the CLI's endpoint, rationed on their own.
    let control_router = GuardedRouterBuilder::new(endpoints.control.clone())
        .serve(ALPN_CONTROL, cli_allowed.clone(), control)
        .serve(ALPN_TELEMETRY, cli_allowed, telemetry)
        .handshake_rate(None, handshake_rate(HandshakeRate::DEFAULT));
    metrics.watch_handshakes(vec![
        ("swarm", swarm_handshakes),
        ("control", control_router.handshakes_under_way()),
    ]);
    Routers {
        swarm: router,
        control: control_router.spawn(),
        agent_caps,
    }
}

/// The most connections each of the agents' protocols serves at once for a
/// cluster of `slots` desired nodes: one per joined agent, a quarter more
/// for replacements that overlap their predecessors and for rollouts, and
/// never fewer than the engine's default for an open protocol.
pub(super) fn agents_cap(slots: usize) -> usize {
    Limits::OPEN
        .connections_max
        .max(slots.saturating_add(slots / 4).saturating_add(64))
}

/// Moves the agents' protocols' caps to every shape the cluster accepts
/// (never below what the daemon started with), until the cluster is gone.
pub(super) async fn follow_cluster_size(
    cluster: ClusterHandle,
    caps: Vec<swactor_engine::net::ConnectionCap>,
    fleet: usize,
) {
    let Ok(sub) = cluster.subscribe().await else {
        return;
    };
    let set = |slots: usize| {
        let cap = agents_cap(slots.max(fleet));
        for c in &caps {
            c.set(cap);
        }
    };
    set(usize::try_from(sub.snapshot.desired_nodes).unwrap_or(usize::MAX));
    let mut events = sub.events;
    loop {
        match events.recv().await {
            Ok(ClusterEvent::ShapeAccepted { nodes, .. }) => {
                set(usize::try_from(nodes).unwrap_or(usize::MAX));
            }
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// On SIGHUP (sent by the CLI of the daemon's own user when it lost the
/// ticket or its key), writes the ticket again and lets the CLI key now in the
/// state directory in, in place of the old one.
/// A SIGHUP received while the daemon was starting is served once it runs.
pub(super) fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    state: StateDir,
    ticket: EndpointTicket,
    allowed: Allowlist,
    mut cli: swactor_engine::iroh::EndpointId,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
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
    }))
}

/// Largest `telemetry.ndjson` before it is rotated, in bytes.
pub(super) const TELEMETRY_FILE_BYTES_MAX: &str = "SWACTOR_TELEMETRY_FILE_BYTES_MAX";
/// The smallest rotation size accepted.
pub(super) const TELEMETRY_FILE_BYTES_MIN: u64 = 4096;
/// Rotated `telemetry.ndjson.N` files kept.
pub(super) const TELEMETRY_FILES_KEPT: &str = "SWACTOR_TELEMETRY_FILES_KEPT";

/// The NDJSON sink's settings: the defaults, or what
/// `SWACTOR_TELEMETRY_FILE_BYTES_MAX` and `SWACTOR_TELEMETRY_FILES_KEPT` say.
pub(super) fn ndjson_config() -> Result<NdjsonConfig> {
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
pub(super) fn env_seconds(name: &str) -> Result<Option<Duration>> {
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

/// Binds loopback on the port used last time, so agents of a previous daemon
/// (which kept running) find this one again.
pub(super) async fn bind_daemon_endpoint(
    state: &StateDir,
    listen: IpAddr,
    patience: Duration,
) -> Result<swactor_engine::iroh::Endpoint> {
    let config = NetConfig {
        frame_len_max: FRAME_LEN_MAX,
        // Every protocol here is one request stream a peer opens (swarm,
        // control) or one stream the daemon opens (telemetry).
        incoming_bidi_streams_max: Some(1),
        incoming_uni_streams_max: Some(0),
        ..NetConfig::default()
    };
    let key = state.daemon_key()?;
    let ep = bind_at_saved(config, key, (listen, state.saved_port()), patience, "port")
        .await
        .context("cannot bind the daemon's endpoint")?;
    if let Some(port) = bound_port(&ep) {
        state.save_port(port)?;
    }
    Ok(ep)
}

/// The port `ep` is bound on.
pub(super) fn bound_port(ep: &swactor_engine::iroh::Endpoint) -> Option<u16> {
    ep.bound_sockets().first().map(SocketAddr::port)
}

/// How often a taken port is tried again while it is waited for.
const RETRY_PORT_EVERY: Duration = Duration::from_millis(100);

/// Binds `config` on `listen` at the port `saved` (the one used before),
/// trying it again for up to `patience` while it is taken, else on a port
/// the system picks: the caller learns which from the endpoint.
async fn bind_at_saved(
    mut config: NetConfig,
    key: swactor_engine::iroh::SecretKey,
    (listen, saved): (IpAddr, Option<u16>),
    patience: Duration,
    what: &str,
) -> Result<swactor_engine::iroh::Endpoint, swactor_engine::net::NetError> {
    if let Some(port) = saved {
        config.bind_addr = SocketAddr::new(listen, port);
        let started = tokio::time::Instant::now();
        loop {
            match bind_endpoint(&config, key.clone()).await {
                Ok(ep) => return Ok(ep),
                Err(e) if started.elapsed() >= patience => {
                    tracing::warn!(%e, port, "the previous {what} is taken; binding a new one");
                    break;
                }
                Err(_) => tokio::time::sleep(RETRY_PORT_EVERY).await,
            }
        }
    }
    config.bind_addr = SocketAddr::new(listen, 0);
    bind_endpoint(&config, key).await
}

/// The daemon's two routers: the agents' protocols on the swarm endpoint,
/// the CLI's on the control endpoint.
pub(super) struct Routers {
    pub(super) swarm: swactor_engine::iroh::protocol::Router,
    pub(super) control: swactor_engine::iroh::protocol::Router,
    /// The total caps of the agents' protocols, which follow the cluster's size.
    pub(super) agent_caps: Vec<swactor_engine::net::ConnectionCap>,
}

impl Routers {
    /// Closes both endpoints.
    pub(super) async fn shutdown(self) {
        let (a, b) = tokio::join!(self.control.shutdown(), self.swarm.shutdown());
        let _ = (a, b);
    }
}

/// Binds the CLI's endpoint (`control/0`, `telemetry/0`) on `listen`, with
/// a key of its own (`control.key`), on a port the system picks: the CLI
/// finds it in `daemon.ticket`.
pub(super) async fn bind_control_endpoint(
    state: &StateDir,
    listen: IpAddr,
    patience: Duration,
) -> Result<swactor_engine::iroh::Endpoint> {
    let config = NetConfig {
        frame_len_max: FRAME_LEN_MAX,
        incoming_bidi_streams_max: Some(1),
        incoming_uni_streams_max: Some(0),
        ..NetConfig::default()
    };
    let key = state.control_key()?;
    // The port of last time, when there is one, so a ticket given out
    // before (to the CLI of another replica of the run) still reaches it.
    let saved = (listen, state.saved_control_port());
    let ep = bind_at_saved(config, key, saved, patience, "control port")
        .await
        .context("cannot bind the daemon's control endpoint")?;
    if let Some(port) = bound_port(&ep) {
        state.save_control_port(port)?;
    }
    Ok(ep)
}

/// How many connections may wait to join at once: [`PreAuth::DEFAULT_MAX`],
/// or, in debug builds only, `SWACTOR_FAULT_PREAUTH_MAX` (a test's flood
/// reaches a small cap on a slow machine).
///
/// [`PreAuth::DEFAULT_MAX`]: swactor_engine::net::PreAuth::DEFAULT_MAX
pub(super) fn pre_auth_max() -> usize {
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
/// or two handshakes per agent (its swarm connection, and its blob
/// transfer when a job ships a workspace) in one burst and their
/// stragglers within the rejoin window, whichever is larger. A flood gets
/// no more than the fleet itself may need.
pub(super) fn agents_rate(fleet: usize) -> HandshakeRate {
    let links = u32::try_from(fleet.saturating_mul(2)).unwrap_or(u32::MAX);
    HandshakeRate {
        per_second: HandshakeRate::DEFAULT.per_second.max(links / 10),
        burst: HandshakeRate::DEFAULT.burst.max(links.saturating_add(20)),
    }
}

/// `rate`, or, in debug builds only, `SWACTOR_FAULT_HANDSHAKE_RATE=
/// PER_SECOND/BURST` (a flood test measures other budgets with it).
pub(super) fn handshake_rate(rate: HandshakeRate) -> HandshakeRate {
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
