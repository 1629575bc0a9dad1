//! The battery: many seeded traces per mode, each shrunk to a minimal trace on failure.
//!
//! Seed `s` of mode `m` seeds proptest's ChaCha generator with `s`, so a seed
//! names one trace on every machine. A failing seed is shrunk by proptest to a
//! minimal trace, recorded in `proptest-regressions/battery.txt` (replayed
//! first by every later battery run), and can be replayed alone:
//!
//! ```text
//! SWACTOR_SEED=1234 cargo test -p swactor-conformance --test battery
//! ```
//!
//! Environment variables: `SWACTOR_CONFORMANCE_SEEDS` (seeds per mode, default
//! 256), `SWACTOR_LEASE_SEEDS` (seeds per mode of the lease and leadership suites, default a
//! quarter of the former), `SWACTOR_FIRST_SEED` (first seed, default 0),
//! `SWACTOR_SEED` (run only this seed), `SWACTOR_MODE` (`in-order` or
//! `adversarial`: only this mode), `SWACTOR_REGRESSIONS_FILE` (record and
//! replay failing seeds elsewhere), `SWACTOR_SHRINK=0` (report a failing seed
//! without shrinking it, e.g. under `cargo mutants`, where only detection
//! matters).
//!
//! Two suites share the machinery: the battery's own ([`Suite::Base`]), and
//! one whose groups hold short leases ([`Suite::Leases`]).

use crate::oracle::{Invariant, Violation};
use crate::trace::{Mode, Trace, lease_trace, trace};
use crate::world::{Factory, Reconciler, RunReport, WorldConfig, run_trace_with};
use proptest::strategy::{BoxedStrategy, Strategy};
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use std::path::PathBuf;

/// Seeds per mode when `SWACTOR_CONFORMANCE_SEEDS` is unset.
pub const DEFAULT_SEEDS: u64 = 256;

/// Which world a battery runs its traces in, and which alphabet it draws
/// them from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    /// The battery's world ([`WorldConfig::for_mode`], where agents hold
    /// their nodes for the default hour) and alphabet ([`trace`]).
    Base,
    /// Groups whose agents end their nodes a short lease after their daemon
    /// stops renewing it ([`WorldConfig::with_short_leases`]), and host
    /// crashes on both sides of that lease ([`lease_trace`]).
    Leases,
    /// A host that leads on a short election lease, renewed while it runs
    /// ([`WorldConfig::with_leadership`]), with the battery's alphabet: its
    /// host pauses freeze the leader for less and for more than the lease.
    Leadership,
}

impl Suite {
    /// The world configuration for `mode`.
    pub fn world(self, mode: Mode) -> WorldConfig {
        match self {
            Self::Base => WorldConfig::for_mode(mode),
            Self::Leases => WorldConfig::with_short_leases(mode),
            Self::Leadership => WorldConfig::with_leadership(mode),
        }
    }

    /// The traces for `mode`.
    pub fn traces(self, mode: Mode) -> BoxedStrategy<Trace> {
        match self {
            Self::Base | Self::Leadership => trace(mode).boxed(),
            Self::Leases => {
                let lease_ms = u64::from(self.world(mode).lease_s()) * 1_000;
                lease_trace(mode, lease_ms).boxed()
            }
        }
    }

    /// What a regression file records a seed of `mode` of this suite
    /// under: the mode's name, prefixed `leases-` for the lease suite.
    pub fn label(self, mode: Mode) -> String {
        match self {
            Self::Base => mode.name().to_owned(),
            Self::Leases => format!("leases-{}", mode.name()),
            Self::Leadership => format!("leader-{}", mode.name()),
        }
    }

    /// The `cargo test` filter that runs this suite's battery.
    fn filter(self) -> &'static str {
        match self {
            Self::Base => "every_invariant_holds_under",
            Self::Leases => "short_leases",
            Self::Leadership => "leadership_lease",
        }
    }
}

/// Which seeds to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatteryConfig {
    /// The seeds, in order.
    pub seeds: Vec<u64>,
    /// Whether to shrink a failing trace (off for mutant hunting, where only detection matters).
    pub shrink: bool,
    /// Whether to run each trace twice and compare the end states.
    pub replay_check: bool,
    /// Where failing seeds are recorded and replayed from, if anywhere.
    pub regressions: Option<PathBuf>,
}

