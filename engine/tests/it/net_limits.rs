//! Hostile peers on loopback: connection caps, the first-frame deadline and
//! limit, stream caps, and refusals that do not flood the log.

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use iroh::endpoint::{Connection, VarInt};
use iroh::protocol::{AcceptError, ProtocolHandler, Router};
use iroh::{Endpoint, EndpointAddr};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, Allowlist, FIRST_FRAME_LEN_MAX_BYTES, GuardedRouterBuilder,
    HANDSHAKE_DEADLINE, Limits, NetConfig, accept_first_frame, codes, connect, peer_close_code,
    recv_frame, send_frame,
};

use crate::net::{endpoint, endpoint_with};
use crate::within;

const DIAL: Duration = Duration::from_secs(5);
const FRAME_LEN_MAX: usize = 1024;

/// Reads a greeting as a stranger's first frame (small limit, deadline),
/// answers it, and stays connected until the peer leaves, holding its slot.
#[derive(Debug, Clone)]
struct Greeter {
    deadline: Duration,
}

impl ProtocolHandler for Greeter {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((mut send, _recv, hello)) =
            accept_first_frame::<String>(&conn, FIRST_FRAME_LEN_MAX_BYTES, self.deadline).await
        else {
            // The connection is closed already; strangers cause this, so no log.
            return Ok(());
        };
        if send_frame(&mut send, &hello, FRAME_LEN_MAX).await.is_ok() {
            let _ = send.finish();
            conn.closed().await;
        }
        Ok(())
    }
}

fn greeter() -> Greeter {
    Greeter {
        deadline: HANDSHAKE_DEADLINE,
    }
}

/// Greets on a fresh stream: the answer, or the code the server closed the
/// connection with.
async fn greet(conn: &Connection, text: &str) -> Result<String, Option<VarInt>> {
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.ok()?;
        send_frame(&mut send, text, FRAME_LEN_MAX).await.ok()?;
        recv_frame::<String, _>(&mut recv, FRAME_LEN_MAX)
            .await
            .ok()
            .flatten()
    };
    match tokio::time::timeout(DIAL, exchange).await {
        Ok(Some(answer)) => Ok(answer),
        _ => {
            let closed = within(DIAL, "close", conn.closed()).await;
            Err(peer_close_code(&closed))
        }
    }
}

async fn dial_and_greet(
    client: &Endpoint,
    addr: &EndpointAddr,
    alpn: &[u8],
) -> (Connection, Result<String, Option<VarInt>>) {
    let conn = connect(client, addr.clone(), alpn, DIAL).await.unwrap();
    let outcome = greet(&conn, "hi").await;
    (conn, outcome)
}

async fn capped_server(limits: Limits) -> Router {
    GuardedRouterBuilder::new(endpoint().await)
        .serve_with_limits(ALPN_SWARM, Allowlist::open(), limits, greeter())
        .serve(ALPN_CONTROL, Allowlist::open(), greeter())
        .spawn()
}

