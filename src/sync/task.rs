//! The sync task: one per limiter, on tokio. It sleeps until its [`Driver`] wants it,
//! picks the keys each round sends, talks to Redis, and applies the fail mode when the
//! driver says the node fell silent. When rounds run, how they back off and when the
//! node is stale is the driver's (`driver`, run by the simulation too); what a round
//! carries is `round`'s; the arithmetic of a round is in `node` (this side) and `model`
//! (Redis's side, run by `redis/lua/sync_round.lua`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Display;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use redis::cluster_routing::Slot;

use super::cell::{Cold, NEW, OutageMode, SyncCell, SyncPolicy, WANT_HOT};
use super::config::Settings;
use super::driver::{self, Driver, Health, RoundSize, Timing, nanos};
use super::limiter::SyncedLimiter;
use super::node::{self, Need, NodeParams};
use super::protocol::{Answer, Params, Request, Shape, SharedQuota};
use super::round::{self, Call, Selection};
use super::{FailMode, RedisSync, Shared, SyncHandle, SyncMode};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::redis::connection::{Connection, Link, eval};
use crate::redis::keys::write_key;
use crate::redis::scripts::{SYNC_HOT_KEYS as HOT_KEYS, SYNC_ROUND as ROUND};
use crate::store::Store;

/// A cold key unused for this long (and whose share is whole again) is dropped.
const COLD_IDLE: Duration = Duration::from_secs(1);
/// How many rounds a shutdown may run to flush every key.
const SHUTDOWN_ROUNDS: usize = 1_000;
/// How often the task looks whether the limiter's users have all dropped it.
const ALIVE_EVERY: Duration = Duration::from_millis(250);

/// The prefixes (with the algorithm) in use by this process's synced limiters.
static IN_USE: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Holds a prefix for as long as its limiter's task runs.
struct PrefixGuard(Option<String>);

impl PrefixGuard {
    fn claim(name: String, shared: bool) -> Result<Self, ConfigError> {
        if shared {
            return Ok(Self(None));
        }
        let mut in_use = IN_USE.lock();
        if !in_use.get_or_insert_with(HashSet::new).insert(name.clone()) {
            return Err(ConfigError::PrefixInUse(name));
        }
        Ok(Self(Some(name)))
    }
}

impl Drop for PrefixGuard {
    fn drop(&mut self) {
        if let Some(name) = self.0.take() {
            if let Some(set) = IN_USE.lock().as_mut() {
                set.remove(&name);
            }
        }
    }
}

/// Aborts a spawned task when dropped (so that aborting the supervisor stops it too).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Everything the task needs, besides the limiter's store.
struct Task {
    /// The limiter's algorithm (a key's own quota is for it).
    algorithm: Algorithm,
    config: RedisSync,
    settings: Settings,
    params: Params,
    node_params: NodeParams,
    /// The schedule's timing, for each run's [`Driver`].
    timing: Timing,
    script: redis::Script,
    /// The limiter's clock, read as ns.
    now: Arc<dyn Fn() -> u64 + Send + Sync>,
    registry: String,
    key_prefix: String,
    node: String,
    shared: Arc<Shared>,
    /// The limiter's name, for metrics.
    name: Arc<str>,
    /// How many clones of the limiter the task itself holds: once no other is left, the
    /// limiter is gone for its users, and the task flushes and stops.
    own_handles: usize,
    /// The cold tier, if on.
    cold: Option<ColdTier>,
}

/// The cold tier's settings (see [`RedisSync::cold_keys`]).
struct ColdTier {
    /// The announcements of keys turned hot: a sorted set, `{prefix}:sync:tag:hot`.
    key: String,
    script: redis::Script,
    /// How long (ms) an announcement lasts unless renewed; a node renews the
    /// announcement of a key it syncs once half of it is left.
    lifetime_ms: u64,
    /// How long (ns) after it last read the announcements a node may admit on its cold
    /// keys: `share_ttl` (at least the staleness), as its reserved share in the fallback.
    valid_ns: u64,
    /// A window counter's cold share is half a burst and half the rate.
    windowed: bool,
}

