//! Issue 32: run lifetimes on the real daemon. `max_lifetime_s` tears a
//! run down on time, at the deadline the first daemon set even across a
//! `kill -9` and a restart, and later when an apply extends it;
//! `idle_teardown_s` waits for a running job, then for its window.

use crate::common;

use common::*;
use std::path::Path;
use std::time::{Duration, Instant};
use swactor_provisioning::lifetime::{Verdict, Which};

/// How late after its deadline a run may start its teardown: the daemon
/// checks every second, and a loaded CI machine is slow.
const LATE_MAX: Duration = Duration::from_secs(2);
/// How early: never, but a status read a little before the deadline and
/// rounded to the millisecond may be off by the time it took to answer.
const EARLY_MAX: Duration = Duration::from_millis(500);
/// How long a teardown of local nodes may take, once started.
const TEARDOWN_MAX: Duration = Duration::from_secs(15);
/// The words the daemon logs when a deadline comes.
const REACHED: &str = "reached; tearing the run down";

fn shape(dir: &Path, run: &str, top: &str, workers_n: u32) -> std::path::PathBuf {
    shape_file(
        dir,
        &format!("{run}.toml"),
        &format!("{top}\n{}", workers(run, workers_n)),
    )
}

/// The instant the run's deadline falls at, and whose it is, from its
/// status (`None` while there is none yet).
fn deadline(state: &Path) -> Option<(Instant, Which)> {
    let asked = Instant::now();
    let s = status(state)?;
    match s.lifetime?.verdict {
        Verdict::Within { left_ms, which } => Some((asked + Duration::from_millis(left_ms), which)),
        _ => None,
    }
}

fn wait_deadline(state: &Path) -> (Instant, Which) {
    let mut found = None;
    wait_for(Duration::from_secs(20), "a deadline in the status", || {
        found = deadline(state);
        found.is_some()
    });
    found.unwrap()
}

