//! One instance's "machine": a directory of its own and, while running, a real sshd.

use std::net::TcpListener;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use swactor_providers::ssh::testing::Sshd;

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

/// An instance's machine directory and its SSH server.
#[derive(Debug)]
pub(crate) struct Machine {
    dir: PathBuf,
    gpus: Gpus,
    sshd: Option<Sshd>,
    /// The port reported in `ssh_port`/`ports`; kept across stops.
    port: Option<u16>,
    /// Whether the sshd runs now.
    up: bool,
}

impl Machine {
    pub(crate) fn new(dir: PathBuf, gpus: Gpus) -> Self {
        Self {
            dir,
            gpus,
            sshd: None,
            port: None,
            up: false,
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sshd's home directory (`$HOME` of commands run over SSH).
    pub(crate) fn home(&self) -> Option<PathBuf> {
        self.sshd.as_ref().map(Sshd::home)
    }

    pub(crate) fn port(&self) -> Option<u16> {
        self.port
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up
    }

    /// Brings the machine to "running": an sshd accepting `authorized` when
    /// `serve_ssh`, else only a reported port on which nothing listens.
    /// Blocks while sshd starts (about 100 ms).
    pub(crate) fn run(&mut self, authorized: &[String], serve_ssh: bool) {
        if !serve_ssh {
            self.halt();
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
        if let Err(e) = self.install_nvidia_smi() {
            eprintln!(
                "swactor-vastmock: cannot make machine directory {}: {e}",
                self.dir.display()
            );
            self.port.get_or_insert_with(unused_port);
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

    /// Makes the directory, with `bin/nvidia-smi` in it.
    fn install_nvidia_smi(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let bin = self.dir.join("bin");
        std::fs::create_dir_all(&bin)?;
        let path = bin.join("nvidia-smi");
        std::fs::write(&path, self.gpus.nvidia_smi())?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
    }

    /// Stops the sshd (the port stays reserved in name only) and every
    /// process the machine runs: what was started over SSH ends with the
    /// machine, as it would on a stopped or destroyed instance.
    pub(crate) fn halt(&mut self) {
        if let Some(sshd) = &mut self.sshd {
            sshd.stop();
        }
        self.up = false;
        kill_processes_in(&self.dir);
    }

    /// Stops the sshd and removes the directory.
    pub(crate) fn remove(&mut self) {
        self.halt();
        self.sshd = None;
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

/// A loopback port nothing listens on right now.
fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(1)
}
