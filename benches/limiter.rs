//! The single criterion entry point: tollgate and its peers on the same workloads, in the
//! same run. Figures are nanoseconds per check per thread; see benches/README.md.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group};
use governor::clock::DefaultClock;
use governor::state::keyed::DefaultKeyedStateStore;

/// Number of distinct keys in the keyed workloads.
const KEYS: u64 = 10_000;
/// Length of the pre-drawn key sequence (a power of two, so indexing is a mask).
const SEQUENCE: usize = 1 << 16;

/// A limiter under test, reduced to "check this key".
trait Check: Sync {
    fn check(&self, key: u64) -> bool;
}

struct Tollgate(tollgate::RateLimiter<u64>);

impl Check for Tollgate {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check(&key).is_allowed()
    }
}

struct Governor(governor::RateLimiter<u64, DefaultKeyedStateStore<u64>, DefaultClock>);

impl Check for Governor {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check_key(&key).is_ok()
    }
}

/// tollgate's two algorithms and governor, with rates so high that checks pass: T = 1ns
/// and a burst of 10^9 for both GCRAs, 10^7 per second per key for the sliding window
/// (whose limit is capped at 2^24 − 1).
fn contenders() -> Vec<(&'static str, Box<dyn Check>)> {
    let ours = |algorithm: tollgate::Algorithm| {
        let quota = match algorithm {
            tollgate::Algorithm::SlidingWindow => tollgate::Quota::per_second(10_000_000),
            _ => {
                tollgate::Quota::per_second(1_000_000_000).and_then(|q| q.with_burst(1_000_000_000))
            }
        }
        .expect("valid quota");
        let limiter = tollgate::RateLimiter::builder(quota)
            .algorithm(algorithm)
            .build()
            .expect("valid limiter");
        (
            algorithm.name(),
            Box::new(Tollgate(limiter)) as Box<dyn Check>,
        )
    };
    let gov_quota = governor::Quota::with_period(Duration::from_nanos(1))
        .expect("non-zero period")
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("non-zero"));
    vec![
        ours(tollgate::Algorithm::TokenBucket),
        ours(tollgate::Algorithm::SlidingWindow),
        (
            "governor",
            Box::new(Governor(governor::RateLimiter::keyed(gov_quota))),
        ),
    ]
}

/// Uniformly random keys in `0..KEYS` (xorshift64*, fixed seed: both contenders see the
/// same sequence).
fn key_sequence(seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..SEQUENCE)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d) % KEYS
        })
        .collect()
}

/// Runs `iters` checks over `keys` on `threads` threads at once; returns the slowest
/// thread's time, so the figure is time per check per thread.
fn run_threads(limiter: &dyn Check, threads: usize, iters: u64, keys: &[Vec<u64>]) -> Duration {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = keys[..threads]
            .iter()
            .map(|keys| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for i in 0..iters as usize {
                        black_box(limiter.check(keys[i & (SEQUENCE - 1)]));
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

fn keyed_10k(c: &mut Criterion) {
    let keys: Vec<Vec<u64>> = (1..=2).map(|t| key_sequence(0x9e37_79b9 * t)).collect();
    let mut group = c.benchmark_group("keyed_10k_u64");
    for threads in [1, 2] {
        for (name, limiter) in contenders() {
            for key in 0..KEYS {
                limiter.check(key);
            }
            group.bench_function(BenchmarkId::new(name, format!("{threads}_thread")), |b| {
                b.iter_custom(|iters| run_threads(&*limiter, threads, iters, &keys))
            });
        }
    }
    group.finish();
}

/// Resident set size of this process, in bytes (Linux `VmRSS`).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Environment variable that turns a run of this binary into one memory probe.
const PROBE: &str = "TOLLGATE_MEMORY_PROBE";

/// In a fresh process: builds `name`'s limiter, touches `keys` distinct keys, and prints
/// the growth of resident memory per key.
fn memory_probe(spec: &str) {
    let (name, keys) = spec.split_once(':').expect("PROBE is name:keys");
    let keys: u64 = keys.parse().expect("key count");
    let limiter = contenders()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, l)| l)
        .expect("known contender");
    let before = resident_bytes().expect("/proc/self/status");
    for key in 0..keys {
        black_box(limiter.check(key.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    }
    let after = resident_bytes().expect("/proc/self/status");
    println!("{}", (after - before) as f64 / keys as f64);
}

/// Resident bytes per key for each contender, each count measured in a fresh process.
fn memory_per_key(quick: bool) {
    let counts: &[u64] = if quick {
        &[10_000]
    } else {
        &[600_000, 1_000_000, 1_500_000]
    };
    let exe = std::env::current_exe().expect("bench binary path");
    println!("\nmemory: resident bytes per u64 key (fresh process per count)");
    for (name, _) in contenders() {
        let per_key: Vec<f64> = counts
            .iter()
            .map(|keys| {
                let out = std::process::Command::new(&exe)
                    .env(PROBE, format!("{name}:{keys}"))
                    .output()
                    .expect("run memory probe");
                String::from_utf8_lossy(&out.stdout)
                    .trim()
                    .parse()
                    .expect("probe output")
            })
            .collect();
        let mean = per_key.iter().sum::<f64>() / per_key.len() as f64;
        let each: Vec<String> = per_key.iter().map(|b| format!("{b:.1}")).collect();
        println!(
            "memory/{name:<15} mean {mean:6.1} B/key   [{}] at {counts:?} keys",
            each.join(", ")
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = keyed_10k
}

fn main() {
    if let Ok(spec) = std::env::var(PROBE) {
        memory_probe(&spec);
        return;
    }
    benches();
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    memory_per_key(quick);
    Criterion::default().configure_from_args().final_summary();
}
