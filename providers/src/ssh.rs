//! An SSH client for remote providers: one authenticated connection per host that runs commands and uploads files.
//!
//! A remote provider parses where a node is ([`SshTarget`]), loads or makes
//! the daemon's key ([`SshIdentity`]), checks host keys against a file in the
//! state directory ([`KnownHosts`]) and opens an [`SshSession`]. Commands are
//! shell command lines: build them with [`quote`] and [`command_line`].
//!
//! # Errors
//!
//! Every failure is an [`SshError`] that says which of two kinds it is
//! ([`SshError::is_definite`]): a host that does not answer yet, or a
//! connection that broke while a command ran, is worth another try later; a
//! refused key, a host key that changed or is unknown, or a bad local file
//! will fail the same way until someone changes the configuration, and the
//! message says what to change. The conversion into [`crate::ProviderError`]
//! keeps that distinction.
//!
//! # Caveats
//!
//! - Only ed25519 keys are used for our identity (RSA support is not built).
//! - Commands run through the remote user's login shell, which must be a
//!   POSIX shell for [`quote`] to be correct (`sh`, `bash`, `dash`, `zsh`;
//!   not `fish` or `csh`).
//! - A dead peer is noticed by keepalives within about
//!   [`KEEPALIVE_INTERVAL`] × ([`KEEPALIVE_MAX`] + 1).

mod hosts;
mod identity;
mod known_hosts;
mod quote;
pub(crate) mod remote;
mod session;
mod target;
#[cfg(feature = "ssh-testing")]
pub mod testing;

#[cfg(test)]
pub(crate) use hosts::relay_tests;
pub use hosts::{SshHostsConfig, SshHostsProvider, UNREACHABLE_GIVE_UP_DEFAULT, check_template};
#[cfg(feature = "vast")]
pub(crate) use hosts::{private_dirs, read_agent_log, start_relay, write_durably};
pub use identity::{KEY_COMMENT, KEY_FILE, PUBLIC_KEY_FILE, SshIdentity};
pub use known_hosts::KnownHosts;
pub use quote::{command_line, quote};
pub use session::{
    ExecOutput, KEEPALIVE_INTERVAL, KEEPALIVE_MAX, LINE_LEN_MAX, LINES_BUFFER_LEN,
    OUTPUT_KEEP_BYTES, RemoteLine, RemoteLines, SshSession,
};
pub use target::{DEFAULT_PORT, SshTarget, SshTargetError};

use std::path::PathBuf;
use std::time::Duration;

/// Default of [`ConnectOptions::connect_timeout`].
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// How [`SshSession::connect`] reaches and trusts a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// How long the TCP connection, the SSH handshake and the key
    /// authentication may take together before the host counts as not ready.
    pub connect_timeout: Duration,
    /// Whether a host missing from the known hosts file is trusted, and its
    /// key recorded, on first contact. A host already recorded must always
    /// offer the recorded key.
    pub trust_on_first_use: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            trust_on_first_use: false,
        }
    }
}

