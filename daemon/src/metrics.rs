//! The daemon's Prometheus metrics: what a scrape reads from the cluster,
//! what the event stream counts, and what the provider calls take.
//!
//! A scrape copies no node: the cluster's figures and each group's counts
//! come from the driver's glance ([`ClusterHandle::glance`]), whose tally
//! the driver keeps node by node as it publishes their changes, and the
//! daemon's own figures (rentals, spend, who leads) are read beside it. What
//! one scrape costs follows the shape's groups, not its nodes. A driver that
//! is handling a message, or does not answer within 5 ms (it is working
//! through a large pass), is not waited for: the scrape takes the glance it
//! left after its last step ([`ClusterHandle::last_glance`]).
//!
//! [`ClusterHandle::glance`]: swactor_actors::ClusterHandle::glance
//! [`ClusterHandle::last_glance`]: swactor_actors::ClusterHandle::last_glance

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use swactor_engine::TaskGauge;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use swactor_actors::glance::{CAUSES, STAGES};
use swactor_actors::{ClusterEvent, ClusterGlance, ClusterSnapshot, HaStatus, Rental};
use swactor_providers::{
    BootstrapSession, FaultKind, Inventory, LeaseGrant, Provider, ProviderError, Release,
    async_trait,
};
use swactor_provisioning::{
    FailureCause, LeaseId, NodeEndpoint, NodeTemplate, ResourceKey, RunId, SessionId,
};

