//! Remote shells (`swactor ssh`) and forwarded TCP connections (`swactor
//! forward`) over the agents' jobs links.
//!
//! No SSH server is involved, so they work on every provider. The CLI asks
//! the daemon on `swactor/control/0`; the daemon (`relay`) checks the node,
//! opens a stream on that node's jobs link (its agent's swarm connection)
//! with a [`ToAgent::Shell`] or [`ToAgent::Connect`] naming the attempt,
//! and once the agent answers [`FromAgent::Opened`] it copies bytes both
//! ways without reading them. The agent (`serve_shell`, `serve_connect`) runs the
//! command (in a pseudo-terminal when asked) or dials `127.0.0.1:PORT`.
//!
//! ```text
//! swactor ssh ──control/0──▶ daemon ──swarm/0 (the agent's jobs link)──▶ agent ──▶ sh -l in a PTY
//!              ◀── ShellFrame: Stdin, StdinEnd, Resize ▶ / ◀ Stdout, Stderr, Exit ──
//! swactor forward: one control connection per TCP connection, raw bytes, half-close kept
//! ```
//!
//! # Limits
//! Each agent serves at most [`SHELLS_MAX`] shells and [`CONNECTIONS_MAX`]
//! forwarded connections at once and refuses more, naming the limit. A
//! frame carries at most [`SHELL_PIECE_LEN`] bytes; each direction of a
//! session holds at most [`OUTPUT_FRAMES_MAX`] frames waiting, and a
//! forwarded connection one copy buffer per direction: a slow reader slows
//! the writer down instead of growing a buffer.
//!
//! # Caveats
//! A command is killed (SIGHUP to its process group, then SIGKILL) when its
//! stream goes away: the CLI was killed, the daemon or the link went. When
//! it exits by itself, what is left of its process group is sent SIGHUP
//! only, so a `nohup`ed process survives, as after an SSH session.

use super::{
    ExitInfo, FromAgent, JOBS_FRAME_LEN_MAX, SHELL_FRAME_LEN_MAX, SHELL_PIECE_LEN, ShellFrame,
    ToAgent,
};
use crate::protocol::{ControlResponse, FRAME_LEN_MAX};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::ClusterHandle;
use swactor_engine::Clock;
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::net::{recv_frame, send_frame};
use swactor_provisioning::{Intent, LogicalNodeId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// Most remote shells (and commands) one agent runs at once.
pub const SHELLS_MAX: usize = 16;

/// Most forwarded TCP connections one agent serves at once.
pub const CONNECTIONS_MAX: usize = 64;

/// Most output frames of one session read ahead of the stream.
pub const OUTPUT_FRAMES_MAX: usize = 8;

/// How long output may still arrive after a command exited, from what it
/// left running with its output open, before the exit is reported anyway.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);

/// How long a command is given to end after SIGHUP before SIGKILL.
const HANGUP_GRACE: Duration = Duration::from_secs(2);

/// How long the agent may take to dial a forwarded port on its loopback.
const CONNECT_WAIT: Duration = Duration::from_secs(10);

/// How long the daemon waits for the agent to open a shell or a connection.
const OPEN_WAIT: Duration = Duration::from_secs(30);

/// How long a ready node's jobs link is waited for (it may still be dialing).
const LINK_WAIT: Duration = Duration::from_secs(5);

/// How long the daemon waits for the CLI to read a refusal and close.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// An agent's open sessions, counted against [`SHELLS_MAX`] and
/// [`CONNECTIONS_MAX`].
#[derive(Debug, Clone)]
pub(crate) struct Sessions {
    shells: Arc<Semaphore>,
    connections: Arc<Semaphore>,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            shells: Arc::new(Semaphore::new(SHELLS_MAX)),
            connections: Arc::new(Semaphore::new(CONNECTIONS_MAX)),
        }
    }
}

/// What a [`ToAgent::Shell`] asks for.
#[derive(Debug, Clone)]
pub(crate) struct ShellRequest {
    pub(crate) argv: Option<Vec<String>>,
    pub(crate) pty: Option<(u16, u16)>,
    pub(crate) env: Vec<(String, String)>,
}

