//! The control protocol (`swactor/control/0`): what the CLI asks of a running daemon.

use crate::guard::CHANGES_SHOWN;
use crate::journal::JournalHealth;
use crate::protocol::{AgentLogPiece, ControlRequest, ControlResponse, FRAME_LEN_MAX, PlanReport};
use crate::shapefile::{ShapeFile, refusal};
use crate::words::{cut, cut_long_words};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use swactor_actors::{AgentLink, ClusterError, ClusterHandle, NodeSummary, ShutdownReport};
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{HANDSHAKE_DEADLINE, accept_first_frame, send_frame};
use swactor_providers::{Provider, Providers};
use swactor_provisioning::{
    ClusterShape, DesiredUpdate, Intent, LogicalNodeId, NodeAttemptId, ReplaceError, ResourceKey,
    RunId, every_change,
};
use tokio::sync::{mpsc, oneshot, watch};

/// Largest control request (a shape file, as JSON).
const REQUEST_LEN_MAX_BYTES: usize = 1 << 20;

/// A `down` request on its way to the daemon's main task: keep the nodes?
/// and where the report goes.
pub(crate) type DownRequest = (bool, bool, oneshot::Sender<DownReport>);

/// What a `down` did: the cluster's shutdown report, and with `purge`, each
/// remote host and why it could not be purged if it could not.
pub(crate) type DownReport = (ShutdownReport, Vec<(String, Option<String>)>);

/// [`refusal`], unless the cluster is gone because its journal could not be
/// written: then that is the reason, and the request was not recorded.
pub(crate) fn refusal_in(e: &ClusterError, journal: &JournalHealth) -> String {
    match (e, journal.failure()) {
        (ClusterError::NotRunning, Some(failure)) => format!(
            "the journal cannot be written ({}), so this was not recorded; the daemon stops \
             and leaves every node running for the next `swactor up` to adopt",
            cut_long_words(&failure)
        ),
        _ => refusal(e),
    }
}

/// The refusal of a shape for another run than the daemon's.
fn other_run(file: &ShapeFile, run_id: &RunId) -> Option<String> {
    (file.run_id() != *run_id).then(|| {
        format!(
            "the shape is for run {:?}, but this daemon manages run {:?}; a daemon's run \
             never changes (start another daemon with its own --state-dir); nothing was changed",
            cut(file.run_id().as_str()),
            cut(run_id.as_str())
        )
    })
}

/// Applies a shape file, assigning the next generation when the file has none.
pub(crate) async fn apply_file(
    cluster: &ClusterHandle,
    run_id: &RunId,
    journal: &JournalHealth,
    file: &ShapeFile,
) -> std::result::Result<(u64, bool), String> {
    if let Some(refused) = other_run(file, run_id) {
        return Err(refused);
    }
    let shape_at = |g| file.check(g).map_err(|e| format!("{e:#}"));
    // A file without a generation is offered as the next one: the cluster
    // picks it, so an apply from elsewhere cannot take it in between.
    let outcome = if file.generation.is_some() {
        cluster.apply(shape_at(0)?).await
    } else {
        cluster.apply_next(shape_at(1)?).await
    };
    match outcome {
        Ok(DesiredUpdate::Accepted(g)) => Ok((g.0, true)),
        Ok(DesiredUpdate::Unchanged(g)) => Ok((g.0, false)),
        Err(e) => Err(refusal_in(&e, journal)),
    }
}

/// Whether a node still has something to do: it is not ready, its agent is
/// away, or it is leaving.
fn under_way(n: &NodeSummary) -> bool {
    !n.ready || n.intent == Intent::Deleting || matches!(n.agent, AgentLink::Away { .. })
}

