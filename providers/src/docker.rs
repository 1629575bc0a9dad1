//! The `docker` provider: each node is a container on the local Docker engine, its agent the container's process.
//!
//! - **Image.** By default nodes run the agent image, which the provider
//!   builds on first use from the static agent binary alone (`FROM scratch`,
//!   the binary at `/swactor/swactor-agent`) and tags by the binary's content,
//!   `{image_repository}:{first 16 hex digits of its BLAKE3 hash}`; an image of
//!   that tag already on the engine is reused. No registry is ever contacted.
//!   A group may name its own image (`image`, which must already be on the
//!   engine); the agent binary is then copied into each container before it
//!   starts, to the same path.
//! - **Lease.** A container named `swactor_{run}_{node}_a{attempt}` (ids
//!   cannot hold `_`, so distinct keys never share a name), labelled
//!   `swactor.run`, `swactor.node`, `swactor.attempt` and `swactor.group`,
//!   created but not started, on the host's network (its traffic to a local
//!   daemon stays on loopback), with no restart policy and a small init
//!   process (`docker-init`) that passes signals on and reaps what the agent
//!   leaves. The name is the idempotency token: a create that finds it taken
//!   (409) adopts the container if its labels name the same key, and fails
//!   definitely otherwise. The lease id and endpoint are `docker:{name}`.
//! - **Bootstrap.** The attempt's [`AgentCredentials`] are copied into the
//!   container (`/swactor/agent.credentials`, mode 0600, through the archive
//!   upload API) and the container is started; the agent reads and removes
//!   the file, so the secrets are never in the container's environment, its
//!   command line or a host file. The session is `docker:{name}#{StartedAt}`
//!   and streams the agent's protocol lines from the container's log, from
//!   that start on. When the container stops, an agent that did not report
//!   its failure fails the stream with the exit code, `OOMKilled` when the
//!   engine says so, and its last output lines. A running container is
//!   adopted: its fresh stream replays the log of its current start.
//! - **Cancel** stops the container (SIGTERM, then SIGKILL after
//!   [`DockerConfig::stop_grace`]); **destroy** removes it by force with its
//!   anonymous volumes. A container already gone is success for both.
//! - **List** finds the run's containers by the `swactor.run` label; a
//!   running one is a session.
//!
//! # Group parameters
//!
//! `image` (a local image name), `memory_mb` (at least [`MEMORY_MB_MIN`]; no
//! swap on top), `cpus` (a number, fractions allowed), and `mounts`: a list
//! of `"host:container[:rw]"`, read-only unless `:rw`, whose host paths must
//! exist. The template's `boot.env` becomes the container's environment.
//! [`check_template`] checks them all.
//!
//! # The agent's command line
//!
//! ```text
//! /swactor/swactor-agent {agent_args…} --run {run} --node {node} --attempt {n}
//!     --daemon {daemon_ticket} --credentials /swactor/agent.credentials
//!     --dir /swactor [--boot-check={arg}]… --boot-timeout-s={seconds}
//! ```
//!
//! as the [`crate::process`] provider starts it, with `/swactor` for the node directory.
//!
//! # Caveats
//!
//! - The agent binary must be statically linked (`scripts/build-static-agent.sh`):
//!   the agent image holds nothing else, and a group's own image may lack the
//!   C library the binary was built against. A dynamically linked binary is refused.
//! - A group's own image whose `USER` is not root must still let that user
//!   read the uploaded files: they are copied with the container user's ids.
//! - Calls for one container are serialised within one provider (and its
//!   clones); two daemons on one engine could still race a start.
//!
//! Over 1,000 lines in one file because the contract's methods share the
//! container names, labels and per-key locks; options, follow and the image
//! build already live in `docker/`.

#![cfg(all(target_os = "linux", feature = "docker"))]

mod follow;
mod on_demand;
mod options;
mod tar;

pub use on_demand::DockerOnDemand;

pub use options::{CPUS_MAX, MEMORY_MB_MAX, MEMORY_MB_MIN, MOUNTS_MAX, check_template};

use crate::Release;
use crate::credentials::{AgentCredentials, CREDENTIALS_FILE};
use crate::kit::{KeyGuard, KeyLocks, Sessions};
use crate::lock;
use crate::{
    AgentLogSource, BootstrapSession, FaultKind, Inventory, LeaseGrant, OwnedResources, Provider,
    ProviderError,
};
use async_trait::async_trait;
use bollard::Docker;
use bollard::errors::Error as EngineError;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, HostConfig, RestartPolicy, RestartPolicyNameEnum,
};
use bollard::query_parameters::{
    BuildImageOptions, CreateContainerOptions, ListContainersOptions, ListImagesOptions,
    RemoveContainerOptions, RemoveImageOptions, StopContainerOptions, UploadToContainerOptions,
};
use futures_util::StreamExt;
use options::NodeOptions;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use swactor_provisioning::{
    LeaseId, LogicalNodeId, NodeAttemptId, NodeEndpoint, NodeTemplate, ResourceKey, RunId,
    SessionId, validate_id,
};

/// Default of [`DockerConfig::stop_grace`].
pub const STOP_GRACE_DEFAULT: Duration = Duration::from_secs(5);
/// Longest accepted [`DockerConfig::stop_grace`].
pub const STOP_GRACE_MAX: Duration = Duration::from_secs(600);
/// Default of [`DockerConfig::image_repository`].
pub const IMAGE_REPOSITORY_DEFAULT: &str = "swactor-agent";

