//! The single criterion entry point: tollgate and its peers on the same workloads, in the
//! same run. Figures are nanoseconds per check per thread; see benches/README.md.
//!
//! Run as `TOLLGATE_MEMORY_PROBE=<name>:<keys> <bench binary>`, the binary measures one
//! contender's resident memory per key in a fresh process instead.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group};
use governor::clock::DefaultClock;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use tollgate::{Algorithm, Quota, RateLimiter};

#[path = "support/reference.rs"]
mod reference;

/// Number of distinct keys in the keyed workloads.
const KEYS: u64 = 10_000;
/// Length of the pre-drawn key sequence (a power of two, so indexing is a mask).
const SEQUENCE: usize = 1 << 16;

/// A limiter under test, reduced to "check this key".
trait Check: Sync {
    fn check(&self, key: u64) -> bool;

    /// The table rebuilds so far, for the contenders that count them (tollgate's
    /// `stats().resizes`).
    fn rebuilds(&self) -> Option<u64> {
        None
    }
}

/// A tollgate limiter on `u64` keys, on its default clock or another.
struct Tollgate<C: tollgate::clock::Clock = tollgate::clock::MonotonicClock>(RateLimiter<u64, C>);

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
struct Governor<C: governor::clock::Clock = DefaultClock>(
    governor::RateLimiter<u64, DefaultKeyedStateStore<u64>, C, NoOpMiddleware<C::Instant>>,
);

impl<C: governor::clock::Clock + Sync> Check for Governor<C> {
    #[inline]
    fn check(&self, key: u64) -> bool {
        self.0.check_key(&key).is_ok()
    }
}

/// A tollgate check preceded by what publishing the configuration through a
/// crossbeam-epoch pointer would add: pinning the thread and loading the pointer.
struct EpochPublished {
    limiter: RateLimiter<u64>,
    config: crossbeam_epoch::Atomic<Quota>,
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
fn generous(algorithm: Algorithm) -> Quota {
    match algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            Quota::per_second(1_000_000_000).and_then(|q| q.with_burst(1_000_000_000))
        }
        Algorithm::SlidingWindow | Algorithm::FixedWindow => Quota::per_second(10_000_000),
        Algorithm::SlidingLog => Quota::per_second(4_096),
    }
    .expect("valid quota")
}

fn tollgate(algorithm: Algorithm, quota: Quota) -> RateLimiter<u64> {
    RateLimiter::builder(quota)
        .algorithm(algorithm)
        .build()
        .expect("valid limiter")
}

/// Governor's quota for the keyed benches: T = 1 ns, a burst of 10^9.
fn governor_quota() -> governor::Quota {
    governor::Quota::with_period(Duration::from_nanos(1))
        .expect("non-zero period")
        .allow_burst(NonZeroU32::new(1_000_000_000).expect("non-zero"))
}

fn governor() -> Governor {
    Governor(governor::RateLimiter::keyed(governor_quota()))
}

