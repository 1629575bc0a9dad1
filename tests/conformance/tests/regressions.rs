//! Known bugs from the wild, each a named scenario over the fake provider, plus fault-coverage scenarios.
//!
//! Over 1,000 lines in one file: one named scenario per known bug, each
//! short, sharing the same few helpers.

use swactor_conformance::{
    DeliveryFault, FakeExecutor, Input, Invariant, Mode, ProviderFault, World, WorldConfig,
};
use swactor_provisioning::{
    BootstrapStage, Driver, EffectKind, FailureClass, GroupShape, Intent, LogicalNodeId,
    OperationOutcome, OperationResult, ReconcilerConfig, RunId, Timestamp,
};

/// A world with nothing desired yet, so faults can be armed before the first dispatch.
fn empty_world(tweak: impl FnOnce(&mut WorldConfig)) -> World {
    let mut config = WorldConfig::for_mode(Mode::InOrder);
    config.initial = [(0, 0), (0, 0)];
    tweak(&mut config);
    World::new(config, 7)
}

fn scale(world: &mut World, count: u8) {
    world.apply(&Input::Shape {
        group: 0,
        count,
        variant: 0,
        skip: 0,
    });
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

fn converge(world: &mut World) {
    let tail = world.run_fair_tail();
    assert_clean(world);
    assert!(tail.converged, "{tail:?}");
}

fn slot0() -> LogicalNodeId {
    LogicalNodeId::parse("alpha-0").expect("valid id")
}

fn attempts_of(exec: &FakeExecutor, node: &LogicalNodeId) -> usize {
    exec.backend()
        .keys()
        .keys()
        .filter(|k| k.node == *node)
        .count()
}

/// cluster-api-provider-aws#5794: the controller crashed or timed out after
/// RunInstances but before it saved the instance id, and the next reconcile
/// launched a second instance. Here the create's effect happens and its result
/// is lost (then, in a second run, reported as an ambiguous timeout); the
/// driver re-issues the same create under the same key and adopts.
#[test]
fn a_crash_or_timeout_after_a_create_leaves_no_extra_instance() {
    for fault in [
        DeliveryFault::LoseResult,
        DeliveryFault::AmbiguousWithEffect,
    ] {
        let mut world = empty_world(|_| {});
        world
            .executor_mut()
            .arm(Some(EffectKind::CreateLease), fault.clone());
        scale(&mut world, 1);
        converge(&mut world);
        let c = world.executor().backend().counters();
        assert_eq!(c.leases_created, 1, "{fault:?}: {c:?}");
        assert!(
            c.create_lease_calls >= 2,
            "{fault:?}: the create was re-issued: {c:?}"
        );
        assert_eq!(
            attempts_of(world.executor(), &slot0()),
            1,
            "{fault:?}: no replacement was needed"
        );
    }
}

/// kubermatic machine-controller#886: a freshly created machine was not yet
/// visible to the provider's list call, so the controller created another.
/// The kit's model: a new lease shows up in list-by-key lookups only after a
/// lag (here 20 s, longer than the create timeout plus backoff), and the
/// create call carries the resource key as an idempotency token. The lost
/// first result forces a re-issue while the lease is still invisible; the
/// token must make it adopt.
#[test]
fn a_create_not_yet_visible_to_a_lookup_is_not_created_again() {
    let mut world = empty_world(|c| c.backend.visibility_lag_ms = 20_000);
    world
        .executor_mut()
        .arm(Some(EffectKind::CreateLease), DeliveryFault::LoseResult);
    scale(&mut world, 1);
    converge(&mut world);
    assert_eq!(world.executor().stats().results_lost, 1, "the fault fired");
    let c = world.executor().backend().counters();
    assert_eq!(c.leases_created, 1, "{c:?}");
    assert!(
        c.adopted_by_token >= 1,
        "the re-issue adopted through the token: {c:?}"
    );
}

/// The negative control of the test above: a provider with no idempotency
/// token double-creates under eventual visibility, and the oracle says so.
/// Without this, the test above could pass for the wrong reason.
#[test]
fn without_an_idempotency_token_the_invisible_create_is_caught_as_a_double_create() {
    let mut world = empty_world(|c| {
        c.backend.visibility_lag_ms = 20_000;
        c.backend.idempotent_create = false;
    });
    world
        .executor_mut()
        .arm(Some(EffectKind::CreateLease), DeliveryFault::LoseResult);
    scale(&mut world, 1);
    world.run_fair_tail();
    let caught = world
        .oracle()
        .violations()
        .iter()
        .any(|v| v.invariant == Invariant::NoDoubleCreate);
    assert!(caught, "{:?}", world.oracle().violations());
}

/// cluster-api-provider-aws#1368: an instance terminated outside the
/// controller was recreated over and over. Here the machine of a converged
/// node is deleted out of band; its open bootstrap stream reports the agent
/// lost; the slot is replaced exactly once and then stays quiet.
#[test]
fn a_machine_deleted_out_of_band_is_replaced_once_not_in_a_loop() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 1);
    converge(&mut world);
    world.apply(&Input::DeleteOutOfBand { pick: 0 });
    world.apply(&Input::Advance { ms: 1_000 });
    converge(&mut world);
    // A long quiet stretch: nothing more is created.
    world.apply(&Input::Advance { ms: 600_000 });
    assert_clean(&world);
    let c = world.executor().backend().counters();
    assert_eq!(c.out_of_band_deletions, 1);
    assert_eq!(c.leases_created, 2, "exactly one replacement: {c:?}");
    assert_eq!(attempts_of(world.executor(), &slot0()), 2);
    assert!(world.sut().is_converged());
}

