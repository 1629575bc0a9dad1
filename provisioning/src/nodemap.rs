//! A map keyed by slot that stores each group's slots in a dense vector.
//!
//! Slots are `{group}-{index}` with small, mostly contiguous indexes, so a
//! group's entries live in a vector indexed by slot index: a lookup is a
//! search among the (few) groups and one index, and a walk in slot order
//! reads memory front to back. It iterates in the same order as a
//! `BTreeMap<LogicalNodeId, V>` (group, then index) and serializes as one.
//!
//! Indexes at or above [`DENSE_INDEX_MAX`] (never made by a shape, whose
//! groups are bounded by `GROUP_COUNT_MAX`, but possible in a journal or a
//! provider's listing) go to a sparse map instead, so no input can make the
//! vector huge.

use crate::id::{GroupId, LogicalNodeId};
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

/// Slot indexes below this are stored densely; larger ones sparsely.
pub const DENSE_INDEX_MAX: u32 = 1 << 18;

/// A slot's key and value, in that order: a walk reads the key and the
/// value's first fields (which `ManagedNode` keeps hot) from one cache line.
#[repr(C)]
#[derive(Clone)]
struct Entry<V>(LogicalNodeId, V);

#[derive(Clone)]
struct Group<V> {
    id: GroupId,
    /// Slot `i` at position `i`; `None` for an absent slot. Never ends in `None`.
    dense: Vec<Option<Entry<V>>>,
    /// Slots at or above [`DENSE_INDEX_MAX`].
    sparse: BTreeMap<u32, Entry<V>>,
}

impl<V> Group<V> {
    fn new(id: GroupId) -> Self {
        Self {
            id,
            dense: Vec::new(),
            sparse: BTreeMap::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.dense.is_empty() && self.sparse.is_empty()
    }

    /// Drops the dense part's trailing empty slots (it never ends in one) and,
    /// once it is a quarter of its room, most of that room.
    fn trim(&mut self) {
        while self.dense.last().is_some_and(Option::is_none) {
            self.dense.pop();
        }
        if self.dense.capacity() > 64 && self.dense.len() < self.dense.capacity() / 4 {
            self.dense.shrink_to(self.dense.len() * 2);
        }
    }

    #[inline]
    fn get(&self, index: u32) -> Option<&Entry<V>> {
        if index < DENSE_INDEX_MAX {
            self.dense.get(index as usize)?.as_ref()
        } else {
            self.sparse.get(&index)
        }
    }

    #[inline]
    fn get_mut(&mut self, index: u32) -> Option<&mut Entry<V>> {
        if index < DENSE_INDEX_MAX {
            self.dense.get_mut(index as usize)?.as_mut()
        } else {
            self.sparse.get_mut(&index)
        }
    }

    fn iter(&self) -> GroupIter<'_, V> {
        self.dense
            .iter()
            .filter_map(entry_ref as fn(&Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)>)
            .chain(
                self.sparse
                    .values()
                    .map(pair_ref as fn(&Entry<V>) -> (&LogicalNodeId, &V)),
            )
    }
}

fn entry_ref<V>(e: &Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)> {
    e.as_ref().map(|Entry(k, v)| (k, v))
}

fn pair_ref<V>(e: &Entry<V>) -> (&LogicalNodeId, &V) {
    (&e.0, &e.1)
}

type GroupIter<'a, V> = std::iter::Chain<
    std::iter::FilterMap<
        std::slice::Iter<'a, Option<Entry<V>>>,
        fn(&Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)>,
    >,
    std::iter::Map<
        std::collections::btree_map::Values<'a, u32, Entry<V>>,
        fn(&Entry<V>) -> (&LogicalNodeId, &V),
    >,
>;

/// A map from slot to `V`, ordered like `BTreeMap<LogicalNodeId, V>`. See the module docs.
#[derive(Clone)]
pub struct NodeMap<V> {
    /// Sorted by group id. A group is empty only between a
    /// [`NodeMap::reserve`] and its first insert; removing its last entry
    /// drops it.
    groups: Vec<Group<V>>,
    len: usize,
}

