//! `watch`: the cluster's event stream, as a live view.

use super::*;

/// How often `watch` checks that the daemon still holds its state directory.
pub(super) const WATCH_ALIVE_INTERVAL: Duration = Duration::from_millis(500);
/// Frames read ahead of what `watch` has printed.
pub(super) const WATCH_FRAMES_BUFFERED: usize = 256;
/// How long `watch` waits for the end of the stream of a daemon that has
/// released its state directory, before it takes the stream as broken.
pub(super) const WATCH_END_GRACE: Duration = Duration::from_secs(1);

/// How a watch ends.
pub(super) enum Ended {
    /// The daemon ended the stream (it stopped), or the user pressed Ctrl-C.
    Cleanly(&'static str),
    /// The stream broke off: the daemon died, the connection was lost, a
    /// frame did not decode.
    Broken(String),
}

/// `swactor watch`: follows the daemon's telemetry until it stops (exit 0),
/// Ctrl-C (exit 0), or the stream breaks (an error, so exit 1).
///
/// # Errors
/// An unreachable daemon, or a stream that broke off.
pub(crate) async fn watch(state_dir: &Path) -> Result<()> {
    let client = Client::open(state_dir).await?;
    let subscribed = subscribe::<ClusterSnapshot, ClusterEvent>(
        &client.endpoint,
        client.ticket.addr().clone(),
        CONNECT_TIMEOUT,
        FRAME_LEN_MAX,
    )
    .await
    .map_err(|e| match e {
        SubscribeError::Refused { code, .. } if code == codes::CLOSE_NOT_ALLOWED.into_inner() => {
            client.not_authorised()
        }
        e => client.not_running(swactor_engine::error_chain(&e)),
    });
    let mut sub = match subscribed {
        Ok(sub) => sub,
        Err(e) => {
            client.close().await;
            return Err(e);
        }
    };
    // Frames are read by a task of their own: reading one is not
    // cancel-safe, so it must never be a branch of the `select!` below (a
    // tick that won the race would drop half a frame and garble the stream).
    let (frames_tx, mut frames) = tokio::sync::mpsc::channel(WATCH_FRAMES_BUFFERED);
    let reader = tokio::spawn(async move {
        loop {
            let frame = sub.next().await;
            let last = !matches!(frame, Ok(Some(_)));
            if frames_tx.send(frame).await.is_err() || last {
                break;
            }
        }
    });
    let mut view = WatchView::new();
    let mut alive = tokio::time::interval(WATCH_ALIVE_INTERVAL);
    // One listener for the whole watch: a fresh `ctrl_c()` per frame would
    // miss a Ctrl-C that came while a frame was being printed.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch for Ctrl-C")?;
    let ended = loop {
        let frame = tokio::select! {
            f = frames.recv() => f,
            _ = interrupt.recv() => break Ok(Ended::Cleanly("stopped")),
            _ = alive.tick() => {
                if client.daemon_alive().await {
                    continue;
                }
                // The daemon let go of its directory: it stopped, or died.
                // A daemon that stopped has ended the stream by now.
                let rest = async {
                    while let Some(frame) = frames.recv().await {
                        if let Some(ended) = view.frame(frame)? {
                            return Ok(ended);
                        }
                    }
                    Ok(Ended::Broken("the stream stopped".to_owned()))
                };
                match tokio::time::timeout(WATCH_END_GRACE, rest).await {
                    Ok(ended) => break ended,
                    Err(_) => break Ok(Ended::Broken(
                        "the daemon is gone without ending the stream (was it killed?)".to_owned(),
                    )),
                }
            }
        };
        let Some(frame) = frame else {
            break Ok(Ended::Broken("the stream stopped".to_owned()));
        };
        match view.frame(frame) {
            // Nobody reads any more (`| head`): the watch is over.
            Ok(None) if crate::term::Stdout::closed() => break Ok(Ended::Cleanly("stopped")),
            Ok(None) => {}
            Ok(Some(ended)) => break Ok(ended),
            Err(e) => break Err(e),
        }
    };
    reader.abort();
    client.close().await;
    match ended? {
        Ended::Cleanly(how) => {
            view.say(how)?;
            view.out.flush()?;
            Ok(())
        }
        Ended::Broken(why) => bail!("the stream from the daemon broke off: {why}"),
    }
}

/// Whether a subscription ended because the daemon closed it on purpose
/// (it is stopping), not because something broke.
pub(super) fn closed_on_purpose(e: &SubscribeError) -> bool {
    matches!(e, SubscribeError::Refused { code, .. }
        if *code == codes::CLOSE_DONE.into_inner() || *code == codes::CLOSE_SHUTDOWN.into_inner())
}

/// What `watch` has printed: every line starts with the wall-clock time, and
/// a line that would repeat the previous one for the same node (or the
/// previous line at all) is not printed again.
pub(super) struct WatchView {
    out: Out,
    /// The cluster's clock at the last snapshot, and when it arrived here.
    clock: Option<(Timestamp, Instant)>,
    last_per_node: HashMap<LogicalNodeId, String>,
    last_line: String,
    /// When the event being printed was published (wall clock, ms since
    /// the Unix epoch): its lines carry that time, not the time they arrive.
    at_ms: Option<u64>,
}

impl WatchView {
    fn new() -> Self {
        Self {
            out: Out::new(),
            clock: None,
            last_per_node: HashMap::new(),
            last_line: String::new(),
            at_ms: None,
        }
    }

