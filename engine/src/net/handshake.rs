//! Reading a peer's first frame under a small size limit and a deadline.
//!
//! Before a protocol has authenticated its peer (a swarm join carries its
//! token in the first frame), the peer is a stranger: it gets a small frame
//! limit and a few seconds to say who it is. Handlers read the first frame
//! with [`accept_first_frame`] (a connection) or [`recv_first_frame`] (a
//! stream), and switch to their protocol's larger limit afterwards.

use std::time::Duration;

use iroh::endpoint::{Connection, ConnectionError, RecvStream, SendStream, VarInt};
use serde::de::DeserializeOwned;
use tokio::io::AsyncRead;

use super::codes;
use super::frame::{FrameError, recv_frame, reset_stream};

/// Default limit of a first frame, in bytes: a join or a request fits in a
/// few KiB, so a stranger may not make us buffer more.
pub const FIRST_FRAME_LEN_MAX_BYTES: usize = 16 * 1024;

/// Default time a peer has, from the moment its handler starts, to open its
/// stream and deliver its whole first frame.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// Why a peer's first frame was not received.
#[derive(Debug, thiserror::Error)]
pub enum FirstFrameError {
    /// The peer did not open a stream and deliver a complete first frame in time.
    #[error("no complete first frame within {deadline:?}")]
    TimedOut {
        /// The deadline that expired.
        deadline: Duration,
    },
    /// The peer ended its stream before sending any frame.
    #[error("the stream ended before its first frame")]
    Ended,
    /// The first frame was oversized, undecodable, truncated, or its stream failed.
    #[error("bad first frame")]
    Frame {
        /// What was wrong with it.
        #[source]
        source: FrameError,
    },
    /// The connection ended before the peer opened a stream.
    #[error("the connection ended before the first stream")]
    Connection {
        /// iroh's reason.
        #[source]
        source: ConnectionError,
    },
}

impl FirstFrameError {
    /// The QUIC code to close the connection (or reset the stream) with
    /// after this error.
    #[must_use]
    pub fn close_code(&self) -> VarInt {
        match self {
            Self::TimedOut { .. } => codes::CLOSE_HANDSHAKE_TIMEOUT,
            Self::Frame { source } => source.stream_code(),
            Self::Ended | Self::Connection { .. } => codes::STREAM_BAD_FRAME,
        }
    }

    fn close_reason(&self) -> &'static [u8] {
        match self {
            Self::TimedOut { .. } => codes::REASON_HANDSHAKE_TIMEOUT,
            Self::Frame {
                source: FrameError::TooLarge { .. },
            } => b"first frame too large",
            Self::Frame { .. } | Self::Ended | Self::Connection { .. } => b"bad first frame",
        }
    }
}

/// Receives the first frame of a stream, which must be complete within
/// `deadline` and at most `first_frame_len_max` bytes long.
///
/// The buffer follows the bytes received (see [`recv_frame`]), and the
/// deadline covers the whole frame, so a peer that sends a header and then
/// trickles or stops is cut off on time.
///
/// # Errors
/// [`FirstFrameError::TimedOut`], [`FirstFrameError::Ended`] or
/// [`FirstFrameError::Frame`]. Reset the stream with
/// [`FirstFrameError::close_code`] afterwards.
pub async fn recv_first_frame<T, R>(
    reader: &mut R,
    first_frame_len_max: usize,
    deadline: Duration,
) -> Result<T, FirstFrameError>
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin + ?Sized,
{
    match tokio::time::timeout(deadline, recv_frame(reader, first_frame_len_max)).await {
        Ok(Ok(Some(value))) => Ok(value),
        Ok(Ok(None)) => Err(FirstFrameError::Ended),
        Ok(Err(source)) => Err(FirstFrameError::Frame { source }),
        Err(_) => Err(FirstFrameError::TimedOut { deadline }),
    }
}

/// Accepts the peer's first bidirectional stream and receives its first
/// frame, both within `deadline`, the frame at most `first_frame_len_max`
/// bytes long.
///
/// This is how a handler should start: a peer that connects and stays
/// silent, or opens a stream and sends too little, is gone after
/// `deadline`. After it succeeds, read further frames with [`recv_frame`]
/// and the protocol's own limit.
///
/// # Errors
/// [`FirstFrameError`]. The connection has then already been closed with
/// [`FirstFrameError::close_code`], so the handler just returns; it should
/// not log each failure above debug level, since strangers cause them.
pub async fn accept_first_frame<T: DeserializeOwned>(
    conn: &Connection,
    first_frame_len_max: usize,
    deadline: Duration,
) -> Result<(SendStream, RecvStream, T), FirstFrameError> {
    let outcome = tokio::time::timeout(deadline, async {
        let (mut send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|source| FirstFrameError::Connection { source })?;
        // The outer timeout bounds this too; the inner one never fires first.
        match recv_first_frame(&mut recv, first_frame_len_max, deadline).await {
            Ok(value) => Ok((send, recv, value)),
            Err(error) => {
                reset_stream(&mut send, &mut recv, error.close_code());
                Err(error)
            }
        }
    })
    .await
    .unwrap_or(Err(FirstFrameError::TimedOut { deadline }));
    if let Err(error) = &outcome {
        conn.close(error.close_code(), error.close_reason());
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::send_frame;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_first_frame_in_time_and_within_the_limit_is_received() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        send_frame(&mut a, "join", 64).await.unwrap();
        let hello: String = recv_first_frame(&mut b, 64, HANDSHAKE_DEADLINE)
            .await
            .unwrap();
        assert_eq!(hello, "join");
    }

    #[tokio::test(start_paused = true)]
    async fn a_header_without_its_payload_times_out_at_the_deadline() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&10u32.to_be_bytes()).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = recv_first_frame::<String, _>(&mut b, 64, HANDSHAKE_DEADLINE)
            .await
            .unwrap_err();
        assert!(
            matches!(err, FirstFrameError::TimedOut { deadline } if deadline == HANDSHAKE_DEADLINE)
        );
        assert_eq!(started.elapsed(), HANDSHAKE_DEADLINE);
        assert_eq!(err.close_code(), codes::CLOSE_HANDSHAKE_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn an_oversized_or_missing_first_frame_is_refused_with_its_own_code() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let announced = u32::try_from(FIRST_FRAME_LEN_MAX_BYTES + 1).unwrap();
        a.write_all(&announced.to_be_bytes()).await.unwrap();
        let err =
            recv_first_frame::<String, _>(&mut b, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
                .unwrap_err();
        assert!(
            matches!(
                err,
                FirstFrameError::Frame {
                    source: FrameError::TooLarge { .. }
                }
            ),
            "{err}"
        );
        assert_eq!(err.close_code(), codes::STREAM_FRAME_TOO_LARGE);

        let (a, mut b) = tokio::io::duplex(1024);
        drop(a);
        let err = recv_first_frame::<String, _>(&mut b, 64, HANDSHAKE_DEADLINE)
            .await
            .unwrap_err();
        assert!(matches!(err, FirstFrameError::Ended), "{err}");
        assert_eq!(err.close_code(), codes::STREAM_BAD_FRAME);
    }
}
