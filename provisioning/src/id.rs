//! Layered identities: run, group, logical slot, attempt and operation.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// Longest accepted run or group id, in bytes.
pub const ID_LEN_MAX: usize = 63;

/// Why an id string was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id is the empty string.
    #[error("is empty")]
    Empty,
    /// The id is longer than [`ID_LEN_MAX`] bytes.
    #[error("is {len} bytes long; the limit is {ID_LEN_MAX}")]
    TooLong {
        /// The length that was given.
        len: usize,
    },
    /// The id does not start with a lowercase ASCII letter.
    #[error("must start with a lowercase letter (a-z)")]
    BadStart,
    /// The id contains a character outside `a-z`, `0-9` and `-`.
    #[error("contains {ch:?}; only a-z, 0-9 and '-' are allowed")]
    BadChar {
        /// The offending character.
        ch: char,
    },
    /// The id ends with `-`.
    #[error("must not end with '-'")]
    TrailingDash,
}

/// Checks the id grammar shared by runs and groups: a DNS-label-like string.
///
/// Group ids are joined to slot indexes with `-`, and because an index is all
/// digits and always follows the *last* dash, two distinct (group, index) pairs
/// can never spell the same node name.
pub fn validate_id(s: &str) -> Result<(), IdError> {
    let first = s.chars().next().ok_or(IdError::Empty)?;
    if s.len() > ID_LEN_MAX {
        return Err(IdError::TooLong { len: s.len() });
    }
    if !first.is_ascii_lowercase() {
        return Err(IdError::BadStart);
    }
    if let Some(ch) = s
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(IdError::BadChar { ch });
    }
    if s.ends_with('-') {
        return Err(IdError::TrailingDash);
    }
    Ok(())
}

/// Identifies one run: the lifetime of one declared cluster. Fixed for a
/// driver's lifetime. Cheap to clone (shared string); clones of one id compare
/// equal without looking at the bytes, which keeps resource keys cheap to
/// order and find.
#[derive(Clone, Debug, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(Arc<str>);

impl RunId {
    /// Wraps a run id string (validated when a shape is validated).
    pub fn new(s: impl AsRef<str>) -> Self {
        Self(Arc::from(s.as_ref()))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl PartialEq for RunId {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl std::hash::Hash for RunId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl PartialOrd for RunId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RunId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return std::cmp::Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Identifies a node group within a run. Cheap to clone (shared string).
#[derive(Clone, Debug, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GroupId(Arc<str>);

impl GroupId {
    /// Wraps a group id string (validated when a shape is validated).
    pub fn new(s: &str) -> Self {
        Self(Arc::from(s))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// True when both are clones of one id (the same allocation); false
    /// says nothing.
    #[inline]
    pub fn ptr_eq(&self, other: &GroupId) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Equality with a pointer fast path: ids cloned from the same desired
    /// group share their allocation, which keeps a settled pass cheap.
    #[inline]
    pub fn same(&self, other: &GroupId) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl PartialEq for GroupId {
    fn eq(&self, other: &Self) -> bool {
        self.same(other)
    }
}

impl std::hash::Hash for GroupId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Equality compares the strings, so hashing must too.
        self.0.hash(state);
    }
}

impl PartialOrd for GroupId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for GroupId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return std::cmp::Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A logical slot: `{group_id}-{index}`. Stable across attempts.
///
/// Ordered by group, then by index, so the highest indexes of a group are the
/// last entries of its range (scale-down removes exactly those).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogicalNodeId {
    /// The group the slot belongs to.
    pub group: GroupId,
    /// The slot's index within its group, from zero.
    pub index: u32,
}

impl LogicalNodeId {
    /// The slot `index` of `group`.
    pub fn new(group: GroupId, index: u32) -> Self {
        Self { group, index }
    }

    /// Parses `{group}-{index}` by splitting at the last dash.
    pub fn parse(s: &str) -> Option<Self> {
        let (group, index) = s.rsplit_once('-')?;
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if index.len() > 1 && index.starts_with('0') {
            return None;
        }
        validate_id(group).ok()?;
        Some(Self::new(GroupId::new(group), index.parse().ok()?))
    }
}

impl fmt::Display for LogicalNodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.group, self.index)
    }
}

impl Serialize for LogicalNodeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LogicalNodeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("invalid node id {s:?}")))
    }
}

/// One incarnation of a slot. Allocated from a run-wide monotonic counter and
/// never reused, so facts of a superseded attempt can always be told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeAttemptId(pub u64);

impl fmt::Display for NodeAttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

/// One dispatched effect: the attempt it acts for plus a per-attempt sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct OperationId {
    /// The attempt the operation belongs to.
    pub attempt: NodeAttemptId,
    /// Position of the operation within its attempt, from zero.
    pub seq: u64,
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/op{}", self.attempt, self.seq)
    }
}

/// Revision number of a desired shape. Strictly increases when content changes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// The key every provider request is made under: who owns the external resource.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ResourceKey {
    /// The run that owns the resource.
    pub run_id: RunId,
    /// The slot the resource serves.
    pub node: LogicalNodeId,
    /// The incarnation of the slot that created it.
    pub attempt: NodeAttemptId,
}

impl fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.run_id, self.node, self.attempt)
    }
}

/// A provider's string id, kept inline when it is short (24 bytes or less,
/// which covers every id the bundled providers make for the fake and most
/// real ones): cloning and comparing one touches no heap.
pub type IdString = compact_str::CompactString;

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub IdString);

        impl $name {
            /// Wraps a provider's id.
            pub fn new(s: impl Into<IdString>) -> Self {
                Self(s.into())
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s.into())
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.into())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// A provider's handle on a leased machine.
    LeaseId
);

string_id!(
    /// Where a leased machine can be reached (an SSH address, a local path, ...).
    NodeEndpoint
);

string_id!(
    /// A provider's handle on one running bootstrap session.
    SessionId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_round_trip_through_their_display_form() {
        for s in ["worker-0", "gpu-a-12", "x-4294967295"] {
            let id = LogicalNodeId::parse(s).unwrap();
            assert_eq!(id.to_string(), s);
        }
        for bad in [
            "worker",
            "worker-",
            "-1",
            "worker-01",
            "Worker-1",
            "w-x",
            "w-4294967296",
        ] {
            assert!(
                LogicalNodeId::parse(bad).is_none(),
                "{bad} should not parse"
            );
        }
    }

    #[test]
    fn node_ids_order_by_group_then_numeric_index() {
        let a = LogicalNodeId::parse("w-2").unwrap();
        let b = LogicalNodeId::parse("w-10").unwrap();
        assert!(a < b);
    }

    #[test]
    fn id_grammar_names_the_problem() {
        assert_eq!(validate_id(""), Err(IdError::Empty));
        assert_eq!(validate_id("1a"), Err(IdError::BadStart));
        assert_eq!(validate_id("a_b"), Err(IdError::BadChar { ch: '_' }));
        assert_eq!(validate_id("ab-"), Err(IdError::TrailingDash));
        assert!(matches!(
            validate_id(&"a".repeat(64)),
            Err(IdError::TooLong { len: 64 })
        ));
        assert_eq!(validate_id("gpu-a100"), Ok(()));
    }
}
