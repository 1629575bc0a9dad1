//! Connection caps per protocol, and refusals counted instead of logged one by one.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use iroh::EndpointId;

/// Default interval between two summaries of refused connections.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Caps on the connections one protocol of a guarded router serves at once.
///
/// A connection over a cap is closed with [`super::codes::CLOSE_BUSY`] right
/// after the handshake, before its handler is called; its slot is freed
/// when the handler returns, so a handler that hands its connection to a
/// task of its own and returns early lets it escape the count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most connections served at once on the protocol, from all peers together.
    pub connections_max: usize,
    /// Most connections served at once on the protocol from one endpoint id.
    pub connections_per_peer_max: usize,
    /// Refusals after the first are counted and logged as one summary line
    /// per interval at most.
    pub refusal_log_interval: Duration,
}

impl Limits {
    /// Defaults for a protocol open to any peer (such as swarm joins): many
    /// agents, but few connections from any one of them.
    pub const OPEN: Self = Self {
        connections_max: 4096,
        connections_per_peer_max: 4,
        refusal_log_interval: REFUSAL_LOG_INTERVAL,
    };

    /// Defaults for a protocol with an allowlist (control, telemetry): few
    /// connections in all. The per-peer cap equals the total because every
    /// invocation of a CLI presents the same key; the allowlist, not the
    /// cap, keeps strangers out.
    pub const ALLOWLISTED: Self = Self {
        connections_max: 64,
        connections_per_peer_max: 64,
        refusal_log_interval: REFUSAL_LOG_INTERVAL,
    };

    /// Defaults for a protocol whose allowlist admits the key of every
    /// linked agent (the workspace blobs): the allowlist holds agents only,
    /// so there may be as many connections in all as on an open protocol,
    /// and few from any one of them. ([`Limits::ALLOWLISTED`] capped a
    /// workspace at 64 nodes at once.)
    pub const LINKED: Self = Self {
        connections_max: Self::OPEN.connections_max,
        connections_per_peer_max: 4,
        refusal_log_interval: REFUSAL_LOG_INTERVAL,
    };

    /// The defaults for `allowlist`: [`Limits::OPEN`] if it is open to
    /// everyone now, else [`Limits::ALLOWLISTED`].
    #[must_use]
    pub fn for_allowlist(allowlist: &super::Allowlist) -> Self {
        if allowlist.is_open() {
            Self::OPEN
        } else {
            Self::ALLOWLISTED
        }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`LimitsError`] naming the offending field.
    pub fn validate(&self) -> Result<(), LimitsError> {
        if self.connections_max == 0 {
            return Err(LimitsError::ZeroConnections);
        }
        if self.connections_per_peer_max == 0 {
            return Err(LimitsError::ZeroConnectionsPerPeer);
        }
        if self.refusal_log_interval.is_zero() {
            return Err(LimitsError::ZeroRefusalLogInterval);
        }
        Ok(())
    }
}

/// Invalid [`Limits`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    /// Nobody could ever connect.
    #[error("connections_max must be at least 1")]
    ZeroConnections,
    /// Nobody could ever connect.
    #[error("connections_per_peer_max must be at least 1")]
    ZeroConnectionsPerPeer,
    /// Every refusal would be logged on its own.
    #[error("refusal_log_interval must be longer than zero")]
    ZeroRefusalLogInterval,
}

/// Why a guarded router refused a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The peer is not on the protocol's allowlist.
    Allowlist,
    /// The peer already holds [`Limits::connections_per_peer_max`] connections.
    PerPeerCap,
    /// The protocol already serves [`Limits::connections_max`] connections.
    TotalCap,
    /// The endpoint started as many handshakes as its
    /// [`HandshakeRate`](super::HandshakeRate) allows (refused before the
    /// handshake, so before any protocol is known).
    HandshakeRate,
}

impl Refusal {
    pub(crate) fn close_reason(self) -> &'static [u8] {
        match self {
            Self::Allowlist => super::codes::REASON_NOT_ALLOWED,
            Self::PerPeerCap => super::codes::REASON_PEER_BUSY,
            Self::TotalCap | Self::HandshakeRate => super::codes::REASON_BUSY,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Allowlist => "not on the allowlist",
            Self::PerPeerCap => "over the per-peer connection cap",
            Self::TotalCap => "over the connection cap",
            Self::HandshakeRate => "over the rate of new handshakes",
        })
    }
}

