//! The conformance battery at the process level: seeded fault scripts made of
//! real signals and real errors, against the real daemon and real agents.
//!
//! While a script runs, a watcher scans `/proc` every 20 ms and records any
//! moment at which two live agent processes serve the same (node, attempt):
//! that would be a double create. After the script the faults stop, the
//! final shape must converge with exactly one live agent per node (its
//! current attempt), and `down` must leave no agent process and no node
//! directory.
//!
//! `SWACTOR_PROCESS_SEEDS` sets how many seeds run (default 16);
//! `SWACTOR_PROCESS_SEED` replays one seed alone.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

fn shape(run: &str, count: u32, boot_ok: bool) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"process\"\n\
         boot_check = [\"{}\"]\nlost_grace_s = 0.5\n",
        if boot_ok { "true" } else { "false" }
    )
}

fn signal(sig: &str, pid: u32) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

fn random_agent(state: &Path, rng: &mut Rng) -> Option<u32> {
    let all: Vec<u32> = agents(state).into_values().flatten().collect();
    (!all.is_empty()).then(|| all[rng.below(all.len() as u64) as usize])
}

fn run_seed(seed: u64) -> Result<String, String> {
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let run = format!("battery-{seed}");
    let mut generation_files = 0;
    let mut write = |body: String| {
        generation_files += 1;
        shape_file(tmp.path(), &format!("s{generation_files}.toml"), &body)
    };
    let first = write(shape(&run, 1 + rng.below(3) as u32, true));
    let mut daemon = Daemon::start(&state, &first);

    let stop = Arc::new(AtomicBool::new(false));
    let doubles: Arc<Mutex<Vec<String>>> = Arc::default();
    let watcher = {
        let (stop, doubles, state) = (stop.clone(), doubles.clone(), state.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for ((node, attempt), pids) in agents(&state) {
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
        match rng.below(7) {
            0 => {
                if let Some(pid) = random_agent(&state, &mut rng) {
                    log.push(format!("kill -9 agent {pid}"));
                    signal("-9", pid);
                }
            }
            1 => {
                if let Some(pid) = random_agent(&state, &mut rng) {
                    log.push(format!("SIGTERM agent {pid}"));
                    signal("-TERM", pid);
                }
            }
            2 => {
                // Stopped past its grace period: the daemon replaces it while
                // the old process still exists; it must be killed, not doubled.
                if let Some(pid) = random_agent(&state, &mut rng) {
                    log.push(format!("SIGSTOP agent {pid} for 1.5 s"));
                    signal("-STOP", pid);
                    std::thread::sleep(Duration::from_millis(1_500));
                    signal("-CONT", pid);
                }
            }
            3 => {
                final_count = 1 + rng.below(4) as u32;
                log.push(format!("scale to {final_count}"));
                let f = write(shape(&run, final_count, true));
                let _ = cli(&state, &["apply", f.to_str().unwrap(), "--yes"]);
            }
            4 => {
                log.push("apply a failing boot check".to_owned());
                let f = write(shape(&run, final_count, false));
                let _ = cli(&state, &["apply", f.to_str().unwrap(), "--yes"]);
            }
            5 => {
                log.push("kill -9 the daemon and start it again".to_owned());
                daemon.kill9();
                std::thread::sleep(Duration::from_millis(200));
                let f = write(shape(&run, final_count, true));
                daemon = Daemon::start(&state, &f);
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
    let last = write(shape(&run, final_count, true));
    let applied = cli(&state, &["apply", last.to_str().unwrap(), "--yes"]);
    if !applied.status.success() {
        return Err(format!(
            "final apply failed: {}; log {log:?}",
            stderr(&applied)
        ));
    }
    let snap = wait_converged(&state, Duration::from_secs(90), |s| {
        s.nodes.len() == final_count as usize
    });
    std::thread::sleep(Duration::from_millis(500));
    let live = agents(&state);
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
    let leftovers = (agents(&state), node_dirs(&state));
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
        "seed {seed}: {} steps, {final_count} node(s): {}",
        log.len(),
        log.join("; ")
    ))
}

#[test]
fn seeded_real_faults_never_double_an_agent_and_down_leaves_nothing() {
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
                s.spawn(move || match run_seed(seed) {
                    Ok(summary) => eprintln!("{summary}"),
                    Err(e) => failures.lock().unwrap().push(format!("seed {seed}: {e}")),
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
