//! The daemon as a supervisor: a cluster actor that panics is restarted from
//! the journal without a double create or a leak, and past the restart
//! budget the daemon exits non-zero and leaves every node running.
//!
//! The panics are injected through `SWACTOR_FAULT_DRIVER_PANICS=N@MS`, a
//! fault only debug builds of the daemon honour.

use crate::common;

use common::*;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CONVERGE: Duration = Duration::from_secs(60);

fn up_with_faults(state: &std::path::Path, shape: &std::path::Path, faults: &str) -> Daemon {
    let log = std::fs::File::create(state.with_extension("daemon.log")).unwrap();
    let child = Command::new(BIN)
        .arg("up")
        .arg(shape)
        .arg("--state-dir")
        .arg(state)
        .env("SWACTOR_FAULT_DRIVER_PANICS", faults)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the daemon");
    let d = Daemon {
        child: Some(child),
        state: state.to_path_buf(),
    };
    wait_for(Duration::from_secs(30), "the daemon's ticket", || {
        state.join("daemon.ticket").exists()
    });
    d
}

#[test]
fn a_cluster_actor_that_panics_while_nodes_converge_is_restarted_without_a_double_create() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "four.toml", &workers("sup-restart", 4));
    // Two panics while the nodes come up (0.4 s and 0.8 s after start).
    let d = up_with_faults(&state, &shape, "2@400");

    // Watch for two live agents of one identity, and for status answering,
    // for the whole run.
    let stop = Arc::new(AtomicBool::new(false));
    let doubles: Arc<Mutex<Vec<String>>> = Arc::default();
    let gaps: Arc<Mutex<(Duration, u32)>> = Arc::default();
    let watchers = {
        let (stop, doubles, gaps, state) =
            (stop.clone(), doubles.clone(), gaps.clone(), state.clone());
        std::thread::spawn(move || {
            let mut last_answer = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                for ((node, attempt), pids) in agents(&state) {
                    if pids.len() > 1 {
                        doubles
                            .lock()
                            .unwrap()
                            .push(format!("{node} a{attempt}: {pids:?}"));
                    }
                }
                if status(&state).is_some() {
                    let mut g = gaps.lock().unwrap();
                    g.0 = g.0.max(last_answer.elapsed());
                    g.1 += 1;
                    last_answer = Instant::now();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let snap = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 4);
    std::thread::sleep(Duration::from_millis(1_500));
    // Watched for at least a dozen answers, however fast this machine runs
    // the CLI (a loaded one took 0.8 s a status): the gaps between them are
    // what is checked.
    let watched = Instant::now();
    while gaps.lock().unwrap().1 <= 10 && watched.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    watchers.join().unwrap();
    let log = d.log();
    assert!(
        log.matches("injecting a panic").count() == 2,
        "both faults fired: {log}"
    );
    assert!(
        doubles.lock().unwrap().is_empty(),
        "{:?}",
        doubles.lock().unwrap()
    );
    // Exactly one agent per node, each the node's current attempt.
    let live = agents(&state);
    assert_eq!(live.len(), 4, "{live:?}");
    for n in &snap.nodes {
        let pids = live.get(&(n.node.to_string(), n.attempt.0));
        assert_eq!(
            pids.map(Vec::len),
            Some(1),
            "{} {}: {live:?}",
            n.node,
            n.attempt
        );
    }
    let (gap, answers) = *gaps.lock().unwrap();
    eprintln!("status answered {answers} times; longest gap {gap:?}");
    assert!(answers > 10, "status kept answering ({answers} answers)");
    assert!(
        gap < Duration::from_secs(5),
        "status answered within a bounded gap ({gap:?})"
    );
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(agents(&state).is_empty(), "{:?}", agents(&state));
    assert!(node_dirs(&state).is_empty(), "{:?}", node_dirs(&state));
}

#[test]
fn past_its_restart_budget_the_daemon_exits_non_zero_and_the_next_up_adopts_every_node() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "two.toml", &workers("sup-budget", 2));
    // Let the nodes converge first, then panic more often than the budget
    // (3 restarts in 60 s) allows.
    let mut d = up_with_faults(&state, &shape, "6@2500");
    let before = {
        let snap = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
        assert_eq!(snap.nodes.len(), 2);
        agents(&state)
    };
    let code = d.wait_exit(Duration::from_secs(60));
    assert_eq!(code, Some(3), "the daemon gives up with exit code 3");
    let log = d.log();
    assert!(
        log.contains("kept failing") && log.contains("leaves every node running"),
        "{log}"
    );
    // Every node is still running: the failure was the daemon's, not theirs.
    assert_eq!(
        agents(&state),
        before,
        "the nodes outlive a daemon that gave up"
    );

    // The next daemon adopts them: the same attempts, the same processes.
    let _ = std::fs::remove_file(state.join("daemon.ticket"));
    let d2 = Daemon::start(&state, &shape);
    let snap = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(agents(&state), before, "adopted, nothing started again");
    for n in &snap.nodes {
        assert!(before.contains_key(&(n.node.to_string(), n.attempt.0)));
    }
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    drop(d2);
    assert!(agents(&state).is_empty());
}
