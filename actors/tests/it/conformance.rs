//! The conformance battery through the real actors: the kit's seeded traces
//! drive a cluster of driver actor, executor workers and observers over the
//! fake provider, under tokio's paused time. The kit's oracle checks its
//! state invariants on a snapshot after every input, and convergence plus
//! leak-freedom at the end of a fair tail.
//!
//! How the kit's inputs map onto actors: shape and invalid updates go through
//! `apply`; provider faults are armed in the fake provider; a lost or
//! ambiguous reply is a provider call whose reply is lost; an aborted pass,
//! a duplicate or a late delivery becomes an executor worker crash (its
//! operations fold as ambiguous); a lost agent is reported to the driver,
//! which replaces the node after its grace period; time passes on the paused
//! clock, and a host pause jumps it. A host crash kills the cluster actor and
//! starts a new one from its (in-memory) journal and the provider's
//! inventory; a shutdown keeps or tears down, and a new cluster follows.
//! `SWACTOR_ACTOR_SEEDS` raises the seed count (default 64 per mode).

// The policy binds the library; this harness bounds runs on the clock.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;
use swactor_actors::{
    Cluster, ClusterConfig, ClusterHandle, DriverArgs, MemoryJournal, ShutdownMode, WorkerMsg,
};
use swactor_conformance::battery::trace_for_seed;
use swactor_conformance::trace::InvalidUpdate;
use swactor_conformance::{
    BackendConfig, FakeBackend, Input, Mode, Oracle, RUN, Snapshot, shape_of,
};
use swactor_engine::Clock;
use swactor_engine::ractor::ActorRef;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_provisioning::{EffectKind, ReconcilerConfig, RunId};

