//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test crate uses its own subset

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, RateLimiter};

/// A `String`-keyed limiter running `algorithm` at `quota` (a quota string) on a
/// `ManualClock` at 0, with that clock.
pub fn manual(
    algorithm: Algorithm,
    quota: &str,
) -> (RateLimiter<String, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let limiter = RateLimiter::builder(quota.parse().unwrap())
        .algorithm(algorithm)
        .clock(clock.clone())
        .build()
        .unwrap();
    (limiter, clock)
}

/// Serves `app` on 127.0.0.1 at an ephemeral port, with each connection's address as
/// axum's `ConnectInfo`; the server runs until the test's runtime ends.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// The example server, built by `cargo test` beside the test's binary.
pub fn example_server() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join("server");
    assert!(path.exists(), "{} is not built", path.display());
    path
}

/// The largest `count − rate·t` over any interval of admissions, i.e. the smallest `b`
/// with "at most `b + rate·t` in any interval of length `t`".
pub fn excess_over_rate(admitted: &[u64], rate_per_us: f64) -> f64 {
    let mut worst = 0.0f64;
    let mut min_before = f64::MAX;
    for (k, &t) in admitted.iter().enumerate() {
        let f = k as f64 - rate_per_us * t as f64;
        min_before = min_before.min(f - 1.0);
        worst = worst.max(f - min_before);
    }
    worst
}

/// Whether `total` admissions are `rate` (per second) over `secs` within `±tolerance`
/// (relative) and `slack` tokens at the span's ends; above it, also `left`, what the
/// global state held unspent at the start (a leftover burst, which the bounds allow).
/// `secs` is the span on Redis's clock: the limit runs on it, and it moves with the
/// host's wall clock.
pub fn within_rate(
    total: u64,
    rate: f64,
    secs: f64,
    tolerance: f64,
    slack: u64,
    left: u64,
) -> Result<(), String> {
    let expected = rate * secs;
    let low = ((expected * (1.0 - tolerance)).floor() as u64).saturating_sub(slack);
    let high = (expected * (1.0 + tolerance)).ceil() as u64 + slack + left;
    if (low..=high).contains(&total) {
        Ok(())
    } else {
        Err(format!(
            "{total} admitted, not in {low}..={high}: {expected:.1} at {rate}/s over \
             {secs:.3} s of Redis's clock, {left} tokens left at the start"
        ))
    }
}

/// Seconds of the wall clock since `start`: the clock a Redis on this host reads for its
/// `TIME`, and so the one the global limits run on.
pub fn wall_secs_since(start: std::time::SystemTime) -> f64 {
    std::time::SystemTime::now()
        .duration_since(start)
        .unwrap_or_default()
        .as_secs_f64()
}
