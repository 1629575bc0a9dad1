//! The `ssh` provider end to end: real daemons, real OpenSSH servers on
//! 127.0.0.1 (each a host with a home of its own), real agents started over
//! SSH that join the daemon over iroh.
//!
//! Hosts accept the daemon's own key (`swactor ssh-key`). The agent binary
//! the daemon uploads is a small script that runs this build's `swactor`
//! (the hosts are this machine), except in the test that uploads the real
//! binary.

use crate::common;

use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;
use swactor_providers::ssh::testing::{NetNs, Sshd};

const CONVERGE: Duration = Duration::from_secs(60);

struct Pool {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
    hosts: Vec<Sshd>,
    agent: PathBuf,
}

impl Pool {
    /// `n` hosts that accept the daemon's key.
    fn new(n: usize) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let state = root.join("state");
        let o = cli(&state, &["ssh-key"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let key = stdout(&o).trim().to_owned();
        assert!(key.starts_with("ssh-ed25519 "), "{key}");
        let hosts = (0..n)
            .map(|i| {
                let dir = root.join(format!("host{i}"));
                std::fs::create_dir_all(&dir).unwrap();
                Sshd::start(&dir, std::slice::from_ref(&key))
            })
            .collect();
        // The hosts are this machine: the uploaded agent runs this build.
        let agent = root.join("agent.sh");
        std::fs::write(&agent, format!("#!/bin/sh\nexec {BIN} \"$@\"\n")).unwrap();
        Self {
            _tmp: tmp,
            root,
            state,
            hosts,
            agent,
        }
    }

    fn targets(&self, which: &[usize]) -> String {
        which
            .iter()
            .map(|i| format!("\"{}\"", self.hosts[*i].target()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// A shape of `count` nodes over the hosts `which`, with `params` added.
    fn shape(&self, name: &str, count: u32, which: &[usize], params: &str) -> PathBuf {
        shape_file(
            &self.root,
            name,
            &format!(
                "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"ssh\"\n\
                 hosts = [{}]\nboot_check = [\"true\"]\nlost_grace_s = 2\n\
                 [group.params]\ntrust_on_first_use = true\nunreachable_give_up_s = 3\n{params}",
                self.targets(which)
            ),
        )
    }

    fn up(&self, shape: &Path) -> Daemon {
        self.up_with(Some(shape), &self.agent)
    }

    fn up_with(&self, shape: Option<&Path>, agent: &Path) -> Daemon {
        let agent = agent.to_str().unwrap();
        Daemon::spawn_with(&self.state, shape, &["--agent-binary", agent])
            .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log))
    }

    /// The host's home.
    fn home(&self, i: usize) -> PathBuf {
        self.hosts[i].home()
    }

    fn claim(&self, i: usize) -> Option<String> {
        std::fs::read_to_string(self.home(i).join(".swactor/claim")).ok()
    }

    /// Live agents on host `i`: attempt directory name → pids.
    fn agents_on(&self, i: usize) -> BTreeMap<String, Vec<u32>> {
        let Ok(want) = self.home(i).canonicalize() else {
            return BTreeMap::new();
        };
        let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (pid, cwd) in agent_cwds() {
            if let Ok(rest) = cwd.strip_prefix(want.join(".swactor/nodes/ssh")) {
                out.entry(rest.display().to_string()).or_default().push(pid);
            }
        }
        out
    }

    /// Live agents on every host.
    fn all_agents(&self) -> Vec<(usize, String, Vec<u32>)> {
        (0..self.hosts.len())
            .flat_map(|i| {
                self.agents_on(i)
                    .into_iter()
                    .map(move |(dir, pids)| (i, dir, pids))
            })
            .collect()
    }

    /// The claim file of `node`'s `attempt`, made by this pool's daemon
    /// (whose deployment it names).
    fn claim_of(&self, node: &str, attempt: u64) -> String {
        format!(
            "swactor-claim run=ssh node={node} attempt={attempt} deployment={}\n",
            deployment_of(&self.state)
        )
    }

    /// The host holding `node`'s current attempt, from its claim.
    fn host_of(&self, node: &str, attempt: u64) -> Option<usize> {
        let line = self.claim_of(node, attempt);
        (0..self.hosts.len()).find(|i| self.claim(*i).as_deref() == Some(line.as_str()))
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // The agents are processes of this machine: stop what a test left.
        for (_, _, pids) in self.all_agents() {
            for pid in pids {
                kill9(pid);
            }
        }
    }
}

fn node<'a>(s: &'a ClusterSnapshot, name: &str) -> &'a swactor_actors::NodeSummary {
    s.nodes
        .iter()
        .find(|n| n.node.to_string() == name)
        .unwrap_or_else(|| panic!("no {name} in {s:#?}"))
}

