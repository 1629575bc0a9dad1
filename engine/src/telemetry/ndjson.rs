//! A `telemetry.ndjson` file sink: one JSON object per line, written off the caller's thread.

use std::future::Future;
use std::io::{self, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// The file name the sink writes inside its directory.
pub const NDJSON_FILE_NAME: &str = "telemetry.ndjson";

/// Most rotated files an [`NdjsonSink`] keeps.
const FILES_KEPT_MAX: usize = 1000;

/// The wait before the first try to reopen the file after a write error;
/// each try that fails doubles it, up to [`NdjsonConfig::reopen_after_max`].
const REOPEN_AFTER_MIN: Duration = Duration::from_millis(100);

/// Limits of an [`NdjsonSink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NdjsonConfig {
    /// Lines queued for the writer before new ones are dropped (and counted).
    pub queue_len_max: usize,
    /// Longest line accepted, in bytes, newline included.
    pub line_len_max: usize,
    /// Size at which the file is rotated, in bytes: a line that would take
    /// it past this starts a new file (the old one becomes `….ndjson.1`).
    pub file_len_max: u64,
    /// Rotated files kept besides the live one (`….ndjson.1` is the newest);
    /// 0 keeps none (a full file is simply started afresh).
    pub files_kept: usize,
    /// Longest wait between two tries to reopen the file after a write
    /// error (a full disk): the first comes 100 ms after the error, and each
    /// one that fails doubles the wait up to this (at least 100 ms, at most
    /// an hour).
    pub reopen_after_max: Duration,
}

impl Default for NdjsonConfig {
    fn default() -> Self {
        Self {
            queue_len_max: 4096,
            line_len_max: 1024 * 1024,
            file_len_max: 64 * 1024 * 1024,
            files_kept: 3,
            reopen_after_max: Duration::from_secs(5),
        }
    }
}

impl NdjsonConfig {
    /// Checks the limits.
    ///
    /// # Errors
    /// [`NdjsonError::Config`] naming the field.
    pub fn validate(&self) -> Result<(), NdjsonError> {
        if self.queue_len_max == 0 || self.queue_len_max > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(NdjsonError::Config {
                field: "queue_len_max",
            });
        }
        if self.line_len_max < 2 {
            return Err(NdjsonError::Config {
                field: "line_len_max",
            });
        }
        // A file must hold at least one line, or every line would rotate.
        if self.file_len_max < self.line_len_max as u64 {
            return Err(NdjsonError::Config {
                field: "file_len_max",
            });
        }
        if self.files_kept > FILES_KEPT_MAX {
            return Err(NdjsonError::Config {
                field: "files_kept",
            });
        }
        // Tries closer together than the first one would only spin on a
        // disk that is still full; an hour apart they would hardly recover.
        if self.reopen_after_max < REOPEN_AFTER_MIN
            || self.reopen_after_max > Duration::from_secs(3600)
        {
            return Err(NdjsonError::Config {
                field: "reopen_after_max",
            });
        }
        Ok(())
    }
}

/// NDJSON sink failures.
#[derive(Debug, thiserror::Error)]
pub enum NdjsonError {
    /// A configuration field is out of range.
    #[error("invalid ndjson configuration: {field}")]
    Config {
        /// The field.
        field: &'static str,
    },
    /// The file could not be opened.
    #[error("cannot open {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Writing, flushing or reopening the file failed. The writer goes on:
    /// it drops (and counts) lines until it can write the file again, then
    /// writes a line saying how many it dropped.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The value has no JSON form.
    #[error("cannot encode value as json")]
    Encode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The line exceeds `line_len_max`; it was dropped.
    #[error("line of {len} bytes exceeds the limit of {line_len_max} bytes")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        line_len_max: usize,
    },
    /// The queue is full; the line was dropped.
    #[error("ndjson queue full; line dropped")]
    QueueFull,
    /// The writer has stopped (its runtime is shutting down).
    #[error("ndjson writer stopped")]
    Stopped,
}

enum Command {
    Line(Vec<u8>),
    Flush(oneshot::Sender<Result<(), NdjsonError>>),
}

#[derive(Debug, Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
}

