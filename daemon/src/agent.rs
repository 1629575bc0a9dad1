//! `swactor agent`: the node agent a provider starts on each machine.
//!
//! It reports its bootstrap stages as `@swactor …` lines on stdout (which the
//! provider follows), runs the group's boot check, joins the daemon's swarm
//! over iroh with a token bound to its (run, node, attempt), reports
//! convergence, and then stays connected, sending heartbeats, so the daemon
//! sees it alive. If the connection drops it rejoins; a refused join (its
//! attempt was superseded) ends it. Once welcomed, the same connection is
//! its jobs link: it serves the job requests the daemon opens on it
//! ([`crate::jobs::agent`]), so the agent holds one connection to its
//! daemon, and a rejoin brings both back. When several daemons take turns
//! leading the run, they share the ticket's identity and each tells the
//! agent where all of them listen (`DialSet`), so a rejoin finds whichever
//! leads now.
//!
//! It also holds its node on a lease ([`Lease`]): the daemon renews it while
//! it hears the agent, and an agent whose lease has not been renewed for
//! its group's `orphan_after_s`, on its own clock, takes its daemon for
//! gone for good and ends its node by itself (it exits, and its job runs
//! with it), so no machine runs on, or bills, for a controller that is not
//! coming back.

use crate::jobs::agent::AgentJobs;
use crate::protocol::{
    FRAME_LEN_MAX, Heartbeat, JoinReply, JoinRequest, REPLICAS_MAX, Renewal,
    SWARM_REPLY_LEN_MAX_BYTES,
};
use anyhow::{Context, Result};
use futures_util::StreamExt as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::{Endpoint, EndpointAddr, TransportAddr};
use swactor_engine::net::{
    ALPN_SWARM, EndpointTicket, NetConfig, bind_endpoint, connect, recv_frame, send_frame,
};
use swactor_providers::credentials::AgentCredentials;
use swactor_providers::process::format_agent_line;
use swactor_provisioning::{
    BootstrapEvent, BootstrapStage, LogicalNodeId, NodeAttemptId, ResourceKey, RunId,
};
use tokio::time::Instant;

/// How long the agent's connection to its daemon may hear nothing before it
/// is taken for dead and the agent dials again.
pub(crate) const AGENT_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Options of `swactor agent`.
#[derive(Debug, clap::Args)]
pub struct AgentOptions {
    /// The run.
    #[arg(long)]
    pub run: String,
    /// The node (slot) this agent serves.
    #[arg(long)]
    pub node: String,
    /// The attempt it was started for.
    #[arg(long)]
    pub attempt: u64,
    /// The daemon's ticket.
    #[arg(long)]
    pub daemon: String,
    /// A file holding this (run, node, attempt)'s join token and key, readable
    /// by its owner only; the agent reads it and removes it.
    #[arg(long)]
    pub credentials: PathBuf,
    /// The node directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// One argument of the boot check command (repeat, in order; any value,
    /// including one starting with `-`: write `--boot-check=-c`).
    #[arg(long = "boot-check", allow_hyphen_values = true)]
    pub boot_check: Vec<String>,
    /// Seconds the boot check may run before it is stopped and the attempt fails.
    #[arg(long, default_value_t = 300.0)]
    pub boot_timeout_s: f64,
    /// On a Vast.ai instance: the service URL the agent destroys its own
    /// instance through, with the instance's own key, if its lease lapses.
    #[arg(long)]
    pub vast_url: Option<String>,
    /// On a Vast.ai instance: where the create's `onstart` copied the
    /// instance's id and own key (a relative path is taken from `$HOME`);
    /// `CONTAINER_ID` and `CONTAINER_API_KEY` in the environment come first.
    #[arg(long, default_value = swactor_providers::vast::INSTANCE_FILE)]
    pub vast_instance_file: PathBuf,
}

fn report(event: &BootstrapEvent) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", format_agent_line(event));
    let _ = out.flush();
}

fn fail(stage: BootstrapStage, reason: String) -> i32 {
    report(&BootstrapEvent::Failed { stage, reason });
    1
}

