//! What a node runs by: derived once from the limiter's validated configuration.

use std::fmt::Display;

use super::super::agree::Terms;
use super::super::cell::{Cold, SyncPolicy};
use super::super::config::{FailMode, RedisSync, Settings, SyncMode};
use super::super::driver::{MAX_BACKOFF, Timing, micros, millis, nanos};
use super::super::key::NodeParams;
use super::super::protocol::{Params, Shape};
use crate::algorithm::Algorithm;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::redis::keys::{KeyHasher, write_key};

/// Everything a node's rounds run by, derived once from a validated configuration.
#[derive(Clone, Debug)]
pub(crate) struct NodeConfig {
    /// The node id it heartbeats under (shown as 16 hex digits).
    pub(crate) id: u64,
    /// The limiter's algorithm (a key's own quota is for it).
    pub(crate) algorithm: Algorithm,
    pub(crate) fail_mode: FailMode,
    /// What every round tells Redis.
    pub(crate) params: Params,
    /// What the node side of every key's round uses.
    pub(crate) node_params: NodeParams,
    /// The schedule.
    pub(crate) timing: Timing,
    /// How long (ns) a round waits for its replies.
    pub(crate) timeout_ns: u64,
    /// How long (ms) a node stays in the registry without a heartbeat.
    pub(crate) registry_ttl_ms: u64,
    /// The registry's Redis key, and the prefix of every limiter key's.
    pub(crate) registry: Vec<u8>,
    pub(crate) key_prefix: Vec<u8>,
    /// Keys are written to Redis as this digest, when set.
    pub(crate) hasher: Option<KeyHasher>,
    /// Redis Cluster: a call's keys share a slot.
    pub(crate) cluster: bool,
    pub(crate) batch_size: usize,
    pub(crate) round_keys: usize,
    /// The cold tier, if on.
    pub(crate) cold: Option<ColdTier>,
    /// What every node of the prefix must sync by, and the prefix's hash of them.
    pub(crate) terms: Terms,
    pub(crate) terms_key: Vec<u8>,
}

/// The cold tier's settings (see [`RedisSync::cold_keys`]).
#[derive(Clone, Debug)]
pub(crate) struct ColdTier {
    /// The announcements of keys turned hot: a sorted set, `{prefix}:sync:tag:hot`.
    pub(crate) key: Vec<u8>,
    /// How long (ms) an announcement lasts unless renewed; a node renews the
    /// announcement of a key it keeps hot once half of it is left.
    pub(crate) lifetime_ms: u64,
    /// How long (ns) after it last read the announcements a node may admit on its cold
    /// keys: `share_ttl` (at least the staleness), as its reserved share in the fallback.
    pub(crate) valid_ns: u64,
    /// A window counter's cold share is half a burst and half the rate.
    pub(crate) windowed: bool,
}

impl NodeConfig {
    /// The node `id` of a limiter of `algorithm` and `quota` (of capacity `capacity`),
    /// synced by `config` (validated into `settings`).
    ///
    /// # Errors
    /// [`ConfigError::Unsupported`] for the sliding log, and the Redis tier's quota
    /// errors.
    pub(crate) fn new(
        id: u64,
        config: &RedisSync,
        settings: &Settings,
        algorithm: Algorithm,
        quota: Quota,
        capacity: u64,
    ) -> Result<Self, ConfigError> {
        let shape = Shape::new(algorithm, quota)?;
        // The leaky bucket's global state is the token bucket's, under keys of its own.
        let tag = match algorithm {
            Algorithm::LeakyBucket => "lb",
            _ => shape.script_args().0,
        };
        // An `also` quota's keys: `<tag>+<i>`, beside the limiter's own.
        let tag = match config.quota_index {
            0 => tag.to_owned(),
            i => format!("{tag}+{i}"),
        };
        let prefix = &config.options.prefix;
        let interval_us = micros(config.interval);
        let hold = interval_us * 2;
        let reconcile = config.mode == SyncMode::Reconcile;
        let valid = settings.share_ttl.max(settings.staleness);
        let cold = config.cold_keys.unwrap_or(reconcile).then(|| ColdTier {
            key: format!("{{{prefix}}}:sync:{tag}:hot").into_bytes(),
            lifetime_ms: millis(valid.saturating_mul(4)).max(10_000),
            valid_ns: nanos(valid),
            windowed: shape.period().is_some(),
        });
        Ok(Self {
            id,
            algorithm,
            fail_mode: config.fail_mode,
            params: Params {
                shape,
                overdraft_horizon: if reconcile { hold } else { 0 },
                hold,
                demand_ttl: interval_us * 3,
                retain_ms: millis(settings.idle_ttl) * 2 + 10_000,
                share_ttl: micros(settings.share_ttl),
                // The staleness and one round's timeout: a node that lost one round is
                // not silent (what its fallback admits meanwhile is charged when it
                // reports).
                silent_after: micros(settings.staleness).saturating_add(micros(settings.timeout)),
            },
            node_params: NodeParams {
                ticks: shape.ticks_per_token(),
                capacity,
                interval_ns: interval_us * 1_000,
                hold_us: hold,
                idle_ns: nanos(settings.idle_ttl),
                reconcile,
                demand_tau_us: (quota.period_ns() / 1_000).clamp(1_000_000, 60_000_000),
                timeout_ns: nanos(settings.timeout),
                // Set per round, by the node count (see `Node::start_round`).
                use_tau_us: 0,
            },
            timing: Timing {
                interval_ns: nanos(config.interval),
                staleness_ns: nanos(settings.staleness),
                max_backoff_ns: nanos(MAX_BACKOFF),
            },
            timeout_ns: nanos(settings.timeout),
            registry_ttl_ms: millis(settings.node_ttl).max(1),
            registry: format!("{{{prefix}}}:sync:{tag}:nodes").into_bytes(),
            key_prefix: format!("{prefix}:sync:{tag}:").into_bytes(),
            hasher: config.options.hasher.clone(),
            cluster: config.options.target.is_cluster(),
            batch_size: config.batch_size,
            round_keys: config.round_keys,
            cold,
            terms: Terms::new(config, algorithm, quota),
            terms_key: format!("{{{prefix}}}:sync:settings").into_bytes(),
        })
    }

    /// The Redis key of `key`'s state: `prefix:sync:tag:{key}`, or its digest.
    pub(crate) fn redis_key<K: Display>(&self, key: &K) -> Vec<u8> {
        let key = key.to_string();
        let mut out = Vec::with_capacity(self.key_prefix.len() + key.len().max(34) + 2);
        out.extend_from_slice(&self.key_prefix);
        out.push(b'{');
        write_key(self.hasher.as_ref(), key.as_bytes(), &mut out);
        out.push(b'}');
        out
    }

    /// The cold share's ns per token among `nodes` nodes (the rate's, when unknown).
    pub(super) fn cold_t_ns(&self, nodes: u64) -> u64 {
        let windowed = self.cold.as_ref().is_some_and(|c| c.windowed);
        Cold::t_ns(self.node_params.ticks, nodes, windowed)
    }

    /// The limiter's policy for a node that has not heard Redis yet: with the cold tier,
    /// new keys start cold and wait for the first read of the keys turned hot (as a new
    /// key waits for its first lease without it).
    pub(crate) fn initial_policy(&self, policy: SyncPolicy) -> SyncPolicy {
        match self.cold {
            Some(_) => SyncPolicy {
                cold: Some(Cold::unvouched()),
                ..policy
            },
            None => policy,
        }
    }
}