/// What this node knows of the keys turned hot, and of its cold tier.
#[derive(Default)]
struct HotView {
    /// Each announced key's [`node::fleet_hash`], and until when (Redis ms) it is hot.
    keys: HashMap<u64, u64>,
    /// The next read returns the announcements from this score on (ms).
    from_ms: u64,
    /// A key new to `keys` arrived: every cold key is looked up at the next round.
    rescan: bool,
    /// Successful reads, and when (limiter clock, ns) the last one was sent.
    reads: u64,
    read_at: Option<u64>,
    /// Redis's clock (ms) at the last read.
    server_ms: u64,
    /// The node count the cold shares divide by: the largest seen within the validity
    /// (a node that dropped out of the registry may still admit on its cold keys until
    /// its own validity ends), and when (limiter clock, ns) it was last seen.
    nodes: u64,
    nodes_at: u64,
    /// Keys turned hot since the start.
    turned: u64,
}
/// Validates `config` for the limiter's algorithm and spawns the task for `limiter`.
pub(crate) fn start<K, C>(
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
    let shape = Shape::new(algorithm, quota)?;
    // The leaky bucket's global state is the token bucket's, under keys of its own.
    let tag = match algorithm {
        Algorithm::LeakyBucket => "lb",
        _ => shape.script_args().0,
    };
    // An `also` quota's keys: `<tag>+<i>`, beside the limiter's own.
    let tag = match config.quota_index {
        0 => tag.to_string(),
        i => format!("{tag}+{i}"),
    };
    let guard = PrefixGuard::claim(
        match config.quota_index {
            0 => format!(
                "prefix {:?} with {}",
                config.options.prefix,
                algorithm.name()
            ),
            i => format!(
                "prefix {:?} with {}, quota {i}",
                config.options.prefix,
                algorithm.name()
            ),
        },
        config.shared_prefix,
    )?;
    if config.require_connection {
        settings
            .client
            .ping_blocking(settings.timeout)
            .map_err(|e| {
                crate::redis::sentinel::master_unknown(&e).unwrap_or_else(|| {
                    ConfigError::RedisUnreachable {
                        url: config.options.target.redacted(),
                        reason: config.options.target.scrub(&e.to_string()),
                    }
                })
            })?;
    }
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seed = (
        std::process::id(),
        STARTED.fetch_add(1, Ordering::Relaxed),
        SystemTime::now(),
    );
    let node = format!("{:016x}", ahash::RandomState::new().hash_one(seed));
    let shared = Arc::new(Shared::default());
    let clock_of = limiter.clone();
    let for_run = limiter.clone();
    let plan = driver::plan(
        &config,
        &settings,
        shape,
        limiter.quota_capacity(),
        quota.period_ns(),
    );
    let cold = config
        .cold_keys
        .unwrap_or(config.mode == SyncMode::Reconcile)
        .then(|| ColdTier {
            key: format!("{{{}}}:sync:{tag}:hot", config.options.prefix),
            script: redis::Script::new(HOT_KEYS),
            lifetime_ms: plan.cold_lifetime_ms,
            valid_ns: plan.cold_valid_ns,
            windowed: shape.period().is_some(),
        });
    let task = Task {
        algorithm,
        name: Arc::from(limiter.name()),
        params: plan.params,
        node_params: plan.node_params,
        timing: plan.timing,
        script: redis::Script::new(ROUND),
        now: Arc::new(move || clock_of.clock().now_ns()),
        registry: format!("{{{}}}:sync:{tag}:nodes", config.options.prefix),
        key_prefix: format!("{}:sync:{tag}:", config.options.prefix),
        node: node.clone(),
        shared: Arc::clone(&shared),
        settings,
        config,
        // `limiter`, `clock_of` and `for_run`: every clone but the caller's (`build_synced`
        // keeps one, which it returns).
        own_handles: limiter.handles() - 1,
        cold,
    };
    // Until its first read of the keys turned hot, a node cannot tell which keys are
    // cold: new keys start cold and wait for it (as a new key waits for its first lease).
    if task.cold.is_some() {
        let store = limiter.store();
        let policy = store.default_policy();
        store.set_policy(
            SyncPolicy {
                cold: Some(Cold::unvouched()),
                ..policy
            },
            0,
        );
    }
    let handle = runtime.spawn(supervise(Arc::new(task), limiter, for_run, guard));
    Ok(SyncHandle {
        name: format!("tollgate-sync-{node}"),
        shared,
        task: Some(handle),
        also: Vec::new(),
    })
}

/// Runs the task; if it dies, records it and applies the fallback until stopped or the
/// limiter's users have all dropped it.
async fn supervise<K, C>(
    task: Arc<Task>,
    limiter: SyncedLimiter<K, C>,
    for_run: SyncedLimiter<K, C>,
    _guard: PrefixGuard,
) where
    K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    C: Clock,
{
    let mut inner = AbortOnDrop(tokio::spawn(Arc::clone(&task).run(for_run)));
    if (&mut inner.0).await.is_ok() {
        return;
    }
    let store = limiter.store();
    {
        let mut cell = task.shared.stats.lock();
        cell.stats.task_died = true;
        cell.stats.fallback_active = true;
    }
    task.shared.settle();
    super::observe::sync_died(&task.name, &task.config.fail_mode);
    task.apply_fail_mode(store);
    // The rest of the process's life is the dead task's, less its own clone.
    let own = task.own_handles - 1;
    let nodes = task.shared.stats.lock().stats.nodes.max(1);
    let mut refill = tokio::time::interval(task.config.interval);
    let mut alive = tokio::time::interval(ALIVE_EVERY);
    loop {
        tokio::select! {
            _ = refill.tick(), if task.config.fail_mode == FailMode::Local => {
                task.refill_locally(store, nodes, false);
            }
            _ = alive.tick() => {
                if limiter.handles() <= own {
                    return;
                }
            }
            _ = task.shared.stop.notified() => return,
        }
    }
}

/// The task's running state.
struct Progress {
    /// The schedule, the backoff and the staleness/fallback state, on the time since
    /// `origin`.
    driver: Driver,
    /// How many keys the next round may send.
    size: RoundSize,
    origin: tokio::time::Instant,
    connection: Option<Arc<Link>>,
    seq: u64,
    nodes: u64,
    /// Sliding window in lease mode: how long after the last round Redis's next window
    /// starts (and every lease of the last one has expired), for a round then.
    window_in: Option<Duration>,
    /// Redis's clock minus the limiter's (ns), measured at the last round's midpoint.
    redis_offset_ns: Option<i64>,
    /// The node registry as the last heartbeat read it: each node's last heartbeat (ms
    /// of Redis's clock), which tells Redis which silent nodes are alive.
    heard: BTreeMap<String, u64>,
    /// The keys turned hot, as last read.
    hot: HotView,
}

impl Progress {
    /// The driver's time: ns since the run started.
    fn now(&self) -> u64 {
        nanos(self.origin.elapsed())
    }
}

/// The arguments of one call of `sync_round.lua`: the node, the registry's TTL, the
/// limit, the round's parameters and number, the clock (`clock_us`; 0, as every node
/// sends: the server's `TIME`), then each key's request, in the order the script reads
/// them.
pub(crate) fn round_args<'a>(
    params: &Params,
    node: &str,
    registry_ttl_ms: u64,
    heard: &BTreeMap<String, u64>,
    seq: u64,
    clock_us: u64,
    requests: impl IntoIterator<Item = &'a Request>,
) -> Vec<String> {
    let (tag, a, b) = params.shape.script_args();
    let mut args = vec![node.to_owned(), registry_ttl_ms.to_string(), tag.to_owned()];
    args.extend(
        [
            a,
            b,
            params.overdraft_horizon,
            params.hold,
            params.demand_ttl,
            params.retain_ms,
            params.share_ttl,
            params.silent_after,
        ]
        .map(|n| n.to_string()),
    );
    let heard: Vec<String> = heard.iter().map(|(id, ms)| format!("{id}:{ms}")).collect();
    args.push(heard.join(","));
    args.push(seq.to_string());
    args.push(clock_us.to_string());
    for r in requests {
        args.extend(
            [
                r.epoch,
                r.floor,
                r.keep,
                r.known,
                r.demand,
                r.want,
                r.anchor,
                r.deadline,
                r.local,
                r.beyond,
                r.quota.version,
                r.quota.limit,
                r.quota.period,
                r.quota.burst,
            ]
            .map(|n| n.to_string()),
        );
    }
    args
}

