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
    let quantile = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    for threads in [1, 2] {
        let time = |limiter: &dyn Check| {
            let op = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &op).as_secs_f64() * 1e9 / iters as f64
        };
        let n = contenders.len();
        let mut times = vec![Vec::new(); n];
        let mut ratios = vec![Vec::new(); n / 2];
        for round in 0..rounds {
            let mut t = vec![0.0; n];
            for i in 0..n {
                let which = (round + i) % n;
                t[which] = time(&contenders[which].1);
            }
            for (pair, r) in ratios.iter_mut().enumerate() {
                r.push(t[2 * pair + 1] / t[2 * pair]);
            }
            for (all, one) in times.iter_mut().zip(t) {
                all.push(one);
            }
        }
        for v in times.iter_mut().chain(ratios.iter_mut()) {
            v.sort_by(f64::total_cmp);
        }
        for (pair, r) in ratios.iter().enumerate() {
            let (a, b) = (2 * pair, 2 * pair + 1);
            println!(
                "calendar_10k_u64/alternating/{threads}_thread: {} / {} {:.3} (quartiles {:.3}–{:.3}, range {:.3}–{:.3}); {:.1} ns vs {:.1} ns (medians)",
                contenders[b].0,
                contenders[a].0,
                quantile(r, 0.5),
                quantile(r, 0.25),
                quantile(r, 0.75),
                r[0],
                r[r.len() - 1],
                quantile(&times[b], 0.5),
                quantile(&times[a], 0.5),
            );
        }
    }
}
