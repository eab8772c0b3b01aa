//! The Redis tier against a real `redis-server` that each test starts on an ephemeral
//! port: decisions identical to the in-memory limiter, the usual Lua token bucket's flaws
//! gone, exact under concurrency, and typed errors instead of hangs.
#![cfg(feature = "redis")]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use tollgate::clock::{Clock, ManualClock};
use tollgate::redis::{DEFAULT_TIMEOUT, FailMode, RedisError, RedisLimiter, RedisOptions, scripts};
use tollgate::sync::RedisSync;
use tollgate::{Algorithm, Decision, RateLimiter};
use tollgate_testing::LocalRedis;

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::TokenBucket,
    Algorithm::SlidingWindow,
    Algorithm::FixedWindow,
];

pub(crate) fn server() -> LocalRedis {
    LocalRedis::start().expect("these tests need redis-server (./scripts/test.sh installs it)")
}

async fn limiter(
    server: &LocalRedis,
    algorithm: Algorithm,
    quota: &str,
    clock: impl Clock,
) -> RedisLimiter {
    RedisLimiter::builder(&server.url(), quota.parse().unwrap())
        .algorithm(algorithm)
        .timeout(Duration::from_secs(2))
        .caller_clock(clock)
        .build()
        .await
        .unwrap()
}

/// Rounds nanoseconds up to whole microseconds, the scripts' unit.
pub(crate) fn ceil_us(d: Duration) -> Duration {
    Duration::from_micros(d.as_nanos().div_ceil(1_000) as u64)
}

/// Asserts that Redis's decision `r` is the in-memory limiter's `l`: the same verdict,
/// limit and remaining, and the same reset and retry once `l`'s are rounded up to the
/// scripts' microseconds.
pub(crate) fn assert_same(r: &Decision, l: &Decision, context: &str) {
    assert_eq!(r.is_allowed(), l.is_allowed(), "{context}");
    assert_eq!(
        (r.limit(), r.remaining()),
        (l.limit(), l.remaining()),
        "{context}"
    );
    assert_eq!(r.reset_after(), ceil_us(l.reset_after()), "{context}");
    assert_eq!(r.retry_after(), l.retry_after().map(ceil_us), "{context}");
}

/// Keeps the keys of a differential on the caller's clock. Redis expires keys by their
/// TTL in real time, which a loaded machine stretches between two calls; the scripts read
/// an outdated state as the expired one (and `every_written_key_expires` checks the
/// TTLs), so the differential removes every TTL after each step and its timeline is the
/// caller's clock alone. A TTL of a millisecond can still end before that (a CI run
/// stalled longer between a check and the next call): `persist` says which keys Redis
/// expired, from its keyspace events, so that the test forgets them on the in-memory
/// side too, where both sides then start again from a full key.
pub(crate) struct Keeper {
    con: redis::aio::MultiplexedConnection,
    events: redis::aio::PubSub,
}

/// The channel that marks the end of a step's events.
const MARK: &str = "tollgate-test-mark";

impl Keeper {
    pub(crate) async fn new(server: &LocalRedis) -> Self {
        let mut con = server.connection().await.unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("Ex")
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        let client = redis::Client::open(server.url()).unwrap();
        let mut events = client.get_async_pubsub().await.unwrap();
        events.subscribe("__keyevent@0__:expired").await.unwrap();
        events.subscribe(MARK).await.unwrap();
        Self { con, events }
    }

    /// Removes every key's TTL, and returns the keys Redis expired since the last call.
    /// `watched` are read first (`EXISTS`): `KEYS` skips a key whose TTL has ended
    /// without deleting it, and a key is expired (and its event sent) only when it is
    /// read. Redis queues a subscriber's messages in order, so every expiry before the
    /// mark arrives before it.
    pub(crate) async fn persist(&mut self, watched: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let _: () = redis::Script::new(
            "for _, k in ipairs(KEYS) do redis.call('EXISTS', k) end \
             for _, k in ipairs(redis.call('KEYS', '*')) do redis.call('PERSIST', k) end",
        )
        .key(watched)
        .invoke_async(&mut self.con)
        .await
        .unwrap();
        let _: () = self.con.publish(MARK, "").await.unwrap();
        let mut expired = Vec::new();
        let mut messages = self.events.on_message();
        while let Some(message) = futures_util::StreamExt::next(&mut messages).await {
            if message.get_channel_name() == MARK {
                break;
            }
            expired.push(message.get_payload_bytes().to_vec());
        }
        expired
    }

