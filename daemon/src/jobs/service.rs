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
use super::{CHUNK_LEN, FileEntry, FromAgent, Hash, LogRecord, Stream, ToAgent, walk};
use crate::words::sizes_compared;
use anyhow::Context;
use iroh_blobs::api::TempTag;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_actors::ClusterHandle;
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::journal::{Journal, JournalBatch, JournalContents};
use swactor_engine::net::Allowlist;
use swactor_engine::ractor::{Actor, ActorId, ActorRef, rpc::CallResult};
use swactor_engine::{BlockingConfig, BlockingPool, Clock, run_until};
use swactor_provisioning::{Intent, LogicalNodeId, NodeAttemptId, ResourceKey};
use tokio::sync::{broadcast, watch};

use super::machine::Stop;
use swactor_jobs::admission::{Candidate, choose_targets};
use swactor_jobs::queue::{Decision, Slot, Waiting, busy_counts, schedule};
pub use swactor_jobs::record::{
    Gang, JobEvent, JobRecord, JobSpec, JobState, OutputFile, RunRecord, Targets, Want,
};

/// Events of a job kept for a follower that falls behind.
const EVENTS_KEPT: usize = 4096;

/// Workspaces read (and hashed) at once.
const WORKSPACE_READS_MAX: usize = 2;

/// Seconds a gang's rank waits for its agent beyond its group's grace.
const REATTACH_MARGIN_S: u64 = 10;

/// The longest a gang's rank may take to say its address: the queue's
/// pass waits for it, and every other waiting job with it.
const PREPARE_WAIT: Duration = Duration::from_secs(5);

