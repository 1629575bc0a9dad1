//! Telemetry publisher and subscribers on loopback, plus the NDJSON sink.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use iroh::Endpoint;
use iroh::protocol::Router;
use serde::{Deserialize, Serialize};
use swactor_engine::net::{
    ALPN_TELEMETRY, Allowlist, GuardedRouterBuilder, Limits, NetConfig, codes,
};
use swactor_engine::telemetry::{
    NDJSON_FILE_NAME, NdjsonConfig, NdjsonSink, SubscribeError, TelemetryConfig, TelemetryFrame,
    TelemetryPublisher, TelemetrySubscription, subscribe,
};
use tokio::sync::watch;

use crate::net::{endpoint, endpoint_with};
use crate::{eventually, within};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Snap {
    count: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Ev {
    n: u64,
    pad: Vec<u8>,
}

fn ev(n: u64) -> Ev {
    Ev { n, pad: Vec::new() }
}

type Frame = TelemetryFrame<Snap, Ev>;
type Sub = TelemetrySubscription<Snap, Ev>;

const FRAME_LEN_MAX: usize = 64 * 1024;
const WAIT: Duration = Duration::from_secs(20);

async fn serve(config: TelemetryConfig) -> (TelemetryPublisher<Snap, Ev>, Router) {
    let publisher = TelemetryPublisher::new(config, &Snap { count: 0 }).unwrap();
    let router = GuardedRouterBuilder::new(endpoint().await)
        .serve_with_limits(
            ALPN_TELEMETRY,
            Allowlist::open(),
            // One test client holds a hundred subscriptions under one key,
            // which the default per-peer cap of an open protocol refuses.
            Limits {
                connections_per_peer_max: Limits::OPEN.connections_max,
                ..Limits::OPEN
            },
            publisher.handler(),
        )
        .spawn();
    (publisher, router)
}

async fn sub(client: &Endpoint, router: &Router) -> Sub {
    subscribe(
        client,
        router.endpoint().addr(),
        Duration::from_secs(5),
        FRAME_LEN_MAX,
    )
    .await
    .unwrap()
}

/// The next frame, with an event's timestamp checked (it is recent) and
/// then zeroed, so frames compare equal to the expected ones.
async fn next(sub: &mut Sub) -> Frame {
    let frame = within(WAIT, "telemetry frame", sub.next())
        .await
        .unwrap()
        .expect("stream open");
    match frame {
        TelemetryFrame::Event { seq, at_ms, event } => {
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64;
            assert!(
                at_ms <= now_ms && now_ms - at_ms < 60_000,
                "event {seq} is stamped {at_ms}, now is {now_ms}"
            );
            TelemetryFrame::Event {
                seq,
                at_ms: 0,
                event,
            }
        }
        other => other,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_subscribers_each_receive_every_event_in_order() {
    let (publisher, router) = serve(TelemetryConfig {
        buffer_len_max: 4096,
        ..TelemetryConfig::default()
    })
    .await;
    let client = endpoint().await;
    let mut subs = Vec::new();
    for _ in 0..100 {
        subs.push(sub(&client, &router).await);
    }
    eventually(WAIT, "100 subscribers", || {
        publisher.subscriber_count() == 100
    })
    .await;
    assert_eq!(publisher.buffer_count(), 100);

    let events = 300;
    for n in 1..=events {
        assert_eq!(publisher.publish(&ev(n)).unwrap(), n);
    }
    drop(publisher); // ends every stream after its last event

    let readers = subs.into_iter().map(|sub| {
        tokio::spawn(async move {
            let frames: Vec<Frame> = sub.into_stream().map(Result::unwrap).collect().await;
            frames
        })
    });
    for reader in readers {
        let frames = within(WAIT, "subscriber drained", reader).await.unwrap();
        assert_eq!(
            frames[0],
            TelemetryFrame::Snapshot {
                seq: 0,
                state: Snap { count: 0 }
            }
        );
        let seqs: Vec<u64> = frames[1..]
            .iter()
            .map(|frame| match frame {
                TelemetryFrame::Event { seq, event, .. } if event.n == *seq => *seq,
                other => panic!("unexpected frame {other:?}"),
            })
            .collect();
        assert_eq!(seqs, (1..=events).collect::<Vec<_>>());
    }
    client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_never_reads_lags_without_slowing_the_others() {
    let (publisher, router) = serve(TelemetryConfig {
        buffer_len_max: 64,
        history_len_max: 0,
        write_stall_max: Duration::from_secs(60),
        ..TelemetryConfig::default()
    })
    .await;
    // The slow client's tiny receive window fills after a few frames, so the
    // publisher side's task for it blocks on its stream almost at once.
    let slow_client = endpoint_with(&NetConfig {
        stream_receive_window_bytes: Some(8 * 1024),
        ..NetConfig::default()
    })
    .await;
    let mut slow = sub(&slow_client, &router).await;
    let fast_client = endpoint().await;
    let fast_count = 5;
    let mut progress = Vec::new();
    let mut readers = Vec::new();
    for _ in 0..fast_count {
        let mut sub = sub(&fast_client, &router).await;
        let (tx, rx) = watch::channel(0u64);
        progress.push(rx);
        readers.push(tokio::spawn(async move {
            let mut expected = 1;
            loop {
                match within(WAIT, "fast frame", sub.next()).await.unwrap() {
                    Some(TelemetryFrame::Snapshot { .. }) => {}
                    Some(TelemetryFrame::Event { seq, .. }) => {
                        assert_eq!(seq, expected, "fast subscriber saw a gap");
                        expected += 1;
                        let _ = tx.send(seq);
                    }
                    Some(TelemetryFrame::Lagged { missed }) => {
                        panic!("fast subscriber lagged by {missed}")
                    }
                    None => return expected - 1,
                }
            }
        }));
    }
    eventually(WAIT, "subscribers", || {
        publisher.subscriber_count() == fast_count + 1
    })
    .await;

    // Publish in batches no larger than the ring, letting the fast readers
    // catch up in between, so only the reader that never reads can lag.
    let events = 2000u64;
    let batch = 32;
    let mut slowest_publish = Duration::ZERO;
    for start in (1..=events).step_by(batch) {
        let end = (start + batch as u64 - 1).min(events);
        for n in start..=end {
            let event = Ev {
                n,
                pad: vec![7; 1024],
            };
            let began = Instant::now();
            publisher.publish(&event).unwrap();
            slowest_publish = slowest_publish.max(began.elapsed());
        }
        for rx in &mut progress {
            within(
                WAIT,
                "fast readers catch up",
                rx.wait_for(|seen| *seen >= end),
            )
            .await
            .unwrap();
        }
    }
    // Generous: publish is synchronous, so only OS preemption can stretch it.
    assert!(
        slowest_publish < Duration::from_millis(250),
        "publish took {slowest_publish:?}"
    );
    // One ring cursor per subscriber and nothing else: the stalled one holds no backlog of its own.
    assert_eq!(publisher.buffer_count(), fast_count + 1);
    drop(publisher);
    for reader in readers {
        assert_eq!(within(WAIT, "fast reader", reader).await.unwrap(), events);
    }

    // Now the slow one reads: a prefix, a lag notice, the tail, then the end.
    let mut events_seen = 0u64;
    let mut missed_total = 0u64;
    let mut last = 0u64;
    while let Some(frame) = within(WAIT, "slow frame", slow.next()).await.unwrap() {
        match frame {
            TelemetryFrame::Snapshot { .. } => {}
            TelemetryFrame::Event { seq, .. } => {
                assert!(seq > last, "out of order");
                last = seq;
                events_seen += 1;
            }
            TelemetryFrame::Lagged { missed } => missed_total += missed,
        }
    }
    assert!(
        missed_total > 0,
        "the slow subscriber must have been told it lagged"
    );
    assert_eq!(
        events_seen + missed_total,
        events,
        "every event seen or counted as missed"
    );
    assert!(
        events_seen < 200,
        "memory for it stayed bounded (saw {events_seen})"
    );
    slow_client.close().await;
    fast_client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stalled_subscriber_is_dropped_with_a_clear_code() {
    let (publisher, router) = serve(TelemetryConfig {
        buffer_len_max: 16,
        write_stall_max: Duration::from_millis(300),
        ..TelemetryConfig::default()
    })
    .await;
    let slow_client = endpoint_with(&NetConfig {
        stream_receive_window_bytes: Some(4 * 1024),
        ..NetConfig::default()
    })
    .await;
    let mut slow = sub(&slow_client, &router).await;
    eventually(WAIT, "subscriber", || publisher.subscriber_count() == 1).await;
    for n in 1..=64 {
        publisher
            .publish(&Ev {
                n,
                pad: vec![1; 1024],
            })
            .unwrap();
    }
    eventually(WAIT, "stalled subscriber dropped", || {
        publisher.subscriber_count() == 0 && publisher.buffer_count() == 0
    })
    .await;
    let ending = within(WAIT, "slow drains", async {
        loop {
            match slow.next().await {
                Ok(Some(_)) => {}
                Ok(None) => return None,
                Err(error) => return Some(error),
            }
        }
    })
    .await;
    assert!(
        matches!(ending, Some(SubscribeError::Refused { code, .. }) if code == codes::CLOSE_SUBSCRIBER_STALLED.into_inner()),
        "{ending:?}"
    );
    slow_client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_departing_subscriber_frees_its_task_and_buffer() {
    let (publisher, router) = serve(TelemetryConfig::default()).await;
    let client = endpoint().await;
    let mut subs = Vec::new();
    for _ in 0..3 {
        let mut s = sub(&client, &router).await;
        assert!(matches!(
            next(&mut s).await,
            TelemetryFrame::Snapshot { .. }
        ));
        subs.push(s);
    }
    eventually(WAIT, "3 subscribers", || publisher.subscriber_count() == 3).await;
    assert_eq!(publisher.buffer_count(), 3);

    // Without any event to write, the task must notice the close by itself.
    subs.pop().unwrap().close();
    eventually(WAIT, "one gone", || {
        publisher.subscriber_count() == 2 && publisher.buffer_count() == 2
    })
    .await;
    // Dropping without a goodbye works too.
    drop(subs.pop());
    eventually(WAIT, "two gone", || {
        publisher.subscriber_count() == 1 && publisher.buffer_count() == 1
    })
    .await;
    publisher.publish(&ev(1)).unwrap();
    assert_eq!(
        next(&mut subs[0]).await,
        TelemetryFrame::Event {
            seq: 1,
            at_ms: 0,
            event: ev(1)
        }
    );
    client.close().await;
    eventually(WAIT, "all gone", || {
        publisher.subscriber_count() == 0 && publisher.buffer_count() == 0
    })
    .await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_late_subscriber_gets_the_snapshot_then_the_events_after_it() {
    let (publisher, router) = serve(TelemetryConfig::default()).await;
    for n in 1..=3 {
        publisher.publish(&ev(n)).unwrap();
    }
    publisher.set_snapshot(&Snap { count: 3 }).unwrap();
    for n in 4..=5 {
        publisher.publish(&ev(n)).unwrap();
    }
    let client = endpoint().await;
    let mut s = sub(&client, &router).await;
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Snapshot {
            seq: 3,
            state: Snap { count: 3 }
        }
    );
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Event {
            seq: 4,
            at_ms: 0,
            event: ev(4)
        }
    );
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Event {
            seq: 5,
            at_ms: 0,
            event: ev(5)
        }
    );
    publisher.publish(&ev(6)).unwrap();
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Event {
            seq: 6,
            at_ms: 0,
            event: ev(6)
        }
    );
    client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_older_than_the_history_is_followed_by_a_lag_notice() {
    let (publisher, router) = serve(TelemetryConfig {
        history_len_max: 2,
        ..TelemetryConfig::default()
    })
    .await;
    for n in 1..=5 {
        publisher.publish(&ev(n)).unwrap();
    }
    let client = endpoint().await;
    let mut s = sub(&client, &router).await;
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Snapshot {
            seq: 0,
            state: Snap { count: 0 }
        }
    );
    assert_eq!(next(&mut s).await, TelemetryFrame::Lagged { missed: 3 });
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Event {
            seq: 4,
            at_ms: 0,
            event: ev(4)
        }
    );
    assert_eq!(
        next(&mut s).await,
        TelemetryFrame::Event {
            seq: 5,
            at_ms: 0,
            event: ev(5)
        }
    );
    client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn published_events_are_also_written_as_ndjson_lines() {
    let dir = tempfile::tempdir().unwrap();
    let sink = NdjsonSink::open(dir.path(), &NdjsonConfig::default())
        .await
        .unwrap();
    let publisher =
        TelemetryPublisher::<Snap, Ev>::new(TelemetryConfig::default(), &Snap { count: 0 })
            .unwrap()
            .with_ndjson(sink.clone());
    for n in 1..=3 {
        publisher.publish(&ev(n)).unwrap();
    }
    sink.flush().await.unwrap();
    let text = std::fs::read_to_string(dir.path().join(NDJSON_FILE_NAME)).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        let n = i as u64 + 1;
        assert_eq!(line["seq"], n);
        assert!(line["at_ms"].as_u64().is_some_and(|t| t > 0), "{line}");
        assert_eq!(line["event"]["n"], n);
    }
    assert_eq!((sink.written(), sink.dropped()), (3, 0));
}

#[tokio::test]
async fn a_full_ndjson_queue_drops_and_counts_instead_of_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let sink = NdjsonSink::open(
        dir.path(),
        &NdjsonConfig {
            queue_len_max: 4,
            line_len_max: 64,
            ..NdjsonConfig::default()
        },
    )
    .await
    .unwrap();
    // On this single-threaded runtime the writer cannot run until we await,
    // so the fifth record finds the queue full.
    for n in 0..4 {
        sink.record(&ev(n)).unwrap();
    }
    assert!(sink.record(&ev(4)).is_err());
    assert!(
        sink.record(&Ev {
            n: 5,
            pad: vec![0; 100]
        })
        .is_err(),
        "too long"
    );
    sink.flush().await.unwrap();
    assert_eq!((sink.written(), sink.dropped()), (4, 2));
}

#[tokio::test]
async fn subscribers_beyond_the_limit_are_refused_as_busy() {
    let (publisher, router) = serve(TelemetryConfig {
        subscribers_max: 2,
        ..TelemetryConfig::default()
    })
    .await;
    let client = endpoint().await;
    let _a = sub(&client, &router).await;
    let _b = sub(&client, &router).await;
    eventually(WAIT, "2 subscribers", || publisher.subscriber_count() == 2).await;
    let refused = subscribe::<Snap, Ev>(
        &client,
        router.endpoint().addr(),
        Duration::from_secs(5),
        FRAME_LEN_MAX,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(refused, SubscribeError::Refused { code, .. } if code == codes::CLOSE_BUSY.into_inner()),
        "{refused:?}"
    );
    assert_eq!(publisher.subscriber_count(), 2);
    client.close().await;
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_ndjson_file_rotates_at_its_size_limit_keeping_so_many_old_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = NdjsonConfig {
        line_len_max: 64,
        file_len_max: 200,
        files_kept: 2,
        ..NdjsonConfig::default()
    };
    let sink = NdjsonSink::open(dir.path(), &config).await.unwrap();
    for n in 0..50u32 {
        sink.record(&serde_json::json!({ "n": n, "pad": "xxxxxxxxxx" }))
            .unwrap();
    }
    sink.flush().await.unwrap();
    let live = dir.path().join(NDJSON_FILE_NAME);
    let path = |n: usize| dir.path().join(format!("{NDJSON_FILE_NAME}.{n}"));
    assert!(
        path(1).exists() && path(2).exists(),
        "two rotated files kept"
    );
    assert!(!path(3).exists(), "no third rotated file");
    let mut last = None;
    for file in [path(2), path(1), live] {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            text.len() <= 200,
            "{} has {} bytes",
            file.display(),
            text.len()
        );
        for line in text.lines() {
            let n = serde_json::from_str::<serde_json::Value>(line).unwrap()["n"]
                .as_u64()
                .unwrap();
            // Lines run on in order across the files, oldest file first.
            assert!(last.is_none_or(|l| n == l + 1), "{n} after {last:?}");
            last = Some(n);
        }
    }
    assert_eq!(last, Some(49));
    assert_eq!((sink.written(), sink.dropped()), (50, 0));
}

