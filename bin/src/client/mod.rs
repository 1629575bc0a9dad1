//! The CLI side: `apply`, `plan`, `status`, `describe`, `watch` and `down`
//! talk to the running daemon; `validate` checks a shape offline.

use crate::guard;
use crate::protocol::{ControlRequest, ControlResponse, FRAME_LEN_MAX, PlanReport};
use crate::shapefile::{ShapeFile, capacity_refusal, offline_capacities};
use crate::state::{DaemonHolder, StateDir};
use crate::term::{Table, stdout_width};
use crate::words::{
    ago, bootstrap_words, clock, cut_long_words, effect_words, next_words, nodes, orphan_words,
    retry_cell, stage_word, state_cell, state_text, state_word,
};
use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_actors::{AgentLink, ClusterEvent, ClusterSnapshot, NodeDescription, NodeSummary};
use swactor_engine::iroh::Endpoint;
use swactor_engine::net::{
    ALPN_CONTROL, EndpointTicket, NetConfig, bind_endpoint, codes, connect, recv_frame, send_frame,
};
use swactor_engine::telemetry::{SubscribeError, TelemetryFrame, subscribe};
use swactor_provisioning::{LogicalNodeId, NextStep, Timestamp};

mod shape;
mod status;
mod watch;

pub(crate) use shape::{apply, down, pause, plan, replace, validate};
use status::status_headline;
pub(crate) use status::{describe, status};
pub(crate) use watch::watch;

/// How long a daemon that holds its state directory may take to answer a
/// dial. One that holds none is reported at once, without a dial. 1.5 s
/// was too short on a loaded 2-core machine (a busy daemon was reported as
/// not answering); a stopped daemon is reported after this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the CLI waits for its endpoint to close once it is done: its
/// connections were closed already (the daemon is told at once), so this
/// only lets the close reach a slow daemon before the process exits.
const CLOSE_WAIT_MAX: Duration = Duration::from_millis(100);
/// How long the CLI's connection may hear nothing from the daemon before it
/// is taken for lost (keep-alives go out at a third of it), so a daemon
/// killed under a `watch` is noticed even on another machine.
const CLI_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a daemon asked to reload its ticket or key is given.
const RELOAD_WAIT: Duration = Duration::from_millis(300);

/// Why a request failed.
enum Refusal {
    /// The daemon closed the connection: this CLI's key is not allowed.
    NotAuthorised,
    /// Anything else.
    Other(anyhow::Error),
}

/// Whether `conn` was closed by the daemon's allowlist.
fn closed_as_not_allowed(conn: &swactor_engine::iroh::endpoint::Connection) -> bool {
    use swactor_engine::iroh::endpoint::ConnectionError;
    matches!(
        conn.close_reason(),
        Some(ConnectionError::ApplicationClosed(close))
            if close.error_code == codes::CLOSE_NOT_ALLOWED
    )
}

fn refusal(conn: &swactor_engine::iroh::endpoint::Connection, e: anyhow::Error) -> Refusal {
    if closed_as_not_allowed(conn) {
        Refusal::NotAuthorised
    } else {
        Refusal::Other(e)
    }
}

/// Asks the daemon holding `state`'s lock to write its ticket again and
/// reload the CLI's key (SIGHUP). Returns its pid if it could be signalled:
/// only its own user (or root) can.
fn recover(state: &StateDir) -> Option<u32> {
    let pid = state.running_daemon()?.pid?;
    let target = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
    rustix::process::kill_process(target, rustix::process::Signal::HUP).ok()?;
    Some(pid)
}

