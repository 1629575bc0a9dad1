//! Allocation counts of the driver's hot paths. Counts, not timings: the
//! counting allocator of `allocation-counter` replaces this test binary's
//! global allocator and counts what the measured closure allocates on its
//! own thread.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// A settled cluster of `n` nodes in two groups, and the observation that
/// folds on its first node without changing what the node needs.
fn settled(n: u32) -> (Driver, BootstrapObservation) {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("a", n / 2), group("b", n - n / 2)]))
        .unwrap();
    converge(&mut d, t(0));
    let o = observe(&d, "a-0", BootstrapEvent::Stage(BootstrapStage::Converged));
    (d, o)
}

#[test]
fn a_settled_pass_after_one_fold_allocates_nothing() {
    let (mut d, o) = settled(1_000);
    // The first fold and pass size the driver's reusable buffers.
    for round in 0..3u64 {
        let now = t(1 + round);
        assert_eq!(d.handle_bootstrap(o.clone(), now).unwrap(), Folded::Applied);
        assert!(d.is_pass_queued());
        let info = allocation_counter::measure(|| {
            let pass = d.poll_pass(now).unwrap().expect("a pass is queued");
            assert!(pass.dispatches.is_empty() && pass.transitioned.is_empty());
            d.finish_pass().unwrap();
        });
        if round > 0 {
            assert_eq!(info.count_total, 0, "round {round}: {info:?}");
        }
    }
    assert!(!d.is_pass_queued());
    assert!(d.is_converged());
}

#[test]
fn a_fold_on_a_settled_node_allocates_nothing_once_buffers_are_sized() {
    let (mut d, o) = settled(1_000);
    assert_eq!(
        d.handle_bootstrap(o.clone(), t(1)).unwrap(),
        Folded::Applied
    );
    let _ = d.poll_pass(t(1)).unwrap();
    d.finish_pass().unwrap();
    let o2 = o.clone();
    let info = allocation_counter::measure(|| {
        assert_eq!(d.handle_bootstrap(o2, t(2)).unwrap(), Folded::Applied);
    });
    assert_eq!(info.count_total, 0, "{info:?}");
}

#[test]
fn next_pass_plan_does_not_copy_the_driver() {
    let (mut d, o) = settled(2_000);
    assert_eq!(d.handle_bootstrap(o, t(1)).unwrap(), Folded::Applied);
    let info = allocation_counter::measure(|| {
        let plan = d.next_pass_plan(t(1));
        assert!(plan.actions.is_empty());
    });
    // A copy of 2,000 nodes would allocate thousands of times; the plan of
    // one dirty node needs only its candidate and update buffers.
    assert!(info.count_total <= 4, "{info:?}");
    assert_eq!(d.next_pass_plan(t(1)), d.plan(t(1)));
}
