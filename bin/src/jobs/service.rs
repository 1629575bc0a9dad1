//! The daemon's side of jobs: accepts agents' jobs links, turns a
//! `swactor run` into a job with one run per (node, attempt), ships the
//! workspace, follows each run's output, collects its outputs and records
//! every state change in `jobs.redb` before acting on it.
//!
//! One task drives each job and one child task each of its runs; the job's
//! timeout is a timer of the job's task. A restarted daemon reads
//! `jobs.redb` and follows again every run that was running: the agents
//! keep output and exit status until the daemon has collected them.

use super::{
    CHUNK_LEN, FileEntry, FromAgent, Hash, JOBS_FRAME_LEN_MAX, LogRecord, Stream, ToAgent, hex,
    safe_relative, size_words, walk,
};
use crate::protocol::JoinRequest;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_actors::ClusterHandle;
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::journal::{Journal, JournalBatch, JournalContents};
use swactor_engine::net::{
    FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE, accept_first_frame, recv_frame, send_frame,
};
use swactor_providers::credentials::AgentCredentials;
use swactor_provisioning::Intent;
use tokio::io::AsyncWriteExt;
use tokio::sync::{broadcast, watch};

/// Events of a job kept for a follower that falls behind.
const EVENTS_KEPT: usize = 4096;

/// Refuses when a node of `targets` already has as many runs under way as it may.
fn busy(jobs: &BTreeMap<u64, Entry>, targets: &[(String, u64)], max: usize) -> Result<(), String> {
    for (node, _) in targets {
        let busy = jobs
            .values()
            .flat_map(|e| e.record.runs.iter())
            .filter(|r| &r.node == node && !r.state.is_final())
            .count();
        if busy >= max {
            return Err(format!(
                "{node} already has {busy} run(s) under way, the most one node may have \
                 (SWACTOR_JOB_RUNS_PER_NODE_MAX={max}); nothing was started"
            ));
        }
    }
    Ok(())
}

/// What the jobs journal says it holds, and its format.
const KIND: &str = "swactor-jobs";
const FORMAT: u32 = 1;

/// Limits on jobs, each refused with its numbers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JobLimits {
    /// Largest workspace, in bytes.
    pub(crate) workspace_max_bytes: u64,
    /// Largest sum of one run's output files, in bytes.
    pub(crate) output_max_bytes: u64,
    /// Most runs shipping or running on one node at once.
    pub(crate) runs_per_node_max: usize,
    /// How long a run whose agent went away waits for it to come back
    /// before it is `lost`.
    pub(crate) reattach_wait: Duration,
}

impl JobLimits {
    /// The defaults, each overridden by its environment variable.
    ///
    /// # Errors
    /// A variable that is not a number.
    pub(crate) fn from_env() -> anyhow::Result<Self> {
        let get = |name: &str, default: u64| -> anyhow::Result<u64> {
            match std::env::var(name) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .with_context(|| format!("{name}={v:?} is not a whole number")),
                Err(_) => Ok(default),
            }
        };
        Ok(Self {
            workspace_max_bytes: get("SWACTOR_JOB_WORKSPACE_MAX_BYTES", 1 << 30)?,
            output_max_bytes: get("SWACTOR_JOB_OUTPUT_MAX_BYTES", 256 << 20)?,
            runs_per_node_max: usize::try_from(get("SWACTOR_JOB_RUNS_PER_NODE_MAX", 4)?)
                .unwrap_or(usize::MAX),
            reattach_wait: Duration::from_secs(get("SWACTOR_JOB_REATTACH_S", 15)?),
        })
    }
}

/// Where a job or a run is.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub(crate) enum JobState {
    /// Accepted, nothing sent yet.
    Queued,
    /// The workspace is on its way.
    Shipping,
    /// The command runs (or was asked to start).
    Running,
    /// It exited 0 and its outputs were collected.
    Succeeded,
    /// It exited non-zero, could not start, timed out, or its outputs could not be collected.
    Failed,
    /// Cancelled by `swactor job cancel` or Ctrl-C.
    Cancelled,
    /// Its node went away while it ran.
    Lost,
}

impl JobState {
    /// Whether nothing more happens to it.
    pub(crate) fn is_final(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Failed | Self::Cancelled | Self::Lost
        )
    }

    /// The state's word.
    pub(crate) fn word(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Shipping => "shipping",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Lost => "lost",
        }
    }
}

/// One run of a job: a node's attempt, and what became of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct RunRecord {
    /// The node.
    pub(crate) node: String,
    /// The attempt of the node the run was meant for.
    pub(crate) attempt: u64,
    /// Where it is.
    pub(crate) state: JobState,
    /// The exit code (128 + signal when a signal ended it).
    pub(crate) exit_code: Option<i32>,
    /// Why it failed, was lost or cancelled.
    pub(crate) error: Option<String>,
    /// Workspace bytes sent to the node for this run.
    pub(crate) shipped_bytes: u64,
    /// Chunks sent to the node for this run.
    pub(crate) shipped_chunks: u64,
    /// Chunks of the workspace.
    pub(crate) chunks: u64,
    /// Output files collected.
    pub(crate) output_files: u64,
    /// Output bytes collected.
    pub(crate) output_bytes: u64,
}

/// A job as the journal keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct JobRecord {
    /// `job-N`.
    pub(crate) id: String,
    /// The command.
    pub(crate) argv: Vec<String>,
    /// Extra environment.
    pub(crate) env: Vec<(String, String)>,
    /// The workspace directory, as given.
    pub(crate) workspace: Option<String>,
    /// Output globs.
    pub(crate) outputs: Vec<String>,
    /// The timeout in seconds.
    pub(crate) timeout_s: Option<f64>,
    /// When it was accepted, in ms since the Unix epoch.
    pub(crate) created_unix_ms: u64,
    /// Files in the workspace.
    pub(crate) workspace_files: u64,
    /// Bytes in the workspace.
    pub(crate) workspace_bytes: u64,
    /// Where the collected outputs are: `<dir>/<node>/…`.
    pub(crate) outputs_dir: String,
    /// Why it was cancelled, once it was.
    pub(crate) cancelled: Option<String>,
    /// Its runs.
    pub(crate) runs: Vec<RunRecord>,
}

