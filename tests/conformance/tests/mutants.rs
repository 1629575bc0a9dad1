//! Proof that the battery bites: deliberately broken drivers, each caught within the default seeds.
//!
//! Every mutation lives in a wrapper around a real [`Driver`] (no hook inside
//! the core): the wrapper rewrites what goes in or what comes out, the way a
//! buggy driver would behave from the outside. Compiled only for tests.

use std::collections::BTreeMap;
use std::rc::Rc;
use swactor_conformance::battery::{BatteryConfig, Suite, run_battery, suite_trace_for_seed};
use swactor_conformance::{
    Factory, Invariant, Mode, RUN, Reconciler, Renewals, SHORT_LEASE_S, WorldConfig, run_trace_with,
};
use swactor_provisioning::{
    AdoptEntry, Adoption, BootstrapObservation, Breaker, ClusterShape, ClusterState, DesiredState,
    DesiredUpdate, Dispatch, Driver, DriverError, DriverStats, EffectRequest, FailureCause,
    FailureClass, Folded, Generation, GroupId, LogicalNodeId, NodeAttemptId, NodeStage,
    OperationId, OperationOutcome, OperationResult, Pass, Plan, Quantity, ReconcilerConfig,
    RolloutStatus, RunId, Timestamp, UpdateError,
};

/// One way to break the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    /// No mutation: the honest driver behind the same wrapper.
    Nothing,
    /// Destroys the lease where it should cancel the bootstrap first.
    SwapCleanupOrder,
    /// Sends every effect a second time under an operation id it never recorded.
    DispatchWithoutPending,
    /// Folds a superseded attempt's result as if it answered the current operation.
    FoldSupersededResult,
    /// Keys every dispatch on the slot's first attempt id.
    ReuseAttemptId,
    /// Treats an ambiguous CreateLease failure as definite (forgets it may have leased).
    ForgetAmbiguousCreate,
    /// Runs a pass as late as the latest pending restart, so restarts skip their backoff.
    RestartWithoutBackoff,
    /// Destroys the lowest-index slot's lease when scaling a group down.
    ScaleDownLowestIndex,
    /// Never expires pending operations.
    SkipTimeouts,
    /// Accepts a regressed generation as if it were the next one.
    AcceptRegression,
    /// Queues a pass whenever any deadline exists, due or not.
    TickIgnoresDueTime,
    /// Never asks to be woken.
    LoseWakeup,
    /// A restarted driver ignores the journal's attempt-id floor.
    IgnoreAttemptFloor,
    /// Adoption takes every adopted attempt as running the desired template.
    AdoptDriftedAsCurrent,
    /// Says it is paused but goes on reconciling as if it were not.
    IgnorePause,
    /// Shows the shape's budgets but rolls every group out with
    /// `max_unavailable = 100%` (everything at once).
    IgnoreRolloutBudget,
    /// Never reports a group's remediation breaker tripped.
    IgnoreBreaker,
    /// Shows the shape's budgets but rolls out with no surge (so a
    /// `max_unavailable` of 0 takes a node down, as 1 would).
    IgnoreSurge,
    /// Shows the shape's budgets but surges by the whole group during every
    /// rollout.
    ExtraSurge,
    /// Tells its host it may go an hour without an input and still have
    /// listened, and ignores the gaps it is told of: a host that stops
    /// hears nobody, and blames its agents for the silence.
    BlameAgentsForDeafGaps,
    /// Drops what a shape says about paused machines: every group replaces
    /// them at their grace's end, even one that waits for them.
    IgnoreOnPreempt,
    /// A restarted host's core is shown the journal's attempts without the
    /// leases the provider listed, so it creates each again (the provider
    /// finds it by its key: nothing is made twice, but every live node is
    /// created anew instead of adopted).
    AdoptIgnoringListedLeases,
    /// A restarted host's core ignores the inventory and the journal: it
    /// starts every slot afresh beside the running nodes.
    AdoptNothing,
}

