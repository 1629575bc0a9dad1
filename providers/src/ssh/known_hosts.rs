//! The host keys the daemon trusts, in a file of OpenSSH's `known_hosts` syntax.

use super::identity::fingerprint;
use russh::keys::PublicKey;
use rustix::fs::{FlockOperation, flock};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Largest known hosts file read; a larger one is refused as not ours.
const FILE_LEN_MAX: u64 = 16 << 20;

/// A known hosts file: one line per host, `[host]:port ssh-ed25519 AAAA…`
/// (plain `host` for port 22), as OpenSSH writes and `ssh -o
/// UserKnownHostsFile=…` reads.
///
/// Lines may list several comma-separated names and carry a comment after
/// the key. Only exact names match: hashed names (`|1|…`), patterns and
/// marker lines (`@cert-authority`, `@revoked`) are skipped. A host matches
/// when any line for it holds the offered key.
///
/// # Guarantees
/// The file is created (0600) only when a first key is recorded. Every
/// read holds a shared lock and every check-then-record an exclusive one on
/// the file, so sessions connecting at the same time, in this process or in
/// others, never record two keys for one host.
#[derive(Clone, Debug)]
pub struct KnownHosts {
    path: PathBuf,
}

/// What a known hosts file says about a host's offered key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// A line for the host holds the key.
    Known,
    /// No line names the host.
    Unknown,
    /// Lines name the host, none with this key; the first such key.
    Changed { known: PublicKey },
}

impl KnownHosts {
    /// The file at `path`; nothing is read or created until a session needs it.
    pub fn open(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the file says about `offered` for `name` (as
    /// [`super::SshTarget::known_hosts_name`] writes it).
    pub(super) fn check(&self, name: &str, offered: &PublicKey) -> io::Result<Verdict> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Verdict::Unknown),
            Err(e) => return Err(e),
        };
        flock(&file, FlockOperation::LockShared)?;
        Ok(verdict(&read_bounded(&mut file)?, name, offered))
    }

    /// Records `offered` for `name` unless the file already says something
    /// about `name` (another session may have recorded it since
    /// [`Self::check`]), and returns what it said before.
    pub(super) fn record(&self, name: &str, offered: &PublicKey) -> io::Result<Verdict> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)?;
        flock(&file, FlockOperation::LockExclusive)?;
        let text = read_bounded(&mut file)?;
        let before = verdict(&text, name, offered);
        if before == Verdict::Unknown {
            let mut key = offered.clone();
            key.set_comment("");
            let key = key.to_openssh().map_err(io::Error::other)?;
            let separator = if text.is_empty() || text.ends_with('\n') {
                ""
            } else {
                "\n"
            };
            // One write of one line: O_APPEND puts it after whatever is there.
            file.write_all(format!("{separator}{name} {key}\n").as_bytes())?;
            file.sync_data()?;
        }
        Ok(before)
    }
}

fn read_bounded(file: &mut File) -> io::Result<String> {
    file.seek(SeekFrom::Start(0))?;
    let mut text = String::new();
    file.take(FILE_LEN_MAX + 1).read_to_string(&mut text)?;
    if text.len() as u64 > FILE_LEN_MAX {
        return Err(io::Error::other(format!(
            "the file is larger than {FILE_LEN_MAX} bytes; is it the right file?"
        )));
    }
    Ok(text)
}

fn verdict(text: &str, name: &str, offered: &PublicKey) -> Verdict {
    let mut recorded = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('@') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(names), Some(algorithm), Some(base64)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if !names.split(',').any(|n| n == name) {
            continue;
        }
        let Ok(key) = PublicKey::from_openssh(&format!("{algorithm} {base64}")) else {
            continue;
        };
        if key.key_data() == offered.key_data() {
            return Verdict::Known;
        }
        recorded.get_or_insert(key);
    }
    match recorded {
        Some(known) => Verdict::Changed { known },
        None => Verdict::Unknown,
    }
}

impl Verdict {
    /// The recorded key's fingerprint, for [`Verdict::Changed`].
    pub(super) fn known_fingerprint(&self) -> Option<String> {
        match self {
            Self::Changed { known } => Some(fingerprint(known)),
            Self::Known | Self::Unknown => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use russh::keys::{Algorithm, PrivateKey};

    fn key() -> PublicKey {
        let mut rng = russh::keys::key::safe_rng();
        PrivateKey::random(&mut rng, Algorithm::Ed25519)
            .unwrap()
            .public_key()
            .clone()
    }

    #[test]
    fn a_recorded_key_is_known_another_is_a_change_and_other_hosts_are_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let known = KnownHosts::open(&dir.path().join("known_hosts"));
        let (a, b) = (key(), key());
        assert_eq!(known.check("[h]:2222", &a).unwrap(), Verdict::Unknown);
        assert!(!known.path().exists(), "checking creates nothing");
        assert_eq!(known.record("[h]:2222", &a).unwrap(), Verdict::Unknown);
        assert_eq!(
            known.record("[h]:2222", &b).unwrap().known_fingerprint(),
            Some(fingerprint(&a))
        );
        assert_eq!(known.check("[h]:2222", &a).unwrap(), Verdict::Known);
        assert_eq!(
            known.check("h", &a).unwrap(),
            Verdict::Unknown,
            "port 22 is another entry"
        );
        assert_eq!(
            known.check("[h]:2222", &b).unwrap(),
            Verdict::Changed { known: a.clone() }
        );
        let text = std::fs::read_to_string(known.path()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.starts_with("[h]:2222 ssh-ed25519 AAAA"), "{text}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(known.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn lines_written_by_hand_are_read_like_openssh_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("known_hosts");
        let (a, b) = (key(), key());
        let line = |k: &PublicKey| k.to_openssh().unwrap();
        std::fs::write(
            &path,
            format!(
                "# comment\n\n|1|hashed= {}\n@revoked h {}\nother,h {} a comment\nh {}",
                line(&b),
                line(&b),
                line(&a),
                line(&b)
            ),
        )
        .unwrap();
        let known = KnownHosts::open(&path);
        assert_eq!(known.check("h", &a).unwrap(), Verdict::Known);
        assert_eq!(
            known.check("h", &b).unwrap(),
            Verdict::Known,
            "any line may match"
        );
        assert_eq!(
            known.check("other", &b).unwrap(),
            Verdict::Changed { known: a.clone() }
        );
        // A record after a last line with no newline starts a new line.
        assert_eq!(known.record("n", &a).unwrap(), Verdict::Unknown);
        assert_eq!(known.check("n", &a).unwrap(), Verdict::Known);
        assert_eq!(known.check("h", &b).unwrap(), Verdict::Known);
    }
}
