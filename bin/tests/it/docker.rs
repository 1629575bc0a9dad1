//! The daemon driving the `docker` provider on the real Docker engine: real
//! containers of the static agent, faults made with the docker CLI.
//!
//! Each test uses a run of its own and removes that run's containers when it
//! ends, pass or fail. See `common/docker.rs` for what happens without an engine.

use crate::common;

use common::docker::{
    Container, agent_binary, by_slot, containers, docker, docker_shape, engine_up, remove_run,
    slot_watcher,
};
use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;

/// One test's daemon and run; removes the run's containers when dropped.
struct World {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    state: PathBuf,
    run: String,
    daemon: Option<Daemon>,
    files: u32,
}

impl World {
    fn new(name: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        // Unique per test process, so two runs of the suite never share containers.
        let run = format!("dk-{name}-{}", std::process::id());
        remove_run(&run);
        Self {
            state: dir.join("state"),
            dir,
            _tmp: tmp,
            run,
            daemon: None,
            files: 0,
        }
    }

    fn file(&mut self, body: &str) -> PathBuf {
        self.files += 1;
        shape_file(&self.dir, &format!("s{}.toml", self.files), body)
    }

    fn up(&mut self, body: &str) {
        let f = self.file(body);
        let agent = agent_binary();
        let d = Daemon::spawn_with(
            &self.state,
            Some(&f),
            &["--agent-binary", agent.to_str().unwrap()],
        )
        .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
        self.daemon = Some(d);
    }

    fn apply(&mut self, body: &str) -> std::process::Output {
        let f = self.file(body);
        cli(&self.state, &["apply", f.to_str().unwrap(), "--yes"])
    }

    fn converged(&self, nodes: usize) -> ClusterSnapshot {
        match try_wait_converged(&self.state, Duration::from_secs(120), |s| {
            s.nodes.len() == nodes && s.nodes.iter().all(|n| n.ready)
        }) {
            Ok(s) => s,
            Err(last) => panic!(
                "not converged to {nodes} node(s): {last:#?}\ncontainers {:#?}\ndaemon log:\n{}",
                containers(&self.run),
                self.log()
            ),
        }
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(Daemon::log).unwrap_or_default()
    }

    /// `swactor down`, then: the daemon exited 0 and no container of the run is left.
    fn down(&mut self) {
        let o = cli(&self.state, &["down"]);
        assert!(o.status.success(), "down failed: {}", stderr(&o));
        if let Some(d) = self.daemon.as_mut() {
            assert_eq!(d.wait_exit(Duration::from_secs(60)), Some(0), "{}", d.log());
        }
        let left = containers(&self.run);
        assert!(left.is_empty(), "left after down: {left:#?}");
    }
}

impl Drop for World {
    fn drop(&mut self) {
        drop(self.daemon.take());
        remove_run(&self.run);
    }
}

/// Each node's current (attempt, container) from the engine, by slot; panics
/// if a slot has more than one.
fn one_per_slot(run: &str) -> BTreeMap<String, Container> {
    by_slot(run)
        .into_iter()
        .map(|(slot, mut cs)| {
            assert_eq!(
                cs.len(),
                1,
                "slot {slot} has {} containers: {cs:#?}",
                cs.len()
            );
            (slot, cs.remove(0))
        })
        .collect()
}

fn attempts(s: &ClusterSnapshot) -> BTreeMap<String, u64> {
    s.nodes
        .iter()
        .map(|n| (n.node.to_string(), n.attempt.0))
        .collect()
}

fn describe(state: &Path, node: &str) -> String {
    let o = cli(state, &["describe", node]);
    format!("{}{}", stdout(&o), stderr(&o))
}

