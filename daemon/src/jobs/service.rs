//! The daemon's side of jobs: the requests `swactor run`, `swactor jobs` and
//! `swactor job …` make, the records of every job, and the registry of the
//! agents' jobs links.
//!
//! A job is driven by actors ([`super::runner`]): a job actor per job, a run
//! actor per (job, node) run. This module is what the control protocol
//! talks to: it checks a request, records the job in `jobs.redb` before
//! anything is sent, hands the job to its actor, and answers queries from a
//! copy of each job's record that its actor refreshes after every journal
//! write. A restarted daemon reads `jobs.redb` and starts a job actor for
//! every job with runs still under way; the agents keep output and exit
//! status on disk until the daemon has collected them.

use super::blobs::Blobs;
use super::runner::{JobArgs, JobMsg, JobsActor, JobsMsg, RunMsg};
use super::{CHUNK_LEN, FileEntry, Hash, LogRecord, Stream, walk};
use crate::protocol::JoinRequest;
use crate::words::sizes_compared;
use anyhow::Context;
use iroh_blobs::api::TempTag;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_actors::ClusterHandle;
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::journal::{Journal, JournalBatch, JournalContents};
use swactor_engine::net::{Allowlist, PreAuth};
use swactor_engine::net::{FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE, accept_first_frame};
use swactor_engine::ractor::{Actor, ActorId, ActorRef, rpc::CallResult};
use swactor_engine::{BlockingConfig, BlockingPool, Clock, run_until};
use swactor_provisioning::{Intent, LogicalNodeId, NodeAttemptId};
use tokio::sync::{broadcast, watch};

use super::machine::Stop;
use swactor_jobs::admission::{Candidate, check_busy, choose_targets};
pub use swactor_jobs::record::{
    JobEvent, JobRecord, JobSpec, JobState, OutputFile, RunRecord, Targets,
};

/// Events of a job kept for a follower that falls behind.
const EVENTS_KEPT: usize = 4096;

/// Workspaces read (and hashed) at once.
const WORKSPACE_READS_MAX: usize = 2;

/// How long a request may wait for a job actor to answer.
pub(crate) const ACTOR_CALL_WAIT: Duration = Duration::from_secs(60);

/// Refuses when a node of `targets` already has as many runs under way as
/// it may (decided in the jobs core).
fn busy(
    jobs: &BTreeMap<u64, Entry>,
    targets: &[(LogicalNodeId, NodeAttemptId)],
    max: usize,
) -> Result<(), String> {
    check_busy(
        jobs.values().flat_map(|e| e.record.runs.iter()),
        targets,
        max,
    )
    .map_err(|r| r.to_string())
}

/// What the jobs journal says it holds, and its format. Fields added since
/// format 1 default when read, so a journal written before them still opens.
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

#[derive(Debug)]
struct Entry {
    /// The record as last written to the journal.
    record: JobRecord,
    events: broadcast::Sender<JobEvent>,
    /// The job's actor while it runs.
    actor: Option<ActorRef<JobMsg>>,
}

/// Test hooks of debug builds, read from the daemon's environment; release
/// builds ignore the variables.
#[derive(Clone, Debug, Default)]
pub(crate) struct Faults {
    /// `SWACTOR_FAULT_TAMPER_BLOBS`: every chunk the daemon imports into its
    /// blob store gets a byte of its data file flipped, after its hash tree
    /// was computed, so agents are served bytes that do not match.
    pub(crate) tamper_blobs: bool,
    /// `SWACTOR_FAULT_RUN_PANICS_ON=NODE`: the run actor of that node panics
    /// on the first piece of log it receives.
    pub(crate) run_panics_on: Option<String>,
    /// `SWACTOR_FAULT_ABORT_AFTER_RUNNING=1`: the daemon exits (code 86) as
    /// soon as a run's `running` is on record, before its start request is sent.
    pub(crate) abort_after_running: bool,
}

impl Faults {
    fn from_env() -> Self {
        if !cfg!(debug_assertions) {
            return Self::default();
        }
        Self {
            tamper_blobs: std::env::var_os("SWACTOR_FAULT_TAMPER_BLOBS").is_some(),
            run_panics_on: std::env::var("SWACTOR_FAULT_RUN_PANICS_ON").ok(),
            abort_after_running: std::env::var_os("SWACTOR_FAULT_ABORT_AFTER_RUNNING").is_some(),
        }
    }
}

