//! `RedisLimiter`: one atomic script call per check, against state shared by every node.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::RedisError;
use super::connection::{Link, Target};
use super::keys::{KeyHasher, write_key};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;

/// The scripts, as sent to Redis, one per algorithm. Public so that tests and operators
/// can inspect or `EVAL` them directly.
pub mod scripts {
    /// The token bucket (GCRA in integer microseconds).
    pub const TOKEN_BUCKET: &str = include_str!("token_bucket.lua");
    /// The sliding window counter.
    pub const SLIDING_WINDOW: &str = include_str!("sliding_window.lua");
    /// The fixed window counter.
    pub const FIXED_WINDOW: &str = include_str!("fixed_window.lua");
}

/// The default timeout of a call to Redis.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// Integers in Lua's doubles are exact below this.
const LUA_EXACT: u64 = 1 << 53;

/// What a caller does when Redis fails: its policy, applied by
/// [`RedisLimiter::check_or`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailMode {
    /// Admit the request (availability first).
    Open,
    /// Deny the request (protection first), with `retry_after` = one emission interval.
    Closed,
}

/// A quota in the scripts' units: integer microseconds.
#[derive(Clone, Copy, Debug)]
enum Rule {
    TokenBucket { t: u64, tau: u64, burst: u64 },
    Window { limit: u64, period: u64 },
}

impl Rule {
    fn new(algorithm: Algorithm, quota: Quota) -> Result<Self, RedisError> {
        let period_ns = quota.period_ns();
        if period_ns % 1_000 != 0 {
            return Err(ConfigError::PeriodNotWholeMicroseconds(period_ns).into());
        }
        let period = period_ns / 1_000;
        let limit = quota.limit();
        match algorithm {
            Algorithm::TokenBucket => {
                let t = period / limit;
                let lost = u128::from(period % limit);
                if t == 0 || lost * 10_000 > u128::from(limit) * u128::from(t) {
                    return Err(ConfigError::RateNotRepresentable { limit, period_ns }.into());
                }
                let tau = t
                    .checked_mul(quota.burst() - 1)
                    .filter(|&tau| tau < LUA_EXACT / 2);
                let Some(tau) = tau else {
                    return Err(ConfigError::ExceedsRedisPrecision(
                        "burst × (period / limit) must stay below 2^52 µs",
                    )
                    .into());
                };
                Ok(Self::TokenBucket {
                    t,
                    tau,
                    burst: quota.burst(),
                })
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                if u128::from(limit) * u128::from(period) >= u128::from(LUA_EXACT) {
                    return Err(ConfigError::ExceedsRedisPrecision(
                        "limit × period (µs) must stay below 2^53",
                    )
                    .into());
                }
                Ok(Self::Window { limit, period })
            }
            other => Err(RedisError::UnsupportedAlgorithm(other)),
        }
    }

    fn capacity(&self) -> u64 {
        match *self {
            Self::TokenBucket { burst, .. } => burst,
            Self::Window { limit, .. } => limit,
        }
    }
}

/// The quota arguments the scripts take for `algorithm`, in microseconds:
/// `[T, tau, burst]` for the token bucket, `[limit, period, 0]` for the windows.
pub(crate) fn script_args(algorithm: Algorithm, quota: Quota) -> Result<[u64; 3], RedisError> {
    Ok(match Rule::new(algorithm, quota)? {
        Rule::TokenBucket { t, tau, burst } => [t, tau, burst],
        Rule::Window { limit, period } => [limit, period, 0],
    })
}

/// Configures a [`RedisLimiter`]. Made by [`RedisLimiter::builder`] (one server) or
/// [`RedisLimiter::cluster_builder`] (Redis Cluster).
#[must_use = "a builder does nothing until .build() is awaited"]
pub struct RedisBuilder {
    target: Target,
    quota: Quota,
    algorithm: Algorithm,
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    hasher: Option<KeyHasher>,
    name: Arc<str>,
}

