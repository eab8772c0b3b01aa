//! What a check decides when Redis cannot answer: one policy for both Redis-backed tiers.

use crate::quota::Quota;

/// What a check does when Redis cannot decide: the fail mode of both Redis-backed tiers,
/// the exact one ([`RedisLimiter::check_or`](crate::redis::RedisLimiter::check_or), the
/// HTTP layer's Redis backend) and the sync ([`RedisSync::fail_mode`](crate::sync::RedisSync::fail_mode)).
///
/// | variant | the Redis tier (Redis failed, or its breaker is open) | the sync (Redis silent for the staleness, or its task died) |
/// |---|---|---|
/// | `Open` | admits | admits |
/// | `Closed` | denies, `retry_after` one emission interval | denies |
/// | `LocalShare` (the sync's default) | this node's share of the quota, in process | this node's share while Redis keeps it reserved, then a one-time budget |
/// | `Local(quota)` | `quota` per key, in process | refused at build ([`ConfigError::Unsupported`](crate::ConfigError::Unsupported)) |
///
/// ```no_run
/// use tollgate::FailMode;
/// use tollgate::redis::RedisLimiter;
/// use tollgate::sync::RedisSync;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = RedisLimiter::builder("redis://127.0.0.1:6379/", "100/s".parse()?)
///     .build()
///     .await?;
/// // With 4 nodes, each admits a quarter of the global quota while Redis is away.
/// let decision = limiter.check_or("user_1024", FailMode::Local("25/s".parse()?)).await;
/// // The same, with the nodes counted for you: 100/s divided by the live limiters.
/// let shared = limiter.check_or("user_1024", FailMode::LocalShare).await;
/// // A synced limiter that denies everything while Redis has been silent for 2 s.
/// let sync = RedisSync::new("redis://127.0.0.1:6379/")
///     .fail_mode(FailMode::Closed)
///     .staleness(std::time::Duration::from_secs(2));
/// # let _ = (decision, shared, sync);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailMode {
    /// Admit (availability first).
    Open,
    /// Deny (protection first). The Redis tier says `retry_after` = one emission
    /// interval.
    Closed,
    /// Limit in process with this quota (per key, with the limiter's algorithm): an
    /// insurance limit, typically the global quota divided by the number of nodes. Each
    /// node's in-process state starts empty at the outage and is kept across outages; it
    /// is not synchronised with Redis. (A quota the algorithm cannot hold in process — a
    /// window limit beyond its state word — denies as `Closed`.) The Redis tier's only:
    /// the sync refuses it at build, its local fail mode being [`LocalShare`](Self::LocalShare).
    Local(Quota),
    /// Limit in process by this node's share of the limiter's quota.
    ///
    /// **The Redis tier** (of each quota, all or nothing, for a limiter with
    /// [`also`](crate::redis::RedisBuilder::also) quotas): the quota divided by `N`, the
    /// number of live limiters sharing the prefix (and algorithm), as last counted while
    /// Redis answered. The limiters count each other through the subscribers of the reset
    /// channel (`PUBSUB NUMSUB` on every node the limiter was given, every second), so `N`
    /// follows nodes that start or stop, with no configuration. The share: with
    /// `limit ≥ N`, `⌊limit / N⌋` per period; below, `limit` per `N` periods; the burst
    /// `max(1, ⌊burst / N⌋)`. Over an outage of length `t`, the `N` nodes together admit
    /// at most `max(burst, N) + ⌊t / T⌋` per key (`T` the quota's emission interval): the
    /// global bound, plus up to `N − burst` units when the burst is smaller than the node
    /// count (a unit cannot be split). Each node's in-process state starts empty at the
    /// outage.
    ///
    /// **The sync** (its default): each key admits, locally, at this node's share of the
    /// rate for as long as Redis keeps that share reserved for the node
    /// ([`RedisSync::share_ttl`](crate::sync::RedisSync::share_ttl) after its last round:
    /// Redis charges the global state for it meanwhile), then at most a one-time budget of
    /// the quota's capacity divided by the last known number of nodes for the rest of the
    /// outage. What is admitted is set against what Redis charged on the node's behalf
    /// once Redis answers again; the budget's excess is this node's own debt, and while it
    /// owes, a new outage gets no new budget. So a node cut off from Redis alone adds a
    /// fixed term to the global bound (see the [sync guide](crate::guide::sync)), however
    /// long the partition lasts. A whole-Redis outage longer than `share_ttl` leaves each
    /// node only its budget: raise `share_ttl` to ride out longer ones.
    #[default]
    LocalShare,
}
