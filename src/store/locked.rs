//! The store of the sliding log and the synced limiters, whose per-key state is a cell
//! of several words: each shard behind a [`parking_lot::RwLock`] around a [`Shard`],
//! an existing key served under the read lock, its state changed by CAS or under a
//! per-key mutex.

use std::borrow::Borrow;
use std::hash::Hash;

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use super::counts::Counts;
use super::hash::Sharding;
use super::recent_denies::Denies;
use super::shard::Shard;
use super::state::State;
use super::table::{Entry, MAX_ENTRIES, Table};
use super::{Limits, StoreStats, fits, keys_per_shard};
use crate::algorithm::Policy;
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;

/// One shard behind its lock, padded to its own cache lines.
type Locked<K, S> = CachePadded<RwLock<Shard<K, S>>>;

/// A sharded, capped map from keys to state, with per-shard policies.
pub(crate) struct Store<K, S: State> {
    shards: Box<[Locked<K, S>]>,
    sharding: Sharding,
    denies: Denies,
    limits: Limits,
    counts: Counts,
    /// Serialises default-policy changes, so all shards end on the same one.
    reconfigure: Mutex<()>,
    /// The keys noted for the store's owner (see [`State::take_note`]).
    notes: Notes,
}

/// The hashes of the keys a store noted for its owner since it last looked. Keys
/// inserted go in a list that grows as it must (an insert allocates anyway); keys whose
/// check or settlement asked to be noted, at most [`State::NOTES`] of them, in room
/// reserved when the store was made, so that a check of a key the store holds never
/// allocates; past that, a flag tells the owner to look at every key instead.
struct Notes {
    inserted: Mutex<Vec<u64>>,
    changed: Mutex<Vec<u64>>,
    overflowed: std::sync::atomic::AtomicBool,
    room: usize,
}

impl Notes {
    fn new(room: usize) -> Self {
        Self {
            inserted: Mutex::new(Vec::new()),
            changed: Mutex::new(Vec::with_capacity(room)),
            overflowed: std::sync::atomic::AtomicBool::new(false),
            room,
        }
    }

    fn inserted(&self, hash: u64) {
        self.inserted.lock().push(hash);
    }

