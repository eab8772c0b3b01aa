//! `RateLimitLayer`: the builder of the configuration every service it wraps shares.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use tower::Layer;

use super::backend::{Backing, LayerLimiter};
use super::config::{
    Config, DecisionEvent, MissingKey, PlanFields, PlanFn, PlanStyles, RejectionEvent,
};
use super::exempt::Exempt;
use super::extra::{Extra, ExtraLimit};
use super::extract::{ExtractKey, KeyLimits, OversizedKey, RequestHead};
use super::key::{Cidr, KeyExtractor};
use super::response::{ErrorBody, GrpcCode, HeaderStyle, Style, quoted};
use super::service::RateLimitService;
use crate::decision::Decision;
use crate::quota::Quota;

/// A tower layer that rate-limits requests with a tollgate limiter.
///
/// Admitted requests reach the inner service, and their responses get the rate-limit
/// headers ([`HeaderStyle`]). Denied requests get `429 Too Many Requests` with the same
/// headers, `Retry-After` (whole seconds, rounded up, at least 1) and a JSON body
/// ([`ErrorBody`]); the inner service is not called. A gRPC call (`content-type:
/// application/grpc…`) is denied the gRPC way instead: HTTP 200 with `grpc-status: 8`
/// (`RESOURCE_EXHAUSTED`, or [`grpc_code`](Self::grpc_code)), a `grpc-message`, the same
/// headers as metadata and an empty body.
///
/// The response body is [`RateLimitBody`](super::RateLimitBody): the inner service's body
/// or the layer's own, so the layer wraps any service whose body is an
/// `http_body::Body<Data = Bytes>` (axum, hyper, tonic, tower-http's layers).
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
///     .layer(
///         RateLimitLayer::new(limiter)
///             .key(KeyExtractor::peer_ip())
///             .exempt_paths(["/healthz"]),
///     );
/// // Serve with `app.into_make_service_with_connect_info::<SocketAddr>()` so the layer
/// // sees each connection's address.
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// **Per-route quotas.** Give each group of routes its own layer with
/// `Router::route_layer` (not `layer`), then `merge` the groups: `route_layer` limits only
/// requests that match one of the group's routes, so an unknown path (axum's fallback)
/// consumes no group's quota. To give some clients a different quota on the same routes,
/// use [`RateLimiter::set_quota`](crate::RateLimiter::set_quota) on the layer's limiter.
pub struct RateLimitLayer<K = String, E: ExtractKey<K> = KeyExtractor> {
    config: Arc<Config<K, E>>,
}

impl<K, E: ExtractKey<K>> Clone for RateLimitLayer<K, E> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
        }
    }
}

impl<K: fmt::Debug, E: ExtractKey<K> + fmt::Debug> fmt::Debug for RateLimitLayer<K, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.config.key)
            .field("missing", &self.config.missing)
            .field("style", &self.config.style)
            .field("limits", &self.config.limits)
            .field("exempt", &self.config.exempt)
            .field("shape", &self.config.shape)
            .field("shadow", &self.config.shadow)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer<String, KeyExtractor> {
    /// Limits with `limiter` (a [`RateLimiter`](crate::RateLimiter), a
    /// [`SyncedLimiter`](crate::sync::SyncedLimiter), or a
    /// [`RedisLimiter`](crate::redis::RedisLimiter) with its fail mode: see
    /// [`LayerLimiter`]), keyed by the peer address (see [`KeyExtractor`]).
    pub fn new<L: LayerLimiter<String>>(limiter: L) -> Self {
        Self::keyed(limiter, KeyExtractor::peer_ip())
    }

    /// Limits with the Redis tier, keyed by the peer address; when Redis fails,
    /// `on_failure` decides. The same as `new((limiter, on_failure))`.
    #[cfg(feature = "redis")]
    pub fn redis(limiter: crate::redis::RedisLimiter, on_failure: crate::redis::FailMode) -> Self {
        Self::new((limiter, on_failure))
    }
}

