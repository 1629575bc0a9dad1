//! Linux process plumbing: whether a pid is our agent, finding agents in `/proc`, whether a group still runs, signals.

use rustix::io::Errno;
use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
use std::collections::HashMap;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use swactor_provisioning::ResourceKey;

/// The arguments that mark a process as the agent of one node directory.
///
/// The directory is part of it, so two providers with different state
/// directories (or a reused pid) are never mistaken for each other.
#[derive(Clone, Debug)]
pub(super) struct AgentIdentity {
    pairs: [(&'static [u8], Vec<u8>); 4],
}

impl AgentIdentity {
    pub(super) fn new(key: &ResourceKey, dir: &Path) -> Self {
        Self {
            pairs: [
                (b"--run", key.run_id.as_str().as_bytes().to_vec()),
                (b"--node", key.node.to_string().into_bytes()),
                (b"--attempt", key.attempt.0.to_string().into_bytes()),
                (b"--dir", dir.as_os_str().as_bytes().to_vec()),
            ],
        }
    }

    /// The `--dir` value: the node directory, as bytes.
    fn dir(&self) -> &[u8] {
        &self.pairs[3].1
    }

    /// True when the NUL-separated `cmdline` carries every identifying flag and value.
    fn matches(&self, cmdline: &[u8]) -> bool {
        self.matches_args(&split_args(cmdline))
    }

    fn matches_args(&self, args: &[&[u8]]) -> bool {
        self.pairs.iter().all(|(flag, value)| {
            args.windows(2)
                .any(|w| w[0] == *flag && w[1] == value.as_slice())
        })
    }
}

fn split_args(cmdline: &[u8]) -> Vec<&[u8]> {
    cmdline.split(|b| *b == 0).collect()
}

/// What a recorded agent pid currently names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leader {
    /// A running process that leads its own group and has our agent's arguments.
    Ours,
    /// A running process that is not our agent. Either the pid was reused,
    /// so our agent and (since Linux never reuses a pid still naming a group)
    /// its whole process group are gone; or it is a child our agent forked,
    /// which carries the agent's arguments until it calls exec (a subshell
    /// for ever) but does not lead a group, and must not be signalled as one.
    Foreign,
    /// No running process: exited, or a zombie waiting to be reaped. Members
    /// of its group may still run.
    Gone,
}

/// What `pid` names now, judged against `who`.
pub(super) fn leader(pid: i32, who: &AgentIdentity) -> Leader {
    let leads_group = match stat(pid) {
        None => return Leader::Gone,
        Some(s) if s.is_dead() => return Leader::Gone,
        Some(s) => s.pgrp == pid,
    };
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmdline) if leads_group && who.matches(&cmdline) => Leader::Ours,
        // A zombie's cmdline reads empty; one that died between the two reads
        // is gone, not foreign.
        Ok(cmdline) if cmdline.is_empty() => Leader::Gone,
        Ok(_) => Leader::Foreign,
        Err(_) => Leader::Gone,
    }
}

/// The running agents of each identity in `who`, found in ONE pass over
/// `/proc`: for `who[i]`, the pids of the live processes that lead their own
/// process group and carry `who[i]`'s arguments, oldest first.
///
/// Only group leaders count: the agent is spawned into a group of its own,
/// and a child it forks carries the same command line until it calls exec
/// (a shell's subshell, for ever) but stays in the agent's group.
///
/// The cost is a read of `/proc/{pid}/stat` per process and of
/// `/proc/{pid}/cmdline` per group leader; the identities are looked up by
/// their `--dir` value, so many of them cost no more than one.
///
/// # Errors
/// `/proc` cannot be listed; a scan that may have missed processes would
/// let a caller start a second agent, so there is no partial answer.
pub(super) fn scan_agents(who: &[&AgentIdentity]) -> io::Result<Vec<Vec<i32>>> {
    if who.is_empty() {
        return Ok(Vec::new());
    }
    // Per identity: (start time, pid) of each agent found.
    let mut found: Vec<Vec<(u64, i32)>> = vec![Vec::new(); who.len()];
    let mut by_dir: HashMap<&[u8], Vec<usize>> = HashMap::new();
    for (i, w) in who.iter().enumerate() {
        by_dir.entry(w.dir()).or_default().push(i);
    }
    let mut candidates = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // A process gone since the listing, or a zombie, is no agent.
        let Some(s) = stat(pid).filter(|s| s.pgrp == pid && !s.is_dead()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args = split_args(&cmdline);
        candidates.clear();
        for w in args.windows(2).filter(|w| w[0] == b"--dir") {
            candidates.extend(by_dir.get(w[1]).into_iter().flatten().copied());
        }
        candidates.sort_unstable();
        candidates.dedup();
        for &i in &candidates {
            if who[i].matches_args(&args) {
                found[i].push((s.start, pid));
            }
        }
    }
    Ok(found
        .into_iter()
        .map(|mut agents| {
            agents.sort_unstable();
            agents.into_iter().map(|(_, pid)| pid).collect()
        })
        .collect())
}

