//! The flight recorder on a real cluster actor: every input its host was
//! given, recorded life by life, replays to the same answers.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::FlightRecorder;
use swactor_actors::*;
use swactor_engine::Clock;
use swactor_engine::flight::FlightLimits;
use swactor_providers::fake::{FakeConfig, FakeProvider};
use swactor_provisioning::flight::{self, Recording};
use swactor_provisioning::*;

fn shape(generation: u64, count: u32, image: Option<&str>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("run"),
        generation: Generation(generation),
        groups: vec![GroupShape {
            id: "w".into(),
            run_id: None,
            count,
            provider: ProviderShape {
                kind: "fake".into(),
                params: BTreeMap::new(),
                placement: Default::default(),
            },
            boot: BootParams {
                image: image.map(Into::into),
                ..BootParams::default()
            },
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

fn node(id: &str) -> LogicalNodeId {
    LogicalNodeId::parse(id).unwrap()
}

/// Replays one recording over a fresh host around a real driver.
fn replayed(bytes: &[u8]) -> Result<flight::Replayed, flight::ReplayError> {
    flight::replay(
        bytes,
        |h| Driver::new(h.run_id.clone(), h.reconciler.clone()).map_err(|e| e.to_string()),
        |_, _| {},
    )
}

#[cfg(debug_assertions)]
#[tokio::test(start_paused = true)]
async fn every_life_of_a_cluster_replays_to_the_same_answers() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = FlightRecorder::open(dir.path(), FlightLimits::on_disk(64 << 20)).unwrap();
    let mut config = ClusterConfig::new(RunId::new("run"));
    config.stream_joins = true;
    config.flight = Some(recorder.clone());
    let fake = FakeProvider::new(
        FakeConfig {
            latency: Duration::from_millis(30),
            ..FakeConfig::default()
        },
        Clock::new(),
    );
    let args = SupervisorArgs {
        config,
        provider: Arc::new(fake),
        publisher: None,
        journal: Arc::new(MemoryJournal::new(RunId::new("run"))),
        restarts: Default::default(),
        on_exit: None,
    };
    let c = Cluster::supervised(args, None).await.unwrap();
    c.apply(shape(1, 4, None)).await.unwrap();
    c.converged().await.unwrap();
    c.replace(node("w-1")).await.unwrap();
    c.converged().await.unwrap();
    // An agent that joined goes away and is replaced at its grace.
    let snap = c.snapshot().await.unwrap();
    let w2 = snap.nodes.iter().find(|n| n.node == node("w-2")).unwrap();
    let key = ResourceKey {
        run_id: RunId::new("run"),
        node: w2.node,
        attempt: w2.attempt,
    };
    c.agent_join(key.clone()).await.unwrap().unwrap();
    c.agent_gone(key, Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.converged().await.unwrap();

    // The driver dies and its supervisor starts another: a second life.
    c.actor().send_message(DriverMsg::InjectPanic).unwrap();
    let mut back = false;
    for _ in 0..1_000 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Ok(g) = c.glance().await
            && g.converged
            && g.inventory_read
        {
            back = true;
            break;
        }
    }
    assert!(back, "the restarted driver converges");
    // A scale-down, then a new template rolled over the rest.
    c.apply(shape(2, 2, None)).await.unwrap();
    c.converged().await.unwrap();
    c.apply(shape(3, 2, Some("other"))).await.unwrap();
    c.converged().await.unwrap();
    c.shutdown(ShutdownMode::Teardown).await.unwrap();
    recorder.sync();

    let mut files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "one recording per driver life: {files:?}");
    let counts = recorder.counts();
    assert_eq!(
        (counts.lives, counts.dropped_chunks, counts.cut_lives),
        (2, 0, 0)
    );
    for (life, file) in files.iter().enumerate() {
        let bytes = std::fs::read(file).unwrap();
        let recording = Recording::read(&bytes).unwrap();
        // The second life resumed from the journal the first one left.
        let resumed = recording.header.resume.as_ref().map(|j| j.slots.len());
        assert_eq!(
            resumed.is_some_and(|n| n > 0),
            life == 1,
            "{file:?}: {resumed:?}"
        );
        let kinds: std::collections::BTreeSet<&str> = recording
            .frames()
            .map(|f| f.unwrap().input.kind())
            .collect();
        for kind in ["inventory", "result", "poll-output", "persisted"] {
            assert!(kinds.contains(kind), "life {life} has no {kind}: {kinds:?}");
        }
        let done = replayed(&bytes).unwrap_or_else(|e| panic!("life {life}: {e}"));
        assert!(done.inputs > 50, "{done:?}");
        assert!(!done.cut);
    }
    // An answer's digest tampered with in the middle of the first life is
    // found at its very frame.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let header_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let mut at = 16 + header_len;
    let kept_whole: Vec<bool> = Recording::read(&bytes)
        .unwrap()
        .frames()
        .map(|f| f.unwrap().input.keeps_fold())
        .collect();
    // The first frame from the middle on whose answer is kept as a digest
    // (its last eight bytes).
    let target = (kept_whole.len() / 2..kept_whole.len())
        .find(|&i| !kept_whole[i])
        .expect("a frame answered with a digest");
    for _ in 0..target {
        at += 4 + u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    }
    let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    bytes[at + 4 + len - 1] ^= 1;
    match replayed(&bytes) {
        Err(flight::ReplayError::Diverged(d)) => assert_eq!(d.index, target as u64, "{d}"),
        other => panic!("the tampered frame {target} was not found: {other:?}"),
    }
}
