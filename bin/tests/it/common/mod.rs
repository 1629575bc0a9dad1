//! Running the real `swactor` binary: daemons, CLI calls, and counting agent processes.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use swactor_actors::ClusterSnapshot;

pub mod docker;

pub const BIN: &str = env!("CARGO_BIN_EXE_swactor");

/// The test knob `name` from the environment, or `default` when it is
/// unset. A value that does not parse stops the test with the knob named,
/// so a typo never runs the default silently.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a valid value for this knob")),
        Err(_) => default,
    }
}

/// A shape file with `workers` workers (and optionally a coordinator).
pub fn shape_file(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

pub fn workers(run: &str, n: u32) -> String {
    format!(
        "run = \"{run}\"\n[[group]]\nid = \"worker\"\ncount = {n}\nprovider = \"process\"\nboot_check = [\"true\"]\nlost_grace_s = 1.0\n"
    )
}

/// Runs the CLI to completion.
pub fn cli(state: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .stdin(Stdio::null())
        .output()
        .expect("run swactor")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A daemon running in the background; killed (and its agents) when dropped.
pub struct Daemon {
    pub child: Option<Child>,
    pub state: PathBuf,
}

impl Daemon {
    pub fn start(state: &Path, shape: &Path) -> Self {
        Self::spawn(state, Some(shape)).unwrap_or_else(|e| {
            panic!(
                "the daemon exited ({:?}) before publishing its ticket: {}",
                e.code, e.log
            )
        })
    }

    /// `swactor up [SHAPE]`: returns once the daemon has published its
    /// ticket, or how it ended if it exited first.
    ///
    /// Every daemon of a state directory appends to the same log (see
    /// [`Daemon::log`]), each start under a header line, so a test that
    /// restarts a daemon keeps the whole story.
    pub fn spawn(state: &Path, shape: Option<&Path>) -> Result<Self, Exited> {
        Self::spawn_with(state, shape, &[])
    }

    /// [`Daemon::spawn`] with more arguments for `up`.
    pub fn spawn_with(state: &Path, shape: Option<&Path>, extra: &[&str]) -> Result<Self, Exited> {
        Self::spawn_env(state, shape, extra, &[])
    }

    /// [`Daemon::spawn_with`] with more environment variables.
    pub fn spawn_env(
        state: &Path,
        shape: Option<&Path>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, Exited> {
        let log_path = state.with_extension("daemon.log");
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let from = log.metadata().unwrap().len();
        let shown = shape.map_or("(no shape)".to_owned(), |s| s.display().to_string());
        writeln!(log, "=== swactor up {shown}").unwrap();
        let mut cmd = Command::new(BIN);
        cmd.arg("up");
        if let Some(shape) = shape {
            // These tests are about what a daemon does, not about the
            // question `up SHAPE` asks first (see cli.rs for that).
            cmd.arg(shape).arg("--yes");
        }
        let mut child = cmd
            .envs(env.iter().copied())
            .args(extra)
            .arg("--state-dir")
            .arg(state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        // No guard until it is up: one that exited must not take the agents
        // it refused to touch with it (see `Drop`).
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let all = std::fs::read(&log_path).unwrap_or_default();
                let log = String::from_utf8_lossy(all.get(from as usize..).unwrap_or_default())
                    .into_owned();
                return Err(Exited {
                    code: status.code(),
                    signal: std::os::unix::process::ExitStatusExt::signal(&status),
                    log,
                });
            }
            if state.join("daemon.ticket").exists() {
                return Ok(Self {
                    child: Some(child),
                    state: state.to_path_buf(),
                });
            }
            if start.elapsed() > Duration::from_secs(30) {
                // The guard kills it (and its agents) as the panic unwinds.
                let d = Self {
                    child: Some(child),
                    state: state.to_path_buf(),
                };
                panic!("no ticket from the daemon within 30 s: {}", d.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is still running (false once it has been reaped).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The log of every daemon started on this state directory.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.with_extension("daemon.log")).unwrap_or_default()
    }

    /// What the daemon started last on this state directory has logged so far.
    pub fn last_log(&self) -> String {
        let all = self.log();
        match all.rfind("=== swactor up") {
            Some(at) => all[at..].to_owned(),
            None => all,
        }
    }

    /// Kills the daemon with SIGKILL and reaps it.
    ///
    /// A killed daemon leaves its ticket behind, which would make the next
    /// [`Daemon::spawn`] return before the new daemon is up; so the ticket is
    /// removed when this process was running and held the directory (its pid
    /// is in `daemon.lock`), and only then: a daemon that lost the race for
    /// the lock must not take the winner's ticket with it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let running = matches!(c.try_wait(), Ok(None));
            let _ = c.kill();
            let _ = c.wait();
            if running && lock_holder(&self.state) == Some(c.id()) {
                let _ = std::fs::remove_file(self.state.join("daemon.ticket"));
            }
        }
    }

    /// Waits for the daemon to exit on its own; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut c = self.child.take()?;
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(s)) = c.try_wait() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }
}

