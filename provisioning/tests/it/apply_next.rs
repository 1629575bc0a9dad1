//! A shape offered as the next generation: the host picks the generation
//! in the same step as it applies, so nothing can take it in between.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn host() -> Host<Driver> {
    Host::new(driver(), HostConfig::default(), None).unwrap()
}

/// The reply the host gave `ticket`.
fn reply(h: &mut Host<Driver>, ticket: Ticket) -> Option<Reply> {
    let mut found = None;
    while let Some(o) = h.poll_output(t(0)) {
        match o {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::Reply(t, r) if t == ticket => found = Some(r),
            _ => {}
        }
    }
    found
}

#[test]
fn the_next_generation_is_one_above_the_current_and_an_identical_shape_changes_nothing() {
    let mut h = host();
    // The generation a shape carries is ignored.
    let first = h.handle_apply_next(&shape(7, vec![group("w", 2)]), Ticket(1), t(0));
    assert_eq!(first, Ok(DesiredUpdate::Accepted(Generation(1))));
    assert_eq!(
        reply(&mut h, Ticket(1)),
        Some(Reply::Applied(Ok(DesiredUpdate::Accepted(Generation(1)))))
    );

    let same = h.handle_apply_next(&shape(99, vec![group("w", 2)]), Ticket(2), t(1));
    assert_eq!(same, Ok(DesiredUpdate::Unchanged(Generation(1))));

    let grown = h.handle_apply_next(&shape(1, vec![group("w", 3)]), Ticket(3), t(2));
    assert_eq!(grown, Ok(DesiredUpdate::Accepted(Generation(2))));
    assert_eq!(h.core().desired().generation, Generation(2));
    assert_eq!(h.core().desired().node_count(), 3);

    // After an explicit generation, the next is one above it.
    h.handle_apply(&shape(5, vec![group("w", 4)]), Ticket(4), t(3))
        .unwrap();
    let next = h.handle_apply_next(&shape(0, vec![group("w", 1)]), Ticket(5), t(4));
    assert_eq!(next, Ok(DesiredUpdate::Accepted(Generation(6))));
}

#[test]
fn a_shape_the_contract_refuses_is_refused_as_an_apply_would_be() {
    let mut h = host();
    h.handle_apply_next(&shape(0, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let mut other = shape(0, vec![group("w", 1)]);
    other.run_id = RunId::new("another");
    let refused = h.handle_apply_next(&other, Ticket(2), t(1));
    assert!(
        matches!(
            refused,
            Err(ApplyError::Update(UpdateError::RunMismatch { .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(h.core().desired().generation, Generation(1));

    h.handle_shutdown(ShutdownMode::Teardown, Ticket(3), t(2));
    let late = h.handle_apply_next(&shape(0, vec![group("w", 2)]), Ticket(4), t(3));
    assert_eq!(late, Err(ApplyError::ShuttingDown));
}