const ALL: [Mutation; 20] = [
    Mutation::IgnoreOnPreempt,
    Mutation::BlameAgentsForDeafGaps,
    Mutation::IgnoreRolloutBudget,
    Mutation::IgnoreSurge,
    Mutation::ExtraSurge,
    Mutation::IgnoreBreaker,
    Mutation::IgnorePause,
    Mutation::IgnoreAttemptFloor,
    Mutation::AdoptDriftedAsCurrent,
    Mutation::SwapCleanupOrder,
    Mutation::DispatchWithoutPending,
    Mutation::FoldSupersededResult,
    Mutation::ReuseAttemptId,
    Mutation::ForgetAmbiguousCreate,
    Mutation::RestartWithoutBackoff,
    Mutation::ScaleDownLowestIndex,
    Mutation::SkipTimeouts,
    Mutation::AcceptRegression,
    Mutation::TickIgnoresDueTime,
    Mutation::LoseWakeup,
];

struct Mutant {
    inner: Driver,
    /// The configuration the host is shown.
    shown_config: ReconcilerConfig,
    mutation: Mutation,
    first_attempt: BTreeMap<LogicalNodeId, NodeAttemptId>,
    paused: bool,
    /// What `desired` shows when the inner driver was given another shape.
    shown: Option<DesiredState>,
}

impl Mutant {
    fn new(mutation: Mutation, mode: Mode) -> Self {
        let config = WorldConfig::for_mode(mode).reconciler;
        let mut shown_config = config.clone();
        if mutation == Mutation::BlameAgentsForDeafGaps {
            shown_config.listen_gap_ms = 3_600_000;
        }
        Self {
            inner: Driver::new(RunId::new(RUN), config).expect("valid config"),
            shown_config,
            mutation,
            first_attempt: BTreeMap::new(),
            paused: false,
            shown: None,
        }
    }

    fn mutate_pass(&mut self, mut pass: Pass) -> Pass {
        let state = self.inner.state().clone();
        let desired = self.inner.desired().clone();
        match self.mutation {
            Mutation::SwapCleanupOrder => {
                for d in &mut pass.dispatches {
                    if let EffectRequest::CancelBootstrap { .. } = d.request
                        && let Some(lease) = state
                            .nodes
                            .get(&d.key.node)
                            .and_then(|n| n.record.lease.clone())
                    {
                        d.request = EffectRequest::DestroyLease {
                            lease,
                            failed: None,
                        };
                    }
                }
            }
            Mutation::DispatchWithoutPending => {
                let extra: Vec<Dispatch> = pass
                    .dispatches
                    .iter()
                    .map(|d| Dispatch {
                        op: OperationId {
                            attempt: d.op.attempt,
                            seq: d.op.seq + 1_000,
                        },
                        ..d.clone()
                    })
                    .collect();
                pass.dispatches.extend(extra);
            }
            Mutation::ReuseAttemptId => {
                for d in &mut pass.dispatches {
                    let first = *self
                        .first_attempt
                        .entry(d.key.node)
                        .or_insert(d.key.attempt);
                    d.key.attempt = first;
                    d.op.attempt = first;
                }
            }
            Mutation::ScaleDownLowestIndex => {
                for d in &mut pass.dispatches {
                    let EffectRequest::DestroyLease { lease, .. } = &mut d.request else {
                        continue;
                    };
                    if desired.slot(&d.key.node).is_some() {
                        continue;
                    }
                    let lowest = state.nodes.iter().find(|(id, n)| {
                        id.group == d.key.node.group
                            && desired.slot(id).is_some()
                            && n.record.lease.is_some()
                    });
                    if let Some((_, n)) = lowest {
                        *lease = n.record.lease.clone().expect("filtered above");
                    }
                }
            }
            _ => {}
        }
        pass
    }
}

impl Reconciler for Mutant {
    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError> {
        let current = self.inner.desired().generation;
        if self.mutation == Mutation::AcceptRegression && shape.generation < current {
            let mut forward = shape.clone();
            forward.generation = Generation(current.0 + 1);
            return self.inner.update_desired(&forward);
        }
        let budget = match self.mutation {
            Mutation::IgnoreRolloutBudget => Some((Some(Quantity::Percent(100)), None)),
            Mutation::IgnoreSurge => Some((None, Some(Quantity::Count(0)))),
            Mutation::ExtraSurge => Some((None, Some(Quantity::Percent(100)))),
            _ => None,
        };
        if self.mutation == Mutation::IgnoreOnPreempt {
            let mut given = shape.clone();
            for g in &mut given.groups {
                g.policy.on_preempt = None;
                g.policy.preempt_wait_s = None;
            }
            return self.inner.update_desired(&given);
        }
        if let Some((max_unavailable, max_surge)) = budget {
            let mut given = shape.clone();
            for g in &mut given.groups {
                if max_unavailable.is_some() {
                    g.policy.max_unavailable = max_unavailable;
                }
                if max_surge.is_some() {
                    g.policy.max_surge = max_surge;
                }
            }
            let outcome = self.inner.update_desired(&given);
            if let Ok(DesiredUpdate::Accepted(_)) = outcome {
                self.shown = shape.validate().ok();
            }
            return outcome;
        }
        self.inner.update_desired(shape)
    }

