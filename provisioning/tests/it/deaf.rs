//! A daemon that could not listen (stopped, asleep, starved) blames nobody
//! for the silence, and a daemon that has not adopted its journal yet
//! defers the joins of the attempts the journal holds instead of refusing
//! them; a daemon restarted while paused re-attaches its running nodes.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// A host whose agents join over the swarm only (as the daemon's).
fn host(journal: Option<JournalImage>) -> Host<Driver> {
    Host::new(driver(), HostConfig::default(), journal).unwrap()
}

/// Runs the host's outputs at `now` with a well-behaved provider: writes are
/// durable at once (and kept in `journal`), the inventory is `listed`, every
/// dispatch succeeds, and a started bootstrap's agent joins and converges.
fn pump(
    h: &mut Host<Driver>,
    journal: &mut JournalImage,
    listed: &[Listed],
    now: Timestamp,
) -> Vec<Dispatch> {
    // No group here waits for paused machines: nothing is probed.
    pump_host(h, Some(journal), listed, &mut Vec::new(), now)
}

fn key(h: &Host<Driver>, node: &str) -> ResourceKey {
    let id = node_id(node);
    ResourceKey {
        run_id: h.core().state().run_id.clone(),
        node: id,
        attempt: h.core().state().nodes[&id].attempt,
    }
}

/// What the provider lists for `nodes`: each one's lease and session as the host knows them.
fn listed(h: &Host<Driver>, nodes: &[&str]) -> Vec<Listed> {
    nodes
        .iter()
        .map(|n| {
            let k = key(h, n);
            let rec = &h.core().state().nodes[&k.node].record;
            Listed {
                key: k,
                lease: rec.lease.clone(),
                session: rec.session.clone(),
            }
        })
        .collect()
}

fn converged(count: u32) -> (Host<Driver>, JournalImage) {
    let mut h = host(None);
    let mut journal = JournalImage::new(h.core().state().run_id.clone());
    h.handle_apply(&shape(1, vec![group("w", count)]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, &mut journal, &[], t(0));
    assert!(h.is_converged(), "{:#?}", h.core().state());
    (h, journal)
}

/// Feeds the host its watch wake-ups up to `until`, as a listening daemon's timer would.
fn listen(h: &mut Host<Driver>, journal: &mut JournalImage, until: Timestamp) {
    while let Some(at) = h.poll_timeout().filter(|at| *at <= until) {
        h.handle_timeout(at).unwrap();
        pump(h, journal, &[], at);
    }
}

#[test]
fn a_listening_host_asks_to_be_woken_within_its_listen_gap() {
    let (mut h, mut journal) = converged(2);
    let gap = h.core().config().listen_gap_ms;
    let at = h.poll_timeout().expect("a host with nodes watches");
    assert!(at.as_millis() <= gap, "{at} is past the listen gap {gap}");
    listen(&mut h, &mut journal, t(60_000));
    assert_eq!(
        h.last_deaf_gap(),
        None,
        "a host woken as it asked is never deaf"
    );
}

#[test]
fn an_agent_found_silent_after_a_deaf_gap_gets_its_grace_from_the_gap_s_end() {
    let (mut h, mut journal) = converged(2);
    listen(&mut h, &mut journal, t(10_000));
    let w0 = key(&h, "w-0");
    // The daemon was stopped from 10 s to 40 s; on waking, its swarm
    // endpoint finds w-0 silent for 30 s (grace: 5 s).
    h.handle_agent_gone(&w0, 30_000, t(40_000));
    let gap = h.last_deaf_gap().expect("a 30 s gap is deaf");
    assert_eq!((gap.from, gap.to, gap.agents), (t(10_000), t(40_000), 2));
    match h.link(&w0.node) {
        Some(Link::Away { until, .. }) => assert_eq!(until, t(45_000)),
        other => panic!("{other:?}"),
    }
    // Back within that grace: nothing is replaced.
    h.handle_timeout(t(44_000)).unwrap();
    pump(&mut h, &mut journal, &[], t(44_000));
    h.handle_agent_joined(&w0, t(44_000)).unwrap();
    listen(&mut h, &mut journal, t(60_000));
    assert_eq!(key(&h, "w-0").attempt, w0.attempt);
    assert!(h.is_converged());
}

#[test]
fn an_agent_away_when_the_host_went_deaf_gets_its_whole_grace_again() {
    let (mut h, mut journal) = converged(2);
    let w1 = key(&h, "w-1");
    h.handle_agent_gone(&w1, 0, t(1_000));
    // Its grace would end at 6 s; the host hears nothing from 1 s to 20 s.
    h.handle_timeout(t(20_000)).unwrap();
    match h.link(&w1.node) {
        Some(Link::Away { until, .. }) => assert_eq!(until, t(25_000)),
        other => panic!("{other:?}"),
    }
    pump(&mut h, &mut journal, &[], t(20_000));
    assert_eq!(key(&h, "w-1").attempt, w1.attempt, "not lost at once");
    // It never comes back: lost one grace after the host was back.
    listen(&mut h, &mut journal, t(24_900));
    assert_eq!(key(&h, "w-1").attempt, w1.attempt);
    listen(&mut h, &mut journal, t(25_500));
    let n = &h.core().state().nodes[&w1.node];
    assert!(
        n.attempt != w1.attempt || n.record.failed_reason() == Some(AWAY_PAST_GRACE),
        "{n:#?}"
    );
}

#[test]
fn a_deaf_gap_moves_bootstrap_stall_deadlines_on_by_its_length() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    // Create, look up, start: the node waits on its stream.
    for _ in 0..3 {
        for dispatch in drain(&mut d, t(0)) {
            assert_eq!(
                d.handle_result(success(&dispatch), t(0)).unwrap(),
                Folded::Applied
            );
        }
    }
    let w0 = node_id("w-0");
    let before = d.state().nodes[&w0]
        .record
        .bootstrap_deadline
        .expect("a stall deadline");
    d.handle_unheard(t(100), t(60_100));
    let after = d.state().nodes[&w0].record.bootstrap_deadline.unwrap();
    assert_eq!(after, before.saturating_add_ms(60_000));
    // At the old deadline nothing stalls.
    d.handle_timeout(before).unwrap();
    drain(&mut d, before);
    assert_ne!(d.state().nodes[&w0].record.stage, NodeStage::Failed);
}

