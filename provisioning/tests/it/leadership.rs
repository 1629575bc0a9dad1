//! A host that may act only while it leads: past the instant the replica
//! layer gave it, nothing that acts leaves it (no journal write, pass,
//! listing, collection or probe), its inputs are still folded, and told of
//! a later instant it goes on where it stopped.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// Every output the host gives at `now`, acting ones carried out as a
/// daemon would (writes acknowledged, listings answered empty).
fn outputs(h: &mut Host<Driver>, now: Timestamp) -> Vec<Output> {
    let mut out = Vec::new();
    while let Some(o) = h.poll_output(now) {
        match &o {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::List => h.handle_inventory(Ok(Vec::new()), now),
            _ => {}
        }
        out.push(o);
    }
    out
}

fn acting(outs: &[Output]) -> usize {
    outs.iter().filter(|o| o.acts()).count()
}

#[test]
fn a_host_past_its_leadership_writes_and_dispatches_nothing_until_renewed() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    h.handle_leadership(Leadership::Until(t(1_000)), t(0));
    h.handle_apply(&shape(1, vec![group("w", 2)]), Ticket(1), t(0))
        .unwrap();
    // Leading: the apply is written, the provider listed, creates go out.
    let first = outputs(&mut h, t(10));
    assert!(first.iter().any(|o| matches!(o, Output::Persist(_))));
    let creates: Vec<Dispatch> = first
        .iter()
        .filter_map(|o| match o {
            Output::Pass(p) => Some(p.dispatches.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(creates.len(), 2, "{first:?}");

    // The leadership lapses (the replica layer did not renew it). The
    // creates' results are folded, but nothing acts: no write of what they
    // changed, no next step.
    for d in &creates {
        let folded = h.handle_result(success(d), t(1_000)).unwrap();
        assert_eq!(folded, Folded::Applied);
    }
    assert!(!h.leads(t(1_000)));
    let lapsed = outputs(&mut h, t(1_000));
    assert_eq!(acting(&lapsed), 0, "{lapsed:?}");
    let lapsed = outputs(&mut h, t(60_000));
    assert_eq!(acting(&lapsed), 0, "a minute later: {lapsed:?}");
    // An apply while not leading is folded and answered only once durable:
    // no reply, no write yet.
    h.handle_apply(&shape(2, vec![group("w", 3)]), Ticket(2), t(60_000))
        .unwrap();
    let held = outputs(&mut h, t(60_000));
    assert_eq!(acting(&held), 0, "{held:?}");
    assert!(
        !held
            .iter()
            .any(|o| matches!(o, Output::Reply(Ticket(2), _)))
    );
    // People are told, once.
    let warnings: Vec<HostEvent> = std::iter::from_fn(|| h.poll_event())
        .filter(|e| matches!(e, HostEvent::Warning(w) if w.contains("leadership")))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");

    // Renewed: what waited goes out, in order, the write first.
    h.handle_leadership(Leadership::Until(t(120_000)), t(60_000));
    let renewed = outputs(&mut h, t(60_001));
    assert!(
        matches!(renewed.first(), Some(Output::Persist(_))),
        "{renewed:?}"
    );
    assert!(
        renewed
            .iter()
            .any(|o| matches!(o, Output::Pass(p) if !p.dispatches.is_empty())),
        "the next steps and the third node: {renewed:?}"
    );
    assert!(
        renewed
            .iter()
            .any(|o| matches!(o, Output::Reply(Ticket(2), _)))
    );
}

#[test]
fn a_host_alone_on_its_journal_always_leads() {
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    assert!(h.leads(t(u64::MAX / 2)));
    h.handle_leadership(Leadership::Until(t(5)), t(0));
    assert!(
        h.leads(t(4)) && !h.leads(t(5)),
        "the instant itself is past it"
    );
    h.handle_leadership(Leadership::Always, t(6));
    assert!(h.leads(t(u64::MAX / 2)));
}
