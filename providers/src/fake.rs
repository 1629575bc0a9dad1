//! The `fake` provider: the conformance kit's reference model behind the provider contract.
//!
//! One [`FakeBackend`] (the same model the conformance battery checks the
//! reconciler against) sits behind a mutex. Calls take the engine clock's
//! `now`, optionally after a configured latency; a pump task delivers each
//! session's scripted observations at their virtual time, so under tokio's
//! paused time a whole cluster converges instantly and deterministically.
//!
//! Faults: everything [`ProviderFault`] offers (refusals, slow or never-ready
//! endpoints, bootstrap failures at each stage, lost observations, late
//! visibility), plus [`FakeProvider::arm_lost_result`] (the call takes effect
//! but its reply is lost: an ambiguous outcome) and out-of-band deletion.

use crate::FaultKind;
use crate::Release;
use crate::{BootstrapEvents, BootstrapSession, Inventory, LeaseGrant, Provider, ProviderError};
use async_trait::async_trait;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use swactor_conformance::{BackendConfig, FakeBackend, Origin, ProviderFault};
use swactor_engine::{Clock, stream};
use swactor_provisioning::{
    BootstrapEvent, EffectKind, LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId,
    Timestamp,
};
use tokio::sync::Notify;

/// Settings of a [`FakeProvider`].
#[derive(Clone, Debug)]
pub struct FakeConfig {
    /// The reference model's settings.
    pub backend: BackendConfig,
    /// Seed of the model's cosmetic choices.
    pub seed: u64,
    /// Delay added to every call (zero for none).
    pub latency: Duration,
    /// Observations buffered per session stream before the reader must catch up.
    pub stream_buffer_len: usize,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            backend: BackendConfig::default(),
            seed: 0,
            latency: Duration::ZERO,
            stream_buffer_len: 64,
        }
    }
}

/// The provider's end of one session's stream.
type StreamTx = stream::Sender<BootstrapEvent>;

/// Why [`deliver`] could not hand an observation to a stream's reader.
#[derive(Debug)]
enum Undelivered {
    /// The reader is `stream_buffer_len` behind.
    Full,
    /// The reader is gone.
    Closed,
}

/// A new stream holding up to `buffer` undelivered observations. Every
/// stream the provider makes comes from here.
fn open_stream(buffer: usize) -> (StreamTx, BootstrapEvents) {
    stream::channel(buffer)
}

/// Hands `event` to the stream's reader without waiting. Every observation
/// the provider sends goes through here.
fn deliver(tx: &StreamTx, event: BootstrapEvent) -> Result<(), Undelivered> {
    tx.try_send(event).map_err(|e| match e {
        stream::TrySendError::Full(_) => Undelivered::Full,
        stream::TrySendError::Closed(_) => Undelivered::Closed,
    })
}

struct State {
    backend: FakeBackend,
    /// The stream of each session, by the model's session index; `None`
    /// once the session ended (the reader sees the end of its stream).
    /// Replaying a session to an adopting caller reads the model's log.
    streams: Vec<Option<StreamTx>>,
    lost_results: Vec<EffectKind>,
    observations_dropped: u64,
}

struct Shared {
    state: Mutex<State>,
    clock: Clock,
    config: FakeConfig,
    wake: Arc<Notify>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Wakes the pump so it notices the provider is gone and ends.
        self.wake.notify_one();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a single call into the backend.
        crate::lock(&self.state)
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.clock.now_ms())
    }
}

/// The in-memory reference provider. Cheap to clone; clones share one model.
#[derive(Clone)]
pub struct FakeProvider {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FakeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeProvider").finish_non_exhaustive()
    }
}