#[derive(Debug, Default)]
struct SlotTable {
    connections: usize,
    per_peer: HashMap<EndpointId, usize>,
}

/// The total cap of one served protocol, which its owner may move while
/// the router runs (the agents' protocols follow the cluster's size). A
/// lowered cap closes nothing: it refuses new connections until fewer are
/// served.
#[derive(Clone, Debug)]
pub struct ConnectionCap(Arc<AtomicUsize>);

impl ConnectionCap {
    fn new(max: usize) -> Self {
        Self(Arc::new(AtomicUsize::new(max)))
    }

    /// The cap now.
    #[must_use]
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the cap to `max` (at least 1).
    pub fn set(&self, max: usize) {
        self.0.store(max.max(1), Ordering::Relaxed);
    }
}

/// The connections one protocol serves now, counted in total and per peer.
///
/// The per-peer map holds only peers with a live connection, so it never
/// has more than [`Limits::connections_max`] entries (or the cap it was
/// moved to).
#[derive(Clone, Debug)]
pub(crate) struct Slots {
    connections_max: ConnectionCap,
    connections_per_peer_max: usize,
    table: Arc<Mutex<SlotTable>>,
}

impl Slots {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            connections_max: ConnectionCap::new(limits.connections_max),
            connections_per_peer_max: limits.connections_per_peer_max,
            table: Arc::default(),
        }
    }

    /// The handle that moves the total cap.
    pub(crate) fn cap(&self) -> ConnectionCap {
        self.connections_max.clone()
    }

    /// Takes a slot for a connection from `peer`, unless a cap is reached.
    pub(crate) fn try_acquire(&self, peer: EndpointId) -> Result<Slot, Refusal> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let held = table.per_peer.get(&peer).copied().unwrap_or(0);
        if held >= self.connections_per_peer_max {
            return Err(Refusal::PerPeerCap);
        }
        if table.connections >= self.connections_max.get() {
            return Err(Refusal::TotalCap);
        }
        table.connections += 1;
        table.per_peer.insert(peer, held + 1);
        Ok(Slot {
            table: Arc::clone(&self.table),
            peer,
        })
    }

    /// Connections now holding a slot.
    #[cfg(test)]
    fn connections(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .connections
    }
}

/// One connection's place in [`Slots`]; dropping it frees the place.
#[derive(Debug)]
pub(crate) struct Slot {
    table: Arc<Mutex<SlotTable>>,
    peer: EndpointId,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        table.connections -= 1;
        if let Some(held) = table.per_peer.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                table.per_peer.remove(&self.peer);
            }
        }
    }
}

/// Refusals counted by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RefusalCounts {
    pub(crate) allowlist: u64,
    pub(crate) per_peer_cap: u64,
    pub(crate) total_cap: u64,
    pub(crate) handshake_rate: u64,
}

impl RefusalCounts {
    fn add(&mut self, refusal: Refusal) {
        let count = match refusal {
            Refusal::Allowlist => &mut self.allowlist,
            Refusal::PerPeerCap => &mut self.per_peer_cap,
            Refusal::TotalCap => &mut self.total_cap,
            Refusal::HandshakeRate => &mut self.handshake_rate,
        };
        *count = count.saturating_add(1);
    }

    pub(crate) fn total(&self) -> u64 {
        self.allowlist
            .saturating_add(self.per_peer_cap)
            .saturating_add(self.total_cap)
            .saturating_add(self.handshake_rate)
    }
}

/// A summary of the refusals since the last line about them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub(crate) struct RefusalSummary {
    pub(crate) counts: RefusalCounts,
    /// How long the counts were gathered over.
    pub(crate) over: Duration,
}

