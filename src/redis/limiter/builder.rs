//! `RedisBuilder`: the Redis tier's settings, and the build that connects and starts the
//! limiter's background tasks.

use super::*;
use crate::penalty::Penalty;
use crate::redis::connection::{Client, Nodes};

/// Configures a [`RedisLimiter`]. Made by [`RedisLimiter::builder`] (one server),
/// [`RedisLimiter::cluster_builder`] (Redis Cluster) or
/// [`RedisLimiter::sentinel_builder`] (Redis Sentinel).
#[must_use = "a builder does nothing until .build() is awaited"]
pub struct RedisBuilder {
    pub(super) options: RedisOptions,
    pub(super) quota: Quota,
    pub(super) algorithm: Algorithm,
    pub(super) clock: Option<Arc<dyn Clock>>,
    pub(super) name: Arc<str>,
    pub(super) deny_cache: bool,
    pub(super) deny_cache_keys: usize,
    pub(super) breaker: CircuitBreaker,
    pub(super) also: Vec<Quota>,
    pub(super) block_for: Option<Duration>,
    pub(super) block_after: Option<(u32, Duration)>,
    pub(super) penalty_box: bool,
    pub(super) default_plan: Option<String>,
    pub(super) plans: Vec<(String, Vec<Quota>)>,
    pub(super) plan_resolver: Option<plans::PlanResolver>,
    pub(super) keep_plan_answers: Option<Duration>,
}

impl fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("options", &self.options)
            .field("quota", &self.quota)
            .field("also", &self.also)
            .field("algorithm", &self.algorithm)
            .field("caller_clock", &self.clock.is_some())
            .field("name", &self.name)
            .field("local_deny_cache", &self.deny_cache)
            .field("deny_cache_keys", &self.deny_cache_keys)
            .field("circuit_breaker", &self.breaker)
            .field("block_for", &self.block_for)
            .field("block_after", &self.block_after)
            .field("penalty_box", &self.penalty_box)
            .field("default_plan", &self.default_plan)
            .field("plans", &self.plans)
            .field("plan_resolver", &self.plan_resolver.is_some())
            .field("keep_plan_answers", &self.keep_plan_answers)
            .finish()
    }
}

impl RedisBuilder {
    /// Names the limiter, for metrics (the `limiter` label) and logs; `"default"`
    /// unless set.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// `TokenBucket` (the default), `SlidingWindow` or `FixedWindow`.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Holds every key to `quota` as well, all or nothing, as
    /// [`Builder::also`](crate::Builder::also) does in process: a check is admitted only
    /// if every quota admits it, and then consumes from each; a denied check consumes
    /// from none. For example `"10/s burst 20"` and `"1000/day"`. Call it again for a
    /// third quota.
    ///
    /// **One round trip.** All the quotas of a key are decided in one script call: each
    /// keeps its state in a Redis key of its own (`<prefix>:<algorithm>+<i>:{<key>}` for
    /// the `i`-th `also` quota, see [`redis_keys`](RedisLimiter::redis_keys)), and all of
    /// them carry the key's hash tag, so on Redis Cluster they share one slot and the
    /// script is atomic there too.
    ///
    /// The [`Decision`] describes the most constraining quota ([`Decision::policy`]
    /// says which): for an admission, the one with the fewest units left; for a deny,
    /// the denying one with the longest wait, with the fewest units left of all. The
    /// decisions are those of the in-process limiter with the same quotas (tests hold
    /// the two to each other on random timelines).
    /// [`set_default_quota`](RedisLimiter::set_default_quota) changes the first quota;
    /// the `also` quotas stay. [`charge`](RedisLimiter::charge) and
    /// [`refund`](RedisLimiter::refund) settle every quota, and
    /// [`FailMode::LocalShare`] shares each.
    ///
    /// A quota's state is found by its place in the list: give every node the quotas
    /// in the same order. Reordering them on a restart reads each state under another
    /// quota, as [`set_default_quota`](RedisLimiter::set_default_quota) does.
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = RedisLimiter::builder("redis://127.0.0.1/", "10/s burst 20".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build()
    ///     .await?;
    /// let decision = limiter.check("tenant-a").await?; // one script call, both quotas
    /// if !decision.is_allowed() {
    ///     let which = ["burst", "daily"][decision.policy()];
    ///     println!("{which} limit: retry in {:?}", decision.retry_after());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn also(mut self, quota: Quota) -> Self {
        self.also.push(quota);
        self
    }

    crate::redis::options::option_setters!(
        keys: "<prefix>:<algorithm>:{<key>}",
        timeout: "How long a check may take before it fails with [`RedisError::Timeout`] \
                  (from 1 ms to 1 h; 50 ms by default): a deadline from the moment `check` \
                  is called, waiting for another request's call, reconnection and retries \
                  included. It also bounds the first connection."
    );

