//! Keyed concurrency limits: at most N requests in flight per key.
//!
//! A rate limit bounds how many requests start per period; a concurrency limit bounds how
//! many run at once, whatever they cost in time. Stripe runs both ("100 per minute and at
//! most 2 at once per API key"); tower's `ConcurrencyLimit` is one global count, and
//! pingora's `Inflight` counts without holding a slot. [`ConcurrencyLimiter`] holds one
//! count per key, and each admitted request a [`Permit`] that gives its slots back when
//! it is dropped: when the request ends, panics, or its future is cancelled.
//!
//! ```text
//! try_acquire(&key) ─► shard read lock ─► Slot: CAS in_flight + n ≤ max ─► Permit(Arc<Slot>, n)
//! drop(Permit)      ─► Slot: fetch_sub n ─► (someone waits?) serve the line in order
//! ```
//!
//! ```
//! use tollgate::ConcurrencyLimiter;
//!
//! // At most 2 requests at once per API key.
//! let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(2);
//! let first = limiter.try_acquire("key-1")?;
//! let _second = limiter.try_acquire("key-1")?;
//! assert!(limiter.try_acquire("key-1").is_err());
//! assert!(limiter.try_acquire("key-2").is_ok()); // another key, its own slots
//! drop(first); // the request ended: its slot is free again
//! assert_eq!(limiter.in_flight("key-1"), 1);
//! assert!(limiter.try_acquire("key-1").is_ok());
//! # Ok::<(), tollgate::ConcurrencyError>(())
//! ```
//!
//! Waiting callers ([`acquire`](ConcurrencyLimiter::acquire),
//! [`acquire_timeout`](ConcurrencyLimiter::acquire_timeout)) are served in arrival order
//! per key, and [`try_acquire`](ConcurrencyLimiter::try_acquire) does not pass them. A
//! key with nothing in flight and nobody waiting is dropped by its shard's next sweep,
//! so the map holds about twice the keys in use at most, under
//! [`max_keys`](ConcurrencyBuilder::max_keys).
//!
//! Across processes, `redis::RedisConcurrencyLimiter` holds the same limit in Redis, each
//! slot a lease that expires if its holder dies. With a rate limit on the same key, see
//! [`ConcurrencyLimiter::try_acquire_with`].

mod error;
mod observe;
mod permit;
mod slot;
mod table;

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use error::ConcurrencyError;
pub use permit::Permit;

use crate::clock::Clock;
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::limiter::{Key, MAX_SHARDS, RateLimiter, valid_shards};
use crate::tally::Tally;
use permit::Waiting;
use slot::{Queued, Refusal};
use table::{Keys, Refused};

/// At most `max` slots in flight per key; see the [module](self) docs and the
/// [concurrency guide](crate::guide::concurrency).
///
/// Cloning is cheap and shares the keys.
pub struct ConcurrencyLimiter<K> {
    inner: Arc<Inner<K>>,
}

struct Inner<K> {
    keys: Keys<K>,
    name: Arc<str>,
    tally: Tally,
    timed_out: AtomicU64,
}

impl<K> Clone for ConcurrencyLimiter<K> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K: Key> fmt::Debug for ConcurrencyLimiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the keys: they may be API keys.
        f.debug_struct("ConcurrencyLimiter")
            .field("name", &self.inner.name)
            .field("default_max", &self.inner.keys.default_max())
            .field("keys", &self.inner.keys.len())
            .finish()
    }
}

/// A concurrency limiter's counters; see [`ConcurrencyLimiter::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Permits issued (at once or after a wait).
    pub acquired: u64,
    /// Acquires refused: full, never fitting, no room for a new key, or timed out.
    pub denied: u64,
    /// Of the refused, those that waited and gave up at their deadline.
    pub timed_out: u64,
    /// Keys held now (with something in flight, or not swept yet).
    pub keys: usize,
    /// Slots held now, over every key.
    pub in_flight: u64,
    /// Callers waiting in a key's line now.
    pub waiting: u64,
}

impl<K: Key> ConcurrencyLimiter<K> {
    /// At most `max` slots in flight per key (a `max` of 0 admits nothing), with the
    /// default shards and no key cap. For more knobs, [`builder`](Self::builder).
    pub fn new(max: u32) -> Self {
        Self::builder(max)
            .build()
            .expect("the default configuration is valid")
    }

