//! `swactor bench swarm`: a real daemon, in a child process, with N
//! simulated agents joined to it over iroh on loopback.
//!
//! Each simulated agent is the real agent's code after its boot check
//! (`swactor_daemon::agent::simulate`): an endpoint with its attempt's own
//! key, the key-bound join, heartbeats, renewals, rejoins, and the job
//! requests the daemon opens on the same connection (its jobs link).
//! They all run in this process; the daemon's provider (`sim`, see
//! [`super::sim`]) asks for them over a Unix socket as its leases are made
//! and released, so the daemon's processor time and memory are its own.
//!
//! The run: the shape (one group of N `sim` nodes) is applied at start;
//! once every agent joined and the daemon shows every node ready, the
//! daemon is left alone for `--secs` while its processor time is counted;
//! then `status` and `/metrics` are timed, a flood (`--flood`) and a frozen
//! agent (`--freeze`) are tried if asked, and the daemon tears down. The
//! last line is one JSON object with the figures.

use super::sim::{self, ToBench, ToDaemon};
use crate::client::Client;
use crate::protocol::{ControlRequest, ControlResponse};
use anyhow::{Context, Result, bail};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use swactor_actors::{AgentLink, ClusterEvent, ClusterSnapshot};
use swactor_daemon::agent::{Simulated, simulate};
use swactor_engine::telemetry::TelemetryFrame;
use swactor_providers::credentials::AgentCredentials;
use swactor_provisioning::{LogicalNodeId, NodeAttemptId, ResourceKey};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::UnixListener;

/// Simulated agents between their start and their first join at once.
const JOINING_MAX: usize = 256;

/// Options of `swactor bench swarm`.
#[derive(Debug, clap::Args)]
pub(crate) struct SwarmArgs {
    /// Simulated agents: the nodes of the bench's one group.
    #[arg(long, default_value_t = 1000)]
    agents: u32,
    /// Seconds the joined swarm is left alone while the daemon's processor
    /// time is counted.
    #[arg(long, default_value_t = 30.0)]
    secs: f64,
    /// The group's `lost_grace_s` (default: the shapes' default).
    #[arg(long)]
    grace: Option<f64>,
    /// After the quiet window: this many unauthenticated connections on
    /// the swarm protocol, each announcing a 64 MiB frame and holding it,
    /// while `status` is timed and every agent's state is watched.
    #[arg(long, default_value_t = 0)]
    flood: u32,
    /// After the quiet window: stop one agent's heartbeats and time until
    /// the daemon shows it disconnected and until its replacement is ready.
    #[arg(long)]
    freeze: bool,
    /// Keep the daemon's state, its log and the agents' directory here
    /// (default: a fresh temporary directory, removed at the end).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// Options of the bench's daemon (`swactor bench swarm-daemon`).
#[derive(Debug, clap::Args)]
pub(crate) struct DaemonArgs {
    /// The bench's socket.
    #[arg(long)]
    socket: PathBuf,
    /// Where the daemon's web surface listens.
    #[arg(long)]
    http: std::net::SocketAddr,
    /// The shape.
    shape: PathBuf,
}

/// Runs the bench's daemon: `up` on the shape, with the `sim` provider.
pub(crate) async fn daemon(state_dir: PathBuf, args: DaemonArgs) -> Result<i32> {
    let socket = args.socket.clone();
    let provider = swactor_daemon::daemon::EmbeddedProvider {
        kind: sim::KIND,
        make: Box::new(move |joining| {
            let stream = std::os::unix::net::UnixStream::connect(&socket)
                .with_context(|| format!("cannot reach the bench at {}", socket.display()))?;
            stream.set_nonblocking(true)?;
            let stream = tokio::net::UnixStream::from_std(stream)?;
            Ok(Arc::new(sim::SimProvider::start(
                stream,
                joining.ticket.clone(),
                joining.token_secret,
            )) as Arc<dyn swactor_providers::Provider>)
        }),
    };
    swactor_daemon::daemon::up(swactor_daemon::daemon::UpOptions {
        shape: Some(args.shape),
        state_dir,
        until_converged: false,
        timeout: Duration::from_secs(300),
        keep: false,
        yes: true,
        listen: None,
        advertise: None,
        agent_binary: None,
        http: Some(args.http),
        unrecorded: None,
        providers: vec![provider],
        ha: None,
        flight_max_bytes: swactor_daemon::daemon::FLIGHT_MAX_BYTES_DEFAULT,
    })
    .await
}

/// The bench's directory and what it holds.
struct Work {
    root: PathBuf,
    /// Removed at the end (a temporary directory).
    temporary: bool,
}

impl Work {
    fn new(dir: Option<PathBuf>) -> Result<Self> {
        let (root, temporary) = match dir {
            Some(dir) => (dir, false),
            None => (
                std::env::temp_dir().join(format!("swactor-bench-{}", std::process::id())),
                true,
            ),
        };
        if root.join("state").exists() {
            bail!(
                "{} already holds a bench's state; name an empty directory",
                root.display()
            );
        }
        std::fs::create_dir_all(root.join("agents"))
            .with_context(|| format!("cannot make {}", root.display()))?;
        use std::os::unix::fs::PermissionsExt as _;
        // The socket carries agents' credentials: this user's only.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))?;
        Ok(Self { root, temporary })
    }

