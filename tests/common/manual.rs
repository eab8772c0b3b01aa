//! A limiter on a `ManualClock`, for the tests of every package.

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, RateLimiter};

/// A `String`-keyed limiter running `algorithm` at `quota` (a quota string) on a
/// `ManualClock` at 0, with that clock.
pub fn manual(
    algorithm: Algorithm,
    quota: &str,
) -> (RateLimiter<String, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let limiter = RateLimiter::builder(quota.parse().unwrap())
        .algorithm(algorithm)
        .clock(clock.clone())
        .build()
        .unwrap();
    (limiter, clock)
}