    /// A builder, for a name, shards and a key cap.
    pub fn builder(max: u32) -> ConcurrencyBuilder<K> {
        ConcurrencyBuilder {
            max,
            name: "default".into(),
            shards: None,
            max_keys: usize::MAX,
            counters: true,
            _keys: std::marker::PhantomData,
        }
    }

    /// Takes one slot of `key`, or says why not at once.
    ///
    /// # Errors
    /// [`ConcurrencyError::Full`] while `key`'s slots are held (or callers wait for them),
    /// [`ConcurrencyError::TooManyKeys`] for a new key when every key held under the cap
    /// has something in flight.
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard, for a lookup and a CAS (its write lock for a
    /// new key). Never waits for a slot.
    #[inline]
    pub fn try_acquire<Q>(&self, key: &Q) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.try_acquire_n(key, 1)
    }

    /// Takes `weight` slots of `key` at once, or none: for requests of different sizes
    /// (a weight of 0 takes nothing and always succeeds).
    ///
    /// # Errors
    /// As [`try_acquire`](Self::try_acquire), and [`ConcurrencyError::NeverFits`] when
    /// `weight` exceeds the key's maximum.
    ///
    /// # Locking behaviour
    /// As [`try_acquire`](Self::try_acquire).
    #[inline]
    pub fn try_acquire_n<Q>(&self, key: &Q, weight: u32) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if weight == 0 {
            return Ok(Permit::empty());
        }
        match self.inner.keys.take(key, weight) {
            Ok(slot) => {
                self.inner.tally.count(true);
                Ok(Permit::new(slot, weight))
            }
            Err(refused) => Err(self.refused(key, weight, refused)),
        }
    }

    #[cold]
    #[inline(never)]
    fn refused<Q: Hash + ?Sized>(
        &self,
        key: &Q,
        weight: u32,
        refused: Refused,
    ) -> ConcurrencyError {
        self.inner.tally.count(false);
        let error = match refused {
            Refused::Slot(Refusal::Full { in_flight, max }) => {
                ConcurrencyError::Full { in_flight, max }
            }
            Refused::Slot(Refusal::NeverFits { max }) => {
                ConcurrencyError::NeverFits { weight, max }
            }
            Refused::NoRoom { max_keys } => ConcurrencyError::TooManyKeys { max_keys },
        };
        observe::refused(&self.inner.name, key, &error);
        error
    }

    /// Takes one slot of `key`, waiting in the key's line while they are held. Callers
    /// are served in arrival order; a cancelled (dropped) wait leaves the line, and gives
    /// back the slot if it was granted meanwhile. Runs on any executor.
    ///
    /// # Errors
    /// [`ConcurrencyError::NeverFits`] for a key of maximum 0, and
    /// [`ConcurrencyError::TooManyKeys`] as [`try_acquire`](Self::try_acquire); never
    /// `Full`.
    pub async fn acquire<Q>(&self, key: &Q) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.acquire_n(key, 1).await
    }

    /// [`acquire`](Self::acquire) for `weight` slots at once. A heavy caller at the head
    /// of the line holds back lighter ones behind it until its slots are free.
    ///
    /// # Errors
    /// As [`acquire`](Self::acquire), and [`ConcurrencyError::NeverFits`] when `weight`
    /// exceeds the key's maximum.
    pub async fn acquire_n<Q>(&self, key: &Q, weight: u32) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        match self.wait_for(key, weight) {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(waiting)) => {
                let permit = waiting.await;
                self.inner.tally.count(true);
                Ok(permit)
            }
            Err(error) => Err(error),
        }
    }

    /// A permit now, or the line to wait in.
    fn wait_for<Q>(&self, key: &Q, weight: u32) -> Result<Result<Permit, Waiting>, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if weight == 0 {
            return Ok(Ok(Permit::empty()));
        }
        match self.inner.keys.take(key, weight) {
            Ok(slot) => {
                self.inner.tally.count(true);
                return Ok(Ok(Permit::new(slot, weight)));
            }
            Err(Refused::Slot(Refusal::Full { .. })) => {}
            Err(refused) => return Err(self.refused(key, weight, refused)),
        }
        let slot = self
            .inner
            .keys
            .slot(key)
            .map_err(|refused| self.refused(key, weight, refused))?;
        let max = slot.max();
        if weight > max {
            return Err(self.refused(key, weight, Refused::Slot(Refusal::NeverFits { max })));
        }
        Ok(match slot.enqueue(weight) {
            Queued::Taken => {
                self.inner.tally.count(true);
                Ok(Permit::new(slot, weight))
            }
            Queued::Waiting(grant) => Err(Waiting::new(slot, grant, weight)),
        })
    }

    /// [`acquire`](Self::acquire), giving up after `timeout`: a caller still in line then
    /// leaves it, and holds nothing.
    ///
    /// # Errors
    /// [`ConcurrencyError::Timeout`] at the deadline, and as [`acquire`](Self::acquire).
    #[cfg(any(feature = "tokio", feature = "tower"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn acquire_timeout<Q>(
        &self,
        key: &Q,
        timeout: std::time::Duration,
    ) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.acquire_n_timeout(key, 1, timeout).await
    }

    /// [`acquire_timeout`](Self::acquire_timeout) for `weight` slots at once.
    ///
    /// # Errors
    /// As [`acquire_timeout`](Self::acquire_timeout) and [`acquire_n`](Self::acquire_n).
    #[cfg(any(feature = "tokio", feature = "tower"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn acquire_n_timeout<Q>(
        &self,
        key: &Q,
        weight: u32,
        timeout: std::time::Duration,
    ) -> Result<Permit, ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let waiting = match self.wait_for(key, weight)? {
            Ok(permit) => return Ok(permit),
            Err(waiting) => waiting,
        };
        match tokio::time::timeout(timeout, waiting).await {
            Ok(permit) => {
                self.inner.tally.count(true);
                Ok(permit)
            }
            // The wait was dropped: out of the line, or its late grant given back.
            Err(_) => {
                self.inner.timed_out.fetch_add(1, Ordering::Relaxed);
                Err(self.refused_timeout(key, timeout))
            }
        }
    }

    #[cfg(any(feature = "tokio", feature = "tower"))]
    #[cold]
    fn refused_timeout<Q: Hash + ?Sized>(
        &self,
        key: &Q,
        waited: std::time::Duration,
    ) -> ConcurrencyError {
        self.inner.tally.count(false);
        let error = ConcurrencyError::Timeout { waited };
        observe::refused(&self.inner.name, key, &error);
        error
    }

    /// Takes one slot of `key` and one unit of `rate`'s quota for it, both or neither: a
    /// request denied by the rate limit holds no slot, and one refused a slot consumes no
    /// quota. The slot is taken first (a CAS that can be undone exactly); if the rate
    /// denies, it is given back before this returns.
    ///
    /// ```
    /// use tollgate::{ConcurrencyLimiter, RateLimiter};
    ///
    /// // 100 per minute and at most 2 at once per API key.
    /// let rate: RateLimiter<String> = RateLimiter::new("100/min".parse()?);
    /// let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(2);
    /// let (_permit, decision) = slots.try_acquire_with(&rate, "key-1")?;
    /// assert!(decision.is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ConcurrencyError::RateLimited`] (with the rate's decision, whose `retry_after`
    /// says when) or any error of [`try_acquire`](Self::try_acquire).
    ///
    /// # Locking behaviour
    /// As [`try_acquire`](Self::try_acquire) and [`RateLimiter::check`].
    pub fn try_acquire_with<Q, C>(
        &self,
        rate: &RateLimiter<K, C>,
        key: &Q,
    ) -> Result<(Permit, Decision), ConcurrencyError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
        C: Clock,
    {
        let permit = self.try_acquire(key)?;
        let decision = rate.check(key);
        if decision.is_allowed() {
            Ok((permit, decision))
        } else {
            drop(permit);
            Err(ConcurrencyError::RateLimited(decision))
        }
    }

    /// The slots of `key` held now (0 for a key with none).
    ///
    /// # Locking behaviour
    /// The read lock of the key's shard.
    pub fn in_flight<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.keys.in_flight(key)
    }

    /// The maximum of `key` now: its own, or the default.
    pub fn max_for<Q>(&self, key: &Q) -> u32
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.keys.max_for(key)
    }

    /// The default maximum.
    pub fn max(&self) -> u32 {
        self.inner.keys.default_max()
    }

    /// Gives `key` a maximum of its own, now: a rise serves its waiting callers at once;
    /// a fall admits nobody new until the slots held drop below it (nothing held is
    /// taken back).
    ///
    /// # Locking behaviour
    /// The limiter's reconfiguration mutex, the overrides' write lock and the key's
    /// shard read lock, one after the other.
    pub fn set_max<Q>(&self, key: &Q, max: u32)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.inner.keys.set_max(key, max);
    }

    /// Returns `key` to the default maximum.
    ///
    /// # Locking behaviour
    /// As [`set_max`](Self::set_max).
    pub fn remove_max<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.keys.remove_max(key);
    }

    /// Sets the default maximum, for every key without its own, now (as
    /// [`set_max`](Self::set_max) for each).
    ///
    /// # Locking behaviour
    /// The reconfiguration mutex, then each shard's read lock in turn.
    pub fn set_default_max(&self, max: u32) {
        self.inner.keys.set_default_max(max);
    }

    /// Drops every key with nothing in flight and nobody waiting, now (inserts do it
    /// anyway as the shards grow); returns how many.
    ///
    /// # Locking behaviour
    /// Each shard's write lock in turn.
    pub fn sweep(&self) -> usize {
        self.inner.keys.sweep()
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner.keys.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The limiter's name (for metrics and logs).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The number of shards of the key map.
    pub fn shards(&self) -> usize {
        self.inner.keys.shards()
    }

    /// The counters, also published as metrics (feature `metrics`).
    ///
    /// # Locking behaviour
    /// Each shard's read lock in turn (it counts the slots held): O(keys).
    pub fn stats(&self) -> ConcurrencyStats {
        let totals = self.inner.tally.totals();
        let (keys, in_flight, waiting) = self.inner.keys.totals();
        let stats = ConcurrencyStats {
            acquired: totals.allowed,
            denied: totals.denied,
            timed_out: self.inner.timed_out.load(Ordering::Relaxed),
            keys,
            in_flight,
            waiting,
        };
        observe::publish(&self.inner.name, &stats);
        stats
    }
}