    /// [`persist`](Self::persist), forgetting each of `keys` one of whose Redis keys
    /// (by `remote`, one per quota) expired on `local` and in `remote` (every quota's
    /// state, and the deny cache); returns how many Redis keys expired.
    pub(crate) async fn persist_for(
        &mut self,
        remote: &RedisLimiter,
        local: &RateLimiter<String, ManualClock>,
        keys: &[String],
    ) -> usize {
        let per_key: Vec<Vec<Vec<u8>>> = keys.iter().map(|k| remote.redis_keys(k)).collect();
        let watched: Vec<Vec<u8>> = per_key.iter().flatten().cloned().collect();
        let expired = self.persist(&watched).await;
        for (key, redis_keys) in keys.iter().zip(&per_key) {
            if redis_keys.iter().any(|k| expired.contains(k)) {
                local.reset(key.as_str());
                // And the deny cache, which may hold a deny from the lost state.
                remote.reset(key).await.unwrap();
            }
        }
        expired.len()
    }
}

/// Asserts that a differential's timeline kept its keys, so that it compared the states
/// it built rather than full keys: at most 2% of its `steps` lost one to real time where
/// every quota's interval is a millisecond or longer (a TTL that short then needs a
/// state within a millisecond of full; 1 of 400 steps with 8 busy loops beside the
/// test), and at most a quarter where one quota's is shorter (at 100,000/s every state's
/// TTL is about a millisecond; 26 to 30 of 400 steps with the same load).
pub(crate) fn assert_reach(expired: usize, steps: usize, quotas: &[&str], context: &str) {
    let shortest = quotas
        .iter()
        .map(|q| q.parse::<tollgate::Quota>().unwrap().emission_interval())
        .min()
        .unwrap();
    let allowed = if shortest >= Duration::from_millis(1) {
        steps / 50
    } else {
        steps / 4
    };
    assert!(
        expired <= allowed,
        "{context}: {expired} of {steps} steps lost a key to real time (at most {allowed})"
    );
}

/// A clock that can be moved backwards, as a skewed node's can.
#[derive(Clone, Default)]
struct SettableClock(Arc<AtomicU64>);

impl Clock for SettableClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The same random timelines through Redis (caller clock) and through the in-memory
/// limiter (`ManualClock`) give the same decisions; retry and reset agree once rounded
/// up to the scripts' microseconds.
#[tokio::test]
async fn decisions_equal_the_in_memory_limiter() {
    let server = server();
    // Quotas whose interval is a whole number of microseconds, the scripts' unit (the
    // Redis tier truncates T to microseconds, the local limiter to nanoseconds).
    let quotas = ["5/s burst 3", "10/s", "4/100ms burst 2", "20/min burst 5"];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut expired = 0;
    for algorithm in ALGORITHMS {
        for quota in quotas {
            let clock = ManualClock::new();
            let remote = limiter(&server, algorithm, quota, clock.clone()).await;
            let local: RateLimiter<String, ManualClock> =
                RateLimiter::builder(quota.parse().unwrap())
                    .algorithm(algorithm)
                    .clock(clock.clone())
                    .build()
                    .unwrap();
            let prefix = format!("{}-{quota}", algorithm.name());
            let keys: Vec<String> = (0..3).map(|k| format!("{prefix}-{k}")).collect();
            // Every key is kept after each step (see `Keeper`).
            let mut keeper = Keeper::new(&server).await;
            for step in 0..400 {
                crate::common::xorshift(&mut x);
                let drawn =
                    Duration::from_micros([0, 1, 17, 900, 45_000, 250_000][(x % 6) as usize]);
                clock.advance(drawn);
                let key = format!("{prefix}-{}", (x >> 8) % 3);
                let cost = 1 + (x >> 16) % 2;
                let (r, l) = (
                    remote.check_n(&key, cost).await.unwrap(),
                    local.check_n(key.as_str(), cost).unwrap(),
                );
                let context = format!("{algorithm:?} {quota} step {step}: redis {r:?} local {l:?}");
                assert_same(&r, &l, &context);
                expired += keeper.persist_for(&remote, &local, &keys).await;
            }
        }
    }
    // Nearly every step compares states that Redis kept.
    assert!(
        expired <= 48,
        "{expired} of 4,800 steps lost a key to real time"
    );
}

/// After any sequence of allows and denies, every key the scripts wrote has a TTL, and
/// it ends exactly when the key is untouched again.
#[tokio::test]
async fn every_written_key_expires() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        let clock = ManualClock::new();
        clock.set_ns(1_000_000_000);
        let l = limiter(&server, algorithm, "4/s burst 2", clock.clone()).await;
        for i in 0..200u64 {
            clock.advance(Duration::from_millis(i % 7 * 30));
            let d = l.check(&format!("ttl-{}", i % 5)).await.unwrap();
            let key = l.redis_key(&format!("ttl-{}", i % 5));
            let ttl: i64 = con.pttl(&key).await.unwrap();
            if d.is_allowed() {
                let expected = d.reset_after().as_millis() as i64;
                assert!(
                    ttl > 0 && ttl <= expected && ttl >= expected - 50,
                    "{algorithm:?}: ttl {ttl}ms, reset {expected}ms"
                );
            }
        }
        // Every key is listed, then asked its TTL: one written by an earlier algorithm's
        // run (real-time TTLs) may expire in between, and answers 0 (its last ms) or -2
        // (gone). Only -1 is a key without a TTL.
        let keys: Vec<Vec<u8>> = con.keys("tollgate:*").await.unwrap();
        for key in keys {
            let ttl: i64 = con.pttl(&key).await.unwrap();
            assert_ne!(
                ttl,
                -1,
                "{algorithm:?}: {} has no TTL",
                String::from_utf8_lossy(&key)
            );
        }
    }
}

