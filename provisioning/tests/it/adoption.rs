//! Waiting for the adoption: a start that offers a shape is told, by a
//! ticket, when the provider's inventory and the journal have been adopted,
//! instead of asking again and again.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// Drains the host's outputs at `now` (writes durable at once); the list
/// request is left unanswered. Returns the replies and whether a listing
/// was asked for.
fn replies(h: &mut Host<Driver>, now: Timestamp) -> (Vec<(Ticket, Reply)>, bool) {
    let mut out = Vec::new();
    let mut listing = false;
    while let Some(o) = h.poll_output(now) {
        match o {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::List => listing = true,
            Output::Reply(t, r) => out.push((t, r)),
            _ => {}
        }
    }
    (out, listing)
}

#[test]
fn a_waiter_is_answered_once_the_inventory_is_adopted_and_at_once_after() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_wait_adopted(Ticket(7));
    let (early, listing) = replies(&mut h, t(0));
    assert!(listing, "the host asks for the provider's inventory");
    assert!(early.is_empty(), "{early:?}");
    assert!(!h.adopted());

    h.handle_inventory(Ok(Vec::new()), t(1));
    let (answered, _) = replies(&mut h, t(1));
    assert!(h.adopted());
    assert_eq!(answered, vec![(Ticket(7), Reply::Adopted)]);

    h.handle_wait_adopted(Ticket(8));
    let (late, _) = replies(&mut h, t(2));
    assert_eq!(late, vec![(Ticket(8), Reply::Adopted)]);
}

#[test]
fn a_restarted_host_answers_only_after_the_journals_nodes_are_listed() {
    // A first host converges one node and keeps its journal.
    let mut first = Host::new(driver(), HostConfig::default(), None).unwrap();
    let mut journal = JournalImage::new(first.core().state().run_id.clone());
    first
        .handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let created: Vec<ResourceKey> =
        pump_host(&mut first, Some(&mut journal), &[], &mut Vec::new(), t(0))
            .into_iter()
            .filter(|d| d.request.kind() == EffectKind::CreateLease)
            .map(|d| d.key)
            .collect();
    assert_eq!(created.len(), 1);

    // The next daemon's host waits for the listing of that node.
    let mut next = Host::new(driver(), HostConfig::default(), Some(journal)).unwrap();
    next.handle_wait_adopted(Ticket(9));
    let (early, listing) = replies(&mut next, t(10));
    assert!(listing);
    assert!(early.is_empty(), "{early:?}");
    let listed = Listed {
        key: created[0].clone(),
        lease: Some(LeaseId::from("lease-w-0")),
        session: None,
    };
    next.handle_inventory(Ok(vec![listed]), t(11));
    let (answered, _) = replies(&mut next, t(11));
    assert!(next.adopted());
    assert!(
        answered.contains(&(Ticket(9), Reply::Adopted)),
        "{answered:?}"
    );
}

#[test]
fn a_host_that_stops_before_adopting_tells_its_waiters() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_wait_adopted(Ticket(3));
    let _ = replies(&mut h, t(0));
    h.handle_shutdown(ShutdownMode::Keep, Ticket(4), t(1));
    let (answered, _) = replies(&mut h, t(1));
    assert!(
        answered.contains(&(Ticket(3), Reply::Stopped)),
        "{answered:?}"
    );
    // Once stopped, a new waiter is told at once.
    h.handle_wait_adopted(Ticket(5));
    let (late, _) = replies(&mut h, t(2));
    assert_eq!(late, vec![(Ticket(5), Reply::Stopped)]);
}
