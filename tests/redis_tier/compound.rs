//! Several quotas on one key in the Redis tier (`RedisBuilder::also`): the decisions of
//! the in-process limiter with the same quotas, one script call per check, never a
//! partial consumption, exact under concurrency, and the settlements, resets and fail
//! modes on every quota.
#![cfg(feature = "redis")]

use std::time::Duration;

use redis::AsyncCommands;
use tollgate::clock::ManualClock;
use tollgate::redis::{FailMode, RedisError, RedisLimiter, scripts};
use tollgate::{Algorithm, RateLimiter};

use crate::redis::{Keeper, assert_reach, assert_same, server};

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::TokenBucket,
    Algorithm::SlidingWindow,
    Algorithm::FixedWindow,
];

/// A Redis limiter on `url` and an in-process one on the same clock, both holding every
/// key to all of `quotas`.
async fn pair(
    url: &str,
    algorithm: Algorithm,
    quotas: &[&str],
    clock: &ManualClock,
) -> (RedisLimiter, RateLimiter<String, ManualClock>) {
    let mut remote = RedisLimiter::builder(url, quotas[0].parse().unwrap())
        .algorithm(algorithm)
        .timeout(Duration::from_secs(2))
        .caller_clock(clock.clone());
    let mut local = RateLimiter::builder(quotas[0].parse().unwrap())
        .algorithm(algorithm)
        .clock(clock.clone());
    for quota in &quotas[1..] {
        remote = remote.also(quota.parse().unwrap());
        local = local.also(quota.parse().unwrap());
    }
    (remote.build().await.unwrap(), local.build().unwrap())
}

/// Random timelines of checks (costs 1 and 2), refunds and, for the token bucket,
/// charges, with two and three quotas, 1/s and 100,000/s among them: Redis decides each
/// step as the in-process limiter does (verdict, limit, remaining, reset and retry to
/// the microsecond, and the deciding quota).
#[tokio::test]
async fn several_quotas_decide_as_in_memory() {
    let server = server();
    let sets: [&[&str]; 4] = [
        &["5/s burst 3", "20/min burst 5"],
        &["1/s", "4/100ms burst 2", "30/h burst 4"],
        &["100000/s burst 50", "200/s burst 100", "1000/min"],
        &["20/min burst 5", "5/s burst 3"],
    ];
    let mut x = 0x51_7cc1_b727_220au64;
    let (mut denied_later, mut refused) = (0, 0);
    for algorithm in ALGORITHMS {
        for (set, quotas) in sets.iter().enumerate() {
            let (mut expired, mut steps) = (0, 0);
            let clock = ManualClock::new();
            let (remote, local) = pair(&server.url(), algorithm, quotas, &clock).await;
            let prefix = format!("{}-{set}", algorithm.name());
            let keys: Vec<String> = (0..3).map(|k| format!("{prefix}-{k}")).collect();
            let mut keeper = Keeper::new(&server).await;
            for step in 0..400 {
                crate::common::xorshift(&mut x);
                let drawn =
                    Duration::from_micros([0, 1, 17, 900, 45_000, 250_000][(x % 6) as usize]);
                clock.advance(drawn);
                let key = &keys[((x >> 8) % 3) as usize];
                let n = 1 + (x >> 16) % 2;
                let settle = algorithm == Algorithm::TokenBucket;
                let (r, l) = match (x >> 24) % 6 {
                    0 if settle => (
                        remote.charge(key, n * 3).await.unwrap(),
                        local.charge(key.as_str(), n * 3).unwrap(),
                    ),
                    // Every algorithm here gives units back.
                    1 => (
                        remote.refund(key, n).await.unwrap(),
                        local.refund(key.as_str(), n).unwrap(),
                    ),
                    _ => match (remote.check_n(key, n).await, local.check_n(key.as_str(), n)) {
                        (Ok(r), Ok(l)) => (r, l),
                        // A cost beyond the smallest capacity: the same refusal.
                        (Err(RedisError::InsufficientCapacity(r)), Err(l)) => {
                            assert_eq!((r.requested, r.capacity), (l.requested, l.capacity));
                            refused += 1;
                            continue;
                        }
                        other => panic!("{algorithm:?} {quotas:?} step {step}: {other:?}"),
                    },
                };
                let context =
                    format!("{algorithm:?} {quotas:?} step {step}: redis {r:?} local {l:?}");
                assert_same(&r, &l, &context);
                assert_eq!(r.policy(), l.policy(), "{context}");
                denied_later += usize::from(!r.is_allowed() && r.policy() > 0);
                steps += 1;
                expired += keeper.persist_for(&remote, &local, &keys).await;
            }
            // Steps whose key Redis expired in real time are not compared; a loaded
            // machine makes more of them (59 of 4,347 in one CI run).
            assert_reach(expired, steps, quotas, &format!("{algorithm:?} {quotas:?}"));
        }
    }
    // The timelines reach the later quotas' denies, not only the first's.
    assert!(
        denied_later >= 200,
        "{denied_later} denies by a later quota"
    );
    assert!(
        refused >= 50,
        "{refused} costs beyond the 1/s quota's burst"
    );
}