impl JobRecord {
    /// The job's state: its runs' while any is under way, else the worst outcome.
    pub(crate) fn state(&self) -> JobState {
        if let Some(under_way) = self
            .runs
            .iter()
            .map(|r| r.state)
            .filter(|s| !s.is_final())
            .max()
        {
            return under_way;
        }
        self.runs
            .iter()
            .map(|r| r.state)
            .max()
            .unwrap_or(JobState::Succeeded)
    }

    /// The exit code `swactor run` ends with: the worst run's (1 for a
    /// run that failed without one).
    pub(crate) fn exit_code(&self) -> i32 {
        self.runs
            .iter()
            .map(|r| match (r.state, r.exit_code) {
                (JobState::Succeeded, _) => 0,
                (_, Some(c)) if c != 0 => c,
                _ => 1,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Which nodes a job is for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Targets {
    /// Every ready node.
    All,
    /// Every ready node of these groups.
    Groups(Vec<String>),
    /// These nodes, each of which must be ready.
    Nodes(Vec<String>),
}

/// A job as `swactor run` asks for it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct JobSpec {
    /// Where it runs.
    pub(crate) targets: Targets,
    /// The workspace directory (absolute), if any.
    pub(crate) workspace: Option<PathBuf>,
    /// Output globs.
    pub(crate) outputs: Vec<String>,
    /// Seconds before the job is stopped.
    pub(crate) timeout_s: Option<f64>,
    /// Extra environment.
    pub(crate) env: Vec<(String, String)>,
    /// The command.
    pub(crate) argv: Vec<String>,
}

/// What `swactor run` is told as a job goes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum JobEvent {
    /// The job was accepted.
    Accepted {
        /// Its id.
        job: String,
        /// The nodes it runs on.
        nodes: Vec<String>,
        /// Nodes left out because they are not ready.
        skipped: Vec<String>,
        /// Files in the workspace.
        workspace_files: u64,
        /// Bytes in the workspace.
        workspace_bytes: u64,
    },
    /// A node has the workspace.
    Shipped {
        /// The node.
        node: String,
        /// Bytes sent.
        bytes: u64,
        /// Chunks sent.
        chunks: u64,
        /// Chunks of the workspace.
        of: u64,
    },
    /// Output of a node.
    Output {
        /// The node.
        node: String,
        /// From stderr (else stdout).
        stderr: bool,
        /// The text.
        text: String,
    },
    /// A run ended.
    Finished(RunRecord),
    /// The job ended.
    Done(JobRecord),
}

#[derive(Debug)]
struct Entry {
    record: JobRecord,
    events: broadcast::Sender<JobEvent>,
    /// Set to the reason when the job is cancelled or timed out.
    cancel: watch::Sender<Option<Stop>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Stop {
    Cancelled,
    TimedOut(String),
}

/// The daemon's jobs.
#[derive(Clone, Debug)]
pub(crate) struct JobService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    journal: Journal,
    save: tokio::sync::Mutex<()>,
    cluster: ClusterHandle,
    secret: [u8; 32],
    limits: JobLimits,
    links: Mutex<HashMap<(String, u64), Connection>>,
    links_changed: watch::Sender<u64>,
    jobs: Mutex<BTreeMap<u64, Entry>>,
    /// Test hook (debug builds): every chunk is sent with a byte flipped.
    tamper: bool,
}

/// The outcome of one run, decided by its task.
struct Outcome {
    state: JobState,
    exit_code: Option<i32>,
    error: Option<String>,
}

impl Outcome {
    fn fail(state: JobState, error: impl Into<String>) -> Self {
        Self {
            state,
            exit_code: None,
            error: Some(error.into()),
        }
    }
}

/// A workspace as read for shipping: its manifest and where each chunk is.
#[derive(Debug, Default)]
struct Workspace {
    manifest: Vec<FileEntry>,
    chunks: HashMap<Hash, (PathBuf, u64, usize)>,
    order: Vec<Hash>,
    bytes: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn seq_of(id: &str) -> Option<u64> {
    id.strip_prefix("job-").unwrap_or(id).parse().ok()
}

impl JobService {
    /// Opens `jobs.redb` under `state_root` and follows again every run it
    /// says was under way.
    ///
    /// # Errors
    /// The journal cannot be opened.
    pub(crate) fn open(
        state_root: &Path,
        cluster: ClusterHandle,
        secret: [u8; 32],
        limits: JobLimits,
    ) -> anyhow::Result<Self> {
        let path = state_root.join("jobs.redb");
        let (journal, contents): (Journal, JournalContents<u64, JobRecord>) =
            Journal::open(&path, KIND, FORMAT)
                .with_context(|| format!("cannot use the jobs journal {}", path.display()))?;
        let dir = state_root.join("jobs");
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
        let tamper =
            cfg!(debug_assertions) && std::env::var_os("SWACTOR_FAULT_TAMPER_CHUNKS").is_some();
        let service = Self {
            inner: Arc::new(Inner {
                dir,
                journal,
                save: tokio::sync::Mutex::new(()),
                cluster,
                secret,
                limits,
                links: Mutex::new(HashMap::new()),
                links_changed: watch::channel(0).0,
                jobs: Mutex::new(BTreeMap::new()),
                tamper,
            }),
        };
        let mut resume = Vec::new();
        for (key, record) in contents.records {
            let Ok(seq) = key.parse::<u64>() else {
                continue;
            };
            let under_way = record.runs.iter().any(|r| !r.state.is_final());
            service.insert(seq, record);
            if under_way {
                resume.push(seq);
            }
        }
        for seq in resume {
            tracing::info!(job = seq, "following a job the last daemon left running");
            tokio::spawn(service.clone().drive(seq, None));
        }
        Ok(service)
    }

    fn insert(&self, seq: u64, record: JobRecord) -> broadcast::Receiver<JobEvent> {
        let (events, rx) = broadcast::channel(EVENTS_KEPT);
        let cancel = watch::channel(None).0;
        self.inner
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                seq,
                Entry {
                    record,
                    events,
                    cancel,
                },
            );
        rx
    }

    /// The protocol handler of `swactor/jobs/0`.
    pub(crate) fn handler(&self) -> JobsHandler {
        JobsHandler(self.clone())
    }

    fn with<T>(&self, seq: u64, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        self.inner
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&seq)
            .map(f)
    }

    fn emit(&self, seq: u64, event: JobEvent) {
        self.with(seq, |e| {
            let _ = e.events.send(event);
        });
    }

    /// Writes job `seq` as it is now to the journal.
    async fn save(&self, seq: u64) -> anyhow::Result<()> {
        let _order = self.inner.save.lock().await;
        let Some(record) = self.with(seq, |e| e.record.clone()) else {
            return Ok(());
        };
        self.inner
            .journal
            .commit(JournalBatch::<u64, JobRecord> {
                meta: None,
                put: vec![(format!("{seq:012}"), record)],
                delete: Vec::new(),
            })
            .await
            .with_context(|| {
                format!(
                    "cannot record job {seq} in {}",
                    self.inner.journal.path().display()
                )
            })
    }

    async fn set_run(&self, seq: u64, idx: usize, f: impl FnOnce(&mut RunRecord)) {
        self.with(seq, |e| {
            if let Some(run) = e.record.runs.get_mut(idx) {
                f(run);
            }
        });
        if let Err(e) = self.save(seq).await {
            tracing::error!("{e:#}");
        }
    }

    /// Every job, oldest first.
    pub(crate) fn list(&self) -> Vec<JobRecord> {
        self.inner
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|e| e.record.clone())
            .collect()
    }

