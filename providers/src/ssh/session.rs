//! One authenticated SSH connection: running commands, streaming their output, uploading files.

use super::identity::fingerprint;
use super::known_hosts::{KnownHosts, Verdict};
use super::{ConnectOptions, SshError, SshIdentity, SshTarget, quote};
use russh::client::{self, Handle};
use russh::keys::{PrivateKeyWithHashAlg, PublicKey, PublicKeyOrCertificate};
use russh::{ChannelMsg, ChannelReadHalf, ChannelWriteHalf, Disconnect, Sig};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How much of each of a command's stdout and stderr [`SshSession::exec`]
/// keeps: the last this many bytes.
pub const OUTPUT_KEEP_BYTES: usize = 1 << 20;
/// Longest line [`SshSession::exec_lines`] delivers; a longer one arrives
/// cut into pieces of this many bytes.
pub const LINE_LEN_MAX: usize = 64 << 10;
/// Lines buffered for the reader of [`RemoteLines`]; beyond that the remote
/// command waits (SSH flow control) until the reader catches up.
pub const LINES_BUFFER_LEN: usize = 256;
/// How long a connection may stay silent before the client asks the server
/// whether it is still there.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
/// How many keepalives may go unanswered before the connection counts as broken.
pub const KEEPALIVE_MAX: usize = 3;

/// What a finished command produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// The end of its standard output (at most [`OUTPUT_KEEP_BYTES`]).
    pub stdout: Vec<u8>,
    /// The end of its standard error (at most [`OUTPUT_KEEP_BYTES`]).
    pub stderr: Vec<u8>,
    /// Its exit status; `None` when it ended without one (it was killed by
    /// a signal, or the server closed the channel without saying).
    pub status: Option<u32>,
    /// The signal that ended it (`KILL`, `TERM`, … without `SIG`), when the
    /// server reported one.
    pub signal: Option<String>,
}

impl ExecOutput {
    /// Whether the command exited with status 0.
    pub fn success(&self) -> bool {
        self.status == Some(0)
    }

    /// How the command ended, for messages: `exited with code 3`, `killed
    /// by signal 9 (SIGKILL)`, or `ended without an exit status`.
    pub fn describe_exit(&self) -> String {
        match (self.status, self.signal.as_deref()) {
            (None, Some(name))
                if crate::exit::Ended::from_ssh(None, Some(name))
                    == crate::exit::Ended::Unknown =>
            {
                // A signal this side does not know by name: its name, as sent.
                format!("killed by signal {name}")
            }
            (status, signal) => crate::exit::Ended::from_ssh(status, signal).to_string(),
        }
    }
}

/// The output of a running command, line by line, as it is written.
///
/// Lines of one stream keep their order; a stdout line and a stderr line
/// written close together may arrive in either order (the command writes
/// them to two pipes, which the server reads separately).
///
/// The stream ends with [`RemoteLine::Exit`] or [`RemoteLine::Closed`] and
/// then closes. Dropping it closes the SSH channel: the remote command then
/// sees its output pipes closed.
#[derive(Debug)]
pub struct RemoteLines {
    /// The lines, then how the command ended.
    pub lines: mpsc::Receiver<RemoteLine>,
}

/// One observation of a command run by [`SshSession::exec_lines`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteLine {
    /// A line of standard output, without its end of line (`\n` or `\r\n`).
    /// Bytes that are not UTF-8 are replaced with U+FFFD.
    Stdout(String),
    /// A line of standard error, in the same form.
    Stderr(String),
    /// The command ended: its exit status, or `None` when the server
    /// reported a signal instead.
    Exit(Option<u32>),
    /// The channel or the connection ended without an exit status or signal:
    /// how the command ended is unknown.
    Closed,
}

/// One authenticated SSH connection. Clones share it; it closes when the
/// last clone and the last [`RemoteLines`] are dropped, or on [`Self::close`].
///
/// Each command runs in a channel of its own, so clones may run commands
/// concurrently (OpenSSH allows 10 at a time by default, `MaxSessions`).
#[derive(Clone)]
pub struct SshSession {
    inner: Arc<Inner>,
}

