//! The host's outputs: `poll_output`, the passes it runs on the driver
//! core, and how each node's changes and history are published.

use super::*;

impl<C: Reconciler> Host<C> {
    /// The next output. See the module docs for what each one MUST cause.
    ///
    /// Only one [`Output::Persist`] is out at a time: nothing more comes
    /// until [`Host::handle_persisted`] is told of it.
    pub fn poll_output(&mut self, now: Timestamp) -> Option<Output> {
        self.heard(now);
        loop {
            if self.awaiting.is_some() {
                return None;
            }
            let leads = self.leads(now);
            if !leads && self.outputs.front().is_some_and(Output::acts) {
                return None;
            }
            if let Some(out) = self.outputs.pop_front() {
                match &out {
                    Output::Persist(delta) => self.awaiting = Some(delta.seq),
                    Output::Stop => self.stopped = true,
                    _ => {}
                }
                return Some(out);
            }
            if self.stopped {
                return None;
            }
            self.release_held(now);
            if let Some(todo) = self.todo.pop_front() {
                if let Some(fold) = self.run_todo(todo, now) {
                    return Some(Output::Folded(fold));
                }
                continue;
            }
            if !leads {
                // Folds go on (they change no machine); what acts waits.
                return None;
            }
            if self.flush_delta() {
                continue;
            }
            if !self.listing && self.sweep_at.is_some_and(|at| at <= now) {
                self.listing = true;
                self.sweep_at = None;
                return Some(Output::List);
            }
            if let Some(c) = self.due_collect(now) {
                return Some(Output::Collect(c));
            }
            self.sync_tripped();
            if self.passes_allowed() && self.core.is_pass_queued() {
                if self.reserve_attempts() {
                    continue;
                }
                match self.run_pass(now) {
                    Some(pass) => return Some(Output::Pass(pass)),
                    None => continue,
                }
            }
            self.check_progress();
            if self.outputs.is_empty() {
                return None;
            }
        }
    }

    /// Whether the host may act at `now` (write its journal, dispatch,
    /// list, collect, probe): always, unless the replica layer bounded it
    /// ([`Host::handle_leadership`]). Says so, once, when it lapses.
    pub fn leads(&mut self, now: Timestamp) -> bool {
        let leads = self.leadership.holds_at(now);
        if !leads && !self.lapsed {
            self.lapsed = true;
            self.warn(
                "this daemon's leadership was not renewed in time: it writes and dispatches \
                 nothing until it is (another replica may lead meanwhile)"
                    .to_owned(),
            );
        }
        leads
    }

    // ----- internals -----

    pub(super) fn passes_allowed(&self) -> bool {
        matches!(self.adoption, Adoption::Done) || self.shutdown.is_some()
    }

    pub(super) fn warn(&mut self, message: String) {
        self.events.push_back(HostEvent::Warning(message));
    }

    pub(super) fn node_changed(&mut self, node: &LogicalNodeId, now: Timestamp) {
        self.record_failures(node);
        // A destroyed attempt has no agent: its link (connected, or away
        // with a grace running) ends with it, before its slot restarts.
        if self
            .core
            .state()
            .nodes
            .get(node)
            .is_none_or(|n| n.record.stage == NodeStage::Destroyed)
        {
            self.clear_link(node);
        }
        if self.config.history_len > 0 {
            self.touch_history(node, now);
        }
        if self.config.node_events {
            self.events.push_back(HostEvent::NodeChanged(*node));
        }
    }

    /// Brings `node`'s attempt history up to date with its state.
    pub(super) fn touch_history(&mut self, node: &LogicalNodeId, now: Timestamp) {
        let Some(n) = self.core.state().nodes.get(node) else {
            // A slot that left. Its history may already be let go (many
            // slots leave in one pass, and the trim runs on the first of
            // them): it is not made again, empty, to be trimmed once more.
            if let Some(last) = self.history.get_mut(node).and_then(|h| h.latest.as_mut()) {
                last.ended_at.set_once(now);
            }
            self.forget_departed();
            return;
        };
        let history = self.history.get_or_insert_with(node, Attempts::default);
        if history.latest.as_ref().map(|r| r.attempt) != Some(n.attempt) {
            if let Some(last) = &mut history.latest {
                last.ended_at.set_once(now);
            }
            history.start(n.attempt, now, self.config.history_len);
        }
        let Some(r) = &mut history.latest else {
            return;
        };
        r.stage = n.record.stage;
        r.bootstrap = n.record.bootstrap.or(r.bootstrap);
        if n.is_ready() {
            r.ready_at.set_once(now);
        }
        if r.failed_reason().is_none()
            && let Some(reason) = n.record.failed_reason()
        {
            r.notes().failed_reason = Some(reason.to_owned());
        }
        // The node's last error as it is now: one it got past (a create
        // that waited for room, then went through) is not the attempt's
        // last word.
        match n.record.last_error() {
            Some(e) if r.last_error() != Some(e) => r.notes().last_error = Some(e.to_owned()),
            None if r.last_error().is_some() => r.notes().last_error = None,
            _ => {}
        }
        if r.last_cause() != n.record.last_cause() {
            r.notes().last_cause = n.record.last_cause();
        }
        if n.record.stage == NodeStage::Destroyed {
            r.ended_at.set_once(now);
        }
    }

