//! The measurements of the `scale` benchmark, shared with the test that runs
//! it at a tiny size (`actors/tests/it/scale.rs`).
//!
//! Every figure comes from one cold run per size: a fresh cluster (real
//! driver actor, executor workers and bootstrap observers) on a fresh
//! current-thread runtime with paused time, over the zero-latency fake
//! provider, converging one group of N nodes from nothing. Heap figures come
//! from the counting allocator the including binary installs
//! (`allocation-counter`): it counts the allocations of the one thread that
//! runs everything.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use swactor_actors::{Cluster, ClusterConfig, ShutdownMode};
use swactor_engine::Clock;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_providers::{BootstrapEvents, Provider};
use swactor_provisioning::{
    BootParams, BootstrapEvent, BootstrapStage, ClusterShape, Generation, GroupShape,
    LogicalNodeId, NodeAttemptId, NodeTemplate, ProviderShape, ResourceKey, RunId, SwarmJoin,
    Timestamp, reconcile,
};

/// What one cold run of N nodes measured.
#[derive(Clone, Debug)]
pub(crate) struct Figures {
    /// Nodes converged.
    pub(crate) nodes: u32,
    /// From starting the cluster to the convergence reply (wall clock).
    pub(crate) converge: Duration,
    /// Processor time the process spent over the same span (user and
    /// system): the figure to read on a machine busy with other work.
    pub(crate) converge_cpu: Duration,
    /// Processor time the runtime's own thread spent over the same span
    /// (it runs the actors, the host and the fake provider; helper threads
    /// such as the flight recorder's writer are left out).
    pub(crate) converge_thread_cpu: Duration,
    /// Messages the driver actor's mailbox took (a batch of results or of
    /// observations is one message).
    pub(crate) messages: u64,
    /// Passes the driver ran.
    pub(crate) passes: u64,
    /// Peak resident set of the process so far (VmHWM).
    pub(crate) peak_rss: u64,
    /// Growth of the resident set across the run, at convergence.
    pub(crate) rss_growth: u64,
    /// Heap held at convergence by everything the run made (cluster and provider).
    pub(crate) heap: u64,
    /// Heap held by a copy of the converged `ClusterState`.
    pub(crate) state: u64,
    /// Heap held by the fake provider alone, driven through N ladders directly.
    pub(crate) provider: u64,
    /// One full `reconcile` walk of the converged state (best of several).
    pub(crate) walk: Duration,
}

impl Figures {
    /// `bytes` per node.
    pub(crate) fn per_node(&self, bytes: u64) -> f64 {
        bytes as f64 / f64::from(self.nodes.max(1))
    }

    /// Heap of the actors, the host and the driver besides its state: what
    /// the run held minus the state and the provider.
    pub(crate) fn actors(&self) -> u64 {
        self.heap.saturating_sub(self.state + self.provider)
    }

    /// The table row of this run.
    pub(crate) fn row(&self) -> String {
        let n = self.nodes;
        format!(
            "| {n} | {:.3} s | {:.3} s | {:.4} | {} | {:.0} MB | {:.0} B | {:.0} B | {:.0} B | {:.0} B | {:.0} B | {:.1} ns |",
            self.converge.as_secs_f64(),
            self.converge_cpu.as_secs_f64(),
            self.messages as f64 / f64::from(n.max(1)),
            self.passes,
            self.peak_rss as f64 / 1e6,
            self.per_node(self.rss_growth),
            self.per_node(self.heap),
            self.per_node(self.state),
            self.per_node(self.actors()),
            self.per_node(self.provider),
            self.walk.as_nanos() as f64 / f64::from(n.max(1)),
        )
    }
}

/// The header of [`Figures::row`].
pub(crate) const HEADER: &str = "| nodes | cold converge | CPU time | driver msgs/node | passes | peak RSS | RSS/node | heap/node | ClusterState/node | actors+host+driver/node | fake provider/node | full walk/node |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

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

/// A `/proc/self/status` field in bytes (0 where there is no procfs).
pub(crate) fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    kb * 1024
}

/// Processor time (user and system) this process has used, from
/// `/proc/self/stat` (zero where there is no procfs). Clock ticks are taken
/// to be the usual 100 per second.
/// Processor time this thread has run, from the scheduler's statistics
/// (nanoseconds, unlike the 10 ms ticks of `/proc/self/stat`).
pub(crate) fn thread_cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = stat
        .split_whitespace()
        .next()
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

pub(crate) fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime")
}

