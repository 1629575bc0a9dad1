//! The swarm protocol (`swactor/swarm/0`): agents join the daemon and stay connected.
//!
//! Anyone who knows the daemon's address may open this protocol, so nothing
//! is trusted before a join is checked: the first frame must arrive within
//! the engine's handshake deadline and fit its small first-frame limit, and
//! it is accepted only from the key derived for that very (run, node,
//! attempt), with its token. Refusals are logged once, then summarised.
//!
//! When several daemons take turns leading the run, a welcome names them
//! all, and a change of that list reaches each joined agent with the
//! renewal that answers its next heartbeat.
//!
//! A welcomed agent's connection is also its attempt's jobs link: the
//! daemon opens each job request (`swactor/jobs/0`'s frames, see
//! [`crate::jobs`]) on a stream of its own on it, so an agent holds one
//! connection to its daemon, and its jobs link lives and dies with its
//! session.

use crate::jobs::service::JobLinks;
use crate::protocol::{
    Heartbeat, JoinReply, JoinRequest, REPLICAS_MAX, Renewal, SWARM_REPLY_LEN_MAX_BYTES,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use swactor_actors::ClusterHandle;
use swactor_engine::Starvation;
use swactor_engine::iroh::endpoint::{Connection, RecvStream, SendStream};
use swactor_engine::iroh::protocol::{AcceptError, ProtocolHandler};
use swactor_engine::net::{
    FIRST_FRAME_LEN_MAX_BYTES, FrameError, HANDSHAKE_DEADLINE, PreAuth, PreAuthSlot,
    REFUSAL_LOG_INTERVAL, accept_first_frame, recv_frame, send_frame,
};
use swactor_provisioning::{Liveness, ResourceKey};
use tokio::sync::watch;

/// How often a connected agent's join is asserted again.
const JOIN_REASSERT: Duration = Duration::from_secs(3);

// After a daemon restart, an agent first notices that its old link died
// (its idle timeout), then is taken as joined here (a join is asserted
// again at most every `JOIN_REASSERT`). Both must fit in the rejoin window
// the host gives it, or a live node would be replaced on every restart.
const _: () = assert!(
    crate::agent::AGENT_IDLE_TIMEOUT.as_millis() + JOIN_REASSERT.as_millis()
        < swactor_provisioning::DEFAULT_REJOIN_WINDOW_MS as u128,
    "the rejoin window must outlast the agent's idle timeout and a join reassert"
);

/// Largest heartbeat frame (a heartbeat is a counter).
const SMALL_FRAME_LEN_MAX_BYTES: usize = 64;

#[derive(Debug, Clone)]
pub(crate) struct SwarmHandler {
    pub(crate) cluster: ClusterHandle,
    pub(crate) secret: [u8; 32],
    pub(crate) refusals: RefusalLog,
    /// Each attempt's live session.
    pub(crate) sessions: Sessions,
    /// Connections not joined yet, bounded apart from joined ones.
    pub(crate) pre_auth: PreAuth,
    /// When each node's lease was last renewed, for the views.
    pub(crate) renewals: crate::renewals::Renewals,
    /// Every daemon of the run's agents' address, told to agents so they
    /// find whichever leads (empty: this daemon alone).
    pub(crate) replicas: crate::replicas::Replicas,
}

impl SwarmHandler {
    /// The protocol handler: this, with the daemon's jobs, whose link each
    /// welcomed agent's connection becomes.
    pub(crate) fn with_jobs(self, jobs: JobLinks) -> SwarmProtocol {
        SwarmProtocol { swarm: self, jobs }
    }
}

/// `swactor/swarm/0` on the daemon: each agent's one connection, which
/// carries its join, heartbeats and renewals, and from the welcome on its
/// attempt's jobs link (`swactor/jobs/0`'s frames, on streams the daemon
/// opens).
#[derive(Debug, Clone)]
pub(crate) struct SwarmProtocol {
    swarm: SwarmHandler,
    jobs: JobLinks,
}

impl ProtocolHandler for SwarmProtocol {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        self.swarm.accept(conn, &self.jobs).await;
        Ok(())
    }
}

