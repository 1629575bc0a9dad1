//! Memory a hostile peer can make the engine hold: allocations while
//! receiving frames (counted per thread by a counting global allocator) and
//! the process's resident size under a flood of announced-but-unsent frames.
//!
//! A binary of its own because the counting allocator replaces the global
//! one, and because the resident size is a process-wide figure that the
//! parallel tests of `it` would disturb; the tests here take turns.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use iroh::endpoint::Connection;
use iroh::protocol::{AcceptError, ProtocolHandler};
use iroh::{Endpoint, SecretKey};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, Allowlist, FRAME_HEADER_LEN, FrameError, GuardedRouterBuilder,
    Limits, NetConfig, RECV_CHUNK_LEN_MAX_BYTES, bind_endpoint, codes, connect, encode_frame,
    recv_frame, send_frame,
};
use tokio::io::{AsyncRead, ReadBuf};

/// The daemon's frame limit, which the attacks were run against.
const DAEMON_FRAME_LEN_MAX: usize = 64 * 1024 * 1024;
/// Bookkeeping besides the payload (the list of pieces, the runtime's
/// per-call state) that a measurement may include.
const SLACK_BYTES: u64 = 16 * 1024;
const DIAL: Duration = Duration::from_secs(5);

static TURNS: Mutex<()> = Mutex::new(());

fn take_turn() -> MutexGuard<'static, ()> {
    TURNS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hands out its bytes a few at a time, every other poll returning
/// `Pending`, the way a slow peer's stream does. Allocates nothing.
struct Trickle<'a> {
    data: &'a [u8],
    pos: usize,
    pieces: &'a [usize],
    turn: usize,
    stall: bool,
}

