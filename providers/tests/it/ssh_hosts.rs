//! The `ssh` provider against real OpenSSH servers on 127.0.0.1, each a host
//! with a home of its own; the agent is a shell script uploaded as the agent
//! binary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_providers::ssh::testing::Sshd;
use swactor_providers::ssh::{SshHostsConfig, SshHostsProvider};
use swactor_providers::{BootstrapEvents, FaultKind, Provider, ProviderError, Release};
use swactor_provisioning::{
    BootParams, BootstrapEvent, BootstrapStage, LogicalNodeId, NodeAttemptId, NodeTemplate,
    ParamValue, ProviderShape, ResourceKey, RunId, SwarmJoin,
};

const WAIT: Duration = Duration::from_secs(15);
const SECRET: [u8; 32] = [7; 32];

/// Walks through the stages, then stays up (a shell, so it keeps its
/// arguments) until stopped.
const CONVERGING: &str = r#"#!/bin/sh
printf '%s\n' "$@" > args.txt
echo "@swactor stage ssh-connect"
echo "@swactor stage boot-check"
echo "@swactor stage swactor-start"
echo "@swactor stage join"
echo "@swactor joined"
echo "@swactor stage converged"
while :; do sleep 1; done
"#;

const EXITS: &str = r#"#!/bin/sh
echo "@swactor stage ssh-connect"
echo "cannot find the daemon's ticket" >&2
exit 4
"#;

struct World {
    root: tempfile::TempDir,
    hosts: Vec<Sshd>,
}

impl World {
    /// `n` hosts accepting the key the provider makes in `{root}/state/ssh`.
    fn new(n: usize, agent: &str) -> Self {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("state")).unwrap();
        std::fs::write(root.path().join("agent"), agent).unwrap();
        let key =
            swactor_providers::ssh::SshIdentity::load_or_generate(&root.path().join("state/ssh"))
                .unwrap()
                .public_openssh();
        let hosts = (0..n)
            .map(|i| {
                let dir = root.path().join(format!("host{i}"));
                std::fs::create_dir_all(&dir).unwrap();
                Sshd::start(&dir, std::slice::from_ref(&key))
            })
            .collect();
        Self { root, hosts }
    }

    fn provider(&self) -> SshHostsProvider {
        self.provider_in("state", None)
    }

    /// A provider of `deployment` keeping its files in `{root}/{state}`
    /// (with the same SSH key as the first one).
    fn provider_in(&self, state: &str, deployment: Option<&str>) -> SshHostsProvider {
        let dir = self.root.path().join(state);
        if !dir.join("ssh").exists() {
            std::fs::create_dir_all(dir.join("ssh")).unwrap();
            for f in [
                swactor_providers::ssh::KEY_FILE,
                swactor_providers::ssh::PUBLIC_KEY_FILE,
            ] {
                std::fs::copy(
                    self.root.path().join("state/ssh").join(f),
                    dir.join("ssh").join(f),
                )
                .unwrap();
            }
        }
        let mut config = SshHostsConfig::new(dir, self.root.path().join("agent"));
        config.deployment = deployment.map(str::to_owned);
        config.daemon_ticket = "ticket-1".into();
        config.token_secret = SECRET;
        config.connect_timeout = Duration::from_secs(3);
        config.term_grace = Duration::from_secs(1);
        SshHostsProvider::new(config).unwrap()
    }

    fn template(&self) -> NodeTemplate {
        let hosts = self
            .hosts
            .iter()
            .map(|h| ParamValue::Str(h.target().to_string()))
            .collect();
        NodeTemplate {
            provider: ProviderShape {
                kind: "ssh".into(),
                params: BTreeMap::from([
                    ("trust_on_first_use".into(), ParamValue::Bool(true)),
                    ("unreachable_give_up_s".into(), ParamValue::Float(2.0)),
                ]),
                placement: BTreeMap::from([("hosts".into(), ParamValue::List(hosts))]),
            },
            boot: BootParams {
                image: None,
                boot_check: vec!["sh".into(), "-c".into(), "exit 0".into()],
                env: BTreeMap::new(),
            },
            role: "worker".into(),
            join: SwarmJoin::default(),
            limits: Default::default(),
        }
    }

    /// The attempt directory of `key` on host `i`.
    fn node_dir(&self, i: usize, key: &ResourceKey) -> PathBuf {
        self.hosts[i].home().join(format!(
            ".swactor/nodes/{}/{}-{}",
            key.run_id, key.node, key.attempt
        ))
    }

    fn claim(&self, i: usize) -> Option<String> {
        std::fs::read_to_string(self.hosts[i].home().join(".swactor/claim")).ok()
    }

    /// Which host holds `key`'s claim.
    fn holder(&self, key: &ResourceKey) -> Option<usize> {
        let line = format!(
            "swactor-claim run={} node={} attempt={}\n",
            key.run_id, key.node, key.attempt.0
        );
        (0..self.hosts.len()).find(|i| self.claim(*i).as_deref() == Some(line.as_str()))
    }
}

