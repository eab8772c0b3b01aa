//! The stores' key hash: two multiplies and two adds for a key that hashes as a single
//! integer (`u64`, `u32`, `usize`, newtypes of them), ahash for every other key.
//!
//! A check's steps form one dependent chain (key → hash → slot → CAS), and the CAS keeps
//! the next check's loads from starting early, so the hash's latency is paid on every
//! check. ahash's portable path (two folded multiplies and a rotate, one after the other)
//! is about three times the latency of two multiplies side by side.
//!
//! # Why two multiplies are enough for integer keys
//!
//! With the key's 32-bit halves `lo` and `hi`,
//! `h(x) = a₁·lo + a₂·hi + b mod 2⁶⁴`, for random 64-bit `a₁`, `a₂`, `b`, is the vector
//! multiply-shift family (Thorup, "High Speed Hashing for Integers and Strings"): its top
//! 32 bits are strongly universal. For any two distinct keys, chosen by anyone who does
//! not know the seeds, the top `l ≤ 32` bits of their hashes are equal with probability
//! `2⁻ˡ`. The store reads only top bits: the shard from the top `s` bits, the home slot
//! from the 32 below them (see [`for_table`]); the theorem covers the top 32 of those
//! `s + 32`, so below them the bound is only approximate. So a client who picks keys cannot pile them into
//! one probe run except by luck it cannot improve on.
//!
//! Multiplicative hashing also spreads dense keys (ids `k, k+1, k+2…`, or strided by a
//! power of two) more evenly than a random function would, when the multipliers are well
//! chosen (see [`well_spread`], which every multiplier passes): in the tests, their mean
//! probe run is 0.2–0.75× a random function's. Its weak spot is keys that pack two dense
//! ids into one integer (`tenant << 32 | user`): for any linear hash they form a lattice,
//! and with some seeds the mean run reaches 3.7× a random function's (never a cluster:
//! the longest run stays within a random function's). A tuple `(tenant, user)` is hashed
//! by ahash and has no such pattern.
//!
//! The low bits of `h` are weaker (bit `i` depends only on the halves' bits `0..=i`);
//! the consumers that read low bits — the per-thread deny cache's way, the key quota
//! map — read [`spread`] instead.
//!
//! # Other keys
//!
//! A key whose `Hash` writes more than one integer, or any bytes (`String`, `IpAddr`,
//! tuples), is hashed by a seeded ahash, whose every bit is strong.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::OnceLock;

/// Builds the hashers of one store.
#[derive(Clone)]
pub(crate) struct KeyHashing {
    seeds: Seeds,
    bytes: ahash::RandomState,
}

/// The seeds of the integer hash.
#[derive(Clone, Copy)]
struct Seeds {
    /// The low half's multiplier; [`well_spread`].
    low: u64,
    /// The high half's multiplier; [`well_spread`].
    high: u64,
    addend: u64,
}

impl Seeds {
    #[inline(always)]
    fn hash(self, value: u64) -> u64 {
        (value & 0xffff_ffff)
            .wrapping_mul(self.low)
            .wrapping_add((value >> 32).wrapping_mul(self.high))
            .wrapping_add(self.addend)
    }
}

impl KeyHashing {
    /// The process's multipliers (drawn once, see [`multiplier`]) with an addend and a
    /// byte hasher drawn for this store.
    pub(crate) fn new() -> Self {
        static MULTIPLIERS: OnceLock<(u64, u64)> = OnceLock::new();
        let random = ahash::RandomState::new();
        let (low, high) = *MULTIPLIERS.get_or_init(|| {
            let draws = ahash::RandomState::new();
            let mut n = 0u64;
            let mut draw = || {
                n += 1;
                draws.hash_one(n)
            };
            (multiplier(&mut draw), multiplier(&mut draw))
        });
        Self {
            seeds: Seeds {
                low,
                high,
                addend: random.hash_one(0u8),
            },
            bytes: random,
        }
    }
}

impl BuildHasher for KeyHashing {
    type Hasher = KeyHasher;