impl SwarmHandler {
    /// Serves one connection: its join, then, once welcomed, its agent's
    /// session and jobs link until either side ends it.
    async fn accept(&self, conn: Connection, jobs: &JobLinks) {
        // Strangers are bounded apart from joined agents: a connection
        // holds a pre-authentication place until its join has a verdict.
        let Some(unjoined) = self.enter_unjoined(&conn) else {
            return;
        };
        // Closes the connection itself when the peer is slow, silent or too big.
        let Ok((mut send, mut recv, join)) =
            accept_first_frame::<JoinRequest>(&conn, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
        else {
            return;
        };
        // Only the key this attempt's agent was given may join for it, and
        // only with its token: a token read off another process is useless.
        let checked = join.verify(&self.secret, conn.remote_id());
        // One session per attempt: while its agent is heard on another
        // link, a second join is told "not yet"; a silent one is replaced.
        let session = match &checked {
            Ok(key) => self.sessions.claim(key, &conn),
            Err(_) => None,
        };
        let verdict = self.admit(&checked, session.is_some()).await;
        let _session = SessionGuard {
            sessions: &self.sessions,
            key: checked.as_ref().ok().cloned(),
            session: session.clone(),
        };
        // The welcome names the run's daemons as they are now; a later
        // change goes out with a renewal.
        let mut replicas = self.replicas.receiver();
        let told = told(&replicas.borrow_and_update());
        let sent = self.answer(&mut send, &join, &verdict, told).await;
        drop(unjoined);
        let (key, liveness, session) = match (sent, checked, verdict, session) {
            (Ok(()), Ok(key), Ok(liveness), Some(session)) => {
                // The welcome is the lease's first renewal.
                self.renewals.renewed(&key);
                (key, liveness, session)
            }
            _ => {
                let _ = send.finish();
                let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
                return;
            }
        };
        // The connection carries the agent's jobs too: renewals go out
        // ahead of any job request data waiting to be sent.
        let _ = send.set_priority(1);
        let mut link = Link {
            conn: &conn,
            send: &mut send,
            recv: &mut recv,
        };
        let renewer = Renewer::new(&liveness, replicas, Instant::now());
        // From the welcome on, this connection is the attempt's jobs link
        // too: job requests go out on streams the daemon opens on it, and
        // the link goes down with the session. One that cannot be linked
        // (only a bug leaves a live link behind) ends at once, through the
        // session's own end, so the cluster hears the agent is gone.
        let linked = jobs.link(&key, &conn);
        if linked.is_none() {
            conn.close(1u32.into(), b"this attempt is linked already");
        }
        self.serve(&mut link, key, &liveness, &session, renewer)
            .await;
        drop(linked);
    }
}

/// A joined agent's link: its connection, and the stream its heartbeats
/// come on and its lease's renewals go back on.
struct Link<'a> {
    conn: &'a Connection,
    send: &'a mut SendStream,
    recv: &'a mut RecvStream,
}

/// How long a renewal may wait to be sent: one the agent does not read in
/// time is dropped (the next heartbeat brings another), so an agent that
/// stops reading never holds up the daemon's reading of its heartbeats.
const RENEWAL_SEND_MAX: Duration = Duration::from_millis(200);

/// A join's verdict: the agent's liveness, or why not and whether the agent
/// should ask again.
type Verdict = Result<Liveness, (String, bool)>;

impl SwarmHandler {
    /// Takes a pre-authentication place for `conn`, or closes it and logs
    /// the refusal when all are taken.
    fn enter_unjoined(&self, conn: &Connection) -> Option<PreAuthSlot> {
        let Some(unjoined) = self.pre_auth.try_enter() else {
            conn.close(
                swactor_engine::net::codes::CLOSE_BUSY,
                b"too many unauthenticated connections",
            );
            self.refusals.refused(
                "(an unauthenticated peer)",
                &format!(
                    "{} connections are waiting to join already, the most",
                    self.pre_auth.max()
                ),
            );
            return None;
        };
        Some(unjoined)
    }

