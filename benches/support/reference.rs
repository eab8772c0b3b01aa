//! The check path's reference designs, bare: a GCRA step on one word per key that returns
//! a full decision (limit, remaining, reset, retry), found by
//!
//! - the design the performance issue measured at about 2× governor: shards of a
//!   `parking_lot::RwLock` over a hashbrown table, hashed once by ahash;
//! - open addressing of `{word, key}` slots (tollgate's layout) with no lock, hashed by
//!   ahash;
//! - the same with an unseeded multiply for a hash: the floor of a table lookup, but not
//!   a design anyone should ship (anyone who can choose keys can collide them);
//! - no table at all, only the clock read every design (governor's included) makes per
//!   check; and that read followed by one CAS on a word of the design's own, which is what
//!   every limiter here pays for an admitted check: the floor under every row;
//! - the unseeded table on a frozen clock, to show what of its check is the clock;
//! - for `String` keys, open addressing of `{word, String}` slots hashed by ahash (the
//!   key's bytes a pointer away), and of slots holding up to 24 key bytes inline.
//!
//! None has tollgate's API around it (eviction, overrides, growth, reclamation, the deny
//! cache, counters): they show what the hardware allows a check on 10k keys, measured
//! beside tollgate and governor in the same run.
//!
//! [`Growing`] is the reference of a growing table instead: open addressing whose
//! migrations move a few slots per insert (incremental growth, as issue 30 asks) or the
//! whole table in one insert (as governor's grow), under governor's locking, for the
//! growth workload's new keys.

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::RwLock;

use super::Check;

/// What every design returns: tollgate's decision, in the fields a caller reads. The
/// bench reads `allowed`, as it reads tollgate's decision, so the compiler may skip the
/// others in both.
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub struct Decision {
    pub allowed: bool,
    pub limit: u64,
    pub remaining: u64,
    pub reset_ns: u64,
    pub retry_ns: u64,
}

/// A GCRA policy: one unit every `t` ns, bursts of `burst`.
#[derive(Clone, Copy)]
struct Gcra {
    t: u64,
    burst: u64,
}

impl Gcra {
    /// One unit for the key whose theoretical arrival time `word` holds, at `now`.
    #[inline(always)]
    fn check(self, word: &AtomicU64, now: u64) -> Decision {
        let window = self.t * self.burst;
        let mut tat = word.load(Ordering::Relaxed);
        loop {
            let start = tat.max(now);
            let next = start + self.t;
            if next > now + window {
                return Decision {
                    allowed: false,
                    limit: self.burst,
                    remaining: 0,
                    reset_ns: start - now,
                    retry_ns: next - now - window,
                };
            }
            match word.compare_exchange_weak(tat, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    return Decision {
                        allowed: true,
                        limit: self.burst,
                        remaining: (now + window - next) / self.t,
                        reset_ns: next - now,
                        retry_ns: 0,
                    };
                }
                Err(actual) => tat = actual,
            }
        }
    }
}

/// A design's time source: the TSC as tollgate reads it, or a frozen one.
pub trait Now: Sync {
    fn now(&self) -> u64;
}

/// Nanoseconds since the design was made, read as tollgate reads them.
pub struct Clock {
    clock: quanta::Clock,
    origin: u64,
}

