//! One test per row of the decision ladder, named as sentences, plus a golden table.

use crate::common;

use common::*;
use std::fmt::Write as _;
use std::sync::Arc;
use swactor_provisioning::*;

const NOW: u64 = 10_000;

fn desired() -> DesiredState {
    shape(1, vec![group("w", 2)]).validate().unwrap()
}

/// A node of slot `w-0` at stage `stage` with its usual facts.
fn node_at(stage: NodeStage) -> ManagedNode {
    let mut n = ManagedNode::new(NodeAttemptId(7), template(&desired(), "w-0"), 0);
    let rec = &mut n.record;
    rec.stage = stage;
    use NodeStage as S;
    if matches!(
        stage,
        S::LeaseCreated | S::EndpointKnown | S::BootstrapRunning | S::SwactorJoined | S::Dormant
    ) {
        rec.lease = Some(LeaseId::from("l"));
    }
    if matches!(
        stage,
        S::EndpointKnown | S::BootstrapRunning | S::SwactorJoined | S::Dormant
    ) {
        rec.endpoint = Some(NodeEndpoint::from("e"));
    }
    if matches!(stage, S::BootstrapRunning | S::SwactorJoined | S::Dormant) {
        rec.session = Some(SessionId::from("s"));
    }
    if stage == S::Dormant {
        rec.ready = true;
        rec.bootstrap = Some(BootstrapStage::Converged);
    }
    n
}

fn decide(n: &ManagedNode, desired_slot: bool) -> NodeDecision {
    let d = desired();
    let slot = desired_slot.then(|| template(&d, "w-0"));
    reconcile_node(n, slot.as_ref(), t(NOW))
}

fn pending(kind: EffectKind, deadline: u64) -> PendingOperation {
    PendingOperation {
        id: OperationId {
            attempt: NodeAttemptId(7),
            seq: 0,
        },
        effect: kind,
        dispatched_at: t(0),
        deadline: t(deadline),
        cleanup: false,
    }
}

#[test]
fn row_0_a_desired_slot_without_a_node_is_inserted() {
    let d = desired();
    let state = ClusterState::new(RunId::new("run"), 1);
    let plan = reconcile(&state, &d, t(NOW));
    let rows: Vec<_> = plan
        .actions
        .iter()
        .map(|a| (a.node.to_string(), a.row))
        .collect();
    assert_eq!(
        rows,
        [
            ("w-0".into(), LadderRow::InsertSlot),
            ("w-1".into(), LadderRow::InsertSlot)
        ]
    );
}

#[test]
fn row_1_a_destroyed_undesired_node_is_reaped() {
    let d = decide(&node_at(NodeStage::Destroyed), false);
    assert_eq!(
        (d.row, d.action),
        (LadderRow::ReapDestroyed, Some(NodeAction::Reap))
    );
}

#[test]
fn row_2_a_destroyed_desired_node_restarts_with_the_latest_spec_once_due() {
    let mut n = node_at(NodeStage::Destroyed);
    n.record.restart_at = Some(t(NOW));
    let d = decide(&n, true);
    assert_eq!(d.row, LadderRow::RestartDestroyed);
    let Some(NodeAction::Restart { template: tpl }) = d.action else {
        panic!("expected restart, got {:?}", d.action)
    };
    assert!(same_template(&tpl, &template(&desired(), "w-0")));
}

#[test]
fn row_3_a_destroyed_desired_node_waits_for_its_restart_backoff() {
    let mut n = node_at(NodeStage::Destroyed);
    n.record.restart_at = Some(t(NOW + 1));
    let d = decide(&n, true);
    assert_eq!(
        (d.row, d.action, d.wake_at),
        (LadderRow::AwaitRestartBackoff, None, Some(t(NOW + 1)))
    );
}

