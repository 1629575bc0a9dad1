//! Starting a daemon again on a state directory: what its journal makes it
//! adopt, replace, refuse, and never reuse.

use crate::common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_actors::{AgentLink, ClusterSnapshot};

const CONVERGE: Duration = Duration::from_secs(60);

type Id = (String, u64);

/// The (node, attempt) of every node a status lists.
fn ids(snap: &ClusterSnapshot) -> BTreeSet<Id> {
    snap.nodes
        .iter()
        .map(|n| (n.node.to_string(), n.attempt.0))
        .collect()
}

fn all_connected(snap: &ClusterSnapshot) -> bool {
    snap.nodes.iter().all(|n| n.agent == AgentLink::Connected)
}

/// Waits for `count` nodes, converged, every agent connected.
fn converged_on(state: &Path, count: usize) -> ClusterSnapshot {
    wait_converged(state, CONVERGE, |s| {
        s.nodes.len() == count && all_connected(s)
    })
}

/// The live agents, which must be exactly one per node of `snap`.
fn one_agent_per_node(state: &Path, snap: &ClusterSnapshot) -> BTreeMap<Id, Vec<u32>> {
    let live = agents(state);
    let keys: BTreeSet<Id> = live.keys().cloned().collect();
    assert_eq!(
        keys,
        ids(snap),
        "live agents are the nodes' current attempts"
    );
    assert!(
        live.values().all(|p| p.len() == 1),
        "one process per identity: {live:?}"
    );
    assert_eq!(node_dir_ids(state), ids(snap), "node directories");
    live
}

/// `swactor down [--keep]`, which must succeed with the daemon gone.
fn down(state: &Path, d: &mut Daemon, keep: bool) -> String {
    let args: &[&str] = if keep { &["down", "--keep"] } else { &["down"] };
    let o = cli(state, args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        d.wait_exit(Duration::from_secs(2)),
        Some(0),
        "the daemon exited by the time `down` returned: {}",
        d.last_log()
    );
    stdout(&o)
}

fn nothing_left(state: &Path) {
    assert!(agents(state).is_empty(), "agents left: {:?}", agents(state));
    assert!(
        node_dirs(state).is_empty(),
        "node directories left: {:?}",
        node_dirs(state)
    );
}

/// `up` without a shape, which must come up.
fn resume(state: &Path) -> Daemon {
    Daemon::spawn(state, None).unwrap_or_else(|e| panic!("`up` without a shape exited {e:?}"))
}

fn attempts(snap: &ClusterSnapshot) -> Vec<u64> {
    snap.nodes.iter().map(|n| n.attempt.0).collect()
}