impl Clock {
    fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }

    #[inline(always)]
    fn now(&self) -> u64 {
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

impl Now for Clock {
    #[inline(always)]
    fn now(&self) -> u64 {
        Clock::now(self)
    }
}

/// A clock that never moves, as tollgate's `ManualClock` and governor's
/// `FakeRelativeClock` in the frozen-clock rows.
pub struct Frozen;

impl Now for Frozen {
    #[inline(always)]
    fn now(&self) -> u64 {
        0
    }
}

/// The quota of the keyed benches: T = 1 ns, a burst of 10^9.
const POLICY: Gcra = Gcra {
    t: 1,
    burst: 1_000_000_000,
};

/// One shard: keys with their state words.
type Shard = CachePadded<RwLock<hashbrown::HashTable<(u64, AtomicU64)>>>;

/// Shards of a reader-writer lock over a hashbrown table, the key hashed once (ahash)
/// for both the shard and the table.
pub struct ShardedRwLock {
    shards: Box<[Shard]>,
    hasher: ahash::RandomState,
    clock: Clock,
}

impl ShardedRwLock {
    /// `keys` keys in 8 shards (tollgate's default on 2 CPUs).
    pub fn new(keys: u64) -> Self {
        let design = Self {
            shards: (0..8)
                .map(|_| CachePadded::new(RwLock::new(hashbrown::HashTable::new())))
                .collect(),
            hasher: ahash::RandomState::new(),
            clock: Clock::new(),
        };
        for key in 0..keys {
            let hash = design.hasher.hash_one(key);
            design.shards[(hash >> 61) as usize].write().insert_unique(
                hash,
                (key, AtomicU64::new(0)),
                |(k, _)| design.hasher.hash_one(*k),
            );
        }
        design
    }

    #[inline]
    pub fn decide(&self, key: u64) -> Option<Decision> {
        let now = self.clock.now();
        let hash = self.hasher.hash_one(key);
        let shard = self.shards[(hash >> 61) as usize].read();
        let (_, word) = shard.find(hash, |(k, _)| *k == key)?;
        Some(POLICY.check(word, now))
    }
}

impl Check for ShardedRwLock {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.decide(key).is_some_and(|d| d.allowed)
    }
}

/// A slot: the key's state word and the key.
struct Slot {
    word: AtomicU64,
    key: AtomicU64,
}

/// No key yet.
const EMPTY: u64 = u64::MAX;

/// `capacity` empty slots.
fn empty_slots(capacity: usize) -> Box<[Slot]> {
    (0..capacity)
        .map(|_| Slot {
            word: AtomicU64::new(EMPTY),
            key: AtomicU64::new(0),
        })
        .collect()
}

/// Linear probing from the home of `hash` (its high 32 bits scaled to the capacity): the
/// slot holding `key`, or `Err` with the first empty slot of its probe.
#[inline(always)]
fn find(slots: &[Slot], key: u64, hash: u64) -> Result<&Slot, usize> {
    let capacity = slots.len();
    let mut index = (((hash >> 32) * capacity as u64) >> 32) as usize;
    loop {
        let slot = &slots[index];
        if slot.word.load(Ordering::Acquire) == EMPTY {
            return Err(index);
        }
        if slot.key.load(Ordering::Relaxed) == key {
            return Ok(slot);
        }
        index += 1;
        if index == capacity {
            index = 0;
        }
    }
}

/// Open addressing, linear probing, at 79% full (the middle of tollgate's 72–86%).
pub struct OpenAddressing<H, N = Clock> {
    slots: Box<[Slot]>,
    hash: H,
    clock: N,
}

impl<H: Fn(u64) -> u64> OpenAddressing<H> {
    pub fn new(keys: u64, hash: H) -> Self {
        Self::with_clock(keys, hash, Clock::new())
    }
}

impl<H: Fn(u64) -> u64, N: Now> OpenAddressing<H, N> {
    pub fn with_clock(keys: u64, hash: H, clock: N) -> Self {
        let capacity = (keys * 100 / 79) as usize;
        let design = Self {
            slots: empty_slots(capacity),
            hash,
            clock,
        };
        for key in 0..keys {
            if let Err(index) = find(&design.slots, key, (design.hash)(key)) {
                design.slots[index].key.store(key, Ordering::Relaxed);
                design.slots[index].word.store(0, Ordering::Release);
            }
        }
        design
    }

    #[inline]
    pub fn decide(&self, key: u64) -> Option<Decision> {
        let now = self.clock.now();
        let slot = find(&self.slots, key, (self.hash)(key)).ok()?;
        Some(POLICY.check(&slot.word, now))
    }
}

impl<H: Fn(u64) -> u64 + Sync, N: Now> Check for OpenAddressing<H, N> {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.decide(key).is_some_and(|d| d.allowed)
    }
}

/// Open addressing hashed by ahash, seeded per table.
pub fn open_addressing_ahash(keys: u64) -> OpenAddressing<impl Fn(u64) -> u64 + Sync> {
    let hasher = ahash::RandomState::new();
    OpenAddressing::new(keys, move |key| hasher.hash_one(key))
}