/// Appends JSON lines to `<dir>/telemetry.ndjson`, rotating it at
/// `file_len_max` bytes; cheap to clone.
///
/// [`NdjsonSink::record`] is synchronous and never waits: the line goes on a
/// bounded queue drained by a writer task, and is dropped (and counted) when
/// the queue is full. The writer stops when the last clone is dropped.
///
/// # Errors while writing
/// A write that fails (a full disk) does not stop the writer. It closes the
/// file, drops (and counts) the lines that were not known to be written and
/// every line that comes until it can write again, and reopens the file
/// 100 ms later, then at doubling intervals up to
/// `reopen_after_max`. The first line it writes after reopening is
/// `{"at_ms":…,"gap":{"dropped":N,"since_ms":…,"error":"…"}}`; a line a failed
/// write cut short is removed first, so the file holds whole lines only.
#[derive(Clone, Debug)]
pub struct NdjsonSink {
    tx: mpsc::Sender<Command>,
    counters: Arc<Counters>,
    line_len_max: usize,
    path: Arc<PathBuf>,
}

impl NdjsonSink {
    /// Opens (appending, creating if needed) `dir/telemetry.ndjson` and starts the writer.
    ///
    /// A line cut short at the end of the file (by a daemon killed while
    /// writing it, or a full disk) is removed, so the next one starts a line
    /// of its own.
    ///
    /// # Errors
    /// An invalid config or a file that cannot be opened.
    pub async fn open(dir: &Path, config: &NdjsonConfig) -> Result<Self, NdjsonError> {
        Self::open_on(Disk, dir, config).await
    }

    async fn open_on<F: Files>(
        files: F,
        dir: &Path,
        config: &NdjsonConfig,
    ) -> Result<Self, NdjsonError> {
        config.validate()?;
        let path = dir.join(NDJSON_FILE_NAME);
        let (file, len) = files
            .open(&path, config.line_len_max)
            .await
            .map_err(|source| NdjsonError::Open {
                path: path.clone(),
                source,
            })?;
        let (tx, rx) = mpsc::channel(config.queue_len_max);
        let counters = Arc::new(Counters::default());
        let path = Arc::new(path);
        let writer = Writer {
            files,
            path: path.clone(),
            counters: counters.clone(),
            out: Some(BufWriter::new(file)),
            unflushed: Vec::new(),
            uncertain: Vec::new(),
            uncertain_from: 0,
            len,
            flushed_len: len,
            file_len_max: config.file_len_max,
            files_kept: config.files_kept,
            line_len_max: config.line_len_max,
            gap: None,
            reopen_at: Instant::now(),
            reopen_after: REOPEN_AFTER_MIN,
            reopen_after_max: config.reopen_after_max,
        };
        tokio::spawn(writer.run(rx));
        Ok(Self {
            tx,
            counters,
            line_len_max: config.line_len_max,
            path,
        })
    }

    /// The file being written.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues `value` as one JSON line. Never waits.
    ///
    /// # Errors
    /// The value cannot be encoded, is too long, the queue is full (the line
    /// is dropped and counted), or the writer stopped.
    pub fn record<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), NdjsonError> {
        let mut line =
            serde_json::to_vec(value).map_err(|source| NdjsonError::Encode { source })?;
        line.push(b'\n');
        if line.len() > self.line_len_max {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return Err(NdjsonError::TooLong {
                len: line.len(),
                line_len_max: self.line_len_max,
            });
        }
        self.tx.try_send(Command::Line(line)).map_err(|error| {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            match error {
                mpsc::error::TrySendError::Full(_) => NdjsonError::QueueFull,
                mpsc::error::TrySendError::Closed(_) => NdjsonError::Stopped,
            }
        })
    }

    /// Waits until every line queued so far is written and flushed. A
    /// writer that is waiting to reopen the file after a write error tries
    /// at once.
    ///
    /// # Errors
    /// The writer stopped, or the file cannot be written (the lines were
    /// dropped and counted; the writer goes on).
    pub async fn flush(&self) -> Result<(), NdjsonError> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Command::Flush(ack))
            .await
            .map_err(|_| NdjsonError::Stopped)?;
        done.await.map_err(|_| NdjsonError::Stopped)?
    }

    /// Lines written to the file so far (flushed to it, that is).
    #[must_use]
    pub fn written(&self) -> u64 {
        self.counters.written.load(Ordering::Relaxed)
    }

    /// Lines dropped (queue full, too long, the file could not be written).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }
}

