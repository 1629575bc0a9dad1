//! An executor over [`FakeBackend`] with an unreliable path back to the driver.
//!
//! [`FakeExecutor`] plays the spec's executor role in virtual time:
//!
//! - it deduplicates by [`OperationId`]: resubmitting a finished operation
//!   replays its recorded result, resubmitting a queued or running one is a
//!   no-op, and reusing an id with a different request is refused
//!   ([`Submitted::Conflict`]);
//! - it runs at most one operation per attempt at a time, queueing the rest in
//!   submission order (so a re-issued create always runs after, and adopts the
//!   effect of, a late earlier one);
//! - each operation takes a latency, then its effect is applied to the backend,
//!   then its result travels back with a delivery delay.
//!
//! Delivery faults ([`DeliveryFault`]) are armed one-shot and consumed by the
//! next submitted operation of the matching kind; random reordering and
//! duplication come from [`ExecutorConfig`] and a seeded generator.
//! Bootstrap observations travel the same path but stay in order per session,
//! as a real stream does.

use crate::backend::FakeBackend;
use crate::rng::SimRng;
use std::collections::{BTreeMap, VecDeque};
use swactor_provisioning::{
    BootstrapObservation, Dispatch, EffectKind, FailureClass, LogicalNodeId, NodeAttemptId,
    OperationId, OperationOutcome, OperationResult, SessionId, Timestamp,
};

/// Latencies and random delivery behaviour. Ranges are inclusive, in milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutorConfig {
    /// How long an operation runs before its effect is applied.
    pub latency_ms: (u64, u64),
    /// How long a result travels back.
    pub delivery_ms: (u64, u64),
    /// How long a bootstrap observation travels (order per session is kept).
    pub observation_delay_ms: (u64, u64),
    /// Chance, in thousandths, that a result is delivered twice.
    pub duplicate_permille: u32,
}

impl ExecutorConfig {
    /// Prompt, in-order delivery: fixed latencies, no duplicates.
    pub fn in_order() -> Self {
        Self {
            latency_ms: (20, 20),
            delivery_ms: (5, 5),
            observation_delay_ms: (5, 5),
            duplicate_permille: 0,
        }
    }

    /// Adversarial delivery: widely varying latencies, so results and
    /// observations of different nodes overtake each other, and duplicates.
    pub fn adversarial() -> Self {
        Self {
            latency_ms: (1, 400),
            delivery_ms: (0, 1_500),
            observation_delay_ms: (0, 600),
            duplicate_permille: 150,
        }
    }

    /// The largest delay between submitting an operation and its result
    /// arriving, when no fault is armed.
    pub fn round_trip_max_ms(&self) -> u64 {
        self.latency_ms.1 + self.delivery_ms.1
    }
}

/// A one-shot fault on the path between provider and driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliveryFault {
    /// The effect happens, the result never arrives (the driver's deadline fires).
    LoseResult,
    /// The effect happens, but the result arrives as an ambiguous failure (a timeout, a crash).
    AmbiguousWithEffect,
    /// The effect does not happen, and the result is an ambiguous failure.
    AmbiguousWithoutEffect,
    /// The result is delivered twice.
    Duplicate,
    /// The result arrives `extra_ms` late.
    Delay {
        /// Additional delivery delay.
        extra_ms: u64,
    },
    /// The operation completes only `extra_ms` after its deadline; its result comes later still.
    LateCompletion {
        /// How far past the deadline the effect is applied.
        extra_ms: u64,
    },
}

/// A fault and the kind of operation it waits for (`None`: the next operation of any kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArmedDelivery {
    /// Which operation kind consumes it.
    pub kind: Option<EffectKind>,
    /// What happens to it.
    pub fault: DeliveryFault,
}

/// What the executor did with a submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// A new operation, queued or started.
    Accepted,
    /// A known, finished operation; its recorded result is delivered again.
    Replayed,
    /// A known operation still queued or running; nothing more happens.
    AlreadyRunning,
    /// The id was already used with a different request; refused.
    Conflict,
}

/// Something travelling back to the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// An operation result.
    Result(OperationResult),
    /// A bootstrap stream observation.
    Observation(BootstrapObservation),
}

/// Lifetime counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Submissions of new operations.
    pub accepted: u64,
    /// Submissions that replayed a finished operation.
    pub replayed: u64,
    /// Submissions refused for reusing an id with a different request.
    pub conflicts: u64,
    /// Times an operation started while another of its attempt was running (must stay 0).
    pub overlaps: u64,
    /// Results dropped by a fault.
    pub results_lost: u64,
    /// Extra deliveries made by duplication.
    pub duplicates: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum OpState {
    Queued,
    Running,
    Done(OperationOutcome),
}

#[derive(Clone, Debug)]
struct OpEntry {
    dispatch: Dispatch,
    state: OpState,
    fault: Option<DeliveryFault>,
}

#[derive(Clone, Debug)]
enum Event {
    Apply(OperationId),
    Deliver(Output),
}

type AttemptKey = (LogicalNodeId, NodeAttemptId);