/// Numbers per key in a round's reply: grant, overdraft, reserved, stale, share, until,
/// owes, void, and the key's quota (version, limit, period, burst).
const ANSWER_LEN: usize = 12;

fn unexpected_reply() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Parse, "sync round: unexpected reply"))
}

/// What a round's timeout says.
const TIMED_OUT: &str = "sync round timed out";

/// The [`SyncStats::last_error`](super::SyncStats::last_error) of a failed round.
fn error_kind(e: &redis::RedisError) -> &'static str {
    // A pipeline's failure carries its calls' error codes in its message only.
    let text = e.to_string();
    let coded = |codes: &[&str]| {
        codes.iter().any(|code| {
            e.code() == Some(code)
                || text.contains(&format!("\"{code}\""))
                || text.starts_with(code)
        })
    };
    // Without a password, Redis refuses the round's large request before any code:
    // "Protocol error: unauthenticated multibulk length".
    if crate::redis::sentinel::master_unknown(e).is_some() {
        "unknown_master"
    } else if e.kind() == redis::ErrorKind::AuthenticationFailed
        || coded(&["NOAUTH", "WRONGPASS"])
        || text.contains("unauthenticated")
    {
        "authentication"
    } else if e.is_timeout() || text.contains(TIMED_OUT) {
        "timeout"
    } else if e.kind() == redis::ErrorKind::Parse {
        "reply"
    } else if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || coded(&crate::redis::error::UNAVAILABLE_CODES)
    {
        "unavailable"
    } else if coded(&["NOSCRIPT"]) || text.contains("script") {
        "script"
    } else {
        "redis"
    }
}

/// What a successful round learnt.
struct Round {
    nodes: u64,
    keys: usize,
    waiting: usize,
    stale: u64,
    released: u64,
    clock_offset: i64,
}

impl Task {
    async fn connect(&self) -> Result<Arc<Link>, redis::RedisError> {
        Link::connect(self.settings.client.clone(), self.settings.timeout).await
    }

    async fn run<K, C>(self: Arc<Self>, limiter: SyncedLimiter<K, C>)
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
        C: Clock,
    {
        let store = limiter.store();
        let origin = tokio::time::Instant::now();
        let mut p = Progress {
            driver: Driver::new(self.timing, driver::seed(&self.node), 0),
            size: RoundSize::new(self.config.round_keys),
            origin,
            connection: None,
            seq: 0,
            // Unknown until the first round (which sets the fresh share).
            nodes: 0,
            window_in: None,
            redis_offset_ns: None,
            heard: BTreeMap::new(),
            hot: HotView::default(),
        };
        let mut alive = tokio::time::interval(ALIVE_EVERY);
        loop {
            let wake_at = origin + Duration::from_nanos(p.driver.poll_timeout());
            let (stopping, timer) = tokio::select! {
                _ = tokio::time::sleep_until(wake_at) => (false, true),
                // A key waits for a lease: a round now, unless the rounds back off.
                _ = self.shared.wake.notified() => (false, false),
                _ = self.shared.stop.notified() => (true, false),
                // Whether the limiter's users have all dropped it (and the handle, or kept
                // it without calling `shutdown`): then flush, and stop. This look is no
                // round: the rounds keep their own schedule.
                _ = alive.tick() => {
                    if limiter.handles() > self.own_handles {
                        continue;
                    }
                    (true, false)
                }
            };
            #[cfg(test)]
            if self.shared.poison.load(Ordering::Acquire) {
                panic!("poisoned for a test");
            }
            if stopping {
                self.flush(store, &mut p).await;
                self.shared.settle();
                return;
            }
            let now = p.now();
            let round = if timer {
                p.driver.handle_timeout(now)
            } else {
                p.driver.may_run(now)
            };
            if round {
                self.attempt(store, &mut p, false).await;
                // A round that heard Redis's clock schedules the next window's round; one
                // that did not leaves the last one scheduled.
                if let Some(renew_in) = p.window_in.take() {
                    p.driver
                        .round_at(Some(p.now().saturating_add(nanos(renew_in))));
                }
            }
            self.update_cold(store, &mut p);
            let (silent, health) = p.driver.poll_health(p.now());
            if health == Health::Fell {
                self.shared.stats.lock().stats.fallback_active = true;
                super::observe::sync_state(&self.name, true, p.nodes);
                super::observe::sync_fallback(&self.name, true, &self.config.fail_mode);
                self.apply_fail_mode(store);
            }
            // Once per timer turn, as the simulation does: a round asked for early
            // (`sync_now`) would otherwise add another interval's credit to every
            // reserved share.
            if silent && timer && self.config.fail_mode == FailMode::Local {
                self.refill_locally(store, p.nodes, p.hot.read_at.is_none());
            }
            if !self.shared.is_settled() {
                let answered = self.shared.stats.lock().stats.syncs > 0;
                let vouched = self.cold.is_none() || p.hot.read_at.is_some();
                if (answered && vouched) || p.driver.in_fallback() {
                    self.shared.settle();
                }
            }
        }
    }

    /// The last rounds before stopping: report everything, return every lease, leave
    /// the node registry.
    async fn flush<K>(&self, store: &Store<K, SyncCell>, p: &mut Progress)
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    {
        for _ in 0..SHUTDOWN_ROUNDS {
            let before = self.shared.stats.lock().stats.syncs;
            self.attempt(store, p, true).await;
            let stats = self.shared.stats.lock().stats;
            if stats.syncs == before || (stats.keys_last_round == 0 && stats.keys_waiting == 0) {
                break;
            }
        }
        if let Some(link) = &p.connection {
            let mut leave = redis::cmd("ZREM");
            leave.arg(&self.registry).arg(&self.node);
            let mut connection = link.get();
            let query = leave.query_async::<()>(&mut connection);
            let _ = tokio::time::timeout(self.settings.timeout, query).await;
        }
    }

