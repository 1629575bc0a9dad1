//! iroh networking: endpoint construction, identity, tickets, ALPNs, frames, allowlists, dialing.

mod allowlist;
mod frame;
mod handshake;
mod key;
mod limits;
mod rate;
mod ticket;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use iroh::endpoint::{
    Connection, ConnectionError, IdleTimeout, NetReportConfig, PortmapperConfig,
    QuicTransportConfig, VarInt, presets,
};
use iroh::{Endpoint, EndpointAddr, RelayMode, SecretKey};

pub use allowlist::{
    Allowlist, GuardedRouterBuilder, HANDSHAKE_FINISH_DEADLINE, HandshakeTooSlow, NotAllowed,
};
pub use frame::{
    FRAME_HEADER_LEN, FrameError, RECV_CHUNK_LEN_MAX_BYTES, RECV_FIRST_CHUNK_LEN_BYTES,
    encode_frame, recv_frame, reset_stream, send_frame,
};
pub use handshake::{
    FIRST_FRAME_LEN_MAX_BYTES, FirstFrameError, HANDSHAKE_DEADLINE, accept_first_frame,
    recv_first_frame,
};
pub use key::{KeyFileError, load_or_create_secret_key};
pub use limits::{ConnectionCap, Limits, LimitsError, PreAuth, PreAuthSlot, REFUSAL_LOG_INTERVAL};
pub use rate::HandshakeRate;
pub use ticket::{EndpointTicket, TICKET_LEN_MAX, TICKET_PREFIX, TicketError};

/// ALPN of the swarm protocol (joins, membership, work).
pub const ALPN_SWARM: &[u8] = b"swactor/swarm/0";
/// ALPN of the control protocol (CLI commands to a daemon).
pub const ALPN_CONTROL: &[u8] = b"swactor/control/0";
/// ALPN of the telemetry protocol (snapshot plus event stream).
pub const ALPN_TELEMETRY: &[u8] = b"swactor/telemetry/0";

/// Application error codes used when closing connections and resetting streams.
pub mod codes {
    use iroh::endpoint::VarInt;

    /// Normal close: the conversation is over.
    pub const CLOSE_DONE: VarInt = VarInt::from_u32(0);
    /// The peer is not on the allowlist of the protocol it asked for.
    pub const CLOSE_NOT_ALLOWED: VarInt = VarInt::from_u32(403);
    /// Reason text sent with [`CLOSE_NOT_ALLOWED`].
    pub const REASON_NOT_ALLOWED: &[u8] = b"peer not on allowlist for this protocol";
    /// A telemetry subscriber stopped reading for too long and was dropped.
    pub const CLOSE_SUBSCRIBER_STALLED: VarInt = VarInt::from_u32(408);
    /// The service has no room for another peer (e.g. subscriber limit,
    /// connection caps).
    pub const CLOSE_BUSY: VarInt = VarInt::from_u32(429);
    /// Reason text sent with [`CLOSE_BUSY`] when a protocol serves its
    /// maximum number of connections.
    pub const REASON_BUSY: &[u8] = b"too many connections on this protocol";
    /// Reason text sent with [`CLOSE_BUSY`] when the peer already holds its
    /// maximum number of connections on a protocol.
    pub const REASON_PEER_BUSY: &[u8] = b"too many connections from this peer";
    /// The peer did not deliver its first frame within the handshake
    /// deadline. The same number as [`CLOSE_SUBSCRIBER_STALLED`]: both say
    /// the peer was too slow, on different protocols.
    pub const CLOSE_HANDSHAKE_TIMEOUT: VarInt = VarInt::from_u32(408);
    /// Reason text sent with [`CLOSE_HANDSHAKE_TIMEOUT`].
    pub const REASON_HANDSHAKE_TIMEOUT: &[u8] = b"no first frame within the handshake deadline";
    /// The service is shutting down.
    pub const CLOSE_SHUTDOWN: VarInt = VarInt::from_u32(503);
    /// Stream reset: a frame did not decode.
    pub const STREAM_BAD_FRAME: VarInt = VarInt::from_u32(400);
    /// Stream reset: a frame exceeded the size limit.
    pub const STREAM_FRAME_TOO_LARGE: VarInt = VarInt::from_u32(413);
}

