//! The jobs protocol's wire types (`swactor/jobs/0`), the workspace
//! manifest and the output log format, shared by the daemon and the agent.
//!
//! The jobs protocol has no ALPN of its own: its frames travel on streams
//! the daemon opens on an agent's `swactor/swarm/0` connection once it has
//! welcomed the agent's join, so they are versioned with the swarm's ALPN.

use serde::{Deserialize, Serialize};

/// A BLAKE3 hash: the name of a chunk.
pub type Hash = [u8; 32];

/// Largest chunk of a workspace file; files are cut into chunks of this
/// size, each shipped and stored under its own hash.
pub const CHUNK_LEN: usize = 1 << 20;

/// Largest frame on the jobs protocol: a start request's manifest of
/// chunk hashes, or a piece of output, plus envelope.
pub const JOBS_FRAME_LEN_MAX: usize = CHUNK_LEN + 64 * 1024;

/// Largest piece of output or of an output file in one frame.
pub const DATA_PIECE_LEN: usize = 256 * 1024;

/// Hex of a hash, for names and messages.
pub fn hex(hash: &Hash) -> String {
    use std::fmt::Write;
    hash.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// One file of a workspace: where it goes, whether it is executable, and
/// its content as a list of chunk hashes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileEntry {
    /// Relative path, `/`-separated, no `..`.
    pub path: String,
    /// Whether any execute bit is set.
    pub executable: bool,
    /// Length in bytes.
    pub len: u64,
    /// The chunks, in order.
    pub chunks: Vec<Hash>,
}

/// Whether `path` is a safe relative path: no root, no `..`, nothing empty.
pub fn safe_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

/// A request from the daemon to an agent, one per stream. Every request
/// names the attempt it is meant for; an agent refuses one for another
/// attempt.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToAgent {
    /// Fetch the chunks of these that the agent lacks from the daemon's
    /// blob provider (iroh-blobs), each verified as it arrives.
    Fetch {
        /// The attempt the request is for.
        attempt: u64,
        /// Chunk hashes.
        chunks: Vec<Hash>,
    },
    /// Materialise the workspace and start the command.
    Start {
        /// The attempt the request is for.
        attempt: u64,
        /// The job's id.
        job: String,
        /// The workspace's files.
        manifest: Vec<FileEntry>,
        /// The command and its arguments.
        argv: Vec<String>,
        /// Extra environment variables.
        env: Vec<(String, String)>,
        /// A command to run first, unless it already ran on this node
        /// with the same key.
        setup: Option<Setup>,
    },
    /// Stream the run's output from `offset` of its log, then its exit.
    Attach {
        /// The attempt the request is for.
        attempt: u64,
        /// The job's id.
        job: String,
        /// Byte offset into the run's log.
        offset: u64,
    },
    /// Send the files of the workspace that match `globs`.
    Collect {
        /// The attempt the request is for.
        attempt: u64,
        /// The job's id.
        job: String,
        /// Glob patterns, relative to the workspace.
        globs: Vec<String>,
        /// Refuse when the matched files add up to more than this.
        output_max_bytes: u64,
    },
    /// Kill the run's process group.
    Cancel {
        /// The attempt the request is for.
        attempt: u64,
        /// The job's id.
        job: String,
    },
    /// Remove everything the agent keeps of the run.
    Forget {
        /// The attempt the request is for.
        attempt: u64,
        /// The job's id.
        job: String,
    },
    /// Say the node's address as its peers reach it, a free TCP port on
    /// it, and its GPUs: what the ranks of a gang are told.
    Prepare {
        /// The attempt the request is for.
        attempt: u64,
    },
    /// Start a shell or one command for `swactor ssh`; once the agent
    /// answers [`FromAgent::Opened`], the stream carries [`ShellFrame`]s
    /// both ways until the command exits or the stream goes (which kills it).
    Shell {
        /// The attempt the request is for.
        attempt: u64,
        /// The command and its arguments; `None` for a login shell.
        argv: Option<Vec<String>>,
        /// A pseudo-terminal of (rows, columns) for it; `None` for pipes,
        /// its stdout and stderr kept apart.
        pty: Option<(u16, u16)>,
        /// Extra environment variables (`TERM` for a terminal).
        env: Vec<(String, String)>,
    },
    /// Connect to `127.0.0.1:port` on the node for `swactor forward`; once
    /// the agent answers [`FromAgent::Opened`], the stream carries the
    /// connection's bytes both ways, each direction ending on its own.
    Connect {
        /// The attempt the request is for.
        attempt: u64,
        /// The TCP port on the node's loopback.
        port: u16,
    },
}

