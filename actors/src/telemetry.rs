//! What the cluster tells the world: snapshots and a stream of events, built from the host.

use crate::events::{ClusterEvent, ClusterSnapshot, NodeDescription, NodeSummary};
use crate::glance::{Counts, Entry, Tally};
use crate::msg::Subscription;
use std::sync::Arc;
use swactor_engine::telemetry::TelemetryPublisher;
use swactor_provisioning::{
    DeafGap, GroupId, HoldKind, Host, HostEvent, LogicalNodeId, NextStep, PassStats, Reconciler,
    ResourceKey, Timestamp,
};
use tokio::sync::broadcast;

/// The target of the log lines that say again what an event already says (a
/// warning, a hold, an adoption): a program that shows the events in its
/// own words, as `swactor up` does, turns this target off where it shows
/// them, and keeps the log lines of every other target.
pub const EVENT_LOG_TARGET: &str = "swactor_actors::events";

/// Local subscribers and, optionally, remote ones through the engine's publisher.
pub(crate) struct Telemetry {
    events: broadcast::Sender<ClusterEvent>,
    publisher: Option<Arc<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>>,
    /// The remote snapshot is stale.
    pub(crate) dirty: bool,
    /// How long the last passes took (pass number, microseconds), newest
    /// last, until their events are published.
    pass_us: std::collections::VecDeque<(u64, u64)>,
    /// The counts views read (see [`crate::glance`]), kept as node changes
    /// are published.
    pub(crate) tally: Tally,
}

/// Pass timings kept until their events are drained.
const PASS_TIMINGS_MAX: usize = 64;

impl Telemetry {
    pub(crate) fn new(
        buffer_len: usize,
        publisher: Option<Arc<TelemetryPublisher<ClusterSnapshot, ClusterEvent>>>,
        tally: Tally,
    ) -> Self {
        let (events, _) = broadcast::channel(buffer_len.max(1));
        Self {
            events,
            publisher,
            dirty: false,
            pass_us: std::collections::VecDeque::new(),
            tally,
        }
    }

    /// Notes how long pass `number` took, for its event.
    pub(crate) fn pass_took(&mut self, number: u64, took: std::time::Duration) {
        if self.pass_us.len() == PASS_TIMINGS_MAX {
            self.pass_us.pop_front();
        }
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.pass_us.push_back((number, us));
    }

    pub(crate) fn subscribe<C: Reconciler>(&self, host: &Host<C>, now: Timestamp) -> Subscription {
        Subscription {
            events: self.events.subscribe(),
            snapshot: snapshot(host, now),
        }
    }

    pub(crate) fn publish(&mut self, event: ClusterEvent) {
        if let Some(p) = &self.publisher {
            if let Err(e) = p.publish(&event) {
                tracing::warn!(%e, "telemetry event could not be published");
            }
            self.dirty = true;
        }
        // No receivers is fine: nobody is watching.
        let _ = self.events.send(event);
    }

    pub(crate) fn warn(&mut self, message: String) {
        tracing::warn!(target: EVENT_LOG_TARGET, "{message}");
        self.publish(ClusterEvent::Warning { message });
    }

    /// Publishes everything the host has to say, and counts what it says
    /// of nodes in the tally.
    pub(crate) fn drain<C: Reconciler>(
        &mut self,
        host: &mut swactor_provisioning::flight::Flight<C>,
        now: Timestamp,
    ) {
        let tally = self.tally.clone();
        let mut counts = tally.lock();
        while let Some(event) = host.poll_event() {
            if let Some(event) = self.translate(host, event, now, &mut counts) {
                self.publish(event);
            }
        }
    }

