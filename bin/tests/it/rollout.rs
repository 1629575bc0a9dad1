//! Rolling replacement and the remediation breaker with real daemons and agent processes.

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;

const CONVERGE: Duration = Duration::from_secs(40);

/// Six process workers; `extra` is more of the group's TOML.
fn six(run: &str, extra: &str) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"worker\"\ncount = 6\nprovider = \"process\"\nlost_grace_s = 2.0\n{extra}\n"
    )
}

fn ready(s: &ClusterSnapshot) -> usize {
    s.nodes.iter().filter(|n| n.ready).count()
}

fn attempts(s: &ClusterSnapshot) -> BTreeMap<String, u64> {
    s.nodes
        .iter()
        .map(|n| (n.node.to_string(), n.attempt.0))
        .collect()
}

fn holds(s: &ClusterSnapshot) -> Vec<String> {
    s.holds.iter().map(|h| h.reason.clone()).collect()
}

fn apply(state: &Path, shape: &Path) -> String {
    let o = cli(state, &["apply", shape.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// Samples `status --json` until `done` holds; returns the fewest ready
/// nodes seen, how many samples showed a node not ready, and the last status.
fn sample_until(
    state: &Path,
    timeout: Duration,
    mut done: impl FnMut(&ClusterSnapshot) -> bool,
) -> (usize, usize, ClusterSnapshot) {
    let start = Instant::now();
    let mut fewest = usize::MAX;
    let mut busy = 0;
    loop {
        let s = status(state).expect("a status");
        fewest = fewest.min(ready(&s));
        busy += usize::from(ready(&s) < 6);
        if done(&s) {
            return (fewest, busy, s);
        }
        assert!(
            start.elapsed() < timeout,
            "not done within {timeout:?}: {s:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_six_node_group_rolled_to_a_new_template_never_has_fewer_than_five_ready() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let v1 = shape_file(
        tmp.path(),
        "v1.toml",
        &six("roll", "boot_check = [\"true\"]"),
    );
    let v2 = shape_file(
        tmp.path(),
        "v2.toml",
        &six("roll", "boot_check = [\"true\", \"v2\"]"),
    );
    let _d = Daemon::start(&state, &v1);
    let before = attempts(&wait_converged(&state, CONVERGE, |s| ready(s) == 6));
    let said = apply(&state, &v2);
    assert!(
        said.contains("group worker: ready nodes are replaced 1 at a time (max_unavailable)"),
        "{said}"
    );
    let (fewest, busy, last) = sample_until(&state, Duration::from_secs(60), |s| {
        s.converged && attempts(s).iter().all(|(n, a)| before[n] != *a)
    });
    eprintln!(
        "rolled 6 nodes in {:?}; fewest ready {fewest}, {busy} samples mid-roll",
        started.elapsed()
    );
    assert!(
        busy >= 2,
        "the roll was sampled while it ran ({busy} samples)"
    );
    assert_eq!(fewest, 5, "never fewer than 5 of 6 ready");
    assert!(last.holds.is_empty(), "{:?}", holds(&last));
}

#[test]
fn a_surge_rolls_six_nodes_without_ever_having_fewer_than_six_ready() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let budget = "max_unavailable = 0\nmax_surge = 1";
    let v1 = shape_file(
        tmp.path(),
        "v1.toml",
        &six("surge", &format!("boot_check = [\"true\"]\n{budget}")),
    );
    let v2 = shape_file(
        tmp.path(),
        "v2.toml",
        &six(
            "surge",
            &format!("boot_check = [\"true\", \"v2\"]\n{budget}"),
        ),
    );
    let _d = Daemon::start(&state, &v1);
    let before = attempts(&wait_converged(&state, CONVERGE, |s| ready(s) == 6));
    let said = apply(&state, &v2);
    assert!(
        said.contains("group worker: 1 surge node(s) (worker-6 and up) are added first"),
        "{said}"
    );
    let (mut fewest, mut most, mut surged) = (usize::MAX, 0, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    let last = loop {
        let s = status(&state).expect("a status");
        fewest = fewest.min(ready(&s));
        most = most.max(s.nodes.len());
        surged |= s.nodes.iter().any(|n| n.node.to_string() == "worker-6");
        let rolled = (0..6).all(|i| {
            let n = format!("worker-{i}");
            attempts(&s).get(&n).is_some_and(|a| before[&n] != *a)
        });
        if s.converged && rolled {
            break s;
        }
        assert!(Instant::now() < deadline, "not rolled within 60 s: {s:#?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "rolled 6 nodes with a surge in {:?}; fewest ready {fewest}, most nodes {most}",
        started.elapsed()
    );
    assert!(surged, "worker-6 was made as the surge node");
    assert_eq!(fewest, 6, "never fewer than 6 ready");
    assert_eq!(most, 7, "6 nodes and 1 surge node at most");
    assert_eq!(
        last.nodes.len(),
        6,
        "the surge node is gone: {:?}",
        attempts(&last)
    );
    assert!(last.holds.is_empty(), "{:?}", holds(&last));
}

/// Samples `status` after a restart until every node runs a new attempt and
/// the cluster converged; returns how many of the `old` nodes (still of the
/// old template at the restart) were taken down at once at most (a new
/// attempt not ready yet), the samples taken, and the last status.
fn roll_after_restart(
    state: &Path,
    before: &BTreeMap<String, u64>,
    old: &[String],
) -> (usize, usize, ClusterSnapshot) {
    let (mut most, mut samples) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = status(state) {
            samples += 1;
            // The ones already rolled re-attach, and are not counted.
            let starting = s
                .nodes
                .iter()
                .filter(|n| old.contains(&n.node.to_string()))
                .filter(|n| !n.ready && before[&n.node.to_string()] != n.attempt.0)
                .count();
            most = most.max(starting);
            let rolled = s
                .nodes
                .iter()
                .all(|n| before[&n.node.to_string()] != n.attempt.0);
            if s.converged && rolled && s.nodes.len() == 6 {
                return (most, samples, s);
            }
        }
        assert!(
            Instant::now() < deadline,
            "not rolled within 60 s after the restart"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_daemon_started_again_with_a_changed_template_rolls_its_nodes_one_at_a_time() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let v1 = shape_file(
        tmp.path(),
        "v1.toml",
        &six("again", "boot_check = [\"true\"]"),
    );
    let v2 = shape_file(
        tmp.path(),
        "v2.toml",
        &six("again", "boot_check = [\"sleep\", \"0.5\"]"),
    );
    let mut d = Daemon::start(&state, &v1);
    let before = attempts(&wait_converged(&state, CONVERGE, |s| ready(s) == 6));
    d.kill9();
    // `swactor up v2.toml` over the journal: the nodes it finds run v1,
    // which the journal names; they are kept and rolled like an apply.
    let _d = Daemon::spawn(&state, Some(&v2)).expect("the daemon restarts");
    let old: Vec<String> = before.keys().cloned().collect();
    let (most, samples, last) = roll_after_restart(&state, &before, &old);
    eprintln!(
        "rolled 6 nodes after `up v2.toml` in {:?} ({samples} samples, at most {most} replaced at once)",
        started.elapsed()
    );
    assert_eq!(most, 1, "one node replaced at a time");
    assert!(last.holds.is_empty(), "{:?}", holds(&last));
}

#[test]
fn a_daemon_killed_mid_rollout_rolls_the_rest_one_at_a_time_after_its_restart() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let v1 = shape_file(
        tmp.path(),
        "v1.toml",
        &six("resume", "boot_check = [\"true\"]"),
    );
    // Each replacement takes a second, so the kill lands mid-roll.
    let v2 = shape_file(
        tmp.path(),
        "v2.toml",
        &six("resume", "boot_check = [\"sleep\", \"1\"]"),
    );
    let mut d = Daemon::start(&state, &v1);
    let before = attempts(&wait_converged(&state, CONVERGE, |s| ready(s) == 6));
    let _ = apply(&state, &v2);
    let (_, _, s) = sample_until(&state, Duration::from_secs(30), |s| {
        s.nodes
            .iter()
            .any(|n| n.ready && before[&n.node.to_string()] != n.attempt.0)
    });
    d.kill9();
    let old: Vec<String> = attempts(&s)
        .into_iter()
        .filter(|(n, a)| before[n] == *a)
        .map(|(n, _)| n)
        .collect();
    assert!(
        old.len() >= 3,
        "killed early in the roll: {:?}",
        attempts(&s)
    );
    // The restarted daemon adopts the old nodes as they are and rolls them
    // within max_unavailable = 1: never two new attempts starting at once.
    let _d = Daemon::spawn(&state, None).expect("the daemon restarts");
    let (most, samples, last) = roll_after_restart(&state, &before, &old);
    eprintln!(
        "killed with {} old node(s) left; rolled after the restart in {:?} ({samples} samples, at most {most} starting at once)",
        old.len(),
        started.elapsed()
    );
    assert_eq!(most, 1, "one old node replaced at a time after the restart");
    assert!(last.holds.is_empty(), "{:?}", holds(&last));
}

#[test]
fn a_template_whose_boot_check_fails_stops_after_the_first_replacement() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let v1 = shape_file(
        tmp.path(),
        "v1.toml",
        &six("stop", "boot_check = [\"true\"]"),
    );
    let broken = shape_file(
        tmp.path(),
        "broken.toml",
        &six("stop", "boot_check = [\"false\"]"),
    );
    let fixed = shape_file(
        tmp.path(),
        "fixed.toml",
        &six("stop", "boot_check = [\"true\", \"fixed\"]"),
    );
    let _d = Daemon::start(&state, &v1);
    let before = attempts(&wait_converged(&state, CONVERGE, |s| ready(s) == 6));
    let _ = apply(&state, &broken);
    let stopped = "rollout stopped: node worker-0 failed with the new template";
    let (fewest, _, s) = sample_until(&state, Duration::from_secs(30), |s| {
        holds(s).iter().any(|h| h.starts_with(stopped))
    });
    assert_eq!(fewest, 5);
    eprintln!("stopped after {:?}: {:?}", started.elapsed(), holds(&s));
    // It stays stopped: worker-0 retries, the other five are left alone.
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(4) {
        let s = status(&state).expect("a status");
        assert_eq!(ready(&s), 5, "{s:#?}");
        let now = attempts(&s);
        for i in 1..6 {
            let n = format!("worker-{i}");
            assert_eq!(now[&n], before[&n], "{n} was not touched");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = cli(&state, &["status"]);
    let text = stdout(&o);
    assert!(
        text.contains(&format!("group worker: {stopped}")),
        "status says why: {text}"
    );
    // A fixed template resumes the rollout.
    let _ = apply(&state, &fixed);
    let (fewest, _, last) = sample_until(&state, Duration::from_secs(60), |s| {
        s.converged && attempts(s).iter().all(|(n, a)| before[n] != *a)
    });
    assert!(fewest >= 4, "worker-0 and one more at most: {fewest}");
    assert!(last.holds.is_empty(), "{:?}", holds(&last));
    eprintln!("fixed and rolled after {:?}", started.elapsed());
}

#[test]
fn freezing_four_of_six_agents_trips_the_breaker_until_they_recover_or_the_limit_is_raised() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let limited = shape_file(tmp.path(), "two.toml", &six("brk", "max_unhealthy = 2"));
    let raised = shape_file(tmp.path(), "four.toml", &six("brk", "max_unhealthy = 4"));
    let _d = Daemon::start(&state, &limited);
    let s = wait_converged(&state, CONVERGE, |s| ready(s) == 6);
    let before = attempts(&s);
    let pids: Vec<u32> = agents(&state)
        .into_iter()
        .filter(|((node, attempt), _)| before.get(node) == Some(attempt))
        .take(4)
        .flat_map(|(_, pids)| pids)
        .collect();
    assert_eq!(pids.len(), 4, "{pids:?}");

    // A partition, as far as the daemon can tell: four agents go silent.
    for pid in &pids {
        signal(*pid, "-STOP");
    }
    let tripped = "remediation paused: 4 of 6 unhealthy > max 2";
    sample_until(&state, Duration::from_secs(10), |s| {
        holds(s).iter().any(|h| h == tripped)
    });
    // Well past their 2 s grace, nothing is replaced or failed.
    std::thread::sleep(Duration::from_secs(4));
    let s = status(&state).expect("a status");
    assert_eq!(attempts(&s), before, "nothing was replaced");
    assert!(s.nodes.iter().all(|n| n.failures == 0), "{s:#?}");
    // /metrics says the same.
    let (addr, token) = web(&state);
    let (code, metrics) = get(addr, &token, "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert!(
        metrics.contains(r#"swactor_group_held{group="worker",kind="remediation"} 1"#),
        "{metrics}"
    );
    let text = stdout(&cli(&state, &["status"]));
    assert!(
        text.contains(&format!("group worker: {tripped}")),
        "status says why: {text}"
    );

    // They recover: the breaker resets and nothing was replaced.
    for pid in &pids {
        signal(*pid, "-CONT");
    }
    let s = wait_converged(&state, CONVERGE, |s| s.holds.is_empty() && ready(s) == 6);
    assert_eq!(attempts(&s), before, "the same agents came back");
    eprintln!("recovered after {:?}", started.elapsed());

    // Frozen again, and this time the operator raises the limit: the held
    // nodes are replaced at once.
    for pid in &pids {
        signal(*pid, "-STOP");
    }
    sample_until(&state, Duration::from_secs(10), |s| {
        holds(s).iter().any(|h| h == tripped)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(attempts(&status(&state).unwrap()), before, "still held");
    let _ = apply(&state, &raised);
    let s = wait_converged(&state, CONVERGE, |s| {
        s.holds.is_empty()
            && ready(s) == 6
            && attempts(s)
                .iter()
                .filter(|(n, a)| before[*n] != **a)
                .count()
                == 4
    });
    eprintln!(
        "replaced after the limit was raised, {:?} in all: {:?}",
        started.elapsed(),
        attempts(&s)
    );
    for pid in &pids {
        // Replaced agents are killed with their attempts; a stopped one may
        // linger until it is continued.
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[test]
fn a_restarted_daemon_says_its_breaker_holds_in_its_own_words_and_not_again_as_raw_warnings() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "six.toml", &six("quiet", "max_unhealthy = 1"));
    let mut first = Daemon::start(&state, &shape);
    wait_converged(&state, CONVERGE, |s| ready(s) == 6);
    first.kill9();
    // Until its six agents are back, the new daemon counts them unhealthy:
    // past max_unhealthy, its breaker holds the group.
    let second = Daemon::spawn(&state, None).expect("a resumed daemon");
    wait_converged(&state, CONVERGE, |s| s.holds.is_empty() && ready(s) == 6);
    let log = second.last_log();
    assert!(
        log.lines()
            .any(|l| l.starts_with("group worker: remediation paused: ")),
        "the hold is said: {log}"
    );
    let raw: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("WARN swactor_actors")
                || (l.contains("remediation paused") && !l.starts_with("group worker: "))
        })
        .collect();
    assert!(raw.is_empty(), "said again raw: {raw:#?}\n{log}");
}
