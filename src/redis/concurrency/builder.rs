//! Builds a [`RedisConcurrencyLimiter`]: the connection, the lease, the rate decided with
//! it, the first tier in front of Redis, and the tasks that stop with it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::{Counts, DEFAULT_LEASE, DenyCache, Inner, Rate, RedisConcurrencyLimiter, renew_leases};
use crate::algorithm::Algorithm;
use crate::clock::MonotonicClock;
use crate::concurrency::ConcurrencyLimiter;
use crate::error::ConfigError;
use crate::fail_mode::FailMode;
use crate::quota::Quota;
use crate::redis::breaker::{Breaker, CircuitBreaker};
use crate::redis::connection::Link;
use crate::redis::options::RedisOptions;
use crate::redis::script_quota::ScriptQuota;
use crate::redis::{DEFAULT_TIMEOUT, RedisError, scripts};

/// The shortest lease: renewals go every third of it, each bounded by the timeout.
const MIN_LEASE: Duration = Duration::from_millis(30);
/// How long a key found full is refused in process, unless set.
const DEFAULT_DENY_HOLD: Duration = Duration::from_millis(5);

/// Builds a [`RedisConcurrencyLimiter`]; from
/// [`RedisConcurrencyLimiter::builder`] and its siblings.
pub struct RedisConcurrencyBuilder {
    options: RedisOptions,
    max: u32,
    lease: Duration,
    name: Arc<str>,
    breaker: CircuitBreaker,
    fail_mode: FailMode,
    rate: Option<Quota>,
    deny_hold: Duration,
}

impl std::fmt::Debug for RedisConcurrencyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConcurrencyBuilder")
            .field("options", &self.options)
            .field("max", &self.max)
            .field("lease", &self.lease)
            .field("fail_mode", &self.fail_mode)
            .field("rate", &self.rate)
            .finish()
    }
}

impl RedisConcurrencyBuilder {
    pub(super) fn new(options: RedisOptions, max: u32) -> Self {
        Self {
            options,
            max,
            lease: DEFAULT_LEASE,
            name: "default".into(),
            breaker: CircuitBreaker::default(),
            fail_mode: FailMode::Closed,
            rate: None,
            deny_hold: DEFAULT_DENY_HOLD,
        }
    }

    crate::redis::options::option_setters!(
        keys: "<prefix>:cc:{<key>}` and `<prefix>:ccw:{<key>}` (and `<prefix>:tb:{<key>}` for a rate",
        timeout: "The deadline of each call (acquire, release, renewal), reconnection and retries included; 50 ms by default."
    );

