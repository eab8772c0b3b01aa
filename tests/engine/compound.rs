//! Several quotas per key (`Builder::also`), all or nothing: against a model made of
//! one single-quota limiter per quota over generated timelines, at the quota edges, and
//! under two threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::{Clock, ManualClock};
use tollgate::{Algorithm, ConfigError, Decision, Quota, RateLimiter};

const WORD_ALGORITHMS: [Algorithm; 4] = [
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
];

fn quota() -> impl Strategy<Value = Quota> {
    (1u64..30, 1u64..4_000, 1u64..30).prop_filter_map("representable", |(limit, ms, burst)| {
        Quota::new(limit, Duration::from_millis(ms))
            .and_then(|q| q.with_burst(burst))
            .ok()
    })
}

/// Requests `(at, cost)` at non-decreasing instants, bursts and gaps of up to a few
/// seconds.
fn timeline() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec(
        (
            prop_oneof![
                3 => Just(0u64),
                3 => 0u64..100_000_000,
                2 => 0u64..1_000_000_000,
                1 => 0u64..5_000_000_000,
            ],
            prop_oneof![5 => Just(1u64), 1 => 0u64..6],
        ),
        1..150,
    )
    .prop_map(|steps| {
        let mut at = 1_000_000_000;
        steps
            .into_iter()
            .map(|(gap, cost)| {
                at += gap;
                (at, cost)
            })
            .collect()
    })
}

fn built(
    algorithm: Algorithm,
    quotas: &[Quota],
    clock: &ManualClock,
) -> Result<RateLimiter<u8, ManualClock>, ConfigError> {
    let mut builder = RateLimiter::builder(quotas[0])
        .algorithm(algorithm)
        .clock(clock.clone());
    for &q in &quotas[1..] {
        builder = builder.also(q);
    }
    builder.build()
}

/// Of two decisions, the one the compound limiter reports (its documented rule).
fn tighter(a: (usize, Decision), b: (usize, Decision)) -> (usize, Decision) {
    let (da, db) = (a.1, b.1);
    match (da.is_allowed(), db.is_allowed()) {
        (true, false) => b,
        (false, true) => a,
        (false, false) => {
            if db.retry_after() > da.retry_after() {
                b
            } else {
                a
            }
        }
        (true, true) => {
            let key = |d: &Decision| (d.remaining(), std::cmp::Reverse(d.reset_after()));
            if key(&db) < key(&da) { b } else { a }
        }
    }
}

/// What the model says of one request: an error for a cost beyond a quota's capacity,
/// else (admitted, policy, remaining, retry-after, reset-after, delay).
type Said = Result<(bool, usize, u64, Option<Duration>, Duration, Duration), ()>;

fn said(d: &Decision) -> Said {
    Ok((
        d.is_allowed(),
        d.policy(),
        d.remaining(),
        d.retry_after(),
        d.reset_after(),
        d.delay(),
    ))
}