/// A DestroyLease whose success was lost must not leave the node stuck in
/// Deleting: the expired operation is retried, "already absent" is success,
/// and the node is marked destroyed and reaped.
#[test]
fn a_destroy_whose_success_was_lost_does_not_leave_the_node_stuck_deleting() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 1);
    converge(&mut world);
    world
        .executor_mut()
        .arm(Some(EffectKind::DestroyLease), DeliveryFault::LoseResult);
    scale(&mut world, 0);
    // Faults stop when the fair tail starts; let the destroy run (and its
    // result get lost) before that.
    world.apply(&Input::Advance { ms: 10_000 });
    converge(&mut world);
    assert!(world.sut().state().nodes.is_empty());
    assert_eq!(world.executor().stats().results_lost, 1, "the fault fired");
    assert_eq!(world.sut().stats().expired, 1, "the lost destroy expired");
    let c = world.executor().backend().counters();
    assert_eq!(c.destroys, 2, "one lost, one already-absent success: {c:?}");
    assert_eq!(world.executor().backend().live_resources().count(), 0);
}

/// Every failure stage of a bootstrap ends the attempt and the slot is
/// replaced once; the failure count carries into the replacement and resets
/// when it becomes ready (the oracle checks both on every step).
#[test]
fn a_bootstrap_failing_at_each_failure_stage_is_replaced_once() {
    for stage in [
        BootstrapStage::SshConnectFailed,
        BootstrapStage::BootCheckFailed,
        BootstrapStage::SwactorStartFailed,
        BootstrapStage::JoinFailed,
        BootstrapStage::AgentLost,
    ] {
        let mut world = empty_world(|_| {});
        world
            .executor_mut()
            .backend_mut()
            .arm(ProviderFault::BootstrapFailsAt { stage });
        scale(&mut world, 1);
        // Let the failing script run out, then converge.
        world.apply(&Input::Advance { ms: 5_000 });
        converge(&mut world);
        let c = world.executor().backend().counters();
        assert_eq!(c.sessions_started, 2, "{stage:?}: {c:?}");
        assert_eq!(attempts_of(world.executor(), &slot0()), 2, "{stage:?}");
    }
}

/// Lost bootstrap observations (here the Converged fact) end in the stall
/// deadline, AgentLost, and one replacement.
#[test]
fn a_bootstrap_whose_converged_observation_is_lost_is_replaced_after_the_stall_deadline() {
    let mut world = empty_world(|_| {});
    world
        .executor_mut()
        .backend_mut()
        .arm(ProviderFault::LoseObservations { mask: 1 << 5 });
    scale(&mut world, 1);
    world.apply(&Input::Advance { ms: 12_000 });
    converge(&mut world);
    assert_eq!(attempts_of(world.executor(), &slot0()), 2);
}

/// An endpoint that never becomes ready is probed at the probe interval,
/// never counted as a failure and never spun on, until its group's
/// readiness deadline: then the attempt fails and the machine is replaced
/// (a rented instance stuck loading is not paid for forever).
#[test]
fn an_endpoint_that_never_becomes_ready_is_probed_until_its_deadline_then_replaced() {
    let mut world = empty_world(|_| {});
    world
        .executor_mut()
        .backend_mut()
        .arm(ProviderFault::EndpointNeverReady);
    scale(&mut world, 1);
    world.apply(&Input::Advance { ms: 60_000 });
    assert_clean(&world);
    let node = &world.sut().state().nodes[&slot0()];
    assert_eq!(node.retry.consecutive_failures, 0);
    assert!(!world.sut().is_converged());
    let lookups = world.executor().backend().counters().lookups;
    let probe = world.config().reconciler.probe_interval_ms;
    // One probe per interval plus its round trip, give or take one.
    let per_probe = probe + world.config().executor.round_trip_max_ms();
    assert!(
        lookups >= 60_000 / per_probe - 1 && lookups <= 60_000 / probe + 1,
        "{lookups} lookups"
    );
    assert_eq!(attempts_of(world.executor(), &slot0()), 1);
    // Past the group's deadline (900 s by default) the attempt is replaced;
    // the fault was one-shot, so the replacement converges.
    world.apply(&Input::Advance { ms: 900_000 });
    converge(&mut world);
    assert_eq!(attempts_of(world.executor(), &slot0()), 2);
    let c = world.executor().backend().counters();
    assert_eq!(c.leases_created, 2, "{c:?}");
    assert_eq!(
        world.executor().backend().live_resources().count(),
        2,
        "lease and session"
    );
}

