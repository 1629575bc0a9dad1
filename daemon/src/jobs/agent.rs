//! The agent's side of `swactor/jobs/0`.
//!
//! The agent serves the streams its daemon opens on the agent's swarm
//! connection once its join was welcomed ([`crate::agent`] hands each one
//! over): the daemon's key is proven by the connection itself, and nobody
//! else can open a stream on it. Every request names the attempt it is
//! meant for and one for another attempt is refused, so a run meant for a
//! node's previous attempt never reaches its replacement.
//!
//! Chunks live in `<node dir>/jobs/chunks/<hash>`. The agent fetches the
//! ones it lacks from the daemon's `iroh-blobs` provider, on a connection it
//! dials itself, and keeps a chunk only once every piece of it was verified
//! against its BLAKE3 hash tree. A run lives in `<node dir>/jobs/runs/<job>/`:
//! its workspace `ws/`, its output log `log` (see [`LogRecord`]) and, once
//! it ended, `exit` (its [`ExitInfo`] as JSON, written to `exit.part` and
//! renamed, so it is whole or absent). The run's command runs in its own
//! process group under `swactor job-exec`, which dies with the agent.
//!
//! Everything of a run is on disk until the daemon says `Forget`, so an
//! agent that restarts still answers `Attach` and `Collect` for the runs
//! its predecessor finished. A run without `exit` was still running when
//! its agent died, and its process died with it: `Attach` says so
//! ([`FromAgent::Died`]) after the log.
//!
//! Every output file `Collect` sends names its BLAKE3 hash first; the
//! daemon keeps the file only if the bytes it receives match.
//!
//! Over 1,000 lines in one file with its tests: the code is under 950 lines;
//! the rest are its unit tests, kept next to the code they check.

use super::{
    CHUNK_LEN, DATA_PIECE_LEN, ExitInfo, FromAgent, Hash, JOBS_FRAME_LEN_MAX, LogRecord, Setup,
    Stream, ToAgent, glob_match, hex, safe_relative, walk,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::iroh::{Endpoint, EndpointAddr};
use swactor_engine::net::{connect, recv_frame, send_frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Its command exited like this.
    Exited(ExitInfo),
    /// It was running when an earlier agent of this attempt died; its
    /// process died with that agent.
    Died,
}

/// What a run has done so far: how long its log is, and how it ended.
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    log_len: u64,
    end: Option<End>,
}

/// Writes `exit` to `<dir>/exit` whole or not at all.
fn write_exit(dir: &Path, exit: ExitInfo) -> std::io::Result<()> {
    use std::io::Write;
    let part = dir.join("exit.part");
    let mut f = std::fs::File::create(&part)?;
    f.write_all(&serde_json::to_vec(&exit).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&part, dir.join("exit"))?;
    // The rename itself is durable once the directory is.
    std::fs::File::open(dir)?.sync_all()
}

/// The exit recorded in `<dir>/exit`, if there is one.
fn read_exit(dir: &Path) -> Option<ExitInfo> {
    serde_json::from_slice(&std::fs::read(dir.join("exit")).ok()?).ok()
}

/// The runs an earlier agent left under `runs`, each ended one way or the other.
fn recover(runs: &Path) -> HashMap<String, Arc<Run>> {
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir(runs) else {
        return out;
    };
    for entry in entries.flatten() {
        let job = entry.file_name().to_string_lossy().into_owned();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || !safe_relative(&job) {
            continue;
        }
        let dir = entry.path();
        let log_len = std::fs::metadata(dir.join("log")).map_or(0, |m| m.len());
        let end = read_exit(&dir).map_or(End::Died, End::Exited);
        tracing::info!(%job, ?end, "a run an earlier agent left");
        let progress = watch::channel(Progress {
            log_len,
            end: Some(end),
        })
        .0;
        out.insert(
            job,
            Arc::new(Run {
                dir,
                // Nothing of it runs any more; there is nothing to kill.
                pgid: None,
                progress,
            }),
        );
    }
    out
}

#[derive(Debug)]
struct Run {
    dir: PathBuf,
    /// The process group of the command, while this agent runs it.
    pgid: Option<i32>,
    progress: watch::Sender<Progress>,
}

/// The agent's jobs: its chunk store and its runs.
#[derive(Debug, Clone)]
pub(crate) struct AgentJobs {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    node: String,
    attempt: u64,
    runs: Mutex<HashMap<String, Arc<Run>>>,
    /// Whether a run's command is started through `swactor job-exec` (only
    /// unit tests start it directly: their binary has no `job-exec`).
    exec_wrapper: bool,
    /// Test hook (debug builds): `SWACTOR_FAULT_TAMPER_OUTPUTS=PATH` flips a
    /// byte of the output file PATH as it is sent, after it was hashed.
    tamper_output: Option<String>,
    /// Its open remote shells and forwarded connections (see [`super::remote`]).
    sessions: super::remote::Sessions,
}

impl AgentJobs {
    /// Whether a run's command is running now.
    pub(crate) fn running(&self) -> bool {
        let runs = self
            .inner
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.values()
            .any(|r| r.pgid.is_some() && r.progress.borrow().end.is_none())
    }

