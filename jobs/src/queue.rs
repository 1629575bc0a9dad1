//! The job queue: which waiting jobs start now, on which nodes, and why
//! the others wait, decided as data.
//!
//! The daemon hands [`schedule`] every job that waits (with what it wants,
//! its priority and its number) and one [`Slot`] per node of its cluster
//! (whether a job may run there, how many it may run at once, how many it
//! runs now). The answer is one [`Decision`] per job.
//!
//! The rules:
//! - Jobs are taken in order: higher `priority` first, then the order of
//!   submission.
//! - A node never runs more jobs at once than its group's `jobs_per_node`.
//! - A gang starts on all its nodes together or waits; a job for named
//!   nodes (or `--all`/`--group` as chosen at submission) waits until each
//!   of them has a free slot.
//! - No job is overtaken by a later one for the nodes it waits for: once a
//!   job waits, every node it could use is held back from the jobs behind
//!   it. A later job still starts at once on nodes no earlier waiting job
//!   could use.

use crate::record::{RunRecord, Want};
use std::collections::{BTreeMap, BTreeSet};
use swactor_provisioning::{LogicalNodeId, NodeAttemptId};

/// A node, as the queue sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The node.
    pub node: LogicalNodeId,
    /// Its current attempt: a run placed now is bound to it.
    pub attempt: NodeAttemptId,
    /// Whether a job may start there now (ready, linked, not leaving).
    pub usable: bool,
    /// How its state reads, for a reason to wait.
    pub state: &'static str,
    /// Jobs it may run at once (its group's `jobs_per_node`, at least 1).
    pub limit: u32,
    /// Jobs it runs now.
    pub busy: u32,
}

/// A job that waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// Its number (`job-N`): the order of submission.
    pub seq: u64,
    /// Higher goes first.
    pub priority: i32,
    /// What it needs.
    pub want: Want,
}

/// What becomes of a waiting job now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Start it on these (node, attempt)s, in rank order.
    Start {
        /// The job.
        seq: u64,
        /// Where.
        nodes: Vec<(LogicalNodeId, NodeAttemptId)>,
    },
    /// It keeps waiting; the text says for what.
    Wait {
        /// The job.
        seq: u64,
        /// Why, in words for `swactor jobs`.
        why: String,
    },
    /// It can never start: a node it was for left the cluster.
    Fail {
        /// The job.
        seq: u64,
        /// Why.
        why: String,
    },
}

/// How many jobs each node runs, from the runs of every job on record
/// (each unfinished run is one job on its node).
pub fn busy_counts<'a>(runs: impl Iterator<Item = &'a RunRecord>) -> BTreeMap<LogicalNodeId, u32> {
    let mut busy = BTreeMap::new();
    for run in runs.filter(|r| !r.state.is_final()) {
        *busy.entry(run.node).or_insert(0) += 1;
    }
    busy
}

/// The order jobs are considered in: priority (higher first), then number.
pub fn order(waiting: &[Waiting]) -> Vec<&Waiting> {
    let mut order: Vec<&Waiting> = waiting.iter().collect();
    order.sort_by_key(|w| (std::cmp::Reverse(w.priority), w.seq));
    order
}

/// Whether `node` is one `want` could run on.
pub fn eligible(want: &Want, node: &LogicalNodeId) -> bool {
    match want {
        Want::Each(nodes) => nodes.contains(node),
        Want::Gang { groups, .. } => {
            groups.is_empty() || groups.iter().any(|g| g.as_str() == node.group.as_str())
        }
    }
}

fn of_groups(n: u32, groups: &[String]) -> String {
    match groups {
        [] => format!("{n} node(s)"),
        [g] => format!("{n} of group {g}"),
        gs => format!("{n} of groups {}", gs.join(", ")),
    }
}

