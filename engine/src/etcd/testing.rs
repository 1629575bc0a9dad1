//! A real etcd cluster on 127.0.0.1 for tests: start it, kill, freeze or restart its members.
//!
//! [`EtcdCluster`] runs Debian's `/usr/bin/etcd` (package `etcd-server`),
//! one process per member, on ports it picks, with data directories and
//! logs in a temporary directory of its own. Every member is killed when
//! the cluster is dropped. Everything here panics with a message saying
//! what to do: it is for tests.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

use super::{Client, EtcdConfig};

/// The server binary the harness runs.
pub const ETCD: &str = "/usr/bin/etcd";
/// Set to `1` (as `.ci/run` does) to make [`etcd_available`] fail a test
/// instead of skipping it when etcd is missing.
pub const REQUIRE_ETCD_ENV: &str = "SWACTOR_REQUIRE_ETCD";
/// How long a cluster or a restarted member may take to be healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How many sets of ports [`EtcdCluster::start`] tries when another
/// process takes one it picked.
const PORT_TRIES_MAX: usize = 5;
const POLL: Duration = Duration::from_millis(50);

/// Whether this machine has etcd. Tests that need it return early when it
/// says no, after one line on stderr saying what to install; with
/// `SWACTOR_REQUIRE_ETCD=1` a missing etcd fails the test instead.
///
/// # Panics
/// When etcd is missing and `SWACTOR_REQUIRE_ETCD=1`.
pub fn etcd_available() -> bool {
    static SKIPPED: std::sync::Once = std::sync::Once::new();
    if Path::new(ETCD).exists() {
        return true;
    }
    assert!(
        std::env::var(REQUIRE_ETCD_ENV).as_deref() != Ok("1"),
        "{REQUIRE_ETCD_ENV}=1 but {ETCD} is missing (apt-get install etcd-server)"
    );
    SKIPPED.call_once(|| {
        // Straight to stderr: the harness hides a passing test's output.
        let _ = writeln!(
            std::io::stderr(),
            "etcd tests skipped: {ETCD} is missing (apt-get install etcd-server; \
             {REQUIRE_ETCD_ENV}=1 to fail instead)"
        );
    });
    false
}

