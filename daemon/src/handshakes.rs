//! Failed connection handshakes, counted instead of logged one by one.
//!
//! iroh's router logs a warning for every incoming connection whose
//! handshake fails (an unknown protocol, a peer that gives up, a TLS
//! error): anyone who can reach the daemon's port could fill its log with
//! them. The log filter shows the first of a quiet spell and counts the
//! rest; the daemon says the count once per [`SUMMARY_EVERY`], as the
//! engine does for connections it refuses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// How often counted handshakes are summed up (and how long a spell is).
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// The process's count of failed handshakes.
#[derive(Debug, Default)]
pub struct FailedHandshakes {
    /// Counted since the last summary (not shown one by one).
    counted: AtomicU64,
    /// When one was last shown.
    shown_at: Mutex<Option<Instant>>,
}

impl FailedHandshakes {
    /// The process's one count.
    pub fn global() -> &'static Self {
        static ONE: OnceLock<FailedHandshakes> = OnceLock::new();
        ONE.get_or_init(Self::default)
    }

    /// Whether `meta` is iroh's line for a failed incoming handshake.
    pub fn is_one(meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "iroh::protocol" && *meta.level() == tracing::Level::WARN
    }

    /// True for the first failure of a quiet spell (it is shown); counts
    /// the others.
    pub fn first_of_a_spell(&self) -> bool {
        let mut shown = self.shown_at.lock().unwrap_or_else(PoisonError::into_inner);
        if shown.is_some_and(|at| at.elapsed() < SUMMARY_EVERY) {
            self.counted.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        *shown = Some(Instant::now());
        true
    }

    /// Takes the count since the last call.
    pub fn take(&self) -> u64 {
        self.counted.swap(0, Ordering::Relaxed)
    }
}

/// Says, every [`SUMMARY_EVERY`], how many failed handshakes were counted
/// and not shown; for as long as the daemon runs.
pub async fn summarise() {
    let mut tick = tokio::time::interval(SUMMARY_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let n = FailedHandshakes::global().take();
        if n > 0 {
            tracing::warn!(
                refused = n,
                "{n} more incoming connection(s) failed their handshake (an unknown protocol, \
                 a peer that gave up) since the last report"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_of_a_spell_is_shown_and_the_rest_counted() {
        let h = FailedHandshakes::default();
        assert!(h.first_of_a_spell());
        for _ in 0..1_999 {
            assert!(!h.first_of_a_spell());
        }
        assert_eq!(h.take(), 1_999);
        assert_eq!(h.take(), 0);
    }
}
