//! The sharded map that holds each key's state, and its policy.
//!
//! Keys are spread over a power-of-two number of shards, each a cache-padded
//! [`parking_lot::RwLock`] around a [`Shard`]. A key is hashed once, with ahash: the top
//! bits pick the shard, the rest place it in the shard's compact table (see
//! [`table`]).
//!
//! An existing key is served under its shard's read lock, and its state changes by CAS
//! (or, for the sliding log, under a per-key mutex), so checks on different keys of one
//! shard run in parallel. Only a new key, a quota change or a removal takes the write
//! lock. A unit request denied recently is answered from a per-thread cache without
//! touching the shard at all (see [`deny_cache`]).
//!
//! Memory stays bounded without losing decisions: every insert moves its shard's
//! eviction hand over a couple of entries and drops those back to untouched, and
//! `max_keys` caps the total (see [`WhenFull`]).

mod deny_cache;
mod shard;
pub(crate) mod state;
mod table;

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use crate::algorithm::Policy;
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;
use shard::{Room, Shard};
use state::State;
use table::Entry;

/// What a limiter at [`max_keys`](crate::Builder::max_keys) does with a new key once no
/// untouched key can make room for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WhenFull {
    /// Evict a live key: of 8 keys sampled at random in the new key's shard, the one
    /// whose eviction loses the least — the fewest units consumed, then the soonest to be
    /// untouched (for the token bucket, the least recently admitted). A client that has
    /// used up its quota (an abuser being limited) is the last to go, so flooding new keys
    /// cannot reset it. The evicted key's next request starts fresh. (Denies write
    /// nothing, so a key's activity is what it was admitted, not what it asked.)
    #[default]
    EvictLeastActive,
    /// Deny the new key's request; keys already stored are unaffected. Its
    /// `retry_after` is when the soonest key the eviction hand examined will be untouched,
    /// an estimate, since other shards may free room sooner.
    DenyNewKeys,
}

/// Counters for monitoring a limiter's key store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Keys holding state now.
    pub keys: usize,
    /// Keys dropped because their state was back to untouched (no decision changed).
    pub evicted_untouched: u64,
    /// Live keys evicted to make room under [`WhenFull::EvictLeastActive`].
    pub evicted_active: u64,
    /// Requests of new keys denied because the store was full.
    pub refused_new_keys: u64,
}

/// One shard behind its lock, padded to its own cache lines.
type Locked<K, S> = CachePadded<RwLock<Shard<K, S>>>;

/// Hands out store identities for the deny cache (0 means "no store").
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

/// How the store is configured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) shards: usize,
    pub(crate) max_keys: usize,
    pub(crate) when_full: WhenFull,
    /// Whether inserts sweep untouched keys away.
    pub(crate) sweep: bool,
}

/// A sharded, capped map from keys to state, with per-shard policies.
pub(crate) struct Store<K, S: State> {
    shards: Box<[Locked<K, S>]>,
    hasher: ahash::RandomState,
    /// An independent hash confirming deny-cache hits.
    checker: ahash::RandomState,
    /// `log2(shards.len())`.
    shard_bits: u32,
    limits: Limits,
    len: CachePadded<AtomicUsize>,
    id: u64,
    /// Bumped by everything that can admit a cached-denied key early.
    generation: AtomicU64,
    /// Whether any deny was ever cached (until then the cache is not consulted).
    deny_cache_live: AtomicBool,
    evicted_untouched: AtomicU64,
    evicted_active: AtomicU64,
    refused: AtomicU64,
    /// Serialises default-policy changes, so all shards end on the same one.
    reconfigure: Mutex<()>,
}

impl<K: Hash + Eq, S: State> Store<K, S> {
    /// A store with `limits.shards` shards (a power of two), all under `policy`.
    pub(crate) fn new(limits: Limits, policy: S::Policy) -> Self {
        debug_assert!(limits.shards.is_power_of_two());
        let hasher = ahash::RandomState::new();
        Self {
            shards: (0..limits.shards)
                .map(|i| CachePadded::new(RwLock::new(Shard::new(policy, hasher.hash_one(i)))))
                .collect(),
            hasher,
            checker: ahash::RandomState::new(),
            shard_bits: limits.shards.trailing_zeros(),
            limits,
            len: CachePadded::new(AtomicUsize::new(0)),
            id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
            generation: AtomicU64::new(0),
            deny_cache_live: AtomicBool::new(false),
            evicted_untouched: AtomicU64::new(0),
            evicted_active: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            reconfigure: Mutex::new(()),
        }
    }

    #[inline]
    fn shard(&self, hash: u64) -> &RwLock<Shard<K, S>> {
        let index = if self.shard_bits == 0 {
            0
        } else {
            (hash >> (u64::BITS - self.shard_bits)) as usize
        };
        &self.shards[index]
    }

