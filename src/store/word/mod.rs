//! The store of the word algorithms (token bucket, leaky bucket, both window counters):
//! checks that take no lock and write nothing shared but their key's state word.
//!
//! Each shard is an [`EpochTable`] of `{state word, key}` slots. A check on an existing
//! key takes a guard (two plain stores to its thread's own record), loads its shard's
//! table, reads the key's policy from it, probes for the key and runs the algorithm on
//! the state word with one CAS. The policies travel with the table: a quota change migrates
//! the shard to a new table whose states are converted as they move, while frozen, so a
//! check never pairs a new quota with an unconverted state, or the reverse; until its
//! slot moves, a key is decided by the old quota.
//!
//! A new key, a removal, the eviction sweep and a migration's steps take the shard's
//! writer mutex; checks go on meanwhile. Migrations (growth, shrinking, quota changes)
//! move a few slots per insert (see [`epoch_table`](super::epoch_table)), so no insert
//! pays for a whole table. Removal and eviction mark slots removed, and the next rebuild
//! leaves them behind, so a key flood under `max_keys` cycles through a table of bounded
//! size. A full table is swept for idle keys before it is rebuilt (see
//! [`WordStore::rebuild_full`]).
//!
//! # Reclamation
//! A thread holds its guard only for the length of a check (see
//! [`reclaim`](super::epoch_table::reclaim)): a table retired by a resize or a quota
//! change is freed as soon as every check that was in flight then has finished, by the
//! collect that follows the retire (or the next write path's), whatever other threads
//! do between checks — idle, parked or blocked for hours, they hold nothing back.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use super::counts::Counts;
use super::epoch_table::{
    Carry, EpochTable, Guard, Located, STEP_PER_INSERT, Slot, Table, Word, Writer,
    capacity_holding, reclaim, slot_bytes,
};
use super::hash::Sharding;
use super::key_quotas::KeyQuotas;
use super::recent_denies::Denies;
use super::rule::{Op, Rule, StateOf};
use super::{
    Limits, Room, SAMPLES, SCAN_WHEN_FULL, StoreStats, Sweep, WhenFull, keys_per_shard,
    least_costly,
};
use crate::algorithm::{Outcome, Policy, Settle, WordPolicy};
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::quota::Quota;
use crate::rng::XorShift;

mod evict;
mod growth;
mod quotas;

/// The smallest table a shard keeps.
const MIN_CAPACITY: usize = 8;
/// How many slots an operator's path (a quota change, a removal that shrinks) moves per
/// hold of the writer mutex while it runs a migration to its end.
const DRIVE_BATCH: usize = 1_024;
/// A shrink sizes the table for this load: 72%.
const TARGET_LOAD_NUM: usize = 18;
const TARGET_LOAD_DEN: usize = 25;
/// A full table grows only if its keys in use, after the sweep, fill more than 60% of it;
/// otherwise it is rebuilt at its size, leaving at least a quarter of it for new keys
/// before the next rebuild (so the full sweep is O(1) per insert, amortised). See
/// [`WordStore::rebuild_full`].
const GROW_ABOVE_NUM: usize = 3;
const GROW_ABOVE_DEN: usize = 5;
/// Tables below this many slots (256 KiB of `u64` keys) grow 4× at a time: few rebuilds
/// while the memory is small.
const QUICK_GROWTH_BELOW: usize = 1 << 14;

/// A check that meets a migration under way helps it along once in this many, per
/// thread: a help moves [`STEP_PER_INSERT`] slots, too long a detour for every such check.
/// Inserts move their slots each time, and an operator's path drives its migration to the
/// end, so helping only finishes a migration that inserts began and then stopped feeding:
/// `HELP_EVERY / STEP_PER_INSERT` checks per slot of the table. While an operator's path
/// drives a migration, checks do not help at all: the path moves every slot itself.
const HELP_EVERY: u32 = 64;

