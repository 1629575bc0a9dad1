//! Settings of a cluster.

use std::time::Duration;
use swactor_engine::{RestartPolicy, Starvation};
use swactor_provisioning::{Capacity, ClusterShape, HostConfig, ReconcilerConfig, RunId};

/// Settings of a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The run this cluster manages; fixed for its lifetime.
    pub run_id: RunId,
    /// The reconciler's tunables.
    pub reconciler: ReconcilerConfig,
    /// Executor workers, i.e. provider calls that may run at once (the host's lanes).
    pub executors: usize,
    /// Restart budget of each executor worker.
    pub executor_restarts: RestartPolicy,
    /// Completed operations each worker remembers for replay.
    pub executor_history_len_max: usize,
    /// Period of the safety-net tick.
    pub tick: Duration,
    /// Events a local subscriber may fall behind before it is told it lagged.
    pub event_buffer_len: usize,
    /// Publish one event per node change (off for very large benchmarks).
    pub node_events: bool,
    /// The first desired shape, if known at start (offered after the journal's).
    pub initial_shape: Option<ClusterShape>,
    /// How often the remote telemetry snapshot is refreshed while things change.
    pub snapshot_refresh: Duration,
    /// Whether a bootstrap stream's join report counts as a live join (a
    /// cluster with no swarm endpoint, e.g. over the fake provider).
    pub stream_joins: bool,
    /// How long a new resource may stay invisible to the provider's listing.
    pub visibility_window: Duration,
    /// Interval of the leak sweeps.
    pub sweep_interval: Duration,
    /// How long an agent of an earlier daemon has at least to rejoin this one.
    pub rejoin_window: Duration,
    /// Attempts remembered per slot for `describe` (0 for none).
    pub history_len: usize,
    /// How many nodes each provider kind can hold; a shape asking one for
    /// more is refused unless it names its own capacity.
    pub capacities: Vec<Capacity>,
    /// The daemon's measure of its own starvation (see
    /// [`swactor_engine::Starvation`]), told to the host so silence the
    /// daemon could not hear counts against no agent; `None` where nothing
    /// measures it (tests under paused time, benchmarks).
    pub starvation: Option<Starvation>,
    /// See [`HostConfig::adopt_unrecorded`]: `swactor up --adopt`.
    pub adopt_unrecorded: bool,
    /// See [`HostConfig::deployment`]: what a new journal records.
    pub deployment: Option<String>,
    /// Until when this daemon leads its run, when it shares the journal
    /// with standbys (`swactor up --etcd`): the host acts on nothing past
    /// it. `None`: alone on its journal, it always acts.
    pub lead: Option<swactor_engine::LeadBound>,
    /// The counts views read, shared by the drivers a supervisor starts
    /// one after the other (it sets one when it starts); `None`: each
    /// driver keeps its own.
    pub(crate) tally: Option<crate::glance::Tally>,
    /// Where each driver this config starts records its host's inputs (see
    /// `swactor_provisioning::flight`): one recording per driver life.
    /// `None`: nothing is recorded.
    pub flight: Option<crate::FlightRecorder>,
    /// The build that records, named in each recording's header.
    pub build: String,
}

impl ClusterConfig {
    /// Defaults for `run_id`.
    pub fn new(run_id: RunId) -> Self {
        let host = HostConfig::default();
        Self {
            run_id,
            reconciler: ReconcilerConfig::default(),
            executors: 16,
            // Generous: a provider call that panics is a bug worth escalating,
            // but a handful of them should not take the whole cluster down.
            executor_restarts: RestartPolicy {
                restarts_max: 10,
                window: Duration::from_secs(60),
            },
            executor_history_len_max: 4_096,
            tick: Duration::from_secs(30),
            event_buffer_len: 4_096,
            node_events: true,
            initial_shape: None,
            snapshot_refresh: Duration::from_secs(1),
            stream_joins: host.stream_joins,
            visibility_window: Duration::from_millis(host.visibility_window_ms),
            sweep_interval: Duration::from_millis(host.sweep_interval_ms),
            rejoin_window: Duration::from_millis(host.rejoin_window_ms),
            history_len: host.history_len,
            capacities: host.capacities,
            starvation: None,
            adopt_unrecorded: host.adopt_unrecorded,
            deployment: host.deployment,
            lead: None,
            tally: None,
            flight: None,
            build: format!("swactor-actors {}", env!("CARGO_PKG_VERSION")),
        }
    }

    pub(crate) fn host(&self) -> HostConfig {
        HostConfig {
            lanes: u32::try_from(self.executors.max(1)).unwrap_or(u32::MAX),
            stream_joins: self.stream_joins,
            node_events: self.node_events,
            visibility_window_ms: u64::try_from(self.visibility_window.as_millis())
                .unwrap_or(u64::MAX),
            sweep_interval_ms: u64::try_from(self.sweep_interval.as_millis()).unwrap_or(u64::MAX),
            rejoin_window_ms: u64::try_from(self.rejoin_window.as_millis()).unwrap_or(u64::MAX),
            history_len: self.history_len,
            capacities: self.capacities.clone(),
            adopt_unrecorded: self.adopt_unrecorded,
            deployment: self.deployment.clone(),
        }
    }
}