    /// Decides a checked join: refused, deferred, or welcomed by the cluster.
    async fn admit(&self, checked: &Result<ResourceKey, &'static str>, claimed: bool) -> Verdict {
        // (reason, whether the agent should ask again)
        match (checked, claimed) {
            (Err(reason), _) => Err(((*reason).to_owned(), false)),
            (Ok(key), false) => Err((
                format!("the agent of {key} is connected on another link"),
                true,
            )),
            (Ok(key), true) => match self.cluster.agent_join(key.clone()).await {
                Ok(v) => v.map_err(|e| (e.to_string(), e.is_transient())),
                // The cluster actor is restarting from its journal, or the
                // daemon is going away: not a verdict on the attempt.
                Err(e) => Err((e.to_string(), true)),
            },
        }
    }

    /// Sends the verdict to the agent (a welcome names `replicas`) and logs
    /// a refusal or a deferral.
    async fn answer(
        &self,
        send: &mut SendStream,
        join: &JoinRequest,
        verdict: &Verdict,
        replicas: Vec<SocketAddr>,
    ) -> Result<(), FrameError> {
        let reply = match verdict {
            Ok(liveness) => JoinReply::Welcome {
                heartbeat_ms: liveness.heartbeat_ms,
                lease_ms: liveness.lease_ms,
                lease_waits_for_jobs: liveness.lease_waits_for_jobs,
                replicas,
            },
            Err((reason, true)) => JoinReply::NotYet(reason.clone()),
            Err((reason, false)) => JoinReply::Refused(reason.clone()),
        };
        let sent = send_frame(send, &reply, SWARM_REPLY_LEN_MAX_BYTES).await;
        match verdict {
            Err((reason, false)) => {
                // The key is the peer's own unchecked text: escaped, so it
                // cannot forge log lines.
                self.refusals
                    .refused(&join.key.text().escape_debug().to_string(), reason);
            }
            Err((reason, true)) => {
                tracing::debug!(key = %join.key.text().escape_debug(), %reason, "join deferred");
            }
            Ok(_) => {}
        }
        sent
    }

    /// Serves a joined agent: reads its heartbeats and answers them with
    /// renewals when `renewer` says so. Whether it is silent is judged
    /// apart, for every agent at once, by [`Sessions::sweep`]; this only
    /// notes when it was heard, tells the cluster when an agent that was
    /// away is heard again, and when its link ends.
    async fn serve(
        &self,
        link: &mut Link<'_>,
        key: ResourceKey,
        liveness: &Liveness,
        session: &Session,
        mut renewer: Renewer,
    ) {
        let conn = link.conn;
        tracing::info!(%key, "agent joined");
        let clock = &self.sessions.clock;
        session.start(clock, liveness);
        loop {
            match recv_frame::<Heartbeat, _>(&mut *link.recv, SMALL_FRAME_LEN_MAX_BYTES).await {
                Ok(Some(Heartbeat(n))) => {
                    if session.heard(clock) && !self.back(conn, &key).await {
                        return;
                    }
                    if let Some(renewal) = renewer.handle_heartbeat(n, Instant::now())
                        && renew(link.send, &key, &renewal).await
                    {
                        renewer.handle_sent(&renewal);
                        self.renewals.renewed(&key);
                    }
                }
                // The stream ended or broke, the sweep closed a link silent
                // past its grace, or a new link took over (each of those two
                // was away already): the agent is gone, if it was not.
                _ => {
                    if let Some(silent) = session.leave(clock) {
                        tracing::info!(%key, silent_for = ?silent, "agent disconnected");
                        self.cluster.agent_gone(key, silent);
                    }
                    conn.close(0u32.into(), b"silent");
                    return;
                }
            }
        }
    }

    /// Tells the cluster an agent that was away is heard again on its
    /// link; false when its attempt is no longer wanted (its connection is
    /// then closed).
    async fn back(&self, conn: &Connection, key: &ResourceKey) -> bool {
        match self.cluster.agent_join(key.clone()).await {
            Ok(Err(refusal)) => {
                tracing::info!(%key, %refusal, "dropping an agent no longer wanted");
                conn.close(1u32.into(), b"no longer wanted");
                false
            }
            Ok(Ok(_)) => {
                tracing::info!(%key, "agent heard again on its link");
                true
            }
            // The cluster is restarting: the sweep's next assertion
            // brings it up to date.
            Err(_) => true,
        }
    }
}

