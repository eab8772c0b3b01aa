//! Bounded memory without losing decisions: dropping untouched keys changes nothing, and
//! a flood of new keys neither grows the limiter past its cap nor frees a limited client.

mod common;

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
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
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
        assert!(
            swept.keys * 4 < kept.keys,
            "{algorithm:?}: {} vs {} keys",
            swept.keys,
            kept.keys
        );
    }
}

/// Resident set size of this process (Linux `VmRSS`), in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The documented bound on what a flood of new keys can add to resident memory with
/// `max_keys = 100_000`: the keys' entries and index (~2.2 MB) with ample room for the
/// allocator.
const FLOOD_MEMORY_BOUND: u64 = 32 << 20;

/// 10 million distinct keys against `max_keys = 100_000` while one client is being
/// limited: the cap holds, memory stays bounded, and the limited client's decisions are
/// exactly those of a limiter that never saw the flood.
#[test]
fn a_flood_of_new_keys_is_contained() {
    for when_full in [WhenFull::EvictLeastActive, WhenFull::DenyNewKeys] {
        let clock = ManualClock::new();
        let flooded: RateLimiter<u64, ManualClock> =
            RateLimiter::builder("10/s burst 20".parse().unwrap())
                .clock(clock.clone())
                .max_keys(100_000)
                .when_full(when_full)
                .build()
                .unwrap();
        let reference = build(Algorithm::TokenBucket, "10/s burst 20", true, &clock);
        const HOT: u64 = u64::MAX;
        let before = resident_bytes();
        let mut hot_admitted = 0;
        for key in 0..10_000_000u64 {
            clock.advance(Duration::from_micros(1));
            flooded.check(&key);
            if key % 100 == 0 {
                let (a, b) = (flooded.check(&HOT), reference.check(&HOT));
                assert_eq!(
                    a, b,
                    "{when_full:?}: the hot key diverged after {key} flood keys"
                );
                hot_admitted += u64::from(a.is_allowed());
            }
            if key % 10_000 == 0 {
                assert!(
                    flooded.len() <= 100_000,
                    "{when_full:?}: {} keys",
                    flooded.len()
                );
            }
        }
        let grown = resident_bytes().saturating_sub(before);
        assert!(
            grown < FLOOD_MEMORY_BOUND,
            "{when_full:?}: resident memory grew {grown} bytes"
        );
        // Checked every 100µs from 1µs to 9.9999s: the burst of 20, then one every
        // 100ms: 99 more.
        assert_eq!(hot_admitted, 20 + 99, "{when_full:?}");
        let stats = flooded.stats();
        assert!(stats.keys <= 100_000);
        match when_full {
            WhenFull::EvictLeastActive => assert_eq!(stats.refused_new_keys, 0, "{stats:?}"),
            WhenFull::DenyNewKeys => assert!(stats.refused_new_keys > 0, "{stats:?}"),
        }
        // Every key is accounted for: held now, evicted since, or refused.
        let accounted = stats.keys as u64
            + stats.evicted_untouched
            + stats.evicted_active
            + stats.refused_new_keys;
        assert_eq!(accounted, 10_000_001, "{when_full:?}: {stats:?}");
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
