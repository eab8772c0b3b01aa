//! The public `RateLimiter` API: construction, each method's contract, the key cap, and
//! arithmetic at the extremes.

use std::time::Duration;

use crate::common;

use common::manual;
use tollgate::clock::ManualClock;
use tollgate::{Algorithm, ConfigError, InsufficientCapacity, Quota, RateLimiter, WhenFull};

const ALGORITHMS: [Algorithm; 5] = Algorithm::ALL;

#[test]
fn limiter_is_send_sync_and_clones_share_state() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<RateLimiter<String>>();
    assert_send_sync::<RateLimiter<u64, ManualClock>>();

    let limiter: RateLimiter<String> =
        RateLimiter::new(Quota::per_second(100).unwrap().with_burst(2).unwrap());
    let clone = limiter.clone();
    assert!(limiter.check("user_1024").is_allowed());
    assert!(clone.check("user_1024").is_allowed());
    let d = limiter.check("user_1024");
    assert!(!d.is_allowed());
    assert!(d.retry_after().unwrap() > Duration::ZERO);
    assert_eq!(limiter.algorithm(), Algorithm::TokenBucket);
}

#[test]
fn decision_limit_is_the_burst_or_the_limit() {
    let (tb, _) = manual(Algorithm::TokenBucket, "10/s burst 3");
    let (sw, _) = manual(Algorithm::SlidingWindow, "10/s burst 3");
    assert_eq!(tb.check("k").limit(), 3);
    assert_eq!(sw.check("k").limit(), 10);
}

#[test]
fn check_n_refuses_what_can_never_fit_and_consumes_nothing_for_zero() {
    let (tb, _) = manual(Algorithm::TokenBucket, "10/s burst 4");
    assert_eq!(
        tb.check_n("k", 5),
        Err(InsufficientCapacity {
            requested: 5,
            capacity: 4
        })
    );
    let (sw, _) = manual(Algorithm::SlidingWindow, "10/s burst 4");
    let err = sw.check_n("k", 11).unwrap_err();
    assert_eq!(err.capacity, 10);
    assert!(err.to_string().contains("cost 11 exceeds 10"), "{err}");
    for limiter in [tb, sw] {
        let d = limiter.check_n("k", 0).unwrap();
        assert!(d.is_allowed());
        assert!(limiter.is_empty(), "cost 0 stored a key");
        let cap = limiter.check("k").limit();
        assert!(limiter.check_n("k", cap - 1).unwrap().is_allowed());
        let d = limiter.check_n("k", 0).unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 0);
        assert!(!limiter.check("k").is_allowed(), "cost 0 consumed");
    }
}

#[test]
fn peek_neither_consumes_nor_stores() {
    for algorithm in ALGORITHMS {
        let (limiter, _) = manual(algorithm, "2/s");
        let d = limiter.peek("ghost");
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 2);
        assert!(limiter.is_empty());
        limiter.check("k");
        limiter.check("k");
        for _ in 0..3 {
            let d = limiter.peek("k");
            assert!(!d.is_allowed());
            assert_eq!(d.remaining(), 0);
        }
        assert_eq!(
            limiter.peek("k"),
            limiter.check("k"),
            "{algorithm:?}: peek and check disagree on a deny"
        );
    }
}

#[test]
fn reset_restores_a_full_quota() {
    for algorithm in ALGORITHMS {
        let (limiter, _) = manual(algorithm, "3/min");
        for _ in 0..3 {
            assert!(limiter.check("k").is_allowed());
        }
        limiter.check("other");
        assert!(!limiter.check("k").is_allowed());
        assert_eq!(limiter.len(), 2);
        limiter.reset("k");
        limiter.reset("never-seen");
        assert_eq!(limiter.len(), 1);
        assert_eq!(limiter.check("k").remaining(), 2);
    }
}

