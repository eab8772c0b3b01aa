//! The node's schedule and health: time is an argument (ns from any origin), and the
//! driver says when the node next needs to run and whether a round may go now. The
//! [node](super::node) runs it (and so the task and the simulation alike).
//!
//! ```text
//!            poll_timeout()                 on_success(now) ──► Health::Recovered
//!  sleep ───────────────────► handle_timeout(now) ─► round? ─┤
//!    ▲                                                       └ on_failure(now): backoff
//!    └──────────────────── poll_health(now) ──► Health::Fell (silent for the staleness)
//! ```

use std::time::Duration;

use crate::rng::XorShift;

/// Repeated failures back off up to this long between rounds.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// The seed of a node's jitter: a hash of its id, the same on every build.
pub(crate) fn seed(node: u64) -> u64 {
    ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(node)
}

/// `d` in whole µs, saturating.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `d` in whole ms, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) use crate::clock::nanos;

/// What the driver's schedule runs by, in ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
    /// The sync interval: rounds come every `interval ± 25%`.
    pub(crate) interval_ns: u64,
    /// A node that has had no successful round for this long is silent: it falls back.
    pub(crate) staleness_ns: u64,
    /// The longest wait between rounds while they keep failing.
    pub(crate) max_backoff_ns: u64,
}

/// A change of the node's health that the task acts on (the fail mode, events, stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Health {
    Unchanged,
    /// Silent for the staleness (or never heard and failing): the fail mode applies.
    Fell,
    /// A round succeeded while in the fail mode: normal operation again.
    Recovered,
}

/// The fewest keys a round shrinks to after timeouts (or the configured most, if fewer).
const MIN_ROUND_KEYS: usize = 50;

/// How many keys a round sends: the configured most (`round_keys`), halved by each round
/// that times out, and grown back by an eighth after every [`GROW_AFTER`] successful
/// rounds in a row, up to the most. A round too large to finish within the timeout (a
/// flood of keys on a loaded machine, a slow link) would otherwise fail every time, with
/// every key left waiting and the node in its fallback for good; growing slowly keeps the
/// rounds that fit from probing straight back into a timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RoundSize {
    most: usize,
    keys: usize,
    /// Successful rounds since the last change.
    streak: u32,
}

/// Successful rounds in a row before a round may send an eighth more keys.
const GROW_AFTER: u32 = 8;

impl RoundSize {
    pub(crate) fn new(most: usize) -> Self {
        Self {
            most,
            keys: most,
            streak: 0,
        }
    }

    /// The keys the next round may send.
    pub(crate) fn keys(&self) -> usize {
        self.keys
    }

    /// A round timed out: the next sends half as many keys, down to the minimum.
    pub(crate) fn timed_out(&mut self) {
        self.streak = 0;
        self.keys = (self.keys / 2).max(MIN_ROUND_KEYS.min(self.most));
    }

    /// A round succeeded: after [`GROW_AFTER`] in a row, the next may send an eighth more
    /// keys, up to the most.
    pub(crate) fn succeeded(&mut self) {
        self.streak += 1;
        if self.streak >= GROW_AFTER {
            self.streak = 0;
            self.keys = (self.keys + self.keys.div_ceil(8)).min(self.most);
        }
    }
}

/// The schedule of a node's rounds, their backoff, and the staleness/fallback state.
#[derive(Clone, Debug)]
pub(crate) struct Driver {
    timing: Timing,
    jitter: XorShift,
    started: u64,
    next_round: u64,
    /// Sliding window in lease mode: an extra round just after Redis's next window
    /// starts, when every lease of the last one has expired.
    window_round: Option<u64>,
    retry_at: u64,
    failures: u32,
    last_success: Option<u64>,
    fallback: bool,
}

impl Driver {
    /// A driver started at `now`, whose jitter is seeded by `seed` (the node's: nodes
    /// started together then drift apart). Its first round is due at once: it tells the
    /// number of nodes, and so a new key's share.
    pub(crate) fn new(timing: Timing, seed: u64, now: u64) -> Self {
        Self {
            timing,
            jitter: XorShift::new(seed),
            started: now,
            next_round: now,
            window_round: None,
            retry_at: now,
            failures: 0,
            last_success: None,
            fallback: false,
        }
    }

    /// When the driver next needs [`handle_timeout`](Self::handle_timeout): the next
    /// scheduled round, or the window's round if that comes first.
    pub(crate) fn poll_timeout(&self) -> u64 {
        self.window_round
            .map_or(self.next_round, |at| at.min(self.next_round))
    }

    /// Consumes the timers due at `now` and says whether a round runs now: one is due
    /// and the rounds are not backing off. The next scheduled round is jittered by ±25%
    /// of the interval, so that nodes started together do not hit Redis in lock-step and
    /// no node is always first after the global state refills; over many rounds they
    /// average one interval apart, however late each wake-up.
    pub(crate) fn handle_timeout(&mut self, now: u64) -> bool {
        let mut due = false;
        if now >= self.next_round {
            // From when the round was due, not from when the timer fired: a late wake-up
            // (a timer's granularity, a busy runtime) must not slow the schedule down.
            // One more than an interval late starts afresh from now instead of catching
            // up with a burst of rounds.
            let interval = Duration::from_nanos(self.timing.interval_ns);
            let jitter = nanos(self.jitter.around(interval));
            let next = self.next_round.saturating_add(jitter);
            self.next_round = if next > now {
                next
            } else {
                now.saturating_add(jitter)
            };
            due = true;
        }
        if self.window_round.is_some_and(|at| now >= at) {
            self.window_round = None;
            due = true;
        }
        due && self.may_run(now)
    }

