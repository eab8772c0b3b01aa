//! [`Builder::build_synced`]: builds a [`SyncedLimiter`] and starts its sync task.

use std::fmt;

use super::cell::SyncPolicy;
use super::limiter::SyncedLimiter;
use super::{RedisSync, SyncHandle};
use crate::algorithm::{Algorithm, Plan, Policy};
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::limiter::{Builder, Key};
use crate::quota::Quota;
use crate::store::{Limits, Store};

impl<K: Key, C: Clock> Builder<K, C> {
    /// Builds a [`SyncedLimiter`]: one limit held by every node sharing a Redis through a
    /// background sync (cargo feature `redis`), and starts the sync task on the current
    /// tokio runtime. See [`crate::sync`] for the modes, their bounds and what happens
    /// during outages. Keys are written to Redis with their `Display` form.
    ///
    /// # Errors
    /// As [`build`](Self::build); also [`ConfigError::Unsupported`] for an algorithm
    /// other than `TokenBucket` and `SlidingWindow`, [`ConfigError::NoRuntime`] outside
    /// a tokio runtime, and the Redis tier's quota limits.
    pub fn build_synced(
        self,
        sync: RedisSync,
    ) -> Result<(SyncedLimiter<K, C>, SyncHandle), ConfigError>
    where
        K: Clone + fmt::Display,
    {
        let (common, limits, quota) = self.into_parts()?;
        let capacity = supported(common.algorithm, quota)?;
        // Until the first round tells how many nodes share the limit, a new key waits for
        // its first lease (the sync task sets each key's share of a fresh capacity then).
        let interval_ns = super::driver::nanos(sync.interval);
        let policy = SyncPolicy::new(quota, capacity, 0, interval_ns);
        // Synced keys are dropped by the sync task once released; the cap still applies.
        let limits = Limits {
            sweep: false,
            ..limits
        };
        let limiter = SyncedLimiter::new(Store::new(limits, policy), common);
        #[cfg(feature = "metrics")]
        limiter.publish_every_second();
        let handle = super::task::start(limiter.clone(), sync)?;
        Ok((limiter, handle))
    }
}

/// The capacity of `quota` under `algorithm`, if the sync can hold it.
fn supported(algorithm: Algorithm, quota: Quota) -> Result<u64, ConfigError> {
    match Plan::new(algorithm, quota)? {
        Plan::Word(word)
            if matches!(algorithm, Algorithm::TokenBucket | Algorithm::SlidingWindow) =>
        {
            Ok(word.capacity())
        }
        _ => Err(ConfigError::Unsupported(
            "background sync supports token-bucket and sliding-window",
        )),
    }
}
