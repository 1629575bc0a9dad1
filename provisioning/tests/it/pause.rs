//! Pausing: a paused driver folds everything but dispatches nothing new;
//! cleanup of what already failed or is being deleted still finishes.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn kinds(ds: &[Dispatch]) -> Vec<(String, EffectKind)> {
    ds.iter()
        .map(|d| (d.key.node.to_string(), d.request.kind()))
        .collect()
}

#[test]
fn a_paused_driver_inserts_nothing_and_resuming_creates_every_slot() {
    let mut d = driver();
    d.set_paused(true);
    d.update_desired(&shape(1, vec![group("w", 3)])).unwrap();
    assert!(drain(&mut d, t(0)).is_empty());
    assert!(d.state().nodes.is_empty());
    assert!(d.plan(t(0)).actions.is_empty());
    assert_eq!(d.poll_timeout(), None, "a held slot waits on nothing");
    d.set_paused(false);
    assert!(d.is_pass_queued(), "resuming re-decides every node");
    let creates = drain(&mut d, t(0));
    assert_eq!(creates.len(), 3);
    assert!(
        creates
            .iter()
            .all(|c| c.request.kind() == EffectKind::CreateLease)
    );
}

#[test]
fn pending_operations_finish_and_are_folded_while_paused_but_the_next_step_waits() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let create = drain(&mut d, t(0));
    d.set_paused(true);
    // The lease arrives while paused: folded, shown, not advanced.
    let lease = OperationResult {
        outcome: OperationOutcome::LeaseCreated {
            lease: LeaseId::from("l"),
            endpoint: None,
        },
        ..success(&create[0])
    };
    assert_eq!(d.handle_result(lease, t(5)).unwrap(), Folded::Applied);
    assert!(
        drain(&mut d, t(5)).is_empty(),
        "no LookupEndpoint while paused"
    );
    assert_eq!(
        d.state().nodes[&node_id("w-0")].record.stage,
        NodeStage::LeaseCreated
    );
    d.set_paused(false);
    assert_eq!(
        kinds(&drain(&mut d, t(6))),
        [("w-0".to_owned(), EffectKind::LookupEndpoint)]
    );
}

#[test]
fn a_failed_attempt_is_cleaned_up_while_paused_but_not_replaced() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 2)])).unwrap();
    converge(&mut d, t(0));
    let first = d.state().nodes[&node_id("w-1")].attempt;
    d.set_paused(true);
    assert_eq!(
        d.handle_agent_lost(
            &node_id("w-1"),
            first,
            FailureCause::AgentLost,
            "killed",
            t(10)
        ),
        Folded::Applied
    );
    // Cancel, then destroy: the failed attempt leaks nothing.
    let cancel = drain(&mut d, t(10));
    assert_eq!(
        kinds(&cancel),
        [("w-1".to_owned(), EffectKind::CancelBootstrap)]
    );
    assert_eq!(
        d.handle_result(success(&cancel[0]), t(11)).unwrap(),
        Folded::Applied
    );
    let destroy = drain(&mut d, t(11));
    assert_eq!(
        kinds(&destroy),
        [("w-1".to_owned(), EffectKind::DestroyLease)]
    );
    assert_eq!(
        d.handle_result(success(&destroy[0]), t(12)).unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(12)).is_empty());
    let n = &d.state().nodes[&node_id("w-1")];
    assert_eq!(n.record.stage, NodeStage::Destroyed);
    // Long after its restart would be due, it is still not replaced.
    let later = t(10_000_000);
    d.handle_tick(later);
    assert!(drain(&mut d, later).is_empty());
    assert_eq!(d.state().nodes[&node_id("w-1")].attempt, first);
    assert_eq!(d.poll_timeout(), None);
    d.set_paused(false);
    let create = drain(&mut d, later);
    assert_eq!(
        kinds(&create),
        [("w-1".to_owned(), EffectKind::CreateLease)]
    );
    assert!(create[0].key.attempt > first);
}