/// Polls `status` until `pred` holds; returns the last snapshot.
fn wait_status(
    state: &Path,
    timeout: Duration,
    what: &str,
    mut pred: impl FnMut(&ClusterSnapshot) -> bool,
) -> ClusterSnapshot {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < timeout {
        if let Some(s) = status(state) {
            if pred(&s) {
                return s;
            }
            last = Some(s);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out after {timeout:?} waiting for {what}; last status: {last:#?}");
}

/// One live agent per node, each its slot's current attempt, on the host
/// that holds its claim; no other agent anywhere.
fn one_agent_per_node(pool: &Pool, snap: &ClusterSnapshot) {
    let agents = pool.all_agents();
    assert_eq!(agents.len(), snap.nodes.len(), "{agents:?}");
    for n in &snap.nodes {
        let dir = format!("{}-{}", n.node, n.attempt);
        let host = pool
            .host_of(&n.node.to_string(), n.attempt.0)
            .unwrap_or_else(|| panic!("no claim for {dir}"));
        let here: Vec<_> = agents
            .iter()
            .filter(|(i, d, _)| *i == host && *d == dir)
            .collect();
        assert_eq!(here.len(), 1, "{dir} on host {host}: {agents:?}");
        assert_eq!(here[0].2.len(), 1, "{dir}: {agents:?}");
    }
}

fn down_leaves_nothing(pool: &Pool, d: &mut Daemon, purge: bool) {
    let args: &[&str] = if purge {
        &["down", "--purge"]
    } else {
        &["down"]
    };
    let o = cli(&pool.state, args);
    assert!(o.status.success(), "{}", stderr(&o));
    d.wait_exit(Duration::from_secs(30));
    for i in 0..pool.hosts.len() {
        assert_eq!(pool.claim(i), None, "host {i} still claimed");
        assert!(pool.agents_on(i).is_empty(), "agents left on host {i}");
        let nodes = pool.home(i).join(".swactor/nodes/ssh");
        let left: Vec<_> = std::fs::read_dir(&nodes)
            .into_iter()
            .flatten()
            .flatten()
            .collect();
        assert!(
            left.is_empty(),
            "attempt directories left on host {i}: {left:?}"
        );
        if purge {
            assert!(
                !pool.home(i).join(".swactor").exists(),
                "host {i} not purged"
            );
        }
    }
}

#[test]
fn a_pool_of_three_hosts_converges_with_the_real_agent_and_down_purge_leaves_nothing() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(3);
    let shape = pool.shape("three.toml", 3, &[0, 1, 2], "");
    // The real binary this time: uploaded once per host, checked by content.
    // `SWACTOR_TEST_AGENT_BINARY` names another (e.g. the static build of
    // scripts/build-static-agent.sh) to try it end to end.
    let agent = std::env::var("SWACTOR_TEST_AGENT_BINARY").unwrap_or_else(|_| BIN.to_owned());
    let started = Instant::now();
    let mut d = pool.up_with(Some(&shape), Path::new(&agent));
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 3);
    eprintln!(
        "3 hosts converged in {:?} (the {} MB agent {agent} uploaded to each)",
        started.elapsed(),
        std::fs::metadata(&agent).unwrap().len() >> 20
    );
    one_agent_per_node(&pool, &snap);
    // `status` names each node's host.
    for n in &snap.nodes {
        let host = pool.host_of(&n.node.to_string(), n.attempt.0).unwrap();
        let shown = format!("host {}", pool.hosts[host].target());
        assert_eq!(n.resource.as_deref(), Some(shown.as_str()), "{n:?}");
    }
    for i in 0..3 {
        assert!(pool.claim(i).is_some(), "host {i} holds a node");
        let bins: Vec<_> = std::fs::read_dir(pool.home(i).join(".swactor/bin"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(bins.len(), 1, "one cached agent binary on host {i}");
    }
    down_leaves_nothing(&pool, &mut d, true);
}

#[test]
fn a_killed_remote_agent_is_replaced_and_a_restarted_daemon_adopts_without_a_second_start() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(3);
    let shape = pool.shape("two.toml", 2, &[0, 1, 2], "");
    let mut d = pool.up(&shape);
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 2);
    one_agent_per_node(&pool, &snap);
    let before = node(&snap, "w-0").attempt;
    let host = pool.host_of("w-0", before.0).unwrap();
    let victim = pool.agents_on(host)[&format!("w-0-{before}")][0];
    kill9(victim);
    let snap = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 2 && node(s, "w-0").attempt != before
    });
    one_agent_per_node(&pool, &snap);
    assert!(
        !pool
            .home(host)
            .join(format!(".swactor/nodes/ssh/w-0-{before}"))
            .exists(),
        "the replaced attempt's directory is gone"
    );

    // kill -9 the daemon; a new one adopts the remote agents as they are.
    let agents_before = pool.all_agents();
    d.kill9();
    let mut d = pool.up_with(None, &pool.agent);
    let snap = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
    });
    assert_eq!(
        pool.all_agents(),
        agents_before,
        "no agent was started again"
    );
    one_agent_per_node(&pool, &snap);
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn a_host_that_goes_down_is_given_up_its_node_placed_elsewhere_and_nothing_is_left_when_it_is_back()
{
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut pool = Pool::new(2);
    let shape = pool.shape("one.toml", 1, &[0, 1], "");
    let mut d = pool.up(&shape);
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 1);
    let first = node(&snap, "w-0").attempt;
    let host = pool.host_of("w-0", first.0).unwrap();
    // The machine goes down: its SSH server and its agent.
    pool.hosts[host].stop();
    for pid in pool.agents_on(host).into_values().flatten() {
        kill9(pid);
    }
    let down = Instant::now();
    let snap = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 1 && node(s, "w-0").attempt != first
    });
    eprintln!("replaced on the other host after {:?}", down.elapsed());
    let now = node(&snap, "w-0").attempt;
    assert_eq!(pool.host_of("w-0", now.0), Some(1 - host));
    // The old attempt was given up, not destroyed, and people are told:
    // a line in the daemon's output, and a note in the node's history.
    let target = pool.hosts[host].target().to_string();
    let line = format!("gave up releasing w-0 {first}: {target} has not answered");
    wait_for(Duration::from_secs(10), "the give-up to be told", || {
        d.log().contains(&line)
    });
    let described = cli(&pool.state, &["describe", "w-0"]);
    let text = stdout(&described);
    assert!(
        text.contains("left behind:") && text.contains(&target),
        "{text}{}",
        stderr(&described)
    );
    // The host comes back holding the old claim: it is cleaned, not listed.
    pool.hosts[host].start_again();
    wait_for(
        Duration::from_secs(30),
        "the old claim to be released",
        || pool.claim(host).is_none(),
    );
    assert!(
        !pool
            .home(host)
            .join(format!(".swactor/nodes/ssh/w-0-{first}"))
            .exists()
    );
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 1);
    assert_eq!(
        node(&snap, "w-0").attempt,
        now,
        "the live node was left alone"
    );
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn hosts_whose_daemon_is_gone_for_good_are_freed_by_their_agents_once_the_lease_lapses() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    // Long enough for a daemon started again 2 s after a kill to answer
    // its agents on a loaded machine (an answer holds the lease).
    const LEASE_S: u64 = 8;
    let pool = Pool::new(2);
    let shape = pool.shape("two.toml", 2, &[0, 1], "");
    // The lease is a group field: it goes before the group's params.
    let body = std::fs::read_to_string(&shape).unwrap().replace(
        "[group.params]",
        &format!("orphan_after_s = {LEASE_S}\n[group.params]"),
    );
    std::fs::write(&shape, body).unwrap();
    let mut d = pool.up(&shape);
    let snap = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
    });
    one_agent_per_node(&pool, &snap);
    let claims = (pool.claim(0), pool.claim(1));
    assert!(claims.0.is_some() && claims.1.is_some());
    let agents = pool.all_agents();

    // Back within the lease: every node adopted, the same agents, the same
    // claims, nothing made.
    d.kill9();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let mut d = pool.up(&shape);
    std::thread::sleep(Duration::from_secs(LEASE_S + 3).saturating_sub(killed.elapsed()));
    let back = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 2 && s.nodes.iter().all(|n| n.ready)
    });
    for n in &back.nodes {
        assert_eq!(
            node(&snap, &n.node.to_string()).attempt,
            n.attempt,
            "{back:#?}"
        );
    }
    assert_eq!(pool.all_agents(), agents, "the same agents");
    assert_eq!((pool.claim(0), pool.claim(1)), claims, "the same claims");

    // Gone for good: each agent frees its host.
    d.kill9();
    let killed = Instant::now();
    wait_for(
        Duration::from_secs(LEASE_S + 3),
        "both hosts free, with no agent and no attempt directory",
        || {
            (0..2).all(|h| {
                pool.claim(h).is_none()
                    && pool.agents_on(h).is_empty()
                    && std::fs::read_dir(pool.home(h).join(".swactor/nodes/ssh"))
                        .map_or(true, |mut e| e.next().is_none())
            })
        },
    );
    let freed = killed.elapsed();
    eprintln!("both hosts free {freed:?} after the daemon was killed");
    assert!(
        freed >= Duration::from_secs(LEASE_S - 2),
        "freed before the lease could lapse: {freed:?}"
    );
    // A daemon started afterwards finds both hosts free and makes each node
    // once more.
    let mut d = pool.up_with(None, &pool.agent);
    let after = wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 2
            && s.nodes.iter().all(|n| {
                n.ready
                    && snap
                        .nodes
                        .iter()
                        .any(|b| b.node == n.node && b.attempt != n.attempt)
            })
    });
    one_agent_per_node(&pool, &after);
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn no_account_key_and_no_daemon_secret_reach_an_ssh_host() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(1);
    let shape = pool.shape("one.toml", 1, &[0], "");
    let key = format!("vastkey-{}", std::process::id());
    let agent = pool.agent.to_str().unwrap().to_owned();
    let _d = Daemon::spawn_env(
        &pool.state,
        Some(&shape),
        &["--agent-binary", &agent],
        &[("VAST_API_KEY", &key), ("VAST_URL", "http://127.0.0.1:9")],
    )
    .unwrap_or_else(|e| panic!("the daemon exited: {}", e.log));
    wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 1 && s.nodes.iter().all(|n| n.ready)
    });
    let secret = std::fs::read(pool.state.join("token.secret")).unwrap();
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let agents = pool.agents_on(0);
    assert_eq!(agents.len(), 1, "{agents:?}");
    for pid in agents.values().flatten() {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        for (what, needle) in [
            ("the account key", key.as_bytes()),
            ("the daemon's secret", &secret[..]),
            ("the daemon's secret in hex", hex.as_bytes()),
        ] {
            assert!(
                !holds(&environ, needle),
                "{what} is in the agent's environment"
            );
            assert!(!holds(&argv, needle), "{what} is in the agent's arguments");
        }
    }
    // Nor in anything the host keeps for the node.
    for (path, bytes) in files_under(&pool.home(0).join(".swactor/nodes")) {
        assert!(
            !holds(&bytes, key.as_bytes()),
            "the account key is in {}",
            path.display()
        );
        assert!(
            !holds(&bytes, &secret),
            "the daemon's secret is in {}",
            path.display()
        );
        assert!(
            !holds(&bytes, hex.as_bytes()),
            "the daemon's secret is in {}",
            path.display()
        );
    }
}

