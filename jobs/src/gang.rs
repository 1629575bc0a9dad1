//! Gang jobs: what each rank is told, and what a job does once one of its
//! runs ends, decided as data.
//!
//! A gang (`swactor run --nodes N`) starts all its ranks together and ends
//! together: once a rank ends without success, the others are stopped.
//! When every rank has ended, the gang restarts (all ranks anew, on ready
//! nodes) only if a rank was lost because the cluster replaced its node,
//! it has restarts left, and nobody stopped the job. A rank that ended
//! with an exit code, a log stream that broke, or an agent that did not
//! answer in time never restarts anything.

use crate::record::{JobRecord, JobState};

/// What a job does now that its runs are as `record` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Runs are under way; nothing to do.
    Wait,
    /// A gang rank ended without success: stop the others (the text says why).
    StopOthers(String),
    /// Every rank ended and a node was lost: go back to the queue and start
    /// every rank anew (the text says why).
    Restart(String),
    /// The job is over.
    End,
}

/// The run that ended the gang: the first (by end time, then rank) that
/// failed or was lost; ranks the gang stopped do not count.
fn culprit(record: &JobRecord) -> Option<usize> {
    record
        .runs
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r.state, JobState::Failed | JobState::Lost))
        .min_by_key(|(i, r)| (r.ended_unix_ms.unwrap_or(u64::MAX), *i))
        .map(|(i, _)| i)
}

/// How a run reads in a reason: `worker-1 (rank 1)`.
fn who(record: &JobRecord, idx: usize) -> String {
    let r = &record.runs[idx];
    match r.rank {
        Some(rank) => format!("{} (rank {rank})", r.node),
        None => r.node.to_string(),
    }
}

/// What job `record` does next.
pub fn next(record: &JobRecord) -> Next {
    let under_way = record.runs.iter().any(|r| !r.state.is_final());
    let Some(gang) = &record.gang else {
        return if under_way { Next::Wait } else { Next::End };
    };
    let Some(bad) = culprit(record) else {
        return if under_way { Next::Wait } else { Next::End };
    };
    let run = &record.runs[bad];
    let what = match (run.state, run.exit_code) {
        (JobState::Lost, _) => "was lost".to_owned(),
        (_, Some(code)) => format!("exited with code {code}"),
        _ => "failed".to_owned(),
    };
    let why = format!("{} {what}", who(record, bad));
    if under_way {
        return Next::StopOthers(why);
    }
    let lost = record.runs.iter().position(|r| r.node_lost);
    match lost {
        Some(i) if record.stop.is_none() && gang.restarts < gang.retry => Next::Restart(format!(
            "{} was lost with its node; restart {} of {}",
            who(record, i),
            gang.restarts + 1,
            gang.retry
        )),
        _ => Next::End,
    }
}

/// Sends a gang back to the queue after [`Next::Restart`]: its runs are
/// kept as the attempt they were, the restart is counted, the ranks'
/// addresses are forgotten (the next placement asks again), and the job
/// waits for `why`.
pub fn requeue(record: &mut JobRecord, why: &str) {
    let runs = std::mem::take(&mut record.runs);
    if let Some(gang) = record.gang.as_mut() {
        record.earlier.push(crate::record::EarlierAttempt {
            restart: gang.restarts,
            outputs_dir: record.outputs_dir.clone(),
            runs,
        });
        gang.restarts += 1;
        gang.addrs.clear();
    }
    record.waiting = Some(format!("queued: {why}"));
}