#[test]
fn a_scale_down_or_a_new_template_applied_while_paused_waits_for_resume() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 3)])).unwrap();
    converge(&mut d, t(0));
    d.set_paused(true);
    let mut g = group("w", 2);
    g.role = "coordinator".into();
    d.update_desired(&shape(2, vec![g])).unwrap();
    assert!(drain(&mut d, t(1)).is_empty());
    assert!(
        d.state()
            .nodes
            .values()
            .all(|n| n.intent == Intent::Active && n.is_ready()),
        "nothing began deleting"
    );
    d.set_paused(false);
    let cleanup = drain(&mut d, t(2));
    let mut slots: Vec<String> = cleanup.iter().map(|d| d.key.node.to_string()).collect();
    slots.sort();
    assert_eq!(
        slots,
        ["w-0", "w-2"],
        "the undesired one goes, and the first drifted one (max_unavailable 1); w-1 waits its turn"
    );
}

#[test]
fn a_deletion_under_way_when_paused_still_finishes() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 2)])).unwrap();
    converge(&mut d, t(0));
    d.update_desired(&shape(2, vec![group("w", 1)])).unwrap();
    let cancel = drain(&mut d, t(1));
    assert_eq!(
        kinds(&cancel),
        [("w-1".to_owned(), EffectKind::CancelBootstrap)]
    );
    d.set_paused(true);
    assert_eq!(
        d.handle_result(success(&cancel[0]), t(2)).unwrap(),
        Folded::Applied
    );
    let destroy = drain(&mut d, t(2));
    assert_eq!(
        kinds(&destroy),
        [("w-1".to_owned(), EffectKind::DestroyLease)]
    );
    assert_eq!(
        d.handle_result(success(&destroy[0]), t(3)).unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(3)).is_empty());
    // Marked destroyed and reaped: nothing of w-1 is left.
    assert!(!d.state().nodes.contains_key(&node_id("w-1")));
}

#[test]
fn an_undesired_node_whose_deletion_is_held_still_times_out_its_pending_operation() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let create = drain(&mut d, t(0));
    d.set_paused(true);
    d.update_desired(&shape(2, vec![group("w", 0)])).unwrap();
    assert!(drain(&mut d, t(1)).is_empty());
    // It waits on its CreateLease's deadline, held deletion or not.
    assert_eq!(d.poll_timeout(), Some(create[0].deadline));
    assert_eq!(d.handle_timeout(create[0].deadline).unwrap(), 1);
    assert!(drain(&mut d, create[0].deadline).is_empty());
    let n = &d.state().nodes[&node_id("w-0")];
    assert_eq!(n.intent, Intent::Active);
    assert!(n.record.ambiguous.is_some());
}

#[test]
fn allowed_while_paused_lets_only_cleanup_and_bookkeeping_through() {
    let desired = shape(1, vec![group("w", 1)]).validate().unwrap();
    let tpl = template(&desired, "w-0");
    let mut n = ManagedNode::new(NodeAttemptId(1), tpl.clone(), 0);
    let insert = NodeAction::Insert {
        template: tpl.clone(),
    };
    let restart = NodeAction::Restart { template: tpl };
    let drift = NodeAction::BeginDelete {
        reason: DeleteReason::SpecDrift,
    };
    assert!(!allowed_while_paused(None, &insert));
    assert!(!allowed_while_paused(Some(&n), &restart));
    assert!(!allowed_while_paused(Some(&n), &drift));
    for kind in [
        EffectKind::CreateLease,
        EffectKind::LookupEndpoint,
        EffectKind::StartBootstrap,
    ] {
        assert!(!allowed_while_paused(Some(&n), &NodeAction::Dispatch(kind)));
    }
    assert!(allowed_while_paused(Some(&n), &NodeAction::Reap));
    assert!(allowed_while_paused(
        Some(&n),
        &NodeAction::ObserveConvergence
    ));
    n.record.stage = NodeStage::Failed;
    assert!(
        allowed_while_paused(Some(&n), &drift),
        "a failed attempt is cleaned up"
    );
    n.intent = Intent::Deleting;
    for kind in [
        EffectKind::CreateLease,
        EffectKind::CancelBootstrap,
        EffectKind::DestroyLease,
    ] {
        assert!(allowed_while_paused(Some(&n), &NodeAction::Dispatch(kind)));
    }
}
