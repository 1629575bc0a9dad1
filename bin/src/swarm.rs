//! The swarm protocol (`swactor/swarm/0`): agents join the daemon and stay connected.
//!
//! Anyone who knows the daemon's address may open this protocol, so nothing
//! is trusted before a join is checked: the first frame must arrive within
//! the engine's handshake deadline and fit its small first-frame limit, and
//! it is accepted only from the key derived for that very (run, node,
//! attempt), with its token. Refusals are logged once, then summarised.

use crate::protocol::{Heartbeat, JoinReply, JoinRequest};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use swactor_actors::ClusterHandle;
use swactor_engine::iroh::endpoint::Connection;
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{
    FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE, REFUSAL_LOG_INTERVAL, accept_first_frame,
    recv_frame, send_frame,
};

/// How often a connected agent's join is asserted again.
const JOIN_REASSERT: Duration = Duration::from_secs(3);

/// Largest heartbeat or reply frame (a heartbeat is a counter).
const SMALL_FRAME_LEN_MAX_BYTES: usize = 64;

#[derive(Debug, Clone)]
pub(crate) struct SwarmHandler {
    pub(crate) cluster: ClusterHandle,
    pub(crate) secret: [u8; 32],
    pub(crate) refusals: RefusalLog,
}

impl ProtocolHandler for SwarmHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // Closes the connection itself when the peer is slow, silent or too big.
        let Ok((mut send, mut recv, join)) =
            accept_first_frame::<JoinRequest>(&conn, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
        else {
            return Ok(());
        };
        // Only the key this attempt's agent was given may join for it, and
        // only with its token: a token read off another process is useless.
        let checked = join.verify(&self.secret, conn.remote_id());
        // (reason, whether the agent should ask again)
        let verdict = match &checked {
            Err(reason) => Err(((*reason).to_owned(), false)),
            Ok(key) => match self.cluster.agent_join(key.clone()).await {
                Ok(v) => v.map_err(|e| (e.to_string(), e.is_transient())),
                // The cluster actor is restarting from its journal, or the
                // daemon is going away: not a verdict on the attempt.
                Err(e) => Err((e.to_string(), true)),
            },
        };
        let reply = match &verdict {
            Ok(liveness) => JoinReply::Welcome {
                heartbeat_ms: liveness.heartbeat_ms,
            },
            Err((reason, true)) => JoinReply::NotYet(reason.clone()),
            Err((reason, false)) => JoinReply::Refused(reason.clone()),
        };
        let sent = send_frame(&mut send, &reply, SMALL_FRAME_LEN_MAX_BYTES).await;
        match &verdict {
            Err((reason, false)) => {
                // The key is the peer's own unchecked text: escaped, so it
                // cannot forge log lines.
                self.refusals
                    .refused(&join.key.text().escape_debug().to_string(), reason);
            }
            Err((reason, true)) => {
                tracing::debug!(key = %join.key.text().escape_debug(), %reason, "join deferred");
            }
            Ok(_) => {}
        }
        let (key, liveness) = match (sent, checked, verdict) {
            (Ok(()), Ok(key), Ok(liveness)) => (key, liveness),
            _ => {
                let _ = send.finish();
                let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
                return Ok(());
            }
        };
        // Silent this long, the agent is taken for gone; its grace is
        // counted from its last heartbeat.
        let silence = Duration::from_millis(liveness.silence_ms);
        tracing::info!(%key, "agent joined");
        // The agent stays connected and sends heartbeats. The join is asserted
        // again now and then: a cluster actor restarted from its journal
        // learns who is still connected, and an agent whose attempt was
        // replaced meanwhile is dropped.
        let mut asserted = Instant::now();
        let mut heard = Instant::now();
        loop {
            let next = recv_frame::<Heartbeat, _>(&mut recv, SMALL_FRAME_LEN_MAX_BYTES);
            match tokio::time::timeout(silence, next).await {
                Ok(Ok(Some(Heartbeat(_)))) => heard = Instant::now(),
                // Silent (stopped, hung, cut off), gone, or talking nonsense.
                _ => break,
            }
            if asserted.elapsed() < JOIN_REASSERT {
                continue;
            }
            asserted = Instant::now();
            if let Ok(Err(refusal)) = self.cluster.agent_join(key.clone()).await {
                tracing::info!(%key, %refusal, "dropping an agent no longer wanted");
                conn.close(1u32.into(), b"no longer wanted");
                return Ok(());
            }
        }
        tracing::info!(%key, silent_for = ?heard.elapsed(), "agent disconnected");
        conn.close(0u32.into(), b"silent");
        self.cluster.agent_gone(key, heard.elapsed());
        Ok(())
    }
}

/// Refused joins, logged once and then summarised at most every
/// [`REFUSAL_LOG_INTERVAL`], so a peer cannot fill the log.
#[derive(Debug, Clone, Default)]
pub(crate) struct RefusalLog(Arc<Mutex<RefusalCounts>>);

#[derive(Debug, Default)]
struct RefusalCounts {
    since_summary: u64,
    last_logged: Option<Instant>,
}

impl RefusalLog {
    fn refused(&self, who: &str, reason: &str) {
        let mut c = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match c.last_logged {
            Some(at) if at.elapsed() < REFUSAL_LOG_INTERVAL => c.since_summary += 1,
            _ => {
                if c.since_summary > 0 {
                    tracing::warn!(
                        refused = c.since_summary,
                        "refused {} more join(s) since the last report",
                        c.since_summary
                    );
                }
                tracing::warn!(%who, %reason, "join refused");
                c.since_summary = 0;
                c.last_logged = Some(Instant::now());
            }
        }
    }
}
