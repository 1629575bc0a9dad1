//! Timestamps and durations as plain millisecond counts supplied by the host.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A point in time, in milliseconds since an epoch the host chooses.
///
/// The reconciler never reads a clock: the host passes `now` into every call
/// and the reconciler only compares and adds. Arithmetic is checked; a sum that
/// would overflow is reported as [`DeadlineOverflow`] instead of wrapping or
/// saturating, because a saturated deadline would silently mean "never".
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(pub u64);

/// A deadline could not be represented: `now + delay` overflows `u64` milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("deadline overflow: {now_ms} ms + {delay_ms} ms does not fit in a timestamp")]
pub struct DeadlineOverflow {
    /// The base instant, in milliseconds.
    pub now_ms: u64,
    /// The delay that was added, in milliseconds.
    pub delay_ms: u64,
}

impl Timestamp {
    /// The timestamp `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// `self + delay_ms`, or an error when the sum does not fit.
    pub fn checked_add_ms(self, delay_ms: u64) -> Result<Self, DeadlineOverflow> {
        self.0
            .checked_add(delay_ms)
            .map(Self)
            .ok_or(DeadlineOverflow {
                now_ms: self.0,
                delay_ms,
            })
    }

    /// `self` plus `delay_ms`, saturating at the end of time (for deadlines the host owns).
    pub fn saturating_add_ms(self, delay_ms: u64) -> Self {
        Self(self.0.saturating_add(delay_ms))
    }

    /// Milliseconds from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: Self) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t+{}ms", self.0)
    }
}

/// The earlier of two optional deadlines; `None` means "no deadline".
pub(crate) fn earliest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}
