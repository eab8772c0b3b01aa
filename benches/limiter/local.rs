//! The in-process limiter against governor and the bare references: keys, threads,
//! settling, two quotas, churn, string keys, a million keys.

use super::*;

/// 10k `u64` keys, uniformly random, on 1 and 2 threads: every algorithm and governor.
pub(crate) fn keyed_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let mut group = c.benchmark_group("keyed_10k_u64");
    for threads in [1, 2] {
        for (name, limiter) in contenders(generous) {
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, &*limiter, threads, &keys);
        }
    }
    group.finish();
}

/// What a settlement bench does to a key: `check_n(key, 1)`, `charge(key, 1)` or
/// `refund(key, 1)`.
#[derive(Clone, Copy)]
pub(crate) enum Settling {
    CheckN,
    Charge,
    Refund,
}

/// A tollgate limiter driven by one kind of settlement.
pub(crate) struct Settles(pub(crate) RateLimiter<u64>, Settling);

impl Check for Settles {
    #[inline]
    fn check(&self, key: u64) -> bool {
        match self.1 {
            Settling::CheckN => self.0.check_n(&key, 1).is_ok_and(|d| d.is_allowed()),
            Settling::Charge => self.0.charge(&key, 1).is_ok_and(|d| d.is_allowed()),
            Settling::Refund => self.0.refund(&key, 1).is_ok_and(|d| d.is_allowed()),
        }
    }
}

/// `charge` and `refund` against `check_n` of the same cost, in the same run: 10k `u64`
/// keys on the token bucket (T = 1 ns, a burst of 10^9: every check admitted, and the
/// charges never run a key into debt), 1 and 2 threads.
pub(crate) fn settle_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let mut group = c.benchmark_group("settle_10k_u64");
    for threads in [1, 2] {
        for (name, kind) in [
            ("check_n", Settling::CheckN),
            ("charge", Settling::Charge),
            ("refund", Settling::Refund),
        ] {
            let limiter = Settles(
                tollgate(Algorithm::TokenBucket, generous(Algorithm::TokenBucket)),
                kind,
            );
            // Every key held: the refunds find their keys.
            for key in 0..KEYS {
                limiter.0.check(&key);
            }
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_sequences(&mut group, id, &limiter, threads, &keys);
        }
    }
    group.finish();
}

/// A check of a key held to two quotas (`also`) against one quota, in the same run: 10k
/// `u64` keys on the token bucket, both quotas generous (every check admitted, so both
/// are consumed), 1 and 2 threads.
pub(crate) fn also_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let mut group = c.benchmark_group("also_10k_u64");
    for threads in [1, 2] {
        let (one, two) = one_and_two_quotas();
        for (name, limiter) in [("one_quota", &one), ("two_quotas", &two)] {
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, limiter, threads, &keys);
        }
    }
    group.finish();
}

/// `also_10k`'s two limiters: the token bucket at a generous quota, and the same with a
/// generous daily quota as well (every check admitted by both, so both are consumed).
pub(crate) fn one_and_two_quotas() -> (Tollgate, Tollgate) {
    let generous = generous(Algorithm::TokenBucket);
    let daily = Quota::new(8_640_000_000_000, Duration::from_secs(86_400))
        .and_then(|q| q.with_burst(1_000_000_000_000))
        .expect("valid quota");
    let one = Tollgate(tollgate(Algorithm::TokenBucket, generous));
    let two = Tollgate(
        RateLimiter::builder(generous)
            .also(daily)
            .build()
            .expect("valid limiter"),
    );
    (one, two)
}

/// A 1,000-key set in steady use whose requests come about one period apart (T =
/// 100 µs, burst 1: a client pacing itself at its limit; about half the checks denied),
/// against the same T and burst over a 1 h period (nothing can ever be swept), the
/// smallest period (1 ns: every key back to untouched between any two checks) and
/// governor at T = 100 µs. The sweep must leave the set alone: the store's counters are
/// printed after each run (evicted and resized should not move once the set is in).
pub(crate) fn churn_1k(c: &mut Criterion) {
    const SET: u64 = 1_000;
    let keys: Vec<Vec<u64>> = (1..=2)
        .map(|t| key_sequence(0x2545_f491 * t, SET))
        .collect();
    let t = Duration::from_micros(100);
    let quotas = [
        ("token-bucket/period_T", Quota::new(1, t)),
        (
            "token-bucket/period_1h",
            Quota::new(36_000_000, Duration::from_secs(3_600)),
        ),
        (
            "token-bucket/period_1ns",
            Quota::new(1, Duration::from_nanos(1)),
        ),
    ];
    let mut group = c.benchmark_group("churn_1k");
    for threads in [1, 2] {
        for (name, quota) in quotas.clone() {
            let quota = quota.and_then(|q| q.with_burst(1)).expect("valid quota");
            let limiter = tollgate(Algorithm::TokenBucket, quota);
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            let contender = Tollgate(limiter);
            for key in 0..SET {
                contender.check(key);
            }
            let before = contender.0.stats();
            bench_sequences(&mut group, id, &contender, threads, &keys);
            let after = contender.0.stats();
            eprintln!(
                "churn_1k/{name}/{threads}_thread: {} keys evicted, {} resizes while measured",
                after.evicted_untouched - before.evicted_untouched,
                after.resizes - before.resizes
            );
        }
        let governor = Governor(governor::RateLimiter::keyed(
            governor::Quota::with_period(t).expect("non-zero period"),
        ));
        let id = BenchmarkId::new("governor/period_T", format!("{threads}_thread"));
        bench_keyed_set(&mut group, id, &governor, threads, &keys, SET);
    }
    group.finish();
}