#[tokio::test]
async fn connections_over_the_per_peer_cap_are_refused_and_a_freed_slot_is_reused() {
    let limits = Limits {
        connections_max: 16,
        connections_per_peer_max: 4,
        ..Limits::OPEN
    };
    let server = capped_server(limits).await;
    let addr = server.endpoint().addr();
    let client = endpoint().await;

    let mut held = Vec::new();
    for _ in 0..4 {
        let (conn, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
        assert_eq!(outcome.as_deref(), Ok("hi"));
        held.push(conn);
    }
    for _ in 0..2 {
        let (conn, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
        assert_eq!(outcome, Err(Some(codes::CLOSE_BUSY)));
        let reason = conn.close_reason().unwrap().to_string();
        assert!(reason.contains("from this peer"), "{reason}");
    }
    // Another peer is within both caps.
    let other = endpoint().await;
    let (_kept, outcome) = dial_and_greet(&other, &addr, ALPN_SWARM).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));

    // A connection that leaves frees its slot once the server sees it go.
    held.pop().unwrap().close(codes::CLOSE_DONE, b"bye");
    let started = Instant::now();
    loop {
        let (conn, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
        if outcome.is_ok() {
            held.push(conn);
            break;
        }
        assert!(started.elapsed() < DIAL, "the slot was never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.close().await;
    other.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn connections_over_the_total_cap_from_many_keys_are_refused() {
    let limits = Limits {
        connections_max: 6,
        connections_per_peer_max: 4,
        ..Limits::OPEN
    };
    let server = capped_server(limits).await;
    let addr = server.endpoint().addr();

    let mut clients = Vec::new();
    let mut held = Vec::new();
    for _ in 0..3 {
        let client = endpoint().await;
        for _ in 0..2 {
            let (conn, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
            assert_eq!(outcome.as_deref(), Ok("hi"));
            held.push(conn);
        }
        clients.push(client);
    }
    let late = endpoint().await;
    let (conn, outcome) = dial_and_greet(&late, &addr, ALPN_SWARM).await;
    assert_eq!(outcome, Err(Some(codes::CLOSE_BUSY)));
    let reason = conn.close_reason().unwrap().to_string();
    assert!(reason.contains("on this protocol"), "{reason}");

    // The caps are per protocol: the same peer is served on another one.
    let (_control, outcome) = dial_and_greet(&late, &addr, ALPN_CONTROL).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));

    for client in clients {
        client.close().await;
    }
    late.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_silent_peer_is_dropped_at_the_handshake_deadline() {
    let deadline = Duration::from_millis(300);
    let server = GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_SWARM, Allowlist::open(), Greeter { deadline })
        .spawn();
    let addr = server.endpoint().addr();
    let client = endpoint().await;

    // Connects and opens nothing.
    let silent = connect(&client, addr.clone(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    // Opens a stream and sends half a header.
    let mumbling = connect(&client, addr.clone(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    let (mut send, _recv) = mumbling.open_bi().await.unwrap();
    send.write_all(&[0, 0]).await.unwrap();
    let started = Instant::now();

    for conn in [&silent, &mumbling] {
        let closed = within(deadline + DIAL, "the deadline", conn.closed()).await;
        assert_eq!(
            peer_close_code(&closed),
            Some(codes::CLOSE_HANDSHAKE_TIMEOUT),
            "{closed}"
        );
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < deadline + Duration::from_secs(1),
        "dropped after {elapsed:?}"
    );

    // A prompt peer is served meanwhile.
    let (_conn, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));
    client.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_first_frame_over_the_small_limit_is_refused_at_once() {
    let server = GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_SWARM, Allowlist::open(), greeter())
        .spawn();
    let client = endpoint().await;
    let conn = connect(&client, server.endpoint().addr(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    let announced = u32::try_from(FIRST_FRAME_LEN_MAX_BYTES + 1).unwrap();
    send.write_all(&announced.to_be_bytes()).await.unwrap();
    let closed = within(Duration::from_secs(1), "refusal", conn.closed()).await;
    assert_eq!(
        peer_close_code(&closed),
        Some(codes::STREAM_FRAME_TOO_LARGE),
        "{closed}"
    );
    client.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_peer_cannot_open_more_streams_than_the_endpoint_allows_nor_send_datagrams() {
    let config = NetConfig {
        incoming_bidi_streams_max: Some(1),
        incoming_uni_streams_max: Some(0),
        ..NetConfig::default()
    };
    let server = GuardedRouterBuilder::new(endpoint_with(&config).await)
        .serve(ALPN_SWARM, Allowlist::open(), greeter())
        .spawn();
    let client = endpoint().await;
    let conn = connect(&client, server.endpoint().addr(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    let (mut first, _first_recv) = conn.open_bi().await.unwrap();
    first.write_all(&[0]).await.unwrap();
    let second = tokio::time::timeout(Duration::from_millis(300), conn.open_bi()).await;
    assert!(second.is_err(), "a second bidirectional stream was allowed");
    let uni = tokio::time::timeout(Duration::from_millis(300), conn.open_uni()).await;
    assert!(uni.is_err(), "a unidirectional stream was allowed");
    // Datagrams are off on every engine endpoint: nothing would read them.
    assert_eq!(conn.max_datagram_size(), None);
    client.close().await;
    server.shutdown().await.unwrap();
}

/// Log output shared with the test: a `MakeWriter` appending to a buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Self;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    /// Captures what this thread logs at INFO and above until the guard
    /// drops (a test's runtime has one thread, so every task of its server
    /// logs here).
    fn start() -> (Self, tracing::subscriber::DefaultGuard) {
        let captured = Self::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        let guard = tracing::subscriber::set_default(subscriber);
        (captured, guard)
    }

    fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

/// The refusals a log line accounts for: one for a line about a single
/// refusal, the count of a summary.
fn refusals_in(line: &str) -> u64 {
    if line.contains("refusing connection") {
        return 1;
    }
    let Some(rest) = line.split("refused ").nth(1) else {
        return 0;
    };
    rest.split_whitespace()
        .next()
        .and_then(|n| n.replace(',', "").parse().ok())
        .unwrap_or(0)
}

const REFUSALS: usize = 1_000;

#[tokio::test]
async fn a_thousand_refusals_log_fewer_than_twenty_lines() {
    let (captured, _logging) = Captured::start();

    // Long enough that a slow machine (a refusal is a full handshake, about
    // 10 ms here in a debug build) stays far below 20 summaries.
    let interval = Duration::from_secs(3);
    let server = GuardedRouterBuilder::new(endpoint().await)
        .serve_with_limits(
            ALPN_CONTROL,
            Allowlist::closed(),
            Limits {
                refusal_log_interval: interval,
                ..Limits::ALLOWLISTED
            },
            greeter(),
        )
        .spawn();
    let addr = server.endpoint().addr();
    let client = endpoint().await;

    let started = Instant::now();
    let refused = futures_util::stream::iter(0..REFUSALS)
        .map(|_| async {
            let conn = connect(&client, addr.clone(), ALPN_CONTROL, DIAL)
                .await
                .unwrap();
            let closed = within(DIAL, "refusal", conn.closed()).await;
            peer_close_code(&closed) == Some(codes::CLOSE_NOT_ALLOWED)
        })
        .buffer_unordered(16)
        .filter(|refused| std::future::ready(*refused))
        .count()
        .await;
    let took = started.elapsed();
    assert_eq!(refused, REFUSALS);
    // The last summary comes at most one interval after the last refusal.
    tokio::time::sleep(interval + Duration::from_millis(500)).await;

    let lines = captured.lines();
    eprintln!(
        "{REFUSALS} refusals in {took:?} logged {} lines:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(lines.len() < 20, "{} lines", lines.len());
    let accounted: u64 = lines.iter().map(|l| refusals_in(l)).sum();
    assert_eq!(accounted, REFUSALS as u64, "every refusal is counted once");
    client.close().await;
    server.shutdown().await.unwrap();
}

/// Issue 29, item 4: the workspace blobs were served under the allowlisted
/// cap of 64 connections, so a workspace reached 64 nodes at once and the
/// rest failed. A protocol whose allowlist holds linked agents serves every
/// one of them.
#[tokio::test]
async fn every_peer_on_a_linked_allowlist_is_served_at_once() {
    const PEERS: usize = 80;
    let clients: Vec<Endpoint> =
        futures_util::future::join_all((0..PEERS).map(|_| endpoint())).await;
    let allowlist = Allowlist::closed();
    for c in &clients {
        allowlist.allow(c.id());
    }
    for (limits, served) in [(Limits::LINKED, PEERS), (Limits::ALLOWLISTED, 64)] {
        let server = GuardedRouterBuilder::new(endpoint().await)
            .serve_with_limits(ALPN_SWARM, allowlist.clone(), limits, greeter())
            .spawn();
        let addr = server.endpoint().addr();
        let mut held = Vec::new();
        let mut greeted = 0;
        for c in &clients {
            let (conn, outcome) = dial_and_greet(c, &addr, ALPN_SWARM).await;
            match outcome {
                Ok(_) => greeted += 1,
                Err(code) => assert_eq!(code, Some(codes::CLOSE_BUSY)),
            }
            held.push(conn);
        }
        assert_eq!(greeted, served, "{limits:?}");
        for conn in held {
            conn.close(codes::CLOSE_DONE, b"bye");
        }
        server.shutdown().await.unwrap();
    }
    for c in clients {
        c.close().await;
    }
}

/// Issue 29, item 1: a flood of connection attempts buys the server a
/// handshake each. Past the endpoint's handshake rate an attempt is refused
/// before its handshake; a connection made earlier is served throughout,
/// and the rate refills; a protocol with a budget of its own is served.
#[tokio::test]
async fn attempts_past_the_handshake_rate_are_refused_before_the_handshake() {
    use swactor_engine::net::HandshakeRate;
    let (captured, _logging) = Captured::start();

    let rate = HandshakeRate {
        per_second: 2,
        burst: 6,
    };
    let server = GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_SWARM, Allowlist::open(), greeter())
        .serve(ALPN_CONTROL, Allowlist::open(), greeter())
        .handshake_rate(Some(&[ALPN_CONTROL]), rate)
        .handshake_rate(None, rate)
        .spawn();
    let addr = server.endpoint().addr();
    let client = endpoint().await;
    let (kept, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));

    // 40 attempts at once, from new keys: the burst's 5 left (one went to
    // `kept`), and at most what a second or two refills.
    let started = Instant::now();
    let dialers: Vec<Endpoint> = futures_util::future::join_all((0..40).map(|_| endpoint())).await;
    let outcomes = futures_util::future::join_all(
        dialers
            .iter()
            .map(|ep| connect(ep, addr.clone(), ALPN_SWARM, DIAL)),
    )
    .await;
    let took = started.elapsed();
    let made = outcomes.iter().filter(|o| o.is_ok()).count();
    let refused: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().err().map(|e| swactor_engine::error_chain(e)))
        .collect();
    eprintln!(
        "{made} of 40 made in {took:?}; first refusal: {:?}",
        refused.first()
    );
    let refill = usize::try_from(took.as_secs() + 1).unwrap() * 2;
    assert!(
        (5..=5 + refill).contains(&made),
        "{made} handshakes made in {took:?}"
    );
    assert!(
        refused.iter().all(|e| e.to_lowercase().contains("refused")),
        "{refused:?}"
    );
    // The connection made before the flood is untouched, and a protocol
    // with a budget of its own is still served.
    assert!(kept.close_reason().is_none(), "{:?}", kept.close_reason());
    let (_control, outcome) = dial_and_greet(&client, &addr, ALPN_CONTROL).await;
    assert_eq!(
        outcome.as_deref(),
        Ok("hi"),
        "the flood took the CLI's budget"
    );

    // The rate refills: a second later, an attempt is made again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let (_again, outcome) = dial_and_greet(&client, &addr, ALPN_SWARM).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));

    // The refusals are logged once, then summed up.
    tokio::time::sleep(swactor_engine::net::REFUSAL_LOG_INTERVAL + Duration::from_millis(500))
        .await;
    let lines = captured.lines();
    assert!(lines.len() < 5, "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("over the handshake rate")),
        "{lines:#?}"
    );
    for ep in dialers {
        ep.close().await;
    }
    client.close().await;
    server.shutdown().await.unwrap();
}

/// A loopback UDP relay for one client in front of `server`: it passes the
/// client's packets only until the server first answers, and every packet
/// of the server's. The client's handshake starts and never finishes, as
/// when a peer gives up or never sends its last flight.
async fn stalling_relay(server: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{Ipv4Addr, SocketAddr};
    let socket = tokio::net::UdpSocket::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        let (mut client, mut answered) = (None, false);
        while let Ok((len, from)) = socket.recv_from(&mut buf).await {
            if from == server {
                answered = true;
                if let Some(client) = client {
                    let _ = socket.send_to(&buf[..len], client).await;
                }
            } else {
                client = Some(from);
                if !answered {
                    let _ = socket.send_to(&buf[..len], server).await;
                }
            }
        }
    });
    addr
}

/// Issue 29: a handshake its peer abandons is dropped at the router's
/// finish deadline, not kept until QUIC's idle timeout (30 s here), so a
/// flood's abandoned attempts do not pile up; other peers are served.
#[tokio::test]
async fn a_handshake_left_unfinished_is_dropped_at_the_deadline() {
    use std::net::IpAddr;
    use swactor_engine::net::HANDSHAKE_FINISH_DEADLINE;
    // No dialler of ours waits longer than the default deadline gives.
    assert!(HANDSHAKE_FINISH_DEADLINE >= NetConfig::default().connect_timeout);

    let deadline = Duration::from_millis(1_500);
    let builder = GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_SWARM, Allowlist::open(), greeter())
        .handshake_deadline(deadline);
    let under_way = builder.handshakes_under_way();
    let server = builder.spawn();
    let addr = server.endpoint().addr();
    let direct = *addr
        .ip_addrs()
        .find(|a| a.ip() == IpAddr::from(std::net::Ipv4Addr::LOCALHOST))
        .expect("the server listens on 127.0.0.1");
    let relay = stalling_relay(direct).await;

    let client = endpoint().await;
    let stalled = tokio::spawn({
        let client = client.clone();
        let via_relay = EndpointAddr::new(addr.id).with_ip_addr(relay);
        async move { connect(&client, via_relay, ALPN_SWARM, Duration::from_secs(20)).await }
    });
    crate::eventually(DIAL, "the stalled handshake to start", || {
        under_way.get() == 1
    })
    .await;
    let started = Instant::now();
    // Another peer is served meanwhile.
    let other = endpoint().await;
    let (_conn, outcome) = dial_and_greet(&other, &addr, ALPN_SWARM).await;
    assert_eq!(outcome.as_deref(), Ok("hi"));
    assert_eq!(
        under_way.get(),
        1,
        "only the stalled handshake is under way"
    );

    crate::eventually(
        deadline + Duration::from_secs(3),
        "the stalled handshake to be dropped",
        || under_way.get() == 0,
    )
    .await;
    let dropped_after = started.elapsed();
    eprintln!("the stalled handshake was dropped {dropped_after:?} after it was seen");
    assert!(dropped_after <= deadline + Duration::from_secs(1));
    stalled.abort();
    client.close().await;
    other.close().await;
    server.shutdown().await.unwrap();
}
