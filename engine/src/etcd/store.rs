//! A journal of one meta value and keyed records in etcd: the same contents
//! as [`crate::journal::Journal`], under one key prefix, each commit one
//! etcd transaction, optionally fenced by a leader's key.
//!
//! # Layout
//! Under `{root}/` (the caller's root, e.g. `/prod/swactor/v1/gpu`):
//! - `header`: JSON `{"kind", "format", "buckets", "writer", "commit"}`,
//!   rewritten by every commit (so its revision moves with the journal);
//! - `meta`: the meta value, JSON;
//! - `slots/{bb}`: the records whose key hashes to bucket `bb` (two hex
//!   digits, [`BUCKETS`] of them), as one JSON object from key to record.
//!
//! Records are packed into buckets so that a commit is a bounded number of
//! etcd operations however many records it changes (at most
//! [`BUCKETS`] + 2, under etcd's default `--max-txn-ops` of 128): a commit
//! is never split over several transactions.
//!
//! # Guarantees
//! - [`EtcdStore::commit`] is one transaction. It runs only if the header
//!   is still the one this store last wrote or read (no one else wrote the
//!   journal meanwhile) and, when fenced, if the fence key still has the
//!   creation revision the caller holds; otherwise nothing is written.
//! - A commit that got no answer is sent again (another member, same
//!   transaction) until the call's deadline. The header names each
//!   commit, so a resend that finds its own commit already landed reports
//!   success, and a late copy can never land after a newer commit.
//! - A commit whose outcome is still unknown at its deadline poisons the
//!   store: every later commit is refused until the journal is opened
//!   again (which reads what landed).
//! - [`EtcdStore::open`] only reads: one range (paged, at one revision).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Client, Compare, EtcdError, Op, OpResponse, Range, Txn};
use crate::journal::{JournalBatch, JournalContents};

/// How many buckets the records are packed into.
pub const BUCKETS: usize = 64;
/// The layout version this build writes and reads (also in the header).
pub const LAYOUT: u32 = 1;
/// How many keys one page of [`EtcdStore::open`] reads.
const PAGE_KEYS: i64 = 256;
/// What one operation adds to a request besides its key and value, in
/// bytes (a generous bound of its protobuf framing).
const OP_OVERHEAD_BYTES: usize = 32;

const HEADER: &str = "header";
const META: &str = "meta";
const SLOTS: &str = "slots/";

/// etcd's limits on one transaction, as the cluster is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// etcd's `--max-txn-ops` (default 128).
    pub txn_ops_max: usize,
    /// etcd's `--max-request-bytes` (default 1.5 MiB).
    pub request_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            txn_ops_max: 128,
            request_bytes_max: 1_572_864,
        }
    }
}

/// A leader's claim that a commit must still hold: the key it created to
/// win its election, and the revision that created it. A key deleted (its
/// lease expired) or created again by another leader has another creation
/// revision, so a deposed leader's commit fails with
/// [`EtcdStoreError::Fenced`] and writes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The election key.
    pub key: String,
    /// Its `create_revision` when this leader created it.
    pub create_revision: i64,
}

