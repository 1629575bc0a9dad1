//! Agents' leases (issue 32): what a daemon back within an agent's lease,
//! or after it, finds and makes; and that the lease battery exercises both.

use swactor_conformance::battery::{Suite, suite_trace_for_seed};
use swactor_conformance::{
    FakeExecutor, Input, Invariant, Mode, SHORT_LEASE_S, World, WorldConfig, run_trace,
};
use swactor_provisioning::{Link, LogicalNodeId};

const LEASE_MS: u64 = SHORT_LEASE_S as u64 * 1_000;

/// A world of three nodes whose agents hold short leases, converged.
fn converged() -> World {
    let mut world = World::new(WorldConfig::with_short_leases(Mode::InOrder), 7);
    world.apply(&Input::Advance { ms: 15_000 });
    assert_clean(&world);
    assert!(world.host().is_converged(), "the first shape converges");
    world
}

fn assert_clean(world: &World) {
    let v: Vec<String> = world
        .oracle()
        .violations()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(v.is_empty(), "{}", v.join("\n"));
}

fn leases_made(exec: &FakeExecutor) -> u64 {
    exec.backend().counters().leases_created
}

fn linked(world: &World) -> Vec<LogicalNodeId> {
    let state = world.sut().state();
    state
        .nodes
        .iter()
        .filter(|(id, n)| world.host().link(id) == Some(Link::Connected(n.attempt)))
        .map(|(id, _)| *id)
        .collect()
}

#[test]
fn agents_linked_to_a_running_daemon_keep_their_nodes_for_many_leases() {
    let mut world = converged();
    let made = leases_made(world.executor());
    world.apply(&Input::Advance {
        ms: 5 * LEASE_MS as u32,
    });
    assert_clean(&world);
    assert_eq!(world.leases().stats().lapses, 0);
    assert!(
        world.leases().stats().renewals >= 3 * 5 * 4,
        "renewed all along"
    );
    assert_eq!(leases_made(world.executor()), made);
    assert_eq!(linked(&world).len(), 3);
}

#[test]
fn a_daemon_back_within_the_lease_adopts_every_node_and_makes_nothing_new() {
    let mut world = converged();
    let made = leases_made(world.executor());
    world.apply(&Input::HostCrash {
        at_persist: false,
        down_ms: (LEASE_MS / 2) as u16,
    });
    let tail = world.run_fair_tail();
    assert_clean(&world);
    assert!(tail.converged);
    let stats = world.leases().stats();
    assert_eq!(
        (stats.comebacks, stats.kept_adopted, stats.lapses),
        (1, 3, 0)
    );
    assert_eq!(leases_made(world.executor()), made, "nothing new was made");
    assert_eq!(linked(&world).len(), 3, "every agent is linked again");
}

#[test]
fn a_daemon_back_after_the_lease_finds_its_nodes_gone_and_makes_each_once_more() {
    let mut world = converged();
    let made = leases_made(world.executor());
    world.apply(&Input::HostCrash {
        at_persist: false,
        down_ms: (LEASE_MS + LEASE_MS / 2) as u16,
    });
    let tail = world.run_fair_tail();
    assert_clean(&world);
    assert!(tail.converged);
    let stats = world.leases().stats();
    assert_eq!(
        (stats.comebacks, stats.kept_lapsed, stats.lapses),
        (1, 3, 3)
    );
    assert_eq!(
        leases_made(world.executor()),
        made + 3,
        "one machine per slot"
    );
    assert_eq!(
        world.executor().backend().counters().out_of_band_deletions,
        3
    );
}

#[test]
fn a_host_paused_past_the_lease_loses_its_nodes_and_replaces_each_once() {
    let mut world = converged();
    let made = leases_made(world.executor());
    world.apply(&Input::HostPause {
        ms: (LEASE_MS + 1_000) as u32,
    });
    let tail = world.run_fair_tail();
    assert_clean(&world);
    assert!(tail.converged);
    assert_eq!(world.leases().stats().lapses, 3);
    assert_eq!(leases_made(world.executor()), made + 3);
}

