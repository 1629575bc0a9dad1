//! The flight recorder's pure half: every input a daemon hands its
//! [`Host`], written down as it is handed in, with a digest of what the
//! host answered, so that a fresh host fed the same inputs later (anywhere,
//! by any build that reads the format) can be checked to decide the same.
//!
//! [`Flight`] wraps a host. It derefs to the host for reading and has a
//! method of the same name and signature for every call that changes it,
//! so a caller that holds a `Flight` cannot change its host unrecorded (the
//! wrapper gives no `&mut Host`). Each such call appends one frame to a
//! buffer the caller drains ([`Flight::take_frames`]) and writes where it
//! likes; nothing here does I/O, reads a clock or allocates beyond the
//! buffer, which the caller bounds ([`Flight::set_buffer_max`]): a frame
//! that would not fit is dropped and counted, never waited for.
//!
//! A recording is [`MAGIC`], the format version, a length-prefixed
//! [`FlightHeader`] (what the host was built from), then frames. A frame is
//! a little-endian `u32` length, the postcard encoding of a
//! [`FlightInput`], and what the call returned ([`Answer`]): the answer
//! itself where it is a fold's (a result's or an observation's: applied,
//! or discarded and why; the most common frames by far), otherwise a 64-bit
//! digest of it (`digest.rs`). [`Replayer`] builds a host from a header and
//! feeds it frames, comparing answers; [`replay`] does it for a whole
//! recording and says where the first difference is.

use crate::ReconcilerConfig;
use crate::core::Reconciler;
use crate::driver::{DesiredUpdate, DriverError, EffectRequest};
use crate::host::{
    ApplyError, Host, HostConfig, HostError, HostEvent, JoinRefused, JournalDelta, JournalImage,
    Leadership, Listed, Liveness, Output, PauseError, ReplaceError, ShutdownMode, Ticket,
};
use crate::id::{GroupId, LogicalNodeId, NodeAttemptId, OperationId, ResourceKey, RunId};
use crate::lifetime::Status;
use crate::observe::{BootstrapEvent, BootstrapObservation, Folded, OperationResult, Release};
use crate::shape::{ClusterShape, NodeTemplate};
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::fmt;

mod digest;

/// The first bytes of every recording.
pub const MAGIC: &[u8; 8] = b"SWFLIGHT";

/// The version of the recording format this build writes and reads. A
/// change to [`FlightHeader`], [`FlightInput`] or to any type they or a
/// host's answers carry bumps it.
pub const FLIGHT_FORMAT: u32 = 2;

/// What a recording's host was built from, and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlightHeader {
    /// The build that recorded it (the daemon's version and commit), for
    /// people; replay does not depend on it.
    pub build: String,
    /// The run.
    pub run_id: RunId,
    /// The driver core's settings.
    pub reconciler: ReconcilerConfig,
    /// The host's settings.
    pub host: HostConfig,
    /// The journal the host resumed from (`None`: a new one).
    pub resume: Option<JournalImage>,
    /// The wall clock (ms since the Unix epoch) when the host was built...
    pub wall_ms: u64,
    /// ...and the host's own instant at that moment, so any later instant
    /// of the recording can be told as a time of day.
    pub now: Timestamp,
}

impl FlightHeader {
    /// The wall clock (ms since the Unix epoch) at the host's instant `at`.
    pub fn wall_at(&self, at: Timestamp) -> u64 {
        self.wall_ms.saturating_add(at.0).saturating_sub(self.now.0)
    }
}

/// One call that changes a host, with its arguments: the recorded input.
/// Borrowed while recording, owned when read back.
#[allow(missing_docs)] // each variant is the `Host` method of its name
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FlightInput<'a> {
    Inventory {
        listed: Cow<'a, Result<Vec<Listed>, String>>,
        now: Timestamp,
    },
    Apply {
        #[serde(with = "json")]
        shape: Cow<'a, ClusterShape>,
        ticket: Ticket,
        now: Timestamp,
    },
    ApplyNext {
        #[serde(with = "json")]
        shape: Cow<'a, ClusterShape>,
        ticket: Ticket,
        now: Timestamp,
    },
    Pause {
        paused: bool,
        ticket: Ticket,
        now: Timestamp,
    },
    WaitConverged {
        ticket: Ticket,
    },
    WaitAdopted {
        ticket: Ticket,
    },
    Shutdown {
        mode: ShutdownMode,
        ticket: Ticket,
        now: Timestamp,
    },
    Persisted {
        seq: u64,
    },
    Result {
        #[serde(with = "compact::result")]
        result: Cow<'a, OperationResult>,
        now: Timestamp,
    },
    SubmitFailed {
        node: LogicalNodeId,
        op: OperationId,
        reason: Cow<'a, str>,
        now: Timestamp,
    },
    Bootstrap {
        #[serde(with = "compact::observation")]
        obs: Cow<'a, BootstrapObservation>,
        now: Timestamp,
    },
    AgentJoined {
        key: Cow<'a, ResourceKey>,
        now: Timestamp,
    },
    AgentGone {
        key: Cow<'a, ResourceKey>,
        silent_ms: u64,
        now: Timestamp,
    },
    Leadership {
        leadership: Leadership,
        now: Timestamp,
    },
    Spent {
        spent_micros: u64,
    },
    Probed {
        key: Cow<'a, ResourceKey>,
        paused: Cow<'a, Result<bool, String>>,
        now: Timestamp,
    },
    Replace {
        node: LogicalNodeId,
        ticket: Ticket,
        now: Timestamp,
    },
    LaneLost {
        lane: u32,
    },
    Collected {
        key: Cow<'a, ResourceKey>,
        outcome: Cow<'a, Result<Release, String>>,
        now: Timestamp,
    },
    Timeout {
        now: Timestamp,
    },
    Starved {
        starved_ms: u64,
        now: Timestamp,
    },
    Tick {
        now: Timestamp,
    },
    WallClock {
        wall_ms: u64,
        now: Timestamp,
    },
    Lifetime {
        wall_ms: u64,
        jobs_running: bool,
        now: Timestamp,
    },
    Leads {
        now: Timestamp,
    },
    PollOutput {
        now: Timestamp,
    },
    PollEvent,
}

impl FlightInput<'_> {
    /// The instant the input was handed in at, when it names one.
    pub fn now(&self) -> Option<Timestamp> {
        match self {
            Self::Inventory { now, .. }
            | Self::Apply { now, .. }
            | Self::ApplyNext { now, .. }
            | Self::Pause { now, .. }
            | Self::Shutdown { now, .. }
            | Self::Result { now, .. }
            | Self::SubmitFailed { now, .. }
            | Self::Bootstrap { now, .. }
            | Self::AgentJoined { now, .. }
            | Self::AgentGone { now, .. }
            | Self::Leadership { now, .. }
            | Self::Probed { now, .. }
            | Self::Replace { now, .. }
            | Self::Collected { now, .. }
            | Self::Timeout { now }
            | Self::Starved { now, .. }
            | Self::Tick { now }
            | Self::WallClock { now, .. }
            | Self::Lifetime { now, .. }
            | Self::Leads { now }
            | Self::PollOutput { now } => Some(*now),
            Self::WaitConverged { .. }
            | Self::WaitAdopted { .. }
            | Self::Persisted { .. }
            | Self::Spent { .. }
            | Self::LaneLost { .. }
            | Self::PollEvent => None,
        }
    }

    /// Whether its answer is a fold's, which a recording keeps whole
    /// ([`Answer::Folded`] unless the fold failed).
    pub fn keeps_fold(&self) -> bool {
        matches!(
            self,
            Self::Result { .. } | Self::Bootstrap { .. } | Self::SubmitFailed { .. }
        )
    }

    /// Whether it is one of the host's own polls (an output or an event
    /// asked for) rather than something that happened.
    pub fn is_poll(&self) -> bool {
        matches!(
            self,
            Self::PollOutput { .. } | Self::PollEvent | Self::Leads { .. }
        )
    }

    /// The node it is about, when it names one.
    pub fn node(&self) -> Option<LogicalNodeId> {
        match self {
            Self::Result { result, .. } => Some(result.node),
            Self::SubmitFailed { node, .. } | Self::Replace { node, .. } => Some(*node),
            Self::Bootstrap { obs, .. } => Some(obs.node),
            Self::AgentJoined { key, .. }
            | Self::AgentGone { key, .. }
            | Self::Probed { key, .. }
            | Self::Collected { key, .. } => Some(key.node),
            _ => None,
        }
    }

    /// The variant's name, for people.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Inventory { .. } => "inventory",
            Self::Apply { .. } => "apply",
            Self::ApplyNext { .. } => "apply-next",
            Self::Pause { .. } => "pause",
            Self::WaitConverged { .. } => "wait-converged",
            Self::WaitAdopted { .. } => "wait-adopted",
            Self::Shutdown { .. } => "shutdown",
            Self::Persisted { .. } => "persisted",
            Self::Result { .. } => "result",
            Self::SubmitFailed { .. } => "submit-failed",
            Self::Bootstrap { .. } => "bootstrap",
            Self::AgentJoined { .. } => "agent-joined",
            Self::AgentGone { .. } => "agent-gone",
            Self::Leadership { .. } => "leadership",
            Self::Spent { .. } => "spent",
            Self::Probed { .. } => "probed",
            Self::Replace { .. } => "replace",
            Self::LaneLost { .. } => "lane-lost",
            Self::Collected { .. } => "collected",
            Self::Timeout { .. } => "timeout",
            Self::Starved { .. } => "starved",
            Self::Tick { .. } => "tick",
            Self::WallClock { .. } => "wall-clock",
            Self::Lifetime { .. } => "lifetime",
            Self::Leads { .. } => "leads",
            Self::PollOutput { .. } => "poll-output",
            Self::PollEvent => "poll-event",
        }
    }

    /// A short account of the input for people: its kind, and what it
    /// carries that says why it mattered (a result's outcome, an
    /// observation's event, how long an agent was silent).
    pub fn describe(&self) -> String {
        match self {
            Self::Inventory { listed, .. } => match listed.as_ref() {
                Ok(l) => format!("inventory: {} resource(s) listed", l.len()),
                Err(e) => format!("inventory: could not list ({e})"),
            },
            Self::Apply { shape, .. } | Self::ApplyNext { shape, .. } => {
                let groups: Vec<String> = shape
                    .groups
                    .iter()
                    .map(|g| format!("{}={}", g.id, g.count))
                    .collect();
                let which = match self {
                    Self::Apply { .. } => format!("apply of generation {}", shape.generation.0),
                    _ => "apply (as the next generation)".to_owned(),
                };
                format!("{which}: {}", groups.join(", "))
            }
            Self::Pause { paused, .. } => if *paused { "pause" } else { "resume" }.to_owned(),
            Self::Shutdown { mode, .. } => format!("shutdown ({mode:?})"),
            Self::Result { result, .. } => format!(
                "result for {} of {}: {:?}",
                result.node, result.op, result.outcome
            ),
            Self::SubmitFailed { node, reason, .. } => {
                format!("submit failed for {node}: {reason}")
            }
            Self::Bootstrap { obs, .. } => {
                format!("bootstrap of {}/{}: {:?}", obs.node, obs.attempt, obs.event)
            }
            Self::AgentJoined { key, .. } => format!("agent of {key} joined"),
            Self::AgentGone { key, silent_ms, .. } => {
                format!("agent of {key} went away (silent {silent_ms} ms)")
            }
            Self::Probed { key, paused, .. } => format!("probe of {key}: {paused:?}"),
            Self::Replace { node, .. } => format!("operator's replace of {node}"),
            Self::Collected { key, outcome, .. } => format!("collected {key}: {outcome:?}"),
            Self::Starved { starved_ms, .. } => format!("starved {starved_ms} ms in all"),
            Self::Leadership { leadership, .. } => format!("leadership {leadership:?}"),
            other => other.kind().to_owned(),
        }
    }

    /// An owned copy.
    pub fn into_owned(self) -> FlightInput<'static> {
        fn own<T: Clone>(c: Cow<'_, T>) -> Cow<'static, T> {
            Cow::Owned(c.into_owned())
        }
        match self {
            Self::Inventory { listed, now } => FlightInput::Inventory {
                listed: own(listed),
                now,
            },
            Self::Apply { shape, ticket, now } => FlightInput::Apply {
                shape: own(shape),
                ticket,
                now,
            },
            Self::ApplyNext { shape, ticket, now } => FlightInput::ApplyNext {
                shape: own(shape),
                ticket,
                now,
            },
            Self::Pause {
                paused,
                ticket,
                now,
            } => FlightInput::Pause {
                paused,
                ticket,
                now,
            },
            Self::WaitConverged { ticket } => FlightInput::WaitConverged { ticket },
            Self::WaitAdopted { ticket } => FlightInput::WaitAdopted { ticket },
            Self::Shutdown { mode, ticket, now } => FlightInput::Shutdown { mode, ticket, now },
            Self::Persisted { seq } => FlightInput::Persisted { seq },
            Self::Result { result, now } => FlightInput::Result {
                result: own(result),
                now,
            },
            Self::SubmitFailed {
                node,
                op,
                reason,
                now,
            } => FlightInput::SubmitFailed {
                node,
                op,
                reason: Cow::Owned(reason.into_owned()),
                now,
            },
            Self::Bootstrap { obs, now } => FlightInput::Bootstrap { obs: own(obs), now },
            Self::AgentJoined { key, now } => FlightInput::AgentJoined { key: own(key), now },
            Self::AgentGone {
                key,
                silent_ms,
                now,
            } => FlightInput::AgentGone {
                key: own(key),
                silent_ms,
                now,
            },
            Self::Leadership { leadership, now } => FlightInput::Leadership { leadership, now },
            Self::Spent { spent_micros } => FlightInput::Spent { spent_micros },
            Self::Probed { key, paused, now } => FlightInput::Probed {
                key: own(key),
                paused: own(paused),
                now,
            },
            Self::Replace { node, ticket, now } => FlightInput::Replace { node, ticket, now },
            Self::LaneLost { lane } => FlightInput::LaneLost { lane },
            Self::Collected { key, outcome, now } => FlightInput::Collected {
                key: own(key),
                outcome: own(outcome),
                now,
            },
            Self::Timeout { now } => FlightInput::Timeout { now },
            Self::Starved { starved_ms, now } => FlightInput::Starved { starved_ms, now },
            Self::Tick { now } => FlightInput::Tick { now },
            Self::WallClock { wall_ms, now } => FlightInput::WallClock { wall_ms, now },
            Self::Lifetime {
                wall_ms,
                jobs_running,
                now,
            } => FlightInput::Lifetime {
                wall_ms,
                jobs_running,
                now,
            },
            Self::Leads { now } => FlightInput::Leads { now },
            Self::PollOutput { now } => FlightInput::PollOutput { now },
            Self::PollEvent => FlightInput::PollEvent,
        }
    }
}

