//! Two daemons on one run, its journal in a 3-member etcd cluster on
//! loopback, their nodes containers on the real Docker engine (which both
//! daemons see): one leads, the other stands by and takes over.
//!
//! - The battery kills the leader with SIGKILL at a seeded moment,
//!   `SWACTOR_HA_CYCLES` times (default 2; `SWACTOR_HA_SEED` picks the
//!   moments; the closing figures come from 30): the standby must lead
//!   within the lease + 5 s and converge; a watcher lists the run's
//!   containers every 50 ms and fails on any moment a slot has two; the
//!   killed daemon comes back as the standby; the kinds of moment go
//!   mid-rollout, mid-scale, mid-replacement, steady, in turn (CI runs the
//!   first two). Last, the leader is killed in the middle of `down`: the
//!   standby finishes the teardown.
//! - The frozen leader: SIGSTOP past its lease; the standby takes over and
//!   converges; after SIGCONT the old leader changes nothing (no container
//!   made or removed, no journal write) and stands by.
//! - etcd members lost: one of three during convergence changes nothing;
//!   all three stop the leader acting within the lease and end its term
//!   once the lease may have ended, the nodes keep running, and the run
//!   converges again once etcd is back.
//!
//! Without etcd or Docker these tests print one line and pass, unless
//! `SWACTOR_REQUIRE_ETCD=1` / `SWACTOR_REQUIRE_DOCKER=1` (set by `.ci/run`).

use crate::common;

use common::docker::{
    agent_binary, by_slot, containers, docker, docker_shape, remove_run, slot_watcher,
};
use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_engine::etcd::testing::EtcdCluster;

/// The leader's lease in these tests, seconds.
const TTL_S: u64 = 3;

/// Two daemons' state directories on one run and one etcd.
struct Pair {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    run: String,
    etcd: EtcdCluster,
    states: [PathBuf; 2],
    daemons: [Option<Daemon>; 2],
    files: u32,
}

impl Pair {
    /// `None` when etcd or Docker is missing (and not required).
    fn new(name: &str) -> Option<Self> {
        Self::with_etcd(name, &[])
    }

    /// [`Pair::new`], with more flags for every etcd member.
    fn with_etcd(name: &str, flags: &[&str]) -> Option<Self> {
        if !common::docker::engine_up() {
            return None;
        }
        let etcd = EtcdCluster::start_with(3, flags)?;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let run = format!("ha-{name}-{}", std::process::id());
        remove_run(&run);
        Some(Self {
            states: [dir.join("a"), dir.join("b")],
            dir,
            _tmp: tmp,
            run,
            etcd,
            daemons: [None, None],
            files: 0,
        })
    }

    fn file(&mut self, body: &str) -> PathBuf {
        self.files += 1;
        shape_file(&self.dir, &format!("s{}.toml", self.files), body)
    }

    /// Starts daemon `i` on `shape` (it leads or stands by).
    fn start(&mut self, i: usize, shape: &Path) {
        let agent = agent_binary();
        let endpoints = self.etcd.endpoints().join(",");
        let ttl = TTL_S.to_string();
        let d = Daemon::spawn_with(
            &self.states[i],
            Some(shape),
            &[
                "--agent-binary",
                agent.to_str().unwrap(),
                "--etcd",
                &endpoints,
                "--lease-ttl",
                &ttl,
            ],
        )
        .unwrap_or_else(|e| panic!("daemon {i} exited ({:?}): {}", e.code, e.log));
        self.daemons[i] = Some(d);
    }

    /// How many terms daemon `i` (the last one started on its directory)
    /// began, and how many it ended.
    fn terms(&self, i: usize) -> (usize, usize) {
        let log = self.daemons[i]
            .as_ref()
            .map(Daemon::last_log)
            .unwrap_or_default();
        (
            log.matches("swactor: leading run").count(),
            log.matches("swactor: no longer leading").count(),
        )
    }

    fn leads(&self, i: usize) -> bool {
        let (began, ended) = self.terms(i);
        self.daemons[i].is_some() && began > ended
    }

