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
//! host's home. `$HOME` is that directory from the start of the session
//! (`SetEnv`), so the login shell does not read this machine's own
//! `~/.bashrc`: bash does so for SSH commands, and a slow or locking one
//! (pyenv's rehash takes a lock that a killed session leaves behind) would
//! stall every command. Programs in `{dir}/bin` come first on its `PATH`
//! (the Vast.ai mock puts an `nvidia-smi` there).
//!
//! [`NetNs`] makes a network namespace joined to this one by a veth pair,
//! so an [`Sshd`] started in it ([`Sshd::start_in`]) is a host on another
//! network: its agents reach the daemon through a non-loopback address, as
//! on a real remote machine, and no traffic leaves this machine.
//!
//! Everything here panics with a message saying what to do: it is for tests.

use super::SshTarget;
use rustix::process::{Pid, Signal, kill_process};
use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
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

/// Set to `1` (as `.ci/run` does) to make [`sshd_available`] fail a test
/// instead of skipping it when the server is missing.
pub const REQUIRE_SSHD_ENV: &str = "SWACTOR_REQUIRE_SSHD";

/// Whether this machine has the OpenSSH server and `ssh-keygen` the harness
/// runs. Tests that need them return early when it says no, after one line
/// on stderr saying what to install; with `SWACTOR_REQUIRE_SSHD=1` a
/// missing server fails the test instead.
///
/// # Panics
/// When the server is missing and `SWACTOR_REQUIRE_SSHD=1`.
pub fn sshd_available() -> bool {
    static SKIPPED: std::sync::Once = std::sync::Once::new();
    let keygen = ["/usr/bin/ssh-keygen", "/bin/ssh-keygen"]
        .iter()
        .any(|p| Path::new(p).exists());
    if Path::new(SSHD).exists() && keygen {
        return true;
    }
    assert!(
        std::env::var(REQUIRE_SSHD_ENV).as_deref() != Ok("1"),
        "{REQUIRE_SSHD_ENV}=1 but {SSHD} or ssh-keygen is missing (apt-get install openssh-server)"
    );
    SKIPPED.call_once(|| {
        // Straight to stderr: the harness hides a passing test's output.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "ssh tests skipped: {SSHD} or ssh-keygen is missing (apt-get install openssh-server; \
             {REQUIRE_SSHD_ENV}=1 to fail instead)"
        );
    });
    false
}

