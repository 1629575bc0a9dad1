//! The host's inputs: the `handle_*` calls a daemon makes as commands,
//! results, observations, joins and departures, time and starvation arrive.

use super::*;

impl<C: Reconciler> Host<C> {
    /// The provider's inventory for this run (or why it could not be
    /// listed), answering [`Output::List`]. The first one is adopted once a
    /// shape (or a shutdown) says what is desired; later ones are sweeps:
    /// whatever no slot's current attempt owns is collected.
    pub fn handle_inventory(&mut self, listed: Result<Vec<Listed>, String>, now: Timestamp) {
        self.heard(now);
        self.listing = false;
        let listed = match listed {
            Err(e) => {
                self.warn(format!("could not list the provider's resources: {e}"));
                match &mut self.adoption {
                    // The journal's records are still adopted; what the
                    // provider holds beyond them is found by a later sweep.
                    Adoption::Listing => Vec::new(),
                    // Judged on the first listing, and verified by a sweep.
                    Adoption::Relisting(first) => std::mem::take(first),
                    _ => {
                        self.schedule_sweep(now);
                        return;
                    }
                }
            }
            Ok(listed) => {
                if matches!(self.adoption, Adoption::Relisting(_)) {
                    self.relisted = true;
                }
                listed
            }
        };
        match self.adoption {
            Adoption::Listing | Adoption::Relisting(_) => {
                self.adoption = Adoption::Waiting(listed);
                self.adopt_if_ready(now);
            }
            Adoption::Waiting(_) => {}
            Adoption::Done => self.sweep(listed, now),
        }
    }

