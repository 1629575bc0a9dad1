//! The control protocol (`swactor/control/0`): what the CLI asks of a running daemon.

use crate::protocol::{ControlRequest, ControlResponse, FRAME_LEN_MAX};
use crate::shapefile::ShapeFile;
use std::time::Duration;
use swactor_actors::{ApplyError, ClusterHandle, PlanView, ShutdownReport};
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{HANDSHAKE_DEADLINE, accept_first_frame, send_frame};
use swactor_provisioning::{ClusterShape, DesiredUpdate, RunId, UpdateError};
use tokio::sync::{mpsc, oneshot};

/// Largest control request (a shape file, as JSON).
const REQUEST_LEN_MAX_BYTES: usize = 1 << 20;

/// A `down` request on its way to the daemon's main task: keep the nodes?
/// and where the report goes.
pub(crate) type DownRequest = (bool, oneshot::Sender<ShutdownReport>);

/// One line counting what a plan does.
pub(crate) fn plan_summary(plan: &PlanView) -> String {
    let count =
        |pred: &dyn Fn(&str) -> bool| plan.actions.iter().filter(|l| pred(&l.action)).count();
    let create = count(&|a| a == "create slot");
    let replace = count(&|a| a.contains("SpecDrift") || a.contains("Failed"));
    let delete = count(&|a| a.contains("Undesired"));
    if plan.actions.is_empty() {
        "plan: no changes".to_owned()
    } else {
        format!(
            "plan: {create} to create, {replace} to replace, {delete} to delete ({} action(s) in the next pass)",
            plan.actions.len()
        )
    }
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
        Err(swactor_actors::ClusterError::Apply(ApplyError::Update(
            UpdateError::SameGenerationChanged { .. },
        ))) if file.generation.is_none() => match try_apply(shape_at(current + 1)?).await {
            Ok(DesiredUpdate::Accepted(g) | DesiredUpdate::Unchanged(g)) => Ok((g.0, true)),
            Err(e) => Err(e.to_string()),
        },
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ControlHandler {
    pub(crate) cluster: ClusterHandle,
    pub(crate) run_id: RunId,
    pub(crate) down: mpsc::Sender<DownRequest>,
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
        // Closes the connection itself when the request is late or too big.
        let Ok((mut send, _recv, req)) =
            accept_first_frame::<String>(&conn, REQUEST_LEN_MAX_BYTES, HANDSHAKE_DEADLINE).await
        else {
            return Ok(());
        };
        let resp = match serde_json::from_str::<ControlRequest>(&req) {
            Ok(req) => self.answer(req).await,
            Err(e) => ControlResponse::Error(format!("malformed request: {e}")),
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