    fn handle_result(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let mut result = result.clone();
        let node = self.inner.state().nodes.get(&result.node);
        match self.mutation {
            Mutation::FoldSupersededResult => {
                if let Some(p) = node.and_then(|n| n.pending.as_ref())
                    && result.op.attempt != p.id.attempt
                {
                    result.op = p.id;
                }
            }
            Mutation::ForgetAmbiguousCreate => {
                let create = node.and_then(|n| n.pending.as_ref()).is_some_and(|p| {
                    p.id == result.op && p.effect == swactor_provisioning::EffectKind::CreateLease
                });
                if let (true, OperationOutcome::Failed { class, .. }) =
                    (create, &mut result.outcome)
                {
                    *class = FailureClass::Definite;
                }
            }
            _ => {}
        }
        self.inner.handle_result_ref(&result, now)
    }

    fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.inner.handle_submit_failed(node, op, reason, now)
    }

    fn adopt(&mut self, mut entries: Vec<AdoptEntry>, op_seq_base: u64) -> Adoption {
        match self.mutation {
            Mutation::AdoptDriftedAsCurrent => {
                for e in &mut entries {
                    if let Some(t) = self.inner.desired().slot(&e.key.node) {
                        e.template = Some(t.clone());
                    }
                }
            }
            Mutation::AdoptIgnoringListedLeases => {
                for e in &mut entries {
                    e.lease = None;
                    e.session = None;
                }
            }
            Mutation::AdoptNothing => entries.clear(),
            _ => {}
        }
        self.inner.adopt(entries, op_seq_base)
    }

    fn raise_attempt_floor(&mut self, floor: u64) {
        if self.mutation != Mutation::IgnoreAttemptFloor {
            self.inner.raise_attempt_floor(floor);
        }
    }

    fn carry_failures(&mut self, node: LogicalNodeId, failures: u32) {
        self.inner.carry_failures(node, failures);
    }

    fn plan(&self, now: Timestamp) -> Plan {
        self.inner.plan(now)
    }

    fn plan_shape(&self, shape: &ClusterShape, now: Timestamp) -> Result<Plan, UpdateError> {
        self.inner.plan_shape(shape, now)
    }

    fn config(&self) -> &ReconcilerConfig {
        &self.shown_config
    }

    fn handle_unheard(&mut self, from: Timestamp, to: Timestamp) {
        if self.mutation != Mutation::BlameAgentsForDeafGaps {
            self.inner.handle_unheard(from, to);
        }
    }

    fn handle_bootstrap(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.inner.handle_bootstrap_ref(obs, now)
    }

    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        cause: FailureCause,
        reason: &str,
        now: Timestamp,
    ) -> Folded {
        self.inner
            .handle_agent_lost(node, attempt, cause, reason, now)
    }

    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        if self.mutation == Mutation::SkipTimeouts {
            return Ok(0);
        }
        self.inner.handle_timeout(now)
    }

    fn handle_tick(&mut self, now: Timestamp) {
        if self.mutation == Mutation::TickIgnoresDueTime {
            self.inner.handle_tick(Timestamp(u64::MAX / 2));
        } else {
            self.inner.handle_tick(now);
        }
    }

    fn poll_timeout(&self) -> Option<Timestamp> {
        if self.mutation == Mutation::LoseWakeup {
            return None;
        }
        self.inner.poll_timeout()
    }

    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError> {
        let mut at = now;
        if self.mutation == Mutation::RestartWithoutBackoff {
            let desired = self.inner.desired();
            at = self
                .inner
                .state()
                .nodes
                .iter()
                .filter(|(id, n)| {
                    n.record.stage == NodeStage::Destroyed && desired.slot(id).is_some()
                })
                .filter_map(|(_, n)| n.record.restart_at)
                .fold(now, Timestamp::max);
        }
        let pass = self.inner.poll_pass(at)?;
        Ok(pass.map(|p| self.mutate_pass(p)))
    }

    fn finish_pass(&mut self) -> Result<(), DriverError> {
        self.inner.finish_pass()
    }

    fn state(&self) -> &ClusterState {
        self.inner.state()
    }

    fn desired(&self) -> &DesiredState {
        self.shown.as_ref().unwrap_or_else(|| self.inner.desired())
    }

    fn is_converged(&self) -> bool {
        self.inner.is_converged()
    }

    fn stats(&self) -> DriverStats {
        self.inner.stats()
    }

    fn is_pass_queued(&self) -> bool {
        self.inner.is_pass_queued()
    }

    fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
        if self.mutation != Mutation::IgnorePause {
            self.inner.set_paused(paused);
        }
    }

    fn is_paused(&self) -> bool {
        self.paused
    }

    fn rollout_holds(&self) -> Vec<RolloutStatus> {
        self.inner.rollout_holds()
    }

    fn set_tripped(&mut self, tripped: std::collections::BTreeSet<GroupId>) {
        self.inner.set_tripped(tripped);
    }

    fn breaker(
        &self,
        group: &GroupId,
        away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Option<Breaker> {
        if self.mutation == Mutation::IgnoreBreaker {
            return None;
        }
        self.inner.breaker(group, away)
    }
}

