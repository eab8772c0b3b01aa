//! `RedisLimiter`: one atomic script call per check, against state shared by every node.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::RwLock;

use super::RedisError;
use super::breaker::{Breaker, BreakerState, CircuitBreaker, Gate, Probe};
use super::connection::{Link, Target, eval};
use super::deny_cache::{CachePolicy, DenyCache, Lookup, lesson};
use super::fallback::{FailMode, Fallbacks, LocalClock};
use super::keys::{KeyHasher, write_key};
use super::options::RedisOptions;
use super::script_quota::{ScriptQuota, capacity_of, short_name};
use super::scripts;
use crate::algorithm::{Algorithm, Settle};
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;

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

/// Configures a [`RedisLimiter`]. Made by [`RedisLimiter::builder`] (one server),
/// [`RedisLimiter::cluster_builder`] (Redis Cluster) or
/// [`RedisLimiter::sentinel_builder`] (Redis Sentinel).
#[must_use = "a builder does nothing until .build() is awaited"]
pub struct RedisBuilder {
    options: RedisOptions,
    quota: Quota,
    algorithm: Algorithm,
    clock: Option<Arc<dyn Clock>>,
    name: Arc<str>,
    deny_cache: bool,
    deny_cache_keys: usize,
    breaker: CircuitBreaker,
    also: Vec<Quota>,
}

impl fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("options", &self.options)
            .field("quota", &self.quota)
            .field("also", &self.also)
            .field("algorithm", &self.algorithm)
            .field("caller_clock", &self.clock.is_some())
            .field("name", &self.name)
            .field("local_deny_cache", &self.deny_cache)
            .field("deny_cache_keys", &self.deny_cache_keys)
            .field("circuit_breaker", &self.breaker)
            .finish()
    }
}

impl RedisBuilder {
    /// Names the limiter, for metrics (the `limiter` label) and logs; `"default"`
    /// unless set.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// `TokenBucket` (the default), `SlidingWindow` or `FixedWindow`.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Holds every key to `quota` as well, all or nothing, as
    /// [`Builder::also`](crate::Builder::also) does in process: a check is admitted only
    /// if every quota admits it, and then consumes from each; a denied check consumes
    /// from none. For example `"10/s burst 20"` and `"1000/day"`. Call it again for a
    /// third quota.
    ///
    /// **One round trip.** All the quotas of a key are decided in one script call: each
    /// keeps its state in a Redis key of its own (`<prefix>:<algorithm>+<i>:{<key>}` for
    /// the `i`-th `also` quota, see [`redis_keys`](RedisLimiter::redis_keys)), and all of
    /// them carry the key's hash tag, so on Redis Cluster they share one slot and the
    /// script is atomic there too.
    ///
    /// The [`Decision`] describes the most constraining quota ([`Decision::policy`]
    /// says which): for an admission, the one with the fewest units left; for a deny,
    /// the denying one with the longest wait, with the fewest units left of all. The
    /// decisions are those of the in-process limiter with the same quotas (tests hold
    /// the two to each other on random timelines).
    /// [`set_default_quota`](RedisLimiter::set_default_quota) changes the first quota;
    /// the `also` quotas stay. [`charge`](RedisLimiter::charge) and
    /// [`refund`](RedisLimiter::refund) settle every quota, and
    /// [`FailMode::LocalShare`] shares each.
    ///
    /// A quota's state is found by its place in the list: give every node the quotas
    /// in the same order. Reordering them on a restart reads each state under another
    /// quota, as [`set_default_quota`](RedisLimiter::set_default_quota) does.
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = RedisLimiter::builder("redis://127.0.0.1/", "10/s burst 20".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build()
    ///     .await?;
    /// let decision = limiter.check("tenant-a").await?; // one script call, both quotas
    /// if !decision.is_allowed() {
    ///     let which = ["burst", "daily"][decision.policy()];
    ///     println!("{which} limit: retry in {:?}", decision.retry_after());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn also(mut self, quota: Quota) -> Self {
        self.also.push(quota);
        self
    }