#[test]
fn a_join_the_journal_holds_is_deferred_until_adoption_then_accepted() {
    let (h, journal) = converged(2);
    let w0 = key(&h, "w-0");
    let listed = listed(&h, &["w-0", "w-1"]);
    drop(h);
    let mut next = host(Some(journal.clone()));
    assert_eq!(
        next.handle_agent_joined(&w0, t(0)),
        Err(JoinRefused::NotYet(w0.node)),
        "a restarted host that has not adopted yet defers, never says 'not a node'"
    );
    assert!(JoinRefused::NotYet(w0.node).is_transient());
    // A stranger is refused as before.
    let stranger = ResourceKey {
        node: node_id("w-7"),
        ..w0.clone()
    };
    assert_eq!(
        next.handle_agent_joined(&stranger, t(0)),
        Err(JoinRefused::UnknownNode(stranger.node))
    );
    let mut journal = journal;
    pump(&mut next, &mut journal, &listed, t(10));
    assert!(next.handle_agent_joined(&w0, t(20)).is_ok());
}

#[test]
fn a_host_restarted_while_paused_re_attaches_its_running_nodes() {
    let (mut h, mut journal) = converged(2);
    assert_eq!(h.handle_pause(true, Ticket(2), t(5)), Ok(true));
    pump(&mut h, &mut journal, &[], t(5));
    assert!(journal.meta.paused);
    let listed = listed(&h, &["w-0", "w-1"]);
    let attempts: Vec<NodeAttemptId> = listed.iter().map(|l| l.key.attempt).collect();
    drop(h);
    let mut next = host(Some(journal.clone()));
    assert!(next.is_paused());
    let dispatched = pump(&mut next, &mut journal, &listed, t(100));
    let kinds: Vec<EffectKind> = dispatched.iter().map(|d| d.request.kind()).collect();
    assert!(
        kinds
            .iter()
            .all(|k| matches!(k, EffectKind::LookupEndpoint | EffectKind::StartBootstrap)),
        "only re-attachment while paused: {kinds:?}"
    );
    assert!(next.is_paused());
    let now: Vec<NodeAttemptId> = ["w-0", "w-1"]
        .iter()
        .map(|n| key(&next, n).attempt)
        .collect();
    assert_eq!(now, attempts, "the same attempts, nothing new");
    assert!(
        ["w-0", "w-1"]
            .iter()
            .all(|n| next.core().state().nodes[&node_id(n)].is_ready()),
        "{:#?}",
        next.core().state()
    );
}