    /// Once twice [`DEPARTED_HISTORY_MAX`] slots that no longer have a node
    /// are remembered (or an eighth as many as have one, if that is more),
    /// forgets the ones that left first down to the limit. In bulk, so that
    /// a large scale-down does not sort once per node, and after a number
    /// of departures that grows with the cluster, since the trim walks every
    /// slot's history: a large cluster leaving one slot at a time would
    /// otherwise be walked whole every few hundred departures.
    pub(super) fn forget_departed(&mut self) {
        let nodes = &self.core.state().nodes;
        let departed = self.history.len().saturating_sub(nodes.len());
        if departed <= (2 * DEPARTED_HISTORY_MAX).max(nodes.len() / 8) {
            return;
        }
        let mut gone: Vec<(Timestamp, LogicalNodeId)> = self
            .history
            .iter()
            .filter(|(id, _)| !nodes.contains_key(id))
            .map(|(id, h)| {
                let ended = h
                    .latest
                    .as_ref()
                    .and_then(|r| r.ended_at.get())
                    .unwrap_or(Timestamp(0));
                (ended, id)
            })
            .collect();
        gone.sort();
        let excess = gone.len().saturating_sub(DEPARTED_HISTORY_MAX);
        for (_, id) in gone.into_iter().take(excess) {
            self.history.remove(&id);
        }
    }

    pub(super) fn stop(&mut self) {
        let waiting = std::mem::take(&mut self.waiters);
        for t in waiting
            .into_iter()
            .chain(std::mem::take(&mut self.adopt_waiters))
        {
            self.outputs.push_back(Output::Reply(t, Reply::Stopped));
        }
        self.outputs.push_back(Output::Stop);
    }

    pub(super) fn run_pass(&mut self, now: Timestamp) -> Option<Pass> {
        let pass = match self.core.poll_pass(now) {
            Ok(Some(pass)) => pass,
            Ok(None) => return None,
            Err(e) => {
                self.warn(format!("a pass could not run: {e}"));
                return None;
            }
        };
        if let Err(e) = self.core.finish_pass() {
            self.warn(format!("a pass could not finish: {e}"));
        }
        for e in &pass.errors {
            self.warn(e.to_string());
        }
        for d in &pass.dispatches {
            self.in_flight.insert(d.key.node, d.op);
            if self.config.node_events {
                self.events.push_back(HostEvent::Dispatched {
                    node: d.key.node,
                    op: d.op,
                    effect: d.request.kind(),
                });
                self.events.push_back(HostEvent::NodeChanged(d.key.node));
            }
        }
        for node in &pass.transitioned {
            self.record_slot(node);
            let attempt = self.core.state().nodes.get(node).map(|n| n.attempt);
            let stale = |a: NodeAttemptId| Some(a) != attempt;
            if let Some(link) = self.links.get(node).copied() {
                let linked = match link {
                    Link::Connected(a) | Link::Away { attempt: a, .. } => a,
                };
                if stale(linked) {
                    self.clear_link(node);
                }
            }
            if self
                .early
                .get(node)
                .and_then(|v| v.first())
                .is_some_and(|o| stale(o.attempt))
            {
                self.early.remove(node);
            }
            self.node_changed(node, now);
        }
        if self.config.node_events || pass.stats.transitions + pass.stats.dispatched > 0 {
            self.events.push_back(HostEvent::Pass {
                number: pass.number,
                stats: pass.stats,
            });
        }
        Some(pass)
    }

    pub(super) fn due_collect(&mut self, now: Timestamp) -> Option<CollectRequest> {
        let c = self
            .collects
            .values_mut()
            .find(|c| c.due.is_some_and(|at| at <= now))?;
        c.due = None;
        Some(c.request.clone())
    }

    /// [`Host::is_converged`], remembering the node that is not for the
    /// next check.
    pub(super) fn converged_from_hint(&mut self) -> bool {
        match self.convergence() {
            Ok(()) => {
                self.converged_hint = None;
                true
            }
            Err(hint) => {
                if hint.is_some() {
                    self.converged_hint = hint;
                }
                false
            }
        }
    }

