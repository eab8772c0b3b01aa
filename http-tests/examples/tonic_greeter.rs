//! A tonic gRPC greeter behind tollgate's layer, keyed by the caller's address.
//!
//! ```text
//! cargo run --release -p tollgate-http-tests --example tonic_greeter -- --addr 127.0.0.1:50051 --quota "5/s"
//! ```
//!
//! It serves `helloworld.Greeter/SayHello`, then calls itself eight times in a row with
//! tonic's client and prints each answer: the sixth and later calls get
//! `RESOURCE_EXHAUSTED` with a `retry-after` in their metadata.

use std::net::SocketAddr;

use tollgate::http::RateLimitLayer;
use tollgate::{Quota, RateLimiter};

#[path = "greeter/mod.rs"]
mod greeter;

/// The flags, with their defaults.
struct Args {
    /// Where to listen (`--addr`, 127.0.0.1:0).
    addr: SocketAddr,
    /// Each caller's quota (`--quota`, 5/s).
    quota: Quota,
    /// Calls the example makes to itself before it exits (`--calls`, 8; 0: serve until
    /// killed).
    calls: u32,
}

const USAGE: &str = "usage: tonic_greeter [--addr HOST:PORT] [--quota QUOTA] [--calls N]";

impl Args {
    /// Reads `--flag value` or `--flag=value` for each flag; an unknown flag, a missing
    /// value or one that does not parse is an error that names it.
    fn parse(mut words: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut args = Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            quota: "5/s".parse().map_err(|e| format!("{e}"))?,
            calls: 8,
        };
        while let Some(word) = words.next() {
            let (flag, inline) = match word.split_once('=') {
                Some((flag, value)) => (flag.to_owned(), Some(value.to_owned())),
                None => (word, None),
            };
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.to_owned());
            }
            let value = inline
                .or_else(|| words.next())
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            let bad = |e: &dyn std::fmt::Display| format!("{flag} {value:?}: {e}");
            match flag.as_str() {
                "--addr" => args.addr = value.parse().map_err(|e| bad(&e))?,
                "--quota" => args.quota = value.parse().map_err(|e| bad(&e))?,
                "--calls" => args.calls = value.parse().map_err(|e| bad(&e))?,
                _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
            }
        }
        Ok(args)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    let limiter: RateLimiter<String> = RateLimiter::new(args.quota);
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    let addr = listener.local_addr()?;
    println!("greeter listening on {addr}, {} per caller", args.quota);
    let incoming = tokio_stream_from(listener);
    let server = tonic::transport::Server::builder()
        .layer(RateLimitLayer::new(limiter))
        .add_service(greeter::Greeter)
        .serve_with_incoming(incoming);
    if args.calls == 0 {
        server.await?;
        return Ok(());
    }
    let serving = tokio::spawn(server);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    for i in 1..=args.calls {
        match greeter::say_hello(channel.clone(), "tollgate").await {
            Ok(reply) => println!("call {i}: {}", reply.into_inner().message),
            Err(status) => println!(
                "call {i}: {:?} {:?}, retry-after {:?}",
                status.code(),
                status.message(),
                status.metadata().get("retry-after")
            ),
        }
    }
    serving.abort();
    Ok(())
}

/// The listener's connections as the stream tonic serves.
fn tokio_stream_from(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
}
