//! The sync task: one per limiter, on tokio.

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::cell::{Override, SyncCell, SyncPolicy, WANTED};
use super::{Fallback, RedisSync, Shared, SyncHandle, SyncMode};
use crate::algorithm::Algorithm;
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::limiter::RateLimiter;
use crate::redis::limiter::script_args;
use crate::store::Store;

const TOKEN_BUCKET: &str = include_str!("sync_token_bucket.lua");
const SLIDING_WINDOW: &str = include_str!("sync_sliding_window.lua");
/// The longest wait between retries while Redis fails.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What a round sends for one key, kept to apply the answer or to undo on failure.
struct Item<K> {
    key: K,
    /// Units admitted since the last round (lease and overdraft), for sizing the lease.
    used: u64,
    /// Whether the key ran out (was denied).
    ran_out: bool,
    /// Units to charge: admitted beyond a lease, plus tokens handed out locally during an
    /// outage in lease mode.
    charged: u64,
    /// Of `charged`, what was the key's own spending (the rest is outage debt).
    spent: u64,
    /// The overdraft left when the round was collected; checks may spend on from it
    /// while the round is in flight.
    overdraft_left: u64,
    returned: u64,
    wanted: u64,
}

/// What a successful round learnt.
struct Round {
    nodes: u64,
    keys: usize,
    clock_offset: i64,
}

/// Everything the task needs, besides the limiter's store.
struct Task {
    config: RedisSync,
    algorithm: Algorithm,
    /// The limiter's clock, read as ns.
    now: Arc<dyn Fn() -> u64 + Send + Sync>,
    script: redis::Script,
    args: [u64; 3],
    capacity: u64,
    /// The quota's rate in units per second, for the local fallback refill.
    rate_per_sec: f64,
    registry: String,
    key_prefix: String,
    node: String,
    shared: Arc<Shared>,
}

/// Validates `config` for the limiter's algorithm and spawns the task for `limiter`,
/// which must use a synced store.
pub(crate) fn start<K, C>(
    limiter: RateLimiter<K, C>,
    config: RedisSync,
) -> Result<SyncHandle, ConfigError>
where
    K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    C: Clock,
{
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
    let algorithm = limiter.algorithm();
    let quota = limiter.quota();
    let (source, tag) = match algorithm {
        Algorithm::TokenBucket => (TOKEN_BUCKET, "tb"),
        Algorithm::SlidingWindow => (SLIDING_WINDOW, "sw"),
        _ => {
            return Err(ConfigError::Unsupported(
                "background sync supports token-bucket and sliding-window",
            ));
        }
    };
    let args = script_args(algorithm, quota).map_err(|e| match e {
        crate::redis::RedisError::Config(e) => e,
        _ => ConfigError::Unsupported("this quota cannot run on Redis"),
    })?;
    if config.prefix.contains(['{', '}']) {
        return Err(ConfigError::InvalidPrefix(config.prefix.clone()));
    }
    if config.interval.is_zero() {
        return Err(ConfigError::ZeroPeriod);
    }
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seed = (
        std::process::id(),
        STARTED.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now(),
    );
    let node = format!("{:016x}", ahash::RandomState::new().hash_one(seed));
    let shared = Arc::new(Shared::default());
    let clock_of = limiter.clone();
    let task = Task {
        algorithm,
        now: Arc::new(move || clock_of.clock().now_ns()),
        script: redis::Script::new(source),
        args,
        capacity: limiter.capacity(),
        rate_per_sec: quota.limit() as f64 / quota.period().as_secs_f64(),
        registry: format!("{{{}}}:sync:{tag}:nodes", config.prefix),
        key_prefix: format!("{{{}}}:sync:{tag}:", config.prefix),
        node: node.clone(),
        shared: Arc::clone(&shared),
        config,
    };
    let handle = runtime.spawn(task.run(limiter));
    Ok(SyncHandle {
        name: format!("tollgate-sync-{node}"),
        shared,
        task: Some(handle),
    })
}

