//! Length-delimited postcard frames: a big-endian `u32` length, then the payload.

use std::io;

use iroh::endpoint::{RecvStream, SendStream, VarInt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::codes;

/// Bytes of the length prefix in front of every frame.
pub const FRAME_HEADER_LEN: usize = 4;

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The announced (or encoded) payload exceeds the frame limit.
    #[error("frame of {len} bytes exceeds the limit of {frame_len_max} bytes")]
    TooLarge {
        /// Payload length.
        len: u64,
        /// The limit in force.
        frame_len_max: usize,
    },
    /// The value could not be encoded.
    #[error("cannot encode frame")]
    Encode {
        /// The postcard error.
        #[source]
        source: postcard::Error,
    },
    /// The payload is not a valid encoding of the expected type.
    #[error("cannot decode frame of {len} bytes")]
    Decode {
        /// Payload length.
        len: usize,
        /// The postcard error.
        #[source]
        source: postcard::Error,
    },
    /// The payload decoded but left bytes over.
    #[error("frame has {count} trailing bytes after its value")]
    Trailing {
        /// Number of extra bytes.
        count: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// The underlying stream failed (reset, connection lost, ...).
    #[error("frame stream i/o failed")]
    Io {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl FrameError {
    /// The QUIC code to reset a stream with after this error.
    #[must_use]
    pub fn stream_code(&self) -> VarInt {
        match self {
            Self::TooLarge { .. } => codes::STREAM_FRAME_TOO_LARGE,
            _ => codes::STREAM_BAD_FRAME,
        }
    }
}

/// Encodes `value` as one frame (header included), enforcing `frame_len_max`.
///
/// # Errors
/// [`FrameError::Encode`] or [`FrameError::TooLarge`].
pub fn encode_frame<T: Serialize + ?Sized>(
    value: &T,
    frame_len_max: usize,
) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; FRAME_HEADER_LEN];
    buf = postcard::to_extend(value, buf).map_err(|source| FrameError::Encode { source })?;
    let len = buf.len() - FRAME_HEADER_LEN;
    let header = u32::try_from(len)
        .ok()
        .filter(|_| len <= frame_len_max)
        .ok_or(FrameError::TooLarge {
            len: len as u64,
            frame_len_max,
        })?;
    buf[..FRAME_HEADER_LEN].copy_from_slice(&header.to_be_bytes());
    Ok(buf)
}

/// Sends `value` as one frame.
///
/// # Errors
/// Encoding errors, an oversized value, or I/O errors.
pub async fn send_frame<T, W>(
    writer: &mut W,
    value: &T,
    frame_len_max: usize,
) -> Result<(), FrameError>
where
    T: Serialize + ?Sized,
    W: AsyncWrite + Unpin + ?Sized,
{
    let buf = encode_frame(value, frame_len_max)?;
    writer
        .write_all(&buf)
        .await
        .map_err(|source| FrameError::Io { source })
}

/// Bytes allocated for a frame's payload before any of it has arrived.
///
/// Most frames (heartbeats, joins, requests) fit, so they take one exact
/// allocation; a peer that announces a large frame and then sends nothing
/// pins only this much.
pub const RECV_FIRST_CHUNK_LEN_BYTES: usize = 4 * 1024;

/// Largest piece of a payload allocated at once while it arrives.
///
/// A frame's buffer grows in pieces of at most this size as bytes actually
/// arrive, never to the announced length up front: a peer must send the
/// bytes it wants us to hold.
pub const RECV_CHUNK_LEN_MAX_BYTES: usize = 64 * 1024;

/// Receives one frame; `Ok(None)` when the stream ends cleanly between frames.
///
/// # Guarantees
/// The announced length is checked against `frame_len_max` first, and
/// memory follows the bytes that actually arrive: while a frame is
/// incomplete, its buffers hold at most the bytes received plus one piece
/// of [`RECV_CHUNK_LEN_MAX_BYTES`] (only [`RECV_FIRST_CHUNK_LEN_BYTES`]
/// before the first payload byte). A complete frame longer than the first
/// piece is copied once into a contiguous buffer for decoding.
///
/// # Caveats
/// Decoding may reserve more than the frame's length for a `HashMap`:
/// serde pre-sizes it from the entry count the payload announces (up to
/// 1 MiB of entries; a 7-byte frame made a `HashMap<u8, u8>` reserve
/// 3 MiB), and postcard checks that count against the bytes left only for
/// sequences, not for maps. Types read from untrusted peers should avoid
/// hash maps (a `BTreeMap` reserves nothing up front).
///
/// # Errors
/// An oversized or undecodable frame, truncation, or I/O errors.
pub async fn recv_frame<T, R>(reader: &mut R, frame_len_max: usize) -> Result<Option<T>, FrameError>
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin + ?Sized,
{
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut filled = 0;
    while filled < FRAME_HEADER_LEN {
        let n = reader
            .read(&mut header[filled..])
            .await
            .map_err(|source| FrameError::Io { source })?;
        if n == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        filled += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > frame_len_max {
        return Err(FrameError::TooLarge {
            len: len as u64,
            frame_len_max,
        });
    }
    let payload = recv_payload(reader, len).await?;
    let (value, rest) =
        postcard::take_from_bytes(&payload).map_err(|source| FrameError::Decode { len, source })?;
    if !rest.is_empty() {
        return Err(FrameError::Trailing { count: rest.len() });
    }
    Ok(Some(value))
}

/// Reads exactly `len` payload bytes, allocating as they arrive.
///
/// Pieces are kept apart until the last one is in, rather than grown in one
/// buffer: growing would copy the whole buffer at every step in the worst
/// case, and would briefly hold the old and the new buffer each time.
async fn recv_payload<R>(reader: &mut R, len: usize) -> Result<Vec<u8>, FrameError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    let first_len = len.min(RECV_FIRST_CHUNK_LEN_BYTES);
    let mut first = vec![0u8; first_len];
    read_exact_or_truncated(reader, &mut first).await?;
    if first_len == len {
        return Ok(first);
    }
    let mut pieces = vec![first];
    let mut received = first_len;
    while received < len {
        let mut piece = vec![0u8; (len - received).min(RECV_CHUNK_LEN_MAX_BYTES)];
        read_exact_or_truncated(reader, &mut piece).await?;
        received += piece.len();
        pieces.push(piece);
    }
    // Every byte has arrived, so the peer has paid for this allocation.
    let mut payload = Vec::with_capacity(len);
    for piece in pieces {
        payload.extend_from_slice(&piece);
    }
    Ok(payload)
}

async fn read_exact_or_truncated<R>(reader: &mut R, buf: &mut [u8]) -> Result<(), FrameError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    reader
        .read_exact(buf)
        .await
        .map(drop)
        .map_err(|source| match source.kind() {
            io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io { source },
        })
}