#[test]
fn a_changed_host_key_is_refused_naming_the_host_and_both_fingerprints() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut pool = Pool::new(1);
    let shape = pool.shape("one.toml", 1, &[0], "");
    let _d = pool.up(&shape);
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 1);
    let first = node(&snap, "w-0").attempt;
    let old = pool.hosts[0].host_key_fingerprint();
    pool.hosts[0].rotate_host_key();
    let new = pool.hosts[0].host_key_fingerprint();
    for pid in pool.agents_on(0).into_values().flatten() {
        kill9(pid);
    }
    let snap = wait_status(&pool.state, CONVERGE, "a host key error", |s| {
        node(s, "w-0")
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(&new))
    });
    let err = node(&snap, "w-0").last_error.clone().unwrap();
    assert!(
        err.contains(&pool.hosts[0].target().to_string())
            && err.contains(&old)
            && err.contains(&new),
        "{err}"
    );
    assert!(!node(&snap, "w-0").ready);
    // Nothing was started on the host that offered the other key.
    assert!(pool.agents_on(0).is_empty());
    assert_eq!(
        pool.claim(0).as_deref(),
        Some(pool.claim_of("w-0", first.0).as_str()),
        "the claim stays until the host is trusted again"
    );
}

#[test]
fn a_key_the_hosts_refuse_gets_a_clear_error_and_is_not_retried_in_a_hot_loop() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(1);
    // A key nobody authorised.
    let stranger = pool.root.join("stranger");
    let o = cli(&stranger, &["ssh-key"]);
    assert!(o.status.success());
    let key = stranger.join("ssh/id_ed25519");
    let shape = pool.shape(
        "stranger.toml",
        1,
        &[0],
        &format!("key = \"{}\"\n", key.display()),
    );
    let _d = pool.up(&shape);
    let snap = wait_status(&pool.state, CONVERGE, "an auth error", |s| {
        s.nodes
            .first()
            .and_then(|n| n.last_error.as_deref())
            .is_some_and(|e| e.contains("refused"))
    });
    let err = node(&snap, "w-0").last_error.clone().unwrap();
    assert!(err.contains("root@127.0.0.1"), "{err}");
    std::thread::sleep(Duration::from_secs(8));
    // Backoff: a handful of tries in those seconds, not hundreds.
    let tries = pool.hosts[0]
        .log()
        .matches("Connection closed by authenticating user")
        .count()
        .max(pool.hosts[0].log().matches("Failed publickey").count());
    assert!(
        (1..=8).contains(&tries),
        "{tries} tries: {}",
        pool.hosts[0].log()
    );
    assert_eq!(pool.claim(0), None);
}

