//! The conformance battery at the process level: seeded fault scripts made of
//! real signals and real errors, against the real daemon and real agents,
//! over two providers: local processes, and SSH hosts (real OpenSSH servers
//! on 127.0.0.1, each with a home of its own).
//!
//! While a script runs, a watcher scans `/proc` every 20 ms and records any
//! moment at which two live agent processes serve the same (node, attempt):
//! that would be a double create. After the script the faults stop, the
//! final shape must converge with exactly one live agent per node (its
//! current attempt), and `down` must leave no agent process, no node
//! directory and (over SSH) no claim on any host.
//!
//! `SWACTOR_PROCESS_SEEDS` sets how many seeds run per provider (default
//! 16); `SWACTOR_PROCESS_SEED` replays one seed alone.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use swactor_providers::ssh::testing::Sshd;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Where the battery's nodes run.
enum Backend {
    /// Local agent processes.
    Process,
    /// A pool of SSH hosts (one more than the most nodes a script asks for).
    Ssh { hosts: Vec<Sshd>, agent: PathBuf },
}

impl Backend {
    fn ssh(root: &Path, state: &Path) -> Self {
        let o = cli(state, &["ssh-key"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let key = stdout(&o).trim().to_owned();
        let hosts = (0..5)
            .map(|i| {
                let dir = root.join(format!("host{i}"));
                std::fs::create_dir_all(&dir).unwrap();
                Sshd::start(&dir, std::slice::from_ref(&key))
            })
            .collect();
        // The hosts are this machine: the uploaded agent runs this build.
        let agent = root.join("agent.sh");
        std::fs::write(&agent, format!("#!/bin/sh\nexec {BIN} \"$@\"\n")).unwrap();
        Self::Ssh { hosts, agent }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Process => "process",
            Self::Ssh { .. } => "ssh",
        }
    }

    fn shape(&self, run: &str, count: u32, boot_ok: bool) -> String {
        let check = if boot_ok { "true" } else { "false" };
        match self {
            Self::Process => format!(
                "run = \"{run}\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"process\"\n\
                 boot_check = [\"{check}\"]\nlost_grace_s = 0.5\n"
            ),
            Self::Ssh { hosts, .. } => {
                let hosts: Vec<String> = hosts
                    .iter()
                    .map(|h| format!("\"{}\"", h.target()))
                    .collect();
                format!(
                    "run = \"{run}\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"ssh\"\n\
                     hosts = [{}]\nboot_check = [\"{check}\"]\nlost_grace_s = 0.5\n\
                     [group.params]\ntrust_on_first_use = true\nunreachable_give_up_s = 5\n",
                    hosts.join(", ")
                )
            }
        }
    }

    fn start(&self, state: &Path, shape: &Path) -> Daemon {
        match self {
            Self::Process => Daemon::start(state, shape),
            Self::Ssh { agent, .. } => {
                let agent = agent.to_str().unwrap();
                Daemon::spawn_with(state, Some(shape), &["--agent-binary", agent])
                    .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log))
            }
        }
    }

    /// Live agents: (node, attempt) → pids.
    fn agents(&self, state: &Path) -> BTreeMap<(String, u64), Vec<u32>> {
        match self {
            Self::Process => agents(state),
            Self::Ssh { hosts, .. } => {
                let homes: Vec<PathBuf> = hosts
                    .iter()
                    .filter_map(|h| h.home().canonicalize().ok())
                    .collect();
                remote_agents(&homes)
            }
        }
    }

    /// What is left after `down`: node directories, and claims on hosts.
    fn leftovers(&self, state: &Path) -> Vec<String> {
        match self {
            Self::Process => node_dirs(state)
                .into_iter()
                .map(|d| d.display().to_string())
                .collect(),
            Self::Ssh { hosts, .. } => hosts
                .iter()
                .flat_map(|h| {
                    let home = h.home();
                    let claim = std::fs::read_to_string(home.join(".swactor/claim"))
                        .ok()
                        .map(|c| format!("{}: claim {}", h.target(), c.trim()));
                    let dirs = std::fs::read_dir(home.join(".swactor/nodes"))
                        .into_iter()
                        .flatten()
                        .flatten()
                        .flat_map(|run| {
                            std::fs::read_dir(run.path())
                                .into_iter()
                                .flatten()
                                .flatten()
                        })
                        .map(|d| d.path().display().to_string());
                    claim.into_iter().chain(dirs).collect::<Vec<_>>()
                })
                .collect(),
        }
    }

    /// A host's SSH server goes away for a moment (its agents keep running).
    fn blip(&mut self, rng: &mut Rng) -> Option<String> {
        let Self::Ssh { hosts, .. } = self else {
            return None;
        };
        let i = rng.below(hosts.len() as u64) as usize;
        hosts[i].stop();
        std::thread::sleep(Duration::from_millis(300));
        hosts[i].start_again();
        Some(format!("sshd of host {i} down for 0.3 s"))
    }
}