/// The executor and its unreliable return path. See the module docs.
#[derive(Clone, Debug)]
pub struct FakeExecutor {
    backend: FakeBackend,
    config: ExecutorConfig,
    rng: SimRng,
    ops: BTreeMap<OperationId, OpEntry>,
    queues: BTreeMap<AttemptKey, VecDeque<OperationId>>,
    events: BTreeMap<(Timestamp, u64), Event>,
    event_seq: u64,
    session_clock: BTreeMap<SessionId, Timestamp>,
    armed: Vec<ArmedDelivery>,
    stats: ExecutorStats,
}

impl FakeExecutor {
    /// An executor over `backend`; `seed` drives every random delay.
    pub fn new(backend: FakeBackend, config: ExecutorConfig, seed: u64) -> Self {
        Self {
            backend,
            config,
            rng: SimRng::new(seed),
            ops: BTreeMap::new(),
            queues: BTreeMap::new(),
            events: BTreeMap::new(),
            event_seq: 0,
            session_clock: BTreeMap::new(),
            armed: Vec::new(),
            stats: ExecutorStats::default(),
        }
    }

    /// The provider.
    pub fn backend(&self) -> &FakeBackend {
        &self.backend
    }

    /// The provider, for arming faults or deleting things out of band.
    pub fn backend_mut(&mut self) -> &mut FakeBackend {
        &mut self.backend
    }

    /// The delivery configuration in force.
    pub fn config(&self) -> &ExecutorConfig {
        &self.config
    }

    /// Lifetime counters.
    pub fn stats(&self) -> ExecutorStats {
        self.stats
    }

    /// Arms a one-shot delivery fault for the next operation of `kind` (any kind for `None`).
    pub fn arm(&mut self, kind: Option<EffectKind>, fault: DeliveryFault) {
        self.armed.push(ArmedDelivery { kind, fault });
    }

    /// The delivery faults armed and not consumed yet.
    pub fn armed(&self) -> &[ArmedDelivery] {
        &self.armed
    }

    /// Stops all faults from here on: disarms delivery faults, switches to
    /// `fair` delivery, and heals the backend. Operations already submitted keep
    /// the fault they drew (a late completion stays late).
    pub fn heal(&mut self, fair: ExecutorConfig, now: Timestamp) {
        self.armed.clear();
        self.config = fair;
        self.backend.heal(now);
    }

    fn schedule(&mut self, at: Timestamp, event: Event) {
        self.event_seq += 1;
        self.events.insert((at, self.event_seq), event);
    }

    fn draw(&mut self, (lo, hi): (u64, u64)) -> u64 {
        self.rng.range(lo, hi)
    }

    /// Submits a dispatch. See [`Submitted`] for the deduplication rules.
    pub fn submit(&mut self, dispatch: &Dispatch, now: Timestamp) -> Submitted {
        if let Some(entry) = self.ops.get(&dispatch.op) {
            if entry.dispatch != *dispatch {
                self.stats.conflicts += 1;
                return Submitted::Conflict;
            }
            let OpState::Done(outcome) = &entry.state else {
                return Submitted::AlreadyRunning;
            };
            let result = OperationResult {
                node: dispatch.key.node,
                op: dispatch.op,
                outcome: outcome.clone(),
            };
            let at = Timestamp(now.0 + self.draw(self.config.delivery_ms));
            self.schedule(at, Event::Deliver(Output::Result(result)));
            self.stats.replayed += 1;
            return Submitted::Replayed;
        }
        let kind = dispatch.request.kind();
        let fault = self
            .armed
            .iter()
            .position(|a| a.kind.is_none_or(|k| k == kind))
            .map(|i| self.armed.remove(i).fault);
        self.ops.insert(
            dispatch.op,
            OpEntry {
                dispatch: dispatch.clone(),
                state: OpState::Queued,
                fault,
            },
        );
        self.stats.accepted += 1;
        let queue = self
            .queues
            .entry((dispatch.key.node, dispatch.op.attempt))
            .or_default();
        queue.push_back(dispatch.op);
        if queue.len() == 1 {
            self.start(dispatch.op, now);
        }
        Submitted::Accepted
    }

    fn start(&mut self, op: OperationId, now: Timestamp) {
        let latency = self.draw(self.config.latency_ms);
        let entry = self.ops.get_mut(&op).expect("started ops are known");
        debug_assert_eq!(entry.state, OpState::Queued);
        entry.state = OpState::Running;
        let key = (entry.dispatch.key.node, op.attempt);
        let mut apply_at = Timestamp(now.0 + latency);
        if let Some(DeliveryFault::LateCompletion { extra_ms }) = entry.fault {
            apply_at = apply_at.max(Timestamp(entry.dispatch.deadline.0 + extra_ms));
        }
        let running = self.queues[&key]
            .iter()
            .filter(|o| matches!(self.ops[o].state, OpState::Running))
            .count();
        if running > 1 {
            self.stats.overlaps += 1;
        }
        self.schedule(apply_at, Event::Apply(op));
    }