#[test]
fn more_nodes_than_hosts_wait_for_a_free_host_and_converge_when_apply_adds_one() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(3);
    let two_hosts = pool.shape("two-hosts.toml", 3, &[0, 1], "");
    let mut d = pool.up(&two_hosts);
    let snap = wait_status(&pool.state, CONVERGE, "a node waiting for a host", |s| {
        s.nodes.iter().filter(|n| n.ready).count() == 2
            && s.nodes.iter().any(|n| {
                n.last_error.as_deref().is_some_and(|e| {
                    e.contains("waiting for a free host: 2 of the pool's 2 hosts are claimed")
                })
            })
    });
    assert!(!snap.converged);
    let placed = pool.all_agents();
    // Adding a host moves no node: only the waiting one goes there.
    let three_hosts = pool.shape("three-hosts.toml", 3, &[0, 1, 2], "");
    let o = cli(&pool.state, &["plan", three_hosts.to_str().unwrap()]);
    assert!(stdout(&o).contains("changes no node"), "{}", stdout(&o));
    let o = cli(&pool.state, &["apply", three_hosts.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let snap = wait_converged(&pool.state, Duration::from_secs(90), |s| s.nodes.len() == 3);
    one_agent_per_node(&pool, &snap);
    let after = pool.all_agents();
    for agent in &placed {
        assert!(after.contains(agent), "{agent:?} was moved: {after:?}");
    }
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn bad_host_entries_are_refused_offline_and_a_host_that_never_answers_is_named() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(1);
    let bad = shape_file(
        &pool.root,
        "bad.toml",
        "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"ssh\"\nhosts = [\"no-user-here:22\"]\n",
    );
    let o = cli(&pool.state, &["validate", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no-user-here:22"), "{}", stderr(&o));
    let none = shape_file(
        &pool.root,
        "none.toml",
        "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"ssh\"\n",
    );
    let o = cli(&pool.state, &["validate", none.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("lists no `hosts`"), "{}", stderr(&o));

    // A port nothing listens on: the node says so, and nothing is claimed.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let dead = shape_file(
        &pool.root,
        "dead.toml",
        &format!(
            "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"ssh\"\n\
             hosts = [\"root@127.0.0.1:{port}\"]\n[group.params]\ntrust_on_first_use = true\n"
        ),
    );
    let _d = pool.up(&dead);
    let snap = wait_status(&pool.state, CONVERGE, "a not-answering error", |s| {
        s.nodes
            .first()
            .and_then(|n| n.last_error.as_deref())
            .is_some_and(|e| e.contains("not answering"))
    });
    let err = node(&snap, "w-0").last_error.clone().unwrap();
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
}

#[test]
fn an_apply_sent_while_up_is_still_adopting_waits_and_is_not_overtaken_by_the_up_shape() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(2);
    // A host that accepts TCP and never says a word: listing it takes the
    // whole connect timeout, so the daemon adopts late.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in silent.incoming().flatten() {
            held.push(c);
        }
    });
    let shape = |name: &str, count: u32| {
        shape_file(
            &pool.root,
            name,
            &format!(
                "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = {count}\nprovider = \"ssh\"\n\
                 hosts = [{}, \"root@127.0.0.1:{silent_port}\"]\nboot_check = [\"true\"]\n\
                 [group.params]\ntrust_on_first_use = true\n",
                pool.targets(&[0, 1])
            ),
        )
    };
    let mut d = pool.up(&shape("one.toml", 1));
    let two = shape("two.toml", 2);
    let early = status(&pool.state).expect("status answers while the daemon adopts");
    assert!(
        !early.inventory_read,
        "the silent host did not hold adoption back"
    );
    let o = cli(&pool.state, &["apply", two.to_str().unwrap(), "--yes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stdout(&o) + &stderr(&o);
    // The apply went after the shape `up` was given, never before it.
    assert!(said.contains("generation 2"), "{said}");
    wait_status(&pool.state, CONVERGE, "adoption", |s| s.inventory_read);
    std::thread::sleep(Duration::from_millis(500));
    let s = status(&pool.state).unwrap();
    assert_eq!(
        (s.generation.0, s.desired_nodes),
        (2, 2),
        "the later apply was overtaken: {s:#?}"
    );
    let _ = cli(&pool.state, &["down"]);
    d.wait_exit(Duration::from_secs(30));
}

#[test]
fn an_agent_on_a_host_across_a_network_joins_the_daemon_at_its_advertised_address() {
    if !swactor_providers::ssh::testing::sshd_available() || !NetNs::available() {
        return;
    }
    // The host is a network namespace of its own, joined to this one by a
    // veth pair: its agent reaches the daemon through the pair's address,
    // not through loopback, as on a real remote machine.
    let ns = NetNs::create();
    let mut pool = Pool::new(0);
    let key = stdout(&cli(&pool.state, &["ssh-key"])).trim().to_owned();
    let dir = pool.root.join("remote");
    std::fs::create_dir_all(&dir).unwrap();
    pool.hosts.push(Sshd::start_in(&dir, &[key], &ns));
    let shape = pool.shape("remote.toml", 1, &[0], "");
    let outside = ns.outside.to_string();
    let agent = pool.agent.to_str().unwrap().to_owned();
    let mut d = Daemon::spawn_with(
        &pool.state,
        Some(&shape),
        &["--agent-binary", &agent, "--listen", &outside],
    )
    .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
    let snap = wait_status(&pool.state, CONVERGE, "the remote node to join", |s| {
        s.converged && s.nodes.len() == 1
    });
    one_agent_per_node(&pool, &snap);
    // The agent runs in the namespace: its connection to the daemon is on
    // the veth pair, from the namespace's address.
    let (_, _, pids) = pool.all_agents().into_iter().next().unwrap();
    let netns_of = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(
        netns_of(pids[0]),
        netns_of(std::process::id()),
        "the agent is not in the host's namespace"
    );
    // The records naming the hosts and how to reach them are the daemon
    // user's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let leases = pool.state.join("ssh/leases");
    assert_eq!(mode(&leases), 0o700);
    assert_eq!(mode(&leases.join("ssh")), 0o700);
    let records: Vec<_> = std::fs::read_dir(leases.join("ssh"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(mode(&records[0]), 0o600, "{}", records[0].display());

    // kill -9 the daemon and start it again naming no address: it listens
    // where the last one did, so the agent across the network rejoins it
    // (on 127.0.0.1 it could not, and the node would be replaced).
    let attempt = snap.nodes[0].attempt;
    let agents_before = pool.all_agents();
    d.kill9();
    let mut d = Daemon::spawn_with(&pool.state, None, &["--agent-binary", &agent])
        .unwrap_or_else(|e| panic!("the daemon exited ({:?}): {}", e.code, e.log));
    let snap = wait_status(&pool.state, CONVERGE, "the agent to rejoin", |s| {
        s.converged
            && s.nodes.len() == 1
            && s.nodes[0].agent == swactor_actors::AgentLink::Connected
    });
    assert_eq!(snap.nodes[0].attempt, attempt, "the node was replaced");
    assert_eq!(
        pool.all_agents(),
        agents_before,
        "no agent was started again"
    );
    assert!(
        d.log()
            .contains(&format!("listening on {outside}, as the last daemon")),
        "{}",
        d.log()
    );
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn a_missing_key_an_unknown_user_a_read_only_disk_and_a_failing_or_hanging_boot_check_each_say_why()
{
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(5);
    // Host 4's disk is read-only: its home is a read-only bind mount.
    let _read_only = ReadOnly::mount(&pool.home(4));
    let group = |id: &str, host: String, extra: &str, params: &str| {
        format!(
            "[[group]]\nid = \"{id}\"\ncount = 1\nprovider = \"ssh\"\nhosts = [\"{host}\"]\n\
             {extra}[group.params]\ntrust_on_first_use = true\n{params}"
        )
    };
    let target = |i: usize| pool.hosts[i].target().to_string();
    let port = |i: usize| pool.hosts[i].port();
    let body = [
        "run = \"ssh\"\n".to_owned(),
        group(
            "nokey",
            target(0),
            "",
            "key = \"/nonexistent/swactor-key\"\n",
        ),
        group(
            "nouser",
            format!("no-such-user@127.0.0.1:{}", port(1)),
            "",
            "",
        ),
        group(
            "bad",
            target(2),
            "boot_check = [\"sh\", \"-c\", \"echo the disk is too small >&2; exit 3\"]\n",
            "",
        ),
        group(
            "hang",
            target(3),
            "boot_check = [\"sleep\", \"60\"]\nboot_timeout_s = 1\n",
            "",
        ),
        group("rodisk", target(4), "", ""),
    ]
    .concat();
    let shape = shape_file(&pool.root, "broken.toml", &body);
    let o = cli(&pool.state, &["validate", shape.to_str().unwrap()]);
    assert!(o.status.success(), "offline checks pass: {}", stderr(&o));
    let mut d = pool.up(&shape);
    let want = [
        (
            "nokey-0",
            "cannot be used: root@127.0.0.1:{p0}: cannot use /nonexistent/swactor-key",
        ),
        (
            "nouser-0",
            "cannot be used: no-such-user@127.0.0.1:{p1} refused",
        ),
        ("bad-0", "the disk is too small"),
        ("hang-0", "did not finish within its boot_timeout_s of 1 s"),
        ("rodisk-0", "Read-only file system"),
    ];
    let want = want.map(|(n, why)| {
        let why = why
            .replace("{p0}", &port(0).to_string())
            .replace("{p1}", &port(1).to_string());
        (n, why)
    });
    let snap = wait_status(&pool.state, CONVERGE, "every node's reason", |s| {
        want.iter().all(|(n, why)| {
            s.nodes.iter().any(|x| {
                x.node.to_string() == *n
                    && x.last_error
                        .as_deref()
                        .is_some_and(|e| e.contains(why.as_str()))
            })
        })
    });
    for (n, _) in &want {
        let node = node(&snap, n);
        assert!(!node.ready, "{n}: {node:?}");
        eprintln!("{n}: {}", node.last_error.as_deref().unwrap_or(""));
    }
    // Neither a host the daemon cannot log in to nor one it never reached
    // with a usable key holds a claim.
    assert_eq!(pool.claim(0), None);
    assert_eq!(pool.claim(1), None);
    assert_eq!(pool.claim(4), None);
    // The hanging check was stopped: no `sleep 60` of the attempt is left.
    std::thread::sleep(Duration::from_millis(500));
    let sleeping = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == b"sleep\x0060\x00")
                && std::fs::read_link(e.path().join("cwd"))
                    .is_ok_and(|cwd| cwd.starts_with(pool.home(3).canonicalize().unwrap()))
        })
        .count();
    assert!(sleeping <= 1, "{sleeping} hanging boot checks left running");
    down_leaves_nothing(&pool, &mut d, false);
}

/// A directory made read-only by a read-only bind mount over itself (root
/// ignores permission bits); unmounted when dropped.
struct ReadOnly(PathBuf);

impl ReadOnly {
    fn mount(dir: &Path) -> Self {
        let run = |args: &[&str]| {
            let o = std::process::Command::new("mount")
                .args(args)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "mount {args:?} failed (the SSH tests run as root): {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        let d = dir.to_str().unwrap();
        run(&["--bind", d, d]);
        let guard = Self(dir.to_owned());
        run(&["-o", "remount,ro,bind", d]);
        guard
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_hosts_labels_reach_its_agent_and_its_boot_check_and_changing_them_replaces_nothing() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(2);
    let shape = |name: &str, labels: &str| {
        shape_file(
            &pool.root,
            name,
            &format!(
                "run = \"ssh\"\n\
                 [[group]]\nid = \"lab\"\ncount = 1\nprovider = \"ssh\"\n\
                 hosts = [{{ host = {}, labels = [{labels}] }}]\n\
                 boot_check = [\"sh\", \"-c\", \"[ \\\"$SWACTOR_HOST_LABELS\\\" = 'gpu zone=b' ]\"]\n\
                 [group.params]\ntrust_on_first_use = true\n\
                 [[group]]\nid = \"plain\"\ncount = 1\nprovider = \"ssh\"\nhosts = [{}]\n\
                 boot_check = [\"sh\", \"-c\", \"[ -z \\\"$SWACTOR_HOST_LABELS\\\" ]\"]\n\
                 [group.params]\ntrust_on_first_use = true\n",
                pool.targets(&[0]),
                pool.targets(&[1]),
            ),
        )
    };
    let first = shape("labels.toml", "\"gpu\", \"zone=b\"");
    let mut d = pool.up(&first);
    // Each boot check passes only with its host's labels in its environment.
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 2);
    one_agent_per_node(&pool, &snap);
    // Labels are where a node goes, not what it is made of.
    let relabelled = shape("relabelled.toml", "\"gpu\", \"zone=c\"");
    let o = cli(&pool.state, &["plan", relabelled.to_str().unwrap()]);
    assert!(
        stdout(&o).contains("changes no node (2 unchanged), only where new nodes may go"),
        "{}",
        stdout(&o)
    );
    let o = cli(
        &pool.state,
        &["plan", relabelled.to_str().unwrap(), "--detailed-exitcode"],
    );
    assert_eq!(o.status.code(), Some(2), "a new generation is work");
    let o = cli(&pool.state, &["apply", relabelled.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let after = wait_converged(&pool.state, CONVERGE, |s| s.generation.0 == 2);
    let attempts = |s: &ClusterSnapshot| s.nodes.iter().map(|n| n.attempt).collect::<Vec<_>>();
    assert_eq!(
        attempts(&after),
        attempts(&snap),
        "a relabel replaced a node"
    );
    // A label the agent's environment could not carry is refused offline.
    let bad = shape("bad.toml", "\"gpu\", \"zone b\"");
    let o = cli(&pool.state, &["validate", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("label \"zone b\""), "{}", stderr(&o));
    down_leaves_nothing(&pool, &mut d, false);
}

#[test]
fn a_missing_agent_binary_is_named_before_anything_starts() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let shape = shape_file(
        tmp.path(),
        "s.toml",
        "run = \"ssh\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"ssh\"\n\
         hosts = [\"root@127.0.0.1:1\"]\n",
    );
    let o = std::process::Command::new(BIN)
        .args(["up", shape.to_str().unwrap(), "--yes"])
        .args([
            "--agent-binary",
            "/nonexistent/swactor-agent",
            "--state-dir",
        ])
        .arg(&state)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("the agent binary /nonexistent/swactor-agent") && err.contains("No such file"),
        "{err}"
    );
    assert!(!err.contains("plan:"), "it got as far as the plan: {err}");
    assert!(!state.exists(), "a state directory was made");
}

#[test]
fn swactor_logs_reads_an_ssh_node_s_agent_log_from_its_host_and_follows_it_to_its_end() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let pool = Pool::new(1);
    let shape = pool.shape("one.toml", 1, &[0], "");
    let mut d = pool.up(&shape);
    let snap = wait_converged(&pool.state, CONVERGE, |s| s.nodes.len() == 1);
    let attempt = node(&snap, "w-0").attempt;
    let on_host = pool
        .home(0)
        .join(format!(".swactor/nodes/ssh/w-0-{attempt}/agent.log"));

    // `describe` points at `swactor logs`, and that reads the file on the host.
    let o = cli(&pool.state, &["describe", "w-0"]);
    assert!(stdout(&o).contains("swactor logs w-0"), "{}", stdout(&o));
    let o = cli(&pool.state, &["logs", "w-0"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let shown = stdout(&o);
    let file = std::fs::read_to_string(&on_host).unwrap();
    assert!(!shown.is_empty(), "{}", stderr(&o));
    assert!(
        file.starts_with(&shown),
        "shown:\n{shown}\nthe file on the host:\n{file}"
    );
    assert!(
        stderr(&o).contains(&format!("w-0 attempt {attempt} (ssh node")),
        "{}",
        stderr(&o)
    );

    // --follow prints what is written next, and ends with the attempt.
    let mut follow = std::process::Command::new(BIN)
        .args(["logs", "w-0", "--follow", "--state-dir"])
        .arg(&pool.state)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&on_host)
        .unwrap();
    std::io::Write::write_all(&mut log, b"a line the test wrote\n").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let o = cli(&pool.state, &["replace", "w-0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let started = Instant::now();
    while follow.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "`logs --follow` outlived its attempt"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = follow.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("a line the test wrote\n"),
        "{}",
        stdout(&o)
    );
    assert!(stderr(&o).contains("has ended"), "{}", stderr(&o));

    // The replaced attempt's log went with its directory: said so, not
    // that the node was never a `process` one.
    wait_converged(&pool.state, CONVERGE, |s| {
        s.nodes.len() == 1 && node(s, "w-0").attempt != attempt
    });
    let o = cli(
        &pool.state,
        &["logs", "w-0", "--attempt", &attempt.0.to_string()],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not w-0's current attempt"),
        "{}",
        stderr(&o)
    );
    down_leaves_nothing(&pool, &mut d, false);
}
