//! Whether a job may start, and on which nodes: decided from the cluster's
//! nodes and the runs under way, as data.
//!
//! The daemon hands [`choose_targets`] one [`Candidate`] per node of its
//! cluster snapshot and [`check_busy`] the runs its records hold; either
//! answers with the nodes to use or a [`Refusal`] that names what is wrong.
//! Nothing is shipped or recorded before both said yes.

use crate::record::{RunRecord, Targets};
use std::fmt;
use swactor_provisioning::{LogicalNodeId, NodeAttemptId};

/// A node of the cluster, as target choice needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The node.
    pub node: LogicalNodeId,
    /// Its current attempt: a run is bound to it.
    pub attempt: NodeAttemptId,
    /// Whether a job may run there now (ready, and not being deleted).
    pub usable: bool,
    /// How its state reads to a person, for a refusal.
    pub state: &'static str,
}

/// The nodes a job runs on, and those its targets covered but left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chosen {
    /// Each chosen node with the attempt its run is bound to, in the
    /// cluster's order (or the order named, for explicit nodes), no node
    /// twice.
    pub nodes: Vec<(LogicalNodeId, NodeAttemptId)>,
    /// Nodes of the named groups (or of the cluster) that are not usable.
    pub skipped: Vec<LogicalNodeId>,
}

