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
    // What a node does if its daemon goes is shown with it.
    let o = cli(&state, &["describe", "worker-0"]);
    let text = stdout(&o);
    assert!(
        text.contains("ends itself 5 s after its daemon stops renewing its lease"),
        "{text}{}",
        stderr(&o)
    );
    // When the new daemon last renewed it, in describe and in status.
    let renewed = |line: &str| {
        line.split("renewed ")
            .nth(1)
            .and_then(|rest| rest.split(" s ago").next())
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|s| s <= 2)
            || line.contains("renewed just now")
    };
    let line = text.lines().find(|l| l.contains("if orphaned")).unwrap();
    assert!(renewed(line), "{line}");
    let o = cli(&state, &["status"]);
    let text = stdout(&o);
    assert!(text.contains("LEASE"), "{text}");
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("worker-"))
        .collect();
    assert_eq!(rows.len(), 3, "{text}");
    assert!(rows.iter().all(|r| renewed(r)), "{text}");
    assert!(
        text.contains(
            "if this daemon goes for good, its nodes end themselves after 5 s without a lease renewal"
        ),
        "{text}"
    );
}

#[test]
fn no_account_key_and_no_daemon_secret_reach_a_local_node() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "two.toml", &workers("no-keys", 2));
    // The daemon has the account's key in its environment, as a user who
    // rents on Vast.ai has; nothing here rents, and nothing dials out (the
    // service's address is a closed loopback port).
    let key = format!("vastkey-{}", std::process::id());
    let _d = Daemon::spawn_env(
        &state,
        Some(&shape),
        &[],
        &[("VAST_API_KEY", &key), ("VAST_URL", "http://127.0.0.1:9")],
    )
    .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
    });
    let secret = std::fs::read(state.join("token.secret")).unwrap();
    assert_eq!(secret.len(), 32);
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let forbidden: [(&str, &[u8]); 3] = [
        ("the Vast.ai API key", key.as_bytes()),
        ("the daemon's token secret", &secret),
        ("the daemon's token secret in hex", hex.as_bytes()),
    ];
    let agents = one_agent_each(&state);
    assert_eq!(agents.len(), 2);
    for (id, pid) in &agents {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        for (what, bytes) in forbidden {
            assert!(
                !holds(&environ, bytes),
                "{what} is in the environment of {id:?}"
            );
            assert!(!holds(&argv, bytes), "{what} is in the arguments of {id:?}");
        }
    }
    for dir in node_dirs(&state) {
        for (path, bytes) in files_under(&dir) {
            for (what, needle) in forbidden {
                assert!(!holds(&bytes, needle), "{what} is in {}", path.display());
            }
        }
    }
    // A job sees what its agent sees.
    let o = std::process::Command::new(BIN)
        .arg("run")
        .arg("--state-dir")
        .arg(&state)
        .args(["--all", "--", "env"])
        .current_dir(tmp.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("SWACTOR_NODE="), "{out}");
    assert!(!out.contains(&key), "a job sees the account key:\n{out}");
}

#[test]
fn with_orphan_policy_idle_a_node_running_a_job_outlives_its_lease_until_the_job_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let body = format!(
        "{}orphan_after_s = 3\norphan_policy = \"idle\"\n",
        workers("orphan-idle", 2)
    );
    let shape = shape_file(tmp.path(), "idle.toml", &body);
    let mut d = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
    });
    let held = one_agent_each(&state);
    // A 10 s job on worker-0 only; worker-1 is idle.
    let mut job = std::process::Command::new(BIN)
        .arg("run")
        .arg("--state-dir")
        .arg(&state)
        .args(["--nodes", "worker-0", "--", "sleep", "10"])
        .current_dir(tmp.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = |node: &str| {
        held.iter()
            .find(|((n, _), _)| n == node)
            .map(|(_, p)| *p)
            .unwrap()
    };
    let (busy, idle) = (pid("worker-0"), pid("worker-1"));
    // The job has started once its command runs under the busy agent.
    let sleeping = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .any(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == b"sleep\x0010\x00"))
    };
    let asked = Instant::now();
    while !sleeping() {
        assert!(
            asked.elapsed() < Duration::from_secs(20),
            "the job did not start: {}",
            std::fs::read_to_string(tmp.path().join("job.err")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    d.kill9();
    let killed = Instant::now();
    // The idle node ends within its lease and margin; the busy one does not.
    wait_for(Duration::from_secs(3 + 3), "the idle node to end", || {
        !alive(idle)
    });
    assert!(alive(busy), "the node running a job ended with its lease");
    // The job ends 10 s after it started; its node ends one lease later.
    wait_for(
        (Duration::from_secs(10 + 3 + 3)).saturating_sub(started.elapsed()),
        "the busy node to end after its job",
        || !alive(busy),
    );
    let busy_for = killed.elapsed();
    assert!(
        busy_for >= Duration::from_secs(8),
        "the busy node ended {busy_for:?} after its daemon, before its job could end"
    );
    let _ = job.kill();
    let _ = job.wait();
}

/// A daemon stopped (SIGSTOP: a laptop's sleep) for longer than the lease
/// wakes to nodes that ended themselves: each slot gets exactly one new
/// agent, and the daemon says how long it was not listening.
#[test]
fn a_daemon_asleep_past_the_lease_brings_each_ended_node_back_once() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "orphan-asleep");
    let d = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready)
    });
    let held = one_agent_each(&state);
    let pid = d.pid().expect("the daemon runs");
    let doubles = Watcher::doubles(&state);
    signal(pid, "-STOP");
    let stopped = Instant::now();
    wait_for(
        LEASE + MARGIN,
        "every agent to end while the daemon sleeps",
        || held.values().all(|p| !alive(*p)),
    );
    eprintln!(
        "every agent ended {:?} into the daemon's sleep",
        stopped.elapsed()
    );
    signal(pid, "-CONT");
    let woke = Instant::now();
    wait_converged(&state, Duration::from_secs(60), |s| {
        s.nodes.len() == 3 && s.nodes.iter().all(|n| n.ready) && agents(&state).len() == 3
    });
    eprintln!("all ready again {:?} after the daemon woke", woke.elapsed());
    let now = one_agent_each(&state);
    for (id, pid) in &now {
        assert!(
            !held.values().any(|p| p == pid),
            "{id:?}: the old agent {pid} is back"
        );
    }
    let (found, _) = doubles.stop();
    assert!(found.is_empty(), "two agents of one slot: {found:?}");
    let log = d.last_log();
    assert!(log.contains("the daemon was not listening for"), "{log}");
}