/// Equal when they hold the same entries (room reserved is not compared).
impl<V: PartialEq> PartialEq for NodeMap<V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<V> Default for NodeMap<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> NodeMap<V> {
    /// An empty map.
    pub const fn new() -> Self {
        Self {
            groups: Vec::new(),
            len: 0,
        }
    }

    /// How many slots hold an entry.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no slot holds an entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    fn group_pos(&self, id: &GroupId) -> Result<usize, usize> {
        // Most maps hold one group, and group ids are equal exactly when
        // they are the same pointer: the first group is one comparison.
        match self.groups.first() {
            Some(g) if g.id == *id => Ok(0),
            _ => self.group_pos_rest(id),
        }
    }

    #[inline(never)]
    fn group_pos_rest(&self, id: &GroupId) -> Result<usize, usize> {
        for (i, g) in self.groups.iter().enumerate().take(8).skip(1) {
            if g.id == *id {
                return Ok(i);
            }
        }
        // Not among the first few (or absent): by name, which also gives
        // where an absent group goes.
        self.groups.binary_search_by(|g| g.id.cmp(id))
    }

    /// The entry of `key`.
    #[inline]
    pub fn get(&self, key: &LogicalNodeId) -> Option<&V> {
        let g = &self.groups[self.group_pos(&key.group).ok()?];
        g.get(key.index).map(|Entry(_, v)| v)
    }

    /// The entry of `key`, to change.
    #[inline]
    pub fn get_mut(&mut self, key: &LogicalNodeId) -> Option<&mut V> {
        let i = self.group_pos(&key.group).ok()?;
        self.groups[i].get_mut(key.index).map(|Entry(_, v)| v)
    }

    /// True when `key` holds an entry.
    #[inline]
    pub fn contains_key(&self, key: &LogicalNodeId) -> bool {
        self.get(key).is_some()
    }

    /// Puts `value` at `key`; returns what was there.
    pub fn insert(&mut self, key: LogicalNodeId, value: V) -> Option<V> {
        let i = match self.group_pos(&key.group) {
            Ok(i) => i,
            Err(i) => {
                self.groups.insert(i, Group::new(key.group));
                i
            }
        };
        let g = &mut self.groups[i];
        let index = key.index;
        let old = if index < DENSE_INDEX_MAX {
            let at = index as usize;
            if g.dense.len() <= at {
                g.dense.resize_with(at + 1, || None);
            }
            g.dense[at].replace(Entry(key, value))
        } else {
            g.sparse.insert(index, Entry(key, value))
        };
        if old.is_none() {
            self.len += 1;
        }
        old.map(|Entry(_, v)| v)
    }

    /// The entry of `key`, made by `f` first if there is none.
    pub fn get_or_insert_with(&mut self, key: &LogicalNodeId, f: impl FnOnce() -> V) -> &mut V {
        if !self.contains_key(key) {
            self.insert(*key, f());
        }
        self.get_mut(key).expect("just inserted")
    }

    /// Makes room for `group`'s slots `0..slots` (dense ones only), so
    /// inserting them does not grow the vector step by step.
    pub fn reserve(&mut self, group: &GroupId, slots: u32) {
        let i = match self.group_pos(group) {
            Ok(i) => i,
            Err(i) => {
                self.groups.insert(i, Group::new(*group));
                i
            }
        };
        let dense = &mut self.groups[i].dense;
        let want = slots.min(DENSE_INDEX_MAX) as usize;
        dense.reserve_exact(want.saturating_sub(dense.len()));
    }

    /// Takes the entry of `key` out.
    pub fn remove(&mut self, key: &LogicalNodeId) -> Option<V> {
        let i = self.group_pos(&key.group).ok()?;
        let g = &mut self.groups[i];
        let old = if key.index < DENSE_INDEX_MAX {
            let at = key.index as usize;
            let old = g.dense.get_mut(at)?.take();
            g.trim();
            old
        } else {
            g.sparse.remove(&key.index)
        };
        if old.is_some() {
            self.len -= 1;
        }
        if g.is_empty() {
            self.groups.remove(i);
        }
        old.map(|Entry(_, v)| v)
    }

    /// Keeps only the entries `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&LogicalNodeId, &mut V) -> bool) {
        let mut removed = 0;
        for g in &mut self.groups {
            for e in &mut g.dense {
                if let Some(Entry(k, v)) = e
                    && !keep(k, v)
                {
                    *e = None;
                    removed += 1;
                }
            }
            g.trim();
            let before = g.sparse.len();
            g.sparse.retain(|_, Entry(k, v)| keep(k, v));
            removed += before - g.sparse.len();
        }
        self.len -= removed;
        self.groups.retain(|g| !g.is_empty());
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.groups.clear();
        self.len = 0;
    }

    /// Every entry, in slot order (group, then index).
    pub fn iter(&self) -> Iter<'_, V> {
        Iter {
            inner: self.groups.iter().flat_map(Group::iter),
            left: self.len,
        }
    }

    /// The entries at `from` and after it, in slot order.
    pub fn iter_from(&self, from: &LogicalNodeId) -> impl Iterator<Item = (&LogicalNodeId, &V)> {
        let (Ok(start) | Err(start)) = self.group_pos(&from.group);
        self.groups[start..].iter().flat_map(move |g| {
            let at = if g.id == from.group { from.index } else { 0 };
            let dense_from = (at as usize).min(g.dense.len());
            g.dense[dense_from..]
                .iter()
                .filter_map(entry_ref as fn(&Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)>)
                .chain(g.sparse.range(at..).map(|(_, e)| pair_ref(e)))
        })
    }

    /// Every entry in slot order, to change.
    pub fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = (&LogicalNodeId, &mut V)> {
        self.groups.iter_mut().flat_map(|g| {
            let dense = g
                .dense
                .iter_mut()
                .filter_map(|e| e.as_mut().map(|Entry(k, v)| (&*k, v)));
            dense.chain(g.sparse.values_mut().map(|Entry(k, v)| (&*k, v)))
        })
    }

    /// The entries of one group, in index order.
    pub fn group(&self, id: &GroupId) -> impl DoubleEndedIterator<Item = (&LogicalNodeId, &V)> {
        let g = self.group_pos(id).ok().map(|i| &self.groups[i]);
        g.into_iter().flat_map(Group::iter)
    }

    /// Each group (in order) with its entries (in index order): a walk in
    /// slot order without a per-entry step across groups.
    pub fn by_group(&self) -> impl Iterator<Item = (&GroupId, GroupEntries<'_, V>)> {
        self.groups.iter().map(|g| (&g.id, GroupEntries(g.iter())))
    }

    /// Every key, in slot order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &LogicalNodeId> {
        self.iter().map(|(k, _)| k)
    }

    /// Every value, in slot order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Every value in slot order, to change.
    pub fn values_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut V> {
        self.iter_mut().map(|(_, v)| v)
    }

    /// The last entry in slot order.
    pub fn last_key_value(&self) -> Option<(&LogicalNodeId, &V)> {
        self.iter().next_back()
    }
}