    fn state(&self) -> PathBuf {
        self.root.join("state")
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// One simulated agent this process runs.
struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    frozen: Arc<AtomicBool>,
}

/// The simulated agents, and what they did.
struct Swarm {
    agents: Mutex<HashMap<ResourceKey, Running>>,
    to_daemon: tokio::sync::mpsc::UnboundedSender<ToDaemon>,
    dir: PathBuf,
    /// Frames the agents sent and received once joined.
    frames: Arc<AtomicU64>,
    /// Leases made.
    created: AtomicU64,
    /// Agents joined now (an ended or stopped one no longer counts).
    joined_now: AtomicU64,
    /// Places for agents between their start and their first join.
    joining: Arc<tokio::sync::Semaphore>,
    /// Agents that ended by themselves.
    ended: AtomicU64,
    /// When the last lease was made and when the last agent joined.
    last_created: Mutex<Option<Instant>>,
    last_joined: Mutex<Option<Instant>>,
    /// The ticket the agents dial (the daemon's swarm endpoint).
    ticket: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Swarm {
    fn heard(self: &Arc<Self>, msg: ToBench) {
        match msg {
            ToBench::Created { .. } => {
                self.created.fetch_add(1, Ordering::Relaxed);
                *lock(&self.last_created) = Some(Instant::now());
            }
            ToBench::Start {
                key,
                ticket,
                token,
                secret,
            } => self.start(key, ticket, token, &secret),
            ToBench::Stop { key } => {
                if let Some(running) = lock(&self.agents).remove(&key) {
                    running.stop.send_replace(true);
                }
            }
        }
    }

    fn start(self: &Arc<Self>, key: ResourceKey, ticket: String, token: String, secret: &str) {
        let Some(secret_key) = sim::unhex32(secret) else {
            tracing::error!(%key, "the daemon sent a key that is not 64 hex digits");
            return;
        };
        lock(&self.ticket).get_or_insert_with(|| ticket.clone());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let frozen = Arc::new(AtomicBool::new(false));
        let replaced = lock(&self.agents).insert(
            key.clone(),
            Running {
                stop,
                frozen: frozen.clone(),
            },
        );
        if let Some(old) = replaced {
            old.stop.send_replace(true);
        }
        let agent = Simulated {
            key: key.clone(),
            ticket,
            credentials: AgentCredentials { token, secret_key },
            dir: self.dir.clone(),
            frozen,
        };
        let swarm = self.clone();
        tokio::spawn(async move {
            // Machines boot over seconds, not all in one: at most
            // `JOINING_MAX` agents are between their start and their first
            // join at once.
            let Ok(permit) = swarm.joining.clone().acquire_owned().await else {
                return;
            };
            let permit = Mutex::new(Some(permit));
            let frames = swarm.frames.clone();
            let was_joined = AtomicBool::new(false);
            let joined = || {
                lock(&permit).take();
                was_joined.store(true, Ordering::Relaxed);
                swarm.joined_now.fetch_add(1, Ordering::Relaxed);
                *lock(&swarm.last_joined) = Some(Instant::now());
                let _ = swarm.to_daemon.send(ToDaemon::Joined { key: key.clone() });
            };
            let ended = simulate(agent, &frames, &joined, stopped).await;
            if was_joined.load(Ordering::Relaxed) {
                swarm.joined_now.fetch_sub(1, Ordering::Relaxed);
            }
            if let Err(reason) = ended {
                swarm.ended.fetch_add(1, Ordering::Relaxed);
                let _ = swarm.to_daemon.send(ToDaemon::Ended { key, reason });
            }
        });
    }

    fn freeze(&self, key: &ResourceKey) -> bool {
        lock(&self.agents)
            .get(key)
            .map(|r| r.frozen.store(true, Ordering::Relaxed))
            .is_some()
    }

    fn stop_all(&self) {
        for (_, running) in lock(&self.agents).drain() {
            running.stop.send_replace(true);
        }
    }
}

/// What the event stream showed of the nodes.
#[derive(Default)]
struct Seen {
    /// Nodes shown disconnected (away), and when first.
    away: HashMap<LogicalNodeId, Instant>,
    /// When each node was last shown ready, with its attempt.
    ready: HashMap<LogicalNodeId, (NodeAttemptId, Instant)>,
}

/// Follows the cluster's events into `seen` until the stream ends.
async fn follow(client: &Client, seen: Arc<Mutex<Seen>>) -> Result<tokio::task::JoinHandle<()>> {
    let mut sub = client.events().await?;
    Ok(tokio::spawn(async move {
        while let Ok(Some(frame)) = sub.next().await {
            let TelemetryFrame::<ClusterSnapshot, ClusterEvent>::Event { event, .. } = frame else {
                continue;
            };
            let now = Instant::now();
            match event {
                ClusterEvent::AgentDisconnected { key, .. } => {
                    lock(&seen).away.entry(key.node).or_insert(now);
                }
                ClusterEvent::Node(node) => {
                    let mut seen = lock(&seen);
                    if matches!(node.agent, AgentLink::Away { .. }) {
                        seen.away.entry(node.node).or_insert(now);
                    }
                    if node.ready {
                        seen.ready.insert(node.node, (node.attempt, now));
                    }
                }
                _ => {}
            }
        }
    }))
}

/// The processor time (user + system) of `pid` so far.
fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) in its parentheses.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("an unreadable /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|f| f.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|f| f.parse().ok()).unwrap_or(0);
    let hz = rustix::param::clock_ticks_per_second().max(1);
    Ok(Duration::from_millis(ticks * 1000 / hz))
}

/// The resident memory of `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Raises this process's descriptor limit to its hard limit: every agent
/// holds a socket.
fn more_descriptors() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    let _ = setrlimit(Resource::Nofile, limit);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// A control client; a daemon busy with thousands of joins may be slow
/// to take its connection, so it is asked five times.
async fn open_client(state: &std::path::Path) -> Result<Client> {
    let mut tries = 0;
    loop {
        match Client::open(state).await {
            Ok(client) => return Ok(client),
            Err(e) if tries < 4 => {
                tries += 1;
                eprintln!("bench: {e:#}; asking again");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The status, and how long the daemon took to answer it.
async fn timed_status(client: &Client) -> Result<(ClusterSnapshot, Duration)> {
    let started = Instant::now();
    match client.ask(ControlRequest::Status).await? {
        ControlResponse::Status(snap) => Ok((snap, started.elapsed())),
        other => Err(crate::client::unexpected(&other)),
    }
}

/// `GET /metrics`: the exposition, and how long it took.
async fn timed_metrics(http: std::net::SocketAddr, token: &str) -> Result<(String, Duration)> {
    let started = Instant::now();
    let mut conn = tokio::net::TcpStream::connect(http).await?;
    conn.write_all(
        format!(
            "GET /metrics HTTP/1.1\r\nHost: {http}\r\nAuthorization: Bearer {token}\r\n\
             Connection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let mut body = Vec::new();
    conn.read_to_end(&mut body).await?;
    let took = started.elapsed();
    if !body.starts_with(b"HTTP/1.1 200") {
        bail!(
            "/metrics answered {}",
            String::from_utf8_lossy(body.get(..40).unwrap_or(&body))
        );
    }
    Ok((String::from_utf8_lossy(&body).into_owned(), took))
}

/// A sample's value in an exposition, by its name (no labels).
fn sample(exposition: &str, name: &str) -> Option<u64> {
    exposition.lines().find_map(|l| {
        let value = l.strip_prefix(name)?.strip_prefix(' ')?;
        value.trim().parse::<f64>().ok().map(|v| v as u64)
    })
}

fn median_ms(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples
        .get(samples.len() / 2)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

fn shape(agents: u32, grace: Option<f64>) -> String {
    let grace = grace.map_or(String::new(), |g| format!("lost_grace_s = {g}\n"));
    format!(
        "run = \"bench\"\n\n[[group]]\nid = \"sim\"\ncount = {agents}\nprovider = \"{}\"\n{grace}",
        sim::KIND
    )
}

/// A free port on loopback for the daemon's web surface.
fn free_port() -> Result<std::net::SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// Runs the bench; the exit code is 0 when every agent joined and stayed
/// joined, 1 otherwise.
pub(crate) async fn swarm(args: SwarmArgs) -> Result<i32> {
    if args.agents == 0 || args.agents > swactor_provisioning::GROUP_COUNT_MAX {
        bail!(
            "--agents must be 1 to {}",
            swactor_provisioning::GROUP_COUNT_MAX
        );
    }
    let descriptors = more_descriptors();
    let n = u64::from(args.agents);
    let work = Work::new(args.dir.clone())?;
    let state = work.state();
    let socket = work.root.join("sim.sock");
    let listener = UnixListener::bind(&socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    let shape_file = work.root.join("shape.toml");
    std::fs::write(&shape_file, shape(args.agents, args.grace))?;
    let http = free_port()?;
    let log = std::fs::File::create(work.root.join("daemon.log"))?;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .arg("--state-dir")
        .arg(&state)
        .args(["bench", "swarm-daemon", "--socket"])
        .arg(&socket)
        .arg("--http")
        .arg(http.to_string())
        .arg(&shape_file)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the bench's daemon")?;
    let pid = child.id().context("the daemon exited at once")?;
    eprintln!(
        "bench: daemon pid {pid}, {} agents, state and log in {} (descriptors: {descriptors})",
        args.agents,
        work.root.display()
    );
    let (stream, _) = tokio::time::timeout(Duration::from_secs(60), listener.accept())
        .await
        .context("the daemon did not reach the bench within 60 s (see its daemon.log)")??;
    let (read, write) = stream.into_split();
    let to_daemon = sim::json_lines(write, "the daemon's socket closed");
    let swarm = Arc::new(Swarm {
        agents: Mutex::default(),
        to_daemon,
        dir: work.root.join("agents"),
        frames: Arc::default(),
        created: AtomicU64::new(0),
        joined_now: AtomicU64::new(0),
        joining: Arc::new(tokio::sync::Semaphore::new(JOINING_MAX)),
        ended: AtomicU64::new(0),
        last_created: Mutex::default(),
        last_joined: Mutex::default(),
        ticket: Mutex::default(),
    });
    {
        let swarm = swarm.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<ToBench>(&line) {
                    Ok(msg) => swarm.heard(msg),
                    Err(e) => tracing::error!(%e, "the daemon sent a line the bench cannot read"),
                }
            }
        });
    }

    let outcome = measure(&args, &work, &swarm, pid, http).await;
    swarm.stop_all();
    // The daemon ends with its teardown (or was never asked: stop it).
    if tokio::time::timeout(Duration::from_secs(120), child.wait())
        .await
        .is_err()
    {
        eprintln!("bench: the daemon did not end within 120 s of its teardown; killing it");
        let _ = child.kill().await;
    }
    let figures = outcome?;
    let ok = figures["joined"] == json!(n)
        && figures["disconnected"] == json!(0)
        && figures["teardown_error"].is_null();
    println!("{figures}");
    Ok(if ok { 0 } else { 1 })
}

/// The bench's phases, once the daemon runs; the figures as JSON.
async fn measure(
    args: &SwarmArgs,
    work: &Work,
    swarm: &Arc<Swarm>,
    pid: u32,
    http: std::net::SocketAddr,
) -> Result<serde_json::Value> {
    let n = u64::from(args.agents);
    let state = work.state();
    // 1. Every agent joined, and the daemon shows every node ready.
    let started = Instant::now();
    let patience = Duration::from_secs(120 + n / 50);
    let mut shown = Instant::now();
    while swarm.joined_now.load(Ordering::Relaxed) < n {
        if started.elapsed() > patience {
            bail!(
                "only {} of {n} agents joined within {patience:?} ({} leases made, {} agents \
                 ended by themselves; see {})",
                swarm.joined_now.load(Ordering::Relaxed),
                swarm.created.load(Ordering::Relaxed),
                swarm.ended.load(Ordering::Relaxed),
                work.root.join("daemon.log").display()
            );
        }
        if shown.elapsed() >= Duration::from_secs(2) {
            shown = Instant::now();
            eprintln!(
                "bench: {} of {n} agents joined ({} leases made, {:.0} s)",
                swarm.joined_now.load(Ordering::Relaxed),
                swarm.created.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last_created = lock(&swarm.last_created).unwrap_or(started);
    let last_joined = lock(&swarm.last_joined).unwrap_or(started);
    let to_joined = last_joined.saturating_duration_since(last_created);
    let client = open_client(&state).await?;
    let mut ready_at = None;
    while ready_at.is_none() {
        let (snap, _) = timed_status(&client).await?;
        let ready = snap.nodes.iter().filter(|n| n.ready).count() as u64;
        if ready >= n {
            ready_at = Some(Instant::now());
        } else if started.elapsed() > patience {
            bail!("the daemon shows {ready} of {n} nodes ready after {patience:?}");
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let to_ready = ready_at
        .unwrap_or(last_created)
        .saturating_duration_since(last_created);
    eprintln!(
        "bench: all {n} joined {:.2} s after the last lease was made (ready in status after {:.2} s)",
        to_joined.as_secs_f64(),
        to_ready.as_secs_f64()
    );
    let (before, _) = timed_status(&client).await?;
    let attempts: HashMap<LogicalNodeId, NodeAttemptId> =
        before.nodes.iter().map(|s| (s.node, s.attempt)).collect();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let follower = follow(&client, seen.clone()).await?;

    // 2. Left alone: the daemon's processor time and the agents' frames.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let load_before = load_average();
    let me = std::process::id();
    let own0 = cpu_time(me)?;
    let (cpu0, frames0, t0) = (
        cpu_time(pid)?,
        swarm.frames.load(Ordering::Relaxed),
        Instant::now(),
    );
    let window = Duration::from_secs_f64(args.secs.max(1.0));
    let mut rss_max = 0;
    while t0.elapsed() < window {
        tokio::time::sleep(Duration::from_secs(1).min(window.saturating_sub(t0.elapsed()))).await;
        rss_max = rss_max.max(rss(pid));
    }
    let (cpu1, frames1, elapsed) = (
        cpu_time(pid)?,
        swarm.frames.load(Ordering::Relaxed),
        t0.elapsed(),
    );
    let load_after = load_average();
    let own_pct = (cpu_time(me)? - own0).as_secs_f64() / elapsed.as_secs_f64() * 100.0;
    let own_rss = rss(me);
    let cpu_pct = (cpu1 - cpu0).as_secs_f64() / elapsed.as_secs_f64() * 100.0;
    let frames_per_s = (frames1 - frames0) as f64 / elapsed.as_secs_f64();
    let rss_now = rss(pid);
    eprintln!(
        "bench: {:.0} s alone: daemon {cpu_pct:.1}% of a core, RSS {} MiB ({} B per agent), \
         {frames_per_s:.0} frames/s; the agents' process {own_pct:.0}%, {} MiB (load \
         {load_before} -> {load_after})",
        elapsed.as_secs_f64(),
        rss_now >> 20,
        rss_now / n,
        own_rss >> 20
    );

    // 3. `status` and `/metrics`, five times each.
    let token = std::fs::read_to_string(state.join("http.token"))
        .context("cannot read the daemon's web token")?;
    let token = token.trim();
    let mut status_times = Vec::new();
    let mut metrics_times = Vec::new();
    let mut exposition = String::new();
    for _ in 0..5 {
        status_times.push(timed_status(&client).await?.1);
        let (text, took) = timed_metrics(http, token).await?;
        exposition = text;
        metrics_times.push(took);
    }
    let metrics_bytes = exposition.len();
    let heap = sample(&exposition, "swactor_allocator_allocated_bytes").unwrap_or(0);
    let status_ms = median_ms(status_times);
    let metrics_ms = median_ms(metrics_times);
    eprintln!(
        "bench: status {status_ms:.1} ms, /metrics {metrics_ms:.1} ms ({} KiB) (medians of 5); \
         daemon heap {} MiB",
        metrics_bytes >> 10,
        heap >> 20
    );

    // 4. A flood of strangers, while every agent stays joined.
    let mut flood = json!(null);
    if args.flood > 0 {
        let ticket = lock(&swarm.ticket)
            .clone()
            .context("no agent was started")?;
        let ticket: swactor_engine::net::EndpointTicket = ticket.parse()?;
        flood = flood_while_joined(&client, ticket.addr().clone(), args.flood).await?;
    }

    // What the window (and the flood) did to the agents.
    let (after, _) = timed_status(&client).await?;
    let replaced = after
        .nodes
        .iter()
        .filter(|s| attempts.get(&s.node).is_some_and(|a| *a != s.attempt))
        .count();
    let disconnected = lock(&seen).away.len() + replaced;
    if args.flood > 0 {
        flood["disconnected"] = json!(disconnected);
    }

    // 5. A frozen agent: disconnected, then replaced.
    let mut frozen = json!(null);
    if args.freeze {
        frozen = freeze_one(swarm, &after, &seen).await?;
    }

    // 6. The teardown.
    let joined = swarm.joined_now.load(Ordering::Relaxed);
    let torn = Instant::now();
    let down = client
        .ask(ControlRequest::Down {
            keep: false,
            purge: false,
        })
        .await;
    follower.abort();
    client.close().await;
    // The figures stand whatever the teardown did; a failed one is said
    // (and fails the run).
    let teardown = match down {
        Ok(_) => {
            eprintln!("bench: torn down in {:.2} s", torn.elapsed().as_secs_f64());
            json!(null)
        }
        Err(e) => {
            eprintln!("bench: the teardown failed: {e:#}");
            json!(format!("{e:#}"))
        }
    };
    Ok(json!({
        "teardown_error": teardown,
        "agents": n,
        "joined": joined,
        "leases": swarm.created.load(Ordering::Relaxed),
        "disconnected": disconnected,
        "secs_to_all_joined": round3(to_joined.as_secs_f64()),
        "secs_to_all_ready": round3(to_ready.as_secs_f64()),
        "daemon_cpu_pct": round3(cpu_pct),
        "daemon_rss_bytes": rss_now,
        "daemon_rss_max_bytes": rss_max,
        "daemon_rss_per_agent_bytes": rss_now / n,
        "daemon_heap_bytes": heap,
        "agents_cpu_pct": round3(own_pct),
        "agents_rss_bytes": own_rss,
        "frames_per_s": round3(frames_per_s),
        "status_ms": round3(status_ms),
        "metrics_ms": round3(metrics_ms),
        "secs": round3(elapsed.as_secs_f64()),
        "load": [load_before, load_after],
        "flood": flood,
        "freeze": frozen,
    }))
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Holds `count` unauthenticated connections on the swarm protocol (from
/// up to 64 keys), each announcing a 64 MiB frame, while `status` is
/// timed; then lets them go.
async fn flood_while_joined(
    client: &Client,
    addr: swactor_engine::iroh::EndpointAddr,
    count: u32,
) -> Result<serde_json::Value> {
    let started = Instant::now();
    // The flood comes from elsewhere: its own thread, runtime and lower
    // priority, so its handshakes do not hold up the simulated agents'
    // heartbeats in this process (they would on machines of their own).
    let (done, flooded) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
        let outcome = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(flood(addr, count)));
        let _ = done.send(outcome);
    });
    let mut times = Vec::new();
    for _ in 0..5 {
        match timed_status(client).await {
            Ok((_, took)) => times.push(took),
            Err(e) => eprintln!("bench: status during the flood: {e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (made, held) = flooded.await.context("the flood's thread ended")??;
    let answered = times.len();
    let status_ms = median_ms(times);
    eprintln!(
        "bench: flood of {count} connections ({made} made, {held} still held a second later) in \
         {:.1} s; status answered {answered} of 5 times, {status_ms:.1} ms (median)",
        started.elapsed().as_secs_f64()
    );
    // Let the daemon settle before the agents' states are read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    Ok(json!({
        "connections": count,
        "made": made,
        "held": held,
        "status_answered": answered,
        "status_ms": round3(status_ms),
    }))
}

/// `count` connections on the swarm protocol from up to 64 keys, 512 at a
/// time, each announcing a 64 MiB frame and held; how many were made, and
/// how many the daemon still held a second after the last.
async fn flood(addr: swactor_engine::iroh::EndpointAddr, count: u32) -> Result<(usize, usize)> {
    use futures_util::StreamExt as _;
    use swactor_engine::iroh::SecretKey;
    use swactor_engine::net::{ALPN_SWARM, NetConfig, bind_endpoint, connect};
    let keys = count.clamp(1, 64) as usize;
    let mut endpoints = Vec::with_capacity(keys);
    for _ in 0..keys {
        endpoints.push(bind_endpoint(&NetConfig::default(), SecretKey::generate()).await?);
    }
    let conns: Vec<_> = futures_util::stream::iter(0..count as usize)
        .map(|i| {
            let ep = &endpoints[i % keys];
            let addr = addr.clone();
            async move {
                // Many are refused at once (the handshakes in flight and
                // each key's connections are capped): that is the point too.
                let conn = connect(ep, addr, ALPN_SWARM, Duration::from_secs(5))
                    .await
                    .ok()?;
                let (mut send, recv) = conn.open_bi().await.ok()?;
                send.write_all(&(64u32 << 20).to_be_bytes()).await.ok()?;
                Some((conn, send, recv))
            }
        })
        .buffer_unordered(512)
        .collect()
        .await;
    let made = conns.iter().filter(|h| h.is_some()).count();
    // Within its first-frame deadline the daemon closes what is over its
    // caps or too big: what it still holds a second later is what a
    // stranger can keep.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = conns
        .iter()
        .flatten()
        .filter(|(conn, _, _)| conn.close_reason().is_none())
        .count();
    drop(conns);
    for ep in endpoints {
        let _ = tokio::time::timeout(Duration::from_secs(2), ep.close()).await;
    }
    Ok((made, held))
}

/// Freezes the agent of the first ready node and times what the daemon
/// shows: disconnected, then replaced (its slot ready on a new attempt).
async fn freeze_one(
    swarm: &Swarm,
    snap: &ClusterSnapshot,
    seen: &Mutex<Seen>,
) -> Result<serde_json::Value> {
    let Some(victim) = snap.nodes.iter().find(|s| s.ready) else {
        bail!("no ready node to freeze");
    };
    let key = ResourceKey {
        run_id: swactor_provisioning::RunId::new(snap.run_id.clone()),
        node: victim.node,
        attempt: victim.attempt,
    };
    lock(seen).away.remove(&victim.node);
    let frozen_at = Instant::now();
    if !swarm.freeze(&key) {
        bail!("the bench runs no agent for {key}");
    }
    let patience = Duration::from_secs(120);
    let mut away = None;
    let mut replaced = None;
    while replaced.is_none() {
        if frozen_at.elapsed() > patience {
            bail!("{key}'s frozen agent was not replaced within {patience:?}");
        }
        {
            let seen = lock(seen);
            away = away.or_else(|| seen.away.get(&victim.node).copied());
            if let Some((attempt, at)) = seen.ready.get(&victim.node)
                && *attempt != victim.attempt
            {
                replaced = Some(*at);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = |at: Option<Instant>| {
        at.map(|at| round3(at.saturating_duration_since(frozen_at).as_secs_f64()))
    };
    eprintln!(
        "bench: froze {key}: shown disconnected after {:?} s, replaced (ready again) after {:?} s",
        secs(away),
        secs(replaced)
    );
    Ok(json!({
        "node": victim.node.to_string(),
        "disconnected_s": secs(away),
        "replaced_s": secs(replaced),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_names_the_sim_provider_and_the_grace() {
        // Only a daemon that brings the `sim` provider takes this shape
        // (the bench's own, `bench swarm-daemon`); its fields are read here.
        let file: crate::shapefile::ShapeFile = toml::from_str(&shape(12, Some(3.0))).unwrap();
        assert_eq!(file.run.as_deref(), Some("bench"));
        let group = &file.groups[0];
        assert_eq!((group.id.as_str(), group.count), ("sim", 12));
        assert_eq!(group.provider, sim::KIND);
        assert_eq!(group.lost_grace_s, Some(3.0));
        let default: crate::shapefile::ShapeFile = toml::from_str(&shape(1, None)).unwrap();
        assert_eq!(default.groups[0].lost_grace_s, None);
    }
}
