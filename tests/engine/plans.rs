//! Plans per key: named sets of quotas, each key's plan from an assignment, a resolver
//! (called once per key, its answer kept) or the default; changed live.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::plans::{MAX_PLANS, Plans};
use tollgate::{Algorithm, ConfigError, Quota, RateLimiter};

fn q(text: &str) -> Quota {
    text.parse().unwrap()
}

/// free: 3/min and 5/h; pro: 10/min; the resolver puts `pro_*` keys on pro and
/// counts its calls.
fn free_and_pro(algorithm: Algorithm) -> (Plans<String, ManualClock>, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let plans = Plans::builder("free")
        .plan("free", [q("3/min"), q("5/h")])
        .plan("pro", [q("10/min")])
        .algorithm(algorithm)
        .clock(ManualClock::new())
        .resolver(move |key: &String| {
            counted.fetch_add(1, Ordering::Relaxed);
            key.starts_with("pro_").then_some("pro")
        })
        .build()
        .unwrap();
    (plans, calls)
}

/// Admissions of `key` in a row, from now, until the first deny.
fn admitted(plans: &Plans<String, ManualClock>, key: &str) -> u64 {
    (0..1_000)
        .take_while(|_| plans.check(key).is_allowed())
        .count() as u64
}

/// Every window and bucket algorithm: each plan's quotas hold (both of free's), the
/// decision's limit is the plan's, and the resolver runs once per key however many
/// checks follow.
#[test]
fn each_key_is_held_to_its_plan_and_the_resolver_runs_once() {
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ] {
        let (plans, calls) = free_and_pro(algorithm);
        assert_eq!(admitted(&plans, "pro_a"), 10, "{algorithm:?}");
        assert_eq!(plans.check("pro_a").limit(), 10);
        assert_eq!(admitted(&plans, "anon"), 3, "{algorithm:?}");
        let denied = plans.check("anon");
        assert_eq!((denied.limit(), denied.policy()), (3, 0));
        // The hourly quota of free: 5 in the hour, whatever the minutes allow.
        for _ in 0..3 {
            plans.clock().advance(Duration::from_secs(60));
            plans.check("anon");
        }
        let hourly = plans.check("anon");
        assert!(!hourly.is_allowed(), "{algorithm:?}");
        assert_eq!(hourly.policy(), 1, "{algorithm:?}: the hourly quota denies");
        assert_eq!(
            calls.load(Ordering::Relaxed),
            2,
            "{algorithm:?}: one call per key"
        );
        assert_eq!(plans.stats().resolver_calls, 2);
        assert_eq!(plans.stats().answers, 2);
        let (decision, plan) = plans.check_planned("pro_a");
        assert_eq!((decision.limit(), plan.as_ref()), (10, "pro"));
    }
}

/// A kept answer is asked again once older than `keep_answers_for`, or at once after
/// `forget_answer`; an answer naming no plan decides by the default plan, counted.
#[test]
fn answers_expire_are_forgotten_and_unknown_ones_fall_back() {
    let plan_of_b = Arc::new(std::sync::Mutex::new("pro"));
    let answer = Arc::clone(&plan_of_b);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let plans: Plans<String, ManualClock> = Plans::builder("free")
        .plan("free", [q("1/s")])
        .plan("pro", [q("100000/s")])
        .clock(ManualClock::new())
        .keep_answers_for(Duration::from_secs(30))
        .resolver(move |_: &String| {
            counted.fetch_add(1, Ordering::Relaxed);
            Some(*answer.lock().unwrap())
        })
        .build()
        .unwrap();
    assert_eq!(plans.plan_of("b").as_ref(), "pro");
    *plan_of_b.lock().unwrap() = "free";
    plans.clock().advance(Duration::from_secs(29));
    assert_eq!(plans.plan_of("b").as_ref(), "pro", "kept for 30 s");
    plans.clock().advance(Duration::from_secs(1));
    assert_eq!(
        plans.plan_of("b").as_ref(),
        "free",
        "asked again after 30 s"
    );
    *plan_of_b.lock().unwrap() = "pro";
    plans.forget_answer("b");
    assert_eq!(plans.plan_of("b").as_ref(), "pro");
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    *plan_of_b.lock().unwrap() = "gold";
    plans.forget_answers();
    assert_eq!(
        plans.check("b").limit(),
        1,
        "an unknown plan: the default decides"
    );
    assert_eq!(plans.stats().unknown_plans, 1);
}