/// How an SSH operation failed.
///
/// The `target` fields are the [`SshTarget`] as text (`user@host:port`);
/// fingerprints are OpenSSH's `SHA256:…` form, as `ssh-keygen -l` prints.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SshError {
    /// Nothing usable answers yet: the connection was refused or timed out,
    /// the host is unreachable, or no SSH handshake completed. A probe
    /// result for a machine that may still be booting, not a failure.
    #[error("{target} does not accept SSH connections yet: {reason}")]
    NotReady {
        /// The host.
        target: String,
        /// What happened.
        reason: String,
    },
    /// The server refused our key. Retrying will not help until the key is
    /// added to the user's `authorized_keys` on the host.
    #[error("{target} refused our SSH key: {reason}")]
    Auth {
        /// The host.
        target: String,
        /// The user, the key's fingerprint and how to authorize it.
        reason: String,
    },
    /// The host offered a key other than the one recorded for it: either it
    /// was reinstalled, or someone is in the middle of the connection.
    #[error(
        "the SSH host key of {target} has changed: {file} records {known} but the host offered \
         {offered}; if the host was reinstalled, delete its line from {file} (or run \
         `ssh-keygen -R <host> -f {file}`), otherwise someone may be intercepting the connection"
    )]
    HostKeyChanged {
        /// The host.
        target: String,
        /// The fingerprint of the recorded key.
        known: String,
        /// The fingerprint of the key the host offered.
        offered: String,
        /// The known hosts file.
        file: PathBuf,
    },
    /// The host is not in the known hosts file and trust on first use is off.
    #[error(
        "{target} is not a known SSH host (it offered the key {offered}): trust it by \
         connecting once with trust on first use enabled, or add its key to {file} \
         (the line `ssh-keyscan -t ed25519 -p <port> <host>` prints)"
    )]
    UnknownHost {
        /// The host.
        target: String,
        /// The fingerprint of the key the host offered.
        offered: String,
        /// The known hosts file.
        file: PathBuf,
    },
    /// A local file cannot be used: our key file (unreadable, encrypted, not
    /// ed25519) or the known hosts file (unreadable, unwritable).
    #[error("cannot use {path}: {reason}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why, and how to fix it.
        reason: String,
    },
    /// The server refused a request before it did anything (a session
    /// channel, a command), or a helper command this module ran for the
    /// caller (see [`SshSession::upload`]) failed and left nothing changed.
    #[error("{target}: {reason}")]
    Remote {
        /// The host.
        target: String,
        /// What was refused or failed, with the remote error output.
        reason: String,
    },
    /// The connection broke or the protocol failed after the handshake began:
    /// the outcome of a running command is unknown.
    #[error("the SSH connection to {target} broke: {reason}")]
    Broken {
        /// The host.
        target: String,
        /// What happened.
        reason: String,
    },
}

impl SshError {
    /// What kind of provider fault the error is.
    pub fn fault_kind(&self) -> crate::FaultKind {
        use crate::FaultKind;
        match self {
            Self::Auth { .. } | Self::HostKeyChanged { .. } | Self::UnknownHost { .. } => {
                FaultKind::Denied
            }
            Self::Key { .. } => FaultKind::Local,
            Self::Remote { .. } => FaultKind::Refused,
            Self::NotReady { .. } | Self::Broken { .. } => FaultKind::Unreachable,
        }
    }

    /// Whether the error will repeat until someone changes the configuration
    /// (a refused key, a changed or unknown host key, a bad local file) or
    /// certainly left nothing done ([`SshError::Remote`]); `false` for a host
    /// that is not ready yet and for a broken connection.
    pub fn is_definite(&self) -> bool {
        match self {
            Self::Auth { .. }
            | Self::HostKeyChanged { .. }
            | Self::UnknownHost { .. }
            | Self::Key { .. }
            | Self::Remote { .. } => true,
            Self::NotReady { .. } | Self::Broken { .. } => false,
        }
    }
}

/// [`SshError::NotReady`] and [`SshError::Broken`] become
/// [`crate::ProviderError::Ambiguous`]: whether a host that does not answer
/// yet is worth waiting for, and whether a command cut off half-way took
/// effect, is for the provider to decide. Every other error is
/// [`crate::ProviderError::Definite`] (see [`SshError::is_definite`]).
impl From<SshError> for crate::ProviderError {
    fn from(err: SshError) -> Self {
        let definite = err.is_definite();
        let fault = crate::Fault::from(err);
        if definite {
            Self::Definite(fault)
        } else {
            Self::Ambiguous(fault)
        }
    }
}

/// The error's own words, its kind, and the error as the source.
impl From<SshError> for crate::Fault {
    fn from(err: SshError) -> Self {
        crate::Fault::with_source(err.fault_kind(), err.to_string(), err)
    }
}
