//! The layer with real servers and a real hyper client over sockets: composition with
//! tower-http, request-aware keys, exemptions, key checks, deny hooks, per-group
//! quotas and shaping.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::serve;
use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::routing;
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tollgate::clock::ManualClock;
use tollgate::http::{
    ExtractKey, KeyExtractor, KeyLimits, KeyRejection, MissingKey, OversizedKey, RateLimitLayer,
    RequestHead, key_fn,
};
use tollgate::{Algorithm, Quota, RateLimiter};
use tower::ServiceBuilder;
use tower_http::compression::CompressionLayer;
use tower_http::cors::CorsLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

/// A response as the hyper client got it.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map_or("<missing>", |v| v.to_str().unwrap_or("<not text>"))
    }

    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap_or("<not text>")
    }

    /// Asserts a 429 whose `RateLimit` field reports the policy `denied_by` exhausted
    /// (the field starts with `"<denied_by>";r=0;t=`).
    fn assert_denied_by(&self, denied_by: &str, context: &str) {
        assert_eq!(self.status, StatusCode::TOO_MANY_REQUESTS, "{context}");
        let field = self.header("ratelimit");
        assert!(
            field.starts_with(&format!("\"{denied_by}\";r=0;t=")),
            "{context}: {field}"
        );
    }
}

/// Sends `req` over a fresh HTTP/1.1 connection with hyper's client.
async fn send(addr: SocketAddr, req: http::Request<Full<Bytes>>) -> Reply {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let response = sender.send_request(req).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

fn request(method: Method, path: &str, headers: &[(&str, &[u8])]) -> http::Request<Full<Bytes>> {
    let mut builder = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "test");
    for (name, value) in headers {
        builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
    }
    builder.body(Full::new(Bytes::new())).unwrap()
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, request(Method::GET, path, &[])).await
}

async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &[u8])]) -> Reply {
    send(addr, request(Method::GET, path, headers)).await
}

fn limiter<K: tollgate::Key>(quota: &str) -> (RateLimiter<K, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let limiter = RateLimiter::builder(quota.parse::<Quota>().unwrap())
        .clock(clock.clone())
        .build()
        .unwrap();
    (limiter, clock)
}

/// A body long enough for the compression layer to compress.
fn long_body() -> String {
    "hello, compressed world. ".repeat(64)
}

#[tokio::test]
async fn composes_with_tower_http_layers_in_either_order() {
    // The limiter outside compression, then inside it, each with trace, timeout and CORS.
    for limiter_outside in [true, false] {
        let (l, _clock) = limiter::<String>("2/min");
        let layer = RateLimitLayer::new(l);
        let routes = Router::new().route("/", routing::get(|| async { long_body() }));
        let timeout =
            TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_secs(5));
        let app = if limiter_outside {
            routes.layer(
                ServiceBuilder::new()
                    .layer(layer)
                    .layer(CompressionLayer::new())
                    .layer(TraceLayer::new_for_http())
                    .layer(timeout)
                    .layer(CorsLayer::permissive()),
            )
        } else {
            routes.layer(
                ServiceBuilder::new()
                    .layer(TraceLayer::new_for_http())
                    .layer(CorsLayer::permissive())
                    .layer(CompressionLayer::new())
                    .layer(timeout)
                    .layer(layer),
            )
        };
        let addr = serve(app).await;
        let gzip: &[(&str, &[u8])] = &[
            ("accept-encoding", b"gzip"),
            ("origin", b"https://a.example"),
        ];
        for left in ["1", "0"] {
            let ok = get_with(addr, "/", gzip).await;
            assert_eq!(ok.status, 200, "outside: {limiter_outside}");
            assert_eq!(ok.header("content-encoding"), "gzip");
            assert_eq!(ok.header("ratelimit-remaining"), left);
            assert_eq!(ok.header("access-control-allow-origin"), "*");
            assert!(ok.body.len() < long_body().len(), "the body was compressed");
        }
        let denied = get_with(addr, "/", gzip).await;
        assert_eq!(denied.status, 429, "outside: {limiter_outside}");
        assert_eq!(
            denied.header("retry-after"),
            "30",
            "2/min: a slot every 30 s"
        );
        // Inside CORS, the 429 gets CORS headers too (so browsers can read it); outside,
        // the layer answers before CORS sees the request.
        let cors = if limiter_outside { "<missing>" } else { "*" };
        assert_eq!(denied.header("access-control-allow-origin"), cors);
        // A short JSON 429 is left uncompressed or compressed; either way it decodes.
        if denied.header("content-encoding") == "<missing>" {
            assert!(denied.text().contains("rate_limit_exceeded"));
        }
    }
}

