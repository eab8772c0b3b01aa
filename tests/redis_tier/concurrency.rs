//! `RedisConcurrencyLimiter` against a real `redis-server` on an ephemeral port: slots
//! held across limiters, two script calls per permit, leases that expire after a holder
//! dies (a process killed with `kill -9`), renewal, a rate decided with the slot, the
//! fail modes, and three processes that never hold more than the maximum (asserted from
//! the server's side).
#![cfg(feature = "redis")]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::redis::server;
use crate::redis_first_tier::script_calls;
use tollgate::redis::{PermitError, RedisConcurrencyLimiter};
use tollgate::{ConcurrencyError, FailMode, Quota};

/// Acquires `weight` slots of `key`, retrying every 10 ms until `deadline` (the
/// message names the last error).
async fn acquire_by(
    limiter: &RedisConcurrencyLimiter,
    key: &str,
    weight: u32,
    deadline: Instant,
) -> tollgate::redis::RedisPermit {
    loop {
        match limiter.try_acquire_n(key, weight).await {
            Ok(permit) => return permit,
            Err(e) => assert!(Instant::now() < deadline, "{e:?}: {:?}", limiter.stats()),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn full(e: &PermitError) -> bool {
    matches!(e, PermitError::Refused(ConcurrencyError::Full { .. }))
}

#[tokio::test]
async fn slots_are_held_across_limiters_and_each_permit_costs_two_calls() {
    let server = server();
    let build = || {
        RedisConcurrencyLimiter::builder(&server.url(), 2)
            .prefix("cc")
            .deny_cache(Duration::ZERO)
            .build()
    };
    let (a, b) = (build().await.unwrap(), build().await.unwrap());
    let before = script_calls(&server).await;
    let first = a.try_acquire("k").await.unwrap();
    first.release().await.unwrap();
    assert_eq!(script_calls(&server).await - before, 2, "acquire + release");

    let first = a.try_acquire("k").await.unwrap();
    let second = b.try_acquire("k").await.unwrap();
    let refused = a.try_acquire("k").await.unwrap_err();
    assert!(full(&refused), "{refused:?}");
    assert_eq!(
        refused.refusal(),
        Some(&ConcurrencyError::Full {
            in_flight: 2,
            max: 2
        })
    );
    assert_eq!(b.in_flight("k").await.unwrap(), (2, 2));
    // Weighted: all or nothing, and never beyond the maximum.
    let never = a.try_acquire_n("other", 3).await.unwrap_err();
    assert!(matches!(
        never,
        PermitError::Refused(ConcurrencyError::NeverFits { weight: 3, max: 2 })
    ));
    second.release().await.unwrap();
    let again = b.try_acquire("k").await.unwrap();
    drop((first, again));
    // Dropped permits are released in the background.
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.in_flight("k").await.unwrap().0 != 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The keys carry the key in a hash tag, and the secret never shows.
    assert_eq!(
        a.redis_keys("k"),
        [b"cc:cc:{k}".to_vec(), b"cc:ccw:{k}".to_vec()]
    );
    let stats = a.stats();
    assert_eq!((stats.acquired, stats.leases), (2, 0), "{stats:?}");
}

#[tokio::test]
async fn a_lease_outlives_its_holder_by_at_most_the_lease_and_is_renewed_while_held() {
    let server = server();
    let lease = Duration::from_millis(600);
    let build = || {
        RedisConcurrencyLimiter::builder(&server.url(), 1)
            .prefix("lease")
            .lease(lease)
            .deny_cache(Duration::ZERO)
            .build()
    };
    let holder = build().await.unwrap();
    let other = build().await.unwrap();
    // Held for three leases: the renewals keep it.
    let held = holder.try_acquire("k").await.unwrap();
    let until = Instant::now() + 3 * lease;
    while Instant::now() < until {
        assert!(full(&other.try_acquire("k").await.unwrap_err()));
        assert!(!held.is_lost());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The holder vanishes without releasing: its limiter (and so the renewal) stops,
    // and the permit is leaked, as a killed process would.
    let dropped_at = Instant::now();
    std::mem::forget(held);
    drop(holder);
    let permit = acquire_by(&other, "k", 1, dropped_at + 2 * lease).await;
    let freed = (permit, dropped_at.elapsed());
    // Within the lease of the last renewal (at most a third of it before the drop).
    assert!(
        freed.1 <= lease + Duration::from_millis(100),
        "{:?}",
        freed.1
    );
    assert!(freed.1 >= lease / 2, "freed after {:?}: too early", freed.1);
    freed.0.release().await.unwrap();
}

#[tokio::test]
async fn a_rate_and_a_slot_are_taken_both_or_neither() {
    let server = server();
    let limiter = RedisConcurrencyLimiter::builder(&server.url(), 1)
        .prefix("both")
        .rate(Quota::per_minute(2).unwrap())
        .deny_cache(Duration::ZERO)
        .build()
        .await
        .unwrap();
    let permit = limiter.try_acquire("k").await.unwrap();
    let decision = *permit.decision().unwrap();
    assert_eq!((decision.limit(), decision.remaining()), (2, 1));
    // Full: no unit of the rate is spent.
    assert!(full(&limiter.try_acquire("k").await.unwrap_err()));
    permit.release().await.unwrap();
    let permit = limiter.try_acquire("k").await.unwrap();
    assert_eq!(permit.decision().unwrap().remaining(), 0);
    permit.release().await.unwrap();
    // The rate is spent: refused, and no slot held.
    let denied = limiter.try_acquire("k").await.unwrap_err();
    let Some(ConcurrencyError::RateLimited(d)) = denied.refusal() else {
        panic!("{denied:?}")
    };
    assert!(d.retry_after().unwrap() > Duration::from_secs(20));
    assert_eq!(limiter.in_flight("k").await.unwrap().0, 0);
}

#[tokio::test]
async fn the_fail_modes_decide_while_redis_is_away_and_the_breaker_stops_the_calls() {
    let mut server = server();
    let build = |mode| {
        RedisConcurrencyLimiter::builder(&server.url(), 4)
            .prefix("fail")
            .timeout(Duration::from_millis(50))
            .lease(Duration::from_millis(300))
            .fail_mode(mode)
            .build()
    };
    let closed = build(FailMode::Closed).await.unwrap();
    let open = build(FailMode::Open).await.unwrap();
    let share = build(FailMode::LocalShare).await.unwrap();
    assert!(matches!(
        RedisConcurrencyLimiter::builder(&server.url(), 4)
            .fail_mode(FailMode::Local(Quota::per_second(1).unwrap()))
            .build()
            .await,
        Err(tollgate::redis::RedisError::Config(_))
    ));
    server.stop();
    assert!(matches!(
        closed.try_acquire("k").await,
        Err(PermitError::Redis(_))
    ));
    let unlimited = open.try_acquire("k").await.unwrap();
    assert!(!unlimited.is_lease());
    // Three limiters share the prefix: each may hold ⌊4 / 3⌋ = 1 in process.
    let local = share.try_acquire("k").await.unwrap();
    assert!(!local.is_lease());
    assert!(matches!(
        share.try_acquire("k").await,
        Err(PermitError::Refused(ConcurrencyError::Full { max: 1, .. }))
    ));
    drop(local);
    // The breaker opened after three failures: no call waits for Redis any more.
    for _ in 0..3 {
        let _ = closed.try_acquire("k").await;
    }
    let t = Instant::now();
    let e = closed.try_acquire("k").await.unwrap_err();
    assert!(t.elapsed() < Duration::from_millis(20), "{e:?}");
    assert!(matches!(
        e,
        PermitError::Redis(tollgate::redis::RedisError::CircuitOpen { .. })
    ));
    // Redis back: the probe closes the breaker, and leases are held there again.
    server.restart().unwrap();
    let permit = acquire_by(&closed, "k", 1, Instant::now() + Duration::from_secs(10)).await;
    assert!(permit.is_lease());
    permit.release().await.unwrap();
}

/// The deny cache: a key found full is refused in process for its hold, with no call,
/// and this process's own release lifts it.
#[tokio::test]
async fn a_full_key_is_refused_from_the_cache_until_a_slot_comes_back() {
    let server = server();
    let limiter = RedisConcurrencyLimiter::builder(&server.url(), 1)
        .prefix("cache")
        .deny_cache(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let permit = limiter.try_acquire("k").await.unwrap();
    assert!(full(&limiter.try_acquire("k").await.unwrap_err()));
    let before = script_calls(&server).await;
    for _ in 0..100 {
        assert!(full(&limiter.try_acquire("k").await.unwrap_err()));
    }
    assert_eq!(script_calls(&server).await, before);
    assert_eq!(limiter.stats().cached_denies, 100);
    permit.release().await.unwrap();
    limiter
        .try_acquire("k")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A process that holds `N` slots of `key` under `prefix` and never lets go: the child
/// side of the tests below, run as this test binary with `TOLLGATE_CC_HOLD` set.
#[tokio::test]
async fn holder_process() {
    let Ok(spec) = std::env::var("TOLLGATE_CC_HOLD") else {
        return;
    };
    let mut parts = spec.split(',');
    let (url, mode) = (parts.next().unwrap(), parts.next().unwrap());
    let limiter = RedisConcurrencyLimiter::builder(url, 3)
        .prefix("procs")
        .lease(Duration::from_millis(900))
        // Three processes and the watcher on two cores: a generous deadline.
        .timeout(Duration::from_millis(300))
        .deny_cache(Duration::ZERO)
        .build()
        .await
        .unwrap();
    if mode == "hold" {
        let permits: Vec<_> = (0..3)
            .map(|_| limiter.try_acquire("held"))
            .collect::<Vec<_>>();
        let mut held = Vec::new();
        for p in permits {
            held.push(p.await.unwrap());
        }
        println!("holding");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(held);
    } else {
        // Churn: acquire, hold a moment, release, for `mode` ms.
        let until = Instant::now() + Duration::from_millis(mode.parse().unwrap());
        let (mut admitted, mut failed) = (0u64, 0u64);
        while Instant::now() < until {
            match limiter.try_acquire("busy").await {
                Ok(permit) => {
                    admitted += 1;
                    tokio::time::sleep(Duration::from_micros(300)).await;
                    // A release that fails leaves the lease to expire: still safe.
                    failed += u64::from(permit.release().await.is_err());
                }
                Err(e) if full(&e) => {}
                Err(_) => failed += 1,
            }
        }
        println!("admitted {admitted} failed {failed}");
    }
}

fn spawn_holder(url: &str, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "concurrency::holder_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TOLLGATE_CC_HOLD", format!("{url},{mode}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Reads the child's stdout until a line with `prefix` (the test harness may print its
/// own words before it on the line), for at most 30 s; returns the line from `prefix` on.
fn wait_line(child: &mut Child, prefix: &'static str) -> String {
    use std::io::{BufRead, BufReader};
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Read to the end: a closed pipe would fail the child's next write.
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(at) = line.find(prefix) {
                let _ = tx.send(line[at..].to_owned());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("no `{prefix}` line from the child"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_with_sigkill_frees_its_slots_within_the_lease() {
    let server = server();
    let mut child = spawn_holder(&server.url(), "hold");
    wait_line(&mut child, "holding");
    let limiter = RedisConcurrencyLimiter::builder(&server.url(), 3)
        .prefix("procs")
        .deny_cache(Duration::ZERO)
        .build()
        .await
        .unwrap();
    // Held, and renewed, past its lease.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(full(&limiter.try_acquire("held").await.unwrap_err()));
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    child.wait().unwrap();
    let permit = acquire_by(&limiter, "held", 3, killed + Duration::from_secs(5)).await;
    let freed = (permit, killed.elapsed());
    assert!(freed.1 <= Duration::from_millis(900 + 100), "{:?}", freed.1);
    freed.0.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_never_hold_more_than_the_maximum() {
    let server = server();
    let mut children: Vec<Child> = (0..3)
        .map(|_| spawn_holder(&server.url(), "3000"))
        .collect();
    // Watched from the server's side while they churn: the weight held, never above 3.
    let mut connection = server.connection().await.unwrap();
    let started = Instant::now();
    let mut seen = 0;
    while started.elapsed() < Duration::from_millis(2500) {
        let held: Option<i64> = redis::cmd("HGET")
            .arg("procs:ccw:{busy}")
            .arg("*")
            .query_async(&mut connection)
            .await
            .unwrap();
        let held = held.unwrap_or(0);
        assert!((0..=3).contains(&held), "{held} held");
        seen = seen.max(held);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut admitted = 0;
    for child in &mut children {
        let line = wait_line(child, "admitted");
        let words: Vec<&str> = line.split(' ').collect();
        admitted += words[1].parse::<u64>().unwrap();
        // Calls that timed out under the load are tolerated (their leases expire), but
        // they must be rare.
        assert!(words[3].parse::<u64>().unwrap() < 20, "{line}");
        assert!(child.wait().unwrap().success());
    }
    // The script's own record of the most held at once, at every change.
    let peak: i64 = redis::cmd("HGET")
        .arg("procs:ccw:{busy}")
        .arg("^")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(peak, 3, "saturated, never above");
    assert_eq!(seen.min(3), seen);
    assert!(admitted > 100, "{admitted}");
    let held: Option<i64> = redis::cmd("HGET")
        .arg("procs:ccw:{busy}")
        .arg("*")
        .query_async(&mut connection)
        .await
        .unwrap();
    // Every slot released (or, for a release that timed out, expired).
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut held = held.unwrap_or(0);
    while held != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let limiter = RedisConcurrencyLimiter::builder(&server.url(), 3)
            .prefix("procs")
            .build()
            .await
            .unwrap();
        // An acquire gives expired leases back first.
        limiter
            .try_acquire("busy")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        held = limiter.in_flight("busy").await.unwrap().0.into();
    }
    assert_eq!(held, 0);
}

/// On a cluster: each key's two Redis keys share a slot, keys spread over the masters,
/// and the limit holds across two limiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_holds_the_limit_too() {
    let cluster = tollgate_testing::LocalCluster::start(3, 0, Duration::from_secs(2))
        .expect("these tests need redis-server (./scripts/test.sh installs it)");
    let urls = cluster.urls();
    let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
    let build = || {
        RedisConcurrencyLimiter::cluster_builder(&seeds, 2)
            .timeout(Duration::from_millis(500))
            .lease(Duration::from_secs(2))
            .deny_cache(Duration::ZERO)
            .build()
    };
    let (a, b) = (build().await.unwrap(), build().await.unwrap());
    let mut held = Vec::new();
    for key in 0..30 {
        let key = format!("user-{key}");
        held.push(a.try_acquire(&key).await.unwrap());
        held.push(b.try_acquire(&key).await.unwrap());
        assert!(full(&a.try_acquire(&key).await.unwrap_err()));
    }
    for permit in held {
        permit.release().await.unwrap();
    }
    assert_eq!(a.in_flight("user-7").await.unwrap().0, 0);
}

/// Behind Sentinel, the limit holds before and after a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_holds_the_limit_across_a_failover() {
    let mut sentinel = tollgate_testing::LocalSentinel::start(1, 3, Duration::from_millis(1000))
        .expect("these tests need redis-server and redis-sentinel");
    let addresses = sentinel.sentinel_addresses();
    let sentinels: Vec<&str> = addresses.iter().map(String::as_str).collect();
    let limiter = RedisConcurrencyLimiter::sentinel_builder(&sentinels, sentinel.master_name(), 1)
        .timeout(Duration::from_millis(500))
        .lease(Duration::from_secs(2))
        .deny_cache(Duration::ZERO)
        .build()
        .await
        .unwrap();
    let permit = limiter.try_acquire("k").await.unwrap();
    assert!(full(&limiter.try_acquire("k").await.unwrap_err()));
    permit.release().await.unwrap();
    let old = sentinel.kill_primary().unwrap();
    sentinel
        .wait_failover(old, Duration::from_secs(20))
        .unwrap();
    let permit = acquire_by(&limiter, "k", 1, Instant::now() + Duration::from_secs(20)).await;
    assert!(permit.is_lease());
    assert!(full(&limiter.try_acquire("k").await.unwrap_err()));
    permit.release().await.unwrap();
}

/// Sixteen limiters on one Redis race for one key, at the smallest maximum (1) and, with
/// weights, at a large one (100,000): never above it, and saturated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_limiters_never_exceed_the_smallest_or_largest_maximum() {
    let server = server();
    for (max, weight) in [(1u32, 1u32), (100_000, 25_000)] {
        let prefix = format!("sixteen{max}");
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let limiter = RedisConcurrencyLimiter::builder(&server.url(), max)
                .prefix(&prefix)
                .timeout(Duration::from_millis(500))
                .lease(Duration::from_secs(2))
                .deny_cache(Duration::ZERO)
                .build()
                .await
                .unwrap();
            tasks.push(tokio::spawn(async move {
                let until = Instant::now() + Duration::from_millis(800);
                let mut admitted = 0u32;
                while Instant::now() < until {
                    match limiter.try_acquire_n("k", weight).await {
                        Ok(permit) => {
                            admitted += 1;
                            tokio::task::yield_now().await;
                            permit.release().await.unwrap();
                        }
                        Err(e) => assert!(full(&e), "{e:?}"),
                    }
                }
                admitted
            }));
        }
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        let checker = RedisConcurrencyLimiter::builder(&server.url(), max)
            .prefix(&prefix)
            .build()
            .await
            .unwrap();
        let (held, peak) = checker.in_flight("k").await.unwrap();
        assert_eq!((held, peak), (0, max), "max {max}: admitted {admitted}");
    }
}

/// Redis paused (SIGSTOP) for longer than a lease: the holder's renewals fail, it is told
/// its lease may be lost, and once Redis is back the slot is free for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_longer_than_the_lease_loses_the_lease_and_says_so() {
    let server = server();
    let build = || {
        RedisConcurrencyLimiter::builder(&server.url(), 1)
            .prefix("pause")
            .timeout(Duration::from_millis(100))
            .lease(Duration::from_millis(600))
            .deny_cache(Duration::ZERO)
            .build()
    };
    let holder = build().await.unwrap();
    let other = build().await.unwrap();
    let permit = holder.try_acquire("k").await.unwrap();
    server.pause().unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(permit.is_lost(), "no renewal got through for a whole lease");
    server.resume().unwrap();
    let taken = acquire_by(&other, "k", 1, Instant::now() + Duration::from_secs(5)).await;
    // The old holder's release finds its lease gone, and takes nothing of the new one.
    permit.release().await.unwrap();
    assert_eq!(other.in_flight("k").await.unwrap().0, 1);
    assert!(holder.stats().leases_lost >= 1, "{:?}", holder.stats());
    taken.release().await.unwrap();
}

/// The permit and the limiter move between tasks and threads, as a request's state does.
#[test]
fn the_permit_and_the_limiter_are_send_and_static() {
    fn movable<T: Send + Sync + 'static>() {}
    movable::<tollgate::redis::RedisPermit>();
    movable::<RedisConcurrencyLimiter>();
    movable::<PermitError>();
}