    /// The jobs of the agent of (`node`, `attempt`), kept under `node_dir`,
    /// with every run an earlier agent left there.
    pub(crate) fn new(node_dir: &Path, node: String, attempt: u64) -> Self {
        let root = node_dir.join("jobs");
        let runs = recover(&root.join("runs"));
        let tamper_output = cfg!(debug_assertions)
            .then(|| std::env::var("SWACTOR_FAULT_TAMPER_OUTPUTS").ok())
            .flatten();
        Self {
            inner: Arc::new(Inner {
                root,
                node,
                attempt,
                runs: Mutex::new(runs),
                exec_wrapper: true,
                tamper_output,
                sessions: super::remote::Sessions::default(),
            }),
        }
    }

    /// As [`Self::new`], but its runs start their command directly: a test
    /// binary has no `swactor job-exec`.
    #[cfg(test)]
    pub(crate) fn unwrapped(node_dir: &Path, node: String, attempt: u64) -> Self {
        let jobs = Self::new(node_dir, node, attempt);
        let inner = Arc::into_inner(jobs.inner).expect("a new agent's jobs are not shared");
        Self {
            inner: Arc::new(Inner {
                exec_wrapper: false,
                ..inner
            }),
        }
    }

    fn chunk_path(&self, hash: &Hash) -> PathBuf {
        self.inner.root.join("chunks").join(hex(hash))
    }

    fn run(&self, job: &str) -> Option<Arc<Run>> {
        self.inner
            .runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(job)
            .cloned()
    }

