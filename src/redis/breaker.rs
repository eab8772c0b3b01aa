//! The circuit breaker of [`RedisLimiter`](super::RedisLimiter): after consecutive
//! failures, checks stop calling Redis and answer by their fail mode at once; a probe in
//! the background, once per period, finds out when Redis is back.
//!
//! States:
//! - **closed**: every check calls Redis. `failures` consecutive failures, the first and
//!   the last at most `within` apart, open the breaker.
//! - **open**: every check fails at once with
//!   [`RedisError::CircuitOpen`](super::RedisError). When each period ends, a background
//!   task (not a check: no request ever waits for a probe) makes one call (the breaker is
//!   *half-open* while it runs). A probe that Redis answers closes the breaker; one that
//!   fails opens it again for twice the period, up to `max_open_for`. So checks answer
//!   again at most `max_open_for` after Redis does. When the limiter's connection is
//!   rebuilt meanwhile (the new primary of a cluster's slots, or the one Sentinel
//!   names, found), the next probe goes at once.
//!
//! The arithmetic takes time as an argument (nanoseconds of a monotonic clock), so the
//! unit tests drive it without sleeping. Closed and healthy, a check reads one atomic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::nanos;
use crate::error::ConfigError;

/// When [`RedisLimiter`](super::RedisLimiter) stops calling a failing Redis, and for how
/// long. The default: open after 3 consecutive failures within 1 s, for 250 ms at first,
/// doubling while the background probes fail, up to 500 ms (so checks answer again at
/// most 500 ms, plus a round trip, after Redis does).
///
/// ```
/// use std::time::Duration;
/// use tollgate::redis::{CircuitBreaker, RedisLimiter};
///
/// // Open after 5 failures within 2 s (a Redis farther away, or a flakier network).
/// let builder = RedisLimiter::builder("redis://127.0.0.1:6379/", "100/s".parse()?)
///     .circuit_breaker(CircuitBreaker::new(5, Duration::from_secs(2)));
/// # let _ = builder;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CircuitBreaker {
    failures: u32,
    within: Duration,
    open_for: Duration,
    max_open_for: Duration,
    enabled: bool,
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        Self::new(3, Duration::from_secs(1))
    }
}

impl CircuitBreaker {
    /// Opens after `failures` consecutive failed calls, the first and the last at most
    /// `within` apart (validated by [`RedisBuilder::build`](super::RedisBuilder::build):
    /// `failures` ≥ 1 and `within` > 0).
    pub const fn new(failures: u32, within: Duration) -> Self {
        Self {
            failures,
            within,
            open_for: Duration::from_millis(250),
            max_open_for: Duration::from_millis(500),
            enabled: true,
        }
    }

    /// Stays open for `first` after opening, doubling after each failed probe up to
    /// `max` (both > 0, `max` ≥ `first`): `max` bounds how long after Redis answers again
    /// checks still fail at once, and a probe is one call per `max` while Redis is away.
    pub const fn open_for(mut self, first: Duration, max: Duration) -> Self {
        self.open_for = first;
        self.max_open_for = max;
        self
    }

    /// No breaker: every check calls Redis and waits out its timeout when Redis is down.
    pub const fn disabled() -> Self {
        let mut breaker = Self::new(3, Duration::from_secs(1));
        breaker.enabled = false;
        breaker
    }

    /// Whether the breaker can open at all.
    pub const fn is_enabled(&self) -> bool {
        self.enabled
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting, value: String, expected| {
            Err(ConfigError::InvalidRedisSetting {
                setting,
                value,
                expected,
            })
        };
        if !self.enabled {
            return Ok(());
        }
        if self.failures == 0 {
            return invalid("circuit_breaker failures", "0".into(), "1 or more");
        }
        if self.within.is_zero() {
            return invalid(
                "circuit_breaker within",
                format!("{:?}", self.within),
                "a duration above zero",
            );
        }
        if self.open_for.is_zero() || self.max_open_for < self.open_for {
            return invalid(
                "circuit_breaker open_for",
                format!("{:?}..{:?}", self.open_for, self.max_open_for),
                "a first period above zero and a max at least as long",
            );
        }
        Ok(())
    }
}

/// The breaker's state, as [`RedisStats`](super::RedisStats) reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Checks call Redis.
    #[default]
    Closed,
    /// Checks answer by their fail mode without calling Redis.
    Open,
    /// Open, with one probe call under way.
    HalfOpen,
}

/// What a check may do now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Call Redis.
    Call,
    /// Do not call; the next probe is due in this many ns (at least 1).
    Reject(u64),
}

/// What the background prober does now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The breaker is closed: stop probing.
    Closed,
    /// Wait this many ns.
    Wait(u64),
    /// Call Redis now, and report the outcome.
    Now,
}