/// Scale a slot away while its StartBootstrap (or LookupEndpoint) is in
/// flight, and let that operation fail: the cleanup it interrupted starts at
/// once. (The core used to fold the failure with a backoff that held the
/// DestroyLease back.)
#[test]
fn a_slot_scaled_away_while_an_operation_is_in_flight_starts_its_cleanup_at_once() {
    for kind in [EffectKind::LookupEndpoint, EffectKind::StartBootstrap] {
        let mut world = empty_world(|c| c.backend.endpoint_delay_ms = 1_000);
        world
            .executor_mut()
            .backend_mut()
            .arm(ProviderFault::Refuse { kind });
        scale(&mut world, 1);
        // Run until the operation is in flight, then scale the slot away.
        for _ in 0..200 {
            let pending = world.sut().state().nodes[&slot0()]
                .pending
                .as_ref()
                .map(|p| p.effect);
            if pending == Some(kind) {
                break;
            }
            world.apply(&Input::Step);
        }
        scale(&mut world, 0);
        // Its refusal comes back one round trip later; the destroy follows in
        // the same instant, not a backoff later.
        world.apply(&Input::Advance { ms: 200 });
        assert_clean(&world);
        let n = world.sut().state().nodes.get(&slot0());
        assert!(
            n.is_none_or(|n| n.retry.next_effect_at.is_none()),
            "{kind:?}: cleanup held back: {n:?}"
        );
        assert_eq!(
            world.executor().backend().counters().destroys,
            1,
            "{kind:?}: the lease was destroyed within one round trip"
        );
        converge(&mut world);
    }
}

/// Observations of a session that arrive before its StartBootstrap result
/// are kept and folded once the result arrives: the node becomes ready one
/// round trip later, instead of waiting out the stall deadline.
#[test]
fn observations_that_overtake_their_start_result_cost_no_stall() {
    let mut world = empty_world(|_| {});
    world.executor_mut().arm(
        Some(EffectKind::StartBootstrap),
        DeliveryFault::Delay { extra_ms: 2_000 },
    );
    scale(&mut world, 1);
    world.apply(&Input::Advance { ms: 3_500 });
    assert_clean(&world);
    assert!(
        world.sut().is_converged(),
        "ready within the delayed result's round trip: {:?}",
        world.sut().state().nodes[&slot0()].record
    );
    let stall = world.config().reconciler.bootstrap_stall_ms;
    assert!(world.now().0 < stall, "no stall deadline was waited out");
    assert_eq!(attempts_of(world.executor(), &slot0()), 1);
}

/// A lease that vanishes before its bootstrap starts (deleted out of band,
/// expired) fails the attempt when the provider says it is gone, and the slot
/// is replaced; nothing probes it forever.
#[test]
fn a_lease_gone_before_its_bootstrap_fails_the_attempt_and_is_replaced() {
    let mut world = empty_world(|c| c.backend.endpoint_delay_ms = 2_000);
    scale(&mut world, 1);
    world.apply(&Input::Advance { ms: 200 });
    let lease = world.sut().state().nodes[&slot0()]
        .record
        .lease
        .clone()
        .expect("the lease was made");
    let now = world.now();
    assert!(
        world
            .executor_mut()
            .backend_mut()
            .delete_out_of_band(&lease, now)
    );
    world.apply(&Input::Advance { ms: 5_000 });
    converge(&mut world);
    assert_eq!(attempts_of(world.executor(), &slot0()), 2);
    let c = world.executor().backend().counters();
    assert_eq!(c.leases_created, 2, "{c:?}");
}

/// A host killed at any moment (here: while it hands out its first journal
/// write, then again mid-convergence) is replaced by one that resumes from
/// the journal and the provider's inventory: nothing is made twice, nothing
/// is leaked, and every acknowledged shape survives.
#[test]
fn hosts_killed_mid_convergence_resume_without_making_anything_twice() {
    for down_ms in [0, 3_000] {
        let mut world = empty_world(|_| {});
        world.apply(&Input::HostCrash {
            at_persist: true,
            down_ms,
        });
        // Killed before this apply was durable: it was never acknowledged,
        // and the next host does not know of it. The user applies it again.
        scale(&mut world, 3);
        assert_eq!(world.sut().desired().node_count(), 0);
        scale(&mut world, 3);
        world.apply(&Input::Advance { ms: 300 });
        world.apply(&Input::HostCrash {
            at_persist: false,
            down_ms,
        });
        world.apply(&Input::Advance { ms: 700 });
        world.apply(&Input::HostCrash {
            at_persist: false,
            down_ms,
        });
        converge(&mut world);
        assert!(world.restarts() >= 3, "{}", world.restarts());
        for (key, stats) in world.executor().backend().keys() {
            assert!(stats.leases_created <= 1, "{key}: {stats:?}");
        }
        assert_eq!(world.sut().state().nodes.len(), 3);
    }
}