impl BatteryConfig {
    /// The configuration the environment asks for, for `suite`: the lease
    /// suite runs `SWACTOR_LEASE_SEEDS` seeds per mode, by default a
    /// quarter of the base battery's count (at least one).
    pub fn for_suite(suite: Suite) -> Self {
        let mut config = Self::from_env();
        if suite != Suite::Base && env_u64("SWACTOR_SEED").is_none() {
            let first = env_u64("SWACTOR_FIRST_SEED").unwrap_or(0);
            let count = env_u64("SWACTOR_LEASE_SEEDS").unwrap_or_else(|| {
                (env_u64("SWACTOR_CONFORMANCE_SEEDS").unwrap_or(DEFAULT_SEEDS) / 4).max(1)
            });
            config.seeds = (first..first + count).collect();
        }
        config
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

impl BatteryConfig {
    /// The configuration the environment asks for (see the module docs).
    pub fn from_env() -> Self {
        let seeds = match env_u64("SWACTOR_SEED") {
            Some(seed) => vec![seed],
            None => {
                let first = env_u64("SWACTOR_FIRST_SEED").unwrap_or(0);
                let count = env_u64("SWACTOR_CONFORMANCE_SEEDS").unwrap_or(DEFAULT_SEEDS);
                (first..first + count).collect()
            }
        };
        Self {
            seeds,
            shrink: env_u64("SWACTOR_SHRINK") != Some(0),
            replay_check: true,
            regressions: Some(default_regressions_file()),
        }
    }

    /// True when the environment restricts the battery to `mode` or to all modes.
    pub fn wants(mode: Mode) -> bool {
        std::env::var("SWACTOR_MODE")
            .ok()
            .and_then(|m| Mode::parse(&m))
            .is_none_or(|m| m == mode)
    }
}

/// The committed regression file, or the one `SWACTOR_REGRESSIONS_FILE` names.
pub fn default_regressions_file() -> PathBuf {
    std::env::var_os("SWACTOR_REGRESSIONS_FILE").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proptest-regressions/battery.txt"),
        PathBuf::from,
    )
}

/// Seeds recorded for `mode` in a regression file (`<mode> <seed> # note` lines).
pub fn recorded_seeds(path: &std::path::Path, mode: Mode) -> Vec<u64> {
    recorded_seeds_of(path, &Suite::Base.label(mode))
}

/// Seeds recorded under `label` (see [`Suite::label`]) in a regression file.
pub fn recorded_seeds_of(path: &std::path::Path, label: &str) -> Vec<u64> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let line = line.split('#').next()?.trim();
            let (m, seed) = line.split_once(' ')?;
            (m == label).then_some(())?;
            seed.trim().parse().ok()
        })
        .collect()
}

fn record_seed(path: &std::path::Path, label: &str, seed: u64, headline: &str) {
    if recorded_seeds_of(path, label).contains(&seed) {
        return;
    }
    let mut text = std::fs::read_to_string(path).unwrap_or_else(|_| {
        "# Seeds that once failed the conformance battery; every battery run replays them first.\n\
         # Format: <mode> <seed> # <first violation>\n"
            .to_owned()
    });
    let headline: String = headline.chars().take(200).collect();
    text.push_str(&format!("{label} {seed} # {headline}\n"));
    // Failing to record must not hide the failure itself, which is reported anyway.
    let _ = std::fs::write(path, text);
}

/// One seed that failed, with its minimal trace.
#[derive(Clone, Debug)]
pub struct SeedFailure {
    /// The suite.
    pub suite: Suite,
    /// The mode.
    pub mode: Mode,
    /// The seed.
    pub seed: u64,
    /// The minimal failing trace proptest found.
    pub minimal: Trace,
    /// What the minimal trace violates.
    pub message: String,
}

impl std::fmt::Display for SeedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} seed {} failed (replay: SWACTOR_MODE={} SWACTOR_SEED={} cargo test -p swactor-conformance --test battery {})",
            self.suite.label(self.mode),
            self.seed,
            self.mode.name(),
            self.seed,
            self.suite.filter(),
        )?;
        writeln!(f, "{}", self.message)?;
        writeln!(
            f,
            "minimal trace ({} inputs, executor seed {}):",
            self.minimal.inputs.len(),
            self.minimal.seed
        )?;
        for (i, input) in self.minimal.inputs.iter().enumerate() {
            writeln!(f, "  {i:3}: {input:?}")?;
        }
        Ok(())
    }
}

fn seed_rng(seed: u64) -> TestRng {
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        let v = seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(i as u64);
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
}

/// The trace seed `seed` of `mode` names (without running it).
pub fn trace_for_seed(mode: Mode, seed: u64) -> Trace {
    suite_trace_for_seed(Suite::Base, mode, seed)
}

/// The trace seed `seed` of `mode` names in `suite` (without running it).
pub fn suite_trace_for_seed(suite: Suite, mode: Mode, seed: u64) -> Trace {
    use proptest::strategy::ValueTree;
    let mut runner = TestRunner::new_with_rng(Config::default(), seed_rng(seed));
    suite
        .traces(mode)
        .new_tree(&mut runner)
        .expect("trace strategies never reject")
        .current()
}