#[test]
fn up_without_a_shape_after_down_keep_adopts_every_node_and_starts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let three = shape_file(tmp.path(), "three.toml", &workers("restart-keep", 3));
    let mut d = Daemon::start(&state, &three);
    let snap = converged_on(&state, 3);
    let before = one_agent_per_node(&state, &snap);
    let doubles = Watcher::doubles(&state);

    let out = down(&state, &mut d, true);
    assert!(out.contains("kept 3 node(s)"), "{out}");
    assert_eq!(agents(&state), before, "kept agents outlive their daemon");

    let mut d2 = resume(&state);
    let after = converged_on(&state, 3);
    assert!(
        d2.last_log()
            .contains("resuming run restart-keep at generation 1"),
        "{}",
        d2.last_log()
    );
    assert_eq!(ids(&after), ids(&snap), "the same attempts");
    // Let any wrongly started agent show up before counting.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        one_agent_per_node(&state, &after),
        before,
        "the same processes, nothing new started"
    );
    let (found, count) = doubles.stop();
    assert_eq!(count, 0, "two agents for one identity: {found:?}");
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn adopting_nodes_of_a_drifted_template_replaces_every_one_without_a_double() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let a_body = workers("restart-drift", 3);
    let b_body = a_body.replace("[\"true\"]", "[\"/bin/true\"]");
    assert_ne!(a_body, b_body, "shape B differs in its boot check only");
    let a = shape_file(tmp.path(), "a.toml", &a_body);
    let b = shape_file(tmp.path(), "b.toml", &b_body);
    let mut d = Daemon::start(&state, &a);
    let snap = converged_on(&state, 3);
    let before = one_agent_per_node(&state, &snap);
    let newest_old = attempts(&snap).into_iter().max().unwrap();
    let doubles = Watcher::doubles(&state);
    down(&state, &mut d, true);

    let mut d2 = Daemon::start(&state, &b);
    let after = wait_converged(&state, CONVERGE, |s| {
        s.nodes.len() == 3 && all_connected(s) && attempts(s).iter().all(|&a| a > newest_old)
    });
    let live = one_agent_per_node(&state, &after);
    let old_pids: BTreeSet<u32> = before.values().flatten().copied().collect();
    assert!(
        live.values().flatten().all(|p| !old_pids.contains(p)),
        "no old agent serves a new attempt: {live:?}, old {before:?}"
    );
    let log = d2.last_log();
    let plan = log
        .lines()
        .find(|l| l.contains("plan:"))
        .unwrap_or_default();
    eprintln!("up B: {plan}");
    assert!(plan.contains("3 to replace"), "{log}");
    let (found, count) = doubles.stop();
    assert_eq!(count, 0, "two agents for one identity: {found:?}");
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn attempt_ids_keep_rising_after_a_full_teardown() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let three = shape_file(tmp.path(), "three.toml", &workers("restart-ids", 3));
    let mut d = Daemon::start(&state, &three);
    let first = attempts(&converged_on(&state, 3));
    down(&state, &mut d, false);
    nothing_left(&state);

    let e = Daemon::spawn(&state, None)
        .err()
        .expect("`up` without a shape after a teardown does not start");
    assert_ne!(e.code, Some(0), "{}", e.log);
    assert!(e.log.contains("there is nothing to resume"), "{}", e.log);

    let mut d2 = Daemon::start(&state, &three);
    let second = attempts(&converged_on(&state, 3));
    let newest_old = *first.iter().max().unwrap();
    assert!(
        second.iter().all(|&a| a > newest_old),
        "every new attempt id {second:?} is greater than every earlier one {first:?}"
    );
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn generations_keep_rising_across_a_kill_9() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-gen", 2));
    let three = shape_file(tmp.path(), "three.toml", &workers("restart-gen", 3));
    let mut d = Daemon::start(&state, &two);
    assert_eq!(converged_on(&state, 2).generation.0, 1);
    let o = cli(&state, &["apply", three.to_str().unwrap(), "--yes"]);
    assert!(stdout(&o).contains("generation 2"), "{}", stderr(&o));
    assert_eq!(converged_on(&state, 3).generation.0, 2);
    d.kill9();

    let mut d2 = resume(&state);
    let snap = converged_on(&state, 3);
    assert_eq!(snap.generation.0, 2, "{snap:#?}");
    assert!(
        d2.last_log()
            .contains("resuming run restart-gen at generation 2"),
        "{}",
        d2.last_log()
    );
    let o = cli(&state, &["apply", two.to_str().unwrap(), "--yes"]);
    assert!(stdout(&o).contains("generation 3"), "{}", stderr(&o));
    assert_eq!(converged_on(&state, 2).generation.0, 3);
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn a_journal_of_another_run_is_refused_and_nothing_is_destroyed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let a = shape_file(tmp.path(), "a.toml", &workers("run-alpha", 2));
    let b = shape_file(tmp.path(), "b.toml", &workers("run-beta", 2));
    let mut d = Daemon::start(&state, &a);
    let before = one_agent_per_node(&state, &converged_on(&state, 2));
    down(&state, &mut d, true);

    let e = Daemon::spawn(&state, Some(&b))
        .err()
        .expect("a shape of another run does not start");
    assert_ne!(e.code, Some(0), "{}", e.log);
    assert!(
        e.log.contains("run-alpha") && e.log.contains("run-beta"),
        "the error names both runs: {}",
        e.log
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(agents(&state), before, "run-alpha's agents still run");

    // And its journal is intact: run-alpha resumes with the same agents.
    let mut d2 = resume(&state);
    let snap = converged_on(&state, 2);
    assert_eq!(one_agent_per_node(&state, &snap), before);
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn a_corrupt_journal_is_refused_naming_the_file_and_nothing_is_destroyed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-corrupt", 2));
    let mut d = Daemon::start(&state, &two);
    let before = one_agent_per_node(&state, &converged_on(&state, 2));
    down(&state, &mut d, true);

    let journal = state.join("journal.redb");
    let copy = tmp.path().join("journal.redb.copy");
    std::fs::copy(&journal, &copy).unwrap();
    let garbage: Vec<u8> = (0..16_384u32).map(|i| (i * 7 + 13) as u8).collect();
    std::fs::write(&journal, &garbage).unwrap();
    for shape in [None, Some(two.as_path())] {
        let e = Daemon::spawn(&state, shape)
            .err()
            .expect("a corrupt journal does not start");
        assert_ne!(e.code, Some(0), "{}", e.log);
        assert!(
            e.log.contains("journal.redb"),
            "the error names the file: {}",
            e.log
        );
    }
    // Cut to half its length (issue 29, item 10): redb asserts on that
    // rather than returning an error; the refusal is still the only thing
    // said, with no panic message or backtrace before it.
    let whole = std::fs::read(&copy).unwrap();
    std::fs::write(&journal, &whole[..whole.len() / 2]).unwrap();
    let e = Daemon::spawn(&state, None)
        .err()
        .expect("a truncated journal does not start");
    assert!(
        e.log.contains("journal.redb")
            && !e.log.contains("panicked")
            && !e.log.contains("backtrace"),
        "one clear refusal: {}",
        e.log
    );
    std::fs::write(&journal, &garbage).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(agents(&state), before, "the kept agents still run");
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        garbage,
        "the file is left as it was"
    );

    std::fs::copy(&copy, &journal).unwrap();
    let mut d2 = resume(&state);
    let snap = converged_on(&state, 2);
    assert_eq!(
        one_agent_per_node(&state, &snap),
        before,
        "adopted once the journal is back"
    );
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn with_daemon_key_deleted_kept_agents_are_replaced_and_never_counted_as_converged() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-key", 2));
    let mut d = Daemon::start(&state, &two);
    let snap = converged_on(&state, 2);
    let before = one_agent_per_node(&state, &snap);
    down(&state, &mut d, true);
    std::fs::remove_file(state.join("daemon.key")).unwrap();

    let doubles = Watcher::doubles(&state);
    let started = Instant::now();
    let mut d2 = resume(&state);
    // Started once the daemon is up: a CLI call before its ticket exists
    // kills it (see `a_cli_call_while_the_daemon_starts_does_not_kill_it`).
    let lies = {
        let state = state.clone();
        Watcher::start(Duration::from_millis(100), move || match status(&state) {
            Some(s) if s.converged && !all_connected(&s) => vec![format!("{s:?}")],
            _ => Vec::new(),
        })
    };
    let old: BTreeSet<Id> = before.keys().cloned().collect();
    let after = wait_converged(&state, Duration::from_secs(30), |s| {
        s.nodes.len() == 2 && all_connected(s) && ids(s).is_disjoint(&old)
    });
    let took = started.elapsed();
    eprintln!("replaced after {:.1} s", took.as_secs_f64());
    let live = one_agent_per_node(&state, &after);
    let old_pids: BTreeSet<u32> = before.values().flatten().copied().collect();
    assert!(
        live.values().flatten().all(|p| !old_pids.contains(p)),
        "no old agent survives: {live:?}"
    );
    let (found, count) = lies.stop();
    assert_eq!(
        count, 0,
        "status said converged while an agent was not connected: {found:?}"
    );
    let (found, count) = doubles.stop();
    assert_eq!(count, 0, "two agents for one identity: {found:?}");
    down(&state, &mut d2, false);
    nothing_left(&state);
}

