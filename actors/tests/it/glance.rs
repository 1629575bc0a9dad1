//! The glance's counts, kept node by node as events are published, against
//! the same counts taken from a full snapshot of the same instant.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::glance::{CAUSES, STAGES};
use swactor_actors::*;
use swactor_engine::Clock;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_provisioning::*;

fn group(id: &str, count: u32) -> GroupShape {
    GroupShape {
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
    }
}

fn shape(generation: u64, groups: &[(&str, u32)]) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("run"),
        generation: Generation(generation),
        groups: groups.iter().map(|(id, n)| group(id, *n)).collect(),
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

fn config() -> ClusterConfig {
    let mut c = ClusterConfig::new(RunId::new("run"));
    c.stream_joins = true;
    c
}

fn fake() -> FakeProvider {
    let config = FakeConfig {
        latency: Duration::from_millis(30),
        ..FakeConfig::default()
    };
    FakeProvider::new(config, Clock::new())
}

/// Each group's counts as a full snapshot has them.
fn counted(snap: &ClusterSnapshot) -> BTreeMap<GroupId, GroupCounts> {
    let mut groups: BTreeMap<GroupId, GroupCounts> = BTreeMap::new();
    for n in &snap.nodes {
        let g = groups.entry(n.node.group).or_default();
        let at = STAGES.iter().position(|s| *s == n.stage).unwrap();
        g.stages[at] += 1;
        g.ready += u64::from(n.ready);
    }
    groups
}

/// A glance and a snapshot of the same instant: both requests reach the
/// driver one after the other (the test's runtime has one thread, so
/// nothing is sent to it in between), so they must agree exactly.
async fn same_instant(c: &ClusterHandle) -> (ClusterGlance, ClusterSnapshot) {
    let (glance, snap) = tokio::join!(c.glance(), c.snapshot());
    (glance.unwrap(), snap.unwrap())
}

/// Checks every figure the glance shares with the snapshot; returns the glance.
async fn agree(c: &ClusterHandle, when: &str) -> ClusterGlance {
    let (g, s) = same_instant(c).await;
    let from_nodes: BTreeMap<GroupId, GroupCounts> = g
        .groups
        .iter()
        .filter(|g| g.counts.nodes() > 0)
        .map(|g| (g.id, g.counts))
        .collect();
    assert_eq!(from_nodes, counted(&s), "{when}: {s:#?}");
    assert_eq!(g.nodes(), s.nodes.len() as u64, "{when}");
    let ready = s.nodes.iter().filter(|n| n.ready).count() as u64;
    assert_eq!(g.ready(), ready, "{when}");
    assert_eq!(
        (g.generation, g.converged, g.desired_nodes, g.paused),
        (s.generation, s.converged, s.desired_nodes, s.paused),
        "{when}"
    );
    assert_eq!(
        (g.stats, g.in_flight, g.orphans),
        (s.stats, s.in_flight, s.orphans)
    );
    assert_eq!((&g.holds, g.now), (&s.holds, s.now), "{when}");
    let desired: u64 = g
        .groups
        .iter()
        .filter_map(|g| g.desired)
        .map(u64::from)
        .sum();
    assert_eq!(desired, g.desired_nodes, "{when}");
    g
}

/// Checks agreement every few milliseconds of virtual time until the
/// cluster converges, then once more.
async fn agree_until_converged(c: &ClusterHandle, what: &str) -> ClusterGlance {
    let converged = c.converged();
    tokio::pin!(converged);
    for step in 0..10_000 {
        tokio::select! {
            done = &mut converged => {
                done.unwrap();
                return agree(c, &format!("{what}, converged")).await;
            }
            () = tokio::time::sleep(Duration::from_millis(7)) => {
                agree(c, &format!("{what}, step {step}")).await;
            }
        }
    }
    panic!("{what}: no convergence");
}

fn replaced(g: &ClusterGlance, cause: Option<FailureCause>) -> u64 {
    g.replacements[CAUSES.iter().position(|c| *c == cause).unwrap()]
}

