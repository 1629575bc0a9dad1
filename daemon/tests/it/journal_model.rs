//! The conformance kit's journal model against both real journals: the
//! deltas a host commits over random traces, replayed into the redb
//! journal and the etcd journal, reopened now and then; each must hold
//! what the model holds after every commit.

use std::rc::Rc;
use std::time::Instant;
use swactor_actors::JournalStore;
use swactor_conformance::battery::{Suite, suite_trace_for_seed};
use swactor_conformance::{Factory, Mode, RUN, World};
use swactor_daemon::journal::{DaemonJournal, EtcdJournal};
use swactor_engine::etcd::testing::{EtcdCluster, unique_prefix};
use swactor_provisioning::{Driver, JournalDelta, JournalImage, RunId};

/// Traces replayed (a few dozen commits each; a few seconds in all).
const SEEDS: u64 = 24;
/// Both journals are reopened after this many commits.
const REOPEN_EVERY: usize = 9;
/// Most commits replayed from one trace.
const COMMITS_MAX: usize = 250;

/// The deltas one seeded trace commits (its fair tail included), and the
/// journal the kit's world ends with.
fn committed(seed: u64) -> (Vec<JournalDelta>, JournalImage) {
    let mode = if seed.is_multiple_of(2) {
        Mode::InOrder
    } else {
        Mode::Adversarial
    };
    // Every other pair of seeds has short leases, and host crashes around them.
    let suite = if seed % 4 < 2 {
        Suite::Base
    } else {
        Suite::Leases
    };
    let trace = suite_trace_for_seed(suite, mode, seed);
    let config = suite.world(mode);
    let reconciler = config.reconciler.clone();
    let make: Factory<Driver> = Rc::new(move || {
        Driver::new(RunId::new(RUN), reconciler.clone()).expect("the battery's config is valid")
    });
    let mut world = World::with_factory(make, config, trace.seed);
    for input in &trace.inputs {
        if !world.oracle().ok() {
            break;
        }
        world.apply(input);
    }
    if world.oracle().ok() {
        let _ = world.run_fair_tail();
    }
    (world.take_committed(), world.journal().clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_journals_hold_what_the_kits_journal_model_holds_over_random_traces() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let started = Instant::now();
    let mut commits = 0;
    let mut reopens = 0;
    for seed in 0..SEEDS {
        let (deltas, journal) = committed(seed);
        // The recorder is read-only: replayed in order, the deltas make the world's journal.
        let mut model = JournalImage::new(RunId::new(RUN));
        deltas.iter().for_each(|d| model.apply(d));
        assert_eq!(
            model, journal,
            "seed {seed}: the recorded deltas are the world's journal"
        );
        assert!(
            deltas.len() > 3,
            "seed {seed}: only {} commits",
            deltas.len()
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.redb");
        let prefix = unique_prefix("model");
        let run = RunId::new(RUN);
        let (mut redb, _) = DaemonJournal::open(&path).unwrap();
        let (mut etcd, _) = EtcdJournal::open(cluster.client(), &prefix, &run)
            .await
            .unwrap();
        let mut model = JournalImage::new(RunId::new(RUN));
        for (i, delta) in deltas.iter().take(COMMITS_MAX).enumerate() {
            redb.commit(delta).await.unwrap();
            etcd.commit(delta).await.unwrap();
            model.apply(delta);
            let at = format!("seed {seed}, commit {i} (seq {})", delta.seq);
            assert_eq!(
                JournalStore::image(&redb).as_ref(),
                Some(&model),
                "redb, {at}"
            );
            assert_eq!(
                JournalStore::image(&etcd).as_ref(),
                Some(&model),
                "etcd, {at}"
            );
            if (i + 1) % REOPEN_EVERY == 0 {
                drop(redb);
                let (again, image) = DaemonJournal::open(&path).unwrap();
                assert_eq!(image.as_ref(), Some(&model), "redb reopened, {at}");
                redb = again;
                let (again, image) = EtcdJournal::open(cluster.client(), &prefix, &run)
                    .await
                    .unwrap();
                assert_eq!(image.as_ref(), Some(&model), "etcd reopened, {at}");
                etcd = again;
                reopens += 1;
            }
            commits += 1;
        }
    }
    eprintln!(
        "journal model: {SEEDS} traces, {commits} commits into both journals, {reopens} reopens, \
         in {:?}",
        started.elapsed()
    );
}