/// A shape inside a frame, as JSON bytes: a shape leaves out some fields
/// at their defaults when it is encoded, which postcard cannot read back.
mod json {
    use super::ClusterShape;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::borrow::Cow;

    #[allow(clippy::ptr_arg)] // serde's `with` hands the field as it is
    pub(super) fn serialize<S: Serializer>(
        shape: &Cow<'_, ClusterShape>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let bytes = serde_json::to_vec(shape.as_ref()).map_err(serde::ser::Error::custom)?;
        s.serialize_bytes(&bytes)
    }

    pub(super) fn deserialize<'de, 'a, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Cow<'a, ClusterShape>, D::Error> {
        let bytes = <Cow<'de, [u8]>>::deserialize(d)?;
        serde_json::from_slice(&bytes)
            .map(Cow::Owned)
            .map_err(serde::de::Error::custom)
    }
}

/// The two inputs that come for every node at every step (results and
/// observations), with their slot as its group and index rather than as
/// text: formatting ids was most of what recording them cost.
mod compact {
    use super::*;
    use crate::id::GroupId;
    use crate::id::SessionId;
    use crate::observe::{BootstrapEvent, OperationOutcome};
    use serde::{Deserializer, Serializer};

    fn node<E: serde::de::Error>(group: &str, index: u32) -> Result<LogicalNodeId, E> {
        GroupId::intern(group)
            .map(|g| LogicalNodeId::new(g, index))
            .ok_or_else(|| E::custom("too many group names"))
    }

    pub(super) mod result {
        use super::*;

        #[derive(Serialize)]
        struct Shown<'a> {
            group: &'a str,
            index: u32,
            op: &'a OperationId,
            outcome: &'a OperationOutcome,
        }

        #[derive(Deserialize)]
        struct Read {
            group: String,
            index: u32,
            op: OperationId,
            outcome: OperationOutcome,
        }

        #[allow(clippy::ptr_arg)] // serde's `with` hands the field as it is
        pub(in super::super) fn serialize<S: Serializer>(
            r: &Cow<'_, OperationResult>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            Shown {
                group: r.node.group.as_str(),
                index: r.node.index,
                op: &r.op,
                outcome: &r.outcome,
            }
            .serialize(s)
        }

        pub(in super::super) fn deserialize<'de, 'a, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Cow<'a, OperationResult>, D::Error> {
            let r = Read::deserialize(d)?;
            Ok(Cow::Owned(OperationResult {
                node: node(&r.group, r.index)?,
                op: r.op,
                outcome: r.outcome,
            }))
        }
    }

    pub(super) mod observation {
        use super::*;

        #[derive(Serialize)]
        struct Shown<'a> {
            group: &'a str,
            index: u32,
            attempt: NodeAttemptId,
            session: &'a SessionId,
            event: &'a BootstrapEvent,
        }

        #[derive(Deserialize)]
        struct Read {
            group: String,
            index: u32,
            attempt: NodeAttemptId,
            session: SessionId,
            event: BootstrapEvent,
        }

        #[allow(clippy::ptr_arg)] // serde's `with` hands the field as it is
        pub(in super::super) fn serialize<S: Serializer>(
            o: &Cow<'_, BootstrapObservation>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            Shown {
                group: o.node.group.as_str(),
                index: o.node.index,
                attempt: o.attempt,
                session: &o.session,
                event: &o.event,
            }
            .serialize(s)
        }

        pub(in super::super) fn deserialize<'de, 'a, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Cow<'a, BootstrapObservation>, D::Error> {
            let o = Read::deserialize(d)?;
            Ok(Cow::Owned(BootstrapObservation {
                node: node(&o.group, o.index)?,
                attempt: o.attempt,
                session: o.session,
                event: o.event,
            }))
        }
    }
}

/// The digest of what [`Host::poll_output`] returned, as a recording keeps
/// it. A pass names its run, a slot's group and a template in every create
/// and start it dispatches (the same few, 200,000 times in a pass over
/// 100,000 nodes): each is digested once per pass and that digest folded
/// in where it appears. A slot, in a pass and in a journal write, is
/// folded in as one word, its group's digest plus its index, rather than
/// as its text. Every other output is digested as [`digest`] does.
pub fn output_digest(out: &Option<Output>) -> u64 {
    let pass = match out {
        Some(Output::Pass(pass)) => pass,
        Some(Output::Persist(delta)) => return delta_digest(delta),
        _ => return digest(out),
    };
    let mut h = digest::Hasher::new();
    // `Some`, then the variant's index, as serde would show them.
    h.word(1);
    h.word(2);
    h.value(&pass.number);
    h.word(pass.dispatches.len() as u64);
    let mut known = Known::default();
    for d in &pass.dispatches {
        // Numbers and ids as serde shows them, written out: a pass over
        // 100,000 nodes has 200,000 of them.
        h.word(d.op.attempt.0);
        h.word(d.op.seq);
        h.word(known.run(&d.key.run_id));
        known.slot(&mut h, &d.key.node);
        h.word(d.key.attempt.0);
        h.word(d.deadline.0);
        match &d.request {
            EffectRequest::CreateLease { template: t } => {
                h.word(0);
                h.word(known.template(t));
            }
            EffectRequest::StartBootstrap {
                lease,
                endpoint,
                template: t,
            } => {
                h.word(2);
                h.str(lease.as_str());
                h.str(endpoint.as_str());
                h.word(known.template(t));
            }
            other => request_words(&mut h, other),
        }
    }
    h.word(digest::SEQ_END);
    h.word(pass.transitioned.len() as u64);
    for node in &pass.transitioned {
        known.slot(&mut h, node);
    }
    h.word(digest::SEQ_END);
    h.value(&pass.stats);
    h.value(&pass.errors);
    h.finish()
}

/// Folds in a request that names no run or template, word by word as
/// serde shows it (a variant's index, then its fields): where a provider
/// learns a machine's address only after leasing it, every new lease's
/// endpoint is looked up, so a pass can hold a `LookupEndpoint` per node.
#[inline]
fn request_words(h: &mut digest::Hasher, request: &EffectRequest) {
    match request {
        EffectRequest::LookupEndpoint { lease } => {
            h.word(1);
            h.str(lease.as_str());
        }
        EffectRequest::CancelBootstrap { session } => {
            h.word(3);
            h.str(session.as_str());
        }
        EffectRequest::DestroyLease { lease, failed } => {
            h.word(4);
            h.str(lease.as_str());
            match failed {
                None => h.word(0),
                Some(why) => {
                    h.word(1);
                    h.str(why);
                }
            }
        }
        other => h.value(other),
    }
}

/// What a pass's digest has digested already: the last run and group (a
/// pass names one run, and its slots group by group) and each template,
/// each by identity, so none is digested twice.
#[derive(Default)]
struct Known {
    run: Option<(*const str, u64)>,
    group: Option<(crate::id::GroupId, u64)>,
    templates: Vec<(*const NodeTemplate, u64)>,
}

impl Known {
    fn run(&mut self, run: &RunId) -> u64 {
        let at: *const str = run.as_str();
        match self.run {
            Some((p, d)) if std::ptr::eq(p, at) => d,
            _ => {
                let d = digest(run);
                self.run = Some((at, d));
                d
            }
        }
    }

    /// Folds in `node` as one word: its group's digest plus its index.
    fn slot(&mut self, h: &mut digest::Hasher, node: &LogicalNodeId) {
        let d = match self.group {
            Some((g, d)) if g == node.group => d,
            _ => {
                let d = digest(node.group.as_str());
                self.group = Some((node.group, d));
                d
            }
        };
        h.word(d.wrapping_add(u64::from(node.index)));
    }

    fn template(&mut self, t: &std::sync::Arc<NodeTemplate>) -> u64 {
        let at = std::sync::Arc::as_ptr(t);
        if let Some((_, d)) = self.templates.iter().find(|(p, _)| std::ptr::eq(*p, at)) {
            return *d;
        }
        let d = digest(t.as_ref());
        self.templates.push((at, d));
        d
    }
}

