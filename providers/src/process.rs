//! The `process` provider: each node is a directory on this machine and its agent a local process.
//!
//! A lease is the node directory `{state_dir}/nodes/{run}/{node}-a{attempt}/`
//! holding `identity.json` (the [`ResourceKey`] as JSON); its [`LeaseId`] is
//! that path relative to the state directory and its endpoint is
//! `local:{absolute path}`. A bootstrap runs the agent in the directory, in a
//! process group of its own, with stdout and stderr appended to `agent.log`
//! and its pid in `agent.pid`; the session is `{lease}#pid{pid}`.
//!
//! Everything a later daemon needs is on disk or in `/proc`, and the agent
//! owns no pipe to the daemon, so a restarted daemon on the same state
//! directory adopts the leases ([`Provider::list`], `create_lease`) and
//! running agents (`start_bootstrap`), whose fresh stream replays the log
//! from its start.
//!
//! # Finding the agent
//!
//! A node directory's agent is the live process that leads its own process
//! group and whose command line carries the directory's identity (`--run`,
//! `--node`, `--attempt` and `--dir`, see below). A child the agent forks
//! carries the same command line until it calls exec (a subshell, for ever)
//! but stays in the agent's group, so it never counts as a second agent.
//!
//! `agent.pid` is a hint that saves a search, not the record adoption rests
//! on: a daemon may be killed between spawning the agent and writing the
//! file. When the file is missing or names something else (an agent that
//! exited, a reused pid, a hand-edited file), the provider searches `/proc`,
//! adopts what it finds and writes the file again. The record of intent is
//! `agent.log`, which every spawn creates before it spawns: a directory with
//! neither file never had an agent and needs no search. It is not fsynced;
//! only a machine crash can lose it, and that ends the agent as well.
//!
//! A search is one pass over `/proc` that reads `stat` of every process and
//! `cmdline` of every group leader:
//!
//! - `start_bootstrap` searches only when the hint fails and an agent may
//!   have been started;
//! - `list` searches at most once per call, for all directories of the run;
//! - `destroy_lease` searches every time, because once the directory is gone
//!   no call could find a leftover agent again;
//! - `cancel_bootstrap` never searches: its session names the pid.
//!
//! Nothing is signalled before `/proc` confirms that the pid leads a group
//! and carries the identity, so a stale or hand-edited pid is never killed.
//! The one exception is a recorded agent that has exited while members of
//! its group still run: those are stopped through the group id, which Linux
//! does not reuse while the group exists.
//!
//! # The agent's command line
//!
//! ```text
//! {agent_program} {agent_args…} --run {run} --node {node} --attempt {n}
//!     --daemon {daemon_ticket} --credentials {node dir}/agent.credentials
//!     --dir {node dir} [--boot-check={arg}]… --boot-timeout-s={seconds}
//! ```
//!
//! with the template's `boot.env` added to the environment. `--attempt` is
//! the bare number. Nothing on it is secret: the agent's join token and iroh
//! key ([`AgentCredentials`]) are in the credentials file, written mode 0600
//! in a node directory only the daemon's user can enter (0700) before the
//! agent starts; the agent reads and removes it. The agent reports progress
//! on stdout in the line protocol of [`parse_agent_line`] (write lines with
//! [`format_agent_line`]) and joins with its credentials. The provider recognises its agent
//! by `--run`, `--node`, `--attempt` and `--dir` in `/proc/{pid}/cmdline`, so
//! an agent must keep its arguments (a wrapper script must not `exec` into a
//! program with other arguments).
//!
//! # Logs
//!
//! An agent that exits without reporting a failure (it crashed, or refused
//! its arguments) fails its stream with its exit status and the last lines
//! it wrote. When a lease is destroyed, the end of its agent log is kept
//! under `{state_dir}/logs/` (bounded per attempt, slot and run; see
//! [`agent_logs`]), so a failed attempt's error can be read after its
//! directory is gone.
//!
//! # Caveats
//!
//! - Linux only: liveness and identity come from `/proc`.
//! - Calls for one node directory are serialised within one provider (and its
//!   clones); two daemons on one state directory could still race a spawn.
//! - The provider polls (the log, adopted pids, a stopping group) with tokio
//!   timers in real time; under tokio's paused time those polls would spin.
//! - File operations are synchronous: they touch one small local directory.
//!
//! Over 1,000 lines in one file because the contract's methods share the
//! node directory layout and the session kit; tails, signals and the agent
//! protocol already live in `process/`.

#![cfg(all(target_os = "linux", feature = "process"))]

mod logs;
mod os;
mod tail;

pub use crate::kit::{AGENT_LINE_PREFIX, format_agent_line, parse_agent_line};
pub use logs::{
    AgentLog, LOG_ATTEMPTS_KEPT, LOG_KEEP_BYTES, LOG_RUN_BYTES_MAX, agent_logs, kept_log_path,
};

use crate::Release;
use crate::credentials::{AgentCredentials, CREDENTIALS_FILE};
use std::os::unix::fs::DirBuilderExt;

use crate::kit::{KeyGuard, KeyLocks, RecentOutput, Sessions};
use crate::{BootstrapSession, Inventory, LeaseGrant, OwnedResources, Provider, ProviderError};
use crate::{Fault, FaultKind};
use async_trait::async_trait;
use os::{AgentIdentity, Leader};
use rustix::process::Signal;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use swactor_provisioning::{
    LeaseId, LogicalNodeId, NodeAttemptId, NodeEndpoint, NodeTemplate, ResourceKey, RunId,
    SessionId, validate_id,
};
use tail::{Exit, Tail};
use tokio::sync::watch;

