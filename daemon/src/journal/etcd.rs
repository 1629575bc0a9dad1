//! The cluster journal kept in etcd, for daemons that share one (`docs/ha.md`).
//!
//! [`EtcdJournal`] holds what [`super::DaemonJournal`] holds in
//! `journal.redb` (the run's [`JournalMeta`] and one [`SlotRecord`] per
//! slot, encoded the same way), under `{prefix}/swactor/v1/{run}` in etcd,
//! through the engine's [`EtcdStore`]. Each commit is one etcd transaction,
//! fenced by the leader's election key when one is set.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use swactor_actors::{CommitError, JournalStore};
use swactor_engine::etcd::{
    Client, EtcdConfig, EtcdError, EtcdFlags, EtcdStore, EtcdStoreError, Fence, Limits,
};
use swactor_engine::journal::JournalContents;
use swactor_providers::async_trait;
use swactor_provisioning::{
    JOURNAL_FORMAT, JournalDelta, JournalImage, JournalMeta, LogicalNodeId, NodeTable, RunId,
    SlotRecord, validate_id,
};

use super::{JournalHealth, KIND};

/// The command line's etcd flags; each absent one falls back to the
/// variable `etcdctl` reads (credentials only ever come from
/// `ETCDCTL_USER` and `ETCDCTL_PASSWORD`).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdArgs {
    /// etcd members' client URLs, comma-separated, tried in order
    /// (default: $ETCDCTL_ENDPOINTS).
    #[arg(long = "etcd", value_name = "URL[,URL...]")]
    pub etcd: Option<String>,
    /// The CA file the members' certificates chain to (default: $ETCDCTL_CACERT).
    #[arg(long = "etcd-cacert", value_name = "FILE")]
    pub etcd_cacert: Option<PathBuf>,
    /// This daemon's client certificate (default: $ETCDCTL_CERT).
    #[arg(long = "etcd-cert", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's key (default: $ETCDCTL_KEY).
    #[arg(long = "etcd-key", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    /// The etcd configuration these flags and the environment describe;
    /// `None` when neither names an endpoint.
    ///
    /// # Errors
    /// When it is not usable (see [`EtcdConfig::validate`]).
    pub fn config(&self) -> Result<Option<EtcdConfig>, EtcdError> {
        self.config_from(|name| std::env::var(name).ok())
    }

    /// [`Self::config`] with the environment read through `env`.
    ///
    /// # Errors
    /// As [`Self::config`].
    pub fn config_from(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<EtcdConfig>, EtcdError> {
        let flags = EtcdFlags {
            endpoints: self.etcd.clone(),
            cacert: self.etcd_cacert.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
        };
        EtcdConfig::from_sources(&flags, env)
    }
}

/// The journal of one run in etcd, with a copy in memory of what it holds
/// (updated only once a commit is durable).
#[derive(Clone, Debug)]
pub struct EtcdJournal {
    store: EtcdStore,
    image: Arc<Mutex<Option<JournalImage>>>,
    health: JournalHealth,
    fence: Arc<Mutex<Option<Fence>>>,
    /// Commits sent so far (tried, whatever their outcome).
    sent: Arc<std::sync::atomic::AtomicU64>,
}

impl EtcdJournal {
    /// How many commits this journal object has sent to etcd (tried,
    /// landed or not); clones count together.
    #[must_use]
    pub fn commits_sent(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Where the journal of `run` lives under `prefix`: `{prefix}/swactor/v1/{run}`.
    #[must_use]
    pub fn root(prefix: &str, run: &RunId) -> String {
        format!("{prefix}/swactor/v1/{}", run.as_str())
    }

    /// Reads the journal of `run` under `prefix` (e.g. `""` or `/prod`):
    /// `None` when nothing was ever written. Writes nothing.
    ///
    /// # Errors
    /// etcd cannot be read, or the prefix holds another kind of journal, a
    /// newer format, another run's journal, or values that do not decode;
    /// the error names the prefix, and nothing in etcd is changed.
    pub async fn open(
        client: Client,
        prefix: &str,
        run: &RunId,
    ) -> Result<(Self, Option<JournalImage>)> {
        Self::open_with(client, prefix, run, Limits::default()).await
    }

    /// [`Self::open`] for an etcd whose transaction limits are not the defaults.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub async fn open_with(
        client: Client,
        prefix: &str,
        run: &RunId,
        limits: Limits,
    ) -> Result<(Self, Option<JournalImage>)> {
        if let Err(e) = validate_id(run.as_str()) {
            bail!(
                "the run id {:?} {e}; it cannot name a journal in etcd",
                run.as_str()
            );
        }
        if prefix.ends_with('/') || prefix.chars().any(char::is_control) {
            bail!("the etcd prefix {prefix:?} must not end with '/' nor hold control characters");
        }
        let root = Self::root(prefix, run);
        let nothing_done = || {
            format!(
                "cannot use the journal in etcd under {root}; nothing was started or destroyed \
                 (delete the prefix to start over, knowing that whatever it recorded will then \
                 not be adopted)"
            )
        };
        let (store, contents): (EtcdStore, JournalContents<JournalMeta, SlotRecord>) =
            EtcdStore::open(client, &root, KIND, JOURNAL_FORMAT, limits)
                .await
                .with_context(nothing_done)?;
        let image = image_of(contents, &root, run).with_context(nothing_done)?;
        let journal = Self {
            store,
            image: Arc::new(Mutex::new(image.clone())),
            health: JournalHealth::default(),
            fence: Arc::new(Mutex::new(None)),
            sent: Arc::default(),
        };
        Ok((journal, image))
    }