struct Inner {
    handle: Handle<Client>,
    /// The target as text, for errors.
    label: String,
}

impl std::fmt::Debug for SshSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshSession")
            .field("target", &self.inner.label)
            .finish()
    }
}

/// How far [`SshSession::connect`] got, to explain a timeout.
#[derive(Clone, Copy, Debug)]
enum Phase {
    Tcp,
    Handshake,
    Auth,
}

impl SshSession {
    /// Connects to `target`, checks its host key against `known` and
    /// authenticates as `target.user` with `identity`, all within
    /// `opts.connect_timeout`.
    ///
    /// # Errors
    /// - [`SshError::NotReady`]: no TCP connection (refused, unreachable,
    ///   a name that does not resolve), no complete SSH handshake, or the
    ///   timeout passed.
    /// - [`SshError::UnknownHost`] / [`SshError::HostKeyChanged`]: see
    ///   [`KnownHosts`] and [`ConnectOptions::trust_on_first_use`].
    /// - [`SshError::Auth`]: the server refused the key.
    /// - [`SshError::Key`]: the known hosts file cannot be read or written.
    /// - [`SshError::Broken`]: the protocol failed after the handshake began.
    pub async fn connect(
        target: &SshTarget,
        identity: &SshIdentity,
        known: &KnownHosts,
        opts: &ConnectOptions,
    ) -> Result<Self, SshError> {
        let label = target.to_string();
        let mut phase = Phase::Tcp;
        let attempt = connect_in_phases(target, &label, identity, known, opts, &mut phase);
        match tokio::time::timeout(opts.connect_timeout, attempt).await {
            Ok(Ok(handle)) => Ok(Self {
                inner: Arc::new(Inner { handle, label }),
            }),
            Ok(Err(err)) => Err(err),
            Err(_elapsed) => {
                let what = match phase {
                    Phase::Tcp => "no TCP connection",
                    Phase::Handshake => "no SSH handshake (no banner or no key exchange)",
                    Phase::Auth => "no answer to the key authentication",
                };
                Err(SshError::NotReady {
                    target: label,
                    reason: format!("{what} within {:?}", opts.connect_timeout),
                })
            }
        }
    }

    /// The target as `user@host:port`.
    pub fn target(&self) -> &str {
        &self.inner.label
    }

    /// Whether the connection has ended (closed, or found broken).
    pub fn is_closed(&self) -> bool {
        self.inner.handle.is_closed()
    }

    /// Runs `command`, a shell command line for the remote user's login
    /// shell (build it with [`quote`] or [`super::command_line`]), feeds it
    /// `stdin` (if any) followed by end of file, and waits until it ends.
    ///
    /// Output is read while the input is written, so a command may produce
    /// any amount of output whatever it does with its input; each stream
    /// keeps its last [`OUTPUT_KEEP_BYTES`].
    ///
    /// There is no time limit: wrap the call in one. A cancelled call
    /// closes the command's channel; the server does not kill the command,
    /// which sees its input end and its output pipes closed.
    ///
    /// # Errors
    /// - [`SshError::Remote`]: the server refused to open a channel or run
    ///   the command (it never ran).
    /// - [`SshError::Broken`]: the connection ended before the command
    ///   reported how it ended; whether it ran, and how far, is unknown.
    pub async fn exec(&self, command: &str, stdin: Option<&[u8]>) -> Result<ExecOutput, SshError> {
        // The login shell may print before the command runs (a greeting in
        // ~/.bashrc, say): a marker line first, and only what follows it is
        // the command's output.
        let marked = format!("printf '%s\\n' {OUTPUT_MARK}; {command}");
        let (mut read, write) = self.start(&marked).await?;
        let send_input = async {
            if let Some(bytes) = stdin {
                write.half().data(bytes).await?;
            }
            write.half().eof().await
        };
        tokio::pin!(send_input);
        let mut input_sent = false;
        let mut stdout = Tail::default();
        let mut stderr = Tail::default();
        let mut status = None;
        let mut signal = None;
        loop {
            let msg = tokio::select! {
                msg = read.wait() => msg,
                // The command may exit without reading its input; the loop
                // then ends and the unsent rest is dropped.
                sent = &mut send_input, if !input_sent => {
                    input_sent = true;
                    if let Err(e) = sent {
                        tracing::debug!(target = %self.inner.label, "stdin not fully sent: {e}");
                    }
                    continue;
                }
            };
            match msg {
                Some(ChannelMsg::Data { data }) => stdout.push(&data),
                Some(ChannelMsg::ExtendedData { data, ext: 1 }) => stderr.push(&data),
                Some(ChannelMsg::ExitStatus { exit_status }) => status = Some(exit_status),
                Some(ChannelMsg::ExitSignal { signal_name, .. }) => {
                    signal = Some(signal_text(&signal_name));
                }
                Some(ChannelMsg::Close) => break,
                Some(_) => {}
                None if status.is_some() || signal.is_some() => break,
                None => {
                    return Err(self.broken(format!(
                        "the connection ended while `{}` ran, before it reported how it \
                         ended",
                        shorten(command)
                    )));
                }
            }
        }
        Ok(ExecOutput {
            stdout: after_mark(stdout.into_vec()),
            stderr: stderr.into_vec(),
            status,
            signal,
        })
    }

