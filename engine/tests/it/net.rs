//! Endpoints on loopback: ALPN routing, frames, allowlists, dial timeouts, identity and tickets.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use iroh::endpoint::{Connection, ReadError, ReadToEndError};
use iroh::protocol::{AcceptError, ProtocolHandler, Router};
use iroh::{Endpoint, EndpointAddr, SecretKey};
use serde::{Deserialize, Serialize};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, ALPN_TELEMETRY, Allowlist, DialError, EndpointTicket,
    GuardedRouterBuilder, NetConfig, TicketError, bind_endpoint, codes, connect,
    load_or_create_secret_key, peer_close_code, recv_frame, reset_stream, send_frame,
};

const FRAME_LEN_MAX: usize = 1024;
const DIAL: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Ping {
    text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Pong {
    alpn: String,
    text: String,
}

/// Answers every frame on every stream with a `Pong` naming its protocol;
/// a bad frame resets only the stream it came on.
#[derive(Debug, Clone)]
struct Echo {
    alpn: &'static [u8],
}

impl ProtocolHandler for Echo {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let alpn = String::from_utf8_lossy(self.alpn).into_owned();
            tokio::spawn(async move {
                loop {
                    match recv_frame::<Ping, _>(&mut recv, FRAME_LEN_MAX).await {
                        Ok(Some(ping)) => {
                            let pong = Pong {
                                alpn: alpn.clone(),
                                text: ping.text,
                            };
                            if send_frame(&mut send, &pong, FRAME_LEN_MAX).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => {
                            let _ = send.finish();
                            return;
                        }
                        Err(error) => {
                            reset_stream(&mut send, &mut recv, error.stream_code());
                            return;
                        }
                    }
                }
            });
        }
        Ok(())
    }
}

pub(crate) async fn endpoint() -> Endpoint {
    endpoint_with(&NetConfig::default()).await
}

pub(crate) async fn endpoint_with(config: &NetConfig) -> Endpoint {
    let endpoint = bind_endpoint(config, SecretKey::generate()).await.unwrap();
    // Guard the machine rule: tests only ever bind (and so advertise) loopback.
    assert!(endpoint.addr().ip_addrs().all(|a| a.ip().is_loopback()));
    endpoint
}

async fn echo_server(control: Allowlist) -> Router {
    GuardedRouterBuilder::new(endpoint().await)
        .serve(ALPN_SWARM, Allowlist::open(), Echo { alpn: ALPN_SWARM })
        .serve(ALPN_CONTROL, control, Echo { alpn: ALPN_CONTROL })
        .serve(
            ALPN_TELEMETRY,
            Allowlist::open(),
            Echo {
                alpn: ALPN_TELEMETRY,
            },
        )
        .spawn()
}

async fn ping(conn: &Connection, text: &str) -> Result<Pong, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let ping = Ping { text: text.into() };
    send_frame(&mut send, &ping, FRAME_LEN_MAX)
        .await
        .map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    recv_frame::<Pong, _>(&mut recv, FRAME_LEN_MAX)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "stream ended".to_string())
}