/// Stands in for authentication middleware: stores the caller's user id.
#[derive(Clone, Copy)]
struct UserId(u64);

async fn authenticate(mut req: Request, next: Next) -> axum::response::Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("user "))
        .and_then(|id| id.parse().ok());
    if let Some(id) = user {
        req.extensions_mut().insert(UserId(id));
    }
    next.run(req).await
}

#[tokio::test]
async fn keys_come_from_extensions_and_may_be_any_type() {
    // A `u64`-keyed limiter, keyed by the id the middleware stored.
    let (l, _clock) = limiter::<u64>("2/min");
    let layer = RateLimitLayer::keyed(
        l,
        key_fn(|head: &RequestHead<'_>| head.extensions.get::<UserId>().map(|u| u.0)),
    );
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(layer)
        .layer(middleware::from_fn(authenticate));
    let addr = serve(app).await;
    let as_user = |id: &'static [u8]| [("authorization", id)];
    for _ in 0..2 {
        assert_eq!(get_with(addr, "/", &as_user(b"user 7")).await.status, 200);
    }
    assert_eq!(get_with(addr, "/", &as_user(b"user 7")).await.status, 429);
    // Another user has their own bucket; no user means no key: a 400.
    assert_eq!(get_with(addr, "/", &as_user(b"user 8")).await.status, 200);
    let anonymous = get(addr, "/").await;
    assert_eq!(anonymous.status, 400);
    assert!(anonymous.text().contains("rate_limit_key_missing"));
}

/// An extractor of our own: the peer address from axum's `ConnectInfo`, as a `SocketAddr`
/// key (so each connection's port is its own bucket).
#[derive(Clone)]
struct ByConnection;

impl ExtractKey<SocketAddr> for ByConnection {
    type Lookup = SocketAddr;
    type Key<'r> = SocketAddr;

    fn extract<B>(
        &self,
        req: &http::Request<B>,
        _: &KeyLimits,
    ) -> Result<SocketAddr, KeyRejection> {
        req.extensions()
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
            .map(|c| c.0)
            .ok_or(KeyRejection::Missing)
    }
}

#[tokio::test]
async fn a_user_extractor_sees_connect_info() {
    let (l, _clock) = limiter::<SocketAddr>("1/min");
    let probe = l.clone();
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(RateLimitLayer::keyed(l, ByConnection));
    let addr = serve(app).await;
    // Every request is a new connection, from a new port: a new bucket each time.
    for _ in 0..3 {
        assert_eq!(get(addr, "/").await.status, 200);
    }
    assert_eq!(probe.len(), 3);
}

#[tokio::test]
async fn exempt_requests_pass_unlimited_and_consume_nothing() {
    let (l, _clock) = limiter::<String>("1/min");
    let probe = l.clone();
    let app = Router::new()
        .route(
            "/",
            routing::get(|| async { "hi" }).options(|| async { "preflight" }),
        )
        .route("/healthz", routing::get(|| async { "ok" }))
        .route("/static/app.js", routing::get(|| async { "js" }))
        .route("/internal", routing::get(|| async { "internal" }))
        .layer(
            RateLimitLayer::new(l)
                .exempt_paths(["/healthz", "/static/*"])
                .exempt_methods([Method::OPTIONS])
                .exempt_if(|head: &RequestHead<'_>| head.headers.contains_key("x-internal")),
        );
    let addr = serve(app).await;
    for _ in 0..5 {
        let health = get(addr, "/healthz").await;
        assert_eq!(health.status, 200);
        assert_eq!(health.header("ratelimit-limit"), "<missing>");
        assert_eq!(get(addr, "/static/app.js").await.status, 200);
        assert_eq!(
            send(addr, request(Method::OPTIONS, "/", &[])).await.status,
            200
        );
        assert_eq!(
            get_with(addr, "/internal", &[("x-internal", b"1")])
                .await
                .status,
            200
        );
    }
    assert_eq!(probe.len(), 0, "no exempt request made a key");
    assert_eq!(get(addr, "/").await.status, 200);
    assert_eq!(get(addr, "/").await.status, 429);
    assert_eq!(
        get(addr, "/healthz").await.status,
        200,
        "still exempt once limited"
    );
}

#[tokio::test]
async fn networks_can_be_exempt_and_keyless_requests_allowed() {
    let (l, _clock) = limiter::<String>("1/min");
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(RateLimitLayer::new(l).exempt_networks(["127.0.0.0/8".parse().unwrap()]));
    let addr = serve(app).await;
    for _ in 0..3 {
        assert_eq!(get(addr, "/").await.status, 200);
    }

    let (l, _clock) = limiter::<String>("1/min");
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(
            RateLimitLayer::new(l)
                .key(KeyExtractor::header("x-api-key").unwrap())
                .on_missing_key(MissingKey::Allow),
        );
    let addr = serve(app).await;
    for _ in 0..3 {
        assert_eq!(get(addr, "/").await.status, 200, "keyless: allowed");
    }
    assert_eq!(
        get_with(addr, "/", &[("x-api-key", b"k")]).await.status,
        200
    );
    assert_eq!(
        get_with(addr, "/", &[("x-api-key", b"k")]).await.status,
        429
    );
}

#[tokio::test]
async fn keys_are_checked_for_utf8_and_length() {
    let (l, _clock) = limiter::<String>("1/min");
    let probe = l.clone();
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(RateLimitLayer::new(l).key(KeyExtractor::header("x-api-key").unwrap()));
    let addr = serve(app).await;

    let euro = get_with(addr, "/", &[("x-api-key", "€uro".as_bytes())]).await;
    assert_eq!(euro.status, 200, "UTF-8 beyond ASCII is a key");
    let latin1 = get_with(addr, "/", &[("x-api-key", b"caf\xe9")]).await;
    assert_eq!(latin1.status, 400);
    assert!(
        latin1.text().contains("rate_limit_key_not_utf8"),
        "{}",
        latin1.text()
    );
    let long = "k".repeat(257);
    let too_long = get_with(addr, "/", &[("x-api-key", long.as_bytes())]).await;
    assert_eq!(too_long.status, 400);
    assert!(too_long.text().contains("257 bytes"), "{}", too_long.text());
    let max = "k".repeat(256);
    assert_eq!(
        get_with(addr, "/", &[("x-api-key", max.as_bytes())])
            .await
            .status,
        200
    );
    assert_eq!(probe.len(), 2, "rejected keys are not stored");

    // Hashed instead: 1,500 distinct 16 KiB keys each get a bucket of a 35-byte key.
    let (l, _clock) = limiter::<String>("1/min");
    let probe = l.clone();
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(
            RateLimitLayer::new(l)
                .key(KeyExtractor::header("x-api-key").unwrap())
                .max_key_len(64, OversizedKey::Hash),
        );
    let addr = serve(app).await;
    let long_key = |i: usize| format!("{i:06}{}", "x".repeat(16 * 1024));
    for i in 0..1_500 {
        let reply = get_with(addr, "/", &[("x-api-key", long_key(i).as_bytes())]).await;
        assert_eq!(reply.status, 200, "key {i}");
    }
    assert_eq!(probe.len(), 1_500);
    let again = get_with(addr, "/", &[("x-api-key", long_key(0).as_bytes())]).await;
    assert_eq!(again.status, 429, "the same long key is the same bucket");
}

#[tokio::test]
async fn a_deny_hook_makes_the_response_and_the_layer_adds_its_headers() {
    let (l, _clock) = limiter::<String>("1/min");
    let app = Router::new()
        .route("/", routing::get(|| async { "hi" }))
        .layer(
            RateLimitLayer::new(l).on_deny(|decision, head: &RequestHead<'_>| {
                http::Response::builder()
                    .status(503)
                    .header("content-type", "text/plain")
                    .header("ratelimit-limit", "custom")
                    .body(Bytes::from(format!(
                        "slow down on {}: {} left",
                        head.uri.path(),
                        decision.remaining()
                    )))
                    .unwrap()
            }),
        );
    let addr = serve(app).await;
    assert_eq!(get(addr, "/").await.status, 200);
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 503);
    assert_eq!(denied.text(), "slow down on /: 0 left");
    assert_eq!(
        denied.header("ratelimit-limit"),
        "custom",
        "the hook's header wins"
    );
    assert_eq!(denied.header("retry-after"), "60");
    assert_eq!(denied.header("ratelimit-remaining"), "0");
}

