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
//!   check: the floor under every row.
//!
//! None has tollgate's API around it (eviction, overrides, growth, reclamation, the deny
//! cache, counters): they show what the hardware allows a check on 10k keys, measured
//! beside tollgate and governor in the same run.

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

/// Nanoseconds since the design was made, read as tollgate reads them.
struct Clock {
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

/// Open addressing, linear probing, at 79% full (the middle of tollgate's 72–86%).
pub struct OpenAddressing<H> {
    slots: Box<[Slot]>,
    hash: H,
    clock: Clock,
}

impl<H: Fn(u64) -> u64> OpenAddressing<H> {
    pub fn new(keys: u64, hash: H) -> Self {
        let capacity = (keys * 100 / 79) as usize;
        let design = Self {
            slots: (0..capacity)
                .map(|_| Slot {
                    word: AtomicU64::new(EMPTY),
                    key: AtomicU64::new(0),
                })
                .collect(),
            hash,
            clock: Clock::new(),
        };
        for key in 0..keys {
            let mut index = design.home(key);
            while design.slots[index].word.load(Ordering::Relaxed) != EMPTY {
                index = (index + 1) % capacity;
            }
            design.slots[index].key.store(key, Ordering::Relaxed);
            design.slots[index].word.store(0, Ordering::Release);
        }
        design
    }

    /// The home slot: the hash's high 32 bits scaled to the capacity.
    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        ((((self.hash)(key) >> 32) * self.slots.len() as u64) >> 32) as usize
    }

    #[inline]
    pub fn decide(&self, key: u64) -> Option<Decision> {
        let now = self.clock.now();
        let mut index = self.home(key);
        loop {
            let slot = &self.slots[index];
            if slot.word.load(Ordering::Acquire) == EMPTY {
                return None;
            }
            if slot.key.load(Ordering::Relaxed) == key {
                return Some(POLICY.check(&slot.word, now));
            }
            index += 1;
            if index == self.slots.len() {
                index = 0;
            }
        }
    }
}

impl<H: Fn(u64) -> u64 + Sync> Check for OpenAddressing<H> {
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

/// Open addressing hashed by a multiply by the golden ratio: no seed.
pub fn open_addressing_multiply(keys: u64) -> OpenAddressing<impl Fn(u64) -> u64 + Sync> {
    OpenAddressing::new(keys, |key| key.wrapping_mul(0x9e37_79b9_7f4a_7c15))
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