    /// Runs one round, connecting first if needed, and records how it went.
    async fn attempt<K>(&self, store: &Store<K, SyncCell>, p: &mut Progress, stopping: bool)
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    {
        let started = Instant::now();
        let fallback = p.driver.in_fallback();
        if p.connection.is_none() {
            let failure = match tokio::time::timeout(self.settings.timeout, self.connect()).await {
                Ok(Ok(c)) => {
                    p.connection = Some(c);
                    None
                }
                Ok(Err(e)) => Some((
                    error_kind(&e),
                    self.config.options.target.scrub(&e.to_string()),
                )),
                Err(_) => Some(("timeout", "connecting timed out".to_owned())),
            };
            if let Some((kind, message)) = failure {
                let took = started.elapsed();
                super::observe::sync_round(&self.name, false, took, fallback, p.nodes);
                return self.failed(p, kind, &message);
            }
        }
        let Some(link) = p.connection.clone() else {
            return;
        };
        match self.round(store, link.get(), p, stopping).await {
            Ok(round) => {
                super::observe::sync_round(&self.name, true, started.elapsed(), false, round.nodes);
                if round.nodes != p.nodes {
                    p.nodes = round.nodes;
                    self.set_shares(store, p.nodes);
                }
                p.size.succeeded();
                if p.driver.on_success(p.now()) == Health::Recovered {
                    self.set_outage(store, OutageMode::Normal);
                    super::observe::sync_fallback(&self.name, false, &self.config.fail_mode);
                }
                let mut cell = self.shared.stats.lock();
                cell.last_success = Some(Instant::now());
                let stats = &mut cell.stats;
                stats.syncs += 1;
                stats.keys_last_round = round.keys;
                stats.keys_waiting = round.waiting;
                stats.stale_answers += round.stale;
                stats.keys_released += round.released;
                stats.nodes = p.nodes;
                stats.clock_offset = round.clock_offset;
                stats.fallback_active = false;
                stats.last_error = None;
            }
            Err(e) => {
                super::observe::sync_round(&self.name, false, started.elapsed(), fallback, p.nodes);
                // On a cluster, a fresh connection is made in the background and replaces
                // this one once it connects (see `Link`).
                link.failed();
                let message = self.config.options.target.scrub(&e.to_string());
                let kind = error_kind(&e);
                if kind == "timeout" {
                    p.size.timed_out();
                }
                self.failed(p, kind, &message);
            }
        }
    }

    /// A round failed with an error of `kind`: counted, shown in the stats, and logged
    /// (`warn` for the first failure of a run or a new kind, `debug` after).
    fn failed(&self, p: &mut Progress, kind: &'static str, message: &str) {
        let changed = {
            let mut cell = self.shared.stats.lock();
            let changed = cell.stats.last_error != Some(kind);
            cell.stats.last_error = Some(kind);
            changed
        };
        super::observe::sync_error(&self.name, kind, message, changed);
        p.driver.on_failure(p.now());
        self.shared.stats.lock().stats.errors += 1;
    }

    /// The keys this round sends, most urgent first, at most `most` of them (all
    /// keys that are not released yet when stopping); how many more wait; and how many
    /// idle keys that did not fit were released without a round (see
    /// [`node::release_locally`]), and dropped.
    fn choose<K>(
        &self,
        store: &Store<K, SyncCell>,
        now: u64,
        stopping: bool,
        most: usize,
        hot: &mut HotView,
    ) -> (Vec<K>, usize, u64)
    where
        K: Hash + Eq + Clone + Display,
    {
        let mut selection = Selection::new(most);
        let mut released = Vec::new();
        let mut idle_cold = Vec::new();
        let rescan = std::mem::take(&mut hot.rescan);
        let cold_t_ns = self.cold_t_ns(hot.nodes);
        let cold_idle_ns = nanos(COLD_IDLE);
        store.for_each(|key, cell, policy| {
            if node::is_cold(cell) {
                let flags = cell.hot.flags.load(Ordering::Acquire);
                let idle = || {
                    cell.cold_tat
                        .load(Ordering::Acquire)
                        .saturating_add(cold_idle_ns)
                        <= now
                        && flags & WANT_HOT == 0
                };
                if stopping || (flags & (NEW | WANT_HOT) == 0 && !rescan) {
                    if idle() {
                        idle_cold.push(key.clone());
                    }
                    return;
                }
                let mut books = cell.hot.aside.books.lock();
                if flags & NEW != 0 {
                    books.fleet = node::fleet_hash(&self.redis_key(key));
                    cell.hot.flags.fetch_and(!NEW, Ordering::AcqRel);
                }
                let elsewhere = hot.keys.contains_key(&books.fleet);
                if flags & WANT_HOT == 0 && !elsewhere {
                    if idle() {
                        idle_cold.push(key.clone());
                    }
                    return;
                }
                if !node::turn_hot(cell, &mut books, cold_t_ns, now) {
                    return;
                }
                hot.turned += 1;
            }
            let mut books = cell.hot.aside.books.lock();
            let need = if stopping && !books.released {
                Some(Need::Release)
            } else {
                node::need(
                    cell,
                    &books,
                    &node::key_params(&self.node_params, policy),
                    now,
                )
            };
            let Some(need) = need else { return };
            if let Err(key) = selection.offer(key.clone(), need) {
                if need == Need::Release && node::release_locally(cell, &mut books) {
                    released.push(key);
                } else {
                    selection.wait();
                }
            }
        });
        let (chosen, waiting) = selection.finish();
        let dropped = released
            .iter()
            .filter(|key| store.remove_if(key, SyncCell::is_released))
            .count() as u64;
        // An idle cold key is as good as new: dropping it loses nothing.
        for key in idle_cold {
            store.remove_if(&key, |cell| {
                node::is_cold(cell)
                    && cell.hot.flags.load(Ordering::Acquire) & WANT_HOT == 0
                    && cell
                        .cold_tat
                        .load(Ordering::Acquire)
                        .saturating_add(cold_idle_ns)
                        <= now
            });
        }
        (chosen, waiting, dropped)
    }