/// Why an etcd journal could not be opened or committed to.
///
/// An error from [`EtcdStore::open`] means nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum EtcdStoreError {
    /// etcd could not be asked, or refused (see the source); nothing was written,
    /// unless the source [is ambiguous](EtcdError::is_ambiguous).
    #[error("the journal in etcd under {root}")]
    Etcd {
        /// The journal's root.
        root: String,
        /// What failed.
        #[source]
        source: EtcdError,
    },
    /// The prefix holds another kind of journal.
    #[error("the etcd prefix {root} holds {found:?}, not {expected:?}; nothing was changed")]
    OtherKind {
        /// The journal's root.
        root: String,
        /// What its header names.
        found: String,
        /// What the caller expected.
        expected: String,
    },
    /// The journal was written by a newer build.
    #[error(
        "the journal in etcd under {root} has format {found}, newer than format {supported} \
         that this build understands; nothing was changed (upgrade swactor)"
    )]
    NewerFormat {
        /// The journal's root.
        root: String,
        /// Its format.
        found: u32,
        /// The newest this build understands.
        supported: u32,
    },
    /// The prefix holds keys this build did not write, or not in the way it writes them.
    #[error(
        "the etcd prefix {root} is not a journal this build wrote ({reason}); nothing was changed"
    )]
    Foreign {
        /// The journal's root.
        root: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A stored value does not decode as the caller's type.
    #[error(
        "the journal in etcd under {root} holds {what} that does not decode; nothing was changed"
    )]
    Undecodable {
        /// The journal's root.
        root: String,
        /// Which value.
        what: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// A value of a batch cannot be encoded; nothing was written.
    #[error("cannot encode {what} for the journal in etcd under {root}; nothing was written")]
    Encode {
        /// The journal's root.
        root: String,
        /// Which value.
        what: String,
        /// The encoding error.
        #[source]
        source: serde_json::Error,
    },
    /// The fence key is not the caller's any more: another daemon leads.
    #[error(
        "not the leader: the fence key {key:?} was created at revision {found}, not {expected}; \
         nothing was written to the journal under {root}"
    )]
    Fenced {
        /// The journal's root.
        root: String,
        /// The fence key.
        key: String,
        /// The creation revision the caller holds.
        expected: i64,
        /// The key's creation revision now (0: the key is gone).
        found: i64,
    },
    /// Someone else wrote the journal since this store last read or wrote it.
    #[error(
        "the journal in etcd under {root} was written by someone else ({found}); nothing was \
         written (is another daemon using it?)"
    )]
    Changed {
        /// The journal's root.
        root: String,
        /// What the header says now.
        found: String,
    },
    /// The commit is larger than etcd accepts in one transaction; nothing was written.
    #[error(
        "a commit to the journal in etcd under {root} is {what}, over etcd's limit of {limit}; \
         nothing was written (raise etcd's {setting} and this daemon's matching limit)"
    )]
    TooLarge {
        /// The journal's root.
        root: String,
        /// How large the commit is.
        what: String,
        /// The limit.
        limit: usize,
        /// The etcd server flag that sets it.
        setting: &'static str,
    },
    /// An earlier commit's outcome is unknown, so this store writes no more.
    #[error(
        "an earlier commit to the journal in etcd under {root} may or may not have landed; \
         open the journal again to read what it holds"
    )]
    Poisoned {
        /// The journal's root.
        root: String,
    },
}

/// A journal in etcd; cheap to clone, and clones share one view of it.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    root: String,
    kind: String,
    format: u32,
    /// Names this store's commits in the header, with their sequence number.
    writer: String,
    limits: Limits,
    state: tokio::sync::Mutex<State>,
}

/// What this store knows the journal holds, updated only once a commit landed.
struct State {
    /// The header's mod revision (0: no header yet).
    header_revision: i64,
    /// Each bucket's records, encoded.
    buckets: Vec<BTreeMap<String, Vec<u8>>>,
    /// The next commit's number.
    seq: u64,
    /// A commit whose outcome is unknown.
    poisoned: bool,
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("root", &self.inner.root)
            .field("kind", &self.inner.kind)
            .field("format", &self.inner.format)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    kind: String,
    format: u32,
    #[serde(default)]
    layout: u32,
    #[serde(default)]
    buckets: usize,
    #[serde(default)]
    writer: String,
    #[serde(default)]
    commit: u64,
}

/// The bucket of a record's key: FNV-1a, so it never changes between builds.
#[must_use]
pub fn bucket_of(key: &str) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // BUCKETS is small, so the remainder fits.
    usize::try_from(hash % BUCKETS as u64).unwrap_or(0)
}

