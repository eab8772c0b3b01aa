//! The HTTP and gRPC tier over real sockets: the tower layer with axum, hyper and tonic
//! and their real clients, the example server, and what the tiers report (metrics and
//! tracing). The metrics tests install this process's recorder; every limiter they read
//! has a name of its own, so the other tests' series do not touch theirs.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link.

#[path = "../common/mod.rs"]
mod common;

mod example_server;
mod grpc;
mod http;
mod http_layer;
mod metrics;
mod tracing;