/// An assignment wins over the resolver and moves the key live; each plan keeps the
/// key's state, so moving back finds the old counts; unassigning returns the key to
/// the resolver's plan.
#[test]
fn assignments_move_keys_live_and_each_plan_keeps_its_state() {
    let (plans, calls) = free_and_pro(Algorithm::FixedWindow);
    assert_eq!(admitted(&plans, "anon"), 3);
    plans.assign("anon", "pro").unwrap();
    assert_eq!(plans.plan_of("anon").as_ref(), "pro");
    assert_eq!(admitted(&plans, "anon"), 10, "pro starts the key afresh");
    assert_eq!(plans.assigned_to("pro").unwrap(), 1);
    assert_eq!(plans.unassign("anon").as_deref(), Some("pro"));
    assert_eq!(plans.plan_of("anon").as_ref(), "free");
    assert!(!plans.check("anon").is_allowed(), "free kept its count");
    // An assignment is never asked of the resolver, and outlives forget_answers.
    let before = calls.load(Ordering::Relaxed);
    plans.assign("pro_z", "free").unwrap();
    plans.forget_answers();
    assert_eq!(plans.plan_of("pro_z").as_ref(), "free");
    assert_eq!(calls.load(Ordering::Relaxed), before);
    assert!(matches!(
        plans.assign("anon", "gold"),
        Err(ConfigError::UnknownPlan(p)) if p == "gold"
    ));
    assert_eq!(plans.stats().assigned, 1);
}

/// A plan's quotas change live, each quota's used units carried over; a new plan is
/// added live and keys can be assigned to it at once; the number of a plan's quotas
/// cannot change.
#[test]
fn plans_change_and_grow_live() {
    let (plans, _) = free_and_pro(Algorithm::SlidingWindow);
    assert_eq!(admitted(&plans, "anon"), 3);
    plans.set_plan("free", [q("4/min"), q("5/h")]).unwrap();
    assert_eq!(plans.quotas_of("free").unwrap(), [q("4/min"), q("5/h")]);
    assert_eq!(admitted(&plans, "anon"), 1, "3 used of 4 carried over");
    assert!(matches!(
        plans.set_plan("free", [q("4/min")]),
        Err(ConfigError::QuotaCount { held: 2, given: 1 })
    ));
    plans
        .set_plan("gold", [q("1000/min"), q("100000/day")])
        .unwrap();
    plans.assign("anon", "gold").unwrap();
    let gold = plans.check("anon");
    assert!(gold.is_allowed());
    assert_eq!(gold.limit(), 1000);
    assert_eq!(plans.plan_names().len(), 3);
    assert_eq!(plans.limiter("gold").unwrap().name(), "default/gold");
}

/// Invalid plan sets are typed errors naming the plan.
#[test]
fn bad_plans_are_typed_errors() {
    let base = || Plans::<u64>::builder("free").plan("free", [q("1/s")]);
    assert!(matches!(
        base().plan("free", [q("2/s")]).build(),
        Err(ConfigError::InvalidPlan { plan, .. }) if plan == "free"
    ));
    assert!(matches!(
        base().plan("empty", []).build(),
        Err(ConfigError::InvalidPlan { plan, why }) if plan == "empty" && why.contains("at least one")
    ));
    assert!(matches!(
        Plans::<u64>::builder("missing").plan("free", [q("1/s")]).build(),
        Err(ConfigError::UnknownPlan(p)) if p == "missing"
    ));
    // Several quotas with the sliding log, as a limiter refuses them.
    assert!(matches!(
        base()
            .plan("pro", [q("2/s"), q("10/min")])
            .algorithm(Algorithm::SlidingLog)
            .build(),
        Err(ConfigError::Unsupported(_))
    ));
    // Calendar quotas with a bucket.
    assert!(matches!(
        base().plan("monthly", [q("10000/month calendar")]).build(),
        Err(ConfigError::CalendarUnsupported { .. })
    ));
    let mut many = Plans::<u64>::builder("p0");
    for i in 0..=MAX_PLANS {
        many = many.plan(&format!("p{i}"), [q("1/s")]);
    }
    assert!(matches!(many.build(), Err(ConfigError::InvalidPlan { .. })));
    let plans = base().build().unwrap();
    for i in 1..MAX_PLANS {
        plans.set_plan(&format!("p{i}"), [q("1/s")]).unwrap();
    }
    assert!(matches!(
        plans.set_plan("one-too-many", [q("1/s")]),
        Err(ConfigError::InvalidPlan { .. })
    ));
    assert!(matches!(
        plans.set_plan("p3", [q("1/s"), q("2/s")]),
        Err(ConfigError::QuotaCount { .. })
    ));
}

