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
/// thread: a help moves [`STEP_PER_INSERT`] slots (about a microsecond at millions of
/// keys), which on every such check doubled the checks' p99 while a table grew or a
/// quota change ran. Inserts still move their slots each time, and an operator's path
/// drives its migration to the end, so helping is only what finishes a migration that
/// inserts started and then stopped feeding: `HELP_EVERY / STEP_PER_INSERT` checks per
/// slot, 4 per slot of the table. While an operator's path drives migrations (a quota
/// change, a removal), checks do not help at all: the path moves every slot itself, so a
/// help there would only spend a check's time (and, early in a migration, fault in pages
/// of the new table ahead of the path's prefault) on moves the path makes anyway.
const HELP_EVERY: u32 = 64;

/// While a table that grew last time is within `capacity / PREPARE_AHEAD` inserts of
/// full, each insert writes [`PREPARE_PAGES`] pages' worth of the slots of the table its
/// growth will move to ([`Writer::prepare`]), so that neither the migration's moves nor
/// the readers that look in the new table take a page fault on it, and no insert zeroes
/// a whole table: a fault costs microseconds (two, and a TLB shootdown of the other
/// threads, where a reader mapped the zero page first), and a table of 2M keys'
/// growth is megabytes. A growth of 1.25× has `1.25·capacity / 256` pages for `u64`
/// keys: written in the first third of the inserts ahead, and resident ahead of the
/// growth for about 2% of its span.
const PREPARE_AHEAD: usize = 256;
/// Pages an insert writes of the next table: about 1 insert in 180 while a table grows
/// (a 1.25× growth's `1.25·capacity / 256` pages, 4 an insert, over the
/// `0.215·capacity` inserts of its span), under the 1 in 100 that would reach the p99.
/// Each pays 4–8 µs where the pages fault. With 8 pages an insert, half as often, the
/// new key's p99.99 at 2M keys was half as high again (benches/README, "Fewer pages
/// written ahead per insert").
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
    /// the pair word's `asm!` load (a compiler barrier) the fast path had to reload the
    /// op from memory and test it at run time instead of folding the constant cost of a
    /// unit check: 5–7 ns of a two-quota check (see benches/README).
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

    /// A check met a migration under way (on its key's table, moved or not): one such
    /// check in [`HELP_EVERY`] per thread helps it along, under a guard of its own (a
    /// nested one on the slow path, which holds its own).
    #[cold]
    #[inline(never)]
    fn met_migration(&self, shard: &WordShard<K, R>, now: u64) {
        let driven = self.driving.load(Ordering::Relaxed) > 0;
        if !driven && helps_this_time() {
            let guard = reclaim::pin();
            self.help(shard, &guard, now);
        }
    }

    /// Moves a batch of a migration's slots if no writer is busy (a check that met the
    /// migration helps it end). Allocates nothing: a table it unlinks is retired by the
    /// next writer.
    fn help(&self, shard: &WordShard<K, R>, guard: &Guard<'_>, now: u64) {
        if let Some(mut writer) = shard.try_write() {
            if writer.help(guard, STEP_PER_INSERT, self.rehash(), now) {
                self.published(&mut writer);
            }
        }
    }

    /// Moves up to `budget` slots of the shard's migration, if one runs. Returns true if
    /// the migration ended.
    fn step(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        budget: usize,
        now: u64,
    ) -> bool {
        let published = writer.step(guard, budget, self.rehash(), now);
        if published {
            self.published(writer);
        }
        published
    }

    /// Runs a migration under way to its end, under this hold of the writer mutex.
    fn finish(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) {
        self.step(writer, guard, usize::MAX, now);
    }

    /// Runs the shard's migration to its end, a batch at a time, taking the writer mutex
    /// for each batch only (for the paths that start one for an operator: quota changes,
    /// removals): checks and inserts go on between batches. Then destroys to their end
    /// the retired tables whose release went in pieces (the operator pays for those, not
    /// the next writes).
    fn drive(&self, shard: &WordShard<K, R>, now: impl Fn() -> u64) {
        loop {
            let running = with_guard(|guard| {
                let mut writer = shard.write();
                self.step(&mut writer, guard, DRIVE_BATCH, now());
                writer.migrating(guard)
            });
            if !running {
                reclaim::global().release_parked();
                return;
            }
        }
    }

    /// The write path of a check on a key that was absent or in the middle of its move:
    /// under the writer mutex, finds the key again (another thread may have inserted it,
    /// or the writer that moved it has placed it) and decides on it, doing none of an
    /// insert's work, which may allocate. Otherwise moves a batch of a migration under
    /// way, writes ahead a growing table's next one, makes room, inserts the key and
    /// decides, and sets `wrote` (that work may retire a table: the caller's collect is
    /// then a writer's). `None`: look again.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn insert<Q>(
        &self,
        shard: &WordShard<K, R>,
        guard: &Guard<'_>,
        hash: u64,
        key: &Q,
        now: u64,
        op: Op,
        wrote: &mut bool,
    ) -> Result<Option<Decision>, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let mut writer = shard.write();
        if let Located::Found { table, slot, raw } =
            writer.table(guard).locate(hash, |k| k.borrow() == key)
        {
            let policy = table.meta.policy_for(hash, key);
            op.fits(policy)?;
            return Ok(match apply(slot, raw, policy, now, op) {
                Applied::Done(decision) => Some(decision),
                Applied::Frozen | Applied::Removed => None,
            });
        }
        // Absent. (Under the writer mutex no key is half moved: frozen and absent from the
        // next table means removed after its move.) Moving slots cannot bring it back.
        *wrote = true;
        self.step(&mut writer, guard, STEP_PER_INSERT, now);
        self.prepare_growth(&mut writer, guard);
        // The policy may have changed since the lock-free read; the step may have ended
        // the migration (then its table is the current one).
        let policy = *writer.target(guard).meta.policy_for(hash, key);
        op.fits(&policy)?;
        if let Some(decision) = op.on_absent(&policy, now) {
            return Ok(Some(decision));
        }
        if let Err(retry_after_ns) = self.counts.take_place(
            || self.make_room(&mut writer, guard, now),
            || self.denies.invalidate(),
        ) {
            return Ok(Some(self.counts.refusal(policy.capacity(), retry_after_ns)));
        }
        if !writer.has_room(guard) {
            self.rebuild_full(&mut writer, guard, now);
        }
        match writer.insert(guard, hash, key.to_owned(), R::UNTOUCHED) {
            Ok(slot) => {
                writer.state().live += 1;
                let applied = apply(slot, slot.load_raw(), &policy, now, op);
                if let Word::Live(state) = slot.load() {
                    let from = policy.droppable_from(state, now);
                    let hand = writer.state();
                    hand.drop_from = hand.drop_from.min(from);
                }
                Ok(match applied {
                    Applied::Done(decision) => Some(decision),
                    Applied::Frozen | Applied::Removed => None,
                })
            }
            Err(_) => {
                // The shard is at its largest table (2³² slots).
                self.counts.give_back();
                Ok(Some(
                    self.counts
                        .refusal(policy.capacity(), policy.fallback_retry_ns()),
                ))
            }
        }
    }

    /// Writes a few pages of the table a growing shard will move to next, once it is
    /// near full (see [`PREPARE_AHEAD`]).
    fn prepare_growth(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>) {
        if !writer.state().growing || writer.migrating(guard) {
            return;
        }
        let capacity = writer.table(guard).capacity();
        if !writer.nearly_full(guard, capacity / PREPARE_AHEAD) {
            return;
        }
        let live = writer.state().live;
        writer.prepare(guard, grown(capacity), live, PREPARE_PAGES);
    }

    /// Rebuilds a full table (live and removed slots at the load limit). With sweeping
    /// on, first drops the keys untouched for a period and since the last such rebuild
    /// (see [`Sweep`]): the keys in use stay, whatever their period. Then sizes the new
    /// table for what the last rebuild's span showed:
    /// - the keys left fill at most 60% of it: the same size without the removed slots,
    ///   or, under an eighth, a table they fill 30% of (every key inserted since the last
    ///   rebuild is among them, so the smaller table takes as many inserts again before it
    ///   is full: it does not regrow at once);
    /// - more, and nothing was dropped (the keys are all in use: growth): [`grown`];
    /// - more, after drops: [`grown`] but at most 2×. Either the keys in use outnumber
    ///   what one span holds (they come back after a drop: the table grows until a span
    ///   covers them), or a flood of keys goes idle, and then the keys carried over fill
    ///   at least 30% of the larger table, so its next span inserts at most 56% of it, all
    ///   of which a rebuild's sweep finds under 60%: growth stops, and the flood is held to
    ///   about two spans' worth of keys. (Growth by more than 2.3× would not stop.)
    ///
    /// The sweep reads every slot under the writer mutex (O(1) per insert, amortised, but
    /// not bounded per insert: 1.8 ms at 250,000 keys), so it runs only once a key can be
    /// droppable ([`Hand::drop_from`]): a table growing with its keys all in use skips it.
    /// The rebuild itself is a migration: this call only starts it, and inserts and
    /// checks move its slots a batch at a time.
    fn rebuild_full(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) {
        // A migration under way ends first: then the current table is the full one.
        self.finish(writer, guard, now);
        let capacity = writer.table(guard).capacity();
        let mut dropped = 0;
        // Only once a key can go: a skipped sweep does what one dropping nothing would,
        // which is all it could do.
        let sweeping = self.limits.sweep && now >= writer.state().drop_from;
        #[cfg(test)]
        if self.limits.sweep && !sweeping {
            let missed = self.droppable(writer, guard, now);
            let hand = writer.state();
            hand.skipped_sweeps += 1;
            hand.missed += missed;
        }
        if sweeping {
            let built = writer.state().built;
            let swept = self.sweep(writer, guard, now, capacity, Some(built));
            dropped = swept.dropped;
            // The sweep read every key of the shard: the bound is theirs alone now.
            writer.state().drop_from = swept.drop_from;
            #[cfg(test)]
            {
                writer.state().full_sweeps += 1;
            }
            self.counts.swept(dropped);
        }
        writer.state().built = now;
        let needed = writer.state().live + 1;
        let capacity = if needed * GROW_ABOVE_DEN <= capacity * GROW_ABOVE_NUM {
            if needed * 8 < capacity {
                (needed * 10 / 3).max(self.floor)
            } else {
                capacity
            }
        } else if dropped == 0 {
            grown(capacity)
        } else {
            grown(capacity).min(capacity * 2)
        };
        writer.state().growing = capacity > writer.table(guard).capacity();
        self.resize_to(writer, guard, capacity, now);
    }

    /// Starts migrating the shard to a table sized for `live` keys at the target load.
    fn resize(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, live: usize, now: u64) {
        let capacity = (live * TARGET_LOAD_DEN / TARGET_LOAD_NUM).max(self.floor);
        self.resize_to(writer, guard, capacity, now);
    }

    /// Starts migrating the shard to a table of `capacity` slots (more if its keys need
    /// them), with the same policies, leaving removed slots behind.
    fn resize_to(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        capacity: usize,
        now: u64,
    ) {
        let meta = writer.target(guard).meta.clone();
        self.begin(writer, guard, capacity, meta, now);
    }

    /// Starts a migration to a table of `capacity` slots carrying `meta` (finishing one
    /// under way first).
    fn begin(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        capacity: usize,
        meta: Policies<K, R>,
        now: u64,
    ) {
        self.finish(writer, guard, now);
        let live = writer.state().live;
        writer.begin_migration(guard, capacity, live, meta, self.rehash(), now);
        self.counts.resized();
    }

    /// Bookkeeping after a migration published its table: the hand starts over.
    fn published(&self, writer: &mut ShardWriter<'_, K, R>) {
        writer.state().at = 0;
    }

    /// Shrinks the shard's table once it is under a quarter full, so memory taken by a
    /// flood is given back.
    fn shrink_if_sparse(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) {
        let live = writer.state().live;
        let capacity = writer.target(guard).capacity();
        if capacity > self.floor && live * 4 < capacity {
            self.resize(
                writer,
                guard,
                live * 2 * TARGET_LOAD_NUM / TARGET_LOAD_DEN,
                now,
            );
        }
    }

    /// The policy of the key in `slot` (which must hold one).
    fn slot_policy<'t>(
        &self,
        table: &'t Table<K, Policies<K, R>, R::Atom>,
        slot: &Slot<K, R::Atom>,
    ) -> &'t R {
        if table.meta.key_quotas.is_none() {
            return &table.meta.default;
        }
        slot.with_key(|key| table.meta.policy_for(self.hash(key), key))
            .unwrap_or(&table.meta.default)
    }

    /// Moves the eviction hand over `slots` slots of the current table, dropping the keys
    /// back to untouched (see [`Sweep`]; with a `grace`, only those untouched for a period
    /// and since then, or for 4 periods and 1 s). Returns how many were removed, the
    /// soonest time, in ns, at which a visited survivor will be droppable by a sweep like
    /// this one, and the soonest instant at which a rebuild's sweep could drop one.
    fn sweep(
        &self,
        writer: &mut ShardWriter<'_, K, R>,
        guard: &Guard<'_>,
        now: u64,
        slots: usize,
        grace: Option<u64>,
    ) -> Swept {
        let table = writer.table(guard);
        let capacity = table.capacity();
        let mut sweep = Sweep::new(now, grace);
        let mut drop_from = u64::MAX;
        for _ in 0..slots.min(capacity) {
            let at = writer.state().at % capacity;
            writer.state().at = at + 1;
            let slot = table.slot(at);
            let Some(judged) = self.judge(table, slot, &sweep, now) else {
                continue;
            };
            // A check that changed the state meanwhile keeps the key.
            if sweep.visit(judged.wait, || writer.remove_unchanged(slot, judged.state)) {
                writer.state().live -= 1;
            } else if judged.wait > 0 {
                // Untouched from `since + wait` on (see `Rule::droppable_from`).
                drop_from = drop_from.min(judged.droppable_at);
            } else {
                drop_from = 0;
            }
        }
        let (dropped, soonest) = sweep.finish();
        Swept {
            dropped,
            soonest,
            drop_from,
        }
    }

    /// How `sweep` judges the key in `slot` at `now`: `None` if the slot holds no live key.
    fn judge(
        &self,
        table: &Table<K, Policies<K, R>, R::Atom>,
        slot: &Slot<K, R::Atom>,
        sweep: &Sweep,
        now: u64,
    ) -> Option<Judged<StateOf<R>>> {
        let Word::Live(state) = slot.load() else {
            return None;
        };
        let verdict = self.slot_policy(table, slot).judge(state, now, sweep);
        Some(Judged {
            state,
            wait: verdict.wait,
            droppable_at: verdict.droppable_at,
        })
    }

    /// How many keys of the current table a rebuild's sweep at `now` would drop, dropping
    /// none.
    #[cfg(test)]
    fn droppable(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) -> usize {
        let table = writer.table(guard);
        let sweep = Sweep::new(now, Some(writer.state().built));
        (0..table.capacity())
            .filter_map(|at| self.judge(table, table.slot(at), &sweep, now))
            .filter(|judged| judged.wait == 0)
            .count()
    }

    /// Makes room for one key in a full store: an untouched key near the hand if there is
    /// one, else, under [`WhenFull::EvictLeastActive`], of a few sampled keys the one
    /// whose eviction loses the least: the fewest units consumed, then the soonest reset.
    fn make_room(&self, writer: &mut ShardWriter<'_, K, R>, guard: &Guard<'_>, now: u64) -> Room {
        let Swept {
            dropped, soonest, ..
        } = self.sweep(writer, guard, now, SCAN_WHEN_FULL * 8, None);
        if dropped > 0 {
            self.shrink_if_sparse(writer, guard, now);
            return Room::Untouched;
        }
        let table = writer.table(guard);
        let fallback = table.meta.default.fallback_retry_ns().max(1);
        if self.limits.when_full == WhenFull::DenyNewKeys || writer.state().live == 0 {
            return Room::none_until(soonest, fallback);
        }
        // While a migration runs, the live keys are in both tables: positions past the
        // current table's are the new one's.
        let target = writer.target(guard);
        let positions = if std::ptr::eq(table, target) {
            table.capacity()
        } else {
            table.capacity() + target.capacity()
        };
        let slot_at = |at: usize| {
            if at < table.capacity() {
                (table, table.slot(at))
            } else {
                (target, target.slot(at - table.capacity()))
            }
        };
        // With no more live keys than samples, every key is a candidate (the table is
        // then small: it shrinks below a quarter full): random draws could miss the one
        // that loses least.
        let every = writer.state().live <= SAMPLES;
        let mut rng = writer.state().rng;
        let victim = least_costly(positions, every, SAMPLES * 8, &mut rng, |at| {
            let (table, slot) = slot_at(at);
            let Word::Live(state) = slot.load() else {
                return None;
            };
            Some(self.slot_policy(table, slot).eviction_cost(state, now))
        });
        // The draws can all miss in tables of mostly removed slots (a flood evicts a key
        // per insert): then the first live key from a random position.
        let start = (rng.next_u64() % positions as u64) as usize;
        writer.state().rng = rng;
        let victim = victim.or_else(|| {
            (0..positions)
                .map(|i| (start + i) % positions)
                .find(|&at| matches!(slot_at(at).1.load(), Word::Live(_)))
        });
        let Some(at) = victim else {
            return Room::None {
                retry_after_ns: fallback,
            };
        };
        if writer.remove(slot_at(at).1).is_some() {
            writer.state().live -= 1;
            Room::Active
        } else {
            Room::None {
                retry_after_ns: fallback,
            }
        }
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

    /// Removes `key`'s state (not its key quota); true if it held state.
    ///
    /// Takes the key's shard writer mutex (and, if the removal shrinks the table, again
    /// for each batch of the migration).
    pub(crate) fn remove<Q>(&self, key: &Q, now: impl Fn() -> u64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let _driving = Driving::new(&self.driving);
        let removed = with_guard(|guard| {
            let mut writer = shard.write();
            let Located::Found { slot, .. } =
                writer.table(guard).locate(hash, |k| k.borrow() == key)
            else {
                return false;
            };
            if writer.remove(slot).is_none() {
                return false;
            }
            writer.state().live -= 1;
            self.shrink_if_sparse(&mut writer, guard, now());
            true
        });
        if removed {
            self.counts.removed();
            self.denies.invalidate();
            self.drive(shard, now);
        }
        removed
    }

    /// Gives `key` its own policy (`Some`) or returns it to the default (`None`),
    /// converting its state. The shard migrates to a table carrying the new policies;
    /// until its slot has moved, the key is decided by the old ones.
    ///
    /// Takes the key's shard writer mutex, once to start the migration and once for each
    /// batch of it: checks go on meanwhile.
    pub(crate) fn set_key_quota(&self, key: K, policy: Option<WordPolicy>, now: impl Fn() -> u64) {
        let hash = self.hash(&key);
        let shard = self.shard(hash);
        let _driving = Driving::new(&self.driving);
        with_guard(|guard| {
            let mut writer = shard.write();
            self.finish(&mut writer, guard, now());
            let table = writer.table(guard);
            let mut key_quotas = table
                .meta
                .key_quotas
                .as_deref()
                .map_or_else(KeyQuotas::new, Clone::clone);
            let rehash = self.rehash();
            key_quotas.set(
                hash,
                Arc::new(key),
                policy.map(|first| table.meta.default.with_first(first)),
                |a, b| **a == **b,
                |k: &Arc<K>| rehash(k),
            );
            let meta = Policies {
                default: table.meta.default,
                key_quotas: (!key_quotas.is_empty()).then(|| Arc::new(key_quotas)),
            };
            let capacity = table.capacity();
            // Converted states and another period: the bound no longer holds.
            writer.state().drop_from = 0;
            self.begin(&mut writer, guard, capacity, meta, now());
        });
        self.denies.invalidate();
        self.drive(shard, &now);
        self.denies.invalidate();
    }

    /// The policy of the limiter's own quota that `key` is limited by. Takes no lock.
    pub(crate) fn policy_of<Q>(&self, key: &Q) -> WordPolicy
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.rule_of(key).first()
    }

    /// The rule `key` is limited by. Takes no lock.
    pub(crate) fn rule_of<Q>(&self, key: &Q) -> R
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        with_guard(
            |guard| match self.locate(self.shard(hash), guard, hash, key) {
                Located::Found { table, .. } | Located::Absent { table } => {
                    *table.meta.policy_for(hash, key)
                }
                Located::Moving => *self
                    .shard(hash)
                    .read(guard)
                    .newest()
                    .meta
                    .policy_for(hash, key),
            },
        )
    }

    /// The default policy. Takes no lock.
    pub(crate) fn default_policy(&self) -> WordPolicy {
        self.default_rule().first()
    }

    /// The default rule (every quota's policy). Takes no lock.
    pub(crate) fn default_rule(&self) -> R {
        with_guard(|guard| self.shards[0].read(guard).newest().meta.default)
    }

    /// Replaces the default quota, keeping the algorithm, converting every key without a
    /// key quota. Each shard migrates to a table carrying the new default; until a key's
    /// slot has moved, it is decided by the old one, and its state is converted as it
    /// moves (at that instant).
    ///
    /// Takes each shard's writer mutex once to start its migration and once for each
    /// batch of it: checks never wait on it (a check meeting a key in the middle of its
    /// move, a few nanoseconds, waits for that move), and inserts go on between batches.
    pub(crate) fn set_default_quota(
        &self,
        quota: Quota,
        now: impl Fn() -> u64,
    ) -> Result<(), ConfigError> {
        let _serial = self.reconfigure.lock();
        let rule = self.default_rule();
        let policy = rule.with_first(rule.first().with_quota(quota)?);
        let _driving = Driving::new(&self.driving);
        for shard in self.shards.iter() {
            with_guard(|guard| {
                let mut writer = shard.write();
                self.finish(&mut writer, guard, now());
                let table = writer.table(guard);
                let meta = Policies {
                    default: policy,
                    key_quotas: table.meta.key_quotas.clone(),
                };
                let capacity = table.capacity();
                // Converted states and another period: the bound no longer holds.
                writer.state().drop_from = 0;
                self.begin(&mut writer, guard, capacity, meta, now());
            });
        }
        self.denies.invalidate();
        for shard in self.shards.iter() {
            self.drive(shard, &now);
        }
        self.denies.invalidate();
        Ok(())
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
mod tests {
    use super::*;
    use crate::algorithm::AnyPolicy;
    use std::time::Duration;

    fn limits(shards: usize, max_keys: usize) -> Limits {
        Limits {
            shards,
            max_keys,
            when_full: WhenFull::DenyNewKeys,
            sweep: false,
            expected_keys: 0,
        }
    }

    fn store(shards: usize, max_keys: usize) -> WordStore<String> {
        let quota = Quota::new(1, Duration::from_nanos(100)).unwrap();
        WordStore::new(limits(shards, max_keys), WordPolicy::token_bucket(quota))
    }

    #[test]
    fn borrowed_lookups_find_owned_keys() {
        let store = store(4, usize::MAX);
        assert!(store.check("a", || 0, 1, u64::MAX).unwrap().is_allowed());
        assert!(!store.check("a", || 0, 1, u64::MAX).unwrap().is_allowed());
        assert!(store.peek("b", 0, 1).unwrap().is_allowed());
        assert_eq!(store.len(), 1);
        assert!(store.remove("a", || 0));
        assert!(!store.remove("a", || 0));
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn keys_spread_over_all_shards() {
        let store = store(8, usize::MAX);
        for i in 0..8000 {
            store
                .check(format!("k{i}").as_str(), || 0, 1, u64::MAX)
                .unwrap();
        }
        for len in store.shard_lens() {
            assert!((800..1200).contains(&len), "{len} keys in one shard of 8");
        }
    }

    #[test]
    fn a_full_store_evicts_only_untouched_keys_and_says_when_to_retry() {
        // One shard so the hand sees every key; T = 100ns, burst 1.
        let store = store(1, 2);
        store.check("old", || 0, 1, u64::MAX).unwrap();
        store.check("busy", || 50, 1, u64::MAX).unwrap();
        // At 120, "old" is untouched (full since 100) and "busy" is full at 150.
        assert!(
            store
                .check("new", || 120, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        );
        assert_eq!(store.stats().evicted_untouched, 1);
        let d = store.check("other", || 120, 1, u64::MAX).unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(30)));
        assert_eq!(store.len(), 2);
        assert_eq!(store.stats().refused_new_keys, 1);
        assert!(
            store
                .check("other", || 150, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        );
    }

    #[test]
    fn cached_denies_are_exact_and_invalidated_by_admin_changes() {
        let store = store(2, usize::MAX);
        store.check("k", || 0, 1, u64::MAX).unwrap();
        let first = store.check("k", || 10, 1, u64::MAX).unwrap();
        // Served from the cache: the same instants, seen from a later now.
        let cached = store.check("k", || 30, 1, u64::MAX).unwrap();
        assert_eq!(cached.retry_after(), Some(Duration::from_nanos(70)));
        assert_eq!(
            cached.reset_after(),
            first.reset_after() - Duration::from_nanos(20)
        );
        assert_eq!(cached, store.peek("k", 30, 1).unwrap());
        // At the retry instant the store answers again, and admits.
        assert!(store.check("k", || 100, 1, u64::MAX).unwrap().is_allowed());
        // A reset must not leave a stale deny behind.
        assert!(!store.check("k", || 110, 1, u64::MAX).unwrap().is_allowed());
        store.remove("k", || 0);
        assert!(store.check("k", || 111, 1, u64::MAX).unwrap().is_allowed());
    }

    #[test]
    fn a_quota_change_converts_state_in_the_migration() {
        let Ok(AnyPolicy::Word(policy)) =
            AnyPolicy::new(crate::Algorithm::TokenBucket, "10/s".parse().unwrap())
        else {
            panic!("word policy")
        };
        let store: WordStore<String> = WordStore::new(limits(2, usize::MAX), policy);
        for _ in 0..5 {
            store.check("k", || 0, 1, u64::MAX).unwrap();
        }
        store
            .set_default_quota("100/s".parse().unwrap(), || 0)
            .unwrap();
        assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 95);
        store.set_key_quota("k".to_owned(), Some(policy), || 0);
        assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 5);
        assert_eq!(store.policy_of("k").quota().limit(), 10);
        assert_eq!(store.policy_of("j").quota().limit(), 100);
        // Back to the default: the key's 5 consumed units carry over.
        store.set_key_quota("k".to_owned(), None, || 0);
        assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 95);
        assert_eq!(store.policy_of("k").quota().limit(), 100);
    }

    /// One shard growing to 250,000 keys in use (2M keys over the 8 shards of 2 CPUs):
    /// 4× while the table is under 2¹⁴ slots, then 1.25×, so 16 rebuilds in all, and the
    /// table ends at least 68% full (0.86 / 1.25).
    #[test]
    fn growth_takes_few_rebuilds_and_keeps_the_table_full() {
        let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
        let limits = Limits {
            sweep: true,
            ..limits(1, usize::MAX)
        };
        let store: WordStore<u64> = WordStore::new(limits, WordPolicy::token_bucket(quota));
        for key in 0..250_000u64 {
            assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
        }
        let stats = store.stats();
        assert_eq!(stats.keys, 250_000);
        assert!(stats.resizes <= 16, "{stats:?}");
        let capacity = with_guard(|g| store.shards[0].read(g).capacity());
        assert!(
            capacity * 68 <= 250_000 * 100,
            "{capacity} slots for 250,000 keys"
        );
    }

    /// A table growing with keys all in use skips every rebuild's sweep (none could drop
    /// a key: each would read the whole table under the writer mutex for nothing), and
    /// sweeps again, dropping the idle keys, once they can go.
    #[test]
    fn a_growing_table_skips_sweeps_that_could_drop_nothing() {
        let hour = 3_600_000_000_000u64;
        let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
        let limits = Limits {
            sweep: true,
            ..limits(1, usize::MAX)
        };
        let store: WordStore<u64> = WordStore::new(limits, WordPolicy::token_bucket(quota));
        let hand = |f: fn(&mut Hand) -> usize| f(store.shards[0].write().state());
        for key in 0..100_000u64 {
            assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
        }
        let resizes = store.stats().resizes;
        assert!(resizes >= 8, "{resizes} rebuilds");
        assert_eq!(hand(|h| h.full_sweeps), 0);
        assert_eq!(hand(|h| h.skipped_sweeps) as u64, resizes);
        // Three hours later every key has been idle for two periods: the next rebuild
        // sweeps (keys untouched since the previous rebuild go, and that was before their
        // last period), and the one after it drops them all.
        let later = 3 * hour;
        let mut key = 100_000u64;
        while hand(|h| h.full_sweeps) < 2 {
            assert!(
                store
                    .check(&key, || later, 1, u64::MAX)
                    .unwrap()
                    .is_allowed()
            );
            key += 1;
            assert!(key < 400_000, "no sweep in {} inserts", key - 100_000);
        }
        assert!(store.len() < 100_000, "{} keys left", store.len());
        assert!(
            store.stats().evicted_untouched >= 100_000,
            "{:?}",
            store.stats()
        );
        assert_eq!(hand(|h| h.missed), 0);
    }

    /// Over generated timelines (every algorithm, periods from 1 µs to 10 ms, checks
    /// and charges on new and existing keys, quota changes, clock jumps), a rebuild that
    /// skips its sweep never keeps a key the sweep would have dropped.
    #[test]
    fn a_skipped_sweep_never_keeps_a_droppable_key() {
        use crate::Algorithm;
        let algorithms = [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
        ];
        let mut rng = XorShift::new(0x5eed);
        let (mut skipped, mut swept) = (0, 0);
        for scenario in 0..64u64 {
            let period = 1_000 + rng.next_u64() % 10_000_000;
            // A period its count divides into whole nanoseconds.
            let quota = |rng: &mut XorShift| {
                let count = 1 + rng.next_u64() % 20;
                let interval = ((period / 2 + rng.next_u64() % period) / count).max(1);
                Quota::new(count, Duration::from_nanos(interval * count)).unwrap()
            };
            let algorithm = algorithms[scenario as usize % algorithms.len()];
            let Ok(AnyPolicy::Word(policy)) = AnyPolicy::new(algorithm, quota(&mut rng)) else {
                panic!("{algorithm:?} is a word algorithm");
            };
            let limits = Limits {
                sweep: true,
                ..limits(2, usize::MAX)
            };
            let store: WordStore<u64> = WordStore::new(limits, policy);
            // Steps from a hundredth to a hundred-thousandth of a period, and jumps of one
            // to eight periods in 1 in 1,000 or 10,000 steps or none: timelines where keys
            // go idle all the time, and others where a growing set stays in use.
            let (steps, jumps) = [(100, 10), (3_000, 1), (100_000, 0)][scenario as usize % 3];
            let mut now = 0u64;
            let mut next_key = 0u64;
            for _ in 0..20_000 {
                now += match rng.next_u64() % 10_000 {
                    draw if draw < jumps => period * (1 + rng.next_u64() % 8),
                    draw if draw < 10 * jumps => rng.next_u64() % period,
                    _ => rng.next_u64() % (period / steps + 1),
                };
                // New keys, recent ones (a moving set in use) and any older one.
                let key = match rng.next_u64() % 6 {
                    _ if next_key == 0 => 0,
                    0 | 1 => next_key,
                    2..=4 => next_key - 1 - rng.next_u64() % next_key.min(64),
                    _ => rng.next_u64() % next_key,
                };
                next_key = next_key.max(key + 1);
                match rng.next_u64() % 1_000 {
                    0 => store.set_default_quota(quota(&mut rng), || now).unwrap(),
                    1..=50 => {
                        let n = rng.next_u64() % 4;
                        store.settle(&key, now, Settle::Charge(n));
                    }
                    _ => {
                        let _ = store.check(&key, || now, 1, u64::MAX).unwrap();
                    }
                }
            }
            for shard in store.shards.iter() {
                let mut writer = shard.write();
                let hand = writer.state();
                assert_eq!(hand.missed, 0, "scenario {scenario}");
                skipped += hand.skipped_sweeps;
                swept += hand.full_sweeps;
            }
        }
        // Both branches ran.
        assert!(
            skipped > 200 && swept > 200,
            "{skipped} skipped, {swept} swept"
        );
    }

    /// A store of one shard and no key cap, at 1 an hour with a burst of 1: a key
    /// admitted once is denied for the rest of the test.
    fn one_shard_hourly() -> WordStore<u64> {
        let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
        WordStore::new(limits(1, usize::MAX), WordPolicy::token_bucket(quota))
    }

    /// A growing shard prepares its next table in the last inserts before it is full,
    /// and the growth takes it: after the growth no spare is left, and while the table
    /// fills far from full none is made.
    #[test]
    fn a_growing_table_prepares_its_next_one_ahead() {
        let store = one_shard_hourly();
        let shard = &store.shards[0];
        let (mut prepared, mut taken) = (0, 0);
        let mut had_spare = false;
        for key in 0..200_000u64 {
            let before = with_guard(|g| shard.read(g).capacity());
            assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
            let (capacity, spare) = with_guard(|g| {
                let writer = shard.write();
                (writer.target(g).capacity(), writer.has_spare())
            });
            if spare && !had_spare {
                prepared += 1;
                // Only near full: within `capacity / PREPARE_AHEAD` inserts of it.
                let used = store.len();
                assert!(
                    used * 50 + before * 50 / PREPARE_AHEAD >= before * 43 - 50,
                    "a spare at {used} keys of {before} slots"
                );
            }
            if had_spare && !spare && capacity > before {
                taken += 1;
            }
            had_spare = spare;
        }
        // Growths beyond the first few tables take a prepared table each.
        assert!(
            prepared >= 10 && taken >= 10,
            "{prepared} made, {taken} taken"
        );
        assert!(taken + 1 >= prepared, "{prepared} made, {taken} taken");
    }

    /// A check that takes the writer path for a key that exists (it met the key in the
    /// middle of its move, or another thread inserted it first) decides on it and does
    /// none of an insert's work: it does not write ahead the growth's next table (that
    /// allocates megabytes, and a check on an existing key allocates nothing), nor move
    /// a migration's slots, and does not count as a writer (its collect is then a
    /// check's, which never waits); a new key's insert does.
    #[test]
    fn an_existing_key_on_the_writer_path_does_none_of_an_inserts_work() {
        let store = one_shard_hourly();
        let shard = &store.shards[0];
        let unit = Op::Check {
            cost: 1,
            max_delay: u64::MAX,
        };
        // Keys until the next insert would write ahead the growth's table, and not fill
        // the table too.
        let mut keys = 0u64;
        while !with_guard(|g| {
            let mut writer = shard.write();
            let ahead = writer.table(g).capacity() / PREPARE_AHEAD;
            ahead > 1
                && writer.state().growing
                && !writer.migrating(g)
                && !writer.has_spare()
                && writer.nearly_full(g, ahead)
        }) {
            assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
            keys += 1;
            assert!(keys < 1_000_000, "no growth came near");
        }
        let existing = keys / 2;
        let hash = store.hash(&existing);
        let mut wrote = false;
        let decision = with_guard(|g| store.insert(shard, g, hash, &existing, 0, unit, &mut wrote));
        // Admitted once at 0 with a burst of 1: denied, by its own state.
        assert!(!decision.unwrap().unwrap().is_allowed());
        // No writer's work, so its collect is a check's.
        assert!(!wrote, "a check of an existing key counted as a writer's");
        assert!(
            !shard.write().has_spare(),
            "a check wrote the next table ahead"
        );
        // An insert there writes it ahead.
        assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
        assert!(shard.write().has_spare());

        // While a migration is under way, enough such checks to move all its slots at an
        // insert's step each leave it under way.
        let (store, keys, capacity) = store_migrating_after_inserts();
        let shard = &store.shards[0];
        let existing = keys / 2;
        let hash = store.hash(&existing);
        for _ in 0..capacity / STEP_PER_INSERT as u64 + 1 {
            let mut wrote = false;
            let decision =
                with_guard(|g| store.insert(shard, g, hash, &existing, 0, unit, &mut wrote));
            assert!(!decision.unwrap().unwrap().is_allowed());
            assert!(!wrote);
        }
        assert!(
            migrating(&store),
            "checks on an existing key moved the migration's slots"
        );
        // A new key's insert does a writer's work (here a step of the migration).
        let mut wrote = false;
        let hash = store.hash(&keys);
        let decision = with_guard(|g| store.insert(shard, g, hash, &keys, 0, unit, &mut wrote));
        assert!(decision.unwrap().unwrap().is_allowed());
        assert!(wrote, "an insert did not count as a writer's");
    }

    /// A one-shard store (1 an hour, burst 1) given at least 20,000 keys, each admitted
    /// once, and then until a migration is under way; with its number of keys and its
    /// table's capacity.
    fn store_migrating_after_inserts() -> (WordStore<u64>, u64, u64) {
        let store = one_shard_hourly();
        let mut keys = 0u64;
        while keys < 20_000 || !migrating(&store) {
            assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
            keys += 1;
        }
        let capacity = with_guard(|g| store.shards[0].read(g).capacity()) as u64;
        (store, keys, capacity)
    }

    fn migrating(store: &WordStore<u64>) -> bool {
        with_guard(|g| store.shards[0].read(g).next().is_some())
    }

    /// The `i`-th check of a spread over the `keys` keys of
    /// [`store_migrating_after_inserts`]: each was admitted once, so each is denied.
    fn check_a_spent_key(store: &WordStore<u64>, keys: u64, i: u64) {
        let key = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % keys;
        assert!(!store.check(&key, || 1, 1, u64::MAX).unwrap().is_allowed());
    }

    /// A migration that inserts began and then stopped feeding ends through checks on
    /// existing keys alone, moved or not: one in `HELP_EVERY` helps with
    /// `STEP_PER_INSERT` slots, so about `HELP_EVERY / STEP_PER_INSERT` checks a slot.
    /// And the keys keep their state through it.
    #[test]
    fn checks_alone_finish_a_migration_that_inserts_began() {
        let (store, keys, capacity) = store_migrating_after_inserts();
        let per_slot = u64::from(HELP_EVERY) / STEP_PER_INSERT as u64;
        let mut checks = 0u64;
        while migrating(&store) {
            check_a_spent_key(&store, keys, checks);
            checks += 1;
            assert!(
                checks <= 2 * per_slot * capacity,
                "{checks} checks, and the migration of {capacity} slots runs on"
            );
        }
        assert!(
            checks >= capacity / STEP_PER_INSERT as u64,
            "{checks} checks"
        );
        assert_eq!(store.len(), keys as usize);
    }

    /// While an operator's path drives migrations (counted in `driving`, as a quota
    /// change is), checks leave a migration under way alone however many meet it; once
    /// the path ends, they help it to its end again.
    #[test]
    fn checks_do_not_help_while_an_operator_drives() {
        let (store, keys, capacity) = store_migrating_after_inserts();
        let per_slot = u64::from(HELP_EVERY) / STEP_PER_INSERT as u64;
        {
            let _driving = Driving::new(&store.driving);
            // Three times what finishes it when checks help.
            for i in 0..6 * per_slot * capacity {
                check_a_spent_key(&store, keys, i);
            }
            assert!(migrating(&store), "checks helped while an operator drove");
        }
        let mut checks = 0u64;
        while migrating(&store) {
            check_a_spent_key(&store, keys, checks);
            checks += 1;
            assert!(checks <= 2 * per_slot * capacity, "{checks} checks");
        }
        assert_eq!(store.len(), keys as usize);
    }

    #[test]
    fn a_table_emptied_after_a_flood_shrinks_and_keeps_the_rest() {
        let store = store(1, usize::MAX);
        for i in 0..10_000 {
            store
                .check(format!("k{i}").as_str(), || 0, 1, u64::MAX)
                .unwrap();
        }
        let grown = store.stats().resizes;
        for i in 10..10_000 {
            assert!(store.remove(format!("k{i}").as_str(), || 0));
        }
        assert!(store.stats().resizes > grown, "no shrink");
        let capacity = with_guard(|g| store.shards[0].read(g).capacity());
        assert!(capacity <= 64, "{capacity} slots for 10 keys");
        for i in 0..10 {
            assert!(
                !store
                    .check(format!("k{i}").as_str(), || 1, 1, u64::MAX)
                    .unwrap()
                    .is_allowed()
            );
        }
    }
}
