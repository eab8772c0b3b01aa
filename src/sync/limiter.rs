//! [`SyncedLimiter`]: a keyed limiter whose keys spend allowances a background sync
//! obtains from Redis.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::cell::SyncCell;
use crate::algorithm::Algorithm;
use crate::algorithm::Settle;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::{Decision, unit};
use crate::error::{ConfigError, InsufficientCapacity, SettleError};
use crate::limiter::{Common, Key};
use crate::quota::Quota;
use crate::store::{Part, Parts, Store, StoreStats, check_all, peek_all};

/// A keyed limiter that holds one limit across every node sharing a Redis: checks stay
/// in process (nanoseconds, no I/O), while a background task trades each key's use for
/// fresh allowance once per sync interval. Made by
/// [`Builder::build_synced`](crate::Builder::build_synced); see [the module's
/// docs](crate::sync) for the modes and their bounds.
///
/// `SyncedLimiter` is `Send + Sync` and cheap to clone; clones share the same state.
/// Every method works on it. A key's own quota ([`set_quota`](Self::set_quota)) is set
/// on every node at once: it travels with the key's rounds.
///
/// ```no_run
/// use tollgate::sync::RedisSync;
/// use tollgate::RateLimiter;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (limiter, handle) = RateLimiter::<String>::builder("100/s".parse()?)
///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
/// handle.ready().await; // the first round answered: new keys are admitted from now on
/// if !limiter.check("user_1024").is_allowed() {
///     // 429
/// }
/// limiter.set_quota("partner", "1000/s".parse()?)?; // on every node at once
/// handle.shutdown().await;
/// # Ok(())
/// # }
/// ```
pub struct SyncedLimiter<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

struct Inner<K, C> {
    store: Store<K, SyncCell>,
    common: Common<Arc<C>>,
    /// The last version this node gave a key's quota (see [`SharedQuota`]).
    version: AtomicU64,
    /// The [`also`](crate::Builder::also) quotas: each a limiter of its own quota, with a
    /// sync of its own (its handle is in this limiter's [`SyncHandle`]), sharing this
    /// limiter's clock.
    ///
    /// [`SyncHandle`]: super::SyncHandle
    also: Box<[SyncedLimiter<K, C>]>,
}

/// Sets `key`'s own policy in `store` at `now`, and makes sure the key's next round
/// carries it, whether or not the key is in use on this node (a cold key turns hot at
/// that round; meanwhile it admits at its cold share).
pub(super) fn set_key_policy<K, Q>(
    store: &Store<K, SyncCell>,
    key: &Q,
    policy: Option<super::cell::SyncPolicy>,
    now: u64,
) where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
{
    store.set_key_quota(key.to_owned(), policy, || now);
    // (A store full of keys that cannot go refuses the cell: the change then goes with
    // the key's first round.)
    store.upsert(key, now, |cell| {
        if super::key::is_cold(cell) {
            cell.want_hot(now);
        }
        cell.hot
            .flags
            .fetch_or(super::cell::QUOTA, Ordering::AcqRel);
    });
}

/// A synced limiter's quotas, its own first, for [`check_all`](crate::store::check_all).
struct Quotas<'a, K, C>(&'a Inner<K, C>);

impl<K: Key, C> Parts<K> for Quotas<'_, K, C> {
    type Part = Store<K, SyncCell>;

    fn count(&self) -> usize {
        1 + self.0.also.len()
    }

    fn part(&self, i: usize) -> &Self::Part {
        match i {
            0 => &self.0.store,
            _ => &self.0.also[i - 1].inner.store,
        }
    }
}

impl<K: Key> Part<K> for Store<K, SyncCell> {
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
        use crate::store::state::State;
        self.with_state_policy(key, |cell, policy| {
            cell.give_back(policy, now, cost);
            cell.peek(policy, now, 1).remaining()
        })
    }

    fn part_peek<Q>(&self, key: &Q, now: u64, cost: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.peek(key, now, cost)
    }
}

impl<K, C> Clone for SyncedLimiter<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K: Key, C> fmt::Debug for SyncedLimiter<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedLimiter")
            .field("name", &self.inner.common.name)
            .field("quota", &self.quota())
            .field("also", &self.also_quotas())
            .field("algorithm", &self.inner.common.algorithm)
            .field("keys", &self.len())
            .finish_non_exhaustive()
    }
}

