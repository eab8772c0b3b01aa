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
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::limiter::SyncedLimiter;
use super::node::{self, Event, Node, Replies};
use super::transport::{Transport, send};
use super::{FailMode, RedisSync, TaskShared};
use crate::clock::Clock;
use crate::error::ConfigError;
use crate::redis::connection::Link;

/// How often the task looks whether the limiter's users have all dropped it.
const ALIVE_EVERY: Duration = Duration::from_millis(250);

/// The prefixes (with the algorithm) in use by this process's synced limiters.
static IN_USE: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Holds a prefix for as long as its limiter's task runs.
pub(super) struct PrefixGuard(Option<String>);

impl PrefixGuard {
    pub(super) fn claim(name: String, shared: bool) -> Result<Self, ConfigError> {
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
pub(super) struct Io {
    pub(super) transport: Arc<Transport>,
    pub(super) config: RedisSync,
    pub(super) shared: Arc<TaskShared>,
    /// The limiter's name, for metrics.
    pub(super) name: Arc<str>,
    /// How many clones of the limiter the task itself holds: once no other is left, the
    /// limiter is gone for its users, and the node flushes and stops.
    pub(super) own_handles: usize,
}

/// Runs the task; if it dies, records it and applies the fail mode until stopped or the
/// limiter's users have all dropped it.
pub(super) async fn supervise<K, C>(
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
            _ = refill.tick(), if config.fail_mode == FailMode::LocalShare => {
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
                let sent = send(Arc::clone(&io.transport), link.clone(), transmit, wait);
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