type GroupsIter<'a, V> = std::iter::FlatMap<
    std::slice::Iter<'a, Group<V>>,
    GroupIter<'a, V>,
    fn(&'a Group<V>) -> GroupIter<'a, V>,
>;

/// One group's entries in index order ([`NodeMap::by_group`]).
pub struct GroupEntries<'a, V>(GroupIter<'a, V>);

impl<'a, V> Iterator for GroupEntries<'a, V> {
    type Item = (&'a LogicalNodeId, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        self.0.next()
    }
}

/// The iterator of [`NodeMap::iter`]: entries in slot order.
pub struct Iter<'a, V> {
    inner: GroupsIter<'a, V>,
    left: usize,
}

impl<'a, V> Iterator for Iter<'a, V> {
    type Item = (&'a LogicalNodeId, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let next = self.inner.next();
        self.left = self.left.saturating_sub(usize::from(next.is_some()));
        next
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<V> DoubleEndedIterator for Iter<'_, V> {
    fn next_back(&mut self) -> Option<Self::Item> {
        let next = self.inner.next_back();
        self.left = self.left.saturating_sub(usize::from(next.is_some()));
        next
    }
}

impl<V> ExactSizeIterator for Iter<'_, V> {}

impl<'a, V> IntoIterator for &'a NodeMap<V> {
    type Item = (&'a LogicalNodeId, &'a V);
    type IntoIter = Iter<'a, V>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<V> IntoIterator for NodeMap<V> {
    type Item = (LogicalNodeId, V);
    type IntoIter = std::vec::IntoIter<(LogicalNodeId, V)>;

