//! The cluster journal in etcd against a real three-member cluster: the
//! same contents as the redb journal, refusals, fencing, failures, limits.

use std::time::{Duration, Instant};
use swactor_actors::JournalStore;
use swactor_daemon::journal::{DaemonJournal, EtcdJournal};
use swactor_engine::etcd::testing::{EtcdCluster, unique_prefix};
use swactor_engine::etcd::{
    Client, Compare, EtcdError, EtcdStoreError, Fence, KeyValue, Op, Range, Txn,
};
use swactor_provisioning::{
    JournalDelta, JournalImage, LogicalNodeId, NodeAttemptId, RunId, SlotRecord,
};

const RUN: &str = "gpu";

fn run() -> RunId {
    RunId::new(RUN)
}

fn node(i: u32) -> LogicalNodeId {
    LogicalNodeId::parse(&format!("g{}-{}", i / 1_000, i % 1_000)).expect("a node id")
}

fn record(i: u32) -> SlotRecord {
    SlotRecord {
        attempt: NodeAttemptId(u64::from(i) + 1),
        template: 0x5eed_0000 + u64::from(i),
        created: i.is_multiple_of(2),
        failures: i % 3,
        replace: i.is_multiple_of(5),
    }
}

/// A delta that sets the meta (its epoch `epoch`) and puts `slots`.
fn delta(seq: u64, epoch: u64, slots: impl IntoIterator<Item = u32>) -> JournalDelta {
    let mut meta = JournalImage::new(run()).meta;
    meta.epoch = epoch;
    meta.attempts_reserved = epoch * 100;
    meta.deployment = Some("dep-1".to_owned());
    JournalDelta {
        seq,
        meta: Some(meta),
        put: slots.into_iter().map(|i| (node(i), record(i))).collect(),
        remove: Vec::new(),
    }
}

