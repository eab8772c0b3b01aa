//! Costs settled after the fact: `charge` (into debt) and `refund` (up to full), against
//! independent models over generated timelines, at the quota edges, under two threads, and
//! their typed errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::{Clock, ManualClock};
use tollgate::{Algorithm, Decision, Quota, RateLimiter, SettleError, WhenFull};

use super::properties::{limiter, quota};

/// One step of a timeline on one key.
#[derive(Clone, Copy, Debug)]
enum Step {
    Check(u64),
    Charge(u64),
    Refund(u64),
}

/// Steps at non-decreasing instants: bursts, short and long gaps; charges that often
/// exceed the burst.
fn timeline(period_ns: u64) -> impl Strategy<Value = Vec<(u64, Step)>> {
    prop::collection::vec(
        (
            prop_oneof![
                3 => Just(0u64),
                3 => 0..period_ns / 8 + 1,
                2 => 0..period_ns + 1,
                1 => 0..3 * period_ns,
            ],
            prop_oneof![
                5 => (1u64..4).prop_map(Step::Check),
                2 => (0u64..80).prop_map(Step::Charge),
                2 => (0u64..30).prop_map(Step::Refund),
            ],
        ),
        1..120,
    )
    .prop_map(|steps| {
        let mut at = 1_000_000_000;
        steps
            .into_iter()
            .map(|(gap, step)| {
                at += gap;
                (at, step)
            })
            .collect()
    })
}

/// The token bucket with debts, written from its definition in u128 arithmetic: the
/// bucket's state is the instant `tat` it is full again; a charge moves it `n·T` past
/// `max(tat, now)` however far, a refund `n·T` back but not before `now`.
struct BucketModel {
    t: u128,
    tau: u128,
    burst: u64,
    tat: u128,
}

/// What the model says of one step: admitted, remaining, retry-after (ns, 0 if admitted).
type Said = (bool, u64, u64);

impl BucketModel {
    fn new(q: Quota) -> Self {
        let t = q.period().as_nanos() / u128::from(q.limit());
        Self {
            t,
            tau: t * u128::from(q.burst() - 1),
            burst: q.burst(),
            tat: 0,
        }
    }

    fn remaining(&self, now: u128) -> u64 {
        let debt = self.tat.saturating_sub(now);
        ((self.tau + self.t).saturating_sub(debt) / self.t) as u64
    }

    /// A request of `n` (consumed if admitted, else nothing changes).
    fn request(&mut self, now: u128, n: u64, consume: bool) -> Said {
        let earliest = (self.tat + u128::from(n - 1) * self.t).saturating_sub(self.tau);
        if now < earliest {
            return (false, self.remaining(now), (earliest - now) as u64);
        }
        if consume {
            self.tat = self.tat.max(now) + u128::from(n) * self.t;
        }
        (true, self.remaining(now), 0)
    }

    fn step(&mut self, now: u128, step: Step) -> Option<Said> {
        match step {
            Step::Check(n) if n > self.burst => None,
            Step::Check(n) => Some(self.request(now, n, true)),
            Step::Charge(n) => {
                self.tat = self.tat.max(now) + u128::from(n) * self.t;
                Some(self.request(now, 1, false))
            }
            Step::Refund(n) => {
                if self.tat > now {
                    self.tat = self.tat.saturating_sub(u128::from(n) * self.t).max(now);
                }
                Some(self.request(now, 1, false))
            }
        }
    }
}

fn said(d: &Decision) -> Said {
    (
        d.is_allowed(),
        d.remaining(),
        d.retry_after().map_or(0, |r| r.as_nanos() as u64),
    )
}

fn apply(limiter: &RateLimiter<u8, ManualClock>, step: Step) -> Option<Decision> {
    match step {
        Step::Check(n) => limiter.check_n(&0, n).ok(),
        Step::Charge(n) => Some(limiter.charge(&0, n).unwrap()),
        Step::Refund(n) => Some(limiter.refund(&0, n).unwrap()),
    }
}

/// The fixed window with refunds, from its definition: a count per aligned window.
struct WindowModel {
    limit: u64,
    period: u64,
    window: u64,
    count: u64,
}

impl WindowModel {
    fn roll(&mut self, now: u64) {
        if now / self.period != self.window {
            self.window = now / self.period;
            self.count = 0;
        }
    }

