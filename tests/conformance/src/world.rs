//! The simulated world: a cluster host around a driver core, a fake executor
//! and provider, a simulated journal, virtual time, and the oracle.
//!
//! [`World`] drives a [`Host`] exactly as a daemon does (the calling order in
//! the module docs of `swactor_provisioning::Host`): feed inputs, drain
//! outputs (commit each journal write before going on, submit every
//! dispatch, collect orphans), re-arm one timer. The host can be killed at
//! any step, including between a journal write and its commit, and a new one
//! started from the journal and the provider's inventory, as a restarted
//! daemon would; it can be shut down keeping its nodes or tearing them down.
//! Time is virtual: the world jumps straight to the earliest wake-up of any
//! party. Every step goes through the [`Oracle`].
//!
//! With [`WorldConfig::record`] every host the world starts is wrapped in
//! the daemon's flight recorder (`swactor_provisioning::flight`), one
//! recording per host life ([`World::recordings`]), which
//! [`crate::recording`] checks as regression cases.
//!
//! The host's core sits behind the [`Reconciler`] trait, which [`Driver`]
//! implements; a test can wrap a driver to break it on purpose and check
//! that the oracle notices.
//!
//! Over 1,000 lines in one file because it is one calling order (the
//! daemon's) written once; split, the order would be spread over files.

use crate::backend::{BackendConfig, FakeBackend, ProviderFault};
use crate::executor::{ExecutorConfig, FakeExecutor, Output, Submitted};
use crate::lease::{AgentLeases, Lapse, Renewals, Wrong};
use crate::oracle::{Invariant, Oracle, Snapshot, StepEvent, independently_converged};
use crate::trace::{Input, InvalidUpdate, LATE_EXTRA_MAX_MS, Mode, ProviderFaultInput, Trace};
use std::collections::BTreeMap;
use std::rc::Rc;
pub use swactor_provisioning::Reconciler;
use swactor_provisioning::{
    AWAY_PAST_GRACE, BOOT_CHECK_REPORT_MARGIN_MS, BootParams, BootstrapEvent, ClusterShape,
    CollectRequest, Driver, Folded, Generation, GroupPolicy, GroupShape, Host, HostConfig,
    HostError, HostFold, Intent, JournalImage, Leadership, Link, Liveness, LogicalNodeId,
    NodeAttemptId, NodeLimits, OperationTimeouts, Output as HostOutput, PAUSED_PAST_WAIT,
    PolicyShape, PreemptChoice, ProviderShape, Quantity, ReconcilerConfig, Reply, ResourceKey,
    RunId, ShutdownMode, SwarmJoin, Ticket, Timestamp, flight, flight::Flight, same_template,
};

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
    /// The `orphan_after_s` of the world's groups (`None`: the shapes leave
    /// it out, and agents hold their nodes for the default hour, longer
    /// than any generated trace runs). See [`crate::lease`].
    pub orphan_after_s: Option<u32>,
    /// How the world's daemon renews leases: as the host says, except in
    /// tests that break it on purpose.
    pub renewals: Renewals,
    /// With `Some(ms)`, the host is one of several replicas and leads on an
    /// election lease of `ms` (see `LeaderLease`); `None`: it is alone on
    /// its journal and always may act.
    pub leadership_ms: Option<u64>,
    /// Whether the election tells the host its bound (always, except in
    /// the test that breaks it on purpose: a host never told acts on).
    pub tell_leadership: bool,
    /// Whether every host the world starts records its inputs as the
    /// daemon's flight recorder does (one recording per host life, read
    /// with [`World::recordings`]); off by default. Recording changes
    /// nothing the world does.
    pub record: bool,
}

/// The world's election, as the daemon's `Election` on etcd would answer:
/// it grants the host's leadership on a lease of `lease_ms`, renewed every
/// third of it while the host runs; the host may act until a lease less a
/// margin ([`LEADERSHIP_MARGIN_MS`]) after the last renewal. A host frozen
/// (a host pause) past the whole lease wakes deposed: another replica
/// leads, which the world models as a new host started from the journal,
/// as a takeover is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LeaderLease {
    lease_ms: u64,
    /// When the last renewal was sent (and answered).
    renewed: Timestamp,
}

/// How much sooner than its election lease could end a leader stops acting.
pub const LEADERSHIP_MARGIN_MS: u64 = 500;

/// The election lease of the leadership suite's worlds.
pub const LEADERSHIP_LEASE_MS: u64 = 3_000;

impl LeaderLease {
    fn until(self) -> Timestamp {
        Timestamp(self.renewed.0 + self.lease_ms - LEADERSHIP_MARGIN_MS)
    }

    fn renew_at(self) -> Timestamp {
        Timestamp(self.renewed.0 + self.lease_ms / 3)
    }

    fn expired_at(self, now: Timestamp) -> bool {
        now.0 >= self.renewed.0 + self.lease_ms
    }
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
                // The silence a live agent's connection is dropped after
                // (its group's grace is GRACE_MS): a shorter host pause
                // drops nobody, a longer one is a deaf gap.
                listen_gap_ms: 2_000,
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
            orphan_after_s: None,
            renewals: Renewals::AsTold,
            leadership_ms: None,
            tell_leadership: true,
            record: false,
        }
    }

    /// The configuration the leadership suite uses for `mode`: the
    /// battery's, with a host that leads on an election lease of
    /// [`LEADERSHIP_LEASE_MS`], so that host pauses fall on both sides of it.
    pub fn with_leadership(mode: Mode) -> Self {
        Self {
            leadership_ms: Some(LEADERSHIP_LEASE_MS),
            ..Self::for_mode(mode)
        }
    }

    /// The configuration the lease battery uses for `mode`: the battery's,
    /// with groups whose agents end their nodes [`SHORT_LEASE_S`] after
    /// their daemon stops renewing them.
    pub fn with_short_leases(mode: Mode) -> Self {
        Self {
            orphan_after_s: Some(SHORT_LEASE_S),
            ..Self::for_mode(mode)
        }
    }

    /// The lease the world's groups give their agents, in seconds.
    pub fn lease_s(&self) -> u32 {
        self.orphan_after_s
            .unwrap_or(GroupPolicy::ORPHAN_AFTER_DEFAULT_S)
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
                .max(BOOT_TIMEOUT_MS + BOOT_CHECK_REPORT_MARGIN_MS)
            + 6 * round_trip
            + c.backend.endpoint_delay_ms
            + r.probe_interval_ms
            + script
            + GRACE_MS
            + SWEEP_MS
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

/// The grace of a disconnected agent in the world's shapes.
pub const GRACE_MS: u64 = 5_000;

/// The lease of the lease battery's groups: four graces, long enough for
/// a restarted host to adopt and relink its agents (a listing, a second
/// one a visibility window later, a lookup and a start), short enough for
/// a trace to outlast it.
pub const SHORT_LEASE_S: u32 = 20;

/// The world's host settings: one executor lane, joins proven only by the
/// swarm (the world turns a stream's join into a live join, as a real agent
/// joins its daemon).
pub fn host_config() -> HostConfig {
    HostConfig {
        lanes: 1,
        stream_joins: false,
        node_events: false,
        visibility_window_ms: SWEEP_MS,
        sweep_interval_ms: SWEEP_MS,
        rejoin_window_ms: GRACE_MS,
        history_len: 2,
        capacities: Vec::new(),
        adopt_unrecorded: false,
        deployment: None,
    }
}

/// The boot-check timeout of the world's shapes: the stall deadline while a
/// boot check runs is this plus the report margin when that is longer than
/// the plain stall deadline.
pub const BOOT_TIMEOUT_MS: u64 = 4_000;

/// The world's sweep interval and visibility window: longer than the
/// longest invisibility a trace can arm.
pub const SWEEP_MS: u64 = 6_000;

/// Makes fresh cores for the hosts a world starts.
pub type Factory<R> = Rc<dyn Fn() -> R>;

/// The simulated world. See the module docs.
pub struct World<R: Reconciler = Driver> {
    make: Factory<R>,
    /// The host, recording its inputs when [`WorldConfig::record`] is set.
    host: Flight<R>,
    /// The seed the world was made with (named in its recordings).
    seed: u64,
    /// One recording per host life, the last one still growing (empty
    /// unless [`WorldConfig::record`] is set).
    lives: Vec<Vec<u8>>,
    exec: FakeExecutor,
    oracle: Oracle,
    config: WorldConfig,
    now: Timestamp,
    groups: [(u8, u8); 2],
    generation: u64,
    abort: Option<(u8, bool)>,
    timer_lost: bool,
    crash_at_persist: Option<u16>,
    submitted: Vec<swactor_provisioning::Dispatch>,
    snapshot: Snapshot,
    passes: u64,
    durable: JournalImage,
    next_ticket: u64,
    restarts: u64,
    next_shape: Option<[(u8, u8); 2]>,
    teardowns: Vec<usize>,
    policies: [PolicyShape; 2],
    /// Agents the world cut off (they are really silent), with when.
    cut: BTreeMap<LogicalNodeId, (NodeAttemptId, Timestamp)>,
    /// Machines the provider paused, by slot: the attempt, and until when
    /// the host must keep its node (when the machine was paused, plus the
    /// group's wait as the world set it then; `None` in a group that
    /// replaced paused machines then).
    paused: BTreeMap<LogicalNodeId, (NodeAttemptId, Option<Timestamp>)>,
    /// Stretches in which no host listened: host pauses, crash downtime.
    unheard: Vec<(Timestamp, Timestamp)>,
    /// Live agents whose connection a host pause dropped, and when each
    /// is back (it dials again, as a real agent does).
    rejoins: Vec<(Timestamp, ResourceKey)>,
    /// Every joined agent's lease.
    leases: AgentLeases,
    /// Journal writes committed since [`World::take_committed`] last took
    /// them (read by tests that replay them into real journal stores).
    committed: Vec<swactor_provisioning::JournalDelta>,
    /// The host's leadership, when the world runs an election
    /// ([`WorldConfig::leadership_ms`]).
    lead: Option<LeaderLease>,
}

/// How soon an agent whose connection a host pause dropped joins again.
const PAUSE_REJOIN_MS: u64 = 500;

/// Whether a host hears its agents while virtual time passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hearing {
    /// A host runs and listens.
    Listening,
    /// The host is paused: it runs, but hears nothing and renews nothing.
    Paused,
    /// No host runs (a crash's downtime).
    Down,
}