/// Builds a [`ConcurrencyLimiter`] with more knobs than [`ConcurrencyLimiter::new`].
///
/// ```
/// use tollgate::ConcurrencyLimiter;
///
/// let limiter: ConcurrencyLimiter<u64> = ConcurrencyLimiter::builder(4)
///     .name("uploads")
///     .max_keys(100_000)
///     .build()?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
pub struct ConcurrencyBuilder<K> {
    max: u32,
    name: String,
    shards: Option<usize>,
    max_keys: usize,
    counters: bool,
    _keys: std::marker::PhantomData<fn() -> K>,
}

impl<K> fmt::Debug for ConcurrencyBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyBuilder")
            .field("max", &self.max)
            .field("name", &self.name)
            .field("shards", &self.shards)
            .field("max_keys", &self.max_keys)
            .finish()
    }
}

impl<K: Key> ConcurrencyBuilder<K> {
    /// The limiter's name, for metrics and logs (default `"default"`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// The number of shards of the key map: a power of two, at most [`MAX_SHARDS`]. By
    /// default 16 per CPU, at least 64: each shard has a read-write lock, and more of
    /// them keep threads on different keys off each other's lock.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The most keys held at once. Keys with nothing in flight are swept to make room; a
    /// new key is refused ([`ConcurrencyError::TooManyKeys`]) only when every key held
    /// has something in flight.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Whether to count acquires and refusals for [`stats`](ConcurrencyLimiter::stats)
    /// (default on; a count costs a per-thread store).
    pub fn counters(mut self, on: bool) -> Self {
        self.counters = on;
        self
    }

    /// The limiter.
    ///
    /// # Errors
    /// [`ConfigError::InvalidShards`] and [`ConfigError::ZeroMaxKeys`].
    pub fn build(self) -> Result<ConcurrencyLimiter<K>, ConfigError> {
        let shards = match self.shards {
            Some(n) if !valid_shards(n) => return Err(ConfigError::InvalidShards(n)),
            Some(n) => n,
            None => default_shards(),
        };
        if self.max_keys == 0 {
            return Err(ConfigError::ZeroMaxKeys);
        }
        let limiter = ConcurrencyLimiter {
            inner: Arc::new(Inner {
                keys: Keys::new(shards, self.max, self.max_keys),
                name: self.name.into(),
                tally: Tally::new(self.counters),
                timed_out: AtomicU64::new(0),
            }),
        };
        #[cfg(all(feature = "metrics", feature = "tokio"))]
        crate::observe::every_second(Arc::downgrade(&limiter.inner), |inner| {
            ConcurrencyLimiter { inner }.stats();
        });
        Ok(limiter)
    }
}

/// 16 shards per CPU, at least 64, a power of two.
fn default_shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    cpus.saturating_mul(16)
        .clamp(64, MAX_SHARDS)
        .next_power_of_two()
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests;
