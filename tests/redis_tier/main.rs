//! The Redis tiers on real processes: the exact tier on one server and on a cluster, the
//! local first tier, the sync against a real redis-server, both tiers behind Redis Sentinel, and one node
//! cut off alone.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link.

// Not built for the loom models (`--cfg tollgate_loom`), whose tables are not `Sync`
// outside a model and whose dev-dependencies are not there.
#![cfg(not(tollgate_loom))]

#[path = "../common/mod.rs"]
mod common;

mod calendar;
mod cluster;
mod compound;
mod concurrency;
mod partition;
mod penalty;
mod plans;
mod redis;
mod redis_first_tier;
mod sentinel;
mod sync;
mod sync_quotas;

/// Builds `remote` (with `algorithm`, on a caller clock, and `quotas[1..]` as `also`
/// quotas) and an in-memory limiter with the same quotas (`quotas[0]` being `remote`'s
/// own) and algorithm on the same clock, then checks `steps` random costs of 1 to
/// `max_cost` on `keys` keys through both and asserts the same verdict, remaining and
/// deciding quota at every step. The clock never falls behind real time: Redis expires
/// keys by it.
#[cfg(feature = "redis")]
async fn assert_decides_as_in_memory(
    mut remote: tollgate::redis::RedisBuilder,
    quotas: &[tollgate::Quota],
    algorithm: tollgate::Algorithm,
    (keys, steps, max_cost): (u64, u64, u64),
) {
    use std::time::{Duration, Instant};
    use tollgate::clock::ManualClock;
    let clock = ManualClock::new();
    let mut local = tollgate::RateLimiter::builder(quotas[0])
        .algorithm(algorithm)
        .clock(clock.clone());
    for &quota in &quotas[1..] {
        remote = remote.also(quota);
        local = local.also(quota);
    }
    let remote = remote
        .algorithm(algorithm)
        .caller_clock(clock.clone())
        .build()
        .await
        .unwrap();
    let local: tollgate::RateLimiter<String, ManualClock> = local.build().unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut real = Instant::now();
    for step in 0..steps {
        crate::common::xorshift(&mut x);
        let drawn = Duration::from_micros([0, 1, 900, 45_000, 250_000][(x % 5) as usize]);
        let behind = Duration::from_micros(real.elapsed().as_micros() as u64 + 1);
        clock.advance(drawn.max(behind));
        real = Instant::now();
        let key = format!("key-{}", step % keys);
        let n = 1 + (x >> 8) % max_cost;
        let r = remote.check_n(&key, n).await.unwrap();
        let l = local.check_n(key.as_str(), n).unwrap();
        assert_eq!(
            (r.is_allowed(), r.remaining(), r.policy()),
            (l.is_allowed(), l.remaining(), l.policy()),
            "{algorithm:?} step {step} {key}: redis {r:?} local {l:?}"
        );
    }
}

/// Asserts that a check failed as a failover makes it fail: a timeout, no server, or an
/// open breaker (three failures in a row open it; checks then fail at once until a probe
/// finds the new primary).
#[cfg(feature = "redis")]
fn assert_failover_error(e: &tollgate::redis::RedisError) {
    use tollgate::redis::RedisError;
    assert!(
        matches!(
            e,
            RedisError::Timeout(_) | RedisError::Unavailable(_) | RedisError::CircuitOpen { .. }
        ),
        "{e}"
    );
}
