//! Gang jobs, the queue and recovery end to end: a real daemon, real agents
//! (local processes), `swactor run` as a user types it, and a real
//! multi-rank program (`bin/tests/fixtures/ranksum/ranksum.py`, standard
//! library only) that meets at the master address and sums every rank's
//! number over TCP.

use crate::common;

use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const READY: Duration = Duration::from_secs(60);

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ranksum")
}

fn python() -> &'static str {
    // Debian's, so a docker node that mounts /usr finds the same one.
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// `swactor run ARGS`, in `cwd`, to its end.
fn run<S: AsRef<std::ffi::OsStr>>(cwd: &Path, state: &Path, args: &[S]) -> Output {
    spawn_run(cwd, state, args).wait_with_output().unwrap()
}

/// `swactor run ARGS`, in `cwd`, started.
fn spawn_run<S: AsRef<std::ffi::OsStr>>(cwd: &Path, state: &Path, args: &[S]) -> Child {
    Command::new(BIN)
        .arg("--state-dir")
        .arg(state)
        .arg("run")
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn job(state: &Path, id: &str) -> Value {
    let j = try_job(state, id);
    assert!(!j.is_null(), "no {id}");
    j
}

/// Job `id`, or null while it was not submitted yet or no daemon answers
/// (a restarted one may not hold its state directory yet: the ticket its
/// killed predecessor left says nothing).
fn try_job(state: &Path, id: &str) -> Value {
    let o = cli(state, &["jobs", "--json"]);
    if !o.status.success() {
        return Value::Null;
    }
    serde_json::from_slice::<Vec<Value>>(&o.stdout)
        .unwrap()
        .into_iter()
        .find(|j| j["id"] == id)
        .unwrap_or(Value::Null)
}

/// Waits until `n` nodes are ready.
fn all_ready(state: &Path, n: usize) {
    wait_converged(state, READY, |s| {
        s.nodes.iter().filter(|x| x.ready).count() == n
    });
}

/// The sum line every rank of an N-rank ranksum prints.
fn sums(out: &str, n: u32, restart: u32) -> Vec<String> {
    let total = n * (n + 1) / 2;
    (0..n)
        .filter(|r| out.contains(&format!("rank {r} of {n}: sum {total} (restart {restart})")))
        .map(|r| r.to_string())
        .collect()
}

fn ranksum(extra: &[&str]) -> Vec<String> {
    let fixture = fixture().display().to_string();
    let mut args: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    args.extend(["--workspace".to_owned(), fixture, "--".to_owned()]);
    args.extend([python().to_owned(), "ranksum.py".to_owned()]);
    args
}

/// Starts job `id`, a 2-rank ranksum gang (with `extra` options) whose
/// ranks hold 30 s after their sum, waits for both sums, then `kill -9`s
/// the agent of rank `rank`. Returns the `swactor run` following the job
/// and the node whose agent was killed.
fn gang_then_kill(
    root: &Path,
    state: &Path,
    id: &str,
    extra: &[&str],
    rank: usize,
) -> (Child, String) {
    let mut opts = vec!["--nodes", "2", "--env", "RANKSUM_HOLD_S=30"];
    opts.extend_from_slice(extra);
    let args = ranksum(&opts);
    let child = spawn_run(root, state, &args);
    wait_for(Duration::from_secs(30), "both ranks' sums", || {
        stdout(&cli(state, &["job", "logs", id]))
            .matches(": sum 3 (restart 0)")
            .count()
            == 2
    });
    let r = job(state, id)["runs"][rank].clone();
    let node = r["node"].as_str().unwrap().to_owned();
    kill9(agents(state)[&(node.clone(), r["attempt"].as_u64().unwrap())][0]);
    (child, node)
}

#[test]
fn a_four_rank_gang_sums_over_tcp_and_two_gangs_on_four_nodes_queue() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "four.toml", &workers("gang-four", 4));
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 4);

    // Four ranks, one per node; each prints the sum of 1+2+3+4.
    let args = ranksum(&["--nodes", "4"]);
    let o = run(root, &state, &args);
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert_eq!(sums(&out, 4, 0), ["0", "1", "2", "3"], "{out}{err}");
    assert!(err.contains("job-1 started on 4 node(s)"), "{err}");
    let j = job(&state, "job-1");
    assert_eq!(j["gang"]["nodes"], 4);
    let ranks: Vec<u64> = j["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, [0, 1, 2, 3]);
    assert_eq!(j["gang"]["addrs"][0], "127.0.0.1");

    // The rank environment, as a command sees it.
    let o = run(
        root,
        &state,
        &[
            "--nodes",
            "2",
            "--",
            "sh",
            "-c",
            "echo rank=$SWACTOR_NODE_RANK of=$SWACTOR_NUM_NODES job=$SWACTOR_JOB_ID \
             master=$SWACTOR_MASTER_ADDR:$SWACTOR_MASTER_PORT addrs=$SWACTOR_NODE_ADDRS \
             gpus=$SWACTOR_GPUS_PER_NODE restart=$SWACTOR_RESTART_COUNT",
        ],
    );
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    let port = job(&state, "job-2")["gang"]["master_port"]
        .as_u64()
        .unwrap();
    assert!(port > 0);
    for r in 0..2 {
        assert!(
            out.contains(&format!(
                "rank={r} of=2 job=job-2 master=127.0.0.1:{port} addrs=127.0.0.1,127.0.0.1 gpus=0 restart=0"
            )),
            "{out}"
        );
    }

    // Two 3-node gangs at once onto 4 nodes: the second waits, then runs.
    let hold = ranksum(&["--nodes", "3", "--env", "RANKSUM_HOLD_S=6"]);
    let first = spawn_run(root, &state, &hold);
    wait_for(Duration::from_secs(20), "job-3 to run", || {
        try_job(&state, "job-3")["runs"]
            .as_array()
            .is_some_and(|r| r.len() == 3)
    });
    let second = spawn_run(root, &state, &hold);
    let mut seen_queued = None;
    wait_for(Duration::from_secs(30), "job-4 to show queued", || {
        let j = try_job(&state, "job-4");
        seen_queued = j["waiting"].as_str().map(str::to_owned);
        seen_queued
            .as_deref()
            .is_some_and(|w| w.starts_with("queued: "))
    });
    let why = seen_queued.unwrap();
    assert!(why == "queued: needs 3 node(s), 1 free", "{why}");
    // The dashboard's list shows it queued, with the reason.
    let (addr, token) = web(&state);
    let (code, body) = get(addr, &token, "/api/jobs");
    assert_eq!(code, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).unwrap();
    let j4 = listed["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == "job-4")
        .cloned()
        .unwrap_or_default();
    assert_eq!(j4["state"], "queued", "{body}");
    assert_eq!(j4["waiting"], "needs 3 node(s), 1 free", "{body}");
    assert_eq!(j4["gang"]["nodes"], 3, "{body}");
    assert_eq!(listed["queued"], 1, "{body}");
    let table = stdout(&cli(&state, &["jobs"]));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("job-4") && l.contains("queued") && l.contains("needs 3")),
        "{table}"
    );
    let (a, b) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert_eq!(a.status.code(), Some(0), "{}", stderr(&a));
    assert_eq!(b.status.code(), Some(0), "{}", stderr(&b));
    assert_eq!(sums(&stdout(&a), 3, 0).len(), 3, "{}", stdout(&a));
    assert_eq!(sums(&stdout(&b), 3, 0).len(), 3, "{}", stdout(&b));
    assert!(
        stderr(&b).contains("job-4 queued: needs 3 node(s), 1 free"),
        "{}",
        stderr(&b)
    );
    // The second started only once the first had ended.
    let (j3, j4) = (job(&state, "job-3"), job(&state, "job-4"));
    let end3 = j3["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ended_unix_ms"].as_u64().unwrap())
        .min()
        .unwrap();
    let start4 = j4["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ended_unix_ms"].as_u64().unwrap())
        .min()
        .unwrap();
    assert!(start4 >= end3 + 6000, "job-4 ended {start4}, job-3 {end3}");

    // A queued job can be cancelled, and a gang larger than the cluster
    // waits saying what would let it start.
    let big = spawn_run(root, &state, &["--nodes", "5", "--", "true"]);
    wait_for(Duration::from_secs(10), "job-5 to wait", || {
        try_job(&state, "job-5")["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("scale up to start it"))
    });
    let o = cli(&state, &["job", "cancel", "job-5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = big.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert_eq!(job(&state, "job-5")["stop"], "Cancelled");
}

#[test]
fn a_lost_rank_restarts_the_gang_with_retry_and_fails_it_without() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "three.toml", &workers("gang-retry", 3));
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 3);

    // With --retry 1: the gang restarts, every rank anew, and completes.
    let started = Instant::now();
    let (child, lost) = gang_then_kill(root, &state, "job-1", &["--retry", "1"], 1);
    let o = child.wait_with_output().unwrap();
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "{err}");
    assert!(err.contains("restart 1: every rank anew"), "{err}");
    assert_eq!(sums(&out, 2, 1), ["0", "1"], "{out}");
    let j = job(&state, "job-1");
    assert_eq!(j["gang"]["restarts"], 1);
    let earlier = &j["earlier"][0]["runs"];
    let lost_run = earlier
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == lost.as_str())
        .unwrap();
    assert_eq!(lost_run["state"], "lost");
    assert_eq!(lost_run["node_lost"], true);
    assert!(
        j["runs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["state"] == "succeeded")
    );

    // Without --retry: the job fails and names the lost node.
    all_ready(&state, 3);
    let (child, lost) = gang_then_kill(root, &state, "job-2", &[], 0);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("[{lost}] lost:")), "{err}");
    let j = job(&state, "job-2");
    assert!(j["earlier"].as_array().unwrap().is_empty());
    // The other rank was stopped because of it, and says so.
    let other = j["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] != lost.as_str())
        .unwrap();
    assert_eq!(other["state"], "cancelled", "{other}");
    assert!(
        other["error"]
            .as_str()
            .unwrap()
            .contains(&format!("{lost} (rank 0) was lost")),
        "{other}"
    );

    // Not a gang: a run that exited 0 before another node was lost stays
    // done and is not run again.
    all_ready(&state, 3);
    let child = spawn_run(
        root,
        &state,
        &[
            "--all",
            "--",
            "sh",
            "-c",
            "echo started; if [ \"$SWACTOR_NODE\" = worker-0 ]; then exit 0; fi; sleep 60",
        ],
    );
    wait_for(Duration::from_secs(20), "worker-0's run to end", || {
        try_job(&state, "job-3")["runs"]
            .as_array()
            .is_some_and(|runs| {
                runs.iter()
                    .any(|r| r["node"] == "worker-0" && r["state"] == "succeeded")
            })
    });
    let j = job(&state, "job-3");
    let r1 = j["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == "worker-1")
        .unwrap();
    let agent = agents(&state)[&("worker-1".to_owned(), r1["attempt"].as_u64().unwrap())][0];
    kill9(agent);
    wait_for(Duration::from_secs(30), "worker-1's run to be lost", || {
        try_job(&state, "job-3")["runs"]
            .as_array()
            .is_some_and(|runs| {
                runs.iter()
                    .any(|r| r["node"] == "worker-1" && r["state"] == "lost")
            })
    });
    let _ = cli(&state, &["job", "cancel", "job-3"]);
    let o = child.wait_with_output().unwrap();
    let j = job(&state, "job-3");
    let w0 = j["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == "worker-0")
        .unwrap();
    assert_eq!(w0["state"], "succeeded", "{j}");
    let logs = stdout(&cli(
        &state,
        &["job", "logs", "job-3", "--node", "worker-0"],
    ));
    assert_eq!(logs.matches("started").count(), 1, "{logs}");
    assert!(stderr(&o).contains("[worker-1] lost:"), "{}", stderr(&o));
}

#[test]
fn setup_runs_once_per_node_and_workspace_and_a_failing_setup_fails_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "two.toml", &workers("gang-setup", 2));
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 2);
    let ws = root.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("data.txt"), "one\n").unwrap();
    let count = root.join("count");
    std::fs::create_dir_all(&count).unwrap();
    let setup = format!("sh -c 'echo x >> {}/$SWACTOR_NODE'", count.display());
    let ws_arg = ws.display().to_string();
    let go = |ws_arg: &str| {
        run(
            root,
            &state,
            &[
                "--all",
                "--workspace",
                ws_arg,
                "--setup",
                &setup,
                "--",
                "cat",
                "data.txt",
            ],
        )
    };
    let ran = |node: &str| {
        std::fs::read_to_string(count.join(node))
            .unwrap_or_default()
            .lines()
            .count()
    };
    let o = go(&ws_arg);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("[worker-0] one"), "{}", stdout(&o));
    assert_eq!((ran("worker-0"), ran("worker-1")), (1, 1));
    // The same setup and workspace again: skipped.
    let o = go(&ws_arg);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("setup skipped"), "{}", stderr(&o));
    assert_eq!((ran("worker-0"), ran("worker-1")), (1, 1));
    // A changed workspace runs it again.
    std::fs::write(ws.join("data.txt"), "two\n").unwrap();
    let o = go(&ws_arg);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!((ran("worker-0"), ran("worker-1")), (2, 2));
    // A failing setup fails the run with its code; the command never runs.
    let o = run(
        root,
        &state,
        &[
            "--nodes",
            "worker-0",
            "--setup",
            "sh -c 'exit 9'",
            "--",
            "echo",
            "never",
        ],
    );
    assert_eq!(o.status.code(), Some(9), "{}", stderr(&o));
    assert!(!stdout(&o).contains("never"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("setup `sh -c exit 9` exited with code 9"),
        "{}",
        stderr(&o)
    );
    // --retry is for gangs only.
    let o = run(root, &state, &["--all", "--retry", "1", "--", "true"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--retry restarts a gang"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_two_rank_gang_sums_across_two_docker_containers() {
    use common::docker::{RunContainers, agent_binary, docker_shape, engine_up};
    if !engine_up() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let name = format!("dk-gang-{}", std::process::id());
    let _containers = RunContainers::new(&name);
    // The agent image holds only the agent: this machine's Python comes in
    // read-only (no registry here to pull an image with it from).
    let params = "[group.params]\nmounts = [\"/usr:/usr\", \"/lib:/lib\", \"/lib64:/lib64\", \"/bin:/bin\"]\n";
    let shape = shape_file(root, "dk.toml", &docker_shape(&name, 2, params));
    let agent = agent_binary();
    let _d = Daemon::spawn_with(
        &state,
        Some(&shape),
        &["--agent-binary", agent.to_str().unwrap()],
    )
    .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
    all_ready(&state, 2);
    let args = ranksum(&["--nodes", "2"]);
    let o = run(root, &state, &args);
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert_eq!(sums(&out, 2, 0), ["0", "1"], "{out}{err}");
    let j = job(&state, "job-1");
    let nodes: Vec<&str> = j["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["node"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["w-0", "w-1"]);
}

#[test]
fn a_queued_gang_survives_a_daemon_restart_and_starts_when_its_group_scales_up() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "two.toml", &workers("gang-wait", 2));
    let mut d = Daemon::start(&state, &shape);
    all_ready(&state, 2);
    let child = spawn_run(
        root,
        &state,
        &[
            "--nodes",
            "3",
            "--group",
            "worker",
            "--priority",
            "2",
            "--",
            "sh",
            "-c",
            "echo rank $SWACTOR_NODE_RANK gpus $SWACTOR_GPUS_PER_NODE",
        ],
    );
    wait_for(Duration::from_secs(10), "job-1 to wait", || {
        try_job(&state, "job-1")["waiting"].as_str()
            == Some(
                "queued: needs 3 of group worker, 2 free (the cluster has 2 such node(s): scale up to start it)",
            )
    });
    // The daemon dies; the job is on record and waits again under the next.
    d.kill9();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 2);
    let j = job(&state, "job-1");
    assert_eq!(j["priority"], 2);
    assert!(j["waiting"].as_str().is_some(), "{j}");
    assert!(j["runs"].as_array().unwrap().is_empty(), "{j}");
    // Scaling the group up lets it start; the group now declares its GPUs
    // and lets a node run two jobs at once (neither replaces a node).
    let three = shape_file(
        root,
        "three.toml",
        &format!("{}gpus = 8\njobs_per_node = 2\n", workers("gang-wait", 3)),
    );
    let o = cli(&state, &["apply", three.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for(Duration::from_secs(60), "job-1 to succeed", || {
        let j = try_job(&state, "job-1");
        j["runs"]
            .as_array()
            .is_some_and(|r| r.len() == 3 && r.iter().all(|r| r["state"] == "succeeded"))
    });
    let logs = stdout(&cli(&state, &["job", "logs", "job-1"]));
    for r in 0..3 {
        assert!(logs.contains(&format!("rank {r} gpus 8")), "{logs}");
    }
    // Two jobs on one node that can only end if they run at once.
    let dir = root.join("meet");
    std::fs::create_dir_all(&dir).unwrap();
    let meet = |me: &str, other: &str| {
        format!(
            "touch {d}/{me}; for i in $(seq 100); do [ -e {d}/{other} ] && exit 0; sleep 0.1; done; exit 1",
            d = dir.display()
        )
    };
    let (a, b) = (meet("a", "b"), meet("b", "a"));
    let first = spawn_run(root, &state, &["--nodes", "worker-0", "--", "sh", "-c", &a]);
    let second = spawn_run(root, &state, &["--nodes", "worker-0", "--", "sh", "-c", &b]);
    let (a, b) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert_eq!(a.status.code(), Some(0), "{}", stderr(&a));
    assert_eq!(b.status.code(), Some(0), "{}", stderr(&b));
    // A queued job's --timeout counts while it waits.
    let started = Instant::now();
    let o = run(
        root,
        &state,
        &["--nodes", "9", "--timeout", "2", "--", "true"],
    );
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("timed out after 2 s while it waited in the queue"),
        "{}",
        stderr(&o)
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// Opt-in: `SWACTOR_TEST_TORCH_PYTHON=/path/to/python` (one that can
/// `import torch`) runs `examples/torchrun` on a two-node gang of local
/// processes with gloo on CPU.
#[test]
fn torchrun_example_trains_on_a_two_node_gang() {
    let Some(python) = std::env::var_os("SWACTOR_TEST_TORCH_PYTHON") else {
        eprintln!("skipped: set SWACTOR_TEST_TORCH_PYTHON to a Python with torch to run it");
        return;
    };
    let python = python.to_string_lossy().into_owned();
    let has_torch = Command::new(&python)
        .args(["-c", "import torch"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_torch,
        "SWACTOR_TEST_TORCH_PYTHON={python} cannot import torch"
    );
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "two.toml", &workers("gang-torch", 2));
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 2);
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/torchrun");
    let env = format!("PYTHON={python}");
    let o = run(
        root,
        &state,
        &[
            "--nodes",
            "2",
            "--timeout",
            "300",
            "--env",
            &env,
            "--workspace",
            example.to_str().unwrap(),
            "--",
            "./launch.sh",
        ],
    );
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    for r in 0..2 {
        assert!(
            out.contains(&format!("rank {r} of 2 (node rank {r}): all_reduce sum 3")),
            "{out}{err}"
        );
    }
    assert!(out.contains("[worker-0] step 40: loss"), "{out}");
}

#[test]
fn a_daemon_that_dies_before_a_gang_restart_is_on_record_restarts_it_when_back() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    let shape = shape_file(root, "three.toml", &workers("gang-requeue", 3));
    let fault = [("SWACTOR_FAULT_ABORT_BEFORE_REQUEUE", "1")];
    let mut d = Daemon::spawn_env(&state, Some(&shape), &[], &fault)
        .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    all_ready(&state, 3);
    let (child, _) = gang_then_kill(root, &state, "job-1", &["--retry", "1"], 1);
    // Every rank's end is on record; the daemon dies before the restart is.
    assert_eq!(
        d.wait_exit(Duration::from_secs(30)),
        Some(86),
        "{}",
        d.log()
    );
    let _ = child.wait_with_output();
    let _d = Daemon::start(&state, &shape);
    all_ready(&state, 3);
    wait_for(
        Duration::from_secs(60),
        "the gang's restart to succeed",
        || {
            let j = try_job(&state, "job-1");
            j["gang"]["restarts"] == 1
                && j["runs"]
                    .as_array()
                    .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["state"] == "succeeded"))
        },
    );
    let j = job(&state, "job-1");
    assert_eq!(j["earlier"].as_array().unwrap().len(), 1, "{j}");
    let logs = stdout(&cli(&state, &["job", "logs", "job-1"]));
    assert_eq!(logs.matches(": sum 3 (restart 1)").count(), 2, "{logs}");
}