/// Label sets: a list of (name, value) pairs.
type Labels = Vec<(&'static str, String)>;

/// Points kept for the dashboard's plot: one every [`SAMPLE_EVERY`], an hour's worth.
pub(crate) const SAMPLES_MAX: usize = 360;
/// How often the plot gets a point.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// Every metric the daemon exports, and the state the event stream keeps.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    scraped: Arc<Mutex<Option<Scraped>>>,
    provider_calls: Family<Labels, Histogram>,
    provider_failures: Family<Labels, Counter>,
    given_up: Family<Labels, Counter>,
    pass_duration: Histogram,
    control_requests: Family<Labels, Histogram>,
    events: Mutex<EventState>,
    encoding: Mutex<()>,
    /// Each endpoint's handshakes under way, once its router runs.
    handshakes: Arc<OnceLock<Vec<(&'static str, TaskGauge)>>>,
    /// The agents' protocols' connection caps, once their router runs.
    agent_caps: Arc<OnceLock<Vec<(&'static str, swactor_engine::net::ConnectionCap)>>>,
    /// The flight recorder, when the daemon keeps one.
    flight: Arc<OnceLock<swactor_actors::FlightRecorder>>,
}

/// What one scrape read from the daemon, for the collector to encode.
#[derive(Debug, Clone)]
pub(crate) struct Scraped {
    /// The cluster's figures and each group's counts (no node copied).
    pub(crate) glance: ClusterGlance,
    /// The machines rented for the current attempts, as `status` lists them.
    pub(crate) rentals: Vec<Rental>,
    /// What the run's rented machines cost so far, as `status` has it.
    pub(crate) spend: Option<swactor_provisioning::budget::Spend>,
    /// Who leads the run, when several daemons share it.
    pub(crate) ha: Option<HaStatus>,
    /// Telemetry subscribers now (remote and web).
    pub(crate) subscribers: usize,
    /// Whether a provider that rents by the hour is configured (then the
    /// cluster's price is exported even when it is 0).
    pub(crate) priced: Vec<&'static str>,
    /// How long the last convergence took, and of which generation (filled
    /// in by [`Metrics::encode`]).
    pub(crate) convergence: Option<(u64, Duration)>,
}

/// What the event stream has taught the metrics so far. Nothing per node:
/// the cluster's own tally counts nodes and replacements.
#[derive(Debug, Default)]
struct EventState {
    /// Ready nodes, as the cluster last said.
    ready: u64,
    /// Generations accepted and not yet converged, with when.
    accepted: BTreeMap<u64, Instant>,
    /// How long the last convergence took, and of which generation.
    last_convergence: Option<(u64, Duration)>,
    /// Passes seen so far (the last pass number).
    passes: u64,
    /// The plot's points: (wall-clock ms, ready nodes, passes so far).
    samples: std::collections::VecDeque<(u64, u64, u64)>,
}

impl Metrics {
    pub(crate) fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        let provider_calls = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        registry.register(
            "swactor_provider_call_duration_seconds",
            "How long provider calls took, by provider and call",
            provider_calls.clone(),
        );
        let provider_failures = Family::<Labels, Counter>::default();
        registry.register(
            "swactor_provider_call_failures",
            "Provider calls that failed, by provider, call, failure class and kind of fault",
            provider_failures.clone(),
        );
        let given_up = Family::<Labels, Counter>::default();
        registry.register(
            "swactor_releases_given_up",
            "Sessions and leases a provider gave up releasing since the daemon started, because \
             their machine did not answer for too long (they may hold it until cleaned up)",
            given_up.clone(),
        );
        let control_requests = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_5, 2.0, 16))
        });
        registry.register(
            "swactor_control_request_duration_seconds",
            "How long the daemon took to answer the CLI's control requests, from the request \
             read to the answer written, by request (streams of jobs and logs not included)",
            control_requests.clone(),
        );
        let pass_duration = Histogram::new(exponential_buckets(0.000_05, 2.0, 16));
        registry.register(
            "swactor_pass_duration_seconds",
            "How long the driver's steps that ran a reconcile pass took",
            pass_duration.clone(),
        );
        let scraped = Arc::new(Mutex::new(None));
        registry.register_collector(Box::new(SnapshotCollector {
            scraped: scraped.clone(),
        }));
        registry.register_collector(Box::new(AllocatorCollector));
        let handshakes = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(HandshakeCollector {
            gauges: handshakes.clone(),
        }));
        let agent_caps = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(CapCollector {
            caps: agent_caps.clone(),
        }));
        let flight = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(FlightCollector {
            recorder: flight.clone(),
        }));
        Arc::new(Self {
            registry,
            scraped,
            provider_calls,
            provider_failures,
            given_up,
            pass_duration,
            control_requests,
            events: Mutex::new(EventState::default()),
            encoding: Mutex::new(()),
            handshakes,
            agent_caps,
            flight,
        })
    }

    /// The exposition (OpenMetrics text) of everything, with `scraped` as
    /// the cluster's state.
    pub(crate) fn encode(&self, mut scraped: Scraped) -> String {
        scraped.convergence = self.lock_events().last_convergence;
        // One scrape at a time: the collector reads what this one stored.
        let _one = self.encoding.lock().unwrap_or_else(PoisonError::into_inner);
        *self.scraped.lock().unwrap_or_else(PoisonError::into_inner) = Some(scraped);
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// A control request of `kind` answered in `took`.
    pub(crate) fn control_answered(&self, kind: &'static str, took: Duration) {
        self.control_requests
            .get_or_create(&vec![("request", kind.to_owned())])
            .observe(took.as_secs_f64());
    }

    fn lock_events(&self) -> std::sync::MutexGuard<'_, EventState> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the event state from a subscription's snapshot.
    pub(crate) fn seed(&self, snapshot: &ClusterSnapshot) {
        self.lock_events().passes = snapshot.stats.passes;
    }

    /// Exports each endpoint's handshakes under way from now on (the first
    /// call wins: a daemon starts its routers once).
    pub(crate) fn watch_handshakes(&self, gauges: Vec<(&'static str, TaskGauge)>) {
        let _ = self.handshakes.set(gauges);
    }

    /// Exports the agents' protocols' connection caps from now on (the
    /// first call wins).
    pub(crate) fn watch_agent_caps(
        &self,
        caps: Vec<(&'static str, swactor_engine::net::ConnectionCap)>,
    ) {
        let _ = self.agent_caps.set(caps);
    }

    /// Exports what the flight recorder wrote and dropped from now on (the
    /// first call wins).
    pub(crate) fn watch_flight(&self, recorder: swactor_actors::FlightRecorder) {
        let _ = self.flight.set(recorder);
    }

    /// Counts what one event says.
    pub(crate) fn observe(&self, event: &ClusterEvent) {
        match event {
            ClusterEvent::Pass {
                number,
                duration_us,
                ..
            } => {
                self.lock_events().passes = *number;
                if *duration_us > 0 {
                    self.pass_duration.observe(*duration_us as f64 / 1e6);
                }
            }
            ClusterEvent::GivenUp { .. } => {
                self.given_up.get_or_create(&Vec::new()).inc();
            }
            ClusterEvent::ShapeAccepted { generation, .. }
            | ClusterEvent::TeardownStarted { generation } => {
                let mut events = self.lock_events();
                events.accepted.insert(generation.0, Instant::now());
                // Only the last few generations can still converge.
                while events.accepted.len() > 16 {
                    events.accepted.pop_first();
                }
            }
            ClusterEvent::Converged { generation, .. } => {
                let mut events = self.lock_events();
                if let Some(at) = events.accepted.remove(&generation.0) {
                    events.last_convergence = Some((generation.0, at.elapsed()));
                }
                events.accepted.retain(|g, _| *g > generation.0);
            }
            _ => {}
        }
    }

    /// Adds a point to the plot: ready nodes (as the cluster says now, or
    /// said last when it cannot answer) and passes so far, now.
    pub(crate) fn sample(&self, at_ms: u64, ready: Option<u64>) {
        let mut events = self.lock_events();
        if let Some(ready) = ready {
            events.ready = ready;
        }
        let (ready, passes) = (events.ready, events.passes);
        if events.samples.len() == SAMPLES_MAX {
            events.samples.pop_front();
        }
        events.samples.push_back((at_ms, ready, passes));
    }

    /// The plot's points, oldest first: (wall-clock ms, ready, passes so far).
    pub(crate) fn samples(&self) -> Vec<(u64, u64, u64)> {
        self.lock_events().samples.iter().copied().collect()
    }

    fn call(
        &self,
        provider: &'static str,
        call: &'static str,
        took: Duration,
        failed: Option<(&'static str, &'static str)>,
    ) {
        let labels = vec![("provider", provider.to_owned()), ("call", call.to_owned())];
        self.provider_calls
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if let Some((class, kind)) = failed {
            let mut labels = labels;
            labels.push(("class", class.to_owned()));
            labels.push(("kind", kind.to_owned()));
            self.provider_failures.get_or_create(&labels).inc();
        }
    }
}

/// A failed call's class and kind of fault, as label values.
fn failure_labels(e: &ProviderError) -> (&'static str, &'static str) {
    let class = match e {
        ProviderError::Definite(_) => "definite",
        ProviderError::Ambiguous(_) => "ambiguous",
        ProviderError::NotReady => "not_ready",
        ProviderError::Gone(_) => "gone",
    };
    // A probe's "not yet" is no fault: its kind says so.
    (class, e.kind().map_or("none", FaultKind::word))
}

/// Why a slot got a new attempt, in a few fixed words (a label value),
/// from the cause the core recorded with its previous attempt's last
/// error; none means its template changed.
fn replacement_reason(last_cause: Option<FailureCause>) -> &'static str {
    match last_cause {
        None => "shape_change",
        Some(FailureCause::Operator) => "operator",
        Some(FailureCause::Preempted) => "preempted",
        Some(FailureCause::AgentLost) => "agent_lost",
        Some(FailureCause::Timeout) => "timeout",
        Some(FailureCause::Failure) => "failure",
    }
}

/// An effect kind as a label value.
pub(crate) fn effect_label(kind: swactor_provisioning::EffectKind) -> &'static str {
    use swactor_provisioning::EffectKind as K;
    match kind {
        K::CreateLease => "create_lease",
        K::LookupEndpoint => "lookup_endpoint",
        K::StartBootstrap => "start_bootstrap",
        K::CancelBootstrap => "cancel_bootstrap",
        K::DestroyLease => "destroy_lease",
    }
}

