//! `tracing` events and the layer's decision hook: what they carry, and that keys never
//! appear in logs.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::serve;
use tollgate::http::{DecisionEvent, KeyExtractor, RateLimitLayer};
use tollgate::redis::{FailMode, RedisLimiter};
use tollgate::{Quota, RateLimiter};
use tollgate_testing::LocalRedis;

/// A writer into a shared buffer, for a subscriber whose output the test reads.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// A subscriber writing every event at `level` and above here, for this thread.
    fn subscribe(&self, level: tracing::Level) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }
}

#[test]
fn a_deny_is_logged_with_the_limiter_and_a_hash_never_the_key() {
    let logs = Captured::default();
    let _guard = logs.subscribe(tracing::Level::DEBUG);
    let limiter: RateLimiter<String> = RateLimiter::builder("2/min".parse::<Quota>().unwrap())
        .name("payments")
        .build()
        .unwrap();
    let secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    assert!(limiter.check(secret).is_allowed());
    assert!(limiter.check(secret).is_allowed());
    assert_eq!(logs.text(), "", "admissions log nothing");
    assert!(!limiter.check(secret).is_allowed());
    assert!(!limiter.check_n(secret, 1).unwrap().is_allowed());
    let text = logs.text();
    assert_eq!(text.matches("request denied").count(), 2, "{text}");
    assert!(text.contains("limiter=\"payments\""), "{text}");
    assert!(text.contains("key_hash="), "{text}");
    assert!(text.contains("retry_after_ms="), "{text}");
    assert!(
        !text.contains("sk_live"),
        "the key leaked into the log: {text}"
    );
    // The same key hashes the same way each time.
    let hashes: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split("key_hash=").nth(1)?.split_whitespace().next())
        .collect();
    assert_eq!(hashes.len(), 2);
    assert_eq!(hashes[0], hashes[1]);
}

#[test]
fn nothing_is_logged_below_the_enabled_level() {
    let logs = Captured::default();
    let _guard = logs.subscribe(tracing::Level::INFO);
    let limiter: RateLimiter<u64> = RateLimiter::new("1/min".parse().unwrap());
    for _ in 0..100 {
        limiter.check(&1);
    }
    assert_eq!(logs.text(), "");
}

#[tokio::test]
async fn a_redis_outage_warns_once_and_recovery_is_announced() {
    let logs = Captured::default();
    let _guard = logs.subscribe(tracing::Level::INFO);
    let mut server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let limiter = RedisLimiter::builder(&server.url(), "100/s".parse().unwrap())
        .name("edge")
        .timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    assert!(limiter.check("k").await.is_ok());
    server.stop();
    for _ in 0..3 {
        assert!(limiter.check("k").await.is_err());
    }
    server.restart().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while limiter.check("k").await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "Redis did not come back"
        );
        // Waits for the restarted Redis process to answer.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = logs.text();
    // One warning for the outage's first failure, one for the breaker opening at the
    // third; the failures in between are `debug`.
    assert_eq!(
        text.matches("WARN").count(),
        2,
        "two warnings per outage: {text}"
    );
    assert_eq!(
        text.matches("redis tier: a check failed").count(),
        1,
        "{text}"
    );
    assert_eq!(text.matches("circuit breaker open").count(), 1, "{text}");
    assert!(text.contains("circuit breaker closed"), "{text}");
    assert!(text.contains("limiter=\"edge\""), "{text}");
    assert!(text.contains("redis tier: answering again"), "{text}");
    assert!(!text.contains(&server.url()), "{text}");
}

#[tokio::test]
async fn the_decision_hook_sees_every_decision_and_the_errors_fail_modes_hide() {
    type Seen = Arc<Mutex<Vec<(bool, String, Option<String>)>>>;
    let seen: Seen = Arc::default();
    let record = |seen: &Seen| {
        let seen = Arc::clone(seen);
        move |event: &DecisionEvent<'_>| {
            seen.lock().unwrap().push((
                event.decision.is_allowed(),
                event.head.uri.path().to_owned(),
                event.backend_error.map(ToString::to_string),
            ));
        }
    };
    async fn status(addr: SocketAddr, path: &str) -> u16 {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let request = http::Request::get(path)
            .header("host", "test")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        sender
            .send_request(request)
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    // The local limiter: every decision, allowed and denied, with its path.
    let local: RateLimiter<String> = RateLimiter::new("1/min".parse().unwrap());
    let app = axum::Router::new()
        .route("/a", axum::routing::get(|| async { "a" }))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(local)
                .exempt_paths(["/healthz"])
                .on_decision(record(&seen)),
        );
    let addr = serve(app).await;
    assert_eq!(status(addr, "/a").await, 200);
    assert_eq!(status(addr, "/a").await, 429);
    assert_eq!(status(addr, "/healthz").await, 200);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (true, "/a".to_owned(), None),
            (false, "/a".to_owned(), None)
        ],
        "exempt requests are not decisions"
    );

    // The Redis tier, failing open: the hook gets the error the fail mode swallowed.
    seen.lock().unwrap().clear();
    let mut server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let redis = RedisLimiter::builder(&server.url(), "10/s".parse().unwrap())
        .timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let app = axum::Router::new()
        .route("/b", axum::routing::get(|| async { "b" }))
        .layer(
            RateLimitLayer::redis(redis, FailMode::Open)
                .key(KeyExtractor::peer_ip())
                .on_decision(record(&seen)),
        );
    let addr = serve(app).await;
    assert_eq!(status(addr, "/b").await, 200);
    server.stop();
    assert_eq!(status(addr, "/b").await, 200, "fail open");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].2, None);
    let error = seen[1].2.as_deref().unwrap_or_default();
    assert!(
        !error.is_empty(),
        "the swallowed error reaches the hook: {seen:?}"
    );
}
