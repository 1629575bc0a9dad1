//! Which peers may use a protocol, and the router that enforces it per ALPN.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use iroh::endpoint::{Accepting, Connection};
use iroh::protocol::{AcceptError, IncomingFilterOutcome, ProtocolHandler, Router};
use iroh::{Endpoint, EndpointId};

use super::codes;
use super::limits::{ConnectionCap, Limits, Refusal, RefusalLog, Slots};
use super::rate::{Bucket, HandshakeRate};
use crate::timers::TaskGauge;

#[derive(Debug)]
enum Rule {
    Open,
    Only(BTreeSet<EndpointId>),
}

/// The peers allowed on one protocol; a shared handle, so changes apply to
/// connections accepted afterwards.
#[derive(Clone, Debug)]
pub struct Allowlist(Arc<RwLock<Rule>>);

impl Allowlist {
    /// Any authenticated peer may connect; for protocols that authenticate
    /// themselves, such as swarm joins presenting a token.
    #[must_use]
    pub fn open() -> Self {
        Self(Arc::new(RwLock::new(Rule::Open)))
    }

    /// Only the given peers may connect.
    #[must_use]
    pub fn only(peers: impl IntoIterator<Item = EndpointId>) -> Self {
        Self(Arc::new(RwLock::new(Rule::Only(
            peers.into_iter().collect(),
        ))))
    }

    /// Nobody may connect until allowed.
    #[must_use]
    pub fn closed() -> Self {
        Self::only([])
    }

    /// Lets `peer` connect. No effect on an open list.
    pub fn allow(&self, peer: EndpointId) {
        if let Rule::Only(peers) = &mut *self.0.write().unwrap_or_else(PoisonError::into_inner) {
            peers.insert(peer);
        }
    }

    /// Stops letting `peer` connect; returns whether it was listed.
    /// Connections already accepted are not affected.
    pub fn revoke(&self, peer: &EndpointId) -> bool {
        match &mut *self.0.write().unwrap_or_else(PoisonError::into_inner) {
            Rule::Only(peers) => peers.remove(peer),
            Rule::Open => false,
        }
    }

    /// Whether `peer` may connect now.
    #[must_use]
    pub fn is_allowed(&self, peer: &EndpointId) -> bool {
        match &*self.0.read().unwrap_or_else(PoisonError::into_inner) {
            Rule::Open => true,
            Rule::Only(peers) => peers.contains(peer),
        }
    }

    /// Whether the list is open to everyone.
    #[must_use]
    pub fn is_open(&self) -> bool {
        matches!(
            &*self.0.read().unwrap_or_else(PoisonError::into_inner),
            Rule::Open
        )
    }
}

/// The peer is not on the allowlist of the protocol it asked for.
#[derive(Debug, thiserror::Error)]
#[error("peer {peer} is not on the allowlist for {alpn}")]
pub struct NotAllowed {
    /// Who tried.
    pub peer: EndpointId,
    /// The protocol, lossily as text.
    pub alpn: String,
}

/// How long a peer whose first packet was admitted has to finish its
/// handshake, by default: as long as a dialler of ours waits for one
/// ([`NetConfig`](super::NetConfig)'s `connect_timeout`), so no handshake
/// one of ours still waits on is cut. Without a deadline, a handshake its
/// peer abandoned (a flood's attempt that gave up, a peer that never sends
/// its last flight) keeps its connection's state until QUIC's idle
/// timeout, 30 s by default.
pub const HANDSHAKE_FINISH_DEADLINE: Duration = Duration::from_secs(10);

/// A peer did not finish its handshake in time; the connection was dropped.
#[derive(Debug, thiserror::Error)]
#[error("the peer did not finish its handshake within {deadline:?}")]
pub struct HandshakeTooSlow {
    /// The deadline it missed.
    pub deadline: Duration,
}

/// What every protocol of one router shares about handshakes.
#[derive(Debug)]
struct Handshakes {
    /// Handshakes admitted and not yet finished (or dropped).
    under_way: TaskGauge,
    /// The finish deadline, in nanoseconds (settable on the builder after
    /// protocols are registered).
    deadline_nanos: AtomicU64,
}

