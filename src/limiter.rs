//! The public entry point: a keyed limiter tying the store, the clock and an algorithm.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::algorithm::{Algorithm, Outcome, Policy, UNTOUCHED};
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;
use crate::store::{Access, Store};

/// A keyed rate limiter: every key has its own quota state.
///
/// `RateLimiter` is `Send + Sync` and cheap to clone; clones share the same state. Keys
/// are looked up by borrow, so a `RateLimiter<String>` is checked with a `&str` and an
/// existing key costs no allocation.
///
/// ```
/// use tollgate::{Quota, RateLimiter};
///
/// let limiter: RateLimiter<String> = RateLimiter::new(Quota::per_second(2)?);
/// assert!(limiter.check("alice").is_allowed());
/// assert!(limiter.check("alice").is_allowed());
/// let denied = limiter.check("alice");
/// assert!(!denied.is_allowed());
/// // The next token is due 500ms after the first request.
/// assert!(denied.retry_after().unwrap() <= std::time::Duration::from_millis(500));
/// assert!(limiter.check("bob").is_allowed());
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
pub struct RateLimiter<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

struct Inner<K, C> {
    store: Store<K>,
    policy: Policy,
    quota: Quota,
    algorithm: Algorithm,
    clock: C,
}

impl<K, C> Clone for RateLimiter<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K, C> fmt::Debug for RateLimiter<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("quota", &self.inner.quota)
            .field("algorithm", &self.inner.algorithm)
            .finish_non_exhaustive()
    }
}

impl<K: Hash + Eq> RateLimiter<K> {
    /// A token-bucket limiter with the default clock, shard count and no key cap.
    pub fn new(quota: Quota) -> Self {
        Builder::new(quota).assemble(Policy::token_bucket(quota))
    }

    /// A builder to choose the algorithm, clock, shard count and key cap.
    pub fn builder(quota: Quota) -> Builder<K> {
        Builder::new(quota)
    }
}

impl<K: Hash + Eq, C: Clock> RateLimiter<K, C> {
    /// Checks one request for `key` and consumes one unit if it is admitted.
    ///
    /// # Locking behaviour
    /// Takes the read lock of the key's shard; a key seen for the first time takes that
    /// shard's write lock to insert it. Never holds more than one lock.
    #[inline]
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.decide(key, 1)
    }

    /// Checks a request of cost `n` for `key`: all `n` units are admitted together, or
    /// none. A cost of 0 is always admitted and consumes nothing.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] when `n` exceeds what the quota can ever admit at once
    /// (the burst for the token bucket, the limit for window algorithms): no wait would
    /// let it pass.
    ///
    /// # Locking behaviour
    /// As [`check`](Self::check).
    pub fn check_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let capacity = self.inner.policy.capacity();
        if n > capacity {
            return Err(InsufficientCapacity {
                requested: n,
                capacity,
            });
        }
        if n == 0 {
            let state = self.inner.store.get(key).unwrap_or(UNTOUCHED);
            return Ok(self.inner.policy.snapshot(state, self.inner.clock.now_ns()));
        }
        Ok(self.decide(key, n))
    }

    #[inline]
    fn decide<Q>(&self, key: &Q, cost: u64) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let inner = &*self.inner;
        let now = inner.clock.now_ns();
        let policy = &inner.policy;
        match inner.store.access(
            key,
            |s| policy.reset_after_ns(s, now),
            |cell| apply(policy, cell, now, cost),
        ) {
            Access::Done(decision) => decision,
            Access::Full { retry_after_ns } => {
                Decision::deny(policy.capacity(), 0, 0, retry_after_ns)
            }
        }
    }

    /// The decision a unit request for `key` would get now, without consuming anything
    /// and without storing a new key. `remaining` and `reset_after` describe the state as
    /// it stands.
    ///
    /// # Locking behaviour
    /// Takes the read lock of the key's shard.
    pub fn peek<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let state = self.inner.store.get(key).unwrap_or(UNTOUCHED);
        self.inner.policy.peek(state, self.inner.clock.now_ns())
    }

    /// Forgets `key`: its next request sees a full, untouched quota.
    ///
    /// # Locking behaviour
    /// Takes the write lock of the key's shard.
    pub fn reset<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.store.remove(key);
    }

    /// How many keys hold state.
    pub fn len(&self) -> usize {
        self.inner.store.len()
    }

    /// Whether no key holds state.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many untouched keys were dropped to make room under
    /// [`max_keys`](Builder::max_keys). Dropping them changed no decision.
    pub fn evicted(&self) -> u64 {
        self.inner.store.evicted()
    }

    /// The quota every key is limited by.
    pub fn quota(&self) -> Quota {
        self.inner.quota
    }

    /// The algorithm this limiter runs.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The number of shards of the key map.
    pub fn shards(&self) -> usize {
        self.inner.store.shard_count()
    }

    /// The limiter's clock.
    pub fn clock(&self) -> &C {
        &self.inner.clock
    }
}

