//! One shard: its keys' state, its copy of the default policy, its keys' own quotas, and
//! its eviction hand.
//!
//! Keeping the policy inside the shard means a check reads its key's policy under the
//! shard read lock it already holds for the lookup: no extra lock, no extra atomic. A
//! quota change takes the shard's write lock, so no check ever sees a new policy with
//! state that has not been converted for it, or the reverse.

use std::borrow::Borrow;
use std::hash::Hash;

use super::key_quotas::KeyQuotas;
use super::state::State;
use super::table::{Entry, Table};
use super::{Room, SAMPLES, SCAN_WHEN_FULL, Sweep, WhenFull, least_costly};
use crate::algorithm::Policy;
use crate::rng::XorShift;

/// The keys of one shard, under one lock.
pub(crate) struct Shard<K, S: State> {
    table: Table<K, S>,
    /// The limiter's default policy.
    policy: S::Policy,
    /// Keys with their own policy, whether or not they hold state.
    key_quotas: KeyQuotas<K, S::Policy>,
    /// The eviction hand: the next entry position the sweep looks at.
    hand: usize,
    /// When (clock ns) the last full table was swept: the next full sweep keeps every
    /// key touched since.
    swept: u64,
    /// Xorshift state for sampling.
    rng: XorShift,
}

impl<K: Hash + Eq, S: State> Shard<K, S> {
    /// A shard under `policy` whose table has room for `keys` keys made now (0: none).
    pub(crate) fn new(policy: S::Policy, seed: u64, keys: usize) -> Self {
        Self {
            table: Table::with_room(keys),
            policy,
            key_quotas: KeyQuotas::new(),
            hand: 0,
            swept: 0,
            rng: XorShift::new(seed),
        }
    }

    pub(crate) fn default_policy(&self) -> &S::Policy {
        &self.policy
    }

