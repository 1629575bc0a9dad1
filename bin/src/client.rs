//! The CLI side: `apply`, `plan`, `status`, `describe`, `watch` and `down`
//! talk to the running daemon; `validate` checks a shape offline.

use crate::guard;
use crate::protocol::{ControlRequest, ControlResponse, FRAME_LEN_MAX, PlanReport};
use crate::shapefile::{ShapeFile, capacity_refusal, offline_capacities};
use crate::state::{DaemonHolder, StateDir};
use crate::term::{Table, stdout_width};
use crate::words::{
    ago, bootstrap_words, clock, cut_long_words, effect_words, next_words, nodes, retry_cell,
    stage_word, state_cell, state_text, state_word,
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
    async fn open(state_dir: &Path) -> Result<Self> {
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
    async fn close(self) {
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
        let _ = send.finish();
        Ok((conn, recv))
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

/// `swactor validate SHAPE`: every check that needs no daemon, the
/// capacity of this machine included (as `up` would check it).
///
/// # Errors
/// The shape is not one a daemon would take; the error says why.
pub(crate) fn validate(shape: &Path) -> Result<()> {
    let file = ShapeFile::load(shape)?;
    let checked = file.check(1)?;
    if let Some(refused) = capacity_refusal(&checked, None, &offline_capacities()) {
        bail!("{refused}");
    }
    let total = checked.node_count();
    let mut out = Out::new();
    out.line(format_args!(
        "{}: valid — run {}, {} in {} group(s)",
        shape.display(),
        checked.run_id,
        nodes(total),
        checked.groups.len()
    ))?;
    let width = checked.groups.iter().map(|g| g.id.len()).max().unwrap_or(0);
    for g in &checked.groups {
        out.line(format_args!(
            "  {:<width$}  {} × {} (role {})",
            g.id, g.count, g.provider.kind, g.role
        ))?;
    }
    if let Some(capacity) = checked.capacity {
        out.line(format_args!(
            "  capacity: at most {} (the shape's own)",
            nodes(capacity)
        ))?;
    }
    out.line(format_args!(
        "`swactor up {}` on a fresh state directory creates {}; next to a running daemon, \
         `swactor plan {}` shows what it would change.",
        shape.display(),
        nodes(total),
        shape.display()
    ))?;
    out.flush()?;
    Ok(())
}

/// Prints a plan's summary and its bounded listing.
fn print_plan(out: &mut Out, report: &PlanReport) -> std::io::Result<()> {
    let total = guard::changed(&report.diff);
    let generation = report
        .generation
        .map(|g| format!(" (as generation {g})"))
        .unwrap_or_default();
    if total > 0 {
        out.line(format_args!("{}{generation}", guard::summary(&report.diff)))?;
    } else if report.placement_only {
        out.line(format_args!(
            "plan: the shape changes no node ({} unchanged), only where new nodes may go \
             (a group's hosts or their labels){generation}",
            report.diff.unchanged
        ))?;
    } else if report.has_work() {
        // Terraform's "no changes" would be untrue here: the daemon still
        // has work, whatever the shape says.
        out.line(format_args!(
            "plan: the shape changes no node ({} unchanged), but the cluster is not converged yet",
            report.diff.unchanged
        ))?;
    } else {
        out.line(format_args!(
            "plan: no changes; {} unchanged, converged on generation {}",
            nodes(report.diff.unchanged),
            report.current
        ))?;
    }
    for line in guard::listing(&report.changes, total) {
        out.line(line)?;
    }
    if report.under_way_total > 0 {
        out.line(format_args!(
            "under way now, whatever the shape: {} not ready",
            nodes(report.under_way_total)
        ))?;
        for n in &report.under_way {
            let error = n
                .last_error
                .as_deref()
                .map(|e| format!(" — {e}"))
                .unwrap_or_default();
            out.line(format_args!(
                "  {:<16} {:<5} {}{error}",
                n.node.to_string(),
                n.attempt.to_string(),
                state_text(n, report.now)
            ))?;
        }
        let more = report
            .under_way_total
            .saturating_sub(report.under_way.len() as u64);
        if more > 0 {
            out.line(format_args!(
                "  … and {more} more (`swactor status` lists them)"
            ))?;
        }
    } else if !report.converged {
        let why = if report.orphans > 0 {
            format!("collecting {} leftover resource(s)", report.orphans)
        } else {
            "checking what an earlier daemon left".to_owned()
        };
        out.line(format_args!("under way now: {why}"))?;
    }
    Ok(())
}

/// `swactor plan [SHAPE] [--all]`. Returns whether the daemon has work to
/// do: the shape changes something, or the cluster is not converged yet.
///
/// # Errors
/// Bad input or an unreachable daemon.
pub(crate) async fn plan(state_dir: &Path, shape: Option<&Path>, all: bool) -> Result<bool> {
    let file = shape.map(ShapeFile::load).transpose()?;
    if let Some(f) = &file {
        f.check(1)?;
    }
    let answer = one(state_dir, ControlRequest::Plan { shape: file, all }).await?;
    let ControlResponse::Plan(report) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    print_plan(&mut out, &report)?;
    out.flush()?;
    Ok(report.has_work())
}

/// `swactor apply SHAPE [--yes]`: shows the plan, asks when it destroys,
/// replaces or creates many nodes, then applies.
///
/// # Errors
/// Bad input, a refusal (of the daemon, or of the question), or an
/// unreachable daemon; nothing changes then.
pub(crate) async fn apply(state_dir: &Path, shape: &Path, yes: bool) -> Result<()> {
    let file = ShapeFile::load(shape)?;
    file.check(1)?;
    with_client(state_dir, async |client| {
        let plan = ControlRequest::Plan {
            shape: Some(file.clone()),
            all: false,
        };
        let answer = client.ask(plan).await?;
        let ControlResponse::Plan(report) = answer else {
            return Err(unexpected(&answer));
        };
        let mut out = Out::new();
        print_plan(&mut out, &report)?;
        out.flush()?;
        guard::ask(&report.diff, yes).await?;
        match client.ask(ControlRequest::Apply(file.clone())).await? {
            ControlResponse::Applied {
                generation,
                changed: true,
                paused,
            } => {
                out.line(format_args!("applied: generation {generation}"))?;
                if paused {
                    out.line(
                        "the cluster is paused: the shape is recorded, but nothing changes \
                         until `swactor resume`",
                    )?;
                } else {
                    rollout_lines(&mut out, &file, &report)?;
                }
            }
            ControlResponse::Applied {
                generation,
                changed: false,
                ..
            } => out.line(format_args!(
                "unchanged: the shape is already generation {generation}"
            ))?,
            other => return Err(unexpected(&other)),
        }
        out.flush()?;
        Ok(())
    })
    .await
}

/// One line per group whose nodes a plan replaces: how many of its ready
/// nodes go at a time.
fn rollout_lines(out: &mut Out, file: &ShapeFile, report: &PlanReport) -> std::io::Result<()> {
    if report.diff.replace == 0 {
        return Ok(());
    }
    let Some(desired) = file.check(1).ok().and_then(|s| s.validate().ok()) else {
        return Ok(());
    };
    let replaced: std::collections::BTreeSet<&str> = report
        .changes
        .iter()
        .filter(|(_, c)| *c == swactor_provisioning::Change::Replace)
        .map(|(n, _)| n.group.as_str())
        .collect();
    for g in desired
        .groups
        .iter()
        .filter(|g| replaced.contains(g.id.as_str()))
    {
        let surge = g.policy.max_surge_of(g.count);
        if surge == 0 {
            out.line(format_args!(
                "group {}: ready nodes are replaced {} at a time (max_unavailable), in slot order; \
                 a replacement that fails stops the rollout, and `swactor status` says why",
                g.id,
                g.policy.max_unavailable_of(g.count)
            ))?;
        } else {
            out.line(format_args!(
                "group {}: {surge} surge node(s) ({}-{} and up) are added first, then ready nodes \
                 are replaced in slot order keeping at least {} ready (max_unavailable {}, \
                 max_surge {surge}); the surge nodes go once the group is ready with the new \
                 template; a replacement that fails stops the rollout, and `swactor status` says why",
                g.id,
                g.id,
                g.count,
                g.count - g.policy.max_unavailable_of(g.count).min(g.count),
                g.policy.max_unavailable_of(g.count),
            ))?;
        }
    }
    Ok(())
}

/// `swactor pause` (`paused`) or `swactor resume`.
///
/// # Errors
/// A refusal (a teardown cannot be paused), or an unreachable daemon.
pub(crate) async fn pause(state_dir: &Path, paused: bool) -> Result<()> {
    let request = if paused {
        ControlRequest::Pause
    } else {
        ControlRequest::Resume
    };
    let answer = one(state_dir, request).await?;
    let ControlResponse::Paused { changed, .. } = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    out.line(match (paused, changed) {
        (true, true) => {
            "paused: nothing new is dispatched (no node is created, replaced or removed) \
             until `swactor resume`; operations under way finish, failed nodes are cleaned up"
        }
        (true, false) => "already paused",
        (false, true) => "resumed",
        (false, false) => "not paused: nothing to resume",
    })?;
    out.flush()?;
    Ok(())
}

/// `swactor replace NODE`.
///
/// # Errors
/// An unreachable daemon, or the replace was refused.
pub(crate) async fn replace(state_dir: &Path, node: &str) -> Result<()> {
    let answer = one(state_dir, ControlRequest::Replace(node.to_owned())).await?;
    let ControlResponse::Replaced { node, attempt } = answer else {
        return Err(unexpected(&answer));
    };
    // What follows the cleanup is the cluster's to say: nothing new starts
    // while it is paused.
    let paused = match one(state_dir, ControlRequest::Status).await {
        Ok(ControlResponse::Status(snap)) => snap.paused,
        _ => false,
    };
    let then = if paused {
        "no new attempt starts while the cluster is paused (`swactor resume` goes on)"
    } else {
        "then a new attempt starts (`swactor status` shows it)"
    };
    let mut out = Out::new();
    out.line(format!(
        "{node}: its attempt a{attempt} is failed (replaced by the operator) and is cleaned \
         up; {then}"
    ))?;
    out.flush()?;
    Ok(())
}

/// `swactor status [--json]`.
///
/// # Errors
/// An unreachable daemon.
pub(crate) async fn status(state_dir: &Path, json: bool) -> Result<()> {
    let answer = one(state_dir, ControlRequest::Status).await?;
    let ControlResponse::Status(snap) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    if json {
        /// The snapshot with the cluster's state in a word first, as the
        /// headline says it (`converging`, `converged`, `paused`, `tearing
        /// down`, `stopping`).
        #[derive(serde::Serialize)]
        struct WithState<'a> {
            state: &'static str,
            #[serde(flatten)]
            snapshot: &'a ClusterSnapshot,
        }
        let with_state = WithState {
            state: crate::words::cluster_state(&snap),
            snapshot: &snap,
        };
        serde_json::to_writer_pretty(&mut out.0, &with_state)?;
        out.line("")?;
    } else {
        print_status(&mut out, &snap, stdout_width(), "")?;
    }
    out.flush()?;
    Ok(())
}

/// The first line of a status: the run, the generation, how many nodes are
/// ready, and how many are in each other state.
fn status_headline(s: &ClusterSnapshot) -> String {
    let ready = s.nodes.iter().filter(|n| state_word(n) == "ready").count();
    let mut line = format!(
        "run {} · generation {} · {ready}/{} ready",
        s.run_id, s.generation.0, s.desired_nodes
    );
    let mut others: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &s.nodes {
        let word = state_word(n);
        if word != "ready" {
            *others.entry(word).or_default() += 1;
        }
    }
    for (word, count) in others {
        line.push_str(&format!(" · {count} {word}"));
    }
    if s.orphans > 0 {
        line.push_str(&format!(" · collecting {} leftover(s)", s.orphans));
    }
    // The same word `status --json` gives as its `state`; `paused` has a
    // longer form of its own below.
    match crate::words::cluster_state(s) {
        "converging" => {}
        "paused" if s.converged => line.push_str(" · converged"),
        "paused" => {}
        word => {
            line.push_str(" · ");
            line.push_str(word);
        }
    }
    if s.paused {
        line.push_str(" · paused (`swactor resume` to go on)");
    }
    line
}

/// The status table: one row per node, its state in the common vocabulary.
///
/// A `RESOURCE` column (what the provider says of each node's lease: a
/// container id, say) is shown when any node has something there.
fn status_table(s: &ClusterSnapshot) -> Table {
    let resources = s.nodes.iter().any(|n| n.resource.is_some());
    let mut headers = vec!["NODE", "ATTEMPT", "STATE"];
    if resources {
        headers.push("RESOURCE");
    }
    headers.extend(["FAILS", "RETRY", "LAST ERROR"]);
    let mut table = Table::new(&headers);
    for n in &s.nodes {
        let mut cells = vec![
            n.node.to_string(),
            n.attempt.to_string(),
            state_cell(n, s.now),
        ];
        if resources {
            cells.push(n.resource.clone().unwrap_or_else(|| "-".to_owned()));
        }
        cells.extend([n.failures.to_string(), retry_cell(n, s.now)]);
        table.row(cells, n.last_error.clone().unwrap_or_default());
    }
    table
}

/// Prints a status, each line after `prefix`, fitted to `width` columns if given.
fn print_status(
    out: &mut Out,
    s: &ClusterSnapshot,
    width: Option<usize>,
    prefix: &str,
) -> std::io::Result<()> {
    out.line(format_args!("{prefix}{}", status_headline(s)))?;
    for h in &s.holds {
        out.line(format_args!("{prefix}group {}: {}", h.group, h.reason))?;
    }
    let width = width.map(|w| w.saturating_sub(prefix.chars().count() + 1));
    for line in status_table(s).render(width).into_iter().flatten() {
        out.line(format_args!("{prefix}{line}"))?;
    }
    if !s.rentals.is_empty() {
        out.line(format_args!("{prefix}{}", rentals_headline(s)))?;
        for line in rentals_table(s).render(width).into_iter().flatten() {
            out.line(format_args!("{prefix}{line}"))?;
        }
    }
    if let Some(line) = crate::words::budget_line(s.budget.as_ref(), s.spend.as_ref()) {
        out.line(format_args!("{prefix}{line}"))?;
    }
    if !s.foreign.is_empty() {
        let cost = crate::words::foreign_cost(&s.foreign)
            .map(|m| format!(" · {} $/h", usd_per_hour(m)))
            .unwrap_or_default();
        let ours = s.deployment.as_deref().map_or_else(
            || "this daemon's journal predates deployments".to_owned(),
            |d| format!("this daemon is deployment {d}"),
        );
        out.line(format_args!(
            "{prefix}foreign: {} resource(s) of run {} made by another deployment{cost} \
             ({ours}; it never adopts or destroys them):",
            s.foreign.len(),
            s.run_id
        ))?;
        for r in &s.foreign {
            out.line(format_args!(
                "{prefix}  {}",
                crate::words::foreign_resource(r)
            ))?;
        }
    }
    Ok(())
}

/// Dollars per hour from millionths.
fn usd_per_hour(micros: u64) -> String {
    crate::words::usd(micros)
}

/// The rented machines' line: how many and what they cost together.
fn rentals_headline(s: &ClusterSnapshot) -> String {
    let total: u64 = s.rentals.iter().map(|r| r.usd_per_hour_micros).sum();
    format!(
        "rented machines: {} · {} $/h in all",
        s.rentals.len(),
        usd_per_hour(total)
    )
}

/// One row per rented machine: where it was rented and what it costs.
fn rentals_table(s: &ClusterSnapshot) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "ATTEMPT",
        "PROVIDER",
        "INSTANCE",
        "OFFER",
        "MACHINE",
        "$/H",
        "LAST SEEN",
    ]);
    for r in &s.rentals {
        table.row(
            vec![
                r.node.to_string(),
                r.attempt.to_string(),
                r.provider.clone(),
                r.instance.clone(),
                if r.offer.is_empty() {
                    "?".to_owned()
                } else {
                    r.offer.clone()
                },
                r.machine.clone(),
                usd_per_hour(r.usd_per_hour_micros),
            ],
            r.status.clone(),
        );
    }
    table
}

