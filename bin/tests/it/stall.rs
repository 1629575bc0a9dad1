//! A daemon that could not listen, with real processes: stopped with
//! SIGSTOP (what Ctrl-Z or a laptop's sleep does) for many graces, or
//! restarted while its agents dial it again. No live agent's node is ever
//! replaced for the daemon's own silence, and no join of a node the journal
//! holds is refused.
//!
//! `SWACTOR_STALL_LONG=1` adds a stop of 60 graces (3 minutes);
//! `SWACTOR_RESTART_RACES=N` sets the start-up race's restarts (CI: 12; the
//! issue's figure is 50).

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_actors::{AgentLink, ClusterSnapshot};

/// The group's grace in these tests.
const GRACE_S: u64 = 3;

fn shape(run: &str, n: u32) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"worker\"\ncount = {n}\nprovider = \"process\"\nboot_check = [\"true\"]\nlost_grace_s = {GRACE_S}.0\n"
    )
}

/// Every node's attempt.
fn attempts(snap: &ClusterSnapshot) -> BTreeMap<String, u64> {
    snap.nodes
        .iter()
        .map(|n| (n.node.to_string(), n.attempt.0))
        .collect()
}

fn settled(state: &Path, count: usize) -> ClusterSnapshot {
    wait_converged(state, Duration::from_secs(90), |s| {
        s.nodes.len() == count && s.nodes.iter().all(|n| n.agent == AgentLink::Connected)
    })
}

#[test]
fn a_daemon_stopped_for_many_graces_replaces_no_live_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let file = shape_file(tmp.path(), "stall.toml", &shape("stall", 3));
    let d = Daemon::start(&state, &file);
    let pid = d.pid().expect("the daemon runs");
    let before = attempts(&settled(&state, 3));
    let mut factors = vec![3, 10];
    if std::env::var_os("SWACTOR_STALL_LONG").is_some() {
        factors.push(60);
    }
    for factor in factors {
        signal(pid, "-STOP");
        std::thread::sleep(Duration::from_secs(factor * GRACE_S));
        signal(pid, "-CONT");
        // Two graces for anything wrongly lost to show.
        std::thread::sleep(Duration::from_secs(2 * GRACE_S + 2));
        let after = settled(&state, 3);
        assert_eq!(
            attempts(&after),
            before,
            "stopped for {factor} graces: a live agent's node was replaced\n{}",
            d.last_log()
        );
        let log = d.last_log();
        assert!(
            log.contains("the daemon was not listening for"),
            "the gap is said: {log}"
        );
    }

    // An agent that really dies while the daemon is stopped is replaced
    // once the daemon is back.
    let victim = agents(&state)
        .into_iter()
        .find(|((node, _), _)| node == "worker-1")
        .map(|(_, pids)| pids[0])
        .expect("worker-1's agent");
    signal(pid, "-STOP");
    kill9(victim);
    std::thread::sleep(Duration::from_secs(3 * GRACE_S));
    signal(pid, "-CONT");
    let back = Instant::now();
    let after = wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3
            && s.nodes
                .iter()
                .any(|n| n.node.to_string() == "worker-1" && n.attempt.0 != before["worker-1"])
    });
    let took = back.elapsed();
    let mut expected = before.clone();
    expected.remove("worker-1");
    let mut kept = attempts(&after);
    kept.remove("worker-1");
    assert_eq!(kept, expected, "only the dead agent's node was replaced");
    eprintln!("the dead agent's node was replaced and ready {took:?} after the daemon was back");
}

#[test]
fn joins_racing_restarts_are_never_refused_for_a_node_the_journal_holds() {
    let races: usize = env_or("SWACTOR_RESTART_RACES", 12);
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let file = shape_file(tmp.path(), "race.toml", &shape("race", 3));
    let mut d = Daemon::start(&state, &file);
    let before = attempts(&settled(&state, 3));
    let started = Instant::now();
    for i in 0..races {
        if i % 3 == 2 {
            // A crash: its agents find out within their idle timeout and
            // dial until the next daemon answers.
            d.kill9();
            std::thread::sleep(Duration::from_millis(500));
        } else {
            // `down --keep`: the agents see the connection close and dial
            // again at once, racing the next daemon's start-up.
            let o = cli(&state, &["down", "--keep"]);
            assert!(o.status.success(), "{}", stderr(&o));
            d.wait_exit(Duration::from_secs(5));
        }
        // Every other daemon lists its provider slowly, so the agents'
        // joins surely reach it before it has adopted its journal.
        let slow: &[(&str, &str)] = if i % 2 == 0 {
            &[("SWACTOR_FAULT_LIST_DELAY_MS", "1500")]
        } else {
            &[]
        };
        d = Daemon::spawn_env(&state, None, &[], slow)
            .unwrap_or_else(|e| panic!("restart {i}: `up` exited {e:?}"));
        let after = settled(&state, 3);
        let log = d.last_log();
        assert!(
            !log.contains("is not a node of this cluster") && !log.contains("refused the join"),
            "restart {i}: a join was refused for a node the journal holds\n{log}"
        );
        assert_eq!(
            attempts(&after),
            before,
            "restart {i}: nothing was replaced\n{log}"
        );
    }
    eprintln!(
        "{races} restarts raced against live agents' joins in {:?}",
        started.elapsed()
    );
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
}
