//! The flight recorder with a real daemon: a run with faults (agents
//! killed, an apply, a scale-down, a rollout, a daemon killed and started
//! again) leaves one recording per daemon life; `swactor replay` finds
//! every answer as recorded, `swactor explain` tells why the killed
//! agent's node was replaced, and no recording holds a secret.

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;

const CONVERGE: Duration = Duration::from_secs(30);

/// `count` process nodes in group `w`; `check` is their boot check.
fn shape(count: u32, check: &str) -> String {
    format!(
        "run = \"flight\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"process\"\n\
         boot_check = {check}\nlost_grace_s = 1.0\n"
    )
}

fn attempt_of(s: &ClusterSnapshot, node: &str) -> Option<u64> {
    s.nodes
        .iter()
        .find(|n| n.node.to_string() == node)
        .map(|n| n.attempt.0)
}

fn all_ready(s: &ClusterSnapshot, count: usize) -> bool {
    s.nodes.len() == count && s.nodes.iter().all(|n| n.ready)
}

/// Kills `node`'s agent with SIGKILL; returns its attempt.
fn kill_agent(state: &Path, node: &str) -> u64 {
    let agents = agents(state);
    let ((_, attempt), pids) = agents
        .iter()
        .find(|((n, _), _)| n == node)
        .unwrap_or_else(|| panic!("no agent of {node}: {agents:?}"));
    kill9(pids[0]);
    *attempt
}