/// `down --keep`, then `up`: the next host adopts every node as it is and
/// makes nothing; its agents must rejoin it before their nodes are ready again.
#[test]
fn a_kept_cluster_is_resumed_without_creating_anything() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 2);
    converge(&mut world);
    let before = world.executor().backend().counters();
    world.apply(&Input::Shutdown { keep: true });
    converge(&mut world);
    let after = world.executor().backend().counters();
    assert_eq!(after.leases_created, before.leases_created);
    assert_eq!(after.sessions_started, before.sessions_started);
    assert_eq!(world.restarts(), 1);
}

/// `down --keep`, then `up changed.toml`: the kept nodes were made from the
/// old template, so the new host replaces them (after adopting them, so
/// nothing is leaked), exactly once each.
#[test]
fn a_kept_cluster_resumed_with_a_changed_template_replaces_every_node_once() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 2);
    converge(&mut world);
    world.restart_with([(2, 1), (0, 0)]);
    converge(&mut world);
    for node in ["alpha-0", "alpha-1"] {
        let id = LogicalNodeId::parse(node).expect("valid id");
        assert_eq!(attempts_of(world.executor(), &id), 2, "{node}");
    }
    let c = world.executor().backend().counters();
    assert_eq!(c.leases_created, 4, "{c:?}");
}

/// A host killed after it recorded its creates but before they were made,
/// restarted with a shape that no longer wants those attempts (their
/// template changed, or their slots were scaled away): the attempts are
/// neither listed nor known to be made, and there is no template left to
/// make them from. They must not be created again to find out (found by the
/// docker battery: the re-issued create named no provider and failed
/// forever, so the cluster never converged); an attempt made after all is
/// an orphan for the sweep.
#[test]
fn creates_cut_short_by_a_crash_and_no_longer_wanted_are_not_made_to_be_destroyed() {
    for (groups, nodes) in [
        ([(2, 1), (0, 0)], 2),
        ([(1, 0), (0, 0)], 1),
        ([(0, 0), (1, 0)], 1),
    ] {
        let mut world = empty_world(|_| {});
        scale(&mut world, 3);
        // The creates are recorded and dispatched, none is done yet.
        world.apply(&Input::Advance { ms: 10 });
        world.crash_and_restart_with(groups, 500);
        converge(&mut world);
        assert_eq!(world.sut().state().nodes.len(), nodes, "{groups:?}");
        for (key, stats) in world.executor().backend().keys() {
            assert!(stats.leases_created <= 1, "{groups:?} {key}: {stats:?}");
        }
    }
}

/// A teardown asked for and then interrupted by a crash is finished by the
/// next host; nothing is left at the provider.
#[test]
fn a_teardown_interrupted_by_a_crash_leaves_nothing_behind() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    world.apply(&Input::Shutdown { keep: false });
    world.apply(&Input::HostCrash {
        at_persist: false,
        down_ms: 1_000,
    });
    assert!(
        world.host().journal_meta().tearing_down,
        "the new host knows a teardown was asked for"
    );
    let left = world.finish_teardown();
    assert_clean(&world);
    assert_eq!(left, Some(0), "nothing is left when the teardown ends");
}

