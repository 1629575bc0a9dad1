//! The bootstrap sessions a provider streams: at most one live stream per
//! session, each forgotten when it ends.

use crate::{BootstrapSession, lock};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use swactor_provisioning::{BootstrapEvent, SessionId};
use tokio::sync::oneshot;

/// Events buffered per session stream; a stream's task waits for the
/// reader beyond that.
const STREAM_BUFFER_LEN: usize = 64;

/// The registry of a provider's open session streams.
///
/// `E` is what a provider keeps per session besides the kit's own fields
/// (the process provider: the agent's exit watch).
///
/// # Guarantees
/// - Opening a stream for a session ends its older stream, if any.
/// - A session's entry is gone once its newest stream's task ends (its
///   [`Registration`] is dropped): the registry holds only live streams.
/// - "Stopped on purpose" set on a session carries to the session's newer
///   streams, unless the newer stream follows a freshly started agent.
pub(crate) struct Sessions<E> {
    inner: Arc<Mutex<Inner<E>>>,
}

struct Inner<E> {
    next_stream: u64,
    map: HashMap<SessionId, Entry<E>>,
}

struct Entry<E> {
    /// Tells successive streams of one session apart.
    stream: u64,
    /// Dropping it ends the stream's task.
    _stop: oneshot::Sender<()>,
    /// Set when the provider stops the agent on purpose.
    cancelled: Arc<AtomicBool>,
    extra: E,
}

/// What a stream's task is handed by [`Sessions::stream`].
pub(crate) struct Stream<E> {
    /// Resolves (with an error) when a newer stream replaces this one or the
    /// provider is dropped.
    pub(crate) stop: oneshot::Receiver<()>,
    /// The session's "stopped on purpose" mark.
    pub(crate) cancelled: Arc<AtomicBool>,
    /// The provider's own per-session state, as chosen for this stream.
    pub(crate) extra: E,
    /// Where the task sends the session's events.
    pub(crate) tx: swactor_engine::stream::Sender<BootstrapEvent>,
}

/// What a new stream's task needs.
struct Opened<E> {
    stop: oneshot::Receiver<()>,
    cancelled: Arc<AtomicBool>,
    extra: E,
    /// Forgets the entry when dropped: moved into the stream's task.
    registration: Registration<E>,
}

/// Removes its stream's entry when dropped, unless a newer stream of the
/// session replaced it.
struct Registration<E> {
    inner: Weak<Mutex<Inner<E>>>,
    session: SessionId,
    stream: u64,
}

impl<E> Drop for Registration<E> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        let mut inner = lock(&inner);
        if inner
            .map
            .get(&self.session)
            .is_some_and(|e| e.stream == self.stream)
        {
            inner.map.remove(&self.session);
        }
    }
}