    /// The one that leads, waiting up to `within` for one to.
    fn leader(&self, within: Duration) -> usize {
        let start = Instant::now();
        loop {
            for i in 0..2 {
                if self.leads(i) {
                    return i;
                }
            }
            assert!(
                start.elapsed() < within,
                "no daemon leads after {within:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn logs(&self) -> String {
        (0..2)
            .map(|i| {
                format!(
                    "--- daemon {i}:\n{}",
                    self.daemons[i]
                        .as_ref()
                        .map(Daemon::log)
                        .unwrap_or_default()
                )
            })
            .collect()
    }

    /// Converged on `nodes` ready nodes, as the CLI of `state` `i` sees it
    /// (whichever daemon leads answers).
    fn converged(&self, i: usize, nodes: usize, within: Duration) {
        if let Err(last) = try_wait_converged(&self.states[i], within, |s| {
            s.nodes.len() == nodes && s.nodes.iter().all(|n| n.ready)
        }) {
            panic!(
                "not converged to {nodes} node(s): {last:#?}\ncontainers {:#?}\n{}",
                containers(&self.run),
                self.logs()
            );
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(d) = self.daemons[i].as_mut() {
            d.kill9();
        }
        self.daemons[i] = None;
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            drop(d.take());
        }
        remove_run(&self.run);
    }
}

fn shape(run: &str, count: u32, colour: &str) -> String {
    docker_shape(run, count, &format!("env = {{ COLOUR = \"{colour}\" }}\n"))
}

/// The containers' ids and states, for "nothing changed".
fn world(run: &str) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = containers(run)
        .into_iter()
        .map(|c| (c.id, c.state))
        .collect();
    all.sort();
    all
}

#[test]
fn a_standby_takes_over_a_killed_leader_and_nothing_is_made_twice() {
    let Some(mut p) = Pair::new("battery") else {
        return;
    };
    let cycles: u64 = std::env::var("SWACTOR_HA_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let seed: u64 = std::env::var("SWACTOR_HA_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let mut rng = Rng(seed);
    let run = p.run.clone();
    let first = p.file(&shape(&run, 3, "c0"));
    p.start(0, &first);
    assert_eq!(p.leader(Duration::from_secs(10)), 0);
    p.start(1, &first);
    p.converged(1, 3, Duration::from_secs(120));
    let doubles = slot_watcher(&run);
    let (mut count, mut colour) = (3u32, 0u32);
    let mut takeovers = Vec::new();
    for cycle in 0..cycles {
        let leader = p.leader(Duration::from_secs(10));
        let standby = 1 - leader;
        let (began, _) = p.terms(standby);
        // What is under way when the leader dies.
        let what = match cycle % 4 {
            0 => {
                colour += 1;
                let f = p.file(&shape(&run, count, &format!("c{colour}")));
                let o = cli(&p.states[leader], &["apply", f.to_str().unwrap(), "--yes"]);
                assert!(o.status.success(), "apply: {}", stderr(&o));
                "mid-rollout"
            }
            1 => {
                count = if count == 3 { 4 } else { 3 };
                let f = p.file(&shape(&run, count, &format!("c{colour}")));
                let o = cli(&p.states[leader], &["apply", f.to_str().unwrap(), "--yes"]);
                assert!(o.status.success(), "apply: {}", stderr(&o));
                "mid-scale"
            }
            2 => {
                let victim = containers(&run).into_iter().next().expect("a container");
                docker(&["rm", "-f", &victim.id]);
                "mid-replacement"
            }
            _ => "steady",
        };
        std::thread::sleep(Duration::from_millis(rng.below(1_500)));
        let killed = Instant::now();
        p.kill(leader);
        // The standby leads within the lease and 5 s.
        let within = Duration::from_secs(TTL_S + 5);
        while p.terms(standby).0 == began {
            assert!(
                killed.elapsed() < within,
                "cycle {cycle} ({what}): the standby did not lead within {within:?}\n{}",
                p.logs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let took = killed.elapsed();
        takeovers.push(took);
        eprintln!(
            "ha battery: cycle {cycle} ({what}): daemon {standby} leads {:.2} s after the kill",
            took.as_secs_f64()
        );
        p.converged(standby, count as usize, Duration::from_secs(120));
        let (found, _) = doubles.found();
        assert!(
            found.is_empty(),
            "cycle {cycle} ({what}): a slot had two containers: {found:#?}\n{}",
            p.logs()
        );
        // One container per slot, of the template now desired.
        for (slot, cs) in by_slot(&run) {
            assert_eq!(cs.len(), 1, "slot {slot}: {cs:#?}");
        }
        // The killed daemon comes back, standing by.
        p.start(leader, &first);
    }
    // The last leader is killed in the middle of `down`: the standby
    // finishes the teardown, and both daemons end.
    let leader = p.leader(Duration::from_secs(10));
    let standby = 1 - leader;
    let state = p.states[leader].clone();
    let down = std::thread::spawn(move || cli(&state, &["down"]));
    let asked = Instant::now();
    while !p.daemons[leader]
        .as_ref()
        .is_some_and(|d| d.last_log().contains("swactor: tearing down"))
    {
        assert!(
            asked.elapsed() < Duration::from_secs(20),
            "down never began:\n{}",
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(rng.below(500)));
    p.kill(leader);
    let _ = down.join();
    let code = p.daemons[standby]
        .as_mut()
        .unwrap()
        .wait_exit(Duration::from_secs(120));
    assert_eq!(
        code,
        Some(0),
        "the standby did not finish the teardown:\n{}",
        p.logs()
    );
    let left = containers(&run);
    assert!(left.is_empty(), "left after down: {left:#?}\n{}", p.logs());
    let (found, times) = doubles.stop();
    assert!(
        found.is_empty() && times == 0,
        "a slot had two containers {times} time(s): {found:#?}"
    );
    takeovers.sort();
    eprintln!(
        "ha battery: {cycles} takeovers (seed {seed}), min {:.2} s, median {:.2} s, max {:.2} s",
        takeovers.first().map_or(0.0, Duration::as_secs_f64),
        takeovers
            .get(takeovers.len() / 2)
            .map_or(0.0, Duration::as_secs_f64),
        takeovers.last().map_or(0.0, Duration::as_secs_f64),
    );
}

/// The journal header's revision: it moves with every journal write.
fn journal_revision(etcd: &EtcdCluster, run: &str) -> i64 {
    let client = etcd.client();
    let key = format!("/swactor/v1/{run}/header");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move { client.get(key).await })
        .expect("etcd answers")
        .map_or(0, |kv| kv.mod_revision)
}

#[test]
fn a_frozen_leader_wakes_to_change_nothing_and_stands_by() {
    let Some(mut p) = Pair::new("frozen") else {
        return;
    };
    let run = p.run.clone();
    let f = p.file(&shape(&run, 2, "c0"));
    p.start(0, &f);
    assert_eq!(p.leader(Duration::from_secs(10)), 0);
    p.start(1, &f);
    p.converged(1, 2, Duration::from_secs(120));
    // A group of local processes is refused by a leader too, as by `up`:
    // the next leader could neither see nor adopt its nodes.
    let before = status(&p.states[0]).expect("a status").generation;
    let local = p.file(&format!(
        "{}[[group]]\nid = \"local\"\ncount = 1\nprovider = \"process\"\n",
        shape(&run, 2, "c0")
    ));
    let o = cli(&p.states[0], &["apply", local.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("group \"local\" runs its nodes as processes of this machine")
            && stderr(&o).contains("nothing was changed"),
        "{}",
        stderr(&o)
    );
    assert_eq!(status(&p.states[0]).expect("a status").generation, before);
    let doubles = slot_watcher(&run);
    let pid = p.daemons[0].as_ref().unwrap().pid().unwrap();
    // What the leader's term has done so far, by its own counts (a steady
    // cluster makes no call between this and the freeze).
    let ha = status(&p.states[0])
        .and_then(|s| s.ha)
        .expect("the leader says who leads");
    assert!(ha.provider_calls > 0 && ha.journal_commits > 0, "{ha:?}");
    signal(pid, "-STOP");
    let frozen = Instant::now();
    while p.terms(1).0 == 0 {
        assert!(
            frozen.elapsed() < Duration::from_secs(TTL_S + 5),
            "the standby did not lead:\n{}",
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "ha frozen: the standby leads {:.2} s after the leader froze",
        frozen.elapsed().as_secs_f64()
    );
    // A container lost while the old leader sleeps: the new one replaces it.
    let victim = containers(&run).into_iter().next().expect("a container");
    docker(&["rm", "-f", &victim.id]);
    p.converged(1, 2, Duration::from_secs(120));
    let before = (world(&run), journal_revision(&p.etcd, &run));
    signal(pid, "-CONT");
    let woke = Instant::now();
    while p.terms(0).1 == 0 {
        assert!(
            woke.elapsed() < Duration::from_secs(10),
            "the old leader did not stand down:\n{}",
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Time for anything it might still do to show.
    std::thread::sleep(Duration::from_secs(3));
    let after = (world(&run), journal_revision(&p.etcd, &run));
    assert_eq!(
        before,
        after,
        "something changed after the old leader woke:\n{}",
        p.logs()
    );
    let old = p.daemons[0].as_ref().unwrap().last_log();
    let ended = old
        .lines()
        .find(|l| l.contains("no longer leading"))
        .unwrap()
        .to_owned();
    eprintln!("ha frozen: the old leader said: {ended}");
    // Everything it counted, it had counted before it froze: no provider
    // call, refused or made, and no journal commit since.
    let said = format!(
        "{} provider calls made, 0 refused at the bound, {} journal commits sent",
        ha.provider_calls, ha.journal_commits
    );
    assert!(ended.contains(&said), "expected {said:?} in {ended:?}");
    assert!(p.leads(1) && !p.leads(0), "{}", p.logs());
    let (found, times) = doubles.stop();
    assert!(
        found.is_empty() && times == 0,
        "a slot had two containers: {found:#?}"
    );
    // It stands by: killing the new leader makes it lead again.
    p.kill(1);
    p.leader(Duration::from_secs(TTL_S + 5));
    p.converged(0, 2, Duration::from_secs(120));
}

/// A standby whose control port another program took while it was down
/// (its record, and so every CLI's ticket, still names that port) waits
/// for it when it is to lead, then stands by again on a new port, which
/// its record gives before it leads: the CLI of either state directory
/// reaches it there, and its nodes are left as they were.
#[test]
fn a_standby_whose_port_was_taken_leads_on_a_new_one_the_cli_finds() {
    let Some(mut p) = Pair::new("ports") else {
        return;
    };
    let run = p.run.clone();
    let f = p.file(&shape(&run, 1, "c0"));
    p.start(0, &f);
    assert_eq!(p.leader(Duration::from_secs(10)), 0);
    p.start(1, &f);
    p.converged(1, 1, Duration::from_secs(120));
    // The node is made again (a rollout) once daemon 1 is registered, so
    // its agent's ticket names both daemons: an agent made before a
    // standby registered can miss it, and a takeover then replaces its
    // node, which is not what this test is about.
    std::thread::sleep(Duration::from_secs(2));
    let first = world(&run);
    let rolled = p.file(&shape(&run, 1, "c1"));
    let o = cli(&p.states[0], &["apply", rolled.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "apply: {}", stderr(&o));
    let started = Instant::now();
    while world(&run).len() != 1 || world(&run) == first {
        assert!(started.elapsed() < Duration::from_secs(120), "{}", p.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    p.converged(1, 1, Duration::from_secs(120));
    // Daemon 1 is killed, and its control port taken, before it comes back.
    let port: u16 = std::fs::read_to_string(p.states[1].join("control.port"))
        .expect("daemon 1 saved its control port")
        .trim()
        .parse()
        .unwrap();
    p.kill(1);
    let taken = std::net::UdpSocket::bind(("127.0.0.1", port)).expect("the port is free");
    p.start(1, &f);
    let before = world(&run);
    // Daemon 1 is to lead: the port stays taken, so its first term ends
    // before it starts anything, and it leads again on a new port.
    p.kill(0);
    let moved = Instant::now();
    while p.terms(1) != (2, 1) {
        assert!(
            moved.elapsed() < Duration::from_secs(TTL_S + 20),
            "daemon 1 never led:\n{}",
            p.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = p.daemons[1].as_ref().unwrap().last_log();
    assert!(
        log.contains(&format!(
            "({}) stayed taken",
            format_args!("127.0.0.1:{port}")
        )),
        "{}",
        p.logs()
    );
    let now: u16 = std::fs::read_to_string(p.states[1].join("control.port"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(now, port);
    // Its own CLI finds it, and so does the other's once that one is back.
    p.converged(1, 1, Duration::from_secs(60));
    p.start(0, &f);
    p.converged(0, 1, Duration::from_secs(60));
    assert_eq!(world(&run), before, "{}", p.logs());
    drop(taken);
}

#[test]
fn etcd_members_lost_change_nothing_or_stop_the_leader_until_they_are_back() {
    // etcd's own election scaled to the test's 3 s lease, as its defaults
    // (1 s election timeout) are to a lease of tens of seconds: killing
    // etcd's leader leaves no leader for up to twice the election timeout,
    // and a renewal that cannot be answered meanwhile would end the term
    // (on a loaded machine it did, once in two CI runs).
    let fast = ["--heartbeat-interval", "50", "--election-timeout", "400"];
    let Some(mut p) = Pair::with_etcd("members", &fast) else {
        return;
    };
    let run = p.run.clone();
    let f = p.file(&shape(&run, 3, "c0"));
    p.start(0, &f);
    assert_eq!(p.leader(Duration::from_secs(10)), 0);
    p.start(1, &f);
    // One member of three lost while the cluster converges: nothing to see.
    p.etcd.kill(p.etcd.leader().unwrap_or(0));
    p.converged(1, 3, Duration::from_secs(120));
    assert_eq!(p.terms(0), (1, 0), "{}", p.logs());
    assert_eq!(p.terms(1), (0, 0), "{}", p.logs());
    // All three lost: past the lease the leader acts on nothing (a lost
    // container is not replaced), its nodes keep running.
    let ids = world(&run);
    p.etcd.kill_all();
    std::thread::sleep(Duration::from_secs(TTL_S));
    let victim = containers(&run).into_iter().next().expect("a container");
    docker(&["rm", "-f", &victim.id]);
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    let left = world(&run);
    assert_eq!(
        left.len(),
        ids.len() - 1,
        "acted without etcd: {left:#?}\n{}",
        p.logs()
    );
    assert!(
        left.iter().all(|(_, state)| state == "running"),
        "{left:#?}"
    );
    // Its lease may have ended by now: it let go of the agents too.
    assert_eq!(p.terms(0), (1, 1), "{}", p.logs());
    // etcd back: it converges again.
    p.etcd.restart_all();
    p.converged(0, 3, Duration::from_secs(120));
    for (slot, cs) in by_slot(&run) {
        assert_eq!(cs.len(), 1, "slot {slot}: {cs:#?}");
    }
}

/// `up --etcd` refuses, starting nothing and leaving no state directory,
/// when etcd does not answer, when the run's groups are local processes,
/// and when the prefix holds a journal of another kind (left untouched).
#[test]
fn a_daemon_that_cannot_share_the_run_starts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |shape: &str, endpoints: &str, what: &str| -> String {
        let f = shape_file(tmp.path(), "s.toml", shape);
        let state = tmp.path().join("state");
        let e = Daemon::spawn_with(&state, Some(&f), &["--etcd", endpoints])
            .err()
            .unwrap_or_else(|| panic!("{what}: the daemon started"));
        assert_eq!(e.code, Some(1), "{what}: {}", e.log);
        assert!(e.log.contains("nothing was started"), "{what}: {}", e.log);
        assert!(!state.exists(), "{what}: the state directory was made");
        e.log
    };
    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = refused(
        &docker_shape("ha-gone", 1, ""),
        &format!("http://127.0.0.1:{port}"),
        "etcd unreachable",
    );
    assert!(
        log.contains("cannot read run ha-gone's journal in etcd"),
        "{log}"
    );
    let log = refused(
        "run = \"ha-local\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n",
        &format!("http://127.0.0.1:{port}"),
        "process nodes",
    );
    assert!(log.contains("processes of this machine"), "{log}");
    let Some(etcd) = EtcdCluster::shared() else {
        return;
    };
    let client = etcd.client();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let run = format!("ha-foreign-{}", std::process::id());
    let header = format!("/swactor/v1/{run}/header");
    let foreign = br#"{"kind":"someone-else","format":1}"#.to_vec();
    runtime
        .block_on(client.put(&header, &foreign, None))
        .unwrap();
    let log = refused(
        &docker_shape(&run, 1, ""),
        &etcd.endpoints().join(","),
        "a foreign journal",
    );
    assert!(log.contains(&format!("/swactor/v1/{run}")), "{log}");
    let kept = runtime.block_on(client.get(&header)).unwrap().unwrap();
    assert_eq!(kept.value, foreign, "the foreign header was touched");
}
