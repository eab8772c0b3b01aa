//! Four nodes share one global limit through Redis: the same skewed overload (3× the
//! limit, 70/10/10/10 across the nodes) runs once per sync mode. Prints what each node
//! admitted per window, and writes `docs/sync_sim.csv` and `docs/sync_sim.svg` (admitted
//! rate against the limit over time).
//!
//! Run with: `cargo run --release --all-features --example sync_sim` (needs redis-server,
//! which ./scripts/test.sh installs).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use plotters::prelude::*;
use tollgate::redis::LocalRedis;
use tollgate::sync::{RedisSync, SyncHandle, SyncMode};
use tollgate::{Quota, RateLimiter};

const NODES: usize = 4;
const SHARES: [f64; NODES] = [0.7, 0.1, 0.1, 0.1];
const LOAD: f64 = 3.0;
const WINDOWS: usize = 8;
const BUCKET: Duration = Duration::from_millis(100);

/// Admissions per node per 100ms bucket.
type Trace = Vec<[u64; NODES]>;

async fn simulate(
    server: &LocalRedis,
    mode: SyncMode,
    quota: Quota,
) -> Result<Trace, Box<dyn std::error::Error>> {
    let mut nodes: Vec<(RateLimiter<String>, SyncHandle)> = Vec::new();
    for _ in 0..NODES {
        let sync = RedisSync::new(&server.url())
            .mode(mode)
            .prefix(&format!("sim-{mode:?}"));
        nodes.push(RateLimiter::builder(quota).build_synced(sync)?);
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let per_ms = LOAD * quota.limit() as f64 / quota.period().as_millis() as f64;
    let buckets = (quota.period() * WINDOWS as u32).as_millis() / BUCKET.as_millis();
    let mut trace = vec![[0u64; NODES]; buckets as usize];
    let mut owed = [0.0; NODES];
    let start = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed() < quota.period() * WINDOWS as u32 {
        ticker.tick().await;
        let bucket = (start.elapsed().as_millis() / BUCKET.as_millis()) as usize;
        for (node, (limiter, _)) in nodes.iter().enumerate() {
            owed[node] += per_ms * SHARES[node];
            while owed[node] >= 1.0 {
                owed[node] -= 1.0;
                if limiter.check("api").is_allowed() {
                    if let Some(row) = trace.get_mut(bucket) {
                        row[node] += 1;
                    }
                }
            }
        }
    }
    for (_, handle) in nodes {
        handle.shutdown().await;
    }
    Ok(trace)
}

fn plot(traces: &[(&str, Trace)], limit_per_sec: f64) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new("docs/sync_sim.svg", (900, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let seconds = traces[0].1.len() as f64 * BUCKET.as_secs_f64();
    let rate = |row: &[u64; NODES]| row.iter().sum::<u64>() as f64 / BUCKET.as_secs_f64();
    let highest = traces
        .iter()
        .flat_map(|(_, t)| t.iter().map(rate))
        .fold(limit_per_sec * 2.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "4 nodes, 3x skewed overload: admitted rate vs the global limit",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..seconds, 0.0..highest * 1.1)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("admitted per second (100 ms buckets)")
        .draw()?;
    let colours = [BLUE, RED];
    for ((name, trace), colour) in traces.iter().zip(colours) {
        let points = trace
            .iter()
            .enumerate()
            .map(|(i, row)| (i as f64 * BUCKET.as_secs_f64(), rate(row)));
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2)));
    }
    chart
        .draw_series(LineSeries::new(
            [(0.0, limit_per_sec), (seconds, limit_per_sec)],
            BLACK.stroke_width(1),
        ))?
        .label("global limit")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    root.present()?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = LocalRedis::start()?;
    let quota: Quota = "1000/s".parse()?;
    let mut traces = Vec::new();
    let mut csv = String::from("mode,bucket_start_ms,node0,node1,node2,node3,total\n");
    for (mode, name) in [
        (SyncMode::Reconcile, "reconcile"),
        (SyncMode::Lease, "lease"),
    ] {
        let trace = simulate(&server, mode, quota).await?;
        println!(
            "\n{name}: admitted per {}-ms window (limit {} per window)",
            quota.period().as_millis(),
            quota.limit()
        );
        println!(
            "{:>6} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}",
            "window", "node0", "node1", "node2", "node3", "total", "/limit"
        );
        let per_window = trace.len() / WINDOWS;
        for (w, rows) in trace.chunks(per_window).enumerate() {
            let mut sums = [0u64; NODES];
            for row in rows {
                for (sum, n) in sums.iter_mut().zip(row) {
                    *sum += n;
                }
            }
            let total: u64 = sums.iter().sum();
            println!(
                "{w:>6} {:>7} {:>7} {:>7} {:>7} {total:>7} {:>7.3}",
                sums[0],
                sums[1],
                sums[2],
                sums[3],
                total as f64 / quota.limit() as f64
            );
        }
        for (i, row) in trace.iter().enumerate() {
            let total: u64 = row.iter().sum();
            writeln!(
                csv,
                "{name},{},{},{},{},{},{total}",
                i as u128 * BUCKET.as_millis(),
                row[0],
                row[1],
                row[2],
                row[3]
            )?;
        }
        traces.push((name, trace));
    }
    std::fs::create_dir_all("docs")?;
    std::fs::write("docs/sync_sim.csv", csv)?;
    plot(&traces, quota.limit() as f64 / quota.period().as_secs_f64())?;
    println!("\nwrote docs/sync_sim.csv and docs/sync_sim.svg");
    Ok(())
}
