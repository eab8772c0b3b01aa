//! The limiters a [`RateLimitLayer`](super::RateLimitLayer) runs on, behind one trait:
//! [`LayerLimiter`], for the in-process limiter, the synced limiter and the Redis tier.

use std::borrow::Borrow;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::Arc;

use crate::clock::Clock;
use crate::decision::{Decision, unit};
use crate::limiter::RateLimiter;
use crate::plans::Plans;
use crate::quota::Quota;
#[cfg(feature = "redis")]
use crate::sync::SyncedLimiter;

/// A limiter a [`RateLimitLayer`](super::RateLimitLayer) can run on, for keys of type
/// `K`:
///
/// - [`RateLimiter<K, C>`](crate::RateLimiter): in process;
/// - [`SyncedLimiter<K, C>`](crate::sync::SyncedLimiter) (cargo feature `redis`): in
///   process, one limit across the nodes sharing a Redis;
/// - `(RedisLimiter, FailMode)` (cargo feature `redis`): every decision in Redis, and
///   when Redis fails, the [`FailMode`](crate::redis::FailMode) decides.
///
/// The layer asks the limiter for its name (the `limiter` label of its metric), its
/// quota and capacity (the `RateLimit-Policy` and `RateLimit-Limit` fields).
///
/// The trait is implemented by tollgate's limiters only: its one method is not part of
/// the public API.
///
/// ```
/// use tollgate::http::{KeyExtractor, RateLimitLayer};
/// use tollgate::RateLimiter;
///
/// let local: RateLimiter<String> = RateLimiter::new("10/s".parse()?);
/// let layer = RateLimitLayer::keyed(local, KeyExtractor::header("x-api-key")?);
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait LayerLimiter<K>: Send + 'static {
    /// What the layer runs on, looked up by `Q`.
    #[doc(hidden)]
    fn into_backing<Q>(self) -> Backing<Q>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + ToOwned<Owned = K>;
}

/// What the layer keeps of a [`LayerLimiter`]. Not part of the public API.
#[doc(hidden)]
pub struct Backing<Q: ?Sized> {
    pub(crate) backend: Backend<Q>,
    pub(crate) name: Arc<str>,
    pub(crate) quota: Quota,
    pub(crate) capacity: u64,
    /// The limiter's further quotas ([`Builder::also`](crate::Builder::also)), each with
    /// its capacity.
    pub(crate) also: Vec<(Quota, u64)>,
    /// A limiter of plans: each plan's name and quotas (with their capacities), by index.
    pub(crate) plans: Vec<crate::plans::PlanQuotas>,
}

/// A limiter of plans, as the layer uses it: looked up by `Q`.
pub(crate) trait PlannedLimiter<Q: ?Sized>: Send + Sync {
    /// Decides one request under the plan named `plan` (the key's own plan if `None`);
    /// returns the decision and the deciding plan's index.
    fn check(&self, plan: Option<&str>, key: &Q, max_delay: u64) -> (Decision, u32);
}

impl<K: crate::Key, C: Clock> LayerLimiter<K> for Plans<K, C> {
    fn into_backing<Q>(self) -> Backing<Q>
    where
        K: Borrow<Q>,
        Q: ?Sized + Hash + Eq + ToOwned<Owned = K>,
    {
        let plans = self.plan_table();
        let default = self.default_index() as usize;
        let (first, also) = plans[default]
            .1
            .split_first()
            .map(|(&first, also)| (first, also.to_vec()))
            .expect("a plan has at least one quota");
        Backing {
            name: Arc::from(self.name()),
            quota: first.0,
            capacity: first.1,
            also,
            plans,
            backend: Backend::Planned(Arc::new(self)),
        }
    }
}

impl<K, Q, C> PlannedLimiter<Q> for Plans<K, C>
where
    K: crate::Key + Borrow<Q>,
    Q: ?Sized + Hash + Eq + ToOwned<Owned = K>,
    C: Clock,
{
    fn check(&self, plan: Option<&str>, key: &Q, max_delay: u64) -> (Decision, u32) {
        self.check_indexed(plan, key, max_delay)
    }
}

/// A local limiter, as the layer uses it: looked up by `Q`.
pub(crate) trait LocalLimiter<Q: ?Sized>: Send + Sync {
    /// Decides one request; a leaky bucket's admission more than `max_delay` ns away is
    /// a deny instead (`u64::MAX`: never).
    fn check(&self, key: &Q, max_delay: u64) -> Decision;
}

