//! A tonic gRPC greeter behind tollgate's layer, keyed by the caller's address.
//!
//! ```text
//! cargo run --release --example tonic_greeter -- --addr 127.0.0.1:50051 --quota "5/s"
//! ```
//!
//! It serves `helloworld.Greeter/SayHello`, then calls itself eight times in a row with
//! tonic's client and prints each answer: the sixth and later calls get
//! `RESOURCE_EXHAUSTED` with a `retry-after` in their metadata.

use std::net::SocketAddr;

use clap::Parser;
use tollgate::http::RateLimitLayer;
use tollgate::{Quota, RateLimiter};

#[path = "greeter/mod.rs"]
mod greeter;

#[derive(Parser)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Each caller's quota.
    #[arg(long, default_value = "5/s")]
    quota: Quota,
    /// Calls the example makes to itself before it exits (0: serve until killed).
    #[arg(long, default_value_t = 8)]
    calls: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
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
