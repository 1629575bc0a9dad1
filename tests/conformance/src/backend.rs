//! A deterministic in-memory provider: leases, endpoints, bootstrap sessions and their faults.
//!
//! [`FakeBackend`] models what a real provider plus its bootstrap transport
//! look like from the executor's side, with no I/O and no clock: every call
//! takes `now`. It knows nothing about the driver or the harness, so a `fake`
//! provider crate can wrap it directly (one `FakeBackend` behind a mutex,
//! [`FakeBackend::execute`] per effect, [`FakeBackend::poll_observations`] on a
//! timer armed at [`FakeBackend::next_observation_at`]).
//!
//! # The provider contract it models
//! - Every resource is created under a [`ResourceKey`] (run, slot, attempt).
//!   [`FakeBackend::create_lease`] and [`FakeBackend::start_bootstrap`] first
//!   look for a live resource with that key and return it ("adopt").
//! - Cancel and destroy treat "already absent" as success.
//! - Provider errors are *definite*: an `Err` means the call had no effect.
//!   Ambiguity (an effect whose result is lost) is a property of the path
//!   between provider and driver, and is modelled by [`crate::FakeExecutor`].
//!
//! # Eventual visibility (kubermatic machine-controller#886)
//! A new lease shows up in the provider's *list-by-key* lookup only
//! [`BackendConfig::visibility_lag_ms`] after it was created, like a cloud API
//! whose list/describe calls are eventually consistent. Adoption by lookup
//! alone therefore cannot prevent a second create while the first one is
//! invisible. What does prevent it is the executor contract: the create call
//! itself carries the [`ResourceKey`] as an idempotency token (EC2's
//! `ClientToken`, GCE's `requestId`), and the provider answers a repeated
//! token with the resource it already made, visible or not. Set
//! [`BackendConfig::idempotent_create`] to `false` to model a provider without
//! tokens; the conformance battery then detects the double create.
//!
//! # Counting
//! The backend counts every create call and how many of them made a *new*
//! resource, per identity and in total ([`BackendCounters`], [`KeyStats`]), and
//! keeps every resource it ever made (dead ones too), so an oracle can ask who
//! owns a lease or session and whether anything is left behind.

use crate::rng::SimRng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use swactor_provisioning::{
    BootstrapEvent, BootstrapObservation, BootstrapStage, EffectKind, EffectRequest, FailureClass,
    LeaseId, Listed, NodeEndpoint, NodeTemplate, OperationOutcome, ResourceKey, RunId, SessionId,
    Timestamp,
};

/// Tunables of the fake provider. Plain data; every field has a sensible default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// How long after creation a lease becomes visible to list-by-key lookups.
    pub visibility_lag_ms: u64,
    /// Whether a create call is idempotent per [`ResourceKey`] even while the
    /// resource is not yet visible (an idempotency token). See the module docs.
    pub idempotent_create: bool,
    /// How long after creation a lease's endpoint becomes ready; zero means the
    /// create call already returns it.
    pub endpoint_delay_ms: u64,
    /// Spacing of the scripted bootstrap observations.
    pub bootstrap_step_ms: u64,
    /// Whether sessions close their stream after reporting convergence. An
    /// open stream is what lets an out-of-band deletion surface as `AgentLost`.
    pub close_after_converge: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            visibility_lag_ms: 0,
            idempotent_create: true,
            endpoint_delay_ms: 0,
            bootstrap_step_ms: 200,
            close_after_converge: false,
        }
    }
}

/// A one-shot fault armed in the provider; the next matching call consumes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderFault {
    /// The next call of `kind` is refused with a definite error and has no effect.
    Refuse {
        /// Which call to refuse.
        kind: EffectKind,
    },
    /// The next *new* lease never gets a ready endpoint (until [`FakeBackend::heal`]).
    EndpointNeverReady,
    /// The next *new* lease's endpoint becomes ready only after `delay_ms`.
    EndpointSlow {
        /// The readiness delay.
        delay_ms: u64,
    },
    /// The next *new* session fails at `stage` (one of the five failure stages).
    BootstrapFailsAt {
        /// The failure stage.
        stage: BootstrapStage,
    },
    /// The next *new* session loses the observations whose script index bit is set
    /// (bit 0 = SshConnect ... bit 4 = SwactorJoined, bit 5 = Converged, bit 6 = Closed).
    LoseObservations {
        /// The loss mask.
        mask: u8,
    },
    /// The next *new* session closes its stream after convergence.
    CloseAfterConverge,
    /// The next *new* lease becomes visible to lookups only after `lag_ms`.
    Invisible {
        /// The visibility lag.
        lag_ms: u64,
    },
}

