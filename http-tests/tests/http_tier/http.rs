//! The HTTP layer over real sockets: an axum app served on 127.0.0.1:0, spoken to with
//! plain HTTP/1.1 over TCP.

use crate::limiter;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::serve;
use axum::Router;
use axum::routing;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate::RateLimiter;
use tollgate::clock::ManualClock;
use tollgate::http::{
    ErrorBody, HeaderStyle, KeyExtractor, MissingKey, RateLimitLayer, RequestHead, key_fn,
};

/// A response as it came over the wire.
#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("<missing>", String::as_str)
    }
}

async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// The status of a GET with `headers`.
async fn status(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> u16 {
    get_with(addr, path, headers).await.status
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    get_with(addr, path, &[]).await
}

/// An app whose handler counts its calls.
fn app(layer: RateLimitLayer, calls: Arc<AtomicU64>) -> Router {
    Router::new()
        .route(
            "/",
            routing::get(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { "hello" }
            }),
        )
        .layer(layer)
}

#[tokio::test]
async fn headers_are_exact_on_allowed_and_denied_responses() {
    let (l, clock) = limiter("1/min");
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(app(RateLimitLayer::new(l), calls.clone())).await;

    let ok = get(addr, "/").await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.body, "hello");
    assert_eq!(ok.header("ratelimit-limit"), "1");
    assert_eq!(ok.header("ratelimit-remaining"), "0");
    assert_eq!(ok.header("ratelimit-reset"), "60");
    assert_eq!(ok.header("ratelimit-policy"), "\"default\";q=1;w=60");
    assert_eq!(ok.header("ratelimit"), "\"default\";r=0;t=60");
    assert_eq!(ok.header("retry-after"), "<missing>");

    clock.advance(Duration::from_millis(20_500));
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), "40", "39.5s rounds up");
    assert_eq!(denied.header("ratelimit-reset"), "40");
    assert_eq!(denied.header("ratelimit"), "\"default\";r=0;t=40");
    assert_eq!(denied.header("ratelimit-limit"), "1");
    assert_eq!(denied.header("content-type"), "application/json");
    assert_eq!(
        denied.body,
        r#"{"error":"rate_limit_exceeded","message":"Too many requests: retry in 40 seconds.","retry_after_seconds":40}"#
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the inner service ran for a denied request"
    );
}

#[tokio::test]
async fn sub_second_waits_say_one_second() {
    let (l, clock) = limiter("4/s burst 1");
    let addr = serve(app(RateLimitLayer::new(l), Arc::default())).await;
    assert_eq!(get(addr, "/").await.status, 200);
    clock.advance(Duration::from_millis(100));
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 429);
    assert_eq!(
        denied.header("retry-after"),
        "1",
        "a 150ms wait is never Retry-After: 0"
    );
    assert_eq!(denied.header("ratelimit"), "\"default\";r=0;t=1");
    assert!(denied.body.contains(r#""retry_after_seconds":1"#));
}

#[tokio::test]
async fn header_styles_policy_name_and_problem_json() {
    let (l, _) = limiter("1/s");
    let layer = RateLimitLayer::new(l)
        .headers(HeaderStyle::Ietf)
        .policy_name("per-ip")
        .error_body(ErrorBody::ProblemJson);
    let addr = serve(app(layer, Arc::default())).await;
    let ok = get(addr, "/").await;
    assert_eq!(ok.header("ratelimit-limit"), "<missing>");
    assert_eq!(ok.header("ratelimit-policy"), "\"per-ip\";q=1;w=1");
    let denied = get(addr, "/").await;
    assert_eq!(denied.header("content-type"), "application/problem+json");
    for field in [
        r#""title":"Too Many Requests""#,
        r#""status":429"#,
        r#""type":"https://"#,
        r#""detail":"Too many requests"#,
    ] {
        assert!(denied.body.contains(field), "{} lacks {field}", denied.body);
    }

    let (l, _) = limiter("1/s");
    let addr = serve(app(
        RateLimitLayer::new(l).headers(HeaderStyle::Legacy),
        Arc::default(),
    ))
    .await;
    let ok = get(addr, "/").await;
    assert_eq!(ok.header("ratelimit-policy"), "<missing>");
    assert_eq!(ok.header("ratelimit-limit"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_admit_exactly_the_burst() {
    let (l, _) = limiter("5/s");
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(app(RateLimitLayer::new(l), calls.clone())).await;
    let tasks: Vec<_> = (0..200)
        .map(|_| tokio::spawn(async move { get(addr, "/").await.status }))
        .collect();
    let mut counts = HashMap::new();
    for task in tasks {
        *counts.entry(task.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(counts.get(&200), Some(&5));
    assert_eq!(counts.get(&429), Some(&195));
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn forwarding_headers_cannot_buy_fresh_buckets() {
    // No trusted proxy: the headers are ignored, every request is the peer's.
    let (l, _) = limiter("3/s");
    let addr = serve(app(
        RateLimitLayer::new(l).key(KeyExtractor::client_ip([])),
        Arc::default(),
    ))
    .await;
    for i in 0..3 {
        let xff = format!("203.0.113.{i}");
        assert_eq!(status(addr, "/", &[("x-forwarded-for", &xff)]).await, 200);
    }
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "198.51.100.99")]).await,
        429
    );

    // Behind a trusted proxy (the loopback peer), the rightmost untrusted hop is the
    // client, and what it wrote to the left of itself is ignored.
    let (l, _) = limiter("1/s");
    let layer =
        RateLimitLayer::new(l).key(KeyExtractor::client_ip(["127.0.0.0/8".parse().unwrap()]));
    let addr = serve(app(layer, Arc::default())).await;
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "198.51.100.1")]).await,
        200
    );
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "198.51.100.2")]).await,
        200
    );
    let forged = get_with(addr, "/", &[("x-forwarded-for", "6.6.6.6, 198.51.100.1")]).await;
    assert_eq!(
        forged.status, 429,
        "a forged leftmost entry bought a fresh bucket"
    );
    assert_eq!(
        status(addr, "/", &[("forwarded", "for=198.51.100.3")]).await,
        200
    );
}