/// Finds the first seed (either mode, default seed count) whose trace catches `mutation`.
fn first_catch(mutation: Mutation) -> Option<(Mode, u64, String)> {
    let seeds = BatteryConfig::from_env().seeds;
    let battery = BatteryConfig {
        seeds,
        shrink: false,
        replay_check: false,
        regressions: None,
    };
    for mode in Mode::ALL {
        let make: Factory<Mutant> = Rc::new(move || Mutant::new(mutation, mode));
        let report = run_battery(&make, mode, &battery, true);
        if let Some(f) = report.failures.first() {
            return Some((
                mode,
                f.seed,
                f.message.lines().next().unwrap_or_default().to_owned(),
            ));
        }
    }
    None
}

#[test]
fn the_battery_catches_every_deliberately_broken_driver() {
    let mut missed = Vec::new();
    let only = std::env::var("SWACTOR_MUTATION").ok();
    for mutation in ALL {
        if only.as_ref().is_some_and(|m| *m != format!("{mutation:?}")) {
            continue;
        }
        let started = std::time::Instant::now();
        let caught = first_catch(mutation);
        eprintln!("{mutation:?}: {:?}", started.elapsed());
        match caught {
            Some((mode, seed, why)) => {
                println!("{mutation:?}: caught by {} seed {seed}: {why}", mode.name())
            }
            None => missed.push(mutation),
        }
    }
    assert!(missed.is_empty(), "the battery missed {missed:?}");
}

#[test]
fn the_mutation_wrapper_mutating_nothing_passes_the_battery() {
    // Guards the wrapper itself: without a mutation it must be the honest driver.
    let battery = BatteryConfig {
        seeds: (0..32).collect(),
        shrink: false,
        replay_check: true,
        regressions: None,
    };
    for mode in Mode::ALL {
        let make: Factory<Mutant> = Rc::new(move || Mutant::new(Mutation::Nothing, mode));
        let report = run_battery(&make, mode, &battery, true);
        assert!(report.failures.is_empty(), "{}", report.failures[0]);
    }
}

/// A world of the lease suite around mutants of `mutation`, whose daemon
/// renews as `renewals` says.
fn lease_world(
    mode: Mode,
    mutation: Mutation,
    renewals: Renewals,
) -> (Factory<Mutant>, WorldConfig) {
    let make: Factory<Mutant> = Rc::new(move || Mutant::new(mutation, mode));
    let config = WorldConfig {
        renewals,
        ..Suite::Leases.world(mode)
    };
    (make, config)
}

