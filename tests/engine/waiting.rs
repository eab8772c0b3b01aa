//! The waiting API, on tokio's paused clock: no test really sleeps, and every wait is
//! checked to the nanosecond.
#![cfg(feature = "tokio")]

use std::time::Duration;

use tokio::time::Instant;
use tollgate::clock::TokioClock;
use tollgate::{AcquireError, Algorithm, Jitter, Quota, RateLimiter};

fn limiter(algorithm: Algorithm, quota: &str) -> RateLimiter<String, TokioClock> {
    RateLimiter::builder(quota.parse::<Quota>().unwrap())
        .algorithm(algorithm)
        .clock(TokioClock::new())
        .build()
        .unwrap()
}

/// The wait for one more request on a "2/s" key that has used both units: the
/// retry-after, plus for the leaky bucket the queue ahead of it (one slot, 500ms).
fn total_wait(algorithm: Algorithm, retry_after: Duration) -> Duration {
    match algorithm {
        Algorithm::LeakyBucket => retry_after + Duration::from_millis(500),
        _ => retry_after,
    }
}

#[tokio::test(start_paused = true)]
async fn until_ready_waits_exactly_the_retry_after() {
    for algorithm in Algorithm::ALL {
        let l = limiter(algorithm, "2/s");
        l.check_n("k", 2).unwrap();
        let expected = total_wait(algorithm, l.peek("k").retry_after().unwrap());
        let start = Instant::now();
        let d = l.until_ready("k").await;
        assert!(d.is_allowed(), "{algorithm:?}");
        assert_eq!(start.elapsed(), expected, "{algorithm:?}");
        assert!(
            d.remaining() < d.limit(),
            "{algorithm:?}: the wait did not consume"
        );
        if d.delay().is_zero() {
            // (A leaky-bucket decision describes the instant of admission, before the
            // wait for its slot, during which the queue drained.)
            assert_eq!(l.peek("k").remaining(), d.remaining(), "{algorithm:?}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn until_ready_n_refuses_what_can_never_fit_at_once() {
    let l = limiter(Algorithm::TokenBucket, "10/s burst 3");
    let start = Instant::now();
    let err = l.until_ready_n("k", 4).await.unwrap_err();
    assert_eq!(err.capacity, 3);
    assert_eq!(start.elapsed(), Duration::ZERO);
    let d = l.until_ready_n("k", 3).await.unwrap();
    assert_eq!(d.remaining(), 0);
}

#[tokio::test(start_paused = true)]
async fn acquire_timeout_gives_up_at_once_and_consumes_nothing() {
    for algorithm in Algorithm::ALL {
        let l = limiter(algorithm, "2/s");
        l.check_n("k", 2).unwrap();
        let needed = total_wait(algorithm, l.peek("k").retry_after().unwrap());
        let start = Instant::now();
        let err = l
            .acquire_timeout("k", 1, needed - Duration::from_nanos(1))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            AcquireError::Timeout {
                needed,
                max_wait: needed - Duration::from_nanos(1)
            },
            "{algorithm:?}"
        );
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "{algorithm:?}: waited before giving up"
        );
        assert!(err.to_string().contains("rate limited"));

        let d = l.acquire_timeout("k", 1, needed).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(start.elapsed(), needed, "{algorithm:?}");
        let err = l.acquire_timeout("k", 3, Duration::MAX).await.unwrap_err();
        assert!(
            matches!(err, AcquireError::InsufficientCapacity(_)),
            "{algorithm:?}"
        );
    }
}

/// nginx `burst` without `nodelay`: waiters that find the queue full wait for a slot,
/// and everyone leaves exactly one interval apart.
#[tokio::test(start_paused = true)]
async fn the_leaky_bucket_spaces_waiters_evenly() {
    let l = limiter(Algorithm::LeakyBucket, "10/s burst 3");
    let start = Instant::now();
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let l = l.clone();
            tokio::spawn(async move {
                l.until_ready("k").await;
                start.elapsed()
            })
        })
        .collect();
    let mut served = Vec::new();
    for task in tasks {
        served.push(task.await.unwrap());
    }
    served.sort();
    let expected: Vec<Duration> = (0..6).map(|i| Duration::from_millis(100 * i)).collect();
    assert_eq!(served, expected);
}

#[tokio::test(start_paused = true)]
async fn a_leaky_bucket_slot_beyond_the_deadline_is_not_taken() {
    let l = limiter(Algorithm::LeakyBucket, "10/s burst 5");
    for _ in 0..3 {
        l.check("k");
    }
    // The queue has room, but the next slot is 300ms away.
    let err = l
        .acquire_timeout("k", 1, Duration::from_millis(250))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AcquireError::Timeout { needed, .. } if needed == Duration::from_millis(300))
    );
    assert_eq!(l.peek("k").remaining(), 2, "the refused slot was consumed");
    let start = Instant::now();
    l.acquire_timeout("k", 1, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(300));
}

#[tokio::test(start_paused = true)]
async fn jitter_spreads_waiters_within_its_bounds() {
    let l = limiter(Algorithm::TokenBucket, "1/s");
    let jitter = Jitter::up_to(Duration::from_millis(50));
    let start = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let l = l.clone();
            let key = format!("k{i}");
            tokio::spawn(async move {
                l.check(key.as_str());
                l.until_ready_with_jitter(key.as_str(), 1, jitter)
                    .await
                    .unwrap();
                start.elapsed()
            })
        })
        .collect();
    let mut woke = Vec::new();
    for task in tasks {
        woke.push(task.await.unwrap());
    }
    for t in &woke {
        assert!(
            *t >= Duration::from_secs(1) && *t <= Duration::from_millis(1050),
            "{t:?}"
        );
    }
    woke.sort();
    woke.dedup();
    assert!(woke.len() > 1, "all waiters woke at once: {woke:?}");
    assert!(Jitter::between(Duration::from_secs(2), Duration::from_secs(1)).is_err());
    assert_eq!(Jitter::NONE.sample(), Duration::ZERO);
}
