//! What the host keeps durable: the journal deltas it emits, the slot
//! records and attempt reservations they carry, and retired templates.

use super::*;

impl<C: Reconciler> Host<C> {
    pub(super) fn digest(&mut self, template: &Arc<NodeTemplate>) -> u64 {
        if let Some((_, d)) = self.digests.iter().find(|(t, _)| Arc::ptr_eq(t, template)) {
            return *d;
        }
        let d = template.digest();
        // A handful of live templates at a time; keep the cache small.
        if self.digests.len() >= 64 {
            self.digests.remove(0);
        }
        self.digests.push((template.clone(), d));
        d
    }

    /// Moves the pending durable changes into the output stream. True if it did.
    pub(super) fn flush_delta(&mut self) -> bool {
        if !self.meta_dirty && self.put.is_empty() && self.remove.is_empty() {
            return false;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let delta = JournalDelta {
            seq,
            meta: self.meta_dirty.then(|| self.meta.clone()),
            put: self.changed_records(),
            remove: std::mem::take(&mut self.remove).into_iter().collect(),
        };
        self.meta_dirty = false;
        self.outputs.push_back(Output::Persist(delta));
        true
    }

    /// The records of the slots changed since the last flush, once each, in
    /// slot order; a slot changed and then removed has none (its removal is
    /// written instead).
    pub(super) fn changed_records(&mut self) -> Vec<(LogicalNodeId, SlotRecord)> {
        let mut changed = std::mem::take(&mut self.put);
        // Stable: the list comes in a few sorted runs (a pass's slots, then
        // each result batch's), which a merge sort takes as they are; an
        // unstable sort cost 30 M more instructions at 100k.
        changed.sort();
        changed.dedup();
        changed
            .into_iter()
            .filter_map(|node| Some((node, *self.slots.get(&node)?)))
            .collect()
    }

    /// `node`'s `attempt` released something only by giving it up (see
    /// [`crate::Release::GivenUp`]): people are told, now and in the
    /// attempt's history, that it may still hold a machine.
    pub(super) fn given_up(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        reason: String,
    ) {
        if let Some(r) = self
            .history
            .get_mut(node)
            .and_then(|h| h.latest.as_mut())
            .filter(|r| r.attempt == attempt)
        {
            r.notes().left_behind = Some(reason.clone());
        }
        self.given_up_total = self.given_up_total.saturating_add(1);
        let key = ResourceKey {
            run_id: self.meta.run_id.clone(),
            node: *node,
            attempt,
        };
        self.events.push_back(HostEvent::GivenUp { key, reason });
    }

    /// A lease of `node`'s `attempt` was seen created: a later host must never make it again.
    pub(super) fn record_created(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) {
        let Some(r) = self.slots.get_mut(node) else {
            return;
        };
        if r.attempt == attempt && !r.created {
            r.created = true;
            self.put.push(*node);
        }
    }

    pub(super) fn record_slot(&mut self, node: &LogicalNodeId) {
        let current = self
            .core
            .state()
            .nodes
            .get(node)
            .map(|n| (n.attempt, n.template.clone(), n.retry.template_failures()));
        match current {
            Some((attempt, template, failures)) => {
                if self.slots.get(node).is_some_and(|r| r.attempt == attempt) {
                    self.record_failures(node);
                    return;
                }
                let record = SlotRecord {
                    attempt,
                    template: self.digest(&template),
                    created: false,
                    failures,
                    replace: false,
                };
                self.slots.insert(*node, record);
                self.remove.remove(node);
                self.put.push(*node);
            }
            None => {
                if self.slots.remove(node).is_some() {
                    self.remove.insert(*node);
                }
            }
        }
    }

    /// The template of each desired group, in group order.
    pub(super) fn desired_templates(&self) -> Vec<Arc<NodeTemplate>> {
        self.core
            .desired()
            .groups
            .iter()
            .map(|g| g.template.clone())
            .collect()
    }

    /// Keeps, among the templates desired `before` a shape change and those
    /// retired earlier, the ones some slot record still names and no group
    /// of the desired state does (see [`JournalMeta::retired`]).
    pub(super) fn retire_templates(&mut self, before: &[Arc<NodeTemplate>]) {
        let named: BTreeSet<u64> = self.slots.values().map(|r| r.template).collect();
        let desired = self.desired_templates();
        let mut skip: BTreeSet<u64> = desired.iter().map(|t| self.digest(t)).collect();
        let earlier = std::mem::take(&mut self.meta.retired);
        let mut kept = Vec::new();
        for t in before.iter().map(|t| (**t).clone()).chain(earlier) {
            let d = t.digest();
            if named.contains(&d) && skip.insert(d) {
                kept.push(t);
            }
        }
        if !kept.is_empty() || !self.meta.retired.is_empty() {
            self.meta_dirty = true;
        }
        self.meta.retired = kept;
    }

    /// Brings the failure count in `node`'s slot record up to date with
    /// its current attempt (a change is journaled like any record).
    pub(super) fn record_failures(&mut self, node: &LogicalNodeId) {
        let Some(n) = self.core.state().nodes.get(node) else {
            return;
        };
        let (attempt, failures) = (n.attempt, n.retry.template_failures());
        if let Some(r) = self.slots.get_mut(node)
            && r.attempt == attempt
            && r.failures != failures
        {
            r.failures = failures;
            self.put.push(*node);
        }
    }

    /// Before a pass, makes sure every attempt id it may hand out is covered
    /// by a durable reservation. True if a persist had to be queued.
    pub(super) fn reserve_attempts(&mut self) -> bool {
        // A pass gives at most one new attempt to each desired slot (surge
        // slots included).
        let bound = self.core.desired().peak_node_count().saturating_add(1);
        let next = self.core.state().next_attempt;
        if next.saturating_add(bound) <= self.meta.attempts_reserved {
            return false;
        }
        self.meta.attempts_reserved = next
            .saturating_add(bound.saturating_mul(2))
            .saturating_add(64);
        self.meta_dirty = true;
        self.flush_delta()
    }

    /// Writes a record for the latest listed attempt of each desired slot,
    /// as if the journal had held it: its desired template, created if it
    /// has a lease (see [`HostConfig::adopt_unrecorded`]).
    pub(super) fn record_unrecorded(
        &mut self,
        held: &BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)>,
    ) {
        let mut latest: BTreeMap<LogicalNodeId, (NodeAttemptId, bool)> = BTreeMap::new();
        for (key, (lease, _)) in held {
            if key.run_id != self.meta.run_id || self.core.desired().slot(&key.node).is_none() {
                continue;
            }
            let e = latest
                .entry(key.node)
                .or_insert((key.attempt, lease.is_some()));
            if key.attempt > e.0 {
                *e = (key.attempt, lease.is_some());
            }
        }
        let count = latest.len();
        for (node, (attempt, created)) in latest {
            let Some(template) = self.core.desired().slot(&node).cloned() else {
                continue;
            };
            let record = SlotRecord {
                attempt,
                template: self.digest(&template),
                created,
                failures: 0,
                replace: false,
            };
            self.slots.insert(node, record);
            self.put.push(node);
        }
        if count > 0 {
            self.warn(format!(
                "took {count} resource(s) no journal recorded as the shape's nodes (--adopt)"
            ));
        }
    }
}