    /// Take "now" from the caller's `clock` (truncated to microseconds) instead of the
    /// Redis server's `TIME`. Tests use this with a `ManualClock` for determinism; in
    /// production, the server's clock is the one all nodes agree on. Either way, time
    /// never goes backwards in the stored state: a GCRA state never moves back, and a
    /// window state ahead of the given time is read at its own window's start.
    pub fn caller_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Whether to answer repeated denies in process (on by default): after Redis denies
    /// a unit request for a key, the same request is denied locally, with no round trip,
    /// until the instant Redis said it could pass. The cached decision is the one Redis
    /// would give (denies write nothing, and nothing but a reset or a quota change can
    /// admit sooner), so an abusive client costs about one Redis call per retry
    /// interval instead of one per request. See [`RedisLimiter`] for the details and the
    /// one caveat (resets made by other nodes).
    pub fn local_deny_cache(mut self, on: bool) -> Self {
        self.deny_cache = on;
        self
    }

    /// The most keys the deny cache holds (100,000 by default); expired entries are
    /// swept as new ones come, and when it is full, the entry nearest its expiry makes
    /// room. Each entry keeps a copy of its key. Only denied keys take an entry.
    pub fn deny_cache_max_keys(mut self, max_keys: usize) -> Self {
        self.deny_cache_keys = max_keys;
        self
    }

