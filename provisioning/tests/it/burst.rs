//! A burst of results costs one pass: triggers collapse into the queued pass.

use crate::common;

use common::*;
use swactor_provisioning::*;

#[test]
fn a_thousand_results_in_one_burst_cost_one_pass() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1_000)]))
        .unwrap();
    let creates = drain(&mut d, t(0));
    assert_eq!(creates.len(), 1_000);
    let before = d.stats();
    for disp in &creates {
        assert_eq!(
            d.handle_result(success(disp), t(1)).unwrap(),
            Folded::Applied
        );
    }
    let after_folds = d.stats();
    assert_eq!(after_folds.folded - before.folded, 1_000);
    // The first fold queued the pass; the other 999 collapsed into it.
    assert_eq!(
        after_folds.collapsed_triggers - before.collapsed_triggers,
        999
    );
    let pass = d.poll_pass(t(1)).unwrap().expect("one pass is queued");
    assert_eq!(pass.dispatches.len(), 1_000, "every node's next step");
    d.finish_pass().unwrap();
    assert!(d.poll_pass(t(1)).unwrap().is_none(), "no second pass");
    assert_eq!(d.stats().passes - before.passes, 1);
}
