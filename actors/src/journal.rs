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
    async fn commit(&self, delta: &JournalDelta) -> Result<(), String>;

    /// Everything committed so far, for a cluster to resume from (`None`
    /// when nothing ever was).
    fn image(&self) -> Option<JournalImage>;
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
    async fn commit(&self, delta: &JournalDelta) -> Result<(), String> {
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
