//! Each algorithm's documented guarantee, checked over arbitrary request timelines on a
//! `ManualClock`, and the promises every `Decision` makes (exact retry-after, remaining,
//! reset-after, peek never consuming).

use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use tollgate::clock::ManualClock;
use tollgate::{Algorithm, Decision, Quota, RateLimiter};

const ALGORITHMS: [Algorithm; 5] = Algorithm::ALL;

/// A request at absolute time `at` (ns) with `cost`.
#[derive(Clone, Copy, Debug)]
struct Request {
    at: u64,
    cost: u64,
}

pub(crate) fn quota() -> impl Strategy<Value = Quota> {
    (1u64..40, 1u64..3_000, 1u64..40).prop_filter_map("representable", |(limit, ms, burst)| {
        Quota::new(limit, Duration::from_millis(ms))
            .and_then(|q| q.with_burst(burst))
            .ok()
    })
}

/// Requests with gaps that are often zero (bursts) and sometimes several periods.
fn requests(period_ns: u64) -> impl Strategy<Value = Vec<Request>> {
    prop::collection::vec(
        (
            prop_oneof![
                3 => Just(0u64),
                3 => 0..period_ns / 8 + 1,
                2 => 0..period_ns + 1,
                1 => 0..3 * period_ns,
            ],
            prop_oneof![5 => Just(1u64), 1 => 1u64..6],
        ),
        1..150,
    )
    .prop_map(|steps| {
        let mut at = 0;
        steps
            .into_iter()
            .map(|(gap, cost)| {
                at += gap;
                Request { at, cost }
            })
            .collect()
    })
}

pub(crate) fn limiter(
    algorithm: Algorithm,
    quota: Quota,
) -> (RateLimiter<u8, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let limiter = RateLimiter::builder(quota)
        .algorithm(algorithm)
        .clock(clock.clone())
        .build()
        .unwrap();
    (limiter, clock)
}

/// Runs the requests on one key, returning each decision (`None` for a cost the quota can
/// never admit).
fn run(algorithm: Algorithm, quota: Quota, requests: &[Request]) -> Vec<Option<Decision>> {
    let (limiter, clock) = limiter(algorithm, quota);
    requests
        .iter()
        .map(|r| {
            clock.set_ns(r.at);
            limiter.check_n(&0, r.cost).ok()
        })
        .collect()
}

/// A fresh limiter that has admitted exactly the `admitted` requests, with its clock at
/// `now`. Denied requests change no state, so this reproduces the original state.
fn replay(
    algorithm: Algorithm,
    quota: Quota,
    admitted: &[Request],
    now: u64,
) -> (RateLimiter<u8, ManualClock>, ManualClock) {
    let (limiter, clock) = limiter(algorithm, quota);
    for r in admitted {
        clock.set_ns(r.at);
        assert!(
            limiter.check_n(&0, r.cost).unwrap().is_allowed(),
            "replay diverged"
        );
    }
    clock.set_ns(now);
    (limiter, clock)
}

fn admitted(requests: &[Request], decisions: &[Option<Decision>]) -> Vec<Request> {
    requests
        .iter()
        .zip(decisions)
        .filter(|(_, d)| d.is_some_and(|d| d.is_allowed()))
        .map(|(r, _)| *r)
        .collect()
}

/// The largest total cost admitted in any closed interval `[a.at, a.at + len]` (or
/// half-open `[a.at, a.at + len)` when `half_open`).
fn densest(admitted: &[Request], len: u64, half_open: bool) -> u64 {
    admitted
        .iter()
        .map(|start| {
            admitted
                .iter()
                .filter(|r| r.at >= start.at)
                .filter(|r| {
                    if half_open {
                        r.at - start.at < len
                    } else {
                        r.at - start.at <= len
                    }
                })
                .map(|r| r.cost)
                .sum()
        })
        .max()
        .unwrap_or(0)
}

/// Total admitted cost per aligned window.
fn per_window(admitted: &[Request], q: Quota) -> std::collections::BTreeMap<u64, u64> {
    let p = q.period().as_nanos() as u64;
    let mut totals = std::collections::BTreeMap::new();
    for r in admitted {
        *totals.entry(r.at / p).or_insert(0) += r.cost;
    }
    totals
}

/// The worst (observed / bound) seen by each algorithm's bound test, as parts per
/// million, printed by `worst_observed_bursts` (run with `--nocapture`).
static WORST_PPM: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

fn record(algorithm: Algorithm, observed: u64, bound: u64) {
    let index = ALGORITHMS.iter().position(|a| *a == algorithm).unwrap();
    WORST_PPM[index].fetch_max(observed * 1_000_000 / bound.max(1), Ordering::Relaxed);
}

