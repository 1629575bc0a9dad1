//! The records of jobs and runs, as the daemon keeps them in `jobs.redb`
//! and shows them, and what `swactor run` asks for and is told.

use crate::wire::ExitInfo;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use swactor_provisioning::LogicalNodeId;

/// Where a job or a run is.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
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
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Failed | Self::Cancelled | Self::Lost
        )
    }

    /// The state's word.
    pub fn word(self) -> &'static str {
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

/// A collected output file, as the daemon verified and kept it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct OutputFile {
    /// Path relative to the workspace (and to `<outputs_dir>/<node>/`).
    pub path: String,
    /// Length in bytes.
    pub len: u64,
    /// BLAKE3 of its bytes, in hex; the daemon checked the bytes against it.
    pub blake3: String,
}

/// One run of a job: a node's attempt, and what became of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// The node (written as its id, `worker-3`, as a string was before).
    pub node: LogicalNodeId,
    /// The attempt of the node the run was meant for.
    pub attempt: u64,
    /// Where it is.
    pub state: JobState,
    /// The exit code (128 + signal when a signal ended it).
    pub exit_code: Option<i32>,
    /// Why it failed, was lost or cancelled.
    pub error: Option<String>,
    /// Workspace bytes sent to the node for this run.
    pub shipped_bytes: u64,
    /// Chunks sent to the node for this run.
    pub shipped_chunks: u64,
    /// Chunks of the workspace.
    pub chunks: u64,
    /// Output files collected.
    pub output_files: u64,
    /// Output bytes collected.
    pub output_bytes: u64,
    /// The output files collected, each with its verified hash.
    #[serde(default)]
    pub collected: Vec<OutputFile>,
    /// When it ended, in ms since the Unix epoch.
    #[serde(default)]
    pub ended_unix_ms: Option<u64>,
    /// Its rank in a gang job (0…N-1, stable for the job).
    #[serde(default)]
    pub rank: Option<u32>,
    /// Whether it ended `lost` because the cluster replaced its node (the
    /// only loss that restarts a gang with retries left).
    #[serde(default)]
    pub node_lost: bool,
}

impl RunRecord {
    /// A run placed on (`node`, `attempt`), queued, of a workspace of
    /// `chunks` chunks; `rank` for a gang's ranks.
    pub fn placed(node: LogicalNodeId, attempt: u64, chunks: u64, rank: Option<u32>) -> Self {
        Self {
            node,
            attempt,
            state: JobState::Queued,
            exit_code: None,
            error: None,
            shipped_bytes: 0,
            shipped_chunks: 0,
            chunks,
            output_files: 0,
            output_bytes: 0,
            collected: Vec::new(),
            ended_unix_ms: None,
            rank,
            node_lost: false,
        }
    }
}

/// A job as the journal keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    /// `job-N`.
    pub id: String,
    /// The command.
    pub argv: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// The workspace directory, as given.
    pub workspace: Option<String>,
    /// Output globs.
    pub outputs: Vec<String>,
    /// The timeout in seconds.
    pub timeout_s: Option<f64>,
    /// When it was accepted, in ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Files in the workspace.
    pub workspace_files: u64,
    /// Bytes in the workspace.
    pub workspace_bytes: u64,
    /// Where the collected outputs are: `<dir>/<node>/…`.
    pub outputs_dir: String,
    /// Why it was cancelled or stopped, once it was.
    pub cancelled: Option<String>,
    /// The stop itself, recorded before any run is told, so a restarted
    /// daemon carries it out.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Its runs.
    pub runs: Vec<RunRecord>,
    /// What it waits for in the queue; absent for a job recorded before
    /// the queue existed (its runs were placed when it was accepted).
    #[serde(default)]
    pub want: Option<Want>,
    /// Why it is queued, while it waits without runs.
    #[serde(default)]
    pub waiting: Option<String>,
    /// Its place in the queue: higher first, then the order of submission.
    #[serde(default)]
    pub priority: i32,
    /// A gang job's ranks and restarts.
    #[serde(default)]
    pub gang: Option<Gang>,
    /// The runs of a gang's earlier attempts, one entry per restart.
    #[serde(default)]
    pub earlier: Vec<EarlierAttempt>,
    /// A command run on each node before the job, once per (setup,
    /// workspace) on a node.
    #[serde(default)]
    pub setup: Option<Vec<String>>,
}

