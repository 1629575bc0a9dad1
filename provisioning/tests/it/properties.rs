//! Property tests over random traces of shape updates, results, observations and time.

use crate::common;

use common::*;
use proptest::prelude::*;
use std::collections::BTreeSet;
use swactor_provisioning::*;

#[derive(Clone, Debug)]
enum Step {
    /// Apply a shape with these counts for groups `a` and `b`; `drift` flips a's role.
    Shape { a: u32, b: u32, drift: bool },
    /// Answer the i-th outstanding dispatch with an outcome of this kind.
    Answer { i: usize, how: u8 },
    /// Drop the i-th outstanding dispatch (its result is lost).
    Lose { i: usize },
    /// Send a bootstrap event to the i-th node with a live session.
    Observe { i: usize, ev: u8 },
    /// Replay a result recorded earlier (duplicate or late).
    Replay { i: usize },
    /// Advance time and fire the timer.
    Advance { ms: u64 },
    /// The periodic tick.
    Tick,
    /// Pause (`true`) or resume reconciling.
    Pause(bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (0u32..4, 0u32..3, any::<bool>()).prop_map(|(a, b, drift)| Step::Shape { a, b, drift }),
        6 => (0usize..8, 0u8..10).prop_map(|(i, how)| Step::Answer { i, how }),
        1 => (0usize..8).prop_map(|i| Step::Lose { i }),
        3 => (0usize..8, 0u8..8).prop_map(|(i, ev)| Step::Observe { i, ev }),
        1 => (0usize..64).prop_map(|i| Step::Replay { i }),
        2 => (1u64..120_000).prop_map(|ms| Step::Advance { ms }),
        1 => Just(Step::Tick),
        1 => any::<bool>().prop_map(Step::Pause),
    ]
}

struct World {
    d: Driver,
    now: u64,
    generation: u64,
    outstanding: Vec<Dispatch>,
    answered: Vec<OperationResult>,
    attempts_seen: BTreeSet<NodeAttemptId>,
}

impl World {
    fn new() -> Self {
        let cfg = ReconcilerConfig {
            jitter_permille: 300,
            ..ReconcilerConfig::default()
        };
        Self {
            d: Driver::new(RunId::new("run"), cfg).unwrap(),
            now: 0,
            generation: 0,
            outstanding: Vec::new(),
            answered: Vec::new(),
            attempts_seen: BTreeSet::new(),
        }
    }

    fn pump(&mut self) {
        let now = t(self.now);
        while self.d.is_pass_queued() {
            // The driver decides only dirty and due nodes; that must be exactly
            // what a full pass over every slot would decide.
            let full = if self.d.is_paused() {
                reconcile_paused(self.d.state(), self.d.desired(), now)
            } else {
                reconcile(self.d.state(), self.d.desired(), now)
            };
            let incremental = self.d.next_pass_plan(now);
            assert_eq!(
                incremental, full,
                "incremental pass diverged from a full pass"
            );
            let pass = self.d.poll_pass(now).unwrap().expect("queued");
            self.outstanding.extend(pass.dispatches);
            self.d.finish_pass().unwrap();
        }
        // Attempt ids are never reused: a node's attempt is either one we
        // already saw on that node, or brand new.
        for n in self.d.state().nodes.values() {
            self.attempts_seen.insert(n.attempt);
        }
        assert!(self.d.state().next_attempt > self.attempts_seen.last().map_or(0, |a| a.0));
    }

