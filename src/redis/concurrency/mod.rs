//! `RedisConcurrencyLimiter`: at most N slots in flight per key across every process,
//! each slot a lease in Redis that expires unless its holder renews it.
//!
//! ```text
//! try_acquire ─► (deny cache) ─► (breaker) ─► EVALSHA acquire: expired leases out, slot in as a lease
//!                                                    └─► RedisPermit ─► registered for renewal
//! renewal task (every lease/3, while the limiter lives) ─► EVALSHA renew: each key's leases extended
//! RedisPermit::release ─► EVALSHA release ─► out of the renewal list
//! ```
//!
//! Redis holds, per key, `<prefix>:cc:{key}` (a sorted set of permit ids scored by their
//! lease's expiry, on the server's clock) and `<prefix>:ccw:{key}` (each permit's weight,
//! the weight held, `*`, and the most ever held at once, `^`), one hash slot per key as
//! the Redis tier's keys. Both expire with their last lease.

mod builder;
mod permit;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

pub use builder::RedisConcurrencyBuilder;
pub use permit::{PermitError, RedisPermit};

use super::RedisError;
use crate::clock::nanos;
use crate::clock::{Clock, MonotonicClock};
use crate::concurrency::{ConcurrencyError, ConcurrencyLimiter};
use crate::decision::Decision;
use crate::fail_mode::FailMode;
use crate::redis::breaker::{Breaker, BreakerState, Gate, Probe};
use crate::redis::connection::{Link, eval};
use crate::redis::keys::{KeyHasher, write_key};
use crate::redis::limiter::reply::gcra_decision;
use permit::{Kind, Lease, LeaseState};

/// The default lease of a slot: a holder that dies gives its slots back this long after
/// its last renewal at most.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Held in Redis per key, `max` slots at once across every process that shares the
/// prefix; see the [concurrency guide](crate::guide::concurrency).
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::redis::RedisConcurrencyLimiter;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // At most 2 requests at once per API key, over the whole fleet.
/// let limiter = RedisConcurrencyLimiter::builder("redis://127.0.0.1/", 2)
///     .lease(Duration::from_secs(10))
///     .prefix("api")
///     .build()
///     .await?;
/// let permit = limiter.try_acquire("key-1").await?;
/// // ... serve the request; the lease is renewed while it runs ...
/// permit.release().await?;
/// # Ok(())
/// # }
/// ```
///
/// Each acquire and each release is one script call, bounded (reconnection and retries
/// included) by the timeout as a deadline. A key found full is refused in process for a
/// moment after ([`deny_cache`](RedisConcurrencyBuilder::deny_cache)); after consecutive
/// failures the circuit breaker stops calling Redis; and the fail mode decides what a
/// failed or short-circuited acquire returns.
///
/// Cloning is cheap; the clones share the leases. Dropping the last clone stops the
/// renewal of every lease it issued: permits still held then expire after their lease.
#[derive(Clone)]
pub struct RedisConcurrencyLimiter {
    inner: Arc<Inner>,
    /// Dropped with the last clone: the renewal task and the node count stop.
    _running: Arc<tokio::sync::watch::Sender<()>>,
}

pub(crate) struct Inner {
    link: Arc<Link>,
    acquire: redis::Script,
    release: redis::Script,
    prefix: String,
    hasher: Option<KeyHasher>,
    timeout: Duration,
    lease: Duration,
    default_max: AtomicU32,
    overrides: RwLock<HashMap<String, u32>>,
    /// The token bucket decided with each acquire: its quota and the script's `T`, `tau`.
    rate: Option<Rate>,
    fail_mode: FailMode,
    /// The fail mode's in-process limiter (`LocalShare`): the maximum divided by `nodes`.
    local: ConcurrencyLimiter<String>,
    nodes: AtomicU64,
    breaker: Breaker,
    deny_cache: Option<DenyCache>,
    /// The leases this limiter renews, by permit id.
    leases: Mutex<HashMap<u64, Arc<LeaseState>>>,
    node: u64,
    next_id: AtomicU64,
    monotonic: MonotonicClock,
    name: Arc<str>,
    failing: AtomicBool,
    counts: Counts,
}

#[derive(Clone, Copy)]
struct Rate {
    t: u64,
    tau: u64,
    burst: u64,
}