/// Sliding-window maximum: the most retries in any `window_ms` window.
fn busiest_window(times: &mut [u64], window_ms: u64) -> usize {
    times.sort_unstable();
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= window_ms {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

/// Drives `n` nodes of one group through CreateLease failures: each wave, every
/// node fails at the same instant; returns, per wave, the retry instants
/// relative to that instant.
fn failing_waves(config: ReconcilerConfig, n: u32, waves: usize) -> Vec<Vec<u64>> {
    let mut driver = Driver::new(RunId::new("jitter"), config).expect("valid config");
    let mut group = swactor_conformance::shape_of(1, &[(1, 0), (0, 0)]).groups[0].clone();
    group = GroupShape { count: n, ..group };
    let mut shape = swactor_conformance::shape_of(1, &[(0, 0), (0, 0)]);
    shape.run_id = RunId::new("jitter");
    shape.groups = vec![group];
    driver.update_desired(&shape).expect("valid shape");
    let mut now = Timestamp(0);
    let mut pending = Vec::new();
    let drain = |driver: &mut Driver, now: Timestamp, pending: &mut Vec<OperationResult>| {
        while let Some(pass) = driver.poll_pass(now).expect("no re-entry") {
            for d in pass.dispatches {
                pending.push(OperationResult {
                    node: d.key.node,
                    op: d.op,
                    outcome: OperationOutcome::Failed {
                        class: FailureClass::Definite,
                        reason: "capacity exhausted".to_owned(),
                    },
                });
            }
            driver.finish_pass().expect("running");
        }
    };
    drain(&mut driver, now, &mut pending);
    assert_eq!(pending.len(), n as usize);
    let mut out = Vec::new();
    for _ in 0..waves {
        // Everyone fails together, at `now`.
        let failed_at = now;
        for r in pending.drain(..) {
            let _ = driver.handle_result(r, now).expect("folds");
        }
        drain(&mut driver, now, &mut pending);
        let mut retries = Vec::new();
        while retries.len() < n as usize {
            now = driver
                .poll_timeout()
                .expect("every node waits on its backoff");
            driver.handle_tick(now);
            let before = pending.len();
            drain(&mut driver, now, &mut pending);
            retries.extend(std::iter::repeat_n(
                now.0 - failed_at.0,
                pending.len() - before,
            ));
        }
        out.push(retries);
    }
    out
}

/// 1,000 nodes failing together must not retry in one burst: no more than 5 %
/// of them in any 100 ms window.
///
/// The core's jitter window is `d * jitter_permille / 1000` wide (placed as
/// high as the cap allows, never below the base), where `d` is the
/// un-jittered delay. 1,000 retries spread uniformly over a window `W` put
/// about `100_000 / W` of them in 100 ms, so the 5 % bound needs `W` well above
/// 2 s. With the production default (base 1 s, jitter 500 ‰) the first three
/// waves are narrower than that (0.5 s, 1 s, 2 s) and DO burst; this test
/// asserts that honestly, then checks the waves where the bound is reachable:
/// the fourth failure (d = 8 s, W = 4 s) and later with the default jitter,
/// and the third failure (d = 4 s, W = 4 s) with jitter 1000 ‰.
#[test]
fn a_thousand_nodes_failing_together_retry_spread_out_by_jitter() {
    let limit = 1_000 * 5 / 100;
    let default = ReconcilerConfig::default();
    let waves = failing_waves(default.clone(), 1_000, 6);
    let busiest: Vec<usize> = waves
        .iter()
        .map(|w| busiest_window(&mut w.clone(), 100))
        .collect();
    // Every retry of wave k lies in its jitter window.
    for (k, w) in waves.iter().enumerate() {
        let (lo, hi) = swactor_conformance::backoff_window(&default, k as u32 + 1);
        assert!(
            w.iter().all(|d| (lo..=hi).contains(d)),
            "wave {}: outside [{lo}, {hi}]",
            k + 1
        );
    }
    assert!(
        busiest[0] > limit,
        "the first wave is a known burst: {busiest:?}"
    );
    for (k, b) in busiest.iter().enumerate().skip(3) {
        assert!(
            *b <= limit,
            "wave {} (default jitter): {b} retries in 100 ms; {busiest:?}",
            k + 1
        );
    }
    let full = ReconcilerConfig {
        jitter_permille: 1_000,
        ..ReconcilerConfig::default()
    };
    let waves = failing_waves(full, 1_000, 3);
    let b = busiest_window(&mut waves[2].clone(), 100);
    assert!(b <= limit, "wave 3 (jitter 1000): {b} retries in 100 ms");
}

/// Issue 11: fixing a broken template left its nodes waiting out the backoff
/// the broken one had earned (up to a minute). A slot that wants another
/// template restarts at once.
#[test]
fn a_fixed_template_restarts_at_once_instead_of_waiting_out_the_old_backoff() {
    let mut world = empty_world(|_| {});
    for _ in 0..5 {
        world
            .executor_mut()
            .backend_mut()
            .arm(ProviderFault::BootstrapFailsAt {
                stage: BootstrapStage::BootCheckFailed,
            });
    }
    scale(&mut world, 1);
    // Let it fail until its restart waits out a long backoff.
    let mut waiting = None;
    for _ in 0..400 {
        world.apply(&Input::Advance { ms: 500 });
        let node = world.host().core().state().nodes.get(&slot0()).cloned();
        let now = world.now();
        if let Some(at) = node.and_then(|n| n.record.restart_at)
            && at.saturating_since(now) >= 4_000
        {
            waiting = Some(at);
            break;
        }
    }
    let restart_at = waiting.expect("a restart waits out a backoff of at least 4 s");
    let before = attempts_of(world.executor(), &slot0());
    world.heal();
    world.apply(&Input::Shape {
        group: 0,
        count: 1,
        variant: 1,
        skip: 0,
    });
    world.apply(&Input::Advance { ms: 1_000 });
    assert!(world.now() < restart_at);
    assert_eq!(
        attempts_of(world.executor(), &slot0()),
        before + 1,
        "the new template's attempt started before the old backoff ran out"
    );
    converge(&mut world);
}

/// `swactor pause` mid-convergence, then a scale-up, a lost agent and a
/// daemon killed with -9, all while paused: nothing is inserted, advanced or
/// replaced (the lost node's failed attempt is cleaned up, so nothing
/// leaks), the restarted host comes back paused, and `swactor resume`
/// converges on the latest shape.
#[test]
fn a_paused_cluster_makes_nothing_new_across_a_crash_and_converges_once_resumed() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 2);
    converge(&mut world);
    let made = world.executor().backend().counters().leases_created;
    world.pause(true);
    scale(&mut world, 4);
    world.apply(&Input::AgentLost {
        pick: 1,
        stale: false,
    });
    world.apply(&Input::Advance { ms: 20_000 });
    world.apply(&Input::HostCrash {
        at_persist: false,
        down_ms: 1_000,
    });
    assert!(world.host().is_paused(), "the new host is still paused");
    world.apply(&Input::Advance { ms: 30_000 });
    assert_clean(&world);
    let c = world.executor().backend().counters();
    assert_eq!(c.leases_created, made, "nothing was created while paused");
    // The lost node's attempt was cleaned up (the restarted host, finding
    // nothing of it, holds its slot empty), not replaced.
    let lost = world
        .sut()
        .state()
        .nodes
        .get(&LogicalNodeId::parse("alpha-1").expect("id"));
    assert!(
        lost.is_none_or(|n| n.record.stage == swactor_provisioning::NodeStage::Destroyed),
        "{lost:?}"
    );
    let live: Vec<String> = world
        .executor()
        .backend()
        .live_resources()
        .map(|(k, _)| k.node.to_string())
        .collect();
    assert!(live.iter().all(|n| n == "alpha-0"), "{live:?}");
    world.pause(false);
    converge(&mut world);
    assert_eq!(world.sut().state().nodes.len(), 4);
}