/// The digest of a journal write, with each slot as one word (see
/// [`output_digest`]; the first write of a cold start names every slot).
fn delta_digest(delta: &JournalDelta) -> u64 {
    let mut h = digest::Hasher::new();
    // `Some`, then `Persist`'s index.
    h.word(1);
    h.word(0);
    h.value(&delta.seq);
    h.value(&delta.meta);
    let mut known = Known::default();
    h.word(delta.put.len() as u64);
    for (node, record) in &delta.put {
        known.slot(&mut h, node);
        h.value(record);
    }
    h.word(digest::SEQ_END);
    h.word(delta.remove.len() as u64);
    for node in &delta.remove {
        known.slot(&mut h, node);
    }
    h.finish()
}

/// What a recording keeps of a host call's answer.
///
/// A fold's answer (to a result, an observation or a failed submission) is
/// kept whole when the fold went through, as it nearly always does: it is
/// two or three bytes, cheaper to write than a digest, and a divergence on
/// it can say what was recorded. Anything else is kept as its digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// A fold that went through, as it went.
    Folded(Folded),
    /// The digest of any other answer ([`digest`], [`output_digest`]).
    Digest(u64),
}

impl Answer {
    /// What a recording keeps of a fold's answer `out`.
    pub fn of_fold(out: &Result<Folded, DriverError>) -> Self {
        match out {
            Ok(folded) => Self::Folded(*folded),
            Err(_) => Self::Digest(digest(out)),
        }
    }

    /// What a recording keeps of a poll of the host's outputs.
    pub fn of_output(out: &Option<Output>) -> Self {
        Self::Digest(output_digest(out))
    }

    /// What a recording keeps of any other answer.
    pub fn of<T: Serialize + ?Sized>(out: &T) -> Self {
        Self::Digest(digest(out))
    }

    /// The answer as a divergence shows what was recorded.
    pub fn describe(&self) -> String {
        match self {
            Self::Folded(folded) => format!("Ok({folded:?})"),
            Self::Digest(d) => format!("an answer of digest {d:016x}"),
        }
    }
}

/// The digest of what a host call returned, as a recording keeps it (see
/// `digest.rs` for how it is taken).
pub fn digest<T: Serialize + ?Sized>(value: &T) -> u64 {
    digest::of(value)
}

/// The recorder's counters, for the daemon's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlightStats {
    /// Frames written to the buffer.
    pub frames: u64,
    /// Frames dropped because the buffer was full (the first one cut the
    /// recording; every one after it is dropped too).
    pub dropped: u64,
    /// Bytes the frames took in the buffer (a result or an observation,
    /// kept compact until it is written out, counts the bytes it took
    /// there, and the time written before it when there was one).
    pub bytes: u64,
}

/// Tags that stand where a frame's length would among a [`FlightBatch`]'s
/// bytes, each beginning a frame kept in a compact form of its own until
/// the batch is written out ([`FlightBatch::write_to`]). No frame is this
/// long: one that would be is cut ([`CUT_MARKER`], the last value, ends a
/// batch as it ends a recording).
///
/// Results and observations are nearly every frame (a million in a cold
/// converge of 100,000 nodes). Kept this way, each costs the thread that
/// runs the host a few stores and one copy of its id; the writer thread
/// (the daemon's) puts the postcard frame together. The form is a fixed
/// head and the id's bytes, and a message's time is written once for all
/// the frames that share it: an observation takes about 40 bytes in the
/// buffer, fewer than its frame will, which matters as much as the
/// instructions (every byte passes from one core's cache to another's).
mod tag {
    /// The time given with the kept frames after it: a `u64`.
    pub(super) const NOW: u32 = u32::MAX - 3;
    /// A kept result: [`super::fast::RESULT_HEAD`].
    pub(super) const RESULT: u32 = u32::MAX - 2;
    /// A kept observation: [`super::fast::OBSERVATION_HEAD`].
    pub(super) const OBSERVATION: u32 = u32::MAX - 1;
    /// Lengths from this one up are tags, or [`super::CUT_MARKER`].
    pub(super) const FIRST: u32 = NOW;
}

/// The bytes a time takes among a batch's: its tag and a `u64`.
const NOW_SIZE: usize = 12;

/// Frames a [`Flight`] recorded, taken out with [`Flight::take_frames`]:
/// frames encoded already, and results and observations kept compact (see
/// [`tag`]) to be encoded among them when the batch is written out.
#[derive(Debug, Default)]
pub struct FlightBatch {
    bytes: Vec<u8>,
    /// The groups the kept frames name, by their place here.
    groups: Vec<GroupId>,
    /// The place of the group named last.
    last_group: u32,
    /// The time written last ([`tag::NOW`]), which the kept frames after
    /// it were given.
    now: Option<Timestamp>,
}

impl FlightBatch {
    /// An empty batch with room for `bytes` bytes of frames: a batch
    /// handed over once it holds some amount, with room for that much and
    /// one usual frame more, never grows on the way (growing copies what
    /// it holds).
    pub fn with_room(bytes: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(bytes),
            ..Self::default()
        }
    }

    /// Whether it holds no frame.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes its frames hold in memory (a kept frame takes fewer than
    /// it will written out).
    #[inline]
    pub fn held(&self) -> usize {
        self.bytes.len()
    }

    /// The bytes it has room for.
    pub fn capacity(&self) -> usize {
        self.bytes.capacity()
    }

    /// Empties it, keeping its room.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.groups.clear();
        self.last_group = 0;
        self.now = None;
    }

    /// The place of `group` among the batch's groups; `None` for a name
    /// too long to keep compact (a kept frame says its length in a byte).
    #[inline(always)]
    fn group(&mut self, group: GroupId) -> Option<u32> {
        match self.groups.get(self.last_group as usize) {
            Some(&last) if last == group => Some(self.last_group),
            _ => self.another_group(group),
        }
    }

    #[inline(never)]
    fn another_group(&mut self, group: GroupId) -> Option<u32> {
        if group.as_str().len() > usize::from(u8::MAX) {
            return None;
        }
        let at = match self.groups.iter().position(|&g| g == group) {
            Some(at) => at,
            None => {
                self.groups.push(group);
                self.groups.len() - 1
            }
        };
        self.last_group = u32::try_from(at).ok()?;
        Some(self.last_group)
    }

    /// Writes `now` for the kept frames after it, if it is not the time
    /// written last.
    #[inline(always)]
    fn set_now(&mut self, now: Timestamp) {
        if self.now != Some(now) {
            self.now = Some(now);
            let mut head = [0; NOW_SIZE];
            head[..4].copy_from_slice(&tag::NOW.to_le_bytes());
            head[4..].copy_from_slice(&now.0.to_le_bytes());
            self.bytes.extend_from_slice(&head);
        }
    }

    /// Appends its frames, encoded, to `out`: what the recording holds
    /// next.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        let b = &self.bytes[..];
        let mut scratch = fast::Scratch::new();
        let mut now = 0;
        // Where the frames not yet copied begin: frames encoded already
        // are copied a run at a time.
        let mut from = 0;
        let mut at = 0;
        while let Some(head) = b.get(at..at + 4) {
            let head = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
            if head < tag::FIRST {
                at += 4 + head as usize;
                continue;
            }
            out.extend_from_slice(&b[from..at]);
            let rest = &b[at..];
            at += match head {
                tag::NOW => {
                    now = fast::u64_at(rest, 4);
                    NOW_SIZE
                }
                tag::OBSERVATION => fast::observation(&mut scratch, rest, &self.groups, now, out),
                tag::RESULT => fast::result(&mut scratch, rest, &self.groups, now, out),
                // The cut: nothing follows it.
                _ => {
                    out.extend_from_slice(rest);
                    return;
                }
            };
            from = at;
        }
        out.extend_from_slice(&b[from..]);
    }

    /// Its frames, encoded.
    #[cfg(test)]
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() * 2);
        self.write_to(&mut out);
        out
    }
}

/// The frames a [`Flight`] has recorded and not yet handed out, bounded.
#[derive(Debug)]
struct Recorder {
    batch: FlightBatch,
    max: usize,
    stats: FlightStats,
    /// Where the frame being written starts, while one is.
    open: Option<usize>,
    /// A frame was dropped: the recording ended there with
    /// [`CUT_MARKER`], and nothing more is recorded (a recording with a
    /// hole could not be replayed past it).
    cut: bool,
}

impl Recorder {
    fn new(max: usize) -> Self {
        Self {
            batch: FlightBatch::default(),
            max,
            stats: FlightStats::default(),
            open: None,
            cut: false,
        }
    }

    /// Drops the frame begun at `start` and ends the recording there.
    fn cut_at(&mut self, start: usize) {
        self.batch.bytes.truncate(start);
        self.batch
            .bytes
            .extend_from_slice(&CUT_MARKER.to_le_bytes());
        self.open = None;
        self.cut = true;
        self.stats.dropped += 1;
    }

    /// Starts a frame with `input`; its length is written over its first
    /// four bytes once its answer is in. Nothing once the recording was
    /// cut.
    fn begin(&mut self, input: &FlightInput<'_>) {
        if self.cut {
            self.stats.dropped += 1;
            return;
        }
        let buf = &mut self.batch.bytes;
        let start = buf.len();
        // Room for a usual frame at once, so its pieces never reallocate.
        buf.reserve(128);
        buf.extend_from_slice(&[0; 4]);
        if postcard::serialize_with_flavor(input, Append(buf)).is_ok() {
            self.open = Some(start);
        } else {
            // Unencodable: never happens for these types; nothing is
            // written half.
            self.cut_at(start);
        }
    }

    /// Records a result and its fold's answer `out`: kept compact when
    /// the fold went through (see [`tag`]), as a frame now otherwise.
    /// Always inlined: it runs for a great many frames.
    #[inline(always)]
    fn keep_result(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
        out: &Result<Folded, DriverError>,
    ) {
        let kept = match out {
            Ok(answer) => fast::Outcome::of(&result.outcome).and_then(|outcome| {
                let group = self.batch.group(result.node.group)?;
                let start = self.batch.bytes.len();
                self.batch.set_now(now);
                fast::keep_result(&mut self.batch.bytes, result, group, outcome, *answer);
                Some(start)
            }),
            Err(_) => None,
        };
        match kept {
            Some(start) => self.count(start),
            None => self.at_once(
                &FlightInput::Result {
                    result: Cow::Borrowed(result),
                    now,
                },
                out,
            ),
        }
    }

    /// Records an observation and its fold's answer `out`, as
    /// [`Recorder::keep_result`] does a result; a failure, with its words,
    /// is written at once.
    #[inline(always)]
    fn keep_observation(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
        out: &Result<Folded, DriverError>,
    ) {
        let kept = match out {
            Ok(answer) if fast::keeps(obs) => self.batch.group(obs.node.group).map(|group| {
                let start = self.batch.bytes.len();
                self.batch.set_now(now);
                fast::keep_observation(&mut self.batch.bytes, obs, group, *answer);
                start
            }),
            _ => None,
        };
        match kept {
            Some(start) => self.count(start),
            None => self.at_once(
                &FlightInput::Bootstrap {
                    obs: Cow::Borrowed(obs),
                    now,
                },
                out,
            ),
        }
    }

    /// Records a result or an observation as a frame now: one the host
    /// refused with an error, a failure with its words, or one with an id
    /// too long to keep compact.
    #[cold]
    fn at_once(&mut self, input: &FlightInput<'_>, out: &Result<Folded, DriverError>) {
        self.begin(input);
        self.end_fold(out);
    }

