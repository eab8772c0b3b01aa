//! The local deny cache of [`RedisLimiter`](super::RedisLimiter): until the instant a
//! reply from Redis says a unit request for a key could next pass, the same request is
//! denied in process, with no round trip.
//!
//! # Why a cached deny is exact
//! The scripts write nothing on a deny, and every admission (by any node) only moves a
//! key's state further from admitting: a GCRA TAT only grows, a window's counts only
//! grow within their window. So when Redis says "a unit request is denied until `X`",
//! every unit request before `X` is denied, by Redis itself, whatever else happens —
//! except an administrative change: a reset of the key or a quota change, which
//! invalidate the cache. The cached decision is the one Redis would give: the same
//! limit, `remaining` 0, and the same absolute reset and retry instants, so both count
//! down (for every algorithm the scripts run, a unit deny has `remaining` 0, and its
//! reset and retry instants stay put while the state does).
//!
//! Two replies teach the cache:
//! - a deny of a unit request, for its retry and reset instants;
//! - an admission that leaves `remaining` 0 for the token bucket and the fixed window,
//!   whose next unit request is then denied until an instant the reply determines: the
//!   bucket's TAT − τ (reset − τ from now), and the window's end (its reset). The
//!   sliding window's next retry depends on counts the reply does not carry, so only its
//!   denies are cached.
//!
//! A reply that shows a unit request could pass now (an admission with `remaining`
//! ≥ 1) clears the key's entry.
//!
//! # One call per expiry
//! When a key's cached deny expires under a flood, every concurrent request would call
//! Redis at once, and all but one would be denied. Instead the first one calls and the
//! others wait for its reply (at most the call's timeout), then look again: if the reply
//! taught a new deny, they get it — the decision Redis would have given them, since it
//! would have decided them after that call — and otherwise they call. Keys without a
//! cached deny (or whose last reply showed room) are never held back.
//!
//! # Time
//! Instants are in microseconds of the limiter's local clock (the caller's clock with
//! `caller_clock`, else a monotonic one), the scripts' unit. An entry starts from the
//! instant the call was *sent*: Redis decided no earlier than that, so its own retry
//! instant is no earlier than the cached one, and the cache never denies a request
//! Redis would admit. (With `caller_clock` the script reads the same clock, and cached
//! decisions equal Redis's exactly.)
//!
//! A hit is also kept in a small per-thread front (the store's own per-thread deny
//! cache), so that a flooded key's next hits on that thread touch no shared memory;
//! resets and quota changes invalidate the fronts too.
//!
//! # Memory
//! Entries live in the crate's sharded [`Store`]: bounded by `max_keys`, dropped by the
//! sweep of a full shard table once their instant has passed (and stayed past since the
//! shard's previous full sweep), and, when the cache is full, the entry nearest its
//! expiry makes room.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::algorithm::{Algorithm, Policy};
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::store::recent_denies::Denies;
use crate::store::state::State;
use crate::store::{Limits, Store, WhenFull};
use crate::tally::Tally;

/// The cache's policy: the quota and the algorithm (for the `limit` of a cached deny).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CachePolicy {
    quota: Quota,
    algorithm: Algorithm,
}

impl CachePolicy {
    pub(crate) fn new(algorithm: Algorithm, quota: Quota) -> Self {
        Self { quota, algorithm }
    }
}

impl Policy for CachePolicy {
    fn quota(&self) -> Quota {
        self.quota
    }

    fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError> {
        Ok(Self::new(self.algorithm, quota))
    }

    fn capacity(&self) -> u64 {
        super::script_quota::capacity_of(self.algorithm, self.quota)
    }
}

/// A cached deny: a unit request is denied while `now < retry_at`; both instants in µs
/// of the local clock. `limit` is the quota's, as the reply gave it, and `policy` which
/// of the limiter's quotas denied ([`Decision::policy`]). A `block` (the penalty box)
/// denies requests of every cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Until {
    pub(crate) retry_at: u64,
    pub(crate) reset_at: u64,
    pub(crate) limit: u64,
    pub(crate) policy: usize,
    pub(crate) block: bool,
}

