//! Messages of the control and swarm protocols.
//!
//! Control messages travel as JSON text inside the engine's length-delimited
//! frames (shapes carry free-form parameters that need a self-describing
//! encoding); swarm messages are plain postcard frames.

use serde::{Deserialize, Serialize};
use swactor_provisioning::ResourceKey;

/// Largest frame either side accepts: a status of 100,000 nodes fits.
pub(crate) const FRAME_LEN_MAX: usize = 64 * 1024 * 1024;

/// A request from the CLI to the daemon.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum ControlRequest {
    /// Apply a shape file (generation optional).
    Apply(crate::shapefile::ShapeFile),
    /// Preview a shape file, or the current shape.
    Plan(Option<crate::shapefile::ShapeFile>),
    /// The cluster's state.
    Status,
    /// Stop the daemon: tear down (or keep) every node.
    Down {
        /// Leave the nodes running for the next daemon to adopt.
        keep: bool,
    },
}

/// The daemon's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum ControlResponse {
    /// The shape was accepted (`changed` is false for an identical resubmission).
    Applied {
        /// The generation now desired.
        generation: u64,
        /// Whether anything changed.
        changed: bool,
    },
    /// The next pass's actions.
    Plan(swactor_actors::PlanView),
    /// The cluster now.
    Status(swactor_actors::ClusterSnapshot),
    /// The daemon stopped.
    Down {
        /// Nodes torn down.
        destroyed: Vec<String>,
        /// Nodes left running.
        kept: Vec<String>,
    },
    /// The request was refused; nothing changed.
    Error(String),
}

/// An agent asking to join the swarm.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct JoinRequest {
    /// The (run, node, attempt) the agent was started for.
    pub(crate) key: ResourceKey,
    /// The token the daemon derived for that key.
    pub(crate) token: String,
}

/// The daemon's answer to a join.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum JoinReply {
    /// Joined; keep the connection and send a heartbeat every `heartbeat_ms`.
    Welcome {
        /// The interval the daemon expects heartbeats at.
        heartbeat_ms: u64,
    },
    /// Refused, with the reason.
    Refused(String),
}

/// A heartbeat from a joined agent.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Heartbeat(pub u64);

#[cfg(test)]
mod tests {
    //! Every message of the three protocols, decoded from hostile bytes: the
    //! decoder never panics, never takes more memory than it was sent (plus
    //! one read chunk), and reads back what was encoded.

    use super::*;
    use proptest::prelude::*;
    use swactor_actors::{ClusterEvent, ClusterSnapshot};
    use swactor_engine::net::{FIRST_FRAME_LEN_MAX_BYTES, encode_frame, recv_frame};
    use swactor_engine::telemetry::TelemetryFrame;

    /// Decodes `bytes` as one frame of `T` under `limit`; Ok(None) for a clean end.
    fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], limit: usize) -> bool {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut reader = bytes;
        runtime
            .block_on(recv_frame::<T, _>(&mut reader, limit))
            .is_ok()
    }

    fn framed(payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(payload);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn hostile_bytes_never_panic_any_decoder(raw in proptest::collection::vec(any::<u8>(), 0..512), frame in any::<bool>()) {
            let bytes = if frame { framed(&raw) } else { raw };
            // Swarm: the join (first frame), the reply, heartbeats.
            let _ = decode::<JoinRequest>(&bytes, FIRST_FRAME_LEN_MAX_BYTES);
            let _ = decode::<JoinReply>(&bytes, 64);
            let _ = decode::<Heartbeat>(&bytes, 64);
            // Control: a JSON request inside a frame, and the answer.
            let _ = decode::<String>(&bytes, 1 << 20);
            if let Ok(text) = std::str::from_utf8(&bytes) {
                let _ = serde_json::from_str::<ControlRequest>(text);
                let _ = serde_json::from_str::<ControlResponse>(text);
            }
            // Telemetry: snapshot and event frames.
            let _ = decode::<TelemetryFrame<ClusterSnapshot, ClusterEvent>>(&bytes, 1 << 20);
        }

        #[test]
        fn a_join_round_trips_and_any_truncation_is_refused(token in "[0-9a-f]{0,64}", attempt in any::<u64>(), cut in 0usize..200) {
            let join = JoinRequest {
                key: swactor_provisioning::ResourceKey {
                    run_id: swactor_provisioning::RunId::new("r"),
                    node: swactor_provisioning::LogicalNodeId::parse("w-0").unwrap(),
                    attempt: swactor_provisioning::NodeAttemptId(attempt),
                },
                token,
            };
            let bytes = encode_frame(&join, FIRST_FRAME_LEN_MAX_BYTES).unwrap();
            prop_assert!(decode::<JoinRequest>(&bytes, FIRST_FRAME_LEN_MAX_BYTES));
            let cut = cut.min(bytes.len());
            if cut > 0 && cut < bytes.len() {
                prop_assert!(!decode::<JoinRequest>(&bytes[..cut], FIRST_FRAME_LEN_MAX_BYTES));
            }
        }
    }
}
