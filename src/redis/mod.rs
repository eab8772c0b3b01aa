//! The Redis tier (cargo feature `redis`): exact global limits with atomic server-side
//! scripts, on one Redis server or a Redis Cluster.
//!
//! [`RedisLimiter`] runs the same quotas and algorithms as the local
//! [`RateLimiter`](crate::RateLimiter) (`TokenBucket`, `SlidingWindow`, `FixedWindow`)
//! and returns the same [`Decision`](crate::Decision), so an HTTP layer cannot tell the
//! tiers apart. See [`RedisLimiter`] for when to use it.

pub(crate) mod connection;
mod error;
pub(crate) mod keys;
pub(crate) mod limiter;
#[cfg(any(test, feature = "test-support"))]
pub(crate) mod local_cluster;
#[cfg(any(test, feature = "test-support"))]
pub(crate) mod server;

pub use error::RedisError;
pub use limiter::{DEFAULT_TIMEOUT, FailMode, RedisBuilder, RedisLimiter, scripts};
