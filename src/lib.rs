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
//! ## The guide
//!
//! The [`guide`] has a page per topic, each with code that compiles: choosing an
//! [algorithm](guide::algorithms), [configuration](guide::configuration) (quotas,
//! per-key quotas, live changes, files), [waiting](guide::waiting) instead of rejecting,
//! the HTTP and gRPC layer, the Redis tier, the sync across nodes,
//! [observability](guide::observability) (the metric names) and
//! [testing](guide::testing).
//!
//! ## Local, Redis or synced
//!
//! One [`RateLimiter`] per process, `redis::RedisLimiter` for a limit held exactly in
//! Redis, or `sync::SyncedLimiter` for local checks that hold one global limit within a
//! bound: the guide's [tier table](guide#which-tier) compares
//! them (where a check runs, what all nodes admit, what a check costs).
//!
//! ## Feature flags
//!
//! | feature | adds |
//! |---|---|
//! | *(default)* | the local limiter alone |
//! | `tokio` | the waiting API (`until_ready`, `acquire_timeout`) and `clock::TokioClock` |
//! | `redis` | `redis` (exact global limits in Redis) and `sync` (local checks, one global limit); implies `tokio` |
//! | `tls` | `rediss://` URLs, with rustls |
//! | `tower` | the HTTP and gRPC layer, `http::RateLimitLayer` |
//! | `axum`, `tonic` | the layer reads their connection info (implies `tower`) |
//! | `metrics` | counters and gauges through the `metrics` facade |
//! | `tracing` | `tracing` events: denies at `debug` (never the key), failures at `warn` |
//! | `serde` | `Quota`, `Algorithm` and `WhenFull` (de)serialize; `config::LimiterConfig` |
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
pub mod calendar;
pub mod clock;
pub mod concurrency;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
mod decision;
mod error;
#[cfg(feature = "redis")]
mod fail_mode;
pub mod guide;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod http;
mod limiter;
mod observe;
mod penalty;
pub mod plans;
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

/// The README's examples, compiled (and the local one run) as doctests.
#[cfg(all(doctest, feature = "axum", feature = "redis"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
#[cfg(feature = "tokio")]
mod wait;

pub use algorithm::{
    Algorithm, FIXED_WINDOW_MAX_LIMIT, SLIDING_LOG_MAX_LIMIT, SLIDING_WINDOW_MAX_LIMIT,
};
pub use concurrency::{ConcurrencyError, ConcurrencyLimiter, Permit};
pub use decision::Decision;
pub use error::{ConfigError, InsufficientCapacity, SettleError};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use fail_mode::FailMode;
pub use limiter::{Builder, Key, MAX_SHARDS, RateLimiter};
pub use quota::Quota;
pub use store::{StoreStats, WhenFull};
#[cfg(feature = "tokio")]
pub use wait::{AcquireError, Jitter};
