//! The docker provider against the real Docker engine: containers of the static agent binary.
//!
//! Needs a reachable engine (`DOCKER_HOST` or the default socket). Without
//! one every test that needs it passes after printing one line saying so,
//! unless `SWACTOR_REQUIRE_DOCKER=1`, which makes them fail. The agent is
//! `SWACTOR_TEST_AGENT_BINARY` when set, otherwise the static build
//! `scripts/build-static-agent.sh --debug` makes (once per test run; cargo
//! makes it a no-op when nothing changed).
#![cfg(all(target_os = "linux", feature = "docker"))]

use bollard::Docker;
use bollard::query_parameters::{
    DownloadFromContainerOptions, ListContainersOptions, RemoveContainerOptions,
};
use futures_util::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};
use swactor_engine::iroh::{EndpointAddr, SecretKey};
use swactor_engine::net::EndpointTicket;
use swactor_providers::credentials::AgentCredentials;
use swactor_providers::docker::{
    DockerConfig, DockerError, DockerProvider, LABEL_ATTEMPT, LABEL_GROUP, LABEL_NODE, LABEL_RUN,
};
use swactor_providers::{BootstrapEvents, FaultKind, Provider, ProviderError};
use swactor_provisioning::{
    BootParams, BootstrapEvent, BootstrapStage, LogicalNodeId, NodeAttemptId, NodeTemplate,
    ParamValue, ProviderShape, ResourceKey, RunId, SwarmJoin,
};

/// Longest any single wait in these tests may take before it counts as a hang
/// (the first one may build the agent image).
const WAIT: Duration = Duration::from_secs(120);
const SECRET: [u8; 32] = [42; 32];

/// The agent binary, built once per test run.
fn agent_binary() -> PathBuf {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("SWACTOR_TEST_AGENT_BINARY") {
                return PathBuf::from(path);
            }
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
            let started = Instant::now();
            let out = std::process::Command::new("bash")
                .arg(root.join("scripts/build-static-agent.sh"))
                .arg("--debug")
                .current_dir(&root)
                .output()
                .expect("cannot run scripts/build-static-agent.sh");
            assert!(
                out.status.success(),
                "scripts/build-static-agent.sh --debug failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!(
                "static agent: {} in {:.1?}",
                String::from_utf8_lossy(&out.stdout).trim(),
                started.elapsed()
            );
            root.join("target/debug/swactor-agent")
        })
        .clone()
}

/// Whether the engine answers; prints the skip line once when it does not.
async fn engine_up() -> bool {
    static SKIPPED: Once = Once::new();
    let up = match Docker::connect_with_defaults() {
        Ok(d) => d.ping().await.is_ok(),
        Err(_) => false,
    };
    if !up {
        assert!(
            std::env::var("SWACTOR_REQUIRE_DOCKER").as_deref() != Ok("1"),
            "SWACTOR_REQUIRE_DOCKER=1 but no Docker engine answers (DOCKER_HOST or /var/run/docker.sock)"
        );
        SKIPPED.call_once(|| {
            // Straight to stderr: the harness would hide a passing test's `eprintln!`.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "docker tests skipped: no Docker engine answers (set DOCKER_HOST, or SWACTOR_REQUIRE_DOCKER=1 to fail instead)"
            );
        });
    }
    up
}

/// A daemon ticket that parses but names an address where no daemon listens.
fn dead_ticket() -> String {
    let id = SecretKey::from_bytes(&[7; 32]).public();
    EndpointTicket::new(
        EndpointAddr::new(id).with_ip_addr(SocketAddr::from((Ipv4Addr::LOCALHOST, 9))),
    )
    .to_string()
}

/// One test's run: a provider and a run id no other test uses. On drop it
/// removes every container labelled with the run, pass or fail.
struct World {
    provider: DockerProvider,
    run: RunId,
    docker: Docker,
}

impl World {
    /// `None` when no engine answers (the test then passes, see the module docs).
    async fn new(test: &str) -> Option<Self> {
        Self::with(test, |c| c).await
    }

