//! What a daemon with no journal does when a run has been here before.
//!
//! A journal is the only record of which resources are a run's own. A
//! daemon that starts without one (never made, or deleted, or lost with a
//! disk) would take every resource its provider lists for the run as an
//! orphan and destroy it, and then create the nodes again: on a paid
//! provider, every machine rented twice. So when there is any trace of an
//! earlier run (files in the state directory, resources listed under the
//! run's labels), a daemon without a journal starts only once told which of
//! two things to do: take the listed resources as they are, or clean them
//! up first.

use crate::ResourceKey;
use std::fmt;

/// What to do with what an earlier run left, when there is no journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unrecorded {
    /// Take every listed resource of a desired slot as that slot's attempt,
    /// running the desired template (`swactor up --adopt`); the rest are
    /// collected.
    Adopt,
    /// Collect everything listed, then create the shape anew (`swactor up
    /// --fresh`).
    Fresh,
}

/// The traces an earlier run left, found before a daemon without a journal
/// started anything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traces {
    /// Files of the state directory that only a run leaves, for people
    /// (`token.secret`, `nodes/ (3 entries)`).
    pub files: Vec<String>,
    /// Resources the provider lists for the run.
    pub listed: Vec<ResourceKey>,
}

impl Traces {
    /// Nothing says a run was here.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.listed.is_empty()
    }
}

/// A daemon without a journal found traces of an earlier run and was not
/// told what to do with them: nothing was started or destroyed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostJournal {
    /// What was found.
    pub traces: Traces,
}

impl fmt::Display for LostJournal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut found = self.traces.files.clone();
        if !self.traces.listed.is_empty() {
            const SHOWN: usize = 5;
            let mut names: Vec<String> = self
                .traces
                .listed
                .iter()
                .take(SHOWN)
                .map(ToString::to_string)
                .collect();
            if self.traces.listed.len() > SHOWN {
                names.push(format!("and {} more", self.traces.listed.len() - SHOWN));
            }
            found.push(format!(
                "{} resource(s) of the run still listed by its provider ({})",
                self.traces.listed.len(),
                names.join(", ")
            ));
        }
        write!(
            f,
            "there is no journal, but a run was here before: {}. Its journal was lost, so \
             nothing says which of these are its own. Start again with --adopt to take the \
             listed resources as they are (as the shape's nodes), or with --fresh to destroy \
             them first and create the shape anew; nothing was started or destroyed",
            found.join("; ")
        )
    }
}

impl std::error::Error for LostJournal {}

/// Whether a daemon that has no journal may start, given the `traces` of an
/// earlier run and the `choice` it was given: with no traces it starts as a
/// new run (and needs no choice); with traces, only with a choice.
///
/// # Errors
/// [`LostJournal`]: traces and no choice.
pub fn without_journal(
    traces: Traces,
    choice: Option<Unrecorded>,
) -> Result<Option<Unrecorded>, LostJournal> {
    match choice {
        Some(c) => Ok(Some(c)),
        None if traces.is_empty() => Ok(None),
        None => Err(LostJournal { traces }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LogicalNodeId, NodeAttemptId, RunId};

    fn key(node: &str, attempt: u64) -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(attempt),
        }
    }

    #[test]
    fn traces_without_a_choice_stop_the_start_and_say_what_was_found() {
        assert_eq!(without_journal(Traces::default(), None), Ok(None));
        let traces = Traces {
            files: vec!["token.secret".into(), "nodes/ (2 entries)".into()],
            listed: (0..7).map(|i| key(&format!("w-{i}"), i + 1)).collect(),
        };
        let err = without_journal(traces.clone(), None).unwrap_err();
        let said = err.to_string();
        assert!(
            said.contains("token.secret; nodes/ (2 entries); 7 resource(s)"),
            "{said}"
        );
        assert!(
            said.contains("r/w-0/a1") && said.contains("and 2 more"),
            "{said}"
        );
        assert!(
            said.contains("--adopt") && said.contains("--fresh"),
            "{said}"
        );
        for c in [Unrecorded::Adopt, Unrecorded::Fresh] {
            assert_eq!(without_journal(traces.clone(), Some(c)), Ok(Some(c)));
        }
    }
}
