//! A deterministic in-memory provider: leases, endpoints, bootstrap sessions and their faults.
//!
//! [`FakeBackend`] models what a real provider plus its bootstrap transport
//! look like from the executor's side, with no I/O and no clock: every call
//! takes `now`. It knows nothing about the driver or the harness, so a `fake`
//! provider crate can wrap it directly (one `FakeBackend` behind a mutex,
//! [`FakeBackend::execute`] per effect, [`FakeBackend::poll_observations`] on a
//! timer armed at [`FakeBackend::next_observation_at`]).
//!
//! # The provider contract it models
//! - Every resource is created under a [`ResourceKey`] (run, slot, attempt).
//!   [`FakeBackend::create_lease`] and [`FakeBackend::start_bootstrap`] first
//!   look for a live resource with that key and return it ("adopt").
//! - Cancel and destroy treat "already absent" as success.
//! - Provider errors are *definite*: an `Err` means the call had no effect.
//!   Ambiguity (an effect whose result is lost) is a property of the path
//!   between provider and driver, and is modelled by [`crate::FakeExecutor`].
//!
//! # Eventual visibility (kubermatic machine-controller#886)
//! A new lease shows up in the provider's *list-by-key* lookup only
//! [`BackendConfig::visibility_lag_ms`] after it was created, like a cloud API
//! whose list/describe calls are eventually consistent. Adoption by lookup
//! alone therefore cannot prevent a second create while the first one is
//! invisible. What does prevent it is the executor contract: the create call
//! itself carries the [`ResourceKey`] as an idempotency token (EC2's
//! `ClientToken`, GCE's `requestId`), and the provider answers a repeated
//! token with the resource it already made, visible or not. Set
//! [`BackendConfig::idempotent_create`] to `false` to model a provider without
//! tokens; the conformance battery then detects the double create.
//!
//! # Counting
//! The backend counts every create call and how many of them made a *new*
//! resource, per identity and in total ([`BackendCounters`], [`KeyStats`]), and
//! keeps every resource it ever made (dead ones too), so an oracle can ask who
//! owns a lease or session and whether anything is left behind.
//!
//! # Order and size
//! The battery replays a seed exactly only while the model answers the same
//! way and reports observations in the same order (each one draws from the
//! model's generator), so every order it shows is fixed: leases and
//! sessions by their id strings ("session-10" before "session-9"),
//! identities by [`ResourceKey`], and observations due at one instant by
//! their session's id string. `tests/backend_model.rs` guards this.
//!
//! Inside, leases and sessions are dense indexes into chunked tables (their
//! ids are made on the way out and parsed back on the way in), identities
//! are stored once behind a small hash index, a session's log is eight
//! one-byte codes, and the schedule is a bucket per instant; a model of
//! 100,000 converged nodes holds about 200 bytes per node.
//!
//! Over 1,000 lines in one file: one fault model per provider operation,
//! all over one shared state of leases and sessions.

use crate::rng::SimRng;
use std::collections::BTreeMap;
use std::sync::Arc;
use swactor_provisioning::{
    BootstrapEvent, BootstrapObservation, BootstrapStage, EffectKind, EffectRequest, FailureClass,
    GroupId, LeaseId, Listed, LogicalNodeId, NodeEndpoint, NodeTemplate, OperationOutcome,
    ResourceKey, RunId, SessionId, Timestamp,
};

/// Tunables of the fake provider. Plain data; every field has a sensible default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// How long after creation a lease becomes visible to list-by-key lookups.
    pub visibility_lag_ms: u64,
    /// Whether a create call is idempotent per [`ResourceKey`] even while the
    /// resource is not yet visible (an idempotency token). See the module docs.
    pub idempotent_create: bool,
    /// How long after creation a lease's endpoint becomes ready; zero means the
    /// create call already returns it.
    pub endpoint_delay_ms: u64,
    /// Spacing of the scripted bootstrap observations.
    pub bootstrap_step_ms: u64,
    /// Whether sessions close their stream after reporting convergence. An
    /// open stream is what lets an out-of-band deletion surface as `AgentLost`.
    pub close_after_converge: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            visibility_lag_ms: 0,
            idempotent_create: true,
            endpoint_delay_ms: 0,
            bootstrap_step_ms: 200,
            close_after_converge: false,
        }
    }
}

/// A one-shot fault armed in the provider; the next matching call consumes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderFault {
    /// The next call of `kind` is refused with a definite error and has no effect.
    Refuse {
        /// Which call to refuse.
        kind: EffectKind,
    },
    /// The next *new* lease never gets a ready endpoint (until [`FakeBackend::heal`]).
    EndpointNeverReady,
    /// The next *new* lease's endpoint becomes ready only after `delay_ms`.
    EndpointSlow {
        /// The readiness delay.
        delay_ms: u64,
    },
    /// The next *new* session fails at `stage` (one of the five failure stages).
    BootstrapFailsAt {
        /// The failure stage.
        stage: BootstrapStage,
    },
    /// The next *new* session loses the observations whose script index bit is set
    /// (bit 0 = SshConnect ... bit 4 = SwactorJoined, bit 5 = Converged, bit 6 = Closed).
    LoseObservations {
        /// The loss mask.
        mask: u8,
    },
    /// The next *new* session closes its stream after convergence.
    CloseAfterConverge,
    /// The next *new* lease becomes visible to lookups only after `lag_ms`.
    Invisible {
        /// The visibility lag.
        lag_ms: u64,
    },
}

/// Why a provider call failed. Every error is definite: the call had no effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderError {
    /// An armed [`ProviderFault::Refuse`] refused the call.
    Refused(EffectKind),
    /// The lease does not exist (never did, or is gone).
    NoSuchLease(LeaseId),
    /// A create named a provider kind this provider is not, as a daemon
    /// that routes calls by kind would answer (any kind but `"fake"`).
    UnknownKind(String),
}

/// The provider kind the world's shapes name; a create for any other kind
/// is refused, as a daemon with no provider of that kind would.
pub(crate) const PROVIDER_KIND: &str = "fake";

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(kind) => write!(f, "provider refused {kind:?}"),
            Self::NoSuchLease(l) => write!(f, "no such lease {}", l.0),
            Self::UnknownKind(kind) => write!(f, "no provider drives kind {kind:?}"),
        }
    }
}

/// How a create call found or made its resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A new resource was made.
    Created,
    /// An existing resource was found by the list-by-key lookup.
    AdoptedByLookup,
    /// The lookup missed it (not yet visible) but the idempotency token matched.
    AdoptedByToken,
}

/// What [`FakeBackend::create_lease`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease.
    pub lease: LeaseId,
    /// Its endpoint, if ready at the time of the call.
    pub endpoint: Option<NodeEndpoint>,
    /// New or adopted.
    pub origin: Origin,
}

/// What [`FakeBackend::start_bootstrap`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionGrant {
    /// The session.
    pub session: SessionId,
    /// New or adopted.
    pub origin: Origin,
}

/// One lease the backend ever made, as [`FakeBackend::leases`] shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseInfo<'a> {
    /// The identity it was created for.
    pub key: &'a ResourceKey,
    /// When it was created.
    pub created_at: Timestamp,
    /// When list-by-key lookups start to see it.
    pub visible_at: Timestamp,
    /// When its endpoint is ready; `None` for never.
    pub endpoint_ready_at: Option<Timestamp>,
    /// The endpoint it will have.
    pub endpoint: NodeEndpoint,
    /// False once destroyed or deleted out of band.
    pub live: bool,
    /// True when it was deleted out of band.
    pub deleted_out_of_band: bool,
    /// The template the create asked for (`None` when the caller gave none).
    pub template: Option<&'a Arc<NodeTemplate>>,
}

/// One bootstrap session the backend ever started, as [`FakeBackend::sessions`] shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionInfo<'a> {
    /// The identity it was started for.
    pub key: &'a ResourceKey,
    /// The lease it runs on.
    pub lease: LeaseId,
    /// When it started.
    pub opened_at: Timestamp,
    /// False once the stream ended (cancelled, failed, closed, machine gone).
    pub open: bool,
    /// Whether a host follows the stream. A session outlives the host that
    /// started it (its agent keeps running); what it reports meanwhile goes
    /// to its log only, and a host that adopts it gets the log replayed.
    pub attached: bool,
    session: &'a Session,
}

impl<'a> SessionInfo<'a> {
    /// Everything the session reported so far, in order (its log).
    pub fn history(&self) -> impl ExactSizeIterator<Item = BootstrapEvent> + 'a {
        self.session.history.codes().map(|c| event(c & CODE_MASK))
    }
}