/// Why a job was not started. Its text is what `swactor run` prints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A node named with `--node` is not in the cluster.
    NoSuchNode {
        /// The name as given.
        name: String,
        /// The cluster's nodes.
        known: Vec<LogicalNodeId>,
    },
    /// A node named with `--node` is not ready.
    NotReady {
        /// The node.
        node: LogicalNodeId,
        /// How its state reads.
        state: &'static str,
    },
    /// A group named with `--group` has no node in the cluster.
    NoSuchGroup {
        /// The name as given.
        group: String,
    },
    /// No node the targets cover is ready.
    NoneReady {
        /// The nodes that are not.
        skipped: Vec<LogicalNodeId>,
    },
    /// A gang of no nodes.
    NoNodes,
    /// A chosen node already has as many runs under way as one may.
    Busy {
        /// The node.
        node: LogicalNodeId,
        /// Its runs under way.
        busy: usize,
        /// The most one node may have.
        max: usize,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoSuchNode { name, known } => {
                let known = if known.is_empty() {
                    "none".to_owned()
                } else {
                    known
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                write!(
                    f,
                    "there is no node {name:?} in this cluster (its nodes: {known}); nothing was started"
                )
            }
            Self::NotReady { node, state } => write!(
                f,
                "{node} is not ready (it is {state}); a job runs on ready nodes only; nothing was started"
            ),
            Self::NoSuchGroup { group } => write!(
                f,
                "there is no group {group:?} with nodes in this cluster; nothing was started"
            ),
            Self::NoneReady { skipped } => {
                write!(f, "no node is ready to run a job")?;
                if !skipped.is_empty() {
                    let names: Vec<String> = skipped.iter().map(ToString::to_string).collect();
                    write!(f, " (not ready: {})", names.join(", "))?;
                }
                write!(f, "; nothing was started")
            }
            Self::NoNodes => write!(
                f,
                "--nodes 0 names no node: a gang takes at least one; nothing was started"
            ),
            Self::Busy { node, busy, max } => write!(
                f,
                "{node} already has {busy} run(s) under way, the most one node may have \
                 (SWACTOR_JOB_RUNS_PER_NODE_MAX={max}); nothing was started"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// The nodes `targets` covers among `candidates`.
///
/// - Named nodes must each exist and be usable; a name given twice is used
///   once.
/// - `All` and `Groups` take every usable node (of the groups), leave the
///   others out as skipped, and refuse when none is usable; a named group
///   with no node at all is refused, so a typo is not read as "no node".
///
/// # Errors
/// The first [`Refusal`] met; nothing is chosen then.
pub fn choose_targets(targets: &Targets, candidates: &[Candidate]) -> Result<Chosen, Refusal> {
    let mut chosen = Chosen::default();
    match targets {
        Targets::Nodes(names) => {
            for name in names {
                let Some(c) = candidates.iter().find(|c| c.node.to_string() == *name) else {
                    return Err(Refusal::NoSuchNode {
                        name: name.clone(),
                        known: candidates.iter().map(|c| c.node).collect(),
                    });
                };
                if !c.usable {
                    return Err(Refusal::NotReady {
                        node: c.node,
                        state: c.state,
                    });
                }
                if !chosen.nodes.iter().any(|(n, _)| *n == c.node) {
                    chosen.nodes.push((c.node, c.attempt));
                }
            }
        }
        Targets::Gang { nodes, groups } => {
            if *nodes == 0 {
                return Err(Refusal::NoNodes);
            }
            if let Some(g) = groups.iter().find(|g| {
                !candidates
                    .iter()
                    .any(|c| c.node.group.as_str() == g.as_str())
            }) {
                return Err(Refusal::NoSuchGroup { group: g.clone() });
            }
            // Placed when the queue starts it, on the nodes free then.
            return Ok(chosen);
        }
        Targets::All | Targets::Groups(_) => {
            let in_groups = |c: &Candidate| match targets {
                Targets::Groups(groups) => groups.iter().any(|g| c.node.group.as_str() == g),
                _ => true,
            };
            if let Targets::Groups(groups) = targets
                && let Some(g) = groups.iter().find(|g| {
                    !candidates
                        .iter()
                        .any(|c| c.node.group.as_str() == g.as_str())
                })
            {
                return Err(Refusal::NoSuchGroup { group: g.clone() });
            }
            for c in candidates.iter().filter(|c| in_groups(c)) {
                if c.usable {
                    chosen.nodes.push((c.node, c.attempt));
                } else {
                    chosen.skipped.push(c.node);
                }
            }
            if chosen.nodes.is_empty() {
                return Err(Refusal::NoneReady {
                    skipped: chosen.skipped,
                });
            }
        }
    }
    debug_assert!(!chosen.nodes.is_empty(), "a chosen set is never empty");
    Ok(chosen)
}

/// Refuses when a node of `targets` already has `max` runs under way among
/// `runs` (the runs of every job on record).
///
/// # Errors
/// [`Refusal::Busy`] for the first such node.
pub fn check_busy<'a>(
    runs: impl Iterator<Item = &'a RunRecord> + Clone,
    targets: &[(LogicalNodeId, NodeAttemptId)],
    max: usize,
) -> Result<(), Refusal> {
    for (node, _) in targets {
        let busy = runs
            .clone()
            .filter(|r| r.node == *node && !r.state.is_final())
            .count();
        if busy >= max {
            return Err(Refusal::Busy {
                node: *node,
                busy,
                max,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::JobState;
    use swactor_provisioning::GroupId;

    fn node(group: &str, index: u32) -> LogicalNodeId {
        LogicalNodeId::new(GroupId::new(group), index)
    }

    fn candidate(group: &str, index: u32, usable: bool) -> Candidate {
        Candidate {
            node: node(group, index),
            attempt: NodeAttemptId(u64::from(index) + 10),
            usable,
            state: if usable { "ready" } else { "booting" },
        }
    }

    fn cluster() -> Vec<Candidate> {
        vec![
            candidate("worker", 0, true),
            candidate("worker", 1, false),
            candidate("gpu", 0, true),
        ]
    }

    #[test]
    fn all_takes_every_usable_node_and_names_the_others() {
        let chosen = choose_targets(&Targets::All, &cluster()).unwrap();
        assert_eq!(
            chosen.nodes,
            [
                (node("worker", 0), NodeAttemptId(10)),
                (node("gpu", 0), NodeAttemptId(10))
            ]
        );
        assert_eq!(chosen.skipped, [node("worker", 1)]);
    }

    #[test]
    fn groups_take_only_their_nodes_and_an_unknown_group_is_refused() {
        let gpu = Targets::Groups(vec!["gpu".to_owned()]);
        let chosen = choose_targets(&gpu, &cluster()).unwrap();
        assert_eq!(chosen.nodes, [(node("gpu", 0), NodeAttemptId(10))]);
        assert!(chosen.skipped.is_empty());
        let typo = Targets::Groups(vec!["gpu".to_owned(), "gpus".to_owned()]);
        assert_eq!(
            choose_targets(&typo, &cluster()),
            Err(Refusal::NoSuchGroup {
                group: "gpus".to_owned()
            })
        );
    }

    #[test]
    fn a_group_with_no_usable_node_is_refused_with_the_nodes_left_out() {
        let mut nodes = cluster();
        nodes[2].usable = false;
        let refusal = choose_targets(&Targets::Groups(vec!["gpu".to_owned()]), &nodes).unwrap_err();
        assert_eq!(
            refusal,
            Refusal::NoneReady {
                skipped: vec![node("gpu", 0)]
            }
        );
        assert_eq!(
            refusal.to_string(),
            "no node is ready to run a job (not ready: gpu-0); nothing was started"
        );
        let empty = choose_targets(&Targets::All, &[]).unwrap_err();
        assert_eq!(
            empty.to_string(),
            "no node is ready to run a job; nothing was started"
        );
    }

    #[test]
    fn named_nodes_must_exist_and_be_ready_and_count_once() {
        let names = |n: &[&str]| Targets::Nodes(n.iter().map(|s| (*s).to_owned()).collect());
        let chosen = choose_targets(&names(&["gpu-0", "worker-0", "gpu-0"]), &cluster()).unwrap();
        assert_eq!(
            chosen.nodes,
            [
                (node("gpu", 0), NodeAttemptId(10)),
                (node("worker", 0), NodeAttemptId(10))
            ]
        );
        let not_ready = choose_targets(&names(&["worker-1"]), &cluster()).unwrap_err();
        assert_eq!(
            not_ready,
            Refusal::NotReady {
                node: node("worker", 1),
                state: "booting"
            }
        );
        let missing = choose_targets(&names(&["worker-9"]), &cluster()).unwrap_err();
        assert!(
            matches!(&missing, Refusal::NoSuchNode { name, known } if name == "worker-9" && known.len() == 3)
        );
        assert!(
            missing
                .to_string()
                .contains("its nodes: worker-0, worker-1, gpu-0")
        );
        let none = choose_targets(&names(&["worker-9"]), &[]).unwrap_err();
        assert!(none.to_string().contains("its nodes: none"));
    }

    fn run(node: LogicalNodeId, state: JobState) -> RunRecord {
        RunRecord {
            state,
            ..RunRecord::placed(node, 1, 0, None)
        }
    }

    #[test]
    fn a_node_at_its_run_limit_is_busy_and_finished_runs_do_not_count() {
        let runs = [
            run(node("worker", 0), JobState::Running),
            run(node("worker", 0), JobState::Shipping),
            run(node("worker", 0), JobState::Succeeded),
            run(node("worker", 1), JobState::Running),
        ];
        let targets = |index: u32| vec![(node("worker", index), NodeAttemptId(1))];
        assert_eq!(check_busy(runs.iter(), &targets(0), 3), Ok(()));
        assert_eq!(
            check_busy(runs.iter(), &targets(0), 2),
            Err(Refusal::Busy {
                node: node("worker", 0),
                busy: 2,
                max: 2
            })
        );
        assert_eq!(check_busy(runs.iter(), &targets(2), 1), Ok(()));
    }
}
