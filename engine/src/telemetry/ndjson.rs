//! A `telemetry.ndjson` file sink: one JSON object per line, written off the caller's thread.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

/// The file name the sink writes inside its directory.
pub const NDJSON_FILE_NAME: &str = "telemetry.ndjson";

/// Most rotated files an [`NdjsonSink`] keeps.
const FILES_KEPT_MAX: usize = 1000;

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
}

impl Default for NdjsonConfig {
    fn default() -> Self {
        Self {
            queue_len_max: 4096,
            line_len_max: 1024 * 1024,
            file_len_max: 64 * 1024 * 1024,
            files_kept: 3,
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
    /// Writing or flushing the file failed; the writer has stopped.
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
    /// The writer has stopped (after a write error).
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
    /// # Errors
    /// An invalid config or a file that cannot be opened.
    pub async fn open(dir: &Path, config: &NdjsonConfig) -> Result<Self, NdjsonError> {
        config.validate()?;
        let path = dir.join(NDJSON_FILE_NAME);
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await
            .map_err(|source| NdjsonError::Open {
                path: path.clone(),
                source,
            })?;
        let len = file.metadata().await.map_or(0, |m| m.len());
        let (tx, rx) = mpsc::channel(config.queue_len_max);
        let counters = Arc::new(Counters::default());
        let path = Arc::new(path);
        let rotation = Rotation {
            len,
            file_len_max: config.file_len_max,
            files_kept: config.files_kept,
        };
        tokio::spawn(write_lines(
            file,
            rx,
            counters.clone(),
            path.clone(),
            rotation,
        ));
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

    /// Waits until every line queued so far is written and flushed.
    ///
    /// # Errors
    /// The writer stopped or the flush failed.
    pub async fn flush(&self) -> Result<(), NdjsonError> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Command::Flush(ack))
            .await
            .map_err(|_| NdjsonError::Stopped)?;
        done.await.map_err(|_| NdjsonError::Stopped)?
    }

    /// Lines written to the file so far.
    #[must_use]
    pub fn written(&self) -> u64 {
        self.counters.written.load(Ordering::Relaxed)
    }

    /// Lines dropped (queue full, too long, writer stopped).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }
}

/// The live file's size and when to rotate it.
struct Rotation {
    len: u64,
    file_len_max: u64,
    files_kept: usize,
}

/// `telemetry.ndjson.N`.
fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// Shifts the rotated files by one (dropping the oldest), moves the live
/// file to `.1`, and opens a fresh live file.
async fn rotate(path: &Path, files_kept: usize) -> io::Result<tokio::fs::File> {
    if files_kept == 0 {
        tokio::fs::remove_file(path).await?;
    } else {
        let _ = tokio::fs::remove_file(rotated(path, files_kept)).await;
        for n in (1..files_kept).rev() {
            match tokio::fs::rename(rotated(path, n), rotated(path, n + 1)).await {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
        tokio::fs::rename(path, rotated(path, 1)).await?;
    }
    tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
}

async fn write_lines(
    file: tokio::fs::File,
    mut rx: mpsc::Receiver<Command>,
    counters: Arc<Counters>,
    path: Arc<PathBuf>,
    mut rotation: Rotation,
) {
    let mut out = tokio::io::BufWriter::new(file);
    let fail = |source| NdjsonError::Write {
        path: path.to_path_buf(),
        source,
    };
    while let Some(command) = rx.recv().await {
        let result = match command {
            Command::Line(line)
                if rotation.len > 0
                    && rotation.len.saturating_add(line.len() as u64) > rotation.file_len_max =>
            {
                let rotated = match out.flush().await {
                    Ok(()) => rotate(&path, rotation.files_kept).await,
                    Err(e) => Err(e),
                };
                match rotated {
                    Ok(file) => {
                        out = tokio::io::BufWriter::new(file);
                        rotation.len = 0;
                        write_line(&mut out, &line, &rx, &counters, &mut rotation)
                            .await
                            .map_err(fail)
                    }
                    Err(source) => Err(fail(source)),
                }
            }
            Command::Line(line) => write_line(&mut out, &line, &rx, &counters, &mut rotation)
                .await
                .map_err(fail),
            Command::Flush(ack) => {
                let flushed = out.flush().await.map_err(fail);
                let failed = flushed.as_ref().err().map(ToString::to_string);
                let _ = ack.send(flushed);
                match failed {
                    Some(error) => {
                        tracing::error!(%error, "ndjson sink stopped");
                        return;
                    }
                    None => Ok(()),
                }
            }
        };
        if let Err(error) = result {
            tracing::error!(%error, "ndjson sink stopped");
            return;
        }
    }
    let _ = out.flush().await;
}

async fn write_line(
    out: &mut tokio::io::BufWriter<tokio::fs::File>,
    line: &[u8],
    rx: &mpsc::Receiver<Command>,
    counters: &Counters,
    rotation: &mut Rotation,
) -> io::Result<()> {
    out.write_all(line).await?;
    counters.written.fetch_add(1, Ordering::Relaxed);
    rotation.len = rotation.len.saturating_add(line.len() as u64);
    // Flush whenever the queue runs dry so the file trails the events by
    // at most one burst.
    if rx.is_empty() {
        out.flush().await?;
    }
    Ok(())
}