impl EtcdStore {
    /// Reads the journal under `root` (e.g. `/prod/swactor/v1/gpu`), which
    /// must hold `kind` at a format no newer than `format`, or nothing.
    /// Writes nothing: an empty root gets its header with the first commit.
    ///
    /// # Errors
    /// Every error leaves etcd as it was: [`EtcdStoreError::Etcd`] when etcd
    /// cannot be read, [`EtcdStoreError::OtherKind`],
    /// [`EtcdStoreError::NewerFormat`] or [`EtcdStoreError::Foreign`] when the
    /// root holds something else, [`EtcdStoreError::Undecodable`] when a
    /// value does not decode as `M` or `R`.
    pub async fn open<M: DeserializeOwned, R: DeserializeOwned>(
        client: Client,
        root: &str,
        kind: &str,
        format: u32,
        limits: Limits,
    ) -> Result<(EtcdStore, JournalContents<M, R>), EtcdStoreError> {
        let foreign = |reason: String| EtcdStoreError::Foreign {
            root: root.to_owned(),
            reason,
        };
        if root.is_empty() || root.ends_with('/') || root.chars().any(char::is_control) {
            return Err(foreign(
                "a root must be non-empty, printable and end without '/'".into(),
            ));
        }
        let kvs = read_all(&client, root).await?;
        let mut raw = Raw::default();
        for kv in kvs {
            let name = kv.key.get(root.len() + 1..).unwrap_or_default();
            let name = String::from_utf8(name.to_vec())
                .map_err(|_| foreign("a key that is not UTF-8".to_owned()))?;
            raw.file(name, kv.value, kv.mod_revision).map_err(foreign)?;
        }
        let (contents, buckets) = raw.decode(root, kind, format)?;
        let store = EtcdStore {
            inner: Arc::new(Inner {
                client,
                root: root.to_owned(),
                kind: kind.to_owned(),
                format,
                writer: writer_name(),
                limits,
                state: tokio::sync::Mutex::new(State {
                    header_revision: raw.header.map_or(0, |(_, rev)| rev),
                    buckets,
                    seq: 1,
                    poisoned: false,
                }),
            }),
        };
        Ok((store, contents))
    }

    /// The journal's root.
    #[must_use]
    pub fn root(&self) -> &str {
        &self.inner.root
    }

    /// Commits `batch` as one etcd transaction (puts before deletes, as
    /// [`crate::journal::Journal::commit`]), only while `fence` holds.
    /// Returns once etcd has it (committed on a quorum of members).
    /// Commits are applied one at a time, in the order they are awaited.
    ///
    /// # Errors
    /// Nothing was written, except where noted:
    /// - [`EtcdStoreError::Fenced`]: the fence no longer holds;
    /// - [`EtcdStoreError::Changed`]: someone else wrote the journal;
    /// - [`EtcdStoreError::TooLarge`]: over [`Limits`] (checked before sending);
    /// - [`EtcdStoreError::Encode`]: a value does not encode;
    /// - [`EtcdStoreError::Poisoned`]: an earlier commit's outcome is unknown;
    /// - [`EtcdStoreError::Etcd`]: etcd could not be reached or refused; when
    ///   its source is ambiguous the commit may have landed, and the store
    ///   is poisoned.
    pub async fn commit<M: Serialize, R: Serialize>(
        &self,
        batch: &JournalBatch<M, R>,
        fence: Option<&Fence>,
    ) -> Result<(), EtcdStoreError> {
        let inner = &*self.inner;
        let mut state = inner.state.lock().await;
        if state.poisoned {
            return Err(EtcdStoreError::Poisoned {
                root: inner.root.clone(),
            });
        }
        let planned = inner.plan(&state, batch, fence)?;
        let txn = planned.txn;
        let result = inner.client.txn_resendable(&txn).await;
        let response = match result {
            Ok(r) => r,
            Err(source) => {
                state.poisoned = source.is_ambiguous();
                return Err(inner.etcd_error(source));
            }
        };
        let revision = if response.succeeded {
            response.revision
        } else {
            inner.why_not(&response.responses, state.seq, fence)?
        };
        state.header_revision = revision;
        state.seq += 1;
        for (bucket, records) in planned.buckets {
            state.buckets[bucket] = records;
        }
        Ok(())
    }