#[tokio::test]
async fn a_deny_writes_nothing() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        let clock = ManualClock::new();
        let l = limiter(&server, algorithm, "2/s", clock.clone()).await;
        // A deny on a new key creates nothing.
        l.check_n("fresh", 2).await.unwrap();
        let key = l.redis_key("fresh");
        let before: Vec<u8> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut con)
            .await
            .unwrap();
        let ttl_before: i64 = con.pttl(&key).await.unwrap();
        clock.advance(Duration::from_millis(10));
        let d = l.check("fresh").await.unwrap();
        assert!(!d.is_allowed(), "{algorithm:?}");
        let after: Vec<u8> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut con)
            .await
            .unwrap();
        let ttl_after: i64 = con.pttl(&key).await.unwrap();
        assert_eq!(before, after, "{algorithm:?}: a deny changed the value");
        assert!(
            ttl_after <= ttl_before,
            "{algorithm:?}: a deny extended the TTL"
        );
        // A deny on a key that never existed writes nothing either.
        let l1 = limiter(&server, algorithm, "1/s", clock.clone()).await;
        assert!(l1.check_n("never", 2).await.is_err());
        let exists: bool = con.exists(l1.redis_key("never")).await.unwrap();
        assert!(!exists, "{algorithm:?}");
    }
}

#[tokio::test]
async fn a_clock_that_steps_back_mints_nothing() {
    let server = server();
    for algorithm in ALGORITHMS {
        let clock = SettableClock::default();
        clock.0.store(10_000_000_000, Ordering::SeqCst);
        let l = limiter(&server, algorithm, "5/s", clock.clone()).await;
        let admitted = async || {
            let mut n = 0;
            while l.check("skewed").await.unwrap().is_allowed() {
                n += 1;
            }
            n
        };
        assert_eq!(admitted().await, 5, "{algorithm:?}");
        // The node's clock jumps 3 seconds back, and then forward by less than a period.
        clock.0.store(7_000_000_000, Ordering::SeqCst);
        assert_eq!(
            admitted().await,
            0,
            "{algorithm:?}: a backwards step minted tokens"
        );
        // 100ms after the burst: no token is due (one every 200ms) and the window is the
        // same, so the step back must not have reopened anything.
        clock.0.store(10_100_000_000, Ordering::SeqCst);
        assert!(
            !l.check("skewed").await.unwrap().is_allowed(),
            "{algorithm:?}"
        );
    }
}

#[tokio::test]
async fn a_script_flush_mid_run_is_survived() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        let l = limiter(&server, algorithm, "3/s", ManualClock::new()).await;
        assert!(l.check("flush").await.unwrap().is_allowed());
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut con)
            .await
            .unwrap();
        let d = l.check("flush").await.unwrap();
        assert!(d.is_allowed(), "{algorithm:?}");
        assert_eq!(d.remaining(), 1, "{algorithm:?}: the state was lost");
    }
}