    #[cold]
    fn changed(&self, hash: u64) {
        let mut hashes = self.changed.lock();
        if hashes.len() < self.room {
            hashes.push(hash);
        } else {
            self.overflowed
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

impl<K: Hash + Eq, S: State> Store<K, S> {
    /// A store with `limits.shards` shards (a power of two), all under `policy`.
    pub(crate) fn new(limits: Limits, policy: S::Policy) -> Self {
        let sharding = Sharding::new(limits.shards);
        let room = keys_per_shard(limits.expected_keys, limits.shards);
        Self {
            shards: (0..limits.shards)
                .map(|i| CachePadded::new(RwLock::new(Shard::new(policy, sharding.seed(i), room))))
                .collect(),
            sharding,
            denies: Denies::new(),
            limits,
            counts: Counts::new(limits.max_keys),
            reconfigure: Mutex::new(()),
            notes: Notes::new(S::NOTES),
        }
    }

    /// Notes `hash` for the owner if `state` asks to be (see [`State::take_note`]).
    #[inline(always)]
    fn note(&self, hash: u64, state: &S) {
        if S::NOTES > 0 && state.take_note() {
            self.notes.changed(hash);
        }
    }

    /// Notes the key of a denied check, if its state asks to be.
    #[inline(always)]
    fn note_deny(&self, hash: u64, state: &S, decision: &Decision) {
        if S::NOTES > 0 && !decision.is_allowed() {
            self.note(hash, state);
        }
    }

    /// Moves the hashes of the keys noted since the last call into `into` (appended),
    /// and says whether some could not be noted (then every key must be looked at).
    ///
    /// Takes the notes' own lock, briefly.
    #[cfg(feature = "redis")]
    pub(crate) fn take_notes(&self, into: &mut Vec<u64>) -> bool {
        // The inserted list is swapped out whole (its room goes with it); the other
        // keeps its reserved room.
        let inserted = std::mem::take(&mut *self.notes.inserted.lock());
        if into.is_empty() {
            *into = inserted;
        } else {
            into.extend_from_slice(&inserted);
        }
        let mut changed = self.notes.changed.lock();
        into.extend_from_slice(&changed);
        changed.clear();
        drop(changed);
        self.notes
            .overflowed
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Runs `f` on the key whose hash is `hash` (as the store hashes keys), with its state
    /// and policy, if the store holds it.
    ///
    /// Takes the key's shard read lock.
    #[cfg(feature = "redis")]
    pub(crate) fn with_hashed<R>(
        &self,
        hash: u64,
        f: impl FnOnce(&K, &S, &S::Policy) -> R,
    ) -> Option<R> {
        let shard = self.shard(hash).read();
        let entry = shard.find_hashed(hash, &self.rehash())?;
        Some(f(
            &entry.key,
            &entry.state,
            shard.policy_for(hash, &entry.key),
        ))
    }

    /// Moves each shard's eviction hand over up to `steps` keys, dropping those untouched
    /// as the sweep of a full table judges them (for a few periods of their quota, or
    /// for one and since the table last filled): so that memory follows the keys in use
    /// without a pass over every key. Returns how many were dropped.
    ///
    /// Takes each shard's write lock in turn, for its steps.
    #[cfg(feature = "redis")]
    pub(crate) fn sweep_some(&self, now: u64, steps: usize) -> usize {
        let rehash = self.rehash();
        let mut dropped = 0;
        for lock in self.shards.iter() {
            let gone = lock.write().sweep_step(now, steps, &rehash);
            self.counts.swept(gone);
            dropped += gone;
        }
        if dropped > 0 {
            self.denies.invalidate();
        }
        dropped
    }

    /// The bytes of the room [`new`](Self::new) reserves for `limits`' expected keys (0
    /// when none are expected), or `None` beyond what a shard's table can index
    /// ([`MAX_ENTRIES`]) or the address space.
    pub(crate) fn bytes_ahead(limits: Limits) -> Option<usize> {
        match keys_per_shard(limits.expected_keys, limits.shards) {
            0 => Some(0),
            keys if keys > MAX_ENTRIES => None,
            keys => Table::<K, S>::bytes_for(keys)?.checked_mul(limits.shards),
        }
    }

    /// The hash the store reads for `key`, as the word store's (see [`Sharding`]).
    #[inline(always)]
    fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.sharding.hash(key)
    }

    #[inline]
    fn shard(&self, hash: u64) -> &RwLock<Shard<K, S>> {
        &self.shards[Sharding::shard(hash, self.shards.len())]
    }

    fn rehash(&self) -> impl Fn(&K) -> u64 + '_ {
        |key| self.hash(key)
    }

    /// Decides a request of `cost` for `key` at `now`, inserting the key if it is new
    /// (and `cost > 0`). An admission that would be delayed more than `max_delay` ns is
    /// refused instead (see [`State::check`]).
    ///
    /// Takes the shard's read lock for an existing key, its write lock for a new one, and
    /// no lock at all for a unit request the thread saw denied until a later instant.
    #[inline(always)]
    pub(crate) fn check<Q>(
        &self,
        key: &Q,
        now: impl FnOnce() -> u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.hash(key);
        let now = now();
        self.denies.check(
            hash,
            key,
            now,
            cost,
            max_delay,
            S::DENIES_ARE_STABLE,
            || self.decide(hash, key, now, cost, max_delay),
        )
    }

    /// [`check`](Self::check) of a unit request at `now`: a key the store holds is
    /// decided under the read lock and its decision returned from that branch, in
    /// registers; everything else (a new key, a deny the thread may have cached, a
    /// policy with no capacity at all) goes through [`check`](Self::check) out of line.
    ///
    /// Takes the locks [`check`](Self::check) takes.
    #[cfg(feature = "redis")]
    #[inline(always)]
    pub(crate) fn check_unit<Q>(&self, key: &Q, now: u64) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if !S::DENIES_ARE_STABLE {
            let hash = self.hash(key);
            let shard = self.shard(hash).read();
            if let Some(entry) = shard.find(hash, key) {
                let policy = shard.policy_for(hash, key);
                if policy.capacity() > 0 {
                    let decision = entry.state.check(policy, now, 1, u64::MAX);
                    self.note_deny(hash, &entry.state, &decision);
                    return decision;
                }
            }
        }
        self.check_unit_slow(key, now)
    }

    #[cfg(feature = "redis")]
    #[inline(never)]
    fn check_unit_slow<Q>(&self, key: &Q, now: u64) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        crate::decision::unit(self.check(key, || now, 1, u64::MAX))
    }

