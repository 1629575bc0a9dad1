//! Messages of the control and swarm protocols.
//!
//! Control messages travel as JSON text inside the engine's length-delimited
//! frames (shapes carry free-form parameters that need a self-describing
//! encoding); swarm messages are plain postcard frames.

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use swactor_actors::{ClusterSnapshot, NodeSummary};
use swactor_provisioning::{Change, LogicalNodeId, ResourceKey, ShapeDiff, Timestamp};

/// Largest frame either side accepts, and the daemon's largest telemetry
/// frame: the status of 100,000 nodes, each with a 200-character error, is
/// some 40 MiB as JSON and fits (see the test
/// `a_status_of_a_hundred_thousand_nodes_fits_a_frame`). A larger answer is
/// refused by the daemon with a message saying so.
pub const FRAME_LEN_MAX: usize = 64 * 1024 * 1024;

/// A request from the CLI to the daemon.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Apply a shape file (generation optional).
    Apply(crate::shapefile::ShapeFile),
    /// What a shape file would change, or what the current shape still has to do.
    Plan {
        /// The shape; `None` for the current one.
        shape: Option<crate::shapefile::ShapeFile>,
        /// List every changed node, not only the first ones.
        all: bool,
    },
    /// The cluster's state.
    Status,
    /// One node in depth, by its id (e.g. `worker-1`).
    Describe(String),
    /// Pause reconciling: fold and show state, dispatch nothing new.
    Pause,
    /// Resume reconciling.
    Resume,
    /// Replace one node, by its id: its current attempt is failed and
    /// cleaned up, then a new one starts.
    Replace(String),
    /// Stop the daemon: tear down (or keep) every node.
    Down {
        /// Leave the nodes running for the next daemon to adopt.
        keep: bool,
        /// After the teardown, remove what remote hosts cache (the agent binary).
        #[serde(default)]
        purge: bool,
    },
    /// Run a job; the answer is a stream of [`ControlResponse::Job`] events
    /// ending with its `Done` (or one `Error`).
    Run(swactor_jobs::record::JobSpec),
    /// Every job.
    Jobs,
    /// A job's recorded output, of one node or all.
    JobLogs {
        /// The job's id.
        id: String,
        /// Only this node's.
        node: Option<String>,
    },
    /// Cancel a job on every node it still runs on.
    JobCancel(String),
    /// A node's agent log; the answer is a stream of
    /// [`ControlResponse::AgentLog`] pieces (or one `Error`).
    AgentLog {
        /// The node, e.g. `worker-0`.
        node: String,
        /// One attempt (its number) instead of the current one.
        attempt: Option<u64>,
        /// The run the CLI asks about, when it names one.
        run: Option<String>,
        /// Go on sending what the agent writes until its attempt ends.
        follow: bool,
    },
    /// A shell or one command on a node (`swactor ssh`). The answer is
    /// [`ControlResponse::Remote`] (or one `Error`); then the stream
    /// carries `swactor_jobs::wire::ShellFrame`s both ways.
    Shell {
        /// The node, e.g. `worker-0`.
        node: String,
        /// The command and its arguments; `None` for a login shell.
        argv: Option<Vec<String>>,
        /// A pseudo-terminal of (rows, columns); `None` for pipes.
        pty: Option<(u16, u16)>,
        /// Extra environment variables (`TERM` for a terminal).
        env: Vec<(String, String)>,
    },
    /// One TCP connection to `127.0.0.1:port` on a node (`swactor
    /// forward`). The answer is [`ControlResponse::Remote`] (or one
    /// `Error`); then the stream carries the connection's bytes both ways.
    Connect {
        /// The node, e.g. `worker-0`.
        node: String,
        /// The port on the node's loopback.
        port: u16,
        /// Only check that the node can be reached this way; connect nothing.
        probe: bool,
    },
}

