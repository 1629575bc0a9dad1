//! Small bounded channels for the many streams a cluster follows at once.
//!
//! A cluster follows one bootstrap stream per session, which can mean a
//! hundred thousand open streams. A tokio `mpsc` channel costs about 1.5 KiB
//! however little it carries (it allocates its first block of 32 slots up
//! front); this one is a mutex around a queue that holds one item inline and
//! allocates only for a second, about 110 bytes when idle. Its API follows tokio's: `send` waits for
//! room, `try_send` does not, `closed` resolves when the receiver is gone,
//! and `recv` yields `None` once every sender is dropped and the queue is
//! drained.
//!
//! # Guarantees
//! - Items arrive in the order they were sent (per channel).
//! - At most `capacity` items wait at once; `send` waits for room and
//!   `try_send` refuses.
//! - Dropping the receiver drops what was queued and makes every send fail.

use std::collections::VecDeque;
use std::fmt;
use std::future::{Future, poll_fn};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

struct State<T> {
    queue: Queue<T>,
    /// Kept narrow (as `senders`): a channel per followed stream, so every
    /// byte here is a byte per node.
    capacity: u32,
    senders: u32,
    receiver_gone: bool,
    /// Who is told when the receiver waits for an item or the end.
    rx_waker: RxWake,
    /// Senders waiting for room, or for the receiver to go. Boxed: few
    /// channels ever have one, and an empty `Vec` inline is 24 bytes a
    /// channel where `None` is 8.
    #[allow(clippy::box_collection)]
    tx_wakers: Option<Box<Vec<Waker>>>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
}

/// A follower of many streams (the engine's mux), told which of them has
/// something: where a waker per stream would be an allocation per stream,
/// each stream keeps a handle on the follower's one queue and its own
/// number in it.
pub(crate) trait ReadyQueue: Send + Sync {
    /// Stream `index` (of `generation`) has an item, or has ended.
    fn ready(&self, index: u32, generation: u32);
}

/// Who to tell when the waiting receiver has something.
enum RxWake {
    None,
    /// A task polled the receiver and waits.
    Task(Waker),
    /// The receiver is followed through a [`ReadyQueue`]: told once each
    /// time its follower found it empty (`armed`), and kept across wake-ups.
    Queue {
        queue: Arc<dyn ReadyQueue>,
        index: u32,
        generation: u32,
        armed: bool,
    },
}

/// A wake-up taken out of a channel's state, to give once its lock is released.
enum Wake {
    Task(Waker),
    Queue(Arc<dyn ReadyQueue>, u32, u32),
}

impl Wake {
    fn wake(self) {
        match self {
            Self::Task(w) => w.wake(),
            Self::Queue(queue, index, generation) => queue.ready(index, generation),
        }
    }
}

impl RxWake {
    /// The wake-up an item or the end gives the waiting receiver, if it waits.
    fn take(&mut self) -> Option<Wake> {
        match self {
            Self::None => None,
            Self::Task(_) => match std::mem::replace(self, Self::None) {
                Self::Task(w) => Some(Wake::Task(w)),
                _ => None,
            },
            Self::Queue {
                queue,
                index,
                generation,
                armed,
            } => std::mem::take(armed).then(|| Wake::Queue(queue.clone(), *index, *generation)),
        }
    }
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Every critical section is a few assignments that cannot panic
        // half-way, so a poisoned lock still guards a consistent queue.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The waiting items: the oldest inline, the rest (rarely any: a follower
/// drains a stream as soon as it is woken) in a deque that is freed once it
/// empties, so an idle channel holds no buffer.
struct Queue<T> {
    first: Option<T>,
    /// Boxed so an idle channel pays one pointer for it, not a deque's
    /// header; the extra allocation is only made for a second waiting item.
    #[allow(clippy::box_collection)]
    rest: Option<Box<VecDeque<T>>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            first: None,
            rest: None,
        }
    }
}

impl<T> Queue<T> {
    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.as_ref().map_or(0, |r| r.len())
    }

    fn push_back(&mut self, item: T) {
        if self.first.is_none() {
            self.first = Some(item);
        } else {
            self.rest.get_or_insert_default().push_back(item);
        }
    }

    fn pop_front(&mut self) -> Option<T> {
        let item = self.first.take()?;
        if let Some(rest) = &mut self.rest {
            self.first = rest.pop_front();
            if rest.is_empty() {
                self.rest = None;
            }
        }
        Some(item)
    }
}

