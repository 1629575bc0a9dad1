//! Fault knobs: what can go wrong, as data the admin API and the Rust API share.

use crate::config::Endpoint;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Which instances a per-instance fault applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selector {
    /// One existing instance (admin JSON: `{"id": 123}`).
    Id(u64),
    /// Existing instances with this label, and instances created later with
    /// it (admin JSON: `{"label": "x"}`).
    Label(String),
    /// The next `n` instances created (admin JSON: `{"next": 2}`).
    Next(u32),
    /// Every instance created from now on (admin JSON: `"all_new"`).
    AllNew,
}

/// How an offer is gone when someone tries to rent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gone {
    /// 404, code 3603: `no_such_ask … is not available`.
    NotFound,
    /// With `cancel_unavail`, 410 code 3907 `no_such_ask … no longer
    /// available`; without it, the create commits an instance that cannot be
    /// scheduled (`actual_status` `exited`, never running).
    Unavailable,
}

/// How an instance dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Death {
    /// `actual_status` `exited` (the container stopped on its own; one
    /// stopped by its user shows `stopped`).
    Exited,
    /// `actual_status` `offline` (the host stopped reporting).
    Offline,
    /// `actual_status` `frozen`: the host holds the GPU (and bills for
    /// it) but the container runs nothing; it does not come back by itself.
    Frozen,
    /// Gone from every listing and show, as if destroyed by someone else.
    Vanished,
}

/// What the caller of an ambiguous create sees after the create committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ambiguity {
    /// No answer for `hold`, then the connection is closed without one.
    Timeout {
        /// How long nothing is sent (admin JSON: `hold_ms`).
        #[serde(rename = "hold_ms", with = "millis")]
        hold: Duration,
    },
    /// The connection is closed at once, without a response.
    Drop,
    /// A 502 Bad Gateway with an HTML body.
    BadGateway,
    /// A 200 whose body is cut off mid-JSON, as a broken proxy or a
    /// half-written answer would leave it.
    Malformed,
}

/// Per-instance faults, stamped on an instance (at create, or when set for
/// an existing one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Traits {
    /// Loading takes this long instead of the configured time.
    pub(crate) loading: Option<Duration>,
    /// Loading never ends.
    pub(crate) stuck: bool,
    /// The boot fails: `created` with an OCI error after loading.
    pub(crate) boot_failure: bool,
    /// Running, but no sshd answers.
    pub(crate) ssh_never_ready: bool,
}

/// A per-instance fault kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InstanceFault {
    SlowLoading(Duration),
    StuckLoading,
    BootFailure,
    SshNeverReady,
}

impl InstanceFault {
    pub(crate) fn apply(self, traits: &mut Traits) {
        match self {
            InstanceFault::SlowLoading(d) => traits.loading = Some(d),
            InstanceFault::StuckLoading => traits.stuck = true,
            InstanceFault::BootFailure => traits.boot_failure = true,
            InstanceFault::SshNeverReady => traits.ssh_never_ready = true,
        }
    }
}

/// The fault knobs currently set.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub(crate) offers_gone: HashMap<u64, Gone>,
    /// The next n calls of an endpoint get 429.
    pub(crate) rate_bursts: BTreeMap<Endpoint, u32>,
    /// The next n successful answers of an endpoint are cut off mid-JSON.
    pub(crate) malformed: BTreeMap<Endpoint, u32>,
    /// Faults waiting for instances to be created: (label, fault), (next n, fault), all new.
    pub(crate) by_label: Vec<(String, InstanceFault)>,
    pub(crate) next: Vec<(u32, InstanceFault)>,
    pub(crate) all_new: Vec<InstanceFault>,
    /// The next creates that commit but answer ambiguously.
    pub(crate) ambiguous: Vec<Ambiguity>,
    /// New instances stay out of listings for this long.
    pub(crate) listing_lag: Duration,
    /// The next n destroys fail with this status, destroying nothing.
    pub(crate) flaky_destroys: u32,
    pub(crate) flaky_destroy_status: u16,
    /// 429 bodies are plain text instead of JSON.
    pub(crate) text_429: bool,
    /// No endpoint allows a burst: one call per interval, listings included.
    pub(crate) strict_rate_limits: bool,
    /// Random 5xx: probability and generator.
    pub(crate) random_5xx: Option<(f64, SplitMix64)>,
}

impl Faults {
    /// The traits a new instance with `label` gets (consumes `Next` counts).
    pub(crate) fn traits_for_new(&mut self, label: Option<&str>) -> Traits {
        let mut traits = Traits::default();
        for fault in &self.all_new {
            fault.apply(&mut traits);
        }
        for (l, fault) in &self.by_label {
            if Some(l.as_str()) == label {
                fault.apply(&mut traits);
            }
        }
        for (n, fault) in &mut self.next {
            if *n > 0 {
                *n -= 1;
                fault.apply(&mut traits);
            }
        }
        self.next.retain(|(n, _)| *n > 0);
        traits
    }

    /// Whether this call is one of the next rate-limit burst calls (consumes one).
    pub(crate) fn take_burst(&mut self, endpoint: Endpoint) -> bool {
        match self.rate_bursts.get_mut(&endpoint) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// Whether this call's answer is one of the next cut-off answers of
    /// `endpoint` (consumes one).
    pub(crate) fn take_malformed(&mut self, endpoint: Endpoint) -> bool {
        match self.malformed.get_mut(&endpoint) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// A random 5xx status for this call, if the dice say so.
    pub(crate) fn roll_5xx(&mut self) -> Option<u16> {
        let (p, rng) = self.random_5xx.as_mut()?;
        let roll = rng.next_f64();
        if roll < *p {
            const STATUSES: [u16; 3] = [500, 502, 503];
            Some(STATUSES[(rng.next_u64() % 3) as usize])
        } else {
            None
        }
    }
}

/// A small seeded generator (SplitMix64): deterministic faults without a `rand` dependency.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub(crate) mod millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_deterministic_and_spread() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        let xs: Vec<f64> = (0..1000).map(|_| a.next_f64()).collect();
        let ys: Vec<f64> = (0..1000).map(|_| b.next_f64()).collect();
        assert_eq!(xs, ys);
        let below_half = xs.iter().filter(|x| **x < 0.5).count();
        assert!((400..600).contains(&below_half), "{below_half}");
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
    }

    #[test]
    fn next_faults_are_consumed_and_label_faults_stay() {
        let mut f = Faults::default();
        f.next.push((1, InstanceFault::StuckLoading));
        f.by_label.push(("a".into(), InstanceFault::BootFailure));
        let t = f.traits_for_new(Some("a"));
        assert!(t.stuck && t.boot_failure);
        let t = f.traits_for_new(Some("a"));
        assert!(!t.stuck && t.boot_failure);
        assert_eq!(f.traits_for_new(None), Traits::default());
    }
}