/// The first [`REPLICAS_MAX`] of the run's daemons: what an agent is told
/// (it would keep no more), so a welcome or a renewal always fits its frame.
fn told(replicas: &[SocketAddr]) -> Vec<SocketAddr> {
    replicas.iter().take(REPLICAS_MAX).copied().collect()
}

/// When a joined agent's heartbeat is answered with a renewal of its
/// lease: the first heartbeat heard `renew_every_ms` after the last
/// renewal, and the first heard after the run's daemons changed, whose new
/// list that renewal carries. A renewal only ever answers a heartbeat the
/// daemon heard, so a new list never keeps alive the lease of an agent it
/// does not hear. Call [`Self::handle_heartbeat`] for each heartbeat, then
/// [`Self::handle_sent`] once its renewal is on the agent's stream.
struct Renewer {
    /// How long after a renewal the next one is due; `None` for a lease
    /// that never lapses (renewed only to tell a new list).
    every: Option<Duration>,
    /// When the last renewal went out (or was given up).
    last: Instant,
    /// The run's daemons, as they change.
    replicas: watch::Receiver<Vec<SocketAddr>>,
    /// The list changed since the agent was last told it.
    untold: bool,
}

impl Renewer {
    /// For an agent welcomed at `now` (the welcome was its lease's first
    /// renewal, and told it the list `replicas` last marked seen).
    fn new(liveness: &Liveness, replicas: watch::Receiver<Vec<SocketAddr>>, now: Instant) -> Self {
        Self {
            every: (liveness.renew_every_ms > 0)
                .then(|| Duration::from_millis(liveness.renew_every_ms)),
            last: now,
            replicas,
            untold: false,
        }
    }

    /// The renewal answering heartbeat `n`, heard at `now`, if one is due.
    /// A renewal that is due counts as sent whether or not it is (the next
    /// one is due `renew_every_ms` later); a new list is sent again with
    /// every heartbeat until one reaches the agent.
    #[must_use]
    fn handle_heartbeat(&mut self, n: u64, now: Instant) -> Option<Renewal> {
        // Every sender gone: the list can change no more.
        if self.replicas.has_changed().unwrap_or(false) {
            self.replicas.mark_unchanged();
            self.untold = true;
        }
        let on_time = self
            .every
            .is_some_and(|every| now.saturating_duration_since(self.last) >= every);
        if !on_time && !self.untold {
            return None;
        }
        self.last = now;
        Some(Renewal {
            heartbeat: n,
            replicas: self.untold.then(|| told(&self.replicas.borrow())),
        })
    }

    /// `renewal` reached the agent's stream.
    fn handle_sent(&mut self, renewal: &Renewal) {
        if renewal.replicas.is_some() {
            self.untold = false;
        }
    }
}

/// Renews `key`'s lease with `renewal`; a renewal that cannot be sent at
/// once is dropped. Whether it was sent.
async fn renew(send: &mut SendStream, key: &ResourceKey, renewal: &Renewal) -> bool {
    let sent = tokio::time::timeout(
        RENEWAL_SEND_MAX,
        send_frame(send, renewal, SWARM_REPLY_LEN_MAX_BYTES),
    )
    .await;
    let sent = matches!(sent, Ok(Ok(())));
    if !sent {
        tracing::debug!(%key, "a lease renewal could not be sent; the next heartbeat brings another");
    }
    sent
}

/// The live session of each attempt's agent on this endpoint, and the
/// clock their silences are judged on.
#[derive(Debug, Clone)]
pub(crate) struct Sessions {
    all: Arc<Mutex<HashMap<ResourceKey, Arc<Session>>>>,
    clock: Arc<ListenClock>,
}

impl Sessions {
    /// No sessions yet; silences are judged net of `starvation`.
    pub(crate) fn new(starvation: Starvation) -> Self {
        Self {
            all: Arc::default(),
            clock: Arc::new(ListenClock::new(starvation)),
        }
    }
}

/// The clock silences are judged on: milliseconds since it was made, and
/// how much of that time the daemon could not listen (what its starvation
/// measure counted, and how late the sweep woke beyond scheduling noise).
#[derive(Debug)]
struct ListenClock {
    origin: Instant,
    starvation: Starvation,
    /// The sweep's late wake-ups, summed, in milliseconds.
    late_ms: AtomicU64,
}

