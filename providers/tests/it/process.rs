//! The process provider against real processes: shell-script agents in temporary state directories.
#![cfg(all(target_os = "linux", feature = "process"))]

use rustix::process::{Pid, Signal, kill_process, kill_process_group};
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_providers::credentials::{AgentCredentials, CREDENTIALS_FILE};
use swactor_providers::process::{ProcessConfig, ProcessError, ProcessProvider, agent_logs};
use swactor_providers::{BootstrapEvents, BootstrapSession, Provider, ProviderError};
use swactor_provisioning::{
    BootParams, BootstrapEvent, BootstrapStage, LeaseId, LogicalNodeId, NodeAttemptId,
    NodeTemplate, ProviderShape, ResourceKey, RunId, SessionId, SwarmJoin,
};

/// Longest any single wait in these tests may take before it counts as a hang.
const WAIT: Duration = Duration::from_secs(10);
const SECRET: [u8; 32] = [42; 32];
const TICKET: &str = "ticket-1";

/// Reports its arguments, environment and working directory, walks through
/// every stage, then stays alive (without `exec`, which would drop the
/// arguments the provider recognises it by).
const CONVERGING: &str = r#"
echo "starting"
printf '%s\n' "$@" > args.txt
printf '%s\n' "$SWACTOR_TEST_ENV" > env.txt
echo "@swactor stage ssh-connect"
sleep 0.05
echo "@swactor stage boot-check"
sleep 0.05
echo "@swactor stage swactor-start"
echo "some progress on stderr" >&2
echo "@swactor stage join"
echo "@swactor joined"
echo "@swactor stage converged"
sleep 600
"#;

/// Starts a grandchild in its own group's background before converging.
const WITH_GRANDCHILD: &str = r#"
echo "@swactor stage ssh-connect"
sh -c 'while :; do sleep 1; done' "grandchild of $PWD" &
echo $! > grandchild.pid
echo "@swactor stage converged"
sleep 600
"#;

/// Forks a subshell that keeps running shell code, so it carries the agent's
/// command line (and its process group) for as long as the agent lives.
const WITH_SUBSHELL: &str = r#"
( while :; do sleep 1; done ) &
echo $! > subshell.pid
echo "@swactor stage ssh-connect"
sleep 600
"#;

const IGNORES_TERM: &str = r#"
trap '' TERM
echo "@swactor stage ssh-connect"
sleep 600
"#;

const EXITS_EARLY: &str = r#"
echo "@swactor stage ssh-connect"
printf '\033[31merror:\033[0m unexpected argument found\n' >&2
echo "usage: agent [OPTIONS]" >&2
exit 3
"#;

const FAILS_BOOT_CHECK: &str = r#"
echo "@swactor stage ssh-connect"
echo "@swactor stage boot-check"
echo "@swactor failed boot-check-failed no gpu found"
exit 1
"#;

/// A temporary root holding the state directory and the agent scripts. On
/// drop it kills every process whose command line mentions the root, so no
/// test leaves an agent (or a grandchild) running, pass or fail.
struct World {
    root: tempfile::TempDir,
}