/// The environment rank `idx` of a gang starts with (empty for a run of
/// another job).
pub fn rank_env(record: &JobRecord, idx: usize) -> Vec<(String, String)> {
    let (Some(gang), Some(run)) = (&record.gang, record.runs.get(idx)) else {
        return Vec::new();
    };
    let rank = run.rank.unwrap_or(idx as u32);
    let mut env = vec![
        ("SWACTOR_JOB_ID".to_owned(), record.id.clone()),
        ("SWACTOR_NODE_RANK".to_owned(), rank.to_string()),
        (
            "SWACTOR_NUM_NODES".to_owned(),
            record.runs.len().to_string(),
        ),
        (
            "SWACTOR_RESTART_COUNT".to_owned(),
            gang.restarts.to_string(),
        ),
    ];
    if let Some(master) = gang.addrs.first() {
        env.push(("SWACTOR_MASTER_ADDR".to_owned(), master.clone()));
        env.push((
            "SWACTOR_MASTER_PORT".to_owned(),
            gang.master_port.to_string(),
        ));
        env.push(("SWACTOR_NODE_ADDRS".to_owned(), gang.addrs.join(",")));
    }
    if let Some(gpus) = gang.gpus.get(rank as usize) {
        env.push(("SWACTOR_GPUS_PER_NODE".to_owned(), gpus.to_string()));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Gang, RunRecord, Stop};
    use swactor_provisioning::LogicalNodeId;

    fn run(i: u32, state: JobState, code: Option<i32>, ended: Option<u64>) -> RunRecord {
        RunRecord {
            state,
            exit_code: code,
            ended_unix_ms: ended,
            ..RunRecord::placed(
                LogicalNodeId::parse(&format!("w-{i}")).unwrap(),
                1,
                0,
                Some(i),
            )
        }
    }

    fn job(runs: Vec<RunRecord>, gang: Option<Gang>) -> JobRecord {
        JobRecord {
            id: "job-3".to_owned(),
            gang,
            ..crate::record::test_job(runs)
        }
    }

    fn gang(retry: u32, restarts: u32) -> Option<Gang> {
        Some(Gang {
            nodes: 2,
            retry,
            restarts,
            addrs: vec!["10.0.0.1".to_owned(), "10.0.0.2".to_owned()],
            master_port: 29500,
            gpus: vec![8, 4],
            reattach_s: 0,
        })
    }

    use JobState::*;

    #[test]
    fn a_failed_rank_stops_the_others_and_then_the_gang_ends() {
        let j = job(
            vec![
                run(0, Running, None, None),
                run(1, Failed, Some(3), Some(5)),
            ],
            gang(1, 0),
        );
        assert_eq!(
            next(&j),
            Next::StopOthers("w-1 (rank 1) exited with code 3".to_owned())
        );
        // A failure is never restarted, retries or not.
        let j = job(
            vec![
                run(0, Cancelled, None, Some(6)),
                run(1, Failed, Some(3), Some(5)),
            ],
            gang(1, 0),
        );
        assert_eq!(next(&j), Next::End);
        // A rank that succeeds early stops nobody.
        let j = job(
            vec![
                run(0, Running, None, None),
                run(1, Succeeded, Some(0), Some(5)),
            ],
            gang(1, 0),
        );
        assert_eq!(next(&j), Next::Wait);
    }

    #[test]
    fn only_a_node_the_cluster_replaced_restarts_a_gang_with_retries_left() {
        let mut lost = run(1, Lost, None, Some(5));
        lost.node_lost = true;
        // Rank 0 failed after rank 1's node was lost (its peer went away):
        // the loss came first and explains it.
        let j = job(
            vec![run(0, Failed, Some(1), Some(7)), lost.clone()],
            gang(1, 0),
        );
        assert_eq!(
            next(&j),
            Next::Restart("w-1 (rank 1) was lost with its node; restart 1 of 1".to_owned())
        );
        assert_eq!(next(&job(j.runs.clone(), gang(1, 1))), Next::End);
        assert_eq!(next(&job(j.runs.clone(), gang(0, 0))), Next::End);
        let mut stopped = job(j.runs.clone(), gang(2, 0));
        stopped.stop = Some(Stop::Cancelled);
        assert_eq!(next(&stopped), Next::End);
        // Lost without the node being replaced (a broken log stream, an
        // agent that did not come back in time): never a restart.
        let mut missed = lost;
        missed.node_lost = false;
        assert_eq!(
            next(&job(
                vec![run(0, Cancelled, None, Some(7)), missed],
                gang(1, 0)
            )),
            Next::End
        );
    }

    #[test]
    fn a_requeued_gang_keeps_its_attempt_and_counts_the_restart() {
        let mut lost = run(1, Lost, None, Some(5));
        lost.node_lost = true;
        let mut j = job(vec![run(0, Cancelled, None, Some(6)), lost], gang(2, 0));
        j.outputs_dir = "/s/jobs/job-3/outputs".to_owned();
        let Next::Restart(why) = next(&j) else {
            panic!("{:?}", next(&j))
        };
        requeue(&mut j, &why);
        assert!(j.runs.is_empty());
        assert_eq!(j.earlier.len(), 1);
        assert_eq!(j.earlier[0].restart, 0);
        assert_eq!(j.earlier[0].runs.len(), 2);
        assert_eq!(j.earlier[0].outputs_dir, "/s/jobs/job-3/outputs");
        let g = j.gang.as_ref().unwrap();
        assert_eq!((g.restarts, g.addrs.len()), (1, 0));
        assert_eq!(j.state(), Queued);
        assert_eq!(
            j.waiting.as_deref(),
            Some(format!("queued: {why}").as_str())
        );
    }

    #[test]
    fn a_job_that_is_not_a_gang_waits_for_every_run_and_restarts_nothing() {
        let mut lost = run(1, Lost, None, Some(5));
        lost.node_lost = true;
        let j = job(vec![run(0, Running, None, None), lost.clone()], None);
        assert_eq!(next(&j), Next::Wait);
        let j = job(vec![run(0, Succeeded, Some(0), Some(3)), lost], None);
        assert_eq!(next(&j), Next::End);
    }

    #[test]
    fn each_rank_is_told_its_rank_the_master_and_every_address() {
        let j = job(
            vec![run(0, Queued, None, None), run(1, Queued, None, None)],
            gang(1, 1),
        );
        let env: std::collections::BTreeMap<_, _> = rank_env(&j, 1).into_iter().collect();
        assert_eq!(env["SWACTOR_NODE_RANK"], "1");
        assert_eq!(env["SWACTOR_NUM_NODES"], "2");
        assert_eq!(env["SWACTOR_MASTER_ADDR"], "10.0.0.1");
        assert_eq!(env["SWACTOR_MASTER_PORT"], "29500");
        assert_eq!(env["SWACTOR_NODE_ADDRS"], "10.0.0.1,10.0.0.2");
        assert_eq!(env["SWACTOR_GPUS_PER_NODE"], "4");
        assert_eq!(env["SWACTOR_JOB_ID"], "job-3");
        assert_eq!(env["SWACTOR_RESTART_COUNT"], "1");
        assert!(rank_env(&job(j.runs.clone(), None), 0).is_empty());
    }
}