#[test]
fn row_4_an_active_node_that_is_undesired_drifted_or_failed_begins_deleting() {
    let d = decide(&node_at(NodeStage::Dormant), false);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::BeginDelete,
            Some(NodeAction::BeginDelete {
                reason: DeleteReason::Undesired
            })
        )
    );

    let mut drifted = node_at(NodeStage::Dormant);
    let mut tpl = (*drifted.template).clone();
    tpl.role = "coordinator".into();
    drifted.template = Arc::new(tpl);
    let d = decide(&drifted, true);
    assert_eq!(
        d.action,
        Some(NodeAction::BeginDelete {
            reason: DeleteReason::SpecDrift
        })
    );

    // Failed wins over a pending operation: cleanup starts at once.
    let mut failed = node_at(NodeStage::Failed);
    failed.pending = Some(pending(EffectKind::LookupEndpoint, NOW + 5));
    let d = decide(&failed, true);
    assert_eq!(
        d.action,
        Some(NodeAction::BeginDelete {
            reason: DeleteReason::Failed
        })
    );
}

#[test]
fn row_5_a_node_with_a_pending_operation_waits_for_its_result_or_deadline() {
    let mut n = node_at(NodeStage::LeaseRequested);
    n.pending = Some(pending(EffectKind::CreateLease, NOW + 50));
    let d = decide(&n, true);
    assert_eq!(
        (d.row, d.action, d.wake_at),
        (LadderRow::AwaitPendingOperation, None, Some(t(NOW + 50)))
    );
    // Also while deleting.
    n.intent = Intent::Deleting;
    assert_eq!(decide(&n, false).row, LadderRow::AwaitPendingOperation);
}

#[test]
fn row_6_a_deleting_node_with_an_ambiguous_create_reissues_it_to_adopt_first() {
    let mut n = node_at(NodeStage::LeaseRequested);
    n.intent = Intent::Deleting;
    n.record.ambiguous = Some(AmbiguousCreate::CreateLease);
    let d = decide(&n, false);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::AdoptAmbiguousCreate,
            Some(NodeAction::Dispatch(EffectKind::CreateLease))
        )
    );
    // An ambiguous bootstrap is adopted before the session could be cancelled.
    let mut n = node_at(NodeStage::EndpointKnown);
    n.intent = Intent::Deleting;
    n.record.ambiguous = Some(AmbiguousCreate::StartBootstrap);
    assert_eq!(
        decide(&n, false).action,
        Some(NodeAction::Dispatch(EffectKind::StartBootstrap))
    );
}

#[test]
fn row_7_a_deleting_node_with_a_live_session_cancels_the_bootstrap_first() {
    let mut n = node_at(NodeStage::Dormant);
    n.intent = Intent::Deleting;
    let d = decide(&n, false);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::CancelBootstrap,
            Some(NodeAction::Dispatch(EffectKind::CancelBootstrap))
        )
    );
}

#[test]
fn row_8_a_deleting_node_with_a_live_lease_and_no_session_destroys_the_lease() {
    let mut n = node_at(NodeStage::EndpointKnown);
    n.intent = Intent::Deleting;
    let d = decide(&n, false);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::DestroyLease,
            Some(NodeAction::Dispatch(EffectKind::DestroyLease))
        )
    );
}

#[test]
fn row_9_a_deleting_node_with_nothing_left_is_marked_destroyed() {
    let mut n = node_at(NodeStage::New);
    n.intent = Intent::Deleting;
    // Even under a running backoff: marking needs no I/O.
    n.retry.next_effect_at = Some(t(NOW + 100));
    let d = decide(&n, false);
    assert_eq!(
        (d.row, d.action),
        (LadderRow::MarkDestroyed, Some(NodeAction::MarkDestroyed))
    );
}

#[test]
fn row_10_a_node_in_retry_backoff_waits_and_cleanup_retries_back_off_too() {
    let mut n = node_at(NodeStage::LeaseRequested);
    n.retry.next_effect_at = Some(t(NOW + 1_000));
    let d = decide(&n, true);
    assert_eq!(
        (d.row, d.action, d.wake_at),
        (LadderRow::AwaitRetryBackoff, None, Some(t(NOW + 1_000)))
    );
    // A failed destroy retries after backoff, not hot.
    let mut n = node_at(NodeStage::EndpointKnown);
    n.intent = Intent::Deleting;
    n.retry.next_effect_at = Some(t(NOW + 1_000));
    assert_eq!(decide(&n, false).row, LadderRow::AwaitRetryBackoff);
    // A backoff that is due no longer holds anything back.
    n.retry.next_effect_at = Some(t(NOW));
    assert_eq!(decide(&n, false).row, LadderRow::DestroyLease);
}

