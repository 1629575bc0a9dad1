//! `swactor logs NODE`: an agent's log.
//!
//! A `process` node's log is read from the state directory, with the daemon
//! running or not: the process provider keeps the end of every destroyed
//! attempt's log under `{state}/logs/` and the running attempts' logs are in
//! their node directories (see `swactor_providers::process::agent_logs`).
//! Any other node's log is on its machine (a container's log, a file on an
//! SSH host or a rented instance): the daemon reads it there through its
//! provider and streams it to the CLI.

use anyhow::{Context, Result, bail};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;
use swactor_providers::process::{AgentLog, LOG_ATTEMPTS_KEPT, agent_logs};
use swactor_provisioning::{LogicalNodeId, NodeAttemptId, RunId};

use crate::protocol::{AgentLogPiece, ControlRequest, ControlResponse};
use crate::state::StateDir;
use crate::words::{cut, cut_long_words};

/// Where the logs of nodes on other machines are, when the daemon is not
/// there to read them.
const NO_DAEMON: &str = "Only `process` nodes' logs are kept here; a `docker`, `ssh` or `vast` \
     node's log is on its machine, and is read through the daemon, which is not running \
     (`swactor up` starts it again)";

/// How often `--follow` looks for more output.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// What to show.
pub(crate) struct LogsOptions {
    /// The slot, e.g. `worker-0`.
    pub(crate) node: String,
    /// One attempt (its number) instead of the latest.
    pub(crate) attempt: Option<u64>,
    /// The run, when the state directory holds more than one.
    pub(crate) run: Option<String>,
    /// Keep printing what the agent writes until its attempt ends.
    pub(crate) follow: bool,
}

/// Prints the log; returns the exit code.
///
/// # Errors
/// A bad node id, no such log, or an unreadable file.
pub(crate) async fn logs(state_dir: &Path, opts: &LogsOptions) -> Result<i32> {
    let node = LogicalNodeId::parse(&opts.node).with_context(|| {
        format!(
            "{} is not a node id (a group id, a dash and an index, e.g. worker-0)",
            cut(&opts.node)
        )
    })?;
    if !state_dir.is_dir() {
        bail!("there is no state directory at {}", state_dir.display());
    }
    let elsewhere = if daemon_answers(state_dir) {
        match from_daemon(state_dir, &node, opts).await? {
            FromDaemon::Shown => return Ok(0),
            FromDaemon::InStateDir(None) => "Only `process` nodes' logs are kept here".to_owned(),
            FromDaemon::InStateDir(Some(why)) => {
                format!("The daemon read none: {why}. Only `process` nodes' logs are kept here")
            }
        }
    } else {
        NO_DAEMON.to_owned()
    };
    from_state_dir(state_dir, &node, opts, &elsewhere).await
}

/// Whether a daemon may answer for this state directory: one holds its
/// lock, or (no daemon ever ran here) it holds a ticket of one elsewhere.
fn daemon_answers(state_dir: &Path) -> bool {
    let Ok(state) = StateDir::open(state_dir.to_path_buf()) else {
        return false;
    };
    if state.has_lock_file() {
        state.running_daemon().is_some()
    } else {
        state.read_ticket().is_ok()
    }
}

/// What the daemon did with a request for a log.
enum FromDaemon {
    /// It sent the log, and it was printed.
    Shown,
    /// It says the log is in the state directory, and why when the node
    /// is not a `process` one.
    InStateDir(Option<String>),
}

/// Asks the daemon for the log and prints what it sends.
async fn from_daemon(
    state_dir: &Path,
    node: &LogicalNodeId,
    opts: &LogsOptions,
) -> Result<FromDaemon> {
    let request = ControlRequest::AgentLog {
        node: node.to_string(),
        attempt: opts.attempt,
        run: opts.run.clone(),
        follow: opts.follow,
    };
    crate::client::with_client(state_dir, async |client| {
        let (_conn, mut recv) = client.stream(&request).await?;
        let mut attempt = None;
        loop {
            let answer = crate::client::recv_answer(&mut recv)
                .await
                .context("lost contact with the daemon while it sent the log")?;
            let piece = match answer {
                Some(ControlResponse::AgentLog(piece)) => piece,
                Some(ControlResponse::Error(e)) => bail!("{}", cut_long_words(&e)),
                Some(other) => return Err(crate::client::unexpected(&other)),
                None if attempt.is_none() => {
                    bail!("the daemon closed the connection before it sent the log")
                }
                None => break,
            };
            match piece {
                AgentLogPiece::InStateDir { why } => return Ok(FromDaemon::InStateDir(why)),
                AgentLogPiece::Start {
                    attempt: a,
                    kind,
                    lease,
                } => {
                    attempt = Some(NodeAttemptId(a));
                    eprintln!(
                        "== {node} attempt {} ({kind} node, {lease}; read from its machine by \
                         the daemon) ==",
                        NodeAttemptId(a)
                    );
                }
                AgentLogPiece::Text(text) => {
                    let mut out = std::io::stdout().lock();
                    if !write_out(&mut out, text.as_bytes())? {
                        return Ok(FromDaemon::Shown);
                    }
                }
                AgentLogPiece::Broken(e) => {
                    bail!("reading the log broke off: {}", cut_long_words(&e))
                }
            }
        }
        if opts.follow
            && let Some(a) = attempt
        {
            eprintln!("== {node} attempt {a} has ended; nothing more will be written ==");
        }
        Ok(FromDaemon::Shown)
    })
    .await
}