/// A moment on a [`ListenClock`]: its time, and its two deaf totals then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Moment {
    at_ms: u64,
    starved_ms: u64,
    late_ms: u64,
}

impl ListenClock {
    fn new(starvation: Starvation) -> Self {
        Self {
            origin: Instant::now(),
            starvation,
            late_ms: AtomicU64::new(0),
        }
    }

    fn now(&self) -> Moment {
        Moment {
            at_ms: u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX),
            starved_ms: self.starvation.total_ms(),
            late_ms: self.late_ms.load(Ordering::Relaxed),
        }
    }

    /// The sweep woke `late` after it meant to.
    fn woke_late(&self, late: Duration) {
        if late > Starvation::COUNTED_MIN {
            let ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
            self.late_ms.fetch_add(ms, Ordering::Relaxed);
        }
    }
}

impl Moment {
    /// How long the agent heard at `self` has been silent at `now`, not
    /// counting the time the daemon could not listen (the larger of its
    /// two measures of it).
    fn silent_until(&self, now: &Moment) -> Duration {
        let deaf = now
            .starved_ms
            .saturating_sub(self.starved_ms)
            .max(now.late_ms.saturating_sub(self.late_ms));
        Duration::from_millis(now.at_ms.saturating_sub(self.at_ms).saturating_sub(deaf))
    }
}

/// One agent's session: its link, when it was last heard, and whether it
/// is away (silent: disconnected, its grace running).
#[derive(Debug)]
struct Session {
    conn: Connection,
    /// When its agent was last heard, once it was welcomed.
    heard: Mutex<Heard>,
}

#[derive(Debug, Default)]
struct Heard {
    /// Set once the welcome went out: only then is silence judged.
    serving: bool,
    at: Moment,
    away: bool,
    /// Silent this long, it is away; away this much longer, its link is
    /// closed.
    silence: Duration,
    kept: Duration,
}

/// What a sweep decided about one session.
#[derive(Debug, PartialEq, Eq)]
enum Silence {
    Fine,
    Away(Duration),
    Close,
}

impl Heard {
    /// Welcomed at `now` on `liveness`'s terms.
    fn start(&mut self, now: Moment, liveness: &Liveness) {
        let silence = Duration::from_millis(liveness.silence_ms);
        self.serving = true;
        self.at = now;
        self.silence = silence;
        // A silent agent counts as disconnected (its grace runs), but its
        // connection stays open for as long as the grace may last: an
        // agent that was only stuck, or whose heartbeats waited in a
        // congested daemon, comes back on it without a new handshake (a
        // hundred redials into a daemon that is already behind would only
        // put it further behind).
        self.kept = silence + Duration::from_millis(liveness.lost_grace_ms);
    }

    /// Heard at `now`; true when it was away (it is back).
    fn heard(&mut self, now: Moment) -> bool {
        self.at = now;
        std::mem::replace(&mut self.away, false)
    }

    /// Its link ended at `now`: how long it had been silent, unless it was
    /// away already (the cluster was told then) or never welcomed.
    fn leave(&mut self, now: &Moment) -> Option<Duration> {
        if self.away || !self.serving {
            return None;
        }
        self.away = true;
        Some(self.at.silent_until(now))
    }

    /// The sweep's look at it at `now`: away once silent for its window,
    /// its link closed once away past its grace.
    fn judge(&mut self, now: &Moment) -> Silence {
        if !self.serving {
            return Silence::Fine;
        }
        let silent = self.at.silent_until(now);
        if !self.away && silent >= self.silence {
            self.away = true;
            return Silence::Away(silent);
        }
        if self.away && silent >= self.kept {
            return Silence::Close;
        }
        Silence::Fine
    }
}

impl Session {
    fn lock(&self) -> std::sync::MutexGuard<'_, Heard> {
        self.heard.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn start(&self, clock: &ListenClock, liveness: &Liveness) {
        self.lock().start(clock.now(), liveness);
    }

    /// Heard now; true when it was away (it is back: the caller tells the
    /// cluster). Marked back under the same lock the sweep marks it away
    /// under, so the cluster hears "gone" before "back".
    fn heard(&self, clock: &ListenClock) -> bool {
        self.lock().heard(clock.now())
    }