/// A job's `--setup`: run before the command on a node, and skipped there
/// on later runs with the same key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Setup {
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// BLAKE3 of the setup command and the workspace's manifest, in hex: a
    /// node that ran this setup to success once skips it.
    pub key: String,
}

impl Setup {
    /// The setup `argv` for a workspace whose manifest is `manifest`.
    pub fn new(argv: Vec<String>, manifest: &[FileEntry]) -> Self {
        let mut h = blake3::Hasher::new();
        for a in &argv {
            h.update(&(a.len() as u64).to_le_bytes());
            h.update(a.as_bytes());
        }
        for f in manifest {
            h.update(&(f.path.len() as u64).to_le_bytes());
            h.update(f.path.as_bytes());
            h.update(&[u8::from(f.executable)]);
            for c in &f.chunks {
                h.update(c);
            }
        }
        Self {
            argv,
            key: hex(h.finalize().as_bytes()),
        }
    }
}

/// How a run ended.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitInfo {
    /// The exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
}

impl ExitInfo {
    /// The exit code a shell would report: the code, or 128 + the signal.
    pub fn shell_code(self) -> i32 {
        self.code.or(self.signal.map(|s| 128 + s)).unwrap_or(1)
    }
}

/// An agent's answer (one or many per request).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum FromAgent {
    /// One more chunk was fetched, verified and stored.
    Stored,
    /// Every chunk the agent lacked is stored; this much was fetched.
    Fetched {
        /// Chunk bytes fetched (what the blob protocol calls payload).
        bytes: u64,
        /// Chunks fetched.
        chunks: u64,
    },
    /// The command started.
    Started,
    /// Whole log records (see [`LogRecord`]), from the offset asked for on.
    Log(Vec<u8>),
    /// The run ended.
    Exit(ExitInfo),
    /// An output file follows in `Data` pieces.
    File {
        /// Path relative to the workspace.
        path: String,
        /// Length in bytes.
        len: u64,
        /// The BLAKE3 hash of its bytes, which the daemon checks before
        /// keeping the file.
        hash: Hash,
    },
    /// A piece of the current output file.
    Data(Vec<u8>),
    /// Every output file was sent.
    Collected,
    /// Done (cancel, forget).
    Done,
    /// The agent knows no such run.
    Unknown,
    /// The request was refused; the text says why.
    Refused(String),
    /// The run's process died with an earlier agent of this attempt, before
    /// it could record an exit status; the text says so.
    Died(String),
    /// The answer to [`ToAgent::Prepare`].
    Prepared {
        /// The node's address as the others reach it.
        addr: String,
        /// A TCP port that was free on it a moment ago.
        port: u16,
        /// GPUs it has (`/dev/nvidia0`, …).
        gpus: u32,
    },
    /// A shell or a connection is open: what follows on the stream is its
    /// traffic (see [`ToAgent::Shell`], [`ToAgent::Connect`]).
    Opened,
}

/// Largest piece of a remote shell's input or output in one [`ShellFrame`].
pub const SHELL_PIECE_LEN: usize = 32 * 1024;

/// Largest [`ShellFrame`] on the wire: a piece plus its envelope.
pub const SHELL_FRAME_LEN_MAX: usize = SHELL_PIECE_LEN + 64;

/// One frame of a remote shell's stream once it is open. The CLI sends
/// `Stdin`, `StdinEnd` and `Resize`; the agent sends `Stdout`, `Stderr`
/// and, last, `Exit`. The daemon relays the bytes without reading them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum ShellFrame {
    /// Bytes for the command's standard input (or its terminal).
    Stdin(Vec<u8>),
    /// The CLI's standard input ended: the command's is closed.
    StdinEnd,
    /// The CLI's terminal is now this many rows and columns.
    Resize {
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// Bytes the command wrote to its standard output (or its terminal).
    Stdout(Vec<u8>),
    /// Bytes the command wrote to its standard error (never with a terminal).
    Stderr(Vec<u8>),
    /// The command ended; nothing follows.
    Exit(ExitInfo),
}

