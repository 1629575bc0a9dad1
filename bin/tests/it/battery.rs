//! The conformance battery at the process level: seeded fault scripts made of
//! real signals and real errors, against the real daemon and real agents,
//! over three providers: local processes, SSH hosts (real OpenSSH servers
//! on 127.0.0.1, each with a home of its own), and containers on the real
//! Docker engine (faults made with the docker CLI: kill, rm -f, pause).
//!
//! While a script runs, a watcher records any moment at which two live
//! agents serve the same (node, attempt) (it scans `/proc` every 20 ms), or,
//! for containers, a slot has two containers at all (it lists them by label
//! every 20 ms): that would be a double create. After the script the faults
//! stop, the final shape must converge with exactly one live agent per node
//! (its current attempt), and `down` must leave no agent process, no node
//! directory, (over SSH) no claim on any host, and no container of the run.
//!
//! `SWACTOR_PROCESS_SEEDS` sets how many seeds run per provider (default
//! 16); `SWACTOR_PROCESS_SEED` replays one seed alone.

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use swactor_providers::ssh::testing::Sshd;

/// Where the battery's nodes run.
enum Backend {
    /// Local agent processes.
    Process,
    /// A pool of SSH hosts (one more than the most nodes a script asks for).
    Ssh { hosts: Vec<Sshd>, agent: PathBuf },
    /// Containers of the run on the Docker engine.
    Docker { run: String },
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Self::Docker { run } = self {
            docker::remove_run(run);
        }
    }
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
            Self::Docker { .. } => "docker",
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
            // The agent image holds nothing but the agent: `false` cannot start.
            Self::Docker { .. } => {
                let body = docker::docker_shape(run, count, "")
                    .replace("lost_grace_s = 1.0", "lost_grace_s = 0.5");
                if boot_ok {
                    body
                } else {
                    body.replace("boot_check = []", "boot_check = [\"false\"]")
                }
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
            Self::Docker { .. } => {
                let agent = docker::agent_binary();
                Daemon::spawn_with(
                    state,
                    Some(shape),
                    &["--agent-binary", agent.to_str().unwrap()],
                )
                .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log))
            }
        }
    }

    /// Live agents: (node, attempt) → pids (container names for docker).
    fn agents(&self, state: &Path) -> BTreeMap<(String, u64), Vec<String>> {
        let pids = |m: BTreeMap<(String, u64), Vec<u32>>| {
            m.into_iter()
                .map(|(k, v)| (k, v.iter().map(u32::to_string).collect()))
                .collect()
        };
        match self {
            Self::Process => pids(agents(state)),
            Self::Ssh { hosts, .. } => {
                let homes: Vec<PathBuf> = hosts
                    .iter()
                    .filter_map(|h| h.home().canonicalize().ok())
                    .collect();
                pids(remote_agents(&homes))
            }
            Self::Docker { run } => live_containers(run),
        }
    }

    /// What the watcher looks at: any moment two agents serve one (node,
    /// attempt), or (docker) a slot has two containers.
    fn doubles(&self, state: &Path) -> Box<dyn FnMut() -> Vec<String> + Send> {
        match self {
            Self::Process => {
                let state = state.to_path_buf();
                Box::new(move || doubled(agents(&state)))
            }
            Self::Ssh { hosts, .. } => {
                let homes: Vec<PathBuf> = hosts
                    .iter()
                    .filter_map(|h| h.home().canonicalize().ok())
                    .collect();
                Box::new(move || doubled(remote_agents(&homes)))
            }
            Self::Docker { run } => {
                let run = run.clone();
                Box::new(move || {
                    docker::by_slot(&run)
                        .into_iter()
                        .filter(|(_, cs)| cs.len() > 1)
                        .map(|(slot, cs)| {
                            let what: Vec<String> = cs
                                .iter()
                                .map(|c| format!("{} ({})", c.name, c.state))
                                .collect();
                            format!("slot {slot}: {}", what.join(", "))
                        })
                        .collect()
                })
            }
        }
    }

    /// Kills, stops or removes one random agent: `how` 0 is the hardest
    /// (kill -9; docker kill), 1 the polite one (SIGTERM; docker rm -f of
    /// a running container), 2 a freeze past the grace (SIGSTOP; docker pause).
    fn hit(&self, state: &Path, rng: &mut Rng, how: u64) -> Option<String> {
        let all: Vec<String> = self.agents(state).into_values().flatten().collect();
        if all.is_empty() {
            return None;
        }
        let who = all[rng.below(all.len() as u64) as usize].clone();
        let quiet = |args: &[&str]| {
            let _ = docker::docker(args);
        };
        Some(match (self, how) {
            (Self::Docker { .. }, 0) => {
                quiet(&["kill", &who]);
                format!("docker kill {who}")
            }
            (Self::Docker { .. }, 1) => {
                quiet(&["rm", "-f", &who]);
                format!("docker rm -f {who}")
            }
            (Self::Docker { .. }, _) => {
                quiet(&["pause", &who]);
                std::thread::sleep(Duration::from_millis(1_500));
                quiet(&["unpause", &who]);
                format!("docker pause {who} for 1.5 s")
            }
            (_, 0) => {
                signal("-9", &who);
                format!("kill -9 agent {who}")
            }
            (_, 1) => {
                signal("-TERM", &who);
                format!("SIGTERM agent {who}")
            }
            // Stopped past its grace period: the daemon replaces it while
            // the old process still exists; it must be killed, not doubled.
            (_, _) => {
                signal("-STOP", &who);
                std::thread::sleep(Duration::from_millis(1_500));
                signal("-CONT", &who);
                format!("SIGSTOP agent {who} for 1.5 s")
            }
        })
    }

    /// What is left after `down`: node directories, and claims on hosts.
    fn leftovers(&self, state: &Path) -> Vec<String> {
        match self {
            Self::Docker { run } => docker::containers(run)
                .into_iter()
                .map(|c| format!("container {} ({})", c.name, c.state))
                .collect(),
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

fn signal(sig: &str, pid: &str) {
    let _ = std::process::Command::new("kill").args([sig, pid]).status();
}

/// The (node, attempt)s served by more than one agent.
fn doubled(live: BTreeMap<(String, u64), Vec<u32>>) -> Vec<String> {
    live.into_iter()
        .filter(|(_, pids)| pids.len() > 1)
        .map(|((node, attempt), pids)| format!("{node} a{attempt}: pids {pids:?}"))
        .collect()
}

/// Running (or paused) containers of `run`: (node, attempt) → names.
fn live_containers(run: &str) -> BTreeMap<(String, u64), Vec<String>> {
    let mut out: BTreeMap<(String, u64), Vec<String>> = BTreeMap::new();
    for c in docker::containers(run) {
        if c.state == "running" || c.state == "paused" {
            out.entry((c.node, c.attempt)).or_default().push(c.name);
        }
    }
    out
}

fn run_seed(seed: u64, kind: &str) -> Result<String, String> {
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    // Containers outlive a test process: a run of its own per process.
    let run = match kind {
        "docker" => format!("battery-{seed}-{}", std::process::id()),
        _ => format!("battery-{seed}"),
    };
    let mut backend = match kind {
        "ssh" => Backend::ssh(tmp.path(), &state),
        "docker" => {
            docker::remove_run(&run);
            Backend::Docker { run: run.clone() }
        }
        _ => Backend::Process,
    };
    let mut generation_files = 0;
    let mut write = |body: String| {
        generation_files += 1;
        shape_file(tmp.path(), &format!("s{generation_files}.toml"), &body)
    };
    let first = write(backend.shape(&run, 1 + rng.below(3) as u32, true));
    let mut daemon = backend.start(&state, &first);

    let stop = Arc::new(AtomicBool::new(false));
    let doubles: Arc<Mutex<Vec<String>>> = Arc::default();
    let watcher = {
        let (stop, doubles) = (stop.clone(), doubles.clone());
        let mut look = backend.doubles(&state);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let found = look();
                if !found.is_empty() {
                    doubles.lock().unwrap().extend(found);
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
            how @ 0..=2 => {
                if let Some(what) = backend.hit(&state, &mut rng, how) {
                    log.push(what);
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
            6 if matches!(backend, Backend::Docker { .. }) => {
                // Drift: every container's environment changes.
                let body = backend.shape(&run, final_count, true).replace(
                    "boot_check = []",
                    &format!("boot_check = []\nenv = {{ STEP = \"{}\" }}", log.len()),
                );
                let f = write(body);
                let o = cli(&state, &["apply", f.to_str().unwrap(), "--yes"]);
                log.push(format!("drift the environment ({})", outcome(&o)));
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
    battery("process");
}

#[test]
fn seeded_real_faults_over_ssh_hosts_never_double_an_agent_and_down_leaves_nothing() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    battery("ssh");
}

#[test]
fn seeded_real_faults_on_docker_never_double_a_container_and_down_leaves_nothing() {
    if docker::engine_up() {
        battery("docker");
    }
}

fn battery(kind: &'static str) {
    let seeds: Vec<u64> = match std::env::var("SWACTOR_PROCESS_SEED") {
        Ok(s) => vec![s.parse().expect("SWACTOR_PROCESS_SEED is a number")],
        Err(_) => {
            let n = env_or("SWACTOR_PROCESS_SEEDS", 16);
            (0..n).collect()
        }
    };
    let failures: Mutex<Vec<String>> = Mutex::default();
    // Four seeds at a time: most of a seed's time is spent waiting on processes.
    for chunk in seeds.chunks(4) {
        std::thread::scope(|s| {
            for &seed in chunk {
                let failures = &failures;
                s.spawn(move || match run_seed(seed, kind) {
                    Ok(summary) => eprintln!("{summary}"),
                    Err(e) => {
                        // The reason first and short: a CI log may keep
                        // only its head, and the details run long.
                        let head: String = e.chars().take(400).collect();
                        eprintln!("seed {seed} FAILED: {head} (details at the end)");
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