/// Where the writer's bytes go: the filesystem ([`Disk`]), or in tests one
/// that fails on demand.
trait Files: Send + Sync + 'static {
    /// An open file, appended to.
    type File: AsyncWrite + Unpin + Send + 'static;

    /// Opens `path` for appending, creating it, removes a line cut short at
    /// its end (looking back at most `line_len_max` bytes), and returns the
    /// file with its length.
    fn open(
        &self,
        path: &Path,
        line_len_max: usize,
    ) -> impl Future<Output = io::Result<(Self::File, u64)>> + Send;

    /// Shifts the rotated files by one (dropping the oldest) and moves the
    /// live file to `.1` (or deletes it, with none kept).
    fn rotate(&self, path: &Path, files_kept: usize)
    -> impl Future<Output = io::Result<()>> + Send;
}

/// Most lines handed to the file between two flushes: a writer that never
/// finds its queue empty still flushes, and knows which lines a failed flush
/// may have lost.
const UNFLUSHED_LINES_MAX: usize = 1024;

/// The filesystem.
struct Disk;

impl Files for Disk {
    type File = tokio::fs::File;

    async fn open(&self, path: &Path, line_len_max: usize) -> io::Result<(Self::File, u64)> {
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .await?;
        let len = file.metadata().await?.len();
        let whole = whole_lines_len(&mut file, len, line_len_max).await?;
        if whole < len {
            file.set_len(whole).await?;
        }
        Ok((file, whole))
    }

    async fn rotate(&self, path: &Path, files_kept: usize) -> io::Result<()> {
        if files_kept == 0 {
            return tokio::fs::remove_file(path).await;
        }
        let _ = tokio::fs::remove_file(rotated(path, files_kept)).await;
        for n in (1..files_kept).rev() {
            match tokio::fs::rename(rotated(path, n), rotated(path, n + 1)).await {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
        tokio::fs::rename(path, rotated(path, 1)).await
    }
}

/// The length of `file` (`len` bytes) up to and including its last newline.
/// Only the last `window` bytes are searched, since no line is longer: a
/// file with no newline among them is not one of ours to cut, and is taken
/// whole.
async fn whole_lines_len(file: &mut tokio::fs::File, len: u64, window: usize) -> io::Result<u64> {
    let floor = len.saturating_sub(window as u64);
    let mut chunk = vec![0; window.min(8192)];
    let mut end = len;
    while end > floor {
        let start = end.saturating_sub(chunk.len() as u64).max(floor);
        let part = &mut chunk[..usize::try_from(end - start).unwrap_or(usize::MAX)];
        file.seek(SeekFrom::Start(start)).await?;
        file.read_exact(part).await?;
        if let Some(i) = part.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        if start == 0 {
            // The whole file is one line cut short.
            return Ok(0);
        }
        end = start;
    }
    Ok(len)
}

/// `telemetry.ndjson.N`.
fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// What the writer owes the file after a write error: the line saying how
/// many lines were lost since when, and why.
struct Gap {
    dropped: u64,
    since_ms: u64,
    error: String,
    kind: io::ErrorKind,
}

impl Gap {
    fn line(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Fields<'a> {
            dropped: u64,
            since_ms: u64,
            error: &'a str,
        }
        #[derive(Serialize)]
        struct Line<'a> {
            at_ms: u64,
            gap: Fields<'a>,
        }
        let line = Line {
            at_ms: super::wall_clock_ms(),
            gap: Fields {
                dropped: self.dropped,
                since_ms: self.since_ms,
                error: &self.error,
            },
        };
        // Two numbers and a string: nothing here can fail to encode.
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }
}