    fn apply(&mut self, s: &Step) {
        let now = t(self.now);
        match s {
            Step::Shape { a, b, drift } => {
                self.generation += 1;
                let mut ga = group("a", *a);
                if *drift {
                    ga.role = "coordinator".into();
                }
                let sh = shape(self.generation, vec![ga, group("b", *b)]);
                self.d.update_desired(&sh).unwrap();
            }
            Step::Answer { i, how } if !self.outstanding.is_empty() => {
                let disp = self.outstanding.remove(i % self.outstanding.len());
                let r = match how {
                    0 => fail(&disp, FailureClass::Definite),
                    1 => fail(&disp, FailureClass::Ambiguous),
                    2 if disp.request.kind() == EffectKind::LookupEndpoint => {
                        result(&disp, OperationOutcome::EndpointNotReady)
                    }
                    _ => success(&disp),
                };
                self.answered.push(r.clone());
                let _ = self.d.handle_result(r, now).unwrap();
            }
            Step::Lose { i } if !self.outstanding.is_empty() => {
                let n = self.outstanding.len();
                let _lost = self.outstanding.remove(i % n);
            }
            Step::Observe { i, ev } => {
                let live: Vec<_> = self
                    .d
                    .state()
                    .nodes
                    .iter()
                    .filter_map(|(id, n)| n.record.session.clone().map(|s| (*id, n.attempt, s)))
                    .collect();
                if let Some((node, attempt, session)) = live.get(i % live.len().max(1)).cloned() {
                    let event = match ev {
                        0 => BootstrapEvent::Stage(BootstrapStage::BootCheck),
                        1 | 2 => BootstrapEvent::SwactorJoined,
                        3 | 4 => BootstrapEvent::Stage(BootstrapStage::Converged),
                        5 => BootstrapEvent::Closed,
                        6 => BootstrapEvent::Failed {
                            stage: BootstrapStage::JoinFailed,
                            reason: "x".into(),
                        },
                        _ => BootstrapEvent::Stage(BootstrapStage::AgentLost),
                    };
                    let obs = BootstrapObservation {
                        node,
                        attempt,
                        session,
                        event,
                    };
                    let _ = self.d.handle_bootstrap(obs, now).unwrap();
                }
            }
            Step::Replay { i } if !self.answered.is_empty() => {
                let r = self.answered[i % self.answered.len()].clone();
                let _ = self.d.handle_result(r, now).unwrap();
            }
            Step::Advance { ms } => {
                self.now += ms;
                let _ = self.d.handle_timeout(t(self.now)).unwrap();
            }
            Step::Tick => self.d.handle_tick(now),
            Step::Pause(on) => self.d.set_paused(*on),
            _ => {}
        }
        self.pump();
    }

    /// Faults stop: answer everything successfully, complete bootstraps, let time pass.
    fn settle(&mut self) {
        self.d.set_paused(false);
        self.pump();
        for _ in 0..400 {
            if self.d.is_converged() && self.outstanding.is_empty() {
                return;
            }
            if let Some(disp) = self.outstanding.pop() {
                let _ = self.d.handle_result(success(&disp), t(self.now)).unwrap();
            } else {
                let running: Vec<_> = self
                    .d
                    .state()
                    .nodes
                    .iter()
                    .filter(|(_, n)| {
                        n.intent == Intent::Active
                            && n.record.session.is_some()
                            && n.record.bootstrap != Some(BootstrapStage::Converged)
                    })
                    .map(|(id, n)| (*id, n.attempt, n.record.session.clone().unwrap()))
                    .collect();
                if running.is_empty() {
                    self.now = self
                        .d
                        .poll_timeout()
                        .map_or(self.now + 1, |at| at.as_millis().max(self.now));
                    let _ = self.d.handle_timeout(t(self.now)).unwrap();
                }
                for (node, attempt, session) in running {
                    for event in [
                        BootstrapEvent::SwactorJoined,
                        BootstrapEvent::Stage(BootstrapStage::Converged),
                    ] {
                        let obs = BootstrapObservation {
                            node,
                            attempt,
                            session: session.clone(),
                            event,
                        };
                        let _ = self.d.handle_bootstrap(obs, t(self.now)).unwrap();
                    }
                }
            }
            self.pump();
        }
        panic!("did not settle: {:#?}", self.d.state());
    }
}