    /// Serves, on a task of its own, one request the daemon opened on the
    /// agent's connection (`send`, `recv`). `daemon` is the daemon's
    /// endpoint as the agent dials it, for the blob transfers a request
    /// may need; the task ends with the request (or with the connection).
    pub(crate) fn spawn_request(
        &self,
        send: SendStream,
        recv: RecvStream,
        daemon: (Endpoint, EndpointAddr),
    ) {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.serve_stream(send, recv, &daemon).await {
                tracing::debug!(%e, "a jobs request failed");
            }
        });
    }

    async fn serve_stream(
        &self,
        mut send: SendStream,
        mut recv: RecvStream,
        daemon: &(Endpoint, EndpointAddr),
    ) -> anyhow::Result<()> {
        let Some(req) = recv_frame::<ToAgent, _>(&mut recv, JOBS_FRAME_LEN_MAX).await? else {
            return Ok(());
        };
        let attempt = match &req {
            ToAgent::Fetch { attempt, .. }
            | ToAgent::Start { attempt, .. }
            | ToAgent::Attach { attempt, .. }
            | ToAgent::Collect { attempt, .. }
            | ToAgent::Cancel { attempt, .. }
            | ToAgent::Forget { attempt, .. }
            | ToAgent::Prepare { attempt }
            | ToAgent::Shell { attempt, .. }
            | ToAgent::Connect { attempt, .. } => *attempt,
        };
        if attempt != self.inner.attempt {
            let refused = FromAgent::Refused(format!(
                "this agent serves {} attempt {}, not attempt {attempt}",
                self.inner.node, self.inner.attempt
            ));
            send_frame(&mut send, &refused, JOBS_FRAME_LEN_MAX).await?;
            let _ = send.finish();
            return Ok(());
        }
        match req {
            ToAgent::Fetch { chunks, .. } => self.fetch(&chunks, daemon, &mut send).await?,
            ToAgent::Start {
                job,
                manifest,
                argv,
                env,
                setup,
                ..
            } => {
                let answer = match self
                    .start(&job, &manifest, &argv, &env, setup.as_ref())
                    .await
                {
                    Ok(()) => FromAgent::Started,
                    Err(e) => FromAgent::Refused(e),
                };
                send_frame(&mut send, &answer, JOBS_FRAME_LEN_MAX).await?;
            }
            ToAgent::Attach { job, offset, .. } => {
                let Some(run) = self.run(&job) else {
                    send_frame(&mut send, &FromAgent::Unknown, JOBS_FRAME_LEN_MAX).await?;
                    let _ = send.finish();
                    return Ok(());
                };
                self.attach(&run, offset, &mut send).await?;
            }
            ToAgent::Collect {
                job,
                globs,
                output_max_bytes,
                ..
            } => match self.run(&job) {
                None => send_frame(&mut send, &FromAgent::Unknown, JOBS_FRAME_LEN_MAX).await?,
                Some(run) => {
                    self.collect(&run, &globs, output_max_bytes, &mut send)
                        .await?
                }
            },
            ToAgent::Cancel { job, .. } => {
                if let Some(run) = self.run(&job) {
                    cancel(&run).await;
                }
                send_frame(&mut send, &FromAgent::Done, JOBS_FRAME_LEN_MAX).await?;
            }
            ToAgent::Forget { job, .. } => {
                self.forget(&job).await;
                send_frame(&mut send, &FromAgent::Done, JOBS_FRAME_LEN_MAX).await?;
            }
            ToAgent::Prepare { .. } => {
                let answer = prepared(&daemon.1);
                send_frame(&mut send, &answer, JOBS_FRAME_LEN_MAX).await?;
            }
            // A session owns its stream to the end.
            ToAgent::Shell { argv, pty, env, .. } => {
                let request = super::remote::ShellRequest { argv, pty, env };
                let (node, sessions) = (&self.inner.node, &self.inner.sessions);
                return super::remote::serve_shell(sessions, node, attempt, request, send, recv)
                    .await;
            }
            ToAgent::Connect { port, .. } => {
                let (node, sessions) = (&self.inner.node, &self.inner.sessions);
                return super::remote::serve_connect(sessions, node, port, send, recv).await;
            }
        }
        let _ = send.finish();
        // Let the daemon read the last frame before the stream goes.
        let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
        Ok(())
    }

    /// Drops everything of the run of `job`, killing it first if it runs.
    async fn forget(&self, job: &str) {
        let run = self
            .inner
            .runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(job);
        if let Some(run) = run {
            cancel(&run).await;
            let _ = tokio::fs::remove_dir_all(&run.dir).await;
        }
    }

    /// Fetches the chunks of `chunks` this agent lacks from the daemon's blob
    /// provider; a `Stored` frame follows each, then `Fetched`.
    async fn fetch<W: AsyncWrite + Unpin + Send>(
        &self,
        chunks: &[Hash],
        daemon: &(Endpoint, EndpointAddr),
        send: &mut W,
    ) -> anyhow::Result<()> {
        let mut missing: Vec<Hash> = Vec::new();
        for hash in chunks {
            if !self.chunk_path(hash).is_file() && !missing.contains(hash) {
                missing.push(*hash);
            }
        }
        if missing.is_empty() {
            let none = FromAgent::Fetched {
                bytes: 0,
                chunks: 0,
            };
            return Ok(send_frame(send, &none, JOBS_FRAME_LEN_MAX).await?);
        }
        let (endpoint, addr) = daemon;
        let conn = match connect(
            endpoint,
            addr.clone(),
            iroh_blobs::ALPN,
            Duration::from_secs(5),
        )
        .await
        {
            Ok(conn) => conn,
            Err(e) => {
                let refused = FromAgent::Refused(format!(
                    "{} cannot reach the daemon's blob provider: {e}",
                    self.inner.node
                ));
                return Ok(send_frame(send, &refused, JOBS_FRAME_LEN_MAX).await?);
            }
        };
        let mut bytes = 0u64;
        for hash in &missing {
            match self.fetch_chunk(&conn, hash).await {
                Ok(n) => {
                    bytes += n;
                    send_frame(send, &FromAgent::Stored, JOBS_FRAME_LEN_MAX).await?;
                }
                Err(e) => {
                    conn.close(0u32.into(), b"failed");
                    send_frame(send, &FromAgent::Refused(e), JOBS_FRAME_LEN_MAX).await?;
                    return Ok(());
                }
            }
        }
        conn.close(0u32.into(), b"done");
        let fetched = FromAgent::Fetched {
            bytes,
            chunks: missing.len() as u64,
        };
        Ok(send_frame(send, &fetched, JOBS_FRAME_LEN_MAX).await?)
    }

    /// Fetches one chunk into the chunk store; returns its length. Every
    /// piece is verified against the chunk's hash tree before it is written,
    /// and a chunk that fails is not kept.
    async fn fetch_chunk(&self, conn: &Connection, hash: &Hash) -> Result<u64, String> {
        use bao_tree::io::BaoContentItem;
        use futures_util::StreamExt;
        use iroh_blobs::get::request::{GetBlobItem, get_blob};
        let node = &self.inner.node;
        let dir = self.inner.root.join("chunks");
        let part = dir.join(format!("{}.part", hex(hash)));
        let unstorable =
            |e: std::io::Error| format!("cannot store chunk {} on {node}: {e}", hex(hash));
        tokio::fs::create_dir_all(&dir).await.map_err(unstorable)?;
        let mut out = tokio::fs::File::create(&part).await.map_err(unstorable)?;
        let mut items = get_blob(conn.clone(), iroh_blobs::Hash::from_bytes(*hash));
        let mut len = 0usize;
        let got = loop {
            match items.next().await {
                Some(GetBlobItem::Item(BaoContentItem::Leaf(leaf))) => {
                    len += leaf.data.len();
                    if len > CHUNK_LEN {
                        break Err(format!(
                            "chunk {} rejected by {node}: more than a chunk's {CHUNK_LEN} bytes",
                            hex(hash)
                        ));
                    }
                    if let Err(e) = out.write_all(&leaf.data).await {
                        break Err(unstorable(e));
                    }
                }
                Some(GetBlobItem::Item(_)) => {}
                Some(GetBlobItem::Done(stats)) => break Ok(stats.payload_bytes_read),
                Some(GetBlobItem::Error(e)) => {
                    tracing::warn!(chunk = %hex(hash), %e, "a chunk was not fetched");
                    use iroh_blobs::get::{GetError, fsm::DecodeError};
                    let mismatch = matches!(
                        &e,
                        GetError::Decode {
                            source: DecodeError::LeafHashMismatch { .. }
                                | DecodeError::ParentHashMismatch { .. },
                            ..
                        }
                    );
                    let code = e.iroh_error_code().map(u64::from);
                    break Err(fetch_failed(
                        conn,
                        node,
                        hash,
                        mismatch,
                        code,
                        &e.to_string(),
                    ));
                }
                None => break Err(format!("the transfer of chunk {} ended early", hex(hash))),
            }
        };
        let kept = match got {
            Ok(n) => match out.flush().await {
                Ok(()) => tokio::fs::rename(&part, self.chunk_path(hash))
                    .await
                    .map(|()| n)
                    .map_err(unstorable),
                Err(e) => Err(unstorable(e)),
            },
            Err(e) => Err(e),
        };
        if kept.is_err() {
            let _ = tokio::fs::remove_file(&part).await;
        }
        kept
    }

    /// Materialises the workspace and starts the command.
    async fn start(
        &self,
        job: &str,
        manifest: &[super::FileEntry],
        argv: &[String],
        env: &[(String, String)],
        setup: Option<&Setup>,
    ) -> Result<(), String> {
        if !safe_relative(job) || job.contains('/') {
            return Err(format!("{job:?} is not a job id"));
        }
        if argv.is_empty() {
            return Err("no command to run".to_owned());
        }
        if self.run(job).is_some() {
            return Err(format!("job {job} already runs on {}", self.inner.node));
        }
        let dir = self.inner.root.join("runs").join(job);
        let ws = dir.join("ws");
        let made = self.materialise(&ws, manifest).await;
        if let Err(e) = made {
            // Nothing half-made is left behind.
            let _ = tokio::fs::remove_dir_all(&dir).await;
            return Err(e);
        }
        if let Some(setup) = setup {
            if setup.argv.is_empty() || !setup.key.bytes().all(|b| b.is_ascii_hexdigit()) {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                return Err("a setup needs a command and a hex key".to_owned());
            }
            let setups = self.inner.root.join("setup");
            if let Err(e) = tokio::fs::create_dir_all(&setups).await {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                return Err(format!("cannot make {}: {e}", setups.display()));
            }
        }
        match self.spawn(job, &dir, &ws, argv, env, setup).await {
            Ok(run) => {
                self.inner
                    .runs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(job.to_owned(), run);
                Ok(())
            }
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(&dir).await;
                Err(e)
            }
        }
    }

    async fn materialise(&self, ws: &Path, manifest: &[super::FileEntry]) -> Result<(), String> {
        tokio::fs::create_dir_all(ws)
            .await
            .map_err(|e| format!("cannot make the workspace {}: {e}", ws.display()))?;
        for file in manifest {
            if !safe_relative(&file.path) {
                return Err(format!(
                    "workspace path {:?} is not a plain relative path",
                    file.path
                ));
            }
            let path = ws.join(&file.path);
            if let Some(parent) = path.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| format!("cannot make {}: {e}", parent.display()))?;
            }
            let mut out = tokio::fs::File::create(&path)
                .await
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            for hash in &file.chunks {
                let data = tokio::fs::read(self.chunk_path(hash)).await.map_err(|e| {
                    format!(
                        "chunk {} of {} is not on {}: {e}",
                        hex(hash),
                        file.path,
                        self.inner.node
                    )
                })?;
                out.write_all(&data)
                    .await
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            }
            out.flush()
                .await
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            if file.executable {
                use std::os::unix::fs::PermissionsExt;
                tokio::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                    .await
                    .map_err(|e| format!("cannot make {} executable: {e}", path.display()))?;
            }
        }
        Ok(())
    }

    /// Starts `argv` in `ws` as run `job`, its output logged to `dir/log`
    /// and its exit recorded in `dir` when it ends.
    async fn spawn(
        &self,
        job: &str,
        dir: &Path,
        ws: &Path,
        argv: &[String],
        env: &[(String, String)],
        setup: Option<&Setup>,
    ) -> Result<Arc<Run>, String> {
        let mut command = self.run_command(job, ws, argv, env, setup)?;
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start the run on {}: {e}", self.inner.node))?;
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .ok_or("the run's process has no id")?;
        let log_path = dir.join("log");
        let log = tokio::fs::File::create(&log_path)
            .await
            .map_err(|e| format!("cannot make {}: {e}", log_path.display()))?;
        let (progress, _) = watch::channel(Progress::default());
        let run = Arc::new(Run {
            dir: dir.to_path_buf(),
            pgid: Some(pgid),
            progress,
        });
        let (tx, rx) = mpsc::channel::<(Stream, Vec<u8>)>(64);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(pump(out, Stream::Stdout, tx.clone()));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(pump(err, Stream::Stderr, tx.clone()));
        }
        drop(tx);
        tokio::spawn(log_until_exit(child, log, rx, run.clone()));
        Ok(run)
    }

    /// The command that starts run `job`: `argv` in `ws` (through this
    /// binary's `job-exec` when wrapped), in a process group of its own.
    fn run_command(
        &self,
        job: &str,
        ws: &Path,
        argv: &[String],
        env: &[(String, String)],
        setup: Option<&Setup>,
    ) -> Result<tokio::process::Command, String> {
        // This very binary, even if the file was replaced since it started.
        let exe = if Path::new("/proc/self/exe").exists() {
            PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe()
                .map_err(|e| format!("cannot find the agent's own binary: {e}"))?
        };
        let mut command = if self.inner.exec_wrapper {
            let mut c = tokio::process::Command::new(exe);
            c.arg("job-exec")
                .arg("--parent")
                .arg(rustix::process::getpid().as_raw_nonzero().to_string());
            if let Some(setup) = setup {
                c.arg("--setup")
                    .arg(self.inner.root.join("setup").join(&setup.key))
                    .arg(setup.argv.len().to_string())
                    .args(&setup.argv);
            }
            c.arg("--").args(argv);
            c
        } else {
            let mut c = tokio::process::Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        };
        command
            .current_dir(ws)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("SWACTOR_JOB", job)
            .env("SWACTOR_NODE", &self.inner.node)
            .env("SWACTOR_ATTEMPT", self.inner.attempt.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // Its own process group, so a cancel kills all it started.
            .process_group(0);
        Ok(command)
    }

    async fn collect<W: AsyncWrite + Unpin + Send>(
        &self,
        run: &Run,
        globs: &[String],
        output_max_bytes: u64,
        send: &mut W,
    ) -> anyhow::Result<()> {
        let ws = run.dir.join("ws");
        let files = {
            let ws = ws.clone();
            tokio::task::spawn_blocking(move || walk(&ws)).await??
        };
        let mut chosen: Vec<(String, PathBuf, u64)> = Vec::new();
        for glob in globs {
            let before = chosen.len();
            for (rel, path) in &files {
                if glob_match(glob, rel) && !chosen.iter().any(|(r, _, _)| r == rel) {
                    let len = tokio::fs::metadata(path)
                        .await
                        .map(|m| m.len())
                        .unwrap_or(0);
                    chosen.push((rel.clone(), path.clone(), len));
                }
            }
            let already = files.iter().any(|(rel, _)| glob_match(glob, rel));
            if chosen.len() == before && !already {
                let refused = FromAgent::Refused(format!(
                    "--output {glob:?} matched nothing in the workspace on {}",
                    self.inner.node
                ));
                send_frame(send, &refused, JOBS_FRAME_LEN_MAX).await?;
                return Ok(());
            }
        }
        let total: u64 = chosen.iter().map(|(_, _, len)| len).sum();
        if total > output_max_bytes {
            let (total, max) = crate::words::sizes_compared(total, output_max_bytes);
            let refused = FromAgent::Refused(format!(
                "the outputs on {} add up to {total}, more than the limit of {max}; none was \
                 collected",
                self.inner.node,
            ));
            send_frame(send, &refused, JOBS_FRAME_LEN_MAX).await?;
            return Ok(());
        }
        for (rel, path, _) in chosen {
            // Hashed first, then sent: a file that changes in between is
            // caught by the daemon's check, like one damaged on the way.
            let hash = {
                let path = path.clone();
                tokio::task::spawn_blocking(move || -> std::io::Result<Hash> {
                    let mut hasher = blake3::Hasher::new();
                    hasher.update_reader(std::fs::File::open(path)?)?;
                    Ok(*hasher.finalize().as_bytes())
                })
                .await??
            };
            let mut file = tokio::fs::File::open(&path).await?;
            let len = file.metadata().await?.len();
            let tamper = self.inner.tamper_output.as_deref() == Some(rel.as_str());
            send_frame(
                send,
                &FromAgent::File {
                    path: rel,
                    len,
                    hash,
                },
                JOBS_FRAME_LEN_MAX,
            )
            .await?;
            let mut left = len;
            let mut buf = vec![0u8; DATA_PIECE_LEN];
            let mut first = true;
            while left > 0 {
                let want =
                    usize::try_from(left.min(DATA_PIECE_LEN as u64)).unwrap_or(DATA_PIECE_LEN);
                file.read_exact(&mut buf[..want]).await?;
                if tamper && first {
                    buf[0] ^= 0xff;
                }
                first = false;
                send_frame(
                    send,
                    &FromAgent::Data(buf[..want].to_vec()),
                    JOBS_FRAME_LEN_MAX,
                )
                .await?;
                left -= want as u64;
            }
        }
        send_frame(send, &FromAgent::Collected, JOBS_FRAME_LEN_MAX).await?;
        Ok(())
    }

    /// Sends `run`'s log from `offset` on as it grows, then how it ended.
    async fn attach<W: AsyncWrite + Unpin + Send>(
        &self,
        run: &Run,
        mut offset: u64,
        send: &mut W,
    ) -> anyhow::Result<()> {
        let mut rx = run.progress.subscribe();
        let mut log = None;
        let mut buf = vec![0u8; DATA_PIECE_LEN];
        loop {
            let now = *rx.borrow_and_update();
            if now.log_len > offset {
                let want = usize::try_from((now.log_len - offset).min(DATA_PIECE_LEN as u64))
                    .unwrap_or(DATA_PIECE_LEN);
                if log.is_none() {
                    log = Some(tokio::fs::File::open(run.dir.join("log")).await?);
                }
                let Some(file) = log.as_mut() else {
                    continue;
                };
                file.seek(std::io::SeekFrom::Start(offset)).await?;
                file.read_exact(&mut buf[..want]).await?;
                send_frame(
                    send,
                    &FromAgent::Log(buf[..want].to_vec()),
                    JOBS_FRAME_LEN_MAX,
                )
                .await?;
                offset += want as u64;
                continue;
            }
            match now.end {
                Some(End::Exited(exit)) => {
                    send_frame(send, &FromAgent::Exit(exit), JOBS_FRAME_LEN_MAX).await?;
                    return Ok(());
                }
                Some(End::Died) => {
                    let died = FromAgent::Died(format!(
                        "the agent of {} attempt {} restarted while the run ran, and the \
                         run's process died with the agent before it",
                        self.inner.node, self.inner.attempt
                    ));
                    send_frame(send, &died, JOBS_FRAME_LEN_MAX).await?;
                    return Ok(());
                }
                None => {}
            }
            if rx.changed().await.is_err() {
                return Ok(());
            }
        }
    }
}

