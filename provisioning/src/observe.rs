//! Observation folding: turning executor results and bootstrap facts into observed state.
//!
//! Folding is the only place deadlines are computed. Each fold checks that the
//! input belongs to the node's current attempt (and current operation or
//! session) and discards it otherwise, so nothing of a superseded attempt ever
//! reaches a replacement. Every deadline is computed before anything is
//! mutated, so an overflow leaves the node exactly as it was.

use crate::config::ReconcilerConfig;
use crate::id::{LeaseId, LogicalNodeId, NodeAttemptId, NodeEndpoint, OperationId, SessionId};
use crate::state::{BootstrapStage, EffectKind, FailureCause, Intent, ManagedNode, NodeStage};
use crate::time::{DeadlineOverflow, Timestamp};
use serde::{Deserialize, Serialize};

/// How sure the executor is that a failed operation had no effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FailureClass {
    /// The operation certainly had no effect.
    Definite,
    /// The effect may or may not have happened (lost result, timeout, crash).
    Ambiguous,
    /// The provider is certain the lease the operation named no longer exists
    /// (deleted out of band, expired). The operation had no effect; the
    /// attempt cannot progress and fails, and its cleanup still runs
    /// (destroying an absent lease is success), so nothing is ever leaked on
    /// the provider's word alone.
    LeaseGone,
}

/// How a release (a session stopped, a lease destroyed) ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Release {
    /// Released, or there was nothing left to release.
    Done,
    /// The provider stopped trying without releasing it, because the
    /// machine it is on has not answered for longer than the provider
    /// waits. The slot no longer counts it, and the provider releases it
    /// when the machine answers again; until then it may still hold the
    /// machine. The words say which machine and why.
    GivenUp(String),
}

/// What an executed operation reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OperationOutcome {
    /// CreateLease succeeded (possibly by adopting an existing lease).
    LeaseCreated {
        /// The lease.
        lease: LeaseId,
        /// The endpoint, when the provider knows it already.
        endpoint: Option<NodeEndpoint>,
    },
    /// LookupEndpoint found the endpoint.
    EndpointFound {
        /// The endpoint.
        endpoint: NodeEndpoint,
    },
    /// LookupEndpoint: the lease exists but has no endpoint yet. A probe, not a failure.
    EndpointNotReady,
    /// StartBootstrap succeeded (possibly by adopting a running session).
    BootstrapStarted {
        /// The session.
        session: SessionId,
    },
    /// CancelBootstrap succeeded (or the session was already gone).
    BootstrapCancelled,
    /// DestroyLease succeeded (or the lease was already gone).
    LeaseDestroyed,
    /// The operation failed.
    Failed {
        /// Whether it may have had an effect.
        class: FailureClass,
        /// What went wrong, for people to read.
        reason: String,
    },
    /// CancelBootstrap gave the session up unstopped ([`Release::GivenUp`]):
    /// for the slot it is over, as after [`OperationOutcome::BootstrapCancelled`].
    BootstrapGivenUp {
        /// Where and why, for people to read.
        reason: String,
    },
    /// DestroyLease gave the lease up unreleased ([`Release::GivenUp`]): for
    /// the slot it is over, as after [`OperationOutcome::LeaseDestroyed`].
    LeaseGivenUp {
        /// Where and why, for people to read.
        reason: String,
    },
}

impl OperationOutcome {
    /// The outcome of a CancelBootstrap that ended as `release` says.
    pub fn cancelled(release: Release) -> Self {
        match release {
            Release::Done => Self::BootstrapCancelled,
            Release::GivenUp(reason) => Self::BootstrapGivenUp { reason },
        }
    }

    /// The outcome of a DestroyLease that ended as `release` says.
    pub fn destroyed(release: Release) -> Self {
        match release {
            Release::Done => Self::LeaseDestroyed,
            Release::GivenUp(reason) => Self::LeaseGivenUp { reason },
        }
    }

    /// Why the release this outcome reports was given up, if it was.
    pub fn given_up(&self) -> Option<&str> {
        match self {
            Self::BootstrapGivenUp { reason } | Self::LeaseGivenUp { reason } => Some(reason),
            _ => None,
        }
    }
}

/// The result of one dispatched operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationResult {
    /// The slot the operation acted for.
    pub node: LogicalNodeId,
    /// The operation.
    pub op: OperationId,
    /// What happened.
    pub outcome: OperationOutcome,
}

