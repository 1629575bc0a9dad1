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
pub(crate) struct Entry<V>(LogicalNodeId, V);

// Size budgets, checked when the crate is built: a table entry costs its
// key and value only (the budgets of the values stored in tables sit next
// to their types: `ManagedNode`, `SlotRecord`).
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::size_of;
    assert!(size_of::<LogicalNodeId>() == 16);
    assert!(size_of::<Option<(u64, u64)>>() == 24);
    assert!(size_of::<Option<Entry<(u64, u64)>>>() == 32);
};

/// One group's slots, each holding an `E` (a [`NodeMap`] keeps the key in
/// it, a [`NodeTable`] only the value).
#[derive(Clone)]
struct Group<E> {
    id: GroupId,
    /// Slot `i` at position `i`; `None` for an absent slot. Never ends in `None`.
    dense: Vec<Option<E>>,
    /// Slots at or above [`DENSE_INDEX_MAX`].
    sparse: BTreeMap<u32, E>,
    /// Dense slots the last [`Groups::reserve`] made room for: a trim keeps
    /// that much, so a table filled while entries come and go (as a large
    /// converge does) is not given back its room and grown again by doubling.
    reserved: u32,
}

impl<E> Group<E> {
    fn new(id: GroupId) -> Self {
        Self {
            id,
            dense: Vec::new(),
            sparse: BTreeMap::new(),
            reserved: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.dense.is_empty() && self.sparse.is_empty()
    }

    /// Drops the dense part's trailing empty slots (it never ends in one) and,
    /// once it is a quarter of its room, most of that room (never below
    /// what was reserved).
    fn trim(&mut self) {
        while self.dense.last().is_some_and(Option::is_none) {
            self.dense.pop();
        }
        let keep = (self.dense.len() * 2).max(self.reserved as usize);
        if self.dense.capacity() > 64 && self.dense.capacity() / 4 > keep / 2 {
            self.dense.shrink_to(keep);
        }
    }

    #[inline]
    fn get(&self, index: u32) -> Option<&E> {
        if index < DENSE_INDEX_MAX {
            self.dense.get(index as usize)?.as_ref()
        } else {
            self.sparse.get(&index)
        }
    }

    #[inline]
    fn get_mut(&mut self, index: u32) -> Option<&mut E> {
        if index < DENSE_INDEX_MAX {
            self.dense.get_mut(index as usize)?.as_mut()
        } else {
            self.sparse.get_mut(&index)
        }
    }

    fn put(&mut self, index: u32, e: E) -> Option<E> {
        if index < DENSE_INDEX_MAX {
            let at = index as usize;
            if self.dense.len() <= at {
                self.dense.resize_with(at + 1, || None);
            }
            self.dense[at].replace(e)
        } else {
            self.sparse.insert(index, e)
        }
    }

    fn take(&mut self, index: u32) -> Option<E> {
        if index < DENSE_INDEX_MAX {
            let old = self.dense.get_mut(index as usize)?.take();
            self.trim();
            old
        } else {
            self.sparse.remove(&index)
        }
    }

    /// Every entry with its slot index, in index order.
    fn indexed(&self) -> impl DoubleEndedIterator<Item = (u32, &E)> {
        let dense = self.dense.iter().enumerate();
        dense
            .filter_map(|(i, e)| Some((i as u32, e.as_ref()?)))
            .chain(self.sparse.iter().map(|(i, e)| (*i, e)))
    }
}

/// The groups of a map by slot, sorted by group id, and how many slots hold
/// an entry: what [`NodeMap`] and [`NodeTable`] share.
#[derive(Clone)]
struct Groups<E> {
    /// Sorted by group id. A group is empty only between a
    /// [`Groups::reserve`] and its first insert; removing its last entry
    /// drops it.
    groups: Vec<Group<E>>,
    len: usize,
}

impl<E> Groups<E> {
    const fn new() -> Self {
        Self {
            groups: Vec::new(),
            len: 0,
        }
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

    #[inline]
    fn get(&self, key: &LogicalNodeId) -> Option<&E> {
        self.groups[self.group_pos(&key.group).ok()?].get(key.index)
    }

    #[inline]
    fn get_mut(&mut self, key: &LogicalNodeId) -> Option<&mut E> {
        let i = self.group_pos(&key.group).ok()?;
        self.groups[i].get_mut(key.index)
    }

    /// The group `id`, made (empty) if there is none.
    fn group_or_new(&mut self, id: &GroupId) -> &mut Group<E> {
        let i = match self.group_pos(id) {
            Ok(i) => i,
            Err(i) => {
                self.groups.insert(i, Group::new(*id));
                i
            }
        };
        &mut self.groups[i]
    }

    fn insert(&mut self, key: &LogicalNodeId, e: E) -> Option<E> {
        let old = self.group_or_new(&key.group).put(key.index, e);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    fn reserve(&mut self, group: &GroupId, slots: u32) {
        let g = self.group_or_new(group);
        let want = slots.min(DENSE_INDEX_MAX);
        g.reserved = want;
        g.dense
            .reserve_exact((want as usize).saturating_sub(g.dense.len()));
        // Reserving fewer than before (a smaller shape) gives back the rest.
        g.trim();
    }

    fn remove(&mut self, key: &LogicalNodeId) -> Option<E> {
        let i = self.group_pos(&key.group).ok()?;
        let g = &mut self.groups[i];
        // Nothing taken leaves the group as it is: one only reserved keeps its room.
        let old = g.take(key.index)?;
        self.len -= 1;
        if g.is_empty() {
            self.groups.remove(i);
        }
        Some(old)
    }

    /// Keeps only the entries `keep` accepts (given each one's slot).
    fn retain(&mut self, mut keep: impl FnMut(LogicalNodeId, &mut E) -> bool) {
        let mut removed = 0;
        for g in &mut self.groups {
            let id = g.id;
            for (i, slot) in g.dense.iter_mut().enumerate() {
                if let Some(e) = slot
                    && !keep(LogicalNodeId::new(id, i as u32), e)
                {
                    *slot = None;
                    removed += 1;
                }
            }
            g.trim();
            let before = g.sparse.len();
            g.sparse.retain(|i, e| keep(LogicalNodeId::new(id, *i), e));
            removed += before - g.sparse.len();
        }
        self.len -= removed;
        self.groups.retain(|g| !g.is_empty());
    }

    fn clear(&mut self) {
        self.groups.clear();
        self.len = 0;
    }
}

fn entry_ref<V>(e: &Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)> {
    e.as_ref().map(|Entry(k, v)| (k, v))
}

fn pair_ref<V>(e: &Entry<V>) -> (&LogicalNodeId, &V) {
    (&e.0, &e.1)
}

fn group_iter<V>(g: &Group<Entry<V>>) -> GroupIter<'_, V> {
    g.dense
        .iter()
        .filter_map(entry_ref as fn(&Option<Entry<V>>) -> Option<(&LogicalNodeId, &V)>)
        .chain(
            g.sparse
                .values()
                .map(pair_ref as fn(&Entry<V>) -> (&LogicalNodeId, &V)),
        )
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

/// A map from slot to `V`, ordered like `BTreeMap<LogicalNodeId, V>`, that
/// keeps each slot's key beside its value (so it can lend the key). See the
/// module docs.
#[derive(Clone)]
pub struct NodeMap<V> {
    inner: Groups<Entry<V>>,
}

impl<V> NodeMap<V> {
    /// An empty map.
    pub const fn new() -> Self {
        Self {
            inner: Groups::new(),
        }
    }

    /// The entry of `key`.
    #[inline]
    pub fn get(&self, key: &LogicalNodeId) -> Option<&V> {
        self.inner.get(key).map(|Entry(_, v)| v)
    }

    /// The entry of `key`, to change.
    #[inline]
    pub fn get_mut(&mut self, key: &LogicalNodeId) -> Option<&mut V> {
        self.inner.get_mut(key).map(|Entry(_, v)| v)
    }

    /// Puts `value` at `key`; returns what was there.
    pub fn insert(&mut self, key: LogicalNodeId, value: V) -> Option<V> {
        self.inner
            .insert(&key, Entry(key, value))
            .map(|Entry(_, v)| v)
    }

    /// Makes room for `group`'s slots `0..slots` (dense ones only), so
    /// inserting them does not grow the vector step by step.
    pub fn reserve(&mut self, group: &GroupId, slots: u32) {
        self.inner.reserve(group, slots);
    }

    /// Takes the entry of `key` out.
    pub fn remove(&mut self, key: &LogicalNodeId) -> Option<V> {
        self.inner.remove(key).map(|Entry(_, v)| v)
    }

    /// Keeps only the entries `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&LogicalNodeId, &mut V) -> bool) {
        self.inner.retain(|_, Entry(k, v)| keep(k, v));
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.inner.clear();
    }

    /// Every entry, in slot order (group, then index).
    pub fn iter(&self) -> Iter<'_, V> {
        Iter {
            inner: self.inner.groups.iter().flat_map(group_iter),
            left: self.inner.len,
        }
    }