impl Handshakes {
    fn new() -> Self {
        Self {
            under_way: TaskGauge::default(),
            deadline_nanos: AtomicU64::new(nanos(HANDSHAKE_FINISH_DEADLINE)),
        }
    }

    fn deadline(&self) -> Duration {
        Duration::from_nanos(self.deadline_nanos.load(Ordering::Relaxed))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Wraps a handler so only allowlisted peers, within the caps, reach it.
#[derive(Debug)]
struct Guarded<H> {
    alpn: &'static [u8],
    allowlist: Allowlist,
    slots: Slots,
    refusals: Arc<Mutex<RefusalLog>>,
    handshakes: Arc<Handshakes>,
    inner: H,
}

impl<H> Guarded<H> {
    fn alpn_text(&self) -> String {
        String::from_utf8_lossy(self.alpn).into_owned()
    }

    /// Counts a refusal, logging it only if it is the first after a quiet
    /// interval; the rest reach the log as summaries (see [`RefusalLog`]).
    fn record_refusal(&self, refusal: Refusal, peer: EndpointId) {
        if !count_refusal(&self.refusals, refusal, || self.alpn_text()) {
            return;
        }
        let alpn = self.alpn_text();
        match refusal {
            Refusal::Allowlist => {
                let error = NotAllowed {
                    peer,
                    alpn: alpn.clone(),
                };
                tracing::warn!(%error, "refusing connection; further refusals are summarised");
            }
            Refusal::PerPeerCap | Refusal::TotalCap | Refusal::HandshakeRate => tracing::warn!(
                %peer,
                %alpn,
                reason = %refusal,
                "refusing connection; further refusals are summarised"
            ),
        }
    }
}

/// Counts a refusal in `log`. True when it is the first after a quiet
/// interval: the caller logs that one, and a flusher starts that logs the
/// summaries of the rest under `label` and ends with the busy window (so a
/// burst that stops is still reported).
fn count_refusal(
    log: &Arc<Mutex<RefusalLog>>,
    refusal: Refusal,
    label: impl FnOnce() -> String,
) -> bool {
    let now = tokio::time::Instant::now().into_std();
    let first = log
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .handle_refusal(refusal, now);
    if first {
        tokio::spawn(flush_refusal_summaries(Arc::clone(log), label()));
    }
    first
}

async fn flush_refusal_summaries(log: Arc<Mutex<RefusalLog>>, alpn: String) {
    loop {
        let Some(at) = log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .poll_timeout()
        else {
            return;
        };
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        let now = tokio::time::Instant::now().into_std();
        let (summary, quiet) = {
            let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
            let summary = log.poll_summary(now);
            (summary, log.poll_timeout().is_none())
        };
        if let Some(summary) = summary {
            tracing::warn!(
                %alpn,
                refused = summary.counts.total(),
                allowlist = summary.counts.allowlist,
                per_peer_cap = summary.counts.per_peer_cap,
                total_cap = summary.counts.total_cap,
                handshake_rate = summary.counts.handshake_rate,
                "{}",
                summary.line(&alpn)
            );
        }
        if quiet {
            return;
        }
    }
}

impl<H: ProtocolHandler> ProtocolHandler for Guarded<H> {
    async fn on_accepting(&self, accepting: Accepting) -> Result<Connection, AcceptError> {
        // Finish the handshake here rather than in the inner handler so that
        // no 0-RTT data can reach it before the peer's identity is checked;
        // within the deadline, so an abandoned handshake does not hold its
        // state until the idle timeout (dropping it closes the connection).
        let _under_way = self.handshakes.under_way.enter();
        let deadline = self.handshakes.deadline();
        match tokio::time::timeout(deadline, accepting).await {
            Ok(connection) => Ok(connection?),
            Err(_) => Err(AcceptError::from_err(HandshakeTooSlow { deadline })),
        }
    }

    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let peer = conn.remote_id();
        let admitted = if self.allowlist.is_allowed(&peer) {
            self.slots.try_acquire(peer)
        } else {
            Err(Refusal::Allowlist)
        };
        match admitted {
            Ok(_slot) => self.inner.accept(conn).await,
            Err(refusal) => {
                let code = match refusal {
                    Refusal::Allowlist => codes::CLOSE_NOT_ALLOWED,
                    Refusal::PerPeerCap | Refusal::TotalCap | Refusal::HandshakeRate => {
                        codes::CLOSE_BUSY
                    }
                };
                conn.close(code, refusal.close_reason());
                self.record_refusal(refusal, peer);
                // Not an error: the router would log every one of them.
                Ok(())
            }
        }
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }
}

/// Builds an iroh [`Router`] whose every protocol has an allowlist and
/// connection caps ([`Limits`]).
///
/// A peer offering an ALPN that was not registered fails the TLS handshake;
/// a peer not on that ALPN's allowlist is closed with
/// [`codes::CLOSE_NOT_ALLOWED`], and one over a cap with
/// [`codes::CLOSE_BUSY`], before the handler sees it. Refusals are logged
/// at most once per [`Limits::refusal_log_interval`] and protocol, the
/// first on its own, the rest as a summary with counts per reason.
///
/// # Caveats
/// The caps count connections from the end of the TLS handshake until the
/// handler returns; how many handshakes start is bounded by
/// [`GuardedRouterBuilder::handshake_rate`] where one is set, and how long
/// each may take by [`GuardedRouterBuilder::handshake_deadline`] (from the
/// moment its protocol is known; reading that is bounded only by QUIC's
/// idle timeout), so handshakes under way are at most the rate's burst
/// plus its rate times the deadline. A failed handshake is still logged by
/// iroh's router.
#[derive(Debug)]
pub struct GuardedRouterBuilder {
    inner: iroh::protocol::RouterBuilder,
    rates: Vec<RateClass>,
    handshakes: Arc<Handshakes>,
    caps: Vec<(&'static [u8], ConnectionCap)>,
}

/// A handshake budget for some protocols (`None`: the others).
#[derive(Debug)]
struct RateClass {
    alpns: Option<Vec<&'static [u8]>>,
    rate: HandshakeRate,
    bucket: Mutex<Bucket>,
}

impl GuardedRouterBuilder {
    /// Starts a router for `endpoint`.
    #[must_use]
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            inner: Router::builder(endpoint),
            rates: Vec::new(),
            handshakes: Arc::new(Handshakes::new()),
            caps: Vec::new(),
        }
    }

