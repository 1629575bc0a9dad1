//! Where a cluster's journal writes are made durable.

use std::sync::{Arc, Mutex, PoisonError};
use swactor_providers::async_trait;
use swactor_provisioning::{JournalDelta, JournalImage, RunId};

/// Makes the host's journal deltas durable. The driver actor awaits each
/// commit before it goes on: nothing that depends on a delta (an attempt's
/// first effect, the acknowledgement of an apply) happens before it is durable.
#[async_trait]
pub trait JournalStore: Send + Sync + 'static {
    /// Makes `delta` durable; returns only once it is.
    ///
    /// # Errors
    /// The write failed; the cluster stops rather than act on intent it could not record.
    async fn commit(&self, delta: &JournalDelta) -> Result<(), CommitError>;

    /// Everything committed so far, for a cluster to resume from (`None`
    /// when nothing ever was).
    fn image(&self) -> Option<JournalImage>;
}

/// A journal write that failed, with the store's own error as its source.
#[derive(Debug, thiserror::Error)]
#[error("the journal cannot be written")]
pub struct CommitError(#[source] Box<dyn std::error::Error + Send + Sync + 'static>);

impl CommitError {
    /// Wraps a store's error.
    pub fn new(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(source))
    }
}

/// A journal kept in memory: it survives the cluster actor (a supervisor can
/// restart the actor from it) but not the process. For tests and for
/// embedders who keep their own records.
#[derive(Clone, Debug)]
pub struct MemoryJournal {
    image: Arc<Mutex<JournalImage>>,
}

impl MemoryJournal {
    /// An empty journal for `run`.
    pub fn new(run: RunId) -> Self {
        Self {
            image: Arc::new(Mutex::new(JournalImage::new(run))),
        }
    }

    /// What has been committed so far.
    pub fn image(&self) -> JournalImage {
        self.image
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[async_trait]
impl JournalStore for MemoryJournal {
    async fn commit(&self, delta: &JournalDelta) -> Result<(), CommitError> {
        // Applying a delta is a handful of map operations; a panic cannot leave it half done.
        self.image
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .apply(delta);
        Ok(())
    }

    fn image(&self) -> Option<JournalImage> {
        Some(MemoryJournal::image(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_commit_keeps_the_stores_error_as_its_source() {
        let e = CommitError::new(std::io::Error::other("disk full"));
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(source.to_string(), "disk full");
        // What the driver reports when it stops the cluster.
        assert_eq!(
            swactor_engine::error_chain(&e),
            "the journal cannot be written: disk full"
        );
    }
}
