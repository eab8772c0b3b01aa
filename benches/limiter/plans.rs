//! Plans per key against the plain check, in the same run: a million `u64` keys over
//! three plans, each key's plan from a resolver whose answer the plan book keeps (or
//! named by the caller), against one limiter of the same algorithm holding the same
//! million keys.

use super::*;
use tollgate::plans::Plans;

/// A million keys: the figure.
const PLAN_KEYS: u64 = 1_000_000;

/// The plans, each key's plan from the book (the resolver's answer, kept).
struct Planned(Plans<u64>);

impl Check for Planned {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check(&key).is_allowed()
    }
}

/// The plans, each check naming its plan as the request would (the HTTP layer's plan
/// extractor): no book lookup.
struct Named(Plans<u64>);

impl Check for Named {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let plan = ["free", "pro", "team"][(key % 3) as usize];
        self.0.check_in(plan, &key).is_allowed()
    }
}

/// The contenders: the plain limiter first, then the plans (free, pro and team, each a
/// generous token bucket so that every check admits and writes; the resolver puts a
/// third of the keys on each).
fn contenders() -> Vec<(&'static str, Box<dyn Check>)> {
    let quota = generous(Algorithm::TokenBucket);
    let plans = Plans::builder("free")
        .plan("free", [quota])
        .plan("pro", [quota])
        .plan("team", [quota])
        .resolver(|key: &u64| [None, Some("pro"), Some("team")][(key % 3) as usize])
        .build()
        .expect("valid plans");
    vec![
        (
            "plain",
            Box::new(Tollgate(tollgate(Algorithm::TokenBucket, quota))),
        ),
        ("plans_3", Box::new(Planned(plans.clone()))),
        ("plans_3_named", Box::new(Named(plans))),
    ]
}

fn sequences() -> Vec<Vec<u64>> {
    (1..=2)
        .map(|t| key_sequence(0x5eed_0000 + t, PLAN_KEYS))
        .collect()
}

/// A million keys on 1 and 2 threads, every key checked once first.
pub(crate) fn plans_1m(c: &mut Criterion) {
    let keys = sequences();
    let mut group = c.benchmark_group("plans_1m_u64");
    group.sample_size(20);
    for (name, limiter) in contenders() {
        for threads in [1, 2] {
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed_set(&mut group, id, &*limiter, threads, &keys, PLAN_KEYS);
        }
    }
    group.finish();
}

/// The contenders in alternating rounds in one process (each round times every one, in
/// a rotated order), so the machine's drift cancels out: per round, each plans
/// contender / plain; then the medians and spreads over the rounds.
pub(crate) fn plans_alternating(quick: bool) {
    let keys = sequences();
    let contenders = contenders();
    for key in 0..PLAN_KEYS {
        for (_, c) in &contenders {
            c.check(key);
        }
    }
    let (rounds, iters) = if quick { (3, 1_000) } else { (21, 1_000_000) };
    println!("\nplans_1m_u64 alternating: {rounds} rounds of {iters} checks per thread");
    for threads in [1, 2] {
        let time = |which: usize| {
            let limiter = &*contenders[which].1;
            let op = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &op).as_secs_f64() * 1e9 / iters as f64
        };
        let times = alternate(contenders.len(), rounds, time);
        let label = format!("plans_1m_u64/alternating/{threads}_thread");
        for (i, (name, _)) in contenders.iter().enumerate().skip(1) {
            print_ratio(&label, (contenders[0].0, &times[0]), (name, &times[i]));
        }
    }
}