    fn rehash(&self) -> impl Fn(&K) -> u64 + '_ {
        |key| self.hasher.hash_one(key)
    }

    /// Invalidates every cached deny.
    fn invalidate_denies(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Decides a request of `cost` for `key` at `now`, inserting the key if it is new
    /// (and `cost > 0`). An admission that would be delayed more than `max_delay` ns is
    /// refused instead (see [`State::check`]).
    ///
    /// Takes the shard's read lock for an existing key, its write lock for a new one, and
    /// no lock at all for a unit request the thread saw denied until a later instant.
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
        let hash = self.hasher.hash_one(key);
        let cacheable = S::DENIES_ARE_STABLE && cost == 1 && max_delay == u64::MAX;
        // Read before deciding, so that a reset racing with this check invalidates the
        // deny it may cache. Only cacheable checks need it.
        let generation = if cacheable {
            self.generation.load(Ordering::Acquire)
        } else {
            0
        };
        if cacheable && self.deny_cache_live.load(Ordering::Relaxed) {
            if let Some(d) = deny_cache::lookup(
                self.id,
                generation,
                hash,
                || self.checker.hash_one(key),
                now,
            ) {
                return Ok(d);
            }
        }
        let decision = self.decide(hash, key, now, cost, max_delay)?;
        if cacheable && !decision.is_allowed() && !decision.is_capacity_deny() {
            deny_cache::insert(
                self.id,
                generation,
                hash,
                self.checker.hash_one(key),
                now,
                &decision,
            );
            if !self.deny_cache_live.load(Ordering::Relaxed) {
                self.deny_cache_live.store(true, Ordering::Relaxed);
            }
        }
        Ok(decision)
    }

    #[inline]
    fn decide<Q>(
        &self,
        hash: u64,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let lock = self.shard(hash);
        {
            let shard = lock.read();
            let policy = shard.policy_for(hash, key);
            fits(policy, cost)?;
            let entry = shard.find(hash, key);
            if cost == 0 {
                return Ok(match entry {
                    Some(entry) => entry.state.peek(policy, now, 0),
                    None => S::peek_vacant(policy, now, 0),
                });
            }
            if let Some(entry) = entry {
                return Ok(entry.state.check(policy, now, cost, max_delay));
            }
        }
        let mut shard = lock.write();
        // The policy may have changed between the two locks.
        let policy = *shard.policy_for(hash, key);
        fits(&policy, cost)?;
        if let Some(entry) = shard.find(hash, key) {
            return Ok(entry.state.check(&policy, now, cost, max_delay));
        }
        let rehash = self.rehash();
        if self.limits.sweep {
            let dropped = shard.sweep_on_insert(now, &rehash);
            self.forget(dropped, &self.evicted_untouched);
        }
        if !self.reserve() {
            match shard.make_room(now, self.limits.when_full, &rehash) {
                Room::Untouched => self.forget(1, &self.evicted_untouched),
                Room::Active => {
                    self.forget(1, &self.evicted_active);
                    self.invalidate_denies();
                }
                Room::None { retry_after_ns } => return Ok(self.refuse(&policy, retry_after_ns)),
            }
            // Another shard may take the freed place first; then this key is refused.
            if !self.reserve() {
                return Ok(self.refuse(&policy, 1));
            }
        }
        let entry = Entry {
            key: key.to_owned(),
            state: S::fresh(&policy),
        };
        match shard.insert(hash, entry, &rehash) {
            Ok(entry) => Ok(entry.state.check(&policy, now, cost, max_delay)),
            Err(_) => {
                self.len.fetch_sub(1, Ordering::AcqRel);
                Ok(self.refuse(
                    &policy,
                    policy.quota().emission_interval().as_nanos() as u64,
                ))
            }
        }
    }

    /// A deny for a new key that found no room.
    fn refuse(&self, policy: &S::Policy, retry_after_ns: u64) -> Decision {
        self.refused.fetch_add(1, Ordering::Relaxed);
        Decision::capacity_deny(policy.capacity(), retry_after_ns)
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
        let hash = self.hasher.hash_one(key);
        let shard = self.shard(hash).read();
        let policy = shard.policy_for(hash, key);
        fits(policy, cost)?;
        Ok(match shard.find(hash, key) {
            Some(entry) => entry.state.peek(policy, now, cost),
            None => S::peek_vacant(policy, now, cost),
        })
    }

    /// Takes a place for a new key; false when the store is full.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limits.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Records that `dropped` keys left, counting them in `counter`.
    fn forget(&self, dropped: usize, counter: &AtomicU64) {
        if dropped > 0 {
            self.len.fetch_sub(dropped, Ordering::AcqRel);
            counter.fetch_add(dropped as u64, Ordering::Relaxed);
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
        let hash = self.hasher.hash_one(key);
        let removed = self.shard(hash).write().remove(hash, key, self.rehash());
        if removed {
            self.len.fetch_sub(1, Ordering::AcqRel);
            self.invalidate_denies();
        }
        removed
    }

    /// Removes `key`'s state if `drop_it` holds for it, under the shard write lock (so no
    /// check can touch it in between); true if it was removed.
    ///
    /// Takes the key's shard write lock.
    #[cfg(feature = "redis")]
    pub(crate) fn remove_if<Q>(&self, key: &Q, drop_it: impl FnOnce(&S) -> bool) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let mut shard = self.shard(hash).write();
        if !shard
            .find(hash, key)
            .is_some_and(|entry| drop_it(&entry.state))
        {
            return false;
        }
        let removed = shard.remove(hash, key, self.rehash());
        drop(shard);
        if removed {
            self.len.fetch_sub(1, Ordering::AcqRel);
            self.invalidate_denies();
        }
        removed
    }

    /// Gives `key` its own policy (`Some`) or returns it to the default (`None`),
    /// converting its state.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn set_override(&self, key: K, policy: Option<S::Policy>, now: u64) {
        let hash = self.hasher.hash_one(&key);
        self.shard(hash)
            .write()
            .set_override(hash, key, policy, now, self.rehash());
        self.invalidate_denies();
    }

    /// The policy `key` is limited by.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn policy_of<Q>(&self, key: &Q) -> S::Policy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        *self.shard(hash).read().policy_for(hash, key)
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
    ) -> Result<(), ConfigError> {
        let _serial = self.reconfigure.lock();
        let policy = self.default_policy().with_quota(quota)?;
        for lock in self.shards.iter() {
            lock.write().set_default(policy, now(), self.rehash());
        }
        self.invalidate_denies();
        Ok(())
    }

    #[cfg(feature = "redis")]
    /// Replaces the default policy as is (each key's state converted by its `State`),
    /// shard by shard under each write lock.
    pub(crate) fn set_policy(&self, policy: S::Policy, now: u64) {
        let _serial = self.reconfigure.lock();
        for lock in self.shards.iter() {
            lock.write().set_default(policy, now, self.rehash());
        }
        self.invalidate_denies();
    }

    #[cfg(feature = "redis")]
    /// Runs `f` on `key`'s state, if it holds any.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn with_state<Q, R>(&self, key: &Q, f: impl FnOnce(&S) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let shard = self.shard(hash).read();
        shard.find(hash, key).map(|entry| f(&entry.state))
    }

    #[cfg(feature = "redis")]
    /// Calls `f` on every key and its state, one shard at a time under its read lock
    /// (checks go on; only inserts into that shard wait).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &S)) {
        for lock in self.shards.iter() {
            let shard = lock.read();
            shard.for_each(&mut f);
        }
    }

    /// How many keys hold state.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// The store's counters.
    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats {
            keys: self.len(),
            evicted_untouched: self.evicted_untouched.load(Ordering::Relaxed),
            evicted_active: self.evicted_active.load(Ordering::Relaxed),
            refused_new_keys: self.refused.load(Ordering::Relaxed),
        }
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

    fn limits(shards: usize, max_keys: usize) -> Limits {
        Limits {
            shards,
            max_keys,
            when_full: WhenFull::DenyNewKeys,
            sweep: false,
        }
    }

    fn store(shards: usize, max_keys: usize) -> Store<String, AtomicU64> {
        let quota = Quota::new(1, Duration::from_nanos(100)).unwrap();
        Store::new(limits(shards, max_keys), WordPolicy::token_bucket(quota))
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
        // One shard so the hand sees every key; T = 100ns, burst 1.
        let store = store(1, 2);
        store.check("old", 0, 1, u64::MAX).unwrap();
        store.check("busy", 50, 1, u64::MAX).unwrap();
        // At 120, "old" is untouched (full since 100) and "busy" is full at 150.
        assert!(store.check("new", 120, 1, u64::MAX).unwrap().is_allowed());
        assert_eq!(store.stats().evicted_untouched, 1);
        let d = store.check("other", 120, 1, u64::MAX).unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(30)));
        assert_eq!(store.len(), 2);
        assert_eq!(store.stats().refused_new_keys, 1);
        assert!(store.check("other", 150, 1, u64::MAX).unwrap().is_allowed());
    }

    #[test]
    fn cached_denies_are_exact_and_invalidated_by_admin_changes() {
        let store = store(2, usize::MAX);
        store.check("k", 0, 1, u64::MAX).unwrap();
        let first = store.check("k", 10, 1, u64::MAX).unwrap();
        assert!(store.deny_cache_live.load(Ordering::Relaxed));
        // Served from the cache: the same instants, seen from a later now.
        let cached = store.check("k", 30, 1, u64::MAX).unwrap();
        assert_eq!(cached.retry_after(), Some(Duration::from_nanos(70)));
        assert_eq!(
            cached.reset_after(),
            first.reset_after() - Duration::from_nanos(20)
        );
        assert_eq!(cached, store.peek("k", 30, 1).unwrap());
        // At the retry instant the store answers again, and admits.
        assert!(store.check("k", 100, 1, u64::MAX).unwrap().is_allowed());
        // A reset must not leave a stale deny behind.
        assert!(!store.check("k", 110, 1, u64::MAX).unwrap().is_allowed());
        store.remove("k");
        assert!(store.check("k", 111, 1, u64::MAX).unwrap().is_allowed());
    }

    #[test]
    fn a_quota_change_converts_state_under_the_lock() {
        let Ok(Plan::Word(policy)) =
            Plan::new(crate::Algorithm::TokenBucket, "10/s".parse().unwrap())
        else {
            panic!("word policy")
        };
        let store: Store<String, AtomicU64> = Store::new(limits(2, usize::MAX), policy);
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