    /// What subscribers hear of the host's `event`; `None` for a warning,
    /// published already. A node's change is counted in `counts` too.
    fn translate<C: Reconciler>(
        &mut self,
        host: &Host<C>,
        event: HostEvent,
        now: Timestamp,
        counts: &mut Counts,
    ) -> Option<ClusterEvent> {
        match &event {
            // Readiness follows the agent's link, which these change
            // without a node event of their own.
            HostEvent::AgentJoined(key)
            | HostEvent::AgentDisconnected { key, .. }
            | HostEvent::Preempted { key, .. } => {
                counts.set(key.node, Entry::in_host(host, &key.node));
            }
            // An adoption takes a whole inventory in at once.
            HostEvent::Adopted { .. } => counts.recount(host),
            _ => {}
        }
        let event = match event {
            HostEvent::NodeChanged(node) => match summary(host, &node, now) {
                Some(summary) => {
                    counts.set(node, Some(Entry::of(&summary)));
                    ClusterEvent::Node(summary)
                }
                None => {
                    counts.set(node, None);
                    ClusterEvent::Removed { node }
                }
            },
            HostEvent::Warning(message) => {
                self.warn(message);
                return None;
            }
            HostEvent::ShapeAccepted { generation, nodes } => {
                ClusterEvent::ShapeAccepted { generation, nodes }
            }
            HostEvent::Dispatched { node, op, effect } => {
                ClusterEvent::Dispatched { node, op, effect }
            }
            HostEvent::Pass { number, stats } => self.pass_event(number, stats),
            HostEvent::Converged { generation, nodes } => {
                self.refresh(host, now);
                ClusterEvent::Converged { generation, nodes }
            }
            HostEvent::Adopted {
                adopted,
                drifted,
                orphans,
                presumed_gone,
                foreign: _,
            } => adopted_event(adopted, drifted, orphans, presumed_gone),
            HostEvent::Swept { orphans } => ClusterEvent::Swept { orphans },
            HostEvent::Collected { key, error } => ClusterEvent::Collected { key, error },
            HostEvent::GivenUp { key, reason } => ClusterEvent::GivenUp { key, reason },
            HostEvent::AgentJoined(key) => ClusterEvent::AgentJoined { key },
            HostEvent::AgentDisconnected { key, grace_until } => {
                let replaced = matches!(
                    host.next_step(&key.node, now),
                    Some(NextStep::LostAt { replaced: true, .. })
                );
                ClusterEvent::AgentDisconnected {
                    key,
                    grace_until,
                    replaced,
                    at: now,
                }
            }
            HostEvent::Preempted { key, wait_until } => preempted_event(key, wait_until, now),
            HostEvent::Deaf(gap) => deaf_event(&gap),
            HostEvent::Paused => ClusterEvent::Paused,
            HostEvent::Resumed { by_teardown } => ClusterEvent::Resumed { by_teardown },
            HostEvent::TeardownStarted { generation } => {
                ClusterEvent::TeardownStarted { generation }
            }
            HostEvent::Hold {
                group,
                kind,
                reason,
            } => hold_event(group, kind, reason),
        };
        Some(event)
    }

    /// Pass `number`'s event, with how long it took if that is still known (else 0).
    fn pass_event(&self, number: u64, stats: PassStats) -> ClusterEvent {
        ClusterEvent::Pass {
            number,
            nodes: stats.nodes,
            transitions: stats.transitions,
            dispatched: stats.dispatched,
            duration_us: self
                .pass_us
                .iter()
                .find(|(n, _)| *n == number)
                .map_or(0, |(_, us)| *us),
        }
    }

    /// Sets the remote subscribers' snapshot to the cluster now.
    pub(crate) fn refresh<C: Reconciler>(&mut self, host: &Host<C>, now: Timestamp) {
        if let Some(Err(e)) = self
            .publisher
            .as_ref()
            .map(|p| p.set_snapshot(&snapshot(host, now)))
        {
            tracing::warn!(%e, "telemetry snapshot could not be published");
        }
        self.dirty = false;
    }
}

/// The adoption's event, logged too when it took over or found anything.
fn adopted_event(
    adopted: Vec<ResourceKey>,
    drifted: Vec<ResourceKey>,
    orphans: Vec<ResourceKey>,
    presumed_gone: Vec<ResourceKey>,
) -> ClusterEvent {
    if !adopted.is_empty() || !orphans.is_empty() {
        tracing::info!(
            target: EVENT_LOG_TARGET,
            adopted = adopted.len(),
            drifted = drifted.len(),
            orphans = orphans.len(),
            presumed_gone = presumed_gone.len(),
            "adopted what an earlier daemon left"
        );
    }
    ClusterEvent::Adopted {
        adopted,
        drifted,
        orphans,
        presumed_gone,
    }
}