#[derive(Debug, Clone)]
pub(crate) struct ControlHandler {
    pub(crate) cluster: ClusterHandle,
    pub(crate) run_id: RunId,
    pub(crate) down: mpsc::Sender<DownRequest>,
    /// Becomes true once the shape `up` was given has been offered (or
    /// refused): until then a CLI `apply` or `plan` waits, so it is judged
    /// against that shape and can never be overtaken by it.
    pub(crate) started: watch::Receiver<bool>,
    /// Asked what each node's resource is, for statuses.
    pub(crate) provider: Arc<Providers>,
    /// The vast provider, whose rentals a status lists.
    pub(crate) vast: Option<swactor_providers::vast::VastProvider>,
    /// The jobs.
    pub(crate) jobs: crate::jobs::service::JobService,
    /// Whether the journal's writes are failing (a refusal then says so).
    pub(crate) journal: JournalHealth,
    /// Where the time taken to answer each request is counted.
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    /// The kinds of the providers the embedding program brought: a shape
    /// sent by the CLI may name them too.
    pub(crate) more_providers: Vec<&'static str>,
    /// When each node's lease was last renewed.
    pub(crate) renewals: crate::renewals::Renewals,
    /// Who leads the run and who stands by (`swactor up --etcd`).
    pub(crate) ha: crate::replicas::HaView,
}

impl ControlHandler {
    /// A refusal from the cluster in words, the journal's failure first.
    pub(crate) fn refused(&self, e: &ClusterError) -> String {
        refusal_in(e, &self.journal)
    }

    /// Answers one request: the CLI's control protocol and the daemon's web
    /// page both come here, so both get the same validation and rules.
    pub(crate) async fn answer(&self, req: ControlRequest) -> ControlResponse {
        if matches!(req, ControlRequest::Apply(_) | ControlRequest::Plan { .. })
            && self.started.clone().wait_for(|s| *s).await.is_err()
        {
            return ControlResponse::Error(
                "the daemon stopped before it finished starting".to_owned(),
            );
        }
        let result = match req {
            ControlRequest::Apply(mut file) => {
                file.allow_providers(&self.more_providers);
                // A run with standbys takes no nodes only this machine sees.
                let local = self
                    .ha
                    .get()
                    .and_then(|_| crate::daemon::ha::local_group(&file));
                match local {
                    Some(why) => Err(format!("{why}; nothing was changed")),
                    None => {
                        match apply_file(&self.cluster, &self.run_id, &self.journal, &file).await {
                            Ok((generation, changed)) => {
                                // Said so the caller knows nothing will happen yet.
                                let paused = self.cluster.glance().await.is_ok_and(|g| g.paused);
                                Ok(ControlResponse::Applied {
                                    generation,
                                    changed,
                                    paused,
                                })
                            }
                            Err(e) => Err(e),
                        }
                    }
                }
            }
            ControlRequest::Pause => self
                .cluster
                .pause()
                .await
                .map(|changed| ControlResponse::Paused {
                    paused: true,
                    changed,
                })
                .map_err(|e| self.refused(&e)),
            ControlRequest::Resume => self
                .cluster
                .resume()
                .await
                .map(|changed| ControlResponse::Paused {
                    paused: false,
                    changed,
                })
                .map_err(|e| self.refused(&e)),
            ControlRequest::Plan { mut shape, all } => {
                if let Some(f) = &mut shape {
                    f.allow_providers(&self.more_providers);
                }
                self.plan(shape, all).await
            }
            ControlRequest::Status => self
                .cluster
                .snapshot()
                .await
                .map(|mut snap| {
                    for n in &mut snap.nodes {
                        n.resource = n
                            .lease
                            .as_ref()
                            .and_then(|l| self.provider.describe_lease(l));
                    }
                    self.renewals.fill(&mut snap.nodes);
                    snap.rentals = self.rentals_of(&snap);
                    snap.foreign = self.provider.foreign();
                    snap.spend = self.spend(snap.spend);
                    // Who leads and who stands by, as the election last
                    // said (`None` for a daemon alone on its journal).
                    snap.ha = self.ha.get();
                    ControlResponse::Status(snap)
                })
                .map_err(|e| self.refused(&e)),
            ControlRequest::Describe(node) => self.describe(&node).await,
            ControlRequest::Replace(node) => self.replace(&node).await,
            ControlRequest::Down { keep, purge } => self.down(keep, purge).await,
            ControlRequest::Jobs => Ok(ControlResponse::Jobs(self.jobs.list())),
            ControlRequest::JobLogs { id, node } => self
                .jobs
                .logs(&id, node.as_deref())
                .await
                .map(ControlResponse::JobLogs),
            ControlRequest::JobCancel(id) => self
                .jobs
                .cancel(&id)
                .await
                .map(|(job, nodes)| ControlResponse::JobCancelled { job, nodes }),
            ControlRequest::Run(_) => Err("a job is run on a stream of its own".to_owned()),
            ControlRequest::AgentLog { .. } => {
                Err("an agent log is sent on a stream of its own".to_owned())
            }
            ControlRequest::Shell { .. } | ControlRequest::Connect { .. } => {
                Err("a remote shell or connection runs on a stream of its own".to_owned())
            }
        };
        result.unwrap_or_else(ControlResponse::Error)
    }

