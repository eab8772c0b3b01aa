//! `Builder::expected_keys`: tables sized up front, so that the keys expected grow no
//! table, and no shrink goes below them; the same decisions as a limiter that grows; a
//! typed error for what cannot be sized.

use std::time::Duration;

use crate::common::xorshift;
use tollgate::clock::ManualClock;
use tollgate::{Algorithm, ConfigError, Quota, RateLimiter};

const GENEROUS: &str = "1000000/s";

fn quota(text: &str) -> Quota {
    text.parse().expect("valid quota")
}

/// A limiter of `algorithm` under a generous quota (every check admitted), with `also`
/// quotas, sized for `expected` keys (0: none).
fn limiter(algorithm: Algorithm, also: &[&str], expected: usize) -> RateLimiter<u64> {
    let mut builder = RateLimiter::builder(quota(GENEROUS)).algorithm(algorithm);
    for &q in also {
        builder = builder.also(quota(q));
    }
    builder
        .expected_keys(expected)
        .build()
        .expect("valid limiter")
}

/// Checks keys `from..to` once each, all admitted.
fn insert(limiter: &RateLimiter<u64>, keys: std::ops::Range<u64>) {
    for key in keys {
        assert!(limiter.check(&key).is_allowed(), "key {key}");
    }
}

/// Up to the keys expected, no table of the word algorithms is rebuilt, with one, two
/// (one slot of two states) or three quotas (a store each); past them the tables grow
/// as usual. The same keys without `expected_keys` rebuild tables, so the count can
/// fail.
#[test]
fn the_keys_expected_grow_no_table() {
    const KEYS: u64 = 50_000;
    let cases: [(Algorithm, &[&str]); 6] = [
        (Algorithm::TokenBucket, &[]),
        (Algorithm::LeakyBucket, &[]),
        (Algorithm::FixedWindow, &[]),
        (Algorithm::SlidingWindow, &[]),
        (Algorithm::TokenBucket, &["100000000/day"]),
        (Algorithm::SlidingWindow, &["10000000/day", "1000000/h"]),
    ];
    for (algorithm, also) in cases {
        let growing = limiter(algorithm, also, 0);
        insert(&growing, 0..KEYS);
        assert!(
            growing.stats().resizes > 0,
            "{algorithm:?} {also:?}: a limiter without expected keys grows"
        );

        let sized = limiter(algorithm, also, KEYS as usize);
        insert(&sized, 0..KEYS);
        let stats = sized.stats();
        assert_eq!(stats.keys, KEYS as usize, "{algorithm:?} {also:?}");
        assert_eq!(stats.resizes, 0, "{algorithm:?} {also:?}: {stats:?}");
        insert(&sized, KEYS..3 * KEYS);
        assert!(
            sized.stats().resizes > 0,
            "{algorithm:?} {also:?}: past the keys expected, tables grow"
        );
        assert_eq!(sized.len(), 3 * KEYS as usize);
    }
}

/// The same with `String` keys (whose tables keep a tag per slot), looked up by `&str`,
/// on one shard and on many.
#[test]
fn string_keys_expected_grow_no_table_on_one_shard_or_many() {
    for shards in [1, 64] {
        let sized: RateLimiter<String> = RateLimiter::builder(quota(GENEROUS))
            .shards(shards)
            .expected_keys(20_000)
            .build()
            .expect("valid limiter");
        for i in 0..20_000 {
            assert!(sized.check(format!("user-{i}").as_str()).is_allowed());
        }
        assert_eq!(sized.stats().resizes, 0, "{shards} shards");
        assert_eq!(sized.len(), 20_000);
    }
}

/// Keys that go (reset one by one, or dropped by the idle sweep) never shrink a table
/// below the keys expected: filling it again rebuilds nothing. Without `expected_keys`
/// the resets shrink the tables.
#[test]
fn keys_that_go_shrink_no_table_below_the_keys_expected() {
    const KEYS: u64 = 20_000;
    let refill = |expected: usize| {
        let limiter: RateLimiter<u64> = RateLimiter::builder(quota(GENEROUS))
            .shards(8)
            .expected_keys(expected)
            .build()
            .expect("valid limiter");
        insert(&limiter, 0..KEYS);
        for key in 0..KEYS {
            limiter.reset(&key);
        }
        assert!(limiter.is_empty());
        let after_resets = limiter.stats().resizes;
        insert(&limiter, KEYS..2 * KEYS);
        limiter.stats().resizes - after_resets
    };
    // Filling the tables again rebuilds each once at its size, to clear the removed
    // keys' slots; without keys expected the resets shrank the tables, which then grow
    // again.
    let sized = refill(KEYS as usize);
    assert!(
        sized <= 8,
        "{sized} rebuilds refilling 8 shards sized ahead"
    );
    let growing = refill(0);
    assert!(
        growing > sized,
        "{growing} rebuilds growing against {sized} sized"
    );

    // The idle sweep: a new set of keys each hour, the last one untouched by then. Each
    // shard's table fills once per set, and its rebuild drops the old set's keys: at
    // its size with keys expected (one rebuild a shard a set), smaller without them,
    // which then grows again.
    let sweeping = |expected: usize| {
        let clock = ManualClock::new();
        let swept: RateLimiter<u64, ManualClock> = RateLimiter::builder(quota("10/s"))
            .shards(8)
            .expected_keys(expected)
            .clock(clock.clone())
            .build()
            .expect("valid limiter");
        for round in 0..3u64 {
            for key in round * KEYS..(round + 1) * KEYS {
                assert!(swept.check(&key).is_allowed());
            }
            clock.advance(Duration::from_secs(3_600));
        }
        let stats = swept.stats();
        assert!(stats.evicted_untouched >= KEYS, "{stats:?}");
        stats.resizes
    };
    let sized = sweeping(KEYS as usize);
    assert!(
        sized <= 2 * 8,
        "{sized} rebuilds for two new sets on 8 shards"
    );
    let growing = sweeping(0);
    assert!(
        growing > sized,
        "{growing} rebuilds growing against {sized} sized"
    );
}

