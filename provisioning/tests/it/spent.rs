//! What a run has spent is a floor the journal keeps: it never goes down,
//! it is written once it has risen a cent, and a host started from the
//! journal starts from it.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// Drains `h` as a daemon would, keeping every committed write in `journal`.
fn drain_into(h: &mut Host<Driver>, journal: &mut JournalImage, now: Timestamp) -> usize {
    let mut writes = 0;
    while let Some(o) = h.poll_output(now) {
        match o {
            Output::Persist(delta) => {
                writes += usize::from(delta.meta.is_some());
                journal.apply(&delta);
                h.handle_persisted(delta.seq);
            }
            Output::List => h.handle_inventory(Ok(Vec::new()), now),
            _ => {}
        }
    }
    writes
}

#[test]
fn the_spend_never_goes_down_and_is_journaled_a_cent_at_a_time() {
    let mut journal = JournalImage::new(RunId::new("run"));
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    drain_into(&mut h, &mut journal, t(0));
    assert_eq!(h.spent_micros(), 0);
    assert_eq!(h.handle_spent(4_000), 4_000);
    assert_eq!(drain_into(&mut h, &mut journal, t(1)), 0, "under a cent");
    assert_eq!(journal.meta.spent_micros, 0);
    assert_eq!(
        h.handle_spent(SPENT_RECORD_STEP_MICROS),
        SPENT_RECORD_STEP_MICROS
    );
    assert_eq!(drain_into(&mut h, &mut journal, t(2)), 1);
    assert_eq!(journal.meta.spent_micros, SPENT_RECORD_STEP_MICROS);
    // A provider that lost its records counts less: the run's spend stays.
    assert_eq!(h.handle_spent(1_000), SPENT_RECORD_STEP_MICROS);
    assert_eq!(drain_into(&mut h, &mut journal, t(3)), 0);
    assert_eq!(h.handle_spent(35_000), 35_000);
    drain_into(&mut h, &mut journal, t(4));
    assert_eq!(journal.meta.spent_micros, 35_000);

    // A host started from the journal (its provider's records gone).
    let mut h = Host::new(driver(), HostConfig::default(), Some(journal.clone())).unwrap();
    drain_into(&mut h, &mut journal, t(5));
    assert_eq!(h.spent_micros(), 35_000);
    assert_eq!(h.handle_spent(0), 35_000);
    // Kept as JSON; a journal written before it reads back as 0.
    let json = serde_json::to_value(&journal.meta).unwrap();
    assert_eq!(json["spent_micros"], 35_000);
    let mut old = json.clone();
    old.as_object_mut().unwrap().remove("spent_micros");
    let meta: JournalMeta = serde_json::from_value(old).unwrap();
    assert_eq!(meta.spent_micros, 0);
}