/// Where the agent's endpoint binds, given the daemon's address: loopback
/// when the daemon is on this machine's loopback, otherwise every interface
/// of the daemon's address family (a socket bound to 127.0.0.1 cannot send
/// to another machine).
fn bind_addr_for(daemon: &EndpointAddr) -> SocketAddr {
    let ips: Vec<IpAddr> = daemon.ip_addrs().map(SocketAddr::ip).collect();
    let v4 = ips.iter().any(IpAddr::is_ipv4) || ips.is_empty();
    let ip = match (ips.iter().all(IpAddr::is_loopback) && !ips.is_empty(), v4) {
        (true, true) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        (true, false) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        (false, true) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        (false, false) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    SocketAddr::new(ip, 0)
}

/// Runs the agent. Returns the exit code.
///
/// # Errors
/// Only for errors that happen before the agent can report anything.
pub async fn run(opts: AgentOptions) -> Result<i32> {
    let node = LogicalNodeId::parse(&opts.node).context("--node is not a valid node id")?;
    let key = ResourceKey {
        run_id: RunId::new(opts.run.clone()),
        node,
        attempt: NodeAttemptId(opts.attempt),
    };
    // No `SshConnect`: whatever brought this agent to its machine (a local
    // spawn, a container, an SSH session) is done by now, and most involve
    // no SSH at all. The first stage an agent reports is its own first step.
    report(&BootstrapEvent::Stage(BootstrapStage::BootCheck));
    if !opts.boot_check.is_empty()
        && let Err(reason) = boot_check(&opts.boot_check, opts.boot_timeout_s).await
    {
        return Ok(fail(BootstrapStage::BootCheckFailed, reason));
    }

    report(&BootstrapEvent::Stage(BootstrapStage::SwactorStart));
    let (ticket, credentials, endpoint) = match bind_for_daemon(&opts).await {
        Ok(bound) => bound,
        Err(code) => return Ok(code),
    };

    report(&BootstrapEvent::Stage(BootstrapStage::Join));
    let join = JoinRequest::new(&key, credentials.token.clone());
    // The run's daemons as this attempt last heard of them: an agent
    // started again (its container restarted, say) dials the daemon that
    // leads now, not only the one its command line names.
    let daemons = DialSet::new(ticket.addr()).remembered_in(DAEMONS_FILE);
    let jobs = AgentJobs::new(&opts.dir, opts.node.clone(), opts.attempt);
    // From here on SIGTERM is caught (tokio keeps the handler for the life
    // of the process), so it must be listened for in every wait below: in a
    // session, and between sessions while the daemon is away.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    let lease = Lease::default();
    let frames = AtomicU64::new(0);
    let unpaused = AtomicBool::new(false);
    let agent = Agent {
        endpoint: &endpoint,
        daemons: &daemons,
        join: &join,
        jobs: &jobs,
        lease: &lease,
        announce: &|| {
            report(&BootstrapEvent::SwactorJoined);
            report(&BootstrapEvent::Stage(BootstrapStage::Converged));
        },
        frames: &frames,
        beats_paused: &unpaused,
    };
    let code = tokio::select! {
        ended = stay_joined(&agent, &mut term) => match ended {
            Ended::Stopped => 0,
            Ended::Failed(stage, reason) => fail(stage, reason),
        },
        window = lease.lapsed(|| jobs.running()) => {
            let code = orphaned(&key, window);
            end_own_instance(&opts).await;
            code
        }
    };
    // A close waits for connections to finish closing, and a dial still
    // pending to a daemon that is gone would hold it for seconds: a
    // stopping agent does not wait that long.
    let _ = tokio::time::timeout(Duration::from_millis(300), endpoint.close()).await;
    Ok(code)
}

/// A simulated agent, for `swactor bench swarm`: what a real agent does
/// once its boot check passed (its endpoint with the attempt's own key, the
/// key-bound join, heartbeats, renewals, rejoins, and the job requests its
/// daemon opens on its connection), in the caller's process, without
/// stdout reports or a lease that ends it.
#[derive(Debug)]
pub struct Simulated {
    /// The attempt it serves.
    pub key: ResourceKey,
    /// The daemon's ticket.
    pub ticket: String,
    /// The attempt's join token and key.
    pub credentials: AgentCredentials,
    /// Its node directory (job workspaces; none is made until a job runs).
    pub dir: PathBuf,
    /// While set, it sends no heartbeat: frozen, as the daemon sees it.
    pub frozen: Arc<AtomicBool>,
}

/// Runs a simulated agent until `stop` says so or its join is refused for
/// good; `joined` is called at its first join, `frames` counts the frames
/// it sends and receives once joined.
///
/// # Errors
/// Why it ended by itself, in words.
pub async fn simulate(
    agent: Simulated,
    frames: &AtomicU64,
    joined: &(dyn Fn() + Sync),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let ticket: EndpointTicket = agent
        .ticket
        .parse()
        .map_err(|e| format!("bad daemon ticket: {e}"))?;
    let endpoint = bind_endpoint(&net_config(&ticket), agent.credentials.iroh_key())
        .await
        .map_err(|e| format!("cannot bind: {e}"))?;
    let join = JoinRequest::new(&agent.key, agent.credentials.token.clone());
    let daemons = DialSet::new(ticket.addr());
    let jobs = AgentJobs::new(&agent.dir, agent.key.node.to_string(), agent.key.attempt.0);
    let lease = Lease::default();
    let ended = stay_joined(
        &Agent {
            endpoint: &endpoint,
            daemons: &daemons,
            join: &join,
            jobs: &jobs,
            lease: &lease,
            announce: joined,
            frames,
            beats_paused: &agent.frozen,
        },
        &mut stop,
    )
    .await;
    let _ = tokio::time::timeout(Duration::from_millis(300), endpoint.close()).await;
    match ended {
        Ended::Stopped => Ok(()),
        Ended::Failed(stage, reason) => Err(format!("{stage:?}: {reason}")),
    }
}

/// Reads the daemon's ticket and this attempt's credentials, and binds the
/// agent's endpoint with its key. `Err` is the exit code, its failure
/// reported.
async fn bind_for_daemon(
    opts: &AgentOptions,
) -> Result<(EndpointTicket, AgentCredentials, Endpoint), i32> {
    let ticket: EndpointTicket = match opts.daemon.parse() {
        Ok(t) => t,
        Err(e) => {
            return Err(fail(
                BootstrapStage::SwactorStartFailed,
                format!("bad daemon ticket: {e}"),
            ));
        }
    };
    // The key the daemon expects this attempt's agent to connect with, and
    // the join token; kept in memory only from here on.
    let credentials = match AgentCredentials::take_file(&opts.credentials) {
        Ok(c) => c,
        Err(e) => {
            return Err(fail(
                BootstrapStage::SwactorStartFailed,
                format!("cannot take the agent's credentials: {e}"),
            ));
        }
    };
    let secret = credentials.iroh_key();
    let endpoint = match bind_endpoint(&net_config(&ticket), secret).await {
        Ok(ep) => ep,
        Err(e) => {
            return Err(fail(
                BootstrapStage::SwactorStartFailed,
                format!("cannot bind: {e}"),
            ));
        }
    };
    Ok((ticket, credentials, endpoint))
}

/// How an agent's endpoint is bound to dial the daemon `ticket` names.
fn net_config(ticket: &EndpointTicket) -> NetConfig {
    NetConfig {
        bind_addr: bind_addr_for(ticket.addr()),
        frame_len_max: FRAME_LEN_MAX,
        // A daemon that died is noticed within seconds, so the agent
        // finds its successor well within the rejoin window.
        idle_timeout: Some(AGENT_IDLE_TIMEOUT),
        ..NetConfig::default()
    }
}

/// What ends an agent from outside: SIGTERM for a real one, the bench's
/// word for a simulated one.
pub(crate) trait Stop {
    /// Resolves once the agent is to stop.
    fn stopped(&mut self) -> impl Future<Output = ()> + Send;
}

impl Stop for tokio::signal::unix::Signal {
    async fn stopped(&mut self) {
        let _ = self.recv().await;
    }
}

impl Stop for tokio::sync::watch::Receiver<bool> {
    async fn stopped(&mut self) {
        // A sender gone is a stop too.
        let _ = self.wait_for(|stop| *stop).await;
    }
}

/// What an agent's sessions share: where it dials, what it joins with, and
/// what it does once joined.
struct Agent<'a> {
    endpoint: &'a Endpoint,
    daemons: &'a DialSet,
    join: &'a JoinRequest,
    /// Serves the job requests the daemon opens on a welcomed session.
    jobs: &'a AgentJobs,
    lease: &'a Lease,
    /// Says the first join (a real agent on stdout, for its provider).
    announce: &'a (dyn Fn() + Sync),
    /// Frames sent and received since it joined (heartbeats, renewals).
    frames: &'a AtomicU64,
    /// While set, no heartbeat goes out (a simulated agent frozen by its
    /// bench); a real agent never sets it.
    beats_paused: &'a AtomicBool,
}

/// How an agent's sessions ended: stopped (the exit code), or failed at a
/// stage, in words.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Stopped,
    Failed(BootstrapStage, String),
}