/// The golden ratio's multiply: no seed.
fn golden(key: u64) -> u64 {
    key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Open addressing hashed by a multiply by the golden ratio: no seed.
pub fn open_addressing_multiply(keys: u64) -> OpenAddressing<impl Fn(u64) -> u64 + Sync> {
    OpenAddressing::new(keys, golden)
}

/// The same on a frozen clock.
pub fn open_addressing_multiply_frozen(
    keys: u64,
) -> OpenAddressing<impl Fn(u64) -> u64 + Sync, Frozen> {
    OpenAddressing::with_clock(keys, golden, Frozen)
}

/// Only the clock read of a check, as tollgate and the designs above make it: what no
/// design on this machine can go below (governor reads the same TSC through quanta).
pub struct ClockOnly {
    clock: Clock,
}

impl ClockOnly {
    pub fn new() -> Self {
        Self {
            clock: Clock::new(),
        }
    }
}

impl Check for ClockOnly {
    #[inline]
    fn check(&self, key: u64) -> bool {
        // Depends on the key and the time, so neither read is optimised away (`!key` is
        // above 2^64 − 10^4, which no clock reading reaches).
        self.clock.now() ^ key != u64::MAX
    }
}

/// The clock read and then one CAS on a word of the calling thread's own, always in its
/// cache: on the Intel VM of 2026-12-01 the two do not overlap (a TSC read waits for the
/// locked instruction before it, or the reverse), so this is what any limiter that reads
/// the TSC and changes a key's state with a locked instruction pays per admitted check.
pub struct ClockAndCas {
    clock: Clock,
}

thread_local! {
    /// The word each thread's CAS changes, so that threads share no cache line.
    static WORD: CachePadded<AtomicU64> = const { CachePadded::new(AtomicU64::new(0)) };
}

impl ClockAndCas {
    pub fn new() -> Self {
        Self {
            clock: Clock::new(),
        }
    }
}

impl Check for ClockAndCas {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let now = self.clock.now();
        WORD.with(|word| {
            // The word only records the latest time; what matters is the locked
            // instruction.
            let seen = word.load(Ordering::Relaxed);
            let _ = word.compare_exchange_weak(seen, now, Ordering::AcqRel, Ordering::Relaxed);
        });
        now ^ key != u64::MAX
    }
}

/// A slot of a `String`-keyed table: the state word and the key, whose bytes are on the
/// heap.
pub struct StringSlot {
    word: AtomicU64,
    key: String,
}

/// The most key bytes an inline slot holds.
pub const INLINE_KEY: usize = 24;

/// A slot holding its key's bytes: the state word, the length and up to [`INLINE_KEY`]
/// bytes (40 bytes in all).
pub struct InlineSlot {
    word: AtomicU64,
    len: u64,
    bytes: [u8; INLINE_KEY],
}

/// Where a `String`-keyed design keeps its keys.
pub trait KeySlot: Send + Sync {
    fn vacant() -> Self;
    fn word(&self) -> &AtomicU64;
    fn fill(&mut self, key: &str);
    fn holds(&self, key: &str) -> bool;
}

impl KeySlot for StringSlot {
    fn vacant() -> Self {
        Self {
            word: AtomicU64::new(EMPTY),
            key: String::new(),
        }
    }

    fn word(&self) -> &AtomicU64 {
        &self.word
    }

    fn fill(&mut self, key: &str) {
        self.key = key.to_owned();
    }

    #[inline(always)]
    fn holds(&self, key: &str) -> bool {
        self.key == key
    }
}

impl KeySlot for InlineSlot {
    fn vacant() -> Self {
        Self {
            word: AtomicU64::new(EMPTY),
            len: 0,
            bytes: [0; INLINE_KEY],
        }
    }

    fn word(&self) -> &AtomicU64 {
        &self.word
    }

    fn fill(&mut self, key: &str) {
        assert!(
            key.len() <= INLINE_KEY,
            "inline slots hold keys of up to 24 bytes"
        );
        self.len = key.len() as u64;
        self.bytes[..key.len()].copy_from_slice(key.as_bytes());
    }

    #[inline(always)]
    fn holds(&self, key: &str) -> bool {
        self.len == key.len() as u64 && self.bytes[..key.len()] == *key.as_bytes()
    }
}

/// Open addressing of `String` keys hashed by ahash, at 79% full, checked by `&str`.
pub struct StringKeys<S> {
    slots: Box<[S]>,
    hasher: ahash::RandomState,
    clock: Clock,
}

/// Slots holding a `String` (the key's bytes on the heap).
pub fn string_slots(keys: &[String]) -> StringKeys<StringSlot> {
    StringKeys::<StringSlot>::new(keys)
}

