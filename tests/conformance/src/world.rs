//! The simulated world: a driver, a fake executor and provider, virtual time, and the oracle.
//!
//! [`World`] steps every party the way a host would (the calling order in the
//! module docs of `swactor_provisioning::Driver`): feed inputs, drain passes,
//! submit every dispatch, re-arm one timer. Time is virtual: the world jumps
//! straight to the earliest wake-up of any party (the driver's
//! [`Reconciler::poll_timeout`], the executor's next latency, delivery or
//! bootstrap step). Every step goes through the [`Oracle`].
//!
//! The system under test sits behind the small [`Reconciler`] trait, which
//! [`Driver`] implements; a test can wrap a driver to break it on purpose and
//! check that the oracle notices.

use crate::backend::{BackendConfig, FakeBackend, ProviderFault};
use crate::executor::{ExecutorConfig, FakeExecutor, Output, Submitted};
use crate::oracle::{Invariant, Oracle, Snapshot, StepEvent, independently_converged};
use crate::trace::{Input, InvalidUpdate, LATE_EXTRA_MAX_MS, Mode, ProviderFaultInput, Trace};
use std::collections::BTreeMap;
use swactor_provisioning::{
    BootParams, BootstrapObservation, ClusterShape, ClusterState, DesiredState, DesiredUpdate,
    Dispatch, Driver, DriverError, DriverStats, Folded, Generation, GroupShape, LogicalNodeId,
    NodeAttemptId, OperationResult, OperationTimeouts, Pass, ProviderShape, ReconcilerConfig,
    RunId, SwarmJoin, Timestamp, UpdateError,
};

/// The driver operations a host uses, so a harness can wrap or replace the driver.
///
/// Every method means what the [`Driver`] method of the same name means.
pub trait Reconciler {
    /// See [`Driver::update_desired`].
    ///
    /// # Errors
    /// As the driver's.
    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError>;
    /// See [`Driver::handle_result`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_submit_failed`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_submit_failed(
        &mut self,
        dispatch: &Dispatch,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_bootstrap`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_agent_lost`].
    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        reason: &str,
        now: Timestamp,
    ) -> Folded;
    /// See [`Driver::handle_timeout`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError>;
    /// See [`Driver::handle_tick`].
    fn handle_tick(&mut self, now: Timestamp);
    /// See [`Driver::poll_timeout`].
    fn poll_timeout(&self) -> Option<Timestamp>;
    /// See [`Driver::poll_pass`].
    ///
    /// # Errors
    /// As the driver's.
    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError>;
    /// See [`Driver::finish_pass`].
    ///
    /// # Errors
    /// As the driver's.
    fn finish_pass(&mut self) -> Result<(), DriverError>;
    /// See [`Driver::state`].
    fn state(&self) -> &ClusterState;
    /// See [`Driver::desired`].
    fn desired(&self) -> &DesiredState;
    /// See [`Driver::is_converged`].
    fn is_converged(&self) -> bool;
    /// See [`Driver::stats`].
    fn stats(&self) -> DriverStats;
    /// See [`Driver::is_pass_queued`].
    fn is_pass_queued(&self) -> bool;
}

impl Reconciler for Driver {
    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError> {
        Driver::update_desired(self, shape)
    }
    fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_result(self, result, now)
    }
    fn handle_submit_failed(
        &mut self,
        dispatch: &Dispatch,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_submit_failed(self, &dispatch.key.node, dispatch.op, reason, now)
    }
    fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_bootstrap(self, obs, now)
    }
    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        reason: &str,
        now: Timestamp,
    ) -> Folded {
        Driver::handle_agent_lost(self, node, attempt, reason, now)
    }
    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        Driver::handle_timeout(self, now)
    }
    fn handle_tick(&mut self, now: Timestamp) {
        Driver::handle_tick(self, now);
    }
    fn poll_timeout(&self) -> Option<Timestamp> {
        Driver::poll_timeout(self)
    }
    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError> {
        Driver::poll_pass(self, now)
    }
    fn finish_pass(&mut self) -> Result<(), DriverError> {
        Driver::finish_pass(self)
    }
    fn state(&self) -> &ClusterState {
        Driver::state(self)
    }
    fn desired(&self) -> &DesiredState {
        Driver::desired(self)
    }
    fn is_converged(&self) -> bool {
        Driver::is_converged(self)
    }
    fn stats(&self) -> DriverStats {
        Driver::stats(self)
    }
    fn is_pass_queued(&self) -> bool {
        Driver::is_pass_queued(self)
    }
}