/// While a table that grew last time is within `capacity / PREPARE_AHEAD` inserts of
/// full, each insert writes [`PREPARE_PAGES`] pages' worth of the slots of the table its
/// growth will move to ([`Writer::prepare`]), so that neither the migration's moves nor
/// the readers that look in the new table take a page fault on it, and no insert zeroes
/// a whole table: a fault costs microseconds (and a TLB shootdown of the other threads,
/// where a reader mapped the zero page first), and a large table's growth is megabytes. A growth of 1.25× has `1.25·capacity / 256` pages for `u64`
/// keys: written in the first third of the inserts ahead, and resident ahead of the
/// growth for about 2% of its span.
const PREPARE_AHEAD: usize = 256;
/// Pages an insert writes of the next table: during a 1.25× growth (its
/// `1.25·capacity / 256` pages, 4 an insert, over the `0.215·capacity` inserts of its
/// span) about 1 insert in 180 writes, fewer than the 1 in 100 that would reach a new
/// key's p99.
const PREPARE_PAGES: usize = 4;

thread_local! {
    /// This thread's checks that met a migration under way, counted for [`HELP_EVERY`].
    static MET_MIGRATION: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether this check, which met a migration under way, is the one in [`HELP_EVERY`]
/// on its thread that helps.
fn helps_this_time() -> bool {
    MET_MIGRATION.with(|met| {
        let n = met.get().wrapping_add(1);
        met.set(n);
        n % HELP_EVERY == 0
    })
}

/// The capacity a full table of `capacity` slots grows to: 4× while small, then 1.25×,
/// which keeps a `u64` key at about 21 bytes (16-byte slots, 69–86% full).
fn grown(capacity: usize) -> usize {
    if capacity < QUICK_GROWTH_BELOW {
        capacity * 4
    } else {
        capacity + capacity / 4
    }
}

/// The policies a shard's checks read with its table.
struct Policies<K, R = WordPolicy> {
    default: R,
    /// The keys with their own policy (each key shared by the copies that successive
    /// tables carry); `None` while there are none.
    key_quotas: Option<Arc<KeyQuotas<Arc<K>, R>>>,
}

impl<K, R: Rule> Clone for Policies<K, R> {
    fn clone(&self) -> Self {
        Self {
            default: self.default,
            key_quotas: self.key_quotas.clone(),
        }
    }
}

impl<K: Hash + Eq, R: Rule> Policies<K, R> {
    /// The policy of `key`: its key quota, or the default. Costs a branch while no key of
    /// the shard has a key quota.
    #[inline]
    fn policy_for<Q>(&self, hash: u64, key: &Q) -> &R
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(key_quotas) = &self.key_quotas else {
            return &self.default;
        };
        key_quotas
            .get(hash, |k| (**k).borrow() == key)
            .unwrap_or(&self.default)
    }
}

impl<K: Hash + Eq, R: Rule> Carry<K, StateOf<R>> for Policies<K, R> {
    /// A key whose policy changes has its state converted; the others keep theirs.
    fn carry(&self, from: &Self, key: &K, hash: u64, state: StateOf<R>, now: u64) -> StateOf<R> {
        let (old, new) = (from.policy_for(hash, key), self.policy_for(hash, key));
        if old == new {
            state
        } else {
            new.convert(state, now, old)
        }
    }
}

/// What the writers of one shard keep.
struct Hand {
    /// Live keys, in the current table and the one a migration moves to.
    live: usize,
    /// When (clock ns) the table was last rebuilt as it filled: the sweep keeps every key
    /// touched since (see [`Sweep`]).
    built: u64,

    /// Whether the last rebuild grew the table: then the next one is made ready ahead
    /// (see [`PREPARE_AHEAD`]).
    growing: bool,
    /// No key of the shard can be dropped by a rebuild's sweep before this instant
    /// (clock ns): a lower bound, lowered by each insert and set by each full sweep (see
    /// [`Rule::droppable_from`]), so that a table growing with keys all in use skips a sweep
    /// that would drop nothing (it read the whole table under the writer mutex: 1.8 ms
    /// at 250,000 keys).
    drop_from: u64,
    /// For tests: the rebuilds' full sweeps run, those skipped by `drop_from`, and the
    /// keys a skipped sweep would have dropped (which must stay 0).
    #[cfg(test)]
    full_sweeps: usize,
    #[cfg(test)]
    skipped_sweeps: usize,
    #[cfg(test)]
    missed: usize,

