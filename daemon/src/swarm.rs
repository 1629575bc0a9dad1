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

use crate::protocol::{
    Heartbeat, JoinReply, JoinRequest, REPLICAS_MAX, Renewal, SWARM_REPLY_LEN_MAX_BYTES,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// The daemon's measure of its own starvation.
    pub(crate) starvation: Starvation,
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

impl ProtocolHandler for SwarmHandler {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // Strangers are bounded apart from joined agents: a connection
        // holds a pre-authentication place until its join has a verdict.
        let Some(unjoined) = self.enter_unjoined(&conn) else {
            return Ok(());
        };
        // Closes the connection itself when the peer is slow, silent or too big.
        let Ok((mut send, mut recv, join)) =
            accept_first_frame::<JoinRequest>(&conn, FIRST_FRAME_LEN_MAX_BYTES, HANDSHAKE_DEADLINE)
                .await
        else {
            return Ok(());
        };
        // Only the key this attempt's agent was given may join for it, and
        // only with its token: a token read off another process is useless.
        let checked = join.verify(&self.secret, conn.remote_id());
        // One session per attempt: while its agent is heard on another
        // link, a second join is told "not yet"; a silent one is replaced.
        let session = match &checked {
            Ok(key) => self.sessions.claim(key),
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
                return Ok(());
            }
        };
        let mut link = Link {
            conn: &conn,
            send: &mut send,
            recv: &mut recv,
        };
        let renewer = Renewer::new(&liveness, replicas, Instant::now());
        self.serve(&mut link, key, &liveness, &session, renewer)
            .await;
        Ok(())
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

/// What waiting for an agent's next frame came to.
enum Waited {
    /// A frame came (or the stream ended or broke).
    Frame(Result<Option<Heartbeat>, FrameError>),
    /// The agent was silent past the window.
    Silent,
    /// Another link of the same attempt's agent took over.
    Superseded,
}

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

    /// Serves a joined agent: follows its heartbeats, answers them with
    /// renewals when `renewer` says so, tells the cluster when it goes
    /// silent or comes back, and asserts its join again now and then.
    async fn serve(
        &self,
        link: &mut Link<'_>,
        key: ResourceKey,
        liveness: &Liveness,
        session: &Session,
        mut renewer: Renewer,
    ) {
        let conn = link.conn;
        // Silent this long, the agent is taken for gone; its grace is
        // counted from its last heartbeat.
        let silence = Duration::from_millis(liveness.silence_ms);
        tracing::info!(%key, "agent joined");
        // The agent stays connected and sends heartbeats. The join is asserted
        // again now and then: a cluster actor restarted from its journal
        // learns who is still connected, and an agent whose attempt was
        // replaced meanwhile is dropped.
        let mut asserted = Instant::now();
        let mut heard = Heard::now(&self.starvation);
        // A silent agent counts as disconnected (its grace runs), but its
        // connection stays open for as long as the grace may last: an agent
        // that was only stuck, or whose heartbeats waited in a congested
        // daemon, comes back on it without a new handshake (a hundred
        // redials into a daemon that is already behind would only put it
        // further behind).
        let mut away = false;
        let kept = silence + Duration::from_millis(liveness.lost_grace_ms);
        loop {
            let next = recv_frame::<Heartbeat, _>(&mut *link.recv, SMALL_FRAME_LEN_MAX_BYTES);
            tokio::pin!(next);
            // Only silence the daemon could have heard counts: time it was
            // starved (or stopped) since the last heartbeat moves the
            // deadline on, and so does a wake-up that itself came late.
            let window = if away { kept } else { silence };
            let frame = match next_frame(&mut heard, window, next, session).await {
                Waited::Frame(frame) => Some(frame),
                Waited::Silent => None,
                Waited::Superseded => {
                    tracing::info!(%key, "agent joined on a new link; closing its silent one");
                    conn.close(0u32.into(), b"superseded");
                    return;
                }
            };
            match frame {
                Some(Ok(Some(Heartbeat(n)))) => {
                    heard = Heard::now(&self.starvation);
                    if let Some(renewal) = renewer.handle_heartbeat(n, Instant::now())
                        && renew(link.send, &key, &renewal).await
                    {
                        renewer.handle_sent(&renewal);
                        self.renewals.renewed(&key);
                    }
                }
                // Silent for the first time: disconnected, grace running.
                None if !away => {
                    away = true;
                    session.away.store(true, Ordering::Relaxed);
                    let silent = heard.silent_for();
                    tracing::info!(%key, silent_for = ?silent, "agent silent; its grace runs");
                    self.cluster.agent_gone(key.clone(), silent);
                    continue;
                }
                // Silent past its grace, gone, or talking nonsense.
                None | Some(_) => {
                    if !away {
                        let silent = heard.silent_for();
                        tracing::info!(%key, silent_for = ?silent, "agent disconnected");
                        self.cluster.agent_gone(key, silent);
                    }
                    conn.close(0u32.into(), b"silent");
                    return;
                }
            }
            // Heard: an agent that was away is back, on the same link, if
            // its attempt is still wanted; a connected one is asserted again
            // now and then.
            if !away && asserted.elapsed() < JOIN_REASSERT {
                continue;
            }
            asserted = Instant::now();
            if !self.reassert(conn, &key, &mut away, session).await {
                return;
            }
        }
    }

    /// Asserts a heard agent's join again; false when its attempt is no
    /// longer wanted (its connection is then closed).
    async fn reassert(
        &self,
        conn: &Connection,
        key: &ResourceKey,
        away: &mut bool,
        session: &Session,
    ) -> bool {
        match self.cluster.agent_join(key.clone()).await {
            Ok(Err(refusal)) => {
                tracing::info!(%key, %refusal, "dropping an agent no longer wanted");
                conn.close(1u32.into(), b"no longer wanted");
                return false;
            }
            Ok(Ok(_)) if *away => {
                tracing::info!(%key, "agent heard again on its link");
                *away = false;
                session.away.store(false, Ordering::Relaxed);
            }
            // Welcomed again; or the cluster is restarting (asked again
            // at the next assert).
            Ok(Ok(_)) | Err(_) => {}
        }
        true
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

/// Waits for `next` until the agent has been silent for `window` of
/// listening time, or until another link of its attempt takes over.
async fn next_frame(
    heard: &mut Heard,
    window: Duration,
    mut next: Pin<&mut impl Future<Output = Result<Option<Heartbeat>, FrameError>>>,
    session: &Session,
) -> Waited {
    loop {
        let deadline = heard.deadline(window);
        let waited = tokio::select! {
            waited = tokio::time::timeout_at(deadline.into(), &mut next) => waited,
            // Another link of this attempt's agent joined while
            // this one was silent: it carries the agent from now on.
            () = session.superseded.notified() => return Waited::Superseded,
        };
        match waited {
            Ok(frame) => return Waited::Frame(frame),
            Err(_) if heard.woken_late(deadline) => {}
            Err(_) if heard.deadline(window) > deadline => {}
            Err(_) => return Waited::Silent,
        }
    }
}

/// The live session of each attempt's agent on this endpoint.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sessions(Arc<Mutex<HashMap<ResourceKey, Arc<Session>>>>);

/// One agent's session.
#[derive(Debug, Default)]
struct Session {
    /// Its agent is silent on it (disconnected, its grace running).
    away: AtomicBool,
    /// Told when a new link of the same attempt takes over.
    superseded: tokio::sync::Notify,
}

impl Sessions {
    /// A session for `key`, unless its agent is heard on another link; a
    /// silent one is told it is superseded.
    fn claim(&self, key: &ResourceKey) -> Option<Arc<Session>> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = all.get(key) {
            if !old.away.load(Ordering::Relaxed) {
                return None;
            }
            old.superseded.notify_one();
        }
        let session = Arc::new(Session::default());
        all.insert(key.clone(), Arc::clone(&session));
        Some(session)
    }

    /// Forgets `session` of `key`, if it is still the one on record.
    fn release(&self, key: &ResourceKey, session: &Arc<Session>) {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if all.get(key).is_some_and(|s| Arc::ptr_eq(s, session)) {
            all.remove(key);
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

/// When an agent was last heard, and how much of the time since the daemon
/// itself could not listen.
struct Heard {
    at: Instant,
    /// The daemon's starved total at `at`.
    starved_at: u64,
    /// Lateness of this handler's own wake-ups since `at`, beyond the
    /// noise threshold.
    late: Duration,
    starvation: Starvation,
}

impl Heard {
    fn now(starvation: &Starvation) -> Self {
        Self {
            at: Instant::now(),
            starved_at: starvation.total_ms(),
            late: Duration::ZERO,
            starvation: starvation.clone(),
        }
    }

    /// Time since the heartbeat in which the daemon could not listen: what
    /// its measure counted, or this handler's own late wake-ups if more.
    fn deaf(&self) -> Duration {
        let measured =
            Duration::from_millis(self.starvation.total_ms().saturating_sub(self.starved_at));
        measured.max(self.late)
    }

    /// When the agent is silent for `silence` of listening time.
    fn deadline(&self, silence: Duration) -> Instant {
        self.at + silence + self.deaf()
    }

    /// Notes a wake-up for `deadline` that came late; true if it came later
    /// than scheduling noise (the silence is then looked at again).
    fn woken_late(&mut self, deadline: Instant) -> bool {
        let late = Instant::now().saturating_duration_since(deadline);
        if late <= Starvation::COUNTED_MIN {
            return false;
        }
        self.late += late;
        true
    }

    /// How long the agent was silent while the daemon listened.
    fn silent_for(&self) -> Duration {
        self.at.elapsed().saturating_sub(self.deaf())
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
