//! Background sync (cargo feature `redis`): a local limiter, [`SyncedLimiter`] (made by
//! [`Builder::build_synced`](crate::Builder::build_synced)), that approximates — or, with
//! [`SyncMode::Lease`], never exceeds — one global limit shared by many nodes through
//! Redis, while its checks stay local (a CAS, no I/O).
//!
//! The user's guide, with the bounds, the fail modes and what each setting does, is
//! [`guide::sync`](crate::guide::sync). The protocol's internals are documented where they
//! are implemented: `node` (every decision a node makes, as an I/O-free state machine),
//! `node::round` (what a round carries, and the max-min fair shares), `node::cold` (the
//! cold tier), `protocol` (one key's round as pure arithmetic), `wire` (the scripts' calls
//! and replies), `task` and `transport` (the tokio side), and, for tests, `model`, `sim`
//! and `differential`.

mod agree;
mod books;
mod build;
mod cell;
mod config;
#[cfg(test)]
mod differential;
mod driver;
mod key;
mod limiter;
#[cfg(test)]
mod model;
mod node;
mod observe;
mod plans;
mod protocol;

#[cfg(test)]
mod sim;
mod task;
mod transport;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use config::{FailMode, RedisSync, SyncMode};
pub use limiter::SyncedLimiter;
pub use plans::{SyncedPlans, SyncedPlansBuilder};

/// A snapshot of a sync task's health.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SyncStats {
    /// Time since the last successful round, if there was one.
    pub last_success_age: Option<Duration>,
    /// Successful rounds.
    pub syncs: u64,
    /// Failed rounds.
    pub errors: u64,
    /// Keys sent in the last successful round.
    pub keys_last_round: usize,
    /// Whether the fallback policy is in force.
    pub fallback_active: bool,
    /// Live nodes, as last seen in Redis (0 before the first successful round).
    pub nodes: u64,
    /// Redis's clock minus this machine's wall clock, in nanoseconds, estimated at the
    /// midpoint of the last successful round trip (0 before the first).
    pub clock_offset: i64,
    /// Keys that needed a round but did not fit in the last one (see
    /// [`RedisSync::round_keys`]); they go in the next rounds.
    pub keys_waiting: usize,
    /// Answers Redis marked stale (a round older than one it had applied); they change
    /// nothing.
    pub stale_answers: u64,
    /// Synced keys released (lease returned) and dropped after going idle; while rounds
    /// are saturated, an idle key with nothing to report is released without a round
    /// (its lease given up, not returned: Redis charged it when it granted it).
    pub keys_released: u64,
    /// The sync task died (a bug): checks apply the configured [`FailMode`] from then on.
    pub task_died: bool,
    /// Why the last round failed, while rounds fail (`None` once one succeeds):
    /// `authentication` (a wrong password or user: fix the URL; retrying will not help),
    /// `timeout`, `unavailable` (refused, dropped, or a cluster slot without a master),
    /// `script` (Redis refused the round's script), `reply` (an answer the task cannot
    /// read), `unknown_master` (no sentinel monitors the master name given to
    /// [`RedisSync::sentinel`]) or `redis` (any other error reply).
    pub last_error: Option<&'static str>,
    /// Whether this node admits on cold keys now (see [`RedisSync::cold_keys`]): on
    /// once it has read the keys turned hot, off once it has not for `share_ttl`.
    pub cold_tier: bool,
    /// Keys announced as hot, as this node last read them.
    pub hot_keys: usize,
    /// Keys this node turned from cold to hot (its own share ran out, or another node
    /// announced them).
    pub keys_turned_hot: u64,
    /// Keys this node returned from hot to cold (no node announced them any more, and
    /// their demand here was below this node's even share).
    pub keys_cooled: u64,
    /// Keys whose reserved share ran out during an outage, so that they got the
    /// fallback's one-time budget (counted each time; each is a `warn` event).
    pub keys_on_budget: u64,
    /// The first setting on which another node of this prefix differs, as last read
    /// (`algorithm`, `mode`, `cold_keys` or `quota`; a `warn` event says whose value):
    /// nodes that share a prefix share its keys' state, and must agree on them, or the
    /// bound does not hold. `None` while they agree.
    pub settings_differ: Option<&'static str>,
}

