//! Driver core: revision contract, trigger semantics, pending-before-dispatch, limits.

use crate::common;

use common::*;
use swactor_provisioning::*;

#[test]
fn the_revision_contract_rejects_regressions_silent_changes_and_other_runs() {
    let mut d = driver();
    assert_eq!(
        d.update_desired(&shape(3, vec![group("w", 2)])),
        Ok(DesiredUpdate::Accepted(Generation(3)))
    );
    // An identical resubmission is a no-op.
    assert_eq!(
        d.update_desired(&shape(3, vec![group("w", 2)])),
        Ok(DesiredUpdate::Unchanged(Generation(3)))
    );
    // Same generation, new content: rejected.
    assert_eq!(
        d.update_desired(&shape(3, vec![group("w", 3)])),
        Err(UpdateError::SameGenerationChanged {
            generation: Generation(3)
        })
    );
    // Regression: rejected, even with identical content.
    assert!(matches!(
        d.update_desired(&shape(2, vec![group("w", 2)])),
        Err(UpdateError::GenerationRegressed { .. })
    ));
    let mut other = shape(4, vec![group("w", 2)]);
    other.run_id = RunId::new("other");
    assert!(matches!(
        d.update_desired(&other),
        Err(UpdateError::RunMismatch { .. })
    ));
    let mut invalid = shape(4, vec![group("w", 2)]);
    invalid.groups[0].id = "W".into();
    assert!(matches!(
        d.update_desired(&invalid),
        Err(UpdateError::Invalid(_))
    ));
    assert_eq!(
        d.desired().generation,
        Generation(3),
        "rejections change nothing"
    );
    // Generations may be skipped.
    assert_eq!(
        d.update_desired(&shape(10, vec![group("w", 1)])),
        Ok(DesiredUpdate::Accepted(Generation(10)))
    );
}

#[test]
fn every_dispatch_is_recorded_as_pending_before_it_is_returned() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 3)])).unwrap();
    let dispatches = drain(&mut d, t(0));
    assert_eq!(dispatches.len(), 3);
    for disp in &dispatches {
        let n = &d.state().nodes[&disp.key.node];
        let p = n.pending.as_ref().expect("pending recorded");
        assert_eq!(
            (p.id, p.effect, p.deadline),
            (disp.op, disp.request.kind(), disp.deadline)
        );
        assert_eq!(n.attempt, disp.key.attempt);
    }
    // And while pending, nothing more is emitted for those nodes.
    d.handle_tick(t(1));
    assert!(drain(&mut d, t(1)).is_empty());
}

#[test]
fn poll_pass_during_a_pass_is_reentry_and_is_refused() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let _pass = d.poll_pass(t(0)).unwrap().expect("queued");
    assert_eq!(d.poll_pass(t(0)).unwrap_err(), DriverError::Reentry);
    d.finish_pass().unwrap();
    assert_eq!(d.finish_pass(), Err(DriverError::NotRunning));
}

#[test]
fn triggers_while_queued_collapse_and_a_trigger_during_a_pass_gets_exactly_one_follow_up() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    d.update_desired(&shape(2, vec![group("w", 2)])).unwrap();
    d.update_desired(&shape(3, vec![group("w", 3)])).unwrap();
    assert_eq!(d.stats().collapsed_triggers, 2);
    // The inserts pass: transitions guarantee a follow-up.
    let p = d.poll_pass(t(0)).unwrap().unwrap();
    assert_eq!(p.stats.transitions, 3);
    d.finish_pass().unwrap();
    let p = d.poll_pass(t(0)).unwrap().unwrap();
    assert_eq!(p.dispatches.len(), 3);
    // Two triggers during the pass: exactly one follow-up.
    let r0 = success(&p.dispatches[0]);
    let r1 = success(&p.dispatches[1]);
    assert_eq!(d.handle_result(r0, t(0)).unwrap(), Folded::Applied);
    assert_eq!(d.handle_result(r1, t(0)).unwrap(), Folded::Applied);
    d.finish_pass().unwrap();
    assert!(d.is_pass_queued());
    let follow = d.poll_pass(t(0)).unwrap().unwrap();
    assert_eq!(follow.dispatches.len(), 2);
    d.finish_pass().unwrap();
    assert!(
        d.poll_pass(t(0)).unwrap().is_none(),
        "exactly one follow-up"
    );
}