#[derive(Default)]
struct Counts {
    acquired: AtomicU64,
    refused: AtomicU64,
    calls: AtomicU64,
    errors: AtomicU64,
    cached_denies: AtomicU64,
    fail_mode: AtomicU64,
    lost: AtomicU64,
}

/// Keys found full, refused in process until the instant (monotonic ns) noted for them.
struct DenyCache {
    hold: Duration,
    until: Mutex<HashMap<Vec<u8>, (u64, u32)>>,
}

/// The most keys the deny cache notes; past that it starts afresh.
const DENY_CACHE_KEYS: usize = 100_000;

/// The counters of a [`RedisConcurrencyLimiter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConcurrencyStats {
    /// Permits issued by Redis.
    pub acquired: u64,
    /// Acquires refused (full, never fitting, or denied by the rate), from Redis or the
    /// deny cache.
    pub refused: u64,
    /// Script calls made (acquires, releases, renewals, probes).
    pub calls: u64,
    /// Calls that failed.
    pub errors: u64,
    /// Refusals answered by the deny cache, with no call.
    pub cached_denies: u64,
    /// Acquires decided by the fail mode (Redis failed or the breaker was open).
    pub fail_mode_decisions: u64,
    /// Leases held now, renewed by this limiter.
    pub leases: usize,
    /// Leases found expired at a renewal or a release (their holders were too slow, or
    /// Redis lost them).
    pub leases_lost: u64,
    /// The circuit breaker's state.
    pub breaker: BreakerState,
}

impl fmt::Debug for RedisConcurrencyLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConcurrencyLimiter")
            .field("name", &self.inner.name)
            .field("prefix", &self.inner.prefix)
            .field("max", &self.max())
            .field("lease", &self.inner.lease)
            .field("hash_keys", &self.inner.hasher.is_some())
            .finish()
    }
}

/// How an acquire was decided by Redis.
enum Reply {
    Admitted(Option<Decision>),
    Refused(ConcurrencyError),
}

impl RedisConcurrencyLimiter {
    /// A builder for `max` slots per key on the Redis server at `url`.
    pub fn builder(url: &str, max: u32) -> RedisConcurrencyBuilder {
        RedisConcurrencyBuilder::new(crate::redis::RedisOptions::new(url), max)
    }

    /// A builder on the Redis Cluster reached through the seed `nodes`.
    pub fn cluster_builder(nodes: &[&str], max: u32) -> RedisConcurrencyBuilder {
        RedisConcurrencyBuilder::new(crate::redis::RedisOptions::cluster(nodes), max)
    }

    /// A builder on the primary that Redis Sentinel names `master_name`.
    pub fn sentinel_builder(
        sentinels: &[&str],
        master_name: &str,
        max: u32,
    ) -> RedisConcurrencyBuilder {
        RedisConcurrencyBuilder::new(
            crate::redis::RedisOptions::sentinel(sentinels, master_name),
            max,
        )
    }

    /// A builder with the connection settings shared with the other tiers.
    pub fn builder_with(options: crate::redis::RedisOptions, max: u32) -> RedisConcurrencyBuilder {
        RedisConcurrencyBuilder::new(options, max)
    }

    /// The Redis keys of `key`'s leases: `<prefix>:cc:{key}` (the sorted set of leases)
    /// and `<prefix>:ccw:{key}` (their weights), `{h:<digest>}` in the key's place with
    /// [`hash_keys`](RedisConcurrencyBuilder::hash_keys).
    pub fn redis_keys(&self, key: &str) -> [Vec<u8>; 2] {
        [self.key_of("cc", key), self.key_of("ccw", key)]
    }

    fn key_of(&self, kind: &str, key: &str) -> Vec<u8> {
        let prefix = &self.inner.prefix;
        let mut k = Vec::with_capacity(prefix.len() + kind.len() + key.len().max(34) + 4);
        k.extend_from_slice(prefix.as_bytes());
        k.push(b':');
        k.extend_from_slice(kind.as_bytes());
        k.extend_from_slice(b":{");
        write_key(self.inner.hasher.as_ref(), key.as_bytes(), &mut k);
        k.push(b'}');
        k
    }

    /// Takes one slot of `key` as a lease.
    ///
    /// # Errors
    /// [`PermitError::Refused`] with [`ConcurrencyError::Full`] when `key`'s slots are
    /// held across the fleet (or the rate denies: [`ConcurrencyError::RateLimited`]);
    /// [`PermitError::Redis`] when Redis fails and the fail mode is
    /// [`FailMode::Closed`] (the default).
    pub async fn try_acquire(&self, key: &str) -> Result<RedisPermit, PermitError> {
        self.try_acquire_n(key, 1).await
    }

