//! Telemetry: a publisher streaming a snapshot then events to subscribers, and an NDJSON sink.

mod ndjson;

use std::collections::VecDeque;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use iroh::endpoint::{Connection, ConnectionError, RecvStream};
use iroh::protocol::{AcceptError, ProtocolHandler};
use iroh::{Endpoint, EndpointAddr};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::net::{
    ALPN_TELEMETRY, DialError, FrameError, codes, connect, encode_frame, peer_close_code,
    recv_frame,
};
use crate::timers::TaskGauge;

pub use ndjson::{NDJSON_FILE_NAME, NdjsonConfig, NdjsonError, NdjsonSink};

/// One frame of the telemetry stream.
///
/// A subscriber first gets one `Snapshot`, then `Event`s in `seq` order.
/// The snapshot reflects every event with a sequence number up to its own
/// `seq`; the events that follow start at `seq + 1` unless a `Lagged` frame
/// says some were skipped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TelemetryFrame<S, E> {
    /// The published state as of event `seq`.
    Snapshot {
        /// Last event sequence number the state includes (0: none yet).
        seq: u64,
        /// The state.
        state: S,
    },
    /// One event.
    Event {
        /// Sequence number, starting at 1 and increasing by 1 per publish.
        seq: u64,
        /// When it was published: milliseconds since the Unix epoch, on the
        /// publisher's wall clock.
        at_ms: u64,
        /// The event.
        event: E,
    },
    /// This subscriber fell behind and `missed` events were skipped for it.
    Lagged {
        /// How many events it will never see.
        missed: u64,
    },
}

/// Limits of a [`TelemetryPublisher`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// Events a subscriber may fall behind before it is told it lagged.
    pub buffer_len_max: usize,
    /// Recent events kept to bring new subscribers from the snapshot up to now.
    pub history_len_max: usize,
    /// Subscribers served at once; more are refused.
    pub subscribers_max: usize,
    /// Largest encoded frame, in bytes; larger snapshots or events are refused.
    pub frame_len_max: usize,
    /// A subscriber whose stream accepts nothing for this long is dropped.
    pub write_stall_max: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            buffer_len_max: 1024,
            history_len_max: 1024,
            subscribers_max: 256,
            frame_len_max: 1024 * 1024,
            write_stall_max: Duration::from_secs(30),
        }
    }
}

impl TelemetryConfig {
    /// Checks the limits.
    ///
    /// # Errors
    /// [`TelemetryError::Config`] naming the field.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        let bad = |field: &'static str| Err(TelemetryError::Config { field });
        if self.buffer_len_max == 0 || self.buffer_len_max > usize::MAX / 2 {
            return bad("buffer_len_max");
        }
        if self.subscribers_max == 0 {
            return bad("subscribers_max");
        }
        if self.frame_len_max == 0 || u32::try_from(self.frame_len_max).is_err() {
            return bad("frame_len_max");
        }
        if self.write_stall_max.is_zero() {
            return bad("write_stall_max");
        }
        Ok(())
    }
}

/// Telemetry failures.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A configuration field is out of range.
    #[error("invalid telemetry configuration: {field}")]
    Config {
        /// The field.
        field: &'static str,
    },
    /// A snapshot or event could not be framed (too large, unencodable).
    #[error("cannot frame telemetry value")]
    Frame {
        /// The framing error.
        #[source]
        source: FrameError,
    },
}

/// Why subscribing failed or a subscription ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The publisher could not be reached.
    #[error("cannot reach telemetry publisher")]
    Dial {
        /// The dial error.
        #[source]
        source: DialError,
    },
    /// The publisher refused or dropped us with an application code.
    #[error("telemetry publisher closed the connection with code {code}: {reason}")]
    Refused {
        /// The close code (see [`codes`]).
        code: u64,
        /// The reason text sent with it.
        reason: String,
    },
    /// The connection failed.
    #[error("telemetry connection failed")]
    Connection {
        /// The QUIC error.
        #[source]
        source: ConnectionError,
    },
    /// The publisher opened no stream in time.
    #[error("telemetry publisher sent nothing within {after:?}")]
    TimedOut {
        /// The time waited.
        after: Duration,
    },
    /// A frame was malformed or oversized.
    #[error("bad telemetry frame")]
    Frame {
        /// The framing error.
        #[source]
        source: FrameError,
    },
}

