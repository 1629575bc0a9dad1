//! The actor system over the fake provider, under paused time.

// The execution-ownership policy binds this crate's library code. A test or
// benchmark harness owns its runtime and reads the clock to bound and measure runs.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use swactor_actors::*;
use swactor_engine::Clock;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_providers::{BootstrapSession, Inventory, LeaseGrant, Provider, ProviderError};
use swactor_provisioning::*;

fn shape(generation: u64, workers: u32) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("run"),
        generation: Generation(generation),
        groups: vec![GroupShape {
            id: "w".into(),
            run_id: None,
            count: workers,
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

fn config() -> ClusterConfig {
    let mut c = ClusterConfig::new(RunId::new("run"));
    // The fake provider has no swarm: its stream's join report is the join.
    c.stream_joins = true;
    c
}

fn fake(latency_ms: u64) -> FakeProvider {
    FakeProvider::new(
        FakeConfig {
            latency: Duration::from_millis(latency_ms),
            ..FakeConfig::default()
        },
        Clock::new(),
    )
}

/// Live leases and open sessions at the provider.
fn live(p: &FakeProvider) -> (usize, usize) {
    p.inspect(|b| {
        let leases = b.leases().values().filter(|l| l.live).count();
        let sessions = b.sessions().values().filter(|s| s.open).count();
        (leases, sessions)
    })
}

fn leases_created(p: &FakeProvider) -> u64 {
    p.inspect(|b| b.counters().leases_created)
}

/// At most one lease ever made per (run, node, attempt).
fn assert_no_double_create(p: &FakeProvider) {
    p.inspect(|b| {
        for (key, stats) in b.keys() {
            assert!(
                stats.leases_created <= 1,
                "{key} got {} leases",
                stats.leases_created
            );
        }
    });
}

async fn converged(c: &ClusterHandle) -> ClusterSnapshot {
    tokio::time::timeout(Duration::from_secs(3_600), c.converged())
        .await
        .expect("converges within an hour of virtual time")
        .unwrap();
    c.snapshot().await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_cluster_converges_over_the_fake_provider_and_teardown_leaves_it_empty() {
    let p = fake(50);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    assert_eq!(
        c.apply(shape(1, 5)).await.unwrap(),
        DesiredUpdate::Accepted(Generation(1))
    );
    let snap = converged(&c).await;
    assert!(snap.converged);
    assert_eq!(snap.nodes.len(), 5);
    assert!(
        snap.nodes
            .iter()
            .all(|n| n.ready && n.stage == NodeStage::Dormant)
    );
    assert_eq!(live(&p), (5, 5));

    // Scale down removes the highest indexes.
    c.apply(shape(2, 3)).await.unwrap();
    let snap = converged(&c).await;
    let names: Vec<String> = snap.nodes.iter().map(|n| n.node.to_string()).collect();
    assert_eq!(names, ["w-0", "w-1", "w-2"]);
    assert_eq!(live(&p), (3, 3));

    // Whoever follows the events and waits for the teardown's report has
    // every node's removal by the time the report comes (a line-per-node
    // teardown dropped one `removed` about every other time).
    let mut sub = c.subscribe().await.unwrap();
    let report = c.shutdown(ShutdownMode::Teardown).await.unwrap();
    assert_eq!(report.destroyed.len(), 3);
    let mut removed = Vec::new();
    while let Ok(ev) = sub.events.try_recv() {
        if let ClusterEvent::Removed { node } = ev {
            removed.push(node.to_string());
        }
    }
    removed.sort();
    removed.dedup();
    assert_eq!(
        removed,
        ["w-0", "w-1", "w-2"],
        "every removal before the report"
    );
    assert_eq!(live(&p), (0, 0), "teardown leaves nothing at the provider");
    assert_no_double_create(&p);
    assert!(
        c.snapshot().await.is_err(),
        "the cluster is gone after shutdown"
    );
}

/// Applies without a generation, from two callers at once, each get a
/// generation of their own: the cluster picks it as it applies.
#[tokio::test(start_paused = true)]
async fn shapes_applied_as_the_next_generation_at_once_each_get_their_own() {
    let p = fake(50);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    assert_eq!(
        c.apply_next(shape(0, 2)).await.unwrap(),
        DesiredUpdate::Accepted(Generation(1))
    );
    let (a, b) = tokio::join!(c.apply_next(shape(0, 3)), c.apply_next(shape(0, 4)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let (second, third) = (
        DesiredUpdate::Accepted(Generation(2)),
        DesiredUpdate::Accepted(Generation(3)),
    );
    assert!(
        (a == second && b == third) || (a == third && b == second),
        "{a:?} {b:?}"
    );
    // The shape that got the later generation is the current one: the same
    // content again changes nothing.
    let current = if a == third { 3 } else { 4 };
    assert_eq!(
        c.apply_next(shape(0, current)).await.unwrap(),
        DesiredUpdate::Unchanged(Generation(3))
    );
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn bad_shapes_are_refused_and_change_nothing() {
    let p = fake(0);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    c.apply(shape(3, 2)).await.unwrap();
    converged(&c).await;
    let err = c.apply(shape(2, 4)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("older than the current generation"),
        "{err}"
    );
    let err = c.apply(shape(3, 4)).await.unwrap_err();
    assert!(err.to_string().contains("raise the generation"), "{err}");
    let mut other = shape(4, 1);
    other.run_id = RunId::new("elsewhere");
    assert!(c.apply(other).await.is_err());
    let snap = c.snapshot().await.unwrap();
    assert_eq!((snap.generation, snap.nodes.len()), (Generation(3), 2));
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn plan_previews_without_applying() {
    let p = fake(0);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    c.apply(shape(1, 2)).await.unwrap();
    converged(&c).await;
    let plan = c.plan(Some(shape(2, 4))).await.unwrap();
    let lines: Vec<String> = plan
        .actions
        .iter()
        .map(|l| format!("{} {}", l.node, l.action))
        .collect();
    assert_eq!(lines, ["w-2 create slot", "w-3 create slot"]);
    assert_eq!(
        (plan.diff.create, plan.diff.unchanged, plan.diff.destroy),
        (2, 2, 0)
    );
    let mut image = shape(2, 1);
    image.groups[0].boot.image = Some("other".into());
    let diff = c.plan(Some(image)).await.unwrap().diff;
    assert_eq!((diff.create, diff.replace, diff.destroy), (0, 1, 1));
    assert_eq!(c.snapshot().await.unwrap().nodes.len(), 2);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn keep_leaves_resources_that_a_new_cluster_of_the_run_adopts_instead_of_recreating() {
    let p = fake(10);
    let journal = MemoryJournal::new(RunId::new("run"));
    let start = |resume| {
        let args = DriverArgs {
            config: config(),
            provider: Arc::new(p.clone()),
            publisher: None,
            journal: Some(Arc::new(journal.clone())),
            resume: Some(resume),
        };
        Cluster::spawn(args, None)
    };
    let c = start(journal.image()).await.unwrap();
    c.apply(shape(1, 4)).await.unwrap();
    converged(&c).await;
    let before = leases_created(&p);
    let report = c.shutdown(ShutdownMode::Keep).await.unwrap();
    assert_eq!(report.kept.len(), 4);
    assert_eq!(live(&p).0, 4, "keep leaves the nodes running");

    // The journal's shape is resumed; its records say which template each
    // kept node was made from, so none is taken for drifted.
    let c2 = start(journal.image()).await.unwrap();
    let snap = converged(&c2).await;
    assert_eq!(snap.generation, Generation(1));
    assert_eq!(snap.nodes.len(), 4);
    assert_eq!(leases_created(&p), before, "nothing was created again");
    assert_eq!(live(&p).0, 4);
    assert_no_double_create(&p);
    c2.shutdown(ShutdownMode::Teardown).await.unwrap();
    assert_eq!(live(&p), (0, 0));
}

/// Panics in the middle of the first `panics` create calls, after the lease was made.
struct Crashing {
    inner: FakeProvider,
    panics: AtomicUsize,
}

#[swactor_providers::async_trait]
impl Provider for Crashing {
    fn kind(&self) -> &'static str {
        "fake"
    }
    async fn create_lease(
        &self,
        k: &ResourceKey,
        t: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let g = self.inner.create_lease(k, t).await;
        if self
            .panics
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("executor crashes mid-operation (the lease exists, its result is lost)");
        }
        g
    }
    async fn lookup_endpoint(
        &self,
        k: &ResourceKey,
        l: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        self.inner.lookup_endpoint(k, l).await
    }
    async fn start_bootstrap(
        &self,
        k: &ResourceKey,
        l: &LeaseId,
        e: &NodeEndpoint,
        t: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        self.inner.start_bootstrap(k, l, e, t).await
    }
    async fn cancel_bootstrap(
        &self,
        k: &ResourceKey,
        s: &SessionId,
    ) -> Result<Release, ProviderError> {
        self.inner.cancel_bootstrap(k, s).await
    }
    async fn destroy_lease(&self, k: &ResourceKey, l: &LeaseId) -> Result<Release, ProviderError> {
        self.inner.destroy_lease(k, l).await
    }
    async fn list(&self, r: &RunId) -> Result<Inventory, ProviderError> {
        self.inner.list(r).await
    }
}

#[tokio::test(start_paused = true)]
async fn an_executor_that_crashes_mid_operation_is_restarted_and_its_operation_adopted() {
    let p = fake(20);
    let crashing = Crashing {
        inner: p.clone(),
        panics: AtomicUsize::new(2),
    };
    let mut cfg = config();
    cfg.executors = 2;
    let c = Cluster::start(cfg, Arc::new(crashing)).await.unwrap();
    let mut sub = c.subscribe().await.unwrap();
    c.apply(shape(1, 4)).await.unwrap();
    let snap = converged(&c).await;
    assert_eq!(snap.nodes.len(), 4);
    // Both crashed creates were folded as ambiguous, re-issued and adopted:
    // four leases in all, never two for one identity.
    assert_eq!(leases_created(&p), 4);
    assert_no_double_create(&p);
    let mut crashes = 0;
    while let Ok(ev) = sub.events.try_recv() {
        if let ClusterEvent::Warning { message } = ev {
            crashes += usize::from(message.contains("crashed"));
        }
    }
    assert_eq!(crashes, 2);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
    assert_eq!(live(&p), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_subscriber_that_never_reads_does_not_slow_the_cluster() {
    let p = fake(0);
    let mut cfg = config();
    cfg.event_buffer_len = 16;
    let c = Cluster::start(cfg, Arc::new(p.clone())).await.unwrap();
    let mut idle = c.subscribe().await.unwrap();
    c.apply(shape(1, 50)).await.unwrap();
    let snap = converged(&c).await;
    assert_eq!(snap.nodes.len(), 50);
    // The idle subscriber missed events and is told so; it holds at most its buffer.
    assert!(matches!(
        idle.events.try_recv(),
        Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) if n > 0
    ));
    assert!(idle.events.len() <= 16);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_ten_thousand_results_costs_a_bounded_number_of_passes() {
    let p = fake(0);
    let mut cfg = config();
    cfg.node_events = false;
    let c = Cluster::start(cfg, Arc::new(p.clone())).await.unwrap();
    c.apply(shape(1, 10_000)).await.unwrap();
    let snap = converged(&c).await;
    assert_eq!(snap.nodes.len(), 10_000);
    let passes = snap.stats.passes;
    println!(
        "10,000 nodes converged in {passes} passes ({} folds)",
        snap.stats.folded
    );
    // Each node needs ~5 passes' worth of steps; batching folds each wave of
    // results into one pass, so the count stays far below one pass per result.
    assert!(passes < 500, "{passes} passes");
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
    assert_eq!(live(&p), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn kept_nodes_of_unknown_or_other_templates_are_replaced_not_taken_as_they_are() {
    let p = fake(10);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    c.apply(shape(1, 2)).await.unwrap();
    converged(&c).await;
    let before = leases_created(&p);
    c.shutdown(ShutdownMode::Keep).await.unwrap();
    // No journal: nothing says which template the kept nodes run, so the
    // new cluster adopts them (nothing is leaked) and replaces them.
    let mut cfg = config();
    cfg.initial_shape = Some(shape(1, 2));
    let c2 = Cluster::start(cfg, Arc::new(p.clone())).await.unwrap();
    converged(&c2).await;
    assert_eq!(
        leases_created(&p),
        before + 2,
        "each kept node replaced once"
    );
    assert_eq!(live(&p).0, 2);
    assert_no_double_create(&p);
    c2.shutdown(ShutdownMode::Teardown).await.unwrap();
    assert_eq!(live(&p), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_shape_past_the_capacity_is_refused_unless_it_names_its_own() {
    let p = fake(0);
    let mut cfg = config();
    cfg.capacities = vec![
        Capacity {
            kind: "fake".into(),
            nodes: 3,
            basis: "the test's limit".into(),
        },
        // Another kind's limit does not count against groups of this one.
        Capacity {
            kind: "elsewhere".into(),
            nodes: 0,
            basis: "another provider's limit".into(),
        },
    ];
    let c = Cluster::start(cfg, Arc::new(p.clone())).await.unwrap();
    let err = c.apply(shape(1, 4)).await.unwrap_err().to_string();
    assert!(
        err.contains("asks for 4 nodes") && err.contains("the test's limit allows at most 3"),
        "{err}"
    );
    assert!(
        c.plan(Some(shape(1, 4))).await.is_err(),
        "plan refuses it too"
    );
    assert_eq!(c.snapshot().await.unwrap().desired_nodes, 0);

    let mut own = shape(1, 4);
    own.capacity = Some(4);
    c.apply(own).await.unwrap();
    converged(&c).await;
    // Its own lower capacity refuses growth, but shrinking is always allowed.
    let mut grow = shape(2, 5);
    grow.capacity = Some(2);
    assert!(c.apply(grow).await.is_err());
    let mut shrink = shape(2, 3);
    shrink.capacity = Some(2);
    c.apply(shrink).await.unwrap();
    assert_eq!(converged(&c).await.nodes.len(), 3);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn describe_shows_a_node_and_its_last_attempts() {
    let p = fake(10);
    let c = Cluster::start(config(), Arc::new(p.clone())).await.unwrap();
    c.apply(shape(1, 1)).await.unwrap();
    converged(&c).await;
    let w0 = LogicalNodeId::parse("w-0").unwrap();
    let d = c.describe(w0).await.unwrap().expect("w-0 is known");
    assert!(d.desired && d.summary.as_ref().is_some_and(|s| s.ready));
    assert_eq!(d.attempts.len(), 1);
    let first = &d.attempts[0];
    assert!(
        first.ready_at.is_some() && first.ended_at.is_none(),
        "{first:?}"
    );
    assert!(first.started_at <= first.ready_at.unwrap());
    assert!(d.lease.is_some());

    // A new template replaces the node: the first attempt ends, a second starts.
    let mut next = shape(2, 1);
    next.groups[0].boot.image = Some("v2".into());
    c.apply(next).await.unwrap();
    converged(&c).await;
    let d = c.describe(w0).await.unwrap().unwrap();
    assert_eq!(d.attempts.len(), 2, "{:?}", d.attempts);
    assert!(d.attempts[0].ended_at.is_some());
    assert!(d.attempts[0].attempt < d.attempts[1].attempt);
    assert!(d.attempts[1].ready_at.is_some());

    let nobody = LogicalNodeId::parse("w-7").unwrap();
    assert_eq!(c.describe(nobody).await.unwrap(), None);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}