#[test]
fn an_agent_cut_off_ends_its_node_a_lease_after_its_last_renewal() {
    let mut world = converged();
    world.apply(&Input::AgentLost {
        pick: 0,
        stale: false,
    });
    // The host replaces the node after the agent's grace and destroys its
    // machine long before the lease runs out: nothing lapses.
    world.apply(&Input::Advance {
        ms: 2 * LEASE_MS as u32,
    });
    assert_clean(&world);
    assert_eq!(world.leases().stats().lapses, 0);
}

#[test]
fn the_lease_battery_exercises_both_sides_of_the_lease() {
    let mut total = swactor_conformance::LeaseStats::default();
    for mode in Mode::ALL {
        for seed in 0..32 {
            let trace = suite_trace_for_seed(Suite::Leases, mode, seed);
            let report = run_trace(&Suite::Leases.world(mode), &trace);
            assert!(report.violations.is_empty(), "{}", report.violations[0]);
            total.lapses += report.leases.lapses;
            total.comebacks += report.leases.comebacks;
            total.kept_adopted += report.leases.kept_adopted;
            total.kept_lapsed += report.leases.kept_lapsed;
        }
    }
    assert!(total.comebacks >= 10, "{total:?}");
    assert!(total.kept_adopted >= 10, "{total:?}");
    assert!(total.kept_lapsed >= 10, "{total:?}");
    assert!(total.lapses >= total.kept_lapsed, "{total:?}");
}

#[test]
fn the_default_battery_never_lets_a_lease_lapse() {
    // Hour-long leases: its traces run exactly as before leases existed.
    for mode in Mode::ALL {
        for seed in 0..16 {
            let trace = suite_trace_for_seed(Suite::Base, mode, seed);
            let report = run_trace(&Suite::Base.world(mode), &trace);
            assert_eq!(report.leases.lapses, 0, "{} seed {seed}", mode.name());
        }
    }
}

#[test]
fn invariant_names_are_unique() {
    let mut names: Vec<&str> = Invariant::ALL.iter().map(|i| i.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Invariant::ALL.len());
}

/// A host bug the comeback guarantee found (lease suite, adversarial seed
/// 5810 of a long run; this is its shrunk trace): a restarted host adopts a
/// ready node and re-attaches to its session; the session's replayed log
/// and the StartBootstrap result reach it in one batch, and the line that
/// came before the result (kept, and handed back to the core once the
/// result is in) is folded after the later ones. The stream's last stage
/// goes back from Converged to SshConnect, the node waits for a Converged
/// that already came, stalls, and is replaced although its agent is alive
/// and joined. Only a batching host (adversarial mode) meets it. Fixed:
/// a report of a node whose earlier reports still wait is queued behind
/// them (`DiscardReason::Queued`) and folded in order.
#[test]
fn a_node_whose_replayed_log_arrives_with_its_start_result_is_kept() {
    use swactor_conformance::trace::Trace;
    let inputs = vec![
        Input::HostPause { ms: 1456 },
        Input::HostCrash {
            at_persist: true,
            down_ms: 5000,
        },
        Input::Shape {
            group: 0,
            count: 0,
            variant: 0,
            skip: 0,
        },
        Input::Shutdown { keep: false },
        Input::Advance { ms: 838 },
        Input::Advance { ms: 330 },
        Input::Advance { ms: 824 },
        Input::Step,
        Input::Shape {
            group: 1,
            count: 0,
            variant: 0,
            skip: 0,
        },
        Input::Shape {
            group: 0,
            count: 1,
            variant: 1,
            skip: 0,
        },
        Input::Advance { ms: 2564 },
        Input::Advance { ms: 3527 },
        Input::HostCrash {
            at_persist: false,
            down_ms: 0,
        },
        Input::Advance { ms: 324 },
        Input::Step,
        Input::HostPause { ms: 577 },
    ];
    let trace = Trace {
        mode: Mode::Adversarial,
        seed: 10_702_845_821_286_116_433,
        inputs,
    };
    let report = run_trace(&WorldConfig::for_mode(Mode::Adversarial), &trace);
    assert!(report.violations.is_empty(), "{}", report.violations[0]);
}
