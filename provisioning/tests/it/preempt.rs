//! A machine its provider paused (an interruptible rental outbid) is asked
//! about only in a group that waits for it, kept for the group's wait when
//! the provider says it is paused, and lost at its grace's end otherwise.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn host() -> Host<Driver> {
    Host::new(driver(), HostConfig::default(), None).unwrap()
}

/// A group of `count` whose paused machines are handled as `on_preempt`.
fn group_with(count: u32, on_preempt: Option<PreemptChoice>, wait_s: Option<u32>) -> GroupShape {
    let mut g = group("w", count);
    g.policy.on_preempt = on_preempt;
    g.policy.preempt_wait_s = wait_s;
    g
}

/// Runs the host's outputs at `now` with a well-behaved provider (writes
/// durable at once, an empty inventory, every dispatch succeeds and a
/// started agent joins and converges); returns the dispatches, and pushes
/// each probe asked for onto `probes`.
fn pump(
    h: &mut Host<Driver>,
    probes: &mut Vec<(ResourceKey, LeaseId)>,
    now: Timestamp,
) -> Vec<Dispatch> {
    pump_host(h, None, &[], probes, now)
}

/// Wakes the host as a listening daemon's timer would, up to `until`, with
/// agents that stay connected answering nothing; returns the dispatches.
fn listen(
    h: &mut Host<Driver>,
    probes: &mut Vec<(ResourceKey, LeaseId)>,
    until: Timestamp,
) -> Vec<Dispatch> {
    let mut log = Vec::new();
    while let Some(at) = h.poll_timeout().filter(|at| *at <= until) {
        h.handle_timeout(at).unwrap();
        log.extend(pump(h, probes, at));
    }
    log
}

fn key(h: &Host<Driver>, node: &str) -> ResourceKey {
    let id = node_id(node);
    ResourceKey {
        run_id: h.core().state().run_id.clone(),
        node: id,
        attempt: h.core().state().nodes[&id].attempt,
    }
}

fn converged(g: GroupShape) -> Host<Driver> {
    let mut h = host();
    h.handle_apply(&shape(1, vec![g]), Ticket(1), t(0)).unwrap();
    pump(&mut h, &mut Vec::new(), t(0));
    assert!(h.is_converged(), "{:#?}", h.core().state());
    h
}

fn creates(log: &[Dispatch]) -> usize {
    log.iter()
        .filter(|d| d.request.kind() == EffectKind::CreateLease)
        .count()
}

fn events(h: &mut Host<Driver>) -> Vec<HostEvent> {
    std::iter::from_fn(|| h.poll_event()).collect()
}

#[test]
fn a_paused_machine_of_a_waiting_group_keeps_its_node_until_it_resumes() {
    let mut h = converged(group_with(2, Some(PreemptChoice::Wait), Some(120)));
    let mut probes = Vec::new();
    listen(&mut h, &mut probes, t(10_000));
    let w0 = key(&h, "w-0");
    let lease = h.core().state().nodes[&w0.node].record.lease.clone();
    h.handle_agent_gone(&w0, 1_000, t(10_000));
    pump(&mut h, &mut probes, t(10_000));
    assert_eq!(probes, vec![(w0.clone(), lease.unwrap())], "asked once");
    events(&mut h);
    h.handle_probed(&w0, Ok(true), t(10_500));
    assert!(events(&mut h).contains(&HostEvent::Preempted {
        key: w0.clone(),
        wait_until: Some(t(130_500)),
    }));
    match h.link(&w0.node) {
        Some(Link::Away { until, .. }) => assert_eq!(until, t(130_500)),
        other => panic!("{other:?}"),
    }
    // Far past its 5 s grace, well inside the wait: nothing is replaced.
    let log = listen(&mut h, &mut probes, t(100_000));
    assert_eq!(creates(&log), 0, "{log:?}");
    assert_eq!(key(&h, "w-0").attempt, w0.attempt);
    // The machine resumed: its agent is back and keeps the node.
    h.handle_agent_joined(&w0, t(100_000)).unwrap();
    let log = listen(&mut h, &mut probes, t(400_000));
    assert_eq!(creates(&log), 0, "{log:?}");
    assert_eq!(key(&h, "w-0").attempt, w0.attempt);
    assert!(h.is_converged());
    assert_eq!(probes.len(), 1);
}

#[test]
fn a_paused_machine_that_does_not_resume_in_time_is_replaced_at_the_wait_s_end() {
    let mut h = converged(group_with(1, Some(PreemptChoice::Wait), Some(60)));
    let mut probes = Vec::new();
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    pump(&mut h, &mut probes, t(1_000));
    assert_eq!(probes.len(), 1);
    h.handle_probed(&w0, Ok(true), t(1_000));
    let log = listen(&mut h, &mut probes, t(60_999));
    assert_eq!(creates(&log), 0, "kept for the whole wait: {log:?}");
    let log = listen(&mut h, &mut probes, t(120_000));
    assert_eq!(creates(&log), 1, "{log:?}");
    let now = &h.core().state().nodes[&w0.node];
    assert!(now.attempt > w0.attempt);
    let history = h.history(&w0.node).expect("the slot's attempts");
    let lost = history
        .iter()
        .find(|a| a.attempt == w0.attempt)
        .expect("the lost attempt is remembered");
    assert_eq!(
        lost.failed_reason.as_deref(),
        Some(PAUSED_PAST_WAIT),
        "{lost:?}"
    );
}