impl ControlRequest {
    /// Its kind, for metrics and logs (no argument of it).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Apply(_) => "apply",
            Self::Plan { .. } => "plan",
            Self::Status => "status",
            Self::Describe(_) => "describe",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Replace(_) => "replace",
            Self::Down { .. } => "down",
            Self::Run(_) => "run",
            Self::Jobs => "jobs",
            Self::JobLogs { .. } => "job_logs",
            Self::JobCancel(_) => "job_cancel",
            Self::AgentLog { .. } => "agent_log",
            Self::Shell { .. } => "shell",
            Self::Connect { .. } => "connect",
        }
    }
}

/// One piece of the answer to [`ControlRequest::AgentLog`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum AgentLogPiece {
    /// The daemon sends no log: it is in the state directory (a `process`
    /// node's, or the kept end of an ended attempt's), where the CLI reads
    /// it. The only piece.
    InStateDir {
        /// Why no provider was asked, when the node is not a `process` one.
        why: Option<String>,
    },
    /// The log follows, read where the agent runs. The first piece.
    Start {
        /// The attempt.
        attempt: u64,
        /// Its provider's kind.
        kind: String,
        /// Its lease, with what the provider says of it.
        lease: String,
    },
    /// Some of the log's text.
    Text(String),
    /// Reading the log broke off, for this reason. The last piece.
    Broken(String),
}

/// The daemon's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
// A status is by far the largest answer, and one is sent per request.
#[allow(clippy::large_enum_variant)]
pub enum ControlResponse {
    /// The shape was accepted (`changed` is false for an identical resubmission).
    Applied {
        /// The generation now desired.
        generation: u64,
        /// Whether anything changed.
        changed: bool,
        /// The cluster is paused: the shape is recorded, not acted on until resumed.
        #[serde(default)]
        paused: bool,
    },
    /// Reconciling is now paused (or resumed), durably.
    Paused {
        /// Paused (`true`) or resumed.
        paused: bool,
        /// Whether that changed anything.
        changed: bool,
    },
    /// The node's attempt is failed and will be replaced.
    Replaced {
        /// The node.
        node: String,
        /// The attempt being replaced.
        attempt: u64,
    },
    /// What a shape would change.
    Plan(PlanReport),
    /// The cluster now.
    Status(ClusterSnapshot),
    /// One node in depth.
    Described(swactor_actors::NodeDescription),
    /// The daemon stopped.
    Down {
        /// Nodes torn down.
        destroyed: Vec<String>,
        /// Nodes left running (their machines are kept).
        kept: Vec<String>,
        /// With `keep`: nodes on record that had no machine to keep (failed
        /// and cleaned up, or not created yet); the next `up` starts them.
        #[serde(default)]
        without_machine: Vec<String>,
        /// With `purge`: each remote host, and why it could not be purged if it could not.
        #[serde(default)]
        purged: Vec<(String, Option<String>)>,
    },
    /// One event of a job (the answers to `Run`).
    Job(swactor_jobs::record::JobEvent),
    /// Every job.
    Jobs(Vec<swactor_jobs::record::JobRecord>),
    /// A job's output as (node, from stderr, text) pieces.
    JobLogs(Vec<(LogicalNodeId, bool, String)>),
    /// The job is being cancelled on these nodes.
    JobCancelled {
        /// The job.
        job: String,
        /// The nodes it still ran on.
        nodes: Vec<LogicalNodeId>,
    },
    /// A piece of a node's agent log (the answers to `AgentLog`).
    AgentLog(AgentLogPiece),
    /// The shell or connection asked for is open on this node's attempt;
    /// what follows on the stream is its traffic.
    Remote {
        /// The node.
        node: String,
        /// Its attempt that serves it.
        attempt: u64,
    },
    /// The request was refused; nothing changed.
    Error(String),
}