    /// The entries at `from` and after it, in slot order.
    pub fn iter_from(&self, from: &LogicalNodeId) -> impl Iterator<Item = (&LogicalNodeId, &V)> {
        let (Ok(start) | Err(start)) = self.inner.group_pos(&from.group);
        self.inner.groups[start..].iter().flat_map(move |g| {
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
        self.inner.groups.iter_mut().flat_map(|g| {
            let dense = g
                .dense
                .iter_mut()
                .filter_map(|e| e.as_mut().map(|Entry(k, v)| (&*k, v)));
            dense.chain(g.sparse.values_mut().map(|Entry(k, v)| (&*k, v)))
        })
    }

    /// The entries of one group, in index order.
    pub fn group(&self, id: &GroupId) -> impl DoubleEndedIterator<Item = (&LogicalNodeId, &V)> {
        let g = self.inner.group_pos(id).ok().map(|i| &self.inner.groups[i]);
        g.into_iter().flat_map(group_iter)
    }

    /// Each group (in order) with its entries (in index order): a walk in
    /// slot order without a per-entry step across groups.
    pub fn by_group(&self) -> impl Iterator<Item = (&GroupId, GroupEntries<'_, V>)> {
        self.inner
            .groups
            .iter()
            .map(|g| (&g.id, GroupEntries(group_iter(g))))
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
    std::slice::Iter<'a, Group<Entry<V>>>,
    GroupIter<'a, V>,
    fn(&'a Group<Entry<V>>) -> GroupIter<'a, V>,
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
        let mut out = Vec::with_capacity(self.len());
        for g in self.inner.groups {
            out.extend(g.dense.into_iter().flatten().map(|Entry(k, v)| (k, v)));
            out.extend(g.sparse.into_values().map(|Entry(k, v)| (k, v)));
        }
        out.into_iter()
    }
}

/// What [`NodeMap`] and [`NodeTable`] share besides their storage: they
/// answer alike, built on each one's `new`, `get`, `get_mut`, `insert` and
/// `iter`.
macro_rules! map_by_slot {
    ($map:ident) => {
        impl<V> $map<V> {
            /// How many slots hold an entry.
            pub fn len(&self) -> usize {
                self.inner.len
            }

            /// True when no slot holds an entry.
            pub fn is_empty(&self) -> bool {
                self.inner.len == 0
            }

            /// True when `key` holds an entry.
            #[inline]
            pub fn contains_key(&self, key: &LogicalNodeId) -> bool {
                self.get(key).is_some()
            }

            /// The entry of `key`, made by `f` first if there is none.
            pub fn get_or_insert_with(
                &mut self,
                key: &LogicalNodeId,
                f: impl FnOnce() -> V,
            ) -> &mut V {
                if !self.contains_key(key) {
                    self.insert(*key, f());
                }
                self.get_mut(key).expect("just inserted")
            }
        }

        /// Equal when they hold the same entries (room reserved is not compared).
        impl<V: PartialEq> PartialEq for $map<V> {
            fn eq(&self, other: &Self) -> bool {
                self.len() == other.len() && self.iter().eq(other.iter())
            }
        }

        impl<V> Default for $map<V> {
            fn default() -> Self {
                Self::new()
            }
        }

        impl<V> FromIterator<(LogicalNodeId, V)> for $map<V> {
            fn from_iter<I: IntoIterator<Item = (LogicalNodeId, V)>>(iter: I) -> Self {
                let mut map = Self::new();
                map.extend(iter);
                map
            }
        }

        impl<V> Extend<(LogicalNodeId, V)> for $map<V> {
            fn extend<I: IntoIterator<Item = (LogicalNodeId, V)>>(&mut self, iter: I) {
                for (k, v) in iter {
                    self.insert(k, v);
                }
            }
        }

        impl<V> std::ops::Index<&LogicalNodeId> for $map<V> {
            type Output = V;

            fn index(&self, key: &LogicalNodeId) -> &V {
                self.get(key).expect("no entry for this slot")
            }
        }

        impl<V: fmt::Debug> fmt::Debug for $map<V> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_map().entries(self.iter()).finish()
            }
        }

        impl<V: Serialize> Serialize for $map<V> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut map = s.serialize_map(Some(self.len()))?;
                for (k, v) in self.iter() {
                    map.serialize_entry(&k, v)?;
                }
                map.end()
            }
        }

