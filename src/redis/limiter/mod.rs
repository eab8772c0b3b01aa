//! `RedisLimiter`: one atomic script call per check, against state shared by every node.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::RwLock;

use super::RedisError;
use super::scripts;
use crate::algorithm::{Algorithm, Settle};
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;
use crate::redis::breaker::{Breaker, BreakerState, CircuitBreaker, Gate, Probe};
use crate::redis::connection::{Link, Target, eval};
use crate::redis::deny_cache::{CachePolicy, DenyCache, Lesson, Lookup, Until, lesson};
use crate::redis::fallback::{FailMode, Fallbacks, LocalClock};
use crate::redis::keys::{KeyHasher, write_key};
use crate::redis::options::RedisOptions;
use crate::redis::script_quota::{ScriptQuota, ScriptTime, capacity_of, short_name};

mod boxed;
mod builder;
mod call;
mod plans;
pub(crate) mod reply;

use boxed::BoxSettings;
pub use builder::RedisBuilder;
use reply::*;

/// The default timeout of a call to Redis.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// The key the breaker's background probe calls the script on, with a cost of 0 (which
/// writes nothing).
const PROBE_KEY: &str = "tollgate:breaker-probe";

/// While the breaker of the limiter behind `weak` is open, probes Redis once per period
/// until a probe closes it, or the limiter is dropped; and at once when its connection
/// was rebuilt since the last probe (a cluster's or Sentinel's new primary found),
/// rather than at the end of the period.
async fn probe_while_open(weak: std::sync::Weak<Inner>) {
    // The connection's generation when the last probe began.
    let mut probed = None;
    loop {
        let (due, link) = {
            let Some(inner) = weak.upgrade() else { return };
            let due = inner.breaker.next_probe(inner.monotonic.now_ns());
            (due, Arc::clone(&inner.connection))
        };
        match due {
            Probe::Closed => return,
            Probe::Wait(ns) => {
                let rebuilt = probed.is_some_and(|g| g != link.generation());
                if !rebuilt {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_nanos(ns)) => continue,
                        () = link.rebuilt() => {}
                    }
                }
                // Once per rebuilt connection, whatever the breaker does with it.
                probed = Some(link.generation());
                let Some(inner) = weak.upgrade() else { return };
                inner.breaker.probe_soon(inner.monotonic.now_ns());
            }
            Probe::Now => {
                probed = Some(link.generation());
                let Some(inner) = weak.upgrade() else { return };
                RedisLimiter { inner }.probe().await;
            }
        }
    }
}

/// The default bound on the keys the deny cache holds.
pub const DEFAULT_DENY_CACHE_KEYS: usize = 100_000;