/// What a shape would change, per node, and what the cluster still has to
/// do whatever the shape.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PlanReport {
    /// The generation the shape would be applied as; `None` for the current shape.
    pub generation: Option<u64>,
    /// The generation desired now.
    pub current: u64,
    /// How many nodes it creates, replaces, destroys and leaves (its
    /// `examples` are empty: see `changes`).
    pub diff: ShapeDiff,
    /// Changed nodes in slot order: the first [`crate::guard::CHANGES_SHOWN`],
    /// or every one when all were asked for.
    pub changes: Vec<(LogicalNodeId, Change)>,
    /// Nodes not ready now (starting, failing, disconnected, leaving), listed
    /// as many as `changes` are.
    pub under_way: Vec<NodeSummary>,
    /// How many nodes are not ready now.
    pub under_way_total: u64,
    /// Leftover resources still being collected.
    pub orphans: usize,
    /// Whether the cluster is converged on its current shape.
    pub converged: bool,
    /// The cluster's clock, to read the nodes' times against.
    pub now: Timestamp,
    /// The shape changes no node but does change where new nodes may go
    /// (an `ssh` group's hosts or their labels): applying it makes a new
    /// generation.
    #[serde(default)]
    pub placement_only: bool,
}

impl PlanReport {
    /// Whether the daemon has anything to do: the shape changes a node, or
    /// the cluster is not converged yet (a node waits to restart, a leftover
    /// is being collected).
    pub fn has_work(&self) -> bool {
        crate::guard::changed(&self.diff) > 0
            || self.placement_only
            || self.under_way_total > 0
            || !self.converged
    }
}

/// An agent asking to join the swarm, or to open its jobs link: the first
/// frame either protocol reads from a peer it does not trust yet.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JoinRequest {
    /// The (run, node, attempt) the agent was started for.
    pub key: JoinKey,
    /// The token the daemon derived for that key.
    pub token: String,
}

/// A resource key as plain text, the way a join request carries it. It
/// becomes a [`ResourceKey`] only in [`JoinRequest::verify`], once the peer
/// has proved it is that key's agent, so nothing an unauthenticated peer
/// sends is interned (group names are kept for the life of the process).
/// Encoded exactly like a `ResourceKey`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinKey {
    /// The run id.
    pub run_id: String,
    /// The node id, `GROUP-INDEX`.
    pub node: String,
    /// The attempt number.
    pub attempt: u64,
}

impl JoinKey {
    /// The text form of `key`.
    pub fn of(key: &ResourceKey) -> Self {
        Self {
            run_id: key.run_id.to_string(),
            node: key.node.to_string(),
            attempt: key.attempt.0,
        }
    }

    /// The key as `ResourceKey`'s `Display` spells it (what tokens are derived from).
    pub fn text(&self) -> String {
        // The attempt spelled by its own `Display`, as the key spells it.
        let attempt = swactor_provisioning::NodeAttemptId(self.attempt);
        format!("{}/{}/{attempt}", self.run_id, self.node)
    }
}

impl JoinRequest {
    /// The request for `key`'s agent, holding `token`.
    pub fn new(key: &ResourceKey, token: String) -> Self {
        Self {
            key: JoinKey::of(key),
            token,
        }
    }

    /// The key, if the peer is that key's agent: it connected as the iroh
    /// identity `secret` derives for the key and sent the key's token.
    /// Otherwise the refusal to tell it.
    pub fn verify(
        &self,
        secret: &[u8; 32],
        remote: swactor_engine::iroh::EndpointId,
    ) -> Result<ResourceKey, &'static str> {
        let expected =
            swactor_providers::credentials::AgentCredentials::derive_text(secret, &self.key.text());
        if remote != expected.endpoint_id() {
            return Err("this key may not join for that node");
        }
        if self.token != expected.token {
            return Err("the join token does not match this node's identity");
        }
        // Only now, with a key the daemon issued, are its names interned.
        let node = swactor_provisioning::LogicalNodeId::parse(&self.key.node)
            .ok_or("the key's node id is not one this daemon knows")?;
        Ok(ResourceKey {
            run_id: swactor_provisioning::RunId::new(&self.key.run_id),
            node,
            attempt: swactor_provisioning::NodeAttemptId(self.key.attempt),
        })
    }
}