        impl<'de, V: Deserialize<'de>> Deserialize<'de> for $map<V> {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_map(MapVisitor::<(Self, V)>(PhantomData))
            }
        }
    };
}

map_by_slot!(NodeMap);
map_by_slot!(NodeTable);

/// Reads a map from node id to value into any map by slot `M`.
struct MapVisitor<M>(PhantomData<M>);

impl<'de, V: Deserialize<'de>, M: Default + Extend<(LogicalNodeId, V)>> Visitor<'de>
    for MapVisitor<(M, V)>
{
    type Value = M;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map from node id to value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        let mut map = M::default();
        while let Some(entry) = a.next_entry::<LogicalNodeId, V>()? {
            map.extend(Some(entry));
        }
        Ok(map)
    }
}

/// A map from slot to `V` like [`NodeMap`] (the same order, look-ups,
/// serialization and bounded dense part) that keeps only the values: a
/// slot's key is made from its group and its place when iterating, so each
/// entry is 16 bytes smaller. For the host's and the driver's own tables,
/// which are never walked with borrowed keys.
#[derive(Clone)]
pub struct NodeTable<V> {
    inner: Groups<V>,
}

impl<V> NodeTable<V> {
    /// An empty table.
    pub const fn new() -> Self {
        Self {
            inner: Groups::new(),
        }
    }

