//! Further limits one layer holds a request to ([`RateLimitLayer::and`]): each an
//! in-process limiter with its own key, decided with the layer's own, all or nothing.
//!
//! The further limits are decided first, in the order they were added, each consuming
//! one unit if it admits; the first that denies ends the request, and the ones before it
//! get their unit back. Then the layer's own limiter decides (in process or in Redis);
//! if it denies, every further limit gets its unit back. Refunds are exact (see
//! [`RateLimiter::refund`]), so a denied request consumes from none of the limits, and an
//! admitted one from all. A request racing a doomed one on the same key may be denied by
//! the units it holds for the nanoseconds (or, behind a Redis limiter, the round trip)
//! until they come back; nothing is ever admitted beyond any limit.
//!
//! [`RateLimitLayer::and`]: super::RateLimitLayer::and

use std::borrow::Borrow;

use http::Request;

use super::extract::{ExtractKey, KeyLimits, KeyRejection};
use crate::clock::Clock;
use crate::decision::{Decision, unit};
use crate::limiter::RateLimiter;
use crate::quota::Quota;

/// One further limit, its key type erased.
pub(crate) trait ExtraLimit: Send + Sync {
    /// Decides `head` (consuming one unit if admitted): `None` when the request has no
    /// key for this limit (the limit does not apply to it).
    ///
    /// # Errors
    /// A key this limit's extractor rejects (not UTF-8, too long).
    fn decide(
        &self,
        head: &Request<()>,
        limits: &KeyLimits,
        max_delay: u64,
    ) -> Result<Option<Decision>, KeyRejection>;

    /// Gives back the unit [`decide`](Self::decide) consumed for `head`.
    fn give_back(&self, head: &Request<()>, limits: &KeyLimits);

    /// What this limit's extractor looks for (for the 400 of a key it rejects).
    fn looks_for(&self, head: &Request<()>) -> String;

    /// The limiter's name (the policy name of its headers), quota and capacity.
    fn policy(&self) -> (&str, Quota, u64);
}

/// A limiter and the extractor of its key.
pub(crate) struct Extra<K, C, E> {
    pub(crate) limiter: RateLimiter<K, C>,
    pub(crate) key: E,
}

impl<K, C, E> ExtraLimit for Extra<K, C, E>
where
    K: crate::Key + Borrow<E::Lookup>,
    C: Clock,
    E: ExtractKey<K>,
{
    fn decide(
        &self,
        head: &Request<()>,
        limits: &KeyLimits,
        max_delay: u64,
    ) -> Result<Option<Decision>, KeyRejection> {
        match self.key.extract(head, limits) {
            Ok(key) => Ok(Some(unit(self.limiter.check_within(
                key.borrow(),
                1,
                max_delay,
            )))),
            Err(KeyRejection::Missing) => Ok(None),
            Err(why) => Err(why),
        }
    }

    fn give_back(&self, head: &Request<()>, limits: &KeyLimits) {
        if let Ok(key) = self.key.extract(head, limits) {
            // The limiter's algorithm refunds: `and` refuses the sliding log.
            let _ = self.limiter.refund(key.borrow(), 1);
        }
    }

    fn looks_for(&self, head: &Request<()>) -> String {
        self.key.looks_for(head)
    }

    fn policy(&self) -> (&str, Quota, u64) {
        (
            self.limiter.name(),
            self.limiter.quota(),
            self.limiter.capacity(),
        )
    }
}

/// What the further limits decided about a request.
pub(crate) enum Extras {
    /// Every one that applies admitted, consuming a unit: the tightest of their
    /// decisions (each with its policy index), if any applied.
    Admitted(Option<Decision>),
    /// One denied (the others gave their units back): its decision.
    Denied(Decision),
    /// One rejected the request's key (the others gave their units back): why, and
    /// what its extractor looks for.
    Rejected(KeyRejection, String),
}

/// Decides `head` with every further limit in order, all or nothing; each limit's
/// decisions carry its policy index.
pub(crate) fn decide(
    extras: &[(usize, std::sync::Arc<dyn ExtraLimit>)],
    head: &Request<()>,
    limits: &KeyLimits,
    max_delay: u64,
) -> Extras {
    let mut tightest: Option<Decision> = None;
    for (i, (policy, extra)) in extras.iter().enumerate() {
        let decided = extra.decide(head, limits, max_delay);
        let undo = |upto: usize| give_back(&extras[..upto], head, limits);
        match decided {
            Ok(None) => {}
            Ok(Some(decision)) if decision.is_allowed() => {
                let decision = decision.for_policy(*policy);
                tightest = Some(tightest.map_or(decision, |t| t.tighter(decision)));
            }
            Ok(Some(deny)) => {
                undo(i);
                return Extras::Denied(deny.for_policy(*policy));
            }
            Err(why) => {
                undo(i);
                return Extras::Rejected(why, extra.looks_for(head));
            }
        }
    }
    Extras::Admitted(tightest)
}