    #[inline(always)]
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            seeds: self.seeds,
            first: 0,
            written: Written::Nothing,
            bytes: self.bytes.build_hasher(),
        }
    }
}

/// What a [`KeyHasher`] has been given so far.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Written {
    Nothing,
    /// One integer, held in `first`.
    OneInteger,
    /// More: everything went to the byte hasher.
    More,
}

/// A hasher of the store's keys. For a key type whose `Hash` writes one integer, the
/// branches on `written` are decided at compile time once it is inlined, and `finish` is
/// two multiplies (side by side) and two adds.
pub(crate) struct KeyHasher {
    seeds: Seeds,
    first: u64,
    written: Written,
    bytes: ahash::AHasher,
}

impl KeyHasher {
    #[inline(always)]
    fn integer(&mut self, value: u64) {
        match self.written {
            Written::Nothing => {
                self.first = value;
                self.written = Written::OneInteger;
            }
            Written::OneInteger => {
                self.bytes.write_u64(self.first);
                self.bytes.write_u64(value);
                self.written = Written::More;
            }
            Written::More => self.bytes.write_u64(value),
        }
    }

    /// Moves a held integer to the byte hasher, before bytes follow it.
    #[inline(always)]
    fn spill(&mut self) {
        if self.written == Written::OneInteger {
            self.bytes.write_u64(self.first);
        }
        self.written = Written::More;
    }
}

impl Hasher for KeyHasher {
    #[inline(always)]
    fn finish(&self) -> u64 {
        match self.written {
            Written::Nothing => self.seeds.hash(0),
            Written::OneInteger => self.seeds.hash(self.first),
            // ahash's output is strong in every bit already.
            Written::More => self.bytes.finish(),
        }
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.spill();
        self.bytes.write(bytes);
    }

    #[inline(always)]
    fn write_u8(&mut self, i: u8) {
        self.integer(u64::from(i));
    }

    #[inline(always)]
    fn write_u16(&mut self, i: u16) {
        self.integer(u64::from(i));
    }

    #[inline(always)]
    fn write_u32(&mut self, i: u32) {
        self.integer(u64::from(i));
    }

    #[inline(always)]
    fn write_u64(&mut self, i: u64) {
        self.integer(i);
    }

    #[inline]
    fn write_u128(&mut self, i: u128) {
        self.integer(i as u64);
        self.integer((i >> 64) as u64);
    }

    #[inline(always)]
    fn write_usize(&mut self, i: usize) {
        self.integer(i as u64);
    }

    #[inline(always)]
    fn write_i8(&mut self, i: i8) {
        self.integer(i as u8 as u64);
    }

    #[inline(always)]
    fn write_i16(&mut self, i: i16) {
        self.integer(i as u16 as u64);
    }

    #[inline(always)]
    fn write_i32(&mut self, i: i32) {
        self.integer(i as u32 as u64);
    }

    #[inline(always)]
    fn write_i64(&mut self, i: i64) {
        self.integer(i as u64);
    }

    #[inline]
    fn write_i128(&mut self, i: i128) {
        self.write_u128(i as u128);
    }

    #[inline(always)]
    fn write_isize(&mut self, i: isize) {
        self.integer(i as u64);
    }
}

/// The largest partial quotient [`well_spread`] allows.
const MAX_QUOTIENT: u128 = 32;
/// The convergent denominators [`well_spread`] looks at: runs of up to 2²⁸ keys.
const DENOMINATOR_LIMIT: u128 = 1 << 28;
/// The shifts [`well_spread`] checks: up to 2¹⁶ shards, or keys strided by powers of two
/// up to that.
const SHIFTS: u32 = 16;

/// A random multiplier, from `draw`, that is [`well_spread`].
fn multiplier(mut draw: impl FnMut() -> u64) -> u64 {
    loop {
        let candidate = draw();
        if well_spread(candidate) {
            return candidate;
        }
    }
}

