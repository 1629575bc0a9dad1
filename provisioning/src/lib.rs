//! The pure, sans-IO heart of Swactor: it decides how to move a cluster toward
//! its declared shape, and reads no clock, socket, file, thread or random source.
//!
//! Callers give it three things and get data back:
//!
//! - **desired state**: a [`ClusterShape`] (run, generation, groups), validated
//!   and expanded into one slot per `{group}-{index}`;
//! - **observed state**: a [`ClusterState`] holding one [`ManagedNode`] per slot,
//!   written only by the [`Driver`];
//! - **now**: a [`Timestamp`] the host supplies on every call.
//!
//! [`reconcile`] and [`reconcile_node`] are the decider: a pure function from
//! (observed, desired, now) to at most one [`NodeAction`] per node, chosen by a
//! fixed ladder of rows ([`LadderRow`]). The reason a pass runs is hidden from
//! the decider on purpose, so missed or duplicated events heal on the next pass.
//! The [`observe`] functions fold executor results, bootstrap facts and expired
//! deadlines into state, computing every deadline once. The [`Driver`] ties
//! them together: it folds inputs, coalesces triggers, runs passes, records
//! every effect as pending before handing it out, and reports the one instant
//! it next needs waking ([`Driver::poll_timeout`]).
//!
//! Identity is layered: a [`LogicalNodeId`] is a stable slot, a
//! [`NodeAttemptId`] one incarnation of it (never reused), an [`OperationId`]
//! one dispatched effect of an attempt. Providers key every external resource on
//! a [`ResourceKey`] (run, slot, attempt) and adopt before creating.

pub mod budget;
mod capacity;
mod config;
mod core;
mod decide;
mod driver;
pub mod exit;
pub mod flight;
mod host;
mod id;
pub mod lifetime;
mod lost;
mod nodemap;
pub mod observe;
#[cfg(swactor_policy_probe)]
mod policy_probe;
mod rollout;
mod shape;
mod start;
mod state;
mod time;

pub use capacity::{OverCapacity, check_capacity};
pub use config::{ConfigError, OperationTimeouts, ReconcilerConfig};
pub use core::Reconciler;
pub use decide::{
    Change, DeleteReason, LadderRow, NodeAction, NodeDecision, Plan, PlannedAction, RolloutGates,
    RolloutStatus, RolloutStop, ShapeDiff, allowed_while_paused, breaker, diff, every_change,
    group_status, is_converged, reconcile, reconcile_node, reconcile_node_gated,
    reconcile_node_paused, reconcile_paused, reconcile_with, rollout_holds, surge,
};
pub use driver::{
    AdoptEntry, Adoption, DesiredUpdate, Dispatch, Driver, DriverError, DriverStats, EffectRequest,
    Pass, PassStats, UpdateError,
};
pub use host::{
    AWAY_PAST_GRACE, ApplyError, AttemptRecord, Capacity, CapacityBasis, CollectRequest,
    DEFAULT_REJOIN_WINDOW_MS, DEPARTED_HISTORY_MAX, DeafGap, EARLY_OBSERVATIONS_MAX, GroupHold,
    HeldBy, HoldKind, Host, HostConfig, HostError, HostEvent, HostFold, JOURNAL_FORMAT,
    JoinRefused, JournalDelta, JournalImage, JournalMeta, Leadership, Link, Listed, Liveness,
    NextStep, Output, PAUSED_PAST_WAIT, PauseError, REPLACED_BY_OPERATOR, ReplaceError, Reply,
    SPENT_RECORD_STEP_MICROS, ShutdownMode, ShutdownReport, SlotRecord, Ticket,
};
pub use id::{
    GROUP_NAMES_MAX, Generation, GroupId, ID_LEN_MAX, IdError, IdString, LeaseId, LogicalNodeId,
    NodeAttemptId, NodeEndpoint, OperationId, ResourceKey, RunId, SessionId, validate_id,
};
pub use lost::{LostJournal, Traces, Unrecorded, without_journal};
pub use nodemap::{DENSE_INDEX_MAX, GroupEntries, NodeMap, NodeTable};
pub use observe::{
    BOOT_CHECK_REPORT_MARGIN_MS, BootstrapEvent, BootstrapObservation, DiscardReason, FailureClass,
    Folded, OperationOutcome, OperationResult, Release, stall_during_boot_check_ms,
};
pub use rollout::{Breaker, GroupPolicy, OnPreempt, OrphanPolicy, PERCENT_MAX, Quantity};
pub use shape::{
    BootParams, ClusterShape, DesiredGroup, DesiredState, GROUP_COUNT_MAX, GROUPS_MAX, GroupField,
    GroupShape, LogicalNodeSpec, NodeLimits, NodeTemplate, ParamValue, PolicyShape, PreemptChoice,
    ProviderShape, SHAPE_NODES_MAX, ShapeError, SwarmJoin, same_template,
};
pub use start::{StartDecision, StartRefusal, decide_start};
pub use state::{
    AmbiguousCreate, BootstrapStage, ClusterState, EffectKind, FailureCause, Intent, ManagedNode,
    NodeRecord, NodeStage, PendingOperation, RetryState, Trouble,
};
pub use time::{DeadlineOverflow, Timestamp};