impl std::fmt::Debug for SessionInfo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The fields of the struct this view replaced, in its order, so a
        // printed model reads as it always did.
        let s = self.session;
        let final_event = s.final_event().map(|c| (s.due, event(c)));
        let history: Vec<BootstrapEvent> = self.history().collect();
        f.debug_struct("SessionInfo")
            .field("key", self.key)
            .field("lease", &self.lease)
            .field("opened_at", &self.opened_at)
            .field("open", &self.open)
            .field("next_step", &s.next_step)
            .field("fail_at", &s.fail_at)
            .field("lose_mask", &s.lose_mask)
            .field("close_after_converge", &s.close_after_converge)
            .field("final_event", &final_event)
            .field("attached", &self.attached)
            .field("history", &history)
            .finish()
    }
}

/// Every lease the backend ever made, by id (see [`FakeBackend::leases`]).
#[derive(Clone, Copy)]
pub struct Leases<'a> {
    backend: &'a FakeBackend,
}

impl<'a> Leases<'a> {
    /// The lease `id`, if the backend ever made it.
    pub fn get(&self, id: &LeaseId) -> Option<LeaseInfo<'a>> {
        let i = self.backend.lease_index(id)?;
        Some(self.backend.lease_info(i))
    }

    /// Every lease with its id, in id order (the order of the id strings).
    pub fn iter(&self) -> impl Iterator<Item = (LeaseId, LeaseInfo<'a>)> + 'a {
        let b = self.backend;
        b.in_id_order(Kind::Lease)
            .map(move |i| (lease_id(b.leases[i].number), b.lease_info(i)))
    }

    /// Every lease, in id order.
    pub fn values(&self) -> impl Iterator<Item = LeaseInfo<'a>> + 'a {
        self.iter().map(|(_, l)| l)
    }

    /// How many leases the backend ever made.
    pub fn len(&self) -> usize {
        self.backend.leases.len()
    }

    /// True when the backend never made a lease.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Leases<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Every session the backend ever started, by id (see [`FakeBackend::sessions`]).
#[derive(Clone, Copy)]
pub struct Sessions<'a> {
    backend: &'a FakeBackend,
}

impl<'a> Sessions<'a> {
    /// The session `id`, if the backend ever started it.
    pub fn get(&self, id: &SessionId) -> Option<SessionInfo<'a>> {
        let i = self.backend.session_index(id)?;
        Some(self.backend.session_info(i))
    }

    /// Every session with its id, in id order (the order of the id strings).
    pub fn iter(&self) -> impl Iterator<Item = (SessionId, SessionInfo<'a>)> + 'a {
        let b = self.backend;
        b.in_id_order(Kind::Session)
            .map(move |i| (session_id(b.sessions[i].number), b.session_info(i)))
    }

    /// Every session, in id order.
    pub fn values(&self) -> impl Iterator<Item = SessionInfo<'a>> + 'a {
        self.iter().map(|(_, s)| s)
    }

    /// How many sessions the backend ever started.
    pub fn len(&self) -> usize {
        self.backend.sessions.len()
    }

    /// True when the backend never started a session.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Sessions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Per-identity counts, for every identity the backend was ever asked about
/// (see [`FakeBackend::keys`]).
#[derive(Clone, Copy)]
pub struct Keys<'a> {
    backend: &'a FakeBackend,
}

impl<'a> Keys<'a> {
    /// The counts of `key`, if the backend was ever asked about it.
    pub fn get(&self, key: &ResourceKey) -> Option<&'a KeyStats> {
        let b = self.backend;
        let i = b.index.find(&b.keys, key, key_hash(key))?;
        Some(&b.keys[i].stats)
    }

    /// Every identity with its counts, in identity order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a ResourceKey, &'a KeyStats)> + 'a {
        let b = self.backend;
        let mut order: Vec<usize> = (0..b.keys.len()).collect();
        order.sort_unstable_by(|x, y| b.keys[*x].key.cmp(&b.keys[*y].key));
        order
            .into_iter()
            .map(move |i| (&b.keys[i].key, &b.keys[i].stats))
    }

    /// Every identity, in order.
    pub fn keys(&self) -> impl Iterator<Item = &'a ResourceKey> + 'a {
        self.iter().map(|(k, _)| k)
    }

    /// Every identity's counts, in identity order.
    pub fn values(&self) -> impl Iterator<Item = &'a KeyStats> + 'a {
        self.iter().map(|(_, s)| s)
    }

    /// How many identities the backend was asked about.
    pub fn len(&self) -> usize {
        self.backend.keys.len()
    }

    /// True when the backend was never asked about any identity.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> IntoIterator for Keys<'a> {
    type Item = (&'a ResourceKey, &'a KeyStats);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl std::fmt::Debug for Keys<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// One observation as [`FakeBackend::poll_events`] yields it: by session
/// index rather than with the attempt's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionEvent {
    /// The session's index ([`FakeBackend::session_index`]).
    pub session: usize,
    /// What it reported.
    pub event: BootstrapEvent,
}

/// Totals over the backend's lifetime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendCounters {
    /// Calls to create a lease.
    pub create_lease_calls: u64,
    /// Of those, calls that made a new lease.
    pub leases_created: u64,
    /// Of those, calls that adopted a lease the list-by-key lookup could not
    /// see yet, through the idempotency token.
    pub adopted_by_token: u64,
    /// Calls to start a bootstrap.
    pub start_bootstrap_calls: u64,
    /// Of those, calls that started a new session.
    pub sessions_started: u64,
    /// Endpoint lookups.
    pub lookups: u64,
    /// Cancel calls (including already-absent ones).
    pub cancels: u64,
    /// Destroy calls (including already-absent ones).
    pub destroys: u64,
    /// Calls refused by an armed fault.
    pub refused: u64,
    /// Leases deleted out of band.
    pub out_of_band_deletions: u64,
    /// Observations dropped by a loss fault.
    pub observations_lost: u64,
}

/// Per-identity counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStats {
    /// Create-lease calls for this identity.
    pub create_lease_calls: u32,
    /// New leases made for this identity (more than one is a double create).
    pub leases_created: u32,
    /// New sessions started for this identity.
    pub sessions_started: u32,
    /// Leases of this identity alive now.
    pub live_leases: u32,
    /// Sessions of this identity open now.
    pub open_sessions: u32,
}

// ---------------------------------------------------------------------------
// Ids.
//
// Leases and sessions are numbered from one counter and named
// `"{prefix}-{n}"`. Inside the model each is a dense index into its table;
// the string id is made on the way out and parsed back on the way in. Every
// order the model shows (views, same-instant observations) is the order of
// the *strings*, so "session-10" comes before "session-9": [`lex_key`] and
// [`LexOrder`] give that order on the numbers.

const LEASE_PREFIX: &str = "lease-";
const SESSION_PREFIX: &str = "session-";
const ENDPOINT_PREFIX: &str = "ssh://lease-";

/// A short id string built on the stack (the ids are ASCII and at most 32 bytes).
struct IdBuf {
    bytes: [u8; 40],
    len: usize,
}

impl IdBuf {
    fn new(prefix: &str, n: u64) -> Self {
        let mut bytes = [0u8; 40];
        let p = prefix.as_bytes();
        bytes[..p.len()].copy_from_slice(p);
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut m = n;
        // Two digits a division while there are more than two.
        while m >= 100 {
            let pair = (m % 100) as usize;
            m /= 100;
            at -= 2;
            digits[at] = b'0' + (pair / 10) as u8;
            digits[at + 1] = b'0' + (pair % 10) as u8;
        }
        if m >= 10 {
            at -= 2;
            digits[at] = b'0' + (m / 10) as u8;
            digits[at + 1] = b'0' + (m % 10) as u8;
        } else {
            at -= 1;
            digits[at] = b'0' + m as u8;
        }
        let d = &digits[at..];
        bytes[p.len()..p.len() + d.len()].copy_from_slice(d);
        Self {
            bytes,
            len: p.len() + d.len(),
        }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len]).expect("ids are ASCII")
    }
}

fn lease_id(n: u64) -> LeaseId {
    LeaseId::from(IdBuf::new(LEASE_PREFIX, n).as_str())
}

fn session_id(n: u64) -> SessionId {
    SessionId::from(IdBuf::new(SESSION_PREFIX, n).as_str())
}

fn endpoint_of(n: u64) -> NodeEndpoint {
    NodeEndpoint::from(IdBuf::new(ENDPOINT_PREFIX, n).as_str())
}