    /// Whether a round asked for early (a key waiting for a lease) may run at `now`:
    /// not while the rounds back off.
    pub(crate) fn may_run(&self, now: u64) -> bool {
        now >= self.retry_at
    }

    /// Also run a round at `at` (ns), or no extra round.
    pub(crate) fn round_at(&mut self, at: Option<u64>) {
        self.window_round = at;
    }

    /// A round succeeded at `now`.
    pub(crate) fn on_success(&mut self, now: u64) -> Health {
        self.failures = 0;
        self.retry_at = now;
        self.last_success = Some(now);
        if std::mem::replace(&mut self.fallback, false) {
            Health::Recovered
        } else {
            Health::Unchanged
        }
    }

    /// A round failed at `now`: one failure retries at the next interval; repeated ones
    /// back off, doubling up to the maximum.
    pub(crate) fn on_failure(&mut self, now: u64) {
        self.failures = self.failures.saturating_add(1);
        let backoff = self
            .timing
            .interval_ns
            .saturating_mul(1 << (self.failures - 1).min(8))
            .min(self.timing.max_backoff_ns);
        self.retry_at = now.saturating_add(backoff);
    }

    /// Whether the node is silent at `now` — no successful round for the staleness (since
    /// the start, until the first), or none ever and one failed — and whether that just
    /// began ([`Health::Fell`]).
    pub(crate) fn poll_health(&mut self, now: u64) -> (bool, Health) {
        let since = self.last_success.unwrap_or(self.started);
        let silent = now.saturating_sub(since) >= self.timing.staleness_ns
            || (self.last_success.is_none() && self.failures > 0);
        if silent && !self.fallback {
            self.fallback = true;
            return (true, Health::Fell);
        }
        (silent, Health::Unchanged)
    }

    /// Whether the fail mode applies (from [`Health::Fell`] to [`Health::Recovered`]).
    pub(crate) fn in_fallback(&self) -> bool {
        self.fallback
    }

    /// Consecutive failed rounds.
    #[cfg(test)]
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rounds_shrink_on_timeouts_and_grow_back() {
        let mut size = RoundSize::new(2_000);
        assert_eq!(size.keys(), 2_000);
        size.timed_out();
        assert_eq!(size.keys(), 1_000);
        for _ in 0..10 {
            size.timed_out();
        }
        assert_eq!(size.keys(), MIN_ROUND_KEYS);
        // An eighth more after 8 successful rounds in a row, not before; a timeout
        // starts the count again.
        for _ in 0..7 {
            size.succeeded();
        }
        assert_eq!(size.keys(), MIN_ROUND_KEYS);
        size.timed_out();
        for _ in 0..7 {
            size.succeeded();
        }
        assert_eq!(size.keys(), MIN_ROUND_KEYS);
        size.succeeded();
        assert_eq!(size.keys(), MIN_ROUND_KEYS + MIN_ROUND_KEYS.div_ceil(8));
        // Back to the most, and never above it.
        for _ in 0..8 * 40 {
            size.succeeded();
        }
        assert_eq!(size.keys(), 2_000);
        // A most below the minimum is kept: 1 key a round stays 1.
        let mut one = RoundSize::new(1);
        one.timed_out();
        assert_eq!(one.keys(), 1);
        one.succeeded();
        assert_eq!(one.keys(), 1);
    }

    use super::*;

    const MS: u64 = 1_000_000;

    fn timing(interval_ms: u64) -> Timing {
        Timing {
            interval_ns: interval_ms * MS,
            staleness_ns: (3 * interval_ms * MS).max(500 * MS),
            max_backoff_ns: nanos(MAX_BACKOFF),
        }
    }

    /// Runs the driver alone from 0 to `until` in steps of 1 ms (a tenth of the interval
    /// if that is less: a timer's granularity), every round succeeding or failing as `ok`
    /// says; returns when rounds ran.
    fn rounds(driver: &mut Driver, from: u64, until: u64, ok: impl Fn(u64) -> bool) -> Vec<u64> {
        let step = MS.min(driver.timing.interval_ns / 10);
        let mut ran = Vec::new();
        let mut now = from;
        while now < until {
            if now >= driver.poll_timeout() && driver.handle_timeout(now) {
                ran.push(now);
                if ok(now) {
                    driver.on_success(now);
                } else {
                    driver.on_failure(now);
                }
            }
            now += step;
        }
        ran
    }