    /// Offers a shape. Returns the decision at once; the [`Reply`] for
    /// `ticket` follows once an accepted shape is durable.
    ///
    /// A shape with the current content is [`DesiredUpdate::Unchanged`],
    /// but the run-wide settings it carries (budget, capacity, lifetimes)
    /// are kept, and one that sets a lifetime re-arms it from the wall
    /// clock last handed in ([`Host::handle_wall_clock`]), durably before
    /// the reply, as an accepted one does.
    ///
    /// # Errors
    /// The shape is refused (the same error is replied).
    pub fn handle_apply(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        self.heard(now);
        let before = self.desired_templates();
        let outcome = if self.shutdown.is_some() || self.stopped {
            Err(ApplyError::ShuttingDown)
        } else {
            self.check_capacity(shape)
                .and_then(|()| self.core.update_desired(shape).map_err(ApplyError::from))
        };
        if let Ok(DesiredUpdate::Accepted(generation)) = outcome {
            // Room for each group's slots in one allocation, as the state
            // has: a doubling vector would copy itself as it grows and keep
            // up to half again of slack.
            for g in &self.core.desired().groups {
                self.slots.reserve(&g.id, g.count);
                self.links.reserve(&g.id, g.count);
                self.in_flight.reserve(&g.id, g.count);
                if self.config.history_len > 0 {
                    self.history.reserve(&g.id, g.count);
                }
            }
            self.retire_templates(&before);
            self.meta.shape = Some(shape.clone());
            self.meta.tearing_down = false;
            self.meta_dirty = true;
            self.events.push_back(HostEvent::ShapeAccepted {
                generation,
                nodes: self.core.desired().node_count(),
            });
            self.adopt_if_ready(now);
        } else if let Ok(DesiredUpdate::Unchanged(_)) = outcome {
            self.keep_run_settings(shape);
        }
        if outcome.is_ok() {
            self.arm_lifetime(shape, now);
        }
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Applied(outcome.clone())));
        outcome
    }

    /// Offers `shape` as the next generation, whatever generation it
    /// carries: a shape with the current shape's content is
    /// [`DesiredUpdate::Unchanged`] at the current generation, any other is
    /// offered at the current generation plus one (at least 1), as
    /// [`Host::handle_apply`] would take it. The generation is read and the
    /// shape offered in one step, so no other apply can come between them.
    ///
    /// # Errors
    /// As [`Host::handle_apply`].
    pub fn handle_apply_next(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        let current = self.core.desired().generation;
        let same = current.0 > 0
            && shape
                .validate()
                .is_ok_and(|next| next.same_content(self.core.desired()));
        let mut next = shape.clone();
        next.generation = if same {
            current
        } else {
            Generation(current.0.saturating_add(1))
        };
        self.handle_apply(&next, ticket, now)
    }

    /// Pauses (`paused`) or resumes reconciling. Returns whether that changed
    /// anything; the [`Reply::Paused`] for `ticket` follows once the flag is
    /// durable, so a daemon killed after the reply comes back as it was left.
    ///
    /// A paused cluster goes on folding every result, observation and agent
    /// report, and shows them, but its passes dispatch nothing new (the
    /// rule is [`allowed_while_paused`](crate::allowed_while_paused)):
    /// operations already pending finish and are folded, a deleting or
    /// failed attempt is still cleaned up, orphans are still collected, and
    /// shapes are still accepted (and made durable) but not acted on until
    /// resumed. The core is paused at once, before the flag is durable: a
    /// pause that a crash loses was never acknowledged, and in the meantime
    /// it only held work back.
    ///
    /// # Errors
    /// [`PauseError::ShuttingDown`]: pausing a teardown (resuming one is a
    /// no-op, since a teardown already overrode the pause).
    pub fn handle_pause(
        &mut self,
        paused: bool,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<bool, PauseError> {
        self.heard(now);
        let outcome = if paused && (self.shutdown.is_some() || self.stopped) {
            Err(PauseError::ShuttingDown)
        } else if self.meta.paused == paused || self.stopped {
            Ok(false)
        } else {
            self.meta.paused = paused;
            self.meta_dirty = true;
            self.core.set_paused(paused);
            self.events.push_back(if paused {
                HostEvent::Paused
            } else {
                HostEvent::Resumed { by_teardown: false }
            });
            Ok(true)
        };
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Paused(outcome)));
        outcome
    }

    /// Asks to be told when the cluster is converged on its current shape.
    pub fn handle_wait_converged(&mut self, ticket: Ticket) {
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
        } else if self.is_converged() && !self.core.is_pass_queued() {
            let generation = self.core.desired().generation;
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Converged(generation)));
        } else {
            self.waiters.push(ticket);
        }
    }

    /// Asks to be told once the provider's inventory and the journal have
    /// been adopted (see [`Host::adopted`]): a start that offers a shape
    /// waits for it, so the shape is judged against what really runs.
    pub fn handle_wait_adopted(&mut self, ticket: Ticket) {
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
        } else if self.adopted() {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Adopted));
        } else {
            self.adopt_waiters.push(ticket);
        }
    }

    /// Shuts the cluster down. [`ShutdownMode::Keep`] stops at once and
    /// leaves every node for a later host; [`ShutdownMode::Teardown`] is made
    /// durable first (a restarted host knows a teardown was asked for), then
    /// scales to zero, collects every orphan and stops when nothing is left.
    pub fn handle_shutdown(&mut self, mode: ShutdownMode, ticket: Ticket, now: Timestamp) {
        self.heard(now);
        if self.stopped {
            self.outputs
                .push_back(Output::Reply(ticket, Reply::Stopped));
            return;
        }
        if let Some(s) = &mut self.shutdown {
            s.tickets.push(ticket);
            return;
        }
        let nodes: BTreeSet<LogicalNodeId> = self.core.state().nodes.keys().cloned().collect();
        match mode {
            ShutdownMode::Keep => {
                let state = self.core.state();
                let (kept, without_machine) = nodes.into_iter().partition(|id| {
                    state
                        .nodes
                        .get(id)
                        .is_some_and(|n| n.record.lease.is_some())
                });
                let report = ShutdownReport {
                    mode,
                    destroyed: Vec::new(),
                    kept,
                    without_machine,
                };
                self.outputs
                    .push_back(Output::Reply(ticket, Reply::Shutdown(report)));
                self.stop();
            }
            ShutdownMode::Teardown => {
                let generation = Generation(self.core.desired().generation.0.saturating_add(1));
                let empty = ClusterShape {
                    run_id: self.meta.run_id.clone(),
                    generation,
                    groups: Vec::new(),
                    capacity: None,
                    budget: None,
                    lifetime: Default::default(),
                };
                if let Err(e) = self.core.update_desired(&empty) {
                    // Unreachable: an empty shape of this run at a higher
                    // generation is always valid.
                    self.warn(format!("cannot begin the teardown: {e}"));
                }
                self.meta.shape = Some(empty);
                self.meta.tearing_down = true;
                if self.meta.paused {
                    // The user asked for everything to go: that overrides
                    // the pause, durably with the teardown itself, so a
                    // later `up` is not paused either.
                    self.meta.paused = false;
                    self.core.set_paused(false);
                    self.events
                        .push_back(HostEvent::Resumed { by_teardown: true });
                }
                self.meta_dirty = true;
                self.flush_delta();
                self.events
                    .push_back(HostEvent::TeardownStarted { generation });
                self.shutdown = Some(Shutdown {
                    mode,
                    tickets: vec![ticket],
                    nodes,
                });
                self.adopt_if_ready(now);
            }
        }
    }

    /// A delta was made durable.
    pub fn handle_persisted(&mut self, seq: u64) {
        debug_assert_eq!(
            self.awaiting,
            Some(seq),
            "only the delta the host awaits can be made durable"
        );
        debug_assert!(seq < self.next_seq, "delta {seq} was never issued");
        if self.awaiting == Some(seq) {
            self.awaiting = None;
        }
    }

    /// Folds an operation result.
    ///
    /// # Errors
    /// As [`Reconciler::handle_result`].
    pub fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.handle_result_ref(&result, now)
    }

    /// [`Host::handle_result`] on a borrowed result: the core copies what
    /// it keeps, and a recording keeps the result itself.
    ///
    /// # Errors
    /// As [`Reconciler::handle_result`].
    pub fn handle_result_ref(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        self.back_from_flight(&result.node, result.op);
        let folded = self.core.handle_result(result, now)?;
        if folded == Folded::Applied {
            let (node, attempt) = (&result.node, result.op.attempt);
            self.node_changed(node, now);
            match &result.outcome {
                OperationOutcome::BootstrapStarted { .. } => self.bootstrap_started(node),
                OperationOutcome::LeaseCreated { .. } => self.record_created(node, attempt),
                outcome => {
                    if let Some(reason) = outcome.given_up() {
                        self.given_up(node, attempt, reason.to_owned());
                    }
                }
            }
        }
        Ok(folded)
    }

    /// A dispatch could not be submitted: it folds as a definite failure.
    ///
    /// # Errors
    /// As [`Reconciler::handle_submit_failed`].
    pub fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        self.back_from_flight(node, op);
        let folded = self.core.handle_submit_failed(node, op, reason, now)?;
        if folded == Folded::Applied {
            self.node_changed(node, now);
        }
        Ok(folded)
    }

    /// `node`'s operation `op` is back (its result, or a refused submit).
    pub(super) fn back_from_flight(&mut self, node: &LogicalNodeId, op: OperationId) {
        if self.in_flight.get(node) == Some(&op) {
            self.in_flight.remove(node);
        }
    }

    /// Folds a bootstrap stream observation.
    ///
    /// An observation for a session whose StartBootstrap result has not
    /// arrived yet is kept and replayed once it does. A stream's report that
    /// the agent joined proves a live join only with
    /// [`HostConfig::stream_joins`]; otherwise it means the agent joined
    /// once (perhaps an earlier host), so if it is not connected now it gets
    /// its grace to reconnect.
    ///
    /// # Errors
    /// As [`Reconciler::handle_bootstrap`].
    pub fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.handle_bootstrap_ref(&obs, now)
    }

    /// [`Host::handle_bootstrap`] on a borrowed observation: it is copied
    /// only to be kept (until its session's result comes).
    ///
    /// # Errors
    /// As [`Reconciler::handle_bootstrap`].
    pub fn handle_bootstrap_ref(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.heard(now);
        if obs.event == BootstrapEvent::SwactorJoined {
            if self.config.stream_joins {
                if let Some(n) = self.core.state().nodes.get(&obs.node)
                    && n.attempt == obs.attempt
                {
                    self.set_link(&obs.node, Link::Connected(obs.attempt));
                }
            } else {
                self.joined_before(&obs.node, obs.attempt, now);
                return Ok(Folded::Discarded(DiscardReason::NotLive));
            }
        }
        // What the node's stream said before its StartBootstrap result came
        // is folded first: a replayed log can arrive in one batch with the
        // result, and its stage must never go back.
        if self
            .todo
            .iter()
            .any(|t| matches!(t, Todo::Observe(o) if o.node == obs.node))
        {
            self.todo.push_back(Todo::Observe(obs.clone()));
            return Ok(Folded::Discarded(DiscardReason::Queued));
        }
        let folded = self.core.handle_bootstrap(obs, now)?;
        match folded {
            Folded::Applied => self.node_changed(&obs.node, now),
            Folded::Discarded(DiscardReason::StaleSession) => self.keep_early(obs.clone()),
            Folded::Discarded(_) => {}
        }
        Ok(folded)
    }

    /// An agent presents `key`: accepted only for the slot's current, active
    /// attempt. Its node can become ready from here on.
    ///
    /// # Errors
    /// Why the join is refused; nothing changes.
    pub fn handle_agent_joined(
        &mut self,
        key: &ResourceKey,
        now: Timestamp,
    ) -> Result<Liveness, JoinRefused> {
        self.heard(now);
        let liveness = self.join_verdict(key)?;
        self.set_link(&key.node, Link::Connected(key.attempt));
        self.events.push_back(HostEvent::AgentJoined(key.clone()));
        self.todo.push_back(Todo::FeedJoin(key.node));
        Ok(liveness)
    }

    /// Whether the agent of `key` may join (or keep a link to this host),
    /// exactly as [`Host::handle_agent_joined`] decides it, without linking
    /// it: only the node's current, active attempt may; before adoption, an
    /// attempt the journal holds is told "not yet".
    ///
    /// # Errors
    /// The [`JoinRefused`] a join of `key` would get.
    pub fn join_verdict(&self, key: &ResourceKey) -> Result<Liveness, JoinRefused> {
        if self.stopped {
            return Err(JoinRefused::Stopped);
        }
        if key.run_id != self.meta.run_id {
            return Err(JoinRefused::OtherRun(key.run_id.clone()));
        }
        if !matches!(self.adoption, Adoption::Done)
            && (self.config.adopt_unrecorded
                || self
                    .slots
                    .get(&key.node)
                    .is_some_and(|r| r.attempt == key.attempt))
        {
            // The journal holds this very attempt (or, told to adopt what no
            // journal recorded, the listing may) and adoption has not run
            // yet: the node is not in the core yet, but it is no stranger.
            return Err(JoinRefused::NotYet(key.node));
        }
        let Some(node) = self.core.state().nodes.get(&key.node) else {
            return Err(JoinRefused::UnknownNode(key.node));
        };
        if node.attempt != key.attempt {
            return Err(JoinRefused::Superseded {
                node: key.node,
                given: key.attempt,
                current: node.attempt,
            });
        }
        if node.intent != Intent::Active
            || matches!(node.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        {
            return Err(JoinRefused::NotActive(key.node));
        }
        let (orphan_after_s, policy) = self.orphan_lease(&key.node);
        Ok(Liveness::for_grace(node.template.join.lost_grace_ms())
            .with_lease(orphan_after_s, policy))
    }

    /// The agent of `key` disconnected, having last been heard `silent_ms`
    /// ago: unless it rejoins within its group's grace (counted from when it
    /// was last heard), the attempt fails and is replaced.
    ///
    /// Silence before the end of the latest deaf gap does not count (see
    /// [`Host::last_deaf_gap`]): the grace then runs from the gap's end.
    pub fn handle_agent_gone(&mut self, key: &ResourceKey, silent_ms: u64, now: Timestamp) {
        self.heard(now);
        if self.links.get(&key.node) == Some(&Link::Connected(key.attempt)) {
            let last_heard = Timestamp::from_millis(now.as_millis().saturating_sub(silent_ms));
            let since = last_heard.max(self.listening_since());
            self.start_grace(&key.node, key.attempt, since, 0);
        }
    }

    /// The replica layer's word on this host's leadership: how long it may
    /// act ([`Leadership`]). A host whose leadership lapsed folds its inputs
    /// as usual but writes and dispatches nothing (no journal write, pass,
    /// listing, collection or probe leaves it) until told of a later
    /// instant; then it goes on where it stopped.
    pub fn handle_leadership(&mut self, leadership: Leadership, now: Timestamp) {
        self.heard(now);
        self.leadership = leadership;
        if leadership.holds_at(now) {
            self.lapsed = false;
        }
    }

    /// What the run's rented machines have cost so far, as its providers
    /// count it now (`spent_micros`, millionths of a dollar). The larger of
    /// that and what the journal holds is the run's spend
    /// ([`Host::spent_micros`]), so a provider that lost its own records
    /// (a state file deleted, rentals adopted without their create) never
    /// makes the run look cheaper than it was. It is written to the journal
    /// once it has risen [`SPENT_RECORD_STEP_MICROS`] past what the journal
    /// holds. Returns the run's spend.
    pub fn handle_spent(&mut self, spent_micros: u64) -> u64 {
        self.spent_micros = self.spent_micros.max(spent_micros);
        if self.spent_micros
            >= self
                .meta
                .spent_micros
                .saturating_add(SPENT_RECORD_STEP_MICROS)
        {
            self.meta.spent_micros = self.spent_micros;
            self.meta_dirty = true;
        }
        self.spent_micros()
    }

    /// What the run has spent as far as this host knows: the most it was
    /// told ([`Host::handle_spent`]) or its journal holds.
    pub fn spent_micros(&self) -> u64 {
        self.spent_micros.max(self.meta.spent_micros)
    }

    /// The provider's answer to [`Output::Probe`]: whether the machine of
    /// `key`'s attempt is paused by the provider (`Ok(true)`), and so may
    /// resume. A paused machine of a group that waits keeps its node until
    /// the wait, counted from `now`, ends (or its agent's grace, if later);
    /// an agent back before then keeps the node as any rejoin does. A
    /// "paused" for an agent that is back already (or was never away) is
    /// stale and ignored: its machine runs. An error keeps the grace as it
    /// is, and says so.
    pub fn handle_probed(
        &mut self,
        key: &ResourceKey,
        paused: Result<bool, String>,
        now: Timestamp,
    ) {
        self.heard(now);
        let Some(n) = self.core.state().nodes.get(&key.node) else {
            return;
        };
        if n.attempt != key.attempt || n.intent != Intent::Active {
            return;
        }
        match paused {
            Err(e) => {
                self.events.push_back(HostEvent::Warning(format!(
                    "could not learn whether {key}'s machine was paused by its provider: {e}; \
                     it is lost at its grace's end"
                )));
            }
            Ok(false) => {
                if self
                    .preempted
                    .get(&key.node)
                    .is_some_and(|(a, _)| *a == key.attempt)
                {
                    self.preempted.remove(&key.node);
                }
            }
            Ok(true) => {
                let away = matches!(
                    self.links.get(&key.node),
                    Some(Link::Away { attempt, .. }) if *attempt == key.attempt
                );
                if !away {
                    return;
                }
                let since = match self.preempted.get(&key.node) {
                    Some((a, since)) if *a == key.attempt => *since,
                    _ => now,
                };
                self.preempted.insert(key.node, (key.attempt, since));
                let wait_until = self.preempt_until(&key.node, key.attempt);
                if let (Some(paused), Some(Link::Away { attempt, until })) =
                    (wait_until, self.links.get(&key.node).copied())
                    && attempt == key.attempt
                    && !self.held_lost.contains(&key.node)
                    && paused > until
                {
                    self.set_link(
                        &key.node,
                        Link::Away {
                            attempt,
                            until: paused,
                        },
                    );
                }
                self.events.push_back(HostEvent::Preempted {
                    key: key.clone(),
                    wait_until,
                });
            }
        }
    }

    /// The operator asks for `node`'s current attempt to be replaced: it is
    /// failed with the reason [`REPLACED_BY_OPERATOR`], exactly as if its
    /// agent had been lost, so the normal ladder cancels its bootstrap,
    /// destroys its lease and only then starts a new attempt (never two
    /// live attempts for one slot). Returns the attempt that will be
    /// replaced; the fold happens on the next [`Host::poll_output`], and the
    /// [`Reply::Replaced`] for `ticket` follows once the request is durable
    /// (the slot's record says so, and a host started from it replaces the
    /// attempt all the same), so a daemon that stops after the reply still
    /// replaces it.
    ///
    /// # Errors
    /// [`ReplaceError`]: an unknown slot, a node already failed or leaving,
    /// one with an operation in flight, or a cluster shutting down.
    pub fn handle_replace(
        &mut self,
        node: &LogicalNodeId,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<NodeAttemptId, ReplaceError> {
        self.heard(now);
        if self.stopped || self.shutdown.is_some() {
            return Err(ReplaceError::ShuttingDown);
        }
        let Some(n) = self.core.state().nodes.get(node) else {
            return Err(ReplaceError::UnknownNode(*node));
        };
        if n.intent != Intent::Active
            || matches!(n.record.stage, NodeStage::Failed | NodeStage::Destroyed)
        {
            return Err(ReplaceError::NotActive(*node));
        }
        if let Some(p) = &n.pending {
            return Err(ReplaceError::Busy {
                node: *node,
                effect: p.effect,
            });
        }
        let attempt = n.attempt;
        self.todo.push_back(Todo::AgentLost(
            *node,
            attempt,
            FailureCause::Operator,
            REPLACED_BY_OPERATOR.to_owned(),
        ));
        // Durable before it is acknowledged: the slot's record says so, and
        // a host that starts from it replaces the attempt all the same.
        if let Some(r) = self.slots.get_mut(node).filter(|r| r.attempt == attempt) {
            r.replace = true;
            self.put.push(*node);
        }
        self.flush_delta();
        self.outputs
            .push_back(Output::Reply(ticket, Reply::Replaced(attempt)));
        Ok(attempt)
    }

    /// The executor lane `lane` crashed: every operation it held folds as ambiguous.
    pub fn handle_lane_lost(&mut self, lane: u32) {
        let lost: Vec<(OperationId, LogicalNodeId)> = self
            .in_flight
            .iter()
            .filter(|(_, op)| self.lane_of(op.attempt) == lane)
            .map(|(node, op)| (*op, node))
            .collect();
        if !lost.is_empty() {
            self.warn(format!(
                "executor lane {lane} crashed holding {} operation(s); folding them as ambiguous",
                lost.len()
            ));
        }
        for (op, node) in lost {
            self.in_flight.remove(&node);
            self.todo.push_back(Todo::LaneLost(op, node));
        }
    }

    /// An orphan's collection finished (or failed, and is retried after
    /// backoff). A collection the provider gave up is over, as a done one
    /// is, and people are told what may still hold a machine.
    pub fn handle_collected(
        &mut self,
        key: &ResourceKey,
        outcome: Result<crate::Release, String>,
        now: Timestamp,
    ) {
        self.heard(now);
        let Some(c) = self.collects.get_mut(key) else {
            return;
        };
        match outcome {
            Ok(release) => {
                self.collects.remove(key);
                self.events.push_back(HostEvent::Collected {
                    key: key.clone(),
                    error: None,
                });
                if let crate::Release::GivenUp(reason) = release {
                    self.given_up_total = self.given_up_total.saturating_add(1);
                    self.events.push_back(HostEvent::GivenUp {
                        key: key.clone(),
                        reason,
                    });
                }
            }
            Err(error) => {
                c.failures = c.failures.saturating_add(1);
                let delay = self.core.config().backoff_ms(key.attempt, c.failures);
                c.due = Some(now.saturating_add_ms(delay));
                self.events.push_back(HostEvent::Collected {
                    key: key.clone(),
                    error: Some(error),
                });
            }
        }
    }

    /// The host's timer fired: expires the core's deadlines and agents' graces.
    /// Returns how many core deadlines were folded.
    ///
    /// # Errors
    /// As [`Reconciler::handle_timeout`].
    pub fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        self.heard(now);
        self.expire_graces(now);
        let pending = &self.core.state().nodes;
        self.in_flight.retain(|node, op| {
            pending
                .get(&node)
                .and_then(|n| n.pending.as_ref())
                .is_some_and(|p| p.id == *op)
        });
        if self.core.poll_timeout().is_some_and(|at| at <= now) {
            let expired = self.core.handle_timeout(now)?;
            if expired > 0 {
                // An expiry may have failed attempts; which ones is not said.
                let nodes: Vec<LogicalNodeId> = self.slots.keys().collect();
                for node in &nodes {
                    self.record_failures(node);
                }
            }
            Ok(expired)
        } else {
            Ok(0)
        }
    }

    /// The daemon measured that, since its last report, it left ready work
    /// waiting for `starved_ms` in all before `now` (its event loop was
    /// starved by other work, or its process or machine stopped): time in
    /// which it could not have heard anybody, however loud. Such time
    /// counts against no agent:
    /// - every agent away gets it back on its grace, but never more than a
    ///   whole grace from `now`, so an agent that really died is still
    ///   lost at most one grace after the daemon listens again;
    /// - a running bootstrap's stall deadline moves on by it.
    ///
    /// A stop long enough to leave a deaf gap in the host's inputs (see
    /// [`Host::last_deaf_gap`]) may be reported here as well; the grace rule
    /// is then already met, and a stall deadline may move by it twice,
    /// which errs on the side of the node.
    pub fn handle_starved(&mut self, starved_ms: u64, now: Timestamp) {
        self.heard(now);
        if starved_ms == 0 {
            return;
        }
        self.starved_ms = self.starved_ms.saturating_add(starved_ms);
        let away: Vec<(LogicalNodeId, NodeAttemptId, Timestamp)> = self
            .links
            .iter()
            .filter_map(|(n, l)| match l {
                Link::Away { attempt, until } => Some((n, *attempt, *until)),
                Link::Connected(_) => None,
            })
            .collect();
        for (node, attempt, until) in away {
            if self.held_lost.contains(&node) {
                continue;
            }
            let cap = now.saturating_add_ms(self.grace_of(&node));
            let later = until.saturating_add_ms(starved_ms).min(cap);
            if later > until {
                self.set_link(
                    &node,
                    Link::Away {
                        attempt,
                        until: later,
                    },
                );
            }
        }
        let from = Timestamp::from_millis(now.as_millis().saturating_sub(starved_ms));
        self.core.handle_unheard(from, now);
    }

    /// Milliseconds the daemon reported starved in all
    /// ([`Host::handle_starved`]).
    pub fn starved_ms(&self) -> u64 {
        self.starved_ms
    }

    /// How many releases providers gave up (see [`HostEvent::GivenUp`])
    /// since this host started.
    pub fn given_up_total(&self) -> u64 {
        self.given_up_total
    }

    /// The periodic safety-net tick.
    pub fn handle_tick(&mut self, now: Timestamp) {
        self.heard(now);
        self.expire_graces(now);
        self.core.handle_tick(now);
    }

    // ----- outputs -----
}