    /// Runs `command` (as [`Self::exec`], with no input) and returns its
    /// output line by line as the remote side writes it, then how it ended.
    ///
    /// # Errors
    /// [`SshError::Remote`] when the server refused to run it,
    /// [`SshError::Broken`] when the connection broke before it started.
    /// Once started, a broken connection shows as [`RemoteLine::Closed`].
    pub async fn exec_lines(&self, command: &str) -> Result<RemoteLines, SshError> {
        let (read, write) = self.start(command).await?;
        write.half().eof().await.map_err(|e| {
            self.broken(format!(
                "cannot close the input of `{}`: {e}",
                shorten(command)
            ))
        })?;
        let (tx, rx) = mpsc::channel(LINES_BUFFER_LEN);
        // The task holds the connection open while it streams.
        tokio::spawn(stream_lines(read, write, tx, Arc::clone(&self.inner)));
        Ok(RemoteLines { lines: rx })
    }

    /// Writes `bytes` to `remote_path` with permissions `mode` (e.g. `0o755`),
    /// creating missing parent directories (with the remote umask).
    ///
    /// # Guarantees
    /// The file at `remote_path` is either the old one or the complete new
    /// one, never a partial file: the bytes go to a temporary file in the
    /// same directory (created readable by the remote user only), which is
    /// given `mode` and then renamed over `remote_path`. A relative path is
    /// relative to the remote user's home directory. The data is not
    /// fsynced: a remote machine crash right after may lose it.
    ///
    /// # Panics
    /// When `mode` has bits beyond `0o7777` (a programmer error).
    ///
    /// # Errors
    /// [`SshError::Remote`] with the remote error output when a step failed
    /// (the old file, if any, is left in place); the errors of [`Self::exec`].
    pub async fn upload(&self, remote_path: &str, bytes: &[u8], mode: u32) -> Result<(), SshError> {
        assert!(mode <= 0o7777, "not a file mode: {mode:o}");
        let (dir, name) = match remote_path.rsplit_once('/') {
            Some(("", name)) => ("/", name),
            Some((dir, name)) => (dir, name),
            None => (".", remote_path),
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(SshError::Remote {
                target: self.inner.label.clone(),
                reason: format!("cannot upload to `{remote_path}`: it does not name a file"),
            });
        }
        let tmp = format!("{dir}/.{name}.swactor-upload");
        // `$$` makes the temporary name unique among concurrent uploads; the
        // trap removes it whatever step fails. The directories are made under
        // the usual umask, the temporary file under 077 until its chmod. The
        // size check refuses a file cut short, whatever cut it.
        let script = format!(
            "set -e; p={path}; t={tmp}.$$; mkdir -p -- {dir}; trap 'rm -f -- \"$t\"' EXIT; \
             umask 077; cat > \"$t\"; n=$(wc -c < \"$t\"); \
             if [ $((n)) -ne {len} ]; then echo \"received $((n)) of {len} bytes\" >&2; exit 1; fi; \
             chmod {mode:o} -- \"$t\"; mv -f -- \"$t\" \"$p\"; trap - EXIT",
            path = quote(remote_path),
            tmp = quote(&tmp),
            dir = quote(dir),
            len = bytes.len(),
        );
        let out = self.exec(&script, Some(bytes)).await?;
        if out.success() {
            return Ok(());
        }
        if out.status.is_none() {
            return Err(self.broken(format!(
                "the upload to `{remote_path}` ended without an exit status ({}), it may or \
                 may not have replaced the file",
                out.describe_exit()
            )));
        }
        Err(SshError::Remote {
            target: self.inner.label.clone(),
            reason: format!(
                "cannot upload to `{remote_path}` ({}): {}",
                out.describe_exit(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }

    /// Ends the connection; commands still running see their channel closed.
    /// Other clones of this session fail from then on.
    pub async fn close(&self) {
        let result = self
            .inner
            .handle
            .disconnect(Disconnect::ByApplication, "", "en")
            .await;
        if let Err(e) = result {
            tracing::debug!(target = %self.inner.label, "closing an SSH session: {e}");
        }
    }

    /// Opens a channel and starts `command` in it, waiting for the server to
    /// accept it.
    async fn start(&self, command: &str) -> Result<(Incoming, Writer), SshError> {
        let channel = self
            .inner
            .handle
            .channel_open_session()
            .await
            .map_err(|e| match e {
                russh::Error::ChannelOpenFailure(why) => SshError::Remote {
                    target: self.inner.label.clone(),
                    reason: format!("the server refused a session channel ({why:?})"),
                },
                e => self.broken(format!("cannot open a session channel: {e}")),
            })?;
        channel
            .exec(true, command)
            .await
            .map_err(|e| self.broken(format!("cannot send the command: {e}")))?;
        let (read, write) = channel.split();
        let write = Writer(Some(write));
        let mut incoming = Incoming {
            pending: None,
            read,
        };
        // The server answers the request when it starts the command. Flow
        // control news may come first; output or an exit before the answer
        // means the command runs, and is kept for the caller.
        loop {
            match incoming.read.wait().await {
                Some(ChannelMsg::Success) => return Ok((incoming, write)),
                Some(ChannelMsg::Failure) => {
                    return Err(SshError::Remote {
                        target: self.inner.label.clone(),
                        reason: format!("the server refused to run `{}`", shorten(command)),
                    });
                }
                Some(ChannelMsg::WindowAdjusted { .. } | ChannelMsg::XonXoff { .. }) => {}
                Some(other) => {
                    incoming.pending = Some(other);
                    return Ok((incoming, write));
                }
                None => {
                    return Err(self.broken(format!(
                        "the connection ended before `{}` started",
                        shorten(command)
                    )));
                }
            }
        }
    }

    fn broken(&self, reason: String) -> SshError {
        SshError::Broken {
            target: self.inner.label.clone(),
            reason,
        }
    }
}

async fn connect_in_phases(
    target: &SshTarget,
    label: &str,
    identity: &SshIdentity,
    known: &KnownHosts,
    opts: &ConnectOptions,
    phase: &mut Phase,
) -> Result<Handle<Client>, SshError> {
    let not_ready = |reason: String| SshError::NotReady {
        target: label.to_owned(),
        reason,
    };
    let tcp = tokio::net::TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| {
            not_ready(match e.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    format!(
                        "connection refused (nothing listens on port {})",
                        target.port
                    )
                }
                _ => format!("cannot connect: {e}"),
            })
        })?;
    // Lines of streamed output should leave at once, not wait for more.
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(target = %label, "cannot disable Nagle's algorithm: {e}");
    }
    *phase = Phase::Handshake;
    let client = Client {
        known: known.clone(),
        name: target.known_hosts_name(),
        label: label.to_owned(),
        trust_on_first_use: opts.trust_on_first_use,
    };
    let config = client::Config {
        client_id: russh::SshId::Standard(
            concat!("SSH-2.0-swactor_", env!("CARGO_PKG_VERSION")).into(),
        ),
        keepalive_interval: Some(KEEPALIVE_INTERVAL),
        keepalive_max: KEEPALIVE_MAX,
        nodelay: true,
        ..Default::default()
    };
    let mut handle = client::connect_stream(Arc::new(config), tcp, client)
        .await
        .map_err(|e| match e {
            ClientError::Refused(err) => err,
            // The server (or something else on the port) went away, or spoke
            // no SSH, before the handshake finished: a daemon still starting,
            // or one over its `MaxStartups`.
            ClientError::Ssh(
                e @ (russh::Error::IO(_)
                | russh::Error::Disconnect
                | russh::Error::HUP
                | russh::Error::Version
                | russh::Error::ConnectionTimeout),
            ) => not_ready(format!("no complete SSH handshake: {e}")),
            ClientError::Ssh(e) => SshError::Broken {
                target: label.to_owned(),
                reason: format!("the SSH handshake failed: {e}"),
            },
        })?;
    *phase = Phase::Auth;
    let key = PrivateKeyWithHashAlg::new(identity.private_key(), None);
    let result = handle
        .authenticate_publickey(target.user.as_str(), key)
        .await
        .map_err(|e| SshError::Broken {
            target: label.to_owned(),
            reason: format!("the key authentication failed: {e}"),
        })?;
    match result {
        russh::client::AuthResult::Success => Ok(handle),
        russh::client::AuthResult::Failure {
            remaining_methods, ..
        } => Err(SshError::Auth {
            target: label.to_owned(),
            reason: format!(
                "the server did not accept the key {} for user {} (it would accept: {}); add \
                 the key's public line (`{}`) to ~{}/.ssh/authorized_keys on the host",
                identity.fingerprint(),
                target.user,
                method_names(&remaining_methods),
                identity.public_openssh(),
                target.user,
            ),
        }),
    }
}

