//! What every workload shares: the contenders reduced to one trait, their quotas, the key
//! sequences and the threads that run them.

use super::*;

/// Number of distinct keys in the keyed workloads.
pub(crate) const KEYS: u64 = 10_000;
/// Length of the pre-drawn key sequence (a power of two, so indexing is a mask).
pub(crate) const SEQUENCE: usize = 1 << 16;

/// A limiter under test, reduced to "check this key".
pub(crate) trait Check: Sync {
    fn check(&self, key: u64) -> bool;

    /// The table rebuilds so far, for the contenders that count them (tollgate's
    /// `stats().resizes`).
    fn rebuilds(&self) -> Option<u64> {
        None
    }
}

/// A tollgate limiter on `u64` keys, on its default clock or another.
pub(crate) struct Tollgate<C: tollgate::clock::Clock = tollgate::clock::MonotonicClock>(
    pub(crate) RateLimiter<u64, C>,
);

impl<C: tollgate::clock::Clock> Check for Tollgate<C> {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check(&key).is_allowed()
    }

    fn rebuilds(&self) -> Option<u64> {
        Some(self.0.stats().resizes)
    }
}

/// A keyed governor limiter on `u64` keys, on its default clock or another (the frozen
/// rows use `FakeRelativeClock`).
pub(crate) struct Governor<C: governor::clock::Clock = DefaultClock>(pub(crate) GovernorLimiter<C>);

/// governor's keyed limiter on `u64` keys.
pub(crate) type GovernorLimiter<C> = governor::RateLimiter<
    u64,
    DefaultKeyedStateStore<u64>,
    C,
    NoOpMiddleware<<C as governor::clock::Clock>::Instant>,
>;

impl<C: governor::clock::Clock + Sync> Check for Governor<C> {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check_key(&key).is_ok()
    }
}

/// A tollgate check preceded by what publishing the configuration through a
/// crossbeam-epoch pointer would add: pinning the thread and loading the pointer.
pub(crate) struct EpochPublished {
    pub(crate) limiter: RateLimiter<u64>,
    pub(crate) config: crossbeam_epoch::Atomic<Quota>,
}

impl Check for EpochPublished {
    #[inline]
    fn check(&self, key: u64) -> bool {
        let guard = crossbeam_epoch::pin();
        let config = self
            .config
            .load(std::sync::atomic::Ordering::Acquire, &guard);
        black_box(config);
        self.limiter.check(&key).is_allowed()
    }
}

/// A quota so high that checks pass, for each algorithm within its limit cap: T = 1ns and
/// a burst of 10^9 for the buckets, 10^7 per second for the window counters, and 4,096 per
/// second (its cap; 32 KiB per key) for the sliding log.
pub(crate) fn generous(algorithm: Algorithm) -> Quota {
    match algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            Quota::per_second(1_000_000_000).and_then(|q| q.with_burst(1_000_000_000))
        }
        Algorithm::SlidingWindow | Algorithm::FixedWindow => Quota::per_second(10_000_000),
        Algorithm::SlidingLog => Quota::per_second(4_096),
    }
    .expect("valid quota")
}

pub(crate) fn tollgate(algorithm: Algorithm, quota: Quota) -> RateLimiter<u64> {
    RateLimiter::builder(quota)
        .algorithm(algorithm)
        .build()
        .expect("valid limiter")
}

/// Governor's quota for the keyed benches: T = 1 ns, a burst of 10^9.
pub(crate) fn governor_quota() -> governor::Quota {
    governor::Quota::with_period(Duration::from_nanos(1))
        .expect("non-zero period")
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("non-zero"))
}

pub(crate) fn governor() -> Governor {
    Governor(governor::RateLimiter::keyed(governor_quota()))
}

