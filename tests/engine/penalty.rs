//! The penalty box: keys blocked after breaking their limit, or by hand, in every
//! algorithm, at the smallest and largest quotas, from several threads.

use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, ConfigError, RateLimiter};

fn limiter(
    quota: &str,
    algorithm: Algorithm,
    block: Option<(Duration, Option<(u32, Duration)>)>,
) -> RateLimiter<u64, ManualClock> {
    let mut builder = RateLimiter::builder(quota.parse().unwrap())
        .algorithm(algorithm)
        .clock(ManualClock::new());
    if let Some((duration, after)) = block {
        builder = builder.block_for(duration);
        if let Some((denies, within)) = after {
            builder = builder.block_after(denies, within);
        }
    }
    builder.build().unwrap()
}

const TEN_MIN: Duration = Duration::from_secs(600);

/// For every algorithm, at 1/s and 100,000/s: the deny that breaks the limit blocks
/// the key for the block's length (retry to its end, nothing consumed while blocked),
/// other keys go on, and once the block ends the key has its full quota.
#[test]
fn a_deny_shuts_the_key_out_for_the_block() {
    for algorithm in Algorithm::ALL {
        let largest = if algorithm == Algorithm::SlidingLog {
            ("4096/s", 4096)
        } else {
            ("100000/s", 100_000)
        };
        for (quota, limit) in [("1/s", 1u64), largest] {
            let limiter = limiter(quota, algorithm, Some((TEN_MIN, None)));
            let clock = limiter.clock().clone();
            let admitted = (0..limit + 1)
                .filter(|_| limiter.check(&1).is_allowed())
                .count() as u64;
            assert_eq!(admitted, limit, "{algorithm} {quota}");
            // The deny above started the block.
            let denied = limiter.check(&1);
            assert!(!denied.is_allowed());
            assert_eq!(denied.retry_after(), Some(TEN_MIN), "{algorithm} {quota}");
            assert_eq!(denied.remaining(), 0);
            assert_eq!(denied.limit(), limit);
            assert_eq!(limiter.blocked_for(&1), Some(TEN_MIN));
            assert_eq!(limiter.blocked_keys(), 1);
            assert!(limiter.check(&2).is_allowed(), "other keys are not blocked");
            // Half-way: still blocked, the retry counts down, peek and check_n agree.
            clock.advance(TEN_MIN / 2);
            assert_eq!(limiter.check(&1).retry_after(), Some(TEN_MIN / 2));
            assert_eq!(limiter.peek(&1).retry_after(), Some(TEN_MIN / 2));
            assert!(!limiter.check_n(&1, 1).unwrap().is_allowed());
            assert!(
                limiter.check_n(&1, limit + 1).is_err(),
                "a cost beyond capacity stays an error"
            );
            // 1 ns before the end, then at it: the whole quota is back (the block
            // consumed nothing, and the quota refilled meanwhile).
            clock.advance(TEN_MIN / 2 - Duration::from_nanos(1));
            assert!(!limiter.check(&1).is_allowed());
            clock.advance(Duration::from_nanos(1));
            assert_eq!(limiter.blocked_for(&1), None);
            let admitted = (0..limit)
                .filter(|_| limiter.check(&1).is_allowed())
                .count() as u64;
            assert_eq!(admitted, limit, "{algorithm} {quota} after the block");
        }
    }
}

