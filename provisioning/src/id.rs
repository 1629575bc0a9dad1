//! Layered identities: run, group, logical slot, attempt and operation.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// Longest accepted run or group id, in bytes.
pub const ID_LEN_MAX: usize = 63;

/// Why an id string was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
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

/// Identifies a node group within a run: an interned name, one pointer
/// wide and `Copy`.
///
/// Every distinct name is stored once for the life of the process (see
/// [`GroupId::new`]), so two ids are equal exactly when they point at the same
/// name, and copying one costs nothing: slot ids, resource keys and the maps
/// keyed by them carry no reference counts. Order and hashing follow the
/// name's text, never the pointer, so they are the same in every run.
#[derive(Clone, Copy)]
pub struct GroupId(&'static GroupName);

/// One interned group name (the box keeps [`GroupId`] one pointer wide).
struct GroupName(Box<str>);

/// Most distinct group names [`GroupId::intern`] stores; past it only names
/// already known are found. [`GroupId::new`], which trusted paths (a
/// validated shape, tests) use, is not limited.
///
/// Names are at most [`ID_LEN_MAX`] bytes, so the cap bounds what text from
/// outside (a provider's listing, a wire message) can make the process keep
/// to a few MiB. Frames an unauthenticated peer sends carry no interned ids
/// at all (the swarm's join request carries its key as plain text until its
/// token is checked).
pub const GROUP_NAMES_MAX: usize = 65_536;

/// The interned group names. Filled once per distinct name and never emptied;
/// a lookup takes a lock, so hot paths copy ids rather than intern them.
static GROUP_NAMES: std::sync::Mutex<std::collections::BTreeMap<&'static str, GroupId>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

impl GroupId {
    /// The id of the group named `s`, storing the name if it is new. Used
    /// for names the daemon trusts (a validated shape's groups); text from
    /// elsewhere goes through [`GroupId::intern`].
    pub fn new(s: &str) -> Self {
        Self::lookup(s, usize::MAX).expect("an unlimited intern always succeeds")
    }

    /// Like [`GroupId::new`], but a name not stored yet is only stored while
    /// fewer than [`GROUP_NAMES_MAX`] names are; `None` past that.
    pub fn intern(s: &str) -> Option<Self> {
        Self::lookup(s, GROUP_NAMES_MAX)
    }

    /// The id of `s` if that name is stored already; never stores one. For
    /// text that may only name a group the process knows.
    pub fn known(s: &str) -> Option<Self> {
        Self::lookup(s, 0)
    }

    fn lookup(s: &str, max: usize) -> Option<Self> {
        // A poisoned lock only means a panic elsewhere while holding it; the
        // map is never left half-changed (one insert of a finished entry).
        let mut names = GROUP_NAMES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(id) = names.get(s) {
            return Some(*id);
        }
        if names.len() >= max {
            return None;
        }
        let name: &'static GroupName = Box::leak(Box::new(GroupName(Box::from(s))));
        let id = GroupId(name);
        names.insert(&name.0, id);
        Some(id)
    }

    /// The id as a string slice.
    #[inline]
    pub fn as_str(&self) -> &'static str {
        &self.0.0
    }
}

/// One comparison of pointers: each name is stored once.
impl PartialEq for GroupId {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for GroupId {}

impl std::hash::Hash for GroupId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // By the text, so a hash never depends on where the name was stored.
        self.as_str().hash(state);
    }
}

impl PartialOrd for GroupId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for GroupId {
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if self == other {
            return std::cmp::Ordering::Equal;
        }
        self.as_str().cmp(other.as_str())
    }
}

impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("GroupId").field(&self.as_str()).finish()
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for GroupId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for GroupId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Self::intern(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "group {s:?} is new and {GROUP_NAMES_MAX} group names are already known"
            ))
        })
    }
}

/// A logical slot: `{group_id}-{index}`. Stable across attempts.
///
/// Ordered by group, then by index, so the highest indexes of a group are the
/// last entries of its range (scale-down removes exactly those).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogicalNodeId {
    /// The group the slot belongs to.
    pub group: GroupId,
    /// The slot's index within its group, from zero.
    pub index: u32,
}

// Size budgets, checked when the crate is built: a group id is one
// pointer, and a slot id (with its `None`) two words.
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<GroupId>() == 8);
    assert!(std::mem::size_of::<LogicalNodeId>() == 16);
    assert!(std::mem::size_of::<Option<LogicalNodeId>>() == 16);
};