#[test]
fn a_failed_submission_folds_as_an_operation_failure() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let disp = drain(&mut d, t(0)).pop().unwrap();
    assert_eq!(
        d.handle_submit_failed(&disp.key.node, disp.op, "queue full", t(0))
            .unwrap(),
        Folded::Applied
    );
    let n = &d.state().nodes[&node_id("w-0")];
    assert!(n.pending.is_none());
    assert_eq!(n.retry.consecutive_failures, 1);
    assert!(n.record.last_error().unwrap().contains("queue full"));
}

#[test]
fn poll_timeout_is_the_earliest_deadline_among_waiting_nodes() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 2)])).unwrap();
    let ds = drain(&mut d, t(0));
    assert_eq!(
        d.poll_timeout(),
        Some(t(d.config().timeouts.create_lease_ms))
    );
    assert_eq!(
        d.handle_result(fail(&ds[0], FailureClass::Definite), t(10))
            .unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(10)).is_empty());
    assert_eq!(
        d.poll_timeout(),
        Some(t(1_010)),
        "the backoff is earlier than the other create's deadline"
    );
}

#[test]
fn scale_down_removes_only_the_highest_indexes() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 4)])).unwrap();
    converge(&mut d, t(0));
    d.update_desired(&shape(2, vec![group("w", 2)])).unwrap();
    let p = d.plan(t(0));
    let deleting: Vec<String> = p.actions.iter().map(|a| a.node.to_string()).collect();
    assert_eq!(deleting, ["w-2", "w-3"]);
    converge(&mut d, t(0));
    let left: Vec<String> = d.state().nodes.keys().map(ToString::to_string).collect();
    assert_eq!(left, ["w-0", "w-1"]);
}

#[test]
fn spec_drift_replaces_the_attempt_only_after_full_cleanup() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    converge(&mut d, t(0));
    let first = d.state().nodes[&node_id("w-0")].attempt;
    let mut g = group("w", 1);
    g.role = "coordinator".into();
    d.update_desired(&shape(2, vec![g])).unwrap();
    let cancel = drain(&mut d, t(0));
    assert_eq!(cancel.len(), 1);
    assert_eq!(cancel[0].key.attempt, first);
    assert_eq!(cancel[0].request.kind(), EffectKind::CancelBootstrap);
    assert_eq!(
        d.handle_result(success(&cancel[0]), t(0)).unwrap(),
        Folded::Applied
    );
    let destroy = drain(&mut d, t(0));
    assert_eq!(destroy[0].request.kind(), EffectKind::DestroyLease);
    assert_eq!(
        d.handle_result(success(&destroy[0]), t(0)).unwrap(),
        Folded::Applied
    );
    let create = drain(&mut d, t(0));
    assert_eq!(create[0].request.kind(), EffectKind::CreateLease);
    assert!(create[0].key.attempt > first);
    assert_eq!(
        d.handle_result(success(&create[0]), t(0)).unwrap(),
        Folded::Applied
    );
    converge(&mut d, t(0));
    assert_eq!(
        d.state().nodes[&node_id("w-0")].template.role,
        "coordinator"
    );
}

