//! Rolling replacement: a new template takes ready nodes down within the
//! group's `max_unavailable`, in slot order, and a failing replacement
//! stops the rollout until a fixed template is applied.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// The slots whose active attempt began deleting (or was replaced) since `before`.
fn taken_down(before: &ClusterState, d: &Driver) -> Vec<String> {
    d.state()
        .nodes
        .iter()
        .filter(|(id, n)| {
            before.nodes.get(id).is_some_and(|b| {
                b.intent == Intent::Active
                    && (b.attempt != n.attempt || n.intent == Intent::Deleting)
            })
        })
        .map(|(id, _)| id.to_string())
        .collect()
}

fn with_role(mut g: GroupShape, role: &str) -> GroupShape {
    g.role = role.to_owned();
    g
}

fn budget(mut g: GroupShape, max_unavailable: Quantity) -> GroupShape {
    g.policy.max_unavailable = Some(max_unavailable);
    g
}

#[test]
fn a_new_template_replaces_ready_nodes_one_at_a_time_in_slot_order() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 4)])).unwrap();
    converge(&mut d, t(0));
    d.update_desired(&shape(2, vec![with_role(group("w", 4), "v2")]))
        .unwrap();
    let before = d.state().clone();
    let first = settle(&mut d, t(1));
    assert_eq!(taken_down(&before, &d), ["w-0"]);
    assert!(first.iter().all(|x| x.key.node == node_id("w-0")));
    // The waiting ones are decided by row 17, and the driver says why.
    let mut gates = RolloutGates::new(d.state(), d.desired());
    for id in ["w-1", "w-2", "w-3"] {
        let n = &d.state().nodes[&node_id(id)];
        let row = reconcile_node_gated(
            &node_id(id),
            n,
            d.desired().slot(&node_id(id)),
            t(1),
            &mut gates,
        )
        .row;
        assert_eq!(row, LadderRow::AwaitRolloutBudget, "{id}");
    }
    let holds = d.rollout_holds();
    assert_eq!(holds.len(), 1);
    assert_eq!(
        holds[0].to_string(),
        "rolling out: 3 node(s) of the old template wait; 1 of max 1 unavailable"
    );
    // Step through the rollout: never more than one desired slot down, and
    // the old nodes go in slot order.
    let mut order = vec!["w-0".to_owned()];
    let mut now = t(1);
    for _ in 0..64 {
        if d.is_converged() {
            break;
        }
        now = d.poll_timeout().unwrap_or(now).max(now);
        d.handle_tick(now);
        let before = d.state().clone();
        settle(&mut d, now);
        bring_up(&mut d, now);
        order.extend(taken_down(&before, &d));
        let down = d.state().nodes.values().filter(|n| !n.is_ready()).count();
        assert!(down <= 1, "{down} nodes down at once");
    }
    assert!(d.is_converged());
    assert_eq!(order, ["w-0", "w-1", "w-2", "w-3"]);
    assert!(d.rollout_holds().is_empty());
}

/// Runs passes, answering every dispatch with success, until none is left.
fn settle(d: &mut Driver, now: Timestamp) -> Vec<Dispatch> {
    let mut all = Vec::new();
    loop {
        let ds = drain(d, now);
        if ds.is_empty() {
            return all;
        }
        for disp in &ds {
            let _ = d.handle_result(success(disp), now).unwrap();
        }
        all.extend(ds);
    }
}

/// Every node whose bootstrap runs joins and converges.
fn bring_up(d: &mut Driver, now: Timestamp) {
    loop {
        let running = bootstrapping(d);
        if running.is_empty() {
            return;
        }
        for id in running {
            join(d, &id, now);
        }
        settle(d, now);
    }
}