/// What the job service and its actors share: the journal, the records'
/// copies, the links, the limits.
#[derive(Debug)]
pub(crate) struct Shared {
    /// `<state dir>/jobs`: logs and collected outputs.
    pub(crate) dir: PathBuf,
    pub(crate) journal: Journal,
    pub(crate) cluster: ClusterHandle,
    secret: [u8; 32],
    pub(crate) limits: JobLimits,
    pub(crate) links: Links,
    /// Workspace chunks, served to the agents that ship them.
    pub(crate) blobs: Arc<Blobs>,
    pub(crate) clock: Clock,
    pub(crate) faults: Faults,
    jobs: Mutex<BTreeMap<u64, Entry>>,
    blocking: BlockingPool,
}

impl Shared {
    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The record of job `seq` as last written.
    pub(crate) fn record(&self, seq: u64) -> Option<JobRecord> {
        self.jobs().get(&seq).map(|e| e.record.clone())
    }

    /// Writes `record` (job `seq`) to the journal, then makes it the copy
    /// queries read.
    ///
    /// # Errors
    /// The journal cannot be written; the copy is left as it was.
    pub(crate) async fn commit(&self, seq: u64, record: &JobRecord) -> Result<(), String> {
        self.journal
            .commit(JournalBatch::<u64, JobRecord> {
                meta: None,
                put: vec![(format!("{seq:012}"), record.clone())],
                delete: Vec::new(),
            })
            .await
            .map_err(|e| {
                format!(
                    "cannot record job {seq} in {}: {e}",
                    self.journal.path().display()
                )
            })?;
        if let Some(e) = self.jobs().get_mut(&seq) {
            e.record = record.clone();
        }
        Ok(())
    }

    /// Tells job `seq`'s followers about `event`.
    pub(crate) fn emit(&self, seq: u64, event: JobEvent) {
        if let Some(e) = self.jobs().get(&seq) {
            // Nobody following is fine: `swactor job logs` reads the files.
            let _ = e.events.send(event);
        }
    }

    /// Notes which actor drives job `seq` (`None` once it ended).
    pub(crate) fn set_actor(&self, seq: u64, actor: Option<ActorRef<JobMsg>>) {
        if let Some(e) = self.jobs().get_mut(&seq) {
            e.actor = actor;
        }
    }

    /// Where the daemon keeps the log of `job` on `node`.
    pub(crate) fn log_path(&self, job: &str, node: LogicalNodeId) -> PathBuf {
        self.dir.join(job).join(format!("{node}.log"))
    }
}

/// The daemon's jobs: a cheap handle to share.
#[derive(Clone, Debug)]
pub(crate) struct JobService {
    shared: Arc<Shared>,
    root: ActorRef<JobsMsg>,
}

/// A workspace as read for shipping: its manifest and where each chunk is.
#[derive(Debug, Default)]
pub(crate) struct Workspace {
    pub(crate) manifest: Vec<FileEntry>,
    /// Each chunk's file, offset and length.
    pub(crate) chunks: HashMap<Hash, (PathBuf, u64, usize)>,
    /// Every distinct chunk, in the order first seen.
    pub(crate) order: Vec<Hash>,
    pub(crate) bytes: u64,
    /// Keep the chunks in the blob store while the workspace is in use.
    pub(crate) tags: Vec<TempTag>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Milliseconds since the Unix epoch: a job's timeout counts from its
/// acceptance across daemon restarts, which only the wall clock spans.
pub(crate) fn unix_now_ms() -> u64 {
    now_ms()
}

fn seq_of(id: &str) -> Option<u64> {
    id.strip_prefix("job-").unwrap_or(id).parse().ok()
}

impl JobService {
    /// Stops the jobs' supervisor and its job actors, which lets go of
    /// `jobs.redb` once the last handle is dropped (a term of leadership
    /// that ends; the next one opens it again).
    pub(crate) async fn stop(&self) {
        let _ = self
            .root
            .stop_and_wait(None, Some(std::time::Duration::from_secs(5)))
            .await;
    }