/// An exact, global rate limiter whose state lives in Redis: every check runs one atomic
/// Lua script (`EVALSHA`, reloaded by itself after a `SCRIPT FLUSH`, a restart or a
/// failover).
///
/// **When to use it.** Every check is a network round trip (tens of microseconds on
/// loopback, about 50 µs on a LAN), and every node sees exactly one limit. Use it where a
/// limit must hold exactly across nodes and that cost is acceptable — logins, payments,
/// expensive endpoints. For per-request limiting at nanosecond cost with a global limit
/// approximated (or, with leases, never exceeded) use the local [`RateLimiter`] with
/// background sync.
///
/// **The local first tier.** Three things keep Redis traffic and outage cost down:
/// - *A deny cache* (on by default, [`RedisBuilder::local_deny_cache`]). After Redis
///   denies a unit request for a key until some instant — or admits one leaving nothing
///   for the next (token bucket and fixed window) — the next unit requests for that key
///   are denied in process until that instant, in well under a microsecond. Denies
///   write nothing and admissions only push that instant later, so the cached decision
///   is Redis's own (exactly so with [`caller_clock`](RedisBuilder::caller_clock); with
///   the server's clock the cache starts counting when the call was sent, so it may
///   stop a round trip early, never late). Admissions always go to Redis, so the global
///   limit holds exactly however many nodes cache. [`reset`](Self::reset) and
///   [`set_default_quota`](Self::set_default_quota) empty this limiter's entries, and a reset on any
///   node empties every node's cache (each limiter with the cache subscribes to its
///   prefix's reset channel, on a connection of its own). When that subscription's
///   connection breaks and comes back, the cache is emptied too: Redis may have
///   restarted without its data. (A failover to a replica that lags, with the
///   subscription on another node, is not seen: the cache may then deny, until its
///   instants, what the new master would admit — never the reverse.)
/// - *A circuit breaker* ([`RedisBuilder::circuit_breaker`]). After 3 consecutive
///   failures within 1 s (by default), checks fail at once with
///   [`RedisError::CircuitOpen`] while a background task probes Redis, once after 250 ms
///   and then every 500 ms while Redis stays down, and at once when the connection finds
///   a new primary (no check ever waits for a probe); the first probe Redis answers
///   closes the breaker.
/// - *Fail modes* ([`check_or`](Self::check_or)): when Redis fails or the breaker is
///   open, admit ([`FailMode::Open`]), deny ([`FailMode::Closed`]) or limit in process
///   by an insurance quota ([`FailMode::Local`]).
///
/// [`stats`](Self::stats) (and the metrics) count calls, cached denies, short circuits
/// and fail-mode decisions, and show the breaker's state.
///
/// **Failures.** Every error is typed ([`RedisError`]) and arrives at once while the
/// breaker is open, else within the timeout: **the timeout is a deadline from the moment
/// `check` is called**, across waiting for another request's call on the same key (the
/// deny cache), reconnection, retries and redirections.
///
/// The scripts keep integer state (microseconds and counts, never floats), write nothing
/// on a deny, give every key they write a TTL of exactly the time until it is untouched
/// again, and validate their arguments themselves.
///
/// **Redis Cluster.** [`cluster_builder`](Self::cluster_builder) takes seed nodes; every
/// key's state lives in its own slot, calls go to the master that owns it, and the
/// connection follows slot moves and failovers without a restart (a check meanwhile fails
/// within its timeout).
///
/// **Redis Sentinel.** [`sentinel_builder`](Self::sentinel_builder) takes the sentinels
/// and the master name; calls go to the primary they name, and after a failover the
/// limiter asks them again and carries on without a restart (a check meanwhile fails
/// within its timeout).
///
/// Clones are cheap and share the connection. `Debug` shows the URLs with their
/// passwords replaced by `***`.
///
/// [`RateLimiter`]: crate::RateLimiter
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::redis::{FailMode, RedisLimiter};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = RedisLimiter::builder("redis://127.0.0.1:6379/", "100/s burst 200".parse()?)
///     .prefix("api")
///     .timeout(Duration::from_millis(50))
///     .build()
///     .await?;
/// let exact = limiter.check("user_1024").await?; // Err(RedisError) if Redis fails
/// let answered = limiter.check_or("user_1024", FailMode::Closed).await; // never an error
/// println!("{} {}", exact.is_allowed(), answered.is_allowed());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Arc<Link>,
    script: redis::Script,
    source: &'static str,
    /// The token bucket's settlement script (`charge`, `refund`), sent on first use.
    settle: redis::Script,
    target: Target,
    hasher: Option<KeyHasher>,
    /// The quota, replaced by `set_default_quota`.
    current: RwLock<Current>,
    /// The further quotas ([`RedisBuilder::also`]), fixed at build.
    also: Box<[Also]>,
    /// `<prefix>:<algorithm>:`, the first quota's keys' start.
    prefix: String,
    timeout: Duration,
    /// The caller's clock, whose time the scripts take instead of the server's.
    clock: Option<Arc<dyn Clock>>,
    /// The deny cache's and the fallbacks' time: the caller's clock, or a monotonic one.
    local_clock: LocalClock,
    /// The breaker's time: always real.
    monotonic: MonotonicClock,
    algorithm: Algorithm,
    name: Arc<str>,
    cache: Option<DenyCache>,
    /// The plans and each key's plan ([`RedisBuilder::plan`]), if any.
    plans: Option<plans::PlanTable>,
    /// The penalty box, when checks read it ([`RedisBuilder::block_for`],
    /// [`RedisBuilder::penalty_box`]).
    penalty: Option<BoxSettings>,
    breaker: Breaker,
    fallbacks: Fallbacks,
    /// Whether the last check failed (for logging the start and end of an outage once).
    failing: AtomicBool,
    calls: AtomicU64,
    errors: AtomicU64,
    fail_mode_decisions: AtomicU64,
    /// The live limiters sharing the prefix and algorithm, this one included, as last
    /// counted ([`FailMode::LocalShare`]).
    nodes: AtomicU64,
    /// Dropped with the limiter, it stops the reset listener.
    _listening: tokio::sync::watch::Sender<()>,
}

impl Inner {
    /// Now, in µs of the local clock: the deny cache's time, and the scripts' with
    /// `caller_clock`.
    fn now_us(&self) -> u64 {
        self.local_clock.now_ns() / 1_000
    }

    /// The time calendar quotas' bounds are computed for: the local clock's wall time,
    /// in the script's time (the caller clock's, or the server's Unix `TIME`).
    fn script_time(&self) -> ScriptTime {
        let origin = self.local_clock.unix_origin_ns();
        ScriptTime {
            wall_ns: origin.saturating_add(self.local_clock.now_ns()),
            base_ns: if self.clock.is_some() { origin } else { 0 },
        }
    }
}

