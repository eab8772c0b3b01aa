//! One sync round for one key, as pure integer arithmetic: the messages a node sends and
//! receives (`Request`, `Answer`) and the server side's arithmetic (`model::serve`): the
//! global state and the per-node records in, the answer out. No clock, no Redis, no I/O: time is
//! an argument. The Lua script (`redis/lua/sync_round.lua`, for both shapes) computes
//! exactly this, step by step (a differential test on a real redis-server checks
//! it), and the deterministic simulation drives this function as its Redis.
//!
//! # Units
//!
//! Time is in microseconds of Redis's clock. One token costs `T` **ticks** (µs of the
//! token bucket's GCRA time; for the sliding window `⌊period / limit⌋`, at least 1), and
//! the global state refills one tick per µs. Fractions of a token are never rounded away:
//! they stay in the global state and in each node's credit.
//!
//! # A round for one key
//!
//! A node reports, with a sequence number, the **floor** `F`: every unit it has admitted
//! on the key since it first saw it, plus the lease it keeps. `F` is cumulative, so a
//! round that is applied twice, late, or never, charges exactly once: Redis charges (or,
//! when `F` is below, refunds) the difference between `F` and the reservation it holds
//! for the node, and ignores a sequence number it has already applied.
//!
//! Then the node gets a lease: at most what it asked for, what the global state holds, its
//! **credit** and its holding cap. Credit is how capacity is shared max-min fairly by
//! demand (Doorman's FairShare): every node reports its demand as a weight (a fraction of
//! the rate, in parts of [`WEIGHT_ONE`]); the weights of the nodes heard from within the
//! demand TTL are water-filled, and a node's credit refills at its share of the rate, up
//! to its share of the holding horizon. In reconcile mode the answer also carries an
//! overdraft: the node's share of what the global state still holds after the lease,
//! which it may admit beyond its lease and reports in its next floor.
//!
//! # A node that falls silent, or cannot hear
//!
//! Each answer reserves for the node a share of the rate (a weight: an even split among
//! the registry's nodes, out of what the other nodes' unexpired reservations leave, so
//! that reservations never add up past the rate) **until** `now + share_ttl`. A node is
//! **silent** once Redis has heard neither a round on the key nor a heartbeat from it for
//! `silent_after` (a node alive but with nothing to say about a key is not silent); a
//! node is **in its fallback** while its last round reported tokens its local fallback
//! handed out (its requests arrive, its answers do not). For either, every round on the
//! key first charges the global state with the node's share of the rate since it was
//! last charged, up to its `until` (`prepaid`, in ticks), and the other nodes share only
//! what the reservations leave; the node, meanwhile, admits at exactly that share
//! locally. A node in its fallback keeps the reservation it last knew (it is not
//! renewed).
//!
//! When the node reports again, what it admitted comes first out of `prepaid`; what it
//! did not use goes back, as far as that charge still lies ahead of `now` (`landed`,
//! `landed_end`: capacity past cannot be returned). What its fallback admitted after its
//! reservation ended (`beyond`, at most its one-time budget) beyond that is its own debt
//! (`owes`, in ticks), repaid out of its own credit at `1 / REPAY_PACE` of its share's
//! pace and charged to the global state as it is repaid, while it keeps leasing with the
//! rest: the other nodes never pay for it. Its credit does not accrue while its share is
//! charged on its behalf. A dead node costs the others at most `share_ttl` of its share.

// The server side itself, `serve`, is in `model.rs` (tests only): in production Redis
// runs its Lua twin, and `serve` is its specification, run by the simulation and the
// differential test. This file holds what the node side and the task use in production.

use crate::algorithm::{Algorithm, AnyPolicy, Policy};
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::redis::RedisError;
use crate::redis::script_quota::script_args;