fn seeds() -> u64 {
    std::env::var("SWACTOR_ACTOR_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}

/// Lets every runnable actor make progress without moving the paused clock.
async fn settle() {
    for _ in 0..256 {
        tokio::task::yield_now().await;
    }
}

/// A consistent view: the provider's model is cloned, then the driver is
/// asked, with no await in between, so the driver's answer reflects exactly
/// the results produced before the clone.
async fn snapshot(cluster: &ClusterHandle, provider: &FakeProvider) -> (Snapshot, FakeBackend) {
    let backend = provider.inspect(FakeBackend::clone);
    let view = cluster.inspect().await.expect("the cluster is running");
    let snap = Snapshot {
        now: view.now,
        state: view.state,
        desired: view.desired,
        timer: view.timer,
        converged_claim: view.converged,
        stats: view.stats,
        // The driver's work queue is inside the actor; skip those checks.
        pass_queued: None,
        host_settled: view.settled,
        agents_away: view.agents_away,
        shutting_down: false,
        paused: false,
        away: Default::default(),
        held_lost: Default::default(),
        deaf: view.deaf,
    };
    (snap, backend)
}

fn crash_a_worker(cluster: &ClusterHandle, pick: usize) {
    let workers: Vec<_> = cluster
        .actor()
        .get_children()
        .into_iter()
        .filter(|c| c.is_message_type_of::<WorkerMsg>() == Some(true))
        .collect();
    if let Some(cell) = workers.get(pick % workers.len().max(1)) {
        let _ = ActorRef::<WorkerMsg>::from(cell.clone()).send_message(WorkerMsg::Crash);
    }
}

/// Starts a cluster actor over `provider`, resuming `journal`.
async fn start(
    config: &ClusterConfig,
    provider: &FakeProvider,
    journal: &MemoryJournal,
) -> Result<ClusterHandle, String> {
    let args = DriverArgs {
        config: config.clone(),
        provider: Arc::new(provider.clone()),
        publisher: None,
        journal: Some(Arc::new(journal.clone())),
        resume: Some(journal.image()),
    };
    Cluster::spawn(args, None).await.map_err(|e| e.to_string())
}

async fn run_seed(mode: Mode, seed: u64) -> Result<(), String> {
    let trace = trace_for_seed(mode, seed);
    let provider = FakeProvider::new(
        FakeConfig {
            backend: BackendConfig::default(),
            seed,
            latency: Duration::from_millis(5 + seed % 20),
            ..FakeConfig::default()
        },
        Clock::new(),
    );
    let reconciler = ReconcilerConfig::default();
    let mut config = ClusterConfig::new(RunId::new(RUN));
    config.reconciler = reconciler.clone();
    config.executors = 3;
    config.node_events = false;
    // Crashes are injected on purpose; the budget is for real bugs.
    config.executor_restarts = swactor_engine::RestartPolicy {
        restarts_max: 10_000,
        window: Duration::from_secs(1),
    };
    config.stream_joins = true;
    config.sweep_interval = Duration::from_secs(10);
    config.visibility_window = Duration::from_secs(10);
    let journal = MemoryJournal::new(RunId::new(RUN));
    let mut cluster = start(&config, &provider, &journal).await?;
    let mut oracle = Oracle::new(reconciler);
    let mut groups = [(0u8, 0u8); 2];
    let mut generation = 0u64;
    let adversarial = mode == Mode::Adversarial;

    for (i, input) in trace.inputs.iter().enumerate() {
        oracle.begin_input(format!("input {i}: {input:?}"));
        match input {
            Input::Shape {
                group,
                count,
                variant,
                skip,
            } => {
                groups[usize::from(*group % 2)] = (*count, *variant);
                generation += 1 + u64::from(*skip);
                cluster
                    .apply(shape_of(generation, &groups))
                    .await
                    .map_err(|e| format!("input {i}: a valid shape was refused: {e}"))?;
            }
            Input::Resubmit => {
                if generation > 0 {
                    cluster
                        .apply(shape_of(generation, &groups))
                        .await
                        .map_err(|e| format!("input {i}: a resubmission was refused: {e}"))?;
                }
            }
            Input::Invalid(kind) => {
                let before = cluster.inspect().await.map_err(|e| e.to_string())?.desired;
                let mut shape = shape_of(generation.max(1), &groups);
                match kind {
                    InvalidUpdate::GenerationRegression if generation > 1 => {
                        shape = shape_of(generation - 1, &groups);
                    }
                    InvalidUpdate::SameGenerationChange => {
                        let mut g = groups;
                        g[0].0 = (g[0].0 + 1) % 4;
                        shape = shape_of(generation, &g);
                    }
                    InvalidUpdate::WrongRun => shape.run_id = RunId::new("elsewhere"),
                    InvalidUpdate::Malformed => shape.groups[0].id = "Alpha".to_owned(),
                    InvalidUpdate::OverCapacity => {
                        let mut g = groups;
                        g[0].0 += 1;
                        shape = shape_of(generation + 1, &g);
                        shape.capacity = Some(shape.node_count() - 1);
                    }
                    InvalidUpdate::GenerationRegression => continue,
                }
                if cluster.apply(shape).await.is_ok() {
                    return Err(format!(
                        "input {i}: an invalid update ({kind:?}) was accepted"
                    ));
                }
                let after = cluster.inspect().await.map_err(|e| e.to_string())?.desired;
                if after != before {
                    return Err(format!(
                        "input {i}: a refused update changed the desired state"
                    ));
                }
            }
            Input::Advance { ms } => {
                tokio::time::sleep(Duration::from_millis(u64::from(*ms))).await
            }
            Input::Step => tokio::time::sleep(Duration::from_millis(200)).await,
            Input::Tick => {}
            // A stop-the-world pause: the clock jumps, then everything due runs at once.
            Input::HostPause { ms } => {
                tokio::time::advance(Duration::from_millis(u64::from(*ms))).await
            }
            // The engine's timers cannot be lost from outside the actor; the
            // safety-net tick is covered by the driver core's own battery.
            Input::LoseTimerOnce => {}
            Input::AgentLost { pick, stale } => {
                let view = cluster.inspect().await.map_err(|e| e.to_string())?;
                let nodes: Vec<_> = view.state.nodes.iter().collect();
                if let Some((node, n)) = nodes.get(usize::from(*pick) % nodes.len().max(1)) {
                    let attempt = if *stale {
                        swactor_provisioning::NodeAttemptId(n.attempt.0.saturating_sub(1))
                    } else {
                        n.attempt
                    };
                    let key = swactor_provisioning::ResourceKey {
                        run_id: RunId::new(RUN),
                        node: **node,
                        attempt,
                    };
                    cluster.agent_gone(key, Duration::ZERO);
                }
            }
            Input::Provider(f) => provider.arm(f.fault()),
            Input::Delivery { kind, fault } => {
                use swactor_conformance::DeliveryFault as D;
                match fault {
                    D::LoseResult | D::AmbiguousWithEffect | D::AmbiguousWithoutEffect => {
                        provider.arm_lost_result(kind.unwrap_or(EffectKind::CreateLease));
                    }
                    _ if adversarial => crash_a_worker(&cluster, i),
                    _ => {}
                }
            }
            Input::AbortNextPass { keep, .. } => crash_a_worker(&cluster, usize::from(*keep)),
            Input::DeleteOutOfBand { pick } => {
                let keys: Vec<_> = provider.inspect(|b| {
                    b.sessions()
                        .values()
                        .filter(|s| s.open)
                        .map(|s| s.key.clone())
                        .collect()
                });
                if let Some(key) = keys.get(usize::from(*pick) % keys.len().max(1)) {
                    provider.delete_out_of_band(key);
                }
            }
            Input::ResubmitOld { .. } => {}
            // Budgets and partitions are judged pass by pass in the host's
            // own battery; through the actor they are left out.
            // So are paused machines (the fake provider never pauses one,
            // and the actors only carry the host's probe to it).
            Input::Budget { .. }
            | Input::MassAgentLoss { .. }
            | Input::AgentsReturn
            | Input::Preempt { .. }
            | Input::PreemptPolicy { .. } => {}
            // Pausing through the actor; the oracle here checks states (its
            // pass-by-pass pause checks run in the host's own battery).
            Input::Pause => {
                cluster
                    .pause()
                    .await
                    .map_err(|e| format!("input {i}: pause refused: {e}"))?;
            }
            Input::Resume => {
                cluster
                    .resume()
                    .await
                    .map_err(|e| format!("input {i}: resume refused: {e}"))?;
            }
            Input::HostCrash { down_ms, .. } => {
                // `kill -9`: the actor and its children die mid-whatever.
                cluster.actor().kill();
                settle().await;
                tokio::time::sleep(Duration::from_millis(u64::from(*down_ms))).await;
                cluster = start(&config, &provider, &journal).await?;
                match journal.image().meta.shape {
                    // The world's next shape continues from what survived.
                    Some(shape) => {
                        generation = generation.max(shape.generation.0);
                        groups = swactor_conformance::groups_of(&shape);
                    }
                    None if generation > 0 => {
                        let _ = cluster.apply(shape_of(generation, &groups)).await;
                    }
                    None => {}
                }
            }
            Input::Shutdown { keep } => {
                let mode = if *keep {
                    ShutdownMode::Keep
                } else {
                    ShutdownMode::Teardown
                };
                let report =
                    tokio::time::timeout(Duration::from_secs(3600), cluster.shutdown(mode)).await;
                if !*keep && report.is_ok() {
                    let left: Vec<String> = provider
                        .inspect(|b| b.live_resources().map(|(k, _)| k.to_string()).collect());
                    if !left.is_empty() {
                        return Err(format!("input {i}: teardown left {left:?}"));
                    }
                }
                cluster = start(&config, &provider, &journal).await?;
                let resumed = journal.image().meta.shape.map_or(0, |s| s.generation.0);
                generation = generation.max(resumed);
                if !*keep && generation > 0 {
                    generation += 1;
                    cluster
                        .apply(shape_of(generation, &groups))
                        .await
                        .map_err(|e| format!("input {i}: up after down refused: {e}"))?;
                }
            }
        }
        settle().await;
        let (snap, backend) = snapshot(&cluster, &provider).await;
        oracle.check(&snap, &backend);
        if !oracle.ok() {
            break;
        }
    }

    // The fair tail: faults stop, the operator resumes; the latest shape must converge.
    provider.heal();
    cluster
        .resume()
        .await
        .map_err(|e| format!("resume refused: {e}"))?;
    if oracle.ok() {
        let bound = Duration::from_secs(6 * 3600);
        if tokio::time::timeout(bound, cluster.converged())
            .await
            .is_err()
        {
            let (snap, _) = snapshot(&cluster, &provider).await;
            return Err(format!(
                "not converged within {bound:?} of virtual time after faults stopped: {:#?}",
                snap.state
            ));
        }
        settle().await;
        let (snap, backend) = snapshot(&cluster, &provider).await;
        oracle.finish(&snap, &backend);
    }
    if let Some(v) = oracle.violations().first() {
        return Err(v.to_string());
    }
    cluster
        .shutdown(ShutdownMode::Teardown)
        .await
        .map_err(|e| e.to_string())?;
    let left: Vec<String> =
        provider.inspect(|b| b.live_resources().map(|(k, _)| k.to_string()).collect());
    if !left.is_empty() {
        return Err(format!("teardown left resources at the provider: {left:?}"));
    }
    Ok(())
}

async fn battery(mode: Mode) {
    let mut failures = Vec::new();
    for seed in 0..seeds() {
        if let Err(e) = run_seed(mode, seed).await {
            failures.push(format!("{} seed {seed}: {e}", mode.name()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} seed(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(start_paused = true)]
async fn the_battery_holds_through_the_real_actors_with_in_order_delivery() {
    battery(Mode::InOrder).await;
}

#[tokio::test(start_paused = true)]
async fn the_battery_holds_through_the_real_actors_with_adversarial_faults() {
    battery(Mode::Adversarial).await;
}