/// Every tollgate algorithm, then governor, each built by `quota`.
fn contenders(quota: fn(Algorithm) -> Quota) -> Vec<(&'static str, Box<dyn Check>)> {
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
fn key_sequence(seed: u64, keys: u64) -> Vec<u64> {
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
type CheckFn<'a> = dyn Fn(usize, usize) -> bool + Sync + 'a;

/// Runs `iters` calls of `check(thread, i)` on each of `threads` threads at once; returns
/// the slowest thread's time, so the figure is time per check per thread.
fn run_threads(
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

fn key_sequences() -> Vec<Vec<u64>> {
    (1..=2)
        .map(|t| key_sequence(0x9e37_79b9 * t, KEYS))
        .collect()
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// Benches `limiter` on `threads` threads over the shared key sequences, after touching
/// every key once.
fn bench_keyed(
    group: &mut Group<'_>,
    id: BenchmarkId,
    limiter: &dyn Check,
    threads: usize,
    keys: &[Vec<u64>],
) {
    bench_keyed_set(group, id, limiter, threads, keys, KEYS);
}

/// As [`bench_keyed`], over a set of `set` keys.
fn bench_keyed_set(
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
fn bench_sequences(
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

/// 10k `u64` keys, uniformly random, on 1 and 2 threads: every algorithm and governor.
fn keyed_10k(c: &mut Criterion) {
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
enum Settling {
    CheckN,
    Charge,
    Refund,
}

/// A tollgate limiter driven by one kind of settlement.
struct Settles(RateLimiter<u64>, Settling);

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
fn settle_10k(c: &mut Criterion) {
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
fn also_10k(c: &mut Criterion) {
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
fn one_and_two_quotas() -> (Tollgate, Tollgate) {
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
fn churn_1k(c: &mut Criterion) {
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
fn reference_10k(c: &mut Criterion) {
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
fn config_read(c: &mut Criterion) {
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
fn counters(c: &mut Criterion) {
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
fn hot_key_denied(c: &mut Criterion) {
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
fn string_keys(c: &mut Criterion) {
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

/// One thread, 1M `u64` keys: every check misses the caches.
fn keyed_1m(c: &mut Criterion) {
    const MILLION: u64 = 1_000_000;
    let keys = key_sequence(0xfeed, MILLION);
    let ours = Tollgate(tollgate(
        Algorithm::TokenBucket,
        generous(Algorithm::TokenBucket),
    ));
    let gov = governor();
    let mut group = c.benchmark_group("keyed_1m_u64");
    group.sample_size(20);
    for (name, limiter) in [("token-bucket", &ours as &dyn Check), ("governor", &gov)] {
        for key in 0..MILLION {
            limiter.check(key);
        }
        let check = |_: usize, i: usize| limiter.check(keys[i & (SEQUENCE - 1)]);
        group.bench_function(BenchmarkId::new(name, "1_thread"), |b| {
            b.iter_custom(|iters| run_threads(1, iters, &check))
        });
    }
    group.finish();
}

/// The way a Redis token bucket is usually written, as the baseline for ours: the client
/// passes its clock in seconds, tokens are floats in a hash, every call writes.
#[cfg(feature = "redis")]
/// The issue's peer for the plain path: a minimal GCRA that a user would write, with the
/// server's `TIME`, one `GET`, and a `SET` with a TTL on admission (exact integers, as
/// tollgate's script keeps them), returning only whether it admitted.
const BARE_GCRA: &str = r"
local t, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local tat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now)
local new = tat + t
if new - now > tau + t then
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', string.format('%.0f', math.ceil((new - now) / 1000)))
return 1
";

const COMMON_LUA_TOKEN_BUCKET: &str = r"
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local requested = tonumber(ARGV[4])
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'last_updated')
local tokens = tonumber(bucket[1]) or capacity
local last = tonumber(bucket[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - last) * rate)
local allowed = 0
if tokens >= requested then
  tokens = tokens - requested
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'last_updated', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate))
return {allowed, math.floor(tokens)}
";

/// A throwaway redis-server and a tokio runtime with `workers` threads, or `None` (with a
/// message naming `group`) when redis-server is not installed.
#[cfg(feature = "redis")]
fn redis_and_runtime(
    group: &str,
    workers: usize,
) -> Option<(tollgate_testing::LocalRedis, tokio::runtime::Runtime)> {
    let server = tollgate_testing::LocalRedis::start()
        .map_err(|e| eprintln!("{group} skipped: {e}"))
        .ok()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    Some((server, runtime))
}

/// 10^6 per second per key with an equal burst: checks pass, and the interval is a whole
/// microsecond, as the Redis scripts need.
#[cfg(feature = "redis")]
fn redis_quota() -> Quota {
    Quota::per_second(1_000_000)
        .and_then(|q| q.with_burst(1_000_000))
        .expect("valid quota")
}

/// A check through the Redis tier against the common Lua token bucket and a bare GCRA
/// script (EVALSHA over the same kind of connection), with 1, 16 and 64 requests in
/// flight, every check admitted, and a local check for scale. Needs `redis-server` (./scripts/test.sh installs it).
#[cfg(feature = "redis")]
fn redis_tier(c: &mut Criterion) {
    use std::sync::Arc;
    use tollgate::redis::RedisLimiter;

    let Some((server, runtime)) = redis_and_runtime("redis_tier", 2) else {
        return;
    };
    let quota = redis_quota();
    let ours = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    // The same quota and a second one (`also`, 864M a day: T = 100 µs), decided in the
    // same script call; every check is admitted by both.
    let two_quotas = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .also("864000000/day".parse().expect("valid quota"))
                .prefix("two")
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    let connection = runtime
        .block_on(async {
            let client = redis::Client::open(server.url())?;
            redis::aio::ConnectionManager::new(client).await
        })
        .expect("connect");
    let baseline = Arc::new(redis::Script::new(COMMON_LUA_TOKEN_BUCKET));
    let bare = Arc::new(redis::Script::new(BARE_GCRA));
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());
    let order = Arc::new(key_sequence(0xbeef, KEYS));
    let start = Instant::now();

    // One call of each kind, on the i-th key of the shared sequence.
    let call_ours = {
        let (ours, names, order) = (ours.clone(), names.clone(), order.clone());
        move |i: usize| {
            let (ours, names, order) = (ours.clone(), names.clone(), order.clone());
            async move {
                let key = &names[order[i & (SEQUENCE - 1)] as usize];
                ours.check(key).await.expect("redis check").is_allowed()
            }
        }
    };
    let call_two = {
        let (two_quotas, names, order) = (two_quotas.clone(), names.clone(), order.clone());
        move |i: usize| {
            let (two_quotas, names, order) = (two_quotas.clone(), names.clone(), order.clone());
            async move {
                let key = &names[order[i & (SEQUENCE - 1)] as usize];
                two_quotas
                    .check(key)
                    .await
                    .expect("redis check")
                    .is_allowed()
            }
        }
    };
    let call_baseline = {
        let (connection, baseline, names, order) = (
            connection.clone(),
            baseline.clone(),
            names.clone(),
            order.clone(),
        );
        move |i: usize| {
            let (mut connection, baseline, names, order) = (
                connection.clone(),
                baseline.clone(),
                names.clone(),
                order.clone(),
            );
            async move {
                let key = format!("common:{}", names[order[i & (SEQUENCE - 1)] as usize]);
                let reply: Vec<i64> = baseline
                    .key(key)
                    .arg(1_000_000)
                    .arg(1_000_000)
                    .arg(start.elapsed().as_secs_f64())
                    .arg(1)
                    .invoke_async(&mut connection)
                    .await
                    .expect("baseline script");
                reply[0] == 1
            }
        }
    };

    // The bare GCRA at the same quota: T and tau in µs.
    let t_us = (quota.emission_interval().as_nanos() / 1_000).max(1) as u64;
    let tau_us = t_us * (quota.burst() - 1);
    let call_bare = {
        let (connection, bare, names, order) = (
            connection.clone(),
            bare.clone(),
            names.clone(),
            order.clone(),
        );
        move |i: usize| {
            let (mut connection, bare, names, order) = (
                connection.clone(),
                bare.clone(),
                names.clone(),
                order.clone(),
            );
            async move {
                let key = format!("bare:{}", names[order[i & (SEQUENCE - 1)] as usize]);
                let reply: i64 = bare
                    .key(key)
                    .arg(t_us)
                    .arg(tau_us)
                    .invoke_async(&mut connection)
                    .await
                    .expect("bare script");
                reply == 1
            }
        }
    };

    let mut group = c.benchmark_group("redis_tier");
    group.sample_size(20);
    for in_flight in [1usize, 16, 64] {
        let id = |name: &str| BenchmarkId::new(name, format!("{in_flight}_in_flight"));
        group.bench_function(id("tollgate_script"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_ours.clone()))
            })
        });
        group.bench_function(id("tollgate_two_quotas"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_two.clone()))
            })
        });
        group.bench_function(id("common_lua_baseline"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_baseline.clone()))
            })
        });
        group.bench_function(id("bare_gcra"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_bare.clone()))
            })
        });
    }
    // What each script costs the server itself, from Redis's own accounting.
    let mut admin = connection.clone();
    type BoxedCall =
        Box<dyn Fn(usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>>>;
    let (ours_call, two_call, baseline_call, bare_call) = (
        call_ours.clone(),
        call_two.clone(),
        call_baseline.clone(),
        call_bare.clone(),
    );
    let calls: [(&str, BoxedCall); 4] = [
        ("tollgate_script", Box::new(move |i| Box::pin(ours_call(i)))),
        (
            "tollgate_two_quotas",
            Box::new(move |i| Box::pin(two_call(i))),
        ),
        (
            "common_lua_baseline",
            Box::new(move |i| Box::pin(baseline_call(i))),
        ),
        ("bare_gcra", Box::new(move |i| Box::pin(bare_call(i)))),
    ];
    for (name, call) in calls {
        let calls = 20_000;
        let per_call = runtime.block_on(async {
            evalsha_usec_per_call(&mut admin).await;
            for i in 0..calls {
                black_box(call(i).await);
            }
            evalsha_usec_per_call(&mut admin).await
        });
        println!(
            "redis_tier/server_cost/{name}: {per_call:.2} µs of server time per call (INFO commandstats, {calls} calls)"
        );
    }
    alternating_rounds(
        &runtime,
        &mut admin,
        ("tollgate", &call_ours),
        ("bare", &call_bare),
    );
    alternating_rounds(
        &runtime,
        &mut admin,
        ("two_quotas", &call_two),
        ("one_quota", &call_ours),
    );
    let local = tollgate(Algorithm::TokenBucket, quota);
    group.bench_function(BenchmarkId::new("local_rate_limiter", "1_thread"), |b| {
        b.iter_custom(|iters| {
            let t0 = Instant::now();
            for i in 0..iters as usize {
                black_box(local.check(&order[i & (SEQUENCE - 1)]));
            }
            t0.elapsed()
        })
    });
    group.finish();
}