/// The attempts of group `alpha`'s nodes, in slot order.
fn alpha_attempts(world: &World) -> Vec<u64> {
    world
        .sut()
        .state()
        .nodes
        .iter()
        .filter(|(id, _)| id.group.as_str() == "alpha")
        .map(|(_, n)| n.attempt.0)
        .collect()
}

/// A template change on a converged group of three with the default
/// `max_unavailable` of 1: the oracle's `rollout_within_budget` watches
/// every pass, and at no step are two of the group's slots down at once.
#[test]
fn a_template_change_rolls_a_group_one_ready_node_at_a_time() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    world.apply(&Input::Shape {
        group: 0,
        count: 3,
        variant: 1,
        skip: 0,
    });
    let mut most_down = 0;
    for _ in 0..400 {
        if !world.step() {
            break;
        }
        let down = world
            .sut()
            .state()
            .nodes
            .values()
            .filter(|n| !n.is_ready())
            .count();
        most_down = most_down.max(down);
        if world.sut().is_converged() {
            break;
        }
    }
    assert_clean(&world);
    assert!(world.sut().is_converged());
    assert_eq!(most_down, 1, "one slot down at a time");
}

/// The same change with `max_unavailable = 0, max_surge = 1`: a surge slot
/// (`alpha-3`) comes up first, the group never has fewer than three ready
/// nodes nor more than four slots, and the surge slot is gone at the end.
/// The oracle's `surge_within_budget` and `rollout_within_budget` watch
/// every pass.
#[test]
fn a_template_change_with_a_surge_keeps_every_node_ready() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 4,
        max_unhealthy: None,
    });
    world.apply(&Input::Shape {
        group: 0,
        count: 3,
        variant: 1,
        skip: 0,
    });
    let (mut fewest_ready, mut most_slots, mut surged) = (3, 0, false);
    for _ in 0..600 {
        if !world.step() {
            break;
        }
        let nodes = &world.sut().state().nodes;
        let ready = nodes.values().filter(|n| n.is_ready()).count();
        let slots = nodes
            .values()
            .filter(|n| n.intent == Intent::Active)
            .count();
        surged |= nodes.keys().any(|id| id.index == 3);
        fewest_ready = fewest_ready.min(ready);
        most_slots = most_slots.max(slots);
        if world.sut().is_converged() {
            break;
        }
    }
    assert_clean(&world);
    assert!(world.sut().is_converged());
    assert!(surged, "the surge slot was made");
    assert_eq!(fewest_ready, 3, "never below three ready");
    assert_eq!(most_slots, 4, "three slots and one surge slot at most");
    assert_eq!(world.sut().state().nodes.len(), 3, "the surge slot is gone");
}

