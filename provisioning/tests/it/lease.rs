//! The dead-man's switch as the host decides it: a joined agent is given
//! its group's lease and how often it is renewed; changing the lease
//! replaces no node.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// A host whose one node `w-0` was created, looked up and started, from
/// a group whose policy is `policy`.
fn started(policy: PolicyShape) -> (Host<Driver>, ResourceKey) {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    let mut g = group("w", 1);
    g.policy = policy;
    h.handle_apply(&shape(1, vec![g]), Ticket(1), t(0)).unwrap();
    for _ in 0..3 {
        for d in drain_host(&mut h, t(0)) {
            let _ = h.handle_result(success(&d), t(0)).unwrap();
        }
    }
    let n = &h.core().state().nodes[&node_id("w-0")];
    let key = ResourceKey {
        run_id: h.core().state().run_id.clone(),
        node: node_id("w-0"),
        attempt: n.attempt,
    };
    (h, key)
}

#[test]
fn a_joined_agent_gets_its_groups_lease_an_hour_by_default() {
    let (mut h, key) = started(PolicyShape::default());
    let l = h.handle_agent_joined(&key, t(1)).unwrap();
    assert_eq!(l.lease_ms, 3_600_000);
    assert_eq!(l.renew_every_ms, Liveness::RENEW_EVERY_MAX_MS);

    let (mut h, key) = started(PolicyShape {
        orphan_after_s: Some(5),
        ..PolicyShape::default()
    });
    let l = h.handle_agent_joined(&key, t(1)).unwrap();
    assert_eq!((l.lease_ms, l.renew_every_ms), (5_000, 1_000));

    let (mut h, key) = started(PolicyShape {
        orphan_after_s: Some(0),
        ..PolicyShape::default()
    });
    let l = h.handle_agent_joined(&key, t(1)).unwrap();
    assert_eq!((l.lease_ms, l.renew_every_ms), (0, 0), "0 turns it off");
}

#[test]
fn a_new_lease_replaces_no_node_and_the_next_join_gets_it() {
    let (mut h, key) = started(PolicyShape::default());
    let _ = h.handle_agent_joined(&key, t(1)).unwrap();
    let mut g = group("w", 1);
    g.policy.orphan_after_s = Some(60);
    h.handle_apply(&shape(2, vec![g]), Ticket(2), t(2)).unwrap();
    let dispatched = drain_host(&mut h, t(2));
    assert!(dispatched.is_empty(), "{dispatched:?}");
    assert_eq!(h.core().state().nodes[&node_id("w-0")].attempt, key.attempt);
    let l = h.handle_agent_joined(&key, t(3)).unwrap();
    assert_eq!(l.lease_ms, 60_000);
}