#[test]
fn a_new_placement_reaches_new_nodes_and_replaces_none_already_placed() {
    let hosts = |names: &[&str]| {
        let mut g = group("w", 1);
        g.provider.placement.insert(
            "hosts".into(),
            ParamValue::List(names.iter().map(|h| ParamValue::Str((*h).into())).collect()),
        );
        g
    };
    let mut d = driver();
    d.update_desired(&shape(1, vec![hosts(&["a"])])).unwrap();
    converge(&mut d, t(0));
    let first = d.state().nodes[&node_id("w-0")].attempt;
    let placed = d.desired().slot(&node_id("w-0")).unwrap().clone();

    // The same generation with another placement is a change, not a resubmission.
    assert!(matches!(
        d.update_desired(&shape(1, vec![hosts(&["a", "b"])])),
        Err(UpdateError::SameGenerationChanged { .. })
    ));
    let mut two = hosts(&["a", "b"]);
    two.count = 2;
    d.update_desired(&shape(2, vec![two])).unwrap();
    let wider = d.desired().slot(&node_id("w-1")).unwrap().clone();
    assert!(same_template(&placed, &wider));
    assert_eq!(placed.digest(), wider.digest());
    assert_ne!(
        *placed, *wider,
        "the new placement is what the provider sees"
    );
    // Only the new slot is created; w-0 keeps its attempt.
    let created = drain(&mut d, t(0));
    assert_eq!(created.len(), 1, "{created:?}");
    assert_eq!(created[0].key.node, node_id("w-1"));
    match &created[0].request {
        EffectRequest::CreateLease { template } => assert_eq!(
            template.provider.placement["hosts"],
            ParamValue::List(vec![
                ParamValue::Str("a".into()),
                ParamValue::Str("b".into())
            ])
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        d.handle_result(success(&created[0]), t(0)).unwrap(),
        Folded::Applied
    );
    converge(&mut d, t(0));
    assert_eq!(d.state().nodes[&node_id("w-0")].attempt, first);
}

#[test]
fn a_node_backing_off_a_failed_create_retries_at_once_with_a_new_placement() {
    let placed = |host: &str| {
        let mut g = group("w", 1);
        g.provider.placement.insert(
            "hosts".into(),
            ParamValue::List(vec![ParamValue::Str(host.into())]),
        );
        g
    };
    let mut d = driver();
    d.update_desired(&shape(1, vec![placed("a")])).unwrap();
    let create = drain(&mut d, t(0));
    assert_eq!(create[0].request.kind(), EffectKind::CreateLease);
    assert_eq!(
        d.handle_result(fail(&create[0], FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    assert!(drain(&mut d, t(0)).is_empty(), "backing off");
    let gate = d.state().nodes[&node_id("w-0")].retry.next_effect_at;
    assert!(gate.is_some_and(|at| at > t(0)));
    // Another placement: the create is retried now, with it.
    d.update_desired(&shape(2, vec![placed("b")])).unwrap();
    let retry = drain(&mut d, t(0));
    assert_eq!(retry.len(), 1);
    match &retry[0].request {
        EffectRequest::CreateLease { template } => assert_eq!(
            template.provider.placement["hosts"],
            ParamValue::List(vec![ParamValue::Str("b".into())])
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        retry[0].key.attempt, create[0].key.attempt,
        "the same attempt"
    );
}

#[test]
fn attempt_id_exhaustion_is_an_error_not_a_panic_or_a_spin() {
    let mut d = Driver::new(
        RunId::new("run"),
        ReconcilerConfig {
            first_attempt_id: u64::MAX - 1,
            ..config()
        },
    )
    .unwrap();
    d.update_desired(&shape(1, vec![group("w", 3)])).unwrap();
    let pass = d.poll_pass(t(0)).unwrap().unwrap();
    assert_eq!(pass.stats.transitions, 1, "only one id was left");
    assert_eq!(pass.errors.len(), 2);
    assert!(matches!(
        pass.errors[0],
        DriverError::AttemptIdsExhausted { .. }
    ));
    d.finish_pass().unwrap();
    // The follow-up pass fails the same way; it does not loop on its own.
    let pass = d.poll_pass(t(0)).unwrap().unwrap();
    d.finish_pass().unwrap();
    assert!(pass.errors.len() == 2);
    assert!(d.poll_pass(t(0)).unwrap().is_none());
}

#[test]
fn deadline_overflow_is_an_error_and_leaves_the_node_unchanged() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let near_end = t(u64::MAX - 10);
    let pass = d.poll_pass(near_end).unwrap().unwrap();
    d.finish_pass().unwrap();
    assert!(pass.errors.is_empty());
    let pass = d.poll_pass(near_end).unwrap().unwrap();
    d.finish_pass().unwrap();
    assert!(
        matches!(pass.errors[0], DriverError::Deadline { .. }),
        "{:?}",
        pass.errors
    );
    let n = &d.state().nodes[&node_id("w-0")];
    assert!(n.pending.is_none());
    assert_eq!(n.record.stage, NodeStage::New);
}

#[test]
fn plan_previews_a_shape_without_applying_it() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    converge(&mut d, t(0));
    let before = d.state().clone();
    let plan = d.plan_shape(&shape(2, vec![group("w", 3)]), t(0)).unwrap();
    let rows: Vec<_> = plan
        .actions
        .iter()
        .map(|a| (a.node.to_string(), a.row))
        .collect();
    assert_eq!(
        rows,
        [
            ("w-1".into(), LadderRow::InsertSlot),
            ("w-2".into(), LadderRow::InsertSlot)
        ]
    );
    assert_eq!(d.state(), &before);
    assert_eq!(d.desired().generation, Generation(1));
    assert!(d.plan_shape(&shape(0, vec![]), t(0)).is_err());
}

#[test]
fn observed_generation_alone_is_not_convergence() {
    let mut d = driver();
    d.update_desired(&shape(5, vec![group("w", 1)])).unwrap();
    drain(&mut d, t(0));
    assert_eq!(d.state().observed_generation, Some(Generation(5)));
    assert!(!d.is_converged());
}

#[test]
fn results_of_a_superseded_attempt_are_discarded() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let s = {
        let mut found = None;
        for _ in 0..5 {
            for disp in drain(&mut d, t(0)) {
                if disp.request.kind() == EffectKind::StartBootstrap {
                    found = Some(disp);
                } else {
                    assert_eq!(
                        d.handle_result(success(&disp), t(0)).unwrap(),
                        Folded::Applied
                    );
                }
            }
        }
        found.unwrap()
    };
    assert_eq!(
        d.handle_result(fail(&s, FailureClass::Definite), t(0))
            .unwrap(),
        Folded::Applied
    );
    let old_session_obs = BootstrapObservation {
        node: node_id("w-0"),
        attempt: s.key.attempt,
        session: SessionId::from("whatever"),
        event: BootstrapEvent::SwactorJoined,
    };
    for disp in drain(&mut d, t(0)) {
        assert_eq!(
            d.handle_result(success(&disp), t(0)).unwrap(),
            Folded::Applied
        );
    }
    drain(&mut d, t(0));
    d.handle_timeout(t(1_000)).unwrap();
    drain(&mut d, t(1_000));
    let before = d.state().clone();
    assert_eq!(
        d.handle_result(success(&s), t(1_000)).unwrap(),
        Folded::Discarded(DiscardReason::SupersededAttempt)
    );
    assert_eq!(
        d.handle_bootstrap(old_session_obs, t(1_000)).unwrap(),
        Folded::Discarded(DiscardReason::SupersededAttempt)
    );
    assert_eq!(d.state(), &before);
}

#[test]
fn adopting_resources_reissues_their_creates_under_the_same_key_and_skips_used_attempt_ids() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 2)])).unwrap();
    let key = |node: &str, attempt| ResourceKey {
        run_id: RunId::new("run"),
        node: node_id(node),
        attempt: NodeAttemptId(attempt),
    };
    let mut foreign = key("w-0", 1);
    foreign.run_id = RunId::new("other");
    let known = d.desired().slot(&node_id("w-0")).cloned();
    let entry = |key, template| AdoptEntry {
        key,
        template,
        lease: None,
        session: None,
        failures: 0,
    };
    let report = d.adopt(
        vec![
            entry(key("w-0", 3), None),
            entry(key("w-0", 7), known),
            entry(key("w-5", 4), None),
            entry(foreign.clone(), None),
        ],
        1 << 32,
    );
    assert_eq!(report.adopted, [key("w-0", 7), key("w-5", 4)]);
    assert_eq!(report.orphans, [key("w-0", 3)]);
    assert_eq!(report.foreign, [foreign]);
    assert!(report.drifted.is_empty(), "{:?}", report.drifted);
    let dispatches = drain(&mut d, t(0));
    let mut by_node: Vec<_> = dispatches
        .iter()
        .map(|x| (x.key.node.to_string(), x.key.attempt.0, x.request.kind()))
        .collect();
    by_node.sort();
    // w-0 re-issues its create under attempt 7 (adopt); w-1 is new and gets an
    // id past every adopted one; w-5 is undesired, so it adopts, then cleans up.
    assert_eq!(
        by_node,
        [
            ("w-0".into(), 7, EffectKind::CreateLease),
            ("w-1".into(), 8, EffectKind::CreateLease),
            ("w-5".into(), 4, EffectKind::CreateLease),
        ]
    );
    for x in &dispatches {
        assert_eq!(d.handle_result(success(x), t(0)).unwrap(), Folded::Applied);
    }
    let next: Vec<_> = drain(&mut d, t(0))
        .iter()
        .map(|x| (x.key.node.to_string(), x.request.kind()))
        .collect();
    assert!(
        next.contains(&("w-5".to_string(), EffectKind::DestroyLease)),
        "{next:?}"
    );
}

