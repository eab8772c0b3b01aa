//! The sharded map that holds each key's state, and its policy.
//!
//! Keys are spread over a power-of-two number of shards, each a cache-padded
//! [`parking_lot::RwLock`] around a [`Shard`]. A key is hashed once, with ahash: the hash
//! picks the shard from the bits just below the top seven (hashbrown uses the top seven as
//! its control tags and the low bits as the bucket index, so neither is narrowed by
//! sharding) and is reused for the probe.
//!
//! An existing key is served under its shard's read lock, and its state changes by CAS
//! (or, for the sliding log, under a per-key mutex), so checks on different keys of one
//! shard run in parallel. Only a new key, a quota change or a removal takes the write lock.

mod shard;
pub(crate) mod state;

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use crate::algorithm::Policy;
use crate::decision::Decision;
use crate::error::InsufficientCapacity;
use crate::quota::Quota;
use shard::{Shard, Slot};
use state::State;

/// One shard behind its lock, padded to its own cache lines.
type Locked<K, S> = CachePadded<RwLock<Shard<K, S>>>;

/// A sharded, capped map from keys to state, with per-shard policies.
pub(crate) struct Store<K, S: State> {
    shards: Box<[Locked<K, S>]>,
    hasher: ahash::RandomState,
    /// `log2(shards.len())`.
    shard_bits: u32,
    len: CachePadded<AtomicUsize>,
    max_keys: usize,
    evicted: AtomicU64,
    /// Serialises default-policy changes, so all shards end on the same one.
    reconfigure: Mutex<()>,
}

impl<K: Hash + Eq, S: State> Store<K, S> {
    /// A store of `shards` shards (a power of two) holding at most `max_keys` keys, all
    /// under `policy`.
    pub(crate) fn new(shards: usize, max_keys: usize, policy: S::Policy) -> Self {
        debug_assert!(shards.is_power_of_two());
        Self {
            shards: (0..shards)
                .map(|_| CachePadded::new(RwLock::new(Shard::new(policy))))
                .collect(),
            hasher: ahash::RandomState::new(),
            shard_bits: shards.trailing_zeros(),
            len: CachePadded::new(AtomicUsize::new(0)),
            max_keys,
            evicted: AtomicU64::new(0),
            reconfigure: Mutex::new(()),
        }
    }

    #[inline]
    fn locate<Q>(&self, key: &Q) -> (u64, &RwLock<Shard<K, S>>)
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

    fn rehash(&self) -> impl Fn(&K) -> u64 + '_ {
        |key| self.hasher.hash_one(key)
    }

    /// Decides a request of `cost` for `key` at `now`, inserting the key if it is new
    /// (and `cost > 0`). An admission that would be delayed more than `max_delay` ns is
    /// refused instead (see [`State::check`]). When the store is full, the new key's shard is first swept of
    /// untouched keys; if none is, the request is denied until the first key of that
    /// shard will be untouched.
    ///
    /// Takes the shard's read lock for an existing key, its write lock for a new one.
    #[inline]
    pub(crate) fn check<Q>(
        &self,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let (hash, lock) = self.locate(key);
        {
            let shard = lock.read();
            let policy = shard.policy_for(hash, key);
            fits(policy, cost)?;
            let slot = shard.find(hash, key);
            if cost == 0 {
                return Ok(match slot {
                    Some(slot) => slot.state.peek(policy, now, 0),
                    None => S::peek_vacant(policy, now, 0),
                });
            }
            if let Some(slot) = slot {
                return Ok(slot.state.check(policy, now, cost, max_delay));
            }
        }
        let mut shard = lock.write();
        // The policy may have changed between the two locks.
        let policy = *shard.policy_for(hash, key);
        fits(&policy, cost)?;
        if let Some(slot) = shard.find(hash, key) {
            return Ok(slot.state.check(&policy, now, cost, max_delay));
        }
        if !self.reserve() {
            let (dropped, soonest) = shard.sweep(now, self.rehash());
            self.forget(dropped);
            if !self.reserve() {
                return Ok(Decision::deny(policy.capacity(), 0, 0, soonest));
            }
        }
        let slot = Slot {
            key: key.to_owned(),
            state: S::fresh(&policy),
        };
        let slot = shard.insert(hash, slot, self.rehash());
        Ok(slot.state.check(&policy, now, cost, max_delay))
    }

    /// The decision a request of `cost` for `key` would get at `now`, consuming nothing
    /// and storing nothing.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn peek<Q>(
        &self,
        key: &Q,
        now: u64,
        cost: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, lock) = self.locate(key);
        let shard = lock.read();
        let policy = shard.policy_for(hash, key);
        fits(policy, cost)?;
        Ok(match shard.find(hash, key) {
            Some(slot) => slot.state.peek(policy, now, cost),
            None => S::peek_vacant(policy, now, cost),
        })
    }

    /// Takes a place for a new key; false when the store is full.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Records that `dropped` keys were evicted.
    fn forget(&self, dropped: usize) {
        if dropped > 0 {
            self.len.fetch_sub(dropped, Ordering::AcqRel);
            self.evicted.fetch_add(dropped as u64, Ordering::Relaxed);
        }
    }

    /// Removes `key`'s state (not its override); true if it held state.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn remove<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, lock) = self.locate(key);
        let removed = lock.write().remove(hash, key);
        if removed {
            self.len.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    /// Gives `key` its own policy (`Some`) or returns it to the default (`None`),
    /// converting its state.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn set_override(&self, key: K, policy: Option<S::Policy>, now: u64) {
        let (hash, lock) = self.locate(&key);
        lock.write()
            .set_override(hash, key, policy, now, self.rehash());
    }

    /// The policy `key` is limited by.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn policy_of<Q>(&self, key: &Q) -> S::Policy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, lock) = self.locate(key);
        *lock.read().policy_for(hash, key)
    }

    /// The default policy.
    pub(crate) fn default_policy(&self) -> S::Policy {
        *self.shards[0].read().default_policy()
    }

    /// Replaces the default quota, keeping the algorithm, converting every key without an
    /// override. Shards are converted one at a time, each under its write lock.
    pub(crate) fn set_default_quota(
        &self,
        quota: Quota,
        now: impl Fn() -> u64,
    ) -> Result<(), crate::ConfigError> {
        let _serial = self.reconfigure.lock();
        let policy = self.default_policy().with_quota(quota)?;
        for lock in self.shards.iter() {
            lock.write().set_default(policy, now(), self.rehash());
        }
        Ok(())
    }

    /// How many keys hold state.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// How many untouched keys were dropped to make room since the store was made.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// The number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The keys held by each shard (for tests of the sharding).
    #[cfg(test)]
    fn shard_lens(&self) -> Vec<usize> {
        self.shards.iter().map(|s| s.read().len()).collect()
    }
}