impl World {
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("state")).unwrap();
        Self { root }
    }

    fn state_dir(&self) -> PathBuf {
        self.root.path().join("state")
    }

    /// A config running `script` with `/bin/sh` (running the script file
    /// itself could race another test's fork and fail with "text file busy").
    fn config(&self, name: &str, script: &str) -> ProcessConfig {
        let path = self.root.path().join(format!("{name}.sh"));
        // Written once: a running `sh` reads its script as it goes, so
        // rewriting it under a live agent could cut the agent short.
        if !path.exists() {
            std::fs::write(&path, script).unwrap();
        }
        ProcessConfig {
            agent_program: "/bin/sh".into(),
            agent_args: vec![path.to_str().unwrap().to_owned()],
            daemon_ticket: TICKET.to_owned().into(),
            token_secret: SECRET,
            log_poll_interval: Duration::from_millis(20),
            ..ProcessConfig::new(self.state_dir())
        }
    }

    fn provider(&self, name: &str, script: &str) -> ProcessProvider {
        ProcessProvider::new(self.config(name, script)).unwrap()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let marker = self.root.path().as_os_str().as_encoded_bytes();
        for pid in processes_mentioning(marker) {
            let Some(p) = Pid::from_raw(pid) else {
                continue;
            };
            // Leaders take their whole group along (an agent's `sleep`s).
            if stat(pid).is_some_and(|(_, pgrp)| pgrp == pid) {
                let _ = kill_process_group(p, Signal::KILL);
            } else {
                let _ = kill_process(p, Signal::KILL);
            }
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// State and process group of `pid`, from `/proc/{pid}/stat`.
fn stat(pid: i32) -> Option<(u8, i32)> {
    let raw = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = raw[raw.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.as_bytes()[0];
    let _ppid = fields.next()?;
    Some((state, fields.next()?.parse().ok()?))
}

/// Runs and is not a zombie (orphans may stay zombies: PID 1 need not reap).
fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|(state, _)| state != b'Z' && state != b'X')
}

/// Live processes whose command line contains `needle`.
fn processes_mentioning(needle: &[u8]) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| contains(&c, needle))
        })
        .filter(|pid| alive(*pid))
        .collect()
}

/// The running agents of node directory `dir`: processes given `--dir {dir}`.
fn agents_in(dir: &Path) -> Vec<i32> {
    let mut needle = b"\0--dir\0".to_vec();
    needle.extend_from_slice(dir.as_os_str().as_encoded_bytes());
    needle.push(0);
    processes_mentioning(&needle)
}

/// The agents of `dir` as the provider must see them: those of
/// [`agents_in`] that lead their own process group. Counting all of
/// [`agents_in`] would also count a shell agent's fork for its next command
/// in the moment before that fork calls exec.
fn agent_leaders(dir: &Path) -> Vec<i32> {
    agents_in(dir)
        .into_iter()
        .filter(|pid| stat(*pid).is_some_and(|(_, pgrp)| pgrp == *pid))
        .collect()
}

fn read_pid_file(dir: &Path) -> Option<i32> {
    let raw = std::fs::read_to_string(dir.join("agent.pid")).ok()?;
    raw.trim().parse().ok()
}

fn session_of(lease: &LeaseId, pid: i32) -> SessionId {
    SessionId::from(format!("{}#pid{pid}", lease.0))
}

/// A process that is none of ours, leading a group of its own (so a stray
/// group signal would reach it); killed and reaped on drop.
struct Stranger(std::process::Child);