    /// Every key under the root, for tests and tools that inspect it.
    ///
    /// # Errors
    /// [`EtcdStoreError::Etcd`] when etcd cannot be read.
    pub async fn keys(&self) -> Result<Vec<String>, EtcdStoreError> {
        let kvs = read_all(&self.inner.client, &self.inner.root).await?;
        Ok(kvs
            .into_iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect())
    }
}

/// A commit's transaction and the buckets it leaves.
struct Planned {
    txn: Txn,
    buckets: Vec<(usize, BTreeMap<String, Vec<u8>>)>,
}

impl Inner {
    fn key(&self, name: &str) -> Vec<u8> {
        format!("{}/{name}", self.root).into_bytes()
    }

    fn etcd_error(&self, source: EtcdError) -> EtcdStoreError {
        EtcdStoreError::Etcd {
            root: self.root.clone(),
            source,
        }
    }

    /// The transaction of a commit and the buckets it leaves; checks etcd's limits.
    fn plan<M: Serialize, R: Serialize>(
        &self,
        state: &State,
        batch: &JournalBatch<M, R>,
        fence: Option<&Fence>,
    ) -> Result<Planned, EtcdStoreError> {
        let encode = |what: String, value: serde_json::Result<Vec<u8>>| {
            value.map_err(|source| EtcdStoreError::Encode {
                root: self.root.clone(),
                what,
                source,
            })
        };
        let mut touched: BTreeMap<usize, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
        let bucket = |touched: &mut BTreeMap<usize, BTreeMap<String, Vec<u8>>>, key: &str| {
            let b = bucket_of(key);
            touched.entry(b).or_insert_with(|| state.buckets[b].clone());
            b
        };
        for (key, record) in &batch.put {
            let value = encode(format!("record {key:?}"), serde_json::to_vec(record))?;
            let b = bucket(&mut touched, key);
            touched.entry(b).or_default().insert(key.clone(), value);
        }
        for key in &batch.delete {
            let b = bucket(&mut touched, key);
            touched.entry(b).or_default().remove(key);
        }
        let header = Header {
            kind: self.kind.clone(),
            format: self.format,
            layout: LAYOUT,
            buckets: BUCKETS,
            writer: self.writer.clone(),
            commit: state.seq,
        };
        let header = encode("the header".to_owned(), serde_json::to_vec(&header))?;
        let mut success = vec![put(self.key(HEADER), header)];
        if let Some(meta) = &batch.meta {
            let meta = encode("the meta value".to_owned(), serde_json::to_vec(meta))?;
            success.push(put(self.key(META), meta));
        }
        for (b, records) in &touched {
            let key = self.key(&format!("{SLOTS}{b:02x}"));
            success.push(if records.is_empty() {
                Op::Delete { key, end: None }
            } else {
                put(key, bucket_json(records))
            });
        }
        let mut compare = vec![Compare::modified_at(
            self.key(HEADER),
            state.header_revision,
        )];
        let mut failure = vec![Op::Get(Range::key(self.key(HEADER)))];
        if let Some(fence) = fence {
            compare.push(Compare::created_at(
                fence.key.as_bytes(),
                fence.create_revision,
            ));
            failure.push(Op::Get(Range::key(fence.key.as_bytes())));
        }
        let txn = Txn {
            compare,
            success,
            failure,
        };
        self.check_limits(&txn)?;
        Ok(Planned {
            txn,
            buckets: touched.into_iter().collect(),
        })
    }

