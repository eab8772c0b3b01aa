//! One shard: its keys' state, its copy of the default policy, and its per-key overrides.
//!
//! Keeping the policy inside the shard means a check reads its key's policy under the
//! shard read lock it already holds for the lookup: no extra lock, no extra atomic. A
//! quota change takes the shard's write lock, so no check ever sees a new policy with
//! state that has not been converted for it, or the reverse.

use std::borrow::Borrow;
use std::hash::Hash;

use hashbrown::HashTable;

use super::state::State;

/// One key and its state.
pub(crate) struct Slot<K, S> {
    pub(crate) key: K,
    pub(crate) state: S,
}

/// A key with its own policy.
struct Override<K, P> {
    key: K,
    policy: P,
}

/// The keys of one shard, under one lock.
pub(crate) struct Shard<K, S: State> {
    table: HashTable<Slot<K, S>>,
    /// The limiter's default policy.
    policy: S::Policy,
    /// Keys with their own policy, whether or not they hold state.
    overrides: HashTable<Override<K, S::Policy>>,
}

impl<K: Hash + Eq, S: State> Shard<K, S> {
    pub(crate) fn new(policy: S::Policy) -> Self {
        Self {
            table: HashTable::new(),
            policy,
            overrides: HashTable::new(),
        }
    }

    pub(crate) fn default_policy(&self) -> &S::Policy {
        &self.policy
    }

    /// The policy of `key`: its override, or the default. Costs nothing beyond a field
    /// read while no key of this shard has an override.
    #[inline]
    pub(crate) fn policy_for<Q>(&self, hash: u64, key: &Q) -> &S::Policy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.overrides.is_empty() {
            return &self.policy;
        }
        self.overrides
            .find(hash, |o| o.key.borrow() == key)
            .map_or(&self.policy, |o| &o.policy)
    }

    #[inline]
    pub(crate) fn find<Q>(&self, hash: u64, key: &Q) -> Option<&Slot<K, S>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table.find(hash, |slot| slot.key.borrow() == key)
    }

    /// Inserts a key known to be absent.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        slot: Slot<K, S>,
        rehash: impl Fn(&K) -> u64,
    ) -> &Slot<K, S> {
        self.table
            .insert_unique(hash, slot, |s| rehash(&s.key))
            .into_mut()
    }

    /// Removes `key`; true if it held state.
    pub(crate) fn remove<Q>(&mut self, hash: u64, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table
            .find_entry(hash, |slot| slot.key.borrow() == key)
            .map(|entry| entry.remove())
            .is_ok()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Drops every key whose state is back to untouched at `now` (dropping it changes no
    /// decision). Returns how many were dropped and the soonest time, in ns from `now`,
    /// at which one of the remaining keys will be untouched.
    pub(crate) fn sweep(&mut self, now: u64, rehash: impl Fn(&K) -> u64) -> (usize, u64) {
        let Self {
            table,
            policy,
            overrides,
        } = self;
        let before = table.len();
        let mut soonest = u64::MAX;
        table.retain(|slot| {
            let policy = if overrides.is_empty() {
                &*policy
            } else {
                let hash = rehash(&slot.key);
                overrides
                    .find(hash, |o| o.key == slot.key)
                    .map_or(&*policy, |o| &o.policy)
            };
            let wait = slot.state.reset_after_ns(policy, now);
            soonest = soonest.min(wait);
            wait > 0
        });
        (before - table.len(), soonest)
    }

    /// Sets (`Some`) or clears (`None`) the policy of `key`, converting its state from
    /// the policy it had to the one it gets.
    pub(crate) fn set_override(
        &mut self,
        hash: u64,
        key: K,
        policy: Option<S::Policy>,
        now: u64,
        rehash: impl Fn(&K) -> u64,
    ) {
        let old = *self.policy_for(hash, &key);
        let new = policy.unwrap_or(self.policy);
        if let Some(slot) = self.find(hash, &key) {
            slot.state.convert(now, &old, &new);
        }
        let entry = self
            .overrides
            .entry(hash, |o| o.key == key, |o| rehash(&o.key));
        match (entry, policy) {
            (hashbrown::hash_table::Entry::Occupied(mut o), Some(policy)) => {
                o.get_mut().policy = policy
            }
            (hashbrown::hash_table::Entry::Occupied(o), None) => {
                o.remove();
            }
            (hashbrown::hash_table::Entry::Vacant(v), Some(policy)) => {
                v.insert(Override { key, policy });
            }
            (hashbrown::hash_table::Entry::Vacant(_), None) => {}
        }
    }

    /// Replaces the default policy, converting the state of every key without an
    /// override.
    pub(crate) fn set_default(&mut self, policy: S::Policy, now: u64, rehash: impl Fn(&K) -> u64) {
        for slot in self.table.iter() {
            let has_override = !self.overrides.is_empty()
                && self
                    .overrides
                    .find(rehash(&slot.key), |o| o.key == slot.key)
                    .is_some();
            if !has_override {
                slot.state.convert(now, &self.policy, &policy);
            }
        }
        self.policy = policy;
    }
}