impl Stranger {
    fn spawn() -> Self {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        Self(child)
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).unwrap()
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn key(node: &str, attempt: u64) -> ResourceKey {
    ResourceKey {
        run_id: RunId::new("r1"),
        node: LogicalNodeId::parse(node).unwrap(),
        attempt: NodeAttemptId(attempt),
    }
}

fn template() -> NodeTemplate {
    NodeTemplate {
        provider: ProviderShape {
            kind: "process".to_owned(),
            params: BTreeMap::new(),
            placement: Default::default(),
        },
        boot: BootParams {
            image: None,
            boot_check: vec!["nvidia-smi".to_owned(), "-L".to_owned()],
            env: BTreeMap::from([("SWACTOR_TEST_ENV".to_owned(), "hello".to_owned())]),
        },
        role: "worker".to_owned(),
        join: SwarmJoin::default(),
        limits: Default::default(),
    }
}

fn pid_of(session: &BootstrapSession) -> i32 {
    session
        .session
        .0
        .rsplit_once("#pid")
        .unwrap()
        .1
        .parse()
        .unwrap()
}

/// The next event, or `None` when the stream ended; panics after [`WAIT`].
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

/// Everything left on the stream until it ends.
async fn rest(events: &mut BootstrapEvents) -> Vec<BootstrapEvent> {
    let mut got = Vec::new();
    while let Some(event) = next(events).await {
        got.push(event);
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

/// Leases `key` and starts its agent.
async fn boot(p: &ProcessProvider, key: &ResourceKey) -> (LeaseId, BootstrapSession) {
    let grant = p.create_lease(key, &template()).await.unwrap();
    let endpoint = grant.endpoint.clone().unwrap();
    let session = p
        .start_bootstrap(key, &grant.lease, &endpoint, &template())
        .await
        .unwrap();
    (grant.lease, session)
}

#[tokio::test]
async fn a_bootstrapped_agent_streams_its_stages_in_order_and_closes_when_cancelled() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let (_, mut session) = boot(&p, &k).await;
    assert_eq!(take(&mut session.events, 6).await, converging_stages());
    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
    assert!(agents_in(&p.node_dir(&k)).is_empty());
}

#[tokio::test]
async fn the_agent_runs_in_its_directory_with_its_identity_credentials_boot_checks_and_env() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let (lease, mut session) = boot(&p, &k).await;
    let dir = p.node_dir(&k);
    assert_eq!(lease.0, "nodes/r1/w-0-a1");
    assert_eq!(
        dir,
        world.state_dir().canonicalize().unwrap().join(&lease.0)
    );
    take(&mut session.events, 6).await;

    let args = std::fs::read_to_string(dir.join("args.txt")).unwrap();
    let credentials = dir.join(CREDENTIALS_FILE);
    let credentials_arg = credentials.to_str().unwrap();
    let dir_arg = dir.to_str().unwrap();
    let expected = [
        "--run",
        "r1",
        "--node",
        "w-0",
        "--attempt",
        "1",
        "--daemon",
        TICKET,
        "--credentials",
        credentials_arg,
        "--dir",
        dir_arg,
        "--boot-check=nvidia-smi",
        "--boot-check=-L",
        "--boot-timeout-s=300",
    ];
    assert_eq!(args.lines().collect::<Vec<_>>(), expected);
    // No secret is on the command line; it is in a file only this user can
    // read, in a directory only this user can enter.
    let creds = AgentCredentials::derive(&SECRET, &k);
    assert!(!args.contains(&creds.token), "the token stays off argv");
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "node directory");
    assert_eq!(mode(&credentials), 0o600, "credentials file");
    assert_eq!(
        AgentCredentials::parse(&std::fs::read_to_string(&credentials).unwrap()),
        Some(creds)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("env.txt")).unwrap(),
        "hello\n"
    );
    let log = std::fs::read_to_string(dir.join("agent.log")).unwrap();
    assert!(log.contains("starting\n") && log.contains("some progress on stderr\n"));
    let recorded = std::fs::read_to_string(dir.join("agent.pid")).unwrap();
    assert_eq!(recorded.trim().parse::<i32>().unwrap(), pid_of(&session));
    let identity: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("identity.json")).unwrap()).unwrap();
    assert_eq!(
        identity,
        serde_json::json!({"run_id": "r1", "node": "w-0", "attempt": 1})
    );
    p.cancel_bootstrap(&k, &session.session).await.unwrap();
}

#[tokio::test]
async fn creating_and_bootstrapping_twice_adopts_one_directory_and_one_agent() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let (lease, mut first) = boot(&p, &k).await;
    take(&mut first.events, 2).await;

    let again = p.create_lease(&k, &template()).await.unwrap();
    assert_eq!(again.lease, lease);
    let endpoint = again.endpoint.unwrap();
    let mut second = p
        .start_bootstrap(&k, &lease, &endpoint, &template())
        .await
        .unwrap();
    assert_eq!(second.session, first.session);
    // The adopter's stream restates everything from the start...
    assert_eq!(take(&mut second.events, 6).await, converging_stages());
    // ...and the stream it replaced ends.
    rest(&mut first.events).await;

    let runs = std::fs::read_dir(world.state_dir().join("nodes/r1")).unwrap();
    assert_eq!(runs.count(), 1);
    assert_eq!(agent_leaders(&p.node_dir(&k)), [pid_of(&second)]);
    p.cancel_bootstrap(&k, &second.session).await.unwrap();
    assert_eq!(rest(&mut second.events).await, [BootstrapEvent::Closed]);
}

