//! The dead-man's switch on local processes: agents whose daemon is gone
//! for good end their nodes once their lease lapses, and a daemon back in
//! time finds every node as it left it.

use crate::common;

use common::*;
use std::time::{Duration, Instant};

/// The lease these tests give: 5 s.
const LEASE: Duration = Duration::from_secs(5);
/// What the issue allows past the lease for every agent to be gone.
const MARGIN: Duration = Duration::from_secs(3);

fn shape(dir: &std::path::Path, run: &str) -> std::path::PathBuf {
    let body = format!("{}orphan_after_s = 5\n", workers(run, 3));
    shape_file(dir, "orphan.toml", &body)
}

/// Every agent of the run, by (node, attempt), once each has exactly one.
fn one_agent_each(state: &std::path::Path) -> std::collections::BTreeMap<(String, u64), u32> {
    agents(state)
        .into_iter()
        .map(|(id, pids)| {
            assert_eq!(pids.len(), 1, "{id:?}: {pids:?}");
            (id, pids[0])
        })
        .collect()
}

#[test]
fn agents_of_a_daemon_gone_for_good_end_their_nodes_once_their_lease_lapses() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "orphan-gone");
    let mut d = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready)
    });
    let held = one_agent_each(&state);
    assert_eq!(held.len(), 3);
    d.kill9();
    let killed = Instant::now();
    // Nothing ends early: a second before the lease could lapse, all run.
    std::thread::sleep(LEASE - Duration::from_millis(1_500));
    let early: Vec<_> = held.values().filter(|p| !alive(**p)).collect();
    assert!(
        early.is_empty(),
        "agents {early:?} ended before their lease"
    );
    wait_for(
        LEASE + MARGIN - killed.elapsed(),
        "every agent to end",
        || held.values().all(|p| !alive(*p)),
    );
    eprintln!("every agent ended {:?} after the daemon", killed.elapsed());
    assert!(agents(&state).is_empty());

    // A daemon started afterwards starts each slot's node once more (a
    // local node's directory is its lease: the agent left it, so the new
    // agent starts there), and never two agents for one slot.
    let doubles = Watcher::doubles(&state);
    let _d = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready) && agents(&state).len() == 3
    });
    let now = one_agent_each(&state);
    assert_eq!(now.len(), 3, "one agent per slot: {now:?}");
    for (id, pid) in &now {
        assert!(
            !held.values().any(|p| p == pid),
            "{id:?}: the old agent {pid} is back"
        );
    }
    let (found, _) = doubles.stop();
    assert!(found.is_empty(), "two agents of one slot: {found:?}");
}

#[test]
fn a_daemon_back_within_the_lease_adopts_every_node_and_makes_none() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "orphan-back");
    let mut d = Daemon::start(&state, &shape);
    let before = wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready)
    });
    let held = one_agent_each(&state);
    d.kill9();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let _d = Daemon::spawn(&state, Some(&shape)).unwrap();
    // Past the lease and its margin, counted from the kill: the daemon
    // back has renewed every lease in time.
    std::thread::sleep((LEASE + MARGIN).saturating_sub(killed.elapsed()));
    let after = wait_converged(&state, Duration::from_secs(30), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready)
    });
    for n in &after.nodes {
        let old = before.nodes.iter().find(|b| b.node == n.node).unwrap();
        assert_eq!(
            n.attempt, old.attempt,
            "{}: adopted, not made again",
            n.node
        );
    }
    assert_eq!(one_agent_each(&state), held, "the same agents, all alive");
}
