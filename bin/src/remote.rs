//! `swactor ssh` and `swactor forward`: a shell, a command or TCP
//! connections on a node, through the daemon and its link to the node's
//! agent (no SSH server; see `docs/remote-shell.md`).

use crate::client::{Client, unexpected, with_client};
use crate::protocol::{ControlRequest, ControlResponse, FRAME_LEN_MAX};
use crate::words::cut_long_words;
use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::time::Duration;
use swactor_daemon::jobs::{SHELL_FRAME_LEN_MAX, SHELL_PIECE_LEN, ShellFrame};
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::net::{recv_frame, send_frame};
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

/// `swactor ssh NODE [-t] [-- CMD ARGS…]`.
#[derive(Debug, clap::Args)]
pub(crate) struct SshArgs {
    /// The node, e.g. `worker-0`.
    pub(crate) node: String,
    /// Give the command a terminal even when stdin is not one.
    #[arg(short = 't')]
    pub(crate) tty: bool,
    /// The command and its arguments (default: a login shell).
    #[arg(last = true, value_name = "CMD")]
    pub(crate) argv: Vec<String>,
}

/// `swactor forward NODE LOCAL_PORT[:REMOTE_PORT]`.
#[derive(Debug, clap::Args)]
pub(crate) struct ForwardArgs {
    /// The node, e.g. `worker-0`.
    pub(crate) node: String,
    /// The port to listen on at 127.0.0.1 here (0: any free one), and the
    /// port on the node's 127.0.0.1 to connect to (default: the same).
    #[arg(value_name = "LOCAL_PORT[:REMOTE_PORT]")]
    pub(crate) ports: String,
}

/// Input frames waiting for the stream (stdin pieces, window sizes).
const INPUT_FRAMES_MAX: usize = 4;

/// Forwarded connections relayed at once; more wait to be accepted. Each
/// is a control connection of its own, and the daemon serves 64 of those
/// in all, so some are always left for other commands.
const FORWARDS_MAX: usize = 32;

/// How long a finished forwarded connection waits for the daemon to close it.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// The terminal's size as (rows, columns), if stdin or stdout is one.
fn window_size() -> Option<(u16, u16)> {
    let size = rustix::termios::tcgetwinsize(std::io::stdin())
        .or_else(|_| rustix::termios::tcgetwinsize(std::io::stdout()))
        .ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then_some((size.ws_row, size.ws_col))
}

/// The terminal in raw mode while this lives: keys go to the remote
/// terminal as they are typed (Ctrl-C included), and the mode it had is
/// put back when this is dropped, on every way out (an error, a signal
/// handled, a panic unwinding).
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> std::io::Result<Self> {
        use rustix::termios::{OptionalActions, tcgetattr, tcsetattr};
        let saved = tcgetattr(std::io::stdin())?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(std::io::stdin(), OptionalActions::Now, &raw)?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        use rustix::termios::{OptionalActions, tcsetattr};
        let _ = tcsetattr(std::io::stdin(), OptionalActions::Now, &self.saved);
    }
}

/// The daemon's first answer on a remote stream: open, or why not.
async fn opened(conn: &Connection, recv: &mut RecvStream) -> Result<()> {
    let Some(text) = recv_frame::<String, _>(recv, FRAME_LEN_MAX).await? else {
        bail!("the daemon closed the stream without an answer");
    };
    match serde_json::from_str::<ControlResponse>(&text)? {
        ControlResponse::Remote { .. } => Ok(()),
        ControlResponse::Error(e) => {
            conn.close(0u32.into(), b"refused");
            bail!("{}", cut_long_words(&e))
        }
        other => Err(unexpected(&other)),
    }
}

/// `swactor ssh`: runs the session and returns its exit code (the remote
/// command's, 128 + N for a signal).
pub(crate) async fn ssh(state_dir: &Path, args: SshArgs) -> Result<i32> {
    let stdin_tty = std::io::stdin().is_terminal();
    let pty = args.tty || (args.argv.is_empty() && stdin_tty);
    let size = pty.then(|| window_size().unwrap_or((24, 80)));
    let env = if pty {
        let term = std::env::var("TERM").unwrap_or_else(|_| "xterm".to_owned());
        vec![("TERM".to_owned(), term)]
    } else {
        Vec::new()
    };
    let req = ControlRequest::Shell {
        node: args.node.clone(),
        argv: (!args.argv.is_empty()).then_some(args.argv),
        pty: size,
        env,
    };
    with_client(state_dir, async |c| {
        let (conn, send, mut recv) = c.open_stream(&req).await?;
        opened(&conn, &mut recv).await?;
        let raw = if pty && stdin_tty {
            Some(RawMode::enter().context("cannot put the terminal in raw mode")?)
        } else {
            None
        };
        let ended = session(&args.node, send, recv, pty).await;
        // The terminal is itself again before anything more is printed.
        drop(raw);
        conn.close(0u32.into(), b"done");
        ended
    })
    .await
}