/// Every quota's Redis key, serialized (`DUMP`), or `None` where it does not exist.
async fn dumps(
    con: &mut redis::aio::MultiplexedConnection,
    keys: &[Vec<u8>],
) -> Vec<Option<Vec<u8>>> {
    let mut out = Vec::new();
    for key in keys {
        let dump: Option<Vec<u8>> = redis::cmd("DUMP").arg(key).query_async(con).await.unwrap();
        out.push(dump);
    }
    out
}

/// A check that one quota denies writes nothing to any quota, the ones that would have
/// admitted it included, whichever quota denies and whatever its cost; the admissions
/// before it wrote to every quota's key, all in one hash slot.
#[tokio::test]
async fn a_deny_consumes_from_no_quota() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        // The second quota denies the 4th unit; then the first denies a cost of 3 that the
        // second, refilled, would admit.
        let clock = ManualClock::new();
        clock.set_ns(1_000_000_000);
        let (remote, _) = pair(
            &server.url(),
            algorithm,
            &["10/s burst 10", "3/min"],
            &clock,
        )
        .await;
        let keys = remote.redis_keys("k");
        assert_eq!(keys.len(), 2);
        for _ in 0..3 {
            assert!(remote.check("k").await.unwrap().is_allowed());
        }
        let before = dumps(&mut con, &keys).await;
        assert!(
            before.iter().all(Option::is_some),
            "{algorithm:?}: both written"
        );
        let denied = remote.check("k").await.unwrap();
        assert!(!denied.is_allowed(), "{algorithm:?}");
        assert_eq!((denied.policy(), denied.limit()), (1, 3), "{algorithm:?}");
        assert_eq!(dumps(&mut con, &keys).await, before, "{algorithm:?}");

        // (Quotas whose keys live long in real time: Redis expires them by it.)
        let (other, _) = pair(&server.url(), algorithm, &["3/s", "100/min"], &clock).await;
        let keys = other.redis_keys("j");
        assert!(other.check_n("j", 2).await.unwrap().is_allowed());
        let before = dumps(&mut con, &keys).await;
        let denied = other.check_n("j", 2).await.unwrap();
        assert!(!denied.is_allowed(), "{algorithm:?}");
        assert_eq!(denied.policy(), 0, "{algorithm:?}");
        assert_eq!(dumps(&mut con, &keys).await, before, "{algorithm:?}");
        // A reset forgets every quota's state.
        other.reset("j").await.unwrap();
        assert_eq!(
            dumps(&mut con, &keys).await,
            vec![None, None],
            "{algorithm:?}"
        );
    }
}

/// The script calls the server ran since the last `CONFIG RESETSTAT`, those that failed
/// left out (a settlement's first `EVALSHA` finds no script, and its `EVAL` follows).
async fn script_calls(con: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            let field = |name: &str| {
                let value = l.split(&format!("{name}=")).nth(1)?;
                value.split(',').next()?.parse::<u64>().ok()
            };
            Some(field("calls")? - field("failed_calls").unwrap_or(0))
        })
        .sum()
}

/// Three quotas cost one round trip: one script call per check, admitted or denied,
/// and one per settlement.
#[tokio::test]
async fn three_quotas_take_one_script_call() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        let clock = ManualClock::new();
        let remote = RedisLimiter::builder(&server.url(), "5/s".parse().unwrap())
            .algorithm(algorithm)
            .also("8/min".parse().unwrap())
            .also("100/h".parse().unwrap())
            .caller_clock(clock.clone())
            .local_deny_cache(false)
            .build()
            .await
            .unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut con)
            .await
            .unwrap();
        let mut admitted = 0;
        for _ in 0..20 {
            admitted += u64::from(remote.check("one-call").await.unwrap().is_allowed());
        }
        assert_eq!(admitted, 5, "{algorithm:?}");
        let mut calls = 20;
        if algorithm == Algorithm::TokenBucket {
            remote.refund("one-call", 2).await.unwrap();
            remote.charge("one-call", 1).await.unwrap();
            calls += 2;
        }
        assert_eq!(script_calls(&mut con).await, calls, "{algorithm:?}");
    }
}

