//! An operator's replace: the node's current attempt fails with a reason
//! that says so, goes through the normal cleanup ladder (cancel, destroy),
//! and only then does a new attempt start; never two live attempts.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// A host over a fresh driver, whose bootstrap streams prove joins.
fn host() -> Host<Driver> {
    let config = HostConfig {
        stream_joins: true,
        ..HostConfig::default()
    };
    Host::new(driver(), config, None).unwrap()
}

/// Runs the host's outputs with a perfectly behaved provider until it has
/// nothing left to do at `now`; returns every dispatch, in order.
fn pump(h: &mut Host<Driver>, now: Timestamp) -> Vec<Dispatch> {
    let mut log = Vec::new();
    for _ in 0..64 {
        let round = drain_host(h, now);
        if round.is_empty() {
            break;
        }
        // Answer this round's dispatches; a started bootstrap joins and converges.
        for d in &round {
            assert_eq!(h.handle_result(success(d), now).unwrap(), Folded::Applied);
            if d.request.kind() == EffectKind::StartBootstrap {
                let n = &h.core().state().nodes[&d.key.node];
                let (attempt, session) = (n.attempt, n.record.session.clone());
                for event in [
                    BootstrapEvent::SwactorJoined,
                    BootstrapEvent::Stage(BootstrapStage::Converged),
                ] {
                    let obs = BootstrapObservation {
                        node: d.key.node,
                        attempt,
                        session: session.clone().expect("a live session"),
                        event,
                    };
                    assert_eq!(h.handle_bootstrap(obs, now).unwrap(), Folded::Applied);
                }
            }
        }
        log.extend(round);
    }
    log
}

fn converged_host(count: u32) -> Host<Driver> {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", count)]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, t(0));
    assert!(h.is_converged(), "{:#?}", h.core().state());
    h
}

#[test]
fn an_operator_replace_cleans_up_the_old_attempt_before_starting_a_new_one() {
    let mut h = converged_host(2);
    let w1 = node_id("w-1");
    let old = h.core().state().nodes[&w1].attempt;
    let other = h.core().state().nodes[&node_id("w-0")].attempt;

    assert_eq!(h.handle_replace(&w1, Ticket(101), t(10)), Ok(old));
    let dispatches = pump(&mut h, t(10));
    // The old attempt is failed with the operator's reason.
    let history = h.history(&w1).expect("w-1 has a history");
    assert!(
        history
            .iter()
            .any(|a| a.attempt == old && a.failed_reason.as_deref() == Some(REPLACED_BY_OPERATOR)),
        "{history:#?}"
    );
    // Cleanup first: cancel then destroy for the old attempt, and only then a
    // create for a new attempt (after backoff, so time moves on).
    let kinds: Vec<(NodeAttemptId, EffectKind)> = dispatches
        .iter()
        .filter(|d| d.key.node == w1)
        .map(|d| (d.key.attempt, d.request.kind()))
        .collect();
    assert_eq!(
        kinds,
        [
            (old, EffectKind::CancelBootstrap),
            (old, EffectKind::DestroyLease)
        ]
    );
    let mut now = t(10);
    for _ in 0..100 {
        now = now.saturating_add_ms(1_000);
        let _ = h.handle_timeout(now);
        pump(&mut h, now);
        if h.is_converged() {
            break;
        }
    }
    assert!(h.is_converged(), "{:#?}", h.core().state());
    let new = h.core().state().nodes[&w1].attempt;
    assert!(new > old, "a new attempt ({new}) replaced {old}");
    assert_eq!(
        h.core().state().nodes[&node_id("w-0")].attempt,
        other,
        "the other node is untouched"
    );
}

#[test]
fn a_replace_of_an_unknown_or_failed_node_is_refused_and_changes_nothing() {
    let mut h = converged_host(1);
    assert_eq!(
        h.handle_replace(&node_id("w-7"), Ticket(102), t(1)),
        Err(ReplaceError::UnknownNode(node_id("w-7")))
    );
    let w0 = node_id("w-0");
    let attempt = h.core().state().nodes[&w0].attempt;
    assert_eq!(h.handle_replace(&w0, Ticket(103), t(1)), Ok(attempt));
    // Folded: the node is failed now, and a second replace is refused.
    while let Some(out) = h.poll_output(t(1)) {
        if let Output::Persist(delta) = out {
            h.handle_persisted(delta.seq);
        }
    }
    assert_eq!(
        h.core().state().nodes[&w0].record.stage,
        NodeStage::Failed,
        "the replace failed the attempt"
    );
    assert_eq!(
        h.handle_replace(&w0, Ticket(104), t(2)),
        Err(ReplaceError::NotActive(w0))
    );
}

#[test]
fn a_replace_of_a_node_with_an_operation_in_flight_is_refused() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    // Run the outputs without answering: the create stays in flight.
    while let Some(out) = h.poll_output(t(0)) {
        match out {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::List => h.handle_inventory(Ok(Vec::new()), t(0)),
            _ => {}
        }
    }
    let w0 = node_id("w-0");
    assert_eq!(
        h.handle_replace(&w0, Ticket(105), t(1)),
        Err(ReplaceError::Busy {
            node: w0,
            effect: EffectKind::CreateLease
        })
    );
}

#[test]
fn a_destroyed_attempt_has_no_agent_link_left() {
    let mut h = converged_host(1);
    let w0 = node_id("w-0");
    let old = h.core().state().nodes[&w0].attempt;
    assert_eq!(h.link(&w0), Some(Link::Connected(old)), "it joined");

    assert_eq!(h.handle_replace(&w0, Ticket(106), t(10)), Ok(old));
    pump(&mut h, t(10));
    // Cleaned up, and waiting out its backoff before the next attempt.
    let n = &h.core().state().nodes[&w0];
    assert_eq!((n.attempt, n.record.stage), (old, NodeStage::Destroyed));
    assert_eq!(
        h.link(&w0),
        None,
        "a destroyed attempt's agent is gone; its link must not say connected"
    );
}

#[test]
fn a_shutdown_that_keeps_nodes_keeps_only_those_with_a_machine() {
    let mut h = converged_host(2);
    let (w0, w1) = (node_id("w-0"), node_id("w-1"));
    let old = h.core().state().nodes[&w1].attempt;
    assert_eq!(h.handle_replace(&w1, Ticket(107), t(10)), Ok(old));
    pump(&mut h, t(10));
    let n = &h.core().state().nodes[&w1];
    assert_eq!(
        (n.record.stage, &n.record.lease),
        (NodeStage::Destroyed, &None)
    );

    h.handle_shutdown(ShutdownMode::Keep, Ticket(9), t(11));
    let mut report = None;
    while let Some(out) = h.poll_output(t(11)) {
        match out {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::Reply(Ticket(9), Reply::Shutdown(r)) => report = Some(r),
            _ => {}
        }
    }
    let report = report.expect("the shutdown was answered");
    assert_eq!(report.kept, [w0], "w-0 runs on");
    assert_eq!(
        report.without_machine,
        [w1],
        "w-1 failed and its machine is gone: nothing of it was kept"
    );
    assert!(report.destroyed.is_empty());
}
