//! The leaky bucket as a meter with constant outflow (nginx `limit_req` semantics).
//!
//! Admitted requests join a virtual queue that drains one unit every `T = ⌊period /
//! limit⌋`; the queue holds at most `burst` units. The state is the instant the queue will
//! be empty. A request of cost `n` is admitted iff it fits in the queue:
//!
//! ```text
//! backlog + n·T ≤ burst·T,    backlog = max(empty_at − now, 0)
//! ```
//!
//! which is the token bucket's GCRA test, so admissions equal the token bucket's for the
//! same quota. What the leaky bucket adds is shaping: each admitted request is given the
//! slot at which it leaves the queue, [`Decision::delay`]`= backlog`, and the waiting API
//! holds the caller until then (nginx `burst` without `nodelay`).
//!
//! **Bounds.** At most `burst + ⌊t / T⌋` units are admitted in any interval of length `t`,
//! and slots never overlap: a request of cost `n` starting at slot `s` ends at `s + n·T`,
//! no later than the next request's slot, so the outflow never exceeds one unit per `T`.

use super::Outcome;
use super::token_bucket::Gcra;
use crate::quota::Quota;

/// Leaky bucket constants for one quota: the token bucket's, plus a slot per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeakyBucket(pub(crate) Gcra);

impl LeakyBucket {
    pub(crate) fn new(quota: Quota) -> Self {
        Self(Gcra::new(quota))
    }

    #[inline(always)]
    pub(crate) fn evaluate(&self, empty_at: u64, now: u64, cost: u64) -> Outcome {
        match self.0.evaluate(empty_at, now, cost) {
            Outcome::Allow { decision, state } => Outcome::Allow {
                decision: decision.with_delay(empty_at.saturating_sub(now)),
                state,
            },
            deny => deny,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::UNTOUCHED;
    use std::time::Duration;

    #[test]
    fn admitted_requests_get_consecutive_slots() {
        // 10/s (T = 100ms), a queue of 3.
        let lb = LeakyBucket::new(Quota::per_second(10).unwrap().with_burst(3).unwrap());
        let mut s = UNTOUCHED;
        let mut delays = Vec::new();
        for _ in 0..3 {
            let Outcome::Allow { decision, state } = lb.evaluate(s, 0, 1) else {
                panic!()
            };
            delays.push(decision.delay().as_millis());
            s = state;
        }
        assert_eq!(delays, [0, 100, 200]);
        let Outcome::Deny(d) = lb.evaluate(s, 0, 1) else {
            panic!("queue overflowed")
        };
        assert_eq!(d.retry_after(), Some(Duration::from_millis(100)));
        assert_eq!(d.delay(), Duration::ZERO);
        // At 100ms one unit has drained: the newcomer's slot is at 300ms.
        let Outcome::Allow { decision, .. } = lb.evaluate(s, 100_000_000, 1) else {
            panic!()
        };
        assert_eq!(decision.delay(), Duration::from_millis(200));
    }
}