    /// Drops a connection whose handshake has not finished within
    /// `deadline` of its protocol being known, on every protocol
    /// ([`HANDSHAKE_FINISH_DEADLINE`] unless set).
    ///
    /// # Panics
    /// If `deadline` is zero: deadlines are chosen in code, so that is a
    /// programming error.
    #[must_use]
    pub fn handshake_deadline(self, deadline: Duration) -> Self {
        assert!(
            !deadline.is_zero(),
            "a zero handshake deadline admits nothing"
        );
        self.handshakes
            .deadline_nanos
            .store(nanos(deadline), Ordering::Relaxed);
        self
    }

    /// A reader of how many handshakes are under way on this router.
    #[must_use]
    pub fn handshakes_under_way(&self) -> TaskGauge {
        self.handshakes.under_way.clone()
    }

    /// Serves `alpn` with `handler` for peers on `allowlist`, with the
    /// default caps for that allowlist ([`Limits::for_allowlist`], decided
    /// now: an allowlist opened later keeps the tighter caps).
    ///
    /// The handler's own `on_accepting` is bypassed (no 0-RTT), since the
    /// identity check has to happen after the handshake.
    #[must_use]
    pub fn serve<H: ProtocolHandler>(
        self,
        alpn: &'static [u8],
        allowlist: Allowlist,
        handler: H,
    ) -> Self {
        let limits = Limits::for_allowlist(&allowlist);
        self.serve_with_limits(alpn, allowlist, limits, handler)
    }