    /// How long a slot is held after its last renewal: a holder that dies (or is cut off
    /// from Redis) gives its slots back this long after it last renewed them, at most.
    /// The limiter renews its permits' leases every third of it while it lives. At least
    /// 30 ms, and three timeouts; 30 s by default.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The limiter's name (metrics and logs).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// When to stop calling a failing Redis (as the Redis tier's).
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = breaker;
        self
    }

    /// What an acquire returns when Redis fails or the breaker is open: the error
    /// ([`FailMode::Closed`], the default), a permit that holds nothing
    /// ([`FailMode::Open`]), or a slot of an in-process limit of this node's share of
    /// the maximum, `⌊max / N⌋` (at least 1) for the `N` limiters counted on the prefix
    /// ([`FailMode::LocalShare`]). [`FailMode::Local`] is a rate and is refused at build.
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.fail_mode = mode;
        self
    }

    /// A token-bucket rate on the same keys, decided in the same script call: an
    /// acquire takes a slot and a unit of the rate both or neither. The rate's state is
    /// the Redis tier's token bucket key, `<prefix>:tb:{<key>}`, so a `RedisLimiter` with
    /// the same prefix and quota shares it.
    pub fn rate(mut self, quota: Quota) -> Self {
        self.rate = Some(quota);
        self
    }

    /// How long a key Redis found full is refused in process (no call) after, unless
    /// this process gives back one of its slots meanwhile; 5 ms by default, 0 to call
    /// every time. The cache can only refuse late, never admit: the limit holds exactly.
    pub fn deny_cache(mut self, hold: Duration) -> Self {
        self.deny_hold = hold;
        self
    }

    /// Connects, loads the scripts and starts the lease renewal.
    ///
    /// # Errors
    /// [`RedisError::Config`] for a setting out of range (prefix, timeout, lease, breaker,
    /// fail mode, rate); [`RedisError::Timeout`] or [`RedisError::Unavailable`] when Redis
    /// cannot be reached within the timeout.
    pub async fn build(self) -> Result<RedisConcurrencyLimiter, RedisError> {
        let invalid = |setting, value, expected| ConfigError::InvalidRedisSetting {
            setting,
            value,
            expected,
        };
        let (client, timeout) = self.options.validate(DEFAULT_TIMEOUT, invalid)?;
        self.breaker.validate()?;
        if self.lease < MIN_LEASE
            || self.lease < 3 * timeout
            || self.lease > Duration::from_secs(86_400)
        {
            return Err(ConfigError::InvalidRedisSetting {
                setting: "lease",
                value: format!("{:?}", self.lease),
                expected: "from 30ms (and three timeouts) to 1 day",
            }
            .into());
        }
        if matches!(self.fail_mode, FailMode::Local(_)) {
            return Err(ConfigError::Unsupported(
                "a concurrency limit's fail mode cannot be a rate: use FailMode::LocalShare",
            )
            .into());
        }
        let rate = match self.rate {
            Some(quota) => match ScriptQuota::new(Algorithm::TokenBucket, quota)? {
                ScriptQuota::TokenBucket { t, tau, burst } => Some(Rate { t, tau, burst }),
                ScriptQuota::Window { .. } | ScriptQuota::Calendar { .. } => None,
            },
            None => None,
        };
        let acquire = redis::Script::new(scripts::CONCURRENCY_ACQUIRE);
        let release = redis::Script::new(scripts::CONCURRENCY_RELEASE);
        let connect = async {
            let link = Link::connect(client.clone(), timeout).await?;
            if !self.options.target.is_cluster() {
                acquire.prepare_invoke().load_async(&mut link.get()).await?;
                release.prepare_invoke().load_async(&mut link.get()).await?;
            }
            Ok::<_, redis::RedisError>(link)
        };
        let link = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| RedisError::Timeout(timeout))?
            .map_err(|e| RedisError::from_redis(e, b""))?;
        let local = ConcurrencyLimiter::builder(self.max)
            .name(&self.name)
            .build()
            .map_err(RedisError::Config)?;
        let (running, stop) = tokio::sync::watch::channel(());
        let inner = Arc::new(Inner {
            link,
            acquire,
            release,
            prefix: self.options.prefix.clone(),
            hasher: self.options.hasher.clone(),
            timeout,
            lease: self.lease,
            default_max: AtomicU32::new(self.max),
            overrides: RwLock::new(Default::default()),
            rate,
            fail_mode: self.fail_mode,
            local,
            nodes: AtomicU64::new(1),
            breaker: Breaker::new(self.breaker),
            deny_cache: (!self.deny_hold.is_zero()).then(|| DenyCache {
                hold: self.deny_hold,
                until: Mutex::new(Default::default()),
            }),
            leases: Mutex::new(Default::default()),
            node: ahash::RandomState::new().hash_one(std::process::id()),
            next_id: AtomicU64::new(0),
            monotonic: MonotonicClock::new(),
            name: self.name,
            failing: AtomicBool::new(false),
            counts: Counts::default(),
        });
        tokio::spawn(renew_leases(
            Arc::downgrade(&inner),
            stop.clone(),
            self.lease / 3,
        ));
        // Every limiter subscribes, whatever its fail mode: the subscribers are how the
        // limiters sharing the prefix count each other.
        count_nodes(&inner, &client, timeout, stop).await?;
        #[cfg(feature = "metrics")]
        crate::observe::every_second(Arc::downgrade(&inner), |inner| {
            inner.stats();
        });
        Ok(RedisConcurrencyLimiter {
            inner,
            _running: Arc::new(running),
        })
    }
}

/// Counts the concurrency limiters sharing the prefix (the subscribers of a channel of
/// their own) now and every second, for [`FailMode::LocalShare`]'s share.
async fn count_nodes(
    inner: &Arc<Inner>,
    client: &crate::redis::connection::Client,
    timeout: Duration,
    stop: tokio::sync::watch::Receiver<()>,
) -> Result<(), RedisError> {
    use crate::redis::invalidate;
    let nodes = client.nodes(timeout)?;
    let channel = invalidate::channel(&format!("{}:cc:", inner.prefix));
    let first = match nodes.current().await.first() {
        Some(client) => invalidate::subscribe(client, &channel, timeout).await,
        None => None,
    };
    let counted = invalidate::count(&nodes, &channel, timeout).await;
    inner
        .nodes
        .store(counted.unwrap_or(1).max(1), Ordering::Relaxed);
    let weak = Arc::downgrade(inner);
    invalidate::spawn_counting(
        nodes.clone(),
        channel.clone(),
        timeout,
        stop.clone(),
        move |n| match weak.upgrade() {
            Some(inner) if !inner.breaker.is_open() => {
                inner.nodes.store(n.max(1), Ordering::Relaxed);
                true
            }
            Some(_) => true,
            None => false,
        },
    );
    // The subscription that makes this limiter counted, kept while it lives.
    invalidate::spawn(nodes, channel, timeout, first, stop, || {});
    Ok(())
}
