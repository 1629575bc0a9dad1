//! Change budgets of a group: how many nodes a template change may take down
//! at once, and when remediation of lost nodes is held.
//!
//! A group's [`GroupPolicy`] is part of its shape but not of its template:
//! changing it replaces no node. Amounts are [`Quantity`]s, a count or a
//! percentage of the group's slot count, resolved the way Kubernetes resolves
//! `maxUnavailable`, `maxSurge` and `maxUnhealthy`:
//!
//! - `max_unavailable` rounds a percentage **down, but to at least 1** when
//!   there is no surge (a rollout always makes progress); with a surge it
//!   may be 0, since the surge nodes make the room;
//! - `max_surge` rounds **up**;
//! - `max_unhealthy` rounds **down**, and may resolve to 0 (any unhealthy
//!   node then holds remediation).

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;

/// Largest percentage a [`Quantity`] may name.
pub const PERCENT_MAX: u32 = 100;

/// An amount of nodes: a count, or a percentage of a group's slot count.
///
/// Written as an integer (`2`) or a string ending in `%` (`"25%"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quantity {
    /// That many nodes.
    Count(u32),
    /// That percentage of the group's slots (0 to [`PERCENT_MAX`]).
    Percent(u32),
}

impl Quantity {
    /// The share of `of` nodes, rounded down (a count is taken as it is).
    pub fn resolve_down(self, of: u32) -> u32 {
        match self {
            Self::Count(n) => n,
            Self::Percent(p) => ((u64::from(of) * u64::from(p)) / 100) as u32,
        }
    }

    /// The share of `of` nodes, rounded up (a count is taken as it is).
    pub fn resolve_up(self, of: u32) -> u32 {
        match self {
            Self::Count(n) => n,
            Self::Percent(p) => (u64::from(of) * u64::from(p)).div_ceil(100) as u32,
        }
    }

    /// True for a count of 0 or a percentage of 0.
    pub fn is_zero(self) -> bool {
        matches!(self, Self::Count(0) | Self::Percent(0))
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Count(n) => s.serialize_u32(*n),
            Self::Percent(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a count of nodes (2) or a percentage of the group (\"25%\")")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
                u32::try_from(v)
                    .map(Quantity::Count)
                    .map_err(|_| E::custom(format!("{v} nodes is too many")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("{v} is negative; a count is 0 or more")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
                let digits = v.trim().strip_suffix('%').ok_or_else(|| {
                    E::custom(format!(
                        "{v:?} is neither a count nor a percentage (write 2 or \"25%\")"
                    ))
                })?;
                digits
                    .trim()
                    .parse::<u32>()
                    .map(Quantity::Percent)
                    .map_err(|_| E::custom(format!("{v:?} is not a whole percentage like \"25%\"")))
            }
        }
        d.deserialize_any(V)
    }
}

/// How a group's nodes may be changed and remediated. Not part of the
/// template: changing it replaces no node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupPolicy {
    /// At most this many of the group's desired slots may be unavailable
    /// (not ready) when a ready node of an outdated template is taken down
    /// to be replaced. Default 1.
    pub max_unavailable: Quantity,
    /// Extra slots a rollout may add beside the group's `count` while it
    /// runs (see [`surge`](crate::surge)). Default 0: replacement is in
    /// place only.
    pub max_surge: Quantity,
    /// When more than this many of the group's slots are unhealthy (failed,
    /// or their agent disconnected), lost nodes are not replaced until the
    /// group recovers; `None` for no limit (the default).
    pub max_unhealthy: Option<Quantity>,
    /// What becomes of a node whose machine the provider paused (an
    /// interruptible rental that was outbid). Default: replaced, as any
    /// node whose agent stays away.
    pub on_preempt: OnPreempt,
    /// Seconds a joined agent keeps its node without its lease being
    /// renewed by the daemon; past them it ends the node by itself (the
    /// dead-man's switch). 0: never. Default [`GroupPolicy::ORPHAN_AFTER_DEFAULT_S`].
    pub orphan_after_s: u32,
    /// Whether a node running a job waits for it before its lease counts
    /// ([`OrphanPolicy::Idle`]) or not (the default).
    pub orphan_policy: OrphanPolicy,
    /// Jobs one node runs at once (at least 1; default 1). Read by the
    /// jobs core, never by the reconciler.
    #[serde(default = "one")]
    pub jobs_per_node: u32,
    /// GPUs each node has, when the shape declares them.
    #[serde(default)]
    pub gpus: Option<u32>,
}

