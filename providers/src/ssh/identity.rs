//! The daemon's SSH key: an unencrypted ed25519 key in an OpenSSH private key file.

use super::SshError;
use russh::keys::{Algorithm, HashAlg, PrivateKey, PublicKey};
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The private key's file name in [`SshIdentity::load_or_generate`]'s directory.
pub const KEY_FILE: &str = "id_ed25519";
/// The public key's file name next to it (one `authorized_keys` line).
pub const PUBLIC_KEY_FILE: &str = "id_ed25519.pub";
/// The comment on the public key line, which names the key in `authorized_keys`.
pub const KEY_COMMENT: &str = "swactor";
/// Largest key file read (an ed25519 key file is about 400 bytes).
const KEY_FILE_LEN_MAX: u64 = 64 << 10;

/// An ed25519 private key the daemon authenticates with. Cheap to clone.
#[derive(Clone)]
pub struct SshIdentity {
    key: Arc<PrivateKey>,
}

impl std::fmt::Debug for SshIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret, only which key this is.
        f.debug_struct("SshIdentity")
            .field("fingerprint", &self.fingerprint())
            .finish()
    }
}

impl SshIdentity {
    /// Reads an OpenSSH private key file (`-----BEGIN OPENSSH PRIVATE KEY-----`).
    ///
    /// # Errors
    /// [`SshError::Key`] naming the file when it cannot be read, is not an
    /// OpenSSH private key, is protected by a passphrase, or holds a key
    /// other than ed25519.
    pub fn load(path: &Path) -> Result<Self, SshError> {
        let fail = |reason: String| SshError::Key {
            path: path.to_owned(),
            reason,
        };
        let len = fs::metadata(path)
            .map_err(|e| fail(format!("cannot read the SSH key file: {e}")))?
            .len();
        if len > KEY_FILE_LEN_MAX {
            return Err(fail(format!(
                "the file holds {len} bytes, more than any SSH key file \
                 ({KEY_FILE_LEN_MAX} at most); is it the right file?"
            )));
        }
        let text =
            fs::read(path).map_err(|e| fail(format!("cannot read the SSH key file: {e}")))?;
        let key = PrivateKey::from_openssh(&text).map_err(|e| {
            fail(format!(
                "not an OpenSSH private key ({e}); create one with \
                 `ssh-keygen -t ed25519 -N '' -f {}`",
                path.display()
            ))
        })?;
        if key.is_encrypted() {
            return Err(fail(format!(
                "the key is protected by a passphrase, which the daemon cannot type; \
                 remove it with `ssh-keygen -p -N '' -f {}` or use another key",
                path.display()
            )));
        }
        if key.algorithm() != Algorithm::Ed25519 {
            return Err(fail(format!(
                "the key is {}, but only ed25519 keys are supported; create one with \
                 `ssh-keygen -t ed25519 -N '' -f <file>`",
                key.algorithm()
            )));
        }
        Ok(Self { key: Arc::new(key) })
    }

    /// The key in `dir/id_ed25519`, made on first use.
    ///
    /// A missing `dir` is created readable by its owner only (0700). A new
    /// key is written 0600 through a temporary file and a hard link, so two
    /// callers racing to make it end up with the same key, and a crash never
    /// leaves half a file. `dir/id_ed25519.pub` is (re)written with
    /// [`Self::public_openssh`] whenever it is missing.
    ///
    /// # Errors
    /// [`SshError::Key`] when the directory or a file cannot be made, or the
    /// existing key cannot be used (see [`Self::load`]).
    pub fn load_or_generate(dir: &Path) -> Result<Self, SshError> {
        let path = dir.join(KEY_FILE);
        let fail = |path: &Path, what: &str, e: io::Error| SshError::Key {
            path: path.to_owned(),
            reason: format!("cannot {what}: {e}"),
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| fail(dir, "create the key directory", e))?;
        let identity = match fs::symlink_metadata(&path) {
            Ok(_) => Self::load(&path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Self::generate_into(&path).map_err(|e| fail(&path, "write a new SSH key", e))?
            }
            Err(e) => return Err(fail(&path, "read the SSH key file", e)),
        };
        let public = dir.join(PUBLIC_KEY_FILE);
        if !public.exists() {
            let line = format!("{}\n", identity.public_openssh());
            write_new(&public, line.as_bytes(), 0o644)
                .or_else(|e| match e.kind() {
                    io::ErrorKind::AlreadyExists => Ok(()),
                    _ => Err(e),
                })
                .map_err(|e| fail(&public, "write the public key file", e))?;
        }
        Ok(identity)
    }

