//! Reconciler configuration: backoff, probe interval, operation deadlines.

use crate::id::NodeAttemptId;
use crate::state::EffectKind;
use serde::{Deserialize, Serialize};

/// Tunables of the reconciler. Plain data; call [`ReconcilerConfig::validate`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcilerConfig {
    /// First retry delay after a failure, and the floor of every backoff.
    pub backoff_base_ms: u64,
    /// Largest retry delay; no backoff ever exceeds it.
    pub backoff_cap_ms: u64,
    /// Width of the jitter window, in thousandths of the un-jittered delay
    /// (0 disables jitter). The window sits as high as the cap allows and never
    /// below the floor; the position inside it derives from the attempt id.
    pub jitter_permille: u32,
    /// Interval between endpoint probes while a lease's endpoint is not ready.
    pub probe_interval_ms: u64,
    /// How long a bootstrap session may go without any observation before the
    /// attempt is failed as stalled.
    pub bootstrap_stall_ms: u64,
    /// Per-effect deadlines after which a pending operation is folded as ambiguous.
    pub timeouts: OperationTimeouts,
    /// The first attempt id the allocator hands out.
    pub first_attempt_id: u64,
    /// The longest the daemon may go between two of its own inputs and
    /// still count as having listened (the host asks to be woken at least
    /// every third of it). A longer gap is time in which the daemon could
    /// not hear anyone: its process was stopped, its machine slept, its
    /// event loop was starved. No agent is blamed for silence in such a
    /// gap (see the host's "deaf gaps").
    #[serde(default = "default_listen_gap_ms")]
    pub listen_gap_ms: u64,
}

fn default_listen_gap_ms() -> u64 {
    ReconcilerConfig::LISTEN_GAP_DEFAULT_MS
}

/// How long each kind of operation may stay pending, in milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationTimeouts {
    /// Deadline of a CreateLease.
    pub create_lease_ms: u64,
    /// Deadline of a LookupEndpoint.
    pub lookup_endpoint_ms: u64,
    /// Deadline of a StartBootstrap.
    pub start_bootstrap_ms: u64,
    /// Deadline of a CancelBootstrap.
    pub cancel_bootstrap_ms: u64,
    /// Deadline of a DestroyLease.
    pub destroy_lease_ms: u64,
}

impl Default for OperationTimeouts {
    fn default() -> Self {
        Self {
            create_lease_ms: 300_000,
            lookup_endpoint_ms: 30_000,
            start_bootstrap_ms: 120_000,
            cancel_bootstrap_ms: 60_000,
            destroy_lease_ms: 120_000,
        }
    }
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            backoff_base_ms: 1_000,
            backoff_cap_ms: 60_000,
            jitter_permille: 500,
            probe_interval_ms: 1_000,
            bootstrap_stall_ms: 300_000,
            timeouts: OperationTimeouts::default(),
            first_attempt_id: 1,
            listen_gap_ms: Self::LISTEN_GAP_DEFAULT_MS,
        }
    }
}

/// A configuration value is out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A duration that must be positive is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// The backoff cap is below the base.
    #[error("backoff_cap_ms ({cap}) must be at least backoff_base_ms ({base})")]
    CapBelowBase {
        /// The base delay.
        base: u64,
        /// The cap.
        cap: u64,
    },
    /// The jitter window is wider than the delay itself.
    #[error("jitter_permille is {0}; it must be at most 1000")]
    Jitter(u32),
}

impl ReconcilerConfig {
    /// The default [`ReconcilerConfig::listen_gap_ms`]: well above the
    /// half-second stalls a loaded 2-core machine gives a process now and
    /// then, well below the shortest silence taken for a lost agent.
    pub const LISTEN_GAP_DEFAULT_MS: u64 = 1_500;