fn method_names(methods: &russh::MethodSet) -> String {
    let names: Vec<&str> = methods.iter().map(<&str>::from).collect();
    if names.is_empty() {
        "nothing".to_owned()
    } else {
        names.join(", ")
    }
}

/// The russh callbacks: only the host key check matters to us.
struct Client {
    known: KnownHosts,
    /// The target as a known hosts entry names it.
    name: String,
    label: String,
    trust_on_first_use: bool,
}

/// Why a connection attempt stopped inside russh.
#[derive(Debug)]
enum ClientError {
    Ssh(russh::Error),
    /// Our host key check refused the server.
    Refused(SshError),
}

impl From<russh::Error> for ClientError {
    fn from(e: russh::Error) -> Self {
        Self::Ssh(e)
    }
}

impl Client {
    fn verify(&self, offered: &PublicKey) -> Result<(), SshError> {
        let file_error = |e: std::io::Error| SshError::Key {
            path: self.known.path().to_owned(),
            reason: format!("cannot read or update the known hosts file: {e}"),
        };
        let mut verdict = self.known.check(&self.name, offered).map_err(file_error)?;
        if verdict == Verdict::Unknown && self.trust_on_first_use {
            verdict = self.known.record(&self.name, offered).map_err(file_error)?;
            if verdict == Verdict::Unknown {
                tracing::info!(
                    target = %self.label,
                    key = %fingerprint(offered),
                    file = %self.known.path().display(),
                    "first contact: recorded the host key",
                );
                return Ok(());
            }
        }
        match verdict {
            Verdict::Known => Ok(()),
            Verdict::Unknown => Err(SshError::UnknownHost {
                target: self.label.clone(),
                offered: fingerprint(offered),
                file: self.known.path().to_owned(),
            }),
            Verdict::Changed { .. } => Err(SshError::HostKeyChanged {
                target: self.label.clone(),
                known: verdict.known_fingerprint().unwrap_or_default(),
                offered: fingerprint(offered),
                file: self.known.path().to_owned(),
            }),
        }
    }
}

