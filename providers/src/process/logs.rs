//! Agent logs kept after their attempt's node directory is removed.
//!
//! A destroyed lease's `agent.log` (after the previous agent's, if the
//! lease's agent was started again) is copied, cut to its last
//! [`LOG_KEEP_BYTES`], to `{state_dir}/logs/{run}/{node}/a{attempt}.log`
//! before the directory goes, so a failed attempt's real error outlives it.
//! Only the [`LOG_ATTEMPTS_KEPT`] newest attempts of a slot are kept, and at
//! most [`LOG_RUN_BYTES_MAX`] per run: past it, the oldest kept logs of the
//! run are removed until it holds three quarters of that. Directories are
//! 0700 and files 0600, like the node directories they come from.
//!
//! Keeping a log is best effort: a destroy never fails because its log could
//! not be kept (the provider warns instead).

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use swactor_provisioning::{LogicalNodeId, NodeAttemptId, ResourceKey, RunId};

/// Bytes kept of one attempt's log (its end).
pub const LOG_KEEP_BYTES: u64 = 256 * 1024;
/// Attempts whose logs are kept per slot.
pub const LOG_ATTEMPTS_KEPT: usize = 3;
/// Bytes of kept logs per run.
pub const LOG_RUN_BYTES_MAX: u64 = 64 * 1024 * 1024;

/// One attempt's agent log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentLog {
    /// The attempt.
    pub attempt: NodeAttemptId,
    /// Where it is.
    pub path: PathBuf,
    /// True for the log of a lease that still exists (its agent may still
    /// write to it); false for a kept copy.
    pub live: bool,
}

/// The directory of `node`'s kept logs.
fn node_logs_dir(state_dir: &Path, run: &RunId, node: &LogicalNodeId) -> PathBuf {
    state_dir
        .join("logs")
        .join(run.as_str())
        .join(node.to_string())
}

/// Where `key`'s log is kept once its lease is destroyed.
pub fn kept_log_path(state_dir: &Path, key: &ResourceKey) -> PathBuf {
    node_logs_dir(state_dir, &key.run_id, &key.node).join(format!("a{}.log", key.attempt.0))
}