#[test]
fn a_percentage_budget_rounds_down_and_counts_slots_that_are_not_ready() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 5)])).unwrap();
    converge(&mut d, t(0));
    // 50% of 5 is 2.5: two at a time.
    let g = budget(with_role(group("w", 5), "v2"), Quantity::Percent(50));
    d.update_desired(&shape(2, vec![g.clone()])).unwrap();
    let before = d.state().clone();
    let _ = drain(&mut d, t(1));
    assert_eq!(taken_down(&before, &d), ["w-0", "w-1"]);

    // A slot that is not ready (here: scaled up, not there yet) uses budget.
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 4)])).unwrap();
    converge(&mut d, t(0));
    let g = budget(with_role(group("w", 5), "v2"), Quantity::Percent(50));
    d.update_desired(&shape(2, vec![g])).unwrap();
    let before = d.state().clone();
    let _ = drain(&mut d, t(1));
    assert_eq!(
        taken_down(&before, &d),
        ["w-0"],
        "w-4 is missing, so one of the two units is spent"
    );
}

#[test]
fn a_failing_replacement_stops_the_rollout_until_a_fixed_template_is_applied() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 4)])).unwrap();
    converge(&mut d, t(0));
    let broken = budget(with_role(group("w", 4), "broken"), Quantity::Count(2));
    d.update_desired(&shape(2, vec![broken])).unwrap();
    let before = d.state().clone();
    settle(&mut d, t(1));
    assert_eq!(taken_down(&before, &d), ["w-0", "w-1"]);
    // Both are cleaned up and restarted with the broken template.
    let mut now = t(1);
    for _ in 0..8 {
        let running = d
            .state()
            .nodes
            .values()
            .filter(|n| n.record.stage == NodeStage::BootstrapRunning)
            .count();
        if running == 2 {
            break;
        }
        now = d.poll_timeout().unwrap_or(now).max(now);
        d.handle_tick(now);
        settle(&mut d, now);
    }
    // w-1 comes up; w-0's boot check fails.
    for ev in [
        BootstrapEvent::SwactorJoined,
        BootstrapEvent::Stage(BootstrapStage::Converged),
    ] {
        let o = observe(&d, "w-1", ev);
        let _ = d.handle_bootstrap(o, now).unwrap();
    }
    let o = observe(
        &d,
        "w-0",
        BootstrapEvent::Failed {
            stage: BootstrapStage::BootCheckFailed,
            reason: "boot check exited 1".to_owned(),
        },
    );
    let _ = d.handle_bootstrap(o, now).unwrap();
    let before = d.state().clone();
    settle(&mut d, now);
    assert!(
        taken_down(&before, &d).iter().all(|n| n == "w-0"),
        "only the failed node's own cleanup runs: {:?}",
        taken_down(&before, &d)
    );
    assert!(d.state().nodes[&node_id("w-2")].is_ready());
    assert!(d.state().nodes[&node_id("w-3")].is_ready());
    let holds = d.rollout_holds();
    assert_eq!(holds.len(), 1);
    let why = holds[0].to_string();
    assert!(
        why.starts_with(
            "rollout stopped: node w-0 failed with the new template: boot check exited 1"
        ),
        "{why}: {:#?}",
        d.state().nodes[&node_id("w-0")]
    );
    // Its restart carries the failure: the stop holds while it retries.
    now = d.poll_timeout().unwrap_or(now).max(now);
    d.handle_tick(now);
    let creates = settle(&mut d, now);
    assert!(!creates.is_empty());
    assert!(
        creates.iter().all(|c| c.key.node == node_id("w-0")),
        "{creates:?}"
    );
    assert_eq!(
        d.rollout_holds().len(),
        1,
        "still stopped while w-0 retries"
    );
    assert!(d.rollout_holds()[0].to_string().contains("is retrying"));

    // A fixed template: the failing w-0 is replaced at once (it is not
    // ready, so it costs no budget), and the rollout goes on from there.
    let fixed = budget(with_role(group("w", 4), "fixed"), Quantity::Count(2));
    d.update_desired(&shape(3, vec![fixed])).unwrap();
    let before = d.state().clone();
    settle(&mut d, now);
    // w-0 is not ready, so replacing it costs nothing; w-1 takes the one
    // unit left of the two.
    assert_eq!(taken_down(&before, &d), ["w-0", "w-1"]);
    assert!(d.rollout_holds().iter().all(|h| h.stopped.is_none()));
    for _ in 0..64 {
        if d.is_converged() {
            break;
        }
        bring_up(&mut d, now);
        now = d.poll_timeout().unwrap_or(now).max(now);
        d.handle_tick(now);
        settle(&mut d, now);
    }
    assert!(d.is_converged(), "{:#?}", d.state());
    assert!(d.state().nodes.values().all(|n| n.template.role == "fixed"));
}