/// Gives back the unit every further limit consumed for `head` (the layer's own limiter
/// denied it, or rejected its key).
pub(crate) fn give_back(
    extras: &[(usize, std::sync::Arc<dyn ExtraLimit>)],
    head: &Request<()>,
    limits: &KeyLimits,
) {
    for (_, extra) in extras {
        extra.give_back(head, limits);
    }
}

/// A further limit in Redis ([`RateLimitLayer::and_redis`]): a [`RedisLimiter`] and the
/// extractor of its key, decided after the in-process further limits, one script call.
///
/// [`RateLimitLayer::and_redis`]: super::RateLimitLayer::and_redis
/// [`RedisLimiter`]: crate::redis::RedisLimiter
#[cfg(feature = "redis")]
pub(crate) struct RedisExtra {
    pub(crate) limiter: crate::redis::RedisLimiter,
    pub(crate) on_failure: crate::redis::FailMode,
    pub(crate) key: Box<dyn KeyOf>,
    /// Its quota's index in the layer's policies.
    pub(crate) policy: usize,
}

/// A further limit's key extractor, its key type fixed to `String`.
#[cfg(feature = "redis")]
pub(crate) trait KeyOf: Send + Sync {
    /// `head`'s key: `None` when it has none (the limit does not apply to it).
    fn key(&self, head: &Request<()>, limits: &KeyLimits) -> Result<Option<String>, KeyRejection>;
    /// What the extractor looks for (for the 400 of a key it rejects).
    fn looks_for(&self, head: &Request<()>) -> String;
}

#[cfg(feature = "redis")]
impl<E: ExtractKey<String>> KeyOf for E {
    fn key(&self, head: &Request<()>, limits: &KeyLimits) -> Result<Option<String>, KeyRejection> {
        match self.extract(head, limits) {
            Ok(key) => Ok(Some(key.borrow().to_owned())),
            Err(KeyRejection::Missing) => Ok(None),
            Err(why) => Err(why),
        }
    }

    fn looks_for(&self, head: &Request<()>) -> String {
        ExtractKey::looks_for(self, head)
    }
}

/// What the further limits in Redis decided about a request: as [`Extras`], with the
/// keys that took a unit in Redis (to give it back if a later limit denies).
#[cfg(feature = "redis")]
pub(crate) struct RemoteExtras {
    pub(crate) outcome: Extras,
    /// The error a fail mode answered for, if any (for the decision hook).
    pub(crate) error: Option<super::backend::BackendError>,
    /// For each limit that consumed a unit in Redis, its index and key.
    pub(crate) taken: Vec<(usize, String)>,
}

/// Decides `head` with every further limit in Redis, in order, all or nothing: the first
/// that denies ends it, and the ones before it get their unit back (one script call
/// each). A decision a fail mode gave (Redis failed) consumed nothing in Redis, so it is
/// given nothing back.
#[cfg(feature = "redis")]
pub(crate) async fn decide_remote(
    extras: &[std::sync::Arc<RedisExtra>],
    keys: Vec<Result<Option<String>, (KeyRejection, String)>>,
) -> RemoteExtras {
    let mut tightest: Option<Decision> = None;
    let mut taken: Vec<(usize, String)> = Vec::new();
    let mut error = None;
    for (i, (extra, key)) in extras.iter().zip(keys).enumerate() {
        let key = match key {
            Ok(Some(key)) => key,
            Ok(None) => continue,
            Err((why, looked_for)) => {
                give_back_remote(extras, &taken).await;
                return RemoteExtras {
                    outcome: Extras::Rejected(why, looked_for),
                    error,
                    taken: Vec::new(),
                };
            }
        };
        let (decision, failed) = extra.limiter.check_reporting(&key, extra.on_failure).await;
        let decision = decision.for_policy(extra.policy);
        let in_redis = failed.is_none();
        if let Some(e) = failed {
            error = Some(Box::new(e) as super::backend::BackendError);
        }
        if !decision.is_allowed() {
            give_back_remote(extras, &taken).await;
            return RemoteExtras {
                outcome: Extras::Denied(decision),
                error,
                taken: Vec::new(),
            };
        }
        if in_redis {
            taken.push((i, key));
        }
        tightest = Some(tightest.map_or(decision, |t| t.tighter(decision)));
    }
    RemoteExtras {
        outcome: Extras::Admitted(tightest),
        error,
        taken,
    }
}

/// Gives back, in Redis, the unit each of `taken` consumed. A refund that fails is
/// logged by the limiter (and counted); the unit then stays consumed: nothing is
/// admitted twice.
#[cfg(feature = "redis")]
pub(crate) async fn give_back_remote(
    extras: &[std::sync::Arc<RedisExtra>],
    taken: &[(usize, String)],
) {
    for (i, key) in taken {
        if let Some(extra) = extras.get(*i) {
            let _ = extra.limiter.refund(key, 1).await;
        }
    }
}
