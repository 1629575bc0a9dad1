//! One test per row of the failure-classification table, plus backoff bookkeeping.

use crate::common;

use common::*;
use swactor_provisioning::*;

fn one_node() -> Driver {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    d
}

fn node(d: &Driver) -> &ManagedNode {
    &d.state().nodes[&node_id("w-0")]
}

/// Runs until the next dispatch of `kind`, succeeding everything before it.
fn until(d: &mut Driver, now: Timestamp, kind: EffectKind) -> Dispatch {
    for _ in 0..10 {
        for disp in drain(d, now) {
            if disp.request.kind() == kind {
                return disp;
            }
            assert_eq!(
                d.handle_result(success(&disp), now).unwrap(),
                Folded::Applied
            );
        }
    }
    panic!("no {kind:?} dispatched");
}

#[test]
fn a_failed_create_lease_retries_after_exponential_backoff_keeping_nothing() {
    let mut d = one_node();
    let c = until(&mut d, t(0), EffectKind::CreateLease);
    assert_eq!(
        d.handle_result(fail(&c, FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).retry.next_effect_at, Some(t(1_000)));
    assert_eq!(node(&d).record.lease, None);
    assert_eq!(node(&d).record.ambiguous, None);
    assert!(
        drain(&mut d, t(500)).is_empty(),
        "no retry before the backoff"
    );
    assert_eq!(d.poll_timeout(), Some(t(1_000)));
    d.handle_timeout(t(1_000)).unwrap();
    let retry = drain(&mut d, t(1_000));
    assert_eq!(retry.len(), 1);
    assert_eq!(
        retry[0].key.attempt, c.key.attempt,
        "same attempt, same identity"
    );
    assert_eq!(
        d.handle_result(fail(&retry[0], FailureClass::Definite), t(1_000))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).retry.next_effect_at, Some(t(3_000)), "doubles");
    assert_eq!(node(&d).retry.consecutive_failures, 2);
}

#[test]
fn endpoint_not_ready_is_a_probe_on_the_probe_interval_not_a_failure() {
    let mut d = one_node();
    let l = until(&mut d, t(0), EffectKind::LookupEndpoint);
    assert_eq!(
        d.handle_result(result(&l, OperationOutcome::EndpointNotReady), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).retry.consecutive_failures, 0);
    assert_eq!(
        node(&d).retry.next_effect_at,
        Some(t(d.config().probe_interval_ms))
    );
    assert!(node(&d).record.lease.is_some(), "the lease is kept");
    assert_eq!(node(&d).record.last_error(), None);
}