/// What a queued job waits for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum Want {
    /// A free slot on each of these nodes (`--all`, `--group`, or named nodes).
    Each(Vec<LogicalNodeId>),
    /// Any `nodes` ready nodes of `groups` (of the cluster when empty), all at once.
    Gang {
        /// How many.
        nodes: u32,
        /// Of which groups.
        groups: Vec<String>,
    },
}

/// A gang job's shared facts: what each rank is told.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Gang {
    /// Ranks (nodes) it takes.
    pub nodes: u32,
    /// Restarts it may make after a node is lost (`--retry`).
    pub retry: u32,
    /// Restarts made so far (`SWACTOR_RESTART_COUNT`).
    pub restarts: u32,
    /// Each rank's address, in rank order, as its agent reported it; empty
    /// until the ranks were prepared.
    pub addrs: Vec<String>,
    /// A free port on rank 0, for the ranks to meet at.
    pub master_port: u16,
    /// GPUs each rank has: the group's declared count, else the node's report.
    pub gpus: Vec<u32>,
    /// Seconds a rank whose agent went away waits for it before it is
    /// `lost` (at least the daemon's `SWACTOR_JOB_REATTACH_S`): longer than
    /// its group's `lost_grace_s`, so the cluster decides about the node
    /// (and a restart can follow) before the rank gives up on it.
    #[serde(default)]
    pub reattach_s: u64,
}

/// The runs of one attempt of a gang that was restarted.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EarlierAttempt {
    /// Which restart it was (0: the first attempt).
    pub restart: u32,
    /// Where its collected outputs are.
    pub outputs_dir: String,
    /// Its runs, as they ended.
    pub runs: Vec<RunRecord>,
}

impl JobRecord {
    /// The job's state: its runs' while any is under way, else the worst outcome.
    pub fn state(&self) -> JobState {
        if self.waiting.is_some() {
            return JobState::Queued;
        }
        // Ended in the queue, before any run was placed.
        if self.runs.is_empty() && self.cancelled.is_some() {
            return match self.stop {
                Some(Stop::Cancelled) => JobState::Cancelled,
                _ => JobState::Failed,
            };
        }
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
    pub fn exit_code(&self) -> i32 {
        if self.runs.is_empty() && self.cancelled.is_some() {
            return match self.stop {
                Some(Stop::TimedOut(_)) => 124,
                Some(Stop::Cancelled) => 130,
                _ => 1,
            };
        }
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

    /// Applies `change` to run `idx` at `now_unix_ms`; returns the event
    /// that tells followers about it, if any. A change to a run that already
    /// ended is ignored: a final state is never overwritten.
    pub fn apply(&mut self, idx: usize, change: &Change, now_unix_ms: u64) -> Option<JobEvent> {
        let of = self.runs.first().map_or(0, |r| r.chunks);
        let run = self.runs.get_mut(idx)?;
        if run.state.is_final() {
            return None;
        }
        match change {
            Change::Shipping => {
                run.state = JobState::Shipping;
                None
            }
            Change::Shipped { bytes, chunks } => {
                run.shipped_bytes = *bytes;
                run.shipped_chunks = *chunks;
                Some(JobEvent::Shipped {
                    node: run.node,
                    bytes: *bytes,
                    chunks: *chunks,
                    of,
                })
            }
            Change::Running => {
                run.state = JobState::Running;
                None
            }
            Change::Finished(outcome) => {
                debug_assert!(outcome.state.is_final(), "{outcome:?}");
                run.state = outcome.state;
                run.exit_code = outcome.exit_code;
                run.error.clone_from(&outcome.error);
                run.output_files = outcome.collected.len() as u64;
                run.output_bytes = outcome.collected.iter().map(|f| f.len).sum();
                run.collected.clone_from(&outcome.collected);
                run.node_lost = outcome.node_lost;
                run.ended_unix_ms = Some(now_unix_ms);
                Some(JobEvent::Finished(run.clone()))
            }
        }
    }
}

/// Which nodes a job is for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Targets {
    /// Every ready node.
    All,
    /// Every ready node of these groups.
    Groups(Vec<String>),
    /// These nodes, each of which must be ready.
    Nodes(Vec<String>),
    /// `nodes` ready nodes taken together (of `groups`, or of the cluster
    /// when empty): a gang, whose ranks start together or not at all.
    Gang {
        /// How many.
        nodes: u32,
        /// Of which groups.
        groups: Vec<String>,
    },
}

/// A job as `swactor run` asks for it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobSpec {
    /// Where it runs.
    pub targets: Targets,
    /// The workspace directory (absolute), if any.
    pub workspace: Option<PathBuf>,
    /// Output globs.
    pub outputs: Vec<String>,
    /// Seconds before the job is stopped.
    pub timeout_s: Option<f64>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// The command.
    pub argv: Vec<String>,
    /// Its place in the queue (higher first; default 0).
    #[serde(default)]
    pub priority: i32,
    /// Restarts a gang may make after losing a node.
    #[serde(default)]
    pub retry: u32,
    /// A command to run on each node before the job, skipped where it
    /// already ran with the same workspace.
    #[serde(default)]
    pub setup: Option<Vec<String>>,
}