/// One thing a bootstrap stream reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BootstrapEvent {
    /// A progress fact (a failure stage counts as a failure).
    Stage(BootstrapStage),
    /// The node's agent joined the swarm.
    SwactorJoined,
    /// The stream ended.
    Closed,
    /// The bootstrap failed at `stage`.
    Failed {
        /// The failure stage.
        stage: BootstrapStage,
        /// What went wrong.
        reason: String,
    },
}

/// A bootstrap stream observation, tagged with the attempt and session it came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapObservation {
    /// The slot.
    pub node: LogicalNodeId,
    /// The attempt whose session reported.
    pub attempt: NodeAttemptId,
    /// The session that reported.
    pub session: SessionId,
    /// What it reported.
    pub event: BootstrapEvent,
}

/// Why an input was not folded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DiscardReason {
    /// No node holds that slot.
    UnknownNode,
    /// The input belongs to an older attempt of the slot.
    SupersededAttempt,
    /// The operation is not the node's pending one (late, duplicated or expired).
    StaleOperation,
    /// The outcome does not fit the pending operation's effect.
    OutcomeMismatch,
    /// The session is not the node's live session.
    StaleSession,
    /// The node is not an active, live attempt (already failed or being deleted).
    NotActive,
    /// A stream's report that the agent joined: only a live connection to
    /// the host proves that (see `Host::handle_bootstrap`).
    NotLive,
    /// Not folded yet: earlier reports of the same node wait to be folded
    /// (they came before its StartBootstrap result), and this one is folded
    /// after them, in order, as the host's own fold (`Output::Folded`).
    Queued,
}

/// What folding an input did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Folded {
    /// The input changed the node.
    Applied,
    /// The input was dropped, for the reason given.
    Discarded(DiscardReason),
}

/// Folds an operation result into `node`.
///
/// # Errors
/// A backoff, probe or stall deadline would overflow; `node` is unchanged.
pub fn fold_result(
    node: &mut ManagedNode,
    op: OperationId,
    outcome: &OperationOutcome,
    config: &ReconcilerConfig,
    now: Timestamp,
) -> Result<Folded, DeadlineOverflow> {
    if op.attempt != node.attempt {
        return Ok(Folded::Discarded(DiscardReason::SupersededAttempt));
    }
    let Some(pending) = node.pending.as_ref().filter(|p| p.id == op) else {
        return Ok(Folded::Discarded(DiscardReason::StaleOperation));
    };
    let failures_after = node.retry.consecutive_failures.saturating_add(1);
    // Every deadline any outcome needs up front (the probe and stall ones
    // come first in their own folds), so an overflow changes nothing.
    let facts = ResultFacts {
        kind: pending.effect,
        cleanup: pending.cleanup,
        // An outcome left unknown once the operation's deadline has passed
        // (the host's own expiry, or an executor giving up at it) is a timeout.
        expired: pending.deadline <= now,
        // An operation the active attempt dispatched, failing after the
        // node began deleting, says nothing about the cleanup: it must not
        // delay it.
        interrupted: node.intent == Intent::Deleting && !pending.cleanup,
        failures_after,
        backoff_at: now.checked_add_ms(config.backoff_ms(node.attempt, failures_after))?,
        endpoint_at: now.checked_add_ms(node.template.limits.endpoint_timeout_ms())?,
    };
    match outcome {
        OperationOutcome::Failed { class, reason } => {
            Ok(fold_failure(node, &facts, *class, reason, now))
        }
        outcome => fold_progress(node, &facts, outcome, config, now),
    }
}

/// What [`fold_result`] reads of the pending operation, and the deadlines it
/// computes, before it changes anything.
struct ResultFacts {
    /// The pending operation's effect.
    kind: EffectKind,
    /// Whether the operation is part of the cleanup.
    cleanup: bool,
    /// Whether the operation's deadline has passed.
    expired: bool,
    /// Whether the operation is the active attempt's, and the node is deleting.
    interrupted: bool,
    /// The node's consecutive failures, counting this one.
    failures_after: u32,
    /// When to retry after a failure.
    backoff_at: Timestamp,
    /// When a lease created without its endpoint must have one.
    endpoint_at: Timestamp,
}