    /// Serves `alpn` with `handler` for peers on `allowlist`, at most as
    /// many connections at once as `limits` allow.
    ///
    /// # Panics
    /// If `limits` is invalid ([`Limits::validate`]): limits are chosen in
    /// code, so that is a programming error.
    #[must_use]
    pub fn serve_with_limits<H: ProtocolHandler>(
        self,
        alpn: &'static [u8],
        allowlist: Allowlist,
        limits: Limits,
        handler: H,
    ) -> Self {
        if let Err(error) = limits.validate() {
            panic!(
                "invalid limits for {}: {error}",
                String::from_utf8_lossy(alpn)
            );
        }
        let slots = Slots::new(&limits);
        let mut caps = self.caps;
        caps.push((alpn, slots.cap()));
        let guarded = Guarded {
            alpn,
            allowlist,
            slots,
            refusals: Arc::new(Mutex::new(RefusalLog::new(limits.refusal_log_interval))),
            handshakes: Arc::clone(&self.handshakes),
            inner: handler,
        };
        Self {
            inner: self.inner.accept(alpn, guarded),
            rates: self.rates,
            handshakes: self.handshakes,
            caps,
        }
    }

    /// The handle that moves the total connection cap of `alpn` while the
    /// router runs; `None` if `alpn` is not served.
    #[must_use]
    pub fn connection_cap(&self, alpn: &[u8]) -> Option<ConnectionCap> {
        self.caps
            .iter()
            .find(|(a, _)| *a == alpn)
            .map(|(_, cap)| cap.clone())
    }

    /// Starts at most `rate` new handshakes per second for connections
    /// offering one of `alpns` (`None`: every protocol not given a rate of
    /// its own), all of them together. An attempt past it is refused before
    /// its handshake, at the cost of one packet; the protocol is read from
    /// the first packet (its `ClientHello`), which costs a decryption and
    /// no key exchange. So a flood on the agents' protocols does not take
    /// the CLI's handshakes, and the reverse. Refusals are logged like the
    /// caps' (the first on its own, then a summary per
    /// [`REFUSAL_LOG_INTERVAL`](super::REFUSAL_LOG_INTERVAL)).
    ///
    /// # Panics
    /// If `rate` admits nothing ([`HandshakeRate::is_valid`]): rates are
    /// chosen in code, so that is a programming error.
    #[must_use]
    pub fn handshake_rate(mut self, alpns: Option<&[&'static [u8]]>, rate: HandshakeRate) -> Self {
        assert!(rate.is_valid(), "a handshake rate admits nothing: {rate:?}");
        self.rates.push(RateClass {
            alpns: alpns.map(<[&[u8]]>::to_vec),
            rate,
            bucket: Mutex::new(Bucket::new(rate)),
        });
        self
    }

    /// Starts accepting. Keep the [`Router`]: dropping it stops the accept
    /// loop; call [`Router::shutdown`] for a clean stop (it closes the endpoint).
    #[must_use = "dropping the router stops accepting"]
    pub fn spawn(self) -> Router {
        if self.rates.is_empty() {
            return self.inner.spawn();
        }
        let rates = Arc::new(self.rates);
        let log = Arc::new(Mutex::new(RefusalLog::new(super::REFUSAL_LOG_INTERVAL)));
        let filter = move |incoming: &iroh::endpoint::Incoming| {
            let offered: Vec<Vec<u8>> = incoming
                .decrypt()
                .and_then(|initial| initial.alpns())
                .map(|alpns| alpns.filter_map(Result::ok).map(|a| a.to_vec()).collect())
                .unwrap_or_default();
            let class = rates
                .iter()
                .find(|c| {
                    c.alpns
                        .as_ref()
                        .is_some_and(|own| offered.iter().any(|o| own.contains(&o.as_slice())))
                })
                .or_else(|| rates.iter().find(|c| c.alpns.is_none()));
            let Some(class) = class else {
                return IncomingFilterOutcome::Accept;
            };
            let now = tokio::time::Instant::now().into_std();
            let admitted = class
                .bucket
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .try_take(now);
            if admitted {
                return IncomingFilterOutcome::Accept;
            }
            if count_refusal(&log, Refusal::HandshakeRate, || "this endpoint".to_owned()) {
                let protocols: Vec<String> = offered
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                tracing::warn!(
                    ?protocols,
                    per_second = class.rate.per_second,
                    burst = class.rate.burst,
                    "refusing new connections over the handshake rate; further refusals are summarised"
                );
            }
            IncomingFilterOutcome::Reject
        };
        self.inner.incoming_filter(Arc::new(filter)).spawn()
    }
}
