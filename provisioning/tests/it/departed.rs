//! Attempt histories of slots that left: at most a bounded number are kept,
//! and one that was let go is not made again, empty, when the slot's
//! departure is seen afterwards.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// Drains the host's outputs at `now`, answering every dispatch with
/// success, until it has nothing more to do.
fn settle(h: &mut Host<Driver>, now: Timestamp) {
    loop {
        let dispatches = drain_host(h, now);
        if dispatches.is_empty() {
            return;
        }
        for d in &dispatches {
            let _ = h.handle_result(success(d), now).unwrap();
        }
    }
}

#[test]
fn a_large_scale_down_keeps_a_bounded_departed_history_and_no_empty_one() {
    let total = 4 * DEPARTED_HISTORY_MAX as u32 + 100;
    let kept = 100;
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_apply(&shape(1, vec![group("w", total)]), Ticket(1), t(0))
        .unwrap();
    settle(&mut h, t(0));
    assert_eq!(h.core().state().nodes.len(), total as usize);
    h.handle_apply(&shape(2, vec![group("w", kept)]), Ticket(2), t(10))
        .unwrap();
    settle(&mut h, t(10));
    let nodes = &h.core().state().nodes;
    assert_eq!(nodes.len(), kept as usize, "the scale-down is done");
    let mut remembered = 0;
    for index in kept..total {
        let id = node_id(&format!("w-{index}"));
        if let Some(records) = h.history(&id) {
            assert!(
                !records.is_empty(),
                "{id}: a departed slot's history was made again, empty"
            );
            remembered += 1;
        }
    }
    assert!(remembered > 0, "the latest departures are remembered");
    assert!(
        remembered <= 2 * DEPARTED_HISTORY_MAX,
        "{remembered} departed histories kept"
    );
    for index in 0..kept {
        let id = node_id(&format!("w-{index}"));
        assert!(
            h.history(&id).is_some_and(|r| !r.is_empty()),
            "{id}: a live slot keeps its history"
        );
    }
}

#[test]
fn a_large_cluster_trims_departed_histories_only_after_an_eighth_of_its_size() {
    // 8,000 stay: the trim waits for 1,000 departures (an eighth), so the
    // 900 that leave are all remembered; a small cluster trims at 512.
    let (stay, leave) = (8_000u32, 900u32);
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_apply(&shape(1, vec![group("w", stay + leave)]), Ticket(1), t(0))
        .unwrap();
    settle(&mut h, t(0));
    h.handle_apply(&shape(2, vec![group("w", stay)]), Ticket(2), t(10))
        .unwrap();
    settle(&mut h, t(10));
    assert_eq!(h.core().state().nodes.len(), stay as usize);
    let remembered = (stay..stay + leave)
        .filter(|i| h.history(&node_id(&format!("w-{i}"))).is_some())
        .count();
    assert_eq!(remembered, leave as usize, "no trim below an eighth");
}