    /// The circuit breaker ([`CircuitBreaker::default`]: open after 3 consecutive
    /// failures within 1 s); [`CircuitBreaker::disabled`] turns it off.
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = breaker;
        self
    }

    /// A penalty box in Redis, as [`Builder::block_for`](crate::Builder::block_for) in
    /// process: a key that a check's quota denies is then blocked for `duration`, on
    /// every node (each check denied, retry at the block's end, nothing consumed). With
    /// [`block_after`](Self::block_after), only after several denies.
    ///
    /// The block is one Redis key with a TTL beside the key's state
    /// (`<prefix>:<algorithm>:box:{<key>}`, same hash tag, so same slot), read and
    /// written by the check's own script call: no second round trip. A node's deny
    /// cache holds a block it learned until the block ends, for requests of every cost,
    /// so a blocked key costs that node no Redis call. While denies only count toward a
    /// block, the cache keeps none of them: each must reach Redis to be counted.
    ///
    /// Implies [`penalty_box(true)`](Self::penalty_box). The fail modes' local
    /// decisions do not see blocks.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let logins = RedisLimiter::builder("redis://127.0.0.1/", "5/min".parse()?)
    ///     .block_for(Duration::from_secs(600))
    ///     .block_after(3, Duration::from_secs(60))
    ///     .build()
    ///     .await?;
    /// let denied = logins.check("mallory").await?;
    /// println!("retry in {:?}", denied.retry_after());
    /// # Ok(())
    /// # }
    /// ```
    pub fn block_for(mut self, duration: Duration) -> Self {
        self.block_for = Some(duration);
        self
    }

    /// With [`block_for`](Self::block_for): block a key only once it is denied `denies`
    /// times within `within` of the first of them, counted in Redis across every node.
    pub fn block_after(mut self, denies: u32, within: Duration) -> Self {
        self.block_after = Some((denies, within));
        self
    }

    /// Whether checks read the penalty box (off by default; on with
    /// [`block_for`](Self::block_for)): needed for an operator's
    /// [`RedisLimiter::block`] to deny anything. Every node sharing the prefix must read
    /// it. It costs each check one more key read in its script call.
    pub fn penalty_box(mut self, on: bool) -> Self {
        self.penalty_box = on;
        self
    }

    /// Names the plan of the limiter's own quotas (the builder's and its
    /// [`also`](Self::also) quotas): the plan of every key no assignment or resolver
    /// puts on another. `"default"` unless set.
    pub fn default_plan(mut self, name: &str) -> Self {
        self.default_plan = Some(name.to_owned());
        self
    }

    /// Defines the plan `name`: its quotas, all or nothing, as a key on it is held to
    /// them (the first, then the others as [`also`](Self::also) quotas), with the
    /// limiter's algorithm. Each check sends its key's plan's quotas as the script's
    /// arguments, so one script and one connection serve every plan, and every node
    /// holds a key to the same plan's quotas in Redis. Quota `i` of every plan keeps its
    /// counts in the key's `i`-th Redis key ([`redis_keys`](RedisLimiter::redis_keys)):
    /// a key moved to a plan whose quota `i` has the same period keeps what it used.
    /// A key's plan is, in order: this node's [`assign`](RedisLimiter::assign)ment; the
    /// [`plan_resolver`](Self::plan_resolver)'s answer, kept; the
    /// [`default_plan`](Self::default_plan).
    ///
    /// ```no_run
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let api = RedisLimiter::builder("redis://127.0.0.1/", "60/min".parse()?)
    ///     .also("10000/month calendar".parse()?)
    ///     .algorithm(tollgate::Algorithm::SlidingWindow)
    ///     .default_plan("free")
    ///     .plan("pro", ["600/min".parse()?, "1000000/month calendar".parse()?])
    ///     .plan_resolver(|key| key.starts_with("pro_").then(|| "pro".to_owned()))
    ///     .build()
    ///     .await?;
    /// assert_eq!(api.check("pro_7f3a").await?.limit(), 600);
    /// assert_eq!(api.check("anon").await?.limit(), 60);
    /// # Ok(())
    /// # }
    /// ```
    pub fn plan(mut self, name: &str, quotas: impl IntoIterator<Item = Quota>) -> Self {
        self.plans
            .push((name.to_owned(), quotas.into_iter().collect()));
        self
    }

    /// Finds a key's plan the first time this node checks it: a name (a plan not
    /// defined is logged and counted as the default), or `None` for the default. The
    /// answer is kept for [`keep_plan_answers_for`](Self::keep_plan_answers_for) (for
    /// ever unless set), so the resolver runs once per key, called with no lock held.
    pub fn plan_resolver<F>(mut self, resolver: F) -> Self
    where
        F: Fn(&str) -> Option<String> + Send + Sync + 'static,
    {
        self.plan_resolver = Some(Box::new(resolver));
        self
    }

    /// How long a resolver's answer is kept before it is asked again.
    pub fn keep_plan_answers_for(mut self, keep: Duration) -> Self {
        self.keep_plan_answers = Some(keep);
        self
    }

    /// Validates the configuration, connects (with automatic reconnection; on a cluster,
    /// to the seed nodes, learning the slot map) and, on one server, loads the script.
    ///
    /// # Errors
    /// [`RedisError::Config`] or [`RedisError::UnsupportedAlgorithm`] for a
    /// configuration the scripts cannot run; [`RedisError::Timeout`] or
    /// [`RedisError::Unavailable`] when Redis cannot be reached within the timeout.
    pub async fn build(mut self) -> Result<RedisLimiter, RedisError> {
        let (rule, also) = self.script_quotas()?;
        let (client, timeout) = self.validate()?;
        let plans = plans::PlanSettings {
            default_name: self.default_plan.take(),
            plans: std::mem::take(&mut self.plans),
            resolver: self.plan_resolver.take(),
            keep_answers: self.keep_plan_answers,
            max_keys: self.deny_cache_keys,
        }
        .table(self.algorithm, &self.options.prefix)?;
        let penalty = Penalty::from_settings(self.block_for, self.block_after)?;
        let boxed = penalty.is_some() || self.penalty_box;
        let source = match (self.algorithm, boxed) {
            (Algorithm::TokenBucket, false) => scripts::TOKEN_BUCKET,
            (Algorithm::TokenBucket, true) => scripts::TOKEN_BUCKET_PENALIZED,
            (Algorithm::SlidingWindow, false) => scripts::SLIDING_WINDOW,
            (Algorithm::SlidingWindow, true) => scripts::SLIDING_WINDOW_PENALIZED,
            (_, false) => scripts::FIXED_WINDOW,
            (_, true) => scripts::FIXED_WINDOW_PENALIZED,
        };
        let script = redis::Script::new(source);
        let connection = self.connect(&client, &script, timeout).await?;
        let prefix = format!("{}:{}:", self.options.prefix, short_name(self.algorithm));
        let local_clock = match &self.clock {
            Some(clock) => LocalClock::Caller(Arc::clone(clock)),
            None => LocalClock::Monotonic(MonotonicClock::new()),
        };
        let cache = self.deny_cache.then(|| {
            DenyCache::new(
                CachePolicy::new(self.algorithm, self.quota),
                self.deny_cache_keys,
            )
        });
        // The listener that empties the cache on resets elsewhere stops with the limiter.
        let (listening, stop) = tokio::sync::watch::channel(());
        // Every limiter subscribes, with a deny cache or not: the subscribers are how
        // the limiters sharing the prefix count each other (`FailMode::LocalShare`).
        let nodes = client.nodes(timeout)?;
        let channel = crate::redis::invalidate::channel(&prefix);
        // Subscribed before the first check, so that no reset can go unheard; if that
        // fails, the listener keeps trying (and empties the cache once it succeeds).
        let first = match nodes.current().await.first() {
            Some(client) => crate::redis::invalidate::subscribe(client, &channel, timeout).await,
            None => None,
        };
        let fallbacks = Fallbacks::new(self.algorithm, local_clock.clone(), Arc::clone(&self.name));
        let box_settings = boxed.then(|| BoxSettings::new(&prefix, penalty));
        let limiter = RedisLimiter {
            inner: Arc::new(Inner {
                connection,
                script,
                source,
                settle: redis::Script::new(scripts::TOKEN_BUCKET_SETTLE),
                target: self.options.target,
                hasher: self.options.hasher,
                current: RwLock::new(Current {
                    rule,
                    quota: self.quota,
                }),
                also,
                prefix,
                timeout,
                clock: self.clock,
                local_clock,
                monotonic: MonotonicClock::new(),
                algorithm: self.algorithm,
                name: self.name,
                cache,
                plans,
                penalty: box_settings,
                breaker: Breaker::new(self.breaker),
                fallbacks,
                failing: AtomicBool::new(false),
                calls: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                fail_mode_decisions: AtomicU64::new(0),
                nodes: AtomicU64::new(1),
                _listening: listening,
            }),
        };
        start_listening(&limiter, nodes, channel, timeout, first, stop).await;
        // Every second, `stats` publishes (inside the runtime that built it).
        #[cfg(feature = "metrics")]
        crate::observe::every_second(Arc::downgrade(&limiter.inner), |inner| {
            RedisLimiter { inner }.stats();
        });
        Ok(limiter)
    }

    /// The quota and each `also` quota in the scripts' units, with the `also` quotas' key
    /// prefixes.
    fn script_quotas(&self) -> Result<(ScriptQuota, Box<[Also]>), RedisError> {
        let rule = ScriptQuota::new(self.algorithm, self.quota)?;
        let short = short_name(self.algorithm);
        let also = (1..)
            .zip(&self.also)
            .map(|(i, &quota)| {
                Ok(Also {
                    quota,
                    rule: ScriptQuota::new(self.algorithm, quota)?,
                    prefix: format!("{}:{short}+{i}:", self.options.prefix),
                })
            })
            .collect::<Result<Box<[Also]>, RedisError>>()?;
        Ok((rule, also))
    }

    /// The connection settings, the breaker's and the deny cache's, checked.
    fn validate(&self) -> Result<(Client, Duration), RedisError> {
        let (client, timeout) =
            self.options
                .validate(DEFAULT_TIMEOUT, |setting, value, expected| {
                    ConfigError::InvalidRedisSetting {
                        setting,
                        value,
                        expected,
                    }
                })?;
        self.breaker.validate()?;
        if self.deny_cache_keys == 0 {
            return Err(ConfigError::InvalidRedisSetting {
                setting: "deny_cache_max_keys",
                value: "0".to_owned(),
                expected: "1 or more",
            }
            .into());
        }
        Ok((client, timeout))
    }

    /// Connects within `timeout` and, on one server, loads the script.
    async fn connect(
        &self,
        client: &Client,
        script: &redis::Script,
        timeout: Duration,
    ) -> Result<Arc<Link>, RedisError> {
        let connect = async {
            let link = Link::connect(client.clone(), timeout).await?;
            // A cluster's nodes get the script on first use (`EVAL` after `NOSCRIPT`):
            // loading it on every node would make one unreachable replica fail the build.
            if !self.options.target.is_cluster() {
                script.prepare_invoke().load_async(&mut link.get()).await?;
            }
            Ok::<_, redis::RedisError>(link)
        };
        tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| RedisError::Timeout(timeout))?
            .map_err(|e| RedisError::from_redis(e, b""))
    }
}

