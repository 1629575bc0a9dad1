//! Follows a container's log from its latest start and turns the agent's
//! protocol lines into a session stream.

use crate::kit::{RecentOutput, parse_agent_line};
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::query_parameters::LogsOptions;
use futures_util::StreamExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use swactor_provisioning::{BootstrapEvent, BootstrapStage, SessionId};
use tokio::sync::oneshot;

/// Longest agent output line kept; longer ones cannot be protocol lines and are skipped.
const LINE_LEN_MAX: usize = 64 * 1024;
/// Times a broken log stream of a running container is opened again.
const REOPENS_MAX: u32 = 10;
/// Pause before opening a broken log stream again.
const REOPEN_PAUSE: Duration = Duration::from_millis(500);

/// How many more times, and how far apart, the log of a container that
/// stopped without a line is read again before it is said to be empty: for
/// up to two seconds, as the engine, on a loaded machine, has been seen to
/// take longer than half a second to copy a dying agent's last words (only
/// an agent that dies silent waits this long to be reported).
const LATE_LOG_LOOKS: u32 = 20;
const LATE_LOG_PAUSE: Duration = Duration::from_millis(100);

/// A point in time as the engine writes it (RFC 3339 in UTC): the text up to
/// the whole second, which orders correctly as text in this fixed form, and
/// the nanoseconds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Stamp(String, u32);

impl Stamp {
    /// Parses `2026-11-30T18:39:39.123456789Z` (any number of fraction digits, or none).
    pub(super) fn parse(text: &str) -> Option<Self> {
        let body = text.strip_suffix('Z')?;
        let (secs, frac) = body.split_once('.').unwrap_or((body, ""));
        if secs.len() != 19 || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let nanos = if frac.is_empty() {
            0
        } else {
            frac.parse::<u32>().ok()? * 10u32.pow(9 - frac.len() as u32)
        };
        Some(Self(secs.to_owned(), nanos))
    }
}

/// One stream's follower of one container start.
pub(super) struct Follow {
    pub(super) docker: Docker,
    /// The container.
    pub(super) name: String,
    /// The session, for logs.
    pub(super) session: SessionId,
    /// The start this session is; log entries from before it are an earlier session's.
    pub(super) started_at: String,
    /// Set before the provider stops or removes the container on purpose.
    pub(super) cancelled: Arc<AtomicBool>,
    /// The stream.
    pub(super) tx: swactor_engine::stream::Sender<BootstrapEvent>,
    /// Resolves when a newer stream replaces this one or the provider is dropped.
    pub(super) stop: oneshot::Receiver<()>,
}

/// Why a follower ended without finishing its stream.
struct Stopped;

/// What has been read of the log so far.
#[derive(Default)]
struct Reading {
    /// The stamp of the last entry forwarded: a reopened stream skips up to it.
    last: Option<Stamp>,
    /// Incomplete lines of stdout and stderr.
    partial: [Vec<u8>; 2],
    /// Dropping the rest of an overlong line, per output.
    skipping: [bool; 2],
    /// The agent announced its failure.
    failed: bool,
    /// The last lines of the agent's own output.
    recent: RecentOutput,
}

impl Follow {
    /// Streams the log until the container stops, then ends the stream.
    pub(super) async fn run(mut self) {
        let _ = self.follow().await;
    }

