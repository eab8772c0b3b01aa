//! The `metrics` facade sees exact totals: after concurrent checks from several threads,
//! with and without a `stats()` call, for evictions, sync rounds and Redis errors.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tollgate::clock::ManualClock;
use tollgate::redis::RedisLimiter;
use tollgate::sync::RedisSync;
use tollgate::{Quota, RateLimiter, WhenFull};
use tollgate_testing::LocalRedis;

/// The process's recorder: installed once, shared by the tests (each uses its own
/// limiter names).
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this test binary");
        snapshotter
    })
}

/// The recorder's snapshot, which also resets what it read: tests take one snapshot per
/// look and run one at a time.
struct Snap(Vec<(metrics_util::CompositeKey, DebugValue)>);

fn snap() -> Snap {
    Snap(
        snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| (key, value))
            .collect(),
    )
}

impl Snap {
    /// The value of metric `name` whose labels include all of `labels`, if recorded.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        self.0
            .iter()
            .find(|(key, _)| {
                let key = key.key();
                key.name() == name
                    && labels
                        .iter()
                        .all(|(l, v)| key.labels().any(|x| x.key() == *l && x.value() == *v))
            })
            .map(|(_, value)| value)
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        match self.value(name, labels)? {
            DebugValue::Counter(n) => Some(*n),
            other => panic!("{name} is not a counter: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        match self.value(name, labels)? {
            DebugValue::Gauge(g) => Some(g.into_inner()),
            other => panic!("{name} is not a gauge: {other:?}"),
        }
    }
}

fn snap_counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    snap().counter(name, labels).unwrap_or(0)
}

/// One test at a time: a snapshot resets what it reads, for every test.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[test]
fn decisions_from_many_threads_are_exact() {
    let _serial = SERIAL.blocking_lock();
    snapshotter();
    // 100 per minute and a still clock: exactly 100 of the 8,000 checks pass, whatever the
    // threads' interleaving.
    let limiter: RateLimiter<String, ManualClock> =
        RateLimiter::builder("100/min".parse::<Quota>().unwrap())
            .clock(ManualClock::new())
            .name("threads")
            .build()
            .unwrap();
    assert_eq!(limiter.name(), "threads");
    std::thread::scope(|s| {
        for t in 0..4 {
            let limiter = &limiter;
            s.spawn(move || {
                for i in 0..2_000 {
                    limiter.check(if i % 2 == 0 {
                        "shared"
                    } else {
                        ["a", "b", "c", "d"][t]
                    });
                }
            });
        }
    });
    let stats = limiter.stats();
    let snap = snap();
    assert_eq!(stats.allowed + stats.denied, 8_000);
    // "shared" admits 100; each of a..d admits 100 of its 1,000.
    assert_eq!(stats.allowed, 500);
    assert_eq!(stats.denied, 7_500);
    let limiter_is = [("limiter", "threads")];
    assert_eq!(
        snap.counter(
            "tollgate_decisions_total",
            &[limiter_is[0], ("outcome", "allowed")]
        ),
        Some(500)
    );
    assert_eq!(
        snap.counter(
            "tollgate_decisions_total",
            &[limiter_is[0], ("outcome", "denied")]
        ),
        Some(7_500)
    );
    assert_eq!(snap.gauge("tollgate_keys", &limiter_is), Some(5.0));
    // Counters off: nothing counted.
    let quiet: RateLimiter<String> = RateLimiter::builder("1/s".parse::<Quota>().unwrap())
        .counters(false)
        .name("quiet")
        .build()
        .unwrap();
    quiet.check("x");
    assert_eq!((quiet.stats().allowed, quiet.stats().denied), (0, 0));
}

