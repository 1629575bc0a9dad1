//! The input alphabet of a trace and the proptest strategies that generate traces.
//!
//! A trace is a list of [`Input`]s plus a seed for the random delays of the
//! executor. Everything else the world does (results, bootstrap observations,
//! deadlines) follows from those inputs, so a trace alone replays a run, and
//! shrinking a trace removes inputs until only the ones a failure needs remain.

use crate::executor::DeliveryFault;
use proptest::prelude::*;
use swactor_provisioning::{BootstrapStage, EffectKind};

/// How results travel back to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Fixed latencies: results and observations arrive in the order they were produced.
    InOrder,
    /// Random latencies that reorder results across nodes, plus duplicated
    /// results and resubmitted operations.
    Adversarial,
}

impl Mode {
    /// Both modes.
    pub const ALL: [Mode; 2] = [Mode::InOrder, Mode::Adversarial];

    /// A short name for messages and regression files.
    pub fn name(self) -> &'static str {
        match self {
            Self::InOrder => "in-order",
            Self::Adversarial => "adversarial",
        }
    }

    /// Parses [`Mode::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// A desired-shape update the driver must refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidUpdate {
    /// A generation lower than the current one.
    GenerationRegression,
    /// Different content at the current generation.
    SameGenerationChange,
    /// A shape for another run.
    WrongRun,
    /// A malformed shape (a group id with an upper-case letter).
    Malformed,
    /// A shape that grows past the capacity it names.
    OverCapacity,
}

/// A provider fault to arm (see [`crate::ProviderFault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderFaultInput {
    /// Refuse the next call of this kind, definitely.
    Refuse(EffectKind),
    /// The next new lease's endpoint is never ready (until the faults stop).
    EndpointNeverReady,
    /// The next new lease's endpoint is ready only after this many milliseconds.
    EndpointSlow(u16),
    /// The next new session fails at this stage.
    BootstrapFailsAt(BootstrapStage),
    /// The next new session loses the observations of these script steps.
    LoseObservations(u8),
    /// The next new session closes its stream after converging.
    CloseAfterConverge,
    /// The next new lease stays invisible to lookups for this many milliseconds.
    Invisible(u16),
}

/// One input of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Change group `group`'s count and template variant and raise the
    /// generation by `1 + skip` (intermediate generations are skipped).
    Shape {
        /// Which group (0 or 1).
        group: u8,
        /// Its new slot count.
        count: u8,
        /// Its template variant; a different variant is spec drift.
        variant: u8,
        /// Generations skipped.
        skip: u8,
    },
    /// Offer the current shape again, unchanged (must be a no-op).
    Resubmit,
    /// Offer an update the driver must refuse.
    Invalid(InvalidUpdate),
    /// Let `ms` milliseconds of virtual time pass, waking at every deadline on the way.
    Advance {
        /// How far to go.
        ms: u32,
    },
    /// Jump to the earliest wake-up of any party and run it.
    Step,
    /// A periodic safety-net tick.
    Tick,
    /// The host pauses for `ms` (a stop-the-world pause, an overloaded
    /// machine): nothing runs until then, and then everything due at once.
    HostPause {
        /// How long the pause lasts.
        ms: u32,
    },
    /// The host loses its timer once: the next due deadline is noticed by
    /// the periodic tick instead, which must queue a pass.
    LoseTimerOnce,
    /// Arm a provider fault.
    Provider(ProviderFaultInput),
    /// Arm a delivery fault for the next operation of `kind` (any kind for `None`).
    Delivery {
        /// Which kind of operation consumes it.
        kind: Option<EffectKind>,
        /// What happens.
        fault: DeliveryFault,
    },
    /// Abort the next pass that dispatches anything after submitting `keep` of
    /// its dispatches; the rest are lost, or reported with
    /// `handle_submit_failed` when `report` is set.
    AbortNextPass {
        /// Dispatches submitted before the abort.
        keep: u8,
        /// Whether the unsubmitted ones are reported as failed submissions.
        report: bool,
    },
    /// Delete a live lease that has an open bootstrap stream, out of band.
    DeleteOutOfBand {
        /// Which one, modulo the number of candidates.
        pick: u8,
    },
    /// The swarm reports a node's agent lost (it exited, or stayed away past
    /// its grace period), for its current attempt or, when `stale`, for the
    /// attempt before it.
    AgentLost {
        /// Which node, modulo the number of nodes.
        pick: u8,
        /// Whether the report names the previous attempt.
        stale: bool,
    },
    /// Submit an earlier dispatch to the executor again (a host retrying after a crash).
    ResubmitOld {
        /// Which one, modulo the number of earlier dispatches.
        pick: u8,
    },
    /// The host is killed (`kill -9`) and a new one starts from its journal
    /// and the provider's inventory: at once, or (with `at_persist`) at the
    /// moment it hands out its next journal write, before that write is
    /// durable. Nothing runs for `down_ms` in between; agents keep running.
    HostCrash {
        /// Crash between a journal write and its commit.
        at_persist: bool,
        /// How long no host runs.
        down_ms: u16,
    },
    /// The operator pauses reconciling (`swactor pause`): nothing new is
    /// dispatched until [`Input::Resume`] (or the fair tail, which resumes).
    Pause,
    /// The operator resumes reconciling (`swactor resume`).
    Resume,
    /// Set group `group`'s budgets (a new generation, same templates): see
    /// [`crate::world::budget_policy`] for what the numbers name.
    Budget {
        /// Which group (0 or 1).
        group: u8,
        /// Its `max_unavailable`, by code.
        max_unavailable: u8,
        /// Its `max_unhealthy`, by code (`None` for no limit).
        max_unhealthy: Option<u8>,
    },
    /// A partition cuts up to `count` of a group's connected agents off at
    /// once; their machines keep running.
    MassAgentLoss {
        /// Which group (0 or 1).
        group: u8,
        /// How many agents, at most.
        count: u8,
    },
    /// The partition heals: every away agent rejoins (and every paused
    /// machine resumes).
    AgentsReturn,
    /// The provider pauses the machine of a node whose agent is connected
    /// (an interruptible rental outbid): its agent goes silent with it,
    /// and the provider says the machine is paused when asked.
    Preempt {
        /// Which node, modulo the number of connected ones.
        pick: u8,
    },
    /// Set what group `group` does with paused machines (a new generation,
    /// same templates): wait `wait_s` seconds for one to resume, or (with
    /// `None`) replace its node at its grace's end.
    PreemptPolicy {
        /// Which group (0 or 1).
        group: u8,
        /// Seconds to wait, if it waits.
        wait_s: Option<u8>,
    },
    /// The host is shut down: leaving every node running for the next host
    /// (`keep`), which starts at once, or tearing everything down, after
    /// which a new host starts with the current shape as its next generation.
    Shutdown {
        /// Leave the nodes running.
        keep: bool,
    },
}