/// The run every world drives.
pub const RUN: &str = "conformance";
/// The groups of the generated shapes.
pub const GROUPS: [&str; 2] = ["alpha", "beta"];

/// Everything that parameterises a world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldConfig {
    /// The driver's configuration.
    pub reconciler: ReconcilerConfig,
    /// The provider's configuration.
    pub backend: BackendConfig,
    /// Delivery during the faulty prefix.
    pub executor: ExecutorConfig,
    /// Delivery once faults stop (the fair tail).
    pub fair: ExecutorConfig,
    /// Passes one instant may take before the world calls it a hot loop.
    pub passes_per_instant_max: usize,
    /// Group counts and template variants of the first shape.
    pub initial: [(u8, u8); 2],
    /// Whether the host folds every output that arrived at one instant
    /// (results, observations, and then its timer) before draining passes,
    /// instead of draining after each.
    pub batch_deliveries: bool,
}

impl WorldConfig {
    /// The configuration the battery uses for `mode`.
    ///
    /// Durations are shortened from the production defaults (cap 16 s instead
    /// of 60 s, stall 10 s instead of 300 s) but keep their proportions:
    /// operation timeouts exceed the slowest un-faulted round trip, the stall
    /// deadline exceeds a whole bootstrap script many times over.
    pub fn for_mode(mode: Mode) -> Self {
        Self {
            reconciler: ReconcilerConfig {
                backoff_base_ms: 500,
                backoff_cap_ms: 16_000,
                jitter_permille: 500,
                probe_interval_ms: 250,
                bootstrap_stall_ms: 10_000,
                timeouts: OperationTimeouts {
                    create_lease_ms: 4_000,
                    lookup_endpoint_ms: 2_500,
                    start_bootstrap_ms: 3_000,
                    cancel_bootstrap_ms: 2_500,
                    destroy_lease_ms: 3_000,
                },
                first_attempt_id: 1,
            },
            backend: BackendConfig {
                endpoint_delay_ms: 300,
                ..BackendConfig::default()
            },
            executor: match mode {
                Mode::InOrder => ExecutorConfig::in_order(),
                Mode::Adversarial => ExecutorConfig::adversarial(),
            },
            fair: ExecutorConfig::in_order(),
            passes_per_instant_max: 32,
            initial: [(2, 0), (1, 0)],
            batch_deliveries: mode == Mode::Adversarial,
        }
    }

    /// The bound the fair tail must converge within; see [`TailBound`].
    pub fn tail_bound(&self, nodes: usize) -> TailBound {
        TailBound::derive(self, nodes)
    }
}

/// How long the fair tail may take, derived from the configuration.
///
/// # Derivation
/// Once faults stop at `t0`, the slowest node is one whose prefix left it in
/// the worst place on each of these sequential waits (nodes progress in
/// parallel, so the bound is per node):
///
/// 1. an operation whose result was lost or that completes late: its deadline
///    (at most the largest timeout `T`), or the late completion
///    (`T + LATE_EXTRA_MAX_MS`) that a re-issue queues behind;
/// 2. the retry backoff that follows (at most the cap `C`);
/// 3. the re-issued create adopts a session whose observations went by
///    unheard, so the node waits out the stall deadline `S`;
/// 4. cleanup of that attempt (adopt, cancel, destroy: three round trips)
///    and the restart backoff (at most `C`);
/// 5. a fresh attempt: create, probes until the endpoint is ready (heal makes
///    every endpoint ready, new ones take the configured delay `E`, so at most
///    `E / P + 1` probes), start, the whole bootstrap script `B`, one pass.
///
/// With `R` the slowest fair round trip (plus one observation delay), that is
/// `T + X + C + S + 3R + C + R + E + P + R + R + B + slack`, where `X` is
/// [`LATE_EXTRA_MAX_MS`]. Each step triggers at most one pass per node; a node
/// sees at most two attempts in the tail (the one it had and its replacement),
/// each with at most ~24 triggering events (about 8 results and probes, 7
/// observations, 2 expiries and 5 transitions, plus duplicates), so passes are
/// bounded by `48 * nodes + 16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailBound {
    /// Virtual time the tail may take, in milliseconds.
    pub time_ms: u64,
    /// Passes the tail may take.
    pub passes: u64,
}