/// Whether the endpoint uses relay servers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RelayChoice {
    /// No relays: peers are reached on their direct addresses only. The
    /// default, and the only mode allowed where outside traffic is forbidden.
    #[default]
    Disabled,
    /// iroh's default public relays, for a real deployment across NATs.
    Default,
}

/// Settings of an engine endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// UDP address to bind. Loopback by default; a daemon that peers on other
    /// machines reach sets e.g. `0.0.0.0:7777`.
    pub bind_addr: SocketAddr,
    /// Relay use; off by default. Address lookup (DNS/pkarr) and port mapping
    /// are always off: tickets carry the addresses.
    pub relay: RelayChoice,
    /// Longest a dial may take before [`DialError::TimedOut`].
    pub connect_timeout: Duration,
    /// Largest frame payload accepted or sent, in bytes.
    pub frame_len_max: usize,
    /// Per-stream QUIC receive window in bytes; `None` keeps iroh's default.
    /// A small window makes a slow reader push back on its sender sooner.
    pub stream_receive_window_bytes: Option<u32>,
    /// How long a connection may hear nothing from its peer before it is
    /// dropped (keep-alives go out at a third of it); `None` keeps iroh's
    /// default (30 s). The shorter of the two peers' values applies.
    pub idle_timeout: Option<Duration>,
    /// Most bidirectional streams a peer may have open at once on one
    /// connection to this endpoint; `None` keeps iroh's default (100). The
    /// engine's request protocols use one per connection, and each open
    /// stream may buffer up to its receive window.
    pub incoming_bidi_streams_max: Option<u32>,
    /// Most unidirectional streams a peer may have open at once on one
    /// connection to this endpoint; `None` keeps iroh's default (100). A
    /// daemon may forbid them (`Some(0)`); a telemetry subscriber must allow
    /// at least one, since the publisher sends on one.
    pub incoming_uni_streams_max: Option<u32>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            bind_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            relay: RelayChoice::Disabled,
            connect_timeout: Duration::from_secs(10),
            frame_len_max: 1024 * 1024,
            stream_receive_window_bytes: None,
            idle_timeout: None,
            incoming_bidi_streams_max: None,
            incoming_uni_streams_max: None,
        }
    }
}

impl NetConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`NetConfigError`] naming the offending field.
    pub fn validate(&self) -> Result<(), NetConfigError> {
        if self.connect_timeout.is_zero() {
            return Err(NetConfigError::ZeroConnectTimeout);
        }
        if self.frame_len_max == 0 || u32::try_from(self.frame_len_max).is_err() {
            return Err(NetConfigError::FrameLenMax {
                frame_len_max: self.frame_len_max,
            });
        }
        if self.stream_receive_window_bytes == Some(0) {
            return Err(NetConfigError::ZeroReceiveWindow);
        }
        if let Some(t) = self.idle_timeout
            && (t < Duration::from_millis(30) || IdleTimeout::try_from(t).is_err())
        {
            return Err(NetConfigError::IdleTimeout { idle_timeout: t });
        }
        Ok(())
    }
}

/// An invalid [`NetConfig`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NetConfigError {
    /// Every dial would time out at once.
    #[error("connect_timeout must be longer than zero")]
    ZeroConnectTimeout,
    /// The frame limit must fit the `u32` length prefix and allow something.
    #[error("frame_len_max must be between 1 and {max}, got {frame_len_max}", max = u32::MAX)]
    FrameLenMax {
        /// The configured value.
        frame_len_max: usize,
    },
    /// A zero window would stall every stream.
    #[error("stream_receive_window_bytes must be longer than zero")]
    ZeroReceiveWindow,
    /// The idle timeout is too short for keep-alives, or too long for QUIC.
    #[error("idle_timeout must be at least 30 ms and fit QUIC's limit, got {idle_timeout:?}")]
    IdleTimeout {
        /// The configured value.
        idle_timeout: Duration,
    },
}

/// Failure to create an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The configuration is invalid.
    #[error("invalid network configuration")]
    Config {
        /// What is wrong.
        #[source]
        source: NetConfigError,
    },
    /// The bind address was not accepted.
    #[error("cannot bind to {addr}")]
    BindAddr {
        /// The address.
        addr: SocketAddr,
        /// iroh's reason.
        #[source]
        source: iroh::endpoint::InvalidSocketAddr,
    },
    /// Binding the sockets failed.
    #[error("cannot bind the endpoint")]
    Bind {
        /// iroh's reason.
        #[source]
        source: iroh::endpoint::BindError,
    },
}

