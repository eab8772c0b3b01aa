//! Background sync (cargo feature `redis`): a local limiter that approximates — or, with
//! [`SyncMode::Lease`], never exceeds — one global limit shared by many nodes through
//! Redis.
//!
//! Checks stay local. A synced key holds, on each node, tokens **leased** from the global
//! state (already charged to it) and, in reconcile mode, an **overdraft** (charged at the
//! next round); a check spends them by CAS — no await, no I/O, no lock shared with the
//! sync task. Every `interval` one tokio task per limiter sends, for the keys touched
//! since its last round only, what they used, what is left of their lease (returned) and
//! what they want next, in one script call per [`RedisSync::batch_size`] keys, all
//! pipelined in one round trip together with the node's heartbeat, and applies what comes
//! back. Sync traffic is O(active keys), never O(requests).
//!
//! # Modes and their bounds
//!
//! Let `B` be the capacity (the burst for the token bucket, the limit for the sliding
//! window), `r` the rate, `N` the number of live nodes, `I` the sync interval and `Δ` a
//! round trip. A lease is sized to the key's use in the last round (twice it if the key
//! ran out, a quarter more if not; just before a sliding window ends, what can still be
//! spent in it), lives until the next round replaces it and at most `2·I`, and what is
//! left of it goes back at the next round.
//!
//! - [`SyncMode::Lease`] (strict). A node admits only leased tokens, reserved by an atomic
//!   script, so the global state is never overdrawn. Because a token may be spent up to
//!   `2·I` after it was reserved, all nodes together admit at most `B + r·(t + 2·I)` in any
//!   interval of length `t` (token bucket); a sliding-window lease never outlives its
//!   window (it expires a round trip before the window ends by the node's estimate of
//!   Redis's clock), so at most the limit is admitted per window of Redis's clock. A new
//!   key is denied until its first lease arrives (within one interval). Under-admission
//!   is bounded by the leases held but not spent: about a quarter of each key's use per
//!   round, returned at the next round, plus, for the sliding window, what frees up after
//!   a window's last round.
//! - [`SyncMode::Reconcile`] (approximate). As lease mode, but a key that ran out may also
//!   admit its fair share of what the global state has left plus what it regains by the
//!   next round, `⌈(left + r·I) / N⌉`, charged at the next round (even past the capacity:
//!   the global state keeps the debt, so it stays true, and the following leases shrink
//!   by it). Overdrafts handed out in one round sum to at most `left + r·I + N` with
//!   `left ≤ B`, so in any interval of length `t` all nodes together admit at most
//!
//!   ```text
//!   B + r·(t + I + Δ) + B + N        (token bucket)
//!   2·B + N per window               (sliding window)
//!   ```
//!
//!   A fresh key may overdraft `⌈B / N⌉` on each node before its first round, which the
//!   bound already counts.
//!
//! `TokenBucket` and `SlidingWindow` are supported; other algorithms are refused when the
//! sync starts, with a [`ConfigError`](crate::ConfigError).
//!
//! # Outages
//!
//! The check path never touches Redis, so an outage cannot block it. When no round has
//! succeeded for [`RedisSync::staleness`], the [`Fallback`] applies: by default
//! [`Fallback::LocalShare`], where every key may admit `r / N` per interval up to
//! `⌈B / N⌉` with the last known `N`, leases stop expiring, and everything admitted is
//! charged to the global state when Redis answers again (in `u64` counters per key, which
//! cannot overflow in practice), so the global view stays true. The task retries with
//! exponential backoff up to 2 s; the connection manager reconnects by itself.
//!
//! # Clocks
//!
//! Global state uses Redis's `TIME` only, so a node whose clock is skewed or jumps cannot
//! mint tokens; the local side counts tokens, and reads its monotonic clock only to expire
//! leases. Each round estimates the offset of Redis's clock from the local monotonic clock
//! at the round trip's midpoint ([`SyncStats::clock_offset`]); a sliding-window lease
//! expires a whole round trip before the window ends by that estimate, more than the
//! estimate's error.
//!
//! # Nodes
//!
//! Each node heartbeats a sorted set in Redis every round; a node whose heartbeat is
//! older than [`RedisSync::node_ttl`] (3 intervals by default) drops out of `N` at the
//! next round of any other node, i.e. within `node_ttl + I`. All of a limiter's keys
//! share the hash tag `{prefix}`, so one script call may touch them in Redis Cluster.

mod cell;
mod config;
#[cfg(test)]
mod differential;
mod node;
mod protocol;
#[cfg(test)]
mod sim;
mod task;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub(crate) use cell::{SyncCell, SyncPolicy};
pub(crate) use config::redact_url;
pub use config::{Fallback, RedisSync, SyncMode};

/// A snapshot of a sync task's health.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Live nodes, as last seen in Redis (at least 1).
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
    /// Synced keys released (lease returned) and dropped after going idle.
    pub keys_released: u64,
    /// The sync task died (a bug): checks apply the configured [`Fallback`] from then on.
    pub task_died: bool,
}

/// The state a sync task shares with its handle.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) stats: Mutex<StatsCell>,
    pub(crate) wake: tokio::sync::Notify,
    pub(crate) stop: tokio::sync::Notify,
    /// Makes the task panic at its next wake-up, to test the supervisor.
    #[cfg(test)]
    pub(crate) poison: std::sync::atomic::AtomicBool,
}

/// The task's counters; ages are computed when read.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    pub(crate) last_success: Option<std::time::Instant>,
    pub(crate) stats: SyncStats,
}

/// The running sync task of one limiter. Dropping it stops the task at once (pending
/// consumption is then lost); [`shutdown`](Self::shutdown) flushes first.
#[derive(Debug)]
pub struct SyncHandle {
    name: String,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
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

    /// A snapshot of the task's health.
    pub fn stats(&self) -> SyncStats {
        let cell = self.shared.stats.lock();
        SyncStats {
            last_success_age: cell.last_success.map(|t| t.elapsed()),
            ..cell.stats
        }
    }

    /// Asks for a round now (the task also runs one every interval).
    pub fn sync_now(&self) {
        self.shared.wake.notify_one();
    }

    /// Stops the task after a last round that reports all pending consumption, returns
    /// every leased token and leaves the node registry.
    pub async fn shutdown(mut self) {
        self.shared.stop.notify_one();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for SyncHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

pub(crate) use task::start;
