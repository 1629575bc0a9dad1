//! One instance's "machine": a directory of its own, a real sshd while it runs, the SSH proxy in front of it, and its `onstart` script.

use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use swactor_providers::ssh::testing::Sshd;

/// Connections one SSH proxy forwards at once; more are closed at once.
const PROXY_CONNECTIONS_MAX: usize = 64;
/// Bytes of one `onstart` run's output that reach the instance log; the
/// rest is dropped (with a line saying so).
pub(crate) const ONSTART_OUTPUT_MAX: u64 = 256 * 1024;
/// Bytes of one line of `onstart` output kept in the log; longer lines are cut.
const ONSTART_LINE_MAX: usize = 4096;
/// The file (in the machine directory) the running `onstart` writes its
/// output to; the mock reads it into the instance log as it is asked.
const ONSTART_LOG_FILE: &str = "onstart.log";

/// The GPUs an instance's machine reports (those of its offer).
#[derive(Clone, Debug)]
pub(crate) struct Gpus {
    /// The model, as the offer names it (`RTX 4090`).
    pub(crate) name: String,
    pub(crate) count: u32,
    /// Memory per GPU, MiB.
    pub(crate) ram_mib: u64,
}

impl Gpus {
    /// An `nvidia-smi` that reports these GPUs: its table with no
    /// argument, `-L`, and `--query-gpu=FIELDS` (`index`, `name`,
    /// `memory.total`, `memory.used`, `count`; others `[N/A]`) with
    /// `--format=csv[,noheader][,nounits]`.
    fn nvidia_smi(&self) -> String {
        let name = format!("NVIDIA {}", self.name.replace(['"', '\\', '$', '`'], ""));
        format!(
            r#"#!/bin/sh
# The Vast.ai mock's nvidia-smi: the GPUs of the offer this instance runs on.
count={count}; name="{name}"; ram={ram}
case "$1" in
-L)
    i=0
    while [ "$i" -lt "$count" ]; do
        echo "GPU $i: $name (UUID: GPU-00000000-mock-0000-0000-00000000000$i)"
        i=$((i + 1))
    done ;;
--query-gpu=*)
    fields=${{1#--query-gpu=}}; header=1; units=1
    case "$*" in *noheader*) header=0 ;; esac
    case "$*" in *nounits*) units=0 ;; esac
    if [ "$header" = 1 ]; then echo "$fields" | sed 's/,/, /g'; fi
    i=0
    while [ "$i" -lt "$count" ]; do
        line=""
        for f in $(echo "$fields" | tr ',' ' '); do
            case "$f" in
            index) v=$i ;;
            name) v=$name ;;
            count) v=$count ;;
            memory.total) v=$ram; [ "$units" = 1 ] && v="$v MiB" ;;
            memory.used) v=0; [ "$units" = 1 ] && v="$v MiB" ;;
            *) v="[N/A]" ;;
            esac
            line="${{line:+$line, }}$v"
        done
        echo "$line"
        i=$((i + 1))
    done ;;
"")
    echo "+-----------------------------------------------------------------------------+"
    echo "| NVIDIA-SMI 550.00 (Vast.ai mock)   Driver Version: 550.00   CUDA Version: 12.4 |"
    echo "+-----------------------------------------------------------------------------+"
    i=0
    while [ "$i" -lt "$count" ]; do
        echo "|   $i  $name    0MiB / ${{ram}}MiB |"
        i=$((i + 1))
    done ;;
*)
    echo "nvidia-smi (Vast.ai mock): unsupported arguments: $*" >&2
    exit 2 ;;
esac
"#,
            count = self.count,
            ram = self.ram_mib,
        )
    }
}

/// An instance's machine directory, its SSH server, its SSH proxy and its
/// `onstart` script.
#[derive(Debug)]
pub(crate) struct Machine {
    dir: PathBuf,
    gpus: Gpus,
    sshd: Option<Sshd>,
    /// The sshd's port (`ports["22/tcp"]` when the offer has direct
    /// ports); kept across stops.
    port: Option<u16>,
    /// Whether the sshd runs now.
    up: bool,
    /// Where the proxy forwards to: `port`, once there is one (0: nowhere).
    forward_to: Arc<AtomicU16>,
    /// The SSH proxy (`ssh_host`/`ssh_port`), from the first boot to the destroy.
    proxy: Option<Proxy>,
    /// The runtime the proxy runs on (the mock's server runtime).
    runtime: tokio::runtime::Handle,
    /// The `onstart` run of the current container start, while it is watched.
    onstart: Option<Onstart>,
}

/// The SSH proxy of one machine: a loopback port whose connections are
/// forwarded to the machine's sshd, as the service's `sshN.vast.ai:PORT`
/// forwards to the container's sshd. It listens from the first boot to the
/// destroy; while the sshd is down, a connection is accepted and closed.
#[derive(Debug)]
struct Proxy {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The accept loop owns the connections (a `JoinSet`): aborting it
        // ends them too.
        self.task.abort();
    }
}