impl From<ConnectionError> for SubscribeError {
    fn from(source: ConnectionError) -> Self {
        match &source {
            ConnectionError::ApplicationClosed(close) => Self::Refused {
                code: close.error_code.into_inner(),
                reason: String::from_utf8_lossy(&close.reason).into_owned(),
            },
            _ => Self::Connection { source },
        }
    }
}

struct Ring {
    seq: u64,
    snapshot: Bytes,
    snapshot_seq: u64,
    history: VecDeque<(u64, Bytes)>,
    tx: Option<broadcast::Sender<Bytes>>,
}

struct Shared {
    config: TelemetryConfig,
    ring: Mutex<Ring>,
    subscribers: TaskGauge,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Registration of a new subscriber: what to send first, then the live feed.
struct Start {
    snapshot: Bytes,
    backlog: Vec<Bytes>,
    missed: u64,
    rx: broadcast::Receiver<Bytes>,
}

/// Publishes a snapshot of type `S` and events of type `E` to subscribers.
///
/// The owner (an actor) calls [`TelemetryPublisher::publish`], which is
/// synchronous and never waits for anyone: each event is encoded once into
/// a frame and put on a bounded broadcast ring. Every subscriber connection
/// (ALPN [`ALPN_TELEMETRY`]) is served by its own task that copies frames
/// from the ring to a QUIC stream. A subscriber that falls more than
/// `buffer_len_max` events behind gets a [`TelemetryFrame::Lagged`] frame and
/// continues with the oldest event still held; one whose stream stays blocked
/// for `write_stall_max` is disconnected. Memory per subscriber is therefore
/// bounded by the shared ring plus its QUIC stream window.
///
/// Serve it by registering [`TelemetryPublisher::handler`] on
/// [`ALPN_TELEMETRY`] (see [`crate::net::GuardedRouterBuilder`]). Dropping
/// the publisher ends every subscription after its pending frames.
pub struct TelemetryPublisher<S, E> {
    shared: Arc<Shared>,
    sink: Option<NdjsonSink>,
    _types: PhantomData<fn(&S, &E)>,
}

impl<S, E> fmt::Debug for TelemetryPublisher<S, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetryPublisher")
            .field("seq", &self.shared.lock().seq)
            .field("subscribers", &self.shared.subscribers.get())
            .finish_non_exhaustive()
    }
}

impl<S: Serialize, E: Serialize> TelemetryPublisher<S, E> {
    /// Creates a publisher whose first snapshot is `initial`.
    ///
    /// # Errors
    /// An invalid config or an unframeable snapshot.
    pub fn new(config: TelemetryConfig, initial: &S) -> Result<Self, TelemetryError> {
        config.validate()?;
        let snapshot = encode::<S, E>(
            &TelemetryFrame::Snapshot {
                seq: 0,
                state: initial,
            },
            config.frame_len_max,
        )?;
        let (tx, _) = broadcast::channel(config.buffer_len_max);
        let ring = Ring {
            seq: 0,
            snapshot,
            snapshot_seq: 0,
            history: VecDeque::with_capacity(config.history_len_max.min(4096)),
            tx: Some(tx),
        };
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                ring: Mutex::new(ring),
                subscribers: TaskGauge::default(),
            }),
            sink: None,
            _types: PhantomData,
        })
    }

    /// Also writes every published event to `sink` as `{"seq":…,"at_ms":…,"event":…}`.
    #[must_use]
    pub fn with_ndjson(mut self, sink: NdjsonSink) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Publishes an event and returns its sequence number. Never waits.
    ///
    /// # Errors
    /// [`TelemetryError::Frame`] if the event cannot be framed; nothing is
    /// published then and the sequence number is not used.
    pub fn publish(&self, event: &E) -> Result<u64, TelemetryError> {
        let frame_len_max = self.shared.config.frame_len_max;
        let at_ms = wall_clock_ms();
        let seq = {
            let mut ring = self.shared.lock();
            let seq = ring.seq + 1;
            let frame =
                encode::<S, E>(&TelemetryFrame::Event { seq, at_ms, event }, frame_len_max)?;
            ring.seq = seq;
            if self.shared.config.history_len_max > 0 {
                if ring.history.len() == self.shared.config.history_len_max {
                    ring.history.pop_front();
                }
                ring.history.push_back((seq, frame.clone()));
            }
            if let Some(tx) = &ring.tx {
                // An error only means nobody is subscribed right now.
                let _ = tx.send(frame);
            }
            seq
        };
        if let Some(sink) = &self.sink {
            #[derive(Serialize)]
            struct Line<'a, E> {
                seq: u64,
                at_ms: u64,
                event: &'a E,
            }
            // The sink counts what it had to drop; publishing goes on regardless.
            let _ = sink.record(&Line { seq, at_ms, event });
        }
        Ok(seq)
    }

    /// Replaces the snapshot new subscribers receive. `state` must reflect
    /// every event published so far (it is stamped with the current `seq`).
    ///
    /// # Errors
    /// [`TelemetryError::Frame`] if the state cannot be framed.
    pub fn set_snapshot(&self, state: &S) -> Result<(), TelemetryError> {
        let mut ring = self.shared.lock();
        let seq = ring.seq;
        ring.snapshot = encode::<S, E>(
            &TelemetryFrame::Snapshot { seq, state },
            self.shared.config.frame_len_max,
        )?;
        ring.snapshot_seq = seq;
        // Events the snapshot already covers will never be replayed.
        while ring.history.front().is_some_and(|(s, _)| *s <= seq) {
            ring.history.pop_front();
        }
        Ok(())
    }
}