/// Label naming the run a container belongs to.
pub const LABEL_RUN: &str = "swactor.run";
/// Label naming the node (slot) a container serves.
pub const LABEL_NODE: &str = "swactor.node";
/// Label naming the attempt a container was made for.
pub const LABEL_ATTEMPT: &str = "swactor.attempt";
/// Label naming the node's group.
pub const LABEL_GROUP: &str = "swactor.group";
/// Label naming the deployment (the journal) that made a container; absent
/// on containers made before deployments were recorded.
pub const LABEL_DEPLOYMENT: &str = "swactor.deployment";

/// Where the agent binary is in a node's container.
pub const AGENT_PATH: &str = "/swactor/swactor-agent";
/// The agent's directory in a node's container (its `--dir`).
const AGENT_DIR: &str = "/swactor";
/// The engine's default Unix socket, used when `DOCKER_HOST` is not set.
const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";
/// How often, and how many times, a create that found its name taken looks
/// for the container that took it.
const ADOPT_POLL_INTERVAL: Duration = Duration::from_millis(100);
const ADOPT_POLLS: u32 = 100;
/// How late a container may appear in a listing. The engine finishes a
/// create whose caller went away (a daemon killed mid-request), so such a
/// container can appear after the caller's successor has listed. It is
/// given as long as a create that found its name reserved waits for the
/// container that reserved it (`ADOPT_POLLS` × `ADOPT_POLL_INTERVAL`).
pub const LISTING_LAG: Duration = Duration::from_secs(10);
/// How long an engine request may wait for its answer's headers, beyond a stop's grace.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Settings of a [`DockerProvider`].
#[derive(Clone, Debug)]
pub struct DockerConfig {
    /// The statically linked agent executable (the `swactor` binary).
    pub agent_binary: PathBuf,
    /// Arguments placed before the per-node ones (e.g. `["agent"]`).
    pub agent_args: Vec<String>,
    /// Passed to the agent as `--daemon`: how it reaches this daemon.
    pub daemon_ticket: crate::DaemonTicket,
    /// The secret agents' credentials derive from (see [`AgentCredentials`]).
    pub token_secret: [u8; 32],
    /// How long a stopping container gets between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// The repository the agent image is tagged in.
    pub image_repository: String,
    /// The engine's address (`unix:///…`, `tcp://…`); `None` reads
    /// `DOCKER_HOST`, falling back to the default socket.
    pub docker_host: Option<String>,
    /// The daemon's deployment: its containers' names and labels carry it,
    /// and a container of the run made for another deployment (or for
    /// none, when this is `Some`) is foreign: never adopted or removed.
    pub deployment: Option<String>,
}

impl DockerConfig {
    /// A configuration running `agent_binary` with `["agent"]`, the default
    /// grace and repository, and the engine `DOCKER_HOST` names. The daemon
    /// ticket and the token secret start empty and must be set (use struct
    /// update syntax): [`Self::validate`] rejects them until they are.
    pub fn new(agent_binary: impl Into<PathBuf>) -> Self {
        Self {
            agent_binary: agent_binary.into(),
            agent_args: vec!["agent".to_owned()],
            daemon_ticket: crate::DaemonTicket::default(),
            token_secret: [0; 32],
            stop_grace: STOP_GRACE_DEFAULT,
            image_repository: IMAGE_REPOSITORY_DEFAULT.to_owned(),
            docker_host: None,
            deployment: None,
        }
    }

    /// Checks every field, including that the agent binary is a file.
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), DockerError> {
        if self.daemon_ticket.is_empty() {
            return Err(DockerError::EmptyField {
                field: "daemon_ticket",
            });
        }
        if self.token_secret == [0; 32] {
            return Err(DockerError::ZeroTokenSecret);
        }
        if let Some(d) = &self.deployment {
            crate::check_deployment(d).map_err(DockerError::BadDeployment)?;
        }
        if self.stop_grace > STOP_GRACE_MAX {
            return Err(DockerError::BadGrace {
                value: self.stop_grace,
            });
        }
        let repo = &self.image_repository;
        if repo.is_empty()
            || !repo
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-/".contains(c))
        {
            return Err(DockerError::BadRepository {
                value: repo.clone(),
            });
        }
        if !self.agent_binary.is_file() {
            return Err(DockerError::AgentBinaryMissing {
                path: self.agent_binary.clone(),
            });
        }
        Ok(())
    }
}

/// Why a [`DockerProvider`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// A required setting is empty.
    #[error("{field} must not be empty")]
    EmptyField {
        /// The field.
        field: &'static str,
    },
    /// The token secret is all zeros (the unset value), so anyone could forge join tokens.
    #[error("token_secret is all zeros; it must be a random 32-byte key")]
    ZeroTokenSecret,
    /// The deployment is not a deployment id.
    #[error("{0}")]
    BadDeployment(String),
    /// The stop grace is too long.
    #[error("stop_grace is {value:?}; the most accepted is {STOP_GRACE_MAX:?}")]
    BadGrace {
        /// The rejected value.
        value: Duration,
    },
    /// The image repository is not one the engine accepts.
    #[error("image_repository {value:?} must be lowercase letters, digits and `._-/`")]
    BadRepository {
        /// The rejected value.
        value: String,
    },
    /// The agent binary is not a file.
    #[error("agent binary {} does not exist (build it with scripts/build-static-agent.sh)", path.display())]
    AgentBinaryMissing {
        /// The configured path.
        path: PathBuf,
    },
    /// The engine does not answer at its address.
    #[error(
        "cannot reach the Docker engine at {host} ({origin}); is dockerd running, and may this user use its socket?"
    )]
    EngineUnreachable {
        /// The address tried.
        host: String,
        /// Where the address came from.
        origin: &'static str,
        /// What the client said.
        #[source]
        source: EngineError,
    },
}