#[test]
fn right_after_down_returns_up_takes_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-down", 2));
    let mut d = Daemon::start(&state, &two);
    converged_on(&state, 2);
    for keep in [false, true, false] {
        let args: &[&str] = if keep { &["down", "--keep"] } else { &["down"] };
        let o = cli(&state, args);
        assert!(o.status.success(), "{}", stderr(&o));
        // At once: after a teardown the shape is needed again, after a keep it is not.
        let next = Daemon::spawn(&state, (!keep).then_some(two.as_path()));
        let mut next = next.unwrap_or_else(|e| {
            panic!(
                "`up` right after `{}` exited {:?}: {}",
                args.join(" "),
                e.code,
                e.log
            )
        });
        assert_eq!(
            d.wait_exit(Duration::from_millis(500)),
            Some(0),
            "the old daemon had exited when `down` returned"
        );
        assert!(
            !next.last_log().contains("already running"),
            "{}",
            next.last_log()
        );
        converged_on(&state, 2);
        assert!(next.running());
        d = next;
    }
    down(&state, &mut d, false);
    nothing_left(&state);
}

/// A kept agent whose daemon is gone keeps dialling it; `kill` (SIGTERM), the
/// way a provider's destroy or a person stops it, must still end it promptly.
#[test]
fn an_agent_whose_daemon_is_gone_still_stops_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let one = shape_file(tmp.path(), "one.toml", &workers("restart-term", 1));
    let mut d = Daemon::start(&state, &one);
    let snap = converged_on(&state, 1);
    let pid = one_agent_per_node(&state, &snap)
        .into_values()
        .flatten()
        .next()
        .unwrap();
    down(&state, &mut d, true);
    // The agent notices the daemon is gone within 4 s and starts dialling again.
    std::thread::sleep(Duration::from_secs(6));
    assert!(alive(pid), "the kept agent runs on");
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !alive(pid),
        "agent {pid} still runs {:?} after SIGTERM (the process provider's destroy waits \
         5 s for it, then sends SIGKILL)",
        start.elapsed()
    );
}