impl<'a> Trickle<'a> {
    fn new(data: &'a [u8], pieces: &'a [usize]) -> Self {
        assert!(!pieces.is_empty());
        Self {
            data,
            pos: 0,
            pieces,
            turn: 0,
            stall: false,
        }
    }
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.stall = !this.stall;
        if this.stall {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let piece = this.pieces[this.turn % this.pieces.len()].max(1);
        this.turn += 1;
        let n = piece.min(buf.remaining()).min(this.data.len() - this.pos);
        buf.put_slice(&this.data[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Probe {
    n: u64,
    name: String,
    flag: bool,
}

/// Runs `recv_frame` over `data` on this thread and returns its outcome with
/// the most bytes it held at once.
fn recv_measured(
    rt: &tokio::runtime::Runtime,
    data: &[u8],
    pieces: &[usize],
    frame_len_max: usize,
) -> (Result<Option<Probe>, FrameError>, u64) {
    let mut reader = Trickle::new(data, pieces);
    let mut outcome = None;
    let info = allocation_counter::measure(|| {
        outcome = Some(rt.block_on(recv_frame::<Probe, _>(&mut reader, frame_len_max)));
    });
    (outcome.expect("measured"), info.bytes_max)
}

fn runtime() -> tokio::runtime::Runtime {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // The first `block_on` sets up per-thread state; keep it out of measurements.
    rt.block_on(async {});
    rt
}

#[test]
fn a_peer_announcing_64_mib_and_sending_4_bytes_costs_one_chunk_not_64_mib() {
    let _turn = take_turn();
    let rt = runtime();
    let mut data = (DAEMON_FRAME_LEN_MAX as u32).to_be_bytes().to_vec();
    data.extend([1, 2, 3, 4]);
    let (outcome, peak) = recv_measured(&rt, &data, &[1, 3, 2], DAEMON_FRAME_LEN_MAX);
    assert!(matches!(outcome, Err(FrameError::Truncated)), "{outcome:?}");
    assert!(
        peak <= RECV_CHUNK_LEN_MAX_BYTES as u64 + SLACK_BYTES,
        "held {peak} bytes for 8 bytes received"
    );
}

#[test]
fn a_large_frame_that_arrives_in_full_is_received_and_costs_about_twice_its_size() {
    let _turn = take_turn();
    let rt = runtime();
    let probe = Probe {
        n: 7,
        name: "x".repeat(300 * 1024),
        flag: true,
    };
    let data = encode_frame(&probe, DAEMON_FRAME_LEN_MAX).unwrap();
    let (outcome, peak) = recv_measured(&rt, &data, &[70_000, 1, 5_000], DAEMON_FRAME_LEN_MAX);
    assert_eq!(outcome.unwrap(), Some(probe));
    let supplied = data.len() as u64;
    assert!(
        peak <= 2 * supplied + SLACK_BYTES,
        "held {peak} bytes for {supplied}"
    );
}

/// What a peer sends: garbage, a valid frame possibly cut short, or a
/// header announcing some length followed by whatever.
#[derive(Debug, Clone)]
enum Input {
    Garbage(Vec<u8>),
    Valid { probe: Probe, cut: Option<usize> },
    Announce { len: u32, body: Vec<u8> },
}

const PROP_FRAME_LEN_MAX: usize = 1024 * 1024;

fn probe() -> impl Strategy<Value = Probe> {
    let name_len = prop_oneof![0usize..64, 0usize..8_192, 0usize..300_000];
    (any::<u64>(), name_len, any::<bool>(), any::<u8>()).prop_map(|(n, len, flag, seed)| Probe {
        n,
        name: (0..len)
            .map(|i| char::from(b'a' + ((i as u8).wrapping_add(seed) % 26)))
            .collect(),
        flag,
    })
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..1_024).prop_map(Input::Garbage),
        (probe(), proptest::option::of(any::<prop::sample::Index>())).prop_map(|(probe, cut)| {
            let full = encode_frame(&probe, PROP_FRAME_LEN_MAX).unwrap().len();
            Input::Valid {
                probe,
                cut: cut.map(|i| i.index(full)),
            }
        }),
        (
            0..=PROP_FRAME_LEN_MAX as u32,
            proptest::collection::vec(any::<u8>(), 0..70_000)
        )
            .prop_map(|(len, body)| Input::Announce { len, body }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct("proptest-regressions/memory.txt"),
        )),
        ..ProptestConfig::default()
    })]

    /// Whatever arrives, `recv_frame` neither panics nor holds more than
    /// the bytes supplied plus one chunk while a frame is incomplete (a
    /// complete frame is copied once for decoding), and a whole valid
    /// frame round-trips.
    #[test]
    fn recv_frame_never_panics_and_allocates_as_bytes_arrive(
        input in input(),
        pieces in proptest::collection::vec(1usize..100_000, 1..8),
    ) {
        let _turn = take_turn();
        let rt = runtime();
        let data = match &input {
            Input::Garbage(bytes) => bytes.clone(),
            Input::Valid { probe, cut } => {
                let mut frame = encode_frame(probe, PROP_FRAME_LEN_MAX).unwrap();
                if let Some(cut) = cut {
                    frame.truncate(*cut);
                }
                frame
            }
            Input::Announce { len, body } => {
                let mut frame = len.to_be_bytes().to_vec();
                frame.extend_from_slice(body);
                frame
            }
        };
        let (outcome, peak) = recv_measured(&rt, &data, &pieces, PROP_FRAME_LEN_MAX);
        let supplied = data.len() as u64;
        match &outcome {
            Ok(_) => prop_assert!(
                peak <= 2 * supplied + SLACK_BYTES,
                "held {} bytes after a complete frame of {} bytes", peak, supplied
            ),
            Err(_) => prop_assert!(
                peak <= supplied + RECV_CHUNK_LEN_MAX_BYTES as u64 + SLACK_BYTES,
                "held {} bytes for {} bytes supplied", peak, supplied
            ),
        }
        if let Input::Valid { probe, cut } = &input {
            match cut {
                None => prop_assert_eq!(outcome.as_ref().ok(), Some(&Some(probe.clone()))),
                Some(0) => prop_assert!(matches!(outcome, Ok(None))),
                Some(_) => prop_assert!(
                    matches!(outcome, Err(FrameError::Truncated)),
                    "{:?}", outcome
                ),
            }
        }
        if let Input::Announce { len, body } = &input
            && (*len as usize) > body.len()
        {
            prop_assert!(matches!(outcome, Err(FrameError::Truncated)), "{:?}", outcome);
        }
    }
}

/// A field of `/proc/self/status` in bytes (VmRSS, VmSize).
fn proc_status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line}"));
    kib * 1024
}

/// Reads frames with the daemon's 64 MiB limit, as its swarm handler did,
/// counting the streams it is waiting on.
#[derive(Debug, Clone)]
struct Swallow {
    waiting: Arc<AtomicUsize>,
}

impl ProtocolHandler for Swallow {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((_send, mut recv)) = conn.accept_bi().await else {
            return Ok(());
        };
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let outcome = recv_frame::<Probe, _>(&mut recv, DAEMON_FRAME_LEN_MAX).await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(outcome);
        Ok(())
    }
}

/// Answers one request frame with the same text.
#[derive(Debug, Clone)]
struct Answer;