    /// Ends the open frame with the digest of its answer.
    #[inline]
    fn end_digest(&mut self, digest: u64) {
        if let Some(start) = self.open.take() {
            self.batch.bytes.extend_from_slice(&digest.to_le_bytes());
            self.close(start);
        }
    }

    /// Ends the open frame, a fold's, with its answer `out` as
    /// [`Answer::of_fold`] keeps it, in postcard.
    fn end_fold(&mut self, out: &Result<Folded, DriverError>) {
        let Some(start) = self.open.take() else {
            return;
        };
        let buf = &mut self.batch.bytes;
        match out {
            Ok(answer) => {
                let (bytes, len) = fast::folded(*answer);
                buf.extend_from_slice(&bytes[..len]);
            }
            Err(_) => {
                // Writing to a vector cannot fail.
                let _ = postcard::serialize_with_flavor(&Answer::of_fold(out), Append(buf));
            }
        }
        self.close(start);
    }

    /// Writes the length of the frame begun at `start`, or cuts the
    /// recording there if it does not fit.
    #[inline]
    fn close(&mut self, start: usize) {
        let buf = &mut self.batch.bytes;
        let len = buf.len() - start - 4;
        match u32::try_from(len) {
            Ok(len32) if len32 < tag::FIRST => {
                buf[start..start + 4].copy_from_slice(&len32.to_le_bytes());
                self.count(start);
            }
            _ => self.cut_at(start),
        }
    }

    /// Counts the frame begun at `start`, whole now, or cuts the recording
    /// there if it does not fit.
    #[inline]
    fn count(&mut self, start: usize) {
        let len = self.batch.bytes.len() - start;
        let before = self.batch.held() - len;
        if before + len <= self.max || before == 0 {
            self.stats.frames += 1;
            self.stats.bytes += len as u64;
        } else {
            self.cut_at(start);
        }
    }
}

/// Results and observations kept compact (see [`tag`]), and their frames
/// put together from that form: the very bytes postcard writes for them (a
/// test checks each kind against it), without going through serde.
/// Anything else, and the rarer outcomes and events (failures, with their
/// words), goes through postcard at once.
mod fast {
    use super::*;
    use crate::observe::OperationOutcome;

    /// `FlightInput`'s variant indices, as serde numbers them.
    const RESULT: u8 = 8;
    const BOOTSTRAP: u8 = 10;

    /// A kept observation: its tag, its group's place in the batch
    /// (`u32`), the slot's index (`u32`), the attempt (`u64`), the event's
    /// variant and stage (a byte each, as serde numbers them), the answer
    /// ([`answer_code`]), and the session's length (a byte); its bytes
    /// follow.
    pub(super) const OBSERVATION_HEAD: usize = 24;

    /// A kept result: its tag, its group's place (`u32`), the slot's index
    /// (`u32`), the operation's attempt and number (`u64` each), the
    /// outcome's variant, whether it carries an endpoint (see
    /// [`Outcome`]), the answer, and the length of its text (a byte each);
    /// the text follows, then the endpoint's length and bytes if it has one.
    pub(super) const RESULT_HEAD: usize = 32;

    /// The answer of a fold that applied, as a kept frame holds it (any
    /// other byte is the reason a fold discarded its input).
    const APPLIED_CODE: u8 = u8::MAX;

    /// The longest id a kept frame holds (its length is a byte); a longer
    /// one is written at once, through postcard.
    const TEXT_MAX: usize = u8::MAX as usize;

    /// The most a frame put together here takes: three texts of at most
    /// [`TEXT_MAX`] bytes and their lengths, four varints and a few bytes.
    const MAX: usize = 1024;

    #[inline]
    fn answer_code(answer: Folded) -> u8 {
        match answer {
            Folded::Applied => APPLIED_CODE,
            Folded::Discarded(reason) => reason as u8,
        }
    }

    /// A result's outcome as a kept result holds it: the variant (as
    /// serde numbers it), its text (a lease, an endpoint or a session),
    /// and for a lease just made, whether an endpoint came with it.
    #[derive(Clone, Copy)]
    pub(super) struct Outcome<'a> {
        variant: u8,
        text: &'a str,
        /// 0 for an outcome with no such field, 1 for none, 2 for this.
        endpoint: (u8, &'a str),
    }

    impl<'a> Outcome<'a> {
        /// `None` for an outcome written at once: a failure, with its
        /// words, or one with an id longer than [`TEXT_MAX`].
        #[inline]
        pub(super) fn of(outcome: &'a OperationOutcome) -> Option<Self> {
            let (variant, text, endpoint) = match outcome {
                OperationOutcome::LeaseCreated { lease, endpoint } => (
                    0,
                    lease.as_str(),
                    endpoint.as_ref().map_or((1, ""), |e| (2, e.as_str())),
                ),
                OperationOutcome::EndpointFound { endpoint } => (1, endpoint.as_str(), (0, "")),
                OperationOutcome::EndpointNotReady => (2, "", (0, "")),
                OperationOutcome::BootstrapStarted { session } => (3, session.as_str(), (0, "")),
                OperationOutcome::BootstrapCancelled => (4, "", (0, "")),
                OperationOutcome::LeaseDestroyed => (5, "", (0, "")),
                _ => return None,
            };
            (text.len() <= TEXT_MAX && endpoint.1.len() <= TEXT_MAX).then_some(Self {
                variant,
                text,
                endpoint,
            })
        }
    }

    /// Whether an outcome of `variant` carries a text.
    #[inline]
    fn has_text(variant: u8) -> bool {
        matches!(variant, 0 | 1 | 3)
    }

    /// Appends `r`, kept compact, with its `outcome` ([`Outcome::of`] of
    /// its own) and the fold's `answer`; `group` is its group's place.
    #[inline(always)]
    pub(super) fn keep_result(
        buf: &mut Vec<u8>,
        r: &OperationResult,
        group: u32,
        outcome: Outcome<'_>,
        answer: Folded,
    ) {
        let mut head = [0; RESULT_HEAD];
        head[..4].copy_from_slice(&tag::RESULT.to_le_bytes());
        head[4..8].copy_from_slice(&group.to_le_bytes());
        head[8..12].copy_from_slice(&r.node.index.to_le_bytes());
        head[12..20].copy_from_slice(&r.op.attempt.0.to_le_bytes());
        head[20..28].copy_from_slice(&r.op.seq.to_le_bytes());
        head[28] = outcome.variant;
        head[29] = outcome.endpoint.0;
        head[30] = answer_code(answer);
        // `Outcome::of` let no longer text through.
        head[31] = outcome.text.len() as u8;
        buf.extend_from_slice(&head);
        buf.extend_from_slice(outcome.text.as_bytes());
        if outcome.endpoint.0 == 2 {
            let e = outcome.endpoint.1;
            buf.push(e.len() as u8);
            buf.extend_from_slice(e.as_bytes());
        }
    }

    /// Whether `obs` can be kept compact: not a failure (its words are
    /// written at once), and its session no longer than [`TEXT_MAX`].
    #[inline]
    pub(super) fn keeps(obs: &BootstrapObservation) -> bool {
        !matches!(obs.event, BootstrapEvent::Failed { .. })
            && obs.session.as_str().len() <= TEXT_MAX
    }

    /// Appends `obs` ([`keeps`] it), kept compact, with the fold's
    /// `answer`; `group` is its group's place.
    #[inline(always)]
    pub(super) fn keep_observation(
        buf: &mut Vec<u8>,
        obs: &BootstrapObservation,
        group: u32,
        answer: Folded,
    ) {
        let (variant, stage) = match obs.event {
            BootstrapEvent::Stage(stage) => (0, stage as u8),
            BootstrapEvent::SwactorJoined => (1, 0),
            // A failure is never kept (see `keeps`).
            BootstrapEvent::Closed | BootstrapEvent::Failed { .. } => (2, 0),
        };
        let session = obs.session.as_str();
        let mut head = [0; OBSERVATION_HEAD];
        head[..4].copy_from_slice(&tag::OBSERVATION.to_le_bytes());
        head[4..8].copy_from_slice(&group.to_le_bytes());
        head[8..12].copy_from_slice(&obs.node.index.to_le_bytes());
        head[12..20].copy_from_slice(&obs.attempt.0.to_le_bytes());
        head[20] = variant;
        head[21] = stage;
        head[22] = answer_code(answer);
        // `keeps` let no longer session through.
        head[23] = session.len() as u8;
        buf.extend_from_slice(&head);
        buf.extend_from_slice(session.as_bytes());
    }

    #[inline]
    fn u32_at(b: &[u8], at: usize) -> u32 {
        let mut w = [0; 4];
        w.copy_from_slice(&b[at..at + 4]);
        u32::from_le_bytes(w)
    }

    #[inline]
    pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
        let mut w = [0; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    }

    /// Begins the frame of an input of `variant` kept at the start of
    /// `raw`: both kinds hold their slot (its group's place and its index)
    /// and their attempt in the same places, and serde shows them first.
    #[inline]
    fn begin(s: &mut Scratch, variant: u8, raw: &[u8], groups: &[GroupId]) {
        s.start();
        s.small(variant);
        s.text(groups[u32_at(raw, 4) as usize].as_str().as_bytes());
        s.varint(u64::from(u32_at(raw, 8)));
        s.varint(u64_at(raw, 12));
    }

    /// Appends the frame of the observation kept at the start of `raw`,
    /// given `now`; the bytes it was kept in.
    pub(super) fn observation(
        s: &mut Scratch,
        raw: &[u8],
        groups: &[GroupId],
        now: u64,
        out: &mut Vec<u8>,
    ) -> usize {
        let len = OBSERVATION_HEAD + usize::from(raw[23]);
        begin(s, BOOTSTRAP, raw, groups);
        s.text(&raw[OBSERVATION_HEAD..len]);
        s.small(raw[20]);
        if raw[20] == 0 {
            s.small(raw[21]);
        }
        s.varint(now);
        s.answer(raw[22]);
        s.finish(out);
        len
    }

    /// Appends the frame of the result kept at the start of `raw`, given
    /// `now`; the bytes it was kept in.
    pub(super) fn result(
        s: &mut Scratch,
        raw: &[u8],
        groups: &[GroupId],
        now: u64,
        out: &mut Vec<u8>,
    ) -> usize {
        let variant = raw[28];
        let mut len = RESULT_HEAD + usize::from(raw[31]);
        begin(s, RESULT, raw, groups);
        s.varint(u64_at(raw, 20));
        s.small(variant);
        if has_text(variant) {
            s.text(&raw[RESULT_HEAD..len]);
        }
        match raw[29] {
            0 => {}
            1 => s.small(0),
            _ => {
                s.small(1);
                let at = len + 1;
                len = at + usize::from(raw[len]);
                s.text(&raw[at..len]);
            }
        }
        s.varint(now);
        s.answer(raw[30]);
        s.finish(out);
        len
    }

    /// A frame put together on the stack and appended in one copy (a
    /// capacity check for every byte would cost more than the bytes).
    pub(super) struct Scratch {
        bytes: [u8; MAX],
        len: usize,
    }

    impl Scratch {
        pub(super) fn new() -> Self {
            Self {
                bytes: [0; MAX],
                len: 4,
            }
        }

        /// Begins a frame, after room for its length.
        #[inline]
        fn start(&mut self) {
            self.len = 4;
        }

        /// Appends the frame, with its length first.
        #[inline]
        fn finish(&mut self, out: &mut Vec<u8>) {
            let len = (self.len - 4) as u32;
            self.bytes[..4].copy_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&self.bytes[..self.len]);
        }