    /// Takes `weight` slots of `key` at once, or none (a weight of 0 takes nothing).
    ///
    /// # Errors
    /// As [`try_acquire`](Self::try_acquire), and [`ConcurrencyError::NeverFits`] (before
    /// any call) when `weight` exceeds the key's maximum.
    pub async fn try_acquire_n(&self, key: &str, weight: u32) -> Result<RedisPermit, PermitError> {
        let inner = &*self.inner;
        if weight == 0 {
            return Ok(RedisPermit::new(Kind::Empty, None));
        }
        let max = self.max_for(key);
        if weight > max {
            return Err(self.refused(ConcurrencyError::NeverFits { weight, max }));
        }
        let [leases, weights] = self.redis_keys(key);
        if let Some(cache) = &inner.deny_cache {
            if let Some(in_flight) = cache.full(&leases, weight, max, inner.monotonic.now_ns()) {
                inner.counts.cached_denies.fetch_add(1, Ordering::Relaxed);
                return Err(self.refused(ConcurrencyError::Full { in_flight, max }));
            }
        }
        if let Gate::Reject(ns) = inner.breaker.gate(|| inner.monotonic.now_ns()) {
            let e = RedisError::CircuitOpen {
                retry_in: Duration::from_nanos(ns),
            };
            return self.fail(key, weight, e);
        }
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let member = permit_member(inner.node, id);
        let rate_key = inner.rate.map(|_| self.key_of("tb", key));
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let started = inner.monotonic.now_ns();
        let reply = self
            .inner
            .call(deadline, &leases, async {
                let mut connection = inner.link.get();
                let call = |eval: bool| {
                    let mut cmd = script_cmd(
                        eval,
                        &inner.acquire,
                        crate::redis::scripts::CONCURRENCY_ACQUIRE,
                    );
                    cmd.arg(if rate_key.is_some() { 3 } else { 2 })
                        .arg(&leases)
                        .arg(&weights);
                    if let Some(rate_key) = &rate_key {
                        cmd.arg(rate_key);
                    }
                    cmd.arg(max)
                        .arg(weight)
                        .arg(micros(inner.lease))
                        .arg(&member);
                    if let Some(rate) = inner.rate {
                        cmd.arg(rate.t).arg(rate.tau);
                    }
                    cmd
                };
                eval::<Vec<i64>>(&mut connection, call).await
            })
            .await;
        let reply = match reply.and_then(|r| self.read_acquire(&r, weight, max)) {
            Ok(reply) => reply,
            Err(e) => return self.fail(key, weight, e),
        };
        match reply {
            Reply::Admitted(decision) => {
                inner.counts.acquired.fetch_add(1, Ordering::Relaxed);
                let state = Arc::new(LeaseState::new(
                    leases,
                    weights,
                    member,
                    // The lease runs from the server's `TIME` in the call, which is
                    // after `started`: counting from `started` errs early.
                    started.saturating_add(nanos(inner.lease)),
                ));
                inner.leases.lock().insert(id, Arc::clone(&state));
                Ok(RedisPermit::new(
                    Kind::Lease(Lease {
                        limiter: Arc::clone(&self.inner),
                        id,
                        weight,
                        state,
                        released: false,
                    }),
                    decision,
                ))
            }
            Reply::Refused(refusal) => {
                if let (Some(cache), ConcurrencyError::Full { in_flight, .. }) =
                    (&inner.deny_cache, &refusal)
                {
                    cache.note(leases, *in_flight, inner.monotonic.now_ns());
                }
                Err(self.refused(refusal))
            }
        }
    }

    /// Reads the acquire script's `{code, held, wait, rate}`.
    fn read_acquire(&self, reply: &[i64], weight: u32, max: u32) -> Result<Reply, RedisError> {
        let unexpected = || RedisError::UnexpectedReply(format!("{reply:?} to an acquire"));
        let &[code, held, _wait, rate] = reply else {
            return Err(unexpected());
        };
        let in_flight = u32::try_from(held).map_err(|_| unexpected())?;
        let decision = |rate: i64| {
            self.inner
                .rate
                .map(|r| gcra_decision(rate, r.t, r.tau, r.burst, u64::from(weight)))
                .transpose()
        };
        match code {
            1 => Ok(Reply::Admitted(decision(rate)?)),
            0 => Ok(Reply::Refused(ConcurrencyError::Full { in_flight, max })),
            2 => match decision(rate)? {
                Some(d) if !d.is_allowed() => Ok(Reply::Refused(ConcurrencyError::RateLimited(d))),
                _ => Err(unexpected()),
            },
            _ => Err(unexpected()),
        }
    }