/// One key's entry: its deny and whether a call for it is under way. A mutex, not
/// atomics, so that a reader never pairs the retry instant of one reply with the reset
/// instant of another.
#[derive(Debug, Default)]
struct Entry {
    until: Until,
    calling: bool,
}

/// What the cell shares with the calls and waiters of its key, which may outlive its
/// place in the store.
#[derive(Debug, Default)]
pub(crate) struct KeyCalls {
    entry: Mutex<Entry>,
    /// Wakes the requests waiting for the call under way.
    done: Notify,
}

impl KeyCalls {
    /// Whether a call for the key is under way.
    pub(crate) fn calling(&self) -> bool {
        self.entry.lock().calling
    }

    /// A future that completes when the call under way ends; enable it, then check
    /// [`calling`](Self::calling), so that an end in between is not missed.
    pub(crate) fn done(&self) -> tokio::sync::futures::Notified<'_> {
        self.done.notified()
    }
}

#[derive(Debug, Default)]
pub(crate) struct DenyCell(Arc<KeyCalls>);

impl DenyCell {
    fn until(&self) -> Until {
        self.0.entry.lock().until
    }

    fn set(&self, until: Until) {
        self.0.entry.lock().until = until;
    }
}

/// The call a request makes for a key whose cached deny expired; dropped (after its
/// reply was learned, or when it failed or was abandoned), it wakes the waiters.
#[derive(Debug)]
pub(crate) struct CallGuard(Arc<KeyCalls>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.entry.lock().calling = false;
        self.0.done.notify_waiters();
    }
}

/// What the cache says of a unit request.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// Denied, with no call.
    Hit(Decision),
    /// A call for the key is under way: wait for it, then look again.
    Wait(Arc<KeyCalls>),
    /// Call Redis, as the one caller for the key's expired deny.
    Call(CallGuard),
    /// Call Redis.
    Miss,
}

/// The deny `until` gives at `now` (µs); `None` once it has expired.
pub(crate) fn cached_decision(until: Until, now_us: u64) -> Option<Decision> {
    (now_us < until.retry_at).then(|| {
        Decision::deny(
            until.limit,
            0,
            until.reset_at.saturating_sub(now_us).saturating_mul(1_000),
            (until.retry_at - now_us).saturating_mul(1_000),
        )
        .for_policy(until.policy)
    })
}

impl State for DenyCell {
    type Policy = CachePolicy;

    fn fresh(_policy: &CachePolicy) -> Self {
        Self::default()
    }

    // The cache reads and writes its cells through `Store::with_state` and
    // `Store::upsert`; the store's own calls (eviction, sweeping) go through `peek` and
    // `reset_after_ns`, with `now` in ns as everywhere in the store (the entries keep µs).
    fn check(&self, policy: &CachePolicy, now: u64, cost: u64, _max_delay: u64) -> Decision {
        self.peek(policy, now, cost)
    }

    fn peek(&self, policy: &CachePolicy, now: u64, cost: u64) -> Decision {
        let until = self.until();
        match cached_decision(until, now / 1_000) {
            Some(deny) if cost == 1 => deny,
            // Nothing consumed locally: the entry's only cost is its time to expiry.
            _ => Decision::allow(
                policy.capacity(),
                policy.capacity(),
                self.reset_after_ns(policy, now),
            ),
        }
    }

    fn peek_vacant(policy: &CachePolicy, _now: u64, _cost: u64) -> Decision {
        Decision::allow(policy.capacity(), policy.capacity(), 0)
    }

    fn reset_after_ns(&self, _policy: &CachePolicy, now: u64) -> u64 {
        self.until()
            .retry_at
            .saturating_mul(1_000)
            .saturating_sub(now)
    }

