//! The configuration of a background sync, and its validation.

use std::fmt;
use std::time::Duration;

use crate::error::ConfigError;
pub use crate::fail_mode::FailMode;
use crate::redis::RedisOptions;
use crate::redis::connection::Client;

/// How nodes share a global limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SyncMode {
    /// Approximate: each node admits its lease and, beyond it, its fair share of what the
    /// global state has left, charged at its next round. See the
    /// [sync guide](crate::guide::sync) for the bound.
    #[default]
    Reconcile,
    /// Strict: each node spends only tokens it leased from the global state.
    Lease,
}

/// The configuration of a limiter's background sync. Start it with
/// [`Builder::build_synced`](crate::Builder::build_synced), which validates every
/// setting.
///
/// ```
/// use std::time::Duration;
/// use tollgate::sync::{RedisSync, SyncMode};
///
/// let sync = RedisSync::cluster(&["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"])
///     .prefix("api")
///     .mode(SyncMode::Lease)
///     .interval(Duration::from_millis(100))
///     .hash_keys(b"a secret shared by every node");
/// # let _ = sync;
/// ```
#[derive(Clone)]
pub struct RedisSync {
    pub(crate) options: RedisOptions,
    pub(crate) mode: SyncMode,
    pub(crate) interval: Duration,
    pub(crate) fail_mode: FailMode,
    pub(crate) staleness: Option<Duration>,
    pub(crate) node_ttl: Option<Duration>,
    pub(crate) idle_ttl: Option<Duration>,
    pub(crate) share_ttl: Duration,
    pub(crate) cold_keys: Option<bool>,
    pub(crate) batch_size: usize,
    pub(crate) round_keys: usize,
    pub(crate) require_connection: bool,
    pub(crate) shared_prefix: bool,
    /// Which of the limiter's quotas this sync holds: 0 for its own, `i` for its `i`th
    /// [`also`](crate::Builder::also) quota (whose Redis keys carry `+i` after the
    /// algorithm's tag).
    pub(crate) quota_index: usize,
}

impl fmt::Debug for RedisSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSync")
            .field("options", &self.options)
            .field("mode", &self.mode)
            .field("interval", &self.interval)
            .field("fail_mode", &self.fail_mode)
            .field("staleness", &self.staleness)
            .field("node_ttl", &self.node_ttl)
            .field("idle_ttl", &self.idle_ttl)
            .field("share_ttl", &self.share_ttl)
            .field("cold_keys", &self.cold_keys)
            .field("batch_size", &self.batch_size)
            .field("round_keys", &self.round_keys)
            .field("require_connection", &self.require_connection)
            .field("shared_prefix", &self.shared_prefix)
            .field("quota_index", &self.quota_index)
            .finish()
    }
}

/// The bounds every duration setting is checked against.
const MIN_INTERVAL: Duration = Duration::from_millis(1);
const MAX_INTERVAL: Duration = Duration::from_secs(60);
const MAX_WAIT: Duration = Duration::from_secs(3600);
const MAX_IDLE: Duration = Duration::from_secs(7 * 24 * 3600);
const MAX_BATCH: usize = 10_000;
const MAX_ROUND_KEYS: usize = 1_000_000;
/// How long a round may wait for Redis, by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);
/// How long Redis keeps a silent node's share reserved, by default.
const DEFAULT_SHARE_TTL: Duration = Duration::from_secs(10);
/// The default node TTL is never below this: a node that loses a few rounds in a row
/// must not drop out of the others' count (which sizes the local fallback's share).
const DEFAULT_MIN_NODE_TTL: Duration = Duration::from_secs(1);
/// The default staleness is never below this: a few lost rounds in a row must not put a
/// node in its fallback (which admits regardless of the global state), while a real
/// outage is still caught within half a second.
const DEFAULT_MIN_STALENESS: Duration = Duration::from_millis(500);

impl RedisSync {
    /// Sync through the Redis server at `url`, in [`SyncMode::Reconcile`], every 50 ms.
    pub fn new(url: &str) -> Self {
        Self::with_options(RedisOptions::new(url))
    }