    fn find(&self, id: &str) -> Result<u64, String> {
        seq_of(id)
            .filter(|seq| self.with(*seq, |_| ()).is_some())
            .ok_or_else(|| format!("no job {id:?} (`swactor jobs` lists them)"))
    }

    /// The recorded output of job `id`, of one node or all, as
    /// (node, from stderr, text) pieces in order.
    pub(crate) async fn logs(
        &self,
        id: &str,
        node: Option<&str>,
    ) -> Result<Vec<(String, bool, String)>, String> {
        let seq = self.find(id)?;
        let record = self.with(seq, |e| e.record.clone()).ok_or("gone")?;
        if let Some(n) = node
            && !record.runs.iter().any(|r| r.node == n)
        {
            return Err(format!("job {} did not run on {n}", record.id));
        }
        let mut out = Vec::new();
        for run in record
            .runs
            .iter()
            .filter(|r| node.is_none_or(|n| n == r.node))
        {
            let bytes = tokio::fs::read(self.log_path(&record.id, &run.node))
                .await
                .unwrap_or_default();
            for rec in LogRecord::decode_all(&bytes).0 {
                out.push((
                    run.node.clone(),
                    rec.stream == Stream::Stderr,
                    String::from_utf8_lossy(&rec.data).into_owned(),
                ));
            }
        }
        Ok(out)
    }

    fn log_path(&self, job: &str, node: &str) -> PathBuf {
        self.inner.dir.join(job).join(format!("{node}.log"))
    }

    /// Cancels job `id` on every node it still runs on; returns the job and those nodes.
    pub(crate) fn cancel(&self, id: &str) -> Result<(String, Vec<String>), String> {
        let seq = self.find(id)?;
        self.stop(seq, Stop::Cancelled)
            .ok_or_else(|| format!("no job {id:?}"))
    }

    fn stop(&self, seq: u64, why: Stop) -> Option<(String, Vec<String>)> {
        self.with(seq, |e| {
            let nodes: Vec<String> = e
                .record
                .runs
                .iter()
                .filter(|r| !r.state.is_final())
                .map(|r| r.node.clone())
                .collect();
            if !nodes.is_empty() {
                e.cancel.send_if_modified(|c| {
                    if c.is_none() {
                        *c = Some(why);
                        true
                    } else {
                        false
                    }
                });
            }
            (e.record.id.clone(), nodes)
        })
    }

