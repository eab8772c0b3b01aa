//! `RateLimitLayer`: the configuration shared by every service it wraps.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use tower::Layer;

use super::key::KeyExtractor;
use super::response::{ErrorBody, HeaderStyle, Style};
use super::service::RateLimitService;
use crate::clock::Clock;
use crate::decision::Decision;
use crate::limiter::RateLimiter;
use crate::quota::Quota;

/// What the layer does with a request it finds no key for (no peer address, no key
/// header, or a custom extractor that returned `None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum MissingKey {
    /// Answer `400 Bad Request` with a JSON error; the inner service is not called.
    #[default]
    Reject,
    /// Limit all such requests together, in one bucket of this name.
    Shared(String),
}

/// A local limiter, as the layer uses it.
pub(crate) trait LocalLimiter: Send + Sync {
    fn check(&self, key: &str) -> Decision;
}

impl<C: Clock> LocalLimiter for RateLimiter<String, C>
where
    String: Hash + Eq,
{
    fn check(&self, key: &str) -> Decision {
        RateLimiter::check(self, key)
    }
}

/// Where decisions come from.
#[derive(Clone)]
pub(crate) enum Backend {
    Local(Arc<dyn LocalLimiter>),
    #[cfg(feature = "redis")]
    Redis(crate::redis::RedisLimiter, crate::redis::FailMode),
}

/// Everything a [`RateLimitService`] needs, shared by all its clones.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) backend: Backend,
    pub(crate) key: KeyExtractor,
    pub(crate) missing: MissingKey,
    pub(crate) style: Style,
}

/// A tower layer that rate-limits requests with a tollgate limiter.
///
/// Admitted requests reach the inner service, and their responses get the rate-limit
/// headers ([`HeaderStyle`]). Denied requests get `429 Too Many Requests` with the same
/// headers, `Retry-After` (whole seconds, rounded up, at least 1) and a JSON body
/// ([`ErrorBody`]); the inner service is not called.
///
/// ```
/// use std::net::SocketAddr;
/// use axum::{routing::get, Router};
/// use tollgate::http::{KeyExtractor, RateLimitLayer};
/// use tollgate::RateLimiter;
///
/// let limiter: RateLimiter<String> = RateLimiter::new("10/s burst 20".parse()?);
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(RateLimitLayer::new(limiter).key(KeyExtractor::peer_ip()));
/// // Serve with `app.into_make_service_with_connect_info::<SocketAddr>()` so the layer
/// // sees each connection's address.
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// **Per-route quotas.** The recommended way is one layer per group of routes, each
/// with its own limiter (`Router::new().route(..).layer(..)` per group, then `merge`):
/// each group's quota, headers and keys stay independent and visible in one place. To
/// give some clients a different quota on the same routes, use
/// [`RateLimiter::set_quota`] on the layer's limiter.
#[derive(Clone)]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.config.key)
            .field("missing", &self.config.missing)
            .field("style", &self.config.style)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Limits with `limiter`, keyed by the peer address (see [`KeyExtractor`]).
    pub fn new<C: Clock>(limiter: RateLimiter<String, C>) -> Self {
        let quota = limiter.quota();
        let capacity = limiter.capacity();
        Self::with_backend(Backend::Local(Arc::new(limiter)), quota, capacity)
    }

    /// Limits with the Redis tier; when Redis fails, `on_failure` decides.
    #[cfg(feature = "redis")]
    pub fn redis(limiter: crate::redis::RedisLimiter, on_failure: crate::redis::FailMode) -> Self {
        let quota = limiter.quota();
        let capacity = match limiter.algorithm() {
            crate::Algorithm::TokenBucket => quota.burst(),
            _ => quota.limit(),
        };
        Self::with_backend(Backend::Redis(limiter, on_failure), quota, capacity)
    }

    fn with_backend(backend: Backend, quota: Quota, capacity: u64) -> Self {
        let period = quota.period();
        let mut style = Style {
            headers: HeaderStyle::Both,
            body: ErrorBody::Json,
            policy: "\"default\"".to_owned(),
            window_secs: period.as_secs() + u64::from(period.subsec_nanos() > 0),
            policy_value: None,
        };
        style.cache_policy(capacity);
        Self {
            config: Arc::new(Config {
                backend,
                key: KeyExtractor::peer_ip(),
                missing: MissingKey::Reject,
                style,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// How requests are keyed; [`KeyExtractor::peer_ip`] by default.
    pub fn key(self, key: KeyExtractor) -> Self {
        self.edit(|c| c.key = key)
    }

    /// What to do with a request that has no key; [`MissingKey::Reject`] by default.
    pub fn on_missing_key(self, missing: MissingKey) -> Self {
        self.edit(|c| c.missing = missing)
    }

    /// Which rate-limit headers responses carry; [`HeaderStyle::Both`] by default.
    pub fn headers(self, headers: HeaderStyle) -> Self {
        self.edit(|c| c.style.headers = headers)
    }

    /// The body of a 429; [`ErrorBody::Json`] by default.
    pub fn error_body(self, body: ErrorBody) -> Self {
        self.edit(|c| c.style.body = body)
    }

    /// The policy name in the IETF fields; `default` by default. Quotes and backslashes
    /// are escaped.
    pub fn policy_name(self, name: &str) -> Self {
        let quoted = format!("\"{}\"", name.replace('\\', "\\\\").replace('"', "\\\""));
        self.edit(|c| {
            c.style.policy = quoted;
            if let Some((limit, _)) = c.style.policy_value {
                c.style.cache_policy(limit);
            }
        })
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, Arc::clone(&self.config))
    }
}