/// Default of [`ProcessConfig::term_grace`].
pub const TERM_GRACE_DEFAULT: Duration = Duration::from_secs(5);
/// Longest accepted [`ProcessConfig::term_grace`].
pub const TERM_GRACE_MAX: Duration = Duration::from_secs(600);
/// Default of [`ProcessConfig::log_poll_interval`].
pub const LOG_POLL_INTERVAL_DEFAULT: Duration = Duration::from_millis(100);
/// Longest accepted [`ProcessConfig::log_poll_interval`].
pub const LOG_POLL_INTERVAL_MAX: Duration = Duration::from_secs(10);

/// Memory set aside per agent when estimating how many fit on this
/// machine (an idle agent holds about 35 MB; its boot check and the
/// workload need room too).
pub const AGENT_MEMORY_BYTES: u64 = 64 << 20;

/// Checks a `process` group's template as its author wrote it: the provider
/// takes no parameters, so any is refused by name (as the `docker` and
/// `ssh` providers refuse the ones they do not know).
///
/// # Errors
/// The first problem, worded for the shape's author.
pub fn check_template(template: &NodeTemplate) -> Result<(), String> {
    match template.provider.params.keys().next() {
        Some(name) => Err(format!(
            "unknown parameter `{name}` (the process provider takes none)"
        )),
        None => Ok(()),
    }
}

/// How many agents this machine can hold: its available memory at
/// [`AGENT_MEMORY_BYTES`] each; `None` when that cannot be read. It is the
/// [`ProcessProvider`]'s [`Provider::capacity`], and needs no provider, so
/// that a shape can be checked against it before a daemon starts.
pub fn machine_capacity() -> Option<swactor_provisioning::Capacity> {
    let available = available_memory_bytes()?;
    Some(swactor_provisioning::Capacity {
        kind: "process".to_owned(),
        nodes: available / AGENT_MEMORY_BYTES,
        basis: format!(
            "this machine's {:.1} GiB of available memory at {} MiB per agent",
            available as f64 / f64::from(1u32 << 30),
            AGENT_MEMORY_BYTES >> 20
        ),
    })
}

/// How long a stop waits for a group to vanish after SIGKILL before calling the outcome unknown.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How often a stop checks whether the group is gone.
const STOP_POLL: Duration = Duration::from_millis(10);

const IDENTITY_FILE: &str = "identity.json";
const PID_FILE: &str = "agent.pid";
const LOG_FILE: &str = "agent.log";
/// The previous agent's log when a lease's agent is started again; only one is kept.
const PREVIOUS_LOG_FILE: &str = "agent.log.prev";

/// Settings of a [`ProcessProvider`].
#[derive(Clone, Debug)]
pub struct ProcessConfig {
    /// Directory holding all provider state; must exist. Node directories go
    /// under `nodes/` in it.
    pub state_dir: PathBuf,
    /// The agent executable (e.g. the `swactor` binary).
    pub agent_program: PathBuf,
    /// Arguments placed before the per-node ones (e.g. `["agent"]`).
    pub agent_args: Vec<String>,
    /// Passed to the agent as `--daemon`: how it reaches this daemon.
    pub daemon_ticket: crate::DaemonTicket,
    /// The secret agents' credentials derive from (see [`AgentCredentials`]).
    pub token_secret: [u8; 32],
    /// How long a stopping agent's group gets between SIGTERM and SIGKILL.
    pub term_grace: Duration,
    /// How often agent logs, and the liveness of adopted agents, are checked.
    pub log_poll_interval: Duration,
}

impl ProcessConfig {
    /// A configuration over `state_dir` with the default grace and poll
    /// interval. The agent program, the daemon ticket and the token secret
    /// start empty and must be set (use struct update syntax):
    /// [`Self::validate`] rejects them until they are.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            agent_program: PathBuf::new(),
            agent_args: Vec::new(),
            daemon_ticket: crate::DaemonTicket::default(),
            token_secret: [0; 32],
            term_grace: TERM_GRACE_DEFAULT,
            log_poll_interval: LOG_POLL_INTERVAL_DEFAULT,
        }
    }

    /// Checks every field, including that `state_dir` is an existing directory.
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), ProcessError> {
        if self.agent_program.as_os_str().is_empty() {
            return Err(ProcessError::EmptyField {
                field: "agent_program",
            });
        }
        if self.daemon_ticket.is_empty() {
            return Err(ProcessError::EmptyField {
                field: "daemon_ticket",
            });
        }
        if self.token_secret == [0; 32] {
            return Err(ProcessError::ZeroTokenSecret);
        }
        if self.term_grace > TERM_GRACE_MAX {
            return Err(ProcessError::BadDuration {
                field: "term_grace",
                value: self.term_grace,
                max: TERM_GRACE_MAX,
            });
        }
        if self.log_poll_interval.is_zero() || self.log_poll_interval > LOG_POLL_INTERVAL_MAX {
            return Err(ProcessError::BadDuration {
                field: "log_poll_interval",
                value: self.log_poll_interval,
                max: LOG_POLL_INTERVAL_MAX,
            });
        }
        if !self.state_dir.is_dir() {
            return Err(ProcessError::StateDirMissing {
                path: self.state_dir.clone(),
            });
        }
        Ok(())
    }
}