/// The number in `"{prefix}{n}"`, exactly as [`IdBuf`] writes it (no sign, no
/// leading zero), or `None` for any other string.
fn parse_number(id: &str, prefix: &str) -> Option<u64> {
    let digits = id.strip_prefix(prefix)?.as_bytes();
    let well_formed = !digits.is_empty()
        && digits.len() <= 20
        && digits[0] != b'0'
        && digits.iter().all(u8::is_ascii_digit);
    if !well_formed {
        return None;
    }
    digits.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// A key whose order is the order of the decimal strings of the numbers
/// (`lex_key(10) < lex_key(9)`, `lex_key(1) < lex_key(10)`): the digits
/// left-aligned to twenty places, ties (one string a prefix of the other
/// plus zeros) broken by length.
fn lex_key(n: u64) -> u128 {
    /// `10^i`, looked up: a `u128` power is a loop of wide multiplies, and
    /// every observation the backend schedules takes a key.
    const POW10: [u128; 21] = {
        let mut p = [1u128; 21];
        let mut i = 1;
        while i < 21 {
            p[i] = p[i - 1] * 10;
            i += 1;
        }
        p
    };
    let len = n.checked_ilog10().map_or(1, |d| d + 1);
    ((u128::from(n) * POW10[(20 - len) as usize]) << 5) | u128::from(len)
}

/// The numbers `1..=max` in the order of their decimal strings.
struct LexOrder {
    next: u64,
    left: u64,
    max: u64,
}

impl LexOrder {
    fn new(max: u64) -> Self {
        Self {
            next: 1,
            left: max,
            max,
        }
    }
}

impl Iterator for LexOrder {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let out = self.next;
        // Down to the first child ("1" -> "10") if there is one, else on to
        // the next sibling, climbing while the siblings are used up.
        if self.next <= self.max / 10 {
            self.next *= 10;
        } else {
            while self.next % 10 == 9 || self.next >= self.max {
                self.next /= 10;
            }
            self.next += 1;
        }
        Some(out)
    }
}

/// What an id number names: a lease or a session, and its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Lease,
    Session,
}

const SESSION_BIT: u32 = 1 << 31;

// ---------------------------------------------------------------------------
// Tables.

const CHUNK_BITS: u32 = 12;
const CHUNK_LEN: usize = 1 << CHUNK_BITS;

/// A growable table in fixed chunks: past the first chunk it never holds
/// more than one chunk of spare room (a `Vec` holds up to its length again)
/// and never moves what it holds.
#[derive(Clone, Debug)]
struct Table<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Table<T> {
    fn len(&self) -> usize {
        self.len
    }

    /// Appends `value` and returns its index.
    fn push(&mut self, value: T) -> usize {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK_LEN => chunk.push(value),
            _ => {
                // The first chunk grows as a `Vec` does, so a small model
                // stays small; later ones are made whole.
                let mut chunk = if self.chunks.is_empty() {
                    Vec::new()
                } else {
                    Vec::with_capacity(CHUNK_LEN)
                };
                chunk.push(value);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
        self.len - 1
    }

    fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i >> CHUNK_BITS)?.get(i & (CHUNK_LEN - 1))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.chunks.iter_mut().flatten()
    }
}

impl<T> std::ops::Index<usize> for Table<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> CHUNK_BITS][i & (CHUNK_LEN - 1)]
    }
}

impl<T> std::ops::IndexMut<usize> for Table<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> CHUNK_BITS][i & (CHUNK_LEN - 1)]
    }
}

/// No lease or session (in the `u32` index fields).
const NONE: u32 = u32::MAX;

fn index_u32(i: usize) -> u32 {
    let i = u32::try_from(i).expect("fewer than 2^31 leases and sessions");
    assert!(i < SESSION_BIT, "fewer than 2^31 leases and sessions");
    i
}

/// One identity the backend was asked about.
#[derive(Clone, Debug)]
struct KeyEntry {
    key: ResourceKey,
    stats: KeyStats,
    /// One live lease of the key, or [`NONE`]; any others (after a double
    /// create) are in [`FakeBackend::more_live`].
    lease: u32,
    /// The key's open session, or [`NONE`].
    session: u32,
}

/// Hash of an identity, for [`KeyIndex`] (FxHash-style: fast, not keyed).
fn key_hash(key: &ResourceKey) -> u64 {
    fn mix(h: u64, word: u64) -> u64 {
        (h.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95)
    }
    let mut h = 0;
    for s in [key.run_id.as_str(), key.node.group.as_str()] {
        let bytes = s.as_bytes();
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            h = mix(h, u64::from_le_bytes(w.try_into().expect("eight bytes")));
        }
        let last = words
            .remainder()
            .iter()
            .rev()
            .fold(0u64, |w, b| (w << 8) | u64::from(*b));
        h = mix(h, last ^ ((bytes.len() as u64) << 56));
    }
    h = mix(h, u64::from(key.node.index));
    mix(h, key.attempt.0)
}

/// An open-addressing hash set of key indexes, compared through the key
/// table (so each identity is stored once). Each slot also keeps the top
/// bits of its key's hash, so a probe rarely touches the key table and
/// growing never does.
#[derive(Clone, Debug, Default)]
struct KeyIndex {
    /// A power of two long (at most 2^32), or empty: a free slot is zero,
    /// a taken one holds `tag << 32 | (index + 1)`.
    slots: Vec<u64>,
}

impl KeyIndex {
    /// The 32 bits of a key's hash the index uses: the top of a Fibonacci
    /// multiply, where it mixed most.
    fn tag(hash: u64) -> u32 {
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32
    }

    fn home(&self, tag: u32) -> usize {
        let bits = self.slots.len().trailing_zeros();
        (u64::from(tag) >> (32 - bits)) as usize
    }

    fn find(&self, keys: &Table<KeyEntry>, key: &ResourceKey, hash: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let tag = Self::tag(hash);
        let mask = self.slots.len() - 1;
        let mut at = self.home(tag);
        loop {
            let slot = self.slots[at];
            if slot == 0 {
                return None;
            }
            if (slot >> 32) as u32 == tag {
                let i = (slot as u32 - 1) as usize;
                if keys[i].key == *key {
                    return Some(i);
                }
            }
            at = (at + 1) & mask;
        }
    }

    /// Adds key `i` (not present yet), `count` keys in all with it.
    fn insert(&mut self, count: usize, i: usize, hash: u64) {
        if count * 4 > self.slots.len() * 3 {
            let old = std::mem::take(&mut self.slots);
            let len = (old.len() * 2).max(16);
            assert!(len <= 1 << 32, "fewer than 2^31 identities");
            self.slots = vec![0; len];
            for slot in old.into_iter().filter(|s| *s != 0) {
                self.place(slot);
            }
        }
        self.place(u64::from(Self::tag(hash)) << 32 | (u64::from(index_u32(i)) + 1));
    }

    fn place(&mut self, slot: u64) {
        let mask = self.slots.len() - 1;
        let mut at = self.home((slot >> 32) as u32);
        while self.slots[at] != 0 {
            at = (at + 1) & mask;
        }
        self.slots[at] = slot;
    }
}

/// Shares one allocation among equal run and group ids, so a model of many
/// nodes does not keep every caller's copy of the same short string alive.
#[derive(Clone, Debug, Default)]
struct Interned {
    runs: Vec<RunId>,
    groups: Vec<GroupId>,
}

impl Interned {
    /// Few distinct ids are expected; past this many, ids are kept as given.
    const LEN_MAX: usize = 64;

    fn key(&mut self, key: &ResourceKey) -> ResourceKey {
        fn one<T: Clone + PartialEq>(pool: &mut Vec<T>, id: &T) -> T {
            if let Some(known) = pool.iter().find(|known| *known == id) {
                return known.clone();
            }
            if pool.len() < Interned::LEN_MAX {
                pool.push(id.clone());
            }
            id.clone()
        }
        ResourceKey {
            run_id: one(&mut self.runs, &key.run_id),
            node: LogicalNodeId::new(one(&mut self.groups, &key.node.group), key.node.index),
            attempt: key.attempt,
        }
    }
}

/// One lease the backend ever made.
#[derive(Clone, Debug)]
struct Lease {
    number: u64,
    created_at: Timestamp,
    visible_at: Timestamp,
    /// When the endpoint is ready, if `ready`.
    ready_at: Timestamp,
    template: Option<Arc<NodeTemplate>>,
    key: u32,
    /// False for an endpoint that is never ready.
    ready: bool,
    live: bool,
    deleted_out_of_band: bool,
}

impl Lease {
    fn endpoint_ready_at(&self) -> Option<Timestamp> {
        self.ready.then_some(self.ready_at)
    }

    fn endpoint_at(&self, now: Timestamp) -> Option<NodeEndpoint> {
        self.endpoint_ready_at()
            .filter(|t| *t <= now)
            .map(|_| endpoint_of(self.number))
    }
}