/// The model: one limiter per quota. A request is admitted iff every one would admit it
/// (asked with `peek_n`), and then consumed from every one; nothing otherwise.
fn model(singles: &[RateLimiter<u8, ManualClock>], cost: u64) -> Said {
    let mut peeks = Vec::new();
    for single in singles {
        match single.peek_n(&0, cost) {
            Ok(d) => peeks.push(d),
            Err(_) => return Err(()),
        }
    }
    if peeks.iter().all(Decision::is_allowed) {
        let mut best: Option<(usize, Decision)> = None;
        let mut delay = Duration::ZERO;
        for (i, single) in singles.iter().enumerate() {
            let d = single.check_n(&0, cost).unwrap();
            assert!(d.is_allowed(), "the model's own peek and check disagree");
            delay = delay.max(d.delay());
            best = Some(best.map_or((i, d), |b| tighter(b, (i, d))));
        }
        let (policy, d) = best.unwrap();
        return Ok((true, policy, d.remaining(), None, d.reset_after(), delay));
    }
    let fewest = peeks.iter().map(Decision::remaining).min().unwrap();
    let (policy, d) = peeks
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, d)| !d.is_allowed())
        .reduce(tighter)
        .unwrap();
    Ok((
        false,
        policy,
        fewest.min(d.remaining()),
        d.retry_after(),
        d.reset_after(),
        Duration::ZERO,
    ))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    /// Every decision of a limiter with 2 or 3 quotas equals the model's, for every word
    /// algorithm: admitted or not, which quota it reports, remaining, retry-after,
    /// reset-after and the leaky bucket's delay. Equal `remaining` after every request
    /// also shows no quota was ever consumed alone.
    #[test]
    fn decisions_equal_the_model(
        quotas in prop::collection::vec(quota(), 2..=3),
        requests in timeline(),
    ) {
        for algorithm in WORD_ALGORITHMS {
            let clock = ManualClock::new();
            let Ok(compound) = built(algorithm, &quotas, &clock) else {
                continue; // a limit beyond what the window counters hold
            };
            let singles: Vec<_> = quotas
                .iter()
                .map(|q| built(algorithm, &[*q], &clock).unwrap())
                .collect();
            for (i, &(at, cost)) in requests.iter().enumerate() {
                clock.set_ns(at);
                let got = compound.check_n(&0, cost).map_err(|_| ()).and_then(|d| said(&d));
                let want = model(&singles, cost);
                prop_assert_eq!(got, want, "{} request {} (cost {}) at {}", algorithm, i, cost, at);
                // And a peek agrees with the singles' state after it.
                let peeked = compound.peek(&0);
                let fewest = singles.iter().map(|s| s.peek(&0).remaining()).min().unwrap();
                prop_assert_eq!(peeked.remaining(), fewest, "{} after request {}", algorithm, i);
            }
        }
    }
}

/// A request a later quota denies consumes nothing from the earlier ones, at the
/// smallest and largest quotas: the first quota is slow to refill, so units it lost to
/// denied requests would still be missing when the second quota lets requests through
/// again.
#[test]
fn a_deny_consumes_from_no_quota_at_the_edges() {
    for (first, second) in [("3/h", "1/s"), ("1000/h", "100000/s burst 50")] {
        let (q1, q2): (Quota, Quota) = (first.parse().unwrap(), second.parse().unwrap());
        for algorithm in [Algorithm::TokenBucket, Algorithm::LeakyBucket] {
            let clock = ManualClock::new();
            clock.set_ns(1_000_000_000_000);
            let limiter = built(algorithm, &[q1, q2], &clock).unwrap();
            for _ in 0..q2.burst() {
                assert!(
                    limiter.check(&0).is_allowed(),
                    "{algorithm} {first}+{second}"
                );
            }
            let denied = limiter.check(&0);
            assert!(!denied.is_allowed());
            assert_eq!(
                denied.policy(),
                1,
                "{algorithm} {first}+{second}: {denied:?}"
            );
            // More denies than the first quota has units left.
            for _ in 0..q1.burst() {
                assert!(!limiter.check(&0).is_allowed());
            }
            clock.advance(denied.retry_after().unwrap());
            // Admitted only if the first quota lost nothing to the denies (its own
            // refill is minutes away).
            let again = limiter.check(&0);
            assert!(
                again.is_allowed(),
                "{algorithm} {first}+{second}: {again:?}"
            );
        }
    }
}