/// `swactor describe NODE`: one node in depth.
///
/// # Errors
/// Not a node id, a node the daemon does not know, or an unreachable daemon.
pub(crate) async fn describe(state_dir: &Path, node: &str) -> Result<()> {
    if LogicalNodeId::parse(node).is_none() {
        bail!("{}", crate::control::not_a_node_id(node));
    }
    let answer = one(state_dir, ControlRequest::Describe(node.to_owned())).await?;
    let ControlResponse::Described(d) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    print_description(&mut out, &d, stdout_width())?;
    out.flush()?;
    Ok(())
}

fn print_description(
    out: &mut Out,
    d: &NodeDescription,
    width: Option<usize>,
) -> std::io::Result<()> {
    let now = d.now;
    let mut facts: Vec<(&str, String)> = Vec::new();
    match &d.summary {
        Some(n) => {
            facts.push(("state", state_text(n, now)));
            let failures = match n.failures {
                0 => String::new(),
                1 => " (1 failure since it was last ready)".to_owned(),
                f => format!(" ({f} failures since it was last ready)"),
            };
            facts.push(("attempt", format!("{}{failures}", n.attempt)));
            if matches!(n.next, NextStep::RetryAt(_) | NextStep::Held(_)) {
                facts.push(("next retry", next_words(n.next, now)));
            }
            facts.push((
                "agent",
                match n.agent {
                    AgentLink::Connected => "connected".to_owned(),
                    AgentLink::NotJoined => "not joined to this daemon".to_owned(),
                    AgentLink::Away { .. } => format!("disconnected; {}", next_words(n.next, now)),
                },
            ));
            if let Some(p) = n.pending {
                facts.push(("doing", effect_words(p).to_owned()));
            }
        }
        None => facts.push(("state", "no node (the slot is empty)".to_owned())),
    }
    facts.push((
        "desired",
        if d.desired {
            "yes: the current shape wants this slot".to_owned()
        } else {
            "no: the current shape does not want this slot".to_owned()
        },
    ));
    facts.push((
        "lease",
        d.lease.clone().unwrap_or_else(|| "none".to_owned()),
    ));
    if let Some(b) = d.bootstrap {
        facts.push(("bootstrap", bootstrap_words(b).to_owned()));
    }
    if let Some(r) = &d.failed_reason {
        facts.push(("failed", r.clone()));
    }
    if let Some(e) = d.summary.as_ref().and_then(|n| n.last_error.clone()) {
        facts.push(("last error", e));
    }
    out.line(d.node)?;
    let mut table = Table::new(&["", ""]);
    for (k, v) in facts {
        table.row(vec![k.to_owned()], v);
    }
    for line in table.render(width).into_iter().skip(1).flatten() {
        out.line(line)?;
    }
    if d.attempts.is_empty() {
        return Ok(());
    }
    out.line("attempts, oldest first:")?;
    let mut table = Table::new(&[
        "ATTEMPT",
        "STARTED",
        "READY",
        "ENDED",
        "OUTCOME",
        "REASON / LAST ERROR",
    ]);
    let current = d.summary.as_ref().map(|n| n.attempt);
    for a in &d.attempts {
        let outcome = if a.failed_reason.is_some() {
            "failed"
        } else if a.ended_at.is_some() {
            "ended"
        } else if Some(a.attempt) == current {
            d.summary.as_ref().map_or("", state_word)
        } else {
            stage_word(a.stage)
        };
        let mut why: Vec<String> = Vec::new();
        if let Some(r) = &a.failed_reason {
            why.push(r.clone());
        }
        if let Some(e) = &a.last_error
            && a.failed_reason.as_ref() != Some(e)
        {
            why.push(e.clone());
        }
        if why.is_empty()
            && let Some(b) = a.bootstrap
        {
            why.push(bootstrap_words(b).to_owned());
        }
        let when = |t: Option<Timestamp>| t.map_or_else(|| "-".to_owned(), |t| ago(t, now));
        table.row(
            vec![
                a.attempt.to_string(),
                ago(a.started_at, now),
                when(a.ready_at),
                when(a.ended_at),
                outcome.to_owned(),
            ],
            why.join("; "),
        );
    }
    for line in table.render(width).into_iter().flatten() {
        out.line(line)?;
    }
    out.line(format_args!(
        "agent logs: `swactor logs {}` (`--attempt N` for an earlier attempt aN)",
        d.node
    ))?;
    Ok(())
}