// ---------------------------------------------------------------------------
// Events, as one-byte codes: a session's log holds at most eight of them.

/// Codes 0..=9: `Stage(STAGES[code])`.
const STAGES: [BootstrapStage; 10] = [
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
const JOINED: u8 = 10;
const CLOSED: u8 = 11;
/// Codes 12..=21: `Failed { stage: STAGES[code - 12], reason: "scripted failure at ..." }`.
const SCRIPTED_FAILURE: u8 = 12;
const LOST_OUT_OF_BAND: u8 = 22;
const LOST_DESTROYED: u8 = 23;
/// Marks a logged event that [`FakeBackend::poll_events`] reported.
const DELIVERED: u8 = 0x80;
const CODE_MASK: u8 = 0x7f;
/// No code (in [`Session::final_event`]).
const NO_EVENT: u8 = u8::MAX;

fn stage_code(stage: BootstrapStage) -> u8 {
    match stage {
        BootstrapStage::SshConnect => 0,
        BootstrapStage::BootCheck => 1,
        BootstrapStage::SwactorStart => 2,
        BootstrapStage::Join => 3,
        BootstrapStage::Converged => 4,
        BootstrapStage::SshConnectFailed => 5,
        BootstrapStage::BootCheckFailed => 6,
        BootstrapStage::SwactorStartFailed => 7,
        BootstrapStage::JoinFailed => 8,
        BootstrapStage::AgentLost => 9,
    }
}

fn event(code: u8) -> BootstrapEvent {
    match code {
        0..=9 => BootstrapEvent::Stage(STAGES[usize::from(code)]),
        JOINED => BootstrapEvent::SwactorJoined,
        CLOSED => BootstrapEvent::Closed,
        12..=21 => {
            let stage = STAGES[usize::from(code - SCRIPTED_FAILURE)];
            BootstrapEvent::Failed {
                stage,
                reason: format!("scripted failure at {stage:?}"),
            }
        }
        LOST_OUT_OF_BAND | LOST_DESTROYED => BootstrapEvent::Failed {
            stage: BootstrapStage::AgentLost,
            reason: if code == LOST_OUT_OF_BAND {
                "machine deleted out of band"
            } else {
                "machine destroyed under a running session"
            }
            .to_owned(),
        },
        _ => unreachable!("event code {code}"),
    }
}

fn is_failure(code: u8) -> bool {
    match code {
        0..=9 => STAGES[usize::from(code)].is_failure(),
        SCRIPTED_FAILURE..=LOST_DESTROYED => true,
        _ => false,
    }
}

/// A session's log: what it reported, in order, each code marked
/// [`DELIVERED`] when a host heard it from the script.
///
/// A session reports at most eight events: its script has seven steps, a
/// failure ends the script and adds a close, and a cancel or loss ends a
/// session that has not ended yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct History {
    codes: [u8; 8],
    len: u8,
}

impl History {
    fn push(&mut self, code: u8) {
        assert!(usize::from(self.len) < self.codes.len(), "a ninth event");
        self.codes[usize::from(self.len)] = code;
        self.len += 1;
    }

    fn codes(&self) -> impl ExactSizeIterator<Item = u8> + '_ {
        self.codes[..usize::from(self.len)].iter().copied()
    }
}

/// One bootstrap session the backend ever started.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Session {
    number: u64,
    opened_at: Timestamp,
    /// When the next observation is due, while `scheduled`; also the time
    /// of `final_event`, which is always scheduled while it is pending.
    due: Timestamp,
    key: u32,
    lease: u32,
    history: History,
    /// A one-off final observation (cancel, out-of-band loss), emitted
    /// before closing, or [`NO_EVENT`].
    final_event: u8,
    /// The script position of the next observation.
    next_step: u8,
    /// The failure stage the script ends in, if any.
    fail_at: Option<BootstrapStage>,
    /// Script steps whose observations are lost.
    lose_mask: u8,
    close_after_converge: bool,
    open: bool,
    attached: bool,
    /// Whether the session has an entry in the schedule at `due`.
    scheduled: bool,
}

impl Session {
    fn final_event(&self) -> Option<u8> {
        (self.final_event != NO_EVENT).then_some(self.final_event)
    }
}

/// Sessions due at one instant. Entries of sessions since moved elsewhere
/// stay until the bucket is taken; `live` counts the others.
#[derive(Clone, Debug)]
struct Bucket {
    live: u32,
    /// Whether `sessions` is in the order of the id strings.
    sorted: bool,
    /// The [`lex_key`] of the last session put in.
    last: u128,
    sessions: Vec<u32>,
}

impl Default for Bucket {
    fn default() -> Self {
        Self {
            live: 0,
            sorted: true,
            last: 0,
            sessions: Vec::new(),
        }
    }
}

impl Bucket {
    fn push(&mut self, i: u32, number: u64) {
        let key = lex_key(number);
        self.sorted &= key > self.last;
        self.last = key;
        self.live += 1;
        self.sessions.push(i);
    }
}

const SCRIPT_CONVERGED: u8 = 5;
const SCRIPT_CLOSED: u8 = 6;

/// The fake provider. See the module docs.
#[derive(Clone, Debug)]
pub struct FakeBackend {
    config: BackendConfig,
    /// Every lease ever made, in creation order.
    leases: Table<Lease>,
    /// Every session ever started, in start order.
    sessions: Table<Session>,
    /// What id number `n` names, at `n - 1`: a lease index, or a session
    /// index with [`SESSION_BIT`] set.
    ids: Table<u32>,
    /// Every identity ever asked about, and a hash index on them.
    keys: Table<KeyEntry>,
    index: KeyIndex,
    interned: Interned,
    /// Live leases of a key beyond [`KeyEntry::lease`] (after a double create).
    more_live: BTreeMap<u32, Vec<u32>>,
    armed: Vec<ProviderFault>,
    counters: BackendCounters,
    next_id: u64,
    rng: SimRng,
    /// Sessions with an observation left, by when it is due.
    schedule: BTreeMap<Timestamp, Bucket>,
    /// Logs being replayed to a host that adopted a session, by when each
    /// line is due: the session and the event's code.
    replays: BTreeMap<(Timestamp, u64), (u32, u8)>,
    replay_seq: u64,
}

impl FakeBackend {
    /// An empty provider. `seed` only picks cosmetic variations (which of the two
    /// encodings a failure observation uses), so equal seeds give equal runs.
    pub fn new(config: BackendConfig, seed: u64) -> Self {
        Self {
            config,
            leases: Table::default(),
            sessions: Table::default(),
            ids: Table::default(),
            keys: Table::default(),
            index: KeyIndex::default(),
            interned: Interned::default(),
            more_live: BTreeMap::new(),
            armed: Vec::new(),
            counters: BackendCounters::default(),
            next_id: 1,
            rng: SimRng::new(seed),
            schedule: BTreeMap::new(),
            replays: BTreeMap::new(),
            replay_seq: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BackendConfig {
        &self.config
    }

    /// Arms a one-shot fault.
    pub fn arm(&mut self, fault: ProviderFault) {
        self.armed.push(fault);
    }

    /// The faults armed and not consumed yet, in the order they were armed.
    pub fn armed(&self) -> &[ProviderFault] {
        &self.armed
    }

    /// Stops all faults: disarms pending ones, makes never-ready endpoints
    /// ready at `now`, and lets open sessions finish their script cleanly
    /// (no further losses or scripted failures). Out-of-band damage already
    /// done stays done.
    pub fn heal(&mut self, now: Timestamp) {
        self.armed.clear();
        for l in self.leases.iter_mut() {
            if l.live {
                l.ready_at = if l.ready { l.ready_at.min(now) } else { now };
                l.ready = true;
                l.visible_at = l.visible_at.min(now);
            }
        }
        for i in 0..self.sessions.len() {
            let s = &mut self.sessions[i];
            if s.open && s.final_event().is_none() {
                s.fail_at = None;
                s.lose_mask = 0;
                self.reschedule(i);
            }
        }
    }

    // --- ids -------------------------------------------------------------

    fn fresh_number(&mut self, kind: Kind, index: usize) -> u64 {
        let n = self.next_id;
        self.next_id += 1;
        let tagged = match kind {
            Kind::Lease => index_u32(index),
            Kind::Session => index_u32(index) | SESSION_BIT,
        };
        let at = self.ids.push(tagged);
        debug_assert_eq!(at as u64, n - 1);
        n
    }

    fn named(&self, number: u64, kind: Kind) -> Option<usize> {
        let tagged = *self
            .ids
            .get(usize::try_from(number.checked_sub(1)?).ok()?)?;
        let is_session = tagged & SESSION_BIT != 0;
        (is_session == (kind == Kind::Session)).then_some((tagged & !SESSION_BIT) as usize)
    }

    /// The index of lease `id` in the backend's tables, if it ever made it.
    fn lease_index(&self, id: &LeaseId) -> Option<usize> {
        self.named(parse_number(id.as_str(), LEASE_PREFIX)?, Kind::Lease)
    }

    /// The index of session `id`: sessions are numbered from zero in the
    /// order they were started, and an index never changes. `None` when
    /// the backend never started `id`.
    pub fn session_index(&self, id: &SessionId) -> Option<usize> {
        self.named(parse_number(id.as_str(), SESSION_PREFIX)?, Kind::Session)
    }

    /// Lease or session indexes in the order of their id strings.
    fn in_id_order(&self, kind: Kind) -> impl Iterator<Item = usize> + '_ {
        LexOrder::new(self.next_id - 1).filter_map(move |n| self.named(n, kind))
    }

    fn lease_info(&self, i: usize) -> LeaseInfo<'_> {
        let l = &self.leases[i];
        LeaseInfo {
            key: &self.keys[l.key as usize].key,
            created_at: l.created_at,
            visible_at: l.visible_at,
            endpoint_ready_at: l.endpoint_ready_at(),
            endpoint: endpoint_of(l.number),
            live: l.live,
            deleted_out_of_band: l.deleted_out_of_band,
            template: l.template.as_ref(),
        }
    }

