//! Background sync against a real redis-server: four limiters in one process, each its
//! own node with its own sync task, sharing one global quota.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use tollgate::redis::LocalRedis;
use tollgate::sync::{Fallback, RedisSync, SyncHandle, SyncMode};
use tollgate::{Algorithm, Quota, RateLimiter};

fn server() -> LocalRedis {
    LocalRedis::start().expect("these tests need redis-server (./scripts/test.sh installs it)")
}

const INTERVAL: Duration = Duration::from_millis(50);

fn nodes(
    server: &LocalRedis,
    algorithm: Algorithm,
    quota: Quota,
    mode: SyncMode,
    prefix: &str,
    count: usize,
) -> Vec<(RateLimiter<String>, SyncHandle)> {
    (0..count)
        .map(|_| {
            RateLimiter::builder(quota)
                .algorithm(algorithm)
                .build_synced(
                    RedisSync::new(&server.url())
                        .mode(mode)
                        .interval(INTERVAL)
                        .prefix(prefix)
                        .allow_shared_prefix(true),
                )
                .unwrap()
        })
        .collect()
}

/// Redis's clock, in µs.
async fn server_time(server: &LocalRedis) -> u64 {
    let mut con = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    secs * 1_000_000 + micros
}

/// How far ahead of Redis's clock the token-bucket state at `key` is (µs): the tokens it
/// owes times the interval.
async fn debt_us(server: &LocalRedis, key: &str) -> u64 {
    let mut con = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let tat: u64 = redis::cmd("HGET")
        .arg(key)
        .arg("t")
        .query_async(&mut con)
        .await
        .unwrap();
    tat.saturating_sub(server_time(server).await)
}

/// Offers load `load × L`, split 70/10/10/10 over the nodes, one tick a millisecond: a
/// warm-up until the next window of Redis's clock starts (so the full bucket of an idle
/// start is spent before measuring), then `windows` measured windows. Returns the
/// admission instants in µs since the first measured window started.
async fn drive(
    server: &LocalRedis,
    nodes: &[(RateLimiter<String>, SyncHandle)],
    quota: Quota,
    load: f64,
    windows: u32,
) -> Vec<u64> {
    let period = quota.period();
    let p = period.as_micros() as u64;
    // Warm up for at least half a window, up to a window boundary.
    let now = server_time(server).await;
    let warm_up = Duration::from_micros(p - now % p + if p - now % p < p / 2 { p } else { 0 });
    offer(nodes, quota, load, warm_up).await;
    offer(nodes, quota, load, period * windows).await
}

/// Offers load for `length`; returns the admission instants in µs since the start.
async fn offer(
    nodes: &[(RateLimiter<String>, SyncHandle)],
    quota: Quota,
    load: f64,
    length: Duration,
) -> Vec<u64> {
    let period = quota.period();
    let per_ms = load * quota.limit() as f64 / period.as_millis() as f64;
    let shares = [0.7, 0.1, 0.1, 0.1];
    let mut owed = [0.0f64; 4];
    let mut admitted = Vec::new();
    let start = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed() < length {
        ticker.tick().await;
        for (node, (limiter, _)) in nodes.iter().enumerate() {
            owed[node] += per_ms * shares[node];
            while owed[node] >= 1.0 {
                owed[node] -= 1.0;
                if limiter.check("global").is_allowed() {
                    admitted.push(start.elapsed().as_micros() as u64);
                }
            }
        }
    }
    admitted
}

fn per_window(admitted: &[u64], period: Duration, windows: u32) -> Vec<u64> {
    let p = period.as_micros() as u64;
    let mut counts = vec![0; windows as usize];
    for &t in admitted {
        if let Some(c) = counts.get_mut((t / p) as usize) {
            *c += 1;
        }
    }
    counts
}