    /// An acquire Redis could not decide: the fail mode decides.
    fn fail(&self, key: &str, weight: u32, e: RedisError) -> Result<RedisPermit, PermitError> {
        let inner = &*self.inner;
        match inner.fail_mode {
            FailMode::Open => {
                inner.counts.fail_mode.fetch_add(1, Ordering::Relaxed);
                Ok(RedisPermit::new(Kind::Unlimited(weight), None))
            }
            FailMode::LocalShare => {
                inner.counts.fail_mode.fetch_add(1, Ordering::Relaxed);
                let local = self.local_share(key);
                inner.local.set_max(key, local);
                match inner.local.try_acquire_n(key, weight) {
                    Ok(permit) => Ok(RedisPermit::new(Kind::Local(permit), None)),
                    Err(refusal) => Err(self.refused(refusal)),
                }
            }
            // `Local(_)` is refused at build.
            _ => Err(PermitError::Redis(e)),
        }
    }

    /// This node's share of `key`'s maximum: `⌊max / N⌋` of the `N` limiters counted on
    /// the prefix, at least 1 (0 for a maximum of 0).
    fn local_share(&self, key: &str) -> u32 {
        let max = self.max_for(key);
        let nodes = self.inner.nodes.load(Ordering::Relaxed).max(1);
        let share = u64::from(max) / nodes;
        u32::try_from(share)
            .unwrap_or(u32::MAX)
            .max(u32::from(max > 0))
    }

    fn refused(&self, refusal: ConcurrencyError) -> PermitError {
        self.inner.counts.refused.fetch_add(1, Ordering::Relaxed);
        PermitError::Refused(refusal)
    }

    /// The maximum of `key`: its own ([`set_max`](Self::set_max)) or the default.
    pub fn max_for(&self, key: &str) -> u32 {
        let own = self.inner.overrides.read().get(key).copied();
        own.unwrap_or_else(|| self.max())
    }

    /// The default maximum.
    pub fn max(&self) -> u32 {
        self.inner.default_max.load(Ordering::Relaxed)
    }

    /// Gives `key` a maximum of its own, now, for this process's acquires (every process
    /// must set the same, as they must build with the same default: each acquire
    /// carries its maximum to Redis). A lower maximum takes no lease back.
    pub fn set_max(&self, key: &str, max: u32) {
        self.inner.overrides.write().insert(key.to_owned(), max);
    }

    /// Returns `key` to the default maximum.
    pub fn remove_max(&self, key: &str) {
        self.inner.overrides.write().remove(key);
    }

    /// Sets the default maximum, now (as [`set_max`](Self::set_max), for every key
    /// without its own).
    pub fn set_default_max(&self, max: u32) {
        self.inner.default_max.store(max, Ordering::Relaxed);
    }

    /// The weight held on `key` across the fleet, as Redis counts it now (expired leases
    /// not yet given back by an acquire included), and the most ever held at once while
    /// the key existed.
    ///
    /// # Errors
    /// As a call: [`RedisError::Timeout`], [`RedisError::Unavailable`], ….
    pub async fn in_flight(&self, key: &str) -> Result<(u32, u32), RedisError> {
        let [_, weights] = self.redis_keys(key);
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        let (held, peak): (Option<u32>, Option<u32>) = self
            .inner
            .call(deadline, &weights, async {
                redis::cmd("HMGET")
                    .arg(&weights)
                    .arg("*")
                    .arg("^")
                    .query_async(&mut self.inner.link.get())
                    .await
            })
            .await?;
        Ok((held.unwrap_or(0), peak.unwrap_or(0)))
    }

    /// The lease of each slot.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The limiter's name (metrics and logs).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The counters, also published as metrics (feature `metrics`; every second too,
    /// inside the runtime that built the limiter).
    pub fn stats(&self) -> RedisConcurrencyStats {
        self.inner.stats()
    }
}

