//! A compact hash table: keys and their state stored densely, found through an index of
//! 4-byte slots.
//!
//! ```text
//! index:   [ 0 | tag·idx | 0 | tag·idx | tag·idx | 0 | … ]   u32 per slot, linear probing
//!                  │              │         │
//! entries: [ (key, state) (key, state) (key, state) … ]      dense, in insertion order
//! ```
//!
//! An index slot holds 0 (empty) or an 8-bit tag from the key's hash with the entry's
//! position plus one in the low 24 bits. A lookup probes from the key's home slot and
//! compares keys only where the tag matches (1 in 256 false candidates). The index grows
//! by 1.3× when it passes 85% load, and its size need not be a power of two (the home slot
//! is the hash's top 32 bits scaled to the size), so it averages about 75% full: for `u64`
//! keys a key costs its 16-byte entry plus about 5.3 bytes of index. Entries are dense, so
//! a `Vec`'s spare capacity is never touched and costs no resident memory, and they can be
//! visited by position, which the eviction hand and the sampling need.
//!
//! Removal swaps the last entry into the hole and repairs the index by backward shifting,
//! so there are no tombstones. Hashes are not stored: they are recomputed from the key
//! when an entry moves or the index grows.

/// The most entries one table holds: the index keeps positions in 24 bits.
pub(crate) const MAX_ENTRIES: usize = (1 << 24) - 1;

const POSITION_BITS: u32 = 24;
const POSITION_MASK: u32 = (1 << POSITION_BITS) - 1;
/// Grow the index when `len / capacity` would pass `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 17;
const MAX_LOAD_DEN: usize = 20;
const MIN_CAPACITY: usize = 8;

/// The parts of a hash the table uses, laid out as the word store's
/// ([`for_table`](super::hash::for_table)): the top 32 bits the home slot, bits 16‥24
/// the tag (the low bits picked the shard).
fn tag(hash: u64) -> u32 {
    u32::from((hash >> 16) as u8)
}

fn home(hash: u64, capacity: usize) -> usize {
    (((hash >> 32) * capacity as u64) >> 32) as usize
}

fn encode(hash: u64, position: usize) -> u32 {
    (tag(hash) << POSITION_BITS) | (position as u32 + 1)
}

fn position(slot: u32) -> usize {
    (slot & POSITION_MASK) as usize - 1
}

/// A key with its state, the key first: a state whose hot words lead it (the synced cell)
/// shares the key's cache line.
#[repr(C)]
pub(crate) struct Entry<K, S> {
    pub(crate) key: K,
    pub(crate) state: S,
}

/// Dense entries with a compact linear-probing index.
pub(crate) struct Table<K, S> {
    entries: Vec<Entry<K, S>>,
    index: Box<[u32]>,
    /// The entries reserved when the table was made ([`with_room`](Self::with_room)),
    /// which no shrink goes below; 0 for none.
    floor: usize,
}

/// The index that holds `entries` entries and one more within the load limit.
fn index_for(entries: usize) -> usize {
    entries
        .saturating_add(1)
        .saturating_mul(MAX_LOAD_DEN)
        .div_ceil(MAX_LOAD_NUM)
        .max(MIN_CAPACITY)
}

impl<K: Eq, S> Table<K, S> {
    pub(crate) fn new() -> Self {
        Self {
            entries: Vec::new(),
            index: Box::new([]),
            floor: 0,
        }
    }

    /// A table with room for `entries` entries (at most [`MAX_ENTRIES`]) made now: up to
    /// that many, inserts neither grow the index nor reallocate the entries, and
    /// removals never shrink it below.
    pub(crate) fn with_room(entries: usize) -> Self {
        let entries = entries.min(MAX_ENTRIES);
        if entries == 0 {
            return Self::new();
        }
        Self {
            entries: Vec::with_capacity(entries),
            index: vec![0; index_for(entries)].into_boxed_slice(),
            floor: entries,
        }
    }