/// A channel of at most `capacity` waiting items (at least one).
pub fn channel<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: Queue::default(),
            capacity: u32::try_from(capacity.max(1)).unwrap_or(u32::MAX),
            senders: 1,
            receiver_gone: false,
            rx_waker: RxWake::None,
            tx_wakers: None,
        }),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

/// How [`Receiver::drain_into`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// It took `max` items (more may wait).
    Full,
    /// The callback asked to stop.
    Stopped,
    /// The queue is empty and a sender is left; the waker is registered.
    Pending,
    /// The queue is empty and every sender is gone: the stream has ended.
    Closed,
}

/// The sending half; clones send into the same channel.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

/// The receiving half.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

/// The receiver is gone; the item comes back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SendError<T>(pub T);

/// Why [`Sender::try_send`] did not send; the item comes back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TrySendError<T> {
    /// The channel holds `capacity` items.
    Full(T),
    /// The receiver is gone.
    Closed(T),
}

/// Why [`Receiver::try_recv`] gave nothing (as tokio's `TryRecvError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TryRecvError {
    /// Nothing waits now; a sender is left.
    Empty,
    /// Every sender is gone and nothing is left.
    Disconnected,
}

impl fmt::Display for TryRecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the channel is empty"),
            Self::Disconnected => f.write_str("every sender is gone"),
        }
    }
}

impl std::error::Error for TryRecvError {}

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SendError(..)")
    }
}

impl<T> fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the receiver is gone")
    }
}

impl<T> std::error::Error for SendError<T> {}

impl<T> fmt::Debug for TrySendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full(_) => f.write_str("Full(..)"),
            Self::Closed(_) => f.write_str("Closed(..)"),
        }
    }
}

impl<T> fmt::Display for TrySendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full(_) => f.write_str("the channel is full"),
            Self::Closed(_) => f.write_str("the receiver is gone"),
        }
    }
}

impl<T> std::error::Error for TrySendError<T> {}

impl<T> Sender<T> {
    /// Queues `item` if there is room, waking the receiver.
    ///
    /// # Errors
    /// The channel is full, or the receiver is gone.
    pub fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        let mut st = self.shared.lock();
        if st.receiver_gone {
            return Err(TrySendError::Closed(item));
        }
        if st.queue.len() >= st.capacity as usize {
            return Err(TrySendError::Full(item));
        }
        st.queue.push_back(item);
        let wake = st.rx_waker.take();
        drop(st);
        if let Some(w) = wake {
            w.wake();
        }
        Ok(())
    }

    /// Queues `item`, waiting for room. Cancel-safe: if the future is
    /// dropped before it completes, nothing was sent.
    ///
    /// # Errors
    /// The receiver is gone.
    pub async fn send(&self, item: T) -> Result<(), SendError<T>> {
        let mut item = Some(item);
        poll_fn(|cx| {
            let mut st = self.shared.lock();
            let Some(it) = item.take() else {
                return Poll::Ready(Ok(()));
            };
            if st.receiver_gone {
                return Poll::Ready(Err(SendError(it)));
            }
            if st.queue.len() >= st.capacity as usize {
                item = Some(it);
                register(&mut st, cx);
                return Poll::Pending;
            }
            st.queue.push_back(it);
            let wake = st.rx_waker.take();
            drop(st);
            if let Some(w) = wake {
                w.wake();
            }
            Poll::Ready(Ok(()))
        })
        .await
    }

    /// Resolves once the receiver is gone.
    pub fn closed(&self) -> impl Future<Output = ()> + '_ {
        poll_fn(|cx| {
            let mut st = self.shared.lock();
            if st.receiver_gone {
                Poll::Ready(())
            } else {
                register(&mut st, cx);
                Poll::Pending
            }
        })
    }

    /// True once the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().receiver_gone
    }
}

/// Makes `cx`'s waker the receiver's, unless an equivalent one is already
/// (a task that polls a followed receiver takes it over from its follower).
fn register_rx<T>(st: &mut State<T>, cx: &Context<'_>) {
    match &st.rx_waker {
        RxWake::Task(w) if w.will_wake(cx.waker()) => {}
        _ => st.rx_waker = RxWake::Task(cx.waker().clone()),
    }
}

/// Arms the receiver's queue, or registers nothing if it has none.
fn arm_queue<T>(st: &mut State<T>) {
    if let RxWake::Queue { armed, .. } = &mut st.rx_waker {
        *armed = true;
    }
}