#[test]
fn starved_time_is_given_back_to_an_away_agent_up_to_one_whole_grace() {
    let (mut h, mut journal) = converged(2);
    listen(&mut h, &mut journal, t(10_000));
    let w0 = key(&h, "w-0");
    // Found silent for 2 s at 10 s: lost at 13 s (grace 5 s from 8 s).
    h.handle_agent_gone(&w0, 2_000, t(10_000));
    let until = |h: &Host<Driver>| match h.link(&w0.node) {
        Some(Link::Away { until, .. }) => until,
        other => panic!("{other:?}"),
    };
    assert_eq!(until(&h), t(13_000));
    // The daemon then measured itself starved for 1.5 s: the grace ends
    // that much later.
    h.handle_starved(1_500, t(10_400));
    assert_eq!(until(&h), t(14_500));
    assert_eq!(h.starved_ms(), 1_500);
    // Never more than a whole grace from when it is told.
    h.handle_starved(60_000, t(10_800));
    assert_eq!(until(&h), t(15_800));
    assert_eq!(h.last_deaf_gap(), None, "starved, but never deaf here");
    // An agent that really died is still lost at that deadline, not later.
    listen(&mut h, &mut journal, t(15_799));
    assert_eq!(key(&h, "w-0").attempt, w0.attempt, "not before its grace");
    listen(&mut h, &mut journal, t(15_800));
    pump(&mut h, &mut journal, &[], t(15_800));
    let n = &h.core().state().nodes[&w0.node];
    assert!(
        n.attempt != w0.attempt || n.record.stage == NodeStage::Destroyed,
        "lost at its grace's end: {n:#?}"
    );
}

#[test]
fn starved_time_moves_a_bootstrap_s_stall_deadline() {
    let mut h = host(None);
    let mut journal = JournalImage::new(h.core().state().run_id.clone());
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    // Run the create and the bootstrap's start, but let no agent report.
    let mut started = false;
    for _ in 0..16 {
        let mut round = Vec::new();
        while let Some(o) = h.poll_output(t(0)) {
            match o {
                Output::Persist(delta) => {
                    journal.apply(&delta);
                    h.handle_persisted(delta.seq);
                }
                Output::List => h.handle_inventory(Ok(Vec::new()), t(0)),
                Output::Pass(pass) => round.extend(pass.dispatches),
                _ => {}
            }
        }
        if round.is_empty() {
            break;
        }
        for d in &round {
            started |= d.request.kind() == EffectKind::StartBootstrap;
            let _ = h.handle_result(success(d), t(0)).unwrap();
        }
    }
    assert!(started);
    let w0 = node_id("w-0");
    let deadline = |h: &Host<Driver>| h.core().state().nodes[&w0].record.bootstrap_deadline;
    let before = deadline(&h).expect("a stall deadline runs");
    h.handle_starved(800, t(1_000));
    assert_eq!(h.last_deaf_gap(), None);
    assert_eq!(deadline(&h), Some(before.saturating_add_ms(800)));
}