    /// The run's spend as `status` and `/metrics` show it: what the vast
    /// provider counts now, never less than the journal holds (`journaled`;
    /// the provider's own records may have been lost); `None` without a
    /// provider that rents by the hour.
    pub(crate) fn spend(
        &self,
        journaled: Option<swactor_provisioning::budget::Spend>,
    ) -> Option<swactor_provisioning::budget::Spend> {
        self.vast.as_ref().map(|v| {
            let mut spend = v.spend(&self.run_id);
            let journaled = journaled.map_or(0, |s| s.spent_micros);
            spend.spent_micros = spend.spent_micros.max(journaled);
            spend
        })
    }

    /// The rented machines of the snapshot's current attempts.
    fn rentals_of(&self, snap: &swactor_actors::ClusterSnapshot) -> Vec<swactor_actors::Rental> {
        let Some(vast) = &self.vast else {
            return Vec::new();
        };
        let instances = vast.instances(&self.run_id);
        let keys: BTreeSet<(LogicalNodeId, NodeAttemptId)> = instances
            .iter()
            .map(|(key, _)| (key.node, key.attempt))
            .collect();
        let current: BTreeSet<(LogicalNodeId, NodeAttemptId)> = snap
            .nodes
            .iter()
            .map(|n| (n.node, n.attempt))
            .filter(|k| keys.contains(k))
            .collect();
        Self::rentals(instances, |node, attempt| {
            current.contains(&(*node, attempt))
        })
    }

    /// The rented machines of the current attempts, asking the cluster
    /// only about the rented slots (`/metrics` holds no snapshot): as much
    /// work as there are rentals, however many nodes there are.
    pub(crate) async fn rentals_now(&self) -> Vec<swactor_actors::Rental> {
        let Some(vast) = &self.vast else {
            return Vec::new();
        };
        let instances = vast.instances(&self.run_id);
        if instances.is_empty() {
            return Vec::new();
        }
        let nodes: Vec<LogicalNodeId> = instances.iter().map(|(key, _)| key.node).collect();
        let Ok(attempts) = self.cluster.attempts(nodes.clone()).await else {
            return Vec::new();
        };
        let current: BTreeSet<(LogicalNodeId, NodeAttemptId)> = nodes
            .into_iter()
            .zip(attempts)
            .filter_map(|(node, a)| Some((node, a?)))
            .collect();
        Self::rentals(instances, |node, attempt| {
            current.contains(&(*node, attempt))
        })
    }