fn one() -> u32 {
    1
}

/// When an orphaned node's lease counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OrphanPolicy {
    /// From the last renewal, job or no job (the default): no machine
    /// outlives its controller by more than the lease.
    #[default]
    Always,
    /// From the last renewal or the end of the last job, whichever is
    /// later: a run under way is not cut off by a lost controller.
    Idle,
}

impl Default for GroupPolicy {
    fn default() -> Self {
        Self {
            max_unavailable: Quantity::Count(1),
            max_surge: Quantity::Count(0),
            max_unhealthy: None,
            on_preempt: OnPreempt::Replace,
            orphan_after_s: Self::ORPHAN_AFTER_DEFAULT_S,
            orphan_policy: OrphanPolicy::Always,
            jobs_per_node: 1,
            gpus: None,
        }
    }
}

/// What a group does with a node whose machine its provider paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OnPreempt {
    /// The node is lost like any node whose agent stays away past its
    /// grace: its paused machine is destroyed and another one made.
    Replace,
    /// The node keeps its machine for up to this many seconds from when
    /// the pause was seen (its agent's grace, if longer): a machine that
    /// resumes in time brings its agent back and nothing is replaced.
    Wait {
        /// Seconds to wait.
        wait_s: u32,
    },
}

impl OnPreempt {
    /// The wait default for `on_preempt = "wait"` without
    /// `preempt_wait_s`: ten minutes.
    pub const WAIT_DEFAULT_S: u32 = 600;

    /// How long a paused machine is waited for, in milliseconds; `None`
    /// when it is not.
    pub fn wait_ms(self) -> Option<u64> {
        match self {
            Self::Replace => None,
            Self::Wait { wait_s } => Some(u64::from(wait_s) * 1000),
        }
    }
}

impl GroupPolicy {
    /// How long an agent keeps its node without a renewed lease, by
    /// default: an hour, enough for a laptop's lid to be closed and opened
    /// again, short enough that a machine lost for good bills an hour.
    pub const ORPHAN_AFTER_DEFAULT_S: u32 = 3_600;

    /// `max_unavailable` for a group of `count` slots: a percentage rounds
    /// down, and the result is at least 1 unless the group may surge (then
    /// 0 is kept: the rollout moves by adding nodes first, as Kubernetes
    /// does with `maxUnavailable: 0`).
    pub fn max_unavailable_of(&self, count: u32) -> u32 {
        let n = self.max_unavailable.resolve_down(count);
        if self.max_surge_of(count) > 0 {
            n
        } else {
            n.max(1)
        }
    }

    /// `max_surge` for a group of `count` slots: a percentage rounds up,
    /// and the result is at most `count` (a rollout never more than doubles
    /// a group).
    pub fn max_surge_of(&self, count: u32) -> u32 {
        self.max_surge.resolve_up(count).min(count)
    }

    /// `max_unhealthy` for a group of `count` slots (a percentage rounds
    /// down), or `None` for no limit.
    pub fn max_unhealthy_of(&self, count: u32) -> Option<u32> {
        self.max_unhealthy.map(|q| q.resolve_down(count))
    }
}

/// Whether a group's remediation is held: `unhealthy` of its `nodes` desired
/// slots are unhealthy, more than `max` allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Breaker {
    /// Unhealthy slots (failed, or their agent disconnected).
    pub unhealthy: u32,
    /// The group's desired slots.
    pub nodes: u32,
    /// The resolved `max_unhealthy`.
    pub max: u32,
}