#[test]
fn evictions_and_refusals_are_published() {
    let _serial = SERIAL.blocking_lock();
    snapshotter();
    let limiter: RateLimiter<u64> = RateLimiter::builder("10/s".parse::<Quota>().unwrap())
        .max_keys(2)
        .when_full(WhenFull::DenyNewKeys)
        .name("full")
        .build()
        .unwrap();
    for key in 0..5u64 {
        limiter.check(&key);
    }
    let stats = limiter.stats();
    let snap = snap();
    assert_eq!(stats.refused_new_keys, 3);
    assert_eq!(stats.denied, 3);
    assert_eq!(
        snap.counter(
            "tollgate_evictions_total",
            &[("limiter", "full"), ("reason", "refused")]
        ),
        Some(3)
    );
    assert_eq!(
        snap.counter(
            "tollgate_evictions_total",
            &[("limiter", "full"), ("reason", "active")]
        ),
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_are_published_every_second_without_a_call() {
    let _serial = SERIAL.lock().await;
    snapshotter();
    let limiter: RateLimiter<String> = RateLimiter::builder("1000/s".parse::<Quota>().unwrap())
        .name("periodic")
        .build()
        .unwrap();
    for i in 0..300 {
        limiter.check(&format!("k{}", i % 7));
    }
    let allowed = [("limiter", "periodic"), ("outcome", "allowed")];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let snap = snap();
        // Both from one publication: a snapshot taken while a publication runs may see
        // its counter and the previous one's gauge (the recorder reads each metric on
        // its own), so the next look must show both.
        let published = (
            snap.counter("tollgate_decisions_total", &allowed),
            snap.gauge("tollgate_keys", &[("limiter", "periodic")]),
        );
        if published == (Some(300), Some(7.0)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not published within 3 s: (decisions, keys) = {published:?}"
        );
        // Waits for the limiter's periodic publication, on its real-time schedule.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_rounds_and_redis_errors_are_published() {
    let _serial = SERIAL.lock().await;
    snapshotter();
    let mut server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let (limiter, handle) = RateLimiter::<String>::builder("100/s".parse::<Quota>().unwrap())
        .name("synced")
        .build_synced(
            RedisSync::new(&server.url())
                .interval(Duration::from_millis(50))
                .prefix("metrics-test"),
        )
        .unwrap();
    limiter.check("k");
    // Counters are reset by each snapshot: add up what the snapshots saw.
    let ok = [("limiter", "synced"), ("result", "ok")];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut rounds = 0;
    loop {
        // Waits for the sync task's rounds against the real Redis process.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let snap = snap();
        rounds += snap.counter("tollgate_sync_rounds_total", &ok).unwrap_or(0);
        if rounds >= 3 {
            assert_eq!(
                snap.gauge("tollgate_sync_nodes", &[("limiter", "synced")]),
                Some(1.0)
            );
            assert_eq!(
                snap.gauge("tollgate_sync_fallback", &[("limiter", "synced")]),
                Some(0.0)
            );
            assert!(matches!(
                snap.value("tollgate_sync_round_duration_seconds", &[("limiter", "synced")]),
                Some(DebugValue::Histogram(h)) if !h.is_empty()
            ));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{rounds} sync rounds counted"
        );
    }

    let redis = RedisLimiter::builder(&server.url(), "10/s".parse().unwrap())
        .name("tier")
        .timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    assert!(redis.check("k").await.is_ok());
    server.stop();
    assert!(redis.check("k").await.is_err());
    assert!(redis.check("k").await.is_err());
    let snap = snap();
    let errors: u64 = ["unavailable", "timeout"]
        .iter()
        .filter_map(|kind| {
            snap.counter(
                "tollgate_redis_errors_total",
                &[("limiter", "tier"), ("kind", kind)],
            )
        })
        .sum();
    assert_eq!(errors, 2);
    // The third failure opens the breaker: the gauge moves at once; then checks are
    // short-circuited, and `stats` publishes the totals.
    assert!(redis.check("k").await.is_err());
    let snap = self::snap();
    assert_eq!(
        snap.gauge("tollgate_redis_breaker_open", &[("limiter", "tier")]),
        Some(1.0)
    );
    for _ in 0..5 {
        assert!(matches!(
            redis.check("k").await,
            Err(tollgate::redis::RedisError::CircuitOpen { .. })
        ));
    }
    let stats = redis.stats();
    let snap = self::snap();
    let tier = [("limiter", "tier")];
    assert_eq!(stats.short_circuited, 5);
    assert_eq!(
        snap.counter("tollgate_redis_short_circuited_total", &tier),
        Some(5)
    );
    assert_eq!(snap.counter("tollgate_redis_calls_total", &tier), Some(4));
    assert_eq!(
        snap.counter("tollgate_redis_breaker_opened_total", &tier),
        Some(1)
    );
    assert_eq!(
        snap.counter("tollgate_redis_cached_denies_total", &tier),
        Some(0)
    );

    // Rounds now fail: counted as errors, and the node falls back in time.
    let error = [("limiter", "synced"), ("result", "error")];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut failed = snap
        .counter("tollgate_sync_rounds_total", &error)
        .unwrap_or(0);
    while failed < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed round counted"
        );
        // Waits for the sync task's rounds against the real Redis process.
        tokio::time::sleep(Duration::from_millis(50)).await;
        failed += snap_counter("tollgate_sync_rounds_total", &error);
    }
    drop(handle);
}

