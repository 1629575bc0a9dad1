//! A run's lifetimes: it tears itself down a set time after it was applied
//! (`max_lifetime_s`), or once no job has run for a set time
//! (`idle_teardown_s`), so that no machine outlives the person who asked
//! for it.
//!
//! Pure: the wall clock and whether a job runs are arguments. Deadlines are
//! wall-clock instants (milliseconds since the Unix epoch) counted from
//! [`Anchors`] the journal keeps, so a daemon restarted after a crash
//! tears the run down when the first one would have, not later.

use serde::{Deserialize, Serialize};

/// The longest either lifetime may be: 366 days.
pub const SECONDS_MAX: u64 = 366 * 86_400;

/// How long a run may live, as its shape sets it. 0 is off.
///
/// No field is ever skipped when serialized: it travels inside telemetry
/// snapshots, whose postcard frames carry no field names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifetime {
    /// Seconds after the last apply that sets it at which the run is torn
    /// down.
    #[serde(default)]
    pub max_lifetime_s: u64,
    /// Seconds with no job running after which the run is torn down,
    /// counted from the later of the last apply and the end of the last
    /// job.
    #[serde(default)]
    pub idle_teardown_s: u64,
}

impl Lifetime {
    /// Neither lifetime is set.
    pub fn is_off(&self) -> bool {
        self.max_lifetime_s == 0 && self.idle_teardown_s == 0
    }

    /// The lifetimes a shape file writes, in seconds (`None`: not written,
    /// which is off, as 0 is).
    ///
    /// # Errors
    /// A value that is not a whole number of seconds from 0 to
    /// [`SECONDS_MAX`], in words that name the field.
    pub fn of_seconds(
        max_lifetime_s: Option<f64>,
        idle_teardown_s: Option<f64>,
    ) -> Result<Self, String> {
        Ok(Self {
            max_lifetime_s: seconds("max_lifetime_s", max_lifetime_s)?,
            idle_teardown_s: seconds("idle_teardown_s", idle_teardown_s)?,
        })
    }

    /// The seconds `which` is set to (0: off).
    pub fn seconds(&self, which: Which) -> u64 {
        match which {
            Which::MaxLifetime => self.max_lifetime_s,
            Which::IdleTeardown => self.idle_teardown_s,
        }
    }
}

fn seconds(field: &str, value: Option<f64>) -> Result<u64, String> {
    let Some(s) = value else {
        return Ok(0);
    };
    if !s.is_finite() || s < 0.0 || s.fract() != 0.0 || s > SECONDS_MAX as f64 {
        return Err(format!(
            "{field} = {s}: it is a whole number of seconds, from 0 (off) to {SECONDS_MAX} \
             (366 days)"
        ));
    }
    // Whole, non-negative and in range: exact.
    Ok(s as u64)
}

/// Which lifetime a deadline is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Which {
    /// `max_lifetime_s`.
    MaxLifetime,
    /// `idle_teardown_s`.
    IdleTeardown,
}

impl Which {
    /// The shape file's word for it.
    pub fn field(self) -> &'static str {
        match self {
            Self::MaxLifetime => "max_lifetime_s",
            Self::IdleTeardown => "idle_teardown_s",
        }
    }
}

/// What the deadlines count from, as the journal keeps them. Every field
/// is a wall-clock instant in milliseconds since the Unix epoch; a journal
/// written before lifetimes existed reads as the default (nothing known),
/// and the first check counts from itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anchors {
    /// When the last apply that set a lifetime was accepted; `None` until
    /// one was with the wall clock known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_wall_ms: Option<u64>,
    /// When the last job was seen to have ended; `None` before any did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs_ended_wall_ms: Option<u64>,
    /// A job was running when last checked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy: bool,
}

