//! Cold convergence of N nodes through the whole ladder, over a zero-latency fake provider.
//!
//! Each sample starts a cluster on a fresh current-thread runtime with paused
//! time (the fake provider's scripted bootstrap steps then cost no waiting),
//! applies one group of N nodes and waits until the cluster reports
//! convergence. Teardown is not timed. Per-node figures (messages, resident
//! memory) are printed once per size.

// The execution-ownership policy binds this crate's library code. A test or
// benchmark harness owns its runtime and reads the clock to bound and measure runs.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]
// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use swactor_actors::{Cluster, ClusterConfig, ShutdownMode};
use swactor_engine::Clock;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_provisioning::{
    BootParams, ClusterShape, Generation, GroupShape, ProviderShape, RunId, SwarmJoin,
};

fn shape(n: u32) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("bench"),
        generation: Generation(1),
        groups: vec![GroupShape {
            id: "w".into(),
            run_id: None,
            count: n,
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
        }],
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

struct Run {
    elapsed: Duration,
    messages: u64,
    rss_growth: u64,
}

fn converge(n: u32) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let provider = FakeProvider::new(FakeConfig::default(), Clock::new());
        let mut config = ClusterConfig::new(RunId::new("bench"));
        config.stream_joins = true;
        config.node_events = false;
        config.executors = 8;
        let before = rss_bytes();
        let start = Instant::now();
        let cluster = Cluster::start(config, Arc::new(provider)).await.unwrap();
        cluster.apply(shape(n)).await.unwrap();
        cluster.converged().await.unwrap();
        let elapsed = start.elapsed();
        let rss_growth = rss_bytes().saturating_sub(before);
        let stats = cluster.snapshot().await.unwrap().stats;
        cluster.shutdown(ShutdownMode::Teardown).await.unwrap();
        // Messages into the driver: every result and observation folded or
        // discarded, plus one RunPass per pass; out of it: every dispatch.
        let messages = stats.folded + stats.discarded + stats.passes + stats.dispatched;
        Run {
            elapsed,
            messages,
            rss_growth,
        }
    })
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("cold_convergence");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    for n in [10_000u32, 100_000] {
        let probe = converge(n);
        eprintln!(
            "N={n}: {:.3} s, {:.1} driver messages/node, {:.0} bytes RSS/node",
            probe.elapsed.as_secs_f64(),
            probe.messages as f64 / f64::from(n),
            probe.rss_growth as f64 / f64::from(n)
        );
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| (0..iters).map(|_| converge(n).elapsed).sum());
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