impl TailBound {
    /// The bound for a world configured by `c` with `nodes` nodes (the larger
    /// of the nodes held at `t0` and the nodes desired).
    pub fn derive(c: &WorldConfig, nodes: usize) -> Self {
        let r = &c.reconciler;
        let t = &r.timeouts;
        let timeout_max = [
            t.create_lease_ms,
            t.lookup_endpoint_ms,
            t.start_bootstrap_ms,
            t.cancel_bootstrap_ms,
            t.destroy_lease_ms,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let round_trip = c.fair.round_trip_max_ms() + c.fair.observation_delay_ms.1;
        let script = 8 * c.backend.bootstrap_step_ms + c.fair.observation_delay_ms.1;
        let slack = 1_000;
        let time_ms = timeout_max
            + LATE_EXTRA_MAX_MS
            + 2 * r.backoff_cap_ms
            + r.bootstrap_stall_ms
            + 6 * round_trip
            + c.backend.endpoint_delay_ms
            + r.probe_interval_ms
            + script
            + slack;
        Self {
            time_ms,
            passes: 48 * nodes as u64 + 16,
        }
    }
}

/// What the fair tail did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailReport {
    /// Whether the cluster converged within the bound.
    pub converged: bool,
    /// Virtual time from the end of faults to convergence.
    pub time_ms: u64,
    /// Passes from the end of faults to convergence.
    pub passes: u64,
    /// The bound that applied.
    pub bound: TailBound,
}

/// The simulated world. See the module docs.
pub struct World<R: Reconciler = Driver> {
    sut: R,
    exec: FakeExecutor,
    oracle: Oracle,
    config: WorldConfig,
    now: Timestamp,
    groups: [(u8, u8); 2],
    generation: u64,
    abort: Option<(u8, bool)>,
    timer_lost: bool,
    submitted: Vec<Dispatch>,
    snapshot: Snapshot,
    passes: u64,
}

fn snapshot<R: Reconciler>(sut: &R, now: Timestamp) -> Snapshot {
    Snapshot {
        now,
        state: sut.state().clone(),
        desired: sut.desired().clone(),
        timer: sut.poll_timeout(),
        converged_claim: sut.is_converged(),
        stats: sut.stats(),
        pass_queued: Some(sut.is_pass_queued()),
    }
}

/// The shape with the given group counts and template variants.
pub fn shape_of(generation: u64, groups: &[(u8, u8); 2]) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation(generation),
        groups: GROUPS
            .iter()
            .zip(groups)
            .map(|(id, (count, variant))| GroupShape {
                id: (*id).to_owned(),
                run_id: None,
                count: u32::from(*count),
                provider: ProviderShape {
                    kind: "fake".to_owned(),
                    params: BTreeMap::new(),
                },
                boot: BootParams {
                    image: Some(format!("image-v{variant}")),
                    ..BootParams::default()
                },
                role: "worker".to_owned(),
                join: SwarmJoin::default(),
            })
            .collect(),
    }
}

impl World<Driver> {
    /// A world around a fresh [`Driver`] configured by `config`.
    pub fn new(config: WorldConfig, seed: u64) -> Self {
        let driver = Driver::new(RunId::new(RUN), config.reconciler.clone())
            .expect("the world's reconciler config is valid");
        Self::with_reconciler(driver, config, seed)
    }
}

