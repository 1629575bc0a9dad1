//! A run's lifetimes in the host: the apply that sets one arms it from the
//! wall clock, durably before its reply; every later apply that sets it
//! (the same content included) arms it again; a busy stretch is recorded;
//! and a host started from the journal keeps every deadline.

use crate::common;

use common::*;
use proptest::prelude::*;
use swactor_provisioning::lifetime::{Lifetime, Status, Verdict, Which};
use swactor_provisioning::*;

/// A wall-clock instant (ms since the Unix epoch) the tests count from.
const W0: u64 = 1_700_000_000_000;

fn lived(max_s: u64, idle_s: u64) -> ClusterShape {
    let mut s = shape(1, vec![group("w", 1)]);
    s.lifetime = Lifetime {
        max_lifetime_s: max_s,
        idle_teardown_s: idle_s,
    };
    s
}

/// Drains `h` as a daemon would, keeping every committed write in
/// `journal`; returns the replies, in order.
fn drain_into(h: &mut Host<Driver>, journal: &mut JournalImage, now: Timestamp) -> Vec<Reply> {
    let mut replies = Vec::new();
    while let Some(o) = h.poll_output(now) {
        match o {
            Output::Persist(delta) => {
                journal.apply(&delta);
                h.handle_persisted(delta.seq);
            }
            Output::List => h.handle_inventory(Ok(Vec::new()), now),
            Output::Reply(_, reply) => replies.push(reply),
            _ => {}
        }
    }
    replies
}

/// The host's monotonic instant for a wall-clock one: its clock started
/// at `W0`.
fn at(wall_ms: u64) -> Timestamp {
    t(wall_ms - W0)
}

/// Applies `s` at wall-clock `wall_ms` as the driver actor does (the wall
/// clock first, then the next generation); returns the update once it is
/// durable.
fn apply_at(
    h: &mut Host<Driver>,
    journal: &mut JournalImage,
    s: &ClusterShape,
    wall_ms: u64,
) -> DesiredUpdate {
    h.handle_wall_clock(wall_ms, at(wall_ms));
    let update = h
        .handle_apply_next(s, Ticket(wall_ms), at(wall_ms))
        .unwrap();
    let replies = drain_into(h, journal, at(wall_ms));
    assert!(replies.contains(&Reply::Applied(Ok(update))), "{replies:?}");
    update
}

fn check_at(h: &mut Host<Driver>, wall_ms: u64, running: bool) -> Option<Status> {
    h.handle_lifetime(wall_ms, running, at(wall_ms))
}

#[test]
fn an_apply_arms_the_max_lifetime_durably_and_a_restarted_host_keeps_the_deadline() {
    let mut journal = JournalImage::new(RunId::new("run"));
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    drain_into(&mut h, &mut journal, at(W0));
    assert_eq!(
        apply_at(&mut h, &mut journal, &lived(6, 0), W0 + 1_000),
        DesiredUpdate::Accepted(Generation(1))
    );
    // Durable with the shape, before the reply.
    assert_eq!(journal.meta.lifetime.applied_wall_ms, Some(W0 + 1_000));
    let s = check_at(&mut h, W0 + 3_000, false).unwrap();
    assert_eq!(
        s.verdict,
        Verdict::Within {
            left_ms: 4_000,
            which: Which::MaxLifetime
        }
    );
    // A host started from the journal (a daemon killed and started again,
    // its monotonic clock from zero) keeps the deadline of the first.
    let mut h = Host::new(driver(), HostConfig::default(), Some(journal.clone())).unwrap();
    drain_into(&mut h, &mut journal, t(0));
    assert_eq!(h.lifetime_status(t(0)), None, "no wall clock read yet");
    let s = h.handle_lifetime(W0 + 5_000, false, t(10)).unwrap();
    assert_eq!(
        s.verdict,
        Verdict::Within {
            left_ms: 2_000,
            which: Which::MaxLifetime
        }
    );
    // Views reckon the wall clock from the last reading.
    assert!(matches!(
        h.lifetime_status(t(1_010)).unwrap().verdict,
        Verdict::Within { left_ms: 1_000, .. }
    ));
    assert_eq!(
        h.handle_lifetime(W0 + 7_000, true, t(2_010))
            .unwrap()
            .verdict,
        Verdict::Reached(Which::MaxLifetime)
    );
}