/// Runs `policy` on one key's state word: a CAS loop that writes only when a request is
/// admitted and the state changes. A deny returns without writing.
#[inline]
fn apply(policy: &Policy, cell: &AtomicU64, now: u64, cost: u64) -> Decision {
    let mut state = cell.load(Ordering::Acquire);
    loop {
        match policy.evaluate(state, now, cost) {
            Outcome::Deny(decision) => return decision,
            Outcome::Allow {
                decision,
                state: next,
            } => {
                if next == state {
                    return decision;
                }
                match cell.compare_exchange_weak(state, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return decision,
                    Err(actual) => state = actual,
                }
            }
        }
    }
}

/// Configures a [`RateLimiter`]. Made by [`RateLimiter::builder`].
///
/// ```
/// use tollgate::{clock::ManualClock, Algorithm, Quota, RateLimiter};
///
/// let limiter: RateLimiter<u64, ManualClock> = RateLimiter::builder("100/min".parse()?)
///     .algorithm(Algorithm::SlidingWindow)
///     .clock(ManualClock::new())
///     .shards(16)
///     .max_keys(100_000)
///     .build()?;
/// assert!(limiter.check(&7).is_allowed());
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[must_use = "a builder does nothing until .build() is called"]
pub struct Builder<K, C = MonotonicClock> {
    quota: Quota,
    algorithm: Algorithm,
    clock: C,
    shards: Option<usize>,
    max_keys: Option<usize>,
    key: PhantomData<fn() -> K>,
}

impl<K> Builder<K> {
    fn new(quota: Quota) -> Self {
        Self {
            quota,
            algorithm: Algorithm::default(),
            clock: MonotonicClock::new(),
            shards: None,
            max_keys: None,
            key: PhantomData,
        }
    }
}

impl<K, C> fmt::Debug for Builder<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("quota", &self.quota)
            .field("algorithm", &self.algorithm)
            .field("shards", &self.shards)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl<K: Hash + Eq, C: Clock> Builder<K, C> {
    /// The algorithm to run; [`Algorithm::TokenBucket`] by default.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The time source; [`MonotonicClock`] by default. Tests use
    /// [`ManualClock`](crate::clock::ManualClock).
    pub fn clock<C2: Clock>(self, clock: C2) -> Builder<K, C2> {
        Builder {
            quota: self.quota,
            algorithm: self.algorithm,
            clock,
            shards: self.shards,
            max_keys: self.max_keys,
            key: PhantomData,
        }
    }

    /// The number of shards of the key map: a power of two. By default four per CPU,
    /// rounded up to a power of two.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The most keys the limiter holds at once; unbounded by default.
    ///
    /// When it is full, a new key first makes room by dropping keys of its shard whose
    /// state is back to untouched (which changes no decision). If none is, the new key's
    /// request is denied, with `retry_after` set to when the first key of that shard will
    /// be untouched. Keys already stored are never affected.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// Validates the configuration and builds the limiter.
    ///
    /// # Errors
    /// [`ConfigError::InvalidShards`] for a shard count that is zero or not a power of two,
    /// [`ConfigError::ZeroMaxKeys`], or [`ConfigError::LimitTooLarge`] when the algorithm
    /// cannot hold the quota's limit.
    pub fn build(self) -> Result<RateLimiter<K, C>, ConfigError> {
        if let Some(n) = self.shards {
            if !n.is_power_of_two() {
                return Err(ConfigError::InvalidShards(n));
            }
        }
        if self.max_keys == Some(0) {
            return Err(ConfigError::ZeroMaxKeys);
        }
        let policy = Policy::new(self.algorithm, self.quota)?;
        Ok(self.assemble(policy))
    }

    /// Builds from validated parts.
    fn assemble(self, policy: Policy) -> RateLimiter<K, C> {
        let shards = self.shards.unwrap_or_else(default_shards);
        RateLimiter {
            inner: Arc::new(Inner {
                store: Store::new(shards, self.max_keys.unwrap_or(usize::MAX)),
                policy,
                quota: self.quota,
                algorithm: self.algorithm,
                clock: self.clock,
            }),
        }
    }
}

/// Four shards per CPU, rounded up to a power of two.
fn default_shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (cpus * 4).next_power_of_two()
}