/// The event of `key`'s machine paused by its provider, logged too.
fn preempted_event(
    key: ResourceKey,
    wait_until: Option<Timestamp>,
    now: Timestamp,
) -> ClusterEvent {
    tracing::info!(
        target: EVENT_LOG_TARGET,
        %key,
        waits = wait_until.is_some(),
        "its machine is paused by its provider (preempted)"
    );
    ClusterEvent::Preempted {
        key,
        wait_until,
        at: now,
    }
}

/// The event of a time the daemon was not listening, logged too.
fn deaf_event(gap: &DeafGap) -> ClusterEvent {
    tracing::info!(
        target: EVENT_LOG_TARGET,
        unheard_ms = gap.len_ms(),
        agents = gap.agents,
        "the daemon was not listening; every agent gets its grace again"
    );
    ClusterEvent::Deaf {
        from: gap.from,
        to: gap.to,
        agents: gap.agents,
    }
}

/// The event of `group`'s hold set (with its `reason`) or lifted, logged too.
fn hold_event(group: GroupId, kind: HoldKind, reason: Option<String>) -> ClusterEvent {
    match &reason {
        Some(r) => tracing::warn!(target: EVENT_LOG_TARGET, group = %group, "{r}"),
        None => tracing::info!(
            target: EVENT_LOG_TARGET,
            group = %group,
            ?kind,
            "no longer held"
        ),
    }
    ClusterEvent::Hold {
        group: group.to_string(),
        kind,
        reason,
    }
}

fn summary<C: Reconciler>(
    host: &Host<C>,
    node: &LogicalNodeId,
    now: Timestamp,
) -> Option<NodeSummary> {
    let mut summary = NodeSummary::of(node, host.core().state(), host.link(node))?;
    summary.next = host.next_step(node, now).unwrap_or_default();
    summary.orphan_after_s = host.orphan_after_s(node);
    Some(summary)
}

/// One node in depth, or `None` if the host knows nothing of it.
pub(crate) fn describe<C: Reconciler>(
    host: &Host<C>,
    node: &LogicalNodeId,
    now: Timestamp,
) -> Option<NodeDescription> {
    let current = host.core().state().nodes.get(node);
    let history = host.history(node);
    if current.is_none() && history.is_none() {
        return None;
    }
    Some(NodeDescription {
        node: *node,
        summary: summary(host, node, now),
        desired: host.core().desires(node),
        lease: current.and_then(|n| n.record.lease.as_ref().map(|l| l.0.to_string())),
        bootstrap: current.and_then(|n| n.record.bootstrap),
        failed_reason: current.and_then(|n| n.record.failed_reason().map(str::to_owned)),
        attempts: history.unwrap_or_default(),
        now,
    })
}

/// The cluster as people see it.
pub(crate) fn snapshot<C: Reconciler>(host: &Host<C>, now: Timestamp) -> ClusterSnapshot {
    let core = host.core();
    let state = core.state();
    ClusterSnapshot {
        run_id: state.run_id.to_string(),
        generation: core.desired().generation,
        observed_generation: state.observed_generation,
        converged: host.is_converged(),
        inventory_read: host.adopted(),
        desired_nodes: core.desired().node_count(),
        nodes: state
            .nodes
            .keys()
            .filter_map(|id| summary(host, id, now))
            .collect(),
        orphans: host.collecting().count(),
        shutting_down: host.shutting_down(),
        stats: core.stats(),
        now,
        rentals: Vec::new(),
        deployment: host.journal_meta().deployment.clone(),
        foreign: Vec::new(),
        budget: host.journal_meta().shape.as_ref().and_then(|s| s.budget),
        // What the journal holds; the daemon adds what its providers count now.
        spend: (host.spent_micros() > 0).then(|| swactor_provisioning::budget::Spend {
            spent_micros: host.spent_micros(),
            usd_per_hour_micros: 0,
        }),
        lifetime: host.lifetime_status(now),
        in_flight: host.in_flight_count(),
        paused: host.is_paused(),
        holds: host.holds(),
        ha: None,
    }
}