    fn convert(&self, _now: u64, _from: &CachePolicy, _to: &CachePolicy) {
        // A new quota can admit sooner: what the old one denied says nothing now.
        self.set(Until::default());
    }
}

/// What one reply from Redis teaches about a key's next unit request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lesson {
    /// Denied until then.
    Denied(Until),
    /// It could pass now: forget any entry.
    Admissible,
    /// Nothing certain.
    Nothing,
}

/// What a reply to a request of `cost` sent at `sent_us` teaches, for `algorithm` whose
/// token bucket has `tau_us` = (burst − 1)·T. Pure: the differential tests run it.
pub(crate) fn lesson(
    algorithm: Algorithm,
    tau_us: u64,
    cost: u64,
    sent_us: u64,
    decision: &Decision,
) -> Lesson {
    let reset_us = decision.reset_after_ns() / 1_000;
    let limit = decision.limit();
    let policy = decision.policy();
    let at = |after_us: u64| sent_us.saturating_add(after_us);
    if !decision.is_allowed() {
        if cost != 1 {
            return Lesson::Nothing;
        }
        let retry_us = decision.retry_after_ns() / 1_000;
        return Lesson::Denied(Until {
            retry_at: at(retry_us),
            reset_at: at(reset_us),
            limit,
            policy,
            block: false,
        });
    }
    if decision.remaining() >= 1 {
        return Lesson::Admissible;
    }
    match algorithm {
        // remaining = ⌊(τ + T − (TAT − now)) / T⌋ = 0 ⟺ TAT − now > τ: the next unit
        // request waits until TAT − τ.
        Algorithm::TokenBucket if cost >= 1 && reset_us > tau_us => Lesson::Denied(Until {
            retry_at: at(reset_us - tau_us),
            reset_at: at(reset_us),
            limit,
            policy,
            block: false,
        }),
        // The window is full: the next unit request waits for its end.
        Algorithm::FixedWindow if cost >= 1 && reset_us > 0 => Lesson::Denied(Until {
            retry_at: at(reset_us),
            reset_at: at(reset_us),
            limit,
            policy,
            block: false,
        }),
        _ => Lesson::Nothing,
    }
}

/// The cache: a store of [`DenyCell`]s and a generation that resets and quota changes
/// bump, so that a reply already in flight when they happened is not learned from.
pub(crate) struct DenyCache {
    store: Store<String, DenyCell>,
    /// A per-thread front of recent hits: a hit there touches no shared memory.
    front: Denies,
    hasher: ahash::RandomState,
    generation: AtomicU64,
    /// Cached denies answered, counted per thread (no shared write on a hit).
    hits: Tally,
}

impl DenyCache {
    pub(crate) fn new(policy: CachePolicy, max_keys: usize) -> Self {
        // Four per CPU, but no more than the keys it may hold (a power of two, however
        // large `max_keys` is).
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let shards = cpus
            .saturating_mul(4)
            .min(max_keys)
            .min(crate::MAX_SHARDS)
            .next_power_of_two();
        let limits = Limits {
            shards,
            max_keys,
            when_full: WhenFull::EvictLeastActive,
            sweep: true,
            expected_keys: 0,
        };
        Self {
            store: Store::new(limits, policy),
            front: Denies::new(),
            hasher: ahash::RandomState::new(),
            generation: AtomicU64::new(0),
            hits: Tally::new(true),
        }
    }