impl Inner {
    /// The limiter's counters, published as metrics.
    pub(crate) fn stats(&self) -> RedisConcurrencyStats {
        let c = &self.counts;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let stats = RedisConcurrencyStats {
            acquired: load(&c.acquired),
            refused: load(&c.refused),
            calls: load(&c.calls),
            errors: load(&c.errors),
            cached_denies: load(&c.cached_denies),
            fail_mode_decisions: load(&c.fail_mode),
            leases: self.leases.lock().len(),
            leases_lost: load(&c.lost),
            breaker: self.breaker.state(),
        };
        crate::redis::observe::redis_concurrency(&self.name, &stats);
        stats
    }

    /// Runs `call` (about `redis_key`) until `deadline`, and tells the breaker.
    async fn call<T>(
        self: &Arc<Self>,
        deadline: tokio::time::Instant,
        redis_key: &[u8],
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, RedisError> {
        let inner = &**self;
        inner.counts.calls.fetch_add(1, Ordering::Relaxed);
        let outcome = match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) if e.is_timeout() => Err(RedisError::Timeout(inner.timeout)),
            Ok(Err(e)) => Err(RedisError::from_redis(e, redis_key)),
            Err(_) => Err(RedisError::Timeout(inner.timeout)),
        };
        match &outcome {
            Ok(_) => {
                if inner.breaker.succeeded() {
                    crate::redis::observe::redis_breaker(&inner.name, BreakerState::Closed);
                }
                if inner.failing.swap(false, Ordering::Relaxed) {
                    crate::redis::observe::redis_health(&inner.name, None, true);
                }
            }
            Err(e) => self.failed(e, false),
        }
        outcome
    }

    /// A call failed with `e`: counted, logged, told to the breaker (which may start the
    /// probe), and the connection rebuilt if the server is gone.
    fn failed(self: &Arc<Self>, e: &RedisError, probe: bool) {
        let inner = &**self;
        inner.counts.errors.fetch_add(1, Ordering::Relaxed);
        crate::redis::observe::redis_error(&inner.name, e);
        let first = !inner.failing.swap(true, Ordering::Relaxed);
        crate::redis::observe::redis_health(&inner.name, Some(e), first);
        if matches!(e, RedisError::Unavailable(_) | RedisError::Timeout(_)) {
            inner.link.failed();
        }
        if e.is_outage() && inner.breaker.failed(inner.monotonic.now_ns(), probe) {
            crate::redis::observe::redis_breaker(&inner.name, BreakerState::Open);
            tokio::spawn(probe_while_open(Arc::downgrade(self)));
        }
    }

    /// The release script's call: give back (`renew: None`) or renew `members` of one
    /// key.
    fn release_cmd(
        &self,
        eval: bool,
        (leases, weights): (&[u8], &[u8]),
        renew: Option<Duration>,
        members: &[&str],
    ) -> redis::Cmd {
        let mut cmd = script_cmd(
            eval,
            &self.release,
            crate::redis::scripts::CONCURRENCY_RELEASE,
        );
        cmd.arg(2).arg(leases).arg(weights);
        match renew {
            Some(lease) => cmd.arg(micros(lease)),
            None => cmd.arg("r"),
        };
        for member in members {
            cmd.arg(*member);
        }
        cmd
    }

    /// Gives `member`'s slots back (`renew: None`) or renews the leases of `members`
    /// (`Some(lease)`), all of one key; returns, per member, whether it was still held.
    async fn release_or_renew(
        self: &Arc<Self>,
        state: (&[u8], &[u8]),
        renew: Option<Duration>,
        members: &[&str],
    ) -> Result<Vec<bool>, RedisError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let (leases, weights) = state;
        let reply: Vec<i64> = self
            .call(deadline, leases, async {
                let mut connection = self.link.get();
                let call = |eval: bool| self.release_cmd(eval, (leases, weights), renew, members);
                eval(&mut connection, call).await
            })
            .await?;
        if reply.len() != members.len() + 1 {
            return Err(RedisError::UnexpectedReply(format!(
                "{} values to a release of {}",
                reply.len(),
                members.len()
            )));
        }
        let held: Vec<bool> = reply[1..].iter().map(|&r| r == 1).collect();
        let lost = held.iter().filter(|&&h| !h).count() as u64;
        self.counts.lost.fetch_add(lost, Ordering::Relaxed);
        Ok(held)
    }
}