    async fn with(test: &str, tweak: impl FnOnce(DockerConfig) -> DockerConfig) -> Option<Self> {
        if !engine_up().await {
            return None;
        }
        let agent = tokio::task::spawn_blocking(agent_binary).await.unwrap();
        let config = tweak(DockerConfig {
            daemon_ticket: "not-a-ticket".to_owned().into(),
            token_secret: SECRET,
            stop_grace: Duration::from_secs(2),
            ..DockerConfig::new(agent)
        });
        let provider = DockerProvider::connect(config).await.unwrap();
        // One build for all tests of the run; the others find the tag.
        static IMAGE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
        let started = Instant::now();
        let tag = IMAGE
            .get_or_try_init(|| provider.agent_image())
            .await
            .unwrap();
        if started.elapsed() > Duration::from_secs(1) {
            eprintln!("agent image {tag} ready in {:.1?}", started.elapsed());
        }
        let docker = provider.engine().clone();
        let run = RunId::new(format!("dt-{test}-{}", std::process::id()));
        let world = Self {
            provider,
            run,
            docker,
        };
        world.cleanup().await;
        Some(world)
    }

    fn key(&self, node: &str, attempt: u64) -> ResourceKey {
        ResourceKey {
            run_id: self.run.clone(),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(attempt),
        }
    }

    /// The run's containers (names without the leading `/`), stopped ones too.
    async fn containers(&self) -> Vec<String> {
        containers_of(&self.docker, &self.run).await
    }

    async fn cleanup(&self) {
        remove_all(&self.docker, &self.run).await;
    }
}

async fn containers_of(docker: &Docker, run: &RunId) -> Vec<String> {
    let options = ListContainersOptions {
        all: true,
        filters: Some(HashMap::from([(
            "label".to_owned(),
            vec![format!("{LABEL_RUN}={run}")],
        )])),
        ..Default::default()
    };
    let mut names: Vec<String> = docker
        .list_containers(Some(options))
        .await
        .unwrap()
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .map(|n| n.trim_start_matches('/').to_owned())
        .collect();
    names.sort();
    names
}

async fn remove_all(docker: &Docker, run: &RunId) {
    for name in containers_of(docker, run).await {
        let options = RemoveContainerOptions {
            force: true,
            v: true,
            ..Default::default()
        };
        let _ = docker.remove_container(&name, Some(options)).await;
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // The test's runtime may be gone or busy: clean up on a thread of its own.
        let run = self.run.clone();
        let host = self.provider.host().to_owned();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(docker) = Docker::connect_with_host(&host) {
                    remove_all(&docker, &run).await;
                }
            });
        });
        let _ = done.join();
    }
}

fn template(params: &[(&str, ParamValue)], env: &[(&str, &str)]) -> NodeTemplate {
    NodeTemplate {
        provider: ProviderShape {
            kind: "docker".to_owned(),
            params: params
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            placement: BTreeMap::new(),
        },
        boot: BootParams {
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..BootParams::default()
        },
        role: "worker".to_owned(),
        join: SwarmJoin::default(),
        limits: Default::default(),
    }
}

/// The next event, failing the test on a hang.
async fn next(events: &mut BootstrapEvents) -> Option<BootstrapEvent> {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("no bootstrap event in time")
}

/// Events up to and including the first that `stop` accepts.
async fn events_until(
    events: &mut BootstrapEvents,
    stop: impl Fn(&BootstrapEvent) -> bool,
) -> Vec<BootstrapEvent> {
    let mut seen = Vec::new();
    loop {
        let event = next(events).await.unwrap_or_else(|| {
            panic!("the stream ended before the awaited event; it said {seen:?}")
        });
        let done = stop(&event);
        seen.push(event);
        if done {
            return seen;
        }
    }
}