/// Writes a run's output to its log as it comes, then records how the run
/// exited: on disk, then in its progress.
async fn log_until_exit(
    mut child: tokio::process::Child,
    mut log: tokio::fs::File,
    mut rx: mpsc::Receiver<(Stream, Vec<u8>)>,
    watcher: Arc<Run>,
) {
    let mut len = 0u64;
    while let Some((stream, data)) = rx.recv().await {
        let record = LogRecord::encode(stream, &data);
        if log.write_all(&record).await.is_err() {
            break;
        }
        let _ = log.flush().await;
        len += record.len() as u64;
        watcher.progress.send_modify(|p| p.log_len = len);
    }
    let status = child.wait().await;
    let exit = match status {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            ExitInfo {
                code: s.code(),
                signal: s.signal(),
            }
        }
        Err(_) => ExitInfo {
            code: None,
            signal: None,
        },
    };
    // On disk before anyone is told, so what a daemon was told
    // survives this agent.
    let dir = watcher.dir.clone();
    match tokio::task::spawn_blocking(move || write_exit(&dir, exit)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(%e, "cannot record a run's exit"),
        Err(e) => tracing::warn!(%e, "cannot record a run's exit"),
    }
    watcher
        .progress
        .send_modify(|p| p.end = Some(End::Exited(exit)));
}

