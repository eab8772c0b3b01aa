//! The token bucket, run as GCRA (the generic cell rate algorithm).
//!
//! The state is the theoretical arrival time `tat` in nanoseconds: the instant at which the
//! bucket would be full again. With `T = ⌊period / limit⌋` and `τ = (burst − 1)·T`, a
//! request of cost `n` at `now` is admitted iff
//!
//! ```text
//! now ≥ tat + (n − 1)·T − τ
//! ```
//!
//! and then `tat ← max(tat, now) + n·T`. This is the same rule, with the same integer
//! arithmetic, as governor's GCRA, so both admit exactly the same requests.
//!
//! **Bound.** In any interval of length `t`, at most `burst + ⌊t / T⌋` unit requests are
//! admitted (`≈ burst + t·limit/period`; equal when `limit` divides the period in ns).

use super::{Divisor, Outcome, clamp_ns};
use crate::decision::Decision;
use crate::quota::Quota;

/// GCRA constants for one quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gcra {
    /// Emission interval `T`, ns. Never zero.
    t: u64,
    /// Tolerance `τ = (burst − 1)·T`, ns.
    tau: u64,
    /// Capacity.
    burst: u64,
    /// `T` as a multiply-and-shift divisor: `remaining` divides by `T` on every check.
    per_t: Divisor,
}

impl Gcra {
    pub(crate) fn new(quota: Quota) -> Self {
        let t = quota.emission_interval_ns();
        // `Quota::with_burst` guarantees burst·T fits in u64.
        Self {
            t,
            tau: t * (quota.burst() - 1),
            burst: quota.burst(),
            per_t: Divisor::new(t),
        }
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.burst
    }

    /// This quota's state for a key whose state was `tat` under `from`: the units it had
    /// consumed (its debt `tat − now` divided by `from`'s `T`, fractions kept) carry over,
    /// rounded up and capped at this quota's burst. A quota change therefore never refills
    /// a key, and never leaves it deeper in debt than an empty bucket.
    pub(crate) fn convert_from(&self, tat: u64, now: u64, from: &Gcra) -> u64 {
        let debt = u128::from(tat.saturating_sub(now));
        if debt == 0 {
            return tat;
        }
        let t = u128::from(self.t);
        let scaled = (debt * t).div_ceil(u128::from(from.t));
        let capped = scaled.min(u128::from(self.tau) + t);
        now.saturating_add(clamp_ns(capped))
    }

    /// The TAT after a settlement at `now`. A charge of `n` moves it `n·T` later from
    /// `max(tat, now)`, however far that is: the key is in debt while the TAT lies more
    /// than `τ` ahead, and a unit request passes again once `now ≥ tat − τ`, so the debt
    /// is repaid at the quota's rate. A refund of `n` moves it `n·T` earlier, but never
    /// before `now` (a full bucket).
    #[inline(always)]
    pub(crate) fn settle(&self, tat: u64, now: u64, op: super::Settle) -> u64 {
        let amount = |n: u64| clamp_ns(u128::from(n) * u128::from(self.t));
        match op {
            super::Settle::Charge(n) => tat.max(now).saturating_add(amount(n)),
            super::Settle::Refund(_) if tat <= now => tat,
            super::Settle::Refund(n) => tat.saturating_sub(amount(n)).max(now),
        }
    }

    /// What [`evaluate`](Self::evaluate) says of a unit request at `now` without
    /// consuming it: a deny as it gives one, or an admission with the state as it stands.
    #[inline]
    pub(crate) fn unit_view(&self, tat: u64, now: u64) -> Decision {
        let (remaining, reset) = (self.remaining(tat, now), tat.saturating_sub(now));
        let wait = tat.saturating_sub(self.tau).saturating_sub(now);
        Decision::waiting(self.burst, remaining, reset, wait)
    }

    /// Unit requests admissible at `now` when the bucket's TAT is `tat`.
    fn remaining(&self, tat: u64, now: u64) -> u64 {
        self.per_t
            .div((self.tau + self.t).saturating_sub(tat.saturating_sub(now)))
    }

