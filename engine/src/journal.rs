//! A durable, single-writer journal of one meta value and keyed records, on redb.
//!
//! The daemon records its intent here before acting on it. A [`Journal`] is a
//! redb file with three tables: a header naming what the file holds (its
//! `kind`) and the format version of its values, one optional meta value, and
//! records keyed by string. Values are JSON (serde_json), so value types may
//! use `#[serde(untagged)]`.
//!
//! # Guarantees
//! - [`Journal::commit`] applies a [`JournalBatch`] in one redb transaction
//!   that is fsynced before it returns: after a crash the file holds every
//!   acknowledged batch and no part of an unacknowledged one.
//! - A failed [`Journal::open`] leaves the file's bytes as they were. The
//!   file is first checked on a private in-memory copy (opened, recovered if
//!   needed, every value decoded); it is opened for writing only once the
//!   copy passed.
//! - One [`Journal`] (with its clones) holds the file at a time, in this
//!   process or any other: an exclusive `flock` is taken before the file is
//!   read and kept until the last clone is dropped.
//! - A new file is built under a temporary name and linked into place, so
//!   `path` never names a half-initialised file; it has mode 0600.
//!
//! # Caveats
//! - A file left by a killed process is recovered by redb when it is next
//!   opened: redb rebuilds its allocator state and keeps the newest commit
//!   whose checksums verify. This rewrites part of the file, which is redb's
//!   normal crash recovery and cannot be turned off without refusing every
//!   crashed journal; it is logged at `warn`. If the newest commit's
//!   checksums fail, redb falls back to the commit before it. A crash tears
//!   only a commit whose fsync had not returned (so it was never
//!   acknowledged); an acknowledged commit is lost this way only if the disk
//!   lied about the fsync or the file was damaged afterwards.
//! - Some damage makes redb panic instead of returning an error (for example
//!   a file shorter than its header says). The check on the copy catches the
//!   panic and reports [`JournalError::Corrupt`], but the panic message is
//!   still printed by the panic hook, and a build with `panic = "abort"`
//!   aborts instead.
//! - Files larger than [`FILE_LEN_MAX_BYTES`] are refused, since the check
//!   copies the file into memory.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redb::{
    Builder, Database, ReadableDatabase, ReadableTable, StorageBackend, TableDefinition, TableError,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Largest journal file [`Journal::open`] accepts, in bytes; the file is
/// copied into memory to be checked before it is opened for writing.
pub const FILE_LEN_MAX_BYTES: u64 = 256 << 20;

/// Most memory redb may use to cache pages of one journal, in bytes.
const CACHE_LEN_MAX_BYTES: usize = 16 << 20;

/// `kind` and `format`, as strings.
const HEADER: TableDefinition<'_, &str, &str> = TableDefinition::new("header");
/// The meta value, JSON, under [`META_KEY`].
const META: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("meta");
/// The records, JSON.
const RECORDS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("records");

const KIND_KEY: &str = "kind";
const FORMAT_KEY: &str = "format";
const META_KEY: &str = "meta";

/// One atomic change: replace the meta value (if `Some`), upsert `put`, remove `delete`.
///
/// Puts are applied before deletes, so a key named in both ends up absent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalBatch<M, R> {
    /// The new meta value; `None` leaves the stored one as it is.
    pub meta: Option<M>,
    /// Records to insert or replace, by key.
    pub put: Vec<(String, R)>,
    /// Keys of records to remove; absent keys are ignored.
    pub delete: Vec<String>,
}

impl<M, R> Default for JournalBatch<M, R> {
    fn default() -> Self {
        Self {
            meta: None,
            put: Vec::new(),
            delete: Vec::new(),
        }
    }
}

/// What a journal held when opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalContents<M, R> {
    /// The meta value, if one was ever committed.
    pub meta: Option<M>,
    /// Every record, by key.
    pub records: BTreeMap<String, R>,
}

impl<M, R> Default for JournalContents<M, R> {
    fn default() -> Self {
        Self {
            meta: None,
            records: BTreeMap::new(),
        }
    }
}