/// Makes an in-process limiter type (`name`, `quota`, `capacity`, `check` and
/// `check_within`) a [`LayerLimiter`] whose requests it decides.
macro_rules! in_process {
    ($limiter:ident) => {
        impl<K: crate::Key, C: Clock> LayerLimiter<K> for $limiter<K, C> {
            fn into_backing<Q>(self) -> Backing<Q>
            where
                K: Borrow<Q>,
                Q: ?Sized + Hash + Eq + ToOwned<Owned = K>,
            {
                Backing {
                    name: Arc::from(self.name()),
                    quota: self.quota(),
                    capacity: self.quota_capacity(),
                    also: self.also_policies(),
                    plans: Vec::new(),
                    backend: Backend::Local(Arc::new(self)),
                }
            }
        }

        impl<K, Q, C> LocalLimiter<Q> for $limiter<K, C>
        where
            K: crate::Key + Borrow<Q>,
            Q: ?Sized + Hash + Eq + ToOwned<Owned = K>,
            C: Clock,
        {
            #[inline]
            fn check(&self, key: &Q, max_delay: u64) -> Decision {
                if max_delay == u64::MAX {
                    $limiter::check(self, key)
                } else {
                    unit(self.check_within(key, 1, max_delay))
                }
            }
        }
    };
}

in_process!(RateLimiter);
#[cfg(feature = "redis")]
in_process!(SyncedLimiter);

#[cfg(feature = "redis")]
mod redis {
    use std::borrow::Borrow;
    use std::hash::Hash;
    use std::sync::Arc;

    use super::{Backend, BackendError, Backing, LayerLimiter, RemoteLimiter};
    use crate::redis::{FailMode, RedisLimiter};

    impl LayerLimiter<String> for (RedisLimiter, FailMode) {
        fn into_backing<Q>(self) -> Backing<Q>
        where
            String: Borrow<Q>,
            Q: ?Sized + Hash + Eq + ToOwned<Owned = String>,
        {
            let (limiter, on_failure) = self;
            let (name, quota, capacity, also) = (
                Arc::from(limiter.name()),
                limiter.quota(),
                limiter.quota_capacity(),
                limiter.also_policies(),
            );
            let plans = limiter.plan_table();
            let planned = !plans.is_empty();
            let remote: RemoteLimiter<Q> = Arc::new(move |plan: Option<&str>, key: &Q| {
                let limiter = limiter.clone();
                let key: String = key.to_owned();
                let plan = plan.map(str::to_owned);
                Box::pin(async move {
                    let (decision, error, index) = limiter
                        .check_reporting_in(plan.as_deref(), &key, on_failure)
                        .await;
                    let error = error.map(|e| Box::new(e) as BackendError);
                    (decision, error, planned.then_some(index))
                })
            });
            Backing {
                backend: Backend::Remote(remote),
                name,
                quota,
                capacity,
                also,
                plans,
            }
        }
    }
}

/// An error a backend recovered from by its failure policy (the Redis tier's
/// [`FailMode`](crate::redis::FailMode)), reported to the decision hook.
pub type BackendError = Box<dyn std::error::Error + Send + Sync>;

/// A decision that must be awaited (the Redis tier), with the error its failure policy
/// answered for, if any, and the index of the plan that decided (a limiter of plans).
pub(crate) type RemoteDecision =
    Pin<Box<dyn Future<Output = (Decision, Option<BackendError>, Option<u32>)> + Send>>;

/// A remote limiter, as the layer uses it: starts the decision for a key, under the
/// plan named (the request's, from `plan_from`) or the key's own.
pub(crate) type RemoteLimiter<Q> = Arc<dyn Fn(Option<&str>, &Q) -> RemoteDecision + Send + Sync>;

/// Where decisions come from.
pub(crate) enum Backend<Q: ?Sized> {
    Local(Arc<dyn LocalLimiter<Q>>),
    /// A limiter of plans, in process.
    Planned(Arc<dyn PlannedLimiter<Q>>),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Remote(RemoteLimiter<Q>),
}

impl<Q: ?Sized> Clone for Backend<Q> {
    fn clone(&self) -> Self {
        match self {
            Self::Local(l) => Self::Local(Arc::clone(l)),
            Self::Planned(p) => Self::Planned(Arc::clone(p)),
            Self::Remote(r) => Self::Remote(Arc::clone(r)),
        }
    }
}