/// Token and leaky bucket: at most `burst + ⌊t / T⌋` in any interval of length `t`.
/// The leaky bucket's slots never overlap: each starts after the previous one ends.
fn bucket_bounds(q: Quota, reqs: Vec<Request>) -> Result<(), TestCaseError> {
    let t = q.emission_interval().as_nanos() as u64;
    for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket] {
        let decisions = run(algorithm, q, &reqs);
        let ok = admitted(&reqs, &decisions);
        for start in &ok {
            for end in ok.iter().filter(|r| r.at >= start.at) {
                let len = end.at - start.at;
                let total: u64 = ok
                    .iter()
                    .filter(|r| r.at >= start.at && r.at <= end.at)
                    .map(|r| r.cost)
                    .sum();
                let bound = q.burst() + len / t;
                prop_assert!(
                    total <= bound,
                    "{algorithm:?}: {total} admitted in {len}ns, bound {bound}"
                );
                record(algorithm, total, bound);
            }
        }
        let mut free_at = 0;
        for (r, d) in reqs.iter().zip(&decisions) {
            let Some(d) = d.filter(|d| d.is_allowed()) else {
                continue;
            };
            let slot = r.at + d.delay().as_nanos() as u64;
            if algorithm == Algorithm::LeakyBucket {
                prop_assert!(
                    slot >= free_at,
                    "slot {slot} overlaps the previous one ending {free_at}"
                );
                free_at = slot + r.cost * t;
            } else {
                prop_assert_eq!(d.delay(), Duration::ZERO);
            }
        }
    }
    Ok(())
}

/// Fixed window: at most `limit` per aligned window.
fn fixed_window_bound(q: Quota, reqs: Vec<Request>) -> Result<(), TestCaseError> {
    let decisions = run(Algorithm::FixedWindow, q, &reqs);
    let ok = admitted(&reqs, &decisions);
    for (w, total) in per_window(&ok, q) {
        prop_assert!(total <= q.limit(), "window {w}: {total} > {}", q.limit());
        record(Algorithm::FixedWindow, total, q.limit());
    }
    Ok(())
}

/// Sliding log: at most `limit` in any interval of length `period`.
fn sliding_log_bound(q: Quota, reqs: Vec<Request>) -> Result<(), TestCaseError> {
    let decisions = run(Algorithm::SlidingLog, q, &reqs);
    let ok = admitted(&reqs, &decisions);
    let worst = densest(&ok, q.period().as_nanos() as u64, true);
    prop_assert!(
        worst <= q.limit(),
        "{worst} in one period, limit {}",
        q.limit()
    );
    record(Algorithm::SlidingLog, worst, q.limit());
    Ok(())
}

/// Sliding window: at most `limit` per aligned window, and fewer than `2·limit` in any
/// interval of length `period`.
fn sliding_window_bounds(q: Quota, reqs: Vec<Request>) -> Result<(), TestCaseError> {
    let decisions = run(Algorithm::SlidingWindow, q, &reqs);
    let ok = admitted(&reqs, &decisions);
    for (w, total) in per_window(&ok, q) {
        prop_assert!(total <= q.limit(), "window {w}: {total} > {}", q.limit());
    }
    let worst = densest(&ok, q.period().as_nanos() as u64, true);
    prop_assert!(
        worst < 2 * q.limit(),
        "{worst} in one period, limit {}",
        q.limit()
    );
    record(Algorithm::SlidingWindow, worst, 2 * q.limit());
    Ok(())
}