    /// Accepts a job: checks everything, records it, starts it. Returns its
    /// number and its events from the start.
    ///
    /// # Errors
    /// Anything wrong with the request, in words; nothing was shipped then.
    pub(crate) async fn submit(
        &self,
        spec: JobSpec,
    ) -> Result<(u64, broadcast::Receiver<JobEvent>, JobEvent), String> {
        if spec.argv.is_empty() {
            return Err(
                "no command: write it after `--`, e.g. `swactor run --all -- hostname`".to_owned(),
            );
        }
        if let Some(t) = spec.timeout_s
            && !(t.is_finite() && t > 0.0)
        {
            return Err(format!(
                "--timeout must be a positive number of seconds, got {t}"
            ));
        }
        for glob in &spec.outputs {
            if glob.starts_with('/') || glob.split('/').any(|p| p == "..") {
                return Err(format!(
                    "--output {glob:?} must be relative to the workspace, without `..`"
                ));
            }
        }
        let (targets, skipped) = self.targets(&spec.targets).await?;
        // Checked now, before the workspace is read, and again as the job is
        // recorded (another job may have started meanwhile).
        busy(
            &self
                .inner
                .jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
            &targets,
            self.inner.limits.runs_per_node_max,
        )?;
        let workspace = match &spec.workspace {
            None => Workspace::default(),
            Some(dir) => {
                let dir = dir.clone();
                let max = self.inner.limits.workspace_max_bytes;
                tokio::task::spawn_blocking(move || read_workspace(&dir, max))
                    .await
                    .map_err(|e| e.to_string())??
            }
        };
        // The number is taken and the job entered under one lock, so two
        // jobs submitted at once never share a number or overrun a node.
        let (seq, id, record, rx) = {
            let mut jobs = self
                .inner
                .jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            busy(&jobs, &targets, self.inner.limits.runs_per_node_max)?;
            let seq = jobs.keys().next_back().copied().unwrap_or(0) + 1;
            let id = format!("job-{seq}");
            let outputs_dir = self.inner.dir.join(&id).join("outputs");
            let record = JobRecord {
                id: id.clone(),
                argv: spec.argv.clone(),
                env: spec.env.clone(),
                workspace: spec.workspace.as_ref().map(|p| p.display().to_string()),
                outputs: spec.outputs.clone(),
                timeout_s: spec.timeout_s,
                created_unix_ms: now_ms(),
                workspace_files: workspace.manifest.len() as u64,
                workspace_bytes: workspace.bytes,
                outputs_dir: outputs_dir.display().to_string(),
                cancelled: None,
                runs: targets
                    .iter()
                    .map(|(node, attempt)| RunRecord {
                        node: node.clone(),
                        attempt: *attempt,
                        state: JobState::Queued,
                        exit_code: None,
                        error: None,
                        shipped_bytes: 0,
                        shipped_chunks: 0,
                        chunks: workspace.order.len() as u64,
                        output_files: 0,
                        output_bytes: 0,
                    })
                    .collect(),
            };
            let (events, rx) = broadcast::channel(EVENTS_KEPT);
            jobs.insert(
                seq,
                Entry {
                    record: record.clone(),
                    events,
                    cancel: watch::channel(None).0,
                },
            );
            (seq, id, record, rx)
        };
        tokio::fs::create_dir_all(self.inner.dir.join(&id))
            .await
            .map_err(|e| format!("cannot make the job's directory: {e}"))?;
        // Recorded before anything is sent.
        if let Err(e) = self.save(seq).await {
            self.inner
                .jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&seq);
            return Err(format!("{e:#}; nothing was started"));
        }
        let accepted = JobEvent::Accepted {
            job: id,
            nodes: targets.iter().map(|(n, _)| n.clone()).collect(),
            skipped,
            workspace_files: record.workspace_files,
            workspace_bytes: record.workspace_bytes,
        };
        tokio::spawn(self.clone().drive(seq, Some(Arc::new(workspace))));
        Ok((seq, rx, accepted))
    }

    /// The (node, attempt)s a job is for, and the nodes left out.
    async fn targets(
        &self,
        targets: &Targets,
    ) -> Result<(Vec<(String, u64)>, Vec<String>), String> {
        let snap = self
            .inner
            .cluster
            .snapshot()
            .await
            .map_err(|e| format!("cannot read the cluster: {e}"))?;
        let usable = |n: &swactor_actors::NodeSummary| n.ready && n.intent != Intent::Deleting;
        let mut chosen = Vec::new();
        let mut skipped = Vec::new();
        match targets {
            Targets::Nodes(names) => {
                for name in names {
                    let Some(n) = snap.nodes.iter().find(|n| n.node.to_string() == *name) else {
                        let known: Vec<String> =
                            snap.nodes.iter().map(|n| n.node.to_string()).collect();
                        return Err(format!(
                            "there is no node {name:?} in this cluster (its nodes: {}); nothing was started",
                            if known.is_empty() {
                                "none".to_owned()
                            } else {
                                known.join(", ")
                            }
                        ));
                    };
                    if !usable(n) {
                        return Err(format!(
                            "{name} is not ready (it is {}); a job runs on ready nodes only; nothing was started",
                            crate::words::state_word(n)
                        ));
                    }
                    if !chosen.iter().any(|(c, _)| c == name) {
                        chosen.push((name.clone(), n.attempt.0));
                    }
                }
            }
            Targets::All | Targets::Groups(_) => {
                if let Targets::Groups(groups) = targets {
                    for g in groups {
                        if !snap.nodes.iter().any(|n| n.node.group.as_str() == g) {
                            return Err(format!(
                                "there is no group {g:?} with nodes in this cluster; nothing was started"
                            ));
                        }
                    }
                }
                for n in &snap.nodes {
                    if let Targets::Groups(groups) = targets
                        && !groups.iter().any(|g| n.node.group.as_str() == g)
                    {
                        continue;
                    }
                    if usable(n) {
                        chosen.push((n.node.to_string(), n.attempt.0));
                    } else {
                        skipped.push(n.node.to_string());
                    }
                }
                if chosen.is_empty() {
                    return Err(format!(
                        "no node is ready to run a job{}; nothing was started",
                        if skipped.is_empty() {
                            String::new()
                        } else {
                            format!(" (not ready: {})", skipped.join(", "))
                        }
                    ));
                }
            }
        }
        // A ready node's agent may still be dialing its jobs link.
        for (node, attempt) in &chosen {
            if self
                .wait_link(node, *attempt, Duration::from_secs(5))
                .await
                .is_none()
            {
                return Err(format!(
                    "{node} is ready but its agent has no jobs link to this daemon; nothing was started"
                ));
            }
        }
        Ok((chosen, skipped))
    }

    fn link(&self, node: &str, attempt: u64) -> Option<Connection> {
        self.inner
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(node.to_owned(), attempt))
            .filter(|c| c.close_reason().is_none())
            .cloned()
    }

    /// The link of (node, attempt), waiting up to `wait` for it.
    async fn wait_link(&self, node: &str, attempt: u64, wait: Duration) -> Option<Connection> {
        let mut changed = self.inner.links_changed.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(c) = self.link(node, attempt) {
                return Some(c);
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return None;
            }
        }
    }

    /// Whether the cluster has moved on from (node, attempt): the node now
    /// runs a later attempt. (A node missing from the snapshot proves
    /// nothing: a daemon that just restarted may not list it yet; the
    /// reattach wait covers that case.)
    async fn superseded(&self, node: &str, attempt: u64) -> Option<String> {
        let snap = self.inner.cluster.snapshot().await.ok()?;
        let n = snap.nodes.iter().find(|n| n.node.to_string() == node)?;
        (n.attempt.0 > attempt).then(|| {
            format!(
                "{node} attempt {attempt} was replaced by attempt {}",
                n.attempt.0
            )
        })
    }

    /// Drives job `seq`: a child task per run, the timeout, then the end.
    async fn drive(self, seq: u64, workspace: Option<Arc<Workspace>>) {
        let Some((runs, timeout, created, stop_rx)) = self.with(seq, |e| {
            (
                e.record.runs.len(),
                e.record.timeout_s,
                e.record.created_unix_ms,
                e.cancel.subscribe(),
            )
        }) else {
            return;
        };
        let mut children = tokio::task::JoinSet::new();
        for idx in 0..runs {
            children.spawn(
                self.clone()
                    .run(seq, idx, workspace.clone(), stop_rx.clone()),
            );
        }
        let timer = timeout.map(|t| {
            let left = Duration::from_secs_f64(t.clamp(0.001, 1e9))
                .saturating_sub(Duration::from_millis(now_ms().saturating_sub(created)));
            let me = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(left).await;
                me.stop(seq, Stop::TimedOut(format!("timed out after {t} s")));
            })
        });
        while children.join_next().await.is_some() {}
        if let Some(timer) = timer {
            timer.abort();
        }
        let stopped = stop_rx.borrow().clone();
        self.with(seq, |e| {
            e.record.cancelled = match stopped {
                Some(Stop::Cancelled) => Some("cancelled".to_owned()),
                Some(Stop::TimedOut(t)) => Some(t),
                None => None,
            };
        });
        if let Err(e) = self.save(seq).await {
            tracing::error!("{e:#}");
        }
        if let Some(record) = self.with(seq, |e| e.record.clone()) {
            tracing::info!(job = %record.id, state = record.state().word(), "job ended");
            self.emit(seq, JobEvent::Done(record));
        }
    }

    /// One run, from wherever the journal says it is to its end.
    async fn run(
        self,
        seq: u64,
        idx: usize,
        workspace: Option<Arc<Workspace>>,
        mut stop: watch::Receiver<Option<Stop>>,
    ) {
        let Some(run) = self
            .with(seq, |e| e.record.runs.get(idx).cloned())
            .flatten()
        else {
            return;
        };
        if run.state.is_final() {
            return;
        }
        let outcome = match (run.state, workspace) {
            (JobState::Queued | JobState::Shipping, Some(ws)) => {
                self.ship_and_start(seq, idx, &run, &ws, &mut stop).await
            }
            (JobState::Queued | JobState::Shipping, None) => Err(Outcome::fail(
                JobState::Failed,
                "the daemon stopped before the run started; nothing ran",
            )),
            (_, _) => Ok(()),
        };
        let outcome = match outcome {
            Err(o) => o,
            Ok(()) => self.follow(seq, idx, &run, &mut stop).await,
        };
        let job = self.with(seq, |e| e.record.id.clone()).unwrap_or_default();
        self.set_run(seq, idx, |r| {
            r.state = outcome.state;
            r.exit_code = outcome.exit_code;
            r.error = outcome.error.clone();
        })
        .await;
        if let Some(r) = self
            .with(seq, |e| e.record.runs.get(idx).cloned())
            .flatten()
        {
            self.emit(seq, JobEvent::Finished(r));
        }
        // The agent may drop what it kept once the end is on record.
        if let Some(conn) = self.link(&run.node, run.attempt) {
            let _ = request(
                &conn,
                &ToAgent::Forget {
                    attempt: run.attempt,
                    job,
                },
            )
            .await;
        }
    }

    async fn ship_and_start(
        &self,
        seq: u64,
        idx: usize,
        run: &RunRecord,
        ws: &Workspace,
        stop: &mut watch::Receiver<Option<Stop>>,
    ) -> Result<(), Outcome> {
        self.set_run(seq, idx, |r| r.state = JobState::Shipping)
            .await;
        let lost = || {
            Outcome::fail(
                JobState::Lost,
                format!("{} attempt {} has no jobs link", run.node, run.attempt),
            )
        };
        let conn = self.link(&run.node, run.attempt).ok_or_else(lost)?;
        let (bytes, chunks) = self
            .ship(&conn, run, ws)
            .await
            .map_err(|e| Outcome::fail(JobState::Failed, e))?;
        self.set_run(seq, idx, |r| {
            r.shipped_bytes = bytes;
            r.shipped_chunks = chunks;
        })
        .await;
        self.emit(
            seq,
            JobEvent::Shipped {
                node: run.node.clone(),
                bytes,
                chunks,
                of: ws.order.len() as u64,
            },
        );
        if let Some(why) = stop.borrow().clone() {
            return Err(stopped_outcome(&why, "before it started"));
        }
        // The intent is on record before the effect.
        self.set_run(seq, idx, |r| r.state = JobState::Running)
            .await;
        let (job, argv, env) = self
            .with(seq, |e| {
                (
                    e.record.id.clone(),
                    e.record.argv.clone(),
                    e.record.env.clone(),
                )
            })
            .ok_or_else(lost)?;
        let start = ToAgent::Start {
            attempt: run.attempt,
            job,
            manifest: ws.manifest.clone(),
            argv,
            env,
        };
        match request(&conn, &start).await {
            Ok(FromAgent::Started) => Ok(()),
            Ok(FromAgent::Refused(e)) => Err(Outcome {
                state: JobState::Failed,
                exit_code: Some(127),
                error: Some(e),
            }),
            Ok(other) => Err(Outcome::fail(
                JobState::Failed,
                format!("unexpected answer {other:?}"),
            )),
            Err(e) => Err(Outcome::fail(
                JobState::Lost,
                format!("{} went away while the run was starting: {e}", run.node),
            )),
        }
    }

    /// Sends the chunks `run`'s node lacks; returns the bytes and chunks sent.
    async fn ship(
        &self,
        conn: &Connection,
        run: &RunRecord,
        ws: &Workspace,
    ) -> Result<(u64, u64), String> {
        let missing = match request(
            conn,
            &ToAgent::Missing {
                attempt: run.attempt,
                chunks: ws.order.clone(),
            },
        )
        .await
        {
            Ok(FromAgent::Missing(m)) => m,
            Ok(FromAgent::Refused(e)) => return Err(e),
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(e) => {
                return Err(format!(
                    "{} went away while the workspace was shipped: {e}",
                    run.node
                ));
            }
        };
        if missing.is_empty() {
            return Ok((0, 0));
        }
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let mut bytes = 0u64;
        let mut sent = 0u64;
        for hash in &missing {
            let Some((path, offset, len)) = ws.chunks.get(hash) else {
                return Err(format!(
                    "the agent asked for chunk {} that is not in the workspace",
                    hex(hash)
                ));
            };
            let mut data = read_at(path, *offset, *len)
                .await
                .map_err(|e| format!("cannot read {} of the workspace: {e}", path.display()))?;
            if self.inner.tamper
                && let Some(b) = data.first_mut()
            {
                *b ^= 0xff;
            }
            let frame = ToAgent::Chunk {
                attempt: run.attempt,
                hash: *hash,
                data,
            };
            send_frame(&mut send, &frame, JOBS_FRAME_LEN_MAX)
                .await
                .map_err(|e| e.to_string())?;
            match recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX).await {
                Ok(Some(FromAgent::Stored)) => {}
                Ok(Some(FromAgent::Refused(e))) => return Err(e),
                Ok(other) => return Err(format!("unexpected answer {other:?}")),
                Err(e) => {
                    return Err(format!(
                        "{} went away while the workspace was shipped: {e}",
                        run.node
                    ));
                }
            }
            bytes += *len as u64;
            sent += 1;
        }
        let _ = send.finish();
        Ok((bytes, sent))
    }

    /// Follows a started run to its end: output, exit, outputs. Survives its
    /// agent's link going and coming back; a node that does not come back
    /// (or was replaced) makes the run `lost`.
    async fn follow(
        &self,
        seq: u64,
        idx: usize,
        run: &RunRecord,
        stop: &mut watch::Receiver<Option<Stop>>,
    ) -> Outcome {
        let Some(job) = self.with(seq, |e| e.record.id.clone()) else {
            return Outcome::fail(JobState::Failed, "the job is gone");
        };
        let log_path = self.log_path(&job, &run.node);
        // This daemon's copy of the log starts over: the agent has all of it.
        let Ok(mut log) = tokio::fs::File::create(&log_path).await else {
            return Outcome::fail(
                JobState::Failed,
                format!("cannot write {}", log_path.display()),
            );
        };
        let mut offset = 0u64;
        let mut pending: Vec<u8> = Vec::new();
        let mut cancel_sent = false;
        let exit = 'attach: loop {
            let away_until = tokio::time::Instant::now() + self.inner.limits.reattach_wait;
            let conn = loop {
                if let Some(c) = self.link(&run.node, run.attempt) {
                    break c;
                }
                if let Some(why) = self.superseded(&run.node, run.attempt).await {
                    return Outcome::fail(JobState::Lost, format!("{why} while the run ran"));
                }
                if tokio::time::Instant::now() >= away_until {
                    return Outcome::fail(
                        JobState::Lost,
                        format!(
                            "the agent of {} attempt {} did not come back within {} s",
                            run.node,
                            run.attempt,
                            self.inner.limits.reattach_wait.as_secs()
                        ),
                    );
                }
                // Looked at again twice a second: the node may be replaced meanwhile.
                let _ = self
                    .wait_link(&run.node, run.attempt, Duration::from_millis(500))
                    .await;
            };
            if stop.borrow().is_some() && !cancel_sent {
                cancel_sent = true;
                let _ = request(
                    &conn,
                    &ToAgent::Cancel {
                        attempt: run.attempt,
                        job: job.clone(),
                    },
                )
                .await;
            }
            let attached = async {
                let (mut send, recv) = conn.open_bi().await?;
                let req = ToAgent::Attach {
                    attempt: run.attempt,
                    job: job.clone(),
                    offset,
                };
                send_frame(&mut send, &req, JOBS_FRAME_LEN_MAX).await?;
                let _ = send.finish();
                anyhow::Ok(recv)
            };
            let Ok(mut recv) = attached.await else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            loop {
                let next = tokio::select! {
                    next = recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX) => next,
                    changed = stop.changed(), if !cancel_sent => {
                        if changed.is_ok() && stop.borrow().is_some() {
                            cancel_sent = true;
                            let conn = conn.clone();
                            let cancel = ToAgent::Cancel { attempt: run.attempt, job: job.clone() };
                            tokio::spawn(async move { let _ = request(&conn, &cancel).await; });
                        }
                        continue;
                    }
                };
                match next {
                    Ok(Some(FromAgent::Log(bytes))) => {
                        if log.write_all(&bytes).await.is_err() {
                            return Outcome::fail(
                                JobState::Failed,
                                format!("cannot write {}", log_path.display()),
                            );
                        }
                        offset += bytes.len() as u64;
                        pending.extend_from_slice(&bytes);
                        let (records, used) = LogRecord::decode_all(&pending);
                        pending.drain(..used);
                        for rec in records {
                            self.emit(
                                seq,
                                JobEvent::Output {
                                    node: run.node.clone(),
                                    stderr: rec.stream == Stream::Stderr,
                                    text: String::from_utf8_lossy(&rec.data).into_owned(),
                                },
                            );
                        }
                    }
                    Ok(Some(FromAgent::Exit(exit))) => break 'attach exit,
                    Ok(Some(FromAgent::Unknown)) => {
                        return Outcome::fail(
                            JobState::Failed,
                            format!(
                                "{} has no record of this run: the daemon stopped before the run started, so nothing ran",
                                run.node
                            ),
                        );
                    }
                    Ok(Some(FromAgent::Refused(e))) => return Outcome::fail(JobState::Lost, e),
                    // The link broke: find the agent again.
                    _ => {
                        let _ = log.flush().await;
                        continue 'attach;
                    }
                }
            }
        };
        let _ = log.flush().await;
        let stopped = stop.borrow().clone();
        if let Some(why) = stopped {
            let mut o = stopped_outcome(&why, "while it ran");
            // A cancelled run shows how it was killed; a timed-out one, 124.
            if why == Stop::Cancelled {
                o.exit_code = Some(exit.shell_code());
            }
            return o;
        }
        let code = exit.shell_code();
        let outputs = self
            .with(seq, |e| e.record.outputs.clone())
            .unwrap_or_default();
        let collected = if outputs.is_empty() {
            Ok((0, 0))
        } else {
            match self.link(&run.node, run.attempt) {
                Some(conn) => self.collect(&conn, &job, run, outputs).await,
                None => Err(format!(
                    "{} went away before its outputs were collected",
                    run.node
                )),
            }
        };
        match collected {
            Ok((files, bytes)) => {
                self.set_run(seq, idx, |r| {
                    r.output_files = files;
                    r.output_bytes = bytes;
                })
                .await;
                Outcome {
                    state: if code == 0 {
                        JobState::Succeeded
                    } else {
                        JobState::Failed
                    },
                    exit_code: Some(code),
                    error: (code != 0).then(|| format!("exited with {code}")),
                }
            }
            Err(e) => Outcome {
                state: JobState::Failed,
                exit_code: Some(code),
                error: Some(e),
            },
        }
    }

    /// Fetches the run's outputs into `<outputs_dir>/<node>/`.
    async fn collect(
        &self,
        conn: &Connection,
        job: &str,
        run: &RunRecord,
        globs: Vec<String>,
    ) -> Result<(u64, u64), String> {
        let into = self.inner.dir.join(job).join("outputs").join(&run.node);
        let _ = tokio::fs::remove_dir_all(&into).await;
        let max = self.inner.limits.output_max_bytes;
        let req = ToAgent::Collect {
            attempt: run.attempt,
            job: job.to_owned(),
            globs,
            output_max_bytes: max,
        };
        let went = |e: &dyn std::fmt::Display| {
            format!(
                "{} went away while its outputs were collected: {e}",
                run.node
            )
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| went(&e))?;
        send_frame(&mut send, &req, JOBS_FRAME_LEN_MAX)
            .await
            .map_err(|e| went(&e))?;
        let _ = send.finish();
        let mut files = 0u64;
        let mut bytes = 0u64;
        let mut current: Option<tokio::fs::File> = None;
        let result = loop {
            match recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX).await {
                Ok(Some(FromAgent::File { path, .. })) => {
                    if !safe_relative(&path) {
                        break Err(format!(
                            "{} named an output {path:?} outside its workspace",
                            run.node
                        ));
                    }
                    let dest = into.join(&path);
                    if let Some(parent) = dest.parent() {
                        let _ = tokio::fs::create_dir_all(parent).await;
                    }
                    match tokio::fs::File::create(&dest).await {
                        Ok(f) => current = Some(f),
                        Err(e) => break Err(format!("cannot write {}: {e}", dest.display())),
                    }
                    files += 1;
                }
                Ok(Some(FromAgent::Data(data))) => {
                    bytes += data.len() as u64;
                    if bytes > max {
                        break Err(format!(
                            "the outputs of {} exceed the limit of {}",
                            run.node,
                            size_words(max)
                        ));
                    }
                    if let Some(f) = current.as_mut()
                        && let Err(e) = f.write_all(&data).await
                    {
                        break Err(format!("cannot write an output: {e}"));
                    }
                }
                Ok(Some(FromAgent::Collected)) => break Ok((files, bytes)),
                Ok(Some(FromAgent::Refused(e))) => break Err(e),
                Ok(other) => break Err(format!("unexpected answer {other:?}")),
                Err(e) => break Err(went(&e)),
            }
        };
        if let Some(mut f) = current {
            let _ = f.flush().await;
        }
        if result.is_err() {
            let _ = tokio::fs::remove_dir_all(&into).await;
        }
        result
    }
}

