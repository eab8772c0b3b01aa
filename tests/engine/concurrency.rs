//! Many threads on one key, with time frozen, admit exactly the quota: no lost update and
//! no double spend in the CAS loop, for both algorithms.

use std::sync::Barrier;
use std::thread;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, Quota, RateLimiter};

fn frozen(algorithm: Algorithm, quota: Quota) -> RateLimiter<String, ManualClock> {
    RateLimiter::builder(quota)
        .algorithm(algorithm)
        .clock(ManualClock::new())
        .build()
        .unwrap()
}

/// Runs `per_thread` checks of cost `cost` on `key` from each of `threads` threads at
/// once; returns the total cost admitted.
fn hammer(
    limiter: &RateLimiter<String, ManualClock>,
    threads: usize,
    per_thread: usize,
    key: &str,
    cost: u64,
) -> u64 {
    let start = Barrier::new(threads);
    thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    (0..per_thread)
                        .filter(|_| limiter.check_n(key, cost).unwrap().is_allowed())
                        .count() as u64
                        * cost
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

#[test]
fn every_algorithm_admits_exactly_its_capacity() {
    for algorithm in Algorithm::ALL {
        for threads in [4, 8] {
            // Capacity 4,000 (the burst for the buckets, the limit for the others).
            let limiter = frozen(algorithm, Quota::per_second(4_000).unwrap());
            let admitted = hammer(&limiter, threads, 4_000, "hot", 1);
            assert_eq!(admitted, 4_000, "{algorithm:?}, {threads} threads");
            assert!(!limiter.check("hot").is_allowed(), "{algorithm:?}");
            assert_eq!(limiter.peek("hot").remaining(), 0, "{algorithm:?}");
        }
    }
}

#[test]
fn a_small_burst_is_exact_too() {
    let quota = Quota::per_second(10).unwrap().with_burst(3).unwrap();
    for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket] {
        let limiter = frozen(algorithm, quota);
        assert_eq!(hammer(&limiter, 8, 1_000, "hot", 1), 3, "{algorithm:?}");
    }
}

#[test]
fn weighted_checks_never_overspend() {
    for algorithm in Algorithm::ALL {
        // Cost 3 into a capacity of 3,001: exactly 1,000 fit, the last unit is left over.
        let limiter = frozen(algorithm, Quota::per_second(3_001).unwrap());
        assert_eq!(hammer(&limiter, 4, 1_000, "hot", 3), 3_000, "{algorithm:?}");
        assert_eq!(limiter.peek("hot").remaining(), 1, "{algorithm:?}");
    }
}

#[test]
fn many_keys_under_contention_are_each_exact() {
    let limiter = frozen(Algorithm::TokenBucket, Quota::per_second(100).unwrap());
    let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
    let start = Barrier::new(4);
    let admitted: usize = thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let mut admitted = 0;
                    for _ in 0..60 {
                        for key in &keys {
                            admitted += usize::from(limiter.check(key.as_str()).is_allowed());
                        }
                    }
                    admitted
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    // 4 threads × 60 rounds = 240 attempts per key, of which exactly 100 pass.
    assert_eq!(admitted, 64 * 100);
    assert_eq!(limiter.len(), 64);
    for key in &keys {
        assert_eq!(limiter.peek(key.as_str()).remaining(), 0, "{key}");
    }
    let clone = limiter.clone();
    clone.clock().advance(std::time::Duration::from_millis(10));
    assert!(
        limiter.check("k0").is_allowed(),
        "a clone shares the clock and state"
    );
    assert!(!clone.check("k0").is_allowed());
}
