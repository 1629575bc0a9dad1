//! What can go wrong talking to etcd, as types a caller decides on.

use std::fmt;
use std::path::PathBuf;

/// Why an etcd call failed. No variant holds a password, a token, a key's
/// value or a TLS key: their words are safe to log.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The configuration cannot be used.
    #[error("etcd configuration: {0}")]
    Config(String),
    /// A TLS file cannot be used.
    #[error("cannot use the TLS file {path}: {reason}")]
    Tls {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// No member could be reached before the call's deadline, and nothing
    /// was sent to any: the call certainly did not happen.
    #[error("no etcd member could be reached within {after_ms} ms ({})", Tried(.tried))]
    Unreachable {
        /// Each endpoint tried and why it failed, in order.
        tried: Vec<(String, String)>,
        /// How long the call tried.
        after_ms: u64,
    },
    /// A request was sent and no answer came before the deadline (or the
    /// member said it could not tell, e.g. while the cluster had no leader):
    /// a write may or may not have landed.
    #[error(
        "etcd did not answer within {after_ms} ms ({}); a write may or may not have landed",
        Tried(.tried)
    )]
    NoAnswer {
        /// Each endpoint tried and why it failed, in order.
        tried: Vec<(String, String)>,
        /// How long the call tried.
        after_ms: u64,
    },
    /// etcd answered with an error: it refused the request, and nothing was written.
    #[error("etcd at {endpoint} refused the request: {message} (gRPC code {code})")]
    Refused {
        /// The member that answered.
        endpoint: String,
        /// etcd's gRPC status code.
        code: i32,
        /// etcd's words.
        message: String,
    },
    /// Authentication failed: the user or password is wrong, or the user may not log in.
    #[error("etcd at {endpoint} refused the credentials of user {user:?}: {message}")]
    Auth {
        /// The member that answered.
        endpoint: String,
        /// The user (never the password).
        user: String,
        /// etcd's words.
        message: String,
    },
    /// A transaction's comparison did not hold, so none of its writes were made.
    #[error(
        "the etcd transaction's comparison did not hold (at revision {revision}); nothing was written"
    )]
    CompareFailed {
        /// The cluster's revision when it was evaluated.
        revision: i64,
    },
    /// The request is over one of etcd's limits; nothing was written.
    #[error(
        "{what} is over etcd's limit; nothing was written (raise etcd's {setting} to allow it)"
    )]
    TooLarge {
        /// What is too large, with its size and the limit when known.
        what: String,
        /// The etcd server flag that sets the limit.
        setting: &'static str,
    },
    /// An answer that is not what the gateway sends.
    #[error("etcd at {endpoint} sent an answer that cannot be read: {what}")]
    Decode {
        /// The member that answered.
        endpoint: String,
        /// What is wrong with it.
        what: String,
    },
}

impl EtcdError {
    /// Whether the call may have had an effect although it failed.
    #[must_use]
    pub fn is_ambiguous(&self) -> bool {
        matches!(self, EtcdError::NoAnswer { .. })
    }
}

/// `endpoint: reason; …`, the last few only.
struct Tried<'a>(&'a [(String, String)]);

impl fmt::Display for Tried<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN_MAX: usize = 4;
        let skipped = self.0.len().saturating_sub(SHOWN_MAX);
        if skipped > 0 {
            write!(f, "{skipped} earlier tries, then ")?;
        }
        for (i, (endpoint, reason)) in self.0[skipped..].iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{endpoint}: {reason}")?;
        }
        if self.0.is_empty() {
            f.write_str("no member was tried")?;
        }
        Ok(())
    }
}
