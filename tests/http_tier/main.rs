//! The HTTP and gRPC tier over real sockets: the tower layer with axum, hyper and tonic
//! and their real clients, the example server, and tracing.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link.

#[path = "../common/mod.rs"]
mod common;

mod example_server;
mod grpc;
mod http;
mod http_layer;
mod tracing;
