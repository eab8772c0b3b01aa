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
use crate::decision::Decision;
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
            Ok(key) => Ok(Some(
                self.limiter
                    .check_within(key.borrow(), 1, max_delay)
                    .unwrap_or_else(|e| Decision::deny(e.capacity, 0, 0, u64::MAX)),
            )),
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

/// Decides `head` with every further limit in order, all or nothing; the `i`-th
/// limit's decisions carry the policy index `first + i`.
pub(crate) fn decide(
    extras: &[std::sync::Arc<dyn ExtraLimit>],
    head: &Request<()>,
    limits: &KeyLimits,
    max_delay: u64,
    first: usize,
) -> Extras {
    let mut tightest: Option<Decision> = None;
    for (i, extra) in extras.iter().enumerate() {
        let decided = extra.decide(head, limits, max_delay);
        let undo = |upto: usize| {
            for earlier in &extras[..upto] {
                earlier.give_back(head, limits);
            }
        };
        match decided {
            Ok(None) => {}
            Ok(Some(decision)) if decision.is_allowed() => {
                let decision = decision.for_policy(first + i);
                tightest = Some(tightest.map_or(decision, |t| t.tighter(decision)));
            }
            Ok(Some(deny)) => {
                undo(i);
                return Extras::Denied(deny.for_policy(first + i));
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
    extras: &[std::sync::Arc<dyn ExtraLimit>],
    head: &Request<()>,
    limits: &KeyLimits,
) {
    for extra in extras {
        extra.give_back(head, limits);
    }
}
