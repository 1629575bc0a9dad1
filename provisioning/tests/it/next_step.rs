//! `Host::next_step` is what every view announces (`retry in 4 s`, `held:
//! paused`, `replaced unless it is back in 3 s`); these tests hold each
//! announcement against what the host then does.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn host() -> Host<Driver> {
    Host::new(driver(), HostConfig::default(), None).unwrap()
}

/// Drains at `now`: writes durable at once, an empty inventory; returns
/// the dispatches.
fn drain(h: &mut Host<Driver>, now: Timestamp) -> Vec<Dispatch> {
    drain_host(h, now)
}

/// Steps the host from timer to timer until `until`, answering every
/// dispatch with `answer`; returns (instant, dispatch) for each.
fn run(
    h: &mut Host<Driver>,
    from: Timestamp,
    until: Timestamp,
    mut answer: impl FnMut(&Dispatch) -> OperationResult,
) -> Vec<(Timestamp, Dispatch)> {
    let mut log = Vec::new();
    let mut now = from;
    loop {
        let round = drain(h, now);
        if !round.is_empty() {
            for d in round {
                let r = answer(&d);
                let _ = h.handle_result(r, now).unwrap();
                log.push((now, d));
            }
            continue;
        }
        match h.poll_timeout() {
            Some(at) if at <= until => {
                now = at.max(now);
                h.handle_timeout(now).unwrap();
            }
            _ => return log,
        }
    }
}

fn w0() -> LogicalNodeId {
    node_id("w-0")
}

#[test]
fn an_announced_retry_happens_at_the_instant_announced_and_not_before() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let first = drain(&mut h, t(0));
    assert_eq!(first.len(), 1);
    let _ = h
        .handle_result(fail(&first[0], FailureClass::Definite), t(0))
        .unwrap();
    // Every create fails: the node backs off, each retry announced.
    let mut announced = Vec::new();
    let mut now = t(0);
    for _ in 0..5 {
        let next = h.next_step(&w0(), now).unwrap();
        let NextStep::RetryAt(retry) = next else {
            panic!("a failed create announces its retry: {next:?}");
        };
        announced.push(retry);
        // Nothing goes out before the announced instant.
        while let Some(wake) = h.poll_timeout().filter(|w| *w < retry) {
            now = wake.max(now);
            h.handle_timeout(now).unwrap();
            let early = drain(&mut h, now);
            assert!(early.is_empty(), "{early:?} at {now}, before {retry}");
        }
        // At it, the create goes out again.
        h.handle_timeout(retry).unwrap();
        let again = drain(&mut h, retry);
        assert_eq!(again.len(), 1, "the retry went out at {retry}");
        assert_eq!(again[0].request.kind(), EffectKind::CreateLease);
        let _ = h
            .handle_result(fail(&again[0], FailureClass::Definite), retry)
            .unwrap();
        now = retry;
    }
    assert!(announced.windows(2).all(|w| w[0] < w[1]), "{announced:?}");
}

#[test]
fn while_paused_no_retry_is_announced_and_none_happens() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let log = run(&mut h, t(0), t(0), |d| fail(d, FailureClass::Definite));
    assert_eq!(log.len(), 1);
    assert_eq!(h.handle_pause(true, Ticket(2), t(10)), Ok(true));
    drain(&mut h, t(10));
    assert_eq!(
        h.next_step(&w0(), t(10)),
        Some(NextStep::Held(HeldBy::Paused))
    );
    let later = run(&mut h, t(10), t(300_000), |d| {
        fail(d, FailureClass::Definite)
    });
    assert!(
        later.is_empty(),
        "nothing is retried while paused: {later:?}"
    );
    assert_eq!(
        h.next_step(&w0(), t(300_000)),
        Some(NextStep::Held(HeldBy::Paused))
    );
    assert_eq!(h.handle_pause(false, Ticket(3), t(300_000)), Ok(true));
    let resumed = run(&mut h, t(300_000), t(300_000), success);
    assert!(!resumed.is_empty(), "resuming retries at once");
}

#[test]
fn an_away_agent_is_lost_at_the_instant_announced_and_not_replaced_while_paused() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let log = run(&mut h, t(0), t(0), success);
    let start = log
        .iter()
        .find(|(_, d)| d.request.kind() == EffectKind::StartBootstrap)
        .map(|(_, d)| d.key.clone())
        .expect("a bootstrap started");
    h.handle_agent_joined(&start, t(0)).unwrap();
    let n = &h.core().state().nodes[&w0()];
    let obs = BootstrapObservation {
        node: w0(),
        attempt: n.attempt,
        session: n.record.session.clone().unwrap(),
        event: BootstrapEvent::Stage(BootstrapStage::Converged),
    };
    let _ = h.handle_bootstrap(obs, t(0)).unwrap();
    drain(&mut h, t(0));
    assert_eq!(h.next_step(&w0(), t(0)), Some(NextStep::Nothing));

    assert_eq!(h.handle_pause(true, Ticket(2), t(100)), Ok(true));
    drain(&mut h, t(100));
    h.handle_agent_gone(&start, 0, t(100));
    let Some(NextStep::LostAt { at, replaced }) = h.next_step(&w0(), t(100)) else {
        panic!("{:?}", h.next_step(&w0(), t(100)));
    };
    assert!(!replaced, "not replaced while paused");
    // Not lost a moment before `at`; lost at it, and then not replaced.
    while let Some(now) = h.poll_timeout().filter(|w| *w < at) {
        h.handle_timeout(now).unwrap();
        drain(&mut h, now);
        assert_eq!(h.core().state().nodes[&w0()].attempt, start.attempt);
        assert!(
            h.core().state().nodes[&w0()]
                .record
                .failed_reason()
                .is_none()
        );
    }
    h.handle_timeout(at).unwrap();
    let cleanup = run(&mut h, at, at.saturating_add_ms(120_000), success);
    let n = &h.core().state().nodes[&w0()];
    assert_eq!(n.attempt, start.attempt, "no new attempt while paused");
    assert!(
        cleanup.iter().all(|(_, d)| d.key.attempt == start.attempt),
        "only the old attempt's cleanup: {cleanup:?}"
    );
    assert_eq!(
        h.next_step(&w0(), at.saturating_add_ms(120_000)),
        Some(NextStep::Held(HeldBy::Paused))
    );
}