    /// How often the host asks to be woken while anything is judged by
    /// silence: a third of [`ReconcilerConfig::listen_gap_ms`], so a
    /// listening daemon never leaves a gap as long as that.
    pub fn listen_watch_ms(&self) -> u64 {
        (self.listen_gap_ms / 3).max(1)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// The first out-of-range field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = &self.timeouts;
        for (field, v) in [
            ("backoff_base_ms", self.backoff_base_ms),
            ("probe_interval_ms", self.probe_interval_ms),
            ("bootstrap_stall_ms", self.bootstrap_stall_ms),
            ("listen_gap_ms", self.listen_gap_ms),
            ("timeouts.create_lease_ms", t.create_lease_ms),
            ("timeouts.lookup_endpoint_ms", t.lookup_endpoint_ms),
            ("timeouts.start_bootstrap_ms", t.start_bootstrap_ms),
            ("timeouts.cancel_bootstrap_ms", t.cancel_bootstrap_ms),
            ("timeouts.destroy_lease_ms", t.destroy_lease_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.backoff_cap_ms < self.backoff_base_ms {
            return Err(ConfigError::CapBelowBase {
                base: self.backoff_base_ms,
                cap: self.backoff_cap_ms,
            });
        }
        if self.jitter_permille > 1000 {
            return Err(ConfigError::Jitter(self.jitter_permille));
        }
        Ok(())
    }

    /// The deadline, in milliseconds, of an operation of `kind`.
    pub fn timeout_ms(&self, kind: EffectKind) -> u64 {
        let t = &self.timeouts;
        match kind {
            EffectKind::CreateLease => t.create_lease_ms,
            EffectKind::LookupEndpoint => t.lookup_endpoint_ms,
            EffectKind::StartBootstrap => t.start_bootstrap_ms,
            EffectKind::CancelBootstrap => t.cancel_bootstrap_ms,
            EffectKind::DestroyLease => t.destroy_lease_ms,
        }
    }

    /// The un-jittered delay after `failures` consecutive failures:
    /// `base * 2^(failures-1)`, capped. Zero failures means no delay.
    pub fn backoff_unjittered_ms(&self, failures: u32) -> u64 {
        if failures == 0 {
            return 0;
        }
        let shift = (failures - 1).min(63);
        self.backoff_base_ms
            .saturating_mul(1u64 << shift)
            .min(self.backoff_cap_ms)
    }

    /// The delay before the next try after `failures` consecutive failures of `attempt`.
    ///
    /// Deterministic: the jitter position is a hash of the attempt id and the
    /// failure count. The result is zero for zero failures and otherwise lies
    /// in `[backoff_base_ms, backoff_cap_ms]`.
    pub fn backoff_ms(&self, attempt: NodeAttemptId, failures: u32) -> u64 {
        let d = self.backoff_unjittered_ms(failures);
        if d == 0 || self.jitter_permille == 0 {
            return d;
        }
        let width = (u128::from(d) * u128::from(self.jitter_permille) / 1000) as u64;
        let hi = d.saturating_add(width).min(self.backoff_cap_ms);
        let lo = hi.saturating_sub(width).max(self.backoff_base_ms);
        let span = hi - lo;
        if span == 0 {
            return lo;
        }
        let h = splitmix64(attempt.0 ^ (u64::from(failures) << 48) ^ 0x5eed_ba5e);
        lo + ((u128::from(h) * u128::from(span + 1)) >> 64) as u64
    }
}

/// A fixed, well-mixed 64-bit hash (SplitMix64's finaliser).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_cap() {
        let c = ReconcilerConfig {
            jitter_permille: 0,
            ..Default::default()
        };
        let ds: Vec<u64> = (0..9).map(|f| c.backoff_ms(NodeAttemptId(1), f)).collect();
        assert_eq!(
            ds,
            [
                0, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000
            ]
        );
        assert_eq!(c.backoff_ms(NodeAttemptId(1), u32::MAX), 60_000);
    }

    #[test]
    fn jittered_backoff_stays_between_floor_and_cap_and_is_deterministic() {
        let c = ReconcilerConfig {
            jitter_permille: 1000,
            ..Default::default()
        };
        let mut distinct = std::collections::BTreeSet::new();
        for a in 0..2_000u64 {
            for f in 1..12 {
                let d = c.backoff_ms(NodeAttemptId(a), f);
                assert!((1_000..=60_000).contains(&d), "{d}");
                assert_eq!(d, c.backoff_ms(NodeAttemptId(a), f));
                if f == 1 {
                    distinct.insert(d);
                }
            }
        }
        assert!(distinct.len() > 500, "jitter should spread retries");
        // At the cap the window slides down instead of collapsing onto the cap.
        let at_cap: std::collections::BTreeSet<u64> = (0..100)
            .map(|a| c.backoff_ms(NodeAttemptId(a), 20))
            .collect();
        assert!(at_cap.len() > 50 && at_cap.iter().all(|d| (1_000..=60_000).contains(d)));
    }

    #[test]
    fn invalid_config_is_rejected_with_the_field_name() {
        let mut c = ReconcilerConfig::default();
        assert_eq!(c.validate(), Ok(()));
        c.backoff_cap_ms = 10;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::CapBelowBase { .. })
        ));
        c = ReconcilerConfig::default();
        c.timeouts.destroy_lease_ms = 0;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "timeouts.destroy_lease_ms must be greater than zero"
        );
        c = ReconcilerConfig::default();
        c.jitter_permille = 1001;
        assert!(c.validate().is_err());
    }
}
