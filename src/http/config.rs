//! What a [`RateLimitService`](super::RateLimitService) runs on: the backend limiter, the
//! hooks, and the configuration every clone of the layer and its services shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::backend::Backend;
use super::exempt::Exempt;
use super::extra::ExtraLimit;
use super::extract::{ExtractKey, KeyLimits, KeyRejection, RequestHead};
use super::response::{DenyHook, Style};
use crate::decision::Decision;

/// What the layer does with a request it finds no key for (no peer address, no key
/// header, or a custom extractor that returned `None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey<K = String> {
    /// Answer `400 Bad Request` (gRPC: `INVALID_ARGUMENT`) with a JSON error; the inner
    /// service is not called.
    #[default]
    Reject,
    /// Limit all such requests together, in one bucket of this key.
    Shared(K),
    /// Let them through unlimited (and without rate-limit headers).
    Allow,
}

/// What the decision hook sees of one decision.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct DecisionEvent<'a> {
    /// The decision.
    pub decision: &'a Decision,
    /// The request's head (extensions included).
    pub head: RequestHead<'a>,
    /// The error the backend's failure policy answered for (the Redis tier with
    /// [`FailMode`](crate::redis::FailMode)): the decision is the policy's, not Redis's.
    pub backend_error: Option<&'a (dyn std::error::Error + Send + Sync)>,
    /// The decision is a deny that the layer let through, because it runs in
    /// [shadow mode](super::RateLimitLayer::shadow).
    pub shadow: bool,
}

impl fmt::Debug for DecisionEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DecisionEvent")
            .field("decision", self.decision)
            .field("method", self.head.method)
            .field("path", &self.head.uri.path())
            .field(
                "backend_error",
                &self.backend_error.map(ToString::to_string),
            )
            .field("shadow", &self.shadow)
            .finish()
    }
}

/// A hook that sees every decision (for audit logs).
pub(crate) type DecisionHook = Arc<dyn Fn(&DecisionEvent<'_>) + Send + Sync>;

/// What the rejection hook sees of a request the layer answered with a 400 (or gRPC
/// `INVALID_ARGUMENT`) before deciding: no key, or a key it refuses.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct RejectionEvent<'a> {
    /// Why the request has no usable key.
    pub rejection: KeyRejection,
    /// What the key extractor looks for ("the `x-api-key` header", "the peer address").
    pub looked_for: &'a str,
    /// The request's head (extensions included).
    pub head: RequestHead<'a>,
}

impl fmt::Debug for RejectionEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RejectionEvent")
            .field("rejection", &self.rejection)
            .field("looked_for", &self.looked_for)
            .field("method", self.head.method)
            .field("path", &self.head.uri.path())
            .finish()
    }
}

/// A hook that sees every request rejected before a decision.
pub(crate) type RejectionHook = Arc<dyn Fn(&RejectionEvent<'_>) + Send + Sync>;

/// Everything a [`RateLimitService`] needs, shared by all its clones.
pub(crate) struct Config<K, E: ExtractKey<K>> {
    pub(crate) backend: Backend<E::Lookup>,
    /// The backend limiter's name: the `limiter` label of the layer's own metric.
    pub(crate) name: Arc<str>,
    pub(crate) key: E,
    pub(crate) missing: MissingKey<K>,
    pub(crate) style: Arc<Style>,
    pub(crate) limits: KeyLimits,
    pub(crate) exempt: Exempt,
    pub(crate) deny_hook: Option<DenyHook>,
    pub(crate) decision_hook: Option<DecisionHook>,
    pub(crate) rejection_hook: Option<RejectionHook>,
    /// Leaky-bucket shaping: the longest an admitted request is held; `None`: off.
    pub(crate) shape: Option<Duration>,
    /// Shadow mode: decide and report as usual, but never deny.
    pub(crate) shadow: bool,
    /// Further limits each request is held to ([`RateLimitLayer::and`](super::RateLimitLayer::and)),
    /// each with its quota's index in the layer's policies.
    pub(crate) extras: Vec<(usize, Arc<dyn ExtraLimit>)>,
    /// Further limits in Redis ([`RateLimitLayer::and_redis`](super::RateLimitLayer::and_redis)),
    /// decided after the in-process ones.
    #[cfg(feature = "redis")]
    pub(crate) remote_extras: Vec<Arc<super::extra::RedisExtra>>,
    /// The policy index of the first further limit: the layer's own limiter's quota
    /// count (for plans, the most any plan has).
    pub(crate) first_extra: usize,
    /// A layer of plans: where each request's plan comes from, and each plan's style
    /// (its name and quotas in the fields), by plan index.
    pub(crate) plans: Option<PlanStyles>,
}

/// Finds a request's plan name, handing it to its second argument.
pub(crate) type PlanFn = Arc<dyn Fn(&RequestHead<'_>, &mut dyn FnMut(&str)) + Send + Sync>;

/// A plan's name and its quotas' capacities and windows (whole seconds), its first
/// quota first.
pub(crate) type PlanFields = (Arc<str>, Vec<(u64, u64)>);

/// What a layer of plans keeps besides the others' configuration.
#[derive(Clone)]
pub(crate) struct PlanStyles {
    /// Each plan's name and quotas (capacity, window in whole seconds), by index.
    pub(crate) table: Arc<[PlanFields]>,
    /// Each plan's style, made from the layer's own after each change of it.
    pub(crate) styles: Arc<[Arc<Style>]>,
    /// The plan from the request; `None`: the key's own plan.
    pub(crate) from: Option<PlanFn>,
}

impl PlanStyles {
    /// Each plan's style made anew from the layer's `base`.
    pub(crate) fn remake(&mut self, base: &Style) {
        self.styles = self
            .table
            .iter()
            .map(|(name, quotas)| Arc::new(base.for_plan(name, quotas)))
            .collect();
    }
}

impl<K, E: ExtractKey<K>> Config<K, E> {
    /// The policy index of the next further limit: after the layer's own quotas and the
    /// further limits added before it, of either kind.
    pub(crate) fn next_policy(&self) -> usize {
        #[cfg(feature = "redis")]
        let remote = self.remote_extras.len();
        #[cfg(not(feature = "redis"))]
        let remote = 0;
        self.first_extra + self.extras.len() + remote
    }
}

impl<K: Clone, E: ExtractKey<K> + Clone> Clone for Config<K, E> {
    fn clone(&self) -> Self {
        Self {
            backend: self.backend.clone(),
            name: Arc::clone(&self.name),
            key: self.key.clone(),
            missing: self.missing.clone(),
            style: Arc::clone(&self.style),
            limits: self.limits,
            exempt: self.exempt.clone(),
            deny_hook: self.deny_hook.clone(),
            decision_hook: self.decision_hook.clone(),
            rejection_hook: self.rejection_hook.clone(),
            shape: self.shape,
            shadow: self.shadow,
            extras: self.extras.clone(),
            #[cfg(feature = "redis")]
            remote_extras: self.remote_extras.clone(),
            first_extra: self.first_extra,
            plans: self.plans.clone(),
        }
    }
}
