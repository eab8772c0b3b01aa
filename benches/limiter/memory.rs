//! Resident memory per key, and what retired tables hold back, each in a fresh process.

use super::*;

/// Resident set size of this process, in bytes (Linux `VmRSS`).
pub(crate) fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Environment variable that turns a run of this binary into one memory probe.
pub(crate) const PROBE: &str = "TOLLGATE_MEMORY_PROBE";

/// Names the probes printed after the criterion groups to run (comma-separated: `memory`,
/// `reclamation`, `growth`, `quota_change`); all of them if unset.
pub(crate) const PROBES: &str = "TOLLGATE_PROBES";

/// The quota of the memory probes: a typical "100/s". Only the sliding log's memory
/// depends on it (8 bytes per unit of limit).
pub(crate) fn typical(_: Algorithm) -> Quota {
    Quota::per_second(100).expect("valid quota")
}

/// In a fresh process: builds `name`'s limiter, touches `keys` distinct keys, and prints
/// the growth of resident memory per key.
pub(crate) fn memory_probe(spec: &str) {
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
pub(crate) fn memory_per_key(quick: bool) {
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
pub(crate) const RECLAIM_PROBE: &str = "TOLLGATE_RECLAIM_PROBE";

/// In a fresh process, one of issue 26's experiments on retired tables, with or without a
/// thread that makes one check and then sleeps: `changes` (200,000 keys, then 400
/// default-quota changes, each migrating every shard, with 2,000 checks between them) or
/// `cycles` (10 cycles of growing to 1M keys and removing them all). Prints the resident
/// MB before and after.
pub(crate) fn reclaim_probe(spec: &str) {
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
pub(crate) fn reclamation_memory(quick: bool) {
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