/// A node stage as a label value.
pub(crate) fn stage_label(stage: swactor_provisioning::NodeStage) -> String {
    let debug = format!("{stage:?}");
    let mut out = String::with_capacity(debug.len() + 4);
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The daemon's allocator (jemalloc), read at scrape time: what it holds
/// for live objects against what of it is resident, so a memory rise can be
/// told apart as live state or as pages not yet handed back.
#[derive(Debug)]
struct AllocatorCollector;

/// Reads the agents' protocols' connection caps at scrape time.
#[derive(Debug)]
struct CapCollector {
    caps: Arc<OnceLock<Vec<(&'static str, swactor_engine::net::ConnectionCap)>>>,
}

impl prometheus_client::collector::Collector for CapCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(caps) = self.caps.get() else {
            return Ok(());
        };
        let values: Vec<(Labels, i64)> = caps
            .iter()
            .map(|(protocol, c)| {
                let v = i64::try_from(c.get()).unwrap_or(i64::MAX);
                (vec![("protocol", (*protocol).to_owned())], v)
            })
            .collect();
        gauge(
            &mut encoder,
            "swactor_agent_connections_max",
            "Most connections each of the agents' protocols serves at once; it follows \
             the cluster's desired size (a quarter more, at least 4096)",
            &values,
        )
    }
}

/// Reads the flight recorder's counters at scrape time.
#[derive(Debug)]
struct FlightCollector {
    recorder: Arc<OnceLock<swactor_actors::FlightRecorder>>,
}

impl prometheus_client::collector::Collector for FlightCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(recorder) = self.recorder.get() else {
            return Ok(());
        };
        let c = recorder.counts();
        let e = &mut encoder;
        counter(
            e,
            "swactor_flight_written_bytes",
            "Bytes the flight recorder wrote to STATE/flight/ since the daemon started",
            c.written_bytes,
        )?;
        counter(
            e,
            "swactor_flight_dropped_chunks",
            "Frames the flight recorder dropped (in chunks of one driver step) rather than \
             make the daemon wait; the first one cuts its life's recording",
            c.dropped_chunks,
        )?;
        counter(
            e,
            "swactor_flight_lives_cut",
            "Recordings that end before their daemon life did (the writer fell behind, the \
             size limit was reached, or a write failed)",
            c.cut_lives,
        )?;
        counter(
            e,
            "swactor_flight_recordings_removed",
            "Recordings of earlier lives removed to keep STATE/flight/ within its limit",
            c.removed,
        )?;
        counter(
            e,
            "swactor_flight_write_errors",
            "Writes to STATE/flight/ that failed",
            c.write_errors,
        )
    }
}

/// Reads each endpoint's handshakes under way at scrape time.
#[derive(Debug)]
struct HandshakeCollector {
    gauges: Arc<OnceLock<Vec<(&'static str, TaskGauge)>>>,
}

impl prometheus_client::collector::Collector for HandshakeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(gauges) = self.gauges.get() else {
            return Ok(());
        };
        let values: Vec<(Labels, i64)> = gauges
            .iter()
            .map(|(endpoint, g)| {
                let v = i64::try_from(g.get()).unwrap_or(i64::MAX);
                (vec![("endpoint", (*endpoint).to_owned())], v)
            })
            .collect();
        gauge(
            &mut encoder,
            "swactor_handshakes_under_way",
            "Connections whose handshake has started and not yet finished, by endpoint \
             (each is dropped at the handshake deadline)",
            &values,
        )
    }
}