/// The check path's reference designs (benches/support/reference.rs) on the keyed_10k
/// workload, beside tollgate's token bucket and governor in the same run; and tollgate
/// and governor each on a clock that never moves, which shows what of a check is the TSC
/// read (frozen at 0, the buckets admit every check of the run: 10^9 per key).
pub(crate) fn reference_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let designs: Vec<(&str, Box<dyn Check>)> = vec![
        (
            "tollgate",
            Box::new(Tollgate(tollgate(
                Algorithm::TokenBucket,
                generous(Algorithm::TokenBucket),
            ))),
        ),
        ("governor", Box::new(governor())),
        (
            "rwlock-shards-hashbrown-ahash",
            Box::new(reference::ShardedRwLock::new(KEYS)),
        ),
        (
            "open-addressing-ahash",
            Box::new(reference::open_addressing_ahash(KEYS)),
        ),
        (
            "open-addressing-unseeded-multiply",
            Box::new(reference::open_addressing_multiply(KEYS)),
        ),
        (
            "open-addressing-unseeded-multiply-frozen-clock",
            Box::new(reference::open_addressing_multiply_frozen(KEYS)),
        ),
        ("clock-read-only", Box::new(reference::ClockOnly::new())),
        (
            "clock-read-then-cas",
            Box::new(reference::ClockAndCas::new()),
        ),
        (
            "tollgate-frozen-clock",
            Box::new(Tollgate(
                RateLimiter::builder(generous(Algorithm::TokenBucket))
                    .clock(tollgate::clock::ManualClock::new())
                    .build()
                    .expect("valid limiter"),
            )),
        ),
        (
            "governor-frozen-clock",
            Box::new(Governor(governor::RateLimiter::new(
                governor_quota(),
                DefaultKeyedStateStore::default(),
                governor::clock::FakeRelativeClock::default(),
            ))),
        ),
    ];
    for (name, design) in &designs {
        assert!(
            (0..KEYS).all(|key| design.check(key)),
            "{name} admits every key"
        );
    }
    let mut group = c.benchmark_group("reference_10k_u64");
    for threads in [1, 2] {
        for (name, design) in &designs {
            let id = BenchmarkId::new(*name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, &**design, threads, &keys);
        }
    }
    group.finish();
}

/// What per-key quotas and live reconfiguration cost a check: the token bucket as is,
/// with 1,000 keys holding their own quota (so every shard has overrides to look up), and
/// with a crossbeam-epoch pin and pointer load added, as an epoch-published configuration
/// would need.
pub(crate) fn config_read(c: &mut Criterion) {
    let keys = key_sequences();
    let quota = generous(Algorithm::TokenBucket);
    let mut group = c.benchmark_group("config_read");
    let plain = tollgate(Algorithm::TokenBucket, quota);
    let with_overrides = tollgate(Algorithm::TokenBucket, quota);
    for key in (0..KEYS).step_by(10) {
        with_overrides.set_quota(&key, quota).expect("valid quota");
    }
    let epoch = EpochPublished {
        limiter: tollgate(Algorithm::TokenBucket, quota),
        config: crossbeam_epoch::Atomic::new(quota),
    };
    let variants: [(&str, &dyn Check); 3] = [
        ("shard_policy", &Tollgate(plain)),
        ("shard_policy_with_overrides", &Tollgate(with_overrides)),
        ("plus_epoch_pin", &epoch),
    ];
    for (name, limiter) in variants {
        bench_keyed(
            &mut group,
            BenchmarkId::new(name, "1_thread"),
            limiter,
            1,
            &keys,
        );
    }
    group.finish();
}