/// A million keys on two quotas (3 an hour, and 1 a second), both tables growing from
/// empty on two threads: every key is held to both, and the second quota's denies take
/// nothing from the first, whichever table had just resized. The first quota's 3 go to
/// three admissions a second apart, and only then does it deny.
#[test]
fn a_million_keys_are_each_held_to_both_quotas() {
    const KEYS: u64 = 1_000_000;
    let clock = ManualClock::new();
    clock.set_ns(1_000_000_000);
    let limiter: RateLimiter<u64, ManualClock> = RateLimiter::builder("3/h".parse().unwrap())
        .also("1/s".parse().unwrap())
        .clock(clock.clone())
        .build()
        .unwrap();
    let limiter = &limiter;
    // Each thread's half of the keys, interleaved so that both insert into every shard.
    let each = |f: &(dyn Fn(u64) -> Result<(), String> + Sync)| {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2u64)
                .map(|thread| {
                    s.spawn(move || (0..KEYS / 2).map(|i| 2 * i + thread).try_for_each(f))
                })
                .collect();
            for handle in handles {
                handle.join().unwrap().unwrap();
            }
        });
    };
    let admitted = |left: u64| {
        move |key: u64| match limiter.check(&key) {
            d if d.is_allowed() && d.remaining() == left => Ok(()),
            d => Err(format!("key {key}: {d:?}, not admitted with {left} left")),
        }
    };
    let denied_by = |policy: usize| {
        move |key: u64| match limiter.check(&key) {
            d if !d.is_allowed() && d.policy() == policy => Ok(()),
            d => Err(format!("key {key}: {d:?}, not denied by quota {policy}")),
        }
    };
    for second in 0..3 {
        // The 1/s quota has none left after it, whatever the 3/h one has.
        each(&admitted(0));
        assert_eq!(limiter.len(), KEYS as usize);
        // After the third, both deny, and the 3/h quota's wait is the longer.
        let denier = if second < 2 { 1 } else { 0 };
        each(&denied_by(denier));
        each(&denied_by(denier));
        clock.advance(Duration::from_secs(1));
    }
    // The 1/s quota would admit again, but the 3/h one is spent (its refill is 20
    // minutes away).
    each(&denied_by(0));
    let stats = limiter.stats();
    assert_eq!(stats.keys, KEYS as usize, "{stats:?}");
    assert_eq!(
        stats.evicted_untouched + stats.evicted_active,
        0,
        "{stats:?}"
    );
}

/// Under two threads checking one key while the clock moves, the admitted total never
/// exceeds any single quota's bound (burst + ⌊t/T⌋), with each quota constraining in
/// turn.
#[test]
fn two_threads_never_exceed_any_quota() {
    for (first, second) in [
        ("1/s burst 5", "20/min"),
        ("100000/s burst 50", "3000000/min burst 400"),
    ] {
        let quotas: [Quota; 2] = [first.parse().unwrap(), second.parse().unwrap()];
        let clock = ManualClock::new();
        let start = 1_000_000_000;
        clock.set_ns(start);
        let limiter = built(Algorithm::TokenBucket, &quotas, &clock).unwrap();
        let step = quotas[0].period().as_nanos() as u64 / quotas[0].limit() / 4;
        let admitted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for thread in 0..2 {
                let (limiter, clock, admitted) = (&limiter, &clock, &admitted);
                s.spawn(move || {
                    for i in 0..50_000u64 {
                        if thread == 0 && i % 10 == 0 {
                            clock.advance(Duration::from_nanos(step));
                        }
                        if limiter.check(&0).is_allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let t = clock.now_ns() - start;
        let admitted = admitted.into_inner();
        for q in quotas {
            let emission = q.period().as_nanos() as u64 / q.limit();
            let bound = q.burst() + t / emission;
            assert!(
                admitted <= bound,
                "{first} + {second}: {admitted} admitted, {q} allows {bound}"
            );
        }
        assert!(admitted > 0);
    }
}

#[test]
fn the_sliding_log_refuses_several_quotas_and_settlements_reach_every_quota() {
    let clock = ManualClock::new();
    let q: Quota = "5/s".parse().unwrap();
    assert!(matches!(
        built(Algorithm::SlidingLog, &[q, q], &clock),
        Err(ConfigError::Unsupported(_))
    ));
    // A charge goes to every quota: the one it exhausts reports it.
    let limiter = built(
        Algorithm::TokenBucket,
        &[q.with_burst(10).unwrap(), "8/min".parse().unwrap()],
        &clock,
    )
    .unwrap();
    let after = limiter.charge(&0, 8).unwrap();
    assert!(!after.is_allowed());
    assert_eq!(after.policy(), 1);
    let back = limiter.refund(&0, 8).unwrap();
    assert!(back.is_allowed());
    assert_eq!(back.remaining(), 8, "the tighter quota is full again");
    assert_eq!(limiter.quotas().len(), 2);
    assert_eq!(limiter.capacity(), 8);
}