    async fn follow(&mut self) -> Result<(), Stopped> {
        let since = Stamp::parse(&self.started_at);
        let mut reading = Reading::default();
        let mut reopens = 0;
        loop {
            let broken = self.read_log(&mut reading, since.as_ref(), true).await?;
            let last = match self.docker.inspect_container(&self.name, None).await {
                Ok(c) => {
                    let state = c.state.unwrap_or_default();
                    let same_start = state.started_at.as_deref() == Some(&self.started_at);
                    if same_start && state.running == Some(true) {
                        // The log stream broke while the agent runs on.
                        reopens += 1;
                        if reopens <= REOPENS_MAX {
                            tracing::debug!(session = %self.session.0, ?broken, "reopening the container's log");
                            self.pause(REOPEN_PAUSE).await?;
                            continue;
                        }
                        BootstrapEvent::Failed {
                            stage: BootstrapStage::AgentLost,
                            reason: format!(
                                "cannot follow the log of container {}: {}",
                                self.name,
                                broken.unwrap_or_else(|| "it keeps ending".to_owned())
                            ),
                        }
                    } else if self.cancelled.load(Ordering::SeqCst) || reading.failed {
                        BootstrapEvent::Closed
                    } else if !same_start {
                        BootstrapEvent::Failed {
                            stage: BootstrapStage::AgentLost,
                            reason: format!(
                                "container {} was started again by something else",
                                self.name
                            ),
                        }
                    } else {
                        // The engine may end a followed log before the last
                        // lines of an agent that died at once: what it holds
                        // now is read once more (entries already read are
                        // skipped by their stamps).
                        let _ = self.read_log(&mut reading, since.as_ref(), false).await?;
                        // The engine copies a container's output into its
                        // log on its own time: right after an agent that
                        // died at once, on a busy machine, the log may still
                        // be empty. An agent seen to write nothing is given
                        // a few more looks before it is said to have.
                        let mut looks = 0;
                        while reading.last.is_none() && looks < LATE_LOG_LOOKS {
                            looks += 1;
                            self.pause(LATE_LOG_PAUSE).await?;
                            let _ = self.read_log(&mut reading, since.as_ref(), false).await?;
                        }
                        let oom = state.oom_killed == Some(true);
                        let code = state.exit_code.unwrap_or(-1);
                        if reading.failed {
                            BootstrapEvent::Closed
                        } else {
                            BootstrapEvent::Failed {
                                stage: BootstrapStage::AgentLost,
                                reason: exit_reason(&self.name, code, oom, &reading.recent),
                            }
                        }
                    }
                }
                Err(e) if super::status(&e) == Some(404) => {
                    if self.cancelled.load(Ordering::SeqCst) || reading.failed {
                        BootstrapEvent::Closed
                    } else {
                        BootstrapEvent::Failed {
                            stage: BootstrapStage::AgentLost,
                            reason: format!("container {} was removed", self.name),
                        }
                    }
                }
                Err(e) => {
                    reopens += 1;
                    if reopens <= REOPENS_MAX {
                        self.pause(REOPEN_PAUSE).await?;
                        continue;
                    }
                    BootstrapEvent::Failed {
                        stage: BootstrapStage::AgentLost,
                        reason: format!("cannot inspect container {}: {e}", self.name),
                    }
                }
            };
            tracing::debug!(session = %self.session.0, ?last, "container stopped");
            return self.send(last).await;
        }
    }

    /// Reads the log to its end (with `follow`, once the container stopped;
    /// without, what the engine holds now) or until it breaks; returns why
    /// it broke.
    async fn read_log(
        &mut self,
        reading: &mut Reading,
        since: Option<&Stamp>,
        follow: bool,
    ) -> Result<Option<String>, Stopped> {
        let options = LogsOptions {
            follow,
            stdout: true,
            stderr: true,
            timestamps: true,
            ..Default::default()
        };
        let mut logs = self.docker.logs(&self.name, Some(options));
        loop {
            let item = tokio::select! {
                item = logs.next() => item,
                _ = &mut self.stop => return Err(Stopped),
                () = self.tx.closed() => return Err(Stopped),
            };
            match item {
                None => {
                    self.flush(reading).await?;
                    return Ok(None);
                }
                Some(Err(e)) => return Ok(Some(e.to_string())),
                Some(Ok(output)) => {
                    let (which, message) = match output {
                        LogOutput::StdErr { message } => (1, message),
                        LogOutput::StdOut { message }
                        | LogOutput::Console { message }
                        | LogOutput::StdIn { message } => (0, message),
                    };
                    let text = message.as_ref();
                    let (stamp, body) = match text.iter().position(|b| *b == b' ') {
                        Some(at) => (
                            std::str::from_utf8(&text[..at]).ok().and_then(Stamp::parse),
                            &text[at + 1..],
                        ),
                        None => (None, text),
                    };
                    if let Some(stamp) = &stamp {
                        // An earlier start's output, or an entry an earlier
                        // stream already forwarded.
                        if since.is_some_and(|s| stamp < s)
                            || reading.last.as_ref().is_some_and(|l| stamp <= l)
                        {
                            continue;
                        }
                        reading.last = Some(stamp.clone());
                    }
                    self.take(reading, which, body).await?;
                }
            }
        }
    }

