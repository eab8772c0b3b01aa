//! # tollgate
//!
//! An embedded, in-memory, sharded rate limiter for servers that check every request from
//! many threads at once.
//!
//! - Per-key state is one packed `AtomicU64` beside its key in a sharded open-addressing
//!   table; a check on an existing key is a hash, one probe and one CAS, with no lock, no
//!   fence and no heap allocation, and writes no shared word but the key's state. A denied
//!   check writes nothing. A table replaced by a resize or a quota change is freed as
//!   soon as every check in flight then has finished, whatever idle threads do. (The sliding log keeps a ring of timestamps per key, behind
//!   a shard read lock.)
//! - Time is integer nanoseconds from a monotonic clock ([`clock::MonotonicClock`], on
//!   quanta); there is no floating point on the check path.
//! - Every [`Decision`] says whether the request passed, the limit, what remains, when the
//!   key is back to full, and for a deny the exact, never-zero time to retry.
//!
//! ## Quick start
//!
//! ```
//! use tollgate::{Algorithm, Quota, RateLimiter};
//!
//! // 100 requests per second per key, with bursts of up to 200.
//! let limiter: RateLimiter<String> = RateLimiter::new(Quota::per_second(100)?.with_burst(200)?);
//!
//! let d = limiter.check("user_1024"); // &str lookup on a String-keyed limiter
//! if d.is_allowed() {
//!     // serve it; d.remaining() and d.reset_after() go in the response headers
//! } else {
//!     let _retry_after = d.retry_after(); // Some(exact wait), never zero
//! }
//!
//! // The sliding window counter, from a quota string.
//! let windows: RateLimiter<u64> = RateLimiter::builder("600/min".parse()?)
//!     .algorithm(Algorithm::SlidingWindow)
//!     .build()?;
//! assert!(windows.check(&42).is_allowed());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Choosing an algorithm
//!
//! See [`Algorithm`] for each algorithm's guarantee as a formula. The token bucket
//! ([`Algorithm::TokenBucket`], the default) allows short bursts and then a steady rate;
//! its decisions equal governor's GCRA. The sliding window counter
//! ([`Algorithm::SlidingWindow`]) smooths the fixed window's boundary burst in 8 bytes of
//! state; the sliding log is exact at 8 bytes per unit of limit; the leaky bucket shapes
//! traffic to a constant rate.
//!
//! ## Per-key quotas and live changes
//!
//! [`RateLimiter::set_quota`] gives one key its own quota and
//! [`RateLimiter::set_default_quota`] changes everyone else's while checks go on; a key's
//! consumed units carry over, so no change refills a key.
//!
//! ## Local, Redis or synced
//!
//! | tier | where a check runs | what all nodes admit in any interval `t` | cost |
//! |---|---|---|---|
//! | [`RateLimiter`] | in process | per node: `N` nodes admit up to `N ×` the quota | nanoseconds |
//! | `redis::RedisLimiter` (`redis`) | one Lua script in Redis per check | the quota, exactly | one round trip |
//! | `sync::SyncedLimiter` (`redis`, from `Builder::build_synced`), lease | in process, spending leased units | `r·t + B + r·H + 2·N` (token bucket) | nanoseconds |
//! | `sync::SyncedLimiter`, reconcile | in process; rounds charge what was admitted | `r·t + x`, `x` adding the overdrafts of one round (see `sync`) | nanoseconds |
//!
//! (`r` the rate, `B` the burst, `N` nodes, `H` twice the sync interval.)
//! The `sync` module documents the protocol, its bounds, and what happens while Redis is
//! away (the fallback policy).
//!
//! ## HTTP and gRPC
//!
//! With `tower`, `http::RateLimitLayer` limits any axum, hyper or tonic service: the
//! rate-limit headers on every response, a `429` with `Retry-After` (or a gRPC
//! `RESOURCE_EXHAUSTED` status with the same metadata for `application/grpc` calls),
//! request-aware keys of any type, exemptions, key checks, and leaky-bucket shaping.
//!
//! ## Metrics
//!
//! [`RateLimiter::stats`] counts allowed and denied decisions exactly (each thread into
//! counters of its own), and keys, evictions and refusals. With `metrics`, the same
//! totals (and the sync's rounds, fallback and nodes, and the Redis tier's errors) go to
//! the `metrics` facade as `tollgate_decisions_total`, `tollgate_keys`, … — see the table
//! in the README — labelled by the limiter's [`name`](Builder::name).
//!
//! ## Feature flags
//!
//! The default build is the local limiter alone. `tokio` adds the waiting API;
//! `redis` adds `redis` (exact global limits in Redis) and background sync (`tls` adds
//! `rediss://`); `tower` adds the HTTP layer in `http`, `axum` and `tonic` let it read
//! their connection info; `metrics` publishes to the `metrics` facade; `serde` makes
//! quotas and algorithms (de)serializable and adds `config::LimiterConfig`.
//!
//! ## Waiting instead of rejecting
//!
//! With the `tokio` feature, `until_ready`, `until_ready_n`, `until_ready_with_jitter`
//! and `acquire_timeout` wait for admission (and, for the leaky bucket, for the
//! request's slot) instead of rejecting.
//!
//! ## Testing with time
//!
//! Build the limiter with [`clock::ManualClock`] and move time by hand; nothing needs to
//! sleep:
//!
//! ```
//! use std::time::Duration;
//! use tollgate::clock::ManualClock;
//! use tollgate::RateLimiter;
//!
//! let clock = ManualClock::new();
//! let limiter: RateLimiter<u64, ManualClock> =
//!     RateLimiter::builder("1/s".parse()?).clock(clock.clone()).build()?;
//! assert!(limiter.check(&1).is_allowed());
//! assert_eq!(limiter.check(&1).retry_after(), Some(Duration::from_secs(1)));
//! clock.advance(Duration::from_secs(1));
//! assert!(limiter.check(&1).is_allowed());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

mod algorithm;
pub mod clock;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
mod decision;
mod error;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod http;
mod limiter;
mod observe;
mod quota;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod rng;
mod store;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod sync;
mod tally;
#[cfg(feature = "tokio")]
mod wait;

pub use algorithm::{
    Algorithm, FIXED_WINDOW_MAX_LIMIT, SLIDING_LOG_MAX_LIMIT, SLIDING_WINDOW_MAX_LIMIT,
};
pub use decision::Decision;
pub use error::{ConfigError, InsufficientCapacity};
pub use limiter::{Builder, Key, MAX_SHARDS, RateLimiter};
pub use quota::Quota;
pub use store::{StoreStats, WhenFull};
#[cfg(feature = "tokio")]
pub use wait::{AcquireError, Jitter};
