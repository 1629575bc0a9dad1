//! One daemon per state directory: racing `swactor up`s, `down` releasing the
//! directory, and a killed holder that does not keep it.

use crate::common;

use common::{BIN, Daemon, cli, kill9, shape_file, stderr, wait_for, workers};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `swactor up [SHAPE] --state-dir STATE` without waiting for it, its
/// stderr going to `log`.
fn spawn_up(state: &Path, shape: Option<&Path>, log: &Path) -> Child {
    let mut cmd = Command::new(BIN);
    cmd.arg("up");
    if let Some(shape) = shape {
        cmd.arg(shape);
    }
    cmd.arg("--state-dir")
        .arg(state)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start swactor up")
}

/// Owns a child so it (and any agents of `state`) is killed if the test fails.
fn guard(child: Child, state: &Path) -> Daemon {
    Daemon {
        child: Some(child),
        state: state.to_path_buf(),
    }
}

fn exited(d: &mut Daemon) -> Option<std::process::ExitStatus> {
    d.child.as_mut().unwrap().try_wait().unwrap()
}

/// Waits until the process has exited, for at most `limit`.
fn exits_within(d: &mut Daemon, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = exited(d) {
            return Some(status);
        }
        if start.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ticket(state: &Path) -> PathBuf {
    state.join("daemon.ticket")
}

#[test]
fn of_two_daemons_started_at_once_exactly_one_runs_and_down_frees_the_directory() {
    const ROUNDS: usize = 20;
    let tmp = tempfile::tempdir().unwrap();
    let shape = shape_file(tmp.path(), "shape.toml", &workers("lock", 1));
    let started = Instant::now();
    for round in 0..ROUNDS {
        let state = tmp.path().join(format!("s{round}"));
        let logs = [0, 1].map(|i| tmp.path().join(format!("s{round}.{i}.log")));
        // Spawned back to back, so both race through create_dir and the lock.
        let a = spawn_up(&state, Some(&shape), &logs[0]);
        let b = spawn_up(&state, Some(&shape), &logs[1]);
        let mut racers = [guard(a, &state), guard(b, &state)];
        wait_for(Duration::from_secs(30), "the winner's ticket", || {
            ticket(&state).exists()
        });
        wait_for(Duration::from_secs(10), "the loser to exit", || {
            racers.iter_mut().any(|d| exited(d).is_some())
        });
        let running: Vec<usize> = (0..2)
            .filter(|i| exited(&mut racers[*i]).is_none())
            .collect();
        assert_eq!(
            running.len(),
            1,
            "round {round}: exactly one daemon is still running"
        );
        let (winner, loser) = (running[0], 1 - running[0]);
        let winner_pid = racers[winner].child.as_ref().unwrap().id();
        let loser_status = exited(&mut racers[loser]).unwrap();
        let loser_log = std::fs::read_to_string(&logs[loser]).unwrap();
        assert!(
            !loser_status.success(),
            "round {round}: the loser exited {loser_status}"
        );
        assert!(
            loser_log.contains("already running")
                && loser_log.contains(&format!("pid {winner_pid}")),
            "round {round}: the loser's error names the winner (pid {winner_pid}): {loser_log}"
        );

        let down = cli(&state, &["down"]);
        assert!(
            down.status.success(),
            "round {round}: down failed: {}",
            stderr(&down)
        );
        let status = exits_within(&mut racers[winner], Duration::from_secs(1));
        assert!(
            status.is_some(),
            "round {round}: the daemon is still running after `down` returned"
        );
        assert!(
            !ticket(&state).exists(),
            "round {round}: the ticket is gone"
        );

        // At once, a new daemon gets the directory (an empty shape is
        // refused, so it gets one node).
        let log = tmp.path().join(format!("s{round}.next.log"));
        let one = shape_file(tmp.path(), &format!("one{round}.toml"), &workers("lock", 1));
        let mut next = guard(spawn_up(&state, Some(&one), &log), &state);
        wait_for(Duration::from_secs(30), "the next daemon's ticket", || {
            ticket(&state).exists() || exited(&mut next).is_some()
        });
        assert!(
            exited(&mut next).is_none(),
            "round {round}: the next daemon did not start: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        // Dropping the guards kills it and its agent, and reaps everything.
    }
    eprintln!(
        "{ROUNDS} rounds in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The old pid-file check counted a zombie as alive; the kernel drops a
/// killed process's `flock` whether or not it has been reaped.
#[test]
fn a_killed_daemon_even_unreaped_does_not_keep_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let shape = shape_file(tmp.path(), "shape.toml", &workers("zombie", 1));
    let state = tmp.path().join("state");
    let first = Daemon::start(&state, &shape);
    let pid = first.child.as_ref().unwrap().id();
    kill9(pid);
    // Not reaped: a zombie until `first` is dropped.
    wait_for(
        Duration::from_secs(5),
        "the killed daemon to be a zombie",
        || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        },
    );
    let lock = std::fs::read_to_string(state.join("daemon.lock")).unwrap();
    assert_eq!(
        lock.trim(),
        pid.to_string(),
        "its pid is still in the lock file"
    );
    // Its ticket is stale; remove it to see the next daemon's appear.
    std::fs::remove_file(ticket(&state)).unwrap();

    // Its agent is still running, so this also shows agents do not inherit the lock.
    let mut second = Daemon::start(&state, &shape);
    assert!(exited(&mut second).is_none(), "the second daemon runs");
    let down = cli(&state, &["down"]);
    assert!(down.status.success(), "down failed: {}", stderr(&down));
    assert!(
        exits_within(&mut second, Duration::from_secs(1)).is_some(),
        "the second daemon exited by the time `down` returned"
    );
    drop(first);
}

/// Issue 29, item 9: with `daemon.lock` deleted, a second `up` took a new
/// lock file (and was refused only later, at the journal), leaving an
/// unheld lock file behind; `status` and `down` then said no daemon was
/// running while the daemon and its agents ran. The daemon now holds its
/// directory as well, which no file operation inside it takes away.
#[test]
fn a_deleted_lock_file_lets_no_second_daemon_in_and_hides_nothing_from_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(tmp.path(), "lock.toml", &workers("lock-deleted", 1));
    let mut first = Daemon::start(&state, &shape);
    let o = cli(&state, &["status"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_file(state.join("daemon.lock")).unwrap();
    // A second `up` is refused at once, naming the running one.
    let log = tmp.path().join("second.log");
    let mut second = guard(spawn_up(&state, Some(&shape), &log), &state);
    let status = exits_within(&mut second, Duration::from_secs(20)).expect("the second up exits");
    assert!(!status.success());
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("is already running"), "{said}");
    assert!(exited(&mut first).is_none(), "the first daemon runs on");
    // The CLI still finds the running daemon, with or without a lock file.
    for _ in 0..2 {
        let o = cli(&state, &["status"]);
        assert!(o.status.success(), "status: {}", stderr(&o));
        let _ = std::fs::remove_file(state.join("daemon.lock"));
    }
    // Its guard would stop the agents of the directory, which are the first's.
    std::mem::forget(second);
    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "down: {}", stderr(&o));
    let status = exits_within(&mut first, Duration::from_secs(30)).expect("down stops it");
    assert!(status.success());
}