/// Every tollgate algorithm, then governor, each built by `quota`.
pub(crate) fn contenders(quota: fn(Algorithm) -> Quota) -> Vec<(&'static str, Box<dyn Check>)> {
    let mut all: Vec<(&'static str, Box<dyn Check>)> = Algorithm::ALL
        .into_iter()
        .map(|a| {
            (
                a.name(),
                Box::new(Tollgate(tollgate(a, quota(a)))) as Box<dyn Check>,
            )
        })
        .collect();
    all.push(("governor", Box::new(governor())));
    all
}

/// `SEQUENCE` keys drawn uniformly from `0..keys` (xorshift64*, fixed seed: every
/// contender sees the same sequence).
pub(crate) fn key_sequence(seed: u64, keys: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..SEQUENCE)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d) % keys
        })
        .collect()
}

/// A check as a workload sees it: `(thread, iteration) -> allowed`.
pub(crate) type CheckFn<'a> = dyn Fn(usize, usize) -> bool + Sync + 'a;

/// Runs `iters` calls of `check(thread, i)` on each of `threads` threads at once; returns
/// the slowest thread's time, so the figure is time per check per thread.
pub(crate) fn run_threads(
    threads: usize,
    iters: u64,
    check: &(dyn Fn(usize, usize) -> bool + Sync),
) -> Duration {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for i in 0..iters as usize {
                        black_box(check(thread, i));
                    }
                    t0.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .max()
            .unwrap_or_default()
    })
}

pub(crate) fn key_sequences() -> Vec<Vec<u64>> {
    (1..=2)
        .map(|t| key_sequence(0x9e37_79b9 * t, KEYS))
        .collect()
}

pub(crate) type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// Benches `limiter` on `threads` threads over the shared key sequences, after touching
/// every key once.
pub(crate) fn bench_keyed(
    group: &mut Group<'_>,
    id: BenchmarkId,
    limiter: &dyn Check,
    threads: usize,
    keys: &[Vec<u64>],
) {
    bench_keyed_set(group, id, limiter, threads, keys, KEYS);
}

/// As [`bench_keyed`], over a set of `set` keys.
pub(crate) fn bench_keyed_set(
    group: &mut Group<'_>,
    id: BenchmarkId,
    limiter: &dyn Check,
    threads: usize,
    keys: &[Vec<u64>],
    set: u64,
) {
    for key in 0..set {
        limiter.check(key);
    }
    bench_sequences(group, id, limiter, threads, keys);
}

/// Benches `limiter`, whose keys exist, on `threads` threads over the key sequences.
pub(crate) fn bench_sequences(
    group: &mut Group<'_>,
    id: BenchmarkId,
    limiter: &dyn Check,
    threads: usize,
    keys: &[Vec<u64>],
) {
    let check = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
    group.bench_function(id, |b| {
        b.iter_custom(|iters| run_threads(threads, iters, &check))
    });
}

/// Times `n` contenders over `rounds` rounds, each round in a rotated order, so that the
/// machine's drift cancels out of their ratios: each contender's time per round (`time`
/// of its index), in round order.
pub(crate) fn alternate(
    n: usize,
    rounds: usize,
    mut time: impl FnMut(usize) -> f64,
) -> Vec<Vec<f64>> {
    let mut times = vec![Vec::with_capacity(rounds); n];
    for round in 0..rounds {
        for i in 0..n {
            let which = (round + i) % n;
            times[which].push(time(which));
        }
    }
    times
}

/// Prints contender `b` against `a` from their times per round (as [`alternate`] gives
/// them): the median ratio per round, its quartiles and range, and both median times.
pub(crate) fn print_ratio(label: &str, (a_name, a): (&str, &[f64]), (b_name, b): (&str, &[f64])) {
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let quantile = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let ratios = sorted(a.iter().zip(b).map(|(a, b)| b / a).collect());
    let (a, b) = (sorted(a.to_vec()), sorted(b.to_vec()));
    println!(
        "{label}: {b_name} / {a_name} {:.3} (quartiles {:.3}–{:.3}, range {:.3}–{:.3}); {:.1} ns vs {:.1} ns (medians)",
        quantile(&ratios, 0.5),
        quantile(&ratios, 0.25),
        quantile(&ratios, 0.75),
        ratios[0],
        ratios[ratios.len() - 1],
        quantile(&b, 0.5),
        quantile(&a, 0.5),
    );
}
