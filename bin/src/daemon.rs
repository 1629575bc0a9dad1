//! `swactor up`: the daemon, in the foreground.

use crate::progress::Progress;
use crate::protocol::{
    ControlRequest, ControlResponse, FRAME_LEN_MAX, Heartbeat, JoinReply, JoinRequest,
};
use crate::shapefile::ShapeFile;
use crate::state::StateDir;
use anyhow::{Context, Result};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::{
    Cluster, ClusterConfig, ClusterEvent, ClusterHandle, ClusterSnapshot, ShutdownMode,
    ShutdownReport,
};
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{
    ALPN_CONTROL, ALPN_SWARM, ALPN_TELEMETRY, Allowlist, EndpointTicket, GuardedRouterBuilder,
    NetConfig, bind_endpoint, recv_frame, send_frame,
};
use swactor_engine::telemetry::{NdjsonConfig, NdjsonSink, TelemetryConfig, TelemetryPublisher};
use swactor_providers::process::{ProcessConfig, ProcessProvider, join_token};
use swactor_provisioning::{ClusterShape, DesiredUpdate, Generation, RunId, UpdateError};
use tokio::sync::{mpsc, oneshot};

/// Options of `swactor up`.
#[derive(Debug)]
pub(crate) struct UpOptions {
    /// The shape to converge on, if any.
    pub(crate) shape: Option<PathBuf>,
    /// The state directory.
    pub(crate) state_dir: PathBuf,
    /// Exit once converged.
    pub(crate) until_converged: bool,
    /// How long to wait for convergence.
    pub(crate) timeout: Duration,
    /// Leave nodes running on exit.
    pub(crate) keep: bool,
}

type DownRequest = (bool, oneshot::Sender<ShutdownReport>);