    fn step(&mut self, now: u64, step: Step) -> Option<(bool, u64)> {
        self.roll(now);
        match step {
            Step::Check(n) if n > self.limit => None,
            Step::Check(n) if self.count + n <= self.limit => {
                self.count += n;
                Some((true, self.limit - self.count))
            }
            Step::Check(_) => Some((false, self.limit - self.count)),
            Step::Refund(n) => {
                self.count -= n.min(self.count);
                Some((self.count < self.limit, self.limit - self.count))
            }
            Step::Charge(_) => unreachable!("the window counters refuse charges"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// The token bucket's every decision, with charges and refunds interleaved, equals the
    /// model's: admitted, remaining and the exact retry-after.
    #[test]
    fn the_token_bucket_settles_as_its_model(q in quota(), steps in timeline(1_000_000_000)) {
        let (limiter, clock) = limiter(Algorithm::TokenBucket, q);
        let mut model = BucketModel::new(q);
        for (i, &(at, step)) in steps.iter().enumerate() {
            clock.set_ns(at);
            let got = apply(&limiter, step).map(|d| said(&d));
            prop_assert_eq!(got, model.step(u128::from(at), step), "step {} {:?} at {}", i, step, at);
        }
    }

    /// The fixed window's decisions with refunds interleaved equal its model's.
    #[test]
    fn the_fixed_window_refunds_as_its_model(q in quota(), steps in timeline(1_000_000_000)) {
        let (limiter, clock) = limiter(Algorithm::FixedWindow, q);
        let mut model = WindowModel { limit: q.limit(), period: q.period().as_nanos() as u64, window: 0, count: 0 };
        for (i, &(at, step)) in steps.iter().enumerate() {
            let step = match step { Step::Charge(n) => Step::Refund(n), s => s };
            clock.set_ns(at);
            let got = apply(&limiter, step).map(|d| (d.is_allowed(), d.remaining()));
            prop_assert_eq!(got, model.step(at, step), "step {} {:?} at {}", i, step, at);
        }
    }

    /// Every algorithm that settles keeps its bound, loosened by exactly what was
    /// refunded: a charge never lets a check through, and a refund lets through at most
    /// what it gave back. The buckets: admitted check units ≤ burst + ⌊t/T⌋ + refunded,
    /// over the whole run; the windows: per aligned window, ≤ limit + refunded in it.
    #[test]
    fn bounds_hold_with_settlements(q in quota(), steps in timeline(1_000_000_000)) {
        for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket, Algorithm::FixedWindow, Algorithm::SlidingWindow] {
            let (limiter, clock) = limiter(algorithm, q);
            let bucket = matches!(algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket);
            let period = q.period().as_nanos() as u64;
            let mut admitted = std::collections::BTreeMap::<u64, (u64, u64)>::new();
            let (mut total, mut refunded) = (0u64, 0u64);
            for &(at, step) in &steps {
                let step = match step { Step::Charge(n) if !bucket => Step::Refund(n), s => s };
                clock.set_ns(at);
                let window = admitted.entry(at / period).or_default();
                match step {
                    Step::Check(n) => if limiter.check_n(&0, n).is_ok_and(|d| d.is_allowed()) {
                        total += n;
                        window.0 += n;
                    },
                    Step::Refund(n) => {
                        limiter.refund(&0, n).unwrap();
                        refunded += n;
                        window.1 += n;
                    }
                    Step::Charge(n) => { limiter.charge(&0, n).unwrap(); }
                }
            }
            let t = steps.last().unwrap().0 - steps[0].0;
            let emission = period / q.limit();
            if bucket {
                prop_assert!(total <= q.burst() + t / emission + refunded, "{algorithm}: {total} admitted");
            } else {
                for (w, (got, back)) in &admitted {
                    prop_assert!(*got <= q.limit() + back, "{algorithm}: window {w}: {got} admitted, {back} refunded");
                }
            }
        }
    }
}

/// A debt is repaid at the quota's rate, exactly, at the smallest and largest quotas:
/// after a charge of `burst + k` on a full bucket, the next unit is due `k` intervals on,
/// denied 1 ns before; a refund of the debt makes it full at once.
#[test]
fn a_debt_is_repaid_at_the_quota_s_rate_at_the_edges() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket] {
        for (quota, t_ns) in [("1/s", 1_000_000_000u64), ("100000/s", 10_000)] {
            let q: Quota = quota.parse().unwrap();
            let burst = q.burst();
            let (limiter, clock) = limiter(algorithm, q);
            clock.set_ns(1_000_000_000_000);
            let after = limiter.charge(&0, burst + 5).unwrap();
            assert!(!after.is_allowed(), "{algorithm} {quota}");
            assert_eq!(after.remaining(), 0);
            // 5 units of debt and the unit itself.
            let due = 6 * t_ns;
            assert_eq!(after.retry_after(), Some(Duration::from_nanos(due)));
            clock.advance(Duration::from_nanos(due - 1));
            assert!(
                !limiter.check(&0).is_allowed(),
                "{algorithm} {quota}: early"
            );
            clock.advance(Duration::from_nanos(1));
            assert!(limiter.check(&0).is_allowed(), "{algorithm} {quota}: due");
            assert!(
                !limiter.check(&0).is_allowed(),
                "{algorithm} {quota}: one only"
            );

            // A refund of everything makes the key full again, never more.
            let full = limiter.refund(&0, u64::MAX).unwrap();
            assert!(full.is_allowed());
            assert_eq!(full.remaining(), burst, "{algorithm} {quota}");
            for _ in 0..burst {
                assert!(limiter.check(&0).is_allowed(), "{algorithm} {quota}");
            }
            assert!(
                !limiter.check(&0).is_allowed(),
                "{algorithm} {quota}: refund overfilled"
            );
        }
    }
}