#[test]
fn a_gangs_ranks_wait_longer_than_their_groups_grace_and_a_loss_restarts_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let state = root.join("state");
    // The group's grace (3 s) is longer than the daemon's reattach wait
    // (1 s): the gang's ranks wait 3 + 10 s for a link that dropped, so the
    // cluster decides about a silent node first. (A process node's agent
    // killed outright is replaced before its link is seen down, so this
    // run does not reach the case where the longer wait is what saves the
    // restart; it checks the wait the ranks were given and the restart.)
    let body = workers("gang-grace", 3).replace("lost_grace_s = 1.0", "lost_grace_s = 3.0");
    let shape = shape_file(root, "three.toml", &body);
    let _d = Daemon::spawn_env(
        &state,
        Some(&shape),
        &[],
        &[("SWACTOR_JOB_REATTACH_S", "1")],
    )
    .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    all_ready(&state, 3);
    let (child, node) = gang_then_kill(root, &state, "job-1", &["--retry", "1"], 1);
    let j = job(&state, "job-1");
    assert_eq!(j["gang"]["reattach_s"], 13, "{j}");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = job(&state, "job-1");
    let lost = j["earlier"][0]["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == node.as_str())
        .cloned()
        .unwrap();
    assert_eq!(lost["node_lost"], true, "{lost}");
    assert_eq!(j["gang"]["restarts"], 1);
}