#[test]
fn row_11_a_ready_node_is_in_steady_state_and_does_nothing() {
    let d = decide(&node_at(NodeStage::Dormant), true);
    assert_eq!(
        (d.row, d.action, d.wake_at),
        (LadderRow::SteadyReady, None, None)
    );
    let mut h = node_at(NodeStage::Dormant);
    h.record.stage = NodeStage::HandedOff;
    assert_eq!(decide(&h, true).row, LadderRow::SteadyReady);
}

#[test]
fn row_12_an_active_node_without_a_lease_creates_one() {
    for stage in [NodeStage::New, NodeStage::LeaseRequested] {
        let d = decide(&node_at(stage), true);
        assert_eq!(
            (d.row, d.action),
            (
                LadderRow::CreateLease,
                Some(NodeAction::Dispatch(EffectKind::CreateLease))
            )
        );
    }
}

#[test]
fn row_13_a_lease_without_an_endpoint_is_looked_up() {
    let d = decide(&node_at(NodeStage::LeaseCreated), true);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::LookupEndpoint,
            Some(NodeAction::Dispatch(EffectKind::LookupEndpoint))
        )
    );
}

#[test]
fn row_14_a_joined_and_converged_node_records_convergence() {
    let mut n = node_at(NodeStage::SwactorJoined);
    n.record.bootstrap = Some(BootstrapStage::Converged);
    let d = decide(&n, true);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::ObserveConvergence,
            Some(NodeAction::ObserveConvergence)
        )
    );
    // The stream may already have closed cleanly.
    n.record.session = None;
    assert_eq!(decide(&n, true).row, LadderRow::ObserveConvergence);
}

#[test]
fn row_15_a_running_bootstrap_awaits_stream_observations_until_its_stall_deadline() {
    let mut n = node_at(NodeStage::BootstrapRunning);
    n.record.bootstrap_deadline = Some(t(NOW + 300));
    let d = decide(&n, true);
    assert_eq!(
        (d.row, d.action, d.wake_at),
        (LadderRow::AwaitBootstrap, None, Some(t(NOW + 300)))
    );
    // Joined but not yet converged still waits.
    let mut j = node_at(NodeStage::SwactorJoined);
    j.record.bootstrap = Some(BootstrapStage::Join);
    assert_eq!(decide(&j, true).row, LadderRow::AwaitBootstrap);
}

#[test]
fn row_16_a_lease_with_an_endpoint_and_no_session_starts_bootstrap() {
    let d = decide(&node_at(NodeStage::EndpointKnown), true);
    assert_eq!(
        (d.row, d.action),
        (
            LadderRow::StartBootstrap,
            Some(NodeAction::Dispatch(EffectKind::StartBootstrap))
        )
    );
}

#[test]
fn rows_are_tried_in_priority_order() {
    // A destroyed node outranks everything, even a (bogus) pending operation.
    let mut n = node_at(NodeStage::Destroyed);
    n.pending = Some(pending(EffectKind::CreateLease, NOW + 1));
    assert_eq!(decide(&n, false).row, LadderRow::ReapDestroyed);
    // Begin-delete outranks a pending operation.
    let mut n = node_at(NodeStage::LeaseRequested);
    n.pending = Some(pending(EffectKind::CreateLease, NOW + 1));
    assert_eq!(decide(&n, false).row, LadderRow::BeginDelete);
    // Adoption outranks cancel and destroy.
    let mut n = node_at(NodeStage::BootstrapRunning);
    n.intent = Intent::Deleting;
    n.record.ambiguous = Some(AmbiguousCreate::StartBootstrap);
    assert_eq!(decide(&n, false).row, LadderRow::AdoptAmbiguousCreate);
    // Cancel outranks destroy.
    n.record.ambiguous = None;
    assert_eq!(decide(&n, false).row, LadderRow::CancelBootstrap);
}

