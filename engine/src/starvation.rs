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
//! One measure may watch several runtimes (the daemon runs its agents'
//! endpoint on a runtime of its own): each gets its measuring task, and a
//! stretch in which any of them was starved is counted once, however many
//! of them were starved in it (a machine asleep starves them all at once).
//!
//! The figure is a running total in milliseconds, read without a lock; a
//! reader keeps the total it last saw and takes the difference.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The running total of time a runtime was seen starved (shared; cheap to
/// clone).
#[derive(Clone, Debug, Default)]
pub struct Starvation(Arc<Measured>);

#[derive(Debug, Default)]
struct Measured {
    /// Milliseconds counted so far.
    total_ms: AtomicU64,
    /// The latest stretches counted (disjoint, in order, at most
    /// [`COUNTED_KEPT`]): what of a new one they cover was counted already.
    counted: Mutex<Vec<(Instant, Instant)>>,
}

/// Stretches kept to tell what a new one overlaps: a runtime late across
/// more than this many of the others' stretches is counted a little short.
const COUNTED_KEPT: usize = 64;

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
        self.0.total_ms.load(Ordering::Relaxed)
    }

    /// Counts `late` as starved if it is more than [`Self::COUNTED_MIN`];
    /// for tests that starve a runtime on purpose (it is not merged with
    /// what the measuring tasks count).
    pub fn count(&self, late: Duration) {
        if late > Self::COUNTED_MIN {
            self.add(late);
        }
    }

    /// Counts a wake-up due at `due` that came at `woke`, if later than
    /// [`Self::COUNTED_MIN`]: the part of it no stretch counted before
    /// covers. The measuring tasks' own step.
    pub fn count_between(&self, due: Instant, woke: Instant) {
        if woke.saturating_duration_since(due) <= Self::COUNTED_MIN {
            return;
        }
        let mut counted = self
            .0
            .counted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let overlap: Duration = counted
            .iter()
            .map(|&(from, to)| to.min(woke).saturating_duration_since(from.max(due)))
            .sum();
        self.add(woke.saturating_duration_since(due).saturating_sub(overlap));
        // Kept merged: the new stretch swallows those it overlaps.
        let (mut from, mut to) = (due, woke);
        counted.retain(|&(f, t)| {
            let apart = t < from || f > to;
            if !apart {
                from = from.min(f);
                to = to.max(t);
            }
            apart
        });
        let at = counted.partition_point(|&(f, _)| f < from);
        counted.insert(at, (from, to));
        if counted.len() > COUNTED_KEPT {
            counted.remove(0);
        }
    }

    fn add(&self, late: Duration) {
        let ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
        self.0.total_ms.fetch_add(ms, Ordering::Relaxed);
    }

    /// Measures the current tokio runtime from now on, every
    /// [`Self::PERIOD`], until the returned task is aborted or the runtime
    /// ends. Called once on each runtime to watch.
    pub fn measure(&self) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut due = tokio::time::Instant::now() + Self::PERIOD;
            loop {
                tokio::time::sleep_until(due).await;
                let woke = tokio::time::Instant::now();
                me.count_between(due.into_std(), woke.into_std());
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
    fn a_stretch_two_runtimes_were_starved_in_is_counted_once() {
        let s = Starvation::new();
        let t = Instant::now();
        let ms = Duration::from_millis;
        // Both asleep for the same 10 s: counted once.
        s.count_between(t, t + ms(10_000));
        s.count_between(t + ms(5), t + ms(10_020));
        assert_eq!(s.total_ms(), 10_020);
        // One starved alone later: counted whole.
        s.count_between(t + ms(11_000), t + ms(11_500));
        assert_eq!(s.total_ms(), 10_520);
        // Overlapping the end of the last one: only what is new.
        s.count_between(t + ms(11_400), t + ms(11_700));
        assert_eq!(s.total_ms(), 10_720);
        // One runtime's short stretch told first, then another's long one
        // around it: the long one's whole length, the short one once.
        s.count_between(t + ms(20_000), t + ms(20_100));
        s.count_between(t + ms(15_000), t + ms(25_000));
        assert_eq!(s.total_ms(), 20_720);
        // Noise is still noise.
        s.count_between(t + ms(12_000), t + ms(12_030));
        assert_eq!(s.total_ms(), 20_720);
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