    fn apply(&mut self, op: OperationId, now: Timestamp) {
        let entry = &self.ops[&op];
        let (dispatch, fault) = (entry.dispatch.clone(), entry.fault.clone());
        let outcome = match fault {
            Some(DeliveryFault::AmbiguousWithoutEffect) => OperationOutcome::Failed {
                class: FailureClass::Ambiguous,
                reason: "connection reset before the request was sent".to_owned(),
            },
            _ => self.backend.execute(&dispatch.key, &dispatch.request, now),
        };
        let reported = match fault {
            Some(DeliveryFault::AmbiguousWithEffect) => OperationOutcome::Failed {
                class: FailureClass::Ambiguous,
                reason: "connection reset after the request was sent".to_owned(),
            },
            _ => outcome.clone(),
        };
        self.ops.get_mut(&op).expect("known").state = OpState::Done(reported.clone());
        let result = Output::Result(OperationResult {
            node: dispatch.key.node,
            op,
            outcome: reported,
        });
        let delay = self.draw(self.config.delivery_ms);
        match fault {
            Some(DeliveryFault::LoseResult) => self.stats.results_lost += 1,
            Some(DeliveryFault::Delay { extra_ms }) => {
                self.schedule(Timestamp(now.0 + delay + extra_ms), Event::Deliver(result));
            }
            _ => {
                let twice = matches!(fault, Some(DeliveryFault::Duplicate))
                    || self.rng.chance(self.config.duplicate_permille);
                if twice {
                    let again = Timestamp(now.0 + delay + self.draw(self.config.delivery_ms));
                    self.schedule(again, Event::Deliver(result.clone()));
                    self.stats.duplicates += 1;
                }
                self.schedule(Timestamp(now.0 + delay), Event::Deliver(result));
            }
        }
        // The next operation of this attempt may run now.
        let key = (dispatch.key.node, op.attempt);
        let queue = self.queues.get_mut(&key).expect("applied ops are queued");
        queue.pop_front();
        match queue.front().copied() {
            Some(next) => self.start(next, now),
            None => {
                self.queues.remove(&key);
            }
        }
    }

    /// When something next happens (an effect applies, a result or observation
    /// arrives, a session reports).
    pub fn next_wake(&self) -> Option<Timestamp> {
        let event = self.events.keys().next().map(|(t, _)| *t);
        match (event, self.backend.next_observation_at()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs everything due at or before `now`, in time order, and returns what
    /// arrives at the driver, in arrival order.
    pub fn poll(&mut self, now: Timestamp) -> Vec<Output> {
        let mut out = Vec::new();
        loop {
            let event_at = self.events.keys().next().map(|(t, _)| *t);
            let obs_at = self.backend.next_observation_at();
            let at = match (event_at, obs_at) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => break,
                },
            };
            if at > now {
                break;
            }
            if obs_at == Some(at) {
                for obs in self.backend.poll_observations(at) {
                    let delay = self.draw(self.config.observation_delay_ms);
                    let clock = self.session_clock.entry(obs.session.clone()).or_default();
                    let arrive = Timestamp((at.0 + delay).max(clock.0));
                    *clock = arrive;
                    self.schedule(arrive, Event::Deliver(Output::Observation(obs)));
                }
                continue;
            }
            let (_, event) = self.events.pop_first().expect("peeked above");
            match event {
                Event::Apply(op) => self.apply(op, at),
                Event::Deliver(output) => out.push(output),
            }
        }
        out
    }

    /// The host this executor served died (a daemon killed with `-9`).
    /// Operations not started yet are dropped; each running one either took
    /// its effect at the provider or not (a seeded coin); results and
    /// observations in transit are lost; every stream is detached. The
    /// executor then starts over with empty memory, as a new daemon's does.
    pub fn crash(&mut self, now: Timestamp) {
        let running: Vec<OperationId> = self
            .ops
            .iter()
            .filter(|(_, e)| e.state == OpState::Running)
            .map(|(op, _)| *op)
            .collect();
        for op in running {
            let entry = &self.ops[&op];
            let effect = !matches!(entry.fault, Some(DeliveryFault::AmbiguousWithoutEffect));
            if effect && self.rng.chance(500) {
                let (key, request) = (entry.dispatch.key.clone(), entry.dispatch.request.clone());
                let _ = self.backend.execute(&key, &request, now);
            }
        }
        self.ops.clear();
        self.queues.clear();
        self.events.clear();
        self.session_clock.clear();
        self.backend.detach_streams();
    }

    /// Operations of `attempt` of `node` submitted and not yet applied.
    pub fn in_flight(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> usize {
        self.queues.get(&(*node, attempt)).map_or(0, VecDeque::len)
    }

    /// Operations that have been submitted and not yet applied, over all attempts.
    pub fn in_flight_total(&self) -> usize {
        self.queues.values().map(VecDeque::len).sum()
    }

    /// The kind of every operation of `attempt` of `node` still queued or running.
    pub fn in_flight_kinds(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> Vec<EffectKind> {
        self.queues
            .get(&(*node, attempt))
            .map(|q| {
                q.iter()
                    .map(|op| self.ops[op].dispatch.request.kind())
                    .collect()
            })
            .unwrap_or_default()
    }
}