#[test]
fn a_failed_endpoint_lookup_keeps_the_lease_and_retries_after_backoff() {
    let mut d = one_node();
    let l = until(&mut d, t(0), EffectKind::LookupEndpoint);
    assert_eq!(
        d.handle_result(fail(&l, FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).retry.consecutive_failures, 1);
    assert_eq!(node(&d).retry.next_effect_at, Some(t(1_000)));
    assert!(node(&d).record.lease.is_some());
    assert_eq!(node(&d).record.stage, NodeStage::LeaseCreated);
}

#[test]
fn a_bootstrap_that_fails_to_start_ends_the_attempt_and_cleanup_starts_immediately() {
    let mut d = one_node();
    let s = until(&mut d, t(0), EffectKind::StartBootstrap);
    let first = s.key.attempt;
    assert_eq!(
        d.handle_result(fail(&s, FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).record.stage, NodeStage::Failed);
    assert_eq!(node(&d).retry.next_effect_at, None, "no backoff on cleanup");
    let cleanup = drain(&mut d, t(0));
    assert_eq!(cleanup.len(), 1);
    assert_eq!(
        cleanup[0].request.kind(),
        EffectKind::DestroyLease,
        "same instant"
    );
    assert_eq!(
        d.handle_result(success(&cleanup[0]), t(0)).unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(0)).is_empty());
    // Backoff applies to the restart.
    assert_eq!(node(&d).record.stage, NodeStage::Destroyed);
    assert_eq!(node(&d).record.restart_at, Some(t(1_000)));
    d.handle_timeout(t(1_000)).unwrap();
    let next = drain(&mut d, t(1_000));
    assert_eq!(next[0].request.kind(), EffectKind::CreateLease);
    assert!(next[0].key.attempt > first, "a fresh attempt");
    assert_eq!(
        node(&d).retry.consecutive_failures,
        1,
        "failures carry into the replacement"
    );
}

#[test]
fn a_bootstrap_runtime_or_join_failure_ends_the_attempt() {
    for event in [
        BootstrapEvent::Failed {
            stage: BootstrapStage::BootCheckFailed,
            reason: "check exited 1".into(),
        },
        BootstrapEvent::Failed {
            stage: BootstrapStage::JoinFailed,
            reason: "token refused".into(),
        },
        BootstrapEvent::Stage(BootstrapStage::SwactorStartFailed),
        BootstrapEvent::Stage(BootstrapStage::SshConnectFailed),
        BootstrapEvent::Closed,
    ] {
        let mut d = one_node();
        let s = until(&mut d, t(0), EffectKind::StartBootstrap);
        assert_eq!(d.handle_result(success(&s), t(0)).unwrap(), Folded::Applied);
        let o = observe(&d, "w-0", event.clone());
        assert_eq!(d.handle_bootstrap(o, t(5)).unwrap(), Folded::Applied);
        let n = node(&d);
        assert_eq!(n.record.stage, NodeStage::Failed, "{event:?}");
        assert_eq!(n.record.failed_at(), Some(t(5)));
        assert!(n.record.failed_reason().is_some());
        assert_eq!(n.retry.consecutive_failures, 1);
        let cleanup = drain(&mut d, t(5));
        let want = if event == BootstrapEvent::Closed {
            EffectKind::DestroyLease
        } else {
            EffectKind::CancelBootstrap
        };
        assert_eq!(cleanup[0].request.kind(), want, "{event:?}");
    }
}

#[test]
fn a_failed_cancel_or_destroy_stays_deleting_and_retries_after_backoff() {
    let mut d = one_node();
    converge(&mut d, t(0));
    d.update_desired(&shape(2, vec![])).unwrap();
    let cancel = drain(&mut d, t(0));
    assert_eq!(cancel[0].request.kind(), EffectKind::CancelBootstrap);
    assert_eq!(
        d.handle_result(fail(&cancel[0], FailureClass::Ambiguous), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).intent, Intent::Deleting);
    assert!(
        node(&d).record.session.is_some(),
        "failed cleanup keeps its live facts"
    );
    assert!(drain(&mut d, t(999)).is_empty());
    d.handle_timeout(t(1_000)).unwrap();
    let again = drain(&mut d, t(1_000));
    assert_eq!(again[0].request.kind(), EffectKind::CancelBootstrap);
    assert_eq!(
        d.handle_result(success(&again[0]), t(1_000)).unwrap(),
        Folded::Applied
    );
    let destroy = drain(&mut d, t(1_000));
    assert_eq!(destroy[0].request.kind(), EffectKind::DestroyLease);
    assert_eq!(
        d.handle_result(fail(&destroy[0], FailureClass::Definite), t(1_000))
            .unwrap(),
        Folded::Applied
    );
    assert!(node(&d).record.lease.is_some());
    assert_eq!(
        node(&d).retry.next_effect_at,
        Some(t(1_000 + 2_000)),
        "second failure"
    );
}

#[test]
fn an_ambiguous_create_is_remembered_and_reissued_so_the_executor_adopts() {
    let mut d = one_node();
    let c = until(&mut d, t(0), EffectKind::CreateLease);
    assert_eq!(
        d.handle_result(fail(&c, FailureClass::Ambiguous), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(
        node(&d).record.ambiguous,
        Some(AmbiguousCreate::CreateLease)
    );
    // Scale to zero: the ambiguous create is re-issued before anything else.
    d.update_desired(&shape(2, vec![])).unwrap();
    let next = drain(&mut d, t(0));
    assert_eq!(next[0].request.kind(), EffectKind::CreateLease);
    assert_eq!(next[0].key, c.key, "same identity, so the provider adopts");
    assert_eq!(
        d.handle_result(success(&next[0]), t(0)).unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).record.ambiguous, None);
    assert_eq!(
        drain(&mut d, t(0))[0].request.kind(),
        EffectKind::DestroyLease
    );
}

#[test]
fn an_operation_past_its_stored_deadline_folds_as_ambiguous_and_its_late_result_is_discarded() {
    let mut d = one_node();
    let c = until(&mut d, t(0), EffectKind::CreateLease);
    let deadline = c.deadline;
    assert_eq!(deadline, t(d.config().timeouts.create_lease_ms));
    assert_eq!(d.poll_timeout(), Some(deadline));
    assert_eq!(d.handle_timeout(deadline).unwrap(), 1);
    assert_eq!(
        node(&d).record.ambiguous,
        Some(AmbiguousCreate::CreateLease)
    );
    assert_eq!(node(&d).pending, None);
    assert_eq!(
        d.handle_result(success(&c), deadline).unwrap(),
        Folded::Discarded(DiscardReason::StaleOperation)
    );
    assert_eq!(node(&d).record.lease, None);
}

#[test]
fn a_bootstrap_that_stalls_past_its_deadline_fails_the_attempt() {
    let mut d = one_node();
    let s = until(&mut d, t(0), EffectKind::StartBootstrap);
    assert_eq!(d.handle_result(success(&s), t(0)).unwrap(), Folded::Applied);
    assert!(drain(&mut d, t(0)).is_empty());
    let stall = d.config().bootstrap_stall_ms;
    assert_eq!(d.poll_timeout(), Some(t(stall)));
    // While the boot check runs, the deadline leaves the agent its own
    // boot timeout (300 s by default) plus the margin to report it.
    let o = observe(&d, "w-0", BootstrapEvent::Stage(BootstrapStage::BootCheck));
    assert_eq!(d.handle_bootstrap(o, t(10)).unwrap(), Folded::Applied);
    assert!(drain(&mut d, t(10)).is_empty());
    let check = stall.max(300_000 + BOOT_CHECK_REPORT_MARGIN_MS);
    assert_eq!(d.poll_timeout(), Some(t(10 + check)));
    // Other progress pushes the deadline out by the stall time.
    let o = observe(
        &d,
        "w-0",
        BootstrapEvent::Stage(BootstrapStage::SwactorStart),
    );
    assert_eq!(d.handle_bootstrap(o, t(20)).unwrap(), Folded::Applied);
    assert!(drain(&mut d, t(20)).is_empty());
    assert_eq!(d.poll_timeout(), Some(t(20 + stall)));
    d.handle_timeout(t(20 + stall)).unwrap();
    assert_eq!(node(&d).record.stage, NodeStage::Failed);
    assert_eq!(node(&d).record.bootstrap, Some(BootstrapStage::AgentLost));
    let reason = node(&d).record.failed_reason().unwrap().to_owned();
    assert!(reason.contains("last reported: SwactorStart"), "{reason}");
}

#[test]
fn a_boot_check_that_outlives_its_timeout_and_its_report_fails_naming_the_boot_check() {
    let mut d = one_node();
    let s = until(&mut d, t(0), EffectKind::StartBootstrap);
    assert_eq!(d.handle_result(success(&s), t(0)).unwrap(), Folded::Applied);
    let o = observe(&d, "w-0", BootstrapEvent::Stage(BootstrapStage::BootCheck));
    assert_eq!(d.handle_bootstrap(o, t(0)).unwrap(), Folded::Applied);
    assert!(drain(&mut d, t(0)).is_empty());
    let at = d.poll_timeout().unwrap();
    d.handle_timeout(at).unwrap();
    assert_eq!(node(&d).record.stage, NodeStage::Failed);
    let reason = node(&d).record.failed_reason().unwrap().to_owned();
    assert!(
        reason.starts_with("the boot check did not finish within its boot_timeout_s of 300 s"),
        "{reason}"
    );
}

#[test]
fn reaching_ready_resets_the_failure_count() {
    let mut d = one_node();
    let c = until(&mut d, t(0), EffectKind::CreateLease);
    assert_eq!(
        d.handle_result(fail(&c, FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).retry.consecutive_failures, 1);
    d.handle_timeout(t(1_000)).unwrap();
    converge(&mut d, t(1_000));
    assert_eq!(node(&d).retry.consecutive_failures, 0);
    assert_eq!(node(&d).record.last_error(), None);
}

#[test]
fn a_ready_node_whose_agent_is_lost_is_failed_and_replaced() {
    let mut d = one_node();
    converge(&mut d, t(0));
    let first = node(&d).attempt;
    let o = observe(
        &d,
        "w-0",
        BootstrapEvent::Failed {
            stage: BootstrapStage::AgentLost,
            reason: "agent disconnected".into(),
        },
    );
    assert_eq!(d.handle_bootstrap(o, t(100)).unwrap(), Folded::Applied);
    assert_eq!(node(&d).record.stage, NodeStage::Failed);
    assert!(!d.is_converged());
    // Cleanup runs at once; the restart waits out one backoff.
    let cancel = drain(&mut d, t(100));
    assert_eq!(cancel[0].request.kind(), EffectKind::CancelBootstrap);
    assert_eq!(
        d.handle_result(success(&cancel[0]), t(100)).unwrap(),
        Folded::Applied
    );
    let destroy = drain(&mut d, t(100));
    assert_eq!(
        d.handle_result(success(&destroy[0]), t(100)).unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(100)).is_empty());
    assert_eq!(node(&d).record.restart_at, Some(t(1_100)));
    assert_eq!(d.handle_timeout(t(1_100)).unwrap(), 0);
    converge(&mut d, t(1_100));
    assert!(node(&d).attempt > first);
}

#[test]
fn a_lost_agent_fails_only_the_current_active_attempt() {
    let mut d = one_node();
    converge(&mut d, t(0));
    let attempt = node(&d).attempt;
    let stale = NodeAttemptId(attempt.0 - 1);
    assert_eq!(
        d.handle_agent_lost(
            &node_id("w-0"),
            stale,
            FailureCause::AgentLost,
            "gone",
            t(1)
        ),
        Folded::Discarded(DiscardReason::SupersededAttempt)
    );
    assert!(d.is_converged());
    assert_eq!(
        d.handle_agent_lost(
            &node_id("w-0"),
            attempt,
            FailureCause::AgentLost,
            "disconnected for 5s",
            t(1)
        ),
        Folded::Applied
    );
    assert_eq!(node(&d).record.stage, NodeStage::Failed);
    assert_eq!(node(&d).record.bootstrap, Some(BootstrapStage::AgentLost));
    // A second report changes nothing.
    assert_eq!(
        d.handle_agent_lost(
            &node_id("w-0"),
            attempt,
            FailureCause::AgentLost,
            "again",
            t(2)
        ),
        Folded::Discarded(DiscardReason::NotActive)
    );
    assert_eq!(node(&d).retry.consecutive_failures, 1);
}

#[test]
fn an_operation_interrupted_by_a_scale_down_never_holds_back_the_cleanup() {
    // Scale the slot away while its StartBootstrap (or LookupEndpoint) is
    // pending; the operation then fails definitely. The cleanup it would
    // have been part of must start at once: no backoff, no failure counted.
    for kind in [EffectKind::LookupEndpoint, EffectKind::StartBootstrap] {
        let mut d = one_node();
        let op = until(&mut d, t(0), kind);
        d.update_desired(&shape(2, vec![group("w", 0)])).unwrap();
        assert!(drain(&mut d, t(0)).is_empty(), "BeginDelete only");
        assert_eq!(node(&d).intent, Intent::Deleting);
        assert_eq!(
            d.handle_result(fail(&op, FailureClass::Definite), t(0))
                .unwrap(),
            Folded::Applied
        );
        assert_eq!(node(&d).retry.next_effect_at, None, "{kind:?}");
        assert_eq!(node(&d).retry.consecutive_failures, 0, "{kind:?}");
        let next = drain(&mut d, t(0));
        assert_eq!(next.len(), 1, "{kind:?}: {next:?}");
        assert_eq!(next[0].request.kind(), EffectKind::DestroyLease, "{kind:?}");
        // A failing cleanup step still backs off.
        assert_eq!(
            d.handle_result(fail(&next[0], FailureClass::Definite), t(0))
                .unwrap(),
            Folded::Applied
        );
        assert_eq!(node(&d).retry.next_effect_at, Some(t(1_000)), "{kind:?}");
    }
}

#[test]
fn an_endpoint_that_never_becomes_ready_fails_the_attempt_at_its_groups_deadline() {
    let mut d = driver();
    let mut g = group("w", 1);
    g.limits.endpoint_timeout_s = 10.0;
    d.update_desired(&shape(1, vec![g])).unwrap();
    let create = until(&mut d, t(0), EffectKind::CreateLease);
    assert_eq!(
        d.handle_result(success(&create), t(0)).unwrap(),
        Folded::Applied
    );
    assert_eq!(node(&d).record.endpoint_deadline, Some(t(10_000)));
    let mut now = 0;
    let cleanup = loop {
        let lookups = drain(&mut d, t(now));
        if node(&d).intent == Intent::Deleting || now > 20_000 {
            break lookups;
        }
        for l in lookups {
            assert_eq!(l.request.kind(), EffectKind::LookupEndpoint);
            let not_ready = result(&l, OperationOutcome::EndpointNotReady);
            assert_eq!(d.handle_result(not_ready, t(now)).unwrap(), Folded::Applied);
        }
        now += 1_000;
        d.handle_timeout(t(now)).unwrap();
    };
    assert!(
        (10_000..=11_000).contains(&now),
        "failed at {now} ms, the deadline is 10 s and probes are 1 s apart"
    );
    let reason = node(&d).record.failed_reason().unwrap().to_owned();
    assert!(reason.contains("not ready within 10 s"), "{reason}");
    // Its cleanup destroys the lease (a stuck instance is not left billing).
    assert_eq!(cleanup.len(), 1);
    assert_eq!(cleanup[0].request.kind(), EffectKind::DestroyLease);
}

#[test]
fn a_lease_the_provider_says_is_gone_fails_the_attempt_and_is_still_destroyed() {
    for kind in [EffectKind::LookupEndpoint, EffectKind::StartBootstrap] {
        let mut d = one_node();
        let op = until(&mut d, t(0), kind);
        assert_eq!(
            d.handle_result(fail(&op, FailureClass::LeaseGone), t(0))
                .unwrap(),
            Folded::Applied
        );
        assert_eq!(node(&d).record.stage, NodeStage::Failed, "{kind:?}");
        let reason = node(&d).record.failed_reason().unwrap().to_owned();
        assert!(reason.contains("the lease is gone"), "{reason}");
        // Destroying what the provider says is gone is cheap and certain;
        // trusting the word alone could leak a machine that only looked gone.
        let mut next = drain(&mut d, t(0));
        assert_eq!(next.len(), 1, "{kind:?}: {next:?}");
        assert_eq!(next[0].request.kind(), EffectKind::DestroyLease);
        let destroyed = next.remove(0);
        assert_eq!(
            d.handle_result(success(&destroyed), t(0)).unwrap(),
            Folded::Applied
        );
        assert!(drain(&mut d, t(0)).is_empty());
        assert_eq!(node(&d).record.stage, NodeStage::Destroyed);
    }
}

/// A host whose bootstrap streams prove joins.
fn host() -> Host<Driver> {
    let config = HostConfig {
        stream_joins: true,
        ..HostConfig::default()
    };
    Host::new(driver(), config, None).unwrap()
}

#[test]
fn an_error_is_no_longer_shown_once_the_step_it_held_back_succeeds() {
    let mut h = host();
    h.handle_apply(&shape(1, vec![group("w", 1)]), Ticket(1), t(0))
        .unwrap();
    let w0 = node_id("w-0");
    let error = |h: &Host<Driver>| {
        h.core().state().nodes[&w0]
            .record
            .last_error()
            .map(str::to_owned)
    };
    let mut now = t(0);
    let mut failed_once = false;
    for _ in 0..50 {
        for d in drain_host(&mut h, now) {
            if d.request.kind() == EffectKind::CreateLease && !failed_once {
                // The provider has no room yet ("waiting for a free host").
                failed_once = true;
                let _ = h
                    .handle_result(fail(&d, FailureClass::Definite), now)
                    .unwrap();
                assert_eq!(error(&h).as_deref(), Some("CreateLease: injected"));
                continue;
            }
            assert_eq!(h.handle_result(success(&d), now).unwrap(), Folded::Applied);
            // The create went through: what held it back is over.
            assert_eq!(error(&h), None, "after {:?}", d.request.kind());
            if d.request.kind() == EffectKind::StartBootstrap {
                for event in [
                    BootstrapEvent::SwactorJoined,
                    BootstrapEvent::Stage(BootstrapStage::Converged),
                ] {
                    let obs = observe(h.core(), "w-0", event);
                    assert_eq!(h.handle_bootstrap(obs, now).unwrap(), Folded::Applied);
                }
            }
        }
        if h.is_converged() {
            break;
        }
        now = now.saturating_add_ms(1_000);
        let _ = h.handle_timeout(now);
    }
    assert!(failed_once && h.is_converged(), "{:#?}", h.core().state());
    let history = h.history(&w0).expect("w-0 has a history");
    let latest = history.last().expect("one attempt");
    assert!(latest.ready_at.is_some(), "{latest:#?}");
    assert_eq!(
        latest.last_error, None,
        "`describe` of a ready attempt shows no error it got past"
    );
}