#[tokio::test]
async fn two_endpoints_exchange_frames_on_each_protocol() {
    let server = echo_server(Allowlist::open()).await;
    let client = endpoint().await;
    for alpn in [ALPN_SWARM, ALPN_CONTROL, ALPN_TELEMETRY] {
        let conn = connect(&client, server.endpoint().addr(), alpn, DIAL)
            .await
            .unwrap();
        let pong = ping(&conn, "hello").await.unwrap();
        assert_eq!(pong.alpn.as_bytes(), alpn);
        assert_eq!(pong.text, "hello");
        conn.close(codes::CLOSE_DONE, b"done");
    }
    client.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_unknown_protocol_is_refused() {
    let server = echo_server(Allowlist::open()).await;
    let client = endpoint().await;
    let err = connect(&client, server.endpoint().addr(), b"swactor/nope/0", DIAL)
        .await
        .unwrap_err();
    assert!(matches!(err, DialError::Failed { .. }), "{err}");
    // The endpoint is unharmed.
    let conn = connect(&client, server.endpoint().addr(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    ping(&conn, "still here").await.unwrap();
    client.close().await;
    server.shutdown().await.unwrap();
}

async fn reset_code_after_sending(conn: &Connection, bytes: &[u8]) -> Option<u64> {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    // The server may stop our send side before we finish; that's expected.
    let _ = send.write_all(bytes).await;
    let _ = send.finish();
    match recv.read_to_end(FRAME_LEN_MAX).await {
        Err(ReadToEndError::Read(ReadError::Reset(code))) => Some(code.into_inner()),
        _ => None,
    }
}

#[tokio::test]
async fn an_oversized_or_garbage_frame_resets_only_its_stream() {
    let server = echo_server(Allowlist::open()).await;
    let client = endpoint().await;
    let conn = connect(&client, server.endpoint().addr(), ALPN_SWARM, DIAL)
        .await
        .unwrap();

    let oversized = (FRAME_LEN_MAX as u32 + 1).to_be_bytes();
    assert_eq!(
        reset_code_after_sending(&conn, &oversized).await,
        Some(codes::STREAM_FRAME_TOO_LARGE.into_inner())
    );
    let mut garbage = 4u32.to_be_bytes().to_vec();
    garbage.extend([0xff, 0xff, 0xff, 0xff]);
    assert_eq!(
        reset_code_after_sending(&conn, &garbage).await,
        Some(codes::STREAM_BAD_FRAME.into_inner())
    );

    // Same connection, new stream: served.
    assert_eq!(ping(&conn, "again").await.unwrap().text, "again");
    // New connection: served.
    let other = connect(&client, server.endpoint().addr(), ALPN_CONTROL, DIAL)
        .await
        .unwrap();
    assert_eq!(ping(&other, "fresh").await.unwrap().text, "fresh");
    client.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_peer_missing_from_a_protocols_allowlist_is_closed_with_a_clear_code() {
    let control = Allowlist::only([SecretKey::generate().public()]);
    let server = echo_server(control.clone()).await;
    let client = endpoint().await;
    let addr = server.endpoint().addr();

    let conn = connect(&client, addr.clone(), ALPN_CONTROL, DIAL)
        .await
        .unwrap();
    let closed = crate::within(DIAL, "refusal", conn.closed()).await;
    assert_eq!(
        peer_close_code(&closed),
        Some(codes::CLOSE_NOT_ALLOWED),
        "{closed}"
    );
    assert!(closed.to_string().contains("allowlist"), "{closed}");

    // The open swarm protocol serves the same peer meanwhile.
    let swarm = connect(&client, addr.clone(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    ping(&swarm, "joined").await.unwrap();

    // Once allowed, control works too.
    control.allow(client.id());
    let conn = connect(&client, addr, ALPN_CONTROL, DIAL).await.unwrap();
    assert_eq!(
        ping(&conn, "now").await.unwrap().alpn.as_bytes(),
        ALPN_CONTROL
    );
    client.close().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_dial_to_a_dead_address_fails_within_the_timeout() {
    // A loopback port with nobody behind it.
    let port = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = EndpointAddr::new(SecretKey::generate().public())
        .with_ip_addr(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    let client = endpoint().await;
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = connect(&client, dead, ALPN_CONTROL, timeout)
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        elapsed < timeout + Duration::from_millis(400),
        "took {elapsed:?}"
    );
    assert!(
        matches!(err, DialError::TimedOut { .. } | DialError::Failed { .. }),
        "{err}"
    );
    client.close().await;
}

#[tokio::test]
async fn an_endpoint_keeps_its_identity_across_restarts_from_its_key_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoint.key");
    let config = NetConfig::default();
    let first = bind_endpoint(&config, load_or_create_secret_key(&path).unwrap())
        .await
        .unwrap();
    let id = first.id();
    first.close().await;
    let second = bind_endpoint(&config, load_or_create_secret_key(&path).unwrap())
        .await
        .unwrap();
    assert_eq!(second.id(), id);
    second.close().await;
}

#[tokio::test]
async fn a_ticket_round_trips_and_can_be_dialled() {
    let server = echo_server(Allowlist::open()).await;
    let ticket = EndpointTicket::new(server.endpoint().addr());
    let text = ticket.to_string();
    assert!(text.starts_with("swactor1"), "{text}");
    let parsed: EndpointTicket = text.parse().unwrap();
    assert_eq!(parsed, ticket);
    let shouted: EndpointTicket = text.to_uppercase().parse().unwrap();
    assert_eq!(shouted, ticket);

    let client = endpoint().await;
    let conn = connect(&client, parsed.into_addr(), ALPN_SWARM, DIAL)
        .await
        .unwrap();
    ping(&conn, "via ticket").await.unwrap();
    client.close().await;
    server.shutdown().await.unwrap();
}

#[test]
fn malformed_tickets_say_what_is_wrong() {
    let id = SecretKey::generate().public();
    let cases: [(String, &str); 6] = [
        ("   ".into(), "ticket is empty"),
        (
            "hello-world".into(),
            "must start with `swactor1`, found `hello-wo`",
        ),
        ("swactor1!!!!".into(), "not valid base32"),
        ("swactor1aaaa".into(), "does not hold an endpoint address"),
        (
            EndpointTicket::new(EndpointAddr::new(id)).to_string(),
            "has no address to dial",
        ),
        (format!("swactor1{}", "a".repeat(5000)), "at most 4096"),
    ];
    for (input, expected) in cases {
        let err = input.parse::<EndpointTicket>().unwrap_err();
        assert!(err.to_string().contains(expected), "{input:.20}: {err}");
    }
    let truncated = {
        let full = EndpointTicket::new(
            EndpointAddr::new(id).with_ip_addr(SocketAddr::from((Ipv4Addr::LOCALHOST, 9))),
        )
        .to_string();
        full[..full.len() - 8].to_string()
    };
    assert!(matches!(
        truncated.parse::<EndpointTicket>(),
        Err(TicketError::Payload { .. } | TicketError::Base32 { .. })
    ));
}

#[test]
fn invalid_net_configs_are_rejected() {
    let mut config = NetConfig::default();
    assert!(config.validate().is_ok());
    config.frame_len_max = 0;
    assert!(config.validate().is_err());
    config = NetConfig {
        connect_timeout: Duration::ZERO,
        ..NetConfig::default()
    };
    assert!(config.validate().is_err());
}