/// The quota in force and its script arguments.
#[derive(Clone, Copy, Debug)]
struct Current {
    rule: ScriptQuota,
    quota: Quota,
}

/// What a call of the check script does: a check of a cost, or (the window counters) a
/// refund, which the token bucket makes with a script of its own.
#[derive(Clone, Copy, Debug)]
enum Op {
    Check(u64),
    Refund(u64),
}

/// What a check script answered: the decision, and the µs to the end of the key's
/// block when the penalty box denied it.
#[derive(Clone, Copy, Debug)]
struct Answer {
    decision: Decision,
    block_us: Option<u64>,
}

/// A further quota ([`RedisBuilder::also`]): its script arguments, and its keys' start,
/// `<prefix>:<algorithm>+<i>:`.
#[derive(Debug)]
struct Also {
    quota: Quota,
    rule: ScriptQuota,
    prefix: String,
}

/// Counters of a [`RedisLimiter`], from [`RedisLimiter::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStats {
    /// Script calls sent to Redis.
    pub calls: u64,
    /// Checks answered by the local deny cache, with no call.
    pub cached_denies: u64,
    /// Entries the deny cache holds now (expired and emptied ones until the store's
    /// sweep or eviction drops them).
    pub cached_keys: usize,
    /// Calls that failed (any [`RedisError`] after the call was sent).
    pub errors: u64,
    /// Checks that did not call Redis because the circuit breaker was open.
    pub short_circuited: u64,
    /// Decisions made by a [`FailMode`] (Redis failed or the breaker was open).
    pub fail_mode_decisions: u64,
    /// The circuit breaker's state now.
    pub breaker: BreakerState,
    /// Times the circuit breaker opened.
    pub breaker_opened: u64,
    /// The live limiters sharing this one's prefix and algorithm, itself included, as
    /// last counted while Redis answered: the `N` of [`FailMode::LocalShare`].
    pub nodes: u64,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &*self.inner;
        f.debug_struct("RedisLimiter")
            .field("redis", &inner.target)
            .field("hash_keys", &inner.hasher.is_some())
            .field("quota", &inner.current.read().quota)
            .field("algorithm", &inner.algorithm)
            .field("prefix", &inner.prefix)
            .field("timeout", &inner.timeout)
            .field("name", &inner.name)
            .field("local_deny_cache", &inner.cache.is_some())
            .field("breaker", &inner.breaker.state())
            .finish_non_exhaustive()
    }
}

impl RedisLimiter {
    /// A builder for a limiter on the Redis server at `url` (for example
    /// `redis://127.0.0.1:6379/`), enforcing `quota`.
    pub fn builder(url: &str, quota: Quota) -> RedisBuilder {
        Self::builder_with(RedisOptions::new(url), quota)
    }

    /// A builder for a limiter on the Redis Cluster reached through the seed `nodes`
    /// (for example `["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]`; one live
    /// seed is enough), enforcing `quota`. Credentials are taken from the first URL.
    pub fn cluster_builder(nodes: &[&str], quota: Quota) -> RedisBuilder {
        Self::builder_with(RedisOptions::cluster(nodes), quota)
    }

    /// A builder for a limiter on the primary that Redis Sentinel names `master_name`,
    /// found through the `sentinels` (`host:port`, or URLs that carry the sentinels'
    /// password), enforcing `quota`. The data nodes' password is set with
    /// [`master_password`](RedisBuilder::master_password). After a failover the limiter
    /// finds the new primary by itself, as [`RedisOptions::sentinel`] describes; the
    /// [Redis guide](crate::guide::redis) gives the bound across one.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::redis::RedisLimiter;
    /// use tollgate::Quota;
    ///
    /// # async fn run() -> Result<(), tollgate::redis::RedisError> {
    /// let limiter = RedisLimiter::sentinel_builder(
    ///     &["10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"],
    ///     "mymaster",
    ///     Quota::per_second(100).unwrap(),
    /// )
    /// .master_password("data-node-secret")
    /// .timeout(Duration::from_millis(100))
    /// .build()
    /// .await?;
    /// assert!(limiter.check("user:42").await?.is_allowed());
    /// # Ok(())
    /// # }
    /// ```
    pub fn sentinel_builder(sentinels: &[&str], master_name: &str, quota: Quota) -> RedisBuilder {
        Self::builder_with(RedisOptions::sentinel(sentinels, master_name), quota)
    }