impl ProtocolHandler for Answer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
            return Ok(());
        };
        if let Ok(Some(text)) = recv_frame::<String, _>(&mut recv, 1024).await {
            let _ = send_frame(&mut send, &text, 1024).await;
            let _ = send.finish();
            let _ = tokio::time::timeout(DIAL, conn.closed()).await;
        }
        Ok(())
    }
}

async fn endpoint() -> Endpoint {
    let endpoint = bind_endpoint(&NetConfig::default(), SecretKey::generate())
        .await
        .unwrap();
    assert!(endpoint.addr().ip_addrs().all(|a| a.ip().is_loopback()));
    endpoint
}

const FLOOD_CONNECTIONS: usize = 200;
const FLOOD_KEYS: usize = 50;

#[test]
fn two_hundred_peers_announcing_64_mib_frames_leave_memory_bounded_and_control_answering() {
    let _turn = take_turn();
    // The turn is a blocking lock, so the runtime lives inside it.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(flood_announcing_64_mib_frames());
}

async fn flood_announcing_64_mib_frames() {
    let operator = endpoint().await;
    let waiting = Arc::new(AtomicUsize::new(0));
    let server = GuardedRouterBuilder::new(endpoint().await)
        .serve(
            ALPN_SWARM,
            Allowlist::open(),
            Swallow {
                waiting: Arc::clone(&waiting),
            },
        )
        .serve(ALPN_CONTROL, Allowlist::only([operator.id()]), Answer)
        .spawn();
    let addr = server.endpoint().addr();
    // The default per-peer cap is 4, so 50 keys bring 200 connections.
    assert_eq!(
        Limits::OPEN.connections_per_peer_max * FLOOD_KEYS,
        FLOOD_CONNECTIONS
    );
    let mut attackers = Vec::new();
    for _ in 0..FLOOD_KEYS {
        attackers.push(endpoint().await);
    }
    let rss_before = proc_status_bytes("VmRSS:");
    let size_before = proc_status_bytes("VmSize:");

    let started = Instant::now();
    let mut held = Vec::new();
    for attacker in &attackers {
        for _ in 0..Limits::OPEN.connections_per_peer_max {
            let conn = connect(attacker, addr.clone(), ALPN_SWARM, DIAL)
                .await
                .unwrap();
            let (mut send, recv) = conn.open_bi().await.unwrap();
            send.write_all(&(DAEMON_FRAME_LEN_MAX as u32).to_be_bytes())
                .await
                .unwrap();
            held.push((conn, send, recv));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting.load(Ordering::SeqCst) < FLOOD_CONNECTIONS {
        assert!(
            Instant::now() < deadline,
            "only {} streams reached the handler",
            waiting.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Let every handler see its header and settle in its read.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let flood_took = started.elapsed();

    let asked = Instant::now();
    let conn = connect(&operator, addr.clone(), ALPN_CONTROL, DIAL)
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send_frame(&mut send, "status?", 1024).await.unwrap();
    send.finish().unwrap();
    let answer: Option<String> = recv_frame(&mut recv, 1024).await.unwrap();
    let answered_in = asked.elapsed();
    conn.close(codes::CLOSE_DONE, b"done");
    assert_eq!(answer.as_deref(), Some("status?"));

    let rss_after = proc_status_bytes("VmRSS:");
    let size_after = proc_status_bytes("VmSize:");
    let rss_growth = rss_after.saturating_sub(rss_before);
    let size_growth = size_after.saturating_sub(size_before);
    eprintln!(
        "flood of {FLOOD_CONNECTIONS} connections from {FLOOD_KEYS} keys took {flood_took:?}; \
         VmRSS {} -> {} MB (+{} MB), VmSize {} -> {} MB (+{} MB); control answered in {answered_in:?}",
        rss_before >> 20,
        rss_after >> 20,
        rss_growth >> 20,
        size_before >> 20,
        size_after >> 20,
        size_growth >> 20,
    );
    assert!(
        rss_growth < 50 << 20,
        "resident size grew by {} MB",
        rss_growth >> 20
    );
    // Untouched pages of an up-front allocation would not show in VmRSS,
    // only in the address space: 200 x 64 MiB is 12.5 GiB of it.
    assert!(
        size_growth < 1 << 30,
        "address space grew by {} MB",
        size_growth >> 20
    );
    assert!(
        answered_in < Duration::from_secs(1),
        "control took {answered_in:?}"
    );

    drop(held);
    for attacker in attackers {
        attacker.close().await;
    }
    operator.close().await;
    server.shutdown().await.unwrap();
}

// The flood above writes a bare `u32` as a header.
const _: () = assert!(FRAME_HEADER_LEN == 4);