/// Why a [`ProcessProvider`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The state directory does not exist (or is not a directory).
    #[error("state directory {} does not exist", path.display())]
    StateDirMissing {
        /// The configured path.
        path: PathBuf,
    },
    /// The state directory exists but cannot be resolved or written.
    #[error("state directory {} is unusable", path.display())]
    StateDirUnusable {
        /// The path that failed.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A required setting is empty.
    #[error("{field} must not be empty")]
    EmptyField {
        /// The field.
        field: &'static str,
    },
    /// The token secret is all zeros (the unset value), so anyone could forge join tokens.
    #[error("token_secret is all zeros; it must be a random 32-byte key")]
    ZeroTokenSecret,
    /// A duration is out of range.
    #[error("{field} is {value:?}; it must be above zero and at most {max:?}")]
    BadDuration {
        /// The field.
        field: &'static str,
        /// The rejected value.
        value: Duration,
        /// The largest accepted value.
        max: Duration,
    },
}

/// Publishes a spawned agent's exit status once its reaper has waited for it.
type ExitWatch = watch::Receiver<Option<String>>;

struct Shared {
    config: ProcessConfig,
    /// The canonical (absolute) `{state_dir}/nodes`.
    nodes_dir: PathBuf,
    /// The canonical state directory.
    state_dir: PathBuf,
    /// Open session streams, with the agent's exit status when this
    /// process spawned it.
    sessions: Sessions<Option<ExitWatch>>,
    /// Serialises the calls for one node directory.
    key_locks: KeyLocks<PathBuf>,
    /// Keeps destroyed leases' logs.
    logs: logs::LogKeeper,
}

/// The local process provider. Cheap to clone; clones share state.
///
/// # Guarantees
/// - One node directory and at most one live agent per [`ResourceKey`]:
///   creates and bootstraps adopt what they find, also across daemon
///   restarts on the same state directory.
/// - Stopping signals the agent's whole process group and returns only once
///   no process of it runs (or says [`ProviderError::Ambiguous`]).
/// - Session streams never lose lines: the tail waits for a slow reader.
#[derive(Clone)]
pub struct ProcessProvider {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ProcessProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessProvider")
            .field("state_dir", &self.shared.state_dir)
            .finish_non_exhaustive()
    }
}

