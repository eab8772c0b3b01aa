//! Several quotas on every key, decided all or nothing.
//!
//! Two quotas share one store whose slots hold both states in one 16-byte word
//! ([`PairPolicy`]): a check probes once and decides both with one compare-and-swap, so
//! it writes both or neither, and needs no refund. That needs lock-free 16-byte atomics
//! (`cmpxchg16b` and AVX on x86-64, detected at run time). A pair decides exactly as the
//! chain below does (a unit test runs both side by side).
//!
//! Three quotas or more (or two on a machine without those instructions) take a chain:
//! one [`WordStore`] per quota. A check goes through the quotas in order, consuming from
//! each that admits; the first that denies (or finds the cost beyond its capacity) ends
//! it, and the quotas already passed get their units back by an exact refund. So a check
//! consumes from every quota or from none, and is admitted only if every quota admits.
//!
//! Under concurrency on one key, the units a chain's doomed check holds between its
//! consumption and its refund (nanoseconds) are briefly unavailable: a request racing it
//! may be denied by a quota it would otherwise have passed. The reverse never happens:
//! nothing is ever admitted beyond any single quota's bound, whatever the interleaving,
//! since each quota's own store admits only what it can hold.
//!
//! Refunds are exact because each algorithm's refund undoes its own admission at the same
//! instant: the buckets move their state back by `cost·T` (to `max(tat, now)`, which
//! decides every later request as `tat` does), the windows lower the counts they raised.

use std::borrow::Borrow;
use std::hash::Hash;

use super::rule::PairPolicy;
use super::word::WordStore;
use super::{Limits, StoreStats};
use crate::algorithm::{Policy, Settle, WordPolicy};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;

/// The quotas' stores: the limiter's own quota first, then each `also` quota.
// One per limiter, and a pair's check reads its store in place: a box would add a
// pointer to follow on every check.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Compound<K> {
    /// Two quotas in one store, both states in each key's slot.
    Pair(WordStore<K, PairPolicy>),
    /// One store per quota.
    Chain(Box<[WordStore<K>]>),
}

impl<K: crate::Key> Compound<K> {
    /// The stores for `policies` (at least one), each with `limits` (so up to `max_keys`
    /// keys, each with every quota's state).
    pub(crate) fn new(limits: Limits, policies: Vec<WordPolicy>) -> Self {
        if let [first, second] = policies[..] {
            if let Some(pair) = PairPolicy::new([first, second]) {
                return Self::Pair(WordStore::new(limits, pair));
            }
        }
        Self::chain(limits, policies)
    }

    /// The bytes of the tables [`new`](Self::new) writes up front for `limits` and
    /// `quotas` quotas ([`WordStore::bytes_ahead`]).
    pub(crate) fn bytes_ahead(limits: Limits, quotas: usize) -> Option<usize> {
        if quotas == 2 && PairPolicy::available() {
            WordStore::<K, PairPolicy>::bytes_ahead(limits)
        } else {
            WordStore::<K>::bytes_ahead(limits)?.checked_mul(quotas)
        }
    }

    /// One store per policy, whatever their number.
    pub(crate) fn chain(limits: Limits, policies: Vec<WordPolicy>) -> Self {
        Self::Chain(
            policies
                .into_iter()
                .map(|policy| WordStore::new(limits, policy))
                .collect(),
        )
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
        match self {
            Self::Pair(pair) => pair.check(key, now, cost, max_delay),
            Self::Chain(stores) => {
                check_all(&**stores, key, now(), cost, max_delay, |decided| decided)
            }
        }
    }