    /// Adds `body` to output `which`'s partial line and forwards the lines it completes.
    async fn take(
        &mut self,
        reading: &mut Reading,
        which: usize,
        body: &[u8],
    ) -> Result<(), Stopped> {
        for piece in body.split_inclusive(|b| *b == b'\n') {
            let (part, complete) = match piece.strip_suffix(b"\n") {
                Some(part) => (part, true),
                None => (piece, false),
            };
            if !reading.skipping[which] {
                reading.partial[which].extend_from_slice(part);
                if reading.partial[which].len() > LINE_LEN_MAX {
                    reading.partial[which].clear();
                    reading.skipping[which] = true;
                }
            }
            if complete {
                let line = std::mem::take(&mut reading.partial[which]);
                if !std::mem::take(&mut reading.skipping[which]) {
                    self.line(reading, &String::from_utf8_lossy(&line)).await?;
                }
            }
        }
        Ok(())
    }

    /// Forwards the unterminated last lines once the log has ended.
    async fn flush(&mut self, reading: &mut Reading) -> Result<(), Stopped> {
        for which in 0..2 {
            let line = std::mem::take(&mut reading.partial[which]);
            if !std::mem::take(&mut reading.skipping[which]) && !line.is_empty() {
                self.line(reading, &String::from_utf8_lossy(&line)).await?;
            }
        }
        Ok(())
    }

    async fn line(&mut self, reading: &mut Reading, line: &str) -> Result<(), Stopped> {
        match parse_agent_line(line) {
            Some(event) => {
                reading.failed |= matches!(event, BootstrapEvent::Failed { .. });
                self.send(event).await
            }
            None => {
                tracing::debug!(session = %self.session.0, line, "agent output");
                reading.recent.remember(line);
                Ok(())
            }
        }
    }

    async fn send(&mut self, event: BootstrapEvent) -> Result<(), Stopped> {
        tokio::select! {
            sent = self.tx.send(event) => sent.map_err(|_| Stopped),
            _ = &mut self.stop => Err(Stopped),
        }
    }

    async fn pause(&mut self, pause: Duration) -> Result<(), Stopped> {
        tokio::select! {
            () = tokio::time::sleep(pause) => Ok(()),
            _ = &mut self.stop => Err(Stopped),
            () = self.tx.closed() => Err(Stopped),
        }
    }
}

/// Why a container's stream ends in a failure: its exit code, whether the
/// kernel killed it for memory, and what it last wrote.
pub(super) fn exit_reason(
    name: &str,
    code: i64,
    oom_killed: bool,
    recent: &RecentOutput,
) -> String {
    let oom = if oom_killed {
        " (OOMKilled: it ran out of its memory limit; raise `memory_mb`)"
    } else {
        ""
    };
    // Docker gives a container killed by a signal the shell's code for it.
    let ended = i32::try_from(code).map_or_else(
        |_| format!("exited with code {code}"),
        |code| crate::exit::Ended::from_shell(code).clause(),
    );
    format!("container {name} {ended}{oom}{}", recent.clause())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_stamps_order_by_time_whatever_their_fraction_digits() {
        let a = Stamp::parse("2026-11-30T18:39:39.1Z").unwrap();
        let b = Stamp::parse("2026-11-30T18:39:39.099999999Z").unwrap();
        let c = Stamp::parse("2026-11-30T18:39:40Z").unwrap();
        assert_eq!(a.1, 100_000_000);
        assert!(b < a && a < c);
        for bad in [
            "",
            "2026-11-30T18:39:39",
            "2026-11-30T18:39:39.x1Z",
            "0001Z",
        ] {
            assert_eq!(Stamp::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_exit_reason_names_the_code_the_oom_kill_and_the_last_output() {
        let mut recent = RecentOutput::default();
        assert_eq!(
            exit_reason("c", 137, true, &recent),
            "container c was killed by signal 9 (SIGKILL) (OOMKilled: it ran out of its memory limit; raise `memory_mb`) (it wrote nothing else)"
        );
        recent.remember("error: \u{1b}[1munexpected\u{1b}[0m argument\r");
        recent.remember("  ");
        assert_eq!(
            exit_reason("c", 2, false, &recent),
            "container c exited with code 2; its last output: error: unexpected argument"
        );
    }
}