/// How long a request may wait for a job actor to answer.
pub(crate) const ACTOR_CALL_WAIT: Duration = Duration::from_secs(60);

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
    /// Most jobs waiting in the queue at once.
    pub(crate) queue_max: usize,
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
            queue_max: usize::try_from(get("SWACTOR_JOB_QUEUE_MAX", 256)?).unwrap_or(usize::MAX),
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
    /// Its workspace, read when it was accepted, kept while it may still
    /// start runs (a job resumed by a restarted daemon reads it again).
    workspace: Option<Arc<Workspace>>,
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
    /// `SWACTOR_FAULT_ABORT_BEFORE_REQUEUE=1`: the daemon exits (code 86)
    /// when a gang is to restart, before that is on record.
    pub(crate) abort_before_requeue: bool,
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
            abort_before_requeue: std::env::var_os("SWACTOR_FAULT_ABORT_BEFORE_REQUEUE").is_some(),
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
    pub(crate) limits: JobLimits,
    pub(crate) links: Links,
    /// Workspace chunks, served to the agents that ship them.
    pub(crate) blobs: Arc<Blobs>,
    pub(crate) clock: Clock,
    pub(crate) faults: Faults,
    jobs: Mutex<BTreeMap<u64, Entry>>,
    blocking: BlockingPool,
    /// Whether a pass of the queue is asked for and not yet begun.
    schedule_asked: std::sync::atomic::AtomicBool,
    /// The jobs' supervisor, which runs the queue's passes.
    root: std::sync::OnceLock<ActorRef<JobsMsg>>,
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

    /// Where the daemon keeps the log of `job` on `node`, for the gang's
    /// `restart` (0 for the first attempt and for every other job).
    pub(crate) fn log_path(&self, job: &str, node: LogicalNodeId, restart: u32) -> PathBuf {
        if restart == 0 {
            self.dir.join(job).join(format!("{node}.log"))
        } else {
            self.dir.join(job).join(format!("{node}.r{restart}.log"))
        }
    }

    /// Asks the supervisor for a pass of the queue, unless one is asked
    /// for already and has not begun.
    pub(crate) fn ask_schedule(&self) {
        use std::sync::atomic::Ordering;
        if self.schedule_asked.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(root) = self.root.get()
            && root.send_message(JobsMsg::Schedule).is_err()
        {
            self.schedule_asked.store(false, Ordering::Release);
        }
    }

    /// Takes the ask for a pass (the pass begins now).
    pub(crate) fn take_schedule_ask(&self) {
        self.schedule_asked
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// The workspace job `seq` keeps, if any.
    pub(crate) fn workspace(&self, seq: u64) -> Option<Arc<Workspace>> {
        self.jobs().get(&seq).and_then(|e| e.workspace.clone())
    }

    /// Drops job `seq`'s workspace (it starts no more runs).
    pub(crate) fn drop_workspace(&self, seq: u64) {
        if let Some(e) = self.jobs().get_mut(&seq) {
            e.workspace = None;
        }
    }

    /// Every job that waits in the queue, with its record.
    pub(crate) fn waiting(&self) -> Vec<(u64, JobRecord)> {
        self.jobs()
            .iter()
            .filter(|(_, e)| e.record.waiting.is_some() && e.actor.is_none())
            .map(|(seq, e)| (*seq, e.record.clone()))
            .collect()
    }

    /// How many jobs each node runs now.
    pub(crate) fn busy(&self) -> BTreeMap<LogicalNodeId, u32> {
        let jobs = self.jobs();
        busy_counts(jobs.values().flat_map(|e| e.record.runs.iter()))
    }

    /// Updates why job `seq` waits, in memory (it says nothing durable);
    /// tells its followers when the words changed.
    pub(crate) fn note_waiting(&self, seq: u64, why: &str) {
        let mut jobs = self.jobs();
        let Some(e) = jobs.get_mut(&seq) else {
            return;
        };
        if e.record.waiting.as_deref() == Some(why) {
            return;
        }
        e.record.waiting = Some(why.to_owned());
        let _ = e.events.send(JobEvent::Queued {
            job: e.record.id.clone(),
            why: why.to_owned(),
        });
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
        // Unused: every link is a swarm session, whose join the swarm
        // checks with the secret (see [`JobLinks`]).
        _secret: [u8; 32],
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
            limits,
            links: Links::new(blobs.allowlist.clone()),
            blobs,
            clock: Clock::new(),
            faults,
            jobs: Mutex::new(BTreeMap::new()),
            blocking: BlockingPool::new(&BlockingConfig {
                concurrency_max: WORKSPACE_READS_MAX,
            })?,
            schedule_asked: std::sync::atomic::AtomicBool::new(false),
            root: std::sync::OnceLock::new(),
        });
        let (root, _) = Actor::spawn(None, JobsActor, shared.clone())
            .await
            .context("cannot start the jobs' supervisor")?;
        let _ = shared.root.set(root.clone());
        let service = Self { shared, root };
        let mut resume = Vec::new();
        for (key, mut record) in contents.records {
            let Ok(seq) = key.parse::<u64>() else {
                continue;
            };
            // Placed, but nothing was sent to any node: back to the queue.
            if record.want.is_some()
                && !record.runs.is_empty()
                && record.runs.iter().all(|r| r.state == JobState::Queued)
                && record.stop.is_none()
            {
                record.runs.clear();
                record.waiting = Some("back in the queue after a daemon restart".to_owned());
                service
                    .shared
                    .commit(seq, &record)
                    .await
                    .map_err(anyhow::Error::msg)?;
            }
            // Every rank ended and the gang was to restart, but the last
            // daemon stopped before that was on record: it is now.
            if record.waiting.is_none()
                && let swactor_jobs::gang::Next::Restart(why) = swactor_jobs::gang::next(&record)
            {
                swactor_jobs::gang::requeue(&mut record, &why);
                service
                    .shared
                    .commit(seq, &record)
                    .await
                    .map_err(anyhow::Error::msg)?;
            }
            if record.runs.iter().any(|r| !r.state.is_final()) {
                resume.push((seq, record.clone()));
            }
            service.insert(seq, record);
        }
        for (seq, record) in resume {
            tracing::info!(job = %record.id, "following a job the last daemon left running");
            service.start(seq, record, None).await?;
        }
        // Wake the queue on every change of the cluster and of the agents'
        // links; the task ends with the cluster or the supervisor.
        let events = service
            .shared
            .cluster
            .subscribe()
            .await
            .context("cannot follow the cluster for the job queue")?
            .events;
        tokio::spawn(wake_queue(service.shared.clone(), events));
        service.shared.ask_schedule();
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
                workspace: None,
            },
        );
        rx
    }

    /// Has the supervisor start job `seq`'s actor (a job resumed from the
    /// journal).
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
            .call(
                |reply| JobsMsg::Start(Box::new(args), reply),
                Some(ACTOR_CALL_WAIT),
            )
            .await
        {
            Ok(CallResult::Success(Ok(()))) => Ok(()),
            Ok(CallResult::Success(Err(e))) => anyhow::bail!("{e}"),
            Ok(_) | Err(_) => anyhow::bail!("the jobs' supervisor did not answer"),
        }
    }

    /// What the swarm makes each welcomed agent's connection its jobs
    /// link with.
    pub(crate) fn job_links(&self) -> JobLinks {
        JobLinks(Arc::clone(&self.shared))
    }

    /// The handler of [`iroh_blobs::ALPN`] and the allowlist to serve it
    /// behind (the keys of the agents whose jobs link is up).
    pub(crate) fn blobs(&self) -> (Allowlist, iroh_blobs::BlobsProtocol) {
        (
            self.shared.blobs.allowlist.clone(),
            self.shared.blobs.protocol(),
        )
    }

    /// The agents' jobs links and the clock to wait for one by (remote
    /// shells and forwarded connections go over the same links).
    pub(crate) fn links(&self) -> (&Links, &Clock) {
        (&self.shared.links, &self.shared.clock)
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
            && !record
                .runs
                .iter()
                .chain(record.earlier.iter().flat_map(|e| e.runs.iter()))
                .any(|r| r.node.to_string() == n)
        {
            return Err(format!("job {} did not run on {n}", record.id));
        }
        let mut out = Vec::new();
        // A restarted gang's earlier attempts first, then the last one.
        let restarts = record.gang.as_ref().map_or(0, |g| g.restarts);
        let mut attempts: Vec<(u32, LogicalNodeId)> = Vec::new();
        for e in &record.earlier {
            attempts.extend(e.runs.iter().map(|r| (e.restart, r.node)));
        }
        attempts.extend(record.runs.iter().map(|r| (restarts, r.node)));
        for (restart, run_node) in attempts {
            let run = RunNode { node: run_node };
            if node.is_some_and(|n| run.node.to_string() != n) {
                continue;
            }
            let bytes = tokio::fs::read(self.shared.log_path(&record.id, run.node, restart))
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
    pub(crate) async fn cancel(&self, id: &str) -> Result<(String, Vec<LogicalNodeId>), String> {
        let seq = self.find(id)?;
        // A job that waits in the queue ends here, before it ever starts.
        // The supervisor runs the queue's passes: asked there, a cancel
        // never races a pass that is starting the job.
        match self
            .root
            .call(
                |reply| JobsMsg::CancelQueued(seq, reply),
                Some(ACTOR_CALL_WAIT),
            )
            .await
        {
            Ok(CallResult::Success(Ok(true))) => {
                let id = self
                    .shared
                    .record(seq)
                    .map_or_else(|| id.to_owned(), |r| r.id);
                return Ok((id, Vec::new()));
            }
            Ok(CallResult::Success(Ok(false))) => {}
            Ok(CallResult::Success(Err(e))) => return Err(e),
            Ok(_) | Err(_) => return Err("the jobs' supervisor did not answer".to_owned()),
        }
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

    /// Accepts a job: checks everything, records it as waiting in the
    /// queue, and asks for a pass of the queue. Returns its number and its
    /// events from the start.
    ///
    /// # Errors
    /// Anything wrong with the request, in words; nothing was shipped then.
    pub(crate) async fn submit(
        &self,
        spec: JobSpec,
    ) -> Result<(u64, broadcast::Receiver<JobEvent>, JobEvent), String> {
        check_spec(&spec)?;
        let (want, skipped) = self.targets(&spec.targets).await?;
        let queue_max = self.shared.limits.queue_max;
        let full = |n: usize| {
            format!(
                "the job queue holds {n} waiting job(s), the most it may \
                 (SWACTOR_JOB_QUEUE_MAX={queue_max} on the daemon); nothing was started"
            )
        };
        // Checked now, before the workspace is read, and again as the job
        // is entered (another may have been entered meanwhile).
        let n = self.shared.waiting().len();
        if n >= queue_max {
            return Err(full(n));
        }
        let workspace = self.load_workspace(spec.workspace.as_ref()).await?;
        let (seq, id, record, rx) = {
            let mut jobs = self.shared.jobs();
            let n = jobs.values().filter(|e| e.record.waiting.is_some()).count();
            if n >= queue_max {
                return Err(full(n));
            }
            let seq = jobs.keys().next_back().copied().unwrap_or(0) + 1;
            let id = format!("job-{seq}");
            let outputs_dir = self.shared.dir.join(&id).join("outputs");
            let record = job_record(&id, &spec, want.clone(), &workspace, &outputs_dir);
            let (events, rx) = broadcast::channel(EVENTS_KEPT);
            jobs.insert(
                seq,
                Entry {
                    record: record.clone(),
                    events,
                    actor: None,
                    workspace: Some(Arc::new(workspace)),
                },
            );
            (seq, id, record, rx)
        };
        let forget = || {
            self.shared.jobs().remove(&seq);
        };
        if let Err(e) = tokio::fs::create_dir_all(self.shared.dir.join(&id)).await {
            forget();
            return Err(format!("cannot make the job's directory: {e}"));
        }
        // Recorded before anything is sent: a restarted daemon queues it again.
        if let Err(e) = self.shared.commit(seq, &record).await {
            forget();
            return Err(format!("{e}; nothing was started"));
        }
        let accepted = JobEvent::Accepted {
            job: id,
            nodes: match &want {
                Want::Each(nodes) => nodes.clone(),
                Want::Gang { .. } => Vec::new(),
            },
            skipped,
            workspace_files: record.workspace_files,
            workspace_bytes: record.workspace_bytes,
        };
        self.shared.ask_schedule();
        Ok((seq, rx, accepted))
    }

    /// Reads the job's workspace, if it ships one, and imports its chunks
    /// into the blob store.
    async fn load_workspace(&self, dir: Option<&PathBuf>) -> Result<Workspace, String> {
        load_workspace(&self.shared, dir).await
    }

    /// What a job waits for, and the nodes its targets left out (not
    /// ready at submission). Named nodes must exist and be ready now; a
    /// gang's groups must exist.
    async fn targets(&self, targets: &Targets) -> Result<(Want, Vec<LogicalNodeId>), String> {
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
        Ok(match targets {
            Targets::Gang { nodes, groups } => (
                Want::Gang {
                    nodes: *nodes,
                    groups: groups.clone(),
                },
                Vec::new(),
            ),
            _ => (
                Want::Each(picked.nodes.iter().map(|(n, _)| *n).collect()),
                picked.skipped,
            ),
        })
    }
}

/// What a pass of the queue found to start: each job placed, its record
/// (on record already) and its workspace.
pub(crate) type Placed = (u64, JobRecord, Option<Arc<Workspace>>);

/// One pass of the queue: asks the jobs core which waiting jobs start now
/// on the cluster as it is, records each placement (and each job that can
/// never start) before anything is sent, and returns the jobs to start.
/// Jobs that keep waiting get their reason updated.
pub(crate) async fn pass(shared: &Arc<Shared>) -> Vec<Placed> {
    shared.take_schedule_ask();
    let waiting_jobs = shared.waiting();
    if waiting_jobs.is_empty() {
        return Vec::new();
    }
    let now = unix_now_ms();
    let mut placed = Vec::new();
    let mut waiting = Vec::new();
    for (seq, record) in &waiting_jobs {
        // A queued job's timeout counts from its acceptance, too.
        if swactor_jobs::machine::timeout_left(record.timeout_s, record.created_unix_ms, now)
            == Some(Duration::ZERO)
        {
            let t = record.timeout_s.unwrap_or_default();
            let why = format!("timed out after {t} s while it waited in the queue");
            end_queued(shared, *seq, Stop::TimedOut(why)).await;
            continue;
        }
        if let Some(want) = record.want.clone() {
            waiting.push(Waiting {
                seq: *seq,
                priority: record.priority,
                want,
            });
        }
    }
    // The groups' policies only: the shape on record, not the whole state.
    let Ok(view) = shared.cluster.desired().await else {
        return placed;
    };
    let Ok(snap) = shared.cluster.snapshot().await else {
        return placed;
    };
    let groups: BTreeMap<&str, swactor_provisioning::GroupPolicy> = view
        .desired
        .groups
        .iter()
        .map(|g| (g.id.as_str(), g.policy))
        .collect();
    let grace: BTreeMap<&str, f64> = view
        .desired
        .groups
        .iter()
        .map(|g| (g.id.as_str(), g.template.join.lost_grace_s))
        .collect();
    let busy = shared.busy();
    let slots: Vec<Slot> = snap
        .nodes
        .iter()
        .map(|n| {
            let linked = shared.links.get(n.node, n.attempt.0).is_some();
            let ready = n.ready && n.intent != Intent::Deleting;
            Slot {
                node: n.node,
                attempt: n.attempt,
                usable: ready && linked,
                state: if ready && !linked {
                    "ready, but its agent has not linked for jobs yet"
                } else {
                    crate::words::state_word(n)
                },
                limit: groups
                    .get(n.node.group.as_str())
                    .map_or(1, |p| p.jobs_per_node.max(1)),
                busy: busy.get(&n.node).copied().unwrap_or(0),
            }
        })
        .collect();
    for decision in schedule(&waiting, &slots) {
        match decision {
            Decision::Wait { seq, why } => shared.note_waiting(seq, &format!("queued: {why}")),
            Decision::Fail { seq, why } => {
                let Some(mut record) = shared.record(seq) else {
                    continue;
                };
                record.waiting = None;
                record.cancelled = Some(why);
                if let Err(e) = shared.commit(seq, &record).await {
                    tracing::error!("{e}");
                }
                shared.drop_workspace(seq);
                shared.emit(seq, JobEvent::Done(Box::new(record)));
            }
            Decision::Start { seq, nodes } => {
                let Some(record) = shared.record(seq) else {
                    continue;
                };
                match place(shared, seq, record, &nodes, &groups, &grace).await {
                    Ok(p) => placed.push(p),
                    Err(why) => shared.note_waiting(seq, &format!("queued: {why}")),
                }
            }
        }
    }
    placed
}

/// Places job `seq` on `nodes`: reads its workspace again if this daemon
/// does not hold it, asks a gang's ranks for their addresses, records the
/// runs. Nothing is sent to run before the record is durable.
async fn place(
    shared: &Arc<Shared>,
    seq: u64,
    mut record: JobRecord,
    nodes: &[(LogicalNodeId, NodeAttemptId)],
    groups: &BTreeMap<&str, swactor_provisioning::GroupPolicy>,
    grace: &BTreeMap<&str, f64>,
) -> Result<Placed, String> {
    let workspace = match shared.workspace(seq) {
        Some(ws) => Some(ws),
        None => {
            let dir = record.workspace.as_ref().map(PathBuf::from);
            let ws = load_workspace(shared, dir.as_ref())
                .await
                .map_err(|e| format!("its workspace cannot be read again: {e}"))?;
            let ws = Arc::new(ws);
            if let Some(e) = shared.jobs().get_mut(&seq) {
                e.workspace = Some(ws.clone());
            }
            Some(ws)
        }
    };
    let chunks = workspace.as_ref().map_or(0, |w| w.order.len() as u64);
    if let Some(gang) = record.gang.as_mut() {
        let asks = nodes.iter().map(|(node, attempt)| async move {
            let Some(conn) = shared.links.get(*node, attempt.0) else {
                return Err(format!("{node} has no jobs link any more"));
            };
            let req = ToAgent::Prepare { attempt: attempt.0 };
            match super::runner::request_within(shared, &conn, &req, PREPARE_WAIT).await {
                Ok(FromAgent::Prepared { addr, port, gpus }) => Ok((addr, port, gpus)),
                Ok(other) => Err(format!("{node} answered {other:?} to prepare")),
                Err(e) => Err(format!("{node} could not be prepared: {e}")),
            }
        });
        let answers = futures_util::future::join_all(asks).await;
        let mut addrs = Vec::with_capacity(answers.len());
        let mut gpus = Vec::with_capacity(answers.len());
        let mut port = 0;
        for (rank, (answer, (node, _))) in answers.into_iter().zip(nodes).enumerate() {
            let (addr, p, reported) = answer?;
            if rank == 0 {
                port = p;
            }
            addrs.push(addr);
            gpus.push(
                groups
                    .get(node.group.as_str())
                    .and_then(|g| g.gpus)
                    .unwrap_or(reported),
            );
        }
        if port == 0 {
            return Err(format!("{} found no free port", nodes[0].0));
        }
        gang.addrs = addrs;
        gang.master_port = port;
        gang.gpus = gpus;
        // Longer than any rank's group grace: the cluster decides whether
        // a silent node is lost (and replaced) before its rank gives up.
        gang.reattach_s = nodes
            .iter()
            .filter_map(|(node, _)| grace.get(node.group.as_str()))
            .fold(0u64, |m, g| m.max(g.ceil() as u64 + REATTACH_MARGIN_S));
    }
    let restart = record.gang.as_ref().map_or(0, |g| g.restarts);
    let outputs = shared.dir.join(&record.id).join(if restart == 0 {
        "outputs".to_owned()
    } else {
        format!("outputs.r{restart}")
    });
    record.outputs_dir = outputs.display().to_string();
    record.runs = placed_runs(&record, nodes, chunks);
    record.waiting = None;
    shared.commit(seq, &record).await?;
    shared.emit(
        seq,
        JobEvent::Placed {
            nodes: nodes.iter().map(|(n, _)| *n).collect(),
            restart,
        },
    );
    Ok((seq, record, workspace))
}

/// Ends job `seq`, which waits in the queue, for `stop`: on record, then
/// told to its followers. False if it no longer waits.
pub(crate) async fn end_queued(shared: &Shared, seq: u64, stop: Stop) -> bool {
    let Some(mut record) = shared.record(seq) else {
        return false;
    };
    if record.waiting.is_none() {
        return false;
    }
    record.waiting = None;
    record.cancelled = Some(match &stop {
        Stop::Cancelled => "cancelled while it waited in the queue".to_owned(),
        Stop::TimedOut(why) | Stop::Gang(why) => why.clone(),
    });
    record.stop = Some(stop);
    if let Err(e) = shared.commit(seq, &record).await {
        tracing::error!("{e}");
    }
    shared.drop_workspace(seq);
    shared.emit(seq, JobEvent::Done(Box::new(record)));
    true
}

/// Reads the workspace `dir`, if any, and imports its chunks.
async fn load_workspace(shared: &Shared, dir: Option<&PathBuf>) -> Result<Workspace, String> {
    let workspace = match dir {
        None => Workspace::default(),
        Some(dir) => {
            let dir = dir.clone();
            let max = shared.limits.workspace_max_bytes;
            let mut ws = shared
                .blocking
                .call(move |_| read_workspace(&dir, max))
                .await
                .map_err(|e| format!("cannot read the workspace: {e}"))??;
            ws.tags = shared.blobs.import(&ws).await?;
            ws
        }
    };
    Ok(workspace)
}

/// Asks for a pass of the queue on every change of the cluster or of the
/// agents' jobs links, until either is gone.
async fn wake_queue(
    shared: Arc<Shared>,
    mut events: broadcast::Receiver<swactor_actors::ClusterEvent>,
) {
    let mut links = shared.links.changed.subscribe();
    loop {
        tokio::select! {
            got = events.recv() => match got {
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return,
            },
            got = links.changed() => if got.is_err() { return },
        }
        if shared.root.get().is_none_or(|r| {
            !matches!(
                r.get_status(),
                swactor_engine::ractor::ActorStatus::Running
                    | swactor_engine::ractor::ActorStatus::Starting
                    | swactor_engine::ractor::ActorStatus::Upgrading
            )
        }) {
            return;
        }
        shared.ask_schedule();
    }
}

/// A run's node, as the log reader needs it.
struct RunNode {
    node: LogicalNodeId,
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
    if spec.retry > 0 && !matches!(spec.targets, Targets::Gang { .. }) {
        return Err(
            "--retry restarts a gang (`--nodes N`) whose node was lost; a job on --all, \
             --group or named nodes never runs twice"
                .to_owned(),
        );
    }
    if spec.setup.as_ref().is_some_and(Vec::is_empty) {
        return Err("--setup needs a command".to_owned());
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

/// A new job's record: waiting in the queue, no run placed yet.
fn job_record(
    id: &str,
    spec: &JobSpec,
    want: Want,
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
        runs: Vec::new(),
        gang: match &want {
            Want::Gang { nodes, .. } => Some(Gang {
                nodes: *nodes,
                retry: spec.retry,
                ..Gang::default()
            }),
            Want::Each(_) => None,
        },
        want: Some(want),
        waiting: Some("waiting for its first pass of the queue".to_owned()),
        priority: spec.priority,
        earlier: Vec::new(),
        setup: spec.setup.clone(),
    }
}

/// The runs of a job placed on `nodes` (in rank order for a gang), each
/// queued, bound to its attempt.
pub(crate) fn placed_runs(
    record: &JobRecord,
    nodes: &[(LogicalNodeId, NodeAttemptId)],
    chunks: u64,
) -> Vec<RunRecord> {
    nodes
        .iter()
        .enumerate()
        .map(|(rank, (node, attempt))| {
            let rank = record.gang.as_ref().map(|_| rank as u32);
            RunRecord::placed(*node, attempt.0, chunks, rank)
        })
        .collect()
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

/// The agents' jobs links (each a welcomed agent's swarm connection, see
/// [`JobLinks`]), by (node, attempt), and the run actors waiting on them. A run actor is told when its attempt's link comes up, and when
/// a later attempt of its node links up (its own attempt was replaced). The
/// key of an agent whose link is up may connect to the blob provider.
#[derive(Debug)]
pub(crate) struct Links {
    inner: Mutex<LinksInner>,
    /// Bumped on every change, for requests that wait for a link (and the
    /// queue, which starts jobs only on linked nodes).
    pub(crate) changed: watch::Sender<u64>,
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

/// Where the swarm hands each agent it welcomes: from the welcome on, the
/// agent's swarm connection is its attempt's jobs link too, until the
/// [`JobLink`] it gets back is dropped (its session ended).
///
/// The swarm has checked the join by then (the attempt's own key and
/// token, and the cluster's word that it is the node's current, active
/// attempt) and holds one session per attempt, so nothing here checks a
/// peer again: an unauthenticated, refused, deferred or superseded peer
/// never reaches it, and its key never the blob provider's allowlist.
#[derive(Debug, Clone)]
pub(crate) struct JobLinks(Arc<Shared>);

impl JobLinks {
    /// Makes `conn` the jobs link of `key`'s attempt, for as long as the
    /// returned guard lives; `None`, changing nothing, when that attempt
    /// is linked on another live connection already (the swarm closes a
    /// superseded session's connection before it welcomes the next, so
    /// this is a bug's mark, not a peer's doing).
    pub(crate) fn link(&self, key: &ResourceKey, conn: &Connection) -> Option<JobLink> {
        let (node, attempt) = (key.node, key.attempt.0);
        if !self.0.links.up(node, attempt, conn.clone()) {
            tracing::warn!(%node, attempt, "a second jobs link for an attempt was refused");
            return None;
        }
        tracing::info!(%node, attempt, "jobs link up");
        Some(JobLink {
            shared: Arc::clone(&self.0),
            node,
            attempt,
            conn: conn.clone(),
        })
    }
}

/// A welcomed agent's jobs link; dropping it takes the link down (a run
/// waiting on it waits for the agent's next session).
#[derive(Debug)]
pub(crate) struct JobLink {
    shared: Arc<Shared>,
    node: LogicalNodeId,
    attempt: u64,
    conn: Connection,
}

impl Drop for JobLink {
    fn drop(&mut self) {
        self.shared.links.down(self.node, self.attempt, &self.conn);
        tracing::info!(node = %self.node, attempt = self.attempt, "jobs link down");
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