/// What `swactor run` is told as a job goes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JobEvent {
    /// The job was accepted.
    Accepted {
        /// Its id.
        job: String,
        /// The nodes it runs on.
        nodes: Vec<LogicalNodeId>,
        /// Nodes left out because they are not ready.
        skipped: Vec<LogicalNodeId>,
        /// Files in the workspace.
        workspace_files: u64,
        /// Bytes in the workspace.
        workspace_bytes: u64,
    },
    /// The job waits for nodes; the text says for what.
    Queued {
        /// Its id.
        job: String,
        /// Why it waits.
        why: String,
    },
    /// The job's runs were placed on these nodes (in rank order for a gang).
    Placed {
        /// The nodes.
        nodes: Vec<LogicalNodeId>,
        /// The restart this placement is (0: the first).
        restart: u32,
    },
    /// A node has the workspace.
    Shipped {
        /// The node.
        node: LogicalNodeId,
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
        node: LogicalNodeId,
        /// From stderr (else stdout).
        stderr: bool,
        /// The text.
        text: String,
    },
    /// A run ended.
    Finished(RunRecord),
    /// The job ended.
    Done(Box<JobRecord>),
}

/// Why a job was stopped before its runs ended on their own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stop {
    /// `swactor job cancel`, or Ctrl-C on `swactor run`.
    Cancelled,
    /// The job's `--timeout` passed; the text says after how long.
    TimedOut(String),
    /// Another rank of the gang ended without success; the text says which.
    Gang(String),
}

impl Stop {
    /// What a stopped run became: a cancelled one is `cancelled`, a timed-out
    /// one `failed` with 124 (as `timeout(1)` exits).
    pub fn outcome(&self, when: &str) -> Outcome {
        match self {
            Self::Cancelled => Outcome::fail(JobState::Cancelled, format!("cancelled {when}")),
            Self::TimedOut(why) => Outcome {
                state: JobState::Failed,
                exit_code: Some(124),
                error: Some(why.clone()),
                collected: Vec::new(),
                node_lost: false,
            },
            Self::Gang(why) => Outcome::fail(JobState::Cancelled, format!("stopped {when}: {why}")),
        }
    }
}

/// How a run ended, as its record keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// A final state.
    pub state: JobState,
    /// The exit code (128 + signal when a signal ended it).
    pub exit_code: Option<i32>,
    /// Why it failed, was lost or cancelled.
    pub error: Option<String>,
    /// The output files collected, each with its verified hash.
    pub collected: Vec<OutputFile>,
    /// `lost` because the cluster replaced the run's node.
    pub node_lost: bool,
}

impl Outcome {
    /// A run that ended in `state` for `error`, without an exit code.
    pub fn fail(state: JobState, error: impl Into<String>) -> Self {
        Self {
            state,
            exit_code: None,
            error: Some(error.into()),
            collected: Vec::new(),
            node_lost: false,
        }
    }