fn stopped_outcome(why: &Stop, when: &str) -> Outcome {
    match why {
        Stop::Cancelled => Outcome::fail(JobState::Cancelled, format!("cancelled {when}")),
        Stop::TimedOut(t) => Outcome {
            state: JobState::Failed,
            exit_code: Some(124),
            error: Some(t.clone()),
        },
    }
}

/// One request, one answer, on a new stream of `conn`.
async fn request(conn: &Connection, req: &ToAgent) -> anyhow::Result<FromAgent> {
    let ask = async {
        let (mut send, mut recv): (SendStream, RecvStream) = conn.open_bi().await?;
        send_frame(&mut send, req, JOBS_FRAME_LEN_MAX).await?;
        let _ = send.finish();
        let answer = recv_frame::<FromAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX)
            .await?
            .ok_or_else(|| anyhow::anyhow!("the agent closed the stream"))?;
        anyhow::Ok(answer)
    };
    tokio::time::timeout(Duration::from_secs(30), ask)
        .await
        .map_err(|_| anyhow::anyhow!("the agent did not answer within 30 s"))?
}

async fn read_at(path: &Path, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut f = tokio::fs::File::open(path).await?;
    f.seek(std::io::SeekFrom::Start(offset)).await?;
    let mut data = vec![0u8; len];
    f.read_exact(&mut data).await?;
    Ok(data)
}

