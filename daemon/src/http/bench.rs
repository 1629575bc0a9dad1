//! The views' benchmark: what one `/metrics` scrape, one `status` and one
//! dashboard overview cost at 1k, 10k and 100k nodes.
//!
//! ```sh
//! cargo test -p swactor-daemon --release --lib scrape_bench -- --ignored --nocapture
//! SWACTOR_BENCH_NODES="1000 100000" cargo test ...   # other sizes
//! ```
//!
//! Each size is a fresh cluster through the real actors (supervisor,
//! driver, executors, observers) over the zero-latency fake provider, with
//! the daemon's telemetry publisher and the web surface's event follower
//! running, converged from nothing; then the views are read through the
//! same functions the routes call.

// A benchmark reads the clock to measure.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use super::{State, Web};
use crate::control::ControlHandler;
use crate::metrics::{Metered, Metrics};
use crate::protocol::{ControlRequest, ControlResponse};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use swactor_actors::glance::STAGES;
use swactor_actors::{
    Cluster, ClusterConfig, ClusterEvent, ClusterGlance, ClusterSnapshot, GroupCounts, GroupGlance,
    MemoryJournal, SupervisorArgs,
};
use swactor_engine::telemetry::{TelemetryConfig, TelemetryPublisher};
use swactor_engine::{Clock, RestartPolicy};
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_providers::{Provider, Providers};
use swactor_provisioning::{
    BootParams, ClusterShape, Generation, GroupId, GroupShape, ProviderShape, RunId, SwarmJoin,
};