/// A running etcd cluster on loopback; every member is killed when dropped.
#[derive(Debug)]
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    token: String,
    /// Flags every member gets besides the harness's own.
    extra: Vec<String>,
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdCluster {
    /// Starts a cluster of `size` members and waits until every one is
    /// healthy (has a leader); `None` (after one line on stderr) when etcd
    /// is not installed.
    ///
    /// # Panics
    /// When etcd is missing and `SWACTOR_REQUIRE_ETCD=1`, or the cluster
    /// does not start (the members' logs are in the message).
    pub fn start(size: usize) -> Option<Self> {
        Self::start_with(size, &[])
    }

    /// [`Self::start`], with more etcd flags for every member (e.g.
    /// `["--auth-token-ttl", "1"]`).
    ///
    /// # Panics
    /// As [`Self::start`].
    pub fn start_with(size: usize, extra: &[&str]) -> Option<Self> {
        if !etcd_available() {
            return None;
        }
        assert!(size > 0, "a cluster has at least one member");
        let mut failures = Vec::new();
        for _ in 0..PORT_TRIES_MAX {
            let mut cluster = Self::configure(size);
            cluster.extra = extra.iter().map(|s| (*s).to_owned()).collect();
            for i in 0..size {
                cluster.spawn(i, true);
            }
            match cluster.wait_healthy_all() {
                Ok(()) => return Some(cluster),
                Err(why) if why.contains("address already in use") => failures.push(why),
                Err(why) => panic!("the etcd test cluster did not start: {why}"),
            }
        }
        panic!(
            "the etcd test cluster found no free ports: {}",
            failures.join("\n")
        );
    }

    /// One cluster of three members shared by every test of this process
    /// that holds it: started by the first, killed when the last lets go.
    /// Tests that kill or freeze members start their own.
    ///
    /// # Panics
    /// As [`Self::start`].
    pub fn shared() -> Option<Arc<Self>> {
        static SHARED: Mutex<Weak<EtcdCluster>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(cluster) = shared.upgrade() {
            return Some(cluster);
        }
        let cluster = Arc::new(Self::start(3)?);
        *shared = Arc::downgrade(&cluster);
        Some(cluster)
    }

    fn configure(size: usize) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("swactor-etcd-")
            .tempdir()
            .expect("cannot make a temporary directory for etcd");
        // Held together so no two members get the same port.
        let listeners: Vec<TcpListener> = (0..2 * size)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("no free loopback port"))
            .collect();
        let port = |i: usize| listeners[i].local_addr().expect("a bound port").port();
        let members = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: port(2 * i),
                peer_port: port(2 * i + 1),
                child: None,
            })
            .collect();
        let token = dir.path().file_name().map_or_else(
            || "swactor-test".to_owned(),
            |n| n.to_string_lossy().into_owned(),
        );
        Self {
            dir,
            members,
            token,
            extra: Vec::new(),
        }
    }

    /// The members' client URLs.
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `i`'s client URL.
    #[must_use]
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// A configuration naming every member, with timeouts short enough for
    /// tests (a request 1 s, a call 3 s).
    #[must_use]
    pub fn config(&self) -> EtcdConfig {
        let mut config = EtcdConfig::new(self.endpoints());
        config.request_timeout = Duration::from_secs(1);
        config.call_timeout = Duration::from_secs(3);
        config
    }

    /// A client of [`Self::config`].
    ///
    /// # Panics
    /// Never for the configurations this harness makes.
    #[must_use]
    pub fn client(&self) -> Client {
        Client::new(self.config()).expect("the harness's configuration is valid")
    }

    /// The directory holding the members' data and logs.
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&mut self, i: usize, fresh: bool) {
        let url = |port: u16| format!("http://127.0.0.1:{port}");
        let initial = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, url(m.peer_port)))
            .collect::<Vec<_>>()
            .join(",");
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log(i))
            .expect("cannot open an etcd log");
        let m = &self.members[i];
        let mut command = Command::new(ETCD);
        command
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("{}.data", m.name)))
            .args(["--listen-client-urls", &url(m.client_port)])
            .args(["--advertise-client-urls", &url(m.client_port)])
            .args(["--listen-peer-urls", &url(m.peer_port)])
            .args(["--initial-advertise-peer-urls", &url(m.peer_port)])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-token", &self.token])
            .args([
                "--initial-cluster-state",
                if fresh { "new" } else { "existing" },
            ])
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // etcd reads any ETCD_* variable as a flag.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                command.env_remove(name);
            }
        }
        let child = command.spawn().expect("cannot run /usr/bin/etcd");
        self.members[i].child = Some(child);
    }

    /// Kills member `i` at once (SIGKILL), as a crash would.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = kill_process(Pid::from_child(&child), Signal::CONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops member `i` cleanly (SIGTERM), waiting for it to exit.
    pub fn stop(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = kill_process(Pid::from_child(&child), Signal::CONT);
            let _ = kill_process(Pid::from_child(&child), Signal::TERM);
            let _ = child.wait();
        }
    }

    /// Freezes member `i` (SIGSTOP): it keeps its ports but answers nothing,
    /// like a hung machine.
    pub fn freeze(&self, i: usize) {
        if let Some(child) = &self.members[i].child {
            let _ = kill_process(Pid::from_child(child), Signal::STOP);
        }
    }

    /// Lets a frozen member run again (SIGCONT).
    pub fn thaw(&self, i: usize) {
        if let Some(child) = &self.members[i].child {
            let _ = kill_process(Pid::from_child(child), Signal::CONT);
        }
    }

    /// The member that leads the cluster now, as the running members say.
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        let ids: Vec<Option<(String, String)>> = self
            .members
            .iter()
            .map(|m| {
                m.child.as_ref()?;
                let answer = http(m.client_port, "POST /v3/maintenance/status", "{}")?;
                let status: serde_json::Value = serde_json::from_str(&answer).ok()?;
                let own = status["header"]["member_id"].as_str()?.to_owned();
                Some((own, status["leader"].as_str()?.to_owned()))
            })
            .collect();
        let leader = ids.iter().flatten().map(|(_, l)| l.clone()).next()?;
        ids.iter()
            .position(|id| id.as_ref().is_some_and(|(own, _)| *own == leader))
    }

    /// Kills every member.
    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// Starts member `i` again on its data and waits until it is healthy
    /// (for that, a quorum must run).
    ///
    /// # Panics
    /// When it does not become healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, false);
        let deadline = Instant::now() + READY_TIMEOUT;
        if let Err(why) = self.wait_healthy(i, deadline) {
            panic!("etcd member {i} did not come back: {why}");
        }
    }

    /// Starts every member that is not running and waits until all are healthy.
    ///
    /// # Panics
    /// When they do not become healthy.
    pub fn restart_all(&mut self) {
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                self.spawn(i, false);
            }
        }
        if let Err(why) = self.wait_healthy_all() {
            panic!("the etcd cluster did not come back: {why}");
        }
    }

    fn wait_healthy_all(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        for i in 0..self.members.len() {
            self.wait_healthy(i, deadline)?;
        }
        Ok(())
    }

    fn wait_healthy(&mut self, i: usize, deadline: Instant) -> Result<(), String> {
        let port = self.members[i].client_port;
        loop {
            if healthy(port) {
                return Ok(());
            }
            let exited = self.members[i]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let state = exited.map_or("still running".to_owned(), |s| format!("exited: {s}"));
                return Err(format!(
                    "member {i} (port {port}) is not healthy ({state}); its log ends:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Whether the member on `port` says it is healthy (it has a leader).
fn healthy(port: u16) -> bool {
    http(port, "GET /health", "").is_some_and(|a| a.contains("\"health\":\"true\""))
}

/// A plain HTTP/1.0 request to the member on `port`; its answer's body.
fn http(port: u16, request_line: &str, body: &str) -> Option<String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok()?;
    let request = format!(
        "{request_line} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.take(64 << 10).read_to_string(&mut answer).ok()?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// A key prefix no other caller in this process gets, for tests sharing a cluster.
#[must_use]
pub fn unique_prefix(what: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "/test-{}-{what}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}