/// Keeps the agent joined, one session after another, until its join is
/// refused, the daemon stays out of reach before the first join, or `stop`.
async fn stay_joined(agent: &Agent<'_>, stop: &mut impl Stop) -> Ended {
    let mut joined_once = false;
    let mut failures = 0u32;
    loop {
        let joined = Joined {
            once: &mut joined_once,
            jobs: agent.jobs,
            lease: agent.lease,
            announce: agent.announce,
            frames: agent.frames,
            beats_paused: agent.beats_paused,
        };
        let outcome = tokio::select! {
            outcome = session(agent.endpoint, agent.daemons, agent.join, joined) => outcome,
            () = stop.stopped() => Session::Stopped,
        };
        let was_joined = matches!(outcome, Session::Dropped(_));
        match outcome {
            Session::Refused(reason) => {
                let stage = if joined_once {
                    BootstrapStage::AgentLost
                } else {
                    BootstrapStage::JoinFailed
                };
                break Ended::Failed(stage, format!("the daemon refused the join: {reason}"));
            }
            Session::NotYet(reason) => {
                // The daemon answered: it is there, just not ready for this
                // join (it is reading its journal, or restarting its
                // cluster). Ask again soon, for as long as it says so.
                // A daemon that answers is not gone for good: a lease it
                // gave holds while it adopts, however long its listing
                // takes. Only a welcome ever starts one.
                if agent.lease.held().is_some() {
                    agent.lease.renew(None);
                }
                tracing::info!(%reason, "the daemon deferred the join; asking again");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(200)) => {}
                    () = stop.stopped() => break Ended::Stopped,
                }
            }
            Session::Lost(reason) | Session::Dropped(reason) => {
                if was_joined {
                    // A daemon that restarts is dialled again after the
                    // shortest pause, however many restarts came before.
                    failures = 0;
                }
                failures += 1;
                // Before the first join, give up after about a minute so the
                // daemon sees a join failure instead of a silent stall.
                if !joined_once && failures > 30 {
                    break Ended::Failed(
                        BootstrapStage::JoinFailed,
                        format!("cannot reach the daemon: {reason}"),
                    );
                }
                tracing::info!(%reason, "connection to the daemon lost; rejoining");
                let pause = Duration::from_millis(200 * u64::from(failures.min(5)));
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = stop.stopped() => break Ended::Stopped,
                }
            }
            Session::Stopped => break Ended::Stopped,
        }
    }
}

#[derive(Debug)]
enum Session {
    Refused(String),
    NotYet(String),
    /// No join: the daemon could not be reached, or the link failed
    /// before it answered.
    Lost(String),
    /// The link failed after a welcome.
    Dropped(String),
    Stopped,
}

/// What a session does once joined: says so the first time, keeps the
/// lease, serves the daemon's job requests, and counts its frames.
struct Joined<'a> {
    once: &'a mut bool,
    jobs: &'a AgentJobs,
    lease: &'a Lease,
    announce: &'a (dyn Fn() + Sync),
    frames: &'a AtomicU64,
    beats_paused: &'a AtomicBool,
}

/// One session with whichever of `daemons` answers: a join, then
/// heartbeats, and the job requests the daemon opens on the same
/// connection, until the link is lost. A welcome and a renewal may name the
/// run's daemons anew, for the next dial.
async fn session(
    endpoint: &Endpoint,
    daemons: &DialSet,
    join: &JoinRequest,
    joined: Joined<'_>,
) -> Session {
    let conn = match connect(endpoint, daemons.addr(), ALPN_SWARM, Duration::from_secs(5)).await {
        Ok(c) => c,
        Err(e) => return Session::Lost(e.to_string()),
    };
    let ended = joined_on(&conn, endpoint, daemons, join, joined).await;
    // A job request still served on it (a log followed, a shell) holds the
    // connection open: closed, so it ends with the session, as the daemon
    // takes its jobs link down with it.
    conn.close(0u32.into(), b"session ended");
    ended
}

/// [`session`] on its connection `conn`.
async fn joined_on(
    conn: &Connection,
    endpoint: &Endpoint,
    daemons: &DialSet,
    join: &JoinRequest,
    joined: Joined<'_>,
) -> Session {
    let (mut send, mut recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return Session::Lost(e.to_string()),
    };
    // The connection carries job data too (logs, outputs): heartbeats go
    // out ahead of whatever of it is waiting, so a busy link is not taken
    // for a silent agent.
    let _ = send.set_priority(1);
    if let Err(e) = send_frame(&mut send, join, FRAME_LEN_MAX).await {
        return Session::Lost(e.to_string());
    }
    // The daemon says how often it wants to hear from this agent (a
    // fraction of the group's grace); never busier than every 50 ms.
    let heartbeat = match recv_frame::<JoinReply, _>(&mut recv, SWARM_REPLY_LEN_MAX_BYTES).await {
        Ok(Some(JoinReply::Welcome {
            heartbeat_ms,
            lease_ms,
            lease_waits_for_jobs,
            replicas,
        })) => {
            daemons.replace(&replicas);
            joined.lease.renew(Some((
                Duration::from_millis(lease_ms),
                lease_waits_for_jobs,
            )));
            Duration::from_millis(heartbeat_ms.max(50))
        }
        Ok(Some(JoinReply::Refused(reason))) => return Session::Refused(reason),
        Ok(Some(JoinReply::NotYet(reason))) => return Session::NotYet(reason),
        Ok(None) => return Session::Lost("the daemon closed the stream".to_owned()),
        Err(e) => return Session::Lost(e.to_string()),
    };
    if !*joined.once {
        *joined.once = true;
        (joined.announce)();
    }
    // The daemon's renewals come back on the stream the heartbeats go out
    // on; a frame half read when a heartbeat is due stays in the stream.
    let renewals = futures_util::stream::unfold(recv, |mut recv| async move {
        let frame = recv_frame::<Renewal, _>(&mut recv, SWARM_REPLY_LEN_MAX_BYTES).await;
        Some((frame, recv))
    });
    tokio::pin!(renewals);
    let mut n = 0u64;
    let mut beat_at = Instant::now() + heartbeat;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(beat_at) => {
                beat_at += heartbeat;
                if joined.beats_paused.load(Ordering::Relaxed) {
                    continue;
                }
                n += 1;
                if let Err(e) = send_frame(&mut send, &Heartbeat(n), FRAME_LEN_MAX).await {
                    return Session::Dropped(e.to_string());
                }
                joined.frames.fetch_add(1, Ordering::Relaxed);
            }
            frame = renewals.next() => match frame {
                Some(Ok(Some(Renewal { replicas, .. }))) => {
                    joined.frames.fetch_add(1, Ordering::Relaxed);
                    joined.lease.renew(None);
                    if let Some(replicas) = replicas {
                        daemons.replace(&replicas);
                    }
                }
                Some(Ok(None)) | None => {
                    return Session::Dropped("the daemon closed the stream".to_owned());
                }
                Some(Err(e)) => return Session::Dropped(e.to_string()),
            },
            // The jobs link: the daemon opens a stream per request once it
            // welcomed the join (this agent opens none after its join).
            accepted = conn.accept_bi() => match accepted {
                Ok((send, recv)) => {
                    joined.jobs.spawn_request(send, recv, (endpoint.clone(), daemons.addr()));
                }
                Err(e) => return Session::Dropped(e.to_string()),
            },
        }
    }
}