impl Drop for Daemon {
    /// Kills the daemon and, unless another daemon now runs on the same state
    /// directory, its agents too. A test that kills a daemon and starts the
    /// next one drops the first while the second adopts those agents; killing
    /// them then would replace adoption with re-creation unnoticed.
    fn drop(&mut self) {
        self.kill9();
        if !lock_holder(&self.state).is_some_and(alive) {
            kill_agents(&self.state);
        }
    }
}

/// Whether a process is alive (a zombie is not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

/// How a `swactor up` ended that exited before publishing its ticket.
#[derive(Debug)]
pub struct Exited {
    pub code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// What it wrote to stderr.
    pub log: String,
}

/// The pid written into `daemon.lock` by the daemon that took it last.
pub fn lock_holder(state: &Path) -> Option<u32> {
    std::fs::read_to_string(state.join("daemon.lock"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub fn wait_for(timeout: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

pub fn status(state: &Path) -> Option<ClusterSnapshot> {
    let o = cli(state, &["status", "--json"]);
    o.status
        .success()
        .then(|| serde_json::from_slice(&o.stdout).ok())
        .flatten()
}

/// The deployment the journal of `state` is, from its `deployment` file.
#[allow(dead_code)]
pub fn deployment_of(state: &Path) -> String {
    std::fs::read_to_string(state.join("deployment"))
        .unwrap_or_else(|e| panic!("no deployment file in {}: {e}", state.display()))
        .trim()
        .to_owned()
}

/// Waits until `status` shows a converged cluster satisfying `pred`.
pub fn wait_converged(
    state: &Path,
    timeout: Duration,
    pred: impl FnMut(&ClusterSnapshot) -> bool,
) -> ClusterSnapshot {
    try_wait_converged(state, timeout, pred)
        .unwrap_or_else(|last| panic!("not converged within {timeout:?}; last status: {last:#?}"))
}

/// [`wait_converged`] that hands back the last status seen on a timeout.
#[allow(dead_code)]
pub fn try_wait_converged(
    state: &Path,
    timeout: Duration,
    mut pred: impl FnMut(&ClusterSnapshot) -> bool,
) -> Result<ClusterSnapshot, Box<Option<ClusterSnapshot>>> {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < timeout {
        if let Some(s) = status(state) {
            if s.converged && pred(&s) {
                return Ok(s);
            }
            last = Some(s);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(Box::new(last))
}

/// Live agent processes (their command line has `--attempt`) and their
/// working directories: where a provider started them.
///
/// A child an agent forks (to run its boot check) carries the agent's command
/// line and working directory until it calls `exec`; it is not a second
/// agent, so a process whose parent is an agent in the same directory is left
/// out (as `agents` does for local processes).
pub fn agent_cwds() -> Vec<(u32, PathBuf)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<(u32, u32, PathBuf)> = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if !cmd.split(|b| *b == 0).any(|a| a == b"--attempt") || !alive(pid) {
            continue;
        }
        let ppid = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0);
        if let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) {
            found.push((pid, ppid, cwd));
        }
    }
    found
        .iter()
        .filter(|(_, ppid, cwd)| !found.iter().any(|(p, _, c)| p == ppid && c == cwd))
        .map(|(pid, _, cwd)| (*pid, cwd.clone()))
        .collect()
}

/// Live agent processes of this state directory: (node, attempt) → pids.
///
/// A child an agent forks (to run its boot check) carries the agent's command
/// line until it calls `exec`; it is not a second agent, so processes whose
/// parent is an agent of the same identity are left out.
pub fn agents(state: &Path) -> BTreeMap<(String, u64), Vec<u32>> {
    let needle = state.to_string_lossy().into_owned();
    let mut found: Vec<(u32, u32, (String, u64))> = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.iter().any(|a| a == "agent") || !args.iter().any(|a| a.contains(&needle)) {
            continue;
        }
        // `stat` is "pid (comm) state ppid ..."; comm may hold spaces, so split after ')'.
        let ppid = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0);
        // A zombie has an empty cmdline, so anything here is alive.
        let get = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned()
        };
        if let (Some(node), Some(attempt)) = (get("--node"), get("--attempt")) {
            found.push((pid, ppid, (node, attempt.parse().unwrap_or(0))));
        }
    }
    let mut out: BTreeMap<(String, u64), Vec<u32>> = BTreeMap::new();
    for (pid, ppid, id) in &found {
        let forked = found.iter().any(|(p, _, pid_id)| p == ppid && pid_id == id);
        if !forked {
            out.entry(id.clone()).or_default().push(*pid);
        }
    }
    out
}

/// Every path (file or directory) below `roots`, at any depth, that
/// `keep` keeps; a directory that cannot be read is passed over.
pub fn paths_below(roots: Vec<PathBuf>, keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = roots;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if keep(&p) {
                out.push(p.clone());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            }
        }
    }
    out
}