#[test]
fn a_replacing_group_never_asks_and_loses_its_node_at_the_grace_s_end() {
    for policy in [None, Some(PreemptChoice::Replace)] {
        let mut h = converged(group_with(1, policy, None));
        let mut probes = Vec::new();
        let w0 = key(&h, "w-0");
        h.handle_agent_gone(&w0, 0, t(1_000));
        let log = listen(&mut h, &mut probes, t(5_999));
        assert_eq!(creates(&log), 0);
        let log = listen(&mut h, &mut probes, t(60_000));
        assert_eq!(creates(&log), 1, "{policy:?}");
        assert!(probes.is_empty(), "{policy:?}: {probes:?}");
    }
}

#[test]
fn a_machine_not_paused_or_not_known_is_lost_at_the_grace_s_end() {
    for answer in [Ok(false), Err("rate limited".to_owned())] {
        let mut h = converged(group_with(1, Some(PreemptChoice::Wait), None));
        let mut probes = Vec::new();
        let w0 = key(&h, "w-0");
        h.handle_agent_gone(&w0, 0, t(1_000));
        pump(&mut h, &mut probes, t(1_000));
        events(&mut h);
        h.handle_probed(&w0, answer.clone(), t(1_200));
        let said = events(&mut h);
        match &answer {
            Err(_) => assert!(
                said.iter().any(
                    |e| matches!(e, HostEvent::Warning(w) if w.contains("rate limited") && w.contains(&w0.to_string()))
                ),
                "{said:?}"
            ),
            Ok(_) => assert!(said.is_empty(), "{said:?}"),
        }
        let log = listen(&mut h, &mut probes, t(5_999));
        assert_eq!(creates(&log), 0);
        let log = listen(&mut h, &mut probes, t(60_000));
        assert_eq!(creates(&log), 1, "{answer:?}");
    }
}

#[test]
fn an_answer_about_an_older_attempt_changes_nothing() {
    let mut h = converged(group_with(1, Some(PreemptChoice::Wait), Some(600)));
    let mut probes = Vec::new();
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    pump(&mut h, &mut probes, t(1_000));
    // Not answered in time: lost and replaced at its grace's end.
    listen(&mut h, &mut probes, t(60_000));
    let w0_now = key(&h, "w-0");
    assert!(w0_now.attempt > w0.attempt);
    events(&mut h);
    h.handle_probed(&w0, Ok(true), t(60_000));
    assert!(events(&mut h).is_empty());
    // The new attempt's agent going away is judged afresh.
    h.handle_agent_gone(&w0_now, 0, t(61_000));
    match h.link(&w0_now.node) {
        Some(Link::Away { until, .. }) => assert_eq!(until, t(66_000)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_paused_answer_for_an_agent_already_back_is_not_held_against_a_later_loss() {
    let mut h = converged(group_with(1, Some(PreemptChoice::Wait), Some(600)));
    let mut probes = Vec::new();
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    pump(&mut h, &mut probes, t(1_000));
    // Back before the provider answered: the answer is stale.
    h.handle_agent_joined(&w0, t(1_100)).unwrap();
    events(&mut h);
    h.handle_probed(&w0, Ok(true), t(1_200));
    assert!(events(&mut h).is_empty());
    // Lost later for another reason (the provider says it runs): judged
    // by its grace alone, not by a pause that is over.
    h.handle_agent_gone(&w0, 0, t(20_000));
    pump(&mut h, &mut probes, t(20_000));
    h.handle_probed(&w0, Ok(false), t(20_000));
    match h.link(&w0.node) {
        Some(Link::Away { until, .. }) => assert_eq!(until, t(25_000)),
        other => panic!("{other:?}"),
    }
    let log = listen(&mut h, &mut probes, t(60_000));
    assert_eq!(creates(&log), 1, "{log:?}");
}

#[test]
fn the_policy_is_read_from_the_shape_and_changing_it_replaces_nothing() {
    let mut h = converged(group_with(2, None, None));
    let before: Vec<_> = ["w-0", "w-1"].iter().map(|n| key(&h, n)).collect();
    h.handle_apply(
        &shape(2, vec![group_with(2, Some(PreemptChoice::Wait), Some(30))]),
        Ticket(2),
        t(1_000),
    )
    .unwrap();
    let mut probes = Vec::new();
    let log = pump(&mut h, &mut probes, t(1_000));
    assert_eq!(creates(&log), 0, "{log:?}");
    let after: Vec<_> = ["w-0", "w-1"].iter().map(|n| key(&h, n)).collect();
    assert_eq!(before, after);
    let policy = h
        .core()
        .desired()
        .group(&node_id("w-0").group)
        .unwrap()
        .policy;
    assert_eq!(policy.on_preempt, OnPreempt::Wait { wait_s: 30 });
    let default = PolicyShape {
        on_preempt: Some(PreemptChoice::Wait),
        ..PolicyShape::default()
    };
    assert_eq!(
        default.resolve().on_preempt.wait_ms(),
        Some(u64::from(OnPreempt::WAIT_DEFAULT_S) * 1000)
    );
}
