//! The embedding example, run as a test: a program that is not `swactor`
//! starts the daemon through the crate's public API with a provider of its
//! own next to the built-in ones, real agents (the example itself, started
//! by the local process provider and by the program's own) join it, and
//! the journal it leaves holds the run.

use std::path::PathBuf;
use std::process::Command;
use swactor_daemon::journal::DaemonJournal;

/// The example's binary: `cargo test` builds examples next to the test
/// binaries (`target/debug/examples/`).
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let path = dir.join("examples").join("embed");
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build -p swactor-daemon --example embed` \
         (`cargo test --workspace` builds it)",
        path.display()
    );
    path
}

#[test]
fn an_embedding_program_runs_a_daemon_that_real_agents_join_and_that_persists() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let out = Command::new(example())
        .arg(&state)
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the example failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    // Both agents joined: the daemon saw the cluster converge with them.
    assert!(
        stderr.contains("converged: generation 1, 2 node(s) ready")
            || stdout.contains("converged: generation 1, 2 node(s) ready"),
        "no convergence with two joined agents:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("embed: the daemon returned 0"), "{stdout}");
    // The provider the program brought served its group, and its node was
    // destroyed at the teardown.
    assert!(
        stdout.contains("embed: the own provider made 1 lease(s) and destroyed 1"),
        "{stdout}"
    );
    // What it persisted, read here independently of the example: the run,
    // the shape of the teardown it finished, the attempts it reserved for
    // the two agents, and no slot left (both were destroyed).
    let (_journal, image) = DaemonJournal::open(&state.join("journal.redb")).unwrap();
    let image = image.expect("the journal holds the run");
    assert_eq!(image.meta.run_id.to_string(), "embedded");
    assert!(image.meta.attempts_reserved >= 2);
    assert_eq!(image.slots.len(), 0);
    assert!(image.meta.shape.is_some());
}
