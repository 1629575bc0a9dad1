//! Whether a shape fits: under its own `capacity`, or under the providers' estimates.

use crate::shape::{ClusterShape, DesiredState};
use serde::{Deserialize, Serialize};

/// How many nodes a provider can hold, and on what the estimate rests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// The provider kind (`process`, ...) whose groups it limits.
    pub kind: String,
    /// The most nodes.
    pub nodes: u64,
    /// Where the number comes from, for people (e.g. "this machine's
    /// 7.5 GiB of free memory at 64 MiB per agent").
    pub basis: String,
}

/// On what the limit of an [`OverCapacity`] rests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CapacityBasis {
    /// The shape's own top-level `capacity`, which overrides every
    /// provider's estimate.
    Shape,
    /// A provider's estimate, as its [`Capacity::basis`] describes it.
    Provider(String),
}

impl std::fmt::Display for CapacityBasis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shape => f.write_str("the shape's `capacity`"),
            Self::Provider(basis) => f.write_str(basis),
        }
    }
}

/// A shape refused by [`check_capacity`], with its numbers; the host
/// answers it as `ApplyError::OverCapacity` (`From` turns one into the
/// other).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverCapacity {
    /// Nodes the shape asks for at most (surge slots of a rollout included).
    pub nodes: u64,
    /// How the surge adds to `nodes`, said for people (empty without one).
    pub surge: String,
    /// The most allowed.
    pub capacity: u64,
    /// On what that rests.
    pub basis: CapacityBasis,
}

/// Refuses `shape` when it would grow the cluster, from `current`, past the
/// shape's own `capacity` or, without one, past any of `capacities` (each
/// counting only the groups of its provider kind). Nodes are counted at
/// their peak: a rollout's surge slots are machines too. A shape may
/// always shrink, even one already over a limit.
///
/// The [`Host`](crate::Host) checks every shape it is offered with it; a
/// front end may call it before it starts anything (with an empty
/// `current` for a new cluster), to refuse the same shapes earlier.
///
/// # Errors
/// [`OverCapacity`], naming the numbers. A shape that does not
/// validate is not refused here: validation says why, more clearly.
pub fn check_capacity(
    shape: &ClusterShape,
    current: &DesiredState,
    capacities: &[Capacity],
) -> Result<(), OverCapacity> {
    let Ok(next) = shape.validate() else {
        return Ok(());
    };
    let peak = |d: &DesiredState, kind: Option<&str>| -> (u64, u64) {
        d.groups
            .iter()
            .filter(|g| kind.is_none_or(|k| g.template.provider.kind == k))
            .map(|g| {
                (
                    u64::from(g.count),
                    u64::from(g.policy.max_surge_of(g.count)),
                )
            })
            .fold((0, 0), |(n, s), (gn, gs)| (n + gn + gs, s + gs))
    };
    let refuse = |(nodes, surge): (u64, u64), now: u64, capacity: u64, basis: CapacityBasis| {
        (nodes > capacity && nodes > now).then(|| OverCapacity {
            nodes,
            surge: if surge > 0 {
                format!(" (counting up to {surge} surge node(s) of a rollout)")
            } else {
                String::new()
            },
            capacity,
            basis,
        })
    };
    if let Some(capacity) = shape.capacity {
        // The shape's own limit overrides the providers' estimates.
        return match refuse(
            peak(&next, None),
            peak(current, None).0,
            capacity,
            CapacityBasis::Shape,
        ) {
            Some(e) => Err(e),
            None => Ok(()),
        };
    }
    for c in capacities {
        let now = peak(current, Some(c.kind.as_str())).0;
        let basis = CapacityBasis::Provider(c.basis.clone());
        if let Some(e) = refuse(peak(&next, Some(c.kind.as_str())), now, c.nodes, basis) {
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::ApplyError;
    use crate::id::{Generation, RunId};
    use crate::shape::tests::{group, shape};

    fn local(nodes: u64) -> Capacity {
        Capacity {
            kind: "fake".to_owned(),
            nodes,
            basis: "this test's memory".to_owned(),
        }
    }

    #[test]
    fn a_new_cluster_past_a_providers_estimate_is_refused_and_its_own_capacity_wins() {
        let none = DesiredState::empty(RunId::new("run"), Generation(0));
        let mut big = shape(1, vec![group("w", 10)]);
        let e = ApplyError::from(check_capacity(&big, &none, &[local(4)]).unwrap_err());
        assert!(
            matches!(
                &e,
                ApplyError::OverCapacity {
                    nodes: 10,
                    capacity: 4,
                    basis: CapacityBasis::Provider(basis),
                    ..
                } if basis == "this test's memory"
            ),
            "{e}"
        );
        // Other kinds' estimates do not count this group.
        let other = Capacity {
            kind: "process".to_owned(),
            ..local(4)
        };
        assert_eq!(check_capacity(&big, &none, &[other]), Ok(()));
        big.capacity = Some(20);
        assert_eq!(check_capacity(&big, &none, &[local(4)]), Ok(()));
        // Shrinking is always allowed, even past the limit.
        let now = shape(1, vec![group("w", 12)]).validate().unwrap();
        big.capacity = None;
        assert_eq!(check_capacity(&big, &now, &[local(4)]), Ok(()));
    }

    #[test]
    fn a_refusal_says_whether_the_limit_is_the_shapes_own_or_a_providers() {
        let none = DesiredState::empty(RunId::new("run"), Generation(0));
        let mut big = shape(1, vec![group("w", 10)]);
        big.capacity = Some(6);
        let own = ApplyError::from(check_capacity(&big, &none, &[local(20)]).unwrap_err());
        assert!(
            matches!(
                &own,
                ApplyError::OverCapacity {
                    nodes: 10,
                    capacity: 6,
                    basis: CapacityBasis::Shape,
                    ..
                }
            ),
            "{own}"
        );
        // The words the error has always had.
        assert_eq!(
            own.to_string(),
            "the shape asks for 10 nodes, but the shape's `capacity` allows at most 6; nothing \
             was changed (set `capacity` in the shape to override)"
        );
        // A provider's description is its own, whatever it mentions.
        big.capacity = None;
        let described = Capacity {
            basis: "the `capacity` of this test".to_owned(),
            ..local(4)
        };
        let theirs = ApplyError::from(check_capacity(&big, &none, &[described]).unwrap_err());
        assert_eq!(
            theirs,
            ApplyError::OverCapacity {
                nodes: 10,
                surge: String::new(),
                capacity: 4,
                basis: CapacityBasis::Provider("the `capacity` of this test".to_owned()),
            }
        );
        assert_eq!(
            theirs.to_string(),
            "the shape asks for 10 nodes, but the `capacity` of this test allows at most 4; \
             nothing was changed (set `capacity` in the shape to override)"
        );
    }
}