    /// The next slot the eviction hand looks at.
    at: usize,
    /// Xorshift state for sampling.
    rng: XorShift,
}

type WordShard<K, R> = EpochTable<K, Policies<K, R>, Hand, <R as Rule>::Atom>;

/// A shard's writer.
type ShardWriter<'a, K, R> = Writer<'a, K, Policies<K, R>, Hand, <R as Rule>::Atom>;

/// What a [`WordStore::sweep`] did.
struct Swept {
    dropped: usize,
    /// ns from now until a survivor is droppable by a sweep of the same grace.
    soonest: u64,
    /// The soonest instant a rebuild's sweep could drop a survivor ([`Rule::droppable_from`]).
    drop_from: u64,
}

/// A live key as a sweep judges it ([`WordStore::judge`]).
struct Judged<S> {
    state: S,
    /// ns from the sweep's `since` until it is untouched for good: 0 when it can go now.
    wait: u64,
    /// The soonest instant a rebuild's sweep could drop it, if it stays.
    droppable_at: u64,
}

/// What became of a check on a slot.
enum Applied {
    Done(Decision),
    /// The slot is being migrated: wait for the writer, then look again.
    Frozen,
    /// The key was removed meanwhile: look again.
    Removed,
}

/// Runs `policy` on the slot's state, whose raw word is `raw`: a deny returns without
/// writing, an admission writes by CAS only if the state changes. An admission delayed
/// more than `max_delay` ns is refused, as a deny whose `retry_after` is the excess.
///
/// Takes the word raw, not as a [`Word`], so that the state stays in a register from the
/// probe to the CAS (an enum returned by the probe made the compiler pass it through the
/// stack); the word is classified here, in registers.
#[inline(always)]
fn apply<K, R: Rule>(
    slot: &Slot<K, R::Atom>,
    mut raw: StateOf<R>,
    policy: &R,
    now: u64,
    op: Op,
) -> Applied {
    loop {
        let state = match Word::from_raw::<R::Atom>(raw) {
            Word::Live(state) => state,
            Word::Frozen => return Applied::Frozen,
            Word::Removed => return Applied::Removed,
        };
        match policy.outcome(op, state, now) {
            Outcome::Deny(decision) => return Applied::Done(decision),
            Outcome::Allow {
                decision,
                state: next,
            } => {
                if next == state {
                    return Applied::Done(decision);
                }
                match slot.update(state, next) {
                    Ok(()) => return Applied::Done(decision),
                    Err(actual) => raw = actual,
                }
            }
        }
    }
}

/// The parts of a write that depend on its kind, for a store of any rule.
trait OpExt {
    fn fits<R: Rule>(self, policy: &R) -> Result<(), InsufficientCapacity>;
    fn on_absent<R: Rule>(self, policy: &R, now: u64) -> Option<Decision>;
}

impl OpExt for Op {
    /// `Err` for a check whose cost exceeds what `policy` can ever admit; settlements
    /// take any amount.
    fn fits<R: Rule>(self, policy: &R) -> Result<(), InsufficientCapacity> {
        match self {
            Op::Check { cost, .. } => policy.fits(cost),
            Op::Settle(_) => Ok(()),
        }
    }

    /// The decision for a key that is absent, when the op stores nothing for it: a check
    /// of cost 0 (admitted) and a refund (nothing to give back: the key is full).
    fn on_absent<R: Rule>(self, policy: &R, now: u64) -> Option<Decision> {
        match self {
            Op::Check { cost: 0, .. } => Some(policy.peek(R::UNTOUCHED, now, 0)),
            Op::Settle(Settle::Refund(_) | Settle::Charge(0)) => {
                Some(policy.peek(R::UNTOUCHED, now, 1))
            }
            _ => None,
        }
    }
}

