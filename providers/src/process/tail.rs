//! Follows an agent's log from its first byte and turns protocol lines into a session stream.

use super::os::{self, AgentIdentity};
use crate::kit::{RecentOutput, parse_agent_line};
use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use swactor_provisioning::{BootstrapEvent, BootstrapStage, SessionId};
use tokio::sync::{oneshot, watch};

/// Longest agent output line kept; longer ones cannot be protocol lines and are skipped.
const LINE_LEN_MAX: usize = 64 * 1024;
/// Bytes read from the log per read call.
const READ_CHUNK_LEN: usize = 64 * 1024;

/// How a tail learns that the agent exited.
pub(super) enum Exit {
    /// This process spawned it: a reaper thread publishes its exit status.
    Child(watch::Receiver<Option<String>>),
    /// Another process (an earlier daemon) spawned it: poll its pid.
    Adopted {
        /// The agent's pid.
        pid: i32,
        /// What the pid must still look like to be our agent.
        who: AgentIdentity,
    },
}

impl Exit {
    /// How the agent ended (`exited with code 3`, `was killed by signal 9
    /// (SIGKILL)`), once it has.
    fn status(&mut self) -> Option<String> {
        match self {
            Self::Child(rx) => {
                if let Some(status) = rx.borrow().clone() {
                    return Some(status);
                }
                // A reaper that vanished without a status cannot report one.
                rx.has_changed()
                    .is_err()
                    .then(|| "ended with an unknown status".to_owned())
            }
            Self::Adopted { pid, who } => (os::leader(*pid, who) != os::Leader::Ours).then(|| {
                "ended with an unknown status (it was not started by this process)".to_owned()
            }),
        }
    }

    /// Resolves when the status may have changed; never for a polled pid.
    async fn changed(&mut self) {
        match self {
            Self::Child(rx) => {
                if rx.changed().await.is_err() {
                    // The next `status` reports the vanished reaper; until
                    // then, do not spin.
                    std::future::pending::<()>().await;
                }
            }
            Self::Adopted { .. } => std::future::pending().await,
        }
    }
}

/// One stream's follower of one agent log.
pub(super) struct Tail {
    /// The session, for logs.
    pub(super) session: SessionId,
    /// The agent's log file.
    pub(super) log: PathBuf,
    /// How the agent's exit is noticed.
    pub(super) exit: Exit,
    /// Set before the provider signals the agent, so its exit reads as a cancel.
    pub(super) cancelled: Arc<AtomicBool>,
    /// How often the log and a polled pid are checked.
    pub(super) poll: Duration,
    /// The stream.
    pub(super) tx: swactor_engine::stream::Sender<BootstrapEvent>,
    /// Resolves (with an error) when a newer stream replaces this one or the
    /// provider is dropped.
    pub(super) stop: oneshot::Receiver<()>,
    /// The last lines of the agent's own output, for the reason of an exit
    /// it did not announce (a crash, an argument it refused).
    pub(super) recent: RecentOutput,
}

/// Why a tail ended without finishing its stream.
struct Stopped;

impl Tail {
    /// Streams the log until the agent exits, then ends the stream.
    pub(super) async fn run(mut self) {
        let mut reader = LineReader::new(self.log.clone());
        let mut failed = false;
        let _ = self.follow(&mut reader, &mut failed).await;
    }

    async fn follow(&mut self, reader: &mut LineReader, failed: &mut bool) -> Result<(), Stopped> {
        loop {
            // Look at the exit before reading, so that once it is seen the
            // read that follows has everything the agent wrote.
            let status = self.exit.status();
            self.forward(reader, failed, status.is_some()).await?;
            if let Some(status) = status {
                let last = if *failed || self.cancelled.load(Ordering::SeqCst) {
                    BootstrapEvent::Closed
                } else {
                    BootstrapEvent::Failed {
                        stage: BootstrapStage::AgentLost,
                        reason: self.exit_reason(&status),
                    }
                };
                tracing::debug!(session = %self.session.0, ?last, "agent exited");
                return self.send(last).await;
            }
            tokio::select! {
                () = tokio::time::sleep(self.poll) => {}
                () = self.exit.changed() => {}
                _ = &mut self.stop => return Err(Stopped),
                () = self.tx.closed() => return Err(Stopped),
            }
        }
    }