impl prometheus_client::collector::Collector for AllocatorCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use tikv_jemalloc_ctl::{epoch, stats};
        // The statistics are cached until the epoch moves on.
        if epoch::advance().is_err() {
            return Ok(());
        }
        let read = [
            (
                "swactor_allocator_allocated_bytes",
                "Bytes the daemon's live objects take (jemalloc's stats.allocated)",
                stats::allocated::read(),
            ),
            (
                "swactor_allocator_resident_bytes",
                "Bytes of the allocator's pages resident in memory, metadata included \
                 (jemalloc's stats.resident)",
                stats::resident::read(),
            ),
        ];
        for (name, help, value) in read {
            if let Ok(v) = value {
                let v = i64::try_from(v).unwrap_or(i64::MAX);
                gauge(&mut encoder, name, help, &[(Labels::new(), v)])?;
            }
        }
        Ok(())
    }
}

/// Encodes what a scrape read, at scrape time.
#[derive(Debug)]
struct SnapshotCollector {
    scraped: Arc<Mutex<Option<Scraped>>>,
}

fn gauge<V: prometheus_client::encoding::EncodeGaugeValue + Copy>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(Labels, V)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in values {
        if labels.is_empty() {
            return ConstGauge::new(*v).encode(metric);
        }
        ConstGauge::new(*v).encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(metric)
}

impl prometheus_client::collector::Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let guard = self.scraped.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(s) = guard.as_ref() else {
            return Ok(());
        };
        let e = &mut encoder;
        encode_groups(e, s)?;
        encode_cluster_state(e, s)?;
        encode_activity(e, s)?;
        encode_replacements(e, &s.glance)?;
        encode_costs(e, s)?;
        encode_ha(e, s)
    }
}

/// Encodes the per-group families: nodes by stage, ready and desired
/// nodes, from each group's counts (every stage a group has nodes at; every
/// group desired or with nodes).
fn encode_groups(e: &mut DescriptorEncoder, s: &Scraped) -> Result<(), std::fmt::Error> {
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut by_stage: BTreeMap<(String, String), i64> = BTreeMap::new();
    let mut ready: BTreeMap<String, i64> = BTreeMap::new();
    let mut desired: BTreeMap<String, u64> = BTreeMap::new();
    for g in &s.glance.groups {
        let group = g.id.as_str().to_owned();
        for (stage, n) in STAGES.iter().zip(g.counts.stages) {
            if n > 0 {
                by_stage.insert((group.clone(), stage_label(*stage)), int(n));
            }
        }
        if let Some(count) = g.desired {
            desired.insert(group.clone(), u64::from(count));
        }
        if g.desired.is_some() || g.counts.nodes() > 0 {
            ready.insert(group, int(g.counts.ready));
        }
    }
    let stages: Vec<(Labels, i64)> = by_stage
        .into_iter()
        .map(|((g, st), v)| (vec![("group", g), ("stage", st)], v))
        .collect();
    gauge(e, "swactor_nodes", "Nodes by group and stage.", &stages)?;
    let ready_v: Vec<(Labels, i64)> = ready
        .iter()
        .map(|(g, v)| (vec![("group", g.clone())], *v))
        .collect();
    gauge(
        e,
        "swactor_group_ready_nodes",
        "Ready nodes per group.",
        &ready_v,
    )?;
    let desired_v: Vec<(Labels, i64)> = desired
        .iter()
        .map(|(g, v)| {
            (
                vec![("group", g.clone())],
                i64::try_from(*v).unwrap_or(i64::MAX),
            )
        })
        .collect();
    gauge(
        e,
        "swactor_group_desired_nodes",
        "Desired nodes per group.",
        &desired_v,
    )
}

/// Encodes the cluster-wide state: node counts, generation, convergence,
/// pause and the groups' holds.
fn encode_cluster_state(e: &mut DescriptorEncoder, s: &Scraped) -> Result<(), std::fmt::Error> {
    let snap = &s.glance;
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    gauge(
        e,
        "swactor_ready_nodes",
        "Ready nodes.",
        &[(vec![], int(snap.ready()))],
    )?;
    gauge(
        e,
        "swactor_desired_nodes",
        "Slots of the desired shape.",
        &[(vec![], int(snap.desired_nodes))],
    )?;
    gauge(
        e,
        "swactor_generation",
        "The desired generation.",
        &[(vec![], int(snap.generation.0))],
    )?;
    gauge(
        e,
        "swactor_converged",
        "1 when converged on the desired generation.",
        &[(vec![], i64::from(snap.converged))],
    )?;
    gauge(
        e,
        "swactor_paused",
        "1 while reconciling is paused.",
        &[(vec![], i64::from(snap.paused))],
    )?;
    let holds: Vec<(Labels, i64)> = snap
        .holds
        .iter()
        .map(|h| {
            let kind = match h.kind {
                swactor_provisioning::HoldKind::Rollout => "rollout",
                swactor_provisioning::HoldKind::Remediation => "remediation",
            };
            (
                vec![("group", h.group.to_string()), ("kind", kind.to_owned())],
                1,
            )
        })
        .collect();
    gauge(
        e,
        "swactor_group_held",
        "1 while a group holds back: a rollout waiting on its budget or stopped \
         (kind=rollout), or remediation paused by its breaker (kind=remediation).",
        &holds,
    )
}