#[tokio::test]
async fn per_group_quotas_leave_unknown_paths_alone() {
    let (public, _c1) = limiter::<String>("1/min");
    let (admin, _c2) = limiter::<String>("1/min");
    let (public_probe, admin_probe) = (public.clone(), admin.clone());
    let app = Router::new()
        .route("/public", routing::get(|| async { "public" }))
        .route_layer(RateLimitLayer::new(public))
        .merge(
            Router::new()
                .route("/admin", routing::get(|| async { "admin" }))
                .route_layer(RateLimitLayer::new(admin)),
        );
    let addr = serve(app).await;
    for _ in 0..5 {
        let missing = get(addr, "/nope").await;
        assert_eq!(missing.status, 404);
        assert_eq!(missing.header("ratelimit-limit"), "<missing>");
    }
    assert_eq!(
        public_probe.len() + admin_probe.len(),
        0,
        "404s consume nothing"
    );
    assert_eq!(get(addr, "/public").await.status, 200);
    assert_eq!(get(addr, "/admin").await.status, 200);
    assert_eq!(get(addr, "/public").await.status, 429);
}

#[tokio::test]
async fn shaping_spaces_leaky_bucket_requests_evenly() {
    // 10/s: a slot every 100 ms; a queue of five. Six requests at once: five are served
    // 100 ms apart, the sixth (500 ms away, past the 450 ms cap) is denied at once.
    let limiter: RateLimiter<String> = RateLimiter::builder("10/s burst 5".parse().unwrap())
        .algorithm(Algorithm::LeakyBucket)
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let counted = calls.clone();
    let app = Router::new()
        .route(
            "/",
            routing::get(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { "served" }
            }),
        )
        .layer(RateLimitLayer::new(limiter).shape(Duration::from_millis(450)));
    let addr = serve(app).await;
    let start = Instant::now();
    let replies = futures_join(addr, 6).await;
    let mut served: Vec<Duration> = replies
        .iter()
        .filter(|(status, _)| *status == 200)
        .map(|(_, at)| *at)
        .collect();
    served.sort();
    let denied: Vec<_> = replies.iter().filter(|(s, _)| *s == 429).collect();
    assert_eq!(served.len(), 5, "{replies:?}");
    assert_eq!(denied.len(), 1, "{replies:?}");
    assert!(
        denied[0].1 < Duration::from_millis(90),
        "the deny is not delayed: {replies:?}"
    );
    // The first is served at once; each next one a slot (100 ms) later.
    for (i, at) in served.iter().enumerate() {
        let due = Duration::from_millis(100 * i as u64);
        assert!(
            *at + Duration::from_millis(5) >= due && *at < due + Duration::from_millis(90),
            "request {i} served at {at:?}, due at {due:?} (all: {replies:?}, since {start:?})"
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

/// Sends `n` requests at once; returns each one's status and when it was answered.
async fn futures_join(addr: SocketAddr, n: usize) -> Vec<(u16, Duration)> {
    let start = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let reply = get(addr, "/").await;
                (reply.status.as_u16(), start.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

#[tokio::test]
async fn a_plain_hyper_server_is_limited_by_its_socket_address() {
    use hyper_util::service::TowerToHyperService;
    use tower::{Layer, ServiceExt};

    let (l, _clock) = limiter::<String>("2/min");
    let layer = RateLimitLayer::new(l);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.unwrap();
            // The handler's body is hyper's own `Full`; the peer is a `SocketAddr`
            // extension, as a hyper server records it.
            let handler = tower::service_fn(|_req: http::Request<hyper::body::Incoming>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                    Bytes::from_static(b"from hyper"),
                )))
            });
            let service = layer.layer(handler).map_request(
                move |mut req: http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(peer);
                    req
                },
            );
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service)),
            );
        }
    });
    for left in ["1", "0"] {
        let ok = get(addr, "/").await;
        assert_eq!(ok.status, 200);
        assert_eq!(ok.text(), "from hyper");
        assert_eq!(ok.header("ratelimit-remaining"), left);
    }
    let denied = get(addr, "/").await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), "30");
    assert!(denied.text().contains("rate_limit_exceeded"));
}