/// The writer task's state.
struct Writer<F: Files> {
    files: F,
    path: Arc<PathBuf>,
    counters: Arc<Counters>,
    /// The live file; `None` from a write error until it is reopened.
    out: Option<BufWriter<F::File>>,
    /// Where each line handed to `out` since its last flush ends in the
    /// file (at most [`UNFLUSHED_LINES_MAX`]): they are not known to be written.
    unflushed: Vec<u64>,
    /// After a write error, the ends of the lines that were not flushed,
    /// until the reopened file's length tells which of them it holds.
    uncertain: Vec<u64>,
    /// The file's length when they were written.
    uncertain_from: u64,
    /// The live file's size, with what `out` holds.
    len: u64,
    /// Its size at the last flush.
    flushed_len: u64,
    file_len_max: u64,
    files_kept: usize,
    line_len_max: usize,
    /// Set from a write error until the line saying so is written.
    gap: Option<Gap>,
    /// While `out` is `None`: when to try to reopen it.
    reopen_at: Instant,
    /// The wait after the next failure.
    reopen_after: Duration,
    reopen_after_max: Duration,
}

impl<F: Files> Writer<F> {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            let command = if self.out.is_some() {
                rx.recv().await
            } else {
                tokio::select! {
                    command = rx.recv() => command,
                    () = tokio::time::sleep_until(self.reopen_at) => {
                        self.reopen().await;
                        continue;
                    }
                }
            };
            match command {
                None => break,
                Some(Command::Line(line)) => {
                    self.line(&line).await;
                    // Flush whenever the queue runs dry so the file trails
                    // the events by at most one burst.
                    if rx.is_empty() && self.out.is_some() {
                        let _ = self.flush().await;
                    }
                }
                Some(Command::Flush(ack)) => {
                    if self.out.is_none() {
                        self.reopen().await;
                    }
                    let _ = ack.send(self.flush().await);
                }
            }
        }
        if self.out.is_some() {
            let _ = self.flush().await;
        }
    }

    /// Writes one line, or drops it while the file cannot be written.
    async fn line(&mut self, line: &[u8]) {
        let Some(out) = self.out.take() else {
            self.lose(1);
            return;
        };
        match self.write(out, line).await {
            Ok(out) => {
                self.out = Some(out);
                self.unflushed.push(self.len);
                if self.unflushed.len() >= UNFLUSHED_LINES_MAX {
                    let _ = self.flush().await;
                }
            }
            Err(error) => self.fail(&error, 1),
        }
    }

    /// Hands `line` to `out`, first rotating the file if the line would
    /// take it past its limit; returns the file to go on with.
    async fn write(
        &mut self,
        mut out: BufWriter<F::File>,
        line: &[u8],
    ) -> io::Result<BufWriter<F::File>> {
        if self.len > 0 && self.len.saturating_add(line.len() as u64) > self.file_len_max {
            out.flush().await?;
            self.flushed();
            drop(out);
            self.files.rotate(&self.path, self.files_kept).await?;
            let (file, len) = self.files.open(&self.path, self.line_len_max).await?;
            out = BufWriter::new(file);
            self.len = len;
            self.flushed_len = len;
        }
        out.write_all(line).await?;
        self.len = self.len.saturating_add(line.len() as u64);
        Ok(out)
    }

    /// Flushes the live file.
    async fn flush(&mut self) -> Result<(), NdjsonError> {
        let Some(out) = self.out.as_mut() else {
            let (kind, error) = self
                .gap
                .as_ref()
                .map_or((io::ErrorKind::Other, String::new()), |gap| {
                    (gap.kind, gap.error.clone())
                });
            return Err(NdjsonError::Write {
                path: self.path.to_path_buf(),
                source: io::Error::new(kind, error),
            });
        };
        match out.flush().await {
            Ok(()) => {
                self.flushed();
                Ok(())
            }
            Err(source) => {
                self.fail(&source, 0);
                Err(NdjsonError::Write {
                    path: self.path.to_path_buf(),
                    source,
                })
            }
        }
    }

    fn flushed(&mut self) {
        let lines = self.unflushed.len() as u64;
        self.unflushed.clear();
        self.counters.written.fetch_add(lines, Ordering::Relaxed);
        self.flushed_len = self.len;
    }

    fn lose(&mut self, lines: u64) {
        self.counters.dropped.fetch_add(lines, Ordering::Relaxed);
        if let Some(gap) = &mut self.gap {
            gap.dropped += lines;
        }
    }

    /// After `error`: closes the file, counts `lines` as dropped (those not
    /// flushed yet are counted once the file is reopened), and sets the time
    /// of the next try to reopen it.
    fn fail(&mut self, error: &io::Error, lines: u64) {
        self.out = None;
        if self.gap.is_none() {
            tracing::warn!(
                path = %self.path.display(),
                %error,
                "cannot write telemetry; its lines are dropped and counted until the file \
                 can be written again"
            );
            self.gap = Some(Gap {
                dropped: 0,
                since_ms: super::wall_clock_ms(),
                error: error.to_string(),
                kind: error.kind(),
            });
        }
        if !self.unflushed.is_empty() {
            // Nothing is written while the file is closed, so this is the
            // only batch waiting to be told apart.
            self.uncertain_from = self.flushed_len;
            self.uncertain.append(&mut self.unflushed);
        }
        self.lose(lines);
        self.reopen_at = Instant::now() + self.reopen_after;
        self.reopen_after = (self.reopen_after * 2).min(self.reopen_after_max);
    }

    /// Tries to reopen the file and write the line about the gap.
    async fn reopen(&mut self) {
        match self.try_reopen().await {
            Ok(out) => {
                self.out = Some(out);
                self.reopen_after = REOPEN_AFTER_MIN;
                if let Some(gap) = self.gap.take() {
                    tracing::info!(
                        path = %self.path.display(),
                        dropped = gap.dropped,
                        "writing telemetry again"
                    );
                }
            }
            Err(error) => self.fail(&error, 0),
        }
    }

    /// Counts the lines a failed write may have lost as written or dropped,
    /// from the length of the file reopened after it (its whole lines):
    /// those that end within it are there, assuming nothing else wrote it.
    fn settle(&mut self, len: u64) {
        let there = if len >= self.uncertain_from {
            self.uncertain.iter().take_while(|&&end| end <= len).count()
        } else {
            0
        };
        let lost = self.uncertain.len() - there;
        self.uncertain.clear();
        self.counters
            .written
            .fetch_add(there as u64, Ordering::Relaxed);
        self.lose(lost as u64);
    }

    async fn try_reopen(&mut self) -> io::Result<BufWriter<F::File>> {
        let (file, len) = self.files.open(&self.path, self.line_len_max).await?;
        self.settle(len);
        self.len = len;
        self.flushed_len = len;
        let mut out = BufWriter::new(file);
        if let Some(gap) = &self.gap {
            let line = gap.line();
            out = self.write(out, &line).await?;
        }
        out.flush().await?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Poll};

    /// The disk, with room for `room` more bytes (`None`: no limit); opens are counted.
    #[derive(Clone, Default)]
    struct Faulty {
        room: Arc<Mutex<Option<u64>>>,
        opens: Arc<AtomicUsize>,
    }

    impl Faulty {
        fn set_room(&self, room: Option<u64>) {
            *self.room.lock().unwrap() = room;
        }
    }

    struct FaultyFile {
        file: tokio::fs::File,
        room: Arc<Mutex<Option<u64>>>,
    }

    impl AsyncWrite for FaultyFile {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let room = *self.room.lock().unwrap();
            let len = match room {
                Some(0) => return Poll::Ready(Err(io::ErrorKind::StorageFull.into())),
                Some(room) => buf.len().min(usize::try_from(room).unwrap()),
                None => buf.len(),
            };
            let written = Pin::new(&mut self.file).poll_write(cx, &buf[..len]);
            if let (Poll::Ready(Ok(n)), Some(room)) = (&written, &mut *self.room.lock().unwrap()) {
                *room -= *n as u64;
            }
            written
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.file).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.file).poll_shutdown(cx)
        }
    }

    impl Files for Faulty {
        type File = FaultyFile;

        async fn open(&self, path: &Path, line_len_max: usize) -> io::Result<(FaultyFile, u64)> {
            self.opens.fetch_add(1, Ordering::Relaxed);
            let (file, len) = Disk.open(path, line_len_max).await?;
            // tokio's file reports a failed write at its next write or
            // flush; reaching the disk before answering keeps the room exact.
            let file = FaultyFile {
                file,
                room: self.room.clone(),
            };
            Ok((file, len))
        }

        async fn rotate(&self, path: &Path, files_kept: usize) -> io::Result<()> {
            Disk.rotate(path, files_kept).await
        }
    }

    fn lines(dir: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join(NDJSON_FILE_NAME))
            .unwrap()
            .lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?} is not json"))
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_disk_drops_and_counts_lines_then_writing_resumes_with_a_gap_line() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Faulty::default();
        let sink = NdjsonSink::open_on(disk.clone(), dir.path(), &NdjsonConfig::default())
            .await
            .unwrap();
        for n in 0..3 {
            sink.record(&serde_json::json!({ "n": n })).unwrap();
        }
        sink.flush().await.unwrap();
        // Each line is 8 bytes (`{"n":3}` and a newline): room for three
        // more and part of a fourth, which is cut short.
        disk.set_room(Some(30));
        for n in 3..8 {
            sink.record(&serde_json::json!({ "n": n })).unwrap();
        }
        let error = sink.flush().await.unwrap_err();
        assert!(matches!(error, NdjsonError::Write { .. }), "{error:?}");
        // Lines that come while the disk is full are dropped and counted.
        for n in 8..10 {
            sink.record(&serde_json::json!({ "n": n })).unwrap();
        }
        assert!(sink.flush().await.is_err(), "the disk is still full");
        // The reopened file told which lines made it: 3 to 5.
        assert_eq!((sink.written(), sink.dropped()), (6, 4));
        disk.set_room(None);
        tokio::time::sleep(Duration::from_secs(10)).await;
        for n in 10..12 {
            sink.record(&serde_json::json!({ "n": n })).unwrap();
        }
        sink.flush().await.unwrap();
        let lines = lines(dir.path());
        let ns: Vec<_> = lines.iter().filter_map(|l| l["n"].as_u64()).collect();
        assert_eq!(ns, [0, 1, 2, 3, 4, 5, 10, 11]);
        let gap = &lines[6]["gap"];
        assert_eq!(gap["dropped"], 4, "{}", lines[6]);
        assert!(
            gap["error"].as_str().unwrap().contains("no storage space"),
            "{gap}"
        );
        assert!(gap["since_ms"].as_u64().unwrap() <= lines[6]["at_ms"].as_u64().unwrap());
        assert_eq!((sink.written(), sink.dropped()), (8, 4));
    }

    #[tokio::test(start_paused = true)]
    async fn the_gap_line_comes_once_the_disk_has_room_even_without_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Faulty::default();
        let sink = NdjsonSink::open_on(disk.clone(), dir.path(), &NdjsonConfig::default())
            .await
            .unwrap();
        disk.set_room(Some(0));
        sink.record(&serde_json::json!({ "n": 0 })).unwrap();
        assert!(sink.flush().await.is_err());
        disk.set_room(None);
        // No flush and no line: the writer's own timer reopens the file.
        let deadline = Instant::now() + Duration::from_secs(10);
        while lines(dir.path()).is_empty() {
            assert!(Instant::now() < deadline, "no gap line in 10 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(lines(dir.path())[0]["gap"]["dropped"], 1);
    }

    #[tokio::test(start_paused = true)]
    async fn tries_to_reopen_a_full_disk_back_off_to_the_limit_instead_of_spinning() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Faulty::default();
        let config = NdjsonConfig {
            reopen_after_max: Duration::from_secs(2),
            ..NdjsonConfig::default()
        };
        let sink = NdjsonSink::open_on(disk.clone(), dir.path(), &config)
            .await
            .unwrap();
        disk.set_room(Some(0));
        sink.record(&serde_json::json!({ "n": 0 })).unwrap();
        assert!(sink.flush().await.is_err());
        let before = disk.opens.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let tries = disk.opens.load(Ordering::Relaxed) - before;
        // 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s, then every 2 s: 34 tries in a minute.
        assert!((30..=36).contains(&tries), "{tries} tries in 60 s");
        disk.set_room(None);
        sink.flush().await.unwrap();
        let lines = lines(dir.path());
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["gap"]["dropped"], 1);
    }
}
