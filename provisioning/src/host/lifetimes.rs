//! The run's lifetimes in the host: the apply that arms them, the checks
//! that keep their anchors in the journal, and what views show of them.
//!
//! The wall clock enters only as an argument: [`Host::handle_wall_clock`]
//! before an apply, [`Host::handle_lifetime`] on every check. Between two
//! readings the host reckons the wall clock from its own instants, for
//! views only; a deadline is decided on a reading.

use super::*;
use crate::lifetime::{self, Anchors, Lifetime, Status};

impl<C: Reconciler> Host<C> {
    /// The wall clock read at `now`, in ms since the Unix epoch. A caller
    /// hands it in before an apply, so that an apply that sets a lifetime
    /// is recorded with the wall-clock instant it was accepted at (without
    /// one, the next [`Host::handle_lifetime`] counts it from itself).
    pub fn handle_wall_clock(&mut self, wall_ms: u64, now: Timestamp) {
        self.wall = Some((now, wall_ms));
    }

    /// A check of the run's lifetimes at wall-clock `wall_ms` (read at
    /// `now`), with a job running (`jobs_running`: one submitted and not
    /// ended, on any node) or none. Records in the journal what the
    /// deadlines count from when that changed: the first check of a run
    /// whose apply had no wall clock, and every start or end of a busy
    /// stretch. Returns where the run stands, or `None` when its shape sets
    /// no lifetime (or there is no shape).
    ///
    /// The caller tears the run down on [`lifetime::Verdict::Reached`]; the
    /// host decides only that it is time.
    pub fn handle_lifetime(
        &mut self,
        wall_ms: u64,
        jobs_running: bool,
        now: Timestamp,
    ) -> Option<Status> {
        self.wall = Some((now, wall_ms));
        self.jobs_running = jobs_running;
        let set = self.lifetime()?;
        let anchors = self.meta.lifetime.checked(wall_ms, jobs_running);
        if anchors != self.meta.lifetime {
            self.meta.lifetime = anchors;
            self.meta_dirty = true;
        }
        Some(lifetime::status(&set, &anchors, wall_ms, jobs_running))
    }

    /// The lifetimes the run's shape sets, if any.
    pub fn lifetime(&self) -> Option<Lifetime> {
        self.meta
            .shape
            .as_ref()
            .map(|s| s.lifetime)
            .filter(|l| !l.is_off())
    }

    /// Where the run stands against its lifetimes at `now`, as views show
    /// it: the wall clock reckoned from the last reading, whether a job runs
    /// as the last check saw it. `None` without a lifetime, or before any
    /// wall-clock reading.
    pub fn lifetime_status(&self, now: Timestamp) -> Option<Status> {
        let set = self.lifetime()?;
        let wall_ms = self.wall_at(now)?;
        Some(lifetime::status(
            &set,
            &self.meta.lifetime,
            wall_ms,
            self.jobs_running,
        ))
    }

    /// The wall clock at `now`, reckoned from the last reading.
    fn wall_at(&self, now: Timestamp) -> Option<u64> {
        let (at, wall_ms) = self.wall?;
        Some(if now >= at {
            wall_ms.saturating_add(now.saturating_since(at))
        } else {
            wall_ms.saturating_sub(at.saturating_since(now))
        })
    }

    /// An apply of `shape` was taken (accepted, or the same content
    /// again): one that sets a lifetime arms it from now, which extends a
    /// run that was to end sooner.
    pub(super) fn arm_lifetime(&mut self, shape: &ClusterShape, now: Timestamp) {
        if shape.lifetime.is_off() {
            return;
        }
        let applied_wall_ms = self.wall_at(now);
        if applied_wall_ms != self.meta.lifetime.applied_wall_ms {
            self.meta.lifetime = Anchors {
                applied_wall_ms,
                ..self.meta.lifetime
            };
            self.meta_dirty = true;
        }
    }

    /// The same content applied again with other run-wide settings (a
    /// budget, a capacity, a lifetime): the settings are kept, and nothing
    /// else changes.
    pub(super) fn keep_run_settings(&mut self, shape: &ClusterShape) {
        let Some(kept) = &self.meta.shape else {
            return;
        };
        if kept.budget != shape.budget
            || kept.capacity != shape.capacity
            || kept.lifetime != shape.lifetime
        {
            self.meta.shape = Some(shape.clone());
            self.meta_dirty = true;
        }
    }
}