/// A key held to two quotas over a real socket: `RateLimit-Policy` lists both, `RateLimit`
/// and the legacy fields report the quota nearest exhaustion, and the 429 says which one
/// denied with its exact wait. At 1/s (burst 2) with 3/min, and at 100,000/s (burst 50)
/// with 60/min; in process, and at 1/s in Redis too (`RedisBuilder::also`). (In Redis a
/// key's TTL is its time to full by the caller's frozen clock, 0.5 ms at 100,000/s, which
/// real time ends between two requests; `compound::several_quotas_decide_as_in_memory`
/// holds the Redis tier to the in-process decisions at that rate, keeping its keys.)
#[tokio::test]
async fn two_quotas_are_named_in_the_headers_and_the_tighter_one_reports() {
    use tollgate::redis::{FailMode, RedisLimiter};
    let server = tollgate_testing::LocalRedis::start().unwrap();
    for ((first, second, burst, cap), redis) in [
        (("1/s burst 2", "3/min", 2u64, 3u64), false),
        (("1/s burst 2", "3/min", 2, 3), true),
        (("100000/s burst 50", "60/min", 50, 60), false),
    ] {
        let clock = ManualClock::new();
        let layer = if redis {
            let limiter = RedisLimiter::builder(&server.url(), first.parse().unwrap())
                .also(second.parse().unwrap())
                .prefix(&format!("headers-{burst}"))
                .caller_clock(clock.clone())
                .build()
                .await
                .unwrap();
            RateLimitLayer::redis(limiter, FailMode::Closed)
        } else {
            let limiter: RateLimiter<String, ManualClock> =
                RateLimiter::builder(first.parse().unwrap())
                    .also(second.parse().unwrap())
                    .clock(clock.clone())
                    .build()
                    .unwrap();
            RateLimitLayer::new(limiter)
        };
        let app = Router::new()
            .route("/", routing::get(|| async { "ok" }))
            .layer(
                layer
                    .key(KeyExtractor::header("x-api-key").unwrap())
                    .policy_names(["burst", "minute"]),
            );
        let addr = serve(app).await;
        let key: &[(&str, &[u8])] = &[("x-api-key", b"k")];
        let policy = format!("\"burst\";q={burst};w=1, \"minute\";q={cap};w=60");

        let first_reply = get_with(addr, "/", key).await;
        assert_eq!(first_reply.status, StatusCode::OK);
        assert_eq!(first_reply.header("ratelimit-policy"), policy);
        // After one request the burst has burst − 1 left, the minute cap − 1: the burst
        // is nearer exhaustion.
        assert_eq!(
            first_reply.header("ratelimit"),
            format!("\"burst\";r={};t=1", burst - 1)
        );
        assert_eq!(first_reply.header("ratelimit-limit"), burst.to_string());

        // Drain the burst; every request then waits for the burst quota.
        for _ in 1..burst {
            assert_eq!(get_with(addr, "/", key).await.status, StatusCode::OK);
        }
        get_with(addr, "/", key)
            .await
            .assert_denied_by("burst", &format!("{first} + {second}"));

        // The burst refills one unit per step (its emission interval, far shorter than
        // the minute's), until the minute's cap is used up; then the minute reports and
        // denies, though the burst has a unit again.
        let step: Quota = first.parse().unwrap();
        let step = step.period() / u32::try_from(step.limit()).unwrap();
        let mut admitted = burst;
        while admitted < cap {
            clock.advance(step);
            if get_with(addr, "/", key).await.status == StatusCode::OK {
                admitted += 1;
            }
        }
        clock.advance(step);
        let capped = get_with(addr, "/", key).await;
        capped.assert_denied_by("minute", &format!("{first} + {second}"));
        assert_eq!(capped.header("ratelimit-limit"), cap.to_string());
        assert_eq!(capped.header("ratelimit-policy"), policy);
    }
}