/// The largest `count − rate·t` over any interval of admissions, i.e. the smallest `b`
/// with "at most `b + rate·t` in any interval of length `t`".
fn excess_over_rate(admitted: &[u64], rate_per_us: f64) -> f64 {
    let mut worst = 0.0f64;
    let mut min_before = f64::MAX;
    for (k, &t) in admitted.iter().enumerate() {
        let f = k as f64 - rate_per_us * t as f64;
        min_before = min_before.min(f - 1.0);
        worst = worst.max(f - min_before);
    }
    worst
}

async fn stop(nodes: Vec<(RateLimiter<String>, SyncHandle)>) {
    for (_, handle) in nodes {
        handle.shutdown().await;
    }
}

/// Reconcile, 4 nodes, 2× and 6× skewed overload: every window after the first admits
/// within 5% of L, and the documented bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_tracks_the_global_limit() {
    let server = server();
    for (algorithm, load) in [
        (Algorithm::TokenBucket, 2.0),
        (Algorithm::SlidingWindow, 6.0),
    ] {
        let quota = Quota::new(1000, Duration::from_millis(1000)).unwrap();
        let nodes = nodes(
            &server,
            algorithm,
            quota,
            SyncMode::Reconcile,
            &format!("rec-{load}"),
            4,
        );
        tokio::time::sleep(INTERVAL * 2).await;
        let windows = 20;
        let admitted = drive(&server, &nodes, quota, load, windows).await;
        let counts = per_window(&admitted, quota.period(), windows);
        for (w, &c) in counts.iter().enumerate().skip(1) {
            assert!(
                (950..=1050).contains(&c),
                "{algorithm:?}: window {w} admitted {c} of 1000: {counts:?}"
            );
        }
        if algorithm == Algorithm::TokenBucket {
            // B + r·(t + I + Δ) + B + N, with Δ ≤ 50ms here.
            let rate = 1000.0 / 1_000_000.0;
            let bound = 1000.0 + rate * (INTERVAL.as_micros() as f64 + 50_000.0) + 1000.0 + 4.0;
            let excess = excess_over_rate(&admitted, rate);
            assert!(excess <= bound, "excess {excess} over the bound {bound}");
        } else {
            assert!(counts.iter().all(|&c| c <= 2 * 1000 + 4), "{counts:?}");
        }
        assert_eq!(nodes[0].1.stats().nodes, 4);
        stop(nodes).await;
    }
}

/// Lease, 4 nodes, saturating skewed load: never more than the quota's own bound across
/// all nodes, and at least 90% of L per window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_exceed_the_global_limit() {
    let server = server();
    for algorithm in [Algorithm::TokenBucket, Algorithm::SlidingWindow] {
        let quota = Quota::new(1000, Duration::from_millis(1000)).unwrap();
        let nodes = nodes(
            &server,
            algorithm,
            quota,
            SyncMode::Lease,
            &format!("lease-{}", algorithm.name()),
            4,
        );
        tokio::time::sleep(INTERVAL * 2).await;
        let windows = 20;
        let admitted = drive(&server, &nodes, quota, 4.0, windows).await;
        let counts = per_window(&admitted, quota.period(), windows);
        for (w, &c) in counts.iter().enumerate().skip(1) {
            assert!(
                c >= 900,
                "{algorithm:?}: window {w} admitted only {c}: {counts:?}"
            );
        }
        match algorithm {
            Algorithm::TokenBucket => {
                // burst + rate·(t + 2I): a lease is spent within two intervals of being
                // granted.
                let rate = 1000.0 / 1_000_000.0;
                let bound = 1000.0 + rate * 2.0 * INTERVAL.as_micros() as f64;
                let excess = excess_over_rate(&admitted, rate);
                assert!(excess <= bound, "excess {excess} over {bound}");
            }
            _ => {
                // At most the limit per window of Redis's clock (the windows above are
                // aligned to it).
                for (w, &c) in counts.iter().enumerate() {
                    assert!(
                        c <= 1000,
                        "{algorithm:?}: window {w} admitted {c}: {counts:?}"
                    );
                }
            }
        }
        stop(nodes).await;
    }
}