impl<K: Key, C> SyncedLimiter<K, C> {
    /// How many keys hold state on this node.
    pub fn len(&self) -> usize {
        self.inner.store.len()
    }

    /// Whether no key holds state on this node.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This node's counters, as [`RateLimiter::stats`](crate::RateLimiter::stats). The
    /// sync's own counters are [`SyncHandle::stats`](super::SyncHandle::stats).
    pub fn stats(&self) -> StoreStats {
        let also = self.inner.also.iter().map(|q| q.inner.store.stats());
        let stores = StoreStats::of_quotas(std::iter::once(self.inner.store.stats()).chain(also));
        self.inner.common.stats(stores)
    }

    /// The limiter's name ([`Builder::name`](crate::Builder::name); `"default"` unless
    /// set).
    pub fn name(&self) -> &str {
        &self.inner.common.name
    }

    /// The quota every node together holds (the first, with
    /// [`also`](crate::Builder::also) quotas).
    pub fn quota(&self) -> Quota {
        self.inner.store.default_policy().quota
    }

    /// Every quota each key is held to: this limiter's own ([`quota`](Self::quota))
    /// first, then each [`also`](crate::Builder::also) quota in the order they were
    /// added.
    ///
    /// ```no_run
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (limiter, handle) = RateLimiter::<String>::builder("10/s burst 20".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// assert_eq!(limiter.quotas().len(), 2);
    /// assert_eq!(limiter.capacity(), 20); // the most one request may cost
    /// handle.ready().await; // every quota's first round answered
    /// let decision = limiter.check("tenant-a");
    /// if !decision.is_allowed() {
    ///     eprintln!("quota {} denies", decision.policy());
    /// }
    /// handle.shutdown().await; // every quota's task
    /// # Ok(())
    /// # }
    /// ```
    pub fn quotas(&self) -> Vec<Quota> {
        std::iter::once(self.quota())
            .chain(self.also_quotas())
            .collect()
    }

    fn also_quotas(&self) -> Vec<Quota> {
        self.inner.also.iter().map(SyncedLimiter::quota).collect()
    }

    /// The algorithm: any but [`Algorithm::SlidingLog`].
    pub fn algorithm(&self) -> Algorithm {
        self.inner.common.algorithm
    }

    /// The number of shards of the key map.
    pub fn shards(&self) -> usize {
        self.inner.store.shard_count()
    }

    /// The limiter's clock.
    pub fn clock(&self) -> &C {
        &self.inner.common.clock
    }

    /// The most a single request may cost: the burst for the token bucket, the limit for
    /// the sliding window; the smallest of them with [`also`](crate::Builder::also)
    /// quotas.
    pub fn capacity(&self) -> u64 {
        self.inner
            .also
            .iter()
            .map(SyncedLimiter::capacity)
            .fold(self.quota_capacity(), u64::min)
    }

    /// The capacity of this limiter's own quota (the first): what its sync leases, and
    /// what the HTTP layer's headers report for it.
    pub(crate) fn quota_capacity(&self) -> u64 {
        self.inner.store.default_policy().capacity
    }

    /// The [`also`](crate::Builder::also) quotas, each with its capacity.
    #[cfg(feature = "tower")]
    pub(crate) fn also_policies(&self) -> Vec<(Quota, u64)> {
        self.inner
            .also
            .iter()
            .map(|q| (q.quota(), q.quota_capacity()))
            .collect()
    }

    /// A limiter of `store`, whose sync task is not started yet, holding each key to the
    /// quotas of `also` too (limiters of one quota each, whose syncs have started).
    pub(super) fn new(
        store: Store<K, SyncCell>,
        common: Common<Arc<C>>,
        also: Vec<SyncedLimiter<K, C>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                common,
                version: AtomicU64::new(0),
                also: also.into_boxed_slice(),
            }),
        }
    }

    /// How many clones of this limiter exist (the sync task holds a few of its own).
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// The keys' cells, for the sync task.
    pub(crate) fn store(&self) -> &Store<K, SyncCell> {
        &self.inner.store
    }
}