/// A tmpfs of a few KiB mounted on a temporary directory, unmounted on drop.
struct TinyDisk {
    dir: tempfile::TempDir,
}

impl TinyDisk {
    /// `None` (with a line saying so) where mounting is not permitted.
    fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::piped())
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Self { dir }),
            Ok(out) => {
                eprintln!(
                    "skipped: cannot mount a tmpfs here ({})",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("skipped: cannot run mount ({e})");
                None
            }
        }
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for TinyDisk {
    fn drop(&mut self) {
        // Lazily: the sink's writer may still hold its file open.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

#[tokio::test]
async fn the_ndjson_file_survives_a_full_disk_and_says_how_many_lines_it_lost() {
    let Some(disk) = TinyDisk::mount("64k") else {
        return;
    };
    let config = NdjsonConfig {
        line_len_max: 1024,
        reopen_after_max: Duration::from_millis(200),
        ..NdjsonConfig::default()
    };
    let sink = NdjsonSink::open(disk.path(), &config).await.unwrap();
    let line = |n: u64| serde_json::json!({ "n": n, "pad": "x".repeat(200) });
    let mut recorded = 0;
    for n in 0..10 {
        sink.record(&line(n)).unwrap();
        recorded += 1;
    }
    sink.flush().await.unwrap();
    // Fill the filesystem.
    let filler = disk.path().join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    while std::io::Write::write_all(&mut file, &[0; 1024]).is_ok() {}
    drop(file);
    // Lines go on coming until writing them fails.
    let mut n = 10;
    loop {
        for _ in 0..20 {
            sink.record(&line(n)).unwrap();
            recorded += 1;
            n += 1;
        }
        if sink.flush().await.is_err() {
            break;
        }
        assert!(n < 1000, "the full disk took every line");
    }
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + WAIT;
    while sink.flush().await.is_err() {
        assert!(Instant::now() < deadline, "writing never resumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..10 {
        sink.record(&line(n)).unwrap();
        recorded += 1;
        n += 1;
    }
    sink.flush().await.unwrap();

    let text = std::fs::read_to_string(disk.path().join(NDJSON_FILE_NAME)).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let gaps: Vec<_> = lines.iter().filter(|l| l.get("gap").is_some()).collect();
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    let gap = &gaps[0]["gap"];
    // At least the line the full disk cut short.
    assert!(gap["dropped"].as_u64().unwrap() >= 1, "{gap}");
    assert_eq!(gap["dropped"], sink.dropped(), "{gap}");
    assert!(gap["error"].as_str().unwrap().contains("space"), "{gap}");
    let ns: Vec<u64> = lines.iter().filter_map(|l| l["n"].as_u64()).collect();
    assert!(ns.windows(2).all(|w| w[0] < w[1]), "{ns:?}");
    assert_eq!(ns.len() as u64, sink.written());
    assert_eq!(sink.written() + sink.dropped(), recorded);
    assert_eq!(ns[..10], (0..10).collect::<Vec<_>>());
    assert_eq!(ns[ns.len() - 10..], (n - 10..n).collect::<Vec<_>>());
    // The line after the gap is the first one written after it.
    let at = lines.iter().position(|l| l.get("gap").is_some()).unwrap();
    assert_eq!(lines[at + 1]["n"], n - 10);
}

#[test]
fn a_full_disk_cuts_the_flight_recording_and_is_counted_never_waited_for() {
    use swactor_engine::flight::{FlightLimits, FlightRecorder};
    let Some(disk) = TinyDisk::mount("64k") else {
        return;
    };
    let dir = disk.path().join("flight");
    let rec = FlightRecorder::<Vec<u8>>::open(&dir, FlightLimits::on_disk(64 << 20)).unwrap();
    let life = rec.begin(b"HEAD".to_vec(), 1);
    // 200 KiB handed in, three times what the disk holds: each append
    // returns at once, whatever the writer meets.
    let mut handed = b"HEAD".to_vec();
    for i in 0..50u8 {
        let chunk = vec![i; 4096];
        handed.extend_from_slice(&chunk);
        life.append(chunk);
    }
    rec.sync();
    let counts = rec.counts();
    assert!(counts.write_errors >= 1, "{counts:?}");
    assert_eq!(counts.cut_lives, 1, "{counts:?}");
    // What reached the disk is what was handed in, up to where it filled.
    let on_disk = std::fs::read(life.path()).unwrap();
    assert!(
        on_disk.len() > 4 && on_disk.len() < handed.len(),
        "{} bytes",
        on_disk.len()
    );
    assert_eq!(on_disk[..], handed[..on_disk.len()]);
    // The life's later frames are dropped and counted, not retried.
    life.append(vec![7; 10]);
    rec.sync();
    assert!(rec.counts().dropped_chunks > counts.dropped_chunks);
    assert_eq!(std::fs::read(life.path()).unwrap(), on_disk);
    // With room again, the next life is written whole.
    std::fs::remove_file(life.path()).unwrap();
    let next = rec.begin(b"H2".to_vec(), 2);
    next.append(b"ok".to_vec());
    rec.sync();
    assert_eq!(std::fs::read(next.path()).unwrap(), b"H2ok");
    assert_eq!(rec.counts().cut_lives, 1);
}