#[test]
fn undesired_and_not_ready_nodes_are_replaced_without_waiting_for_the_budget() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 3)])).unwrap();
    // Nothing is ready yet: the new template replaces all three at once.
    let _ = drain(&mut d, t(0));
    d.update_desired(&shape(2, vec![with_role(group("w", 2), "v2")]))
        .unwrap();
    let before = d.state().clone();
    let _ = drain(&mut d, t(1));
    let down: Vec<String> = d
        .state()
        .nodes
        .iter()
        .filter(|(id, n)| {
            n.intent == Intent::Deleting && before.nodes[*id].intent == Intent::Active
        })
        .map(|(id, _)| id.to_string())
        .collect();
    assert_eq!(down, ["w-0", "w-1", "w-2"]);
}

#[test]
fn a_tripped_breaker_holds_a_failed_slots_restart_but_never_a_new_template() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 2)])).unwrap();
    converge(&mut d, t(0));
    let attempt = d.state().nodes[&node_id("w-0")].attempt;
    let _ = d.handle_agent_lost(
        &node_id("w-0"),
        attempt,
        FailureCause::AgentLost,
        "gone",
        t(1),
    );
    d.set_tripped([GroupId::new("w")].into_iter().collect());
    settle(&mut d, t(1));
    assert_eq!(
        d.state().nodes[&node_id("w-0")].record.stage,
        NodeStage::Destroyed,
        "the failed attempt is cleaned up"
    );
    // Long after its restart is due, it waits on row 18.
    let later = t(600_000);
    d.handle_tick(later);
    assert!(settle(&mut d, later).is_empty());
    let n = &d.state().nodes[&node_id("w-0")];
    assert_eq!(n.attempt, attempt);
    let mut gates = RolloutGates::new(d.state(), d.desired()).with_tripped(d.tripped());
    let row = reconcile_node_gated(
        &node_id("w-0"),
        n,
        d.desired().slot(&node_id("w-0")),
        later,
        &mut gates,
    )
    .row;
    assert_eq!(row, LadderRow::AwaitBreaker);
    assert_eq!(
        d.poll_timeout(),
        None,
        "a held restart waits on no deadline"
    );

    // The breaker resets: the restart goes.
    let mut reset = d.clone();
    reset.set_tripped(Default::default());
    let creates = settle(&mut reset, later);
    assert!(
        creates
            .iter()
            .any(|c| c.key.node == node_id("w-0") && c.request.kind() == EffectKind::CreateLease),
        "{creates:?}"
    );

    // Or a new template is applied: a fix is never held back.
    d.update_desired(&shape(2, vec![with_role(group("w", 2), "v2")]))
        .unwrap();
    let creates = settle(&mut d, later);
    assert!(
        creates
            .iter()
            .any(|c| c.key.node == node_id("w-0") && c.request.kind() == EffectKind::CreateLease),
        "{creates:?}"
    );
}