/// Encodes what the daemon is working through and has done: orphans, the
/// executor's queue, subscribers, passes, dispatches and the last
/// convergence's duration.
fn encode_activity(e: &mut DescriptorEncoder, s: &Scraped) -> Result<(), std::fmt::Error> {
    let snap = &s.glance;
    gauge(
        e,
        "swactor_orphans",
        "Leftover resources being collected.",
        &[(vec![], snap.orphans as i64)],
    )?;
    gauge(
        e,
        "swactor_executor_queue_depth",
        "Operations handed to the executor whose results have not come back.",
        &[(vec![], snap.in_flight as i64)],
    )?;
    gauge(
        e,
        "swactor_telemetry_subscribers",
        "Telemetry subscribers (swactor watch, dashboard pages).",
        &[(vec![], s.subscribers as i64)],
    )?;
    counter(
        e,
        "swactor_passes",
        "Reconcile passes run by the cluster's driver.",
        snap.stats.passes,
    )?;
    counter(
        e,
        "swactor_dispatched_operations",
        "Operations the driver dispatched (its lifetime counter; swactor_dispatches_total \
         has them by effect).",
        snap.stats.dispatched,
    )?;
    // From the same counters as the total, read at the same moment: the
    // kinds add up to it at every scrape, and every kind has its series
    // from 0 (a resumed daemon's first lookups included, which come
    // before anything could follow the events).
    let mut by_effect = e.encode_descriptor(
        "swactor_dispatches",
        "Operations the driver dispatched, by effect kind (they add up to \
         swactor_dispatched_operations_total).",
        None,
        MetricType::Counter,
    )?;
    for kind in swactor_provisioning::EffectKind::ALL {
        let labels: Labels = vec![("effect", effect_label(kind).to_owned())];
        ConstCounter::new(snap.stats.dispatched_of(kind))
            .encode(by_effect.encode_family(&labels)?)?;
    }
    if let Some((generation, took)) = s.convergence {
        gauge(
            e,
            "swactor_last_convergence_seconds",
            "How long the last converged generation took, from its acceptance.",
            &[(
                vec![("generation", generation.to_string())],
                took.as_secs_f64(),
            )],
        )?;
    }
    Ok(())
}