/// Why a journal could not be opened or committed to.
///
/// An error from [`Journal::open`] means the file was not changed, except
/// [`JournalError::Storage`] (see there).
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Another [`Journal`] holds the file: another process (a second daemon
    /// for the same state), or another `open` in this one.
    #[error("the journal {path} is in use by another process; nothing was changed")]
    InUse {
        /// The file.
        path: PathBuf,
    },
    /// The file does not exist and cannot be created because its parent
    /// directory does not exist.
    #[error("cannot create the journal {path}: its parent directory does not exist")]
    NoParent {
        /// The file.
        path: PathBuf,
    },
    /// Creating a new file failed; no file was left at `path`.
    #[error("cannot create the journal {path}")]
    Create {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<redb::Error>,
    },
    /// The file cannot be opened or read (permissions, I/O).
    #[error("cannot read the journal {path}; nothing was changed")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// The file is larger than [`FILE_LEN_MAX_BYTES`].
    #[error(
        "the journal {path} is {len_bytes} bytes, more than the {len_max_bytes} bytes allowed; \
         nothing was changed"
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its length.
        len_bytes: u64,
        /// The limit.
        len_max_bytes: u64,
    },
    /// The file is damaged, or is not a journal.
    #[error("the journal {path} is damaged or is not a journal ({reason}); nothing was changed")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
        /// redb's error, when it reported one (rather than panicking or
        /// opening a file without a journal header).
        #[source]
        source: Option<Box<redb::Error>>,
    },
    /// The file holds something else.
    #[error(
        "the journal {path} holds {found:?}, not {expected:?}; nothing was changed \
         (is this the right file?)"
    )]
    OtherKind {
        /// The file.
        path: PathBuf,
        /// The kind the file's header names.
        found: String,
        /// The kind the caller expected.
        expected: String,
    },
    /// The file was written by a newer build.
    #[error(
        "the journal {path} has format {found}, newer than format {supported} that this build \
         understands; nothing was changed (upgrade swactor)"
    )]
    NewerFormat {
        /// The file.
        path: PathBuf,
        /// The file's format.
        found: u32,
        /// The newest format this build understands.
        supported: u32,
    },
    /// A stored value does not decode as the caller's type.
    #[error("the journal {path} holds {what} that does not decode; nothing was changed")]
    Undecodable {
        /// The file.
        path: PathBuf,
        /// Which value: the meta value or a record's key.
        what: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// A value of a batch cannot be encoded; nothing was committed.
    #[error("cannot encode {what} for the journal {path}; nothing was committed")]
    Encode {
        /// The file.
        path: PathBuf,
        /// Which value: the meta value or a record's key.
        what: String,
        /// The encoding error.
        #[source]
        source: serde_json::Error,
    },
    /// redb failed on a file that passed the check: a failed commit was
    /// rolled back; a failed open may have left redb's crash recovery done.
    #[error("i/o on the journal {path} failed")]
    Storage {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<redb::Error>,
    },
    /// The blocking thread running a commit panicked or was cancelled; the
    /// batch may or may not have been committed.
    #[error("a commit to the journal {path} did not finish; it may or may not have landed")]
    Interrupted {
        /// The file.
        path: PathBuf,
        /// The join error.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// How long [`Journal::open`] waits for a lock that may be let go of in a
/// moment. A process this one starts holds a copy of every open file, and
/// so the lock of a journal closed just then, until it has started the
/// program it runs: an `open` right after a close would otherwise be
/// refused as in use now and then, in a daemon that starts processes (or a
/// test binary that does). A journal another daemon holds is still
/// reported, after this.
const LOCK_PATIENCE: Duration = Duration::from_millis(500);

/// How often [`Journal::open`] tries the lock again meanwhile.
const LOCK_RETRY: Duration = Duration::from_millis(5);

/// A durable journal file; cheap to clone, and all clones share one open file.
///
/// The file stays locked until the last clone is dropped, which also closes
/// redb cleanly (so the next open needs no recovery). That close writes and
/// fsyncs, so drop the last clone at shutdown or on a blocking thread.
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    path: PathBuf,
    /// The newest format this build writes.
    format: u32,
    /// The format the file's header names; raised to `format` by the first commit.
    format_on_disk: AtomicU32,
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("path", &self.inner.path)
            .field("format", &self.inner.format)
            .finish_non_exhaustive()
    }
}