/// Runs the daemon until it is told to stop. Returns the process exit code.
///
/// # Errors
/// Bad input (shape, state directory) or a failure to start.
pub(crate) async fn up(opts: UpOptions) -> Result<i32> {
    let started = std::time::Instant::now();
    // Everything the user could have got wrong is checked before anything starts.
    let file = opts.shape.as_deref().map(ShapeFile::load).transpose()?;
    let run_id = file.as_ref().map_or_else(
        || RunId::new(crate::shapefile::DEFAULT_RUN),
        ShapeFile::run_id,
    );
    let initial = file.as_ref().map(|f| f.to_shape(1)).transpose()?;
    if let Some(shape) = &initial {
        shape
            .validate()
            .map_err(|e| anyhow::anyhow!("the shape is invalid: {e}; nothing was started"))?;
    }
    let state = StateDir::create(opts.state_dir.clone())?;
    let _lock = state.lock()?;

    let endpoint = bind_daemon_endpoint(&state).await?;
    let ticket = EndpointTicket::new(endpoint.addr());
    let cli_id = state.cli_key()?.public();
    let secret = state.token_secret()?;

    let provider = ProcessProvider::new(ProcessConfig {
        agent_program: std::env::current_exe().context("cannot find the swactor executable")?,
        agent_args: vec!["agent".to_owned()],
        daemon_ticket: ticket.to_string(),
        token_secret: secret,
        ..ProcessConfig::new(state.root().to_path_buf())
    })
    .context("cannot start the process provider")?;

    let empty = ClusterSnapshot {
        run_id: run_id.to_string(),
        generation: Generation(0),
        observed_generation: None,
        converged: false,
        desired_nodes: 0,
        nodes: Vec::new(),
        stats: Default::default(),
        now: Default::default(),
    };
    let sink = NdjsonSink::open(state.root(), &NdjsonConfig::default())
        .await
        .context("cannot open telemetry.ndjson")?;
    let publisher: TelemetryPublisher<ClusterSnapshot, ClusterEvent> =
        TelemetryPublisher::new(TelemetryConfig::default(), &empty)
            .context("cannot start telemetry")?
            .with_ndjson(sink);
    let telemetry = publisher.handler();

    let mut config = ClusterConfig::new(run_id.clone());
    config.initial_shape = initial;
    let cluster = Cluster::start_with(config, Arc::new(provider), None, Some(publisher))
        .await
        .context("cannot start the cluster")?;

    let (down_tx, mut down_rx) = mpsc::channel::<DownRequest>(4);
    let router = GuardedRouterBuilder::new(endpoint.clone())
        .serve(
            ALPN_SWARM,
            Allowlist::open(),
            SwarmHandler {
                cluster: cluster.clone(),
                secret,
            },
        )
        .serve(
            ALPN_CONTROL,
            Allowlist::only([cli_id]),
            ControlHandler {
                cluster: cluster.clone(),
                run_id: run_id.clone(),
                down: down_tx,
            },
        )
        .serve(ALPN_TELEMETRY, Allowlist::only([cli_id]), telemetry)
        .spawn();
    state.write_ticket(&ticket)?;
    eprintln!(
        "swactor: daemon for run {run_id} on {} (state {})",
        endpoint.addr().id.fmt_short(),
        state.root().display()
    );

    let progress = Progress::start(&cluster).await?;
    let mut code = 0;
    let mut keep = opts.keep;
    let mut down_reply = None;
    if opts.until_converged {
        match tokio::time::timeout(opts.timeout, cluster.converged()).await {
            Ok(Ok(generation)) => {
                progress.flush().await;
                eprintln!(
                    "swactor: converged on generation {} in {:.1} s (daemon peak memory {})",
                    generation.0,
                    started.elapsed().as_secs_f64(),
                    peak_memory()
                );
            }
            Ok(Err(e)) => {
                eprintln!("swactor: the cluster stopped: {e}");
                code = 1;
            }
            Err(_) => {
                progress.flush().await;
                eprintln!(
                    "swactor: not converged within {:?}; still waiting on:",
                    opts.timeout
                );
                if let Ok(snap) = cluster.snapshot().await {
                    for n in snap.nodes.iter().filter(|n| !n.ready) {
                        let err = n.last_error.as_deref().unwrap_or("no error reported");
                        eprintln!("  {} ({}, {:?}): {err}", n.node, n.attempt, n.stage);
                    }
                }
                code = 1;
            }
        }
    } else {
        tokio::select! {
            _ = shutdown_signal() => eprintln!("\nswactor: stopping"),
            Some((k, reply)) = down_rx.recv() => {
                keep = k;
                down_reply = Some(reply);
            }
        }
    }
    let mode = if keep {
        ShutdownMode::Keep
    } else {
        ShutdownMode::Teardown
    };
    if mode == ShutdownMode::Teardown {
        eprintln!("swactor: tearing down");
    }
    let report = cluster.shutdown(mode).await.context("shutdown failed")?;
    progress.stop().await;
    print_report(&report);
    if let Some(reply) = down_reply {
        let _ = reply.send(report);
        // Let the control handler deliver the answer before the endpoint closes.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    state.remove_ticket();
    router.shutdown().await.ok();
    Ok(code)
}

/// The daemon's peak resident memory, from `/proc/self/status`.
fn peak_memory() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l[6..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn print_report(report: &ShutdownReport) {
    if !report.destroyed.is_empty() {
        let names: Vec<String> = report.destroyed.iter().map(ToString::to_string).collect();
        eprintln!(
            "swactor: destroyed {} node(s): {}",
            names.len(),
            names.join(", ")
        );
    }
    if !report.kept.is_empty() {
        let names: Vec<String> = report.kept.iter().map(ToString::to_string).collect();
        eprintln!(
            "swactor: kept {} node(s) running for the next `swactor up`: {}",
            names.len(),
            names.join(", ")
        );
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Binds loopback on the port used last time, so agents of a previous daemon
/// (which kept running) find this one again.
async fn bind_daemon_endpoint(state: &StateDir) -> Result<swactor_engine::iroh::Endpoint> {
    let key = state.daemon_key()?;
    let mut config = NetConfig {
        frame_len_max: FRAME_LEN_MAX,
        ..NetConfig::default()
    };
    if let Some(port) = state.saved_port() {
        config.bind_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        match bind_endpoint(&config, key.clone()).await {
            Ok(ep) => return Ok(ep),
            Err(e) => tracing::warn!(%e, port, "the previous port is taken; binding a new one"),
        }
        config.bind_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    }
    let ep = bind_endpoint(&config, key)
        .await
        .context("cannot bind the daemon's endpoint")?;
    if let Some(port) = ep.bound_sockets().first().map(SocketAddr::port) {
        state.save_port(port)?;
    }
    Ok(ep)
}

/// Applies a shape file, assigning the next generation when the file has none.
pub(crate) async fn apply_file(
    cluster: &ClusterHandle,
    run_id: &RunId,
    file: &ShapeFile,
) -> std::result::Result<(u64, bool), String> {
    if file.run_id() != *run_id {
        return Err(format!(
            "the shape is for run {:?}, but this daemon manages run {:?}; \
             a daemon's run never changes (start another daemon with its own --state-dir)",
            file.run_id().as_str(),
            run_id.as_str()
        ));
    }
    let current = cluster
        .snapshot()
        .await
        .map_err(|e| e.to_string())?
        .generation
        .0;
    let shape_at = |g| file.to_shape(g).map_err(|e| e.to_string());
    let try_apply = |shape: ClusterShape| async move { cluster.apply(shape).await };
    let first = if file.generation.is_some() {
        shape_at(0)?
    } else {
        shape_at(current.max(1))?
    };
    match try_apply(first).await {
        Ok(DesiredUpdate::Accepted(g)) => Ok((g.0, true)),
        Ok(DesiredUpdate::Unchanged(g)) => Ok((g.0, false)),
        Err(swactor_actors::ClusterError::Update(UpdateError::SameGenerationChanged {
            ..
        })) if file.generation.is_none() => match try_apply(shape_at(current + 1)?).await {
            Ok(DesiredUpdate::Accepted(g) | DesiredUpdate::Unchanged(g)) => Ok((g.0, true)),
            Err(e) => Err(e.to_string()),
        },
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Debug, Clone)]
struct ControlHandler {
    cluster: ClusterHandle,
    run_id: RunId,
    down: mpsc::Sender<DownRequest>,
}

impl ControlHandler {
    async fn answer(&self, req: ControlRequest) -> ControlResponse {
        match req {
            ControlRequest::Apply(file) => {
                match apply_file(&self.cluster, &self.run_id, &file).await {
                    Ok((generation, changed)) => ControlResponse::Applied {
                        generation,
                        changed,
                    },
                    Err(e) => ControlResponse::Error(e),
                }
            }
            ControlRequest::Plan(file) => {
                let shape = match file {
                    None => None,
                    Some(f) if f.run_id() != self.run_id => {
                        return ControlResponse::Error(format!(
                            "the shape is for run {:?}, but this daemon manages run {:?}",
                            f.run_id().as_str(),
                            self.run_id.as_str()
                        ));
                    }
                    Some(f) => {
                        let current = match self.cluster.snapshot().await {
                            Ok(s) => s.generation.0,
                            Err(e) => return ControlResponse::Error(e.to_string()),
                        };
                        match f.to_shape(current + 1) {
                            Ok(s) => Some(s),
                            Err(e) => return ControlResponse::Error(e.to_string()),
                        }
                    }
                };
                match self.cluster.plan(shape).await {
                    Ok(plan) => ControlResponse::Plan(plan),
                    Err(e) => ControlResponse::Error(e.to_string()),
                }
            }
            ControlRequest::Status => match self.cluster.snapshot().await {
                Ok(s) => ControlResponse::Status(s),
                Err(e) => ControlResponse::Error(e.to_string()),
            },
            ControlRequest::Down { keep } => {
                let (tx, rx) = oneshot::channel();
                if self.down.send((keep, tx)).await.is_err() {
                    return ControlResponse::Error("the daemon is already stopping".to_owned());
                }
                match rx.await {
                    Ok(r) => ControlResponse::Down {
                        destroyed: r.destroyed.iter().map(ToString::to_string).collect(),
                        kept: r.kept.iter().map(ToString::to_string).collect(),
                    },
                    Err(_) => {
                        ControlResponse::Error("the daemon stopped without a report".to_owned())
                    }
                }
            }
        }
    }
}

impl ProtocolHandler for ControlHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
            return Ok(());
        };
        let req: Option<String> = recv_frame(&mut recv, FRAME_LEN_MAX).await.unwrap_or(None);
        let resp = match req.as_deref().map(serde_json::from_str::<ControlRequest>) {
            Some(Ok(req)) => self.answer(req).await,
            Some(Err(e)) => ControlResponse::Error(format!("malformed request: {e}")),
            None => return Ok(()),
        };
        let text = serde_json::to_string(&resp).unwrap_or_else(|e| {
            serde_json::to_string(&ControlResponse::Error(e.to_string())).unwrap_or_default()
        });
        if send_frame(&mut send, &text, FRAME_LEN_MAX).await.is_ok() {
            let _ = send.finish();
            // Wait for the client to read the answer and close.
            let _ = tokio::time::timeout(Duration::from_secs(10), conn.closed()).await;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct SwarmHandler {
    cluster: ClusterHandle,
    secret: [u8; 32],
}

impl ProtocolHandler for SwarmHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
            return Ok(());
        };
        let Ok(Some(join)) = recv_frame::<JoinRequest, _>(&mut recv, FRAME_LEN_MAX).await else {
            return Ok(());
        };
        let verdict = if join.token != join_token(&self.secret, &join.key) {
            Err("the join token does not match this node's identity".to_owned())
        } else {
            match self.cluster.agent_join(join.key.clone()).await {
                Ok(v) => v,
                Err(e) => Err(e.to_string()),
            }
        };
        let reply = match &verdict {
            Ok(()) => JoinReply::Welcome,
            Err(reason) => JoinReply::Refused(reason.clone()),
        };
        if send_frame(&mut send, &reply, FRAME_LEN_MAX).await.is_err() || verdict.is_err() {
            if let Err(reason) = verdict {
                tracing::warn!(key = %join.key, %reason, "join refused");
            }
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
            return Ok(());
        }
        tracing::info!(key = %join.key, "agent joined");
        // The agent stays connected; its heartbeats end when it goes away.
        while let Ok(Some(Heartbeat(_))) =
            recv_frame::<Heartbeat, _>(&mut recv, FRAME_LEN_MAX).await
        {}
        tracing::info!(key = %join.key, "agent disconnected");
        self.cluster.agent_gone(join.key);
        Ok(())
    }
}