/// The whole rate, as a weight: a node's demand and share are fractions of it.
pub(crate) const WEIGHT_ONE: u64 = 1 << 20;
/// The largest demand a node may report (16 times the rate).
pub(crate) const MAX_DEMAND: u64 = 1 << 24;
/// The global limit a synced key shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// GCRA: `t` µs per token, tolerance `tau = t·(burst − 1)`. The leaky bucket's
    /// admissions are the token bucket's for the same quota, so it shares this shape.
    TokenBucket {
        /// µs per token.
        t: u64,
        /// `t·(burst − 1)`.
        tau: u64,
    },
    /// The sliding window counter: `limit` per `period` µs.
    SlidingWindow {
        /// Units per window.
        limit: u64,
        /// The window, in µs.
        period: u64,
    },
    /// The fixed window: `limit` per aligned window of `period` µs (the sliding window's
    /// state, with the previous window weighing nothing).
    FixedWindow {
        /// Units per window.
        limit: u64,
        /// The window, in µs.
        period: u64,
    },
}

impl Shape {
    /// The shape of `quota` under `algorithm`, in Redis's units (the Redis tier's own
    /// arguments: the same precision limits apply).
    ///
    /// # Errors
    /// [`ConfigError::Unsupported`] for the sliding log, whose per-request timestamps
    /// cannot be leased out as counts; the Redis tier's quota errors otherwise.
    pub(crate) fn new(algorithm: Algorithm, quota: Quota) -> Result<Self, ConfigError> {
        let script = match algorithm {
            Algorithm::LeakyBucket => Algorithm::TokenBucket,
            Algorithm::SlidingLog => return Err(ConfigError::Unsupported(SLIDING_LOG)),
            other => other,
        };
        let [a, b, _] = script_args(script, quota).map_err(|e| match e {
            RedisError::Config(e) => e,
            _ => ConfigError::Unsupported(SLIDING_LOG),
        })?;
        Ok(match script {
            Algorithm::TokenBucket => Self::TokenBucket { t: a, tau: b },
            Algorithm::SlidingWindow => Self::SlidingWindow {
                limit: a,
                period: b,
            },
            _ => Self::FixedWindow {
                limit: a,
                period: b,
            },
        })
    }

    /// [`new`](Self::new), and the quota's capacity under `algorithm` (the most one
    /// request may cost).
    ///
    /// # Errors
    /// As [`new`](Self::new), and the core's quota errors.
    pub(crate) fn with_capacity(
        algorithm: Algorithm,
        quota: Quota,
    ) -> Result<(Self, u64), ConfigError> {
        let shape = Self::new(algorithm, quota)?;
        // `new` refused calendar quotas: the clock's origin is not read.
        match AnyPolicy::new(algorithm, quota, 0)? {
            AnyPolicy::Word(word) => Ok((shape, word.capacity())),
            // Only the sliding log keeps a log, and `new` refused it.
            AnyPolicy::Log(_) => Err(ConfigError::Unsupported(SLIDING_LOG)),
        }
    }

    /// Ticks (µs of refill) one token costs.
    pub(crate) fn ticks_per_token(self) -> u64 {
        match self {
            Self::TokenBucket { t, .. } => t,
            Self::SlidingWindow { limit, period } | Self::FixedWindow { limit, period } => {
                (period / limit).max(1)
            }
        }
    }

    /// The window's length (µs), for the two window counters.
    pub(crate) fn period(self) -> Option<u64> {
        match self {
            Self::TokenBucket { .. } => None,
            Self::SlidingWindow { period, .. } | Self::FixedWindow { period, .. } => Some(period),
        }
    }

    /// The script's name for the shape and its two numbers.
    pub(crate) fn script_args(self) -> (&'static str, u64, u64) {
        match self {
            Self::TokenBucket { t, tau } => ("tb", t, tau),
            Self::SlidingWindow { limit, period } => ("sw", limit, period),
            Self::FixedWindow { limit, period } => ("fw", limit, period),
        }
    }

    #[cfg(test)]
    /// The shape the script reads from its name and two numbers (`None` for another
    /// name, or a window of no length or no limit).
    pub(crate) fn from_script_args(tag: &[u8], a: u64, b: u64) -> Option<Self> {
        match tag {
            b"tb" if a >= 1 => Some(Self::TokenBucket { t: a, tau: b }),
            b"sw" if a >= 1 && b >= 1 => Some(Self::SlidingWindow {
                limit: a,
                period: b,
            }),
            b"fw" if a >= 1 && b >= 1 => Some(Self::FixedWindow {
                limit: a,
                period: b,
            }),
            _ => None,
        }
    }
}

