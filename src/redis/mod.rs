//! The Redis tier (cargo feature `redis`): exact global limits with atomic server-side
//! scripts, on one Redis server or a Redis Cluster.
//!
//! [`RedisLimiter`] runs the same quotas and algorithms as the local
//! [`RateLimiter`](crate::RateLimiter) (`TokenBucket`, `SlidingWindow`, `FixedWindow`)
//! and returns the same [`Decision`](crate::Decision), so an HTTP layer cannot tell the
//! tiers apart. In front of Redis it keeps a local first tier: a cache of denies (a
//! limited client costs about one call per retry interval), a circuit breaker (an
//! outage costs microseconds per check, not a timeout) and an insurance limit
//! ([`FailMode::Local`]). See [`RedisLimiter`] for when to use it.

mod breaker;
mod concurrency;
pub(crate) mod connection;
mod deny_cache;
pub(crate) mod error;
mod fallback;
mod invalidate;
pub(crate) mod keys;
pub(crate) mod limiter;
mod observe;
pub(crate) mod options;
pub(crate) mod script_quota;
pub mod scripts;
pub(crate) mod sentinel;

pub use breaker::{BreakerState, CircuitBreaker};
pub use concurrency::{
    DEFAULT_LEASE, PermitError, RedisConcurrencyBuilder, RedisConcurrencyLimiter,
    RedisConcurrencyStats, RedisPermit,
};
pub use error::{RedisCause, RedisError};
pub use fallback::FailMode;
pub use limiter::{
    DEFAULT_DENY_CACHE_KEYS, DEFAULT_TIMEOUT, RedisBuilder, RedisLimiter, RedisStats,
};
pub use options::RedisOptions;