impl SyncStats {
    /// This snapshot and `other`'s together (see [`SyncHandle::stats`]).
    fn with(self, other: &SyncStats) -> SyncStats {
        SyncStats {
            last_success_age: match (self.last_success_age, other.last_success_age) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            },
            syncs: self.syncs + other.syncs,
            errors: self.errors + other.errors,
            keys_last_round: self.keys_last_round + other.keys_last_round,
            fallback_active: self.fallback_active || other.fallback_active,
            nodes: self.nodes.min(other.nodes),
            clock_offset: self.clock_offset,
            keys_waiting: self.keys_waiting + other.keys_waiting,
            stale_answers: self.stale_answers + other.stale_answers,
            keys_released: self.keys_released + other.keys_released,
            task_died: self.task_died || other.task_died,
            last_error: self.last_error.or(other.last_error),
            cold_tier: self.cold_tier && other.cold_tier,
            hot_keys: self.hot_keys + other.hot_keys,
            keys_turned_hot: self.keys_turned_hot + other.keys_turned_hot,
            keys_cooled: self.keys_cooled + other.keys_cooled,
            keys_on_budget: self.keys_on_budget + other.keys_on_budget,
            settings_differ: self.settings_differ.or(other.settings_differ),
        }
    }
}

/// The state a sync task shares with its handle.
#[derive(Debug, Default)]
pub(crate) struct TaskShared {
    pub(crate) stats: Mutex<StatsCell>,
    pub(crate) wake: tokio::sync::Notify,
    pub(crate) stop: tokio::sync::Notify,
    /// Whether checks decide as they will from now on (see [`SyncHandle::ready`]).
    settled: std::sync::atomic::AtomicBool,
    /// Wakes [`SyncHandle::ready`] when `settled` turns true.
    settled_now: tokio::sync::Notify,
    /// Makes the task panic at its next wake-up, to test the supervisor.
    #[cfg(test)]
    pub(crate) poison: std::sync::atomic::AtomicBool,
}

impl TaskShared {
    /// Marks the sync settled (once): the first round has been answered and, with the
    /// cold tier, the keys turned hot elsewhere have been read; or the fail mode applies;
    /// or the task has stopped.
    pub(crate) fn settle(&self) {
        if !self.settled.swap(true, std::sync::atomic::Ordering::AcqRel) {
            self.settled_now.notify_waiters();
        }
    }

    pub(crate) fn is_settled(&self) -> bool {
        self.settled.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The task's counters; ages are computed when read.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    pub(crate) last_success: Option<std::time::Instant>,
    pub(crate) stats: SyncStats,
}

/// The running sync task of one limiter, for its [`stats`](Self::stats) and an explicit
/// [`shutdown`](Self::shutdown).
///
/// **Dropping the handle leaves the sync running for the limiter's life:** once every
/// clone of the limiter has been dropped too, the task runs a last round that reports
/// what was admitted and returns every lease (as `shutdown` does), then stops, within a
/// second or one interval. `shutdown` stops it now, and returns once that round is done.
///
/// ```no_run
/// use tollgate::sync::RedisSync;
/// use tollgate::RateLimiter;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (limiter, handle) = RateLimiter::<u64>::builder("10/s".parse()?)
///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
/// limiter.check(&1);
/// let stats = handle.stats();
/// if stats.fallback_active {
///     eprintln!("Redis unreachable: {:?}", stats.last_error);
/// }
/// handle.shutdown().await; // reports what this node admitted, returns its leases
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "dropping the handle leaves the sync running until the limiter is dropped; \
              keep it for `stats()` and a flushing `shutdown().await`"]
pub struct SyncHandle {
    name: String,
    shared: Arc<TaskShared>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// The tasks of the limiter's [`also`](crate::Builder::also) quotas, in order.
    also: Vec<SyncHandle>,
}

