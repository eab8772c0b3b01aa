//! The public entry point: a keyed limiter tying the store, the clock and an algorithm.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::{Algorithm, AnyPolicy, Policy, Settle, WordPolicy};
use crate::clock::{Clock, MonotonicClock};
use crate::decision::{Decision, unit};
use crate::error::{ConfigError, InsufficientCapacity, SettleError};
use crate::penalty::{Penalty, PenaltyBox};
use crate::quota::Quota;
use crate::store::state::LogCell;
use crate::store::{Compound, Limits, Store, StoreStats, WhenFull, WordStore, check_room};
use crate::tally::Tally;

/// What a limiter's keys must be: hashable, comparable, and shareable between the
/// threads that check them. Implemented for every such type (`String`, `u64`, `IpAddr`,
/// tuples of them, …).
///
/// `Send + Sync + 'static` because a key can outlive the call that inserted it on another
/// thread: a resized table, with its keys, is freed by whichever thread next collects
/// what was retired.
pub trait Key: Hash + Eq + Send + Sync + 'static {}

impl<T: Hash + Eq + Send + Sync + 'static> Key for T {}

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
///
/// # Per-key quotas and live changes
///
/// [`set_quota`](Self::set_quota) gives one key its own quota and
/// [`set_default_quota`](Self::set_default_quota) changes everyone else's, while checks
/// go on. Each shard keeps its policies next to its keys (for the word algorithms, in
/// the very table a check probes), so reading a key's quota costs no extra lock or
/// atomic. A change takes each affected shard's writer lock in turn and converts the
/// state of its keys (for the word algorithms, while each is frozen during the
/// migration to a table carrying the new quota), so no check ever pairs a new quota with
/// unconverted state.
///
/// What a change does to a key's state: **the units it has consumed carry over, capped
/// at the new quota's capacity**, so a change never refills a key. A token bucket with
/// 100 of 100 used half (50 consumed) that grows to 1000 has 950 left; one that shrinks to
/// a burst of 10 is empty and refills at the new rate. Window counters keep their counts
/// (capped at the new limit); if the period changes, the weighted estimate becomes the
/// count of the window `now` falls in. The sliding log keeps its newest timestamps.
pub struct RateLimiter<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

/// The store, typed by the state its algorithm keeps per key.
enum Engine<K> {
    Word(WordStore<K>),
    Log(Store<K, LogCell>),
    /// Several quotas per key ([`Builder::also`]), for the word algorithms.
    Compound(Compound<K>),
}

/// Runs the same expression on whichever store an engine holds.
macro_rules! on_store {
    ($engine:expr, $store:ident => $body:expr) => {
        match $engine {
            Engine::Word($store) => $body,
            Engine::Log($store) => $body,
            Engine::Compound($store) => $body,
        }
    };
}

struct Inner<K, C> {
    engine: Engine<K>,
    common: Common<C>,
    /// Blocked keys ([`Builder::block_for`], [`RateLimiter::block`]).
    penalty: PenaltyBox<K>,
}

/// What every limiter keeps besides its store: its algorithm, clock, name and decision
/// counts. The tiers' limiters that keep keys in process share it.
pub(crate) struct Common<C> {
    pub(crate) algorithm: Algorithm,
    pub(crate) clock: C,
    /// The limiter's name, for metrics and logs.
    pub(crate) name: Arc<str>,
    /// Allowed and denied decisions.
    tally: Tally,
}

impl<C> Common<C> {
    /// The same, with its clock shared (see [`for_quota`](Self::for_quota)).
    #[cfg(feature = "redis")]
    pub(crate) fn shared(self) -> Common<Arc<C>> {
        Common {
            algorithm: self.algorithm,
            clock: Arc::new(self.clock),
            name: self.name,
            tally: self.tally,
        }
    }
}

#[cfg(feature = "redis")]
impl<C> Common<Arc<C>> {
    /// The part of quota `i` (from 1) of a limiter with several: the same clock and
    /// algorithm, named `<name>+<i>`, counting nothing of its own (the limiter counts
    /// its decisions once).
    pub(crate) fn for_quota(&self, i: usize) -> Self {
        Common {
            algorithm: self.algorithm,
            clock: Arc::clone(&self.clock),
            name: Arc::from(format!("{}+{i}", self.name)),
            tally: Tally::new(false),
        }
    }
}

impl<C> Common<C> {
    /// Counts a decision, and logs it if it is a deny.
    #[inline(always)]
    pub(crate) fn record<Q: Hash + ?Sized>(&self, key: &Q, decision: &Decision) {
        self.tally.count(decision.is_allowed());
        if !decision.is_allowed() {
            crate::observe::denied(&self.name, key, decision);
        }
    }

    /// [`record`](Self::record) for a request of a given cost: a cost beyond capacity is
    /// a deny the caller sees too.
    #[inline]
    pub(crate) fn record_n<Q: Hash + ?Sized>(
        &self,
        key: &Q,
        decided: &Result<Decision, InsufficientCapacity>,
    ) {
        match decided {
            Ok(decision) => self.record(key, decision),
            Err(_) => self.tally.count(false),
        }
    }

    /// The store's counters with the decision counts, published as metrics.
    pub(crate) fn stats(&self, store: StoreStats) -> StoreStats {
        let totals = self.tally.totals();
        let stats = StoreStats {
            allowed: totals.allowed,
            denied: totals.denied,
            ..store
        };
        crate::observe::limiter(&self.name, &stats);
        stats
    }
}

