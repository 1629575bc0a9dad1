//! The state directory: the daemon's lock and identity, its ticket, the CLI's key, the join-token secret.

use anyhow::{Context, Result, bail};
use rustix::fs::{FlockOperation, flock};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::net::IpAddr;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use swactor_engine::iroh::SecretKey;
use swactor_engine::net::{EndpointTicket, load_or_create_secret_key};

/// Environment variable naming the state directory.
pub const STATE_DIR_ENV: &str = "SWACTOR_STATE_DIR";
/// Where the daemon's listen and advertised addresses are kept.
pub const NETWORK_FILE: &str = "daemon.network";
/// The deployment the journal is, kept beside it: what a lost journal leaves.
pub const DEPLOYMENT_FILE: &str = "deployment";
/// Where the agent binary named with `--agent-binary` is kept.
pub const AGENT_BINARY_FILE: &str = "daemon.agent-binary";
/// The state directory used when none is given.
pub const DEFAULT_STATE_DIR: &str = ".swactor";

/// Makes an existing state directory its owner's alone (0700), or says why
/// it cannot be: one that other users may enter or list would show them job
/// logs and workspaces.
fn make_private(path: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read the state directory {}", path.display()))?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        bail!(
            "cannot use {} as the state directory: other users may open it (mode {mode:o}) and \
             it belongs to user {}, not to this one ({me}); make it private (`chmod 700`) or \
             point --state-dir elsewhere",
            path.display(),
            meta.uid()
        );
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7700 | 0o700))
        .with_context(|| {
            format!(
                "cannot make the state directory {} private (it is mode {mode:o}); \
                 `chmod 700` it or point --state-dir elsewhere",
                path.display()
            )
        })?;
    eprintln!(
        "swactor: made the state directory {} private (mode 700; it was {mode:o}): it holds \
         keys, the journal and job logs",
        path.display()
    );
    Ok(())
}

