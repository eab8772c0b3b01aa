//! Per-key quotas and live changes of the default quota: what happens to a key's state,
//! and that threads checking meanwhile see every change and never a torn one.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use crate::common;

use common::manual;
use tollgate::{Algorithm, ConfigError, Quota};

fn q(s: &str) -> Quota {
    s.parse().unwrap()
}

#[test]
fn a_key_can_have_its_own_quota() {
    for algorithm in Algorithm::ALL {
        let (l, _) = manual(algorithm, "2/s");
        l.set_quota("paid", q("100/s")).unwrap();
        assert_eq!(l.quota_for("paid"), q("100/s"));
        assert_eq!(l.quota_for("free"), q("2/s"));
        assert!(l.is_empty(), "setting a quota stores no state");
        assert_eq!(
            (0..200).filter(|_| l.check("paid").is_allowed()).count(),
            100,
            "{algorithm:?}"
        );
        assert_eq!(
            (0..200).filter(|_| l.check("free").is_allowed()).count(),
            2,
            "{algorithm:?}"
        );
        assert_eq!(l.check("paid").limit(), 100);
        // check_n's capacity follows the key's own quota.
        assert!(l.check_n("free", 3).is_err());
        assert!(l.check_n("paid", 3).is_ok());

        // Back to the default: its 100 consumed units are capped at the default's 2.
        l.remove_quota("paid");
        assert_eq!(l.quota_for("paid"), q("2/s"));
        assert!(
            !l.check("paid").is_allowed(),
            "{algorithm:?}: removing a quota refilled the key"
        );
    }
}

#[test]
fn the_default_quota_changes_for_keys_without_their_own() {
    for algorithm in Algorithm::ALL {
        let (l, _) = manual(algorithm, "2/s");
        l.set_quota("paid", q("5/s")).unwrap();
        l.set_default_quota(q("10/s")).unwrap();
        assert_eq!(l.quota(), q("10/s"));
        assert_eq!(l.quota_for("new"), q("10/s"));
        assert_eq!(l.quota_for("paid"), q("5/s"));
        assert_eq!(
            (0..20).filter(|_| l.check("new").is_allowed()).count(),
            10,
            "{algorithm:?}"
        );
        assert_eq!(
            (0..20).filter(|_| l.check("paid").is_allowed()).count(),
            5,
            "{algorithm:?}"
        );
    }
}

#[test]
fn invalid_quotas_change_nothing() {
    let (l, _) = manual(Algorithm::SlidingLog, "2/s");
    let err = l.set_default_quota(q("100000/s")).unwrap_err();
    assert!(
        matches!(err, ConfigError::LimitTooLarge { max: 4096, .. }),
        "{err:?}"
    );
    assert!(l.set_quota("k", q("100000/s")).is_err());
    assert_eq!(l.quota(), q("2/s"));
    assert_eq!(l.quota_for("k"), q("2/s"));
}

/// A key that has used 50 of 100 when its quota changes keeps its 50 consumed units,
/// capped at the new capacity. No change refills it.
#[test]
fn a_half_consumed_key_keeps_what_it_used() {
    // (new quota, remaining right after the change)
    let changes = [
        ("1000/min", 950), // grows: the extra allowance is available at once
        ("10/min", 0),     // shrinks below what was used: empty, never negative
        ("50/s", 0),       // another period, exactly what was used
        ("200/2min", 150), // same rate, longer period
        ("100/min", 50),   // no change at all
    ];
    for algorithm in Algorithm::ALL {
        for (quota, remaining) in changes {
            for per_key in [false, true] {
                let (l, clock) = manual(algorithm, "100/min");
                clock.set_ns(7_000_000_000);
                assert!(l.check_n("k", 50).unwrap().is_allowed());
                if per_key {
                    l.set_quota("k", q(quota)).unwrap();
                } else {
                    l.set_default_quota(q(quota)).unwrap();
                }
                let d = l.peek("k");
                assert_eq!(
                    d.remaining(),
                    remaining,
                    "{algorithm:?} → {quota} (per key: {per_key})"
                );
                assert_eq!(d.limit(), q(quota).limit(), "{algorithm:?} → {quota}");
                if remaining == 0 {
                    assert!(
                        !l.check("k").is_allowed(),
                        "{algorithm:?} → {quota}: refilled"
                    );
                }
            }
        }
    }
}

#[test]
fn a_shrunk_token_bucket_refills_at_the_new_rate() {
    let (l, clock) = manual(Algorithm::TokenBucket, "100/min");
    l.check_n("k", 50).unwrap();
    l.set_default_quota(q("10/min")).unwrap();
    // Empty: the next token comes one new interval (6s) later, not after the old debt.
    let d = l.check("k");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(6)));
    assert_eq!(d.reset_after(), Duration::from_secs(60));
    clock.advance(Duration::from_secs(6));
    assert!(l.check("k").is_allowed());
}

/// While one thread raises the default quota step by step, checking threads always see a
/// whole quota (never a mix of two) and, once a change has returned, at least that quota.
#[test]
fn changes_are_seen_by_all_threads_and_never_torn() {
    for algorithm in Algorithm::ALL {
        let (l, clock) = manual(algorithm, "10/s");
        let published = AtomicU64::new(10);
        let done = AtomicBool::new(false);
        let start = Barrier::new(4);
        thread::scope(|s| {
            for t in 0..3 {
                let (l, published, done, start, clock) = (&l, &published, &done, &start, &clock);
                s.spawn(move || {
                    start.wait();
                    let key = format!("k{}", t % 2);
                    while !done.load(Ordering::Acquire) {
                        let floor = published.load(Ordering::Acquire);
                        let d = l.check(key.as_str());
                        assert!(
                            d.limit() >= floor,
                            "{algorithm:?}: saw limit {} after {floor} was set",
                            d.limit()
                        );
                        assert_eq!(d.limit() % 10, 0, "{algorithm:?}: torn limit {}", d.limit());
                        assert!(d.remaining() <= d.limit());
                        clock.advance(Duration::from_micros(7));
                    }
                });
            }
            start.wait();
            for limit in (20..=400).step_by(10) {
                l.set_default_quota(Quota::per_second(limit).unwrap())
                    .unwrap();
                published.store(limit, Ordering::Release);
                thread::yield_now();
            }
            done.store(true, Ordering::Release);
        });
        assert_eq!(l.quota(), Quota::per_second(400).unwrap());
    }
}