#[test]
fn four_nodes_converge_as_containers_that_status_names_and_down_removes() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("four");
    w.up(&docker_shape(
        &w.run,
        4,
        "[group.params]\nmemory_mb = 256\n",
    ));
    let snap = w.converged(4);
    let live = one_per_slot(&w.run);
    assert_eq!(live.len(), 4);
    for n in &snap.nodes {
        let c = &live[&n.node.to_string()];
        assert_eq!(c.state, "running", "{c:?}");
        assert_eq!(c.attempt, n.attempt.0, "{c:?} vs {n:?}");
        // `status` names each node's container by the engine's id.
        assert_eq!(
            n.resource.as_deref(),
            Some(format!("container {}", &c.id[..12]).as_str()),
            "{n:?}"
        );
    }
    let shown = cli(&w.state, &["status"]);
    let text = stdout(&shown);
    assert!(text.contains("RESOURCE"), "{text}");
    for c in live.values() {
        assert!(text.contains(&c.id[..12]), "{text}");
    }
    // Each container runs with the group's limit and the node's labels, on the host network.
    let c = &live["w-0"];
    let inspect = docker(&[
        "inspect",
        "--format",
        "{{.HostConfig.Memory}} {{.HostConfig.NetworkMode}} {{.HostConfig.RestartPolicy.Name}} {{index .Config.Labels \"swactor.group\"}}",
        &c.id,
    ]);
    assert_eq!(
        stdout(&inspect).trim(),
        format!("{} host no w", 256 * 1024 * 1024)
    );
    w.down();
}

#[test]
fn killed_paused_and_removed_containers_are_replaced_never_two_per_slot() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("faults");
    w.up(&docker_shape(&w.run, 4, ""));
    let before = attempts(&w.converged(4));
    let watcher = slot_watcher(&w.run);
    let live = one_per_slot(&w.run);
    // Out of band: killed, paused past the 1 s grace, removed.
    assert!(docker(&["kill", &live["w-0"].name]).status.success());
    assert!(docker(&["pause", &live["w-1"].name]).status.success());
    assert!(docker(&["rm", "-f", &live["w-2"].name]).status.success());
    let after = w.converged(4);
    let now = attempts(&after);
    let (doubles, count) = watcher.stop();
    assert_eq!(count, 0, "two containers for one slot: {doubles:#?}");
    for slot in ["w-0", "w-1", "w-2"] {
        assert!(now[slot] > before[slot], "{slot} was not replaced: {now:?}");
    }
    assert_eq!(now["w-3"], before["w-3"], "w-3 was touched: {now:?}");
    let live = one_per_slot(&w.run);
    // The paused container is gone, not left beside its replacement.
    assert!(live.values().all(|c| c.state == "running"), "{live:#?}");
    // Why each was replaced is on record.
    let killed = describe(&w.state, "w-0");
    assert!(
        killed.contains("was killed by signal 9 (SIGKILL)"),
        "{killed}"
    );
    let paused = describe(&w.state, "w-1");
    assert!(paused.contains("stayed away past its grace"), "{paused}");
    w.down();
}

#[test]
fn scaling_four_to_one_removes_the_highest_slots_containers() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("scale");
    w.up(&docker_shape(&w.run, 4, ""));
    let before = one_per_slot(&w.run);
    w.converged(4);
    let before = if before.len() == 4 {
        before
    } else {
        one_per_slot(&w.run)
    };
    let o = w.apply(&docker_shape(&w.run, 1, ""));
    assert!(o.status.success(), "{}", stderr(&o));
    w.converged(1);
    wait_for(
        Duration::from_secs(30),
        "the removed slots' containers to go",
        || containers(&w.run).len() == 1,
    );
    let live = one_per_slot(&w.run);
    assert_eq!(live.keys().collect::<Vec<_>>(), ["w-0"]);
    assert_eq!(live["w-0"].id, before["w-0"].id, "w-0 was replaced");
    w.down();
}

#[test]
fn a_daemon_killed_at_any_point_adopts_its_containers_instead_of_making_more() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("adopt");
    let body = docker_shape(&w.run, 3, "");
    w.up(&body);
    let watcher = slot_watcher(&w.run);
    // Mid-creation: the kill lands while containers are being made and started.
    std::thread::sleep(Duration::from_millis(300));
    w.daemon.as_mut().unwrap().kill9();
    w.up(&body);
    let first = w.converged(3);
    let live = one_per_slot(&w.run);
    // Converged: a kill now must be followed by adoption, not replacement.
    w.daemon.as_mut().unwrap().kill9();
    w.up(&body);
    let second = w.converged(3);
    assert_eq!(attempts(&first), attempts(&second), "nodes were replaced");
    let again = one_per_slot(&w.run);
    let ids =
        |m: &BTreeMap<String, Container>| m.values().map(|c| c.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&live), ids(&again), "containers were made anew");
    let (doubles, count) = watcher.stop();
    assert_eq!(count, 0, "two containers for one slot: {doubles:#?}");
    w.down();
}

