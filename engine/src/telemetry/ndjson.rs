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

/// Limits of an [`NdjsonSink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NdjsonConfig {
    /// Lines queued for the writer before new ones are dropped (and counted).
    pub queue_len_max: usize,
    /// Longest line accepted, in bytes, newline included.
    pub line_len_max: usize,
}

impl Default for NdjsonConfig {
    fn default() -> Self {
        Self {
            queue_len_max: 4096,
            line_len_max: 1024 * 1024,
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

/// Appends JSON lines to `<dir>/telemetry.ndjson`; cheap to clone.
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
        let (tx, rx) = mpsc::channel(config.queue_len_max);
        let counters = Arc::new(Counters::default());
        let path = Arc::new(path);
        tokio::spawn(write_lines(file, rx, counters.clone(), path.clone()));
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

async fn write_lines(
    file: tokio::fs::File,
    mut rx: mpsc::Receiver<Command>,
    counters: Arc<Counters>,
    path: Arc<PathBuf>,
) {
    let mut out = tokio::io::BufWriter::new(file);
    let fail = |source| NdjsonError::Write {
        path: path.to_path_buf(),
        source,
    };
    while let Some(command) = rx.recv().await {
        let result = match command {
            Command::Line(line) => match out.write_all(&line).await {
                Ok(()) => {
                    counters.written.fetch_add(1, Ordering::Relaxed);
                    // Flush whenever the queue runs dry so the file trails
                    // the events by at most one burst.
                    if rx.is_empty() {
                        out.flush().await.map_err(fail)
                    } else {
                        Ok(())
                    }
                }
                Err(source) => Err(fail(source)),
            },
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