        /// Writes a varint.
        #[inline(always)]
        fn varint(&mut self, mut v: u64) {
            let at = self.len;
            // Most are below 2^21 (an index, an attempt, a time in ms):
            // written without a loop.
            if v < 0x80 {
                self.bytes[at] = v as u8;
                self.len = at + 1;
            } else if v < 0x4000 {
                self.bytes[at] = v as u8 | 0x80;
                self.bytes[at + 1] = (v >> 7) as u8;
                self.len = at + 2;
            } else if v < 0x20_0000 {
                self.bytes[at] = v as u8 | 0x80;
                self.bytes[at + 1] = (v >> 7) as u8 | 0x80;
                self.bytes[at + 2] = (v >> 14) as u8;
                self.len = at + 3;
            } else {
                let mut at = at;
                while v >= 0x80 {
                    self.bytes[at] = (v & 0x7f) as u8 | 0x80;
                    v >>= 7;
                    at += 1;
                }
                self.bytes[at] = v as u8;
                self.len = at + 1;
            }
        }

        /// Writes a small number (a variant's index).
        #[inline]
        fn small(&mut self, v: u8) {
            self.bytes[self.len] = v;
            self.len += 1;
        }

        /// Writes a text's length and bytes (at most [`TEXT_MAX`] of them:
        /// [`MAX`] has room for three).
        #[inline(always)]
        fn text(&mut self, t: &[u8]) {
            self.varint(t.len() as u64);
            self.bytes[self.len..self.len + t.len()].copy_from_slice(t);
            self.len += t.len();
        }

        /// Writes a kept answer ([`answer_code`]) as [`coded`] does.
        #[inline]
        fn answer(&mut self, code: u8) {
            let (bytes, len) = coded(code);
            self.bytes[self.len..self.len + len].copy_from_slice(&bytes[..len]);
            self.len += len;
        }
    }

    /// A fold's answer as postcard writes `Answer::Folded` of it: the
    /// variants' indices and a discard's reason (a test checks every one),
    /// and how many of the three bytes that takes.
    #[inline]
    pub(super) fn folded(answer: Folded) -> ([u8; 3], usize) {
        coded(answer_code(answer))
    }

    /// [`folded`] of the answer kept as `code` ([`answer_code`]): the one
    /// place that knows those bytes.
    #[inline]
    fn coded(code: u8) -> ([u8; 3], usize) {
        if code == APPLIED_CODE {
            ([0, 0, 0], 2)
        } else {
            ([0, 1, code], 3)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::id::{GroupId, LeaseId, NodeEndpoint, SessionId};
        use crate::state::BootstrapStage;

        /// A recording of one host's header and `frames`.
        fn recording_of(frames: &[u8]) -> Vec<u8> {
            let core = crate::Driver::new(RunId::new("r"), ReconcilerConfig::default()).unwrap();
            let (_, mut bytes) = record(
                core,
                HostConfig::default(),
                None,
                "test".into(),
                1_000,
                Timestamp(5),
            )
            .unwrap();
            bytes.extend_from_slice(frames);
            bytes
        }

        /// Records `input` with `out` as its answer.
        fn keep(rec: &mut Recorder, input: &FlightInput<'_>, out: &Result<Folded, DriverError>) {
            match input {
                FlightInput::Result { result, now } => rec.keep_result(result, *now, out),
                FlightInput::Bootstrap { obs, now } => rec.keep_observation(obs, *now, out),
                _ => unreachable!("only results and observations are kept"),
            }
        }

        /// Whether `input` is kept compact when its fold goes through: not
        /// a failure, and no id in it longer than a byte can say.
        fn compact(input: &FlightInput<'_>) -> bool {
            match input {
                FlightInput::Result { result, .. } => Outcome::of(&result.outcome).is_some(),
                FlightInput::Bootstrap { obs, .. } => {
                    keeps(obs) && obs.node.group.as_str().len() <= TEXT_MAX
                }
                _ => false,
            }
        }

        /// Kept compact or written at once, a recorder writes its frame as
        /// postcard writes it, and the frame reads back.
        fn same_as_postcard(input: FlightInput<'_>) {
            let slow = postcard::to_allocvec(&input).unwrap();
            for out in super::super::tests::answers() {
                let mut rec = Recorder::new(usize::MAX);
                keep(&mut rec, &input, &out);
                // Compact exactly when it went through and fits: its time
                // first, then it.
                let kept = compact(&input) && out.is_ok();
                let head = u32::from_le_bytes(rec.batch.bytes[..4].try_into().unwrap());
                assert_eq!(head == tag::NOW, kept, "{input:?} {out:?}");
                let written = rec.batch.to_bytes();
                let answer = postcard::to_allocvec(&Answer::of_fold(&out)).unwrap();
                let len = slow.len() + answer.len();
                assert_eq!(written[..4], (len as u32).to_le_bytes(), "{input:?}");
                assert_eq!(written.len(), 4 + len, "{input:?}");
                assert_eq!(&written[4..4 + slow.len()], slow, "{input:?}");
                assert_eq!(&written[4 + slow.len()..], answer, "{input:?}");
                let bytes = recording_of(&written);
                let read = Recording::read(&bytes).unwrap();
                let frame = read.frames().next().unwrap().unwrap();
                assert_eq!(frame.answer, Answer::of_fold(&out));
                assert_eq!(rec.stats.frames, 1);
                assert_eq!(rec.stats.bytes, rec.batch.held() as u64);
                // The same bytes as postcard writes through the recorder.
                let mut rec = Recorder::new(usize::MAX);
                rec.begin(&input);
                rec.end_fold(&out);
                assert_eq!(rec.batch.to_bytes(), written, "{input:?}");
            }
            let back: FlightInput<'_> = postcard::from_bytes(&slow).unwrap();
            assert_eq!(back, input);
        }

        #[test]
        fn results_and_observations_are_written_as_postcard_writes_them() {
            let node = LogicalNodeId::new(GroupId::new("gpu-workers"), 300);
            let times = [
                0,
                127,
                128,
                16_383,
                16_384,
                (1 << 21) - 1,
                1 << 21,
                (1 << 28) - 1,
                1 << 28,
                u64::MAX,
            ];
            let stages = [
                BootstrapStage::SshConnect,
                BootstrapStage::BootCheck,
                BootstrapStage::SwactorStart,
                BootstrapStage::Join,
                BootstrapStage::Converged,
                BootstrapStage::SshConnectFailed,
                BootstrapStage::BootCheckFailed,
                BootstrapStage::SwactorStartFailed,
                BootstrapStage::JoinFailed,
                BootstrapStage::AgentLost,
            ];
            for (i, &t) in times.iter().enumerate() {
                let attempt = NodeAttemptId(t.rotate_left(i as u32));
                let now = Timestamp(t);
                let mut events = vec![
                    BootstrapEvent::SwactorJoined,
                    BootstrapEvent::Closed,
                    BootstrapEvent::Failed {
                        stage: BootstrapStage::SshConnect,
                        reason: "connection refused".into(),
                    },
                ];
                events.extend(stages.map(BootstrapEvent::Stage));
                for event in events {
                    same_as_postcard(FlightInput::Bootstrap {
                        obs: Cow::Owned(BootstrapObservation {
                            node,
                            attempt,
                            session: SessionId::new(format!("session-{t}-{}", "x".repeat(i * 40))),
                            event,
                        }),
                        now,
                    });
                }
                let outcomes = [
                    OperationOutcome::LeaseCreated {
                        lease: LeaseId::new("lease-1"),
                        endpoint: None,
                    },
                    OperationOutcome::LeaseCreated {
                        lease: LeaseId::new("l"),
                        endpoint: Some(NodeEndpoint::new(
                            "local:/tmp/a very long endpoint indeed, past 24 bytes",
                        )),
                    },
                    OperationOutcome::EndpointFound {
                        endpoint: NodeEndpoint::new("10.0.0.1:22"),
                    },
                    OperationOutcome::EndpointNotReady,
                    OperationOutcome::BootstrapStarted {
                        session: SessionId::new("s#pid1"),
                    },
                    OperationOutcome::BootstrapCancelled,
                    OperationOutcome::LeaseDestroyed,
                    OperationOutcome::Failed {
                        class: crate::observe::FailureClass::Definite,
                        reason: "quota".into(),
                    },
                    // The longest ids kept compact, and the shortest not.
                    OperationOutcome::LeaseCreated {
                        lease: LeaseId::new("l".repeat(255)),
                        endpoint: Some(NodeEndpoint::new("e".repeat(255))),
                    },
                    OperationOutcome::LeaseCreated {
                        lease: LeaseId::new("l".repeat(256)),
                        endpoint: None,
                    },
                    OperationOutcome::LeaseCreated {
                        lease: LeaseId::new("l"),
                        endpoint: Some(NodeEndpoint::new("e".repeat(256))),
                    },
                    OperationOutcome::EndpointFound {
                        endpoint: NodeEndpoint::new("e".repeat(256)),
                    },
                ];
                // A group named at length, kept compact or not.
                let long = LogicalNodeId::new(GroupId::new(&"g".repeat(255 + i % 2)), 7);
                same_as_postcard(FlightInput::Bootstrap {
                    obs: Cow::Owned(BootstrapObservation {
                        node: long,
                        attempt,
                        session: SessionId::new("s"),
                        event: BootstrapEvent::Closed,
                    }),
                    now,
                });
                for outcome in outcomes {
                    same_as_postcard(FlightInput::Result {
                        result: Cow::Owned(OperationResult {
                            node,
                            op: OperationId { attempt, seq: t },
                            outcome,
                        }),
                        now,
                    });
                }
            }
        }
    }
}

/// Appends an encoding to a buffer in place.
struct Append<'v>(&'v mut Vec<u8>);

impl postcard::ser_flavors::Flavor for Append<'_> {
    type Output = ();

    #[inline]
    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    #[inline]
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        // Most pieces are a varint or a short id: a call to copy each
        // would cost more than the bytes.
        if data.len() <= 8 {
            for &b in data {
                self.0.push(b);
            }
        } else {
            self.0.extend_from_slice(data);
        }
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// A [`Host`] whose every change is recorded. See the module's docs.
pub struct Flight<C: Reconciler> {
    host: Host<C>,
    rec: Option<Recorder>,
}

impl<C: Reconciler> std::ops::Deref for Flight<C> {
    type Target = Host<C>;
    fn deref(&self) -> &Host<C> {
        &self.host
    }
}

impl<C: Reconciler> fmt::Debug for Flight<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Flight")
            .field("recording", &self.rec.is_some())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The header of a recording and its host, built together so the header
/// names exactly what the host was built from.
///
/// # Errors
/// As [`Host::new`].
pub fn record<C: Reconciler>(
    core: C,
    config: HostConfig,
    resume: Option<JournalImage>,
    build: String,
    wall_ms: u64,
    now: Timestamp,
) -> Result<(Flight<C>, Vec<u8>), HostError> {
    let header = FlightHeader {
        build,
        run_id: core.state().run_id.clone(),
        reconciler: core.config().clone(),
        host: config.clone(),
        resume: resume.clone(),
        wall_ms,
        now,
    };
    let host = Host::new(core, config, resume)?;
    Ok((
        Flight {
            host,
            rec: Some(Recorder::new(usize::MAX)),
        },
        encode_header(&header),
    ))
}