/// Two groups: nine tenths workers, one tenth "gpu".
fn shape(n: u32) -> ClusterShape {
    let group = |id: &str, count: u32| GroupShape {
        id: id.into(),
        run_id: None,
        count,
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
    };
    let gpus = n / 10;
    ClusterShape {
        run_id: RunId::new("bench"),
        generation: Generation(1),
        groups: vec![group("gpu", gpus), group("worker", n - gpus)],
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

/// The shape at `generation`, every node of a new template from the
/// first's: a rollout that may take every node down at once.
fn rollout(n: u32, generation: u64) -> ClusterShape {
    let mut shape = shape(n);
    shape.generation = Generation(generation);
    for g in &mut shape.groups {
        g.boot.image = Some(format!("image-{generation}"));
        g.policy.max_unavailable = Some(swactor_provisioning::Quantity::Percent(100));
    }
    shape
}

/// Scrapes with `scrape` every 20 ms while the cluster rolls every node
/// over to generation `generation`: the median and the slowest scrape, and
/// how long the rollout took.
async fn during_rollout<F: std::future::Future<Output = String>>(
    web: &Web,
    n: u32,
    generation: u64,
    mut scrape: impl FnMut() -> F,
) -> (Duration, Duration, Duration) {
    let cluster = web.control.cluster.clone();
    let started = Instant::now();
    cluster
        .apply(rollout(n, generation))
        .await
        .expect("the shape is accepted");
    let done = cluster.converged();
    tokio::pin!(done);
    let mut took = Vec::new();
    loop {
        let t = Instant::now();
        let text = scrape().await;
        took.push(t.elapsed());
        assert!(text.contains("swactor_ready_nodes"));
        tokio::select! {
            g = &mut done => {
                g.expect("the rollout converges");
                break;
            }
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    let rolled = started.elapsed();
    took.sort();
    (took[took.len() / 2], took[took.len() - 1], rolled)
}

/// A converged cluster of `n` nodes and the web surface over it.
async fn converged(n: u32, dir: &std::path::Path) -> (Arc<Web>, Duration) {
    let run = RunId::new("bench");
    let metrics = Metrics::new();
    let fake: Arc<dyn Provider> = Arc::new(FakeProvider::new(FakeConfig::default(), Clock::new()));
    let providers = Arc::new(Providers::new(vec![fake]));
    let telemetry_config = TelemetryConfig {
        frame_len_max: crate::protocol::FRAME_LEN_MAX,
        ..TelemetryConfig::default()
    };
    let publisher = Arc::new(
        TelemetryPublisher::<ClusterSnapshot, ClusterEvent>::new(
            telemetry_config,
            &ClusterSnapshot::empty("bench"),
        )
        .expect("a publisher"),
    );
    let telemetry = publisher.handler();
    let mut config = ClusterConfig::new(run.clone());
    config.stream_joins = true;
    config.executors = 8;
    let args = SupervisorArgs {
        config,
        provider: Metered::wrap(providers.clone(), metrics.clone()),
        publisher: Some(publisher),
        journal: Arc::new(MemoryJournal::new(run.clone())),
        restarts: RestartPolicy {
            restarts_max: 0,
            window: Duration::from_secs(60),
        },
        on_exit: None,
    };
    let cluster = Cluster::supervised(args, None)
        .await
        .expect("the cluster starts");
    let jobs = crate::jobs::service::JobService::open(
        dir,
        cluster.clone(),
        [7; 32],
        crate::jobs::service::JobLimits::from_env().expect("the job limits"),
    )
    .await
    .expect("the jobs service");
    let (down, _down_rx) = tokio::sync::mpsc::channel(1);
    let (_started_tx, started) = tokio::sync::watch::channel(true);
    let control = ControlHandler {
        cluster: cluster.clone(),
        run_id: run,
        down,
        started,
        provider: providers,
        vast: None,
        jobs,
        journal: crate::journal::JournalHealth::default(),
        metrics: metrics.clone(),
        more_providers: Vec::new(),
        renewals: crate::renewals::Renewals::default(),
        ha: crate::replicas::HaView::default(),
    };
    let web = Arc::new(Web {
        control,
        telemetry,
        metrics,
        token: "bench".to_owned(),
        state_dir: dir.to_owned(),
        addr: "127.0.0.1:1".parse().expect("an address"),
    });
    // The metrics follow the events, as the served surface does.
    let _follow = tokio::spawn(super::follow(web.clone()));
    let started = Instant::now();
    cluster
        .apply(shape(n))
        .await
        .expect("the shape is accepted");
    cluster.converged().await.expect("the cluster converges");
    (web, started.elapsed())
}

/// What `/metrics` did before the glance, reproduced: the whole status
/// (every node summarised by the driver, then decorated), a copy of the
/// driver's whole state for the desired counts (`inspect`), and a count over
/// every node, its group and stage labels made per node, as the old
/// collector did; then the same encoding.
async fn old_scrape(web: &Web) -> String {
    let ControlResponse::Status(snap) = web.control.answer(ControlRequest::Status).await else {
        panic!("no status");
    };
    let view = web.control.cluster.inspect().await.expect("a view");
    let mut by_stage: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut ready: BTreeMap<String, u64> = BTreeMap::new();
    for n in &snap.nodes {
        let group = group_of(&n.node);
        *by_stage
            .entry((group.clone(), crate::metrics::stage_label(n.stage)))
            .or_default() += 1;
        *ready.entry(group).or_default() += u64::from(n.ready);
    }
    let mut groups: BTreeMap<String, GroupGlance> = BTreeMap::new();
    for ((g, stage), n) in by_stage {
        let at = STAGES
            .iter()
            .position(|s| crate::metrics::stage_label(*s) == stage)
            .expect("a stage");
        groups
            .entry(g.clone())
            .or_insert_with(|| GroupGlance {
                id: GroupId::new(&g),
                desired: None,
                counts: GroupCounts::default(),
            })
            .counts
            .stages[at] = n;
    }
    for (g, n) in ready {
        if let Some(e) = groups.get_mut(&g) {
            e.counts.ready = n;
        }
    }
    for d in &view.desired.groups {
        groups
            .entry(d.id.to_string())
            .or_insert_with(|| GroupGlance {
                id: d.id,
                desired: None,
                counts: GroupCounts::default(),
            })
            .desired = Some(d.count);
    }
    let glance = ClusterGlance {
        run_id: snap.run_id.clone(),
        generation: snap.generation,
        converged: snap.converged,
        inventory_read: snap.inventory_read,
        desired_nodes: snap.desired_nodes,
        groups: groups.into_values().collect(),
        orphans: snap.orphans,
        shutting_down: snap.shutting_down,
        stats: snap.stats,
        now: snap.now,
        budget: snap.budget,
        spend: snap.spend,
        lifetime: snap.lifetime,
        paused: snap.paused,
        holds: snap.holds.clone(),
        in_flight: snap.in_flight,
        // Counted from the events before; the same figures either way.
        replacements: web
            .control
            .cluster
            .glance()
            .await
            .expect("a glance")
            .replacements,
    };
    web.metrics.encode(crate::metrics::Scraped {
        glance,
        rentals: snap.rentals,
        spend: snap.spend,
        ha: snap.ha,
        subscribers: web.telemetry.subscriber_count(),
        priced: Vec::new(),
        convergence: None,
    })
}

/// A node's group as the old views named it, one string per node.
fn group_of(node: &swactor_provisioning::LogicalNodeId) -> String {
    node.group.as_str().to_owned()
}

/// `/api/status` as it was made before: the status, `inspect` for the
/// desired counts, each group's ready nodes counted over every node, and a
/// tree of JSON values written out.
async fn old_overview(web: &Web) -> (serde_json::Value, Vec<u8>) {
    let ControlResponse::Status(snap) = web.control.answer(ControlRequest::Status).await else {
        panic!("no status");
    };
    let view = web.control.cluster.inspect().await.expect("a view");
    let groups: Vec<serde_json::Value> = view
        .desired
        .groups
        .iter()
        .map(|g| {
            let id = g.id.to_string();
            let ready = snap
                .nodes
                .iter()
                .filter(|n| n.ready && group_of(&n.node) == id)
                .count();
            serde_json::json!({ "id": id, "desired": g.count, "ready": ready })
        })
        .collect();
    let overview = serde_json::json!({ "status": snap, "groups": groups });
    let bytes = serde_json::to_vec(&overview).expect("JSON");
    (overview["groups"].clone(), bytes)
}

/// The median of `runs` timings of `f` (after one unmeasured run), and its
/// last output. Each run comes 50 ms after the last, as scrapes come to a
/// cluster at rest: the driver has finished the step a request leaves it
/// (a glance asked back to back would find it busy with that step, and
/// take the glance it left).
async fn time<T, F: std::future::Future<Output = T>>(
    runs: usize,
    mut f: impl FnMut() -> F,
) -> (Duration, T) {
    let mut out = f().await;
    let mut took = Vec::with_capacity(runs);
    for _ in 0..runs {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        out = f().await;
        took.push(t.elapsed());
    }
    took.sort();
    (took[took.len() / 2], out)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

async fn body(resp: axum::response::Response) -> String {
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("a body");
    String::from_utf8(bytes.to_vec()).expect("text")
}

/// An exposition without the figures that move between two scrapes of a
/// cluster at rest (the allocator's, and the pass timings of the
/// safety-net tick).
fn steady(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| {
            !l.starts_with("swactor_allocator_")
                && !l.starts_with("swactor_pass_duration_seconds")
                && !l.starts_with("swactor_passes_total")
        })
        .collect()
}

#[test]
#[ignore = "a benchmark: run it with --release --ignored --nocapture"]
fn scrape_bench() {
    let sizes: Vec<u32> = std::env::var("SWACTOR_BENCH_NODES")
        .ok()
        .map(|s| {
            s.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_else(|| vec![1_000, 10_000, 100_000]);
    println!(
        "| nodes | converge | /metrics before | /metrics after | glance alone | status | \
         /api/status before | /api/status after |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut rollouts = Vec::new();
    for n in sizes {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let dir = tempfile::tempdir().expect("a directory");
        rt.block_on(async {
            let (web, converge) = converged(n, dir.path()).await;
            let runs = if n >= 100_000 { 7 } else { 15 };
            let (before, old_text) = time(runs, || old_scrape(&web)).await;
            let (after, text) = time(runs, || async {
                body(super::scrape(State(web.clone())).await).await
            })
            .await;
            // Both ways say the same, every metric, label and value.
            let mut same = steady(&old_text) == steady(&text);
            for _ in 0..5 {
                if same {
                    break;
                }
                let old_text = old_scrape(&web).await;
                let text = body(super::scrape(State(web.clone())).await).await;
                same = steady(&old_text) == steady(&text);
            }
            assert!(same, "before:\n{old_text}\nafter:\n{text}");
            assert!(
                text.contains(&format!("swactor_ready_nodes {n}\n")),
                "{text}"
            );
            let (glance, _) = time(runs, || web.control.cluster.glance()).await;
            let (status, _) = time(runs, || async {
                match web.control.answer(ControlRequest::Status).await {
                    ControlResponse::Status(s) => s.nodes.len(),
                    _ => 0,
                }
            })
            .await;
            let (overview_before, (old, _)) = time(runs, || old_overview(&web)).await;
            let (overview_after, new) = time(runs, || async {
                body(super::api_status(State(web.clone())).await).await
            })
            .await;
            let new: serde_json::Value = serde_json::from_str(&new).expect("JSON");
            assert_eq!(old, new["groups"]);
            println!(
                "| {n} | {:.2} s | {} | {} | {} | {} | {} | {} |",
                converge.as_secs_f64(),
                ms(before),
                ms(after),
                ms(glance),
                ms(status),
                ms(overview_before),
                ms(overview_after),
            );
            // Under load: while every node is replaced at once, first
            // scraped the new way, then (another rollout) the old way.
            let after = during_rollout(&web, n, 2, || async {
                body(super::scrape(State(web.clone())).await).await
            })
            .await;
            let before = during_rollout(&web, n, 3, || old_scrape(&web)).await;
            rollouts.push((n, before, after));
        });
    }
    println!();
    println!(
        "| nodes | rollout, scraped before | /metrics before: median, slowest | \
         rollout, scraped after | /metrics after: median, slowest |"
    );
    println!("|---|---|---|---|---|");
    for (n, before, after) in rollouts {
        println!(
            "| {n} | {:.2} s | {}, {} | {:.2} s | {}, {} |",
            before.2.as_secs_f64(),
            ms(before.0),
            ms(before.1),
            after.2.as_secs_f64(),
            ms(after.0),
            ms(after.1),
        );
    }
}