/// The command line of a session: `argv`, or a login shell (`/bin/sh -l`
/// when the node has one, else `sh` from the `PATH`).
fn command_line(argv: Option<Vec<String>>, bin_sh: bool) -> Result<Vec<String>, String> {
    match argv {
        Some(argv) if argv.is_empty() => Err("no command to run".to_owned()),
        Some(argv) => Ok(argv),
        None if bin_sh => Ok(vec!["/bin/sh".to_owned(), "-l".to_owned()]),
        None => Ok(vec!["sh".to_owned()]),
    }
}

/// A window size the kernel takes: at least one row and one column.
fn winsize(rows: u16, cols: u16) -> rustix::termios::Winsize {
    rustix::termios::Winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// The words of a refusal over one of the agent's limits.
fn over_limit(node: &str, what: &str, max: usize) -> String {
    format!(
        "{node} already has {max} {what} open, the most one agent serves at once; \
         close one and try again"
    )
}

/// Where a session starts: `$HOME` of the agent when it is a directory, else `/`.
fn start_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .filter(|h| h.is_dir())
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// This very binary, even if the file was replaced since it started.
fn own_exe() -> Result<PathBuf, String> {
    if Path::new("/proc/self/exe").exists() {
        Ok(PathBuf::from("/proc/self/exe"))
    } else {
        std::env::current_exe().map_err(|e| format!("cannot find the agent's own binary: {e}"))
    }
}

/// A started command and its ends.
struct Started {
    child: tokio::process::Child,
    /// Its process group (its own; with a terminal, its session's too).
    pgid: i32,
    io: Io,
}

enum Io {
    /// The master side of its pseudo-terminal (non-blocking): a copy to
    /// read, one to write and one to resize it by.
    Pty {
        reader: pipe::Receiver,
        writer: pipe::Sender,
        control: OwnedFd,
    },
    Pipes {
        stdin: Option<tokio::process::ChildStdin>,
        stdout: tokio::process::ChildStdout,
        stderr: tokio::process::ChildStderr,
    },
}

/// Opens a pseudo-terminal: its master (non-blocking) and its slave, sized
/// `rows` × `cols`.
fn open_pty(rows: u16, cols: u16) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::pty::OpenptFlags;
    let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
    let master = rustix::pty::openpt(flags)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let slave = match rustix::pty::ioctl_tiocgptpeer(&master, flags) {
        Ok(fd) => fd,
        // Kernels before 4.13: by name.
        Err(_) => {
            let name = rustix::pty::ptsname(&master, Vec::new())?;
            rustix::fs::open(
                name.as_c_str(),
                rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?
        }
    };
    rustix::termios::tcsetwinsize(&slave, winsize(rows, cols))?;
    rustix::fs::fcntl_setfl(&master, rustix::fs::OFlags::NONBLOCK)?;
    Ok((master, slave))
}

/// Starts the session's command through this binary (`pty-exec` with a
/// terminal, `job-exec` without), so it dies with the agent.
fn start(node: &str, attempt: u64, req: ShellRequest) -> Result<Started, String> {
    let argv = command_line(req.argv, Path::new("/bin/sh").exists())?;
    let exe = own_exe()?;
    let mut command = tokio::process::Command::new(exe);
    command
        .arg(if req.pty.is_some() {
            "pty-exec"
        } else {
            "job-exec"
        })
        .arg("--parent")
        .arg(rustix::process::getpid().as_raw_nonzero().to_string())
        .arg("--")
        .args(&argv)
        .current_dir(start_dir())
        .envs(
            req.env
                .iter()
                .filter(|(k, v)| !k.is_empty() && !k.contains(['=', '\0']) && !v.contains('\0'))
                .map(|(k, v)| (k, v)),
        )
        .env("SWACTOR_NODE", node)
        .env("SWACTOR_ATTEMPT", attempt.to_string());
    let cannot = |e: std::io::Error| format!("cannot start `{}` on {node}: {e}", argv.join(" "));
    let master = match req.pty {
        Some((rows, cols)) => {
            let (master, slave) = open_pty(rows, cols)
                .map_err(|e| format!("cannot open a pseudo-terminal on {node}: {e}"))?;
            let (a, b) = (
                slave.try_clone().map_err(cannot)?,
                slave.try_clone().map_err(cannot)?,
            );
            // `pty-exec` makes it the controlling terminal of a new session.
            command.stdin(a).stdout(b).stderr(slave);
            Some(master)
        }
        None => {
            command
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                // Its own process group, so the session kills all it started.
                .process_group(0);
            None
        }
    };
    let mut child = command.spawn().map_err(cannot)?;
    // The command holds the slave's copies: dropped now, the master reads
    // EIO once the command and all it started have closed the terminal.
    drop(command);
    let pgid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .ok_or_else(|| format!("the command on {node} has no process id"))?;
    let io = match master {
        Some(master) => {
            // A terminal's master reads and writes like a pipe's ends.
            let copy = || master.try_clone().map_err(cannot);
            Io::Pty {
                reader: pipe::Receiver::from_owned_fd_unchecked(copy()?).map_err(cannot)?,
                writer: pipe::Sender::from_owned_fd_unchecked(copy()?).map_err(cannot)?,
                control: master,
            }
        }
        None => match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
            (stdin, Some(stdout), Some(stderr)) => Io::Pipes {
                stdin,
                stdout,
                stderr,
            },
            _ => return Err(format!("the command on {node} has no output pipes")),
        },
    };
    Ok(Started { child, pgid, io })
}