#[tokio::test]
async fn ipv6_clients_in_one_64_share_a_bucket() {
    let (l, _) = limiter("1/s");
    let layer = RateLimitLayer::new(l).key(KeyExtractor::client_ip(["127.0.0.1".parse().unwrap()]));
    let addr = serve(app(layer, Arc::default())).await;
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "2001:db8:0:7::1")]).await,
        200
    );
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "2001:db8:0:7:ffff::2")]).await,
        429
    );
    assert_eq!(
        status(addr, "/", &[("x-forwarded-for", "[2001:db8:0:8::1]:443")]).await,
        200
    );
}

#[tokio::test]
async fn header_keys_and_the_missing_key_policy() {
    let (l, _) = limiter("1/s");
    let addr = serve(app(
        RateLimitLayer::new(l).key(KeyExtractor::header("x-api-key").unwrap()),
        Arc::default(),
    ))
    .await;
    assert_eq!(status(addr, "/", &[("x-api-key", "alpha")]).await, 200);
    assert_eq!(status(addr, "/", &[("x-api-key", "beta")]).await, 200);
    assert_eq!(status(addr, "/", &[("x-api-key", "alpha")]).await, 429);
    let missing = get(addr, "/").await;
    assert_eq!(missing.status, 400);
    assert!(
        missing.body.contains("rate_limit_key_missing"),
        "{}",
        missing.body
    );

    let (l, _) = limiter("1/s");
    let layer = RateLimitLayer::new(l)
        .key(KeyExtractor::header("x-api-key").unwrap())
        .on_missing_key(MissingKey::Shared("anonymous".into()));
    let addr = serve(app(layer, Arc::default())).await;
    assert_eq!(get(addr, "/").await.status, 200);
    assert_eq!(
        get(addr, "/").await.status,
        429,
        "keyless requests share one bucket"
    );
    assert_eq!(status(addr, "/", &[("x-api-key", "gamma")]).await, 200);
}

