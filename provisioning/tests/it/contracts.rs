//! The core's contracts with its caller, checked where they are made (in
//! debug builds, as tests run).

use crate::common;

use common::*;
use swactor_provisioning::*;

/// The first delta a host asks to make durable.
fn first_delta(h: &mut Host<Driver>) -> JournalDelta {
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    loop {
        match h.poll_output(t(0)) {
            Some(Output::Persist(delta)) => return delta,
            Some(Output::List) => h.handle_inventory(Ok(Vec::new()), t(0)),
            Some(_) => {}
            None => panic!("no delta to persist"),
        }
    }
}

#[test]
fn the_delta_awaited_is_the_one_persisted() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    let delta = first_delta(&mut h);
    // Nothing more comes out until it is durable.
    assert!(h.poll_output(t(0)).is_none());
    h.handle_persisted(delta.seq);
    assert!(h.poll_output(t(0)).is_some());
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "only the delta the host awaits can be made durable")]
fn persisting_a_delta_the_host_did_not_ask_for_is_a_contract_breach() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    let delta = first_delta(&mut h);
    h.handle_persisted(delta.seq + 1);
}
