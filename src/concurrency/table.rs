//! The concurrency limiter's keys: a sharded map from each key to its [`Slot`], the
//! maxima set per key, and the sweep that drops keys with nothing in flight.
//!
//! Each shard is a `hashbrown` table behind a `parking_lot` read-write lock. An acquire
//! on a key the map holds takes the read lock, finds the slot, takes its slots with one
//! CAS and clones its `Arc` (for the permit) before unlocking; only a new key takes the
//! write lock. A sweep also takes the write lock, so it never sees a slot between an
//! acquirer's lookup and its CAS, and drops a slot only when nothing is held on it and
//! nobody waits (and no permit or waiter holds its `Arc`).
//!
//! A key with nothing in flight is dropped by a sweep of its shard, if it was not used
//! since the sweep before (a second chance: keys between requests stay, so a key in use
//! is not dropped and re-inserted over and over). An insert sweeps a shard once it holds
//! twice the keys it held after its last sweep (and at least [`SWEEP_FLOOR`]), so a shard
//! holds about twice the keys used within its last two sweeps at most, and the sweeps
//! cost O(1) per insert, amortised. At the key cap an insert drops every idle key,
//! touched or not, and is refused only if every key held is in use.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::{Mutex, RwLock};

use super::slot::{Refusal, Slot};
use crate::store::Sharding;

/// A shard is swept when it holds this many keys, at the least.
const SWEEP_FLOOR: usize = 64;

/// One shard: its keys and their slots.
struct Shard<K> {
    table: HashTable<(K, Arc<Slot>)>,
    /// Keys held after the last sweep (or [`SWEEP_FLOOR`]).
    swept_at: usize,
}

/// The keys and their maxima.
pub(crate) struct Keys<K> {
    shards: Box<[CachePadded<RwLock<Shard<K>>>]>,
    sharding: Sharding,
    /// The maximum of a key that has none of its own.
    default_max: AtomicU32,
    /// The keys' own maxima.
    overrides: RwLock<hashbrown::HashMap<K, u32, ahash::RandomState>>,
    keys: AtomicUsize,
    max_keys: usize,
    /// Serialises changes of maxima, so that each ends with every key's maximum right.
    /// Taken before any other lock, and never by an acquire.
    reconfigure: Mutex<()>,
}

/// Why a key's slots could not be taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    Slot(Refusal),
    /// A new key, and every key held (at the cap) has something in flight.
    NoRoom {
        max_keys: usize,
    },
}