/// Runs each algorithm's bound property over random timelines, then prints the worst
/// observed fraction of each bound (the README's algorithm table quotes it).
#[test]
fn every_algorithm_keeps_its_bound() {
    type Property = fn(Quota, Vec<Request>) -> Result<(), TestCaseError>;
    let properties: [(&str, Property); 4] = [
        ("token and leaky bucket", bucket_bounds),
        ("fixed window", fixed_window_bound),
        ("sliding window", sliding_window_bounds),
        ("sliding log", sliding_log_bound),
    ];
    for (name, property) in properties {
        let config = ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::with_cases(200)
        };
        let mut runner = proptest::test_runner::TestRunner::new(config);
        let strategy = quota().prop_flat_map(|q| (Just(q), requests(1_000_000_000)));
        if let Err(e) = runner.run(&strategy, |(q, reqs)| property(q, reqs)) {
            panic!("{name}: {e}");
        }
    }
    for (algorithm, worst) in ALGORITHMS.iter().zip(&WORST_PPM) {
        let worst = worst.load(Ordering::Relaxed);
        assert!(worst <= 1_000_000, "{algorithm:?} exceeded its bound");
        println!(
            "worst observed / bound, {algorithm:?}: {:.3}",
            worst as f64 / 1e6
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every deny's retry-after is exact: one nanosecond earlier the same request is still
    /// denied, at retry-after it passes (if nothing else consumes).
    #[test]
    fn retry_after_is_exact(q in quota(), reqs in requests(1_000_000_000)) {
        for algorithm in ALGORITHMS {
            let decisions = run(algorithm, q, &reqs);
            for (i, (r, d)) in reqs.iter().zip(&decisions).enumerate() {
                let Some(d) = d else { continue };
                if d.is_allowed() {
                    prop_assert_eq!(d.retry_after(), None);
                    continue;
                }
                let wait = d.retry_after().unwrap().as_nanos() as u64;
                prop_assert!(wait > 0);
                let history = admitted(&reqs[..i], &decisions[..i]);
                let (early, _) = replay(algorithm, q, &history, r.at + wait - 1);
                prop_assert!(!early.check_n(&0, r.cost).unwrap().is_allowed(),
                    "{algorithm:?}: allowed 1ns before retry_after {wait}");
                let (on_time, _) = replay(algorithm, q, &history, r.at + wait);
                prop_assert!(on_time.check_n(&0, r.cost).unwrap().is_allowed(),
                    "{algorithm:?}: still denied at retry_after {wait}");
            }
        }
    }

    /// `remaining` unit requests pass at the same instant, and the next one does not;
    /// `reset_after` is when the key is full again; `peek` consumes nothing.
    #[test]
    fn remaining_reset_and_peek_are_exact(q in quota(), reqs in requests(1_000_000_000)) {
        for algorithm in ALGORITHMS {
            let decisions = run(algorithm, q, &reqs);
            let full = decisions.iter().flatten().next().map_or(0, |d| d.limit());
            for (i, (r, d)) in reqs.iter().zip(&decisions).enumerate().step_by(7) {
                let Some(d) = d else { continue };
                let history = admitted(&reqs[..=i], &decisions[..=i]);
                let (l, _) = replay(algorithm, q, &history, r.at);
                let peeked = l.peek(&0);
                prop_assert_eq!(l.peek(&0), peeked, "peek consumed");
                prop_assert_eq!(peeked.remaining(), d.remaining());
                for k in 0..d.remaining() {
                    prop_assert!(l.check(&0).is_allowed(), "{algorithm:?}: unit {k} of {} denied", d.remaining());
                }
                prop_assert!(!l.check(&0).is_allowed(), "{algorithm:?}: more than remaining passed");

                let reset = d.reset_after().as_nanos() as u64;
                let (l, clock) = replay(algorithm, q, &history, r.at);
                if reset > 0 {
                    clock.set_ns(r.at + reset - 1);
                    prop_assert!(l.peek(&0).remaining() < full, "{algorithm:?}: full before reset_after");
                }
                clock.set_ns(r.at + reset);
                prop_assert_eq!(l.peek(&0).remaining(), full, "{:?}: not full at reset_after", algorithm);
            }
        }
    }
}

/// The sliding window's worst case over an arbitrary period is real: a full window at the
/// end of one window, then steady traffic through the next, nearly doubles the limit.
#[test]
fn sliding_window_worst_case_approaches_twice_the_limit() {
    let q = Quota::per_second(100).unwrap();
    let (l, clock) = limiter(Algorithm::SlidingWindow, q);
    let sec = 1_000_000_000u64;
    clock.set_ns(sec - 1);
    let mut admitted = Vec::new();
    for _ in 0..100 {
        assert!(l.check(&0).is_allowed());
        admitted.push(sec - 1);
    }
    // Then one request every millisecond through the next window.
    for ms in 0..1000 {
        let at = sec + ms * 1_000_000;
        clock.set_ns(at);
        if l.check(&0).is_allowed() {
            admitted.push(at);
        }
    }
    let in_period = admitted.iter().filter(|&&t| t < 2 * sec - 1).count();
    assert!(in_period >= 195, "{in_period} in one period");
    assert!(in_period < 200);
}

/// The fixed-window boundary burst does not happen: `limit` at the end of a window leaves
/// almost nothing for the start of the next one.
#[test]
fn sliding_window_smooths_the_boundary() {
    let q = Quota::per_second(10).unwrap();
    let (l, clock) = limiter(Algorithm::SlidingWindow, q);
    clock.set_ns(999_000_000);
    assert_eq!((0..10).filter(|_| l.check(&0).is_allowed()).count(), 10);
    clock.set_ns(1_001_000_000);
    assert_eq!((0..10).filter(|_| l.check(&0).is_allowed()).count(), 0);
    clock.set_ns(1_500_000_000);
    assert_eq!((0..10).filter(|_| l.check(&0).is_allowed()).count(), 5);
}

/// The fixed window's documented boundary burst: `limit` at the end of one window and
/// `limit` at the start of the next all pass, 2·limit within 2ms.
#[test]
fn fixed_window_boundary_burst_is_real() {
    let (l, clock) = limiter(Algorithm::FixedWindow, Quota::per_second(10).unwrap());
    clock.set_ns(999_000_000);
    assert_eq!((0..10).filter(|_| l.check(&0).is_allowed()).count(), 10);
    assert!(!l.check(&0).is_allowed());
    clock.set_ns(1_001_000_000);
    assert_eq!((0..11).filter(|_| l.check(&0).is_allowed()).count(), 10);
}