    /// The cached deny of a unit request for `key` at `now_us`, if one is live; else
    /// whether to call or to wait for a call under way. With `coalesce` false, never
    /// `Wait` nor `Call`.
    ///
    /// Takes the key's shard read lock and its entry's mutex, briefly.
    pub(crate) fn lookup(&self, key: &str, now_us: u64, coalesce: bool) -> Lookup {
        let now_ns = now_us.saturating_mul(1_000);
        let hash = self.hasher.hash_one(key);
        let front = self.front.generation();
        if let Some(hit) = self.front.lookup(front, hash, key, now_ns) {
            self.hits.count(false);
            return Lookup::Hit(hit);
        }
        // A cache that holds no entry has nothing to say: one load of its count, where
        // looking the key up would take its shard's lock (so a limiter whose keys are
        // never denied pays no lock for its cache).
        if self.store.len() == 0 {
            return Lookup::Miss;
        }
        let found = self.store.with_state(key, |cell| {
            let mut entry = cell.0.entry.lock();
            if let Some(hit) = cached_decision(entry.until, now_us) {
                return Lookup::Hit(hit);
            }
            // Only a key whose deny just expired is held back: one with room left
            // (cleared) serves its requests concurrently.
            if !coalesce || entry.until == Until::default() {
                return Lookup::Miss;
            }
            if entry.calling {
                return Lookup::Wait(Arc::clone(&cell.0));
            }
            entry.calling = true;
            Lookup::Call(CallGuard(Arc::clone(&cell.0)))
        });
        let found = found.unwrap_or(Lookup::Miss);
        if let Lookup::Hit(hit) = &found {
            self.hits.count(false);
            self.front.remember(front, hash, key, now_ns, hit);
        }
        found
    }

    /// The deny of `key`'s block at `now_us`, for a request of any cost; `None` when
    /// the cache holds no live block of it.
    ///
    /// Takes the key's shard read lock and its entry's mutex, briefly.
    pub(crate) fn blocked(&self, key: &str, now_us: u64) -> Option<Decision> {
        if self.store.len() == 0 {
            return None;
        }
        let hit = self
            .store
            .with_state(key, |cell| {
                let until = cell.until();
                until
                    .block
                    .then(|| cached_decision(until, now_us))
                    .flatten()
            })
            .flatten();
        if hit.is_some() {
            self.hits.count(false);
        }
        hit
    }

    /// The generation to pass to [`learn`](Self::learn), read before the call is sent.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Applies `lesson` to `key`'s entry, unless a reset or quota change happened since
    /// `generation` was read.
    pub(crate) fn learn(&self, key: &str, generation: u64, now_us: u64, lesson: Lesson) {
        let current = || self.generation.load(Ordering::Acquire) == generation;
        match lesson {
            Lesson::Nothing => {}
            // No entry to clear (as in `lookup`, one load instead of the shard's lock).
            Lesson::Admissible if self.store.len() == 0 => {}
            Lesson::Admissible => {
                self.store.with_state(key, |cell| {
                    if current() {
                        let mut entry = cell.0.entry.lock();
                        if entry.until.retry_at > now_us {
                            // A live deny proved wrong (a reset by another node): the
                            // threads' copies of it go too.
                            self.front.invalidate();
                        }
                        entry.until = Until::default();
                    }
                });
            }
            Lesson::Denied(until) => {
                if until.retry_at <= now_us {
                    return;
                }
                self.store
                    .upsert(key, now_us.saturating_mul(1_000), |cell| {
                        // Checked under the shard lock that `forget` must take to remove the
                        // entry: a reset either comes first (and the generation tells) or
                        // removes what this writes.
                        if current() {
                            let mut entry = cell.0.entry.lock();
                            if until.retry_at > entry.until.retry_at {
                                if until.block && entry.until.retry_at > now_us {
                                    // A block outlasting a live deny: the threads'
                                    // copies of that deny go.
                                    self.front.invalidate();
                                }
                                entry.until = until;
                            }
                        }
                    });
            }
        }
    }