/// The scripts validate their own arguments: a negative, fractional or oversized cost
/// and a malformed quota are error replies, and nothing is written.
#[tokio::test]
async fn the_scripts_reject_bad_arguments() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    let cases: [(&str, &[&str]); 15] = [
        (scripts::TOKEN_BUCKET, &["100000", "100000", "-1", "0"]),
        // The settlements ('c<n>' or 'r<n>'): a mode that is neither, a negative or
        // fractional amount, an amount whose µs pass 2^52, a debt that would pass 2^53.
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["100000", "100000", "x1", "0"],
        ),
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["100000", "100000", "c-1", "0"],
        ),
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["100000", "100000", "r0.5", "0"],
        ),
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["100000", "100000", "c45035996274", "0"],
        ),
        (
            scripts::TOKEN_BUCKET_SETTLE,
            &["100000", "100000", "c1", "9007199254740000"],
        ),
        (scripts::TOKEN_BUCKET, &["100000", "100000", "1.5", "0"]),
        // Three units of a burst of 2.
        (scripts::TOKEN_BUCKET, &["100000", "100000", "3", "0"]),
        (scripts::TOKEN_BUCKET, &["0", "0", "1", "0"]),
        // tau is not a whole number of T.
        (scripts::TOKEN_BUCKET, &["100000", "5", "1", "0"]),
        (scripts::TOKEN_BUCKET, &["100000", "100000", "1", "-7"]),
        (scripts::SLIDING_WINDOW, &["10", "1000000", "-1", "0"]),
        (scripts::SLIDING_WINDOW, &["10", "1000000", "abc", "0"]),
        (scripts::FIXED_WINDOW, &["-3", "1000000", "1", "0"]),
        (scripts::FIXED_WINDOW, &["10", "1000000", "1", "-7"]),
    ];
    for (script, args) in cases {
        let result: redis::RedisResult<Vec<i64>> = redis::Script::new(script)
            .key("bad-args")
            .arg(args)
            .invoke_async(&mut con)
            .await;
        let err = result.expect_err(&format!("{args:?} accepted"));
        assert_eq!(err.code(), Some("TOLLGATE"), "{args:?}: {err}");
        let exists: bool = con.exists("bad-args").await.unwrap();
        assert!(!exists, "{args:?} wrote state");
    }
    // In Rust the cost is a u64; too large a cost is refused before any I/O.
    let l = limiter(
        &server,
        Algorithm::TokenBucket,
        "10/s burst 4",
        ManualClock::new(),
    )
    .await;
    assert!(matches!(
        l.check_n("k", 5).await,
        Err(RedisError::InsufficientCapacity(_))
    ));
}

#[tokio::test]
async fn configurations_the_scripts_cannot_run_are_refused() {
    let server = server();
    let build = |algorithm: Algorithm, quota: &str, prefix: &str| {
        RedisLimiter::builder(&server.url(), quota.parse().unwrap())
            .algorithm(algorithm)
            .prefix(prefix)
            .build()
    };
    for algorithm in [Algorithm::SlidingLog, Algorithm::LeakyBucket] {
        let err = build(algorithm, "1/s", "t").await.unwrap_err();
        assert!(matches!(err, RedisError::UnsupportedAlgorithm(_)), "{err}");
    }
    assert!(matches!(
        build(Algorithm::TokenBucket, "1/1500ns", "t").await,
        Err(RedisError::Config(_))
    ));
    assert!(matches!(
        build(Algorithm::TokenBucket, "1/s", "{t}").await,
        Err(RedisError::Config(_))
    ));
    let err = build(Algorithm::SlidingWindow, "16000000/1000d", "t")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("below 2^53"), "{err}");
}

/// Keys with spaces, braces, newlines and other bytes stay distinct and map to exactly
/// `<prefix>:<algorithm>:{<key>}`, with `}` written `%7D` and `%` written `%25` (so that
/// the hash tag is always the whole key).
#[tokio::test]
async fn arbitrary_keys_round_trip_without_collisions() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    let l = limiter(&server, Algorithm::TokenBucket, "1/min", ManualClock::new()).await;
    let keys = [
        "a b",
        "a}b",
        "{a}",
        "a\nb",
        "a\r\nSET x y",
        "",
        "ü 🦀",
        "a",
        "a{",
        "}",
        "a%7Db",
        "%",
    ];
    for key in keys {
        assert!(
            l.check(key).await.unwrap().is_allowed(),
            "{key:?} collided with an earlier key"
        );
        let escaped = key.replace('%', "%25").replace('}', "%7D");
        let expected = [b"tollgate:tb:{".as_slice(), escaped.as_bytes(), b"}"].concat();
        assert_eq!(l.redis_key(key), expected);
        let exists: bool = con.exists(&expected).await.unwrap();
        assert!(exists, "{key:?}");
    }
    for key in keys {
        assert!(!l.check(key).await.unwrap().is_allowed(), "{key:?}");
    }
    let stray: bool = con.exists("x").await.unwrap();
    assert!(!stray, "a key injected a command");
}

#[tokio::test]
async fn a_key_of_the_wrong_type_is_a_typed_error() {
    let server = server();
    let mut con = server.connection().await.unwrap();
    for algorithm in ALGORITHMS {
        let l = limiter(&server, algorithm, "1/s", ManualClock::new()).await;
        let key = l.redis_key("taken");
        let _: () = con.rpush(&key, "something else").await.unwrap();
        let err = l.check("taken").await.unwrap_err();
        assert!(
            matches!(&err, RedisError::WrongType { .. }),
            "{algorithm:?}: {err}"
        );
        assert!(err.to_string().contains("another type"));
    }
}