impl<E: Clone + Send + 'static> Sessions<E> {
    pub(crate) fn new() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                next_stream: 0,
                map: HashMap::new(),
            })),
        }
    }

    /// Starts a new stream for `session`, ending the older one: `follow`
    /// makes the task that sends its events, which runs until it ends by
    /// itself; the session's entry is forgotten then.
    ///
    /// `extra` chooses the provider's state for the new stream from the
    /// older stream's, if any. `fresh` says the stream follows an agent just
    /// started: an older "stopped on purpose" mark does not apply to it.
    pub(crate) fn stream<Fut>(
        &self,
        session: &SessionId,
        fresh: bool,
        extra: impl FnOnce(Option<E>) -> E,
        follow: impl FnOnce(Stream<E>) -> Fut,
    ) -> BootstrapSession
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = swactor_engine::stream::channel(STREAM_BUFFER_LEN);
        let opened = self.open(session, fresh, extra);
        let task = follow(Stream {
            stop: opened.stop,
            cancelled: opened.cancelled,
            extra: opened.extra,
            tx,
        });
        let registration = opened.registration;
        tokio::spawn(async move {
            task.await;
            drop(registration);
        });
        BootstrapSession {
            session: session.clone(),
            events: rx,
        }
    }

    /// Registers a new stream for `session`, ending the older one (see
    /// [`Self::stream`]).
    fn open(
        &self,
        session: &SessionId,
        fresh: bool,
        extra: impl FnOnce(Option<E>) -> E,
    ) -> Opened<E> {
        let (stop, stop_rx) = oneshot::channel();
        let mut inner = lock(&self.inner);
        let stream = inner.next_stream;
        inner.next_stream += 1;
        // Dropping the old entry's `stop` ends the older stream.
        let old = inner.map.remove(session);
        let (cancelled, extra) = match old {
            Some(old) if !fresh => (old.cancelled, extra(Some(old.extra))),
            Some(old) => (Arc::new(AtomicBool::new(false)), extra(Some(old.extra))),
            None => (Arc::new(AtomicBool::new(false)), extra(None)),
        };
        inner.map.insert(
            session.clone(),
            Entry {
                stream,
                _stop: stop,
                cancelled: cancelled.clone(),
                extra: extra.clone(),
            },
        );
        Opened {
            stop: stop_rx,
            cancelled,
            extra,
            registration: Registration {
                inner: Arc::downgrade(&self.inner),
                session: session.clone(),
                stream,
            },
        }
    }

    /// Marks `session` as stopped on purpose, so its stream closes rather
    /// than reports a loss. False when no stream of it is open.
    pub(crate) fn mark_cancelled(&self, session: &SessionId) -> bool {
        lock(&self.inner).map.get(session).is_some_and(|e| {
            e.cancelled.store(true, Ordering::SeqCst);
            true
        })
    }

    /// Marks every open session that `which` picks as stopped on purpose.
    #[cfg(any(test, feature = "docker"))]
    pub(crate) fn mark_cancelled_where(&self, which: impl Fn(&SessionId) -> bool) {
        for (id, entry) in &lock(&self.inner).map {
            if which(id) {
                entry.cancelled.store(true, Ordering::SeqCst);
            }
        }
    }

    /// How many sessions have a live stream.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.inner).map.len()
    }

    /// [`Self::len`] once it stops falling, waiting up to two seconds: a
    /// stream's entry goes when its task ends, just after its last event.
    #[cfg(test)]
    pub(crate) async fn settled_len(&self) -> usize {
        for _ in 0..200 {
            if self.len() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        self.len()
    }

    /// For each provider's test that `n` sessions leave nothing behind:
    /// opens them with `open` (which gives each stream and the last event
    /// it must end with) in batches, reads every stream to its end, and
    /// checks the registry never held more than a batch and is empty after.
    #[cfg(test)]
    pub(crate) async fn run_to_their_end(
        &self,
        n: u32,
        mut open: impl AsyncFnMut(u32) -> (BootstrapSession, BootstrapEvent),
    ) {
        const BATCH: u32 = 500;
        let mut most = 0;
        for batch in 0..n.div_ceil(BATCH) {
            let mut streams = Vec::new();
            for i in batch * BATCH..((batch + 1) * BATCH).min(n) {
                streams.push(open(i).await);
            }
            most = most.max(self.len());
            for (mut s, expected) in streams {
                let mut last = None;
                while let Some(event) = s.events.recv().await {
                    last = Some(event);
                }
                assert_eq!(last, Some(expected), "{}", s.session.0);
            }
        }
        assert!(
            most <= BATCH as usize,
            "{most} entries for {BATCH} live streams"
        );
        // A stream's entry goes when its task ends, just after its last event.
        assert_eq!(self.settled_len().await, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u32) -> SessionId {
        SessionId::from(format!("test:{i}#1"))
    }

    #[test]
    fn a_newer_stream_ends_the_older_and_outlives_its_registration() {
        let sessions = Sessions::<u32>::new();
        let mut first = sessions.open(&id(1), true, |old| old.unwrap_or(0) + 1);
        assert_eq!(first.extra, 1);
        assert!(sessions.mark_cancelled(&id(1)));
        let second = sessions.open(&id(1), false, |old| old.unwrap_or(0) + 1);
        assert_eq!(second.extra, 2, "the provider's state carries over");
        assert!(
            second.cancelled.load(Ordering::SeqCst),
            "the mark carries to a stream of the same agent"
        );
        assert!(
            matches!(
                first.stop.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            ),
            "the older stream is told to end"
        );
        // The older stream's task ends: the newer entry stays.
        drop(first.registration);
        assert_eq!(sessions.len(), 1);
        let third = sessions.open(&id(1), true, |_| 0);
        assert!(
            !third.cancelled.load(Ordering::SeqCst),
            "a freshly started agent is not stopped"
        );
        drop(second);
        assert_eq!(sessions.len(), 1);
        drop(third.registration);
        assert_eq!(sessions.len(), 0);
        assert!(!sessions.mark_cancelled(&id(1)));
    }

    #[test]
    fn ten_thousand_sessions_leave_nothing_behind() {
        let sessions = Sessions::<()>::new();
        let mut live = Vec::new();
        for i in 0..10_000 {
            live.push(sessions.open(&id(i), true, |_| ()));
            // Some sessions are reopened, as a restarted follow does.
            if i % 3 == 0 {
                live.push(sessions.open(&id(i), false, |_| ()));
            }
        }
        assert_eq!(sessions.len(), 10_000);
        sessions.mark_cancelled_where(|s| s.0.ends_with("7#1"));
        let marked = live
            .iter()
            .filter(|o| o.cancelled.load(Ordering::SeqCst))
            .count();
        assert!(marked >= 1_000, "{marked}");
        drop(live);
        assert_eq!(sessions.len(), 0);
    }
}