impl Breaker {
    /// The breaker of a group of `nodes` slots with `unhealthy` unhealthy
    /// ones under `policy`: `Some` when it is tripped (more unhealthy than
    /// the limit), `None` when remediation may go on.
    pub fn check(policy: &GroupPolicy, nodes: u32, unhealthy: u32) -> Option<Self> {
        let max = policy.max_unhealthy_of(nodes)?;
        (unhealthy > max).then_some(Self {
            unhealthy,
            nodes,
            max,
        })
    }
}

impl fmt::Display for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "remediation paused: {} of {} unhealthy > max {}",
            self.unhealthy, self.nodes, self.max
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_rounds_down_but_to_at_least_one_and_surge_rounds_up() {
        let p = |u, s| GroupPolicy {
            max_unavailable: u,
            max_surge: s,
            max_unhealthy: None,
            on_preempt: OnPreempt::Replace,
            orphan_after_s: GroupPolicy::ORPHAN_AFTER_DEFAULT_S,
            orphan_policy: OrphanPolicy::Always,
            jobs_per_node: 1,
            gpus: None,
        };
        let q = p(Quantity::Percent(25), Quantity::Percent(25));
        assert_eq!(q.max_unavailable_of(10), 2);
        assert_eq!(q.max_surge_of(10), 3);
        assert_eq!(
            q.max_unavailable_of(3),
            0,
            "0.75 rounds down; the surge makes room"
        );
        assert_eq!(
            p(Quantity::Percent(25), Quantity::Count(0)).max_unavailable_of(3),
            1,
            "0.75 rounds down, then up to 1 without a surge"
        );
        assert_eq!(q.max_surge_of(3), 1);
        assert_eq!(
            p(Quantity::Count(0), Quantity::Count(0)).max_unavailable_of(6),
            1
        );
        assert_eq!(
            p(Quantity::Percent(100), Quantity::Count(0)).max_unavailable_of(6),
            6
        );
        assert_eq!(GroupPolicy::default().max_unavailable_of(6), 1);
        let surge = p(Quantity::Count(0), Quantity::Count(1));
        assert_eq!(
            surge.max_unavailable_of(6),
            0,
            "a surge keeps 0 unavailable"
        );
        assert_eq!(surge.max_surge_of(6), 1);
        assert_eq!(p(Quantity::Count(0), Quantity::Count(9)).max_surge_of(4), 4);
        assert_eq!(
            p(Quantity::Count(0), Quantity::Count(1)).max_unavailable_of(0),
            1,
            "an empty group has no surge, so the floor of 1 applies"
        );
    }

    #[test]
    fn the_breaker_trips_only_above_its_limit_and_says_so() {
        let policy = GroupPolicy {
            max_unhealthy: Some(Quantity::Count(2)),
            ..GroupPolicy::default()
        };
        assert_eq!(Breaker::check(&policy, 6, 2), None);
        let b = Breaker::check(&policy, 6, 4).unwrap();
        assert_eq!(
            b.to_string(),
            "remediation paused: 4 of 6 unhealthy > max 2"
        );
        assert_eq!(Breaker::check(&GroupPolicy::default(), 6, 6), None);
        let pct = GroupPolicy {
            max_unhealthy: Some(Quantity::Percent(40)),
            ..GroupPolicy::default()
        };
        assert_eq!(pct.max_unhealthy_of(6), Some(2), "2.4 rounds down");
    }

    #[test]
    fn quantities_read_counts_and_percentages() {
        use serde::de::IntoDeserializer;
        use serde::de::value::Error;
        let text = |s: &str| {
            Quantity::deserialize(IntoDeserializer::<Error>::into_deserializer(s))
                .map_err(|e| e.to_string())
        };
        let int = |n: i64| {
            Quantity::deserialize(IntoDeserializer::<Error>::into_deserializer(n))
                .map_err(|e| e.to_string())
        };
        assert_eq!(int(2), Ok(Quantity::Count(2)));
        assert_eq!(text("25%"), Ok(Quantity::Percent(25)));
        assert!(text("25").unwrap_err().contains("neither a count"));
        assert!(int(-1).unwrap_err().contains("negative"));
    }
}