    #[inline(always)]
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
                let decision = entry.state.check(policy, now, cost, max_delay);
                self.note_deny(hash, &entry.state, &decision);
                return Ok(decision);
            }
        }
        let mut shard = lock.write();
        // The policy may have changed between the two locks.
        let policy = *shard.policy_for(hash, key);
        fits(&policy, cost)?;
        let entry = match shard.find(hash, key) {
            Some(entry) => entry,
            None => match self.insert_fresh(&mut shard, hash, key, now, &policy) {
                Ok(entry) => entry,
                Err(retry_after_ns) => {
                    return Ok(self.counts.refusal(policy.capacity(), retry_after_ns));
                }
            },
        };
        let decision = entry.state.check(&policy, now, cost, max_delay);
        self.note_deny(hash, &entry.state, &decision);
        Ok(decision)
    }

    /// Inserts `key`, which `shard` (write-locked) does not hold, with a fresh state under
    /// `policy`, first making room as the limits say. The new entry, or, when no room
    /// could be made, how long (ns) the refused request should wait.
    fn insert_fresh<'s, Q>(
        &self,
        shard: &'s mut Shard<K, S>,
        hash: u64,
        key: &Q,
        now: u64,
        policy: &S::Policy,
    ) -> Result<&'s Entry<K, S>, u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let rehash = self.rehash();
        if self.limits.sweep {
            self.counts.swept(shard.sweep_if_full(now, &rehash));
        }
        self.counts.take_place(
            || shard.make_room(now, self.limits.when_full, &rehash),
            || self.denies.invalidate(),
        )?;
        let entry = Entry {
            key: key.to_owned(),
            state: S::fresh(policy),
        };
        let entry = shard.insert(hash, entry, &rehash).map_err(|_| {
            self.counts.give_back();
            policy.quota().emission_interval().as_nanos() as u64
        })?;
        if S::NOTES > 0 && entry.state.take_note() {
            self.notes.inserted(hash);
        }
        Ok(entry)
    }

    /// Runs `apply` on `key`'s state, first inserting the key (with a fresh state, making
    /// room as a check of a new key would) if it holds none; false if no room could be
    /// made, and `apply` did not run.
    ///
    /// Takes the key's shard read lock for an existing key, its write lock for a new one;
    /// `apply` runs under that lock.
    #[cfg(feature = "redis")]
    pub(crate) fn upsert<Q>(&self, key: &Q, now: u64, apply: impl FnOnce(&S)) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.hash(key);
        let lock = self.shard(hash);
        {
            let shard = lock.read();
            if let Some(entry) = shard.find(hash, key) {
                apply(&entry.state);
                self.note(hash, &entry.state);
                return true;
            }
        }
        let mut shard = lock.write();
        if let Some(entry) = shard.find(hash, key) {
            apply(&entry.state);
            self.note(hash, &entry.state);
            return true;
        }
        let policy = *shard.policy_for(hash, key);
        match self.insert_fresh(&mut shard, hash, key, now, &policy) {
            Ok(entry) => {
                apply(&entry.state);
                self.note(hash, &entry.state);
                true
            }
            Err(_) => false,
        }
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
        let hash = self.hash(key);
        let shard = self.shard(hash).read();
        let policy = shard.policy_for(hash, key);
        fits(policy, cost)?;
        Ok(match shard.find(hash, key) {
            Some(entry) => entry.state.peek(policy, now, cost),
            None => S::peek_vacant(policy, now, cost),
        })
    }

    /// Removes `key`'s state (not its key quota); true if it held state.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn remove<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let removed = self.shard(hash).write().remove(hash, key, self.rehash());
        if removed {
            self.counts.removed();
            self.denies.invalidate();
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
        let hash = self.hash(key);
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
            self.counts.removed();
            self.denies.invalidate();
        }
        removed
    }

    /// Gives `key` its own policy (`Some`) or returns it to the default (`None`),
    /// converting its state.
    ///
    /// Takes the key's shard write lock.
    pub(crate) fn set_key_quota(&self, key: K, policy: Option<S::Policy>, now: impl Fn() -> u64) {
        let hash = self.hash(&key);
        let mut shard = self.shard(hash).write();
        shard.set_key_quota(hash, key, policy, now(), self.rehash());
        drop(shard);
        self.denies.invalidate();
    }

    /// The policy `key` is limited by.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn policy_of<Q>(&self, key: &Q) -> S::Policy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        *self.shard(hash).read().policy_for(hash, key)
    }

    /// The default policy.
    pub(crate) fn default_policy(&self) -> S::Policy {
        *self.shards[0].read().default_policy()
    }

    /// Replaces the default quota, keeping the algorithm, converting every key without an
    /// key quota. Shards are converted one at a time, each under its write lock.
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
        self.denies.invalidate();
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
        self.denies.invalidate();
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
        self.with_state_policy(key, |state, _| f(state))
    }

    #[cfg(feature = "redis")]
    /// Runs `f` on `key`'s state and policy (its own, or the default), if it holds any.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn with_state_policy<Q, R>(
        &self,
        key: &Q,
        f: impl FnOnce(&S, &S::Policy) -> R,
    ) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash).read();
        shard
            .find(hash, key)
            .map(|entry| f(&entry.state, shard.policy_for(hash, key)))
    }

    #[cfg(feature = "redis")]
    /// [`with_state_policy`](Self::with_state_policy) for a change that may concern the
    /// store's owner (a settlement): the key is noted if its state asks to be.
    ///
    /// Takes the key's shard read lock.
    pub(crate) fn update<Q, R>(&self, key: &Q, f: impl FnOnce(&S, &S::Policy) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash).read();
        let entry = shard.find(hash, key)?;
        let result = f(&entry.state, shard.policy_for(hash, key));
        self.note(hash, &entry.state);
        Some(result)
    }

    #[cfg(feature = "redis")]
    /// Calls `f` on every key and its state, one shard at a time under its read lock
    /// (checks go on; only inserts into that shard wait).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &S, &S::Policy)) {
        let rehash = self.rehash();
        for lock in self.shards.iter() {
            let shard = lock.read();
            shard.for_each(&mut f, &rehash);
        }
    }

    /// How many keys hold state.
    pub(crate) fn len(&self) -> usize {
        self.counts.len()
    }

    /// The store's counters.
    pub(crate) fn stats(&self) -> StoreStats {
        self.counts.stats()
    }

    /// The number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }
}