/// One layer holds each request to a per-key limit and a global one, all or nothing,
/// over a real socket: a request one limit denies consumes nothing from the other, and
/// the 429 names the limit that denied. At 1/s and at 100,000/s.
#[tokio::test]
async fn several_limits_in_one_layer_are_all_or_nothing() {
    for (per_key, global_quota) in [
        ("1/s burst 2", "1/s burst 3"),
        ("100000/s burst 2", "100000/s burst 3"),
    ] {
        let clock = ManualClock::new();
        let keyed: RateLimiter<String, ManualClock> =
            RateLimiter::builder(per_key.parse().unwrap())
                .clock(clock.clone())
                .build()
                .unwrap();
        let global: RateLimiter<(), ManualClock> =
            RateLimiter::builder(global_quota.parse().unwrap())
                .name("global")
                .clock(clock.clone())
                .build()
                .unwrap();
        let app = Router::new()
            .route("/", routing::get(|| async { "ok" }))
            .layer(
                RateLimitLayer::new(keyed.clone())
                    .key(KeyExtractor::header("x-api-key").unwrap())
                    .and(global.clone(), key_fn(|_| Some(())))
                    .unwrap(),
            );
        let addr = serve(app).await;
        let a: &[(&str, &[u8])] = &[("x-api-key", b"a")];
        let b: &[(&str, &[u8])] = &[("x-api-key", b"b")];

        let first = get_with(addr, "/", a).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(
            first.header("ratelimit-policy"),
            "\"default\";q=2;w=1, \"global\";q=3;w=1",
            "{per_key}"
        );
        assert_eq!(get_with(addr, "/", a).await.status, StatusCode::OK);
        // a's own limit denies; the global limit keeps its unit.
        get_with(addr, "/", a)
            .await
            .assert_denied_by("default", per_key);
        assert_eq!(
            global.peek(&()).remaining(),
            1,
            "{per_key}: the global limit lost a unit"
        );
        // b takes the global limit's last unit; then the global limit denies b, whose own
        // limit keeps its unit.
        assert_eq!(get_with(addr, "/", b).await.status, StatusCode::OK);
        get_with(addr, "/", b)
            .await
            .assert_denied_by("global", per_key);
        assert_eq!(
            keyed.peek("b").remaining(),
            1,
            "{per_key}: b's own limit lost a unit"
        );
        // Many denied requests later, nothing more was consumed anywhere.
        for _ in 0..20 {
            assert_eq!(
                get_with(addr, "/", b).await.status,
                StatusCode::TOO_MANY_REQUESTS
            );
        }
        assert_eq!(keyed.peek("b").remaining(), 1);
        assert_eq!(global.peek(&()).remaining(), 0);
    }
}

