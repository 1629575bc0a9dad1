//! Cost of one reconcile pass over settled and churning clusters.

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::collections::BTreeMap;
use std::hint::black_box;
use swactor_provisioning::*;

fn shape(generation: u64, n: u32) -> ClusterShape {
    // Ten groups, as a real shape would have a handful.
    let groups = (0..10)
        .map(|g| GroupShape {
            id: format!("g{g}"),
            run_id: None,
            count: n / 10,
            provider: ProviderShape {
                kind: "fake".into(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: BootParams::default(),
            role: "worker".into(),
            join: SwarmJoin::default(),
            limits: Default::default(),
            policy: Default::default(),
        })
        .collect();
    ClusterShape {
        run_id: RunId::new("bench"),
        generation: Generation(generation),
        groups,
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

/// A converged cluster of `n` nodes, built by folding a perfect provider's answers.
fn settled(n: u32) -> Driver {
    let mut d = Driver::new(RunId::new("bench"), ReconcilerConfig::default()).unwrap();
    d.update_desired(&shape(1, n)).unwrap();
    let now = Timestamp::from_millis(0);
    loop {
        let mut dispatches = Vec::new();
        while let Some(pass) = d.poll_pass(now).unwrap() {
            dispatches.extend(pass.dispatches);
            d.finish_pass().unwrap();
        }
        if dispatches.is_empty() {
            break;
        }
        for disp in dispatches {
            let k = &disp.key;
            let outcome = match &disp.request {
                EffectRequest::CreateLease { .. } => OperationOutcome::LeaseCreated {
                    lease: LeaseId::from(k.to_string()),
                    endpoint: Some(NodeEndpoint::from(k.to_string())),
                },
                EffectRequest::StartBootstrap { .. } => OperationOutcome::BootstrapStarted {
                    session: SessionId::from(k.to_string()),
                },
                _ => unreachable!("a perfect provider needs nothing else"),
            };
            let r = OperationResult {
                node: k.node,
                op: disp.op,
                outcome,
            };
            let _ = d.handle_result(r, now).unwrap();
            if let EffectRequest::StartBootstrap { .. } = disp.request {
                for event in [
                    BootstrapEvent::SwactorJoined,
                    BootstrapEvent::Stage(BootstrapStage::Converged),
                ] {
                    let o = BootstrapObservation {
                        node: k.node,
                        attempt: k.attempt,
                        session: SessionId::from(k.to_string()),
                        event,
                    };
                    let _ = d.handle_bootstrap(o, now).unwrap();
                }
            }
        }
    }
    assert!(d.is_converged());
    d
}

fn bench_pass(c: &mut Criterion) {
    let mut g = c.benchmark_group("pass");
    for n in [1_000u32, 10_000, 100_000] {
        let d = settled(n);
        let now = Timestamp::from_millis(1);
        g.throughput(Throughput::Elements(u64::from(n)));
        g.bench_with_input(BenchmarkId::new("settled", n), &n, |b, _| {
            b.iter(|| {
                let plan = reconcile(black_box(d.state()), black_box(d.desired()), now);
                assert!(plan.actions.is_empty());
                plan
            });
        });
        // The driver's pass after one fold on a settled cluster: only the
        // dirty node is decided, whatever the cluster's size.
        g.bench_with_input(BenchmarkId::new("driver_one_fold", n), &n, |b, _| {
            b.iter_batched(
                || {
                    let mut d2 = d.clone();
                    let (node, n0) = d2.state().nodes.iter().next().unwrap();
                    let o = BootstrapObservation {
                        node: *node,
                        attempt: n0.attempt,
                        session: n0.record.session.clone().unwrap(),
                        event: BootstrapEvent::Stage(BootstrapStage::Converged),
                    };
                    assert_eq!(d2.handle_bootstrap(o, now).unwrap(), Folded::Applied);
                    d2
                },
                |mut d2| {
                    let pass = d2.poll_pass(now).unwrap().unwrap();
                    assert!(pass.dispatches.is_empty());
                    d2.finish_pass().unwrap();
                    d2
                },
                BatchSize::LargeInput,
            );
        });
        // The same, on a driver that stays warm: fold one observation, run
        // the pass it queues, again and again (the clone above leaves every
        // structure cold in the cache, which dominates at 100k).
        let mut warm = d.clone();
        let (node, n0) = warm.state().nodes.iter().nth(n as usize / 2).unwrap();
        let converged = BootstrapObservation {
            node: *node,
            attempt: n0.attempt,
            session: n0.record.session.clone().unwrap(),
            event: BootstrapEvent::Stage(BootstrapStage::Converged),
        };
        g.bench_with_input(BenchmarkId::new("driver_fold_and_pass", n), &n, |b, _| {
            b.iter(|| {
                let folded = warm.handle_bootstrap(converged.clone(), now).unwrap();
                assert_eq!(folded, Folded::Applied);
                let pass = warm.poll_pass(now).unwrap().unwrap();
                assert!(pass.dispatches.is_empty());
                warm.finish_pass().unwrap();
            });
        });
        // 10 % churn: every tenth node failed, so a pass begins its deletion.
        let mut churn = d.state().clone();
        for (i, node) in churn.nodes.values_mut().enumerate() {
            if i % 10 == 0 {
                node.record.stage = NodeStage::Failed;
                node.record.ready = false;
            }
        }
        g.bench_with_input(BenchmarkId::new("churn10", n), &n, |b, _| {
            b.iter(|| {
                let plan = reconcile(black_box(&churn), black_box(d.desired()), now);
                assert_eq!(plan.actions.len(), n as usize / 10);
                plan
            });
        });
        // The same churn through the driver: fold the failures, then one
        // pass decides, applies and records every BeginDelete.
        g.bench_with_input(BenchmarkId::new("driver_churn10", n), &n, |b, _| {
            b.iter_batched(
                || {
                    let mut d2 = d.clone();
                    let lost: Vec<_> = d2
                        .state()
                        .nodes
                        .iter()
                        .step_by(10)
                        .map(|(id, node)| (*id, node.attempt, node.record.session.clone().unwrap()))
                        .collect();
                    for (node, attempt, session) in lost {
                        let event = BootstrapEvent::Failed {
                            stage: BootstrapStage::AgentLost,
                            reason: "bench".into(),
                        };
                        let o = BootstrapObservation {
                            node,
                            attempt,
                            session,
                            event,
                        };
                        assert_eq!(d2.handle_bootstrap(o, now).unwrap(), Folded::Applied);
                    }
                    d2
                },
                |mut d2| {
                    let pass = d2.poll_pass(now).unwrap().unwrap();
                    assert_eq!(pass.stats.transitions, n as usize / 10);
                    d2.finish_pass().unwrap();
                    d2
                },
                BatchSize::LargeInput,
            );
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench_pass
}
criterion_main!(benches);