    /// The bytes [`with_room`](Self::with_room) takes for `entries` entries.
    pub(crate) fn bytes_for(entries: usize) -> Option<usize> {
        entries
            .checked_mul(std::mem::size_of::<Entry<K, S>>())?
            .checked_add(index_for(entries).checked_mul(std::mem::size_of::<u32>())?)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The entry at `position` (`< len`).
    pub(crate) fn entry(&self, position: usize) -> &Entry<K, S> {
        &self.entries[position]
    }

    /// Iterates over all entries.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Entry<K, S>> {
        self.entries.iter()
    }

    /// The index slot and entry position of the key matching `eq`, if stored.
    #[inline]
    fn locate(&self, hash: u64, mut eq: impl FnMut(&K) -> bool) -> Option<(usize, usize)> {
        let capacity = self.index.len();
        if capacity == 0 {
            return None;
        }
        let tag = tag(hash);
        let mut slot = home(hash, capacity);
        loop {
            let value = self.index[slot];
            if value == 0 {
                return None;
            }
            if value >> POSITION_BITS == tag {
                let at = position(value);
                if eq(&self.entries[at].key) {
                    return Some((slot, at));
                }
            }
            slot += 1;
            if slot == capacity {
                slot = 0;
            }
        }
    }

    /// The entry whose key matches `eq`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&K) -> bool) -> Option<&Entry<K, S>> {
        self.locate(hash, eq).map(|(_, at)| &self.entries[at])
    }

    /// Inserts an entry whose key is known to be absent, growing the index first if
    /// needed. `rehash` recomputes a stored key's hash. Returns the new entry, or gives
    /// the entry back when the table already holds [`MAX_ENTRIES`].
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        entry: Entry<K, S>,
        rehash: impl Fn(&K) -> u64,
    ) -> Result<&Entry<K, S>, Entry<K, S>> {
        if self.entries.len() >= MAX_ENTRIES {
            return Err(entry);
        }
        if (self.entries.len() + 1) * MAX_LOAD_DEN > self.index.len() * MAX_LOAD_NUM {
            self.grow(&rehash);
        }
        let at = self.entries.len();
        self.entries.push(entry);
        self.place(encode(hash, at), hash);
        Ok(&self.entries[at])
    }

    /// Writes `value` into the first empty slot from `hash`'s home.
    fn place(&mut self, value: u32, hash: u64) {
        let capacity = self.index.len();
        let mut slot = home(hash, capacity);
        while self.index[slot] != 0 {
            slot += 1;
            if slot == capacity {
                slot = 0;
            }
        }
        self.index[slot] = value;
    }

    /// Whether the next insert grows the index.
    pub(crate) fn is_full(&self) -> bool {
        (self.entries.len() + 1) * MAX_LOAD_DEN > self.index.len() * MAX_LOAD_NUM
    }

    /// Grows the index now if the entries fill more than `num / den` of it.
    pub(crate) fn grow_if_above(&mut self, num: usize, den: usize, rehash: impl Fn(&K) -> u64) {
        if self.entries.len() * den > self.index.len() * num {
            self.grow(&rehash);
        }
    }

    fn grow(&mut self, rehash: &impl Fn(&K) -> u64) {
        self.rebuild((self.index.len() * 13 / 10).max(MIN_CAPACITY), rehash);
    }

    /// Replaces the index with one of `capacity` slots, placing every entry again.
    fn rebuild(&mut self, capacity: usize, rehash: &impl Fn(&K) -> u64) {
        self.index = vec![0; capacity].into_boxed_slice();
        for at in 0..self.entries.len() {
            let hash = rehash(&self.entries[at].key);
            self.place(encode(hash, at), hash);
        }
    }

    /// Removes the entry whose key matches `eq`; returns it.
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        eq: impl FnMut(&K) -> bool,
        rehash: impl Fn(&K) -> u64,
    ) -> Option<Entry<K, S>> {
        let (slot, at) = self.locate(hash, eq)?;
        Some(self.remove_at(slot, at, &rehash))
    }

    /// Removes the entry at `position` (`< len`); returns it.
    pub(crate) fn remove_position(&mut self, at: usize, rehash: impl Fn(&K) -> u64) -> Entry<K, S> {
        let hash = rehash(&self.entries[at].key);
        let slot = self.slot_of(hash, at);
        self.remove_at(slot, at, &rehash)
    }

    /// The index slot that points at entry `at`, whose key hashes to `hash`.
    fn slot_of(&self, hash: u64, at: usize) -> usize {
        let capacity = self.index.len();
        let wanted = encode(hash, at);
        let mut slot = home(hash, capacity);
        while self.index[slot] != wanted {
            slot += 1;
            if slot == capacity {
                slot = 0;
            }
        }
        slot
    }

    fn remove_at(&mut self, slot: usize, at: usize, rehash: &impl Fn(&K) -> u64) -> Entry<K, S> {
        self.clear_slot(slot, rehash);
        let last = self.entries.len() - 1;
        if at != last {
            // The last entry moves into the hole: point its slot at the new position.
            let hash = rehash(&self.entries[last].key);
            let moved = self.slot_of(hash, last);
            self.index[moved] = encode(hash, at);
        }
        let entry = self.entries.swap_remove(at);
        self.shrink_if_sparse(rehash);
        entry
    }

    /// After a removal, gives memory back once the table is a quarter full: the entries'
    /// spare capacity, and an index rebuilt at twice the entries (amortised: a table
    /// shrinks at most once per halving).
    fn shrink_if_sparse(&mut self, rehash: &impl Fn(&K) -> u64) {
        let len = self.entries.len();
        let floor = self.floor.max(MIN_CAPACITY);
        if self.entries.capacity() > floor && len * 4 < self.entries.capacity() {
            self.entries.shrink_to((len * 2).max(floor));
        }
        let index_floor = if self.floor == 0 {
            MIN_CAPACITY
        } else {
            index_for(self.floor)
        };
        if self.index.len() > index_floor && len * 4 < self.index.len() {
            self.rebuild((len * 2).max(index_floor), rehash);
        }
    }

    /// Empties `hole` and shifts back the slots after it whose probe passed through it,
    /// so that every lookup still finds its entry without tombstones.
    fn clear_slot(&mut self, mut hole: usize, rehash: &impl Fn(&K) -> u64) {
        let capacity = self.index.len();
        let mut slot = hole;
        loop {
            slot += 1;
            if slot == capacity {
                slot = 0;
            }
            let value = self.index[slot];
            if value == 0 {
                break;
            }
            let home = home(rehash(&self.entries[position(value)].key), capacity);
            // The entry may move back to the hole iff its home is not in (hole, slot],
            // cyclically.
            let home_after_hole = if hole <= slot {
                hole < home && home <= slot
            } else {
                hole < home || home <= slot
            };
            if !home_after_hole {
                self.index[hole] = value;
                hole = slot;
            }
        }
        self.index[hole] = 0;
    }

    /// The entries' capacity (for tests of shrinking).
    #[cfg(test)]
    fn entries_capacity(&self) -> usize {
        self.entries.capacity()
    }

    /// Bytes of index per entry stored (for tests of the load factor).
    #[cfg(test)]
    fn index_len(&self) -> usize {
        self.index.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn h(key: &u64) -> u64 {
        ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(key)
    }

    /// A table made with room for 1,000 entries takes them without growing its index or
    /// its entries, and keeps both when they all go; a table made empty grows, then
    /// shrinks.
    #[test]
    fn room_made_ahead_is_neither_grown_nor_shrunk_by_its_entries() {
        for room in [0, 1_000] {
            let mut table: Table<u64, u64> = Table::with_room(room);
            let (index, entries) = (table.index_len(), table.entries_capacity());
            for key in 0..1_000 {
                assert!(table.insert(h(&key), Entry { key, state: 0 }, h).is_ok());
            }
            let full = (table.index_len(), table.entries_capacity());
            for key in 0..1_000 {
                assert!(table.remove(h(&key), |k| *k == key, h).is_some());
            }
            let emptied = (table.index_len(), table.entries_capacity());
            if room == 0 {
                assert!(full.0 > index && full.1 > entries);
                assert!(emptied.0 < full.0 && emptied.1 < full.1);
            } else {
                assert_eq!(full, (index, entries), "grew with the room made ahead");
                assert_eq!(
                    emptied,
                    (index, entries),
                    "shrank below the room made ahead"
                );
            }
        }
    }

    #[test]
    fn matches_a_hashmap_through_random_inserts_and_removals() {
        let mut table: Table<u64, u64> = Table::new();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 5_000;
            match x % 3 {
                0 | 1 => {
                    if table.find(h(&key), |k| *k == key).is_none() {
                        assert!(table.insert(h(&key), Entry { key, state: step }, h).is_ok());
                        model.insert(key, step);
                    }
                }
                _ => {
                    let removed = table.remove(h(&key), |k| *k == key, h).map(|e| e.state);
                    assert_eq!(removed, model.remove(&key), "step {step}");
                }
            }
            if step % 1_000 == 0 {
                assert_eq!(table.len(), model.len());
                for (k, v) in &model {
                    assert_eq!(
                        table.find(h(k), |x| x == k).map(|e| e.state),
                        Some(*v),
                        "step {step}"
                    );
                }
            }
        }
        // Remove by position too, down to empty.
        while table.len() > 0 {
            let key = table.entry(0).key;
            let e = table.remove_position(0, h);
            assert_eq!(Some(e.state), model.remove(&key));
            assert!(table.find(h(&key), |k| *k == key).is_none());
        }
        assert!(model.is_empty());
    }

    #[test]
    fn the_index_stays_between_65_and_85_percent_full() {
        let mut table: Table<u64, ()> = Table::new();
        for key in 0..100_000u64 {
            table
                .insert(h(&key), Entry { key, state: () }, h)
                .ok()
                .unwrap();
            if key > 1_000 {
                let load = table.len() as f64 / table.index_len() as f64;
                assert!((0.64..=0.85).contains(&load), "load {load} at {key}");
            }
        }
    }

    #[test]
    fn a_table_emptied_after_a_flood_gives_its_memory_back() {
        let mut table: Table<u64, u64> = Table::new();
        for k in 0..100_000u64 {
            let _ = table.insert(h(&k), Entry { key: k, state: k }, h);
        }
        let full = (table.entries_capacity(), table.index_len());
        for k in 0..99_990u64 {
            assert!(table.remove(h(&k), |x| *x == k, h).is_some());
        }
        assert!(
            table.entries_capacity() <= 64,
            "{} of {full:?}",
            table.entries_capacity()
        );
        assert!(table.index_len() <= 64, "{} of {full:?}", table.index_len());
        // What is left is still found.
        for k in 99_990..100_000u64 {
            assert_eq!(table.find(h(&k), |x| *x == k).map(|e| e.state), Some(k));
        }
    }

    #[test]
    fn colliding_home_slots_wrap_around_the_end() {
        // Every key hashes to the last slot: probes wrap, and removal shifts correctly.
        let h = |k: &u64| (0xffff_ffff << 32) | (*k << 16);
        let mut table: Table<u64, ()> = Table::new();
        for key in 0..6 {
            table
                .insert(h(&key), Entry { key, state: () }, h)
                .ok()
                .unwrap();
        }
        for key in [0, 3, 5] {
            assert!(table.remove(h(&key), |k| *k == key, h).is_some());
        }
        for key in [1, 2, 4] {
            assert!(table.find(h(&key), |k| *k == key).is_some(), "{key}");
        }
        for key in [0, 3, 5] {
            assert!(table.find(h(&key), |k| *k == key).is_none(), "{key}");
        }
    }
}