impl<S, E> TelemetryPublisher<S, E> {
    /// The protocol handler serving subscribers; register it on [`ALPN_TELEMETRY`].
    #[must_use]
    pub fn handler(&self) -> TelemetryHandler {
        TelemetryHandler {
            shared: self.shared.clone(),
        }
    }

    /// Sequence number of the last published event.
    #[must_use]
    pub fn seq(&self) -> u64 {
        self.shared.lock().seq
    }

    /// Subscriber tasks alive right now.
    #[must_use]
    pub fn subscriber_count(&self) -> usize {
        self.shared.subscribers.get()
    }

    /// Subscriber buffers (ring cursors) alive right now.
    #[must_use]
    pub fn buffer_count(&self) -> usize {
        self.shared
            .lock()
            .tx
            .as_ref()
            .map_or(0, broadcast::Sender::receiver_count)
    }
}

impl<S, E> Drop for TelemetryPublisher<S, E> {
    fn drop(&mut self) {
        // Dropping the sender ends every subscriber's feed after what it holds.
        self.shared.lock().tx = None;
    }
}

/// Milliseconds since the Unix epoch (0 for a clock set before it).
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A subscription inside the publisher's own process (e.g. a web page's
/// event stream): the same frames, in the same order, as a remote
/// subscriber gets over [`ALPN_TELEMETRY`], still encoded. It counts
/// against `subscribers_max` like a remote one while it lives.
pub struct LocalSubscription {
    head: VecDeque<Bytes>,
    rx: Option<broadcast::Receiver<Bytes>>,
    _alive: crate::timers::TaskGaugeGuard,
}

impl fmt::Debug for LocalSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalSubscription")
            .field("head", &self.head.len())
            .finish_non_exhaustive()
    }
}

impl LocalSubscription {
    /// The next encoded frame (a big-endian `u32` length, then the postcard
    /// payload; see [`decode_frame`]); `None` once the publisher is gone.
    /// A subscriber that fell behind gets a `Lagged` frame and goes on.
    pub async fn next_frame(&mut self) -> Option<Bytes> {
        if let Some(frame) = self.head.pop_front() {
            return Some(frame);
        }
        let rx = self.rx.as_mut()?;
        match rx.recv().await {
            Ok(frame) => Some(frame),
            Err(broadcast::error::RecvError::Lagged(missed)) => Some(lagged_frame(missed)),
            Err(broadcast::error::RecvError::Closed) => {
                self.rx = None;
                None
            }
        }
    }
}

/// Decodes one frame as [`LocalSubscription::next_frame`] returns it.
///
/// # Errors
/// A frame that is truncated, oversized or not a `TelemetryFrame<S, E>`.
pub fn decode_frame<S: DeserializeOwned, E: DeserializeOwned>(
    frame: &[u8],
) -> Result<TelemetryFrame<S, E>, FrameError> {
    let runtime_free = futures_util::FutureExt::now_or_never(recv_frame::<
        TelemetryFrame<S, E>,
        &[u8],
    >(&mut &frame[..], usize::MAX));
    match runtime_free {
        Some(Ok(Some(frame))) => Ok(frame),
        Some(Ok(None)) | None => Err(FrameError::Io {
            source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
        }),
        Some(Err(e)) => Err(e),
    }
}