/// The start of a recording: [`MAGIC`], the format, and the header.
pub fn encode_header(header: &FlightHeader) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&FLIGHT_FORMAT.to_le_bytes());
    // JSON, as the shape in an apply: some of what it holds (the journal's
    // meta, a shape's lifetime) leaves out fields at their defaults, which
    // only a format that names its fields reads back.
    let body = serde_json::to_vec(header).unwrap_or_default();
    out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Records `$input` (which may borrow what `$call` then consumes: the
/// borrow ends once the input is written), makes the call, and records the
/// digest of its answer (by `$digest`, [`digest`] unless named), or with
/// `fold`, the fold's answer itself.
macro_rules! recorded {
    ($self:ident, $input:expr, $call:expr) => {
        recorded!($self, $input, $call, digest)
    };
    ($self:ident, $input:expr, $call:expr, $digest:expr) => {
        recorded!(@ $self, $input, $call, |rec: &mut Recorder, out| rec.end_digest($digest(out)))
    };
    (fold $self:ident, $input:expr, $call:expr) => {
        recorded!(@ $self, $input, $call, |rec: &mut Recorder, out| rec.end_fold(out))
    };
    (@ $self:ident, $input:expr, $call:expr, $end:expr) => {{
        if let Some(rec) = &mut $self.rec {
            rec.begin(&$input);
        }
        let out = $call;
        if let Some(rec) = &mut $self.rec {
            ($end)(rec, &out);
        }
        out
    }};
}

impl<C: Reconciler> Flight<C> {
    /// A host that records nothing (a test, or a daemon told not to).
    pub fn unrecorded(host: Host<C>) -> Self {
        Self { host, rec: None }
    }

    /// Whether it records.
    pub fn is_recording(&self) -> bool {
        self.rec.is_some()
    }

    /// The most bytes of frames held until [`Flight::take_frames`]; a frame
    /// past it is dropped, counted, and ends the recording with
    /// [`CUT_MARKER`] (one frame always fits an empty buffer).
    pub fn set_buffer_max(&mut self, max: usize) {
        if let Some(rec) = &mut self.rec {
            rec.max = max;
        }
    }

    /// The frames recorded since the last call, to be appended to the
    /// recording ([`FlightBatch::write_to`]); swaps in `spare` (cleared) to
    /// record the next ones in.
    pub fn take_frames(&mut self, mut spare: FlightBatch) -> FlightBatch {
        spare.clear();
        match &mut self.rec {
            Some(rec) => std::mem::replace(&mut rec.batch, spare),
            None => spare,
        }
    }

    /// The bytes the frames recorded since the last
    /// [`Flight::take_frames`] hold in memory.
    #[inline]
    pub fn held(&self) -> usize {
        self.rec.as_ref().map_or(0, |r| r.batch.held())
    }

    /// Counts a frame not recorded because the recording was cut.
    #[cold]
    fn dropped(&mut self) {
        if let Some(rec) = &mut self.rec {
            rec.stats.dropped += 1;
        }
    }

    /// The counters.
    pub fn stats(&self) -> FlightStats {
        self.rec.as_ref().map(|r| r.stats).unwrap_or_default()
    }

    /// The host, for a caller that reads it.
    pub fn host(&self) -> &Host<C> {
        &self.host
    }

    /// See [`Host::handle_inventory`].
    pub fn handle_inventory(&mut self, listed: Result<Vec<Listed>, String>, now: Timestamp) {
        recorded!(
            self,
            FlightInput::Inventory {
                listed: Cow::Borrowed(&listed),
                now,
            },
            self.host.handle_inventory(listed, now)
        );
    }

    /// See [`Host::handle_apply`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_apply(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        recorded!(
            self,
            FlightInput::Apply {
                shape: Cow::Borrowed(shape),
                ticket,
                now
            },
            self.host.handle_apply(shape, ticket, now)
        )
    }

    /// See [`Host::handle_apply_next`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_apply_next(
        &mut self,
        shape: &ClusterShape,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<DesiredUpdate, ApplyError> {
        recorded!(
            self,
            FlightInput::ApplyNext {
                shape: Cow::Borrowed(shape),
                ticket,
                now
            },
            self.host.handle_apply_next(shape, ticket, now)
        )
    }

    /// See [`Host::handle_pause`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_pause(
        &mut self,
        paused: bool,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<bool, PauseError> {
        recorded!(
            self,
            FlightInput::Pause {
                paused,
                ticket,
                now
            },
            self.host.handle_pause(paused, ticket, now)
        )
    }

    /// See [`Host::handle_wait_converged`].
    pub fn handle_wait_converged(&mut self, ticket: Ticket) {
        recorded!(
            self,
            FlightInput::WaitConverged { ticket },
            self.host.handle_wait_converged(ticket)
        );
    }

    /// See [`Host::handle_wait_adopted`].
    pub fn handle_wait_adopted(&mut self, ticket: Ticket) {
        recorded!(
            self,
            FlightInput::WaitAdopted { ticket },
            self.host.handle_wait_adopted(ticket)
        );
    }

    /// See [`Host::handle_shutdown`].
    pub fn handle_shutdown(&mut self, mode: ShutdownMode, ticket: Ticket, now: Timestamp) {
        recorded!(
            self,
            FlightInput::Shutdown { mode, ticket, now },
            self.host.handle_shutdown(mode, ticket, now)
        );
    }

    /// See [`Host::handle_persisted`].
    pub fn handle_persisted(&mut self, seq: u64) {
        recorded!(
            self,
            FlightInput::Persisted { seq },
            self.host.handle_persisted(seq)
        );
    }

    /// See [`Host::handle_result`].
    ///
    /// # Errors
    /// As the host's.
    #[inline]
    pub fn handle_result(
        &mut self,
        result: OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let Some(rec) = self.rec.as_mut().filter(|r| !r.cut) else {
            self.dropped();
            return self.host.handle_result(result, now);
        };
        // The host only borrows it (and copies what it keeps), and so
        // does the recording.
        let out = self.host.handle_result_ref(&result, now);
        rec.keep_result(&result, now, &out);
        out
    }

    /// See [`Host::handle_submit_failed`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        recorded!(
            fold self,
            FlightInput::SubmitFailed {
                node: *node,
                op,
                reason: Cow::Borrowed(reason),
                now
            },
            self.host.handle_submit_failed(node, op, reason, now)
        )
    }

    /// See [`Host::handle_bootstrap`].
    ///
    /// # Errors
    /// As the host's.
    #[inline]
    pub fn handle_bootstrap(
        &mut self,
        obs: BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        let Some(rec) = self.rec.as_mut().filter(|r| !r.cut) else {
            self.dropped();
            return self.host.handle_bootstrap(obs, now);
        };
        // The host only borrows it (and copies what it keeps), and so
        // does the recording.
        let out = self.host.handle_bootstrap_ref(&obs, now);
        rec.keep_observation(&obs, now, &out);
        out
    }

    /// See [`Host::handle_agent_joined`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_agent_joined(
        &mut self,
        key: &ResourceKey,
        now: Timestamp,
    ) -> Result<Liveness, JoinRefused> {
        recorded!(
            self,
            FlightInput::AgentJoined {
                key: Cow::Borrowed(key),
                now
            },
            self.host.handle_agent_joined(key, now)
        )
    }

    /// See [`Host::handle_agent_gone`].
    pub fn handle_agent_gone(&mut self, key: &ResourceKey, silent_ms: u64, now: Timestamp) {
        recorded!(
            self,
            FlightInput::AgentGone {
                key: Cow::Borrowed(key),
                silent_ms,
                now
            },
            self.host.handle_agent_gone(key, silent_ms, now)
        );
    }

    /// See [`Host::handle_leadership`].
    pub fn handle_leadership(&mut self, leadership: Leadership, now: Timestamp) {
        recorded!(
            self,
            FlightInput::Leadership { leadership, now },
            self.host.handle_leadership(leadership, now)
        );
    }

    /// See [`Host::handle_spent`].
    pub fn handle_spent(&mut self, spent_micros: u64) -> u64 {
        recorded!(
            self,
            FlightInput::Spent { spent_micros },
            self.host.handle_spent(spent_micros)
        )
    }

    /// See [`Host::handle_probed`].
    pub fn handle_probed(
        &mut self,
        key: &ResourceKey,
        paused: Result<bool, String>,
        now: Timestamp,
    ) {
        recorded!(
            self,
            FlightInput::Probed {
                key: Cow::Borrowed(key),
                paused: Cow::Borrowed(&paused),
                now,
            },
            self.host.handle_probed(key, paused, now)
        );
    }

    /// See [`Host::handle_replace`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_replace(
        &mut self,
        node: &LogicalNodeId,
        ticket: Ticket,
        now: Timestamp,
    ) -> Result<NodeAttemptId, ReplaceError> {
        recorded!(
            self,
            FlightInput::Replace {
                node: *node,
                ticket,
                now
            },
            self.host.handle_replace(node, ticket, now)
        )
    }

    /// See [`Host::handle_lane_lost`].
    pub fn handle_lane_lost(&mut self, lane: u32) {
        recorded!(
            self,
            FlightInput::LaneLost { lane },
            self.host.handle_lane_lost(lane)
        );
    }

    /// See [`Host::handle_collected`].
    pub fn handle_collected(
        &mut self,
        key: &ResourceKey,
        outcome: Result<Release, String>,
        now: Timestamp,
    ) {
        recorded!(
            self,
            FlightInput::Collected {
                key: Cow::Borrowed(key),
                outcome: Cow::Borrowed(&outcome),
                now,
            },
            self.host.handle_collected(key, outcome, now)
        );
    }

    /// See [`Host::handle_timeout`].
    ///
    /// # Errors
    /// As the host's.
    pub fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        recorded!(
            self,
            FlightInput::Timeout { now },
            self.host.handle_timeout(now)
        )
    }

    /// See [`Host::handle_starved`].
    pub fn handle_starved(&mut self, starved_ms: u64, now: Timestamp) {
        recorded!(
            self,
            FlightInput::Starved { starved_ms, now },
            self.host.handle_starved(starved_ms, now)
        );
    }

    /// See [`Host::handle_tick`].
    pub fn handle_tick(&mut self, now: Timestamp) {
        recorded!(self, FlightInput::Tick { now }, self.host.handle_tick(now));
    }

    /// See [`Host::handle_wall_clock`].
    pub fn handle_wall_clock(&mut self, wall_ms: u64, now: Timestamp) {
        recorded!(
            self,
            FlightInput::WallClock { wall_ms, now },
            self.host.handle_wall_clock(wall_ms, now)
        );
    }

    /// See [`Host::handle_lifetime`].
    pub fn handle_lifetime(
        &mut self,
        wall_ms: u64,
        jobs_running: bool,
        now: Timestamp,
    ) -> Option<Status> {
        recorded!(
            self,
            FlightInput::Lifetime {
                wall_ms,
                jobs_running,
                now
            },
            self.host.handle_lifetime(wall_ms, jobs_running, now)
        )
    }

    /// See [`Host::leads`].
    pub fn leads(&mut self, now: Timestamp) -> bool {
        recorded!(self, FlightInput::Leads { now }, self.host.leads(now))
    }

    /// See [`Host::poll_output`].
    pub fn poll_output(&mut self, now: Timestamp) -> Option<Output> {
        recorded!(
            self,
            FlightInput::PollOutput { now },
            self.host.poll_output(now),
            output_digest
        )
    }

    /// See [`Host::poll_event`].
    pub fn poll_event(&mut self) -> Option<HostEvent> {
        recorded!(self, FlightInput::PollEvent, self.host.poll_event())
    }
}