/// Reads and hashes the workspace `dir`, refusing one over `max` bytes.
fn read_workspace(dir: &Path, max: u64) -> Result<Workspace, String> {
    use std::io::Read;
    if !dir.is_dir() {
        return Err(format!(
            "the workspace {} is not a directory on the daemon's machine; nothing was shipped",
            dir.display()
        ));
    }
    let files =
        walk(dir).map_err(|e| format!("cannot read the workspace {}: {e}", dir.display()))?;
    let mut total = 0u64;
    for (_, path) in &files {
        total += std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    }
    if total > max {
        return Err(format!(
            "the workspace {} holds {} in {} file(s), more than the limit of {} \
             (SWACTOR_JOB_WORKSPACE_MAX_BYTES on the daemon); nothing was shipped",
            dir.display(),
            size_words(total),
            files.len(),
            size_words(max)
        ));
    }
    let mut ws = Workspace::default();
    let mut buf = vec![0u8; CHUNK_LEN];
    for (rel, path) in files {
        let unreadable = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
        let mut f = std::fs::File::open(&path).map_err(unreadable)?;
        let meta = f.metadata().map_err(unreadable)?;
        let executable = {
            use std::os::unix::fs::PermissionsExt;
            meta.permissions().mode() & 0o111 != 0
        };
        let mut entry = FileEntry {
            path: rel,
            executable,
            len: 0,
            chunks: Vec::new(),
        };
        loop {
            let mut n = 0;
            while n < CHUNK_LEN {
                let got = f.read(&mut buf[n..]).map_err(unreadable)?;
                if got == 0 {
                    break;
                }
                n += got;
            }
            if n == 0 {
                break;
            }
            let hash = *blake3::hash(&buf[..n]).as_bytes();
            if ws
                .chunks
                .insert(hash, (path.clone(), entry.len, n))
                .is_none()
            {
                ws.order.push(hash);
            }
            entry.chunks.push(hash);
            entry.len += n as u64;
            if n < CHUNK_LEN {
                break;
            }
        }
        ws.bytes += entry.len;
        ws.manifest.push(entry);
    }
    if ws.bytes > max {
        return Err(format!(
            "the workspace {} grew to {} while it was read, more than the limit of {}; nothing was shipped",
            dir.display(),
            size_words(ws.bytes),
            size_words(max)
        ));
    }
    Ok(ws)
}