#[tokio::test]
async fn a_custom_key_closure() {
    let (l, _) = limiter("1/s");
    let key = key_fn(|head: &RequestHead<'_>| head.uri.path().split('/').nth(1).map(str::to_owned));
    let app = Router::new()
        .route("/{tenant}", routing::get(|| async { "hi" }))
        .layer(RateLimitLayer::keyed(l, key));
    let addr = serve(app).await;
    assert_eq!(get(addr, "/acme").await.status, 200);
    assert_eq!(get(addr, "/acme").await.status, 429);
    assert_eq!(get(addr, "/globex").await.status, 200);
}

/// A closure's text key passes the layer's key limits, as a header's does: an empty key
/// is missing, a long one is refused with a 400 (or, if the layer hashes long keys,
/// limited by its digest: two long keys that differ get two buckets).
#[tokio::test]
async fn a_closures_text_key_passes_the_key_limits() {
    use tollgate::http::OversizedKey;
    let by_path = || key_fn(|head: &RequestHead<'_>| Some(head.uri.path()[1..].to_owned()));
    let (l, _) = limiter("1/s");
    let route = || Router::new().route("/{tenant}", routing::get(|| async { "hi" }));
    let refuse = serve(
        route().layer(RateLimitLayer::keyed(l, by_path()).max_key_len(8, OversizedKey::Reject)),
    )
    .await;
    assert_eq!(get(refuse, "/acme").await.status, 200);
    let long = get(refuse, "/a-tenant-name-longer-than-eight").await;
    assert_eq!(long.status, 400);
    assert!(
        long.body.contains("rate_limit_key_too_long"),
        "{}",
        long.body
    );
    let (l, _) = limiter("1/s");
    let hash = serve(
        route()
            .layer(RateLimitLayer::keyed(l.clone(), by_path()).max_key_len(8, OversizedKey::Hash)),
    )
    .await;
    assert_eq!(
        get(hash, "/a-tenant-name-longer-than-eight").await.status,
        200
    );
    assert_eq!(
        get(hash, "/a-tenant-name-longer-than-eight").await.status,
        429
    );
    assert_eq!(
        get(hash, "/another-tenant-longer-than-eight").await.status,
        200
    );
    // Two keys held, neither longer than a digest.
    assert_eq!(l.len(), 2);
    assert_eq!(l.peek("a-tenant-name-longer-than-eight").remaining(), 1);
}

#[tokio::test]
async fn the_redis_tier_behind_the_layer() {
    use tollgate::redis::{FailMode, RedisLimiter};
    use tollgate_testing::LocalRedis;
    let server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let limiter = RedisLimiter::builder(&server.url(), "2/min".parse().unwrap())
        .build()
        .await
        .unwrap();
    let addr = serve(app(
        RateLimitLayer::redis(limiter, FailMode::Closed),
        Arc::default(),
    ))
    .await;
    assert_eq!(get(addr, "/").await.header("ratelimit-remaining"), "1");
    assert_eq!(get(addr, "/").await.status, 200);
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), "30");
}

/// A Redis limiter with plans behind the layer: one layer serves every plan, each
/// response's fields are its plan's (the key's plan from the resolver, or the request's
/// from `plan_from`), and the decisions are Redis's, shared by two servers.
#[tokio::test]
async fn one_redis_layer_serves_every_plan() {
    use tollgate::redis::{FailMode, RedisLimiter};
    use tollgate_testing::LocalRedis;

    let server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    // One clock that stands still: the windows' ends are whole minutes and hours away.
    let clock = ManualClock::new();
    let limiter = || {
        RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
            .caller_clock(clock.clone())
            .also("5/h".parse().unwrap())
            .algorithm(tollgate::Algorithm::FixedWindow)
            .default_plan("free")
            .plan("pro", ["3/min".parse().unwrap()])
            .plan_resolver(|key| key.starts_with("pro_").then(|| "pro".to_owned()))
            .build()
    };
    let key = || KeyExtractor::header("x-api-key").unwrap();
    let by_key = RateLimitLayer::redis(limiter().await.unwrap(), FailMode::Closed).key(key());
    let (a, b) = (
        serve(app(by_key.clone(), Arc::default())).await,
        serve(app(by_key, Arc::default())).await,
    );
    let pro = get_with(a, "/", &[("x-api-key", "pro_1")]).await;
    assert_eq!(pro.status, 200);
    assert_eq!(pro.header("ratelimit-policy"), "\"pro\";q=3;w=60");
    assert_eq!(pro.header("ratelimit"), "\"pro\";r=2;t=60");
    let free = get_with(b, "/", &[("x-api-key", "anon")]).await;
    assert_eq!(free.status, 200);
    assert_eq!(
        free.header("ratelimit-policy"),
        "\"free\";q=1;w=60, \"free+1\";q=5;w=3600"
    );
    // The other server shares the count in Redis.
    let denied = get_with(a, "/", &[("x-api-key", "anon")]).await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("ratelimit"), "\"free\";r=0;t=60");

    // The plan from the request, on another limiter of the same Redis.
    let by_request = RateLimitLayer::redis(limiter().await.unwrap(), FailMode::Closed).key(key());
    plans_from_the_request(by_request).await;
}