    /// Makes every later [`JournalStore::commit`] hold only while `fence`
    /// does (`None`: unfenced). A leader sets its election key here once it
    /// wins, before its first commit.
    pub fn set_fence(&self, fence: Option<Fence>) {
        *self.fence.lock().unwrap_or_else(PoisonError::into_inner) = fence;
    }

    /// The fence commits hold to now.
    #[must_use]
    pub fn fence(&self) -> Option<Fence> {
        self.fence
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Commits `delta` as one etcd transaction that holds only while
    /// `fence` does; mirrors it once durable.
    ///
    /// # Errors
    /// [`EtcdStoreError::Fenced`] when this daemon no longer leads, and
    /// the rest of [`EtcdStore::commit`]'s errors; the failure is also
    /// kept in [`Self::health`].
    pub async fn commit_fenced(
        &self,
        delta: &JournalDelta,
        fence: Option<&Fence>,
    ) -> Result<(), EtcdStoreError> {
        self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = self.store.commit(&super::batch_of(delta), fence).await {
            self.health.failed(swactor_engine::error_chain(&e));
            return Err(e);
        }
        self.health.succeeded();
        super::mirror(&self.image, delta);
        Ok(())
    }

    /// Whether its writes are failing, for those who explain refusals.
    #[must_use]
    pub fn health(&self) -> JournalHealth {
        self.health.clone()
    }

    /// The etcd key the journal lives under.
    #[must_use]
    pub fn key_root(&self) -> &str {
        self.store.root()
    }
}

#[async_trait]
impl JournalStore for EtcdJournal {
    async fn commit(&self, delta: &JournalDelta) -> Result<(), CommitError> {
        let fence = self.fence();
        self.commit_fenced(delta, fence.as_ref())
            .await
            .map_err(CommitError::new)
    }

    fn image(&self) -> Option<JournalImage> {
        self.image
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The image a journal's contents make, checked as [`super::DaemonJournal::open`] checks a file's.
fn image_of(
    contents: JournalContents<JournalMeta, SlotRecord>,
    root: &str,
    run: &RunId,
) -> Result<Option<JournalImage>> {
    let JournalContents { meta, records } = contents;
    let Some(meta) = meta else {
        if !records.is_empty() {
            bail!(
                "the etcd prefix {root} holds slot records but no run; it is not one this version wrote"
            );
        }
        return Ok(None);
    };
    if meta.run_id != *run {
        bail!(
            "the etcd prefix {root} holds the journal of run {:?}, not of run {:?}",
            meta.run_id.as_str(),
            run.as_str()
        );
    }
    let mut slots = NodeTable::new();
    for (node, record) in records {
        let Some(id) = LogicalNodeId::parse(&node) else {
            bail!("the etcd prefix {root} names a slot {node:?} that is not a node id");
        };
        slots.insert(id, record);
    }
    Ok(Some(JournalImage { meta, slots }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        etcd: EtcdArgs,
    }

    #[test]
    fn the_etcd_flags_parse_and_fall_back_to_etcdctls_variables() {
        let cli = Cli::parse_from(["x", "--etcd", "http://127.0.0.1:1,http://127.0.0.1:2"]);
        let config = cli.etcd.config_from(|_| None).unwrap().unwrap();
        assert_eq!(
            config.endpoints,
            ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        );
        let none = Cli::parse_from(["x"]);
        assert_eq!(none.etcd.config_from(|_| None).unwrap(), None);
        let from_env = none
            .etcd
            .config_from(|n| (n == "ETCDCTL_ENDPOINTS").then(|| "http://127.0.0.1:3".to_owned()))
            .unwrap()
            .unwrap();
        assert_eq!(from_env.endpoints, ["http://127.0.0.1:3"]);
        let e = Cli::parse_from(["x", "--etcd", "https://h:1"])
            .etcd
            .config_from(|_| None)
            .unwrap_err();
        assert!(e.to_string().contains("--etcd-cacert"), "{e}");
    }

    #[test]
    fn a_journals_root_names_its_run_under_the_prefix() {
        assert_eq!(
            EtcdJournal::root("/prod", &RunId::new("gpu")),
            "/prod/swactor/v1/gpu"
        );
        assert_eq!(EtcdJournal::root("", &RunId::new("gpu")), "/swactor/v1/gpu");
    }
}