    /// [`check`](Self::check) of a unit request, whose cost every quota can hold: the
    /// decision itself, written straight to the caller's (see [`check_all`]'s `out`).
    #[inline]
    pub(crate) fn check_unit<Q>(&self, key: &Q, now: u64) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        match self {
            Self::Pair(pair) => crate::decision::unit(pair.check(key, || now, 1, u64::MAX)),
            Self::Chain(stores) => {
                check_all(&**stores, key, now, 1, u64::MAX, crate::decision::unit)
            }
        }
    }

    /// Applies `settle` to every quota; the most constraining result (a capacity refusal
    /// of a new key, if any quota's store had no room for it: the quotas before it then
    /// give the charge back, so nothing changes).
    pub(crate) fn settle<Q>(&self, key: &Q, now: u64, settle: Settle) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let stores = match self {
            // Both quotas at once: a capacity refusal changes neither.
            Self::Pair(pair) => return pair.settle(key, now, settle),
            Self::Chain(stores) => stores,
        };
        // A capacity refusal of a new key comes as a decision: it ends the settlement.
        settle
            .all(stores.iter(), |store, settle| {
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
        match self {
            Self::Pair(pair) => pair.peek(key, now, cost),
            Self::Chain(stores) => peek_all(&**stores, key, now, cost),
        }
    }

    /// Removes `key`'s state under every quota; true if any held it.
    pub(crate) fn remove<Q>(&self, key: &Q, now: impl Fn() -> u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        match self {
            Self::Pair(pair) => pair.remove(key, now),
            Self::Chain(stores) => stores
                .iter()
                .fold(false, |any, store| store.remove(key, &now) | any),
        }
    }

    /// Every quota's default policy, the limiter's own first.
    pub(crate) fn policies(&self) -> Vec<WordPolicy> {
        match self {
            Self::Pair(pair) => pair.default_rule().policies().to_vec(),
            Self::Chain(stores) => stores.iter().map(WordStore::default_policy).collect(),
        }
    }

    /// Every quota, the limiter's own first.
    pub(crate) fn quotas(&self) -> Vec<Quota> {
        use crate::algorithm::Policy;
        self.policies().iter().map(Policy::quota).collect()
    }

    /// The quotas after the first, each with its capacity.
    #[cfg(feature = "tower")]
    pub(crate) fn also_policies(&self) -> Vec<(Quota, u64)> {
        use crate::algorithm::Policy;
        self.policies()[1..]
            .iter()
            .map(|policy| (policy.quota(), policy.capacity()))
            .collect()
    }

    /// The most a single request may cost: the smallest capacity of all quotas.
    pub(crate) fn capacity(&self) -> u64 {
        use crate::algorithm::Policy;
        self.policies()
            .iter()
            .map(Policy::capacity)
            .min()
            .unwrap_or(0)
    }

    /// Keys held: the most any quota's store holds (in a chain, each key is in the first
    /// store from its first check on, until the first quota's state of it is untouched
    /// and swept).
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Pair(pair) => pair.len(),
            Self::Chain(stores) => stores.iter().map(WordStore::len).max().unwrap_or(0),
        }
    }

    /// The stores' counters summed; `keys` as [`len`](Self::len).
    pub(crate) fn stats(&self) -> StoreStats {
        match self {
            Self::Pair(pair) => pair.stats(),
            Self::Chain(stores) => StoreStats::of_quotas(stores.iter().map(WordStore::stats)),
        }
    }

    /// Changes every quota: `quotas` holds one per store, in order (checked by the
    /// caller). Each quota's state carries over as a default-quota change carries it.
    pub(crate) fn set_quotas(
        &self,
        quotas: &[Quota],
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        match self {
            Self::Pair(pair) => pair.set_default_rule(
                |rule| {
                    let [first, second] = rule.policies();
                    Ok(rule.with_policies([
                        first.with_quota(quotas[0])?,
                        second.with_quota(quotas[1])?,
                    ]))
                },
                now,
            ),
            Self::Chain(stores) => {
                // Every policy first, so that a quota no store can hold changes nothing.
                let policies = stores
                    .iter()
                    .zip(quotas)
                    .map(|(store, &quota)| store.default_policy().with_quota(quota))
                    .collect::<Result<Vec<_>, _>>()?;
                for (store, policy) in stores.iter().zip(policies) {
                    store.set_default_rule(|_| Ok(policy), &now)?;
                }
                Ok(())
            }
        }
    }

    /// Changes the limiter's own quota (the first); the `also` quotas stay.
    pub(crate) fn set_default_quota(
        &self,
        quota: Quota,
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        match self {
            Self::Pair(pair) => pair.set_default_quota(quota, now),
            Self::Chain(stores) => stores[0].set_default_quota(quota, now),
        }
    }
}

/// The per-key quota and configuration calls, which act on the limiter's own quota (the
/// first): the same names as [`WordStore`]'s, so the limiter calls either alike.
impl<K: crate::Key> Compound<K> {
    pub(crate) fn default_policy(&self) -> WordPolicy {
        match self {
            Self::Pair(pair) => pair.default_policy(),
            Self::Chain(stores) => stores[0].default_policy(),
        }
    }

    pub(crate) fn shard_count(&self) -> usize {
        match self {
            Self::Pair(pair) => pair.shard_count(),
            Self::Chain(stores) => stores[0].shard_count(),
        }
    }

