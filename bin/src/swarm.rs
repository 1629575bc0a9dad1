//! The swarm protocol (`swactor/swarm/0`): agents join the daemon and stay connected.

use crate::protocol::{FRAME_LEN_MAX, Heartbeat, JoinReply, JoinRequest};
use std::time::Duration;
use swactor_actors::ClusterHandle;
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{recv_frame, send_frame};
use swactor_providers::credentials::AgentCredentials;

/// How often a connected agent's join is asserted again.
const JOIN_REASSERT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone)]
pub(crate) struct SwarmHandler {
    pub(crate) cluster: ClusterHandle,
    pub(crate) secret: [u8; 32],
}

impl ProtocolHandler for SwarmHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
            return Ok(());
        };
        let Ok(Some(join)) = recv_frame::<JoinRequest, _>(&mut recv, FRAME_LEN_MAX).await else {
            return Ok(());
        };
        // Only the key this attempt's agent was given may join for it, and
        // only with its token: a token read off another process is useless.
        let expected = AgentCredentials::derive(&self.secret, &join.key);
        let verdict = if conn.remote_id() != expected.endpoint_id() {
            Err("this key may not join for that node".to_owned())
        } else if join.token != expected.token {
            Err("the join token does not match this node's identity".to_owned())
        } else {
            match self.cluster.agent_join(join.key.clone()).await {
                Ok(v) => v.map_err(|e| e.to_string()),
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
        // The join is asserted again now and then: a cluster actor restarted
        // from its journal learns who is still connected, and an agent whose
        // attempt was replaced meanwhile is dropped.
        let mut asserted = std::time::Instant::now();
        while let Ok(Some(Heartbeat(_))) =
            recv_frame::<Heartbeat, _>(&mut recv, FRAME_LEN_MAX).await
        {
            if asserted.elapsed() < JOIN_REASSERT {
                continue;
            }
            asserted = std::time::Instant::now();
            if let Ok(Err(refusal)) = self.cluster.agent_join(join.key.clone()).await {
                tracing::info!(key = %join.key, %refusal, "dropping an agent no longer wanted");
                conn.close(1u32.into(), b"no longer wanted");
                return Ok(());
            }
        }
        tracing::info!(key = %join.key, "agent disconnected");
        self.cluster.agent_gone(join.key);
        Ok(())
    }
}