fn encode<S: Serialize, E: Serialize>(
    frame: &TelemetryFrame<&S, &E>,
    frame_len_max: usize,
) -> Result<Bytes, TelemetryError> {
    encode_frame(frame, frame_len_max)
        .map(Bytes::from)
        .map_err(|source| TelemetryError::Frame { source })
}

fn lagged_frame(missed: u64) -> Bytes {
    // A Lagged frame carries no S or E, so any type parameters encode alike;
    // it is a handful of bytes, far below any sane frame limit.
    let frame: TelemetryFrame<(), ()> = TelemetryFrame::Lagged { missed };
    Bytes::from(encode_frame(&frame, usize::MAX).unwrap_or_default())
}

/// Serves telemetry subscribers; obtained from [`TelemetryPublisher::handler`].
#[derive(Clone)]
pub struct TelemetryHandler {
    shared: Arc<Shared>,
}

impl fmt::Debug for TelemetryHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetryHandler")
            .field("subscribers", &self.shared.subscribers.get())
            .finish_non_exhaustive()
    }
}

impl TelemetryHandler {
    /// Subscribes from inside the process: the snapshot, then every event,
    /// exactly as a remote subscriber would get them. `None` when
    /// `subscribers_max` subscribers are served already, or the publisher
    /// is gone.
    #[must_use]
    pub fn subscribe_local(&self) -> Option<LocalSubscription> {
        let alive = self
            .shared
            .subscribers
            .try_enter(self.shared.config.subscribers_max)?;
        let start = self.start()?;
        let mut head = VecDeque::with_capacity(start.backlog.len() + 2);
        head.push_back(start.snapshot);
        if start.missed > 0 {
            head.push_back(lagged_frame(start.missed));
        }
        head.extend(start.backlog);
        Some(LocalSubscription {
            head,
            rx: Some(start.rx),
            _alive: alive,
        })
    }

    /// Subscribers (remote and local) served right now.
    #[must_use]
    pub fn subscriber_count(&self) -> usize {
        self.shared.subscribers.get()
    }

    fn start(&self) -> Option<Start> {
        let ring = self.shared.lock();
        let rx = ring.tx.as_ref()?.subscribe();
        let first_wanted = ring.snapshot_seq + 1;
        let backlog: Vec<Bytes> = ring
            .history
            .iter()
            .filter(|(seq, _)| *seq >= first_wanted)
            .map(|(_, frame)| frame.clone())
            .collect();
        let oldest_held = ring.history.front().map_or(ring.seq + 1, |(seq, _)| *seq);
        let missed = oldest_held
            .saturating_sub(first_wanted)
            .min(ring.seq - ring.snapshot_seq);
        Some(Start {
            snapshot: ring.snapshot.clone(),
            backlog,
            missed,
            rx,
        })
    }

    async fn serve(&self, conn: &Connection) -> Result<(), AcceptError> {
        let stall_max = self.shared.config.write_stall_max;
        let Some(start) = self.start() else {
            conn.close(codes::CLOSE_SHUTDOWN, b"telemetry publisher stopped");
            return Ok(());
        };
        let Start {
            snapshot,
            backlog,
            missed,
            mut rx,
        } = start;
        let mut send = conn.open_uni().await?;
        let write = async |send: &mut iroh::endpoint::SendStream, frame: &Bytes| {
            match tokio::time::timeout(stall_max, send.write_all(frame)).await {
                Ok(Ok(())) => Ok(true),
                Ok(Err(error)) => Err(AcceptError::from_err(error)),
                Err(_) => {
                    tracing::warn!(peer = %conn.remote_id().fmt_short(), "telemetry subscriber stalled; dropping it");
                    conn.close(
                        codes::CLOSE_SUBSCRIBER_STALLED,
                        b"subscriber stopped reading",
                    );
                    Ok(false)
                }
            }
        };
        let mut head = vec![snapshot];
        if missed > 0 {
            head.push(lagged_frame(missed));
        }
        head.extend(backlog);
        for frame in &head {
            if !write(&mut send, frame).await? {
                return Ok(());
            }
        }
        drop(head);
        loop {
            let frame = tokio::select! {
                biased;
                _ = conn.closed() => return Ok(()),
                received = rx.recv() => match received {
                    Ok(frame) => frame,
                    Err(broadcast::error::RecvError::Lagged(missed)) => lagged_frame(missed),
                    Err(broadcast::error::RecvError::Closed) => break,
                },
            };
            if !write(&mut send, &frame).await? {
                return Ok(());
            }
        }
        // The publisher is gone: end the stream and wait (briefly) until the
        // peer has it all, since dropping the connection discards unsent data.
        send.finish()?;
        let _ = tokio::time::timeout(stall_max, send.stopped()).await;
        conn.close(codes::CLOSE_DONE, b"telemetry publisher stopped");
        Ok(())
    }
}