/// Waits for the daemon to say a deadline came; returns when it said so.
fn wait_reached(d: &Daemon, within: Duration) -> Instant {
    let start = Instant::now();
    loop {
        if d.last_log().contains(REACHED) {
            return Instant::now();
        }
        assert!(
            start.elapsed() < within,
            "no teardown within {within:?}: {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that `at` is on `deadline`, give or take what a check costs.
fn on_time(at: Instant, deadline: Instant, what: &str) {
    assert!(
        at + EARLY_MAX >= deadline,
        "{what}: torn down {:?} before its deadline",
        deadline - at
    );
    assert!(
        at <= deadline + LATE_MAX,
        "{what}: torn down {:?} after its deadline",
        at - deadline
    );
}

/// The daemon ends after the teardown, every agent gone, and the state
/// directory has no daemon left to ask.
fn torn_down(d: &mut Daemon, state: &Path) {
    assert_eq!(d.wait_exit(TEARDOWN_MAX), Some(0), "{}", d.log());
    assert!(agents(state).is_empty(), "agents left: {:?}", agents(state));
    assert!(node_dirs(state).is_empty(), "{:?}", node_dirs(state));
    let o = cli(state, &["status"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no daemon is running"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_max_lifetime_tears_the_run_down_on_time_and_status_says_when_before() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "life-max", "max_lifetime_s = 6", 2);
    let mut d = Daemon::start(&state, &shape);
    let (due, which) = wait_deadline(&state);
    assert_eq!(which, Which::MaxLifetime);
    let text = stdout(&cli(&state, &["status"]));
    assert!(text.contains("s (max_lifetime_s)"), "{text}");
    assert!(text.contains("tears down in "), "{text}");
    let reached = wait_reached(&d, Duration::from_secs(20));
    on_time(reached, due, "max_lifetime_s = 6");
    assert!(
        d.log()
            .contains("max_lifetime_s (6 s): the run tears itself down that long from now"),
        "{}",
        d.log()
    );
    assert!(
        d.log()
            .contains("max_lifetime_s (6 s) reached; tearing the run down"),
        "{}",
        d.log()
    );
    torn_down(&mut d, &state);
}

#[test]
fn a_daemon_killed_and_started_again_tears_down_at_the_first_ones_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "life-kill", "max_lifetime_s = 10", 2);
    let mut d = Daemon::start(&state, &shape);
    let (due, _) = wait_deadline(&state);
    std::thread::sleep(Duration::from_secs(2));
    d.kill9();
    let killed = Instant::now();
    // Resumed from the journal, without the shape (which would extend it).
    let mut d = Daemon::spawn(&state, None).unwrap_or_else(|e| panic!("{}", e.log));
    let restarted = Instant::now();
    // Counted again from the restart, it would end at least 3 s later.
    assert!(
        restarted + Duration::from_secs(10) > due + LATE_MAX,
        "the restart was too quick to tell the deadlines apart"
    );
    let (again, _) = wait_deadline(&state);
    let drift = if again > due {
        again - due
    } else {
        due - again
    };
    assert!(
        drift < Duration::from_secs(1),
        "the deadline moved by {drift:?}"
    );
    let reached = wait_reached(&d, Duration::from_secs(20));
    on_time(reached, due, "max_lifetime_s = 10 across a kill -9");
    eprintln!(
        "killed {:?} after start, torn down {:?} after the kill",
        killed - (due - Duration::from_secs(10)),
        reached - killed
    );
    torn_down(&mut d, &state);
}

#[test]
fn idle_teardown_waits_for_a_running_job_then_for_its_window() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "life-idle", "idle_teardown_s = 8", 1);
    let mut d = Daemon::start(&state, &shape);
    wait_converged(&state, Duration::from_secs(6), |s| {
        s.nodes.len() == 1 && s.nodes[0].ready
    });
    // A job that outlasts the idle window.
    let job_started = Instant::now();
    let mut job = std::process::Command::new(BIN)
        .arg("run")
        .arg("--state-dir")
        .arg(&state)
        .args(["--all", "--", "sleep", "10"])
        .current_dir(tmp.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(5), "the job's run to be seen", || {
        status(&state)
            .and_then(|s| s.lifetime)
            .is_some_and(|l| l.verdict == Verdict::Unbounded)
    });
    let text = stdout(&cli(&state, &["status"]));
    assert!(
        text.contains("no idle teardown while a job runs (idle_teardown_s: 8 s)"),
        "{text}"
    );
    let ended = loop {
        if job.try_wait().unwrap().is_some() {
            break Instant::now();
        }
        assert!(
            !d.last_log().contains(REACHED),
            "torn down while a job ran: {}",
            d.log()
        );
        assert!(
            job_started.elapsed() < Duration::from_secs(20),
            "the job did not end"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        job_started.elapsed() >= Duration::from_secs(9),
        "the job ended early"
    );
    // Idle from the job's end: the daemon sees it ended at its next check.
    let reached = wait_reached(&d, Duration::from_secs(15));
    on_time(
        reached,
        ended + Duration::from_secs(8) - Duration::from_secs(1),
        "idle_teardown_s = 8 after a job",
    );
    assert!(
        d.log().contains("idle_teardown_s (8 s) reached"),
        "{}",
        d.log()
    );
    torn_down(&mut d, &state);
}

#[test]
fn an_apply_of_the_shape_extends_the_max_lifetime() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "life-apply", "max_lifetime_s = 8", 1);
    let mut d = Daemon::start(&state, &shape);
    let (first, _) = wait_deadline(&state);
    std::thread::sleep(Duration::from_secs(4));
    let applied = Instant::now();
    let o = cli(&state, &["apply", shape.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stdout(&o);
    assert!(said.contains("unchanged"), "{said}");
    assert!(
        said.contains("max_lifetime_s (8 s) counts again from now"),
        "{said}"
    );
    let (due, _) = wait_deadline(&state);
    assert!(
        due >= applied + Duration::from_secs(8) - EARLY_MAX
            && due <= Instant::now() + Duration::from_secs(8),
        "the deadline is not 8 s after the apply"
    );
    assert!(due > first + Duration::from_secs(3), "not extended");
    let reached = wait_reached(&d, Duration::from_secs(20));
    on_time(reached, due, "max_lifetime_s = 8, extended by an apply");
    torn_down(&mut d, &state);
}

#[test]
fn metrics_show_the_time_left_and_the_daemon_warns_as_the_end_nears() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape(tmp.path(), "life-metrics", "max_lifetime_s = 3600", 1);
    let d = Daemon::start(&state, &shape);
    let (due, _) = wait_deadline(&state);
    let (code, body) = web_get(&state, "/metrics");
    assert_eq!(code, 200, "{body}");
    let line = body
        .lines()
        .find(|l| l.starts_with("swactor_run_lifetime_left_seconds{"))
        .unwrap_or_else(|| panic!("no lifetime gauge: {body}"));
    assert!(line.contains("setting=\"max_lifetime_s\""), "{line}");
    let left: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    let want = due.saturating_duration_since(Instant::now()).as_secs_f64();
    assert!((left - want).abs() < 2.0, "{left} s left, want {want}");
    let text = stdout(&cli(&state, &["status"]));
    assert!(
        text.contains("tears down in 60 min (max_lifetime_s)"),
        "{text}"
    );
    // An hour away, the first warning (at 60 minutes) is due at once.
    wait_for(Duration::from_secs(5), "the daemon's warning", || {
        d.last_log()
            .contains("swactor: tears down in 60 min (max_lifetime_s)")
    });
}
