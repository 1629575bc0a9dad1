//! The CLI as a user meets it: guard rails before a change, plans people can
//! read, one vocabulary, `describe`, `validate`, and output that tells the
//! truth (exit codes, closed pipes, a daemon that died, long ids).
//!
//! Real daemons and agents, as in e2e.rs; a pseudo-terminal comes from
//! util-linux's `script`.

use crate::common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const CONVERGE: Duration = Duration::from_secs(60);

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run swactor")
}

/// Runs `swactor ARGS --state-dir STATE` on a pseudo-terminal (through
/// `script`), typing `answer` into it.
fn on_a_terminal(state: &Path, args: &[&str], answer: &str) -> Output {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut line = quote(BIN);
    for a in args
        .iter()
        .copied()
        .chain(["--state-dir", state.to_str().unwrap()])
    {
        line.push(' ');
        line.push_str(&quote(a));
    }
    let mut child = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("util-linux `script` gives these tests a terminal; install it");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(answer.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn generation_and_nodes(state: &Path) -> (u64, Vec<(String, u64)>) {
    let s = status(state).expect("status answers");
    (
        s.generation.0,
        s.nodes
            .iter()
            .map(|n| (n.node.to_string(), n.attempt.0))
            .collect(),
    )
}

fn text(o: &Output) -> String {
    format!("stdout: {}\nstderr: {}", stdout(o), stderr(o))
}

#[test]
fn a_shape_past_its_capacity_is_refused_with_its_numbers_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let body = |count: u32, capacity: u32| {
        format!(
            "run = \"cli-cap\"\ncapacity = {capacity}\n[[group]]\nid = \"worker\"\ncount = {count}\nprovider = \"process\"\nboot_check = [\"true\"]\n"
        )
    };
    let big = shape_file(tmp.path(), "big.toml", &body(100_000, 50));

    // `up` on a fresh directory: refused before anything exists.
    let o = cli(&state, &["up", big.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("100000 nodes") && stderr(&o).contains("`capacity` of 50"),
        "{}",
        text(&o)
    );
    assert!(!state.exists(), "nothing was made: {:?}", node_dirs(&state));

    // Past what the provider can hold (this machine's memory, for local
    // processes): the daemon refuses it once it knows, and stops.
    let huge = shape_file(
        tmp.path(),
        "huge.toml",
        &workers("cli-cap", 100_000).replace("lost_grace_s = 1.0\n", ""),
    );
    let elsewhere = tmp.path().join("elsewhere");
    let o = cli(&elsewhere, &["up", huge.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("asks for 100000 nodes, but this machine's")
            && stderr(&o).contains("allows at most"),
        "{}",
        text(&o)
    );
    assert!(
        node_dirs(&elsewhere).is_empty(),
        "{:?}",
        node_dirs(&elsewhere)
    );
    assert!(!elsewhere.join("daemon.ticket").exists(), "it stopped");

    // `apply` to a running daemon: refused by the daemon, with the numbers.
    let one = shape_file(tmp.path(), "one.toml", &body(1, 50));
    let _d = Daemon::start(&state, &one);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);
    let before = generation_and_nodes(&state);
    let dirs = node_dirs(&state);
    for (file, extra, needle) in [
        (&big, &[][..], "`capacity` of 50"),
        (&big, &["--yes"][..], "`capacity` of 50"),
        (&huge, &["--yes"][..], "available memory"),
    ] {
        let mut args = vec!["apply", file.to_str().unwrap()];
        args.extend(extra);
        let o = cli(&state, &args);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let err = stderr(&o);
        assert!(
            err.contains("asks for 100000 nodes") && err.contains(needle),
            "{err}"
        );
        assert!(err.contains("nothing was changed"), "{err}");
        assert_eq!(generation_and_nodes(&state), before);
        assert_eq!(node_dirs(&state), dirs, "no node directory was made");
    }
    assert!(cli(&state, &["down"]).status.success());
}

#[test]
fn plan_sums_up_and_lists_a_bounded_number_of_changes_in_plain_words() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let one = shape_file(tmp.path(), "one.toml", &workers("cli-plan", 1));
    let _d = Daemon::start(&state, &one);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);

    // The current shape, converged: nothing to do.
    let o = cli(&state, &["plan", "--detailed-exitcode"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(stdout(&o).starts_with("plan: no changes"), "{}", text(&o));

    // A big shape that allows itself to be big.
    let big = shape_file(
        tmp.path(),
        "big.toml",
        &format!("capacity = 100000\n{}", workers("cli-plan", 100_000)),
    );
    let o = cli(&state, &["plan", big.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("plan: 99999 to create, 0 to replace, 0 to destroy, 1 unchanged"),
        "{out}"
    );
    assert!(
        lines.len() <= 25,
        "a bounded listing, not {} lines",
        lines.len()
    );
    assert_eq!(lines[1], "  create   worker-1");
    assert!(out.contains("… and 99979 more"), "{out}");
    for internal in ["row", "BeginDelete", "Insert", "dispatch"] {
        assert!(!out.contains(internal), "{internal:?} in {out}");
    }

    let o = cli(&state, &["plan", big.to_str().unwrap(), "--all"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let all = stdout(&o);
    assert_eq!(
        all.lines().count(),
        1 + 99_999,
        "a summary, then every change"
    );
    assert!(all.lines().last().unwrap().ends_with("worker-99999"));

    let o = cli(
        &state,
        &["plan", big.to_str().unwrap(), "--detailed-exitcode"],
    );
    assert_eq!(o.status.code(), Some(2), "changes present: {}", stderr(&o));
    let o = cli(
        &state,
        &["plan", "/nonexistent.toml", "--detailed-exitcode"],
    );
    assert_eq!(o.status.code(), Some(1), "an error is 1: {}", text(&o));
    let o = cli(&state, &["plan", "--detailed-exitcode", "--no-such-flag"]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "a usage error is 1 too: {}",
        text(&o)
    );

    // A replacement is a replacement, not a deletion.
    let other = shape_file(
        tmp.path(),
        "other.toml",
        &workers("cli-plan", 1).replace("[\"true\"]", "[\"/bin/true\"]"),
    );
    let o = cli(&state, &["plan", other.to_str().unwrap()]);
    assert!(
        stdout(&o).starts_with("plan: 0 to create, 1 to replace, 0 to destroy, 0 unchanged"),
        "{}",
        text(&o)
    );
    assert!(stdout(&o).contains("  replace  worker-0"), "{}", text(&o));
    assert_eq!(
        status(&state).unwrap().nodes.len(),
        1,
        "plan applies nothing"
    );

    // `status` speaks the same words, and a closed pipe ends it quietly.
    let o = cli(&state, &["status"]);
    let out = stdout(&o);
    for column in ["STATE", "FAILS", "RETRY", "LAST ERROR"] {
        assert!(out.contains(column), "{column}: {out}");
    }
    assert!(out.contains(" ready "), "{out}");
    assert!(!out.contains("Dormant"), "{out}");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(BIN)
        .args(["status", "--state-dir", state.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(
        matches!(o.status.code(), Some(0 | 141)),
        "status into a closed pipe: {:?}",
        o.status
    );
    assert_eq!(stderr(&o), "", "nothing said about a closed pipe");
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{BIN} plan {} --all --state-dir {} | head -1",
            big.display(),
            state.display()
        ))
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(
        stdout(&o).starts_with("plan: 99999 to create"),
        "{}",
        text(&o)
    );
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert!(cli(&state, &["down"]).status.success());
}

#[test]
fn empty_shapes_and_shapes_without_a_run_are_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let empty = shape_file(tmp.path(), "empty.toml", "run = \"cli-empty\"\n");
    let zero = shape_file(tmp.path(), "zero.toml", &workers("cli-empty", 0));
    let no_run = shape_file(
        tmp.path(),
        "no-run.toml",
        "[[group]]\nid = \"worker\"\ncount = 1\nprovider = \"process\"\n",
    );
    // Offline first: nothing is started.
    for (file, needle) in [
        (&empty, "`swactor down`"),
        (&zero, "`swactor down`"),
        (&no_run, "names no run"),
    ] {
        let file = file.to_str().unwrap();
        for args in [vec!["validate", file], vec!["up", file, "--yes"]] {
            let o = cli(&state, &args);
            assert_eq!(o.status.code(), Some(1), "{args:?} {}", text(&o));
            assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        }
    }
    assert!(!state.join("daemon.ticket").exists());

    let two = shape_file(tmp.path(), "two.toml", &workers("cli-empty", 2));
    let _d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let before = generation_and_nodes(&state);
    for file in [&empty, &zero, &no_run] {
        let file = file.to_str().unwrap();
        for args in [vec!["apply", file, "--yes"], vec!["plan", file]] {
            let o = cli(&state, &args);
            assert_eq!(o.status.code(), Some(1), "{args:?} {}", text(&o));
        }
        assert_eq!(generation_and_nodes(&state), before, "{file}");
    }
    let o = cli(&state, &["apply", zero.to_str().unwrap(), "--yes"]);
    assert!(stderr(&o).contains("use `swactor down`"), "{}", stderr(&o));
    assert!(cli(&state, &["down"]).status.success());
}

#[test]
fn a_change_that_destroys_or_replaces_asks_first_and_a_refusal_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("cli-ask", 2));
    let one = shape_file(tmp.path(), "one.toml", &workers("cli-ask", 1));
    let mut d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let watch = Command::new(BIN)
        .args(["watch", "--state-dir", state.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let before = generation_and_nodes(&state);

    // No terminal, no --yes: refused, naming --yes.
    let o = cli(&state, &["apply", one.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stdout(&o).starts_with("plan: 0 to create, 0 to replace, 1 to destroy, 1 unchanged"),
        "the plan comes first: {}",
        text(&o)
    );
    assert!(stdout(&o).contains("destroy  worker-1"), "{}", text(&o));
    assert!(stderr(&o).contains("pass --yes"), "{}", text(&o));
    assert_eq!(generation_and_nodes(&state), before);

    // On a terminal, answered no.
    let o = on_a_terminal(&state, &["apply", one.to_str().unwrap()], "n\n");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(stdout(&o).contains("Go ahead? [y/N]"), "{}", text(&o));
    assert!(stdout(&o).contains("nothing was changed"), "{}", text(&o));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(generation_and_nodes(&state), before);

    // Answered yes.
    let o = on_a_terminal(&state, &["apply", one.to_str().unwrap()], "y\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(stdout(&o).contains("applied: generation 2"), "{}", text(&o));
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);

    // Growing by a few nodes needs no question; --yes skips one.
    let o = cli(&state, &["apply", two.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let o = cli(&state, &["apply", one.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", text(&o));
    let kept = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);

    // `up SHAPE` on a journal: the plan is worked out before anything
    // starts, and a replacement without a terminal is refused.
    let o = cli(&state, &["down", "--keep"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(30)), Some(0));
    // The daemon stopped cleanly, so `watch` ends cleanly, every line timestamped.
    let w = watch.wait_with_output().unwrap();
    assert_eq!(w.status.code(), Some(0), "{}", text(&w));
    check_watch_lines(&stdout(&w));
    let agents_before = agents(&state);
    let other = shape_file(
        tmp.path(),
        "other.toml",
        &workers("cli-ask", 1).replace("[\"true\"]", "[\"/bin/true\"]"),
    );
    let started = Instant::now();
    let o = cli(&state, &["up", other.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("plan: 0 to create, 1 to replace, 0 to destroy, 0 unchanged"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("pass --yes"), "{}", stderr(&o));
    assert!(!state.join("daemon.ticket").exists(), "nothing started");
    assert_eq!(agents(&state), agents_before, "no agent touched");
    eprintln!("refused `up` in {:?}", started.elapsed());
    let mut d = Daemon::spawn(&state, None).unwrap();
    let after = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);
    assert_eq!(
        after.nodes[0].attempt, kept.nodes[0].attempt,
        "adopted, not replaced"
    );
    assert!(cli(&state, &["down"]).status.success());
    d.wait_exit(Duration::from_secs(30));
}

/// Every line starts with a wall-clock time, and no line repeats the one before.
fn check_watch_lines(out: &str) {
    assert!(out.lines().count() >= 2, "{out}");
    let mut last = "";
    for line in out.lines() {
        let b = line.as_bytes();
        let stamped = b.len() > 9
            && b[..8].iter().enumerate().all(|(i, c)| {
                if i % 3 == 2 {
                    *c == b':'
                } else {
                    c.is_ascii_digit()
                }
            })
            && b[8] == b' ';
        assert!(stamped, "no timestamp: {line:?} in\n{out}");
        let rest = &line[9..];
        assert_ne!(rest, last, "a repeated line in\n{out}");
        last = rest;
    }
}

#[test]
fn watch_exits_non_zero_when_its_daemon_is_killed_and_a_dead_daemon_is_reported_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let one = shape_file(tmp.path(), "one.toml", &workers("cli-kill", 1));
    let mut d = Daemon::start(&state, &one);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);
    let mut watch = Command::new(BIN)
        .args(["watch", "--state-dir", state.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let two = shape_file(tmp.path(), "two.toml", &workers("cli-kill", 2));
    assert!(
        cli(&state, &["apply", two.to_str().unwrap()])
            .status
            .success()
    );
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    // Killed without a word: its ticket stays behind, stale.
    kill9(d.pid().unwrap());
    let killed = Instant::now();
    let code = loop {
        if let Some(status) = watch.try_wait().unwrap() {
            break status.code();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "watch is still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let w = watch.wait_with_output().unwrap();
    eprintln!("watch ended {:?} after the kill", killed.elapsed());
    assert_eq!(code, Some(1), "{}", text(&w));
    assert!(stderr(&w).contains("broke off"), "{}", stderr(&w));
    let out = stdout(&w);
    check_watch_lines(&out);
    assert!(out.contains("shape accepted: generation 2"), "{out}");

    assert!(
        state.join("daemon.ticket").exists(),
        "the stale ticket stays"
    );
    let started = Instant::now();
    let o = cli(&state, &["status"]);
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("no daemon is running"),
        "{}",
        stderr(&o)
    );
    assert!(took < Duration::from_secs(2), "reported in {took:?}");
    d.kill9();
}

#[test]
fn describe_shows_each_attempt_and_why_it_failed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let body = "run = \"cli-describe\"\n[[group]]\nid = \"good\"\ncount = 1\nprovider = \"process\"\n\
                [[group]]\nid = \"bad\"\ncount = 1\nprovider = \"process\"\nboot_check = [\"false\"]\n";
    let shape = shape_file(tmp.path(), "shape.toml", body);
    let _d = Daemon::start(&state, &shape);
    // Two attempts in the history, the first of them failed.
    let attempt_rows = |out: &str| -> Vec<String> {
        out.lines()
            .skip_while(|l| !l.starts_with("attempts, oldest first:"))
            .skip(2)
            .take_while(|l| l.starts_with("  "))
            .map(str::to_owned)
            .collect()
    };
    let mut last = String::new();
    let deadline = Instant::now() + CONVERGE;
    while Instant::now() < deadline {
        let o = cli(&state, &["describe", "bad-0"]);
        last = stdout(&o);
        if o.status.success() && attempt_rows(&last).len() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let rows = attempt_rows(&last);
    assert!(rows.len() >= 2, "{last}");
    assert!(
        rows[0].contains("failed") && rows[0].contains("boot check `false`"),
        "the first attempt and why it failed: {last}"
    );
    assert!(rows[0].contains(" ago"), "relative times: {last}");
    assert!(
        last.lines()
            .any(|l| l.starts_with("  desired") && l.contains("yes")),
        "{last}"
    );
    assert!(!last.contains("t+"), "no daemon uptime: {last}");

    // Status and plan speak of the failure in the same words.
    let o = cli(&state, &["status"]);
    assert!(stdout(&o).contains("bad-0"), "{}", text(&o));
    let row = stdout(&o)
        .lines()
        .find(|l| l.contains("bad-0"))
        .unwrap()
        .to_owned();
    assert!(
        ["failed", "creating", "booting", "restarting"]
            .iter()
            .any(|w| row.contains(w)),
        "{row}"
    );
    let o = cli(&state, &["plan", "--detailed-exitcode"]);
    assert_eq!(o.status.code(), Some(2), "work under way: {}", text(&o));
    assert!(!stdout(&o).contains("no changes"), "{}", text(&o));
    assert!(stdout(&o).contains("bad-0"), "{}", text(&o));

    let o = cli(&state, &["describe", "nosuch-3"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("has no node nosuch-3"),
        "{}",
        stderr(&o)
    );
    let long = "a".repeat(5_000);
    for (id, len) in [(long.clone(), 5_000), (format!("{long}-1"), 5_002)] {
        let o = cli(&state, &["describe", &id]);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(&format!("… ({len} characters)")), "{err}");
        assert!(err.len() < 300, "cut: {} bytes", err.len());
    }
    let long_run = shape_file(tmp.path(), "long.toml", &workers(&long, 1));
    let o = cli(&state, &["apply", long_run.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).len() < 400, "cut: {}", stderr(&o));
    assert!(cli(&state, &["down"]).status.success());
}

#[test]
fn the_cli_checks_its_input_offline() {
    let tmp = tempfile::tempdir().unwrap();
    // Help: an example everywhere, the agent nowhere.
    let top = run(&["--help"]);
    assert!(top.status.success());
    assert!(stdout(&top).contains("Examples:"), "{}", stdout(&top));
    assert!(
        !stdout(&top)
            .lines()
            .any(|l| l.trim_start().starts_with("agent ")),
        "the agent subcommand is hidden: {}",
        stdout(&top)
    );
    for cmd in [
        "up", "apply", "plan", "validate", "status", "describe", "watch", "logs", "pause",
        "resume", "down", "run", "jobs", "job",
    ] {
        let o = run(&[cmd, "--help"]);
        assert!(o.status.success(), "{cmd}");
        assert!(stdout(&o).contains("Example"), "{cmd}: {}", stdout(&o));
    }

    // --timeout only means something with --until-converged.
    let shape = shape_file(tmp.path(), "one.toml", &workers("cli-offline", 1));
    let o = run(&["up", shape.to_str().unwrap(), "--timeout", "5"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(stderr(&o).contains("--until-converged"), "{}", stderr(&o));

    // An empty $SWACTOR_STATE_DIR is no state directory name.
    let o = Command::new(BIN)
        .arg("status")
        .env("SWACTOR_STATE_DIR", "")
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("there is no state directory at .swactor"),
        "{}",
        stderr(&o)
    );

    // validate: what a good shape creates, why a bad one is refused.
    let local = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/local.toml");
    let o = run(&["validate", local]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        stdout(&o).contains("4 nodes in 2 group(s)"),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains("creates 4 nodes"), "{}", stdout(&o));
    for (body, needle) in [
        (
            "run = \"x\"\n[[group]]\nid = \"gpu\"\ncount = 1\nprovider = \"aws\"\n",
            "provider \"aws\"",
        ),
        (
            "run = \"x\"\n[[group]]\nid = \"gpu\"\ncount = 1\nprovider = \"vast\"\n",
            "`max_dph` (the most a machine may cost per hour, in dollars) is required",
        ),
        (
            "run = \"x\"\n[[group]]\nid = \"Bad\"\ncount = 1\nprovider = \"process\"\n",
            "the id \"Bad\" of the 1st [[group]]",
        ),
        (
            "run = \"x\"\ncapacity = 2\n[[group]]\nid = \"w\"\ncount = 3\nprovider = \"process\"\n",
            "`capacity` of 2",
        ),
        (
            "run = \"x\"\n[[group]]\nid = \"w\"\ncount = three\n",
            "bad.toml:4:9",
        ),
        (
            "run = \"x\"\ncapacity = 2\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"process\"\nmax_surge = 1\n",
            "the shape asks for 3 nodes (counting up to 1 surge node(s) of a rollout), more than its own `capacity` of 2",
        ),
        (
            "run = \"x\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"process\"\nmax_unavailable = \"150%\"\n",
            "group \"w\": max_unavailable must be a percentage from 0% to 100% (got 150%)",
        ),
        (
            "run = \"x\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"process\"\nmax_unhealthy = \"two\"\n",
            "neither a count nor a percentage",
        ),
    ] {
        let bad = shape_file(tmp.path(), "bad.toml", body);
        let o = run(&["validate", bad.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{body}");
        assert!(stderr(&o).contains(needle), "{body}: {}", stderr(&o));
    }
}

/// `swactor validate BODY` in `dir`: its exit code and what it said.
fn validate_body(dir: &Path, body: &str) -> (Option<i32>, String) {
    let file = shape_file(dir, "shape.toml", body);
    let o = run(&["validate", file.to_str().unwrap()]);
    (o.status.code(), text(&o))
}

#[test]
fn validation_messages_name_groups_and_keys_as_the_shape_file_writes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let group = |provider: &str, extra: &str| {
        format!(
            "run = \"x\"\n[[group]]\nid = \"worker\"\ncount = 1\nprovider = \"{provider}\"\n{extra}"
        )
    };
    for (body, want) in [
        (
            group("process", "lost_grace_s = -1\n"),
            "group \"worker\": lost_grace_s must be a number >= 0 (got -1)",
        ),
        (
            group("process", "").replace("count = 1", "count = \"lots\""),
            "shape.toml:4:9: group \"worker\": count must be a whole number, not \"lots\"",
        ),
        (
            group("docker", "image = \"a\"\n[group.params]\nimage = \"b\"\n"),
            "group \"worker\": `image` in [group.params] is \"b\" but the group's `image` is \"a\"",
        ),
        (
            group(
                "ssh",
                "hosts = [\"root@192.0.2.1\"]\n[group.params]\ntrust_on_first_use = \"lots\"\n",
            ),
            "`trust_on_first_use` must be true or false, not \"lots\"",
        ),
        (
            group("aws", ""),
            "group \"worker\": provider \"aws\" is not one this daemon can drive",
        ),
    ] {
        let (code, said) = validate_body(tmp.path(), &body);
        assert_eq!(code, Some(1), "{body}: {said}");
        assert!(said.contains(want), "{body}: {said}");
        for internal in [
            "groups[",
            "group[",
            "boot.image",
            "join.",
            "Str(",
            "expected u32",
        ] {
            assert!(!said.contains(internal), "{body}: {internal} in {said}");
        }
    }
}

#[test]
fn a_process_group_refuses_unknown_params_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, said) = validate_body(
        tmp.path(),
        &format!("{}[group.params]\ncpus = 2\n", workers("x", 1)),
    );
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(
            "group \"worker\": unknown parameter `cpus` (the process provider takes none)"
        ),
        "{said}"
    );
}

#[test]
fn validate_refuses_a_shape_past_this_machines_capacity_as_up_does() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, said) = validate_body(tmp.path(), &workers("x", 100_000));
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("the shape asks for 100000 nodes, but this machine's")
            && said.contains("allows at most")
            && said.contains("nothing was changed"),
        "{said}"
    );
    // Its own `capacity` lets it past the estimate, as it does for `up`.
    let (code, said) = validate_body(
        tmp.path(),
        &format!("capacity = 100000\n{}", workers("x", 100_000)),
    );
    assert_eq!(code, Some(0), "{said}");
}

#[test]
fn up_refuses_a_shape_past_this_machines_capacity_before_starting_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let huge = shape_file(tmp.path(), "huge.toml", &workers("cli-huge", 100_000));
    // A fresh state directory: not even made.
    let state = tmp.path().join("state");
    let o = cli(&state, &["up", huge.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("the shape asks for 100000 nodes, but this machine's"),
        "{err}"
    );
    assert!(!err.contains("dashboard at"), "no daemon started: {err}");
    assert!(!err.contains("daemon for run"), "no daemon started: {err}");
    assert!(!state.exists(), "nothing was made");

    // Next to a journal, refused as early: the stopped run stays as it was.
    let one = shape_file(tmp.path(), "one.toml", &workers("cli-huge", 1));
    let o = cli(
        &state,
        &["up", one.to_str().unwrap(), "--until-converged", "--keep"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let agents_before = agents(&state);
    let o = cli(&state, &["up", huge.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("allows at most") && !err.contains("dashboard at"),
        "{err}"
    );
    assert!(!state.join("daemon.ticket").exists());
    assert_eq!(agents(&state), agents_before, "its agent was left alone");
    kill_agents(&state);
}

#[test]
fn up_without_a_shape_on_a_fresh_state_directory_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let absent = tmp.path().join("absent");
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for state in [&absent, &empty] {
        let o = cli(state, &["up"]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(
            stderr(&o).contains("there is nothing to resume in"),
            "{}",
            text(&o)
        );
    }
    assert!(!absent.exists(), "not made");
    let left: Vec<_> = std::fs::read_dir(&empty).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The README's first command, without a terminal: four nodes are created
/// without a question.
#[test]
fn up_of_the_local_example_never_asks() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let local = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/local.toml");
    let o = cli(
        &state,
        &["up", local, "--until-converged", "--timeout", "60"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("plan: 4 to create, 0 to replace, 0 to destroy, 0 unchanged"),
        "{err}"
    );
    assert!(!err.contains("[y/N]"), "{err}");
    assert!(
        !err.contains('\x1b'),
        "no escape codes without a terminal: {err}"
    );
    assert!(agents(&state).is_empty());
}

/// Runs `swactor ARGS --state-dir STATE` with its stdout a pipe whose
/// reader is already gone, as `| head -1` leaves it once `head` is done.
fn into_a_closed_pipe(state: &Path, args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

#[test]
fn a_closed_stdout_changes_neither_what_apply_does_nor_its_exit_code() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let two = shape_file(tmp.path(), "two.toml", &workers("cli-pipe", 2));
    let one = shape_file(tmp.path(), "one.toml", &workers("cli-pipe", 1));
    let mut d = Daemon::start(&state, &two);
    wait_converged(&state, CONVERGE, |s| s.nodes.len() == 2);
    let before = generation_and_nodes(&state);

    // Refused (it destroys a node, no terminal, no --yes): 1, nothing applied.
    let o = into_a_closed_pipe(&state, &["apply", one.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("pass --yes"), "{}", stderr(&o));
    assert_eq!(generation_and_nodes(&state), before);

    // Applied: 0, and it was.
    let o = into_a_closed_pipe(&state, &["apply", one.to_str().unwrap(), "--yes"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    let after = wait_converged(&state, CONVERGE, |s| s.nodes.len() == 1);
    assert_eq!(after.generation.0, before.0 + 1);

    // Nor does it end a watch with an error, or change `status`'s answer.
    for args in [&["status"][..], &["status", "--json"], &["watch"]] {
        let o = into_a_closed_pipe(&state, args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "{args:?}: nothing said about a closed pipe");
    }

    // `down` takes --yes as `up` and `apply` do, and asks nothing either way.
    let o = cli(&state, &["down", "--yes"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(d.wait_exit(Duration::from_secs(30)), Some(0));
}

/// Issue 28, Why 6: `logs --attempt 99999` listed four attempts as "the
/// last 3". A slot keeps its current attempt's log and its last 3 ended
/// ones; the refusal says so.
#[test]
fn logs_of_an_attempt_not_kept_list_what_is_kept_in_true_words() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let kept = state.join("logs/r/worker-0");
    std::fs::create_dir_all(&kept).unwrap();
    for a in 1..=3 {
        std::fs::write(kept.join(format!("a{a}.log")), format!("log {a}\n")).unwrap();
    }
    let live = state.join("nodes/r/worker-0-a4");
    std::fs::create_dir_all(&live).unwrap();
    std::fs::write(live.join("agent.log"), "live\n").unwrap();
    std::fs::write(state.join("daemon.lock"), "").unwrap();
    let o = cli(&state, &["logs", "worker-0", "--attempt", "99999"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("there are: a1, a2, a3, a4 (a slot keeps the log of its current attempt and those of its last 3 ended ones)"),
        "{err}"
    );
}