/// One run of the `onstart` script: a process group of its own, its output
/// in a file the mock reads as it is asked.
#[derive(Debug)]
struct Onstart {
    child: Child,
    /// The process group (the script's pid), to end what it left running.
    group: u32,
    log: PathBuf,
    /// Bytes of the file read so far.
    read: u64,
    /// The start of a line whose end has not been written yet.
    partial: Vec<u8>,
    /// Whether the exit has been seen (the group may still run).
    exited: bool,
}

/// What the `onstart` run did since the last look.
#[derive(Debug, Default)]
pub(crate) struct OnstartNews {
    /// Whole lines it wrote (at most [`ONSTART_OUTPUT_MAX`] bytes in all per run).
    pub(crate) lines: Vec<String>,
    /// Its exit, the first time it is seen.
    pub(crate) exit: Option<ExitStatus>,
}

impl Machine {
    pub(crate) fn new(dir: PathBuf, gpus: Gpus, runtime: tokio::runtime::Handle) -> Self {
        Self {
            dir,
            gpus,
            sshd: None,
            port: None,
            up: false,
            forward_to: Arc::new(AtomicU16::new(0)),
            proxy: None,
            runtime,
            onstart: None,
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sshd's home directory (`$HOME` of commands run over SSH).
    pub(crate) fn home(&self) -> Option<PathBuf> {
        self.sshd.as_ref().map(Sshd::home)
    }

    /// Where commands run: the sshd's home (`{dir}/home`), whether or not
    /// an sshd was started.
    fn home_dir(&self) -> PathBuf {
        self.dir.join("home")
    }

    pub(crate) fn port(&self) -> Option<u16> {
        self.port
    }

    /// The SSH proxy's port, from the first boot on.
    pub(crate) fn proxy_port(&self) -> Option<u16> {
        self.proxy.as_ref().map(|p| p.port)
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up
    }

    /// Brings the machine to "running": an sshd accepting `authorized` when
    /// `serve_ssh`, else only a reported port on which nothing listens; and
    /// its SSH proxy. Blocks while sshd starts (about 100 ms).
    pub(crate) fn run(&mut self, authorized: &[String], serve_ssh: bool) {
        self.run_sshd(authorized, serve_ssh);
        if let Some(port) = self.port {
            self.forward_to.store(port, Ordering::Relaxed);
        }
        if self.proxy.is_none() {
            self.proxy = self.start_proxy();
        }
    }

    fn run_sshd(&mut self, authorized: &[String], serve_ssh: bool) {
        if let Err(e) = self.install_nvidia_smi() {
            eprintln!(
                "swactor-vastmock: cannot make machine directory {}: {e}",
                self.dir.display()
            );
            self.port.get_or_insert_with(unused_port);
            return;
        }
        if !serve_ssh {
            self.halt_sshd();
            if self.port.is_none() {
                self.port = Some(unused_port());
            }
            return;
        }
        if self.up {
            if let Some(sshd) = &self.sshd {
                sshd.set_authorized(authorized);
            }
            return;
        }
        // `Sshd` panics when it cannot start (it is test support); an
        // instance whose sshd does not start is one whose SSH never answers.
        let started = catch_unwind(AssertUnwindSafe(|| match self.sshd.take() {
            Some(mut sshd) => {
                sshd.set_authorized(authorized);
                sshd.start_again();
                sshd
            }
            None => Sshd::start(&self.dir, authorized),
        }));
        match started {
            Ok(sshd) => {
                self.port = Some(sshd.port());
                self.sshd = Some(sshd);
                self.up = true;
            }
            Err(_) => {
                eprintln!(
                    "swactor-vastmock: sshd for {} did not start; the instance runs without SSH",
                    self.dir.display()
                );
                self.port.get_or_insert_with(unused_port);
            }
        }
    }

    /// Binds the proxy's port and starts forwarding on the mock's runtime;
    /// `None` when no port can be bound.
    fn start_proxy(&self) -> Option<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| eprintln!("swactor-vastmock: cannot bind an SSH proxy port: {e}"))
            .ok()?;
        let port = listener.local_addr().ok()?.port();
        let forward_to = self.forward_to.clone();
        let task = self.runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((mut front, _)) = listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                while connections.try_join_next().is_some() {}
                if connections.len() >= PROXY_CONNECTIONS_MAX {
                    continue;
                }
                let to = forward_to.load(Ordering::Relaxed);
                connections.spawn(async move {
                    if to == 0 {
                        return;
                    }
                    if let Ok(mut back) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                        let _ = tokio::io::copy_bidirectional(&mut front, &mut back).await;
                    }
                });
            }
        });
        Some(Proxy { port, task })
    }

    /// Starts `script` with `bash -c` in the home directory (`$HOME`), with
    /// `{dir}/bin` first on `PATH` and `env` exported (names that are not
    /// shell variable names are left out), in a process group of its own,
    /// its output to a file. A run still going is ended first.
    pub(crate) fn start_onstart(
        &mut self,
        script: &str,
        env: &[(String, String)],
    ) -> std::io::Result<()> {
        self.end_onstart();
        let home = self.home_dir();
        std::fs::create_dir_all(&home)?;
        let log = self.dir.join(ONSTART_LOG_FILE);
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let shell = if Path::new("/bin/bash").exists() {
            "/bin/bash"
        } else {
            "/bin/sh"
        };
        let path = format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.dir.join("bin").display()
        );
        let mut cmd = Command::new(shell);
        cmd.arg("-c")
            .arg(script)
            .current_dir(&home)
            .env_clear()
            .env("PATH", path)
            .env("HOME", &home)
            .env("USER", "root")
            .env("SHELL", shell);
        for (k, v) in env.iter().filter(|(k, _)| is_variable_name(k)) {
            cmd.env(k, v);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()?;
        self.onstart = Some(Onstart {
            group: child.id(),
            child,
            log,
            read: 0,
            partial: Vec::new(),
            exited: false,
        });
        Ok(())
    }

    /// What the `onstart` run wrote and whether it exited, since the last
    /// look. Never blocks on the script.
    pub(crate) fn poll_onstart(&mut self) -> OnstartNews {
        let mut news = OnstartNews::default();
        let Some(run) = &mut self.onstart else {
            return news;
        };
        let exit = if run.exited {
            None
        } else {
            run.child.try_wait().ok().flatten()
        };
        // Read after the exit check: what it wrote before exiting is in.
        if run.read < ONSTART_OUTPUT_MAX
            && let Ok(mut file) = std::fs::File::open(&run.log)
            && file.seek(SeekFrom::Start(run.read)).is_ok()
        {
            let mut bytes = Vec::new();
            let _ = file
                .take(ONSTART_OUTPUT_MAX - run.read)
                .read_to_end(&mut bytes);
            run.read += bytes.len() as u64;
            run.partial.extend_from_slice(&bytes);
            while let Some(end) = run.partial.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = run.partial.drain(..=end).collect();
                news.lines.push(line_text(&line[..line.len() - 1]));
            }
            let full = run.read >= ONSTART_OUTPUT_MAX;
            if (full || exit.is_some()) && !run.partial.is_empty() {
                news.lines.push(line_text(&run.partial));
                run.partial.clear();
            }
            if full {
                news.lines.push(format!(
                    "vastmock: onstart output past {ONSTART_OUTPUT_MAX} bytes is not kept"
                ));
            }
        }
        if exit.is_some() {
            run.exited = true;
        }
        news.exit = exit;
        news
    }

    /// Ends the `onstart` run: the script and every process of its group.
    fn end_onstart(&mut self) {
        let Some(mut run) = self.onstart.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-9", "--", &format!("-{}", run.group)])
            .stderr(Stdio::null())
            .status();
        let _ = run.child.kill();
        let _ = run.child.wait();
    }
    /// Makes the directory, with `bin/nvidia-smi` in it.
    fn install_nvidia_smi(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let bin = self.dir.join("bin");
        std::fs::create_dir_all(&bin)?;
        let path = bin.join("nvidia-smi");
        std::fs::write(&path, self.gpus.nvidia_smi())?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
    }

    /// Stops the sshd (the port stays reserved in name only), the `onstart`
    /// run and every process the machine runs: what was started over SSH or
    /// by `onstart` ends with the container, as it would on a stopped,
    /// rebooted or destroyed instance. The proxy stays, forwarding to nothing.
    pub(crate) fn halt(&mut self) {
        self.halt_sshd();
        self.end_onstart();
        kill_processes_in(&self.dir);
    }

    fn halt_sshd(&mut self) {
        if let Some(sshd) = &mut self.sshd {
            sshd.stop();
        }
        self.up = false;
    }

    /// Stops everything, the proxy too, and removes the directory.
    pub(crate) fn remove(&mut self) {
        self.halt();
        self.sshd = None;
        self.proxy = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Kills (SIGKILL) every process whose working directory is `dir` or under
/// it: this host's processes that a machine started. Best effort.
fn kill_processes_in(dir: &Path) {
    let Ok(dir) = dir.canonicalize() else {
        return;
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    let own = std::process::id();
    let pids: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cwd = std::fs::read_link(e.path().join("cwd")).ok()?;
            (pid != own && cwd.starts_with(&dir)).then(|| pid.to_string())
        })
        .collect();
    if !pids.is_empty() {
        let _ = std::process::Command::new("kill")
            .arg("-9")
            .args(&pids)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Whether `name` can be an environment variable a shell script reads.
fn is_variable_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// One line of output as log text, cut to [`ONSTART_LINE_MAX`] bytes.
fn line_text(bytes: &[u8]) -> String {
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    let cut = &bytes[..bytes.len().min(ONSTART_LINE_MAX)];
    String::from_utf8_lossy(cut).into_owned()
}

/// A loopback port nothing listens on right now.
fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(1)
}
