//! [`SyncedLimiter`]: a keyed limiter whose keys spend allowances a background sync
//! obtains from Redis.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use super::cell::SyncCell;
use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::InsufficientCapacity;
use crate::limiter::{Common, Key};
use crate::quota::Quota;
use crate::store::{Store, StoreStats};

/// A keyed limiter that holds one limit across every node sharing a Redis: checks stay
/// in process (nanoseconds, no I/O), while a background task trades each key's use for
/// fresh allowance once per sync interval. Made by
/// [`Builder::build_synced`](crate::Builder::build_synced); see [the module's
/// docs](crate::sync) for the modes and their bounds.
///
/// `SyncedLimiter` is `Send + Sync` and cheap to clone; clones share the same state.
/// Every method works on it: what a synced limiter cannot do (change a quota on one
/// node only) it does not offer.
pub struct SyncedLimiter<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

struct Inner<K, C> {
    store: Store<K, SyncCell>,
    common: Common<C>,
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
        self.inner.common.stats(self.inner.store.stats())
    }

    /// The limiter's name ([`Builder::name`](crate::Builder::name); `"default"` unless
    /// set).
    pub fn name(&self) -> &str {
        &self.inner.common.name
    }

    /// The quota every node together holds.
    pub fn quota(&self) -> Quota {
        self.inner.store.default_policy().quota
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
    /// the sliding window.
    pub fn capacity(&self) -> u64 {
        self.inner.store.default_policy().capacity
    }

    /// A limiter of `store`, whose sync task is not started yet.
    pub(super) fn new(store: Store<K, SyncCell>, common: Common<C>) -> Self {
        Self {
            inner: Arc::new(Inner { store, common }),
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
    #[inline]
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.check_n(key, 1)
            .unwrap_or_else(|e| Decision::deny(e.capacity, 0, 0, u64::MAX))
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
        let decided = self
            .inner
            .store
            .check(key, || common.clock.now_ns(), n, max_delay);
        common.record_n(key, &decided);
        decided
    }

    /// The decision a unit request for `key` would get now on this node, consuming
    /// nothing and storing no key.
    pub fn peek<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.peek_n(key, 1)
            .unwrap_or_else(|e| Decision::deny(e.capacity, 0, 0, u64::MAX))
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
        self.inner
            .store
            .peek(key, self.inner.common.clock.now_ns(), n)
    }
}
