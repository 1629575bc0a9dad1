//! Loopback measurements: connect latency, telemetry throughput, memory per idle subscriber.
//!
//! Not a pass/fail test; it prints numbers. Memory is measured in a server
//! process whose subscribers live in a child process (this same binary,
//! re-run in client mode), so the figure is the server's cost alone.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use iroh::endpoint::Connection;
use iroh::protocol::{AcceptError, ProtocolHandler};
use iroh::{Endpoint, SecretKey};
use serde::{Deserialize, Serialize};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_TELEMETRY, Allowlist, EndpointTicket, GuardedRouterBuilder, Limits,
    NetConfig, bind_endpoint, connect,
};
use swactor_engine::telemetry::{TelemetryConfig, TelemetryFrame, TelemetryPublisher, subscribe};

const CLIENT_ENV: &str = "SWACTOR_BENCH_CLIENT_TICKET";
const COUNT_ENV: &str = "SWACTOR_BENCH_CLIENT_SUBS";
const MODE_ENV: &str = "SWACTOR_BENCH_CLIENT_MODE";
const MEMORY_ENV: &str = "SWACTOR_BENCH_MEMORY";
const FRAME_LEN_MAX: usize = 64 * 1024;
const DIAL: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Event {
    seq: u64,
    node: u32,
    payload: Vec<u8>,
}

#[derive(Debug)]
struct Idle;

impl ProtocolHandler for Idle {
    async fn accept(&self, connection: Connection) -> Result<(), AcceptError> {
        connection.closed().await;
        Ok(())
    }
}

