//! What `swactor up [SHAPE]` means for a state directory, given its journal.
//!
//! A start either applies a shape, resumes the journal's shape, finishes a
//! teardown an earlier daemon left half done, or is refused. The decision
//! reads only the journal image and the run the shape is for; the front end
//! turns the result into words and into what it starts.

use crate::host::JournalImage;
use crate::id::{Generation, RunId};

/// What a start does, with the facts a front end says it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartDecision {
    /// No journal: a new run, made from the shape.
    New {
        /// The shape's run.
        run_id: RunId,
    },
    /// A journal of the shape's own run: the shape is offered as its next
    /// generation.
    Offer {
        /// The journal's run.
        run_id: RunId,
        /// The generation the journal holds (0 before its first shape).
        generation: Generation,
        /// The journal says reconciling is paused.
        paused: bool,
    },
    /// No shape, and the last daemon was tearing the cluster down when it
    /// stopped: the teardown is finished.
    FinishTeardown {
        /// The journal's run.
        run_id: RunId,
    },
    /// No shape: the journal's shape is resumed as it is.
    Resume {
        /// The journal's run.
        run_id: RunId,
        /// The generation the journal holds.
        generation: Generation,
        /// How many nodes that shape asks for, over all groups.
        desired: u64,
        /// The journal says reconciling is paused.
        paused: bool,
    },
}

impl StartDecision {
    /// The run the start is for.
    pub fn run_id(&self) -> &RunId {
        match self {
            Self::New { run_id }
            | Self::Offer { run_id, .. }
            | Self::FinishTeardown { run_id }
            | Self::Resume { run_id, .. } => run_id,
        }
    }
}

/// Why a start does nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartRefusal {
    /// No journal and no shape: no daemon has run here, and there is
    /// nothing to start from.
    NoJournal,
    /// The shape is for another run than the journal's; a journal never
    /// changes run.
    OtherRun {
        /// The journal's run.
        journal: RunId,
        /// The shape's run.
        shape: RunId,
    },
    /// No shape, and the journal's cluster has no nodes: it was torn down
    /// (or never given a shape).
    TornDown {
        /// The journal's run.
        run_id: RunId,
        /// The generation the journal holds (0 before its first shape).
        generation: Generation,
    },
}