/// Live agent processes (their command line has `--attempt`) whose working
/// directory is `dir`.
fn agents_in(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = processes_in(dir)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"--attempt"))
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Live processes whose working directory is `dir`.
fn processes_in(dir: &Path) -> Vec<u32> {
    let Ok(want) = dir.canonicalize() else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
            let cwd = std::fs::read_link(e.path().join("cwd")).ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let zombie = stat.rsplit_once(')')?.1.trim_start().starts_with('Z');
            (cwd == want && !zombie).then_some(pid)
        })
        .collect()
}

fn key(node: &str, attempt: u64) -> ResourceKey {
    ResourceKey {
        run_id: RunId::new("r1"),
        node: LogicalNodeId::parse(node).unwrap(),
        attempt: NodeAttemptId(attempt),
    }
}

async fn next(events: &mut BootstrapEvents) -> Option<BootstrapEvent> {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("the stream neither delivered nor ended in time")
}

async fn take(events: &mut BootstrapEvents, n: usize) -> Vec<BootstrapEvent> {
    let mut got = Vec::new();
    for _ in 0..n {
        got.push(next(events).await.expect("the stream ended early"));
    }
    got
}

fn converging_stages() -> Vec<BootstrapEvent> {
    use BootstrapStage::*;
    vec![
        BootstrapEvent::Stage(SshConnect),
        BootstrapEvent::Stage(BootCheck),
        BootstrapEvent::Stage(SwactorStart),
        BootstrapEvent::Stage(Join),
        BootstrapEvent::SwactorJoined,
        BootstrapEvent::Stage(Converged),
    ]
}

async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_holds_one_claim_a_retried_create_adopts_it_and_a_full_pool_says_so() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(1, CONVERGING);
    let p = world.provider();
    let t = world.template();
    let a = p.create_lease(&key("w-0", 1), &t).await.unwrap();
    assert_eq!(a.lease.0, format!("ssh:{}", world.hosts[0].target()));
    assert_eq!(world.holder(&key("w-0", 1)), Some(0));
    // The same key again: the same host, no second claim.
    let again = p.create_lease(&key("w-0", 1), &t).await.unwrap();
    assert_eq!(again.lease, a.lease);
    // Another key finds no free host, and says who holds it.
    let e = p.create_lease(&key("w-1", 2), &t).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ProviderError::Definite(_)), "{e:?}");
    assert_eq!(e.kind(), Some(FaultKind::NoCapacity), "{e:?}");
    assert!(
        text.contains("waiting for a free host: 1 of the pool's 1 hosts are claimed")
            && text.contains("r1/w-0/a1"),
        "{text}"
    );
    p.destroy_lease(&key("w-0", 1), &a.lease).await.unwrap();
    assert_eq!(world.claim(0), None);
    p.destroy_lease(&key("w-0", 1), &a.lease).await.unwrap();
    let b = p.create_lease(&key("w-1", 2), &t).await.unwrap();
    assert_eq!(
        b.lease, a.lease,
        "the freed host is claimed by the next key"
    );
}