    fn into_iter(self) -> Self::IntoIter {
        let mut out = Vec::with_capacity(self.len);
        for g in self.groups {
            out.extend(g.dense.into_iter().flatten().map(|Entry(k, v)| (k, v)));
            out.extend(g.sparse.into_values().map(|Entry(k, v)| (k, v)));
        }
        out.into_iter()
    }
}

impl<V> FromIterator<(LogicalNodeId, V)> for NodeMap<V> {
    fn from_iter<I: IntoIterator<Item = (LogicalNodeId, V)>>(iter: I) -> Self {
        let mut map = Self::new();
        map.extend(iter);
        map
    }
}

impl<V> Extend<(LogicalNodeId, V)> for NodeMap<V> {
    fn extend<I: IntoIterator<Item = (LogicalNodeId, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<V> std::ops::Index<&LogicalNodeId> for NodeMap<V> {
    type Output = V;

    fn index(&self, key: &LogicalNodeId) -> &V {
        self.get(key).expect("no entry for this slot")
    }
}

impl<V: fmt::Debug> fmt::Debug for NodeMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V: Serialize> Serialize for NodeMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.len))?;
        for (k, v) in self {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for NodeMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V_<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V_<V> {
            type Value = NodeMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from node id to value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut map = NodeMap::new();
                while let Some((k, v)) = a.next_entry::<LogicalNodeId, V>()? {
                    map.insert(k, v);
                }
                Ok(map)
            }
        }
        d.deserialize_map(V_(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> LogicalNodeId {
        LogicalNodeId::parse(s).unwrap()
    }

    #[test]
    fn it_orders_and_answers_like_a_btree_map() {
        let keys = [
            "w-3", "a-0", "w-0", "w-10", "b-7", "w-262144", "w-300000", "a-2", "w-1",
        ];
        let mut map = NodeMap::new();
        let mut reference = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(map.insert(id(k), i), reference.insert(id(k), i));
        }
        assert_eq!(map.insert(id("w-3"), 99), reference.insert(id("w-3"), 99));
        let got: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
        let want: Vec<_> = reference.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(got, want);
        let back: Vec<_> = map.iter().rev().map(|(k, _)| *k).collect();
        let want_back: Vec<_> = reference.keys().rev().cloned().collect();
        assert_eq!(back, want_back);
        assert_eq!(map.len(), reference.len());
        assert_eq!(map.iter().len(), reference.len());
        for k in ["w-10", "w-300000", "a-0", "a-2", "zz-1"] {
            assert_eq!(map.remove(&id(k)), reference.remove(&id(k)));
            assert_eq!(map.len(), reference.len());
        }
        let got: Vec<_> = map.keys().cloned().collect();
        assert_eq!(got, reference.keys().cloned().collect::<Vec<_>>());
        assert_eq!(map.get(&id("w-1")), reference.get(&id("w-1")));
        assert_eq!(map.get(&id("w-2")), None);
        let w: Vec<_> = map
            .group(&GroupId::new("w"))
            .map(|(k, _)| k.to_string())
            .collect();
        assert_eq!(w, ["w-0", "w-1", "w-3", "w-262144"]);
        assert!(map.group(&GroupId::new("a")).next().is_none());
    }

    #[test]
    fn iter_from_gives_what_a_btree_range_would() {
        let keys = [
            "a-0", "a-2", "b-7", "w-0", "w-1", "w-3", "w-10", "w-262144", "w-300000",
        ];
        let map: NodeMap<usize> = keys.iter().enumerate().map(|(i, k)| (id(k), i)).collect();
        let reference: BTreeMap<LogicalNodeId, usize> =
            keys.iter().enumerate().map(|(i, k)| (id(k), i)).collect();
        let froms = [
            "a-0", "a-1", "a-3", "aa-0", "b-0", "b-7", "b-8", "w-2", "w-10", "w-11", "w-262143",
            "w-262144", "w-262145", "w-300001", "zz-0",
        ];
        for from in froms {
            let got: Vec<_> = map.iter_from(&id(from)).map(|(k, v)| (*k, *v)).collect();
            let want: Vec<_> = reference.range(id(from)..).map(|(k, v)| (*k, *v)).collect();
            assert_eq!(got, want, "from {from}");
        }
    }

    #[test]
    fn retain_keeps_what_a_btree_map_would_and_gives_room_back() {
        let keys = [
            "a-0", "a-1", "w-0", "w-1", "w-2", "w-999", "w-262144", "w-300001",
        ];
        let mut map = NodeMap::new();
        let mut reference = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            map.insert(id(k), i);
            reference.insert(id(k), i);
        }
        let keep = |k: &LogicalNodeId, v: &mut usize| {
            *v += 1;
            k.index.is_multiple_of(2) && k.group != GroupId::new("a")
        };
        map.retain(keep);
        reference.retain(keep);
        let got: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
        let want: Vec<_> = reference.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(got, want);
        assert_eq!(map.len(), reference.len());
        assert!(map.group(&GroupId::new("a")).next().is_none());
        assert_eq!(map.groups.len(), 1, "an emptied group goes");
        assert_eq!(
            map.groups[0].dense.len(),
            3,
            "the dense part ends at its last entry"
        );
        map.retain(|_, _| false);
        assert!(map.is_empty() && map.groups.is_empty());
    }

