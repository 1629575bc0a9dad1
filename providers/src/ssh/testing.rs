//! A real OpenSSH server on 127.0.0.1 for tests: start it, stop it, restart it, change its host key.
//!
//! [`Sshd`] runs Debian's `/usr/sbin/sshd` (package `openssh-server`) in the
//! foreground with a configuration, host key, `authorized_keys` file and log
//! of its own in a directory the test gives it. It must run as root (sshd
//! drops privileges to its `sshd` user, which the package creates) and
//! accepts public key logins only, for `root` too.
//!
//! Each server is a host of its own: commands run in a home directory of its
//! own (`{dir}/home`, also `$HOME`), through a `ForceCommand`, so several
//! servers on this machine do not share what remote providers keep in a
//! host's home.
//!
//! Everything here panics with a message saying what to do: it is for tests.

use super::SshTarget;
use rustix::process::{Pid, Signal, kill_process};
use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::net::TcpListener;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server binary the harness runs.
pub const SSHD: &str = "/usr/sbin/sshd";
/// How long [`Sshd::start`] waits for the server to listen.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How many ports [`Sshd::start`] tries when another process takes the one it picked.
const PORT_TRIES_MAX: usize = 10;
/// How often the harness looks at the server while it waits.
const POLL: Duration = Duration::from_millis(20);

const CONFIG_FILE: &str = "sshd_config";
const HOST_KEY_FILE: &str = "ssh_host_ed25519_key";
const AUTHORIZED_KEYS_FILE: &str = "authorized_keys";
const PID_FILE: &str = "sshd.pid";
const LOG_FILE: &str = "sshd.log";
const HOME_DIR: &str = "home";

/// A running OpenSSH server on `127.0.0.1:{port}`; killed when dropped.
#[derive(Debug)]
pub struct Sshd {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Sshd {
    /// Starts a server whose files live in `dir` (which must exist) and
    /// which accepts the public keys `authorized` (`authorized_keys`
    /// lines), on a free port. Returns once it accepts connections.
    ///
    /// # Panics
    /// When `/usr/sbin/sshd` or `ssh-keygen` is missing, or the server does
    /// not start (its log is in the message).
    pub fn start(dir: &Path, authorized: &[String]) -> Self {
        assert!(
            Path::new(SSHD).exists(),
            "{SSHD} is missing: install openssh-server (`apt-get install -y openssh-server`; \
             .ci/run does) to run the SSH tests"
        );
        // sshd's privilege separation needs this directory; the package makes
        // it at boot through tmpfiles.d, which a container does not run.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create("/run/sshd")
            .expect("cannot create /run/sshd (the SSH tests must run as root)");
        let mut sshd = Self {
            dir: dir.to_owned(),
            port: 0,
            child: None,
        };
        sshd.set_authorized(authorized);
        sshd.make_host_key();
        for _ in 0..PORT_TRIES_MAX {
            sshd.port = free_port();
            if sshd.spawn_and_wait() {
                return sshd;
            }
        }
        panic!(
            "sshd found no free port in {PORT_TRIES_MAX} tries; its log:\n{}",
            sshd.log()
        );
    }

    /// `root@127.0.0.1:{port}`.
    pub fn target(&self) -> SshTarget {
        SshTarget {
            user: "root".to_owned(),
            host: "127.0.0.1".to_owned(),
            port: self.port,
        }
    }

    /// The port it listens on (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding its files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The host key's fingerprint (`SHA256:…`), as `ssh-keygen -l` computes it.
    pub fn host_key_fingerprint(&self) -> String {
        let public = self.dir.join(format!("{HOST_KEY_FILE}.pub"));
        let out = ssh_keygen(&["-l", "-E", "sha256", "-f", path_str(&public)]);
        // "256 SHA256:… comment (ED25519)"
        out.split_whitespace()
            .nth(1)
            .filter(|f| f.starts_with("SHA256:"))
            .unwrap_or_else(|| panic!("unexpected `ssh-keygen -l` output: {out}"))
            .to_owned()
    }

    /// Replaces the accepted public keys; the server reads the file at every login.
    pub fn set_authorized(&self, authorized: &[String]) {
        let mut text = authorized.join("\n");
        text.push('\n');
        fs::write(self.dir.join(AUTHORIZED_KEYS_FILE), text)
            .expect("cannot write the authorized_keys file");
    }