    fn session_info(&self, i: usize) -> SessionInfo<'_> {
        let s = &self.sessions[i];
        SessionInfo {
            key: &self.keys[s.key as usize].key,
            lease: lease_id(self.leases[s.lease as usize].number),
            opened_at: s.opened_at,
            open: s.open,
            attached: s.attached,
            session: s,
        }
    }

    // --- identities ------------------------------------------------------

    fn find_key(&self, key: &ResourceKey) -> Option<usize> {
        self.index.find(&self.keys, key, key_hash(key))
    }

    fn key_or_insert(&mut self, key: &ResourceKey) -> usize {
        let hash = key_hash(key);
        match self.index.find(&self.keys, key, hash) {
            Some(i) => i,
            None => self.insert_key(key, hash),
        }
    }

    /// Adds `key` (not known yet, of hash `hash`) and returns its index.
    fn insert_key(&mut self, key: &ResourceKey, hash: u64) -> usize {
        let i = self.keys.push(KeyEntry {
            key: self.interned.key(key),
            stats: KeyStats::default(),
            lease: NONE,
            session: NONE,
        });
        self.index.insert(self.keys.len(), i, hash);
        i
    }

    /// The live leases of key `k`, in no particular order.
    fn live_leases_of(&self, k: usize) -> impl Iterator<Item = usize> + '_ {
        let first = self.keys[k].lease;
        let more = self.more_live.get(&index_u32(k)).into_iter().flatten();
        (first != NONE)
            .then_some(first)
            .into_iter()
            .chain(more.copied())
            .map(|i| i as usize)
    }

    /// The first (in id order) live lease of key `k` that `pred` accepts.
    fn first_live_lease(&self, k: usize, pred: impl Fn(&Lease) -> bool) -> Option<usize> {
        self.live_leases_of(k)
            .filter(|i| pred(&self.leases[*i]))
            .min_by_key(|i| lex_key(self.leases[*i].number))
    }

    fn add_live_lease(&mut self, k: usize, lease: usize) {
        let entry = &mut self.keys[k];
        if entry.lease == NONE {
            entry.lease = index_u32(lease);
        } else {
            self.more_live
                .entry(index_u32(k))
                .or_default()
                .push(index_u32(lease));
        }
    }

    fn remove_live_lease(&mut self, k: usize, lease: usize) {
        let (k, lease) = (index_u32(k), index_u32(lease));
        let more = self.more_live.get_mut(&k);
        let entry = &mut self.keys[k as usize];
        match more {
            Some(more) => {
                if entry.lease == lease {
                    entry.lease = more.pop().expect("no empty lists are kept");
                } else {
                    more.retain(|l| *l != lease);
                }
                if more.is_empty() {
                    self.more_live.remove(&k);
                }
            }
            None if entry.lease == lease => entry.lease = NONE,
            None => {}
        }
    }

    // --- schedule --------------------------------------------------------

    fn step_at(&self, s: &Session) -> Timestamp {
        if s.final_event().is_some() {
            return s.due;
        }
        let step = u64::from(s.next_step) + 1;
        Timestamp(
            s.opened_at
                .0
                .saturating_add(step * self.config.bootstrap_step_ms),
        )
    }

    /// Takes session `i` out of the schedule.
    fn unschedule(&mut self, i: usize) {
        let s = &mut self.sessions[i];
        if !s.scheduled {
            return;
        }
        s.scheduled = false;
        let due = s.due;
        let bucket = self
            .schedule
            .get_mut(&due)
            .expect("a scheduled session has a bucket");
        bucket.live -= 1;
        if bucket.live == 0 {
            self.schedule.remove(&due);
        }
    }

    /// Puts session `i` (not scheduled) in the schedule at `at`.
    fn schedule_at(&mut self, i: usize, at: Timestamp) {
        let s = &mut self.sessions[i];
        debug_assert!(!s.scheduled);
        s.scheduled = true;
        s.due = at;
        let number = s.number;
        self.schedule
            .entry(at)
            .or_default()
            .push(index_u32(i), number);
    }

    /// Puts session `i` in the observation schedule at its next step, or takes it out.
    fn reschedule(&mut self, i: usize) {
        let s = &self.sessions[i];
        let wanted = Self::has_next(s).then(|| self.step_at(s));
        if s.scheduled && Some(s.due) == wanted {
            return;
        }
        self.unschedule(i);
        if let Some(at) = wanted {
            self.schedule_at(i, at);
        }
    }

    fn take_fault(&mut self, pred: impl Fn(&ProviderFault) -> bool) -> Option<ProviderFault> {
        let i = self.armed.iter().position(pred)?;
        Some(self.armed.remove(i))
    }

    fn refused(&mut self, kind: EffectKind) -> bool {
        let hit = self
            .take_fault(|f| matches!(f, ProviderFault::Refuse { kind: k } if *k == kind))
            .is_some();
        if hit {
            self.counters.refused += 1;
        }
        hit
    }

    // --- the provider calls ----------------------------------------------

    /// The live lease of `key` that a list-by-key lookup sees at `now`.
    pub fn list_lease(&self, key: &ResourceKey, now: Timestamp) -> Option<LeaseId> {
        let i = self.list_lease_index(self.find_key(key)?, now)?;
        Some(lease_id(self.leases[i].number))
    }

    fn list_lease_index(&self, k: usize, now: Timestamp) -> Option<usize> {
        self.first_live_lease(k, |l| l.live && l.visible_at <= now)
    }

    /// The first (in id order) live lease of `key`, visible or not.
    pub fn live_lease(&self, key: &ResourceKey) -> Option<LeaseId> {
        let i = self.first_live_lease(self.find_key(key)?, |_| true)?;
        Some(lease_id(self.leases[i].number))
    }

    /// Leases a machine for `key`, adopting a live one first (see the module docs).
    ///
    /// # Errors
    /// An armed [`ProviderFault::Refuse`]; nothing was created.
    pub fn create_lease(
        &mut self,
        key: &ResourceKey,
        now: Timestamp,
    ) -> Result<LeaseGrant, ProviderError> {
        self.create_lease_from(key, None, now)
    }

    /// [`FakeBackend::create_lease`], recording the template a new lease is made from.
    ///
    /// # Errors
    /// As [`FakeBackend::create_lease`].
    pub fn create_lease_from(
        &mut self,
        key: &ResourceKey,
        template: Option<&Arc<NodeTemplate>>,
        now: Timestamp,
    ) -> Result<LeaseGrant, ProviderError> {
        self.counters.create_lease_calls += 1;
        let k = self.key_or_insert(key);
        self.keys[k].stats.create_lease_calls += 1;
        if let Some(t) = template
            && t.provider.kind != PROVIDER_KIND
        {
            return Err(ProviderError::UnknownKind(t.provider.kind.clone()));
        }
        if self.refused(EffectKind::CreateLease) {
            return Err(ProviderError::Refused(EffectKind::CreateLease));
        }
        let adopt = |origin, l: &Lease| LeaseGrant {
            lease: lease_id(l.number),
            endpoint: l.endpoint_at(now),
            origin,
        };
        if let Some(i) = self.list_lease_index(k, now) {
            return Ok(adopt(Origin::AdoptedByLookup, &self.leases[i]));
        }
        if self.config.idempotent_create
            && let Some(i) = self.first_live_lease(k, |_| true)
        {
            let grant = adopt(Origin::AdoptedByToken, &self.leases[i]);
            self.counters.adopted_by_token += 1;
            return Ok(grant);
        }
        let lag = match self.take_fault(|f| matches!(f, ProviderFault::Invisible { .. })) {
            Some(ProviderFault::Invisible { lag_ms }) => lag_ms,
            _ => self.config.visibility_lag_ms,
        };
        let ready_at = match self.take_fault(|f| {
            matches!(
                f,
                ProviderFault::EndpointNeverReady | ProviderFault::EndpointSlow { .. }
            )
        }) {
            Some(ProviderFault::EndpointNeverReady) => None,
            Some(ProviderFault::EndpointSlow { delay_ms }) => Some(now.0.saturating_add(delay_ms)),
            _ => Some(now.0.saturating_add(self.config.endpoint_delay_ms)),
        };
        let i = self.leases.len();
        let number = self.fresh_number(Kind::Lease, i);
        let lease = Lease {
            number,
            created_at: now,
            visible_at: Timestamp(now.0.saturating_add(lag)),
            ready_at: Timestamp(ready_at.unwrap_or(0)),
            template: template.cloned(),
            key: index_u32(k),
            ready: ready_at.is_some(),
            live: true,
            deleted_out_of_band: false,
        };
        let grant = adopt(Origin::Created, &lease);
        self.leases.push(lease);
        self.add_live_lease(k, i);
        self.counters.leases_created += 1;
        let ks = &mut self.keys[k].stats;
        ks.leases_created += 1;
        ks.live_leases += 1;
        Ok(grant)
    }

    /// The endpoint of `lease`, or `None` while it is not ready.
    ///
    /// # Errors
    /// The lease does not exist, or an armed fault refused the call.
    pub fn lookup_endpoint(
        &mut self,
        lease: &LeaseId,
        now: Timestamp,
    ) -> Result<Option<NodeEndpoint>, ProviderError> {
        self.counters.lookups += 1;
        if self.refused(EffectKind::LookupEndpoint) {
            return Err(ProviderError::Refused(EffectKind::LookupEndpoint));
        }
        match self.lease_index(lease).map(|i| &self.leases[i]) {
            Some(l) if l.live => Ok(l.endpoint_at(now)),
            _ => Err(ProviderError::NoSuchLease(lease.clone())),
        }
    }

    /// Starts the bootstrap of `key` on `lease`, adopting the key's open session first.
    ///
    /// # Errors
    /// The lease is gone, or an armed fault refused the call; nothing was started.
    pub fn start_bootstrap(
        &mut self,
        key: &ResourceKey,
        lease: &LeaseId,
        now: Timestamp,
    ) -> Result<SessionGrant, ProviderError> {
        self.counters.start_bootstrap_calls += 1;
        if self.refused(EffectKind::StartBootstrap) {
            return Err(ProviderError::Refused(EffectKind::StartBootstrap));
        }
        let hash = key_hash(key);
        let known = self.index.find(&self.keys, key, hash);
        let open = known.map(|k| self.keys[k].session).filter(|s| *s != NONE);
        if let Some(i) = open {
            let i = i as usize;
            self.attach(i, now);
            return Ok(SessionGrant {
                session: session_id(self.sessions[i].number),
                origin: Origin::AdoptedByLookup,
            });
        }
        let Some(l) = self.lease_index(lease).filter(|l| self.leases[*l].live) else {
            return Err(ProviderError::NoSuchLease(lease.clone()));
        };
        let fail_at = match self.take_fault(|f| matches!(f, ProviderFault::BootstrapFailsAt { .. }))
        {
            Some(ProviderFault::BootstrapFailsAt { stage }) if stage.is_failure() => Some(stage),
            _ => None,
        };
        let lose_mask =
            match self.take_fault(|f| matches!(f, ProviderFault::LoseObservations { .. })) {
                Some(ProviderFault::LoseObservations { mask }) => mask,
                _ => 0,
            };
        let close_after_converge = self.config.close_after_converge
            || self
                .take_fault(|f| matches!(f, ProviderFault::CloseAfterConverge))
                .is_some();
        let k = match known {
            Some(k) => k,
            None => self.insert_key(key, hash),
        };
        let i = self.sessions.len();
        let number = self.fresh_number(Kind::Session, i);
        self.sessions.push(Session {
            number,
            opened_at: now,
            due: now,
            key: index_u32(k),
            lease: index_u32(l),
            history: History::default(),
            final_event: NO_EVENT,
            next_step: 0,
            fail_at,
            lose_mask,
            close_after_converge,
            open: true,
            attached: true,
            scheduled: false,
        });
        self.keys[k].session = index_u32(i);
        self.reschedule(i);
        self.counters.sessions_started += 1;
        let ks = &mut self.keys[k].stats;
        ks.sessions_started += 1;
        ks.open_sessions += 1;
        Ok(SessionGrant {
            session: session_id(number),
            origin: Origin::Created,
        })
    }

    /// Marks session `i` (of key `k`) as no longer its key's open session.
    fn close_session_index(&mut self, k: usize, i: usize) {
        let entry = &mut self.keys[k];
        if entry.session == index_u32(i) {
            entry.session = NONE;
        }
    }

    /// Ends an open session at once and schedules the last thing its stream says.
    fn end_session(&mut self, i: usize, now: Timestamp, last: u8) {
        let s = &mut self.sessions[i];
        if !s.open {
            return;
        }
        s.open = false;
        s.next_step = u8::MAX;
        s.final_event = last;
        let k = s.key as usize;
        self.keys[k].stats.open_sessions -= 1;
        self.close_session_index(k, i);
        self.unschedule(i);
        self.schedule_at(i, now);
    }

    /// Stops a session; an unknown or already ended session is success.
    ///
    /// # Errors
    /// An armed fault refused the call; the session keeps running.
    pub fn cancel_bootstrap(
        &mut self,
        id: &SessionId,
        now: Timestamp,
    ) -> Result<(), ProviderError> {
        self.counters.cancels += 1;
        if self.refused(EffectKind::CancelBootstrap) {
            return Err(ProviderError::Refused(EffectKind::CancelBootstrap));
        }
        if let Some(i) = self.session_index(id) {
            self.end_session(i, now, CLOSED);
        }
        Ok(())
    }

    fn kill_lease(&mut self, i: usize, now: Timestamp, out_of_band: bool) {
        let l = &mut self.leases[i];
        if !l.live {
            return;
        }
        l.live = false;
        l.deleted_out_of_band = out_of_band;
        let k = l.key as usize;
        self.keys[k].stats.live_leases -= 1;
        self.remove_live_lease(k, i);
        // A session runs on its own key's lease, so only that key's open
        // session can be on this lease.
        let s = self.keys[k].session;
        if s != NONE {
            let s = s as usize;
            let on_lease = self.sessions[s].open && self.sessions[s].lease == index_u32(i);
            if on_lease {
                // The machine is gone, so its agent is lost; the stream says so.
                let code = if out_of_band {
                    LOST_OUT_OF_BAND
                } else {
                    LOST_DESTROYED
                };
                self.end_session(s, now, code);
            }
        }
    }

    /// Releases a lease (and ends any session on it); an absent lease is success.
    ///
    /// # Errors
    /// An armed fault refused the call; the lease stays.
    pub fn destroy_lease(&mut self, lease: &LeaseId, now: Timestamp) -> Result<(), ProviderError> {
        self.counters.destroys += 1;
        if self.refused(EffectKind::DestroyLease) {
            return Err(ProviderError::Refused(EffectKind::DestroyLease));
        }
        if let Some(i) = self.lease_index(lease) {
            self.kill_lease(i, now, false);
        }
        Ok(())
    }

    /// Deletes a live lease behind the reconciler's back (an operator, a spot
    /// reclaim). A session on it reports `Failed { AgentLost }`. Returns false
    /// when the lease was not live.
    pub fn delete_out_of_band(&mut self, lease: &LeaseId, now: Timestamp) -> bool {
        let live = self.lease_index(lease).filter(|i| self.leases[*i].live);
        if let Some(i) = live {
            self.counters.out_of_band_deletions += 1;
            self.kill_lease(i, now, true);
        }
        live.is_some()
    }

    /// Runs one effect request against the provider and classifies the result
    /// the way an executor would: provider errors are definite failures.
    pub fn execute(
        &mut self,
        key: &ResourceKey,
        request: &EffectRequest,
        now: Timestamp,
    ) -> OperationOutcome {
        let failed = |e: ProviderError| OperationOutcome::Failed {
            class: match e {
                ProviderError::NoSuchLease(_) => FailureClass::LeaseGone,
                ProviderError::Refused(_) | ProviderError::UnknownKind(_) => FailureClass::Definite,
            },
            reason: e.to_string(),
        };
        match request {
            EffectRequest::CreateLease { template } => {
                match self.create_lease_from(key, Some(template), now) {
                    Ok(g) => OperationOutcome::LeaseCreated {
                        lease: g.lease,
                        endpoint: g.endpoint,
                    },
                    Err(e) => failed(e),
                }
            }
            EffectRequest::LookupEndpoint { lease } => match self.lookup_endpoint(lease, now) {
                Ok(Some(endpoint)) => OperationOutcome::EndpointFound { endpoint },
                Ok(None) => OperationOutcome::EndpointNotReady,
                Err(e) => failed(e),
            },
            EffectRequest::StartBootstrap { lease, .. } => {
                match self.start_bootstrap(key, lease, now) {
                    Ok(g) => OperationOutcome::BootstrapStarted { session: g.session },
                    Err(e) => failed(e),
                }
            }
            EffectRequest::CancelBootstrap { session } => {
                match self.cancel_bootstrap(session, now) {
                    Ok(()) => OperationOutcome::BootstrapCancelled,
                    Err(e) => failed(e),
                }
            }
            EffectRequest::DestroyLease { lease, .. } => match self.destroy_lease(lease, now) {
                Ok(()) => OperationOutcome::LeaseDestroyed,
                Err(e) => failed(e),
            },
        }
    }

    // --- the script ------------------------------------------------------

    /// The script of a session, one step at a time: `None` when the script is done.
    ///
    /// Steps: 0 SshConnect, 1 BootCheck, 2 SwactorStart, 3 Join, 4 SwactorJoined,
    /// 5 Converged, 6 Closed (only when the stream closes after convergence).
    /// A scripted failure replaces the step it belongs to (AgentLost replaces
    /// step 6: the node converged, then lost its agent) and ends the script.
    fn script_event(s: &Session, fail_encoding: bool) -> Option<u8> {
        let failing_step = s.fail_at.map(|stage| match stage {
            BootstrapStage::SshConnectFailed => 0,
            BootstrapStage::BootCheckFailed => 1,
            BootstrapStage::SwactorStartFailed => 2,
            BootstrapStage::JoinFailed => 3,
            _ => SCRIPT_CLOSED,
        });
        if let (Some(step), Some(stage)) = (failing_step, s.fail_at)
            && step == s.next_step
        {
            // Both encodings of a failure are legal; exercise both.
            return Some(if fail_encoding {
                SCRIPTED_FAILURE + stage_code(stage)
            } else {
                stage_code(stage)
            });
        }
        match s.next_step {
            0 => Some(stage_code(BootstrapStage::SshConnect)),
            1 => Some(stage_code(BootstrapStage::BootCheck)),
            2 => Some(stage_code(BootstrapStage::SwactorStart)),
            3 => Some(stage_code(BootstrapStage::Join)),
            4 => Some(JOINED),
            SCRIPT_CONVERGED => Some(stage_code(BootstrapStage::Converged)),
            SCRIPT_CLOSED if s.close_after_converge => Some(CLOSED),
            _ => None,
        }
    }

    fn has_next(s: &Session) -> bool {
        s.final_event().is_some() || (s.open && Self::script_event(s, false).is_some())
    }

    /// When the next bootstrap observation is due, if any session has one left.
    pub fn next_observation_at(&self) -> Option<Timestamp> {
        let scripted = self.schedule.keys().next().copied();
        let replay = self.replays.keys().next().map(|(at, _)| *at);
        match (scripted, replay) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Every host that followed a stream is gone (it crashed or stopped):
    /// sessions keep running and logging, but nobody hears them until a new
    /// host adopts them.
    pub fn detach_streams(&mut self) {
        for s in self.sessions.iter_mut() {
            s.attached = false;
        }
        self.replays.clear();
    }

    /// A host adopted session `i`: if nobody followed it, its log is replayed from the start.
    fn attach(&mut self, i: usize, now: Timestamp) {
        let s = &mut self.sessions[i];
        if s.attached {
            return;
        }
        s.attached = true;
        for code in s.history.codes() {
            self.replay_seq += 1;
            self.replays
                .insert((now, self.replay_seq), (index_u32(i), code & CODE_MASK));
        }
    }

    /// What the provider holds for `run` as a listing sees it at `now`: every
    /// visible live lease, with its key's open session.
    pub fn list(&self, run: &RunId, now: Timestamp) -> Vec<Listed> {
        let mut held: Vec<usize> = (0..self.keys.len())
            .filter(|k| self.keys[*k].lease != NONE && self.keys[*k].key.run_id == *run)
            .collect();
        held.sort_unstable_by(|a, b| self.keys[*a].key.cmp(&self.keys[*b].key));
        held.into_iter()
            .filter_map(|k| {
                let lease = self.list_lease_index(k, now)?;
                let entry = &self.keys[k];
                Some(Listed {
                    key: entry.key.clone(),
                    lease: Some(lease_id(self.leases[lease].number)),
                    session: (entry.session != NONE)
                        .then(|| session_id(self.sessions[entry.session as usize].number)),
                })
            })
            .collect()
    }

    /// What the provider holds for `run`, visible or not, one entry per
    /// identity that has a live lease or an open session, in no particular
    /// order. The lease is the key's last live lease in id order (there is
    /// more than one only after a double create).
    pub fn holdings<'a>(
        &'a self,
        run: &'a RunId,
    ) -> impl Iterator<Item = (&'a ResourceKey, Option<LeaseId>, Option<SessionId>)> + 'a {
        (0..self.keys.len()).filter_map(move |k| {
            let entry = &self.keys[k];
            if entry.key.run_id != *run || (entry.lease == NONE && entry.session == NONE) {
                return None;
            }
            let lease = self
                .live_leases_of(k)
                .max_by_key(|i| lex_key(self.leases[*i].number))
                .map(|i| lease_id(self.leases[i].number));
            let session = (entry.session != NONE)
                .then(|| session_id(self.sessions[entry.session as usize].number));
            Some((&entry.key, lease, session))
        })
    }

    /// Every observation due at or before `now`, in time order (ties in session order).
    pub fn poll_observations(&mut self, now: Timestamp) -> Vec<BootstrapObservation> {
        let mut out = Vec::new();
        let mut poll = Poll::new(self, now);
        while let Some((i, code)) = poll.next_code() {
            let b = &*poll.backend;
            let s = &b.sessions[i];
            let key = &b.keys[s.key as usize].key;
            out.push(BootstrapObservation {
                node: key.node,
                attempt: key.attempt,
                session: session_id(s.number),
                event: event(code),
            });
        }
        out
    }

    /// [`FakeBackend::poll_observations`] as an iterator of [`SessionEvent`]s:
    /// the same observations in the same order, by session index rather
    /// than with the attempt's identity. Observations the iterator is
    /// dropped before yielding stay due. Once it is exhausted,
    /// [`PollEvents::ended`] names the sessions that reported and are no
    /// longer open.
    pub fn poll_events(&mut self, now: Timestamp) -> PollEvents<'_> {
        PollEvents {
            poll: Poll::new(self, now),
            reported: Vec::new(),
        }
    }

    /// What [`FakeBackend::poll_events`] reported for session `i` from its
    /// script so far, in order (a replay to an adopting host not included).
    pub fn delivered(&self, i: usize) -> impl Iterator<Item = BootstrapEvent> + '_ {
        self.sessions
            .get(i)
            .into_iter()
            .flat_map(|s| s.history.codes())
            .filter(|c| c & DELIVERED != 0)
            .map(|c| event(c & CODE_MASK))
    }

    /// The observation of session `i` due at `at`, if it reaches a host:
    /// advances its script, logs the event and reschedules the session.
    fn fire(&mut self, i: usize, at: Timestamp) -> Option<u8> {
        let encoding = self.rng.chance(500);
        let step_ms = self.config.bootstrap_step_ms;
        let s = &mut self.sessions[i];
        s.scheduled = false;
        let (code, lost) = match s.final_event() {
            Some(code) => {
                s.final_event = NO_EVENT;
                (code, false)
            }
            None => {
                let code = Self::script_event(s, encoding).expect("has_next checked it");
                let lost = s.lose_mask & (1 << s.next_step.min(7)) != 0;
                s.next_step = s.next_step.saturating_add(1);
                (code, lost)
            }
        };
        let failure = is_failure(code);
        let mut close_at = None;
        if failure && s.open {
            // The agent is dead; the stream closes one step later.
            s.next_step = u8::MAX;
            s.final_event = CLOSED;
            close_at = Some(Timestamp(at.0.saturating_add(step_ms)));
        }
        let ends = failure || code == CLOSED;
        let k = s.key as usize;
        if ends && s.open {
            s.open = false;
            self.keys[k].stats.open_sessions -= 1;
            self.close_session_index(k, i);
        }
        match close_at {
            Some(t) => self.schedule_at(i, t),
            None => self.reschedule(i),
        }
        let s = &mut self.sessions[i];
        let heard = s.attached && !lost;
        s.history.push(if heard { code | DELIVERED } else { code });
        if !s.attached {
            return None;
        }
        if lost {
            self.counters.observations_lost += 1;
            return None;
        }
        Some(code)
    }

    /// Every lease ever made, by id.
    pub fn leases(&self) -> Leases<'_> {
        Leases { backend: self }
    }

    /// Every session ever started, by id.
    pub fn sessions(&self) -> Sessions<'_> {
        Sessions { backend: self }
    }

    /// Per-identity counts, for every identity the backend was ever asked about.
    pub fn keys(&self) -> Keys<'_> {
        Keys { backend: self }
    }

    /// Lifetime totals.
    pub fn counters(&self) -> BackendCounters {
        self.counters
    }

    /// Live leases and open sessions, as (identity, what) pairs, in id order.
    pub fn live_resources(&self) -> impl Iterator<Item = (&ResourceKey, LiveResource)> {
        let leases = self
            .in_id_order(Kind::Lease)
            .map(|i| &self.leases[i])
            .filter(|l| l.live)
            .map(|l| {
                let key = &self.keys[l.key as usize].key;
                (key, LiveResource::Lease(lease_id(l.number)))
            });
        let sessions = self
            .in_id_order(Kind::Session)
            .map(|i| &self.sessions[i])
            .filter(|s| s.open)
            .map(|s| {
                let key = &self.keys[s.key as usize].key;
                (key, LiveResource::Session(session_id(s.number)))
            });
        leases.chain(sessions)
    }
}

