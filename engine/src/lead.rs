//! Until when this process may act on the world: shared by whoever learns
//! it (the election) and whoever must respect it (the cluster's host, the
//! gate in front of the providers).

use crate::EngineInstant;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// How long this process may act: for ever (it is alone on its journal),
/// or until an instant of its own monotonic clock, moved on by every
/// answered renewal of its leadership. Clones share one bound.
#[derive(Clone, Debug, Default)]
pub struct LeadBound(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// `None` until told: no leadership yet, so nothing may act.
    until: Mutex<Option<EngineInstant>>,
    /// Bumped on every change, so a reader can tell it moved.
    changes: AtomicU64,
}

impl LeadBound {
    /// A bound that holds nothing until told otherwise.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Leadership held until `until` (exclusive); `None`: not held.
    pub fn set(&self, until: Option<EngineInstant>) {
        let mut held = self.0.until.lock().unwrap_or_else(PoisonError::into_inner);
        if *held != until {
            *held = until;
            self.0.changes.fetch_add(1, Ordering::Release);
        }
    }

    /// Until when leadership is held, if it is.
    #[must_use]
    pub fn until(&self) -> Option<EngineInstant> {
        *self.0.until.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether leadership holds at `now`.
    #[must_use]
    pub fn holds_at(&self, now: EngineInstant) -> bool {
        self.until().is_some_and(|until| now < until)
    }

    /// How many times the bound changed: a reader that saw another number
    /// reads it again.
    #[must_use]
    pub fn changes(&self) -> u64 {
        self.0.changes.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_bound_holds_nothing_until_set_and_only_before_its_instant() {
        let bound = LeadBound::new();
        let now = EngineInstant::now();
        assert!(!bound.holds_at(now));
        let seen = bound.changes();
        bound.set(Some(now + Duration::from_secs(1)));
        assert_ne!(bound.changes(), seen);
        let shared = bound.clone();
        assert!(shared.holds_at(now));
        assert!(!shared.holds_at(now + Duration::from_secs(1)));
        let seen = bound.changes();
        bound.set(Some(now + Duration::from_secs(1)));
        assert_eq!(bound.changes(), seen, "the same bound is no change");
        bound.set(None);
        assert!(!shared.holds_at(now));
    }
}