/// Issue 29, item 7: `replace` was acknowledged before anything of it was
/// durable; a daemon stopped on a journal error lost it. Now its reply
/// follows the write that records it, and a host started from that journal
/// replaces the attempt all the same.
#[test]
fn an_acknowledged_replace_is_durable_and_survives_a_restart() {
    let (mut h, mut journal) = converged(2);
    let w0 = key(&h, "w-0");
    assert_eq!(h.handle_replace(&w0.node, Ticket(7), t(10)), Ok(w0.attempt));
    // Nothing is answered before the record is written.
    let mut written = None;
    let mut answered = false;
    while let Some(out) = h.poll_output(t(10)) {
        match out {
            Output::Persist(delta) => {
                assert!(!answered, "answered before the write");
                assert!(
                    delta.put.iter().any(|(n, r)| *n == w0.node && r.replace),
                    "the write records the replace: {delta:?}"
                );
                written = Some(delta);
                break;
            }
            Output::Reply(Ticket(7), _) => answered = true,
            _ => {}
        }
    }
    let delta = written.expect("a write");
    assert!(!answered);
    assert!(
        h.poll_output(t(10)).is_none(),
        "nothing until the write is durable"
    );
    // The daemon dies right after the write is durable, before anything
    // of the replace reached the provider: the next host replaces it.
    journal.apply(&delta);
    let listed = listed(&h, &["w-0", "w-1"]);
    let mut next = host(Some(journal.clone()));
    let dispatches = pump(&mut next, &mut journal, &listed, t(20));
    let destroyed: Vec<_> = dispatches
        .iter()
        .filter(|d| d.request.kind() == EffectKind::DestroyLease)
        .map(|d| d.key.clone())
        .collect();
    assert_eq!(
        destroyed,
        std::slice::from_ref(&w0),
        "the replaced attempt is cleaned up"
    );
    assert_ne!(key(&next, "w-0").attempt, w0.attempt, "and started anew");
    assert_eq!(
        key(&next, "w-1"),
        key(&h, "w-1"),
        "w-1 is adopted as it was"
    );
}

/// Issue 29, item 8: a daemon whose journal was lost destroyed every
/// running node as an orphan and created them again. Told `--adopt`, a
/// host with an empty journal takes each listed resource of a desired slot
/// as that slot's node, as it is; told nothing, it collects them (what
/// `--fresh` asks for, once the daemon has refused to start without one).
#[test]
fn a_host_told_to_adopt_unrecorded_resources_takes_them_as_they_are() {
    let (h, _) = converged(2);
    let listed = listed(&h, &["w-0", "w-1"]);
    let run = h.core().state().run_id.clone();
    for adopt in [true, false] {
        let config = HostConfig {
            adopt_unrecorded: adopt,
            ..HostConfig::default()
        };
        let mut next = Host::new(driver(), config, None).unwrap();
        let mut journal = JournalImage::new(run.clone());
        next.handle_apply(&shape(1, vec![group("w", 2)]), Ticket(1), t(100))
            .unwrap();
        let dispatches = pump(&mut next, &mut journal, &listed, t(100));
        let kinds: Vec<EffectKind> = dispatches.iter().map(|d| d.request.kind()).collect();
        if adopt {
            assert!(
                !kinds.contains(&EffectKind::CreateLease)
                    && !kinds.contains(&EffectKind::DestroyLease),
                "adopted as they are: {kinds:?}"
            );
            for n in ["w-0", "w-1"] {
                assert_eq!(key(&next, n), key(&h, n));
                assert!(journal.slots.get(&node_id(n)).is_some(), "{n} is journaled");
            }
        } else {
            assert!(kinds.contains(&EffectKind::CreateLease), "{kinds:?}");
            assert_ne!(key(&next, "w-0").attempt, key(&h, "w-0").attempt);
        }
    }
}

/// Issue 30, fix 2: a new journal records the deployment its host is
/// given; a journal that exists keeps its own (none, for one written before
/// deployments), whatever a later host is given.
#[test]
fn a_new_journal_records_its_deployment_and_an_existing_one_keeps_its_own() {
    let config = |d: &str| HostConfig {
        deployment: Some(d.to_owned()),
        ..HostConfig::default()
    };
    let mut first = Host::new(driver(), config("0a1b2c3d"), None).unwrap();
    let mut journal = JournalImage::new(RunId::new("run"));
    first
        .handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(100))
        .unwrap();
    pump(&mut first, &mut journal, &[], t(100));
    assert_eq!(journal.meta.deployment.as_deref(), Some("0a1b2c3d"));
    let again = Host::new(driver(), config("ffffffff"), Some(journal.clone())).unwrap();
    assert_eq!(again.journal_meta().deployment.as_deref(), Some("0a1b2c3d"));
    let mut before = journal;
    before.meta.deployment = None;
    let old = Host::new(driver(), config("ffffffff"), Some(before)).unwrap();
    assert_eq!(old.journal_meta().deployment, None);
}