/// µs of server time per `EVALSHA` since the previous call (Redis's own accounting, `INFO
/// commandstats`), which it then resets (`CONFIG RESETSTAT`); NaN if Redis counted none.
#[cfg(feature = "redis")]
async fn evalsha_usec_per_call(admin: &mut redis::aio::ConnectionManager) -> f64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("info");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .expect("resetstat");
    stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec_per_call=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Two kinds of call (`ours` against `theirs`, each with its name; tollgate's script
/// against the bare GCRA, or two quotas against one) in alternating rounds at 1, 16 and
/// 64 in flight: on this VM a criterion group runs one contender for seconds and then
/// the other, and the machine's load moves between them by more than the gap measured,
/// so the ratio is also taken round by round, each round timing the same calls of both
/// back to back. Prints the median of the rounds' throughput ratios (their time / our
/// time) and of each script's server time per call (`INFO commandstats`, reset before
/// each half).
#[cfg(feature = "redis")]
fn alternating_rounds<O, OF, B, BF>(
    runtime: &tokio::runtime::Runtime,
    admin: &mut redis::aio::ConnectionManager,
    (ours_name, ours): (&str, &O),
    (bare_name, bare): (&str, &B),
) where
    O: Fn(usize) -> OF + Clone + Send + 'static,
    OF: std::future::Future<Output = bool> + Send + 'static,
    B: Fn(usize) -> BF + Clone + Send + 'static,
    BF: std::future::Future<Output = bool> + Send + 'static,
{
    let quick = std::env::args().any(|a| a == "--test");
    let rounds = if quick { 1 } else { 10 };
    let mut server_time = || runtime.block_on(evalsha_usec_per_call(admin));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for in_flight in [1usize, 16, 64] {
        let calls = if quick {
            64
        } else if in_flight == 1 {
            3_000
        } else {
            30_000
        } as u64;
        let (mut ratios, mut ours_us, mut bare_us) = (Vec::new(), Vec::new(), Vec::new());
        server_time();
        for _ in 0..rounds {
            let ours_time = runtime.block_on(run_in_flight(calls, in_flight, ours.clone()));
            ours_us.push(server_time());
            let bare_time = runtime.block_on(run_in_flight(calls, in_flight, bare.clone()));
            bare_us.push(server_time());
            ratios.push(bare_time.as_secs_f64() / ours_time.as_secs_f64());
        }
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let (ours_us, bare_us) = (median(ours_us), median(bare_us));
        println!(
            "redis_tier/alternating/{in_flight}_in_flight: throughput {ours_name} / {bare_name} {:.3} (median of {rounds} rounds, {lo:.3}–{hi:.3}); server µs per call {ours_us:.2} vs {bare_us:.2} ({:.3}×)",
            median(ratios),
            ours_us / bare_us
        );
    }
}

/// `RedisLimiter` checks per second on a 3-master Redis Cluster (no replicas) against one
/// Redis, in the same run, with 1 and 50 checks in flight, on 10,000 keys. Needs
/// `redis-server` and `redis-cli`.
#[cfg(feature = "redis")]
fn redis_cluster(c: &mut Criterion) {
    use std::sync::Arc;
    use tollgate::redis::RedisLimiter;
    use tollgate_testing::LocalCluster;

    let Some((server, runtime)) = redis_and_runtime("redis_cluster", 2) else {
        return;
    };
    let cluster = match LocalCluster::start(3, 0, Duration::from_secs(2)) {
        Ok(cluster) => cluster,
        Err(e) => return eprintln!("redis_cluster skipped: {e}"),
    };
    let quota = redis_quota();
    let seeds = cluster.urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let single = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    let clustered = runtime
        .block_on(
            RedisLimiter::cluster_builder(&seeds, quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect to the cluster");
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());
    let order = Arc::new(key_sequence(0xc1, KEYS));
    let call = |limiter: RedisLimiter| {
        let (names, order) = (names.clone(), order.clone());
        move |i: usize| {
            let (limiter, names, order) = (limiter.clone(), names.clone(), order.clone());
            async move {
                let key = &names[order[i & (SEQUENCE - 1)] as usize];
                limiter.check(key).await.expect("redis check").is_allowed()
            }
        }
    };
    let mut group = c.benchmark_group("redis_cluster");
    group.sample_size(20);
    for in_flight in [1usize, 50] {
        let id = |name: &str| BenchmarkId::new(name, format!("{in_flight}_in_flight"));
        let (one, three) = (call(single.clone()), call(clustered.clone()));
        group.bench_function(id("single_redis"), |b| {
            b.iter_custom(|iters| runtime.block_on(run_in_flight(iters, in_flight, one.clone())))
        });
        group.bench_function(id("cluster_3_masters"), |b| {
            b.iter_custom(|iters| runtime.block_on(run_in_flight(iters, in_flight, three.clone())))
        });
    }
    group.finish();
}

/// Makes `iters` calls with `in_flight` of them outstanding at any time; returns the
/// elapsed time (so the figure is the time per call at that concurrency).
#[cfg(feature = "redis")]
async fn run_in_flight<F, Fut>(iters: u64, in_flight: usize, call: F) -> Duration
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..in_flight {
        let call = call.clone();
        let share = iters as usize / in_flight + usize::from(lane < iters as usize % in_flight);
        tasks.spawn(async move {
            for j in 0..share {
                black_box(call(j * in_flight + lane).await);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    t0.elapsed()
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

/// Names the probes printed after the criterion groups to run (comma-separated: `memory`,
/// `reclamation`, `growth`, `quota_change`); all of them if unset.
const PROBES: &str = "TOLLGATE_PROBES";

/// The quota of the memory probes: a typical "100/s". Only the sliding log's memory
/// depends on it (8 bytes per unit of limit).
fn typical(_: Algorithm) -> Quota {
    Quota::per_second(100).expect("valid quota")
}

/// In a fresh process: builds `name`'s limiter, touches `keys` distinct keys, and prints
/// the growth of resident memory per key.
fn memory_probe(spec: &str) {
    let (name, keys) = spec.split_once(':').expect("PROBE is name:keys");
    let keys: u64 = keys.parse().expect("key count");
    let limiter = contenders(typical)
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
    println!("\nmemory: resident bytes per u64 key at 100/s (fresh process per count)");
    for (name, _) in contenders(typical) {
        let per_key: Vec<f64> = counts
            .iter()
            .map(|keys| {
                in_fresh_process(PROBE, format!("{name}:{keys}"))
                    .parse()
                    .expect("probe output")
            })
            .collect();
        let mean = per_key.iter().sum::<f64>() / per_key.len() as f64;
        let each: Vec<String> = per_key.iter().map(|b| format!("{b:.1}")).collect();
        println!(
            "memory/{name:<15} mean {mean:7.1} B/key   [{}] at {counts:?} keys",
            each.join(", ")
        );
    }
}

/// Environment variable that turns a run of this binary into one reclamation probe.
const RECLAIM_PROBE: &str = "TOLLGATE_RECLAIM_PROBE";

/// In a fresh process, one of issue 26's experiments on retired tables, with or without a
/// thread that makes one check and then sleeps: `changes` (200,000 keys, then 400
/// default-quota changes, each migrating every shard, with 2,000 checks between them) or
/// `cycles` (10 cycles of growing to 1M keys and removing them all). Prints the resident
/// MB before and after.
fn reclaim_probe(spec: &str) {
    let (scenario, idle) = spec.split_once(':').expect("PROBE is scenario:idle");
    let quick = scenario.ends_with("-quick");
    let limiter: RateLimiter<u64> = RateLimiter::new(Quota::per_second(1000).expect("quota"));
    let (keys, changes, cycles) = if quick {
        (20_000u64, 40u64, 2)
    } else {
        (200_000, 400, 10)
    };
    if scenario.starts_with("changes") {
        for key in 0..keys {
            black_box(limiter.check(&key));
        }
    }
    let idle_thread = (idle == "1").then(|| {
        let idle = limiter.clone();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            black_box(idle.check(&u64::MAX));
            ready_tx.send(()).expect("ready");
            let _ = rx.recv();
        });
        ready_rx.recv().expect("idle thread ready");
        (tx, thread)
    });
    let before = resident_bytes().expect("/proc/self/status");
    if scenario.starts_with("changes") {
        let quotas = [
            Quota::per_second(1000).expect("quota"),
            Quota::per_second(2000).expect("quota"),
        ];
        for change in 0..changes {
            limiter
                .set_default_quota(quotas[(change % 2) as usize])
                .expect("same algorithm");
            for i in 0..2_000 {
                black_box(limiter.check(&((change * 2_000 + i) % keys)));
            }
        }
    } else {
        let top = if quick { 100_000u64 } else { 1_000_000 };
        for _ in 0..cycles {
            for key in 0..top {
                black_box(limiter.check(&key));
            }
            for key in 0..top {
                limiter.reset(&key);
            }
        }
    }
    let after = resident_bytes().expect("/proc/self/status");
    println!("{:.1} {:.1}", before as f64 / 1e6, after as f64 / 1e6);
    drop(idle_thread);
}

/// Issue 26's experiments on retired tables, each in a fresh process, without and with an
/// idle thread: resident MB before and after, and the ratio of the two runs' final RSS.
fn reclamation_memory(quick: bool) {
    println!("\nreclamation: resident MB before -> after, without and with an idle thread");
    for scenario in ["changes", "cycles"] {
        let scenario = if quick {
            format!("{scenario}-quick")
        } else {
            scenario.to_owned()
        };
        let run = |idle: &str| -> (f64, f64) {
            let text = in_fresh_process(RECLAIM_PROBE, format!("{scenario}:{idle}"));
            let mut numbers = text.split_whitespace().map(|n| n.parse().expect("MB"));
            (
                numbers.next().expect("before"),
                numbers.next().expect("after"),
            )
        };
        let (plain, idle) = (run("0"), run("1"));
        println!(
            "reclamation/{scenario:<14} no idle thread {:7.1} -> {:7.1} MB   idle thread {:7.1} -> {:7.1} MB   ratio {:.3}",
            plain.0,
            plain.1,
            idle.0,
            idle.1,
            idle.1 / plain.1
        );
    }
}

/// The check path of a limiter with background sync (reconcile mode, syncing every 50 ms
/// to a local redis-server) against the same limiter without, in the same run: 10k keys,
/// 1 thread. The keys stay cold (far from their limit), except in `sync_on_hot_keys`,
/// whose limiter has the cold tier off.
#[cfg(feature = "redis")]
fn sync_check(c: &mut Criterion) {
    use tollgate::sync::RedisSync;

    let Some((server, runtime)) = redis_and_runtime("sync_check", 1) else {
        return;
    };
    let quota = redis_quota();
    let plain = tollgate(Algorithm::TokenBucket, quota);
    let (synced, handle) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota).build_synced(RedisSync::new(&server.url()))
        })
        .expect("synced limiter");
    // The same quota twice over (issue 32's several quotas on the synced limiter): each
    // check decides both, all admitted.
    let (synced_two, handle_two) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota)
                .also(quota)
                .build_synced(RedisSync::new(&server.url()).prefix("bench-two-quotas"))
        })
        .expect("synced limiter with two quotas");
    // Every key hot (the cold tier off): a check spends its lease, which it reaches
    // through the cell's box, where a cold key's check reads only its 24-byte entry.
    let (synced_hot, handle_hot) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota).build_synced(
                RedisSync::new(&server.url())
                    .cold_keys(false)
                    .prefix("bench-hot-keys"),
            )
        })
        .expect("synced limiter without the cold tier");
    let keys = key_sequence(0x5ca1e, KEYS);
    let mut group = c.benchmark_group("sync_check");
    let mut allowed = Vec::new();
    let mut run = |name: &str, check: &dyn Fn(&u64) -> bool| {
        // The closure is called through `dyn`, but `check` itself is inlined into it, so
        // both limiters pay the same call.
        for key in 0..KEYS {
            check(&key);
        }
        group.bench_function(BenchmarkId::new(name, "1_thread"), |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for i in 0..iters as usize {
                    black_box(check(&keys[i & (SEQUENCE - 1)]));
                }
                t0.elapsed()
            })
        });
        let admitted = (0..1_000_000)
            .filter(|i| check(&keys[i & (SEQUENCE - 1)]))
            .count();
        allowed.push(format!(
            "sync_check/{name}: {admitted} of 1000000 checks allowed right after the run"
        ));
    };
    run("sync_off", &|key| plain.check(key).is_allowed());
    run("sync_on", &|key| synced.check(key).is_allowed());
    run("sync_on_hot_keys", &|key| {
        synced_hot.check(key).is_allowed()
    });
    run("sync_on_two_quotas", &|key| {
        synced_two.check(key).is_allowed()
    });
    // Settlements on the synced limiter against its own `check_n` (issue 32: no more
    // than `check_n` in the same run); the quota is generous enough (10^6/s a key) that
    // no key goes into debt over the run.
    run("sync_on_check_n", &|key| {
        synced.check_n(key, 1).is_ok_and(|d| d.is_allowed())
    });
    run("sync_on_charge", &|key| {
        synced.charge(key, 1).is_ok_and(|d| d.is_allowed())
    });
    run("sync_on_refund", &|key| {
        synced.refund(key, 1).is_ok_and(|d| d.is_allowed())
    });
    group.finish();
    for line in allowed {
        println!("{line}");
    }
    println!("sync_check/stats: {:?}", handle.stats());
    println!("sync_check/stats, hot keys: {:?}", handle_hot.stats());
    runtime.block_on(handle.shutdown());
    runtime.block_on(handle_two.shutdown());
    runtime.block_on(handle_hot.shutdown());
}