/// Binds an endpoint with identity `secret_key` as `config` says.
///
/// Address lookup stays cleared and port mapping disabled whatever the
/// config; relays only with [`RelayChoice::Default`]. Peers may not send
/// QUIC datagrams: the engine's protocols use none, and each connection
/// would otherwise buffer up to about a megabyte of them for nobody. ALPNs
/// are set by the router, so a dial-only endpoint needs no router. Never
/// await `Endpoint::online()` on a relay-less endpoint: it waits for a relay.
///
/// # Errors
/// [`NetError`].
pub async fn bind_endpoint(
    config: &NetConfig,
    secret_key: SecretKey,
) -> Result<Endpoint, NetError> {
    config
        .validate()
        .map_err(|source| NetError::Config { source })?;
    let mut builder = Endpoint::builder(presets::Minimal)
        .secret_key(secret_key)
        .clear_address_lookup()
        .portmapper_config(PortmapperConfig::Disabled)
        .clear_ip_transports()
        .bind_addr(config.bind_addr)
        .map_err(|source| NetError::BindAddr {
            addr: config.bind_addr,
            source,
        })?;
    builder = match config.relay {
        // Without relays there is nothing for net-report to probe.
        RelayChoice::Disabled => builder
            .relay_mode(RelayMode::Disabled)
            .net_report_config(NetReportConfig::minimal()),
        RelayChoice::Default => builder.relay_mode(RelayMode::Default),
    };
    let mut transport = QuicTransportConfig::builder().datagram_receive_buffer_size(None);
    if let Some(window) = config.stream_receive_window_bytes {
        transport = transport.stream_receive_window(VarInt::from_u32(window));
    }
    if let Some(idle) = config.idle_timeout {
        // Validated above: it converts.
        transport = transport
            .max_idle_timeout(IdleTimeout::try_from(idle).ok())
            .keep_alive_interval(idle / 3);
    }
    if let Some(streams) = config.incoming_bidi_streams_max {
        transport = transport.max_concurrent_bidi_streams(VarInt::from_u32(streams));
    }
    if let Some(streams) = config.incoming_uni_streams_max {
        transport = transport.max_concurrent_uni_streams(VarInt::from_u32(streams));
    }
    builder = builder.transport_config(transport.build());
    builder
        .bind()
        .await
        .map_err(|source| NetError::Bind { source })
}

/// A failed dial.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// No connection within the timeout (e.g. nobody at the address).
    #[error("dialing {peer} for {alpn} timed out after {after:?}")]
    TimedOut {
        /// Who was dialled.
        peer: String,
        /// The protocol, lossily as text.
        alpn: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The connection attempt failed (refused ALPN, bad address, closed endpoint...).
    #[error("dialing {peer} for {alpn} failed")]
    Failed {
        /// Who was dialled.
        peer: String,
        /// The protocol, lossily as text.
        alpn: String,
        /// iroh's reason.
        #[source]
        source: iroh::endpoint::ConnectError,
    },
}

/// Dials `addr` for `alpn`, giving up after `timeout`.
///
/// Wrapping every dial matters: QUIC takes about 30 s to give up on an
/// address where nobody answers.
///
/// # Errors
/// [`DialError`].
pub async fn connect(
    endpoint: &Endpoint,
    addr: impl Into<EndpointAddr>,
    alpn: &[u8],
    timeout: Duration,
) -> Result<Connection, DialError> {
    let addr = addr.into();
    let peer = addr.id.fmt_short().to_string();
    let alpn_text = || String::from_utf8_lossy(alpn).into_owned();
    match tokio::time::timeout(timeout, endpoint.connect(addr, alpn)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(source)) => Err(DialError::Failed {
            peer,
            alpn: alpn_text(),
            source,
        }),
        Err(_) => Err(DialError::TimedOut {
            peer,
            alpn: alpn_text(),
            after: timeout,
        }),
    }
}

/// The application code the peer closed the connection with, if it did.
#[must_use]
pub fn peer_close_code(error: &ConnectionError) -> Option<VarInt> {
    match error {
        ConnectionError::ApplicationClosed(close) => Some(close.error_code),
        _ => None,
    }
}