impl Anchors {
    /// The anchors after a check at `now_wall_ms` that saw a job running
    /// (`jobs_running`) or none: an unknown apply counts from now, and a
    /// run that was busy and is not any more has been idle since now.
    #[must_use]
    pub fn checked(mut self, now_wall_ms: u64, jobs_running: bool) -> Self {
        self.applied_wall_ms.get_or_insert(now_wall_ms);
        if self.busy && !jobs_running {
            self.jobs_ended_wall_ms = Some(now_wall_ms);
        }
        self.busy = jobs_running;
        self
    }

    /// Since when the run counts as idle at `now_wall_ms` (`None` while a
    /// job runs): the later of the last apply and the end of the last job.
    pub fn idle_since(&self, now_wall_ms: u64, jobs_running: bool) -> Option<u64> {
        if jobs_running {
            return None;
        }
        // A job ran at the last check and none runs now: it just ended.
        let ended = if self.busy {
            Some(now_wall_ms)
        } else {
            self.jobs_ended_wall_ms
        };
        let applied = self.applied_wall_ms.unwrap_or(now_wall_ms);
        Some(applied.max(ended.unwrap_or(0)))
    }
}

/// Where a run stands against its lifetimes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// No deadline: neither lifetime is set, or only `idle_teardown_s` is
    /// and a job runs.
    Unbounded,
    /// The earliest deadline is `left_ms` away.
    Within {
        /// Time left, in ms (never 0).
        left_ms: u64,
        /// Whose deadline it is.
        which: Which,
    },
    /// A deadline has come: tear the run down now.
    Reached(Which),
}

/// The earliest deadline of a run at `now_wall_ms`, as a wall-clock instant
/// and whose it is (`max_lifetime_s` first when both fall together).
pub fn deadline(
    lifetime: &Lifetime,
    anchors: &Anchors,
    now_wall_ms: u64,
    jobs_running: bool,
) -> Option<(u64, Which)> {
    let after = |from: u64, s: u64| from.saturating_add(s.saturating_mul(1_000));
    let max = (lifetime.max_lifetime_s > 0).then(|| {
        let applied = anchors.applied_wall_ms.unwrap_or(now_wall_ms);
        (after(applied, lifetime.max_lifetime_s), Which::MaxLifetime)
    });
    let idle = (lifetime.idle_teardown_s > 0)
        .then(|| anchors.idle_since(now_wall_ms, jobs_running))
        .flatten()
        .map(|since| (after(since, lifetime.idle_teardown_s), Which::IdleTeardown));
    max.into_iter().chain(idle).min()
}

/// Where a run with `lifetime`, counted from `anchors`, stands at
/// `now_wall_ms` with a job running (`jobs_running`) or none.
pub fn verdict(
    lifetime: &Lifetime,
    anchors: &Anchors,
    now_wall_ms: u64,
    jobs_running: bool,
) -> Verdict {
    match deadline(lifetime, anchors, now_wall_ms, jobs_running) {
        None => Verdict::Unbounded,
        Some((at, which)) if at <= now_wall_ms => Verdict::Reached(which),
        Some((at, which)) => Verdict::Within {
            left_ms: at - now_wall_ms,
            which,
        },
    }
}

/// Where a run stands against its lifetimes at one instant, as views show
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The lifetimes the shape sets.
    pub lifetime: Lifetime,
    /// The verdict then.
    pub verdict: Verdict,
    /// How long the run had been idle then, when `idle_teardown_s` is set
    /// and no job ran (`None` otherwise).
    pub idle_ms: Option<u64>,
}

