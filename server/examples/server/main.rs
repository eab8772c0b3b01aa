//! An HTTP server rate-limited by tollgate: the README's main command.
//!
//! ```sh
//! cargo run --release --example server -- --quota "10/s" --key ip
//! curl -i http://127.0.0.1:3000/
//! ```
//!
//! `GET /` and `GET /api/{anything}` are limited (`GET /api/…?delay_ms=N` answers after
//! N ms, at most 10 s: a slow request); `GET /healthz` and `GET /metrics`
//! (every tollgate metric, Prometheus text format, limiter `api`) are not. Every second the
//! server prints what it allowed and denied, how many keys it holds, and the sync state.
//!
//! With `--redis URL` (one server), `--redis-cluster URL,URL,...` (seed nodes of a
//! Redis Cluster) or `--redis-sentinel HOST:PORT,... --redis-master NAME` (the primary
//! that Redis Sentinel names) the limit is global: `--sync reconcile` (the default) or `lease` keeps
//! checks local with a background sync; `--sync off` runs the Redis script on every
//! request (exact, one round trip each).
//!
//! With `--concurrency N`, each key may also have at most N requests in flight at once
//! in this process (a `ConcurrencyLimitLayer` outside the rate limit).

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use tollgate::http::{ConcurrencyLimitLayer, HeaderStyle, KeyExtractor, RateLimitLayer};
use tollgate::redis::{FailMode, RedisLimiter, RedisOptions};
use tollgate::sync::{RedisSync, SyncHandle, SyncMode, SyncedLimiter};
use tollgate::{ConcurrencyLimiter, RateLimiter};

mod args;
// The recorder lives in the library's package, beside the examples that share it, so
// that they build from the published crate too.
#[path = "../../../examples/support/prometheus.rs"]
mod prometheus;

use args::{Args, Command, Headers, OnFailure, Sync};

/// Where the limit lives.
enum Tier {
    /// In this process.
    Local(RateLimiter<String>),
    /// In this process, one limit across the nodes through a Redis sync.
    Synced(SyncedLimiter<String>, SyncHandle),
    /// In Redis, one script call per request.
    Exact(RedisLimiter),
}

impl Tier {
    /// The layer limiting with this tier.
    fn layer(&self, args: &Args) -> RateLimitLayer {
        match self {
            Tier::Local(limiter) => RateLimitLayer::new(limiter.clone()),
            Tier::Synced(limiter, _) => RateLimitLayer::new(limiter.clone()),
            Tier::Exact(limiter) => {
                let mode = match args.on_redis_failure {
                    OnFailure::Open => FailMode::Open,
                    OnFailure::Closed => FailMode::Closed,
                    OnFailure::Local => FailMode::Local(args.quota),
                    OnFailure::LocalShare => FailMode::LocalShare,
                };
                RateLimitLayer::new((limiter.clone(), mode))
            }
        }
    }

    /// Publishes the in-process limiter's totals (`stats` does) and returns how many keys
    /// it holds; `None` for the exact tier, which holds none.
    fn publish(&self) -> Option<usize> {
        match self {
            Tier::Local(limiter) => Some(limiter.stats().keys),
            Tier::Synced(limiter, _) => Some(limiter.stats().keys),
            Tier::Exact(_) => None,
        }
    }

    fn sync(&self) -> Option<&SyncHandle> {
        match self {
            Tier::Synced(_, handle) => Some(handle),
            _ => None,
        }
    }
}

/// The `delay_ms` query parameter, at most 10,000.
fn delay_ms(uri: &axum::http::Uri) -> Option<u64> {
    let query = uri.query()?;
    let value = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("delay_ms="))?;
    value.parse::<u64>().ok().map(|ms| ms.min(10_000))
}

fn key_extractor(args: &Args) -> Result<KeyExtractor, String> {
    match args.key.as_str() {
        "ip" => Ok(KeyExtractor::client_ip(args.trusted_proxy.iter().copied())),
        other => match other.strip_prefix("header:") {
            Some(name) if !name.is_empty() => KeyExtractor::header(name).map_err(|e| e.to_string()),
            _ => Err(format!("invalid --key {other:?}: use ip or header:NAME")),
        },
    }
}

/// Counts what the limited routes answered.
#[derive(Default)]
struct Counters {
    allowed: AtomicU64,
    denied: AtomicU64,
}

