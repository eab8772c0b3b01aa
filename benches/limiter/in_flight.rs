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