    /// The debt (TAT − now) below which `looser` has more units left than `tighter` can
    /// ever hold, so that `tighter` is the tighter of the two in every admission: units
    /// left `⌊(τ + T − debt) / T⌋` exceed `tighter`'s burst exactly when `debt ≤ τ + T −
    /// (burst + 1)·T`. 0 (never) when no debt is that small.
    fn looser_below(tighter: &Self, looser: &Self) -> u64 {
        let room = u128::from(looser.tau) + u128::from(looser.t);
        let more = (u128::from(tighter.burst) + 1) * u128::from(looser.t);
        room.checked_sub(more)
            .map_or(0, |debt| u64::try_from(debt + 1).unwrap_or(u64::MAX))
    }

    /// Both bounds [`admit_both`](Self::admit_both) takes for `pair`, in its order: below
    /// the first (the first bucket's debt), the second bucket is the tighter; below the
    /// second, the first.
    pub(crate) fn looser_bounds(pair: [&Self; 2]) -> [u64; 2] {
        let [a, b] = pair;
        [Self::looser_below(b, a), Self::looser_below(a, b)]
    }

    /// The admission of a request of `cost` (at least 1, at most both capacities) under
    /// two buckets at once, `tats` their states: the decision of the tighter (as
    /// [`Decision::tighter`] picks it, marked with its index) and both new states; `None`
    /// if either denies. The two-quota check's common case, in registers: the same
    /// arithmetic as [`evaluate`](Self::evaluate) on each.
    #[inline(always)]
    pub(crate) fn admit_both(
        pair: [&Self; 2],
        looser_below: [u64; 2],
        tats: [u64; 2],
        now: u64,
        cost: u64,
    ) -> Option<(Decision, [u64; 2])> {
        let [a, b] = pair;
        let (extra_a, extra_b) = (a.t * (cost - 1), b.t * (cost - 1));
        let earliest_a = tats[0].saturating_add(extra_a).saturating_sub(a.tau);
        let earliest_b = tats[1].saturating_add(extra_b).saturating_sub(b.tau);
        if now < earliest_a || now < earliest_b {
            return None;
        }
        let next_a = tats[0].max(now).saturating_add(a.t + extra_a);
        let next_b = tats[1].max(now).saturating_add(b.t + extra_b);
        let (reset_a, reset_b) = (next_a - now, next_b - now);
        // One has more units left than the other can hold: the other is the tighter,
        // and the looser one's units need no division.
        if reset_b < looser_below[1] {
            let decision = Decision::allow(a.burst, a.remaining(next_a, now), reset_a);
            return Some((decision.for_policy(0), [next_a, next_b]));
        }
        if reset_a < looser_below[0] {
            let decision = Decision::allow(b.burst, b.remaining(next_b, now), reset_b);
            return Some((decision.for_policy(1), [next_a, next_b]));
        }
        let (left_a, left_b) = (a.remaining(next_a, now), b.remaining(next_b, now));
        let second = (left_b, std::cmp::Reverse(reset_b)) < (left_a, std::cmp::Reverse(reset_a));
        let pick = |x: u64, y: u64| if second { y } else { x };
        let decision = Decision::allow(
            pick(a.burst, b.burst),
            pick(left_a, left_b),
            pick(reset_a, reset_b),
        )
        .for_policy(usize::from(second));
        Some((decision, [next_a, next_b]))
    }