    /// Takes the host down: the server and every process it started (open
    /// connections, the commands they run) are killed, so the port refuses
    /// connections and open sessions break.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let root = Pid::from_child(&child);
        // Stop the listener first so it forks no new connection while its
        // descendants are collected.
        let _ = kill_process(root, Signal::STOP);
        let mut killed = HashSet::new();
        // A child forked just before the stop shows up in a later pass.
        for _ in 0..3 {
            for pid in descendants(root.as_raw_nonzero().get()) {
                if killed.insert(pid)
                    && let Some(pid) = Pid::from_raw(pid)
                {
                    let _ = kill_process(pid, Signal::STOP);
                }
            }
        }
        let _ = kill_process(root, Signal::KILL);
        for pid in killed {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
        let _ = child.wait();
    }

    /// Starts the server again after [`Self::stop`], on the same port with
    /// the same host key.
    ///
    /// # Panics
    /// When it does not start within a few seconds.
    pub fn start_again(&mut self) {
        self.stop();
        let deadline = Instant::now() + READY_TIMEOUT;
        // The port may be briefly held by another process's probe.
        while !self.spawn_and_wait() {
            assert!(
                Instant::now() < deadline,
                "sshd cannot listen on its port {} again; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Gives the server a new host key and restarts it (same port): what a
    /// reinstalled machine, or someone in the middle, looks like.
    pub fn rotate_host_key(&mut self) {
        self.stop();
        self.make_host_key();
        self.start_again();
    }

    /// Its log so far (sshd's own messages at level VERBOSE).
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join(LOG_FILE)
    }

    fn make_host_key(&self) {
        let key = self.dir.join(HOST_KEY_FILE);
        let _ = fs::remove_file(&key);
        let _ = fs::remove_file(self.dir.join(format!("{HOST_KEY_FILE}.pub")));
        ssh_keygen(&[
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "swactor-test-host",
            "-f",
            path_str(&key),
        ]);
    }

    /// The host's home directory: where its commands run, and `$HOME`.
    pub fn home(&self) -> PathBuf {
        self.dir.join(HOME_DIR)
    }

    fn write_config(&self) -> PathBuf {
        let file = |name: &str| self.dir.join(name).display().to_string();
        let config = format!(
            "Port {port}\n\
             ListenAddress 127.0.0.1\n\
             HostKey \"{host_key}\"\n\
             PidFile \"{pid}\"\n\
             AuthorizedKeysFile \"{authorized}\"\n\
             UsePAM no\n\
             StrictModes no\n\
             PermitRootLogin yes\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             AuthenticationMethods publickey\n\
             UseDNS no\n\
             PrintMotd no\n\
             PrintLastLog no\n\
             X11Forwarding no\n\
             LogLevel VERBOSE\n\
             MaxStartups 100:30:200\n\
             MaxSessions 100\n\
             MaxAuthTries 6\n\
             ForceCommand cd \"{home}\" && HOME=\"{home}\" exec /bin/sh -c \"$SSH_ORIGINAL_COMMAND\"\n",
            port = self.port,
            host_key = file(HOST_KEY_FILE),
            pid = file(PID_FILE),
            authorized = file(AUTHORIZED_KEYS_FILE),
            home = self.home().display(),
        );
        fs::create_dir_all(self.home()).expect("cannot make the host's home directory");
        let path = self.dir.join(CONFIG_FILE);
        fs::write(&path, config).expect("cannot write the sshd configuration");
        path
    }

    /// Spawns the server on `self.port`; `true` once it listens, `false`
    /// when the port is taken.
    fn spawn_and_wait(&mut self) -> bool {
        let config = self.write_config();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("cannot open the sshd log");
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0) as usize;
        let mut child = Command::new(SSHD)
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                log.try_clone().expect("cannot share the log file"),
            ))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {SSHD}: {e}"));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let log = self.log();
            let new = log.get(log_start..).unwrap_or("");
            if let Some(status) = child.try_wait().expect("cannot wait for sshd") {
                if new.contains("Address already in use") {
                    return false;
                }
                panic!("sshd exited ({status}) before it listened; its log:\n{new}");
            }
            if new.contains("Server listening on") {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("sshd did not listen within {READY_TIMEOUT:?}; its log:\n{new}");
            }
            std::thread::sleep(POLL);
        }
        self.child = Some(child);
        true
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nothing listens on right now (another process may still take it
/// before sshd does; [`Sshd::start`] then tries another).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("cannot bind a loopback port")
        .port()
}

/// The pids of every live descendant of `root`, from `/proc`.
fn descendants(root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut found = Vec::new();
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            found.push(child);
            todo.push(child);
        }
    }
    found
}

fn ssh_keygen(args: &[&str]) -> String {
    let out = Command::new("ssh-keygen")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run ssh-keygen ({e}): install openssh-client (openssh-server brings it)")
        });
    assert!(
        out.status.success(),
        "ssh-keygen {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("test directories have UTF-8 paths")
}