/// Paths inside one state directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// The directory named by `--state-dir`, `$SWACTOR_STATE_DIR`, or the
    /// default. An empty variable counts as unset, as an empty `--state-dir`
    /// does: an empty path names no directory.
    pub fn path_from(arg: Option<PathBuf>) -> PathBuf {
        arg.filter(|p| !p.as_os_str().is_empty())
            .or_else(|| {
                std::env::var_os(STATE_DIR_ENV)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            })
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
    }

    /// For the daemon: creates the directory if its parent exists.
    ///
    /// Safe to race: of two daemons creating it at once, one creates it and
    /// the other finds it; [`StateDir::lock`] then picks one of them.
    ///
    /// # Errors
    /// The parent is missing or the directory cannot be created.
    pub fn create(path: PathBuf) -> Result<Self> {
        // Only its user may enter it: it holds keys, the token secret and the journal.
        let made = {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new().mode(0o700).create(&path)
        };
        match made {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let parent = path
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                bail!(
                    "cannot create the state directory {}: its parent {} does not exist",
                    path.display(),
                    parent.display()
                );
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("cannot create the state directory {}", path.display())
                });
            }
        }
        if !path.is_dir() {
            bail!(
                "cannot use {} as the state directory: it is not a directory",
                path.display()
            );
        }
        make_private(&path)?;
        Self::open(path)
    }

    /// Files the daemon makes from here on (and those of the processes it
    /// starts) are its user's alone: the state directory holds keys, the
    /// token secret, the journal, job logs and workspaces, and a job's
    /// output may quote a secret it was given. Nothing in it is meant for
    /// other users.
    pub fn private_files_from_now_on() {
        let _ = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    }

    /// For clients: the directory must already exist.
    ///
    /// # Errors
    /// It does not exist.
    pub fn open(path: PathBuf) -> Result<Self> {
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
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The daemon's persistent identity.
    ///
    /// # Errors
    /// The key file cannot be read or created.
    pub fn daemon_key(&self) -> Result<SecretKey> {
        let path = self.root.join("daemon.key");
        load_or_create_secret_key(&path).with_context(|| format!("daemon key {}", path.display()))
    }

    /// The identity of the daemon's control endpoint (the one the CLI dials).
    ///
    /// # Errors
    /// The key file cannot be read or created.
    pub fn control_key(&self) -> Result<SecretKey> {
        let path = self.root.join("control.key");
        load_or_create_secret_key(&path).with_context(|| format!("control key {}", path.display()))
    }

    /// The CLI's identity (the daemon allowlists it).
    ///
    /// # Errors
    /// The key file cannot be read or created.
    pub fn cli_key(&self) -> Result<SecretKey> {
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
    pub fn write_ticket(&self, ticket: &EndpointTicket) -> Result<()> {
        write_atomic(&self.ticket_path(), ticket.to_string().as_bytes(), 0o600)
    }

    /// Removes the ticket (the daemon is stopping).
    pub fn remove_ticket(&self) {
        let _ = std::fs::remove_file(self.ticket_path());
    }

    /// The running daemon's ticket.
    ///
    /// # Errors
    /// No daemon has published one, or it is malformed.
    pub fn read_ticket(&self) -> Result<EndpointTicket> {
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
    pub fn saved_port(&self) -> Option<u16> {
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
    pub fn save_port(&self, port: u16) -> Result<()> {
        write_atomic(
            &self.root.join("daemon.port"),
            port.to_string().as_bytes(),
            0o600,
        )
    }

    /// The UDP port the daemon's control endpoint used last, so a CLI
    /// ticket given out earlier (another replica's, say) still names it.
    pub fn saved_control_port(&self) -> Option<u16> {
        std::fs::read_to_string(self.root.join("control.port"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Remembers the control endpoint's port.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn save_control_port(&self, port: u16) -> Result<()> {
        write_atomic(
            &self.root.join("control.port"),
            port.to_string().as_bytes(),
            0o600,
        )
    }

    /// The addresses the last daemon listened on and gave its agents
    /// (`--listen`, `--advertise`), if they were saved and can be read.
    /// Read from a path, since `up` settles its addresses before it makes
    /// the directory.
    pub fn saved_network(root: &Path) -> Option<(IpAddr, Option<IpAddr>)> {
        let text = std::fs::read_to_string(root.join(NETWORK_FILE)).ok()?;
        let mut listen = None;
        let mut advertise = None;
        for line in text.lines() {
            match line.split_once('=') {
                Some(("listen", v)) => listen = Some(v.trim().parse().ok()?),
                Some(("advertise", v)) => advertise = Some(v.trim().parse().ok()?),
                _ => {}
            }
        }
        Some((listen?, advertise))
    }

    /// Remembers the addresses the daemon listens on and gives its agents,
    /// so a daemon started again without `--listen`/`--advertise` is still
    /// reachable by the agents on other machines.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn save_network(&self, listen: IpAddr, advertise: Option<IpAddr>) -> Result<()> {
        let mut text = format!("listen={listen}\n");
        if let Some(ip) = advertise {
            text.push_str(&format!("advertise={ip}\n"));
        }
        write_atomic(&self.root.join(NETWORK_FILE), text.as_bytes(), 0o600)
    }

    /// The agent binary the last daemon was told to use (`--agent-binary`
    /// or `$SWACTOR_AGENT_BINARY`), as an absolute path, if it was saved.
    /// Read from a path, as [`Self::saved_network`] is.
    pub fn saved_agent_binary(root: &Path) -> Option<PathBuf> {
        use std::os::unix::ffi::OsStringExt;
        let bytes = std::fs::read(root.join(AGENT_BINARY_FILE)).ok()?;
        let path = PathBuf::from(std::ffi::OsString::from_vec(bytes));
        path.is_absolute().then_some(path)
    }

    /// Remembers the agent binary the daemon was told to use, so a daemon
    /// started again without `--agent-binary` uploads the same one.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn save_agent_binary(&self, path: &Path) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        write_atomic(
            &self.root.join(AGENT_BINARY_FILE),
            path.as_os_str().as_bytes(),
            0o600,
        )
    }

    /// The deployment this directory's journal is (see
    /// [`JournalMeta::deployment`]): the journal's own when it records one
    /// (`None` for a journal from before deployments), else the one in
    /// `deployment` when that file was kept (a journal that was lost), else
    /// a new one. The file is kept up to date either way, so a journal lost
    /// later still leaves its deployment behind.
    ///
    /// [`JournalMeta::deployment`]: swactor_provisioning::JournalMeta::deployment
    ///
    /// # Errors
    /// The file cannot be read or written, or holds no deployment id.
    pub fn deployment(
        &self,
        journal: Option<&swactor_provisioning::JournalImage>,
    ) -> Result<Option<String>> {
        let path = self.root.join(DEPLOYMENT_FILE);
        let kept = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let id = text.trim().to_owned();
                match swactor_providers::check_deployment(&id) {
                    Ok(()) => Some(id),
                    // The journal's own id wins, and the file is rewritten.
                    Err(_) if journal.is_some() => None,
                    Err(e) => anyhow::bail!("{}: {e}", path.display()),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
        };
        let id = match journal {
            Some(image) => image.meta.deployment.clone(),
            None => Some(match kept.clone() {
                Some(id) => id,
                None => {
                    let mut bytes = [0u8; 4];
                    let mut urandom =
                        std::fs::File::open("/dev/urandom").context("open /dev/urandom")?;
                    std::io::Read::read_exact(&mut urandom, &mut bytes)
                        .context("read /dev/urandom")?;
                    bytes.iter().map(|b| format!("{b:02x}")).collect()
                }
            }),
        };
        if let Some(id) = &id
            && kept.as_ref() != Some(id)
        {
            write_atomic(&path, format!("{id}\n").as_bytes(), 0o600)?;
        }
        Ok(id)
    }

    /// The secret join tokens are derived from; created on first use.
    ///
    /// # Errors
    /// The file cannot be read or created, or has the wrong size.
    pub fn token_secret(&self) -> Result<[u8; 32]> {
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

    fn lock_path(&self) -> PathBuf {
        self.root.join("daemon.lock")
    }

    /// The daemon's journal.
    // Unused until the daemon opens its journal (daemon.rs is being rewritten
    // for that separately); remove this allow then.
    #[allow(dead_code)]
    pub fn journal_path(&self) -> PathBuf {
        self.root.join("journal.redb")
    }

    /// Claims the directory for this daemon for as long as the returned lock lives.
    ///
    /// Takes an exclusive `flock` on `daemon.lock` and writes this process's
    /// pid into it. The kernel drops the lock when the process ends however
    /// it ends, so a killed daemon never blocks the next one. When the lock
    /// is held this blocks for up to [`LOCK_RETRY_MAX`] plus [`PID_WAIT_MAX`]
    /// before failing.
    ///
    /// # Errors
    /// Another daemon holds the lock (the message names its pid when it can
    /// be read), or the lock file cannot be opened or written.
    pub fn lock(&self) -> Result<DaemonLock> {
        let path = self.lock_path();
        // The directory itself is locked first: a lock file deleted by hand
        // (or replaced) cannot let a second daemon in, or hide the running
        // one from the CLI, since the directory is still the same one.
        let dir = File::open(&self.root)
            .with_context(|| format!("cannot open {}", self.root.display()))?;
        self.take(&dir, &path)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        self.take(&file, &path)?;
        // The newline marks the pid as complete for readers.
        let pid = format!("{}\n", std::process::id());
        file.set_len(0)
            .and_then(|()| file.write_all_at(pid.as_bytes(), 0))
            .and_then(|()| file.sync_all())
            .with_context(|| format!("cannot write the pid into {}", path.display()))?;
        Ok(DaemonLock { file, _dir: dir })
    }

    /// Takes an exclusive lock on `what` (the directory or the lock file at
    /// `path`), or says who holds it.
    fn take(&self, what: &File, path: &Path) -> Result<()> {
        // A client probing with a shared lock (`running_daemon`) holds it for
        // microseconds; retry briefly so such a probe is never taken for a daemon.
        let started = Instant::now();
        loop {
            match flock(what, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(()),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                    if started.elapsed() >= LOCK_RETRY_MAX {
                        let holder = DaemonHolder {
                            pid: read_holder_pid(path),
                        };
                        bail!(
                            "{holder} is already running for {}; stop it with `swactor down` \
                             or use another --state-dir",
                            self.root.display()
                        );
                    }
                    std::thread::sleep(LOCK_RETRY_INTERVAL);
                }
                Err(e) => {
                    return Err(std::io::Error::from(e))
                        .with_context(|| format!("cannot lock {}", path.display()));
                }
            }
        }
    }

    /// Whether a daemon ever ran on this directory (its lock file exists).
    /// A directory without one may still hold a ticket copied from a daemon
    /// that runs elsewhere.
    pub fn has_lock_file(&self) -> bool {
        self.lock_path().exists()
    }

    /// For clients: the daemon holding this directory's lock, if one does.
    ///
    /// Probes with a non-blocking shared lock on its own file description,
    /// released at once when it succeeds.
    pub fn running_daemon(&self) -> Option<DaemonHolder> {
        let path = self.lock_path();
        // The directory's lock is the daemon's, whatever became of its lock
        // file; the file's is looked at too, for a daemon of an older build.
        if let Ok(dir) = File::open(&self.root) {
            match flock(&dir, FlockOperation::NonBlockingLockShared) {
                Ok(()) => {
                    let _ = flock(&dir, FlockOperation::Unlock);
                }
                Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                    return Some(DaemonHolder {
                        pid: read_holder_pid(&path),
                    });
                }
                Err(_) => {}
            }
        }
        // No lock file: no daemon has ever run here.
        let file = File::open(&path).ok()?;
        match flock(&file, FlockOperation::NonBlockingLockShared) {
            Ok(()) => {
                let _ = flock(&file, FlockOperation::Unlock);
                None
            }
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => Some(DaemonHolder {
                pid: read_holder_pid(&path),
            }),
            Err(_) => None,
        }
    }
}

/// How long [`StateDir::lock`] retries a held lock before giving up.
const LOCK_RETRY_MAX: Duration = Duration::from_millis(100);
/// The pause between two of those tries.
const LOCK_RETRY_INTERVAL: Duration = Duration::from_millis(10);
/// How long to wait for a new holder to write its pid over an old one.
const PID_WAIT_MAX: Duration = Duration::from_millis(500);

/// The daemon's hold on its state directory; dropping it (or the process
/// ending) releases the directory.
#[derive(Debug)]
pub struct DaemonLock {
    /// Opened with `O_CLOEXEC` (std's default), so agents the daemon starts
    /// do not inherit the lock and keep it after the daemon exits.
    file: File,
    /// The state directory, locked too (also `O_CLOEXEC`).
    _dir: File,
}

impl Drop for DaemonLock {
    fn drop(&mut self) {
        // Leave no pid behind for a reader to mistake for a live holder; the
        // file itself stays, since removing it would let two daemons lock two
        // different files.
        let _ = self.file.set_len(0);
    }
}

/// A daemon holding a state directory's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonHolder {
    /// Its pid, when the lock file names a live process.
    pub pid: Option<u32>,
}