/// What counting decisions costs a check: the token bucket with its counters on (the
/// default) and off, 10k keys, 1 and 2 threads, in the same run.
pub(crate) fn counters(c: &mut Criterion) {
    let keys = key_sequences();
    let quota = generous(Algorithm::TokenBucket);
    let mut group = c.benchmark_group("counters");
    for threads in [1, 2] {
        for (name, on) in [("counted", true), ("not_counted", false)] {
            let limiter = RateLimiter::builder(quota)
                .counters(on)
                .build()
                .expect("valid limiter");
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, &Tollgate(limiter), threads, &keys);
        }
    }
    group.finish();
}

/// Two threads hammering one key limited to 100/s: an abusive client, ≥ 99% denied.
pub(crate) fn hot_key_denied(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_key_denied");
    let ours = tollgate(
        Algorithm::TokenBucket,
        Quota::per_second(100).expect("valid quota"),
    );
    let gov = governor::RateLimiter::keyed(governor::Quota::per_second(
        NonZeroU32::new(100).expect("non-zero"),
    ));
    let contenders: [(&str, &CheckFn<'_>); 2] = [
        ("token-bucket", &|_, _| ours.check(&7).is_allowed()),
        ("governor", &|_, _| gov.check_key(&7u64).is_ok()),
    ];
    for (name, check) in contenders {
        group.bench_function(BenchmarkId::new(name, "2_thread"), |b| {
            b.iter_custom(|iters| run_threads(2, iters, check))
        });
    }
    group.finish();
}

/// One thread, 10k `String` keys of 24 bytes; tollgate looks them up by `&str`.
pub(crate) fn string_keys(c: &mut Criterion) {
    let names: Vec<String> = (0..KEYS)
        .map(|i| format!("tenant-{i:05}-abcdefghijk"))
        .collect();
    assert!(names.iter().all(|n| n.len() == 24));
    let order = key_sequence(0x5eed, KEYS);
    let quota = generous(Algorithm::TokenBucket);
    let ours: RateLimiter<String> = RateLimiter::builder(quota).build().expect("valid limiter");
    let gov_quota = governor::Quota::with_period(Duration::from_nanos(1))
        .expect("non-zero period")
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("non-zero"));
    let gov: governor::RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock> =
        governor::RateLimiter::keyed(gov_quota);
    for name in &names {
        ours.check(name.as_str());
        let _ = gov.check_key(name);
    }
    // The reference designs for `String` keys (benches/support/reference.rs): the bare
    // table of `{word, String}` slots, and of slots holding the key's bytes.
    let heap = reference::string_slots(&names);
    let inline = reference::inline_slots(&names);
    assert!(
        names
            .iter()
            .all(|n| heap.decide(n).is_some_and(|d| d.allowed)
                && inline.decide(n).is_some_and(|d| d.allowed)),
        "the reference designs admit every key"
    );
    let mut group = c.benchmark_group("keyed_10k_string24");
    let contenders: [(&str, &CheckFn<'_>); 4] = [
        ("token-bucket", &|_, i| {
            ours.check(names[order[i & (SEQUENCE - 1)] as usize].as_str())
                .is_allowed()
        }),
        ("governor", &|_, i| {
            gov.check_key(&names[order[i & (SEQUENCE - 1)] as usize])
                .is_ok()
        }),
        ("open-addressing-string-slots-ahash", &|_, i| {
            heap.decide(&names[order[i & (SEQUENCE - 1)] as usize])
                .is_some_and(|d| d.allowed)
        }),
        ("open-addressing-inline-key-bytes-ahash", &|_, i| {
            inline
                .decide(&names[order[i & (SEQUENCE - 1)] as usize])
                .is_some_and(|d| d.allowed)
        }),
    ];
    for (name, check) in contenders {
        group.bench_function(BenchmarkId::new(name, "1_thread"), |b| {
            b.iter_custom(|iters| run_threads(1, iters, check))
        });
    }
    group.finish();
}

/// Throughput by key count and threads: tollgate's token bucket against governor at 1k,
/// 10k, 100k and 1M `u64` keys, on 1 and 2 threads (the benchmark page's scaling plot).
pub(crate) fn by_key_count(c: &mut Criterion) {
    let mut group = c.benchmark_group("by_key_count_u64");
    group.sample_size(20);
    for set in [1_000u64, 10_000, 100_000, 1_000_000] {
        let keys: Vec<Vec<u64>> = (1..=2)
            .map(|t| key_sequence(0x5eed_0000 + t, set))
            .collect();
        let ours = Tollgate(tollgate(
            Algorithm::TokenBucket,
            generous(Algorithm::TokenBucket),
        ));
        let gov = governor();
        for (name, limiter) in [("tollgate", &ours as &dyn Check), ("governor", &gov)] {
            for threads in [1, 2] {
                let id = BenchmarkId::new(name, format!("{set}_keys_{threads}_thread"));
                bench_keyed_set(&mut group, id, limiter, threads, &keys, set);
            }
        }
    }
    group.finish();
}