/// Every key under `root` with its value and revisions, to show nothing changed.
async fn snapshot(client: &Client, root: &str) -> Vec<KeyValue> {
    client
        .range(&Range::prefix(format!("{root}/")))
        .await
        .expect("a range")
        .kvs
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_journal_reopens_to_the_image_the_redb_journal_holds_for_the_same_deltas() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let prefix = unique_prefix("roundtrip");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let (redb, none) = DaemonJournal::open(&path).unwrap();
    assert!(none.is_none());
    let (etcd, none) = EtcdJournal::open(cluster.client(), &prefix, &run())
        .await
        .unwrap();
    assert!(none.is_none());

    let mut removal = delta(3, 2, [1_001, 1_002]);
    removal.meta.as_mut().unwrap().paused = true;
    removal.remove = (0..1_000).step_by(3).map(node).collect();
    let mut meta_only = delta(4, 3, []);
    meta_only.meta.as_mut().unwrap().tearing_down = true;
    meta_only.meta.as_mut().unwrap().paused = true;
    let no_meta = JournalDelta {
        seq: 5,
        meta: None,
        put: vec![(node(7), record(70))],
        remove: vec![node(1)],
    };
    let deltas = [
        delta(1, 1, 0..1_000),
        delta(2, 1, 500..700),
        removal,
        meta_only,
        no_meta,
    ];
    for d in &deltas {
        redb.commit(d).await.unwrap();
        etcd.commit(d).await.unwrap();
        assert_eq!(JournalStore::image(&etcd), JournalStore::image(&redb));
    }
    drop(redb);
    let (_, from_redb) = DaemonJournal::open(&path).unwrap();
    let started = Instant::now();
    let (_, from_etcd) = EtcdJournal::open(cluster.client(), &prefix, &run())
        .await
        .unwrap();
    let open_took = started.elapsed();
    let from_etcd = from_etcd.expect("an image");
    assert_eq!(Some(&from_etcd), from_redb.as_ref());
    assert_eq!(from_etcd.slots.len(), 1_000 - 334 + 2 - 1);
    assert!(from_etcd.meta.paused && from_etcd.meta.tearing_down);

    // Open time with 1,000 slots, and commit latency on three members.
    let prefix = unique_prefix("latency");
    let (etcd, _) = EtcdJournal::open(cluster.client(), &prefix, &run())
        .await
        .unwrap();
    etcd.commit(&delta(1, 1, 0..1_000)).await.unwrap();
    let started = Instant::now();
    let (etcd, image) = EtcdJournal::open(cluster.client(), &prefix, &run())
        .await
        .unwrap();
    let open_1000 = started.elapsed();
    assert_eq!(image.unwrap().slots.len(), 1_000);
    let mut took = Vec::new();
    for i in 0..200 {
        let d = JournalDelta {
            seq: 2 + i,
            meta: None,
            put: vec![(node(u32::try_from(i).unwrap()), record(7))],
            remove: Vec::new(),
        };
        let started = Instant::now();
        etcd.commit(&d).await.unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    eprintln!(
        "etcd journal on 3 loopback members: open of 1,000 slots {open_1000:?} (and of 667: \
         {open_took:?}); one-slot commit p50 {:?}, p99 {:?}, max {:?}",
        percentile(&took, 50),
        percentile(&took, 99),
        took[took.len() - 1]
    );
    assert!(percentile(&took, 99) < Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_holding_another_run_kind_or_format_is_refused_and_left_untouched() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let prefix = unique_prefix("foreign");
    let root = EtcdJournal::root(&prefix, &run());

    // Another run's journal where this run's belongs (copied keys, a bad tool).
    let (other, _) = EtcdJournal::open(client.clone(), &prefix, &RunId::new("other"))
        .await
        .unwrap();
    let mut theirs = delta(1, 1, 0..3);
    theirs.meta.as_mut().unwrap().run_id = RunId::new("other");
    other.commit(&theirs).await.unwrap();
    let other_root = other.key_root().to_owned();
    for kv in snapshot(&client, &other_root).await {
        let name = String::from_utf8(kv.key)
            .unwrap()
            .replacen(&other_root, &root, 1);
        client.put(name, kv.value, None).await.unwrap();
    }
    let before = snapshot(&client, &root).await;
    let e = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap_err();
    let words = swactor_engine::error_chain(e.as_ref());
    assert!(
        words.contains(&root) && words.contains("run \"other\""),
        "{words}"
    );
    assert!(
        words.contains("nothing was started or destroyed"),
        "{words}"
    );
    assert_eq!(snapshot(&client, &root).await, before);

    // A newer format, and another kind of journal.
    let header = format!("{root}/header");
    let current = client.get(&header).await.unwrap().unwrap().value;
    let mut newer: serde_json::Value = serde_json::from_slice(&current).unwrap();
    newer["format"] = serde_json::json!(99);
    client.put(&header, newer.to_string(), None).await.unwrap();
    let before = snapshot(&client, &root).await;
    let e = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap_err();
    let source = e.downcast_ref::<EtcdStoreError>();
    assert!(
        matches!(source, Some(EtcdStoreError::NewerFormat { found: 99, .. })),
        "{e:#}"
    );
    assert_eq!(snapshot(&client, &root).await, before);
    newer["format"] = serde_json::json!(1);
    newer["kind"] = serde_json::json!("something-else");
    client.put(&header, newer.to_string(), None).await.unwrap();
    let before = snapshot(&client, &root).await;
    let e = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<EtcdStoreError>(),
            Some(EtcdStoreError::OtherKind { .. })
        ),
        "{e:#}"
    );
    // A key this build never writes.
    client
        .put(format!("{root}/stray"), "x", None)
        .await
        .unwrap();
    let e = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("\"stray\""), "{e:#}");
    assert_eq!(snapshot(&client, &root).await.len(), before.len() + 1);
}

