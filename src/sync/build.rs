//! [`Builder::build_synced`]: builds a [`SyncedLimiter`] and starts its sync tasks.

use std::fmt;
use std::sync::Arc;

use super::cell::{SyncCell, SyncPolicy};
use super::limiter::SyncedLimiter;
use super::protocol::Shape;
use super::{RedisSync, SyncHandle};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::limiter::{Builder, Common, Key};
use crate::quota::Quota;
use crate::store::{Limits, Store, check_room};

impl<K: Key, C: Clock> Builder<K, C> {
    /// Builds a [`SyncedLimiter`]: one limit held by every node sharing a Redis through a
    /// background sync (cargo feature `redis`), and starts the sync task on the current
    /// tokio runtime. See [`crate::sync`] for the modes, their bounds and what happens
    /// during outages. Keys are written to Redis with their `Display` form.
    ///
    /// With [`also`](Self::also) quotas, each key is held to every quota, all or nothing
    /// (see [`crate::sync`]'s "Several quotas"): each quota is synced by a task of its
    /// own, under Redis keys of its own, and the returned handle stands for them all.
    ///
    /// # Errors
    /// As [`build`](Self::build); also [`ConfigError::Unsupported`] for the sliding log
    /// (its per-request timestamps cannot be leased out as counts),
    /// [`ConfigError::NoRuntime`] outside a tokio runtime, and the Redis tier's quota
    /// limits, for every quota. Nothing is started then.
    pub fn build_synced(
        self,
        sync: RedisSync,
    ) -> Result<(SyncedLimiter<K, C>, SyncHandle), ConfigError>
    where
        K: Clone + fmt::Display,
    {
        let (common, limits, quotas) = self.into_parts()?;
        // One store per quota, each sized for the expected keys.
        check_room(
            limits,
            Store::<K, SyncCell>::bytes_ahead(limits)
                .and_then(|bytes| bytes.checked_mul(quotas.len())),
        )?;
        let common = common.shared();
        // Every quota is checked before any task starts.
        for &quota in &quotas {
            Shape::with_capacity(common.algorithm, quota)?;
            sync.validate(quota.period_ns())?;
        }
        tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
        let mut also = Vec::with_capacity(quotas.len() - 1);
        let mut also_handles = Vec::with_capacity(quotas.len() - 1);
        for (i, &quota) in quotas.iter().enumerate().skip(1) {
            let part = RedisSync {
                quota_index: i,
                ..sync.clone()
            };
            let (limiter, handle) = start(common.for_quota(i), limits, quota, part, Vec::new())?;
            also.push(limiter);
            also_handles.push(handle);
        }
        let (limiter, handle) = start(common, limits, quotas[0], sync, also)?;
        #[cfg(feature = "metrics")]
        limiter.publish_every_second();
        Ok((limiter, handle.with_also(also_handles)))
    }
}

/// Builds the limiter of one quota (holding each key to the quotas of `also` too) and
/// starts its sync task.
fn start<K, C>(
    common: Common<Arc<C>>,
    limits: Limits,
    quota: Quota,
    sync: RedisSync,
    also: Vec<SyncedLimiter<K, C>>,
) -> Result<(SyncedLimiter<K, C>, SyncHandle), ConfigError>
where
    K: Key + Clone + fmt::Display,
    C: Clock,
{
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
    // Synced keys are dropped by the sync task's own sweep (a few keys a round, see
    // `node`) and once released, not by a full sweep of a table that fills; the cap
    // still applies.
    let limits = Limits {
        sweep: false,
        ..limits
    };
    let limiter = SyncedLimiter::new(Store::new(limits, policy), common, also);
    let handle = super::task::start(limiter.clone(), sync)?;
    Ok((limiter, handle))
}