/// Why a recording could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlightError {
    /// Not a recording.
    #[error("not a flight recording (it does not start with SWFLIGHT)")]
    NotARecording,
    /// Of another format version.
    #[error(
        "this recording is of format version {found}; this build reads version {FLIGHT_FORMAT} only"
    )]
    Format {
        /// The recording's version.
        found: u32,
    },
    /// The header could not be decoded.
    #[error("the recording's header cannot be read: {0}")]
    Header(String),
    /// A frame could not be decoded (not a cut-off end: that ends the
    /// recording).
    #[error("frame {index} (at byte {offset}) cannot be read: {reason}")]
    Frame {
        /// Its index.
        index: u64,
        /// Where it starts.
        offset: usize,
        /// Why.
        reason: String,
    },
}

/// A recording read from bytes: its header, and its frames in order.
#[derive(Debug)]
pub struct Recording<'b> {
    /// What its host was built from.
    pub header: FlightHeader,
    frames: &'b [u8],
}

impl<'b> Recording<'b> {
    /// Reads a recording's header.
    ///
    /// # Errors
    /// Not a recording, of another format, or a header that cannot be read.
    pub fn read(bytes: &'b [u8]) -> Result<Self, FlightError> {
        let rest = bytes
            .strip_prefix(MAGIC.as_slice())
            .ok_or(FlightError::NotARecording)?;
        let (format, rest) = split_u32(rest).ok_or(FlightError::NotARecording)?;
        if format != FLIGHT_FORMAT {
            return Err(FlightError::Format { found: format });
        }
        let (len, rest) = split_u32(rest).ok_or_else(|| FlightError::Header("cut off".into()))?;
        let len = len as usize;
        if rest.len() < len {
            return Err(FlightError::Header("cut off".into()));
        }
        let header =
            serde_json::from_slice(&rest[..len]).map_err(|e| FlightError::Header(e.to_string()))?;
        Ok(Self {
            header,
            frames: &rest[len..],
        })
    }

    /// Its frames: each input with the digest of what the host answered.
    /// A frame cut off at the end (the daemon died mid-write) ends them.
    pub fn frames(&self) -> Frames<'b> {
        Frames {
            rest: self.frames,
            offset: 0,
            index: 0,
            cut: false,
            torn: false,
        }
    }
}

fn split_u32(b: &[u8]) -> Option<(u32, &[u8])> {
    let (head, rest) = b.split_first_chunk::<4>()?;
    Some((u32::from_le_bytes(*head), rest))
}

/// A frame length that is no frame: the recorder wrote it where it had to
/// drop frames (its writer fell behind, or the recording reached its
/// limit), and wrote nothing more. A recording ends there, cut.
pub const CUT_MARKER: u32 = u32::MAX;

/// The frames of a [`Recording`].
#[derive(Debug)]
pub struct Frames<'b> {
    rest: &'b [u8],
    offset: usize,
    index: u64,
    cut: bool,
    torn: bool,
}

impl Frames<'_> {
    /// Whether the recording ended at a [`CUT_MARKER`] (so far).
    pub fn was_cut(&self) -> bool {
        self.cut
    }

    /// Whether the recording ended in a frame half written: one still
    /// being written, or one whose daemon stopped mid-write or whose disk
    /// filled.
    pub fn was_torn(&self) -> bool {
        self.torn
    }
}

/// One recorded call: its input, and what it returned.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame<'b> {
    /// Its index in the recording, from 0.
    pub index: u64,
    /// The input.
    pub input: FlightInput<'b>,
    /// The host's answer, as the recording keeps it.
    pub answer: Answer,
}

impl<'b> Iterator for Frames<'b> {
    type Item = Result<Frame<'b>, FlightError>;

    fn next(&mut self) -> Option<Self::Item> {
        let Some((len, rest)) = split_u32(self.rest) else {
            // Not even a whole length: torn too, unless nothing is left.
            self.torn = !self.rest.is_empty();
            self.rest = &[];
            return None;
        };
        if len == CUT_MARKER {
            self.cut = true;
            self.rest = &[];
            return None;
        }
        let len = len as usize;
        if rest.len() < len {
            // Cut off mid-write: the recording ends here.
            self.rest = &[];
            self.torn = true;
            return None;
        }
        let (body, rest) = rest.split_at(len);
        let index = self.index;
        let offset = self.offset;
        self.rest = rest;
        self.offset += 4 + len;
        self.index += 1;
        let bad = |reason: String| FlightError::Frame {
            index,
            offset,
            reason,
        };
        let (input, answer) = match postcard::take_from_bytes::<FlightInput<'b>>(body) {
            Ok(read) => read,
            Err(e) => return Some(Err(bad(e.to_string()))),
        };
        let answer = if input.keeps_fold() {
            match postcard::from_bytes::<Answer>(answer) {
                Ok(answer) => answer,
                Err(e) => return Some(Err(bad(format!("its answer: {e}")))),
            }
        } else {
            match <[u8; 8]>::try_from(answer) {
                Ok(d) => Answer::Digest(u64::from_le_bytes(d)),
                Err(_) => {
                    return Some(Err(bad(format!(
                        "its answer's digest is {} bytes, not 8",
                        answer.len()
                    ))));
                }
            }
        };
        Some(Ok(Frame {
            index,
            input,
            answer,
        }))
    }
}

/// Where a replay first decided otherwise than the recorded host.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "input {index} ({input}) was answered otherwise than recorded: the recording kept {recorded}, the replay answered {replayed}"
)]
pub struct Divergence {
    /// The input's index.
    pub index: u64,
    /// The input, for people.
    pub input: String,
    /// What the recording kept of the answer, for people.
    pub recorded: String,
    /// What the replaying host answered, for people.
    pub replayed: String,
}

/// A fresh host fed a recording's inputs one at a time.
pub struct Replayer<C: Reconciler> {
    host: Host<C>,
    next: u64,
}

impl<C: Reconciler> fmt::Debug for Replayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replayer")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl<C: Reconciler> Replayer<C> {
    /// A host built as the recorded one was, around `core` (built from
    /// [`FlightHeader::reconciler`] for the run).
    ///
    /// # Errors
    /// As [`Host::new`].
    pub fn new(header: &FlightHeader, core: C) -> Result<Self, HostError> {
        Ok(Self {
            host: Host::new(core, header.host.clone(), header.resume.clone())?,
            next: 0,
        })
    }

    /// The host as the inputs so far left it.
    pub fn host(&self) -> &Host<C> {
        &self.host
    }

    /// The index of the next input.
    pub fn next_index(&self) -> u64 {
        self.next
    }

    /// Feeds one input and checks the answer against `recorded`.
    ///
    /// # Errors
    /// The host answered otherwise.
    pub fn step(&mut self, input: &FlightInput<'_>, recorded: Answer) -> Result<(), Divergence> {
        let index = self.next;
        self.next += 1;
        let h = &mut self.host;
        let check = |out: &dyn ErasedAnswer| -> Result<(), Divergence> {
            if out.answer() == recorded {
                Ok(())
            } else {
                Err(Divergence {
                    index,
                    input: input.describe(),
                    recorded: recorded.describe(),
                    replayed: out.show(),
                })
            }
        };
        match input.clone() {
            FlightInput::Inventory { listed, now } => {
                h.handle_inventory(listed.into_owned(), now);
                check(&())
            }
            FlightInput::Apply { shape, ticket, now } => {
                check(&h.handle_apply(&shape, ticket, now))
            }
            FlightInput::ApplyNext { shape, ticket, now } => {
                check(&h.handle_apply_next(&shape, ticket, now))
            }
            FlightInput::Pause {
                paused,
                ticket,
                now,
            } => check(&h.handle_pause(paused, ticket, now)),
            FlightInput::WaitConverged { ticket } => {
                h.handle_wait_converged(ticket);
                check(&())
            }
            FlightInput::WaitAdopted { ticket } => {
                h.handle_wait_adopted(ticket);
                check(&())
            }
            FlightInput::Shutdown { mode, ticket, now } => {
                h.handle_shutdown(mode, ticket, now);
                check(&())
            }
            FlightInput::Persisted { seq } => {
                h.handle_persisted(seq);
                check(&())
            }
            FlightInput::Result { result, now } => {
                check(&Fold(h.handle_result(result.into_owned(), now)))
            }
            FlightInput::SubmitFailed {
                node,
                op,
                reason,
                now,
            } => check(&Fold(h.handle_submit_failed(&node, op, &reason, now))),
            FlightInput::Bootstrap { obs, now } => {
                check(&Fold(h.handle_bootstrap(obs.into_owned(), now)))
            }
            FlightInput::AgentJoined { key, now } => check(&h.handle_agent_joined(&key, now)),
            FlightInput::AgentGone {
                key,
                silent_ms,
                now,
            } => {
                h.handle_agent_gone(&key, silent_ms, now);
                check(&())
            }
            FlightInput::Leadership { leadership, now } => {
                h.handle_leadership(leadership, now);
                check(&())
            }
            FlightInput::Spent { spent_micros } => check(&h.handle_spent(spent_micros)),
            FlightInput::Probed { key, paused, now } => {
                h.handle_probed(&key, paused.into_owned(), now);
                check(&())
            }
            FlightInput::Replace { node, ticket, now } => {
                check(&h.handle_replace(&node, ticket, now))
            }
            FlightInput::LaneLost { lane } => {
                h.handle_lane_lost(lane);
                check(&())
            }
            FlightInput::Collected { key, outcome, now } => {
                h.handle_collected(&key, outcome.into_owned(), now);
                check(&())
            }
            FlightInput::Timeout { now } => check(&h.handle_timeout(now)),
            FlightInput::Starved { starved_ms, now } => {
                h.handle_starved(starved_ms, now);
                check(&())
            }
            FlightInput::Tick { now } => {
                h.handle_tick(now);
                check(&())
            }
            FlightInput::WallClock { wall_ms, now } => {
                h.handle_wall_clock(wall_ms, now);
                check(&())
            }
            FlightInput::Lifetime {
                wall_ms,
                jobs_running,
                now,
            } => check(&h.handle_lifetime(wall_ms, jobs_running, now)),
            FlightInput::Leads { now } => check(&h.leads(now)),
            FlightInput::PollOutput { now } => check(&Polled(h.poll_output(now))),
            FlightInput::PollEvent => check(&h.poll_event()),
        }
    }
}

/// What [`Host::poll_output`] returned, digested by [`output_digest`].
struct Polled(Option<Output>);

impl ErasedAnswer for Polled {
    fn answer(&self) -> Answer {
        Answer::of_output(&self.0)
    }
    fn show(&self) -> String {
        self.0.show()
    }
}

/// What a fold returned, kept whole ([`Answer::of_fold`]).
struct Fold(Result<Folded, DriverError>);

impl ErasedAnswer for Fold {
    fn answer(&self) -> Answer {
        Answer::of_fold(&self.0)
    }
    fn show(&self) -> String {
        self.0.show()
    }
}

/// What a host call returned, as a recording keeps it or shown for people.
trait ErasedAnswer {
    fn answer(&self) -> Answer;
    fn show(&self) -> String;
}

impl<T: Serialize + fmt::Debug> ErasedAnswer for T {
    fn answer(&self) -> Answer {
        Answer::of(self)
    }
    fn show(&self) -> String {
        cut_for_people(format!("{self:?}"))
    }
}