impl ProtocolHandler for TelemetryHandler {
    async fn accept(&self, connection: Connection) -> Result<(), AcceptError> {
        let Some(_alive) = self
            .shared
            .subscribers
            .try_enter(self.shared.config.subscribers_max)
        else {
            connection.close(codes::CLOSE_BUSY, b"too many telemetry subscribers");
            return Ok(());
        };
        let outcome = self.serve(&connection).await;
        if let Err(error) = &outcome {
            tracing::debug!(%error, "telemetry subscriber ended");
        }
        // A subscriber going away is normal, not an error worth a warning.
        Ok(())
    }
}

/// The client side: a stream of telemetry frames from one publisher.
pub struct TelemetrySubscription<S, E> {
    conn: Connection,
    recv: RecvStream,
    frame_len_max: usize,
    _types: PhantomData<fn() -> (S, E)>,
}

impl<S, E> fmt::Debug for TelemetrySubscription<S, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TelemetrySubscription")
            .field("peer", &self.conn.remote_id())
            .finish_non_exhaustive()
    }
}

/// Subscribes to the publisher at `addr` (e.g. a parsed [`crate::net::EndpointTicket`]).
///
/// `timeout` bounds the dial and the wait for the first frame's stream.
///
/// # Errors
/// [`SubscribeError`].
pub async fn subscribe<S, E>(
    endpoint: &Endpoint,
    addr: impl Into<EndpointAddr>,
    timeout: Duration,
    frame_len_max: usize,
) -> Result<TelemetrySubscription<S, E>, SubscribeError> {
    let started = tokio::time::Instant::now();
    let conn = connect(endpoint, addr, ALPN_TELEMETRY, timeout)
        .await
        .map_err(|source| SubscribeError::Dial { source })?;
    let left = timeout.saturating_sub(started.elapsed());
    let recv = match tokio::time::timeout(left, conn.accept_uni()).await {
        Ok(Ok(recv)) => recv,
        Ok(Err(error)) => return Err(error.into()),
        Err(_) => return Err(SubscribeError::TimedOut { after: timeout }),
    };
    Ok(TelemetrySubscription {
        conn,
        recv,
        frame_len_max,
        _types: PhantomData,
    })
}

impl<S: DeserializeOwned, E: DeserializeOwned> TelemetrySubscription<S, E> {
    /// The next frame; `Ok(None)` when the publisher ended the stream.
    ///
    /// # Errors
    /// A malformed frame, or the connection closing abnormally.
    pub async fn next(&mut self) -> Result<Option<TelemetryFrame<S, E>>, SubscribeError> {
        match recv_frame(&mut self.recv, self.frame_len_max).await {
            Ok(frame) => Ok(frame),
            Err(FrameError::Io { source }) => {
                // Prefer the connection's close reason (e.g. "stalled") to the
                // bare stream error it caused.
                match self.conn.close_reason() {
                    Some(reason) if peer_close_code(&reason).is_some() => Err(reason.into()),
                    _ => Err(SubscribeError::Frame {
                        source: FrameError::Io { source },
                    }),
                }
            }
            Err(source) => Err(SubscribeError::Frame { source }),
        }
    }

    /// The frames as a [`Stream`], ending after the publisher's last frame or the first error.
    pub fn into_stream(
        self,
    ) -> impl Stream<Item = Result<TelemetryFrame<S, E>, SubscribeError>> + Send
    where
        S: Send + 'static,
        E: Send + 'static,
    {
        futures_util::stream::unfold(Some(self), |state| async move {
            let mut sub = state?;
            match sub.next().await {
                Ok(Some(frame)) => Some((Ok(frame), Some(sub))),
                Ok(None) => None,
                Err(error) => Some((Err(error), None)),
            }
        })
    }
}

impl<S, E> TelemetrySubscription<S, E> {
    /// Closes the subscription politely.
    pub fn close(self) {
        self.conn.close(codes::CLOSE_DONE, b"unsubscribed");
    }
}