impl FakeProvider {
    /// A provider whose timestamps come from `clock`. Must be called inside a
    /// tokio runtime: it starts the task that delivers observations, which
    /// ends when the last clone of the provider is dropped.
    pub fn new(config: FakeConfig, clock: Clock) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                backend: FakeBackend::new(config.backend.clone(), config.seed),
                streams: Vec::new(),
                lost_results: Vec::new(),
                observations_dropped: 0,
            }),
            clock,
            config,
            wake: Arc::new(Notify::new()),
        });
        tokio::spawn(pump(Arc::downgrade(&shared), shared.wake.clone()));
        Self { shared }
    }

    /// Arms a fault in the model; the next matching call consumes it.
    pub fn arm(&self, fault: ProviderFault) {
        self.shared.lock().backend.arm(fault);
        self.shared.wake.notify_one();
    }

    /// Stops every fault: disarms pending ones (lost results included), makes
    /// never-ready endpoints ready and lets open sessions finish cleanly.
    pub fn heal(&self) {
        let now = self.shared.now();
        let mut st = self.shared.lock();
        st.backend.heal(now);
        st.lost_results.clear();
        drop(st);
        self.shared.wake.notify_one();
    }

    /// The next call of `kind` takes effect, but its reply is lost: the caller
    /// gets [`ProviderError::Ambiguous`].
    pub fn arm_lost_result(&self, kind: EffectKind) {
        self.shared.lock().lost_results.push(kind);
    }

    /// Deletes `key`'s live lease behind the reconciler's back. Returns whether one existed.
    pub fn delete_out_of_band(&self, key: &ResourceKey) -> bool {
        let now = self.shared.now();
        let mut st = self.shared.lock();
        let lease = st.backend.live_lease(key);
        let deleted = lease.is_some_and(|l| st.backend.delete_out_of_band(&l, now));
        drop(st);
        self.shared.wake.notify_one();
        deleted
    }

    /// Runs `f` on the model, e.g. to count resources in a test.
    pub fn inspect<R>(&self, f: impl FnOnce(&FakeBackend) -> R) -> R {
        f(&self.shared.lock().backend)
    }

    /// Observations dropped because a session's reader fell `stream_buffer_len` behind.
    pub fn observations_dropped(&self) -> u64 {
        self.shared.lock().observations_dropped
    }

    async fn latency(&self) {
        if !self.shared.config.latency.is_zero() {
            tokio::time::sleep(self.shared.config.latency).await;
        }
    }

    /// One provider call: the configured latency, the model call at `now`, a
    /// wake-up for the observation pump (the call may have scheduled some),
    /// and an armed lost-result fault applied to a call that took effect.
    async fn call<T>(
        &self,
        kind: EffectKind,
        f: impl FnOnce(&mut State, Timestamp) -> Result<T, ProviderError>,
    ) -> Result<T, ProviderError> {
        self.latency().await;
        let now = self.shared.now();
        let mut st = self.shared.lock();
        let out = f(&mut st, now)?;
        let lost = st.lost_results.iter().position(|k| *k == kind);
        if let Some(i) = lost {
            st.lost_results.remove(i);
        }
        drop(st);
        self.shared.wake.notify_one();
        match lost {
            Some(_) => Err(ProviderError::ambiguous(
                FaultKind::Unconfirmed,
                format!("reply to {kind:?} was lost"),
            )),
            None => Ok(out),
        }
    }
}

/// The contract's class of a model error: a refusal had no effect, and a
/// lease the model does not hold is gone (the model looks leases up by id,
/// so a new one is never invisible to these calls).
fn classify(e: swactor_conformance::ProviderError) -> ProviderError {
    use swactor_conformance::ProviderError as Model;
    match e {
        Model::Refused(_) => ProviderError::definite(FaultKind::Refused, e.to_string()),
        Model::UnknownKind(_) => ProviderError::definite(FaultKind::Invalid, e.to_string()),
        Model::NoSuchLease(_) => ProviderError::gone(FaultKind::Deleted, e.to_string()),
    }
}