/// Heap (bytes) that `f` allocates and still holds when it returns, and what it returned.
fn held<T>(f: impl FnOnce() -> T) -> (u64, T) {
    let mut out = None;
    let info = allocation_counter::measure(|| out = Some(f()));
    let out = out.expect("the closure ran");
    (u64::try_from(info.bytes_current).unwrap_or(0), out)
}

/// Converges `n` nodes cold through the actors and measures everything.
///
/// With `flight`, the driver records its host's inputs into `flight`'s
/// directory, as a daemon does (see `swactor_engine::flight`).
pub(crate) fn measure(n: u32, flight: Option<&swactor_actors::FlightRecorder>) -> Figures {
    let rt = runtime();
    let rss_before = status_bytes("VmRSS:");
    let start = Instant::now();
    let cpu_start = cpu_time();
    let thread_start = thread_cpu_time();
    let (heap, (cluster, converge)) = held(|| {
        rt.block_on(async {
            let provider = FakeProvider::new(FakeConfig::default(), Clock::new());
            let mut config = ClusterConfig::new(RunId::new("bench"));
            config.stream_joins = true;
            config.node_events = false;
            config.executors = 8;
            config.flight = flight.cloned();
            let cluster = Cluster::start(config, Arc::new(provider))
                .await
                .expect("the cluster starts");
            cluster
                .apply(shape(n))
                .await
                .expect("the shape is accepted");
            cluster.converged().await.expect("the cluster converges");
            (cluster, start.elapsed())
        })
    });
    let converge_cpu = cpu_time().saturating_sub(cpu_start);
    let converge_thread_cpu = thread_cpu_time().saturating_sub(thread_start);
    let rss_growth = status_bytes("VmRSS:").saturating_sub(rss_before);
    let peak_rss = status_bytes("VmHWM:");
    let view = rt.block_on(cluster.inspect()).expect("the cluster answers");
    assert_eq!(view.state.nodes.len(), n as usize);
    let (state, copy) = held(|| view.state.clone());
    drop(copy);
    let now = Timestamp::from_millis(view.now.as_millis() + 1);
    let walk = (0..5)
        .map(|_| {
            let t = Instant::now();
            let plan = reconcile(&view.state, &view.desired, now);
            let took = t.elapsed();
            assert!(plan.actions.is_empty(), "a converged cluster plans nothing");
            took
        })
        .min()
        .unwrap_or_default();
    let (stats, messages) = (view.stats, view.messages);
    drop(view);
    rt.block_on(cluster.shutdown(ShutdownMode::Teardown))
        .expect("the cluster shuts down");
    drop(cluster);
    drop(rt);
    let (provider, alone) = held(|| provider_alone(n));
    drop(alone);
    Figures {
        nodes: n,
        converge,
        converge_cpu,
        converge_thread_cpu,
        messages,
        passes: stats.passes,
        peak_rss,
        rss_growth,
        heap,
        state,
        provider,
        walk,
    }
}

/// What [`provider_alone`] keeps alive: the provider, the open streams its
/// sessions feed (as a cluster's observers hold them), and their runtime.
type Alone = (FakeProvider, Vec<BootstrapEvents>, tokio::runtime::Runtime);

/// Drives a fake provider through `n` ladders directly (lease, endpoint,
/// bootstrap, every scripted observation read up to convergence) and
/// returns it with the open streams, so its heap is what the provider holds
/// for `n` converged nodes.
fn provider_alone(n: u32) -> Alone {
    let rt = runtime();
    let (provider, streams) = rt.block_on(async {
        let p = FakeProvider::new(FakeConfig::default(), Clock::new());
        let template = NodeTemplate {
            provider: ProviderShape {
                kind: "fake".into(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: BootParams::default(),
            role: "worker".into(),
            join: SwarmJoin::default(),
            limits: Default::default(),
        };
        let mut streams = Vec::new();
        for i in 0..n {
            let key = ResourceKey {
                run_id: RunId::new("bench"),
                node: LogicalNodeId::parse(&format!("w-{i}")).expect("a node id"),
                attempt: NodeAttemptId(u64::from(i) + 1),
            };
            let grant = p.create_lease(&key, &template).await.expect("a lease");
            let endpoint = match grant.endpoint {
                Some(e) => e,
                None => p
                    .lookup_endpoint(&key, &grant.lease)
                    .await
                    .expect("an endpoint"),
            };
            let s = p
                .start_bootstrap(&key, &grant.lease, &endpoint, &template)
                .await
                .expect("a session");
            streams.push(s.events);
        }
        let converged = BootstrapEvent::Stage(BootstrapStage::Converged);
        for events in &mut streams {
            while let Some(event) = events.recv().await {
                if event == converged {
                    break;
                }
            }
        }
        (p, streams)
    });
    (provider, streams, rt)
}