impl<K: Key, C: Clock> SyncedLimiter<K, C> {
    /// Publishes the limiter's stats every second (inside a tokio runtime) for as long as
    /// it lives.
    #[cfg(feature = "metrics")]
    pub(super) fn publish_every_second(&self) {
        crate::observe::every_second(Arc::downgrade(&self.inner), |inner| {
            SyncedLimiter { inner }.stats();
        });
    }

    /// Checks one request for `key` and spends one unit of the key's allowance on this
    /// node if it is admitted.
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard (its write lock for a new key).
    #[inline(always)]
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let common = &self.inner.common;
        if !self.inner.also.is_empty() {
            return unit(self.check_n(key, 1));
        }
        // Inlined into the caller, so the decision's fields stay in registers.
        let decision = self.inner.store.check_unit(key, common.clock.now_ns());
        common.record(key, &decision);
        decision
    }

    /// Checks a request of cost `n` for `key`: all `n` units are admitted together, or
    /// none. A cost of 0 is always admitted.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] when `n` exceeds the quota's capacity.
    pub fn check_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.check_within(key, n, u64::MAX)
    }

    /// [`check_n`](Self::check_n), refusing (as a deny, consuming nothing) a leaky-bucket
    /// admission whose slot would be more than `max_delay` ns away.
    #[inline(always)]
    pub(crate) fn check_within<Q>(
        &self,
        key: &Q,
        n: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let common = &self.inner.common;
        let decided = if self.inner.also.is_empty() {
            self.inner
                .store
                .check(key, || common.clock.now_ns(), n, max_delay)
        } else {
            let now = common.clock.now_ns();
            check_all(&Quotas(&self.inner), key, now, n, max_delay, |decided| {
                decided
            })
        };
        common.record_n(key, &decided);
        decided
    }

    /// Gives `key` a quota of its own, on every node: the quota travels with the key's
    /// next round to Redis, which converts the key's global state (what was used of the
    /// old quota stays used: a change never hands out a fresh burst), and from there
    /// with each round's answer to every other node. When two nodes set a key's quota,
    /// the later call wins everywhere (by this node's wall clock, in µs). Until the round,
    /// this node's leases stand. The quota has the limiter's algorithm.
    ///
    /// With the cold tier ([`RedisSync::cold_keys`](super::RedisSync::cold_keys)), a key
    /// with a quota of its own starts hot on every node that knows the quota, and is
    /// announced hot while it is in use there, so the other nodes sync it and learn the
    /// quota at their next round. A node that has not learned it yet admits on a cold
    /// key at its cold share of the default quota until then (a key in use on no node
    /// that knows its quota stays cold: at most that share per such node).
    ///
    /// # Errors
    /// As [`build_synced`](crate::Builder::build_synced) for the quota, and
    /// [`ConfigError::ExceedsRedisPrecision`] for a quota whose conversion would not be
    /// exact in the round script.
    ///
    /// # Locking behaviour
    /// The write lock of the key's shard.
    pub fn set_quota<Q>(&self, key: &Q, quota: Quota) -> Result<(), ConfigError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let default = self.inner.store.default_policy();
        let policy = default.for_key(self.inner.common.algorithm, quota, self.next_version())?;
        self.set_key_policy(key, Some(policy));
        Ok(())
    }

    /// Whether `quota` can be a key's own quota here, as [`set_quota`](Self::set_quota)
    /// checks it.
    pub(super) fn key_quota_fits(&self, quota: Quota) -> Result<(), ConfigError> {
        let default = self.inner.store.default_policy();
        default
            .for_key(self.inner.common.algorithm, quota, 0)
            .map(drop)
    }

    /// Returns `key` to the default quota on every node, as
    /// [`set_quota`](Self::set_quota) sets one (the change travels with the key's
    /// rounds, and hands out no fresh burst). Nothing happens for a key without a quota
    /// of its own on this node.
    ///
    /// # Locking behaviour
    /// The write lock of the key's shard.
    pub fn remove_quota<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let store = &self.inner.store;
        if store.policy_of(key).shared.is_default() {
            return;
        }
        // Until Redis has it, the key keeps a mark: the default, at this version.
        let mark = store.default_policy().back_to_default(self.next_version());
        self.set_key_policy(key, Some(mark));
    }

    /// The quota `key` is limited by on this node: its own (set here, or learned from a
    /// round), or the default.
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard.
    pub fn quota_for<Q>(&self, key: &Q) -> Quota
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.store.policy_of(key).quota
    }

    /// Sets `key`'s own policy, and makes sure the key's next round carries it, whether
    /// or not the key is in use on this node (a cold key turns hot at that round;
    /// meanwhile it admits at its cold share).
    pub(super) fn set_key_policy<Q>(&self, key: &Q, policy: Option<super::cell::SyncPolicy>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        set_key_policy(&self.inner.store, key, policy, now);
    }

    /// A version for a key's quota set now: this node's wall clock in µs, above every
    /// version it gave before.
    fn next_version(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let mut next = 0;
        let _ = self
            .inner
            .version
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
                next = wall.max(last + 1);
                Some(next)
            });
        next
    }

    /// Consumes `n` units of `key`'s quota, **even beyond what is available**, for costs
    /// known only after the fact, as [`RateLimiter::charge`](crate::RateLimiter::charge)
    /// does in process: the charge spends what this node holds of the key (its lease,
    /// then its overdraft), and the rest puts the key into debt. Nothing waits for
    /// Redis: the key's next round raises the floor this node reports by `n`, Redis
    /// charges the global state with it, and no node is granted more of the key until
    /// the debt is repaid at the quota's rate. Returns the decision a unit request would
    /// get on this node right after. A cold key charges its cold share, and one left in
    /// debt turns hot, its first round reporting the debt.
    ///
    /// The pattern is to reserve an estimate with [`check_n`](Self::check_n) and settle
    /// the difference once the cost is known, on the node that reserved it.
    ///
    /// ```no_run
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (tokens, handle) = RateLimiter::<String>::builder("10000/min burst 4000".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// handle.ready().await;
    /// if tokens.check_n("tenant-a", 1_000)?.is_allowed() {
    ///     let used = 1_700; // known once the response is in
    ///     tokens.charge("tenant-a", used - 1_000)?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`SettleError::Unsupported`] for the window counters, which cannot hold a debt;
    /// [`SettleError::NoRoom`] when `key` is new and the store is full of keys that
    /// cannot go. Nothing changes then.
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard (its write lock for a new key).
    pub fn charge<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle(key, Settle::Charge(n))
    }

    /// Gives back up to `n` units of `key`'s quota, never beyond a full quota, as
    /// [`RateLimiter::refund`](crate::RateLimiter::refund) does in process. The key's
    /// next round lowers the floor this node reports by `n` (at most by what this node
    /// admitted on the key: units reserved on another node are refunded there), and
    /// Redis gives them back to the global state, never beyond full; the units reach
    /// this node's checks with the lease that round brings. A cold key gives them back
    /// to its cold share at once. Returns the decision a unit request would get on this
    /// node right after.
    ///
    /// ```no_run
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (calls, handle) = RateLimiter::<String>::builder("100/min".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// handle.ready().await;
    /// if calls.check("tenant-a").is_allowed() {
    ///     let upstream_failed = true;
    ///     if upstream_failed {
    ///         calls.refund("tenant-a", 1)?; // a failed call does not count, fleet-wide
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// None today: every algorithm the sync runs can refund; the type is
    /// [`RateLimiter::refund`](crate::RateLimiter::refund)'s.
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard; none for a key this node does not hold (it has
    /// admitted nothing on it to give back).
    pub fn refund<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle(key, Settle::Refund(n))
    }

    /// Applies `op` to every quota; the most constraining result. An unsupported
    /// settlement is refused before any quota changes, and a charge one quota has no
    /// room for is given back by the quotas before it.
    fn settle<Q>(&self, key: &Q, op: Settle) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if self.inner.also.is_empty() {
            return self.settle_own(key, op);
        }
        let algorithm = self.inner.common.algorithm;
        if !crate::algorithm::WordPolicy::settles(algorithm, op) {
            return Err(op.unsupported(algorithm));
        }
        // A charge given back is reported against the quotas before the refusal in their
        // next rounds.
        let quotas = std::iter::once(self).chain(&*self.inner.also);
        op.all(quotas, |quota, op| quota.settle_own(key, op))
    }

    /// Applies `op` to this limiter's own quota.
    fn settle_own<Q>(&self, key: &Q, op: Settle) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let common = &self.inner.common;
        // As in process: the window counters refund but cannot hold a debt.
        if !crate::algorithm::WordPolicy::settles(common.algorithm, op) {
            return Err(op.unsupported(common.algorithm));
        }
        let store = &self.inner.store;
        let now = common.clock.now_ns();
        // A key this node holds: one read lock, as a check takes.
        let settled = store.update(key, |cell, policy| cell.settle_then_peek(policy, now, op));
        match (settled, op) {
            (Some(after), _) => Ok(after),
            // Nothing held here: nothing this node admitted to give back.
            (None, Settle::Refund(_)) => Ok(self.peek_own(key)),
            (None, Settle::Charge(_)) => {
                let policy = store.policy_of(key);
                if !store.upsert(key, now, |cell| cell.settle(&policy, now, op)) {
                    return Err(SettleError::NoRoom {
                        retry_after: std::time::Duration::from_nanos(policy.interval_ns),
                    });
                }
                Ok(self.peek_own(key))
            }
        }
    }

    /// The decision a unit request would get under this limiter's own quota.
    fn peek_own<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        unit(self.inner.store.peek(key, now, 1))
    }

    /// The decision a unit request for `key` would get now on this node, consuming
    /// nothing and storing no key.
    pub fn peek<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        unit(self.peek_n(key, 1))
    }

    /// [`peek`](Self::peek) for a request of cost `n`.
    ///
    /// # Errors
    /// [`InsufficientCapacity`], as [`check_n`](Self::check_n).
    pub fn peek_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        if self.inner.also.is_empty() {
            return self.inner.store.peek(key, now, n);
        }
        peek_all(&Quotas(&self.inner), key, now, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::sync::cell::{Cold, OutageMode, SyncPolicy};

    /// A limiter of `policies` (its own first) with no sync task: its keys hold what
    /// the policies give them.
    fn limiter(policies: &[SyncPolicy]) -> SyncedLimiter<u64, ManualClock> {
        limiter_of(
            crate::RateLimiter::<u64>::builder(policies[0].quota),
            policies,
        )
    }

    /// [`limiter`], with the store limits of `builder`.
    fn limiter_of(
        builder: crate::Builder<u64>,
        policies: &[SyncPolicy],
    ) -> SyncedLimiter<u64, ManualClock> {
        let (common, limits, _) = builder.clock(ManualClock::new()).into_parts().unwrap();
        let common = common.shared();
        let also = policies[1..]
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                SyncedLimiter::new(Store::new(limits, p), common.for_quota(i + 1), Vec::new())
            })
            .collect();
        SyncedLimiter::new(Store::new(limits, policies[0]), common, also)
    }

    fn quota(n: u64) -> Quota {
        Quota::per_second(n).unwrap()
    }

    /// Quota `i`'s store.
    fn part(limiter: &SyncedLimiter<u64, ManualClock>, i: usize) -> &Store<u64, SyncCell> {
        match i {
            0 => &limiter.inner.store,
            _ => &limiter.inner.also[i - 1].inner.store,
        }
    }

    /// Hot keys with `fresh` units of overdraft each.
    fn hot(n: u64, fresh: u64) -> SyncPolicy {
        SyncPolicy::new(quota(n), n, fresh, 50_000_000)
    }

    impl SyncPolicy {
        /// The cold share at `t_ns` a token, its burst as it was.
        fn with_t(self, t_ns: u64) -> Self {
            let cold = self.cold.unwrap();
            let burst = cold.tau_ns / cold.t_ns + 1;
            Self {
                cold: Some(Cold::new(t_ns, burst, cold.until).for_new_keys(cold.new_keys)),
                ..self
            }
        }
    }

    /// Cold keys at a share of `burst` (1 ms a token).
    fn cold(n: u64, burst: u64) -> SyncPolicy {
        SyncPolicy {
            cold: Some(Cold::new(1_000_000, burst, u64::MAX)),
            ..hot(n, 0)
        }
    }

    /// A unit check (its own path, the decision returned from the branch that found the
    /// key) decides exactly as `check_n(key, 1)`: new and known keys, hot and cold,
    /// admitted and denied, under each outage mode, as the clock moves.
    #[test]
    fn a_unit_check_decides_as_check_n_of_one() {
        // Each policy, with whether its run admits some requests and denies some.
        let policies = [
            (hot(10, 3), true, true),
            (hot(10, 0), false, true),
            (cold(10, 4), true, true),
            (
                SyncPolicy {
                    outage: OutageMode::Open,
                    ..hot(10, 0)
                },
                true,
                false,
            ),
            (
                SyncPolicy {
                    outage: OutageMode::Closed,
                    ..cold(10, 4)
                },
                false,
                true,
            ),
        ];
        for (policy, admits, denies) in policies {
            let (unit, by_n) = (limiter(&[policy]), limiter(&[policy]));
            for step in 0..40u64 {
                let key = step % 2;
                let (a, b) = (unit.check(&key), by_n.check_n(&key, 1).unwrap());
                assert_eq!(a, b, "{policy:?}, step {step}");
                for l in [&unit, &by_n] {
                    l.inner
                        .common
                        .clock
                        .advance(std::time::Duration::from_micros(100));
                }
            }
            let (stats, by_n) = (unit.stats(), by_n.stats());
            assert_eq!(
                (stats.allowed, stats.denied),
                (by_n.allowed, by_n.denied),
                "{policy:?}"
            );
            assert_eq!(
                (stats.allowed > 0, stats.denied > 0),
                (admits, denies),
                "{policy:?}"
            );
        }
    }

    /// A hot key: the first quota's units spent by requests the second denied are
    /// refunded (for the next round's floor), so what it reports as consumed is exactly
    /// what was admitted; the second quota consumed only what was admitted.
    #[test]
    fn a_hot_deny_by_a_later_quota_refunds_the_earlier_ones() {
        let limiter = limiter(&[hot(100, 5), hot(100, 3)]);
        let admitted = (0..10).filter(|_| limiter.check(&7).is_allowed()).count() as u64;
        assert_eq!(admitted, 3);
        let consumed = |i: usize| {
            let store = part(&limiter, i);
            store
                .with_state(&7, |cell| {
                    let fresh = store.default_policy().fresh;
                    let spent = fresh - cell.hot.overdraft.load(Ordering::Acquire);
                    spent - cell.hot.aside.refunded.load(Ordering::Acquire)
                })
                .unwrap()
        };
        assert_eq!(consumed(0), admitted);
        assert_eq!(consumed(1), admitted);
        assert_eq!(limiter.stats().allowed, 3);
        assert_eq!(limiter.stats().denied, 7);
    }

    /// A cold key: the first quota's share takes the units back at once, so it never
    /// runs out on requests the second denied, and every deny is the second's.
    #[test]
    fn a_cold_deny_by_a_later_quota_leaves_the_earlier_ones_whole() {
        let limiter = limiter(&[cold(100, 5), cold(100, 3)]);
        let decisions: Vec<Decision> = (0..10).map(|_| limiter.check(&7)).collect();
        assert_eq!(decisions.iter().filter(|d| d.is_allowed()).count(), 3);
        assert!(
            decisions[3..].iter().all(|d| d.policy() == 1),
            "{decisions:?}"
        );
        let first = part(&limiter, 0).peek(&7, 0, 1).unwrap();
        assert_eq!(first.remaining(), 2);
        assert_eq!(limiter.quotas(), vec![quota(100), quota(100)]);
    }

    /// A cost the first quota admits but beyond a later quota's capacity is that
    /// error, and the first gets its units back.
    #[test]
    fn a_cost_beyond_a_later_capacity_consumes_nothing() {
        let limiter = limiter(&[cold(100, 80), cold(50, 3)]);
        assert_eq!(limiter.capacity(), 50);
        assert_eq!(limiter.check_n(&8, 60).unwrap_err().capacity, 50);
        let untouched = part(&limiter, 0).peek(&8, 0, 1).unwrap();
        assert_eq!(untouched.remaining(), 80);
        assert_eq!(limiter.peek_n(&8, 60).unwrap_err().capacity, 50);
    }

    /// Settlements reach every quota, and the result is the most constraining.
    #[test]
    fn settlements_reach_every_quota() {
        let limiter = limiter(&[cold(100, 5), cold(100, 3)]);
        let after = limiter.charge(&7, 4).unwrap();
        assert!(!after.is_allowed());
        assert_eq!(after.policy(), 1, "{after:?}");
        for i in 0..2 {
            let part = part(&limiter, i).peek(&7, 0, 1).unwrap();
            assert_eq!(part.remaining(), [1, 0][i], "quota {i}");
        }
        let back = limiter.refund(&7, 4).unwrap();
        assert!(back.is_allowed());
        assert_eq!(back.remaining(), 3);
    }

    /// A charge that one quota's store has no room for changes no quota: the quotas
    /// before it give it back.
    #[test]
    fn a_charge_one_quota_has_no_room_for_changes_nothing() {
        let builder = crate::RateLimiter::<u64>::builder(quota(100))
            .shards(1)
            .max_keys(1)
            .when_full(crate::WhenFull::DenyNewKeys);
        let limiter = limiter_of(builder, &[cold(100, 5), hot(100, 3)]);
        // The second quota's store is full of a key in use.
        assert!(
            part(&limiter, 1)
                .check(&99, || 0, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        );
        assert!(matches!(
            limiter.charge(&7, 4),
            Err(SettleError::NoRoom { .. })
        ));
        let first = part(&limiter, 0).peek(&7, 0, 1).unwrap();
        assert_eq!(first.remaining(), 5, "the first quota kept the charge");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// On cold keys (each quota a local GCRA at this node's share: here the whole
        /// quota), a synced limiter with 2–3 quotas decides every check, charge and
        /// refund of a random timeline as the in-process limiter with the same quotas
        /// does: the same verdicts, so the same all-or-nothing consumption, give-backs
        /// included.
        #[test]
        fn cold_quotas_decide_as_the_in_process_limiter(
            quotas in proptest::collection::vec((1u64..=8, 1u64..=6), 2..=3),
            ops in proptest::collection::vec((0u64..20_000_000, 0u64..3, 0u64..=6, 0u8..10), 1..200),
        ) {
            let shape: Vec<Quota> = quotas
                .iter()
                .map(|&(t_ms, burst)| {
                    Quota::new(1, std::time::Duration::from_millis(t_ms))
                        .and_then(|q| q.with_burst(burst))
                        .unwrap()
                })
                .collect();
            let policies: Vec<SyncPolicy> = shape
                .iter()
                .zip(&quotas)
                .map(|(&q, &(t_ms, burst))| SyncPolicy {
                    quota: q,
                    capacity: burst,
                    ..cold(100, burst)
                }
                .with_t(t_ms * 1_000_000))
                .collect();
            let synced = limiter(&policies);
            let local = shape[1..]
                .iter()
                .fold(crate::RateLimiter::<u64>::builder(shape[0]), |b, &q| b.also(q))
                .clock(ManualClock::new())
                .build()
                .unwrap();
            let smallest = quotas.iter().map(|q| q.1).min().unwrap();
            for (step, (advance, key, cost, kind)) in ops.into_iter().enumerate() {
                synced.clock().advance(std::time::Duration::from_nanos(advance));
                local.clock().advance(std::time::Duration::from_nanos(advance));
                let cost = cost.min(smallest);
                let (ours, theirs) = match kind {
                    0 => (
                        synced.charge(&key, cost).map(|d| d.is_allowed()).ok(),
                        local.charge(&key, cost).map(|d| d.is_allowed()).ok(),
                    ),
                    1 => (
                        synced.refund(&key, cost).map(|d| d.is_allowed()).ok(),
                        local.refund(&key, cost).map(|d| d.is_allowed()).ok(),
                    ),
                    _ => (
                        synced.check_n(&key, cost).map(|d| d.is_allowed()).ok(),
                        local.check_n(&key, cost).map(|d| d.is_allowed()).ok(),
                    ),
                };
                proptest::prop_assert_eq!(ours, theirs, "step {} (kind {}, cost {})", step, kind, cost);
            }
        }
    }
}