/// Agents on SSH hosts (this machine's processes whose working directory is
/// an attempt directory under one of `homes`).
fn remote_agents(homes: &[PathBuf]) -> BTreeMap<(String, u64), Vec<u32>> {
    let mut out: BTreeMap<(String, u64), Vec<u32>> = BTreeMap::new();
    for (pid, cwd) in agent_cwds() {
        for home in homes {
            let Ok(rest) = cwd.strip_prefix(home.join(".swactor/nodes")) else {
                continue;
            };
            // {run}/{node}-a{attempt}
            let name = rest.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some((node, attempt)) = name.rsplit_once("-a")
                && let Ok(attempt) = attempt.parse::<u64>()
            {
                out.entry((node.to_owned(), attempt)).or_default().push(pid);
            }
        }
    }
    out
}

/// What an `apply` said, in a few words: its exit code and its last line.
fn outcome(o: &std::process::Output) -> String {
    let out = format!("{}{}", stdout(o), stderr(o));
    let last = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    format!("exit {:?}: {}", o.status.code(), last.trim())
}

fn signal(sig: &str, pid: u32) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

fn random_agent(backend: &Backend, state: &Path, rng: &mut Rng) -> Option<u32> {
    let all: Vec<u32> = backend.agents(state).into_values().flatten().collect();
    (!all.is_empty()).then(|| all[rng.below(all.len() as u64) as usize])
}