/// The host crashes mid-rollout, once `alpha-0` runs the new template:
/// the restarted host adopts `alpha-1` and `alpha-2`, which still run the
/// old one, as they are (the journal kept that template), lets them become
/// ready again and rolls them one at a time, instead of replacing both at
/// once.
#[test]
fn a_crash_mid_rollout_resumes_the_old_nodes_and_rolls_them_one_at_a_time() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    let attempt = |w: &World, i: u32| {
        let id = LogicalNodeId::parse(&format!("alpha-{i}")).unwrap();
        w.sut().state().nodes.get(&id).map(|n| n.attempt)
    };
    let old: Vec<_> = (0..3).map(|i| attempt(&world, i)).collect();
    world.apply(&Input::Shape {
        group: 0,
        count: 3,
        variant: 1,
        skip: 0,
    });
    for _ in 0..400 {
        let id = slot0();
        let done = world
            .sut()
            .state()
            .nodes
            .get(&id)
            .is_some_and(|n| Some(n.attempt) != old[0] && n.is_ready());
        if done || !world.step() {
            break;
        }
    }
    assert_ne!(attempt(&world, 0), old[0], "alpha-0 was replaced first");
    assert_eq!(attempt(&world, 1), old[1]);
    world.apply(&Input::HostCrash {
        at_persist: false,
        down_ms: 100,
    });
    // Down for the rollout: an old attempt being deleted, or a new one not
    // ready yet. Adopted nodes re-attaching do not count.
    let mut most_down = 0;
    for _ in 0..600 {
        if !world.step() {
            break;
        }
        let nodes = &world.sut().state().nodes;
        let down = (1..3u32)
            .filter(|i| {
                let id = LogicalNodeId::parse(&format!("alpha-{i}")).unwrap();
                nodes.get(&id).is_some_and(|n| {
                    n.intent == Intent::Deleting
                        || (Some(n.attempt) != old[*i as usize] && !n.is_ready())
                })
            })
            .count();
        most_down = most_down.max(down);
        if world.sut().is_converged() {
            break;
        }
    }
    assert_clean(&world);
    assert!(world.sut().is_converged());
    assert_ne!(attempt(&world, 1), old[1], "alpha-1 rolled");
    assert_ne!(attempt(&world, 2), old[2], "alpha-2 rolled");
    assert_eq!(
        most_down, 1,
        "one old node down at a time after the restart"
    );
}

/// A partition cuts every agent of a group whose `max_unhealthy` is 1 off:
/// past their grace they are held, not replaced, and the host says why;
/// when they come back nothing was replaced.
#[test]
fn agents_cut_off_beyond_max_unhealthy_are_held_and_come_back_unreplaced() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    // Set after converging: the fair tail lifts limits, as an operator would.
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 0,
        max_unhealthy: Some(1),
    });
    let before = alpha_attempts(&world);
    world.apply(&Input::MassAgentLoss { group: 0, count: 3 });
    world.apply(&Input::Advance { ms: 20_000 });
    assert_clean(&world);
    assert_eq!(alpha_attempts(&world), before, "nothing was replaced");
    assert_eq!(world.host().held_lost().count(), 3);
    let holds = world.host().holds();
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert_eq!(
        holds[0].reason,
        "remediation paused: 3 of 3 unhealthy > max 1"
    );
    assert!(!world.host().is_converged(), "held agents are not ready");
    world.apply(&Input::AgentsReturn);
    world.apply(&Input::Advance { ms: 5_000 });
    assert_clean(&world);
    assert_eq!(
        alpha_attempts(&world),
        before,
        "they came back as they were"
    );
    assert!(world.host().holds().is_empty());
    assert!(world.host().is_converged());
}

/// The same partition, but the agents never come back: raising the limit
/// (an operator's `apply`) releases the held nodes, which are replaced.
#[test]
fn held_nodes_are_replaced_once_the_limit_is_lifted() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    // Set after converging: the fair tail lifts limits, as an operator would.
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 0,
        max_unhealthy: Some(1),
    });
    let before = alpha_attempts(&world);
    world.apply(&Input::MassAgentLoss { group: 0, count: 2 });
    world.apply(&Input::Advance { ms: 20_000 });
    assert_eq!(alpha_attempts(&world), before, "two of three > max 1: held");
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 0,
        max_unhealthy: None,
    });
    converge(&mut world);
    let after = alpha_attempts(&world);
    assert_eq!(after[2], before[2], "alpha-2 stayed connected throughout");
    assert!(after[0] > before[0] && after[1] > before[1], "{after:?}");
}

/// With `max_unhealthy` 2 of 3, one lost agent is within the limit and is
/// replaced when its grace ends, as without a limit.
#[test]
fn a_loss_within_max_unhealthy_is_replaced_as_usual() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    // Set after converging: the fair tail lifts limits, as an operator would.
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 0,
        max_unhealthy: Some(2),
    });
    let before = alpha_attempts(&world);
    world.apply(&Input::MassAgentLoss { group: 0, count: 1 });
    world.apply(&Input::Advance { ms: 20_000 });
    assert_clean(&world);
    assert!(world.host().holds().is_empty());
    let after = alpha_attempts(&world);
    assert!(after[0] > before[0], "{after:?}");
}