#[tokio::test]
async fn cancel_stops_the_whole_process_group_including_grandchildren() {
    let world = World::new();
    let p = world.provider("grandchild", WITH_GRANDCHILD);
    let k = key("w-0", 1);
    let (_, mut session) = boot(&p, &k).await;
    take(&mut session.events, 2).await;
    let grandchild: i32 = std::fs::read_to_string(p.node_dir(&k).join("grandchild.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let agent = pid_of(&session);
    assert!(alive(agent) && alive(grandchild));

    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    assert!(!alive(agent), "the agent survived its cancel");
    assert!(
        !alive(grandchild),
        "the agent's grandchild survived its cancel"
    );
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
    // Already gone is success.
    p.cancel_bootstrap(&k, &session.session).await.unwrap();
}

#[tokio::test]
async fn an_agent_that_ignores_sigterm_is_killed_once_the_grace_is_over() {
    let world = World::new();
    let mut config = world.config("ignores-term", IGNORES_TERM);
    let grace = Duration::from_millis(300);
    config.term_grace = grace;
    let p = ProcessProvider::new(config).unwrap();
    let k = key("w-0", 1);
    let (_, mut session) = boot(&p, &k).await;
    take(&mut session.events, 1).await;

    let started = Instant::now();
    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    let took = started.elapsed();
    assert!(took >= grace, "killed after {took:?}, before the grace");
    assert!(took < grace + Duration::from_secs(3), "took {took:?}");
    assert!(!alive(pid_of(&session)));
    assert!(agents_in(&p.node_dir(&k)).is_empty());
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
}

#[tokio::test]
async fn destroy_stops_the_agent_removes_the_directory_and_is_idempotent() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let (lease, mut session) = boot(&p, &k).await;
    take(&mut session.events, 1).await;
    let dir = p.node_dir(&k);

    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(!dir.exists());
    assert!(!alive(pid_of(&session)));
    assert!(agents_in(&dir).is_empty());
    // A destroy stops the agent on purpose: its stream closes, not fails.
    assert_eq!(
        rest(&mut session.events).await.last(),
        Some(&BootstrapEvent::Closed)
    );

    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(matches!(
        p.lookup_endpoint(&k, &lease).await,
        Err(ProviderError::Gone(_))
    ));
    assert!(p.list(&k.run_id).await.unwrap().is_empty());
}

#[tokio::test]
async fn list_reports_node_directories_and_live_agents_and_leaves_strangers_alone() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let (a, b) = (key("w-0", 1), key("w-1", 2));
    let (lease_a, mut session) = boot(&p, &a).await;
    take(&mut session.events, 1).await;
    let lease_b = p.create_lease(&b, &template()).await.unwrap().lease;
    let run_dir = world.state_dir().join("nodes/r1");
    std::fs::create_dir(run_dir.join("junk")).unwrap();
    std::fs::create_dir(run_dir.join("w-2-a3")).unwrap();
    std::fs::write(run_dir.join("w-2-a3/identity.json"), "{}").unwrap();

    let inventory = p.list(&a.run_id).await.unwrap();
    assert_eq!(inventory.keys().collect::<Vec<_>>(), [&a, &b]);
    assert_eq!(inventory[&a].lease.as_ref(), Some(&lease_a));
    assert_eq!(inventory[&a].session.as_ref(), Some(&session.session));
    assert_eq!(inventory[&b].lease.as_ref(), Some(&lease_b));
    assert_eq!(inventory[&b].session, None);
    assert!(run_dir.join("junk").exists() && run_dir.join("w-2-a3").exists());
    assert!(p.list(&RunId::new("r2")).await.unwrap().is_empty());

    p.cancel_bootstrap(&a, &session.session).await.unwrap();
    let inventory = p.list(&a.run_id).await.unwrap();
    assert_eq!(inventory[&a].session, None);
    assert_eq!(inventory[&a].lease.as_ref(), Some(&lease_a));
}