/// Prints a `process` node's log from the state directory; `elsewhere`
/// says where other nodes' logs are, for when there is none here.
async fn from_state_dir(
    state_dir: &Path,
    node: &LogicalNodeId,
    opts: &LogsOptions,
    elsewhere: &str,
) -> Result<i32> {
    let run = match &opts.run {
        Some(r) => RunId::new(r.clone()),
        None => only_run(state_dir, elsewhere)?,
    };
    let all = agent_logs(state_dir, &run, node)
        .with_context(|| format!("cannot read the logs of {node}"))?;
    let Some(log) = pick(&all, opts.attempt) else {
        let kept: Vec<String> = all.iter().map(|l| l.attempt.to_string()).collect();
        match opts.attempt {
            Some(a) if !all.is_empty() => bail!(
                "no log of {node} attempt a{a} in run {run}; there are: {} (a slot keeps the \
                 log of its current attempt and those of its last {LOG_ATTEMPTS_KEPT} ended \
                 ones)",
                kept.join(", ")
            ),
            _ => {
                bail!("no log of {node} in run {run}: it never had a local agent here. {elsewhere}")
            }
        }
    };
    let what = if log.live {
        "running or not yet cleaned up"
    } else {
        "its lease is gone; this is the kept end of its log"
    };
    eprintln!("== {node} attempt {} ({what}) ==", log.attempt);
    let mut out = std::io::stdout().lock();
    let mut file = std::fs::File::open(&log.path)
        .with_context(|| format!("cannot open {}", log.path.display()))?;
    let copied = copy(&mut file, &mut out)?;
    if !copied {
        return Ok(0);
    }
    if !opts.follow {
        return Ok(0);
    }
    if !log.live {
        eprintln!("== the attempt has ended; nothing more will be written ==");
        return Ok(0);
    }
    drop(out);
    loop {
        tokio::time::sleep(FOLLOW_POLL).await;
        let mut out = std::io::stdout().lock();
        if !copy(&mut file, &mut out)? {
            return Ok(0);
        }
        if !log.path.exists() {
            // The lease was destroyed (its file is gone from its directory);
            // what was written is already printed.
            eprintln!(
                "== {node} attempt {} ended; its log is kept ==",
                log.attempt
            );
            return Ok(0);
        }
    }
}

/// The wanted attempt's log, or the latest.
fn pick(all: &[AgentLog], attempt: Option<u64>) -> Option<&AgentLog> {
    match attempt {
        Some(a) => all.iter().find(|l| l.attempt.0 == a),
        None => all.last(),
    }
}

/// Copies what is new in `file` to `out`. False once `out` is closed (a
/// pager or `head` quit): the caller stops quietly.
fn copy(file: &mut std::fs::File, out: &mut impl Write) -> Result<bool> {
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf).context("cannot read the log")?;
        if n == 0 {
            break;
        }
        if !write_out(out, &buf[..n])? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Writes `bytes` to `out` and flushes it. False once `out` is closed.
fn write_out(out: &mut impl Write, bytes: &[u8]) -> Result<bool> {
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The one run this state directory holds nodes or kept logs of.
fn only_run(state_dir: &Path, elsewhere: &str) -> Result<RunId> {
    let mut runs = std::collections::BTreeSet::new();
    for sub in ["nodes", "logs"] {
        if let Ok(entries) = std::fs::read_dir(state_dir.join(sub)) {
            for e in entries.flatten() {
                if e.path().is_dir() {
                    runs.insert(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
    }
    let mut runs = runs.into_iter();
    match (runs.next(), runs.next()) {
        (Some(run), None) => Ok(RunId::new(run)),
        (None, _) => bail!(
            "{} holds no agent logs: no `process` node was ever started there. {elsewhere}",
            state_dir.display()
        ),
        (Some(a), Some(b)) => bail!(
            "{} holds logs of more than one run ({a}, {b}, …); say which with --run",
            state_dir.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_prints_only_what_is_new_and_stops_quietly_on_a_closed_pipe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.log");
        std::fs::write(&path, "one\n").unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        let mut out = Vec::new();
        assert!(copy(&mut file, &mut out).unwrap());
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"two\n")
            .unwrap();
        assert!(copy(&mut file, &mut out).unwrap());
        assert_eq!(out, b"one\ntwo\n");

        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut file = std::fs::File::open(&path).unwrap();
        assert!(!copy(&mut file, &mut Closed).unwrap());
    }

    #[test]
    fn a_long_id_is_cut() {
        let long = "x".repeat(5000);
        let shown = cut(&long);
        assert!(
            shown.len() < 80 && shown.ends_with("(5000 characters)"),
            "{shown}"
        );
    }
}