    pub(crate) fn set_key_quota(&self, key: K, policy: Option<WordPolicy>, now: impl Fn() -> u64) {
        match self {
            Self::Pair(pair) => pair.set_key_quota(key, policy, now),
            Self::Chain(stores) => stores[0].set_key_quota(key, policy, now),
        }
    }

    pub(crate) fn policy_of<Q>(&self, key: &Q) -> WordPolicy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        match self {
            Self::Pair(pair) => pair.policy_of(key),
            Self::Chain(stores) => stores[0].policy_of(key),
        }
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

    /// [`part_check`](Self::part_check)'s lock-free path, if the quota has one: the
    /// decision of a key it holds, or `None` with nothing consumed (then `part_check`
    /// decides). By default, `None`.
    #[inline(always)]
    fn part_check_held<Q>(
        &self,
        _key: &Q,
        _now: u64,
        _cost: u64,
        _max_delay: u64,
    ) -> Option<Decision>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        None
    }

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

    #[inline(always)]
    fn part_check_held<Q>(&self, key: &Q, now: u64, cost: u64, max_delay: u64) -> Option<Decision>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.check_held(key, now, cost, max_delay)
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
/// nothing (see the module docs), and returns `out` of the result.
///
/// `out` is applied on each path separately, so that a caller wanting the decision in
/// another shape (a unit check's plain `Decision`) gets the common case's built in
/// place from registers, rather than copied out of a merged result.
#[inline]
pub(crate) fn check_all<K, Q, R>(
    parts: &(impl Parts<K> + ?Sized),
    key: &Q,
    now: u64,
    cost: u64,
    max_delay: u64,
    out: impl FnOnce(Result<Decision, InsufficientCapacity>) -> R,
) -> R
where
    K: Borrow<Q>,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    // The common case first: every quota holds the key and admits on its lock-free
    // path, and the merged decision returns from here, in registers. Any other case
    // goes on in `check_from`, from the first quota this path did not admit. (One path
    // for both merged the decisions through the stack, where the copy out stalled on
    // store forwarding: a third of the samples of a two-quota check.)
    // At least one part: the limiter's own quota, whose decision is about policy 0.
    let mut admitted = match parts.part(0).part_check_held(key, now, cost, max_delay) {
        Some(decision) if decision.is_allowed() => decision.for_policy(0),
        held => return out(check_from(parts, key, now, cost, max_delay, 0, None, held)),
    };
    for i in 1..parts.count() {
        match parts.part(i).part_check_held(key, now, cost, max_delay) {
            Some(decision) if decision.is_allowed() => {
                admitted = admitted.tighter(decision.for_policy(i));
            }
            held => {
                let admitted = Some(admitted);
                return out(check_from(
                    parts, key, now, cost, max_delay, i, admitted, held,
                ));
            }
        }
    }
    out(Ok(admitted))
}

