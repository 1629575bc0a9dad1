//! Grace periods and holds: how long an away or preempted node is waited
//! for, and which groups hold back replacements (their breakers).

use super::*;

impl<C: Reconciler> Host<C> {
    /// The lease `node`'s agent holds its node on (its group's
    /// `orphan_after_s`; the default for a group no longer desired): it
    /// ends the node itself that long after its daemon stops renewing it.
    /// 0: never.
    pub fn orphan_after_s(&self, node: &LogicalNodeId) -> u32 {
        self.orphan_lease(node).0
    }

    /// `node`'s lease and whether it waits for the node's jobs.
    pub(super) fn orphan_lease(&self, node: &LogicalNodeId) -> (u32, crate::OrphanPolicy) {
        let d = crate::GroupPolicy::default();
        self.core
            .desired()
            .group(&node.group)
            .map_or((d.orphan_after_s, d.orphan_policy), |g| {
                (g.policy.orphan_after_s, g.policy.orphan_policy)
            })
    }

    /// How long `node`'s group waits for a machine its provider paused
    /// (`None`: it does not).
    pub(super) fn preempt_wait_ms(&self, node: &LogicalNodeId) -> Option<u64> {
        self.core
            .desired()
            .group(&node.group)
            .and_then(|g| g.policy.on_preempt.wait_ms())
    }

    /// The end of the wait for `node`'s paused machine, if this attempt's
    /// machine was found paused and its group waits.
    pub(super) fn preempt_until(
        &self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
    ) -> Option<Timestamp> {
        let (a, since) = self.preempted.get(node).copied()?;
        (a == attempt).then_some(())?;
        Some(since.saturating_add_ms(self.preempt_wait_ms(node)?))
    }

    pub(super) fn start_grace(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        now: Timestamp,
        at_least_ms: u64,
    ) {
        let Some(n) = self.core.state().nodes.get(node) else {
            return;
        };
        if n.attempt != attempt || n.intent != Intent::Active {
            return;
        }
        let grace = n.template.join.lost_grace_ms().max(at_least_ms);
        let lease = n.record.lease.clone();
        let mut until = now.saturating_add_ms(grace);
        if let Some(paused) = self.preempt_until(node, attempt) {
            until = until.max(paused);
        }
        self.set_link(node, Link::Away { attempt, until });
        let key = ResourceKey {
            run_id: self.meta.run_id.clone(),
            node: *node,
            attempt,
        };
        if let Some(lease) = lease
            && self.preempt_wait_ms(node).is_some()
        {
            // Whether its machine was paused decides how long it is kept.
            self.outputs.push_back(Output::Probe {
                key: key.clone(),
                lease,
            });
        }
        self.events.push_back(HostEvent::AgentDisconnected {
            key,
            grace_until: until,
        });
    }

    /// A stream says the agent joined, but not this host: give it its grace.
    pub(super) fn joined_before(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        now: Timestamp,
    ) {
        if self.links.contains_key(node) {
            return;
        }
        self.start_grace(node, attempt, now, self.config.rejoin_window_ms);
    }

    pub(super) fn expire_graces(&mut self, now: Timestamp) {
        while let Some((at, node)) = self.graces.first().cloned().filter(|(at, _)| *at <= now) {
            if self.breaker(&node.group).is_some() {
                // Counted as away (it still is) while the breaker is
                // checked; kept so, with no deadline, until released.
                self.graces.remove(&(at, node));
                self.held_lost.insert(node);
                continue;
            }
            self.graces.remove(&(at, node));
            let Some(Link::Away { attempt, .. }) = self.links.remove(&node) else {
                continue;
            };
            let (cause, reason) = match self.preempted.remove(&node) {
                Some((a, _)) if a == attempt => (FailureCause::Preempted, PAUSED_PAST_WAIT),
                _ => (FailureCause::AgentLost, AWAY_PAST_GRACE),
            };
            self.todo
                .push_back(Todo::AgentLost(node, attempt, cause, reason.to_owned()));
        }
    }

    /// Tells the core which groups' breakers are tripped (it holds their
    /// failed slots' restarts); a change queues a pass.
    pub(super) fn sync_tripped(&mut self) {
        let limited = self
            .core
            .desired()
            .groups
            .iter()
            .any(|g| g.policy.max_unhealthy.is_some());
        if !limited && self.tripped_none {
            return;
        }
        let tripped: BTreeSet<GroupId> = self
            .core
            .desired()
            .groups
            .iter()
            .filter(|g| g.policy.max_unhealthy.is_some() && self.breaker(&g.id).is_some())
            .map(|g| g.id)
            .collect();
        self.tripped_none = tripped.is_empty();
        self.core.set_tripped(tripped);
    }

    /// Gives the held agents of groups whose breaker is no longer tripped
    /// their grace again, counted from `now`: one that is back by then
    /// keeps its node; one that is not is lost, and replaced, as usual.
    pub(super) fn release_held(&mut self, now: Timestamp) {
        if self.held_lost.is_empty() {
            return;
        }
        let mut tripped: BTreeMap<GroupId, bool> = BTreeMap::new();
        let held: Vec<LogicalNodeId> = self.held_lost.iter().cloned().collect();
        for node in held {
            let trip = match tripped.get(&node.group) {
                Some(t) => *t,
                None => {
                    let t = self.breaker(&node.group).is_some();
                    tripped.insert(node.group, t);
                    t
                }
            };
            if trip {
                continue;
            }
            self.held_lost.remove(&node);
            let Some(Link::Away { attempt, .. }) = self.links.get(&node).copied() else {
                continue;
            };
            let grace = self.grace_of(&node);
            let until = now.saturating_add_ms(grace);
            self.set_link(&node, Link::Away { attempt, until });
        }
    }

    /// Works out what each group holds back now and announces the changes.
    pub(super) fn update_holds(&mut self) {
        let mut holds = BTreeMap::new();
        if self.shutdown.is_none() {
            for r in self.core.rollout_holds() {
                holds.insert((r.group, HoldKind::Rollout), r.to_string());
            }
        }
        for g in &self.core.desired().groups {
            if g.policy.max_unhealthy.is_some()
                && let Some(b) = self.breaker(&g.id)
            {
                holds.insert((g.id, HoldKind::Remediation), b.to_string());
            }
        }
        if holds == self.holds {
            return;
        }
        for (key, reason) in &holds {
            if self.holds.get(key) != Some(reason) {
                self.events.push_back(HostEvent::Hold {
                    group: key.0,
                    kind: key.1,
                    reason: Some(reason.clone()),
                });
            }
        }
        for key in self.holds.keys() {
            if !holds.contains_key(key) {
                self.events.push_back(HostEvent::Hold {
                    group: key.0,
                    kind: key.1,
                    reason: None,
                });
            }
        }
        self.holds = holds;
    }
}