impl RefusalSummary {
    /// The log line, e.g. "refused 3,412 connections on swactor/swarm/0 in
    /// the last 10 s (allowlist: 3,400, per-peer cap: 12)".
    pub(crate) fn line(&self, alpn: &str) -> String {
        let c = &self.counts;
        let parts: Vec<String> = [
            ("allowlist", c.allowlist),
            ("per-peer cap", c.per_peer_cap),
            ("total cap", c.total_cap),
            ("handshake rate", c.handshake_rate),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{what}: {}", thousands(n)))
        .collect();
        let noun = if c.total() == 1 {
            "connection"
        } else {
            "connections"
        };
        format!(
            "refused {} {noun} on {alpn} in the last {} ({})",
            thousands(c.total()),
            seconds(self.over),
            parts.join(", ")
        )
    }
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

fn seconds(d: Duration) -> String {
    if d < Duration::from_secs(10) {
        format!("{:.1} s", d.as_secs_f64())
    } else {
        format!("{} s", d.as_secs_f64().round())
    }
}

/// Decides which refusals of one protocol are logged: the first after a
/// quiet interval on its own, the rest as at most one summary per interval.
///
/// A pure state machine: the driver calls [`RefusalLog::handle_refusal`] for
/// every refusal, and [`RefusalLog::poll_summary`] when
/// [`RefusalLog::poll_timeout`] is reached, logging what they return.
#[derive(Debug)]
pub(crate) struct RefusalLog {
    interval: Duration,
    /// `None` while quiet: the next refusal is logged on its own.
    window: Option<Window>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    counts: RefusalCounts,
}

impl RefusalLog {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval,
            window: None,
        }
    }

    /// Records a refusal; `true` if it should be logged on its own.
    #[must_use]
    pub(crate) fn handle_refusal(&mut self, refusal: Refusal, now: Instant) -> bool {
        match &mut self.window {
            Some(window) => {
                window.counts.add(refusal);
                false
            }
            None => {
                self.window = Some(Window {
                    started: now,
                    counts: RefusalCounts::default(),
                });
                true
            }
        }
    }

    /// The summary due at `now`, if any. An interval without refusals ends
    /// the window, so that the next refusal is logged on its own again.
    pub(crate) fn poll_summary(&mut self, now: Instant) -> Option<RefusalSummary> {
        let window = self.window.as_mut()?;
        let over = now.saturating_duration_since(window.started);
        if over < self.interval {
            return None;
        }
        if window.counts.total() == 0 {
            self.window = None;
            return None;
        }
        let counts = std::mem::take(&mut window.counts);
        window.started = now;
        Some(RefusalSummary { counts, over })
    }

    /// When [`RefusalLog::poll_summary`] next has something to do; `None`
    /// while quiet.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.window.as_ref().map(|w| w.started + self.interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iroh::SecretKey;

    fn limits(connections_max: usize, connections_per_peer_max: usize) -> Limits {
        Limits {
            connections_max,
            connections_per_peer_max,
            ..Limits::OPEN
        }
    }

    #[test]
    fn slots_enforce_both_caps_and_free_on_drop() {
        let slots = Slots::new(&limits(3, 2));
        let a = SecretKey::generate().public();
        let b = SecretKey::generate().public();
        let a1 = slots.try_acquire(a).unwrap();
        let a2 = slots.try_acquire(a).unwrap();
        assert_eq!(slots.try_acquire(a).unwrap_err(), Refusal::PerPeerCap);
        let b1 = slots.try_acquire(b).unwrap();
        assert_eq!(slots.try_acquire(b).unwrap_err(), Refusal::TotalCap);
        assert_eq!(slots.connections(), 3);
        drop(a1);
        let b2 = slots.try_acquire(b).unwrap();
        assert_eq!(slots.try_acquire(a).unwrap_err(), Refusal::TotalCap);
        drop((a2, b1, b2));
        assert_eq!(slots.connections(), 0);
        let table = slots.table.lock().unwrap();
        assert!(
            table.per_peer.is_empty(),
            "no entry outlives its peer's last slot"
        );
    }

    #[test]
    fn a_moved_cap_admits_more_at_once_and_a_lowered_one_closes_nothing() {
        let slots = Slots::new(&limits(2, 8));
        let cap = slots.cap();
        let peer = SecretKey::generate().public();
        let held: Vec<Slot> = (0..2).map(|_| slots.try_acquire(peer).unwrap()).collect();
        assert_eq!(slots.try_acquire(peer).unwrap_err(), Refusal::TotalCap);
        cap.set(4);
        let more: Vec<Slot> = (0..2).map(|_| slots.try_acquire(peer).unwrap()).collect();
        assert_eq!(slots.try_acquire(peer).unwrap_err(), Refusal::TotalCap);
        // Lowered below what is served: those stay, new ones wait.
        cap.set(1);
        assert_eq!(slots.connections(), 4);
        drop(more);
        assert_eq!(slots.try_acquire(peer).unwrap_err(), Refusal::TotalCap);
        drop(held);
        let one = slots.try_acquire(peer).unwrap();
        assert_eq!(slots.try_acquire(peer).unwrap_err(), Refusal::TotalCap);
        drop(one);
        cap.set(0);
        assert_eq!(cap.get(), 1, "a cap never admits nothing");
    }

