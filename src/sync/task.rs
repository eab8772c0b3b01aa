//! The sync task: one per limiter, on tokio. It makes no protocol decision: it sleeps
//! until its [`Node`] wants it, sends what the node gives over the connection, feeds the
//! replies back, and publishes the node's events and counters. Everything a node decides
//! is in `node` (which the simulation drives too).

use std::collections::HashSet;
use std::fmt::Display;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use redis::Value;

use super::agree;
use super::config::Settings;
use super::driver;
use super::limiter::SyncedLimiter;
use super::node::{self, Event, Failure, Node, NodeConfig, Replies, Transmit};
use super::wire::{Command, Script, SettingsCall, SettingsReply};
use super::{FailMode, RedisSync, Shared, SyncHandle};
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::redis::connection::Link;
use crate::redis::scripts::{SYNC_HOT_KEYS, SYNC_ROUND, SYNC_SETTINGS};

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

/// What the task needs besides its node.
struct Io {
    settings: Settings,
    config: RedisSync,
    round: redis::Script,
    hot_keys: redis::Script,
    settings_script: redis::Script,
    shared: Arc<Shared>,
    /// The limiter's name, for metrics.
    name: Arc<str>,
    /// How many clones of the limiter the task itself holds: once no other is left, the
    /// limiter is gone for its users, and the node flushes and stops.
    own_handles: usize,
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
    let shared = Arc::new(Shared::default());
    let now = limiter.clock().now_ns();
    let node = Node::new(node_config, driver::seed(id), now);
    let for_run = limiter.clone();
    let io = Io {
        name: Arc::from(limiter.name()),
        settings,
        config,
        round: redis::Script::new(SYNC_ROUND),
        hot_keys: redis::Script::new(SYNC_HOT_KEYS),
        settings_script: redis::Script::new(SYNC_SETTINGS),
        shared: Arc::clone(&shared),
        // `limiter` and `for_run`: every clone but the caller's (`build_synced` keeps
        // one, which it returns).
        own_handles: limiter.handles() - 1,
    };
    let handle = runtime.spawn(supervise(Arc::new(io), node, limiter, for_run, guard));
    Ok(SyncHandle {
        name: format!("tollgate-sync-{id:016x}"),
        shared,
        task: Some(handle),
        also: Vec::new(),
    })
}

/// Runs the task; if it dies, records it and applies the fail mode until stopped or the
/// limiter's users have all dropped it.
async fn supervise<K, C>(
    io: Arc<Io>,
    node: Node<K>,
    limiter: SyncedLimiter<K, C>,
    for_run: SyncedLimiter<K, C>,
    _guard: PrefixGuard,
) where
    K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    C: Clock,
{
    let config = node.config().clone();
    let mut inner = AbortOnDrop(tokio::spawn(run(Arc::clone(&io), node, for_run)));
    if (&mut inner.0).await.is_ok() {
        return;
    }
    let store = limiter.store();
    let nodes = {
        let mut cell = io.shared.stats.lock();
        cell.stats.task_died = true;
        cell.stats.fallback_active = true;
        cell.stats.nodes.max(1)
    };
    io.shared.settle();
    super::observe::sync_died(&io.name, &config.fail_mode);
    node::apply_fail_mode(config.fail_mode, store);
    // The rest of the process's life is the dead task's, less its own clone.
    let own = io.own_handles - 1;
    let mut refill = tokio::time::interval(io.config.interval);
    let mut alive = tokio::time::interval(ALIVE_EVERY);
    loop {
        tokio::select! {
            _ = refill.tick(), if config.fail_mode == FailMode::Local => {
                node::refill_dead(&config, store, nodes, limiter.clock().now_ns());
            }
            _ = alive.tick() => {
                if limiter.handles() <= own {
                    return;
                }
            }
            _ = io.shared.stop.notified() => return,
        }
    }
}

/// The replies of one transmit on their way, with the link they went over.
type InFlight = Pin<Box<dyn Future<Output = (Option<Arc<Link>>, Replies)> + Send>>;