#[tokio::test]
async fn a_restarted_provider_adopts_the_running_agent_and_replays_its_progress() {
    let world = World::new();
    let k = key("w-0", 1);
    let (lease, first_session) = {
        let p = world.provider("converging", CONVERGING);
        let (lease, mut session) = boot(&p, &k).await;
        take(&mut session.events, 6).await;
        (lease, session.session)
    };

    let p = world.provider("converging", CONVERGING);
    let inventory = p.list(&k.run_id).await.unwrap();
    assert_eq!(inventory[&k].session.as_ref(), Some(&first_session));
    let grant = p.create_lease(&k, &template()).await.unwrap();
    assert_eq!(grant.lease, lease);
    let mut session = p
        .start_bootstrap(&k, &lease, &grant.endpoint.unwrap(), &template())
        .await
        .unwrap();
    assert_eq!(session.session, first_session);
    assert_eq!(take(&mut session.events, 6).await, converging_stages());
    assert_eq!(agent_leaders(&p.node_dir(&k)), [pid_of(&session)]);

    p.cancel_bootstrap(&k, &session.session).await.unwrap();
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
    assert!(agents_in(&p.node_dir(&k)).is_empty());
}

#[tokio::test]
async fn an_agent_that_exits_on_its_own_is_reported_lost() {
    let world = World::new();
    let p = world.provider("exits", EXITS_EARLY);
    let k = key("w-0", 1);
    let (_, mut session) = boot(&p, &k).await;
    let events = rest(&mut session.events).await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0], BootstrapEvent::Stage(BootstrapStage::SshConnect));
    let BootstrapEvent::Failed { stage, reason } = &events[1] else {
        panic!("expected a failure, got {:?}", events[1]);
    };
    assert_eq!(*stage, BootstrapStage::AgentLost);
    // The reason quotes what the agent last wrote, without terminal escapes.
    assert_eq!(
        reason,
        "agent exited with code 3; its last output: error: unexpected argument found | usage: agent [OPTIONS]"
    );
    // Nothing to stop any more.
    p.cancel_bootstrap(&k, &session.session).await.unwrap();

    // Its log outlives the lease, for `swactor logs`.
    let lease = LeaseId::from("nodes/r1/w-0-a1");
    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(!p.node_dir(&k).exists());
    let logs = agent_logs(p.state_dir(), &k.run_id, &k.node).unwrap();
    assert_eq!(logs.len(), 1, "{logs:?}");
    assert!(!logs[0].live);
    let kept = std::fs::read_to_string(&logs[0].path).unwrap();
    assert!(kept.contains("unexpected argument found"), "{kept}");
}

#[tokio::test]
async fn an_agent_that_reports_a_failure_and_exits_closes_its_stream() {
    let world = World::new();
    let p = world.provider("fails", FAILS_BOOT_CHECK);
    let k = key("w-0", 1);
    let (_, mut session) = boot(&p, &k).await;
    assert_eq!(
        rest(&mut session.events).await,
        [
            BootstrapEvent::Stage(BootstrapStage::SshConnect),
            BootstrapEvent::Stage(BootstrapStage::BootCheck),
            BootstrapEvent::Failed {
                stage: BootstrapStage::BootCheckFailed,
                reason: "no gpu found".to_owned(),
            },
            BootstrapEvent::Closed,
        ]
    );
}

#[tokio::test]
async fn bootstrapping_again_after_the_agent_died_starts_a_new_agent_with_a_fresh_log() {
    let world = World::new();
    let p = world.provider("exits", EXITS_EARLY);
    let k = key("w-0", 1);
    let (lease, mut first) = boot(&p, &k).await;
    assert_eq!(rest(&mut first.events).await.len(), 2);

    let endpoint = p.lookup_endpoint(&k, &lease).await.unwrap();
    let mut second = p
        .start_bootstrap(&k, &lease, &endpoint, &template())
        .await
        .unwrap();
    assert_ne!(second.session, first.session);
    // Only the new agent's two events: the old log was set aside.
    assert_eq!(rest(&mut second.events).await.len(), 2);
    assert!(p.node_dir(&k).join("agent.log.prev").exists());
}