#[test]
fn containers_whose_daemon_is_gone_for_good_stop_once_their_lease_lapses() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("orphan");
    // Long enough for a restart to rejoin its agents on a loaded machine
    // (the suite runs several docker tests at once on two cores).
    const LEASE_S: u64 = 8;
    let body = docker_shape(&w.run, 2, &format!("orphan_after_s = {LEASE_S}\n"));
    w.up(&body);
    let before = w.converged(2);
    let running = |w: &World| {
        let mut cs: Vec<(String, u64)> = containers(&w.run)
            .into_iter()
            .filter(|c| c.state == "running")
            .map(|c| (c.id, c.attempt))
            .collect();
        cs.sort();
        cs
    };
    let held = running(&w);
    assert_eq!(held.len(), 2);

    // Back within the lease: every node adopted, the same containers
    // running, nothing made.
    w.daemon.as_mut().unwrap().kill9();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    w.up(&body);
    std::thread::sleep(Duration::from_secs(LEASE_S + 3).saturating_sub(killed.elapsed()));
    let back = w.converged(2);
    assert_eq!(
        attempts(&back),
        attempts(&before),
        "adopted, not made again"
    );
    assert_eq!(running(&w), held, "the same containers, all running");

    // Gone for good: each container ends with its agent.
    w.daemon.as_mut().unwrap().kill9();
    let killed = Instant::now();
    wait_for(
        Duration::from_secs(LEASE_S + 3),
        "every container to stop",
        || {
            let cs = containers(&w.run);
            cs.len() == 2 && cs.iter().all(|c| c.state != "running")
        },
    );
    let stopped = killed.elapsed();
    assert!(
        stopped >= Duration::from_secs(LEASE_S - 2),
        "stopped before the lease could lapse: {stopped:?}"
    );
    // A daemon started afterwards brings each node back once, one running
    // container per slot (a stopped container is its node's lease: it is
    // started again, as after any agent that exited).
    w.up(&body);
    let watcher = slot_watcher(&w.run);
    let after = w.converged(2);
    let live = one_per_slot(&w.run);
    for n in &after.nodes {
        let c = &live[&n.node.to_string()];
        assert_eq!(
            (c.attempt, c.state.as_str()),
            (n.attempt.0, "running"),
            "{live:#?}"
        );
    }
    assert_eq!(attempts(&before).len(), 2);
    let (doubles, count) = watcher.stop();
    assert_eq!(count, 0, "two containers for one slot: {doubles:#?}");
    w.down();
}

#[test]
fn no_account_key_and_no_daemon_secret_reach_a_container() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("nokeys");
    let f = w.file(&docker_shape(&w.run, 2, ""));
    // The daemon has the account's key in its environment; nothing rents,
    // and nothing dials out (the service's address is a closed loopback port).
    let key = format!("vastkey-{}", std::process::id());
    let agent = agent_binary();
    let d = Daemon::spawn_env(
        &w.state,
        Some(&f),
        &["--agent-binary", agent.to_str().unwrap()],
        &[("VAST_API_KEY", &key), ("VAST_URL", "http://127.0.0.1:9")],
    )
    .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    w.daemon = Some(d);
    w.converged(2);
    let secret = std::fs::read(w.state.join("token.secret")).unwrap();
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    for c in one_per_slot(&w.run).values() {
        let o = docker(&["inspect", "-f", "{{json .Config}}", &c.id]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let config = String::from_utf8_lossy(&o.stdout);
        assert!(config.contains("swactor"), "{config}");
        assert!(
            !config.contains(&key),
            "the account key is in {}: {config}",
            c.name
        );
        assert!(
            !config.contains(&hex),
            "the daemon's secret is in {}: {config}",
            c.name
        );
    }
    w.down();
}