impl client::Handler for Client {
    type Error = ClientError;

    async fn check_server_key(
        &mut self,
        server_key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let offered = match server_key {
            PublicKeyOrCertificate::PublicKey { key, .. } => key.clone(),
            // A certificate is trusted like the plain key it certifies: we
            // keep no certificate authorities.
            PublicKeyOrCertificate::Certificate(cert) => PublicKey::from(cert.public_key().clone()),
        };
        self.verify(&offered).map_err(ClientError::Refused)?;
        Ok(true)
    }
}

/// A channel's sending half, which closes the channel when dropped: a
/// command whose caller gave up (a cancelled [`SshSession::exec`], a dropped
/// [`RemoteLines`]) does not hold one of the server's sessions until it ends.
/// Closing an already closed channel does nothing.
struct Writer(Option<ChannelWriteHalf<client::Msg>>);

impl Writer {
    fn half(&self) -> &ChannelWriteHalf<client::Msg> {
        self.0.as_ref().expect("the half is taken only on drop")
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(half) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                let _ = half.close().await;
            });
        }
    }
}

/// A channel's messages, after one read ahead while waiting for the command to start.
struct Incoming {
    pending: Option<ChannelMsg>,
    read: ChannelReadHalf,
}

impl Incoming {
    async fn wait(&mut self) -> Option<ChannelMsg> {
        match self.pending.take() {
            Some(msg) => Some(msg),
            None => self.read.wait().await,
        }
    }
}