/// `swactor down [--keep]`.
///
/// Returns once the daemon has released its state directory, so an
/// immediate `swactor up` finds it free.
///
/// # Errors
/// An unreachable daemon, or one still holding the directory
/// [`RELEASE_WAIT_MAX`] after it answered.
pub(crate) async fn down(state_dir: &Path, keep: bool, purge: bool) -> Result<()> {
    let state = StateDir::open(state_dir.to_path_buf())?;
    let request = ControlRequest::Down { keep, purge };
    let (destroyed, kept, without_machine, purged) = match one(state_dir, request).await? {
        ControlResponse::Down {
            destroyed,
            kept,
            without_machine,
            purged,
        } => (destroyed, kept, without_machine, purged),
        other => return Err(unexpected(&other)),
    };
    let mut out = Out::new();
    if destroyed.is_empty() && kept.is_empty() && without_machine.is_empty() {
        out.line("daemon stopped; there were no nodes")?;
    }
    if !destroyed.is_empty() {
        out.line(format_args!(
            "destroyed {} node(s): {}",
            destroyed.len(),
            crate::words::names(&destroyed)
        ))?;
    }
    if !kept.is_empty() {
        out.line(format_args!(
            "kept {} node(s) running: {}",
            kept.len(),
            crate::words::names(&kept)
        ))?;
    }
    if !without_machine.is_empty() {
        out.line(crate::words::without_machine(&without_machine))?;
    }
    for (host, failed) in &purged {
        match failed {
            None => out.line(format_args!("purged {host}"))?,
            Some(why) => out.line(format_args!("could not purge {host}: {why}"))?,
        }
    }
    out.flush()?;
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

/// How often `watch` checks that the daemon still holds its state directory.
const WATCH_ALIVE_INTERVAL: Duration = Duration::from_millis(500);
/// Frames read ahead of what `watch` has printed.
const WATCH_FRAMES_BUFFERED: usize = 256;
/// How long `watch` waits for the end of the stream of a daemon that has
/// released its state directory, before it takes the stream as broken.
const WATCH_END_GRACE: Duration = Duration::from_secs(1);

/// How a watch ends.
enum Ended {
    /// The daemon ended the stream (it stopped), or the user pressed Ctrl-C.
    Cleanly(&'static str),
    /// The stream broke off: the daemon died, the connection was lost, a
    /// frame did not decode.
    Broken(String),
}

/// `swactor watch`: follows the daemon's telemetry until it stops (exit 0),
/// Ctrl-C (exit 0), or the stream breaks (an error, so exit 1).
///
/// # Errors
/// An unreachable daemon, or a stream that broke off.
pub(crate) async fn watch(state_dir: &Path) -> Result<()> {
    let client = Client::open(state_dir).await?;
    let subscribed = subscribe::<ClusterSnapshot, ClusterEvent>(
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
        e => client.not_running(swactor_engine::error_chain(&e)),
    });
    let mut sub = match subscribed {
        Ok(sub) => sub,
        Err(e) => {
            client.close().await;
            return Err(e);
        }
    };
    // Frames are read by a task of their own: reading one is not
    // cancel-safe, so it must never be a branch of the `select!` below (a
    // tick that won the race would drop half a frame and garble the stream).
    let (frames_tx, mut frames) = tokio::sync::mpsc::channel(WATCH_FRAMES_BUFFERED);
    let reader = tokio::spawn(async move {
        loop {
            let frame = sub.next().await;
            let last = !matches!(frame, Ok(Some(_)));
            if frames_tx.send(frame).await.is_err() || last {
                break;
            }
        }
    });
    let mut view = WatchView::new();
    let mut alive = tokio::time::interval(WATCH_ALIVE_INTERVAL);
    // One listener for the whole watch: a fresh `ctrl_c()` per frame would
    // miss a Ctrl-C that came while a frame was being printed.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch for Ctrl-C")?;
    let ended = loop {
        let frame = tokio::select! {
            f = frames.recv() => f,
            _ = interrupt.recv() => break Ok(Ended::Cleanly("stopped")),
            _ = alive.tick() => {
                if client.daemon_alive().await {
                    continue;
                }
                // The daemon let go of its directory: it stopped, or died.
                // A daemon that stopped has ended the stream by now.
                let rest = async {
                    while let Some(frame) = frames.recv().await {
                        if let Some(ended) = view.frame(frame)? {
                            return Ok(ended);
                        }
                    }
                    Ok(Ended::Broken("the stream stopped".to_owned()))
                };
                match tokio::time::timeout(WATCH_END_GRACE, rest).await {
                    Ok(ended) => break ended,
                    Err(_) => break Ok(Ended::Broken(
                        "the daemon is gone without ending the stream (was it killed?)".to_owned(),
                    )),
                }
            }
        };
        let Some(frame) = frame else {
            break Ok(Ended::Broken("the stream stopped".to_owned()));
        };
        match view.frame(frame) {
            // Nobody reads any more (`| head`): the watch is over.
            Ok(None) if crate::term::Stdout::closed() => break Ok(Ended::Cleanly("stopped")),
            Ok(None) => {}
            Ok(Some(ended)) => break Ok(ended),
            Err(e) => break Err(e),
        }
    };
    reader.abort();
    client.close().await;
    match ended? {
        Ended::Cleanly(how) => {
            view.say(how)?;
            view.out.flush()?;
            Ok(())
        }
        Ended::Broken(why) => bail!("the stream from the daemon broke off: {why}"),
    }
}

/// Whether a subscription ended because the daemon closed it on purpose
/// (it is stopping), not because something broke.
fn closed_on_purpose(e: &SubscribeError) -> bool {
    matches!(e, SubscribeError::Refused { code, .. }
        if *code == codes::CLOSE_DONE.into_inner() || *code == codes::CLOSE_SHUTDOWN.into_inner())
}

/// What `watch` has printed: every line starts with the wall-clock time, and
/// a line that would repeat the previous one for the same node (or the
/// previous line at all) is not printed again.
struct WatchView {
    out: Out,
    /// The cluster's clock at the last snapshot, and when it arrived here.
    clock: Option<(Timestamp, Instant)>,
    last_per_node: HashMap<LogicalNodeId, String>,
    last_line: String,
    /// When the event being printed was published (wall clock, ms since
    /// the Unix epoch): its lines carry that time, not the time they arrive.
    at_ms: Option<u64>,
}

impl WatchView {
    fn new() -> Self {
        Self {
            out: Out::new(),
            clock: None,
            last_per_node: HashMap::new(),
            last_line: String::new(),
            at_ms: None,
        }
    }

    /// The cluster's clock now, as best known here.
    fn now(&self) -> Timestamp {
        self.clock.map_or(Timestamp::from_millis(0), |(at, seen)| {
            at.saturating_add_ms(u64::try_from(seen.elapsed().as_millis()).unwrap_or(u64::MAX))
        })
    }

    fn say(&mut self, text: &str) -> std::io::Result<()> {
        if text == self.last_line {
            return Ok(());
        }
        let at = self.at_ms.map_or_else(clock, crate::words::clock_at);
        self.out.line(format_args!("{at} {text}"))?;
        text.clone_into(&mut self.last_line);
        Ok(())
    }

    fn node_line(&mut self, node: &LogicalNodeId, text: String) -> std::io::Result<()> {
        if self.last_per_node.get(node) == Some(&text) {
            return Ok(());
        }
        self.say(&text)?;
        self.last_per_node.insert(*node, text);
        Ok(())
    }

    /// Prints one frame; `Some` when the stream ended.
    fn frame(
        &mut self,
        frame: Result<Option<TelemetryFrame<ClusterSnapshot, ClusterEvent>>, SubscribeError>,
    ) -> std::io::Result<Option<Ended>> {
        let ended = match frame {
            Ok(Some(TelemetryFrame::Snapshot { state, .. })) => {
                self.snapshot(&state)?;
                None
            }
            Ok(Some(TelemetryFrame::Event { event, at_ms, .. })) => {
                self.at_ms = Some(at_ms);
                let printed = self.event(event);
                self.at_ms = None;
                printed?;
                None
            }
            Ok(Some(TelemetryFrame::Lagged { missed })) => {
                self.say(&format!(
                    "(missed {missed} events: this watch fell behind the daemon)"
                ))?;
                None
            }
            Ok(None) => Some(Ended::Cleanly("the daemon ended the stream (it stopped)")),
            Err(e) if closed_on_purpose(&e) => {
                Some(Ended::Cleanly("the daemon closed the stream (it stopped)"))
            }
            Err(e) => Some(Ended::Broken(swactor_engine::error_chain(&e))),
        };
        self.out.flush()?;
        Ok(ended)
    }

    fn snapshot(&mut self, s: &ClusterSnapshot) -> std::io::Result<()> {
        self.clock = Some((s.now, Instant::now()));
        self.say(&status_headline(s))?;
        // The nodes that are not ready; the ready ones are counted above.
        let busy: Vec<&NodeSummary> = s.nodes.iter().filter(|n| !n.ready).collect();
        for n in busy.iter().take(guard::CHANGES_SHOWN) {
            let text = node_text(n, s.now);
            self.node_line(&n.node, text)?;
        }
        if busy.len() > guard::CHANGES_SHOWN {
            self.say(&format!(
                "… and {} more not ready (`swactor status` lists them)",
                busy.len() - guard::CHANGES_SHOWN
            ))?;
        }
        for n in &s.nodes {
            self.last_per_node.insert(n.node, node_text(n, s.now));
        }
        Ok(())
    }

    fn event(&mut self, e: ClusterEvent) -> std::io::Result<()> {
        let now = self.now();
        match e {
            ClusterEvent::Node(n) => self.node_line(&n.node.clone(), node_text(&n, now)),
            ClusterEvent::Removed { node } => {
                // Said once, however often the daemon repeats it.
                if self.last_per_node.remove(&node).is_some() {
                    self.say(&format!("{node} removed"))?;
                }
                Ok(())
            }
            ClusterEvent::ShapeAccepted {
                generation,
                nodes: n,
            } => self.say(&format!(
                "shape accepted: generation {}, {}",
                generation.0,
                nodes(n)
            )),
            ClusterEvent::Converged {
                generation,
                nodes: n,
            } => self.say(&format!(
                "converged: generation {}, {} ready",
                generation.0,
                nodes(n as u64)
            )),
            ClusterEvent::Dispatched { node, op, effect } => {
                self.say(&format!("{node} {}: {}", op.attempt, effect_words(effect)))
            }
            ClusterEvent::Finished {
                node,
                op,
                outcome,
                folded,
            } => {
                let late = if folded {
                    ""
                } else {
                    " (a late result, ignored)"
                };
                self.say(&format!(
                    "{node} {}: {}{late}",
                    op.attempt,
                    crate::words::outcome_words(&outcome)
                ))
            }
            // Passes are the daemon's own bookkeeping.
            ClusterEvent::Pass { .. } | ClusterEvent::AgentJoined { .. } => Ok(()),
            ClusterEvent::Warning { message } => self.say(&format!("warning: {message}")),
            other => match crate::progress::note(&other, now) {
                Some(note) => self.say(&note),
                None => Ok(()),
            },
        }
    }
}

/// One node on one line: `worker-1 a3 failed, retrying in 12 s — reason`.
fn node_text(n: &NodeSummary, now: Timestamp) -> String {
    let error = match (&n.last_error, n.ready) {
        (Some(e), false) => format!(" — {e}"),
        _ => String::new(),
    };
    format!("{} {} {}{error}", n.node, n.attempt, state_text(n, now))
}
