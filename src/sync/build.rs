//! [`Builder::build_synced`]: builds a [`SyncedLimiter`], checks its terms against the
//! prefix's other nodes, and starts its sync tasks.

use std::fmt::{self, Display};
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::agree;
use super::cell::{SyncCell, SyncPolicy};
use super::driver;
use super::limiter::SyncedLimiter;
use super::node::{Node, NodeConfig};
use super::protocol::Shape;
use super::task::{self, Io, PrefixGuard};
use super::transport::Transport;
use super::wire::{SettingsCall, SettingsReply};
use super::{RedisSync, SyncHandle, TaskShared};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::limiter::{Builder, Common, Key};
use crate::quota::Quota;
use crate::redis::scripts::SYNC_SETTINGS;
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
    let handle = start_task(limiter.clone(), sync)?;
    Ok((limiter, handle))
}

/// Validates `config` for the limiter's algorithm and spawns the task for `limiter`.
fn start_task<K, C>(
    limiter: SyncedLimiter<K, C>,
    config: RedisSync,
) -> Result<SyncHandle, ConfigError>
where
    K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    C: Clock,
{
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
    let algorithm = limiter.algorithm();
    let quota = limiter.quota();
    let settings = config.validate(quota.period_ns())?;
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seed = (
        std::process::id(),
        STARTED.fetch_add(1, Ordering::Relaxed),
        SystemTime::now(),
    );
    let id = ahash::RandomState::new().hash_one(seed);
    let node_config = NodeConfig::new(
        id,
        &config,
        &settings,
        algorithm,
        quota,
        limiter.quota_capacity(),
    )?;
    let quota_part = match config.quota_index {
        0 => String::new(),
        i => format!(", quota {i}"),
    };
    let guard = PrefixGuard::claim(
        format!(
            "prefix {:?} with {}{quota_part}",
            config.options.prefix,
            algorithm.name()
        ),
        config.shared_prefix,
    )?;
    if config.require_connection {
        // Reaches Redis, and reads the terms the prefix's other nodes sync by (writing
        // none: the node's first round writes its own).
        let call = SettingsCall {
            field: node_config.terms.field(id),
            terms: String::new(),
            stale_ms: agree::STALE_MS,
        };
        let mut read = redis::cmd("EVAL");
        read.arg(SYNC_SETTINGS)
            .arg(1)
            .arg(&node_config.terms_key)
            .arg(call.encode());
        let reply = settings
            .client
            .query_blocking(settings.timeout, &read)
            .map_err(|e| {
                crate::redis::sentinel::master_unknown(&e).unwrap_or_else(|| {
                    ConfigError::RedisUnreachable {
                        url: config.options.target.redacted(),
                        reason: config.options.target.scrub(&e.to_string()),
                    }
                })
            })?;
        if let Ok(read) = SettingsReply::decode(&reply) {
            if let Some(d) = node_config.terms.differ(id, &read.entries) {
                return Err(ConfigError::SyncSettingsDiffer {
                    setting: d.setting,
                    ours: d.ours,
                    theirs: d.theirs,
                });
            }
        }
    }
    let store = limiter.store();
    store.set_policy(node_config.initial_policy(store.default_policy()), 0);
    let shared = Arc::new(TaskShared::default());
    let now = limiter.clock().now_ns();
    let node = Node::new(node_config, driver::seed(id), now);
    let for_run = limiter.clone();
    let io = Io {
        name: Arc::from(limiter.name()),
        transport: Arc::new(Transport::new(settings, config.options.target.clone())),
        config,
        shared: Arc::clone(&shared),
        // `limiter` and `for_run`: every clone but the caller's (`build_synced` keeps
        // one, which it returns).
        own_handles: limiter.handles() - 1,
    };
    let handle = runtime.spawn(task::supervise(Arc::new(io), node, limiter, for_run, guard));
    Ok(SyncHandle {
        name: format!("tollgate-sync-{id:016x}"),
        shared,
        task: Some(handle),
        also: Vec::new(),
    })
}
