//! The state directory: the daemon's identity, its ticket, the CLI's key, the join-token secret.

use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::{Path, PathBuf};
use swactor_engine::iroh::SecretKey;
use swactor_engine::net::{EndpointTicket, load_or_create_secret_key};

/// Environment variable naming the state directory.
pub(crate) const STATE_DIR_ENV: &str = "SWACTOR_STATE_DIR";
/// The state directory used when none is given.
pub(crate) const DEFAULT_STATE_DIR: &str = ".swactor";

/// Paths inside one state directory.
#[derive(Clone, Debug)]
pub(crate) struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// The directory named by `--state-dir`, `$SWACTOR_STATE_DIR`, or the default.
    pub(crate) fn path_from(arg: Option<PathBuf>) -> PathBuf {
        arg.or_else(|| std::env::var_os(STATE_DIR_ENV).map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
    }

    /// For the daemon: creates the directory if its parent exists.
    ///
    /// # Errors
    /// The parent is missing or the directory cannot be created.
    pub(crate) fn create(path: PathBuf) -> Result<Self> {
        if !path.exists() {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            if let Some(parent) = parent.filter(|p| !p.exists()) {
                bail!(
                    "cannot create the state directory {}: its parent {} does not exist",
                    path.display(),
                    parent.display()
                );
            }
            std::fs::create_dir(&path)
                .with_context(|| format!("cannot create the state directory {}", path.display()))?;
        }
        Self::open(path)
    }

    /// For clients: the directory must already exist.
    ///
    /// # Errors
    /// It does not exist.
    pub(crate) fn open(path: PathBuf) -> Result<Self> {
        if !path.is_dir() {
            bail!(
                "there is no state directory at {}: start a daemon with `swactor up` first, \
                 or point --state-dir (or ${STATE_DIR_ENV}) at the one it uses",
                path.display()
            );
        }
        let root = path.canonicalize().unwrap_or(path);
        Ok(Self { root })
    }

    /// The directory.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The daemon's persistent identity.
    ///
    /// # Errors
    /// The key file cannot be read or created.
    pub(crate) fn daemon_key(&self) -> Result<SecretKey> {
        let path = self.root.join("daemon.key");
        load_or_create_secret_key(&path).with_context(|| format!("daemon key {}", path.display()))
    }

    /// The CLI's identity (the daemon allowlists it).
    ///
    /// # Errors
    /// The key file cannot be read or created.
    pub(crate) fn cli_key(&self) -> Result<SecretKey> {
        let path = self.root.join("cli.key");
        load_or_create_secret_key(&path).with_context(|| format!("CLI key {}", path.display()))
    }

    fn ticket_path(&self) -> PathBuf {
        self.root.join("daemon.ticket")
    }

    /// Publishes the running daemon's ticket.
    ///
    /// # Errors
    /// The file cannot be written.
    pub(crate) fn write_ticket(&self, ticket: &EndpointTicket) -> Result<()> {
        write_atomic(&self.ticket_path(), ticket.to_string().as_bytes(), 0o600)
    }

    /// Removes the ticket (the daemon is stopping).
    pub(crate) fn remove_ticket(&self) {
        let _ = std::fs::remove_file(self.ticket_path());
    }

    /// The running daemon's ticket.
    ///
    /// # Errors
    /// No daemon has published one, or it is malformed.
    pub(crate) fn read_ticket(&self) -> Result<EndpointTicket> {
        let path = self.ticket_path();
        let text = std::fs::read_to_string(&path).map_err(|_| {
            anyhow::anyhow!(
                "no daemon is running for {} (there is no {}); start one with `swactor up`",
                self.root.display(),
                path.display()
            )
        })?;
        text.trim()
            .parse()
            .with_context(|| format!("the ticket in {} is malformed", path.display()))
    }

    /// The UDP port the daemon used last, so a restarted daemon is found by its agents.
    pub(crate) fn saved_port(&self) -> Option<u16> {
        std::fs::read_to_string(self.root.join("daemon.port"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Remembers the daemon's port.
    ///
    /// # Errors
    /// The file cannot be written.
    pub(crate) fn save_port(&self, port: u16) -> Result<()> {
        write_atomic(
            &self.root.join("daemon.port"),
            port.to_string().as_bytes(),
            0o644,
        )
    }

    /// The secret join tokens are derived from; created on first use.
    ///
    /// # Errors
    /// The file cannot be read or created, or has the wrong size.
    pub(crate) fn token_secret(&self) -> Result<[u8; 32]> {
        let path = self.root.join("token.secret");
        if !path.exists() {
            let mut secret = [0u8; 32];
            let mut urandom = std::fs::File::open("/dev/urandom").context("open /dev/urandom")?;
            std::io::Read::read_exact(&mut urandom, &mut secret).context("read /dev/urandom")?;
            write_atomic(&path, &secret, 0o600)?;
        }
        let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        bytes
            .try_into()
            .map_err(|_| anyhow::anyhow!("{} must hold exactly 32 bytes", path.display()))
    }

    /// Claims the directory for one daemon: fails if another live daemon holds it.
    ///
    /// # Errors
    /// Another daemon is running here.
    pub(crate) fn claim(&self) -> Result<PidGuard> {
        let path = self.root.join("daemon.pid");
        let holder = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|pid| {
                *pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists()
            });
        if let Some(pid) = holder {
            bail!(
                "a daemon (pid {pid}) is already running for {}; stop it with `swactor down` \
                 or use another --state-dir",
                self.root.display()
            );
        }
        write_atomic(&path, std::process::id().to_string().as_bytes(), 0o644)?;
        Ok(PidGuard { path })
    }
}

/// Removes the pid file when the daemon ends.
#[derive(Debug)]
pub(crate) struct PidGuard {
    path: PathBuf,
}

impl Drop for PidGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes a file via a temporary sibling and a rename, so readers never see half of it.
///
/// # Errors
/// Any I/O error, naming the path.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}
