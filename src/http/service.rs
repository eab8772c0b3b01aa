//! `RateLimitService`: decides, then calls the inner service or answers itself.

use std::borrow::Borrow;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::backend::{Backend, RemoteDecision};
use super::body::RateLimitBody;
use super::config::{Config, DecisionEvent, MissingKey, RejectionEvent};
use super::extra::{self, Extras};
use super::extract::{ExtractKey, KeyRejection, RequestHead, is_grpc};
use super::future::{Pending, ResponseFuture};
use super::key::KeyExtractor;
use super::response::Style;
use crate::clock::nanos;
use crate::decision::Decision;

/// A service rate-limited by a [`RateLimitLayer`](super::RateLimitLayer).
pub struct RateLimitService<S, K = String, E: ExtractKey<K> = KeyExtractor> {
    inner: S,
    config: Arc<Config<K, E>>,
}

impl<S: Clone, K, E: ExtractKey<K>> Clone for RateLimitService<S, K, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S, K, E: ExtractKey<K>> std::fmt::Debug for RateLimitService<S, K, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService").finish_non_exhaustive()
    }
}

/// What a request needs once the layer has looked at it.
enum Step {
    /// Let through unlimited (exempt, or keyless under [`MissingKey::Allow`]).
    Pass,
    /// Answer with a 400 (or gRPC `INVALID_ARGUMENT`).
    Reject(KeyRejection),
    /// The local limiter decided (a limiter of plans: under the plan of this index).
    Decided(Decision, Option<u32>),
    /// The remote tier will decide.
    Remote(RemoteDecision),
}

impl<S, K, E: ExtractKey<K>> RateLimitService<S, K, E> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, E>>) -> Self {
        Self { inner, config }
    }

    /// Takes the inner service, made ready for this call, and leaves a clone for the
    /// next one (for work that finishes after `call` returns).
    fn take_inner(&mut self) -> S
    where
        S: Clone,
    {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

/// Decides `key` of `req` with `config`'s backend.
fn start<K, E: ExtractKey<K>, B>(
    config: &Config<K, E>,
    req: &Request<B>,
    key: &E::Lookup,
    max_delay: u64,
) -> Step {
    match &config.backend {
        Backend::Local(limiter) => Step::Decided(limiter.check(key, max_delay), None),
        Backend::Planned(plans) => {
            let from = config.plans.as_ref().and_then(|p| p.from.as_ref());
            let (decision, plan) = match from {
                Some(from) => {
                    let mut named = None;
                    from(&RequestHead::of(req), &mut |name| {
                        named = Some(plans.check(Some(name), key, max_delay));
                    });
                    named.unwrap_or_else(|| plans.check(None, key, max_delay))
                }
                None => plans.check(None, key, max_delay),
            };
            Step::Decided(decision, Some(plan))
        }
        Backend::Remote(remote) => {
            let from = config.plans.as_ref().and_then(|p| p.from.as_ref());
            let mut named = None;
            if let Some(from) = from {
                from(&RequestHead::of(req), &mut |name| {
                    named = Some(name.to_owned());
                });
            }
            Step::Remote(remote(named.as_deref(), key))
        }
    }
}

impl<S, K, E, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S, K, E>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
    K: Borrow<E::Lookup> + Send + Sync + 'static,
    E: ExtractKey<K>,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let config = &*self.config;
        let max_delay = config.shape.map_or(u64::MAX, nanos);
        let exempt = config.exempt.matches(&req);
        // The further limits first (`and`): if one denies or rejects, the layer's own
        // limiter is not asked.
        let mut held = None;
        if !exempt && !config.extras.is_empty() {
            let (decided, back) = with_head(req, |head| {
                extra::decide(&config.extras, head, &config.limits, max_delay)
            });
            req = back;
            match decided {
                Extras::Admitted(tightest) => held = tightest,
                Extras::Denied(deny) => {
                    self.report(&deny, &req, None);
                    return self.respond(deny, req, None);
                }
                Extras::Rejected(why, looked_for) => return self.rejected(why, &looked_for, &req),
            }
        }
        // The further limits in Redis next, then the layer's own limiter: all after a
        // round trip each.
        #[cfg(feature = "redis")]
        if !exempt && !config.remote_extras.is_empty() {
            return self.call_after_redis(req, held, max_delay);
        }
        let step = if exempt {
            Step::Pass
        } else {
            self.step(&req, max_delay)
        };
        match step {
            Step::Pass => ResponseFuture::admitted(self.inner.call(req), Pending::None),
            Step::Reject(why) => {
                if held.is_some() {
                    req = self.give_back(req);
                }
                let looked_for = config.key.looks_for(&req);
                self.rejected(why, &looked_for, &req)
            }
            Step::Decided(decision, plan) => {
                let (decision, req) = self.with_held(held, decision, req);
                self.report(&decision, &req, None);
                self.respond(decision, req, plan)
            }
            Step::Remote(decision) => {
                let mut service = Self {
                    inner: self.take_inner(),
                    config: Arc::clone(&self.config),
                };
                ResponseFuture::deferred(Box::pin(async move {
                    let (decision, error, plan) = decision.await;
                    let (decision, req) = service.with_held(held, decision, req);
                    service.report(&decision, &req, error.as_deref());
                    service.respond(decision, req, plan).await
                }))
            }
        }
    }
}

