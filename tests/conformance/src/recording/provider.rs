//! The provider's ground truth for a case, as the recording reports it.

use crate::backend::KeyStats;
use crate::oracle::ProviderView;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use swactor_provisioning::flight::FlightInput;
use swactor_provisioning::{
    BootstrapEvent, CollectRequest, Dispatch, EffectRequest, LeaseId, LogicalNodeId, NodeAttemptId,
    NodeTemplate, OperationId, OperationOutcome, OperationResult, Pass, ResourceKey, RunId,
    SessionId, Timestamp,
};

/// A lease or session as the recording reports it.
#[derive(Clone, Debug)]
struct Made {
    /// Whom it was made for.
    key: ResourceKey,
    /// Whether nothing the recording reports has removed it.
    live: bool,
    /// Whether a listing has shown it (so a later listing without it says
    /// it is gone).
    listed: bool,
    /// Whether a start of this life answered it (sessions).
    started: bool,
    /// When it was first named.
    since: Timestamp,
    /// The template of the create whose answer first named it (leases).
    template: Option<Arc<NodeTemplate>>,
}

/// The provider as a recording reports it: the oracle's ground truth for a
/// case (see the module docs for what it can and cannot know).
#[derive(Clone, Debug)]
pub(super) struct RecordedProvider {
    pub(super) run_id: RunId,
    leases: BTreeMap<LeaseId, Made>,
    sessions: BTreeMap<SessionId, Made>,
    /// CreateLease dispatches, per key.
    creates: BTreeMap<ResourceKey, u32>,
    /// Every dispatch handed out in this life.
    pub(super) ops: BTreeMap<OperationId, Dispatch>,
    /// Collections asked for and not yet reported done.
    pub(super) collecting: BTreeMap<ResourceKey, CollectRequest>,
    /// Sessions whose stream reported its end.
    closed: BTreeSet<SessionId>,
    /// The provider's visibility window, as the host was configured.
    visibility_window_ms: u64,
    /// The instant of the last answer or listing.
    now: Timestamp,
}

impl RecordedProvider {
    pub(super) fn new(run_id: RunId, visibility_window_ms: u64) -> Self {
        Self {
            run_id,
            leases: BTreeMap::new(),
            sessions: BTreeMap::new(),
            creates: BTreeMap::new(),
            ops: BTreeMap::new(),
            collecting: BTreeMap::new(),
            closed: BTreeSet::new(),
            visibility_window_ms,
            now: Timestamp(0),
        }
    }

    /// What an input says the provider did, learnt before the host hears
    /// it (the provider acted before its answer came back).
    pub(super) fn learn(&mut self, input: &FlightInput<'_>) {
        match input {
            FlightInput::Inventory { listed, now } => {
                let Ok(listed) = listed.as_ref() else { return };
                // What a listing leaves out is gone if an earlier listing
                // showed it, or if it is older than the provider's
                // visibility window (the host's own setting: a younger one
                // may only be invisible yet).
                let window = self.visibility_window_ms;
                let gone = |m: &Made| m.listed || now.0 >= m.since.0.saturating_add(window);
                let leases: BTreeSet<&LeaseId> = listed.iter().flat_map(|l| &l.lease).collect();
                let sessions: BTreeSet<&SessionId> =
                    listed.iter().flat_map(|l| &l.session).collect();
                for (id, m) in &mut self.leases {
                    m.live &= leases.contains(id) || !gone(m);
                }
                for (id, m) in &mut self.sessions {
                    m.live &= sessions.contains(id) || !gone(m);
                }
                self.now = *now;
                for l in listed {
                    if let Some(lease) = &l.lease {
                        self.made_lease(lease, &l.key, None);
                        if let Some(m) = self.leases.get_mut(lease) {
                            m.listed = true;
                        }
                    }
                    if let Some(session) = &l.session {
                        self.made_session(session, &l.key, false);
                        if let Some(m) = self.sessions.get_mut(session) {
                            m.listed = true;
                        }
                    }
                }
            }
            FlightInput::Result { result, now } => {
                self.now = *now;
                self.answered(result);
            }
            FlightInput::Bootstrap { obs, .. } if obs.event == BootstrapEvent::Closed => {
                // The stream's end can come before its start's answer.
                self.closed.insert(obs.session.clone());
                if let Some(s) = self.sessions.get_mut(&obs.session) {
                    s.live = false;
                }
            }
            FlightInput::Collected { key, outcome, .. } if outcome.is_ok() => {
                if let Some(request) = self.collecting.remove(key.as_ref()) {
                    if let Some(lease) = &request.lease {
                        self.destroyed(lease);
                    }
                    if let Some(session) = &request.session
                        && let Some(s) = self.sessions.get_mut(session)
                    {
                        s.live = false;
                    }
                }
                self.end_key(key);
            }
            _ => {}
        }
    }

    /// A pass's dispatches, remembered for the answers to come.
    pub(super) fn dispatched(&mut self, pass: &Pass) {
        for d in &pass.dispatches {
            if matches!(d.request, EffectRequest::CreateLease { .. }) {
                *self.creates.entry(d.key.clone()).or_default() += 1;
            }
            self.ops.insert(d.op, d.clone());
        }
    }

