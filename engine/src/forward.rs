//! Forwarders and muxes: tasks that drain channels (or streams) into a callback.
//!
//! A forwarder is one small task that hands each item of one [`Stream`]
//! (frames read off a network stream, say) straight to its sink
//! ([`Forwarder::start_stream`]), so that an actor receives them as
//! messages without owning a task of its own. A [`Mux`] follows many
//! [`stream`](crate::stream) channels in one task and hands their items
//! over in batches: a cluster follows one bootstrap stream per running
//! session, which can mean a hundred thousand at once.
//!
//! # Guarantees (forwarders; a mux's are on [`Mux`])
//! - Items reach the sink in stream order, then one `None` when the stream
//!   ends, unless the sink asked to stop earlier (by returning `false`).
//! - Dropping the [`Forwarder`] (or calling [`Forwarder::stop`]) aborts the
//!   task: no item is handed to the sink after the abort is observed by the
//!   task, which happens at its next await.

use crate::stream;
use futures_util::{Stream, StreamExt};
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Poll, Waker};
use tokio::task::AbortHandle;

/// The handle of a forwarding task; dropping it stops the task.
#[derive(Debug)]
pub struct Forwarder {
    task: AbortHandle,
}

impl Forwarder {
    /// Starts a task that hands every item of `stream` to `sink`, then
    /// `None` once the stream has ended. The task ends after the `None`, or
    /// as soon as `sink` returns `false`. The stream is polled only after
    /// the sink took the previous item, so a bounded stream stays bounded.
    /// Must be called inside a tokio runtime.
    pub fn start_stream<S, F>(stream: S, mut sink: F) -> Self
    where
        S: Stream + Send + 'static,
        S::Item: Send + 'static,
        F: FnMut(Option<S::Item>) -> bool + Send + 'static,
    {
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let item = stream.next().await;
                let end = item.is_none();
                if !sink(item) || end {
                    return;
                }
            }
        });
        Self {
            task: task.abort_handle(),
        }
    }

    /// Stops the task (as dropping the handle does).
    pub fn stop(self) {}

    /// Whether the task has ended (the channel closed, the sink asked to
    /// stop, or it was aborted).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Follows many [`stream`](crate::stream) receivers in ONE task and hands
/// what they yield to a sink in batches.
///
/// A forwarder per stream is a task per stream and a sink call per item; a
/// hundred thousand bootstrap sessions that each report a step at the same
/// moment would cost a hundred thousand task wake-ups and as many messages.
/// A mux wakes once, drains every stream that has something, and makes one
/// sink call with all of it.
///
/// # Guarantees
/// - Each stream's items reach the sink in order, each tagged with the key it
///   was followed under, then `(key, None)` once the stream ends. An item
///   the `last` predicate given to [`Mux::start`] accepts is the stream's
///   last: nothing follows it, not even the `None`. Either way the stream is
///   then forgotten.
/// - Dropping a stream's [`Followed`] handle forgets the stream: nothing of it
///   is drained after the mux task observes the drop (items it already took
///   may still be in the batch it is delivering).
/// - One sink call carries at most [`MUX_DRAIN_MAX`] items of one stream; a
///   stream with more waiting is drained again in the next round, so one
///   chatty stream cannot hold the others up.
/// - One sink call drains at most [`MUX_BATCH_STREAMS`] streams; the task
///   yields before it drains more, so a batch stays small however many
///   streams are woken at once.
/// - The task ends when the sink returns `false`, or when the [`Mux`] is
///   dropped (which aborts it).
pub struct Mux<K, T> {
    shared: Arc<MuxShared<K, T>>,
    task: AbortHandle,
}

/// Most items taken from one stream for one sink call.
pub const MUX_DRAIN_MAX: usize = 64;

/// Most streams drained for one sink call: when more are woken at once, the
/// rest wait for the next call, after the sink's side has run (so 100k
/// streams woken together are not handed over, and held, in one batch).
pub const MUX_BATCH_STREAMS: usize = 4096;

struct MuxShared<K, T> {
    state: Mutex<MuxState<K, T>>,
}