impl fmt::Display for DaemonHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "a daemon (pid {pid})"),
            None => f.write_str("another daemon"),
        }
    }
}

/// The pid in a held lock file. The holder writes it just after locking, so
/// an empty file, a half-written pid or the pid of a dead earlier holder is
/// re-read for up to [`PID_WAIT_MAX`].
fn read_holder_pid(path: &Path) -> Option<u32> {
    let started = Instant::now();
    loop {
        let pid = std::fs::read_to_string(path)
            .ok()
            .filter(|text| text.ends_with('\n'))
            .and_then(|text| text.trim().parse::<u32>().ok())
            .filter(|pid| is_alive(*pid));
        if pid.is_some() || started.elapsed() >= PID_WAIT_MAX {
            return pid;
        }
        std::thread::sleep(LOCK_RETRY_INTERVAL);
    }
}

/// Whether `pid` is a running process (not a zombie, which holds no locks).
fn is_alive(pid: u32) -> bool {
    // `stat` is "pid (comm) state ..."; comm may hold spaces, so split after ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace()
                .next()
                .map(|state| !matches!(state, "Z" | "X"))
        })
        .unwrap_or(false)
}

/// Writes a file via a temporary sibling and a rename, so readers never see half of it.
///
/// # Errors
/// Any I/O error, naming the path.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_addresses_round_trip_and_a_damaged_file_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::create(dir.path().join("state")).unwrap();
        assert_eq!(StateDir::saved_network(state.root()), None);
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let public: IpAddr = "192.0.2.7".parse().unwrap();
        state.save_network(any, Some(public)).unwrap();
        assert_eq!(
            StateDir::saved_network(state.root()),
            Some((any, Some(public)))
        );
        let v6: IpAddr = "::1".parse().unwrap();
        state.save_network(v6, None).unwrap();
        assert_eq!(StateDir::saved_network(state.root()), Some((v6, None)));
        for damaged in ["listen=not-an-ip\n", "advertise=192.0.2.7\n", ""] {
            std::fs::write(state.root().join(NETWORK_FILE), damaged).unwrap();
            assert_eq!(StateDir::saved_network(state.root()), None, "{damaged:?}");
        }
    }

    #[test]
    fn a_deployment_is_made_once_kept_beside_the_journal_and_the_journals_own_wins() {
        use swactor_provisioning::{JournalImage, RunId};
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::create(dir.path().join("state")).unwrap();
        let file = state.root().join(DEPLOYMENT_FILE);
        // A new journal: a new id, kept in the file (0600).
        let made = state.deployment(None).unwrap().unwrap();
        swactor_providers::check_deployment(&made).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), made);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // The journal was lost, the file kept: the same deployment.
        assert_eq!(
            state.deployment(None).unwrap().as_deref(),
            Some(made.as_str())
        );
        // A journal's own id wins, and the file follows it.
        let mut image = JournalImage::new(RunId::new("r"));
        image.meta.deployment = Some("0123abcd".to_owned());
        assert_eq!(
            state.deployment(Some(&image)).unwrap().as_deref(),
            Some("0123abcd")
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), "0123abcd");
        // A journal from before deployments has none.
        image.meta.deployment = None;
        assert_eq!(state.deployment(Some(&image)).unwrap(), None);
        // A damaged file beside a journal that records an id is rewritten.
        image.meta.deployment = Some("0123abcd".to_owned());
        std::fs::write(&file, "not an id\n").unwrap();
        assert_eq!(
            state.deployment(Some(&image)).unwrap().as_deref(),
            Some("0123abcd")
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), "0123abcd");
        // Without a journal, a damaged file is refused, naming it.
        std::fs::write(&file, "not an id\n").unwrap();
        let e = state.deployment(None).unwrap_err().to_string();
        assert!(
            e.contains("deployment") && e.contains("not a deployment id"),
            "{e}"
        );
    }

    #[test]
    fn a_second_lock_on_the_same_directory_fails_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::create(dir.path().join("state")).unwrap();
        assert_eq!(state.running_daemon(), None, "no daemon has run here");
        let first = state.lock().unwrap();
        // Another open file description in the same process, as a second daemon would have.
        let err = state.lock().unwrap_err().to_string();
        let pid = std::process::id();
        assert!(
            err.contains(&format!("a daemon (pid {pid}) is already running for")),
            "{err}"
        );
        assert!(err.contains("swactor down"), "{err}");
        assert_eq!(
            state.running_daemon(),
            Some(DaemonHolder { pid: Some(pid) })
        );
        // The probe released its shared lock: the holder is unaffected and a
        // second probe sees the same.
        assert_eq!(
            state.running_daemon(),
            Some(DaemonHolder { pid: Some(pid) })
        );

        drop(first);
        assert_eq!(state.running_daemon(), None);
        let second = state.lock().unwrap();
        assert_eq!(
            state.running_daemon(),
            Some(DaemonHolder { pid: Some(pid) })
        );
        drop(second);
    }

    #[test]
    fn a_held_lock_whose_pid_cannot_be_read_names_another_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::create(dir.path().join("state")).unwrap();
        let _lock = state.lock().unwrap();
        std::fs::write(state.root().join("daemon.lock"), "not a pid\n").unwrap();
        let err = state.lock().unwrap_err().to_string();
        assert!(
            err.starts_with("another daemon is already running for"),
            "{err}"
        );
        assert_eq!(state.running_daemon(), Some(DaemonHolder { pid: None }));
    }

    #[test]
    fn creating_a_state_directory_tolerates_a_race_and_needs_its_parent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        StateDir::create(path.clone()).unwrap();
        // Found already made, as the loser of a race finds it.
        let again = StateDir::create(path.clone()).unwrap();
        assert_eq!(again.journal_path(), again.root().join("journal.redb"));

        let orphan = dir.path().join("missing").join("state");
        let err = StateDir::create(orphan).unwrap_err().to_string();
        assert!(
            err.contains("its parent") && err.contains("does not exist"),
            "{err}"
        );

        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = StateDir::create(file).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}
