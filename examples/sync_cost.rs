//! What the background sync costs Redis, against the number of active keys: one synced
//! node (reconcile, 50 ms interval, 100/s burst 100 per key) checks each of `K` keys
//! once a second (far under its quota), then with `H` of them pushed over their limit.
//! For each run it reads `INFO commandstats` and `INFO cpu` of a real redis-server
//! before and after a measured span, and prints a table: Redis commands and Redis CPU
//! per second, against the checks per second, with rounds, keys waiting and how many
//! checks were allowed.
//!
//! Run with: `cargo run --release --all-features --example sync_cost [-- --quick]`
//! (needs redis-server, which ./scripts/test.sh installs). `--quick` stops at 100k keys.

use std::time::{Duration, Instant};

use tollgate::sync::{RedisSync, SyncMode};
use tollgate::test_support::LocalRedis;
use tollgate::{Quota, RateLimiter};

/// Redis's counters: commands run (all of them, those scripts run included) and CPU
/// seconds (user and system).
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    commands: u64,
    cpu: f64,
}

/// One section of `INFO`.
async fn info(con: &mut redis::aio::MultiplexedConnection, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(con)
        .await
        .unwrap_or_else(|e| panic!("INFO {section}: {e}"))
}

async fn counters(con: &mut redis::aio::MultiplexedConnection) -> Counters {
    let commands = info(con, "commandstats")
        .await
        .lines()
        .filter_map(|line| {
            let calls = line.split("calls=").nth(1)?;
            calls.split(',').next()?.parse::<u64>().ok()
        })
        .sum();
    let cpu = info(con, "cpu")
        .await
        .lines()
        .filter(|l| l.starts_with("used_cpu_user:") || l.starts_with("used_cpu_sys:"))
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .sum();
    Counters { commands, cpu }
}

/// One run's figures.
struct Row {
    keys: usize,
    hot: usize,
    checks_per_s: f64,
    allowed: f64,
    cold_allowed: f64,
    commands_per_s: f64,
    cpu: f64,
    rounds_per_s: f64,
    keys_waiting: usize,
    fallback: bool,
    /// Keys the limiter held at the end, and how long the flushing shutdown took.
    held: usize,
    shutdown: Duration,
}

/// `keys` keys each checked once a second, and `hot` of them offered 2× their quota on
/// top; `warm` then `measure`.
async fn run(
    server: &LocalRedis,
    keys: usize,
    hot: usize,
    warm: Duration,
    measure: Duration,
) -> Row {
    let quota = Quota::per_second(100).unwrap();
    let prefix = format!("cost-{keys}-{hot}");
    let (limiter, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(
            RedisSync::new(&server.url())
                .mode(SyncMode::Reconcile)
                .interval(Duration::from_millis(50))
                .prefix(&prefix)
                .allow_shared_prefix(true),
        )
        .expect("a synced limiter");
    let names: Vec<String> = (0..keys).map(|i| format!("key-{i}")).collect();
    let mut con = server.connection().await.expect("a connection");
    let start = Instant::now();
    let mut before = None;
    let mut stats_before = handle.stats();
    let (mut checks, mut allowed, mut cold_checks, mut cold_allowed) = (0u64, 0u64, 0u64, 0u64);
    let mut next = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut hot_owed = 0.0f64;
    let mut hot_next = 0usize;
    while start.elapsed() < warm + measure {
        tick.tick().await;
        let measuring = start.elapsed() >= warm;
        if measuring && before.is_none() {
            before = Some((counters(&mut con).await, Instant::now()));
            stats_before = handle.stats();
        }
        // Every key once a second: a hundredth of them per 10 ms tick, in turn.
        let due = (start.elapsed().as_secs_f64() * keys as f64) as usize;
        while next < due {
            let ok = limiter.check(&names[next % keys]).is_allowed();
            if measuring {
                checks += 1;
                allowed += u64::from(ok);
                if next % keys >= hot {
                    cold_checks += 1;
                    cold_allowed += u64::from(ok);
                }
            }
            next += 1;
        }
        // The hot keys, 200/s each on top.
        hot_owed += hot as f64 * 200.0 / 100.0;
        while hot_owed >= 1.0 {
            hot_owed -= 1.0;
            hot_next += 1;
            let ok = limiter.check(&names[hot_next % hot]).is_allowed();
            if measuring {
                checks += 1;
                allowed += u64::from(ok);
            }
        }
        tokio::task::yield_now().await;
    }
    let (counters_before, at) = before.expect("a measured span");
    let after = counters(&mut con).await;
    let secs = at.elapsed().as_secs_f64();
    let stats = handle.stats();
    let held = limiter.len();
    let stopping = Instant::now();
    handle.shutdown().await;
    let shutdown = stopping.elapsed();
    Row {
        keys,
        hot,
        checks_per_s: checks as f64 / secs,
        allowed: allowed as f64 / checks.max(1) as f64,
        cold_allowed: cold_allowed as f64 / cold_checks.max(1) as f64,
        commands_per_s: (after.commands - counters_before.commands) as f64 / secs,
        cpu: (after.cpu - counters_before.cpu) / secs,
        rounds_per_s: (stats.syncs - stats_before.syncs) as f64 / secs,
        keys_waiting: stats.keys_waiting,
        fallback: stats.fallback_active,
        held,
        shutdown,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let mut sizes = vec![1_000, 10_000, 100_000];
    if !quick {
        sizes.push(1_000_000);
    }
    println!(
        "| active keys | hot keys | checks/s | allowed | cold keys allowed | Redis commands/s \
         | commands per check | Redis CPU | rounds/s | keys waiting | keys held | shutdown | fallback |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &keys in &sizes {
        for hot in [0, 1_000.min(keys / 10)] {
            // Long enough for every key to be seen twice before measuring.
            let row = run(
                &server,
                keys,
                hot,
                Duration::from_secs(5),
                Duration::from_secs(10),
            )
            .await;
            println!(
                "| {} | {} | {:.0} | {:.1}% | {:.1}% | {:.0} | {:.2} | {:.0}% | {:.1} | {} | {} | {:.2?} | {} |",
                row.keys,
                row.hot,
                row.checks_per_s,
                row.allowed * 100.0,
                row.cold_allowed * 100.0,
                row.commands_per_s,
                row.commands_per_s / row.checks_per_s.max(1.0),
                row.cpu * 100.0,
                row.rounds_per_s,
                row.keys_waiting,
                row.held,
                row.shutdown,
                row.fallback,
            );
        }
    }
}