#[derive(Debug, Default)]
struct Run {
    /// Consecutive failures, and when the first of them happened.
    failures: u32,
    first_at: u64,
    open: bool,
    open_until: u64,
    /// The current open period.
    period: u64,
    probing: bool,
}

/// The breaker of one limiter.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    /// Whether anything is out of the ordinary (failures counted or the breaker open):
    /// while false, neither a call nor a success takes the mutex.
    troubled: AtomicBool,
    run: Mutex<Run>,
    opened: AtomicU64,
    rejected: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self {
            config,
            troubled: AtomicBool::new(false),
            run: Mutex::new(Run::default()),
            opened: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Whether a check may call Redis; `now` (read only while the breaker is troubled)
    /// gives the time.
    #[inline]
    pub(crate) fn gate(&self, now: impl FnOnce() -> u64) -> Gate {
        if !self.troubled.load(Ordering::Acquire) {
            return Gate::Call;
        }
        let run = self.run.lock();
        if !run.open {
            return Gate::Call;
        }
        self.rejected.fetch_add(1, Ordering::Relaxed);
        Gate::Reject(run.open_until.saturating_sub(now()).max(1))
    }

    /// Whether the breaker is open (checks fail at once).
    pub(crate) fn is_open(&self) -> bool {
        self.troubled.load(Ordering::Acquire) && self.run.lock().open
    }

    /// An open breaker's next probe is due at `now` (unless one runs): the connection was
    /// rebuilt (after a failover), so Redis may well answer already.
    pub(crate) fn probe_soon(&self, now: u64) {
        let mut run = self.run.lock();
        if run.open && !run.probing {
            run.open_until = run.open_until.min(now);
        }
    }

    /// What the background prober does at `now`; `Now` marks the breaker half-open until
    /// the outcome is reported (and, should the probe hang, lets the next one start a
    /// period later).
    pub(crate) fn next_probe(&self, now: u64) -> Probe {
        let mut run = self.run.lock();
        if !run.open {
            return Probe::Closed;
        }
        if now < run.open_until {
            return Probe::Wait(run.open_until - now);
        }
        run.probing = true;
        run.open_until = now.saturating_add(run.period);
        Probe::Now
    }

    /// A call succeeded (Redis answered); true if that closed the breaker.
    #[inline]
    pub(crate) fn succeeded(&self) -> bool {
        if !self.troubled.load(Ordering::Acquire) {
            return false;
        }
        let mut run = self.run.lock();
        let was_open = run.open;
        *run = Run::default();
        self.troubled.store(false, Ordering::Release);
        was_open
    }

    /// A call failed for want of Redis at `now`; `probe` if it was the probe. True if
    /// that opened the breaker.
    pub(crate) fn failed(&self, now: u64, probe: bool) -> bool {
        if !self.config.enabled {
            return false;
        }
        let mut run = self.run.lock();
        self.troubled.store(true, Ordering::Release);
        if run.open {
            if probe {
                run.probing = false;
                run.period = run
                    .period
                    .saturating_mul(2)
                    .min(nanos(self.config.max_open_for));
                run.open_until = now.saturating_add(run.period);
            }
            // A call begun before the breaker opened says nothing new.
            return false;
        }
        if run.failures == 0 || now.saturating_sub(run.first_at) > nanos(self.config.within) {
            run.failures = 1;
            run.first_at = now;
        } else {
            run.failures += 1;
        }
        if run.failures < self.config.failures {
            return false;
        }
        run.open = true;
        run.probing = false;
        run.period = nanos(self.config.open_for);
        run.open_until = now.saturating_add(run.period);
        self.opened.fetch_add(1, Ordering::Relaxed);
        true
    }

    pub(crate) fn state(&self) -> BreakerState {
        let run = self.run.lock();
        match (run.open, run.probing) {
            (false, _) => BreakerState::Closed,
            (true, false) => BreakerState::Open,
            (true, true) => BreakerState::HalfOpen,
        }
    }

    /// Times the breaker opened.
    pub(crate) fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Checks answered without calling Redis because the breaker was open.
    pub(crate) fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn breaker() -> Breaker {
        Breaker::new(
            CircuitBreaker::new(3, Duration::from_secs(1))
                .open_for(Duration::from_millis(500), Duration::from_secs(2)),
        )
    }

    /// A rebuilt connection brings the next probe forward to now, once a probe is not
    /// running; a closed breaker ignores it.
    #[test]
    fn a_rebuilt_connection_brings_the_probe_forward() {
        let b = breaker();
        b.probe_soon(0);
        assert_eq!(b.next_probe(0), Probe::Closed);
        for t in 0..3 {
            b.failed(t * MS, false);
        }
        assert_eq!(b.next_probe(10 * MS), Probe::Wait(492 * MS));
        b.probe_soon(10 * MS);
        assert_eq!(b.next_probe(10 * MS), Probe::Now);
        // While that probe runs, nothing moves; it fails, and the period doubles.
        b.probe_soon(11 * MS);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.failed(12 * MS, true);
        assert_eq!(b.next_probe(12 * MS), Probe::Wait(1_000 * MS));
        b.probe_soon(20 * MS);
        assert_eq!(b.next_probe(20 * MS), Probe::Now);
    }

    #[test]
    fn three_failures_within_the_window_open_it_and_a_success_in_between_does_not() {
        let b = breaker();
        assert!(!b.failed(0, false));
        assert!(!b.failed(10 * MS, false));
        assert!(!b.succeeded());
        assert!(!b.failed(20 * MS, false));
        assert!(!b.failed(30 * MS, false));
        assert_eq!(b.gate(|| 31 * MS), Gate::Call);
        assert!(b.failed(40 * MS, false), "the third in a row");
        assert_eq!(b.state(), BreakerState::Open);
        assert!(b.is_open());
        assert_eq!(b.gate(|| 41 * MS), Gate::Reject(499 * MS));
        assert_eq!(b.opened(), 1);
        assert_eq!(b.rejected(), 1);
    }

    #[test]
    fn failures_further_apart_than_the_window_do_not_open_it() {
        let b = breaker();
        for i in 0..10 {
            assert!(!b.failed(i * 600 * MS, false));
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.gate(|| 6_000 * MS), Gate::Call);
    }

    #[test]
    fn one_probe_per_period_doubling_to_the_max_and_checks_never_probe() {
        let b = breaker();
        for t in 0..3 {
            b.failed(t, false);
        }
        let open_at = 2;
        assert_eq!(b.next_probe(open_at + 499 * MS), Probe::Wait(MS));
        assert_eq!(b.next_probe(open_at + 500 * MS), Probe::Now);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        // Checks fail at once while the probe runs: none of them waits for it.
        assert!(matches!(b.gate(|| open_at + 500 * MS), Gate::Reject(_)));
        // The probe fails: 1 s, then 2 s, then 2 s (the max).
        let mut now = open_at + 600 * MS;
        for period in [1_000, 2_000, 2_000] {
            assert!(!b.failed(now, true));
            assert_eq!(b.state(), BreakerState::Open);
            assert_eq!(b.gate(|| now + period * MS - 1), Gate::Reject(1));
            assert_eq!(b.next_probe(now + period * MS - 1), Probe::Wait(1));
            now += period * MS;
            assert_eq!(b.next_probe(now), Probe::Now);
        }
        assert!(b.succeeded(), "the probe closes it");
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.gate(|| now), Gate::Call);
        assert_eq!(b.next_probe(now), Probe::Closed);
        // A new outage starts again from the first period.
        for t in 0..3 {
            b.failed(now + t, false);
        }
        assert_eq!(b.next_probe(now + 2 + 500 * MS), Probe::Now);
        assert_eq!(b.opened(), 2);
    }

    #[test]
    fn a_hung_probe_lets_the_next_one_start_a_period_later() {
        let b = breaker();
        for t in 0..3 {
            b.failed(t, false);
        }
        assert_eq!(b.next_probe(600 * MS), Probe::Now);
        assert_eq!(b.next_probe(700 * MS), Probe::Wait(400 * MS));
        assert_eq!(b.next_probe(1_100 * MS), Probe::Now);
    }

    #[test]
    fn the_default_answers_again_within_half_a_second() {
        let b = Breaker::new(CircuitBreaker::default());
        for t in 0..3 {
            b.failed(t, false);
        }
        let mut now = 2;
        let mut longest = 0;
        for _ in 0..10 {
            let Probe::Wait(ns) = b.next_probe(now) else {
                panic!("a probe before its period")
            };
            longest = longest.max(ns);
            now += ns;
            assert_eq!(b.next_probe(now), Probe::Now);
            b.failed(now, true);
        }
        assert_eq!(longest, 500 * MS);
    }

    #[test]
    fn disabled_never_opens_and_bad_settings_are_typed_errors() {
        let b = Breaker::new(CircuitBreaker::disabled());
        for t in 0..100 {
            b.failed(t, false);
        }
        assert_eq!(b.gate(|| 100), Gate::Call);
        for bad in [
            CircuitBreaker::new(0, Duration::from_secs(1)),
            CircuitBreaker::new(3, Duration::ZERO),
            CircuitBreaker::default().open_for(Duration::ZERO, Duration::from_secs(1)),
            CircuitBreaker::default().open_for(Duration::from_secs(2), Duration::from_secs(1)),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(
                matches!(err, ConfigError::InvalidRedisSetting { .. }),
                "{err}"
            );
        }
        assert!(CircuitBreaker::disabled().validate().is_ok());
    }
}