/// Reads `pipe` into `tx` until it ends.
async fn pump(
    mut pipe: impl AsyncRead + Unpin,
    stream: Stream,
    tx: mpsc::Sender<(Stream, Vec<u8>)>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send((stream, buf[..n].to_vec())).await.is_err() {
                    break;
                }
            }
        }
    }
}

/// Kills the run's process group and waits briefly for its exit.
/// This node's answer to [`ToAgent::Prepare`]: its address as the other
/// ranks reach it (`SWACTOR_NODE_ADDR` from the agent's environment, else
/// the local address this machine would send from to reach the daemon,
/// found without sending anything), a TCP port free a moment ago, and the
/// NVIDIA devices it has.
fn prepared(daemon: &EndpointAddr) -> FromAgent {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
    let from_env = std::env::var("SWACTOR_NODE_ADDR")
        .ok()
        .filter(|a| !a.trim().is_empty());
    let addr = from_env.unwrap_or_else(|| {
        daemon
            .ip_addrs()
            .find_map(|to| {
                let any: SocketAddr = if to.is_ipv4() {
                    (Ipv4Addr::UNSPECIFIED, 0).into()
                } else {
                    (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                };
                // A UDP connect picks the route and the source address; no
                // packet leaves.
                let s = UdpSocket::bind(any).ok()?;
                s.connect(to).ok()?;
                s.local_addr().ok().map(|a| a.ip())
            })
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
            .to_string()
    });
    let bind: SocketAddr = match addr.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => (ip, 0).into(),
        Ok(IpAddr::V6(_)) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        _ => (Ipv4Addr::UNSPECIFIED, 0).into(),
    };
    let port = TcpListener::bind(bind)
        .and_then(|l| l.local_addr())
        .map_or(0, |a| a.port());
    let gpus = std::fs::read_dir("/dev").map_or(0, |dir| {
        dir.flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .count()
    });
    FromAgent::Prepared {
        addr,
        port,
        gpus: u32::try_from(gpus).unwrap_or(u32::MAX),
    }
}

