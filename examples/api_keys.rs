//! An axum API keyed by the `x-api-key` header, with per-key quotas from a TOML file,
//! Prometheus metrics at `/metrics` and `tracing` events on stderr.
//!
//! ```text
//! cargo run --example api_keys --features axum,serde,metrics,tracing            # a demo, then exit
//! cargo run --example api_keys --features axum,serde,metrics,tracing -- --serve # keep serving
//! ```
//!
//! The quotas are in `examples/api_keys.toml`. The demo sends eight requests with a
//! listed key and eight with an unlisted one, one without a key, then prints the
//! statuses and the `/metrics` page. With `--serve` it listens on 127.0.0.1:3001:
//! `curl -i -H 'x-api-key: partner-7f3a' http://127.0.0.1:3001/`.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::config::LimiterConfig;
use tollgate::http::{KeyExtractor, RateLimitLayer};

// The recorder the example server uses too: every series, in Prometheus's text format.
#[path = "support/prometheus.rs"]
mod prometheus;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve = std::env::args().any(|a| a == "--serve");
    // Deny events are `debug`; the key never appears in them, only a short hash.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(std::io::stderr)
        .init();
    let metrics = prometheus::Prometheus::install()?;

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/api_keys.toml");
    let config: LimiterConfig =
        toml::from_str(&std::fs::read_to_string(path)?).map_err(|e| format!("{path}: {e}"))?;
    let limiter = config.build::<String>()?;

    let scrape = metrics.clone();
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route(
            "/metrics",
            get(move || {
                let scrape = scrape.clone();
                async move { scrape.render() }
            }),
        )
        .layer(
            RateLimitLayer::new(limiter.clone())
                .key(KeyExtractor::header("x-api-key")?)
                .exempt_paths(["/metrics"]),
        );
    let address = if serve {
        "127.0.0.1:3001"
    } else {
        "127.0.0.1:0"
    };
    let listener = tokio::net::TcpListener::bind(address).await?;
    let address = listener.local_addr()?;
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    println!("listening on {address}; quotas from {path}");
    if serve {
        server.await??;
        return Ok(());
    }

    for key in ["partner-7f3a", "unlisted-key"] {
        let mut statuses = Vec::new();
        for _ in 0..8 {
            statuses.push(status_of(get_request(address, "/", Some(key)).await?));
        }
        println!(
            "{key:>14} ({}): {}",
            limiter.quota_for(key),
            statuses.join(" ")
        );
    }
    let missing = get_request(address, "/", None).await?;
    println!("{:>14}: {}", "no key", status_of(missing));
    limiter.stats(); // publishes the counters now, not at the next second
    let page = get_request(address, "/metrics", None).await?;
    let body = page.split("\r\n\r\n").nth(1).unwrap_or_default();
    println!("\nGET /metrics (the tollgate series):");
    for line in body.lines().filter(|l| l.starts_with("tollgate_")) {
        println!("  {line}");
    }
    server.abort();
    Ok(())
}

/// One HTTP/1.1 request over a fresh connection; the whole response as text.
async fn get_request(
    address: SocketAddr,
    path: &str,
    key: Option<&str>,
) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let key = key
        .map(|k| format!("x-api-key: {k}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nhost: {address}\r\n{key}connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}

/// The status code of a response's first line.
fn status_of(response: String) -> String {
    response.split(' ').nth(1).unwrap_or("?").to_owned()
}