#[tokio::test]
async fn calls_for_a_missing_lease_say_gone_a_mismatched_one_fails_definitely_and_absent_is_success()
 {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let lease = LeaseId::from("nodes/r1/w-0-a1");
    let endpoint = swactor_provisioning::NodeEndpoint::from("local:/nowhere");
    assert!(matches!(
        p.lookup_endpoint(&k, &lease).await,
        Err(ProviderError::Gone(_))
    ));
    assert!(matches!(
        p.start_bootstrap(&k, &lease, &endpoint, &template()).await,
        Err(ProviderError::Gone(_))
    ));
    let granted = p.create_lease(&k, &template()).await.unwrap().lease;
    assert_eq!(granted, lease);
    let other = LeaseId::from("nodes/r1/w-0-a2");
    assert!(matches!(
        p.lookup_endpoint(&k, &other).await,
        Err(ProviderError::Definite(_))
    ));
    assert!(matches!(
        p.destroy_lease(&k, &other).await,
        Err(ProviderError::Definite(_))
    ));
    let gone = swactor_provisioning::SessionId::from("nodes/r1/w-0-a1#pid999999");
    p.cancel_bootstrap(&k, &gone).await.unwrap();
    p.destroy_lease(&k, &lease).await.unwrap();
    p.destroy_lease(&k, &lease).await.unwrap();
}

/// The kill window: a daemon killed after spawning the agent but before
/// writing `agent.pid`.
#[tokio::test]
async fn an_agent_whose_pid_was_never_recorded_is_listed_adopted_once_and_destroyed_by_a_new_provider()
 {
    let world = World::new();
    let k = key("w-0", 1);
    let (lease, agent) = {
        let p = world.provider("converging", CONVERGING);
        let (lease, mut session) = boot(&p, &k).await;
        take(&mut session.events, 6).await;
        (lease, pid_of(&session))
    };
    let dir = world
        .state_dir()
        .canonicalize()
        .unwrap()
        .join("nodes/r1/w-0-a1");
    std::fs::remove_file(dir.join("agent.pid")).unwrap();

    let p = world.provider("converging", CONVERGING);
    let inventory = p.list(&k.run_id).await.unwrap();
    assert_eq!(inventory[&k].session, Some(session_of(&lease, agent)));
    // The listing wrote the hint back.
    assert_eq!(read_pid_file(&dir), Some(agent));

    std::fs::remove_file(dir.join("agent.pid")).unwrap();
    let endpoint = p.lookup_endpoint(&k, &lease).await.unwrap();
    let mut session = p
        .start_bootstrap(&k, &lease, &endpoint, &template())
        .await
        .unwrap();
    assert_eq!(pid_of(&session), agent);
    assert_eq!(agent_leaders(&dir), [agent], "a second agent was started");
    assert_eq!(read_pid_file(&dir), Some(agent));
    assert_eq!(take(&mut session.events, 6).await, converging_stages());

    std::fs::remove_file(dir.join("agent.pid")).unwrap();
    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(!alive(agent), "the unrecorded agent survived its destroy");
    assert!(agents_in(&dir).is_empty());
    assert!(!dir.exists());
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
}

#[tokio::test]
async fn a_pid_file_naming_a_stranger_is_neither_adopted_nor_signalled_and_the_real_agent_is_found()
{
    let world = World::new();
    let stranger = Stranger::spawn();
    let k = key("w-0", 1);
    let p = world.provider("converging", CONVERGING);
    let grant = p.create_lease(&k, &template()).await.unwrap();
    let dir = p.node_dir(&k);
    std::fs::write(dir.join("agent.pid"), format!("{}\n", stranger.pid())).unwrap();

    // No agent runs: the stranger is not taken for one...
    assert_eq!(p.list(&k.run_id).await.unwrap()[&k].session, None);
    let endpoint = grant.endpoint.unwrap();
    let mut session = p
        .start_bootstrap(&k, &grant.lease, &endpoint, &template())
        .await
        .unwrap();
    let agent = pid_of(&session);
    assert_ne!(agent, stranger.pid());
    take(&mut session.events, 6).await;

    // ...and once one runs, a new provider finds it behind the stale file.
    drop(p);
    rest(&mut session.events).await;
    std::fs::write(dir.join("agent.pid"), format!("{}\n", stranger.pid())).unwrap();
    let p = world.provider("converging", CONVERGING);
    let listed = p.list(&k.run_id).await.unwrap()[&k].session.clone();
    assert_eq!(listed, Some(session.session.clone()));
    std::fs::write(dir.join("agent.pid"), format!("{}\n", stranger.pid())).unwrap();
    let mut adopted = p
        .start_bootstrap(&k, &grant.lease, &endpoint, &template())
        .await
        .unwrap();
    assert_eq!(adopted.session, session.session);
    assert_eq!(agent_leaders(&dir), [agent]);

    // Neither a cancel naming the stranger nor a destroy over its pid file
    // signals it.
    let forged = session_of(&grant.lease, stranger.pid());
    p.cancel_bootstrap(&k, &forged).await.unwrap();
    assert!(alive(stranger.pid()) && alive(agent));
    std::fs::write(dir.join("agent.pid"), format!("{}\n", stranger.pid())).unwrap();
    p.destroy_lease(&k, &grant.lease).await.unwrap();
    assert!(alive(stranger.pid()), "the stranger was signalled");
    assert!(!alive(agent), "the real agent survived its destroy");
    assert!(!dir.exists());
    assert_eq!(
        rest(&mut adopted.events).await.last(),
        Some(&BootstrapEvent::Closed)
    );
}