    /// The entry of `key`.
    #[inline]
    pub fn get(&self, key: &LogicalNodeId) -> Option<&V> {
        self.inner.get(key)
    }

    /// The entry of `key`, to change.
    #[inline]
    pub fn get_mut(&mut self, key: &LogicalNodeId) -> Option<&mut V> {
        self.inner.get_mut(key)
    }

    /// Puts `value` at `key`; returns what was there.
    pub fn insert(&mut self, key: LogicalNodeId, value: V) -> Option<V> {
        self.inner.insert(&key, value)
    }

    /// Makes room for `group`'s slots `0..slots` (dense ones only).
    pub fn reserve(&mut self, group: &GroupId, slots: u32) {
        self.inner.reserve(group, slots);
    }

    /// Takes the entry of `key` out.
    pub fn remove(&mut self, key: &LogicalNodeId) -> Option<V> {
        self.inner.remove(key)
    }

    /// Keeps only the entries `keep` accepts.
    pub fn retain(&mut self, keep: impl FnMut(LogicalNodeId, &mut V) -> bool) {
        self.inner.retain(keep);
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.inner.clear();
    }

    /// Every entry, in slot order (group, then index), with its key made.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (LogicalNodeId, &V)> {
        self.inner
            .groups
            .iter()
            .flat_map(|g| g.indexed().map(|(i, v)| (LogicalNodeId::new(g.id, i), v)))
    }

    /// Every key, in slot order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = LogicalNodeId> {
        self.iter().map(|(k, _)| k)
    }

    /// Every value, in slot order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> {
        self.inner
            .groups
            .iter()
            .flat_map(|g| g.indexed().map(|(_, v)| v))
    }
}

impl<V> IntoIterator for NodeTable<V> {
    type Item = (LogicalNodeId, V);
    type IntoIter = std::vec::IntoIter<(LogicalNodeId, V)>;