/// Runs the host's outputs at `now` without answering any dispatch: what a
/// daemon does before it dies with its effects on the way. Returns them.
fn dispatch_only(
    h: &mut Host<Driver>,
    journal: &mut JournalImage,
    now: Timestamp,
) -> Vec<Dispatch> {
    let mut out = Vec::new();
    while let Some(o) = h.poll_output(now) {
        match o {
            Output::Persist(delta) => {
                journal.apply(&delta);
                h.handle_persisted(delta.seq);
            }
            Output::List => h.handle_inventory(Ok(Vec::new()), now),
            Output::Pass(pass) => out.extend(pass.dispatches),
            _ => {}
        }
    }
    out
}

/// A daemon that restarts with w-0's create on the way (sent just before
/// it died) and a new template applied, before that create landed: the
/// create is not re-issued (its template is no longer wanted), so the slot
/// would move on to a new attempt at once.
fn restarted_with_a_create_on_the_way(window_ms: u64) -> (Host<Driver>, JournalImage, ResourceKey) {
    let mut h = host(None);
    let mut journal = JournalImage::new(h.core().state().run_id.clone());
    let mut g = group("w", 1);
    h.handle_apply(&shape(1, vec![g.clone()]), Ticket(1), t(0))
        .unwrap();
    let sent = dispatch_only(&mut h, &mut journal, t(0));
    let create = sent
        .iter()
        .find(|d| d.request.kind() == EffectKind::CreateLease)
        .expect("w-0's create")
        .key
        .clone();
    g.role = "v2".to_owned();
    h.handle_apply(&shape(2, vec![g]), Ticket(2), t(1)).unwrap();
    dispatch_only(&mut h, &mut journal, t(1));
    assert!(!journal.slots[&create.node].created);
    let config = HostConfig {
        visibility_window_ms: window_ms,
        ..HostConfig::default()
    };
    let next = Host::new(driver(), config, Some(journal.clone())).unwrap();
    (next, journal, create)
}

/// CI (stop 37), the docker battery: a daemon killed while the engine was
/// making w-0's container came back, listed nothing for w-0 (the engine
/// had not finished), started w-0's next attempt, and the first container
/// appeared beside it. A listing that misses an attempt the journal names
/// is now repeated a listing lag later before anything is decided; the
/// late one is adopted and destroyed before the slot's next attempt.
#[test]
fn an_attempt_the_first_listing_misses_is_looked_for_again_before_its_slot_moves_on() {
    const WINDOW: u64 = 5_000;
    let (mut next, mut journal, late) = restarted_with_a_create_on_the_way(WINDOW);
    let sent = pump(&mut next, &mut journal, &[], t(10));
    assert!(
        sent.is_empty(),
        "nothing decided on the first listing: {sent:?}"
    );
    assert!(!next.adopted());
    let mut warned = false;
    while let Some(e) = next.poll_event() {
        warned |= matches!(&e, HostEvent::Warning(w) if w.contains("looking again in 5 s"));
    }
    assert!(warned, "the wait is said");
    assert_eq!(next.poll_timeout(), Some(t(10 + WINDOW)));

    // The create landed meanwhile: the second listing shows it.
    let landed = Listed {
        key: late.clone(),
        lease: Some(LeaseId::from("fake-lease")),
        session: None,
    };
    next.handle_timeout(t(10 + WINDOW)).unwrap();
    let sent = pump(&mut next, &mut journal, &[landed], t(10 + WINDOW));
    assert!(next.adopted());
    let destroyed = sent
        .iter()
        .position(|d| d.request.kind() == EffectKind::DestroyLease && d.key == late)
        .unwrap_or_else(|| panic!("the late attempt is destroyed: {sent:?}"));
    let created = sent
        .iter()
        .position(|d| d.request.kind() == EffectKind::CreateLease)
        .unwrap_or_else(|| panic!("the slot's next attempt is made: {sent:?}"));
    assert!(destroyed < created, "never two attempts of w-0: {sent:?}");
    assert_ne!(sent[created].key.attempt, late.attempt);
}

/// Without a listing lag (a provider that lists what it made at once) the
/// slot moves on at the first listing, as it did before.
#[test]
fn without_a_listing_lag_a_missing_attempt_is_taken_as_gone_at_once() {
    let (mut next, mut journal, late) = restarted_with_a_create_on_the_way(0);
    let sent = pump(&mut next, &mut journal, &[], t(10));
    assert!(next.adopted());
    assert!(
        sent.iter()
            .any(|d| d.request.kind() == EffectKind::CreateLease && d.key.attempt != late.attempt),
        "{sent:?}"
    );
}