/// Behind a Redis limiter too: the further limit is decided first, and given its unit
/// back when Redis denies.
#[tokio::test]
async fn a_further_limit_gets_its_unit_back_when_redis_denies() {
    use tollgate::redis::{FailMode, RedisLimiter};
    let server = tollgate_testing::LocalRedis::start().unwrap();
    let redis = RedisLimiter::builder(&server.url(), "2/min".parse().unwrap())
        .build()
        .await
        .unwrap();
    let (global, _clock) = limiter::<()>("10/min");
    let app = Router::new()
        .route("/", routing::get(|| async { "ok" }))
        .layer(
            RateLimitLayer::redis(redis, FailMode::Closed)
                .key(KeyExtractor::header("x-api-key").unwrap())
                .and(global.clone(), key_fn(|_| Some(())))
                .unwrap(),
        );
    let addr = serve(app).await;
    let key: &[(&str, &[u8])] = &[("x-api-key", b"k")];
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for _ in 0..5 {
            out.push(get_with(addr, "/", key).await.status.as_u16());
        }
        out
    };
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    // Only the two admitted requests used the global limit.
    assert_eq!(global.peek(&()).remaining(), 8);
}

/// One layer holds each request to a per-key limit in process and to two limits in
/// Redis (per tenant, and one global), all or nothing, over a real socket against a real
/// redis-server: whichever limit denies, the limits before it get their unit back (the
/// Redis ones by a refund before the 429 goes out), the 429 names it, and
/// `RateLimit-Policy` lists all three. With Redis gone, the fail mode decides.
#[tokio::test]
async fn limits_in_redis_join_a_layer_all_or_nothing() {
    use tollgate::redis::{FailMode, RedisLimiter};
    let mut server = tollgate_testing::LocalRedis::start().unwrap();
    let redis = |quota: &str, name: &str| {
        RedisLimiter::builder(&server.url(), quota.parse().unwrap())
            .name(name)
            .prefix(name)
            .build()
    };
    let tenant = redis("3/min", "tenant").await.unwrap();
    let global = redis("6/min", "global").await.unwrap();
    let per_key: RateLimiter<String> = RateLimiter::builder("4/min".parse().unwrap())
        .name("key")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", routing::get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(per_key.clone())
                .key(KeyExtractor::header("x-api-key").unwrap())
                .policy_name("key")
                .and_redis(
                    tenant.clone(),
                    FailMode::Closed,
                    KeyExtractor::header("x-tenant").unwrap(),
                )
                .and_redis(
                    global.clone(),
                    FailMode::Closed,
                    key_fn(|_| Some("all".to_owned())),
                ),
        );
    let addr = serve(app).await;
    let call = |key: &'static str, tenant: &'static str| async move {
        let headers: &[(&str, &[u8])] = &[
            ("x-api-key", key.as_bytes()),
            ("x-tenant", tenant.as_bytes()),
        ];
        get_with(addr, "/", headers).await
    };
    // What a limit has left, asked without consuming (a cost of 0).
    let left = |limiter: &RedisLimiter, key: &'static str| {
        let limiter = limiter.clone();
        async move { limiter.check_n(key, 0).await.unwrap().remaining() }
    };

    let first = call("k1", "t1").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.header("ratelimit-policy"),
        "\"key\";q=4;w=60, \"tenant\";q=3;w=60, \"global\";q=6;w=60"
    );
    for _ in 0..2 {
        assert_eq!(call("k1", "t1").await.status, StatusCode::OK);
    }
    // The tenant denies: the global limit, after it, and the key's own are not asked.
    call("k1", "t1")
        .await
        .assert_denied_by("tenant", "t1's fourth");
    assert_eq!(left(&global, "all").await, 3);
    assert_eq!(per_key.peek("k1").remaining(), 1);
    // The key's own limit denies (its fifth): both Redis limits get their unit back.
    assert_eq!(call("k1", "t2").await.status, StatusCode::OK);
    call("k1", "t2").await.assert_denied_by("key", "k1's fifth");
    assert_eq!(left(&tenant, "t2").await, 2);
    assert_eq!(left(&global, "all").await, 2);
    // The global limit denies: the tenant gets its unit back.
    for _ in 0..2 {
        assert_eq!(call("k2", "t3").await.status, StatusCode::OK);
    }
    call("k2", "t3")
        .await
        .assert_denied_by("global", "the seventh overall");
    assert_eq!(left(&tenant, "t3").await, 1);
    assert_eq!(per_key.peek("k2").remaining(), 2);
    // Redis gone: the fail mode decides (`Closed`: a deny), and nothing is consumed.
    server.stop();
    assert_eq!(call("k3", "t4").await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(per_key.peek("k3").remaining(), 4);
}