impl ProcessProvider {
    /// A provider over `config.state_dir`, creating its `nodes/` directory.
    ///
    /// # Errors
    /// An invalid config, a missing state directory, or one that cannot be written.
    pub fn new(config: ProcessConfig) -> Result<Self, ProcessError> {
        config.validate()?;
        let state_dir = fs::canonicalize(&config.state_dir).map_err(|source| {
            ProcessError::StateDirUnusable {
                path: config.state_dir.clone(),
                source,
            }
        })?;
        let nodes_dir = state_dir.join("nodes");
        fs::create_dir_all(&nodes_dir).map_err(|source| ProcessError::StateDirUnusable {
            path: nodes_dir.clone(),
            source,
        })?;
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                nodes_dir,
                state_dir,
                sessions: Sessions::new(),
                key_locks: KeyLocks::new(),
                logs: logs::LogKeeper::default(),
            }),
        })
    }

    /// The canonical state directory.
    pub fn state_dir(&self) -> &Path {
        &self.shared.state_dir
    }

    /// The directory that is (or would be) `key`'s lease.
    pub fn node_dir(&self, key: &ResourceKey) -> PathBuf {
        self.shared.state_dir.join(lease_path(key))
    }

    /// Checks the key can name a directory, and returns it with its lease id.
    fn locate(&self, key: &ResourceKey) -> Result<(PathBuf, LeaseId), ProviderError> {
        validate_id(key.run_id.as_str())
            .and_then(|()| validate_id(key.node.group.as_str()))
            .map_err(|e| {
                ProviderError::definite(
                    FaultKind::Invalid,
                    format!("key {key} cannot name a lease: {e}"),
                )
            })?;
        Ok((self.node_dir(key), LeaseId::from(lease_path(key))))
    }

    /// Like [`Self::locate`], also checking `lease` is the key's.
    fn locate_lease(&self, key: &ResourceKey, lease: &LeaseId) -> Result<PathBuf, ProviderError> {
        let (dir, expected) = self.locate(key)?;
        if *lease != expected {
            return Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!(
                    "lease {} is not key {key}'s (that is {})",
                    lease.0, expected.0
                ),
            ));
        }
        Ok(dir)
    }

    async fn lock_key(&self, dir: &Path) -> KeyGuard<'_, PathBuf> {
        self.shared.key_locks.lock(&dir.to_path_buf()).await
    }

    fn endpoint(dir: &Path) -> NodeEndpoint {
        NodeEndpoint::from(format!("local:{}", dir.display()))
    }

    /// Spawns `key`'s agent in `dir` and records its pid.
    ///
    /// The agent's log is created first: it is the record that an agent may
    /// run here (see the module docs), so it MUST exist before the spawn.
    fn spawn_agent(
        &self,
        key: &ResourceKey,
        dir: &Path,
        template: &NodeTemplate,
    ) -> Result<(i32, Option<ExitWatch>), ProviderError> {
        let config = &self.shared.config;
        let log_path = dir.join(LOG_FILE);
        // A fresh log per agent, so the new stream does not replay the
        // previous agent's progress.
        match fs::rename(&log_path, dir.join(PREVIOUS_LOG_FILE)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(definite(
                    format!("cannot set aside {}", log_path.display()),
                    e,
                ));
            }
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| definite(format!("cannot open {}", log_path.display()), e))?;
        let stdout = log
            .try_clone()
            .map_err(|e| definite(format!("cannot share {}", log_path.display()), e))?;
        // The secrets go in a file only this user can read, never on the
        // command line; the agent takes it (reads and removes it).
        let credentials = dir.join(CREDENTIALS_FILE);
        AgentCredentials::derive(&config.token_secret, key)
            .write_file(&credentials)
            .map_err(|e| definite(format!("cannot write {}", credentials.display()), e))?;
        let mut cmd = Command::new(&config.agent_program);
        cmd.args(&config.agent_args)
            .arg("--run")
            .arg(key.run_id.as_str())
            .arg("--node")
            .arg(key.node.to_string())
            .arg("--attempt")
            .arg(key.attempt.0.to_string())
            .arg("--daemon")
            .arg(config.daemon_ticket.get())
            .arg("--credentials")
            .arg(&credentials)
            .arg("--dir")
            .arg(dir);
        // `--boot-check=ARG` keeps an argument that starts with `-` (say
        // `sh -c …`) a value rather than an option of the agent.
        for check in &template.boot.boot_check {
            let mut arg = std::ffi::OsString::from("--boot-check=");
            arg.push(check);
            cmd.arg(arg);
        }
        cmd.arg(format!(
            "--boot-timeout-s={}",
            template.limits.boot_timeout_s
        ));
        // Everything of the daemon's environment but the account's keys;
        // the group's own variables on top.
        for secret in crate::ACCOUNT_ENV {
            cmd.env_remove(secret);
        }
        cmd.envs(&template.boot.env)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            // Its own group, so a stop reaches everything the agent started
            // and a signal to the daemon's group does not reach the agent.
            .process_group(0);
        let mut child = cmd.spawn().map_err(|e| {
            definite(
                format!("cannot start agent {}", config.agent_program.display()),
                e,
            )
        })?;
        let pid = i32::try_from(child.id()).map_err(|_| {
            // Unreachable on Linux (pids fit in 31 bits); without a usable pid
            // the child could not be stopped, so kill it through the handle.
            let _ = child.kill();
            let _ = child.wait();
            ProviderError::definite(
                FaultKind::Local,
                format!("agent pid {} is out of range", child.id()),
            )
        })?;
        let exit = reap(child, pid);
        // Only a hint: an agent without it is found by a search.
        record_pid(dir, pid);
        Ok((pid, exit))
    }

    /// Opens a stream for `session`, replacing (ending) any earlier one.
    fn open_stream(
        &self,
        session: &SessionId,
        dir: &Path,
        pid: i32,
        who: AgentIdentity,
        spawned: Option<ExitWatch>,
    ) -> BootstrapSession {
        let log = dir.join(LOG_FILE);
        let poll = self.shared.config.log_poll_interval;
        // A freshly spawned agent has its own exit watch; a stream that
        // follows the same agent again keeps the one it had.
        let fresh = spawned.is_some();
        let exit = |old: Option<Option<ExitWatch>>| spawned.or(old.flatten());
        self.shared.sessions.stream(session, fresh, exit, |s| {
            Tail {
                session: session.clone(),
                log,
                exit: match s.extra {
                    Some(rx) => Exit::Child(rx),
                    None => Exit::Adopted { pid, who },
                },
                cancelled: s.cancelled,
                poll,
                tx: s.tx,
                stop: s.stop,
                recent: RecentOutput::default(),
            }
            .run()
        })
    }

    /// Marks `session` as stopped on purpose, so its stream closes rather than reports a loss.
    fn mark_cancelled(&self, session: &SessionId) {
        self.shared.sessions.mark_cancelled(session);
    }

    /// Stops the agent `pid` of `who` and everything in its group.
    ///
    /// Signals nothing when `pid` names a process that is not the agent (a
    /// reused pid, a child the agent forked): [`os::leader`] looks first.
    async fn stop_agent(&self, pid: i32, who: &AgentIdentity) -> Result<(), ProviderError> {
        if os::leader(pid, who) == Leader::Foreign || !os::group_alive(pid) {
            return Ok(());
        }
        match os::signal_group(pid, Signal::TERM) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => return Err(definite(format!("cannot signal agent group {pid}"), e)),
        }
        // A stopped (SIGSTOP, frozen) agent would hold SIGTERM pending until
        // SIGKILL: let it run to act on it.
        let _ = os::signal_group(pid, Signal::CONT);
        if wait_group_gone(pid, self.shared.config.term_grace).await {
            return Ok(());
        }
        tracing::info!(pid, grace = ?self.shared.config.term_grace, "agent outlived its grace; killing its group");
        match os::signal_group(pid, Signal::KILL) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                return Err(ProviderError::ambiguous(
                    FaultKind::Unstoppable,
                    format!("agent group {pid} ignored SIGTERM and cannot be sent SIGKILL: {e}"),
                ));
            }
        }
        if wait_group_gone(pid, KILL_WAIT).await {
            return Ok(());
        }
        Err(ProviderError::ambiguous(
            FaultKind::Unstoppable,
            format!("agent group {pid} still runs {KILL_WAIT:?} after SIGKILL"),
        ))
    }

    /// The live agent of `dir`: the one `agent.pid` names, or else the
    /// oldest a search of `/proc` finds.
    fn live_agent(dir: &Path, who: &AgentIdentity) -> Result<Option<Agent>, ProviderError> {
        match agent_hint(dir, who)? {
            Hint::Live(pid) => Ok(Some(Agent {
                pid,
                recorded: true,
            })),
            Hint::NeverStarted => Ok(None),
            Hint::Search => {
                let agents = search(&[who])?.swap_remove(0);
                if agents.len() > 1 {
                    tracing::warn!(dir = %dir.display(), ?agents, "more than one agent runs for one node directory; adopting the oldest");
                }
                Ok(agents.first().map(|&pid| Agent {
                    pid,
                    recorded: false,
                }))
            }
        }
    }

    /// Records a searched-out agent in `dir`, unless a call holds the
    /// directory (that call settles the file itself).
    fn record_found(&self, dir: &Path, who: &AgentIdentity, pid: i32) {
        let Some(_guard) = self.shared.key_locks.try_lock(&dir.to_path_buf()) else {
            return;
        };
        // Checked again under the lock: a call may have stopped the agent
        // since the search.
        if os::leader(pid, who) == Leader::Ours {
            record_pid(dir, pid);
        }
    }
}