/// What the oracle sees of `host` at `now`.
pub(crate) fn snapshot<R: Reconciler>(host: &Host<R>, now: Timestamp) -> Snapshot {
    let core = host.core();
    Snapshot {
        now,
        state: core.state().clone(),
        desired: core.desired().clone(),
        timer: core.poll_timeout(),
        converged_claim: host.is_converged(),
        stats: core.stats(),
        pass_queued: Some(core.is_pass_queued()),
        host_settled: host.settled(),
        agents_away: host.agents_away(),
        shutting_down: host.shutting_down().is_some() || host.is_stopped(),
        paused: host.is_paused(),
        away: core
            .state()
            .nodes
            .iter()
            .filter(|(id, n)| {
                matches!(host.link(id), Some(Link::Away { attempt, .. }) if attempt == n.attempt)
            })
            .map(|(id, _)| *id)
            .collect(),
        held_lost: host.held_lost().cloned().collect(),
        deaf: host.last_deaf_gap(),
    }
}

/// The shape with the given group counts and template variants, and the
/// default budgets.
pub fn shape_of(generation: u64, groups: &[(u8, u8); 2]) -> ClusterShape {
    shape_with(generation, groups, &[PolicyShape::default(); 2])
}

impl ProviderFaultInput {
    /// The backend fault this provider-fault input arms.
    pub fn fault(self) -> ProviderFault {
        match self {
            ProviderFaultInput::Refuse(kind) => ProviderFault::Refuse { kind },
            ProviderFaultInput::EndpointNeverReady => ProviderFault::EndpointNeverReady,
            ProviderFaultInput::EndpointSlow(ms) => ProviderFault::EndpointSlow {
                delay_ms: u64::from(ms),
            },
            ProviderFaultInput::BootstrapFailsAt(stage) => {
                ProviderFault::BootstrapFailsAt { stage }
            }
            ProviderFaultInput::LoseObservations(mask) => ProviderFault::LoseObservations { mask },
            ProviderFaultInput::CloseAfterConverge => ProviderFault::CloseAfterConverge,
            ProviderFaultInput::Invisible(ms) => ProviderFault::Invisible {
                lag_ms: u64::from(ms),
            },
        }
    }
}

/// The shape with the given group counts, template variants and budgets.
pub fn shape_with(
    generation: u64,
    groups: &[(u8, u8); 2],
    policies: &[PolicyShape; 2],
) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation(generation),
        groups: GROUPS
            .iter()
            .zip(groups)
            .zip(policies)
            .map(|((id, (count, variant)), policy)| GroupShape {
                id: (*id).to_owned(),
                run_id: None,
                count: u32::from(*count),
                provider: ProviderShape {
                    kind: crate::backend::PROVIDER_KIND.to_owned(),
                    params: BTreeMap::new(),
                    placement: Default::default(),
                },
                boot: BootParams {
                    image: Some(format!("image-v{variant}")),
                    ..BootParams::default()
                },
                role: "worker".to_owned(),
                join: SwarmJoin {
                    lost_grace_s: GRACE_MS as f64 / 1000.0,
                    ..SwarmJoin::default()
                },
                limits: NodeLimits {
                    boot_timeout_s: BOOT_TIMEOUT_MS as f64 / 1000.0,
                    ..NodeLimits::default()
                },
                policy: *policy,
            })
            .collect(),
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