async fn cancel(run: &Run) {
    if run.progress.borrow().end.is_some() {
        return;
    }
    if let Some(pid) = run.pgid.and_then(rustix::process::Pid::from_raw) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let mut rx = run.progress.subscribe();
    let _ = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|p| p.end.is_some())).await;
}

/// When `args` (the process's own) say `job-exec --parent PID -- CMD…`,
/// becomes CMD ([`exec`]) and returns the code to exit with if it could
/// not; `None` for any other command line. The agent starts each run this
/// way, so `swactor` and any program that embeds the daemon ask this first
/// thing in `main`, before a runtime or a thread starts.
pub fn exec_if_asked(args: &[String]) -> Option<i32> {
    // A remote shell with a terminal (`swactor ssh`) starts the same way.
    if let Some(code) = super::remote::pty_exec_if_asked(args) {
        return Some(code);
    }
    if args.get(1).map(String::as_str) != Some("job-exec") {
        return None;
    }
    let parent = args.get(3).and_then(|p| p.parse().ok()).unwrap_or(0);
    // `--setup MARKER N SETUP…` may come before `--`.
    let (setup, rest) = if args.get(4).map(String::as_str) == Some("--setup") {
        let n: usize = args.get(6).and_then(|n| n.parse().ok()).unwrap_or(0);
        let marker = args.get(5).map(PathBuf::from).unwrap_or_default();
        let argv = args.get(7..7 + n).unwrap_or_default();
        (Some((marker, argv)), 7 + n)
    } else {
        (None, 4)
    };
    if args.get(rest).map(String::as_str) != Some("--") {
        eprintln!("swactor: job-exec was started with a malformed command line");
        return Some(2);
    }
    let argv = args.get(rest + 1..).unwrap_or_default();
    Some(exec(parent, setup, argv))
}