    /// A builder for a limiter on the Redis that `options` reach, with their prefix,
    /// timeout (50 ms unless set), TLS roots and key hashing, enforcing `quota`.
    pub fn builder_with(options: RedisOptions, quota: Quota) -> RedisBuilder {
        RedisBuilder {
            options,
            quota,
            algorithm: Algorithm::TokenBucket,
            clock: None,
            name: Arc::from("default"),
            deny_cache: true,
            deny_cache_keys: DEFAULT_DENY_CACHE_KEYS,
            breaker: CircuitBreaker::default(),
            also: Vec::new(),
            block_for: None,
            block_after: None,
            penalty_box: false,
            default_plan: None,
            plans: Vec::new(),
            plan_resolver: None,
            keep_plan_answers: None,
        }
    }

    /// The limiter's name ([`RedisBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The quota every key is limited by (the first, for a limiter with
    /// [`also`](RedisBuilder::also) quotas).
    pub fn quota(&self) -> Quota {
        self.inner.current.read().quota
    }

    /// Every quota a key is held to: the limiter's own, then each
    /// [`also`](RedisBuilder::also) quota, in the order of [`Decision::policy`].
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = RedisLimiter::builder("redis://127.0.0.1/", "10/s".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build()
    ///     .await?;
    /// let denied = limiter.check("tenant-a").await?;
    /// println!("held to {}", limiter.quotas()[denied.policy()]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn quotas(&self) -> Vec<Quota> {
        let first = self.quota();
        std::iter::once(first)
            .chain(self.inner.also.iter().map(|a| a.quota))
            .collect()
    }

    /// The most one request can cost: the quota's burst for the token bucket, its
    /// limit for the windows (the smallest of all quotas, with
    /// [`also`](RedisBuilder::also)).
    pub fn capacity(&self) -> u64 {
        let algorithm = self.inner.algorithm;
        self.inner
            .also
            .iter()
            .map(|a| capacity_of(algorithm, a.quota))
            .fold(capacity_of(algorithm, self.quota()), u64::min)
    }

    /// The first quota's capacity (the `RateLimit-Policy` of policy 0).
    #[cfg(feature = "tower")]
    pub(crate) fn quota_capacity(&self) -> u64 {
        capacity_of(self.inner.algorithm, self.quota())
    }

    /// The `also` quotas, each with its capacity.
    #[cfg(feature = "tower")]
    pub(crate) fn also_policies(&self) -> Vec<(Quota, u64)> {
        let algorithm = self.inner.algorithm;
        self.inner
            .also
            .iter()
            .map(|a| (a.quota, capacity_of(algorithm, a.quota)))
            .collect()
    }

    /// The algorithm the script runs.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The Redis key that holds `key`'s state: `<prefix>:<algorithm>:{<key>}` (or, with
    /// [`hash_keys`](RedisBuilder::hash_keys), `{h:<digest>}`), one hash slot per key in
    /// Redis Cluster. In the key, `}` is written `%7D` and `%` is written `%25`, so
    /// that the hash tag is always the whole key (a `}` would end it early and put
    /// `x}1`, `x}2`, … in one slot). The name is passed as a binary-safe script key,
    /// never spliced into a command, so any bytes round-trip.
    pub fn redis_key(&self, key: &str) -> Vec<u8> {
        self.state_key(&self.inner.prefix, key)
    }

    /// The Redis keys that hold `key`'s state under each quota, in the order of
    /// [`quotas`](Self::quotas): [`redis_key`](Self::redis_key) first, then
    /// `<prefix>:<algorithm>+<i>:{<key>}` for the `i`-th
    /// [`also`](RedisBuilder::also) quota. All carry the same hash tag, so they share a
    /// slot on Redis Cluster.
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = RedisLimiter::builder("redis://127.0.0.1/", "10/s".parse()?)
    ///     .prefix("api")
    ///     .also("1000/day".parse()?)
    ///     .build()
    ///     .await?;
    /// assert_eq!(
    ///     limiter.redis_keys("alice"),
    ///     [b"api:tb:{alice}".to_vec(), b"api:tb+1:{alice}".to_vec()]
    /// );
    /// # Ok(())
    /// # }
    /// ```
    pub fn redis_keys(&self, key: &str) -> Vec<Vec<u8>> {
        std::iter::once(self.redis_key(key))
            .chain(
                self.inner
                    .also
                    .iter()
                    .map(|a| self.state_key(&a.prefix, key)),
            )
            .collect()
    }

    /// The Redis key of `key`'s penalty box, `<prefix>:<algorithm>:box:{<key>}` (same
    /// hash tag as its state), when checks read the box ([`RedisBuilder::block_for`],
    /// [`RedisBuilder::penalty_box`]).
    pub fn penalty_box_key(&self, key: &str) -> Option<Vec<u8>> {
        let settings = self.inner.penalty.as_ref()?;
        Some(self.state_key(&settings.prefix, key))
    }

