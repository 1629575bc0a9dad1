//! The kind of trouble a node's last error was is decided by the fold that
//! records it, never read back from the error's wording: each way an
//! attempt can end is driven through a host here, and the cause kept with
//! the replaced attempt (or the live node) is checked.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn host() -> Host<Driver> {
    Host::new(driver(), HostConfig::default(), None).unwrap()
}

/// Whether the agents of started bootstraps join and converge.
#[derive(Clone, Copy, PartialEq)]
enum Agents {
    /// They join and converge at once.
    Converge,
    /// They never say anything.
    Silent,
}

/// Runs the host's outputs at `now`: writes are durable at once, the
/// inventory is empty, every dispatch succeeds, and started agents behave
/// as `agents` says. Each probe asked for is pushed onto `probes`.
fn pump(
    h: &mut Host<Driver>,
    agents: Agents,
    probes: &mut Vec<(ResourceKey, LeaseId)>,
    now: Timestamp,
) -> Vec<Dispatch> {
    if agents == Agents::Converge {
        return pump_host(h, None, &[], probes, now);
    }
    let mut log = Vec::new();
    for _ in 0..64 {
        let round = drain_host(h, now);
        if round.is_empty() {
            break;
        }
        for d in &round {
            let _ = h.handle_result(success(d), now).unwrap();
        }
        log.extend(round);
    }
    log
}

/// Wakes the host as a daemon's timer would, up to `until`.
fn listen(
    h: &mut Host<Driver>,
    agents: Agents,
    probes: &mut Vec<(ResourceKey, LeaseId)>,
    until: Timestamp,
) {
    while let Some(at) = h.poll_timeout().filter(|at| *at <= until) {
        h.handle_timeout(at).unwrap();
        pump(h, agents, probes, at);
    }
}

fn converged(g: GroupShape) -> Host<Driver> {
    let mut h = host();
    h.handle_apply(&shape(1, vec![g]), Ticket(1), t(0)).unwrap();
    pump(&mut h, Agents::Converge, &mut Vec::new(), t(0));
    assert!(h.is_converged(), "{:#?}", h.core().state());
    h
}

fn key(h: &Host<Driver>, node: &str) -> ResourceKey {
    let id = node_id(node);
    ResourceKey {
        run_id: h.core().state().run_id.clone(),
        node: id,
        attempt: h.core().state().nodes[&id].attempt,
    }
}

fn record<'h>(h: &'h Host<Driver>, node: &str) -> &'h NodeRecord {
    &h.core().state().nodes[&node_id(node)].record
}

/// The cause kept with `old`, an attempt of its slot that a newer one replaced.
fn cause_of_replaced(h: &Host<Driver>, old: &ResourceKey) -> Option<FailureCause> {
    let now = key(h, &old.node.to_string());
    assert!(now.attempt > old.attempt, "{old} was not replaced");
    let history = h.history(&old.node).expect("the slot's attempts");
    let record = history
        .iter()
        .find(|a| a.attempt == old.attempt)
        .expect("the replaced attempt is remembered");
    assert_eq!(record.last_cause.is_some(), record.last_error.is_some());
    record.last_cause
}

/// A bootstrap stream report for `node`'s live session.
fn report(h: &Host<Driver>, node: &str, event: BootstrapEvent) -> BootstrapObservation {
    let n = &h.core().state().nodes[&node_id(node)];
    BootstrapObservation {
        node: node_id(node),
        attempt: n.attempt,
        session: n.record.session.clone().expect("a live session"),
        event,
    }
}

#[test]
fn an_agent_away_past_its_grace_is_replaced_as_a_lost_agent() {
    let mut h = converged(group("w", 1));
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(60_000));
    assert_eq!(
        cause_of_replaced(&h, &w0),
        Some(FailureCause::AgentLost),
        "{:?}",
        h.history(&w0.node)
    );
}

#[test]
fn an_operator_replace_is_recorded_as_the_operators() {
    let mut h = converged(group("w", 2));
    let w1 = key(&h, "w-1");
    assert_eq!(h.handle_replace(&w1.node, Ticket(7), t(10)), Ok(w1.attempt));
    pump(&mut h, Agents::Converge, &mut Vec::new(), t(10));
    assert_eq!(record(&h, "w-1").last_cause(), Some(FailureCause::Operator));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(60_000));
    assert_eq!(cause_of_replaced(&h, &w1), Some(FailureCause::Operator));
    // Its neighbour was left alone.
    assert_eq!(record(&h, "w-0").last_cause(), None);
}