    /// Opens `jobs.redb` under `state_root`, starts the jobs' supervisor and
    /// a job actor for every job it says has runs under way.
    ///
    /// # Errors
    /// The journal cannot be opened, or the supervisor cannot start.
    pub(crate) async fn open(
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
        let faults = Faults::from_env();
        let blobs = Arc::new(Blobs::open(&dir.join("blobs"), faults.tamper_blobs).await?);
        let shared = Arc::new(Shared {
            dir,
            journal,
            cluster,
            secret,
            limits,
            links: Links::new(blobs.allowlist.clone()),
            blobs,
            clock: Clock::new(),
            faults,
            jobs: Mutex::new(BTreeMap::new()),
            blocking: BlockingPool::new(&BlockingConfig {
                concurrency_max: WORKSPACE_READS_MAX,
            })?,
        });
        let (root, _) = Actor::spawn(None, JobsActor, shared.clone())
            .await
            .context("cannot start the jobs' supervisor")?;
        let service = Self { shared, root };
        let mut resume = Vec::new();
        for (key, record) in contents.records {
            let Ok(seq) = key.parse::<u64>() else {
                continue;
            };
            if record.runs.iter().any(|r| !r.state.is_final()) {
                resume.push((seq, record.clone()));
            }
            service.insert(seq, record);
        }
        for (seq, record) in resume {
            tracing::info!(job = %record.id, "following a job the last daemon left running");
            service.start(seq, record, None).await?;
        }
        Ok(service)
    }

    fn insert(&self, seq: u64, record: JobRecord) -> broadcast::Receiver<JobEvent> {
        let (events, rx) = broadcast::channel(EVENTS_KEPT);
        self.shared.jobs().insert(
            seq,
            Entry {
                record,
                events,
                actor: None,
            },
        );
        rx
    }

    /// Has the supervisor start job `seq`'s actor.
    async fn start(
        &self,
        seq: u64,
        record: JobRecord,
        workspace: Option<Arc<Workspace>>,
    ) -> anyhow::Result<()> {
        let args = JobArgs {
            shared: self.shared.clone(),
            seq,
            record,
            workspace,
        };
        match self
            .root
            .call(|reply| JobsMsg::Start(args, reply), Some(ACTOR_CALL_WAIT))
            .await
        {
            Ok(CallResult::Success(Ok(()))) => Ok(()),
            Ok(CallResult::Success(Err(e))) => anyhow::bail!("{e}"),
            Ok(_) | Err(_) => anyhow::bail!("the jobs' supervisor did not answer"),
        }
    }

    /// The protocol handler of `swactor/jobs/0`.
    /// The handler of the jobs protocol; its links count against
    /// `pre_auth` until they are checked.
    pub(crate) fn handler(&self, pre_auth: PreAuth) -> JobsHandler {
        JobsHandler(self.shared.clone(), pre_auth)
    }

    /// The handler of [`iroh_blobs::ALPN`] and the allowlist to serve it
    /// behind (the keys of the agents whose jobs link is up).
    pub(crate) fn blobs(&self) -> (Allowlist, iroh_blobs::BlobsProtocol) {
        (
            self.shared.blobs.allowlist.clone(),
            self.shared.blobs.protocol(),
        )
    }

    /// Whether any job runs: one accepted whose runs have not all ended,
    /// on any node (what a run's `idle_teardown_s` waits for).
    pub(crate) fn any_running(&self) -> bool {
        self.shared
            .jobs()
            .values()
            .any(|e| !e.record.state().is_final())
    }

    /// Every job, oldest first.
    pub(crate) fn list(&self) -> Vec<JobRecord> {
        self.shared
            .jobs()
            .values()
            .map(|e| e.record.clone())
            .collect()
    }

    fn find(&self, id: &str) -> Result<u64, String> {
        seq_of(id)
            .filter(|seq| self.shared.jobs().contains_key(seq))
            .ok_or_else(|| format!("no job {id:?} (`swactor jobs` lists them)"))
    }

    /// The recorded output of job `id`, of one node or all, as
    /// (node, from stderr, text) pieces in order.
    pub(crate) async fn logs(
        &self,
        id: &str,
        node: Option<&str>,
    ) -> Result<Vec<(LogicalNodeId, bool, String)>, String> {
        let seq = self.find(id)?;
        let record = self.shared.record(seq).ok_or("gone")?;
        if let Some(n) = node
            && !record.runs.iter().any(|r| r.node.to_string() == n)
        {
            return Err(format!("job {} did not run on {n}", record.id));
        }
        let mut out = Vec::new();
        for run in record
            .runs
            .iter()
            .filter(|r| node.is_none_or(|n| r.node.to_string() == n))
        {
            let bytes = tokio::fs::read(self.shared.log_path(&record.id, run.node))
                .await
                .unwrap_or_default();
            for rec in LogRecord::decode_all(&bytes).0 {
                out.push((
                    run.node,
                    rec.stream == Stream::Stderr,
                    String::from_utf8_lossy(&rec.data).into_owned(),
                ));
            }
        }
        Ok(out)
    }

