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
    /// Joined; keep the connection and send heartbeats.
    Welcome,
    /// Refused, with the reason.
    Refused(String),
}

/// A heartbeat from a joined agent.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Heartbeat(pub u64);