/// Adds `cx`'s waker to the waiting senders unless an equivalent one is there.
fn register<T>(st: &mut State<T>, cx: &Context<'_>) {
    let wakers = st.tx_wakers.get_or_insert_default();
    if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
        wakers.push(cx.waker().clone());
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        let mut st = self.shared.lock();
        st.senders = st.senders.checked_add(1).expect("fewer than 2^32 senders");
        drop(st);
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.senders -= 1;
        let wake = if st.senders == 0 {
            st.rx_waker.take()
        } else {
            None
        };
        drop(st);
        if let Some(w) = wake {
            w.wake();
        }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender").finish_non_exhaustive()
    }
}

impl<T> Receiver<T> {
    /// The next item, or `None` once every sender is gone and the queue is empty.
    pub async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Polls for the next item; see [`Receiver::recv`].
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut st = self.shared.lock();
        if let Some(item) = st.queue.pop_front() {
            let wakers = take_wakers(&mut st);
            drop(st);
            wakers.into_iter().for_each(Waker::wake);
            return Poll::Ready(Some(item));
        }
        if st.senders == 0 {
            return Poll::Ready(None);
        }
        register_rx(&mut st, cx);
        Poll::Pending
    }

    /// The next item if one is waiting.
    ///
    /// # Errors
    /// [`TryRecvError::Empty`] when nothing waits but a sender is left;
    /// [`TryRecvError::Disconnected`] once every sender is gone and nothing
    /// is left.
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        let mut st = self.shared.lock();
        match st.queue.pop_front() {
            Some(item) => {
                let wakers = take_wakers(&mut st);
                drop(st);
                wakers.into_iter().for_each(Waker::wake);
                Ok(item)
            }
            None if st.senders == 0 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Takes up to `max` waiting items in order under ONE lock, handing
    /// each to `take`, which returns `false` to stop after that item. What a
    /// follower of many streams calls instead of polling item by item (a
    /// poll per item, and one more to find the queue empty, each lock a
    /// cache miss on a large set of streams).
    ///
    /// When it finds the queue empty with a sender left, it registers `cx`'s
    /// waker as [`Receiver::poll_recv`] does.
    pub fn drain_into(
        &mut self,
        cx: &Context<'_>,
        max: usize,
        take: impl FnMut(T) -> bool,
    ) -> Drained {
        self.drain_with(max, take, |st| register_rx(st, cx))
    }

    /// Has `queue` told (as stream `index` of `generation`) when this
    /// receiver, found empty by [`Receiver::drain_armed`], has something
    /// again; it replaces any waker. Nothing is told until the first such
    /// drain.
    pub(crate) fn link(&self, queue: Arc<dyn ReadyQueue>, index: u32, generation: u32) {
        self.shared.lock().rx_waker = RxWake::Queue {
            queue,
            index,
            generation,
            armed: false,
        };
    }

    /// [`Receiver::drain_into`] for a [`Receiver::link`]ed receiver: finding
    /// the queue empty arms the link instead of registering a waker.
    pub(crate) fn drain_armed(&mut self, max: usize, take: impl FnMut(T) -> bool) -> Drained {
        self.drain_with(max, take, arm_queue)
    }

    fn drain_with(
        &mut self,
        max: usize,
        mut take: impl FnMut(T) -> bool,
        wait: impl FnOnce(&mut State<T>),
    ) -> Drained {
        let mut st = self.shared.lock();
        let mut taken = 0;
        let outcome = loop {
            if taken == max {
                break Drained::Full;
            }
            match st.queue.pop_front() {
                Some(item) => {
                    taken += 1;
                    if !take(item) {
                        break Drained::Stopped;
                    }
                }
                None if st.senders == 0 => break Drained::Closed,
                None => {
                    wait(&mut st);
                    break Drained::Pending;
                }
            }
        };
        let wakers = if taken > 0 {
            take_wakers(&mut st)
        } else {
            Vec::new()
        };
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
        outcome
    }

    /// Items waiting now.
    pub fn len(&self) -> usize {
        self.shared.lock().queue.len()
    }

    /// True when nothing waits now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Senders waiting for room, taken out to be woken after the lock is released.
fn take_wakers<T>(st: &mut State<T>) -> Vec<Waker> {
    st.tx_wakers.take().map_or_else(Vec::new, |w| *w)
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.receiver_gone = true;
        let queued = std::mem::take(&mut st.queue);
        let wakers = st.tx_wakers.take().map_or_else(Vec::new, |w| *w);
        // Nothing will wait on this channel again; a waker kept here could
        // keep its owner alive for as long as a sender lives.
        let rx_waker = std::mem::replace(&mut st.rx_waker, RxWake::None);
        drop(st);
        drop(queued);
        drop(rx_waker);
        wakers.into_iter().for_each(Waker::wake);
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn items_arrive_in_order_then_the_end() {
        let (tx, mut rx) = channel(4);
        let tx2 = tx.clone();
        tx.send(1).await.unwrap();
        tx2.try_send(2).unwrap();
        tx.send(3).await.unwrap();
        drop(tx);
        assert_eq!(rx.recv().await, Some(1));
        drop(tx2);
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, Some(3));
        assert_eq!(rx.recv().await, None);
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_channel_makes_send_wait_and_try_send_refuse() {
        let (tx, mut rx) = channel(1);
        tx.try_send(1).unwrap();
        assert!(matches!(tx.try_send(2), Err(TrySendError::Full(2))));
        let waiting = tokio::time::timeout(Duration::from_secs(1), tx.send(2)).await;
        assert!(waiting.is_err(), "send waits while the channel is full");
        let tx2 = tx.clone();
        let sender = tokio::spawn(async move { tx2.send(3).await });
        tokio::task::yield_now().await;
        assert_eq!(rx.recv().await, Some(1));
        sender.await.unwrap().unwrap();
        assert_eq!(rx.recv().await, Some(3));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
    }

    #[tokio::test]
    async fn dropping_the_receiver_fails_every_send_and_resolves_closed() {
        let (tx, rx) = channel::<u32>(2);
        let tx2 = tx.clone();
        let waiter = tokio::spawn(async move { tx2.closed().await });
        tokio::task::yield_now().await;
        assert!(!tx.is_closed());
        drop(rx);
        waiter.await.unwrap();
        assert!(tx.is_closed());
        assert!(matches!(tx.try_send(1), Err(TrySendError::Closed(1))));
        assert_eq!(tx.send(2).await, Err(SendError(2)));
    }

    /// A waker that counts its wake-ups.
    struct Count(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Count {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn drain_into_takes_in_order_up_to_its_bounds_then_waits_or_ends() {
        let count = Arc::new(Count(0.into()));
        let waker = Waker::from(count.clone());
        let cx = Context::from_waker(&waker);
        let wakes = || count.0.load(std::sync::atomic::Ordering::SeqCst);
        let (tx, mut rx) = channel(8);
        for i in 0..5 {
            tx.try_send(i).unwrap();
        }
        let mut got = Vec::new();
        assert_eq!(
            rx.drain_into(&cx, 2, |i| {
                got.push(i);
                true
            }),
            Drained::Full
        );
        assert_eq!(
            rx.drain_into(&cx, 9, |i| {
                got.push(i);
                i != 3
            }),
            Drained::Stopped
        );
        assert_eq!(got, [0, 1, 2, 3]);
        assert_eq!(
            rx.drain_into(&cx, 9, |i| {
                got.push(i);
                true
            }),
            Drained::Pending
        );
        assert_eq!(got, [0, 1, 2, 3, 4]);
        assert_eq!(wakes(), 0);
        tx.try_send(5).unwrap();
        assert_eq!(wakes(), 1, "an empty drain registers the waker");
        drop(tx);
        assert_eq!(
            rx.drain_into(&cx, 9, |i| {
                got.push(i);
                true
            }),
            Drained::Closed
        );
        assert_eq!(got, [0, 1, 2, 3, 4, 5]);
    }

    #[tokio::test]
    async fn drain_into_makes_room_for_a_waiting_sender() {
        let (tx, mut rx) = channel(1);
        tx.try_send(1).unwrap();
        let sender = tokio::spawn(async move { tx.send(2).await });
        tokio::task::yield_now().await;
        let waker = Waker::noop();
        let cx = Context::from_waker(waker);
        let mut got = Vec::new();
        assert_eq!(
            rx.drain_into(&cx, 9, |i| {
                got.push(i);
                true
            }),
            Drained::Pending
        );
        assert_eq!(
            sender.await.unwrap(),
            Ok(()),
            "the waiting send went through"
        );
        assert_eq!(
            rx.drain_into(&cx, 9, |i| {
                got.push(i);
                true
            }),
            Drained::Closed
        );
        assert_eq!(got, [1, 2]);
    }

    #[test]
    fn an_empty_channel_is_small() {
        // The point of this channel: far less than tokio's ~1.5 KiB, with
        // room for one waiting item inline and no buffer when idle.
        // 112 bytes, 128 with the `Arc`'s counts: the link to a follower
        // is 32 of them, where a follower's waker would be its own
        // allocation (48 bytes with the allocator's) and 16 more here.
        let size = std::mem::size_of::<Shared<[u8; 32]>>();
        assert!(size <= 112, "{size}");
        assert_eq!(std::mem::size_of::<RxWake>(), 32);
    }
}
