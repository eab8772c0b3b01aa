//! The Redis tier (cargo feature `redis`): exact global limits with atomic server-side
//! scripts.
//!
//! [`RedisLimiter`] runs the same quotas and algorithms as the local
//! [`RateLimiter`](crate::RateLimiter) (`TokenBucket`, `SlidingWindow`, `FixedWindow`)
//! and returns the same [`Decision`](crate::Decision), so an HTTP layer cannot tell the
//! tiers apart. See [`RedisLimiter`] for when to use it.

mod error;
pub(crate) mod limiter;
mod server;

pub use error::RedisError;
pub use limiter::{DEFAULT_TIMEOUT, FailMode, RedisBuilder, RedisLimiter, scripts};
pub use server::LocalRedis;
