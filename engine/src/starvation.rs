//! Measures how long the runtime left ready work waiting: time in which the
//! daemon could not have heard anybody, however loud.
//!
//! A stopped process, a sleeping machine or an event loop starved by other
//! work all look the same from inside: a task asked to run at some instant
//! runs late. [`Starvation::measure`] keeps one small task asking to be woken
//! at a fixed period and adds up every wake-up that comes later than a
//! scheduling-noise threshold. Whoever judges another party by its silence
//! (the swarm endpoint, the cluster host) subtracts what was added meanwhile:
//! silence the daemon could not have heard is nobody's fault.
//!
//! The figure is a running total in milliseconds, read without a lock; a
//! reader keeps the total it last saw and takes the difference.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The running total of time the runtime was seen starved (shared; cheap to
/// clone).
#[derive(Clone, Debug, Default)]
pub struct Starvation(Arc<AtomicU64>);

impl Starvation {
    /// How often the measuring task asks to be woken.
    pub const PERIOD: Duration = Duration::from_millis(100);
    /// Lateness at or below this is scheduling noise and not counted.
    pub const COUNTED_MIN: Duration = Duration::from_millis(40);

    /// A total at zero, measured by nobody yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Milliseconds counted so far.
    pub fn total_ms(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts `late` as starved if it is more than [`Self::COUNTED_MIN`];
    /// the measuring task's own step, public for tests that starve a
    /// runtime on purpose.
    pub fn count(&self, late: Duration) {
        if late > Self::COUNTED_MIN {
            let ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
            self.0.fetch_add(ms, Ordering::Relaxed);
        }
    }

    /// Measures the current tokio runtime from now on, every
    /// [`Self::PERIOD`], until the returned task is aborted or the runtime
    /// ends.
    pub fn measure(&self) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut due = tokio::time::Instant::now() + Self::PERIOD;
            loop {
                tokio::time::sleep_until(due).await;
                let woke = tokio::time::Instant::now();
                me.count(woke.saturating_duration_since(due));
                due = woke + Self::PERIOD;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_not_counted_and_real_lateness_is_counted_whole() {
        let s = Starvation::new();
        s.count(Duration::from_millis(3));
        s.count(Starvation::COUNTED_MIN);
        assert_eq!(s.total_ms(), 0);
        s.count(Duration::from_millis(250));
        s.clone().count(Duration::from_secs(2));
        assert_eq!(s.total_ms(), 2_250, "clones share the total");
    }

    #[test]
    fn a_thread_that_blocks_the_runtime_is_measured() {
        // One worker thread, blocked on purpose: the measuring task cannot
        // run until the block ends, and says how long it waited.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let s = Starvation::new();
        rt.block_on(async {
            let task = s.measure();
            tokio::time::sleep(Duration::from_millis(250)).await;
            let before = s.total_ms();
            std::thread::sleep(Duration::from_millis(600));
            tokio::time::sleep(Duration::from_millis(250)).await;
            let starved = s.total_ms() - before;
            task.abort();
            assert!(
                (400..=700).contains(&starved),
                "a 600 ms block measured as {starved} ms"
            );
        });
    }
}