#[test]
fn a_paused_machine_that_does_not_resume_within_its_wait_is_replaced_as_preempted() {
    let mut g = group("w", 1);
    g.policy.on_preempt = Some(PreemptChoice::Wait);
    g.policy.preempt_wait_s = Some(60);
    let mut h = converged(g);
    let mut probes = Vec::new();
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    pump(&mut h, Agents::Converge, &mut probes, t(1_000));
    assert_eq!(probes.len(), 1, "the provider is asked");
    h.handle_probed(&w0, Ok(true), t(1_000));
    listen(&mut h, Agents::Converge, &mut probes, t(120_000));
    assert_eq!(cause_of_replaced(&h, &w0), Some(FailureCause::Preempted));
}

#[test]
fn a_machine_not_paused_is_lost_at_its_grace_end_as_a_lost_agent() {
    let mut g = group("w", 1);
    g.policy.on_preempt = Some(PreemptChoice::Wait);
    g.policy.preempt_wait_s = Some(60);
    let mut h = converged(g);
    let mut probes = Vec::new();
    let w0 = key(&h, "w-0");
    h.handle_agent_gone(&w0, 0, t(1_000));
    pump(&mut h, Agents::Converge, &mut probes, t(1_000));
    h.handle_probed(&w0, Ok(false), t(1_000));
    listen(&mut h, Agents::Converge, &mut probes, t(120_000));
    assert_eq!(cause_of_replaced(&h, &w0), Some(FailureCause::AgentLost));
}

#[test]
fn a_bootstrap_that_never_reports_is_replaced_as_a_timeout() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, Agents::Silent, &mut Vec::new(), t(0));
    let first = key(&h, "w-0");
    assert_eq!(record(&h, "w-0").stage, NodeStage::BootstrapRunning);
    listen(&mut h, Agents::Silent, &mut Vec::new(), t(600_000));
    assert_eq!(cause_of_replaced(&h, &first), Some(FailureCause::Timeout));
}

#[test]
fn a_boot_check_that_never_ends_is_a_timeout_though_its_reason_names_the_agent() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, Agents::Silent, &mut Vec::new(), t(0));
    let first = key(&h, "w-0");
    let check = report(&h, "w-0", BootstrapEvent::Stage(BootstrapStage::BootCheck));
    assert_eq!(h.handle_bootstrap(check, t(0)).unwrap(), Folded::Applied);
    listen(&mut h, Agents::Silent, &mut Vec::new(), t(600_000));
    let history = h.history(&first.node).unwrap();
    let reason = history[0].last_error.clone().unwrap_or_default();
    assert!(reason.contains("agent"), "{reason}");
    assert_eq!(cause_of_replaced(&h, &first), Some(FailureCause::Timeout));
}

/// When the pending operation of `node` is folded as unanswered.
fn pending_deadline(h: &Host<Driver>, node: &str) -> Timestamp {
    let n = &h.core().state().nodes[&node_id(node)];
    n.pending.as_ref().expect("an operation in flight").deadline
}

#[test]
fn an_operation_with_no_result_by_its_deadline_is_a_timeout_and_an_earlier_unknown_one_is_not() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let create = drain_host(&mut h, t(0));
    assert_eq!(create.len(), 1);
    assert!(pending_deadline(&h, "w-0") > t(1));
    // The executor says it does not know, well before the deadline.
    let early = fail(&create[0], FailureClass::Ambiguous);
    assert_eq!(h.handle_result(early, t(1)).unwrap(), Folded::Applied);
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Failure));
    // The re-issued create is never answered: the host's own expiry folds it.
    while h.core().state().nodes[&node_id("w-0")].pending.is_none() {
        let now = h.poll_timeout().expect("a backoff to wait out");
        h.handle_timeout(now).unwrap();
        assert!(drain_host(&mut h, now).len() <= 1);
    }
    let expiry = pending_deadline(&h, "w-0");
    h.handle_timeout(expiry).unwrap();
    let _ = drain_host(&mut h, expiry);
    assert!(h.core().state().nodes[&node_id("w-0")].pending.is_none());
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Timeout));
    let error = record(&h, "w-0")
        .last_error()
        .unwrap_or_default()
        .to_owned();
    assert!(error.starts_with("CreateLease"), "{error}");
}