impl Journal {
    /// Opens the journal at `path`, creating it when absent. `kind` names what the file holds
    /// (e.g. "swactor-cluster") and `format` the newest format version this build understands.
    ///
    /// A file of an older format is accepted as it is (no migrations exist
    /// yet); the first commit records `format` in its header, so older builds
    /// then refuse it. This call blocks on file I/O: call it at start-up or
    /// from a blocking thread.
    ///
    /// # Errors
    /// Every error but the last leaves the file's bytes untouched:
    /// - [`JournalError::InUse`] if another [`Journal`] holds the file (and
    ///   still does half a second later: see [`LOCK_PATIENCE`]);
    /// - [`JournalError::NoParent`] or [`JournalError::Create`] if a new file
    ///   cannot be made;
    /// - [`JournalError::Unreadable`] or [`JournalError::TooLarge`] if it
    ///   cannot be read;
    /// - [`JournalError::Corrupt`] if it is damaged or not a journal (also an
    ///   empty file);
    /// - [`JournalError::OtherKind`] or [`JournalError::NewerFormat`] if it is
    ///   another kind of journal or newer than `format`;
    /// - [`JournalError::Undecodable`] if a value does not decode as `M` or `R`;
    /// - [`JournalError::Storage`] if the file passed the check and then failed
    ///   to open, after redb's crash recovery may have written to it.
    pub fn open<M: DeserializeOwned, R: DeserializeOwned>(
        path: &Path,
        kind: &str,
        format: u32,
    ) -> Result<(Journal, JournalContents<M, R>), JournalError> {
        match std::fs::symlink_metadata(path) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => create(path, kind, format)?,
            Err(source) => {
                return Err(JournalError::Unreadable {
                    path: path.to_owned(),
                    source,
                });
            }
        }
        let unreadable = |source| JournalError::Unreadable {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(unreadable)?;
        // redb takes the same lock when it opens the file; taking it first
        // keeps another process from writing between the check and the open.
        // A second lock on the same open file description is a no-op.
        let mut waited = Duration::ZERO;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) if waited < LOCK_PATIENCE => {
                    std::thread::sleep(LOCK_RETRY);
                    waited += LOCK_RETRY;
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(JournalError::InUse {
                        path: path.to_owned(),
                    });
                }
                Err(TryLockError::Error(e)) => return Err(unreadable(e)),
            }
        }
        let len_bytes = file.metadata().map_err(unreadable)?.len();
        if len_bytes == 0 {
            return Err(JournalError::Corrupt {
                path: path.to_owned(),
                reason: "the file is empty".to_owned(),
                source: None,
            });
        }
        if len_bytes > FILE_LEN_MAX_BYTES {
            return Err(JournalError::TooLarge {
                path: path.to_owned(),
                len_bytes,
                len_max_bytes: FILE_LEN_MAX_BYTES,
            });
        }
        // Bounded by FILE_LEN_MAX_BYTES above, so it fits in usize.
        let mut bytes = vec![0u8; usize::try_from(len_bytes).unwrap_or(usize::MAX)];
        file.read_exact_at(&mut bytes, 0).map_err(unreadable)?;

        let (format_on_disk, contents) = check_copy::<M, R>(path, bytes, kind, format)?;

        let repaired = Arc::new(AtomicBool::new(false));
        let flag = repaired.clone();
        let db = builder()
            .set_repair_callback(move |_| flag.store(true, Ordering::Relaxed))
            .create_file(file)
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => JournalError::InUse {
                    path: path.to_owned(),
                },
                e => JournalError::Storage {
                    path: path.to_owned(),
                    source: Box::new(e.into()),
                },
            })?;
        if repaired.load(Ordering::Relaxed) {
            tracing::warn!(
                path = %path.display(),
                "the journal was not closed cleanly; redb recovered its last complete commit"
            );
        }
        let journal = Journal {
            inner: Arc::new(Inner {
                db,
                path: path.to_owned(),
                format,
                format_on_disk: AtomicU32::new(format_on_disk),
            }),
        };
        Ok((journal, contents))
    }

    /// Commits `batch` in one durable transaction (fsynced before it returns)
    /// on one of tokio's blocking threads, so an async caller is never blocked.
    ///
    /// Concurrent commits are applied one at a time in an unspecified order;
    /// await one before starting the next when order matters. Dropping the
    /// returned future does not stop a commit that has started. Must be
    /// called inside a tokio runtime.
    ///
    /// # Errors
    /// - [`JournalError::Encode`] if a value cannot be encoded (nothing is
    ///   committed);
    /// - [`JournalError::Storage`] if redb fails (the transaction is rolled back);
    /// - [`JournalError::Interrupted`] if the blocking thread panicked or was
    ///   cancelled, in which case the batch may or may not have landed.
    pub async fn commit<M: Serialize + Send + 'static, R: Serialize + Send + 'static>(
        &self,
        batch: JournalBatch<M, R>,
    ) -> Result<(), JournalError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.commit_blocking(batch))
            .await
            .map_err(|source| JournalError::Interrupted {
                path: self.inner.path.clone(),
                source,
            })?
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