impl SyncHandle {
    /// The task's name: `tollgate-sync-<node id>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node id this limiter heartbeats under.
    pub fn node_id(&self) -> &str {
        self.name.trim_start_matches("tollgate-sync-")
    }

    /// The handle of the limiter's own quota's task, standing for the tasks of its
    /// [`also`](crate::Builder::also) quotas too.
    pub(crate) fn with_also(self, also: Vec<SyncHandle>) -> Self {
        Self { also, ..self }
    }

    /// A snapshot of the task's health. With [`also`](crate::Builder::also) quotas (a
    /// task each), the tasks' snapshots together: the counters summed, the fault flags
    /// (`fallback_active`, `task_died`) set if any task's is, `cold_tier` only if every
    /// task's is, the oldest success (none until every task has had one), the fewest
    /// nodes seen, the first task's clock offset, and the first error;
    /// [`quota_stats`](Self::quota_stats) has each.
    pub fn stats(&self) -> SyncStats {
        self.also
            .iter()
            .fold(self.own_stats(), |all, also| all.with(&also.own_stats()))
    }

    /// Each quota's task's snapshot: the limiter's own quota first, then each
    /// [`also`](crate::Builder::also) quota in the order they were added.
    ///
    /// ```no_run
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (_limiter, handle) = RateLimiter::<u64>::builder("10/s".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// for (quota, stats) in handle.quota_stats().iter().enumerate() {
    ///     if stats.fallback_active {
    ///         eprintln!("quota {quota}: Redis unreachable: {:?}", stats.last_error);
    ///     }
    /// }
    /// handle.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn quota_stats(&self) -> Vec<SyncStats> {
        std::iter::once(self)
            .chain(&self.also)
            .map(SyncHandle::own_stats)
            .collect()
    }

    fn own_stats(&self) -> SyncStats {
        let cell = self.shared.stats.lock();
        SyncStats {
            last_success_age: cell.last_success.map(|t| t.elapsed()),
            ..cell.stats
        }
    }

    /// Waits until the limiter's checks decide as they will from now on: until the first
    /// round has been answered and, with the cold tier (`RedisSync::cold_keys`), this node
    /// has read which keys are hot elsewhere. Until then a new key's check is denied
    /// (with a `retry_after` of one interval), since this node cannot yet vouch for its
    /// share. If Redis does not answer, it returns once the fail mode applies (at the
    /// first failed round of a node that has never heard Redis, else after the
    /// staleness); it also returns if the task has stopped.
    ///
    /// Await it before serving when the first requests matter, or bound it with
    /// `tokio::time::timeout`.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (limiter, handle) = RateLimiter::<String>::builder("100/s".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// tokio::time::timeout(Duration::from_secs(2), handle.ready()).await?;
    /// assert!(limiter.check("first-request").is_allowed());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn ready(&self) {
        for also in &self.also {
            also.ready_own().await;
        }
        self.ready_own().await;
    }

    async fn ready_own(&self) {
        loop {
            let notified = self.shared.settled_now.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a settle in between still wakes it.
            notified.as_mut().enable();
            if self.shared.is_settled() {
                return;
            }
            notified.await;
        }
    }

    /// Asks for a round now (the task also runs one every interval).
    pub fn sync_now(&self) {
        self.shared.wake.notify_one();
        for also in &self.also {
            also.sync_now();
        }
    }

    /// Stops the task after a last round that reports all pending consumption, returns
    /// every leased token and leaves the node registry. The limiter denies every check
    /// after it (with no round to report them, its admissions would go uncharged, and its
    /// share is the other nodes' again): shut down when the node is about to stop
    /// serving.
    pub async fn shutdown(mut self) {
        for also in &self.also {
            also.shared.stop.notify_one();
        }
        self.shared.stop.notify_one();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        for also in std::mem::take(&mut self.also) {
            Box::pin(also.shutdown()).await;
        }
    }
}