fn stages(events: &[BootstrapEvent]) -> Vec<BootstrapStage> {
    events
        .iter()
        .filter_map(|e| match e {
            BootstrapEvent::Stage(s) => Some(*s),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_started_container_streams_the_agent_stages_and_its_failure() {
    let Some(w) = World::new("stages").await else {
        return;
    };
    let key = w.key("w-0", 1);
    let t = template(
        &[("memory_mb", ParamValue::Int(256))],
        &[("RUST_LOG", "info")],
    );
    let started = Instant::now();
    let grant = w.provider.create_lease(&key, &t).await.unwrap();
    let endpoint = grant.endpoint.clone().unwrap();
    let name = DockerProvider::container_name(&key);
    assert_eq!(name, format!("swactor_{}_w-0_a1", w.run));
    assert_eq!(grant.lease.0, format!("docker:{name}"));

    // Created, not started, labelled for its key, on the host's network.
    let c = w.docker.inspect_container(&name, None).await.unwrap();
    let state = c.state.clone().unwrap();
    assert_eq!(state.running, Some(false));
    let labels = c.config.as_ref().unwrap().labels.clone().unwrap();
    assert_eq!(labels[LABEL_RUN], w.run.as_str());
    assert_eq!(labels[LABEL_NODE], "w-0");
    assert_eq!(labels[LABEL_ATTEMPT], "1");
    assert_eq!(labels[LABEL_GROUP], "w");
    let host = c.host_config.clone().unwrap();
    assert_eq!(host.network_mode.as_deref(), Some("host"));
    assert_eq!(host.memory, Some(256 << 20));

    let mut session = w
        .provider
        .start_bootstrap(&key, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert!(
        session
            .session
            .0
            .starts_with(&format!("{}#", grant.lease.0))
    );
    let seen = events_until(&mut session.events, |e| {
        matches!(e, BootstrapEvent::Failed { .. })
    })
    .await;
    eprintln!("create to failure in {:.1?}", started.elapsed());
    assert_eq!(
        stages(&seen),
        [BootstrapStage::BootCheck, BootstrapStage::SwactorStart]
    );
    match seen.last().unwrap() {
        BootstrapEvent::Failed { stage, reason } => {
            assert_eq!(*stage, BootstrapStage::SwactorStartFailed);
            assert!(reason.contains("bad daemon ticket"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The agent reported its failure, so its exit only closes the stream.
    assert_eq!(
        next(&mut session.events).await,
        Some(BootstrapEvent::Closed)
    );
    assert_eq!(next(&mut session.events).await, None);

    // The secrets were never in the container's environment or command line.
    let c = w.docker.inspect_container(&name, None).await.unwrap();
    let creds = AgentCredentials::derive(&SECRET, &key);
    let config = c.config.unwrap();
    let shown = format!("{:?} {:?} {:?}", config.env, config.cmd, config.entrypoint);
    assert!(shown.contains("RUST_LOG=info"), "{shown}");
    assert!(shown.contains("--credentials"), "{shown}");
    assert!(
        !shown.contains(&creds.token),
        "the join token leaked: {shown}"
    );
    assert_eq!(c.state.unwrap().exit_code, Some(1));
}

#[tokio::test]
async fn an_agent_takes_its_credentials_and_cancel_stops_its_running_container() {
    let Some(w) = World::with("cancel", |c| DockerConfig {
        daemon_ticket: dead_ticket().into(),
        ..c
    })
    .await
    else {
        return;
    };
    let key = w.key("w-0", 2);
    let t = template(&[], &[]);
    let grant = w.provider.create_lease(&key, &t).await.unwrap();
    let endpoint = grant.endpoint.clone().unwrap();
    let mut session = w
        .provider
        .start_bootstrap(&key, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    // Reaching `join` means the agent read its credentials (without them it
    // fails at `swactor-start`); it then keeps dialling the absent daemon.
    let seen = events_until(&mut session.events, |e| {
        matches!(
            e,
            BootstrapEvent::Stage(BootstrapStage::Join) | BootstrapEvent::Failed { .. }
        )
    })
    .await;
    assert_eq!(
        seen.last(),
        Some(&BootstrapEvent::Stage(BootstrapStage::Join)),
        "{seen:?}"
    );
    let name = DockerProvider::container_name(&key);
    // The agent removed the file once read.
    let mut gone = w.docker.download_from_container(
        &name,
        Some(DownloadFromContainerOptions {
            path: "/swactor/agent.credentials".to_owned(),
        }),
    );
    let err = gone.next().await.unwrap().unwrap_err();
    assert!(
        err.to_string().contains("404") || err.to_string().to_lowercase().contains("no such"),
        "{err}"
    );

    // A running container is a session in the listing, and a second start adopts it.
    let listed = w.provider.list(&w.run).await.unwrap();
    assert_eq!(listed[&key].session.as_ref(), Some(&session.session));
    let mut adopted = w
        .provider
        .start_bootstrap(&key, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    assert_eq!(adopted.session, session.session);
    let replayed = events_until(&mut adopted.events, |e| {
        *e == BootstrapEvent::Stage(BootstrapStage::Join)
    })
    .await;
    assert_eq!(stages(&replayed).len(), 3, "{replayed:?}");
    // The adopting stream replaces the first one, which ends.
    assert_eq!(next(&mut session.events).await, None);

    let started = Instant::now();
    w.provider
        .cancel_bootstrap(&key, &adopted.session)
        .await
        .unwrap();
    eprintln!("cancel took {:.1?}", started.elapsed());
    let c = w.docker.inspect_container(&name, None).await.unwrap();
    assert_eq!(c.state.unwrap().running, Some(false));
    assert_eq!(
        next(&mut adopted.events).await,
        Some(BootstrapEvent::Closed)
    );
    assert_eq!(next(&mut adopted.events).await, None);
    let listed = w.provider.list(&w.run).await.unwrap();
    assert_eq!(listed[&key].session, None);
    assert!(listed[&key].lease.is_some());
    // Cancelling again, or a session that is over, is success.
    w.provider
        .cancel_bootstrap(&key, &adopted.session)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_retried_create_adopts_the_container_and_list_finds_it() {
    let Some(w) = World::new("adopt").await else {
        return;
    };
    let key = w.key("w-3", 4);
    let t = template(&[], &[]);
    // Two providers (two daemons on one engine) creating at once, and
    // retries: one container. Unless one sees the other's container first,
    // the later create meets a name in use (409) and adopts.
    let again = DockerProvider::connect(DockerConfig {
        daemon_ticket: "not-a-ticket".to_owned().into(),
        token_secret: SECRET,
        ..DockerConfig::new(agent_binary())
    })
    .await
    .unwrap();
    let (a, b) = tokio::join!(
        w.provider.create_lease(&key, &t),
        again.create_lease(&key, &t)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a, b);
    assert_eq!(w.provider.create_lease(&key, &t).await.unwrap(), a);
    assert_eq!(w.containers().await, [DockerProvider::container_name(&key)]);

    let listed = w.provider.list(&w.run).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[&key].lease.as_ref(), Some(&a.lease));
    assert_eq!(listed[&key].session, None);
    assert_eq!(
        w.provider.lookup_endpoint(&key, &a.lease).await.unwrap(),
        a.endpoint.clone().unwrap()
    );
    // Another attempt of the slot is another container.
    let next_attempt = w.key("w-3", 5);
    w.provider.create_lease(&next_attempt, &t).await.unwrap();
    assert_eq!(w.provider.list(&w.run).await.unwrap().len(), 2);
    // Another run's listing does not see them.
    assert!(
        w.provider
            .list(&RunId::new(format!("{}-other", w.run.as_str())))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn destroy_removes_the_container_and_a_second_destroy_succeeds() {
    let Some(w) = World::new("destroy").await else {
        return;
    };
    let key = w.key("w-0", 1);
    let t = template(&[], &[]);
    let grant = w.provider.create_lease(&key, &t).await.unwrap();
    let endpoint = grant.endpoint.clone().unwrap();
    let _session = w
        .provider
        .start_bootstrap(&key, &grant.lease, &endpoint, &t)
        .await
        .unwrap();
    // Destroy removes even a container that runs (or has just run).
    w.provider.destroy_lease(&key, &grant.lease).await.unwrap();
    assert!(w.containers().await.is_empty());
    assert!(w.provider.list(&w.run).await.unwrap().is_empty());
    w.provider.destroy_lease(&key, &grant.lease).await.unwrap();
    assert!(matches!(
        w.provider.lookup_endpoint(&key, &grant.lease).await,
        Err(ProviderError::Gone(_))
    ));
    assert!(matches!(
        w.provider
            .start_bootstrap(&key, &grant.lease, &endpoint, &t)
            .await,
        Err(ProviderError::Gone(_))
    ));
}

#[tokio::test]
async fn a_container_of_another_key_is_never_adopted_or_removed() {
    let Some(w) = World::new("foreign").await else {
        return;
    };
    let key = w.key("w-0", 1);
    let name = DockerProvider::container_name(&key);
    // A container of the key's name whose labels name another attempt.
    let labels = HashMap::from([
        (LABEL_RUN.to_owned(), w.run.as_str().to_owned()),
        (LABEL_NODE.to_owned(), "w-0".to_owned()),
        (LABEL_ATTEMPT.to_owned(), "9".to_owned()),
    ]);
    let body = bollard::models::ContainerCreateBody {
        image: Some(w.provider.agent_image().await.unwrap()),
        entrypoint: Some(vec!["/swactor/swactor-agent".to_owned()]),
        labels: Some(labels),
        ..Default::default()
    };
    let options = bollard::query_parameters::CreateContainerOptions {
        name: Some(name.clone()),
        ..Default::default()
    };
    w.docker
        .create_container(Some(options), body)
        .await
        .unwrap();
    let t = template(&[], &[]);
    for result in [
        w.provider.create_lease(&key, &t).await.map(|_| ()),
        w.provider
            .destroy_lease(
                &key,
                &swactor_provisioning::LeaseId::from(format!("docker:{name}")),
            )
            .await
            .map(|_| ()),
    ] {
        match result {
            Err(ProviderError::Definite(why)) => {
                assert_eq!(why.kind(), FaultKind::NotOurs, "{why}");
                assert!(why.message().contains("belongs to"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(w.containers().await, [name]);
}

#[tokio::test]
async fn an_image_the_engine_lacks_is_a_definite_error() {
    let Some(w) = World::new("noimage").await else {
        return;
    };
    let key = w.key("w-0", 1);
    let t = template(
        &[(
            "image",
            ParamValue::Str("swactor-test-no-such-image:1".to_owned()),
        )],
        &[],
    );
    match w.provider.create_lease(&key, &t).await {
        Err(ProviderError::Definite(why)) => {
            assert_eq!(why.kind(), FaultKind::Invalid, "{why}");
            // The words tell the user what to do.
            assert!(
                why.message()
                    .contains("image swactor-test-no-such-image:1 is not on the Docker engine"),
                "{why}"
            );
            assert!(why.message().contains("no registry is used"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert!(w.containers().await.is_empty());
}

#[tokio::test]
async fn bad_group_options_are_refused_before_anything_is_made() {
    let Some(w) = World::new("badopts").await else {
        return;
    };
    let key = w.key("w-0", 1);
    let mount = |m: &str| {
        (
            "mounts",
            ParamValue::List(vec![ParamValue::Str(m.to_owned())]),
        )
    };
    for (t, expected) in [
        (
            template(&[mount("/nonexistent/swactor-docker-test:/data")], &[]),
            "/nonexistent/swactor-docker-test does not exist",
        ),
        (
            template(&[], &[("BAD-NAME", "x")]),
            "\"BAD-NAME\" is invalid",
        ),
        (
            template(&[("memory_mb", ParamValue::Int(16))], &[]),
            "under 32 MB is refused",
        ),
    ] {
        match w.provider.create_lease(&key, &t).await {
            Err(ProviderError::Definite(why)) => {
                assert_eq!(why.kind(), FaultKind::Invalid, "{why}");
                // The words name the option at fault.
                assert!(why.message().contains(expected), "{why}");
            }
            other => panic!("{expected}: {other:?}"),
        }
    }
    assert!(w.containers().await.is_empty());
}

#[tokio::test]
async fn an_agent_that_exits_unannounced_fails_its_stream_with_the_exit_code() {
    let Some(w) = World::with("exitcode", |c| DockerConfig {
        agent_args: vec!["agent".to_owned(), "--no-such-flag".to_owned()],
        ..c
    })
    .await
    else {
        return;
    };
    let key = w.key("w-0", 1);
    let t = template(&[], &[]);
    let grant = w.provider.create_lease(&key, &t).await.unwrap();
    let mut session = w
        .provider
        .start_bootstrap(&key, &grant.lease, &grant.endpoint.unwrap(), &t)
        .await
        .unwrap();
    match next(&mut session.events).await {
        Some(BootstrapEvent::Failed { stage, reason }) => {
            assert_eq!(stage, BootstrapStage::AgentLost);
            assert!(reason.contains("exited with code 1"), "{reason}");
            assert!(reason.contains("--no-such-flag"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(next(&mut session.events).await, None);
}

#[tokio::test]
async fn an_unreachable_engine_is_a_clear_error() {
    let config = DockerConfig {
        daemon_ticket: "t".to_owned().into(),
        token_secret: SECRET,
        docker_host: Some("unix:///nonexistent".to_owned()),
        // Any file will do: the engine is never reached.
        ..DockerConfig::new("/proc/self/exe")
    };
    let err = DockerProvider::connect(config).await.unwrap_err();
    assert!(
        matches!(err, DockerError::EngineUnreachable { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("unix:///nonexistent"), "{text}");
    assert!(text.contains("is dockerd running"), "{text}");
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(source.contains("nonexistent"), "{source}");
}

#[tokio::test]
async fn a_groups_own_image_gets_the_agent_copied_in() {
    let Some(w) = World::new("ownimage").await else {
        return;
    };
    // An image with an empty file system (an empty tar), made here: no
    // registry, and no agent in it until the provider copies one in.
    let image = "swactor-test-empty:1";
    let options = bollard::query_parameters::CreateImageOptions {
        from_src: Some("-".to_owned()),
        repo: Some("swactor-test-empty".to_owned()),
        tag: Some("1".to_owned()),
        ..Default::default()
    };
    let empty = bollard::body_full(vec![0u8; 1024].into());
    let mut import = w.docker.create_image(Some(options), Some(empty), None);
    while let Some(step) = import.next().await {
        step.unwrap();
    }
    let key = w.key("own-0", 1);
    let t = template(&[("image", ParamValue::Str(image.to_owned()))], &[]);
    let grant = w.provider.create_lease(&key, &t).await.unwrap();
    let mut session = w
        .provider
        .start_bootstrap(&key, &grant.lease, &grant.endpoint.clone().unwrap(), &t)
        .await
        .unwrap();
    let seen = events_until(&mut session.events, |e| {
        matches!(e, BootstrapEvent::Failed { .. })
    })
    .await;
    assert_eq!(stages(&seen).len(), 2, "{seen:?}");
    match seen.last().unwrap() {
        BootstrapEvent::Failed { stage, reason } => {
            assert_eq!(*stage, BootstrapStage::SwactorStartFailed);
            assert!(reason.contains("bad daemon ticket"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let c = w
        .docker
        .inspect_container(&DockerProvider::container_name(&key), None)
        .await
        .unwrap();
    assert_eq!(c.config.unwrap().image.as_deref(), Some(image));
    w.provider.destroy_lease(&key, &grant.lease).await.unwrap();
    // Another run of this test may be using it still; then it stays.
    let _ = w
        .docker
        .remove_image(
            image,
            Some(bollard::query_parameters::RemoveImageOptions {
                force: true,
                ..Default::default()
            }),
            None,
        )
        .await;
}

#[tokio::test]
async fn two_providers_building_one_agent_image_at_once_leave_no_untagged_copy() {
    if !engine_up().await {
        return;
    }
    let agent = tokio::task::spawn_blocking(agent_binary).await.unwrap();
    // A repository of this test's own, so both builds really run.
    let repository = format!("swactor-agent-race-{}", std::process::id());
    let provider = || {
        DockerProvider::connect(DockerConfig {
            daemon_ticket: "not-a-ticket".to_owned().into(),
            token_secret: SECRET,
            image_repository: repository.clone(),
            ..DockerConfig::new(agent.clone())
        })
    };
    let (a, b) = (provider().await.unwrap(), provider().await.unwrap());
    let (ta, tb) = tokio::join!(a.agent_image(), b.agent_image());
    let (ta, tb) = (ta.unwrap(), tb.unwrap());
    assert_eq!(ta, tb);
    let docker = a.engine().clone();
    let hash_label = docker
        .inspect_image(&ta)
        .await
        .unwrap()
        .config
        .and_then(|c| c.labels)
        .and_then(|l| l.get("swactor.agent-blake3").cloned())
        .expect("the image carries the agent's hash");
    let untagged = docker
        .list_images(Some(bollard::query_parameters::ListImagesOptions {
            filters: Some(HashMap::from([
                ("dangling".to_owned(), vec!["true".to_owned()]),
                (
                    "label".to_owned(),
                    vec![format!("swactor.agent-blake3={hash_label}")],
                ),
            ])),
            ..Default::default()
        }))
        .await
        .unwrap();
    let _ = docker
        .remove_image(
            &ta,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await;
    assert!(
        untagged.is_empty(),
        "untagged agent images left: {untagged:#?}"
    );
}
