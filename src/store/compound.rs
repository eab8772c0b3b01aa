//! Several quotas on every key, decided all or nothing: one [`WordStore`] per quota.
//!
//! A check goes through the quotas in order, consuming from each that admits; the first
//! that denies (or finds the cost beyond its capacity) ends it, and the quotas already
//! passed get their units back by an exact refund. So a check consumes from every quota
//! or from none, and is admitted only if every quota admits.
//!
//! Under concurrency on one key, the units a doomed check holds between its consumption
//! and its refund (nanoseconds) are briefly unavailable: a request racing it may be denied
//! by a quota it would otherwise have passed. The reverse never happens: nothing is ever
//! admitted beyond any single quota's bound, whatever the interleaving, since each quota's
//! own store admits only what it can hold.
//!
//! Refunds are exact because each algorithm's refund undoes its own admission at the same
//! instant: the buckets move their state back by `cost·T` (to `max(tat, now)`, which
//! decides every later request as `tat` does), the windows lower the counts they raised.

use std::borrow::Borrow;
use std::hash::Hash;

use super::word::WordStore;
use super::{Limits, StoreStats};
use crate::algorithm::{Settle, WordPolicy};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;

/// One store per quota: the limiter's own quota first, then each `also` quota.
pub(crate) struct Compound<K> {
    stores: Box<[WordStore<K>]>,
}

impl<K: crate::Key> Compound<K> {
    /// A store per policy, each with `limits` (so up to `max_keys` keys per quota).
    pub(crate) fn new(limits: Limits, policies: Vec<WordPolicy>) -> Self {
        Self {
            stores: policies
                .into_iter()
                .map(|policy| WordStore::new(limits, policy))
                .collect(),
        }
    }

    /// Decides a request of `cost` for `key` at `now` under every quota, all or nothing
    /// (see the module docs).
    #[inline]
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
        check_all(&*self.stores, key, now(), cost, max_delay)
    }

    /// Applies `settle` to every quota; the most constraining result (a capacity refusal
    /// of a new key, if any quota's store had no room for it: the quotas before it then
    /// give the charge back, so nothing changes).
    pub(crate) fn settle<Q>(&self, key: &Q, now: u64, settle: Settle) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // A capacity refusal of a new key comes as a decision: it ends the settlement.
        settle
            .all(self.stores.iter(), |store, settle| {
                let decision = store.settle(key, now, settle);
                if decision.is_capacity_deny() {
                    Err(decision)
                } else {
                    Ok(decision)
                }
            })
            .unwrap_or_else(|refused| refused)
    }

    /// The decision a request of `cost` would get at `now` under every quota, consuming
    /// nothing.
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
        peek_all(&*self.stores, key, now, cost)
    }

    /// Removes `key`'s state under every quota; true if any held it.
    pub(crate) fn remove<Q>(&self, key: &Q, now: impl Fn() -> u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.stores
            .iter()
            .fold(false, |any, store| store.remove(key, &now) | any)
    }

    /// The limiter's own quota's store: per-key quotas, the default quota and the shard
    /// count are its.
    pub(crate) fn first(&self) -> &WordStore<K> {
        &self.stores[0]
    }

    /// Every quota, the limiter's own first.
    pub(crate) fn quotas(&self) -> Vec<Quota> {
        use crate::algorithm::Policy;
        self.stores
            .iter()
            .map(|s| s.default_policy().quota())
            .collect()
    }

    /// The quotas after the first, each with its capacity.
    #[cfg(feature = "tower")]
    pub(crate) fn also_policies(&self) -> Vec<(Quota, u64)> {
        use crate::algorithm::Policy;
        self.stores[1..]
            .iter()
            .map(|s| {
                let policy = s.default_policy();
                (policy.quota(), policy.capacity())
            })
            .collect()
    }

    /// The most a single request may cost: the smallest capacity of all quotas.
    pub(crate) fn capacity(&self) -> u64 {
        use crate::algorithm::Policy;
        self.stores
            .iter()
            .map(|s| s.default_policy().capacity())
            .min()
            .unwrap_or(0)
    }

    /// Keys held: the most any quota's store holds (each key is in the first store from
    /// its first check on, until the first quota's state of it is untouched and swept).
    pub(crate) fn len(&self) -> usize {
        self.stores.iter().map(WordStore::len).max().unwrap_or(0)
    }

    /// The stores' counters summed; `keys` as [`len`](Self::len).
    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats::of_quotas(self.stores.iter().map(WordStore::stats))
    }

    /// Changes the limiter's own quota (the first); the `also` quotas stay.
    pub(crate) fn set_default_quota(
        &self,
        quota: Quota,
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        self.first().set_default_quota(quota, now)
    }
}