    #[inline(always)]
    pub(crate) fn evaluate(&self, tat: u64, now: u64, cost: u64) -> Outcome {
        if cost == 0 {
            let decision = Decision::allow(
                self.burst,
                self.remaining(tat, now),
                tat.saturating_sub(now),
            );
            return Outcome::Allow {
                decision,
                state: tat,
            };
        }
        // cost ≤ burst, so (cost − 1)·T ≤ τ cannot overflow.
        let extra = self.t * (cost - 1);
        let earliest = tat.saturating_add(extra).saturating_sub(self.tau);
        if now < earliest {
            return Outcome::Deny(Decision::deny(
                self.burst,
                self.remaining(tat, now),
                tat.saturating_sub(now),
                earliest - now,
            ));
        }
        let next = tat.max(now).saturating_add(self.t + extra);
        Outcome::Allow {
            decision: Decision::allow(
                self.burst,
                self.remaining(next, now),
                clamp_ns(u128::from(next - now)),
            ),
            state: next,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::UNTOUCHED;
    use std::time::Duration;

    fn gcra(limit: u64, period_ms: u64, burst: u64) -> Gcra {
        let q = Quota::new(limit, Duration::from_millis(period_ms))
            .unwrap()
            .with_burst(burst)
            .unwrap();
        Gcra::new(q)
    }

    fn run(g: &Gcra, state: &mut u64, now: u64, cost: u64) -> Decision {
        match g.evaluate(*state, now, cost) {
            Outcome::Allow { decision, state: s } => {
                *state = s;
                decision
            }
            Outcome::Deny(d) => d,
        }
    }

    #[test]
    fn burst_then_one_per_interval() {
        // 10 per second (T = 100ms), burst 3.
        let g = gcra(10, 1000, 3);
        let mut s = UNTOUCHED;
        let now = 5_000_000_000;
        let remaining: Vec<u64> = (0..3)
            .map(|_| run(&g, &mut s, now, 1).remaining())
            .collect();
        assert_eq!(remaining, [2, 1, 0]);
        let d = run(&g, &mut s, now, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_millis(100)));
        assert_eq!(d.reset_after(), Duration::from_millis(300));
        // One nanosecond early is still denied, and says 1ns.
        let d = run(&g, &mut s, now + 99_999_999, 1);
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
        assert!(run(&g, &mut s, now + 100_000_000, 1).is_allowed());
    }

    #[test]
    fn cost_n_waits_for_n_tokens() {
        let g = gcra(10, 1000, 5);
        let mut s = UNTOUCHED;
        assert!(run(&g, &mut s, 0, 5).is_allowed());
        let d = run(&g, &mut s, 0, 3);
        assert_eq!(d.retry_after(), Some(Duration::from_millis(300)));
        assert_eq!(d.remaining(), 0);
        let d = run(&g, &mut s, 300_000_000, 3);
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 0);
        assert_eq!(d.reset_after(), Duration::from_millis(500));
    }

    #[test]
    fn the_unit_view_is_a_unit_peek() {
        let g = gcra(10, 1000, 3);
        let policy = crate::algorithm::WordPolicy::token_bucket(
            Quota::new(10, Duration::from_secs(1))
                .unwrap()
                .with_burst(3)
                .unwrap(),
        );
        let now = 10_000_000_000;
        for tat in [
            0,
            now - 1,
            now,
            now + 1,
            now + 99_999_999,
            now + 200_000_000,
            now + 200_000_001,
            now + 5_000_000_000,
        ] {
            assert_eq!(g.unit_view(tat, now), policy.peek(tat, now, 1), "tat {tat}");
        }
    }

    #[test]
    fn a_deny_never_changes_state() {
        let g = gcra(1, 1000, 1);
        let s = g.t * 7;
        assert!(matches!(g.evaluate(s, 0, 1), Outcome::Deny(_)));
    }

    #[test]
    fn extreme_times_saturate_instead_of_overflowing() {
        let g = gcra(1, 1000, 1);
        let mut s = UNTOUCHED;
        assert!(run(&g, &mut s, u64::MAX - 10, 1).is_allowed());
        assert_eq!(s, u64::MAX, "the TAT saturates at the end of time");
        let d = run(&g, &mut s, u64::MAX - 5, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(5)));