/// True when some process of group `pgid` still runs.
///
/// `kill(-pgid, 0)` alone is not enough: it counts zombies, and orphaned
/// zombies stay until PID 1 reaps them, which some container inits never do.
pub(super) fn group_alive(pgid: i32) -> bool {
    let Some(pid) = group_pid(pgid) else {
        return false;
    };
    if test_kill_process_group(pid) == Err(Errno::SRCH) {
        return false;
    }
    // A running leader settles it with one read; only a group whose leader
    // is gone needs the scan, which a stop would otherwise repeat every poll.
    if stat(pgid).is_some_and(|s| s.pgrp == pgid && !s.is_dead()) {
        return true;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        // Without /proc there is no telling; assume it runs so callers keep
        // waiting and report an unconfirmed stop instead of a false success.
        return true;
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .any(|p| stat(p).is_some_and(|s| s.pgrp == pgid && !s.is_dead()))
}

/// Sends `signal` to group `pgid`; `Ok(false)` when the group no longer exists.
pub(super) fn signal_group(pgid: i32, signal: Signal) -> io::Result<bool> {
    let Some(pid) = group_pid(pgid) else {
        return Ok(false);
    };
    match kill_process_group(pid, signal) {
        Ok(()) => Ok(true),
        Err(Errno::SRCH) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The group to signal, refusing 0 and 1: `kill(-1, ..)` would signal every
/// process we may signal, and no agent of ours is ever init.
fn group_pid(pgid: i32) -> Option<Pid> {
    if pgid <= 1 {
        return None;
    }
    Pid::from_raw(pgid)
}

/// The fields of `/proc/{pid}/stat` this module reads.
struct Stat {
    state: u8,
    pgrp: i32,
    /// Start time in clock ticks after boot; orders agents by age.
    start: u64,
}

impl Stat {
    /// Zombie or dead: it holds a pid but runs no code.
    fn is_dead(&self) -> bool {
        matches!(self.state, b'Z' | b'X' | b'x')
    }
}

fn stat(pid: i32) -> Option<Stat> {
    let raw = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself hold spaces and
    // parentheses, so the fixed fields start after the last ')'.
    let close = raw.iter().rposition(|b| *b == b')')?;
    let rest = std::str::from_utf8(raw.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    // Field 22 of the file; `pgrp` was field 5.
    let start = fields.nth(16).and_then(|f| f.parse().ok()).unwrap_or(0);
    Some(Stat { state, pgrp, start })
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId, RunId};

    fn identity() -> AgentIdentity {
        let key = ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(4),
        };
        AgentIdentity::new(&key, Path::new("/s/nodes/r/w-0-a4"))
    }

    #[test]
    fn an_agent_is_recognised_by_all_four_identifying_arguments() {
        let ours = b"/bin/sh\0agent.sh\0--run\0r\0--node\0w-0\0--attempt\x004\0--daemon\0t\0--dir\0/s/nodes/r/w-0-a4\0";
        assert!(identity().matches(ours));
        let other_attempt =
            b"sh\0--run\0r\0--node\0w-0\0--attempt\x005\0--dir\0/s/nodes/r/w-0-a4\0";
        assert!(!identity().matches(other_attempt));
        let other_dir = b"sh\0--run\0r\0--node\0w-0\0--attempt\x004\0--dir\0/t/nodes/r/w-0-a4\0";
        assert!(!identity().matches(other_dir));
        assert!(!identity().matches(b""));
    }

    #[test]
    fn this_process_is_foreign_and_never_group_one() {
        assert_eq!(
            leader(std::process::id() as i32, &identity()),
            Leader::Foreign
        );
        assert!(!signal_group(1, Signal::TERM).unwrap());
        assert!(!group_alive(0));
    }

    #[test]
    fn a_scan_answers_per_identity_and_finds_no_agent_nobody_runs() {
        assert!(scan_agents(&[]).unwrap().is_empty());
        let (a, b) = (identity(), identity());
        assert_eq!(
            scan_agents(&[&a, &b]).unwrap(),
            [Vec::<i32>::new(), Vec::new()]
        );
        let me = stat(std::process::id() as i32).unwrap();
        assert!(me.start > 0 && !me.is_dead());
    }
}
