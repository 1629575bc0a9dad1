//! Linux process plumbing: whether a pid is our agent, whether its group still runs, signals.

use rustix::io::Errno;
use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
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

    /// True when the NUL-separated `cmdline` carries every identifying flag and value.
    fn matches(&self, cmdline: &[u8]) -> bool {
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        self.pairs.iter().all(|(flag, value)| {
            args.windows(2)
                .any(|w| w[0] == *flag && w[1] == value.as_slice())
        })
    }
}

/// What a recorded agent pid currently names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leader {
    /// A running process with our agent's arguments.
    Ours,
    /// A running process that is someone else: the pid was reused, so our
    /// agent and (since Linux never reuses a pid still naming a group) its
    /// whole process group are gone.
    Foreign,
    /// No running process: exited, or a zombie waiting to be reaped. Members
    /// of its group may still run.
    Gone,
}

/// What `pid` names now, judged against `who`.
pub(super) fn leader(pid: i32, who: &AgentIdentity) -> Leader {
    match stat(pid) {
        None => return Leader::Gone,
        Some(s) if s.is_dead() => return Leader::Gone,
        Some(_) => {}
    }
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmdline) if who.matches(&cmdline) => Leader::Ours,
        // A zombie's cmdline reads empty; one that died between the two reads
        // is gone, not foreign.
        Ok(cmdline) if cmdline.is_empty() => Leader::Gone,
        Ok(_) => Leader::Foreign,
        Err(_) => Leader::Gone,
    }
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
    Some(Stat { state, pgrp })
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
}