#[async_trait]
impl Provider for FakeProvider {
    fn kind(&self) -> &'static str {
        "fake"
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        _template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        self.call(EffectKind::CreateLease, |st, now| {
            let grant = st.backend.create_lease(key, now).map_err(classify)?;
            Ok(LeaseGrant {
                lease: grant.lease,
                endpoint: grant.endpoint,
            })
        })
        .await
    }

    async fn lookup_endpoint(
        &self,
        _key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.call(EffectKind::LookupEndpoint, |st, now| {
            st.backend.lookup_endpoint(lease, now).map_err(classify)
        })
        .await?
        .ok_or(ProviderError::NotReady)
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        _endpoint: &NodeEndpoint,
        _template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let buffer = self.shared.config.stream_buffer_len;
        self.call(EffectKind::StartBootstrap, |st, now| {
            let grant = st
                .backend
                .start_bootstrap(key, lease, now)
                .map_err(classify)?;
            let i = st
                .backend
                .session_index(&grant.session)
                .expect("the model just started or adopted it");
            let (tx, events) = open_stream(buffer);
            if grant.origin != Origin::Created {
                // Restate the progress so far on the adopter's fresh stream.
                for ev in st.backend.delivered(i) {
                    let _ = deliver(&tx, ev);
                }
            }
            if st.streams.len() <= i {
                st.streams.resize_with(i + 1, || None);
            }
            // Replacing the sender ends any older reader's stream.
            st.streams[i] = Some(tx);
            Ok(BootstrapSession {
                session: grant.session,
                events,
            })
        })
        .await
    }

    async fn cancel_bootstrap(
        &self,
        _key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.call(EffectKind::CancelBootstrap, |st, now| {
            st.backend
                .cancel_bootstrap(session, now)
                .map(|()| Release::Done)
                .map_err(classify)
        })
        .await
    }

    async fn destroy_lease(
        &self,
        _key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        self.call(EffectKind::DestroyLease, |st, now| {
            st.backend
                .destroy_lease(lease, now)
                .map(|()| Release::Done)
                .map_err(classify)
        })
        .await
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        self.latency().await;
        let st = self.shared.lock();
        let inv: Inventory = st
            .backend
            .holdings(run_id)
            .map(|(key, lease, session)| (key.clone(), crate::OwnedResources { lease, session }))
            .collect();
        Ok(inv)
    }
}