    /// Sends the events of every new complete line (and, at the end, of a
    /// last line without a newline).
    async fn forward(
        &mut self,
        reader: &mut LineReader,
        failed: &mut bool,
        at_end: bool,
    ) -> Result<(), Stopped> {
        loop {
            let lines = match reader.read_lines(at_end) {
                Ok(lines) => lines,
                Err(e) => {
                    // The agent keeps running and writing; try again next poll.
                    tracing::warn!(session = %self.session.0, log = %self.log.display(), error = %e, "cannot read agent log");
                    return Ok(());
                }
            };
            if lines.is_empty() {
                return Ok(());
            }
            for line in lines {
                match parse_agent_line(&line) {
                    Some(event) => {
                        *failed |= matches!(event, BootstrapEvent::Failed { .. });
                        self.send(event).await?;
                    }
                    None => {
                        tracing::debug!(session = %self.session.0, line, "agent output");
                        self.recent.remember(&line);
                    }
                }
            }
        }
    }

    /// Why the agent's stream ends in a failure: how it ended (a clause of
    /// [`crate::exit::Ended`]) and what it last wrote.
    fn exit_reason(&self, status: &str) -> String {
        format!("agent {status}{}", self.recent.clause())
    }

    async fn send(&mut self, event: BootstrapEvent) -> Result<(), Stopped> {
        tokio::select! {
            sent = self.tx.send(event) => sent.map_err(|_| Stopped),
            _ = &mut self.stop => Err(Stopped),
        }
    }
}

/// Reads a growing file line by line, keeping at most one partial line.
struct LineReader {
    path: PathBuf,
    file: Option<File>,
    /// The read buffer, reused across reads.
    chunk: Box<[u8]>,
    partial: Vec<u8>,
    /// True while dropping the rest of an overlong line.
    skipping: bool,
}

impl LineReader {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            file: None,
            chunk: vec![0; READ_CHUNK_LEN].into_boxed_slice(),
            partial: Vec::new(),
            skipping: false,
        }
    }

    /// The complete lines of the next chunk; with `at_end`, once the file is
    /// exhausted, also the unterminated last line. Empty when nothing is new.
    fn read_lines(&mut self, at_end: bool) -> io::Result<Vec<String>> {
        let file = match &mut self.file {
            Some(file) => file,
            None => match File::open(&self.path) {
                Ok(file) => self.file.insert(file),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(e) => return Err(e),
            },
        };
        let mut lines = Vec::new();
        // Chunks without a line end (an overlong line) are consumed here
        // rather than reported as "nothing new".
        while lines.is_empty() {
            let n = file.read(&mut self.chunk)?;
            if n == 0 {
                if at_end && !self.partial.is_empty() {
                    if !self.skipping {
                        lines.push(String::from_utf8_lossy(&self.partial).into_owned());
                    }
                    self.partial.clear();
                    self.skipping = false;
                }
                break;
            }
            for piece in self.chunk[..n].split_inclusive(|b| *b == b'\n') {
                let (body, complete) = match piece.strip_suffix(b"\n") {
                    Some(body) => (body, true),
                    None => (piece, false),
                };
                if !self.skipping {
                    self.partial.extend_from_slice(body);
                    if self.partial.len() > LINE_LEN_MAX {
                        self.partial.clear();
                        self.skipping = true;
                    }
                }
                if complete {
                    if !self.skipping {
                        lines.push(String::from_utf8_lossy(&self.partial).into_owned());
                    }
                    self.partial.clear();
                    self.skipping = false;
                }
            }
        }
        Ok(lines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_reader_yields_whole_lines_skips_overlong_ones_and_flushes_the_last_at_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.log");
        let mut f = File::create(&path).unwrap();
        let mut reader = LineReader::new(path);
        assert!(reader.read_lines(false).unwrap().is_empty());
        write!(f, "one\ntw").unwrap();
        assert_eq!(reader.read_lines(false).unwrap(), ["one"]);
        write!(f, "o\n{}\nthree", "x".repeat(LINE_LEN_MAX + 1)).unwrap();
        assert_eq!(reader.read_lines(false).unwrap(), ["two"]);
        assert!(reader.read_lines(false).unwrap().is_empty());
        assert_eq!(reader.read_lines(true).unwrap(), ["three"]);
    }
}