/// Redis dies mid-run and comes back on the same port: checks keep answering at local
/// speed, the fallback engages, and afterwards the global state includes what was
/// admitted during the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_survived_and_accounted() {
    let mut server = server();
    let quota = Quota::per_second(1000).unwrap();
    let (limiter, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(
            RedisSync::new(&server.url())
                .interval(INTERVAL)
                .prefix("outage")
                .fallback(Fallback::LocalShare),
        )
        .unwrap();
    tokio::time::sleep(INTERVAL * 3).await;
    assert!(handle.stats().syncs > 0);
    server.stop();
    let mut admitted_during = 0u64;
    let mut slowest = Duration::ZERO;
    let until = Instant::now() + Duration::from_millis(600);
    while Instant::now() < until {
        for _ in 0..5 {
            let t = Instant::now();
            admitted_during += u64::from(limiter.check("k").is_allowed());
            slowest = slowest.max(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let stats = handle.stats();
    assert!(stats.fallback_active, "{stats:?}");
    assert!(stats.errors > 0);
    assert!(admitted_during > 0, "LocalShare admitted nothing");
    // A local check is nanoseconds; a millisecond means it waited on something.
    assert!(
        slowest < Duration::from_millis(1),
        "a check took {slowest:?}"
    );

    server.restart().unwrap();
    let resumed_at = handle.stats().syncs;
    let mut waited = 0;
    while handle.stats().syncs <= resumed_at + 2 && waited < 100 {
        tokio::time::sleep(INTERVAL).await;
        waited += 1;
    }
    let stats = handle.stats();
    assert!(!stats.fallback_active, "{stats:?}");
    // The fresh Redis has been charged with the outage's consumption: its bucket for the
    // key is in debt.
    assert!(
        debt_us(&server, "outage:sync:tb:{k}").await > 0,
        "the outage's consumption was not applied"
    );
    handle.shutdown().await;
}

/// A node that stops heartbeating drops out of the others' node count within
/// `node_ttl + interval` (1 s + 1 interval by default at this interval).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_drops_out() {
    let server = server();
    let quota = Quota::per_second(100).unwrap();
    let mut nodes = nodes(
        &server,
        Algorithm::TokenBucket,
        quota,
        SyncMode::Reconcile,
        "loss",
        2,
    );
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(nodes[0].1.stats().nodes, 2);
    // Abort the second node's task without a goodbye, as a crash would.
    drop(nodes.pop());
    let lost_at = Instant::now();
    while nodes[0].1.stats().nodes != 1 {
        assert!(
            lost_at.elapsed() < Duration::from_secs(1) + INTERVAL * 4,
            "still counted after {:?}",
            lost_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop(nodes).await;
}

/// `shutdown` reports everything admitted locally before it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_flushes_pending_consumption() {
    let server = server();
    let quota = Quota::per_minute(1000).unwrap();
    let (limiter, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(
            RedisSync::new(&server.url())
                .interval(Duration::from_secs(60))
                .prefix("flush"),
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let admitted = (0..300).filter(|_| limiter.check("k").is_allowed()).count() as u64;
    assert_eq!(admitted, 300);
    handle.shutdown().await;
    let debt = debt_us(&server, "flush:sync:tb:{k}").await;
    // 300 tokens of 60ms each: the bucket owes 18s, less the moments since.
    assert!((17_000_000..=18_000_000).contains(&debt), "debt {debt}µs");
}

#[tokio::test]
async fn unsupported_setups_are_refused() {
    let quota = Quota::per_second(10).unwrap();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::LeakyBucket,
    ] {
        let err = RateLimiter::<String>::builder(quota)
            .algorithm(algorithm)
            .build_synced(RedisSync::new("redis://127.0.0.1:1/"))
            .unwrap_err();
        assert!(
            err.to_string().contains("token-bucket and sliding-window"),
            "{err}"
        );
    }
}

#[test]
fn starting_outside_a_runtime_is_an_error() {
    let err = RateLimiter::<String>::builder(Quota::per_second(10).unwrap())
        .build_synced(RedisSync::new("redis://127.0.0.1:1/"))
        .unwrap_err();
    assert_eq!(err, tollgate::ConfigError::NoRuntime);
}