    /// `<prefix>{<key>}`, the key written as [`redis_key`](Self::redis_key) says.
    fn state_key(&self, prefix: &str, key: &str) -> Vec<u8> {
        let mut k = Vec::with_capacity(prefix.len() + key.len().max(34) + 2);
        k.extend_from_slice(prefix.as_bytes());
        k.push(b'{');
        write_key(self.inner.hasher.as_ref(), key.as_bytes(), &mut k);
        k.push(b'}');
        k
    }

    /// Checks one request for `key`.
    ///
    /// # Errors
    /// [`RedisError::Timeout`], [`RedisError::Unavailable`], [`RedisError::WrongType`]
    /// and the other [`RedisError`]s; nothing is consumed when an error is returned
    /// before the script ran.
    pub async fn check(&self, key: &str) -> Result<Decision, RedisError> {
        self.check_n(key, 1).await
    }

    /// Checks a request of cost `n` for `key`: all `n` units or none. A cost of 0 reports
    /// the state without consuming.
    ///
    /// A unit request that Redis denied until a later instant is denied from the local
    /// deny cache, with no call (see [`RedisBuilder::local_deny_cache`]); while the
    /// circuit breaker is open, no call is made either.
    ///
    /// # Errors
    /// [`RedisError::InsufficientCapacity`] (before any I/O, nothing written) when `n`
    /// exceeds the burst (token bucket) or the limit (windows);
    /// [`RedisError::CircuitOpen`] at once while the breaker is open; otherwise as
    /// [`check`](Self::check).
    pub async fn check_n(&self, key: &str, n: u64) -> Result<Decision, RedisError> {
        let plan = self.plan_index(key);
        self.check_planned(key, n, plan).await
    }

    /// [`check_n`](Self::check_n) under the quotas of plan `plan`.
    async fn check_planned(&self, key: &str, n: u64, plan: u32) -> Result<Decision, RedisError> {
        let inner = &*self.inner;
        // One deadline for the whole check: waiting for another request's call, the
        // call, its reconnection and retries all come out of it.
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let mut now_us = inner.now_us();
        // The caller for a key whose cached deny expired, if this request is it.
        let mut _call_guard = None;
        // A unit request always fits the quota: the cache answers before anything else.
        if let (1, Some(cache)) = (n, &inner.cache) {
            // The deadline was set just now: only a look after a wait reads the clock.
            let mut coalesce = true;
            loop {
                match cache.lookup(key, now_us, coalesce) {
                    Lookup::Hit(hit) => return Ok(hit),
                    Lookup::Miss => break,
                    Lookup::Call(guard) => {
                        _call_guard = Some(guard);
                        break;
                    }
                    // With the breaker open, the call under way fails or is a check that
                    // got through just before: answer now (the gate below rejects) rather
                    // than queue behind it.
                    Lookup::Wait(_) if inner.breaker.is_open() => break,
                    Lookup::Wait(shared) => {
                        let done = shared.done();
                        tokio::pin!(done);
                        done.as_mut().enable();
                        if shared.calling() {
                            // The call is bounded by its own deadline, and its guard wakes
                            // us even if it is abandoned; ours bounds us anyway.
                            let _ = tokio::time::timeout_at(deadline, done).await;
                        }
                        now_us = inner.now_us();
                        coalesce = tokio::time::Instant::now() < deadline;
                    }
                }
            }
        }
        let (current, also) = self.rules(plan);
        // The first quota, in order, that can never admit the cost (as in process).
        let too_small = std::iter::once(current.quota)
            .chain(also.iter().map(|a| a.quota))
            .map(|quota| capacity_of(inner.algorithm, quota))
            .find(|&capacity| n > capacity);
        if let Some(capacity) = too_small {
            return Err(InsufficientCapacity {
                requested: n,
                capacity,
            }
            .into());
        }
        // A block denies every cost: the cache answers the others' too, with no call.
        if let (true, Some(cache)) = (n > 1 && inner.penalty.is_some(), &inner.cache) {
            if let Some(hit) = cache.blocked(key, now_us) {
                return Ok(hit);
            }
        }
        self.through_breaker()?;
        let generation = inner.cache.as_ref().map(DenyCache::generation);
        inner.calls.fetch_add(1, Ordering::Relaxed);
        let script_now = inner.clock.as_ref().map(|_| now_us);
        let decided = self
            .call(key, Op::Check(n), current.rule, also, script_now, deadline)
            .await;
        match &decided {
            Ok(answer) => {
                self.answered();
                if let (Some(cache), Some(generation)) = (&inner.cache, generation) {
                    let lesson = self.lesson((current.rule, also), n, now_us, answer);
                    cache.learn(key, generation, now_us, lesson);
                }
            }
            Err(e) => self.failed(e, false),
        }
        decided.map(|answer| answer.decision)
    }