/// From 2 threads, 200 concurrent checks of one key on a frozen clock admit exactly the
/// smallest quota's capacity, whichever quota it is: never more than any single quota
/// allows, and nothing lost to checks that another quota denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_admit_exactly_the_tightest_quota() {
    let server = server();
    for algorithm in ALGORITHMS {
        for (quotas, expected) in [
            (["100/s burst 40", "25/min"], 25u64),
            (["10/s burst 10", "1000/min"], 10),
            (["100000/s burst 60", "60/min"], 60),
        ] {
            let clock = ManualClock::new();
            let (remote, _) = pair(&server.url(), algorithm, &quotas, &clock).await;
            let key = format!("contended-{expected}");
            let tasks: Vec<_> = (0..200)
                .map(|_| {
                    let (remote, key) = (remote.clone(), key.clone());
                    tokio::spawn(async move { remote.check(&key).await.unwrap() })
                })
                .collect();
            let mut admitted = 0;
            for task in tasks {
                admitted += u64::from(task.await.unwrap().is_allowed());
            }
            assert_eq!(admitted, expected, "{algorithm:?} {quotas:?}");
        }
    }
}

/// The scripts refuse a further quota's bad arguments, and a settlement whose debt only
/// a later quota cannot hold, before writing anything to any key.
#[tokio::test]
async fn the_scripts_check_every_quota_before_writing() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    let keys = ["bad-1", "bad-2"];
    let cases: [(&str, &[&str]); 10] = [
        // T, tau, cost, now, then T₂, tau₂: tau₂ not a multiple of T₂, T₂ of 0, one missing.
        (
            scripts::TOKEN_BUCKET,
            &["100000", "100000", "1", "0", "1000", "1500"],
        ),
        (
            scripts::TOKEN_BUCKET,
            &["100000", "100000", "1", "", "0", "0"],
        ),
        (
            scripts::TOKEN_BUCKET,
            &["100000", "100000", "1", "0", "1000"],
        ),
        // A cost beyond the second quota's burst (1).
        (
            scripts::TOKEN_BUCKET,
            &["100000", "100000", "2", "0", "1000", "0"],
        ),
        // T, tau, the settlement, now, then T₂, tau₂: a debt that only the second cannot
        // hold.
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["1", "0", "c1000", "0", "9007199254740", "0"],
        ),
        // limit, period, cost, now, then limit₂, period₂.
        (
            scripts::SLIDING_WINDOW,
            &["10", "1000000", "1", "0", "-1", "1000000"],
        ),
        (
            scripts::FIXED_WINDOW,
            &["10", "1000000", "3", "", "2", "1000000"],
        ),
        (scripts::FIXED_WINDOW, &["10", "1000000", "1", "0", "5"]),
        // A window refund ('r<n>') of a negative or unreadable amount.
        (
            scripts::SLIDING_WINDOW,
            &["10", "1000000", "r-1", "0", "5", "1000000"],
        ),
        (
            scripts::FIXED_WINDOW,
            &["10", "1000000", "rx", "", "5", "1000000"],
        ),
    ];
    for (script, args) in cases {
        let result: redis::RedisResult<redis::Value> = redis::Script::new(script)
            .key(&keys[..])
            .arg(args)
            .invoke_async(&mut con)
            .await;
        let err = result.expect_err(&format!("{args:?} accepted"));
        assert_eq!(err.code(), Some("TOLLGATE"), "{args:?}: {err}");
        let exists: u64 = con.exists(&keys[..]).await.unwrap();
        assert_eq!(exists, 0, "{args:?} wrote state");
    }
}

/// While Redis is down, `FailMode::LocalShare` holds each key to every quota's share
/// (one live node: the quotas themselves), all or nothing; `FailMode::Local` to the one
/// quota it names. Too large a cost for any quota is refused before any I/O.
#[tokio::test]
async fn fail_modes_and_capacity_cover_every_quota() {
    let mut server = server();
    let clock = ManualClock::new();
    let (remote, _) = pair(
        &server.url(),
        Algorithm::TokenBucket,
        &["10/s burst 10", "4/min"],
        &clock,
    )
    .await;
    assert_eq!(remote.capacity(), 4);
    assert_eq!(
        remote.quotas(),
        vec!["10/s burst 10".parse().unwrap(), "4/min".parse().unwrap()]
    );
    match remote.check_n("k", 5).await {
        Err(RedisError::InsufficientCapacity(e)) => assert_eq!(e.capacity, 4),
        other => panic!("{other:?}"),
    }
    server.stop();
    let mut admitted = 0;
    for _ in 0..10 {
        let d = remote.check_or("outage", FailMode::LocalShare).await;
        if d.is_allowed() {
            admitted += 1;
        } else {
            assert_eq!((d.policy(), d.limit()), (1, 4));
        }
    }
    assert_eq!(admitted, 4);
    let mut admitted = 0;
    for _ in 0..10 {
        let d = remote
            .check_or("outage", FailMode::Local("6/min".parse().unwrap()))
            .await;
        admitted += u64::from(d.is_allowed());
    }
    assert_eq!(admitted, 6);
}