    /// Sync through the Redis Cluster reached by the seed `nodes` (one live seed is
    /// enough to connect; a rebuilt connection also tries the nodes the cluster listed,
    /// so the seeds may die later; credentials are taken from the first URL), with the
    /// same settings and defaults as [`new`](Self::new). Each key's state lives in its
    /// own slot; a round sends each slot's keys in calls of their own, all at once, so
    /// the sync state and its traffic spread over the masters; the heartbeat is one more
    /// call.
    pub fn cluster(nodes: &[&str]) -> Self {
        Self::with_options(RedisOptions::cluster(nodes))
    }

    /// Sync through the primary that Redis Sentinel names `master_name`, found through
    /// the `sentinels` (`host:port`, or URLs that carry the sentinels' password), with
    /// the same settings and defaults as [`new`](Self::new). The data nodes' password is
    /// set with [`master_password`](Self::master_password). A round that fails for want
    /// of a server makes the task ask the sentinels again, so a failover needs no
    /// restart; the [sync guide](crate::guide::sync) gives the bound across one.
    ///
    /// ```no_run
    /// use tollgate::sync::{RedisSync, SyncMode};
    /// use tollgate::{Quota, RateLimiter};
    ///
    /// # #[tokio::main] async fn main() -> Result<(), tollgate::ConfigError> {
    /// let sync = RedisSync::sentinel(&["10.0.0.1:26379", "10.0.0.2:26379"], "mymaster")
    ///     .master_password("data-node-secret")
    ///     .mode(SyncMode::Lease);
    /// let (limiter, handle) =
    ///     RateLimiter::<String>::builder(Quota::per_second(1000).unwrap()).build_synced(sync)?;
    /// limiter.check("user:42");
    /// handle.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn sentinel(sentinels: &[&str], master_name: &str) -> Self {
        Self::with_options(RedisOptions::sentinel(sentinels, master_name))
    }

    /// Sync through the Redis that `options` reach, with their prefix, timeout (200 ms
    /// unless set), TLS roots and key hashing, and the same defaults as
    /// [`new`](Self::new) otherwise.
    pub fn with_options(options: RedisOptions) -> Self {
        Self {
            options,
            mode: SyncMode::Reconcile,
            interval: Duration::from_millis(50),
            fail_mode: FailMode::LocalShare,
            staleness: None,
            node_ttl: None,
            idle_ttl: None,
            share_ttl: DEFAULT_SHARE_TTL,
            cold_keys: None,
            batch_size: 500,
            round_keys: 2_000,
            require_connection: false,
            shared_prefix: false,
            quota_index: 0,
        }
    }

    /// [`SyncMode::Reconcile`] (the default) or [`SyncMode::Lease`].
    pub fn mode(mut self, mode: SyncMode) -> Self {
        self.mode = mode;
        self
    }

    /// How often the task syncs; 50 ms by default, from 1 ms to 60 s.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    crate::redis::options::option_setters!(
        keys: "<prefix>:sync:<algorithm>:{<key>}",
        timeout: "How long one round may wait for Redis; 200 ms by default (1 ms to 1 h)."
    );

    /// What checks do once Redis has been silent for the staleness; [`FailMode::LocalShare`]
    /// by default.
    pub fn fail_mode(mut self, fail_mode: FailMode) -> Self {
        self.fail_mode = fail_mode;
        self
    }

    /// How long without a successful round before the fallback applies; 3 intervals or
    /// 500 ms, whichever is longer, by default; at least one interval.
    pub fn staleness(mut self, staleness: Duration) -> Self {
        self.staleness = Some(staleness);
        self
    }

    /// How long a node's heartbeat counts in the number of nodes; 3 intervals or 1 s,
    /// whichever is longer, by default; at least one interval. (A node's demand counts
    /// for 3 intervals after its last round.)
    pub fn node_ttl(mut self, ttl: Duration) -> Self {
        self.node_ttl = Some(ttl);
        self
    }

    /// How long a key may go unused on this node before it gives its lease back and is
    /// dropped; by default 15 s or two periods of the quota, whichever is longer. Until
    /// then a key keeps a standing lease of at least one token, so that a key used
    /// rarely is admitted at once.
    pub fn idle_ttl(mut self, ttl: Duration) -> Self {
        self.idle_ttl = Some(ttl);
        self
    }

    /// How long after each round Redis keeps this node's share of each key reserved
    /// for it should it fall silent (cut off from Redis alone, or dead): 10 s by default,
    /// from 0 to 1 h. Meanwhile the other nodes share only the rest, and this node's
    /// [`FailMode::LocalShare`] admits at its share; then it gets a one-time budget and
    /// nothing more until Redis answers. Longer rides out longer Redis outages at the
    /// share rate; shorter returns a dead node's share to the others sooner (a dead node
    /// costs the others at most this long of its share). 0: no reservation (the fallback
    /// has only its budget).
    pub fn share_ttl(mut self, ttl: Duration) -> Self {
        self.share_ttl = ttl;
        self
    }

    /// Whether keys far from their limit stay **cold**: each node admits on such a key at
    /// its even share of the quota (`⌊burst / N⌋` at once, `rate / N` after; half of
    /// each for the window counters), locally, with no Redis traffic at all. A key whose
    /// share runs out on some node turns hot there, is announced to the other nodes
    /// (they turn it hot at their next round) and is synced from then on; it goes back
    /// to cold once it is released everywhere. Sync traffic is then proportional to the
    /// keys near their limit, not to the active keys. On by default in
    /// [`SyncMode::Reconcile`], off in [`SyncMode::Lease`] (whose bound it loosens by
    /// `r·(2.5·I + 2·Δ)` while a key turns hot, among other terms the
    /// [sync guide](crate::guide::sync) lists).
    /// Every node of a prefix must use the same setting. Off when a node's share of the
    /// burst is under one token.
    pub fn cold_keys(mut self, cold: bool) -> Self {
        self.cold_keys = Some(cold);
        self
    }

    /// The most keys sent in one script call; 500 by default (1 to 10,000). A round
    /// sends its keys in several calls, pipelined.
    pub fn batch_size(mut self, keys: usize) -> Self {
        self.batch_size = keys;
        self
    }

    /// The most keys one round sends; 2,000 by default (1 to 1,000,000). Keys that need
    /// a lease go first, then keys with something to report, then idle keys to release;
    /// the rest wait for the next round. A round that times out halves the next one's
    /// keys (down to 50), and every 8 successful rounds in a row add an eighth back, up
    /// to this most, so that a round too large for the timeout (a flood of keys on a
    /// loaded machine) does not fail for good.
    pub fn round_keys(mut self, keys: usize) -> Self {
        self.round_keys = keys;
        self
    }

    /// Whether `build_synced` fails when Redis cannot be reached (within the timeout)
    /// at start; false by default, where the limiter serves by its fallback until Redis
    /// answers and [`SyncStats`](super::SyncStats) says so.
    pub fn require_connection(mut self, require: bool) -> Self {
        self.require_connection = require;
        self
    }

    /// Lets several synced limiters of this process use the same prefix and algorithm,
    /// each as a node of its own (tests that run several nodes in one process). By
    /// default a second one is refused: it would share the first one's keys and count
    /// it as a node.
    pub fn allow_shared_prefix(mut self, allow: bool) -> Self {
        self.shared_prefix = allow;
        self
    }

    /// Checks every setting against the quota's period (ns).
    pub(crate) fn validate(&self, period_ns: u64) -> Result<Settings, ConfigError> {
        let invalid = |setting: &'static str, value: String, expected: &'static str| {
            ConfigError::InvalidSyncSetting {
                setting,
                value,
                expected,
            }
        };
        let setting = |name: &'static str, value: &dyn fmt::Debug, expected: &'static str| {
            invalid(name, format!("{value:?}"), expected)
        };
        if let FailMode::Local(_) = self.fail_mode {
            return Err(ConfigError::Unsupported(
                "FailMode::Local(quota) in the sync: its local fail mode is FailMode::LocalShare, \
                 this node's share of the quota",
            ));
        }
        let (client, timeout) = self.options.validate(DEFAULT_TIMEOUT, invalid)?;
        if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&self.interval) {
            return Err(setting("interval", &self.interval, "from 1ms to 60s"));
        }
        let interval = self.interval;
        let at_least_interval = |name, value: Option<Duration>, default: Duration| {
            let value = value.unwrap_or(default);
            if value < interval || value > MAX_WAIT {
                Err(setting(name, &value, "from the sync interval to 1h"))
            } else {
                Ok(value)
            }
        };
        let staleness = at_least_interval(
            "staleness",
            self.staleness,
            (interval * 3).max(DEFAULT_MIN_STALENESS),
        )?;
        let node_ttl = at_least_interval(
            "node_ttl",
            self.node_ttl,
            (interval * 3).max(DEFAULT_MIN_NODE_TTL),
        )?;
        let period = Duration::from_nanos(period_ns);
        let idle_default = Duration::from_secs(15).max(period.saturating_mul(2));
        let idle_ttl = self.idle_ttl.unwrap_or(idle_default);
        if idle_ttl < interval || idle_ttl > MAX_IDLE {
            return Err(setting(
                "idle_ttl",
                &idle_ttl,
                "from the sync interval to 7 days",
            ));
        }
        if self.share_ttl > MAX_WAIT {
            return Err(setting("share_ttl", &self.share_ttl, "from 0 to 1h"));
        }
        if !(1..=MAX_BATCH).contains(&self.batch_size) {
            return Err(setting("batch_size", &self.batch_size, "from 1 to 10,000"));
        }
        if !(1..=MAX_ROUND_KEYS).contains(&self.round_keys) {
            return Err(setting(
                "round_keys",
                &self.round_keys,
                "from 1 to 1,000,000",
            ));
        }
        Ok(Settings {
            client,
            timeout,
            staleness,
            node_ttl,
            idle_ttl,
            share_ttl: self.share_ttl,
        })
    }
}

