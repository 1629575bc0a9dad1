//! `swactor logs NODE`: an agent's log, read from the state directory.
//!
//! Works with the daemon running or not: the process provider keeps the end
//! of every destroyed attempt's log under `{state}/logs/` and the running
//! attempts' logs are in their node directories (see
//! `swactor_providers::process::agent_logs`).

use anyhow::{Context, Result, bail};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;
use swactor_providers::process::{AgentLog, LOG_ATTEMPTS_KEPT, agent_logs};
use swactor_provisioning::{LogicalNodeId, RunId};

use crate::words::cut;

/// Where the logs of nodes on other machines are.
const ELSEWHERE: &str = "Logs are kept here only for `process` nodes; a `docker` node's agent \
     logs to its container (`docker logs swactor_RUN_NODE_aN`, its name in `swactor describe`), \
     an `ssh` node's to `~/.swactor/nodes/RUN/NODE-aN/agent.log` on its host";

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
    let run = match &opts.run {
        Some(r) => RunId::new(r.clone()),
        None => only_run(state_dir)?,
    };
    let all = agent_logs(state_dir, &run, &node)
        .with_context(|| format!("cannot read the logs of {node}"))?;
    let Some(log) = pick(&all, opts.attempt) else {
        let kept: Vec<String> = all.iter().map(|l| l.attempt.to_string()).collect();
        match opts.attempt {
            Some(a) if !all.is_empty() => bail!(
                "no log of {node} attempt a{a} in run {run}; there are: {} (the last {LOG_ATTEMPTS_KEPT} attempts of a slot are kept)",
                kept.join(", ")
            ),
            _ => {
                bail!("no log of {node} in run {run}: it never had a local agent here. {ELSEWHERE}")
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
        match out.write_all(&buf[..n]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
    match out.flush() {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The one run this state directory holds nodes or kept logs of.
fn only_run(state_dir: &Path) -> Result<RunId> {
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
            "{} holds no agent logs: no `process` node was ever started there. {ELSEWHERE}",
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