#[test]
fn builder_rejects_bad_configuration() {
    let q = Quota::per_second(10).unwrap();
    // Above the cap: 1 << 30 aborted the process with a 128 GiB allocation, 1 << 62
    // panicked, 1 << 24 took 10 GB.
    for shards in [
        0,
        3,
        12,
        tollgate::MAX_SHARDS * 2,
        1 << 24,
        1 << 30,
        1 << 62,
    ] {
        let err = RateLimiter::<u64>::builder(q)
            .shards(shards)
            .build()
            .unwrap_err();
        assert_eq!(err, ConfigError::InvalidShards(shards));
        assert!(
            err.to_string().contains("power of two from 1 to 65,536"),
            "{err}"
        );
    }
    assert_eq!(
        RateLimiter::<u64>::builder(q)
            .shards(tollgate::MAX_SHARDS)
            .build()
            .unwrap()
            .shards(),
        65_536
    );
    // The largest key cap is no cap at all: nothing is sized by it.
    let unbounded = RateLimiter::<u64>::builder(q)
        .max_keys(usize::MAX)
        .build()
        .unwrap();
    assert!(unbounded.check(&1).is_allowed());
    for shards in [1, 2, 64] {
        let limiter = RateLimiter::<u64>::builder(q)
            .shards(shards)
            .build()
            .unwrap();
        assert_eq!(limiter.shards(), shards);
        assert!(limiter.check(&1).is_allowed());
    }
    assert_eq!(
        RateLimiter::<u64>::builder(q)
            .max_keys(0)
            .build()
            .unwrap_err(),
        ConfigError::ZeroMaxKeys
    );
    let huge = Quota::per_hour(100_000_000).unwrap();
    let err = RateLimiter::<u64>::builder(huge)
        .algorithm(Algorithm::SlidingWindow)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::LimitTooLarge {
                max: 16_777_215,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        RateLimiter::<u64>::builder(huge).build().is_ok(),
        "the token bucket has no such cap"
    );
    for (algorithm, max) in [
        (Algorithm::SlidingLog, tollgate::SLIDING_LOG_MAX_LIMIT),
        (Algorithm::FixedWindow, tollgate::FIXED_WINDOW_MAX_LIMIT),
        (Algorithm::SlidingWindow, tollgate::SLIDING_WINDOW_MAX_LIMIT),
    ] {
        let at_cap = Quota::new(max, Duration::from_secs(86_400)).unwrap();
        assert!(
            RateLimiter::<u64>::builder(at_cap)
                .algorithm(algorithm)
                .build()
                .is_ok()
        );
        let over = Quota::new(max + 1, Duration::from_secs(86_400)).unwrap();
        let err = RateLimiter::<u64>::builder(over)
            .algorithm(algorithm)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains(&format!("at most {max}")), "{err}");
    }
}

#[test]
fn algorithm_names_round_trip() {
    for algorithm in Algorithm::ALL {
        assert_eq!(algorithm.name().parse::<Algorithm>(), Ok(algorithm));
        assert_eq!(algorithm.to_string(), algorithm.name());
    }
    let err = "gcra".parse::<Algorithm>().unwrap_err();
    assert!(
        err.to_string().contains("use token-bucket, sliding-window"),
        "{err}"
    );
}

#[test]
fn only_the_leaky_bucket_delays_admissions() {
    for algorithm in ALGORITHMS {
        let (l, _) = manual(algorithm, "10/s burst 3");
        let delays: Vec<Duration> = (0..3).map(|_| l.check("k").delay()).collect();
        let expected = if algorithm == Algorithm::LeakyBucket {
            vec![
                Duration::ZERO,
                Duration::from_millis(100),
                Duration::from_millis(200),
            ]
        } else {
            vec![Duration::ZERO; 3]
        };
        assert_eq!(delays, expected, "{algorithm:?}");
    }
}

