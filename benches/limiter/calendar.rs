//! Calendar periods and the penalty box against the plain check, in the same run: a
//! check of a calendar quota against a rolling quota of the same algorithm, and a check
//! on a limiter with a penalty box (no key blocked) against one without.

use super::*;

/// The contenders: (name, limiter). Windows: a day's quota of 4·10^9 (fixed window) or
/// 16·10^6 (sliding window, its largest limit): never reached in a run, so every check
/// admits and writes.
fn contenders() -> Vec<(&'static str, Tollgate)> {
    let build = |quota: &str, algorithm| {
        let b = RateLimiter::builder(quota.parse().expect("valid quota")).algorithm(algorithm);
        Tollgate(b.build().expect("valid limiter"))
    };
    vec![
        (
            "fixed_rolling",
            build("4000000000/d", Algorithm::FixedWindow),
        ),
        (
            "fixed_calendar",
            build("4000000000/day calendar", Algorithm::FixedWindow),
        ),
        (
            "sliding_rolling",
            build("16000000/d", Algorithm::SlidingWindow),
        ),
        (
            "sliding_calendar",
            build("16000000/day calendar", Algorithm::SlidingWindow),
        ),
        (
            "bucket",
            Tollgate(tollgate(
                Algorithm::TokenBucket,
                generous(Algorithm::TokenBucket),
            )),
        ),
        ("bucket_penalty_box", {
            let builder = RateLimiter::builder(generous(Algorithm::TokenBucket));
            Tollgate(
                builder
                    .block_for(Duration::from_secs(600))
                    .build()
                    .expect("valid limiter"),
            )
        }),
    ]
}

/// 10k `u64` keys on 1 and 2 threads.
pub(crate) fn calendar_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let mut group = c.benchmark_group("calendar_10k_u64");
    for threads in [1, 2] {
        for (name, limiter) in contenders() {
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, &limiter, threads, &keys);
        }
    }
    group.finish();
}

/// The pairs above in alternating rounds in one process (each round times every
/// contender, in a rotated order), so the machine's drift cancels out: per round, each
/// pair's ratio (calendar / rolling, penalty box / none), then the medians and spreads
/// over the rounds.
pub(crate) fn calendar_alternating(quick: bool) {
    let keys = key_sequences();
    let contenders = contenders();
    for key in 0..KEYS {
        for (_, c) in &contenders {
            c.check(key);
        }
    }
    let (rounds, iters) = if quick { (3, 1_000) } else { (31, 400_000) };
    println!("\ncalendar_10k_u64 alternating: {rounds} rounds of {iters} checks per thread");
    for threads in [1, 2] {
        let time = |which: usize| {
            let limiter = &contenders[which].1;
            let op = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &op).as_secs_f64() * 1e9 / iters as f64
        };
        let times = alternate(contenders.len(), rounds, time);
        let label = format!("calendar_10k_u64/alternating/{threads}_thread");
        for pair in contenders.chunks(2).zip(times.chunks(2)) {
            let ([(a_name, _), (b_name, _)], [a, b]) = pair else {
                continue;
            };
            print_ratio(&label, (a_name, a), (b_name, b));
        }
    }
}