    /// Cancels job `id` on every node it still runs on; returns the job and those nodes.
    pub(crate) fn cancel(&self, id: &str) -> Result<(String, Vec<LogicalNodeId>), String> {
        let seq = self.find(id)?;
        let jobs = self.shared.jobs();
        let entry = jobs.get(&seq).ok_or_else(|| format!("no job {id:?}"))?;
        let nodes: Vec<LogicalNodeId> = entry
            .record
            .runs
            .iter()
            .filter(|r| !r.state.is_final())
            .map(|r| r.node)
            .collect();
        if !nodes.is_empty()
            && let Some(actor) = &entry.actor
        {
            // A job that ended meanwhile has nothing left to cancel.
            let _ = actor.send_message(JobMsg::Stop(Stop::Cancelled));
        }
        Ok((entry.record.id.clone(), nodes))
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
        check_spec(&spec)?;
        let (targets, skipped) = self.targets(&spec.targets).await?;
        let limits = self.shared.limits;
        // Checked now, before the workspace is read, and again as the job is
        // recorded (another job may have started meanwhile).
        busy(&self.shared.jobs(), &targets, limits.runs_per_node_max)?;
        let workspace = self.load_workspace(spec.workspace.as_ref()).await?;
        let (seq, id, record, rx) = self.enter(&spec, &targets, &workspace)?;
        let forget = || {
            self.shared.jobs().remove(&seq);
        };
        if let Err(e) = tokio::fs::create_dir_all(self.shared.dir.join(&id)).await {
            forget();
            return Err(format!("cannot make the job's directory: {e}"));
        }
        // Recorded before anything is sent.
        if let Err(e) = self.shared.commit(seq, &record).await {
            forget();
            return Err(format!("{e}; nothing was started"));
        }
        let accepted = JobEvent::Accepted {
            job: id,
            nodes: targets.iter().map(|(n, _)| *n).collect(),
            skipped,
            workspace_files: record.workspace_files,
            workspace_bytes: record.workspace_bytes,
        };
        let runs = record.runs.len();
        if let Err(e) = self.start(seq, record, Some(Arc::new(workspace))).await {
            // On record as queued: a restarted daemon marks it failed.
            tracing::error!(job = seq, runs, "{e:#}");
            return Err(format!("{e:#}"));
        }
        Ok((seq, rx, accepted))
    }

    /// Reads the job's workspace, if it ships one, and imports its chunks
    /// into the blob store.
    async fn load_workspace(&self, dir: Option<&PathBuf>) -> Result<Workspace, String> {
        let workspace = match dir {
            None => Workspace::default(),
            Some(dir) => {
                let dir = dir.clone();
                let max = self.shared.limits.workspace_max_bytes;
                let mut ws = self
                    .shared
                    .blocking
                    .call(move |_| read_workspace(&dir, max))
                    .await
                    .map_err(|e| format!("cannot read the workspace: {e}"))??;
                ws.tags = self.shared.blobs.import(&ws).await?;
                ws
            }
        };
        Ok(workspace)
    }

    /// Numbers the job and enters it as queued on `targets`, returning its
    /// number, id, record and events.
    fn enter(
        &self,
        spec: &JobSpec,
        targets: &[(LogicalNodeId, NodeAttemptId)],
        workspace: &Workspace,
    ) -> Result<(u64, String, JobRecord, broadcast::Receiver<JobEvent>), String> {
        // The number is taken and the job entered under one lock, so two
        // jobs submitted at once never share a number or overrun a node.
        let mut jobs = self.shared.jobs();
        busy(&jobs, targets, self.shared.limits.runs_per_node_max)?;
        let seq = jobs.keys().next_back().copied().unwrap_or(0) + 1;
        let id = format!("job-{seq}");
        let outputs_dir = self.shared.dir.join(&id).join("outputs");
        let record = job_record(&id, spec, targets, workspace, &outputs_dir);
        let (events, rx) = broadcast::channel(EVENTS_KEPT);
        jobs.insert(
            seq,
            Entry {
                record: record.clone(),
                events,
                actor: None,
            },
        );
        Ok((seq, id, record, rx))
    }

