//! What an agent proves its identity with: a join token and its own iroh key,
//! both derived from the daemon's secret and the agent's (run, node, attempt).
//!
//! The daemon never has to be told an agent's key: it derives the public key
//! a given attempt's agent must connect with, and accepts that attempt's join
//! only from it. A token read off another process is therefore useless from
//! any other key. Providers hand the credentials to the agent in a file only
//! its owner can read ([`AgentCredentials::write_file`]); the agent reads and
//! deletes it, so no secret ever appears on a command line or in an
//! environment listing.

use std::io::{self, Write};
use std::path::Path;
use swactor_engine::iroh::{EndpointId, SecretKey};
use swactor_provisioning::ResourceKey;

/// The name providers give the credentials file in an agent's directory.
pub const CREDENTIALS_FILE: &str = "agent.credentials";

/// One attempt's agent credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentCredentials {
    /// The join token (the BLAKE3 keyed hash of the key under the daemon's secret), hex.
    pub token: String,
    /// The agent's iroh secret key.
    pub secret_key: [u8; 32],
}

impl std::fmt::Debug for AgentCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets, not even in a debug dump.
        f.write_str("AgentCredentials { .. }")
    }
}

/// A credentials file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The file could not be read.
    #[error("cannot read the credentials file {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The file is not in the expected form.
    #[error("the credentials file {path} is malformed")]
    Malformed {
        /// The file.
        path: String,
    },
}

impl AgentCredentials {
    /// The credentials of `key`'s agent under the daemon's `secret`.
    pub fn derive(secret: &[u8; 32], key: &ResourceKey) -> Self {
        Self::derive_text(secret, &key.to_string())
    }

    /// The credentials of the key whose text (`run/node/aN`, as a
    /// [`ResourceKey`] displays) is `id`: what a daemon checks a join
    /// against before it trusts the key enough to parse it.
    pub fn derive_text(secret: &[u8; 32], id: &str) -> Self {
        let token = blake3::keyed_hash(secret, id.as_bytes())
            .to_hex()
            .to_string();
        // A separate derivation, so the token says nothing about the key.
        let mut material = b"swactor agent key v1:".to_vec();
        material.extend_from_slice(id.as_bytes());
        let secret_key = *blake3::keyed_hash(secret, &material).as_bytes();
        Self { token, secret_key }
    }

    /// The iroh identity the agent connects with.
    pub fn endpoint_id(&self) -> EndpointId {
        SecretKey::from_bytes(&self.secret_key).public()
    }

    /// The agent's iroh secret key.
    pub fn iroh_key(&self) -> SecretKey {
        SecretKey::from_bytes(&self.secret_key)
    }

    /// The file's text: `token <hex>` and `key <hex>` lines.
    pub fn to_text(&self) -> String {
        let key: String = self.secret_key.iter().map(|b| format!("{b:02x}")).collect();
        format!("token {}\nkey {key}\n", self.token)
    }

    /// Parses [`AgentCredentials::to_text`].
    pub fn parse(text: &str) -> Option<Self> {
        let mut token = None;
        let mut secret_key = None;
        for line in text.lines() {
            match line.split_once(' ') {
                Some(("token", t)) if t.len() == 64 => token = Some(t.to_owned()),
                Some(("key", k)) if k.len() == 64 => {
                    let mut bytes = [0u8; 32];
                    for (i, b) in bytes.iter_mut().enumerate() {
                        *b = u8::from_str_radix(k.get(2 * i..2 * i + 2)?, 16).ok()?;
                    }
                    secret_key = Some(bytes);
                }
                _ => return None,
            }
        }
        Some(Self {
            token: token?,
            secret_key: secret_key?,
        })
    }

    /// Writes the file at `path`, readable and writable by its owner only,
    /// through a temporary file and a rename (never half written).
    ///
    /// # Errors
    /// Any I/O error.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = std::path::PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(self.to_text().as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    }

    /// Reads the file at `path` and removes it (the agent keeps the
    /// credentials in memory only).
    ///
    /// # Errors
    /// The file cannot be read or is malformed.
    pub fn take_file(path: &Path) -> Result<Self, CredentialsError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
            path: shown.clone(),
            source,
        })?;
        let creds = Self::parse(&text).ok_or(CredentialsError::Malformed { path: shown })?;
        // Best effort: a file left behind is still readable only by its owner.
        let _ = std::fs::remove_file(path);
        Ok(creds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId, RunId};

    fn key(attempt: u64) -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(attempt),
        }
    }

    #[test]
    fn credentials_are_bound_to_one_attempt_and_round_trip_through_their_file() {
        let secret = [7u8; 32];
        let a = AgentCredentials::derive(&secret, &key(1));
        let b = AgentCredentials::derive(&secret, &key(2));
        assert_ne!(a.token, b.token);
        assert_ne!(a.endpoint_id(), b.endpoint_id());
        assert_eq!(
            a,
            AgentCredentials::derive(&secret, &key(1)),
            "deterministic"
        );
        assert_ne!(
            a,
            AgentCredentials::derive(&[8u8; 32], &key(1)),
            "secret-bound"
        );
        assert_eq!(AgentCredentials::parse(&a.to_text()), Some(a.clone()));
        assert!(
            !format!("{a:?}").contains(&a.token),
            "no secret in debug output"
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CREDENTIALS_FILE);
        a.write_file(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(AgentCredentials::take_file(&path).unwrap(), a);
        assert!(!path.exists(), "taken means removed");
        assert!(AgentCredentials::take_file(&path).is_err());
        std::fs::write(&path, "token nope\n").unwrap();
        assert!(matches!(
            AgentCredentials::take_file(&path),
            Err(CredentialsError::Malformed { .. })
        ));
    }
}