/// The daemon's answer to a join.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinReply {
    /// Joined; keep the connection and send a heartbeat every `heartbeat_ms`.
    Welcome {
        /// The interval the daemon expects heartbeats at.
        heartbeat_ms: u64,
        /// The agent's lease: once this long has passed on the agent's own
        /// clock since the daemon last renewed it (this welcome, or a
        /// [`Renewal`]), the agent ends its node by itself. 0: never.
        lease_ms: u64,
        /// Whether the lease waits for a job the node runs (the group's
        /// `orphan_policy = "idle"`): it then counts from the later of the
        /// last renewal and the end of the last job.
        lease_waits_for_jobs: bool,
        /// Where every daemon of the run listens for agents, this one
        /// included, when several take turns leading it: they share the
        /// ticket's identity, so the agent dials them all and whichever
        /// leads answers. Empty for a daemon alone: the agent dials its
        /// ticket as before. At most [`REPLICAS_MAX`] are kept.
        replicas: Vec<SocketAddr>,
    },
    /// Refused, with the reason: the agent's attempt is not wanted, it stops.
    Refused(String),
    /// Not now, with the reason (the daemon has not read its journal yet,
    /// its cluster is restarting or going away): the agent asks again.
    NotYet(String),
}

/// A heartbeat from a joined agent.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Heartbeat(pub u64);

/// The daemon renewing a joined agent's lease (sent back on the stream the
/// agent's heartbeats come on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewal {
    /// The heartbeat it answers.
    pub heartbeat: u64,
    /// The run's daemons, as in [`JoinReply::Welcome`], when that list
    /// changed since the agent was last told; it then replaces the one the
    /// agent had. `None`: no change.
    pub replicas: Option<Vec<SocketAddr>>,
}

/// The most daemon addresses a welcome or a renewal carries: a daemon sends
/// no more, and an agent keeps no more of a longer list.
pub const REPLICAS_MAX: usize = 16;

/// Largest frame a daemon answers a join or a heartbeat with: a welcome or
/// a renewal naming [`REPLICAS_MAX`] IPv6 addresses takes under 400 bytes
/// (see the test `a_welcome_and_a_renewal_with_every_replica_fit_a_reply`),
/// and the rest leaves room for the reason of a refusal.
pub const SWARM_REPLY_LEN_MAX_BYTES: usize = 4 * 1024;

#[cfg(test)]
mod tests {
    //! Every message of the three protocols, decoded from hostile bytes: the
    //! decoder never panics, never takes more memory than it was sent (plus
    //! one read chunk), and reads back what was encoded.

    use super::*;
    use proptest::prelude::*;
    use swactor_actors::{AgentLink, ClusterEvent};
    use swactor_engine::net::{FIRST_FRAME_LEN_MAX_BYTES, encode_frame, recv_frame};
    use swactor_engine::telemetry::{TelemetryConfig, TelemetryFrame};

