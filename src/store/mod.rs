//! The sharded maps that hold each key's state, and their policy.
//!
//! Keys are spread over a power-of-two number of cache-padded shards. A key is hashed
//! once, in both stores by [`hash::KeyHashing`] (two multiplies for integer keys, ahash
//! for the others), whose top bits pick the shard and the 32 below them the home slot.
//!
//! - The word algorithms (token bucket, leaky bucket, window counters) use
//!   [`WordStore`]: each shard is an open-addressing table of `{state word, key}` slots
//!   kept alive by an epoch scheme of the crate's own (see [`epoch_table`], its one
//!   `unsafe` module). A check on an existing key takes no lock and writes nothing shared but its
//!   state word.
//! - The sliding log and the synced limiters keep per-key cells of several words, and use
//!   [`Store`] (see [`locked`]): each shard behind a [`parking_lot::RwLock`], an existing
//!   key served under the read lock.
//!
//! In both, only a new key, a quota change or a removal takes a shard's writer lock, and a
//! unit request denied recently is answered from a per-thread cache without touching the
//! shard at all (see [`recent_denies`]).
//!
//! Memory stays bounded without losing decisions: an insert that finds its shard's table
//! full sweeps it first and drops the keys idle for a while (see [`Sweep`]: never a key
//! in use, whatever its period), and `max_keys` caps the total (see [`WhenFull`]).

mod compound;
mod counts;
#[allow(unsafe_code)]
mod epoch_table;
mod hash;
mod key_quotas;
mod locked;
pub(crate) mod recent_denies;
mod rule;
mod shard;
pub(crate) mod state;
pub(crate) mod table;
mod word;

pub(crate) use compound::Compound;
#[cfg(feature = "redis")]
pub(crate) use compound::{Part, Parts, check_all, peek_all};
pub(crate) use hash::Sharding;
pub(crate) use locked::Store;
pub(crate) use word::WordStore;

use crate::algorithm::Policy;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::rng::XorShift;

/// A full table's sweep drops a key untouched for this many periods of its quota ...
const IDLE_PERIODS: u64 = 4;
/// ... and at least this long (1 s), even if it was touched since the last such sweep.
const IDLE_FLOOR_NS: u64 = 1_000_000_000;
/// How far the hand looks for an untouched key when the store is full.
const SCAN_WHEN_FULL: usize = 32;
/// How many random keys the sampled eviction compares.
const SAMPLES: usize = 8;

/// Words of the key quota filter: 1,024 bits.
const FILTER_WORDS: usize = 16;

/// The key quota filter bit of a hash: bits 40‥50.
fn filter_bit(hash: u64) -> (usize, u64) {
    let bit = (hash >> 40) as usize % (FILTER_WORDS * 64);
    (bit / 64, 1 << (bit % 64))
}

/// How room was made for a new key in a full store.
enum Room {
    /// An untouched key was dropped: no decision changes.
    Untouched,
    /// A key with live state was dropped (sampled least-active eviction).
    Active,
    /// Nothing was dropped; the soonest key seen will be untouched after this many ns.
    None { retry_after_ns: u64 },
}

impl Room {
    /// No room: retry when the soonest key seen is untouched (`u64::MAX` if none was
    /// seen: then after `fallback`), at least 1 ns from now.
    fn none_until(soonest: u64, fallback: u64) -> Self {
        let retry = if soonest == u64::MAX {
            fallback
        } else {
            soonest
        };
        Room::None {
            retry_after_ns: retry.max(1),
        }
    }
}

/// One pass of an eviction hand, as both stores run it: each key visited is dropped if
/// it is back to untouched (which changes no decision). With a `grace` (when the shard's
/// table last filled up: the word store's last rebuild of a full table, the locked
/// store's last full sweep), only keys untouched for a while go: for [`IDLE_PERIODS`]
/// periods of their quota and [`IDLE_FLOOR_NS`] at least, or for one period and since
/// the table last filled. A key that comes back at any point of a table's span, or
/// within a second, stays, so keys in use are not dropped and re-inserted over and over,
/// whatever their period; a flood of keys that go idle is dropped after about one span.
pub(crate) struct Sweep {
    now: u64,
    grace: Option<u64>,
    dropped: usize,
    /// The soonest time (ns from now) at which a visited survivor will be droppable.
    soonest: u64,
}

impl Sweep {
    fn new(now: u64, grace: Option<u64>) -> Self {
        Self {
            now,
            grace,
            dropped: 0,
            soonest: u64::MAX,
        }
    }

    /// When a key of a quota of `period_ns` must have been untouched since to go.
    fn since(&self, period_ns: u64) -> u64 {
        match self.grace {
            // Untouched at an instant means untouched ever since.
            Some(swept) => {
                let idle = period_ns.saturating_mul(IDLE_PERIODS).max(IDLE_FLOOR_NS);
                let spanned = self.now.saturating_sub(period_ns).min(swept);
                spanned.max(self.now.saturating_sub(idle))
            }
            None => self.now,
        }
    }

    /// A visited key, droppable in `wait` ns (judged at [`since`](Self::since)):
    /// dropped by `drop` now if 0 (which may refuse: a check changed it meanwhile).
    /// Returns whether it was dropped.
    fn visit(&mut self, wait: u64, drop: impl FnOnce() -> bool) -> bool {
        if wait > 0 {
            self.soonest = self.soonest.min(wait);
            return false;
        }
        let dropped = drop();
        self.dropped += usize::from(dropped);
        dropped
    }

    /// How many keys were dropped, and the soonest a survivor will be droppable.
    fn finish(self) -> (usize, u64) {
        (self.dropped, self.soonest)
    }
}

