//! The sliding window counter.
//!
//! Time is cut into windows aligned to multiples of `period` on the limiter's clock (or,
//! for a calendar quota, into its calendar periods, `period` then being each window's own
//! length, and the previous window weighed by the current one's elapsed fraction). A key
//! keeps two counters: `cur`, admitted in the current window, and `prev`, admitted in the
//! previous one. At `elapsed` nanoseconds into the current window a request of cost `n` is
//! admitted iff the weighted estimate stays within the limit:
//!
//! ```text
//! prev·(period − elapsed)/period + cur + n ≤ limit
//! ```
//!
//! evaluated exactly, in integers, as `prev·(period − elapsed) + (cur + n)·period ≤
//! limit·period`.
//!
//! **Bounds.** At most `limit` are admitted in any aligned window (the estimate is never
//! below `cur`). Over an arbitrary interval of length `period`, fewer than `2·limit` are
//! admitted: with `c` admitted in the earlier window, the later window's part of the
//! interval can add at most `limit − c·(period − e)/period`, so the total is at most
//! `limit + c·e/period < 2·limit`. The worst case is approached when a full window's worth
//! arrives at the very end of one window and traffic then arrives steadily in the next.
//!
//! **State.** One `u64`: `cur` and `prev` in `C = bits(limit)` bits each and the low
//! `64 − 2C ≥ 16` bits of the window index as a tag. A key untouched for a multiple of
//! `2^(64−2C)` windows (exactly) would have its stale counts read as live: this can only
//! deny more, never admit more, and lasts at most two windows. For `limit < 65,536` the tag
//! has 32 bits, which is 136 years at a one-second period.

use super::windows::{Frame, Windows};
use super::{Outcome, capped_limit, clamp_ns};
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;

/// The largest limit the sliding window counter accepts: `2^24 − 1`, so that both counters
/// and a tag of at least 16 bits fit one atomic word.
pub const SLIDING_WINDOW_MAX_LIMIT: u64 = (1 << 24) - 1;

/// Sliding window constants for one quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    limit: u64,
    windows: Windows,
    /// Bits per counter.
    count_bits: u32,
    /// Mask of the tag (window index) bits, after shifting.
    tag_mask: u64,
}

/// A key's counters as seen at one instant.
struct View {
    /// The window the evaluation happens in, and how far into it.
    frame: Frame,
    /// How far the evaluation instant lies ahead of the caller's `now` (non-zero only when
    /// another thread has already stored state for the next window).
    lead: u64,
    prev: u64,
    cur: u64,
}

impl SlidingWindow {
    /// The counter for `quota` on a clock whose origin is the Unix instant `unix_origin`.
    pub(crate) fn new(quota: Quota, unix_origin: u64) -> Result<Self, ConfigError> {
        let limit = capped_limit(
            quota,
            SLIDING_WINDOW_MAX_LIMIT,
            "the sliding window counter",
        )?;
        let count_bits = u64::BITS - limit.leading_zeros();
        Ok(Self {
            limit,
            windows: Windows::new(quota, unix_origin),
            count_bits,
            // The top bit stays clear, so that a state word stays below the values the
            // store reserves (`STATE_MAX`).
            tag_mask: u64::MAX >> (2 * count_bits + 1),
        })
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.limit
    }

    fn pack(&self, window: u64, prev: u64, cur: u64) -> u64 {
        ((window & self.tag_mask) << (2 * self.count_bits)) | (prev << self.count_bits) | cur
    }

    #[inline(always)]
    fn view(&self, word: u64, now: u64) -> View {
        let count_mask = (1u64 << self.count_bits) - 1;
        let tag = word >> (2 * self.count_bits);
        let (prev, cur) = ((word >> self.count_bits) & count_mask, word & count_mask);
        let frame = self.windows.frame(now);
        let window = frame.index;
        let at = |frame: Frame, lead: u64, prev: u64, cur: u64| View {
            frame,
            lead,
            prev,
            cur,
        };
        if tag == window & self.tag_mask {
            at(frame, 0, prev, cur)
        } else if tag == window.wrapping_sub(1) & self.tag_mask {
            at(frame, 0, cur, 0)
        } else if tag == window.wrapping_add(1) & self.tag_mask {
            // Another thread read a later clock and already rolled the key into the next
            // window: evaluate at that window's start so no count is forgotten.
            at(frame.next(), frame.left(), prev, cur)
        } else {
            at(frame, 0, 0, 0)
        }
    }