/// Every log of `node` in `run` on this state directory, oldest attempt
/// first: the kept copies and the logs of leases that still exist (a
/// lease's own log wins over a copy of the same attempt).
///
/// # Errors
/// A directory exists but cannot be read.
pub fn agent_logs(
    state_dir: &Path,
    run: &RunId,
    node: &LogicalNodeId,
) -> io::Result<Vec<AgentLog>> {
    let mut logs: HashMap<u64, AgentLog> = HashMap::new();
    for (attempt, path) in kept_logs(&node_logs_dir(state_dir, run, node))? {
        logs.insert(
            attempt,
            AgentLog {
                attempt: NodeAttemptId(attempt),
                path,
                live: false,
            },
        );
    }
    let run_dir = state_dir.join("nodes").join(run.as_str());
    let prefix = format!("{node}-a");
    match fs::read_dir(&run_dir) {
        Ok(entries) => {
            for entry in entries {
                let entry = entry?;
                let name = entry.file_name();
                let Some(attempt) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix(&prefix))
                    .and_then(|a| a.parse::<u64>().ok())
                else {
                    continue;
                };
                let path = entry.path().join(super::LOG_FILE);
                if path.exists() {
                    logs.insert(
                        attempt,
                        AgentLog {
                            attempt: NodeAttemptId(attempt),
                            path,
                            live: true,
                        },
                    );
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut logs: Vec<AgentLog> = logs.into_values().collect();
    logs.sort_by_key(|l| l.attempt);
    Ok(logs)
}

/// The kept logs in `dir`, by attempt number.
fn kept_logs(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut logs = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(attempt) = name
            .to_str()
            .and_then(|n| n.strip_prefix('a'))
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|a| a.parse::<u64>().ok())
        {
            logs.push((attempt, entry.path()));
        }
    }
    logs.sort();
    Ok(logs)
}

/// Keeps the logs of destroyed leases; see the module docs.
#[derive(Debug, Default)]
pub(super) struct LogKeeper {
    /// Bytes of kept logs per run, counted once per process and then tracked.
    used: Mutex<HashMap<RunId, u64>>,
}

impl LogKeeper {
    /// Copies the end of the logs in `node_dir` (the lease of `key`) to
    /// their kept place, then enforces the per-slot and per-run limits.
    pub(super) fn keep(
        &self,
        state_dir: &Path,
        key: &ResourceKey,
        node_dir: &Path,
    ) -> io::Result<()> {
        let sources = [
            node_dir.join(super::PREVIOUS_LOG_FILE),
            node_dir.join(super::LOG_FILE),
        ];
        let (tail, dropped) = read_tail(&sources, LOG_KEEP_BYTES)?;
        if tail.is_empty() && dropped == 0 {
            return Ok(());
        }
        let dir = node_logs_dir(state_dir, &key.run_id, &key.node);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let path = kept_log_path(state_dir, key);
        let tmp = path.with_extension("log.tmp");
        {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            if dropped > 0 {
                writeln!(
                    f,
                    "[swactor: the first {dropped} bytes of this log were not kept]"
                )?;
            }
            f.write_all(&tail)?;
        }
        fs::rename(&tmp, &path)?;
        let written = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let mut freed = 0;
        let kept = kept_logs(&dir)?;
        let excess = kept.len().saturating_sub(LOG_ATTEMPTS_KEPT);
        for (_, old) in kept.into_iter().take(excess) {
            freed += fs::metadata(&old).map(|m| m.len()).unwrap_or(0);
            fs::remove_file(&old)?;
        }
        let run_dir = state_dir.join("logs").join(key.run_id.as_str());
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        let total = match used.get(&key.run_id) {
            Some(t) => (t + written).saturating_sub(freed),
            // The first keep of this process counts what is there.
            None => run_bytes(&run_dir)?,
        };
        let total = if total > LOG_RUN_BYTES_MAX {
            trim_run(&run_dir, LOG_RUN_BYTES_MAX / 4 * 3)?
        } else {
            total
        };
        used.insert(key.run_id.clone(), total);
        Ok(())
    }
}

/// The last `max` bytes of the concatenated `sources` (missing ones are
/// empty), and how many bytes before them were left out.
fn read_tail(sources: &[PathBuf], max: u64) -> io::Result<(Vec<u8>, u64)> {
    let mut lens = Vec::with_capacity(sources.len());
    for s in sources {
        lens.push(match fs::metadata(s) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        });
    }
    let total: u64 = lens.iter().sum();
    let mut skip = total.saturating_sub(max);
    let dropped = skip;
    let mut out = Vec::new();
    for (s, len) in sources.iter().zip(lens) {
        if skip >= len {
            skip -= len;
            continue;
        }
        let mut f = match File::open(s) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        f.seek(SeekFrom::Start(skip))?;
        // The file may have grown since it was measured: read only what was.
        f.take(len - skip).read_to_end(&mut out)?;
        skip = 0;
    }
    Ok((out, dropped))
}