/// Runs `f` under a guard (for the paths off the hot one), then, once the guard has
/// dropped, frees what was retired meanwhile (by `f`'s resize or elsewhere) unless a
/// check in flight still holds it.
fn with_guard<R>(f: impl FnOnce(&Guard<'_>) -> R) -> R {
    with_guard_writing(|guard, wrote| {
        *wrote = true;
        f(guard)
    })
}

/// [`with_guard`] for a check's slow path, which `f` tells whether it took the writer
/// path (`wrote`): a writer's collect waits a few microseconds for checks in flight, a
/// check that only read through a migration collects once and never waits
/// ([`Domain::collect_once`](super::epoch_table::reclaim::Domain::collect_once)).
fn with_guard_writing<R>(f: impl FnOnce(&Guard<'_>, &mut bool) -> R) -> R {
    let guard = reclaim::pin();
    let mut wrote = false;
    let result = f(&guard, &mut wrote);
    drop(guard);
    let domain = reclaim::global();
    if domain.unfreed() > 0 {
        if wrote {
            domain.collect();
        } else {
            domain.collect_once();
        }
    }
    result
}

/// A sharded, capped map from keys to word states whose checks take no lock.
pub(crate) struct WordStore<K, R: Rule = WordPolicy> {
    shards: Box<[CachePadded<WordShard<K, R>>]>,
    sharding: Sharding,
    denies: Denies,
    limits: Limits,
    counts: Counts,
    /// Serialises default-policy changes, so all shards end on the same one.
    reconfigure: Mutex<()>,
    /// Operator paths (quota changes, removals) driving migrations to their end right
    /// now: while any does, checks do not help (see [`HELP_EVERY`]).
    driving: AtomicUsize,
    /// The smallest table a shard has: [`MIN_CAPACITY`], or the table sized for the keys
    /// the limiter expects ([`Limits::expected_keys`]), which no shrink goes below.
    floor: usize,
}

/// An operator path's hold on [`WordStore::driving`]: counted while it lives, also if
/// the path unwinds.
struct Driving<'a>(&'a AtomicUsize);

impl<'a> Driving<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<K: crate::Key, R: Rule> WordStore<K, R> {
    /// A store with `limits.shards` shards (a power of two), all under `policy`. Decides
    /// the reclamation's barrier here, on the builder's thread, not on the first check
    /// ([`Domain::decide_barrier`](super::epoch_table::reclaim::Domain::decide_barrier)).
    pub(crate) fn new(limits: Limits, policy: R) -> Self {
        reclaim::global().decide_barrier();
        // Keys beyond any table's reach (which the builder refuses): the largest.
        let floor = Self::floor(limits).unwrap_or(usize::MAX);
        let sharding = Sharding::new(limits.shards);
        let policies = || Policies {
            default: policy,
            key_quotas: None,
        };
        Self {
            shards: (0..limits.shards)
                .map(|i| {
                    let hand = Hand {
                        live: 0,
                        built: 0,
                        growing: true,
                        drop_from: u64::MAX,
                        #[cfg(test)]
                        full_sweeps: 0,
                        #[cfg(test)]
                        skipped_sweeps: 0,
                        #[cfg(test)]
                        missed: 0,

                        at: 0,
                        rng: XorShift::new(sharding.seed(i)),
                    };
                    CachePadded::new(if floor > MIN_CAPACITY {
                        EpochTable::written(floor, policies(), hand)
                    } else {
                        EpochTable::new(MIN_CAPACITY, policies(), hand)
                    })
                })
                .collect(),
            sharding,
            denies: Denies::new(),
            limits,
            counts: Counts::new(limits.max_keys),
            reconfigure: Mutex::new(()),
            driving: AtomicUsize::new(0),
            floor,
        }
    }

    /// The table a shard starts with and never shrinks below under `limits`: sized for
    /// its share of the expected keys (see [`keys_per_shard`]) and room for the inserts
    /// that would make its successor ready ([`PREPARE_AHEAD`]), so that none of those
    /// keys grows it; [`MIN_CAPACITY`] when none are expected. `None` beyond what a
    /// table can hold (2³² slots).
    fn floor(limits: Limits) -> Option<usize> {
        match keys_per_shard(limits.expected_keys, limits.shards) {
            0 => Some(MIN_CAPACITY),
            keys => Some(capacity_holding(keys, PREPARE_AHEAD)?.max(MIN_CAPACITY)),
        }
    }

    /// The bytes of the tables [`new`](Self::new) writes for `limits` up front (0 when no
    /// keys are expected), or `None` beyond what a table can hold or the address space.
    pub(crate) fn bytes_ahead(limits: Limits) -> Option<usize> {
        if limits.expected_keys == 0 {
            return Some(0);
        }
        Self::floor(limits)?
            .checked_mul(slot_bytes::<K, R::Atom>())?
            .checked_mul(limits.shards)
    }

    /// The hash the store reads for `key` (see [`Sharding`]).
    #[inline(always)]
    fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.sharding.hash(key)
    }

    #[inline]
    fn shard(&self, hash: u64) -> &WordShard<K, R> {
        &self.shards[Sharding::shard(hash, self.shards.len())]
    }

    fn rehash(&self) -> impl Fn(&K) -> u64 + '_ {
        |key| self.hash(key)
    }

    /// Decides a request of `cost` for `key` at `now`, inserting the key if it is new
    /// (and `cost > 0`). An admission that would be delayed more than `max_delay` ns is
    /// refused instead.
    ///
    /// Takes no lock for an existing key (unless a resize of its shard is moving it right
    /// now, when it waits for that); a new key takes its shard's writer mutex.
    #[inline(always)]
    pub(crate) fn check<Q>(
        &self,
        key: &Q,
        now: impl FnOnce() -> u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // The clock first: its latency overlaps the hash and the probe's loads.
        let now = now();
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let op = Op::Check { cost, max_delay };
        let cacheable = Denies::applies(true, cost, max_delay);
        let generation = if cacheable {
            self.denies.generation()
        } else {
            0
        };
        if cacheable {
            if let Some(denied) = self.denies.lookup(generation, hash, key, now) {
                return Ok(denied);
            }
        }
        // Every policy admits at least one unit, so a unit check skips the capacity test.
        let fast = self.fast(shard, hash, key, now, op, |policy| {
            cost <= 1 || cost <= policy.capacity()
        });
        let decision = match fast {
            Some(decision) => decision,
            None => self.check_slow(hash, key, now, cost, max_delay)?,
        };
        if cacheable {
            self.denies.remember(generation, hash, key, now, &decision);
        }
        Ok(decision)
    }

    /// Starts loading the slot `key` would be in (a hint for a caller that will check
    /// the key soon but must first read something else: its plan).
    #[inline]
    pub(crate) fn prefetch<Q: Hash + ?Sized>(&self, key: &Q) {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let guard = reclaim::pin();
        shard.read(&guard).prefetch(hash);
    }

    /// [`check`](Self::check) without its slow path: the decision from this thread's
    /// deny cache or from the lock-free path, `None` (nothing consumed) for a key the
    /// fast path leaves to [`decide_slow`](Self::decide_slow). For a caller that returns
    /// this decision from one branch and a slow path's from another, so that it stays
    /// in registers (a compound check: see `compound::check_all`). `check` keeps its own
    /// copy of these lines, tuned for the single quota's path.
    #[inline(always)]
    pub(crate) fn check_held<Q>(
        &self,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Option<Decision>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let cacheable = Denies::applies(true, cost, max_delay);
        let generation = if cacheable {
            self.denies.generation()
        } else {
            0
        };
        if cacheable {
            if let Some(denied) = self.denies.lookup(generation, hash, key, now) {
                return Some(denied);
            }
        }
        let op = Op::Check { cost, max_delay };
        let decision = self.fast(shard, hash, key, now, op, |policy| {
            cost <= 1 || cost <= policy.capacity()
        })?;
        if cacheable {
            self.denies.remember(generation, hash, key, now, &decision);
        }
        Some(decision)
    }

    /// The lock-free path of a write to a key the shard holds, if `eligible` for its
    /// policy: `None` for an absent key, one being moved or removed, or one not eligible
    /// (then [`decide_slow`](Self::decide_slow) decides).
    #[inline(always)]
    fn fast<Q>(
        &self,
        shard: &WordShard<K, R>,
        hash: u64,
        key: &Q,
        now: u64,
        op: Op,
        eligible: impl FnOnce(&R) -> bool,
    ) -> Option<Decision>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let guard = reclaim::pin();
        let table = shard.read(&guard);
        // During a migration the key may be in the next table (moved, or new): its home
        // there starts loading now, so that its miss overlaps this table's.
        let next = table.next();
        if let Some(next) = next {
            next.prefetch(hash);
        }
        let policy = table.meta.policy_for(hash, key);
        let fast = if eligible(policy) {
            match table.find_raw(hash, |k| k.borrow() == key) {
                Some((slot, raw)) => match apply(slot, raw, policy, now, op) {
                    Applied::Done(decision) => Some(decision),
                    Applied::Frozen | Applied::Removed => None,
                },
                None => None,
            }
        } else {
            None
        };
        let migrating = fast.is_some() && next.is_some();
        // The guard drops first, and a help pins its own: passing this guard by reference
        // kept it in the stack frame, and a `String` key's probe then reloaded the table
        // from the stack (callgrind: 272 instructions a check against 263).
        drop(guard);
        if migrating {
            self.met_migration(shard, now);
        }
        fast
    }

    /// Charges or refunds `key` at `now` (the caller has checked that the algorithm
    /// supports `settle`): a charge inserts a new key, a refund of an absent key changes
    /// nothing. Returns what a unit request would get right after; a charge of a new key
    /// that finds no room is that refusal (a capacity deny), with nothing written.
    ///
    /// Invalidates the cached denies after its write (so that no check caches a deny of
    /// the state before it) if a deny of this key may be cached: a refund may admit a
    /// cached deny's key, and a charge moves its retry-after later (see
    /// [`Settle::may_outdate`]).
    ///
    /// Infallible: a settlement takes any amount, so the capacity test that can refuse a
    /// check never refuses it.
    #[inline]
    pub(crate) fn settle<Q>(&self, key: &Q, now: u64, settle: Settle) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        match self.settle_held(key, now, settle) {
            Some(decision) => decision,
            None => self.settle_slow(key, now, settle),
        }
    }

    /// [`settle`](Self::settle)'s lock-free path, for a key the shard holds (never a
    /// capacity deny): `None` leaves the settlement to
    /// [`settle_slow`](Self::settle_slow). A caller that returns the decision from here
    /// and the slow path's from another branch keeps it in registers: merged into one
    /// value, it went through the stack and its copy stalled on store forwarding.
    #[inline(always)]
    pub(crate) fn settle_held<Q>(&self, key: &Q, now: u64, settle: Settle) -> Option<Decision>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let op = Op::Settle(settle);
        let decision = self.fast(self.shard(hash), hash, key, now, op, |_| true)?;
        if settle.may_outdate(&decision) {
            self.denies.invalidate();
        }
        Some(decision)
    }

    /// [`settle`](Self::settle) for a key [`settle_held`](Self::settle_held) did not
    /// decide: absent, being moved or just removed.
    #[cold]
    #[inline(never)]
    pub(crate) fn settle_slow<Q>(&self, key: &Q, now: u64, settle: Settle) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.hash(key);
        // `Op::fits` admits every settlement, so `decide_slow` has no error to return
        // for one; were it ever to, the settlement would be refused as a capacity deny
        // (the caller's `NoRoom`, nothing written) rather than lost or panicking.
        let decision = self
            .decide_slow(hash, key, now, Op::Settle(settle))
            .unwrap_or_else(|e| Decision::capacity_deny(e.capacity, 1));
        if settle.may_outdate(&decision) {
            self.denies.invalidate();
        }
        decision
    }

    /// [`decide_slow`](Self::decide_slow) for a check, called with the check's cost and
    /// delay bound as plain arguments. An `Op` passed by value is three words, so it goes
    /// by pointer to a copy in the caller's frame; that copy's address escapes, and after
    /// the pair word's `asm!` load (a compiler barrier) the fast path would reload the
    /// op from memory and test it at run time instead of folding the constant cost of a
    /// unit check.
    #[cold]
    #[inline(never)]
    fn check_slow<Q>(
        &self,
        hash: u64,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.decide_slow(hash, key, now, Op::Check { cost, max_delay })
    }

    /// Every case the fast path leaves: a cost above capacity, an absent key (peeked or
    /// inserted), a key being migrated (read in the table it moved to) or just removed.
    #[cold]
    #[inline(never)]
    fn decide_slow<Q>(
        &self,
        hash: u64,
        key: &Q,
        now: u64,
        op: Op,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let shard = self.shard(hash);
        with_guard_writing(|guard, wrote| {
            loop {
                let current = shard.read(guard);
                match current.locate(hash, |k| k.borrow() == key) {
                    Located::Found { table, slot, raw } => {
                        let policy = table.meta.policy_for(hash, key);
                        op.fits(policy)?;
                        match apply(slot, raw, policy, now, op) {
                            Applied::Done(decision) => {
                                if current.next().is_some() {
                                    self.met_migration(shard, now);
                                }
                                return Ok(decision);
                            }
                            // Frozen or removed meanwhile: look again.
                            Applied::Frozen | Applied::Removed => {}
                        }
                    }
                    Located::Absent { table } => {
                        let policy = table.meta.policy_for(hash, key);
                        if let Some(decision) = op.on_absent(policy, now) {
                            return Ok(decision);
                        }
                        if let Some(decision) =
                            self.insert(shard, guard, hash, key, now, op, wrote)?
                        {
                            return Ok(decision);
                        }
                    }
                    // Being moved (the writer path tells where; a key it finds there, in
                    // the middle of its move or inserted by another thread meanwhile, is
                    // decided with no writer's work, so `wrote` stays as it was).
                    Located::Moving => {
                        if let Some(decision) =
                            self.insert(shard, guard, hash, key, now, op, wrote)?
                        {
                            return Ok(decision);
                        }
                    }
                }
            }
        })
    }

    /// Where `key` is, settled: a key being moved right now is waited for (under the
    /// writer mutex no move is half done, so there it is found or absent).
    fn locate<'g, Q>(
        &self,
        shard: &'g WordShard<K, R>,
        guard: &'g Guard<'_>,
        hash: u64,
        key: &Q,
    ) -> Located<'g, K, Policies<K, R>, R::Atom>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        match shard.read(guard).locate(hash, |k| k.borrow() == key) {
            Located::Moving => {
                let writer = shard.write();
                match writer.table(guard).locate(hash, |k| k.borrow() == key) {
                    Located::Moving => Located::Absent {
                        table: writer.target(guard),
                    },
                    settled => settled,
                }
            }
            settled => settled,
        }
    }

    /// The decision a request of `cost` for `key` would get at `now`, consuming nothing
    /// and storing nothing. Takes no lock (unless the key is being moved right now).
    pub(crate) fn peek<Q>(
        &self,
        key: &Q,
        now: u64,
        cost: u64,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        with_guard(|guard| {
            loop {
                match self.locate(shard, guard, hash, key) {
                    Located::Found { table, raw, .. } => {
                        let policy = table.meta.policy_for(hash, key);
                        policy.fits(cost)?;
                        if let Word::Live(state) = Word::from_raw::<R::Atom>(raw) {
                            return Ok(policy.peek(state, now, cost));
                        }
                    }
                    Located::Absent { table } => {
                        let policy = table.meta.policy_for(hash, key);
                        policy.fits(cost)?;
                        return Ok(policy.peek(R::UNTOUCHED, now, cost));
                    }
                    Located::Moving => {}
                }
            }
        })
    }

    /// How many keys hold state.
    pub(crate) fn len(&self) -> usize {
        self.counts.len()
    }

    /// The store's counters.
    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats {
            retired_tables: self.retired_unfreed() as u64,
            ..self.counts.stats()
        }
    }

    /// This store's tables replaced by a resize and not yet freed.
    pub(crate) fn retired_unfreed(&self) -> usize {
        self.shards.iter().map(|s| s.retired_unfreed()).sum()
    }

    /// The number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The keys held by each shard (for tests of the sharding).
    #[cfg(test)]
    fn shard_lens(&self) -> Vec<usize> {
        self.shards.iter().map(|s| s.write().state().live).collect()
    }
}

#[cfg(test)]
mod tests;