/// Encodes the slots given a new attempt, by reason: each reason once it
/// has happened.
fn encode_replacements(
    e: &mut DescriptorEncoder,
    g: &ClusterGlance,
) -> Result<(), std::fmt::Error> {
    let mut metric = e.encode_descriptor(
        "swactor_replacements",
        "Nodes whose attempt was replaced by a new one since the daemon started, by reason.",
        None,
        MetricType::Counter,
    )?;
    for (cause, n) in CAUSES.iter().zip(g.replacements) {
        if n > 0 {
            let labels: Labels = vec![("reason", replacement_reason(*cause).to_owned())];
            ConstCounter::new(n).encode(metric.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// Encodes what the run costs: the rentals' hourly price, the spend so far
/// and the budget; and how long it has left to live.
fn encode_costs(e: &mut DescriptorEncoder, s: &Scraped) -> Result<(), std::fmt::Error> {
    let snap = &s.glance;
    let mut price: BTreeMap<String, u64> = s.priced.iter().map(|p| ((*p).to_owned(), 0)).collect();
    for r in &s.rentals {
        *price.entry(r.provider.clone()).or_default() += r.usd_per_hour_micros;
    }
    if !price.is_empty() {
        let values: Vec<(Labels, f64)> = price
            .into_iter()
            .map(|(p, micros)| (vec![("provider", p)], micros as f64 / 1e6))
            .collect();
        gauge(
            e,
            "swactor_cluster_usd_per_hour",
            "What the rented machines of the current attempts cost, in dollars per hour.",
            &values,
        )?;
    }
    if let Some(spend) = s.spend {
        gauge(
            e,
            "swactor_run_spent_usd",
            "What the run's rented machines have cost so far, ended rentals included, in dollars.",
            &[(Vec::new(), spend.spent_micros as f64 / 1e6)],
        )?;
    }
    if let Some(budget) = snap.budget {
        gauge(
            e,
            "swactor_run_budget_usd",
            "The run's dollar budget (budget_usd).",
            &[(Vec::new(), budget.usd_micros as f64 / 1e6)],
        )?;
    }
    if let Some(swactor_provisioning::lifetime::Status {
        verdict: swactor_provisioning::lifetime::Verdict::Within { left_ms, which },
        ..
    }) = snap.lifetime
    {
        gauge(
            e,
            "swactor_run_lifetime_left_seconds",
            "Seconds until the run tears itself down, by the setting whose deadline \
             comes first (max_lifetime_s or idle_teardown_s).",
            &[(
                vec![("setting", which.field().to_owned())],
                left_ms as f64 / 1e3,
            )],
        )?;
    }
    Ok(())
}

/// Longest label value taken from text from outside (a leader's name).
const LABEL_TEXT_MAX_CHARS: usize = 128;

/// `text` as a label value: the encoder writes label values as they are,
/// so a quote, a backslash or a line break in a name that came from etcd
/// would end the value early or break the line; they are escaped as the
/// exposition format says, and a very long name is cut.
fn label_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(LABEL_TEXT_MAX_CHARS) + 8);
    for c in text.chars().take(LABEL_TEXT_MAX_CHARS) {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// Encodes who leads the run and who stands by, when several daemons share
/// it (`swactor up --etcd`); nothing for a daemon alone on its journal.
fn encode_ha(e: &mut DescriptorEncoder, s: &Scraped) -> Result<(), std::fmt::Error> {
    let Some(ha) = &s.ha else {
        return Ok(());
    };
    let secs = |ms: u64| ms as f64 / 1e3;
    gauge(
        e,
        "swactor_ha_leader",
        "1, labelled with the daemon that leads the run (host and pid), when several \
         daemons share its journal in etcd.",
        &[(vec![("leader", label_text(&ha.leader))], 1)],
    )?;
    gauge(
        e,
        "swactor_ha_standbys",
        "Daemons standing by to take the run over if its leader goes.",
        &[(
            Vec::new(),
            i64::try_from(ha.standbys.len()).unwrap_or(i64::MAX),
        )],
    )?;
    gauge(
        e,
        "swactor_ha_lease_renewed_seconds_ago",
        "How long ago, on the leader's clock, its etcd lease was last renewed.",
        &[(Vec::new(), secs(ha.renewed_ms_ago))],
    )?;
    gauge(
        e,
        "swactor_ha_lease_ttl_seconds",
        "How long the leader's etcd lease lives without a renewal; the leader stops \
         acting its margin before that.",
        &[(Vec::new(), secs(ha.lease_ttl_ms))],
    )?;
    counter(
        e,
        "swactor_ha_terms",
        "Times this daemon took the lead since it started.",
        ha.terms,
    )?;
    counter(
        e,
        "swactor_ha_provider_calls",
        "Provider calls the leader's current term let through its leadership gate.",
        ha.provider_calls,
    )?;
    counter(
        e,
        "swactor_ha_provider_calls_refused",
        "Provider calls the current term's gate refused, unsent, because they were \
         picked up past the leadership bound.",
        ha.provider_calls_refused,
    )?;
    counter(
        e,
        "swactor_ha_journal_commits",
        "Journal commits the leader's current term sent to etcd.",
        ha.journal_commits,
    )
}

/// A provider whose every call is timed and whose failures are counted.
pub(crate) struct Metered {
    inner: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
}

impl Metered {
    pub(crate) fn wrap(inner: Arc<dyn Provider>, metrics: Arc<Metrics>) -> Arc<dyn Provider> {
        Arc::new(Self { inner, metrics })
    }

    fn record<T>(&self, call: &'static str, started: Instant, result: &Result<T, ProviderError>) {
        let failed = result.as_ref().err().map(failure_labels);
        self.metrics
            .call(self.inner.kind(), call, started.elapsed(), failed);
    }
}

impl std::fmt::Debug for Metered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Metered({})", self.inner.kind())
    }
}

#[async_trait]
impl Provider for Metered {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn create_lease(
        &self,
        key: &ResourceKey,
        template: &NodeTemplate,
    ) -> Result<LeaseGrant, ProviderError> {
        let started = Instant::now();
        let r = self.inner.create_lease(key, template).await;
        self.record("create_lease", started, &r);
        r
    }

    async fn lookup_endpoint(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<NodeEndpoint, ProviderError> {
        let started = Instant::now();
        let r = self.inner.lookup_endpoint(key, lease).await;
        self.record("lookup_endpoint", started, &r);
        r
    }

    async fn start_bootstrap(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        endpoint: &NodeEndpoint,
        template: &NodeTemplate,
    ) -> Result<BootstrapSession, ProviderError> {
        let started = Instant::now();
        let r = self
            .inner
            .start_bootstrap(key, lease, endpoint, template)
            .await;
        self.record("start_bootstrap", started, &r);
        r
    }

    async fn cancel_bootstrap(
        &self,
        key: &ResourceKey,
        session: &SessionId,
    ) -> Result<Release, ProviderError> {
        let started = Instant::now();
        let r = self.inner.cancel_bootstrap(key, session).await;
        self.record("cancel_bootstrap", started, &r);
        r
    }

    async fn destroy_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
    ) -> Result<Release, ProviderError> {
        let started = Instant::now();
        let r = self.inner.destroy_lease(key, lease).await;
        self.record("destroy_lease", started, &r);
        r
    }

    async fn destroy_failed_lease(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        reason: &str,
    ) -> Result<Release, ProviderError> {
        let started = Instant::now();
        let r = self.inner.destroy_failed_lease(key, lease, reason).await;
        self.record("destroy_lease", started, &r);
        r
    }

    async fn list(&self, run_id: &RunId) -> Result<Inventory, ProviderError> {
        let started = Instant::now();
        // Debug builds only: `SWACTOR_FAULT_LIST_DELAY_MS=N` holds every
        // listing back N ms, so a test can make agents' joins reach a
        // restarted daemon before it has adopted its journal.
        #[cfg(debug_assertions)]
        if let Some(ms) = std::env::var("SWACTOR_FAULT_LIST_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let r = self.inner.list(run_id).await;
        self.record("list", started, &r);
        r
    }

    async fn paused(&self, key: &ResourceKey, lease: &LeaseId) -> Result<bool, ProviderError> {
        let started = Instant::now();
        let r = self.inner.paused(key, lease).await;
        self.record("paused", started, &r);
        r
    }

    fn listing_lag(&self) -> Duration {
        self.inner.listing_lag()
    }

    fn capacity(&self) -> Option<swactor_provisioning::Capacity> {
        self.inner.capacity()
    }

    fn describe_lease(&self, lease: &LeaseId) -> Option<String> {
        self.inner.describe_lease(lease)
    }

    fn foreign(&self) -> Vec<swactor_providers::ForeignResource> {
        self.inner.foreign()
    }

    // Not timed: reading a log is an operator's request, not one of the
    // reconciler's effects, and a followed log lasts as long as it is read.
    async fn agent_log(
        &self,
        key: &ResourceKey,
        lease: &LeaseId,
        follow: bool,
    ) -> Result<swactor_providers::AgentLogSource, ProviderError> {
        self.inner.agent_log(key, lease, follow).await
    }

    fn owns_lease(&self, lease: &LeaseId) -> bool {
        self.inner.owns_lease(lease)
    }

    fn owns_session(&self, session: &SessionId) -> bool {
        self.inner.owns_session(session)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_actors::{GroupCounts, GroupGlance};
    use swactor_provisioning::NodeStage;

    #[test]
    fn stages_and_reasons_are_fixed_snake_case_label_values() {
        assert_eq!(
            stage_label(NodeStage::BootstrapRunning),
            "bootstrap_running"
        );
        assert_eq!(stage_label(NodeStage::New), "new");
        assert_eq!(replacement_reason(None), "shape_change");
        let labels = [
            (FailureCause::Operator, "operator"),
            (FailureCause::Preempted, "preempted"),
            (FailureCause::AgentLost, "agent_lost"),
            (FailureCause::Timeout, "timeout"),
            (FailureCause::Failure, "failure"),
        ];
        for (cause, label) in labels {
            assert_eq!(replacement_reason(Some(cause)), label, "{cause:?}");
        }
    }

    fn scraped(glance: ClusterGlance) -> Scraped {
        Scraped {
            glance,
            rentals: Vec::new(),
            spend: None,
            ha: None,
            subscribers: 0,
            priced: Vec::new(),
            convergence: None,
        }
    }

    fn group(
        id: &str,
        desired: Option<u32>,
        stages: &[(NodeStage, u64)],
        ready: u64,
    ) -> GroupGlance {
        let mut counts = GroupCounts::default();
        for (stage, n) in stages {
            let at = STAGES.iter().position(|s| s == stage).unwrap();
            counts.stages[at] = *n;
        }
        counts.ready = ready;
        GroupGlance {
            id: swactor_provisioning::GroupId::new(id),
            desired,
            counts,
        }
    }

    /// The lines of `text` that start with `prefix`, sorted.
    fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        let mut out: Vec<&str> = text.lines().filter(|l| l.starts_with(prefix)).collect();
        out.sort_unstable();
        out
    }

    #[test]
    fn the_groups_counts_are_exported_as_the_nodes_were() {
        let mut glance = ClusterGlance::empty("r");
        glance.desired_nodes = 7;
        glance.groups = vec![
            // A group the shape no longer has, its nodes leaving.
            group(
                "old",
                None,
                &[(NodeStage::Destroyed, 1), (NodeStage::Dormant, 1)],
                0,
            ),
            // A desired group with no node yet.
            group("spare", Some(2), &[], 0),
            group(
                "worker",
                Some(5),
                &[
                    (NodeStage::Dormant, 3),
                    (NodeStage::BootstrapRunning, 1),
                    (NodeStage::HandedOff, 1),
                ],
                4,
            ),
        ];
        let text = Metrics::new().encode(scraped(glance));
        assert_eq!(
            lines(&text, "swactor_nodes{"),
            [
                "swactor_nodes{group=\"old\",stage=\"destroyed\"} 1",
                "swactor_nodes{group=\"old\",stage=\"dormant\"} 1",
                "swactor_nodes{group=\"worker\",stage=\"bootstrap_running\"} 1",
                "swactor_nodes{group=\"worker\",stage=\"dormant\"} 3",
                "swactor_nodes{group=\"worker\",stage=\"handed_off\"} 1",
            ]
        );
        assert_eq!(
            lines(&text, "swactor_group_ready_nodes{"),
            [
                "swactor_group_ready_nodes{group=\"old\"} 0",
                "swactor_group_ready_nodes{group=\"spare\"} 0",
                "swactor_group_ready_nodes{group=\"worker\"} 4",
            ]
        );
        assert_eq!(
            lines(&text, "swactor_group_desired_nodes{"),
            [
                "swactor_group_desired_nodes{group=\"spare\"} 2",
                "swactor_group_desired_nodes{group=\"worker\"} 5",
            ]
        );
        assert_eq!(
            lines(&text, "swactor_ready_nodes "),
            ["swactor_ready_nodes 4"]
        );
        assert_eq!(
            lines(&text, "swactor_desired_nodes "),
            ["swactor_desired_nodes 7"]
        );
    }

    #[test]
    fn replacements_are_exported_by_reason_once_one_happened() {
        let none = Metrics::new().encode(scraped(ClusterGlance::empty("r")));
        assert!(
            none.contains(
                "# HELP swactor_replacements Nodes whose attempt was replaced by a new one since \
                 the daemon started, by reason.\n# TYPE swactor_replacements counter\n"
            ),
            "{none}"
        );
        assert!(
            lines(&none, "swactor_replacements_total").is_empty(),
            "{none}"
        );
        let mut glance = ClusterGlance::empty("r");
        // In the order of CAUSES: a new template, the operator, preempted,
        // agent lost, timeout, failure.
        glance.replacements = [2, 1, 0, 3, 0, 5];
        let text = Metrics::new().encode(scraped(glance));
        assert_eq!(
            lines(&text, "swactor_replacements_total"),
            [
                "swactor_replacements_total{reason=\"agent_lost\"} 3",
                "swactor_replacements_total{reason=\"failure\"} 5",
                "swactor_replacements_total{reason=\"operator\"} 1",
                "swactor_replacements_total{reason=\"shape_change\"} 2",
            ]
        );
    }

    #[test]
    fn a_failed_call_is_counted_by_its_class_and_kind_not_its_words() {
        let metrics = Metrics::new();
        let e = ProviderError::definite(FaultKind::NoCapacity, "the unreachable host is full");
        assert_eq!(failure_labels(&e), ("definite", "no_capacity"));
        assert_eq!(
            failure_labels(&ProviderError::NotReady),
            ("not_ready", "none")
        );
        metrics.call(
            "vast",
            "create_lease",
            Duration::ZERO,
            Some(failure_labels(&e)),
        );
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &metrics.registry);
        assert!(
            out.contains(
                "swactor_provider_call_failures_total{provider=\"vast\",call=\"create_lease\",\
                 class=\"definite\",kind=\"no_capacity\"} 1"
            ),
            "{out}"
        );
    }

    fn scrape(ha: Option<swactor_actors::HaStatus>) -> String {
        let mut scraped = scraped(ClusterGlance::empty("r"));
        scraped.ha = ha;
        Metrics::new().encode(scraped)
    }

    #[test]
    fn who_leads_is_exported_only_when_daemons_share_the_run() {
        let alone = scrape(None);
        assert!(alone.contains("swactor_generation 0"), "{alone}");
        assert!(!alone.contains("swactor_ha_"), "{alone}");
        let shared = scrape(Some(swactor_actors::HaStatus {
            leader: "ctl-a (pid 4242)".to_owned(),
            leading_since_wall_ms: 1_700_000_000_000,
            standbys: vec!["ctl-b (pid 77)".to_owned(), "ctl-c (pid 9)".to_owned()],
            lease_ttl_ms: 10_000,
            margin_ms: 2_000,
            renewed_ms_ago: 1_250,
            etcd: "https://etcd-0:2379".to_owned(),
            terms: 3,
            provider_calls: 12,
            provider_calls_refused: 1,
            journal_commits: 7,
        }));
        for line in [
            "swactor_ha_leader{leader=\"ctl-a (pid 4242)\"} 1\n",
            "swactor_ha_standbys 2\n",
            "swactor_ha_lease_renewed_seconds_ago 1.25\n",
            "swactor_ha_lease_ttl_seconds 10.0\n",
            "swactor_ha_terms_total 3\n",
            "swactor_ha_provider_calls_total 12\n",
            "swactor_ha_provider_calls_refused_total 1\n",
            "swactor_ha_journal_commits_total 7\n",
        ] {
            assert!(shared.contains(line), "{line} in {shared}");
        }
        // Everything else is as it was (but the allocator's figures, which
        // move between any two scrapes).
        let read = |text: &str, ha: bool| -> Vec<String> {
            text.lines()
                .filter(|l| !l.contains("swactor_allocator_") && (ha || !l.contains("swactor_ha_")))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(read(&shared, false), read(&alone, true));
    }

    #[test]
    fn a_leader_name_cannot_break_out_of_its_label() {
        assert_eq!(label_text("a\"} 1\nb\\"), "a\\\"} 1\\nb\\\\");
        assert_eq!(label_text("ctl\u{7}-a"), "ctl-a");
        assert_eq!(label_text(&"x".repeat(500)).len(), LABEL_TEXT_MAX_CHARS);
    }

    #[test]
    fn a_release_given_up_is_counted() {
        let metrics = Metrics::new();
        let key = swactor_provisioning::ResourceKey {
            run_id: swactor_provisioning::RunId::new("r"),
            node: swactor_provisioning::LogicalNodeId::parse("w-0").unwrap(),
            attempt: swactor_provisioning::NodeAttemptId(1),
        };
        for _ in 0..2 {
            metrics.observe(&ClusterEvent::GivenUp {
                key: key.clone(),
                reason: "h1 has not answered".to_owned(),
            });
        }
        assert_eq!(metrics.given_up.get_or_create(&Vec::new()).get(), 2);
    }
}