/// Wins an election as a leader would: creates `key` if absent, on a lease.
async fn elect(client: &Client, key: &str) -> Fence {
    let lease = client.lease_grant(10).await.unwrap();
    let won = client
        .txn(&Txn {
            compare: vec![Compare::created_at(key.as_bytes(), 0)],
            success: vec![Op::Put {
                key: key.as_bytes().to_vec(),
                value: b"me".to_vec(),
                lease: lease.id,
            }],
            failure: vec![],
        })
        .await
        .unwrap()
        .check()
        .expect("the election key was free");
    Fence {
        key: key.to_owned(),
        create_revision: won.revision,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_commit_with_a_stale_revision_fails_and_writes_nothing() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let prefix = unique_prefix("fence");
    let election = format!("{prefix}/election");
    let (journal, _) = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap();
    let mine = elect(&client, &election).await;
    journal.set_fence(Some(mine.clone()));
    journal.commit(&delta(1, 1, 0..4)).await.unwrap();

    // Deposed: the key is gone and another daemon created it again.
    client.delete(&election, false).await.unwrap();
    let theirs = elect(&client, &election).await;
    let before = snapshot(&client, journal.key_root()).await;
    let image = JournalStore::image(&journal);
    let e = journal.commit(&delta(2, 2, 4..8)).await.unwrap_err();
    let words = swactor_engine::error_chain(&e);
    assert!(words.contains("not the leader"), "{words}");
    let stale = journal
        .commit_fenced(&delta(2, 2, 4..8), Some(&mine))
        .await
        .unwrap_err();
    assert!(
        matches!(&stale, EtcdStoreError::Fenced { expected, found, .. }
            if *expected == mine.create_revision && *found == theirs.create_revision),
        "{stale}"
    );
    assert_eq!(snapshot(&client, journal.key_root()).await, before);
    assert_eq!(JournalStore::image(&journal), image);
    assert!(
        journal
            .health()
            .failure()
            .unwrap()
            .contains("not the leader")
    );

    // The new leader's journal (opened after it won) writes under its fence.
    let (successor, _) = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap();
    successor.set_fence(Some(theirs.clone()));
    successor.commit(&delta(2, 2, 4..8)).await.unwrap();
    assert_eq!(JournalStore::image(&successor).unwrap().slots.len(), 8);
    // The election key gone altogether: no one may write.
    client.delete(&election, false).await.unwrap();
    let e = successor.commit(&delta(3, 3, [])).await.unwrap_err();
    assert!(
        swactor_engine::error_chain(&e).contains("not the leader"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_survive_a_dead_leader_and_fail_in_bounded_time_when_every_member_is_down() {
    let Some(mut cluster) = EtcdCluster::start(3) else {
        return;
    };
    let mut config = cluster.config();
    // Long enough for the two members left to elect a leader (1 s election timeout).
    config.call_timeout = Duration::from_secs(5);
    let client = Client::new(config).unwrap();
    let (journal, _) = EtcdJournal::open(client, "", &run()).await.unwrap();
    journal.commit(&delta(1, 1, 0..10)).await.unwrap();

    let leader = cluster.leader().expect("a leader");
    cluster.kill(leader);
    let started = Instant::now();
    journal.commit(&delta(2, 2, 10..20)).await.unwrap();
    let through_election = started.elapsed();

    cluster.kill_all();
    let started = Instant::now();
    let e = journal
        .commit_fenced(&delta(3, 3, 20..30), None)
        .await
        .unwrap_err();
    let all_down = started.elapsed();
    assert!(
        matches!(
            &e,
            EtcdStoreError::Etcd {
                source: EtcdError::Unreachable { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(
        all_down < Duration::from_millis(5_500),
        "{all_down:?} for a 5 s call timeout"
    );
    assert!(
        journal
            .health()
            .failure()
            .unwrap()
            .contains("could be reached")
    );

    cluster.restart_all();
    journal.commit(&delta(3, 3, 20..30)).await.unwrap();
    assert_eq!(journal.health().failure(), None);
    let (_, image) = EtcdJournal::open(cluster.client(), "", &run())
        .await
        .unwrap();
    assert_eq!(image.unwrap().slots.len(), 30);
    eprintln!(
        "etcd journal: a commit across the leader's death took {through_election:?}; \
         with every member down one failed after {all_down:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_delta_is_one_transaction_and_one_over_etcds_limit_is_refused_whole() {
    let Some(cluster) = EtcdCluster::shared() else {
        return;
    };
    let client = cluster.client();
    let prefix = unique_prefix("big");
    let (journal, _) = EtcdJournal::open(client.clone(), &prefix, &run())
        .await
        .unwrap();
    // 5,000 slots (far over etcd's 128 operations a transaction) in one commit.
    journal.commit(&delta(1, 1, 0..5_000)).await.unwrap();
    let kvs = snapshot(&client, journal.key_root()).await;
    assert!(
        kvs.len() <= swactor_engine::etcd::BUCKETS + 2,
        "{} keys",
        kvs.len()
    );
    let revisions: std::collections::BTreeSet<i64> = kvs.iter().map(|kv| kv.mod_revision).collect();
    assert_eq!(
        revisions.len(),
        1,
        "written by one transaction: {revisions:?}"
    );

    // 20,000 slots are over etcd's 1.5 MiB a request: refused before
    // anything is sent, naming the setting to raise.
    let e = journal
        .commit_fenced(&delta(2, 2, 0..20_000), None)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdStoreError::TooLarge {
                setting: "--max-request-bytes",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("nothing was written"), "{e}");
    assert_eq!(snapshot(&client, journal.key_root()).await, kvs);
    assert_eq!(JournalStore::image(&journal).unwrap().slots.len(), 5_000);
    // And the journal goes on.
    journal.commit(&delta(3, 3, [5_000])).await.unwrap();
    let (_, image) = EtcdJournal::open(client, &prefix, &run()).await.unwrap();
    assert_eq!(image.unwrap().slots.len(), 5_001);
}