    #[test]
    fn the_first_refusal_is_logged_then_one_summary_per_interval() {
        let interval = Duration::from_secs(10);
        let mut log = RefusalLog::new(interval);
        let t0 = Instant::now();
        assert_eq!(log.poll_timeout(), None);
        assert!(log.handle_refusal(Refusal::Allowlist, t0));
        assert_eq!(log.poll_timeout(), Some(t0 + interval));
        for i in 0..3_400 {
            let now = t0 + Duration::from_millis(i);
            assert!(!log.handle_refusal(Refusal::Allowlist, now));
        }
        for _ in 0..12 {
            assert!(!log.handle_refusal(Refusal::PerPeerCap, t0));
        }
        assert_eq!(log.poll_summary(t0 + Duration::from_secs(9)), None);
        let t1 = t0 + interval;
        let summary = log.poll_summary(t1).unwrap();
        assert_eq!(
            summary.line("swactor/swarm/0"),
            "refused 3,412 connections on swactor/swarm/0 in the last 10 s \
             (allowlist: 3,400, per-peer cap: 12)"
        );
        // Still in a busy window: counted, not logged.
        assert!(!log.handle_refusal(Refusal::TotalCap, t1));
        let summary = log.poll_summary(t1 + interval).unwrap();
        assert_eq!(
            summary.line("a"),
            "refused 1 connection on a in the last 10 s (total cap: 1)"
        );
        // A quiet interval closes the window; the next refusal is logged again.
        assert_eq!(log.poll_summary(t1 + 2 * interval), None);
        assert_eq!(log.poll_timeout(), None);
        assert!(log.handle_refusal(Refusal::Allowlist, t1 + 3 * interval));
    }

    #[test]
    fn counts_print_with_thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn invalid_limits_are_rejected() {
        assert!(Limits::OPEN.validate().is_ok());
        assert!(Limits::ALLOWLISTED.validate().is_ok());
        assert_eq!(limits(0, 1).validate(), Err(LimitsError::ZeroConnections));
        assert_eq!(
            limits(1, 0).validate(),
            Err(LimitsError::ZeroConnectionsPerPeer)
        );
        let quiet = Limits {
            refusal_log_interval: Duration::ZERO,
            ..Limits::OPEN
        };
        assert_eq!(quiet.validate(), Err(LimitsError::ZeroRefusalLogInterval));
    }
}

/// A cap on connections that have not proved who they are yet, shared by
/// the protocols any peer may open (swarm joins, jobs links).
///
/// Anyone who has the daemon's address may open connections and send
/// nothing: each holds memory until its first-frame deadline. The guarded
/// router's caps count every connection of a protocol, joined agents'
/// included; this one counts only those still unauthenticated, so a flood
/// of strangers is bounded apart from the agents that joined, and a
/// joined agent's link never waits behind it. A handler enters before it
/// reads the first frame and leaves once it has a verdict.
#[derive(Clone, Debug)]
pub struct PreAuth {
    slots: Arc<tokio::sync::Semaphore>,
    max: usize,
}

/// A connection's place among the unauthenticated ones; dropping it
/// leaves.
#[derive(Debug)]
pub struct PreAuthSlot(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl PreAuth {
    /// The default: unauthenticated connections held at once.
    pub const DEFAULT_MAX: usize = 512;

    /// At most `max` unauthenticated connections at once.
    ///
    /// # Panics
    /// If `max` is 0: nobody could ever join.
    #[must_use]
    pub fn new(max: usize) -> Self {
        assert!(max > 0, "a pre-authentication cap of 0 admits nobody");
        Self {
            slots: Arc::new(tokio::sync::Semaphore::new(max)),
            max,
        }
    }

    /// A place for one more unauthenticated connection, if there is one.
    pub fn try_enter(&self) -> Option<PreAuthSlot> {
        Arc::clone(&self.slots)
            .try_acquire_owned()
            .ok()
            .map(PreAuthSlot)
    }

    /// The cap.
    #[must_use]
    pub fn max(&self) -> usize {
        self.max
    }
}

impl Default for PreAuth {
    fn default() -> Self {
        Self::new(Self::DEFAULT_MAX)
    }
}