    fn check_limits(&self, txn: &Txn) -> Result<(), EtcdStoreError> {
        let ops = txn.success.len().max(txn.compare.len());
        if ops > self.limits.txn_ops_max {
            return Err(EtcdStoreError::TooLarge {
                root: self.root.clone(),
                what: format!("{ops} operations"),
                limit: self.limits.txn_ops_max,
                setting: "--max-txn-ops",
            });
        }
        let bytes: usize = txn
            .success
            .iter()
            .map(|op| match op {
                Op::Put { key, value, .. } => key.len() + value.len(),
                Op::Delete { key, .. } => key.len(),
                Op::Get(range) => range.key.len(),
            })
            .chain(txn.compare.iter().map(|c| c.key.len() + 8))
            .map(|len| len + OP_OVERHEAD_BYTES)
            .sum();
        if bytes > self.limits.request_bytes_max {
            return Err(EtcdStoreError::TooLarge {
                root: self.root.clone(),
                what: format!("{bytes} bytes"),
                limit: self.limits.request_bytes_max,
                setting: "--max-request-bytes",
            });
        }
        Ok(())
    }

    /// Why a commit's comparisons failed, from its failure branch's reads;
    /// `Ok` with the header's revision when it failed because this very
    /// commit had already landed (a resend after no answer).
    fn why_not(
        &self,
        responses: &[OpResponse],
        seq: u64,
        fence: Option<&Fence>,
    ) -> Result<i64, EtcdStoreError> {
        let first = |i: usize| match responses.get(i) {
            Some(OpResponse::Get(page)) => page.kvs.first().cloned(),
            _ => None,
        };
        let header = first(0);
        let said: Option<Header> = header
            .as_ref()
            .and_then(|kv| serde_json::from_slice(&kv.value).ok());
        if let (Some(kv), Some(h)) = (&header, &said)
            && h.writer == self.writer
            && h.commit == seq
        {
            return Ok(kv.mod_revision);
        }
        if let Some(fence) = fence {
            let found = first(1).map_or(0, |kv| kv.create_revision);
            if found != fence.create_revision {
                return Err(EtcdStoreError::Fenced {
                    root: self.root.clone(),
                    key: fence.key.clone(),
                    expected: fence.create_revision,
                    found,
                });
            }
        }
        Err(EtcdStoreError::Changed {
            root: self.root.clone(),
            found: match said {
                Some(h) => format!(
                    "commit {} of writer {}, format {}",
                    h.commit, h.writer, h.format
                ),
                None if header.is_some() => "a header this build cannot read".to_owned(),
                None => "no header: the journal was deleted".to_owned(),
            },
        })
    }
}

fn put(key: Vec<u8>, value: Vec<u8>) -> Op {
    Op::Put {
        key,
        value,
        lease: 0,
    }
}

/// A bucket as one JSON object: `{"key": record, …}`.
fn bucket_json(records: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.values().map(|v| v.len() + 32).sum());
    out.push(b'{');
    for (i, (key, value)) in records.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // A string always encodes.
        out.extend(serde_json::to_vec(key).unwrap_or_default());
        out.push(b':');
        out.extend_from_slice(value);
    }
    out.push(b'}');
    out
}

/// A name for this store's commits that no other store shares: the
/// process, the time and a per-process count.
fn writer_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u64(SEQ.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}", h.finish())
}

/// Every key under `{root}/`, paged at one revision.
async fn read_all(client: &Client, root: &str) -> Result<Vec<super::KeyValue>, EtcdStoreError> {
    let etcd = |source| EtcdStoreError::Etcd {
        root: root.to_owned(),
        source,
    };
    let mut range = Range::prefix(format!("{root}/"));
    range.limit = PAGE_KEYS;
    let mut kvs = Vec::new();
    loop {
        let page = client.range(&range).await.map_err(etcd)?;
        // Later pages read at the first page's revision: one consistent view.
        range.revision = page.revision;
        let more = page.more;
        if let Some(last) = page.kvs.last() {
            let mut next = last.key.clone();
            next.push(0);
            range.key = next;
        }
        kvs.extend(page.kvs);
        if !more {
            return Ok(kvs);
        }
    }
}

/// A root's keys, sorted by name, undecoded.
#[derive(Default)]
struct Raw {
    header: Option<(Vec<u8>, i64)>,
    meta: Option<Vec<u8>>,
    slots: Vec<(usize, Vec<u8>)>,
}

