//! The penalty box: keys shut out for a while, after breaking their limit (once, or `K`
//! times within a window) or by an operator's hand.
//!
//! A limiter keeps one box beside its store. While the box holds nothing, a check reads
//! one counter of it (a load of a word no check writes) and goes on; while it holds
//! entries, a check first looks its key up under the read lock of one of the box's
//! shards. A blocked key's checks consume nothing and are denied with the block's end as
//! their retry.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crossbeam_utils::CachePadded;
use parking_lot::RwLock;

use crate::clock::nanos;
use crate::error::ConfigError;

/// The box's shard count: blocks are few, and their lookups only read-lock.
const SHARDS: usize = 16;
/// A shard is purged of ended entries when it has doubled since its last purge, and
/// no sooner than at this size.
const PURGE_FLOOR: usize = 16;

/// When a key is blocked, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Penalty {
    /// How long a block lasts, in nanoseconds.
    block_ns: u64,
    /// Denies that trigger a block...
    after: u32,
    /// ... within this many nanoseconds of the first of them.
    within_ns: u64,
}

impl Penalty {
    /// A block of `block` after each deny.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPenalty`] for a block of zero.
    pub(crate) fn new(block: Duration) -> Result<Self, ConfigError> {
        if block.is_zero() {
            return Err(ConfigError::InvalidPenalty(
                "block_for(0) blocks nothing: give a duration of at least 1ns, or leave it out",
            ));
        }
        Ok(Self {
            block_ns: nanos(block),
            after: 1,
            within_ns: u64::MAX,
        })
    }

    /// The penalty a builder's `block_for` and `block_after` settings ask for, checked:
    /// none without `block_for`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPenalty`] for `block_after` without `block_for`, and as
    /// [`new`](Self::new) and [`after`](Self::after).
    pub(crate) fn from_settings(
        block_for: Option<Duration>,
        block_after: Option<(u32, Duration)>,
    ) -> Result<Option<Self>, ConfigError> {
        match (block_for, block_after) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(ConfigError::InvalidPenalty(
                "block_after without block_for: say how long a block lasts",
            )),
            (Some(block), after) => {
                let penalty = Self::new(block)?;
                match after {
                    Some((denies, within)) => penalty.after(denies, within).map(Some),
                    None => Ok(Some(penalty)),
                }
            }
        }
    }

    /// How long a block lasts, in nanoseconds.
    #[cfg(feature = "redis")]
    pub(crate) fn block_ns(&self) -> u64 {
        self.block_ns
    }

    /// How many denies within [`within_ns`](Self::within_ns) start a block.
    #[cfg(feature = "redis")]
    pub(crate) fn denies(&self) -> u32 {
        self.after
    }

    /// The window the denies that start a block fall within, in nanoseconds
    /// (`u64::MAX` when one deny blocks).
    #[cfg(feature = "redis")]
    pub(crate) fn within_ns(&self) -> u64 {
        self.within_ns
    }

    /// The same block, after `denies` denies within `within` of the first.
    ///
    /// # Errors
    /// [`ConfigError::InvalidPenalty`] for zero denies or a zero window.
    pub(crate) fn after(self, denies: u32, within: Duration) -> Result<Self, ConfigError> {
        if denies == 0 || within.is_zero() {
            return Err(ConfigError::InvalidPenalty(
                "block_after needs at least 1 deny within a window of at least 1ns",
            ));
        }
        Ok(Self {
            after: denies,
            within_ns: nanos(within),
            ..self
        })
    }
}

/// A key's entry: a block, or denies counted toward one.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The block's end on the limiter's clock; 0 if not blocked.
    until: u64,
    /// Denies counted since `since`.
    denies: u32,
    since: u64,
}

impl Entry {
    /// Whether the entry still matters at `now`: a block not over, or denies whose
    /// window is not.
    fn live(&self, now: u64, within_ns: u64) -> bool {
        self.until > now || (self.denies > 0 && now - self.since.min(now) < within_ns)
    }
}