/// Decides what a start means, given the state directory's `journal` (none:
/// no daemon has run there) and the run of the shape it was given
/// (`shape_run`; none: no shape).
///
/// With a shape, the start applies it: as a new run without a journal, or
/// as the next generation of the journal's own run. Without one, it
/// finishes an unfinished teardown first, and otherwise resumes the
/// journal's shape if that shape still has nodes, wanted or held.
///
/// # Errors
/// [`StartRefusal`]: nothing to start from, a shape of another run, or a
/// cluster with no nodes to resume.
pub fn decide_start(
    journal: Option<&JournalImage>,
    shape_run: Option<&RunId>,
) -> Result<StartDecision, StartRefusal> {
    let Some(image) = journal else {
        return match shape_run {
            Some(run_id) => Ok(StartDecision::New {
                run_id: run_id.clone(),
            }),
            None => Err(StartRefusal::NoJournal),
        };
    };
    let meta = &image.meta;
    let run_id = meta.run_id.clone();
    let generation = meta.shape.as_ref().map_or(Generation(0), |s| s.generation);
    if let Some(theirs) = shape_run {
        if *theirs != run_id {
            return Err(StartRefusal::OtherRun {
                journal: run_id,
                shape: theirs.clone(),
            });
        }
        return Ok(StartDecision::Offer {
            run_id,
            generation,
            paused: meta.paused,
        });
    }
    if meta.tearing_down {
        return Ok(StartDecision::FinishTeardown { run_id });
    }
    let desired = meta.shape.as_ref().map_or(0, |s| s.node_count());
    if meta.shape.is_none() || (desired == 0 && image.slots.is_empty()) {
        return Err(StartRefusal::TornDown { run_id, generation });
    }
    Ok(StartDecision::Resume {
        run_id,
        generation,
        desired,
        paused: meta.paused,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::SlotRecord;
    use crate::id::{LogicalNodeId, NodeAttemptId};
    use crate::shape::tests::{group, shape};

    fn run() -> RunId {
        RunId::new("run")
    }

    /// A journal of run `run` holding a shape of `generation` with `count`
    /// nodes in one group.
    fn journal(generation: u64, count: u32) -> JournalImage {
        let mut image = JournalImage::new(run());
        image.meta.shape = Some(shape(generation, vec![group("w", count)]));
        image
    }

    fn hold_a_slot(image: &mut JournalImage) {
        image.slots.insert(
            LogicalNodeId::parse("w-0").unwrap(),
            SlotRecord {
                attempt: NodeAttemptId(1),
                template: 0,
                created: true,
                failures: 0,
                replace: false,
            },
        );
    }

    #[test]
    fn without_a_journal_a_shape_starts_a_new_run_and_no_shape_is_refused() {
        let theirs = RunId::new("new-run");
        assert_eq!(
            decide_start(None, Some(&theirs)),
            Ok(StartDecision::New { run_id: theirs })
        );
        assert_eq!(decide_start(None, None), Err(StartRefusal::NoJournal));
    }

    #[test]
    fn a_shape_of_the_journals_run_is_offered_as_the_next_generation() {
        let mut image = journal(3, 2);
        assert_eq!(
            decide_start(Some(&image), Some(&run())),
            Ok(StartDecision::Offer {
                run_id: run(),
                generation: Generation(3),
                paused: false,
            })
        );
        // Paused, tearing down or torn down, a shape of the run is still
        // offered: applying it is how a run starts again.
        image.meta.paused = true;
        image.meta.tearing_down = true;
        image.meta.shape = None;
        assert_eq!(
            decide_start(Some(&image), Some(&run())),
            Ok(StartDecision::Offer {
                run_id: run(),
                generation: Generation(0),
                paused: true,
            })
        );
    }

    #[test]
    fn a_shape_of_another_run_is_refused_naming_both_runs() {
        let image = journal(1, 2);
        let theirs = RunId::new("other");
        assert_eq!(
            decide_start(Some(&image), Some(&theirs)),
            Err(StartRefusal::OtherRun {
                journal: run(),
                shape: theirs,
            })
        );
    }

    #[test]
    fn without_a_shape_an_unfinished_teardown_is_finished_before_anything_else() {
        let mut image = journal(2, 0);
        image.meta.tearing_down = true;
        let finish = Ok(StartDecision::FinishTeardown { run_id: run() });
        assert_eq!(decide_start(Some(&image), None), finish);
        // Even with no shape recorded at all.
        image.meta.shape = None;
        assert_eq!(decide_start(Some(&image), None), finish);
    }

    #[test]
    fn without_a_shape_the_journals_shape_is_resumed_with_its_facts() {
        let mut image = journal(4, 3);
        assert_eq!(
            decide_start(Some(&image), None),
            Ok(StartDecision::Resume {
                run_id: run(),
                generation: Generation(4),
                desired: 3,
                paused: false,
            })
        );
        image.meta.paused = true;
        assert!(matches!(
            decide_start(Some(&image), None),
            Ok(StartDecision::Resume { paused: true, .. })
        ));
    }

    #[test]
    fn a_shape_of_no_nodes_is_resumed_while_a_slot_still_holds_an_attempt() {
        let mut image = journal(5, 0);
        hold_a_slot(&mut image);
        assert_eq!(
            decide_start(Some(&image), None),
            Ok(StartDecision::Resume {
                run_id: run(),
                generation: Generation(5),
                desired: 0,
                paused: false,
            })
        );
    }

    #[test]
    fn without_a_shape_a_torn_down_cluster_is_refused() {
        // A shape of no nodes and no slot held: torn down.
        let image = journal(6, 0);
        assert_eq!(
            decide_start(Some(&image), None),
            Err(StartRefusal::TornDown {
                run_id: run(),
                generation: Generation(6),
            })
        );
        // No shape ever accepted: nothing to resume either, even with a
        // slot record.
        let mut image = JournalImage::new(run());
        hold_a_slot(&mut image);
        assert_eq!(
            decide_start(Some(&image), None),
            Err(StartRefusal::TornDown {
                run_id: run(),
                generation: Generation(0),
            })
        );
    }

    #[test]
    fn the_decision_names_the_run_it_is_for() {
        let image = journal(1, 1);
        let d = decide_start(Some(&image), None).unwrap();
        assert_eq!(d.run_id(), &run());
    }
}
