//! The daemon's journal: the cluster host's durable records in `journal.redb`
//! (or in etcd: [`etcd`]).

pub mod etcd;
pub use etcd::{EtcdArgs, EtcdJournal};

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use swactor_actors::{CommitError, JournalStore};
use swactor_engine::journal::{Journal, JournalBatch, JournalContents};
use swactor_providers::async_trait;
use swactor_provisioning::{
    JOURNAL_FORMAT, JournalDelta, JournalImage, JournalMeta, LogicalNodeId, SlotRecord,
};

/// What the file says it holds.
const KIND: &str = "swactor-cluster";

/// The journal file of one state directory, with a copy in memory of what
/// it holds (a cluster restarted in this process resumes from it).
#[derive(Clone, Debug)]
pub struct DaemonJournal {
    journal: Journal,
    image: Arc<Mutex<Option<JournalImage>>>,
    health: JournalHealth,
}

/// Why the journal's last write failed, if it did: the cluster stops on
/// such a failure, dropping what it was asked, and whoever asked is told
/// this rather than only that the cluster is gone.
#[derive(Clone, Debug, Default)]
pub struct JournalHealth(Arc<Mutex<Option<String>>>);

impl JournalHealth {
    /// The last write's error, unless a write has succeeded since.
    pub fn failure(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records a failure, keeping the first since the last success (a
    /// storage that failed once may only say so on later writes).
    fn failed(&self, failure: String) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(failure);
    }

    fn succeeded(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl DaemonJournal {
    /// Opens (or creates) the journal at `path` and reads what it holds:
    /// `None` when nothing was ever written.
    ///
    /// # Errors
    /// The file is corrupt, of another kind, of a newer format, or held by
    /// another process; the error names the file and nothing is changed.
    pub fn open(path: &Path) -> Result<(Self, Option<JournalImage>)> {
        let (journal, contents): (Journal, JournalContents<JournalMeta, SlotRecord>) =
            Journal::open(path, KIND, JOURNAL_FORMAT).with_context(|| {
                format!(
                    "cannot use the journal {}; nothing was started or destroyed \
                     (move the file away to start over, knowing that whatever it \
                     recorded will then not be adopted)",
                    path.display()
                )
            })?;
        let JournalContents { meta, records } = contents;
        let Some(meta) = meta else {
            if !records.is_empty() {
                bail!(
                    "the journal {} holds slot records but no run; it is not one this \
                     version wrote. Nothing was started or destroyed",
                    path.display()
                );
            }
            let image = Arc::new(Mutex::new(None));
            let health = JournalHealth::default();
            return Ok((
                Self {
                    journal,
                    image,
                    health,
                },
                None,
            ));
        };
        let mut slots = swactor_provisioning::NodeTable::new();
        for (node, record) in records {
            let id = LogicalNodeId::parse(&node).with_context(|| {
                format!(
                    "the journal {} names a slot {node:?} that is not a node id",
                    path.display()
                )
            })?;
            slots.insert(id, record);
        }
        let image = JournalImage { meta, slots };
        let mirror = Arc::new(Mutex::new(Some(image.clone())));
        Ok((
            Self {
                journal,
                image: mirror,
                health: JournalHealth::default(),
            },
            Some(image),
        ))
    }

    /// Whether its writes are failing, for those who explain refusals.
    pub fn health(&self) -> JournalHealth {
        self.health.clone()
    }
}

#[async_trait]
impl JournalStore for DaemonJournal {
    async fn commit(&self, delta: &JournalDelta) -> Result<(), CommitError> {
        if let Err(e) = self.journal.commit(batch_of(delta)).await {
            let failure = swactor_engine::error_chain(&e);
            self.health.failed(failure);
            return Err(CommitError::new(e));
        }
        self.health.succeeded();
        // Mirrored only once durable.
        mirror(&self.image, delta);
        Ok(())
    }

    fn image(&self) -> Option<JournalImage> {
        self.image
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Applies a durable `delta` to a store's in-memory mirror of what it holds
/// (made by the first delta that names the run).
pub(crate) fn mirror(image: &Mutex<Option<JournalImage>>, delta: &JournalDelta) {
    let mut image = image.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(meta) = &delta.meta {
        image
            .get_or_insert_with(|| JournalImage::new(meta.run_id.clone()))
            .apply(delta);
    } else if let Some(image) = image.as_mut() {
        image.apply(delta);
    }
}

/// A delta as the stores write it: slots keyed by their node id's text.
pub(crate) fn batch_of(delta: &JournalDelta) -> JournalBatch<JournalMeta, SlotRecord> {
    JournalBatch {
        meta: delta.meta.clone(),
        put: delta
            .put
            .iter()
            .map(|(node, record)| (node.to_string(), *record))
            .collect(),
        delete: delta.remove.iter().map(ToString::to_string).collect(),
    }
}