struct MuxState<K, T> {
    slots: Vec<Option<Slot<K, T>>>,
    free: Vec<u32>,
    /// Slots whose stream woke them, to drain.
    ready: Vec<u32>,
    /// The mux task, while it waits for a ready slot.
    task: Option<Waker>,
    next_generation: u32,
}

struct Slot<K, T> {
    key: K,
    /// Linked to the mux's ready queue as the slot's index and generation.
    rx: stream::Receiver<T>,
    generation: u32,
    /// In `ready` already.
    queued: bool,
}

impl<K, T> MuxShared<K, T> {
    fn lock(&self) -> MutexGuard<'_, MuxState<K, T>> {
        // Critical sections only move slots and indexes; a poisoned lock
        // still guards consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<K, T> MuxState<K, T> {
    /// Queues slot `index` of `generation` for draining; the waker of the
    /// task to wake, if it waits.
    fn mark_ready(&mut self, index: u32, generation: u32) -> Option<Waker> {
        match self.slots.get_mut(index as usize) {
            Some(Some(slot)) if slot.generation == generation && !slot.queued => {
                slot.queued = true;
                self.ready.push(index);
                self.task.take()
            }
            _ => None,
        }
    }
}

/// How a followed stream tells the mux it has something: its receiver is
/// linked to the mux's state (no waker, and no allocation, per stream), and
/// queues its slot.
///
/// Each link holds the mux's state strongly, so a wake-up (one per item a
/// stream is sent) takes the lock and nothing else. The cycle this makes
/// (state, slot, receiver, state) is broken when the [`Mux`] is dropped: it
/// empties the slot table, and a receiver forgets its link when dropped.
impl<K: Send, T: Send> stream::ReadyQueue for MuxShared<K, T> {
    fn ready(&self, index: u32, generation: u32) {
        let task = self.lock().mark_ready(index, generation);
        if let Some(task) = task {
            task.wake();
        }
    }
}

/// A stream a [`Mux`] follows; dropping it forgets the stream.
pub struct Followed<K, T> {
    shared: Weak<MuxShared<K, T>>,
    index: u32,
    generation: u32,
}

impl<K, T> Drop for Followed<K, T> {
    fn drop(&mut self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let mut st = shared.lock();
        let live = matches!(
            st.slots.get(self.index as usize),
            Some(Some(slot)) if slot.generation == self.generation
        );
        if live {
            let slot = st.slots[self.index as usize].take();
            st.free.push(self.index);
            drop(st);
            // The receiver goes outside the lock: its senders may be woken.
            drop(slot);
        }
    }
}

impl<K, T> std::fmt::Debug for Followed<K, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Followed")
            .field("index", &self.index)
            .finish()
    }
}

impl<K: Clone + Send + 'static, T: Send + 'static> Mux<K, T> {
    /// Starts the task; `sink` gets every batch and returns `false` to stop;
    /// `last` says which items end their stream. Must be called inside a
    /// tokio runtime.
    pub fn start<F>(last: fn(&T) -> bool, mut sink: F) -> Self
    where
        F: FnMut(Vec<(K, Option<T>)>) -> bool + Send + 'static,
    {
        let shared = Arc::new(MuxShared {
            state: Mutex::new(MuxState {
                slots: Vec::new(),
                free: Vec::new(),
                ready: Vec::new(),
                task: None,
                next_generation: 0,
            }),
        });
        let weak = Arc::downgrade(&shared);
        let task = tokio::spawn(async move {
            // The slots woken, and how many of them are drained.
            let mut ready = Vec::new();
            let mut taken = 0;
            loop {
                if taken < ready.len() {
                    // More were woken than one batch takes: the sink's side
                    // runs before the next batch is made.
                    tokio::task::yield_now().await;
                }
                let Some(shared) = weak.upgrade() else { return };
                if taken == ready.len() {
                    ready.clear();
                    taken = 0;
                    poll_fn(|cx| {
                        let mut st = shared.lock();
                        if st.ready.is_empty() {
                            st.task = Some(cx.waker().clone());
                            Poll::Pending
                        } else {
                            std::mem::swap(&mut ready, &mut st.ready);
                            Poll::Ready(())
                        }
                    })
                    .await;
                }
                let end = ready.len().min(taken + MUX_BATCH_STREAMS);
                let batch = drain(&shared, &ready[taken..end], last);
                taken = end;
                drop(shared);
                if !batch.is_empty() && !sink(batch) {
                    return;
                }
            }
        });
        Self {
            shared,
            task: task.abort_handle(),
        }
    }