/// Node directories left under the state directory.
pub fn node_dirs(state: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(runs) = std::fs::read_dir(state.join("nodes")) else {
        return out;
    };
    for run in runs.flatten() {
        if let Ok(nodes) = std::fs::read_dir(run.path()) {
            out.extend(nodes.flatten().map(|n| n.path()));
        }
    }
    out
}

pub fn kill_agents(state: &Path) {
    for pids in agents(state).values() {
        for pid in pids {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
    }
}

pub fn kill9(pid: u32) {
    let ok = Command::new("kill")
        .arg("-9")
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(ok.success(), "kill -9 {pid}");
}

/// The (node, attempt) of every node directory left under the state directory
/// (each is named `{node}-a{attempt}`).
pub fn node_dir_ids(state: &Path) -> std::collections::BTreeSet<(String, u64)> {
    node_dirs(state)
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let (node, attempt) = name.rsplit_once("-a").unwrap_or_else(|| {
                panic!("a node directory not named {{node}}-a{{attempt}}: {p:?}")
            });
            let attempt = attempt
                .parse()
                .unwrap_or_else(|_| panic!("a node directory with a bad attempt: {p:?}"));
            (node.to_owned(), attempt)
        })
        .collect()
}

/// Every (node, attempt) served by more than one live agent process right now.
pub fn double_agents(state: &Path) -> Vec<String> {
    agents(state)
        .into_iter()
        .filter(|(_, pids)| pids.len() > 1)
        .map(|((node, attempt), pids)| format!("{node} a{attempt}: pids {pids:?}"))
        .collect()
}

/// A background thread that looks at something every `period` and records
/// what it reports; it stops when [`Watcher::stop`] is called or it is dropped.
pub struct Watcher {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    found: std::sync::Arc<std::sync::Mutex<Found>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Found {
    first: Vec<String>,
    count: usize,
}

impl Watcher {
    /// How many findings are kept (all are counted).
    pub const KEPT_MAX: usize = 50;

    pub fn start(period: Duration, mut look: impl FnMut() -> Vec<String> + Send + 'static) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let found = std::sync::Arc::new(std::sync::Mutex::new(Found::default()));
        let thread = {
            let (stop, found) = (stop.clone(), found.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let now = look();
                    if !now.is_empty() {
                        let mut f = found.lock().unwrap();
                        f.count += now.len();
                        let room = Self::KEPT_MAX.saturating_sub(f.first.len());
                        f.first.extend(now.into_iter().take(room));
                    }
                    std::thread::sleep(period);
                }
            })
        };
        Self {
            stop,
            found,
            thread: Some(thread),
        }
    }

    /// Records any moment two live agents serve one (node, attempt) of `state`.
    pub fn doubles(state: &Path) -> Self {
        let state = state.to_path_buf();
        Self::start(Duration::from_millis(20), move || double_agents(&state))
    }

    /// What it found so far: the first [`Watcher::KEPT_MAX`] findings, and how many in all.
    pub fn found(&self) -> (Vec<String>, usize) {
        let f = self.found.lock().unwrap();
        (f.first.clone(), f.count)
    }

    pub fn stop(mut self) -> (Vec<String>, usize) {
        self.halt();
        self.found()
    }

    fn halt(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.halt();
    }
}

/// `GET path` on the daemon's web surface (address and token from the state
/// directory): the status and the body.
pub fn web_get(state: &Path, path: &str) -> (u16, String) {
    use std::io::Read;
    let addr = std::fs::read_to_string(state.join("http.addr")).expect("http.addr");
    let token = std::fs::read_to_string(state.join("http.token")).expect("http.token");
    let (addr, token) = (addr.trim(), token.trim());
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the web surface");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    );
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// The dashboard's address and token, from the state directory.
pub fn web(state: &Path) -> (std::net::SocketAddr, String) {
    let addr = std::fs::read_to_string(state.join("http.addr"))
        .expect("http.addr")
        .trim()
        .parse()
        .expect("an address in http.addr");
    let token = std::fs::read_to_string(state.join("http.token"))
        .expect("http.token")
        .trim()
        .to_owned();
    (addr, token)
}

/// One HTTP/1.1 exchange over a fresh connection: the status and the body.
pub fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the dashboard");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    std::io::Write::write_all(&mut s, req.as_bytes()).unwrap();
    // A refused body may be answered before it is all read; the answer counts.
    let _ = std::io::Write::write_all(&mut s, body);
    let mut out = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer to {method} {path}: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

pub fn get(addr: std::net::SocketAddr, token: &str, path: &str) -> (u16, String) {
    http(addr, "GET", path, &[("Authorization", &bearer(token))], b"")
}

/// Whether `hay` holds `needle` (bytes).
pub fn holds(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir`, read whole.
pub fn files_under(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push((path, bytes));
        }
    }
    out
}

/// Sends `sig` (`-STOP`, `-CONT`, …) to `pid` with kill(1); it must succeed.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A small seeded generator (splitmix64), so a failing seed replays.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 for `n` = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}