/// Reads stdin on a thread of its own (a read of a terminal cannot be
/// cancelled, and a runtime waits for its blocking tasks at exit) into
/// `tx`, ending with `StdinEnd`.
fn read_stdin(tx: mpsc::Sender<ShellFrame>) {
    let spawned = std::thread::Builder::new()
        .name("stdin".to_owned())
        .spawn(move || {
            let mut buf = vec![0u8; SHELL_PIECE_LEN];
            let mut stdin = std::io::stdin().lock();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx
                            .blocking_send(ShellFrame::Stdin(buf[..n].to_vec()))
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = tx.blocking_send(ShellFrame::StdinEnd);
        });
    if let Err(e) = spawned {
        tracing::warn!(%e, "cannot read stdin");
    }
}

/// A stream that, dropped, is reset rather than finished: the agent takes
/// any end of the CLI's side for the CLI going, and so it must be when the
/// CLI stops short (a signal, an error).
struct ResetOnDrop(SendStream);

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        let _ = self.0.reset(0u32.into());
    }
}

/// Sends the input frames, and the window's size whenever it changed
/// (only the latest: sizes in between are skipped), until the stream breaks.
async fn write_input(
    send: SendStream,
    mut rx: mpsc::Receiver<ShellFrame>,
    mut sizes: watch::Receiver<Option<(u16, u16)>>,
    pty: bool,
) {
    let mut send = ResetOnDrop(send);
    let send = &mut send.0;
    let mut input_open = true;
    loop {
        let frame = tokio::select! {
            frame = rx.recv(), if input_open => match frame {
                // A terminal has no end of input of its own: its Ctrl-D is a key.
                Some(ShellFrame::StdinEnd) if pty => continue,
                Some(frame) => frame,
                None => {
                    input_open = false;
                    continue;
                }
            },
            changed = sizes.changed() => {
                let size = *sizes.borrow_and_update();
                match (changed, size) {
                    (Ok(()), Some((rows, cols))) => ShellFrame::Resize { rows, cols },
                    (Ok(()), None) => continue,
                    // The stream stays open: the session ends when the command does.
                    (Err(_), _) => std::future::pending().await,
                }
            }
        };
        if send_frame(send, &frame, SHELL_FRAME_LEN_MAX).await.is_err() {
            return;
        }
    }
}

/// Prints the session's output until the command's exit, which it returns
/// as a shell's exit code; a signal to this process ends it with 128 + N.
async fn session(node: &str, send: SendStream, mut recv: RecvStream, pty: bool) -> Result<i32> {
    let (tx, rx) = mpsc::channel::<ShellFrame>(INPUT_FRAMES_MAX);
    read_stdin(tx);
    let (sizes, sizes_rx) = watch::channel(None);
    // Input goes out on a task of its own: a command that stops reading
    // its input must not stop its output from being shown.
    let writer = tokio::spawn(write_input(send, rx, sizes_rx, pty));
    let mut winch = signal(SignalKind::window_change())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut quit = signal(SignalKind::quit())?;
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let ended = loop {
        tokio::select! {
            frame = recv_frame::<ShellFrame, _>(&mut recv, SHELL_FRAME_LEN_MAX) => match frame {
                Ok(Some(ShellFrame::Stdout(data))) => {
                    stdout.write_all(&data).await?;
                    stdout.flush().await?;
                }
                Ok(Some(ShellFrame::Stderr(data))) => {
                    stderr.write_all(&data).await?;
                    stderr.flush().await?;
                }
                Ok(Some(ShellFrame::Exit(exit))) => break Ok(exit.shell_code()),
                Ok(Some(other)) => break Err(anyhow::anyhow!(
                    "{node}'s agent sent {other:?}; are the CLI and the daemon the same version?"
                )),
                // No exit status came: exit 1, and say why in words.
                Ok(None) => break Err(anyhow::anyhow!(
                    "the connection to {node} ended before the command's exit status arrived \
                     (the daemon or the node's agent went away)"
                )),
                Err(e) => break Err(anyhow::Error::new(e).context(format!(
                    "the connection to {node} broke off before the command's exit status arrived"
                ))),
            },
            _ = winch.recv(), if pty => {
                if let Some(size) = window_size() {
                    sizes.send_replace(Some(size));
                }
            }
            _ = int.recv() => break Ok(130),
            _ = term.recv() => break Ok(143),
            _ = hup.recv() => break Ok(129),
            _ = quit.recv() => break Ok(131),
        }
    };
    writer.abort();
    ended
}