/// One live resource, as listed by [`FakeBackend::live_resources`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LiveResource {
    /// A live lease.
    Lease(LeaseId),
    /// An open session.
    Session(SessionId),
}

/// A poll in progress: the replays due, then the schedule one instant at a
/// time, each instant's sessions in the order of their id strings.
struct Poll<'a> {
    backend: &'a mut FakeBackend,
    now: Timestamp,
    /// The instant being worked through, its sessions in order, and how
    /// many of them are done.
    instant: Option<(Timestamp, Vec<u32>, usize)>,
    /// The session that fired last, which may be due again at the same
    /// instant (a zero step) and then comes before every other.
    last: Option<usize>,
}

impl<'a> Poll<'a> {
    fn new(backend: &'a mut FakeBackend, now: Timestamp) -> Self {
        Self {
            backend,
            now,
            instant: None,
            last: None,
        }
    }

    /// The next observation that reaches a host: its session and code.
    fn next_code(&mut self) -> Option<(usize, u8)> {
        let b = &mut *self.backend;
        if let Some(entry) = b.replays.first_entry().filter(|e| e.key().0 <= self.now) {
            let (i, code) = entry.remove();
            return Some((i as usize, code));
        }
        loop {
            // A session fired at this instant and due at it again is
            // (at, itself), before every session left at the instant.
            if let (Some(i), Some((at, _, _))) = (self.last, &self.instant) {
                let s = &b.sessions[i];
                if s.scheduled && s.due == *at {
                    let at = *at;
                    b.unschedule(i);
                    if let Some(code) = b.fire(i, at) {
                        return Some((i, code));
                    }
                    continue;
                }
            }
            self.last = None;
            if let Some((at, order, done)) = &mut self.instant
                && let Some(&i) = order.get(*done)
            {
                *done += 1;
                let (at, i) = (*at, i as usize);
                self.last = Some(i);
                if let Some(code) = b.fire(i, at) {
                    return Some((i, code));
                }
                continue;
            }
            self.instant = None;
            let entry = b.schedule.first_entry().filter(|e| *e.key() <= self.now)?;
            let (at, bucket) = entry.remove_entry();
            let mut order = bucket.sessions;
            // Drop entries of sessions that moved since (there are some
            // only if one moved out), then put the rest in the order of
            // their id strings (a bucket filled from an earlier one, in
            // order, is in order already).
            let stale = order.len() != bucket.live as usize;
            if stale {
                order.retain(|i| {
                    let s = &b.sessions[*i as usize];
                    s.scheduled && s.due == at
                });
            }
            if !bucket.sorted {
                let lex = |i: &u32| lex_key(b.sessions[*i as usize].number);
                let mut keyed: Vec<(u128, u32)> = order.iter().map(|i| (lex(i), *i)).collect();
                keyed.sort_unstable();
                order.clear();
                order.extend(keyed.into_iter().map(|(_, i)| i));
            }
            if stale {
                order.dedup();
            }
            debug_assert_eq!(order.len(), bucket.live as usize);
            self.instant = Some((at, order, 0));
        }
    }
}