fn apply(state: &Path, shape: &Path) {
    let o = cli(state, &["apply", shape.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// The recordings under `state`, in the order their lives began.
fn recordings(state: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(state.join("flight"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "flight"));
    files.sort();
    files
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_faulty_run_replays_as_recorded_and_explains_a_replaced_node() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let three = shape_file(tmp.path(), "three.toml", &shape(3, "[\"true\"]"));
    let two = shape_file(tmp.path(), "two.toml", &shape(2, "[\"true\"]"));
    let rolled = shape_file(
        tmp.path(),
        "rolled.toml",
        &shape(2, "[\"sh\", \"-c\", \"true\"]"),
    );

    // Life 1: converge, lose an agent, scale down, roll a new template.
    let mut first = Daemon::start(&state, &three);
    let s = wait_converged(&state, CONVERGE, |s| all_ready(s, 3));
    let w1 = attempt_of(&s, "w-1").unwrap();
    // A moment when w-1 was ready (status said so) and well before its
    // agent is killed.
    let before_kill = chrono::Utc::now();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(kill_agent(&state, "w-1"), w1);
    let s = wait_converged(&state, CONVERGE, |s| {
        all_ready(s, 3) && attempt_of(s, "w-1").is_some_and(|a| a != w1)
    });
    let w1_second = attempt_of(&s, "w-1").unwrap();
    apply(&state, &two);
    let s = wait_converged(&state, CONVERGE, |s| all_ready(s, 2));
    let w0 = attempt_of(&s, "w-0").unwrap();
    apply(&state, &rolled);
    wait_converged(&state, CONVERGE, |s| {
        all_ready(s, 2)
            && attempt_of(s, "w-0").is_some_and(|a| a != w0)
            && attempt_of(s, "w-1").is_some_and(|a| a != w1_second)
    });

    // Life 2: the daemon killed and started again; it adopts, then loses
    // another agent.
    first.kill9();
    let second = Daemon::spawn(&state, None).unwrap_or_else(|e| panic!("{}", e.log));
    let s = wait_converged(&state, CONVERGE, |s| all_ready(s, 2));
    let w0 = attempt_of(&s, "w-0").unwrap();
    assert_eq!(kill_agent(&state, "w-0"), w0);
    wait_converged(&state, CONVERGE, |s| {
        all_ready(s, 2) && attempt_of(s, "w-0").is_some_and(|a| a != w0)
    });

    // The live recording can be read while the daemon writes it.
    let o = cli(&state, &["explain", "w-0"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("life 2 of 2"), "{}", stdout(&o));

    let o = cli(&state, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut second = second;
    assert_eq!(second.wait_exit(Duration::from_secs(30)), Some(0));

    // Two lives, two recordings, each replayed with every answer as recorded.
    let files = recordings(&state);
    assert_eq!(files.len(), 2, "{files:?}");
    let mut args = vec!["replay"];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    let o = cli(&state, &args);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", stderr(&o));
    assert_eq!(
        out.matches("replayed, every answer as recorded").count(),
        2,
        "{out}"
    );
    assert!(!out.contains("cut"), "nothing was dropped: {out}");
    for (file, line) in files
        .iter()
        .zip(out.lines().filter(|l| l.contains("inputs replayed")))
    {
        let inputs: u64 = line.split_whitespace().next().unwrap().parse().unwrap();
        assert!(inputs > 100, "{}: {line}", file.display());
    }
    assert!(out.contains("build swactor "), "{out}");
    assert!(out.contains("run flight, started "), "{out}");

    // Why w-1 was replaced: the row, and the failure that chose it.
    let o = cli(&state, &["explain", "w-1"]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("life 1 of 2") && out.contains("life 2 of 2"),
        "{out}"
    );
    let failed = format!("a{w1}: stage Failed");
    let begin = out
        .lines()
        .enumerate()
        .find(|(i, l)| {
            l.contains("row 4 (BeginDelete): begin deleting the attempt (it failed)")
                && out.lines().nth(i + 1).is_some_and(|f| f.contains(&failed))
        })
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("no row 4 for a{w1}'s failure in:\n{out}"));
    let facts: Vec<&str> = out.lines().skip(begin).take(7).collect();
    let facts = facts.join("\n");
    assert!(facts.contains("failures 1"), "{facts}");
    // The process provider saw the agent die of the signal it was sent.
    assert!(facts.contains("    failed at "), "{facts}");
    assert!(facts.contains("killed by signal 9"), "{facts}");
    assert!(facts.contains("    last error ("), "{facts}");
    assert!(facts.contains("    because: #"), "{facts}");
    // Then its slot was restarted with the attempt status showed.
    let after = out.lines().skip(begin).collect::<Vec<_>>().join("\n");
    assert!(
        after.contains("restart the slot with a fresh attempt"),
        "{out}"
    );
    assert!(
        after.contains(&format!("    a{w1_second}: stage New")),
        "{out}"
    );

    // Up to a moment before the kill, nothing of it.
    let at = before_kill.to_rfc3339();
    let o = cli(&state, &["explain", "w-1", "--at", &at]);
    let early = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{early}\n{}", stderr(&o));
    assert!(early.contains("row 11 (SteadyReady)"), "{early}");
    assert!(early.contains("(--at)"), "{early}");
    assert!(!early.contains("BeginDelete"), "{early}");

    // A node no recording knows is named as unknown, with the ones they know.
    let o = cli(&state, &["explain", "w-9"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("know no node w-9"), "{}", stderr(&o));
    assert!(stderr(&o).contains("w-0 to w-2"), "{}", stderr(&o));

    // No recording holds a secret of the run: the token secret (as bytes
    // and as hex) nor any key or token file of the state directory.
    let mut secrets: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in std::fs::read_dir(&state).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let secretive = ["key", "secret", "token"].iter().any(|w| name.contains(w));
        if !secretive || !entry.path().is_file() {
            continue;
        }
        let bytes = std::fs::read(entry.path()).unwrap();
        let text = String::from_utf8_lossy(&bytes).trim().to_owned();
        for (what, needle) in [
            (name.clone(), bytes.clone()),
            (format!("{name} in hex"), hex(&bytes).into_bytes()),
            (format!("{name} as text"), text.into_bytes()),
        ] {
            if needle.len() >= 16 {
                secrets.push((what, needle));
            }
        }
    }
    let names: Vec<&str> = secrets.iter().map(|(w, _)| w.as_str()).collect();
    for must in ["token.secret", "token.secret in hex", "daemon.key"] {
        assert!(names.contains(&must), "{must} not checked: {names:?}");
    }
    for file in &files {
        let bytes = std::fs::read(file).unwrap();
        for (what, needle) in &secrets {
            assert!(!holds(&bytes, needle), "{what} is in {}", file.display());
        }
    }
    eprintln!(
        "flight: {} recordings, {} secrets checked, {:.1} s",
        files.len(),
        secrets.len(),
        started.elapsed().as_secs_f64()
    );
}
