//! The sharded map that holds one packed state word per key.
//!
//! Keys are spread over a power-of-two number of shards, each a cache-padded
//! [`parking_lot::RwLock`] around a [`hashbrown::HashTable`]. A key is hashed once, with
//! ahash: the hash picks the shard from the bits just below the top seven (hashbrown uses
//! the top seven as its control tags and the low bits as the bucket index, so neither is
//! narrowed by sharding) and is reused for the probe.
//!
//! An existing key is served under its shard's read lock, and its state changes by CAS on
//! an [`AtomicU64`], so checks on different keys of one shard run in parallel. Only a new
//! key takes the write lock.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::RwLock;

use crate::algorithm::UNTOUCHED;

/// One key and its packed state.
struct Slot<K> {
    key: K,
    state: AtomicU64,
}

/// One shard: a lock around a table of slots.
type Shard<K> = RwLock<HashTable<Slot<K>>>;

/// What [`Store::access`] found.
pub(crate) enum Access<R> {
    /// The key was found or inserted, and the closure ran on its state.
    Done(R),
    /// The key was new, the store was at `max_keys`, and no key in its shard could be
    /// dropped without changing a decision. The first such key becomes droppable after
    /// this many nanoseconds.
    Full { retry_after_ns: u64 },
}

/// A sharded, capped map from keys to atomic state words.
pub(crate) struct Store<K> {
    shards: Box<[CachePadded<Shard<K>>]>,
    hasher: ahash::RandomState,
    /// `log2(shards.len())`.
    shard_bits: u32,
    len: CachePadded<AtomicUsize>,
    max_keys: usize,
    evicted: AtomicU64,
}

impl<K: Hash + Eq> Store<K> {
    /// A store of `shards` shards (a power of two) holding at most `max_keys` keys.
    pub(crate) fn new(shards: usize, max_keys: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        Self {
            shards: (0..shards)
                .map(|_| CachePadded::new(RwLock::new(HashTable::new())))
                .collect(),
            hasher: ahash::RandomState::new(),
            shard_bits: shards.trailing_zeros(),
            len: CachePadded::new(AtomicUsize::new(0)),
            max_keys,
            evicted: AtomicU64::new(0),
        }
    }

    fn locate<Q>(&self, key: &Q) -> (u64, &Shard<K>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let index = if self.shard_bits == 0 {
            0
        } else {
            ((hash << 7) >> (u64::BITS - self.shard_bits)) as usize
        };
        (hash, &self.shards[index])
    }

    /// The state of `key`, or `None` if it is not stored.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn get<Q>(&self, key: &Q) -> Option<u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        let table = shard.read();
        table
            .find(hash, |slot| slot.key.borrow() == key)
            .map(|slot| slot.state.load(Ordering::Acquire))
    }

    /// Runs `update` on the state of `key`, inserting the key (as [`UNTOUCHED`]) first if it
    /// is new. When the store is full, the key's shard is swept of the keys for which
    /// `reset_after(state)` is zero (they carry no information); if none is, the key is not
    /// inserted and [`Access::Full`] says when the first one will be.
    ///
    /// Takes the shard's read lock for an existing key, its write lock for a new one.
    #[inline]
    pub(crate) fn access<Q, R>(
        &self,
        key: &Q,
        reset_after: impl Fn(u64) -> u64,
        update: impl FnOnce(&AtomicU64) -> R,
    ) -> Access<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        {
            let table = shard.read();
            if let Some(slot) = table.find(hash, |slot| slot.key.borrow() == key) {
                return Access::Done(update(&slot.state));
            }
        }
        let mut table = shard.write();
        if let Some(slot) = table.find(hash, |slot| slot.key.borrow() == key) {
            return Access::Done(update(&slot.state));
        }
        if !self.reserve() {
            let mut soonest = u64::MAX;
            let before = table.len();
            table.retain(|slot| {
                let wait = reset_after(slot.state.load(Ordering::Acquire));
                soonest = soonest.min(wait);
                wait > 0
            });
            self.forget(before - table.len());
            if !self.reserve() {
                return Access::Full {
                    retry_after_ns: soonest.max(1),
                };
            }
        }
        let slot = Slot {
            key: key.to_owned(),
            state: AtomicU64::new(UNTOUCHED),
        };
        let hasher = &self.hasher;
        let entry = table.insert_unique(hash, slot, |slot| hasher.hash_one(&slot.key));
        Access::Done(update(&entry.get().state))
    }

    /// Takes a place for a new key; false when the store is full.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Records that `removed` keys were evicted.
    fn forget(&self, removed: usize) {
        if removed > 0 {
            self.len.fetch_sub(removed, Ordering::AcqRel);
            self.evicted.fetch_add(removed as u64, Ordering::Relaxed);
        }
    }

    /// Removes `key`; true if it was stored.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn remove<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        let mut table = shard.write();
        match table.find_entry(hash, |slot| slot.key.borrow() == key) {
            Ok(entry) => {
                entry.remove();
                self.len.fetch_sub(1, Ordering::AcqRel);
                true
            }
            Err(_) => false,
        }
    }

    /// How many keys are stored.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// How many keys were dropped to make room since the store was made.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// The number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insert(store: &Store<String>, key: &str, state: u64) -> bool {
        matches!(
            store.access(key, |s| s, |a| a.store(state, Ordering::Release)),
            Access::Done(())
        )
    }

    #[test]
    fn borrowed_lookups_find_owned_keys() {
        let store: Store<String> = Store::new(4, usize::MAX);
        assert!(insert(&store, "a", 7));
        assert_eq!(store.get("a"), Some(7));
        assert_eq!(store.get("b"), None);
        assert_eq!(store.len(), 1);
        assert!(store.remove("a"));
        assert!(!store.remove("a"));
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn a_full_store_evicts_only_untouched_keys_and_says_when_to_retry() {
        // One shard, so the sweep sees every key.
        let store: Store<String> = Store::new(1, 2);
        assert!(insert(&store, "busy", 30));
        assert!(insert(&store, "idle", 0));
        // Full: "idle" (reset_after 0) is swept to make room.
        assert!(insert(&store, "new", 50));
        assert_eq!((store.len(), store.evicted()), (2, 1));
        assert_eq!(store.get("idle"), None);
        // Full again with no idle key: refused, retry when "busy" resets.
        match store.access("other", |s| s, |_| ()) {
            Access::Full { retry_after_ns } => assert_eq!(retry_after_ns, 30),
            Access::Done(()) => panic!("inserted past max_keys"),
        }
        assert_eq!(store.get("busy"), Some(30));
        assert_eq!(store.len(), 2);
    }
}