/// A live agent of a node directory.
#[derive(Clone, Copy, Debug)]
struct Agent {
    pid: i32,
    /// `agent.pid` already names it.
    recorded: bool,
}

/// A node directory `list` found, before the search for agents.
struct Listed {
    key: ResourceKey,
    dir: PathBuf,
    lease: LeaseId,
    who: AgentIdentity,
    hint: Hint,
}

/// What a node directory's files say about its agent, before any search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hint {
    /// `agent.pid` names the live agent.
    Live(i32),
    /// No agent was ever started in the directory.
    NeverStarted,
    /// Only a search of `/proc` can tell.
    Search,
}

fn agent_hint(dir: &Path, who: &AgentIdentity) -> Result<Hint, ProviderError> {
    if let Some(pid) = read_pid(dir)? {
        return Ok(match os::leader(pid, who) {
            Leader::Ours => Hint::Live(pid),
            Leader::Foreign | Leader::Gone => Hint::Search,
        });
    }
    Ok(if may_have_started(dir) {
        Hint::Search
    } else {
        Hint::NeverStarted
    })
}

/// False only when no agent was ever started in `dir`: `agent.log` is
/// created before every spawn. A malformed `agent.pid` counts as a start.
fn may_have_started(dir: &Path) -> bool {
    [LOG_FILE, PID_FILE]
        .iter()
        .any(|name| match fs::symlink_metadata(dir.join(name)) {
            Ok(_) => true,
            // Unknown, so search.
            Err(e) => e.kind() != io::ErrorKind::NotFound,
        })
}

/// The running agents of each identity, from one pass over `/proc` (see [`os::scan_agents`]).
fn search(who: &[&AgentIdentity]) -> Result<Vec<Vec<i32>>, ProviderError> {
    os::scan_agents(who).map_err(|e| definite("cannot search /proc for agents".to_owned(), e))
}

/// Writes `pid` to `dir`'s `agent.pid`. A failure is only logged: the file is
/// a hint, and a later call finds the agent by a search.
fn record_pid(dir: &Path, pid: i32) {
    let path = dir.join(PID_FILE);
    if let Err(e) = write_atomically(&path, format!("{pid}\n").as_bytes()) {
        tracing::warn!(path = %path.display(), pid, error = %e, "cannot record the agent pid; later calls will search for it");
    }
}

/// Waits up to `limit` for group `pgid` to have no running process.
async fn wait_group_gone(pgid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if !os::group_alive(pgid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(STOP_POLL).await;
    }
}

/// Waits for `child` on a thread of its own, publishing its exit status, so
/// no zombie is left. `None` when no thread could be started; the agent is
/// then polled like an adopted one and stays a zombie until this process ends.
/// Its stack is small but not tiny: 64 KiB overflowed once the daemon ran on
/// jemalloc, whose per-thread set-up and teardown need more of it.
fn reap(mut child: std::process::Child, pid: i32) -> Option<ExitWatch> {
    let (tx, rx) = watch::channel(None);
    let spawned = std::thread::Builder::new()
        .name(format!("reap-agent-{pid}"))
        .stack_size(256 * 1024)
        .spawn(move || {
            let status = match child.wait() {
                Ok(status) => crate::exit::of(&status).clause(),
                Err(e) => format!("ended with an unknown status ({e})"),
            };
            let _ = tx.send(Some(status));
        });
    match spawned {
        Ok(_) => Some(rx),
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot start a reaper thread; polling the agent instead");
            None
        }
    }
}

