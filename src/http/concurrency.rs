//! `ConcurrencyLimitLayer`: at most N requests in flight per key, each holding its slot
//! until its response body ends (or a gRPC stream closes).
//!
//! ```text
//! request ─► key (the rate layer's extractors) ─► try_acquire ─┬─► inner service ─► body holds the permit
//!                                                              └─► 429 / RESOURCE_EXHAUSTED + Retry-After
//! ```

use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::body::RateLimitBody;
use super::config::MissingKey;
use super::extract::{ExtractKey, KeyLimits, KeyRejection, is_grpc};
use super::key::KeyExtractor;
use super::response::{GrpcCode, Style, grpc_status, json_escaped};
use super::values;
use crate::concurrency::{ConcurrencyError, ConcurrencyLimiter, Permit};

/// A tower layer that holds each request to a per-key concurrency limit: at most `max`
/// requests of a key in flight at once, each holding its slot until its response body
/// has been sent (or dropped), so a streamed response or a gRPC stream holds it for as
/// long as it is open.
///
/// A request over the limit gets `429 Too Many Requests` with `Retry-After` (a hint, 1 s
/// by default: [`retry_after`](Self::retry_after)) and a JSON body, or for a gRPC call
/// `RESOURCE_EXHAUSTED` with `retry-after` and `grpc-retry-pushback-ms` metadata; the
/// inner service is not called. Keys come from the same extractors as
/// [`RateLimitLayer`](super::RateLimitLayer)'s ([`KeyExtractor`], [`key_fn`](super::key_fn)).
///
/// With a rate limit on the same requests, put this layer outside the rate layer (in
/// axum, the later `.layer` call): a request it refuses never reaches the rate limit, and
/// one the rate limit denies holds its slot only while the 429 is sent, so neither limit
/// is charged for a request the other refused.
///
/// ```
/// use axum::{routing::get, Router};
/// use tollgate::http::{ConcurrencyLimitLayer, KeyExtractor, RateLimitLayer};
/// use tollgate::{ConcurrencyLimiter, RateLimiter};
///
/// let rate: RateLimiter<String> = RateLimiter::new("100/min".parse()?);
/// let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(2);
/// let app: Router = Router::new()
///     .route("/report", get(|| async { "a slow report" }))
///     .layer(RateLimitLayer::new(rate).key(KeyExtractor::header("x-api-key")?))
///     .layer(ConcurrencyLimitLayer::new(slots).key(KeyExtractor::header("x-api-key")?));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ConcurrencyLimitLayer<K = String, E: ExtractKey<K> = KeyExtractor> {
    shared: Arc<Shared<K, E>>,
}

struct Shared<K, E> {
    limiter: ConcurrencyLimiter<K>,
    key: E,
    limits: KeyLimits,
    missing: MissingKey<K>,
    retry_after: Duration,
    grpc: GrpcCode,
    /// How long a request of a full key waits in its line; `None`: not at all.
    queue: Option<Duration>,
    /// The 400s for requests without a usable key.
    style: Style,
}

impl<K, E: ExtractKey<K>> Clone for ConcurrencyLimitLayer<K, E> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K: crate::Key, E: ExtractKey<K> + fmt::Debug> fmt::Debug for ConcurrencyLimitLayer<K, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitLayer")
            .field("limiter", &self.shared.limiter)
            .field("key", &self.shared.key)
            .field("retry_after", &self.shared.retry_after)
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimitLayer<String, KeyExtractor> {
    /// Limits with `limiter`, keyed by the peer address (see [`KeyExtractor`]).
    pub fn new(limiter: ConcurrencyLimiter<String>) -> Self {
        Self::keyed(limiter, KeyExtractor::peer_ip())
    }
}