/// [`verdict`], with what a view says beside it.
pub fn status(
    lifetime: &Lifetime,
    anchors: &Anchors,
    now_wall_ms: u64,
    jobs_running: bool,
) -> Status {
    let idle_ms = (lifetime.idle_teardown_s > 0)
        .then(|| anchors.idle_since(now_wall_ms, jobs_running))
        .flatten()
        .map(|since| now_wall_ms.saturating_sub(since));
    Status {
        lifetime: *lifetime,
        verdict: verdict(lifetime, anchors, now_wall_ms, jobs_running),
        idle_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: u64 = 1_700_000_000_000;

    fn lifetime(max_s: u64, idle_s: u64) -> Lifetime {
        Lifetime {
            max_lifetime_s: max_s,
            idle_teardown_s: idle_s,
        }
    }

    fn applied(at: u64) -> Anchors {
        Anchors {
            applied_wall_ms: Some(at),
            ..Anchors::default()
        }
    }

    #[test]
    fn a_max_lifetime_counts_from_the_apply_and_is_reached_at_its_end() {
        let l = lifetime(7_200, 0);
        let a = applied(T0);
        assert_eq!(
            verdict(&l, &a, T0 + 1_000, false),
            Verdict::Within {
                left_ms: 7_199_000,
                which: Which::MaxLifetime
            }
        );
        // A running job does not hold a max lifetime back.
        assert_eq!(
            verdict(&l, &a, T0 + 7_199_999, true),
            Verdict::Within {
                left_ms: 1,
                which: Which::MaxLifetime
            }
        );
        assert_eq!(
            verdict(&l, &a, T0 + 7_200_000, true),
            Verdict::Reached(Which::MaxLifetime)
        );
        // A wall clock set back only makes the deadline look further off.
        assert!(matches!(
            verdict(&l, &a, T0 - 60_000, false),
            Verdict::Within {
                left_ms: 7_260_000,
                ..
            }
        ));
        // Off is off.
        assert_eq!(
            verdict(&Lifetime::default(), &a, u64::MAX, false),
            Verdict::Unbounded
        );
    }

    #[test]
    fn idle_counts_from_the_later_of_the_apply_and_the_last_job_and_never_while_one_runs() {
        let l = lifetime(0, 300);
        let mut a = applied(T0);
        assert_eq!(
            status(&l, &a, T0 + 60_000, false),
            Status {
                lifetime: l,
                verdict: Verdict::Within {
                    left_ms: 240_000,
                    which: Which::IdleTeardown
                },
                idle_ms: Some(60_000),
            }
        );
        // A job runs from 2 min to 20 min: no deadline meanwhile.
        a = a.checked(T0 + 120_000, true);
        let s = status(&l, &a, T0 + 1_000_000, true);
        assert_eq!((s.verdict, s.idle_ms), (Verdict::Unbounded, None));
        // Seen running, now not: idle from now, even before it is recorded.
        assert!(matches!(
            verdict(&l, &a, T0 + 1_200_000, false),
            Verdict::Within {
                left_ms: 300_000,
                ..
            }
        ));
        a = a.checked(T0 + 1_200_000, false);
        assert_eq!(a.jobs_ended_wall_ms, Some(T0 + 1_200_000));
        assert_eq!(
            verdict(&l, &a, T0 + 1_499_999, false),
            Verdict::Within {
                left_ms: 1,
                which: Which::IdleTeardown
            }
        );
        assert_eq!(
            verdict(&l, &a, T0 + 1_500_000, false),
            Verdict::Reached(Which::IdleTeardown)
        );
        // An apply after the job's end counts from itself.
        a.applied_wall_ms = Some(T0 + 1_400_000);
        assert!(matches!(
            verdict(&l, &a, T0 + 1_500_000, false),
            Verdict::Within {
                left_ms: 200_000,
                ..
            }
        ));
    }

    #[test]
    fn the_earliest_deadline_wins_and_unknown_anchors_count_from_now() {
        let l = lifetime(3_600, 600);
        let a = applied(T0);
        assert_eq!(
            verdict(&l, &a, T0, false),
            Verdict::Within {
                left_ms: 600_000,
                which: Which::IdleTeardown
            }
        );
        assert_eq!(
            verdict(&l, &a, T0, true),
            Verdict::Within {
                left_ms: 3_600_000,
                which: Which::MaxLifetime
            }
        );
        // A journal from before lifetimes: armed at the first check.
        let old = Anchors::default();
        assert_eq!(old.checked(T0, false).applied_wall_ms, Some(T0));
        assert_eq!(
            verdict(&l, &old, T0, false),
            Verdict::Within {
                left_ms: 600_000,
                which: Which::IdleTeardown
            }
        );
        // Both at once: max_lifetime_s is named.
        assert_eq!(
            verdict(&lifetime(600, 600), &a, T0 + 600_000, false),
            Verdict::Reached(Which::MaxLifetime)
        );
    }

    #[test]
    fn lifetimes_are_read_in_whole_seconds_with_reasons() {
        assert_eq!(
            Lifetime::of_seconds(Some(7_200.0), None),
            Ok(lifetime(7_200, 0))
        );
        assert!(Lifetime::of_seconds(Some(0.0), Some(0.0)).unwrap().is_off());
        for bad in [-1.0, 1.5, f64::NAN, f64::INFINITY, 1e12] {
            let e = Lifetime::of_seconds(None, Some(bad)).unwrap_err();
            assert!(e.starts_with("idle_teardown_s = "), "{e}");
            assert!(e.contains("whole number of seconds"), "{e}");
        }
        assert!(Lifetime::of_seconds(Some(SECONDS_MAX as f64), None).is_ok());
        // The journal's anchors, as JSON: nothing known leaves no trace.
        assert_eq!(serde_json::to_string(&Anchors::default()).unwrap(), "{}");
    }

    fn any_anchors() -> impl Strategy<Value = Anchors> {
        (
            proptest::option::of(0..2_000_000u64),
            proptest::option::of(0..2_000_000u64),
            any::<bool>(),
        )
            .prop_map(|(applied, ended, busy)| Anchors {
                applied_wall_ms: applied.map(|a| T0 + a),
                jobs_ended_wall_ms: ended.map(|e| T0 + e),
                busy,
            })
    }

    proptest! {
        /// Never reached before the deadline, always at and after it, and
        /// the time left always lands on it.
        #[test]
        fn reached_exactly_from_the_deadline_on(
            max_s in 0..2_000u64,
            idle_s in 0..2_000u64,
            anchors in any_anchors(),
            now in 0..6_000_000u64,
            later in 0..6_000_000u64,
            running in any::<bool>(),
        ) {
            let (l, now) = (lifetime(max_s, idle_s), T0 + now);
            let deadline = deadline(&l, &anchors, now, running);
            match verdict(&l, &anchors, now, running) {
                Verdict::Unbounded => prop_assert!(deadline.is_none()),
                Verdict::Within { left_ms, which } => {
                    prop_assert!(left_ms > 0);
                    prop_assert_eq!(deadline, Some((now + left_ms, which)));
                    // Nothing else changing, it is reached exactly then.
                    let at = now + left_ms;
                    let then = anchors.checked(now, running);
                    prop_assert!(!matches!(verdict(&l, &then, at - 1, running), Verdict::Reached(_)));
                    prop_assert_eq!(verdict(&l, &then, at + later, running), Verdict::Reached(which));
                }
                Verdict::Reached(which) => {
                    let (at, w) = deadline.unwrap();
                    prop_assert!(at <= now);
                    prop_assert_eq!(w, which);
                }
            }
        }

        /// While a job runs, idle_teardown_s never tears a run down and
        /// says nothing of idleness.
        #[test]
        fn a_running_job_never_reaches_idle(
            max_s in 0..2_000u64,
            idle_s in 1..2_000u64,
            anchors in any_anchors(),
            now in 0..u64::MAX / 2,
        ) {
            let s = status(&lifetime(max_s, idle_s), &anchors, now, true);
            prop_assert_eq!(s.idle_ms, None);
            match s.verdict {
                Verdict::Unbounded => prop_assert_eq!(max_s, 0),
                Verdict::Within { which, .. } | Verdict::Reached(which) => {
                    prop_assert_eq!(which, Which::MaxLifetime);
                }
            }
        }
    }
}
