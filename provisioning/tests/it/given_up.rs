//! A release the provider gave up (its machine did not answer for too
//! long) ends the attempt's hold on the slot as a done one does, and the
//! host says so: an event, a count, and a note in the attempt's history.

use crate::common;

use common::*;
use swactor_provisioning::*;

const WHY: &str = "h1 has not answered for 60s (unreachable_give_up_s)";

/// A host whose one node `w-0` was created, looked up and started (its
/// bootstrap runs), then asked at t=10 to scale to none.
fn scaling_down_one_started_node() -> Host<Driver> {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    for _ in 0..3 {
        for d in drain_host(&mut h, t(0)) {
            let _ = h.handle_result(success(&d), t(0)).unwrap();
        }
    }
    assert!(
        h.core().state().nodes[&node_id("w-0")]
            .record
            .session
            .is_some()
    );
    while h.poll_event().is_some() {}
    h.handle_apply(&shape(2, vec![group("w", 0)]), Ticket(2), t(10))
        .unwrap();
    h
}

#[test]
fn a_given_up_release_frees_the_slot_and_is_told() {
    let mut h = scaling_down_one_started_node();
    let w0 = node_id("w-0");
    let attempt = h.core().state().nodes[&w0].attempt;
    // Scaled to none: the session and then the lease are given up.
    let mut given_up = Vec::new();
    for _ in 0..4 {
        for d in drain_host(&mut h, t(10)) {
            let outcome = match d.request {
                EffectRequest::CancelBootstrap { .. } => OperationOutcome::BootstrapGivenUp {
                    reason: format!("stopping its agent: {WHY}"),
                },
                EffectRequest::DestroyLease { .. } => OperationOutcome::LeaseGivenUp {
                    reason: format!("its lease: {WHY}"),
                },
                ref other => panic!("a scale-down dispatched {other:?}"),
            };
            let folded = h.handle_result(result(&d, outcome), t(10)).unwrap();
            assert_eq!(folded, Folded::Applied);
        }
        while let Some(e) = h.poll_event() {
            if let HostEvent::GivenUp { key, reason } = e {
                given_up.push((key, reason));
            }
        }
    }
    assert!(
        !h.core().state().nodes.contains_key(&w0),
        "the slot is let go as after a destroy"
    );
    assert_eq!(given_up.len(), 2, "{given_up:?}");
    for (key, reason) in &given_up {
        assert_eq!((key.node, key.attempt), (w0, attempt));
        assert!(reason.ends_with(WHY), "{reason}");
    }
    assert_eq!(h.given_up_total(), 2);
    let history = h.history(&w0).expect("the departed slot's history");
    let last = history.last().unwrap();
    assert_eq!(last.attempt, attempt);
    assert_eq!(
        last.left_behind.as_deref(),
        Some(&*format!("its lease: {WHY}"))
    );
}

#[test]
fn a_done_release_leaves_nothing_behind() {
    let mut h = scaling_down_one_started_node();
    for _ in 0..4 {
        for d in drain_host(&mut h, t(10)) {
            let _ = h.handle_result(success(&d), t(10)).unwrap();
        }
        while let Some(e) = h.poll_event() {
            assert!(!matches!(e, HostEvent::GivenUp { .. }), "{e:?}");
        }
    }
    assert_eq!(h.given_up_total(), 0);
    let history = h.history(&node_id("w-0")).unwrap();
    assert_eq!(history.last().unwrap().left_behind, None);
}

#[test]
fn outcomes_say_whether_a_release_was_given_up() {
    let why = "away".to_owned();
    assert_eq!(
        OperationOutcome::destroyed(Release::Done),
        OperationOutcome::LeaseDestroyed
    );
    assert_eq!(
        OperationOutcome::cancelled(Release::Done),
        OperationOutcome::BootstrapCancelled
    );
    let lease = OperationOutcome::destroyed(Release::GivenUp(why.clone()));
    let session = OperationOutcome::cancelled(Release::GivenUp(why.clone()));
    assert_eq!(lease.given_up(), Some("away"));
    assert_eq!(session.given_up(), Some("away"));
    assert_eq!(OperationOutcome::LeaseDestroyed.given_up(), None);
}
