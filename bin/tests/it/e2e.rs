//! The real binary, real agent processes, real iroh connections on loopback.

use crate::common;

use common::*;
use std::time::{Duration, Instant};

const CONVERGE: Duration = Duration::from_secs(60);

#[test]
fn up_until_converged_converges_a_four_node_shape_and_tears_it_down() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "four.toml", &workers("e2e-until", 4));
    let o = std::process::Command::new(BIN)
        .args(["up", "--until-converged", "--timeout", "60"])
        .arg(&shape)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("converged on generation 1"), "{err}");
    assert!(err.contains("destroyed 4 node(s)"), "{err}");
    assert!(
        agents(&state).is_empty(),
        "agents left: {:?}",
        agents(&state)
    );
    assert!(
        node_dirs(&state).is_empty(),
        "node dirs left: {:?}",
        node_dirs(&state)
    );
}

#[test]
fn up_until_converged_hears_a_down_and_a_signal_before_it_converges() {
    let tmp = tempfile::tempdir().unwrap();
    // One group that never becomes ready: the run never converges.
    let body = format!(
        "{}[[group]]\nid = \"broken\"\ncount = 1\nprovider = \"process\"\nboot_check = [\"false\"]\n",
        workers("e2e-until-down", 2)
    );
    let shape = shape_file(tmp.path(), "never.toml", &body);
    for stop in ["down", "SIGINT"] {
        let state = tmp.path().join(format!("state-{stop}"));
        let mut up = std::process::Command::new(BIN)
            .args(["up", "--until-converged", "--timeout", "300", "--yes"])
            .arg(&shape)
            .arg("--state-dir")
            .arg(&state)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(CONVERGE, "two ready workers", || {
            status(&state).is_some_and(|s| s.nodes.iter().filter(|n| n.ready).count() == 2)
        });
        let asked = Instant::now();
        if stop == "down" {
            let o = cli(&state, &["down"]);
            assert!(o.status.success(), "{}", stderr(&o));
        } else {
            let sent = std::process::Command::new("kill")
                .args(["-INT", &up.id().to_string()])
                .status()
                .unwrap();
            assert!(sent.success());
        }
        let code = loop {
            if let Some(s) = up.try_wait().unwrap() {
                break s.code();
            }
            assert!(
                asked.elapsed() < Duration::from_secs(30),
                "{stop}: `up --until-converged` did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(up.stderr.as_mut().unwrap(), &mut err).unwrap();
        let want = if stop == "down" { 0 } else { 130 };
        assert_eq!(code, Some(want), "{stop}: {err}");
        assert!(err.contains("tearing down"), "{stop}: {err}");
        assert!(
            agents(&state).is_empty(),
            "{stop}: agents left: {:?}",
            agents(&state)
        );
    }
}

#[test]
fn a_killed_agent_is_replaced_scale_down_removes_the_highest_and_down_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let four = shape_file(tmp.path(), "four.toml", &workers("e2e-heal", 4));
    let mut d = Daemon::start(&state, &four);
    let snap = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 4);
    let before = snap
        .nodes
        .iter()
        .find(|n| n.node.to_string() == "worker-1")
        .unwrap()
        .attempt;
    let live = agents(&state);
    assert_eq!(live.len(), 4, "{live:?}");
    let victim = live[&("worker-1".to_owned(), before.0)][0];
    kill9(victim);
    let healed = wait_converged(&state, CONVERGE, |s| {
        s.nodes
            .iter()
            .any(|n| n.node.to_string() == "worker-1" && n.attempt != before)
    });
    let after = healed
        .nodes
        .iter()
        .find(|n| n.node.to_string() == "worker-1")
        .unwrap()
        .attempt;
    assert!(after > before, "a new attempt: {before} -> {after}");
    assert!(!agents(&state).contains_key(&("worker-1".to_owned(), before.0)));

    let two = shape_file(tmp.path(), "two.toml", &workers("e2e-heal", 2));
    let o = cli(&state, &["apply", two.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let scaled = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let names: Vec<String> = scaled.nodes.iter().map(|n| n.node.to_string()).collect();
    assert_eq!(names, ["worker-0", "worker-1"]);
    wait_for(Duration::from_secs(20), "two agents", || {
        agents(&state).len() == 2
    });

    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("destroyed 2 node(s)"), "{}", stdout(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(30)), Some(0), "{}", d.log());
    assert!(
        agents(&state).is_empty(),
        "agents left: {:?}",
        agents(&state)
    );
    assert!(
        node_dirs(&state).is_empty(),
        "node dirs left: {:?}",
        node_dirs(&state)
    );
}

#[test]
fn a_daemon_killed_with_sigkill_and_restarted_adopts_its_agents_without_duplicates() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let three = shape_file(tmp.path(), "three.toml", &workers("e2e-adopt", 3));
    let mut d = Daemon::start(&state, &three);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 3);
    let before = agents(&state);
    assert_eq!(before.len(), 3);
    d.kill9();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(agents(&state), before, "agents outlive their daemon");

    let d2 = Daemon::start(&state, &three);
    let snap = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 3);
    // Let any wrongly started duplicate show up before counting.
    std::thread::sleep(Duration::from_secs(2));
    let after = agents(&state);
    assert_eq!(
        after, before,
        "the same agents, adopted; nothing new started"
    );
    for n in &snap.nodes {
        assert!(
            before.contains_key(&(n.node.to_string(), n.attempt.0)),
            "{} {}",
            n.node,
            n.attempt
        );
    }
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    drop(d2);
    assert!(agents(&state).is_empty());
    assert!(node_dirs(&state).is_empty());
}

