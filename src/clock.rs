//! Time sources. A limiter reads time as integer nanoseconds since the clock's own origin.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonic source of time in whole nanoseconds.
///
/// Implementations must never go backwards; the origin is arbitrary but fixed. Windowed
/// algorithms align their windows to multiples of the period on this clock.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds elapsed since this clock's origin.
    fn now_ns(&self) -> u64;

    /// The Unix time of this clock's origin, in nanoseconds: wall time is this plus
    /// [`now_ns`](Self::now_ns). Calendar periods read it once, when a limiter is built.
    ///
    /// The default reads the system's wall clock now and subtracts `now_ns`.
    fn unix_origin_ns(&self) -> u64 {
        unix_now_ns().saturating_sub(self.now_ns())
    }
}

/// `d` in whole nanoseconds, saturating at `u64::MAX` (about 584 years).
#[inline]
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The system's wall clock, in Unix nanoseconds (0 before 1970).
fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, nanos)
}

/// The default clock: quanta's TSC-backed monotonic clock, with its origin at creation.
///
/// Reading it costs a few nanoseconds and never makes a system call where the TSC is
/// usable; quanta falls back to the OS monotonic clock elsewhere.
///
/// Its wall time is the system's at its creation plus the monotonic time since: a step
/// of the system clock afterwards (not NTP's gradual slewing, which both follow) is not
/// seen by calendar periods until the limiter is rebuilt on a new clock.
#[derive(Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    origin: u64,
    unix_origin: u64,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self {
            clock,
            origin,
            unix_origin: unix_now_ns(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MonotonicClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MonotonicClock")
            .field("now_ns", &self.now_ns())
            .finish()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }

    fn unix_origin_ns(&self) -> u64 {
        self.unix_origin
    }
}

/// A clock that only moves when told to: for tests and simulations.
///
/// Clones share the same time. Its wall time starts at the Unix epoch, or at the instant
/// given to [`at_unix`](Self::at_unix).
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(shared.now_ns(), 5_000_000);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
    unix_origin: u64,
}

impl ManualClock {
    /// A clock at time 0, whose wall time is the Unix epoch.
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock at time 0 whose wall time starts at the Unix instant `unix` (saturating
    /// at `u64::MAX` nanoseconds, in 2554): for tests of calendar periods.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::{Clock, ManualClock};
    ///
    /// let clock = ManualClock::at_unix(Duration::from_secs(1_738_364_400)); // 2025-01-31T23:00Z
    /// clock.advance(Duration::from_secs(5));
    /// assert_eq!(clock.unix_origin_ns() + clock.now_ns(), 1_738_364_405_000_000_000);
    /// ```
    pub fn at_unix(unix: Duration) -> Self {
        Self {
            now: Arc::default(),
            unix_origin: nanos(unix),
        }
    }

    /// Moves the clock forward by `by`, saturating at `u64::MAX` nanoseconds.
    pub fn advance(&self, by: Duration) {
        let by = nanos(by);
        // `fetch_update` with a closure that always returns `Some` cannot fail.
        let _ = self
            .now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(by))
            });
    }

    /// Moves the clock to `ns` nanoseconds if that is later than now; a clock never goes
    /// backwards, so an earlier value is ignored.
    pub fn set_ns(&self, ns: u64) {
        self.now.fetch_max(ns, Ordering::AcqRel);
    }

    /// The current time since the origin.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.now_ns())
    }
}

/// A shared clock: every holder reads the same time (the synced limiter shares its
/// clock with the syncs of its [`also`](crate::Builder::also) quotas this way).
impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    #[inline]
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }

    fn unix_origin_ns(&self) -> u64 {
        (**self).unix_origin_ns()
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }

    fn unix_origin_ns(&self) -> u64 {
        self.unix_origin
    }
}

/// Tokio's clock (cargo feature `tokio`): time as tokio's timer sees it, so that under
/// `tokio::time::pause()` a limiter and its waiters share one virtual time and tests of
/// the waiting API never really sleep. Its wall time is the system's when first asked,
/// less tokio's time since its origin.
#[cfg(feature = "tokio")]
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

#[cfg(feature = "tokio")]
impl TokioClock {
    /// A clock whose origin is tokio's now.
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }
}

#[cfg(feature = "tokio")]
impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(feature = "tokio")]
impl Clock for TokioClock {
    fn now_ns(&self) -> u64 {
        nanos(self.origin.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_saturates_and_never_goes_back() {
        let c = ManualClock::new();
        c.set_ns(10);
        c.set_ns(3);
        assert_eq!(c.now_ns(), 10);
        c.advance(Duration::MAX);
        assert_eq!(c.now_ns(), u64::MAX);
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let c = MonotonicClock::new();
        let start = std::time::Instant::now();
        let a = c.now_ns();
        // Spin (no sleep) until the OS clock has moved 1ms; quanta must have moved with it.
        while start.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
        let b = c.now_ns();
        assert!(b - a >= 900_000, "{a} -> {b}");
    }
}