    /// Makes room for `streams` followed at once, so following that many
    /// does not grow the slot table step by step (each step a copy, and up
    /// to half again of slack kept).
    pub fn reserve(&self, streams: usize) {
        let mut st = self.shared.lock();
        let additional = streams.saturating_sub(st.slots.len());
        st.slots.reserve_exact(additional);
    }

    /// Follows `rx` under `key` until it ends or the handle is dropped.
    pub fn follow(&self, key: K, rx: stream::Receiver<T>) -> Followed<K, T> {
        let mut st = self.shared.lock();
        let generation = st.next_generation;
        st.next_generation = st.next_generation.wrapping_add(1);
        let index = match st.free.pop() {
            Some(i) => i,
            None => {
                st.slots.push(None);
                u32::try_from(st.slots.len() - 1).expect("fewer than 2^32 streams")
            }
        };
        rx.link(self.shared.clone(), index, generation);
        st.slots[index as usize] = Some(Slot {
            key,
            rx,
            generation,
            queued: false,
        });
        // A first drain arms the stream's link and takes what is queued.
        let task = st.mark_ready(index, generation);
        drop(st);
        if let Some(task) = task {
            task.wake();
        }
        Followed {
            shared: Arc::downgrade(&self.shared),
            index,
            generation,
        }
    }

    /// Streams followed now.
    pub fn len(&self) -> usize {
        let st = self.shared.lock();
        st.slots.len() - st.free.len()
    }

    /// True when no stream is followed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Takes what the `ready` slots hold.
fn drain<K: Clone, T>(
    shared: &MuxShared<K, T>,
    ready: &[u32],
    last: fn(&T) -> bool,
) -> Vec<(K, Option<T>)> {
    // Most woken streams hold one item.
    let mut batch = Vec::with_capacity(ready.len());
    let mut ended = Vec::new();
    let mut st = shared.lock();
    for &index in ready {
        let Some(Some(slot)) = st.slots.get_mut(index as usize) else {
            continue;
        };
        slot.queued = false;
        let Slot { key, rx, .. } = slot;
        let drained = rx.drain_armed(MUX_DRAIN_MAX, |item| {
            let ends = last(&item);
            batch.push((key.clone(), Some(item)));
            !ends
        });
        let more = match drained {
            // More next round; the others go first.
            stream::Drained::Full => true,
            stream::Drained::Stopped => {
                ended.push(index);
                false
            }
            stream::Drained::Closed => {
                batch.push((slot.key.clone(), None));
                ended.push(index);
                false
            }
            stream::Drained::Pending => false,
        };
        if more {
            let generation = slot.generation;
            let _ = st.mark_ready(index, generation);
        }
    }
    let mut gone = Vec::with_capacity(ended.len());
    for index in ended {
        gone.push(st.slots[index as usize].take());
        st.free.push(index);
    }
    drop(st);
    drop(gone);
    batch
}

impl<K, T> Drop for Mux<K, T> {
    fn drop(&mut self) {
        self.task.abort();
        // Every followed receiver's link holds the state: emptying the table lets it go
        // (the slots are dropped outside the lock, since dropping a
        // receiver may wake its senders).
        let mut st = self.shared.lock();
        let slots = std::mem::take(&mut st.slots);
        let task = st.task.take();
        drop(st);
        drop(slots);
        drop(task);
    }
}

impl<K, T> std::fmt::Debug for Mux<K, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mux").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;