/// Sampled least-active eviction, as both stores run it: of up to [`SAMPLES`]
/// candidates among `positions` (every position when `every`, else up to `draws` random
/// ones), the position whose eviction loses the least. `cost_at` gives a position's cost
/// (units consumed, then ns to reset), or `None` when it holds no candidate.
fn least_costly(
    positions: usize,
    every: bool,
    draws: usize,
    rng: &mut XorShift,
    mut cost_at: impl FnMut(usize) -> Option<(u64, u64)>,
) -> Option<usize> {
    if positions == 0 {
        return None;
    }
    let mut victim: Option<((u64, u64), usize)> = None;
    let mut seen = 0;
    let draws = if every { positions } else { draws };
    for draw in 0..draws {
        if seen == SAMPLES {
            break;
        }
        let at = if every {
            draw
        } else {
            (rng.next_u64() % positions as u64) as usize
        };
        let Some(cost) = cost_at(at) else { continue };
        seen += 1;
        if victim.is_none_or(|(best, _)| cost < best) {
            victim = Some((cost, at));
        }
    }
    victim.map(|(_, at)| at)
}

/// What a limiter at [`max_keys`](crate::Builder::max_keys) does with a new key once no
/// untouched key can make room for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WhenFull {
    /// Evict a live key: of 8 keys sampled at random in the new key's shard, the one
    /// whose eviction loses the least — the fewest units consumed, then the soonest to be
    /// untouched (for the token bucket, the least recently admitted). A client that has
    /// used up its quota (an abuser being limited) is the last to go, so flooding new keys
    /// cannot reset it. The evicted key's next request starts fresh. (Denies write
    /// nothing, so a key's activity is what it was admitted, not what it asked.)
    #[default]
    EvictLeastActive,
    /// Deny the new key's request; keys already stored are unaffected. Its
    /// `retry_after` is when the soonest key the eviction hand examined will be untouched,
    /// an estimate, since other shards may free room sooner.
    DenyNewKeys,
}

/// Counters for monitoring a limiter's key store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Requests admitted (`check`, `check_n`, the waiting API's admissions; `peek`s are
    /// not decisions).
    pub allowed: u64,
    /// Requests denied, including costs beyond the quota's capacity.
    pub denied: u64,
    /// Keys holding state now.
    pub keys: usize,
    /// Keys dropped because their state was back to untouched (no decision changed).
    pub evicted_untouched: u64,
    /// Live keys evicted to make room under [`WhenFull::EvictLeastActive`].
    pub evicted_active: u64,
    /// Requests of new keys denied because the store was full.
    pub refused_new_keys: u64,
    /// Times a shard's table was rebuilt: grown, shrunk, cleared of removed keys or
    /// migrated to a new quota (the word algorithms' lock-free tables; 0 for the sliding
    /// log and synced limiters, whose tables grow in place).
    pub resizes: u64,
    /// Tables replaced by a resize that are not freed yet: held only while a check that
    /// was in flight when they were replaced runs, so 0 or a few, whatever the threads
    /// that are not checking do.
    pub retired_tables: u64,
}

impl StoreStats {
    /// The store counters of several quotas' stores, each holding the same keys: the
    /// counters summed, the keys the most any store holds.
    pub(crate) fn of_quotas(each: impl IntoIterator<Item = StoreStats>) -> Self {
        let mut total = Self::default();
        for s in each {
            total.evicted_untouched += s.evicted_untouched;
            total.evicted_active += s.evicted_active;
            total.refused_new_keys += s.refused_new_keys;
            total.resizes += s.resizes;
            total.retired_tables += s.retired_tables;
            total.keys = total.keys.max(s.keys);
        }
        total
    }
}

/// How the store is configured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) shards: usize,
    pub(crate) max_keys: usize,
    pub(crate) when_full: WhenFull,
    /// Whether inserts sweep untouched keys away.
    pub(crate) sweep: bool,
    /// The keys the tables are sized for when built, and never shrunk below (0: none;
    /// see [`keys_per_shard`]).
    pub(crate) expected_keys: usize,
}

/// Whether tables sized up front for `limits.expected_keys` can be, taking `bytes` (`None`
/// beyond what the tables can hold): within `max_keys`, the tables' reach and this
/// machine's memory (where the system says how much it has).
pub(crate) fn check_room(limits: Limits, bytes: Option<usize>) -> Result<(), ConfigError> {
    let expected = limits.expected_keys;
    if expected == 0 {
        return Ok(());
    }
    let why = if expected > limits.max_keys {
        "more than `max_keys`"
    } else {
        match bytes {
            None => "more than the key tables can hold",
            Some(bytes) if epoch_table::physical_memory().is_some_and(|memory| bytes > memory) => {
                "tables larger than this machine's memory"
            }
            Some(_) => return Ok(()),
        }
    };
    Err(ConfigError::ExpectedKeysTooMany { expected, why })
}

/// The keys one of `shards` shards is sized for when a limiter expects `expected` keys:
/// its share, plus four standard deviations of the binomial spread of keys over shards
/// (`√share`), so that no shard outgrows its table before `expected` keys are in all but
/// about once in 30,000 shards. 0 for no expectation.
pub(crate) fn keys_per_shard(expected: usize, shards: usize) -> usize {
    if expected == 0 {
        return 0;
    }
    let share = expected.div_ceil(shards.max(1));
    // An integer square root (within one): `f64` is exact enough far past any table.
    let spread = (share as f64).sqrt().ceil() as usize;
    share.saturating_add(spread.saturating_mul(4))
}

/// `Err` when `cost` exceeds what `policy` can ever admit at once.
#[inline]
fn fits<P: Policy>(policy: &P, cost: u64) -> Result<(), InsufficientCapacity> {
    let capacity = policy.capacity();
    if cost > capacity {
        return Err(InsufficientCapacity {
            requested: cost,
            capacity,
        });
    }
    Ok(())
}