    super::options::option_setters!(
        keys: "<prefix>:<algorithm>:{<key>}",
        timeout: "How long a check may take before it fails with [`RedisError::Timeout`] \
                  (from 1 ms to 1 h; 50 ms by default): a deadline from the moment `check` \
                  is called, waiting for another request's call, reconnection and retries \
                  included. It also bounds the first connection."
    );

    /// Take "now" from the caller's `clock` (truncated to microseconds) instead of the
    /// Redis server's `TIME`. Tests use this with a `ManualClock` for determinism; in
    /// production, the server's clock is the one all nodes agree on. Either way, time
    /// never goes backwards in the stored state: a GCRA state never moves back, and a
    /// window state ahead of the given time is read at its own window's start.
    pub fn caller_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Whether to answer repeated denies in process (on by default): after Redis denies
    /// a unit request for a key, the same request is denied locally, with no round trip,
    /// until the instant Redis said it could pass. The cached decision is the one Redis
    /// would give (denies write nothing, and nothing but a reset or a quota change can
    /// admit sooner), so an abusive client costs about one Redis call per retry
    /// interval instead of one per request. See [`RedisLimiter`] for the details and the
    /// one caveat (resets made by other nodes).
    pub fn local_deny_cache(mut self, on: bool) -> Self {
        self.deny_cache = on;
        self
    }

    /// The most keys the deny cache holds (100,000 by default); expired entries are
    /// swept as new ones come, and when it is full, the entry nearest its expiry makes
    /// room. Each entry keeps a copy of its key. Only denied keys take an entry.
    pub fn deny_cache_max_keys(mut self, max_keys: usize) -> Self {
        self.deny_cache_keys = max_keys;
        self
    }