#[tokio::main]
async fn main() -> ExitCode {
    // tollgate's events (fallbacks, Redis failures, recoveries; each deny at `debug`) on
    // stderr, filtered by RUST_LOG: `warn` and above by default, `RUST_LOG=debug` for all.
    // RUST_LOG takes `target=level` directives and a bare default level, as env-filter's
    // do (`tollgate=debug`, `info,tollgate=trace`); one that does not parse means `warn`.
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|directives| directives.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(LevelFilter::WARN));
    // The filter decides alone: fmt's own maximum (INFO unless told) would drop `debug`.
    tracing_subscriber::fmt()
        .with_max_level(LevelFilter::TRACE)
        .with_writer(std::io::stderr)
        .finish()
        .with(filter)
        .init();
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(Command::Run(args)) => args,
        Ok(Command::Help) => {
            print!("{}", args::HELP);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(*args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    // Every tollgate metric, in Prometheus text format at `GET /metrics`.
    let prometheus = prometheus::Prometheus::install()?;
    let key = key_extractor(&args)?;
    let tier = tier(&args).await?;
    let headers = match args.headers {
        Headers::Legacy => HeaderStyle::Legacy,
        Headers::Ietf => HeaderStyle::Ietf,
        Headers::Both => HeaderStyle::Both,
    };
    let counters = Arc::new(Counters::default());
    let count = {
        let counters = Arc::clone(&counters);
        move |response: Response| {
            let counter = if response.status() == StatusCode::TOO_MANY_REQUESTS {
                &counters.denied
            } else {
                &counters.allowed
            };
            counter.fetch_add(1, Ordering::Relaxed);
            std::future::ready(response)
        }
    };
    let limited = Router::new()
        .route(
            "/",
            get(|| async { json_object("message", "hello from tollgate") }),
        )
        .route(
            "/api/{*path}",
            get(
                |Path(path): Path<String>, uri: axum::http::Uri| async move {
                    // `?delay_ms=N` (at most 10 s): a slow request, to watch --concurrency.
                    if let Some(ms) = delay_ms(&uri) {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    json_object("path", &path)
                },
            ),
        )
        // `route_layer`: only these routes are limited; a request for an unknown path
        // (the fallback's 404) uses up no quota.
        .route_layer(
            tier.layer(&args)
                .key(key.clone())
                .headers(headers)
                .shadow(args.shadow),
        );
    // Outside the rate limit: a request refused a slot uses up no quota, and one the
    // rate limit denies holds its slot only while its 429 goes out.
    let limited = match args.concurrency {
        Some(max) => {
            let slots = ConcurrencyLimiter::<String>::builder(max)
                .name("api")
                .build()
                .map_err(|e| e.to_string())?;
            limited.route_layer(ConcurrencyLimitLayer::new(slots).key(key))
        }
        None => limited,
    }
    .route_layer(axum::middleware::map_response(count));
    let tier = Arc::new(tier);
    let scrape = Arc::clone(&tier);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move || {
                // Fresh totals first.
                scrape.publish();
                std::future::ready(prometheus.render())
            }),
        )
        .merge(limited);

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let also: String = args.also.iter().map(|q| format!(" and {q}")).collect();
    println!(
        "listening on http://{local} with quota {}{also} ({}); try: curl -i http://{local}/",
        args.quota, args.algorithm
    );

    let stats = tokio::spawn({
        let counters = Arc::clone(&counters);
        let tier = Arc::clone(&tier);
        async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let (allowed, denied) = (
                    counters.allowed.swap(0, Ordering::Relaxed),
                    counters.denied.swap(0, Ordering::Relaxed),
                );
                let Some(keys) = tier.publish() else {
                    // A closed stdout (a supervisor that stopped reading) ends no task.
                    let _ = writeln!(
                        std::io::stdout(),
                        "allowed {allowed:>6}  denied {denied:>6}  (exact: every request runs the Redis script)"
                    );
                    continue;
                };
                let sync = match tier.sync() {
                    None => "off".to_owned(),
                    Some(handle) => {
                        let s = handle.stats();
                        let age = s
                            .last_success_age
                            .map_or("never".to_owned(), |a| format!("{}ms ago", a.as_millis()));
                        let fallback = if s.fallback_active { ", FALLBACK" } else { "" };
                        let failing = s
                            .last_error
                            .map_or(String::new(), |kind| format!(" (failing: {kind})"));
                        format!(
                            "{} nodes, last sync {age}, {} errors{failing}{fallback}",
                            s.nodes, s.errors
                        )
                    }
                };
                let _ = writeln!(
                    std::io::stdout(),
                    "allowed {allowed:>6}  denied {denied:>6}  keys {keys:>6}  sync {sync}"
                );
            }
        }
    });
    let serve = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    });
    let result = serve.await.map_err(|e| e.to_string());
    stats.abort();
    let _ = stats.await;
    if let Ok(Tier::Synced(_, handle)) = Arc::try_unwrap(tier) {
        handle.shutdown().await;
    }
    result
}