fn node(id: &str) -> LogicalNodeId {
    LogicalNodeId::parse(id).unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_glance_counts_what_a_full_snapshot_counts_at_every_step() {
    let c = Cluster::start(config(), Arc::new(fake())).await.unwrap();
    let g = agree(&c, "before any shape").await;
    assert!(g.groups.is_empty(), "{g:?}");

    c.apply(shape(1, &[("w", 6), ("g", 2)])).await.unwrap();
    let g = agree_until_converged(&c, "converge").await;
    let w = g.group(&node("w-0").group).unwrap();
    assert_eq!((w.desired, w.counts.ready), (Some(6), 6));
    // The glance the driver left after its last step, read without a
    // message, says the same of a cluster at rest.
    let left = c.last_glance().expect("a glance left");
    assert_eq!((&left.groups, left.stats), (&g.groups, g.stats));
    assert!(
        ClusterHandle::from_actor(c.actor().clone())
            .last_glance()
            .is_none()
    );
    assert_eq!(w.counts.at(NodeStage::Dormant), 6);
    assert_eq!(g.replacements, [0; CAUSES.len()]);

    // The operator replaces a node: it fails, is cleaned up, and its slot
    // gets a new attempt.
    c.replace(node("w-1")).await.unwrap();
    let g = agree_until_converged(&c, "replace").await;
    assert_eq!(replaced(&g, Some(FailureCause::Operator)), 1);
    assert_eq!(g.ready(), 8);

    // An agent that joined goes away: its node is not ready while its
    // grace runs, then it is lost and replaced.
    let snap = c.snapshot().await.unwrap();
    let w2 = snap.nodes.iter().find(|n| n.node == node("w-2")).unwrap();
    let key = ResourceKey {
        run_id: RunId::new("run"),
        node: w2.node,
        attempt: w2.attempt,
    };
    c.agent_join(key.clone()).await.unwrap().unwrap();
    c.agent_gone(key, Duration::ZERO);
    let g = agree(&c, "agent away").await;
    assert_eq!(g.ready(), 7, "{g:?}");
    let g = agree_until_converged(&c, "agent lost").await;
    assert_eq!(replaced(&g, Some(FailureCause::AgentLost)), 1);
    assert_eq!(g.ready(), 8);

    // Scale down one group and drop the other: the dropped group is
    // counted, undesired, while its nodes leave, then not at all.
    c.apply(shape(2, &[("w", 3)])).await.unwrap();
    let g = agree(&c, "scale-down accepted").await;
    let gpu = g.group(&node("g-0").group).expect("still has nodes");
    assert_eq!((gpu.desired, gpu.counts.nodes()), (None, 2));
    let g = agree_until_converged(&c, "scale down").await;
    assert_eq!(g.nodes(), 3);
    assert!(g.group(&node("g-0").group).is_none(), "{g:?}");
    // A scale-down replaces nothing.
    assert_eq!(g.replacements.iter().sum::<u64>(), 2);

    // A new template replaces every node of its group, as a shape change.
    let mut image = shape(3, &[("w", 3)]);
    image.groups[0].boot.image = Some("other".into());
    c.apply(image).await.unwrap();
    let g = agree_until_converged(&c, "new template").await;
    assert_eq!(replaced(&g, None), 3);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn without_per_node_events_the_glance_counts_by_a_walk() {
    let mut config = config();
    config.node_events = false;
    let c = Cluster::start(config, Arc::new(fake())).await.unwrap();
    c.apply(shape(1, &[("w", 5)])).await.unwrap();
    let g = agree_until_converged(&c, "converge, no node events").await;
    assert_eq!(g.ready(), 5);
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}

/// A cluster actor restarted by its supervisor adopts what runs: its glance
/// counts every adopted node, and the replacements counted before the
/// restart stay.
#[cfg(debug_assertions)]
#[tokio::test(start_paused = true)]
async fn a_restarted_driver_counts_what_it_adopts_and_keeps_the_replacements() {
    let args = SupervisorArgs {
        config: config(),
        provider: Arc::new(fake()),
        publisher: None,
        journal: Arc::new(MemoryJournal::new(RunId::new("run"))),
        restarts: Default::default(),
        on_exit: None,
    };
    let c = Cluster::supervised(args, None).await.unwrap();
    c.apply(shape(1, &[("w", 4)])).await.unwrap();
    c.converged().await.unwrap();
    c.replace(node("w-3")).await.unwrap();
    c.converged().await.unwrap();
    let before = c.glance().await.unwrap();
    assert_eq!((before.ready(), before.replacements[1]), (4, 1));

    c.actor().send_message(DriverMsg::InjectPanic).unwrap();
    // The new driver answers once it runs; it has adopted everything once
    // it converges again.
    let mut after = None;
    for _ in 0..1_000 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Ok(g) = c.glance().await
            && g.converged
            && g.inventory_read
        {
            after = Some(g);
            break;
        }
    }
    let after = after.expect("the restarted driver converges");
    let snap = c.snapshot().await.unwrap();
    assert!(snap.stats.passes < before.stats.passes, "a new driver");
    assert_eq!(after.ready(), 4, "{after:?}");
    assert_eq!(after.replacements, before.replacements);
    let left = c.last_glance().expect("a glance left");
    assert_eq!((left.ready(), left.replacements), (4, before.replacements));
    let from_nodes: BTreeMap<GroupId, GroupCounts> =
        after.groups.iter().map(|g| (g.id, g.counts)).collect();
    assert_eq!(from_nodes, counted(&snap));
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
}