impl<R: Reconciler> World<R> {
    /// A world around `sut`, which must be a fresh driver for [`RUN`]
    /// configured with `config.reconciler`. Applies the initial shape
    /// (generation 1) at time zero.
    pub fn with_reconciler(sut: R, config: WorldConfig, seed: u64) -> Self {
        let backend = FakeBackend::new(config.backend.clone(), seed ^ 0xb0b0);
        let exec = FakeExecutor::new(backend, config.executor.clone(), seed);
        let snapshot = snapshot(&sut, Timestamp(0));
        let mut world = Self {
            sut,
            exec,
            oracle: Oracle::new(config.reconciler.clone()),
            groups: config.initial,
            config,
            now: Timestamp(0),
            generation: 0,
            abort: None,
            timer_lost: false,
            submitted: Vec::new(),
            snapshot,
            passes: 0,
        };
        world.oracle.begin_input("initial shape".to_owned());
        world.generation = 1;
        let shape = shape_of(1, &world.groups);
        world.offer(&shape);
        world.settle();
        world
    }

    /// The system under test.
    pub fn sut(&self) -> &R {
        &self.sut
    }

    /// The executor and, through it, the provider.
    pub fn executor(&self) -> &FakeExecutor {
        &self.exec
    }

    /// The executor, for arming faults by hand in a scenario test.
    pub fn executor_mut(&mut self) -> &mut FakeExecutor {
        &mut self.exec
    }

    /// The oracle.
    pub fn oracle(&self) -> &Oracle {
        &self.oracle
    }

    /// The oracle, for reporting harness-level violations.
    pub fn oracle_mut(&mut self) -> &mut Oracle {
        &mut self.oracle
    }

    /// The world's configuration.
    pub fn config(&self) -> &WorldConfig {
        &self.config
    }

    /// Virtual now.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// Passes run so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// The current desired group counts and variants, and the generation.
    pub fn shape(&self) -> ([(u8, u8); 2], u64) {
        (self.groups, self.generation)
    }

    /// A digest of everything observable, for replay comparisons.
    pub fn digest(&self) -> String {
        format!(
            "{}|{}|{:?}|{:?}|{:?}|{:?}|{:?}",
            self.now,
            self.passes,
            self.sut.state(),
            self.sut.poll_timeout(),
            self.exec.backend().counters(),
            self.exec.stats(),
            self.exec.backend().leases(),
        )
    }

    fn record(&mut self, event: StepEvent<'_>) {
        let after = snapshot(&self.sut, self.now);
        self.oracle
            .observe(event, &self.snapshot, &after, &self.exec);
        self.snapshot = after;
    }

    /// Offers a shape to the driver (valid or not) and lets the oracle judge the answer.
    pub fn offer(&mut self, shape: &ClusterShape) {
        let outcome = self.sut.update_desired(shape);
        self.record(StepEvent::Update {
            shape,
            outcome: &outcome,
        });
    }

    fn deliver(&mut self, output: Output) {
        match output {
            Output::Result(result) => {
                let folded = self.sut.handle_result(result.clone(), self.now);
                self.record(StepEvent::Result {
                    result: &result,
                    folded: &folded,
                });
            }
            Output::Observation(obs) => {
                let folded = self.sut.handle_bootstrap(obs.clone(), self.now);
                self.record(StepEvent::Observation {
                    obs: &obs,
                    folded: &folded,
                });
            }
        }
    }