    #[test]
    fn removing_the_last_slots_gives_their_room_back() {
        let mut map = NodeMap::new();
        for i in 0..1000 {
            map.insert(LogicalNodeId::new(GroupId::new("w"), i), i);
        }
        for i in (10..1000).rev() {
            map.remove(&LogicalNodeId::new(GroupId::new("w"), i));
        }
        assert_eq!(map.len(), 10);
        assert!(map.groups[0].dense.capacity() < 100);
        for i in 0..10 {
            map.remove(&LogicalNodeId::new(GroupId::new("w"), i));
        }
        assert!(map.is_empty() && map.groups.is_empty());
    }

    #[test]
    fn it_serializes_as_a_map_and_reads_back_in_slot_order() {
        let mut map = NodeMap::new();
        map.insert(id("w-10"), 10u32);
        map.insert(id("w-1"), 1u32);
        map.insert(id("a-0"), 0u32);
        let reference: BTreeMap<LogicalNodeId, u32> = map.iter().map(|(k, v)| (*k, *v)).collect();
        let text = serde_json::to_string(&map).unwrap();
        assert_eq!(text, serde_json::to_string(&reference).unwrap());
        assert_eq!(text, r#"{"a-0":0,"w-1":1,"w-10":10}"#);
        let back: NodeMap<u32> = serde_json::from_str(&text).unwrap();
        assert!(back == map);
    }

    #[test]
    fn room_reserved_is_not_part_of_equality() {
        let mut reserved = NodeMap::new();
        reserved.reserve(&GroupId::new("w"), 100);
        reserved.reserve(&GroupId::new("a"), 3);
        assert!(reserved == NodeMap::<u32>::new());
        reserved.insert(id("w-1"), 1u32);
        let mut plain = NodeMap::new();
        plain.insert(id("w-1"), 1u32);
        assert!(reserved == plain);
        plain.insert(id("w-2"), 2u32);
        assert!(reserved != plain);
    }

    #[test]
    fn a_slot_of_the_state_is_four_cache_lines() {
        // See `ManagedNode`'s padding: the walk's speed depends on it.
        assert_eq!(
            std::mem::size_of::<Option<Entry<crate::state::ManagedNode>>>(),
            256
        );
    }
}