/// [`check_all`] from quota `start` on, the quotas before it having admitted (their
/// merged decision `admitted`, `None` if `start` is 0); `held` is quota `start`'s
/// decision if its lock-free path made one (a deny), else it is asked in full.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn check_from<K, Q>(
    parts: &(impl Parts<K> + ?Sized),
    key: &Q,
    now: u64,
    cost: u64,
    max_delay: u64,
    start: usize,
    admitted: Option<Decision>,
    held: Option<Decision>,
) -> Result<Decision, InsufficientCapacity>
where
    K: Borrow<Q>,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    let mut admitted = admitted;
    let mut held = held;
    for i in start..parts.count() {
        let decided = match held.take() {
            Some(decision) => Ok(decision),
            None => parts.part(i).part_check(key, now, cost, max_delay),
        };
        match decided {
            Ok(decision) if decision.is_allowed() => {
                let decision = decision.for_policy(i);
                admitted = Some(admitted.map_or(decision, |a| a.tighter(decision)));
            }
            Ok(deny) => return denied(parts, key, now, cost, i, deny.for_policy(i)),
            Err(too_large) => {
                give_back(parts, i, key, now, cost);
                return Err(too_large);
            }
        }
    }
    // `parts` has at least one quota, so some decision was made.
    Ok(admitted.unwrap_or_else(|| Decision::allow(0, 0, 0)))
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

    impl<K: crate::Key> Compound<K> {
        /// A chain's stores.
        fn stores(&self) -> &[WordStore<K>] {
            match self {
                Self::Chain(stores) => stores,
                Self::Pair(_) => panic!("a pair has one store"),
            }
        }
    }

    /// A charge that one quota's store has no room for changes no quota: the quotas
    /// before it give it back.
    #[test]
    fn a_charge_one_quota_has_no_room_for_changes_nothing() {
        let limits = Limits {
            shards: 1,
            max_keys: 2,
            when_full: WhenFull::DenyNewKeys,
            sweep: true,
            expected_keys: 0,
        };
        // The first quota's keys are untouched again after a millisecond (swept to make
        // room); the second's hold for an hour.
        let fast = WordPolicy::token_bucket("1000/s".parse().unwrap());
        let slow = WordPolicy::token_bucket("1/h".parse().unwrap());
        let both: Compound<u64> = Compound::chain(limits, vec![fast, slow]);
        for key in [1, 2] {
            assert!(both.check(&key, || 0, 1, u64::MAX).unwrap().is_allowed());
        }
        let now = 1_000_000_000;
        let refused = both.settle(&3, now, Settle::Charge(5_000));
        assert!(refused.is_capacity_deny(), "{refused:?}");
        let first = both.stores()[0].peek(&3, now, 1).unwrap();
        assert!(
            first.is_allowed(),
            "the first quota kept the charge: {first:?}"
        );
        assert_eq!(first.remaining(), 1000);
    }

    /// Every way a compound check can leave its lock-free path (a key new to every
    /// quota, new to the second only or to the first only, a deny by the second quota on
    /// its lock-free path and from its deny cache, a cost the second quota can never
    /// hold) decides as the quotas do, all or nothing.
    #[test]
    fn every_path_of_a_compound_check_decides_all_or_nothing() {
        let limits = Limits {
            shards: 1,
            max_keys: 100,
            when_full: WhenFull::EvictLeastActive,
            sweep: true,
            expected_keys: 0,
        };
        let tens = WordPolicy::token_bucket("10/s".parse().unwrap());
        let hourly = WordPolicy::token_bucket("3/h".parse().unwrap());
        let both: Compound<u64> = Compound::chain(limits, vec![tens, hourly]);
        let now = 1_000_000_000;
        let left = |part: usize| both.stores()[part].peek(&1, now, 1).unwrap().remaining();
        // New to both; then held by both (the lock-free path): the hourly quota is the
        // tighter, so its `remaining` is the decision's.
        for expected in [2, 1, 0] {
            let decision = both.check_unit(&1, now);
            assert!(decision.is_allowed(), "{decision:?}");
            assert_eq!((decision.remaining(), decision.policy()), (expected, 1));
        }
        assert_eq!(left(0), 7);
        // Denied by the hourly quota: on its lock-free path, then from its deny cache.
        // The first quota gets its unit back each time.
        for _ in 0..2 {
            let decision = both.check_unit(&1, now);
            assert!(!decision.is_allowed(), "{decision:?}");
            assert_eq!(decision.policy(), 1);
            assert_eq!(decision.retry_after_ns(), 1_200_000_000_000);
            assert_eq!(left(0), 7);
        }
        // Held by the first quota only: admitted by both, consumed from both.
        assert!(both.stores()[1].remove(&1, || now));
        let decision = both.check_unit(&1, now);
        assert!(decision.is_allowed(), "{decision:?}");
        assert_eq!((decision.remaining(), left(0), left(1)), (2, 6, 2));
        // Held by the second quota only.
        assert!(both.stores()[0].remove(&1, || now));
        let decision = both.check_unit(&1, now);
        assert!(decision.is_allowed(), "{decision:?}");
        assert_eq!((decision.remaining(), left(0), left(1)), (1, 9, 1));
        // A cost the hourly quota can never hold: the error, and nothing consumed.
        let too_large = both.check(&1, || now, 5, u64::MAX).unwrap_err();
        assert_eq!((too_large.requested, too_large.capacity), (5, 3));
        assert_eq!((left(0), left(1)), (9, 1));
    }

    /// Two quotas in one slot decide as the chain of two stores does: every check,
    /// check of several units, delayed admission, charge, refund, peek, removal, and
    /// default and per-key quota change, over random timelines, for every word algorithm
    /// and quotas from 1 per hour to 100,000 per second. The decisions are equal field by
    /// field (the quota a decision names among them).
    #[test]
    fn a_pair_decides_as_the_chain_of_its_two_stores() {
        use crate::algorithm::{Algorithm, AnyPolicy};
        let limits = Limits {
            shards: 2,
            max_keys: 10_000,
            when_full: WhenFull::EvictLeastActive,
            sweep: true,
            expected_keys: 0,
        };
        let quotas = [
            "1/h",
            "3/s burst 2",
            "10/s burst 20",
            "100000/s",
            "7/s",
            "1000/day burst 50",
        ];
        let algorithms = [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut steps = 0;
        for scenario in 0..240 {
            let algorithm = algorithms[scenario % algorithms.len()];
            let policy = |quota: &str| match AnyPolicy::new(algorithm, quota.parse().unwrap(), 0) {
                Ok(AnyPolicy::Word(policy)) => policy,
                _ => unreachable!("a word algorithm"),
            };
            let first = quotas[(next() % quotas.len() as u64) as usize];
            let second = quotas[(next() % quotas.len() as u64) as usize];
            let pair: Compound<u64> = Compound::new(limits, vec![policy(first), policy(second)]);
            assert!(
                matches!(pair, Compound::Pair(_)),
                "this machine has cmpxchg16b"
            );
            let chain: Compound<u64> = Compound::chain(limits, vec![policy(first), policy(second)]);
            let charges = WordPolicy::settles(algorithm, Settle::Charge(1));
            let mut now = 1_000_000_000u64;
            for step in 0..300 {
                steps += 1;
                let r = next();
                now += match r % 4 {
                    0 => 0,
                    1 => r >> 40 & 0xffff,
                    2 => (r >> 32) % 200_000_000,
                    _ => (r >> 32) % 5_000_000_000,
                };
                let key = (r >> 8) % 5;
                let what = (r >> 16) % 16;
                let context = || format!("{algorithm} {first} + {second}, step {step}, op {what}");
                match what {
                    0 => assert_eq!(
                        pair.peek(&key, now, 1),
                        chain.peek(&key, now, 1),
                        "{}",
                        context()
                    ),
                    // Whether a store held the key may differ (a chain's stores sweep
                    // untouched keys each on its own schedule); the decisions after
                    // may not.
                    1 => {
                        pair.remove(&key, || now);
                        chain.remove(&key, || now);
                    }
                    2 if charges => {
                        let n = (r >> 24) % 4;
                        assert_eq!(
                            pair.settle(&key, now, Settle::Charge(n)),
                            chain.settle(&key, now, Settle::Charge(n)),
                            "{}",
                            context()
                        );
                    }
                    3 => {
                        let n = (r >> 24) % 4;
                        assert_eq!(
                            pair.settle(&key, now, Settle::Refund(n)),
                            chain.settle(&key, now, Settle::Refund(n)),
                            "{}",
                            context()
                        );
                    }
                    4 if step % 50 == 0 => {
                        let quota: Quota =
                            quotas[(r >> 24) as usize % quotas.len()].parse().unwrap();
                        let a = pair.set_default_quota(quota, || now).is_ok();
                        let b = chain.set_default_quota(quota, || now).is_ok();
                        assert_eq!(a, b, "{}", context());
                    }
                    5 if step % 30 == 0 => {
                        let own = (r >> 24) % 2 == 0;
                        let quota = own.then(|| policy(quotas[(r >> 32) as usize % quotas.len()]));
                        pair.set_key_quota(key, quota, || now);
                        chain.set_key_quota(key, quota, || now);
                        assert_eq!(pair.policy_of(&key), chain.policy_of(&key), "{}", context());
                    }
                    6 | 7 => {
                        let cost = (r >> 24) % 5;
                        let (a, b) = (
                            pair.check(&key, || now, cost, u64::MAX),
                            chain.check(&key, || now, cost, u64::MAX),
                        );
                        assert_eq!(a, b, "{}", context());
                    }
                    8 if algorithm == Algorithm::LeakyBucket => {
                        let max_delay = (r >> 24) % 2_000_000_000;
                        let (a, b) = (
                            pair.check(&key, || now, 1, max_delay),
                            chain.check(&key, || now, 1, max_delay),
                        );
                        assert_eq!(a, b, "{}", context());
                    }
                    _ => assert_eq!(
                        pair.check_unit(&key, now),
                        chain.check_unit(&key, now),
                        "{}",
                        context()
                    ),
                }
            }
            assert_eq!(pair.quotas(), chain.quotas());
            assert_eq!(pair.capacity(), chain.capacity());
        }
        assert_eq!(steps, 240 * 300);
    }
}