#[test]
fn a_surge_keeps_every_node_ready_and_goes_once_the_rollout_is_done() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 4)])).unwrap();
    converge(&mut d, t(0));
    let mut g = budget(with_role(group("w", 4), "v2"), Quantity::Count(0));
    g.policy.max_surge = Some(Quantity::Count(1));
    d.update_desired(&shape(2, vec![g])).unwrap();
    // Nothing is taken down before the surge node is up: w-4 comes first.
    let before = d.state().clone();
    let first = settle(&mut d, t(1));
    assert!(taken_down(&before, &d).is_empty());
    assert!(
        first.iter().all(|x| x.key.node == node_id("w-4")),
        "{first:?}"
    );
    assert!(d.desires(&node_id("w-4")));
    assert_eq!(d.state().nodes.len(), 5);
    assert_eq!(
        d.rollout_holds()[0].to_string(),
        "rolling out: 4 node(s) of the old template wait; 0 of max 0 unavailable; 4 of 5 ready with 1 surge node(s)"
    );
    let mut order = Vec::new();
    let mut now = t(1);
    for _ in 0..64 {
        if d.is_converged() {
            break;
        }
        now = d.poll_timeout().unwrap_or(now).max(now);
        d.handle_tick(now);
        let before = d.state().clone();
        settle(&mut d, now);
        bring_up(&mut d, now);
        order.extend(taken_down(&before, &d));
        let ready = d.state().nodes.values().filter(|n| n.is_ready()).count();
        let live = d
            .state()
            .nodes
            .values()
            .filter(|n| n.record.stage != NodeStage::Destroyed)
            .count();
        assert!(ready >= 4, "{ready} ready: the surge must keep 4 up");
        assert!(live <= 5, "{live} live attempts: at most 4 + 1 surge");
    }
    assert!(
        d.is_converged(),
        "{:?}",
        d.state().nodes.keys().collect::<Vec<_>>()
    );
    assert_eq!(order, ["w-0", "w-1", "w-2", "w-3"]);
    // The surge slot went (reaped) once w-3 was ready with the new template.
    assert!(!d.desires(&node_id("w-4")));
    assert!(!d.state().nodes.contains_key(&node_id("w-4")));
    assert_eq!(d.state().nodes.len(), 4);
    assert!(d.rollout_holds().is_empty());
    // No rollout, no surge: a failed node is replaced in place.
    let n = &d.state().nodes[&node_id("w-1")];
    assert!(same_template(&n.template, &template(d.desired(), "w-1")));
}

/// A host whose bootstrap streams prove joins, resuming `journal` if given.
fn host_with(journal: Option<JournalImage>) -> Host<Driver> {
    let config = HostConfig {
        stream_joins: true,
        ..HostConfig::default()
    };
    Host::new(driver(), config, journal).unwrap()
}

/// Runs the host's outputs at `now` with a provider that does what it is
/// asked and lists `listed` (once); a started bootstrap of the node
/// `broken` names fails its boot check, the others join and converge.
fn pump(
    h: &mut Host<Driver>,
    now: Timestamp,
    broken: &dyn Fn(&LogicalNodeId, &NodeTemplate) -> bool,
    mut listed: Vec<Listed>,
) {
    for _ in 0..64 {
        let mut round = Vec::new();
        while let Some(out) = h.poll_output(now) {
            match out {
                Output::Persist(delta) => h.handle_persisted(delta.seq),
                Output::List => h.handle_inventory(Ok(std::mem::take(&mut listed)), now),
                Output::Pass(pass) => round.extend(pass.dispatches),
                _ => {}
            }
        }
        if round.is_empty() {
            return;
        }
        for d in &round {
            assert_eq!(h.handle_result(success(d), now).unwrap(), Folded::Applied);
            if d.request.kind() != EffectKind::StartBootstrap {
                continue;
            }
            let n = &h.core().state().nodes[&d.key.node];
            let events = if broken(&d.key.node, &n.template) {
                vec![BootstrapEvent::Stage(BootstrapStage::BootCheckFailed)]
            } else {
                vec![
                    BootstrapEvent::SwactorJoined,
                    BootstrapEvent::Stage(BootstrapStage::Converged),
                ]
            };
            let (attempt, session) = (n.attempt, n.record.session.clone().unwrap());
            for event in events {
                let obs = BootstrapObservation {
                    node: d.key.node,
                    attempt,
                    session: session.clone(),
                    event,
                };
                assert_eq!(h.handle_bootstrap(obs, now).unwrap(), Folded::Applied);
            }
        }
    }
}