impl<K, E> RateLimitLayer<K, E>
where
    K: crate::Key + Clone + Borrow<E::Lookup>,
    E: ExtractKey<K> + Clone,
{
    /// Limits with `limiter` (of any key type, any of the [`LayerLimiter`]s), keyed by
    /// `extractor`: a [`KeyExtractor`] for `String` keys, [`key_fn`](super::key_fn) or
    /// your own [`ExtractKey`].
    pub fn keyed<L: LayerLimiter<K>>(limiter: L, extractor: E) -> Self {
        let Backing {
            backend,
            name,
            quota,
            capacity,
            also,
            plans,
        } = limiter.into_backing();
        let window = |q: Quota| {
            let period = q.period();
            period.as_secs() + u64::from(period.subsec_nanos() > 0)
        };
        let mut first_extra = 1 + also.len();
        let mut style = Style::new(window(quota), Some(capacity));
        if !also.is_empty() {
            let also: Vec<(u64, u64)> = also.iter().map(|&(q, cap)| (cap, window(q))).collect();
            style.set_also(&also);
        }
        let plans = (!plans.is_empty()).then(|| {
            let table: Arc<[PlanFields]> = plans
                .into_iter()
                .map(|(name, quotas)| {
                    let quotas = quotas.iter().map(|&(q, cap)| (cap, window(q))).collect();
                    (name, quotas)
                })
                .collect();
            // Further limits' decisions come after every plan's own quotas.
            first_extra = table.iter().map(|(_, q)| q.len()).max().unwrap_or(1);
            style.set_extras_at(first_extra);
            let mut plans = PlanStyles {
                table,
                styles: Arc::from([]),
                from: None,
            };
            plans.remake(&style);
            plans
        });
        Self {
            config: Arc::new(Config {
                backend,
                name,
                key: extractor,
                missing: MissingKey::Reject,
                style: Arc::new(style),
                limits: KeyLimits::default(),
                exempt: Exempt::default(),
                deny_hook: None,
                decision_hook: None,
                rejection_hook: None,
                shape: None,
                shadow: false,
                extras: Vec::new(),
                #[cfg(feature = "redis")]
                remote_extras: Vec::new(),
                first_extra,
                plans,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config<K, E>)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        f(config);
        if let Some(plans) = &mut config.plans {
            plans.remake(&config.style);
        }
        self
    }

    /// For a layer of [`Plans`](crate::plans::Plans), or of a Redis limiter with plans
    /// (`RedisBuilder::plan`): takes each request's plan from
    /// the request (the plan an authentication layer put in its extensions, say)
    /// rather than from the key's plan book. `plan` returns the plan's name, or `None`
    /// for the key's own plan; a name the limiter lacks decides by its default plan.
    /// A layer of any other limiter ignores it.
    ///
    /// Never read a plan from a header the client sets: it would choose its own plan.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tollgate::http::{KeyExtractor, RateLimitLayer};
    /// use tollgate::plans::Plans;
    ///
    /// /// What the authentication layer puts in each request's extensions.
    /// #[derive(Clone)]
    /// struct Account {
    ///     plan: Arc<str>,
    /// }
    ///
    /// let plans: Plans<String> = Plans::builder("free")
    ///     .plan("free", ["60/min".parse()?])
    ///     .plan("pro", ["600/min".parse()?])
    ///     .build()?;
    /// let layer = RateLimitLayer::keyed(plans, KeyExtractor::header("x-api-key")?)
    ///     .plan_from(|head| head.extensions.get::<Account>().map(|a| a.plan.clone()));
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn plan_from<F, R>(self, plan: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> Option<R> + Send + Sync + 'static,
        R: AsRef<str>,
    {
        let from: PlanFn = Arc::new(move |head, found| {
            if let Some(name) = plan(head) {
                found(name.as_ref());
            }
        });
        self.edit(|c| {
            if let Some(plans) = &mut c.plans {
                plans.from = Some(from);
            }
        })
    }

    /// How requests are keyed; [`KeyExtractor::peer_ip`] by default for `String` keys.
    /// The new extractor looks keys up the same way (`str` for `String` keys).
    pub fn key<E2>(self, key: E2) -> RateLimitLayer<K, E2>
    where
        E2: ExtractKey<K, Lookup = E::Lookup> + Clone,
    {
        let config = Arc::unwrap_or_clone(self.config);
        RateLimitLayer {
            config: Arc::new(Config {
                backend: config.backend,
                name: config.name,
                key,
                missing: config.missing,
                style: config.style,
                limits: config.limits,
                exempt: config.exempt,
                deny_hook: config.deny_hook,
                decision_hook: config.decision_hook,
                rejection_hook: config.rejection_hook,
                shape: config.shape,
                shadow: config.shadow,
                extras: config.extras,
                #[cfg(feature = "redis")]
                remote_extras: config.remote_extras,
                first_extra: config.first_extra,
                plans: config.plans,
            }),
        }
    }

    /// What to do with a request that has no key; [`MissingKey::Reject`] by default.
    pub fn on_missing_key(self, missing: MissingKey<K>) -> Self {
        self.edit(|c| c.missing = missing)
    }

    /// The longest text key accepted, in bytes (256 by default), and what a longer one
    /// gets: a 400, or its digest as the key.
    pub fn max_key_len(self, max_len: usize, oversized: OversizedKey) -> Self {
        self.edit(|c| c.limits = KeyLimits { max_len, oversized })
    }

    /// Lets requests for these paths through unlimited: exact paths (`/healthz`), or
    /// prefixes ending in `*` (`/static/*`). The query string is not part of the path.
    pub fn exempt_paths<I, P>(self, paths: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.edit(|c| c.exempt.paths(paths))
    }

    /// Lets requests with these methods through unlimited (`OPTIONS` preflights, say).
    pub fn exempt_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.edit(|c| c.exempt.methods(methods))
    }

    /// Lets requests whose connection comes from these networks through unlimited (the
    /// peer address, as [`KeyExtractor::peer_ip`] reads it; forwarding headers are not
    /// trusted for this).
    pub fn exempt_networks(self, networks: impl IntoIterator<Item = Cidr>) -> Self {
        self.edit(|c| c.exempt.networks(networks))
    }

    /// Lets requests for which `predicate` holds through unlimited.
    pub fn exempt_if(
        self,
        predicate: impl Fn(&RequestHead<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.edit(|c| c.exempt.predicate(Arc::new(predicate)))
    }

    /// Answers denied HTTP requests with `hook`'s response instead of the JSON 429. The
    /// layer adds the rate-limit headers and `Retry-After` where the hook did not set
    /// them. gRPC calls are still denied with a gRPC status.
    pub fn on_deny(
        self,
        hook: impl Fn(&Decision, &RequestHead<'_>) -> http::Response<bytes::Bytes>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.edit(|c| c.deny_hook = Some(Arc::new(hook)))
    }

    /// Calls `hook` with every decision the layer makes (not for exempt or keyless
    /// requests it lets through), with the request's head and, on the Redis tier, the
    /// error its [`FailMode`](crate::redis::FailMode) answered for: for audit logs. The
    /// hook runs before the response is made; keep it quick.
    pub fn on_decision(self, hook: impl Fn(&DecisionEvent<'_>) + Send + Sync + 'static) -> Self {
        self.edit(|c| c.decision_hook = Some(Arc::new(hook)))
    }

    /// Calls `hook` with every request the layer rejects before deciding — no key under
    /// [`MissingKey::Reject`], a key that is not UTF-8, one longer than the maximum —
    /// with what the key extractor looked for, so that an audit log can tell these 400s
    /// from the inner service's. They are also counted, as `tollgate_decisions_total`
    /// with `outcome="rejected"` and a `reason` label (`missing_key`, `invalid_key`,
    /// `oversized_key`), with the `metrics` feature.
    pub fn on_rejected(self, hook: impl Fn(&RejectionEvent<'_>) + Send + Sync + 'static) -> Self {
        self.edit(|c| c.rejection_hook = Some(Arc::new(hook)))
    }

    /// Shapes traffic like nginx's `limit_req` without `nodelay`: a request the leaky
    /// bucket admits for a later slot waits for that slot (at most `max_delay`) before it
    /// reaches the inner service, so requests leave evenly spaced. A request whose slot
    /// is further away is denied, consuming nothing. Other algorithms admit no delay, so
    /// this changes nothing for them.
    pub fn shape(self, max_delay: Duration) -> Self {
        self.edit(|c| c.shape = Some(max_delay))
    }

    /// Holds each request to `limiter` as well, keyed by `key`, all or nothing with the
    /// layer's own limiter and every other limit added this way: a request is admitted
    /// only if every limit admits it, and then consumes one unit from each; a denied
    /// request consumes from none (the limits that admitted it get their unit back). For
    /// example per API key, per client IP and one global limit, in one layer. Stacking
    /// layers cannot do this: the outer one consumes even when the inner one denies.
    ///
    /// The further limits are decided first, in the order added (those in Redis,
    /// [`and_redis`](Self::and_redis), after the in-process ones); a request with no key
    /// for one of them is not held to it (a key it rejects is a 400, as for the layer's
    /// own). The response's headers describe the most constraining limit: on a deny the
    /// one that denied, on an admission the one with the fewest units left.
    /// `RateLimit-Policy` lists every limit, each further one named by its limiter's
    /// [`name`](crate::Builder::name). See [`RateLimiter::refund`](crate::RateLimiter::refund)
    /// for the exact refunds, and the race they leave: a request racing a doomed one on
    /// the same key may be denied for the moment the doomed one holds a unit.
    ///
    /// ```
    /// use axum::{body::Body, routing::get, Router};
    /// use http::{Request, StatusCode};
    /// use tollgate::http::{key_fn, KeyExtractor, RateLimitLayer};
    /// use tollgate::RateLimiter;
    /// use tower::ServiceExt;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let per_key: RateLimiter<String> = RateLimiter::new("2/min".parse()?);
    /// // One key for every request: a limit for the whole service.
    /// let global: RateLimiter<()> = RateLimiter::builder("3/min".parse()?).name("global").build()?;
    /// let app = Router::new().route("/", get(|| async { "hello" })).layer(
    ///     RateLimitLayer::new(per_key)
    ///         .key(KeyExtractor::header("x-api-key")?)
    ///         .and(global.clone(), key_fn(|_| Some(())))?,
    /// );
    /// let call = |key: &str| Request::get("/").header("x-api-key", key).body(Body::empty()).unwrap();
    /// let status = |r: http::Response<_>| r.status();
    /// assert_eq!(status(app.clone().oneshot(call("a")).await?), StatusCode::OK);
    /// assert_eq!(status(app.clone().oneshot(call("a")).await?), StatusCode::OK);
    /// // The key's own limit denies its third request: the global limit keeps its unit.
    /// assert_eq!(status(app.clone().oneshot(call("a")).await?), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(global.peek(&()).remaining(), 1);
    /// assert_eq!(status(app.clone().oneshot(call("b")).await?), StatusCode::OK);
    /// // Now the global limit denies, and b's own limit keeps its unit.
    /// assert_eq!(status(app.oneshot(call("b")).await?), StatusCode::TOO_MANY_REQUESTS);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::Unsupported`](crate::ConfigError::Unsupported) for a sliding-log
    /// limiter, which cannot give a unit back.
    pub fn and<K2, C2, E2>(
        self,
        limiter: crate::RateLimiter<K2, C2>,
        key: E2,
    ) -> Result<Self, crate::ConfigError>
    where
        K2: crate::Key + Borrow<E2::Lookup>,
        C2: crate::clock::Clock,
        E2: ExtractKey<K2>,
    {
        if limiter.algorithm() == crate::Algorithm::SlidingLog {
            return Err(crate::ConfigError::Unsupported(
                "a further limit (`and`) with the sliding log, which cannot give back the \
                 unit of a request another limit denies: use the sliding window counter \
                 or a bucket",
            ));
        }
        let extra = Extra { limiter, key };
        let (name, quota, capacity) = extra.policy();
        let name = quoted(name);
        let window = quota.period().as_secs() + u64::from(quota.period().subsec_nanos() > 0);
        Ok(self.edit(|c| {
            Arc::make_mut(&mut c.style).push_policy(name, capacity, window);
            let policy = c.next_policy();
            c.extras.push((policy, Arc::new(extra)));
        }))
    }

    /// Holds each request to a [`RedisLimiter`](crate::redis::RedisLimiter) as well, keyed
    /// by `key`, all or nothing with the layer's own limiter and the other further
    /// limits, as [`and`](Self::and) does for an in-process one: for example a global
    /// limit per API key held exactly across the fleet, besides a per-IP limit in
    /// process.
    ///
    /// The in-process further limits are decided first, then those in Redis in the order
    /// added (one script call each), then the layer's own limiter. When one denies, every
    /// limit before it gets its unit back, the Redis ones by a refund script call before
    /// the answer goes out. The keys of different limits are different Redis keys (on a
    /// Cluster, different slots), so they are decided one after the other, not in one
    /// script: nothing is ever admitted beyond any one limit, and between a unit's
    /// consumption and its refund (a round trip) a request racing it may be denied where
    /// it would otherwise pass. When Redis fails, `on_failure` decides for this limit
    /// (as for [`redis`](Self::redis)); a unit a fail mode admitted is not given back to
    /// Redis, which never took it. The limiter's first quota is listed in
    /// `RateLimit-Policy`, named by its [`name`](crate::redis::RedisBuilder::name).
    ///
    /// ```no_run
    /// use axum::{routing::get, Router};
    /// use tollgate::http::{KeyExtractor, RateLimitLayer};
    /// use tollgate::redis::{FailMode, RedisLimiter};
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let per_ip: RateLimiter<String> = RateLimiter::new("20/s".parse()?);
    /// let per_key = RedisLimiter::builder("redis://127.0.0.1/", "1000/h".parse()?)
    ///     .name("api-key")
    ///     .build()
    ///     .await?;
    /// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(
    ///     RateLimitLayer::new(per_ip) // keyed by the peer address
    ///         .and_redis(per_key, FailMode::Closed, KeyExtractor::header("x-api-key")?),
    /// );
    /// # let _ = app;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn and_redis<E2: ExtractKey<String>>(
        self,
        limiter: crate::redis::RedisLimiter,
        on_failure: crate::redis::FailMode,
        key: E2,
    ) -> Self {
        let (quota, capacity) = (limiter.quota(), limiter.quota_capacity());
        let name = quoted(limiter.name());
        let window = quota.period().as_secs() + u64::from(quota.period().subsec_nanos() > 0);
        self.edit(|c| {
            Arc::make_mut(&mut c.style).push_policy(name, capacity, window);
            let policy = c.next_policy();
            c.remote_extras.push(Arc::new(super::extra::RedisExtra {
                limiter,
                on_failure,
                key: Box::new(key),
                policy,
            }));
        })
    }

    /// Shadow mode, for rolling a limit out on live traffic before enforcing it: the
    /// layer decides as usual, consumes quota, adds the rate-limit headers and reports
    /// every decision (metrics, [`on_decision`](Self::on_decision)), but never denies.
    /// A request the limiter denied reaches the inner service like an admitted one,
    /// with the deny's `RateLimit` fields (no `Retry-After`); the decision hook sees it
    /// with [`DecisionEvent::shadow`] set, and the `metrics` feature counts it as
    /// `tollgate_decisions_total{outcome="shadow_denied"}` (the limiter still counts
    /// it as `denied`). Off by default.
    ///
    /// ```
    /// use axum::{body::Body, routing::get, Router};
    /// use http::{Request, StatusCode};
    /// use tollgate::http::{KeyExtractor, RateLimitLayer};
    /// use tollgate::RateLimiter;
    /// use tower::ServiceExt;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// // Watch what 1/s per key would deny before enforcing it.
    /// let limiter: RateLimiter<String> = RateLimiter::new("1/s".parse()?);
    /// let app = Router::new().route("/", get(|| async { "hello" })).layer(
    ///     RateLimitLayer::new(limiter.clone())
    ///         .key(KeyExtractor::header("x-api-key")?)
    ///         .shadow(true)
    ///         .on_decision(|event| {
    ///             if event.shadow {
    ///                 println!("would have denied {}", event.head.uri.path());
    ///             }
    ///         }),
    /// );
    /// let request = || Request::get("/").header("x-api-key", "k").body(Body::empty()).unwrap();
    /// assert_eq!(app.clone().oneshot(request()).await?.status(), StatusCode::OK);
    /// let shadowed = app.oneshot(request()).await?; // denied, yet served
    /// assert_eq!(shadowed.status(), StatusCode::OK);
    /// assert_eq!(shadowed.headers()["ratelimit-remaining"], "0");
    /// assert!(shadowed.headers().get("retry-after").is_none());
    /// assert_eq!(limiter.stats().denied, 1); // the limiter did decide a deny
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shadow(self, on: bool) -> Self {
        self.edit(|c| c.shadow = on)
    }

    /// The gRPC status of a denied gRPC call; [`GrpcCode::ResourceExhausted`] by default.
    pub fn grpc_code(self, code: GrpcCode) -> Self {
        self.edit(|c| Arc::make_mut(&mut c.style).grpc = code)
    }

    /// Which rate-limit headers responses carry; [`HeaderStyle::Both`] by default.
    pub fn headers(self, headers: HeaderStyle) -> Self {
        self.edit(|c| Arc::make_mut(&mut c.style).headers = headers)
    }

    /// The body of a 429; [`ErrorBody::Json`] by default.
    pub fn error_body(self, body: ErrorBody) -> Self {
        self.edit(|c| Arc::make_mut(&mut c.style).body = body)
    }

    /// The policy name in the IETF fields; `default` by default. Quotes and backslashes
    /// are escaped.
    pub fn policy_name(self, name: &str) -> Self {
        self.edit(|c| Arc::make_mut(&mut c.style).set_policy(quoted(name)))
    }

    /// The policy names in the IETF fields of a limiter with several quotas
    /// ([`Builder::also`](crate::Builder::also)), in the order of its quotas: by default
    /// `default`, `also1`, `also2`, …. `RateLimit-Policy` lists every quota, and
    /// `RateLimit` reports the one nearest exhaustion ([`Decision::policy`]), as the IETF
    /// draft (-11) describes.
    ///
    /// ```
    /// use axum::{body::Body, routing::get, Router};
    /// use http::Request;
    /// use tollgate::http::{KeyExtractor, RateLimitLayer};
    /// use tollgate::RateLimiter;
    /// use tower::ServiceExt;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let limiter: RateLimiter<String> = RateLimiter::builder("10/s burst 20".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build()?;
    /// let app = Router::new().route("/", get(|| async { "hello" })).layer(
    ///     RateLimitLayer::new(limiter)
    ///         .key(KeyExtractor::header("x-api-key")?)
    ///         .policy_names(["burst", "daily"]),
    /// );
    /// let request = Request::get("/").header("x-api-key", "k").body(Body::empty())?;
    /// let response = app.oneshot(request).await?;
    /// assert_eq!(
    ///     response.headers()["ratelimit-policy"],
    ///     "\"burst\";q=20;w=1, \"daily\";q=1000;w=86400"
    /// );
    /// assert_eq!(response.headers()["ratelimit"], "\"burst\";r=19;t=1");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn policy_names<I, N>(self, names: I) -> Self
    where
        I: IntoIterator<Item = N>,
        N: AsRef<str>,
    {
        let names: Vec<String> = names.into_iter().map(|n| quoted(n.as_ref())).collect();
        self.edit(|c| Arc::make_mut(&mut c.style).set_policies(names))
    }
}

impl<S, K, E: ExtractKey<K>> Layer<S> for RateLimitLayer<K, E> {
    type Service = RateLimitService<S, K, E>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, Arc::clone(&self.config))
    }
}
