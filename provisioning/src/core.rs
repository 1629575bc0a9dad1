//! The driver operations a host uses, as a trait, so a harness can wrap or replace the driver.

use crate::config::ReconcilerConfig;
use crate::decide::{Plan, RolloutStatus};
use crate::driver::{
    AdoptEntry, Adoption, DesiredUpdate, Driver, DriverError, DriverStats, Pass, UpdateError,
};
use crate::id::{GroupId, LogicalNodeId, NodeAttemptId, OperationId};
use crate::observe::{BootstrapObservation, Folded, OperationResult};
use crate::rollout::Breaker;
use crate::shape::{ClusterShape, DesiredState};
use crate::state::{ClusterState, FailureCause};
use crate::time::Timestamp;
use std::collections::BTreeSet;

/// The driver core as a [`crate::Host`] (or a test harness) drives it.
///
/// Every method means what the [`Driver`] method of the same name means;
/// [`Driver`] is the implementation. A conformance harness wraps a driver in
/// another implementation to break it on purpose and check that its oracle
/// notices.
pub trait Reconciler {
    /// See [`Driver::update_desired`].
    ///
    /// # Errors
    /// As the driver's.
    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError>;
    /// See [`Driver::handle_result`]; the result is borrowed (the host
    /// may record it).
    ///
    /// # Errors
    /// As the driver's.
    fn handle_result(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_submit_failed`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_bootstrap`]; the observation is borrowed (the
    /// host may still need it, to keep an early one).
    ///
    /// # Errors
    /// As the driver's.
    fn handle_bootstrap(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError>;
    /// See [`Driver::handle_agent_lost`].
    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        cause: FailureCause,
        reason: &str,
        now: Timestamp,
    ) -> Folded;
    /// See [`Driver::handle_timeout`].
    ///
    /// # Errors
    /// As the driver's.
    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError>;
    /// See [`Driver::handle_tick`].
    fn handle_tick(&mut self, now: Timestamp);
    /// See [`Driver::handle_unheard`].
    fn handle_unheard(&mut self, from: Timestamp, to: Timestamp);
    /// See [`Driver::poll_timeout`].
    fn poll_timeout(&self) -> Option<Timestamp>;
    /// See [`Driver::poll_pass`].
    ///
    /// # Errors
    /// As the driver's.
    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError>;
    /// See [`Driver::finish_pass`].
    ///
    /// # Errors
    /// As the driver's.
    fn finish_pass(&mut self) -> Result<(), DriverError>;
    /// See [`Driver::adopt`].
    fn adopt(&mut self, entries: Vec<AdoptEntry>, op_seq_base: u64) -> Adoption;
    /// See [`Driver::raise_attempt_floor`].
    fn raise_attempt_floor(&mut self, floor: u64);
    /// See [`Driver::carry_failures`].
    fn carry_failures(&mut self, node: LogicalNodeId, failures: u32);
    /// See [`Driver::plan`].
    fn plan(&self, now: Timestamp) -> Plan;
    /// See [`Driver::plan_shape`].
    ///
    /// # Errors
    /// As the driver's.
    fn plan_shape(&self, shape: &ClusterShape, now: Timestamp) -> Result<Plan, UpdateError>;
    /// See [`Driver::state`].
    fn state(&self) -> &ClusterState;
    /// See [`Driver::desired`].
    fn desired(&self) -> &DesiredState;
    /// See [`Driver::config`].
    fn config(&self) -> &ReconcilerConfig;
    /// See [`Driver::is_converged`].
    fn is_converged(&self) -> bool;
    /// See [`Driver::unconverged_from`]; by default, [`Reconciler::is_converged`]
    /// naming no node.
    ///
    /// # Errors
    /// The state is not converged.
    fn unconverged_from(&self, hint: Option<&LogicalNodeId>) -> Result<(), Option<LogicalNodeId>> {
        let _ = hint;
        if self.is_converged() {
            Ok(())
        } else {
            Err(None)
        }
    }
    /// See [`Driver::stats`].
    fn stats(&self) -> DriverStats;
    /// See [`Driver::is_pass_queued`].
    fn is_pass_queued(&self) -> bool;
    /// See [`Driver::set_paused`].
    fn set_paused(&mut self, paused: bool);
    /// See [`Driver::is_paused`].
    fn is_paused(&self) -> bool;
    /// See [`Driver::rollout_holds`].
    fn rollout_holds(&self) -> Vec<RolloutStatus>;
    /// Whether slot `id` is desired now: one of its group's `count` slots,
    /// or one of the surge slots a rollout adds ([`surge`](crate::surge)).
    fn desires(&self, id: &LogicalNodeId) -> bool {
        self.desired()
            .group(&id.group)
            .is_some_and(|g| id.index < g.count + crate::decide::surge(self.state(), g))
    }
    /// See [`Driver::set_tripped`].
    fn set_tripped(&mut self, tripped: BTreeSet<GroupId>);
    /// See [`Driver::breaker`].
    fn breaker(
        &self,
        group: &GroupId,
        away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Option<Breaker>;
}

impl Reconciler for Driver {
    fn update_desired(&mut self, shape: &ClusterShape) -> Result<DesiredUpdate, UpdateError> {
        Driver::update_desired(self, shape)
    }
    fn handle_result(
        &mut self,
        result: &OperationResult,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_result_ref(self, result, now)
    }
    fn handle_submit_failed(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        reason: &str,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_submit_failed(self, node, op, reason, now)
    }
    fn handle_bootstrap(
        &mut self,
        obs: &BootstrapObservation,
        now: Timestamp,
    ) -> Result<Folded, DriverError> {
        Driver::handle_bootstrap_ref(self, obs, now)
    }
    fn handle_agent_lost(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
        cause: FailureCause,
        reason: &str,
        now: Timestamp,
    ) -> Folded {
        Driver::handle_agent_lost(self, node, attempt, cause, reason, now)
    }
    fn handle_timeout(&mut self, now: Timestamp) -> Result<usize, DriverError> {
        Driver::handle_timeout(self, now)
    }
    fn handle_tick(&mut self, now: Timestamp) {
        Driver::handle_tick(self, now);
    }
    fn handle_unheard(&mut self, from: Timestamp, to: Timestamp) {
        Driver::handle_unheard(self, from, to);
    }
    fn poll_timeout(&self) -> Option<Timestamp> {
        Driver::poll_timeout(self)
    }
    fn poll_pass(&mut self, now: Timestamp) -> Result<Option<Pass>, DriverError> {
        Driver::poll_pass(self, now)
    }
    fn finish_pass(&mut self) -> Result<(), DriverError> {
        Driver::finish_pass(self)
    }
    fn adopt(&mut self, entries: Vec<AdoptEntry>, op_seq_base: u64) -> Adoption {
        Driver::adopt(self, entries, op_seq_base)
    }
    fn raise_attempt_floor(&mut self, floor: u64) {
        Driver::raise_attempt_floor(self, floor);
    }
    fn carry_failures(&mut self, node: LogicalNodeId, failures: u32) {
        Driver::carry_failures(self, node, failures);
    }
    fn plan(&self, now: Timestamp) -> Plan {
        Driver::plan(self, now)
    }
    fn plan_shape(&self, shape: &ClusterShape, now: Timestamp) -> Result<Plan, UpdateError> {
        Driver::plan_shape(self, shape, now)
    }
    fn state(&self) -> &ClusterState {
        Driver::state(self)
    }
    fn desired(&self) -> &DesiredState {
        Driver::desired(self)
    }
    fn config(&self) -> &ReconcilerConfig {
        Driver::config(self)
    }
    fn is_converged(&self) -> bool {
        Driver::is_converged(self)
    }
    fn unconverged_from(&self, hint: Option<&LogicalNodeId>) -> Result<(), Option<LogicalNodeId>> {
        Driver::unconverged_from(self, hint)
    }
    fn stats(&self) -> DriverStats {
        Driver::stats(self)
    }
    fn is_pass_queued(&self) -> bool {
        Driver::is_pass_queued(self)
    }
    fn set_paused(&mut self, paused: bool) {
        Driver::set_paused(self, paused);
    }
    fn is_paused(&self) -> bool {
        Driver::is_paused(self)
    }
    fn rollout_holds(&self) -> Vec<RolloutStatus> {
        Driver::rollout_holds(self)
    }
    fn set_tripped(&mut self, tripped: BTreeSet<GroupId>) {
        Driver::set_tripped(self, tripped);
    }
    fn breaker(
        &self,
        group: &GroupId,
        away: &dyn Fn(&LogicalNodeId, NodeAttemptId) -> bool,
    ) -> Option<Breaker> {
        Driver::breaker(self, group, away)
    }
}