/// The task behind [`SshSession::exec_lines`].
async fn stream_lines(
    mut read: Incoming,
    // Dropped at the end, which closes the channel.
    _write: Writer,
    tx: mpsc::Sender<RemoteLine>,
    inner: Arc<Inner>,
) {
    let mut stdout = Lines::default();
    let mut stderr = Lines::default();
    let mut status = None;
    let mut signalled = false;
    let end = loop {
        let msg = tokio::select! {
            msg = read.wait() => msg,
            // Nobody reads any more: dropping the writer closes the channel.
            () = tx.closed() => return,
        };
        let lines = match msg {
            Some(ChannelMsg::Data { data }) => stdout.push(&data, RemoteLine::Stdout),
            Some(ChannelMsg::ExtendedData { data, ext: 1 }) => {
                stderr.push(&data, RemoteLine::Stderr)
            }
            Some(ChannelMsg::ExitStatus { exit_status }) => {
                status = Some(exit_status);
                Vec::new()
            }
            Some(ChannelMsg::ExitSignal { signal_name, .. }) => {
                tracing::debug!(target = %inner.label, signal = %signal_text(&signal_name), "remote command killed");
                signalled = true;
                Vec::new()
            }
            Some(ChannelMsg::Close) | None => break status.is_some() || signalled,
            Some(_) => Vec::new(),
        };
        for line in lines {
            if tx.send(line).await.is_err() {
                return;
            }
        }
    };
    let mut last = stdout.finish(RemoteLine::Stdout);
    last.extend(stderr.finish(RemoteLine::Stderr));
    last.push(if end {
        RemoteLine::Exit(status)
    } else {
        RemoteLine::Closed
    });
    for line in last {
        if tx.send(line).await.is_err() {
            return;
        }
    }
}

/// Splits one output stream into lines.
#[derive(Default)]
struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    fn push(&mut self, data: &[u8], wrap: fn(String) -> RemoteLine) -> Vec<RemoteLine> {
        let mut lines = Vec::new();
        for &byte in data {
            if byte == b'\n' {
                lines.push(wrap(take_line(&mut self.partial)));
            } else {
                self.partial.push(byte);
                if self.partial.len() >= LINE_LEN_MAX {
                    lines.push(wrap(take_line(&mut self.partial)));
                }
            }
        }
        lines
    }

    /// The unfinished last line, if any.
    fn finish(&mut self, wrap: fn(String) -> RemoteLine) -> Vec<RemoteLine> {
        if self.partial.is_empty() {
            Vec::new()
        } else {
            vec![wrap(take_line(&mut self.partial))]
        }
    }
}

fn take_line(partial: &mut Vec<u8>) -> String {
    if partial.last() == Some(&b'\r') {
        partial.pop();
    }
    let line = String::from_utf8_lossy(partial).into_owned();
    partial.clear();
    line
}

/// The line [`Session::exec`] prints before running a command.
const OUTPUT_MARK: &str = "swactor-output-follows-9c4e";

