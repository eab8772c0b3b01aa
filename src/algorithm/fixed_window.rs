//! The fixed window counter.
//!
//! Time is cut into windows aligned to multiples of `period` on the limiter's clock (or,
//! for a calendar quota, into its calendar periods); a key counts what it was admitted
//! in the current window. A request of cost `n` is admitted
//! iff `count + n ≤ limit`.
//!
//! **Bound.** At most `limit` are admitted in any aligned window. **Boundary burst:** an
//! arbitrary interval of length `period` that straddles a boundary can hold up to
//! `2·limit` — `limit` at the very end of one window and `limit` at the start of the next
//! all pass. The sliding window counter exists to smooth exactly this.
//!
//! **State.** One `u64`: the count in `C = bits(limit)` bits and the low `64 − C ≥ 32`
//! bits of the window index as a tag (a stale count could be misread as live only after
//! exactly a multiple of 2^32 untouched windows, and then only denies more).

use super::windows::{Frame, Windows};
use super::{Outcome, capped_limit, clamp_ns};
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;

/// The largest limit the fixed window counter accepts: `2^32 − 1`.
pub const FIXED_WINDOW_MAX_LIMIT: u64 = u32::MAX as u64;

/// Fixed window constants for one quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    limit: u64,
    windows: Windows,
    count_bits: u32,
}

impl FixedWindow {
    /// The counter for `quota` on a clock whose origin is the Unix instant `unix_origin`.
    pub(crate) fn new(quota: Quota, unix_origin: u64) -> Result<Self, ConfigError> {
        let limit = capped_limit(quota, FIXED_WINDOW_MAX_LIMIT, "the fixed window counter")?;
        Ok(Self {
            limit,
            windows: Windows::new(quota, unix_origin),
            count_bits: u64::BITS - limit.leading_zeros(),
        })
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.limit
    }

    /// The window tag's bits: all above the count but the top one, so that a state word
    /// stays below the values the store reserves (`STATE_MAX`).
    fn tag_mask(&self) -> u64 {
        u64::MAX >> (self.count_bits + 1)
    }

    pub(crate) fn pack(&self, window: u64, count: u64) -> u64 {
        ((window & self.tag_mask()) << self.count_bits) | count
    }

    /// `(frame, lead, count)` at `now`: the window the evaluation happens in (and how far
    /// into it), how far that instant lies past `now`, and the live count.
    #[inline(always)]
    fn view(&self, word: u64, now: u64) -> (Frame, u64, u64) {
        let count = word & ((1u64 << self.count_bits) - 1);
        let tag = word >> self.count_bits;
        let frame = self.windows.frame(now);
        if tag == frame.index & self.tag_mask() {
            (frame, 0, count)
        } else if tag == frame.index.wrapping_add(1) & self.tag_mask() {
            // Already rolled into the next window by a thread with a later clock read.
            (frame.next(), frame.left(), count)
        } else {
            (frame, 0, 0)
        }
    }

    /// The instant from which `word` is untouched, judged at `now` (any instant at or
    /// after its last write, give or take a window): the end of its window if it counts
    /// anything. Unlike [`evaluate`](Self::evaluate) at an earlier instant, this reads
    /// the tag against `now`, so a state written after some instant never looks untouched
    /// at it. A state ahead of `now` (a later clock's) is untouched from `u64::MAX`.
    pub(crate) fn untouched_from(&self, word: u64, now: u64) -> u64 {
        if word & ((1u64 << self.count_bits) - 1) == 0 {
            return 0;
        }
        let now_window = self.windows.frame(now).index;
        match super::window_of(word >> self.count_bits, now_window, self.tag_mask()) {
            Some(window) => self.windows.start_of(window.saturating_add(1)),
            None => u64::MAX,
        }
    }

    /// Units counted against the current window at `now`.
    pub(crate) fn consumed(&self, word: u64, now: u64) -> u64 {
        self.view(word, now).2
    }

    /// This quota's state for a key whose state was `word` under `from`: the current
    /// window's count carries over, capped at the new limit, into the window `now` falls
    /// in under this quota's period.
    pub(crate) fn convert_from(&self, word: u64, now: u64, from: &FixedWindow) -> u64 {
        let count = from.consumed(word, now).min(self.limit);
        self.pack(self.windows.frame(now).index, count)
    }

    /// The state after `n` units of the window `now` falls in are given back (at most
    /// its count).
    pub(crate) fn refund(&self, word: u64, now: u64, n: u64) -> u64 {
        let (frame, _, count) = self.view(word, now);
        if count == 0 {
            return word;
        }
        self.pack(frame.index, count - n.min(count))
    }

    #[inline(always)]
    pub(crate) fn evaluate(&self, word: u64, now: u64, cost: u64) -> Outcome {
        let (frame, lead, count) = self.view(word, now);
        let to_end = clamp_ns(u128::from(frame.left()) + u128::from(lead));
        if count + cost <= self.limit {
            let count = count + cost;
            let reset = if count > 0 { to_end } else { 0 };
            Outcome::Allow {
                decision: Decision::allow(self.limit, self.limit - count, reset),
                state: self.pack(frame.index, count),
            }
        } else {
            // cost ≤ limit, so the next window always has room.
            Outcome::Deny(Decision::deny(
                self.limit,
                self.limit - count,
                to_end,
                to_end,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::UNTOUCHED;
    use std::time::Duration;

    #[test]
    fn counts_per_window_and_retries_at_the_boundary() {
        let w = FixedWindow::new(Quota::per_second(3).unwrap(), 0).unwrap();
        let mut s = UNTOUCHED;
        for expected in [2, 1, 0] {
            match w.evaluate(s, 400_000_000, 1) {
                Outcome::Allow { decision, state } => {
                    assert_eq!(decision.remaining(), expected);
                    assert_eq!(decision.reset_after(), Duration::from_millis(600));
                    s = state;
                }
                Outcome::Deny(d) => panic!("denied {d:?}"),
            }
        }
        let Outcome::Deny(d) = w.evaluate(s, 400_000_000, 1) else {
            panic!("allowed")
        };
        assert_eq!(d.retry_after(), Some(Duration::from_millis(600)));
        assert!(matches!(
            w.evaluate(s, 1_000_000_000, 3),
            Outcome::Allow { .. }
        ));
        assert_eq!(w.consumed(s, 999_999_999), 3);
        assert_eq!(w.consumed(s, 1_000_000_000), 0);
    }
}
