//! The token bucket decides exactly as governor's GCRA does, for the same quota and the
//! same timeline: same admissions, same retry-after, same remaining burst.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use governor::middleware::StateInformationMiddleware;
use proptest::prelude::*;
use tollgate::clock::ManualClock;
use tollgate::{Quota, RateLimiter};

/// One request: how long after the previous one it comes, its key and its cost.
fn timeline() -> impl Strategy<Value = Vec<(u64, u8, u32)>> {
    prop::collection::vec(
        (
            prop_oneof![
                Just(0u64),
                0u64..1_000,
                0u64..50_000_000,
                0u64..2_000_000_000
            ],
            0u8..3,
            prop_oneof![4 => Just(1u32), 1 => 1u32..12],
        ),
        1..300,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn token_bucket_equals_governor_gcra(
        limit in 1u64..200,
        period_ms in 1u64..5_000,
        burst in 1u32..20,
        events in timeline(),
    ) {
        let Ok(quota) = Quota::new(limit, Duration::from_millis(period_ms))
            .and_then(|q| q.with_burst(u64::from(burst)))
        else {
            return Ok(()); // not representable within 0.01%: tested elsewhere
        };
        let interval = quota.emission_interval();
        let clock = ManualClock::new();
        let ours: RateLimiter<u8, ManualClock> =
            RateLimiter::builder(quota).clock(clock.clone()).build().unwrap();

        let gov_clock = FakeRelativeClock::default();
        let gov_quota = governor::Quota::with_period(interval)
            .unwrap()
            .allow_burst(NonZeroU32::new(burst).unwrap());
        let theirs = governor::RateLimiter::dashmap_with_clock(gov_quota, gov_clock.clone())
            .with_middleware::<StateInformationMiddleware>();

        for (gap, key, cost) in events {
            clock.advance(Duration::from_nanos(gap));
            gov_clock.advance(Duration::from_nanos(gap));
            let mine = ours.check_n(&key, u64::from(cost));
            let gov = theirs.check_key_n(&key, NonZeroU32::new(cost).unwrap());
            match (mine, gov) {
                (Err(_), Err(_)) => {}
                (Ok(d), Ok(Ok(snapshot))) => {
                    prop_assert!(d.is_allowed());
                    prop_assert_eq!(d.remaining(), u64::from(snapshot.remaining_burst_capacity()));
                }
                (Ok(d), Ok(Err(not_until))) => {
                    prop_assert!(!d.is_allowed());
                    let wait = not_until.wait_time_from(governor::clock::Clock::now(&gov_clock));
                    prop_assert_eq!(d.retry_after(), Some(wait));
                }
                (mine, gov) => prop_assert!(false, "tollgate {mine:?} vs governor {gov:?}"),
            }
        }
    }
}