/// Decides, for every job in `waiting`, whether it starts now on `slots`.
/// Decisions come in the order the jobs were considered.
pub fn schedule(waiting: &[Waiting], slots: &[Slot]) -> Vec<Decision> {
    let mut free: BTreeMap<LogicalNodeId, u32> = slots
        .iter()
        .map(|s| (s.node, s.limit.max(1).saturating_sub(s.busy)))
        .collect();
    // Nodes an earlier waiting job could use, and the first such job.
    let mut held: BTreeMap<LogicalNodeId, u64> = BTreeMap::new();
    let mut out = Vec::with_capacity(waiting.len());
    for w in order(waiting) {
        let open = |s: &Slot, free: &BTreeMap<LogicalNodeId, u32>| {
            s.usable && free.get(&s.node).copied().unwrap_or(0) > 0
        };
        let decision = match &w.want {
            Want::Each(nodes) => {
                let mut why = None;
                let mut chosen = Vec::with_capacity(nodes.len());
                for node in nodes {
                    let Some(s) = slots.iter().find(|s| s.node == *node) else {
                        why = Some(Err(format!(
                            "{node} left the cluster while the job waited; nothing was started"
                        )));
                        break;
                    };
                    if !s.usable {
                        why.get_or_insert(Ok(format!("{node} is {}", s.state)));
                    } else if !open(s, &free) {
                        why.get_or_insert(Ok(format!(
                            "{node} runs {} job(s), as many as it may (jobs_per_node = {})",
                            s.busy, s.limit
                        )));
                    } else if let Some(before) = held.get(node) {
                        why.get_or_insert(Ok(format!("{node} is held for job-{before}, ahead")));
                    }
                    chosen.push((s.node, s.attempt));
                }
                match why {
                    None => Decision::Start {
                        seq: w.seq,
                        nodes: chosen,
                    },
                    Some(Ok(why)) => Decision::Wait { seq: w.seq, why },
                    Some(Err(why)) => Decision::Fail { seq: w.seq, why },
                }
            }
            Want::Gang { nodes: n, groups } => {
                let mine: Vec<&Slot> = slots
                    .iter()
                    .filter(|s| eligible(&w.want, &s.node))
                    .collect();
                let open_now: Vec<&Slot> =
                    mine.iter().copied().filter(|s| open(s, &free)).collect();
                let take: Vec<&Slot> = open_now
                    .iter()
                    .copied()
                    .filter(|s| !held.contains_key(&s.node))
                    .take(*n as usize)
                    .collect();
                if *n > 0 && take.len() == *n as usize {
                    Decision::Start {
                        seq: w.seq,
                        nodes: take.iter().map(|s| (s.node, s.attempt)).collect(),
                    }
                } else {
                    let mut why =
                        format!("needs {}, {} free", of_groups(*n, groups), open_now.len());
                    if mine.len() < *n as usize {
                        why.push_str(&format!(
                            " (the cluster has {} such node(s): scale up to start it)",
                            mine.len()
                        ));
                    } else if open_now.len() >= *n as usize
                        && let Some(before) = open_now.iter().find_map(|s| held.get(&s.node))
                    {
                        why.push_str(&format!(", held for job-{before}, ahead"));
                    }
                    Decision::Wait { seq: w.seq, why }
                }
            }
        };
        match &decision {
            Decision::Start { nodes, .. } => {
                for (node, _) in nodes {
                    if let Some(f) = free.get_mut(node) {
                        *f = f.saturating_sub(1);
                    }
                }
            }
            Decision::Wait { .. } => {
                for s in slots.iter().filter(|s| eligible(&w.want, &s.node)) {
                    held.entry(s.node).or_insert(w.seq);
                }
            }
            Decision::Fail { .. } => {}
        }
        out.push(decision);
    }
    out
}

/// The nodes a set of decisions starts jobs on, with how many each.
pub fn starts(decisions: &[Decision]) -> BTreeMap<LogicalNodeId, u32> {
    let mut n = BTreeMap::new();
    for d in decisions {
        if let Decision::Start { nodes, .. } = d {
            for (node, _) in nodes {
                *n.entry(*node).or_insert(0) += 1;
            }
        }
    }
    n
}

