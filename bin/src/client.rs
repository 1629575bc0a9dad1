//! The CLI side: `apply`, `plan`, `status`, `watch` and `down` talk to the running daemon.

use crate::protocol::{ControlRequest, ControlResponse, FRAME_LEN_MAX};
use crate::shapefile::ShapeFile;
use crate::state::{DaemonHolder, StateDir};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::time::Duration;
use swactor_actors::{ClusterEvent, ClusterSnapshot};
use swactor_engine::iroh::Endpoint;
use swactor_engine::net::{
    ALPN_CONTROL, EndpointTicket, NetConfig, bind_endpoint, codes, connect, recv_frame, send_frame,
};
use swactor_engine::telemetry::{SubscribeError, TelemetryFrame, subscribe};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
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

struct Client {
    endpoint: Endpoint,
    ticket: EndpointTicket,
    root: String,
}

impl Client {
    async fn open(state_dir: &Path) -> Result<Self> {
        let state = StateDir::open(state_dir.to_path_buf())?;
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
            ..NetConfig::default()
        };
        let endpoint = bind_endpoint(&config, state.cli_key()?)
            .await
            .context("cannot bind the CLI's endpoint")?;
        Ok(Self {
            endpoint,
            ticket,
            root: state.root().display().to_string(),
        })
    }

    fn not_running(&self, e: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!(
            "cannot reach the daemon for {} ({e}); it may have stopped — start it with `swactor up`",
            self.root
        )
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

    async fn close(self) {
        self.endpoint.close().await;
    }
}

async fn one(state_dir: &Path, req: ControlRequest) -> Result<ControlResponse> {
    let client = Client::open(state_dir).await?;
    let resp = client.request(&req).await;
    client.close().await;
    match resp? {
        ControlResponse::Error(e) => bail!("{e}"),
        other => Ok(other),
    }
}

/// Checks a shape before bothering the daemon, so bad input is named precisely.
fn check(file: &ShapeFile) -> Result<()> {
    file.to_shape(1)?
        .validate()
        .map_err(|e| anyhow::anyhow!("the shape is invalid: {e}; nothing was changed"))?;
    Ok(())
}

/// `swactor apply SHAPE`.
///
/// # Errors
/// Bad input or an unreachable daemon; nothing changes then.
pub(crate) async fn apply(state_dir: &Path, shape: &Path) -> Result<()> {
    let file = ShapeFile::load(shape)?;
    check(&file)?;
    match one(state_dir, ControlRequest::Apply(file)).await? {
        ControlResponse::Applied {
            generation,
            changed: true,
        } => {
            println!("applied: generation {generation}");
        }
        ControlResponse::Applied {
            generation,
            changed: false,
        } => {
            println!("unchanged: the shape is already generation {generation}");
        }
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `swactor plan [SHAPE]`.
///
/// # Errors
/// Bad input or an unreachable daemon.
pub(crate) async fn plan(state_dir: &Path, shape: Option<&Path>) -> Result<()> {
    let file = shape.map(ShapeFile::load).transpose()?;
    if let Some(f) = &file {
        check(f)?;
    }
    let ControlResponse::Plan(plan) = one(state_dir, ControlRequest::Plan(file)).await? else {
        bail!("unexpected answer from the daemon");
    };
    if plan.actions.is_empty() {
        println!("no changes: the next pass would do nothing");
    }
    for line in &plan.actions {
        let sign = match line.action.as_str() {
            "create slot" => '+',
            a if a.starts_with("begin delete") || a == "remove slot" => '-',
            a if a.starts_with("restart") => '~',
            _ => ' ',
        };
        println!(
            "{sign} {:<20} {:<34} ({})",
            line.node.to_string(),
            line.action,
            line.row
        );
    }
    Ok(())
}

/// `swactor status [--json]`.
///
/// # Errors
/// An unreachable daemon.
pub(crate) async fn status(state_dir: &Path, json: bool) -> Result<()> {
    let ControlResponse::Status(snap) = one(state_dir, ControlRequest::Status).await? else {
        bail!("unexpected answer from the daemon");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&snap)?);
    } else {
        print_status(&snap);
    }
    Ok(())
}

fn print_status(s: &ClusterSnapshot) {
    let ready = s.nodes.iter().filter(|n| n.ready).count();
    println!(
        "run {} · generation {} · {ready}/{} ready{}",
        s.run_id,
        s.generation.0,
        s.desired_nodes,
        if s.converged { " · converged" } else { "" }
    );
    for n in &s.nodes {
        let err = n.last_error.as_deref().unwrap_or("");
        println!(
            "  {:<16} {:>6} {:<16} {:<8} {err}",
            n.node.to_string(),
            n.attempt.to_string(),
            format!("{:?}", n.stage),
            if n.ready { "ready" } else { "" }
        );
    }
}

