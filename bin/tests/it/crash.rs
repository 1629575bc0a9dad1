//! A `kill -9` crash battery: the daemon is killed at a seeded random moment
//! (while it converges, while it scales, while it tears down), started again
//! (with the cycle's shape, or with none to resume its journal), and must
//! converge with exactly one live agent per desired slot, that slot's current
//! attempt, and nothing else: no orphan agent, no stray node directory.
//!
//! A watcher scans `/proc` every 20 ms for the whole run and records any
//! moment at which two live agents serve the same (node, attempt). After the
//! last cycle `swactor down` must leave no agent and no node directory.
//!
//! `SWACTOR_CRASH_CYCLES` sets how many cycles run (default 8; the full run is
//! 50); `SWACTOR_CRASH_SEED` picks the seed (default 1).

use crate::common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use swactor_actors::{AgentLink, ClusterSnapshot};

const RUN: &str = "crash";
/// How long a restarted daemon may take to converge (the rejoin window is
/// 15 s, and agents notice a dead daemon within 4 s).
const CONVERGE_MAX: Duration = Duration::from_secs(60);
/// How long a CLI call in flight when the daemon is killed may take to end
/// by itself before it is killed too (it would dial the dead daemon for 5 s,
/// or reach the restarted one).
const CLI_GRACE: Duration = Duration::from_secs(1);

fn shape(count: u32) -> String {
    format!(
        "run = \"{RUN}\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"process\"\n\
         boot_check = [\"true\"]\nlost_grace_s = 1.0\n"
    )
}

/// When the daemon is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    /// A few hundred ms after `up SHAPE` (the previous daemon stopped with
    /// `down` or `down --keep`).
    Converging,
    /// 0–500 ms after `apply` of a shape with another count.
    Scaling,
    /// 0–500 ms after `down` was asked for.
    TearingDown,
}

/// What the journal may hold after the kill, so what a daemon started
/// without a shape may do.
#[derive(Debug)]
struct Allowed {
    /// Node counts it may resume.
    counts: BTreeSet<u32>,
    /// It may find nothing to resume (a teardown finished).
    nothing: bool,
    /// It may find a teardown to finish.
    teardown: bool,
}

/// A CLI call running in the background.
struct Call {
    child: Child,
    what: String,
}