/// The distinct nodes of `nodes`, for checks.
pub fn distinct(nodes: &[(LogicalNodeId, NodeAttemptId)]) -> BTreeSet<LogicalNodeId> {
    nodes.iter().map(|(n, _)| *n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use swactor_provisioning::GroupId;

    fn node(group: &str, index: u32) -> LogicalNodeId {
        LogicalNodeId::new(GroupId::new(group), index)
    }

    fn slot(group: &str, index: u32, busy: u32) -> Slot {
        Slot {
            node: node(group, index),
            attempt: NodeAttemptId(1),
            usable: true,
            state: "ready",
            limit: 1,
            busy,
        }
    }

    fn gang(seq: u64, n: u32, group: &str) -> Waiting {
        Waiting {
            seq,
            priority: 0,
            want: Want::Gang {
                nodes: n,
                groups: vec![group.to_owned()],
            },
        }
    }

    #[test]
    fn a_gang_waits_for_enough_free_nodes_and_says_how_many() {
        let slots = [slot("gpu", 0, 1), slot("gpu", 1, 0), slot("cpu", 0, 0)];
        let d = schedule(&[gang(1, 2, "gpu")], &slots);
        assert_eq!(
            d,
            [Decision::Wait {
                seq: 1,
                why: "needs 2 of group gpu, 1 free".to_owned()
            }]
        );
        let d = schedule(&[gang(1, 3, "gpu")], &slots);
        assert!(
            matches!(&d[0], Decision::Wait { why, .. } if why.contains("the cluster has 2 such node(s): scale up")),
            "{d:?}"
        );
        let slots = [slot("gpu", 0, 0), slot("gpu", 1, 0)];
        let d = schedule(&[gang(1, 2, "gpu")], &slots);
        assert_eq!(
            d,
            [Decision::Start {
                seq: 1,
                nodes: vec![
                    (node("gpu", 0), NodeAttemptId(1)),
                    (node("gpu", 1), NodeAttemptId(1))
                ]
            }]
        );
    }

    #[test]
    fn two_gangs_on_four_nodes_the_second_waits_and_a_later_small_job_does_not_overtake_it() {
        let slots: Vec<Slot> = (0..4).map(|i| slot("w", i, 0)).collect();
        let small = Waiting {
            seq: 3,
            priority: 0,
            want: Want::Each(vec![node("w", 3)]),
        };
        let d = schedule(&[gang(1, 3, "w"), gang(2, 3, "w"), small.clone()], &slots);
        assert!(matches!(&d[0], Decision::Start { seq: 1, nodes } if nodes.len() == 3));
        assert!(
            matches!(&d[1], Decision::Wait { seq: 2, why } if why == "needs 3 of group w, 1 free")
        );
        // w-3 is free, but job 2 waits for it: job 3 may not take it.
        assert!(
            matches!(&d[2], Decision::Wait { seq: 3, why } if why == "w-3 is held for job-2, ahead"),
            "{d:?}"
        );
        // With a higher priority it may.
        let urgent = Waiting {
            priority: 5,
            ..small
        };
        let d = schedule(&[gang(1, 3, "w"), gang(2, 3, "w"), urgent], &slots);
        assert!(matches!(&d[0], Decision::Start { seq: 3, .. }), "{d:?}");
    }

    #[test]
    fn a_named_node_that_left_fails_the_job_and_a_busy_one_makes_it_wait() {
        let slots = [slot("w", 0, 1)];
        let each = |n: Vec<LogicalNodeId>| Waiting {
            seq: 1,
            priority: 0,
            want: Want::Each(n),
        };
        assert!(matches!(
            &schedule(&[each(vec![node("w", 0)])], &slots)[0],
            Decision::Wait { why, .. } if why == "w-0 runs 1 job(s), as many as it may (jobs_per_node = 1)"
        ));
        assert!(matches!(
            &schedule(&[each(vec![node("w", 0), node("w", 7)])], &slots)[0],
            Decision::Fail { why, .. } if why.starts_with("w-7 left the cluster")
        ));
        let mut two = slots[0].clone();
        two.limit = 2;
        assert!(matches!(
            &schedule(&[each(vec![node("w", 0)])], &[two])[0],
            Decision::Start { .. }
        ));
    }

    fn arb_want() -> impl Strategy<Value = Want> {
        prop_oneof![
            (1u32..5, prop::option::of(0u32..2)).prop_map(|(n, g)| Want::Gang {
                nodes: n,
                groups: g.map(|g| vec![format!("g{g}")]).unwrap_or_default(),
            }),
            prop::collection::btree_set((0u32..2, 0u32..4), 1..4).prop_map(|set| {
                Want::Each(
                    set.into_iter()
                        .map(|(g, i)| node(&format!("g{g}"), i))
                        .collect(),
                )
            }),
        ]
    }

    proptest! {
        /// No node runs more than its limit; every start is what its job
        /// asked for; no job starts on a node an earlier (in queue order)
        /// job still waits for.
        #[test]
        fn no_node_over_its_limit_and_no_earlier_job_overtaken(
            nodes in prop::collection::vec((0u32..3, 0u32..3, any::<bool>()), 0..8),
            jobs in prop::collection::vec((arb_want(), -1i32..2), 0..8),
        ) {
            let mut slots: Vec<Slot> = Vec::new();
            for (i, (limit, busy, usable)) in nodes.iter().enumerate() {
                let i = i as u32;
                let n = node(&format!("g{}", i % 2), i / 2);
                if slots.iter().any(|s| s.node == n) { continue; }
                slots.push(Slot {
                    node: n,
                    attempt: NodeAttemptId(u64::from(i)),
                    usable: *usable,
                    state: if *usable { "ready" } else { "booting" },
                    limit: limit + 1,
                    busy: (*busy).min(limit + 1),
                });
            }
            let waiting: Vec<Waiting> = jobs
                .into_iter()
                .enumerate()
                .map(|(i, (want, priority))| Waiting { seq: i as u64 + 1, priority, want })
                .collect();
            let d = schedule(&waiting, &slots);
            prop_assert_eq!(d.len(), waiting.len());
            let started = starts(&d);
            for s in &slots {
                let n = started.get(&s.node).copied().unwrap_or(0);
                prop_assert!(s.busy + n <= s.limit, "{} over its limit", s.node);
                prop_assert!(n == 0 || s.usable);
            }
            let ordered = order(&waiting);
            for (pos, (w, dec)) in ordered.iter().zip(&d).enumerate() {
                let Decision::Start { seq, nodes } = dec else { continue };
                prop_assert_eq!(*seq, w.seq);
                let set = distinct(nodes);
                prop_assert_eq!(set.len(), nodes.len(), "a node twice");
                match &w.want {
                    Want::Gang { nodes: n, .. } => prop_assert_eq!(nodes.len(), *n as usize),
                    Want::Each(want) => prop_assert_eq!(&set, &want.iter().copied().collect()),
                }
                for node in &set {
                    prop_assert!(eligible(&w.want, node));
                }
                for (earlier, edec) in ordered[..pos].iter().zip(&d) {
                    if matches!(edec, Decision::Wait { .. }) {
                        for node in &set {
                            prop_assert!(
                                !eligible(&earlier.want, node),
                                "job {} took {} that job {} (ahead) waits for",
                                w.seq, node, earlier.seq
                            );
                        }
                    }
                }
            }
            // The first job in order starts whenever what it asks is free.
            if let (Some(first), Some(d0)) = (ordered.first(), d.first()) {
                let free: Vec<&Slot> = slots
                    .iter()
                    .filter(|s| s.usable && s.busy < s.limit && eligible(&first.want, &s.node))
                    .collect();
                let can = match &first.want {
                    Want::Gang { nodes, .. } => free.len() >= *nodes as usize,
                    Want::Each(want) => want.iter().all(|n| free.iter().any(|s| s.node == *n)),
                };
                prop_assert_eq!(can, matches!(d0, Decision::Start { .. }));
            }
        }
    }
}