    #[tokio::test]
    async fn items_arrive_in_order_then_the_end() {
        let (tx, rx) = mpsc::channel(4);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let mut done_tx = Some(done_tx);
        let s = seen.clone();
        let f = Forwarder::start_stream(tokio_stream_of(rx), move |item: Option<u32>| {
            s.lock().unwrap().push(item);
            if item.is_none()
                && let Some(d) = done_tx.take()
            {
                let _ = d.send(());
            }
            true
        });
        for i in 0..3 {
            tx.send(i).await.unwrap();
        }
        drop(tx);
        done_rx.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![Some(0), Some(1), Some(2), None]);
        tokio::task::yield_now().await;
        assert!(f.is_finished());
    }

    #[tokio::test]
    async fn a_stream_is_drained_like_a_channel_and_stops_with_its_handle() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let mut done_tx = Some(done_tx);
        let s = seen.clone();
        let _f = Forwarder::start_stream(futures_util::stream::iter([1u32, 2, 3]), move |item| {
            s.lock().unwrap().push(item);
            if item.is_none()
                && let Some(d) = done_tx.take()
            {
                let _ = d.send(());
            }
            true
        });
        done_rx.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![Some(1), Some(2), Some(3), None]);

        // A stream that never ends is stopped by dropping the handle.
        let (tx, rx) = mpsc::channel::<u32>(1);
        let f = Forwarder::start_stream(tokio_stream_of(rx), |_| true);
        tx.send(1).await.unwrap();
        drop(f);
        tokio::task::yield_now().await;
        assert!(tx.send(2).await.is_err());
    }

    /// A channel as a stream, without another dependency.
    fn tokio_stream_of(rx: mpsc::Receiver<u32>) -> impl Stream<Item = u32> {
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|i| (i, rx)) })
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_task_and_a_false_sink_ends_it() {
        let (tx, rx) = mpsc::channel::<u32>(4);
        let seen = Arc::new(Mutex::new(0u32));
        let s = seen.clone();
        let f = Forwarder::start_stream(tokio_stream_of(rx), move |_| {
            *s.lock().unwrap() += 1;
            true
        });
        tx.send(1).await.unwrap();
        tokio::task::yield_now().await;
        drop(f);
        tokio::task::yield_now().await;
        // The receiver went with the aborted task.
        assert!(tx.send(2).await.is_err());
        assert_eq!(*seen.lock().unwrap(), 1);

        let (tx, rx) = mpsc::channel::<u32>(4);
        let f = Forwarder::start_stream(tokio_stream_of(rx), |_| false);
        tx.send(1).await.unwrap();
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert!(f.is_finished());
        assert!(tx.send(2).await.is_err());
    }

    type Batches = Arc<Mutex<Vec<Vec<(u32, Option<u32>)>>>>;

    fn collecting_mux() -> (Mux<u32, u32>, Batches) {
        let batches: Batches = Arc::default();
        let b = batches.clone();
        let mux = Mux::start(
            |v: &u32| *v == 999,
            move |batch| {
                b.lock().unwrap().push(batch);
                true
            },
        );
        (mux, batches)
    }

    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_mux_delivers_what_many_streams_hold_in_one_batch_in_order_then_each_end() {
        let (mux, batches) = collecting_mux();
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for key in 0..100u32 {
            let (tx, rx) = stream::channel(8);
            handles.push(mux.follow(key, rx));
            senders.push(tx);
        }
        settle().await;
        assert!(
            batches.lock().unwrap().is_empty(),
            "nothing sent, nothing delivered"
        );
        for (key, tx) in senders.iter().enumerate() {
            let key = key as u32;
            tx.try_send(key * 10).unwrap();
            tx.try_send(key * 10 + 1).unwrap();
        }
        settle().await;
        let got = std::mem::take(&mut *batches.lock().unwrap());
        assert_eq!(got.len(), 1, "one wake-up, one batch");
        assert_eq!(got[0].len(), 200);
        for key in 0..100u32 {
            let mine: Vec<_> = got[0]
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, v)| *v)
                .collect();
            assert_eq!(mine, vec![Some(key * 10), Some(key * 10 + 1)]);
        }
        senders[0].try_send(999).unwrap();
        senders[0].try_send(1000).unwrap();
        drop(senders);
        settle().await;
        let got = std::mem::take(&mut *batches.lock().unwrap());
        let ends: usize = got
            .iter()
            .map(|b| b.iter().filter(|(_, v)| v.is_none()).count())
            .sum();
        assert_eq!(ends, 99, "every stream reports its end once");
        let first: Vec<_> = got.iter().flatten().filter(|(k, _)| *k == 0).collect();
        assert_eq!(
            first,
            [&(0, Some(999))],
            "a last item ends its stream: nothing follows"
        );
        assert!(mux.is_empty(), "ended streams are forgotten");
        drop(handles);
    }

    #[tokio::test]
    async fn many_streams_woken_at_once_go_out_in_bounded_batches_and_the_sink_runs_between() {
        let (mux, batches) = collecting_mux();
        let streams = 2 * MUX_BATCH_STREAMS as u32 + 5;
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for key in 0..streams {
            let (tx, rx) = stream::channel(2);
            handles.push(mux.follow(key, rx));
            senders.push(tx);
        }
        settle().await;
        for (key, tx) in senders.iter().enumerate() {
            tx.try_send(key as u32).unwrap();
        }
        // The first batch is out, and the mux yields before it makes the next.
        tokio::task::yield_now().await;
        let first = batches.lock().unwrap().len();
        assert_eq!(first, 1, "one batch, then the others run");
        settle().await;
        let got = std::mem::take(&mut *batches.lock().unwrap());
        let sizes: Vec<usize> = got.iter().map(Vec::len).collect();
        assert_eq!(sizes, [MUX_BATCH_STREAMS, MUX_BATCH_STREAMS, 5]);
        let keys: Vec<u32> = got.iter().flatten().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            (0..streams).collect::<Vec<_>>(),
            "in wake order, each once"
        );
        drop(handles);
    }

    #[tokio::test]
    async fn a_dropped_mux_lets_its_state_go_though_its_streams_senders_live() {
        let (mux, _batches) = collecting_mux();
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for key in 0..10u32 {
            let (tx, rx) = stream::channel(8);
            handles.push(mux.follow(key, rx));
            tx.try_send(key).unwrap();
            senders.push(tx);
        }
        // Drained once: every stream's link to the state is armed.
        settle().await;
        let state = Arc::downgrade(&mux.shared);
        drop(mux);
        // The aborted task lets go of the state once the runtime drops it.
        settle().await;
        assert!(
            state.upgrade().is_none(),
            "the links' hold on the state went with the mux"
        );
        for tx in &senders {
            assert!(tx.try_send(1).is_err(), "the streams' receivers are gone");
        }
        drop(handles);
    }

    #[tokio::test]
    async fn a_dropped_handle_stops_its_stream_and_a_chatty_stream_shares_the_rounds() {
        let (mux, batches) = collecting_mux();
        let (quiet_tx, quiet_rx) = stream::channel(4);
        let (chatty_tx, chatty_rx) = stream::channel(1000);
        let quiet = mux.follow(1, quiet_rx);
        let _chatty = mux.follow(2, chatty_rx);
        for i in 0..(3 * MUX_DRAIN_MAX as u32) {
            chatty_tx.try_send(i).unwrap();
        }
        quiet_tx.try_send(7).unwrap();
        settle().await;
        let got = std::mem::take(&mut *batches.lock().unwrap());
        assert!(
            got.len() >= 3,
            "the chatty stream took several rounds: {}",
            got.len()
        );
        assert!(
            got.iter()
                .all(|b| b.iter().filter(|(k, _)| *k == 2).count() <= MUX_DRAIN_MAX)
        );
        let chatty: Vec<u32> = got
            .iter()
            .flatten()
            .filter(|(k, _)| *k == 2)
            .filter_map(|(_, v)| *v)
            .collect();
        assert_eq!(chatty, (0..3 * MUX_DRAIN_MAX as u32).collect::<Vec<_>>());
        assert_eq!(
            got[0].iter().filter(|(k, _)| *k == 1).count(),
            1,
            "the quiet one is in the first round"
        );
        drop(quiet);
        settle().await;
        assert!(
            quiet_tx.is_closed(),
            "the dropped stream's receiver is gone"
        );
        assert!(matches!(
            quiet_tx.try_send(8),
            Err(stream::TrySendError::Closed(8))
        ));
        settle().await;
        assert!(
            batches
                .lock()
                .unwrap()
                .iter()
                .flatten()
                .all(|(k, _)| *k != 1)
        );
        assert_eq!(mux.len(), 1);
    }
}
