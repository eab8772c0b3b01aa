//! One shared table of scenarios, run against every algorithm. Each scenario is a
//! timeline of (time, key, cost) with the expected outcome of every request and the exact
//! retry-after of every deny, per algorithm.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, RateLimiter};

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// What each algorithm must answer: one letter per request (`A` allowed, `D` denied,
/// `E` a cost the quota can never admit) and the retry-after of each `D`, in order.
type Expected = [(Algorithm, &'static str, &'static [Duration]); 5];

struct Scenario {
    name: &'static str,
    quota: &'static str,
    /// (milliseconds since start, key, cost)
    timeline: &'static [(u64, &'static str, u64)],
    expected: Expected,
}

use Algorithm::{FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket};

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "a burst, then a deny",
        quota: "2/s",
        timeline: &[(0, "a", 1), (0, "a", 1), (0, "a", 1)],
        expected: [
            (TokenBucket, "AAD", &[ms(500)]),
            (LeakyBucket, "AAD", &[ms(500)]),
            (FixedWindow, "AAD", &[ms(1000)]),
            // The previous window's 2 must fully decay: they weigh 2·(1 − e) + 1 ≤ 2 at e = ½.
            (SlidingWindow, "AAD", &[ms(1500)]),
            (SlidingLog, "AAD", &[ms(1000)]),
        ],
    },
    Scenario {
        name: "a window boundary",
        quota: "2/s",
        timeline: &[
            (900, "a", 1),
            (900, "a", 1),
            (1000, "a", 1),
            (1000, "a", 1),
            (1100, "a", 1),
        ],
        expected: [
            (TokenBucket, "AADDD", &[ms(400), ms(400), ms(300)]),
            (LeakyBucket, "AADDD", &[ms(400), ms(400), ms(300)]),
            // The classic 2× boundary burst.
            (FixedWindow, "AAAAD", &[ms(900)]),
            (SlidingWindow, "AADDD", &[ms(500), ms(500), ms(400)]),
            (SlidingLog, "AADDD", &[ms(900), ms(900), ms(800)]),
        ],
    },
    Scenario {
        name: "weighted costs",
        quota: "4/s burst 2",
        timeline: &[(0, "a", 3), (0, "a", 2), (0, "a", 1)],
        expected: [
            (TokenBucket, "EAD", &[ms(250)]),
            (LeakyBucket, "EAD", &[ms(250)]),
            (FixedWindow, "ADA", &[ms(1000)]),
            // Next window, prev = 3 must weigh ≤ 2: y = 1s − ⌊2s/3⌋.
            (SlidingWindow, "ADA", &[Duration::from_nanos(1_333_333_334)]),
            (SlidingLog, "ADA", &[ms(1000)]),
        ],
    },
    Scenario {
        name: "keys are independent",
        quota: "1/s",
        timeline: &[(0, "a", 1), (0, "b", 1), (0, "a", 1), (0, "b", 1)],
        expected: [
            (TokenBucket, "AADD", &[ms(1000), ms(1000)]),
            (LeakyBucket, "AADD", &[ms(1000), ms(1000)]),
            (FixedWindow, "AADD", &[ms(1000), ms(1000)]),
            (SlidingWindow, "AADD", &[ms(2000), ms(2000)]),
            (SlidingLog, "AADD", &[ms(1000), ms(1000)]),
        ],
    },
    Scenario {
        name: "refill over time",
        quota: "2/s",
        timeline: &[
            (0, "a", 1),
            (0, "a", 1),
            (500, "a", 1),
            (600, "a", 1),
            (1000, "a", 1),
        ],
        expected: [
            (TokenBucket, "AAADA", &[ms(400)]),
            (LeakyBucket, "AAADA", &[ms(400)]),
            (FixedWindow, "AADDA", &[ms(500), ms(400)]),
            (SlidingWindow, "AADDD", &[ms(1000), ms(900), ms(500)]),
            (SlidingLog, "AADDA", &[ms(500), ms(400)]),
        ],
    },
    Scenario {
        name: "a quiet spell restores everything",
        quota: "3/min burst 3",
        timeline: &[
            (0, "a", 3),
            (1, "a", 1),
            (180_000, "a", 3),
            (180_000, "a", 1),
        ],
        expected: [
            (TokenBucket, "ADAD", &[ms(19_999), ms(20_000)]),
            (LeakyBucket, "ADAD", &[ms(19_999), ms(20_000)]),
            (FixedWindow, "ADAD", &[ms(59_999), ms(60_000)]),
            (SlidingWindow, "ADAD", &[ms(79_999), ms(80_000)]),
            (SlidingLog, "ADAD", &[ms(59_999), ms(60_000)]),
        ],
    },
];

#[test]
fn every_algorithm_passes_the_shared_scenarios() {
    for scenario in SCENARIOS {
        let algorithms: Vec<Algorithm> = scenario.expected.iter().map(|e| e.0).collect();
        for algorithm in Algorithm::ALL {
            assert!(
                algorithms.contains(&algorithm),
                "{}: no row for {algorithm:?}",
                scenario.name
            );
        }
        for (algorithm, outcomes, retries) in scenario.expected {
            let clock = ManualClock::new();
            let limiter: RateLimiter<String, ManualClock> =
                RateLimiter::builder(scenario.quota.parse().unwrap())
                    .algorithm(algorithm)
                    .clock(clock.clone())
                    .build()
                    .unwrap();
            let mut got = String::new();
            let mut got_retries = Vec::new();
            for &(at, key, cost) in scenario.timeline {
                clock.set_ns(at * 1_000_000);
                match limiter.check_n(key, cost) {
                    Err(_) => got.push('E'),
                    Ok(d) if d.is_allowed() => got.push('A'),
                    Ok(d) => {
                        got.push('D');
                        got_retries.push(d.retry_after().unwrap());
                    }
                }
            }
            assert_eq!(got, outcomes, "{}: {algorithm:?}", scenario.name);
            assert_eq!(got_retries, retries, "{}: {algorithm:?}", scenario.name);
        }
    }
}