/// The error of an unreachable Redis, within the timeout (with ample slack for a loaded
/// machine) of `started`.
fn assert_failed_fast(err: &RedisError, started: Instant) {
    assert!(
        matches!(err, RedisError::Unavailable(_) | RedisError::Timeout(_)),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

/// Unreachable Redis, or one that dies mid-run, gives a typed error within the timeout
/// (with ample slack for a loaded machine) — never a hang — and the fail-open and
/// fail-closed policies answer without one.
#[tokio::test]
async fn an_outage_is_a_typed_error_not_a_hang() {
    let timeout = Duration::from_millis(50);
    let free_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let err = RedisLimiter::builder(
        &format!("redis://127.0.0.1:{free_port}/"),
        "1/s".parse().unwrap(),
    )
    .timeout(timeout)
    .build()
    .await
    .unwrap_err();
    assert_failed_fast(&err, started);

    let mut server = server();
    let l = RedisLimiter::builder(&server.url(), "5/s".parse().unwrap())
        .timeout(timeout)
        .build()
        .await
        .unwrap();
    assert!(l.check("k").await.unwrap().is_allowed());
    server.stop();
    for _ in 0..3 {
        let started = Instant::now();
        let err = l.check("k").await.unwrap_err();
        assert_failed_fast(&err, started);
    }
    assert!(l.check_or("k", FailMode::Open).await.is_allowed());
    let closed = l.check_or("k", FailMode::Closed).await;
    assert_eq!(closed.retry_after(), Some(Duration::from_millis(200)));

    // The connection manager reconnects by itself once Redis is back.
    server.restart().unwrap();
    let mut recovered = false;
    for _ in 0..100 {
        if let Ok(d) = l.check("k").await {
            recovered = d.is_allowed();
            break;
        }
        // Waits for the restarted Redis process to accept connections.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recovered, "never reconnected");
}

/// 32 concurrent tasks on one key admit exactly the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_admit_exactly_the_burst() {
    let server = server();
    for algorithm in ALGORITHMS {
        let l = limiter(&server, algorithm, "1/min burst 20", ManualClock::new()).await;
        let capacity = if algorithm == Algorithm::TokenBucket {
            20
        } else {
            1
        };
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move {
                    let mut admitted = 0;
                    for _ in 0..5 {
                        admitted += u32::from(l.check("hot").await.unwrap().is_allowed());
                    }
                    admitted
                })
            })
            .collect();
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        assert_eq!(total, capacity, "{algorithm:?}");
    }
}

/// Without a caller clock the scripts read the server's TIME.
#[tokio::test]
async fn server_time_is_the_default_clock() {
    let server = server();
    let l = RedisLimiter::builder(&server.url(), "2/s".parse().unwrap())
        .timeout(common::DECISION_TIMEOUT)
        .build()
        .await
        .unwrap();
    assert!(l.check("k").await.unwrap().is_allowed());
    assert!(l.check("k").await.unwrap().is_allowed());
    let d = l.check("k").await.unwrap();
    let wait = d.retry_after().unwrap();
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_millis(500),
        "{wait:?}"
    );
    assert_eq!(d.limit(), 2);
}

/// The slowest of `checks` concurrent checks of `l` (each must fail), and how many failed
/// with `Timeout`.
async fn slowest_failure(l: &RedisLimiter, checks: usize) -> (Duration, usize) {
    let tasks: Vec<_> = (0..checks)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let err = l.check(&format!("k{i}")).await.unwrap_err();
                (started.elapsed(), matches!(err, RedisError::Timeout(_)))
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    let mut timeouts = 0;
    for task in tasks {
        let (took, timeout) = task.await.unwrap();
        slowest = slowest.max(took);
        timeouts += usize::from(timeout);
    }
    (slowest, timeouts)
}

/// A paused Redis (SIGSTOP) and a killed one: every check, alone or 100 at once, fails
/// within its timeout plus 15 ms, for a 10 ms and for the default 50 ms timeout (plus, on
/// a loaded machine, the latest the runtime woke a task meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_comes_within_the_timeout() {
    let slack = Duration::from_millis(15);
    for timeout in [Duration::from_millis(10), DEFAULT_TIMEOUT] {
        let mut server = server();
        // Connected, with the script loaded: waits for the real server to answer within
        // the timeout (a loaded machine may miss 10 ms once), the first connection too.
        let deadline = Instant::now() + Duration::from_secs(10);
        let l =
            common::limiter_within(&server.url(), "5/s".parse().unwrap(), timeout, deadline).await;
        while !l.check("k").await.is_ok_and(|d| d.is_allowed()) {
            assert!(
                Instant::now() < deadline,
                "the server never answered in {timeout:?}"
            );
        }
        server.pause().unwrap();
        let lateness = common::Lateness::watch();
        for checks in [1, 1, 100] {
            let (slowest, timeouts) = slowest_failure(&l, checks).await;
            let late = lateness.worst();
            eprintln!(
                "paused, {timeout:?} timeout, {checks} at once: slowest {slowest:?}, runtime \
                 late by {late:?}"
            );
            assert_eq!(timeouts, checks);
            assert!(
                slowest < timeout + slack + late,
                "{slowest:?} for {timeout:?} (the runtime late by {late:?})"
            );
        }
        server.resume().unwrap();
        server.stop();
        for checks in [1, 100] {
            let (slowest, _) = slowest_failure(&l, checks).await;
            let late = lateness.worst();
            eprintln!(
                "killed, {timeout:?} timeout, {checks} at once: slowest {slowest:?}, runtime \
                 late by {late:?}"
            );
            assert!(
                slowest < timeout + slack + late,
                "{slowest:?} for {timeout:?} (the runtime late by {late:?})"
            );
        }
    }
}