impl<S, K, E: ExtractKey<K>> RateLimitService<S, K, E>
where
    K: Borrow<E::Lookup>,
{
    /// What the layer's own limiter makes of `req`.
    fn step<B>(&self, req: &Request<B>, max_delay: u64) -> Step {
        let config = &*self.config;
        match config.key.extract(req, &config.limits) {
            Ok(key) => start(config, req, key.borrow(), max_delay),
            Err(KeyRejection::Missing) => match &config.missing {
                MissingKey::Reject => Step::Reject(KeyRejection::Missing),
                MissingKey::Shared(key) => start(config, req, key.borrow(), max_delay),
                MissingKey::Allow => Step::Pass,
            },
            Err(why) => Step::Reject(why),
        }
    }
}

#[cfg(feature = "redis")]
impl<S, K, E> RateLimitService<S, K, E>
where
    K: Borrow<E::Lookup> + Send + Sync + 'static,
    E: ExtractKey<K>,
{
    /// The rest of a request's decision once the in-process further limits admitted it
    /// (`held`, the tightest of their admissions): the further limits in Redis, in
    /// order, then the layer's own limiter; whichever denies, every limit before it gets
    /// its unit back (in Redis, one script call each, before the answer goes out).
    fn call_after_redis<ReqBody, ResBody>(
        &mut self,
        req: Request<ReqBody>,
        held: Option<Decision>,
        max_delay: u64,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Send + 'static,
    {
        let config = Arc::clone(&self.config);
        let (keys, mut req) = with_head(req, |head| {
            config
                .remote_extras
                .iter()
                .map(|e| {
                    e.key
                        .key(head, &config.limits)
                        .map_err(|why| (why, e.key.looks_for(head)))
                })
                .collect::<Vec<_>>()
        });
        let mut service = Self {
            inner: self.take_inner(),
            config,
        };
        ResponseFuture::deferred(Box::pin(async move {
            let extras = &service.config.remote_extras;
            let remote = extra::decide_remote(extras, keys).await;
            let held = match remote.outcome {
                Extras::Admitted(tightest) => match (held, tightest) {
                    (Some(a), Some(b)) => Some(a.tighter(b)),
                    (a, b) => a.or(b),
                },
                Extras::Denied(deny) => {
                    if held.is_some() {
                        req = service.give_back(req);
                    }
                    service.report(&deny, &req, remote.error.as_deref());
                    return service.respond(deny, req, None).await;
                }
                Extras::Rejected(why, looked_for) => {
                    if held.is_some() {
                        req = service.give_back(req);
                    }
                    return service
                        .rejected::<ReqBody, S::Future, ResBody>(why, &looked_for, &req)
                        .await;
                }
            };
            let (decision, error, plan) = match service.step(&req, max_delay) {
                Step::Pass => {
                    return ResponseFuture::admitted(service.inner.call(req), Pending::None).await;
                }
                Step::Reject(why) => {
                    if held.is_some() {
                        req = service.give_back(req);
                    }
                    extra::give_back_remote(extras, &remote.taken).await;
                    let looked_for = service.config.key.looks_for(&req);
                    return service
                        .rejected::<ReqBody, S::Future, ResBody>(why, &looked_for, &req)
                        .await;
                }
                Step::Decided(decision, plan) => (decision, None, plan),
                Step::Remote(decision) => decision.await,
            };
            if !decision.is_allowed() {
                extra::give_back_remote(extras, &remote.taken).await;
            }
            let (decision, req) = service.with_held(held, decision, req);
            let error = error.or(remote.error);
            service.report(&decision, &req, error.as_deref());
            service.respond(decision, req, plan).await
        }))
    }
}

/// Runs `f` on `req`'s head as a bodiless request, then puts the body back (moves, no
/// copy).
fn with_head<B, R>(req: Request<B>, f: impl FnOnce(&Request<()>) -> R) -> (R, Request<B>) {
    let (parts, body) = req.into_parts();
    let head = Request::from_parts(parts, ());
    let result = f(&head);
    let (parts, ()) = head.into_parts();
    (result, Request::from_parts(parts, body))
}

impl<S, K, E: ExtractKey<K>> RateLimitService<S, K, E> {
    /// The layer's own `decision` with what the further limits decided (`held`, the
    /// tightest of their admissions, if any applied): on a deny they get their units
    /// back; on an admission the more constraining decision is reported.
    fn with_held<B>(
        &self,
        held: Option<Decision>,
        decision: Decision,
        req: Request<B>,
    ) -> (Decision, Request<B>) {
        match held {
            Some(_) if !decision.is_allowed() => (decision, self.give_back(req)),
            Some(extras) => (decision.tighter(extras), req),
            None => (decision, req),
        }
    }

    /// Gives back the units the further limits took for `req`.
    fn give_back<B>(&self, req: Request<B>) -> Request<B> {
        let config = &*self.config;
        with_head(req, |head| {
            extra::give_back(&config.extras, head, &config.limits)
        })
        .1
    }

    /// The 400 (or gRPC `INVALID_ARGUMENT`) for a request whose key is rejected,
    /// counted and given to the rejection hook.
    fn rejected<B, F, ResBody>(
        &self,
        why: KeyRejection,
        looked_for: &str,
        req: &Request<B>,
    ) -> ResponseFuture<F, ResBody, S::Error>
    where
        S: Service<Request<B>>,
    {
        let config = &*self.config;
        super::observe::http_rejected(&config.name, why);
        if let Some(hook) = &config.rejection_hook {
            hook(&RejectionEvent {
                rejection: why,
                looked_for,
                head: RequestHead::of(req),
            });
        }
        ResponseFuture::ready(config.style.rejected(why, looked_for, is_grpc(req)))
    }

    /// Gives the decision to the decision hook, if there is one, and counts a deny that
    /// shadow mode lets through.
    fn report<B>(
        &self,
        decision: &Decision,
        req: &Request<B>,
        backend_error: Option<&(dyn std::error::Error + Send + Sync)>,
    ) {
        let shadow = self.config.shadow && !decision.is_allowed();
        if shadow {
            super::observe::shadow_denied(&self.config.name);
        }
        if let Some(hook) = &self.config.decision_hook {
            hook(&DecisionEvent {
                decision,
                head: RequestHead::of(req),
                backend_error,
                shadow,
            });
        }
    }

    /// Calls the inner service for an admitted request (its response gets the headers;
    /// under shaping, after its slot's delay), or answers a denied one; in shadow mode,
    /// a denied request is served as an admitted one, with the deny's headers.
    fn respond<ReqBody, ResBody>(
        &mut self,
        decision: Decision,
        req: Request<ReqBody>,
        plan: Option<u32>,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Send + 'static,
    {
        if decision.is_allowed() || self.config.shadow {
            let delay = decision.delay();
            if self.config.shape.is_some() && !delay.is_zero() {
                let mut inner = self.take_inner();
                let style = Arc::clone(self.style_of(plan));
                return ResponseFuture::deferred(Box::pin(async move {
                    tokio::time::sleep(delay).await;
                    let mut response = inner.call(req).await?.map(RateLimitBody::inner);
                    style.apply(&decision, response.headers_mut());
                    Ok(response)
                }));
            }
            let style = self.style_of(plan);
            let headers = match style.made(&decision) {
                Some(made) => Pending::Made(made),
                None => Pending::Later(decision, Arc::clone(style)),
            };
            ResponseFuture::admitted(self.inner.call(req), headers)
        } else {
            self.denied(&decision, &req, plan)
        }
    }

    /// The style of the plan of index `plan` (a plan added after the layer was made:
    /// the layer's own).
    fn style_of(&self, plan: Option<u32>) -> &Arc<Style> {
        let config = &*self.config;
        plan.and_then(|i| config.plans.as_ref()?.styles.get(i as usize))
            .unwrap_or(&config.style)
    }

    /// The layer's own answer to a denied request: a gRPC status, the user's deny
    /// response, or the JSON 429.
    fn denied<ReqBody, ResBody>(
        &self,
        decision: &Decision,
        req: &Request<ReqBody>,
        plan: Option<u32>,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        let style = self.style_of(plan);
        if is_grpc(req) {
            ResponseFuture::ready(style.grpc_denied(decision))
        } else if let Some(hook) = &self.config.deny_hook {
            ResponseFuture::ready(style.hooked(hook, decision, &RequestHead::of(req)))
        } else {
            ResponseFuture::ready(style.too_many_requests(decision))
        }
    }
}