/// Why a provider call failed. Every error is definite: the call had no effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderError {
    /// An armed [`ProviderFault::Refuse`] refused the call.
    Refused(EffectKind),
    /// The lease does not exist (never did, or is gone).
    NoSuchLease(LeaseId),
    /// A create named a provider kind this provider is not, as a daemon
    /// that routes calls by kind would answer (any kind but `"fake"`).
    UnknownKind(String),
}

/// The provider kind the world's shapes name; a create for any other kind
/// is refused, as a daemon with no provider of that kind would.
pub(crate) const PROVIDER_KIND: &str = "fake";

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(kind) => write!(f, "provider refused {kind:?}"),
            Self::NoSuchLease(l) => write!(f, "no such lease {}", l.0),
            Self::UnknownKind(kind) => write!(f, "no provider drives kind {kind:?}"),
        }
    }
}

/// How a create call found or made its resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A new resource was made.
    Created,
    /// An existing resource was found by the list-by-key lookup.
    AdoptedByLookup,
    /// The lookup missed it (not yet visible) but the idempotency token matched.
    AdoptedByToken,
}

/// What [`FakeBackend::create_lease`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease.
    pub lease: LeaseId,
    /// Its endpoint, if ready at the time of the call.
    pub endpoint: Option<NodeEndpoint>,
    /// New or adopted.
    pub origin: Origin,
}

/// What [`FakeBackend::start_bootstrap`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionGrant {
    /// The session.
    pub session: SessionId,
    /// New or adopted.
    pub origin: Origin,
}

/// One lease the backend ever made.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseInfo {
    /// The identity it was created for.
    pub key: ResourceKey,
    /// When it was created.
    pub created_at: Timestamp,
    /// When list-by-key lookups start to see it.
    pub visible_at: Timestamp,
    /// When its endpoint is ready; `None` for never.
    pub endpoint_ready_at: Option<Timestamp>,
    /// The endpoint it will have.
    pub endpoint: NodeEndpoint,
    /// False once destroyed or deleted out of band.
    pub live: bool,
    /// True when it was deleted out of band.
    pub deleted_out_of_band: bool,
    /// The template the create asked for (`None` when the caller gave none).
    pub template: Option<Arc<NodeTemplate>>,
}

/// One bootstrap session the backend ever started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// The identity it was started for.
    pub key: ResourceKey,
    /// The lease it runs on.
    pub lease: LeaseId,
    /// When it started.
    pub opened_at: Timestamp,
    /// False once the stream ended (cancelled, failed, closed, machine gone).
    pub open: bool,
    /// The script position of the next observation.
    next_step: u8,
    /// The failure stage the script ends in, if any.
    fail_at: Option<BootstrapStage>,
    /// Script steps whose observations are lost.
    lose_mask: u8,
    /// Whether the stream closes after convergence.
    close_after_converge: bool,
    /// A one-off final observation (cancel, out-of-band loss), emitted before closing.
    final_event: Option<(Timestamp, BootstrapEvent)>,
    /// Whether a host follows the stream. A session outlives the host that
    /// started it (its agent keeps running); what it reports meanwhile goes
    /// to its log only, and a host that adopts it gets the log replayed.
    pub attached: bool,
    /// Everything the session reported so far, in order (its log).
    pub history: Vec<BootstrapEvent>,
}

/// Totals over the backend's lifetime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendCounters {
    /// Calls to create a lease.
    pub create_lease_calls: u64,
    /// Of those, calls that made a new lease.
    pub leases_created: u64,
    /// Of those, calls that adopted a lease the list-by-key lookup could not
    /// see yet, through the idempotency token.
    pub adopted_by_token: u64,
    /// Calls to start a bootstrap.
    pub start_bootstrap_calls: u64,
    /// Of those, calls that started a new session.
    pub sessions_started: u64,
    /// Endpoint lookups.
    pub lookups: u64,
    /// Cancel calls (including already-absent ones).
    pub cancels: u64,
    /// Destroy calls (including already-absent ones).
    pub destroys: u64,
    /// Calls refused by an armed fault.
    pub refused: u64,
    /// Leases deleted out of band.
    pub out_of_band_deletions: u64,
    /// Observations dropped by a loss fault.
    pub observations_lost: u64,
}

