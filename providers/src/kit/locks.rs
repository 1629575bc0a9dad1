//! Per-key async locks that keep an entry only while a call holds or awaits it.

use crate::lock;
use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

type Acquire = Pin<Box<dyn Future<Output = OwnedMutexGuard<()>> + Send>>;

/// Serialises the calls for one key (a node directory, a container, a
/// resource key) while calls for other keys run freely.
///
/// # Guarantees
/// - Two guards for one key are never held at once.
/// - The map holds a key only while a guard for it is held or awaited:
///   after every call has finished, or been cancelled while waiting, it is
///   empty again.
pub(crate) struct KeyLocks<K> {
    map: Mutex<HashMap<K, Arc<AsyncMutex<()>>>>,
}

impl<K: Eq + Hash + Clone + Send + 'static> KeyLocks<K> {
    pub(crate) fn new() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Waits for `key`'s lock.
    pub(crate) async fn lock(&self, key: &K) -> KeyGuard<'_, K> {
        let mut waiting = Waiting {
            locks: self,
            key: Some(key.clone()),
            acquire: Some(Box::pin(self.entry(key).lock_owned())),
        };
        let guard = match waiting.acquire.as_mut() {
            Some(acquire) => acquire.as_mut().await,
            None => unreachable!("set just above"),
        };
        // Disarmed: the guard below now owns the clean-up.
        waiting.acquire = None;
        let key = waiting.key.take();
        KeyGuard {
            locks: self,
            key,
            guard: Some(guard),
        }
    }

    /// `key`'s lock, if no call holds it now.
    pub(crate) fn try_lock(&self, key: &K) -> Option<KeyGuard<'_, K>> {
        let mutex = self.entry(key);
        let guard = mutex.try_lock_owned().ok()?;
        Some(KeyGuard {
            locks: self,
            key: Some(key.clone()),
            guard: Some(guard),
        })
    }

    /// How many keys the map holds now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.map).len()
    }

    fn entry(&self, key: &K) -> Arc<AsyncMutex<()>> {
        lock(&self.map).entry(key.clone()).or_default().clone()
    }

    /// Forgets `key` when the map's is the only reference left: no guard
    /// holds it and no call awaits it. Checked under the map's lock, which
    /// every new waiter takes before it clones the entry.
    fn forget_if_idle(&self, key: &K) {
        let mut map = lock(&self.map);
        if map.get(key).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(key);
        }
    }
}

/// A call waiting for a key's lock; if the wait is cancelled, the key is
/// forgotten unless someone else uses it.
struct Waiting<'a, K: Eq + Hash + Clone + Send + 'static> {
    locks: &'a KeyLocks<K>,
    key: Option<K>,
    acquire: Option<Acquire>,
}

impl<K: Eq + Hash + Clone + Send + 'static> Drop for Waiting<'_, K> {
    fn drop(&mut self) {
        // The pending acquisition holds a reference to the entry: drop it first.
        self.acquire = None;
        if let Some(key) = self.key.take() {
            self.locks.forget_if_idle(&key);
        }
    }
}

/// Holds one key's lock; dropping it lets the next call in and forgets the
/// key when nobody else waits for it.
pub(crate) struct KeyGuard<'a, K: Eq + Hash + Clone + Send + 'static> {
    locks: &'a KeyLocks<K>,
    key: Option<K>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl<K: Eq + Hash + Clone + Send + 'static> Drop for KeyGuard<'_, K> {
    fn drop(&mut self) {
        self.guard = None;
        if let Some(key) = self.key.take() {
            self.locks.forget_if_idle(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_key_is_held_only_while_locked_or_awaited() {
        let locks = Arc::new(KeyLocks::new());
        let guard = locks.lock(&"a").await;
        assert_eq!(locks.len(), 1);
        assert!(locks.try_lock(&"a").is_none(), "one holder at a time");
        let waiter = tokio::spawn({
            let locks = locks.clone();
            async move { drop(locks.lock(&"a").await) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "the second call waits");
        drop(guard);
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0, "nobody holds or awaits the key");

        let other = locks.try_lock(&"b").unwrap();
        assert_eq!(locks.len(), 1);
        drop(other);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_no_entry_behind() {
        let locks = Arc::new(KeyLocks::new());
        let guard = locks.lock(&7).await;
        let waiter = tokio::spawn({
            let locks = locks.clone();
            async move { drop(locks.lock(&7).await) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        drop(guard);
        assert_eq!(locks.len(), 0);

        // Cancelled after the holder left: the waiter was the last user.
        let guard = locks.lock(&7).await;
        let pending = locks.lock(&7);
        let mut pending = Box::pin(pending);
        assert!(futures_poll_once(pending.as_mut()).await.is_none());
        drop(guard);
        assert_eq!(locks.len(), 1, "the waiter still counts");
        drop(pending);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn ten_thousand_keys_locked_in_turn_leave_the_map_empty() {
        let locks = Arc::new(KeyLocks::new());
        let mut tasks = Vec::new();
        for i in 0..10_000u32 {
            let locks = locks.clone();
            tasks.push(tokio::spawn(async move {
                // Every key is contended by two calls.
                let _g = locks.lock(&(i % 5_000)).await;
                tokio::task::yield_now().await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(locks.len(), 0);
    }

    /// Polls `f` once.
    async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Option<F::Output> {
        std::future::poll_fn(|cx| match Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
            std::task::Poll::Pending => std::task::Poll::Ready(None),
        })
        .await
    }
}