/// A calendar plan (the sliding window, `10000/month calendar` with the month's own
/// limit) counts to the month's end: a deny on Jan 31 at 23:00 UTC waits 3,600 s.
#[test]
fn a_calendar_plan_waits_for_the_month_s_end() {
    let jan_31_23h = Duration::from_secs(1_769_900_400); // 2026-01-31T23:00:00Z
    let plans: Plans<u64, ManualClock> = Plans::builder("free")
        .plan("free", [q("2/month calendar")])
        .plan("pro", [q("100000/s"), q("10000/month calendar")])
        .algorithm(Algorithm::FixedWindow)
        .clock(ManualClock::at_unix(jan_31_23h))
        .resolver(|key: &u64| (*key >= 100).then_some("pro"))
        .build()
        .unwrap();
    assert!(plans.check(&1).is_allowed() && plans.check(&1).is_allowed());
    let denied = plans.check(&1);
    assert_eq!(denied.retry_after(), Some(Duration::from_secs(3_600)));
    // Pro's admission reports the quota with the fewest units left: the month's.
    assert_eq!(plans.check(&100).limit(), 10_000);
    assert_eq!(plans.plan_of(&100).as_ref(), "pro");
}

/// 1/s and 100,000/s plans, two threads hammering keys of both plans while a third
/// moves keys between them: no key ever gets more than its plan's limit per plan.
#[test]
fn concurrent_checks_and_moves_never_exceed_a_plan() {
    let plans: Plans<u64, ManualClock> = Plans::builder("slow")
        .plan("slow", [q("1/s")])
        .plan("fast", [q("100000/s")])
        .algorithm(Algorithm::FixedWindow)
        .clock(ManualClock::new())
        .resolver(|key: &u64| (key % 2 == 0).then_some("fast"))
        .build()
        .unwrap();
    let admitted: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for i in 0..200_000u64 {
                    let key = i % 64;
                    if plans.check(&key).is_allowed() {
                        admitted[key as usize].fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        s.spawn(|| {
            for round in 0..2_000u64 {
                let key = round % 64;
                let to = if round % 3 == 0 { "slow" } else { "fast" };
                plans.assign(&key, to).unwrap();
            }
        });
    });
    // Each key spent at most each plan's limit (the clock never moved).
    for (key, n) in admitted.iter().enumerate() {
        let n = n.load(Ordering::Relaxed);
        assert!(n <= 100_001, "key {key}: {n} admitted");
    }
}

/// A million keys over three plans: each decided by its plan, the resolver called
/// exactly once per key, every answer kept.
#[test]
fn a_million_keys_over_three_plans() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let plans: Plans<u64> = Plans::builder("free")
        .plan("free", [q("60/min")])
        .plan("pro", [q("600/min")])
        .plan("team", [q("6000/min")])
        .algorithm(Algorithm::SlidingWindow)
        .resolver(move |key: &u64| {
            counted.fetch_add(1, Ordering::Relaxed);
            [None, Some("pro"), Some("team")][(key % 3) as usize]
        })
        .build()
        .unwrap();
    const KEYS: u64 = 1_000_000;
    for round in 0..2 {
        for key in 0..KEYS {
            let d = plans.check(&key);
            assert!(d.is_allowed(), "round {round}, key {key}");
            assert_eq!(d.limit(), [60, 600, 6000][(key % 3) as usize]);
        }
    }
    assert_eq!(calls.load(Ordering::Relaxed), KEYS as usize);
    assert_eq!(plans.stats().answers, KEYS as usize);
    assert_eq!(plans.len(), KEYS as usize);
    assert_eq!(plans.limiter("team").unwrap().len(), (KEYS / 3) as usize);
}

/// `RateLimiter::set_quotas` changes every quota of a compound limiter (a pair of
/// quotas and a chain of three), each quota's used units carried over.
#[test]
fn set_quotas_changes_every_quota_and_carries_each_count() {
    for also in [vec!["10/h"], vec!["10/h", "100/day"]] {
        let mut builder = RateLimiter::builder(q("5/min"))
            .algorithm(Algorithm::FixedWindow)
            .clock(ManualClock::new());
        for a in &also {
            builder = builder.also(q(a));
        }
        let limiter: RateLimiter<u64, ManualClock> = builder.build().unwrap();
        for _ in 0..5 {
            assert!(limiter.check(&1).is_allowed());
        }
        let mut next = vec![q("8/min"), q("6/h")];
        next.extend(also.iter().skip(1).map(|a| q(a)));
        limiter.set_quotas(&next).unwrap();
        assert_eq!(limiter.quotas(), next);
        // 5 used of the hour's new 6: one more.
        assert!(limiter.check(&1).is_allowed());
        let denied = limiter.check(&1);
        assert!(!denied.is_allowed());
        assert_eq!((denied.policy(), denied.limit()), (1, 6));
        assert!(matches!(
            limiter.set_quotas(&[q("1/s")]),
            Err(ConfigError::QuotaCount { .. })
        ));
        assert_eq!(limiter.quotas(), next, "a refused change changes nothing");
    }
}