#[test]
fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");

    // A daemon that is not running, then a state directory that does not exist.
    let missing = tmp.path().join("nowhere");
    let o = cli(&missing, &["status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("there is no state directory"),
        "{}",
        stderr(&o)
    );
    std::fs::create_dir(&state).unwrap();
    let o = cli(&state, &["status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no daemon is running"),
        "{}",
        stderr(&o)
    );

    // Bad shapes refused by `up` before anything starts.
    let bad_toml = shape_file(
        tmp.path(),
        "bad.toml",
        "[[group]]\nid = \"worker\"\ncount = three\n",
    );
    let o = cli(&state, &["up", bad_toml.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("bad.toml:3:9"), "{}", stderr(&o));
    let unknown = shape_file(
        tmp.path(),
        "aws.toml",
        "run = \"e2e-bad\"\n[[group]]\nid = \"gpu\"\ncount = 1\nprovider = \"aws\"\n",
    );
    let o = cli(&state, &["up", unknown.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("provider \"aws\""), "{}", stderr(&o));
    let invalid = shape_file(
        tmp.path(),
        "invalid.toml",
        "run = \"e2e-bad\"\n[[group]]\nid = \"Bad_Id\"\ncount = 1\nprovider = \"process\"\n",
    );
    let o = cli(&state, &["up", invalid.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("the id \"Bad_Id\" of the 1st [[group]]"),
        "{}",
        stderr(&o)
    );
    assert!(!state.join("daemon.ticket").exists(), "nothing was started");

    // Through `apply` on a running daemon.
    let two = shape_file(tmp.path(), "two.toml", &workers("e2e-bad", 2));
    let _d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let three_g5 = shape_file(
        tmp.path(),
        "g5.toml",
        &format!("generation = 5\n{}", workers("e2e-bad", 3)),
    );
    assert!(
        cli(&state, &["apply", three_g5.to_str().unwrap(), "--yes"])
            .status
            .success()
    );
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 3);
    let before = status(&state).unwrap();
    let regress = shape_file(
        tmp.path(),
        "g4.toml",
        &format!("generation = 4\n{}", workers("e2e-bad", 1)),
    );
    let other_run = shape_file(tmp.path(), "other.toml", &workers("another-run", 1));
    for (file, needle) in [
        (&regress, "older than the current generation"),
        (&other_run, "this daemon manages run"),
        (&bad_toml, "bad.toml:3:9"),
        (&unknown, "provider \"aws\""),
        (&invalid, "the id \"Bad_Id\" of the 1st [[group]]"),
    ] {
        let o = cli(&state, &["apply", file.to_str().unwrap(), "--yes"]);
        assert_eq!(o.status.code(), Some(1), "{}", file.display());
        assert!(
            stderr(&o).contains(needle),
            "{}: {}",
            file.display(),
            stderr(&o)
        );
        let now = status(&state).unwrap();
        assert_eq!(
            (now.generation, now.nodes.len()),
            (before.generation, before.nodes.len())
        );
    }
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn plan_shows_the_next_actions_as_a_diff_without_applying_them() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("e2e-plan", 2));
    let _d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let three = shape_file(tmp.path(), "three.toml", &workers("e2e-plan", 3));
    let o = cli(&state, &["plan", three.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("create   worker-2"), "{}", stdout(&o));
    let one = shape_file(tmp.path(), "one.toml", &workers("e2e-plan", 1));
    let o = cli(&state, &["plan", one.to_str().unwrap()]);
    assert!(stdout(&o).contains("destroy  worker-1"), "{}", stdout(&o));
    assert_eq!(
        status(&state).unwrap().nodes.len(),
        2,
        "plan applies nothing"
    );
    assert!(cli(&state, &["down"]).status.success());
}

#[test]
fn a_hundred_local_nodes_converge() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    // The default grace (5 s): with a hundred debug agents starting on two
    // cores, a ready agent is starved for over a second now and then, and
    // the 1 s grace of `workers` would replace it (this test is about
    // converging at this size, not about how fast silence is noticed).
    let shape = workers("e2e-100", 100).replace("lost_grace_s = 1.0\n", "");
    assert!(!shape.contains("lost_grace_s"));
    let hundred = shape_file(tmp.path(), "hundred.toml", &shape);
    let start = Instant::now();
    let o = std::process::Command::new(BIN)
        .args(["up", "--until-converged", "--timeout", "120", "--yes"])
        .arg(&hundred)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    let took = start.elapsed();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A figure for the closing note, not an assertion: timing depends on the machine.
    let line = stderr(&o)
        .lines()
        .find(|l| l.contains("converged on generation"))
        .unwrap_or_default()
        .to_owned();
    eprintln!("100 local nodes: {line}; whole run with teardown {took:?}");
    assert!(agents(&state).is_empty());
    assert!(node_dirs(&state).is_empty());
}

#[test]
fn ctrl_c_tears_everything_down_and_says_what_was_destroyed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("e2e-sigint", 2));
    let mut d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let pid = d.child.as_ref().unwrap().id();
    let ok = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    assert_eq!(d.wait_exit(Duration::from_secs(30)), Some(0), "{}", d.log());
    assert!(d.log().contains("destroyed 2 node(s)"), "{}", d.log());
    assert!(agents(&state).is_empty());
    assert!(node_dirs(&state).is_empty());
    assert!(
        !state.join("daemon.ticket").exists(),
        "the ticket is withdrawn"
    );
}

#[test]
fn watch_follows_the_daemons_telemetry() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let one = shape_file(tmp.path(), "one.toml", &workers("e2e-watch", 1));
    let _d = Daemon::start(&state, &one);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);
    let watch = std::process::Command::new(BIN)
        .arg("watch")
        .arg("--state-dir")
        .arg(&state)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let two = shape_file(tmp.path(), "two.toml", &workers("e2e-watch", 2));
    assert!(
        cli(&state, &["apply", two.to_str().unwrap()])
            .status
            .success()
    );
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    assert!(cli(&state, &["down"]).status.success());
    // The daemon ends the stream when it stops, so watch exits by itself.
    let out = watch.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("run e2e-watch"),
        "starts with a snapshot: {text}"
    );
    assert!(text.contains("shape accepted: generation 2"), "{text}");
    assert!(text.contains("worker-1"), "{text}");
    assert!(text.contains("converged: generation 2"), "{text}");
}
