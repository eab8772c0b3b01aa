//! What [`RedisLimiter`](super::RedisLimiter) decides when Redis cannot: the fail modes,
//! and the in-process limiters of [`FailMode::Local`].

use std::sync::Arc;

use parking_lot::RwLock;

use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::limiter::RateLimiter;
use crate::quota::Quota;

/// What a check does when Redis fails or the circuit breaker is open: its policy,
/// applied by [`RedisLimiter::check_or`](super::RedisLimiter::check_or) and by the HTTP
/// layer's Redis backend.
///
/// ```no_run
/// use tollgate::redis::{FailMode, RedisLimiter};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = RedisLimiter::builder("redis://127.0.0.1:6379/", "100/s".parse()?)
///     .build()
///     .await?;
/// // With 4 nodes, each admits a quarter of the global quota while Redis is away.
/// let decision = limiter.check_or("user_1024", FailMode::Local("25/s".parse()?)).await;
/// # let _ = decision;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailMode {
    /// Admit the request (availability first).
    Open,
    /// Deny the request (protection first), with `retry_after` = one emission interval.
    Closed,
    /// Limit the request in process with this quota (per key, with the limiter's
    /// algorithm): an insurance limit, typically the global quota divided by the number
    /// of nodes. Each node's in-process state starts empty at the outage and is kept
    /// across outages; it is not synchronised with Redis. (A quota the algorithm cannot
    /// hold in process — a window limit beyond its state word — denies as `Closed`.)
    Local(Quota),
}

/// The time source of the local limiters: the Redis limiter's caller clock, or a
/// monotonic one.
#[derive(Clone)]
pub(crate) enum LocalClock {
    Monotonic(MonotonicClock),
    Caller(Arc<dyn Clock>),
}

impl Clock for LocalClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        match self {
            Self::Monotonic(clock) => clock.now_ns(),
            Self::Caller(clock) => clock.now_ns(),
        }
    }
}

type Local = RateLimiter<String, LocalClock>;

/// The in-process limiters of [`FailMode::Local`], one per quota asked for, built on
/// first use (an outage's first check), kept for the next outage.
pub(crate) struct Fallbacks {
    algorithm: Algorithm,
    clock: LocalClock,
    name: Arc<str>,
    limiters: RwLock<Vec<(Quota, Arc<Local>)>>,
}

impl Fallbacks {
    pub(crate) fn new(algorithm: Algorithm, clock: LocalClock, name: Arc<str>) -> Self {
        Self {
            algorithm,
            clock,
            name,
            limiters: RwLock::new(Vec::new()),
        }
    }

    /// The decision `mode` gives a request of cost `n` for `key` when Redis cannot
    /// decide. `capacity` and `interval_ns` are the Redis quota's.
    pub(crate) fn decide(
        &self,
        mode: FailMode,
        key: &str,
        n: u64,
        capacity: u64,
        interval_ns: u64,
    ) -> Decision {
        match mode {
            FailMode::Open => Decision::allow(capacity, 0, 0),
            FailMode::Closed => Decision::deny(capacity, 0, 0, interval_ns.max(1)),
            FailMode::Local(quota) => match self.limiter(quota) {
                Some(local) => local.check_n(key, n).unwrap_or_else(|e| {
                    // The cost fits the Redis quota but not the insurance one: it can never
                    // pass locally, so deny it until Redis is back (one interval).
                    Decision::capacity_deny(e.capacity, interval_ns.max(1))
                }),
                None => Decision::deny(capacity, 0, 0, interval_ns.max(1)),
            },
        }
    }

    /// The local limiter for `quota`, built if new; `None` only if the algorithm cannot
    /// hold the quota (then the caller denies, as `Closed`).
    fn limiter(&self, quota: Quota) -> Option<Arc<Local>> {
        if let Some((_, l)) = self.limiters.read().iter().find(|(q, _)| *q == quota) {
            return Some(Arc::clone(l));
        }
        let mut limiters = self.limiters.write();
        if let Some((_, l)) = limiters.iter().find(|(q, _)| *q == quota) {
            return Some(Arc::clone(l));
        }
        let built = RateLimiter::builder(quota)
            .algorithm(self.algorithm)
            .name(&format!("{}-local", self.name))
            .clock(self.clock.clone())
            .build()
            .ok()?;
        let built = Arc::new(built);
        limiters.push((quota, Arc::clone(&built)));
        Some(built)
    }
}