    /// This quota's state for a key whose state was `word` under `from`. With the same
    /// windows, both counters carry over (capped at the new limit), so the previous window
    /// keeps decaying on schedule. With a different period the windows no longer line up:
    /// the weighted estimate under `from` (rounded up, capped at the new limit) becomes the
    /// current window's count. Either way no key is refilled by a change.
    pub(crate) fn convert_from(&self, word: u64, now: u64, from: &SlidingWindow) -> u64 {
        let v = from.view(word, now);
        if from.windows == self.windows {
            return self.pack(v.frame.index, v.prev.min(self.limit), v.cur.min(self.limit));
        }
        let p = u128::from(v.frame.len);
        let weighted = (u128::from(v.prev) * u128::from(v.frame.left())).div_ceil(p);
        let used = (weighted + u128::from(v.cur)).min(u128::from(self.limit)) as u64;
        self.pack(self.windows.frame(now).index, 0, used)
    }

    /// The state after `n` units are given back: from the current window's count
    /// first, then from the previous window's (whose weight in the estimate is what
    /// remains of its decay), never below zero.
    pub(crate) fn refund(&self, word: u64, now: u64, n: u64) -> u64 {
        let v = self.view(word, now);
        if v.prev == 0 && v.cur == 0 {
            return word;
        }
        let from_cur = n.min(v.cur);
        let from_prev = (n - from_cur).min(v.prev);
        self.pack(v.frame.index, v.prev - from_prev, v.cur - from_cur)
    }

    /// The instant from which `word` is untouched, judged at `now` (see
    /// [`FixedWindow::untouched_from`](super::fixed_window::FixedWindow::untouched_from)):
    /// two windows after its own if its current count is not zero, one if only the
    /// previous one is.
    pub(crate) fn untouched_from(&self, word: u64, now: u64) -> u64 {
        let count_mask = (1u64 << self.count_bits) - 1;
        let (prev, cur) = ((word >> self.count_bits) & count_mask, word & count_mask);
        let windows = match (prev, cur) {
            (0, 0) => return 0,
            (_, 0) => 1,
            _ => 2,
        };
        match super::window_of(
            word >> (2 * self.count_bits),
            self.windows.frame(now).index,
            self.tag_mask,
        ) {
            Some(window) => self.windows.start_of(window.saturating_add(windows)),
            None => u64::MAX,
        }
    }

    /// Time from the view's instant until the counters are both zero again.
    fn reset_after(&self, v: &View, prev: u64, cur: u64) -> u128 {
        let to_window_end = u128::from(v.frame.left());
        if cur > 0 {
            to_window_end + u128::from(v.frame.next_len)
        } else if prev > 0 {
            to_window_end
        } else {
            0
        }
    }

    /// Exact time from the view's instant until a request of `cost` fits. Only called on a
    /// deny, with `cost ≤ limit`.
    fn retry_after(&self, v: &View, cost: u64) -> u128 {
        let p = u128::from(v.frame.len);
        let e = u128::from(v.frame.elapsed);
        if v.cur + cost <= self.limit {
            // Fits later in this window, once prev's weight has decayed enough:
            // prev·(p − x) ≤ r·p  ⇔  x ≥ p − ⌊r·p / prev⌋. Denied now, so prev > 0 and x > e.
            let r = u128::from(self.limit - v.cur - cost);
            let x = p - r * p / u128::from(v.prev);
            x - e
        } else {
            // Needs the next window (of length p'), where prev' = cur and cur' = 0; cur > 0
            // here since cost ≤ limit. cur·(p' − y) ≤ (limit − cost)·p'  ⇔
            // y ≥ p' − ⌊(limit − cost)·p' / cur⌋.
            let next = u128::from(v.frame.next_len);
            let y = next - u128::from(self.limit - cost) * next / u128::from(v.cur);
            (p - e) + y
        }
    }

