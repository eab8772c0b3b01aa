//! [`Builder::build_synced`]: builds a [`SyncedLimiter`] and starts its sync task.

use std::fmt;

use super::cell::SyncPolicy;
use super::limiter::SyncedLimiter;
use super::protocol::Shape;
use super::{RedisSync, SyncHandle};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::limiter::{Builder, Key};
use crate::store::{Limits, Store};

impl<K: Key, C: Clock> Builder<K, C> {
    /// Builds a [`SyncedLimiter`]: one limit held by every node sharing a Redis through a
    /// background sync (cargo feature `redis`), and starts the sync task on the current
    /// tokio runtime. See [`crate::sync`] for the modes, their bounds and what happens
    /// during outages. Keys are written to Redis with their `Display` form.
    ///
    /// # Errors
    /// As [`build`](Self::build); also [`ConfigError::Unsupported`] for the sliding log
    /// (its per-request timestamps cannot be leased out as counts),
    /// [`ConfigError::NoRuntime`] outside a tokio runtime, and the Redis tier's quota
    /// limits.
    pub fn build_synced(
        self,
        sync: RedisSync,
    ) -> Result<(SyncedLimiter<K, C>, SyncHandle), ConfigError>
    where
        K: Clone + fmt::Display,
    {
        let (common, limits, quota) = self.into_parts()?;
        let (shape, capacity) = Shape::with_capacity(common.algorithm, quota)?;
        // Until the first round tells how many nodes share the limit, a new key waits for
        // its first lease (the sync task sets each key's share of a fresh capacity then).
        let interval_ns = super::driver::nanos(sync.interval);
        let mut policy = SyncPolicy::new(quota, capacity, 0, interval_ns);
        policy.ticks = shape.ticks_per_token();
        if common.algorithm == Algorithm::LeakyBucket {
            // At the whole rate until the first round tells how many nodes share it
            // (nothing is admitted before it).
            policy.pace_ns = shape.ticks_per_token().saturating_mul(1_000);
        }
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