/// Waits (briefly) for a daemon asked to write its ticket again.
async fn wait_for_ticket(state: &StateDir) -> Result<EndpointTicket> {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        match state.read_ticket() {
            Ok(t) => return Ok(t),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
/// How long `down` waits for the daemon to release its state directory.
const RELEASE_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often `down` checks whether it has.
const RELEASE_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// A CLI connection to its daemon.
pub(crate) struct Client {
    endpoint: Endpoint,
    ticket: EndpointTicket,
    root: String,
    state: StateDir,
    /// Whether the daemon runs on this directory (it has a lock file), so
    /// whether its lock tells if it still runs.
    local: bool,
    /// The pid of the daemon that held the directory when the client opened.
    pid: Option<u32>,
}

impl Client {
    pub(crate) async fn open(state_dir: &Path) -> Result<Self> {
        let state = StateDir::open(state_dir.to_path_buf())?;
        // A daemon running on this directory holds its lock; with no holder,
        // a ticket left behind is stale and dialing it would only time out.
        // A directory no daemon ever ran on may hold a ticket copied from
        // one that runs elsewhere: that one is dialed.
        let local = state.has_lock_file();
        let holder = {
            let state = state.clone();
            tokio::task::spawn_blocking(move || state.running_daemon())
                .await
                .context("checking for a running daemon")?
        };
        if local && holder.is_none() {
            bail!(
                "no daemon is running for {} (none holds its daemon.lock); start one with \
                 `swactor up`",
                state.root().display()
            );
        }
        let ticket = match state.read_ticket() {
            Ok(ticket) => ticket,
            // The ticket was lost while the daemon runs: ask it (the lock's
            // holder) to write it again. Only its own user may signal it.
            Err(e) => match recover(&state) {
                Some(pid) => wait_for_ticket(&state).await.with_context(|| {
                    format!("the daemon (pid {pid}) did not write its ticket again")
                })?,
                None => return Err(e),
            },
        };
        let config = NetConfig {
            frame_len_max: FRAME_LEN_MAX,
            idle_timeout: Some(CLI_IDLE_TIMEOUT),
            ..NetConfig::default()
        };
        let endpoint = bind_endpoint(&config, state.cli_key()?)
            .await
            .context("cannot bind the CLI's endpoint")?;
        Ok(Self {
            endpoint,
            ticket,
            root: state.root().display().to_string(),
            state,
            local,
            pid: holder.and_then(|h| h.pid),
        })
    }

    /// The cluster's events, a snapshot first, as `watch` follows them.
    pub(crate) async fn events(
        &self,
    ) -> Result<swactor_engine::telemetry::TelemetrySubscription<ClusterSnapshot, ClusterEvent>>
    {
        subscribe(
            &self.endpoint,
            self.ticket.addr().clone(),
            CONNECT_TIMEOUT,
            FRAME_LEN_MAX,
        )
        .await
        .map_err(|e| self.not_running(swactor_engine::error_chain(&e)))
    }

    /// Whether the daemon this client found still holds its directory
    /// (always true of a daemon elsewhere: its connection tells instead).
    async fn daemon_alive(&self) -> bool {
        if !self.local {
            return true;
        }
        let state = self.state.clone();
        let holder = tokio::task::spawn_blocking(move || state.running_daemon())
            .await
            .ok()
            .flatten();
        holder.is_some_and(|h| self.pid.is_none() || h.pid.is_none() || h.pid == self.pid)
    }

    fn not_running(&self, e: impl std::fmt::Display) -> anyhow::Error {
        let who = self.pid.map_or_else(
            || "the daemon".to_owned(),
            |pid| format!("the daemon (pid {pid})"),
        );
        if self.local {
            anyhow::anyhow!(
                "cannot reach {who} for {} ({e}); it holds the state directory but does not \
                 answer: it may be stopping, or stopped (SIGSTOP)",
                self.root
            )
        } else {
            anyhow::anyhow!(
                "cannot reach the daemon that {}/daemon.ticket names ({e}); it may have stopped",
                self.root
            )
        }
    }

    async fn request(&self, req: &ControlRequest) -> Result<ControlResponse> {
        match self.try_request(req).await {
            Err(Refusal::NotAuthorised) => {
                // This CLI's key is not the one the daemon allows (cli.key was
                // replaced or deleted). The daemon's own user may ask it to
                // reload the key; anyone else stays refused.
                let state = StateDir::open(PathBuf::from(&self.root))?;
                if recover(&state).is_some() {
                    tokio::time::sleep(RELOAD_WAIT).await;
                    if let Ok(answer) = self.try_request(req).await {
                        return Ok(answer);
                    }
                }
                Err(self.not_authorised())
            }
            Err(Refusal::Other(e)) => Err(e),
            Ok(answer) => Ok(answer),
        }
    }

    fn not_authorised(&self) -> anyhow::Error {
        anyhow::anyhow!(
            "not authorised: this CLI's key is not allowed by the daemon of {}; run the \
             CLI as the user who started the daemon (its cli.key is what the daemon allows)",
            self.root
        )
    }

    async fn try_request(&self, req: &ControlRequest) -> Result<ControlResponse, Refusal> {
        let conn = connect(
            &self.endpoint,
            self.ticket.addr().clone(),
            ALPN_CONTROL,
            CONNECT_TIMEOUT,
        )
        .await
        .map_err(|e| Refusal::Other(self.not_running(e)))?;
        let failed = |e: &dyn std::fmt::Display| refusal(&conn, self.not_running(e));
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| failed(&e))?;
        let text = serde_json::to_string(req).map_err(|e| Refusal::Other(e.into()))?;
        send_frame(&mut send, &text, FRAME_LEN_MAX)
            .await
            .map_err(|e| failed(&e))?;
        let _ = send.finish();
        let answer: Option<String> = recv_frame(&mut recv, FRAME_LEN_MAX)
            .await
            .map_err(|e| failed(&e))?;
        conn.close(0u32.into(), b"done");
        let answer = answer.ok_or_else(|| failed(&"it closed the connection"))?;
        serde_json::from_str(&answer).map_err(|e| Refusal::Other(e.into()))
    }

    /// Closes the endpoint, waiting at most [`CLOSE_WAIT_MAX`]: a dial that
    /// timed out leaves a connection attempt the endpoint would otherwise
    /// wait seconds for, after the error was already known.
    pub(crate) async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_WAIT_MAX, self.endpoint.close()).await;
    }
}