impl Call {
    fn spawn(state: &Path, args: &[&str]) -> Self {
        let child = Command::new(BIN)
            .args(args)
            .arg("--state-dir")
            .arg(state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run swactor");
        Self {
            child,
            what: args
                .iter()
                .map(|a| Path::new(a).file_name().map_or(*a, |f| f.to_str().unwrap()))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }

    /// Whether it succeeded, if it ended by itself within [`CLI_GRACE`]; it
    /// is killed otherwise. Also returns what it wrote to stderr.
    fn finish(mut self) -> (Option<bool>, String) {
        let start = Instant::now();
        let mut ended = None;
        while start.elapsed() < CLI_GRACE {
            if let Ok(Some(s)) = self.child.try_wait() {
                ended = Some(s.success());
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if ended.is_none() {
            let _ = self.child.kill();
        }
        let out = self.child.wait_with_output().expect("reap the CLI");
        (
            ended,
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        )
    }
}

/// How one cycle went.
#[derive(Debug)]
struct Cycle {
    kind: Kill,
    /// Daemons started after the kill.
    restarts: u32,
    /// From the first restart to convergence.
    converge: Duration,
    total: Duration,
    line: String,
}

struct World {
    dir: PathBuf,
    state: PathBuf,
    files: u32,
    daemon: Option<Daemon>,
    /// The node count the running daemon converged on.
    count: u32,
    /// The generation it converged on; never goes backwards.
    generation: u64,
}

impl World {
    fn shape_file(&mut self, count: u32) -> PathBuf {
        self.files += 1;
        shape_file(
            &self.dir,
            &format!("s{}-{count}.toml", self.files),
            &shape(count),
        )
    }

    fn daemon(&mut self) -> &mut Daemon {
        self.daemon.as_mut().expect("a running daemon")
    }

    fn kill_daemon(&mut self) {
        self.daemon().kill9();
    }

    /// `up SHAPE`, which must come up.
    fn up(&mut self, shape: &Path) -> Result<(), String> {
        let d = Daemon::spawn(&self.state, Some(shape))
            .map_err(|e| format!("`up {}` exited {:?}: {}", shape.display(), e.code, e.log))?;
        self.daemon = Some(d);
        Ok(())
    }

    /// Nothing is left: no agent, no node directory.
    fn nothing_left(&self, when: &str) -> Result<(), String> {
        let (live, dirs) = (agents(&self.state), node_dirs(&self.state));
        if live.is_empty() && dirs.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{when}: left behind: agents {live:?}, node directories {dirs:?}"
            ))
        }
    }

    /// Waits for a converged cluster with no orphan left to collect.
    fn converged(&self) -> Result<ClusterSnapshot, String> {
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < CONVERGE_MAX {
            if let Some(s) = status(&self.state) {
                if s.converged && s.orphans == 0 && s.shutting_down.is_none() {
                    return Ok(s);
                }
                last = Some(s);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "not converged within {CONVERGE_MAX:?}; last status: {last:#?}"
        ))
    }

    /// One live agent per desired slot, its current attempt, and nothing else.
    fn check(&mut self, snap: &ClusterSnapshot, counts: &BTreeSet<u32>) -> Result<(), String> {
        let mut errors = Vec::new();
        let desired: BTreeSet<(String, u64)> = snap
            .nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt.0))
            .collect();
        let count = u32::try_from(snap.desired_nodes).unwrap();
        if !counts.contains(&count) {
            errors.push(format!(
                "desires {count} node(s); expected one of {counts:?}"
            ));
        }
        if snap.nodes.len() != count as usize {
            errors.push(format!(
                "{} node(s) listed for {count} desired",
                snap.nodes.len()
            ));
        }
        if snap.generation.0 < self.generation {
            errors.push(format!(
                "generation went back from {} to {}",
                self.generation, snap.generation.0
            ));
        }
        for n in &snap.nodes {
            if !n.ready || n.agent != AgentLink::Connected {
                errors.push(format!(
                    "converged, but {} {} is ready={} with agent {:?}",
                    n.node, n.attempt, n.ready, n.agent
                ));
            }
        }
        let live = agents(&self.state);
        for id in &desired {
            match live.get(id).map(Vec::len) {
                Some(1) => {}
                other => errors.push(format!(
                    "{} a{}: {} live agent(s), expected 1",
                    id.0,
                    id.1,
                    other.unwrap_or(0)
                )),
            }
        }
        let strays: BTreeMap<_, _> = live.iter().filter(|(k, _)| !desired.contains(k)).collect();
        if !strays.is_empty() {
            errors.push(format!("agents of no current slot (orphans): {strays:?}"));
        }
        let dirs = node_dir_ids(&self.state);
        if dirs != desired {
            errors.push(format!(
                "node directories {dirs:?} != current attempts {desired:?}"
            ));
        }
        if errors.is_empty() {
            self.count = count;
            self.generation = snap.generation.0;
            Ok(())
        } else {
            Err(format!("{}; status: {snap:#?}", errors.join("; ")))
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn run_cycle(w: &mut World, rng: &mut Rng) -> Result<Cycle, String> {
    let started = Instant::now();
    let kind = match rng.below(3) {
        0 => Kill::Converging,
        1 => Kill::Scaling,
        _ => Kill::TearingDown,
    };
    let mut n = 2 + rng.below(3) as u32;
    if kind == Kill::Scaling && n == w.count {
        n = if n == 4 { 2 } else { n + 1 };
    }
    let target = w.shape_file(n);
    let c = w.count;
    let mut line = format!("{kind:?} {c}->{n}");

    // The kill.
    let allowed = match kind {
        Kill::Converging => {
            let keep = rng.below(2) == 0;
            let args: &[&str] = if keep { &["down", "--keep"] } else { &["down"] };
            let o = cli(&w.state, args);
            if !o.status.success() {
                return Err(format!("`{}` failed: {}", args.join(" "), stderr(&o)));
            }
            let exit = w.daemon().wait_exit(Duration::from_secs(5));
            if exit != Some(0) {
                return Err(format!(
                    "`{}` returned, daemon exit {exit:?}",
                    args.join(" ")
                ));
            }
            if !keep {
                w.nothing_left("after `down`")?;
            }
            w.up(&target)?;
            let delay = Duration::from_millis(100 + rng.below(500));
            std::thread::sleep(delay);
            w.kill_daemon();
            line += &format!(" ({}; killed {} after up)", args.join(" "), ms(delay));
            Allowed {
                counts: if keep { [c, n].into() } else { [n].into() },
                nothing: !keep,
                teardown: false,
            }
        }
        Kill::Scaling | Kill::TearingDown => {
            let call = if kind == Kill::Scaling {
                Call::spawn(&w.state, &["apply", target.to_str().unwrap(), "--yes"])
            } else {
                Call::spawn(&w.state, &["down"])
            };
            // A teardown of a few local nodes takes tens of ms, so a kill
            // 0-500 ms after `down` mostly finds the daemon gone; half of
            // them are aimed at the teardown itself instead.
            let aimed = kind == Kill::TearingDown && rng.below(2) == 0;
            let (delay, after) = if aimed {
                let began = Instant::now();
                while !w.daemon().last_log().contains("swactor: tearing down")
                    && began.elapsed() < Duration::from_secs(2)
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                (Duration::from_millis(rng.below(41)), "the teardown began")
            } else {
                (Duration::from_millis(rng.below(501)), "the call")
            };
            std::thread::sleep(delay);
            w.kill_daemon();
            let what = call.what.clone();
            let (acked, err) = call.finish();
            line += &format!(
                " (killed {} after {after}; `{what}` {})",
                ms(delay),
                match acked {
                    Some(true) => "succeeded".to_owned(),
                    Some(false) => format!("failed: {err}"),
                    None => "was still waiting and was killed".to_owned(),
                }
            );
            let acked = acked == Some(true);
            match (kind, acked) {
                // An acknowledged shape survives the crash.
                (Kill::Scaling, true) => Allowed {
                    counts: [n].into(),
                    nothing: false,
                    teardown: false,
                },
                (Kill::Scaling, false) => Allowed {
                    counts: [c, n].into(),
                    nothing: false,
                    teardown: false,
                },
                // An acknowledged teardown is over.
                (_, true) => Allowed {
                    counts: BTreeSet::new(),
                    nothing: true,
                    teardown: false,
                },
                (_, false) => Allowed {
                    counts: [c].into(),
                    nothing: true,
                    teardown: true,
                },
            }
        }
    };

    // The restart.
    let restarted = Instant::now();
    let mut restarts = 1;
    let resume = rng.below(2) == 0;
    let counts = if resume {
        match Daemon::spawn(&w.state, None) {
            Err(e) if allowed.nothing && e.log.contains("there is nothing to resume") => {
                w.nothing_left("when there was nothing to resume")?;
                restarts += 1;
                w.up(&target)?;
                line += "; up: nothing to resume; up SHAPE";
                BTreeSet::from([n])
            }
            // A short teardown may be finished before its ticket is seen.
            Err(e)
                if allowed.teardown
                    && e.code == Some(0)
                    && e.log.contains("finishing the teardown") =>
            {
                w.nothing_left("after the teardown was finished")?;
                restarts += 1;
                w.up(&target)?;
                line += "; up: finished the teardown at once; up SHAPE";
                BTreeSet::from([n])
            }
            Err(e) => {
                return Err(format!(
                    "`up` without a shape exited {:?} (allowed: {allowed:?}): {}",
                    e.code, e.log
                ));
            }
            Ok(d) => {
                w.daemon = Some(d);
                let note = Instant::now();
                let mut log = w.daemon().last_log();
                while !log.contains("resuming run") && !log.contains("finishing the teardown") {
                    if note.elapsed() > Duration::from_secs(10) {
                        return Err(format!("no start note from `up`: {log}"));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    log = w.daemon().last_log();
                }
                if log.contains("finishing the teardown") {
                    if !allowed.teardown {
                        return Err(format!(
                            "`up` finishes a teardown (allowed: {allowed:?}): {log}"
                        ));
                    }
                    let exit = w.daemon().wait_exit(Duration::from_secs(60));
                    if exit != Some(0) {
                        return Err(format!(
                            "finishing the teardown exited {exit:?}: {}",
                            w.daemon().last_log()
                        ));
                    }
                    w.nothing_left("after the teardown was finished")?;
                    restarts += 1;
                    w.up(&target)?;
                    line += "; up: finished the teardown; up SHAPE";
                    BTreeSet::from([n])
                } else {
                    line += "; up: resumed";
                    allowed.counts.clone()
                }
            }
        }
    } else {
        w.up(&target)?;
        line += "; up SHAPE";
        BTreeSet::from([n])
    };
    let snap = w.converged()?;
    let converge = restarted.elapsed();
    w.check(&snap, &counts)?;
    line += &format!(
        "; converged on {} node(s) at generation {} in {}",
        snap.desired_nodes,
        snap.generation.0,
        ms(converge)
    );
    Ok(Cycle {
        kind,
        restarts,
        converge,
        total: started.elapsed(),
        line,
    })
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn a_daemon_killed_at_any_moment_restarts_into_one_agent_per_slot_and_no_orphans() {
    let cycles: u32 = env_or("SWACTOR_CRASH_CYCLES", 8);
    let seed: u64 = env_or("SWACTOR_CRASH_SEED", 1);
    let started = Instant::now();
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let mut w = World {
        dir: tmp.path().to_path_buf(),
        state: state.clone(),
        files: 0,
        daemon: None,
        count: 0,
        generation: 0,
    };
    let doubles = Watcher::doubles(&state);

    let first_count = 2 + rng.below(3) as u32;
    let first = w.shape_file(first_count);
    w.up(&first).unwrap();
    let snap = w.converged().unwrap();
    w.check(&snap, &[first_count].into()).unwrap();

    let mut done: Vec<Cycle> = Vec::new();
    for i in 0..cycles {
        let cycle = run_cycle(&mut w, &mut rng);
        let (found, count) = doubles.found();
        let failed = match cycle {
            Ok(c) => {
                eprintln!("cycle {i}: {:.1} s: {}", c.total.as_secs_f64(), c.line);
                done.push(c);
                None
            }
            Err(e) => Some(e),
        };
        if failed.is_some() || count > 0 {
            panic!(
                "seed {seed}, cycle {i}: {}; two live agents for one identity ({count} sightings): \
                 {found:?}\n--- daemon log (tail) ---\n{}",
                failed.unwrap_or_else(|| "the cycle itself passed".to_owned()),
                tail(&w.daemon.as_ref().map(Daemon::log).unwrap_or_default(), 80)
            );
        }
    }

    let down = cli(&state, &["down"]);
    assert!(down.status.success(), "down failed: {}", stderr(&down));
    let exit = w.daemon().wait_exit(Duration::from_secs(5));
    assert_eq!(
        exit,
        Some(0),
        "the daemon exited by the time `down` returned"
    );
    let (found, count) = doubles.stop();
    assert_eq!(count, 0, "two live agents for one identity: {found:?}");
    w.nothing_left("after the final `down`").unwrap();

    let kinds: BTreeMap<Kill, usize> = done.iter().fold(BTreeMap::new(), |mut m, c| {
        *m.entry(c.kind).or_default() += 1;
        m
    });
    let restarts: u32 = done.iter().map(|c| c.restarts).sum();
    let slowest = done.iter().map(|c| c.converge).max().unwrap_or_default();
    eprintln!(
        "seed {seed}: {} cycle(s) in {:.1} s; kills {kinds:?}; {restarts} restart(s); \
         slowest convergence after a restart {:.1} s; no double agent, nothing left after down",
        done.len(),
        started.elapsed().as_secs_f64(),
        slowest.as_secs_f64()
    );
}
