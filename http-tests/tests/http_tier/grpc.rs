//! The layer in front of a tonic server, called by tonic's own client over a socket.

use crate::limiter;

use std::net::SocketAddr;
use std::time::Duration;

use tollgate::http::{GrpcCode, KeyExtractor, RateLimitLayer};
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Server};

#[path = "../../examples/greeter/mod.rs"]
pub(crate) mod greeter;

/// Serves the greeter behind `layer` on an ephemeral port; returns a connected channel.
async fn serve(layer: RateLimitLayer) -> Channel {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(greeter::Greeter)
            .serve_with_incoming(incoming),
    );
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_limited_call_is_resource_exhausted_with_its_metadata() {
    // Keyed by the peer address, which the layer reads from tonic's `TcpConnectInfo`.
    let (l, clock) = limiter("2/min");
    let channel = serve(RateLimitLayer::new(l).key(KeyExtractor::peer_ip())).await;

    for left in ["1", "0"] {
        let reply = greeter::say_hello(channel.clone(), "ada").await.unwrap();
        assert_eq!(reply.get_ref().message, "Hello, ada!");
        assert_eq!(reply.metadata().get("ratelimit-remaining").unwrap(), left);
        assert_eq!(reply.metadata().get("ratelimit-limit").unwrap(), "2");
    }
    clock.advance(Duration::from_millis(500));
    let status = greeter::say_hello(channel.clone(), "ada")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "Too many requests: retry in 30 seconds.");
    let meta = status.metadata();
    assert_eq!(meta.get("retry-after").unwrap(), "30", "29.5s rounds up");
    // gRFC A6's pushback, exact to the millisecond: the slot is 29.5 s away.
    assert_eq!(meta.get("grpc-retry-pushback-ms").unwrap(), "29500");
    assert_eq!(meta.get("ratelimit-remaining").unwrap(), "0");
    assert_eq!(meta.get("ratelimit").unwrap(), "\"default\";r=0;t=30");

    // Once the slot is back, the call goes through again.
    clock.advance(Duration::from_secs(30));
    assert!(greeter::say_hello(channel, "ada").await.is_ok());
}

#[tokio::test]
async fn the_grpc_status_is_configurable() {
    let (l, _clock) = limiter("1/min");
    let channel = serve(RateLimitLayer::new(l).grpc_code(GrpcCode::Unavailable)).await;
    assert!(greeter::say_hello(channel.clone(), "x").await.is_ok());
    let status = greeter::say_hello(channel, "x").await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.metadata().get("retry-after").unwrap(), "60");
}

#[tokio::test]
async fn a_rejected_key_is_invalid_argument_not_internal() {
    // Keyed by a header the client does not send, so every call has no key.
    let (l, _clock) = limiter("10/s");
    let channel =
        serve(RateLimitLayer::new(l).key(KeyExtractor::header("x-api-key").unwrap())).await;
    let status = greeter::say_hello(channel, "x").await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("no rate-limit key: the server looks for the `x-api-key` header"),
        "{status:?}"
    );
}

#[tokio::test]
async fn quotas_hold_at_the_edges_over_grpc() {
    // 1/s: one call, then a deny; 100,000/s with a burst of 50: fifty calls, then a deny.
    for (quota, admitted) in [("1/s", 1), ("100000/s burst 50", 50)] {
        let (l, _clock) = limiter(quota);
        let channel = serve(RateLimitLayer::new(l)).await;
        for i in 0..admitted {
            assert!(
                greeter::say_hello(channel.clone(), "x").await.is_ok(),
                "{quota}: call {i}"
            );
        }
        let status = greeter::say_hello(channel, "x").await.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted, "{quota}");
        assert_eq!(
            status.metadata().get("retry-after").unwrap(),
            "1",
            "{quota}"
        );
        // The manual clock stands still: the next slot is one emission interval away,
        // 1 s at 1/s and 10 µs at 100,000/s, which rounds up to 1 ms, never 0.
        let pushback = if quota == "1/s" { "1000" } else { "1" };
        assert_eq!(
            status.metadata().get("grpc-retry-pushback-ms").unwrap(),
            pushback,
            "{quota}"
        );
    }
}