#[test]
fn changed_environment_replaces_each_container_after_its_cleanup() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("drift");
    w.up(&docker_shape(&w.run, 2, "env = { COLOUR = \"red\" }\n"));
    let before = attempts(&w.converged(2));
    let watcher = slot_watcher(&w.run);
    let o = w.apply(&docker_shape(&w.run, 2, "env = { COLOUR = \"blue\" }\n"));
    assert!(o.status.success(), "{}", stderr(&o));
    let snap = match try_wait_converged(&w.state, Duration::from_secs(120), |s| {
        s.nodes.len() == 2
            && s.nodes
                .iter()
                .all(|n| n.ready && n.attempt.0 > before[&n.node.to_string()])
    }) {
        Ok(s) => s,
        Err(last) => panic!("not replaced: {last:#?}\n{}", w.log()),
    };
    let (doubles, count) = watcher.stop();
    assert_eq!(count, 0, "two containers for one slot: {doubles:#?}");
    for (slot, c) in one_per_slot(&w.run) {
        let env = docker(&["inspect", "--format", "{{json .Config.Env}}", &c.id]);
        assert!(
            stdout(&env).contains("COLOUR=blue"),
            "{slot}: {}",
            stdout(&env)
        );
        assert_eq!(c.attempt, attempts(&snap)[&slot]);
    }
    w.down();
}

#[test]
fn twenty_nodes_converge_on_one_engine() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("twenty");
    // The agent image is built before the clock starts: this measures nodes, not the build.
    w.up(&docker_shape(&w.run, 1, ""));
    w.converged(1);
    let started = Instant::now();
    let o = w.apply(&docker_shape(&w.run, 20, ""));
    assert!(o.status.success(), "{}", stderr(&o));
    w.converged(20);
    let took = started.elapsed();
    eprintln!("docker: 19 more nodes (20 in all) converged in {took:.1?}");
    assert_eq!(one_per_slot(&w.run).len(), 20);
    w.down();
}

#[test]
fn a_missing_image_is_a_per_node_reason_with_backoff_and_nothing_is_left() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("noimage");
    w.up(&docker_shape(
        &w.run,
        2,
        "[group.params]\nimage = \"swactor-test-no-such-image:0\"\n",
    ));
    let reason = "is not on the Docker engine";
    wait_for(Duration::from_secs(30), "the reason in status", || {
        status(&w.state).is_some_and(|s| {
            s.nodes.len() == 2
                && s.nodes
                    .iter()
                    .all(|n| n.last_error.as_deref().is_some_and(|e| e.contains(reason)))
        })
    });
    let first = status(&w.state).unwrap();
    std::thread::sleep(Duration::from_secs(8));
    let later = status(&w.state).unwrap();
    // Backing off: a handful of tries in 8 s, not a hot loop.
    let tries = |s: &ClusterSnapshot| s.nodes.iter().map(|n| n.failures).sum::<u32>();
    assert!(
        tries(&later) - tries(&first) <= 8,
        "{} tries in 8 s: {later:#?}",
        tries(&later) - tries(&first)
    );
    assert!(containers(&w.run).is_empty(), "{:#?}", containers(&w.run));
    w.down();
}

#[test]
fn an_engine_that_does_not_answer_is_a_per_node_reason_and_down_still_ends() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("noengine");
    let socket = w.dir.join("no-engine.sock");
    let host = format!("unix://{}", socket.display());
    let f = w.file(&docker_shape(&w.run, 2, ""));
    let agent = agent_binary();
    w.daemon = Some(
        Daemon::spawn_env(
            &w.state,
            Some(&f),
            &["--agent-binary", agent.to_str().unwrap()],
            &[("DOCKER_HOST", host.as_str())],
        )
        .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log)),
    );
    wait_for(Duration::from_secs(30), "the reason in status", || {
        status(&w.state).is_some_and(|s| {
            s.nodes.len() == 2
                && s.nodes.iter().all(|n| {
                    n.last_error.as_deref().is_some_and(|e| {
                        e.contains("cannot reach the Docker engine") && e.contains("no-engine.sock")
                    })
                })
        })
    });
    let o = cli(&w.state, &["down"]);
    assert!(o.status.success(), "down failed: {}", stderr(&o));
    let d = w.daemon.as_mut().unwrap();
    assert_eq!(d.wait_exit(Duration::from_secs(60)), Some(0), "{}", d.log());
}