/// A generated trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The delivery mode.
    pub mode: Mode,
    /// Seed of the executor's random delays.
    pub seed: u64,
    /// The inputs, in order.
    pub inputs: Vec<Input>,
}

fn effect_kind() -> impl Strategy<Value = EffectKind> {
    prop_oneof![
        Just(EffectKind::CreateLease),
        Just(EffectKind::LookupEndpoint),
        Just(EffectKind::StartBootstrap),
        Just(EffectKind::CancelBootstrap),
        Just(EffectKind::DestroyLease),
    ]
}

fn failure_stage() -> impl Strategy<Value = BootstrapStage> {
    prop_oneof![
        Just(BootstrapStage::SshConnectFailed),
        Just(BootstrapStage::BootCheckFailed),
        Just(BootstrapStage::SwactorStartFailed),
        Just(BootstrapStage::JoinFailed),
        Just(BootstrapStage::AgentLost),
    ]
}

/// Longest extra delay a generated late completion or delayed delivery uses;
/// the fair-tail bound accounts for it.
pub const LATE_EXTRA_MAX_MS: u64 = 3_000;

fn provider_fault() -> impl Strategy<Value = ProviderFaultInput> {
    prop_oneof![
        3 => effect_kind().prop_map(ProviderFaultInput::Refuse),
        1 => Just(ProviderFaultInput::EndpointNeverReady),
        1 => (1u16..3_000).prop_map(ProviderFaultInput::EndpointSlow),
        3 => failure_stage().prop_map(ProviderFaultInput::BootstrapFailsAt),
        1 => (1u8..=127).prop_map(ProviderFaultInput::LoseObservations),
        1 => Just(ProviderFaultInput::CloseAfterConverge),
        1 => (1u16..5_000).prop_map(ProviderFaultInput::Invisible),
    ]
}

fn delivery_fault(mode: Mode) -> BoxedStrategy<DeliveryFault> {
    let late =
        (1..LATE_EXTRA_MAX_MS).prop_map(|extra_ms| DeliveryFault::LateCompletion { extra_ms });
    let base = prop_oneof![
        2 => Just(DeliveryFault::LoseResult),
        2 => Just(DeliveryFault::AmbiguousWithEffect),
        1 => Just(DeliveryFault::AmbiguousWithoutEffect),
        1 => late,
    ];
    match mode {
        // In-order delivery keeps results in order: no duplicates, no extra delays.
        Mode::InOrder => base.boxed(),
        Mode::Adversarial => prop_oneof![
            6 => base,
            2 => Just(DeliveryFault::Duplicate),
            2 => (1..LATE_EXTRA_MAX_MS).prop_map(|extra_ms| DeliveryFault::Delay { extra_ms }),
        ]
        .boxed(),
    }
}