/// The group counts and variants a shape made by [`shape_of`] describes
/// (an empty shape describes empty groups).
pub fn groups_of(shape: &ClusterShape) -> [(u8, u8); 2] {
    let mut groups = [(0, 0); 2];
    for g in &shape.groups {
        let Some(i) = GROUPS.iter().position(|id| *id == g.id) else {
            continue;
        };
        let variant = g
            .boot
            .image
            .as_deref()
            .and_then(|image| image.strip_prefix("image-v"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        groups[i] = (u8::try_from(g.count).unwrap_or(u8::MAX), variant);
    }
    groups
}

/// The budgets a shape made by [`shape_with`] gives its groups.
pub fn policies_of(shape: &ClusterShape) -> [PolicyShape; 2] {
    let mut policies = [PolicyShape::default(); 2];
    for g in &shape.groups {
        if let Some(i) = GROUPS.iter().position(|id| *id == g.id) {
            policies[i] = g.policy;
        }
    }
    policies
}

/// The budgets a [`Input::Budget`] names: `max_unavailable` 0 for the
/// default (1), 1 for 2 nodes, 2 for 50%, 3 for 100%, 4 for 0 with a
/// `max_surge` of 1, 5 for the default with a `max_surge` of 50%;
/// `max_unhealthy` `None` for no limit, 0 and 1 for those counts, 2 for 50%.
pub fn budget_policy(max_unavailable: u8, max_unhealthy: Option<u8>) -> PolicyShape {
    let code = max_unavailable % 6;
    PolicyShape {
        max_unavailable: match code {
            0 | 5 => None,
            1 => Some(Quantity::Count(2)),
            2 => Some(Quantity::Percent(50)),
            3 => Some(Quantity::Percent(100)),
            _ => Some(Quantity::Count(0)),
        },
        max_surge: match code {
            4 => Some(Quantity::Count(1)),
            5 => Some(Quantity::Percent(50)),
            _ => None,
        },
        max_unhealthy: max_unhealthy.map(|m| match m % 3 {
            0 => Quantity::Count(0),
            1 => Quantity::Count(1),
            _ => Quantity::Percent(50),
        }),
        on_preempt: None,
        preempt_wait_s: None,
        orphan_after_s: None,
        orphan_policy: None,
        jobs_per_node: None,
        gpus: None,
    }
}

impl World<Driver> {
    /// A world around a fresh [`Driver`] configured by `config`.
    pub fn new(config: WorldConfig, seed: u64) -> Self {
        let reconciler = config.reconciler.clone();
        let make = move || {
            Driver::new(RunId::new(RUN), reconciler.clone())
                .expect("the world's reconciler config is valid")
        };
        Self::with_reconciler(make, config, seed)
    }
}

impl<R: Reconciler> World<R> {
    /// A world whose hosts are built around cores that `make` returns; each
    /// must be a fresh driver for [`RUN`] configured with `config.reconciler`.
    /// Starts the first host on an empty journal and provider and applies the
    /// initial shape (generation 1) at time zero.
    pub fn with_reconciler(make: impl Fn() -> R + 'static, config: WorldConfig, seed: u64) -> Self {
        Self::with_factory(Rc::new(make), config, seed)
    }

    /// As [`World::with_reconciler`], with a shared factory.
    pub fn with_factory(make: Factory<R>, config: WorldConfig, seed: u64) -> Self {
        let backend = FakeBackend::new(config.backend.clone(), seed ^ 0xb0b0);
        let exec = FakeExecutor::new(backend, config.executor.clone(), seed);
        let (host, header) = build_host(&make, &config, seed, None, Timestamp(0))
            .expect("a fresh core makes a host");
        let snapshot = snapshot(&host, Timestamp(0));
        let policies = [PolicyShape {
            orphan_after_s: config.orphan_after_s,
            ..PolicyShape::default()
        }; 2];
        let leases = AgentLeases::new(config.renewals);
        let mut world = Self {
            make,
            host,
            seed,
            lives: header.into_iter().collect(),
            exec,
            oracle: Oracle::new(config.reconciler.clone()),
            groups: config.initial,
            config,
            now: Timestamp(0),
            generation: 0,
            abort: None,
            timer_lost: false,
            crash_at_persist: None,
            submitted: Vec::new(),
            snapshot,
            passes: 0,
            durable: JournalImage::new(RunId::new(RUN)),
            next_ticket: 0,
            restarts: 0,
            next_shape: None,
            teardowns: Vec::new(),
            policies,
            cut: BTreeMap::new(),
            paused: BTreeMap::new(),
            unheard: Vec::new(),
            rejoins: Vec::new(),
            leases,
            committed: Vec::new(),
            lead: None,
        };
        world.grant_leadership();
        world.oracle.begin_input("initial shape".to_owned());
        world.generation = 1;
        let shape = shape_with(1, &world.groups, &world.policies);
        world.offer(&shape);
        world.settle();
        world
    }

    /// The host's core: the system under test.
    pub fn sut(&self) -> &R {
        self.host.core()
    }

    /// The host around it.
    pub fn host(&self) -> &Host<R> {
        self.host.host()
    }

    /// Every host life's flight recording so far, in order (the last one
    /// is the running host's, up to now); empty unless
    /// [`WorldConfig::record`] is set. Each is a whole recording
    /// (`swactor_provisioning::flight`): its header, then its frames.
    pub fn recordings(&mut self) -> Vec<Vec<u8>> {
        self.flush_recording();
        self.lives.clone()
    }

    /// Appends the running host's frames to its life's recording.
    fn flush_recording(&mut self) {
        if let Some(life) = self.lives.last_mut() {
            let frames = self.host.take_frames(flight::FlightBatch::default());
            frames.write_to(life);
        }
    }

    /// The journal as committed so far.
    pub fn journal(&self) -> &JournalImage {
        &self.durable
    }

    /// The journal writes committed since the last call, in commit order
    /// (the first call also returns those of the initial shape): applied
    /// in order to [`JournalImage::new`]`(RUN)`, they make [`World::journal`].
    pub fn take_committed(&mut self) -> Vec<swactor_provisioning::JournalDelta> {
        std::mem::take(&mut self.committed)
    }

    /// Hosts started after the first (crashes and shutdowns).
    pub fn restarts(&self) -> u64 {
        self.restarts
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

    /// The agents' leases.
    pub fn leases(&self) -> &AgentLeases {
        &self.leases
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

    /// Passes run so far (over every host).
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
            "{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
            self.now,
            self.passes,
            self.restarts,
            self.host.core().state(),
            self.host.poll_timeout(),
            self.durable,
            self.exec.backend().counters(),
            self.exec.stats(),
            self.exec.backend().leases(),
        )
    }

    fn record(&mut self, event: StepEvent<'_>) {
        let after = snapshot(&self.host, self.now);
        self.oracle
            .observe(event, &self.snapshot, &after, &self.exec);
        self.snapshot = after;
        self.judge_comeback();
    }

    /// What a restarted host owes the nodes it found, after every step
    /// (see [`crate::lease`]).
    fn judge_comeback(&mut self) {
        let core = self.host.core();
        let wanted = |n: &LogicalNodeId| core.desired().slot(n).cloned();
        let backend = self.exec.backend();
        let made = |n: &LogicalNodeId, since: Timestamp| machines_made(backend, n, since);
        let mut wrong = self.leases.judge_made(&wanted, &made);
        if self.host.adopted() {
            let adopted_as = |n: &LogicalNodeId| {
                let node = core.state().nodes.get(n)?;
                Some((node.attempt, node.intent))
            };
            wrong.extend(self.leases.judge_adoption(&wanted, &adopted_as));
        }
        self.report_all(wrong);
    }

    fn report_all(&mut self, wrong: Vec<Wrong>) {
        for (invariant, node, detail) in wrong {
            self.oracle.report(invariant, Some(&node), detail);
        }
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    /// Offers a shape to the host (valid or not) and lets the oracle judge the answer.
    pub fn offer(&mut self, shape: &ClusterShape) {
        let ticket = self.ticket();
        let outcome = self.host.handle_apply(shape, ticket, self.now);
        self.record(StepEvent::Update {
            shape,
            outcome: &outcome,
        });
    }

    /// Tells the host what the provider holds for the run (as a new host's first input).
    fn list_inventory(&mut self) {
        let listed = self.exec.backend().list(&RunId::new(RUN), self.now);
        self.leases.listed(&listed);
        self.host.handle_inventory(Ok(listed), self.now);
        self.record(StepEvent::Inventory);
    }

    fn deliver(&mut self, output: Output) {
        match output {
            Output::Result(result) => {
                let folded = self.host.handle_result(result.clone(), self.now);
                self.record(StepEvent::Result {
                    result: &result,
                    folded: &folded,
                });
            }
            Output::Observation(obs) if obs.event == BootstrapEvent::SwactorJoined => {
                // The agent joins its host over the swarm; the stream's line
                // about it proves nothing on its own.
                let key = ResourceKey {
                    run_id: RunId::new(RUN),
                    node: obs.node,
                    attempt: obs.attempt,
                };
                self.join(&key);
            }
            Output::Observation(obs) => {
                let folded = self.host.handle_bootstrap(obs.clone(), self.now);
                self.record(StepEvent::Observation {
                    obs: &obs,
                    folded: &folded,
                });
            }
        }
    }

    /// The agent of `key` joins the host; a welcome renews its lease. An
    /// agent that ended its node when its lease lapsed is gone: it never
    /// dials again.
    fn join(&mut self, key: &ResourceKey) {
        if self.leases.ended(key) {
            return;
        }
        let outcome = self.host.handle_agent_joined(key, self.now);
        if let Ok(liveness) = &outcome {
            let window_s = self.config.lease_s();
            if let Some(detail) = self.leases.welcomed(key, liveness, window_s, self.now) {
                let inv = Invariant::LeaseEndOnlyWhenUnrenewed;
                self.oracle.report(inv, Some(&key.node), detail);
            }
        }
        self.record(StepEvent::AgentJoined {
            key,
            outcome: &outcome,
        });
    }

    /// Drains the host's outputs at `now`: commits journal writes (or crashes
    /// the host at one, when armed), submits passes, collects orphans,
    /// records the host's own folds, and restarts a host that stopped.
    fn drain(&mut self) -> usize {
        let mut passes = 0;
        while let Some(out) = self.host.poll_output(self.now) {
            if let Some(lead) = self.lead.filter(|l| out.acts() && self.now >= l.until()) {
                self.oracle.report(
                    Invariant::NothingActsPastLeadership,
                    None,
                    format!(
                        "{} handed out at {} though its leadership ended at {}",
                        output_name(&out),
                        self.now,
                        lead.until()
                    ),
                );
            }
            match out {
                HostOutput::Persist(delta) => {
                    if let Some(down_ms) = self.crash_at_persist.take() {
                        // Killed with the write handed out but not durable;
                        // the next host carries on from the journal.
                        self.crash(down_ms);
                        continue;
                    }
                    self.durable.apply(&delta);
                    self.host.handle_persisted(delta.seq);
                    self.committed.push(delta);
                }
                HostOutput::Pass(pass) => {
                    passes += 1;
                    self.passes += 1;
                    let durable = self.durable.clone();
                    self.record(StepEvent::Pass {
                        pass: &pass,
                        durable: &durable,
                    });
                    let core = self.host.core();
                    let wanted = |n: &LogicalNodeId| core.desired().slot(n).cloned();
                    let wrong = self.leases.judge_pass(&pass, &wanted);
                    self.report_all(wrong);
                    self.submit(&pass);
                    if passes > self.config.passes_per_instant_max {
                        break;
                    }
                }
                HostOutput::List => self.list_inventory(),
                HostOutput::Collect(request) => self.collect(&request),
                HostOutput::Probe { key, .. } => self.probed(&key),
                HostOutput::Folded(fold) => self.record_fold(&fold),
                HostOutput::Reply(_, reply) => match reply {
                    Reply::Applied(Ok(update)) => self.oracle.acknowledged(update.generation()),
                    Reply::Paused(Ok(_)) => self.oracle.pause_acknowledged(),
                    _ => {}
                },
                HostOutput::Stop => self.host_stopped(),
            }
        }
        let after = snapshot(&self.host, self.now);
        // A host that has not adopted the provider's inventory yet holds
        // its passes (it may wait a listing lag for a second listing): it
        // is not drained, only waiting.
        let holding = !self.host.adopted() && self.host.shutting_down().is_none();
        if passes > 0 && !holding {
            self.oracle
                .on_quiescent(&after, passes, self.config.passes_per_instant_max);
        }
        self.snapshot = after;
        passes
    }

    fn submit(&mut self, pass: &swactor_provisioning::Pass) {
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
                        let folded = self.host.handle_submit_failed(
                            &d.key.node,
                            d.op,
                            "host aborted the pass",
                            self.now,
                        );
                        self.record(StepEvent::SubmitFailed {
                            dispatch: d,
                            folded: &folded,
                        });
                    }
                }
                _ => {
                    if self.exec.submit(d, self.now) == Submitted::Conflict {
                        let folded = self.host.handle_submit_failed(
                            &d.key.node,
                            d.op,
                            "operation id conflict",
                            self.now,
                        );
                        self.record(StepEvent::SubmitFailed {
                            dispatch: d,
                            folded: &folded,
                        });
                    }
                    self.submitted.push(d.clone());
                }
            }
        }
    }

    /// Collects an orphan at once, the way an executor would: cancel its
    /// session, then destroy its lease; a refused call is retried by the host.
    fn collect(&mut self, request: &CollectRequest) {
        if let Some(wrong) = self.leases.judge_collect(request) {
            self.report_all(vec![wrong]);
        }
        let now = self.now;
        let backend = self.exec.backend_mut();
        let mut outcome = Ok(());
        if let Some(session) = &request.session {
            outcome = backend
                .cancel_bootstrap(session, now)
                .map_err(|e| e.to_string());
        }
        if let (Ok(()), Some(lease)) = (&outcome, &request.lease) {
            outcome = backend.destroy_lease(lease, now).map_err(|e| e.to_string());
        }
        self.record(StepEvent::Collect {
            request,
            outcome: &outcome,
        });
        // The model's backend never gives a release up.
        let outcome = outcome.map(|()| swactor_provisioning::Release::Done);
        self.host.handle_collected(&request.key, outcome, now);
    }

    fn record_fold(&mut self, fold: &HostFold) {
        match fold {
            HostFold::Observation { obs, folded } => {
                self.record(StepEvent::Observation { obs, folded })
            }
            HostFold::Result { result, folded } => {
                self.record(StepEvent::Result { result, folded })
            }
            HostFold::AgentLost {
                node,
                attempt,
                folded,
                reason,
            } => {
                if (reason == AWAY_PAST_GRACE || reason == PAUSED_PAST_WAIT)
                    && *folded == Folded::Applied
                {
                    self.check_blame(node, *attempt);
                    self.check_paused_wait(node, *attempt);
                }
                self.record(StepEvent::AgentLost {
                    node,
                    attempt: *attempt,
                    folded: *folded,
                });
            }
        }
    }

    /// A node is being failed because its agent stayed away past its grace:
    /// the world must have cut that agent off, and a host must have been
    /// listening for a whole grace since (see
    /// [`Invariant::NoAgentBlamedForHostSilence`]).
    fn check_blame(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) {
        let inv = Invariant::NoAgentBlamedForHostSilence;
        let Some(&(_, since)) = self.cut.get(node).filter(|(a, _)| *a == attempt) else {
            self.oracle.report(
                inv,
                Some(node),
                format!(
                    "{node}/{attempt} failed for silence at {}, but its agent was live: the host only did not hear it (unheard {:?})",
                    self.now, self.unheard
                ),
            );
            return;
        };
        // Stalls up to the core's listen gap are tolerated as listening
        // (no host can tell them from scheduling noise); longer ones are
        // not listening.
        let tolerated = self.host.core().config().listen_gap_ms;
        let deaf: u64 = self
            .unheard
            .iter()
            .filter(|(a, b)| b.0 - a.0 > tolerated)
            .map(|(a, b)| {
                let (a, b) = (a.0.max(since.0), b.0.min(self.now.0));
                b.saturating_sub(a)
            })
            .sum();
        let listened = (self.now.0 - since.0).saturating_sub(deaf);
        if listened < GRACE_MS {
            self.oracle.report(
                inv,
                Some(node),
                format!(
                    "{node}/{attempt} failed for silence at {}: cut off at {since}, but the host listened for only {listened} ms of it (grace {GRACE_MS} ms)",
                    self.now
                ),
            );
        }
    }

    /// The provider answers the host's question: whether the machine of
    /// `key` is paused.
    fn probed(&mut self, key: &ResourceKey) {
        let paused = self
            .paused
            .get(&key.node)
            .is_some_and(|(a, _)| *a == key.attempt);
        self.host.handle_probed(key, Ok(paused), self.now);
    }

    /// A node is being failed for its silence: if its machine is paused
    /// and the host was told so in a group that waits, the wait must be
    /// over (see [`Invariant::PausedMachineKeptForItsWait`]).
    fn check_paused_wait(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) {
        let Some((a, until)) = self.paused.remove(node) else {
            return;
        };
        if let Some(until) = until
            && a == attempt
            && self.now < until
        {
            self.oracle.report(
                Invariant::PausedMachineKeptForItsWait,
                Some(node),
                format!(
                    "{node}/{attempt} failed at {} though its machine is paused and its group waits until {until}",
                    self.now
                ),
            );
        }
    }

    /// The world cuts off the agent of `key` (it stays silent until the
    /// partition heals).
    fn cut_off(&mut self, key: &ResourceKey) {
        let joined = match self.host.link(&key.node) {
            Some(Link::Connected(a)) => a == key.attempt,
            // Dropped by a host pause and about to dial again: it dies now.
            Some(Link::Away { attempt, .. }) => {
                attempt == key.attempt && self.rejoins.iter().any(|(_, k)| k == key)
            }
            None => false,
        };
        if joined {
            // One a pause dropped has been silent since the host was back
            // (it was to dial again, and now never will): the host owes it
            // a whole grace from then, not from now.
            let since = self
                .rejoins
                .iter()
                .find(|(_, k)| k == key)
                .map_or(self.now, |(at, _)| Timestamp(at.0 - PAUSE_REJOIN_MS));
            self.cut.insert(key.node, (key.attempt, since));
        }
        self.rejoins.retain(|(_, k)| k != key);
    }

    /// The host heard nothing for `ms`: every live agent connected to it
    /// that the pause outlasted its silence limit is dropped (as the swarm
    /// endpoint does when it wakes) and dials again shortly.
    fn host_paused(&mut self, ms: u64) {
        let from = self.now;
        self.pass_time(Timestamp(self.now.0 + ms), Hearing::Paused);
        self.unheard.push((from, self.now));
        if ms <= Liveness::for_grace(GRACE_MS).silence_ms {
            return;
        }
        let dropped: Vec<ResourceKey> = self
            .host
            .core()
            .state()
            .nodes
            .iter()
            .filter(|(id, n)| {
                self.host.link(id) == Some(Link::Connected(n.attempt))
                    && !self.cut.contains_key(*id)
            })
            .map(|(id, n)| ResourceKey {
                run_id: RunId::new(RUN),
                node: *id,
                attempt: n.attempt,
            })
            .collect();
        for key in dropped {
            self.host.handle_agent_gone(&key, ms, self.now);
            self.rejoins
                .push((Timestamp(self.now.0 + PAUSE_REJOIN_MS), key));
        }
    }

    /// Live agents whose connection a pause dropped, due by now, join again.
    fn rejoin_due(&mut self) {
        let now = self.now;
        let due: Vec<ResourceKey> = self
            .rejoins
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, k)| k.clone())
            .collect();
        self.rejoins.retain(|(at, _)| *at > now);
        for key in due {
            if self.cut.contains_key(&key.node) {
                continue;
            }
            self.join(&key);
        }
    }

    /// Kills the host (as `kill -9` would): its executor and streams die
    /// with it; after `down_ms` a new host starts from the journal.
    fn crash(&mut self, down_ms: u16) {
        self.host_going();
        self.exec.crash(self.now);
        let from = self.now;
        self.pass_time(Timestamp(self.now.0 + u64::from(down_ms)), Hearing::Down);
        self.unheard.push((from, self.now));
        self.start_host("crashed");
    }

    /// Lets virtual time pass to `to` while the host is `hearing`: the
    /// daemon renews the leases of the agents a listening host is linked
    /// to, and agents whose lease lapses end their nodes.
    fn pass_time(&mut self, to: Timestamp, hearing: Hearing) {
        let from = self.now;
        let (host, paused) = (&self.host, &self.paused);
        let backend = self.exec.backend();
        // The daemon renews whom its host holds connected: an agent cut off
        // is away from it once the host hears of the cut, and one whose
        // session a restarted host replays joins again (the world passes on
        // every join a stream reports).
        let linked = |k: &ResourceKey| host.link(&k.node) == Some(Link::Connected(k.attempt));
        // A machine the provider paused stops its agent with it; one that
        // resumes starts a fresh agent, which joins for a lease of its own.
        let running = |k: &ResourceKey| {
            backend.live_lease(k).is_some()
                && paused.get(&k.node).is_none_or(|(a, _)| *a != k.attempt)
        };
        let listening = hearing == Hearing::Listening;
        let lapses = self.leases.advance(from, to, listening, linked, running);
        self.now = to;
        for lapse in lapses {
            self.lapse(&lapse, hearing != Hearing::Down);
        }
    }

    /// The agent of `lapse` ends its node: its machine disappears (deleted
    /// behind the host's back, as a Vast.ai instance its agent destroys),
    /// and a host that is up (`host_up`) stops hearing from it.
    fn lapse(&mut self, lapse: &Lapse, host_up: bool) {
        let key = &lapse.key;
        if let Some(detail) = &lapse.wrong {
            let inv = Invariant::LeaseEndOnlyWhenUnrenewed;
            self.oracle.report(inv, Some(&key.node), detail.clone());
        }
        if let Some(lease) = self.exec.backend().live_lease(key) {
            let now = self.now;
            self.exec.backend_mut().delete_out_of_band(&lease, now);
        }
        self.rejoins.retain(|(_, k)| k != key);
        let link = self.host.link(&key.node);
        let names = match link {
            Some(Link::Connected(a)) => a == key.attempt,
            Some(Link::Away { attempt, .. }) => attempt == key.attempt,
            None => false,
        };
        if !host_up || !names {
            return;
        }
        // Silent for real from now on: a host that fails the node for it
        // owes it a whole grace from here (see `check_blame`).
        let since = self.now;
        let cut = self.cut.entry(key.node).or_insert((key.attempt, since));
        if cut.0 < key.attempt {
            *cut = (key.attempt, since);
        }
        if link == Some(Link::Connected(key.attempt)) {
            self.host.handle_agent_gone(key, 0, self.now);
        }
    }

    /// The host goes (killed, or stopped keeping its nodes): the slots
    /// whose node is ready, idle and of its desired template, with their
    /// agent linked, are held to what a host back within their lease owes
    /// them, if no fault that could touch them is armed (see
    /// [`crate::lease`]).
    fn host_going(&mut self) {
        // Faults that touch only new leases leave running nodes alone.
        let quiet = self.exec.armed().is_empty()
            && self.exec.backend().armed().iter().all(|f| {
                matches!(
                    f,
                    ProviderFault::EndpointNeverReady
                        | ProviderFault::EndpointSlow { .. }
                        | ProviderFault::Invisible { .. }
                )
            });
        let core = self.host.core();
        let keep = core
            .state()
            .nodes
            .iter()
            .filter_map(|(id, n)| {
                let template = core.desired().slot(id)?;
                let key = ResourceKey {
                    run_id: RunId::new(RUN),
                    node: *id,
                    attempt: n.attempt,
                };
                let idle = n.pending.is_none() && self.exec.in_flight(id, n.attempt) == 0;
                let kept = n.intent == Intent::Active
                    && n.is_ready()
                    && idle
                    && same_template(template, &n.template)
                    && self.host.link(id) == Some(Link::Connected(n.attempt))
                    && !self.cut.contains_key(id)
                    && !self.paused.contains_key(id);
                kept.then(|| (key, template.clone()))
            })
            .collect();
        let tearing_down = self.host.shutting_down() == Some(ShutdownMode::Teardown)
            || self.durable.meta.tearing_down;
        self.leases.host_going(quiet && !tearing_down, keep);
    }

    /// A host stopped on its own (a shutdown finished): start the next one.
    fn host_stopped(&mut self) {
        self.host_going();
        // A daemon that stops takes its executor with it.
        self.exec.crash(self.now);
        let tore_down = self
            .durable
            .meta
            .shape
            .as_ref()
            .is_some_and(|s| s.groups.is_empty());
        if tore_down {
            self.teardowns
                .push(self.exec.backend().live_resources().count());
        }
        self.start_host("stopped");
        if tore_down && self.next_shape.is_none() {
            // `swactor up SHAPE` after `down`: the shape is the next generation.
            self.generation += 1;
            let shape = shape_with(self.generation, &self.groups, &self.policies);
            self.offer(&shape);
        }
    }

    /// Starts a new host from the journal and the provider's inventory.
    fn start_host(&mut self, why: &str) {
        self.restarts += 1;
        self.abort = None;
        self.timer_lost = false;
        self.submitted.clear();
        let resume = Some(self.durable.clone());
        let host = match build_host(&self.make, &self.config, self.seed, resume, self.now) {
            Ok(host) => host,
            Err(e) => {
                self.oracle.report(
                    Invariant::AcknowledgedShapesSurviveRestarts,
                    None,
                    format!("no host could start from the journal after it {why}: {e}"),
                );
                return;
            }
        };
        // The old host's life ends here: its recording is whole.
        self.flush_recording();
        let (host, header) = host;
        self.host = host;
        self.lives.extend(header);
        self.grant_leadership();
        // A host started on another shape, or to finish a teardown, owes
        // the nodes it finds nothing of the kind.
        let as_before = self.next_shape.is_none() && !self.durable.meta.tearing_down;
        self.leases.host_started(as_before);
        let durable = self.durable.clone();
        self.record(StepEvent::Restart { durable: &durable });
        if self.durable.meta.tearing_down && self.next_shape.is_none() {
            // `swactor up` on a journal whose teardown never finished: finish it.
            let ticket = self.ticket();
            self.host
                .handle_shutdown(ShutdownMode::Teardown, ticket, self.now);
            self.record(StepEvent::Shutdown {
                mode: ShutdownMode::Teardown,
            });
            return;
        }
        if let Some(groups) = self.next_shape.take() {
            // `swactor up SHAPE`: offered before the inventory comes in.
            self.groups = groups;
            self.generation += 1;
            let shape = shape_with(self.generation, &self.groups, &self.policies);
            self.offer(&shape);
            return;
        }
        // What the world offers next continues from what the journal holds.
        match &self.durable.meta.shape {
            Some(shape) => {
                self.generation = self.generation.max(shape.generation.0);
                if !shape.groups.is_empty() {
                    self.groups = groups_of(shape);
                    self.policies = policies_of(shape);
                }
            }
            None => {
                // No shape was ever durable: `swactor up SHAPE` again.
                let shape = shape_with(self.generation.max(1), &self.groups, &self.policies);
                self.offer(&shape);
            }
        }
    }

    /// Runs everything due at `now`: deliveries, the host's timer, passes.
    fn settle(&mut self) {
        self.settle_once();
        // The election renews after the host has drained what woke it (so
        // a leader that wakes past its bound is seen acting on nothing);
        // renewed, the host goes on at once.
        if self.renew_leadership() {
            self.settle_once();
        }
    }

    /// Grants a new host its leadership, when the world runs an election.
    fn grant_leadership(&mut self) {
        let Some(lease_ms) = self.config.leadership_ms else {
            return;
        };
        let lead = LeaderLease {
            lease_ms,
            renewed: self.now,
        };
        self.lead = Some(lead);
        if self.config.tell_leadership {
            self.host
                .handle_leadership(Leadership::Until(lead.until()), self.now);
        }
    }

    /// Renews the leadership when due: the host leads on, or, when its
    /// lease ran out while it was frozen, another replica takes over (a new
    /// host from the journal). Whether the host was told anything.
    fn renew_leadership(&mut self) -> bool {
        let Some(lead) = self.lead.filter(|l| l.renew_at() <= self.now) else {
            return false;
        };
        if lead.expired_at(self.now) {
            // Deposed: what the old leader had under way may still land,
            // as after a crash; the new leader starts from the journal.
            self.host_going();
            self.exec.crash(self.now);
            self.start_host("lost its leadership");
            return true;
        }
        let lead = LeaderLease {
            renewed: self.now,
            ..lead
        };
        self.lead = Some(lead);
        if self.config.tell_leadership {
            self.host
                .handle_leadership(Leadership::Until(lead.until()), self.now);
        }
        true
    }

    fn settle_once(&mut self) {
        self.rejoin_due();
        for output in self.exec.poll(self.now) {
            self.deliver(output);
            // A host that reconciles after every message; the other kind
            // folds everything that arrived at once and reconciles once,
            // like an actor draining its mailbox.
            if !self.config.batch_deliveries {
                self.drain();
            }
        }
        let due = self.host.poll_timeout().is_some_and(|t| t <= self.now);
        if due && self.timer_lost {
            // The timer was lost; the safety-net tick must notice the due deadline.
            self.timer_lost = false;
            let core_due = self
                .host
                .core()
                .poll_timeout()
                .is_some_and(|t| t <= self.now);
            self.host.handle_tick(self.now);
            self.record(StepEvent::Tick);
            // A host killed at the journal write its tick led to took the
            // pass with it; the next host owes nothing for that tick.
            let restarts = self.restarts;
            // A host past its leadership owes no pass until renewed.
            let leads = self.lead.is_none_or(|l| self.now < l.until());
            if self.drain() == 0 && core_due && self.restarts == restarts && leads {
                self.oracle.report(
                    Invariant::RequeueAtEarliestWaitingDeadline,
                    None,
                    format!("a tick at {} with a due deadline queued no pass", self.now),
                );
            }
        }
        let fired = self.host.poll_timeout().is_some_and(|t| t <= self.now);
        if fired {
            let folded = self.host.handle_timeout(self.now);
            self.record(StepEvent::Timeout { folded: &folded });
        }
        let restarts = self.restarts;
        self.drain();
        // A timer that fired and was served must move into the future;
        // otherwise the host would spin on it. (A host killed meanwhile
        // served nothing; its successor's timer is its own.)
        let served = fired && self.restarts == restarts;
        if let Some(t) = self
            .host
            .poll_timeout()
            .filter(|t| served && *t <= self.now)
        {
            self.oracle.report(
                Invariant::RequeueAtEarliestWaitingDeadline,
                None,
                format!(
                    "the timer fired at {} and still says {t} (core {:?}, host {:?}, adopted {})",
                    self.now,
                    self.host.core().poll_timeout(),
                    self.host.host_deadlines(),
                    self.host.adopted(),
                ),
            );
        }
    }

    /// The earliest wake-up of any party.
    pub fn next_wake(&self) -> Option<Timestamp> {
        let rejoin = self.rejoins.iter().map(|(at, _)| *at).min();
        // With the default hour-long lease nothing lapses in a trace; its
        // lapses are no wake-ups, so such worlds step exactly as they did
        // before leases were modelled (a lapse would be seen at the next
        // step after it).
        let lapse = self
            .config
            .orphan_after_s
            .and_then(|_| self.leases.next_lapse());
        [
            self.host.poll_timeout(),
            self.exec.next_wake(),
            rejoin,
            lapse,
            self.lead.map(LeaderLease::renew_at),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Advances to the earliest wake-up and runs it. False when nothing is left to wake.
    pub fn step(&mut self) -> bool {
        let Some(at) = self.next_wake() else {
            return false;
        };
        // A timer in the past was already run; never go back, never stall.
        let to = at.max(Timestamp(self.now.0 + u64::from(at <= self.now)));
        self.pass_time(to, Hearing::Listening);
        self.settle();
        true
    }

    /// Advances virtual time to `target`, waking at every deadline on the way.
    pub fn run_until(&mut self, target: Timestamp) {
        while self.next_wake().is_some_and(|t| t <= target) && self.oracle.ok() {
            self.step();
        }
        if target > self.now {
            self.pass_time(target, Hearing::Listening);
            self.settle();
        }
    }

    /// Applies one trace input.
    pub fn apply(&mut self, input: &Input) {
        self.oracle
            .begin_input(format!("{input:?} at {}", self.now));
        // Inputs that only let time pass, or that no running node feels,
        // keep what a restarted host owes the nodes it found.
        let quiet = matches!(
            input,
            Input::Advance { .. }
                | Input::Step
                | Input::Tick
                | Input::HostPause { .. }
                | Input::LoseTimerOnce
                | Input::Resubmit
                | Input::Invalid(_)
        );
        self.leases.input(quiet);
        match *input {
            Input::Shape {
                group,
                count,
                variant,
                skip,
            } => self.apply_shape(group, count, variant, skip),
            Input::Resubmit => {
                let shape = shape_with(self.generation, &self.groups, &self.policies);
                self.offer(&shape);
            }
            Input::Invalid(kind) => {
                let shape = self.invalid_shape(kind);
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
                self.host.handle_tick(self.now);
                self.record(StepEvent::Tick);
            }
            Input::HostPause { ms } => {
                // Nothing is woken during the pause; `settle` below then
                // serves every late delivery and the late timer at once.
                self.host_paused(u64::from(ms));
            }
            Input::LoseTimerOnce => self.timer_lost = true,
            Input::Provider(f) => self.exec.backend_mut().arm(f.fault()),
            Input::Delivery { kind, ref fault } => self.exec.arm(kind, fault.clone()),
            Input::AbortNextPass { keep, report } => self.abort = Some((keep, report)),
            Input::DeleteOutOfBand { pick } => self.apply_delete_out_of_band(pick),
            Input::AgentLost { pick, stale } => self.apply_agent_lost(pick, stale),
            Input::ResubmitOld { pick } => self.apply_resubmit_old(pick),
            Input::HostCrash {
                at_persist,
                down_ms,
            } => {
                if at_persist {
                    self.crash_at_persist = Some(down_ms);
                } else {
                    self.crash(down_ms);
                }
            }
            Input::Pause => self.pause(true),
            Input::Resume => self.pause(false),
            Input::Budget {
                group,
                max_unavailable,
                max_unhealthy,
            } => self.apply_budget(group, max_unavailable, max_unhealthy),
            Input::MassAgentLoss { group, count } => self.apply_mass_agent_loss(group, count),
            Input::AgentsReturn => self.agents_return(),
            Input::Preempt { pick } => self.apply_preempt(pick),
            Input::PreemptPolicy { group, wait_s } => self.apply_preempt_policy(group, wait_s),
            Input::Shutdown { keep } => self.apply_shutdown(keep),
        }
        self.settle();
    }

    /// Offers a new shape: `count` nodes of template `variant` for `group`, `skip` generations on.
    fn apply_shape(&mut self, group: u8, count: u8, variant: u8, skip: u8) {
        let mut groups = self.groups;
        groups[usize::from(group % 2)] = (count, variant);
        let generation = self.generation + 1 + u64::from(skip);
        let shape = shape_with(generation, &groups, &self.policies);
        self.offer(&shape);
        if self.host.shutting_down().is_none() {
            self.groups = groups;
            self.generation = generation;
        }
    }

    /// The shape an invalid update of `kind` offers: the current one, broken.
    fn invalid_shape(&self, kind: InvalidUpdate) -> ClusterShape {
        let mut groups = self.groups;
        match kind {
            InvalidUpdate::GenerationRegression => {
                groups[0].0 = (groups[0].0 + 1) % 4;
                shape_with(self.generation.saturating_sub(1), &groups, &self.policies)
            }
            InvalidUpdate::SameGenerationChange => {
                groups[1].1 = (groups[1].1 + 1) % 3;
                shape_with(self.generation, &groups, &self.policies)
            }
            InvalidUpdate::WrongRun => {
                let mut s = shape_with(self.generation + 1, &groups, &self.policies);
                s.run_id = RunId::new("another-run");
                s
            }
            InvalidUpdate::Malformed => {
                let mut s = shape_with(self.generation + 1, &groups, &self.policies);
                s.groups[0].id = "Alpha".to_owned();
                s
            }
            InvalidUpdate::OverCapacity => {
                // One more node than the shape's own capacity allows.
                groups[0].0 += 1;
                let mut s = shape_with(self.generation + 1, &groups, &self.policies);
                s.capacity = Some(s.node_count().saturating_sub(1));
                s
            }
        }
    }

    /// Deletes the `pick`th machine with an open bootstrap stream behind the host's back.
    fn apply_delete_out_of_band(&mut self, pick: u8) {
        // Only machines whose bootstrap stream is open: that stream is
        // the one channel through which the core can learn of the loss
        // of a ready node (see the crate README, "gaps").
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

    /// Loses the agent of the `pick`th node for good (`stale`: of the attempt before).
    fn apply_agent_lost(&mut self, pick: u8, stale: bool) {
        // The swarm connection of a node's agent drops and never
        // comes back; its grace runs out and the node is replaced.
        let nodes = &self.host.core().state().nodes;
        if !nodes.is_empty() {
            let (id, n) = nodes
                .iter()
                .nth(usize::from(pick) % nodes.len())
                .expect("index is in range");
            let key = ResourceKey {
                run_id: RunId::new(RUN),
                node: *id,
                attempt: NodeAttemptId(n.attempt.0 - u64::from(stale)),
            };
            self.cut_off(&key);
            self.host.handle_agent_gone(&key, 0, self.now);
        }
    }

    /// Submits the `pick`th earlier dispatch again; its operation id must name the same request.
    fn apply_resubmit_old(&mut self, pick: u8) {
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

    /// Offers new budgets for `group`, keeping what it does with paused machines.
    fn apply_budget(&mut self, group: u8, max_unavailable: u8, max_unhealthy: Option<u8>) {
        let mut policies = self.policies;
        let g = usize::from(group % 2);
        // Budgets only: what the group does with paused machines, and
        // its lease, stay.
        policies[g] = PolicyShape {
            on_preempt: policies[g].on_preempt,
            preempt_wait_s: policies[g].preempt_wait_s,
            orphan_after_s: policies[g].orphan_after_s,
            ..budget_policy(max_unavailable, max_unhealthy)
        };
        let generation = self.generation + 1;
        let shape = shape_with(generation, &self.groups, &policies);
        self.offer(&shape);
        if self.host.shutting_down().is_none() {
            self.policies = policies;
            self.generation = generation;
        }
    }

    /// Cuts `count` of `group`'s connected agents off at once.
    fn apply_mass_agent_loss(&mut self, group: u8, count: u8) {
        // A partition cuts `count` of the group's connected agents
        // off at once (their machines keep running).
        let group = GROUPS[usize::from(group % 2)];
        let cut: Vec<ResourceKey> = self
            .host
            .core()
            .state()
            .nodes
            .iter()
            .filter(|(id, n)| {
                id.group.as_str() == group && self.host.link(id) == Some(Link::Connected(n.attempt))
            })
            .take(usize::from(count))
            .map(|(id, n)| ResourceKey {
                run_id: RunId::new(RUN),
                node: *id,
                attempt: n.attempt,
            })
            .collect();
        for key in &cut {
            self.cut_off(key);
            self.host.handle_agent_gone(key, 0, self.now);
        }
    }

    /// Pauses the machine of the `pick`th connected node, as its provider preempts it.
    fn apply_preempt(&mut self, pick: u8) {
        let connected: Vec<ResourceKey> = self
            .host
            .core()
            .state()
            .nodes
            .iter()
            .filter(|(id, n)| self.host.link(id) == Some(Link::Connected(n.attempt)))
            .map(|(id, n)| ResourceKey {
                run_id: RunId::new(RUN),
                node: *id,
                attempt: n.attempt,
            })
            .collect();
        if !connected.is_empty() {
            let key = connected[usize::from(pick) % connected.len()].clone();
            // The host is owed the group's whole wait from now:
            // it learns of the pause as the agent's silence is
            // noticed, at once here.
            let group = GROUPS.iter().position(|g| *g == key.node.group.as_str());
            let wait = group.and_then(|g| self.policies[g].resolve().on_preempt.wait_ms());
            let until = wait.map(|w| self.now.saturating_add_ms(w));
            self.paused.insert(key.node, (key.attempt, until));
            self.cut_off(&key);
            self.host.handle_agent_gone(&key, 0, self.now);
        }
    }

    /// Offers a new preemption policy for `group`: wait `wait_s`, or not at all.
    fn apply_preempt_policy(&mut self, group: u8, wait_s: Option<u8>) {
        let g = usize::from(group % 2);
        let mut policies = self.policies;
        policies[g].on_preempt = wait_s.map(|_| PreemptChoice::Wait);
        policies[g].preempt_wait_s = wait_s.map(u32::from);
        let generation = self.generation + 1;
        let shape = shape_with(generation, &self.groups, &policies);
        self.offer(&shape);
        if self.host.shutting_down().is_none() {
            if policies[g] != self.policies[g] {
                // The host keeps what it promised under the old
                // policy; the world stops holding it to it.
                for (node, entry) in &mut self.paused {
                    if node.group.as_str() == GROUPS[g] {
                        entry.1 = None;
                    }
                }
            }
            self.policies = policies;
            self.generation = generation;
        }
    }

    /// Shuts the host down, keeping its nodes or tearing them down.
    fn apply_shutdown(&mut self, keep: bool) {
        let mode = if keep {
            ShutdownMode::Keep
        } else {
            ShutdownMode::Teardown
        };
        let ticket = self.ticket();
        self.host.handle_shutdown(mode, ticket, self.now);
        self.record(StepEvent::Shutdown { mode });
    }

    /// The partition heals: every agent away from the host (its grace
    /// running or held by a breaker) rejoins, as its machine still runs.
    pub fn agents_return(&mut self) {
        self.leases.input(false);
        let away: Vec<ResourceKey> = self
            .host
            .core()
            .state()
            .nodes
            .iter()
            .filter_map(|(id, n)| match self.host.link(id) {
                Some(Link::Away { attempt, .. }) if attempt == n.attempt => Some(ResourceKey {
                    run_id: RunId::new(RUN),
                    node: *id,
                    attempt,
                }),
                _ => None,
            })
            // An agent that ended its node is gone for good.
            .filter(|key| !self.leases.ended(key))
            .collect();
        for key in away {
            self.cut.remove(&key.node);
            // A paused machine resumes with its agent.
            self.paused.remove(&key.node);
            self.rejoins.retain(|(_, k)| *k != key);
            self.join(&key);
        }
    }

    /// `swactor pause` (`paused`) or `swactor resume`, judged by the oracle.
    pub fn pause(&mut self, paused: bool) {
        let ticket = self.ticket();
        let outcome = self.host.handle_pause(paused, ticket, self.now);
        self.record(StepEvent::Pause {
            paused,
            outcome: &outcome,
        });
    }

    /// `swactor down --keep`, then `swactor up` with `groups` as the next
    /// generation: the new host is offered the shape before the provider's
    /// inventory arrives, so it adopts against the new templates.
    pub fn restart_with(&mut self, groups: [(u8, u8); 2]) {
        self.oracle
            .begin_input(format!("restart with {groups:?} at {}", self.now));
        self.leases.input(false);
        self.next_shape = Some(groups);
        let ticket = self.ticket();
        self.host
            .handle_shutdown(ShutdownMode::Keep, ticket, self.now);
        self.record(StepEvent::Shutdown {
            mode: ShutdownMode::Keep,
        });
        self.settle();
    }

    /// Kills the host (as `kill -9` would) and starts the next one with
    /// `groups` instead of the journal's shape (`swactor up CHANGED.toml`
    /// after a crash): whatever the dead host had in flight is judged
    /// against a shape it never saw.
    pub fn crash_and_restart_with(&mut self, groups: [(u8, u8); 2], down_ms: u16) {
        self.oracle.begin_input(format!(
            "crash, then restart with {groups:?} at {}",
            self.now
        ));
        self.leases.input(false);
        self.next_shape = Some(groups);
        self.crash(down_ms);
        self.settle();
    }

    /// Runs until a teardown under way finishes (the host stops); returns
    /// how many resources the provider still held at that moment.
    pub fn finish_teardown(&mut self) -> Option<usize> {
        let done = self.teardowns.len();
        let limit = Timestamp(self.now.0 + self.config.tail_bound(8).time_ms);
        while self.teardowns.len() == done && self.now <= limit && self.oracle.ok() {
            if !self.step() {
                break;
            }
        }
        self.teardowns.get(done).copied()
    }

    /// Stops every fault: the executor delivers fairly from now on and the provider heals.
    pub fn heal(&mut self) {
        self.abort = None;
        self.timer_lost = false;
        self.crash_at_persist = None;
        let fair = self.config.fair.clone();
        self.exec.heal(fair, self.now);
        if self.host.is_paused() {
            // A paused cluster converges on nothing; the operator resumes.
            self.pause(false);
            self.settle();
        }
        if self.host.shutting_down().is_none()
            && self.policies.iter().any(|p| p.max_unhealthy.is_some())
        {
            // Agents cut off for good never bring a tripped breaker back
            // under its limit; the operator lifts the limit instead.
            for p in &mut self.policies {
                p.max_unhealthy = None;
            }
            self.generation += 1;
            let shape = shape_with(self.generation, &self.groups, &self.policies);
            self.offer(&shape);
            self.settle();
        }
    }

    /// Heals the world and runs it until the host converges, judging the
    /// time and passes it takes against the derived [`TailBound`]; then lets
    /// stragglers (duplicated results, late completions) arrive and checks the
    /// end state. A teardown under way at the start of the tail finishes
    /// first and the next host starts; the bound runs from there.
    pub fn run_fair_tail(&mut self) -> TailReport {
        self.oracle
            .begin_input(format!("fair tail from {}", self.now));
        self.heal();
        if self.host.shutting_down().is_some() {
            let restarts = self.restarts;
            let limit = Timestamp(self.now.0 + self.config.tail_bound(8).time_ms);
            while self.restarts == restarts && self.now <= limit && self.oracle.ok() {
                if !self.step() {
                    break;
                }
            }
        }
        let (t0, p0) = (self.now, self.passes);
        let nodes = self
            .sut()
            .state()
            .nodes
            .len()
            .max(self.sut().desired().node_count() as usize);
        let mut bound = self.config.tail_bound(nodes);
        // A rollout replaces at most max_unavailable + max_surge ready nodes
        // of a group at a time: the per-node bound holds for each wave of
        // it, and for the surge nodes coming up before the first wave.
        let waves = self
            .sut()
            .desired()
            .groups
            .iter()
            .map(|g| {
                let surge = g.policy.max_surge_of(g.count);
                let step = (g.policy.max_unavailable_of(g.count) + surge).max(1);
                u64::from(g.count.div_ceil(step)) + u64::from(surge > 0)
            })
            .max()
            .unwrap_or(1)
            .max(1);
        bound.time_ms *= waves;
        let converged_now = |w: &Self| {
            independently_converged(w.sut().state(), w.sut().desired()) && w.host.is_converged()
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
                .sut()
                .state()
                .nodes
                .iter()
                .find(|(_, n)| !n.is_ready())
                .map(|(id, n)| (*id, format!("{:?} {:?}", n.intent, n.record.stage)));
            let detail = format!(
                "not converged after {} ms and {} passes of fair delivery (bound {} ms, {} passes); first unready node: {:?}; orphans left: {}",
                report.time_ms,
                report.passes,
                bound.time_ms,
                bound.passes,
                stuck.as_ref().map(|s| &s.1),
                self.host.collecting().count(),
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
        let after = snapshot(&self.host, self.now);
        self.oracle.finish(&after, &self.exec);
        let core = self.host.core();
        let wanted = |n: &LogicalNodeId| core.desired().slot(n).cloned();
        let backend = self.exec.backend();
        let made = |n: &LogicalNodeId, since: Timestamp| machines_made(backend, n, since);
        let wrong = self.leases.judge_end(&wanted, &made);
        self.report_all(wrong);
        report
    }
}

/// The attempts of the machines the provider made for slot `node` at or
/// after `since`, in the order it made them.
fn machines_made(
    backend: &FakeBackend,
    node: &LogicalNodeId,
    since: Timestamp,
) -> Vec<NodeAttemptId> {
    backend
        .leases()
        .values()
        .filter(|l| l.key.node == *node && l.created_at >= since)
        .map(|l| l.key.attempt)
        .collect()
}

/// The wall clock a recorded host is told it started at: this instant
/// (2026-01-01, UTC) plus the world's virtual time, so that recordings of
/// the same seed are the same bytes.
pub const RECORDING_EPOCH_MS: u64 = 1_767_225_600_000;

/// A host for the world, from `resume` (`None`: a fresh journal), and,
/// when the world records, the header of its recording.
fn build_host<R: Reconciler>(
    make: &Factory<R>,
    config: &WorldConfig,
    seed: u64,
    resume: Option<JournalImage>,
    now: Timestamp,
) -> Result<(Flight<R>, Option<Vec<u8>>), HostError> {
    if !config.record {
        let host = Host::new(make(), host_config(), resume)?;
        return Ok((Flight::unrecorded(host), None));
    }
    let build = format!(
        "swactor-conformance {} world (trace seed {seed})",
        env!("CARGO_PKG_VERSION")
    );
    let wall_ms = RECORDING_EPOCH_MS + now.0;
    let (host, header) = flight::record(make(), host_config(), resume, build, wall_ms, now)?;
    Ok((host, Some(header)))
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
    /// What the agents' leases did.
    pub leases: crate::lease::LeaseStats,
    /// Each host life's flight recording, when the world recorded
    /// ([`WorldConfig::record`]).
    pub recordings: Vec<Vec<u8>>,
}

/// Runs `trace` through a world whose hosts wrap cores `make` returns: the
/// faulty prefix, then the fair tail.
pub fn run_trace_with<R: Reconciler>(
    make: &Factory<R>,
    config: &WorldConfig,
    trace: &Trace,
) -> RunReport {
    let mut world = World::with_factory(make.clone(), config.clone(), trace.seed);
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
        leases: world.leases().stats(),
        recordings: world.recordings(),
    }
}

/// Runs `trace` through a world around fresh [`Driver`]s.
pub fn run_trace(config: &WorldConfig, trace: &Trace) -> RunReport {
    let reconciler = config.reconciler.clone();
    let make = move || {
        Driver::new(RunId::new(RUN), reconciler.clone())
            .expect("the world's reconciler config is valid")
    };
    run_trace_with(&(Rc::new(make) as Factory<Driver>), config, trace)
}

/// An output's name, for reports.
fn output_name(out: &HostOutput) -> &'static str {
    match out {
        HostOutput::Persist(_) => "a journal write",
        HostOutput::List => "a listing",
        HostOutput::Pass(_) => "a pass",
        HostOutput::Collect(_) => "a collection",
        HostOutput::Probe { .. } => "a probe",
        HostOutput::Folded(_) => "a fold",
        HostOutput::Reply(..) => "a reply",
        HostOutput::Stop => "the stop",
    }
}