/// Slots holding the key's bytes inline (keys of up to [`INLINE_KEY`] bytes).
pub fn inline_slots(keys: &[String]) -> StringKeys<InlineSlot> {
    StringKeys::<InlineSlot>::new(keys)
}

impl<S: KeySlot> StringKeys<S> {
    fn new(keys: &[String]) -> Self {
        let capacity = keys.len() * 100 / 79;
        let mut design = Self {
            slots: (0..capacity).map(|_| S::vacant()).collect(),
            hasher: ahash::RandomState::new(),
            clock: Clock::new(),
        };
        for key in keys {
            let mut index = design.home(key);
            while design.slots[index].word().load(Ordering::Relaxed) != EMPTY {
                index = (index + 1) % capacity;
            }
            let slot = &mut design.slots[index];
            slot.fill(key);
            slot.word().store(0, Ordering::Release);
        }
        design
    }

    #[inline(always)]
    fn home(&self, key: &str) -> usize {
        (((self.hasher.hash_one(key) >> 32) * self.slots.len() as u64) >> 32) as usize
    }

    #[inline]
    pub fn decide(&self, key: &str) -> Option<Decision> {
        let now = self.clock.now();
        let mut index = self.home(key);
        loop {
            let slot = &self.slots[index];
            if slot.word().load(Ordering::Acquire) == EMPTY {
                return None;
            }
            if slot.holds(key) {
                return Some(POLICY.check(slot.word(), now));
            }
            index += 1;
            if index == self.slots.len() {
                index = 0;
            }
        }
    }
}

/// A slot's word once its key has moved to the next table.
const MOVED: u64 = u64::MAX - 1;

/// One table of [`Growing`]: `{word, key}` slots, and how many hold a key.
struct GrowingTable {
    slots: Box<[Slot]>,
    used: usize,
}

impl GrowingTable {
    fn new(capacity: usize) -> Self {
        Self {
            slots: empty_slots(capacity),
            used: 0,
        }
    }

    #[inline]
    fn find(&self, key: u64, hash: u64) -> Result<&Slot, usize> {
        find(&self.slots, key, hash)
    }

    fn place(&mut self, key: u64, hash: u64, word: u64) {
        if let Err(index) = self.find(key, hash) {
            self.slots[index].key.store(key, Ordering::Relaxed);
            self.slots[index].word.store(word, Ordering::Release);
            self.used += 1;
        }
    }
}

/// One shard of [`Growing`]: its table, the table a migration moves to, the migration's
/// cursor, and the tables still to come, built before the run.
struct GrowingShard {
    table: GrowingTable,
    next: Option<GrowingTable>,
    cursor: usize,
    ladder: Vec<GrowingTable>,
}

/// The growth's reference design, bare: open addressing of `{word, key}` slots, a table
/// per shard that grows when 86% full, as tollgate's do (4× below 16,384 slots, then
/// 1.25×; or 2× from the start, for the moves a doubling takes). Its migration moves
/// `step` slots on each insert (16, as tollgate's; fewer; or the whole table in one
/// insert, as governor's tables grow), each frozen by a compare-and-swap, as a design
/// whose checks take no lock must. The tables a run will grow to are built and written
/// before it starts, so no page fault falls in the run: this is the migration's moves
/// alone, without the new tables' page faults (which tollgate writes ahead, a few pages
/// an insert). Each shard is behind a reader-writer lock, as governor's are: checks take
/// it to read, inserts and their steps to write. So it is incremental growth under
/// governor's locking. It counts its rebuilds.
pub struct Growing {
    shards: Vec<CachePadded<RwLock<GrowingShard>>>,
    hasher: ahash::RandomState,
    clock: Clock,
    rebuilds: AtomicU64,
    doubling: bool,
    step: usize,
}

/// Slots a migration moves per insert, as tollgate's `STEP_PER_INSERT`.
pub const GROWING_STEP: usize = 16;

