//! The sliding log: exact, at the price of one timestamp per admitted unit.
//!
//! A key keeps the timestamps of the units it was admitted in the last `period`, oldest
//! first, in a ring of exactly `limit` slots allocated once, when the key is first seen.
//! A request of cost `n` at `now` is admitted iff
//!
//! ```text
//! #{ stamps s : s > now − period } + n ≤ limit
//! ```
//!
//! **Bound.** At most `limit` units are admitted in *any* interval of length `period`:
//! there is no boundary burst and no estimate. **Memory.** `8·limit` bytes per key, so
//! `limit` is capped at [`SLIDING_LOG_MAX_LIMIT`]; larger limits are a `ConfigError` (use
//! the sliding window counter, which needs 8 bytes whatever the limit).

use super::{capped_limit, clamp_ns};
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;

/// The largest limit the sliding log accepts: 4,096 timestamps, 32 KiB per key.
pub const SLIDING_LOG_MAX_LIMIT: u64 = 4096;

/// Sliding log constants for one quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlidingLog {
    limit: u64,
    period: u64,
}

/// One key's admitted timestamps, oldest first, in a ring allocated once.
#[derive(Debug, Default)]
pub(crate) struct Log {
    stamps: Box<[u64]>,
    head: usize,
    len: usize,
}

impl Log {
    /// An empty log with room for `limit` timestamps.
    pub(crate) fn with_capacity(limit: u64) -> Self {
        Self {
            stamps: vec![0; limit as usize].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    fn at(&self, i: usize) -> u64 {
        self.stamps[(self.head + i) % self.stamps.len()]
    }

    fn newest(&self) -> Option<u64> {
        self.len.checked_sub(1).map(|i| self.at(i))
    }

    /// How many of the oldest stamps are outside the window ending at `now`.
    fn expired(&self, now: u64, period: u64) -> usize {
        (0..self.len)
            .take_while(|&i| self.at(i).saturating_add(period) <= now)
            .count()
    }

    fn drop_oldest(&mut self, n: usize) {
        if !self.stamps.is_empty() {
            self.head = (self.head + n) % self.stamps.len();
            self.len -= n;
        }
    }

    fn push(&mut self, stamp: u64, n: u64) {
        for _ in 0..n {
            if self.stamps.is_empty() {
                return;
            }
            if self.len == self.stamps.len() {
                self.drop_oldest(1);
            }
            let slot = (self.head + self.len) % self.stamps.len();
            self.stamps[slot] = stamp;
            self.len += 1;
        }
    }

    /// Reallocates for a new `limit`, keeping the newest stamps that fit.
    pub(crate) fn resize(&mut self, limit: u64) {
        let keep = self.len.min(limit as usize);
        let mut resized = Log::with_capacity(limit);
        for i in self.len - keep..self.len {
            resized.push(self.at(i), 1);
        }
        *self = resized;
    }
}

impl SlidingLog {
    pub(crate) fn new(quota: Quota) -> Result<Self, ConfigError> {
        let limit = capped_limit(quota, SLIDING_LOG_MAX_LIMIT, "the sliding log")?;
        Ok(Self {
            limit,
            period: quota.period_ns(),
        })
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.limit
    }

    /// Decides a request of `cost` (at most the limit) at `now`; when `commit` is set and
    /// the request is admitted, records it.
    pub(crate) fn decide(&self, log: &mut Log, now: u64, cost: u64, commit: bool) -> Decision {
        // Another thread may have stamped a later clock read: decide at that instant, so
        // the log stays ordered, and count the difference into every duration.
        let at = now.max(log.newest().unwrap_or(0));
        let until =
            |stamp: u64| clamp_ns(u128::from(stamp) + u128::from(self.period) - u128::from(now));
        let expired = log.expired(at, self.period);
        let live = (log.len - expired) as u64;
        if live + cost <= self.limit {
            let reset = if cost > 0 {
                until(at)
            } else {
                log.newest().filter(|_| live > 0).map_or(0, until)
            };
            if commit && cost > 0 {
                log.drop_oldest(expired);
                log.push(at, cost);
            }
            Decision::allow(self.limit, self.limit - live - cost, reset)
        } else {
            // The (live + cost − limit)-th oldest live stamp must leave the window first.
            let blocking = log.at(expired + (live + cost - self.limit) as usize - 1);
            let reset = log.newest().map_or(0, until);
            Decision::deny(
                self.limit,
                self.limit - live.min(self.limit),
                reset,
                until(blocking),
            )
        }
    }

    /// Nanoseconds until every stamp has left the window.
    pub(crate) fn reset_after(&self, log: &Log, now: u64) -> u64 {
        log.newest().map_or(0, |s| {
            clamp_ns((u128::from(s) + u128::from(self.period)).saturating_sub(u128::from(now)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = 1_000_000;

    #[test]
    fn exact_over_any_interval() {
        let sl = SlidingLog::new(Quota::per_second(3).unwrap()).unwrap();
        let mut log = Log::with_capacity(3);
        for t in [0, 400, 900] {
            assert!(sl.decide(&mut log, t * MS, 1, true).is_allowed());
        }
        // At 999ms all three are live; the oldest leaves at 1000ms.
        let d = sl.decide(&mut log, 999 * MS, 1, true);
        assert_eq!(d.retry_after(), Some(Duration::from_millis(1)));
        assert_eq!(d.reset_after(), Duration::from_millis(901));
        let d = sl.decide(&mut log, 1000 * MS, 2, true);
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_millis(400)),
            "cost 2 waits for the 400ms stamp"
        );
        assert!(sl.decide(&mut log, 1000 * MS, 1, true).is_allowed());
        assert_eq!(sl.reset_after(&log, 1000 * MS), 1000 * MS);
    }

    #[test]
    fn resize_keeps_the_newest() {
        let sl = SlidingLog::new(Quota::per_second(4).unwrap()).unwrap();
        let mut log = Log::with_capacity(4);
        for t in 0..4 {
            sl.decide(&mut log, t * MS, 1, true);
        }
        log.resize(2);
        assert_eq!((log.len, log.at(0), log.at(1)), (2, 2 * MS, 3 * MS));
        log.resize(8);
        assert_eq!((log.len, log.at(0), log.at(1)), (2, 2 * MS, 3 * MS));
    }

    #[test]
    fn an_empty_ring_never_panics() {
        let sl = SlidingLog::new(Quota::per_second(4).unwrap()).unwrap();
        let mut log = Log::default();
        assert!(sl.decide(&mut log, 5, 1, true).is_allowed());
        assert_eq!(log.len, 0);
    }
}
