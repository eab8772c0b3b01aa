//! Why a concurrency limiter refused a slot.

use std::fmt;
use std::time::Duration;

use crate::decision::Decision;

/// Why [`ConcurrencyLimiter`](crate::ConcurrencyLimiter) (or the Redis one) refused a
/// permit. Nothing is held after a refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// The key's slots are held (or callers wait for them, and are served first): retry
    /// when a request of this key ends.
    Full {
        /// Slots held on the key when it was refused.
        in_flight: u32,
        /// The key's maximum.
        max: u32,
    },
    /// More slots than the key's maximum: no wait would let it in.
    NeverFits {
        /// The slots asked for.
        weight: u32,
        /// The key's maximum.
        max: u32,
    },
    /// A new key, while the limiter holds `max_keys` keys that all have something in
    /// flight.
    TooManyKeys {
        /// The limiter's key cap.
        max_keys: usize,
    },
    /// The caller waited this long in the key's line and gave up.
    Timeout {
        /// How long it waited.
        waited: Duration,
    },
    /// A slot was free, but the rate limit checked with it denied the request (see
    /// [`try_acquire_with`](crate::ConcurrencyLimiter::try_acquire_with)); the slot was
    /// given back.
    RateLimited(Decision),
}

impl ConcurrencyError {
    /// The rate limit's decision, when it is what refused.
    pub fn decision(&self) -> Option<&Decision> {
        match self {
            Self::RateLimited(decision) => Some(decision),
            _ => None,
        }
    }
}

impl fmt::Display for ConcurrencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full { in_flight, max } => write!(
                f,
                "concurrency limited: {in_flight} of {max} slots of this key are in use; retry when one ends"
            ),
            Self::NeverFits { weight, max } => write!(
                f,
                "a request of {weight} slots never fits this key's maximum of {max}: split it or raise the maximum"
            ),
            Self::TooManyKeys { max_keys } => write!(
                f,
                "no room for a new key: all {max_keys} keys held have requests in flight; raise `max_keys`"
            ),
            Self::Timeout { waited } => write!(
                f,
                "concurrency limited: no slot of this key came free within {waited:?}"
            ),
            Self::RateLimited(decision) => match decision.retry_after() {
                Some(after) => write!(f, "rate limited: retry after {after:?}"),
                None => write!(f, "rate limited"),
            },
        }
    }
}

impl std::error::Error for ConcurrencyError {}