impl Growing {
    /// `shards` shards (a power of two), with the tables built for `keys` keys, growing
    /// by 2× if `doubling`, moving `step` slots an insert: at least 5 for a growth by
    /// 1.25×, whose next table has room for `0.215·capacity` inserts while its migration
    /// takes `capacity / step` (a smaller step would fill it, and an insert would probe
    /// it forever).
    pub fn new(shards: usize, keys: u64, doubling: bool, step: usize) -> Self {
        let per_shard = keys as usize / shards;
        let ladder = || {
            let (mut capacity, mut tables) = (8usize, Vec::new());
            // Up to a table that holds the shard's share with room for its imbalance.
            while capacity * 43 / 50 < per_shard + per_shard / 8 + 64 {
                capacity = Self::grown(capacity, doubling);
                tables.push(GrowingTable::new(capacity));
            }
            tables.reverse();
            tables
        };
        Self {
            shards: (0..shards)
                .map(|_| {
                    CachePadded::new(RwLock::new(GrowingShard {
                        table: GrowingTable::new(8),
                        next: None,
                        cursor: 0,
                        ladder: ladder(),
                    }))
                })
                .collect(),
            hasher: ahash::RandomState::new(),
            clock: Clock::new(),
            rebuilds: AtomicU64::new(0),
            doubling,
            step,
        }
    }

    /// The capacity a full table of `capacity` slots grows to.
    fn grown(capacity: usize, doubling: bool) -> usize {
        if doubling {
            capacity * 2
        } else if capacity < 1 << 14 {
            capacity * 4
        } else {
            capacity + capacity / 4
        }
    }

    /// Moves up to `budget` slots of the shard's migration; ends it at the last.
    fn step(&self, shard: &mut GrowingShard, budget: usize) {
        let Some(next) = shard.next.as_mut() else {
            return;
        };
        let old = &shard.table;
        let stop = shard.cursor.saturating_add(budget).min(old.slots.len());
        for slot in &old.slots[shard.cursor..stop] {
            let mut word = slot.word.load(Ordering::Acquire);
            while word != EMPTY && word != MOVED {
                match slot.word.compare_exchange_weak(
                    word,
                    MOVED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        let key = slot.key.load(Ordering::Relaxed);
                        next.place(key, self.hasher.hash_one(key), word);
                        break;
                    }
                    Err(actual) => word = actual,
                }
            }
        }
        shard.cursor = stop;
        if stop == old.slots.len() {
            shard.table = shard.next.take().expect("a migration under way");
            shard.cursor = 0;
        }
    }
}

impl GrowingShard {
    /// The decision on `key` if the shard holds it.
    #[inline]
    fn decide(&self, key: u64, hash: u64, now: u64) -> Option<bool> {
        if self.next.is_some() {
            if let Ok(slot) = self.table.find(key, hash) {
                if slot.word.load(Ordering::Acquire) != MOVED {
                    return Some(POLICY.check(&slot.word, now).allowed);
                }
            }
        }
        let table = self.next.as_ref().unwrap_or(&self.table);
        let slot = table.find(key, hash).ok()?;
        Some(POLICY.check(&slot.word, now).allowed)
    }
}

impl Check for Growing {
    fn check(&self, key: u64) -> bool {
        let now = self.clock.now();
        let hash = self.hasher.hash_one(key);
        let lock = &self.shards[(hash >> 16) as usize & (self.shards.len() - 1)];
        // A key the shard holds: under the read lock, as governor's store checks.
        if let Some(allowed) = lock.read().decide(key, hash, now) {
            return allowed;
        }
        let shard = &mut *lock.write();
        // Another thread may have inserted it meanwhile.
        if let Some(allowed) = shard.decide(key, hash, now) {
            return allowed;
        }
        // A new key: a step of the migration under way, then the insert, then a growth if
        // the table is full.
        self.step(shard, self.step);
        let table = match shard.next.as_mut() {
            Some(next) => next,
            None => &mut shard.table,
        };
        table.place(key, hash, 0);
        let allowed = table
            .find(key, hash)
            .is_ok_and(|slot| POLICY.check(&slot.word, now).allowed);
        if shard.next.is_none() && shard.table.used * 50 > shard.table.slots.len() * 43 {
            let grown = Self::grown(shard.table.slots.len(), self.doubling);
            let next = match shard.ladder.pop() {
                Some(table) if table.slots.len() == grown => table,
                // Beyond what was built ahead (a shard above its share): built here.
                _ => GrowingTable::new(grown),
            };
            shard.next = Some(next);
            shard.cursor = 0;
            self.rebuilds.fetch_add(1, Ordering::Relaxed);
        }
        allowed
    }

    fn rebuilds(&self) -> Option<u64> {
        Some(self.rebuilds.load(Ordering::Relaxed))
    }
}