    /// What the deny cache learns from `answer`, a reply to a request of cost `n` sent
    /// at `now_us` under `rule` and `also`: a block, for every cost until its end;
    /// otherwise the unit request's lesson, but for a deny while denies count toward a
    /// block (each must reach Redis to be counted: a block, once it starts, is cached).
    fn lesson(
        &self,
        (rule, also): (ScriptQuota, &[Also]),
        n: u64,
        now_us: u64,
        answer: &Answer,
    ) -> Lesson {
        let inner = &*self.inner;
        let decision = &answer.decision;
        if let Some(us) = answer.block_us {
            let end = now_us.saturating_add(us);
            return Lesson::Denied(Until {
                retry_at: end,
                reset_at: end,
                limit: decision.limit(),
                policy: decision.policy(),
                block: true,
            });
        }
        // The tau of the quota the decision describes.
        let tau = match decision.policy() {
            0 => rule.tau(),
            i => also.get(i - 1).map_or(0, |a| a.rule.tau()),
        };
        match lesson(inner.algorithm, tau, n, now_us, decision) {
            Lesson::Denied(_) if inner.penalty.as_ref().is_some_and(|p| p.counts_denies) => {
                Lesson::Nothing
            }
            lesson => lesson,
        }
    }

    /// [`check`](Self::check) with a failure policy: when Redis fails or the circuit
    /// breaker is open, `mode` decides — admit ([`FailMode::Open`]), deny
    /// ([`FailMode::Closed`]) or limit in process ([`FailMode::Local`]) — instead of
    /// returning the error, which is counted ([`RedisStats::errors`]) and logged (with
    /// the `tracing` feature), then dropped.
    pub async fn check_or(&self, key: &str, mode: FailMode) -> Decision {
        self.check_reporting(key, mode).await.0
    }

    /// [`check_or`](Self::check_or) that also returns the error `mode` answered for.
    pub(crate) async fn check_reporting(
        &self,
        key: &str,
        mode: FailMode,
    ) -> (Decision, Option<RedisError>) {
        match self.check(key).await {
            Ok(decision) => (decision, None),
            Err(e) => (self.fail_mode_decision(mode, key, 1), Some(e)),
        }
    }

    /// What `mode` decides for a request of cost `n` for `key` when Redis cannot.
    pub(crate) fn fail_mode_decision(&self, mode: FailMode, key: &str, n: u64) -> Decision {
        self.fail_mode_in(mode, key, n, self.plan_index(key))
    }

    /// [`fail_mode_decision`](Self::fail_mode_decision) under the quotas of plan `plan`.
    fn fail_mode_in(&self, mode: FailMode, key: &str, n: u64, plan: u32) -> Decision {
        let inner = &*self.inner;
        inner.fail_mode_decisions.fetch_add(1, Ordering::Relaxed);
        let (current, also) = self.rules(plan);
        let quotas: Vec<Quota> = std::iter::once(current.quota)
            .chain(also.iter().map(|a| a.quota))
            .collect();
        let capacity = quotas
            .iter()
            .map(|&q| capacity_of(inner.algorithm, q))
            .fold(u64::MAX, u64::min);
        let interval = crate::clock::nanos(current.quota.emission_interval());
        inner.fallbacks.decide(
            mode,
            key,
            n,
            &quotas,
            capacity,
            interval,
            inner.nodes.load(Ordering::Relaxed),
        )
    }

    /// Consumes `n` units of `key`'s quota in Redis, **even beyond what is available**,
    /// for costs known only after the fact: one script call, atomic with every node's
    /// checks. The key goes into debt, and every node's checks of it are denied until
    /// the debt is repaid at the quota's rate. Returns the decision a unit request would
    /// get right after (a deny, with its exact wait, while in debt). As
    /// [`RateLimiter::charge`](crate::RateLimiter::charge) on one node: reserve with
    /// [`check_n`](Self::check_n), then settle with `charge` or [`refund`](Self::refund).
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let tokens = RedisLimiter::builder("redis://127.0.0.1/", "10000/min burst 4000".parse()?)
    ///     .build()
    ///     .await?;
    /// let estimate = 1_000;
    /// if tokens.check_n("tenant-a", estimate).await?.is_allowed() {
    ///     let used = 1_700; // known once the response is in
    ///     tokens.charge("tenant-a", used - estimate).await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// With [`also`](RedisBuilder::also) quotas, every quota is charged `n` in the same
    /// script call, and the decision is the tightest of theirs.
    ///
    /// # Errors
    /// [`RedisError::UnsupportedAlgorithm`] for the window counters, whose counts cannot
    /// hold a debt (before any I/O, as in process); [`RedisError::Rejected`] when the
    /// debt would pass 2⁵³ µs on any quota (nothing is written then); otherwise as
    /// [`check`](Self::check). On a timeout the charge may or may not have been applied.
    pub async fn charge(&self, key: &str, n: u64) -> Result<Decision, RedisError> {
        self.settle(key, Settle::Charge(n)).await
    }