/// One input, weighted so that time passes often and faults are common but not dominant.
pub fn input(mode: Mode) -> BoxedStrategy<Input> {
    // In-order delivery never resubmits old operations (a replay is a
    // duplicate, which belongs to the adversarial mode); proptest refuses a
    // zero weight, so the in-order alphabet names an inert stand-in instead.
    let resubmit_old = match mode {
        Mode::InOrder => Just(Input::Tick).boxed(),
        Mode::Adversarial => any::<u8>()
            .prop_map(|pick| Input::ResubmitOld { pick })
            .boxed(),
    };
    prop_oneof![
        6 => (0u8..2, 0u8..=3, 0u8..3, 0u8..2)
            .prop_map(|(group, count, variant, skip)| Input::Shape { group, count, variant, skip }),
        1 => Just(Input::Resubmit),
        2 => prop_oneof![
            Just(InvalidUpdate::GenerationRegression),
            Just(InvalidUpdate::SameGenerationChange),
            Just(InvalidUpdate::WrongRun),
            Just(InvalidUpdate::Malformed),
            Just(InvalidUpdate::OverCapacity),
        ]
        .prop_map(Input::Invalid),
        14 => (1u32..4_000).prop_map(|ms| Input::Advance { ms }),
        12 => Just(Input::Step),
        2 => Just(Input::Tick),
        2 => (1u32..6_000).prop_map(|ms| Input::HostPause { ms }),
        1 => Just(Input::LoseTimerOnce),
        6 => provider_fault().prop_map(Input::Provider),
        6 => (proptest::option::weighted(0.8, effect_kind()), delivery_fault(mode))
            .prop_map(|(kind, fault)| Input::Delivery { kind, fault }),
        2 => (0u8..3, any::<bool>()).prop_map(|(keep, report)| Input::AbortNextPass { keep, report }),
        2 => any::<u8>().prop_map(|pick| Input::DeleteOutOfBand { pick }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(pick, stale)| Input::AgentLost { pick, stale }),
        2 => resubmit_old,
        2 => (any::<bool>(), 0u16..8_000)
            .prop_map(|(at_persist, down_ms)| Input::HostCrash { at_persist, down_ms }),
        1 => any::<bool>().prop_map(|keep| Input::Shutdown { keep }),
        // Pauses outnumber resumes so that paused stretches span many steps.
        2 => Just(Input::Pause),
        1 => Just(Input::Resume),
        3 => (0u8..2, 0u8..6, proptest::option::weighted(0.7, 0u8..3)).prop_map(
            |(group, max_unavailable, max_unhealthy)| Input::Budget { group, max_unavailable, max_unhealthy }
        ),
        2 => (0u8..2, 1u8..=3).prop_map(|(group, count)| Input::MassAgentLoss { group, count }),
        1 => Just(Input::AgentsReturn),
        2 => any::<u8>().prop_map(|pick| Input::Preempt { pick }),
        2 => (0u8..2, proptest::option::weighted(0.8, 1u8..30))
            .prop_map(|(group, wait_s)| Input::PreemptPolicy { group, wait_s }),
    ]
    .boxed()
}

/// Shortest and longest generated faulty prefix, in inputs.
pub const TRACE_LEN: (usize, usize) = (8, 48);

/// A whole trace for `mode`.
pub fn trace(mode: Mode) -> impl Strategy<Value = Trace> {
    (
        any::<u64>(),
        proptest::collection::vec(input(mode), TRACE_LEN.0..=TRACE_LEN.1),
    )
        .prop_map(move |(seed, inputs)| Trace { mode, seed, inputs })
}

/// A host crash (killed at once or at its next journal write) on either
/// side of a lease of `lease_ms`: back within half of it, so every agent it
/// was linked to is renewed in time by the next host, or down for longer
/// than all of it, so every one of them ends its node meanwhile.
///
/// These are [`Input::HostCrash`]es: a new input kind would be one more arm
/// in every exhaustive match over [`Input`], the actor harness's included.
pub fn crash_around(lease_ms: u64) -> BoxedStrategy<Input> {
    let ms = |v: u64| u16::try_from(v).unwrap_or(u16::MAX);
    let within = ms(lease_ms / 4)..ms(lease_ms / 2);
    let beyond = ms(lease_ms + 1)..ms(lease_ms * 2);
    let crash = |down: std::ops::Range<u16>| {
        (any::<bool>(), down).prop_map(|(at_persist, down_ms)| Input::HostCrash {
            at_persist,
            down_ms,
        })
    };
    prop_oneof![crash(within), crash(beyond)].boxed()
}

/// A whole trace for `mode` in a world whose leases last `lease_ms`: the
/// alphabet of [`input`], with host crashes on both sides of the lease
/// ([`crash_around`]) about one input in thirteen.
pub fn lease_trace(mode: Mode, lease_ms: u64) -> impl Strategy<Value = Trace> {
    let input = prop_oneof![12 => input(mode), 1 => crash_around(lease_ms)];
    (
        any::<u64>(),
        proptest::collection::vec(input, TRACE_LEN.0..=TRACE_LEN.1),
    )
        .prop_map(move |(seed, inputs)| Trace { mode, seed, inputs })
}