#[test]
fn scale_down_and_holes_are_found_in_one_walk() {
    let d = shape(2, vec![group("a", 1), group("c", 3)])
        .validate()
        .unwrap();
    let mut state = ClusterState::new(RunId::new("run"), 1);
    let old = shape(1, vec![group("a", 2), group("b", 1), group("c", 3)])
        .validate()
        .unwrap();
    for (i, id) in ["a-0", "a-1", "b-0", "c-1"].iter().enumerate() {
        let mut n = ManagedNode::new(NodeAttemptId(i as u64 + 1), template(&old, id), 0);
        n.record = node_at(NodeStage::Dormant).record;
        state.nodes.insert(node_id(id), n);
    }
    let plan = reconcile(&state, &d, t(NOW));
    let got: Vec<_> = plan
        .actions
        .iter()
        .map(|a| format!("{} {:?}", a.node, a.row))
        .collect();
    assert_eq!(
        got,
        [
            "a-1 BeginDelete",
            "b-0 BeginDelete",
            "c-0 InsertSlot",
            "c-2 InsertSlot"
        ]
    );
}

/// Renders one scenario per row as text and compares with `testdata/ladder.golden`.
/// Set `UPDATE_GOLDEN=1` to rewrite the file after an intended change.
#[test]
// The policy forbids file I/O in this crate's code; reading and refreshing a
// golden file in a test is not policy code.
#[allow(clippy::disallowed_methods)]
fn the_golden_decision_table_matches() {
    use NodeStage as S;
    let mut out = String::from("# scenario | desired | row | action | wake_at\n");
    let mut row = |name: &str, n: &ManagedNode, desired_slot: bool| {
        let d = decide(n, desired_slot);
        let action = match &d.action {
            None => "-".to_owned(),
            Some(NodeAction::Restart { .. }) => "Restart".to_owned(),
            Some(NodeAction::Insert { .. }) => "Insert".to_owned(),
            Some(a) => format!("{a:?}"),
        };
        let wake = d
            .wake_at
            .map_or("-".to_owned(), |w| w.as_millis().to_string());
        writeln!(
            out,
            "{name} | {desired_slot} | {} | {action} | {wake}",
            d.row.number()
        )
        .unwrap();
    };
    for stage in [
        S::New,
        S::LeaseRequested,
        S::LeaseCreated,
        S::EndpointKnown,
        S::BootstrapRunning,
        S::SwactorJoined,
        S::Dormant,
        S::Failed,
        S::Destroyed,
    ] {
        for desired_slot in [true, false] {
            row(&format!("active {stage:?}"), &node_at(stage), desired_slot);
            let mut del = node_at(stage);
            del.intent = Intent::Deleting;
            row(&format!("deleting {stage:?}"), &del, desired_slot);
            let mut pend = node_at(stage);
            pend.pending = Some(pending(EffectKind::LookupEndpoint, NOW + 10));
            row(&format!("pending {stage:?}"), &pend, desired_slot);
            let mut back = node_at(stage);
            back.retry.next_effect_at = Some(t(NOW + 20));
            back.record.restart_at = Some(t(NOW + 30));
            row(&format!("backoff {stage:?}"), &back, desired_slot);
            let mut amb = node_at(stage);
            amb.intent = Intent::Deleting;
            amb.record.ambiguous = Some(AmbiguousCreate::CreateLease);
            row(&format!("deleting-ambiguous {stage:?}"), &amb, desired_slot);
        }
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/ladder.golden");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(path, &out).unwrap();
    }
    let golden =
        std::fs::read_to_string(path).expect("testdata/ladder.golden (UPDATE_GOLDEN=1 creates it)");
    assert_eq!(
        out, golden,
        "decision table changed; review and run with UPDATE_GOLDEN=1"
    );
}