    /// Gives back up to `n` units of `key`'s quota in Redis, never beyond a full quota:
    /// one script call, on every algorithm (the window counters lower their current
    /// count first, then the sliding window its previous one, never below zero), and
    /// on every quota with [`also`](RedisBuilder::also). Returns the decision a unit
    /// request would get right after. This
    /// limiter's deny cache forgets the key; when the key may have been denied just
    /// before, every node's deny cache is emptied too (one `PUBLISH`, as
    /// [`reset`](Self::reset) does), so the units given back are usable everywhere at
    /// once.
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let calls = RedisLimiter::builder("redis://127.0.0.1/", "100/min".parse()?)
    ///     .build()
    ///     .await?;
    /// if calls.check("tenant-a").await?.is_allowed() {
    ///     let upstream_failed = true;
    ///     if upstream_failed {
    ///         calls.refund("tenant-a", 1).await?; // a failed call does not count
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`check`](Self::check). On a timeout the refund may or may not have been
    /// applied.
    pub async fn refund(&self, key: &str, n: u64) -> Result<Decision, RedisError> {
        self.settle(key, Settle::Refund(n)).await
    }

    /// One settlement script call: the token bucket's settlement script, or a window
    /// counter's check script in its refund mode.
    async fn settle(&self, key: &str, settle: Settle) -> Result<Decision, RedisError> {
        let inner = &*self.inner;
        let (current, also) = self.rules(self.plan_index(key));
        if let (ScriptQuota::Window { .. } | ScriptQuota::Calendar { .. }, Settle::Charge(_)) =
            (current.rule, settle)
        {
            return Err(RedisError::UnsupportedAlgorithm(inner.algorithm));
        }
        self.through_breaker()?;
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let script_now = inner.clock.as_ref().map(|_| inner.now_us());
        inner.calls.fetch_add(1, Ordering::Relaxed);
        let decided = match (current.rule, settle) {
            (ScriptQuota::TokenBucket { t, tau, .. }, settle) => {
                let rules = (current.rule, also);
                self.settle_bucket(key, settle, rules, (t, tau), script_now, deadline)
                    .await
            }
            (
                ScriptQuota::Window { .. } | ScriptQuota::Calendar { .. },
                Settle::Refund(n) | Settle::Charge(n),
            ) => self
                .call(key, Op::Refund(n), current.rule, also, script_now, deadline)
                .await
                .map(|answer| answer.decision),
        };
        // A cached deny of the key may be wrong now when the settlement may outdate one
        // (as in process, `Settle::may_outdate`), or when it failed and may or may not
        // have been applied. Forgetting empties this node's whole cache, so it is left
        // out after a settlement that leaves no deny of the key possibly live.
        let outdated = decided
            .as_ref()
            .map_or(true, |after| settle.may_outdate(after));
        if let (true, Some(cache)) = (outdated, &inner.cache) {
            cache.forget(key);
        }
        match &decided {
            Ok(_) => {
                self.answered();
                if outdated && inner.cache.is_some() {
                    self.empty_every_cache().await;
                }
            }
            Err(e) => self.failed(e, false),
        }
        decided
    }

    /// The token bucket's settlement script on every quota's key.
    async fn settle_bucket(
        &self,
        key: &str,
        settle: Settle,
        (rule, also): (ScriptQuota, &[Also]),
        (t, tau): (u64, u64),
        script_now: Option<u64>,
        deadline: tokio::time::Instant,
    ) -> Result<Decision, RedisError> {
        let inner = &*self.inner;
        // The request argument: 'c<n>' or 'r<n>' (see token_bucket_settle.lua).
        let request = match settle {
            Settle::Charge(n) => format!("c{n}"),
            Settle::Refund(n) => format!("r{n}"),
        };
        let redis_key = self.redis_key(key);
        let also_keys: Vec<Vec<u8>> = also
            .iter()
            .map(|a| self.state_key(&a.prefix, key))
            .collect();
        let call = |eval: bool| {
            let source = scripts::TOKEN_BUCKET_SETTLE;
            let mut cmd = script_call(eval, source, &inner.settle, &redis_key, &also_keys);
            cmd.arg(t).arg(tau).arg(&request);
            now_and_also(&mut cmd, script_now, true, also, || inner.script_time());
            cmd
        };
        let mut connection = inner.connection.get();
        let replies = if also.is_empty() {
            self.bounded(deadline, &redis_key, eval::<i64>(&mut connection, call))
                .await
                .map(|reset_us| vec![reset_us])
        } else {
            self.bounded(
                deadline,
                &redis_key,
                eval::<Vec<i64>>(&mut connection, call),
            )
            .await
        };
        let rules = std::iter::once(rule).chain(also.iter().map(|a| a.rule));
        replies.and_then(|replies| settled(&replies, rules))
    }

    /// Tells every limiter with the same prefix and algorithm to empty its deny cache
    /// (by `PUBLISH`, as [`reset`](Self::reset) does); a failure is counted and logged,
    /// and the other nodes' cached denies then last until their retry instants.
    async fn empty_every_cache(&self) {
        let inner = &*self.inner;
        let channel = crate::redis::invalidate::channel(&inner.prefix);
        let mut connection = inner.connection.get();
        let publish = crate::redis::invalidate::message(&channel);
        match tokio::time::timeout(inner.timeout, publish.query_async::<i64>(&mut connection)).await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => self.failed(&self.classify(e, channel.as_bytes()), false),
            Err(_) => self.failed(&RedisError::Timeout(inner.timeout), false),
        }
    }

    /// Forgets `key`'s state (under every quota of every plan), in Redis (for every
    /// node) and in this limiter's deny cache, then tells every limiter with the same
    /// prefix and algorithm to empty its deny cache (by `PUBLISH`; the message names no
    /// key): the key's next request starts fresh everywhere, once the message has
    /// arrived (within a round trip). A block in the penalty box stays
    /// ([`unblock`](Self::unblock) ends it), as in process.
    ///
    /// # Errors
    /// As [`check`](Self::check); the local cache forgets the key even then.
    pub async fn reset(&self, key: &str) -> Result<(), RedisError> {
        let inner = &*self.inner;
        if let Some(cache) = &inner.cache {
            cache.forget(key);
        }
        // Every quota's state, under every plan: one `DEL`, as the keys share a hash tag.
        let redis_keys = self.every_state_key(key);
        let redis_key = &redis_keys[0];
        let mut connection = inner.connection.get();
        let channel = crate::redis::invalidate::channel(&inner.prefix);
        let run = async {
            redis::cmd("DEL")
                .arg(&redis_keys)
                .query_async::<i64>(&mut connection)
                .await?;
            // Every node's cache, this one's included, empties on hearing it.
            crate::redis::invalidate::message(&channel)
                .query_async::<i64>(&mut connection)
                .await
        };
        let done = tokio::time::timeout(inner.timeout, run)
            .await
            .map_err(|_| RedisError::Timeout(inner.timeout))
            .and_then(|r| r.map_err(|e| self.classify(e, redis_key)));
        // A reply in flight during the `DEL` may have been learned from meanwhile.
        if let Some(cache) = &inner.cache {
            cache.forget(key);
        }
        done.map(drop)
    }

    /// Limits every key by `quota` from now on (same algorithm), and empties the deny
    /// cache, whose denies the old quota decided. The state in Redis is kept and read
    /// under the new quota: a token bucket's arrival time carries over; a window's
    /// counts carry over when only the limit changes, and a new period starts the
    /// windows afresh. Every node must be given the same quota.
    ///
    /// The name matches [`RateLimiter::set_default_quota`](crate::RateLimiter::set_default_quota),
    /// which changes the quota of every key without one of its own.
    ///
    /// # Errors
    /// [`RedisError::Config`] when the scripts cannot run `quota` (nothing changes).
    pub fn set_default_quota(&self, quota: Quota) -> Result<(), RedisError> {
        let inner = &*self.inner;
        let rule = ScriptQuota::new(inner.algorithm, quota)?;
        *inner.current.write() = Current { rule, quota };
        if let Some(cache) = &inner.cache {
            cache.reconfigure(CachePolicy::new(inner.algorithm, quota), inner.now_us());
        }
        Ok(())
    }

    /// The limiter's counters and its breaker's state (and, with the `metrics` feature,
    /// publishes them).
    pub fn stats(&self) -> RedisStats {
        let inner = &*self.inner;
        let stats = RedisStats {
            calls: inner.calls.load(Ordering::Relaxed),
            cached_denies: inner.cache.as_ref().map_or(0, DenyCache::hits),
            cached_keys: inner.cache.as_ref().map_or(0, DenyCache::len),
            errors: inner.errors.load(Ordering::Relaxed),
            short_circuited: inner.breaker.rejected(),
            fail_mode_decisions: inner.fail_mode_decisions.load(Ordering::Relaxed),
            breaker: inner.breaker.state(),
            breaker_opened: inner.breaker.opened(),
            nodes: inner.nodes.load(Ordering::Relaxed),
        };
        crate::redis::observe::redis_limiter(&inner.name, &stats);
        stats
    }
}