/// The per-key quota and configuration calls, which act on the limiter's own quota (the
/// first): the same names as [`WordStore`]'s, so the limiter calls either alike.
impl<K: crate::Key> Compound<K> {
    pub(crate) fn default_policy(&self) -> WordPolicy {
        self.first().default_policy()
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.first().shard_count()
    }

    pub(crate) fn set_key_quota(&self, key: K, policy: Option<WordPolicy>, now: impl Fn() -> u64) {
        self.first().set_key_quota(key, policy, now);
    }

    pub(crate) fn policy_of<Q>(&self, key: &Q) -> WordPolicy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.first().policy_of(key)
    }
}

/// One quota of a compound decision: a store that checks a key, gives back what a check
/// just admitted, and peeks.
pub(crate) trait Part<K> {
    /// Decides a request of `cost` at `now`, consuming it if admitted.
    fn part_check<Q>(
        &self,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized;

    /// Gives back `cost` units this quota admitted at `now` for a compound check that
    /// another quota denied; the units the key has left after, if it is held.
    fn part_give_back<Q>(&self, key: &Q, now: u64, cost: u64) -> Option<u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized;

    /// The decision a request of `cost` would get at `now`, consuming nothing.
    fn part_peek<Q>(&self, key: &Q, now: u64, cost: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized;
}

impl<K: crate::Key> Part<K> for WordStore<K> {
    #[inline]
    fn part_check<Q>(
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
        self.check(key, || now, cost, max_delay)
    }

    fn part_give_back<Q>(&self, key: &Q, now: u64, cost: u64) -> Option<u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // A refund takes any amount, and finds the key it just admitted.
        Some(self.settle(key, now, Settle::Refund(cost)).remaining())
    }

    fn part_peek<Q>(&self, key: &Q, now: u64, cost: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.peek(key, now, cost)
    }
}

/// The quotas of a compound decision, the limiter's own first: indexed, so that a check
/// walks them without collecting them anywhere.
pub(crate) trait Parts<K> {
    /// One quota's store.
    type Part: Part<K>;
    /// How many quotas (at least one).
    fn count(&self) -> usize;
    /// Quota `i`, for `i < count()`.
    fn part(&self, i: usize) -> &Self::Part;
}

impl<K, P: Part<K>> Parts<K> for [P] {
    type Part = P;

    fn count(&self) -> usize {
        self.len()
    }

    fn part(&self, i: usize) -> &P {
        &self[i]
    }
}

/// Decides a request of `cost` for `key` at `now` under every quota of `parts`, all or
/// nothing (see the module docs).
#[inline]
pub(crate) fn check_all<K, Q>(
    parts: &(impl Parts<K> + ?Sized),
    key: &Q,
    now: u64,
    cost: u64,
    max_delay: u64,
) -> Result<Decision, InsufficientCapacity>
where
    K: Borrow<Q>,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    // At least one part: the limiter's own quota, whose decision is about policy 0.
    let mut admitted = match parts.part(0).part_check(key, now, cost, max_delay)? {
        decision if decision.is_allowed() => decision.for_policy(0),
        deny => return denied(parts, key, now, cost, 0, deny.for_policy(0)),
    };
    for i in 1..parts.count() {
        match parts.part(i).part_check(key, now, cost, max_delay) {
            Ok(decision) if decision.is_allowed() => {
                admitted = admitted.tighter(decision.for_policy(i));
            }
            Ok(deny) => return denied(parts, key, now, cost, i, deny.for_policy(i)),
            Err(too_large) => {
                give_back(parts, i, key, now, cost);
                return Err(too_large);
            }
        }
    }
    Ok(admitted)
}

