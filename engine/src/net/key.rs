//! The endpoint's secret key, persisted so a daemon keeps its identity across restarts.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use iroh::SecretKey;

/// A secret key file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// Reading the existing file failed.
    #[error("cannot read secret key file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Creating the file (or its temporary sibling) failed.
    #[error("cannot write secret key file {path}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The file exists but does not hold 64 hex digits.
    #[error(
        "secret key file {path} is malformed: expected 64 hex digits, found {found_len} characters"
    )]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Length of the trimmed contents.
        found_len: usize,
    },
    /// The file exists but other users may read it.
    #[error(
        "secret key file {path} has mode {mode:o}; it must not be readable by group or others (chmod 600)"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

/// Loads the secret key at `path`, creating it (mode 0600) if absent.
///
/// The file holds the 32 key bytes as 64 lowercase hex digits and a newline.
/// Creation is atomic: the key is written to a private temporary file and
/// hard-linked into place, so two processes racing on a fresh path end up
/// with the same key and a crash never leaves a half-written file behind.
/// This does blocking file I/O; call it at startup or on the blocking pool.
///
/// # Errors
/// I/O failures, a malformed file, or a file readable by group or others.
pub fn load_or_create_secret_key(path: &Path) -> Result<SecretKey, KeyFileError> {
    match fs::read_to_string(path) {
        Ok(text) => return parse_key_file(path, &text),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(KeyFileError::Read {
                path: path.to_owned(),
                source,
            });
        }
    }
    let key = SecretKey::generate();
    let text = format!("{}\n", data_encoding::HEXLOWER.encode(&key.to_bytes()));
    let tmp = temp_sibling(path);
    let write = |path: &Path| -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()
    };
    write(&tmp).map_err(|source| KeyFileError::Write {
        path: tmp.clone(),
        source,
    })?;
    let linked = fs::hard_link(&tmp, path);
    // The temporary name has served its purpose either way.
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(key),
        // Someone else created it first: theirs wins, so both agree.
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
            let text = fs::read_to_string(path).map_err(|source| KeyFileError::Read {
                path: path.to_owned(),
                source,
            })?;
            parse_key_file(path, &text)
        }
        Err(source) => Err(KeyFileError::Write {
            path: path.to_owned(),
            source,
        }),
    }
}

fn parse_key_file(path: &Path, text: &str) -> Result<SecretKey, KeyFileError> {
    let mode = fs::metadata(path)
        .map_err(|source| KeyFileError::Read {
            path: path.to_owned(),
            source,
        })?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Permissions {
            path: path.to_owned(),
            mode,
        });
    }
    let trimmed = text.trim();
    let malformed = || KeyFileError::Malformed {
        path: path.to_owned(),
        found_len: trimmed.len(),
    };
    let bytes = data_encoding::HEXLOWER_PERMISSIVE
        .decode(trimmed.as_bytes())
        .map_err(|_| malformed())?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|_| malformed())?;
    Ok(SecretKey::from_bytes(&bytes))
}

fn temp_sibling(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|name| name.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp.{}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_key_file_is_created_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret.key");
        let first = load_or_create_secret_key(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let second = load_or_create_secret_key(&path).unwrap();
        assert_eq!(first.public(), second.public());
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }

    #[test]
    fn a_malformed_key_file_is_rejected_with_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret.key");
        fs::write(&path, "not hex at all\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let err = load_or_create_secret_key(&path).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Malformed { found_len: 14, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_world_readable_key_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret.key");
        load_or_create_secret_key(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create_secret_key(&path).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Permissions { mode: 0o644, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("chmod 600"));
    }
}