    /// Runs every queued pass at `now`, submitting its dispatches (or losing
    /// them, when a pass abort is armed).
    fn drain(&mut self) -> usize {
        let mut passes = 0;
        loop {
            let pass = match self.sut.poll_pass(self.now) {
                Ok(Some(pass)) => pass,
                Ok(None) => break,
                Err(e) => {
                    self.oracle
                        .report(Invariant::DriverErrorFree, None, format!("poll_pass: {e}"));
                    break;
                }
            };
            passes += 1;
            self.passes += 1;
            self.record(StepEvent::Pass { pass: &pass });
            let keep = match self.abort {
                Some((keep, report)) if !pass.dispatches.is_empty() => {
                    self.abort = None;
                    Some((usize::from(keep), report))
                }
                _ => None,
            };
            for (i, d) in pass.dispatches.iter().enumerate() {
                match keep {
                    Some((keep, report)) if i >= keep => {
                        if report {
                            let folded =
                                self.sut
                                    .handle_submit_failed(d, "host aborted the pass", self.now);
                            self.record(StepEvent::SubmitFailed {
                                dispatch: d,
                                folded: &folded,
                            });
                        }
                    }
                    _ => {
                        if self.exec.submit(d, self.now) == Submitted::Conflict {
                            let folded =
                                self.sut
                                    .handle_submit_failed(d, "operation id conflict", self.now);
                            self.record(StepEvent::SubmitFailed {
                                dispatch: d,
                                folded: &folded,
                            });
                        }
                        self.submitted.push(d.clone());
                    }
                }
            }
            if let Err(e) = self.sut.finish_pass() {
                self.oracle.report(
                    Invariant::DriverErrorFree,
                    None,
                    format!("finish_pass: {e}"),
                );
                break;
            }
            if passes > self.config.passes_per_instant_max {
                break;
            }
        }
        let after = snapshot(&self.sut, self.now);
        if passes > 0 {
            self.oracle
                .on_quiescent(&after, passes, self.config.passes_per_instant_max);
        }
        self.snapshot = after;
        passes
    }

    /// Runs everything due at `now`: deliveries, the driver's timer, passes.
    fn settle(&mut self) {
        for output in self.exec.poll(self.now) {
            self.deliver(output);
            // A host that reconciles after every message; the other kind
            // folds everything that arrived at once and reconciles once,
            // like an actor draining its mailbox.
            if !self.config.batch_deliveries {
                self.drain();
            }
        }
        let due = self.sut.poll_timeout().is_some_and(|t| t <= self.now);
        if due && self.timer_lost {
            // The timer was lost; the safety-net tick must notice the due deadline.
            self.timer_lost = false;
            self.sut.handle_tick(self.now);
            self.record(StepEvent::Tick);
            if self.drain() == 0 {
                self.oracle.report(
                    Invariant::RequeueAtEarliestWaitingDeadline,
                    None,
                    format!("a tick at {} with a due deadline queued no pass", self.now),
                );
            }
        }
        let fired = self.sut.poll_timeout().is_some_and(|t| t <= self.now);
        if fired {
            let folded = self.sut.handle_timeout(self.now);
            self.record(StepEvent::Timeout { folded: &folded });
        }
        self.drain();
        // A timer that fired and was served must move into the future;
        // otherwise the host would spin on it.
        if let Some(t) = self.sut.poll_timeout().filter(|t| fired && *t <= self.now) {
            self.oracle.report(
                Invariant::RequeueAtEarliestWaitingDeadline,
                None,
                format!("the timer fired at {} and still says {t}", self.now),
            );
        }
    }