#[cfg(not(feature = "redis"))]
fn sync_check(_: &mut Criterion) {}

/// A request through the HTTP layer (keyed by peer address, 10k addresses, quota high
/// enough to admit) against the same tower service without a limiter, and with
/// tower_governor's layer keyed the same way, in-process and in the same run.
#[cfg(feature = "tower")]
fn http_layer(c: &mut Criterion) {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    use std::sync::Arc;

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use tower::{Layer, Service, ServiceExt};

    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let handler = tower::service_fn(|_req: http::Request<Body>| async {
        let mut response = http::Response::new(Body::from("hello"));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain"),
        );
        Ok::<_, std::convert::Infallible>(response)
    });
    // 1,000/s with a burst of 1,000 per address: realistic header values, and over a
    // run no address comes near its limit (10k addresses share the requests).
    let quota = Quota::per_second(1_000)
        .and_then(|q| q.with_burst(1_000))
        .expect("valid quota");
    let ours =
        tollgate::http::RateLimitLayer::new(RateLimiter::<String>::new(quota)).layer(handler);
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .per_millisecond(1)
        .burst_size(1_000)
        .key_extractor(tower_governor::key_extractor::PeerIpKeyExtractor)
        .use_headers()
        .finish()
        .expect("a valid tower_governor config");
    let theirs = tower_governor::GovernorLayer::new(Arc::new(config)).layer(handler);
    let peers: Vec<SocketAddr> = key_sequence(0x4777, KEYS)
        .into_iter()
        .map(|k| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + k as u32)), 443))
        .collect();
    let mut group = c.benchmark_group("http_layer");
    fn run<S, B>(
        runtime: &tokio::runtime::Runtime,
        service: &S,
        peers: &[SocketAddr],
        iters: u64,
    ) -> Duration
    where
        S: Service<http::Request<Body>, Response = http::Response<B>> + Clone,
        S::Error: std::fmt::Debug,
    {
        runtime.block_on(async {
            let mut service = service.clone();
            let t0 = Instant::now();
            for i in 0..iters as usize {
                let mut request = http::Request::new(Body::empty());
                request
                    .extensions_mut()
                    .insert(ConnectInfo(peers[i & (SEQUENCE - 1)]));
                let ready = service.ready().await.expect("ready");
                let response = ready.call(request).await.expect("response");
                assert_eq!(response.status(), 200, "the quota admits every request");
                black_box(response);
            }
            t0.elapsed()
        })
    }
    group.bench_function(BenchmarkId::new("without_layer", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &handler, &peers, iters))
    });
    group.bench_function(BenchmarkId::new("with_layer", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &ours, &peers, iters))
    });
    group.bench_function(BenchmarkId::new("tower_governor", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &theirs, &peers, iters))
    });
    group.finish();
}