/// A running OpenSSH server on `127.0.0.1:{port}`; killed when dropped.
#[derive(Debug)]
pub struct Sshd {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    /// The address it listens on.
    listen: IpAddr,
    /// The network namespace it runs in (`None`: this one).
    netns: Option<String>,
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
        Self::start_on(dir, authorized, IpAddr::V4(Ipv4Addr::LOCALHOST), None)
    }

    /// [`Self::start`], but inside the network namespace `netns`, listening
    /// on its address there: a host reached over a network.
    ///
    /// # Panics
    /// As [`Self::start`].
    pub fn start_in(dir: &Path, authorized: &[String], netns: &NetNs) -> Self {
        Self::start_on(
            dir,
            authorized,
            IpAddr::V4(netns.inside),
            Some(netns.name.clone()),
        )
    }

    fn start_on(dir: &Path, authorized: &[String], listen: IpAddr, netns: Option<String>) -> Self {
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
            listen,
            netns,
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

    /// `root@{address}:{port}` (`127.0.0.1` unless started in a namespace).
    pub fn target(&self) -> SshTarget {
        SshTarget {
            user: "root".to_owned(),
            host: self.listen.to_string(),
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
             ListenAddress {listen}\n\
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
             SetEnv HOME=\"{home}\"\n\
             ForceCommand cd \"{home}\" && HOME=\"{home}\" PATH=\"{bin}:$PATH\" exec /bin/sh -c \"$SSH_ORIGINAL_COMMAND\"\n",
            port = self.port,
            listen = self.listen,
            host_key = file(HOST_KEY_FILE),
            pid = file(PID_FILE),
            authorized = file(AUTHORIZED_KEYS_FILE),
            home = self.home().display(),
            bin = self.dir.join("bin").display(),
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
        let mut command = match &self.netns {
            None => Command::new(SSHD),
            Some(ns) => {
                // `ip netns exec` execs the server: the child is sshd itself.
                let mut c = Command::new(IP);
                c.args(["netns", "exec", ns, SSHD]);
                c
            }
        };
        let mut child = command
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

/// iproute2's `ip`, which [`NetNs`] uses.
pub const IP: &str = "/usr/sbin/ip";

/// A network namespace of its own, joined to this one by a veth pair with
/// an address at each end (a /30 in 10.0.0.0/8 chosen from the pid); deleted,
/// with its veth pair, when dropped.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    /// The veth end on this side (gone with the namespace, unless making it failed half-way).
    outside_if: String,
    /// This side's address (where a daemon listens for the namespace's agents).
    pub outside: Ipv4Addr,
    /// The namespace's address.
    pub inside: Ipv4Addr,
}

impl NetNs {
    /// Whether namespaces can be made here: `ip` is installed and this
    /// process runs as root. When not, one line on stderr says so and the
    /// caller skips; with `SWACTOR_REQUIRE_SSHD=1` (CI) it fails instead.
    ///
    /// # Panics
    /// When namespaces cannot be made and `SWACTOR_REQUIRE_SSHD=1`.
    pub fn available() -> bool {
        let root = rustix::process::geteuid().is_root();
        if Path::new(IP).exists() && root {
            return true;
        }
        let why = if root {
            format!("{IP} is missing (apt-get install iproute2)")
        } else {
            "making a network namespace needs root".to_owned()
        };
        assert!(
            std::env::var(REQUIRE_SSHD_ENV).as_deref() != Ok("1"),
            "{REQUIRE_SSHD_ENV}=1 but {why}"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "network-namespace ssh test skipped: {why}"
        );
        false
    }

    /// Makes the namespace and its link.
    ///
    /// # Panics
    /// When `ip` (package `iproute2`) is missing or a step fails (not root).
    pub fn create() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        assert!(
            Path::new(IP).exists(),
            "{IP} is missing: install iproute2 (`apt-get install -y iproute2`; .ci/run does)"
        );
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("swactor-test-{pid}-{n}");
        // Interface names hold at most 15 bytes.
        let (outside_if, inside_if) = (format!("swo{:x}{n}", pid), format!("swi{:x}{n}", pid));
        // 10.{200+..}.{..}.{4k+1, 4k+2}: one /30 per (pid, n).
        let k = (pid.wrapping_mul(64).wrapping_add(n)) % (50 * 256 * 64);
        let (a, b, c) = (200 + k / (256 * 64), (k / 64) % 256, (k % 64) * 4);
        let outside = Ipv4Addr::new(10, a as u8, b as u8, (c + 1) as u8);
        let inside = Ipv4Addr::new(10, a as u8, b as u8, (c + 2) as u8);
        let ns = Self {
            name: name.clone(),
            outside_if: outside_if.clone(),
            outside,
            inside,
        };
        ip(&["netns", "add", &name]);
        ip(&[
            "link",
            "add",
            &outside_if,
            "type",
            "veth",
            "peer",
            "name",
            &inside_if,
        ]);
        ip(&["link", "set", &inside_if, "netns", &name]);
        ip(&["addr", "add", &format!("{outside}/30"), "dev", &outside_if]);
        ip(&["link", "set", &outside_if, "up"]);
        ip(&[
            "-n",
            &name,
            "addr",
            "add",
            &format!("{inside}/30"),
            "dev",
            &inside_if,
        ]);
        ip(&["-n", &name, "link", "set", &inside_if, "up"]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        ns
    }

    /// Its name (`ip netns exec NAME …`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it; the link is
        // deleted on its own in case it never moved into the namespace.
        for args in [
            ["netns", "del", self.name.as_str()],
            ["link", "del", self.outside_if.as_str()],
        ] {
            let _ = Command::new(IP)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new(IP)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {IP}: {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (the namespace tests must run as root): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
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