/// Serves a [`ToAgent::Shell`]: starts the command, answers
/// [`FromAgent::Opened`] (or why not), then runs the session to its end.
pub(crate) async fn serve_shell(
    sessions: &Sessions,
    node: &str,
    attempt: u64,
    req: ShellRequest,
    mut send: SendStream,
    recv: RecvStream,
) -> anyhow::Result<()> {
    let Ok(permit) = sessions.shells.clone().try_acquire_owned() else {
        let refused = FromAgent::Refused(over_limit(node, "remote shells", SHELLS_MAX));
        return refuse(send, &refused).await;
    };
    let started = match start(node, attempt, req) {
        Ok(started) => started,
        Err(e) => return refuse(send, &FromAgent::Refused(e)).await,
    };
    send_frame(&mut send, &FromAgent::Opened, JOBS_FRAME_LEN_MAX).await?;
    session(started, send, recv, permit).await;
    Ok(())
}

/// Sends `answer` as the stream's only frame and ends it.
async fn refuse(mut send: SendStream, answer: &FromAgent) -> anyhow::Result<()> {
    send_frame(&mut send, answer, JOBS_FRAME_LEN_MAX).await?;
    let _ = send.finish();
    let _ = tokio::time::timeout(CLOSE_WAIT, send.stopped()).await;
    Ok(())
}

/// Reads the CLI's frames into the command until the stream ends. The CLI
/// never ends its side while the session runs (the end of its input is a
/// `StdinEnd` frame), so any end of it (finished, reset, the link gone, a
/// frame that is not input) means the CLI went.
async fn input(mut recv: RecvStream, io: InputSink) {
    let (mut stdin, mut terminal, control) = match io {
        InputSink::Pipe(stdin) => (stdin, None, None),
        InputSink::Pty { writer, control } => (None, Some(writer), Some(control)),
    };
    loop {
        match recv_frame::<ShellFrame, _>(&mut recv, SHELL_FRAME_LEN_MAX).await {
            Ok(Some(ShellFrame::Stdin(data))) => {
                if let Some(master) = terminal.as_mut() {
                    // A terminal that takes no more input fails only this write.
                    let _ = master.write_all(&data).await;
                } else if let Some(pipe) = stdin.as_mut()
                    && pipe.write_all(&data).await.is_err()
                {
                    // The command closed its stdin; later input is dropped.
                    stdin = None;
                }
            }
            Ok(Some(ShellFrame::StdinEnd)) => stdin = None,
            Ok(Some(ShellFrame::Resize { rows, cols })) => {
                if let Some(control) = &control {
                    let _ = rustix::termios::tcsetwinsize(control, winsize(rows, cols));
                }
            }
            Ok(None | Some(_)) | Err(_) => return,
        }
    }
}