impl<K, C> Clone for RateLimiter<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K: Key, C> fmt::Debug for RateLimiter<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("name", &self.inner.common.name)
            .field("quota", &self.quota())
            .field("algorithm", &self.inner.common.algorithm)
            .field("keys", &self.len())
            .finish_non_exhaustive()
    }
}

impl<K: Key> RateLimiter<K> {
    /// A token-bucket limiter with the default clock, shard count and no key cap. The
    /// first one built in a process pays a one-time registration (see
    /// [`Builder::build`]'s cost).
    pub fn new(quota: Quota) -> Self {
        let builder: Builder<K> = Builder::new(quota);
        let engine = Engine::Word(WordStore::new(
            builder.limits(default_shards()),
            WordPolicy::token_bucket(quota),
        ));
        Builder::new(quota).assemble(engine)
    }

    /// A builder to choose the algorithm, clock, shard count and key cap.
    pub fn builder(quota: Quota) -> Builder<K> {
        Builder::new(quota)
    }
}

impl<K: Key, C> RateLimiter<K, C> {
    /// How many keys hold state.
    pub fn len(&self) -> usize {
        on_store!(&self.inner.engine, s => s.len())
    }

    /// Whether no key holds state.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counters for monitoring: decisions allowed and denied, keys held, keys dropped
    /// because they were untouched (which changed no decision), live keys evicted and new
    /// keys refused under [`max_keys`](Builder::max_keys). Every decision made before
    /// this call started is counted.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::new("1/s".parse()?);
    /// limiter.check(&1);
    /// limiter.check(&1);
    /// let stats = limiter.stats();
    /// assert_eq!((stats.allowed, stats.denied, stats.keys), (1, 1, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Locking behaviour
    /// None: the decision counts are summed from every thread's counters without a
    /// lock. (A thread's first check on a limiter takes a short mutex to claim its
    /// counters; a thread that exits gives them back the same way.)
    pub fn stats(&self) -> StoreStats {
        self.inner
            .common
            .stats(on_store!(&self.inner.engine, s => s.stats()))
    }

    /// The limiter's name ([`Builder::name`]; `"default"` unless set).
    pub fn name(&self) -> &str {
        &self.inner.common.name
    }

    /// The default quota: the one every key without its own quota is limited by.
    ///
    /// # Locking behaviour
    /// None for the token bucket, leaky bucket and window counters; the first shard's
    /// read lock for the sliding log.
    pub fn quota(&self) -> Quota {
        on_store!(&self.inner.engine, s => s.default_policy().quota())
    }

    /// The algorithm this limiter runs.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.common.algorithm
    }

    /// The number of shards of the key map.
    pub fn shards(&self) -> usize {
        on_store!(&self.inner.engine, s => s.shard_count())
    }

    /// The limiter's clock.
    pub fn clock(&self) -> &C {
        &self.inner.common.clock
    }

    /// The most a single request may cost under the default quota: the burst for the
    /// token and leaky buckets, the limit for the window algorithms. Decisions report it
    /// as their [`limit`](Decision::limit).
    pub fn capacity(&self) -> u64 {
        match &self.inner.engine {
            Engine::Compound(s) => s.capacity(),
            engine => on_store!(engine, s => s.default_policy().capacity()),
        }
    }

    /// The default quota's own capacity (a limiter with several quotas reports the
    /// smallest of all as [`capacity`](Self::capacity)).
    #[cfg(feature = "tower")]
    pub(crate) fn quota_capacity(&self) -> u64 {
        on_store!(&self.inner.engine, s => s.default_policy().capacity())
    }

    /// The [`also`](Builder::also) quotas, each with its capacity.
    #[cfg(feature = "tower")]
    pub(crate) fn also_policies(&self) -> Vec<(Quota, u64)> {
        match &self.inner.engine {
            Engine::Compound(s) => s.also_policies(),
            _ => Vec::new(),
        }
    }

    /// Every quota each key is held to: the default quota, then each
    /// [`also`](Builder::also) quota in the order they were added.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::builder("10/s burst 20".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build()?;
    /// assert_eq!(limiter.quotas(), ["10/s burst 20".parse()?, "1000/day".parse()?]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn quotas(&self) -> Vec<Quota> {
        match &self.inner.engine {
            Engine::Compound(s) => s.quotas(),
            _ => vec![self.quota()],
        }
    }
}