/// How the flags reach Redis (`None` without Redis): one server, a cluster's seeds or
/// the sentinels, with the data nodes' password behind Sentinel and the key-hashing
/// secret, each from its environment variable.
fn redis_options(args: &Args) -> Result<Option<RedisOptions>, String> {
    let mut options = if let Some(url) = &args.redis {
        RedisOptions::new(url)
    } else if !args.redis_cluster.is_empty() {
        let seeds: Vec<&str> = args.redis_cluster.iter().map(String::as_str).collect();
        RedisOptions::cluster(&seeds)
    } else if let Some(master) = &args.redis_master {
        let sentinels: Vec<&str> = args.redis_sentinel.iter().map(String::as_str).collect();
        let options = RedisOptions::sentinel(&sentinels, master);
        match std::env::var("TOLLGATE_REDIS_MASTER_PASSWORD") {
            Ok(password) if !password.is_empty() => options.master_password(&password),
            _ => options,
        }
    } else {
        if args.hash_keys {
            return Err("--hash-keys needs Redis".into());
        }
        return Ok(None);
    };
    if args.hash_keys {
        match std::env::var("TOLLGATE_KEY_SECRET") {
            Ok(secret) if !secret.is_empty() => options = options.hash_keys(secret),
            _ => return Err("--hash-keys needs the secret in TOLLGATE_KEY_SECRET".into()),
        }
    }
    Ok(Some(options))
}

/// The limiter the flags ask for.
async fn tier(args: &Args) -> Result<Tier, String> {
    let mut builder = RateLimiter::<String>::builder(args.quota)
        .algorithm(args.algorithm)
        .name("api")
        .expected_keys(args.expected_keys);
    for &quota in &args.also {
        builder = builder.also(quota);
    }
    let Some(options) = redis_options(args)? else {
        if args.sync == Sync::Off {
            return Err("--sync off needs --redis, --redis-cluster or --redis-sentinel".into());
        }
        return Ok(Tier::Local(builder.build().map_err(|e| e.to_string())?));
    };
    let mode = match args.sync {
        Sync::Reconcile => SyncMode::Reconcile,
        Sync::Lease => SyncMode::Lease,
        Sync::Off => {
            let mut exact = RedisLimiter::builder_with(options, args.quota)
                .algorithm(args.algorithm)
                .name("api")
                .timeout(Duration::from_millis(200));
            for &quota in &args.also {
                exact = exact.also(quota);
            }
            let limiter = exact
                .build()
                .await
                .map_err(|e| format!("cannot start the Redis tier: {e}"))?;
            return Ok(Tier::Exact(limiter));
        }
    };
    let mut config = RedisSync::with_options(options)
        .mode(mode)
        .interval(args.sync_interval)
        .share_ttl(args.share_ttl);
    if let Some(cold) = args.cold_keys {
        config = config.cold_keys(cold);
    }
    let (limiter, handle) = builder.build_synced(config).map_err(|e| e.to_string())?;
    // Serve once every quota's task has heard Redis (its first round answered, and the
    // keys hot elsewhere read), so that the first requests are decided as all later ones
    // are; until then a new key's check is denied. An unreachable Redis is not fatal:
    // `ready` returns at the first failed round, and the limiter serves by its fallback
    // (its reserved share, then a one-time budget) until Redis answers. The bound is for
    // a Redis that accepts the connection and never answers.
    let _ = tokio::time::timeout(Duration::from_secs(2), handle.ready()).await;
    // Each quota's task on its own: the summed `stats` would count one task's rounds
    // for all of them.
    if let Some(stats) = handle.quota_stats().into_iter().find(|s| s.syncs == 0) {
        let why = match stats.last_error {
            Some("authentication") => {
                " (authentication failed: check the password or user in the URL)".to_owned()
            }
            Some(kind) => format!(" (last error: {kind})"),
            None => String::new(),
        };
        eprintln!(
            "warning: Redis is not answering yet{why}; serving by the local fallback until it does"
        );
    }
    Ok(Tier::Synced(limiter, handle))
}

/// A one-field JSON object, `{"field":"value"}`, with the value escaped as JSON requires.
fn json_object(field: &str, value: &str) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let mut body = format!("{{\"{field}\":\"");
    for c in value.chars() {
        match c {
            '"' => body.push_str("\\\""),
            '\\' => body.push_str("\\\\"),
            c if c.is_control() => body.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => body.push(c),
        }
    }
    body.push_str("\"}");
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
}