#[cfg(not(feature = "tower"))]
fn http_layer(_: &mut Criterion) {}

/// Throughput through the HTTP layer over real sockets while one client floods: 16
/// keep-alive HTTP/1.1 connections from 127.0.0.1 (one key, 100/s burst 100, so nearly
/// every request is a 429), against the Redis backend with the deny cache, without it,
/// and the local limiter for scale — client and server in the same 2-thread runtime,
/// in the same run. The figure is the time per request (its inverse, the req/s).
#[cfg(all(feature = "redis", feature = "axum"))]
fn redis_layer_flood(c: &mut Criterion) {
    use std::net::SocketAddr;

    use http_body_util::{BodyExt, Empty};
    use hyper::body::Bytes;
    use tollgate::http::RateLimitLayer;
    use tollgate::redis::{FailMode, RedisLimiter};

    const CONNECTIONS: usize = 16;
    let Some((server, runtime)) = redis_and_runtime("redis_layer_flood", 2) else {
        return;
    };
    let quota = Quota::per_second(100)
        .and_then(|q| q.with_burst(100))
        .expect("valid quota");
    let serve = |layer: RateLimitLayer| {
        runtime.block_on(async {
            let app = axum::Router::new()
                .route("/", axum::routing::get(|| async { "ok" }))
                .layer(layer);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("address");
            tokio::spawn(async move {
                let app = app.into_make_service_with_connect_info::<SocketAddr>();
                axum::serve(listener, app).await.expect("serve");
            });
            addr
        })
    };
    let redis_layer = |cached: bool| {
        let limiter = runtime
            .block_on(
                RedisLimiter::builder(&server.url(), quota)
                    .prefix(if cached {
                        "flood-cached"
                    } else {
                        "flood-uncached"
                    })
                    .local_deny_cache(cached)
                    .timeout(Duration::from_secs(2))
                    .build(),
            )
            .expect("connect");
        RateLimitLayer::redis(limiter, FailMode::Closed)
    };
    let targets = [
        ("redis_deny_cache", serve(redis_layer(true))),
        ("redis_no_cache", serve(redis_layer(false))),
        (
            "local_limiter",
            serve(RateLimitLayer::new(RateLimiter::<String>::new(quota))),
        ),
    ];
    let flood = |addr: SocketAddr, iters: u64| -> Duration {
        runtime.block_on(async move {
            let mut senders = Vec::new();
            for _ in 0..CONNECTIONS {
                let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
                let (sender, connection) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                        .await
                        .expect("handshake");
                tokio::spawn(connection);
                senders.push(sender);
            }
            let t0 = Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for (lane, mut sender) in senders.into_iter().enumerate() {
                let share =
                    iters as usize / CONNECTIONS + usize::from(lane < iters as usize % CONNECTIONS);
                tasks.spawn(async move {
                    for _ in 0..share {
                        let request = http::Request::get("/")
                            .header("host", "bench")
                            .body(Empty::<Bytes>::new())
                            .expect("request");
                        sender.ready().await.expect("ready");
                        let response = sender.send_request(request).await.expect("response");
                        let status = response.status();
                        assert!(status == 200 || status == 429, "{status}");
                        black_box(response.into_body().collect().await.expect("body"));
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            t0.elapsed()
        })
    };
    let mut group = c.benchmark_group("redis_layer_flood");
    group.sample_size(20);
    for (name, addr) in targets {
        group.bench_function(
            BenchmarkId::new(name, format!("{CONNECTIONS}_connections")),
            |b| b.iter_custom(|iters| flood(addr, iters)),
        );
    }
    group.finish();
}

#[cfg(not(all(feature = "redis", feature = "axum")))]
fn redis_layer_flood(_: &mut Criterion) {}

/// What a denied check costs when the deny cache answers it (no round trip), from 1 task
/// and from 2 tasks on 2 worker threads, against the local limiter's hot denied key.
#[cfg(feature = "redis")]
fn redis_cached_deny(c: &mut Criterion) {
    use tollgate::redis::RedisLimiter;

    let Some((server, runtime)) = redis_and_runtime("redis_cached_deny", 2) else {
        return;
    };
    let quota = Quota::per_minute(1).expect("valid quota");
    let limiter = runtime
        .block_on(async {
            let limiter = RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(2))
                .build()
                .await?;
            // Admitted, then denied for a minute: cached from here on.
            limiter.check("hot").await?;
            limiter.check("hot").await?;
            Ok::<_, tollgate::redis::RedisError>(limiter)
        })
        .expect("connect");
    let calls = limiter.stats().calls;
    let local = RateLimiter::<String>::new(quota);
    local.check("hot");
    let mut group = c.benchmark_group("redis_cached_deny");
    for tasks in [1usize, 2] {
        let id = |name: &str| BenchmarkId::new(name, format!("{tasks}_thread"));
        group.bench_function(id("redis_limiter_cached"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let t0 = Instant::now();
                    let mut set = tokio::task::JoinSet::new();
                    for _ in 0..tasks {
                        let limiter = limiter.clone();
                        set.spawn(async move {
                            for _ in 0..iters {
                                let d = limiter.check("hot").await.expect("cached");
                                assert!(!d.is_allowed());
                                black_box(d);
                            }
                        });
                    }
                    while set.join_next().await.is_some() {}
                    t0.elapsed()
                })
            })
        });
        group.bench_function(id("local_limiter"), |b| {
            b.iter_custom(|iters| {
                run_threads(tasks, iters, &|_, _| local.check("hot").is_allowed())
            })
        });
    }
    group.finish();
    assert_eq!(
        limiter.stats().calls,
        calls,
        "every deny came from the cache"
    );
}