#[tokio::test]
async fn a_forked_child_carrying_the_agents_command_line_is_never_a_second_agent() {
    let world = World::new();
    let k = key("w-0", 1);
    let p = world.provider("subshell", WITH_SUBSHELL);
    let (lease, mut session) = boot(&p, &k).await;
    take(&mut session.events, 1).await;
    let dir = p.node_dir(&k);
    let agent = pid_of(&session);
    let subshell = std::fs::read_to_string(dir.join("subshell.pid"))
        .unwrap()
        .trim()
        .parse::<i32>()
        .unwrap();
    // The premise: the subshell carries the identity, in the agent's group
    // (and so, for a moment each second, does its fork for `sleep`).
    let carrying = agents_in(&dir);
    assert!(carrying.contains(&agent) && carrying.contains(&subshell));
    assert_eq!(stat(subshell).map(|(_, pgrp)| pgrp), Some(agent));

    // A new provider that must search (no pid file, then one naming the
    // subshell) finds the one agent.
    drop(p);
    rest(&mut session.events).await;
    std::fs::remove_file(dir.join("agent.pid")).unwrap();
    let p = world.provider("subshell", WITH_SUBSHELL);
    assert_eq!(
        p.list(&k.run_id).await.unwrap()[&k].session,
        Some(session.session.clone())
    );
    std::fs::write(dir.join("agent.pid"), format!("{subshell}\n")).unwrap();
    let endpoint = p.lookup_endpoint(&k, &lease).await.unwrap();
    let mut adopted = p
        .start_bootstrap(&k, &lease, &endpoint, &template())
        .await
        .unwrap();
    assert_eq!(adopted.session, session.session);
    assert_eq!(agent_leaders(&dir), [agent]);
    assert_eq!(read_pid_file(&dir), Some(agent));

    // A session naming the subshell is not the agent's: cancelling it
    // signals nothing.
    p.cancel_bootstrap(&k, &session_of(&lease, subshell))
        .await
        .unwrap();
    assert!(alive(agent) && alive(subshell));
    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(!alive(agent) && !alive(subshell));
    assert_eq!(
        rest(&mut adopted.events).await.last(),
        Some(&BootstrapEvent::Closed)
    );
}