/// Abandons a bidirectional stream after a frame error: tells the peer to
/// stop sending and resets our side, both with `code`.
pub fn reset_stream(send: &mut SendStream, recv: &mut RecvStream, code: VarInt) {
    // Either half may already be closed; that is fine, it is going away.
    let _ = recv.stop(code);
    let _ = send.reset(code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Hello {
        name: String,
        n: u32,
    }

    #[tokio::test]
    async fn frames_round_trip_and_end_cleanly() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let hello = Hello {
            name: "x".into(),
            n: 7,
        };
        send_frame(&mut a, &hello, 64).await.unwrap();
        send_frame(&mut a, &hello, 64).await.unwrap();
        drop(a);
        assert_eq!(
            recv_frame::<Hello, _>(&mut b, 64).await.unwrap(),
            Some(hello)
        );
        assert!(recv_frame::<Hello, _>(&mut b, 64).await.unwrap().is_some());
        assert!(recv_frame::<Hello, _>(&mut b, 64).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn an_oversized_header_is_refused_before_allocating() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = recv_frame::<Hello, _>(&mut b, 1024).await.unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { len, .. } if len == u64::from(u32::MAX)));
        assert_eq!(err.stream_code(), codes::STREAM_FRAME_TOO_LARGE);
    }

    #[tokio::test]
    async fn sending_an_oversized_value_fails_without_writing() {
        let (mut a, _b) = tokio::io::duplex(1024);
        let big = vec![0u8; 100];
        let err = send_frame(&mut a, &big, 50).await.unwrap_err();
        assert!(matches!(
            err,
            FrameError::TooLarge {
                len: 101,
                frame_len_max: 50
            }
        ));
    }

    #[tokio::test]
    async fn garbage_and_truncation_are_distinct_errors() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&3u32.to_be_bytes()).await.unwrap();
        a.write_all(&[0xff, 0xff, 0xff]).await.unwrap();
        a.write_all(&10u32.to_be_bytes()).await.unwrap();
        a.write_all(&[1, 2]).await.unwrap();
        drop(a);
        let err = recv_frame::<Hello, _>(&mut b, 64).await.unwrap_err();
        assert!(matches!(err, FrameError::Decode { len: 3, .. }), "{err}");
        assert_eq!(err.stream_code(), codes::STREAM_BAD_FRAME);
        let err = recv_frame::<Hello, _>(&mut b, 64).await.unwrap_err();
        assert!(matches!(err, FrameError::Truncated), "{err}");
    }
}