/// An answer shown for people: at most 2,000 bytes of it, then `…`.
pub fn cut_for_people(mut s: String) -> String {
    if s.len() > 2_000 {
        let mut end = 2_000;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// What a whole replay went through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replayed {
    /// Inputs fed, every one answered as recorded.
    pub inputs: u64,
    /// The instant of the last input that named one.
    pub last: Option<Timestamp>,
    /// Whether the recording was cut ([`CUT_MARKER`]): the daemon went on
    /// past its last input unrecorded.
    pub cut: bool,
    /// Whether it ended in a frame half written ([`Frames::was_torn`]).
    pub torn: bool,
}

/// Why a whole replay stopped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The recording could not be read.
    #[error(transparent)]
    Read(#[from] FlightError),
    /// Its host could not be built.
    #[error("the recorded host cannot be built again: {0}")]
    Host(String),
    /// The replay decided otherwise.
    #[error(transparent)]
    Diverged(#[from] Divergence),
}

/// Replays a whole recording over a fresh host around the core `make`
/// builds from the header, calling `each` after every input with the host
/// as it left it.
///
/// # Errors
/// The recording cannot be read, its host cannot be built, or the first
/// input answered otherwise than recorded.
pub fn replay<C: Reconciler>(
    bytes: &[u8],
    make: impl FnOnce(&FlightHeader) -> Result<C, String>,
    mut each: impl FnMut(&Frame<'_>, &Host<C>),
) -> Result<Replayed, ReplayError> {
    let recording = Recording::read(bytes)?;
    let core = make(&recording.header).map_err(ReplayError::Host)?;
    let mut replayer =
        Replayer::new(&recording.header, core).map_err(|e| ReplayError::Host(e.to_string()))?;
    let mut last = None;
    let mut frames = recording.frames();
    for frame in frames.by_ref() {
        let frame = frame?;
        replayer.step(&frame.input, frame.answer)?;
        if let Some(now) = frame.input.now() {
            last = Some(now);
        }
        each(&frame, replayer.host());
    }
    Ok(Replayed {
        inputs: replayer.next_index(),
        last,
        cut: frames.was_cut(),
        torn: frames.was_torn(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Driver;
    use crate::id::{LeaseId, SessionId};
    use crate::state::BootstrapStage;

    /// Every answer a fold can give: applied, discarded for each reason,
    /// refused.
    pub(super) fn answers() -> Vec<Result<Folded, DriverError>> {
        use crate::observe::DiscardReason as R;
        let reasons = [
            R::UnknownNode,
            R::SupersededAttempt,
            R::StaleOperation,
            R::OutcomeMismatch,
            R::StaleSession,
            R::NotActive,
            R::NotLive,
            R::Queued,
        ];
        // A reason added later must be added above: this match stops
        // compiling until it is.
        for r in reasons {
            match r {
                R::UnknownNode
                | R::SupersededAttempt
                | R::StaleOperation
                | R::OutcomeMismatch
                | R::StaleSession
                | R::NotActive
                | R::NotLive
                | R::Queued => {}
            }
        }
        std::iter::once(Ok(Folded::Applied))
            .chain(reasons.map(|r| Ok(Folded::Discarded(r))))
            .chain([Err(DriverError::Reentry)])
            .collect()
    }

    #[test]
    fn a_folds_answer_is_kept_as_postcard_writes_it() {
        for out in answers() {
            // Written as postcard writes what `Answer::of_fold` keeps...
            let mut rec = Recorder::new(usize::MAX);
            rec.begin(&FlightInput::PollEvent);
            let start = rec.batch.bytes.len();
            rec.open = Some(0);
            rec.end_fold(&out);
            let kept = Answer::of_fold(&out);
            assert_eq!(
                rec.batch.bytes[start..],
                postcard::to_allocvec(&kept).unwrap(),
                "{out:?}"
            );
            // ...which is the fold's answer itself when it went through.
            match &out {
                Ok(folded) => assert_eq!(kept, Answer::Folded(*folded)),
                Err(_) => assert_eq!(kept, Answer::Digest(digest(&out))),
            }
        }
    }

    /// `bytes` replayed by a fresh driver; every answer as recorded.
    fn replayed(bytes: &[u8]) -> Replayed {
        replay(
            bytes,
            |h| Driver::new(h.run_id.clone(), h.reconciler.clone()).map_err(|e| e.to_string()),
            |_, _| {},
        )
        .unwrap()
    }

    fn recorded() -> (Flight<Driver>, Vec<u8>) {
        let core = Driver::new(RunId::new("r"), ReconcilerConfig::default()).unwrap();
        record(
            core,
            HostConfig::default(),
            None,
            "test".into(),
            1_000,
            Timestamp(5),
        )
        .unwrap()
    }

    #[test]
    fn a_frame_past_the_buffer_cuts_the_recording_and_nothing_after_it_is_kept() {
        let (mut flight, mut bytes) = recorded();
        flight.handle_inventory(Ok(Vec::new()), Timestamp(6));
        flight.handle_tick(Timestamp(7));
        flight
            .take_frames(FlightBatch::default())
            .write_to(&mut bytes);
        // One frame fits an empty buffer; the second does not.
        flight.set_buffer_max(1);
        flight.handle_tick(Timestamp(8));
        flight.handle_tick(Timestamp(9));
        flight.handle_tick(Timestamp(10));
        flight
            .take_frames(FlightBatch::default())
            .write_to(&mut bytes);
        flight.handle_tick(Timestamp(11));
        assert!(
            flight.take_frames(FlightBatch::default()).is_empty(),
            "nothing after the cut"
        );
        assert_eq!(flight.stats().frames, 3);
        assert_eq!(flight.stats().dropped, 3);
        let done = replayed(&bytes);
        assert_eq!(
            (done.inputs, done.cut, done.last),
            (3, true, Some(Timestamp(8)))
        );
    }

    #[test]
    fn kept_frames_are_written_in_order_among_the_others_and_a_cut_holds() {
        use crate::observe::OperationOutcome;
        let (mut flight, mut bytes) = recorded();
        let node = LogicalNodeId::new(GroupId::new("w"), 0);
        let result = |seq| OperationResult {
            node,
            op: OperationId {
                attempt: NodeAttemptId(1),
                seq,
            },
            outcome: OperationOutcome::LeaseDestroyed,
        };
        let observation = |event| BootstrapObservation {
            node,
            attempt: NodeAttemptId(1),
            session: SessionId::new("s"),
            event,
        };
        let stage = BootstrapEvent::Stage(BootstrapStage::SshConnect);
        let failed = BootstrapEvent::Failed {
            stage: BootstrapStage::SshConnect,
            reason: "refused".into(),
        };
        flight.handle_inventory(Ok(Vec::new()), Timestamp(6));
        // Results and observations, kept apart, come out in the order
        // they went in, among the frames written at once (a failure is).
        let first = flight.handle_result(result(1), Timestamp(7));
        assert!(
            flight
                .handle_bootstrap(observation(stage.clone()), Timestamp(7))
                .is_ok()
        );
        assert!(
            flight
                .handle_bootstrap(observation(BootstrapEvent::Closed), Timestamp(7))
                .is_ok()
        );
        assert!(flight.handle_result(result(2), Timestamp(7)).is_ok());
        assert!(
            flight
                .handle_bootstrap(observation(failed), Timestamp(8))
                .is_ok()
        );
        flight.handle_tick(Timestamp(8));
        assert!(
            flight
                .handle_bootstrap(observation(stage), Timestamp(9))
                .is_ok()
        );
        assert!(flight.handle_result(result(3), Timestamp(9)).is_ok());
        // Another group between two frames of the first, and back.
        let other = BootstrapObservation {
            node: LogicalNodeId::new(GroupId::new("v"), 3),
            ..observation(BootstrapEvent::SwactorJoined)
        };
        assert!(flight.handle_bootstrap(other.clone(), Timestamp(9)).is_ok());
        assert!(flight.handle_result(result(4), Timestamp(9)).is_ok());
        assert!(flight.handle_bootstrap(other, Timestamp(9)).is_ok());
        flight
            .take_frames(FlightBatch::default())
            .write_to(&mut bytes);
        // A kept frame fits an empty buffer; the tick after it does not,
        // and nothing is kept after the cut.
        flight.set_buffer_max(1);
        assert!(flight.handle_result(result(5), Timestamp(10)).is_ok());
        flight.handle_tick(Timestamp(11));
        assert!(flight.handle_result(result(6), Timestamp(12)).is_ok());
        let last = flight.take_frames(FlightBatch::default());
        assert!(last.held() > 0);
        last.write_to(&mut bytes);
        assert_eq!((flight.stats().frames, flight.stats().dropped), (13, 2));
        let read = Recording::read(&bytes).unwrap();
        let mut frames = read.frames();
        let seen: Vec<(&str, Option<u64>, Answer)> = frames
            .by_ref()
            .map(|f| {
                let f = f.unwrap();
                (f.input.kind(), f.input.now().map(|t| t.0), f.answer)
            })
            .collect();
        assert!(frames.was_cut());
        let folded = Answer::Folded(first.unwrap());
        let kinds: Vec<_> = seen.iter().map(|(k, t, _)| (*k, *t)).collect();
        assert_eq!(
            kinds,
            [
                ("inventory", Some(6)),
                ("result", Some(7)),
                ("bootstrap", Some(7)),
                ("bootstrap", Some(7)),
                ("result", Some(7)),
                ("bootstrap", Some(8)),
                ("tick", Some(8)),
                ("bootstrap", Some(9)),
                ("result", Some(9)),
                ("bootstrap", Some(9)),
                ("result", Some(9)),
                ("bootstrap", Some(9)),
                ("result", Some(10)),
            ]
        );
        let groups: Vec<_> = read
            .frames()
            .filter_map(|f| f.unwrap().input.node().map(|n| n.group.as_str()))
            .collect();
        assert_eq!(groups[7..11], ["v", "w", "v", "w"]);
        assert_eq!(seen[1].2, folded);
        let done = replayed(&bytes);
        assert_eq!(
            (done.inputs, done.cut, done.last),
            (13, true, Some(Timestamp(10)))
        );
    }

    #[test]
    fn a_request_is_digested_word_by_word_as_serde_shows_it() {
        let requests = [
            EffectRequest::LookupEndpoint {
                lease: LeaseId::new("lease-w-12"),
            },
            EffectRequest::CancelBootstrap {
                session: SessionId::new("a-session-id-longer-than-24-bytes"),
            },
            EffectRequest::DestroyLease {
                lease: LeaseId::new("l"),
                failed: None,
            },
            EffectRequest::DestroyLease {
                lease: LeaseId::new("lease-12345678"),
                failed: Some("the agent never joined".into()),
            },
        ];
        for request in &requests {
            let (mut fast, mut serde) = (digest::Hasher::new(), digest::Hasher::new());
            request_words(&mut fast, request);
            serde.value(request);
            assert_eq!(fast.finish(), serde.finish(), "{request:?}");
        }
        // And the words of one differ from another's.
        let (mut a, mut b) = (digest::Hasher::new(), digest::Hasher::new());
        request_words(&mut a, &requests[2]);
        request_words(&mut b, &requests[3]);
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn another_format_is_refused_with_both_versions_named() {
        let (_, mut bytes) = recorded();
        bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
        let e = Recording::read(&bytes).unwrap_err();
        assert_eq!(e, FlightError::Format { found: 7 });
        let text = e.to_string();
        assert!(
            text.contains("version 7") && text.contains(&format!("version {FLIGHT_FORMAT}")),
            "{text}"
        );
        assert_eq!(
            Recording::read(b"NOTAFLIGHT").unwrap_err(),
            FlightError::NotARecording
        );
    }
}