#[tokio::test]
async fn the_remnants_of_an_exited_agents_group_are_no_agent_and_are_stopped_before_a_new_one_starts()
 {
    let world = World::new();
    let k = key("w-0", 1);
    let p = world.provider("subshell", WITH_SUBSHELL);
    let (lease, mut first) = boot(&p, &k).await;
    take(&mut first.events, 1).await;
    let dir = p.node_dir(&k);
    let old = pid_of(&first);
    let subshell: i32 = std::fs::read_to_string(dir.join("subshell.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    kill_process(Pid::from_raw(old).unwrap(), Signal::KILL).unwrap();
    rest(&mut first.events).await;
    assert!(!alive(old) && alive(subshell));

    // The subshell carries the identity but leads no group: no session.
    assert_eq!(p.list(&k.run_id).await.unwrap()[&k].session, None);
    let endpoint = p.lookup_endpoint(&k, &lease).await.unwrap();
    let mut second = p
        .start_bootstrap(&k, &lease, &endpoint, &template())
        .await
        .unwrap();
    let new = pid_of(&second);
    assert_ne!(new, subshell);
    assert!(!alive(subshell), "the old agent's subshell outlived it");
    assert_eq!(agent_leaders(&dir), [new]);
    p.cancel_bootstrap(&k, &second.session).await.unwrap();
    assert_eq!(
        rest(&mut second.events).await.last(),
        Some(&BootstrapEvent::Closed)
    );
}

#[tokio::test]
async fn a_node_directory_removed_out_of_band_is_gone_and_its_destroy_still_stops_the_agent() {
    let world = World::new();
    let p = world.provider("converging", CONVERGING);
    let k = key("w-0", 1);
    let (lease, mut session) = boot(&p, &k).await;
    take(&mut session.events, 6).await;
    let dir = p.node_dir(&k);
    let agent = pid_of(&session);
    std::fs::remove_dir_all(&dir).unwrap();

    let endpoint = swactor_provisioning::NodeEndpoint::from(format!("local:{}", dir.display()));
    assert!(matches!(
        p.lookup_endpoint(&k, &lease).await,
        Err(ProviderError::Gone(_))
    ));
    assert!(matches!(
        p.start_bootstrap(&k, &lease, &endpoint, &template()).await,
        Err(ProviderError::Gone(_))
    ));
    assert!(p.list(&k.run_id).await.unwrap().is_empty());
    assert_eq!(agent_leaders(&dir), [agent]);

    p.destroy_lease(&k, &lease).await.unwrap();
    assert!(!alive(agent), "the orphaned agent survived the destroy");
    assert_eq!(rest(&mut session.events).await, [BootstrapEvent::Closed]);
}

#[tokio::test]
async fn a_missing_state_dir_is_a_clear_error() {
    let world = World::new();
    let mut config = world.config("converging", CONVERGING);
    config.state_dir = world.root.path().join("absent");
    let err = ProcessProvider::new(config.clone()).unwrap_err();
    assert!(
        matches!(&err, ProcessError::StateDirMissing { path } if *path == config.state_dir),
        "{err:?}"
    );
    assert!(err.to_string().contains("absent"), "{err}");
}

#[test]
fn a_config_left_at_its_unset_values_is_rejected_field_by_field() {
    let world = World::new();
    let complete = world.config("converging", CONVERGING);
    assert!(complete.validate().is_ok());
    let unset = ProcessConfig::new(world.state_dir());
    assert!(matches!(
        unset.validate(),
        Err(ProcessError::EmptyField {
            field: "agent_program"
        })
    ));
    let no_ticket = ProcessConfig {
        daemon_ticket: Default::default(),
        ..complete.clone()
    };
    assert!(matches!(
        no_ticket.validate(),
        Err(ProcessError::EmptyField {
            field: "daemon_ticket"
        })
    ));
    let zero_secret = ProcessConfig {
        token_secret: [0; 32],
        ..complete.clone()
    };
    assert!(matches!(
        zero_secret.validate(),
        Err(ProcessError::ZeroTokenSecret)
    ));
    let no_poll = ProcessConfig {
        log_poll_interval: Duration::ZERO,
        ..complete
    };
    assert!(matches!(
        no_poll.validate(),
        Err(ProcessError::BadDuration {
            field: "log_poll_interval",
            ..
        })
    ));
}

#[test]
fn a_process_group_refuses_any_parameter_by_name() {
    let mut t = template();
    assert_eq!(swactor_providers::process::check_template(&t), Ok(()));
    t.provider.params.insert(
        "memory_mb".to_owned(),
        swactor_provisioning::ParamValue::Int(256),
    );
    let e = swactor_providers::process::check_template(&t).unwrap_err();
    assert_eq!(
        e,
        "unknown parameter `memory_mb` (the process provider takes none)"
    );
}