/// Whether dense keys (`k, k+1, k+2…`, or strided by a power of two) land evenly: for
/// every shift `s ≤ 16`, the fraction `(a·2ˢ mod 2⁶⁴) / 2⁶⁴` has no partial quotient above
/// 32 among its convergents with denominators up to 2²⁸.
///
/// The homes of dense keys are `frac(i·α)` scaled, with `α` that fraction (the shift
/// being the shard bits, or the stride's). A large partial quotient `qₖ` means
/// `α ≈ p/q`, and then runs of about `qₖ` keys land next to each other: one long probe run.
/// Random multipliers have such quotients often enough to matter (1 in 4 gave a mean
/// probe run of 3 or more on 10k dense keys, and 1 in 30 a run of over 500 slots at 86%
/// full); about 1 in 1,000 passes, which takes a few milliseconds, once per process.
fn well_spread(a: u64) -> bool {
    (0..=SHIFTS).all(|shift| {
        let (mut p, mut q) = (1u128 << 64, u128::from(a << shift));
        let (mut before, mut denominator) = (0u128, 1u128);
        while q != 0 && denominator <= DENOMINATOR_LIMIT {
            let quotient = p / q;
            let rest = p - quotient * q;
            // The last quotient ends the expansion at `a·2ˢ / 2⁶⁴` itself, whose
            // `2⁶⁴⁻ˢ` multiples are all distinct: it makes no cluster.
            if quotient > MAX_QUOTIENT && rest != 0 {
                return false;
            }
            (before, denominator) = (denominator, quotient * denominator + before);
            (p, q) = (q, rest);
        }
        true
    })
}

/// The hash a shard's table reads: `hash` rotated left past the `shard_bits` that picked
/// the shard, so the table's home slot (its top 32 bits) comes from the 32 bits just
/// below them, the strongest the shard leaves.
#[inline(always)]
pub(crate) fn for_table(hash: u64, shard_bits: u32) -> u64 {
    hash.rotate_left(shard_bits)
}

/// A sharded store's hashing, the same for both stores: a key's [`KeyHashing`] hash
/// rotated past the shard bits ([`for_table`]), whose low bits then pick the shard
/// ([`shard`](Self::shard)) and whose high 32 bits the home slot.
pub(crate) struct Sharding {
    hasher: KeyHashing,
    /// `log2` of the shard count.
    bits: u32,
}

impl Sharding {
    /// The hashing of a store of `shards` shards (a power of two).
    pub(crate) fn new(shards: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        Self {
            hasher: KeyHashing::new(),
            bits: shards.trailing_zeros(),
        }
    }

    /// The hash the store reads for `key`.
    #[inline(always)]
    pub(crate) fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        for_table(self.hasher.hash_one(key), self.bits)
    }

    /// The shard of a [`hash`](Self::hash) among `shards` (the store's count).
    #[inline(always)]
    pub(crate) fn shard(hash: u64, shards: usize) -> usize {
        hash as usize & (shards - 1)
    }

    /// A seed for shard `i`'s own random numbers, drawn from this store's hasher.
    pub(crate) fn seed(&self, i: usize) -> u64 {
        self.hasher.hash_one(i)
    }
}