/// A limiter sized ahead decides exactly as one that grows, over a random timeline of
/// checks, costs and time on 5,000 keys, for each word algorithm with one and two quotas.
#[test]
fn sized_ahead_or_growing_the_decisions_are_the_same() {
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
    ] {
        for also in [&[][..], &["40/min"][..]] {
            if algorithm == Algorithm::SlidingLog && !also.is_empty() {
                continue;
            }
            let build = |expected: usize| {
                let clock = ManualClock::new();
                let mut builder = RateLimiter::<u64>::builder(quota("5/s burst 3"))
                    .algorithm(algorithm)
                    .expected_keys(expected);
                for &q in also {
                    builder = builder.also(quota(q));
                }
                let limiter = builder.clock(clock.clone()).build().expect("valid limiter");
                (limiter, clock)
            };
            let (sized, sized_clock) = build(5_000);
            let (growing, growing_clock) = build(0);
            let mut x = 0x5eed_u64 + algorithm as u64;
            for step in 0..60_000 {
                let key = xorshift(&mut x) % 5_000;
                let cost = 1 + xorshift(&mut x) % 2;
                let a = sized.check_n(&key, cost);
                let b = growing.check_n(&key, cost);
                assert_eq!(a, b, "{algorithm:?} {also:?}, step {step}, key {key}");
                let advance = Duration::from_micros(xorshift(&mut x) % 500);
                sized_clock.advance(advance);
                growing_clock.advance(advance);
            }
        }
    }
}

/// What cannot be sized up front is a typed error, found before anything is allocated:
/// more keys than `max_keys`, than a shard's table can hold (2³² slots, or the sliding
/// log's 2²⁴ − 1 entries), or than fit in this machine's memory.
#[test]
fn what_cannot_be_sized_up_front_is_a_typed_error() {
    let too_many = |result: Result<RateLimiter<u64>, ConfigError>, why: &str| match result {
        Err(ConfigError::ExpectedKeysTooMany { why: said, .. }) => {
            assert!(said.contains(why), "{said:?} does not say {why:?}");
        }
        Err(other) => panic!("another error: {other}"),
        Ok(_) => panic!("built a limiter expecting too many keys"),
    };
    let builder = || RateLimiter::<u64>::builder(quota("10/s"));
    too_many(builder().max_keys(10).expected_keys(11).build(), "max_keys");
    too_many(
        builder().expected_keys(usize::MAX).build(),
        "tables can hold",
    );
    too_many(
        builder()
            .algorithm(Algorithm::SlidingLog)
            .shards(1)
            .expected_keys(1 << 24)
            .build(),
        "tables can hold",
    );
    #[cfg(target_os = "linux")]
    too_many(
        // 16 shards of 2³¹ keys: within a table's reach, 640 GB of tables.
        builder().shards(16).expected_keys(1 << 35).build(),
        "memory",
    );
    let error = builder()
        .max_keys(10)
        .expected_keys(11)
        .build()
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "expected_keys 11 cannot be sized for up front: more than `max_keys`"
    );
    // At the cap exactly, and 0 (nothing sized), build.
    assert!(builder().max_keys(10).expected_keys(10).build().is_ok());
    assert!(builder().expected_keys(0).build().is_ok());
}

/// A configuration file's `expected_keys` sizes the limiter it builds.
#[cfg(feature = "serde")]
#[test]
fn a_configuration_files_expected_keys_size_the_tables() {
    use tollgate::config::LimiterConfig;

    let config: LimiterConfig =
        toml::from_str("quota = \"1000000/s\"\nexpected_keys = 30000").expect("valid config");
    assert_eq!(config.expected_keys, Some(30_000));
    let limiter: RateLimiter<u64> = config.build().expect("valid limiter");
    insert(&limiter, 0..30_000);
    assert_eq!(limiter.stats().resizes, 0);
    let error = toml::from_str::<LimiterConfig>("quota = \"10/s\"\nexpected_keys = -1");
    assert!(error.is_err());
}

/// The synced limiter checks the keys expected before it starts anything, for every
/// quota's store: more than its tables can hold is the typed error, ahead of the check
/// for a tokio runtime (this test has none, so a limiter that passes gets `NoRuntime`).
#[cfg(feature = "redis")]
#[test]
fn the_synced_limiter_checks_the_keys_expected_before_starting() {
    use tollgate::sync::RedisSync;

    let synced = |expected: usize| {
        RateLimiter::<String>::builder(quota("100/s"))
            .also(quota("1000/h"))
            .expected_keys(expected)
            .build_synced(RedisSync::new("redis://127.0.0.1:1/"))
            .map(|_| ())
    };
    match synced(usize::MAX) {
        Err(ConfigError::ExpectedKeysTooMany { why, .. }) => {
            assert!(why.contains("tables can hold"), "{why}");
        }
        other => panic!("expected ExpectedKeysTooMany, got {other:?}"),
    }
    assert!(matches!(synced(10_000), Err(ConfigError::NoRuntime)));
}