/// Every kept log of the run: (modified, bytes, path).
fn run_logs(run_dir: &Path) -> io::Result<Vec<(std::time::SystemTime, u64, PathBuf)>> {
    let nodes = match fs::read_dir(run_dir) {
        Ok(nodes) => nodes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut logs = Vec::new();
    for node in nodes {
        let node = node?.path();
        for (_, path) in kept_logs(&node)? {
            let m = fs::metadata(&path)?;
            logs.push((m.modified()?, m.len(), path));
        }
    }
    Ok(logs)
}

fn run_bytes(run_dir: &Path) -> io::Result<u64> {
    Ok(run_logs(run_dir)?.iter().map(|(_, len, _)| len).sum())
}

/// Removes the run's oldest kept logs until it holds at most `target` bytes;
/// returns what it then holds.
fn trim_run(run_dir: &Path, target: u64) -> io::Result<u64> {
    let mut logs = run_logs(run_dir)?;
    logs.sort();
    let mut total: u64 = logs.iter().map(|(_, len, _)| len).sum();
    for (_, len, path) in logs {
        if total <= target {
            break;
        }
        fs::remove_file(&path)?;
        if let Some(dir) = path.parent() {
            // Fails harmlessly while the slot has other logs.
            let _ = fs::remove_dir(dir);
        }
        total -= len;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(node: &str, attempt: u64) -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(attempt),
        }
    }

    #[test]
    fn a_kept_log_is_the_end_of_both_logs_and_only_the_newest_attempts_stay() {
        let state = tempfile::tempdir().unwrap();
        let keeper = LogKeeper::default();
        for attempt in 1..=5 {
            let dir = state.path().join(format!("nodes/r/w-0-a{attempt}"));
            fs::create_dir_all(&dir).unwrap();
            fs::write(
                dir.join(super::super::PREVIOUS_LOG_FILE),
                b"earlier agent\n",
            )
            .unwrap();
            let body = format!("{}attempt {attempt} failed: boom\n", "x".repeat(300 * 1024));
            fs::write(dir.join(super::super::LOG_FILE), body).unwrap();
            keeper
                .keep(state.path(), &key("w-0", attempt), &dir)
                .unwrap();
            fs::remove_dir_all(&dir).unwrap();
        }
        let logs = agent_logs(state.path(), &RunId::new("r"), &key("w-0", 0).node).unwrap();
        let attempts: Vec<u64> = logs.iter().map(|l| l.attempt.0).collect();
        assert_eq!(attempts, [3, 4, 5]);
        assert!(logs.iter().all(|l| !l.live));
        let text = fs::read_to_string(&logs[2].path).unwrap();
        assert!(
            text.ends_with("attempt 5 failed: boom\n"),
            "{}",
            &text[text.len() - 40..]
        );
        assert!(text.starts_with("[swactor: the first "), "{}", &text[..60]);
        assert!(text.len() as u64 <= LOG_KEEP_BYTES + 80);
        let mode = fs::metadata(&logs[2].path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }

    #[test]
    fn a_live_lease_log_is_listed_next_to_the_kept_ones() {
        let state = tempfile::tempdir().unwrap();
        let keeper = LogKeeper::default();
        let old = state.path().join("nodes/r/w-1-a2");
        fs::create_dir_all(&old).unwrap();
        fs::write(old.join(super::super::LOG_FILE), b"first\n").unwrap();
        keeper.keep(state.path(), &key("w-1", 2), &old).unwrap();
        fs::remove_dir_all(&old).unwrap();
        let live = state.path().join("nodes/r/w-1-a7");
        fs::create_dir_all(&live).unwrap();
        fs::write(live.join(super::super::LOG_FILE), b"running\n").unwrap();
        // Another slot whose name starts the same is not this one's.
        let other = state.path().join("nodes/r/w-10-a1");
        fs::create_dir_all(&other).unwrap();
        fs::write(other.join(super::super::LOG_FILE), b"other\n").unwrap();
        let logs = agent_logs(state.path(), &RunId::new("r"), &key("w-1", 0).node).unwrap();
        let seen: Vec<(u64, bool)> = logs.iter().map(|l| (l.attempt.0, l.live)).collect();
        assert_eq!(seen, [(2, false), (7, true)]);
    }

    #[test]
    fn a_run_over_its_budget_loses_its_oldest_kept_logs() {
        let state = tempfile::tempdir().unwrap();
        let run_dir = state.path().join("logs/r");
        for i in 0..8 {
            let dir = run_dir.join(format!("w-{i}"));
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("a1.log"), vec![b'x'; 1000]).unwrap();
            // Distinct modification times, oldest first.
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + i);
            File::options()
                .write(true)
                .open(dir.join("a1.log"))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        assert_eq!(run_bytes(&run_dir).unwrap(), 8000);
        assert_eq!(trim_run(&run_dir, 5000).unwrap(), 5000);
        let left: Vec<bool> = (0..8)
            .map(|i| run_dir.join(format!("w-{i}/a1.log")).exists())
            .collect();
        assert_eq!(left, [false, false, false, true, true, true, true, true]);
        assert!(
            !run_dir.join("w-0").exists(),
            "an emptied slot directory goes too"
        );
    }
}