/// Issue 30, fix 2: two daemons (deployments) with the same run and the
/// same hosts. A host claimed by one is taken for the other, even for the
/// very same key: never adopted, listed or released by it, only reported
/// as foreign. Once the first lets it go, the second may claim it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_claimed_by_another_deployment_of_the_run_is_never_adopted_or_released() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(1, CONVERGING);
    let a = world.provider_in("state-a", Some("0000000a"));
    let b = world.provider_in("state-b", Some("0000000b"));
    let t = world.template();
    let k = key("w-0", 1);
    let held = a.create_lease(&k, &t).await.unwrap();
    assert_eq!(
        world.claim(0).as_deref(),
        Some("swactor-claim run=r1 node=w-0 attempt=1 deployment=0000000a\n")
    );
    let e = b.create_lease(&k, &t).await.unwrap_err();
    assert_eq!(e.kind(), Some(FaultKind::NoCapacity), "{e:?}");
    assert!(
        e.to_string().contains("r1/w-0/a1 of deployment 0000000a"),
        "{e}"
    );
    assert!(b.list(&k.run_id).await.unwrap().is_empty());
    let foreign = b.foreign();
    assert_eq!(foreign.len(), 1, "{foreign:?}");
    assert_eq!(foreign[0].deployment.as_deref(), Some("0000000a"));
    assert_eq!(foreign[0].key, "w-0/a1");
    // A's agent runs; B's cancel and destroy of "its" key (the same one)
    // leave the agent, its directory and A's claim alone.
    let endpoint = a.lookup_endpoint(&k, &held.lease).await.unwrap();
    let mut session = a
        .start_bootstrap(&k, &held.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(take(&mut session.events, 6).await, converging_stages());
    let dir = world.node_dir(0, &k);
    assert_eq!(agents_in(&dir).len(), 1, "A's agent runs");
    b.cancel_bootstrap(&k, &session.session).await.unwrap();
    b.destroy_lease(&k, &held.lease).await.unwrap();
    assert_eq!(agents_in(&dir).len(), 1, "A's agent still runs");
    assert!(world.claim(0).unwrap().contains("deployment=0000000a"));
    assert_eq!(a.list(&k.run_id).await.unwrap().len(), 1);
    a.cancel_bootstrap(&k, &session.session).await.unwrap();
    a.destroy_lease(&k, &held.lease).await.unwrap();
    assert_eq!(world.claim(0), None);
    b.create_lease(&k, &t).await.unwrap();
    assert!(world.claim(0).unwrap().contains("deployment=0000000b"));
    assert!(a.list(&k.run_id).await.unwrap().is_empty());
    assert_eq!(a.foreign().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_runs_detached_streams_its_stages_and_cancel_and_destroy_leave_nothing() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(1, CONVERGING);
    let p = world.provider();
    let t = world.template();
    let k = key("w-0", 3);
    let grant = p.create_lease(&k, &t).await.unwrap();
    let endpoint = p.lookup_endpoint(&k, &grant.lease).await.unwrap();
    let mut session = p
        .start_bootstrap(&k, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(take(&mut session.events, 6).await, converging_stages());
    let dir = world.node_dir(0, &k);
    let args = std::fs::read_to_string(dir.join("args.txt")).unwrap();
    let args: Vec<&str> = args.lines().collect();
    assert_eq!(
        &args[..9],
        [
            "agent",
            "--run",
            "r1",
            "--node",
            "w-0",
            "--attempt",
            "3",
            "--daemon",
            "ticket-1"
        ]
    );
    assert!(args.contains(&"--boot-check=-c"), "{args:?}");
    // The credentials went to a file only the owner can read.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("agent.credentials"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(agents_in(&dir).len(), 1, "the agent runs");

    // Listing finds the lease and the running agent's session.
    let listed = p.list(&RunId::new("r1")).await.unwrap();
    assert_eq!(listed[&k].lease.as_ref(), Some(&grant.lease));
    assert_eq!(listed[&k].session.as_ref(), Some(&session.session));

    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    assert_eq!(
        next(&mut session.events).await,
        Some(BootstrapEvent::Closed)
    );
    wait_until("the agent, its group and its follower to be gone", || {
        processes_in(&dir).is_empty()
    })
    .await;
    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    p.destroy_lease(&k, &grant.lease).await.unwrap();
    assert!(!dir.exists());
    assert_eq!(world.claim(0), None);
    assert!(p.list(&RunId::new("r1")).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_exits_unannounced_fails_with_its_status_and_last_words() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(1, EXITS);
    let p = world.provider();
    let t = world.template();
    let k = key("w-0", 1);
    let grant = p.create_lease(&k, &t).await.unwrap();
    let endpoint = p.lookup_endpoint(&k, &grant.lease).await.unwrap();
    let mut session = p
        .start_bootstrap(&k, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(
        next(&mut session.events).await,
        Some(BootstrapEvent::Stage(BootstrapStage::SshConnect))
    );
    let Some(BootstrapEvent::Failed { stage, reason }) = next(&mut session.events).await else {
        panic!("expected a failure");
    };
    assert_eq!(stage, BootstrapStage::AgentLost);
    assert!(
        reason.contains("exited with code 4") && reason.contains("cannot find the daemon's ticket"),
        "{reason}"
    );
    p.destroy_lease(&k, &grant.lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_provider_lists_and_adopts_the_running_agent_without_a_second_start() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(2, CONVERGING);
    start_then_adopt_after_a_restart(&world, key("w-1", 5)).await;
}

/// Claims a host for `k`, starts its agent, then has a new provider (as a
/// restarted daemon would) list the claim and adopt the running agent
/// without a second start; destroy leaves nothing and releases the claim.
async fn start_then_adopt_after_a_restart(world: &World, k: ResourceKey) {
    let t = world.template();
    let first = world.provider();
    let grant = first.create_lease(&k, &t).await.unwrap();
    // A retried create sticks to the same claim.
    assert_eq!(first.create_lease(&k, &t).await.unwrap().lease, grant.lease);
    let endpoint = first.lookup_endpoint(&k, &grant.lease).await.unwrap();
    let mut s1 = first
        .start_bootstrap(&k, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(take(&mut s1.events, 6).await, converging_stages());
    let host = world.holder(&k).unwrap();
    let dir = world.node_dir(host, &k);
    let before = agents_in(&dir);
    assert_eq!(before.len(), 1);
    drop(first);

    // A new provider learns the hosts from the shape, then adopts.
    let second = world.provider();
    second.learn_template(&t);
    let listed = second.list(&RunId::new("r1")).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[&k].session.as_ref(), Some(&s1.session));
    let mut s2 = second
        .start_bootstrap(&k, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(s2.session, s1.session);
    // The log is replayed from its start.
    assert_eq!(take(&mut s2.events, 6).await, converging_stages());
    assert_eq!(agents_in(&dir), before, "no second agent");
    second.destroy_lease(&k, &grant.lease).await.unwrap();
    wait_until("everything of the attempt to be gone", || {
        processes_in(&dir).is_empty()
    })
    .await;
    assert!(
        second.list(&RunId::new("r1")).await.unwrap().is_empty(),
        "the claim was released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_stops_answering_is_given_up_and_cleaned_once_it_is_back() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut world = World::new(2, CONVERGING);
    let p = world.provider();
    let t = world.template();
    let k = key("w-0", 1);
    let grant = p.create_lease(&k, &t).await.unwrap();
    let host = world.holder(&k).unwrap();
    let endpoint = p.lookup_endpoint(&k, &grant.lease).await.unwrap();
    let mut session = p
        .start_bootstrap(&k, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    take(&mut session.events, 6).await;
    let dir = world.node_dir(host, &k);

    world.hosts[host].stop();
    // While the host is away, a retried create does not claim the other host.
    let e = p.create_lease(&k, &t).await.unwrap_err();
    assert!(matches!(e, ProviderError::Ambiguous(_)), "{e:?}");
    assert_eq!(world.claim(1 - host), None);
    // Cleanup fails until the host has been away for its give-up time (2 s).
    let e = p.destroy_lease(&k, &grant.lease).await.unwrap_err();
    assert_eq!(e.kind(), Some(FaultKind::Unreachable), "{e:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Then the lease is given up, and the caller is told so, not that it
    // was destroyed: the host still holds the claim and the agent.
    match p.destroy_lease(&k, &grant.lease).await.unwrap() {
        Release::GivenUp(why) => assert!(
            why.contains(&world.hosts[host].target().to_string())
                && why.contains("unreachable_give_up_s"),
            "{why}"
        ),
        Release::Done => panic!("a lease on a host that is away was reported destroyed"),
    }
    // The next attempt goes to the other host.
    let k2 = key("w-0", 2);
    let other = p.create_lease(&k2, &t).await.unwrap();
    assert_ne!(other.lease, grant.lease);
    assert_eq!(world.holder(&k2), Some(1 - host));
    // The stale claim is not listed as a lease while it waits to be cleaned.
    world.hosts[host].start_again();
    let listed = p.list(&RunId::new("r1")).await.unwrap();
    assert!(!listed.contains_key(&k), "{listed:?}");
    // Once the host answers, the provider stops what was left and frees it.
    wait_until("the abandoned claim to be released", || {
        world.claim(host).is_none()
    })
    .await;
    wait_until("the abandoned agent to be stopped", || {
        processes_in(&dir).is_empty()
    })
    .await;
    assert!(!dir.exists());
    p.destroy_lease(&k2, &other.lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_host_that_is_silent_at_a_restart_is_listed_from_its_record_and_collected() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    // A create that claimed a host, then the daemon died before its journal
    // heard of the lease; at the restart the host does not answer.
    let mut world = World::new(1, CONVERGING);
    let t = world.template();
    let k = key("w-2", 3);
    let first = world.provider();
    let grant = first.create_lease(&k, &t).await.unwrap();
    assert_eq!(world.holder(&k), Some(0));
    drop(first);
    world.hosts[0].stop();

    let second = world.provider();
    second.learn_template(&t);
    let listed = second.list(&RunId::new("r1")).await.unwrap();
    // Listed from the local record, so the core collects it (or adopts it)
    // instead of forgetting a claim it cannot see.
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[&k].lease.as_ref(), Some(&grant.lease));
    assert_eq!(listed[&k].session, None);
    // Another run's listing does not see it.
    assert!(second.list(&RunId::new("r2")).await.unwrap().is_empty());

    world.hosts[0].start_again();
    second.destroy_lease(&k, &grant.lease).await.unwrap();
    assert_eq!(world.claim(0), None, "the claim was released");
    assert!(second.list(&RunId::new("r1")).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_shell_greets_on_stdout_is_claimed_listed_and_adopted_all_the_same() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let world = World::new(1, CONVERGING);
    // bash reads ~/.bashrc for commands sshd runs; many print a greeting.
    std::fs::write(
        world.hosts[0].home().join(".bashrc"),
        "echo 'Welcome to host0: be nice'\necho 'claimed by nobody'\n",
    )
    .unwrap();
    start_then_adopt_after_a_restart(&world, key("w-0", 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_pool_that_does_not_answer_is_summed_up_in_a_short_line() {
    let world = World::new(0, CONVERGING);
    let p = world.provider();
    // Ports nothing listens on: each host refuses the connection at once.
    let ports: Vec<u16> = (0..9)
        .map(|_| {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            free.local_addr().unwrap().port()
        })
        .collect();
    let refused = |hosts: Vec<String>| {
        let mut t = world.template();
        let hosts = hosts.into_iter().map(ParamValue::Str).collect();
        t.provider
            .placement
            .insert("hosts".into(), ParamValue::List(hosts));
        let p = p.clone();
        async move {
            let e = p.create_lease(&key("w-0", 1), &t).await.unwrap_err();
            assert!(matches!(e, ProviderError::Definite(_)), "{e:?}");
            e.to_string()
        }
    };
    // Nine reasons: the first hosts with theirs, the rest counted.
    let text = refused(
        ports
            .iter()
            .map(|port| format!("root@127.0.0.1:{port}"))
            .collect(),
    )
    .await;
    assert!(
        text.starts_with(&format!(
            "waiting for a free host: 0 of the pool's 9 hosts are claimed; not answering: \
             root@127.0.0.1:{} (connection refused (nothing listens on port {}))",
            ports[0], ports[0]
        )),
        "{text}"
    );
    assert!(text.ends_with("; and 6 more"), "{text}");
    assert!(!text.contains(&format!("127.0.0.1:{}", ports[3])), "{text}");
    assert!(text.len() < 400, "{} characters: {text}", text.len());
    // One reason for all: said once.
    let text = refused(
        (0..9)
            .map(|i| format!("user{i}@127.0.0.1:{}", ports[0]))
            .collect(),
    )
    .await;
    assert_eq!(
        text,
        format!(
            "waiting for a free host: 0 of the pool's 9 hosts are claimed; not answering: \
             user0@127.0.0.1:{p}, user1@127.0.0.1:{p}, user2@127.0.0.1:{p} and 6 more \
             (connection refused (nothing listens on port {p}))",
            p = ports[0]
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_cut_off_as_its_host_dies_keeps_the_create_on_that_host() {
    if !swactor_providers::ssh::testing::sshd_available() {
        return;
    }
    let mut world = World::new(2, CONVERGING);
    let p = world.provider();
    let t = world.template();
    let k = key("w-0", 1);
    // Host 0 (where w-0 looks first) runs the claim, then its sshd dies
    // before the command's exit status leaves: the claim is written and the
    // provider cannot know it, and host 0 does not answer again.
    let pid_file = world.hosts[0].dir().join("sshd.pid");
    let marker = world.root.path().join("cut-once");
    std::fs::write(
        world.hosts[0].home().join(".bashrc"),
        format!(
            "case \"$SSH_ORIGINAL_COMMAND\" in *set\\ -C*)\n\
             if [ ! -e '{marker}' ]; then touch '{marker}'; \
             (cd \"$HOME\" && /bin/sh -c \"$SSH_ORIGINAL_COMMAND\") > /dev/null 2>&1; \
             kill -9 \"$(cat '{pid}')\" $PPID; sleep 5; fi;;\n\
             esac\n",
            marker = marker.display(),
            pid = pid_file.display(),
        ),
    )
    .unwrap();
    let e = p.create_lease(&k, &t).await.unwrap_err();
    assert!(marker.exists(), "the cut-off claim never ran");
    assert_eq!(world.holder(&k), Some(0), "the claim was written on host 0");
    // Not "nothing ran there": the create is ambiguous and no other host
    // is claimed for the same key.
    assert!(matches!(e, ProviderError::Ambiguous(_)), "{e:?}");
    assert_eq!(world.claim(1), None, "a second host was claimed for {k}");
    // Once host 0 answers, the retried create finds its claim there.
    world.hosts[0].start_again();
    let grant = p.create_lease(&k, &t).await.unwrap();
    assert_eq!(grant.lease.0, format!("ssh:{}", world.hosts[0].target()));
    assert_eq!(world.claim(1), None);
    p.destroy_lease(&k, &grant.lease).await.unwrap();
    assert_eq!(world.holder(&k), None);
}