    fn leave(&self, clock: &ListenClock) -> Option<Duration> {
        self.lock().leave(&clock.now())
    }

    fn is_away(&self) -> bool {
        self.lock().away
    }

    /// The sweep's look at it at `now`; an agent found silent is reported
    /// gone under its lock, so a heartbeat heard meanwhile reports it back
    /// only after.
    fn judge(&self, now: &Moment, key: &ResourceKey, cluster: &ClusterHandle) -> Silence {
        let mut heard = self.lock();
        let silence = heard.judge(now);
        if let Silence::Away(silent) = silence {
            tracing::info!(%key, silent_for = ?silent, "agent silent; its grace runs");
            cluster.agent_gone(key.clone(), silent);
        }
        silence
    }

    /// Whether the sweep asserts its join again: it is connected.
    fn to_reassert(&self) -> bool {
        let h = self.lock();
        h.serving && !h.away
    }
}

/// How often the sweep judges silences: a fifth of the shortest silence
/// window, so an agent is never shown away much later than its window.
const SWEEP_EVERY: Duration = Duration::from_millis(200);

const _: () = assert!(
    SWEEP_EVERY.as_millis() * 5 <= Liveness::SILENCE_MIN_MS as u128,
    "the sweep must judge at least five times per shortest silence window"
);

impl Sessions {
    /// A session for `key` on `conn`, unless its agent is heard on another
    /// link; a silent one's link is closed (superseded).
    fn claim(&self, key: &ResourceKey, conn: &Connection) -> Option<Arc<Session>> {
        let mut all = self.all.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = all.get(key) {
            if !old.is_away() {
                return None;
            }
            // Another link of this attempt's agent joined while this one
            // was silent: it carries the agent from now on.
            tracing::info!(%key, "agent joined on a new link; closing its silent one");
            old.conn.close(0u32.into(), b"superseded");
        }
        let session = Arc::new(Session {
            conn: conn.clone(),
            heard: Mutex::default(),
        });
        all.insert(key.clone(), Arc::clone(&session));
        Some(session)
    }

    /// Forgets `session` of `key`, if it is still the one on record.
    fn release(&self, key: &ResourceKey, session: &Arc<Session>) {
        let mut all = self.all.lock().unwrap_or_else(PoisonError::into_inner);
        if all.get(key).is_some_and(|s| Arc::ptr_eq(s, session)) {
            all.remove(key);
        }
    }

    /// Judges every session's silence every [`SWEEP_EVERY`] (net of the
    /// time the daemon could not listen), and asserts every connected
    /// agent's join again in one batch every [`JOIN_REASSERT`]: a cluster
    /// actor restarted from its journal learns who is still connected, and
    /// an agent whose attempt was replaced meanwhile is dropped. Runs until
    /// the last handle on the sessions is gone.
    pub(crate) async fn sweep(self, cluster: ClusterHandle) {
        let all = Arc::downgrade(&self.all);
        let clock = self.clock.clone();
        drop(self);
        let mut due = Instant::now() + SWEEP_EVERY;
        let mut assert_at = Instant::now() + JOIN_REASSERT;
        loop {
            tokio::time::sleep_until(due.into()).await;
            clock.woke_late(Instant::now().saturating_duration_since(due));
            let Some(all) = all.upgrade() else { return };
            let now = clock.now();
            let mut heard = Vec::new();
            let reassert = Instant::now() >= assert_at;
            {
                let sessions = all.lock().unwrap_or_else(PoisonError::into_inner);
                for (key, session) in sessions.iter() {
                    if session.judge(&now, key, &cluster) == Silence::Close {
                        session.conn.close(0u32.into(), b"silent");
                    }
                    if reassert && session.to_reassert() {
                        heard.push(key.clone());
                    }
                }
            }
            if reassert {
                assert_at = Instant::now() + JOIN_REASSERT;
                if !heard.is_empty() {
                    let refused = cluster
                        .agents_heard(heard.clone())
                        .await
                        .unwrap_or_default();
                    let sessions = all.lock().unwrap_or_else(PoisonError::into_inner);
                    for (key, refusal) in refused {
                        tracing::info!(%key, %refusal, "dropping an agent no longer wanted");
                        if let Some(session) = sessions.get(&key) {
                            session.conn.close(1u32.into(), b"no longer wanted");
                        }
                    }
                    // A link that ended while the batch was on its way may
                    // have said "gone" before the batch said "heard": said
                    // again, so the cluster's last word is the link's.
                    for key in heard {
                        if sessions.get(&key).is_none_or(|s| s.is_away()) {
                            cluster.agent_gone(key, Duration::ZERO);
                        }
                    }
                }
            }
            drop(all);
            due = Instant::now() + SWEEP_EVERY;
        }
    }
}