/// Folds a failed operation: records the error, settles what may have
/// happened, and schedules the retry or ends the attempt.
fn fold_failure(
    node: &mut ManagedNode,
    facts: &ResultFacts,
    class: FailureClass,
    reason: &str,
    now: Timestamp,
) -> Folded {
    let kind = facts.kind;
    let rec = &mut node.record;
    let cause = if class == FailureClass::Ambiguous && facts.expired {
        FailureCause::Timeout
    } else {
        FailureCause::Failure
    };
    rec.set_last_error(cause, format!("{kind:?}: {reason}"));
    let attempt_fails = node.intent == Intent::Active && failure_ends_attempt(kind, class);
    // A definite failure says only that *this* call had no effect: an
    // earlier ambiguous CreateLease (still running late, or done with
    // its result lost) may hold a machine, so it stays unresolved until
    // a re-issue succeeds. A session cannot outlive its lease, so an
    // unresolved StartBootstrap is made safe by the DestroyLease that
    // follows and may be dropped (its lease may be gone for good).
    match class {
        FailureClass::Ambiguous if kind.creates() => rec.ambiguous = kind.as_create(),
        FailureClass::Definite | FailureClass::LeaseGone if kind == EffectKind::StartBootstrap => {
            rec.ambiguous = None
        }
        _ => {}
    }
    node.pending = None;
    if facts.interrupted {
        return Folded::Applied;
    }
    node.retry.consecutive_failures = facts.failures_after;
    if attempt_fails {
        // The attempt ends; cleanup starts at once and backoff is
        // applied to the restart instead.
        let why = if class == FailureClass::LeaseGone {
            format!("the lease is gone: {reason}")
        } else {
            format!("bootstrap could not start: {reason}")
        };
        fail_attempt(node, why, now);
    } else {
        node.retry.next_effect_at = Some(facts.backoff_at);
    }
    Folded::Applied
}

/// Whether a `class` failure of a `kind` operation ends an active attempt.
fn failure_ends_attempt(kind: EffectKind, class: FailureClass) -> bool {
    match class {
        FailureClass::Definite => kind == EffectKind::StartBootstrap,
        FailureClass::LeaseGone => matches!(
            kind,
            EffectKind::LookupEndpoint | EffectKind::StartBootstrap
        ),
        FailureClass::Ambiguous => false,
    }
}

/// Folds an outcome other than a failure: the node advances if it fits the
/// pending operation's effect, and is discarded otherwise.
fn fold_progress(
    node: &mut ManagedNode,
    facts: &ResultFacts,
    outcome: &OperationOutcome,
    config: &ReconcilerConfig,
    now: Timestamp,
) -> Result<Folded, DeadlineOverflow> {
    let rec = &mut node.record;
    match (facts.kind, outcome) {
        (EffectKind::CreateLease, OperationOutcome::LeaseCreated { lease, endpoint }) => {
            if endpoint.is_some() {
                rec.stage = NodeStage::EndpointKnown;
                rec.endpoint_deadline = None;
            } else {
                rec.stage = NodeStage::LeaseCreated;
                rec.endpoint_deadline = Some(facts.endpoint_at);
            }
            rec.lease = Some(lease.clone());
            rec.endpoint = endpoint.clone();
            rec.ambiguous = None;
        }
        (EffectKind::LookupEndpoint, OperationOutcome::EndpointFound { endpoint }) => {
            rec.endpoint = Some(endpoint.clone());
            rec.endpoint_deadline = None;
            if rec.stage == NodeStage::LeaseCreated {
                rec.stage = NodeStage::EndpointKnown;
            }
        }
        (EffectKind::LookupEndpoint, OperationOutcome::EndpointNotReady) => {
            return fold_endpoint_not_ready(node, facts.failures_after, config, now);
        }
        (EffectKind::StartBootstrap, OperationOutcome::BootstrapStarted { session }) => {
            let stall_at = now.checked_add_ms(config.bootstrap_stall_ms)?;
            rec.session = Some(session.clone());
            rec.ambiguous = None;
            if node.intent == Intent::Active {
                rec.stage = NodeStage::BootstrapRunning;
                rec.bootstrap_deadline = Some(stall_at);
            }
        }
        (
            EffectKind::CancelBootstrap,
            OperationOutcome::BootstrapCancelled | OperationOutcome::BootstrapGivenUp { .. },
        ) => {
            rec.session = None;
            rec.bootstrap_deadline = None;
        }
        (
            EffectKind::DestroyLease,
            OperationOutcome::LeaseDestroyed | OperationOutcome::LeaseGivenUp { .. },
        ) => {
            rec.lease = None;
            rec.endpoint = None;
        }
        (_, _) => return Ok(Folded::Discarded(DiscardReason::OutcomeMismatch)),
    }
    // A live attempt got past the step an error held back (a create that
    // waited for room, a lookup that failed): the error is over and is no
    // longer the node's last word. An attempt that failed, or is leaving,
    // keeps the error it failed with for people to read.
    if !facts.cleanup && node.intent == Intent::Active && rec.stage != NodeStage::Failed {
        rec.clear_last_error();
    }
    node.pending = None;
    node.retry.next_effect_at = None;
    Ok(Folded::Applied)
}

