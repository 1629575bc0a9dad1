//! An executor lane that crashes: every operation it held that its node
//! still waits on folds as ambiguous, and nothing of the other lanes moves.

use crate::common;

use common::*;
use swactor_provisioning::*;

#[test]
fn a_lost_lane_folds_its_own_operations_only() {
    let config = HostConfig {
        lanes: 2,
        ..HostConfig::default()
    };
    let mut h = Host::new(driver(), config, None).unwrap();
    h.handle_apply(&shape(1, vec![group("w", 6)]), Ticket(1), t(0))
        .unwrap();
    let creates = drain_host(&mut h, t(0));
    assert_eq!(creates.len(), 6);
    assert_eq!(h.in_flight_count(), 6);
    let (lost, kept): (Vec<_>, Vec<_>) = creates.iter().partition(|d| h.lane_of(d.op.attempt) == 0);
    assert!(!lost.is_empty() && !kept.is_empty(), "both lanes hold some");

    h.handle_lane_lost(0);
    assert_eq!(h.in_flight_count(), kept.len(), "the lost lane's are out");
    drain_host(&mut h, t(1));
    let nodes = &h.core().state().nodes;
    for d in &lost {
        let n = &nodes[&d.key.node];
        assert_ne!(
            n.pending.as_ref().map(|p| p.id),
            Some(d.op),
            "{}: a lost operation is no longer waited on",
            d.key.node
        );
        assert!(
            n.record
                .last_error()
                .is_some_and(|e| e.contains("executor crashed")),
            "{}: {:?}",
            d.key.node,
            n.record.last_error()
        );
    }
    for d in &kept {
        let n = &nodes[&d.key.node];
        assert_eq!(
            n.pending.as_ref().map(|p| p.id),
            Some(d.op),
            "{}",
            d.key.node
        );
    }
    // The other lane's results still fold, and leave the in-flight table.
    for d in &kept {
        assert_eq!(h.handle_result(success(d), t(2)).unwrap(), Folded::Applied);
    }
    assert_eq!(h.in_flight_count(), 0);
}