/// Delivers scripted observations at their virtual time until the provider is dropped.
async fn pump(shared: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let (next, clock) = {
            let Some(s) = shared.upgrade() else { return };
            let next = s.lock().backend.next_observation_at();
            (next, s.clock)
        };
        // Holding only the `Notify` (not the provider) while waiting lets the
        // last clone's drop end this task.
        let notified = wake.notified();
        match next {
            Some(at) => {
                let deadline = clock.at_ms(at.as_millis()).into_tokio();
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => {}
                    () = notified => {}
                }
            }
            None => notified.await,
        }
        let Some(s) = shared.upgrade() else { return };
        let now = s.now();
        let mut guard = s.lock();
        let st = &mut *guard;
        let mut events = st.backend.poll_events(now);
        for obs in events.by_ref() {
            let Some(stream) = st.streams.get(obs.session) else {
                continue;
            };
            if let Some(Err(_)) = stream.as_ref().map(|tx| deliver(tx, obs.event)) {
                st.observations_dropped += 1;
            }
        }
        // A session ends only after an observation (its last script step, or
        // the final event of a cancel or loss); once every observation due
        // is delivered (a failure's close may follow it at the same poll),
        // close the stream of each one that reported and ended, so its
        // reader sees the end.
        for i in events.ended() {
            if let Some(stream) = st.streams.get_mut(i) {
                *stream = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use swactor_conformance::Digest;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId, ResourceKey, RunId};

    fn key() -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(1),
        }
    }

    fn template() -> NodeTemplate {
        NodeTemplate {
            provider: swactor_provisioning::ProviderShape {
                kind: "fake".to_owned(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: swactor_provisioning::BootParams::default(),
            role: "worker".to_owned(),
            join: swactor_provisioning::SwarmJoin::default(),
            limits: Default::default(),
        }
    }

    #[tokio::test]
    async fn a_lease_the_model_does_not_hold_is_gone_and_a_refusal_is_definite() {
        let p = FakeProvider::new(FakeConfig::default(), Clock::new());
        let k = key();
        let grant = p.create_lease(&k, &template()).await.unwrap();
        assert!(p.delete_out_of_band(&k));
        let endpoint = NodeEndpoint::from("fake:nowhere");
        assert!(matches!(
            p.lookup_endpoint(&k, &grant.lease).await,
            Err(ProviderError::Gone(_))
        ));
        assert!(matches!(
            p.start_bootstrap(&k, &grant.lease, &endpoint, &template())
                .await,
            Err(ProviderError::Gone(_))
        ));
        // Already absent is success.
        p.destroy_lease(&k, &grant.lease).await.unwrap();

        p.arm(ProviderFault::Refuse {
            kind: EffectKind::CreateLease,
        });
        assert!(matches!(
            p.create_lease(&k, &template()).await,
            Err(ProviderError::Definite(_))
        ));
    }

    /// Writes what `rx` holds into `d`, then how it stopped (empty or ended).
    fn read_out(d: &mut Digest, rx: &mut crate::BootstrapEvents) {
        use std::fmt::Write as _;
        loop {
            match rx.try_recv() {
                Ok(ev) => {
                    let _ = write!(d, " {ev:?}");
                }
                Err(e) => {
                    let _ = write!(d, " {e:?}");
                    break;
                }
            }
        }
    }

    /// Drives a provider through `ops` pseudo-random calls, sleeps (so the
    /// pump delivers) and stream reads, and digests everything a caller sees.
    async fn drive(config: FakeConfig, seed: u64, ops: u32) -> u64 {
        use std::fmt::Write as _;
        use swactor_conformance::SimRng;
        use swactor_provisioning::{BootstrapStage, GroupId};
        let kinds = [
            EffectKind::CreateLease,
            EffectKind::LookupEndpoint,
            EffectKind::StartBootstrap,
            EffectKind::CancelBootstrap,
            EffectKind::DestroyLease,
        ];
        let stages = [
            BootstrapStage::SshConnectFailed,
            BootstrapStage::BootCheckFailed,
            BootstrapStage::SwactorStartFailed,
            BootstrapStage::JoinFailed,
            BootstrapStage::AgentLost,
            BootstrapStage::Converged,
        ];
        let mut rng = SimRng::new(seed);
        let mut d = Digest::new();
        let p = FakeProvider::new(config, Clock::new());
        let runs = [RunId::new("r"), RunId::new("s")];
        let t = template();
        let mut leases = vec![LeaseId::from("lease-0"), LeaseId::from("session-2")];
        let mut sessions = vec![SessionId::from("session-1")];
        let mut streams: Vec<(SessionId, Option<crate::BootstrapEvents>)> = Vec::new();
        let below = |rng: &mut SimRng, n: usize| rng.range(0, n as u64 - 1) as usize;
        for op in 0..ops {
            let k = ResourceKey {
                run_id: runs[below(&mut rng, 2)].clone(),
                node: LogicalNodeId::new(GroupId::new("w"), rng.range(0, 12) as u32),
                attempt: NodeAttemptId(rng.range(1, 2)),
            };
            let lease = leases[below(&mut rng, leases.len())].clone();
            let _ = write!(d, "#{op} {k} ");
            match rng.range(0, 99) {
                0..=14 => {
                    let r = p.create_lease(&k, &t).await;
                    if let Ok(g) = &r {
                        leases.push(g.lease.clone());
                    }
                    let _ = write!(d, "create {}", as_recorded(&r));
                }
                15..=24 => {
                    let r = p.lookup_endpoint(&k, &lease).await;
                    let _ = write!(d, "lookup {}", as_recorded(&r));
                }
                25..=39 => {
                    let endpoint = NodeEndpoint::from("ssh://x");
                    match p.start_bootstrap(&k, &lease, &endpoint, &t).await {
                        Ok(s) => {
                            let _ = write!(d, "start {:?}", s.session);
                            sessions.push(s.session.clone());
                            streams.push((s.session, Some(s.events)));
                        }
                        Err(e) => {
                            let _ = write!(d, "start {}", recorded_error(&e));
                        }
                    }
                }
                40..=44 => {
                    let s = sessions[below(&mut rng, sessions.len())].clone();
                    let r = p.cancel_bootstrap(&k, &s).await;
                    let _ = write!(d, "cancel {}", as_recorded(&r));
                }
                45..=49 => {
                    let r = p.destroy_lease(&k, &lease).await;
                    let _ = write!(d, "destroy {}", as_recorded(&r));
                }
                50..=52 => {
                    let _ = write!(d, "oob {}", p.delete_out_of_band(&k));
                }
                53..=55 => {
                    let r = p.list(&k.run_id).await;
                    let _ = write!(d, "list {}", as_recorded(&r));
                }
                56..=61 => {
                    let fault = match rng.range(0, 6) {
                        0 => ProviderFault::Refuse {
                            kind: kinds[below(&mut rng, kinds.len())],
                        },
                        1 => ProviderFault::EndpointSlow {
                            delay_ms: rng.range(0, 500),
                        },
                        2 => ProviderFault::BootstrapFailsAt {
                            stage: stages[below(&mut rng, stages.len())],
                        },
                        3 => ProviderFault::LoseObservations {
                            mask: rng.range(0, 255) as u8,
                        },
                        4 => ProviderFault::CloseAfterConverge,
                        5 => ProviderFault::Invisible {
                            lag_ms: rng.range(0, 500),
                        },
                        _ => ProviderFault::EndpointNeverReady,
                    };
                    let _ = write!(d, "arm {fault:?}");
                    p.arm(fault);
                }
                62..=63 => {
                    let kind = kinds[below(&mut rng, kinds.len())];
                    let _ = write!(d, "lose {kind:?}");
                    p.arm_lost_result(kind);
                }
                64 => {
                    let _ = write!(d, "heal");
                    p.heal();
                }
                65..=79 if !streams.is_empty() => {
                    // Read what a stream holds, as an observer would.
                    let at = below(&mut rng, streams.len());
                    let (id, events) = &mut streams[at];
                    let _ = write!(d, "read {id:?}");
                    if let Some(rx) = events {
                        read_out(&mut d, rx);
                    }
                }
                80..=81 if !streams.is_empty() => {
                    // An observer that goes away.
                    let at = below(&mut rng, streams.len());
                    let (id, events) = &mut streams[at];
                    let _ = write!(d, "drop {id:?}");
                    *events = None;
                }
                _ => {
                    let ms = rng.range(0, 450);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    let _ = write!(d, "slept {ms} dropped {}", p.observations_dropped());
                }
            }
            if op % 300 == 299 {
                p.inspect(|b| {
                    let _ = write!(d, "{:?} {:?} {:?}", b.counters(), b.leases(), b.sessions());
                });
            }
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        for (id, events) in &mut streams {
            let _ = write!(d, "end {id:?}");
            if let Some(rx) = events.as_mut() {
                read_out(&mut d, rx);
            }
        }
        let _ = write!(d, "dropped {}", p.observations_dropped());
        for run in &runs {
            let r = p.list(run).await;
            let _ = write!(d, "list {}", as_recorded(&r));
        }
        d.value()
    }

    /// `r` in the words the digests were recorded with, before errors carried
    /// a [`crate::Fault`] and releases a [`Release`]: the answers are the
    /// same, only their types grew.
    fn as_recorded<T: std::fmt::Debug + 'static>(r: &Result<T, ProviderError>) -> String {
        match r {
            Ok(v)
                if (v as &dyn std::any::Any).downcast_ref::<Release>() == Some(&Release::Done) =>
            {
                "Ok(())".to_owned()
            }
            Ok(v) => format!("Ok({v:?})"),
            Err(e) => format!("Err({})", recorded_error(e)),
        }
    }

    fn recorded_error(e: &ProviderError) -> String {
        match e {
            ProviderError::Definite(f) => format!("Definite({:?})", f.message()),
            ProviderError::Ambiguous(f) => format!("Ambiguous({:?})", f.message()),
            ProviderError::Gone(f) => format!("Gone({:?})", f.message()),
            ProviderError::NotReady => "NotReady".to_owned(),
        }
    }

    /// The provider around the model must answer, deliver and end streams
    /// exactly as it did when these digests were recorded (from the
    /// provider that kept a second log per stream and its streams in a map
    /// by session id).
    #[tokio::test(start_paused = true)]
    async fn the_fake_provider_answers_and_streams_exactly_as_recorded() {
        let mut got = Vec::new();
        for (name, buffer, step_ms) in [("roomy", 64, 200), ("tight", 3, 50), ("zero step", 2, 0)] {
            let config = FakeConfig {
                backend: BackendConfig {
                    bootstrap_step_ms: step_ms,
                    ..BackendConfig::default()
                },
                seed: 5,
                latency: Duration::ZERO,
                stream_buffer_len: buffer,
            };
            got.push(format!("{name}: {:016x}", drive(config, 11, 3_000).await));
        }
        let got = got.join("\n");
        let want = "\
roomy: a99294a4a5850220
tight: 504e9ccb3ef12db7
zero step: 0537136ab11b7553";
        assert_eq!(got, want, "the provider's answers changed:\n{got}");
    }
}
