//! `swactor pause` and `swactor resume` with real daemons and agent processes.

use crate::common;

use common::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_actors::AgentLink;

type Id = (String, u64);

/// The (node, attempt) of every live agent process of the state directory.
fn agent_ids(state: &Path) -> BTreeSet<Id> {
    agents(state).into_keys().collect()
}

/// Watches the agents for `period`: none may appear that `allowed` does not hold.
fn no_new_agents_for(state: &Path, allowed: &BTreeSet<Id>, period: Duration, why: &str) {
    let start = Instant::now();
    while start.elapsed() < period {
        let now = agent_ids(state);
        let new: Vec<&Id> = now.difference(allowed).collect();
        assert!(new.is_empty(), "{why}: new agents while paused: {new:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn paused_status(state: &Path) -> swactor_actors::ClusterSnapshot {
    let snap = status(state).expect("a status");
    assert!(snap.paused, "the status says paused: {snap:#?}");
    let o = cli(state, &["status"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let headline = stdout(&o).lines().next().unwrap_or_default().to_owned();
    assert!(headline.contains("paused"), "headline: {headline}");
    snap
}

#[test]
fn pausing_during_convergence_freezes_dispatches() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let three = shape_file(tmp.path(), "three.toml", &workers("pause", 3));
    let five = shape_file(tmp.path(), "five.toml", &workers("pause", 5));
    let mut d = Daemon::start(&state, &three);

    // Paused mid-convergence: what was dispatched finishes, nothing else starts.
    let o = cli(&state, &["pause"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("paused"), "{}", stdout(&o));
    let o = cli(&state, &["status"]);
    eprintln!("right after pausing:\n{}", stdout(&o));
    let o = cli(&state, &["pause"]);
    assert!(stdout(&o).contains("already paused"), "{}", stdout(&o));
    // Operations under way when it paused may still start their agents.
    std::thread::sleep(Duration::from_secs(1));
    let at_pause = agent_ids(&state);
    eprintln!("agents when paused: {at_pause:?}");
    paused_status(&state);
    no_new_agents_for(&state, &at_pause, Duration::from_secs(3), "after pause");

    // A scale-up while paused is recorded, not executed.
    let o = cli(&state, &["apply", five.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("paused") && stdout(&o).contains("swactor resume"),
        "apply says the shape waits for resume: {}",
        stdout(&o)
    );
    no_new_agents_for(&state, &at_pause, Duration::from_secs(3), "after apply");
    let snap = paused_status(&state);
    assert_eq!(snap.desired_nodes, 5, "the shape is recorded");
    assert!(snap.nodes.len() <= 3, "no slot inserted: {snap:#?}");

    // An agent killed while paused: its node fails and is cleaned up, not replaced.
    let victim = agents(&state)
        .into_iter()
        .next()
        .expect("at least one agent started before the pause");
    let ((victim_node, victim_attempt), pids) = victim;
    kill9(pids[0]);
    wait_for(
        Duration::from_secs(20),
        "the killed agent's node to be seen lost",
        || {
            status(&state).is_some_and(|s| {
                s.nodes.iter().any(|n| {
                    n.node.to_string() == victim_node && n.attempt.0 == victim_attempt && !n.ready
                })
            })
        },
    );
    let mut allowed = at_pause.clone();
    allowed.remove(&(victim_node.clone(), victim_attempt));
    no_new_agents_for(&state, &allowed, Duration::from_secs(4), "after kill");
    let snap = paused_status(&state);
    let lost = snap
        .nodes
        .iter()
        .find(|n| n.node.to_string() == victim_node)
        .expect("the lost node is still listed");
    assert_eq!(lost.attempt.0, victim_attempt, "not replaced: {lost:?}");
    assert!(!lost.ready, "{lost:?}");

    // The daemon killed with -9 while paused comes back paused.
    d.kill9();
    let mut d = Daemon::spawn(&state, None).unwrap_or_else(|e| panic!("`up` exited {e:?}"));
    wait_for(Duration::from_secs(10), "a status", || {
        status(&state).is_some()
    });
    paused_status(&state);
    assert!(
        d.last_log().contains("it is paused"),
        "the restarted daemon says it is paused: {}",
        d.last_log()
    );
    no_new_agents_for(&state, &allowed, Duration::from_secs(4), "after restart");
    // Its running agents re-attach while paused: each one's node is ready
    // again (not "creating" for as long as the pause lasts).
    let running = agent_ids(&state);
    assert!(!running.is_empty());
    wait_for(
        Duration::from_secs(30),
        "the running nodes ready again while paused",
        || {
            status(&state).is_some_and(|s| {
                s.paused
                    && running.iter().all(|(node, attempt)| {
                        s.nodes.iter().any(|n| {
                            n.node.to_string() == *node && n.attempt.0 == *attempt && n.ready
                        })
                    })
            })
        },
    );
    assert!(
        paused_status(&state).nodes.len() <= 3,
        "nothing inserted after the restart"
    );

    // Resumed: converges on the five of the recorded shape.
    let o = cli(&state, &["resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("resumed"), "{}", stdout(&o));
    let snap = wait_converged(&state, Duration::from_secs(90), |s| {
        s.nodes.len() == 5 && s.nodes.iter().all(|n| n.agent == AgentLink::Connected)
    });
    assert!(!snap.paused);
    assert_eq!(agent_ids(&state).len(), 5);
    let o = cli(&state, &["resume"]);
    assert!(stdout(&o).contains("not paused"), "{}", stdout(&o));

    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(5)), Some(0), "{}", d.log());
    assert!(agent_ids(&state).is_empty(), "agents left");
    assert!(node_dirs(&state).is_empty(), "{:?}", node_dirs(&state));
    eprintln!("took {:?}", started.elapsed());
}

/// `down` while paused: the teardown overrides the pause and removes
/// everything, and the next `up` is not paused.
#[test]
fn down_overrides_a_pause_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("pause-down", 2));
    let mut d = Daemon::start(&state, &two);
    wait_converged(&state, Duration::from_secs(60), |s| s.nodes.len() == 2);
    let o = cli(&state, &["pause"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(5)), Some(0), "{}", d.log());
    assert!(agent_ids(&state).is_empty(), "agents left");
    assert!(node_dirs(&state).is_empty(), "{:?}", node_dirs(&state));
    assert!(
        d.log().contains("overrides the pause"),
        "the log says why: {}",
        d.log()
    );

    // Started again: not paused, it converges.
    let mut d = Daemon::start(&state, &two);
    let snap = wait_converged(&state, Duration::from_secs(60), |s| s.nodes.len() == 2);
    assert!(!snap.paused);
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(5)), Some(0), "{}", d.log());
}