/// Runs a job's setup unless `marker` says it ran to success here before;
/// `Err` holds the exit code to end the run with.
fn run_setup(marker: &Path, argv: &[String]) -> Result<(), i32> {
    if marker.exists() {
        eprintln!("swactor: setup skipped: it ran on this node with this workspace before");
        return Ok(());
    }
    let Some((program, args)) = argv.split_first() else {
        return Ok(());
    };
    eprintln!("swactor: running setup `{}`", argv.join(" "));
    let status = match std::process::Command::new(program).args(args).status() {
        Ok(status) => status,
        Err(e) => {
            eprintln!("swactor: cannot run setup `{program}`: {e}");
            return Err(if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    };
    if !status.success() {
        use std::os::unix::process::ExitStatusExt;
        let ended = swactor_provisioning::exit::Ended::new(status.code(), status.signal());
        eprintln!(
            "swactor: setup `{}` {ended}; the job did not start",
            argv.join(" ")
        );
        return Err(status
            .code()
            .or(status.signal().map(|s| 128 + s))
            .unwrap_or(1));
    }
    // Written whole or not at all: a later run either skips or runs it again.
    let part = marker.with_extension("part");
    if std::fs::write(&part, argv.join(" "))
        .and_then(|()| std::fs::rename(&part, marker))
        .is_err()
    {
        eprintln!(
            "swactor: setup done, but {} could not be written: it runs again next time",
            marker.display()
        );
    }
    Ok(())
}

/// `swactor job-exec --parent PID -- CMD ARGS…`: becomes CMD, dying with
/// the agent `PID`. Returns only when CMD could not be started: the exit
/// code to end with (127 not found, 126 not runnable).
fn exec(parent: u32, setup: Option<(PathBuf, &[String])>, argv: &[String]) -> i32 {
    use std::os::unix::process::CommandExt;
    // A run outlives neither its agent nor a kill of it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let ppid = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if u32::try_from(ppid).ok() != Some(parent) {
        eprintln!("swactor: the agent that started this run is gone");
        return 1;
    }
    let Some((program, args)) = argv.split_first() else {
        eprintln!("swactor: no command to run");
        return 127;
    };
    if let Some((marker, setup)) = setup
        && let Err(code) = run_setup(&marker, setup)
    {
        return code;
    }
    let e = std::process::Command::new(program).args(args).exec();
    eprintln!("swactor: cannot run `{program}`: {e}");
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// Why fetching `hash` over `conn` failed, in words that say what it was: a
/// refusal over one of the daemon's caps, a connection that broke off,
/// bytes that failed their hash (`mismatch`), or anything else the daemon's
/// blob provider answered.
pub(super) fn fetch_failed(
    conn: &Connection,
    node: &str,
    hash: &Hash,
    mismatch: bool,
    code: Option<u64>,
    error: &str,
) -> String {
    use swactor_engine::iroh::endpoint::ConnectionError;
    if mismatch {
        return format!(
            "chunk {} rejected by {node}: its bytes do not match their BLAKE3 hash ({error})",
            hex(hash)
        );
    }
    // The blob provider's own codes for a request it ends (iroh-blobs'
    // ERR_PERMISSION, ERR_LIMIT, ERR_INTERNAL).
    match code {
        Some(1) => {
            return format!(
                "the daemon refused chunk {} to {node}: it was not granted to this node ({error})",
                hex(hash)
            );
        }
        Some(2) => {
            return format!(
                "the daemon refused to send chunk {} to {node}: over one of its limits, not a \
                 fault of the workspace ({error})",
                hex(hash)
            );
        }
        Some(3) => {
            return format!(
                "the daemon could not send chunk {} to {node}: its stored copy failed the check \
                 against its BLAKE3 hash, or its store failed ({error})",
                hex(hash)
            );
        }
        _ => {}
    }
    match conn.close_reason() {
        Some(ConnectionError::ApplicationClosed(close))
            if close.error_code == swactor_engine::net::codes::CLOSE_BUSY =>
        {
            format!(
                "the daemon refused to send chunk {} to {node}: {} (a limit of its, not a fault \
                 of the workspace)",
                hex(hash),
                String::from_utf8_lossy(&close.reason)
            )
        }
        Some(reason) => format!(
            "the transfer of chunk {} to {node} broke off: {reason}",
            hex(hash)
        ),
        None => format!(
            "the daemon did not send chunk {} to {node} ({error})",
            hex(hash)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::LOG_HEADER_LEN;

    fn agent(node_dir: &Path) -> AgentJobs {
        AgentJobs::unwrapped(node_dir, "worker-0".to_owned(), 2)
    }

    async fn frames(mut bytes: &[u8]) -> Vec<FromAgent> {
        let mut out = Vec::new();
        while let Some(f) = recv_frame::<FromAgent, _>(&mut bytes, JOBS_FRAME_LEN_MAX)
            .await
            .unwrap()
        {
            out.push(f);
        }
        out
    }

    fn log_of(frames: &[FromAgent]) -> Vec<LogRecord> {
        let mut log = Vec::new();
        for f in frames {
            if let FromAgent::Log(b) = f {
                log.extend_from_slice(b);
            }
        }
        LogRecord::decode_all(&log).0
    }

    #[tokio::test]
    async fn a_restarted_agent_answers_attach_and_collect_for_a_finished_run_until_forget() {
        let tmp = tempfile::tempdir().unwrap();
        let first = agent(tmp.path());
        let argv: Vec<String> = ["sh", "-c", "echo hello; echo result > out.txt; exit 3"]
            .map(str::to_owned)
            .to_vec();
        first.start("job-1", &[], &argv, &[], None).await.unwrap();
        let run = first.run("job-1").unwrap();
        let mut progress = run.progress.subscribe();
        tokio::time::timeout(
            Duration::from_secs(30),
            progress.wait_for(|p| p.end.is_some()),
        )
        .await
        .expect("the run ends")
        .unwrap();
        drop((progress, run, first));

        // A new agent on the same directory, as after a restart.
        let again = agent(tmp.path());
        let run = again.run("job-1").expect("the finished run is still known");
        let mut out = Vec::new();
        again.attach(&run, 0, &mut out).await.unwrap();
        let got = frames(&out).await;
        let log = log_of(&got);
        assert_eq!(log.len(), 1, "{got:?}");
        assert_eq!(
            (log[0].stream, log[0].data.as_slice()),
            (Stream::Stdout, &b"hello\n"[..])
        );
        assert_eq!(
            got.last(),
            Some(&FromAgent::Exit(ExitInfo {
                code: Some(3),
                signal: None
            }))
        );
        // From an offset: only the rest.
        let mut out = Vec::new();
        again.attach(&run, 3, &mut out).await.unwrap();
        let FromAgent::Log(rest) = &frames(&out).await[0] else {
            panic!("no log");
        };
        assert_eq!(rest.len(), LOG_HEADER_LEN + 6 - 3);

        let mut out = Vec::new();
        again
            .collect(&run, &["*.txt".to_owned()], 1 << 20, &mut out)
            .await
            .unwrap();
        let got = frames(&out).await;
        assert_eq!(
            got,
            [
                FromAgent::File {
                    path: "out.txt".to_owned(),
                    len: 7,
                    hash: *blake3::hash(b"result\n").as_bytes(),
                },
                FromAgent::Data(b"result\n".to_vec()),
                FromAgent::Collected,
            ]
        );

        // Forgotten, it is gone for good, also for the next agent.
        drop(run);
        again.forget("job-1").await;
        assert!(again.run("job-1").is_none());
        assert!(agent(tmp.path()).run("job-1").is_none());
        assert!(!tmp.path().join("jobs/runs/job-1").exists());
    }

    #[tokio::test]
    async fn a_run_its_agent_left_without_an_exit_reports_its_log_then_that_it_died() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("jobs/runs/job-2");
        std::fs::create_dir_all(dir.join("ws")).unwrap();
        std::fs::write(dir.join("log"), LogRecord::encode(Stream::Stderr, b"half")).unwrap();
        // A torn exit (the agent died mid-write) is no exit.
        std::fs::write(dir.join("exit.part"), b"{\"co").unwrap();
        let agent = agent(tmp.path());
        let run = agent.run("job-2").unwrap();
        let mut out = Vec::new();
        agent.attach(&run, 0, &mut out).await.unwrap();
        let got = frames(&out).await;
        assert_eq!(log_of(&got)[0].data, b"half");
        let Some(FromAgent::Died(why)) = got.last() else {
            panic!("{got:?}");
        };
        assert!(
            why.contains("worker-0 attempt 2 restarted while the run ran"),
            "{why}"
        );
        // Nothing of it runs, so a cancel has nothing to wait for.
        tokio::time::timeout(Duration::from_secs(1), cancel(&run))
            .await
            .unwrap();
        // And it cannot be started again under the same job.
        let again = agent
            .start("job-2", &[], &["true".to_owned()], &[], None)
            .await;
        assert!(again.unwrap_err().contains("already runs"));
    }

    #[test]
    fn an_exit_is_written_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let exit = ExitInfo {
            code: None,
            signal: Some(9),
        };
        write_exit(tmp.path(), exit).unwrap();
        assert_eq!(read_exit(tmp.path()), Some(exit));
        assert!(!tmp.path().join("exit.part").exists());
    }
}