#[test]
fn bad_container_settings_are_refused_before_anything_starts() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("bad");
    let cases = [
        ("[group.params]\nmemory_mb = 8\n", "`memory_mb` is 8"),
        (
            "[group.params]\nmounts = [\"/no/such/swactor/path:/data\"]\n",
            "/no/such/swactor/path",
        ),
        (
            "env = { \"1BAD\" = \"x\" }\n",
            "environment variable name \"1BAD\" is invalid",
        ),
        (
            "[group.params]\nmemroy_mb = 64\n",
            "unknown parameter `memroy_mb`",
        ),
    ];
    let agent = agent_binary();
    for (extra, expected) in cases {
        let f = w.file(&docker_shape(&w.run, 1, extra));
        let Err(exited) = Daemon::spawn_with(
            &w.state,
            Some(&f),
            &["--agent-binary", agent.to_str().unwrap()],
        ) else {
            panic!("a daemon started with {extra:?}");
        };
        assert_ne!(exited.code, Some(0));
        assert!(exited.log.contains(expected), "{extra:?}: {}", exited.log);
        assert!(exited.log.contains("nothing was changed"), "{}", exited.log);
    }
    // The same shapes are refused by `apply` to a running daemon.
    w.up(&docker_shape(&w.run, 1, ""));
    w.converged(1);
    for (extra, expected) in cases {
        let o = w.apply(&docker_shape(&w.run, 1, extra));
        assert!(!o.status.success());
        assert!(stderr(&o).contains(expected), "{extra:?}: {}", stderr(&o));
    }
    assert_eq!(containers(&w.run).len(), 1);
    w.down();
}

#[test]
fn swactor_logs_shows_a_docker_node_s_container_log_and_follows_it_until_the_container_stops() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("logs");
    w.up(&docker_shape(&w.run, 1, ""));
    let snap = w.converged(1);
    let attempt = snap.nodes[0].attempt;
    let container = one_per_slot(&w.run)["w-0"].name.clone();

    // `describe` points at `swactor logs`, and that shows what `docker logs` does.
    assert!(describe(&w.state, "w-0").contains("swactor logs w-0"));
    let o = cli(&w.state, &["logs", "w-0"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let shown = stdout(&o);
    let engine = docker(&["logs", &container]);
    for line in stdout(&engine)
        .lines()
        .chain(stderr(&engine).lines())
        .take(3)
    {
        assert!(shown.contains(line), "{line:?} is not in:\n{shown}");
    }
    assert!(!shown.is_empty(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("w-0 attempt {attempt} (docker node")),
        "{}",
        stderr(&o)
    );

    // --follow ends once the container has stopped.
    let mut follow = std::process::Command::new(BIN)
        .args(["logs", "w-0", "-f", "--state-dir"])
        .arg(&w.state)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(docker(&["stop", "-t", "1", &container]).status.success());
    let started = Instant::now();
    while follow.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "`logs --follow` outlived its container"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = follow.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with(&shown), "{}", stdout(&o));
    assert!(stderr(&o).contains("has ended"), "{}", stderr(&o));

    // The stopped attempt is replaced; its log went with its container,
    // which is said instead of "no process node".
    let after = w.converged(1);
    assert_ne!(after.nodes[0].attempt, attempt);
    let o = cli(
        &w.state,
        &["logs", "w-0", "--attempt", &attempt.0.to_string()],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not w-0's current attempt"),
        "{}",
        stderr(&o)
    );
    w.down();
}