/// Which stream a piece of output came from.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One record of a run's log: a tag byte (1 stdout, 2 stderr), a big-endian
/// `u32` length, then the bytes. The agent writes its log this way and the
/// daemon keeps the same bytes, so an offset means the same on both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogRecord {
    /// The stream.
    pub stream: Stream,
    /// The bytes.
    pub data: Vec<u8>,
}

/// Bytes in front of a log record's data.
pub const LOG_HEADER_LEN: usize = 5;

impl LogRecord {
    /// The record's encoding.
    pub fn encode(stream: Stream, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(LOG_HEADER_LEN + data.len());
        out.push(match stream {
            Stream::Stdout => 1,
            Stream::Stderr => 2,
        });
        out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(data);
        out
    }

    /// Splits `bytes` into whole records; returns them and how many bytes
    /// they took (a torn record at the end is left out).
    pub fn decode_all(bytes: &[u8]) -> (Vec<LogRecord>, usize) {
        let mut records = Vec::new();
        let mut at = 0;
        while let Some(header) = bytes.get(at..at + LOG_HEADER_LEN) {
            let stream = match header[0] {
                1 => Stream::Stdout,
                2 => Stream::Stderr,
                _ => break,
            };
            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
            let Some(data) = bytes.get(at + LOG_HEADER_LEN..at + LOG_HEADER_LEN + len) else {
                break;
            };
            records.push(LogRecord {
                stream,
                data: data.to_vec(),
            });
            at += LOG_HEADER_LEN + len;
        }
        (records, at)
    }
}

/// Whether `name` matches the glob `pattern`: `*` any run of characters
/// but `/`, `?` one such character, `**` as a whole component any number
/// of components.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let pat: Vec<&str> = pattern.split('/').filter(|p| !p.is_empty()).collect();
    let parts: Vec<&str> = name.split('/').collect();
    match_parts(&pat, &parts)
}

fn match_parts(pat: &[&str], parts: &[&str]) -> bool {
    match pat.split_first() {
        None => parts.is_empty(),
        Some((&"**", rest)) => (0..=parts.len()).any(|skip| match_parts(rest, &parts[skip..])),
        Some((first, rest)) => match parts.split_first() {
            Some((part, others)) => {
                match_one(first.as_bytes(), part.as_bytes()) && match_parts(rest, others)
            }
            None => false,
        },
    }
}

fn match_one(pat: &[u8], s: &[u8]) -> bool {
    match pat.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|skip| match_one(rest, &s[skip..])),
        Some((b'?', rest)) => !s.is_empty() && match_one(rest, &s[1..]),
        Some((c, rest)) => s.first() == Some(c) && match_one(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_within_and_across_directories() {
        assert!(glob_match("*.txt", "a.txt"));
        assert!(!glob_match("*.txt", "d/a.txt"));
        assert!(glob_match("**/*.txt", "d/e/a.txt"));
        assert!(glob_match("**/*.txt", "a.txt"));
        assert!(glob_match("out/?.bin", "out/1.bin"));
        assert!(!glob_match("out/?.bin", "out/12.bin"));
        assert!(glob_match("result", "result"));
    }

    #[test]
    fn log_records_round_trip_and_a_torn_tail_is_left_out() {
        let mut bytes = LogRecord::encode(Stream::Stdout, b"hello\n");
        bytes.extend(LogRecord::encode(Stream::Stderr, b"oops"));
        let whole = bytes.len();
        bytes.extend(&LogRecord::encode(Stream::Stdout, b"torn")[..6]);
        let (records, used) = LogRecord::decode_all(&bytes);
        assert_eq!(used, whole);
        assert_eq!(records.len(), 2);
        assert_eq!(records[1].stream, Stream::Stderr);
        assert_eq!(records[1].data, b"oops");
    }

    #[test]
    fn only_plain_relative_paths_are_safe() {
        assert!(safe_relative("a/b.txt"));
        assert!(!safe_relative("/etc/passwd"));
        assert!(!safe_relative("a/../../b"));
        assert!(!safe_relative("a//b"));
        assert!(!safe_relative(""));
    }
}