impl<K, E> ConcurrencyLimitLayer<K, E>
where
    K: crate::Key + Clone + Borrow<E::Lookup>,
    E: ExtractKey<K> + Clone,
{
    /// Limits with `limiter` (of any key type), keyed by `extractor`.
    pub fn keyed(limiter: ConcurrencyLimiter<K>, extractor: E) -> Self {
        Self {
            shared: Arc::new(Shared {
                limiter,
                key: extractor,
                limits: KeyLimits::default(),
                missing: MissingKey::Reject,
                retry_after: Duration::from_secs(1),
                grpc: GrpcCode::ResourceExhausted,
                queue: None,
                style: Style::new(1, None),
            }),
        }
    }

    fn edit(self, f: impl FnOnce(&mut Shared<K, E>)) -> Self {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|s| copied(&s));
        f(&mut shared);
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Keys requests with `key` instead.
    pub fn key<E2>(self, key: E2) -> ConcurrencyLimitLayer<K, E2>
    where
        E2: ExtractKey<K> + Clone,
        K: Borrow<E2::Lookup>,
    {
        let shared = Arc::try_unwrap(self.shared).unwrap_or_else(|s| copied(&s));
        ConcurrencyLimitLayer {
            shared: Arc::new(Shared {
                limiter: shared.limiter,
                key,
                limits: shared.limits,
                missing: shared.missing,
                retry_after: shared.retry_after,
                grpc: shared.grpc,
                queue: shared.queue,
                style: shared.style,
            }),
        }
    }

    /// What a request without a key gets (as the rate layer's): a 400 by default.
    pub fn on_missing_key(self, missing: MissingKey<K>) -> Self {
        self.edit(|s| s.missing = missing)
    }

    /// The longest key accepted, and what a longer one gets (as the rate layer's).
    pub fn max_key_len(self, max_len: usize, oversized: super::OversizedKey) -> Self {
        self.edit(|s| s.limits = KeyLimits { max_len, oversized })
    }

    /// The `Retry-After` of a refused request, a hint (a slot comes free when some
    /// request of the key ends, which no one can know ahead): whole seconds, rounded up,
    /// at least 1; 1 s by default.
    pub fn retry_after(self, hint: Duration) -> Self {
        self.edit(|s| s.retry_after = hint)
    }

    /// Lets a request of a full key wait in the key's line, in arrival order, for up to
    /// `max_wait` before it is refused (tower's `ConcurrencyLimit` waits without end;
    /// by default this layer refuses at once). A request that waits holds a task and its
    /// connection meanwhile, and its wait counts in
    /// [`ConcurrencyLimiter::stats`](crate::ConcurrencyLimiter::stats).
    pub fn queue(self, max_wait: Duration) -> Self {
        self.edit(|s| s.queue = Some(max_wait))
    }

    /// The gRPC status of a refused call (`RESOURCE_EXHAUSTED` by default).
    pub fn grpc_code(self, code: GrpcCode) -> Self {
        self.edit(|s| s.grpc = code)
    }
}

/// A copy of `shared` (for a layer whose configuration is shared with services already
/// made): every field but the 400s' style, which is made anew.
fn copied<K: Clone, E: Clone>(shared: &Shared<K, E>) -> Shared<K, E> {
    Shared {
        limiter: shared.limiter.clone(),
        key: shared.key.clone(),
        limits: shared.limits,
        missing: shared.missing.clone(),
        retry_after: shared.retry_after,
        grpc: shared.grpc,
        queue: shared.queue,
        style: Style::new(1, None),
    }
}

impl<S, K, E: ExtractKey<K>> Layer<S> for ConcurrencyLimitLayer<K, E> {
    type Service = ConcurrencyLimitService<S, K, E>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimitService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// A service held to a [`ConcurrencyLimitLayer`]'s limit.
pub struct ConcurrencyLimitService<S, K = String, E: ExtractKey<K> = KeyExtractor> {
    inner: S,
    shared: Arc<Shared<K, E>>,
}

impl<S: Clone, K, E: ExtractKey<K>> Clone for ConcurrencyLimitService<S, K, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K, E: ExtractKey<K>> fmt::Debug for ConcurrencyLimitService<S, K, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitService")
            .finish_non_exhaustive()
    }
}

/// The 429 (or gRPC status) for a refused request.
fn refused<K, E, R>(
    shared: &Shared<K, E>,
    refusal: &ConcurrencyError,
    grpc: bool,
) -> Response<RateLimitBody<R>> {
    let retry = shared.retry_after.as_nanos().div_ceil(1_000_000_000).max(1) as u64;
    let message = match refusal {
        ConcurrencyError::Full { max, .. } => format!(
            "Too many requests in flight: at most {max} at once; retry in {retry} second{}.",
            if retry == 1 { "" } else { "s" }
        ),
        other => {
            let mut m = other.to_string();
            m.push('.');
            m
        }
    };
    let mut response = if grpc {
        let mut response = grpc_status(shared.grpc.number(), &message);
        response.headers_mut().insert(
            GRPC_RETRY_PUSHBACK,
            values::number_value(retry.saturating_mul(1_000)),
        );
        response
    } else {
        let body = format!(
            r#"{{"error":"concurrency_limit_exceeded","message":"{}","retry_after_seconds":{retry}}}"#,
            json_escaped(&message)
        );
        let mut response = Response::new(RateLimitBody::own(body));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    };
    response
        .headers_mut()
        .insert(RETRY_AFTER, values::number_value(retry));
    response
}

/// What the layer makes of a request.
enum Admission<K, R> {
    /// To the inner service, with its slot (none for a keyless request let through).
    Pass(Option<Permit>),
    /// Into the key's line (with [`ConcurrencyLimitLayer::queue`]).
    Wait(K),
    /// Answered by the layer.
    Answer(Response<RateLimitBody<R>>),
}

/// `grpc-retry-pushback-ms`, as the rate layer sends it.
const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