/// The layer runs on a synced limiter too (one trait takes all three limiters): two
/// servers, each with its own node of one lease-mode limit, answer requests over real
/// sockets, and together stay within the lease bound of `sync` (`B + r·H + 2·N + r·t`),
/// well below what two unshared limiters would admit (`2·B`). The bound itself is proven
/// on simulated time by the sync's simulation; this is its confirmation on real
/// processes, hence the wall clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_synced_nodes_behind_the_layer_hold_one_limit() {
    use std::time::Instant;
    use tollgate::sync::{RedisSync, SyncMode};
    use tollgate_testing::LocalRedis;
    const NODES: usize = 2;
    const BURST: f64 = 20.0;
    let interval = Duration::from_millis(50);
    let server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let mut addrs = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..NODES {
        let (limiter, handle) = RateLimiter::<String>::builder("20/min".parse().unwrap())
            .build_synced(
                RedisSync::new(&server.url())
                    .mode(SyncMode::Lease)
                    .interval(interval)
                    .allow_shared_prefix(true),
            )
            .unwrap();
        addrs.push(serve(app(RateLimitLayer::new(limiter), Arc::default())).await);
        handles.push(handle);
    }
    let (mut admitted, mut denied) = (0u64, 0u64);
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(2) {
        let reply = get(addrs[i % NODES], "/").await;
        i += 1;
        assert_eq!(reply.header("ratelimit-limit"), "20");
        match reply.status {
            200 => admitted += 1,
            429 => {
                denied += 1;
                let retry: u64 = reply.header("retry-after").parse().unwrap();
                assert!(retry >= 1, "a deny never says retry after 0");
            }
            other => panic!("unexpected status {other}"),
        }
        // Paces the requests over real time, across the real servers' sync.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The lease bound over the whole run: B + r·H + 2·N + r·t, H = 2·I.
    let rate = 20.0 / 60.0;
    let bound = BURST
        + rate * 2.0 * interval.as_secs_f64()
        + 2.0 * NODES as f64
        + rate * start.elapsed().as_secs_f64();
    assert!(
        admitted >= 1 && admitted as f64 <= bound,
        "admitted {admitted} (bound {bound:.2}), denied {denied}"
    );
    // Unshared, each node would have admitted its own burst: the bound is below that.
    assert!(bound < BURST * NODES as f64);
    assert!(denied > 0);
    for handle in handles {
        assert!(handle.stats().syncs > 0);
        handle.shutdown().await;
    }
}