#[test]
fn max_keys_is_a_hard_cap_that_first_drops_untouched_keys() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::new();
        let limiter: RateLimiter<u64, ManualClock> = RateLimiter::builder("1/s".parse().unwrap())
            .algorithm(algorithm)
            .clock(clock.clone())
            .shards(1)
            .max_keys(3)
            .when_full(WhenFull::DenyNewKeys)
            .build()
            .unwrap();
        for key in 0..3 {
            assert!(limiter.check(&key).is_allowed());
        }
        // Full, and every key is busy: a new key is refused until the first one resets.
        let d = limiter.check(&99);
        assert!(!d.is_allowed() && d.is_capacity_deny(), "{algorithm:?}");
        let wait = d.retry_after().unwrap();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(2),
            "{algorithm:?}: {wait:?}"
        );
        assert_eq!(limiter.len(), 3);
        assert_eq!(limiter.stats().refused_new_keys, 1);
        // Known keys are still served (and still limited).
        let known = limiter.check(&0);
        assert!(!known.is_allowed() && !known.is_capacity_deny());

        clock.advance(wait);
        assert!(
            limiter.check(&99).is_allowed(),
            "{algorithm:?}: not admitted at retry_after"
        );
        let stats = limiter.stats();
        assert!(stats.keys <= 3, "{algorithm:?}");
        assert_eq!(
            stats.evicted_active, 0,
            "{algorithm:?}: a live key was evicted"
        );
        assert!(stats.evicted_untouched >= 1);
    }
}

#[test]
fn a_full_limiter_can_evict_the_least_active_key_instead() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::new();
        let limiter: RateLimiter<u64, ManualClock> = RateLimiter::builder("10/s".parse().unwrap())
            .algorithm(algorithm)
            .clock(clock.clone())
            .shards(1)
            .max_keys(2)
            .build()
            .unwrap();
        // Key 0 is in deep debt (an abuser); key 1 used one unit, a little later.
        for _ in 0..20 {
            limiter.check(&0);
        }
        clock.advance(Duration::from_millis(1));
        limiter.check(&1);
        // A new key evicts key 1, the one nearest to untouched; the abuser keeps its debt.
        assert!(limiter.check(&2).is_allowed(), "{algorithm:?}");
        assert_eq!(limiter.stats().evicted_active, 1, "{algorithm:?}");
        assert_eq!(limiter.len(), 2);
        assert!(
            !limiter.check(&0).is_allowed(),
            "{algorithm:?}: the abuser was reset"
        );
        assert_eq!(
            limiter.peek(&1).remaining(),
            limiter.peek(&1).limit(),
            "{algorithm:?}"
        );
    }
}

#[test]
fn long_uptimes_and_extreme_quotas_do_not_overflow() {
    let quotas = [
        "1/ns",
        "1/ns burst 18446744073709551615",
        "16777215/min",
        "1/200000d",
        "3/s",
    ];
    for algorithm in ALGORITHMS {
        for quota in quotas {
            let quota: Quota = quota.parse().unwrap();
            let Ok(limiter) = RateLimiter::<u8>::builder(quota)
                .algorithm(algorithm)
                .clock(ManualClock::new())
                .build()
            else {
                continue;
            };
            for now in [0, 1 << 40, 1 << 62, u64::MAX - 1, u64::MAX] {
                limiter.clock().set_ns(now);
                for cost in [1, quota.burst().min(quota.limit())] {
                    if let Ok(d) = limiter.check_n(&0, cost) {
                        assert!(d.is_allowed() || d.retry_after().unwrap() > Duration::ZERO);
                        assert!(d.remaining() <= d.limit());
                    }
                }
                let _ = limiter.peek(&0);
            }
        }
    }
}

#[test]
fn default_clock_limits_in_real_time() {
    // Burst 1 at 1 per hour: the second request in a row is denied with ~1h to wait.
    let limiter: RateLimiter<String> = RateLimiter::new("1/h".parse().unwrap());
    assert!(limiter.check("k").is_allowed());
    let wait = limiter.check("k").retry_after().unwrap();
    assert!(
        wait > Duration::from_secs(3599) && wait <= Duration::from_secs(3600),
        "{wait:?}"
    );
}