impl<K: Key, C: Clock> RateLimiter<K, C> {
    /// Checks one request for `key` and consumes one unit if it is admitted.
    ///
    /// # Locking behaviour
    /// The token bucket, leaky bucket and window counters take no lock for a key they
    /// hold (a key seen for the first time takes its shard's writer mutex to insert it).
    /// The sliding log takes the read lock of the key's shard (its write lock for a new
    /// key) and the key's own mutex. Never holds more than one shard lock.
    #[inline(always)]
    pub fn check<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let penalty = &self.inner.penalty;
        if penalty.occupied() {
            return self.check_boxed(key);
        }
        let decision = self.check_store(key);
        if !decision.is_allowed() && penalty.counts_denies() {
            return self.penalize(key, decision);
        }
        decision
    }

    /// [`check`](Self::check) of a key that may be in the penalty box.
    #[inline(never)]
    fn check_boxed<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        if let Some(until) = self.inner.penalty.blocked_until(key, now) {
            let decision = self.blocked(key, now, until);
            self.inner.common.record(key, &decision);
            return decision;
        }
        let decision = self.check_store(key);
        if !decision.is_allowed() && self.inner.penalty.counts_denies() {
            return self.penalize(key, decision);
        }
        decision
    }

    /// The decision of a key blocked until `until`, judged at `now`: denied, nothing
    /// remaining, retry at the block's end; the limit is the key's quota's.
    #[cold]
    fn blocked<Q>(&self, key: &Q, now: u64, until: u64) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let state = unit(on_store!(&self.inner.engine, s => s.peek(key, now, 1)));
        let wait = until - now;
        Decision::deny(state.limit(), 0, state.reset_after_ns().max(wait), wait)
            .for_policy(state.policy())
    }

    /// `decision`, a deny of `key`, counted toward a block: the block's decision if it
    /// starts one.
    #[cold]
    fn penalize<Q>(&self, key: &Q, decision: Decision) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        match self.inner.penalty.denied(key, now) {
            Some(until) if until > now => {
                let wait = until - now;
                Decision::deny(
                    decision.limit(),
                    0,
                    decision.reset_after_ns().max(wait),
                    decision.retry_after_ns().max(wait),
                )
                .for_policy(decision.policy())
            }
            _ => decision,
        }
    }

    /// Starts loading `key`'s slot, for a check that follows a lookup of something
    /// else (a plan): both loads then overlap. A hint only, for the lock-free stores.
    #[inline]
    pub(crate) fn prefetch<Q: Hash + ?Sized>(&self, key: &Q) {
        match &self.inner.engine {
            Engine::Word(store) => store.prefetch(key),
            Engine::Compound(Compound::Pair(store)) => store.prefetch(key),
            _ => {}
        }
    }

    /// [`check`](Self::check) by the store alone.
    #[inline(always)]
    fn check_store<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        match &self.inner.engine {
            // Inlined into the caller, so the decision's fields stay in registers.
            Engine::Word(store) => {
                let common = &self.inner.common;
                let decision = unit(store.check(key, || common.clock.now_ns(), 1, u64::MAX));
                common.record(key, &decision);
                decision
            }
            // Two quotas in one slot: the same path, with both policies.
            Engine::Compound(Compound::Pair(store)) => {
                let common = &self.inner.common;
                let decision = unit(store.check(key, || common.clock.now_ns(), 1, u64::MAX));
                common.record(key, &decision);
                decision
            }
            _ => self.check_cell(key),
        }
    }

    /// [`check`](Self::check) for the engines whose keys keep a cell of state.
    #[inline(never)]
    fn check_cell<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let common = &self.inner.common;
        let now = || common.clock.now_ns();
        // Several quotas: the decision goes straight to this function's result.
        if let Engine::Compound(store) = &self.inner.engine {
            let decision = store.check_unit(key, now());
            common.record(key, &decision);
            return decision;
        }
        let decision = unit(on_store!(&self.inner.engine, s => s.check(key, now, 1, u64::MAX)));
        common.record(key, &decision);
        decision
    }

    /// Checks a request of cost `n` for `key`: all `n` units are admitted together, or
    /// none. A cost of 0 is always admitted, consumes nothing and stores no key.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] when `n` exceeds what the key's quota can ever admit at
    /// once (the burst for the token and leaky buckets, the limit for the others): no
    /// wait would let it pass.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// // 1 MB per second per tenant, in chunks of at most 256 kB.
    /// let bytes: RateLimiter<String> = RateLimiter::new("1000000/s burst 256000".parse()?);
    /// assert!(bytes.check_n("tenant-a", 200_000)?.is_allowed());
    /// assert!(!bytes.check_n("tenant-a", 200_000)?.is_allowed()); // 56,000 left
    /// assert!(bytes.check_n("tenant-a", 300_000).is_err()); // never fits the burst
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Locking behaviour
    /// As [`check`](Self::check).
    pub fn check_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.check_within(key, n, u64::MAX)
    }

    /// [`check_n`](Self::check_n), refusing (as a deny, consuming nothing) an admission
    /// whose slot would be more than `max_delay` ns away.
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
        let now = || common.clock.now_ns();
        if n > 0 && self.inner.penalty.occupied() {
            let at = now();
            if let Some(until) = self.inner.penalty.blocked_until(key, at) {
                let blocked = self.blocked(key, at, until);
                // A cost beyond capacity stays an error, blocked or not.
                let decided =
                    on_store!(&self.inner.engine, s => s.peek(key, at, n)).map(|_| blocked);
                common.record_n(key, &decided);
                return decided;
            }
        }
        let decided = on_store!(&self.inner.engine, s => s.check(key, now, n, max_delay));
        common.record_n(key, &decided);
        match decided {
            Ok(d) if !d.is_allowed() && self.inner.penalty.counts_denies() => {
                Ok(self.penalize(key, d))
            }
            other => other,
        }
    }

    /// The decision a unit request for `key` would get now, without consuming anything
    /// and without storing a new key. `remaining` and `reset_after` describe the state as
    /// it stands.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::new("5/s".parse()?);
    /// limiter.check(&1);
    /// assert_eq!(limiter.peek(&1).remaining(), 4); // asks, consumes nothing
    /// assert_eq!(limiter.peek(&1).remaining(), 4);
    /// assert!(limiter.peek(&2).is_allowed()); // a key never seen: not stored
    /// assert_eq!(limiter.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Locking behaviour
    /// None for the token bucket, leaky bucket and window counters (unless a resize is
    /// moving the key right then: it waits for that); the read lock of the key's shard and
    /// the key's mutex for the sliding log.
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
        self.peek_at(key, n, self.inner.common.clock.now_ns())
    }

    /// [`peek_n`](Self::peek_n) at the instant `now` of the limiter's clock.
    pub(crate) fn peek_at<Q>(
        &self,
        key: &Q,
        n: u64,
        now: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let peeked = on_store!(&self.inner.engine, s => s.peek(key, now, n))?;
        match self.inner.penalty.blocked_until(key, now) {
            Some(until) if n > 0 => Ok(self.blocked(key, now, until)),
            _ => Ok(peeked),
        }
    }

    /// Shuts `key` out for `duration`: until then every check of it is denied, consumes
    /// nothing, and says to retry at the block's end. A block that ends later stays;
    /// [`unblock`](Self::unblock) ends it early. Works whether or not the limiter was
    /// built with [`Builder::block_for`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{clock::ManualClock, RateLimiter};
    ///
    /// let limiter: RateLimiter<String, _> =
    ///     RateLimiter::builder("100/s".parse()?).clock(ManualClock::new()).build()?;
    /// limiter.block("scraper", Duration::from_secs(600));
    /// let denied = limiter.check("scraper");
    /// assert_eq!(denied.retry_after(), Some(Duration::from_secs(600)));
    /// assert!(limiter.unblock("scraper"));
    /// assert!(limiter.check("scraper").is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Locking behaviour
    /// Takes the write lock of one of the penalty box's 16 shards.
    pub fn block<Q>(&self, key: &Q, duration: Duration)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        let until = now.saturating_add(crate::clock::nanos(duration));
        if until > now {
            self.inner.penalty.block(key, now, until);
        }
    }

    /// Ends `key`'s block, if it has one, and forgets the denies counted toward one;
    /// whether it was blocked.
    ///
    /// # Locking behaviour
    /// As [`block`](Self::block); none while no key is in the box.
    pub fn unblock<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner
            .penalty
            .unblock(key, self.inner.common.clock.now_ns())
    }

    /// How long `key` stays blocked, if it is.
    pub fn blocked_for<Q>(&self, key: &Q) -> Option<Duration>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let now = self.inner.common.clock.now_ns();
        self.inner
            .penalty
            .blocked_until(key, now)
            .map(|until| Duration::from_nanos(until - now))
    }

    /// How many keys are blocked now.
    pub fn blocked_keys(&self) -> usize {
        self.inner.penalty.blocked(self.inner.common.clock.now_ns())
    }

    /// Forgets `key`'s state: its next request sees a full, untouched quota. A quota set
    /// with [`set_quota`](Self::set_quota) stays, and so does a block.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let logins: RateLimiter<String> = RateLimiter::new("3/h".parse()?);
    /// for _ in 0..3 {
    ///     logins.check("alice");
    /// }
    /// assert!(!logins.check("alice").is_allowed());
    /// logins.reset("alice"); // she proved who she is another way
    /// assert!(logins.check("alice").is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Locking behaviour
    /// Takes the writer lock of the key's shard; checks on the shard's other keys go on.
    pub fn reset<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let now = || self.inner.common.clock.now_ns();
        match &self.inner.engine {
            Engine::Word(s) => s.remove(key, now),
            Engine::Log(s) => s.remove(key),
            Engine::Compound(s) => s.remove(key, now),
        };
    }

    /// Gives `key` its own quota (a paid tier, say), with the limiter's algorithm. The
    /// key's consumed units carry over (see [the type's docs](Self)). The quota stays
    /// until [`remove_quota`](Self::remove_quota), whether or not the key holds state.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<String> = RateLimiter::new("10/s".parse()?);
    /// limiter.set_quota("partner", "1000/s".parse()?)?;
    /// assert_eq!(limiter.quota_for("partner").limit(), 1000);
    /// assert_eq!(limiter.quota_for("anyone-else").limit(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::LimitTooLarge`] when the algorithm cannot hold the quota's limit.
    ///
    /// # Locking behaviour
    /// Takes the writer lock of the key's shard. For the token bucket, leaky bucket and
    /// window counters the shard then migrates to a table carrying the new quota
    /// (O(keys in the shard)), taking the lock for each batch of 1,024 slots only; checks
    /// go on (a key is decided by the old quota until its slot moves, and a check waits
    /// only if it meets its key in the middle of its move), and so do inserts, between
    /// batches.
    pub fn set_quota<Q>(&self, key: &Q, quota: Quota) -> Result<(), ConfigError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = || self.inner.common.clock.now_ns();
        on_store!(&self.inner.engine, s => {
            let policy = s.default_policy().with_quota(quota)?;
            s.set_key_quota(key.to_owned(), Some(policy), now);
        });
        Ok(())
    }

    /// Returns `key` to the default quota, carrying its consumed units over.
    ///
    /// # Locking behaviour
    /// As [`set_quota`](Self::set_quota).
    pub fn remove_quota<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = || self.inner.common.clock.now_ns();
        on_store!(&self.inner.engine, s => s.set_key_quota(key.to_owned(), None, now));
    }

    /// The quota `key` is limited by: its own, or the default.
    ///
    /// # Locking behaviour
    /// None for the token bucket, leaky bucket and window counters; the read lock of the
    /// key's shard for the sliding log.
    pub fn quota_for<Q>(&self, key: &Q) -> Quota
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        on_store!(&self.inner.engine, s => s.policy_of(key).quota())
    }

    /// Changes the default quota while the limiter serves. Every key without its own
    /// quota has its consumed units carried over (see [the type's docs](Self)).
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::new("10/s".parse()?);
    /// for _ in 0..10 {
    ///     limiter.check(&1);
    /// }
    /// limiter.set_default_quota("20/s".parse()?)?; // under load, in a handler, anywhere
    /// assert_eq!(limiter.quota().limit(), 20);
    /// assert_eq!(limiter.peek(&1).remaining(), 10); // what was used stays used
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::LimitTooLarge`] when the algorithm cannot hold the quota's limit;
    /// nothing changes then.
    ///
    /// # Locking behaviour
    /// For the token bucket, leaky bucket and window counters: every shard starts
    /// migrating to a table carrying the new quota, then this call moves the keys, taking
    /// a shard's writer lock for each batch of 1,024 slots only. Checks go on throughout
    /// (a key is decided by the old quota until its slot moves, and a check waits only if
    /// it meets its key in the middle of its move), and inserts between batches. For the
    /// sliding log, each shard's writer lock in turn, for as long as converting its keys
    /// takes.
    /// Concurrent calls are serialised.
    pub fn set_default_quota(&self, quota: Quota) -> Result<(), ConfigError> {
        let now = || self.inner.common.clock.now_ns();
        on_store!(&self.inner.engine, s => s.set_default_quota(quota, now))
    }

    /// Changes every quota each key is held to while the limiter serves: the default
    /// quota first, then each [`also`](Builder::also) quota in order, as
    /// [`quotas`](Self::quotas) lists them. Each quota's consumed units carry over, as
    /// [`set_default_quota`](Self::set_default_quota) carries them; a key with a quota
    /// of its own keeps it, and follows the new `also` quotas.
    ///
    /// ```
    /// use tollgate::{Algorithm, RateLimiter};
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::builder("10/s".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .algorithm(Algorithm::SlidingWindow)
    ///     .build()?;
    /// limiter.set_quotas(&["20/s".parse()?, "5000/day".parse()?])?;
    /// assert_eq!(limiter.quotas(), ["20/s".parse()?, "5000/day".parse()?]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::QuotaCount`] when `quotas` does not hold one quota for each the
    /// limiter has, and those of [`set_default_quota`](Self::set_default_quota). Nothing
    /// changes then.
    ///
    /// # Locking behaviour
    /// As [`set_default_quota`](Self::set_default_quota), once for each quota's store.
    pub fn set_quotas(&self, quotas: &[Quota]) -> Result<(), ConfigError> {
        let held = match &self.inner.engine {
            Engine::Compound(s) => s.quotas().len(),
            _ => 1,
        };
        if quotas.len() != held {
            return Err(ConfigError::QuotaCount {
                held,
                given: quotas.len(),
            });
        }
        let now = || self.inner.common.clock.now_ns();
        match &self.inner.engine {
            Engine::Compound(s) => s.set_quotas(quotas, now),
            engine => on_store!(engine, s => s.set_default_quota(quotas[0], now)),
        }
    }

    /// Consumes `n` units of `key`'s quota now, **even beyond what is available**: for
    /// costs known only after the fact, such as an LLM response's tokens. A key charged
    /// past its quota is in debt: its checks are denied until the debt is repaid at the
    /// quota's rate (at 10/s, a debt of 50 units takes 5 s, after which the key refills
    /// as usual). Returns the decision a unit request would get right after the charge
    /// (consuming nothing more): a deny, with the exact `retry_after`, while in debt.
    ///
    /// The pattern is to reserve an estimate with [`check_n`](Self::check_n) before the
    /// work, then settle the difference once the real cost is known: `charge` what was
    /// used beyond the estimate, or [`refund`](Self::refund) what was not.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{clock::ManualClock, RateLimiter};
    ///
    /// // 10,000 tokens a minute per tenant, up to 4,000 at once (a manual clock, so the
    /// // waits below are exact).
    /// let clock = ManualClock::new();
    /// let tokens: RateLimiter<String, ManualClock> =
    ///     RateLimiter::builder("10000/min burst 4000".parse()?).clock(clock.clone()).build()?;
    /// // Reserve an estimate of 1,000 before calling the model ...
    /// assert!(tokens.check_n("tenant-a", 1_000)?.is_allowed());
    /// // ... which used 4,500: charge the 3,500 beyond the estimate, 500 over the burst.
    /// let after = tokens.charge("tenant-a", 3_500)?;
    /// assert!(!after.is_allowed()); // in debt
    /// // The next unit is due once 501 units have refilled (the debt and the unit
    /// // itself), at 6 ms each.
    /// assert_eq!(after.retry_after(), Some(Duration::from_millis(3_006)));
    /// clock.advance(Duration::from_millis(3_006));
    /// assert!(tokens.check("tenant-a").is_allowed());
    /// // A call that failed upstream gives its reservation back.
    /// assert!(tokens.check_n("tenant-b", 1_000)?.is_allowed());
    /// assert_eq!(tokens.refund("tenant-b", 1_000)?.remaining(), 4_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`SettleError::Unsupported`] for the window counters and the sliding log, which
    /// cannot hold a debt; [`SettleError::NoRoom`] when `key` is new and the limiter is
    /// full under [`WhenFull::DenyNewKeys`]. Nothing changes then.
    ///
    /// # Locking behaviour
    /// As [`check`](Self::check) for a key the limiter holds (no lock); a new key takes
    /// its shard's writer mutex.
    pub fn charge<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle(key, Settle::Charge(n))
    }

    /// Gives back up to `n` units of `key`'s quota, never beyond a full quota: for
    /// requests reserved with [`check_n`](Self::check_n) that turned out cheaper, or that
    /// failed and should not count. Returns the decision a unit request would get right
    /// after. A key the limiter does not hold is full already: nothing is stored.
    ///
    /// For the token and leaky buckets a refund moves the bucket's state `n` emission
    /// intervals back (not before now); for the fixed window it lowers the current
    /// window's count; for the sliding window, the current window's count first, then the
    /// previous window's (whose units weigh in the estimate only as far as they have not
    /// decayed).
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let uploads: RateLimiter<String> = RateLimiter::new("10/min".parse()?);
    /// assert!(uploads.check_n("alice", 4)?.is_allowed()); // reserved for a batch of 4
    /// // Two files were rejected upstream: they do not count.
    /// let after = uploads.refund("alice", 2)?;
    /// assert_eq!(after.remaining(), 8);
    /// // Never beyond a full quota.
    /// assert_eq!(uploads.refund("alice", 100)?.remaining(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`SettleError::Unsupported`] for the sliding log. Nothing changes then.
    ///
    /// # Locking behaviour
    /// As [`check`](Self::check) for a key the limiter holds; none for an absent key.
    pub fn refund<Q>(&self, key: &Q, n: u64) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.settle(key, Settle::Refund(n))
    }

    #[inline]
    fn settle<Q>(&self, key: &Q, op: Settle) -> Result<Decision, SettleError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let common = &self.inner.common;
        let unsupported = op.unsupported(common.algorithm);
        if !WordPolicy::settles(common.algorithm, op) {
            return Err(unsupported);
        }
        let now = common.clock.now_ns();
        let decision = match &self.inner.engine {
            // A held key's decision returns from here, in registers (a fast path never
            // refuses for room).
            Engine::Word(store) => match store.settle_held(key, now, op) {
                Some(decision) => return Ok(decision),
                None => store.settle_slow(key, now, op),
            },
            Engine::Compound(store) => store.settle(key, now, op),
            Engine::Log(_) => return Err(unsupported),
        };
        if decision.is_capacity_deny() {
            return Err(SettleError::NoRoom {
                retry_after: decision.retry_after().unwrap_or_default(),
            });
        }
        Ok(decision)
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
    /// Further quotas every key is held to ([`also`](Self::also)).
    also: Vec<Quota>,
    algorithm: Algorithm,
    clock: C,
    shards: Option<usize>,
    max_keys: Option<usize>,
    /// The keys the tables are sized for up front ([`expected_keys`](Self::expected_keys)).
    expected_keys: usize,
    when_full: WhenFull,
    sweep: bool,
    name: Arc<str>,
    counters: bool,
    /// [`block_for`](Self::block_for) and [`block_after`](Self::block_after), checked at
    /// build.
    block_for: Option<Duration>,
    block_after: Option<(u32, Duration)>,
    key: PhantomData<fn() -> K>,
}