fn verdict(report: &RunReport) -> Option<String> {
    let v: &Violation = report.violations.first()?;
    let more = report.violations.len() - 1;
    Some(if more > 0 {
        format!("{v} (and {more} more)")
    } else {
        v.to_string()
    })
}

/// Runs one trace against a fresh system under test, twice when `replay_check`
/// is set, and returns the first violation as a message.
pub fn judge<R: Reconciler>(
    make: &Factory<R>,
    config: &WorldConfig,
    trace: &Trace,
    replay_check: bool,
) -> Result<RunReport, String> {
    let report = run_trace_with(make, config, trace);
    if let Some(message) = verdict(&report) {
        return Err(message);
    }
    if replay_check {
        let again = run_trace_with(make, config, trace);
        if again.digest != report.digest {
            return Err(format!(
                "invariant `{}` violated: the same trace ended in two different states",
                Invariant::DeterministicReplay
            ));
        }
    }
    Ok(report)
}

/// Runs one seed of `mode` against systems made by `make`; on failure, shrinks
/// (when configured) and returns the minimal trace.
pub fn check_seed<R: Reconciler>(
    make: &Factory<R>,
    mode: Mode,
    seed: u64,
    battery: &BatteryConfig,
) -> Result<(), SeedFailure> {
    check_suite_seed(make, Suite::Base, mode, seed, battery)
}

/// As [`check_seed`], for a seed of `suite`.
pub fn check_suite_seed<R: Reconciler>(
    make: &Factory<R>,
    suite: Suite,
    mode: Mode,
    seed: u64,
    battery: &BatteryConfig,
) -> Result<(), SeedFailure> {
    let config = suite.world(mode);
    let runner_config = Config {
        cases: 1,
        failure_persistence: None,
        max_shrink_iters: if battery.shrink { 4_096 } else { 0 },
        max_shrink_time: if battery.shrink { 60_000 } else { 0 },
        rng_algorithm: RngAlgorithm::ChaCha,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(runner_config, seed_rng(seed));
    let result = runner.run(&suite.traces(mode), |t| {
        judge(make, &config, &t, battery.replay_check)
            .map(|_| ())
            .map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, minimal)) => Err(SeedFailure {
            suite,
            mode,
            seed,
            minimal,
            message: reason.to_string(),
        }),
        Err(TestError::Abort(reason)) => Err(SeedFailure {
            suite,
            mode,
            seed,
            minimal: suite_trace_for_seed(suite, mode, seed),
            message: format!("proptest aborted: {reason}"),
        }),
    }
}

/// What a battery run found.
#[derive(Clone, Debug, Default)]
pub struct BatteryReport {
    /// Seeds run (recorded regressions included).
    pub seeds_run: u64,
    /// Failures, in seed order.
    pub failures: Vec<SeedFailure>,
}

/// Runs the recorded regressions of `mode`, then every configured seed; stops
/// at the first failure when `stop_at_first` is set.
pub fn run_battery<R: Reconciler>(
    make: &Factory<R>,
    mode: Mode,
    battery: &BatteryConfig,
    stop_at_first: bool,
) -> BatteryReport {
    run_suite(make, Suite::Base, mode, battery, stop_at_first)
}

/// As [`run_battery`], for `suite`.
pub fn run_suite<R: Reconciler>(
    make: &Factory<R>,
    suite: Suite,
    mode: Mode,
    battery: &BatteryConfig,
    stop_at_first: bool,
) -> BatteryReport {
    let mut report = BatteryReport::default();
    let label = suite.label(mode);
    let recorded = battery
        .regressions
        .as_deref()
        .map(|p| recorded_seeds_of(p, &label))
        .unwrap_or_default();
    let total = battery.seeds.len() as u64;
    for seed in recorded.into_iter().chain(battery.seeds.iter().copied()) {
        report.seeds_run += 1;
        // Long runs say how far they got; the default battery stays quiet.
        if total >= 10_000 && report.seeds_run % 10_000 == 0 {
            eprintln!(
                "{label}: {} seeds, {} failed",
                report.seeds_run,
                report.failures.len()
            );
        }
        if let Err(failure) = check_suite_seed(make, suite, mode, seed, battery) {
            if let Some(path) = &battery.regressions {
                let headline = failure.message.lines().next().unwrap_or_default();
                record_seed(path, &label, seed, headline);
            }
            report.failures.push(failure);
            if stop_at_first {
                break;
            }
        }
    }
    report
}