/// What validation derives from a [`RedisSync`].
pub(crate) struct Settings {
    pub(crate) client: Client,
    /// The timeout of a round's calls.
    pub(crate) timeout: Duration,
    pub(crate) staleness: Duration,
    pub(crate) node_ttl: Duration,
    pub(crate) idle_ttl: Duration,
    pub(crate) share_ttl: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_checked() {
        let second = 1_000_000_000;
        let ok = RedisSync::new("redis://127.0.0.1:1/");
        assert!(ok.validate(second).is_ok());
        let bad = [
            ok.clone().interval(Duration::ZERO),
            ok.clone().interval(Duration::from_secs(u64::MAX / 4)),
            ok.clone().staleness(Duration::from_micros(1)),
            ok.clone().node_ttl(Duration::from_secs(86_400)),
            ok.clone().idle_ttl(Duration::ZERO),
            ok.clone().timeout(Duration::ZERO),
            ok.clone().batch_size(0),
            ok.clone().round_keys(0),
            ok.clone().prefix("a{b}"),
            RedisSync::new("not-a-url"),
        ];
        for config in bad {
            let err = config.validate(second).err().expect("refused");
            assert!(!err.to_string().is_empty());
        }
        let err = RedisSync::new("not-a-url").validate(second).err().unwrap();
        assert!(matches!(err, ConfigError::InvalidRedisUrl { .. }), "{err}");
    }

    #[test]
    fn the_sync_takes_every_fail_mode_but_a_fixed_local_quota() {
        let second = 1_000_000_000;
        let ok = RedisSync::new("redis://127.0.0.1:1/");
        assert_eq!(ok.fail_mode, FailMode::LocalShare, "the default");
        for mode in [FailMode::Open, FailMode::Closed, FailMode::LocalShare] {
            assert!(
                ok.clone().fail_mode(mode).validate(second).is_ok(),
                "{mode:?}"
            );
        }
        let local = FailMode::Local("10/s".parse().unwrap());
        let err = ok.fail_mode(local).validate(second).err().expect("refused");
        let ConfigError::Unsupported(why) = err else {
            panic!("{err}");
        };
        assert!(why.contains("LocalShare"), "{why}");
    }
}