/// What the provider holds for the host's live attempts.
fn inventory(h: &Host<Driver>) -> Vec<Listed> {
    let state = h.core().state();
    state
        .nodes
        .iter()
        .filter(|(_, n)| n.record.lease.is_some())
        .map(|(id, n)| Listed {
            key: ResourceKey {
                run_id: state.run_id.clone(),
                node: *id,
                attempt: n.attempt,
            },
            lease: n.record.lease.clone(),
            session: n.record.session.clone(),
        })
        .collect()
}

#[test]
fn a_stopped_rollout_stays_stopped_across_a_restart_of_the_host() {
    let g = |role: &str| budget(with_role(group("w", 6), role), Quantity::Count(3));
    let v2_on_w0 = |id: &LogicalNodeId, t: &NodeTemplate| *id == node_id("w-0") && t.role == "v2";
    let mut h = host_with(None);
    h.handle_apply(&shape(1, vec![g("v1")]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, t(0), &v2_on_w0, Vec::new());
    assert!(h.is_converged());
    // Three go at once; w-1 and w-2 come up with v2, w-0 fails its boot
    // check: the rollout stops with one slot down, budget left for two.
    h.handle_apply(&shape(2, vec![g("v2")]), Ticket(2), t(1))
        .unwrap();
    pump(&mut h, t(1), &v2_on_w0, Vec::new());
    let kept: Vec<(String, NodeAttemptId)> = ["w-3", "w-4", "w-5"]
        .iter()
        .map(|n| (n.to_string(), h.core().state().nodes[&node_id(n)].attempt))
        .collect();
    let holds = h.core().rollout_holds();
    assert!(holds[0].stopped.is_some(), "{holds:?}");
    assert_eq!(h.slot_records()[&node_id("w-0")].failures, 1);

    // The daemon dies; a new host resumes the journal and adopts what the
    // provider lists. w-3 to w-5 still run v1 (the journal kept it): they
    // resume and become ready, not replaced all at once. w-0's failed
    // attempt is gone, so its slot gets a new attempt: it starts with the
    // failure, so the rollout stays stopped (and w-0 fails again).
    let image = JournalImage {
        meta: h.journal_meta().clone(),
        slots: h.slot_records().clone(),
    };
    assert_eq!(image.meta.retired.len(), 1, "v1 is kept while slots run it");
    let listed = inventory(&h);
    let mut h = host_with(Some(image));
    pump(&mut h, t(2), &v2_on_w0, listed.clone());
    // The listing misses w-0's attempt, which the journal saw created: the
    // host decides nothing until it has listed again a listing lag later.
    assert!(!h.adopted());
    let again = t(2).saturating_add_ms(HostConfig::default().visibility_window_ms);
    let _ = h.handle_timeout(again);
    pump(&mut h, again, &v2_on_w0, listed);
    assert!(h.adopted());
    for (n, attempt) in &kept {
        let node = &h.core().state().nodes[&node_id(n)];
        assert_eq!(node.attempt, *attempt, "{n} was replaced after the restart");
        assert!(node.is_ready(), "{n} was taken down after the restart");
    }
    let w0 = &h.core().state().nodes[&node_id("w-0")];
    assert_eq!(w0.retry.template_failures(), 2, "{:?}", w0.retry);
    let holds = h.core().rollout_holds();
    assert!(holds[0].stopped.is_some(), "{holds:?}");
    // Once w-0 comes up, the rollout goes on: w-3 to w-5 are rolled (three
    // at a time at most).
    let mut now = again;
    for _ in 0..50 {
        now = now.saturating_add_ms(5_000);
        let _ = h.handle_timeout(now);
        pump(&mut h, now, &|_, _| false, Vec::new());
        if h.is_converged() {
            break;
        }
    }
    assert!(h.is_converged(), "{:#?}", h.core().state());
    for (n, attempt) in &kept {
        assert_ne!(
            h.core().state().nodes[&node_id(n)].attempt,
            *attempt,
            "{n} rolled"
        );
    }
}