    #[inline(always)]
    pub(crate) fn evaluate(&self, word: u64, now: u64, cost: u64) -> Outcome {
        let v = self.view(word, now);
        // The previous window's weight, `prev·(period − elapsed)`, in units of ns·request.
        let weight = u128::from(v.prev) * u128::from(v.frame.left());
        // ⌈weight / period⌉ ≤ prev, so it fits u64.
        let weighted = self.windows.div_ceil(weight, v.frame.len) as u64;
        let lead = u128::from(v.lead);
        // prev·(period − elapsed) + (cur + cost)·period ≤ limit·period, split so that the
        // common case needs one multiplication and no 128-bit division.
        let fits = v.cur + cost <= self.limit
            && weight <= u128::from(self.limit - v.cur - cost) * u128::from(v.frame.len);
        if fits {
            let cur = v.cur + cost;
            let remaining = self.limit - cur - weighted;
            let reset = clamp_ns(self.reset_after(&v, v.prev, cur) + lead);
            Outcome::Allow {
                decision: Decision::allow(self.limit, remaining, reset),
                state: self.pack(v.frame.index, v.prev, cur),
            }
        } else {
            let remaining = (self.limit - v.cur).saturating_sub(weighted);
            let reset = clamp_ns(self.reset_after(&v, v.prev, v.cur) + lead);
            let retry = clamp_ns(self.retry_after(&v, cost) + lead);
            Outcome::Deny(Decision::deny(self.limit, remaining, reset, retry))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::UNTOUCHED;
    use std::time::Duration;

    const SEC: u64 = 1_000_000_000;

    fn window(limit: u64) -> SlidingWindow {
        SlidingWindow::new(Quota::per_second(limit).unwrap(), 0).unwrap()
    }

    fn run(w: &SlidingWindow, state: &mut u64, now: u64, cost: u64) -> Decision {
        match w.evaluate(*state, now, cost) {
            Outcome::Allow { decision, state: s } => {
                *state = s;
                decision
            }
            Outcome::Deny(d) => d,
        }
    }

    #[test]
    fn weighted_estimate_and_exact_retry() {
        let w = window(10);
        let mut s = UNTOUCHED;
        // 10 in window 0: all pass, the 11th waits for window 1 ...
        for i in 0..10 {
            assert_eq!(run(&w, &mut s, SEC / 2, 1).remaining(), 9 - i);
        }
        let d = run(&w, &mut s, SEC / 2, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.reset_after(), Duration::from_millis(1500));
        // ... where prev = 10 weighs 10·(1 − e); one more fits once 10·(1 − e) ≤ 9: e = 0.1s.
        assert_eq!(d.retry_after(), Some(Duration::from_millis(600)));
        assert!(!run(&w, &mut s, SEC + SEC / 10 - 1, 1).is_allowed());
        let d = run(&w, &mut s, SEC + SEC / 10, 1);
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 0);
        // Two windows later everything has decayed.
        let reset_at = |now| w.evaluate(s, now, 0).decision().reset_after();
        assert_eq!(reset_at(3 * SEC), Duration::ZERO);
        assert_eq!(reset_at(3 * SEC - 1), Duration::from_nanos(1));
    }

    #[test]
    fn cost_above_what_is_left_in_window_waits_for_next_window() {
        let w = window(10);
        let mut s = UNTOUCHED;
        assert!(run(&w, &mut s, 0, 8).is_allowed());
        let d = run(&w, &mut s, SEC / 4, 3);
        assert_eq!(d.remaining(), 2);
        // Next window: prev = 8, need 8·(1 − y) ≤ 7: y = 0.125s.
        assert_eq!(d.retry_after(), Some(Duration::from_millis(750 + 125)));
        // A full-limit cost needs prev to have fully decayed.
        let d = run(&w, &mut s, SEC / 4, 10);
        assert_eq!(d.retry_after(), Some(Duration::from_millis(750 + 1000)));
    }

    #[test]
    fn state_from_the_next_window_is_not_forgotten() {
        let w = window(2);
        let mut s = UNTOUCHED;
        assert!(run(&w, &mut s, SEC, 2).is_allowed());
        // A thread whose clock read was 1ns earlier sees state tagged with the next window.
        let d = run(&w, &mut s, SEC - 1, 1);
        assert!(!d.is_allowed());
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_nanos(SEC + SEC / 2 + 1))
        );
    }

    #[test]
    fn limit_cap_is_a_config_error() {
        let q = Quota::per_minute(SLIDING_WINDOW_MAX_LIMIT + 1).unwrap();
        assert!(matches!(
            SlidingWindow::new(q, 0),
            Err(ConfigError::LimitTooLarge { .. })
        ));
        let q = Quota::per_minute(SLIDING_WINDOW_MAX_LIMIT).unwrap();
        let w = SlidingWindow::new(q, 0).unwrap();
        let mut s = UNTOUCHED;
        assert!(run(&w, &mut s, u64::MAX - 1, SLIDING_WINDOW_MAX_LIMIT).is_allowed());
        let d = run(&w, &mut s, u64::MAX, 1);
        assert!(!d.is_allowed());
        assert!(d.retry_after().unwrap() > Duration::ZERO);
    }
}
