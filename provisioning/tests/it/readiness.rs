//! What every view calls ready: a ready attempt whose agent is not away.

use crate::common;

use common::*;
use swactor_provisioning::*;

#[test]
fn a_node_is_shown_ready_only_while_its_current_agent_is_not_away() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    pump_host(&mut h, None, &[], &mut Vec::new(), t(0));
    let w0 = node_id("w-0");
    let node = h.core().state().nodes[&w0].clone();
    assert!(node.is_ready());
    let connected = h.link(&w0);
    assert_eq!(connected, Some(Link::Connected(node.attempt)));
    assert!(Link::shows_ready(connected, &node));
    // Never joined this host (a host that has not heard it yet).
    assert!(Link::shows_ready(None, &node));

    // Its agent goes away: not ready until it is back, though the core
    // still holds the attempt as ready.
    let key = ResourceKey {
        run_id: h.core().state().run_id.clone(),
        node: w0,
        attempt: node.attempt,
    };
    h.handle_agent_gone(&key, 0, t(10));
    let away = h.link(&w0);
    assert!(matches!(away, Some(Link::Away { .. })), "{away:?}");
    let node = h.core().state().nodes[&w0].clone();
    assert!(node.is_ready());
    assert!(!Link::shows_ready(away, &node));

    // An away link of another attempt says nothing of this one.
    let other = Link::Away {
        attempt: NodeAttemptId(node.attempt.0 + 1),
        until: t(100),
    };
    assert!(Link::shows_ready(Some(other), &node));
}