/// What follows the first [`OUTPUT_MARK`] line of `stdout`: drops whatever
/// the login shell printed before the command ran. Output without the
/// mark (its start cut off by [`OUTPUT_KEEP_BYTES`]) is kept whole.
fn after_mark(stdout: Vec<u8>) -> Vec<u8> {
    let mark = format!("{OUTPUT_MARK}\n");
    let mark = mark.as_bytes();
    match stdout.windows(mark.len()).position(|w| w == mark) {
        Some(at) => stdout[at + mark.len()..].to_vec(),
        None => stdout,
    }
}

/// The last [`OUTPUT_KEEP_BYTES`] of a stream.
#[derive(Default)]
struct Tail {
    bytes: VecDeque<u8>,
}

impl Tail {
    fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(OUTPUT_KEEP_BYTES)..];
        let excess = (self.bytes.len() + data.len()).saturating_sub(OUTPUT_KEEP_BYTES);
        self.bytes.drain(..excess);
        self.bytes.extend(data);
    }

    fn into_vec(self) -> Vec<u8> {
        self.bytes.into()
    }
}

/// The name of a signal as OpenSSH sends it (`KILL`, no `SIG`).
fn signal_text(sig: &Sig) -> String {
    let name = match sig {
        Sig::ABRT => "ABRT",
        Sig::ALRM => "ALRM",
        Sig::FPE => "FPE",
        Sig::HUP => "HUP",
        Sig::ILL => "ILL",
        Sig::INT => "INT",
        Sig::KILL => "KILL",
        Sig::PIPE => "PIPE",
        Sig::QUIT => "QUIT",
        Sig::SEGV => "SEGV",
        Sig::TERM => "TERM",
        Sig::USR1 => "USR1",
        Sig::Custom(name) => name,
    };
    name.to_owned()
}

/// A command as errors show it: long scripts are cut.
fn shorten(command: &str) -> String {
    const SHOWN_CHARS_MAX: usize = 120;
    match command.char_indices().nth(SHOWN_CHARS_MAX) {
        Some((cut, _)) => format!("{}…", &command[..cut]),
        None => command.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_keeps_its_end_within_the_bound() {
        let mut tail = Tail::default();
        tail.push(&vec![1u8; OUTPUT_KEEP_BYTES - 1]);
        tail.push(&[2, 3, 4]);
        let kept = tail.into_vec();
        assert_eq!(kept.len(), OUTPUT_KEEP_BYTES);
        assert_eq!(kept[0], 1);
        assert_eq!(&kept[OUTPUT_KEEP_BYTES - 3..], &[2, 3, 4]);
        let mut tail = Tail::default();
        tail.push(&vec![5u8; OUTPUT_KEEP_BYTES + 10]);
        assert_eq!(tail.into_vec(), vec![5u8; OUTPUT_KEEP_BYTES]);
    }

    #[test]
    fn lines_are_split_across_packets_and_bounded() {
        let mut lines = Lines::default();
        assert_eq!(lines.push(b"ab", RemoteLine::Stdout), vec![]);
        assert_eq!(
            lines.push(b"c\r\nd\n\xffe", RemoteLine::Stdout),
            vec![
                RemoteLine::Stdout("abc".into()),
                RemoteLine::Stdout("d".into())
            ]
        );
        assert_eq!(
            lines.finish(RemoteLine::Stdout),
            vec![RemoteLine::Stdout("\u{fffd}e".into())]
        );
        let long = vec![b'x'; LINE_LEN_MAX + 1];
        let got = lines.push(&long, RemoteLine::Stderr);
        assert_eq!(got, vec![RemoteLine::Stderr("x".repeat(LINE_LEN_MAX))]);
        assert_eq!(
            lines.finish(RemoteLine::Stderr),
            vec![RemoteLine::Stderr("x".into())]
        );
    }

    #[test]
    fn long_commands_are_cut_in_messages() {
        assert_eq!(shorten("ls"), "ls");
        let long = "é".repeat(200);
        assert_eq!(shorten(&long).chars().count(), 121);
    }
}