#[test]
fn an_adopted_attempt_whose_template_is_not_known_to_be_the_desired_one_is_replaced() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let key = ResourceKey {
        run_id: RunId::new("run"),
        node: node_id("w-0"),
        attempt: NodeAttemptId(3),
    };
    let entry = AdoptEntry {
        key: key.clone(),
        template: None,
        lease: None,
        session: None,
        failures: 0,
    };
    let report = d.adopt(vec![entry], 7 << 32);
    assert_eq!(report.drifted, std::slice::from_ref(&key));
    // It begins deleting at once, and its create is re-issued before any
    // destructive step (adopt before destroy), numbered past every operation
    // an earlier driver could have used.
    let first = drain(&mut d, t(0));
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].request.kind(), EffectKind::CreateLease);
    assert_eq!(first[0].op.seq, 7 << 32);
    assert_eq!(d.state().nodes[&key.node].intent, Intent::Deleting);
    assert_eq!(
        d.handle_result(success(&first[0]), t(0)).unwrap(),
        Folded::Applied
    );
    let next = drain(&mut d, t(0));
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].request.kind(), EffectKind::DestroyLease);
    assert_eq!(next[0].key, key);
}

#[test]
fn an_adopted_listed_lease_is_taken_as_it_is_and_never_created_again() {
    let mut d = driver();
    d.update_desired(&shape(1, vec![group("w", 1)])).unwrap();
    let key = ResourceKey {
        run_id: RunId::new("run"),
        node: node_id("w-0"),
        attempt: NodeAttemptId(3),
    };
    let entry = AdoptEntry {
        key: key.clone(),
        template: d.desired().slot(&key.node).cloned(),
        lease: Some(LeaseId::from("listed")),
        session: Some(SessionId::from("running")),
        failures: 0,
    };
    let report = d.adopt(vec![entry], 1 << 32);
    assert_eq!(report.adopted, std::slice::from_ref(&key));
    let n = &d.state().nodes[&key.node];
    assert_eq!(n.record.lease, Some(LeaseId::from("listed")));
    assert_eq!(n.record.ambiguous, None);
    // Kept: its session is re-attached by StartBootstrap, not assumed.
    assert_eq!(n.record.session, None);
    let next = drain(&mut d, t(0));
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].request.kind(), EffectKind::LookupEndpoint);
    // If the lease turns out to be gone, the attempt fails; nothing is created for it.
    let gone = fail(&next[0], FailureClass::LeaseGone);
    assert_eq!(d.handle_result(gone, t(0)).unwrap(), Folded::Applied);
    let cleanup = drain(&mut d, t(0));
    assert!(
        cleanup
            .iter()
            .all(|x| x.request.kind() != EffectKind::CreateLease || x.key.attempt != key.attempt),
        "{cleanup:?}"
    );
}