/// One `RedisOptions` (prefix, timeout, hashed keys, a password) drives both tiers against
/// one Redis: the exact tier and a synced limiter both write under the prefix, both store
/// only the digest of the key, and neither shows the password or the secret.
#[tokio::test]
async fn one_options_value_configures_both_tiers() {
    let server = LocalRedis::start_with(&["--requirepass", "hunter2"]).unwrap();
    let url = format!("redis://:hunter2@127.0.0.1:{}/", server.port());
    let options = RedisOptions::new(&url)
        .prefix("shop")
        .timeout(Duration::from_secs(2))
        .hash_keys("a secret every node shares");
    let exact = RedisLimiter::builder_with(options.clone(), "2/min".parse().unwrap())
        .build()
        .await
        .unwrap();
    assert!(exact.check("api-key-1").await.unwrap().is_allowed());
    assert!(exact.check("api-key-1").await.unwrap().is_allowed());
    assert!(!exact.check("api-key-1").await.unwrap().is_allowed());
    let (synced, handle) = RateLimiter::<String>::builder("5/s".parse().unwrap())
        .build_synced(
            RedisSync::with_options(options.clone())
                .interval(Duration::from_millis(10))
                // Synced from its first use, so that the key reaches Redis.
                .cold_keys(false)
                .require_connection(true),
        )
        .unwrap();
    // A new key waits for its first lease, which the first round brings.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !synced.check("api-key-1").is_allowed() {
        assert!(Instant::now() < deadline, "{:?}", handle.stats());
        // Waits for the sync task's first round against the real Redis process.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its consumption reaches Redis with the next rounds.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut con = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys = loop {
        let keys: Vec<String> = con.keys("*").await.unwrap();
        if keys.iter().any(|k| k.starts_with("shop:sync:")) || Instant::now() > deadline {
            break keys;
        }
        // Waits for the sync task's round against the real Redis process.
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    handle.shutdown().await;
    assert!(
        keys.iter().any(|k| k.starts_with("shop:tb:{h:")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.starts_with("shop:sync:tb:{h:")),
        "{keys:?}"
    );
    for key in &keys {
        assert!(!key.contains("api-key"), "{key}");
        assert!(
            key.starts_with("shop:") || key.starts_with("{shop}:"),
            "{key}"
        );
    }
    let shown = format!("{options:?} {exact:?}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("secret"),
        "{shown}"
    );

    // Settings out of range are refused by both tiers, each in its own error.
    let zero = options.timeout(Duration::ZERO);
    let err = RedisLimiter::builder_with(zero.clone(), "1/s".parse().unwrap())
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("from 1ms to 1h"), "{err}");
    let err = RateLimiter::<String>::builder("1/s".parse().unwrap())
        .build_synced(RedisSync::with_options(zero))
        .unwrap_err();
    assert!(err.to_string().contains("from 1ms to 1h"), "{err}");
}