type Map<K> = hashbrown::HashMap<K, Entry, ahash::RandomState>;

struct Shard<K> {
    map: Map<K>,
    /// The map's length after its last purge.
    purged_at: usize,
}

/// The blocked keys and the denies counted toward blocks.
pub(crate) struct PenaltyBox<K> {
    penalty: Option<Penalty>,
    shards: Box<[CachePadded<RwLock<Shard<K>>>]>,
    /// Entries in all shards: while 0, checks skip the box.
    entries: CachePadded<AtomicUsize>,
    hasher: ahash::RandomState,
}

impl<K: Hash + Eq> PenaltyBox<K> {
    /// An empty box; `penalty` says when checks' denies block a key (never if `None`:
    /// then only [`block`](Self::block) does).
    pub(crate) fn new(penalty: Option<Penalty>) -> Self {
        Self {
            penalty,
            shards: (0..SHARDS)
                .map(|_| {
                    CachePadded::new(RwLock::new(Shard {
                        map: Map::default(),
                        purged_at: 0,
                    }))
                })
                .collect(),
            entries: CachePadded::new(AtomicUsize::new(0)),
            hasher: ahash::RandomState::new(),
        }
    }

    /// Whether a check must look in the box: it holds an entry.
    #[inline(always)]
    pub(crate) fn occupied(&self) -> bool {
        self.entries.load(Ordering::Relaxed) != 0
    }

    /// Whether a check's deny may block its key.
    #[inline(always)]
    pub(crate) fn counts_denies(&self) -> bool {
        self.penalty.is_some()
    }