/// `swactor/jobs/0` on the daemon: each agent's jobs link, checked like a
/// swarm join (its key and token must be those of its attempt).
#[derive(Debug, Clone)]
pub(crate) struct JobsHandler(JobService);

impl ProtocolHandler for JobsHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((_send, _recv, join)) =
            accept_first_frame::<JoinRequest>(&conn, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
        else {
            return Ok(());
        };
        let expected = AgentCredentials::derive(&self.0.inner.secret, &join.key);
        if conn.remote_id() != expected.endpoint_id() || join.token != expected.token {
            tracing::warn!(key = %join.key, "a jobs link was refused: wrong key or token");
            conn.close(1u32.into(), b"not this node's agent");
            return Ok(());
        }
        let key = (join.key.node.to_string(), join.key.attempt.0);
        tracing::info!(node = %key.0, attempt = key.1, "jobs link up");
        self.0
            .inner
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), conn.clone());
        self.0.inner.links_changed.send_modify(|n| *n += 1);
        conn.closed().await;
        let mut links = self
            .0
            .inner
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if links
            .get(&key)
            .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            links.remove(&key);
        }
        drop(links);
        self.0.inner.links_changed.send_modify(|n| *n += 1);
        tracing::info!(node = %key.0, attempt = key.1, "jobs link down");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(state: JobState, exit_code: Option<i32>) -> RunRecord {
        RunRecord {
            node: "worker-0".to_owned(),
            attempt: 1,
            state,
            exit_code,
            error: None,
            shipped_bytes: 0,
            shipped_chunks: 0,
            chunks: 0,
            output_files: 0,
            output_bytes: 0,
        }
    }

    fn job(runs: Vec<RunRecord>) -> JobRecord {
        JobRecord {
            id: "job-1".to_owned(),
            argv: vec!["true".to_owned()],
            env: Vec::new(),
            workspace: None,
            outputs: Vec::new(),
            timeout_s: None,
            created_unix_ms: 0,
            workspace_files: 0,
            workspace_bytes: 0,
            outputs_dir: String::new(),
            cancelled: None,
            runs,
        }
    }

    #[test]
    fn a_job_is_as_far_as_its_runs_under_way_then_as_bad_as_its_worst() {
        use JobState::*;
        let j = job(vec![
            run(Succeeded, Some(0)),
            run(Running, None),
            run(Shipping, None),
        ]);
        assert_eq!(j.state(), Running);
        let j = job(vec![
            run(Succeeded, Some(0)),
            run(Failed, Some(3)),
            run(Lost, None),
        ]);
        assert_eq!(j.state(), Lost);
        let j = job(vec![run(Succeeded, Some(0)), run(Succeeded, Some(0))]);
        assert_eq!(j.state(), Succeeded);
    }

    #[test]
    fn the_exit_code_is_the_worst_runs() {
        use JobState::*;
        let j = job(vec![
            run(Succeeded, Some(0)),
            run(Failed, Some(3)),
            run(Failed, Some(7)),
        ]);
        assert_eq!(j.exit_code(), 7);
        // A run that failed without a code (lost, refused) counts as 1.
        let j = job(vec![run(Succeeded, Some(0)), run(Lost, None)]);
        assert_eq!(j.exit_code(), 1);
        // A run that exited 0 but whose outputs failed is still a failure.
        let j = job(vec![run(Failed, Some(0))]);
        assert_eq!(j.exit_code(), 1);
        assert_eq!(job(vec![run(Succeeded, Some(0))]).exit_code(), 0);
    }

    #[test]
    fn a_workspace_is_cut_into_named_chunks_and_an_oversized_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let big = vec![5u8; CHUNK_LEN + 10];
        std::fs::write(tmp.path().join("big"), &big).unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        std::fs::write(tmp.path().join("d/same"), &big[..10]).unwrap();
        let ws = read_workspace(tmp.path(), 10 << 20).unwrap();
        assert_eq!(ws.bytes, (CHUNK_LEN + 20) as u64);
        let paths: Vec<&str> = ws.manifest.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["big", "d/same"]);
        assert_eq!(ws.manifest[0].chunks.len(), 2);
        // The same bytes are one chunk, sent once.
        assert_eq!(ws.manifest[0].chunks[1], ws.manifest[1].chunks[0]);
        assert_eq!(ws.order.len(), 2);
        assert_eq!(
            ws.manifest[0].chunks[1],
            *blake3::hash(&big[..10]).as_bytes()
        );
        let err = read_workspace(tmp.path(), 1000).unwrap_err();
        assert!(
            err.contains("more than the limit of 0.0 MB (1000 bytes)"),
            "{err}"
        );
    }
}