impl<S, K, E> ConcurrencyLimitService<S, K, E>
where
    K: crate::Key + Borrow<E::Lookup>,
    E: ExtractKey<K>,
{
    /// A permit for `req` (none for a keyless request let through), or the layer's own
    /// answer.
    fn admit<B, R>(&self, req: &Request<B>) -> Admission<K, R> {
        let shared = &*self.shared;
        let extracted = shared.key.extract(req, &shared.limits);
        let key: &E::Lookup = match &extracted {
            Ok(key) => key.borrow(),
            Err(KeyRejection::Missing) => match &shared.missing {
                MissingKey::Reject => {
                    return Admission::Answer(self.rejected(KeyRejection::Missing, req));
                }
                MissingKey::Shared(key) => key.borrow(),
                MissingKey::Allow => return Admission::Pass(None),
            },
            Err(why) => return Admission::Answer(self.rejected(*why, req)),
        };
        match shared.limiter.try_acquire(key) {
            Ok(permit) => Admission::Pass(Some(permit)),
            Err(ConcurrencyError::Full { .. }) if shared.queue.is_some() => {
                Admission::Wait(key.to_owned())
            }
            Err(refusal) => Admission::Answer(refused(shared, &refusal, is_grpc(req))),
        }
    }

    fn rejected<B, R>(&self, why: KeyRejection, req: &Request<B>) -> Response<RateLimitBody<R>> {
        let looked_for = self.shared.key.looks_for(req);
        super::observe::http_rejected(self.shared.limiter.name(), why);
        self.shared.style.rejected(why, &looked_for, is_grpc(req))
    }
}

impl<S, K, E, ReqBody, ResBody> Service<Request<ReqBody>> for ConcurrencyLimitService<S, K, E>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
    K: crate::Key + Clone + Borrow<E::Lookup>,
    E: ExtractKey<K>,
{
    type Response = Response<PermitBody<ResBody>>;
    type Error = S::Error;
    type Future = PermitFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let state = match self.admit::<_, ResBody>(&req) {
            Admission::Pass(permit) => FutureState::Admitted {
                inner: self.inner.call(req),
                permit,
            },
            Admission::Answer(response) => FutureState::Answered {
                response: Some(response.map(|body| PermitBody { body, permit: None })),
            },
            Admission::Wait(key) => {
                // The service made ready for this call goes with the wait; a clone stays.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let shared = Arc::clone(&self.shared);
                FutureState::Waiting {
                    future: Box::pin(async move {
                        let max_wait = shared.queue.unwrap_or_default();
                        match shared.limiter.acquire_timeout::<K>(&key, max_wait).await {
                            Ok(permit) => Ok(inner.call(req).await?.map(|body| PermitBody {
                                body: RateLimitBody::inner(body),
                                permit: Some(permit),
                            })),
                            Err(refusal) => Ok(refused(&shared, &refusal, is_grpc(&req))
                                .map(|body| PermitBody { body, permit: None })),
                        }
                    }),
                }
            }
        };
        PermitFuture { state }
    }
}

/// A response that waits for its slot first.
type Waiting<B, Er> = Pin<Box<dyn Future<Output = Result<Response<PermitBody<B>>, Er>> + Send>>;

pin_project! {
    /// The response to a request under a [`ConcurrencyLimitLayer`]: the inner service's,
    /// whose body then holds the request's slot, or the layer's own 429 (or 400, or gRPC
    /// status).
    pub struct PermitFuture<F, B, Er> {
        #[pin]
        state: FutureState<F, B, Er>,
    }
}

pin_project! {
    #[project = FutureProjection]
    enum FutureState<F, B, Er> {
        Admitted {
            #[pin]
            inner: F,
            permit: Option<Permit>,
        },
        Answered {
            response: Option<Response<PermitBody<B>>>,
        },
        Waiting {
            future: Waiting<B, Er>,
        },
    }
}

impl<F, B, Er> Future for PermitFuture<F, B, Er>
where
    F: Future<Output = Result<Response<B>, Er>>,
{
    type Output = Result<Response<PermitBody<B>>, Er>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            FutureProjection::Admitted { inner, permit } => {
                let response = std::task::ready!(inner.poll(cx))?;
                // The slot goes with the body; an error drops it with the future.
                let permit = permit.take();
                Poll::Ready(Ok(response.map(|body| PermitBody {
                    body: RateLimitBody::inner(body),
                    permit,
                })))
            }
            FutureProjection::Answered { response } => Poll::Ready(Ok(response
                .take()
                .expect("a PermitFuture polled after it completed"))),
            FutureProjection::Waiting { future } => future.as_mut().poll(cx),
        }
    }
}

pin_project! {
    /// The response body under a [`ConcurrencyLimitLayer`]: the inner body (or the
    /// layer's own), holding the request's slot until its last frame has been sent or it
    /// is dropped (the client went away).
    pub struct PermitBody<B> {
        #[pin]
        body: RateLimitBody<B>,
        permit: Option<Permit>,
    }
}

impl<B> PermitBody<B> {
    /// Whether the body still holds its request's slot.
    pub fn holds_slot(&self) -> bool {
        self.permit.as_ref().is_some_and(|p| p.weight() > 0)
    }

    /// Whether the layer wrote this body (it refused the request).
    pub fn is_own(&self) -> bool {
        self.body.is_own()
    }
}

impl<B: fmt::Debug> fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PermitBody")
            .field("body", &self.body)
            .field("holds_slot", &self.holds_slot())
            .finish()
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let frame = std::task::ready!(this.body.poll_frame(cx));
        if frame.is_none() || matches!(frame, Some(Err(_))) {
            // The last frame is out (or the body failed): the request is over.
            this.permit.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
