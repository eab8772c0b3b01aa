//! The concurrency limiter: a permit taken and given back on an existing key, against a
//! rate limiter's check on the same keys and against the hand-rolled answer, a
//! `tokio::sync::Semaphore` per key in a `DashMap`.

use std::sync::Arc;

use dashmap::DashMap;
use tokio::sync::Semaphore;
use tollgate::ConcurrencyLimiter;

use super::*;

/// Slots per key: far above what the threads hold, so every acquire succeeds.
const SLOTS: u32 = 1_000;

/// tollgate's concurrency limiter: acquire, then release at once.
struct Permits(ConcurrencyLimiter<u64>);

impl Check for Permits {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.try_acquire(&key).is_ok()
    }
}

/// A semaphore per key in a `DashMap`: the key's semaphore looked up (inserted the first
/// time), an owned permit taken, then dropped.
struct Semaphores(DashMap<u64, Arc<Semaphore>, ahash::RandomState>);

impl Check for Semaphores {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let semaphore = match self.0.get(&key) {
            Some(s) => Arc::clone(&s),
            None => Arc::clone(
                &self
                    .0
                    .entry(key)
                    .or_insert_with(|| Arc::new(Semaphore::new(SLOTS as usize))),
            ),
        };
        semaphore.try_acquire_owned().is_ok()
    }
}

/// 10k `u64` keys, uniformly random, on 1 and 2 threads: a permit taken and dropped by
/// tollgate and by the semaphore map, beside tollgate's token-bucket check.
pub(crate) fn in_flight_10k(c: &mut Criterion) {
    let keys = key_sequences();
    let mut group = c.benchmark_group("in_flight_10k_u64");
    for threads in [1, 2] {
        let contenders: [(&str, Box<dyn Check>); 3] = [
            (
                "rate_check",
                Box::new(Tollgate(tollgate(
                    Algorithm::TokenBucket,
                    generous(Algorithm::TokenBucket),
                ))),
            ),
            ("permit", Box::new(Permits(ConcurrencyLimiter::new(SLOTS)))),
            (
                "dashmap_semaphore",
                Box::new(Semaphores(DashMap::with_hasher(ahash::RandomState::new()))),
            ),
        ];
        for (name, limiter) in contenders {
            let id = BenchmarkId::new(name, format!("{threads}_thread"));
            bench_keyed(&mut group, id, &*limiter, threads, &keys);
        }
    }
    group.finish();
}

/// The same three in alternating rounds in one process (each round runs them in a
/// rotated order), so that the machine's drift between them cancels out: per round,
/// permit / check and semaphore map / permit, then their medians over the rounds.
pub(crate) fn in_flight_alternating(quick: bool) {
    let keys = key_sequences();
    let check = Tollgate(tollgate(
        Algorithm::TokenBucket,
        generous(Algorithm::TokenBucket),
    ));
    let permits = Permits(ConcurrencyLimiter::new(SLOTS));
    let semaphores = Semaphores(DashMap::with_hasher(ahash::RandomState::new()));
    let contenders: [&dyn Check; 3] = [&check, &permits, &semaphores];
    for key in 0..KEYS {
        for c in contenders {
            c.check(key);
        }
    }
    let (rounds, iters) = if quick { (3, 1_000) } else { (41, 400_000) };
    println!(
        "\nin_flight_10k_u64 alternating: {rounds} rounds of {iters} operations per thread (ns an operation)"
    );
    for threads in [1, 2] {
        let time = |which: usize| {
            let limiter = contenders[which];
            let op = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &op).as_secs_f64() * 1e9 / iters as f64
        };
        let times = alternate(3, rounds, time);
        let label = format!("in_flight_10k_u64/alternating/{threads}_thread");
        print_ratio(&label, ("check", &times[0]), ("permit", &times[1]));
        print_ratio(&label, ("permit", &times[1]), ("semaphore map", &times[2]));
    }
}