/// `swactor down [--keep]`.
///
/// Returns once the daemon has released its state directory, so an
/// immediate `swactor up` finds it free.
///
/// # Errors
/// An unreachable daemon, or one still holding the directory
/// [`RELEASE_WAIT_MAX`] after it answered.
pub(crate) async fn down(state_dir: &Path, keep: bool) -> Result<()> {
    let state = StateDir::open(state_dir.to_path_buf())?;
    let (destroyed, kept) = match one(state_dir, ControlRequest::Down { keep }).await? {
        ControlResponse::Down { destroyed, kept } => (destroyed, kept),
        other => bail!("unexpected answer: {other:?}"),
    };
    if destroyed.is_empty() && kept.is_empty() {
        println!("daemon stopped; there were no nodes");
    }
    if !destroyed.is_empty() {
        println!(
            "destroyed {} node(s): {}",
            destroyed.len(),
            destroyed.join(", ")
        );
    }
    if !kept.is_empty() {
        println!("kept {} node(s) running: {}", kept.len(), kept.join(", "));
    }
    let still = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        loop {
            match state.running_daemon() {
                None => return None,
                Some(holder) if started.elapsed() >= RELEASE_WAIT_MAX => return Some(holder),
                Some(_) => std::thread::sleep(RELEASE_POLL_INTERVAL),
            }
        }
    })
    .await
    .context("waiting for the daemon to exit")?;
    match still {
        None => Ok(()),
        Some(DaemonHolder { pid: Some(pid) }) => bail!("the daemon (pid {pid}) is still stopping"),
        Some(DaemonHolder { pid: None }) => bail!("the daemon is still stopping"),
    }
}

/// `swactor watch`: follows the daemon's telemetry until it stops or Ctrl-C.
///
/// # Errors
/// An unreachable daemon.
pub(crate) async fn watch(state_dir: &Path) -> Result<()> {
    let client = Client::open(state_dir).await?;
    let mut sub = subscribe::<ClusterSnapshot, ClusterEvent>(
        &client.endpoint,
        client.ticket.addr().clone(),
        CONNECT_TIMEOUT,
        FRAME_LEN_MAX,
    )
    .await
    .map_err(|e| match e {
        SubscribeError::Refused { code, .. } if code == codes::CLOSE_NOT_ALLOWED.into_inner() => {
            client.not_authorised()
        }
        e => client.not_running(e),
    })?;
    loop {
        let frame = tokio::select! {
            f = sub.next() => f,
            _ = tokio::signal::ctrl_c() => break,
        };
        match frame {
            Ok(Some(TelemetryFrame::Snapshot { state, .. })) => print_status(&state),
            Ok(Some(TelemetryFrame::Event { seq, event })) => {
                println!("{seq:>6} {}", describe(&event))
            }
            Ok(Some(TelemetryFrame::Lagged { missed })) => {
                println!("       (missed {missed} events)")
            }
            Ok(None) => {
                println!("the daemon ended the stream");
                break;
            }
            Err(e) => {
                println!("the stream ended: {e}");
                break;
            }
        }
    }
    client.close().await;
    Ok(())
}

fn describe(e: &ClusterEvent) -> String {
    if let Some(note) = crate::progress::note(e) {
        return note;
    }
    match e {
        ClusterEvent::ShapeAccepted { generation, nodes } => {
            format!(
                "shape accepted: generation {}, {nodes} node(s)",
                generation.0
            )
        }
        ClusterEvent::Node(n) => {
            let err = n
                .last_error
                .as_deref()
                .map(|e| format!(" — {e}"))
                .unwrap_or_default();
            format!(
                "{} {} {:?}{}{err}",
                n.node,
                n.attempt,
                n.stage,
                if n.ready { " ready" } else { "" }
            )
        }
        ClusterEvent::Removed { node } => format!("{node} removed"),
        ClusterEvent::Dispatched { node, op, effect } => format!("{node} {op} dispatch {effect:?}"),
        ClusterEvent::Finished {
            node,
            op,
            outcome,
            folded,
        } => {
            format!(
                "{node} {op} {outcome}{}",
                if *folded { "" } else { " (stale, ignored)" }
            )
        }
        ClusterEvent::Pass {
            number,
            nodes,
            transitions,
            dispatched,
        } => {
            format!(
                "pass {number}: {nodes} node(s), {transitions} transition(s), {dispatched} dispatch(es)"
            )
        }
        ClusterEvent::Converged { generation, nodes } => {
            format!("converged: generation {}, {nodes} node(s)", generation.0)
        }
        ClusterEvent::Warning { message } => format!("warning: {message}"),
        other => format!("{other:?}"),
    }
}