#[test]
fn every_apply_that_sets_a_lifetime_extends_it_even_with_the_same_content() {
    let mut journal = JournalImage::new(RunId::new("run"));
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    drain_into(&mut h, &mut journal, at(W0));
    apply_at(&mut h, &mut journal, &lived(60, 0), W0);
    assert_eq!(
        apply_at(&mut h, &mut journal, &lived(60, 0), W0 + 50_000),
        DesiredUpdate::Unchanged(Generation(1))
    );
    assert_eq!(journal.meta.lifetime.applied_wall_ms, Some(W0 + 50_000));
    assert!(matches!(
        check_at(&mut h, W0 + 60_000, false).unwrap().verdict,
        Verdict::Within {
            left_ms: 50_000,
            ..
        }
    ));
    // A longer lifetime with the same nodes is kept too, as a budget is.
    let mut longer = lived(600, 0);
    longer.budget = Some(budget::Budget::of_usd(5.0, budget::OnBudget::Down).unwrap());
    apply_at(&mut h, &mut journal, &longer, W0 + 70_000);
    let kept = journal.meta.shape.as_ref().unwrap();
    assert_eq!(kept.lifetime.max_lifetime_s, 600);
    assert_eq!(kept.generation, Generation(1));
    assert!(kept.budget.is_some());
    // A shape without one turns it off and leaves the anchor alone.
    apply_at(&mut h, &mut journal, &lived(0, 0), W0 + 80_000);
    assert_eq!(check_at(&mut h, W0 + 10_000_000, false), None);
    assert_eq!(journal.meta.lifetime.applied_wall_ms, Some(W0 + 70_000));
    // An apply with the same content and no lifetime writes nothing.
    h.handle_wall_clock(W0 + 90_000, at(W0 + 90_000));
    let _ = h.handle_apply_next(&lived(0, 0), Ticket(1), at(W0 + 90_000));
    let before = journal.clone();
    drain_into(&mut h, &mut journal, at(W0 + 90_000));
    assert_eq!(journal, before);
}

#[test]
fn idle_waits_for_running_jobs_and_their_end_is_journaled() {
    let mut journal = JournalImage::new(RunId::new("run"));
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    drain_into(&mut h, &mut journal, at(W0));
    apply_at(&mut h, &mut journal, &lived(0, 10), W0);
    let s = check_at(&mut h, W0 + 4_000, false).unwrap();
    assert_eq!(s.idle_ms, Some(4_000));
    // A job runs from 5 s to 30 s: no deadline, and the journal knows.
    assert_eq!(
        check_at(&mut h, W0 + 5_000, true).unwrap().verdict,
        Verdict::Unbounded
    );
    drain_into(&mut h, &mut journal, at(W0 + 5_000));
    assert!(journal.meta.lifetime.busy);
    assert_eq!(
        check_at(&mut h, W0 + 29_000, true).unwrap().verdict,
        Verdict::Unbounded
    );
    // A check that changes nothing writes nothing.
    let before = journal.clone();
    drain_into(&mut h, &mut journal, at(W0 + 29_000));
    assert_eq!(journal, before);
    let s = check_at(&mut h, W0 + 30_000, false).unwrap();
    assert_eq!(s.idle_ms, Some(0));
    drain_into(&mut h, &mut journal, at(W0 + 30_000));
    assert_eq!(journal.meta.lifetime.jobs_ended_wall_ms, Some(W0 + 30_000));
    assert!(!journal.meta.lifetime.busy);
    // A restarted host counts idle from the job's end, not from itself.
    let mut h = Host::new(driver(), HostConfig::default(), Some(journal.clone())).unwrap();
    drain_into(&mut h, &mut journal, t(0));
    assert!(matches!(
        h.handle_lifetime(W0 + 36_000, false, t(0)).unwrap().verdict,
        Verdict::Within { left_ms: 4_000, .. }
    ));
    assert_eq!(
        h.handle_lifetime(W0 + 40_000, false, t(4_000))
            .unwrap()
            .verdict,
        Verdict::Reached(Which::IdleTeardown)
    );
}

