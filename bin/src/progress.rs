//! Live progress: a per-node table on a terminal, plain log lines otherwise.

use anyhow::Result;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::Duration;
use swactor_actors::{ClusterEvent, ClusterHandle, NodeSummary};
use swactor_provisioning::{LogicalNodeId, NodeStage, Timestamp};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The running progress display.
pub(crate) struct Progress {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Progress {
    /// Follows `cluster`'s events on stderr until stopped.
    ///
    /// # Errors
    /// The cluster is gone.
    pub(crate) async fn start(cluster: &ClusterHandle) -> Result<Self> {
        let sub = cluster.subscribe().await?;
        let (stop, mut stopped) = oneshot::channel();
        let tty = std::io::stderr().is_terminal();
        let task = tokio::spawn(async move {
            let mut view = View::default();
            for n in sub.snapshot.nodes {
                view.nodes.insert(n.node.clone(), n);
            }
            view.now = sub.snapshot.now;
            view.generation = sub.snapshot.generation.0;
            view.converged = sub.snapshot.converged;
            let mut events = sub.events;
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    ev = events.recv() => match ev {
                        Ok(ev) => view.apply(ev, tty),
                        Err(RecvError::Lagged(n)) => view.line(&format!("(display skipped {n} events)"), tty),
                        Err(RecvError::Closed) => break,
                    },
                    _ = tick.tick(), if tty => view.redraw(),
                }
            }
            if tty {
                view.redraw();
            }
        });
        Ok(Self {
            stop: Some(stop),
            task,
        })
    }

    /// Lets queued events reach the screen.
    pub(crate) async fn flush(&self) {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Stops the display.
    pub(crate) async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

#[derive(Default)]
struct View {
    nodes: BTreeMap<LogicalNodeId, NodeSummary>,
    now: Timestamp,
    drawn_lines: usize,
    generation: u64,
    converged: bool,
}

impl View {
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
                let changed = self
                    .nodes
                    .get(&n.node)
                    .is_none_or(|old| old.stage != n.stage || old.attempt != n.attempt);
                if changed && !tty {
                    let err = n
                        .last_error
                        .as_deref()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default();
                    eprintln!("{} {} {:?}{}", n.node, n.attempt, n.stage, err);
                }
                self.converged = false;
                self.nodes.insert(n.node.clone(), n);
            }
            ClusterEvent::Removed { node } => {
                if !tty {
                    eprintln!("{node} removed");
                }
                self.nodes.remove(&node);
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
                if let Some(note) = note(&other) {
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

    fn redraw(&mut self) {
        self.erase();
        let ready = self.nodes.values().filter(|n| n.ready).count();
        let mut out = format!(
            "generation {} · {ready}/{} ready{}\n",
            self.generation,
            self.nodes.len(),
            if self.converged { " · converged" } else { "" }
        );
        out.push_str(&format!(
            "  {:<16} {:>8} {:<17} {:<6} {}\n",
            "NODE", "ATTEMPT", "STAGE", "FAILS", "LAST ERROR / NEXT RETRY"
        ));
        for n in self.nodes.values() {
            let stage = match (n.stage, n.pending) {
                (NodeStage::Dormant, _) if n.ready => "ready".to_owned(),
                (s, Some(p)) => format!("{s:?}…{p:?}").chars().take(17).collect(),
                (s, None) => format!("{s:?}"),
            };
            let mut note = n.last_error.clone().unwrap_or_default();
            if let Some(at) = n.next_retry_at {
                note.push_str(&format!(
                    " (retry at t+{:.1}s)",
                    at.as_millis() as f64 / 1000.0
                ));
            }
            out.push_str(&format!(
                "  {:<16} {:>8} {:<17} {:<6} {}\n",
                n.node.to_string(),
                n.attempt.to_string(),
                stage,
                n.failures,
                note.chars().take(60).collect::<String>()
            ));
        }
        self.drawn_lines = out.lines().count();
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(out.as_bytes());
        let _ = err.flush();
    }
}

/// One line for the events about adoption, collection, agents and teardown;
/// `None` for the others.
pub(crate) fn note(e: &ClusterEvent) -> Option<String> {
    let keys = |keys: &[swactor_provisioning::ResourceKey]| {
        keys.iter()
            .map(|k| format!("{} {}", k.node, k.attempt))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Some(match e {
        ClusterEvent::Adopted {
            adopted,
            drifted,
            orphans,
            presumed_gone,
        } => {
            if adopted.is_empty() && orphans.is_empty() && presumed_gone.is_empty() {
                return None;
            }
            let mut line = format!("adopted {} node(s) left running", adopted.len());
            if !drifted.is_empty() {
                line.push_str(&format!(
                    "; {} made from another template will be replaced ({})",
                    drifted.len(),
                    keys(drifted)
                ));
            }
            if !orphans.is_empty() {
                line.push_str(&format!(
                    "; collecting {} leftover(s) ({})",
                    orphans.len(),
                    keys(orphans)
                ));
            }
            if !presumed_gone.is_empty() {
                line.push_str(&format!(
                    "; {} on record are gone ({})",
                    presumed_gone.len(),
                    keys(presumed_gone)
                ));
            }
            line
        }
        ClusterEvent::Swept { orphans } => {
            format!(
                "found {} leftover(s) to collect: {}",
                orphans.len(),
                keys(orphans)
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
        ClusterEvent::AgentJoined { .. } => return None,
        ClusterEvent::AgentDisconnected { key, grace_until } => format!(
            "{} {}: agent disconnected; replaced unless it is back by t+{:.1}s",
            key.node,
            key.attempt,
            grace_until.as_millis() as f64 / 1000.0
        ),
        ClusterEvent::TeardownStarted { generation } => {
            format!("tearing down (generation {})", generation.0)
        }
        _ => return None,
    })
}