/// Runs the lease-suite seeds (both modes) against `mutation` with
/// `renewals` until one fails first with `until` (never, for `None`);
/// returns that seed, and how many seeds before it failed, by the
/// invariant each failure names first.
fn lease_catches(
    mutation: Mutation,
    renewals: Renewals,
    until: Option<Invariant>,
) -> (Option<(Mode, u64)>, BTreeMap<Invariant, u64>) {
    let seeds = BatteryConfig::for_suite(Suite::Leases).seeds;
    let mut caught = BTreeMap::new();
    for mode in Mode::ALL {
        let (make, config) = lease_world(mode, mutation, renewals);
        for &seed in &seeds {
            let trace = suite_trace_for_seed(Suite::Leases, mode, seed);
            let report = run_trace_with(&make, &config, &trace);
            let Some(v) = report.violations.first() else {
                continue;
            };
            if Some(v.invariant) == until {
                println!(
                    "{mutation:?} {renewals:?}: caught by {} seed {seed}: {v}",
                    mode.name()
                );
                return (Some((mode, seed)), caught);
            }
            *caught.entry(v.invariant).or_default() += 1;
        }
    }
    (None, caught)
}

#[test]
fn the_lease_invariants_catch_a_daemon_that_renews_late_and_a_host_that_creates_anew() {
    // Each breakage must be the first thing the oracle reports on some
    // seed of the lease suite: other guarantees may notice it too.
    let lease_ms = u64::from(SHORT_LEASE_S) * 1_000;
    let honest = Renewals::AsTold;
    let unrenewed = Invariant::LeaseEndOnlyWhenUnrenewed;
    let nothing_new = Invariant::BackWithinWindowCreatesNothing;
    let cases = [
        // A daemon that welcomes agents and never renews their leases.
        (
            Mutation::Nothing,
            Renewals::Every { ms: u64::MAX },
            unrenewed,
        ),
        // One that renews, but only every lease and a half.
        (
            Mutation::Nothing,
            Renewals::Every {
                ms: lease_ms * 3 / 2,
            },
            unrenewed,
        ),
        (Mutation::AdoptIgnoringListedLeases, honest, nothing_new),
        (Mutation::AdoptNothing, honest, nothing_new),
    ];
    let mut missed = Vec::new();
    for (mutation, renewals, expected) in cases {
        let (first, before) = lease_catches(mutation, renewals, Some(expected));
        if first.is_none() {
            missed.push(format!(
                "{mutation:?} {renewals:?}: {expected} never first (first violations: {before:?})"
            ));
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}

#[test]
fn the_honest_driver_and_daemon_pass_the_lease_suite_behind_the_wrapper() {
    let (_, caught) = lease_catches(Mutation::Nothing, Renewals::AsTold, None);
    assert!(caught.is_empty(), "{caught:?}");
}

/// The first violation of each seed of the leadership suite, in a world
/// whose election tells the host its bound (`tell`) or not.
fn leadership_catches(tell: bool) -> (Option<(Mode, u64)>, BTreeMap<Invariant, u64>) {
    let seeds = BatteryConfig::for_suite(Suite::Leadership).seeds;
    let mut caught = BTreeMap::new();
    for mode in Mode::ALL {
        let config = WorldConfig {
            tell_leadership: tell,
            ..Suite::Leadership.world(mode)
        };
        let c = config.reconciler.clone();
        let make: Factory<Driver> =
            Rc::new(move || Driver::new(RunId::new(RUN), c.clone()).expect("valid config"));
        for &seed in &seeds {
            let trace = suite_trace_for_seed(Suite::Leadership, mode, seed);
            let report = run_trace_with(&make, &config, &trace);
            let Some(v) = report.violations.first() else {
                continue;
            };
            if v.invariant == Invariant::NothingActsPastLeadership {
                println!("caught by {} seed {seed}: {v}", mode.name());
                return (Some((mode, seed)), caught);
            }
            *caught.entry(v.invariant).or_default() += 1;
        }
    }
    (None, caught)
}

#[test]
fn a_host_never_told_its_leadership_bound_is_caught_acting_past_it() {
    let (first, before) = leadership_catches(false);
    assert!(
        first.is_some(),
        "nothing_acts_past_leadership never first (first violations: {before:?})"
    );
    let (first, caught) = leadership_catches(true);
    assert!(first.is_none() && caught.is_empty(), "{caught:?}");
}