    /// Forgets `key`'s entry (after a reset of the key).
    pub(crate) fn forget(&self, key: &str) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.front.invalidate();
        self.store.remove(key);
    }

    /// Forgets every entry and limits by `policy` from now on.
    pub(crate) fn reconfigure(&self, policy: CachePolicy, now_us: u64) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.front.invalidate();
        self.store.set_policy(policy, now_us.saturating_mul(1_000));
    }

    /// Forgets every entry (a reset elsewhere, or Redis may have lost its state).
    pub(crate) fn clear(&self, now_us: u64) {
        self.reconfigure(self.store.default_policy(), now_us);
    }

    /// Cached denies answered so far.
    pub(crate) fn hits(&self) -> u64 {
        self.hits.totals().denied
    }

    /// Keys with an entry now.
    pub(crate) fn len(&self) -> usize {
        self.store.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::Clock;

    fn cached(cache: &DenyCache, key: &str, now_us: u64) -> Option<Decision> {
        match cache.lookup(key, now_us, false) {
            Lookup::Hit(d) => Some(d),
            Lookup::Miss => None,
            other => panic!("{other:?} without coalescing"),
        }
    }

    /// A deny of a quota of limit 1 until `at` (µs), as a window's reply teaches.
    fn denied(at: u64) -> Lesson {
        Lesson::Denied(Until {
            retry_at: at,
            reset_at: at,
            limit: 1,
            policy: 0,
            block: false,
        })
    }

    fn quota(limit: u64, burst: u64) -> Quota {
        Quota::per_second(limit).unwrap().with_burst(burst).unwrap()
    }

    #[test]
    fn a_unit_deny_is_cached_until_its_retry_instant_and_counts_down() {
        let cache = DenyCache::new(CachePolicy::new(Algorithm::TokenBucket, quota(10, 5)), 64);
        let deny = Decision::deny(5, 0, 500_000_000, 100_000_000);
        let g = cache.generation();
        let lesson = lesson(Algorithm::TokenBucket, 400_000, 1, 1_000, &deny);
        cache.learn("k", g, 1_000, lesson);
        let hit = cached(&cache, "k", 51_000).expect("cached");
        assert_eq!(hit, Decision::deny(5, 0, 450_000_000, 50_000_000));
        assert!(cached(&cache, "k", 100_999).is_some());
        assert_eq!(cached(&cache, "k", 101_000), None, "expired at the instant");
        assert_eq!(cached(&cache, "other", 2_000), None);
        assert_eq!(cache.hits(), 2);
    }

    #[test]
    fn admissions_teach_the_next_deny_only_where_the_reply_determines_it() {
        // Token bucket, T = 100 ms, burst 5 (τ = 400 ms): remaining 0 with reset 450 ms
        // means TAT − now = 450 ms, so the next unit passes in 50 ms.
        let spent = Decision::allow(5, 0, 450_000_000);
        assert_eq!(
            lesson(Algorithm::TokenBucket, 400_000, 1, 10, &spent),
            Lesson::Denied(Until {
                retry_at: 50_010,
                reset_at: 450_010,
                limit: 5,
                policy: 0,
                block: false,
            })
        );
        assert_eq!(
            lesson(
                Algorithm::TokenBucket,
                400_000,
                1,
                10,
                &Decision::allow(5, 1, 1)
            ),
            Lesson::Admissible
        );
        let full = Decision::allow(10, 0, 300_000_000);
        assert_eq!(
            lesson(Algorithm::FixedWindow, 0, 2, 0, &full),
            Lesson::Denied(Until {
                retry_at: 300_000,
                reset_at: 300_000,
                limit: 10,
                policy: 0,
                block: false,
            })
        );
        assert_eq!(
            lesson(Algorithm::SlidingWindow, 0, 1, 0, &full),
            Lesson::Nothing
        );
        // A deny of a larger cost says nothing exact about a unit request.
        let deny = Decision::deny(10, 3, 1_000_000, 1_000_000);
        assert_eq!(
            lesson(Algorithm::FixedWindow, 0, 4, 0, &deny),
            Lesson::Nothing
        );
    }

    #[test]
    fn a_reset_or_a_quota_change_forgets_and_beats_a_reply_in_flight() {
        let policy = CachePolicy::new(Algorithm::FixedWindow, quota(10, 10));
        let cache = DenyCache::new(policy, 64);
        let denied = Lesson::Denied(Until {
            retry_at: 1_000,
            reset_at: 1_000,
            limit: 10,
            policy: 0,
            block: false,
        });
        cache.learn("k", cache.generation(), 0, denied);
        assert!(cached(&cache, "k", 10).is_some());
        let in_flight = cache.generation();
        cache.forget("k");
        assert_eq!(cached(&cache, "k", 10), None);
        cache.learn("k", in_flight, 0, denied);
        assert_eq!(
            cached(&cache, "k", 10),
            None,
            "a stale reply is not learned"
        );

        cache.learn("k", cache.generation(), 0, denied);
        let in_flight = cache.generation();
        cache.reconfigure(CachePolicy::new(Algorithm::FixedWindow, quota(20, 20)), 5);
        assert_eq!(cached(&cache, "k", 10), None);
        cache.learn("k", in_flight, 0, denied);
        assert_eq!(cached(&cache, "k", 10), None);

        cache.learn("k", cache.generation(), 0, denied);
        cache.learn("k", cache.generation(), 5, Lesson::Admissible);
        assert_eq!(cached(&cache, "k", 10), None, "an admission clears");
    }

    #[test]
    fn an_expired_deny_lets_one_request_call_and_the_others_wait_for_it() {
        let cache = DenyCache::new(CachePolicy::new(Algorithm::FixedWindow, quota(1, 1)), 64);
        let g = cache.generation();
        assert!(
            matches!(cache.lookup("k", 0, true), Lookup::Miss),
            "no entry"
        );
        cache.learn("k", g, 0, denied(100));
        assert!(matches!(cache.lookup("k", 50, true), Lookup::Hit(_)));
        let Lookup::Call(call) = cache.lookup("k", 100, true) else {
            panic!("the first after expiry calls");
        };
        let Lookup::Wait(shared) = cache.lookup("k", 100, true) else {
            panic!("the second waits");
        };
        let done = shared.done();
        tokio::pin!(done);
        done.as_mut().enable();
        assert!(shared.calling());
        // The call teaches a new deny, then ends: the waiter wakes and is denied locally.
        cache.learn("k", g, 100, denied(200));
        drop(call);
        assert!(!shared.calling());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            std::future::Future::poll(done.as_mut(), &mut cx).is_ready(),
            "woken"
        );
        assert!(matches!(cache.lookup("k", 100, true), Lookup::Hit(_)));
        // A reply showing room clears the entry: nobody is held back then.
        cache.learn("k", g, 200, Lesson::Admissible);
        assert!(matches!(cache.lookup("k", 200, true), Lookup::Miss));
        assert!(matches!(cache.lookup("k", 200, true), Lookup::Miss));
    }

    /// `d` with its durations truncated to whole µs: the scripts' unit (the in-memory
    /// sliding window keeps a fraction of a µs that the scripts do not).
    fn whole_us(d: Decision) -> Decision {
        let us = |ns: u64| ns / 1_000 * 1_000;
        if d.is_allowed() {
            Decision::allow(d.limit(), d.remaining(), us(d.reset_after_ns()))
        } else {
            Decision::deny(
                d.limit(),
                d.remaining(),
                us(d.reset_after_ns()),
                us(d.retry_after_ns()),
            )
        }
    }

    /// The deterministic simulation: the in-memory engine (whose decisions equal the
    /// scripts', as `tests/redis_tier/redis.rs` shows) stands in for Redis, shared by 1, 2 or 16
    /// nodes, each with a deny cache that learns from its own replies as `RedisLimiter`
    /// does. A request the cache does not answer is decided by "Redis"; one it answers is
    /// compared, field by field, with what Redis would decide for it at that instant (its
    /// `peek`: a deny writes nothing, so a check would decide the same). Over thousands of
    /// generated timelines — floods, idle gaps, costs up to the capacity, resets (which
    /// every node hears) and quota changes, at 1/s to 100,000/s — no cached decision
    /// differs.
    #[test]
    fn over_thousands_of_timelines_the_cache_never_changes_a_decision() {
        use proptest::prelude::*;

        use crate::clock::ManualClock;
        use crate::limiter::RateLimiter;

        #[derive(Clone, Debug)]
        enum Op {
            Check {
                node: u8,
                key: u8,
                advance_us: u64,
                cost_pick: u8,
            },
            Reset(u8, u8),
            Requota {
                limit: u64,
                burst: u64,
            },
        }
        let op = prop_oneof![
            30 => (any::<u8>(), 0..3u8, 0..10u8, any::<u64>(), 0..8u8).prop_map(
                |(node, key, kind, r, cost_pick)| {
                    // Mostly floods (no time passing), sometimes steps of up to 20 ms,
                    // and gaps of up to 2 s.
                    let advance_us = match kind {
                        0..=7 => 0,
                        8 => r % 20_000,
                        _ => r % 2_000_000,
                    };
                    Op::Check { node, key, advance_us, cost_pick }
                }
            ),
            1 => (any::<u8>(), 0..3u8).prop_map(|(node, key)| Op::Reset(node, key)),
            1 => (1..12u64, 1..8u64).prop_map(|(limit, burst)| Op::Requota { limit, burst }),
        ];
        let case = (
            0..3usize,
            prop_oneof![2 => Just(1usize), 1 => Just(2), 1 => Just(16)],
            1..12u64,
            // µs per unit: 100,000/s down to 1/s.
            prop::sample::select(vec![10u64, 1_000, 10_000, 100_000, 1_000_000]),
            1..8u64,
            proptest::collection::vec(op, 1..200),
        );
        let config = ProptestConfig {
            cases: 3_000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(15),
            failure_persistence: None,
            ..ProptestConfig::default()
        };
        let algorithms = [
            Algorithm::TokenBucket,
            Algorithm::SlidingWindow,
            Algorithm::FixedWindow,
        ];
        let hits = std::cell::Cell::new(0u64);
        let checks = std::cell::Cell::new(0u64);
        let mut runner = proptest::test_runner::TestRunner::new(config);
        runner
            .run(&case, |(a, nodes, limit, unit_us, burst, ops)| {
                let algorithm = algorithms[a];
                // Whole µs per unit: every instant and interval is whole µs, as in the
                // scripts.
                let make = |limit: u64, burst: u64| {
                    let q = Quota::new(limit, Duration::from_micros(unit_us * limit)).unwrap();
                    match algorithm {
                        Algorithm::TokenBucket => q.with_burst(burst).unwrap(),
                        _ => q,
                    }
                };
                let mut q = make(limit, burst);
                let clock = ManualClock::new();
                clock.advance(Duration::from_secs(1_000));
                let redis = RateLimiter::<String>::builder(q)
                    .algorithm(algorithm)
                    .clock(clock.clone())
                    .build()
                    .unwrap();
                let caches: Vec<DenyCache> = (0..nodes)
                    .map(|_| DenyCache::new(CachePolicy::new(algorithm, q), 16))
                    .collect();
                let tau = |q: Quota| match algorithm {
                    Algorithm::TokenBucket => {
                        (q.emission_interval().as_nanos() as u64 / 1_000) * (q.burst() - 1)
                    }
                    _ => 0,
                };
                for (step, op) in ops.into_iter().enumerate() {
                    let now_us = clock.now_ns() / 1_000;
                    match op {
                        Op::Reset(node, key) => {
                            let key = key.to_string();
                            redis.reset(&key);
                            // The resetting node forgets the key; the others hear the
                            // reset message and forget everything.
                            for (i, cache) in caches.iter().enumerate() {
                                if i == usize::from(node) % nodes {
                                    cache.forget(&key);
                                } else {
                                    cache.clear(now_us);
                                }
                            }
                        }
                        Op::Requota { limit, burst } => {
                            q = make(limit, burst);
                            redis.set_default_quota(q).unwrap();
                            for cache in &caches {
                                cache.reconfigure(CachePolicy::new(algorithm, q), now_us);
                            }
                        }
                        Op::Check {
                            node,
                            key,
                            advance_us,
                            cost_pick,
                        } => {
                            clock.advance(Duration::from_micros(advance_us));
                            let now_us = clock.now_ns() / 1_000;
                            let cache = &caches[usize::from(node) % nodes];
                            let key = key.to_string();
                            let capacity = CachePolicy::new(algorithm, q).capacity();
                            let cost = match cost_pick {
                                0 => 0,
                                1 => capacity,
                                2 => 1 + u64::from(cost_pick) % capacity,
                                _ => 1,
                            };
                            checks.set(checks.get() + 1);
                            // As `RedisLimiter::check_n`: only unit requests ask the cache.
                            let looked = (cost == 1).then(|| cache.lookup(&key, now_us, true));
                            match looked {
                                Some(Lookup::Hit(hit)) => {
                                    hits.set(hits.get() + 1);
                                    let redis_would = redis.peek(&key);
                                    prop_assert_eq!(
                                        whole_us(hit),
                                        whole_us(redis_would),
                                        "step {} {} {} on {} nodes: node {} key {}",
                                        step,
                                        algorithm,
                                        q,
                                        nodes,
                                        node,
                                        key
                                    );
                                }
                                Some(Lookup::Wait(_)) => panic!("no call is under way"),
                                _ => {
                                    let generation = cache.generation();
                                    let d = redis.check_n(&key, cost).unwrap();
                                    let l = lesson(algorithm, tau(q), cost, now_us, &d);
                                    cache.learn(&key, generation, now_us, l);
                                }
                            }
                        }
                    }
                }
                Ok(())
            })
            .unwrap();
        eprintln!(
            "{} checks, {} answered by a cache",
            checks.get(),
            hits.get()
        );
        // The timelines exercise the cache, not only the calls around it.
        assert!(
            hits.get() * 10 > checks.get(),
            "{} of {}",
            hits.get(),
            checks.get()
        );
    }

    #[test]
    fn expired_entries_are_swept_as_new_ones_come() {
        // 1/min: the sweep waits one period (60 s) past an entry's expiry.
        let cache = DenyCache::new(
            CachePolicy::new(Algorithm::FixedWindow, quota(1, 1)),
            100_000,
        );
        for i in 0..100u64 {
            cache.learn(&format!("old{i}"), cache.generation(), 0, denied(1_000_000));
        }
        assert_eq!(cache.len(), 100);
        // Two minutes later, new entries fill the shards' tables: each full table drops
        // the entries untouched since its previous fill (and for a period), so by a
        // shard's second fill its expired entries are gone, and the live ones all stay.
        let later = 120_000_000;
        for i in 0..3_000u64 {
            cache.learn(
                &format!("new{i}"),
                cache.generation(),
                later,
                denied(later + 1),
            );
        }
        assert_eq!(
            cache.len(),
            3_000,
            "the expired entries went as the new came"
        );
    }

    #[test]
    fn memory_stays_bounded_under_a_key_flood() {
        let cache = DenyCache::new(CachePolicy::new(Algorithm::FixedWindow, quota(1, 1)), 256);
        for i in 0..100_000u64 {
            cache.learn(
                &format!("k{i}"),
                cache.generation(),
                i,
                denied(i + 1_000_000),
            );
            assert!(cache.len() <= 256);
        }
        // The newest key was kept.
        assert!(cached(&cache, "k99999", 100_000).is_some());
    }
}
