//! Adoption and sweeps: taking a provider's inventory, adopting what the
//! journal names, asking again when a listing lags, and collecting orphans.

use super::*;

impl<C: Reconciler> Host<C> {
    pub(super) fn schedule_sweep(&mut self, now: Timestamp) {
        let every = self.config.sweep_interval_ms;
        self.sweep_at = (every > 0).then(|| now.saturating_add_ms(every));
    }

    /// Collects what a listing shows that no slot's current attempt owns.
    pub(super) fn sweep(&mut self, listed: Vec<Listed>, now: Timestamp) {
        let mut orphans = Vec::new();
        for l in listed {
            if l.key.run_id != self.meta.run_id || self.collects.contains_key(&l.key) {
                continue;
            }
            let owned = self
                .core
                .state()
                .nodes
                .get(&l.key.node)
                .is_some_and(|n| n.attempt == l.key.attempt);
            if owned || (l.lease.is_none() && l.session.is_none()) {
                continue;
            }
            orphans.push(l.key.clone());
            self.collects.insert(
                l.key.clone(),
                Collect {
                    request: CollectRequest {
                        key: l.key,
                        lease: l.lease,
                        session: l.session,
                    },
                    failures: 0,
                    due: Some(now),
                },
            );
        }
        self.verify = false;
        if !orphans.is_empty() {
            self.events.push_back(HostEvent::Swept { orphans });
        }
        self.schedule_sweep(now);
    }

    /// Whether the adoption waits for a second listing: the first one
    /// misses an attempt the journal names that adoption would take as
    /// gone (seen created, or made from a template its slot no longer
    /// wants, so not re-created to find out), and the provider's listing
    /// may lag. Taking it as gone at once would start its slot's next
    /// attempt while it may still appear: an earlier daemon's create, sent
    /// just before it died, can land after the restart's listing.
    pub(super) fn relist_first(&mut self, now: Timestamp) -> bool {
        let window = self.config.visibility_window_ms;
        if self.relisted || window == 0 {
            return false;
        }
        let Adoption::Waiting(listed) = &self.adoption else {
            return false;
        };
        let listed_keys: BTreeSet<ResourceKey> = listed.iter().map(|l| l.key.clone()).collect();
        let missing = self
            .unlisted(&listed_keys)
            .iter()
            .filter(|u| u.created || !u.wanted)
            .count();
        if missing == 0 {
            return false;
        }
        let Adoption::Waiting(first) = std::mem::replace(&mut self.adoption, Adoption::Listing)
        else {
            return false;
        };
        self.adoption = Adoption::Relisting(first);
        self.sweep_at = Some(now.saturating_add_ms(window));
        self.warn(format!(
            "the provider does not list {missing} attempt(s) the journal names; looking again \
             in {} s before deciding anything (a create cut off by the last stop may still land)",
            window as f64 / 1000.0
        ));
        true
    }

    /// The journal's attempts that `listed` does not hold, in slot order.
    pub(super) fn unlisted(&mut self, listed: &BTreeSet<ResourceKey>) -> Vec<Unlisted> {
        // The digest of each slot's desired template, where it has one.
        let templates: Vec<(LogicalNodeId, Arc<NodeTemplate>)> = self
            .slots
            .keys()
            .filter_map(|node| Some((node, self.core.desired().slot(&node)?.clone())))
            .collect();
        let desired: BTreeMap<LogicalNodeId, u64> = templates
            .into_iter()
            .map(|(node, t)| (node, self.digest(&t)))
            .collect();
        let run = &self.meta.run_id;
        self.slots
            .iter()
            .filter_map(|(node, r)| {
                let key = ResourceKey {
                    run_id: run.clone(),
                    node,
                    attempt: r.attempt,
                };
                (!listed.contains(&key)).then(|| Unlisted {
                    key,
                    created: r.created,
                    wanted: desired.get(&node) == Some(&r.template),
                    failures: r.failures,
                })
            })
            .collect()
    }