/// A key's own quota, as it travels with the key's rounds: the highest one (by version,
/// then by its numbers) wins everywhere. Redis adopts a higher one than it holds,
/// converting the key's state (never handing out capacity: what was used stays used),
/// and answers with the one it holds, which a node that sent a lower one adopts. So
/// Redis and every node agree, whichever node set it. Version 0 is the limiter's
/// default quota; a later version whose limit is 0 returns the key to the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct SharedQuota {
    /// When (µs of the setting node's wall clock, made unique per node) it was set.
    pub(crate) version: u64,
    /// The quota: `limit` per `period` µs, `burst` at once (0, 0, 0: the default).
    pub(crate) limit: u64,
    pub(crate) period: u64,
    pub(crate) burst: u64,
}

impl SharedQuota {
    /// `quota` as a key's own, set at `version`. The quota must have passed
    /// [`Shape::new`] for the limiter's algorithm.
    pub(crate) fn new(version: u64, quota: Quota) -> Self {
        Self {
            version,
            limit: quota.limit(),
            period: quota.period_ns() / 1_000,
            burst: quota.burst(),
        }
    }

    /// The default quota, set at `version` (0: never changed).
    pub(crate) fn default_at(version: u64) -> Self {
        Self {
            version,
            ..Self::default()
        }
    }

    /// Whether the round script takes this quota for a limiter of `shape` (the
    /// script's own check, which refuses the whole call otherwise): its numbers stay
    /// exact in the script's doubles, whatever it converts.
    pub(crate) fn fits(self, shape: Shape) -> bool {
        const EXACT: u64 = 1 << 53;
        let (limit, period, burst) = (self.limit, self.period, self.burst);
        limit == 0
            || (burst >= 1
                && period >= 1
                && match shape {
                    Shape::TokenBucket { .. } => {
                        period >= limit && period.checked_mul(burst).is_some_and(|x| x < EXACT / 2)
                    }
                    _ => limit.checked_mul(period).is_some_and(|x| x < EXACT),
                })
    }

    /// Whether this is the limiter's default quota.
    pub(crate) fn is_default(self) -> bool {
        self.limit == 0
    }

    /// The quota, unless it is the default.
    pub(crate) fn quota(self) -> Option<Quota> {
        if self.is_default() {
            return None;
        }
        Quota::new(self.limit, std::time::Duration::from_micros(self.period))
            .and_then(|q| q.with_burst(self.burst))
            .ok()
    }

    /// The shape of a key with this quota in a limiter whose default shape is `default`
    /// (the algorithm is the limiter's), as the script computes it.
    pub(crate) fn shape(self, default: Shape) -> Shape {
        if self.is_default() {
            return default;
        }
        let (limit, period) = (self.limit, self.period);
        match default {
            Shape::TokenBucket { .. } => {
                let t = period / limit;
                Shape::TokenBucket {
                    t,
                    tau: t * (self.burst - 1),
                }
            }
            Shape::SlidingWindow { .. } => Shape::SlidingWindow { limit, period },
            Shape::FixedWindow { .. } => Shape::FixedWindow { limit, period },
        }
    }
}

/// Why the sliding log cannot be synced.
const SLIDING_LOG: &str = "background sync supports token-bucket, leaky-bucket, \
     sliding-window and fixed-window; a sliding log's per-request timestamps cannot be \
     leased out as counts (use sliding-window)";