/// Found by the test above: `status` run while a daemon starts (its lock
/// taken, its ticket not yet written) must not stop it.
#[test]
fn a_cli_call_while_the_daemon_starts_does_not_kill_it() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-early", 2));
    let mut d = Daemon::start(&state, &two);
    let before = one_agent_per_node(&state, &converged_on(&state, 2));
    down(&state, &mut d, true);
    for round in 0..3 {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let asker = {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut asked = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = cli(&state, &["status"]);
                    asked += 1;
                }
                asked
            })
        };
        let started = Daemon::spawn(&state, None);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let asked = asker.join().unwrap();
        let next = started.unwrap_or_else(|e| {
            panic!("round {round}: `up` died while `status` was asked {asked} time(s): {e:?}")
        });
        // Dropped while the new daemon holds the lock, the old handle leaves
        // the kept agents alone.
        drop(std::mem::replace(&mut d, next));
        let snap = converged_on(&state, 2);
        assert_eq!(one_agent_per_node(&state, &snap), before, "round {round}");
        down(&state, &mut d, round < 2);
    }
    nothing_left(&state);
    drop(d);
}

/// Issue 29, item 8: with its journal deleted, `up SHAPE` said nothing,
/// planned "4 to create", destroyed every running node as an orphan and
/// created it again (on Vast.ai: every machine rented twice). Now it stops
/// and names what it found; `--adopt` takes the running nodes as they are,
/// `--fresh` destroys them first.
#[test]
fn a_lost_journal_is_noticed_and_nothing_is_destroyed_without_a_choice() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("restart-lost", 2));
    let mut d = Daemon::start(&state, &two);
    let before = one_agent_per_node(&state, &converged_on(&state, 2));
    let first = attempts(&converged_on(&state, 2));
    d.kill9();
    std::fs::remove_file(state.join("journal.redb")).unwrap();

    let e = Daemon::spawn(&state, Some(&two))
        .err()
        .expect("a daemon whose journal was lost does not start on its own");
    assert!(
        e.log
            .contains("there is no journal, but a run was here before")
            && e.log.contains("token.secret")
            && e.log.contains("--adopt")
            && e.log.contains("--fresh"),
        "{}",
        e.log
    );
    assert!(!state.join("journal.redb").exists(), "nothing was started");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(agents(&state), before, "nothing was destroyed");
    // A journal is not a lost one: the choice is refused next to one.
    // (Checked once a daemon made a new journal, below.)

    let mut d = Daemon::spawn_with(&state, Some(&two), &["--adopt"])
        .unwrap_or_else(|e| panic!("--adopt: {e:?}"));
    let snap = converged_on(&state, 2);
    assert_eq!(
        attempts(&snap),
        first,
        "adopted as they were, nothing created"
    );
    assert_eq!(
        one_agent_per_node(&state, &snap),
        before,
        "the same agents: {}",
        d.last_log()
    );
    d.kill9();
    let e = Daemon::spawn_with(&state, Some(&two), &["--fresh"])
        .err()
        .expect("--fresh next to a journal is refused");
    assert!(e.log.contains("has a journal"), "{}", e.log);

    // --fresh: destroyed first, then made anew.
    std::fs::remove_file(state.join("journal.redb")).unwrap();
    let mut d = Daemon::spawn_with(&state, Some(&two), &["--fresh"])
        .unwrap_or_else(|e| panic!("--fresh: {e:?}"));
    let snap = wait_converged(&state, CONVERGE, |s| {
        s.nodes.len() == 2 && all_connected(s) && attempts(s).iter().all(|a| !first.contains(a))
    });
    one_agent_per_node(&state, &snap);
    down(&state, &mut d, false);
    nothing_left(&state);
}