#[cfg(not(feature = "redis"))]
fn redis_cached_deny(_: &mut Criterion) {}

#[cfg(not(feature = "redis"))]
fn redis_tier(_: &mut Criterion) {
    eprintln!(
        "redis_tier skipped: run `cargo bench -p tollgate-benches --all-features` to measure the Redis tier"
    );
}

#[cfg(not(feature = "redis"))]
fn redis_cluster(_: &mut Criterion) {}

/// Percentiles of a sample of latencies (ns): p50, p99, p99.99 and the maximum.
fn percentiles(sample: &mut [u32]) -> [u32; 4] {
    sample.sort_unstable();
    let at = |q: f64| sample[((sample.len() - 1) as f64 * q) as usize];
    [
        at(0.5),
        at(0.99),
        at(0.9999),
        sample.last().copied().unwrap_or(0),
    ]
}

/// Runs this bench binary again with `probe` set to `spec` (one of the probes `main`
/// dispatches on), and returns what it printed, trimmed.
fn in_fresh_process(probe: &str, spec: String) -> String {
    let exe = std::env::current_exe().expect("bench binary path");
    let out = std::process::Command::new(exe)
        .env(probe, &spec)
        .output()
        .unwrap_or_else(|e| panic!("{probe}={spec}: {e}"));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Environment variable that turns a run of this binary into one growth run of a
/// contender (`tollgate:keys` or `governor:keys`, or `tollgate-sized` and
/// `governor-sized`, whose tables are sized for the keys when built, or the bare
/// reference design `reference-1`, `reference-8`, `reference-8-doubling`,
/// `reference-8-doubling-4` and `reference-8-doubling-whole`), in a fresh process.
const GROWTH_PROBE: &str = "TOLLGATE_GROWTH_PROBE";

/// The growth workload's contender `name` for `keys` keys (100 per hour: every key stays
/// in use).
fn growth_contender(name: &str, keys: u64) -> Box<dyn Check> {
    const STEP: usize = reference::GROWING_STEP;
    let quota = Quota::per_hour(100).expect("valid quota");
    let governor_quota = governor::Quota::per_hour(NonZeroU32::new(100).expect("non-zero"));
    match name {
        "tollgate" => Box::new(Tollgate(tollgate(Algorithm::TokenBucket, quota))),
        // `Builder::expected_keys`: the tables sized and written when built.
        "tollgate-sized" => Box::new(Tollgate(
            RateLimiter::builder(quota)
                .expected_keys(keys as usize)
                .build()
                .expect("valid limiter"),
        )),
        // The growth's reference design (benches/support/reference.rs), one table or 8:
        // the migration's moves alone, every table built before the run; growing 1.25× as
        // tollgate's tables do, or 2×.
        "reference-1" => Box::new(reference::Growing::new(1, keys, false, STEP)),
        "reference-8" => Box::new(reference::Growing::new(8, keys, false, STEP)),
        "reference-8-doubling" => Box::new(reference::Growing::new(8, keys, true, STEP)),
        // Doubling with 4 slots an insert: more inserts step, each step shorter.
        "reference-8-doubling-4" => Box::new(reference::Growing::new(8, keys, true, 4)),
        // Doubling with the whole table moved by one insert, as governor's tables grow.
        "reference-8-doubling-whole" => {
            Box::new(reference::Growing::new(8, keys, true, usize::MAX))
        }
        // Governor's state store made with room for the keys (`DashMap::with_capacity`).
        "governor-sized" => Box::new(Governor(governor::RateLimiter::new(
            governor_quota,
            dashmap::DashMap::with_capacity_and_hasher(keys as usize, Default::default()),
            DefaultClock::default(),
        ))),
        _ => Box::new(Governor(governor::RateLimiter::keyed(governor_quota))),
    }
}

/// One growth run on `limiter`: `threads` threads, each inserting a new key every 4
/// operations and otherwise checking a key it inserted before, until `keys` keys exist,
/// every operation timed alone. Returns p50, p99, p99.99 and max, for new keys' first
/// checks and existing keys' checks, and the table rebuilds where the contender counts
/// them (issue 30's figure: at most 40 to 2M keys).
fn growth_once(limiter: &dyn Check, keys: u64, threads: u64) -> String {
    let per_thread = keys / threads;
    let start = Barrier::new(threads as usize);
    let (mut new, mut old): (Vec<u32>, Vec<u32>) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let start = &start;
                s.spawn(move || {
                    let mut new = Vec::with_capacity(per_thread as usize);
                    let mut old = Vec::with_capacity(3 * per_thread as usize);
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ thread;
                    start.wait();
                    for i in 0..per_thread {
                        let key = i * threads + thread;
                        let t0 = Instant::now();
                        black_box(limiter.check(key));
                        new.push(t0.elapsed().as_nanos() as u32);
                        for _ in 0..3 {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let key = (x % (i + 1)) * threads + thread;
                            let t0 = Instant::now();
                            black_box(limiter.check(key));
                            old.push(t0.elapsed().as_nanos() as u32);
                        }
                    }
                    (new, old)
                })
            })
            .collect();
        handles
            .into_iter()
            .fold((Vec::new(), Vec::new()), |(mut n, mut o), h| {
                let (a, b) = h.join().expect("growth thread");
                n.extend(a);
                o.extend(b);
                (n, o)
            })
    });
    let [n50, n99, n9999, nmax] = percentiles(&mut new);
    let [o50, o99, o9999, omax] = percentiles(&mut old);
    let rebuilds = limiter
        .rebuilds()
        .map_or_else(String::new, |n| format!("; {n} table rebuilds"));
    format!(
        "new key p50 {n50} p99 {n99} p99.99 {n9999} max {nmax}; existing p50 {o50} p99 {o99} p99.99 {o9999} max {omax}{rebuilds}"
    )
}