#[test]
fn an_executor_giving_up_at_the_deadline_is_a_timeout_whatever_it_says() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let create = drain_host(&mut h, t(0));
    let deadline = pending_deadline(&h, "w-0");
    let late = result(
        &create[0],
        OperationOutcome::Failed {
            class: FailureClass::Ambiguous,
            reason: "something went wrong".to_owned(),
        },
    );
    assert_eq!(h.handle_result(late, deadline).unwrap(), Folded::Applied);
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Timeout));
}

#[test]
fn a_failed_boot_check_is_another_failure_though_its_reason_says_timed_out() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    pump(&mut h, Agents::Silent, &mut Vec::new(), t(0));
    let first = key(&h, "w-0");
    let failed = report(
        &h,
        "w-0",
        BootstrapEvent::Failed {
            stage: BootstrapStage::BootCheckFailed,
            reason: "the agent's boot check timed out".to_owned(),
        },
    );
    assert_eq!(h.handle_bootstrap(failed, t(5)).unwrap(), Folded::Applied);
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Failure));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(600_000));
    assert_eq!(cause_of_replaced(&h, &first), Some(FailureCause::Failure));
}

#[test]
fn a_bootstrap_that_could_not_start_is_another_failure() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let mut now = t(0);
    let first = loop {
        let round = drain_host(&mut h, now);
        let Some(start) = round
            .iter()
            .find(|d| d.request.kind() == EffectKind::StartBootstrap)
        else {
            for d in &round {
                let _ = h.handle_result(success(d), now).unwrap();
            }
            now = t(now.as_millis() + 1);
            continue;
        };
        let refused = fail(start, FailureClass::Definite);
        assert_eq!(h.handle_result(refused, now).unwrap(), Folded::Applied);
        break start.key.clone();
    };
    assert_eq!(record(&h, "w-0").stage, NodeStage::Failed);
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Failure));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(600_000));
    assert_eq!(cause_of_replaced(&h, &first), Some(FailureCause::Failure));
}

#[test]
fn a_stream_reporting_its_agent_gone_is_a_lost_agent_whatever_it_says() {
    let mut h = converged(group("w", 1));
    let w0 = key(&h, "w-0");
    let gone = report(
        &h,
        "w-0",
        BootstrapEvent::Failed {
            stage: BootstrapStage::AgentLost,
            reason: "container swactor_w-0 was removed".to_owned(),
        },
    );
    assert_eq!(h.handle_bootstrap(gone, t(5)).unwrap(), Folded::Applied);
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(600_000));
    assert_eq!(cause_of_replaced(&h, &w0), Some(FailureCause::AgentLost));
}

#[test]
fn a_node_replaced_for_a_new_template_has_no_cause() {
    let mut h = converged(group("w", 1));
    let w0 = key(&h, "w-0");
    let mut next = group("w", 1);
    next.role = "v2".to_owned();
    h.handle_apply(&shape(2, vec![next]), Ticket(2), t(10))
        .unwrap();
    pump(&mut h, Agents::Converge, &mut Vec::new(), t(10));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(600_000));
    assert!(h.is_converged());
    assert_eq!(cause_of_replaced(&h, &w0), None);
}

#[test]
fn an_error_the_attempt_got_past_takes_its_cause_with_it() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let create = drain_host(&mut h, t(0));
    let refused = fail(&create[0], FailureClass::Definite);
    assert_eq!(h.handle_result(refused, t(1)).unwrap(), Folded::Applied);
    assert_eq!(record(&h, "w-0").last_cause(), Some(FailureCause::Failure));
    listen(&mut h, Agents::Converge, &mut Vec::new(), t(600_000));
    assert!(h.is_converged());
    assert_eq!(record(&h, "w-0").last_error(), None);
    assert_eq!(record(&h, "w-0").last_cause(), None);
}