    /// The policy of `key`: its key quota, or the default. Costs nothing beyond a field
    /// read while no key of this shard has a key quota.
    #[inline]
    pub(crate) fn policy_for<Q>(&self, hash: u64, key: &Q) -> &S::Policy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.key_quotas.is_empty() {
            return &self.policy;
        }
        self.key_quotas
            .get(hash, |k| k.borrow() == key)
            .unwrap_or(&self.policy)
    }

    #[inline]
    pub(crate) fn find<Q>(&self, hash: u64, key: &Q) -> Option<&Entry<K, S>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table.find(hash, |k| k.borrow() == key)
    }

    /// The entry whose key hashes to `hash` (by `rehash`), if the shard holds one.
    #[cfg(feature = "redis")]
    pub(crate) fn find_hashed(
        &self,
        hash: u64,
        rehash: &impl Fn(&K) -> u64,
    ) -> Option<&Entry<K, S>> {
        self.table.find(hash, |k| rehash(k) == hash)
    }

    /// Inserts a key known to be absent; gives the entry back if the table is full.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        entry: Entry<K, S>,
        rehash: impl Fn(&K) -> u64,
    ) -> Result<&Entry<K, S>, Entry<K, S>> {
        self.table.insert(hash, entry, rehash)
    }

    /// Calls `f` on every key and its state.
    #[cfg(feature = "redis")]
    pub(crate) fn for_each(
        &self,
        f: &mut impl FnMut(&K, &S, &S::Policy),
        rehash: &impl Fn(&K) -> u64,
    ) {
        for entry in self.table.iter() {
            let policy = if self.key_quotas.is_empty() {
                &self.policy
            } else {
                self.policy_for(rehash(&entry.key), &entry.key)
            };
            f(&entry.key, &entry.state, policy);
        }
    }

    /// Removes `key`; true if it held state.
    pub(crate) fn remove<Q>(&mut self, hash: u64, key: &Q, rehash: impl Fn(&K) -> u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table
            .remove(hash, |k| k.borrow() == key, rehash)
            .is_some()
    }

    /// The policy of the entry at `at`.
    fn entry_policy(&self, at: usize, rehash: &impl Fn(&K) -> u64) -> &S::Policy {
        if self.key_quotas.is_empty() {
            return &self.policy;
        }
        let key = &self.table.entry(at).key;
        self.policy_for(rehash(key), key)
    }

    /// Nanoseconds until the entry at `at` is untouched, under its own policy.
    fn reset_after(&self, at: usize, now: u64, rehash: &impl Fn(&K) -> u64) -> u64 {
        let policy = self.entry_policy(at, rehash);
        self.table.entry(at).state.reset_after_ns(policy, now)
    }

    /// How much evicting the entry at `at` would lose, as an ordering: first the units
    /// it has consumed, then the time until it is untouched.
    fn eviction_cost(&self, at: usize, now: u64, rehash: &impl Fn(&K) -> u64) -> (u64, u64) {
        let policy = self.entry_policy(at, rehash);
        let state = self.table.entry(at).state.peek(policy, now, 0);
        (state.limit() - state.remaining(), state.reset_after_ns())
    }

    /// Moves the eviction hand over up to `steps` entries (see [`Sweep`]). Returns how
    /// many were dropped and the soonest time, in ns, at which a visited survivor will
    /// be droppable.
    pub(crate) fn sweep(
        &mut self,
        now: u64,
        steps: usize,
        grace: Option<u64>,
        rehash: &impl Fn(&K) -> u64,
    ) -> (usize, u64) {
        let mut sweep = Sweep::new(now, grace);
        for _ in 0..steps.min(self.table.len()) {
            if self.hand >= self.table.len() {
                self.hand = 0;
            }
            let since = sweep.since(self.entry_policy(self.hand, rehash).quota().period_ns());
            let wait = self.reset_after(self.hand, since, rehash);
            let hand = self.hand;
            let table = &mut self.table;
            // A dropped entry's place takes the last entry: the hand looks at it next.
            if !sweep.visit(wait, || {
                table.remove_position(hand, rehash);
                true
            }) {
                self.hand += 1;
            } else if self.table.len() == 0 {
                break;
            }
        }
        sweep.finish()
    }

    /// Moves the eviction hand over up to `steps` entries, dropping those untouched as
    /// the full sweep judges them (see [`Sweep`]): so that an owner may sweep a little at
    /// a time. Returns how many were dropped.
    #[cfg(feature = "redis")]
    pub(crate) fn sweep_step(
        &mut self,
        now: u64,
        steps: usize,
        rehash: &impl Fn(&K) -> u64,
    ) -> usize {
        self.sweep(now, steps, Some(self.swept), rehash).0
    }

    /// The lossless sweep run before an insert, only when the table is full (the insert
    /// would grow its index): drops the keys untouched for a period and since the last
    /// such sweep (see [`Sweep`]), so the keys in use stay whatever their period, then
    /// grows the index now if the keys left fill more than 60% of it (so that a quarter of
    /// the table's inserts separate two full sweeps: O(1) per insert, amortised). Returns
    /// how many keys were dropped.
    pub(crate) fn sweep_if_full(&mut self, now: u64, rehash: &impl Fn(&K) -> u64) -> usize {
        if !self.table.is_full() {
            return 0;
        }
        let since = std::mem::replace(&mut self.swept, now);
        let (dropped, _) = self.sweep(now, self.table.len(), Some(since), rehash);
        self.table.grow_if_above(3, 5, rehash);
        dropped
    }

    /// Makes room for one key in a full store: an untouched key near the hand if there is
    /// one, else, under [`WhenFull::EvictLeastActive`], of a few sampled keys the one
    /// whose eviction loses the least: the fewest units consumed, then the soonest reset.
    pub(crate) fn make_room(
        &mut self,
        now: u64,
        when_full: WhenFull,
        rehash: &impl Fn(&K) -> u64,
    ) -> Room {
        let before = self.table.len();
        let (dropped, soonest) = self.sweep(now, SCAN_WHEN_FULL, None, rehash);
        if dropped > 0 {
            return Room::Untouched;
        }
        let fallback = self.policy.quota().emission_interval().as_nanos() as u64;
        if when_full == WhenFull::DenyNewKeys || before == 0 {
            return Room::none_until(soonest, fallback);
        }
        // With no more keys than samples, every key is a candidate: random draws could
        // miss the one that loses least.
        let len = self.table.len();
        let mut rng = self.rng;
        let victim = least_costly(len, len <= SAMPLES, SAMPLES, &mut rng, |at| {
            let entry = self.table.entry(at);
            entry
                .state
                .evictable()
                .then(|| self.eviction_cost(at, now, rehash))
        });
        self.rng = rng;
        let Some(at) = victim else {
            // Nothing sampled can go without losing what it owes: refuse the new key, as
            // `DenyNewKeys` would, until something can.
            return Room::none_until(u64::MAX, fallback);
        };
        self.table.remove_position(at, rehash);
        Room::Active
    }

    /// Sets (`Some`) or clears (`None`) the policy of `key`, converting its state from
    /// the policy it had to the one it gets.
    pub(crate) fn set_key_quota(
        &mut self,
        hash: u64,
        key: K,
        policy: Option<S::Policy>,
        now: u64,
        rehash: impl Fn(&K) -> u64,
    ) {
        let policy = policy.map(|p| p.rebase(&self.policy));
        let old = *self.policy_for(hash, &key);
        let new = policy.unwrap_or(self.policy);
        if let Some(entry) = self.find(hash, &key) {
            entry.state.convert(now, &old, &new);
        }
        self.key_quotas
            .set(hash, key, policy, |a, b| a == b, |k: &K| rehash(k));
    }

    /// Replaces the default policy, converting the state of every key without an
    /// key quota.
    pub(crate) fn set_default(&mut self, policy: S::Policy, now: u64, rehash: impl Fn(&K) -> u64) {
        let entries = if S::CONVERTS { self.table.len() } else { 0 };
        for entry in self.table.iter().take(entries) {
            let has_key_quota = !self.key_quotas.is_empty()
                && self
                    .key_quotas
                    .get(rehash(&entry.key), |k| *k == entry.key)
                    .is_some();
            if !has_key_quota {
                entry.state.convert(now, &self.policy, &policy);
            }
        }
        self.policy = policy;
        self.key_quotas.rebase(&policy);
    }
}
