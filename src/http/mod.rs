//! The HTTP layer (cargo feature `tower`): rate limiting for axum, hyper and tonic, with
//! the standard 429 response and headers.
//!
//! [`RateLimitLayer`] wraps any service of `http` 1.x requests. For each request it picks
//! a key ([`KeyExtractor`]: the peer address, the client address behind trusted
//! proxies, a header, or a closure), asks the limiter, and then either calls the inner
//! service, adding the rate-limit headers to its response, or answers
//! `429 Too Many Requests` itself:
//!
//! ```text
//! HTTP/1.1 429 Too Many Requests
//! ratelimit-limit: 10
//! ratelimit-remaining: 0
//! ratelimit-reset: 2
//! ratelimit-policy: "default";q=10;w=1
//! ratelimit: "default";r=0;t=1
//! retry-after: 1
//! content-type: application/json
//!
//! {"error":"rate_limit_exceeded","message":"Too many requests: retry in 1 second.","retry_after_seconds":1}
//! ```
//!
//! `Retry-After` and the `RateLimit` field's `t` are whole seconds rounded **up** and at
//! least 1 — a client told to retry after a sub-second wait is never told "0".
//!
//! # Client addresses behind proxies
//!
//! [`KeyExtractor::peer_ip`] keys by the connection's address and ignores forwarding
//! headers, which any client can write. Behind a load balancer, list its networks:
//! [`KeyExtractor::client_ip`] then walks `X-Forwarded-For` (or `Forwarded`) from the
//! right, skipping trusted proxies, and keys by the first address that is not one — the
//! address the closest untrusted hop actually connected from. Entries to the left of it
//! are the client's own claims and are never used. IPv6 clients are grouped by /64.
//!
//! # Rate-limit-exceeded
//!
//! The problem type of [`ErrorBody::ProblemJson`] bodies: the client sent more requests
//! than its quota admits; retry after `retry_after_seconds`.

mod backend;
mod body;
mod concurrency;
mod config;
mod exempt;
mod extra;
mod extract;
mod future;
mod key;
mod layer;
mod observe;
mod response;
mod service;
mod values;

pub use backend::{BackendError, LayerLimiter};
pub use body::RateLimitBody;
pub use concurrency::{ConcurrencyLimitLayer, ConcurrencyLimitService, PermitBody, PermitFuture};
pub use config::{DecisionEvent, MissingKey, RejectionEvent};
pub use extract::{
    ExtractKey, KeyFromFn, KeyLimits, KeyRejection, OversizedKey, RequestHead, TextKey, key_fn,
};
pub use future::ResponseFuture;
pub use key::{Cidr, KeyExtractor};
pub use layer::RateLimitLayer;
pub use response::{DenyHook, ErrorBody, GrpcCode, HeaderStyle};
pub use service::RateLimitService;