    /// Adopts the journal's records and the inventory once both it and a
    /// desired state (a shape, or a teardown) are known.
    pub(super) fn adopt_if_ready(&mut self, now: Timestamp) {
        let nothing_held =
            matches!(&self.adoption, Adoption::Waiting(l) if l.is_empty()) && self.slots.is_empty();
        let judged =
            self.core.desired().generation.0 > 0 || self.shutdown.is_some() || nothing_held;
        if !judged || !matches!(self.adoption, Adoption::Waiting(_)) {
            return;
        }
        if self.relist_first(now) {
            return;
        }
        let Adoption::Waiting(listed) = std::mem::replace(&mut self.adoption, Adoption::Done)
        else {
            return;
        };
        // What each key holds, as listed; journal records join in below.
        let mut held: BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)> = BTreeMap::new();
        for l in listed {
            held.insert(l.key, (l.lease, l.session));
        }
        if self.config.adopt_unrecorded && self.slots.is_empty() {
            self.record_unrecorded(&held);
        }
        let mut keys: BTreeSet<ResourceKey> = held.keys().cloned().collect();
        let presumed_gone = self.judge_unlisted(&mut keys);
        let entries = self.adoption_entries(keys, &held);
        let report = self.core.adopt(entries, self.meta.epoch << 32);
        self.take_adopted(report, &held, presumed_gone, now);
    }

    /// Judges the attempts the journal names that the listing does not
    /// hold: the ones worth a re-issued create join `keys`, the others are
    /// presumed gone (returned, and their slots dropped).
    fn judge_unlisted(&mut self, keys: &mut BTreeSet<ResourceKey>) -> Vec<ResourceKey> {
        let mut presumed_gone = Vec::new();
        let listed_keys: BTreeSet<ResourceKey> = keys.clone();
        for Unlisted {
            key,
            created,
            wanted,
            failures,
        } in self.unlisted(&listed_keys)
        {
            if created {
                // It existed and is not listed: gone (or not visible yet).
                // Making it again would make a second machine of one
                // identity; a sweep finds it if it is only invisible.
                if wanted {
                    // Its slot's next attempt carries on from its failures.
                    self.core.carry_failures(key.node, failures);
                }
                presumed_gone.push(key);
            } else if wanted {
                // Maybe never made, maybe not visible yet: the re-issued
                // create makes it once or finds it by its key.
                keys.insert(key);
            } else {
                // Maybe never made, and not wanted as it would be: its slot
                // is gone or wants another template. Creating it to find
                // out would make a machine only to destroy it (and the
                // template it was made from is not kept), so it is taken
                // as never made; a sweep collects it if it was.
                presumed_gone.push(key);
            }
        }
        for key in &presumed_gone {
            self.slots.remove(&key.node);
            self.remove.insert(key.node);
        }
        // Listed twice already (a listing lag apart): nothing more to verify.
        if !presumed_gone.is_empty() && !self.relisted {
            self.verify = true;
        }
        presumed_gone
    }

    /// What the core is asked to adopt for `keys`: each key's template
    /// (the one its record names, if still known), what the listing holds
    /// for it, and its recorded failures.
    fn adoption_entries(
        &mut self,
        keys: BTreeSet<ResourceKey>,
        held: &BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)>,
    ) -> Vec<AdoptEntry> {
        // Templates slots may run, by digest, each shared by Arc: the older
        // ones the journal kept, and the desired ones (a slot of one group
        // may run what another group wants now).
        let mut known: Vec<(u64, Arc<NodeTemplate>)> = self
            .meta
            .retired
            .iter()
            .map(|t| (t.digest(), Arc::new(t.clone())))
            .collect();
        for t in self.desired_templates() {
            known.push((self.digest(&t), t));
        }
        let mut entries = Vec::with_capacity(keys.len());
        for key in keys {
            let desired = self.core.desired().slot(&key.node).cloned();
            let recorded = self.slots.get(&key.node).copied();
            let template = match (desired, recorded) {
                // Its replacement was asked for and acknowledged: replaced.
                (_, Some(r)) if r.attempt == key.attempt && r.replace => None,
                (Some(d), Some(r)) if r.attempt == key.attempt && r.template == self.digest(&d) => {
                    Some(d)
                }
                (Some(_), Some(r)) if r.attempt == key.attempt => known
                    .iter()
                    .find(|(digest, _)| *digest == r.template)
                    .map(|(_, t)| t.clone()),
                _ => None,
            };
            let (lease, session) = held.get(&key).cloned().unwrap_or_default();
            let failures = recorded
                .filter(|r| r.attempt == key.attempt)
                .map_or(0, |r| r.failures);
            entries.push(AdoptEntry {
                key,
                template,
                lease,
                session,
                failures,
            });
        }
        entries
    }

    /// Takes the core's adoption report: records what was adopted, queues
    /// the orphans' collection, warns of other runs' resources, schedules
    /// the first sweep and answers whoever waited for the adoption.
    fn take_adopted(
        &mut self,
        report: crate::driver::Adoption,
        held: &BTreeMap<ResourceKey, (Option<LeaseId>, Option<SessionId>)>,
        presumed_gone: Vec<ResourceKey>,
        now: Timestamp,
    ) {
        for key in &report.adopted {
            self.record_slot(&key.node);
            if held.get(key).is_some_and(|(lease, _)| lease.is_some()) {
                self.record_created(&key.node, key.attempt);
            }
            if let Some(s) = &mut self.shutdown {
                s.nodes.insert(key.node);
            }
        }
        for key in &report.orphans {
            let (lease, session) = held.get(key).cloned().unwrap_or_default();
            if lease.is_none() && session.is_none() {
                // Known only to the journal and not listed: nothing to destroy.
                continue;
            }
            self.collects.insert(
                key.clone(),
                Collect {
                    request: CollectRequest {
                        key: key.clone(),
                        lease,
                        session,
                    },
                    failures: 0,
                    due: Some(now),
                },
            );
        }
        if !report.foreign.is_empty() {
            self.warn(format!(
                "the provider listed {} resource(s) of other runs; they are left alone",
                report.foreign.len()
            ));
        }
        let first = if self.verify {
            self.config.visibility_window_ms
        } else {
            self.config.sweep_interval_ms
        };
        self.sweep_at = (self.verify || first > 0).then(|| now.saturating_add_ms(first));
        self.events.push_back(HostEvent::Adopted {
            adopted: report.adopted,
            presumed_gone,
            drifted: report.drifted,
            orphans: report.orphans,
            foreign: report.foreign,
        });
        for t in std::mem::take(&mut self.adopt_waiters) {
            self.outputs.push_back(Output::Reply(t, Reply::Adopted));
        }
    }
}