/// Sends one HTTP/1.1 GET with `headers` (raw bytes) to `addr` over a fresh connection:
/// the status and the body.
async fn raw_get(addr: std::net::SocketAddr, headers: &[(&str, &[u8])]) -> (u16, String) {
    let (status, _, body) = raw_get_head(addr, headers).await;
    (status, body)
}

/// Requests the HTTP layer answers with a 400 before deciding — no key, a key that is not
/// UTF-8, one over the maximum length — are counted as `tollgate_decisions_total` with
/// `outcome="rejected"` and their `reason`, reach the rejection hook, and the 400 names
/// what the layer looked for. (They were invisible: neither counted nor hooked.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_rejected_before_a_decision_are_counted_and_hooked() {
    use std::sync::{Arc, Mutex};
    use tollgate::http::{KeyExtractor, KeyRejection, RateLimitLayer};

    let _serial = SERIAL.lock().await;
    let _ = snap();
    let limiter: RateLimiter<String> = RateLimiter::builder("100/s".parse().unwrap())
        .name("rejecting")
        .build()
        .unwrap();
    let seen: Arc<Mutex<Vec<(KeyRejection, String)>>> = Arc::default();
    let hook = Arc::clone(&seen);
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hi" }))
        .layer(
            RateLimitLayer::new(limiter)
                .key(KeyExtractor::header("x-api-key").unwrap())
                .on_rejected(move |event| {
                    hook.lock()
                        .unwrap()
                        .push((event.rejection, event.looked_for.to_owned()));
                }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let (status, body) = raw_get(addr, &[]).await;
    assert_eq!(status, 400);
    assert!(
        body.contains("no rate-limit key: the server looks for the `x-api-key` header"),
        "{body}"
    );
    assert_eq!(raw_get(addr, &[("x-api-key", b"caf\xe9")]).await.0, 400);
    let long = "k".repeat(300);
    assert_eq!(
        raw_get(addr, &[("x-api-key", long.as_bytes())]).await.0,
        400
    );
    assert_eq!(raw_get(addr, &[("x-api-key", b"fine")]).await.0, 200);
    let (_, again) = raw_get(addr, &[]).await;
    assert_eq!(again, body);

    let snap = snap();
    for (reason, count) in [("missing_key", 2), ("invalid_key", 1), ("oversized_key", 1)] {
        assert_eq!(
            snap.counter(
                "tollgate_decisions_total",
                &[
                    ("limiter", "rejecting"),
                    ("outcome", "rejected"),
                    ("reason", reason)
                ]
            ),
            Some(count),
            "{reason}"
        );
    }
    let seen = seen.lock().unwrap();
    let reasons: Vec<&str> = seen.iter().map(|(r, _)| r.reason()).collect();
    assert_eq!(
        reasons,
        ["missing_key", "invalid_key", "oversized_key", "missing_key"]
    );
    assert!(
        seen.iter()
            .all(|(_, looked_for)| looked_for == "the `x-api-key` header")
    );
}

/// Shadow mode decides and reports as usual but never denies: over a real socket, every
/// request is served, the ones the limiter denied carry the deny's `RateLimit` fields
/// (and no `Retry-After`), the decision hook sees each of them with `shadow` set, and
/// they are counted as `outcome="shadow_denied"` while the limiter counts them `denied`.
/// At 1/s and at 100,000/s (burst 50), on a frozen clock so the counts are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_serves_denied_requests_and_counts_them() {
    use std::sync::{Arc, Mutex};
    use tollgate::http::{KeyExtractor, RateLimitLayer};

    let _serial = SERIAL.lock().await;
    for (quota, admitted) in [("1/s", 1u64), ("100000/s burst 50", 50)] {
        let _ = snap();
        let name = format!("shadow-{admitted}");
        let clock = ManualClock::new();
        let limiter: RateLimiter<String, ManualClock> =
            RateLimiter::builder(quota.parse().unwrap())
                .name(&name)
                .clock(clock.clone())
                .build()
                .unwrap();
        let seen: Arc<Mutex<Vec<(bool, bool)>>> = Arc::default();
        let hook = Arc::clone(&seen);
        let app = axum::Router::new()
            .route("/", axum::routing::get(|| async { "served" }))
            .layer(
                RateLimitLayer::keyed(limiter.clone(), KeyExtractor::header("x-api-key").unwrap())
                    .shadow(true)
                    .on_decision(move |event| {
                        hook.lock()
                            .unwrap()
                            .push((event.decision.is_allowed(), event.shadow));
                    }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let total = admitted + 7;
        for i in 0..total {
            let (status, head, body) = raw_get_head(addr, &[("x-api-key", b"k")]).await;
            assert_eq!(
                (status, body.as_str()),
                (200, "served"),
                "{quota}: request {i}"
            );
            let left = admitted.saturating_sub(i + 1);
            assert!(
                head.contains(&format!("ratelimit-remaining: {left}\r\n")),
                "{quota}: request {i}: {head}"
            );
            assert!(
                !head.contains("retry-after"),
                "{quota}: request {i}: {head}"
            );
        }
        let seen = seen.lock().unwrap().clone();
        let expected: Vec<(bool, bool)> =
            (0..total).map(|i| (i < admitted, i >= admitted)).collect();
        assert_eq!(
            seen, expected,
            "{quota}: the hook saw each decision, shadowed or not"
        );

        let stats = limiter.stats();
        assert_eq!((stats.allowed, stats.denied), (admitted, 7), "{quota}");
        let snap = snap();
        let count = |outcome| {
            snap.counter(
                "tollgate_decisions_total",
                &[("limiter", name.as_str()), ("outcome", outcome)],
            )
        };
        assert_eq!(count("shadow_denied"), Some(7), "{quota}");
        assert_eq!(count("denied"), Some(7), "{quota}");
        assert_eq!(count("allowed"), Some(admitted), "{quota}");
    }
}

/// [`raw_get`] with the response's head too (lower-cased).
async fn raw_get_head(
    addr: std::net::SocketAddr,
    headers: &[(&str, &[u8])],
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = b"GET / HTTP/1.1\r\nhost: test\r\nconnection: close\r\n".to_vec();
    for (name, value) in headers {
        request.extend_from_slice(name.as_bytes());
        request.extend_from_slice(b": ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    stream.write_all(&request).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response[9..12].parse().unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_ascii_lowercase(), body.to_owned())
}
