//! The guide: one page per topic, each saying when to use what, what it guarantees, and
//! code that compiles (and runs, unless it needs a Redis server).
//!
//! | page | read it for |
//! |---|---|
//! | [`algorithms`] | which of the five algorithms to choose, and each one's bound as a formula |
//! | [`configuration`] | quotas, builder settings, per-key quotas, live changes, configuration files |
//! | [`concurrency`] | at most N requests in flight per key, in process and in Redis |
//! | [`plans`] | calendar periods (days, weeks, months, years, time zones) and the penalty box |
//! | [`waiting`] | throttling background work instead of rejecting it (`tokio`) |
//! | `http` | the tower layer for axum and hyper: keys, headers, exemptions, shaping (`tower`) |
//! | `grpc` | the same layer in front of tonic, answering `RESOURCE_EXHAUSTED` (`tower`) |
//! | `redis` | exact global limits in Redis, its first tier, fail modes, Cluster and secrets (`redis`) |
//! | `sync` | one limit across many nodes with local checks, and its bounds (`redis`) |
//! | [`observability`] | counters, the `metrics` names, `tracing` events and hooks |
//! | [`testing`] | deterministic tests with a manual clock, and the project's own test suite |
//!
//! The pages in code font need their cargo feature (docs.rs builds them all).
//!
//! # Which tier
//!
//! | tier | where a check runs | what all nodes admit in any interval `t` | cost |
//! |---|---|---|---|
//! | [`RateLimiter`](crate::RateLimiter) | in process | per node: `N` nodes admit up to `N ×` the quota | nanoseconds |
//! | `redis::RedisLimiter` | one Lua script in Redis per check | the quota, exactly | one round trip |
//! | `sync::SyncedLimiter`, lease mode | in process, spending leased units | at most `B + r·(t + 2I) + 2N` | nanoseconds |
//! | `sync::SyncedLimiter`, reconcile mode | in process; rounds charge what was admitted | at most `2B + r·(t + 5I + Δ) + 3N` | nanoseconds |
//!
//! (`r` the rate, `B` the burst, `N` the nodes, `I` the sync interval, `Δ` the round
//! timeout.)

pub mod algorithms {
    #![doc = include_str!("algorithms.md")]
}

pub mod configuration {
    #![doc = include_str!("configuration.md")]
}

pub mod concurrency {
    #![doc = include_str!("concurrency.md")]
}

pub mod plans {
    #![doc = include_str!("plans.md")]
}

pub mod waiting {
    #![doc = include_str!("waiting.md")]
}

#[cfg(feature = "tower")]
pub mod http {
    #![doc = include_str!("http.md")]
}

#[cfg(feature = "tower")]
pub mod grpc {
    #![doc = include_str!("grpc.md")]
}

#[cfg(feature = "redis")]
pub mod redis {
    #![doc = include_str!("redis.md")]
}

#[cfg(feature = "redis")]
pub mod sync {
    #![doc = include_str!("sync.md")]
}

pub mod observability {
    #![doc = include_str!("observability.md")]
}

pub mod testing {
    #![doc = include_str!("testing.md")]
}
