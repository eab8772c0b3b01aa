//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test crate uses its own subset

// `manual` has a file of its own, with no cargo feature in it, so that the HTTP tier's
// package (`http-tests/`, which has none of this package's features) includes it too.
mod manual;
#[allow(unused_imports)] // each test crate uses its own subset
pub use manual::manual;

/// Steps `x` (never 0) by xorshift64 and returns it: the tests' seeded, reproducible
/// random timelines.
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
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

/// How many connections listen on a tollgate reset channel (`…reset`) across `urls`: a
/// deny cache's listener counts once it has subscribed.
#[cfg(feature = "redis")]
pub async fn reset_listeners(urls: &[String]) -> u64 {
    let mut total = 0;
    for url in urls {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut con = client.get_multiplexed_async_connection().await.unwrap();
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg("*reset")
            .query_async(&mut con)
            .await
            .unwrap();
        if channels.is_empty() {
            continue;
        }
        let counts: Vec<(String, u64)> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channels)
            .query_async(&mut con)
            .await
            .unwrap();
        total += counts.iter().map(|(_, n)| n).sum::<u64>();
    }
    total
}

/// Waits, for at most 10 s, until `listeners` deny caches listen for resets on `urls`.
#[cfg(feature = "redis")]
pub async fn until_reset_listeners(urls: &[String], listeners: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while reset_listeners(urls).await < listeners {
        assert!(
            std::time::Instant::now() < deadline,
            "the listeners never subscribed"
        );
        // Waits for the limiters' subscriptions on the real Redis processes.
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// How late the runtime wakes a task, watched by a canary that sleeps 1 ms at a time:
/// on a loaded machine a check cannot end sooner after its deadline than the runtime
/// gets to run it, so latency claims are checked against `bound + worst()`.
#[cfg(feature = "tokio")]
pub struct Lateness {
    worst_us: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

#[cfg(feature = "tokio")]
impl Lateness {
    /// Starts the canary on the current runtime.
    pub fn watch() -> Self {
        let worst_us = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let worst = worst_us.clone();
        let task = tokio::spawn(async move {
            let tick = std::time::Duration::from_millis(1);
            loop {
                let asked = std::time::Instant::now();
                // The canary's own timer: its lateness is what it measures.
                tokio::time::sleep(tick).await;
                let late = asked.elapsed().saturating_sub(tick).as_micros() as u64;
                worst.fetch_max(late, std::sync::atomic::Ordering::Relaxed);
            }
        });
        Self { worst_us, task }
    }

    /// The latest wake-up seen so far, beyond the timer's own millisecond.
    pub fn worst(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.worst_us.load(std::sync::atomic::Ordering::Relaxed))
    }
}

#[cfg(feature = "tokio")]
impl Drop for Lateness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The Redis timeout of the tests whose claim is a decision or a call count, not a
/// latency: a call may take longer than the default 50 ms on a loaded machine, and an
/// error is no decision.
pub const DECISION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A `RedisLimiter` at `url` with `quota` and a short `timeout`, built once the real
/// server answers within it (a loaded machine may miss 10 ms now and then, the first
/// connection too), for at most until `deadline`.
#[cfg(feature = "redis")]
pub async fn limiter_within(
    url: &str,
    quota: tollgate::Quota,
    timeout: std::time::Duration,
    deadline: std::time::Instant,
) -> tollgate::redis::RedisLimiter {
    loop {
        let built = tollgate::redis::RedisLimiter::builder(url, quota)
            .timeout(timeout)
            .build()
            .await;
        match built {
            Ok(limiter) => return limiter,
            Err(e) => assert!(std::time::Instant::now() < deadline, "never connected: {e}"),
        }
    }
}

/// Makes a CA and a server certificate for 127.0.0.1 signed by it, in `dir` (needs
/// `openssl`, which `./scripts/test.sh` installs).
#[cfg(feature = "tls")]
pub fn certificates(dir: &std::path::Path) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("these tests need openssl (./scripts/test.sh installs it)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=tollgate test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ]);
}
