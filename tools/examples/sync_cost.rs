//! What the background sync costs Redis, against the number of active keys: one synced
//! node (reconcile, 50 ms interval, 100/s burst 100 per key) checks each of `K` keys
//! once a second (far under its quota; at most 250,000 checks a second, so 1,000,000
//! keys each every 4 s), then with `H` of them pushed over their limit.
//! For each run it reads `INFO commandstats` and `INFO cpu` of a real redis-server
//! before and after a measured span, and prints a table: Redis commands and Redis CPU
//! per second, against the checks per second, with rounds, keys waiting and how many
//! checks were allowed.
//!
//! Run with: `cargo run --release --all-features --example sync_cost [-- --quick]`
//! (needs redis-server, which ./scripts/test.sh installs). `--quick` stops at 100k keys.
//! `-- --rounds COLD HOT` measures what a round costs with that many cold and hot keys
//! (rounds a second, the sync thread's CPU, memory per key).
//! `-- --soak MINUTES` instead rotates through 1,000,000 keys (each far under its quota)
//! as fast as the loop goes for that long, and prints each minute's checks, denies, Redis
//! commands, keys held and the process's resident memory.

use std::time::{Duration, Instant};

use tollgate::sync::{RedisSync, SyncMode};
use tollgate::{Quota, RateLimiter};
use tollgate_testing::LocalRedis;

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
    // Each key once a second, but no more than 250,000 checks a second (what this
    // loop keeps up with on 2 cores): 1,000,000 keys are each checked every 4 s.
    let per_s = (keys as f64).min(250_000.0);
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
        // Every key in turn, `per_s` checks a second (a hundredth per 10 ms tick).
        let due = (start.elapsed().as_secs_f64() * per_s) as usize;
        // At most 10,000 checks a tick, so that a loop behind time still measures.
        let mut work = 0;
        while next < due && work < 10_000 {
            work += 1;
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
        while hot_owed >= 1.0 && work < 20_000 {
            work += 1;
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

/// The process's resident memory, in MiB, from `/proc/self/statm`.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1024.0 * 1024.0)
}

/// 1M keys in turn, as fast as the loop goes, for `minutes`: a line a minute.
async fn soak(server: &LocalRedis, minutes: u64) {
    let quota = Quota::per_second(10).unwrap();
    let (limiter, handle) = RateLimiter::<String>::builder(quota)
        .build_synced(
            RedisSync::new(&server.url())
                .mode(SyncMode::Reconcile)
                .interval(Duration::from_millis(50))
                .prefix("soak"),
        )
        .expect("a synced limiter");
    let keys = 1_000_000;
    let names: Vec<String> = (0..keys).map(|i| format!("api-key-{i}")).collect();
    let mut con = server.connection().await.expect("a connection");
    println!(
        "| minute | checks/s | denied | Redis commands/s | commands per check | keys held | RSS (MiB) | cold tier |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut next = 0usize;
    for minute in 1..=minutes {
        let before = counters(&mut con).await;
        let start = Instant::now();
        let (mut checks, mut denied) = (0u64, 0u64);
        while start.elapsed() < Duration::from_secs(60) {
            for _ in 0..10_000 {
                checks += 1;
                denied += u64::from(!limiter.check(&names[next % keys]).is_allowed());
                next += 1;
            }
            tokio::task::yield_now().await;
        }
        let secs = start.elapsed().as_secs_f64();
        let commands = counters(&mut con).await.commands - before.commands;
        println!(
            "| {minute} | {:.0} | {denied} | {:.0} | {:.4} | {} | {:.0} | {} |",
            checks as f64 / secs,
            commands as f64 / secs,
            commands as f64 / checks.max(1) as f64,
            limiter.len(),
            rss_mib(),
            handle.stats().cold_tier,
        );
    }
    let stopping = Instant::now();
    handle.shutdown().await;
    println!("shutdown: {:.2?}", stopping.elapsed());
}

/// CPU seconds (user and system) a thread has used, from its `/proc/<pid>/task/<tid>/stat`.
fn thread_cpu(task: &std::path::Path) -> f64 {
    let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis: utime and stime are the 12th
    // and 13th of them, in clock ticks (100 a second on Linux).
    let rest = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// `--rounds COLD HOT`: what a round costs with `COLD` cold keys held and in use (each
/// far under its quota) and `HOT` keys over theirs. The sync task runs alone on a thread
/// of its own (a current-thread runtime), so that its CPU is its own; one thread checks
/// every key in turn, each hot key at 3 times its quota and each cold key at a tenth of
/// it, as far as it keeps up. After every key
/// has been checked twice, it measures 10 s: rounds a second (the interval asks for 20),
/// the sync thread's CPU, checks a second, and the memory the keys hold.
fn rounds(url: &str, cold: u64, hot: u64) {
    let (to_main, from_sync) = std::sync::mpsc::channel();
    let (to_sync, from_main) = tokio::sync::oneshot::channel::<tollgate::sync::SyncHandle>();
    let rss_before = rss_mib();
    let url = url.to_owned();
    let url_for_info = url.clone();
    let sync = std::thread::Builder::new()
        .name("tollgate-sync".into())
        .spawn(move || {
            let task = std::path::Path::new("/proc")
                .join(std::fs::read_link("/proc/thread-self").expect("/proc/thread-self"));
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                let (limiter, handle) =
                    RateLimiter::<u64>::builder(Quota::per_second(100).unwrap())
                        .max_keys(usize::MAX)
                        .build_synced(
                            RedisSync::new(&url)
                                .mode(SyncMode::Reconcile)
                                .interval(Duration::from_millis(50))
                                .prefix(&format!("rounds-{cold}-{hot}"))
                                .allow_shared_prefix(true),
                        )
                        .expect("a synced limiter");
                handle.ready().await;
                to_main.send((limiter, handle, task)).expect("main waits");
                let handle = from_main.await.expect("main sends the handle back");
                handle.shutdown().await;
            });
        })
        .expect("a thread");
    let (limiter, handle, task) = from_sync.recv().expect("the limiter");
    let all = cold + hot;
    // Each hot key at 3 times its quota and each cold key at a tenth of it, as far as the
    // loop keeps up (paced, should it go faster): a share `hot_share` of the checks goes
    // to the hot keys (a tenth at least, so that they stay hot however many cold keys
    // share the loop), the rest to the cold keys in turn.
    let (hot_rate, cold_rate) = (hot as f64 * 300.0, cold as f64 * 10.0);
    let hot_share = if hot == 0 {
        0.0
    } else {
        (hot_rate / (hot_rate + cold_rate)).max(0.1)
    };
    let most_per_s = if hot == 0 {
        cold_rate
    } else {
        hot_rate / hot_share
    };
    // Checks 100,000 keys from `next` on.
    let check = |next: u64| {
        for n in next..next + 100_000 {
            let hot_before = (n as f64 * hot_share) as u64;
            let is_hot = ((n + 1) as f64 * hot_share) as u64 > hot_before;
            let key = if is_hot {
                hot_before % hot
            } else {
                // The cold checks so far, so that each cold key comes in turn.
                hot + (n - hot_before) % cold.max(1)
            };
            std::hint::black_box(limiter.check(&key));
        }
        next + 100_000
    };
    let paced = |from: u64, began: Instant| {
        let ahead = from as f64 / most_per_s.max(1.0) - began.elapsed().as_secs_f64();
        if ahead > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(ahead));
        }
    };
    let mut next = 0u64;
    let warm = Instant::now();
    let warm_checks = (2 * all) as f64 / (1.0 - hot_share).max(0.1);
    while (next as f64) < warm_checks {
        next = check(next);
    }
    let warmed = warm.elapsed();
    let rss = rss_mib();
    let mut redis = redis::Client::open(url_for_info.as_str())
        .and_then(|c| c.get_connection())
        .expect("a connection");
    let redis_cpu = |con: &mut redis::Connection| -> f64 {
        let info: String = redis::cmd("INFO").arg("cpu").query(con).unwrap_or_default();
        info.lines()
            .filter(|l| l.starts_with("used_cpu_user:") || l.starts_with("used_cpu_sys:"))
            .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
            .sum()
    };
    let redis_before = redis_cpu(&mut redis);
    let (before, cpu_before, start) = (handle.stats(), thread_cpu(&task), Instant::now());
    let checked = next;
    while start.elapsed() < Duration::from_secs(10) {
        next = check(next);
        paced(next - checked, start);
    }
    let secs = start.elapsed().as_secs_f64();
    let after = handle.stats();
    let cpu = (thread_cpu(&task) - cpu_before) / secs;
    let redis_used = (redis_cpu(&mut redis) - redis_before) / secs;
    if std::env::var_os("TOLLGATE_COMMANDSTATS").is_some() {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut redis)
            .unwrap_or_default();
        eprintln!(
            "{}",
            info.lines()
                .filter(|l| l.contains("calls="))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    println!(
        "| {cold} | {hot} | {:.1} | {:.1}% | {:.0}% | {:.2} M | {} | {} | {:.0} | {:.0} | {:.1?} |",
        (after.syncs - before.syncs) as f64 / secs,
        cpu * 100.0,
        redis_used * 100.0,
        (next - checked) as f64 / secs / 1e6,
        after.hot_keys,
        limiter.len(),
        rss - rss_before,
        (rss - rss_before) * 1024.0 * 1024.0 / all.max(1) as f64,
        warmed,
    );
    drop(limiter);
    to_sync.send(handle).expect("the sync thread waits");
    sync.join().expect("the sync thread");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let server = LocalRedis::start().expect("redis-server (./scripts/test.sh installs it)");
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--rounds") {
        let number = |i: usize, default: u64| {
            args.get(at + i)
                .and_then(|n| n.parse().ok())
                .unwrap_or(default)
        };
        let (cold, hot) = (number(1, 1_000_000), number(2, 1_000));
        let url = server.url();
        println!(
            "| cold keys | hot keys | rounds/s | sync thread CPU | Redis CPU | checks/s | hot keys read | keys held | RSS (MiB) | B/key | warm-up |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        tokio::task::spawn_blocking(move || rounds(&url, cold, hot))
            .await
            .expect("the run");
        return;
    }
    if let Some(at) = args.iter().position(|a| a == "--soak") {
        let minutes = args.get(at + 1).and_then(|m| m.parse().ok()).unwrap_or(10);
        soak(&server, minutes).await;
        return;
    }
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