impl LogicalNodeId {
    /// The slot `index` of `group`.
    pub fn new(group: GroupId, index: u32) -> Self {
        Self { group, index }
    }

    /// Parses `{group}-{index}` by splitting at the last dash. A well-formed
    /// id of a group never seen before fails too once [`GROUP_NAMES_MAX`]
    /// names are known.
    pub fn parse(s: &str) -> Option<Self> {
        let (group, index) = s.rsplit_once('-')?;
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if index.len() > 1 && index.starts_with('0') {
            return None;
        }
        validate_id(group).ok()?;
        let index = index.parse().ok()?;
        Some(Self::new(GroupId::intern(group)?, index))
    }
}

/// `-` and a slot's index in decimal, written from the end of `buf`;
/// returns where it starts.
fn dash_index(index: u32, buf: &mut [u8; 11]) -> usize {
    let mut i = buf.len();
    let mut n = index;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    i -= 1;
    buf[i] = b'-';
    i
}

impl fmt::Display for LogicalNodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Written piece by piece rather than through `write!`: ids are
        // formatted for every journal record and flight frame.
        f.write_str(self.group.as_str())?;
        let mut buf = [0u8; 11];
        let at = dash_index(self.index, &mut buf);
        f.write_str(std::str::from_utf8(&buf[at..]).map_err(|_| fmt::Error)?)
    }
}

impl Serialize for LogicalNodeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // The same string as `Display`, built once on the stack (a
        // serializer's `collect_str` may format it twice: once to count).
        let group = self.group.as_str().as_bytes();
        let mut buf = [0u8; ID_LEN_MAX + 11];
        let mut digits = [0u8; 11];
        let at = dash_index(self.index, &mut digits);
        let tail = &digits[at..];
        if group.len() + tail.len() > buf.len() {
            return s.collect_str(self);
        }
        buf[..group.len()].copy_from_slice(group);
        buf[group.len()..group.len() + tail.len()].copy_from_slice(tail);
        match std::str::from_utf8(&buf[..group.len() + tail.len()]) {
            Ok(text) => s.serialize_str(text),
            Err(_) => s.collect_str(self),
        }
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
            #[inline]
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
    fn a_slot_id_is_written_and_encoded_as_group_dash_index() {
        let long = "g".repeat(ID_LEN_MAX);
        for (group, index) in [
            ("w", 0),
            ("worker", 9),
            ("w", 10),
            ("gpu", u32::MAX),
            (&long[..], 7),
        ] {
            let id = LogicalNodeId::new(GroupId::new(group), index);
            let want = format!("{group}-{index}");
            assert_eq!(id.to_string(), want);
            assert_eq!(serde_json::to_string(&id).unwrap(), format!("{want:?}"));
            assert_eq!(LogicalNodeId::parse(&want), Some(id));
        }
    }

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
    fn one_name_is_one_group_id_ordered_and_hashed_by_its_text() {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let a = GroupId::new("interned-a");
        let again = GroupId::new(&String::from("interned-a"));
        assert!(std::ptr::eq(a.0, again.0) && a == again);
        let b = GroupId::new("interned-b");
        assert_ne!(a, b);
        assert!(a < b, "ordered by the text");
        let h = BuildHasherDefault::<DefaultHasher>::default();
        assert_eq!(
            h.hash_one(a),
            h.hash_one("interned-a"),
            "hashed by the text"
        );
        assert_eq!(format!("{a} {a:?}"), "interned-a GroupId(\"interned-a\")");
    }

    #[test]
    fn past_the_cap_only_known_names_are_found() {
        let known = GroupId::new("capped-known");
        // A cap of zero stands for a full table.
        assert_eq!(GroupId::lookup("capped-known", 0), Some(known));
        assert_eq!(GroupId::lookup("capped-never-stored", 0), None);
        assert_eq!(GroupId::known("capped-never-stored"), None);
        assert_eq!(GroupId::known("capped-known"), Some(known));
        // Serde goes through the capped path and round-trips.
        let json = serde_json::to_string(&known).unwrap();
        assert_eq!(json, "\"capped-known\"");
        assert_eq!(serde_json::from_str::<GroupId>(&json).unwrap(), known);
        let node: LogicalNodeId = serde_json::from_str("\"capped-known-7\"").unwrap();
        assert_eq!((node.group, node.index), (known, 7));
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
