//! Monotonic engine clock that follows tokio's (possibly paused) virtual time.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in engine time.
///
/// Wraps [`tokio::time::Instant`], so under a runtime with paused time
/// (`#[tokio::test(start_paused = true)]`) it moves only when the test
/// advances time, which makes timer and supervision behaviour deterministic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineInstant(tokio::time::Instant);

impl EngineInstant {
    /// Reads the current engine time.
    #[must_use]
    pub fn now() -> Self {
        Self(tokio::time::Instant::now())
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub fn saturating_duration_since(self, earlier: Self) -> Duration {
        self.0.saturating_duration_since(earlier.0)
    }

    /// `self + duration`, or `None` if that is not representable.
    #[must_use]
    pub fn checked_add(self, duration: Duration) -> Option<Self> {
        self.0.checked_add(duration).map(Self)
    }

    /// The underlying tokio instant, for `sleep_until` and friends.
    #[must_use]
    pub fn into_tokio(self) -> tokio::time::Instant {
        self.0
    }
}

impl From<tokio::time::Instant> for EngineInstant {
    fn from(instant: tokio::time::Instant) -> Self {
        Self(instant)
    }
}

impl Add<Duration> for EngineInstant {
    type Output = Self;

    fn add(self, rhs: Duration) -> Self {
        Self(self.0 + rhs)
    }
}

impl Sub<Duration> for EngineInstant {
    type Output = Self;

    fn sub(self, rhs: Duration) -> Self {
        Self(self.0 - rhs)
    }
}

impl Sub for EngineInstant {
    type Output = Duration;

    fn sub(self, rhs: Self) -> Duration {
        self.saturating_duration_since(rhs)
    }
}

/// The engine's clock: a monotonic `now()` plus a per-engine epoch.
///
/// Policy crates take time as a plain `u64` count of milliseconds; the epoch
/// is the zero of that count, fixed when the clock is created, so the
/// numbers stay small and identical for every actor of one engine.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    epoch: EngineInstant,
}

impl Clock {
    /// Creates a clock whose epoch is the current engine time.
    #[must_use]
    pub fn new() -> Self {
        Self {
            epoch: EngineInstant::now(),
        }
    }

    /// Creates a clock with an explicit epoch.
    #[must_use]
    pub fn with_epoch(epoch: EngineInstant) -> Self {
        Self { epoch }
    }

    /// The instant that `0` milliseconds stands for.
    #[must_use]
    pub fn epoch(&self) -> EngineInstant {
        self.epoch
    }

    /// Reads the current engine time.
    #[must_use]
    pub fn now(&self) -> EngineInstant {
        EngineInstant::now()
    }

    /// Milliseconds from the epoch to now, the form policy crates take.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.to_ms(self.now())
    }

    /// The system's wall clock, in milliseconds since the Unix epoch (`0`
    /// for a clock set before it): for deadlines that must outlive the
    /// process, which the monotonic epoch does not. It does not follow
    /// paused test time, and it may jump when the system clock is set.
    #[must_use]
    pub fn wall_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// Milliseconds from the epoch to `at` (rounded down; `0` before the epoch).
    #[must_use]
    pub fn to_ms(&self, at: EngineInstant) -> u64 {
        // Saturate rather than wrap: u64 milliseconds cover 584 million years.
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant `ms` milliseconds after the epoch, e.g. a policy deadline.
    #[must_use]
    pub fn at_ms(&self, ms: u64) -> EngineInstant {
        // A deadline too far out to represent is as good as "never"; clamp to
        // roughly 30 years so arithmetic on it cannot overflow.
        let far = Duration::from_secs(30 * 365 * 24 * 3600);
        self.epoch
            .checked_add(Duration::from_millis(ms).min(far))
            .unwrap_or(self.epoch + far)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn clock_moves_only_when_paused_time_advances() {
        let clock = Clock::new();
        assert_eq!(clock.now_ms(), 0);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(clock.now_ms(), 1500);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(clock.now_ms(), 3_601_500);
    }

    #[tokio::test(start_paused = true)]
    async fn milliseconds_round_trip_through_instants() {
        let clock = Clock::new();
        let deadline = clock.at_ms(42_000);
        assert_eq!(clock.to_ms(deadline), 42_000);
        assert_eq!(deadline - clock.epoch(), Duration::from_secs(42));
        assert_eq!(clock.to_ms(clock.epoch() - Duration::ZERO), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn absurd_deadlines_clamp_instead_of_overflowing() {
        let clock = Clock::new();
        let never = clock.at_ms(u64::MAX);
        assert!(never > clock.at_ms(1_000_000_000));
    }
}