    /// Holds, convergence, waiters and the end of a teardown, once the host is quiet.
    pub(super) fn check_progress(&mut self) {
        self.update_holds();
        if self.core.is_pass_queued() || !self.todo.is_empty() || !self.converged_from_hint() {
            return;
        }
        let generation = self.core.desired().generation;
        if self.converged_reported != Some(generation) {
            self.converged_reported = Some(generation);
            self.events.push_back(HostEvent::Converged {
                generation,
                nodes: self.core.state().nodes.len(),
            });
        }
        for t in std::mem::take(&mut self.waiters) {
            self.outputs
                .push_back(Output::Reply(t, Reply::Converged(generation)));
        }
        let torn_down = self.core.state().nodes.is_empty();
        if torn_down && let Some(s) = self.shutdown.take_if(|s| s.mode == ShutdownMode::Teardown) {
            self.meta.tearing_down = false;
            self.meta_dirty = true;
            self.flush_delta();
            let report = ShutdownReport {
                mode: s.mode,
                destroyed: s.nodes.into_iter().collect(),
                kept: Vec::new(),
                without_machine: Vec::new(),
            };
            for t in s.tickets {
                self.outputs
                    .push_back(Output::Reply(t, Reply::Shutdown(report.clone())));
            }
            self.stop();
        }
    }

    pub(super) fn run_todo(&mut self, todo: Todo, now: Timestamp) -> Option<HostFold> {
        match todo {
            Todo::Observe(obs) => {
                let folded = self.core.handle_bootstrap(&obs, now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&obs.node, now);
                }
                Some(HostFold::Observation { obs, folded })
            }
            Todo::FeedJoin(node) => {
                let n = self.core.state().nodes.get(&node)?;
                let live = self.links.get(&node) == Some(&Link::Connected(n.attempt));
                let session = n.record.session.clone()?;
                if !live || n.record.stage != NodeStage::BootstrapRunning {
                    return None;
                }
                let obs = BootstrapObservation {
                    node,
                    attempt: n.attempt,
                    session,
                    event: BootstrapEvent::SwactorJoined,
                };
                let folded = self.core.handle_bootstrap(&obs, now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&node, now);
                }
                Some(HostFold::Observation { obs, folded })
            }
            Todo::LaneLost(op, node) => {
                let still = self
                    .core
                    .state()
                    .nodes
                    .get(&node)
                    .and_then(|n| n.pending.as_ref())
                    .is_some_and(|p| p.id == op);
                if !still {
                    return None;
                }
                let result = OperationResult {
                    node,
                    op,
                    outcome: OperationOutcome::Failed {
                        class: FailureClass::Ambiguous,
                        reason: "the executor crashed mid-operation".to_owned(),
                    },
                };
                let folded = self.core.handle_result(&result, now);
                if folded == Ok(Folded::Applied) {
                    self.node_changed(&node, now);
                }
                Some(HostFold::Result { result, folded })
            }
            Todo::AgentLost(node, attempt, cause, reason) => {
                let folded = self
                    .core
                    .handle_agent_lost(&node, attempt, cause, &reason, now);
                if folded == Folded::Applied {
                    self.warn(format!("{node}: {reason}; replacing it"));
                    self.node_changed(&node, now);
                }
                Some(HostFold::AgentLost {
                    node,
                    attempt,
                    reason,
                    folded,
                })
            }
        }
    }

    pub(super) fn bootstrap_started(&mut self, node: &LogicalNodeId) {
        let Some(attempt) = self.core.state().nodes.get(node).map(|n| n.attempt) else {
            return;
        };
        for obs in self.early.remove(node).unwrap_or_default() {
            if obs.attempt == attempt {
                self.todo.push_back(Todo::Observe(obs));
            }
        }
        if self.links.get(node) == Some(&Link::Connected(attempt)) {
            self.todo.push_back(Todo::FeedJoin(*node));
        }
    }

    /// Keeps an observation that arrived before its StartBootstrap result.
    pub(super) fn keep_early(&mut self, obs: BootstrapObservation) {
        let waiting = self.core.state().nodes.get(&obs.node).is_some_and(|n| {
            n.attempt == obs.attempt
                && n.pending
                    .as_ref()
                    .is_some_and(|p| p.effect == EffectKind::StartBootstrap)
        });
        if !waiting {
            return;
        }
        let kept = self.early.entry(obs.node).or_default();
        if kept.first().is_some_and(|o| o.attempt != obs.attempt) {
            kept.clear();
        }
        if kept.len() < EARLY_OBSERVATIONS_MAX {
            kept.push(obs);
        }
    }

    pub(super) fn set_link(&mut self, node: &LogicalNodeId, link: Link) {
        self.clear_link(node);
        match link {
            Link::Away { until, .. } => {
                self.graces.insert((until, *node));
            }
            Link::Connected(_) => {
                // Back: whatever paused its machine is over.
                self.preempted.remove(node);
            }
        }
        self.links.insert(*node, link);
    }

    pub(super) fn clear_link(&mut self, node: &LogicalNodeId) {
        if let Some(Link::Away { until, .. }) = self.links.remove(node) {
            self.graces.remove(&(until, *node));
            self.held_lost.remove(node);
        }
    }
}