    /// A run that was `lost` because the cluster replaced its node.
    pub fn node_lost(error: impl Into<String>) -> Self {
        Self {
            node_lost: true,
            ..Self::fail(JobState::Lost, error)
        }
    }

    /// A run whose command exited as `exit` and whose outputs are `collected`.
    pub fn exited(exit: ExitInfo, collected: Vec<OutputFile>) -> Self {
        let code = exit.shell_code();
        Self {
            state: if code == 0 {
                JobState::Succeeded
            } else {
                JobState::Failed
            },
            exit_code: Some(code),
            // The code is the shell's (128 + a signal), for exit codes;
            // the words say which it was.
            error: (code != 0).then(|| {
                swactor_provisioning::exit::Ended::new(exit.code, exit.signal).to_string()
            }),
            collected,
            node_lost: false,
        }
    }
}

/// A change to a run's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The workspace is about to be shipped.
    Shipping,
    /// The node has the workspace; this much was sent.
    Shipped {
        /// Bytes sent.
        bytes: u64,
        /// Chunks sent.
        chunks: u64,
    },
    /// The start request is about to be sent.
    Running,
    /// The run ended.
    Finished(Outcome),
}

/// A job of `runs` with nothing else set, for the crate's tests.
#[cfg(test)]
pub(crate) fn test_job(runs: Vec<RunRecord>) -> JobRecord {
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
        stop: None,
        runs,
        want: None,
        waiting: None,
        priority: 0,
        gang: None,
        earlier: Vec::new(),
        setup: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(state: JobState, exit_code: Option<i32>) -> RunRecord {
        RunRecord {
            state,
            exit_code,
            ..RunRecord::placed(LogicalNodeId::parse("worker-0").unwrap(), 1, 0, None)
        }
    }

    fn job(runs: Vec<RunRecord>) -> JobRecord {
        test_job(runs)
    }

    #[test]
    fn a_final_state_is_applied_once_and_never_overwritten() {
        let mut j = job(vec![run(JobState::Queued, None)]);
        assert!(j.apply(0, &Change::Shipping, 5).is_none());
        assert_eq!(j.runs[0].state, JobState::Shipping);
        let shipped = j.apply(
            0,
            &Change::Shipped {
                bytes: 6,
                chunks: 1,
            },
            5,
        );
        assert!(matches!(shipped, Some(JobEvent::Shipped { bytes: 6, .. })));
        assert!(j.apply(0, &Change::Running, 5).is_none());
        assert_eq!(j.state(), JobState::Running);
        let file = OutputFile {
            path: "out.txt".to_owned(),
            len: 3,
            blake3: "ab".to_owned(),
        };
        let done = Outcome {
            state: JobState::Succeeded,
            exit_code: Some(0),
            error: None,
            collected: vec![file.clone()],
            node_lost: false,
        };
        assert!(matches!(
            j.apply(0, &Change::Finished(done), 5),
            Some(JobEvent::Finished(_))
        ));
        assert_eq!((j.runs[0].output_files, j.runs[0].output_bytes), (1, 3));
        assert_eq!(j.runs[0].collected, [file]);
        assert_eq!(j.runs[0].ended_unix_ms, Some(5));
        // A late change (e.g. from a run actor that crashed after it was
        // recorded) leaves the final state alone.
        let crashed = Outcome::fail(JobState::Failed, "crashed");
        assert!(j.apply(0, &Change::Finished(crashed), 5).is_none());
        assert!(j.apply(0, &Change::Running, 5).is_none());
        assert_eq!(j.runs[0].state, JobState::Succeeded);
        assert!(j.apply(7, &Change::Running, 5).is_none());
    }

    #[test]
    fn a_record_written_before_the_new_fields_still_reads() {
        let mut v = serde_json::to_value(job(vec![run(JobState::Running, None)])).unwrap();
        v.as_object_mut().unwrap().remove("stop");
        v["runs"][0].as_object_mut().unwrap().remove("collected");
        let back: JobRecord = serde_json::from_value(v).unwrap();
        assert!(back.stop.is_none() && back.runs[0].collected.is_empty());
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
}