/// `LOCAL_PORT[:REMOTE_PORT]` as (local, remote).
fn parse_ports(spec: &str) -> Result<(u16, u16), String> {
    let port = |p: &str, which: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("{which} port {p:?} is not a port number (0 to 65535)"))
    };
    let (local, remote) = match spec.split_once(':') {
        Some((l, r)) => (port(l, "the local")?, port(r, "the remote")?),
        None => {
            let p = port(spec, "the")?;
            (p, p)
        }
    };
    if remote == 0 {
        return Err(format!(
            "{spec:?} names no port on the node: give it as LOCAL_PORT:REMOTE_PORT, e.g. 0:8000"
        ));
    }
    Ok((local, remote))
}

/// `swactor forward`: relays every connection to 127.0.0.1:LOCAL_PORT to
/// REMOTE_PORT on the node until Ctrl-C.
pub(crate) async fn forward(state_dir: &Path, args: ForwardArgs) -> Result<i32> {
    let (local, remote) = parse_ports(&args.ports).map_err(anyhow::Error::msg)?;
    let node = args.node;
    with_client(state_dir, async |c| {
        // The node is checked once before anything listens.
        let probe = ControlRequest::Connect {
            node: node.clone(),
            port: remote,
            probe: true,
        };
        let (conn, _send, mut recv) = c.open_stream(&probe).await?;
        opened(&conn, &mut recv).await?;
        conn.close(0u32.into(), b"done");
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", local))
            .await
            .with_context(|| format!("cannot listen on 127.0.0.1:{local}"))?;
        let port = listener.local_addr()?.port();
        {
            let mut out = crate::term::Stdout;
            writeln!(
                out,
                "forwarding 127.0.0.1:{port} → {node}:{remote} (Ctrl-C to stop)"
            )?;
            out.flush()?;
        }
        let stop = tokio::signal::ctrl_c();
        tokio::pin!(stop);
        // Relayed on this task, so they may borrow the client.
        let mut open = futures_util::stream::FuturesUnordered::new();
        loop {
            tokio::select! {
                _ = &mut stop => break,
                accepted = listener.accept(), if open.len() < FORWARDS_MAX => match accepted {
                    Ok((tcp, peer)) => open.push(forward_one(c, &node, remote, tcp, peer)),
                    Err(e) => eprintln!("swactor: a connection was not accepted: {e}"),
                },
                Some(()) = open.next(), if !open.is_empty() => {}
            }
        }
        Ok(0)
    })
    .await
}

/// Relays one accepted connection to the node's `port`; a failure closes
/// it and is printed, and the forward goes on.
async fn forward_one(
    c: &Client,
    node: &str,
    port: u16,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
) {
    if let Err(e) = relay_one(c, node, port, tcp).await {
        eprintln!(
            "swactor: connection from {peer} to {node}:{port} closed: {}",
            cut_long_words(&format!("{e:#}"))
        );
    }
}

async fn relay_one(
    c: &Client,
    node: &str,
    port: u16,
    mut tcp: tokio::net::TcpStream,
) -> Result<()> {
    let req = ControlRequest::Connect {
        node: node.to_owned(),
        port,
        probe: false,
    };
    let (conn, mut send, mut recv) = c.open_stream(&req).await?;
    opened(&conn, &mut recv).await?;
    let (mut from_tcp, mut to_tcp) = tcp.split();
    let up = async {
        tokio::io::copy(&mut from_tcp, &mut send).await?;
        send.finish().map_err(std::io::Error::other)
    };
    let down = async {
        tokio::io::copy(&mut recv, &mut to_tcp).await?;
        to_tcp.shutdown().await
    };
    if let Err(e) = tokio::try_join!(up, down) {
        let _ = send.reset(0u32.into());
        let _ = recv.stop(0u32.into());
        conn.close(1u32.into(), b"broken");
        return Err(e.into());
    }
    // The daemon closes once it has relayed the last bytes both ways.
    let _ = tokio::time::timeout(CLOSE_WAIT, conn.closed()).await;
    conn.close(0u32.into(), b"done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forward_names_its_ports_or_is_refused_in_words() {
        assert_eq!(parse_ports("8000"), Ok((8000, 8000)));
        assert_eq!(parse_ports("0:8000"), Ok((0, 8000)));
        assert_eq!(parse_ports("8080:80"), Ok((8080, 80)));
        assert!(parse_ports("0").unwrap_err().contains("0:8000"));
        assert!(parse_ports("x").unwrap_err().contains("not a port number"));
        assert!(
            parse_ports("1:70000")
                .unwrap_err()
                .contains("the remote port")
        );
    }
}
