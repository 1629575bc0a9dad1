//! Running the real `swactor` binary: daemons, CLI calls, and counting agent processes.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;

pub const BIN: &str = env!("CARGO_BIN_EXE_swactor");

/// A shape file with `workers` workers (and optionally a coordinator).
pub fn shape_file(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

pub fn workers(run: &str, n: u32) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"worker\"\ncount = {n}\nprovider = \"process\"\nboot_check = [\"true\"]\nlost_grace_s = 1.0\n"
    )
}

/// Runs the CLI to completion.
pub fn cli(state: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .stdin(Stdio::null())
        .output()
        .expect("run swactor")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A daemon running in the background; killed (and its agents) when dropped.
pub struct Daemon {
    pub child: Option<Child>,
    pub state: PathBuf,
}

impl Daemon {
    pub fn start(state: &Path, shape: &Path) -> Self {
        let log = std::fs::File::create(state.with_extension("daemon.log")).unwrap();
        let child = Command::new(BIN)
            .arg("up")
            .arg(shape)
            .arg("--state-dir")
            .arg(state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        let d = Self {
            child: Some(child),
            state: state.to_path_buf(),
        };
        wait_for(Duration::from_secs(30), "the daemon's ticket", || {
            state.join("daemon.ticket").exists()
        });
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.with_extension("daemon.log")).unwrap_or_default()
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the daemon to exit on its own; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut c = self.child.take()?;
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(s)) = c.try_wait() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
        kill_agents(&self.state);
    }
}

pub fn wait_for(timeout: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

pub fn status(state: &Path) -> Option<ClusterSnapshot> {
    let o = cli(state, &["status", "--json"]);
    o.status
        .success()
        .then(|| serde_json::from_slice(&o.stdout).ok())
        .flatten()
}

/// Waits until `status` shows a converged cluster satisfying `pred`.
pub fn wait_converged(
    state: &Path,
    timeout: Duration,
    mut pred: impl FnMut(&ClusterSnapshot) -> bool,
) -> ClusterSnapshot {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < timeout {
        if let Some(s) = status(state) {
            if s.converged && pred(&s) {
                return s;
            }
            last = Some(s);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("not converged within {timeout:?}; last status: {last:#?}");
}

/// Live agent processes of this state directory: (node, attempt) → pids.
///
/// A child an agent forks (to run its boot check) carries the agent's command
/// line until it calls `exec`; it is not a second agent, so processes whose
/// parent is an agent of the same identity are left out.
pub fn agents(state: &Path) -> BTreeMap<(String, u64), Vec<u32>> {
    let needle = state.to_string_lossy().into_owned();
    let mut found: Vec<(u32, u32, (String, u64))> = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.iter().any(|a| a == "agent") || !args.iter().any(|a| a.contains(&needle)) {
            continue;
        }
        // `stat` is "pid (comm) state ppid ..."; comm may hold spaces, so split after ')'.
        let ppid = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0);
        // A zombie has an empty cmdline, so anything here is alive.
        let get = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned()
        };
        if let (Some(node), Some(attempt)) = (get("--node"), get("--attempt")) {
            found.push((pid, ppid, (node, attempt.parse().unwrap_or(0))));
        }
    }
    let mut out: BTreeMap<(String, u64), Vec<u32>> = BTreeMap::new();
    for (pid, ppid, id) in &found {
        let forked = found.iter().any(|(p, _, pid_id)| p == ppid && pid_id == id);
        if !forked {
            out.entry(id.clone()).or_default().push(*pid);
        }
    }
    out
}

/// Node directories left under the state directory.
pub fn node_dirs(state: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(runs) = std::fs::read_dir(state.join("nodes")) else {
        return out;
    };
    for run in runs.flatten() {
        if let Ok(nodes) = std::fs::read_dir(run.path()) {
            out.extend(nodes.flatten().map(|n| n.path()));
        }
    }
    out
}

pub fn kill_agents(state: &Path) {
    for pids in agents(state).values() {
        for pid in pids {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }
}

pub fn kill9(pid: u32) {
    let ok = Command::new("kill")
        .arg("-9")
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(ok.success(), "kill -9 {pid}");
}