    /// The cluster's clock now, as best known here.
    fn now(&self) -> Timestamp {
        self.clock.map_or(Timestamp::from_millis(0), |(at, seen)| {
            at.saturating_add_ms(u64::try_from(seen.elapsed().as_millis()).unwrap_or(u64::MAX))
        })
    }

    fn say(&mut self, text: &str) -> std::io::Result<()> {
        if text == self.last_line {
            return Ok(());
        }
        let at = self.at_ms.map_or_else(clock, crate::words::clock_at);
        self.out.line(format_args!("{at} {text}"))?;
        text.clone_into(&mut self.last_line);
        Ok(())
    }

    fn node_line(&mut self, node: &LogicalNodeId, text: String) -> std::io::Result<()> {
        if self.last_per_node.get(node) == Some(&text) {
            return Ok(());
        }
        self.say(&text)?;
        self.last_per_node.insert(*node, text);
        Ok(())
    }

    /// Prints one frame; `Some` when the stream ended.
    fn frame(
        &mut self,
        frame: Result<Option<TelemetryFrame<ClusterSnapshot, ClusterEvent>>, SubscribeError>,
    ) -> std::io::Result<Option<Ended>> {
        let ended = match frame {
            Ok(Some(TelemetryFrame::Snapshot { state, .. })) => {
                self.snapshot(&state)?;
                None
            }
            Ok(Some(TelemetryFrame::Event { event, at_ms, .. })) => {
                self.at_ms = Some(at_ms);
                let printed = self.event(event);
                self.at_ms = None;
                printed?;
                None
            }
            Ok(Some(TelemetryFrame::Lagged { missed })) => {
                self.say(&format!(
                    "(missed {missed} events: this watch fell behind the daemon)"
                ))?;
                None
            }
            Ok(None) => Some(Ended::Cleanly("the daemon ended the stream (it stopped)")),
            Err(e) if closed_on_purpose(&e) => {
                Some(Ended::Cleanly("the daemon closed the stream (it stopped)"))
            }
            Err(e) => Some(Ended::Broken(swactor_engine::error_chain(&e))),
        };
        self.out.flush()?;
        Ok(ended)
    }

    fn snapshot(&mut self, s: &ClusterSnapshot) -> std::io::Result<()> {
        self.clock = Some((s.now, Instant::now()));
        self.say(&status_headline(s))?;
        // The nodes that are not ready; the ready ones are counted above.
        let busy: Vec<&NodeSummary> = s.nodes.iter().filter(|n| !n.ready).collect();
        for n in busy.iter().take(guard::CHANGES_SHOWN) {
            let text = node_text(n, s.now);
            self.node_line(&n.node, text)?;
        }
        if busy.len() > guard::CHANGES_SHOWN {
            self.say(&format!(
                "… and {} more not ready (`swactor status` lists them)",
                busy.len() - guard::CHANGES_SHOWN
            ))?;
        }
        for n in &s.nodes {
            self.last_per_node.insert(n.node, node_text(n, s.now));
        }
        Ok(())
    }

    fn event(&mut self, e: ClusterEvent) -> std::io::Result<()> {
        let now = self.now();
        match e {
            ClusterEvent::Node(n) => self.node_line(&n.node.clone(), node_text(&n, now)),
            ClusterEvent::Removed { node } => {
                // Said once, however often the daemon repeats it.
                if self.last_per_node.remove(&node).is_some() {
                    self.say(&format!("{node} removed"))?;
                }
                Ok(())
            }
            ClusterEvent::ShapeAccepted {
                generation,
                nodes: n,
            } => self.say(&format!(
                "shape accepted: generation {}, {}",
                generation.0,
                nodes(n)
            )),
            ClusterEvent::Converged {
                generation,
                nodes: n,
            } => self.say(&format!(
                "converged: generation {}, {} ready",
                generation.0,
                nodes(n as u64)
            )),
            ClusterEvent::Dispatched { node, op, effect } => {
                self.say(&format!("{node} {}: {}", op.attempt, effect_words(effect)))
            }
            ClusterEvent::Finished {
                node,
                op,
                outcome,
                folded,
            } => {
                let late = if folded {
                    ""
                } else {
                    " (a late result, ignored)"
                };
                self.say(&format!(
                    "{node} {}: {}{late}",
                    op.attempt,
                    crate::words::outcome_words(&outcome)
                ))
            }
            // Passes are the daemon's own bookkeeping.
            ClusterEvent::Pass { .. } | ClusterEvent::AgentJoined { .. } => Ok(()),
            ClusterEvent::Warning { message } => self.say(&format!("warning: {message}")),
            other => match crate::progress::note(&other, now) {
                Some(note) => self.say(&note),
                None => Ok(()),
            },
        }
    }
}

/// One node on one line: `worker-1 a3 failed, retrying in 12 s — reason`.
pub(super) fn node_text(n: &NodeSummary, now: Timestamp) -> String {
    let error = match (&n.last_error, n.ready) {
        (Some(e), false) => format!(" — {e}"),
        _ => String::new(),
    };
    format!("{} {} {}{error}", n.node, n.attempt, state_text(n, now))
}