/// The compound deny of a request that quota `at` denied (`deny`): the quotas before it
/// get their units back, the ones after it are asked without consuming, and the decision
/// is the longest wait among those that deny, with the fewest units left. A later quota
/// that can never admit the cost makes it that error instead.
#[cold]
fn denied<K, Q>(
    parts: &(impl Parts<K> + ?Sized),
    key: &Q,
    now: u64,
    cost: u64,
    at: usize,
    deny: Decision,
) -> Result<Decision, InsufficientCapacity>
where
    K: Borrow<Q>,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    let mut fewest = give_back(parts, at, key, now, cost).min(deny.remaining());
    let mut decision = deny;
    for i in at + 1..parts.count() {
        let later = parts.part(i).part_peek(key, now, cost)?;
        fewest = fewest.min(later.remaining());
        if !later.is_allowed() {
            decision = decision.tighter(later.for_policy(i));
        }
    }
    Ok(decision.with_fewest(fewest))
}

/// Gives `cost` back to the quotas before `upto`, which admitted it; returns the fewest
/// units they have left after.
fn give_back<K, Q>(
    parts: &(impl Parts<K> + ?Sized),
    upto: usize,
    key: &Q,
    now: u64,
    cost: u64,
) -> u64
where
    K: Borrow<Q>,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    if cost == 0 {
        return u64::MAX;
    }
    (0..upto)
        .filter_map(|i| parts.part(i).part_give_back(key, now, cost))
        .fold(u64::MAX, u64::min)
}

/// The decision a request of `cost` for `key` would get at `now` under every quota of
/// `parts`, consuming nothing.
pub(crate) fn peek_all<K, Q>(
    parts: &(impl Parts<K> + ?Sized),
    key: &Q,
    now: u64,
    cost: u64,
) -> Result<Decision, InsufficientCapacity>
where
    K: Borrow<Q>,
    Q: Hash + Eq + ?Sized,
{
    let mut too_large = None;
    let decisions = (0..parts.count()).map_while(|i| {
        parts
            .part(i)
            .part_peek(key, now, cost)
            .map_err(|e| too_large = Some(e))
            .ok()
            .map(|d| d.for_policy(i))
    });
    let decision = Decision::all_of(decisions);
    match too_large {
        Some(e) => Err(e),
        None => Ok(decision.unwrap_or_else(|| Decision::allow(0, 0, 0))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::WhenFull;

    /// A charge that one quota's store has no room for changes no quota: the quotas
    /// before it give it back.
    #[test]
    fn a_charge_one_quota_has_no_room_for_changes_nothing() {
        let limits = Limits {
            shards: 1,
            max_keys: 2,
            when_full: WhenFull::DenyNewKeys,
            sweep: true,
        };
        // The first quota's keys are untouched again after a millisecond (swept to make
        // room); the second's hold for an hour.
        let fast = WordPolicy::token_bucket("1000/s".parse().unwrap());
        let slow = WordPolicy::token_bucket("1/h".parse().unwrap());
        let both: Compound<u64> = Compound::new(limits, vec![fast, slow]);
        for key in [1, 2] {
            assert!(both.check(&key, || 0, 1, u64::MAX).unwrap().is_allowed());
        }
        let now = 1_000_000_000;
        let refused = both.settle(&3, now, Settle::Charge(5_000));
        assert!(refused.is_capacity_deny(), "{refused:?}");
        let first = both.first().peek(&3, now, 1).unwrap();
        assert!(
            first.is_allowed(),
            "the first quota kept the charge: {first:?}"
        );
        assert_eq!(first.remaining(), 1000);
    }
}
