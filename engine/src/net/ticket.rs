//! Endpoint tickets: an `EndpointAddr` as a copy-pasteable `swactor1…` string.

use std::fmt;
use std::str::FromStr;

use iroh::{EndpointAddr, EndpointId};

/// Prefix of every ticket; the trailing `1` is the format version.
pub const TICKET_PREFIX: &str = "swactor1";

/// Tickets longer than this are refused before decoding, so a pasted file
/// or a hostile string cannot make us allocate much.
pub const TICKET_LEN_MAX: usize = 4096;

/// How to reach an endpoint: its id plus direct addresses and/or relay URL.
///
/// The text form is `swactor1` followed by the lowercase, unpadded base32 of
/// the postcard encoding of the [`EndpointAddr`]. Parsing is case-insensitive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointTicket {
    addr: EndpointAddr,
}

impl EndpointTicket {
    /// Wraps an address.
    #[must_use]
    pub fn new(addr: EndpointAddr) -> Self {
        Self { addr }
    }

    /// The address to dial.
    #[must_use]
    pub fn addr(&self) -> &EndpointAddr {
        &self.addr
    }

    /// The endpoint's identity.
    #[must_use]
    pub fn id(&self) -> EndpointId {
        self.addr.id
    }

    /// Unwraps the address.
    #[must_use]
    pub fn into_addr(self) -> EndpointAddr {
        self.addr
    }
}

impl From<EndpointAddr> for EndpointTicket {
    fn from(addr: EndpointAddr) -> Self {
        Self::new(addr)
    }
}

impl From<EndpointTicket> for EndpointAddr {
    fn from(ticket: EndpointTicket) -> Self {
        ticket.addr
    }
}

impl fmt::Display for EndpointTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Serialising an EndpointAddr into a Vec cannot fail.
        let bytes = postcard::to_allocvec(&self.addr).map_err(|_| fmt::Error)?;
        let body = data_encoding::BASE32_NOPAD
            .encode(&bytes)
            .to_ascii_lowercase();
        write!(f, "{TICKET_PREFIX}{body}")
    }
}

/// Why a string is not a ticket.
#[derive(Debug, thiserror::Error)]
pub enum TicketError {
    /// The string is empty (after trimming whitespace).
    #[error("ticket is empty")]
    Empty,
    /// The string is implausibly long.
    #[error("ticket is {len} characters long; at most {TICKET_LEN_MAX} are accepted")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// The string does not start with [`TICKET_PREFIX`].
    #[error("ticket must start with `{TICKET_PREFIX}`, found `{found}`")]
    Prefix {
        /// The first characters of what was given.
        found: String,
    },
    /// The body is not valid base32.
    #[error("ticket body is not valid base32")]
    Base32 {
        /// Where decoding stopped.
        #[source]
        source: data_encoding::DecodeError,
    },
    /// The body decodes, but not to an endpoint address.
    #[error("ticket body does not hold an endpoint address (truncated or corrupted?)")]
    Payload {
        /// The postcard error.
        #[source]
        source: postcard::Error,
    },
    /// The address is followed by extra bytes.
    #[error("ticket has {count} unexpected trailing bytes")]
    Trailing {
        /// Number of extra bytes.
        count: usize,
    },
    /// The address has neither a direct address nor a relay, so it cannot be dialled.
    #[error("ticket for {id} has no address to dial")]
    NoAddress {
        /// The endpoint the ticket names.
        id: EndpointId,
    },
}

impl FromStr for EndpointTicket {
    type Err = TicketError;

    fn from_str(s: &str) -> Result<Self, TicketError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(TicketError::Empty);
        }
        if s.len() > TICKET_LEN_MAX {
            return Err(TicketError::TooLong { len: s.len() });
        }
        let prefix_len = TICKET_PREFIX.len();
        let has_prefix = s
            .get(..prefix_len)
            .is_some_and(|head| head.eq_ignore_ascii_case(TICKET_PREFIX));
        if !has_prefix {
            return Err(TicketError::Prefix {
                found: s.chars().take(prefix_len).collect(),
            });
        }
        let body = s[prefix_len..].to_ascii_uppercase();
        let bytes = data_encoding::BASE32_NOPAD
            .decode(body.as_bytes())
            .map_err(|source| TicketError::Base32 { source })?;
        let (addr, rest): (EndpointAddr, &[u8]) =
            postcard::take_from_bytes(&bytes).map_err(|source| TicketError::Payload { source })?;
        if !rest.is_empty() {
            return Err(TicketError::Trailing { count: rest.len() });
        }
        if addr.is_empty() {
            return Err(TicketError::NoAddress { id: addr.id });
        }
        Ok(Self { addr })
    }
}
