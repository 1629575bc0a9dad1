//! Flight recordings as regression cases: every committed one replays and passes the oracle, a changed decider is caught at the input where it first answers otherwise, and every host life of seeded world runs replays as recorded.
//!
//! The committed recordings are in `recordings/` beside this crate; the
//! README says how they were made and how to make more.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use swactor_conformance::battery::{Suite, suite_trace_for_seed};
use swactor_conformance::recording::{check_recording, check_recording_with};
use swactor_conformance::{Invariant, Mode, WorldConfig, run_trace};
use swactor_provisioning::flight::{self, FlightHeader, Recording, Replayer};
use swactor_provisioning::{
    AdoptEntry, Adoption, BootstrapObservation, Breaker, ClusterShape, ClusterState, DesiredState,
    DesiredUpdate, Driver, DriverError, DriverStats, EffectRequest, FailureCause, Folded, GroupId,
    LogicalNodeId, NodeAttemptId, OperationId, OperationResult, Pass, Plan, Reconciler,
    ReconcilerConfig, RolloutStatus, Timestamp, UpdateError,
};

/// Where the committed recordings live.
fn recordings_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("recordings")
}

/// A fresh driver as a recording's header configures it.
fn honest(header: &FlightHeader) -> Result<Driver, String> {
    Driver::new(header.run_id.clone(), header.reconciler.clone()).map_err(|e| e.to_string())
}

/// Checks one recording both ways: the kit's case (every answer, and the
/// oracle) and the flight module's own replay (every answer), which must
/// agree on how far the recording goes.
fn check(name: &str, bytes: &[u8]) -> Result<String, String> {
    let case = check_recording(bytes).map_err(|e| format!("{name}: {e}"))?;
    case.verdict().map_err(|e| format!("{name}: {e}"))?;
    let replayed = flight::replay(bytes, honest, |_, _| {})
        .map_err(|e| format!("{name}: the flight module's replay: {e}"))?;
    if replayed.inputs != case.inputs || replayed.cut != case.cut {
        return Err(format!(
            "{name}: the flight module replayed {} inputs (cut: {}), the case {} (cut: {})",
            replayed.inputs, replayed.cut, case.inputs, case.cut
        ));
    }
    if case.inputs == 0 || case.steps == 0 {
        return Err(format!(
            "{name}: {} inputs and {} oracle steps: a recording that judges nothing",
            case.inputs, case.steps
        ));
    }
    Ok(format!("{name}: {case}"))
}