/// Where the agent dials its daemon: the ticket's identity with every
/// address of the ticket, and those of the run's daemons the latest welcome
/// or renewal named (all of them answer to the ticket's identity, and only
/// the one leading listens, so iroh's dial finds it). Shared by the swarm
/// sessions and the blob transfers a job request makes; a new list
/// replaces the one before, and the ticket's own addresses are always kept.
#[derive(Clone, Debug)]
pub(crate) struct DialSet {
    ticket: EndpointAddr,
    now: Arc<Mutex<EndpointAddr>>,
    /// Where the last list is kept for a later start of this agent.
    file: Option<std::path::PathBuf>,
}

/// The file, in the agent's working directory (one per attempt on every
/// provider), that keeps the run's daemons as the agent last heard of them.
const DAEMONS_FILE: &str = ".swactor-daemons";

impl DialSet {
    /// Just the ticket's addresses.
    pub(crate) fn new(ticket: &EndpointAddr) -> Self {
        Self {
            ticket: ticket.clone(),
            now: Arc::new(Mutex::new(ticket.clone())),
            file: None,
        }
    }

    /// Keeps every later list in `file` (relative to the working
    /// directory), and takes the list an earlier start of this agent kept
    /// there, if any. Best effort: a file that cannot be read or written
    /// leaves the ticket's addresses.
    pub(crate) fn remembered_in(mut self, file: impl Into<std::path::PathBuf>) -> Self {
        let file = file.into();
        if let Ok(text) = std::fs::read_to_string(&file) {
            let kept: Vec<SocketAddr> = text
                .lines()
                .take(REPLICAS_MAX)
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if !kept.is_empty() {
                self.replace(&kept);
            }
        }
        self.file = Some(file);
        self
    }

    /// The daemon's identity with every address to try.
    pub(crate) fn addr(&self) -> EndpointAddr {
        self.now
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Takes `replicas` for the run's daemons, in place of the list before:
    /// the first [`REPLICAS_MAX`] (a longer list is cut, with a warning),
    /// leaving out addresses nobody can be dialled at (an unspecified IP, or
    /// port 0).
    pub(crate) fn replace(&self, replicas: &[SocketAddr]) {
        if replicas.len() > REPLICAS_MAX {
            tracing::warn!(
                named = replicas.len(),
                kept = REPLICAS_MAX,
                "the daemon named more daemons of the run than an agent keeps; the rest are ignored"
            );
        }
        let dialable = replicas
            .iter()
            .take(REPLICAS_MAX)
            .filter(|a| !a.ip().is_unspecified() && a.port() != 0)
            .map(|a| TransportAddr::Ip(*a));
        let addr = self.ticket.clone().with_addrs(dialable);
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        if *now != addr {
            tracing::info!(daemons = ?addr.ip_addrs().collect::<Vec<_>>(), "the run's daemons changed");
            *now = addr;
            if let Some(file) = &self.file {
                let text: String = replicas
                    .iter()
                    .take(REPLICAS_MAX)
                    .map(|a| format!("{a}\n"))
                    .collect();
                let tmp = file.with_extension("tmp");
                let kept = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, file));
                if let Err(e) = kept {
                    tracing::debug!(%e, "cannot keep the run's daemons for a later start");
                }
            }
        }
    }
}

/// The agent's hold on its node: when its daemon last renewed it, for how
/// long a renewal holds (a zero window holds for ever), and whether a job
/// the node runs holds it too; `None` until the first join. The time is
/// the agent's own monotonic clock: nothing the daemon's clock says
/// shortens it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Lease(Arc<Mutex<Option<Held>>>);

#[derive(Clone, Copy, Debug)]
struct Held {
    renewed: Instant,
    window: Duration,
    waits_for_jobs: bool,
}

impl Lease {
    /// The daemon renewed it now, on `terms` (its window, and whether it
    /// waits for jobs; `None`: the terms it had).
    fn renew(&self, terms: Option<(Duration, bool)>) {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (window, waits_for_jobs) = terms
            .or(held.map(|h| (h.window, h.waits_for_jobs)))
            .unwrap_or((Duration::ZERO, false));
        *held = Some(Held {
            renewed: Instant::now(),
            window,
            waits_for_jobs,
        });
    }

    /// When it lapses unless renewed; `None` while it holds for ever.
    fn ends_at(&self) -> Option<Instant> {
        let held = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        held.filter(|h| !h.window.is_zero())
            .map(|h| h.renewed + h.window)
    }

    fn held(&self) -> Option<Held> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Returns, with its window, once it has lapsed; looks again at least
    /// every second, so a renewal (or a first join) is always seen. While
    /// `busy` (a job runs) and the lease waits for jobs, it counts as
    /// renewed: it then lapses a whole window after the last job ended.
    async fn lapsed(&self, busy: impl Fn() -> bool) -> Duration {
        loop {
            let now = Instant::now();
            if self.held().is_some_and(|h| h.waits_for_jobs) && busy() {
                self.renew(None);
            }
            match self.ends_at() {
                Some(at) if at <= now => {
                    return self.held().map_or(Duration::ZERO, |h| h.window);
                }
                Some(at) => tokio::time::sleep_until(at.min(now + LEASE_LOOK_EVERY)).await,
                None => tokio::time::sleep(LEASE_LOOK_EVERY).await,
            }
        }
    }
}

/// How often a lease with no deadline yet is looked at again.
const LEASE_LOOK_EVERY: Duration = Duration::from_secs(1);

/// The exit code of an agent that ended its node because its lease lapsed.
pub use swactor_providers::ORPHANED_EXIT;

/// Ends the node of an agent whose lease lapsed: it says why and exits
/// (the provider's machine, container or process ends with it, and so do
/// its job runs).
fn orphaned(key: &ResourceKey, window: Duration) -> i32 {
    tracing::warn!(
        %key,
        lease_s = window.as_secs(),
        "the daemon has not renewed this node's lease for its group's orphan_after_s; ending the node"
    );
    report(&BootstrapEvent::Stage(BootstrapStage::AgentLost));
    ORPHANED_EXIT
}

/// On a Vast.ai instance (`--vast-url` given), destroys the instance the
/// agent runs on with that instance's own key, so the rental stops billing
/// with no daemon left to stop it. Says what it did, or why it could not:
/// then the instance runs on until someone destroys it.
async fn end_own_instance(opts: &AgentOptions) {
    use swactor_providers::vast::OwnInstance;
    let Some(url) = &opts.vast_url else {
        return;
    };
    let file = match std::env::var_os("HOME") {
        Some(home) if opts.vast_instance_file.is_relative() => {
            PathBuf::from(home).join(&opts.vast_instance_file)
        }
        _ => opts.vast_instance_file.clone(),
    };
    let own = match OwnInstance::find(&file) {
        Ok(own) => own,
        Err(e) => {
            tracing::error!(
                "cannot destroy this instance: {e}; it runs (and bills) until someone destroys it"
            );
            return;
        }
    };
    match own.destroy(url).await {
        Ok(()) => tracing::warn!(
            instance = own.id,
            "destroyed this instance with its own key"
        ),
        Err(e) => tracing::error!(
            instance = own.id,
            "{e}; it runs (and bills) until someone destroys it"
        ),
    }
}