    fn shard<Q: Hash + ?Sized>(&self, key: &Q) -> &RwLock<Shard<K>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// The end of `key`'s block, if it is blocked at `now`.
    ///
    /// # Locking behaviour
    /// The read lock of one of the box's shards.
    pub(crate) fn blocked_until<Q>(&self, key: &Q, now: u64) -> Option<u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if !self.occupied() {
            return None;
        }
        let shard = self.shard(key).read();
        shard
            .map
            .get(key)
            .map(|e| e.until)
            .filter(|&until| until > now)
    }

    /// Counts a check's deny of `key` at `now`: returns the end of the block it starts,
    /// if it is the deny that completes the count.
    ///
    /// # Locking behaviour
    /// The write lock of one of the box's shards.
    pub(crate) fn denied<Q>(&self, key: &Q, now: u64) -> Option<u64>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let penalty = self.penalty?;
        let mut shard = self.shard(key).write();
        let until = match shard.map.get_mut(key) {
            Some(entry) => {
                if entry.until > now {
                    // Already blocked (a check that raced the block): nothing to add.
                    return Some(entry.until);
                }
                if entry.denies == 0 || now - entry.since.min(now) >= penalty.within_ns {
                    entry.denies = 0;
                    entry.since = now;
                }
                entry.denies += 1;
                if entry.denies < penalty.after {
                    return None;
                }
                entry.denies = 0;
                entry.until = now.saturating_add(penalty.block_ns);
                entry.until
            }
            None => {
                let blocks = penalty.after <= 1;
                let until = if blocks {
                    now.saturating_add(penalty.block_ns)
                } else {
                    0
                };
                self.insert(
                    &mut shard,
                    key.to_owned(),
                    Entry {
                        until,
                        denies: u32::from(!blocks),
                        since: now,
                    },
                    now,
                );
                return blocks.then_some(until);
            }
        };
        Some(until)
    }

    /// Blocks `key` until `until` (a later end than one it has stays).
    pub(crate) fn block<Q>(&self, key: &Q, now: u64, until: u64)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let mut shard = self.shard(key).write();
        match shard.map.get_mut(key) {
            Some(entry) => entry.until = entry.until.max(until),
            None => {
                let entry = Entry {
                    until,
                    denies: 0,
                    since: now,
                };
                self.insert(&mut shard, key.to_owned(), entry, now);
            }
        }
    }

    /// Ends `key`'s block and forgets its denies; whether it was blocked at `now`.
    pub(crate) fn unblock<Q>(&self, key: &Q, now: u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if !self.occupied() {
            return false;
        }
        let removed = self.shard(key).write().map.remove(key);
        if removed.is_some() {
            self.entries.fetch_sub(1, Ordering::Relaxed);
        }
        removed.is_some_and(|e| e.until > now)
    }

    /// Keys blocked at `now` (entries are purged lazily: ended ones are not counted).
    pub(crate) fn blocked(&self, now: u64) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().map.values().filter(|e| e.until > now).count())
            .sum()
    }

    /// Inserts an entry, purging the shard of ended entries first when it has doubled
    /// since its last purge: the box holds at most about twice its live entries.
    fn insert(&self, shard: &mut Shard<K>, key: K, entry: Entry, now: u64) {
        if shard.map.len() >= (2 * shard.purged_at).max(PURGE_FLOOR) {
            let within = self.penalty.map_or(0, |p| p.within_ns);
            let before = shard.map.len();
            shard.map.retain(|_, e| e.live(now, within));
            shard.purged_at = shard.map.len();
            self.entries
                .fetch_sub(before - shard.map.len(), Ordering::Relaxed);
        }
        shard.map.insert(key, entry);
        self.entries.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_deny_blocks_and_the_block_ends() {
        let b = PenaltyBox::<String>::new(Some(Penalty::new(Duration::from_secs(10)).unwrap()));
        assert!(!b.occupied());
        assert_eq!(b.denied("k", SEC), Some(11 * SEC));
        assert_eq!(b.blocked_until("k", 11 * SEC - 1), Some(11 * SEC));
        assert_eq!(b.blocked_until("k", 11 * SEC), None);
        assert_eq!(b.blocked_until("other", SEC), None);
        assert!(b.unblock("k", 2 * SEC));
        assert!(!b.occupied());
    }

    #[test]
    fn k_denies_within_the_window_block_and_older_ones_do_not_count() {
        let penalty = Penalty::new(Duration::from_secs(60))
            .unwrap()
            .after(3, Duration::from_secs(10))
            .unwrap();
        let b = PenaltyBox::<u64>::new(Some(penalty));
        assert_eq!(b.denied(&1, 0), None);
        assert_eq!(b.denied(&1, 5 * SEC), None);
        // The window of the first deny is over: the count starts again here.
        assert_eq!(b.denied(&1, 10 * SEC), None);
        assert_eq!(b.denied(&1, 12 * SEC), None);
        assert_eq!(b.denied(&1, 13 * SEC), Some(73 * SEC));
        assert_eq!(b.blocked_until(&1, 20 * SEC), Some(73 * SEC));
    }

    #[test]
    fn ended_entries_are_purged_as_the_box_grows() {
        let b = PenaltyBox::<u64>::new(Some(Penalty::new(Duration::from_secs(1)).unwrap()));
        for key in 0..100_000u64 {
            // Each key blocked for 1 s, 1 s apart: at most one is live at a time.
            b.denied(&key, key * SEC);
        }
        let held: usize = b.shards.iter().map(|s| s.read().map.len()).sum();
        assert!(held <= SHARDS * 2 * PURGE_FLOOR, "{held} entries held");
        assert_eq!(b.entries.load(Ordering::Relaxed), held);
        assert_eq!(b.blocked(100_000 * SEC - 1), 1);
    }

    #[test]
    fn bad_penalties_are_typed_errors() {
        assert!(matches!(
            Penalty::new(Duration::ZERO),
            Err(ConfigError::InvalidPenalty(_))
        ));
        let p = Penalty::new(Duration::from_secs(1)).unwrap();
        assert!(matches!(
            p.after(0, Duration::from_secs(1)),
            Err(ConfigError::InvalidPenalty(_))
        ));
        assert!(matches!(
            p.after(2, Duration::ZERO),
            Err(ConfigError::InvalidPenalty(_))
        ));
    }
}