/// What every round of a limiter shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Params {
    pub(crate) shape: Shape,
    /// Reconcile mode: hand out overdrafts, each a share of what the global state holds
    /// plus what it refills over this horizon (µs, the sync interval); 0 in lease mode.
    pub(crate) overdraft_horizon: u64,
    /// The holding horizon `H` (µs): a node's credit and lease are capped at its share of
    /// `H` worth of refill (at least one token).
    pub(crate) hold: u64,
    /// A node's demand counts for this long (µs) after it reported it.
    pub(crate) demand_ttl: u64,
    /// A node's record is dropped when it has not been heard from for this long (ms);
    /// the key's Redis TTL is its time until untouched plus this.
    pub(crate) retain_ms: u64,
    /// How long (µs) after a round the node's share stays reserved for it if it falls
    /// silent; 0: not at all.
    pub(crate) share_ttl: u64,
    /// A node not heard from (neither a round nor a heartbeat) for this long (µs) is
    /// silent: the nodes' staleness, after which a node cut off from Redis falls back.
    pub(crate) silent_after: u64,
}

/// One node's report for one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Request {
    /// The node's round number; a round at or below the last one applied is ignored.
    pub(crate) seq: u64,
    /// The node's books for this key: a new epoch counts its floor from 0.
    pub(crate) epoch: u64,
    /// Everything the node admitted on the key, plus the lease it keeps.
    pub(crate) floor: u64,
    /// The lease the node keeps (part of `floor`).
    pub(crate) keep: u64,
    /// The reservation of the last answer the node received (used when Redis lost the
    /// node's record, e.g. after a restart).
    pub(crate) known: u64,
    /// The node's demand, a weight.
    pub(crate) demand: u64,
    /// Tokens the node would like to hold beyond `keep`.
    pub(crate) want: u64,
    /// When (Redis time, µs) the node started admitting what `floor` may add beyond the
    /// reservation: the collection of its last acknowledged round. Such a charge is
    /// spread back over the time since (0: not at all). Absolute, so that rounds queued
    /// in a paused Redis, applied together, all spread from the same start.
    pub(crate) anchor: u64,
    /// When (Redis time, µs) the node stops waiting for the answer (0: never). A round
    /// that runs later (it queued in a paused Redis) only charges: it grants nothing,
    /// since nobody would receive it.
    pub(crate) deadline: u64,
    /// Of `floor`, tokens the node's local fallback handed out since its last
    /// acknowledged round: charged like the rest while Redis holds the node's record
    /// (spread back from `anchor`), but forgiven when Redis lost it (restarted empty, or
    /// failed over): that consumption was the share of a refill no state recorded.
    pub(crate) local: u64,
    /// Of `local`, tokens handed out after the node's share was no longer reserved (its
    /// one-time budget): what of them exceeds what was charged on its behalf is its own
    /// debt, not the global state's.
    pub(crate) beyond: u64,
    /// The key's quota as the node knows it.
    pub(crate) quota: SharedQuota,
}

/// The answer for one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Tokens leased: the node may hold `keep + grant`.
    pub(crate) grant: u64,
    /// Tokens the node may admit beyond its lease, reported in its next floor.
    pub(crate) overdraft: u64,
    /// The node's reservation now: `floor + grant`.
    pub(crate) reserved: u64,
    /// The round was older than one already applied: nothing changed.
    pub(crate) stale: bool,
    /// The share of the rate (a weight) Redis reserves for the node, and until when (µs),
    /// if the node falls silent: its local fallback may admit at that share until then.
    pub(crate) share: u64,
    pub(crate) until: u64,
    /// Tokens the node still owes for what its fallback admitted beyond its reserved
    /// share (rounded up): until it is repaid, its fallback gets no new budget.
    pub(crate) owes: u64,
    /// Of the lease the node kept, tokens Redis gave back to the earlier window they
    /// were reserved in (a window counter's lease in lease mode, at the first round of a
    /// new window): the node drops what is left of its lease.
    pub(crate) void: u64,
    /// The key's quota as Redis holds it (the node adopts it if higher than its own).
    pub(crate) quota: SharedQuota,
}

/// `⌊x · weight / WEIGHT_ONE⌋`, exact for any `x` below 2^52 (the script computes it in
/// the same two parts, each exact in a double).
pub(crate) fn scale(x: u64, weight: u64) -> u64 {
    (x >> 20) * weight + (((x & (WEIGHT_ONE - 1)) * weight) >> 20)
}
