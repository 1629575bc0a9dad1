//! Forwarders: a task that drains one channel (or stream) into a callback.
//!
//! A cluster follows one stream per running bootstrap session, which can mean
//! a hundred thousand streams at once. An actor per stream costs several
//! kilobytes (its mailboxes, its cell, its task) and two messages per event;
//! a forwarder is one small task that hands each item straight to its sink.
//!
//! The same task can drain any [`Stream`] ([`Forwarder::start_stream`]),
//! e.g. frames read from a network stream, so that an actor receives them
//! as messages without owning a task of its own.
//!
//! # Guarantees
//! - Items reach the sink in channel order, then one `None` when the channel
//!   closes, unless the sink asked to stop earlier (by returning `false`).
//! - Dropping the [`Forwarder`] (or calling [`Forwarder::stop`]) aborts the
//!   task: no item is handed to the sink after the abort is observed by the
//!   task, which happens at its next await.

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// The handle of a forwarding task; dropping it stops the task.
#[derive(Debug)]
pub struct Forwarder {
    task: AbortHandle,
}

impl Forwarder {
    /// Starts a task that hands every item of `rx` to `sink`, then `None`
    /// once the channel is closed and drained. The task ends after the
    /// `None`, or as soon as `sink` returns `false`. Must be called inside a
    /// tokio runtime.
    pub fn start<T, F>(mut rx: mpsc::Receiver<T>, mut sink: F) -> Self
    where
        T: Send + 'static,
        F: FnMut(Option<T>) -> bool + Send + 'static,
    {
        let task = tokio::spawn(async move {
            loop {
                let item = rx.recv().await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[tokio::test]
    async fn items_arrive_in_order_then_the_end() {
        let (tx, rx) = mpsc::channel(4);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let mut done_tx = Some(done_tx);
        let s = seen.clone();
        let f = Forwarder::start(rx, move |item: Option<u32>| {
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
        let f = Forwarder::start(rx, move |_| {
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
        let f = Forwarder::start(rx, |_| false);
        tx.send(1).await.unwrap();
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert!(f.is_finished());
        assert!(tx.send(2).await.is_err());
    }
}