/// A node whose machine vanishes fails at once (its stream says so); with
/// the group over its `max_unhealthy` it is cleaned up but not restarted
/// (ladder row 18) until the operator lifts the limit.
#[test]
fn a_failed_slot_of_a_group_over_its_limit_is_cleaned_up_but_not_restarted() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 3);
    converge(&mut world);
    world.apply(&Input::Budget {
        group: 0,
        max_unavailable: 0,
        max_unhealthy: Some(0),
    });
    let before = alpha_attempts(&world);
    world.apply(&Input::DeleteOutOfBand { pick: 0 });
    world.apply(&Input::Advance { ms: 60_000 });
    assert_clean(&world);
    let lost = world
        .sut()
        .state()
        .nodes
        .iter()
        .find(|(_, n)| n.record.failed_reason().is_some())
        .map(|(id, n)| (*id, n.clone()))
        .expect("one node failed");
    assert_eq!(
        lost.1.record.stage,
        swactor_provisioning::NodeStage::Destroyed
    );
    assert_eq!(alpha_attempts(&world), before, "no slot got a new attempt");
    let holds = world.host().holds();
    assert_eq!(
        holds.iter().map(|h| h.reason.as_str()).collect::<Vec<_>>(),
        ["remediation paused: 1 of 3 unhealthy > max 0"]
    );
    let live: Vec<String> = world
        .executor()
        .backend()
        .live_resources()
        .map(|(k, _)| k.node.to_string())
        .collect();
    assert!(!live.contains(&lost.0.to_string()), "cleaned up: {live:?}");
    converge(&mut world);
    assert_eq!(world.sut().state().nodes.len(), 3);
}

/// Found by a 3,000-seed run (in-order seed 804), a false alarm of the
/// kit: a host accepts new budgets and is killed before the shape is
/// durable; the next host, from the journal, accepts the same generation
/// again with the journal's budgets. The oracle judges the driver by the
/// budgets of the latest shape accepted at a generation, not the first.
#[test]
fn budgets_of_a_generation_lost_in_a_crash_and_accepted_again_are_judged_by_the_latest() {
    use swactor_conformance::trace::ProviderFaultInput;
    let mut world = World::new(WorldConfig::for_mode(Mode::InOrder), 0);
    for input in [
        Input::Budget {
            group: 0,
            max_unavailable: 0,
            max_unhealthy: Some(0),
        },
        Input::Shape {
            group: 0,
            count: 2,
            variant: 0,
            skip: 0,
        },
        Input::Provider(ProviderFaultInput::Refuse(EffectKind::StartBootstrap)),
        Input::HostCrash {
            at_persist: true,
            down_ms: 0,
        },
        Input::Budget {
            group: 0,
            max_unavailable: 0,
            max_unhealthy: None,
        },
        Input::Resubmit,
        Input::Resubmit,
        Input::Advance { ms: 1_067 },
    ] {
        world.apply(&input);
    }
    assert_clean(&world);
    converge(&mut world);
}

/// Issue 28: a daemon stopped (`kill -STOP`, a laptop's sleep) for longer
/// than its agents' grace came back and replaced every live node, because
/// it counted its own silence against them. Host pauses of 3, 10 and 60
/// graces leave every live agent's node as it was.
#[test]
fn a_host_paused_for_many_graces_replaces_no_live_agent() {
    for graces in [3u32, 10, 60] {
        let mut world = empty_world(|_| {});
        scale(&mut world, 3);
        converge(&mut world);
        let before = alpha_attempts(&world);
        world.apply(&Input::HostPause { ms: graces * 5_000 });
        let gap = world
            .host()
            .last_deaf_gap()
            .expect("the pause is a deaf gap");
        assert_eq!(gap.len_ms(), u64::from(graces) * 5_000);
        assert_eq!(gap.agents, 3, "every joined agent gets its grace again");
        world.apply(&Input::Advance { ms: 20_000 });
        assert_clean(&world);
        assert_eq!(alpha_attempts(&world), before, "pause of {graces} graces");
        assert!(world.host().is_converged());
    }
}

/// An agent that really died while the host was paused is replaced, but
/// only after a whole grace of the host listening, not the moment it wakes.
#[test]
fn an_agent_lost_during_a_host_pause_is_replaced_one_grace_after_it() {
    let mut world = empty_world(|_| {});
    scale(&mut world, 2);
    converge(&mut world);
    let before = alpha_attempts(&world);
    world.apply(&Input::AgentLost {
        pick: 0,
        stale: false,
    });
    world.apply(&Input::HostPause { ms: 30_000 });
    let back = world.now();
    world.apply(&Input::Advance { ms: 4_900 });
    assert_clean(&world);
    assert_eq!(alpha_attempts(&world), before, "not yet: within its grace");
    world.apply(&Input::Advance { ms: 200 });
    assert_clean(&world);
    let node = world.host().core().state().nodes.get(&slot0()).cloned();
    assert!(
        node.is_some_and(|n| n.record.failed_reason().is_some() || n.intent == Intent::Deleting),
        "lost one grace after the host was back at {back}"
    );
    converge(&mut world);
}