/// Counts the limiters sharing the prefix once now (so that the share is known before
/// the first outage), then starts the two tasks that stop with the limiter: the count
/// every second, and the listener that empties the deny cache on a reset elsewhere.
async fn start_listening(
    limiter: &RedisLimiter,
    nodes: Nodes,
    channel: String,
    timeout: Duration,
    first: Option<redis::aio::PubSub>,
    stop: tokio::sync::watch::Receiver<()>,
) {
    use crate::redis::invalidate;
    let counted = invalidate::count(&nodes, &channel, timeout).await;
    limiter
        .inner
        .nodes
        .store(counted.unwrap_or(1).max(1), Ordering::Relaxed);
    let counting = Arc::downgrade(&limiter.inner);
    invalidate::spawn_counting(
        nodes.clone(),
        channel.clone(),
        timeout,
        limiter.inner._listening.subscribe(),
        move |nodes| match counting.upgrade() {
            Some(inner) if !inner.breaker.is_open() => {
                inner.nodes.store(nodes.max(1), Ordering::Relaxed);
                true
            }
            Some(_) => true,
            None => false,
        },
    );
    let weak = Arc::downgrade(&limiter.inner);
    invalidate::spawn(nodes, channel, timeout, first, stop, move || {
        if let Some(inner) = weak.upgrade() {
            if let Some(cache) = &inner.cache {
                cache.clear(inner.now_us());
            }
        }
    });
}