/// Per-identity counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStats {
    /// Create-lease calls for this identity.
    pub create_lease_calls: u32,
    /// New leases made for this identity (more than one is a double create).
    pub leases_created: u32,
    /// New sessions started for this identity.
    pub sessions_started: u32,
    /// Leases of this identity alive now.
    pub live_leases: u32,
    /// Sessions of this identity open now.
    pub open_sessions: u32,
}

/// The fake provider. See the module docs.
#[derive(Clone, Debug)]
pub struct FakeBackend {
    config: BackendConfig,
    leases: BTreeMap<LeaseId, LeaseInfo>,
    sessions: BTreeMap<SessionId, SessionInfo>,
    keys: BTreeMap<ResourceKey, KeyStats>,
    armed: Vec<ProviderFault>,
    counters: BackendCounters,
    next_id: u64,
    rng: SimRng,
    // Indexes, so that a model of 100,000 nodes answers in logarithmic time.
    /// Live leases of each key (more than one only after a double create).
    live_leases: BTreeMap<ResourceKey, BTreeSet<LeaseId>>,
    /// The open session of each key.
    open_session: BTreeMap<ResourceKey, SessionId>,
    /// Sessions with an observation left, by when it is due.
    schedule: BTreeSet<(Timestamp, SessionId)>,
    /// Each scheduled session's entry in `schedule`.
    scheduled_at: BTreeMap<SessionId, Timestamp>,
    /// Logs being replayed to a host that adopted a session, by when each line is due.
    replays: BTreeMap<(Timestamp, u64), BootstrapObservation>,
    replay_seq: u64,
}

const SCRIPT_CONVERGED: u8 = 5;
const SCRIPT_CLOSED: u8 = 6;

