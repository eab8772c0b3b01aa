//! A fleet of processes sharing one limit through the background sync: each node checks
//! locally, in nanoseconds, and all of them together stay within the global quota.
//!
//! ```text
//! cargo run --release --example fleet --features redis            # 3 nodes, its own redis-server
//! cargo run --release --example fleet --features redis -- 5       # 5 nodes
//! ```
//!
//! The parent starts a `redis-server` on a free port (`./scripts/test.sh` installs it),
//! then runs the nodes as child processes of the same program. Every node offers the
//! same key 200 requests a second for 4 seconds against a global quota of 100 per
//! second (burst 100): together they offer `200·N` a second. Each prints what it
//! admitted; the parent adds them up and prints the documented bound.

#[path = "support/redis_server.rs"]
mod redis_server;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tollgate::RateLimiter;
use tollgate::sync::{RedisSync, SyncMode};

const RATE: u64 = 100;
const BURST: u64 = 100;
const RUN: Duration = Duration::from_secs(4);
const OFFERED_PER_SECOND: u64 = 200;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--node") {
        let url = args.get(1).ok_or("--node needs the Redis URL")?;
        return node(url);
    }
    let nodes: u64 = match args.first() {
        Some(n) => n
            .parse()
            .map_err(|e| format!("the node count {n:?}: {e}"))?,
        None => 3,
    };
    let redis = redis_server::RedisServer::start()?;
    println!(
        "{nodes} nodes, one key, {RATE}/s burst {BURST} across all of them, {}s",
        RUN.as_secs()
    );
    let children = (0..nodes)
        .map(|_| {
            Command::new(std::env::current_exe()?)
                .args(["--node", &redis.url()])
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut total = 0;
    for (i, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        let admitted: u64 = text
            .trim()
            .parse()
            .map_err(|e| format!("node {i} printed {text:?}: {e}"))?;
        println!(
            "node {i}: admitted {admitted} of {}",
            OFFERED_PER_SECOND * RUN.as_secs()
        );
        total += admitted;
    }
    // Reconcile mode: at most 2B + r·(t + 5I + Δ) + 3N in any interval t (I = 50 ms, Δ = 200 ms).
    let t = RUN.as_secs_f64();
    let bound = 2.0 * BURST as f64 + RATE as f64 * (t + 5.0 * 0.05 + 0.2) + 3.0 * nodes as f64;
    println!(
        "all nodes: {total} admitted, against {} offered; quota over {t} s: {} + burst {BURST}; documented bound {bound:.0}",
        OFFERED_PER_SECOND * RUN.as_secs() * nodes,
        RATE * RUN.as_secs(),
    );
    Ok(())
}

/// One node: a synced limiter, the key offered at a steady rate; prints what it admitted.
fn node(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let (limiter, handle) =
            RateLimiter::<String>::builder(format!("{RATE}/s burst {BURST}").parse()?)
                .name("fleet")
                .build_synced(
                    RedisSync::new(url)
                        .prefix("fleet")
                        .mode(SyncMode::Reconcile),
                )?;
        handle.ready().await; // this node has heard Redis: its checks decide from now on
        let gap = Duration::from_secs(1) / OFFERED_PER_SECOND as u32;
        let start = Instant::now();
        let mut admitted = 0u64;
        let mut next = start;
        while start.elapsed() < RUN {
            if limiter.check("shared-key").is_allowed() {
                admitted += 1;
            }
            next += gap;
            tokio::time::sleep_until(next.into()).await;
        }
        handle.shutdown().await;
        println!("{admitted}");
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