fn run(trace: &[Step]) -> World {
    let mut w = World::new();
    for s in trace {
        w.apply(s);
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct("proptest-regressions/properties.txt"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn incremental_passes_equal_full_passes(trace in proptest::collection::vec(step(), 0..200)) {
        // `World::pump` compares the driver's incremental plan with a full
        // `reconcile` before every pass; here the trace ends with a settle so
        // the comparison also covers the fault-free tail.
        let mut w = run(&trace);
        w.settle();
        let full = reconcile(w.d.state(), w.d.desired(), t(w.now));
        prop_assert_eq!(full.requeue_at, None);
    }

    #[test]
    fn the_same_trace_gives_the_same_state(trace in proptest::collection::vec(step(), 0..120)) {
        let a = run(&trace);
        let b = run(&trace);
        prop_assert_eq!(a.d.state(), b.d.state());
        prop_assert_eq!(a.d.stats(), b.d.stats());
        prop_assert_eq!(a.d.poll_timeout(), b.d.poll_timeout());
        prop_assert_eq!(a.outstanding, b.outstanding);
    }

    #[test]
    fn a_pass_over_a_settled_state_emits_nothing(trace in proptest::collection::vec(step(), 0..120)) {
        let mut w = run(&trace);
        w.settle();
        prop_assert!(w.d.is_converged());
        let plan = w.d.plan(t(w.now));
        prop_assert!(plan.actions.is_empty(), "{:?}", plan.actions);
        prop_assert_eq!(plan.requeue_at, None);
        // Waking it anyway changes nothing and dispatches nothing.
        let before = w.d.state().clone();
        let _ = w.d.handle_timeout(t(w.now + 1_000_000)).unwrap();
        w.d.handle_tick(t(w.now + 1_000_000));
        w.pump();
        prop_assert!(w.outstanding.is_empty());
        prop_assert_eq!(w.d.state(), &before);
    }

    #[test]
    fn results_of_superseded_attempts_never_change_state(trace in proptest::collection::vec(step(), 0..120)) {
        let mut w = run(&trace);
        let stale: Vec<OperationResult> = w
            .answered
            .iter()
            .filter(|r| w.d.state().nodes.get(&r.node).is_none_or(|n| n.attempt != r.op.attempt))
            .cloned()
            .collect();
        for r in stale {
            let before = w.d.state().clone();
            let folded = w.d.handle_result(r, t(w.now)).unwrap();
            prop_assert!(matches!(folded, Folded::Discarded(_)));
            prop_assert_eq!(w.d.state(), &before);
        }
    }

    #[test]
    fn a_convergence_check_from_any_node_answers_as_the_full_one(
        trace in proptest::collection::vec(step(), 0..160),
        settle in any::<bool>(),
    ) {
        let mut w = run(&trace);
        if settle {
            w.settle();
        }
        let converged = w.d.is_converged();
        let mut hints: Vec<Option<LogicalNodeId>> = vec![None];
        hints.extend(w.d.state().nodes.keys().map(|k| Some(*k)));
        // A slot with no node, and one past every slot.
        hints.push(Some(LogicalNodeId::parse("w-77").unwrap()));
        hints.push(Some(LogicalNodeId::parse("zz-0").unwrap()));
        for hint in &hints {
            match w.d.unconverged_from(hint.as_ref()) {
                Ok(()) => prop_assert!(converged, "from {:?}: converged, but the full check says no", hint),
                Err(None) => {
                    prop_assert!(!converged);
                    prop_assert_ne!(w.d.state().nodes.len() as u64, w.d.desired().node_count());
                }
                Err(Some(node)) => {
                    prop_assert!(!converged, "from {:?}: {} named, but the full check says yes", hint, node);
                    let n = &w.d.state().nodes[&node];
                    let fine = w.d.desired().slot(&node).is_some_and(|t| same_template(t, &n.template))
                        && n.is_ready()
                        && n.pending.is_none();
                    prop_assert!(!fine, "from {:?}: {} named, but it is converged", hint, node);
                }
            }
        }
    }

    #[test]
    fn attempt_ids_are_never_reused(trace in proptest::collection::vec(step(), 0..160)) {
        // Record (slot, attempt) pairs: an attempt id belongs to one slot, and a
        // slot's attempts only ever grow.
        let mut w = World::new();
        let mut owner = std::collections::BTreeMap::<NodeAttemptId, LogicalNodeId>::new();
        let mut last = std::collections::BTreeMap::<LogicalNodeId, NodeAttemptId>::new();
        for s in &trace {
            w.apply(s);
            for (id, n) in &w.d.state().nodes {
                if let Some(prev) = owner.insert(n.attempt, *id) {
                    prop_assert_eq!(&prev, id, "attempt {} moved slots", n.attempt);
                }
                if let Some(prev) = last.insert(*id, n.attempt) {
                    prop_assert!(prev <= n.attempt, "{} went back from {} to {}", id, prev, n.attempt);
                }
            }
        }
    }
}