    /// The circuit breaker ([`CircuitBreaker::default`]: open after 3 consecutive
    /// failures within 1 s); [`CircuitBreaker::disabled`] turns it off.
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = breaker;
        self
    }

    /// Validates the configuration, connects (with automatic reconnection; on a cluster,
    /// to the seed nodes, learning the slot map) and, on one server, loads the script.
    ///
    /// # Errors
    /// [`RedisError::Config`] or [`RedisError::UnsupportedAlgorithm`] for a
    /// configuration the scripts cannot run; [`RedisError::Timeout`] or
    /// [`RedisError::Unavailable`] when Redis cannot be reached within the timeout.
    pub async fn build(self) -> Result<RedisLimiter, RedisError> {
        let rule = ScriptQuota::new(self.algorithm, self.quota)?;
        let short = short_name(self.algorithm);
        let also = (1..)
            .zip(&self.also)
            .map(|(i, &quota)| {
                Ok(Also {
                    quota,
                    rule: ScriptQuota::new(self.algorithm, quota)?,
                    prefix: format!("{}:{short}+{i}:", self.options.prefix),
                })
            })
            .collect::<Result<Box<[Also]>, RedisError>>()?;
        let (client, timeout) =
            self.options
                .validate(DEFAULT_TIMEOUT, |setting, value, expected| {
                    ConfigError::InvalidRedisSetting {
                        setting,
                        value,
                        expected,
                    }
                })?;
        self.breaker.validate()?;
        if self.deny_cache_keys == 0 {
            return Err(ConfigError::InvalidRedisSetting {
                setting: "deny_cache_max_keys",
                value: "0".to_owned(),
                expected: "1 or more",
            }
            .into());
        }
        let source = match self.algorithm {
            Algorithm::TokenBucket => scripts::TOKEN_BUCKET,
            Algorithm::SlidingWindow => scripts::SLIDING_WINDOW,
            _ => scripts::FIXED_WINDOW,
        };
        let script = redis::Script::new(source);
        let connect = async {
            let link = Link::connect(client.clone(), timeout).await?;
            // A cluster's nodes get the script on first use (`EVAL` after `NOSCRIPT`):
            // loading it on every node would make one unreachable replica fail the build.
            if !self.options.target.is_cluster() {
                script.prepare_invoke().load_async(&mut link.get()).await?;
            }
            Ok::<_, redis::RedisError>(link)
        };
        let connection = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| RedisError::Timeout(timeout))?
            .map_err(|e| RedisError::from_redis(e, b""))?;
        let prefix = format!("{}:{short}:", self.options.prefix);
        let local_clock = match &self.clock {
            Some(clock) => LocalClock::Caller(Arc::clone(clock)),
            None => LocalClock::Monotonic(MonotonicClock::new()),
        };
        let cache = self.deny_cache.then(|| {
            DenyCache::new(
                CachePolicy::new(self.algorithm, self.quota),
                self.deny_cache_keys,
            )
        });
        // The listener that empties the cache on resets elsewhere stops with the limiter.
        let (listening, stop) = tokio::sync::watch::channel(());
        // Every limiter subscribes, with a deny cache or not: the subscribers are how
        // the limiters sharing the prefix count each other (`FailMode::LocalShare`).
        let nodes = client.nodes(timeout)?;
        let channel = super::invalidate::channel(&prefix);
        // Subscribed before the first check, so that no reset can go unheard; if that
        // fails, the listener keeps trying (and empties the cache once it succeeds).
        let first = match nodes.current().await.first() {
            Some(client) => super::invalidate::subscribe(client, &channel, timeout).await,
            None => None,
        };
        let fallbacks = Fallbacks::new(self.algorithm, local_clock.clone(), Arc::clone(&self.name));
        let limiter = RedisLimiter {
            inner: Arc::new(Inner {
                connection,
                script,
                source,
                settle: redis::Script::new(scripts::TOKEN_BUCKET_SETTLE),
                target: self.options.target,
                hasher: self.options.hasher,
                current: RwLock::new(Current {
                    rule,
                    quota: self.quota,
                }),
                also,
                prefix,
                timeout,
                clock: self.clock,
                local_clock,
                monotonic: MonotonicClock::new(),
                algorithm: self.algorithm,
                name: self.name,
                cache,
                breaker: Breaker::new(self.breaker),
                fallbacks,
                failing: AtomicBool::new(false),
                calls: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                fail_mode_decisions: AtomicU64::new(0),
                nodes: AtomicU64::new(1),
                _listening: listening,
            }),
        };
        // Counted once now, so that the share is known before the first outage.
        let counted = super::invalidate::count(&nodes, &channel, timeout).await;
        limiter
            .inner
            .nodes
            .store(counted.unwrap_or(1).max(1), Ordering::Relaxed);
        let counting = Arc::downgrade(&limiter.inner);
        super::invalidate::spawn_counting(
            nodes.clone(),
            channel.clone(),
            timeout,
            limiter.inner._listening.subscribe(),
            move |nodes| match counting.upgrade() {
                Some(inner) if !inner.breaker.is_open() => {
                    inner.nodes.store(nodes.max(1), Ordering::Relaxed);
                    true
                }
                Some(_) => true,
                None => false,
            },
        );
        let weak = Arc::downgrade(&limiter.inner);
        super::invalidate::spawn(nodes, channel, timeout, first, stop, move || {
            if let Some(inner) = weak.upgrade() {
                if let Some(cache) = &inner.cache {
                    cache.clear(inner.now_us());
                }
            }
        });
        // Every second, `stats` publishes (inside the runtime that built it).
        #[cfg(feature = "metrics")]
        crate::observe::every_second(Arc::downgrade(&limiter.inner), |inner| {
            RedisLimiter { inner }.stats();
        });
        Ok(limiter)
    }
}

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
        let current = *inner.current.read();
        // The first quota, in order, that can never admit the cost (as in process).
        let too_small = std::iter::once(current.quota)
            .chain(inner.also.iter().map(|a| a.quota))
            .map(|quota| capacity_of(inner.algorithm, quota))
            .find(|&capacity| n > capacity);
        if let Some(capacity) = too_small {
            return Err(InsufficientCapacity {
                requested: n,
                capacity,
            }
            .into());
        }
        if let Gate::Reject(ns) = inner.breaker.gate(|| inner.monotonic.now_ns()) {
            return Err(RedisError::CircuitOpen {
                retry_in: Duration::from_nanos(ns),
            });
        }
        let generation = inner.cache.as_ref().map(DenyCache::generation);
        inner.calls.fetch_add(1, Ordering::Relaxed);
        let script_now = inner.clock.as_ref().map(|_| now_us);
        let decided = self
            .call(
                key,
                Op::Check(n),
                current.rule,
                &inner.also,
                script_now,
                deadline,
            )
            .await;
        match &decided {
            Ok(decision) => {
                self.answered();
                if let (Some(cache), Some(generation)) = (&inner.cache, generation) {
                    // The tau of the quota the decision describes.
                    let tau = match decision.policy() {
                        0 => current.rule.tau(),
                        i => inner.also.get(i - 1).map_or(0, |a| a.rule.tau()),
                    };
                    let lesson = lesson(inner.algorithm, tau, n, now_us, decision);
                    cache.learn(key, generation, now_us, lesson);
                }
            }
            Err(e) => self.failed(e, false),
        }
        decided
    }

    /// Redis answered a call: the breaker closes, and the end of an outage is logged once.
    fn answered(&self) {
        let inner = &*self.inner;
        if inner.breaker.succeeded() {
            super::observe::redis_breaker(&inner.name, BreakerState::Closed);
        }
        self.recovered();
    }

    /// A call (the background probe's, if `probe`) failed with `e`: counted, logged, and
    /// told to the breaker. If that opens it, the background probe starts.
    fn failed(&self, e: &RedisError, probe: bool) {
        let inner = &*self.inner;
        inner.errors.fetch_add(1, Ordering::Relaxed);
        super::observe::redis_error(&inner.name, e);
        let first = !inner.failing.swap(true, Ordering::Relaxed);
        super::observe::redis_health(&inner.name, Some(e), first);
        if !e.is_outage() {
            // Redis answered (with an error about this call): it is up.
            if inner.breaker.succeeded() {
                super::observe::redis_breaker(&inner.name, BreakerState::Closed);
            }
            return;
        }
        if inner.breaker.failed(inner.monotonic.now_ns(), probe) {
            super::observe::redis_breaker(&inner.name, BreakerState::Open);
            tokio::spawn(probe_while_open(Arc::downgrade(&self.inner)));
        }
    }

    /// One probe of an open breaker: a call of cost 0 (it writes nothing) on a key of its
    /// own. A connection that broke while Redis was away may answer its first request at
    /// once with the old error, and reconnect: then the probe tries once more, through
    /// the reconnected connection, within the same deadline.
    async fn probe(&self) {
        let inner = &*self.inner;
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let rule = inner.current.read().rule;
        let script_now = inner.clock.as_ref().map(|_| inner.now_us());
        let call = || {
            inner.calls.fetch_add(1, Ordering::Relaxed);
            self.call(PROBE_KEY, Op::Check(0), rule, &[], script_now, deadline)
        };
        let mut outcome = call().await;
        if matches!(outcome, Err(RedisError::Unavailable(_)))
            && tokio::time::Instant::now() < deadline
        {
            outcome = call().await;
        }
        match &outcome {
            Ok(_) => self.answered(),
            Err(e) => self.failed(e, true),
        }
    }

    /// Logs the end of an outage, once.
    fn recovered(&self) {
        let inner = &*self.inner;
        if inner.failing.load(Ordering::Relaxed) && inner.failing.swap(false, Ordering::Relaxed) {
            super::observe::redis_health(&inner.name, None, true);
        }
    }

    /// One script call for a request of cost `n` under `rule` and the `also` quotas,
    /// with the script's time (µs) or none (the server's `TIME`), failing with
    /// [`RedisError::Timeout`] at `deadline`.
    async fn call(
        &self,
        key: &str,
        op: Op,
        rule: ScriptQuota,
        also: &[Also],
        now_us: Option<u64>,
        deadline: tokio::time::Instant,
    ) -> Result<Decision, RedisError> {
        let inner = &*self.inner;
        let redis_key = self.redis_key(key);
        // Empty, with no allocation, for one quota.
        let also_keys: Vec<Vec<u8>> = also
            .iter()
            .map(|a| self.state_key(&a.prefix, key))
            .collect();
        let call = |eval: bool| {
            let mut cmd = script_call(eval, inner.source, &inner.script, &redis_key, &also_keys);
            let [first, second] = rule.args();
            cmd.arg(first).arg(second);
            match op {
                Op::Check(n) => cmd.arg(n),
                Op::Refund(n) => cmd.arg(format!("r{n}")),
            };
            // The token bucket takes an absent `now`, which is cheapest.
            let absent = matches!(rule, ScriptQuota::TokenBucket { .. });
            now_and_also(&mut cmd, now_us, absent, also);
            cmd
        };
        let mut connection = inner.connection.get();
        let rules = || std::iter::once(rule).chain(also.iter().map(|a| a.rule));
        let run = async {
            match (rule, op) {
                (ScriptQuota::TokenBucket { t, tau, burst }, Op::Check(n)) if also.is_empty() => {
                    eval::<i64>(&mut connection, call)
                        .await
                        .map(|reply| gcra_decision(reply, t, tau, burst, n))
                }
                (_, Op::Check(n)) => eval::<Vec<i64>>(&mut connection, call)
                    .await
                    .map(|replies| all_of(&replies, rules(), n)),
                (_, Op::Refund(_)) => eval::<Vec<i64>>(&mut connection, call)
                    .await
                    .map(|replies| settled(&replies, rules())),
            }
        };
        self.bounded(deadline, &redis_key, run).await?
    }

    /// Runs `call` (a script call about `redis_key`) until `deadline`: one timer bounds
    /// the whole call, reconnection, retries and redirections included. Its error is
    /// classified, and an unavailable server or a timeout marks the connection failed.
    ///
    /// A plain function that maps the timer's future, not an `async fn`: the latter would
    /// hold `call` twice (as its argument and inside the timer), and a check's future,
    /// which moves as a whole, would be half a kilobyte larger.
    fn bounded<'a, T>(
        &'a self,
        deadline: tokio::time::Instant,
        redis_key: &'a [u8],
        call: impl std::future::Future<Output = redis::RedisResult<T>> + 'a,
    ) -> impl std::future::Future<Output = Result<T, RedisError>> + 'a {
        use futures_util::FutureExt as _;
        tokio::time::timeout_at(deadline, call).map(move |outcome| self.timed(outcome, redis_key))
    }

    /// What [`bounded`](Self::bounded) returns for the `outcome` of its timer.
    fn timed<T>(
        &self,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
        redis_key: &[u8],
    ) -> Result<T, RedisError> {
        let inner = &*self.inner;
        match outcome {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                let e = self.classify(e, redis_key);
                if matches!(e, RedisError::Unavailable(_)) {
                    inner.connection.failed();
                }
                Err(e)
            }
            Err(_) => {
                inner.connection.failed();
                Err(RedisError::Timeout(inner.timeout))
            }
        }
    }

    fn classify(&self, e: redis::RedisError, key: &[u8]) -> RedisError {
        if e.is_timeout() {
            RedisError::Timeout(self.inner.timeout)
        } else {
            RedisError::from_redis(e, key)
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
        let inner = &*self.inner;
        inner.fail_mode_decisions.fetch_add(1, Ordering::Relaxed);
        let current = *inner.current.read();
        let interval =
            u64::try_from(current.quota.emission_interval().as_nanos()).unwrap_or(u64::MAX);
        inner.fallbacks.decide(
            mode,
            key,
            n,
            &self.quotas(),
            self.capacity(),
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
        let current = *inner.current.read();
        if let (ScriptQuota::Window { .. }, Settle::Charge(_)) = (current.rule, settle) {
            return Err(RedisError::UnsupportedAlgorithm(inner.algorithm));
        }
        if let Gate::Reject(ns) = inner.breaker.gate(|| inner.monotonic.now_ns()) {
            return Err(RedisError::CircuitOpen {
                retry_in: Duration::from_nanos(ns),
            });
        }
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let script_now = inner.clock.as_ref().map(|_| inner.now_us());
        inner.calls.fetch_add(1, Ordering::Relaxed);
        let decided = match (current.rule, settle) {
            (ScriptQuota::TokenBucket { t, tau, .. }, settle) => {
                self.settle_bucket(key, settle, current.rule, (t, tau), script_now, deadline)
                    .await
            }
            (ScriptQuota::Window { .. }, Settle::Refund(n) | Settle::Charge(n)) => {
                self.call(
                    key,
                    Op::Refund(n),
                    current.rule,
                    &inner.also,
                    script_now,
                    deadline,
                )
                .await
            }
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
        rule: ScriptQuota,
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
        let also = &inner.also;
        let also_keys: Vec<Vec<u8>> = also
            .iter()
            .map(|a| self.state_key(&a.prefix, key))
            .collect();
        let call = |eval: bool| {
            let source = scripts::TOKEN_BUCKET_SETTLE;
            let mut cmd = script_call(eval, source, &inner.settle, &redis_key, &also_keys);
            cmd.arg(t).arg(tau).arg(&request);
            now_and_also(&mut cmd, script_now, true, also);
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
        let channel = super::invalidate::channel(&inner.prefix);
        let mut connection = inner.connection.get();
        let publish = super::invalidate::message(&channel);
        match tokio::time::timeout(inner.timeout, publish.query_async::<i64>(&mut connection)).await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => self.failed(&self.classify(e, channel.as_bytes()), false),
            Err(_) => self.failed(&RedisError::Timeout(inner.timeout), false),
        }
    }

    /// Forgets `key`'s state (under every quota), in Redis (for every node) and in this limiter's deny
    /// cache, then tells every limiter with the same prefix and algorithm to empty its
    /// deny cache (by `PUBLISH`; the message names no key): the key's next request
    /// starts fresh everywhere, once the message has arrived (within a round trip).
    ///
    /// # Errors
    /// As [`check`](Self::check); the local cache forgets the key even then.
    pub async fn reset(&self, key: &str) -> Result<(), RedisError> {
        let inner = &*self.inner;
        if let Some(cache) = &inner.cache {
            cache.forget(key);
        }
        // Every quota's state: one `DEL`, as the keys share a hash tag.
        let redis_keys = self.redis_keys(key);
        let redis_key = &redis_keys[0];
        let mut connection = inner.connection.get();
        let channel = super::invalidate::channel(&inner.prefix);
        let run = async {
            redis::cmd("DEL")
                .arg(&redis_keys)
                .query_async::<i64>(&mut connection)
                .await?;
            // Every node's cache, this one's included, empties on hearing it.
            super::invalidate::message(&channel)
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
        super::observe::redis_limiter(&inner.name, &stats);
        stats
    }
}

/// `EVAL <source>`, or `EVALSHA` of `script` (the same source), on `first` and `rest`
/// (the first quota's key, then the `also` quotas'), before the script's arguments.
fn script_call(
    eval: bool,
    source: &str,
    script: &redis::Script,
    first: &[u8],
    rest: &[Vec<u8>],
) -> redis::Cmd {
    // Room for everything, so that building the call grows neither buffer: the command,
    // the digest, the key count, the keys, then at most four numbers and two per extra
    // quota (each at most 20 digits, or a settlement's letter and 20 digits).
    let keys = first.len() + rest.iter().map(Vec::len).sum::<usize>();
    let numbers = 4 + 2 * rest.len();
    let args = 3 + 1 + rest.len() + numbers;
    let mut cmd = redis::Cmd::with_capacity(args, 7 + 40 + 3 + keys + 21 * numbers);
    if eval {
        cmd.arg("EVAL").arg(source);
    } else {
        cmd.arg("EVALSHA").arg(script.get_hash());
    }
    cmd.arg(1 + rest.len()).arg(first);
    for key in rest {
        cmd.arg(key);
    }
    cmd
}

/// A script's last arguments: `now` (µs) with a caller's clock, else the server's
/// `TIME` (an absent `now` where the script takes one, `absent`, and nothing follows;
/// otherwise an empty one); then each `also` quota's two arguments.
fn now_and_also(cmd: &mut redis::Cmd, now_us: Option<u64>, absent: bool, also: &[Also]) {
    match now_us {
        Some(us) => {
            cmd.arg(us);
        }
        None if absent && also.is_empty() => {}
        None => {
            cmd.arg("");
        }
    }
    for a in also {
        let [first, second] = a.rule.args();
        cmd.arg(first).arg(second);
    }
}

/// Reads the token bucket's one-integer reply to a request of `cost` under the rule
/// `t`, `tau`, `burst` it was called with: the µs until the bucket is full again, negated
/// for a deny. The rest follows from the rule: remaining `⌊(τ + T − reset) / T⌋`, and a
/// deny's retry-after `reset + T·(cost − 1) − τ`, which is at least 1 µs (a deny came
/// from `now < tat + T·(cost − 1) − τ`).
fn gcra_decision(
    reply: i64,
    t: u64,
    tau: u64,
    burst: u64,
    cost: u64,
) -> Result<Decision, RedisError> {
    let unexpected = || RedisError::UnexpectedReply(format!("{reply} to a request of {cost}"));
    let reset_us = reply.unsigned_abs();
    let remaining = (tau + t).saturating_sub(reset_us) / t.max(1);
    let reset = reset_us.saturating_mul(1_000);
    if reply >= 0 {
        return Ok(Decision::allow(burst, remaining, reset));
    }
    let retry_us = reset_us
        .checked_add(t.saturating_mul(cost.saturating_sub(1)))
        .and_then(|us| us.checked_sub(tau))
        .filter(|&us| cost > 0 && us > 0)
        .ok_or_else(unexpected)?;
    Ok(Decision::deny(
        burst,
        remaining,
        reset,
        retry_us.saturating_mul(1_000),
    ))
}

/// Reads the window scripts' `{allowed, limit, remaining, reset_after_us,
/// retry_after_us}`.
fn decision_from(reply: &[i64]) -> Result<Decision, RedisError> {
    let &[allowed, limit, remaining, reset_us, retry_us] = reply else {
        return Err(RedisError::UnexpectedReply(format!("{reply:?}")));
    };
    let unsigned =
        |v: i64| u64::try_from(v).map_err(|_| RedisError::UnexpectedReply(format!("{reply:?}")));
    let ns = |v: i64| unsigned(v).map(|us| us.saturating_mul(1_000));
    let (limit, remaining, reset) = (unsigned(limit)?, unsigned(remaining)?, ns(reset_us)?);
    Ok(if allowed == 1 {
        Decision::allow(limit, remaining, reset)
    } else {
        Decision::deny(limit, remaining, reset, ns(retry_us)?)
    })
}

/// Reads a script's reply per quota of `rules` (the first quota's, then the `also`
/// quotas'): one integer for the token bucket, read by `bucket(reply, t, tau, burst)`,
/// five for the windows; each decision tagged with its quota's index.
fn per_quota(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
    bucket: impl Fn(i64, u64, u64, u64) -> Result<Decision, RedisError>,
) -> Result<Vec<Decision>, RedisError> {
    let unexpected = || RedisError::UnexpectedReply(format!("{replies:?}"));
    let mut decisions = Vec::new();
    let mut at = 0;
    for (i, rule) in rules.enumerate() {
        let decision = match rule {
            ScriptQuota::TokenBucket { t, tau, burst } => {
                let &reply = replies.get(at).ok_or_else(unexpected)?;
                at += 1;
                bucket(reply, t, tau, burst)?
            }
            ScriptQuota::Window { .. } => {
                let reply = replies.get(at..at + 5).ok_or_else(unexpected)?;
                at += 5;
                decision_from(reply)?
            }
        };
        decisions.push(decision.for_policy(i));
    }
    if at != replies.len() || decisions.is_empty() {
        return Err(unexpected());
    }
    Ok(decisions)
}

/// The decision of a request of `cost` from the check script's reply under `rules`, as
/// [`Decision::all_of`] makes it in process.
fn all_of(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
    cost: u64,
) -> Result<Decision, RedisError> {
    let decisions = per_quota(replies, rules, |reply, t, tau, burst| {
        gcra_decision(reply, t, tau, burst, cost)
    })?;
    Decision::all_of(decisions).ok_or_else(|| RedisError::UnexpectedReply(format!("{replies:?}")))
}

/// The decision a unit request would get right after a settlement, from its reply under
/// `rules`: the token bucket's settlement script gives the µs until each bucket is full
/// again, the window scripts their unit request's decision. The tightest of every
/// quota's ([`Decision::tighter`]), as in process.
fn settled(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
) -> Result<Decision, RedisError> {
    let decisions = per_quota(replies, rules, |reset_us, t, tau, burst| {
        // Denied while the TAT lies beyond tau.
        let reply = if reset_us > tau as i64 {
            -reset_us
        } else {
            reset_us
        };
        gcra_decision(reply, t, tau, burst, 1)
    })?;
    let unexpected = || RedisError::UnexpectedReply(format!("{replies:?}"));
    decisions
        .into_iter()
        .reduce(Decision::tighter)
        .ok_or_else(unexpected)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1/s, burst 3, in µs: T = 10⁶, τ = 2·10⁶.
    const T: u64 = 1_000_000;
    const TAU: u64 = 2 * T;

    #[test]
    fn an_admission_reads_remaining_and_reset_from_the_reset_alone() {
        let full = gcra_decision(0, T, TAU, 3, 0).unwrap();
        assert!(full.is_allowed());
        assert_eq!(
            (
                full.limit(),
                full.remaining(),
                full.reset_after().as_nanos()
            ),
            (3, 3, 0)
        );
        // The first unit of a full bucket: full again in one T, two left.
        let first = gcra_decision(1_000_000, T, TAU, 3, 1).unwrap();
        assert_eq!(
            (first.remaining(), first.reset_after().as_nanos()),
            (2, 1_000_000_000)
        );
        // The last unit: full again in τ + T, none left; a µs later, still none whole.
        assert_eq!(
            gcra_decision(3_000_000, T, TAU, 3, 1).unwrap().remaining(),
            0
        );
        assert_eq!(
            gcra_decision(2_000_001, T, TAU, 3, 1).unwrap().remaining(),
            0
        );
        assert_eq!(
            gcra_decision(2_000_000, T, TAU, 3, 1).unwrap().remaining(),
            1
        );
    }

    #[test]
    fn a_deny_retries_when_its_cost_fits_and_never_after_zero() {
        // Empty for 2.5 s more: a unit fits in 0.5 s, three units in 2.5 s.
        let one = gcra_decision(-2_500_000, T, TAU, 3, 1).unwrap();
        assert!(!one.is_allowed());
        assert_eq!(
            (one.remaining(), one.reset_after().as_nanos()),
            (0, 2_500_000_000)
        );
        assert_eq!(one.retry_after(), Some(Duration::from_millis(500)));
        let three = gcra_decision(-2_500_000, T, TAU, 3, 3).unwrap();
        assert_eq!(three.retry_after(), Some(Duration::from_millis(2_500)));
        // A reply no deny can give: a deny of nothing, or one whose retry would be 0.
        for (reply, cost) in [(-1, 0), (-2_000_000, 1), (-1, 1)] {
            assert!(matches!(
                gcra_decision(reply, T, TAU, 3, cost),
                Err(RedisError::UnexpectedReply(_))
            ));
        }
    }
}
