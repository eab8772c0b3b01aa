//! The HTTP and gRPC tier over real sockets: the tower layer with axum, hyper and tonic
//! and their real clients, the example server, and what the tiers report (metrics and
//! tracing). The metrics tests install this process's recorder; every limiter they read
//! has a name of its own, so the other tests' series do not touch theirs.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link. This one lives in a package of its own
//! (`tollgate-http-tests`), built without optimisation: its tests wait on sockets and
//! processes, and its clients' code (hyper, tonic, axum) is most of what it compiles.

mod concurrency;
mod example_server;
mod grpc;
mod http;
mod http_layer;
mod metrics;
mod tracing;

#[path = "../../../tests/common/manual.rs"]
mod manual;

use tollgate::Algorithm;
use tollgate::RateLimiter;
use tollgate::clock::ManualClock;

/// A token bucket of `quota` (a quota string) on a still `ManualClock` at 0, with that
/// clock.
pub fn limiter(quota: &str) -> (RateLimiter<String, ManualClock>, ManualClock) {
    manual::manual(Algorithm::TokenBucket, quota)
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