#[test]
fn a_journal_from_before_lifetimes_loads_and_counts_from_the_first_check() {
    let mut journal = JournalImage::new(RunId::new("run"));
    let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
    drain_into(&mut h, &mut journal, t(0));
    // An apply with no wall clock read (a caller that never hands one in).
    let _ = h.handle_apply(&lived(0, 0), Ticket(1), t(0));
    drain_into(&mut h, &mut journal, t(0));
    let mut json = serde_json::to_value(&journal.meta).unwrap();
    assert!(json.get("lifetime").is_none(), "{json}");
    // The shape gains a lifetime in the JSON, as if an older daemon had
    // kept a shape a newer one wrote; the anchors are absent.
    json["shape"]["lifetime"] = serde_json::json!({ "max_lifetime_s": 60 });
    let meta: JournalMeta = serde_json::from_value(json).unwrap();
    assert_eq!(meta.lifetime, Default::default());
    let old = JournalImage {
        meta,
        slots: journal.slots.clone(),
    };
    let mut h = Host::new(driver(), HostConfig::default(), Some(old.clone())).unwrap();
    let mut journal = old;
    drain_into(&mut h, &mut journal, t(0));
    assert!(matches!(
        h.handle_lifetime(W0, false, t(0)).unwrap().verdict,
        Verdict::Within {
            left_ms: 60_000,
            ..
        }
    ));
    drain_into(&mut h, &mut journal, t(0));
    assert_eq!(journal.meta.lifetime.applied_wall_ms, Some(W0));
}

/// One step of the run the property replays.
#[derive(Clone, Debug)]
enum Step {
    /// The wall clock moves on this many ms.
    Wait(u64),
    /// The shape is applied again.
    Apply,
    /// A check, with a job running or none.
    Check(bool),
    /// The daemon is killed and started again from its journal.
    Restart,
}

fn any_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..20_000u64).prop_map(Step::Wait),
        1 => Just(Step::Apply),
        4 => any::<bool>().prop_map(Step::Check),
        1 => Just(Step::Restart),
    ]
}

/// The deadline the steps so far set, worked out from the rules as the
/// docs state them: `max_lifetime_s` after the last apply; with no job
/// running at the last check, `idle_teardown_s` after the later of the
/// last apply and the first check that saw no job after one that did.
#[derive(Debug)]
struct Model {
    applied: u64,
    ended: u64,
    running: bool,
}

impl Model {
    fn deadline(&self, max_s: u64, idle_s: u64) -> Option<u64> {
        let max = (max_s > 0).then(|| self.applied + max_s * 1_000);
        let idle =
            (idle_s > 0 && !self.running).then(|| self.applied.max(self.ended) + idle_s * 1_000);
        max.into_iter().chain(idle).min()
    }
}

proptest! {
    /// Whatever happens in between (applies, jobs, restarts), a check is
    /// reached exactly from the deadline the rules give, and a restarted
    /// host keeps it.
    #[test]
    fn the_deadline_follows_the_rules_across_applies_jobs_and_restarts(
        max_s in 0..60u64,
        idle_s in 0..60u64,
        steps in proptest::collection::vec(any_step(), 1..40),
    ) {
        let s = lived(max_s, idle_s);
        let mut journal = JournalImage::new(RunId::new("run"));
        let mut h = Host::new(driver(), HostConfig::default(), None).unwrap();
        // Each host's monotonic clock starts at zero, as a daemon's does.
        let mut wall = W0;
        let mut started = W0;
        drain_into(&mut h, &mut journal, t(0));
        let mono = |wall: u64, started: u64| t(wall - started);
        h.handle_wall_clock(wall, mono(wall, started));
        let _ = h.handle_apply_next(&s, Ticket(0), mono(wall, started));
        drain_into(&mut h, &mut journal, mono(wall, started));
        let mut model = Model { applied: wall, ended: 0, running: false };
        for step in steps {
            match step {
                Step::Wait(ms) => wall += ms,
                Step::Apply => {
                    h.handle_wall_clock(wall, mono(wall, started));
                    let _ = h.handle_apply_next(&s, Ticket(1), mono(wall, started));
                    if !s.lifetime.is_off() {
                        model.applied = wall;
                    }
                }
                Step::Check(running) => {
                    let status = h.handle_lifetime(wall, running, mono(wall, started));
                    if model.running && !running {
                        model.ended = wall;
                    }
                    model.running = running;
                    let Some(status) = status else {
                        prop_assert!(s.lifetime.is_off());
                        continue;
                    };
                    match (model.deadline(max_s, idle_s), status.verdict) {
                        (None, Verdict::Unbounded) => {}
                        (Some(at), Verdict::Reached(_)) => prop_assert!(at <= wall),
                        (Some(at), Verdict::Within { left_ms, .. }) => {
                            prop_assert_eq!(wall + left_ms, at);
                        }
                        (want, got) => prop_assert!(false, "want {:?}, got {:?}", want, got),
                    }
                }
                Step::Restart => {
                    h = Host::new(driver(), HostConfig::default(), Some(journal.clone())).unwrap();
                    started = wall;
                }
            }
            drain_into(&mut h, &mut journal, mono(wall, started));
        }
    }
}