/// Where a session's input goes.
enum InputSink {
    Pipe(Option<tokio::process::ChildStdin>),
    Pty {
        writer: pipe::Sender,
        control: OwnedFd,
    },
}

/// Sends what `pipe` gives, each piece wrapped by `wrap`, until it ends (a
/// terminal's master ends with EIO once every holder of its slave side
/// closed it).
async fn read_pipe(
    mut pipe: impl AsyncRead + Unpin,
    wrap: fn(Vec<u8>) -> ShellFrame,
    tx: mpsc::Sender<ShellFrame>,
) {
    let mut buf = vec![0u8; SHELL_PIECE_LEN];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send(wrap(buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn exit_info(status: std::io::Result<std::process::ExitStatus>) -> ExitInfo {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => ExitInfo {
            code: s.code(),
            signal: s.signal(),
        },
        Err(_) => ExitInfo {
            code: None,
            signal: None,
        },
    }
}

fn signal_group(pgid: i32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Runs an open session: output to the stream, the stream's input to the
/// command, until the command exits (its exit is the last frame) or the
/// stream goes (the command is killed).
async fn session(
    started: Started,
    mut send: SendStream,
    recv: RecvStream,
    _permit: OwnedSemaphorePermit,
) {
    let Started {
        mut child,
        pgid,
        io,
    } = started;
    let (tx, mut rx) = mpsc::channel::<ShellFrame>(OUTPUT_FRAMES_MAX);
    let mut readers = tokio::task::JoinSet::new();
    let sink = match io {
        Io::Pty {
            reader,
            writer,
            control,
        } => {
            readers.spawn(read_pipe(reader, ShellFrame::Stdout, tx));
            InputSink::Pty { writer, control }
        }
        Io::Pipes {
            stdin,
            stdout,
            stderr,
        } => {
            readers.spawn(read_pipe(stdout, ShellFrame::Stdout, tx.clone()));
            readers.spawn(read_pipe(stderr, ShellFrame::Stderr, tx));
            InputSink::Pipe(stdin)
        }
    };
    let mut input = tokio::spawn(input(recv, sink));
    let mut output_over = false;
    let mut exit: Option<ExitInfo> = None;
    // Armed once the command exits.
    let drain = tokio::time::sleep(Duration::from_secs(86_400));
    tokio::pin!(drain);
    let exited = loop {
        tokio::select! {
            frame = rx.recv(), if !output_over => match frame {
                Some(frame) => {
                    if send_frame(&mut send, &frame, SHELL_FRAME_LEN_MAX).await.is_err() {
                        break None;
                    }
                }
                None => {
                    output_over = true;
                    if let Some(e) = exit {
                        break Some(e);
                    }
                }
            },
            status = child.wait(), if exit.is_none() => {
                let e = exit_info(status);
                if output_over {
                    break Some(e);
                }
                exit = Some(e);
                drain.as_mut().reset(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
            },
            () = &mut drain, if exit.is_some() => break exit,
            _ = &mut input => break None,
        }
    };
    input.abort();
    match exited {
        Some(exit) => {
            // What it left behind gets a hangup, as when a terminal closes.
            signal_group(pgid, rustix::process::Signal::HUP);
            readers.abort_all();
            // Output already read goes out before the exit.
            while let Ok(frame) = rx.try_recv() {
                if send_frame(&mut send, &frame, SHELL_FRAME_LEN_MAX)
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if send_frame(&mut send, &ShellFrame::Exit(exit), SHELL_FRAME_LEN_MAX)
                .await
                .is_ok()
            {
                let _ = send.finish();
                let _ = tokio::time::timeout(CLOSE_WAIT, send.stopped()).await;
            }
        }
        None => {
            tracing::debug!(pgid, "a remote shell's stream went; killing its command");
            signal_group(pgid, rustix::process::Signal::HUP);
            let _ = tokio::time::timeout(HANGUP_GRACE, child.wait()).await;
            signal_group(pgid, rustix::process::Signal::KILL);
            let _ = send.reset(0u32.into());
            readers.abort_all();
        }
    }
}

/// When `args` (the process's own) say `pty-exec --parent PID -- CMD…`,
/// becomes CMD ([`pty_exec`]) and returns the code to exit with if it
/// could not; `None` for any other command line.
pub(crate) fn pty_exec_if_asked(args: &[String]) -> Option<i32> {
    if args.get(1).map(String::as_str) != Some("pty-exec") {
        return None;
    }
    let parent = args.get(3).and_then(|p| p.parse().ok()).unwrap_or(0);
    if args.get(4).map(String::as_str) != Some("--") {
        eprintln!("swactor: pty-exec was started with a malformed command line");
        return Some(2);
    }
    Some(pty_exec(parent, args.get(5..).unwrap_or_default()))
}

/// `swactor pty-exec --parent PID -- CMD…`: becomes CMD in a new session
/// whose controlling terminal is its stdin (a pseudo-terminal's slave),
/// hanging up when the agent `PID` dies. Returns only when it could not:
/// the exit code to end with (127 not found, 126 not runnable).
fn pty_exec(parent: u32, argv: &[String]) -> i32 {
    use std::os::unix::process::CommandExt;
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::HUP));
    let ppid = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if u32::try_from(ppid).ok() != Some(parent) {
        eprintln!("swactor: the agent that started this shell is gone");
        return 1;
    }
    if let Err(e) = rustix::process::setsid() {
        eprintln!("swactor: cannot start a session: {e}");
        return 1;
    }
    if let Err(e) = rustix::process::ioctl_tiocsctty(std::io::stdin()) {
        eprintln!("swactor: cannot take the terminal: {e}");
        return 1;
    }
    let Some((program, args)) = argv.split_first() else {
        eprintln!("swactor: no command to run");
        return 127;
    };
    let e = std::process::Command::new(program).args(args).exec();
    eprintln!("swactor: cannot run `{program}`: {e}");
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// Serves a [`ToAgent::Connect`]: dials `127.0.0.1:port`, answers
/// [`FromAgent::Opened`] (or why not), then copies bytes both ways.
pub(crate) async fn serve_connect(
    sessions: &Sessions,
    node: &str,
    port: u16,
    mut send: SendStream,
    mut recv: RecvStream,
) -> anyhow::Result<()> {
    let Ok(_permit) = sessions.connections.clone().try_acquire_owned() else {
        let refused =
            FromAgent::Refused(over_limit(node, "forwarded connections", CONNECTIONS_MAX));
        return refuse(send, &refused).await;
    };
    let dialled = tokio::time::timeout(
        CONNECT_WAIT,
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await;
    let tcp = match dialled {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => {
            let refused =
                FromAgent::Refused(format!("{node} could not connect to 127.0.0.1:{port}: {e}"));
            return refuse(send, &refused).await;
        }
        Err(_) => {
            let refused = FromAgent::Refused(format!(
                "{node} could not connect to 127.0.0.1:{port} within {}s",
                CONNECT_WAIT.as_secs()
            ));
            return refuse(send, &refused).await;
        }
    };
    send_frame(&mut send, &FromAgent::Opened, JOBS_FRAME_LEN_MAX).await?;
    let (mut from_tcp, mut to_tcp) = tcp.into_split();
    let up = async {
        tokio::io::copy(&mut recv, &mut to_tcp).await?;
        to_tcp.shutdown().await
    };
    let down = async {
        tokio::io::copy(&mut from_tcp, &mut send).await?;
        send.finish().map_err(std::io::Error::other)
    };
    if tokio::try_join!(up, down).is_err() {
        let _ = send.reset(0u32.into());
        let _ = recv.stop(0u32.into());
    } else {
        let _ = tokio::time::timeout(CLOSE_WAIT, send.stopped()).await;
    }
    Ok(())
}

/// What the CLI asked the daemon to open.
#[derive(Debug, Clone)]
pub(crate) enum Open {
    /// `swactor ssh`.
    Shell { node: String, request: ShellRequest },
    /// One connection of `swactor forward`; with `probe`, only whether the
    /// node may be reached.
    Connect {
        node: String,
        port: u16,
        probe: bool,
    },
}

impl Open {
    fn node(&self) -> &str {
        match self {
            Self::Shell { node, .. } | Self::Connect { node, .. } => node,
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Self::Shell { .. } => "a remote shell",
            Self::Connect { .. } => "a forwarded connection",
        }
    }
}

/// What the daemon's relay needs: the cluster (is the node there and
/// ready, which attempt) and the agents' jobs links.
pub(crate) struct RelayContext<'a> {
    pub(crate) cluster: &'a ClusterHandle,
    pub(crate) links: &'a super::service::Links,
    pub(crate) clock: &'a Clock,
    pub(crate) run_id: &'a swactor_provisioning::RunId,
}

/// The current attempt of `node` if it is ready, else why not in words.
async fn ready_attempt(cx: &RelayContext<'_>, open: &Open) -> Result<(LogicalNodeId, u64), String> {
    let name = open.node();
    let id = LogicalNodeId::parse(name).ok_or_else(|| crate::control::not_a_node_id(name))?;
    let unknown = || {
        format!(
            "there is no node {:?} in run {} (`swactor status` lists the nodes)",
            crate::words::cut(name),
            cx.run_id
        )
    };
    let described = cx
        .cluster
        .describe(id)
        .await
        .map_err(|e| crate::shapefile::refusal(&e))?
        .ok_or_else(unknown)?;
    if !described.desired && described.summary.is_none() {
        return Err(unknown());
    }
    let Some(summary) = described.summary else {
        return Err(format!(
            "{id} has no attempt now; {} needs a ready node",
            open.what()
        ));
    };
    if !summary.ready || summary.intent == Intent::Deleting {
        return Err(format!(
            "{id} is not ready (it is {}); {} needs a ready node",
            crate::words::state_word(&summary),
            open.what()
        ));
    }
    Ok((id, summary.attempt.0))
}

/// Serves the CLI's request to open a shell or a connection: checks the
/// node, asks its agent over its jobs link, tells the CLI, then relays the
/// stream's bytes both ways until both directions end (or one breaks, which
/// breaks the other: the agent then kills the command).
pub(crate) async fn relay(
    cx: RelayContext<'_>,
    open: Open,
    mut send: SendStream,
    mut recv: RecvStream,
    conn: &Connection,
) {
    let opened = open_on_agent(&cx, &open).await;
    let (answer, agent) = match opened {
        Ok((node, attempt, agent)) => (
            ControlResponse::Remote {
                node: node.to_string(),
                attempt,
            },
            agent,
        ),
        Err(e) => (ControlResponse::Error(e), None),
    };
    let text = serde_json::to_string(&answer).unwrap_or_default();
    if send_frame(&mut send, &text, FRAME_LEN_MAX).await.is_err() {
        return;
    }
    let Some((mut a_send, mut a_recv)) = agent else {
        let _ = send.finish();
        let _ = tokio::time::timeout(CLOSE_WAIT, conn.closed()).await;
        return;
    };
    // Each direction ends on its own. The agent stops reading a session's
    // input once its command has exited, while the command's last output
    // and its exit may still be on their way here: that ends the input
    // direction only, or the exit would be lost. Only a break of the CLI's
    // side, or of what comes from the agent, breaks the whole session.
    let (mut input_over, mut output_over) = (false, false);
    let broke = {
        let input = pipe_input(&mut recv, &mut a_send);
        let output = pipe(&mut a_recv, &mut send);
        tokio::pin!(input, output);
        loop {
            tokio::select! {
                ended = &mut input, if !input_over => match ended {
                    Ok(()) => input_over = true,
                    Err(_) => break true,
                },
                ended = &mut output, if !output_over => match ended {
                    Ok(()) => output_over = true,
                    Err(_) => break true,
                },
                // The CLI went (Ctrl-C, a signal, an error, or it read the
                // exit and closed) while a direction still waits for its
                // other side to say something.
                _ = conn.closed() => break true,
            }
            if input_over && output_over {
                break false;
            }
        }
    };
    if broke {
        // Each side hears that the other broke off, never a clean end
        // (dropped unfinished, a stream would end cleanly). Output already
        // ended cleanly stays so: the CLI may still be reading its end.
        let _ = a_send.reset(0u32.into());
        let _ = a_recv.stop(0u32.into());
        let _ = recv.stop(0u32.into());
        if !output_over {
            let _ = send.reset(0u32.into());
        }
        return;
    }
    // Both directions ended: once the CLI has the last bytes, the
    // connection may close (the CLI waits for that).
    let _ = tokio::time::timeout(CLOSE_WAIT, send.stopped()).await;
}

/// Copies `from` into `to` until `from` ends, then ends `to`.
async fn pipe(from: &mut RecvStream, to: &mut SendStream) -> std::io::Result<()> {
    tokio::io::copy(from, to).await?;
    to.finish().map_err(std::io::Error::other)
}

/// Copies the CLI's side `from` into the agent's `to` until `from` ends,
/// then ends `to`. When the agent takes no more (it stopped reading: the
/// command exited, or a forwarded port took no more), stops reading `from`
/// and ends well: what the agent still sends decides how the session ends.
/// Only `from` breaking off is an error.
async fn pipe_input(
    from: &mut RecvStream,
    to: &mut SendStream,
) -> Result<(), swactor_engine::iroh::endpoint::ReadError> {
    let mut buf = vec![0u8; SHELL_PIECE_LEN];
    loop {
        match from.read(&mut buf).await? {
            None => {
                let _ = to.finish();
                return Ok(());
            }
            Some(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    let _ = from.stop(0u32.into());
                    return Ok(());
                }
            }
        }
    }
}

/// The node's (id, attempt) and, unless only probed, the agent's stream,
/// opened; else why not in words.
async fn open_on_agent(
    cx: &RelayContext<'_>,
    open: &Open,
) -> Result<(LogicalNodeId, u64, Option<(SendStream, RecvStream)>), String> {
    let (node, attempt) = ready_attempt(cx, open).await?;
    let request = match open {
        Open::Connect { probe: true, .. } => return Ok((node, attempt, None)),
        Open::Connect { port, .. } => ToAgent::Connect {
            attempt,
            port: *port,
        },
        Open::Shell { request, .. } => ToAgent::Shell {
            attempt,
            argv: request.argv.clone(),
            pty: request.pty,
            env: request.env.clone(),
        },
    };
    let Some(link) = cx.links.wait(cx.clock, node, attempt, LINK_WAIT).await else {
        return Err(format!(
            "{node} is ready but its agent has no jobs link to this daemon (yet); try again \
             in a moment"
        ));
    };
    let broke = |e: &dyn std::fmt::Display| format!("the link to {node}'s agent broke off: {e}");
    let asked = async {
        let (mut a_send, mut a_recv) = link.open_bi().await.map_err(|e| broke(&e))?;
        send_frame(&mut a_send, &request, JOBS_FRAME_LEN_MAX)
            .await
            .map_err(|e| broke(&e))?;
        match recv_frame::<FromAgent, _>(&mut a_recv, JOBS_FRAME_LEN_MAX).await {
            Ok(Some(FromAgent::Opened)) => Ok((a_send, a_recv)),
            Ok(Some(FromAgent::Refused(e))) => Err(e),
            Ok(Some(other)) => Err(format!(
                "{node}'s agent answered {other:?}; is it the daemon's version?"
            )),
            Ok(None) => Err(broke(&"it closed the stream")),
            Err(e) => Err(broke(&e)),
        }
    };
    match tokio::time::timeout(OPEN_WAIT, asked).await {
        Ok(Ok(streams)) => Ok((node, attempt, Some(streams))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!(
            "{node}'s agent did not open {} within {}s",
            open.what(),
            OPEN_WAIT.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_engine::net::encode_frame;

    #[test]
    fn a_session_runs_its_command_or_a_login_shell_and_never_nothing() {
        let argv = vec!["uname".to_owned(), "-a".to_owned()];
        assert_eq!(command_line(Some(argv.clone()), true), Ok(argv));
        assert_eq!(
            command_line(None, true),
            Ok(vec!["/bin/sh".to_owned(), "-l".to_owned()])
        );
        assert_eq!(command_line(None, false), Ok(vec!["sh".to_owned()]));
        assert!(command_line(Some(Vec::new()), true).is_err());
    }

    #[test]
    fn the_largest_piece_fits_a_frame_and_a_larger_one_does_not() {
        let full = ShellFrame::Stdout(vec![0xff; SHELL_PIECE_LEN]);
        assert!(encode_frame(&full, SHELL_FRAME_LEN_MAX).is_ok());
        let over = ShellFrame::Stdin(vec![0xff; SHELL_FRAME_LEN_MAX]);
        assert!(encode_frame(&over, SHELL_FRAME_LEN_MAX).is_err());
        let exit = ShellFrame::Exit(ExitInfo {
            code: None,
            signal: Some(9),
        });
        assert!(encode_frame(&exit, SHELL_FRAME_LEN_MAX).unwrap().len() < 16);
    }

    #[tokio::test]
    async fn shell_frames_read_back_in_order_and_an_oversized_one_is_refused() {
        let frames = [
            ShellFrame::Stdin(b"echo hi\n".to_vec()),
            ShellFrame::Resize {
                rows: 40,
                cols: 120,
            },
            ShellFrame::StdinEnd,
            ShellFrame::Stderr(b"oops".to_vec()),
            ShellFrame::Exit(ExitInfo {
                code: Some(3),
                signal: None,
            }),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            send_frame(&mut bytes, f, SHELL_FRAME_LEN_MAX)
                .await
                .unwrap();
        }
        let mut reader = bytes.as_slice();
        for f in &frames {
            let got = recv_frame::<ShellFrame, _>(&mut reader, SHELL_FRAME_LEN_MAX)
                .await
                .unwrap();
            assert_eq!(got.as_ref(), Some(f));
        }
        assert_eq!(
            recv_frame::<ShellFrame, _>(&mut reader, SHELL_FRAME_LEN_MAX)
                .await
                .unwrap(),
            None
        );
        let big = encode_frame(&ShellFrame::Stdout(vec![1; 2 * SHELL_PIECE_LEN]), 1 << 20).unwrap();
        let mut reader = big.as_slice();
        assert!(
            recv_frame::<ShellFrame, _>(&mut reader, SHELL_FRAME_LEN_MAX)
                .await
                .is_err()
        );
    }

    #[test]
    fn a_window_is_never_empty() {
        let w = winsize(0, 0);
        assert_eq!((w.ws_row, w.ws_col), (1, 1));
        let w = winsize(24, 80);
        assert_eq!((w.ws_row, w.ws_col), (24, 80));
    }

    #[test]
    fn a_refusal_over_a_limit_names_the_limit() {
        let words = over_limit("worker-0", "remote shells", SHELLS_MAX);
        assert!(
            words.contains("worker-0 already has 16 remote shells open"),
            "{words}"
        );
    }

    #[tokio::test]
    async fn an_agent_refuses_the_shell_over_its_limit_and_takes_one_again_once_one_ends() {
        let sessions = Sessions::default();
        let held: Vec<_> = (0..SHELLS_MAX)
            .map(|_| sessions.shells.clone().try_acquire_owned().unwrap())
            .collect();
        assert!(sessions.shells.clone().try_acquire_owned().is_err());
        drop(held);
        assert!(sessions.shells.clone().try_acquire_owned().is_ok());
        assert_eq!(sessions.connections.available_permits(), CONNECTIONS_MAX);
    }
}