#[test]
fn a_plain_up_after_a_kill_9_uploads_the_agent_binary_the_last_up_was_given() {
    if !engine_up() {
        return;
    }
    let mut w = World::new("keepbin");
    // A binary of its own content (trailing bytes change no ELF), so its
    // image is told from the one of the build's `swactor-agent`, which a
    // daemon finds next to its executable when it is given none.
    let agent = w.dir.join("bin/agent");
    std::fs::create_dir_all(agent.parent().unwrap()).unwrap();
    let mut bytes = std::fs::read(agent_binary()).unwrap();
    bytes.extend_from_slice(b"\nkept-agent-binary-test\n");
    std::fs::write(&agent, bytes).unwrap();
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let f = w.file(&docker_shape(&w.run, 1, ""));
    let d = Daemon::spawn_with(
        &w.state,
        Some(&f),
        &["--agent-binary", agent.to_str().unwrap()],
    )
    .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
    w.daemon = Some(d);
    let before = w.converged(1).nodes[0].attempt;
    let image_of =
        |name: &str| stdout(&docker(&["inspect", "--format", "{{.Config.Image}}", name]));
    let first = one_per_slot(&w.run)["w-0"].clone();
    let image = image_of(&first.name);

    // kill -9, the node's container removed meanwhile (a stopped one would
    // be started again), and `up` with nothing else.
    w.daemon.as_mut().unwrap().kill9();
    assert!(docker(&["rm", "-f", &first.name]).status.success());
    let d = Daemon::spawn(&w.state, None)
        .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
    w.daemon = Some(d);
    let replaced = try_wait_converged(&w.state, Duration::from_secs(120), |s| {
        s.nodes.len() == 1 && s.nodes[0].ready && s.nodes[0].attempt > before
    });
    assert!(
        replaced.is_ok(),
        "w-0 was not replaced: {replaced:#?}\ndaemon log:\n{}",
        w.log()
    );
    let replacement = one_per_slot(&w.run)["w-0"].clone();
    assert_eq!(
        image_of(&replacement.name),
        image,
        "the replacement runs another agent binary; daemon log:\n{}",
        w.log()
    );
    assert!(
        w.daemon.as_ref().unwrap().last_log().contains(&format!(
            "agent binary {}, as the last daemon",
            agent.display()
        )),
        "{}",
        w.log()
    );
    w.down();
}

/// Issue 30, fix 2, on one engine: two daemons with the same run and state
/// directories of their own. Each names and labels its containers with its
/// own deployment, never adopts or removes the other's, lists them as
/// foreign, and `down` on one leaves the other's running and unreplaced.
#[test]
fn two_deployments_of_one_run_on_one_engine_never_touch_each_other() {
    if !engine_up() {
        return;
    }
    let w = World::new("twodep");
    let body = docker_shape(&w.run, 2, "");
    let shape = shape_file(&w.dir, "two.toml", &body);
    let agent = agent_binary();
    let (a, b) = (w.dir.join("state-a"), w.dir.join("state-b"));
    let up = |state: &Path| {
        Daemon::spawn_with(
            state,
            Some(&shape),
            &["--agent-binary", agent.to_str().unwrap()],
        )
        .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log))
    };
    let ready = |state: &Path, d: &Daemon| {
        try_wait_converged(state, Duration::from_secs(120), |s| {
            s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
        })
        .unwrap_or_else(|last| panic!("not converged: {last:#?}\n{}", d.log()))
    };
    let mut da = up(&a);
    let first_a = ready(&a, &da);
    let mut db = up(&b);
    let first_b = ready(&b, &db);
    let (dep_a, dep_b) = (deployment_of(&a), deployment_of(&b));
    assert_ne!(dep_a, dep_b);
    let names = || -> Vec<String> { containers(&w.run).into_iter().map(|c| c.name).collect() };
    let all = names();
    assert_eq!(all.len(), 4, "{all:?}\n{}\n{}", da.log(), db.log());
    for dep in [&dep_a, &dep_b] {
        assert_eq!(
            all.iter()
                .filter(|n| n.ends_with(&format!("_{dep}")))
                .count(),
            2,
            "{all:?}"
        );
    }
    // B, started second, lists A's two as foreign.
    let text = stdout(&cli(&b, &["status"]));
    assert!(
        text.contains(&format!("foreign: 2 resource(s) of run {}", w.run))
            && text.contains(&format!("deployment {dep_a}")),
        "{text}"
    );
    // A restart of A adopts its own two only.
    da.kill9();
    drop(da);
    let mut da = up(&a);
    assert_eq!(
        attempts(&ready(&a, &da)),
        attempts(&first_a),
        "{}",
        da.log()
    );
    assert_eq!(names().len(), 4);
    // `down` on A removes A's containers only; B's run on.
    let o = cli(&a, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        da.wait_exit(Duration::from_secs(60)),
        Some(0),
        "{}",
        da.log()
    );
    let left = names();
    assert!(
        left.len() == 2 && left.iter().all(|n| n.ends_with(&format!("_{dep_b}"))),
        "{left:?}"
    );
    assert!(containers(&w.run).iter().all(|c| c.state == "running"));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        attempts(&ready(&b, &db)),
        attempts(&first_b),
        "{}",
        db.log()
    );
    let o = cli(&b, &["down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        db.wait_exit(Duration::from_secs(60)),
        Some(0),
        "{}",
        db.log()
    );
    assert!(containers(&w.run).is_empty());
}