/// A failure's cause is readable without naming the Redis client's types: an error
/// reply's code (a server-side refusal such as `NOREPLICAS` is `Redis`), a connection's
/// failure (`Unavailable`), and the client's error as the source.
#[tokio::test]
async fn a_failures_cause_is_typed_and_its_source_is_the_clients_error() {
    use std::error::Error as _;
    let mut server = server();
    let l = RedisLimiter::builder(&server.url(), "5/s".parse().unwrap())
        .timeout(Duration::from_millis(200))
        .local_deny_cache(false)
        .circuit_breaker(tollgate::redis::CircuitBreaker::disabled())
        .build()
        .await
        .unwrap();
    // An error reply: Redis refuses writes under `min-replicas-to-write` with no replica.
    let mut con = server.connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg("1")
        .query_async(&mut con)
        .await
        .unwrap();
    let err = l.check("k").await.unwrap_err();
    let RedisError::Redis(cause) = &err else {
        panic!("an error reply is RedisError::Redis: {err:?}");
    };
    assert_eq!(cause.code(), Some("NOREPLICAS"), "{cause}");
    assert!(!cause.is_connection_failure());
    assert!(
        err.source().is_some_and(|s| s.source().is_some()),
        "{err:?}"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg("0")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(l.check("k").await.unwrap().is_allowed());

    // A connection that fails: Unavailable, with no error code.
    server.stop();
    let err = l.check("k").await.unwrap_err();
    match &err {
        RedisError::Unavailable(cause) => {
            assert!(cause.is_connection_failure(), "{cause:?}");
            assert_eq!(cause.code(), None);
        }
        RedisError::Timeout(_) => {}
        other => panic!("a stopped server is Unavailable or a Timeout: {other:?}"),
    }
}

/// Charges and refunds through Redis equal the in-memory limiter's, interleaved with
/// checks on random timelines: every decision the same, retry and reset once rounded
/// up to microseconds. From 1/s to 100,000/s.
///
/// At 100,000/s (T = 10 µs, burst 50) every state is at most about a millisecond from
/// full, and so is its TTL, which Redis counts in real time: a loaded machine lets some
/// pass before the `Keeper` persists the key (44 Redis keys in one CI run; in loaded
/// runs here, every lost key was the token bucket's at 100,000/s). Both sides then
/// forget the key, so the comparison stays exact; what a lost key costs is the test's
/// reach, which `assert_reach` holds each timeline to on its own.
/// `settlements_are_exact_at_100k_per_second` compares debts of a second or more at
/// 100,000/s with no key lost.
#[tokio::test]
async fn settlements_equal_the_in_memory_limiter() {
    let server = server();
    let quotas = ["1/s", "5/s burst 3", "20/min burst 5", "100000/s burst 50"];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut refunds = 0;
    for (algorithm, quota) in ALGORITHMS
        .into_iter()
        .flat_map(|a| quotas.map(move |q| (a, q)))
    {
        let (mut expired, mut steps) = (0, 0);
        let clock = ManualClock::new();
        let remote = limiter(&server, algorithm, quota, clock.clone()).await;
        let local: RateLimiter<String, ManualClock> = RateLimiter::builder(quota.parse().unwrap())
            .algorithm(algorithm)
            .clock(clock.clone())
            .build()
            .unwrap();
        let burst = local.capacity();
        let keys: Vec<String> = (0..2)
            .map(|k| format!("settle-{}-{quota}-{k}", algorithm.name()))
            .collect();
        let mut keeper = Keeper::new(&server).await;
        for step in 0..400 {
            crate::common::xorshift(&mut x);
            let drawn = Duration::from_micros([0, 1, 10, 900, 45_000, 250_000][(x % 6) as usize]);
            clock.advance(drawn);
            let key = keys[((x >> 8) % 2) as usize].clone();
            let n = (x >> 16) % (3 * burst.min(20) + 1);
            let (r, l) = match (x >> 24) % 4 {
                // The windows cannot hold a debt: a charge is refused on both tiers.
                0 if algorithm != Algorithm::TokenBucket => {
                    assert!(matches!(
                        remote.charge(&key, n).await,
                        Err(RedisError::UnsupportedAlgorithm(_))
                    ));
                    assert!(local.charge(key.as_str(), n).is_err());
                    continue;
                }
                0 => (
                    remote.charge(&key, n).await.unwrap(),
                    local.charge(key.as_str(), n).unwrap(),
                ),
                1 => {
                    refunds += 1;
                    (
                        remote.refund(&key, n).await.unwrap(),
                        local.refund(key.as_str(), n).unwrap(),
                    )
                }
                _ => {
                    let cost = 1 + (x >> 32) % burst.min(2);
                    (
                        remote.check_n(&key, cost).await.unwrap(),
                        local.check_n(key.as_str(), cost).unwrap(),
                    )
                }
            };
            let context = format!("{algorithm:?} {quota} step {step}: redis {r:?} local {l:?}");
            assert_same(&r, &l, &context);
            steps += 1;
            expired += keeper.persist_for(&remote, &local, &keys).await;
        }
        assert_reach(expired, steps, &[quota], &format!("{algorithm:?} {quota}"));
    }
    assert!(refunds >= 1_000, "{refunds} refunds");
}

/// At 100,000/s (T = 10 µs, burst 50), charges and refunds through Redis are exact to
/// the microsecond, with debts of a second or more, so that no TTL is short enough to
/// end in real time during the test.
#[tokio::test]
async fn settlements_are_exact_at_100k_per_second() {
    let server = server();
    let clock = ManualClock::new();
    let quota = "100000/s burst 50";
    let remote = limiter(&server, Algorithm::TokenBucket, quota, clock.clone()).await;
    let local: RateLimiter<String, ManualClock> = RateLimiter::builder(quota.parse().unwrap())
        .clock(clock.clone())
        .build()
        .unwrap();
    let steps: [(&str, u64, u64); 7] = [
        // (operation, units, µs to advance before it)
        ("charge", 100_000, 0),
        ("check", 1, 0),
        ("refund", 40_000, 100_000),
        ("check", 1, 1),
        ("charge", 250_000, 0),
        ("refund", 200_000, 300_000),
        ("check", 1, 0),
    ];
    for (i, (op, n, advance)) in steps.into_iter().enumerate() {
        clock.advance(Duration::from_micros(advance));
        let (r, l) = match op {
            "charge" => (
                remote.charge("edge", n).await.unwrap(),
                local.charge("edge", n).unwrap(),
            ),
            "refund" => (
                remote.refund("edge", n).await.unwrap(),
                local.refund("edge", n).unwrap(),
            ),
            _ => (remote.check("edge").await.unwrap(), local.check("edge")),
        };
        let context = format!("step {i} {op} {n}: redis {r:?} local {l:?}");
        assert_same(&r, &l, &context);
        // Every state stays at least 0.3 s of debt from full.
        assert!(r.reset_after() >= Duration::from_millis(300), "{context}");
    }
}

/// A refund on one node lets another node's cached deny of the key through at once (the
/// refund empties every node's deny cache); a charge on one node is seen by the other's
/// next call. The window counters refund the same way, and say they cannot be charged,
/// typed, before any call.
#[tokio::test]
async fn a_refund_reaches_every_nodes_deny_cache() {
    let server = server();
    let build = || async {
        RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap()
    };
    let (a, b) = (build().await, build().await);
    assert!(a.check("k").await.unwrap().is_allowed());
    for _ in 0..3 {
        assert!(!a.check("k").await.unwrap().is_allowed());
    }
    let cached = a.stats().cached_denies;
    assert!(!a.check("k").await.unwrap().is_allowed());
    assert!(a.stats().cached_denies > cached, "the deny was not cached");
    let back = b.refund("k", 1).await.unwrap();
    assert_eq!((back.is_allowed(), back.remaining()), (true, 1));
    // The message arrives within a round trip.
    let started = Instant::now();
    while !a.check("k").await.unwrap().is_allowed() {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a's cache kept the deny"
        );
        // Real time: the PUBLISH travels through the real server.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A charge on b puts the key into debt for both: a denies at once (its cache may
    // still hold the deny it learned from its admission, with the earlier wait), and
    // reports the debt's wait once b's message has emptied its cache.
    let debt = b.charge("k", 2).await.unwrap();
    assert!(!debt.is_allowed());
    let started = Instant::now();
    loop {
        let seen = a.check("k").await.unwrap();
        assert!(!seen.is_allowed());
        if seen.retry_after().unwrap() > Duration::from_secs(120) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a never saw the debt: {seen:?}"
        );
        // Real time: the PUBLISH travels through the real server.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The window counters cannot hold a debt (as in process), so a charge is refused,
    // typed, before any call; their refunds work, and reach every node's cache too.
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let build = || async {
            RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
                .algorithm(algorithm)
                .prefix("windows")
                .timeout(Duration::from_secs(2))
                .build()
                .await
                .unwrap()
        };
        let (a, b) = (build().await, build().await);
        let calls = a.stats().calls;
        assert!(matches!(
            a.charge("w", 1).await,
            Err(RedisError::UnsupportedAlgorithm(found)) if found == algorithm
        ));
        assert_eq!(a.stats().calls, calls, "{algorithm:?}: a call was made");
        assert!(a.check("w").await.unwrap().is_allowed());
        assert!(!a.check("w").await.unwrap().is_allowed());
        assert!(!a.check("w").await.unwrap().is_allowed());
        let back = b.refund("w", 1).await.unwrap();
        assert_eq!(
            (back.is_allowed(), back.remaining()),
            (true, 1),
            "{algorithm:?}"
        );
        let started = Instant::now();
        while !a.check("w").await.unwrap().is_allowed() {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{algorithm:?}: a's cache kept the deny"
            );
            // Real time: the PUBLISH travels through the real server.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The penalty box runs in the process only, for now: the sync refuses `block_for` at
/// build, typed, before connecting to anything (the URL below has no server), rather
/// than run without it. (Calendar quotas: see calendar.rs.)
#[tokio::test]
async fn blocks_are_refused_until_the_sync_carries_them() {
    let url = "redis://127.0.0.1:1";
    let monthly: tollgate::Quota = "10000/month calendar".parse().unwrap();
    let synced = RateLimiter::<String>::builder(monthly)
        .algorithm(Algorithm::FixedWindow)
        .build_synced(RedisSync::new(url))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(synced, tollgate::ConfigError::Unsupported(_)),
        "{synced:?}"
    );
    assert!(
        synced.to_string().contains("calendar periods in the sync"),
        "{synced}"
    );
    let blocking = RateLimiter::<String>::builder("10/s".parse().unwrap())
        .block_for(Duration::from_secs(60))
        .build_synced(RedisSync::new(url))
        .map(|_| ())
        .unwrap_err();
    assert!(blocking.to_string().contains("block_for"), "{blocking}");
}