/// The layer's Redis backend uses the local first tier: a flooding client is denied
/// from the deny cache (no Redis call until its retry instant), and with Redis killed
/// the insurance quota of `FailMode::Local` decides, the breaker open after three
/// failures — while the flooder stays denied by its cached deny.
#[tokio::test]
async fn the_redis_backend_caches_denies_and_falls_back_to_the_insurance_limit() {
    use tollgate::http::KeyExtractor;
    use tollgate::redis::{BreakerState, FailMode, RedisLimiter};
    use tollgate_testing::LocalRedis;
    let mut server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let limiter = RedisLimiter::builder(&server.url(), "2/min".parse().unwrap())
        .timeout(std::time::Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    let insurance = "3/min".parse().unwrap();
    let layer = RateLimitLayer::redis(limiter.clone(), FailMode::Local(insurance))
        .key(KeyExtractor::header("x-user").unwrap());
    let addr = serve(app(layer, Arc::default())).await;
    let as_user =
        |user: &'static str| async move { get_with(addr, "/", &[("x-user", user)]).await };
    for _ in 0..2 {
        assert_eq!(as_user("flooder").await.status, 200);
    }
    for _ in 0..50 {
        let denied = as_user("flooder").await;
        assert_eq!(denied.status, 429);
        assert!(denied.header("retry-after").parse::<u64>().unwrap() >= 29);
    }
    let stats = limiter.stats();
    assert_eq!(
        stats.calls, 2,
        "the second admission left nothing: {stats:?}"
    );
    assert_eq!(stats.cached_denies, 50);

    server.stop();
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(as_user("newcomer").await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
    assert_eq!(
        as_user("flooder").await.status,
        429,
        "still denied, from the cache"
    );
    let stats = limiter.stats();
    assert_eq!(stats.breaker, BreakerState::Open, "{stats:?}");
    assert_eq!(stats.fail_mode_decisions, 10);
    assert!(stats.short_circuited >= 7, "{stats:?}");
    assert_eq!(stats.cached_denies, 51);
}

/// The example server as a process, with the pinned flags.
mod server_binary {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};

    use super::*;

    /// Starts the server on a free port; returns it and its address.
    fn start(flags: &[&str]) -> (Child, SocketAddr) {
        let mut child = Command::new(tollgate_testing::example_server())
            .args(["--listen", "127.0.0.1:0"])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split("http://")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        (child, addr)
    }

    #[tokio::test]
    async fn limits_the_api_and_not_the_health_check() {
        let (mut child, addr) = start(&[
            "--quota",
            "2/min",
            "--algorithm",
            "sliding-window",
            "--headers",
            "legacy",
        ]);
        assert_eq!(get(addr, "/").await.status, 200);
        let api = get(addr, "/api/users/7").await;
        assert_eq!(api.status, 200);
        assert_eq!(api.body, r#"{"path":"users/7"}"#);
        assert_eq!(api.header("ratelimit-remaining"), "0");
        assert_eq!(api.header("ratelimit"), "<missing>");
        assert_eq!(get(addr, "/api/x").await.status, 429);
        for _ in 0..5 {
            assert_eq!(get(addr, "/healthz").await.status, 200);
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[tokio::test]
    async fn keys_by_header_and_trusts_only_configured_proxies() {
        let (mut child, addr) = start(&["--quota", "1/min", "--key", "header:x-api-key"]);
        assert_eq!(status(addr, "/", &[("x-api-key", "a")]).await, 200);
        assert_eq!(status(addr, "/", &[("x-api-key", "b")]).await, 200);
        assert_eq!(status(addr, "/", &[("x-api-key", "a")]).await, 429);
        child.kill().unwrap();
        child.wait().unwrap();

        let (mut child, addr) = start(&[
            "--quota",
            "1/min",
            "--trusted-proxy",
            "127.0.0.0/8",
            "--trusted-proxy",
            "10.0.0.0/8",
        ]);
        assert_eq!(
            status(addr, "/", &[("x-forwarded-for", "198.51.100.1, 10.1.1.1")]).await,
            200
        );
        assert_eq!(
            status(addr, "/", &[("x-forwarded-for", "198.51.100.2")]).await,
            200
        );
        assert_eq!(
            status(addr, "/", &[("x-forwarded-for", "198.51.100.1")]).await,
            429
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn bad_flags_exit_with_2_and_say_why() {
        for (flags, says) in [
            (
                &["--quota", "ten/s"][..],
                "the limit \"ten\" is not a whole number",
            ),
            (&["--quota", "10/fortnight"][..], "unknown period unit"),
            (&["--algorithm", "gcra"][..], "unknown algorithm"),
            (&["--key", "cookie"][..], "invalid --key"),
            (&["--trusted-proxy", "10.0.0.0/99"][..], "prefix length"),
            (&["--headers", "fancy"][..], "invalid value 'fancy'"),
            (&["--sync-interval", "5 minutes"][..], "use ms or s"),
            (
                &[
                    "--redis",
                    "redis://127.0.0.1:1/",
                    "--algorithm",
                    "sliding-log",
                ][..],
                "cannot be leased out",
            ),
        ] {
            let out = Command::new(tollgate_testing::example_server())
                .args(flags)
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(2), "{flags:?}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains(says), "{flags:?}: {stderr}");
            assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
        }
    }
}

/// A calendar month's deny on January 31st at 23:00 UTC: `Retry-After` and the
/// `RateLimit` fields count to the month's end, 3,600 s away, not a rolling remainder;
/// the policy's `w` is the month's nominal length. Then a blocked key: 429 with the
/// block's end.
#[tokio::test]
async fn calendar_quotas_and_blocks_count_to_their_real_end() {
    let clock = ManualClock::at_unix(Duration::from_secs(1_738_364_400));
    let l: RateLimiter<String, ManualClock> =
        RateLimiter::builder("1/month calendar".parse().unwrap())
            .algorithm(tollgate::Algorithm::FixedWindow)
            .clock(clock.clone())
            .build()
            .unwrap();
    let addr = serve(app(RateLimitLayer::new(l.clone()), Arc::default())).await;
    let ok = get(addr, "/").await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.header("ratelimit-reset"), "3600");
    assert_eq!(ok.header("ratelimit"), "\"default\";r=0;t=3600");
    assert_eq!(ok.header("ratelimit-policy"), "\"default\";q=1;w=2629746");
    clock.advance(Duration::from_secs(600));
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), "3000");
    assert_eq!(denied.header("ratelimit"), "\"default\";r=0;t=3000");
    // February: admitted again; then an operator's block of 10 minutes.
    clock.advance(Duration::from_secs(3_000));
    assert_eq!(get(addr, "/").await.status, 200);
    let (blocking, _) = limiter("100/s");
    let addr = serve(app(RateLimitLayer::new(blocking.clone()), Arc::default())).await;
    blocking.block("127.0.0.1", Duration::from_secs(600));
    let blocked = get(addr, "/").await;
    assert_eq!(blocked.status, 429);
    assert_eq!(blocked.header("retry-after"), "600");
    assert!(blocking.unblock("127.0.0.1"));
    assert_eq!(get(addr, "/").await.status, 200);
}

/// A layer of plans over real requests: each key's plan from the plan book (a resolver,
/// then a live assignment) or from the request (an extension an authentication layer
/// set); `RateLimit-Policy` names the plan and lists its quotas; a deny waits for the
/// plan's own quota.
#[tokio::test]
async fn one_layer_serves_every_plan_with_its_own_fields() {
    use tollgate::plans::Plans;

    let plans: Plans<String, ManualClock> = Plans::builder("free")
        .plan("free", ["1/min".parse().unwrap(), "5/h".parse().unwrap()])
        .plan("pro", ["3/min".parse().unwrap()])
        .algorithm(tollgate::Algorithm::FixedWindow)
        .clock(ManualClock::new())
        .resolver(|key: &String| key.starts_with("pro_").then_some("pro"))
        .build()
        .unwrap();
    let key = || KeyExtractor::header("x-api-key").unwrap();
    let by_book = RateLimitLayer::keyed(plans.clone(), key());
    let addr = serve(app(by_book, Arc::default())).await;
    let pro = get_with(addr, "/", &[("x-api-key", "pro_1")]).await;
    assert_eq!(pro.status, 200);
    assert_eq!(pro.header("ratelimit-policy"), "\"pro\";q=3;w=60");
    assert_eq!(pro.header("ratelimit"), "\"pro\";r=2;t=60");
    let free = get_with(addr, "/", &[("x-api-key", "anon")]).await;
    assert_eq!(free.status, 200);
    assert_eq!(
        free.header("ratelimit-policy"),
        "\"free\";q=1;w=60, \"free+1\";q=5;w=3600"
    );
    let denied = get_with(addr, "/", &[("x-api-key", "anon")]).await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), "60");
    assert_eq!(denied.header("ratelimit"), "\"free\";r=0;t=60");
    // An upgrade, live: the next request is decided and named by the pro plan.
    plans.assign("anon", "pro").unwrap();
    let upgraded = get_with(addr, "/", &[("x-api-key", "anon")]).await;
    assert_eq!(upgraded.status, 200);
    assert_eq!(upgraded.header("ratelimit-policy"), "\"pro\";q=3;w=60");

    // The plan from the request: an authentication layer's extension, outside the
    // rate-limit layer; without it, the key's own plan.
    plans_from_the_request(RateLimitLayer::keyed(plans.clone(), key())).await;
}

/// What an authentication layer puts in each request's extensions.
#[derive(Clone)]
struct Account {
    plan: Arc<str>,
}

/// Serves `layer` (plans "free": 1/min and 5/h, and "pro": 3/min, keyed by
/// `x-api-key`) behind an authentication layer that puts the pro plan in the extensions
/// of requests with the pro token, takes each request's plan from there
/// (`plan_from`), and checks that a request with the token is held to pro whatever its
/// key's plan, and one without it to its key's own.
async fn plans_from_the_request(layer: RateLimitLayer<String, KeyExtractor>) {
    let by_request = layer.plan_from(|head: &RequestHead<'_>| {
        head.extensions.get::<Account>().map(|a| a.plan.clone())
    });
    let app = app(by_request, Arc::default()).layer(axum::middleware::map_request(
        |mut req: axum::extract::Request| async move {
            if req
                .headers()
                .get("authorization")
                .is_some_and(|v| v == "Bearer pro-token")
            {
                req.extensions_mut().insert(Account {
                    plan: Arc::from("pro"),
                });
            }
            req
        },
    ));
    let addr = serve(app).await;
    let headers = [("x-api-key", "k2"), ("authorization", "Bearer pro-token")];
    for remaining in [2, 1, 0] {
        let reply = get_with(addr, "/", &headers).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("ratelimit"),
            format!("\"pro\";r={remaining};t=60")
        );
    }
    assert_eq!(get_with(addr, "/", &headers).await.status, 429);
    let own = get_with(addr, "/", &[("x-api-key", "k3")]).await;
    assert_eq!(
        own.header("ratelimit-policy"),
        "\"free\";q=1;w=60, \"free+1\";q=5;w=3600"
    );
}