    /// Makes a key and links it in at `path`; when another caller got there
    /// first, loads theirs instead.
    fn generate_into(path: &Path) -> io::Result<Self> {
        let mut rng = russh::keys::key::safe_rng();
        let mut key = PrivateKey::random(&mut rng, Algorithm::Ed25519).map_err(io::Error::other)?;
        key.set_comment(KEY_COMMENT);
        let text = key
            .to_openssh(russh::keys::ssh_key::LineEnding::LF)
            .map_err(io::Error::other)?;
        match write_new(path, text.as_bytes(), 0o600) {
            Ok(()) => Ok(Self { key: Arc::new(key) }),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Self::load(path).map_err(|e| io::Error::other(e.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    /// The public key as one `authorized_keys` line, without a newline:
    /// `ssh-ed25519 AAAA… swactor`.
    pub fn public_openssh(&self) -> String {
        let mut public = self.key.public_key().clone();
        public.set_comment(KEY_COMMENT);
        public
            .to_openssh()
            .expect("an ed25519 public key always encodes")
    }

    /// The public key's fingerprint as `ssh-keygen -l` prints it (`SHA256:…`).
    pub fn fingerprint(&self) -> String {
        self.key.fingerprint(HashAlg::Sha256).to_string()
    }

    pub(super) fn private_key(&self) -> Arc<PrivateKey> {
        Arc::clone(&self.key)
    }

    #[cfg(test)]
    pub(super) fn public_key(&self) -> &PublicKey {
        self.key.public_key()
    }
}

/// Writes a file that must not exist yet, with `mode`, never visible half
/// written: to a temporary name in the same directory, synced, then hard
/// linked to `path` (which fails with `AlreadyExists` instead of replacing).
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(
        ".tmp{}.{}",
        std::process::id(),
        TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::hard_link(&tmp, path)
    })();
    let _ = fs::remove_file(&tmp);
    written
}

/// The fingerprint of any public key, as `ssh-keygen -l` prints it.
pub(super) fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_generated_key_is_private_reused_and_published() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ssh");
        let made = SshIdentity::load_or_generate(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);
        let public = fs::read_to_string(dir.join(PUBLIC_KEY_FILE)).unwrap();
        assert_eq!(public.trim_end(), made.public_openssh());
        assert!(public.starts_with("ssh-ed25519 AAAA") && public.ends_with(" swactor\n"));
        let again = SshIdentity::load_or_generate(&dir).unwrap();
        assert_eq!(again.public_key().key_data(), made.public_key().key_data());
        assert!(made.fingerprint().starts_with("SHA256:"));
        assert!(!format!("{made:?}").contains("PRIVATE"));
        let leftovers: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 2, "no temporary files left: {leftovers:?}");
    }

    #[test]
    fn unusable_key_files_are_refused_naming_the_file_and_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("nope");
        let err = SshIdentity::load(&missing).unwrap_err();
        assert!(
            matches!(&err, SshError::Key { path, .. } if *path == missing),
            "{err}"
        );
        assert!(err.to_string().contains("nope"), "{err}");

        let garbage = tmp.path().join("garbage");
        fs::write(&garbage, "hello").unwrap();
        let err = SshIdentity::load(&garbage).unwrap_err().to_string();
        assert!(
            err.contains("not an OpenSSH private key") && err.contains("garbage"),
            "{err}"
        );

        let mut rng = russh::keys::key::safe_rng();
        let key = PrivateKey::random(&mut rng, Algorithm::Ed25519).unwrap();
        let encrypted = key.encrypt(&mut rng, "secret").unwrap();
        let path = tmp.path().join("encrypted");
        fs::write(
            &path,
            encrypted.to_openssh(Default::default()).unwrap().as_bytes(),
        )
        .unwrap();
        let err = SshIdentity::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("passphrase") && err.contains("encrypted"),
            "{err}"
        );

        let ecdsa = PrivateKey::random(
            &mut rng,
            Algorithm::Ecdsa {
                curve: russh::keys::EcdsaCurve::NistP256,
            },
        )
        .unwrap();
        let path = tmp.path().join("ecdsa");
        fs::write(
            &path,
            ecdsa.to_openssh(Default::default()).unwrap().as_bytes(),
        )
        .unwrap();
        let err = SshIdentity::load(&path).unwrap_err().to_string();
        assert!(err.contains("only ed25519"), "{err}");
    }
}
