//! Tail latencies measured one operation at a time: new keys while tables grow, a
//! quota change under load, two quotas alternating.

use super::*;

/// Percentiles of a sample of latencies (ns): p50, p99, p99.99 and the maximum.
pub(crate) fn percentiles(sample: &mut [u32]) -> [u32; 4] {
    sample.sort_unstable();
    let at = |q: f64| sample[((sample.len() - 1) as f64 * q) as usize];
    [
        at(0.5),
        at(0.99),
        at(0.9999),
        sample.last().copied().unwrap_or(0),
    ]
}

/// Where the probes write their distributions for `scripts/bench_plots.py`: the directory
/// `TOLLGATE_BENCH_OUT` names, if set.
pub(crate) const BENCH_OUT: &str = "TOLLGATE_BENCH_OUT";

/// Writes the latency distribution `sorted` (ns, ascending) as `cdf-<name>.csv` under
/// [`BENCH_OUT`]: the latency at 361 quantiles spaced evenly in "nines" (p0 to p99.9999,
/// 60 a decade), then the maximum.
pub(crate) fn write_cdf(name: &str, sorted: &[u32]) {
    let Some(dir) = std::env::var_os(BENCH_OUT) else {
        return;
    };
    if sorted.is_empty() {
        return;
    }
    let mut csv = String::from("quantile,ns\n");
    for step in 0..=360 {
        let q = 1.0 - 10f64.powf(-f64::from(step) / 60.0);
        let at = sorted[((sorted.len() - 1) as f64 * q) as usize];
        csv.push_str(&format!("{q:.8},{at}\n"));
    }
    csv.push_str(&format!("1,{}\n", sorted[sorted.len() - 1]));
    let path = std::path::Path::new(&dir).join(format!("cdf-{name}.csv"));
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, csv))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Runs this bench binary again with `probe` set to `spec` (one of the probes `main`
/// dispatches on), and returns what it printed, trimmed.
pub(crate) fn in_fresh_process(probe: &str, spec: String) -> String {
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
pub(crate) const GROWTH_PROBE: &str = "TOLLGATE_GROWTH_PROBE";

/// The growth workload's contender `name` for `keys` keys (100 per hour: every key stays
/// in use).
pub(crate) fn growth_contender(name: &str, keys: u64) -> Box<dyn Check> {
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
pub(crate) fn growth_once(label: &str, limiter: &dyn Check, keys: u64, threads: u64) -> String {
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
    write_cdf(&format!("{label}-{threads}t-new"), &new);
    write_cdf(&format!("{label}-{threads}t-existing"), &old);
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
pub(crate) fn growth_tail(quick: bool) {
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
            let label = format!("{name}-round{round}");
            let line = growth_once(&label, &*growth_contender(name, keys), keys, 2);
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
pub(crate) fn growth_probe(spec: &str) {
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
        growth_once(
            &format!("{name}-fresh"),
            &*growth_contender(name, keys),
            keys,
            threads
        )
    );
}

/// Two quotas against one in alternating rounds, in this process (`also_10k`'s workload:
/// 10k `u64` keys, the token bucket, every check admitted), on 1 and 2 threads. A
/// criterion group times one limiter for seconds and then the other, and on this shared
/// VM the load moves between the two by more than the gap measured, so this also takes
/// the ratio round by round: each round times the same checks on both limiters back to
/// back, in an order that swaps every round. Prints the median of the rounds' ratios (two
/// quotas' time / one quota's), their quartiles and range, and each limiter's median time.
pub(crate) fn two_quotas_alternating(quick: bool) {
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
    let contenders: [&dyn Check; 2] = [&one, &two];
    for threads in [1, 2] {
        let time = |which: usize| {
            let limiter = contenders[which];
            let check = |thread: usize, i: usize| limiter.check(keys[thread][i & (SEQUENCE - 1)]);
            run_threads(threads, iters, &check).as_secs_f64() * 1e9 / iters as f64
        };
        let times = alternate(2, rounds, time);
        let label = format!("also_10k_u64/alternating/{threads}_thread");
        print_ratio(&label, ("one quota", &times[0]), ("two quotas", &times[1]));
    }
}

/// Checks while the default quota changes: 2 threads check `keys` existing keys (each
/// check timed alone) for a while, with and without a third thread calling
/// `set_default_quota` every 10 ms (alternating two quotas). Prints p50, p99, p99.99 and
/// max of the checks, and the mean time of a quota change.
pub(crate) fn quota_change_tail(quick: bool) {
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