/// Runs the boot check `argv` for at most `timeout_s`; a check still running
/// then is killed. It stays in the agent's process group, so whatever it
/// started goes when the provider stops the group.
async fn boot_check(argv: &[String], timeout_s: f64) -> Result<(), String> {
    let cmd = shown_command(argv);
    let Some((program, args)) = argv.split_first() else {
        return Ok(());
    };
    let could_not_start = |e: std::io::Error| format!("boot check `{cmd}` could not start: {e}");
    // Its stdout and stderr are one pipe, so its lines are read in the order
    // it wrote them: two pipes, each read on its own, would interleave them
    // differently at every attempt.
    let (output, written) = std::io::pipe().map_err(could_not_start)?;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(written.try_clone().map_err(could_not_start)?)
        .stderr(written)
        .kill_on_drop(true)
        .spawn()
        .map_err(could_not_start)?;
    // The command is gone with this process's copies of the pipe's writing
    // end: the pipe ends once the check (and what it left behind) closes it.
    // Its output goes to the agent's log, and its last lines into the
    // reason of a failure.
    let mut lines = read_lines(output).map_err(could_not_start)?;
    let mut last = std::collections::VecDeque::new();
    let mut note = |line: String| {
        eprintln!("boot check: {line}");
        if last.len() == BOOT_CHECK_LINES_QUOTED {
            last.pop_front();
        }
        last.push_back(line.chars().take(300).collect::<String>());
    };
    let limit = tokio::time::sleep(Duration::from_secs_f64(timeout_s.clamp(0.001, 1e9)));
    tokio::pin!(limit);
    let mut open = true;
    let status = loop {
        tokio::select! {
            line = lines.recv(), if open => match line {
                Some(line) => note(line),
                None => open = false,
            },
            status = child.wait() => break status,
            () = &mut limit => {
                let _ = child.kill().await;
                return Err(format!(
                    "boot check `{cmd}` did not finish within its boot_timeout_s of {timeout_s} s and was stopped"
                ));
            }
        }
    };
    // What it wrote just before it exited; briefly, since a child it left
    // behind may hold the pipes open.
    let rest = async {
        while let Some(line) = lines.recv().await {
            note(line);
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(200), rest).await;
    let said = if last.is_empty() {
        String::new()
    } else {
        format!("; its last output: {}", Vec::from(last).join(" | "))
    };
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!(
            "boot check `{cmd}` {}{said}",
            swactor_providers::exit::of(&status).clause()
        )),
        Err(e) => Err(format!("boot check `{cmd}` could not be waited for: {e}")),
    }
}

/// Lines of a failed boot check's output quoted in the failure.
const BOOT_CHECK_LINES_QUOTED: usize = 5;
/// Bytes of a boot check's output read as one line at most (a longer line
/// is read as several).
const BOOT_CHECK_LINE_BYTES_MAX: u64 = 64 * 1024;

/// Reads `pipe` line by line on a thread of its own (a pipe read blocks),
/// handing each line on as it comes, until the pipe ends or nobody takes
/// the lines any more. Bytes that are not UTF-8 are shown as `�`.
fn read_lines(pipe: std::io::PipeReader) -> std::io::Result<tokio::sync::mpsc::Receiver<String>> {
    use std::io::{BufRead, Read};
    let (tx, rx) = tokio::sync::mpsc::channel::<String>(64);
    std::thread::Builder::new()
        .name("boot-check-output".to_owned())
        .spawn(move || {
            let mut pipe = std::io::BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match (&mut pipe)
                    .take(BOOT_CHECK_LINE_BYTES_MAX)
                    .read_until(b'\n', &mut line)
                {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']).to_owned();
                if tx.blocking_send(text).is_err() {
                    break;
                }
            }
        })?;
    Ok(rx)
}