/// `Err` when `cost` exceeds what `policy` can ever admit at once.
#[inline]
fn fits<P: Policy>(policy: &P, cost: u64) -> Result<(), InsufficientCapacity> {
    let capacity = policy.capacity();
    if cost > capacity {
        return Err(InsufficientCapacity {
            requested: cost,
            capacity,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Plan, WordPolicy};
    use std::time::Duration;

    fn store(shards: usize, max_keys: usize) -> Store<String, AtomicU64> {
        let quota = Quota::new(1, Duration::from_nanos(100)).unwrap();
        Store::new(shards, max_keys, WordPolicy::token_bucket(quota))
    }

    #[test]
    fn borrowed_lookups_find_owned_keys() {
        let store = store(4, usize::MAX);
        assert!(store.check("a", 0, 1, u64::MAX).unwrap().is_allowed());
        assert!(!store.check("a", 0, 1, u64::MAX).unwrap().is_allowed());
        assert!(store.peek("b", 0, 1).unwrap().is_allowed());
        assert_eq!(store.len(), 1);
        assert!(store.remove("a"));
        assert!(!store.remove("a"));
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn keys_spread_over_all_shards() {
        let store = store(8, usize::MAX);
        for i in 0..8000 {
            store
                .check(format!("k{i}").as_str(), 0, 1, u64::MAX)
                .unwrap();
        }
        for len in store.shard_lens() {
            assert!((800..1200).contains(&len), "{len} keys in one shard of 8");
        }
    }

    #[test]
    fn a_full_store_evicts_only_untouched_keys_and_says_when_to_retry() {
        // One shard so the sweep sees every key; T = 100ns, burst 1.
        let store = store(1, 2);
        store.check("old", 0, 1, u64::MAX).unwrap();
        store.check("busy", 50, 1, u64::MAX).unwrap();
        // At 120, "old" is untouched (full since 100) and "busy" is full at 150.
        assert!(store.check("new", 120, 1, u64::MAX).unwrap().is_allowed());
        assert_eq!((store.len(), store.evicted()), (2, 1));
        let d = store.check("other", 120, 1, u64::MAX).unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(30)));
        assert_eq!(store.len(), 2);
        assert!(store.check("other", 150, 1, u64::MAX).unwrap().is_allowed());
    }

    #[test]
    fn a_quota_change_converts_state_under_the_lock() {
        let Ok(Plan::Word(policy)) =
            Plan::new(crate::Algorithm::TokenBucket, "10/s".parse().unwrap())
        else {
            panic!("word policy")
        };
        let store: Store<String, AtomicU64> = Store::new(2, usize::MAX, policy);
        for _ in 0..5 {
            store.check("k", 0, 1, u64::MAX).unwrap();
        }
        store
            .set_default_quota("100/s".parse().unwrap(), || 0)
            .unwrap();
        assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 95);
        store.set_override("k".to_owned(), Some(policy), 0);
        assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 5);
        assert_eq!(store.policy_of("k").quota().limit(), 10);
        assert_eq!(store.policy_of("j").quota().limit(), 100);
    }
}
