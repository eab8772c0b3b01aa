//! The rate-limiting algorithms, as pure functions over one packed `u64` of per-key state.
//!
//! Each algorithm turns `(state, now, cost)` into an [`Outcome`]: a [`Decision`] and, when
//! the request is admitted, the state to store. Nothing here touches a map, a clock or a
//! thread, so every formula is tested directly.
//!
//! State `0` ([`UNTOUCHED`]) means "never seen / back to full" for every algorithm, so a
//! new key needs no initialisation and an untouched key can be dropped without changing
//! any future decision.

mod sliding_window;
mod token_bucket;

pub use sliding_window::SLIDING_WINDOW_MAX_LIMIT;

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;
use sliding_window::SlidingWindow;
use token_bucket::Gcra;

/// The state word of a key that has never been seen, or whose history no longer matters.
pub(crate) const UNTOUCHED: u64 = 0;

/// Which rate-limiting algorithm a limiter runs.
///
/// | algorithm | state per key | burst | guarantee |
/// |---|---|---|---|
/// | [`TokenBucket`](Self::TokenBucket) | one `u64` | up to `burst` at once | at most `burst + ⌊t / T⌋` in any interval of length `t`, `T = ⌊period / limit⌋` |
/// | [`SlidingWindow`](Self::SlidingWindow) | one `u64` | up to `limit` per window | at most `limit` per aligned window; fewer than `2·limit` in any interval of length `period` |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// The token bucket, run as GCRA: capacity `burst`, refilled continuously at
    /// `limit / period`. Its decisions equal governor's for the same quota and timeline.
    #[default]
    TokenBucket,
    /// The sliding window counter: the weighted estimate
    /// `prev·(period − elapsed)/period + current` over windows aligned to multiples of
    /// `period`. The quota's burst is not used. Limits above
    /// [`SLIDING_WINDOW_MAX_LIMIT`] are refused.
    SlidingWindow,
}

impl Algorithm {
    /// The algorithm's name, as the example server's `--algorithm` flag spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::TokenBucket => "token-bucket",
            Self::SlidingWindow => "sliding-window",
        }
    }
}

/// What an algorithm decided about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Admitted; `state` must be stored (it equals the old state when nothing changed).
    Allow { decision: Decision, state: u64 },
    /// Denied; the state must not be written.
    Deny(Decision),
}

impl Outcome {
    pub(crate) fn decision(&self) -> Decision {
        match *self {
            Self::Allow { decision, .. } | Self::Deny(decision) => decision,
        }
    }
}

/// An algorithm with its quota's constants precomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    TokenBucket(Gcra),
    SlidingWindow(SlidingWindow),
}

impl Policy {
    /// The token bucket for `quota`: valid for every quota.
    pub(crate) fn token_bucket(quota: Quota) -> Self {
        Self::TokenBucket(Gcra::new(quota))
    }

    /// Precomputes `algorithm` for `quota`.
    ///
    /// # Errors
    /// [`ConfigError::LimitTooLarge`] when the algorithm cannot hold the quota's limit.
    pub(crate) fn new(algorithm: Algorithm, quota: Quota) -> Result<Self, ConfigError> {
        Ok(match algorithm {
            Algorithm::TokenBucket => Self::token_bucket(quota),
            Algorithm::SlidingWindow => Self::SlidingWindow(SlidingWindow::new(quota)?),
        })
    }

    /// The largest cost a single request may ever have.
    pub(crate) fn capacity(&self) -> u64 {
        match self {
            Self::TokenBucket(g) => g.capacity(),
            Self::SlidingWindow(w) => w.capacity(),
        }
    }

    /// Decides a request of `cost` (at most [`capacity`](Self::capacity)) at `now`.
    #[inline]
    pub(crate) fn evaluate(&self, state: u64, now: u64, cost: u64) -> Outcome {
        match self {
            Self::TokenBucket(g) => g.evaluate(state, now, cost),
            Self::SlidingWindow(w) => w.evaluate(state, now, cost),
        }
    }

    /// The state as it stands at `now`, as an admitting decision of cost 0.
    pub(crate) fn snapshot(&self, state: u64, now: u64) -> Decision {
        self.evaluate(state, now, 0).decision()
    }

    /// The decision a request of cost 1 would get, with `remaining` and `reset_after` as
    /// the state stands (nothing consumed).
    pub(crate) fn peek(&self, state: u64, now: u64) -> Decision {
        match self.evaluate(state, now, 1) {
            Outcome::Deny(decision) => decision,
            Outcome::Allow { .. } => self.snapshot(state, now),
        }
    }

    /// Nanoseconds from `now` until `state` is back to untouched; 0 when it carries no
    /// information, so that dropping it changes no decision.
    pub(crate) fn reset_after_ns(&self, state: u64, now: u64) -> u64 {
        self.snapshot(state, now).reset_after_ns()
    }
}

/// Clamps a `u128` nanosecond count to `u64`.
fn clamp_ns(ns: u128) -> u64 {
    u64::try_from(ns).unwrap_or(u64::MAX)
}