    /// The (node, attempt)s a job is for, and the nodes left out.
    async fn targets(
        &self,
        targets: &Targets,
    ) -> Result<(Vec<(LogicalNodeId, NodeAttemptId)>, Vec<LogicalNodeId>), String> {
        let snap = self
            .shared
            .cluster
            .snapshot()
            .await
            .map_err(|e| format!("cannot read the cluster: {e}"))?;
        let candidates: Vec<Candidate> = snap
            .nodes
            .iter()
            .map(|n| Candidate {
                node: n.node,
                attempt: n.attempt,
                usable: n.ready && n.intent != Intent::Deleting,
                state: crate::words::state_word(n),
            })
            .collect();
        let picked = choose_targets(targets, &candidates).map_err(|r| r.to_string())?;
        let (chosen, skipped) = (picked.nodes, picked.skipped);
        // A ready node's agent may still be dialing its jobs link.
        for (node, attempt) in &chosen {
            if self
                .shared
                .links
                .wait(&self.shared.clock, *node, attempt.0, Duration::from_secs(5))
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
}

/// Refuses a job without a command, with a timeout that is not a positive
/// number, or with an output glob that leaves the workspace.
fn check_spec(spec: &JobSpec) -> Result<(), String> {
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
    Ok(())
}

/// A new job's record: every run queued, nothing shipped yet.
fn job_record(
    id: &str,
    spec: &JobSpec,
    targets: &[(LogicalNodeId, NodeAttemptId)],
    workspace: &Workspace,
    outputs_dir: &Path,
) -> JobRecord {
    JobRecord {
        id: id.to_owned(),
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
        stop: None,
        runs: targets
            .iter()
            .map(|(node, attempt)| RunRecord {
                node: *node,
                attempt: attempt.0,
                state: JobState::Queued,
                exit_code: None,
                error: None,
                shipped_bytes: 0,
                shipped_chunks: 0,
                chunks: workspace.order.len() as u64,
                output_files: 0,
                output_bytes: 0,
                collected: Vec::new(),
                ended_unix_ms: None,
            })
            .collect(),
    }
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
        let (total, max) = sizes_compared(total, max);
        return Err(format!(
            "the workspace {} holds {total} in {} file(s), more than the limit of {max} \
             (SWACTOR_JOB_WORKSPACE_MAX_BYTES on the daemon); nothing was shipped",
            dir.display(),
            files.len(),
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
        let (bytes, max) = sizes_compared(ws.bytes, max);
        return Err(format!(
            "the workspace {} grew to {bytes} while it was read, more than the limit of {max}; \
             nothing was shipped",
            dir.display(),
        ));
    }
    Ok(ws)
}

/// The agents' jobs links, by (node, attempt), and the run actors waiting
/// on them. A run actor is told when its attempt's link comes up, and when
/// a later attempt of its node links up (its own attempt was replaced). The
/// key of an agent whose link is up may connect to the blob provider.
#[derive(Debug)]
pub(crate) struct Links {
    inner: Mutex<LinksInner>,
    /// Bumped on every change, for requests that wait for a link.
    changed: watch::Sender<u64>,
    /// The blob provider's allowlist.
    blobs: Allowlist,
}

#[derive(Debug, Default)]
struct LinksInner {
    conns: HashMap<(LogicalNodeId, u64), Connection>,
    watchers: Vec<Watcher>,
}

#[derive(Debug)]
struct Watcher {
    node: LogicalNodeId,
    attempt: u64,
    actor: ActorRef<RunMsg>,
}

impl Links {
    fn new(blobs: Allowlist) -> Self {
        Self {
            inner: Mutex::new(LinksInner::default()),
            changed: watch::channel(0).0,
            blobs,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinksInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The live link of (node, attempt).
    pub(crate) fn get(&self, node: LogicalNodeId, attempt: u64) -> Option<Connection> {
        self.lock()
            .conns
            .get(&(node, attempt))
            .filter(|c| c.close_reason().is_none())
            .cloned()
    }

    /// Tells `actor` about links of `node` from now on.
    pub(crate) fn watch(&self, node: LogicalNodeId, attempt: u64, actor: ActorRef<RunMsg>) {
        self.lock().watchers.push(Watcher {
            node,
            attempt,
            actor,
        });
    }

    /// Stops telling actor `id`.
    pub(crate) fn unwatch(&self, id: ActorId) {
        self.lock().watchers.retain(|w| w.actor.get_id() != id);
    }

    /// Records `conn` as the link of (node, attempt); false, changing
    /// nothing, if that attempt has a live link already (a link replaces
    /// another only once the other is gone).
    fn up(&self, node: LogicalNodeId, attempt: u64, conn: Connection) -> bool {
        let mut inner = self.lock();
        let key = (node, attempt);
        if inner
            .conns
            .get(&key)
            .is_some_and(|c| c.close_reason().is_none())
        {
            return false;
        }
        self.blobs.allow(conn.remote_id());
        inner.conns.insert(key, conn);
        // A watcher whose actor is gone (killed with its job) is dropped here.
        inner.watchers.retain(|w| {
            if w.node != node {
                return true;
            }
            let msg = match attempt.cmp(&w.attempt) {
                std::cmp::Ordering::Equal => RunMsg::LinkUp,
                std::cmp::Ordering::Greater => RunMsg::Superseded(format!(
                    "{node} attempt {} was replaced by attempt {attempt}",
                    w.attempt
                )),
                std::cmp::Ordering::Less => return true,
            };
            w.actor.send_message(msg).is_ok()
        });
        drop(inner);
        self.changed.send_modify(|n| *n += 1);
        true
    }

    fn down(&self, node: LogicalNodeId, attempt: u64, conn: &Connection) {
        let mut inner = self.lock();
        let key = (node, attempt);
        if inner
            .conns
            .get(&key)
            .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            inner.conns.remove(&key);
            self.blobs.revoke(&conn.remote_id());
        }
        drop(inner);
        self.changed.send_modify(|n| *n += 1);
    }

    /// The link of (node, attempt), waiting up to `wait` for it.
    pub(crate) async fn wait(
        &self,
        clock: &Clock,
        node: LogicalNodeId,
        attempt: u64,
        wait: Duration,
    ) -> Option<Connection> {
        let mut changed = self.changed.subscribe();
        let deadline = clock.now() + wait;
        loop {
            if let Some(c) = self.get(node, attempt) {
                return Some(c);
            }
            // Woken by every change, never by a timer of its own.
            if !matches!(run_until(deadline, changed.changed()).await, Ok(Ok(()))) {
                return None;
            }
        }
    }
}

/// `swactor/jobs/0` on the daemon: each agent's jobs link, checked like a
/// swarm join (its key and token must be those of its attempt).
#[derive(Debug, Clone)]
pub(crate) struct JobsHandler(Arc<Shared>, PreAuth);

impl ProtocolHandler for JobsHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // Unchecked links are bounded apart from checked ones.
        let Some(unchecked) = self.1.try_enter() else {
            conn.close(
                swactor_engine::net::codes::CLOSE_BUSY,
                b"too many unauthenticated connections",
            );
            return Ok(());
        };
        let Ok((_send, _recv, join)) =
            accept_first_frame::<JoinRequest>(&conn, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
        else {
            return Ok(());
        };
        let key = match join.verify(&self.0.secret, conn.remote_id()) {
            Ok(key) => key,
            Err(reason) => {
                // The key is the peer's unchecked text: logged escaped.
                tracing::warn!(key = ?join.key.text(), %reason, "a jobs link was refused");
                conn.close(1u32.into(), b"not this node's agent");
                return Ok(());
            }
        };
        // Only the node's current, active attempt may link, exactly as
        // only it may join: a superseded, future or unknown attempt, or
        // another run's, is refused, and its key never reaches the blob
        // provider's allowlist.
        match self.0.cluster.agent_check(key.clone()).await {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                // The agent dials its link again (every second at most): a
                // transient refusal is only said at debug level.
                if refusal.is_transient() {
                    tracing::debug!(%key, %refusal, "a jobs link was deferred");
                } else {
                    tracing::warn!(%key, %refusal, "a jobs link was refused");
                }
                conn.close(1u32.into(), b"not this cluster's current attempt");
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(%key, %e, "a jobs link was deferred");
                conn.close(1u32.into(), b"not yet");
                return Ok(());
            }
        }
        let (node, attempt) = (key.node, key.attempt.0);
        // One link per attempt: a second one, while the first is up, is
        // refused and changes nothing of the first.
        if !self.0.links.up(node, attempt, conn.clone()) {
            tracing::warn!(%node, attempt, "a second jobs link for an attempt was refused");
            conn.close(1u32.into(), b"this attempt is linked already");
            return Ok(());
        }
        drop(unchecked);
        tracing::info!(%node, attempt, "jobs link up");
        conn.closed().await;
        self.0.links.down(node, attempt, &conn);
        tracing::info!(%node, attempt, "jobs link down");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            err.contains("holds 1.0 MB in 2 file(s), more than the limit of 1.0 kB"),
            "{err}"
        );
    }
}