impl<K: Hash + Eq + Send + Sync + 'static> Keys<K> {
    pub(crate) fn new(shards: usize, default_max: u32, max_keys: usize) -> Self {
        Self {
            shards: (0..shards)
                .map(|_| {
                    CachePadded::new(RwLock::new(Shard {
                        table: HashTable::new(),
                        swept_at: SWEEP_FLOOR,
                    }))
                })
                .collect(),
            sharding: Sharding::new(shards),
            default_max: AtomicU32::new(default_max),
            overrides: RwLock::new(hashbrown::HashMap::default()),
            keys: AtomicUsize::new(0),
            max_keys,
            reconfigure: Mutex::new(()),
        }
    }

    fn shard(&self, hash: u64) -> &RwLock<Shard<K>> {
        &self.shards[Sharding::shard(hash, self.shards.len())]
    }

    /// Takes `weight` slots of `key`, inserting the key if it is new, and returns its
    /// slot (to be released through).
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard; its write lock for a new key.
    #[inline(always)]
    pub(crate) fn take<Q>(&self, key: &Q, weight: u32) -> Result<Arc<Slot>, Refused>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.sharding.hash(key);
        {
            let shard = self.shard(hash).read();
            if let Some((_, slot)) = shard.table.find(hash, |(k, _)| k.borrow() == key) {
                slot.try_take(weight).map_err(Refused::Slot)?;
                return Ok(Arc::clone(slot));
            }
        }
        self.insert_and_take(hash, key, weight)
    }

    /// The slot of `key`, inserting the key if it is new (for a caller about to wait in
    /// its line).
    pub(crate) fn slot<Q>(&self, key: &Q) -> Result<Arc<Slot>, Refused>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.sharding.hash(key);
        if let Some(slot) = self.find(hash, key) {
            return Ok(slot);
        }
        self.or_sweep_all(|| {
            let mut shard = self.shard(hash).write();
            if let Some((_, slot)) = shard.table.find(hash, |(k, _)| k.borrow() == key) {
                return Ok(Arc::clone(slot));
            }
            self.insert_locked(&mut shard, hash, key)
        })
    }

    /// Runs `insert`; if it finds no room, sweeps every shard (with no lock held) and
    /// runs it once more.
    fn or_sweep_all<T>(&self, insert: impl Fn() -> Result<T, Refused>) -> Result<T, Refused> {
        match insert() {
            Err(Refused::NoRoom { .. }) => {
                self.sweep();
                insert()
            }
            other => other,
        }
    }

    fn find<Q>(&self, hash: u64, key: &Q) -> Option<Arc<Slot>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let shard = self.shard(hash).read();
        shard
            .table
            .find(hash, |(k, _)| k.borrow() == key)
            .map(|(_, slot)| Arc::clone(slot))
    }

    #[cold]
    #[inline(never)]
    fn insert_and_take<Q>(&self, hash: u64, key: &Q, weight: u32) -> Result<Arc<Slot>, Refused>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.or_sweep_all(|| {
            let mut shard = self.shard(hash).write();
            let slot = match shard.table.find(hash, |(k, _)| k.borrow() == key) {
                Some((_, slot)) => Arc::clone(slot),
                None => {
                    // A weight that can never fit inserts nothing.
                    let max = self.max_for(key);
                    if weight > max {
                        return Err(Refused::Slot(Refusal::NeverFits { max }));
                    }
                    self.insert_locked(&mut shard, hash, key)?
                }
            };
            // Under the write lock, so no sweep drops it before it is taken.
            slot.try_take(weight).map_err(Refused::Slot)?;
            Ok(slot)
        })
    }

    fn insert_locked<Q>(
        &self,
        shard: &mut Shard<K>,
        hash: u64,
        key: &Q,
    ) -> Result<Arc<Slot>, Refused>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let at_cap = self.keys.load(Ordering::Relaxed) >= self.max_keys;
        if at_cap || shard.table.len() >= shard.swept_at {
            self.sweep_shard(shard, at_cap);
            if self.keys.load(Ordering::Relaxed) >= self.max_keys {
                return Err(Refused::NoRoom {
                    max_keys: self.max_keys,
                });
            }
        }
        let (max, is_override) = match self.overrides.read().get(key) {
            Some(&max) => (max, true),
            None => (self.default_max.load(Ordering::Acquire), false),
        };
        let slot = Arc::new(Slot::new(max, is_override));
        let sharding = &self.sharding;
        shard
            .table
            .insert_unique(hash, (key.to_owned(), Arc::clone(&slot)), |(k, _)| {
                sharding.hash(k)
            });
        self.keys.fetch_add(1, Ordering::Relaxed);
        Ok(slot)
    }

    /// Drops the shard's keys with nothing in flight and nobody waiting, and (unless
    /// `force`) untouched since the last sweep.
    fn sweep_shard(&self, shard: &mut Shard<K>, force: bool) -> usize {
        let before = shard.table.len();
        shard
            .table
            .retain(|(_, slot)| !(slot.sweepable(force) && Arc::strong_count(slot) == 1));
        let dropped = before - shard.table.len();
        if shard.table.capacity() > 4 * shard.table.len().max(SWEEP_FLOOR) {
            let sharding = &self.sharding;
            shard.table.shrink_to(0, |(k, _)| sharding.hash(k));
        }
        shard.swept_at = (2 * shard.table.len()).max(SWEEP_FLOOR);
        self.keys.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    /// Sweeps every shard of every idle key; returns the keys dropped.
    ///
    /// # Locking behaviour
    /// Each shard's write lock in turn.
    pub(crate) fn sweep(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| self.sweep_shard(&mut shard.write(), true))
            .sum()
    }

    /// The slots of `key` held now (0 for a key the map does not hold).
    pub(crate) fn in_flight<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.find(self.sharding.hash(key), key)
            .map_or(0, |slot| slot.in_flight())
    }

    /// The maximum of `key`: its own, or the default.
    pub(crate) fn max_for<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.overrides
            .read()
            .get(key)
            .copied()
            .unwrap_or_else(|| self.default_max())
    }

    pub(crate) fn default_max(&self) -> u32 {
        self.default_max.load(Ordering::Acquire)
    }

    /// Gives `key` a maximum of its own.
    pub(crate) fn set_max<Q>(&self, key: &Q, max: u32)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let _serial = self.reconfigure.lock();
        self.overrides.write().insert(key.to_owned(), max);
        if let Some(slot) = self.find(self.sharding.hash(key), key) {
            slot.set_max(max, true);
        }
    }

    /// Returns `key` to the default maximum.
    pub(crate) fn remove_max<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let _serial = self.reconfigure.lock();
        self.overrides.write().remove(key);
        if let Some(slot) = self.find(self.sharding.hash(key), key) {
            slot.set_max(self.default_max(), false);
        }
    }

    /// Sets the default maximum, for every key without one of its own.
    pub(crate) fn set_default_max(&self, max: u32) {
        let _serial = self.reconfigure.lock();
        // Stored before the keys are visited: a key inserted meanwhile either reads the
        // new default or is visited.
        self.default_max.store(max, Ordering::Release);
        for shard in self.shards.iter() {
            for (_, slot) in shard.read().table.iter() {
                if !slot.has_override() {
                    slot.set_max(max, false);
                }
            }
        }
    }

    /// Keys held, slots held and callers waiting, over every key.
    pub(crate) fn totals(&self) -> (usize, u64, u64) {
        let (mut keys, mut in_flight, mut waiting) = (0, 0, 0);
        for shard in self.shards.iter() {
            let shard = shard.read();
            keys += shard.table.len();
            for (_, slot) in shard.table.iter() {
                in_flight += u64::from(slot.in_flight());
                waiting += slot.waiting() as u64;
            }
        }
        (keys, in_flight, waiting)
    }

    /// Keys held now.
    pub(crate) fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    pub(crate) fn shards(&self) -> usize {
        self.shards.len()
    }
}