/// The task's running state.
struct Progress<K> {
    connection: Option<ConnectionManager>,
    nodes: u64,
    failures: u32,
    retry_at: Instant,
    fallback: bool,
    /// Tokens handed out locally during an outage in lease mode, owed to Redis.
    debt: HashMap<K, u64>,
    /// The server window (sliding window) of the leases now held, and extra rounds to
    /// run (task clock): just before the window ends, to lease what its last moments
    /// free, and just after the next one starts.
    lease_window: u64,
    extra_rounds: Vec<tokio::time::Instant>,
    /// When the current server window ends (task clock), and when the last round ran.
    window_end: Option<tokio::time::Instant>,
    last_round: tokio::time::Instant,
}

impl Task {
    async fn connect(&self) -> Result<ConnectionManager, redis::RedisError> {
        let client = redis::Client::open(self.config.url.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.config.timeout))
            .set_response_timeout(Some(self.config.timeout))
            .set_number_of_retries(1);
        ConnectionManager::new_with_config(client, config).await
    }

    async fn run<K, C>(self, limiter: RateLimiter<K, C>)
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
        C: Clock,
    {
        let Some(store) = limiter.synced_store() else {
            return;
        };
        let started = Instant::now();
        let mut p = Progress {
            connection: None,
            nodes: 1,
            failures: 0,
            retry_at: Instant::now(),
            fallback: false,
            debt: HashMap::new(),
            lease_window: 0,
            extra_rounds: Vec::new(),
            window_end: None,
            last_round: tokio::time::Instant::now(),
        };
        let mut ticker = tokio::time::interval(self.config.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Besides every interval, the sliding window runs a round just before each
            // window ends and just after the next one starts.
            let extra = p.extra_rounds.iter().min().copied();
            let extra_at =
                extra.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
            let stopping = tokio::select! {
                _ = ticker.tick() => false,
                _ = tokio::time::sleep_until(extra_at) => {
                    p.extra_rounds.retain(|at| Some(*at) != extra);
                    false
                }
                _ = self.shared.wake.notified() => false,
                _ = self.shared.stop.notified() => true,
            };
            if stopping || Instant::now() >= p.retry_at {
                // Just before a window ends, lease only what can be spent before it does.
                let now = tokio::time::Instant::now();
                let horizon = p
                    .window_end
                    .filter(|end| *end > now)
                    .map(|end| {
                        let left = (end - now).as_secs_f64();
                        let since = (now - p.last_round).as_secs_f64().max(1e-3);
                        left / since
                    })
                    .filter(|fraction| *fraction < 1.0);
                p.last_round = now;
                self.attempt(store, &mut p, stopping, horizon).await;
            }
            if stopping {
                if let Some(c) = &mut p.connection {
                    let _: redis::RedisResult<()> = redis::cmd("ZREM")
                        .arg(&self.registry)
                        .arg(&self.node)
                        .query_async(c)
                        .await;
                }
                return;
            }
            let last = self.shared.stats.lock().last_success;
            if last.unwrap_or(started).elapsed() >= self.config.staleness_or_default() {
                if !p.fallback {
                    p.fallback = true;
                    self.shared.stats.lock().stats.fallback_active = true;
                    match self.config.fallback {
                        Fallback::AllowAll => self.set_override(store, Override::AllowAll),
                        Fallback::DenyAll => self.set_override(store, Override::DenyAll),
                        Fallback::LocalShare => {}
                    }
                }
                if self.config.fallback == Fallback::LocalShare {
                    self.refill_locally(store, p.nodes, &mut p.debt);
                }
            }
        }
    }

    /// Runs one round, connecting first if needed, and records how it went.
    async fn attempt<K>(
        &self,
        store: &Store<K, SyncCell>,
        p: &mut Progress<K>,
        stopping: bool,
        horizon: Option<f64>,
    ) where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    {
        if p.connection.is_none() {
            match tokio::time::timeout(self.config.timeout, self.connect()).await {
                Ok(Ok(c)) => p.connection = Some(c),
                _ => return self.failed(p),
            }
        }
        let Some(connection) = p.connection.clone() else {
            return;
        };
        match self.round(store, &connection, p, stopping, horizon).await {
            Ok(round) => {
                p.failures = 0;
                if round.nodes != p.nodes {
                    p.nodes = round.nodes;
                    self.set_fresh(store, p.nodes);
                }
                if p.fallback {
                    p.fallback = false;
                    self.set_override(store, Override::None);
                }
                let mut cell = self.shared.stats.lock();
                cell.last_success = Some(Instant::now());
                cell.stats.syncs += 1;
                cell.stats.keys_last_round = round.keys;
                cell.stats.nodes = p.nodes;
                cell.stats.clock_offset = round.clock_offset;
                cell.stats.fallback_active = false;
            }
            Err(_) => self.failed(p),
        }
    }

    fn failed<K>(&self, p: &mut Progress<K>) {
        p.failures = p.failures.saturating_add(1);
        let backoff = self
            .config
            .interval
            .saturating_mul(1 << p.failures.min(8))
            .min(MAX_BACKOFF);
        p.retry_at = Instant::now() + backoff;
        self.shared.stats.lock().stats.errors += 1;
    }

    /// One round: report, heartbeat, apply. Nothing is lost on failure: what was taken
    /// from the cells is put back.
    async fn round<K>(
        &self,
        store: &Store<K, SyncCell>,
        connection: &ConnectionManager,
        p: &mut Progress<K>,
        stopping: bool,
        horizon: Option<f64>,
    ) -> Result<Round, redis::RedisError>
    where
        K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    {
        let items = self.collect(store, &mut p.debt, stopping, horizon);
        let sent = Instant::now();
        let result = self.send(connection, &items, p.lease_window).await;
        let received = Instant::now();
        let (nodes, server_now_us, answers) = match result {
            Ok(reply) => reply,
            Err(e) => {
                for item in &items {
                    store.with_state(&item.key, |cell| {
                        if item.ran_out {
                            cell.flags.fetch_or(WANTED, Ordering::Relaxed);
                        }
                        cell.overdrawn.fetch_add(item.spent, Ordering::Relaxed);
                        cell.allowance.fetch_add(item.returned, Ordering::Relaxed);
                        cell.granted.fetch_add(item.returned, Ordering::Relaxed);
                    });
                    if item.charged > item.spent {
                        *p.debt.entry(item.key.clone()).or_insert(0) += item.charged - item.spent;
                    }
                }
                return Err(e);
            }
        };
        let nodes = nodes.max(1);
        let refill = (self.rate_per_sec * self.config.interval.as_secs_f64()).ceil() as u64;
        let local_now = (self.now)();
        let expires = self.lease_deadline(server_now_us, received - sent, local_now, p);
        for (item, answer) in items.iter().zip(answers.chunks(2)) {
            let (lease, left) = (answer[0], answer.get(1).copied().unwrap_or(0));
            store.with_state(&item.key, |cell| {
                cell.expires.store(expires, Ordering::Release);
                cell.allowance.fetch_add(lease, Ordering::AcqRel);
                cell.granted.store(lease, Ordering::Release);
                if self.config.mode == SyncMode::Reconcile && item.used != 0 {
                    // Beyond its lease a key may admit its fair share of what the global
                    // state has left and, if it ran out, of what it regains by the next
                    // round.
                    let regained = if item.ran_out { refill } else { 0 };
                    let overdraft = (left + regained).div_ceil(nodes);
                    let before = cell.overdraft.swap(overdraft, Ordering::AcqRel);
                    // What was spent of the old overdraft while the round was in flight.
                    cell.overdrawn.fetch_add(
                        item.overdraft_left.saturating_sub(before),
                        Ordering::Relaxed,
                    );
                    cell.given.store(overdraft, Ordering::Release);
                }
            });
        }
        let midpoint = sent + (received - sent) / 2;
        let local_ns = midpoint.duration_since(epoch()).as_nanos() as i64;
        Ok(Round {
            nodes,
            keys: items.len(),
            clock_offset: (server_now_us as i64)
                .saturating_mul(1_000)
                .saturating_sub(local_ns),
        })
    }

    /// Until when (limiter clock, ns) what a round grants may be spent: two intervals
    /// (the next round normally replaces it after one; the second absorbs a late round),
    /// and for the sliding window never past the end of Redis's current window, brought
    /// forward by a whole round trip so that the clock offset's error cannot carry a
    /// token into the next window. For the sliding window, also schedules the rounds
    /// around the window's end.
    fn lease_deadline<K>(
        &self,
        server_now_us: u64,
        round_trip: Duration,
        local_now: u64,
        p: &mut Progress<K>,
    ) -> u64 {
        let life = u64::try_from(self.config.interval.as_nanos())
            .unwrap_or(u64::MAX)
            .saturating_mul(2);
        let mut deadline = local_now.saturating_add(life);
        if self.algorithm != Algorithm::SlidingWindow {
            return deadline;
        }
        // Returns are credited to the window the tokens were leased in.
        let period = self.args[1];
        p.lease_window = server_now_us / period;
        // In lease mode a sliding-window lease must not outlive its window; reconcile
        // lets it run into the next one (it is counted in the window it was leased in).
        if self.config.mode == SyncMode::Lease {
            let to_window_end = Duration::from_micros(period - server_now_us % period);
            let margin = u64::try_from(round_trip.as_nanos()).unwrap_or(u64::MAX);
            let end = local_now
                .saturating_add(u64::try_from(to_window_end.as_nanos()).unwrap_or(u64::MAX));
            deadline = deadline.min(end.saturating_sub(margin));
            let now = tokio::time::Instant::now();
            p.window_end = Some(now + to_window_end.saturating_sub(round_trip));
            let before_end =
                to_window_end.saturating_sub(round_trip * 2 + Duration::from_millis(10));
            p.extra_rounds.clear();
            if before_end > Duration::from_millis(5) {
                p.extra_rounds.push(now + before_end);
            }
            p.extra_rounds.push(now + to_window_end + round_trip / 2);
        }
        deadline
    }

    /// Takes what each touched key has to report. Keys nobody touched are not sent.
    fn collect<K>(
        &self,
        store: &Store<K, SyncCell>,
        debt: &mut HashMap<K, u64>,
        stopping: bool,
        horizon: Option<f64>,
    ) -> Vec<Item<K>>
    where
        K: Hash + Eq + Clone + Display,
    {
        let mut items = Vec::new();
        store.for_each(|key, cell| {
            let ran_out = cell.flags.swap(0, Ordering::AcqRel) & WANTED != 0;
            // A lease lives for one round: what is left goes back now.
            let returned = cell.allowance.swap(0, Ordering::AcqRel);
            let lease_spent = cell
                .granted
                .swap(0, Ordering::AcqRel)
                .saturating_sub(returned);
            // The overdraft stays usable while the round is in flight: what is spent of it
            // from now on is measured against what is left now, when the answer replaces
            // it; an idle key keeps its overdraft.
            let overdraft_left = cell.overdraft.load(Ordering::Acquire);
            let overdraft_spent = cell
                .given
                .swap(overdraft_left, Ordering::AcqRel)
                .saturating_sub(overdraft_left);
            let spent = overdraft_spent + cell.overdrawn.swap(0, Ordering::AcqRel);
            let owed = debt.remove(key).unwrap_or(0);
            let used = lease_spent + spent;
            let active = used != 0 || ran_out;
            // A key that was used is leased anew, sized to that use: twice it if it ran
            // out, a quarter more if it did not.
            let count = used.max(1);
            let wanted = if stopping || !active {
                0
            } else if let Some(fraction) = horizon {
                // What the key would use until the window ends, at its recent rate.
                ((count as f64 * fraction * 1.25).ceil() as u64 + 1).min(self.capacity)
            } else if ran_out {
                (count * 2).min(self.capacity)
            } else {
                (count + count / 4 + 1).min(self.capacity)
            };
            if active || returned > 0 || owed > 0 {
                items.push(Item {
                    key: key.clone(),
                    used: if active { count } else { 0 },
                    ran_out,
                    charged: spent + owed,
                    spent,
                    overdraft_left,
                    returned,
                    wanted,
                });
            }
        });
        items
    }

    /// Sends the items in chunks of `batch_size`, all chunks pipelined in one round trip
    /// (an empty round still heartbeats). Returns (nodes, server time µs, answers).
    async fn send<K: Display>(
        &self,
        connection: &ConnectionManager,
        items: &[Item<K>],
        lease_window: u64,
    ) -> Result<(u64, u64, Vec<u64>), redis::RedisError> {
        let mut pipe = redis::pipe();
        let ttl_ms = self.config.node_ttl_or_default().as_millis().max(1) as u64;
        let chunks: Vec<&[Item<K>]> = if items.is_empty() {
            vec![&[]]
        } else {
            items.chunks(self.config.batch_size).collect()
        };
        for chunk in &chunks {
            let cmd = pipe
                .cmd("EVALSHA")
                .arg(self.script.get_hash())
                .arg(chunk.len() + 1)
                .arg(&self.registry);
            for item in chunk.iter() {
                cmd.arg(format!("{}{{{}}}", self.key_prefix, item.key));
            }
            cmd.arg(&self.node)
                .arg(ttl_ms)
                .arg(self.args[0])
                .arg(self.args[1])
                .arg(self.args[2])
                .arg(lease_window);
            for item in chunk.iter() {
                cmd.arg(item.charged).arg(item.returned).arg(item.wanted);
            }
        }
        let mut connection = connection.clone();
        let replies: Vec<Vec<u64>> = match pipe.query_async(&mut connection).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.script
                    .prepare_invoke()
                    .load_async(&mut connection)
                    .await?;
                pipe.query_async(&mut connection).await?
            }
            other => other?,
        };
        let mut nodes = 1;
        let mut now = 0;
        let mut answers = Vec::with_capacity(items.len() * 2);
        for reply in replies {
            if let [n, t, rest @ ..] = reply.as_slice() {
                nodes = *n;
                now = *t;
                answers.extend_from_slice(rest);
            }
        }
        Ok((nodes, now, answers))
    }

    /// A key first seen on this node may overdraft its share of the capacity until its
    /// first round (reconcile mode); in lease mode it waits for a lease.
    fn set_fresh<K: Hash + Eq>(&self, store: &Store<K, SyncCell>, nodes: u64) {
        let policy = store.default_policy();
        let fresh = match self.config.mode {
            SyncMode::Reconcile => self.capacity.div_ceil(nodes),
            SyncMode::Lease => 0,
        };
        if policy.fresh != fresh {
            store.set_policy(SyncPolicy { fresh, ..policy }, 0);
        }
    }

    fn set_override<K: Hash + Eq>(&self, store: &Store<K, SyncCell>, override_: Override) {
        let policy = store.default_policy();
        store.set_policy(
            SyncPolicy {
                override_,
                ..policy
            },
            0,
        );
    }

    /// [`Fallback::LocalShare`]: each key may admit `rate / N` per interval, up to
    /// `⌈capacity / N⌉`, charged to the global state once Redis answers again.
    fn refill_locally<K>(&self, store: &Store<K, SyncCell>, nodes: u64, debt: &mut HashMap<K, u64>)
    where
        K: Hash + Eq + Clone,
    {
        let nodes = nodes.max(1);
        let refill =
            ((self.rate_per_sec * self.config.interval.as_secs_f64() / nodes as f64).ceil() as u64)
                .max(1);
        let cap = self.capacity.div_ceil(nodes);
        let lease = self.config.mode == SyncMode::Lease;
        store.for_each(|key, cell| {
            cell.expires.store(u64::MAX, Ordering::Release);
            // Reconcile charges overdrafts as they are used; lease mode charges whatever
            // it handed out.
            let (pool, record) = if lease {
                (&cell.allowance, &cell.granted)
            } else {
                (&cell.overdraft, &cell.given)
            };
            let mut granted = 0;
            let _ = pool.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                granted = cap.saturating_sub(left).min(refill);
                (granted > 0).then_some(left + granted)
            });
            record.fetch_add(granted, Ordering::AcqRel);
            if granted > 0 && lease {
                *debt.entry(key.clone()).or_insert(0) += granted;
            }
        });
    }
}

/// The instant the local side of the clock offset is measured from.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}