/// `nodes/{run}/{node}-a{attempt}`.
/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_memory_bytes() -> Option<u64> {
    let info = fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn lease_path(key: &ResourceKey) -> String {
    format!("nodes/{}/{}-{}", key.run_id, key.node, key.attempt)
}

fn session_id(lease: &LeaseId, pid: i32) -> SessionId {
    SessionId::from(format!("{}#pid{pid}", lease.0))
}

/// The pid of a session of `lease`, when `session` is one.
fn session_pid(lease: &LeaseId, session: &SessionId) -> Option<i32> {
    let (l, pid) = session.0.rsplit_once("#pid")?;
    if l != lease.0 || pid.starts_with(['+', '-']) {
        return None;
    }
    pid.parse().ok().filter(|p| *p > 1)
}

/// The key a node directory's name spells within `run`.
fn key_from_dir_name(run: &RunId, name: &str) -> Option<ResourceKey> {
    let (node, attempt) = name.rsplit_once("-a")?;
    if attempt.is_empty() || !attempt.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(ResourceKey {
        run_id: run.clone(),
        node: LogicalNodeId::parse(node)?,
        attempt: NodeAttemptId(attempt.parse().ok()?),
    })
}

/// A local file or process call that failed and changed nothing.
fn definite(what: String, e: io::Error) -> ProviderError {
    ProviderError::Definite(Fault::caused_by(FaultKind::Local, what, e))
}

/// What a node directory holds.
enum Identity {
    /// No directory.
    Absent,
    /// A directory without `identity.json`: a create that stopped half-way.
    Incomplete,
    /// The directory of the expected key.
    Ours,
    /// A directory claiming another key, or an unreadable identity.
    Foreign(String),
}

fn read_identity(dir: &Path, key: &ResourceKey) -> Result<Identity, ProviderError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Ok(Identity::Foreign(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Identity::Absent),
        Err(e) => return Err(definite(format!("cannot inspect {}", dir.display()), e)),
    }
    let path = dir.join(IDENTITY_FILE);
    let raw = match fs::read(&path) {
        Ok(raw) => raw,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Identity::Incomplete),
        Err(e) => return Err(definite(format!("cannot read {}", path.display()), e)),
    };
    Ok(match serde_json::from_slice::<ResourceKey>(&raw) {
        Ok(found) if found == *key => Identity::Ours,
        Ok(found) => Identity::Foreign(format!("{} names {found}", path.display())),
        Err(e) => Identity::Foreign(format!("{} is malformed: {e}", path.display())),
    })
}

fn write_identity(dir: &Path, key: &ResourceKey) -> io::Result<()> {
    let json = serde_json::to_vec(key).map_err(io::Error::other)?;
    write_atomically(&dir.join(IDENTITY_FILE), &json)
}

/// Writes `path` through a temporary file and a rename, so readers see the
/// old content or the whole new content, never a part.
fn write_atomically(path: &Path, content: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = File::create(&tmp)?;
    file.write_all(content)?;
    file.sync_all()?;
    fs::rename(&tmp, path)
}

/// The pid recorded in `dir`, if one is.
fn read_pid(dir: &Path) -> Result<Option<i32>, ProviderError> {
    let path = dir.join(PID_FILE);
    let raw = match fs::read_to_string(&path) {
        Ok(raw) => raw,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(definite(format!("cannot read {}", path.display()), e)),
    };
    match raw.trim().parse::<i32>() {
        Ok(pid) if pid > 1 => Ok(Some(pid)),
        _ => {
            tracing::warn!(path = %path.display(), "ignoring a malformed agent pid file");
            Ok(None)
        }
    }
}