        // A huge burst at T = 1ns after 146 years of uptime stays exact.
        let q = Quota::per_second(1_000_000_000)
            .unwrap()
            .with_burst(1 << 62)
            .unwrap();
        let g = Gcra::new(q);
        let mut s = UNTOUCHED;
        let now = 1 << 62;
        assert!(run(&g, &mut s, now, 1 << 62).is_allowed());
        let d = run(&g, &mut s, now, 1);
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
        assert_eq!(d.reset_after(), Duration::from_nanos(1 << 62));
        // And the largest burst of all does not panic.
        let g = Gcra::new(q.with_burst(u64::MAX).unwrap());
        let mut s = UNTOUCHED;
        assert!(run(&g, &mut s, u64::MAX, u64::MAX).is_allowed());
        assert!(run(&g, &mut s, u64::MAX, 1).retry_after() != Some(Duration::ZERO));
    }

    /// Two buckets admitted at once decide as each bucket's own evaluation merged by
    /// `tighter_admission`, the general path's merge: the same states, and the same
    /// decision, including the quota it names when both have as many units left (ties
    /// are common: equal intervals, full buckets), over random quotas, states and costs,
    /// with intervals from 1 ns to an hour and bursts up to 2⁴⁰.
    #[test]
    fn both_buckets_at_once_decide_as_each_bucket_alone() {
        fn next(x: &mut u64) -> u64 {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            *x
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let intervals = [
            1,
            2,
            3,
            7,
            10,
            1_000,
            999_999,
            1_000_000_000,
            3_600_000_000_000,
        ];
        let (mut admitted, mut ties, mut second, mut looser) = (0, 0, 0, [0, 0]);
        for _ in 0..200_000 {
            let bucket = |x: &mut u64| {
                let t = intervals[(next(x) % intervals.len() as u64) as usize];
                let burst = match next(x) % 3 {
                    0 => 1 + next(x) % 4,
                    1 => 1 + next(x) % 1_000,
                    _ => 1 + next(x) % (1 << 40),
                };
                let quota = Quota::new(1, Duration::from_nanos(t)).unwrap();
                Gcra::new(quota.with_burst(burst.min(u64::MAX / t)).unwrap())
            };
            let (a, b) = (bucket(&mut x), bucket(&mut x));
            let now = 1_000_000_000_000 + next(&mut x) % 1_000_000;
            // States from untouched to a full bucket's span ahead, and some equal.
            let state = |g: &Gcra, x: &mut u64| match next(x) % 4 {
                0 => UNTOUCHED,
                1 => now,
                _ => now.saturating_sub(g.t) + next(x) % (g.tau + g.t + 1),
            };
            let tats = [state(&a, &mut x), state(&b, &mut x)];
            let cost = 1 + next(&mut x) % a.burst.min(b.burst).min(3);
            let looser_below = Gcra::looser_bounds([&a, &b]);
            let both = Gcra::admit_both([&a, &b], looser_below, tats, now, cost);
            let each = match (
                a.evaluate(tats[0], now, cost),
                b.evaluate(tats[1], now, cost),
            ) {
                (
                    Outcome::Allow {
                        decision: d0,
                        state: s0,
                    },
                    Outcome::Allow {
                        decision: d1,
                        state: s1,
                    },
                ) => {
                    if d0.remaining() == d1.remaining() {
                        ties += 1;
                    }
                    let d = d0.for_policy(0).tighter_admission(d1.for_policy(1));
                    Some((d, [s0, s1]))
                }
                _ => None,
            };
            assert_eq!(both, each, "{a:?} {b:?} {tats:?} now {now} cost {cost}");
            if let Some((d, [next_a, next_b])) = both {
                admitted += 1;
                second += usize::from(d != d.for_policy(0));
                if next_b - now < looser_below[1] {
                    looser[1] += 1;
                } else if next_a - now < looser_below[0] {
                    looser[0] += 1;
                }
            }
        }
        assert!(
            admitted > 50_000 && ties > 5_000 && second > 5_000,
            "{admitted} {ties} {second}"
        );
        // Every way through: one bucket's units skipped (either one), or both divided.
        let divided = admitted - looser[0] - looser[1];
        assert!(
            looser[0] > 5_000 && looser[1] > 5_000 && divided > 5_000,
            "{looser:?} {divided}"
        );
    }
}