fn run_seed(seed: u64, ssh: bool) -> Result<String, String> {
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let mut backend = if ssh {
        Backend::ssh(tmp.path(), &state)
    } else {
        Backend::Process
    };
    let run = format!("battery-{seed}");
    let mut generation_files = 0;
    let mut write = |body: String| {
        generation_files += 1;
        shape_file(tmp.path(), &format!("s{generation_files}.toml"), &body)
    };
    let first = write(backend.shape(&run, 1 + rng.below(3) as u32, true));
    let mut daemon = backend.start(&state, &first);

    let stop = Arc::new(AtomicBool::new(false));
    let doubles: Arc<Mutex<Vec<String>>> = Arc::default();
    let homes: Option<Vec<PathBuf>> = match &backend {
        Backend::Process => None,
        Backend::Ssh { hosts, .. } => Some(
            hosts
                .iter()
                .filter_map(|h| h.home().canonicalize().ok())
                .collect(),
        ),
    };
    let watcher = {
        let (stop, doubles, state) = (stop.clone(), doubles.clone(), state.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let live = match &homes {
                    None => agents(&state),
                    Some(homes) => remote_agents(homes),
                };
                for ((node, attempt), pids) in live {
                    if pids.len() > 1 {
                        doubles
                            .lock()
                            .unwrap()
                            .push(format!("{node} a{attempt}: pids {pids:?}"));
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let mut log = Vec::new();
    let steps = 4 + rng.below(4);
    let mut final_count = 2;
    for _ in 0..steps {
        match rng.below(8) {
            0 => {
                if let Some(pid) = random_agent(&backend, &state, &mut rng) {
                    log.push(format!("kill -9 agent {pid}"));
                    signal("-9", pid);
                }
            }
            1 => {
                if let Some(pid) = random_agent(&backend, &state, &mut rng) {
                    log.push(format!("SIGTERM agent {pid}"));
                    signal("-TERM", pid);
                }
            }
            2 => {
                // Stopped past its grace period: the daemon replaces it while
                // the old process still exists; it must be killed, not doubled.
                if let Some(pid) = random_agent(&backend, &state, &mut rng) {
                    log.push(format!("SIGSTOP agent {pid} for 1.5 s"));
                    signal("-STOP", pid);
                    std::thread::sleep(Duration::from_millis(1_500));
                    signal("-CONT", pid);
                }
            }
            3 => {
                final_count = 1 + rng.below(4) as u32;
                let f = write(backend.shape(&run, final_count, true));
                let o = cli(&state, &["apply", f.to_str().unwrap(), "--yes"]);
                log.push(format!("scale to {final_count} ({})", outcome(&o)));
            }
            4 => {
                let f = write(backend.shape(&run, final_count, false));
                let o = cli(&state, &["apply", f.to_str().unwrap(), "--yes"]);
                log.push(format!("apply a failing boot check ({})", outcome(&o)));
            }
            5 => {
                log.push("kill -9 the daemon and start it again".to_owned());
                daemon.kill9();
                std::thread::sleep(Duration::from_millis(200));
                let f = write(backend.shape(&run, final_count, true));
                daemon = backend.start(&state, &f);
            }
            6 => {
                if let Some(what) = backend.blip(&mut rng) {
                    log.push(what);
                }
            }
            _ => {
                let ms = rng.below(800);
                log.push(format!("wait {ms} ms"));
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        std::thread::sleep(Duration::from_millis(rng.below(300)));
    }

    // Faults stop: the final shape must converge, one agent per node.
    let last = write(backend.shape(&run, final_count, true));
    let applied = cli(&state, &["apply", last.to_str().unwrap(), "--yes"]);
    if !applied.status.success() {
        return Err(format!(
            "final apply failed: {}; log {log:?}",
            stderr(&applied)
        ));
    }
    let final_outcome = outcome(&applied);
    let snap = match try_wait_converged(&state, Duration::from_secs(90), |s| {
        s.nodes.len() == final_count as usize
    }) {
        Ok(snap) => snap,
        Err(last) => {
            return Err(format!(
                "not converged to {final_count} node(s) within 90 s after the final apply \
                 ({final_outcome}); log {log:?}; last status {last:#?}"
            ));
        }
    };
    std::thread::sleep(Duration::from_millis(500));
    let live = backend.agents(&state);
    let expected: BTreeMap<(String, u64), usize> = snap
        .nodes
        .iter()
        .map(|n| ((n.node.to_string(), n.attempt.0), 1))
        .collect();
    let got: BTreeMap<(String, u64), usize> =
        live.iter().map(|(k, v)| (k.clone(), v.len())).collect();
    let down = cli(&state, &["down"]);
    let exit = daemon.wait_exit(Duration::from_secs(60));
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let doubles = doubles.lock().unwrap().clone();
    let leftovers = (backend.agents(&state), backend.leftovers(&state));
    if !doubles.is_empty() {
        return Err(format!(
            "two live agents for one identity: {doubles:?}; log {log:?}"
        ));
    }
    if got != expected {
        return Err(format!(
            "converged agents {got:?} != nodes {expected:?}; log {log:?}"
        ));
    }
    if !down.status.success() || exit != Some(0) {
        return Err(format!(
            "down failed ({:?}): {}; log {log:?}",
            exit,
            stderr(&down)
        ));
    }
    if !leftovers.0.is_empty() || !leftovers.1.is_empty() {
        return Err(format!(
            "left behind after down: {leftovers:?}; log {log:?}"
        ));
    }
    Ok(format!(
        "{} seed {seed}: {} steps, {final_count} node(s): {}",
        backend.name(),
        log.len(),
        log.join("; ")
    ))
}

#[test]
fn seeded_real_faults_never_double_an_agent_and_down_leaves_nothing() {
    battery(false);
}

#[test]
fn seeded_real_faults_over_ssh_hosts_never_double_an_agent_and_down_leaves_nothing() {
    battery(true);
}

fn battery(ssh: bool) {
    let seeds: Vec<u64> = match std::env::var("SWACTOR_PROCESS_SEED") {
        Ok(s) => vec![s.parse().expect("SWACTOR_PROCESS_SEED is a number")],
        Err(_) => {
            let n = std::env::var("SWACTOR_PROCESS_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(16);
            (0..n).collect()
        }
    };
    let failures: Mutex<Vec<String>> = Mutex::default();
    // Four seeds at a time: most of a seed's time is spent waiting on processes.
    for chunk in seeds.chunks(4) {
        std::thread::scope(|s| {
            for &seed in chunk {
                let failures = &failures;
                s.spawn(move || match run_seed(seed, ssh) {
                    Ok(summary) => eprintln!("{summary}"),
                    Err(e) => {
                        eprintln!("seed {seed} FAILED (details at the end)");
                        failures.lock().unwrap().push(format!("seed {seed}: {e}"));
                    }
                });
            }
        });
    }
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} seed(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