    fn into_iter(self) -> Self::IntoIter {
        let mut out = Vec::with_capacity(self.len());
        for g in self.inner.groups {
            let id = g.id;
            let dense = g.dense.into_iter().enumerate();
            out.extend(dense.filter_map(|(i, v)| Some((LogicalNodeId::new(id, i as u32), v?))));
            out.extend(
                g.sparse
                    .into_iter()
                    .map(|(i, v)| (LogicalNodeId::new(id, i), v)),
            );
        }
        out.into_iter()
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
        assert_eq!(map.inner.groups.len(), 1, "an emptied group goes");
        assert_eq!(
            map.inner.groups[0].dense.len(),
            3,
            "the dense part ends at its last entry"
        );
        map.retain(|_, _| false);
        assert!(map.is_empty() && map.inner.groups.is_empty());
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
        assert!(map.inner.groups[0].dense.capacity() < 100);
        for i in 0..10 {
            map.remove(&LogicalNodeId::new(GroupId::new("w"), i));
        }
        assert!(map.is_empty() && map.inner.groups.is_empty());
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
    fn removing_an_absent_slot_keeps_room_reserved() {
        let w = GroupId::new("w");
        let mut map = NodeMap::<u32>::new();
        map.reserve(&w, 1000);
        assert_eq!(map.remove(&id("w-5")), None);
        map.insert(id("w-0"), 0);
        assert!(map.inner.groups[0].dense.capacity() >= 1000);
        let mut table = NodeTable::<u32>::new();
        table.reserve(&w, 1000);
        assert_eq!(table.remove(&id("w-5")), None);
        assert_eq!(table.remove(&id("w-300000")), None);
        table.insert(id("w-0"), 0);
        assert!(table.inner.groups[0].dense.capacity() >= 1000);
    }

    #[test]
    fn removals_keep_room_reserved_until_a_smaller_reserve() {
        let w = GroupId::new("w");
        let mut table = NodeTable::<u32>::new();
        table.reserve(&w, 4000);
        for i in 0..10 {
            table.insert(LogicalNodeId::new(w, i), i);
        }
        for i in 5..10 {
            table.remove(&LogicalNodeId::new(w, i));
        }
        let room = table.inner.groups[0].dense.capacity();
        assert!(
            room >= 4000,
            "a few entries of a reserved table keep its room ({room})"
        );
        table.reserve(&w, 100);
        let room = table.inner.groups[0].dense.capacity();
        assert!(
            (100..4000).contains(&room),
            "a smaller reserve gives room back ({room})"
        );
        let mut unreserved = NodeTable::<u32>::new();
        for i in 0..4000 {
            unreserved.insert(LogicalNodeId::new(w, i), i);
        }
        for i in 10..4000 {
            unreserved.remove(&LogicalNodeId::new(w, i));
        }
        assert!(unreserved.inner.groups[0].dense.capacity() < 100);
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
    fn a_table_answers_like_a_map_that_keeps_its_keys() {
        // Inserts, replaces, removes and retains across dense and sparse
        // slots of three groups, checked after every step.
        let mut table = NodeTable::new();
        let mut reference = BTreeMap::new();
        let mut x: u64 = 7;
        for step in 0..4000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let group = ["a", "w", "zz"][(x >> 60) as usize % 3];
            let index = match (x >> 40) % 4 {
                0 => DENSE_INDEX_MAX + (x >> 20) as u32 % 8,
                _ => (x >> 20) as u32 % 64,
            };
            let key = LogicalNodeId::new(GroupId::new(group), index);
            match (x >> 33) % 5 {
                0..=2 => assert_eq!(table.insert(key, step), reference.insert(key, step)),
                3 => assert_eq!(table.remove(&key), reference.remove(&key)),
                _ => {
                    let keep = |k: LogicalNodeId, v: &mut u32| {
                        *v += 1;
                        (k.index ^ *v).is_multiple_of(3)
                    };
                    table.retain(keep);
                    reference.retain(|k, v| keep(*k, v));
                }
            }
            assert_eq!(table.len(), reference.len());
            assert_eq!(table.get(&key), reference.get(&key));
            if step % 97 == 0 {
                let got: Vec<_> = table.iter().map(|(k, v)| (k, *v)).collect();
                let want: Vec<_> = reference.iter().map(|(k, v)| (*k, *v)).collect();
                assert_eq!(got, want);
                let back: Vec<_> = table.keys().rev().collect();
                assert_eq!(back, reference.keys().rev().copied().collect::<Vec<_>>());
                let text = serde_json::to_string(&table).unwrap();
                assert_eq!(text, serde_json::to_string(&reference).unwrap());
                let read: NodeTable<u32> = serde_json::from_str(&text).unwrap();
                assert!(read == table);
                let owned: Vec<_> = table.clone().into_iter().collect();
                assert_eq!(owned, want);
            }
        }
        assert!(
            table.inner.groups.iter().all(|g| !g.is_empty()),
            "an emptied group goes"
        );
    }
}