impl Inner {
    fn commit_blocking<M: Serialize, R: Serialize>(
        &self,
        batch: JournalBatch<M, R>,
    ) -> Result<(), JournalError> {
        let encode = |what: &dyn Fn() -> String, result: serde_json::Result<Vec<u8>>| {
            result.map_err(|source| JournalError::Encode {
                path: self.path.clone(),
                what: what(),
                source,
            })
        };
        let meta = batch
            .meta
            .as_ref()
            .map(|m| encode(&|| "the meta value".to_owned(), serde_json::to_vec(m)))
            .transpose()?;
        let mut put = Vec::with_capacity(batch.put.len());
        for (key, record) in &batch.put {
            let value = encode(&|| format!("record {key:?}"), serde_json::to_vec(record))?;
            put.push((key.as_str(), value));
        }
        let format_on_disk = self.format_on_disk.load(Ordering::Acquire);
        let raise_format = format_on_disk < self.format;
        self.write(|txn| {
            if let Some(meta) = &meta {
                txn.open_table(META)?.insert(META_KEY, meta.as_slice())?;
            }
            let mut records = txn.open_table(RECORDS)?;
            for (key, value) in &put {
                records.insert(*key, value.as_slice())?;
            }
            for key in &batch.delete {
                records.remove(key.as_str())?;
            }
            if raise_format {
                txn.open_table(HEADER)?
                    .insert(FORMAT_KEY, self.format.to_string().as_str())?;
            }
            Ok(())
        })?;
        if raise_format {
            self.format_on_disk.fetch_max(self.format, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Runs `f` in a write transaction and commits it durably.
    fn write(
        &self,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<(), redb::Error>,
    ) -> Result<(), JournalError> {
        let storage = |source: redb::Error| JournalError::Storage {
            path: self.path.clone(),
            source: Box::new(source),
        };
        let txn = self.db.begin_write().map_err(|e| storage(e.into()))?;
        // Durability::Immediate is redb's default: commit returns after fsync.
        // An error drops `txn`, which aborts it.
        f(&txn).map_err(storage)?;
        txn.commit().map_err(|e| storage(e.into()))
    }
}

fn builder() -> Builder {
    let mut builder = Builder::new();
    builder.set_cache_size(CACHE_LEN_MAX_BYTES);
    builder
}

/// Names temporary files uniquely within this process.
static CREATE_SEQ: AtomicU64 = AtomicU64::new(0);

/// Makes a new journal at `path`: built under a temporary name, then linked
/// into place unless another process got there first.
fn create(path: &Path, kind: &str, format: u32) -> Result<(), JournalError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(JournalError::NoParent {
            path: path.to_owned(),
        });
    }
    let name = path
        .file_name()
        .map_or_else(|| "journal".into(), |n| n.to_string_lossy().into_owned());
    let tmp = parent.join(format!(
        ".{name}.creating-{}-{}",
        std::process::id(),
        CREATE_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = build_new(&tmp, path, kind, format);
    // Gone already when the link failed before the file existed.
    let _ = std::fs::remove_file(&tmp);
    result.map_err(|source| JournalError::Create {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

fn build_new(tmp: &Path, path: &Path, kind: &str, format: u32) -> Result<(), redb::Error> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)
        .map_err(redb::Error::Io)?;
    let db = builder().create_file(file)?;
    let txn = db.begin_write()?;
    {
        let mut header = txn.open_table(HEADER)?;
        header.insert(KIND_KEY, kind)?;
        header.insert(FORMAT_KEY, format.to_string().as_str())?;
        txn.open_table(META)?;
        txn.open_table(RECORDS)?;
    }
    txn.commit()?;
    // A clean close, so the first open needs no recovery.
    drop(db);
    match std::fs::hard_link(tmp, path) {
        Ok(()) => {}
        // Another process created it meanwhile; open theirs.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(redb::Error::Io(e)),
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    File::open(parent.unwrap_or(Path::new(".")))
        .and_then(|dir| dir.sync_all())
        .map_err(redb::Error::Io)
}

thread_local! {
    /// Set while this thread runs code whose panic is expected and caught.
    static PANIC_EXPECTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, catching a panic, without the panic hook printing it (and a
/// backtrace) first: the caller turns it into an error of its own, and a
/// refusal that is preceded by a panic message reads like a crash. Only
/// this thread's panic in `f` is kept quiet; every other panic is printed
/// as before.
fn quietly_catching<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static WRAPPED: std::sync::Once = std::sync::Once::new();
    WRAPPED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !PANIC_EXPECTED.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    PANIC_EXPECTED.with(|e| e.set(true));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    PANIC_EXPECTED.with(|e| e.set(false));
    caught
}

/// Opens a private in-memory copy of the file's bytes (recovering it as redb
/// would) and reads everything, so a bad file is refused before the real one
/// is opened for writing. Returns the header's format and the contents.
fn check_copy<M: DeserializeOwned, R: DeserializeOwned>(
    path: &Path,
    bytes: Vec<u8>,
    kind: &str,
    format: u32,
) -> Result<(u32, JournalContents<M, R>), JournalError> {
    let corrupt = |reason: &str, source: Option<redb::Error>| JournalError::Corrupt {
        path: path.to_owned(),
        reason: reason.to_owned(),
        source: source.map(Box::new),
    };
    let copy = Scratch(Mutex::new(bytes));
    // redb asserts on some damage (a file shorter than its header says)
    // rather than returning an error.
    let read = quietly_catching(|| {
        let db = builder()
            .create_with_backend(copy)
            .map_err(redb::Error::from)?;
        read_all(&db)
    });
    let raw = match read {
        Ok(Ok(raw)) => raw,
        Ok(Err(ReadError::Redb(e))) => return Err(corrupt(&e.to_string(), Some(e))),
        Ok(Err(ReadError::NoHeader)) => {
            return Err(corrupt("it is a redb file without a journal header", None));
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_owned());
            return Err(corrupt(
                &format!("redb gave up reading it: {message}"),
                None,
            ));
        }
    };
    if raw.kind != kind {
        return Err(JournalError::OtherKind {
            path: path.to_owned(),
            found: raw.kind,
            expected: kind.to_owned(),
        });
    }
    let found: u32 = raw.format.parse().map_err(|_| {
        corrupt(
            &format!("its header names format {:?}, not a number", raw.format),
            None,
        )
    })?;
    if found > format {
        return Err(JournalError::NewerFormat {
            path: path.to_owned(),
            found,
            supported: format,
        });
    }
    let undecodable = |what: String| {
        move |source| JournalError::Undecodable {
            path: path.to_owned(),
            what,
            source,
        }
    };
    let meta = raw
        .meta
        .map(|bytes| serde_json::from_slice(&bytes))
        .transpose()
        .map_err(undecodable("the meta value".to_owned()))?;
    let mut records = BTreeMap::new();
    for (key, bytes) in raw.records {
        let record =
            serde_json::from_slice(&bytes).map_err(undecodable(format!("record {key:?}")))?;
        records.insert(key, record);
    }
    Ok((found, JournalContents { meta, records }))
}

/// A journal's tables, undecoded.
struct Raw {
    kind: String,
    format: String,
    meta: Option<Vec<u8>>,
    records: Vec<(String, Vec<u8>)>,
}

enum ReadError {
    Redb(redb::Error),
    NoHeader,
}

impl<E: Into<redb::Error>> From<E> for ReadError {
    fn from(e: E) -> Self {
        ReadError::Redb(e.into())
    }
}

fn read_all(db: &Database) -> Result<Raw, ReadError> {
    let txn = db.begin_read()?;
    let header = match txn.open_table(HEADER) {
        Ok(t) => t,
        Err(TableError::TableDoesNotExist(_)) => return Err(ReadError::NoHeader),
        Err(e) => return Err(e.into()),
    };
    let get = |key: &str| -> Result<String, ReadError> {
        Ok(header
            .get(key)?
            .ok_or(ReadError::NoHeader)?
            .value()
            .to_owned())
    };
    let kind = get(KIND_KEY)?;
    let format = get(FORMAT_KEY)?;
    let meta = match txn.open_table(META) {
        Ok(t) => t.get(META_KEY)?.map(|v| v.value().to_vec()),
        Err(TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    let mut records = Vec::new();
    match txn.open_table(RECORDS) {
        Ok(t) => {
            for entry in t.iter()? {
                let (key, value) = entry?;
                records.push((key.value().to_owned(), value.value().to_vec()));
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Raw {
        kind,
        format,
        meta,
        records,
    })
}

/// A redb storage backend over a private copy of a file's bytes.
#[derive(Debug)]
struct Scratch(Mutex<Vec<u8>>);

impl Scratch {
    fn bytes(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A panic while holding the lock leaves plain bytes, still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn range(offset: u64, len: usize, total: usize) -> io::Result<std::ops::Range<usize>> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start
            .checked_add(len)
            .filter(|end| *end <= total)
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        Ok(start..end)
    }
}

impl StorageBackend for Scratch {
    fn len(&self) -> io::Result<u64> {
        Ok(self.bytes().len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let bytes = self.bytes();
        let range = Self::range(offset, out.len(), bytes.len())?;
        out.copy_from_slice(&bytes[range]);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::OutOfMemory)?;
        self.bytes().resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut bytes = self.bytes();
        let range = Self::range(offset, data.len(), bytes.len())?;
        bytes[range].copy_from_slice(data);
        Ok(())
    }
}