/// The tail of new keys while the tables grow to `keys` keys ([`growth_once`]): rounds
/// in this process alternating tollgate and governor (round 0 on this process's fresh
/// heap, the later ones on memory the earlier ones mapped), then each contender in
/// processes of its own, as a server grows its key set once.
fn growth_tail(quick: bool) {
    let (keys, rounds, fresh) = if quick {
        (20_000u64, 1, 1)
    } else {
        (2_000_000u64, 3, 2)
    };
    println!("\ngrowth_tail: 0 → {keys} keys on 2 threads, a new key every 4 operations (ns)");
    for round in 0..rounds {
        // Each round, the other one first: the first to run in a process maps its heap.
        let mut names = ["tollgate", "governor"];
        if round % 2 == 1 {
            names.reverse();
        }
        for name in names {
            let line = growth_once(&*growth_contender(name, keys), keys, 2);
            println!("growth_tail/{name}/round {round}: {line}");
        }
    }
    // With the bare reference of incremental growth at tollgate's growth factor, and
    // with governor's whole-table growth (benches/support/reference.rs).
    for run in 0..fresh {
        for name in [
            "tollgate",
            "governor",
            "reference-8",
            "reference-8-doubling-whole",
        ] {
            let line = in_fresh_process(GROWTH_PROBE, format!("{name}:{keys}"));
            println!("growth_tail/{name}/fresh process {run}: {line}");
        }
    }
}

/// In a fresh process: one growth run of the contender `spec` names (`name:keys`, or
/// `name:keys:threads`; 2 threads unless it says).
fn growth_probe(spec: &str) {
    let mut fields = spec.split(':');
    let name = fields.next().expect("GROWTH_PROBE is name:keys[:threads]");
    let keys: u64 = fields
        .next()
        .and_then(|k| k.parse().ok())
        .expect("GROWTH_PROBE is name:keys[:threads], with a key count");
    let threads: u64 = fields
        .next()
        .map_or(Some(2), |t| t.parse().ok().filter(|&t| t > 0))
        .expect("GROWTH_PROBE's threads is a positive number");
    println!(
        "{}",
        growth_once(&*growth_contender(name, keys), keys, threads)
    );
}