impl Drop for Poll<'_> {
    fn drop(&mut self) {
        // Sessions of the current instant not fired yet stay due at it.
        let Some((at, order, done)) = self.instant.take() else {
            return;
        };
        let rest = &order[done..];
        if rest.is_empty() {
            return;
        }
        let b = &mut *self.backend;
        let bucket = b.schedule.entry(at).or_default();
        for i in rest {
            bucket.push(*i, b.sessions[*i as usize].number);
        }
    }
}

/// The observations due, as [`FakeBackend::poll_events`] yields them.
#[must_use = "observations not taken stay due"]
pub struct PollEvents<'a> {
    poll: Poll<'a>,
    /// Sessions that reported and may not be open at the end of the poll:
    /// ended already, or due again within it.
    reported: Vec<u32>,
}

impl PollEvents<'_> {
    /// The sessions that reported in this poll and are no longer open (a
    /// session may be named more than once). A session can end by an
    /// observation nobody hears (a lost close), so MUST be asked only once
    /// every observation due was taken, to be complete.
    pub fn ended(&self) -> impl Iterator<Item = usize> + '_ {
        let sessions = &self.poll.backend.sessions;
        self.reported
            .iter()
            .map(|i| *i as usize)
            .filter(|i| !sessions[*i].open)
    }
}