/// `block_after(3, 10 s)`: two denies in the window do not block; a third does; denies
/// further apart than the window never add up. A block's retry is the later of its end
/// and the quota's own.
#[test]
fn several_denies_within_a_window_block() {
    let long = limiter(
        "1/h",
        Algorithm::FixedWindow,
        Some((Duration::from_secs(5), None)),
    );
    let limiter = limiter(
        "1/min",
        Algorithm::FixedWindow,
        Some((TEN_MIN, Some((3, Duration::from_secs(10))))),
    );
    let clock = limiter.clock().clone();
    assert!(limiter.check(&1).is_allowed());
    for _ in 0..2 {
        let d = limiter.check(&1);
        assert!(
            d.retry_after().unwrap() < Duration::from_secs(61),
            "the window's own retry: {d:?}"
        );
        clock.advance(Duration::from_secs(6));
    }
    // 12 s after the first deny the count begins again: two more do not block ...
    for _ in 0..2 {
        assert!(limiter.check(&1).retry_after().unwrap() < Duration::from_secs(61));
    }
    assert!(limiter.blocked_for(&1).is_none());
    // ... a third within 10 s of the count's start does.
    assert_eq!(limiter.check(&1).retry_after(), Some(TEN_MIN));
    assert_eq!(limiter.blocked_for(&1), Some(TEN_MIN));
    // A block shorter than the quota's wait: the retry is the quota's.
    long.check(&1);
    assert_eq!(
        long.check(&1).retry_after(),
        Some(Duration::from_secs(3_600))
    );
    assert_eq!(long.blocked_for(&1), Some(Duration::from_secs(5)));
}

#[test]
fn operators_block_and_unblock_by_hand() {
    let limiter = limiter("10/s", Algorithm::TokenBucket, None);
    assert!(!limiter.unblock(&1), "nothing to unblock");
    limiter.block(&1, Duration::from_secs(30));
    limiter.block(&1, Duration::from_secs(5)); // a shorter block does not shorten it
    assert_eq!(
        limiter.check(&1).retry_after(),
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        limiter.peek(&1).retry_after(),
        Some(Duration::from_secs(30))
    );
    // Without block_for, denies block nothing.
    for _ in 0..20 {
        limiter.check(&2);
    }
    assert_eq!(limiter.blocked_for(&2), None);
    // reset forgets the quota's state, not the block.
    limiter.reset(&1);
    assert!(!limiter.check(&1).is_allowed());
    assert!(limiter.unblock(&1));
    assert!(limiter.check(&1).is_allowed());
    limiter.block(&3, Duration::ZERO);
    assert_eq!(limiter.blocked_keys(), 0, "a zero block blocks nothing");
    limiter.block(&3, Duration::MAX);
    assert!(limiter.blocked_for(&3).unwrap() > Duration::from_secs(100 * 365 * 86_400));
}

#[test]
fn penalties_that_block_nothing_are_typed_errors() {
    let build = |f: fn(tollgate::Builder<u64>) -> tollgate::Builder<u64>| {
        f(RateLimiter::builder("1/s".parse().unwrap()))
            .build()
            .unwrap_err()
    };
    for err in [
        build(|b| b.block_for(Duration::ZERO)),
        build(|b| b.block_after(3, Duration::from_secs(1))),
        build(|b| b.block_for(TEN_MIN).block_after(0, Duration::from_secs(1))),
        build(|b| b.block_for(TEN_MIN).block_after(2, Duration::ZERO)),
    ] {
        assert!(matches!(err, ConfigError::InvalidPenalty(_)), "{err:?}");
    }
}

/// Two threads saturate one key while a third checks others: the first deny blocks it,
/// no check of it passes during the block whatever the interleaving, and the others
/// never see the block.
#[test]
fn a_block_holds_under_concurrent_checks() {
    let limiter = Arc::new(limiter(
        "1000/s",
        Algorithm::TokenBucket,
        Some((TEN_MIN, None)),
    ));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let limiter = Arc::clone(&limiter);
            std::thread::spawn(move || {
                (0..50_000)
                    .filter(|_| limiter.check(&1).is_allowed())
                    .count()
            })
        })
        .collect();
    let others = (0..50_000u64)
        .filter(|k| limiter.check(&(k + 10)).is_allowed())
        .count();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 1000, "the burst, then the block");
    assert_eq!(others, 50_000);
    assert_eq!(limiter.blocked_keys(), 1);
}