/// `argv` as one line for messages, each argument quoted when it needs to be
/// and the whole cut to a readable length.
fn shown_command(argv: &[String]) -> String {
    const SHOWN_LEN_MAX: usize = 200;
    let line = argv
        .iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a.clone()
            } else {
                format!("{a:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    if line.chars().count() <= SHOWN_LEN_MAX {
        line
    } else {
        let cut: String = line.chars().take(SHOWN_LEN_MAX).collect();
        format!("{cut}…")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_engine::iroh::SecretKey;

    fn daemon_at(addrs: &[&str]) -> EndpointAddr {
        let id = SecretKey::from_bytes(&[7; 32]).public();
        addrs.iter().fold(EndpointAddr::new(id), |a, s| {
            a.with_ip_addr(s.parse().expect("a socket address"))
        })
    }

    #[tokio::test]
    async fn a_boot_checks_output_is_quoted_in_the_order_it_was_written() {
        let check: Vec<String> = [
            "sh",
            "-c",
            "for i in 1 2 3 4 5 6; do echo out$i; echo err$i >&2; done; exit 3",
        ]
        .map(str::to_owned)
        .to_vec();
        for _ in 0..10 {
            let reason = boot_check(&check, 30.0).await.unwrap_err();
            assert_eq!(
                reason,
                "boot check `sh -c \"for i in 1 2 3 4 5 6; do echo out$i; echo err$i >&2; done; \
                 exit 3\"` exited with code 3; its last output: err4 | out5 | err5 | out6 | err6"
            );
        }
    }

    #[tokio::test]
    async fn a_boot_check_killed_by_a_signal_says_which() {
        let check: Vec<String> = ["sh", "-c", "kill -TERM $$"].map(str::to_owned).to_vec();
        let reason = boot_check(&check, 30.0).await.unwrap_err();
        assert_eq!(
            reason,
            "boot check `sh -c \"kill -TERM $$\"` was killed by signal 15 (SIGTERM)"
        );
    }

    #[test]
    fn the_dial_set_keeps_the_tickets_addresses_and_only_the_latest_list_of_daemons() {
        let ticket = daemon_at(&["127.0.0.1:4000", "[::1]:4000"]);
        let daemons = DialSet::new(&ticket);
        assert_eq!(daemons.addr(), ticket);
        let with =
            |extra: &[SocketAddr]| extra.iter().fold(ticket.clone(), |a, s| a.with_ip_addr(*s));
        let at = |s: &str| -> SocketAddr { s.parse().unwrap() };
        // Merged with the ticket's, once each; nothing undialable.
        daemons.replace(&[
            at("127.0.0.2:4001"),
            at("127.0.0.1:4000"),
            at("0.0.0.0:4002"),
            at("[::]:4002"),
            at("127.0.0.3:0"),
        ]);
        assert_eq!(daemons.addr(), with(&[at("127.0.0.2:4001")]));
        // A list too long: its first sixteen.
        let many: Vec<SocketAddr> = (1..=20u8)
            .map(|i| SocketAddr::from(([127, 0, 1, i], 5000)))
            .collect();
        daemons.replace(&many);
        assert_eq!(daemons.addr(), with(&many[..REPLICAS_MAX]));
        assert_eq!(daemons.addr().ip_addrs().count(), 2 + REPLICAS_MAX);
        // A later list replaces the earlier one, never the ticket's; a
        // clone sees it too.
        let jobs = daemons.clone();
        daemons.replace(&[at("127.0.0.9:4009")]);
        assert_eq!(jobs.addr(), with(&[at("127.0.0.9:4009")]));
        daemons.replace(&[]);
        assert_eq!(jobs.addr(), ticket);
    }

    /// A daemon of the run while it leads: it welcomes any join naming
    /// `replicas`, answers the first heartbeat with a renewal naming `then`,
    /// and says on `events` that it welcomed an agent.
    #[derive(Debug, Clone)]
    struct Leader {
        name: &'static str,
        replicas: Vec<SocketAddr>,
        then: Option<Vec<SocketAddr>>,
        events: tokio::sync::mpsc::UnboundedSender<&'static str>,
    }

    impl Leader {
        async fn greet(&self, conn: &swactor_engine::iroh::endpoint::Connection) {
            let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                return;
            };
            let Ok(Some(_)) = recv_frame::<JoinRequest, _>(&mut recv, FRAME_LEN_MAX).await else {
                return;
            };
            let welcome = JoinReply::Welcome {
                heartbeat_ms: 50,
                lease_ms: 0,
                lease_waits_for_jobs: false,
                replicas: self.replicas.clone(),
            };
            if send_frame(&mut send, &welcome, SWARM_REPLY_LEN_MAX_BYTES)
                .await
                .is_err()
            {
                return;
            }
            let _ = self.events.send(self.name);
            let mut renewed = false;
            while let Ok(Some(Heartbeat(n))) = recv_frame::<Heartbeat, _>(&mut recv, 64).await {
                if !std::mem::replace(&mut renewed, true) {
                    let renewal = Renewal {
                        heartbeat: n,
                        replicas: self.then.clone(),
                    };
                    let _ = send_frame(&mut send, &renewal, SWARM_REPLY_LEN_MAX_BYTES).await;
                }
            }
        }
    }

    /// A daemon of the run that is still adopting: every join it hears is
    /// told "not yet".
    async fn defer(conn: &swactor_engine::iroh::endpoint::Connection) {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let Ok(Some(_)) = recv_frame::<JoinRequest, _>(&mut recv, FRAME_LEN_MAX).await else {
                return;
            };
            let not_yet = JoinReply::NotYet("adopting".to_owned());
            let _ = send_frame(&mut send, &not_yet, SWARM_REPLY_LEN_MAX_BYTES).await;
            let _ = send.finish();
        }
    }

    #[tokio::test]
    async fn a_lease_holds_while_its_daemon_answers_not_yet_and_lapses_when_none_answers() {
        let run_key = SecretKey::generate();
        let config = NetConfig {
            bind_addr: "127.0.0.1:0".parse().unwrap(),
            ..NetConfig::default()
        };
        let daemon = bind_endpoint(&config, run_key.clone()).await.unwrap();
        daemon.set_alpns(vec![ALPN_SWARM.to_vec()]);
        let ep = daemon.clone();
        let serving = tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let Ok(accepting) = incoming.accept() else {
                    continue;
                };
                tokio::spawn(async move {
                    if let Ok(conn) = accepting.await {
                        defer(&conn).await;
                    }
                });
            }
        });
        let agent_ep = bind_endpoint(&NetConfig::default(), SecretKey::generate())
            .await
            .unwrap();
        let join = JoinRequest {
            key: crate::protocol::JoinKey {
                run_id: "r".to_owned(),
                node: "w-0".to_owned(),
                attempt: 1,
            },
            token: "t".to_owned(),
        };
        let dir = tempfile::tempdir().unwrap();
        let jobs = AgentJobs::new(dir.path(), "w-0".to_owned(), 1);
        let frames = AtomicU64::new(0);
        let unpaused = AtomicBool::new(false);
        let window = Duration::from_millis(600);
        let run = |daemons: DialSet, lease: Lease| {
            let (agent_ep, join, jobs) = (&agent_ep, &join, &jobs);
            let (frames, unpaused) = (&frames, &unpaused);
            async move {
                let agent = Agent {
                    endpoint: agent_ep,
                    daemons: &daemons,
                    join,
                    jobs,
                    lease: &lease,
                    announce: &|| {},
                    frames,
                    beats_paused: unpaused,
                };
                let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
                // Held from an earlier welcome, then twice its window with
                // the daemon deferring every join.
                lease.renew(Some((window, false)));
                let (ended, ()) = tokio::join!(stay_joined(&agent, &mut stop), async {
                    tokio::time::sleep(window * 2).await;
                    stop_tx.send_replace(true);
                });
                assert_eq!(ended, Ended::Stopped);
                lease.ends_at().expect("a lease with a window")
            }
        };

        let ends = run(DialSet::new(&daemon.addr()), Lease::default()).await;
        assert!(
            ends > Instant::now(),
            "a deferring daemon kept the lease: it ends {:?} from now",
            ends.saturating_duration_since(Instant::now())
        );
        // With nobody answering at that address, it lapses as it would.
        serving.abort();
        daemon.close().await;
        let ends = run(DialSet::new(&daemon.addr()), Lease::default()).await;
        assert!(ends <= Instant::now(), "nobody renewed it");
        agent_ep.close().await;
    }

    /// A leading daemon's endpoint and what serves it.
    struct Leading {
        endpoint: Endpoint,
        serving: tokio::task::JoinHandle<()>,
    }

    impl Leading {
        /// Binds a daemon of the run with its shared `key` at `at`, leading.
        async fn start(key: &SecretKey, at: SocketAddr, leader: Leader) -> Self {
            let config = NetConfig {
                bind_addr: at,
                ..NetConfig::default()
            };
            let endpoint = bind_endpoint(&config, key.clone()).await.unwrap();
            endpoint.set_alpns(vec![ALPN_SWARM.to_vec()]);
            let ep = endpoint.clone();
            // Each agent is greeted on a task of its own, which holds no
            // handle of the endpoint and outlives the accepting.
            let serving = tokio::spawn(async move {
                while let Some(incoming) = ep.accept().await {
                    let Ok(accepting) = incoming.accept() else {
                        continue;
                    };
                    let leader = leader.clone();
                    tokio::spawn(async move {
                        if let Ok(conn) = accepting.await {
                            leader.greet(&conn).await;
                        }
                    });
                }
            });
            Self { endpoint, serving }
        }

        /// Dies as a killed process does: nothing more is sent, not even a
        /// close, so its agents notice only by their idle timeout.
        async fn die(self) {
            self.serving.abort();
            let _ = self.serving.await;
            // The last handle of the endpoint: it aborts, before a stream
            // or a connection could be closed.
            drop(self.endpoint);
        }

        /// Stops as a daemon going down does: every connection is closed.
        async fn stop(self) {
            self.serving.abort();
            let _ = self.serving.await;
            self.endpoint.close().await;
        }
    }

    /// A loopback address nothing listens on (now).
    fn unused_loopback_addr() -> SocketAddr {
        std::net::UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .unwrap()
    }

    /// Two daemons of one run, one identity, each on its own loopback
    /// address, one leading at a time; the agent's ticket names only the
    /// first, which is killed. Every address dialled is loopback.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_rejoins_the_daemon_of_the_run_that_leads_after_its_own_died() {
        let run_key = SecretKey::generate();
        let (a_at, b_at, nobody) = (
            unused_loopback_addr(),
            unused_loopback_addr(),
            unused_loopback_addr(),
        );
        let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        // `a` leads, names `nobody` at first and then only the two of them.
        let a = Leading::start(
            &run_key,
            a_at,
            Leader {
                name: "a",
                replicas: vec![a_at, b_at, nobody],
                then: Some(vec![a_at, b_at]),
                events: events_tx.clone(),
            },
        )
        .await;
        let ticket = a.endpoint.addr();
        assert_eq!(ticket.ip_addrs().collect::<Vec<_>>(), [&a_at]);
        let daemons = DialSet::new(&ticket);
        let agent_config = NetConfig {
            idle_timeout: Some(AGENT_IDLE_TIMEOUT),
            ..NetConfig::default()
        };
        let agent = bind_endpoint(&agent_config, SecretKey::generate())
            .await
            .unwrap();
        let join = JoinRequest {
            key: crate::protocol::JoinKey {
                run_id: "r".to_owned(),
                node: "w-0".to_owned(),
                attempt: 1,
            },
            token: "t".to_owned(),
        };
        let dir = tempfile::tempdir().unwrap();
        let jobs = AgentJobs::new(dir.path(), "w-0".to_owned(), 1);
        let lease = Lease::default();
        let frames = AtomicU64::new(0);
        let unpaused = AtomicBool::new(false);
        let mut once = false;
        let both = EndpointAddr::new(run_key.public())
            .with_ip_addr(a_at)
            .with_ip_addr(b_at);
        let settled = |want: EndpointAddr| {
            let daemons = daemons.clone();
            async move {
                while daemons.addr() != want {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let limit = Duration::from_secs(20);

        // The agent joins `a` and learns of `b`; then `a` is killed.
        let joined = Joined {
            once: &mut once,
            jobs: &jobs,
            lease: &lease,
            announce: &|| {},
            frames: &frames,
            beats_paused: &unpaused,
        };
        let (first, ()) = tokio::join!(
            tokio::time::timeout(limit, session(&agent, &daemons, &join, joined)),
            async {
                assert_eq!(events.recv().await, Some("a"));
                tokio::time::timeout(limit, settled(both.clone()))
                    .await
                    .expect("a's renewal names the run's daemons anew");
                a.die().await;
            }
        );
        assert!(matches!(first, Ok(Session::Dropped(_))), "{first:?}");
        assert!(once, "joined");

        // `b` leads now, where `a` said it would be: the agent finds it.
        let b = Leading::start(
            &run_key,
            b_at,
            Leader {
                name: "b",
                replicas: vec![a_at, b_at],
                then: None,
                events: events_tx,
            },
        )
        .await;
        let joined = Joined {
            once: &mut once,
            jobs: &jobs,
            lease: &lease,
            announce: &|| {},
            frames: &frames,
            beats_paused: &unpaused,
        };
        let (second, ()) = tokio::join!(
            tokio::time::timeout(limit, session(&agent, &daemons, &join, joined)),
            async {
                let welcomed = tokio::time::timeout(limit, events.recv()).await;
                assert_eq!(welcomed, Ok(Some("b")));
                // Its renewals name nothing new: the list stays.
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert_eq!(daemons.addr(), both);
                b.stop().await;
            }
        );
        assert!(matches!(second, Ok(Session::Dropped(_))), "{second:?}");
        agent.close().await;
    }

    /// A daemon that welcomes every join on `swactor/swarm/0`, hands the
    /// test each welcomed connection, and counts every connection an agent
    /// opens to it: by protocol, and how many are open now. It serves
    /// `swactor/jobs/0` too, the jobs link agents dialled before it rode
    /// on the swarm connection, so such a dial would be counted, not
    /// refused.
    struct Counting {
        endpoint: Endpoint,
        serving: tokio::task::JoinHandle<()>,
        /// The protocol of every connection opened to it, in order.
        opened: Arc<Mutex<Vec<Vec<u8>>>>,
        /// Connections open now.
        open: Arc<AtomicU64>,
        welcomed: tokio::sync::mpsc::UnboundedReceiver<Connection>,
    }

    impl Counting {
        async fn start() -> Self {
            let config = NetConfig {
                bind_addr: "127.0.0.1:0".parse().unwrap(),
                ..NetConfig::default()
            };
            let endpoint = bind_endpoint(&config, SecretKey::generate()).await.unwrap();
            endpoint.set_alpns(vec![ALPN_SWARM.to_vec(), b"swactor/jobs/0".to_vec()]);
            let (opened, open) = (
                Arc::<Mutex<Vec<Vec<u8>>>>::default(),
                Arc::<AtomicU64>::default(),
            );
            let (tx, welcomed) = tokio::sync::mpsc::unbounded_channel();
            let (ep, o, n) = (endpoint.clone(), opened.clone(), open.clone());
            let serving = tokio::spawn(async move {
                while let Some(incoming) = ep.accept().await {
                    let Ok(accepting) = incoming.accept() else {
                        continue;
                    };
                    let (opened, open, tx) = (o.clone(), n.clone(), tx.clone());
                    tokio::spawn(async move {
                        let Ok(conn) = accepting.await else {
                            return;
                        };
                        opened.lock().unwrap().push(conn.alpn().to_vec());
                        open.fetch_add(1, Ordering::SeqCst);
                        if conn.alpn() == ALPN_SWARM
                            && let Ok((mut send, mut recv)) = conn.accept_bi().await
                            && let Ok(Some(_)) =
                                recv_frame::<JoinRequest, _>(&mut recv, FRAME_LEN_MAX).await
                        {
                            let welcome = JoinReply::Welcome {
                                heartbeat_ms: 50,
                                lease_ms: 0,
                                lease_waits_for_jobs: false,
                                replicas: Vec::new(),
                            };
                            if send_frame(&mut send, &welcome, SWARM_REPLY_LEN_MAX_BYTES)
                                .await
                                .is_ok()
                            {
                                let _ = tx.send(conn.clone());
                                // Heartbeats are read and dropped until the
                                // connection ends.
                                while let Ok(Some(Heartbeat(_))) =
                                    recv_frame::<Heartbeat, _>(&mut recv, 64).await
                                {
                                }
                            }
                        }
                        conn.closed().await;
                        open.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
            Self {
                endpoint,
                serving,
                opened,
                open,
                welcomed,
            }
        }

        fn opened(&self) -> Vec<Vec<u8>> {
            self.opened.lock().unwrap().clone()
        }

        /// Waits until exactly one connection is open.
        async fn one_open(&self) {
            let settled = async {
                while self.open.load(Ordering::SeqCst) != 1 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), settled)
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{} connections open, not one",
                        self.open.load(Ordering::SeqCst)
                    )
                });
        }
    }

    /// Asks the agent on `conn` for `request`, as a run actor does, and
    /// returns every frame of its answer.
    async fn ask(conn: &Connection, request: &crate::jobs::ToAgent) -> Vec<crate::jobs::FromAgent> {
        use crate::jobs::{FromAgent, JOBS_FRAME_LEN_MAX};
        let answer = async {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            send_frame(&mut send, request, JOBS_FRAME_LEN_MAX)
                .await
                .unwrap();
            let mut got = Vec::new();
            while let Some(frame) = recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX)
                .await
                .unwrap()
            {
                got.push(frame);
            }
            got
        };
        tokio::time::timeout(Duration::from_secs(20), answer)
            .await
            .expect("the agent answers")
    }

    /// Starts `job` on the agent on `conn` (it prints its name after a
    /// moment), checks that the agent holds `daemon`'s one connection
    /// while it runs, then follows it to its end.
    async fn run_job(daemon: &Counting, conn: &Connection, jobs: &AgentJobs, job: &str) {
        use crate::jobs::{ExitInfo, FromAgent, LogRecord, ToAgent};
        let start = ToAgent::Start {
            attempt: 1,
            job: job.to_owned(),
            manifest: Vec::new(),
            argv: ["sh", "-c", &format!("sleep 0.5; echo {job}")]
                .map(str::to_owned)
                .to_vec(),
            env: Vec::new(),
            setup: None,
        };
        assert_eq!(ask(conn, &start).await, [FromAgent::Started]);
        assert!(jobs.running(), "{job} runs");
        assert_eq!(daemon.open.load(Ordering::SeqCst), 1, "while {job} runs");
        let attach = ToAgent::Attach {
            attempt: 1,
            job: job.to_owned(),
            offset: 0,
        };
        let got = ask(conn, &attach).await;
        let mut log = Vec::new();
        for frame in &got {
            if let FromAgent::Log(bytes) = frame {
                log.extend_from_slice(bytes);
            }
        }
        let records = LogRecord::decode_all(&log).0;
        let printed: Vec<u8> = records.iter().flat_map(|r| r.data.clone()).collect();
        assert_eq!(printed, format!("{job}\n").into_bytes(), "{got:?}");
        assert_eq!(
            got.last(),
            Some(&FromAgent::Exit(ExitInfo {
                code: Some(0),
                signal: None
            }))
        );
    }

    /// Issue 35: an agent's jobs ride on its swarm connection. While a job
    /// runs, the agent holds exactly one connection to its daemon (it
    /// dials no `swactor/jobs/0` link), and after its connection is lost
    /// it rejoins on one new connection, on which the next job runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_holds_one_connection_which_carries_its_jobs_across_a_rejoin() {
        let mut daemon = Counting::start().await;
        let agent_config = NetConfig {
            idle_timeout: Some(AGENT_IDLE_TIMEOUT),
            ..NetConfig::default()
        };
        let agent_ep = bind_endpoint(&agent_config, SecretKey::generate())
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let jobs = AgentJobs::unwrapped(dir.path(), "w-0".to_owned(), 1);
        let join = JoinRequest {
            key: crate::protocol::JoinKey {
                run_id: "r".to_owned(),
                node: "w-0".to_owned(),
                attempt: 1,
            },
            token: "t".to_owned(),
        };
        let daemons = DialSet::new(&daemon.endpoint.addr());
        let lease = Lease::default();
        let frames = AtomicU64::new(0);
        let unpaused = AtomicBool::new(false);
        let agent = Agent {
            endpoint: &agent_ep,
            daemons: &daemons,
            join: &join,
            jobs: &jobs,
            lease: &lease,
            announce: &|| {},
            frames: &frames,
            beats_paused: &unpaused,
        };
        let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
        let limit = Duration::from_secs(20);
        let (ended, ()) = tokio::join!(stay_joined(&agent, &mut stop), async {
            let first = tokio::time::timeout(limit, daemon.welcomed.recv())
                .await
                .expect("the agent joins")
                .unwrap();
            run_job(&daemon, &first, &jobs, "job-1").await;

            // The daemon drops the session; the agent rejoins, and its
            // jobs come back with it.
            first.close(0u32.into(), b"gone");
            let second = tokio::time::timeout(limit, daemon.welcomed.recv())
                .await
                .expect("the agent rejoins")
                .unwrap();
            assert_ne!(first.stable_id(), second.stable_id());
            daemon.one_open().await;
            run_job(&daemon, &second, &jobs, "job-2").await;
            stop_tx.send_replace(true);
        });
        assert_eq!(ended, Ended::Stopped);
        // Two sessions, one after the other, and nothing else.
        assert_eq!(daemon.opened(), [ALPN_SWARM.to_vec(), ALPN_SWARM.to_vec()]);
        daemon.serving.abort();
        agent_ep.close().await;
        daemon.endpoint.close().await;
    }

    #[test]
    fn an_agent_started_again_dials_the_daemons_it_last_heard_of() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("daemons");
        let ticket = daemon_at(&["127.0.0.1:4000"]);
        let first = DialSet::new(&ticket).remembered_in(&file);
        assert_eq!(first.addr(), ticket);
        let other: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        first.replace(&["127.0.0.1:4000".parse().unwrap(), other]);
        // A later start of the same agent (same working directory).
        let again = DialSet::new(&ticket).remembered_in(&file);
        let addrs: Vec<SocketAddr> = again.addr().ip_addrs().copied().collect();
        assert!(addrs.contains(&other), "{addrs:?}");
        // A damaged file leaves the ticket's addresses.
        std::fs::write(&file, "not an address\n").unwrap();
        assert_eq!(DialSet::new(&ticket).remembered_in(&file).addr(), ticket);
    }

    #[test]
    fn an_agent_binds_loopback_only_for_a_daemon_on_loopback() {
        let ip = |addrs: &[&str]| bind_addr_for(&daemon_at(addrs)).ip().to_string();
        assert_eq!(ip(&["127.0.0.1:4000"]), "127.0.0.1");
        assert_eq!(ip(&["[::1]:4000"]), "::1");
        // A daemon on another machine: a loopback-bound socket could not reach it.
        assert_eq!(ip(&["10.0.0.1:4000"]), "0.0.0.0");
        assert_eq!(ip(&["[2001:db8::1]:4000"]), "::");
        assert_eq!(ip(&["127.0.0.1:4000", "10.0.0.1:4000"]), "0.0.0.0");
    }
}