#[async_trait]
impl Provider for ProcessProvider {
    fn kind(&self) -> &'static str {
        "process"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        _template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let (dir, lease) = self.locate(key)?;
        let _guard = self.lock_key(&dir).await;
        let grant = LeaseGrant {
            lease,
            endpoint: Some(Self::endpoint(&dir)),
        };
        match read_identity(&dir, key)? {
            Identity::Ours => return Ok(grant),
            Identity::Foreign(why) => {
                return Err(ProviderError::definite(
                    FaultKind::NotOurs,
                    format!("cannot lease {}: {why}", dir.display()),
                ));
            }
            Identity::Incomplete => {
                // An earlier create made the directory but not its identity;
                // finishing it is adopting it.
                write_identity(&dir, key)
                    .map_err(|e| definite(format!("cannot complete lease {}", dir.display()), e))?;
                return Ok(grant);
            }
            Identity::Absent => {}
        }
        let parent = dir.parent().unwrap_or(&self.shared.nodes_dir);
        // Retried once: a destroy may remove an empty run directory between
        // the two calls.
        let mut made = Err(io::ErrorKind::NotFound.into());
        for _ in 0..2 {
            fs::create_dir_all(parent)
                .map_err(|e| definite(format!("cannot create {}", parent.display()), e))?;
            // Only this user may enter a node directory: it holds the
            // agent's credentials while the agent starts.
            made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
            if !matches!(&made, Err(e) if e.kind() == io::ErrorKind::NotFound) {
                break;
            }
        }
        match made {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // Made concurrently by another process on this state directory.
                return match read_identity(&dir, key)? {
                    Identity::Ours | Identity::Incomplete => Ok(grant),
                    _ => Err(ProviderError::definite(
                        FaultKind::NotOurs,
                        format!(
                            "cannot lease {}: it appeared with another identity",
                            dir.display()
                        ),
                    )),
                };
            }
            Err(e) => return Err(definite(format!("cannot create {}", dir.display()), e)),
        }
        if let Err(e) = write_identity(&dir, key) {
            return Err(match fs::remove_dir_all(&dir) {
                Ok(()) => definite(
                    format!(
                        "cannot write the identity of {} (removed it again)",
                        dir.display()
                    ),
                    e,
                ),
                Err(_) => ProviderError::ambiguous(
                    FaultKind::Unconfirmed,
                    format!(
                        "created {} but cannot write its identity: {e}",
                        dir.display()
                    ),
                ),
            });
        }
        tracing::debug!(%key, dir = %dir.display(), "leased a node directory");
        Ok(grant)
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        let dir = self.locate_lease(key, lease)?;
        match read_identity(&dir, key)? {
            Identity::Ours | Identity::Incomplete => Ok(Self::endpoint(&dir)),
            Identity::Absent => Err(ProviderError::gone(
                FaultKind::Deleted,
                format!("{} does not exist", dir.display()),
            )),
            Identity::Foreign(why) => Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!("lease {} is not key {key}'s: {why}", lease.0),
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
        let dir = self.locate_lease(key, lease)?;
        let _guard = self.lock_key(&dir).await;
        match read_identity(&dir, key)? {
            Identity::Ours | Identity::Incomplete => {}
            Identity::Absent => {
                return Err(ProviderError::gone(
                    FaultKind::Deleted,
                    format!("{} does not exist", dir.display()),
                ));
            }
            Identity::Foreign(why) => {
                return Err(ProviderError::definite(
                    FaultKind::NotOurs,
                    format!("lease {} is not key {key}'s: {why}", lease.0),
                ));
            }
        }
        let who = AgentIdentity::new(key, &dir);
        if let Some(agent) = Self::live_agent(&dir, &who)? {
            if !agent.recorded {
                record_pid(&dir, agent.pid);
            }
            let session = session_id(lease, agent.pid);
            tracing::debug!(session = %session.0, recorded = agent.recorded, "adopting a running agent");
            return Ok(self.open_stream(&session, &dir, agent.pid, who, None));
        }
        // The recorded agent has exited, but members of its group (a boot
        // check, a subshell) may still run. They would run beside the new
        // agent, and no call could find them once its pid replaces theirs.
        if let Some(old) = read_pid(&dir)?.filter(|pid| os::leader(*pid, &who) == Leader::Gone) {
            self.mark_cancelled(&session_id(lease, old));
            self.stop_agent(old, &who).await?;
        }
        let (pid, exit) = self.spawn_agent(key, &dir, template)?;
        let session = session_id(lease, pid);
        tracing::debug!(session = %session.0, "started an agent");
        // A child without a reaper (`exit` is `None`) is polled like an adopted agent.
        Ok(self.open_stream(&session, &dir, pid, who, exit))
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let (dir, lease) = self.locate(key)?;
        let Some(pid) = session_pid(&lease, session) else {
            return Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!("session {} is not a session of key {key}", session.0),
            ));
        };
        let _guard = self.lock_key(&dir).await;
        self.mark_cancelled(session);
        self.stop_agent(pid, &AgentIdentity::new(key, &dir))
            .await
            .map(|()| Release::Done)
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let dir = self.locate_lease(key, lease)?;
        let guard = self.lock_key(&dir).await;
        if let Identity::Foreign(why) = read_identity(&dir, key)? {
            return Err(ProviderError::definite(
                FaultKind::NotOurs,
                format!("will not remove {}: {why}", dir.display()),
            ));
        }
        // An agent left running would outlive its directory and could never
        // be found again, so every agent of the identity goes first, found by
        // a search rather than the pid file (a hint). On failure the
        // directory stays for the retry. This runs for an absent directory
        // too: one removed out of band may have left its agent running.
        let who = AgentIdentity::new(key, &dir);
        let recorded = read_pid(&dir)?;
        let agents = search(&[&who])?.swap_remove(0);
        for &pid in &agents {
            self.mark_cancelled(&session_id(lease, pid));
            self.stop_agent(pid, &who).await?;
        }
        // A recorded agent that exited may have left members of its group
        // running, which no search finds; `stop_agent` signals that group
        // only while the pid names no other process.
        if let Some(pid) = recorded.filter(|pid| !agents.contains(pid)) {
            self.mark_cancelled(&session_id(lease, pid));
            self.stop_agent(pid, &who).await?;
        }
        // The log outlives its directory, so a failed attempt's error can
        // still be read (`swactor logs`).
        if let Err(e) = self.shared.logs.keep(&self.shared.state_dir, key, &dir) {
            tracing::warn!(%key, error = %e, "cannot keep the agent's log");
        }
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(ProviderError::Ambiguous(Fault::caused_by(
                    FaultKind::Local,
                    format_args!("cannot remove {}", dir.display()),
                    e,
                )));
            }
        }
        if let Some(run_dir) = dir.parent() {
            // Fails harmlessly while other nodes of the run remain.
            let _ = fs::remove_dir(run_dir);
        }
        drop(guard);
        tracing::debug!(%key, dir = %dir.display(), "destroyed a node directory");
        Ok(Release::Done)
    }

    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        _follow: bool,
    ) -> Result<crate::AgentLogSource, ProviderError> {
        self.locate_lease(key, lease)?;
        Ok(crate::AgentLogSource::StateDir)
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        lease.0.starts_with("nodes/")
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        session.0.starts_with("nodes/")
    }

    fn capacity(&self) -> Option<swactor_provisioning::Capacity> {
        machine_capacity()
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        validate_id(run_id.as_str()).map_err(|e| {
            ProviderError::definite(
                FaultKind::Invalid,
                format!("run {run_id} cannot name leases: {e}"),
            )
        })?;
        let run_dir = self.shared.nodes_dir.join(run_id.as_str());
        let entries = match fs::read_dir(&run_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Inventory::new()),
            Err(e) => return Err(definite(format!("cannot list {}", run_dir.display()), e)),
        };
        // Read every directory first, so one search of `/proc` serves all
        // whose pid file does not name a live agent.
        let mut nodes = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| definite(format!("cannot list {}", run_dir.display()), e))?;
            let name = entry.file_name();
            let Some(key) = name.to_str().and_then(|n| key_from_dir_name(run_id, n)) else {
                tracing::warn!(path = %entry.path().display(), "ignoring an entry that is not a node directory");
                continue;
            };
            let (dir, lease) = self.locate(&key)?;
            match read_identity(&dir, &key)? {
                // A half-made lease is reported too, so garbage collection
                // can destroy it.
                Identity::Ours | Identity::Incomplete => {}
                Identity::Absent => continue,
                Identity::Foreign(why) => {
                    tracing::warn!(path = %dir.display(), why, "ignoring a malformed node directory");
                    continue;
                }
            }
            let who = AgentIdentity::new(&key, &dir);
            let hint = agent_hint(&dir, &who)?;
            nodes.push(Listed {
                key,
                dir,
                lease,
                who,
                hint,
            });
        }
        let searched: Vec<&AgentIdentity> = nodes
            .iter()
            .filter(|n| n.hint == Hint::Search)
            .map(|n| &n.who)
            .collect();
        // One answer per searched node, in the same order.
        let mut found = search(&searched)?.into_iter();
        let mut inventory = Inventory::new();
        for node in nodes {
            let pid = match node.hint {
                Hint::Live(pid) => Some(pid),
                Hint::NeverStarted => None,
                Hint::Search => {
                    let pid = found.next().and_then(|agents| agents.first().copied());
                    if let Some(pid) = pid {
                        self.record_found(&node.dir, &node.who, pid);
                    }
                    pid
                }
            };
            inventory.insert(
                node.key,
                OwnedResources {
                    session: pid.map(|pid| session_id(&node.lease, pid)),
                    lease: Some(node.lease),
                },
            );
        }
        Ok(inventory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{BootstrapEvent, BootstrapStage};

    #[test]
    fn directory_names_map_back_to_their_keys() {
        let run = RunId::new("r");
        let key = ResourceKey {
            run_id: run.clone(),
            node: LogicalNodeId::parse("gpu-a-12").unwrap(),
            attempt: NodeAttemptId(7),
        };
        assert_eq!(lease_path(&key), "nodes/r/gpu-a-12-a7");
        assert_eq!(key_from_dir_name(&run, "gpu-a-12-a7"), Some(key));
        for bad in ["gpu-a-12", "gpu-a-12-a", "gpu-a-12-ax", "-a1", ".tmp-a1"] {
            assert_eq!(key_from_dir_name(&run, bad), None, "{bad}");
        }
    }

    /// A provider over `state` whose agent is never started.
    fn provider(state: &Path) -> ProcessProvider {
        ProcessProvider::new(ProcessConfig {
            agent_program: "/bin/true".into(),
            daemon_ticket: "t".into(),
            token_secret: [1; 32],
            ..ProcessConfig::new(state)
        })
        .unwrap()
    }

    #[tokio::test]
    async fn a_key_lock_is_kept_while_another_call_waits_for_it() {
        let state = tempfile::tempdir().unwrap();
        let p = provider(state.path());
        let dir = Path::new("/n/r/w-0-a1");
        let guard = p.lock_key(dir).await;
        let waiter = tokio::spawn({
            let p = p.clone();
            async move { drop(p.lock_key(Path::new("/n/r/w-0-a1")).await) }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        assert_eq!(p.shared.key_locks.len(), 1);
        // The lock is forgotten only once nobody holds or awaits it:
        // otherwise a third call would get a fresh lock while the waiter
        // holds the old one.
        drop(guard);
        waiter.await.unwrap();
        assert_eq!(p.shared.key_locks.len(), 0);
    }

    /// Every session ever started leaves nothing in the provider's maps
    /// once its stream has ended: neither its entry nor its key's lock.
    #[tokio::test]
    async fn ten_thousand_sessions_leave_no_entry_and_no_lock_behind() {
        let state = tempfile::tempdir().unwrap();
        let p = provider(state.path());
        let dir = state.path().join("agent");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(LOG_FILE), "booting\n").unwrap();
        let key = ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(1),
        };
        let who = AgentIdentity::new(&key, &dir);
        let ended = BootstrapEvent::Failed {
            stage: BootstrapStage::AgentLost,
            reason: "agent exited with code 3; its last output: booting".to_owned(),
        };
        p.shared
            .sessions
            .run_to_their_end(10_000, async |i| {
                let _guard = p.lock_key(&dir.join(i.to_string())).await;
                // An agent that already exited: its stream ends at once.
                let (_tx, exit) = watch::channel(Some("exited with code 3".to_owned()));
                let session = SessionId::from(format!("{}#pid{i}", dir.display()));
                let stream = p.open_stream(&session, &dir, 1, who.clone(), Some(exit));
                (stream, ended.clone())
            })
            .await;
        assert_eq!(p.shared.key_locks.len(), 0);
    }

    #[test]
    fn sessions_name_their_lease_and_pid() {
        let lease = LeaseId::from("nodes/r/w-0-a1");
        let session = session_id(&lease, 4242);
        assert_eq!(session.0, "nodes/r/w-0-a1#pid4242");
        assert_eq!(session_pid(&lease, &session), Some(4242));
        let other = LeaseId::from("nodes/r/w-0-a2");
        assert_eq!(session_pid(&other, &session), None);
        for bad in [
            "nodes/r/w-0-a1#pid1",
            "nodes/r/w-0-a1#pid-5",
            "nodes/r/w-0-a1#pid+5",
        ] {
            assert_eq!(
                session_pid(&lease, &SessionId::from(bad.to_owned())),
                None,
                "{bad}"
            );
        }
    }
}