/// Folds a lookup that found no endpoint yet: probe again later, or fail
/// the attempt once the endpoint deadline has passed.
fn fold_endpoint_not_ready(
    node: &mut ManagedNode,
    failures_after: u32,
    config: &ReconcilerConfig,
    now: Timestamp,
) -> Result<Folded, DeadlineOverflow> {
    let probe_at = now.checked_add_ms(config.probe_interval_ms)?;
    node.pending = None;
    let rec = &mut node.record;
    if node.intent == Intent::Active && rec.endpoint_deadline.is_some_and(|at| at <= now) {
        let waited = node.template.limits.endpoint_timeout_s;
        let reason = format!("the endpoint was not ready within {waited} s");
        rec.set_last_error(FailureCause::Timeout, reason.clone());
        node.retry.consecutive_failures = failures_after;
        fail_attempt(node, reason, now);
        return Ok(Folded::Applied);
    }
    node.retry.next_effect_at = Some(probe_at);
    Ok(Folded::Applied)
}

/// How long past the agent's own boot-check timeout the stall deadline
/// waits for it to report the failure.
pub const BOOT_CHECK_REPORT_MARGIN_MS: u64 = 10_000;

/// The stall deadline while `node`'s boot check runs: never before the
/// agent's own timeout (plus [`BOOT_CHECK_REPORT_MARGIN_MS`]) has had its say.
pub fn stall_during_boot_check_ms(config: &ReconcilerConfig, node: &ManagedNode) -> u64 {
    let check = node
        .template
        .limits
        .boot_timeout_ms()
        .saturating_add(BOOT_CHECK_REPORT_MARGIN_MS);
    config.bootstrap_stall_ms.max(check)
}

/// Folds a bootstrap stream observation into `node`.
///
/// # Errors
/// The refreshed stall deadline would overflow; `node` is unchanged.
pub fn fold_bootstrap(
    node: &mut ManagedNode,
    attempt: NodeAttemptId,
    session: &SessionId,
    event: &BootstrapEvent,
    config: &ReconcilerConfig,
    now: Timestamp,
) -> Result<Folded, DeadlineOverflow> {
    if attempt != node.attempt {
        return Ok(Folded::Discarded(DiscardReason::SupersededAttempt));
    }
    if node.record.session.as_ref() != Some(session) {
        return Ok(Folded::Discarded(DiscardReason::StaleSession));
    }
    let stall_at = now.checked_add_ms(config.bootstrap_stall_ms)?;
    let boot_check_at = now.checked_add_ms(stall_during_boot_check_ms(config, node))?;
    let live = node.intent == Intent::Active && node.record.stage != NodeStage::Failed;
    let rec = &mut node.record;
    let failure = match *event {
        BootstrapEvent::Stage(stage) if stage.is_failure() => {
            Some((stage, format!("bootstrap reported {stage:?}")))
        }
        BootstrapEvent::Failed { stage, ref reason } => Some((stage, reason.clone())),
        BootstrapEvent::Stage(stage) => {
            rec.bootstrap = Some(stage);
            if live && !rec.ready {
                // The agent times its own boot check and reports the
                // failure; the stall deadline only backs it up.
                rec.bootstrap_deadline = Some(if stage == BootstrapStage::BootCheck {
                    boot_check_at
                } else {
                    stall_at
                });
            }
            None
        }
        BootstrapEvent::SwactorJoined => {
            if live && rec.stage == NodeStage::BootstrapRunning {
                rec.stage = NodeStage::SwactorJoined;
                rec.bootstrap_deadline = Some(stall_at);
            }
            None
        }
        BootstrapEvent::Closed => {
            rec.session = None;
            rec.bootstrap_deadline = None;
            let converged = rec.stage == NodeStage::SwactorJoined
                && rec.bootstrap == Some(BootstrapStage::Converged);
            if live && !rec.ready && !converged {
                Some((
                    rec.bootstrap.unwrap_or(BootstrapStage::SshConnect),
                    "bootstrap session closed before convergence".to_owned(),
                ))
            } else {
                None
            }
        }
    };
    if let Some((stage, reason)) = failure {
        // The stream's own word that the agent is gone (it exited, its
        // machine or container went away) is a lost agent.
        let cause = if stage == BootstrapStage::AgentLost {
            FailureCause::AgentLost
        } else {
            FailureCause::Failure
        };
        rec.bootstrap = Some(stage);
        rec.set_last_error(cause, reason.clone());
        if live {
            node.retry.consecutive_failures = node.retry.consecutive_failures.saturating_add(1);
            fail_attempt(node, reason, now);
        }
    }
    Ok(Folded::Applied)
}