async fn endpoint() -> Endpoint {
    bind_endpoint(&NetConfig::default(), SecretKey::generate())
        .await
        .expect("bind loopback endpoint")
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// Caps far above what a measurement opens: each client process holds
/// hundreds of connections under one key, which the default per-peer cap
/// exists to refuse.
const UNCAPPED: Limits = Limits {
    connections_max: 10_000,
    connections_per_peer_max: 10_000,
    ..Limits::OPEN
};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

async fn connect_latency() {
    let router = GuardedRouterBuilder::new(endpoint().await)
        .serve_with_limits(ALPN_CONTROL, Allowlist::open(), UNCAPPED, Idle)
        .spawn();
    let addr = router.endpoint().addr();
    let client = endpoint().await;
    let first = Instant::now();
    connect(&client, addr.clone(), ALPN_CONTROL, DIAL)
        .await
        .expect("first connect")
        .close(0u32.into(), b"");
    let first = first.elapsed();
    let mut samples = Vec::new();
    for _ in 0..55 {
        let started = Instant::now();
        let conn = connect(&client, addr.clone(), ALPN_CONTROL, DIAL)
            .await
            .expect("connect");
        samples.push(started.elapsed());
        conn.close(0u32.into(), b"");
    }
    samples.drain(..5); // warm-up
    samples.sort();
    println!(
        "connect latency (loopback, {} connects): median {:?}, p90 {:?}, min {:?}, max {:?}; very first {:?}",
        samples.len(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        samples[0],
        samples[samples.len() - 1],
        first
    );
    client.close().await;
    router.shutdown().await.expect("router shutdown");
}

async fn throughput(events: u64, payload_len: usize) {
    let publisher: TelemetryPublisher<u64, Event> = TelemetryPublisher::new(
        TelemetryConfig {
            buffer_len_max: usize::try_from(events).unwrap() + 16,
            ..TelemetryConfig::default()
        },
        &0,
    )
    .expect("publisher");
    let router = GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_TELEMETRY, Allowlist::open(), publisher.handler())
        .spawn();
    let client = endpoint().await;
    let mut sub = subscribe::<u64, Event>(&client, router.endpoint().addr(), DIAL, FRAME_LEN_MAX)
        .await
        .expect("subscribe");
    assert!(matches!(
        sub.next().await,
        Ok(Some(TelemetryFrame::Snapshot { .. }))
    ));
    let reader = tokio::spawn(async move {
        let mut last = 0;
        while last < events {
            match sub.next().await.expect("frame") {
                Some(TelemetryFrame::Event { seq, .. }) => last = seq,
                other => panic!("unexpected {other:?}"),
            }
        }
        Instant::now()
    });
    let started = Instant::now();
    for seq in 1..=events {
        publisher
            .publish(&Event {
                seq,
                node: 7,
                payload: vec![0xab; payload_len],
            })
            .expect("publish");
    }
    let published = started.elapsed();
    let done = reader.await.expect("reader");
    let elapsed = done - started;
    println!(
        "telemetry, one stream, {events} events of {payload_len} B payload: {:.0} frames/s end to end ({elapsed:?}); publish() alone {:.0} ns/event",
        events as f64 / elapsed.as_secs_f64(),
        published.as_nanos() as f64 / events as f64
    );
    client.close().await;
    router.shutdown().await.expect("router shutdown");
}

/// Server RSS growth per connected client, for telemetry subscribers or
/// (for comparison) bare idle connections on another protocol.
async fn memory_per_client(telemetry: bool) {
    let publisher: TelemetryPublisher<u64, Event> = TelemetryPublisher::new(
        TelemetryConfig {
            subscribers_max: 10_000,
            ..TelemetryConfig::default()
        },
        &0,
    )
    .expect("publisher");
    let router = GuardedRouterBuilder::new(endpoint().await)
        .serve_with_limits(
            ALPN_TELEMETRY,
            Allowlist::open(),
            UNCAPPED,
            publisher.handler(),
        )
        .serve_with_limits(ALPN_CONTROL, Allowlist::open(), UNCAPPED, Idle)
        .spawn();
    let ticket = EndpointTicket::new(router.endpoint().addr()).to_string();
    let mode = if telemetry { "telemetry" } else { "idle" };
    let spawn_clients = |count: usize| {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .env(CLIENT_ENV, &ticket)
            .env(COUNT_ENV, count.to_string())
            .env(MODE_ENV, mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("client process");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("ready line");
        assert_eq!(line.trim(), "ready", "client process failed");
        child
    };
    let settle = async |expected: usize| {
        if telemetry {
            while publisher.subscriber_count() < expected {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        rss_bytes()
    };
    let base_count = 50;
    let extra = 500;
    let first = tokio::task::block_in_place(|| spawn_clients(base_count));
    let rss_base = settle(base_count).await;
    let second = tokio::task::block_in_place(|| spawn_clients(extra));
    let rss_more = settle(base_count + extra).await;
    let per = rss_more.saturating_sub(rss_base) / extra as u64;
    let what = if telemetry {
        "idle telemetry subscriber"
    } else {
        "bare idle connection (for comparison)"
    };
    println!(
        "memory per {what} (server process RSS, {base_count} -> {} clients): ~{:.1} KiB each ({:.1} MiB -> {:.1} MiB)",
        base_count + extra,
        per as f64 / 1024.0,
        rss_base as f64 / 1048576.0,
        rss_more as f64 / 1048576.0
    );
    for mut child in [first, second] {
        drop(child.stdin.take()); // tells the client process to finish
        let _ = child.wait();
    }
    router.shutdown().await.expect("router shutdown");
}

async fn client_mode(ticket: &str, count: usize, telemetry: bool) {
    let ticket: EndpointTicket = ticket.parse().expect("ticket");
    let client = endpoint().await;
    let mut subs = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..count {
        if telemetry {
            let mut sub = subscribe::<u64, Event>(&client, ticket.clone(), DIAL, FRAME_LEN_MAX)
                .await
                .expect("subscribe");
            sub.next().await.expect("snapshot");
            subs.push(sub);
        } else {
            let conn = connect(&client, ticket.clone(), ALPN_CONTROL, DIAL)
                .await
                .expect("connect");
            conns.push(conn);
        }
    }
    println!("ready");
    std::io::stdout().flush().expect("flush");
    tokio::task::block_in_place(|| {
        let mut rest = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut rest);
    });
    drop(subs);
    drop(conns);
    client.close().await;
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if let Ok(ticket) = std::env::var(CLIENT_ENV) {
        let count = std::env::var(COUNT_ENV)
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(1);
        let telemetry = std::env::var(MODE_ENV).as_deref() != Ok("idle");
        runtime.block_on(client_mode(&ticket, count, telemetry));
        return;
    }
    if let Ok(mode) = std::env::var(MEMORY_ENV) {
        runtime.block_on(memory_per_client(mode == "telemetry"));
        return;
    }
    // `cargo bench` passes filter arguments such as `--bench`; ignore them.
    runtime.block_on(async {
        connect_latency().await;
        throughput(200_000, 16).await;
        throughput(20_000, 1024).await;
    });
    // Each memory figure comes from a fresh process, so memory freed by an
    // earlier measurement cannot be reused and hide growth.
    for mode in ["telemetry", "idle"] {
        let status = Command::new(std::env::current_exe().expect("own path"))
            .env(MEMORY_ENV, mode)
            .status()
            .expect("memory measurement process");
        assert!(status.success(), "memory measurement {mode} failed");
    }
}