    /// The cold share's ns per token among `nodes` nodes (the rate's, when unknown).
    fn cold_t_ns(&self, nodes: u64) -> u64 {
        let windowed = self.cold.as_ref().is_some_and(|c| c.windowed);
        Cold::t_ns(self.node_params.ticks, nodes, windowed)
    }

    /// Keeps the limiter's cold share in step with what this node knows: on once a read
    /// of the announcements has succeeded, vouched for until the validity after the last
    /// read, divided by the node count; unvouched before the first read (new keys start
    /// cold and wait for it); off (new keys start hot, and the fallback applies to them)
    /// once the node is in its fallback without a valid read.
    fn update_cold<K: Hash + Eq>(&self, store: &Store<K, SyncCell>, p: &mut Progress) {
        let Some(tier) = &self.cold else { return };
        let now = (self.now)();
        let h = &mut p.hot;
        if p.nodes > 0 && (p.nodes >= h.nodes || now.saturating_sub(h.nodes_at) >= tier.valid_ns) {
            h.nodes = p.nodes;
            h.nodes_at = now;
        }
        let want = match h.read_at {
            None => Some(Cold::unvouched().for_new_keys(!p.driver.in_fallback())),
            Some(at) => {
                let until = at.saturating_add(tier.valid_ns);
                Cold::share(
                    self.node_params.capacity,
                    self.node_params.ticks,
                    h.nodes,
                    tier.windowed,
                    until,
                )
                .map(|c| c.for_new_keys(now < until))
            }
        };
        let policy = store.default_policy();
        let same = match (policy.cold, want) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.t_ns == b.t_ns
                    && a.tau_ns == b.tau_ns
                    && a.new_keys == b.new_keys
                    && b.until < a.until + tier.valid_ns / 4
            }
            _ => false,
        };
        if !same {
            store.set_policy(
                SyncPolicy {
                    cold: want,
                    ..policy
                },
                0,
            );
        }
        let mut cell = self.shared.stats.lock();
        let vouched = want.is_some_and(|c| now < c.until);
        if cell.stats.cold_tier && !vouched {
            super::observe::sync_budget(&self.name, 0);
        }
        cell.stats.cold_tier = vouched;
        cell.stats.hot_keys = h.keys.len();
        cell.stats.keys_turned_hot = h.turned;
    }

    /// Reads the announcements of keys turned hot (from `from_ms` on), first announcing
    /// (or renewing) `announce`, within the round's timeout. Returns Redis's clock (ms)
    /// and each announced key with until when it is hot.
    async fn hot_keys(
        &self,
        tier: &ColdTier,
        mut connection: Connection,
        announce: &[Vec<u8>],
        from_ms: u64,
    ) -> Result<(u64, Vec<(Vec<u8>, u64)>), redis::RedisError> {
        let call = |eval: bool| {
            let mut cmd = if eval {
                let mut c = redis::cmd("EVAL");
                c.arg(HOT_KEYS);
                c
            } else {
                let mut c = redis::cmd("EVALSHA");
                c.arg(tier.script.get_hash());
                c
            };
            cmd.arg(1).arg(&tier.key).arg(tier.lifetime_ms).arg(from_ms);
            for key in announce {
                cmd.arg(key);
            }
            cmd
        };
        let query = eval::<redis::Value>(&mut connection, call);
        let reply = match tokio::time::timeout(self.settings.timeout, query).await {
            Ok(reply) => reply?,
            Err(_) => return Err(redis::RedisError::from((redis::ErrorKind::Io, TIMED_OUT))),
        };
        let redis::Value::Array(items) = reply else {
            return Err(unexpected_reply());
        };
        let Some(redis::Value::Int(now)) = items.first() else {
            return Err(unexpected_reply());
        };
        let mut read = Vec::with_capacity(items.len() / 2);
        for pair in items[1..].chunks(2) {
            match pair {
                [redis::Value::BulkString(member), redis::Value::Int(until)] => {
                    read.push((member.clone(), u64::try_from(*until).unwrap_or(0)));
                }
                _ => return Err(unexpected_reply()),
            }
        }
        Ok((u64::try_from(*now).unwrap_or(0), read))
    }

    /// Takes in a read of the announcements sent at `sent` (limiter clock, ns).
    fn heard_hot(&self, h: &mut HotView, server_ms: u64, read: Vec<(Vec<u8>, u64)>, sent: u64) {
        for (member, until) in read {
            if h.keys.insert(node::fleet_hash(&member), until).is_none() {
                h.rescan = true;
            }
            // Scores only grow with the time they were written at; a second back
            // covers a failover to a server whose clock is a little behind.
            h.from_ms = h.from_ms.max(until.saturating_sub(1_000));
        }
        h.keys.retain(|_, until| *until > server_ms);
        h.server_ms = server_ms;
        h.reads += 1;
        h.read_at = Some(sent);
    }

    /// One round: report, heartbeat, apply. On failure nothing is lost: every report
    /// stays pending, and the next round's floors (cumulative) carry it.
    async fn round<K>(
        &self,
        store: &Store<K, SyncCell>,
        connection: Connection,
        p: &mut Progress,
        stopping: bool,
    ) -> Result<Round, redis::RedisError>
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    {
        let now = (self.now)();
        let (chosen, waiting, released_locally) =
            self.choose(store, now, stopping, p.size.keys(), &mut p.hot);
        if released_locally > 0 {
            // Counted now: they were dropped whatever becomes of this round.
            self.shared.stats.lock().stats.keys_released += released_locally;
        }
        p.seq += 1;
        // Each key with its request, and the node side's parameters for its quota.
        let mut items: Vec<(K, Request, NodeParams)> = Vec::with_capacity(chosen.len());
        // Keys whose announcement as hot this node makes or renews (see the cold tier):
        // made before the key's first round, so that every node that reads it later
        // turns the key hot while the others' cold shares are still accounted for.
        let renew_by = p
            .hot
            .server_ms
            .saturating_add(self.cold.as_ref().map_or(0, |tier| tier.lifetime_ms / 2));
        let mut announce = Vec::new();
        for key in chosen {
            let request = store.with_state_policy(&key, |cell, policy| {
                let params = node::key_params(&self.node_params, policy);
                let mut books = cell.hot.aside.books.lock();
                let request = Request {
                    quota: policy.shared,
                    ..node::collect(
                        cell,
                        &mut books,
                        &params,
                        p.seq,
                        now,
                        stopping,
                        p.redis_offset_ns,
                    )
                };
                let holds = request.demand > 0 || request.keep > 0 || request.want > 0;
                (request, params, holds && books.announced_until <= renew_by)
            });
            if let Some((request, params, renew)) = request {
                if renew && self.cold.is_some() && !stopping {
                    announce.push(items.len());
                }
                items.push((key, request, params));
            }
        }
        let keys: Vec<Vec<u8>> = items.iter().map(|(key, ..)| self.redis_key(key)).collect();
        let announced: Vec<Vec<u8>> = announce.iter().map(|&i| keys[i].clone()).collect();
        let hot_sent = (self.now)();
        // With announcements, they go before the rounds; otherwise the read goes along.
        let mut hot_read = None;
        if let (Some(tier), false) = (&self.cold, announced.is_empty()) {
            let read = self
                .hot_keys(tier, connection.clone(), &announced, p.hot.from_ms)
                .await?;
            hot_read = Some(Ok(read));
        }
        let cluster = self.config.options.target.is_cluster();
        let plan = round::batches(
            &keys,
            self.config.batch_size,
            cluster.then_some(|key: &[u8]| Slot::for_key(key)),
        );
        let sent = Instant::now();
        let wall_sent = SystemTime::now();
        let heard = p.heard.clone();
        let from_ms = p.hot.from_ms;
        let read_along = async {
            match (&self.cold, hot_read.is_none()) {
                (Some(tier), true) => {
                    Some(self.hot_keys(tier, connection.clone(), &[], from_ms).await)
                }
                _ => None,
            }
        };
        let (results, read) = futures_util::future::join(
            futures_util::future::join_all(plan.iter().map(|pipeline| {
                self.send(connection.clone(), pipeline, &items, &keys, &heard, p.seq)
            })),
            read_along,
        )
        .await;
        let hot_read = hot_read.or(read);
        let mut hot_failure = None;
        match hot_read {
            Some(Ok((server_ms, read))) => {
                self.heard_hot(&mut p.hot, server_ms, read, hot_sent);
                if let Some(tier) = &self.cold {
                    let until = server_ms + tier.lifetime_ms;
                    for &i in &announce {
                        store.with_state(&items[i].0, |cell| {
                            cell.hot.aside.books.lock().announced_until = until;
                        });
                    }
                }
            }
            Some(Err(e)) => hot_failure = Some(e),
            None => {}
        }
        let round_trip = sent.elapsed();
        // What each call answered: the number of nodes and the clock from the heartbeat,
        // and each key's answer with the clock of the server that holds it.
        let mut nodes = None;
        let mut heartbeat_now = None;
        let mut failure = None;
        let mut answers: Vec<Option<(Answer, u64)>> = vec![None; items.len()];
        for (pipeline, result) in plan.iter().zip(results) {
            let replies = match result {
                Ok(replies) if replies.len() == pipeline.len() => replies,
                Ok(_) => {
                    failure = Some(unexpected_reply());
                    continue;
                }
                Err(e) => {
                    failure = Some(e);
                    continue;
                }
            };
            for (call, reply) in pipeline.iter().zip(&replies) {
                let [n, t, k, rest @ ..] = reply.as_slice() else {
                    failure = Some(unexpected_reply());
                    continue;
                };
                let registry_len = usize::try_from(*k).unwrap_or(usize::MAX).saturating_mul(3);
                if rest.len() != registry_len.saturating_add(call.items.len() * ANSWER_LEN) {
                    failure = Some(unexpected_reply());
                    continue;
                }
                let (registry, rest) = rest.split_at(registry_len);
                if call.registry {
                    nodes = Some((*n).max(1));
                    heartbeat_now = Some(*t);
                    p.heard = registry
                        .chunks_exact(3)
                        .map(|e| (format!("{:08x}{:08x}", e[0], e[1]), e[2]))
                        .collect();
                }
                for (&i, a) in call.items.iter().zip(rest.chunks_exact(ANSWER_LEN)) {
                    let answer = Answer {
                        grant: a[0],
                        overdraft: a[1],
                        reserved: a[2],
                        stale: a[3] != 0,
                        share: a[4],
                        until: a[5],
                        owes: a[6],
                        void: a[7],
                        quota: SharedQuota {
                            version: a[8],
                            limit: a[9],
                            period: a[10],
                            burst: a[11],
                        },
                    };
                    answers[i] = Some((answer, *t));
                }
            }
        }
        let local_now = (self.now)();
        if let Some(server_now) = heartbeat_now {
            let midpoint = i128::from(local_now) - (round_trip.as_nanos() / 2) as i128;
            if let Ok(offset) = i64::try_from(i128::from(server_now) * 1_000 - midpoint) {
                p.redis_offset_ns = Some(offset);
            }
            // Every round that heartbeats schedules the renewal round of the next window,
            // whether or not it carried keys.
            let period = self.params.shape.period();
            if let (_, Some(renew_in)) =
                self.lease_deadline(period, server_now, round_trip, local_now)
            {
                p.window_in = Some(renew_in);
            }
        }
        // Every answer that arrived is applied, even when another call failed (a cluster
        // master in failover): its key's books then match Redis's.
        let mut stale = 0;
        let mut released = 0;
        for ((key, request, params), answer) in items.iter().zip(&answers) {
            let Some((answer, server_now)) = answer else {
                continue;
            };
            // A key's lease ends with the window (of its own quota) of the clock of the
            // server that holds it.
            let period = answer.quota.shape(self.params.shape).period();
            let (expires, _) = self.lease_deadline(period, *server_now, round_trip, local_now);
            // Its share stays reserved until `until` of that server's clock: here, a
            // whole round trip earlier, so that the offset's error cannot carry a local
            // admission past it.
            let share_until = local_now
                .saturating_add(
                    answer
                        .until
                        .saturating_sub(*server_now)
                        .saturating_mul(1_000),
                )
                .saturating_sub(u64::try_from(round_trip.as_nanos()).unwrap_or(u64::MAX));
            let done = store.with_state(key, |cell| {
                let mut books = cell.hot.aside.books.lock();
                let ok = node::settle(
                    cell,
                    &mut books,
                    params,
                    request,
                    answer,
                    expires,
                    share_until,
                );
                (ok, books.released)
            });
            if done.is_some_and(|(ok, _)| ok) {
                self.adopt_quota(store, key, answer.quota);
            }
            match done {
                Some((false, _)) => stale += 1,
                Some((true, true)) if store.remove_if(key, SyncCell::is_released) => {
                    released += 1;
                }
                _ => {}
            }
        }
        if let Some(e) = failure.or(hot_failure) {
            return Err(e);
        }
        let (Some(nodes), Some(server_now)) = (nodes, heartbeat_now) else {
            return Err(unexpected_reply());
        };
        let midpoint = wall_sent + round_trip / 2;
        let local_ns = midpoint
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        Ok(Round {
            nodes,
            keys: items.len(),
            waiting,
            stale,
            released,
            clock_offset: i64::try_from(server_now)
                .unwrap_or(i64::MAX)
                .saturating_mul(1_000)
                .saturating_sub(local_ns),
        })
    }

    /// The Redis key of `key`'s state: `prefix:sync:algorithm:{key}`, or its digest.
    fn redis_key<K: Display>(&self, key: &K) -> Vec<u8> {
        let key = key.to_string();
        let mut out = Vec::with_capacity(self.key_prefix.len() + key.len().max(34) + 2);
        out.extend_from_slice(self.key_prefix.as_bytes());
        out.push(b'{');
        write_key(
            self.config.options.hasher.as_ref(),
            key.as_bytes(),
            &mut out,
        );
        out.push(b'}');
        out
    }

    /// Sends one pipeline of calls (loading the script once if Redis lost it), within
    /// the round's timeout.
    async fn send<K>(
        &self,
        mut connection: Connection,
        calls: &[Call],
        items: &[(K, Request, NodeParams)],
        keys: &[Vec<u8>],
        heard: &BTreeMap<String, u64>,
        seq: u64,
    ) -> Result<Vec<Vec<u64>>, redis::RedisError> {
        let ttl_ms = driver::millis(self.settings.node_ttl).max(1);
        // `EVALSHA`, or `EVAL` with the source, which also caches the script on the node.
        let pipeline = |eval: bool| {
            let mut pipe = redis::pipe();
            for call in calls {
                let registry = usize::from(call.registry);
                let cmd = if eval {
                    pipe.cmd("EVAL").arg(ROUND)
                } else {
                    pipe.cmd("EVALSHA").arg(self.script.get_hash())
                };
                cmd.arg(call.items.len() + registry);
                if call.registry {
                    cmd.arg(&self.registry);
                }
                for &i in &call.items {
                    cmd.arg(&keys[i]);
                }
                cmd.arg(round_args(
                    &self.params,
                    &self.node,
                    if call.registry { ttl_ms } else { 0 },
                    heard,
                    seq,
                    // Redis's clock: the one every node's rounds share.
                    0,
                    call.items.iter().map(|&i| &items[i].1),
                ));
            }
            pipe
        };
        let query = async {
            match pipeline(false)
                .query_async::<Vec<Vec<u64>>>(&mut connection)
                .await
            {
                // After a restart or a failover the node lacks the script: `EVAL` goes to
                // the node of these keys only, as the limiter's checks do (a `SCRIPT LOAD`
                // goes to every node of a cluster, and fails while one is down). Replaying
                // the pipeline is safe: a call Redis applied answers `stale`.
                Err(e) if e.code() == Some("NOSCRIPT") => {
                    pipeline(true).query_async(&mut connection).await
                }
                other => other,
            }
        };
        match tokio::time::timeout(self.settings.timeout, query).await {
            Ok(result) => result,
            Err(_) => Err(redis::RedisError::from((redis::ErrorKind::Io, TIMED_OUT))),
        }
    }

    /// Until when (limiter clock, ns) what a round leases may be spent: for ever, but in
    /// lease mode for the window counters only until Redis's current window ends, brought
    /// forward by a whole round trip so that the clock offset's error cannot carry a
    /// token into the next window; and how long from now the round that renews leases
    /// just after the next window starts is due.
    fn lease_deadline(
        &self,
        period: Option<u64>,
        server_now_us: u64,
        round_trip: Duration,
        local_now: u64,
    ) -> (u64, Option<Duration>) {
        let Some(period) = period else {
            return (u64::MAX, None);
        };
        if self.params.overdraft_horizon > 0 {
            return (u64::MAX, None);
        }
        let to_end = Duration::from_micros(period - server_now_us % period);
        let margin = nanos(round_trip);
        let end = local_now.saturating_add(u64::try_from(to_end.as_nanos()).unwrap_or(u64::MAX));
        (end.saturating_sub(margin), Some(to_end + round_trip / 2))
    }

    /// Takes in the quota Redis holds for `key` (see [`SharedQuota`]): a higher one than
    /// this node's becomes the key's own here (or returns it to the default); a return to
    /// the default that Redis has taken needs no mark any more.
    fn adopt_quota<K>(&self, store: &Store<K, SyncCell>, key: &K, held: SharedQuota)
    where
        K: Hash + Eq + Clone,
    {
        let mine = store.policy_of(key);
        if held > mine.shared {
            let policy = if held.is_default() {
                None
            } else {
                // (Redis holds only what a node's `set_quota` accepted.)
                let Some(quota) = held.quota() else { return };
                let default = store.default_policy();
                let Ok(policy) = default.for_key(self.algorithm, quota, held.version) else {
                    return;
                };
                Some(policy)
            };
            store.set_key_quota(key.clone(), policy, || (self.now)());
        } else if mine.shared.is_default()
            && mine.shared.version > 0
            && held.version >= mine.shared.version
        {
            store.set_key_quota(key.clone(), None, || (self.now)());
        }
    }

    /// What this node's share among `nodes` sets: a key first seen on this node may
    /// overdraft its share of the capacity until its first round (reconcile mode; in
    /// lease mode it waits for a lease), and the leaky bucket paces its queue at its share
    /// of the rate.
    fn set_shares<K: Hash + Eq>(&self, store: &Store<K, SyncCell>, nodes: u64) {
        let policy = store.default_policy();
        let fresh =
            node::fresh_overdraft(self.node_params.capacity, nodes, self.node_params.reconcile);
        let pace_ns = if policy.pace_ns == 0 {
            0
        } else {
            Cold::t_ns(policy.ticks, nodes, false)
        };
        let nodes = nodes.max(1);
        if policy.fresh != fresh || policy.pace_ns != pace_ns || policy.nodes != nodes {
            store.set_policy(
                SyncPolicy {
                    fresh,
                    pace_ns,
                    nodes,
                    ..policy
                },
                0,
            );
        }
    }

    /// Puts the checks in the configured fail mode: `Open` and `Closed` set every key's
    /// outage mode; `Local` runs on the books (`refill_locally`), with nothing to set.
    fn apply_fail_mode<K: Hash + Eq>(&self, store: &Store<K, SyncCell>) {
        match self.config.fail_mode {
            FailMode::Open => self.set_outage(store, OutageMode::Open),
            FailMode::Closed => self.set_outage(store, OutageMode::Closed),
            FailMode::Local => {}
        }
    }

    fn set_outage<K: Hash + Eq>(&self, store: &Store<K, SyncCell>, outage: OutageMode) {
        let policy = store.default_policy();
        store.set_policy(SyncPolicy { outage, ..policy }, 0);
    }

    /// [`FailMode::Local`], once per interval.
    /// A node that never read the keys turned hot (Redis was unreachable from its
    /// start: `never_read`) turns its cold keys hot, so that the fallback serves them:
    /// they admitted nothing. Otherwise a cold key spends its share by itself.
    fn refill_locally<K: Hash + Eq>(
        &self,
        store: &Store<K, SyncCell>,
        nodes: u64,
        never_read: bool,
    ) {
        let now = (self.now)();
        let t_ns = self.cold_t_ns(nodes);
        let mut budgets = 0;
        store.for_each(|_, cell, policy| {
            if node::is_cold(cell) && !never_read {
                return;
            }
            let mut books = cell.hot.aside.books.lock();
            node::turn_hot(cell, &mut books, t_ns, now);
            budgets += u64::from(node::refill_locally(
                cell,
                &mut books,
                &node::key_params(&self.node_params, policy),
                nodes,
                now,
            ));
        });
        if budgets > 0 {
            self.shared.stats.lock().stats.keys_on_budget += budgets;
            super::observe::sync_budget(&self.name, budgets);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::sync::{FailMode, RedisSync};
    use crate::{ConfigError, Quota, RateLimiter};

    /// A task that dies leaves the fallback in force, and says so.
    #[tokio::test]
    async fn a_dead_task_applies_the_fallback() {
        let (limiter, handle) = RateLimiter::<String>::builder(Quota::per_second(10).unwrap())
            .build_synced(
                RedisSync::new("redis://127.0.0.1:1/")
                    .prefix("poisoned")
                    .fail_mode(FailMode::Closed)
                    .interval(Duration::from_millis(5)),
            )
            .unwrap();
        handle
            .shared
            .poison
            .store(true, std::sync::atomic::Ordering::Release);
        handle.sync_now();
        for _ in 0..200 {
            if handle.stats().task_died {
                break;
            }
            // Waits for the sync task (a tokio task on real time) to die and be supervised.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let stats = handle.stats();
        assert!(stats.task_died && stats.fallback_active, "{stats:?}");
        assert!(!limiter.check("k").is_allowed(), "DenyAll applies");
        // Once the limiter is dropped, the supervisor ends too: its prefix is free.
        drop(limiter);
        let again = || {
            RateLimiter::<String>::builder(Quota::per_second(10).unwrap())
                .build_synced(RedisSync::new("redis://127.0.0.1:1/").prefix("poisoned"))
        };
        for _ in 0..200 {
            if again().is_ok() {
                return;
            }
            // Waits for the supervisor (a tokio task) to end and free the prefix.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the supervisor of a dead task outlived its limiter");
    }

    #[tokio::test]
    async fn a_second_limiter_with_the_same_prefix_is_refused() {
        let quota = Quota::per_second(10).unwrap();
        let config = RedisSync::new("redis://127.0.0.1:1/").prefix("twice");
        let first = RateLimiter::<String>::builder(quota).build_synced(config.clone());
        assert!(first.is_ok());
        let err = RateLimiter::<String>::builder(quota)
            .build_synced(config.clone())
            .unwrap_err();
        assert!(matches!(err, ConfigError::PrefixInUse(_)), "{err}");
        // Once the first stops, the prefix is free again.
        first.unwrap().1.shutdown().await;
        assert!(
            RateLimiter::<String>::builder(quota)
                .build_synced(config)
                .is_ok()
        );
    }

    #[tokio::test]
    async fn an_unreachable_redis_is_an_error_only_when_required() {
        let quota = Quota::per_second(10).unwrap();
        let config = RedisSync::new("redis://:hunter2@127.0.0.1:1/")
            .prefix("required")
            .timeout(Duration::from_millis(100));
        let err = RateLimiter::<String>::builder(quota)
            .build_synced(config.clone().require_connection(true))
            .unwrap_err();
        assert!(matches!(err, ConfigError::RedisUnreachable { .. }), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
        // (The limiter is kept: once it is dropped, its sync stops.)
        let (_limiter, handle) = RateLimiter::<String>::builder(quota)
            .build_synced(config)
            .unwrap();
        for _ in 0..100 {
            if handle.stats().fallback_active {
                break;
            }
            // Waits for the sync task's first round to fail against the closed port.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(handle.stats().fallback_active, "{:?}", handle.stats());
    }
}