/// The node's loop: send what it wants sent, sleep until it wants to run, feed back what
/// came.
async fn run<K, C>(io: Arc<Io>, mut node: Node<K>, limiter: SyncedLimiter<K, C>)
where
    K: Hash + Eq + Clone + Display + Send + Sync + 'static,
    C: Clock,
{
    let store = limiter.store();
    let clock = limiter.clock();
    let mut link: Option<Arc<Link>> = None;
    let mut in_flight: Option<(u64, InFlight)> = None;
    let mut alive = tokio::time::interval(ALIVE_EVERY);
    loop {
        let now = clock.now_ns();
        if in_flight.is_none() {
            if let Some(transmit) = node.poll_transmit(now, store) {
                let wait = Duration::from_nanos(transmit.deadline.saturating_sub(now));
                let sent = send(Arc::clone(&io), link.clone(), transmit, wait);
                in_flight = Some((sent.0, Box::pin(sent.1)));
            }
        }
        io.publish(&mut node, clock.now_ns());
        if node.is_closed() {
            return;
        }
        let sleep = tokio::time::sleep(Duration::from_nanos(
            node.poll_timeout().saturating_sub(now),
        ));
        let replies = async {
            match &mut in_flight {
                Some((_, replies)) => replies.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            (used, replies) = replies => {
                link = used;
                let (id, _) = in_flight.take().expect("a transmit in flight");
                node.handle_replies(clock.now_ns(), store, id, replies);
            }
            () = sleep => node.handle_timeout(clock.now_ns(), store),
            // A key waits for a lease: a round now, unless the rounds back off.
            () = io.shared.wake.notified() => node.wake(clock.now_ns(), store),
            () = io.shared.stop.notified() => node.close(clock.now_ns()),
            // Whether the limiter's users have all dropped it (and the handle, or kept it
            // without calling `shutdown`): then flush, and stop.
            _ = alive.tick() => {
                if limiter.handles() <= io.own_handles {
                    node.close(clock.now_ns());
                }
            }
        }
        // What the node gave up on is dropped (the connection is rebuilt: see `send`).
        if in_flight
            .as_ref()
            .is_some_and(|(id, _)| node.awaiting() != Some(*id))
        {
            in_flight = None;
            if let Some(link) = &link {
                link.failed();
            }
        }
        #[cfg(test)]
        if io.shared.poison.load(Ordering::Acquire) {
            panic!("poisoned for a test");
        }
    }
}

impl Io {
    /// Publishes the node's events and counters, and whether it is settled.
    fn publish<K>(&self, node: &mut Node<K>, now: u64)
    where
        K: Hash + Eq + Clone + Display,
    {
        let mut succeeded = false;
        while let Some(event) = node.poll_event() {
            match event {
                Event::Round {
                    ok,
                    took_ns,
                    fallback,
                    nodes,
                } => {
                    succeeded |= ok;
                    let took = Duration::from_nanos(took_ns);
                    super::observe::sync_round(&self.name, ok, took, fallback, nodes);
                }
                Event::Error {
                    kind,
                    message,
                    changed,
                } => super::observe::sync_error(&self.name, kind, &message, changed),
                Event::Fallback { entered, nodes } => {
                    if entered {
                        super::observe::sync_state(&self.name, true, nodes);
                    }
                    super::observe::sync_fallback(&self.name, entered, &self.config.fail_mode);
                }
                Event::Budget { keys } => super::observe::sync_budget(&self.name, keys),
                Event::Disagreement(d) => {
                    super::observe::sync_disagreement(&self.name, d.setting, &d.ours, &d.theirs);
                }
            }
        }
        let mut cell = self.shared.stats.lock();
        if succeeded {
            cell.last_success = Some(Instant::now());
        }
        // Redis's clock minus the wall clock: Redis's minus the limiter's, plus the
        // limiter's minus the wall clock's.
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
        let clock_offset = node.redis_offset_ns().map_or(0, |offset| {
            let offset = i128::from(offset) + i128::from(now) - wall;
            i64::try_from(offset).unwrap_or(if offset < 0 { i64::MIN } else { i64::MAX })
        });
        cell.stats = super::SyncStats {
            clock_offset,
            task_died: cell.stats.task_died,
            ..node.stats()
        };
        drop(cell);
        if node.is_settled() {
            self.shared.settle();
        }
    }
}

/// Sends a transmit's pipelines side by side over `link` (connecting first if there is
/// none), waiting at most `wait` for each, and returns the link with what each pipeline
/// got (a timeout for one that had no reply by then).
fn send(
    io: Arc<Io>,
    link: Option<Arc<Link>>,
    transmit: Transmit,
    wait: Duration,
) -> (
    u64,
    impl Future<Output = (Option<Arc<Link>>, Replies)> + Send,
) {
    let id = transmit.id;
    let replies = async move {
        let deadline = tokio::time::Instant::now() + wait;
        let timed_out = |n| vec![Err(Failure::timeout()); n];
        let link = match link {
            Some(link) => link,
            None => {
                let connect = Link::connect(io.settings.client.clone(), io.settings.timeout);
                match tokio::time::timeout_at(deadline, connect).await {
                    Ok(Ok(link)) => link,
                    Ok(Err(e)) => {
                        return (None, vec![Err(io.failure(&e)); transmit.pipelines.len()]);
                    }
                    Err(_) => return (None, timed_out(transmit.pipelines.len())),
                }
            }
        };
        let replies: Replies =
            futures_util::future::join_all(transmit.pipelines.iter().map(|pipeline| async {
                tokio::time::timeout_at(deadline, io.query(&link, pipeline))
                    .await
                    .unwrap_or_else(|_| Err(Failure::timeout()))
            }))
            .await;
        if replies.iter().any(Result::is_err) {
            // On a cluster, a fresh connection is made in the background and replaces
            // this one once it connects (see `Link`).
            link.failed();
        }
        (Some(link), replies)
    };
    (id, replies)
}

impl Io {
    /// Sends one pipeline (`EVALSHA`, or `EVAL` with the source, which also caches the
    /// script on the node, if Redis lost it).
    async fn query(&self, link: &Link, commands: &[Command]) -> Result<Vec<Value>, Failure> {
        let pipeline = |eval: bool| {
            let mut pipe = redis::pipe();
            for command in commands {
                let cmd = match (command.script, eval) {
                    (Script::Leave, _) => pipe.cmd("ZREM"),
                    (Script::Round, true) => pipe.cmd("EVAL").arg(SYNC_ROUND),
                    (Script::HotKeys, true) => pipe.cmd("EVAL").arg(SYNC_HOT_KEYS),
                    (Script::Settings, true) => pipe.cmd("EVAL").arg(SYNC_SETTINGS),
                    (Script::Settings, false) => {
                        pipe.cmd("EVALSHA").arg(self.settings_script.get_hash())
                    }
                    (Script::Round, false) => pipe.cmd("EVALSHA").arg(self.round.get_hash()),
                    (Script::HotKeys, false) => pipe.cmd("EVALSHA").arg(self.hot_keys.get_hash()),
                };
                if command.script != Script::Leave {
                    cmd.arg(command.keys.len());
                }
                cmd.arg(&command.keys).arg(&command.args);
            }
            pipe
        };
        let mut connection = link.get();
        let replies = match pipeline(false)
            .query_async::<Vec<Value>>(&mut connection)
            .await
        {
            // After a restart or a failover the node lacks the script: `EVAL` goes to the
            // node of these keys only, as the limiter's checks do (a `SCRIPT LOAD` goes
            // to every node of a cluster, and fails while one is down). Replaying the
            // pipeline is safe: a call Redis applied answers `stale`.
            Err(e) if e.code() == Some("NOSCRIPT") => {
                pipeline(true).query_async(&mut connection).await
            }
            other => other,
        };
        replies.map_err(|e| self.failure(&e))
    }

    /// A failed call, with no password in its message.
    fn failure(&self, e: &redis::RedisError) -> Failure {
        Failure {
            kind: error_kind(e),
            message: self.config.options.target.scrub(&e.to_string()),
        }
    }
}

/// The [`SyncStats::last_error`](super::SyncStats::last_error) of a failed call.
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
    } else if e.is_timeout() {
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