    /// An operation's answer: what it made or removed.
    fn answered(&mut self, result: &OperationResult) {
        let dispatch = self.ops.get(&result.op);
        let request = dispatch.map(|d| d.request.clone());
        let key = dispatch.map_or_else(
            || ResourceKey {
                run_id: self.run_id.clone(),
                node: result.node,
                attempt: result.op.attempt,
            },
            |d| d.key.clone(),
        );
        match (&result.outcome, request) {
            (
                OperationOutcome::LeaseCreated { lease, .. },
                Some(EffectRequest::CreateLease { template }),
            ) => self.made_lease(lease, &key, Some(template)),
            (OperationOutcome::LeaseCreated { lease, .. }, _) => self.made_lease(lease, &key, None),
            (OperationOutcome::BootstrapStarted { session }, _) => {
                self.made_session(session, &key, true);
            }
            (
                OperationOutcome::BootstrapCancelled | OperationOutcome::BootstrapGivenUp { .. },
                Some(EffectRequest::CancelBootstrap { session }),
            ) => {
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.live = false;
                }
            }
            (
                OperationOutcome::BootstrapCancelled | OperationOutcome::BootstrapGivenUp { .. },
                _,
            ) => {
                for s in self.sessions.values_mut().filter(|s| s.key == key) {
                    s.live = false;
                }
            }
            (
                OperationOutcome::LeaseDestroyed | OperationOutcome::LeaseGivenUp { .. },
                Some(EffectRequest::DestroyLease { lease, .. }),
            ) => self.destroyed(&lease),
            (OperationOutcome::LeaseDestroyed | OperationOutcome::LeaseGivenUp { .. }, _) => {
                self.end_key(&key);
            }
            _ => {}
        }
    }

    /// A lease is named for the first time (later names change nothing).
    fn made_lease(
        &mut self,
        lease: &LeaseId,
        key: &ResourceKey,
        template: Option<Arc<NodeTemplate>>,
    ) {
        self.leases.entry(lease.clone()).or_insert_with(|| Made {
            key: key.clone(),
            live: true,
            listed: false,
            started: false,
            since: self.now,
            template,
        });
    }

    /// A session is named for the first time. When a start answers it, a
    /// session of the same key that only a listing showed has ended: a
    /// start adopts the key's running session (the provider's contract),
    /// and its stream's end was reported to no host of this life.
    fn made_session(&mut self, session: &SessionId, key: &ResourceKey, started: bool) {
        if started && !self.sessions.contains_key(session) {
            for m in self
                .sessions
                .values_mut()
                .filter(|m| m.key == *key && m.listed && !m.started)
            {
                m.live = false;
            }
        }
        let closed = self.closed.contains(session);
        let made = self
            .sessions
            .entry(session.clone())
            .or_insert_with(|| Made {
                key: key.clone(),
                live: !closed,
                listed: false,
                started: false,
                since: self.now,
                template: None,
            });
        made.started |= started;
    }

    /// A lease was destroyed, and the sessions on its machine with it.
    fn destroyed(&mut self, lease: &LeaseId) {
        let Some(l) = self.leases.get_mut(lease) else {
            return;
        };
        l.live = false;
        let key = l.key.clone();
        for s in self.sessions.values_mut().filter(|s| s.key == key) {
            s.live = false;
        }
    }

    /// Everything of `key` is gone.
    fn end_key(&mut self, key: &ResourceKey) {
        for m in self
            .leases
            .values_mut()
            .chain(self.sessions.values_mut())
            .filter(|m| m.key == *key)
        {
            m.live = false;
        }
    }
}

impl ProviderView for RecordedProvider {
    fn lease_owner(&self, lease: &LeaseId) -> Option<(&ResourceKey, bool)> {
        self.leases.get(lease).map(|m| (&m.key, m.live))
    }

    fn session_owner(&self, session: &SessionId) -> Option<(&ResourceKey, bool)> {
        self.sessions.get(session).map(|m| (&m.key, m.live))
    }

    fn live_keys(&self) -> Vec<ResourceKey> {
        self.leases
            .values()
            .chain(self.sessions.values())
            .filter(|m| m.live)
            .map(|m| m.key.clone())
            .collect()
    }

    fn key_stats(&self) -> Vec<(&ResourceKey, KeyStats)> {
        let mut stats: BTreeMap<&ResourceKey, KeyStats> = BTreeMap::new();
        for (key, n) in &self.creates {
            stats.entry(key).or_default().create_lease_calls = *n;
        }
        for m in self.leases.values() {
            let s = stats.entry(&m.key).or_default();
            s.leases_created += 1;
            s.live_leases += u32::from(m.live);
        }
        for m in self.sessions.values() {
            let s = stats.entry(&m.key).or_default();
            s.sessions_started += 1;
            s.open_sessions += u32::from(m.live);
        }
        stats.into_iter().collect()
    }

    fn in_flight(&self, _: &LogicalNodeId, _: NodeAttemptId) -> usize {
        // What the provider was still running is not recorded.
        0
    }

    fn lease_template(&self, lease: &LeaseId) -> Option<&NodeTemplate> {
        self.leases.get(lease)?.template.as_deref()
    }

    fn overlaps(&self) -> u64 {
        // Nor when it ran what it ran.
        0
    }
}