impl fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("redis", &self.target)
            .field("hash_keys", &self.hasher.is_some())
            .field("quota", &self.quota)
            .field("algorithm", &self.algorithm)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("caller_clock", &self.clock.is_some())
            .field("name", &self.name)
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

    /// The prefix of every Redis key this limiter writes; `"tollgate"` by default. Keys
    /// are `<prefix>:<algorithm>:{<key>}`.
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.to_owned();
        self
    }

    /// How long a call to Redis (or the first connection) may take before it fails with
    /// [`RedisError::Timeout`]; 50 ms by default.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Store a keyed hash of each key instead of the key itself: the Redis key becomes
    /// `<prefix>:<algorithm>:{h:<32 hex digits>}`, a 128-bit keyed BLAKE3 digest. Use it
    /// when keys are API keys, tokens or anything else that must not be readable in
    /// Redis (by `KEYS`, `MONITOR`, a backup or a replica). Every node that shares the
    /// limit must use the same `secret`; the secret itself is kept by no one (only a key
    /// derived from it) and shows in no `Debug` output.
    pub fn hash_keys(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.hasher = Some(KeyHasher::new(secret.as_ref()));
        self
    }

    /// Trust this CA certificate (PEM) for `rediss://` URLs, instead of the system's
    /// roots (cargo feature `tls`).
    #[cfg(feature = "tls")]
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.target.set_root_cert(pem.into());
        self
    }

    /// Take "now" from the caller's `clock` (truncated to microseconds) instead of the
    /// Redis server's `TIME`. Tests use this with a `ManualClock` for determinism; in
    /// production, the server's clock is the one all nodes agree on. Either way, time
    /// never goes backwards in the stored state: a GCRA state never moves back, and a
    /// window state ahead of the given time is read at its own window's start.
    pub fn caller_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
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
        let rule = Rule::new(self.algorithm, self.quota)?;
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::InvalidPrefix(self.prefix).into());
        }
        let source = match self.algorithm {
            Algorithm::TokenBucket => scripts::TOKEN_BUCKET,
            Algorithm::SlidingWindow => scripts::SLIDING_WINDOW,
            _ => scripts::FIXED_WINDOW,
        };
        let client = self.target.client(self.timeout)?;
        let script = redis::Script::new(source);
        let connect = async {
            let link = Link::connect(client, self.timeout).await?;
            // A cluster's nodes get the script on first use (`EVAL` after `NOSCRIPT`):
            // loading it on every node would make one unreachable replica fail the build.
            if !self.target.is_cluster() {
                script.prepare_invoke().load_async(&mut link.get()).await?;
            }
            Ok::<_, redis::RedisError>(Arc::new(link))
        };
        let connection = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| RedisError::Timeout(self.timeout))?
            .map_err(|e| RedisError::from_redis(e, b""))?;
        let prefix = format!("{}:{}:", self.prefix, short_name(self.algorithm));
        Ok(RedisLimiter {
            inner: Arc::new(Inner {
                connection,
                script,
                source,
                target: self.target,
                hasher: self.hasher,
                rule,
                prefix,
                timeout: self.timeout,
                clock: self.clock,
                quota: self.quota,
                algorithm: self.algorithm,
                name: self.name,
                failing: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }
}

fn short_name(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::SlidingWindow => "sw",
        _ => "fw",
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
/// **Failures.** Every error is typed ([`RedisError`]) and arrives within the timeout.
/// What to do then is the caller's policy: fail open or fail closed, for example with
/// [`check_or`](Self::check_or).
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
/// Clones are cheap and share the connection. `Debug` shows the URLs with their
/// passwords replaced by `***`.
///
/// [`RateLimiter`]: crate::RateLimiter
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Arc<Link>,
    script: redis::Script,
    source: &'static str,
    target: Target,
    hasher: Option<KeyHasher>,
    rule: Rule,
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    quota: Quota,
    algorithm: Algorithm,
    name: Arc<str>,
    /// Whether the last check failed (for logging the start and end of an outage once).
    failing: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &*self.inner;
        f.debug_struct("RedisLimiter")
            .field("redis", &inner.target)
            .field("hash_keys", &inner.hasher.is_some())
            .field("quota", &inner.quota)
            .field("algorithm", &inner.algorithm)
            .field("prefix", &inner.prefix)
            .field("timeout", &inner.timeout)
            .field("name", &inner.name)
            .finish_non_exhaustive()
    }
}

impl RedisLimiter {
    /// A builder for a limiter on the Redis server at `url` (for example
    /// `redis://127.0.0.1:6379/`), enforcing `quota`.
    pub fn builder(url: &str, quota: Quota) -> RedisBuilder {
        Self::builder_for(Target::single(url), quota)
    }

    /// A builder for a limiter on the Redis Cluster reached through the seed `nodes`
    /// (for example `["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]`; one live
    /// seed is enough), enforcing `quota`. Credentials are taken from the first URL.
    pub fn cluster_builder(nodes: &[&str], quota: Quota) -> RedisBuilder {
        Self::builder_for(Target::cluster(nodes), quota)
    }

    fn builder_for(target: Target, quota: Quota) -> RedisBuilder {
        RedisBuilder {
            target,
            quota,
            algorithm: Algorithm::TokenBucket,
            prefix: "tollgate".to_owned(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
            hasher: None,
            name: Arc::from("default"),
        }
    }

    /// The limiter's name ([`RedisBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The quota every key is limited by.
    pub fn quota(&self) -> Quota {
        self.inner.quota
    }

    /// The algorithm the script runs.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The Redis key that holds `key`'s state: `<prefix>:<algorithm>:{<key>}` (or, with
    /// [`hash_keys`](RedisBuilder::hash_keys), `{h:<digest>}`), one hash slot per key in
    /// Redis Cluster. The user key is passed as a binary-safe script key, never spliced
    /// into a command, so any bytes round-trip.
    pub fn redis_key(&self, key: &str) -> Vec<u8> {
        let prefix = &self.inner.prefix;
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
    /// # Errors
    /// [`RedisError::InsufficientCapacity`] (before any I/O, nothing written) when `n`
    /// exceeds the burst (token bucket) or the limit (windows); otherwise as
    /// [`check`](Self::check).
    pub async fn check_n(&self, key: &str, n: u64) -> Result<Decision, RedisError> {
        let decided = self.decide(key, n).await;
        let inner = &*self.inner;
        match &decided {
            // The caller's own mistake says nothing of Redis's health.
            Err(RedisError::InsufficientCapacity(_)) => {}
            Err(e) => {
                crate::observe::redis_error(&inner.name, e);
                let first = !inner
                    .failing
                    .swap(true, std::sync::atomic::Ordering::Relaxed);
                crate::observe::redis_health(&inner.name, Some(e), first);
            }
            Ok(_) => {
                if inner.failing.load(std::sync::atomic::Ordering::Relaxed)
                    && inner
                        .failing
                        .swap(false, std::sync::atomic::Ordering::Relaxed)
                {
                    crate::observe::redis_health(&inner.name, None, true);
                }
            }
        }
        decided
    }

    async fn decide(&self, key: &str, n: u64) -> Result<Decision, RedisError> {
        let inner = &*self.inner;
        let capacity = inner.rule.capacity();
        if n > capacity {
            return Err(InsufficientCapacity {
                requested: n,
                capacity,
            }
            .into());
        }
        let redis_key = self.redis_key(key);
        let now_us = inner.clock.as_ref().map(|clock| clock.now_ns() / 1_000);
        let call = |eval: bool| {
            let mut cmd = if eval {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(inner.source);
                cmd
            } else {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(inner.script.get_hash());
                cmd
            };
            cmd.arg(1).arg(&redis_key);
            match inner.rule {
                Rule::TokenBucket { t, tau, burst } => cmd.arg(t).arg(tau).arg(burst),
                Rule::Window { limit, period } => cmd.arg(limit).arg(period),
            };
            cmd.arg(n);
            match now_us {
                Some(us) => cmd.arg(us),
                None => cmd.arg(""),
            };
            cmd
        };
        let mut connection = inner.connection.get();
        let run = async {
            match call(false).query_async::<Vec<i64>>(&mut connection).await {
                // After a SCRIPT FLUSH, a restart or a failover (or a cluster node's first
                // call): `EVAL` runs the script and caches it on that node.
                Err(e) if e.code() == Some("NOSCRIPT") => {
                    call(true).query_async(&mut connection).await
                }
                reply => reply,
            }
        };
        // One timer bounds the whole call, reconnection, retries and redirections included.
        let reply = match tokio::time::timeout(inner.timeout, run).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                let e = self.classify(e, &redis_key);
                if matches!(e, RedisError::Unavailable(_)) {
                    inner.connection.failed();
                }
                return Err(e);
            }
            Err(_) => {
                inner.connection.failed();
                return Err(RedisError::Timeout(inner.timeout));
            }
        };
        decision_from(&reply)
    }

    fn classify(&self, e: redis::RedisError, key: &[u8]) -> RedisError {
        if e.is_timeout() {
            RedisError::Timeout(self.inner.timeout)
        } else {
            RedisError::from_redis(e, key)
        }
    }

    /// [`check`](Self::check) with a failure policy: when Redis fails, admit
    /// ([`FailMode::Open`]) or deny ([`FailMode::Closed`]) instead of returning the
    /// error, which is dropped. Use [`check`](Self::check) to log it.
    pub async fn check_or(&self, key: &str, mode: FailMode) -> Decision {
        match self.check(key).await {
            Ok(decision) => decision,
            Err(_) => self.failed_decision(mode),
        }
    }

    /// What `mode` decides when Redis fails.
    pub(crate) fn failed_decision(&self, mode: FailMode) -> Decision {
        match mode {
            FailMode::Open => Decision::allow(self.inner.rule.capacity(), 0, 0),
            FailMode::Closed => {
                let interval = u64::try_from(self.inner.quota.emission_interval().as_nanos())
                    .unwrap_or(u64::MAX);
                Decision::deny(self.inner.rule.capacity(), 0, 0, interval)
            }
        }
    }
}

/// Reads the scripts' `{allowed, limit, remaining, reset_after_us, retry_after_us}`.
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
