//! Live progress of `up`: a per-node table that fits the terminal, or plain
//! lines (one per change, nothing cut) when stderr is not a terminal.

use crate::term::{Table, stderr_size};
use crate::words::{retry_cell, state_cell, state_text, state_word};
use anyhow::Result;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};
use swactor_actors::{ClusterEvent, ClusterHandle, ClusterSnapshot, NodeSummary};
use swactor_provisioning::{HoldKind, LogicalNodeId, Timestamp};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// The running progress display.
pub struct Progress {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    lines: mpsc::UnboundedSender<String>,
}

impl Progress {
    /// Follows `cluster`'s events on stderr until stopped.
    ///
    /// # Errors
    /// The cluster is gone.
    pub async fn start(cluster: &ClusterHandle) -> Result<Self> {
        let sub = cluster.subscribe().await?;
        let (stop, mut stopped) = oneshot::channel();
        let (lines, mut said) = mpsc::unbounded_channel::<String>();
        let tty = std::io::stderr().is_terminal();
        let task = tokio::spawn(async move {
            // Holds that began before this display did (the breaker of a
            // restarted daemon, tripped while its agents come back) are said
            // as their events would have said them: the cluster's own log
            // lines for them are kept off the terminal (see main).
            let held: Vec<String> = sub
                .snapshot
                .holds
                .iter()
                .map(|h| format!("group {}: {}", h.group, h.reason))
                .collect();
            let mut view = View::new(sub.snapshot);
            for line in &held {
                view.line(line, tty);
            }
            let mut events = sub.events;
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    Some(text) = said.recv() => view.line(&text, tty),
                    ev = events.recv() => match ev {
                        Ok(ev) => view.apply(ev, tty),
                        Err(RecvError::Lagged(n)) => view.line(&format!("(display skipped {n} events)"), tty),
                        Err(RecvError::Closed) => break,
                    },
                    _ = tick.tick(), if tty => view.redraw(),
                }
            }
            // What happened before the stop is shown before whatever the
            // caller prints next (a teardown's summary): the select above
            // may have taken the stop while events were still queued.
            loop {
                match events.try_recv() {
                    Ok(ev) => view.apply(ev, tty),
                    Err(TryRecvError::Lagged(n)) => {
                        view.line(&format!("(display skipped {n} events)"), tty);
                    }
                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                }
            }
            said.close();
            while let Some(text) = said.recv().await {
                view.line(&text, tty);
            }
            if tty {
                view.redraw();
            }
        });
        Ok(Self {
            stop: Some(stop),
            task,
            lines,
        })
    }

    /// Prints a line of the daemon's own above the table (printing it
    /// directly would let the next redraw erase it, and leave part of the
    /// table behind).
    pub fn say(&self, text: impl Into<String>) {
        if let Err(unsent) = self.lines.send(text.into()) {
            // The display has ended: nothing is drawn to get in the way.
            eprintln!("{}", unsent.0);
        }
    }

    /// Lets queued events reach the screen.
    pub async fn flush(&self) {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Stops the display.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

struct View {
    nodes: BTreeMap<LogicalNodeId, NodeSummary>,
    /// The cluster's clock at the snapshot, and when it was taken here.
    clock: (Timestamp, Instant),
    drawn_lines: usize,
    generation: u64,
    converged: bool,
    /// Reconciling is paused.
    paused: bool,
    /// A teardown is under way.
    tearing_down: bool,
    /// Without a terminal: the last line printed per node, so a node is
    /// printed again only when what is said of it changes.
    said: BTreeMap<LogicalNodeId, String>,
}

impl View {
    fn new(snapshot: ClusterSnapshot) -> Self {
        let mut view = Self {
            nodes: BTreeMap::new(),
            clock: (snapshot.now, Instant::now()),
            drawn_lines: 0,
            generation: snapshot.generation.0,
            converged: snapshot.converged,
            paused: snapshot.paused,
            tearing_down: snapshot.shutting_down
                == Some(swactor_provisioning::ShutdownMode::Teardown),
            said: BTreeMap::new(),
        };
        for n in snapshot.nodes {
            view.nodes.insert(n.node, n);
        }
        view
    }

    /// The cluster's clock now (the daemon's own, read in this process).
    fn now(&self) -> Timestamp {
        let (at, seen) = self.clock;
        at.saturating_add_ms(u64::try_from(seen.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    fn line(&mut self, text: &str, tty: bool) {
        if tty {
            // Log lines go above the table; it is redrawn below them.
            self.erase();
        }
        eprintln!("{text}");
    }

    fn apply(&mut self, ev: ClusterEvent, tty: bool) {
        match ev {
            ClusterEvent::Node(n) => {
                if !tty {
                    let error = match (&n.last_error, n.ready) {
                        (Some(e), false) => format!(" ({e})"),
                        _ => String::new(),
                    };
                    let text = format!(
                        "{} {} {}{error}",
                        n.node,
                        n.attempt,
                        state_text(&n, self.now())
                    );
                    // Only the state word and the error decide whether to
                    // say it again: a wait counting down is not news.
                    let key = format!("{} {} {error}", n.attempt, state_word(&n));
                    if self.said.get(&n.node) != Some(&key) {
                        eprintln!("{text}");
                        self.said.insert(n.node, key);
                    }
                }
                self.converged = false;
                self.nodes.insert(n.node, n);
            }
            ClusterEvent::Removed { node } => {
                // Said once, however often the daemon repeats it.
                if self.nodes.remove(&node).is_some() && !tty {
                    eprintln!("{node} removed");
                }
                self.said.remove(&node);
            }
            ClusterEvent::ShapeAccepted { generation, nodes } => {
                self.generation = generation.0;
                self.converged = false;
                self.line(
                    &format!("generation {} accepted: {nodes} node(s)", generation.0),
                    tty,
                );
            }
            ClusterEvent::Converged { generation, nodes } => {
                self.converged = true;
                self.line(
                    &format!(
                        "converged: generation {}, {nodes} node(s) ready",
                        generation.0
                    ),
                    tty,
                );
            }
            ClusterEvent::Warning { message } => self.line(&format!("warning: {message}"), tty),
            ClusterEvent::Dispatched { .. }
            | ClusterEvent::Finished { .. }
            | ClusterEvent::Pass { .. } => {}
            other => {
                match other {
                    ClusterEvent::Paused => self.paused = true,
                    ClusterEvent::Resumed { .. } => self.paused = false,
                    // The teardown is a generation of its own (the empty
                    // shape), as `status` says: the table says the same.
                    ClusterEvent::TeardownStarted { generation } => {
                        self.generation = generation.0;
                        self.converged = false;
                        self.tearing_down = true;
                    }
                    _ => {}
                }
                if let Some(note) = note(&other, self.now()) {
                    self.line(&note, tty);
                }
            }
        }
    }

    fn erase(&mut self) {
        let mut err = std::io::stderr().lock();
        for _ in 0..self.drawn_lines {
            let _ = write!(err, "\x1b[1A\x1b[2K");
        }
        self.drawn_lines = 0;
    }

    /// The table's first line: `generation 2 · 3/4 ready · tearing down`.
    fn headline(&self) -> String {
        let ready = self
            .nodes
            .values()
            .filter(|n| state_word(n) == "ready")
            .count();
        format!(
            "generation {} · {ready}/{} ready{}{}",
            self.generation,
            self.nodes.len(),
            if self.tearing_down {
                " · tearing down"
            } else if self.converged {
                " · converged"
            } else {
                ""
            },
            if self.paused { " · paused" } else { "" }
        )
    }

    /// Draws the table below the log lines. Every line it draws is shorter
    /// than the terminal is wide, and it draws fewer lines than the terminal
    /// is high, so erasing it again takes exactly as many lines as it drew:
    /// a line that wrapped on its own, or scrolled off the top, would leave
    /// a copy of the table behind at each redraw.
    fn redraw(&mut self) {
        self.erase();
        let (cols, rows) = stderr_size().unwrap_or((80, 24));
        let width = cols.saturating_sub(1).max(20);
        let now = self.now();
        let mut lines = vec![self.headline()];
        // Nodes that are not ready first: when not all fit, they are the
        // ones worth the room.
        let (busy, done): (Vec<&NodeSummary>, Vec<&NodeSummary>) =
            self.nodes.values().partition(|n| state_word(n) != "ready");
        let mut table = Table::new(&["NODE", "ATTEMPT", "STATE", "FAILS", "RETRY", "LAST ERROR"]);
        for n in busy.iter().chain(&done) {
            table.row(
                vec![
                    n.node.to_string(),
                    n.attempt.to_string(),
                    state_cell(n, now),
                    n.failures.to_string(),
                    retry_cell(n, now),
                ],
                n.last_error.clone().unwrap_or_default(),
            );
        }
        let mut rendered = table.render(Some(width)).into_iter();
        // Room left by the headline, the column titles, a last line saying
        // what did not fit, and the line the cursor rests on.
        let room = rows.saturating_sub(4).max(1);
        lines.extend(rendered.next().unwrap_or_default());
        let mut shown = 0;
        let mut used = 0;
        for row in rendered.by_ref() {
            if used + row.len() > room {
                break;
            }
            used += row.len();
            shown += 1;
            lines.extend(row);
        }
        let hidden = self.nodes.len() - shown;
        if hidden > 0 {
            let hidden_ready = done.len().min(hidden);
            lines.push(
                format!(
                    "  … {hidden} more node(s) ({hidden_ready} of them ready); `swactor status` lists all"
                )
                .chars()
                .take(width)
                .collect(),
            );
        }
        let mut out = lines.join("\n");
        out.push('\n');
        self.drawn_lines = lines.len();
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(out.as_bytes());
        let _ = err.flush();
    }
}

/// One line for the events about adoption, collection, agents and teardown;
/// `None` for the others.
pub fn note(e: &ClusterEvent, now: Timestamp) -> Option<String> {
    Some(match e {
        ClusterEvent::Adopted {
            adopted,
            drifted,
            orphans,
            presumed_gone,
        } => return adopted_note(adopted, drifted, orphans, presumed_gone),
        ClusterEvent::Swept { orphans } => {
            format!(
                "found {} leftover(s) to collect: {}",
                orphans.len(),
                key_names(orphans)
            )
        }
        ClusterEvent::Collected { key, error: None } => {
            format!("collected leftover {} {}", key.node, key.attempt)
        }
        ClusterEvent::Collected {
            key,
            error: Some(e),
        } => format!(
            "could not collect leftover {} {} yet ({e}); retrying",
            key.node, key.attempt
        ),
        ClusterEvent::GivenUp { key, reason } => {
            format!("gave up releasing {} {}: {reason}", key.node, key.attempt)
        }
        ClusterEvent::AgentJoined { .. } => return None,
        ClusterEvent::Deaf { from, to, agents } => {
            let secs = to.as_millis().saturating_sub(from.as_millis()) as f64 / 1000.0;
            let mut line = format!("the daemon was not listening for {secs:.1} s");
            if *agents > 0 {
                line.push_str(&format!(
                    " (stopped, asleep or starved): each of its {agents} agent(s) gets its whole grace again"
                ));
            }
            line
        }
        ClusterEvent::AgentDisconnected {
            key,
            grace_until,
            replaced,
            at,
        } => disconnected_note(key, *grace_until, *replaced, *at, now),
        ClusterEvent::Preempted {
            key,
            wait_until,
            at,
        } => preempted_note(key, *wait_until, *at),
        ClusterEvent::TeardownStarted { generation } => {
            format!("tearing down (generation {})", generation.0)
        }
        ClusterEvent::Paused => {
            "paused: nothing new is dispatched until `swactor resume`".to_owned()
        }
        ClusterEvent::Resumed { by_teardown: false } => "resumed".to_owned(),
        ClusterEvent::Resumed { by_teardown: true } => {
            "the teardown overrides the pause: resumed to remove every node".to_owned()
        }
        ClusterEvent::Hold {
            group,
            kind,
            reason,
        } => hold_note(group, *kind, reason.as_deref()),
        _ => return None,
    })
}

/// The attempts named by `keys`, as `worker-0 a3, worker-1 a1`.
fn key_names(keys: &[swactor_provisioning::ResourceKey]) -> String {
    let keys: Vec<String> = keys
        .iter()
        .map(|k| format!("{} {}", k.node, k.attempt))
        .collect();
    crate::words::names(&keys)
}

/// The line for an adoption after a start; `None` when nothing was found.
fn adopted_note(
    adopted: &[swactor_provisioning::ResourceKey],
    drifted: &[swactor_provisioning::ResourceKey],
    orphans: &[swactor_provisioning::ResourceKey],
    presumed_gone: &[swactor_provisioning::ResourceKey],
) -> Option<String> {
    if adopted.is_empty() && orphans.is_empty() && presumed_gone.is_empty() {
        return None;
    }
    let mut line = format!("adopted {} node(s) left running", adopted.len());
    if !drifted.is_empty() {
        line.push_str(&format!(
            "; {} made from another template will be replaced ({})",
            drifted.len(),
            key_names(drifted)
        ));
    }
    if !orphans.is_empty() {
        line.push_str(&format!(
            "; collecting {} leftover(s) ({})",
            orphans.len(),
            key_names(orphans)
        ));
    }
    if !presumed_gone.is_empty() {
        line.push_str(&format!(
            "; {} on record are gone ({})",
            presumed_gone.len(),
            key_names(presumed_gone)
        ));
    }
    Some(line)
}

/// The line for an agent that went away, its grace told from when the
/// daemon noticed (`at`), or from `now` when the event does not say.
fn disconnected_note(
    key: &swactor_provisioning::ResourceKey,
    grace_until: Timestamp,
    replaced: bool,
    at: Timestamp,
    now: Timestamp,
) -> String {
    format!(
        "{} {}: agent disconnected; {}",
        key.node,
        key.attempt,
        crate::words::next_words(
            swactor_provisioning::NextStep::LostAt {
                at: grace_until,
                replaced,
            },
            // The grace as it stood when the daemon noticed: a
            // viewer's clock (from a snapshot that may be old) is not.
            if at > Timestamp::from_millis(0) {
                at
            } else {
                now
            }
        )
    )
}

/// The line for an away agent whose machine its provider paused.
fn preempted_note(
    key: &swactor_provisioning::ResourceKey,
    wait_until: Option<Timestamp>,
    at: Timestamp,
) -> String {
    match wait_until {
        Some(until) => format!(
            "{} {}: its machine is paused by its provider (preempted); kept while it may \
             resume, replaced unless back {}",
            key.node,
            key.attempt,
            crate::words::until(until, at)
        ),
        None => format!(
            "{} {}: its machine is paused by its provider (preempted)",
            key.node, key.attempt
        ),
    }
}

/// The line for a group that began, changed or stopped holding something back.
fn hold_note(group: &str, kind: HoldKind, reason: Option<&str>) -> String {
    match (kind, reason) {
        (_, Some(reason)) => format!("group {group}: {reason}"),
        (HoldKind::Rollout, None) => format!("group {group}: the rollout is no longer held"),
        (HoldKind::Remediation, None) => {
            format!("group {group}: remediation resumed (back within max_unhealthy)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId, ResourceKey, RunId};

    fn disconnected(at: u64, grace_until: u64, replaced: bool) -> ClusterEvent {
        ClusterEvent::AgentDisconnected {
            key: ResourceKey {
                run_id: RunId::new("r"),
                node: LogicalNodeId::parse("worker-0").unwrap(),
                attempt: NodeAttemptId(7),
            },
            grace_until: Timestamp::from_millis(grace_until),
            replaced,
            at: Timestamp::from_millis(at),
        }
    }

    #[test]
    fn a_release_given_up_is_a_line_that_says_where_and_why() {
        let e = ClusterEvent::GivenUp {
            key: ResourceKey {
                run_id: RunId::new("r"),
                node: LogicalNodeId::parse("worker-0").unwrap(),
                attempt: NodeAttemptId(7),
            },
            reason: "h1 has not answered for 60s (unreachable_give_up_s)".to_owned(),
        };
        assert_eq!(
            note(&e, Timestamp::from_millis(0)).as_deref(),
            Some(
                "gave up releasing worker-0 a7: h1 has not answered for 60s (unreachable_give_up_s)"
            )
        );
    }

    /// Issue 28, Why 6: `tearing down (generation 2)` was followed by a
    /// table headed `generation 1 · 0/1 ready`.
    #[test]
    fn a_teardown_is_shown_as_the_generation_it_is() {
        let snapshot = ClusterSnapshot {
            generation: swactor_provisioning::Generation(1),
            converged: true,
            inventory_read: true,
            now: Timestamp::from_millis(1),
            ..ClusterSnapshot::empty("r")
        };
        let mut view = View::new(snapshot);
        assert_eq!(view.headline(), "generation 1 · 0/0 ready · converged");
        view.apply(
            ClusterEvent::TeardownStarted {
                generation: swactor_provisioning::Generation(2),
            },
            false,
        );
        assert_eq!(view.headline(), "generation 2 · 0/0 ready · tearing down");
    }

    #[test]
    fn a_disconnection_tells_its_grace_as_the_daemon_saw_it_not_by_a_stale_clock() {
        // The viewer's clock came from a snapshot 6 s old: the grace left
        // is still the 3 s the daemon saw, not 9 s.
        let line = note(
            &disconnected(100_000, 103_000, true),
            Timestamp::from_millis(94_000),
        );
        assert_eq!(
            line.as_deref(),
            Some("worker-0 a7: agent disconnected; replaced unless back in 3 s")
        );
        let paused = note(
            &disconnected(100_000, 103_000, false),
            Timestamp::from_millis(0),
        );
        assert_eq!(
            paused.as_deref(),
            Some(
                "worker-0 a7: agent disconnected; lost unless back in 3 s (not replaced while paused)"
            )
        );
    }
}