impl Client {
    /// Asks, and turns the daemon's refusal into an error.
    pub(crate) async fn ask(&self, req: ControlRequest) -> Result<ControlResponse> {
        match self.request(&req).await? {
            ControlResponse::Error(e) => bail!("{}", cut_long_words(&e)),
            other => Ok(other),
        }
    }
}

impl Client {
    /// Sends `req` and returns the connection and the stream the daemon's
    /// answers arrive on (a job streams many).
    pub(crate) async fn stream(
        &self,
        req: &ControlRequest,
    ) -> Result<(
        swactor_engine::iroh::endpoint::Connection,
        swactor_engine::iroh::endpoint::RecvStream,
    )> {
        let (conn, mut send, recv) = self.open_stream(req).await?;
        let _ = send.finish();
        Ok((conn, recv))
    }
}

impl Client {
    /// Sends `req` on a connection of its own and returns the connection
    /// and both halves of its stream, the sending half left open: a remote
    /// shell or a forwarded connection goes on on it.
    pub(crate) async fn open_stream(
        &self,
        req: &ControlRequest,
    ) -> Result<(
        swactor_engine::iroh::endpoint::Connection,
        swactor_engine::iroh::endpoint::SendStream,
        swactor_engine::iroh::endpoint::RecvStream,
    )> {
        let conn = connect(
            &self.endpoint,
            self.ticket.addr().clone(),
            ALPN_CONTROL,
            CONNECT_TIMEOUT,
        )
        .await
        .map_err(|e| self.not_running(e))?;
        let (mut send, recv) = conn.open_bi().await.map_err(|e| self.not_running(e))?;
        let text = serde_json::to_string(req)?;
        send_frame(&mut send, &text, FRAME_LEN_MAX)
            .await
            .map_err(|e| self.not_running(e))?;
        Ok((conn, send, recv))
    }
}

/// The next answer on a stream from [`Client::stream`]; `None` when it ended.
pub(crate) async fn recv_answer(
    recv: &mut swactor_engine::iroh::endpoint::RecvStream,
) -> Result<Option<ControlResponse>> {
    let Some(text) = recv_frame::<String, _>(recv, FRAME_LEN_MAX).await? else {
        return Ok(None);
    };
    Ok(Some(serde_json::from_str(&text)?))
}

/// Opens a client, runs `body` with it and closes it, whatever `body` returned.
pub(crate) async fn with_client<T>(
    state_dir: &Path,
    body: impl AsyncFnOnce(&Client) -> Result<T>,
) -> Result<T> {
    let client = Client::open(state_dir).await?;
    let result = body(&client).await;
    client.close().await;
    result
}

async fn one(state_dir: &Path, req: ControlRequest) -> Result<ControlResponse> {
    with_client(state_dir, async |c| c.ask(req).await).await
}

pub(crate) fn unexpected(answer: &ControlResponse) -> anyhow::Error {
    anyhow::anyhow!(
        "the daemon answered something this CLI did not ask for ({}); are the CLI and the \
         daemon the same version?",
        match answer {
            ControlResponse::Applied { .. } => "an apply",
            ControlResponse::Plan(_) => "a plan",
            ControlResponse::Status(_) => "a status",
            ControlResponse::Described(_) => "a node",
            ControlResponse::Down { .. } => "a stop",
            ControlResponse::Paused { .. } => "a pause",
            ControlResponse::Replaced { .. } => "a replace",
            ControlResponse::Job(_) => "a job's event",
            ControlResponse::Jobs(_) => "a list of jobs",
            ControlResponse::JobLogs(_) => "a job's output",
            ControlResponse::JobCancelled { .. } => "a cancel",
            ControlResponse::AgentLog(_) => "a piece of an agent log",
            ControlResponse::Remote { .. } => "an open shell or connection",
            ControlResponse::Error(_) => "an error",
        }
    )
}

/// Buffered lines on stdout. Once its reader has gone, they are dropped
/// (see [`crate::term::Stdout`]): the command goes on regardless.
struct Out(std::io::BufWriter<crate::term::Stdout>);

impl Out {
    fn new() -> Self {
        Self(std::io::BufWriter::new(crate::term::Stdout))
    }

    fn line(&mut self, text: impl std::fmt::Display) -> std::io::Result<()> {
        writeln!(self.0, "{text}")
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