/// A refund invalidates the per-thread deny cache: the denied key passes at once.
#[test]
fn a_refund_lets_a_cached_deny_through_at_once() {
    let (limiter, _clock) = limiter(Algorithm::TokenBucket, "1/s".parse().unwrap());
    assert!(limiter.check(&7).is_allowed());
    for _ in 0..3 {
        assert!(!limiter.check(&7).is_allowed());
    }
    assert_eq!(limiter.refund(&7, 1).unwrap().remaining(), 1);
    assert!(limiter.check(&7).is_allowed());
    // And a charge moves a cached deny's retry-after later at once (a generated timeline
    // found the cache answering with the retry-after from before the charge).
    assert!(!limiter.check(&7).is_allowed());
    let charged = limiter.charge(&7, 2).unwrap().retry_after().unwrap();
    assert_eq!(charged, Duration::from_secs(3));
    assert_eq!(limiter.check(&7).retry_after(), Some(charged));
}

/// A refund of a key the limiter does not hold stores nothing; a charge stores it.
#[test]
fn a_refund_of_an_absent_key_stores_nothing() {
    let (limiter, _clock) = limiter(Algorithm::TokenBucket, "10/s".parse().unwrap());
    let d = limiter.refund(&1, 5).unwrap();
    assert_eq!((d.is_allowed(), d.remaining()), (true, 10));
    assert_eq!(limiter.len(), 0);
    assert_eq!(limiter.charge(&1, 3).unwrap().remaining(), 7);
    assert_eq!(limiter.len(), 1);
}

/// The algorithms that cannot carry a settlement say so, typed, and change nothing.
#[test]
fn unsupported_settlements_are_typed_errors() {
    for (algorithm, charge, refund) in [
        (Algorithm::FixedWindow, false, true),
        (Algorithm::SlidingWindow, false, true),
        (Algorithm::SlidingLog, false, false),
    ] {
        let (limiter, _clock) = limiter(algorithm, "3/s".parse().unwrap());
        assert!(limiter.check(&0).is_allowed());
        match limiter.charge(&0, 5) {
            Err(e @ SettleError::Unsupported { .. }) => {
                assert!(!charge);
                assert!(e.to_string().contains("token-bucket"), "{e}");
            }
            other => panic!("{algorithm}: charge gave {other:?}"),
        }
        assert_eq!(limiter.refund(&0, 1).is_ok(), refund, "{algorithm}");
        // Nothing consumed by the refused charge.
        let left = if refund { 3 } else { 2 };
        assert_eq!(limiter.peek(&0).remaining(), left, "{algorithm}");
    }
}

/// A charge of a new key on a full store under `DenyNewKeys` is refused, typed, with
/// nothing stored.
#[test]
fn a_charge_that_finds_no_room_is_refused_not_lost() {
    let limiter: RateLimiter<u64, ManualClock> = RateLimiter::builder("1/h".parse().unwrap())
        .clock(ManualClock::new())
        .shards(1)
        .max_keys(2)
        .when_full(WhenFull::DenyNewKeys)
        .build()
        .unwrap();
    assert!(limiter.check(&1).is_allowed());
    assert!(limiter.check(&2).is_allowed());
    match limiter.charge(&3, 1) {
        Err(SettleError::NoRoom { retry_after }) => assert!(retry_after > Duration::ZERO),
        other => panic!("{other:?}"),
    }
    assert_eq!(limiter.len(), 2);
    // Keys it holds are still charged.
    assert!(limiter.charge(&1, 1).is_ok());
}

/// Under two threads checking, charging and refunding one key while the clock moves,
/// the admitted units never exceed burst + ⌊t/T⌋ + what was refunded.
#[test]
fn two_threads_never_exceed_the_bound_plus_refunds() {
    for quota in ["1/s", "100000/s burst 50"] {
        let q: Quota = quota.parse().unwrap();
        let emission = q.period().as_nanos() as u64 / q.limit();
        let (limiter, clock) = limiter(Algorithm::TokenBucket, q);
        let start = 1_000_000_000;
        clock.set_ns(start);
        let admitted = AtomicU64::new(0);
        let refunded = AtomicU64::new(0);
        std::thread::scope(|s| {
            for thread in 0..2u64 {
                let (limiter, clock, admitted, refunded) = (&limiter, &clock, &admitted, &refunded);
                s.spawn(move || {
                    for i in 0..20_000u64 {
                        if thread == 0 && i % 50 == 0 {
                            clock.advance(Duration::from_nanos(emission));
                        }
                        if limiter.check(&0).is_allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            if (i + thread) % 3 == 0 {
                                limiter.refund(&0, 1).unwrap();
                                refunded.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        if i % 1_000 == 999 {
                            limiter.charge(&0, 2).unwrap();
                        }
                    }
                });
            }
        });
        let t = clock.now_ns() - start;
        let (admitted, refunded) = (admitted.into_inner(), refunded.into_inner());
        assert!(refunded > 0, "{quota}: {admitted} admitted, none refunded");
        assert!(
            admitted <= q.burst() + t / emission + refunded,
            "{quota}: {admitted} admitted, {refunded} refunded over {t} ns"
        );
    }
}