/// Every `*.flight` file in the recordings directory, by name.
fn committed() -> Vec<(String, Vec<u8>)> {
    let dir = recordings_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "the recordings directory {} cannot be read: {e}",
            dir.display()
        )
    });
    let mut files: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "flight"))
        .map(|p| {
            let name = p
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            let bytes =
                std::fs::read(&p).unwrap_or_else(|e| panic!("{} cannot be read: {e}", p.display()));
            (name, bytes)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_committed_recording_replays_as_recorded_and_passes_the_oracle() {
    let files = committed();
    assert!(
        !files.is_empty(),
        "no *.flight recording in {}: the regression cases are gone (the README says how to make them)",
        recordings_dir().display()
    );
    let mut failures = Vec::new();
    for (name, bytes) in &files {
        match check(name, bytes) {
            Ok(summary) => eprintln!("{summary}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} committed recordings failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}

/// The recording the changed decider is replayed over: a life with a
/// scale-down of a ready node in its middle.
const SCALE_DOWN_RECORDING: &str = "adversarial-4-life1.flight";

/// A real driver with one decision changed: when a scale-down destroys
/// the lease of a slot the shape no longer wants, it destroys instead the
/// lease of the lowest slot of the same group that is still wanted (as
/// `mutants.rs` does to the battery). Everything else is the driver's.
struct LowestFirst(Driver);

impl LowestFirst {
    fn new(header: &FlightHeader) -> Result<Self, String> {
        honest(header).map(Self)
    }
}

impl Reconciler for LowestFirst {
    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError> {
        let Some(mut pass) = self.0.poll_pass(now)? else {
            return Ok(None);
        };
        let (state, desired) = (self.0.state(), self.0.desired());
        for d in &mut pass.dispatches {
            let EffectRequest::DestroyLease { lease, .. } = &mut d.request else {
                continue;
            };
            let scaled_away = desired
                .group(&d.key.node.group)
                .is_some_and(|g| d.key.node.index >= g.count);
            if !scaled_away {
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
        Ok(Some(pass))
    }

    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError> {
        self.0.update_desired(shape)
    }
    fn handle_result(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.0.handle_result_ref(result, now)
    }
    fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        self.0.handle_submit_failed(node, op, reason, now)
    }
    fn handle_bootstrap(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Reconciler::handle_bootstrap(&mut self.0, obs, now)
    }
    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        cause: FailureCause,
        reason: &str,
        now: Timestamp,
    ) -> Folded {
        self.0.handle_agent_lost(node, attempt, cause, reason, now)
    }
    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        self.0.handle_timeout(now)
    }
    fn handle_tick(&mut self, now: Timestamp) {
        self.0.handle_tick(now);
    }
    fn handle_unheard(&mut self, from: Timestamp, to: Timestamp) {
        self.0.handle_unheard(from, to);
    }
    fn poll_timeout(&self) -> Option<Timestamp> {
        self.0.poll_timeout()
    }
    fn finish_pass(&mut self) -> Result<(), DriverError> {
        self.0.finish_pass()
    }
    fn adopt(&mut self, entries: Vec<AdoptEntry>, op_seq_base: u64) -> Adoption {
        self.0.adopt(entries, op_seq_base)
    }
    fn raise_attempt_floor(&mut self, floor: u64) {
        self.0.raise_attempt_floor(floor);
    }
    fn carry_failures(&mut self, node: LogicalNodeId, failures: u32) {
        self.0.carry_failures(node, failures);
    }
    fn plan(&self, now: Timestamp) -> Plan {
        self.0.plan(now)
    }
    fn plan_shape(&self, shape: &ClusterShape, now: Timestamp) -> Result<Plan, UpdateError> {
        self.0.plan_shape(shape, now)
    }
    fn state(&self) -> &ClusterState {
        self.0.state()
    }
    fn desired(&self) -> &DesiredState {
        self.0.desired()
    }
    fn config(&self) -> &ReconcilerConfig {
        self.0.config()
    }
    fn is_converged(&self) -> bool {
        self.0.is_converged()
    }
    fn unconverged_from(&self, hint: Option<&LogicalNodeId>) -> Result<(), Option<LogicalNodeId>> {
        self.0.unconverged_from(hint)
    }
    fn stats(&self) -> DriverStats {
        self.0.stats()
    }
    fn is_pass_queued(&self) -> bool {
        self.0.is_pass_queued()
    }
    fn set_paused(&mut self, paused: bool) {
        self.0.set_paused(paused);
    }
    fn is_paused(&self) -> bool {
        self.0.is_paused()
    }
    fn rollout_holds(&self) -> Vec<RolloutStatus> {
        self.0.rollout_holds()
    }
    fn set_tripped(&mut self, tripped: BTreeSet<GroupId>) {
        self.0.set_tripped(tripped);
    }
    fn breaker(
        &self,
        group: &GroupId,
        away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Option<Breaker> {
        self.0.breaker(group, away)
    }
}

/// The index of the first input at which a [`LowestFirst`] host answers
/// otherwise than an honest one, found without the kit's case: an honest
/// and a changed [`Replayer`] stepped side by side over the recording. The
/// honest one must answer every input as recorded, so the recorded digest
/// is its answer's digest, and the changed one's first refusal is the
/// first input where their answers' digests differ.
fn first_difference(bytes: &[u8]) -> Option<u64> {
    let recording = Recording::read(bytes).expect("a committed recording reads");
    let header = &recording.header;
    let mut straight = Replayer::new(header, honest(header).expect("a valid config"))
        .expect("the honest host builds");
    let mut changed = Replayer::new(header, LowestFirst::new(header).expect("a valid config"))
        .expect("the changed host builds");
    for frame in recording.frames() {
        let frame = frame.expect("a committed frame reads");
        straight
            .step(&frame.input, frame.answer)
            .unwrap_or_else(|d| panic!("the honest driver answered otherwise: {d}"));
        if changed.step(&frame.input, frame.answer).is_err() {
            return Some(frame.index);
        }
    }
    None
}

#[test]
fn a_decider_that_scales_down_from_the_lowest_index_is_reported_where_it_first_answers_otherwise() {
    let path = recordings_dir().join(SCALE_DOWN_RECORDING);
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("{} cannot be read: {e}", path.display()));
    let frames = Recording::read(&bytes).expect("it reads").frames().count() as u64;

    // The honest driver behind nothing passes.
    let straight = check_recording(&bytes).expect("it can be checked");
    assert_eq!(straight.verdict(), Ok(()), "{straight}");
    assert_eq!(straight.inputs, frames);

    let case = check_recording_with(&bytes, LowestFirst::new).expect("it can be checked");
    let divergence = case
        .divergence
        .clone()
        .unwrap_or_else(|| panic!("the changed decider was not told apart: {case}"));
    let expected = first_difference(&bytes)
        .expect("the changed decider answers some input otherwise than the honest one");
    assert_eq!(
        divergence.index, expected,
        "the case reports {divergence}, the replayers first differ at input {expected}"
    );
    assert_eq!(
        case.inputs, expected,
        "every input before it answered as recorded"
    );
    assert!(
        expected > frames / 10 && expected < frames - 1,
        "the change fires mid-recording: input {expected} of {frames}"
    );
    // The input is the poll that hands out the changed pass, and the
    // oracle, judging the replayed answer, names the guarantee it breaks.
    assert!(
        divergence.input.starts_with("poll-output") && divergence.replayed.contains("DestroyLease"),
        "{divergence}"
    );
    assert!(
        case.violations
            .iter()
            .any(|v| v.invariant == Invariant::CleanupTargetsOwnResources),
        "{case}"
    );
    eprintln!("{divergence}");
}

/// Seeds per suite and mode of the seeded-replay test
/// (`SWACTOR_RECORDING_SEEDS`, default 3).
fn seeded_count() -> u64 {
    std::env::var("SWACTOR_RECORDING_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

#[test]
fn every_life_of_seeded_world_runs_replays_as_recorded() {
    let seeds = seeded_count();
    let mut lives = 0;
    let mut failures = Vec::new();
    for suite in [Suite::Base, Suite::Leases, Suite::Leadership] {
        for mode in Mode::ALL {
            let config = WorldConfig {
                record: true,
                ..suite.world(mode)
            };
            for seed in 0..seeds {
                let trace = suite_trace_for_seed(suite, mode, seed);
                let report = run_trace(&config, &trace);
                let label = suite.label(mode);
                if let Some(v) = report.violations.first() {
                    failures.push(format!("{label} {seed}: the world's own run failed: {v}"));
                    continue;
                }
                assert!(
                    !report.recordings.is_empty(),
                    "{label} {seed}: a recording world left no recording"
                );
                for (life, bytes) in report.recordings.iter().enumerate() {
                    lives += 1;
                    if let Err(e) = check(&format!("{label} {seed} life {life}"), bytes) {
                        failures.push(e);
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {lives} host lives failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        lives >= 6 * seeds,
        "{lives} lives of {seeds} seeds per suite and mode"
    );
    eprintln!("{lives} host lives of {seeds} seeds per suite and mode replayed as recorded");
}