struct Shared {
    config: DockerConfig,
    docker: Docker,
    /// The engine's address, for messages.
    host: String,
    /// The agent image's tag, once built or found.
    image: tokio::sync::OnceCell<String>,
    /// Open session streams.
    sessions: Sessions<()>,
    /// Serialises the calls for one container.
    key_locks: KeyLocks<String>,
    /// The engine's id of each container seen, by name, for statuses.
    ids: Mutex<HashMap<String, String>>,
    /// The run's containers of other deployments, as last listed.
    foreign: Mutex<Vec<crate::ForeignResource>>,
}

/// The Docker provider. Cheap to clone; clones share state.
///
/// # Guarantees
/// - One container per [`ResourceKey`]: creates adopt the container of the
///   key's name, also across daemon restarts.
/// - Never touches a container whose labels name another key.
/// - Session streams never lose lines: the follower waits for a slow reader.
#[derive(Clone)]
pub struct DockerProvider {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DockerProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerProvider")
            .field("host", &self.shared.host)
            .finish_non_exhaustive()
    }
}

impl DockerProvider {
    /// Connects to the engine and agrees on an API version with it.
    ///
    /// # Errors
    /// An invalid config, or an engine that does not answer.
    pub async fn connect(config: DockerConfig) -> Result<Self, DockerError> {
        config.validate()?;
        let (host, origin) = match &config.docker_host {
            Some(h) => (h.clone(), "from the provider's configuration"),
            None => match std::env::var("DOCKER_HOST") {
                Ok(h) if !h.is_empty() => (h, "from DOCKER_HOST"),
                _ => (
                    DEFAULT_SOCKET.to_owned(),
                    "the default socket; set DOCKER_HOST to use another",
                ),
            },
        };
        let unreachable = |source| DockerError::EngineUnreachable {
            host: host.clone(),
            origin,
            source,
        };
        let timeout = REQUEST_TIMEOUT + config.stop_grace;
        let docker = Docker::connect_with_host(&host)
            .map_err(unreachable)?
            .with_timeout(timeout)
            .negotiate_version()
            .await
            .map_err(unreachable)?;
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                docker,
                host,
                image: tokio::sync::OnceCell::new(),
                sessions: Sessions::new(),
                key_locks: KeyLocks::new(),
                ids: Mutex::new(HashMap::new()),
                foreign: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The engine's address.
    pub fn host(&self) -> &str {
        &self.shared.host
    }

    /// The engine client, for tests and tools that look at what the provider made.
    pub fn engine(&self) -> &Docker {
        &self.shared.docker
    }

    /// The container that is (or would be) `key`'s lease for a provider of
    /// no deployment (see [`DockerConfig::deployment`]).
    pub fn container_name(key: &ResourceKey) -> String {
        Self::container_name_in(key, None)
    }

    /// The container that is (or would be) `key`'s lease in `deployment`:
    /// `swactor_{run}_{node}_a{n}`, with `_{deployment}` after it when
    /// there is one (ids cannot hold `_`, so the two forms never meet).
    pub fn container_name_in(key: &ResourceKey, deployment: Option<&str>) -> String {
        match deployment {
            Some(d) => format!("swactor_{}_{}_{}_{d}", key.run_id, key.node, key.attempt),
            None => format!("swactor_{}_{}_{}", key.run_id, key.node, key.attempt),
        }
    }

    /// The agent image's tag, building the image if the engine lacks it.
    ///
    /// # Errors
    /// The binary cannot be read or is not static, or the build fails.
    pub async fn agent_image(&self) -> Result<String, ProviderError> {
        self.shared
            .image
            .get_or_try_init(|| self.build_agent_image())
            .await
            .cloned()
    }

    async fn build_agent_image(&self) -> Result<String, ProviderError> {
        let binary = self.read_agent().await?;
        // BLAKE3 rather than SHA-256: its SIMD code is fast even in unoptimised builds.
        let hash = blake3::hash(&binary).to_hex();
        let tag = format!("{}:{}", self.shared.config.image_repository, &hash[..16]);
        let docker = &self.shared.docker;
        match docker.inspect_image(&tag).await {
            Ok(_) => return Ok(tag),
            Err(e) if status(&e) == Some(404) => {}
            Err(e) => return Err(self.definite(format!("cannot look up image {tag}"), &e)),
        }
        let dockerfile = format!(
            "FROM scratch\nCOPY swactor-agent {AGENT_PATH}\nLABEL swactor.agent-blake3={hash}\n"
        );
        let mut context = tar::TarWriter::with_capacity(binary.len());
        context.file("Dockerfile", 0o644, dockerfile.as_bytes());
        context.file("swactor-agent", 0o755, &binary);
        drop(binary);
        let options = BuildImageOptions {
            t: Some(tag.clone()),
            rm: true,
            forcerm: true,
            ..Default::default()
        };
        let body = bollard::body_full(context.finish().into());
        let mut build = docker.build_image(options, None, Some(body));
        while let Some(step) = build.next().await {
            match step {
                Ok(info) => {
                    if let Some(detail) = info.error_detail {
                        return Err(ProviderError::definite(
                            FaultKind::Service,
                            format!(
                                "building the agent image {tag} failed: {}",
                                detail.message.unwrap_or_default()
                            ),
                        ));
                    }
                    if let Some(line) = info
                        .stream
                        .as_deref()
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                    {
                        tracing::debug!(%tag, line, "building the agent image");
                    }
                }
                Err(e) => {
                    return Err(self.definite(format!("building the agent image {tag} failed"), &e));
                }
            }
        }
        docker
            .inspect_image(&tag)
            .await
            .map_err(|e| self.definite(format!("the build did not leave image {tag}"), &e))?;
        tracing::info!(%tag, "built the agent image");
        self.remove_untagged_builds(&hash).await;
        Ok(tag)
    }

    /// Removes images of this agent left without a tag: two processes that
    /// build the same tag at once each make an image, and the tag ends on
    /// one of them. Only unused ones go (no force); failures are ignored.
    async fn remove_untagged_builds(&self, hash: &str) {
        let docker = &self.shared.docker;
        let options = ListImagesOptions {
            filters: Some(HashMap::from([
                ("dangling".to_owned(), vec!["true".to_owned()]),
                (
                    "label".to_owned(),
                    vec![format!("swactor.agent-blake3={hash}")],
                ),
            ])),
            ..Default::default()
        };
        let Ok(untagged) = docker.list_images(Some(options)).await else {
            return;
        };
        for image in untagged {
            if let Err(e) = docker
                .remove_image(&image.id, None::<RemoveImageOptions>, None)
                .await
            {
                tracing::debug!(id = %image.id, error = %e, "an untagged agent image stays");
            }
        }
    }

    /// The agent binary's bytes, refused when it is dynamically linked.
    async fn read_agent(&self) -> Result<Vec<u8>, ProviderError> {
        let path = self.shared.config.agent_binary.clone();
        let read = tokio::task::spawn_blocking({
            let path = path.clone();
            move || std::fs::read(path)
        })
        .await
        .map_err(|e| {
            ProviderError::definite(
                FaultKind::Local,
                format!("cannot read the agent binary: {e}"),
            )
        })?;
        let binary = read.map_err(|e| {
            ProviderError::definite(
                FaultKind::Local,
                format!("cannot read agent binary {}: {e}", path.display()),
            )
        })?;
        if elf_interpreter(&binary) {
            return Err(ProviderError::definite(
                FaultKind::Invalid,
                format!(
                    "agent binary {} is dynamically linked; a container needs a static one (scripts/build-static-agent.sh)",
                    path.display()
                ),
            ));
        }
        Ok(binary)
    }

    /// Checks the key can name a container; returns the name and its lease.
    fn locate(&self, key: &ResourceKey) -> Result<(String, LeaseId), ProviderError> {
        validate_id(key.run_id.as_str())
            .and_then(|()| validate_id(key.node.group.as_str()))
            .map_err(|e| {
                ProviderError::definite(
                    FaultKind::Invalid,
                    format!("key {key} cannot name a container: {e}"),
                )
            })?;
        let name = Self::container_name_in(key, self.shared.config.deployment.as_deref());
        let lease = LeaseId::from(format!("docker:{name}"));
        Ok((name, lease))
    }

    /// Like [`Self::locate`], also checking `lease` is the key's.
    fn locate_lease(&self, key: &ResourceKey, lease: &LeaseId) -> Result<String, ProviderError> {
        let (name, expected) = self.locate(key)?;
        if *lease != expected {
            return Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!(
                    "lease {} is not key {key}'s (that is {})",
                    lease.0, expected.0
                ),
            ));
        }
        Ok(name)
    }

    async fn lock_key(&self, name: &str) -> KeyGuard<'_, String> {
        self.shared.key_locks.lock(&name.to_owned()).await
    }

    fn definite(&self, what: String, e: &EngineError) -> ProviderError {
        ProviderError::definite(engine_kind(e), format!("{what}: {}", self.describe(e)))
    }

    /// A failed change: definite when the engine refused it (a 4xx answer),
    /// of unknown outcome otherwise.
    fn refused_or_unknown(&self, what: String, e: &EngineError) -> ProviderError {
        match status(e) {
            Some(400..=499) => self.definite(what, e),
            _ => ProviderError::ambiguous(engine_kind(e), format!("{what}: {}", self.describe(e))),
        }
    }

    /// The engine's error, naming the engine when it could not be reached.
    fn describe(&self, e: &EngineError) -> String {
        match e {
            EngineError::DockerResponseServerError { message, .. } => message.clone(),
            other => format!(
                "the Docker engine at {} did not answer: {other}",
                self.shared.host
            ),
        }
    }

    /// `name`'s state, `None` when there is no such container; a container
    /// labelled for another key is an error.
    async fn inspect(
        &self,
        key: &ResourceKey,
        name: &str,
    ) -> Result<Option<ContainerInspectResponse>, ProviderError> {
        match self.shared.docker.inspect_container(name, None).await {
            Ok(c) => {
                let labels = c.config.as_ref().and_then(|c| c.labels.as_ref());
                let ours = self.shared.config.deployment.as_deref();
                match labels.map(key_of_labels) {
                    Some(Some((found, deployment)))
                        if found == *key && deployment.as_deref() == ours =>
                    {
                        if let Some(id) = &c.id {
                            lock(&self.shared.ids).insert(name.to_owned(), id.clone());
                        }
                        Ok(Some(c))
                    }
                    Some(Some((found, deployment))) if found == *key => {
                        Err(ProviderError::definite(
                            FaultKind::NotOurs,
                            format!(
                                "container {name} belongs to {}, not to this daemon's {}",
                                deployment_words(deployment.as_deref()),
                                deployment_words(ours)
                            ),
                        ))
                    }
                    Some(Some((found, _))) => Err(ProviderError::definite(
                        FaultKind::NotOurs,
                        format!("container {name} belongs to {found}, not {key}"),
                    )),
                    _ => Err(ProviderError::definite(
                        FaultKind::NotOurs,
                        format!(
                            "container {name} exists but was not made by swactor for {key} (its labels do not say so)"
                        ),
                    )),
                }
            }
            Err(e) if status(&e) == Some(404) => {
                lock(&self.shared.ids).remove(name);
                Ok(None)
            }
            Err(e) => Err(self.definite(format!("cannot inspect container {name}"), &e)),
        }
    }

    fn container_body(
        &self,
        key: &ResourceKey,
        image: String,
        options: &NodeOptions,
        template: &NodeTemplate,
    ) -> ContainerCreateBody {
        let config = &self.shared.config;
        let mut cmd = config.agent_args.clone();
        cmd.extend([
            "--run".to_owned(),
            key.run_id.to_string(),
            "--node".to_owned(),
            key.node.to_string(),
            "--attempt".to_owned(),
            key.attempt.0.to_string(),
            "--daemon".to_owned(),
            config.daemon_ticket.get(),
            "--credentials".to_owned(),
            format!("{AGENT_DIR}/{CREDENTIALS_FILE}"),
            "--dir".to_owned(),
            AGENT_DIR.to_owned(),
        ]);
        // `--boot-check=ARG` keeps an argument that starts with `-` a value.
        cmd.extend(
            template
                .boot
                .boot_check
                .iter()
                .map(|a| format!("--boot-check={a}")),
        );
        cmd.push(format!(
            "--boot-timeout-s={}",
            template.limits.boot_timeout_s
        ));
        let mut labels = HashMap::from([
            (LABEL_RUN.to_owned(), key.run_id.to_string()),
            (LABEL_NODE.to_owned(), key.node.to_string()),
            (LABEL_ATTEMPT.to_owned(), key.attempt.0.to_string()),
            (LABEL_GROUP.to_owned(), key.node.group.to_string()),
        ]);
        if let Some(d) = &config.deployment {
            labels.insert(LABEL_DEPLOYMENT.to_owned(), d.clone());
        }
        let binds: Vec<String> = options
            .mounts
            .iter()
            .map(options::BindMount::bind)
            .collect();
        ContainerCreateBody {
            image: Some(image),
            entrypoint: Some(vec![AGENT_PATH.to_owned()]),
            cmd: Some(cmd),
            env: Some(options.env.clone()),
            labels: Some(labels),
            working_dir: Some(AGENT_DIR.to_owned()),
            host_config: Some(HostConfig {
                network_mode: Some("host".to_owned()),
                restart_policy: Some(RestartPolicy {
                    name: Some(RestartPolicyNameEnum::NO),
                    maximum_retry_count: None,
                }),
                init: Some(true),
                memory: options.memory_bytes,
                // The same as the memory: no swap beyond it.
                memory_swap: options.memory_bytes,
                nano_cpus: options.nano_cpus,
                binds: (!binds.is_empty()).then_some(binds),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Copies the attempt's credentials (and, for a group's own image, the
    /// agent binary) into the stopped container `name`.
    async fn upload(
        &self,
        key: &ResourceKey,
        name: &str,
        own_image: bool,
    ) -> Result<(), ProviderError> {
        let credentials = AgentCredentials::derive(&self.shared.config.token_secret, key);
        let binary = if own_image {
            Some(self.read_agent().await?)
        } else {
            None
        };
        let mut archive = tar::TarWriter::with_capacity(binary.as_ref().map_or(0, Vec::len));
        let dir = AGENT_DIR.trim_start_matches('/');
        archive.dir(dir, 0o755);
        if let Some(binary) = &binary {
            archive.file(&format!("{dir}/swactor-agent"), 0o755, binary);
        }
        archive.file(
            &format!("{dir}/{CREDENTIALS_FILE}"),
            0o600,
            credentials.to_text().as_bytes(),
        );
        drop(binary);
        let options = UploadToContainerOptions {
            path: "/".to_owned(),
            // A group's image may run the agent as another user, who must be able to read them.
            copy_uidgid: own_image.then(|| "1".to_owned()),
            ..Default::default()
        };
        self.shared
            .docker
            .upload_to_container(
                name,
                Some(options),
                bollard::body_full(archive.finish().into()),
            )
            .await
            .map_err(|e| {
                self.refused_or_unknown(
                    format!("cannot copy the agent's files into container {name}"),
                    &e,
                )
            })
    }

    /// Opens a stream for `session` of container `name`, replacing (ending) any earlier one.
    fn open_stream(&self, session: &SessionId, name: &str, started_at: &str) -> BootstrapSession {
        self.shared.sessions.stream(
            session,
            false,
            |_| (),
            |s| {
                follow::Follow {
                    docker: self.shared.docker.clone(),
                    name: name.to_owned(),
                    session: session.clone(),
                    started_at: started_at.to_owned(),
                    cancelled: s.cancelled,
                    tx: s.tx,
                    stop: s.stop,
                }
                .run()
            },
        )
    }

    /// Marks every session of container `name` as stopped on purpose, so
    /// their streams close rather than report a loss.
    fn mark_cancelled(&self, name: &str) {
        let prefix = format!("docker:{name}#");
        self.shared
            .sessions
            .mark_cancelled_where(|id| id.0.starts_with(&prefix));
    }
}

/// The engine's HTTP status for an error it answered with.
/// What kind of fault an engine error is: no answer, a refusal, or the
/// engine's own failure.
fn engine_kind(e: &EngineError) -> FaultKind {
    match status(e) {
        None => FaultKind::Unreachable,
        Some(404) => FaultKind::Deleted,
        Some(400..=499) => FaultKind::Refused,
        Some(_) => FaultKind::Service,
    }
}

fn status(e: &EngineError) -> Option<u16> {
    match e {
        EngineError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// Whether `binary` is a 64-bit little-endian ELF file that names a program
/// interpreter (a dynamic loader). Anything else is not judged.
fn elf_interpreter(binary: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let u16_at = |at: usize| {
        binary
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |at: usize| {
        binary
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |at: usize| {
        binary
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    // Magic, 64-bit class, little-endian.
    if binary.get(..6) != Some(b"\x7fELF\x02\x01") {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    let Ok(phoff) = usize::try_from(phoff) else {
        return false;
    };
    (0..usize::from(count)).any(|i| u32_at(phoff + i * usize::from(entsize)) == Some(PT_INTERP))
}

/// `deployment` in words, for refusals.
fn deployment_words(deployment: Option<&str>) -> String {
    match deployment {
        Some(d) => format!("deployment {d}"),
        None => "no deployment (made before deployments were recorded)".to_owned(),
    }
}

/// The key a container's labels name, and the deployment they carry.
fn key_of_labels(labels: &HashMap<String, String>) -> Option<(ResourceKey, Option<String>)> {
    let run = labels.get(LABEL_RUN)?;
    let node = LogicalNodeId::parse(labels.get(LABEL_NODE)?)?;
    let attempt = labels.get(LABEL_ATTEMPT)?;
    if attempt.starts_with('+') {
        return None;
    }
    let key = ResourceKey {
        run_id: RunId::new(run.clone()),
        node,
        attempt: NodeAttemptId(attempt.parse().ok()?),
    };
    Some((key, labels.get(LABEL_DEPLOYMENT).cloned()))
}

fn session_id(lease: &LeaseId, started_at: &str) -> SessionId {
    SessionId::from(format!("{}#{started_at}", lease.0))
}

/// Whether a container state is one whose process runs.
fn is_running(c: &ContainerInspectResponse) -> bool {
    c.state
        .as_ref()
        .is_some_and(|s| s.running == Some(true) || s.paused == Some(true))
}

fn started_at(c: &ContainerInspectResponse) -> String {
    c.state
        .as_ref()
        .and_then(|s| s.started_at.clone())
        .unwrap_or_default()
}

#[async_trait]
impl Provider for DockerProvider {
    fn kind(&self) -> &'static str {
        "docker"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let bad = |why: String| {
            ProviderError::definite(FaultKind::Invalid, format!("docker provider: {why}"))
        };
        let options = NodeOptions::parse(template).map_err(bad)?;
        options.check_host().map_err(bad)?;
        let (name, lease) = self.locate(key)?;
        let grant = LeaseGrant {
            lease,
            endpoint: Some(NodeEndpoint::from(format!("docker:{name}"))),
        };
        let guard = self.lock_key(&name).await;
        let result = async {
            if self.inspect(key, &name).await?.is_some() {
                return Ok(grant.clone());
            }
            let docker = &self.shared.docker;
            let image = match &options.image {
                None => self.agent_image().await?,
                Some(image) => {
                    match docker.inspect_image(image).await {
                        Ok(_) => {}
                        Err(e) if status(&e) == Some(404) => {
                            return Err(bad(format!(
                                "image {image} is not on the Docker engine at {}; no registry is used, so build or load it there first",
                                self.shared.host
                            )));
                        }
                        Err(e) => return Err(self.definite(format!("cannot look up image {image}"), &e)),
                    }
                    image.clone()
                }
            };
            let body = self.container_body(key, image, &options, template);
            let create = CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            };
            match docker.create_container(Some(create), body).await {
                Ok(_) => {
                    tracing::debug!(%key, container = %name, "created a container");
                    Ok(grant.clone())
                }
                // Made meanwhile (by another daemon on this engine): adopt
                // it if it is this key's.
                // The engine reserves the name before the other create
                // finishes, so the container may not be visible at once.
                Err(e) if status(&e) == Some(409) => {
                    for _ in 0..ADOPT_POLLS {
                        if self.inspect(key, &name).await?.is_some() {
                            return Ok(grant.clone());
                        }
                        tokio::time::sleep(ADOPT_POLL_INTERVAL).await;
                    }
                    Err(ProviderError::ambiguous(FaultKind::Unconfirmed, format!(
                        "container {name} is being made by another call and did not appear: {}",
                        self.describe(&e)
                    )))
                }
                Err(e) => Err(self.refused_or_unknown(format!("cannot create container {name}"), &e)),
            }
        }
        .await;
        drop(guard);
        result
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        let name = self.locate_lease(key, lease)?;
        match self.inspect(key, &name).await? {
            Some(_) => Ok(NodeEndpoint::from(format!("docker:{name}"))),
            None => Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("container {name} does not exist"),
            )),
        }
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        _endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let name = self.locate_lease(key, lease)?;
        let options = NodeOptions::parse(template).map_err(|why| {
            ProviderError::definite(FaultKind::Invalid, format!("docker provider: {why}"))
        })?;
        let _guard = self.lock_key(&name).await;
        let Some(container) = self.inspect(key, &name).await? else {
            return Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("container {name} does not exist"),
            ));
        };
        if is_running(&container) {
            let started = started_at(&container);
            let session = session_id(lease, &started);
            tracing::debug!(session = %session.0, "adopting a running container");
            return Ok(self.open_stream(&session, &name, &started));
        }
        self.upload(key, &name, options.image.is_some()).await?;
        let docker = &self.shared.docker;
        if let Err(e) = docker.start_container(&name, None).await {
            // The engine answers 500 for a start that failed in the runtime
            // (say, a missing executable); whether the container runs is
            // what counts.
            return match self.inspect(key, &name).await {
                Ok(Some(c)) if is_running(&c) => {
                    let started = started_at(&c);
                    Ok(self.open_stream(&session_id(lease, &started), &name, &started))
                }
                Ok(_) => Err(self.definite(format!("cannot start container {name}"), &e)),
                Err(_) => Err(ProviderError::ambiguous(
                    engine_kind(&e),
                    format!("cannot start container {name}: {}", self.describe(&e)),
                )),
            };
        }
        let container = match self.inspect(key, &name).await? {
            Some(c) => c,
            None => {
                return Err(ProviderError::gone(
                    FaultKind::Deleted,
                    format!("container {name} was removed as it started"),
                ));
            }
        };
        let started = started_at(&container);
        let session = session_id(lease, &started);
        tracing::debug!(session = %session.0, "started a container");
        Ok(self.open_stream(&session, &name, &started))
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let (name, lease) = self.locate(key)?;
        let Some(started) = session
            .0
            .strip_prefix(lease.as_str())
            .and_then(|rest| rest.strip_prefix('#'))
        else {
            return Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!("session {} is not a session of key {key}", session.0),
            ));
        };
        let _guard = self.lock_key(&name).await;
        self.mark_cancelled(&name);
        let Some(container) = self.inspect(key, &name).await? else {
            return Ok(Release::Done);
        };
        // A later start is another session, which this cancel must not end.
        if !is_running(&container) || started_at(&container) != started {
            return Ok(Release::Done);
        }
        let grace = i32::try_from(self.shared.config.stop_grace.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptions {
            t: Some(grace),
            ..Default::default()
        };
        match self
            .shared
            .docker
            .stop_container(&name, Some(options))
            .await
        {
            Ok(()) => Ok(Release::Done),
            Err(e) if status(&e) == Some(404) => Ok(Release::Done),
            Err(e) => Err(self.refused_or_unknown(format!("cannot stop container {name}"), &e)),
        }
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let name = self.locate_lease(key, lease)?;
        let guard = self.lock_key(&name).await;
        let result = async {
            // Refuses a container of another key; absent is success.
            if self.inspect(key, &name).await?.is_none() {
                return Ok(());
            }
            self.mark_cancelled(&name);
            let options = RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            };
            match self
                .shared
                .docker
                .remove_container(&name, Some(options))
                .await
            {
                Ok(()) => {
                    tracing::debug!(%key, container = %name, "removed a container");
                    lock(&self.shared.ids).remove(&name);
                    Ok(())
                }
                Err(e) if status(&e) == Some(404) => {
                    lock(&self.shared.ids).remove(&name);
                    Ok(())
                }
                // 409: a removal is already under way; the retry sees it done.
                Err(e) => Err(ProviderError::ambiguous(
                    engine_kind(&e),
                    format!("cannot remove container {name}: {}", self.describe(&e)),
                )),
            }
        }
        .await;
        drop(guard);
        result.map(|()| Release::Done)
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        validate_id(run_id.as_str()).map_err(|e| {
            ProviderError::definite(
                FaultKind::Invalid,
                format!("run {run_id} cannot name containers: {e}"),
            )
        })?;
        let options = ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_owned(),
                vec![format!("{LABEL_RUN}={run_id}")],
            )])),
            ..Default::default()
        };
        let docker = &self.shared.docker;
        let found = docker.list_containers(Some(options)).await.map_err(|e| {
            self.definite(format!("cannot list the containers of run {run_id}"), &e)
        })?;
        let mut inventory = Inventory::new();
        let ours = self.shared.config.deployment.as_deref();
        let mut foreign = Vec::new();
        for summary in found {
            let Some((key, deployment)) = summary.labels.as_ref().and_then(key_of_labels) else {
                tracing::warn!(id = ?summary.id, "ignoring a container of the run whose labels name no key");
                continue;
            };
            if key.run_id == *run_id && deployment.as_deref() != ours {
                let name = summary.names.iter().flatten().next().map_or_else(
                    || summary.id.clone().unwrap_or_default(),
                    |n| n.trim_start_matches('/').to_owned(),
                );
                foreign.push(crate::ForeignResource {
                    provider: "docker".to_owned(),
                    resource: format!("container {name}"),
                    deployment,
                    key: format!("{}/{}", key.node, key.attempt),
                    usd_per_hour_micros: None,
                });
                continue;
            }
            let (name, lease) = self.locate(&key)?;
            let named = summary
                .names
                .iter()
                .flatten()
                .any(|n| n.trim_start_matches('/') == name);
            if key.run_id != *run_id || !named {
                tracing::warn!(id = ?summary.id, names = ?summary.names, "ignoring a container whose name does not match its labels");
                continue;
            }
            // The listing does not say when a container started: ask.
            let session = match self.inspect(&key, &name).await {
                Ok(Some(c)) => is_running(&c).then(|| session_id(&lease, &started_at(&c))),
                Ok(None) => continue,
                Err(e) => return Err(e),
            };
            inventory.insert(
                key,
                OwnedResources {
                    lease: Some(lease),
                    session,
                },
            );
        }
        foreign.sort();
        *lock(&self.shared.foreign) = foreign;
        Ok(inventory)
    }

    fn foreign(&self) -> Vec<crate::ForeignResource> {
        lock(&self.shared.foreign).clone()
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<AgentLogSource, ProviderError> {
        let name = self.locate_lease(key, lease)?;
        if self.inspect(key, &name).await?.is_none() {
            return Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("container {name} no longer exists, and its log went with it"),
            ));
        }
        // The whole log, every start of the container included: what
        // `docker logs` shows.
        let options = bollard::query_parameters::LogsOptions {
            follow,
            stdout: true,
            stderr: true,
            ..Default::default()
        };
        let mut logs = self.shared.docker.logs(&name, Some(options));
        let (tx, rx) = tokio::sync::mpsc::channel(crate::AGENT_LOG_BUFFER_LEN);
        tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    item = logs.next() => item,
                    // Nobody reads any more: stop following.
                    () = tx.closed() => return,
                };
                let piece = match item {
                    None => return,
                    Some(Ok(output)) => {
                        Ok(String::from_utf8_lossy(&output.into_bytes()).into_owned())
                    }
                    Some(Err(e)) => Err(format!(
                        "reading the log of container {name} broke off: {e}"
                    )),
                };
                let last = piece.is_err();
                if tx.send(piece).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(AgentLogSource::Remote(rx))
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        let name = lease.0.strip_prefix("docker:")?;
        let ids = lock(&self.shared.ids);
        let id = ids.get(name)?;
        Some(format!("container {}", &id[..id.len().min(12)]))
    }

    fn listing_lag(&self) -> Duration {
        LISTING_LAG
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with("docker:")
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with("docker:")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every session ever started leaves nothing in the provider's maps
    /// once its stream has ended. Runs against the local engine, following
    /// containers that do not exist (each stream ends at the engine's 404).
    #[tokio::test]
    async fn ten_thousand_sessions_leave_no_entry_and_no_lock_behind() {
        let config = DockerConfig {
            daemon_ticket: "t".into(),
            token_secret: [1; 32],
            ..DockerConfig::new("/bin/true")
        };
        let p = match DockerProvider::connect(config).await {
            Ok(p) => p,
            Err(e @ DockerError::EngineUnreachable { .. }) => {
                assert!(
                    std::env::var("SWACTOR_REQUIRE_DOCKER").as_deref() != Ok("1"),
                    "SWACTOR_REQUIRE_DOCKER=1 but no Docker engine answers: {e}"
                );
                eprintln!("skipped: no Docker engine answers ({e})");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        p.shared
            .sessions
            .run_to_their_end(10_000, async |i| {
                // No container of this name exists: the engine says so.
                let name = format!("swactor-kit-test-absent-{i}");
                let _guard = p.lock_key(&name).await;
                let session = SessionId::from(format!("docker:{name}#t"));
                let stream = p.open_stream(&session, &name, "2026-01-01T00:00:00Z");
                let ended = if i % 10 == 0 {
                    p.mark_cancelled(&name);
                    swactor_provisioning::BootstrapEvent::Closed
                } else {
                    swactor_provisioning::BootstrapEvent::Failed {
                        stage: swactor_provisioning::BootstrapStage::AgentLost,
                        reason: format!("container {name} was removed"),
                    }
                };
                (stream, ended)
            })
            .await;
        assert_eq!(p.shared.key_locks.len(), 0);
    }

    #[test]
    fn the_listing_lag_is_as_long_as_the_wait_for_a_reserved_name() {
        assert_eq!(LISTING_LAG, ADOPT_POLL_INTERVAL * ADOPT_POLLS);
    }

    #[test]
    fn container_names_cannot_collide_across_keys() {
        let key = |run: &str, node: &str| ResourceKey {
            run_id: RunId::new(run),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(3),
        };
        let a = DockerProvider::container_name(&key("a-b", "c-0"));
        let b = DockerProvider::container_name(&key("a", "b-c-0"));
        assert_eq!(a, "swactor_a-b_c-0_a3");
        assert_ne!(a, b);
        let d = DockerProvider::container_name_in(&key("a-b", "c-0"), Some("0a1b2c3d"));
        assert_eq!(d, "swactor_a-b_c-0_a3_0a1b2c3d");
    }

    #[test]
    fn labels_map_back_to_their_key() {
        let labels = HashMap::from([
            (LABEL_RUN.to_owned(), "r".to_owned()),
            (LABEL_NODE.to_owned(), "w-0".to_owned()),
            (LABEL_ATTEMPT.to_owned(), "7".to_owned()),
        ]);
        let (key, deployment) = key_of_labels(&labels).unwrap();
        assert_eq!(key.to_string(), "r/w-0/a7");
        assert_eq!(deployment, None);
        let mut deployed = labels.clone();
        deployed.insert(LABEL_DEPLOYMENT.to_owned(), "0a1b2c3d".to_owned());
        assert_eq!(
            key_of_labels(&deployed),
            Some((key, Some("0a1b2c3d".to_owned())))
        );
        let mut bad = labels.clone();
        bad.insert(LABEL_ATTEMPT.to_owned(), "+7".to_owned());
        assert_eq!(key_of_labels(&bad), None);
        bad.remove(LABEL_ATTEMPT);
        assert_eq!(key_of_labels(&bad), None);
    }

    #[test]
    fn a_dynamic_elf_is_told_from_a_static_one() {
        // A minimal ELF64 header with one program header of the given type.
        let elf = |kind: u32| {
            let mut b = vec![0u8; 0x40 + 0x38];
            b[..6].copy_from_slice(b"\x7fELF\x02\x01");
            b[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
            b[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
            b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
            b[0x40..0x44].copy_from_slice(&kind.to_le_bytes());
            b
        };
        assert!(elf_interpreter(&elf(3)));
        assert!(!elf_interpreter(&elf(1)));
        assert!(!elf_interpreter(b"#!/bin/sh\n"));
        let current = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        // Test binaries are linked dynamically unless built with crt-static.
        if !cfg!(target_feature = "crt-static") {
            assert!(elf_interpreter(&current));
        }
    }
}