impl FakeBackend {
    /// An empty provider. `seed` only picks cosmetic variations (which of the two
    /// encodings a failure observation uses), so equal seeds give equal runs.
    pub fn new(config: BackendConfig, seed: u64) -> Self {
        Self {
            config,
            leases: BTreeMap::new(),
            sessions: BTreeMap::new(),
            keys: BTreeMap::new(),
            armed: Vec::new(),
            counters: BackendCounters::default(),
            next_id: 1,
            rng: SimRng::new(seed),
            live_leases: BTreeMap::new(),
            open_session: BTreeMap::new(),
            schedule: BTreeSet::new(),
            scheduled_at: BTreeMap::new(),
            replays: BTreeMap::new(),
            replay_seq: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BackendConfig {
        &self.config
    }

    /// Arms a one-shot fault.
    pub fn arm(&mut self, fault: ProviderFault) {
        self.armed.push(fault);
    }

    /// Stops all faults: disarms pending ones, makes never-ready endpoints
    /// ready at `now`, and lets open sessions finish their script cleanly
    /// (no further losses or scripted failures). Out-of-band damage already
    /// done stays done.
    pub fn heal(&mut self, now: Timestamp) {
        self.armed.clear();
        for l in self.leases.values_mut() {
            if l.live {
                l.endpoint_ready_at = Some(l.endpoint_ready_at.map_or(now, |t| t.min(now)));
                l.visible_at = l.visible_at.min(now);
            }
        }
        let mut healed = Vec::new();
        for (id, s) in &mut self.sessions {
            if s.open && s.final_event.is_none() {
                s.fail_at = None;
                s.lose_mask = 0;
                healed.push(id.clone());
            }
        }
        for id in healed {
            self.reschedule(&id);
        }
    }

    /// Puts `id` in the observation schedule at its next step, or takes it out.
    fn reschedule(&mut self, id: &SessionId) {
        if let Some(at) = self.scheduled_at.remove(id) {
            self.schedule.remove(&(at, id.clone()));
        }
        let Some(s) = self.sessions.get(id) else {
            return;
        };
        if Self::has_next(s) {
            let at = self.step_at(s);
            self.schedule.insert((at, id.clone()));
            self.scheduled_at.insert(id.clone(), at);
        }
    }

    /// Marks `id` (of `key`) as no longer open.
    fn close_session_index(&mut self, key: &ResourceKey, id: &SessionId) {
        if self.open_session.get(key) == Some(id) {
            self.open_session.remove(key);
        }
    }

    fn take_fault(&mut self, pred: impl Fn(&ProviderFault) -> bool) -> Option<ProviderFault> {
        let i = self.armed.iter().position(pred)?;
        Some(self.armed.remove(i))
    }

    fn refused(&mut self, kind: EffectKind) -> bool {
        let hit = self
            .take_fault(|f| matches!(f, ProviderFault::Refuse { kind: k } if *k == kind))
            .is_some();
        if hit {
            self.counters.refused += 1;
        }
        hit
    }

    fn fresh_id(&mut self, prefix: &str) -> String {
        let id = self.next_id;
        self.next_id += 1;
        format!("{prefix}-{id}")
    }

    fn key_stats(&mut self, key: &ResourceKey) -> &mut KeyStats {
        self.keys.entry(key.clone()).or_default()
    }

    /// The live lease of `key` that a list-by-key lookup sees at `now`.
    pub fn list_lease(&self, key: &ResourceKey, now: Timestamp) -> Option<&LeaseId> {
        self.live_leases.get(key)?.iter().find(|id| {
            self.leases
                .get(*id)
                .is_some_and(|l| l.live && l.visible_at <= now)
        })
    }

    fn endpoint_at(lease: &LeaseInfo, now: Timestamp) -> Option<NodeEndpoint> {
        lease
            .endpoint_ready_at
            .filter(|t| *t <= now)
            .map(|_| lease.endpoint.clone())
    }

    /// Leases a machine for `key`, adopting a live one first (see the module docs).
    ///
    /// # Errors
    /// An armed [`ProviderFault::Refuse`]; nothing was created.
    pub fn create_lease(
        &mut self,
        key: &ResourceKey,
        now: Timestamp,
    ) -> Result<LeaseGrant, ProviderError> {
        self.create_lease_from(key, None, now)
    }

    /// [`FakeBackend::create_lease`], recording the template a new lease is made from.
    ///
    /// # Errors
    /// As [`FakeBackend::create_lease`].
    pub fn create_lease_from(
        &mut self,
        key: &ResourceKey,
        template: Option<&Arc<NodeTemplate>>,
        now: Timestamp,
    ) -> Result<LeaseGrant, ProviderError> {
        self.counters.create_lease_calls += 1;
        self.key_stats(key).create_lease_calls += 1;
        if let Some(t) = template
            && t.provider.kind != PROVIDER_KIND
        {
            return Err(ProviderError::UnknownKind(t.provider.kind.clone()));
        }
        if self.refused(EffectKind::CreateLease) {
            return Err(ProviderError::Refused(EffectKind::CreateLease));
        }
        let adopt = |origin, id: &LeaseId, l: &LeaseInfo| LeaseGrant {
            lease: id.clone(),
            endpoint: Self::endpoint_at(l, now),
            origin,
        };
        if let Some(id) = self.list_lease(key, now) {
            return Ok(adopt(Origin::AdoptedByLookup, id, &self.leases[id]));
        }
        if self.config.idempotent_create
            && let Some((id, l)) = self
                .live_leases
                .get(key)
                .and_then(|ids| ids.first())
                .and_then(|id| self.leases.get_key_value(id))
        {
            let grant = adopt(Origin::AdoptedByToken, id, l);
            self.counters.adopted_by_token += 1;
            return Ok(grant);
        }
        let lag = match self.take_fault(|f| matches!(f, ProviderFault::Invisible { .. })) {
            Some(ProviderFault::Invisible { lag_ms }) => lag_ms,
            _ => self.config.visibility_lag_ms,
        };
        let ready_at = match self.take_fault(|f| {
            matches!(
                f,
                ProviderFault::EndpointNeverReady | ProviderFault::EndpointSlow { .. }
            )
        }) {
            Some(ProviderFault::EndpointNeverReady) => None,
            Some(ProviderFault::EndpointSlow { delay_ms }) => Some(now.0.saturating_add(delay_ms)),
            _ => Some(now.0.saturating_add(self.config.endpoint_delay_ms)),
        };
        let id = LeaseId::from(self.fresh_id("lease"));
        let info = LeaseInfo {
            key: key.clone(),
            created_at: now,
            visible_at: Timestamp(now.0.saturating_add(lag)),
            endpoint_ready_at: ready_at.map(Timestamp),
            endpoint: NodeEndpoint::from(format!("ssh://{}", id.0)),
            live: true,
            deleted_out_of_band: false,
            template: template.cloned(),
        };
        let grant = adopt(Origin::Created, &id, &info);
        self.live_leases
            .entry(key.clone())
            .or_default()
            .insert(id.clone());
        self.leases.insert(id, info);
        self.counters.leases_created += 1;
        let ks = self.key_stats(key);
        ks.leases_created += 1;
        ks.live_leases += 1;
        Ok(grant)
    }

    /// The endpoint of `lease`, or `None` while it is not ready.
    ///
    /// # Errors
    /// The lease does not exist, or an armed fault refused the call.
    pub fn lookup_endpoint(
        &mut self,
        lease: &LeaseId,
        now: Timestamp,
    ) -> Result<Option<NodeEndpoint>, ProviderError> {
        self.counters.lookups += 1;
        if self.refused(EffectKind::LookupEndpoint) {
            return Err(ProviderError::Refused(EffectKind::LookupEndpoint));
        }
        match self.leases.get(lease) {
            Some(l) if l.live => Ok(Self::endpoint_at(l, now)),
            _ => Err(ProviderError::NoSuchLease(lease.clone())),
        }
    }

    /// Starts the bootstrap of `key` on `lease`, adopting the key's open session first.
    ///
    /// # Errors
    /// The lease is gone, or an armed fault refused the call; nothing was started.
    pub fn start_bootstrap(
        &mut self,
        key: &ResourceKey,
        lease: &LeaseId,
        now: Timestamp,
    ) -> Result<SessionGrant, ProviderError> {
        self.counters.start_bootstrap_calls += 1;
        if self.refused(EffectKind::StartBootstrap) {
            return Err(ProviderError::Refused(EffectKind::StartBootstrap));
        }
        if let Some(id) = self.open_session.get(key).cloned() {
            self.attach(&id, now);
            return Ok(SessionGrant {
                session: id,
                origin: Origin::AdoptedByLookup,
            });
        }
        if !self.leases.get(lease).is_some_and(|l| l.live) {
            return Err(ProviderError::NoSuchLease(lease.clone()));
        }
        let fail_at = match self.take_fault(|f| matches!(f, ProviderFault::BootstrapFailsAt { .. }))
        {
            Some(ProviderFault::BootstrapFailsAt { stage }) if stage.is_failure() => Some(stage),
            _ => None,
        };
        let lose_mask =
            match self.take_fault(|f| matches!(f, ProviderFault::LoseObservations { .. })) {
                Some(ProviderFault::LoseObservations { mask }) => mask,
                _ => 0,
            };
        let close_after_converge = self.config.close_after_converge
            || self
                .take_fault(|f| matches!(f, ProviderFault::CloseAfterConverge))
                .is_some();
        let id = SessionId::from(self.fresh_id("session"));
        self.sessions.insert(
            id.clone(),
            SessionInfo {
                key: key.clone(),
                lease: lease.clone(),
                opened_at: now,
                open: true,
                next_step: 0,
                fail_at,
                lose_mask,
                close_after_converge,
                final_event: None,
                attached: true,
                history: Vec::new(),
            },
        );
        self.open_session.insert(key.clone(), id.clone());
        self.reschedule(&id);
        self.counters.sessions_started += 1;
        let ks = self.key_stats(key);
        ks.sessions_started += 1;
        ks.open_sessions += 1;
        Ok(SessionGrant {
            session: id,
            origin: Origin::Created,
        })
    }

    /// Ends an open session at once and schedules the last thing its stream says.
    fn end_session(&mut self, id: &SessionId, now: Timestamp, last: BootstrapEvent) {
        let Some(s) = self.sessions.get_mut(id).filter(|s| s.open) else {
            return;
        };
        s.open = false;
        s.next_step = u8::MAX;
        s.final_event = Some((now, last));
        let key = s.key.clone();
        self.key_stats(&key).open_sessions -= 1;
        self.close_session_index(&key, id);
        self.reschedule(id);
    }

    /// Stops a session; an unknown or already ended session is success.
    ///
    /// # Errors
    /// An armed fault refused the call; the session keeps running.
    pub fn cancel_bootstrap(
        &mut self,
        id: &SessionId,
        now: Timestamp,
    ) -> Result<(), ProviderError> {
        self.counters.cancels += 1;
        if self.refused(EffectKind::CancelBootstrap) {
            return Err(ProviderError::Refused(EffectKind::CancelBootstrap));
        }
        self.end_session(id, now, BootstrapEvent::Closed);
        Ok(())
    }

    fn kill_lease(&mut self, lease: &LeaseId, now: Timestamp, out_of_band: bool) {
        let Some(l) = self.leases.get_mut(lease) else {
            return;
        };
        if !l.live {
            return;
        }
        l.live = false;
        l.deleted_out_of_band = out_of_band;
        let key = l.key.clone();
        self.key_stats(&key).live_leases -= 1;
        if let Some(ids) = self.live_leases.get_mut(&key) {
            ids.remove(lease);
            if ids.is_empty() {
                self.live_leases.remove(&key);
            }
        }
        // A session runs on its own key's lease, so only that key's open
        // session can be on this lease.
        let on_lease: Vec<SessionId> = self
            .open_session
            .get(&key)
            .filter(|id| {
                self.sessions
                    .get(*id)
                    .is_some_and(|s| s.open && s.lease == *lease)
            })
            .cloned()
            .into_iter()
            .collect();
        for id in on_lease {
            // The machine is gone, so its agent is lost; the stream says so.
            let reason = if out_of_band {
                "machine deleted out of band"
            } else {
                "machine destroyed under a running session"
            };
            self.end_session(
                &id,
                now,
                BootstrapEvent::Failed {
                    stage: BootstrapStage::AgentLost,
                    reason: reason.to_owned(),
                },
            );
        }
    }

    /// Releases a lease (and ends any session on it); an absent lease is success.
    ///
    /// # Errors
    /// An armed fault refused the call; the lease stays.
    pub fn destroy_lease(&mut self, lease: &LeaseId, now: Timestamp) -> Result<(), ProviderError> {
        self.counters.destroys += 1;
        if self.refused(EffectKind::DestroyLease) {
            return Err(ProviderError::Refused(EffectKind::DestroyLease));
        }
        self.kill_lease(lease, now, false);
        Ok(())
    }

    /// Deletes a live lease behind the reconciler's back (an operator, a spot
    /// reclaim). A session on it reports `Failed { AgentLost }`. Returns false
    /// when the lease was not live.
    pub fn delete_out_of_band(&mut self, lease: &LeaseId, now: Timestamp) -> bool {
        let live = self.leases.get(lease).is_some_and(|l| l.live);
        if live {
            self.counters.out_of_band_deletions += 1;
            self.kill_lease(lease, now, true);
        }
        live
    }

    /// Runs one effect request against the provider and classifies the result
    /// the way an executor would: provider errors are definite failures.
    pub fn execute(
        &mut self,
        key: &ResourceKey,
        request: &EffectRequest,
        now: Timestamp,
    ) -> OperationOutcome {
        let failed = |e: ProviderError| OperationOutcome::Failed {
            class: match e {
                ProviderError::NoSuchLease(_) => FailureClass::LeaseGone,
                ProviderError::Refused(_) | ProviderError::UnknownKind(_) => FailureClass::Definite,
            },
            reason: e.to_string(),
        };
        match request {
            EffectRequest::CreateLease { template } => {
                match self.create_lease_from(key, Some(template), now) {
                    Ok(g) => OperationOutcome::LeaseCreated {
                        lease: g.lease,
                        endpoint: g.endpoint,
                    },
                    Err(e) => failed(e),
                }
            }
            EffectRequest::LookupEndpoint { lease } => match self.lookup_endpoint(lease, now) {
                Ok(Some(endpoint)) => OperationOutcome::EndpointFound { endpoint },
                Ok(None) => OperationOutcome::EndpointNotReady,
                Err(e) => failed(e),
            },
            EffectRequest::StartBootstrap { lease, .. } => {
                match self.start_bootstrap(key, lease, now) {
                    Ok(g) => OperationOutcome::BootstrapStarted { session: g.session },
                    Err(e) => failed(e),
                }
            }
            EffectRequest::CancelBootstrap { session } => {
                match self.cancel_bootstrap(session, now) {
                    Ok(()) => OperationOutcome::BootstrapCancelled,
                    Err(e) => failed(e),
                }
            }
            EffectRequest::DestroyLease { lease } => match self.destroy_lease(lease, now) {
                Ok(()) => OperationOutcome::LeaseDestroyed,
                Err(e) => failed(e),
            },
        }
    }

    fn step_at(&self, s: &SessionInfo) -> Timestamp {
        if let Some((t, _)) = &s.final_event {
            return *t;
        }
        let step = u64::from(s.next_step) + 1;
        Timestamp(
            s.opened_at
                .0
                .saturating_add(step * self.config.bootstrap_step_ms),
        )
    }

    /// The script of a session, one step at a time: `None` when the script is done.
    ///
    /// Steps: 0 SshConnect, 1 BootCheck, 2 SwactorStart, 3 Join, 4 SwactorJoined,
    /// 5 Converged, 6 Closed (only when the stream closes after convergence).
    /// A scripted failure replaces the step it belongs to (AgentLost replaces
    /// step 6: the node converged, then lost its agent) and ends the script.
    fn script_event(s: &SessionInfo, fail_encoding: bool) -> Option<BootstrapEvent> {
        let failing_step = s.fail_at.map(|stage| match stage {
            BootstrapStage::SshConnectFailed => 0,
            BootstrapStage::BootCheckFailed => 1,
            BootstrapStage::SwactorStartFailed => 2,
            BootstrapStage::JoinFailed => 3,
            _ => SCRIPT_CLOSED,
        });
        if let (Some(step), Some(stage)) = (failing_step, s.fail_at)
            && step == s.next_step
        {
            // Both encodings of a failure are legal; exercise both.
            return Some(if fail_encoding {
                BootstrapEvent::Failed {
                    stage,
                    reason: format!("scripted failure at {stage:?}"),
                }
            } else {
                BootstrapEvent::Stage(stage)
            });
        }
        match s.next_step {
            0 => Some(BootstrapEvent::Stage(BootstrapStage::SshConnect)),
            1 => Some(BootstrapEvent::Stage(BootstrapStage::BootCheck)),
            2 => Some(BootstrapEvent::Stage(BootstrapStage::SwactorStart)),
            3 => Some(BootstrapEvent::Stage(BootstrapStage::Join)),
            4 => Some(BootstrapEvent::SwactorJoined),
            SCRIPT_CONVERGED => Some(BootstrapEvent::Stage(BootstrapStage::Converged)),
            SCRIPT_CLOSED if s.close_after_converge => Some(BootstrapEvent::Closed),
            _ => None,
        }
    }

    fn has_next(s: &SessionInfo) -> bool {
        s.final_event.is_some() || (s.open && Self::script_event(s, false).is_some())
    }

    /// When the next bootstrap observation is due, if any session has one left.
    pub fn next_observation_at(&self) -> Option<Timestamp> {
        let scripted = self.schedule.first().map(|(at, _)| *at);
        let replay = self.replays.keys().next().map(|(at, _)| *at);
        match (scripted, replay) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Every host that followed a stream is gone (it crashed or stopped):
    /// sessions keep running and logging, but nobody hears them until a new
    /// host adopts them.
    pub fn detach_streams(&mut self) {
        for s in self.sessions.values_mut() {
            s.attached = false;
        }
        self.replays.clear();
    }

    /// A host adopted `id`: if nobody followed it, its log is replayed from the start.
    fn attach(&mut self, id: &SessionId, now: Timestamp) {
        let Some(s) = self.sessions.get_mut(id).filter(|s| !s.attached) else {
            return;
        };
        s.attached = true;
        let (key, history) = (s.key.clone(), s.history.clone());
        for event in history {
            self.replay_seq += 1;
            let obs = BootstrapObservation {
                node: key.node.clone(),
                attempt: key.attempt,
                session: id.clone(),
                event,
            };
            self.replays.insert((now, self.replay_seq), obs);
        }
    }

    /// What the provider holds for `run` as a listing sees it at `now`: every
    /// visible live lease, with its key's open session.
    pub fn list(&self, run: &RunId, now: Timestamp) -> Vec<Listed> {
        self.live_leases
            .keys()
            .filter(|k| k.run_id == *run)
            .filter_map(|key| {
                let lease = self.list_lease(key, now)?.clone();
                Some(Listed {
                    key: key.clone(),
                    lease: Some(lease),
                    session: self.open_session.get(key).cloned(),
                })
            })
            .collect()
    }

    /// Every observation due at or before `now`, in time order (ties in session order).
    pub fn poll_observations(&mut self, now: Timestamp) -> Vec<BootstrapObservation> {
        let mut out = Vec::new();
        while let Some(entry) = self.replays.first_entry().filter(|e| e.key().0 <= now) {
            out.push(entry.remove());
        }
        // The schedule yields (time, session) in the same order a scan for
        // the minimum would, so runs are identical to the unindexed model.
        while let Some((at, id)) = self.schedule.first().filter(|(at, _)| *at <= now).cloned() {
            let encoding = self.rng.chance(500);
            let step_ms = self.config.bootstrap_step_ms;
            let s = self.sessions.get_mut(&id).expect("session listed above");
            let (event, lost) = match s.final_event.take() {
                Some((_, event)) => (event, false),
                None => {
                    let event = Self::script_event(s, encoding).expect("has_next checked it");
                    let lost = s.lose_mask & (1 << s.next_step.min(7)) != 0;
                    s.next_step = s.next_step.saturating_add(1);
                    (event, lost)
                }
            };
            let is_failure = match &event {
                BootstrapEvent::Failed { .. } => true,
                BootstrapEvent::Stage(stage) => stage.is_failure(),
                _ => false,
            };
            if is_failure && s.open {
                // The agent is dead; the stream closes one step later.
                s.next_step = u8::MAX;
                s.final_event = Some((
                    Timestamp(at.0.saturating_add(step_ms)),
                    BootstrapEvent::Closed,
                ));
            }
            let ends = is_failure || event == BootstrapEvent::Closed;
            let key = s.key.clone();
            if ends && s.open {
                s.open = false;
                self.key_stats(&key).open_sessions -= 1;
                self.close_session_index(&key, &id);
            }
            self.reschedule(&id);
            let s = self.sessions.get_mut(&id).expect("session listed above");
            s.history.push(event.clone());
            if !s.attached {
                continue;
            }
            if lost {
                self.counters.observations_lost += 1;
                continue;
            }
            out.push(BootstrapObservation {
                node: key.node.clone(),
                attempt: key.attempt,
                session: id,
                event,
            });
        }
        out
    }

    /// Every lease ever made, by id.
    pub fn leases(&self) -> &BTreeMap<LeaseId, LeaseInfo> {
        &self.leases
    }

    /// Every session ever started, by id.
    pub fn sessions(&self) -> &BTreeMap<SessionId, SessionInfo> {
        &self.sessions
    }

    /// Per-identity counts, for every identity the backend was ever asked about.
    pub fn keys(&self) -> &BTreeMap<ResourceKey, KeyStats> {
        &self.keys
    }

    /// Lifetime totals.
    pub fn counters(&self) -> BackendCounters {
        self.counters
    }

    /// Live leases and open sessions, as (identity, what) pairs, in id order.
    pub fn live_resources(&self) -> impl Iterator<Item = (&ResourceKey, LiveResource<'_>)> {
        let leases = self
            .leases
            .iter()
            .filter(|(_, l)| l.live)
            .map(|(id, l)| (&l.key, LiveResource::Lease(id)));
        let sessions = self
            .sessions
            .iter()
            .filter(|(_, s)| s.open)
            .map(|(id, s)| (&s.key, LiveResource::Session(id)));
        leases.chain(sessions)
    }
}

/// One live resource, as listed by [`FakeBackend::live_resources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveResource<'a> {
    /// A live lease.
    Lease(&'a LeaseId),
    /// An open session.
    Session(&'a SessionId),
}