    /// Reads `bytes` as one frame of `T` under `limit`; `Ok(None)` for a clean end.
    fn read<T: serde::de::DeserializeOwned>(
        bytes: &[u8],
        limit: usize,
    ) -> Result<Option<T>, swactor_engine::net::FrameError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut reader = bytes;
        runtime.block_on(recv_frame::<T, _>(&mut reader, limit))
    }

    /// Whether `bytes` read as one frame of `T` under `limit` (a clean end counts).
    fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], limit: usize) -> bool {
        read::<T>(bytes, limit).is_ok()
    }

    /// Decodes `bytes` as one frame of `T` under `limit`.
    fn decoded<T: serde::de::DeserializeOwned>(bytes: &[u8], limit: usize) -> Option<T> {
        read::<T>(bytes, limit).ok().flatten()
    }

    /// Any address as the wire carries it: an IPv6 one without its flow
    /// label and scope, which postcard does not encode.
    fn wire_addr() -> impl Strategy<Value = std::net::SocketAddr> {
        any::<std::net::SocketAddr>().prop_map(|a| match a {
            std::net::SocketAddr::V6(v6) => {
                std::net::SocketAddrV6::new(*v6.ip(), v6.port(), 0, 0).into()
            }
            v4 => v4,
        })
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
            let _ = decode::<JoinReply>(&bytes, SWARM_REPLY_LEN_MAX_BYTES);
            let _ = decode::<Heartbeat>(&bytes, 64);
            let _ = decode::<Renewal>(&bytes, SWARM_REPLY_LEN_MAX_BYTES);
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
            let join = JoinRequest::new(
                &swactor_provisioning::ResourceKey {
                    run_id: swactor_provisioning::RunId::new("r"),
                    node: swactor_provisioning::LogicalNodeId::parse("w-0").unwrap(),
                    attempt: swactor_provisioning::NodeAttemptId(attempt),
                },
                token,
            );
            let bytes = encode_frame(&join, FIRST_FRAME_LEN_MAX_BYTES).unwrap();
            prop_assert!(decode::<JoinRequest>(&bytes, FIRST_FRAME_LEN_MAX_BYTES));
            let cut = cut.min(bytes.len());
            if cut > 0 && cut < bytes.len() {
                prop_assert!(!decode::<JoinRequest>(&bytes[..cut], FIRST_FRAME_LEN_MAX_BYTES));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn a_welcome_and_a_renewal_round_trip_with_their_replicas(
            replicas in proptest::collection::vec(wire_addr(), 0..=REPLICAS_MAX),
            numbers in any::<(u64, u64, bool)>(),
            told in any::<bool>(),
            cut in 1usize..400,
        ) {
            let (heartbeat, lease_ms, lease_waits_for_jobs) = numbers;
            let welcome = JoinReply::Welcome {
                heartbeat_ms: heartbeat,
                lease_ms,
                lease_waits_for_jobs,
                replicas: replicas.clone(),
            };
            let renewal = Renewal {
                heartbeat,
                replicas: told.then_some(replicas),
            };
            let bytes = encode_frame(&welcome, SWARM_REPLY_LEN_MAX_BYTES).unwrap();
            prop_assert_eq!(decoded::<JoinReply>(&bytes, SWARM_REPLY_LEN_MAX_BYTES), Some(welcome));
            if cut < bytes.len() {
                prop_assert!(!decode::<JoinReply>(&bytes[..cut], SWARM_REPLY_LEN_MAX_BYTES));
            }
            let bytes = encode_frame(&renewal, SWARM_REPLY_LEN_MAX_BYTES).unwrap();
            prop_assert_eq!(decoded::<Renewal>(&bytes, SWARM_REPLY_LEN_MAX_BYTES), Some(renewal));
            if cut < bytes.len() {
                prop_assert!(!decode::<Renewal>(&bytes[..cut], SWARM_REPLY_LEN_MAX_BYTES));
            }
        }
    }

    /// The largest welcome and renewal a daemon sends: every number at its
    /// longest, and [`REPLICAS_MAX`] IPv6 addresses.
    #[test]
    fn a_welcome_and_a_renewal_with_every_replica_fit_a_reply() {
        let replicas: Vec<std::net::SocketAddr> = (0..REPLICAS_MAX)
            .map(|i| {
                let ip = std::net::Ipv6Addr::new(0xffff, 0xffff, 0xffff, 0xffff, 0, 0, 0, i as u16);
                std::net::SocketAddr::from((ip, u16::MAX))
            })
            .collect();
        let welcome = JoinReply::Welcome {
            heartbeat_ms: u64::MAX,
            lease_ms: u64::MAX,
            lease_waits_for_jobs: true,
            replicas: replicas.clone(),
        };
        let renewal = Renewal {
            heartbeat: u64::MAX,
            replicas: Some(replicas),
        };
        assert!(encode_frame(&welcome, 400).is_ok());
        assert!(encode_frame(&renewal, 400).is_ok());
        // A daemon alone adds a byte to each: an empty list, no change.
        let alone = Renewal {
            heartbeat: 1,
            replicas: None,
        };
        assert_eq!(encode_frame(&alone, 64).unwrap(), framed(&[1, 0]));
    }

    #[test]
    fn a_join_is_encoded_as_before_and_interns_nothing_until_its_token_checks() {
        use swactor_providers::credentials::AgentCredentials;
        use swactor_provisioning::{GroupId, LogicalNodeId, NodeAttemptId, RunId};
        let key = ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse("w-3").unwrap(),
            attempt: NodeAttemptId(9),
        };
        // Same bytes as the (key, token) pair older agents send.
        let join = JoinRequest::new(&key, "t".into());
        assert_eq!(join.key.text(), key.to_string());
        assert_eq!(
            encode_frame(&join, FIRST_FRAME_LEN_MAX_BYTES).unwrap(),
            encode_frame(&(&key, "t"), FIRST_FRAME_LEN_MAX_BYTES).unwrap()
        );
        let secret = [7u8; 32];
        let creds = AgentCredentials::derive(&secret, &key);
        let good = JoinRequest::new(&key, creds.token.clone());
        assert_eq!(good.verify(&secret, creds.endpoint_id()), Ok(key.clone()));
        assert!(good.verify(&[8u8; 32], creds.endpoint_id()).is_err());
        // A stranger's join for a group this process never saw: refused,
        // and the group's name is not stored.
        let stranger = JoinRequest {
            key: JoinKey {
                run_id: "r".into(),
                node: "never-joined-group-0".into(),
                attempt: 1,
            },
            token: creds.token.clone(),
        };
        let bytes = encode_frame(&stranger, FIRST_FRAME_LEN_MAX_BYTES).unwrap();
        assert!(decode::<JoinRequest>(&bytes, FIRST_FRAME_LEN_MAX_BYTES));
        assert!(stranger.verify(&secret, creds.endpoint_id()).is_err());
        assert_eq!(GroupId::known("never-joined-group"), None);
    }

    /// A status of 100,000 nodes, each with a 200-character error, as the
    /// daemon sends it: as a control answer (JSON) and as a telemetry
    /// snapshot (postcard). Both must fit the frames each side accepts.
    #[test]
    fn a_status_of_a_hundred_thousand_nodes_fits_a_frame() {
        let error = "e".repeat(200);
        let nodes = (0..100_000u32)
            .map(|i| NodeSummary {
                node: swactor_provisioning::LogicalNodeId::parse(&format!("worker-{i}")).unwrap(),
                attempt: swactor_provisioning::NodeAttemptId(u64::from(i) + 1_000_000),
                stage: swactor_provisioning::NodeStage::Failed,
                intent: swactor_provisioning::Intent::Active,
                ready: false,
                pending: Some(swactor_provisioning::EffectKind::DestroyLease),
                failures: 7,
                last_error: Some(error.clone()),
                last_cause: Some(swactor_provisioning::FailureCause::Failure),
                next_retry_at: Some(Timestamp::from_millis(123_456_789)),
                agent: AgentLink::Away {
                    grace_until: Timestamp::from_millis(123_456_789),
                },
                lease: Some(swactor_provisioning::LeaseId::from(format!(
                    "docker:swactor_big_worker-{i}_a{}",
                    u64::from(i) + 1_000_000
                ))),
                resource: Some("container 0123456789ab".to_owned()),
                // The largest a next step is on the wire.
                next: swactor_provisioning::NextStep::LostAt {
                    at: Timestamp::from_millis(123_456_789),
                    replaced: true,
                },
                orphan_after_s: u32::MAX,
                lease_renewed_ms_ago: Some(u64::MAX),
            })
            .collect();
        let snap = ClusterSnapshot {
            run_id: "big".to_owned(),
            generation: swactor_provisioning::Generation(3),
            observed_generation: None,
            converged: false,
            inventory_read: true,
            desired_nodes: 100_000,
            nodes,
            orphans: 0,
            shutting_down: None,
            stats: Default::default(),
            now: Timestamp::from_millis(1),
            rentals: Vec::new(),
            deployment: None,
            foreign: Vec::new(),
            budget: None,
            spend: None,
            lifetime: None,
            in_flight: 0,
            paused: false,
            holds: Vec::new(),
            ha: None,
        };
        let json = serde_json::to_string(&ControlResponse::Status(snap.clone())).unwrap();
        assert!(
            json.len() < FRAME_LEN_MAX,
            "status answer: {} bytes",
            json.len()
        );
        let frame = encode_frame(
            &TelemetryFrame::<ClusterSnapshot, ClusterEvent>::Snapshot {
                seq: 1,
                state: snap,
            },
            FRAME_LEN_MAX,
        )
        .unwrap();
        assert!(
            frame.len() < FRAME_LEN_MAX / 2,
            "snapshot frame: {} bytes",
            frame.len()
        );
        // The engine's default telemetry frame would not carry it.
        assert!(frame.len() > TelemetryConfig::default().frame_len_max);
    }

    #[test]
    fn holds_lifetimes_and_hold_events_survive_the_telemetry_encoding() {
        use swactor_provisioning::lifetime::{Lifetime, Status, Verdict, Which};
        use swactor_provisioning::{GroupHold, GroupId, HoldKind};
        let snap = ClusterSnapshot {
            run_id: "r".to_owned(),
            generation: swactor_provisioning::Generation(1),
            observed_generation: None,
            converged: false,
            inventory_read: true,
            desired_nodes: 6,
            nodes: Vec::new(),
            orphans: 0,
            shutting_down: None,
            stats: Default::default(),
            now: Timestamp::from_millis(1),
            rentals: Vec::new(),
            deployment: None,
            foreign: Vec::new(),
            budget: None,
            spend: None,
            // One lifetime set and one off: postcard keeps both.
            lifetime: Some(Status {
                lifetime: Lifetime {
                    max_lifetime_s: 7_200,
                    idle_teardown_s: 0,
                },
                verdict: Verdict::Within {
                    left_ms: 60_000,
                    which: Which::MaxLifetime,
                },
                idle_ms: None,
            }),
            paused: false,
            in_flight: 2,
            holds: vec![GroupHold {
                group: GroupId::new("worker"),
                kind: HoldKind::Remediation,
                reason: "remediation paused: 4 of 6 unhealthy > max 2".to_owned(),
            }],
            ha: Some(swactor_actors::HaStatus {
                leader: "ctl-a (pid 4242)".to_owned(),
                leading_since_wall_ms: 1_764_000_000_000,
                standbys: vec!["ctl-b (pid 77)".to_owned()],
                lease_ttl_ms: 10_000,
                margin_ms: 2_000,
                renewed_ms_ago: 1_200,
                etcd: "http://127.0.0.1:2379".to_owned(),
                terms: 1,
                ..Default::default()
            }),
        };
        let frames: [TelemetryFrame<ClusterSnapshot, ClusterEvent>; 2] = [
            TelemetryFrame::Snapshot {
                seq: 1,
                state: snap,
            },
            TelemetryFrame::Event {
                seq: 2,
                at_ms: 1_764_000_000_000,
                event: ClusterEvent::Hold {
                    group: "worker".to_owned(),
                    kind: HoldKind::Rollout,
                    reason: None,
                },
            },
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for frame in frames {
            let bytes = encode_frame(&frame, FRAME_LEN_MAX).unwrap();
            let mut reader = &bytes[..];
            let back = runtime
                .block_on(
                    recv_frame::<TelemetryFrame<ClusterSnapshot, ClusterEvent>, _>(
                        &mut reader,
                        FRAME_LEN_MAX,
                    ),
                )
                .unwrap();
            assert_eq!(back, Some(frame));
        }
    }
}