    /// `instances` whose attempt is current, as rentals.
    fn rentals(
        instances: Vec<(ResourceKey, swactor_providers::vast::InstanceInfo)>,
        current: impl Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Vec<swactor_actors::Rental> {
        instances
            .into_iter()
            .filter(|(key, _)| current(&key.node, key.attempt))
            .map(|(key, i)| swactor_actors::Rental {
                node: key.node,
                attempt: key.attempt,
                provider: "vast".to_owned(),
                instance: i.instance.to_string(),
                offer: if i.offer == 0 {
                    String::new()
                } else {
                    i.offer.to_string()
                },
                machine: i.machine.to_string(),
                usd_per_hour_micros: swactor_provisioning::budget::usd_micros(i.dph),
                status: i.status,
            })
            .collect()
    }

    async fn plan(&self, file: Option<ShapeFile>, all: bool) -> Result<ControlResponse, String> {
        let snapshot = self
            .cluster
            .snapshot()
            .await
            .map_err(|e| self.refused(&e))?;
        let (shape, generation) = match &file {
            None => (None, None),
            Some(f) => {
                if let Some(refused) = other_run(f, &self.run_id) {
                    return Err(refused);
                }
                let shape = f
                    .check(snapshot.generation.0 + 1)
                    .map_err(|e| format!("{e:#}"))?;
                let generation = shape.generation.0;
                (Some(shape), Some(generation))
            }
        };
        let next = shape.as_ref().map(ClusterShape::validate);
        let view = self
            .cluster
            .plan(shape)
            .await
            .map_err(|e| self.refused(&e))?;
        let mut diff = view.diff;
        let total = crate::guard::changed(&diff);
        let placement_only = match (&next, total) {
            (Some(Ok(next)), 0) => {
                let on_record = self.cluster.desired().await.map_err(|e| self.refused(&e))?;
                !on_record.desired.same_content(next)
            }
            _ => false,
        };
        let shown = if all { usize::MAX } else { CHANGES_SHOWN };
        let mut changes = crate::guard::examples(&diff, shown);
        if all && total > changes.len() as u64 {
            let inspected = self.cluster.inspect().await.map_err(|e| self.refused(&e))?;
            let every = match next {
                Some(Ok(next)) => every_change(&inspected.state, &next),
                _ => every_change(&inspected.state, &inspected.desired),
            };
            // The core's counts are the truth; the full listing is used
            // only when it agrees with them.
            if every.len() as u64 == total {
                changes = every;
            }
        }
        diff.examples.clear();
        let busy: Vec<&NodeSummary> = snapshot.nodes.iter().filter(|n| under_way(n)).collect();
        Ok(ControlResponse::Plan(PlanReport {
            generation,
            current: snapshot.generation.0,
            diff,
            changes,
            under_way_total: busy.len() as u64,
            under_way: busy.into_iter().take(shown).cloned().collect(),
            orphans: snapshot.orphans,
            converged: snapshot.converged,
            now: snapshot.now,
            placement_only,
        }))
    }

    async fn describe(&self, node: &str) -> Result<ControlResponse, String> {
        let id = LogicalNodeId::parse(node).ok_or_else(|| not_a_node_id(node))?;
        match self
            .cluster
            .describe(id)
            .await
            .map_err(|e| self.refused(&e))?
        {
            Some(mut d) => {
                self.renewals.fill(d.summary.as_mut());
                // The lease, with what the provider says of it.
                if let Some(l) = d.lease.take() {
                    let lease = swactor_provisioning::LeaseId::from(l);
                    d.lease = Some(match self.provider.describe_lease(&lease) {
                        Some(what) => format!("{} ({what})", lease.0),
                        None => lease.0.to_string(),
                    });
                }
                Ok(ControlResponse::Described(d))
            }
            None => Err(format!(
                "run {} has no node {}: it never had one, or it was removed long ago \
                 (`swactor status` lists the nodes)",
                self.run_id,
                cut(node)
            )),
        }
    }

    async fn replace(&self, node: &str) -> Result<ControlResponse, String> {
        let id = LogicalNodeId::parse(node).ok_or_else(|| not_a_node_id(node))?;
        match self.cluster.replace(id).await {
            Ok(attempt) => Ok(ControlResponse::Replaced {
                node: id.to_string(),
                attempt: attempt.0,
            }),
            Err(ClusterError::Replace(ReplaceError::UnknownNode(_))) => Err(format!(
                "run {} has no node {}; nothing was changed (`swactor status` lists the nodes)",
                self.run_id,
                cut(node)
            )),
            Err(e @ ClusterError::NotRunning) => Err(self.refused(&e)),
            Err(e) => Err(format!("{}; nothing was changed", refusal(&e))),
        }
    }

    async fn down(&self, keep: bool, purge: bool) -> Result<ControlResponse, String> {
        let (tx, rx) = oneshot::channel();
        if self.down.send((keep, purge, tx)).await.is_err() {
            return Err("the daemon is already stopping".to_owned());
        }
        match rx.await {
            Ok((r, purged)) => Ok(ControlResponse::Down {
                destroyed: r.destroyed.iter().map(ToString::to_string).collect(),
                kept: r.kept.iter().map(ToString::to_string).collect(),
                without_machine: r.without_machine.iter().map(ToString::to_string).collect(),
                purged,
            }),
            Err(_) => Err("the daemon stopped without a report".to_owned()),
        }
    }
}

/// The refusal of a node id that is not one.
pub fn not_a_node_id(node: &str) -> String {
    format!(
        "{:?} is not a node id; nodes are named GROUP-INDEX, e.g. worker-0",
        cut(node)
    )
}

/// How long the daemon waits for the CLI to read an answer and close, at
/// least; a large answer gets [`CLOSE_WAIT_PER_MIB`] more per MiB.
const CLOSE_WAIT_MIN: Duration = Duration::from_secs(10);
/// The extra wait per MiB of an answer (a status of 100,000 nodes is some
/// 20 MiB, and a debug build of the CLI reads it at a few MiB/s).
const CLOSE_WAIT_PER_MIB: Duration = Duration::from_secs(1);

impl ControlHandler {
    /// Accepts a job and streams its events to the CLI until it ends (or
    /// the CLI goes; the job goes on without it).
    async fn stream_job(
        &self,
        spec: crate::jobs::service::JobSpec,
        mut send: swactor_engine::iroh::endpoint::SendStream,
        conn: &Connection,
    ) {
        use crate::jobs::service::JobEvent;
        let frame = |resp: &ControlResponse| serde_json::to_string(resp).unwrap_or_default();
        let (mut events, accepted) = match self.jobs.submit(spec).await {
            Ok((_, events, accepted)) => (events, accepted),
            Err(e) => {
                let _ =
                    send_frame(&mut send, &frame(&ControlResponse::Error(e)), FRAME_LEN_MAX).await;
                let _ = send.finish();
                let _ = tokio::time::timeout(CLOSE_WAIT_MIN, conn.closed()).await;
                return;
            }
        };
        let mut next = Some(accepted);
        loop {
            let Some(event) = next.take() else {
                match events.recv().await {
                    Ok(e) => next = Some(e),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(skipped = n, "a job's follower fell behind");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
                continue;
            };
            let done = matches!(event, JobEvent::Done(_));
            if send_frame(
                &mut send,
                &frame(&ControlResponse::Job(event)),
                FRAME_LEN_MAX,
            )
            .await
            .is_err()
            {
                return;
            }
            if done {
                break;
            }
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(CLOSE_WAIT_MIN, conn.closed()).await;
    }
}

/// Most bytes of log text sent in one frame: what is already read is
/// gathered up to this, so a long log goes in few frames.
const LOG_FRAME_TEXT_MAX: usize = 256 * 1024;

impl ControlHandler {
    /// Where the log `swactor logs` asks for is: the provider's stream of
    /// it, or where the CLI reads it itself.
    async fn agent_log(
        &self,
        node: &str,
        attempt: Option<u64>,
        run: Option<&str>,
        follow: bool,
    ) -> Result<(AgentLogPiece, Option<swactor_providers::AgentLogStream>), String> {
        let in_state_dir = |why: String| Ok((AgentLogPiece::InStateDir { why: Some(why) }, None));
        if let Some(run) = run.filter(|r| *r != self.run_id.as_str()) {
            return in_state_dir(format!(
                "the daemon runs run {}, not {}",
                self.run_id,
                cut(run)
            ));
        }
        let id = LogicalNodeId::parse(node).ok_or_else(|| not_a_node_id(node))?;
        let described = self
            .cluster
            .describe(id)
            .await
            .map_err(|e| self.refused(&e))?;
        let Some(d) = described else {
            return in_state_dir(format!("run {} has no node {id} now", self.run_id));
        };
        let Some(current) = d.summary else {
            return in_state_dir(format!("{id} has no attempt now"));
        };
        if let Some(a) = attempt.filter(|a| *a != current.attempt.0) {
            return in_state_dir(format!(
                "a{a} is not {id}'s current attempt ({}): a docker, ssh or vast node's log \
                 goes with its machine, and only the current attempt's machine is asked",
                current.attempt
            ));
        }
        let Some(lease) = current.lease.clone() else {
            return in_state_dir(format!(
                "{id}'s attempt {} has no machine now (it is {})",
                current.attempt,
                crate::words::state_word(&current)
            ));
        };
        let key = swactor_provisioning::ResourceKey {
            run_id: self.run_id.clone(),
            node: id,
            attempt: current.attempt,
        };
        let kind = self.provider.kind_of_lease(&lease).unwrap_or("unknown");
        match self.provider.agent_log(&key, &lease, follow).await {
            Ok(swactor_providers::AgentLogSource::StateDir) => {
                Ok((AgentLogPiece::InStateDir { why: None }, None))
            }
            Ok(swactor_providers::AgentLogSource::Remote(stream)) => {
                let shown = match self.provider.describe_lease(&lease) {
                    Some(what) => format!("{} ({what})", lease.0),
                    None => lease.0.to_string(),
                };
                let start = AgentLogPiece::Start {
                    attempt: current.attempt.0,
                    kind: kind.to_owned(),
                    lease: shown,
                };
                Ok((start, Some(stream)))
            }
            Err(e) => Err(format!(
                "cannot read the agent log of {id} attempt {} (a {kind} node, lease {}): {e}",
                current.attempt, lease.0
            )),
        }
    }

    /// Sends the agent log `swactor logs` asked for, piece by piece, until
    /// it ends or the CLI goes.
    async fn stream_agent_log(
        &self,
        request: (String, Option<u64>, Option<String>, bool),
        mut send: swactor_engine::iroh::endpoint::SendStream,
        conn: &Connection,
    ) {
        let (node, attempt, run, follow) = request;
        let frame = |piece: AgentLogPiece| {
            serde_json::to_string(&ControlResponse::AgentLog(piece)).unwrap_or_default()
        };
        let (first, stream) = match self.agent_log(&node, attempt, run.as_deref(), follow).await {
            Ok(found) => found,
            Err(e) => {
                let text = serde_json::to_string(&ControlResponse::Error(e)).unwrap_or_default();
                let _ = send_frame(&mut send, &text, FRAME_LEN_MAX).await;
                let _ = send.finish();
                let _ = tokio::time::timeout(CLOSE_WAIT_MIN, conn.closed()).await;
                return;
            }
        };
        if send_frame(&mut send, &frame(first), FRAME_LEN_MAX)
            .await
            .is_err()
        {
            return;
        }
        if let Some(mut stream) = stream {
            let mut held = None;
            loop {
                let piece = match held.take() {
                    Some(piece) => Some(piece),
                    None => tokio::select! {
                        piece = stream.recv() => piece,
                        // The CLI went (Ctrl-C on `--follow`): stop reading.
                        _ = conn.closed() => return,
                    },
                };
                let piece = match piece {
                    None => break,
                    Some(Err(e)) => AgentLogPiece::Broken(e),
                    Some(Ok(mut text)) => {
                        // What has already been read goes along in the same frame.
                        while text.len() < LOG_FRAME_TEXT_MAX {
                            match stream.try_recv() {
                                Ok(Ok(more)) => text.push_str(&more),
                                Ok(Err(e)) => {
                                    held = Some(Err(e));
                                    break;
                                }
                                Err(_) => break,
                            }
                        }
                        AgentLogPiece::Text(text)
                    }
                };
                let last = matches!(piece, AgentLogPiece::Broken(_));
                if send_frame(&mut send, &frame(piece), FRAME_LEN_MAX)
                    .await
                    .is_err()
                {
                    return;
                }
                if last {
                    break;
                }
            }
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(CLOSE_WAIT_MIN, conn.closed()).await;
    }
}

impl ControlHandler {
    /// Opens a shell or a connection on a node and relays it (see
    /// [`crate::jobs::remote`]) until it ends or the CLI goes.
    async fn remote(
        &self,
        open: crate::jobs::remote::Open,
        send: swactor_engine::iroh::endpoint::SendStream,
        recv: swactor_engine::iroh::endpoint::RecvStream,
        conn: &Connection,
    ) {
        let (links, clock) = self.jobs.links();
        let cx = crate::jobs::remote::RelayContext {
            cluster: &self.cluster,
            links,
            clock,
            run_id: &self.run_id,
        };
        crate::jobs::remote::relay(cx, open, send, recv, conn).await;
    }
}

impl ProtocolHandler for ControlHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // Closes the connection itself when the request is late or too big.
        let Ok((mut send, recv, req)) =
            accept_first_frame::<String>(&conn, REQUEST_LEN_MAX_BYTES, HANDSHAKE_DEADLINE).await
        else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let mut kind = "malformed";
        let resp = match serde_json::from_str::<ControlRequest>(&req) {
            Ok(ControlRequest::Run(spec)) => {
                self.stream_job(spec, send, &conn).await;
                return Ok(());
            }
            Ok(ControlRequest::AgentLog {
                node,
                attempt,
                run,
                follow,
            }) => {
                self.stream_agent_log((node, attempt, run, follow), send, &conn)
                    .await;
                return Ok(());
            }
            Ok(ControlRequest::Shell {
                node,
                argv,
                pty,
                env,
            }) => {
                let request = crate::jobs::remote::ShellRequest { argv, pty, env };
                let open = crate::jobs::remote::Open::Shell { node, request };
                self.remote(open, send, recv, &conn).await;
                return Ok(());
            }
            Ok(ControlRequest::Connect { node, port, probe }) => {
                let open = crate::jobs::remote::Open::Connect { node, port, probe };
                self.remote(open, send, recv, &conn).await;
                return Ok(());
            }
            Ok(req) => {
                kind = req.kind();
                self.answer(req).await
            }
            Err(e) => ControlResponse::Error(cut_long_words(&format!("malformed request: {e}"))),
        };
        let error =
            |e: String| serde_json::to_string(&ControlResponse::Error(e)).unwrap_or_default();
        let mut text = serde_json::to_string(&resp).unwrap_or_else(|e| error(e.to_string()));
        if text.len() > FRAME_LEN_MAX {
            text = error(format!(
                "the answer is {} MiB, more than the control protocol carries ({} MiB); \
                 `swactor watch` and `telemetry.ndjson` in the state directory show the \
                 same cluster",
                text.len() >> 20,
                FRAME_LEN_MAX >> 20
            ));
        }
        let sent = send_frame(&mut send, &text, FRAME_LEN_MAX).await;
        self.metrics.control_answered(kind, started.elapsed());
        if sent.is_ok() {
            let _ = send.finish();
            // Wait for the client to read the answer and close: closing first
            // would cut off what it has not read yet.
            let mib = u32::try_from(text.len() >> 20).unwrap_or(u32::MAX);
            let wait = CLOSE_WAIT_MIN.saturating_add(CLOSE_WAIT_PER_MIB.saturating_mul(mib));
            let _ = tokio::time::timeout(wait, conn.closed()).await;
        }
        Ok(())
    }
}