/// `hash` with its high half folded into its low one, for consumers that read low bits
/// (the deny cache's way, the key quota map's buckets).
#[inline(always)]
pub(crate) fn spread(hash: u64) -> u64 {
    hash ^ (hash >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(seed: u64) -> KeyHashing {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        KeyHashing {
            seeds: Seeds {
                low: multiplier(&mut next),
                high: multiplier(&mut next),
                addend: next(),
            },
            bytes: ahash::RandomState::with_seeds(next(), next(), next(), next()),
        }
    }

    /// Places `keys` by linear probing from their home slots (the store's rule: shard
    /// from the top `shard_bits`, home from the next 32 bits scaled to the capacity) in
    /// tables at 86% full, the store's largest load; returns the mean and the longest
    /// probe run of a successful lookup, over all shards.
    fn probe_runs<K>(hash: impl Fn(&K) -> u64, keys: &[K], shard_bits: u32) -> (f64, usize) {
        let shards = 1usize << shard_bits;
        let mut hashes = vec![Vec::new(); shards];
        for key in keys {
            let hash = for_table(hash(key), shard_bits);
            hashes[hash as usize & (shards - 1)].push(hash);
        }
        let (mut total, mut longest) = (0usize, 0usize);
        for shard in hashes {
            let capacity = (shard.len() * 100 / 86).max(2);
            let mut used = vec![false; capacity];
            for hash in shard {
                let mut index = (((hash >> 32) * capacity as u64) >> 32) as usize;
                let mut run = 1;
                while used[index] {
                    index = (index + 1) % capacity;
                    run += 1;
                }
                used[index] = true;
                total += run;
                longest = longest.max(run);
            }
        }
        (total as f64 / keys.len() as f64, longest)
    }

    /// What a random function gives for `n` keys (ahash of distinct keys, the worst of
    /// four seeds): at 86% full, a mean run near `(1 + 1/(1 − 0.86)) / 2 ≈ 4.1`, and
    /// runs of a few hundred slots in one 60k-key table.
    fn random_runs(n: u64, shard_bits: u32) -> (f64, usize) {
        let keys: Vec<u64> = (0..n).collect();
        (0..4)
            .map(|seed| {
                let random = ahash::RandomState::with_seeds(seed, 1, 2, 3);
                probe_runs(|k| random.hash_one(k), &keys, shard_bits)
            })
            .fold((0.0, 0), |(m, l), (mean, longest)| {
                (m.max(mean), l.max(longest))
            })
    }

    /// Whether `runs` are no worse than a random function's, with slack for chance.
    fn like_random(
        (mean, longest): (f64, usize),
        (random_mean, random_longest): (f64, usize),
    ) -> bool {
        mean <= 1.2 * random_mean && longest <= 2 * random_longest
    }

    /// Key sets that simple hashes get wrong: dense ids, strides of powers of two (keys
    /// that differ only in high bits, or only in bits above 32), and random keys.
    fn patterns() -> Vec<(&'static str, Vec<u64>)> {
        let n = 60_000u64;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let random = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .collect();
        vec![
            ("sequential", (0..n).collect()),
            (
                "sequential from 2^40",
                (0..n).map(|i| (1 << 40) + i).collect(),
            ),
            ("stride 4096", (0..n).map(|i| i << 12).collect()),
            ("stride 2^32", (0..n).map(|i| i << 32).collect()),
            (
                "stride 2^48 (only the top 16 bits vary)",
                (0..n).map(|i| i << 48).collect(),
            ),
            ("random", random),
        ]
    }

    #[test]
    fn integer_keys_probe_like_a_random_hash_in_every_pattern_and_shard_count() {
        let random: Vec<_> = [0, 3, 6]
            .map(|bits| (bits, random_runs(60_000, bits)))
            .into();
        for seed in 0..20 {
            let hashing = seeded(seed);
            for (name, keys) in patterns() {
                for &(shard_bits, baseline) in &random {
                    let runs = probe_runs(|k| hashing.hash_one(k), &keys, shard_bits);
                    assert!(
                        like_random(runs, baseline),
                        "seed {seed}, {name}, {shard_bits} shard bits: {runs:?} against {baseline:?}"
                    );
                }
            }
        }
    }

    /// Keys that pack two dense ids (`tenant << 32 | user`) are a lattice for any linear
    /// hash: with some seeds, pairs `(user + du, tenant + dt)` land next to each other, and
    /// the mean run grows (measured: up to 3.7× a random function's over 20 seeds at 86%
    /// full) — a cost in probes, not a cluster: the longest run stays a random
    /// function's. Tuples `(tenant, user)` hash through ahash and have no lattice.
    #[test]
    fn packed_pairs_of_dense_ids_cost_probes_but_make_no_cluster() {
        let keys: Vec<u64> = (0..60_000u64).map(|i| (i % 60) << 32 | (i / 60)).collect();
        for shard_bits in [0, 3, 6] {
            let (random_mean, random_longest) = random_runs(60_000, shard_bits);
            for seed in 0..20 {
                let hashing = seeded(seed);
                let (mean, longest) = probe_runs(|k| hashing.hash_one(k), &keys, shard_bits);
                assert!(
                    mean <= 4.0 * random_mean && longest <= 2 * random_longest,
                    "seed {seed}, {shard_bits} shard bits: {mean:.2}, {longest} against \
                     {random_mean:.2}, {random_longest}"
                );
            }
        }
    }

    #[test]
    fn string_and_compound_keys_probe_like_a_random_hash() {
        let hashing = seeded(7);
        let strings: Vec<String> = (0..60_000).map(|i| format!("user-{i:019}")).collect();
        let pairs: Vec<(u32, u32)> = (0..60_000u32).map(|i| (i % 7, i / 7)).collect();
        for shard_bits in [0, 3] {
            let baseline = random_runs(60_000, shard_bits);
            let runs = probe_runs(|k| hashing.hash_one(k), &strings, shard_bits);
            assert!(
                like_random(runs, baseline),
                "strings: {runs:?} against {baseline:?}"
            );
            let runs = probe_runs(|k| hashing.hash_one(k), &pairs, shard_bits);
            assert!(
                like_random(runs, baseline),
                "pairs: {runs:?} against {baseline:?}"
            );
        }
    }

    #[test]
    fn a_single_integer_is_two_multiplies_and_its_width_does_not_matter() {
        let hashing = seeded(3);
        let Seeds { low, high, addend } = hashing.seeds;
        for x in [0u64, 1, 41, u64::MAX, 1 << 63, 7 << 32 | 9] {
            let expected = (x & 0xffff_ffff)
                .wrapping_mul(low)
                .wrapping_add((x >> 32).wrapping_mul(high))
                .wrapping_add(addend);
            assert_eq!(hashing.hash_one(x), expected);
        }
        assert_eq!(hashing.hash_one(41u32), hashing.hash_one(41u64));
        assert_eq!(hashing.hash_one(41usize), hashing.hash_one(41u64));
        assert_eq!(
            hashing.hash_one(-1i32),
            hashing.hash_one(u64::from(u32::MAX))
        );
    }

    #[test]
    fn keys_of_more_than_one_write_are_told_apart_by_order_and_content() {
        let hashing = seeded(5);
        let hash = |k: &dyn Fn(&mut KeyHasher)| {
            let mut h = hashing.build_hasher();
            k(&mut h);
            h.finish()
        };
        let ab = hash(&|h| {
            h.write_u64(1);
            h.write_u64(2);
        });
        let ba = hash(&|h| {
            h.write_u64(2);
            h.write_u64(1);
        });
        let one = hash(&|h| h.write_u64(1));
        let bytes = hash(&|h| h.write(&1u64.to_le_bytes()));
        let int_then_bytes = hash(&|h| {
            h.write_u64(1);
            h.write(b"x");
        });
        let other_int_then_bytes = hash(&|h| {
            h.write_u64(2);
            h.write(b"x");
        });
        let all = [ab, ba, one, bytes, int_then_bytes, other_int_then_bytes];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert_ne!(x, y);
            }
        }
        assert_eq!(
            hashing.hash_one("tenant-a"),
            hashing.hash_one(String::from("tenant-a"))
        );
        assert_ne!(hashing.hash_one("tenant-a"), hashing.hash_one("tenant-b"));
    }

    #[test]
    fn spread_folds_the_strong_high_half_into_the_low_bits() {
        let hashing = seeded(11);
        // Keys that differ only in the high half have hashes that share the low 32 bits
        // when the high half's multiplier is a multiple of 2³² — and in any case their
        // low bits depend on fewer key bits. Force the first case to test the fold:
        let hashing = KeyHashing {
            seeds: Seeds {
                high: hashing.seeds.high << 32,
                ..hashing.seeds
            },
            ..hashing
        };
        let hashes: Vec<u64> = (0..256u64).map(|i| hashing.hash_one(i << 32)).collect();
        assert!(hashes.iter().all(|h| *h as u32 == hashes[0] as u32));
        // ...and 256 distinct low bytes once spread.
        let mut bytes: Vec<u8> = hashes.iter().map(|h| spread(*h) as u8).collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert!(bytes.len() > 150, "{} distinct low bytes", bytes.len());
    }
}