/// Releases a claimed session however the handler ends.
struct SessionGuard<'a> {
    sessions: &'a Sessions,
    key: Option<ResourceKey>,
    session: Option<Arc<Session>>,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        if let (Some(key), Some(session)) = (&self.key, &self.session) {
            self.sessions.release(key, session);
        }
    }
}

/// Refused joins, logged once and then summarised at most every
/// [`REFUSAL_LOG_INTERVAL`], so a peer cannot fill the log.
#[derive(Debug, Clone, Default)]
pub(crate) struct RefusalLog(Arc<Mutex<RefusalCounts>>);

#[derive(Debug, Default)]
struct RefusalCounts {
    since_summary: u64,
    last_logged: Option<Instant>,
}

impl RefusalLog {
    fn refused(&self, who: &str, reason: &str) {
        let mut c = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match c.last_logged {
            Some(at) if at.elapsed() < REFUSAL_LOG_INTERVAL => c.since_summary += 1,
            _ => {
                if c.since_summary > 0 {
                    tracing::warn!(
                        refused = c.since_summary,
                        "refused {} more join(s) since the last report",
                        c.since_summary
                    );
                }
                tracing::warn!(%who, %reason, "join refused");
                c.since_summary = 0;
                c.last_logged = Some(Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::OrphanPolicy;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// A renewer for a lease of 10 s (renewed every 2 s) welcomed at `at`,
    /// with the sender of its list of daemons.
    fn renewer(at: Instant, lease_s: u32) -> (Renewer, watch::Sender<Vec<SocketAddr>>) {
        let (tx, mut rx) = watch::channel(vec![addr(1)]);
        // As the welcome does.
        assert_eq!(told(&rx.borrow_and_update()), vec![addr(1)]);
        let liveness = Liveness::for_grace(4_000).with_lease(lease_s, OrphanPolicy::Always);
        (Renewer::new(&liveness, rx, at), tx)
    }

    fn at(at_ms: u64, starved_ms: u64, late_ms: u64) -> Moment {
        Moment {
            at_ms,
            starved_ms,
            late_ms,
        }
    }

    #[test]
    fn silence_leaves_out_the_larger_of_the_daemons_two_measures_of_its_deafness() {
        let heard = at(1_000, 50, 10);
        assert_eq!(
            heard.silent_until(&at(3_000, 50, 10)),
            Duration::from_millis(2_000)
        );
        // Starved 700 ms, woke late 300 ms (the same stall seen twice):
        // the larger counts, once.
        assert_eq!(
            heard.silent_until(&at(3_000, 750, 310)),
            Duration::from_millis(1_300)
        );
        assert_eq!(
            heard.silent_until(&at(3_000, 60, 910)),
            Duration::from_millis(1_100)
        );
        // Deaf for longer than the time passed: silent for nothing.
        assert_eq!(heard.silent_until(&at(3_000, 9_000, 10)), Duration::ZERO);
    }

    #[test]
    fn an_agent_is_away_once_silent_for_its_window_and_its_link_closed_past_its_grace() {
        // Grace 4 s: silent 2 s is away, then the link is kept 4 s more.
        let liveness = Liveness::for_grace(4_000);
        let mut h = Heard::default();
        // Not welcomed yet: never judged, and its end tells nobody.
        assert_eq!(h.judge(&at(60_000, 0, 0)), Silence::Fine);
        h.start(at(0, 0, 0), &liveness);
        assert_eq!(h.judge(&at(1_999, 0, 0)), Silence::Fine);
        assert_eq!(
            h.judge(&at(2_000, 0, 0)),
            Silence::Away(Duration::from_millis(2_000))
        );
        // Said once.
        assert_eq!(h.judge(&at(2_500, 0, 0)), Silence::Fine);
        assert_eq!(h.judge(&at(5_999, 0, 0)), Silence::Fine);
        assert_eq!(h.judge(&at(6_000, 0, 0)), Silence::Close);
        // Its link ending now tells nobody again.
        assert_eq!(h.leave(&at(6_001, 0, 0)), None);
    }

    #[test]
    fn an_agent_heard_again_is_back_and_judged_from_then() {
        let liveness = Liveness::for_grace(4_000);
        let mut h = Heard::default();
        h.start(at(0, 0, 0), &liveness);
        assert!(!h.heard(at(500, 0, 0)), "it was not away");
        assert_eq!(h.judge(&at(2_400, 0, 0)), Silence::Fine);
        assert!(matches!(h.judge(&at(2_500, 0, 0)), Silence::Away(_)));
        assert!(h.heard(at(3_000, 0, 0)), "back");
        assert!(!h.heard(at(3_100, 0, 0)));
        assert_eq!(h.judge(&at(5_000, 0, 0)), Silence::Fine);
        // A daemon that slept 10 s judges nobody for it.
        assert_eq!(h.judge(&at(15_000, 10_000, 0)), Silence::Fine);
        // Its link ends while connected: the cluster hears how long it
        // had been silent, once.
        assert_eq!(
            h.leave(&at(15_000, 10_000, 0)),
            Some(Duration::from_millis(1_900))
        );
        assert_eq!(h.leave(&at(15_100, 10_000, 0)), None);
    }

    #[test]
    fn a_renewal_answers_a_heartbeat_on_time_and_names_no_daemon_while_none_changed() {
        let t0 = Instant::now();
        let (mut r, _tx) = renewer(t0, 10);
        assert_eq!(
            r.handle_heartbeat(1, t0 + Duration::from_millis(1_999)),
            None
        );
        let due = r.handle_heartbeat(2, t0 + Duration::from_secs(2));
        assert_eq!(
            due,
            Some(Renewal {
                heartbeat: 2,
                replicas: None
            })
        );
        // Counted from when it was due, sent or not.
        assert_eq!(r.handle_heartbeat(3, t0 + Duration::from_secs(3)), None);
        assert!(r.handle_heartbeat(4, t0 + Duration::from_secs(4)).is_some());
    }

    #[test]
    fn a_changed_list_of_daemons_answers_the_next_heartbeat_until_it_is_sent() {
        let t0 = Instant::now();
        let (mut r, tx) = renewer(t0, 10);
        let soon = t0 + Duration::from_millis(250);
        assert_eq!(r.handle_heartbeat(1, soon), None);
        // Twenty daemons: the agent is told the first sixteen.
        let many: Vec<SocketAddr> = (1..=20).map(addr).collect();
        tx.send_replace(many.clone());
        let first = r.handle_heartbeat(2, soon).unwrap();
        assert_eq!(first.replicas.as_deref(), Some(&many[..REPLICAS_MAX]));
        // Not sent: the next heartbeat carries it again, and the latest list.
        tx.send_replace(vec![addr(2)]);
        let again = r.handle_heartbeat(3, soon).unwrap();
        assert_eq!(again.replicas, Some(vec![addr(2)]));
        r.handle_sent(&again);
        assert_eq!(r.handle_heartbeat(4, soon), None);
        // A list set again to what it was is told again too: harmless.
        tx.send_replace(vec![addr(2)]);
        assert!(r.handle_heartbeat(5, soon).is_some());
    }

    #[test]
    fn a_lease_that_never_lapses_is_renewed_only_to_tell_a_new_list() {
        let t0 = Instant::now();
        let (mut r, tx) = renewer(t0, 0);
        let late = t0 + Duration::from_secs(3_600);
        assert_eq!(r.handle_heartbeat(1, late), None);
        tx.send_replace(Vec::new());
        let told = r.handle_heartbeat(2, late).unwrap();
        assert_eq!(told.replicas, Some(Vec::new()));
        r.handle_sent(&told);
        assert_eq!(r.handle_heartbeat(3, late), None);
        // The daemon's list going away changes nothing.
        drop(tx);
        assert_eq!(r.handle_heartbeat(4, late), None);
    }
}