impl Iterator for PollEvents<'_> {
    type Item = SessionEvent;

    fn next(&mut self) -> Option<SessionEvent> {
        let (i, code) = self.poll.next_code()?;
        let s = &self.poll.backend.sessions[i];
        if !s.open || (s.scheduled && s.due <= self.poll.now) {
            self.reported.push(index_u32(i));
        }
        Some(SessionEvent {
            session: i,
            event: event(code),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lex_keys_order_numbers_as_their_decimal_strings() {
        let mut rng = SimRng::new(7);
        let mut numbers: Vec<u64> = (0..2_000)
            .map(|i| match i % 4 {
                0 => rng.range(0, 30),
                1 => rng.range(0, 1_200),
                2 => rng.range(0, u64::MAX),
                _ => 10u64.pow(rng.range(0, 18) as u32) * rng.range(1, 3),
            })
            .collect();
        numbers.extend([0, 1, 9, 10, 11, 19, 2, 20, 99, 100, u64::MAX, u64::MAX / 10]);
        for a in &numbers {
            for b in numbers.iter().step_by(7) {
                assert_eq!(
                    lex_key(*a).cmp(&lex_key(*b)),
                    a.to_string().cmp(&b.to_string()),
                    "{a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn lex_order_walks_one_to_max_in_string_order() {
        for max in [
            0, 1, 2, 9, 10, 11, 19, 20, 99, 100, 101, 109, 110, 999, 1_000, 1_234, 10_001,
        ] {
            let walked: Vec<u64> = LexOrder::new(max).collect();
            let mut sorted: Vec<u64> = (1..=max).collect();
            sorted.sort_by_key(u64::to_string);
            assert_eq!(walked, sorted, "max {max}");
        }
    }

    #[test]
    fn ids_parse_back_only_in_the_form_they_are_made() {
        for n in [1, 9, 10, 12_345, u64::MAX] {
            assert_eq!(lease_id(n).as_str(), format!("lease-{n}"));
            assert_eq!(session_id(n).as_str(), format!("session-{n}"));
            assert_eq!(endpoint_of(n).as_str(), format!("ssh://lease-{n}"));
            assert_eq!(parse_number(lease_id(n).as_str(), LEASE_PREFIX), Some(n));
        }
        for bad in [
            "lease-",
            "lease-0",
            "lease-01",
            "lease-+1",
            "lease--1",
            "lease-1a",
            "lease-18446744073709551616",
            "session-1",
            "lease 1",
        ] {
            assert_eq!(parse_number(bad, LEASE_PREFIX), None, "{bad}");
        }
    }
}
