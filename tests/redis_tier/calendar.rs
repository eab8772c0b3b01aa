//! Calendar quotas in the Redis tier: the window scripts on calendar periods, whose
//! bounds the caller computes from the zone's rules and the script picks by its own
//! time, against the in-process limiter at the same instants.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::redis::RedisLimiter;
use tollgate::{Algorithm, RateLimiter};

use crate::redis::{Keeper, assert_same, server};

/// The quotas compared: every unit, an anchor on the 31st, and (with the `calendar`
/// feature) days and months in Paris, across its DST changes.
fn quotas() -> Vec<&'static str> {
    let mut quotas = vec![
        "3/day calendar",
        "2/week calendar",
        "3/month calendar anchor 31",
        "2/year calendar",
    ];
    if cfg!(feature = "calendar") {
        quotas.extend([
            "3/day calendar tz Europe/Paris",
            "2/month calendar tz Europe/Paris",
        ]);
    }
    quotas
}

/// The same random timelines (steps from a microsecond to 40 days, from 2024-02-28, so
/// through a leap day and DST changes) through Redis (caller clock) and through the
/// in-process limiter give the same decisions, for both window counters: verdict, limit
/// and remaining equal; reset and retry equal once the local ones are rounded up to the
/// scripts' microseconds.
#[tokio::test]
async fn calendar_decisions_equal_the_in_process_limiter() {
    let server = server();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut expired = 0;
    let mut steps = 0;
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        for quota in quotas() {
            let clock = ManualClock::at_unix(Duration::from_secs(1_709_078_400));
            let remote = RedisLimiter::builder(&server.url(), quota.parse().unwrap())
                .algorithm(algorithm)
                .timeout(Duration::from_secs(2))
                .caller_clock(clock.clone())
                .build()
                .await
                .unwrap();
            let local: RateLimiter<String, ManualClock> =
                RateLimiter::builder(quota.parse().unwrap())
                    .algorithm(algorithm)
                    .clock(clock.clone())
                    .build()
                    .unwrap();
            let prefix = format!("{}-{quota}", algorithm.name());
            let keys: Vec<String> = (0..2).map(|k| format!("{prefix}-{k}")).collect();
            let mut keeper = Keeper::new(&server).await;
            for step in 0..300 {
                crate::common::xorshift(&mut x);
                let drawn = [
                    1,
                    17,
                    900_000,
                    3_600_000_000,
                    25_200_000_000,
                    86_400_000_000,
                    777_600_000_000,
                    3_456_000_000_000u64,
                ][(x % 8) as usize];
                clock.advance(Duration::from_micros(drawn));
                let key = &keys[((x >> 8) % 2) as usize];
                let (r, l) = (remote.check(key).await.unwrap(), local.check(key.as_str()));
                let context = format!("{algorithm:?} {quota} step {step}: redis {r:?} local {l:?}");
                assert_same(&r, &l, &context);
                expired += keeper.persist_for(&remote, &local, &keys).await;
                steps += 1;
            }
        }
    }
    // Calendar windows' TTLs are hours to years: real time expires none.
    assert_eq!(
        expired, 0,
        "{expired} of {steps} steps lost a key to real time"
    );
}

/// With the server's `TIME` (no caller clock), the bounds travel as Unix time: a deny's
/// retry is the time to the next UTC midnight, as the system clock tells it.
#[tokio::test]
async fn server_time_counts_to_the_real_midnight() {
    let server = server();
    let remote = RedisLimiter::builder(&server.url(), "1/day calendar".parse().unwrap())
        .algorithm(Algorithm::FixedWindow)
        .build()
        .await
        .unwrap();
    assert!(remote.check("k").await.unwrap().is_allowed());
    let denied = remote.check("k").await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let to_midnight = Duration::from_secs(86_400 - now.as_secs() % 86_400);
    let retry = denied.retry_after().expect("denied");
    let gap = retry.abs_diff(to_midnight);
    assert!(
        gap < Duration::from_secs(2),
        "retry {retry:?}, midnight in {to_midnight:?}"
    );
}

/// The sliding window's products must stay exact in Lua's doubles: a monthly limit too
/// large for them is a typed error naming the fixed window; the fixed window takes it.
#[tokio::test]
async fn a_sliding_calendar_beyond_the_scripts_precision_is_refused() {
    let url = "redis://127.0.0.1:1";
    let err = RedisLimiter::builder(url, "10000/month calendar".parse().unwrap())
        .algorithm(Algorithm::SlidingWindow)
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("use the fixed window"), "{err}");
    let server = server();
    let fixed = RedisLimiter::builder(&server.url(), "10000/month calendar".parse().unwrap())
        .algorithm(Algorithm::FixedWindow)
        .build()
        .await
        .unwrap();
    assert_eq!(fixed.check("k").await.unwrap().remaining(), 9_999);
}
