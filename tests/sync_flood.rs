//! A flood of 200,000 distinct keys through a synced limiter, in a process of its own so
//! that its resident memory is this test's alone.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use tollgate::sync::{RedisSync, SyncMode, SyncedLimiter};
use tollgate::{Quota, RateLimiter};
use tollgate_testing::LocalRedis;

/// Resident bytes of this process.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// Floods the limiter with 200,000 new keys and waits until the sync has served them all
/// and dropped them again; returns the peak resident bytes.
async fn flood_and_forget(
    limiter: &SyncedLimiter<String>,
    handle: &tollgate::sync::SyncHandle,
    round: u32,
) -> u64 {
    let keys_before = limiter.len();
    for k in 0..200_000u32 {
        let _ = limiter.check(&format!("flood-{round}-{k}"));
        if k % 10_000 == 0 {
            tokio::task::yield_now().await;
        }
    }
    assert!(limiter.len() >= 200_000, "{} keys", limiter.len());
    let mut peak = resident();
    // Every flooded key gets its round, in bounded rounds, and the sync never stops.
    let started = Instant::now();
    loop {
        let stats = handle.stats();
        assert!(!stats.task_died, "{stats:?}");
        assert!(stats.keys_last_round <= 2_000, "{stats:?}");
        if stats.keys_waiting == 0 && !stats.fallback_active {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "still behind: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(resident());
    }
    // The flooded keys go idle, give their leases back and are dropped.
    let ended = Instant::now();
    while limiter.len() > keys_before + 10 {
        assert!(
            ended.elapsed() < Duration::from_secs(30),
            "{} keys left: {:?}",
            limiter.len(),
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        peak = peak.max(resident());
    }
    peak
}

/// The sync never falls back for good: its rounds stay bounded (urgent keys first), every
/// flooded key gets its round, idle keys give their lease back and are dropped, and the
/// memory comes back: at least 70% of what the flood took, and a second flood leaves
/// almost nothing behind on top of the first (what stays is the allocator keeping freed
/// key strings for reuse, not a leak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_keys_is_absorbed_and_forgotten() {
    let server =
        LocalRedis::start().expect("this test needs redis-server (./scripts/test.sh installs it)");
    let (limiter, handle) = RateLimiter::<String>::builder(Quota::per_second(100).unwrap())
        .build_synced(
            RedisSync::new(&server.url())
                .mode(SyncMode::Lease)
                .interval(Duration::from_millis(50))
                .idle_ttl(Duration::from_secs(2))
                .prefix("flood"),
        )
        .unwrap();
    // A hot key, served throughout.
    let warm_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < warm_until {
        let _ = limiter.check("hot");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = resident();
    let peak = flood_and_forget(&limiter, &handle, 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = resident();
    let peak2 = flood_and_forget(&limiter, &handle, 2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after2 = resident();
    println!(
        "resident MB: before {:.1}, peak {:.1}, after {:.1}; second flood: peak {:.1}, after {:.1}",
        before as f64 / 1e6,
        peak as f64 / 1e6,
        after as f64 / 1e6,
        peak2 as f64 / 1e6,
        after2 as f64 / 1e6
    );
    assert!(
        handle.stats().keys_released >= 400_000,
        "{:?}",
        handle.stats()
    );
    // glibc keeps part of the freed memory in its per-thread arenas: 16–22% in runs
    // here, varying with which worker threads did the freeing. The leak check is the
    // second flood's, below.
    assert!(
        after - before <= (peak - before) * 3 / 10,
        "kept {} of the {} MB the flood took",
        (after - before) >> 20,
        (peak - before) >> 20
    );
    // A leak keeps part of each flood; the allocator's retention is noise of its own,
    // ±1.3 MB between the two floods in runs here, where 10% of `after` (1.1–1.6 MB)
    // failed 1 run in 4 with the same code. So the second flood may leave at most a
    // tenth of what it took (about 4.7 MB) on top of the first's; keeping a quarter of
    // the 400k keys it brought (their strings and cells) would exceed that.
    assert!(
        after2.saturating_sub(after) <= (peak2 - before) / 10,
        "{after2} after the second flood, {after} after the first, of {} it took",
        peak2 - before
    );
    // The hot key went idle too and was released: in lease mode its next request waits
    // for a lease, which the next round brings.
    let _ = limiter.check("hot");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(limiter.check("hot").is_allowed());
    handle.shutdown().await;
}