    /// The earliest wake-up of any party.
    pub fn next_wake(&self) -> Option<Timestamp> {
        match (self.sut.poll_timeout(), self.exec.next_wake()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the earliest wake-up and runs it. False when nothing is left to wake.
    pub fn step(&mut self) -> bool {
        let Some(at) = self.next_wake() else {
            return false;
        };
        // A timer in the past was already run; never go back, never stall.
        self.now = at.max(Timestamp(self.now.0 + u64::from(at <= self.now)));
        self.settle();
        true
    }

    /// Advances virtual time to `target`, waking at every deadline on the way.
    pub fn run_until(&mut self, target: Timestamp) {
        while self.next_wake().is_some_and(|t| t <= target) && self.oracle.ok() {
            self.step();
        }
        if target > self.now {
            self.now = target;
            self.settle();
        }
    }

    /// Applies one trace input.
    pub fn apply(&mut self, input: &Input) {
        self.oracle
            .begin_input(format!("{input:?} at {}", self.now));
        match *input {
            Input::Shape {
                group,
                count,
                variant,
                skip,
            } => {
                self.groups[usize::from(group % 2)] = (count, variant);
                self.generation += 1 + u64::from(skip);
                let shape = shape_of(self.generation, &self.groups);
                self.offer(&shape);
            }
            Input::Resubmit => {
                let shape = shape_of(self.generation, &self.groups);
                self.offer(&shape);
            }
            Input::Invalid(kind) => {
                let mut groups = self.groups;
                let shape = match kind {
                    InvalidUpdate::GenerationRegression => {
                        groups[0].0 = (groups[0].0 + 1) % 4;
                        shape_of(self.generation.saturating_sub(1), &groups)
                    }
                    InvalidUpdate::SameGenerationChange => {
                        groups[1].1 = (groups[1].1 + 1) % 3;
                        shape_of(self.generation, &groups)
                    }
                    InvalidUpdate::WrongRun => {
                        let mut s = shape_of(self.generation + 1, &groups);
                        s.run_id = RunId::new("another-run");
                        s
                    }
                    InvalidUpdate::Malformed => {
                        let mut s = shape_of(self.generation + 1, &groups);
                        s.groups[0].id = "Alpha".to_owned();
                        s
                    }
                };
                self.offer(&shape);
            }
            Input::Advance { ms } => {
                let target = Timestamp(self.now.0 + u64::from(ms));
                self.run_until(target);
            }
            Input::Step => {
                self.step();
            }
            Input::Tick => {
                self.sut.handle_tick(self.now);
                self.record(StepEvent::Tick);
            }
            Input::HostPause { ms } => {
                // Nothing is woken during the pause; `settle` below then
                // serves every late delivery and the late timer at once.
                self.now = Timestamp(self.now.0 + u64::from(ms));
            }
            Input::LoseTimerOnce => self.timer_lost = true,
            Input::Provider(f) => {
                let fault = match f {
                    ProviderFaultInput::Refuse(kind) => ProviderFault::Refuse { kind },
                    ProviderFaultInput::EndpointNeverReady => ProviderFault::EndpointNeverReady,
                    ProviderFaultInput::EndpointSlow(ms) => ProviderFault::EndpointSlow {
                        delay_ms: u64::from(ms),
                    },
                    ProviderFaultInput::BootstrapFailsAt(stage) => {
                        ProviderFault::BootstrapFailsAt { stage }
                    }
                    ProviderFaultInput::LoseObservations(mask) => {
                        ProviderFault::LoseObservations { mask }
                    }
                    ProviderFaultInput::CloseAfterConverge => ProviderFault::CloseAfterConverge,
                    ProviderFaultInput::Invisible(ms) => ProviderFault::Invisible {
                        lag_ms: u64::from(ms),
                    },
                };
                self.exec.backend_mut().arm(fault);
            }
            Input::Delivery { kind, ref fault } => self.exec.arm(kind, fault.clone()),
            Input::AbortNextPass { keep, report } => self.abort = Some((keep, report)),
            Input::DeleteOutOfBand { pick } => {
                // Only machines whose bootstrap stream is open: that stream is
                // the one channel through which the core can learn of the loss
                // (see the crate README, "gaps").
                let candidates: Vec<_> = self
                    .exec
                    .backend()
                    .sessions()
                    .values()
                    .filter(|s| s.open)
                    .map(|s| s.lease.clone())
                    .collect();
                if !candidates.is_empty() {
                    let lease = candidates[usize::from(pick) % candidates.len()].clone();
                    let now = self.now;
                    self.exec.backend_mut().delete_out_of_band(&lease, now);
                }
            }
            Input::AgentLost { pick, stale } => {
                let nodes = &self.sut.state().nodes;
                if !nodes.is_empty() {
                    let (id, n) = nodes
                        .iter()
                        .nth(usize::from(pick) % nodes.len())
                        .expect("index is in range");
                    let attempt = NodeAttemptId(n.attempt.0 - u64::from(stale));
                    let id = id.clone();
                    let folded =
                        self.sut
                            .handle_agent_lost(&id, attempt, "agent left the swarm", self.now);
                    self.record(StepEvent::AgentLost {
                        node: &id,
                        attempt,
                        folded,
                    });
                }
            }
            Input::ResubmitOld { pick } => {
                if !self.submitted.is_empty() {
                    let d = self.submitted[usize::from(pick) % self.submitted.len()].clone();
                    if self.exec.submit(&d, self.now) == Submitted::Conflict {
                        self.oracle.report(
                            Invariant::OperationIdsNeverReused,
                            Some(&d.key.node),
                            format!("{} was submitted with two different requests", d.op),
                        );
                    }
                }
            }
        }
        self.settle();
    }

    /// Stops every fault: the executor delivers fairly from now on and the provider heals.
    pub fn heal(&mut self) {
        self.abort = None;
        self.timer_lost = false;
        let fair = self.config.fair.clone();
        self.exec.heal(fair, self.now);
    }

    /// Heals the world and runs it until the driver converges, judging the
    /// time and passes it takes against the derived [`TailBound`]; then lets
    /// stragglers (duplicated results, late completions) arrive and checks the
    /// end state.
    pub fn run_fair_tail(&mut self) -> TailReport {
        self.oracle
            .begin_input(format!("fair tail from {}", self.now));
        self.heal();
        let (t0, p0) = (self.now, self.passes);
        let nodes = self
            .sut
            .state()
            .nodes
            .len()
            .max(self.sut.desired().node_count() as usize);
        let bound = self.config.tail_bound(nodes);
        let converged_now = |w: &Self| {
            independently_converged(w.sut.state(), w.sut.desired()) && w.sut.is_converged()
        };
        let mut converged = converged_now(self);
        while !converged && self.oracle.ok() {
            let used = (self.now.0 - t0.0, self.passes - p0);
            if used.0 > bound.time_ms || used.1 > bound.passes {
                break;
            }
            if !self.step() {
                break;
            }
            converged = converged_now(self);
        }
        let report = TailReport {
            converged,
            time_ms: self.now.0 - t0.0,
            passes: self.passes - p0,
            bound,
        };
        if !self.oracle.ok() {
            return report;
        }
        if !converged || report.time_ms > bound.time_ms || report.passes > bound.passes {
            let stuck = self
                .sut
                .state()
                .nodes
                .iter()
                .find(|(_, n)| !n.is_ready())
                .map(|(id, n)| (id.clone(), format!("{:?} {:?}", n.intent, n.record.stage)));
            let detail = format!(
                "not converged after {} ms and {} passes of fair delivery (bound {} ms, {} passes); first unready node: {:?}",
                report.time_ms,
                report.passes,
                bound.time_ms,
                bound.passes,
                stuck.as_ref().map(|s| &s.1)
            );
            self.oracle.report(
                Invariant::FairConvergenceWithinBound,
                stuck.as_ref().map(|(id, _)| id),
                detail,
            );
            return report;
        }
        // Let anything still travelling arrive; convergence must survive it.
        let settle_until = Timestamp(self.now.0 + LATE_EXTRA_MAX_MS * 2 + 5_000);
        self.run_until(settle_until);
        let after = snapshot(&self.sut, self.now);
        self.oracle.finish(&after, &self.exec);
        report
    }
}

/// What running one trace produced.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Violations found (empty when the run passed).
    pub violations: Vec<crate::oracle::Violation>,
    /// The fair tail, when the prefix got that far.
    pub tail: Option<TailReport>,
    /// The digest of the end state.
    pub digest: String,
    /// Steps the oracle saw.
    pub steps: u64,
}

/// Runs `trace` through a world around `sut`: the faulty prefix, then the fair tail.
pub fn run_trace_with<R: Reconciler>(sut: R, config: &WorldConfig, trace: &Trace) -> RunReport {
    let mut world = World::with_reconciler(sut, config.clone(), trace.seed);
    for input in &trace.inputs {
        if !world.oracle().ok() {
            break;
        }
        world.apply(input);
    }
    let tail = world.oracle().ok().then(|| world.run_fair_tail());
    RunReport {
        violations: world.oracle().violations().to_vec(),
        tail,
        digest: world.digest(),
        steps: world.oracle().steps(),
    }
}

/// Runs `trace` through a world around a fresh [`Driver`].
pub fn run_trace(config: &WorldConfig, trace: &Trace) -> RunReport {
    let driver = Driver::new(RunId::new(RUN), config.reconciler.clone())
        .expect("the world's reconciler config is valid");
    run_trace_with(driver, config, trace)
}
