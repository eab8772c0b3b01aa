use super::*;

#[test]
fn a_key_holds_at_most_its_maximum_and_each_drop_gives_a_slot_back() {
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(2);
    let a = limiter.try_acquire("k").unwrap();
    let b = limiter.try_acquire("k").unwrap();
    assert_eq!(
        limiter.try_acquire("k").unwrap_err(),
        ConcurrencyError::Full {
            in_flight: 2,
            max: 2
        }
    );
    assert_eq!(limiter.in_flight("k"), 2);
    drop(a);
    assert_eq!(limiter.in_flight("k"), 1);
    drop(b);
    assert_eq!(limiter.in_flight("k"), 0);
    assert_eq!(limiter.in_flight("never seen"), 0);
}

#[test]
fn weights_are_taken_all_or_nothing_and_may_be_given_back_in_part() {
    let limiter: ConcurrencyLimiter<u64> = ConcurrencyLimiter::new(10);
    let mut big = limiter.try_acquire_n(&1, 7).unwrap();
    assert!(matches!(
        limiter.try_acquire_n(&1, 4),
        Err(ConcurrencyError::Full { in_flight: 7, .. })
    ));
    assert_eq!(
        limiter.try_acquire_n(&1, 11).unwrap_err(),
        ConcurrencyError::NeverFits {
            weight: 11,
            max: 10
        }
    );
    // A weight that never fits a new key leaves no key behind.
    assert!(limiter.try_acquire_n(&2, 11).is_err());
    assert_eq!(limiter.len(), 1);
    big.release_part(4);
    assert_eq!(big.weight(), 3);
    assert_eq!(limiter.in_flight(&1), 3);
    let _four = limiter.try_acquire_n(&1, 4).unwrap();
    let zero = limiter.try_acquire_n(&1, 0).unwrap();
    assert_eq!(zero.weight(), 0);
    drop(big);
    assert_eq!(limiter.in_flight(&1), 4);
}

#[test]
fn a_maximum_of_zero_admits_nothing_and_panics_nowhere() {
    let limiter: ConcurrencyLimiter<u64> = ConcurrencyLimiter::new(0);
    assert_eq!(
        limiter.try_acquire(&1).unwrap_err(),
        ConcurrencyError::NeverFits { weight: 1, max: 0 }
    );
    assert!(limiter.is_empty());
}

#[test]
fn overrides_and_the_default_change_live_and_keep_what_is_held() {
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    limiter.set_max("pro", 3);
    let _p: Vec<_> = (0..3)
        .map(|_| limiter.try_acquire("pro").unwrap())
        .collect();
    assert!(limiter.try_acquire("pro").is_err());
    let free = limiter.try_acquire("free").unwrap();
    assert!(limiter.try_acquire("free").is_err());
    // The default rises for keys without their own maximum, held or not.
    limiter.set_default_max(2);
    assert_eq!(limiter.max_for("free"), 2);
    assert_eq!(limiter.max_for("pro"), 3);
    let second = limiter.try_acquire("free").unwrap();
    // A lower maximum takes nothing back, and admits nobody until below it.
    limiter.set_max("free", 1);
    assert!(limiter.try_acquire("free").is_err());
    drop(free);
    assert!(limiter.try_acquire("free").is_err());
    drop(second);
    let again = limiter.try_acquire("free").unwrap();
    drop(again);
    limiter.remove_max("free");
    assert_eq!(limiter.max_for("free"), 2);
    // An override set before the key is first seen applies to it.
    limiter.set_max("later", 5);
    assert_eq!(limiter.try_acquire_n("later", 5).unwrap().weight(), 5);
}

#[test]
fn keys_with_nothing_in_flight_are_swept_and_the_cap_refuses_only_keys_in_use() {
    let limiter: ConcurrencyLimiter<u64> = ConcurrencyLimiter::builder(1)
        .shards(1)
        .max_keys(100)
        .build()
        .unwrap();
    let held: Vec<_> = (0..50).map(|k| limiter.try_acquire(&k).unwrap()).collect();
    // 50 idle keys fill the cap; newer keys sweep them away.
    for k in 50..100 {
        drop(limiter.try_acquire(&k).unwrap());
    }
    assert!(limiter.len() <= 100);
    for k in 1000..1100 {
        drop(limiter.try_acquire(&k).unwrap());
    }
    assert!(limiter.len() <= 100);
    // Every key held now is in use: a new one is refused.
    let more: Vec<_> = (100..150)
        .map(|k| limiter.try_acquire(&k).unwrap())
        .collect();
    assert_eq!(
        limiter.try_acquire(&5000).unwrap_err(),
        ConcurrencyError::TooManyKeys { max_keys: 100 }
    );
    drop(held);
    drop(more);
    assert!(limiter.try_acquire(&5000).is_ok());
    let held = limiter.len();
    assert_eq!(
        limiter.sweep(),
        held,
        "nothing is in flight: every key goes"
    );
    assert!(limiter.is_empty());
}

