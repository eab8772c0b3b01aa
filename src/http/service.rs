//! `RateLimitService`: decides, then calls the inner service or answers itself.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::future::ResponseFuture;
use super::layer::{Backend, Config, MissingKey};
use crate::decision::Decision;

/// A service rate-limited by a [`RateLimitLayer`](super::RateLimitLayer).
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService").finish_non_exhaustive()
    }
}

/// What a request needs once its key is known.
enum Step {
    /// The local limiter decided.
    Decided(Decision),
    /// The Redis tier will decide, for this key.
    #[cfg(feature = "redis")]
    Remote(crate::redis::RedisLimiter, crate::redis::FailMode, String),
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// Calls the inner service for an admitted request (its response gets the headers),
    /// or answers a denied one with a 429.
    fn respond<ReqBody, ResBody>(
        &mut self,
        decision: Decision,
        req: Request<ReqBody>,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ResBody: From<String>,
    {
        if decision.is_allowed() {
            ResponseFuture::admitted(self.inner.call(req), decision, Arc::clone(&self.config))
        } else {
            ResponseFuture::ready(self.config.style.too_many_requests(&decision))
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let config = Arc::clone(&self.config);
        let step = {
            let extracted = config.key.extract(&req);
            let key = match (&extracted, &config.missing) {
                (Some(key), _) => key.as_str(),
                (None, MissingKey::Shared(bucket)) => bucket.as_str(),
                (None, MissingKey::Reject) => {
                    return ResponseFuture::ready(config.style.missing_key());
                }
            };
            match &config.backend {
                Backend::Local(limiter) => Step::Decided(limiter.check(key)),
                #[cfg(feature = "redis")]
                Backend::Redis(limiter, on_failure) => {
                    Step::Remote(limiter.clone(), *on_failure, key.to_owned())
                }
            }
        };
        match step {
            Step::Decided(decision) => self.respond(decision, req),
            #[cfg(feature = "redis")]
            Step::Remote(limiter, on_failure, key) => {
                // The inner service was made ready for this call: take it, and leave a
                // clone for the next one.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::deferred(Box::pin(async move {
                    let decision = limiter.check_or(&key, on_failure).await;
                    let mut service = RateLimitService { inner, config };
                    service.respond(decision, req).await
                }))
            }
        }
    }
}
