//! Eviction without losing decisions: dropping untouched keys changes nothing, and a full
//! limiter evicts its least active key. (A flood of new keys against the cap, with the
//! memory it may take, is in `tests/isolated/alloc.rs`, whose allocator counts the bytes.)

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, RateLimiter, WhenFull};

fn build(
    algorithm: Algorithm,
    quota: &str,
    sweep: bool,
    clock: &ManualClock,
) -> RateLimiter<u64, ManualClock> {
    RateLimiter::builder(quota.parse().unwrap())
        .algorithm(algorithm)
        .clock(clock.clone())
        .shards(4)
        .sweep_untouched(sweep)
        .build()
        .unwrap()
}

/// A limiter that drops untouched keys and one that keeps every key decide identically
/// over a long random timeline in which keys come and go.
#[test]
fn dropping_untouched_keys_changes_no_decision() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new();
        let sweeping = build(algorithm, "5/s burst 3", true, &clock);
        let keeping = build(algorithm, "5/s burst 3", false, &clock);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next_new = 0u64;
        for step in 0..200_000u64 {
            crate::common::xorshift(&mut x);
            // Mostly recent keys, sometimes a brand new one, sometimes an old one back.
            let key = match x % 10 {
                0..=5 => next_new.saturating_sub(x % 50),
                6 | 7 => {
                    next_new += 1;
                    next_new
                }
                _ => x % (next_new + 1),
            };
            let cost = 1 + (x >> 32) % 3;
            clock.advance(Duration::from_micros((x >> 40) % 20_000));
            let a = sweeping.check_n(&key, cost).unwrap();
            let b = keeping.check_n(&key, cost).unwrap();
            assert_eq!(a, b, "{algorithm:?}: step {step}, key {key}");
        }
        let (swept, kept) = (sweeping.stats(), keeping.stats());
        assert!(
            swept.evicted_untouched > 10_000,
            "{algorithm:?}: the sweep hardly ran: {swept:?}"
        );
        assert_eq!(kept.evicted_untouched, 0);
        // A fifth of the requests go to a key drawn from all the keys ever seen, so keys
        // dropped come back, and a table holds what a span of it brings back (the
        // sweep's hysteresis): a third of the keys, not all.
        assert!(
            swept.keys * 3 < kept.keys,
            "{algorithm:?}: {} vs {} keys",
            swept.keys,
            kept.keys
        );
    }
}

/// A full limiter whose keys are all active evicts the one whose eviction loses the
/// least (the fewest units consumed), in both stores, with every key a candidate (fewer
/// keys than samples): the busier keys keep their state.
#[test]
fn a_full_limiter_evicts_the_least_active_key() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::SlidingLog] {
        let clock = ManualClock::new();
        let limiter: RateLimiter<u64, ManualClock> =
            RateLimiter::builder("10/min".parse().unwrap())
                .algorithm(algorithm)
                .clock(clock.clone())
                .shards(1)
                .max_keys(4)
                .when_full(WhenFull::EvictLeastActive)
                .build()
                .unwrap();
        // Key k uses k + 2 units: key 0 is the least active.
        for key in [3u64, 0, 2, 1] {
            for _ in 0..key + 2 {
                assert!(limiter.check(&key).is_allowed());
            }
        }
        assert_eq!(limiter.len(), 4);
        assert!(limiter.check(&99).is_allowed());
        assert_eq!(limiter.len(), 4, "{algorithm:?}");
        assert_eq!(limiter.stats().evicted_active, 1, "{algorithm:?}");
        // Key 0 starts afresh; the others kept what they used.
        assert_eq!(limiter.peek(&0).remaining(), 10, "{algorithm:?}");
        for key in 1..4u64 {
            assert_eq!(
                limiter.peek(&key).remaining(),
                10 - (key + 2),
                "{algorithm:?} key {key}"
            );
        }
    }
}

/// A set of keys in steady use is never swept away, however its requests are paced: a
/// client pacing itself at its limit (requests about one period apart), the same with
/// the smallest period (1 ns, every key back to untouched between any two checks), and
/// scheduling pauses that leave every key untouched at once. One new key per round (a
/// passer-by, the realistic seed of a sweep) must not start a chain of drops and
/// re-inserts: only passers-by may be dropped, and the tables stop being rebuilt once
/// the set fits.
#[test]
fn a_key_set_in_use_is_never_swept() {
    const KEYS: u64 = 1_000;
    const ROUNDS: u64 = 200;
    // Rounds before the tables fit the set: they grow as the keys dropped come back.
    const WARM: u64 = 50;
    for (period, algorithm) in [
        (Duration::from_micros(100), Algorithm::TokenBucket),
        (Duration::from_micros(100), Algorithm::LeakyBucket),
        (Duration::from_micros(100), Algorithm::FixedWindow),
        (Duration::from_micros(100), Algorithm::SlidingWindow),
        (Duration::from_micros(100), Algorithm::SlidingLog),
        (Duration::from_nanos(1), Algorithm::TokenBucket),
    ] {
        let clock = ManualClock::new();
        let limiter: RateLimiter<u64, ManualClock> =
            RateLimiter::builder(tollgate::Quota::new(1, period).unwrap())
                .algorithm(algorithm)
                .clock(clock.clone())
                .shards(8)
                .build()
                .unwrap();
        let step = (period / KEYS as u32).max(Duration::from_nanos(1));
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut order: Vec<u64> = (0..KEYS).collect();
        let mut warm = None;
        for round in 0..ROUNDS {
            // A fresh random order each round: a key's gaps range over 0‥2 periods.
            for i in (1..order.len()).rev() {
                crate::common::xorshift(&mut x);
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            for &key in &order {
                limiter.check(&key);
                clock.advance(step);
            }
            if round % 10 == 9 {
                clock.advance(Duration::from_millis(1));
            }
            limiter.check(&(KEYS + round));
            if round == WARM - 1 {
                warm = Some(limiter.stats());
            }
        }
        let (warm, stats) = (warm.unwrap(), limiter.stats());
        // Every key inserted is either held or was dropped, so the keys of the set that
        // came back after a drop are what the inserts add beyond one passer-by per round.
        let inserted = |s: &tollgate::StoreStats| s.keys as u64 + s.evicted_untouched;
        let returned = inserted(&stats) - inserted(&warm) - (ROUNDS - WARM);
        assert_eq!(
            returned, 0,
            "{algorithm:?} at {period:?}: keys in use were swept: {warm:?} then {stats:?}"
        );
        assert!(
            stats.resizes - warm.resizes <= 16,
            "{algorithm:?} at {period:?}: tables rebuilt over and over: {warm:?} then {stats:?}"
        );
    }
}