#[test]
fn a_flood_of_short_lived_keys_keeps_the_map_near_the_keys_in_use() {
    let limiter: ConcurrencyLimiter<u64> =
        ConcurrencyLimiter::builder(1).shards(4).build().unwrap();
    for k in 0..1_000_000u64 {
        drop(limiter.try_acquire(&k).unwrap());
    }
    // Each shard sweeps when it holds twice what it held after its last sweep.
    assert!(
        limiter.len() <= 4 * 2 * 64 + 4,
        "{} keys held",
        limiter.len()
    );
}

#[test]
fn stats_count_acquires_refusals_and_what_is_held() {
    let limiter: ConcurrencyLimiter<u64> = ConcurrencyLimiter::new(1);
    let p = limiter.try_acquire(&1).unwrap();
    assert!(limiter.try_acquire(&1).is_err());
    assert!(limiter.try_acquire_n(&2, 2).is_err());
    let stats = limiter.stats();
    assert_eq!(
        (stats.acquired, stats.denied, stats.in_flight, stats.keys),
        (1, 2, 1, 1)
    );
    drop(p);
    assert_eq!(limiter.stats().in_flight, 0);
    let debug = format!("{limiter:?}");
    assert!(debug.contains("default_max: 1"), "{debug}");
}

#[test]
fn a_rate_deny_holds_no_slot_and_a_full_key_consumes_no_quota() {
    let rate: RateLimiter<String> = RateLimiter::new("2/min".parse().unwrap());
    let slots: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let (permit, decision) = slots.try_acquire_with(&rate, "k").unwrap();
    assert_eq!(decision.remaining(), 1);
    // Full: the rate is not checked, so nothing of it is consumed.
    assert!(matches!(
        slots.try_acquire_with(&rate, "k"),
        Err(ConcurrencyError::Full { .. })
    ));
    assert_eq!(rate.peek("k").remaining(), 1);
    drop(permit);
    let (permit, _) = slots.try_acquire_with(&rate, "k").unwrap();
    drop(permit);
    // The quota is spent: the slot taken for the check is given back.
    let denied = slots.try_acquire_with(&rate, "k").unwrap_err();
    assert!(denied.decision().unwrap().retry_after().is_some());
    assert_eq!(slots.in_flight("k"), 0);
}

#[test]
fn a_permit_is_owned_send_and_static() {
    fn owned<T: Send + Sync + 'static>(_: &T) {}
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let permit = limiter.try_acquire("k").unwrap();
    owned(&permit);
    let moved = std::thread::spawn(move || drop(permit));
    moved.join().unwrap();
    assert_eq!(limiter.in_flight("k"), 0);
}

#[test]
fn a_panic_while_holding_gives_the_slot_back() {
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let l = limiter.clone();
    let result = std::thread::spawn(move || {
        let _permit = l.try_acquire("k").unwrap();
        panic!("the handler failed");
    })
    .join();
    assert!(result.is_err());
    assert_eq!(limiter.in_flight("k"), 0);
}

#[cfg(feature = "tokio")]
#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_arrival_order_and_a_timeout_leaves_the_line() {
    use std::sync::Arc;
    use std::time::Duration;
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let held = limiter.try_acquire("k").unwrap();
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let (l, order) = (limiter.clone(), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let permit = l.acquire("k").await.unwrap();
            order.lock().push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(permit);
        }));
        // Arrive in order.
        tokio::task::yield_now().await;
    }
    // A fourth gives up after 5 ms, while the others wait: it holds nothing after.
    let timed_out = limiter.acquire_timeout("k", Duration::from_millis(5)).await;
    assert_eq!(
        timed_out.unwrap_err(),
        ConcurrencyError::Timeout {
            waited: Duration::from_millis(5)
        }
    );
    // A newcomer does not pass those waiting.
    assert!(limiter.try_acquire("k").is_err());
    drop(held);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock(), vec![0, 1, 2]);
    assert_eq!(limiter.in_flight("k"), 0);
    assert_eq!(limiter.stats().waiting, 0);
    assert_eq!(limiter.stats().timed_out, 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_wait_holds_nothing_even_when_granted_before_it_saw_it() {
    let limiter: ConcurrencyLimiter<String> = ConcurrencyLimiter::new(1);
    let held = limiter.try_acquire("k").unwrap();
    let mut wait = Box::pin(limiter.acquire("k"));
    assert!(futures_poll_once(wait.as_mut()).is_none());
    drop(held); // granted to the waiter, which never polls again
    assert_eq!(limiter.in_flight("k"), 1);
    drop(wait);
    assert_eq!(limiter.in_flight("k"), 0);
    assert!(limiter.try_acquire("k").is_ok());
}

fn futures_poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}
