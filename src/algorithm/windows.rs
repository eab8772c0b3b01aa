//! The windows of the window counters: rolling (aligned to multiples of the period on
//! the limiter's clock) or calendar periods (aligned to the calendar on its wall time).

use super::Divisor;
use crate::calendar::CalendarPeriod;
use crate::quota::Quota;

/// Where the window counters' windows fall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Windows {
    /// Multiples of the period on the limiter's clock.
    Rolling(Divisor),
    /// Calendar periods; wall time is `unix_origin` plus the clock's time.
    Calendar {
        period: CalendarPeriod,
        unix_origin: u64,
    },
}

/// The window an instant falls in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    /// The window's index: consecutive windows have consecutive indexes.
    pub(crate) index: u64,
    /// Nanoseconds from the window's start to the instant.
    pub(crate) elapsed: u64,
    /// The window's length.
    pub(crate) len: u64,
    /// The next window's length.
    pub(crate) next_len: u64,
}

impl Frame {
    /// Nanoseconds from the instant to the window's end (never 0).
    pub(crate) fn left(&self) -> u64 {
        self.len - self.elapsed
    }

    /// The next window, at its start (as a thread with a later clock read saw it). Its
    /// successor's length is taken as its own, which is exact for rolling windows; for
    /// calendar periods it only matters to a deny's retry in the instant two threads'
    /// clock reads straddle a boundary.
    pub(crate) fn next(&self) -> Frame {
        // A next period of no length (a day a zone skipped, where no instant falls and
        // no state is tagged) is never evaluated in; 1 ns keeps the divisions sound.
        let len = self.next_len.max(1);
        Frame {
            index: self.index.saturating_add(1),
            elapsed: 0,
            len,
            next_len: len,
        }
    }
}

impl Windows {
    /// The windows of `quota`, on a clock whose origin is the Unix instant `unix_origin`
    /// (read only for calendar periods).
    pub(crate) fn new(quota: Quota, unix_origin: u64) -> Self {
        match quota.calendar() {
            Some(period) => Self::Calendar {
                period,
                unix_origin,
            },
            None => Self::Rolling(Divisor::new(quota.period_ns())),
        }
    }

    /// The window `now` (on the limiter's clock) falls in.
    #[inline(always)]
    pub(crate) fn frame(&self, now: u64) -> Frame {
        match self {
            Self::Rolling(period) => {
                let index = period.div(now);
                let len = period.get();
                Frame {
                    index,
                    elapsed: now - index * len,
                    len,
                    next_len: len,
                }
            }
            Self::Calendar {
                period,
                unix_origin,
            } => {
                let wall = unix_origin.saturating_add(now);
                let span = period.span_at(wall);
                Frame {
                    index: span.index,
                    elapsed: wall - span.start,
                    len: span.end - span.start,
                    next_len: span.next_end - span.end,
                }
            }
        }
    }

    /// The start of window `index` on the limiter's clock (0 if before its origin,
    /// saturating at `u64::MAX`).
    pub(crate) fn start_of(&self, index: u64) -> u64 {
        match self {
            Self::Rolling(period) => index.saturating_mul(period.get()),
            Self::Calendar {
                period,
                unix_origin,
            } => period.start_of(index).saturating_sub(*unix_origin),
        }
    }

    /// `⌈n / len⌉` for a window of length `len`: through the precomputed divisor for
    /// rolling windows.
    #[inline(always)]
    pub(crate) fn div_ceil(&self, n: u128, len: u64) -> u128 {
        match self {
            Self::Rolling(period) => period.div_ceil_wide(n),
            Self::Calendar { .. } => n.div_ceil(u128::from(len)),
        }
    }
}