impl<K> Builder<K> {
    fn new(quota: Quota) -> Self {
        Self {
            quota,
            also: Vec::new(),
            algorithm: Algorithm::default(),
            clock: MonotonicClock::new(),
            shards: None,
            max_keys: None,
            expected_keys: 0,
            when_full: WhenFull::default(),
            sweep: true,
            name: Arc::from("default"),
            counters: true,
            block_for: None,
            block_after: None,
            key: PhantomData,
        }
    }
}

impl<K, C> Builder<K, C> {
    fn limits(&self, shards: usize) -> Limits {
        Limits {
            shards,
            max_keys: self.max_keys.unwrap_or(usize::MAX),
            when_full: self.when_full,
            sweep: self.sweep,
            expected_keys: self.expected_keys,
        }
    }
}

impl<K, C> fmt::Debug for Builder<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("quota", &self.quota)
            .field("also", &self.also)
            .field("algorithm", &self.algorithm)
            .field("shards", &self.shards)
            .field("max_keys", &self.max_keys)
            .field("expected_keys", &self.expected_keys)
            .field("when_full", &self.when_full)
            .field("sweep_untouched", &self.sweep)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<K: Key, C: Clock> Builder<K, C> {
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
            also: self.also,
            algorithm: self.algorithm,
            clock,
            shards: self.shards,
            max_keys: self.max_keys,
            expected_keys: self.expected_keys,
            when_full: self.when_full,
            sweep: self.sweep,
            name: self.name,
            counters: self.counters,
            block_for: self.block_for,
            block_after: self.block_after,
            key: PhantomData,
        }
    }

    /// A penalty box: a key denied by its quota is then blocked for `duration` (every
    /// check denied, retry at the block's end, nothing consumed), from the deny on. With
    /// [`block_after`](Self::block_after), only after several denies.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{clock::ManualClock, RateLimiter};
    ///
    /// let logins: RateLimiter<String, _> = RateLimiter::builder("5/min".parse()?)
    ///     .block_for(Duration::from_secs(600))
    ///     .clock(ManualClock::new())
    ///     .build()?;
    /// for _ in 0..5 {
    ///     assert!(logins.check("mallory").is_allowed());
    /// }
    /// // The sixth breaks the limit: shut out for 10 minutes, not the quota's 60 s.
    /// assert_eq!(logins.check("mallory").retry_after(), Some(Duration::from_secs(600)));
    /// logins.clock().advance(Duration::from_secs(120));
    /// assert!(!logins.check("mallory").is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn block_for(mut self, duration: Duration) -> Self {
        self.block_for = Some(duration);
        self
    }

    /// With [`block_for`](Self::block_for): block a key only once it is denied `denies`
    /// times within `within` of the first of them (`block_after(1, _)` is the default).
    pub fn block_after(mut self, denies: u32, within: Duration) -> Self {
        self.block_after = Some((denies, within));
        self
    }

    /// The penalty asked for, checked.
    fn penalty(&self) -> Result<Option<Penalty>, ConfigError> {
        Penalty::from_settings(self.block_for, self.block_after)
    }

    /// Whether to count decisions ([`StoreStats::allowed`] and
    /// [`denied`](StoreStats::denied), and the metrics built on them); on by default. Each
    /// thread counts into its own counters, so counting writes no shared word; turning
    /// it off saves that per-thread add on every check.
    pub fn counters(mut self, on: bool) -> Self {
        self.counters = on;
        self
    }

    /// Names the limiter, for metrics (the `limiter` label) and logs; `"default"` unless
    /// set.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// The number of shards of the key map: a power of two, at most [`MAX_SHARDS`]. By
    /// default four per CPU, rounded up to a power of two.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The most keys the limiter holds at once; unbounded by default.
    ///
    /// When it is full, a new key first makes room by dropping a key of its shard whose
    /// state is back to untouched (which changes no decision), then follows
    /// [`when_full`](Self::when_full). The cap is global; room is made in the new key's
    /// shard, so for caps of a few keys use [`shards(1)`](Self::shards).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// Sizes the key tables for `keys` keys when the limiter is built, and keeps them at
    /// least that large: no table is rebuilt to grow until about `keys` keys are in use
    /// (each shard is sized for its share and four standard deviations more), and none
    /// shrinks below it when keys go. 0 (the default) sizes nothing ahead: the tables
    /// start small and grow with the keys.
    ///
    /// For a server that knows roughly how many keys it will hold, this takes the
    /// tables' growth off the requests' path: while a table grows, about one new key in
    /// four moves a few of its slots to the next table and one in 200 writes a few pages
    /// of it, which sets the new keys' p99 and p99.99.
    ///
    /// # Cost
    /// The memory is taken at build: about 20 bytes per `u64` key for one quota (40 for
    /// two). For the lock-free algorithms (all but the sliding log) every page of the
    /// tables is written then too, so no insert takes a page fault: about 2 µs per 4 KiB
    /// page on a VM, some 20 ms for 2 million `u64` keys. The sliding log's tables, and
    /// the synced limiter's ([`build_synced`](Self::build_synced)), are reserved, not
    /// written.
    ///
    /// [`build`](Self::build) fails with [`ConfigError::ExpectedKeysTooMany`] for more
    /// keys than [`max_keys`](Self::max_keys), than the tables can hold, or than fit in
    /// this machine's memory (where the system says how much it has).
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::builder("100/s".parse()?)
    ///     .expected_keys(100_000)
    ///     .build()?;
    /// for key in 0..100_000 {
    ///     assert!(limiter.check(&key).is_allowed());
    /// }
    /// assert_eq!(limiter.stats().resizes, 0); // no table grew
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn expected_keys(mut self, keys: usize) -> Self {
        self.expected_keys = keys;
        self
    }

    /// What a full limiter does with a new key when no untouched key can make room;
    /// [`WhenFull::EvictLeastActive`] by default.
    pub fn when_full(mut self, when_full: WhenFull) -> Self {
        self.when_full = when_full;
        self
    }

    /// Whether keys whose state is back to untouched are dropped as the limiter goes:
    /// when a new key finds its shard's table full, the table is swept before it is
    /// rebuilt, and the keys untouched for 4 periods of their quota and 1 s at least, or
    /// for one period and since the table's previous full sweep, are dropped. Memory thus
    /// follows the keys in use at O(1) cost per insert (amortised), and a key that comes
    /// back within a table's span or within a second is never dropped and re-inserted
    /// over and over, whatever its period: a set of keys in use is left alone. Dropping
    /// an untouched key changes no decision. On by default; turn it off only to keep
    /// every key until [`reset`](RateLimiter::reset) or `max_keys`.
    pub fn sweep_untouched(mut self, sweep: bool) -> Self {
        self.sweep = sweep;
        self
    }

    /// Holds every key to `quota` as well, all or nothing: a check is admitted only if
    /// every quota admits it, and then consumes from each; a denied check consumes from
    /// none. For example a burst limit and a daily cap, `"10/s burst 20"` and
    /// `"1000/day"`. Call it again for a third quota.
    ///
    /// The [`Decision`] describes the most constraining quota
    /// ([`Decision::policy`] says which): for an admission, the one with the fewest
    /// units left; for a deny, the denying one with the longest wait, with the fewest
    /// units left of all. Per-key quotas ([`RateLimiter::set_quota`]) and
    /// [`set_default_quota`](RateLimiter::set_default_quota) change the first quota;
    /// the `also` quotas stay. Each quota keeps its own state per key, so memory grows
    /// with the number of quotas, and [`max_keys`](Self::max_keys) caps each.
    ///
    /// Two quotas share one slot per key on x86-64 CPUs with `cmpxchg16b` and AVX
    /// (detected at run time; every x86-64 server CPU of the last decade): a check probes
    /// once and changes both states with one 16-byte compare-and-swap, so it writes both
    /// or neither, atomically. With three quotas or more (or on other CPUs), each quota
    /// has its own store and a check goes through them in order: a check that a later
    /// quota denies holds the earlier quotas' units for the nanoseconds until it gives
    /// them back, so a request racing it on the same key may be denied where it would
    /// otherwise pass. Either way nothing is ever admitted beyond any single quota's
    /// bound, and the decisions are the same.
    ///
    /// The synced limiter ([`build_synced`](Self::build_synced)) holds every key to
    /// the `also` quotas too, each synced on its own (see [`crate::sync`]'s "Several
    /// quotas"); the Redis tier's builder has its own
    /// [`also`](crate::redis::RedisBuilder::also).
    ///
    /// ```
    /// use tollgate::{clock::ManualClock, RateLimiter};
    ///
    /// let limiter: RateLimiter<String, ManualClock> =
    ///     RateLimiter::builder("10/s burst 20".parse()?)
    ///         .also("30/h".parse()?)
    ///         .clock(ManualClock::new())
    ///         .build()?;
    /// for _ in 0..20 {
    ///     assert!(limiter.check("alice").is_allowed()); // the burst
    /// }
    /// let burst = limiter.check("alice");
    /// assert_eq!(burst.policy(), 0); // the burst quota denies
    /// limiter.clock().advance(std::time::Duration::from_secs(60));
    /// for _ in 0..10 {
    ///     assert!(limiter.check("alice").is_allowed());
    /// }
    /// let hourly = limiter.check("alice"); // 30 in the hour
    /// assert_eq!(hourly.policy(), 1);
    /// assert_eq!(hourly.limit(), 30);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn also(mut self, quota: Quota) -> Self {
        self.also.push(quota);
        self
    }

    /// Validates the configuration and builds the limiter.
    ///
    /// # Cost
    /// On Linux, the first limiter built in a process whose checks take no lock (every
    /// algorithm but the sliding log) registers the process for `membarrier(2)`, which
    /// its reclamation uses. This happens once, and takes up to about 20 ms in a process
    /// that already runs several threads (the kernel waits for an RCU grace period).
    /// Later builds and every check pay nothing for it, so build limiters at startup,
    /// not on a request's path.
    ///
    /// # Errors
    /// [`ConfigError::InvalidShards`] for a shard count that is zero, not a power of two
    /// or above [`MAX_SHARDS`],
    /// [`ConfigError::ZeroMaxKeys`], [`ConfigError::LimitTooLarge`] when the algorithm
    /// cannot hold a quota's limit, or [`ConfigError::Unsupported`] for
    /// [`also`](Self::also) with the sliding log (which cannot give units back).
    pub fn build(self) -> Result<RateLimiter<K, C>, ConfigError> {
        let limits = self.checked_limits()?;
        self.penalty()?;
        let engine = match AnyPolicy::new(self.algorithm, self.quota, self.clock.unix_origin_ns())?
        {
            AnyPolicy::Word(policy) if self.also.is_empty() => {
                check_room(limits, WordStore::<K>::bytes_ahead(limits))?;
                Engine::Word(WordStore::new(limits, policy))
            }
            AnyPolicy::Word(policy) => {
                let mut policies = vec![policy];
                for &quota in &self.also {
                    policies.push(policy.with_quota(quota)?);
                }
                check_room(limits, Compound::<K>::bytes_ahead(limits, policies.len()))?;
                Engine::Compound(Compound::new(limits, policies))
            }
            AnyPolicy::Log(_) if !self.also.is_empty() => {
                return Err(ConfigError::Unsupported(
                    "several quotas (`also`) with the sliding log, which cannot give back \
                     the units of a check another quota denies: use the sliding window \
                     counter or a bucket",
                ));
            }
            AnyPolicy::Log(policy) => {
                check_room(limits, Store::<K, LogCell>::bytes_ahead(limits))?;
                Engine::Log(Store::new(limits, policy))
            }
        };
        Ok(self.assemble(engine))
    }

    /// What a limiter of another tier built from this builder keeps: its common part,
    /// its quota and algorithm, and its store's limits; checked as [`build`](Self::build)
    /// checks them.
    #[cfg(feature = "redis")]
    pub(crate) fn into_parts(self) -> Result<(Common<C>, Limits, Vec<Quota>), ConfigError> {
        let limits = self.checked_limits()?;
        if self.penalty()?.is_some() {
            return Err(ConfigError::Unsupported(
                "block_for in the sync: block keys in the process (RateLimiter) or in \
                 Redis (RedisBuilder::block_for)",
            ));
        }
        let mut quotas = vec![self.quota];
        quotas.extend_from_slice(&self.also);
        Ok((self.into_common(), limits, quotas))
    }

    /// The store's limits, checked.
    fn checked_limits(&self) -> Result<Limits, ConfigError> {
        let shards = self.shard_count()?;
        if self.max_keys == Some(0) {
            return Err(ConfigError::ZeroMaxKeys);
        }
        Ok(self.limits(shards))
    }

    /// The shard count asked for, or the default.
    fn shard_count(&self) -> Result<usize, ConfigError> {
        match self.shards {
            Some(n) if !valid_shards(n) => Err(ConfigError::InvalidShards(n)),
            Some(n) => Ok(n),
            None => Ok(default_shards()),
        }
    }

    fn into_common(self) -> Common<C> {
        Common {
            algorithm: self.algorithm,
            clock: self.clock,
            name: self.name,
            tally: Tally::new(self.counters),
        }
    }

    fn assemble(self, engine: Engine<K>) -> RateLimiter<K, C> {
        // Checked by `build`.
        let penalty = PenaltyBox::new(self.penalty().ok().flatten());
        let limiter = RateLimiter {
            inner: Arc::new(Inner {
                engine,
                common: self.into_common(),
                penalty,
            }),
        };
        // Every second, `stats` publishes (inside a tokio runtime).
        #[cfg(all(feature = "metrics", feature = "tokio"))]
        crate::observe::every_second(Arc::downgrade(&limiter.inner), |inner| {
            RateLimiter { inner }.stats();
        });
        limiter
    }
}

/// The most shards a limiter may have: 65,536 (a few MiB of empty shards; more would
/// only cost memory, and `1 << 30` of them would take 128 GiB before the first check).
pub const MAX_SHARDS: usize = 1 << 16;

/// Whether `n` is a shard count a limiter accepts: a power of two up to [`MAX_SHARDS`].
pub(crate) fn valid_shards(n: usize) -> bool {
    n.is_power_of_two() && n <= MAX_SHARDS
}

/// Four shards per CPU, rounded up to a power of two (at most [`MAX_SHARDS`]).
fn default_shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (cpus.saturating_mul(4)).min(MAX_SHARDS).next_power_of_two()
}