impl Raw {
    fn file(&mut self, name: String, value: Vec<u8>, revision: i64) -> Result<(), String> {
        if name == HEADER {
            self.header = Some((value, revision));
        } else if name == META {
            self.meta = Some(value);
        } else if let Some(b) = name.strip_prefix(SLOTS)
            && b.len() == 2
            && let Ok(b) = usize::from_str_radix(b, 16)
            && b < BUCKETS
        {
            self.slots.push((b, value));
        } else {
            return Err(format!("it holds a key {name:?} this build does not write"));
        }
        Ok(())
    }

    /// Checks the header and decodes the values.
    #[allow(clippy::type_complexity)] // A pair of the contents and their encoded buckets.
    fn decode<M: DeserializeOwned, R: DeserializeOwned>(
        &self,
        root: &str,
        kind: &str,
        format: u32,
    ) -> Result<(JournalContents<M, R>, Vec<BTreeMap<String, Vec<u8>>>), EtcdStoreError> {
        let foreign = |reason: String| EtcdStoreError::Foreign {
            root: root.to_owned(),
            reason,
        };
        let undecodable = |what: String| {
            move |source| EtcdStoreError::Undecodable {
                root: root.to_owned(),
                what,
                source,
            }
        };
        let mut buckets = vec![BTreeMap::new(); BUCKETS];
        let Some((header, _)) = &self.header else {
            if self.meta.is_some() || !self.slots.is_empty() {
                return Err(foreign("it holds values but no header".to_owned()));
            }
            return Ok((JournalContents::default(), buckets));
        };
        let header: Header =
            serde_json::from_slice(header).map_err(undecodable("the header".to_owned()))?;
        if header.kind != kind {
            return Err(EtcdStoreError::OtherKind {
                root: root.to_owned(),
                found: header.kind,
                expected: kind.to_owned(),
            });
        }
        if header.format > format {
            return Err(EtcdStoreError::NewerFormat {
                root: root.to_owned(),
                found: header.format,
                supported: format,
            });
        }
        if header.layout != LAYOUT || header.buckets != BUCKETS {
            return Err(foreign(format!(
                "its layout is {} with {} buckets, not {LAYOUT} with {BUCKETS}",
                header.layout, header.buckets
            )));
        }
        let meta = self
            .meta
            .as_deref()
            .map(serde_json::from_slice)
            .transpose()
            .map_err(undecodable("the meta value".to_owned()))?;
        let mut records = BTreeMap::new();
        for (b, value) in &self.slots {
            let what = || format!("bucket {b:02x}");
            let entries: BTreeMap<String, serde_json::Value> =
                serde_json::from_slice(value).map_err(undecodable(what()))?;
            for (key, value) in entries {
                if bucket_of(&key) != *b {
                    return Err(foreign(format!("record {key:?} is in bucket {b:02x}")));
                }
                let encoded = serde_json::to_vec(&value).map_err(undecodable(what()))?;
                let record = serde_json::from_value(value)
                    .map_err(undecodable(format!("record {key:?}")))?;
                buckets[*b].insert(key.clone(), encoded);
                records.insert(key, record);
            }
        }
        Ok((JournalContents { meta, records }, buckets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::{EtcdConfig, KeyValue, RangePage};

    fn inner(limits: Limits) -> Inner {
        Inner {
            client: Client::new(EtcdConfig::new(["http://127.0.0.1:9"])).unwrap(),
            root: "/r".to_owned(),
            kind: "k".to_owned(),
            format: 1,
            writer: "w1".to_owned(),
            limits,
            state: tokio::sync::Mutex::new(State {
                header_revision: 0,
                buckets: vec![BTreeMap::new(); BUCKETS],
                seq: 1,
                poisoned: false,
            }),
        }
    }

    fn got(kv: Option<(Vec<u8>, i64, i64)>) -> OpResponse {
        OpResponse::Get(RangePage {
            kvs: kv
                .into_iter()
                .map(|(value, create_revision, mod_revision)| KeyValue {
                    key: Vec::new(),
                    value,
                    create_revision,
                    mod_revision,
                    version: 1,
                    lease: 0,
                })
                .collect(),
            ..RangePage::default()
        })
    }

    fn header(writer: &str, commit: u64) -> Vec<u8> {
        let h = Header {
            kind: "k".to_owned(),
            format: 1,
            layout: LAYOUT,
            buckets: BUCKETS,
            writer: writer.to_owned(),
            commit,
        };
        serde_json::to_vec(&h).unwrap()
    }

    #[test]
    fn a_resend_that_finds_its_own_commit_landed_counts_it_as_landed() {
        let store = inner(Limits::default());
        let ours = [got(Some((header("w1", 5), 3, 42)))];
        assert_eq!(store.why_not(&ours, 5, None).unwrap(), 42);
        // An earlier commit of ours is not this one: someone wrote since.
        let e = store.why_not(&ours, 6, None).unwrap_err();
        assert!(matches!(e, EtcdStoreError::Changed { .. }), "{e}");
        let fence = Fence {
            key: "/election/a".to_owned(),
            create_revision: 7,
        };
        let theirs = [
            got(Some((header("w2", 9), 3, 50))),
            got(Some((b"b".to_vec(), 9, 9))),
        ];
        let e = store.why_not(&theirs, 6, Some(&fence)).unwrap_err();
        assert!(
            matches!(
                e,
                EtcdStoreError::Fenced {
                    expected: 7,
                    found: 9,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().starts_with("not the leader"), "{e}");
        let gone = [got(Some((header("w1", 5), 3, 42))), got(None)];
        let e = store.why_not(&gone, 6, Some(&fence)).unwrap_err();
        assert!(matches!(e, EtcdStoreError::Fenced { found: 0, .. }), "{e}");
    }

    #[test]
    fn a_commit_over_etcds_limits_is_refused_before_anything_is_sent() {
        let store = inner(Limits {
            txn_ops_max: 128,
            request_bytes_max: 4_096,
        });
        let state = store.state.try_lock().unwrap();
        let small: JournalBatch<String, String> = JournalBatch {
            meta: Some("m".to_owned()),
            put: (0..1_000)
                .map(|i| (format!("n{i}"), "r".to_owned()))
                .collect(),
            delete: Vec::new(),
        };
        // A thousand records make at most BUCKETS + 2 operations.
        let e = store.plan(&state, &small, None).err().unwrap();
        assert!(
            matches!(
                e,
                EtcdStoreError::TooLarge {
                    setting: "--max-request-bytes",
                    ..
                }
            ),
            "{e}"
        );
        let roomy = inner(Limits::default());
        let planned = roomy.plan(&state, &small, None).unwrap();
        assert_eq!(planned.txn.success.len(), BUCKETS + 2);
        let few_ops = inner(Limits {
            txn_ops_max: 8,
            request_bytes_max: 1 << 20,
        });
        let e = few_ops.plan(&state, &small, None).err().unwrap();
        assert!(
            matches!(
                e,
                EtcdStoreError::TooLarge {
                    setting: "--max-txn-ops",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("raise etcd's --max-txn-ops"), "{e}");
    }

    #[test]
    fn a_records_bucket_never_changes_between_builds() {
        // Pinned: a build that moved records between buckets could not
        // read the journals earlier builds wrote.
        assert_eq!(
            ["", "a", "gpu-0", "cpu-17"].map(bucket_of),
            [0x25, 0x0c, 0x08, 0x10]
        );
        let mut records = BTreeMap::new();
        records.insert("b\"q".to_owned(), b"{\"x\":1}".to_vec());
        records.insert("a".to_owned(), b"2".to_vec());
        assert_eq!(bucket_json(&records), br#"{"a":2,"b\"q":{"x":1}}"#);
    }
}