/// While the breaker of the limiter behind `weak` is open, probes Redis once per period
/// with a release of nothing (which writes nothing), until a probe closes it.
async fn probe_while_open(weak: std::sync::Weak<Inner>) {
    loop {
        let due = {
            let Some(inner) = weak.upgrade() else { return };
            inner.breaker.next_probe(inner.monotonic.now_ns())
        };
        match due {
            Probe::Closed => return,
            Probe::Wait(ns) => tokio::time::sleep(Duration::from_nanos(ns)).await,
            Probe::Now => {
                let Some(inner) = weak.upgrade() else { return };
                let key: &[u8] = b"tollgate:concurrency-probe";
                let deadline = tokio::time::Instant::now() + inner.timeout;
                inner.counts.calls.fetch_add(1, Ordering::Relaxed);
                let probe = tokio::time::timeout_at(deadline, async {
                    let mut connection = inner.link.get();
                    let call = |eval: bool| inner.release_cmd(eval, (key, key), None, &["probe"]);
                    eval::<Vec<i64>>(&mut connection, call).await
                })
                .await;
                match probe {
                    Ok(Ok(_)) => {
                        if inner.breaker.succeeded() {
                            crate::redis::observe::redis_breaker(&inner.name, BreakerState::Closed);
                        }
                    }
                    Ok(Err(e)) => inner.failed(&RedisError::from_redis(e, key), true),
                    Err(_) => inner.failed(&RedisError::Timeout(inner.timeout), true),
                }
            }
        }
    }
}

impl DenyCache {
    /// The weight held when `leases` was found full, if that was less than the hold ago
    /// and `weight` did not fit then.
    fn full(&self, leases: &[u8], weight: u32, max: u32, now: u64) -> Option<u32> {
        let until = self.until.lock();
        match until.get(leases) {
            Some(&(until, held))
                if now < until && u64::from(held) + u64::from(weight) > u64::from(max) =>
            {
                Some(held)
            }
            _ => None,
        }
    }

    fn note(&self, leases: Vec<u8>, held: u32, now: u64) {
        let mut until = self.until.lock();
        if until.len() >= DENY_CACHE_KEYS {
            until.retain(|_, (u, _)| *u > now);
            if until.len() >= DENY_CACHE_KEYS {
                until.clear();
            }
        }
        until.insert(leases, (now.saturating_add(nanos(self.hold)), held));
    }

    /// A slot of `leases` was given back by this process: its note goes.
    fn forget(&self, leases: &[u8]) {
        self.until.lock().remove(leases);
    }
}

/// `EVALSHA <digest>` (or `EVAL <source>` after `NOSCRIPT`).
fn script_cmd(eval: bool, script: &redis::Script, source: &str) -> redis::Cmd {
    let mut cmd = redis::Cmd::new();
    if eval {
        cmd.arg("EVAL").arg(source);
    } else {
        cmd.arg("EVALSHA").arg(script.get_hash());
    }
    cmd
}

/// A permit's id in Redis: the limiter's random node id and a sequence number.
fn permit_member(node: u64, id: u64) -> String {
    format!("{node:016x}:{id:x}")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Renews every lease the limiter behind `weak` holds, every third of the lease, until
/// `stop`'s sender is dropped (the last limiter handle) or the limiter is gone.
pub(crate) async fn renew_leases(
    weak: std::sync::Weak<Inner>,
    mut stop: tokio::sync::watch::Receiver<()>,
    every: Duration,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {}
        }
        let Some(inner) = weak.upgrade() else { return };
        // Grouped by key: one call renews a key's leases.
        let mut by_key: HashMap<Vec<u8>, Vec<Arc<LeaseState>>> = HashMap::new();
        for state in inner.leases.lock().values() {
            by_key
                .entry(state.leases.clone())
                .or_default()
                .push(Arc::clone(state));
        }
        for (_, states) in by_key {
            let started = inner.monotonic.now_ns();
            let members: Vec<&str> = states.iter().map(|s| s.member.as_str()).collect();
            let first = &states[0];
            let renewed = tokio::select! {
                _ = stop.changed() => return,
                r = inner.release_or_renew((&first.leases, &first.weights), Some(inner.lease), &members) => r,
            };
            if let Ok(held) = renewed {
                for (state, held) in states.iter().zip(held) {
                    if held {
                        state.renewed(started.saturating_add(nanos(inner.lease)));
                    } else {
                        state.lose();
                    }
                }
            }
        }
    }
}