    #[test]
    fn rounds_come_every_interval_give_or_take_a_quarter_from_the_first_at_once() {
        for interval_ms in [1, 50, 1_000] {
            let mut driver = Driver::new(timing(interval_ms), 7, 0);
            let ran = rounds(&mut driver, 0, 200 * interval_ms * MS, |_| true);
            assert_eq!(ran[0], 0, "the first round runs at once");
            let step = interval_ms * MS;
            for gap in ran.windows(2).map(|w| w[1] - w[0]) {
                // A wake-up comes up to a step late, and the next is due from when this
                // one was.
                let late = MS.min(step / 10);
                assert!(
                    gap + late >= step * 3 / 4 && gap <= step * 5 / 4 + late,
                    "{gap}"
                );
            }
            // The mean stays at the interval although each wake-up comes up to a step
            // late: no drift over 200 rounds (the jitter's mean is the interval,
            // and the sample mean of 200 draws is within 3% of it).
            let mean = ran[ran.len() - 1] / (ran.len() as u64 - 1);
            assert!(
                mean.abs_diff(step) <= step * 3 / 100,
                "{interval_ms} ms: {mean}"
            );
        }
    }

    #[test]
    fn two_nodes_started_together_drift_apart() {
        let mut a = Driver::new(timing(50), 1, 0);
        let mut b = Driver::new(timing(50), 2, 0);
        let ra = rounds(&mut a, 0, 5_000 * MS, |_| true);
        let rb = rounds(&mut b, 0, 5_000 * MS, |_| true);
        let together = ra.iter().filter(|t| rb.contains(t)).count();
        assert!(together < ra.len() / 4, "{together} of {}", ra.len());
    }

    #[test]
    fn failures_back_off_doubling_up_to_the_maximum_and_success_resets() {
        let mut driver = Driver::new(timing(10), 3, 0);
        // Redis down for 10 s, then up.
        let ran = rounds(&mut driver, 0, 20_000 * MS, |now| now >= 10_000 * MS);
        let failed: Vec<u64> = ran
            .iter()
            .copied()
            .take_while(|&t| t < 10_000 * MS)
            .collect();
        let gaps: Vec<u64> = failed.windows(2).map(|w| w[1] - w[0]).collect();
        // 10, 20, 40, ... ms, the schedule's jitter on top, never beyond 500 ms + one
        // interval's jitter.
        assert!(gaps[0] <= 13 * MS, "{gaps:?}");
        assert!(gaps.iter().all(|&g| g <= 500 * MS + 13 * MS), "{gaps:?}");
        assert!(
            gaps[gaps.len() - 5..].iter().all(|&g| g >= 500 * MS),
            "{gaps:?}"
        );
        // Once Redis answers, within one backoff; then at the interval again.
        let first_ok = ran.iter().copied().find(|&t| t >= 10_000 * MS).unwrap();
        assert!(first_ok <= 10_000 * MS + 513 * MS, "{first_ok}");
        assert_eq!(driver.failures(), 0);
        let after: Vec<u64> = ran.iter().copied().filter(|&t| t >= first_ok).collect();
        assert!(after.windows(2).all(|w| w[1] - w[0] <= 13 * MS));
    }

    #[test]
    fn silence_for_the_staleness_falls_back_once_and_a_success_recovers() {
        let t = timing(50);
        let mut driver = Driver::new(t, 4, 0);
        driver.on_success(0);
        assert_eq!(
            driver.poll_health(t.staleness_ns - 1),
            (false, Health::Unchanged)
        );
        assert_eq!(driver.poll_health(t.staleness_ns), (true, Health::Fell));
        assert_eq!(
            driver.poll_health(t.staleness_ns * 10),
            (true, Health::Unchanged)
        );
        assert!(driver.in_fallback());
        assert_eq!(driver.on_success(t.staleness_ns * 10), Health::Recovered);
        assert_eq!(driver.on_success(t.staleness_ns * 11), Health::Unchanged);
        assert!(!driver.in_fallback());
    }

    #[test]
    fn a_node_that_never_reached_redis_falls_back_at_its_first_failure() {
        let mut driver = Driver::new(timing(50), 5, 0);
        assert_eq!(driver.poll_health(MS), (false, Health::Unchanged));
        driver.on_failure(MS);
        assert_eq!(driver.poll_health(2 * MS), (true, Health::Fell));
        // One that reached it once waits for the staleness instead.
        let mut driver = Driver::new(timing(50), 5, 0);
        driver.on_success(0);
        driver.on_failure(MS);
        assert_eq!(driver.poll_health(2 * MS), (false, Health::Unchanged));
    }

    #[test]
    fn a_window_round_runs_at_its_instant_besides_the_schedule() {
        let mut driver = Driver::new(timing(1_000), 6, 0);
        assert!(driver.handle_timeout(0));
        driver.on_success(0);
        driver.round_at(Some(300 * MS));
        assert_eq!(driver.poll_timeout(), 300 * MS);
        assert!(driver.handle_timeout(300 * MS));
        assert!(driver.poll_timeout() >= 750 * MS, "back to the schedule");
        // Not while backing off.
        driver.on_failure(300 * MS);
        driver.round_at(Some(301 * MS));
        assert!(!driver.handle_timeout(301 * MS));
    }
}