/// Folds the expiry of the pending operation's stored deadline as an ambiguous failure.
///
/// # Errors
/// The backoff deadline would overflow; `node` is unchanged.
pub fn fold_deadline(
    node: &mut ManagedNode,
    config: &ReconcilerConfig,
    now: Timestamp,
) -> Result<Option<Folded>, DeadlineOverflow> {
    let Some(p) = node.pending.as_ref().filter(|p| p.deadline <= now) else {
        return Ok(None);
    };
    let (op, waited) = (p.id, now.saturating_since(p.dispatched_at));
    let reason = format!("no result within {waited} ms");
    let outcome = OperationOutcome::Failed {
        class: FailureClass::Ambiguous,
        reason,
    };
    fold_result(node, op, &outcome, config, now).map(Some)
}

/// Fails an active attempt whose bootstrap made no progress before its stored stall deadline.
pub fn fold_bootstrap_stall(node: &mut ManagedNode, now: Timestamp) -> bool {
    let rec = &node.record;
    let stalled = node.intent == Intent::Active
        && node.pending.is_none()
        && rec.session.is_some()
        && !rec.ready
        && rec.stage != NodeStage::Failed
        && rec.bootstrap_deadline.is_some_and(|at| at <= now);
    if stalled {
        let reason = match rec.bootstrap {
            Some(BootstrapStage::BootCheck) => format!(
                "the boot check did not finish within its boot_timeout_s of {} s, and the agent did not report it",
                node.template.limits.boot_timeout_s
            ),
            Some(stage) => format!(
                "the bootstrap made no progress before its deadline (last reported: {stage:?})"
            ),
            None => "the bootstrap made no progress before its deadline".to_owned(),
        };
        node.record.bootstrap = Some(BootstrapStage::AgentLost);
        node.record
            .set_last_error(FailureCause::Timeout, reason.clone());
        node.retry.consecutive_failures = node.retry.consecutive_failures.saturating_add(1);
        fail_attempt(node, reason, now);
    }
    stalled
}

/// Folds the loss of a joined agent (it exited, or stayed disconnected past
/// its grace period), or another failure the host decides on (an operator's
/// replace, a paused machine past its wait): the attempt fails, with `cause`
/// and `reason` as its last error, and is replaced. An extension of
/// the specification for node health; see `docs/node-health.md`.
pub fn fold_agent_lost(
    node: &mut ManagedNode,
    attempt: NodeAttemptId,
    cause: FailureCause,
    reason: String,
    now: Timestamp,
) -> Folded {
    if attempt != node.attempt {
        return Folded::Discarded(DiscardReason::SupersededAttempt);
    }
    let stage = node.record.stage;
    if node.intent != Intent::Active || matches!(stage, NodeStage::Failed | NodeStage::Destroyed) {
        return Folded::Discarded(DiscardReason::NotActive);
    }
    node.record.bootstrap = Some(BootstrapStage::AgentLost);
    node.record.set_last_error(cause, reason.clone());
    node.retry.consecutive_failures = node.retry.consecutive_failures.saturating_add(1);
    fail_attempt(node, reason, now);
    Folded::Applied
}

fn fail_attempt(node: &mut ManagedNode, reason: String, now: Timestamp) {
    let rec = &mut node.record;
    rec.stage = NodeStage::Failed;
    rec.ready = false;
    rec.set_failed(reason, now);
    rec.bootstrap_deadline = None;
    rec.endpoint_deadline = None;
    node.retry.next_effect_at = None;
}