/// Two quotas against one in alternating rounds, in this process (`also_10k`'s workload:
/// 10k `u64` keys, the token bucket, every check admitted), on 1 and 2 threads. A
/// criterion group times one limiter for seconds and then the other, and on this shared
/// VM the load moves between the two by more than the gap measured, so this also takes
/// the ratio round by round: each round times the same checks on both limiters back to
/// back, in an order that swaps every round. Prints the median of the rounds' ratios (two
/// quotas' time / one quota's), their quartiles and range, and each limiter's median time.
fn two_quotas_alternating(quick: bool) {
    let keys = key_sequences();
    let (one, two) = one_and_two_quotas();
    for key in 0..KEYS {
        one.check(key);
        two.check(key);
    }
    let (rounds, iters) = if quick { (2, 1_000) } else { (41, 400_000) };
    println!(
        "\nalso_10k_u64 alternating: {rounds} rounds of {iters} checks per thread (ns a check)"
    );
    let quantile = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    for threads in [1, 2] {
        let time = |limiter: &dyn Check| {
            let check = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &check).as_secs_f64() * 1e9 / iters as f64
        };
        let (mut ratios, mut ones, mut twos) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (t1, t2) = if round % 2 == 0 {
                let t1 = time(&one);
                (t1, time(&two))
            } else {
                let t2 = time(&two);
                (time(&one), t2)
            };
            ratios.push(t2 / t1);
            ones.push(t1);
            twos.push(t2);
        }
        for v in [&mut ratios, &mut ones, &mut twos] {
            v.sort_by(f64::total_cmp);
        }
        println!(
            "also_10k_u64/alternating/{threads}_thread: two / one quota {:.3} (median of {rounds} rounds; quartiles {:.3}–{:.3}, range {:.3}–{:.3}); one quota {:.1} ns, two quotas {:.1} ns (medians)",
            quantile(&ratios, 0.5),
            quantile(&ratios, 0.25),
            quantile(&ratios, 0.75),
            ratios[0],
            ratios[ratios.len() - 1],
            quantile(&ones, 0.5),
            quantile(&twos, 0.5),
        );
    }
}

/// Checks while the default quota changes: 2 threads check `keys` existing keys (each
/// check timed alone) for a while, with and without a third thread calling
/// `set_default_quota` every 10 ms (alternating two quotas). Prints p50, p99, p99.99 and
/// max of the checks, and the mean time of a quota change.
fn quota_change_tail(quick: bool) {
    let (keys, checks) = if quick {
        (20_000u64, 200_000u64)
    } else {
        (2_000_000u64, 3_000_000u64)
    };
    println!(
        "\nquota_change_tail: 2 threads checking {keys} keys; a quota change every 10 ms or none (ns)"
    );
    let quotas = [
        Quota::per_second(100).expect("valid quota"),
        Quota::per_second(200).expect("valid quota"),
    ];
    let limiter = tollgate(Algorithm::TokenBucket, quotas[0]);
    for key in 0..keys {
        limiter.check(&key);
    }
    for changing in [false, true, false, true] {
        let done = std::sync::atomic::AtomicBool::new(false);
        let start = Barrier::new(2);
        let (mut sample, changes) = std::thread::scope(|s| {
            let changer = s.spawn(|| {
                let mut times = Vec::new();
                let mut i = 0;
                while changing && !done.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                    let t0 = Instant::now();
                    limiter
                        .set_default_quota(quotas[i % 2])
                        .expect("valid quota");
                    times.push(t0.elapsed());
                    i += 1;
                }
                times
            });
            let handles: Vec<_> = (0..2u64)
                .map(|thread| {
                    let (limiter, start) = (&limiter, &start);
                    s.spawn(move || {
                        let mut sample = Vec::with_capacity(checks as usize);
                        let mut x = 0x2545_f491_4f6c_dd1du64 ^ (thread + 1);
                        start.wait();
                        for _ in 0..checks {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let key = x % keys;
                            let t0 = Instant::now();
                            black_box(limiter.check(&key));
                            sample.push(t0.elapsed().as_nanos() as u32);
                        }
                        sample
                    })
                })
                .collect();
            let sample: Vec<u32> = handles
                .into_iter()
                .flat_map(|h| h.join().expect("checking thread"))
                .collect();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            (sample, changer.join().expect("changer"))
        });
        let [p50, p99, p9999, max] = percentiles(&mut sample);
        let mean_change = if changes.is_empty() {
            Duration::ZERO
        } else {
            changes.iter().sum::<Duration>() / changes.len() as u32
        };
        println!(
            "quota_change_tail/{}: checks p50 {p50} p99 {p99} p99.99 {p9999} max {max}; {} changes, mean {mean_change:?} each",
            if changing { "changing" } else { "idle" },
            changes.len()
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = keyed_10k, settle_10k, also_10k, churn_1k, reference_10k, counters, hot_key_denied, string_keys, keyed_1m, config_read, redis_tier, redis_cluster, sync_check, http_layer, redis_layer_flood, redis_cached_deny
}

fn main() {
    if let Ok(spec) = std::env::var(PROBE) {
        memory_probe(&spec);
        return;
    }
    if let Ok(spec) = std::env::var(RECLAIM_PROBE) {
        reclaim_probe(&spec);
        return;
    }
    if let Ok(spec) = std::env::var(GROWTH_PROBE) {
        growth_probe(&spec);
        return;
    }
    benches();
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    // `TOLLGATE_PROBES=growth,quota_change` runs only those of the probes below.
    let only = std::env::var(PROBES).ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    if wanted("memory") {
        memory_per_key(quick);
    }
    if wanted("reclamation") {
        reclamation_memory(quick);
    }
    if wanted("growth") {
        growth_tail(quick);
    }
    if wanted("quota_change") {
        quota_change_tail(quick);
    }
    if wanted("also") {
        two_quotas_alternating(quick);
    }
    Criterion::default().configure_from_args().final_summary();
}
