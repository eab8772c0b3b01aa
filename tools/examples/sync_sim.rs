//! Several nodes share one global limit through a real Redis, in three scenarios, each
//! run once per sync mode:
//!
//! 1. 1,000/s across 4 nodes under 3× skewed overload (70/10/10/10);
//! 2. a low quota: 10/s across 3 saturated nodes;
//! 3. 200/s across 3 nodes while Redis is paused (SIGSTOP) for 5 s.
//!
//! Prints what all nodes admitted per second, and writes `docs/sync_sim.csv` and
//! `docs/sync_sim.svg` (admitted rate against the limit over time, one panel a
//! scenario).
//!
//! Run with: `cargo run --release --all-features --example sync_sim` (needs redis-server,
//! which ./scripts/test.sh installs).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use plotters::prelude::*;
use tollgate::sync::{RedisSync, SyncHandle, SyncMode, SyncedLimiter};
use tollgate::{Quota, RateLimiter};
use tollgate_testing::LocalRedis;

/// One scenario: a quota, the load each node offers (per second), how long, and when
/// Redis is paused.
struct Scenario {
    title: &'static str,
    quota: &'static str,
    load: &'static [f64],
    seconds: u64,
    /// Pause Redis from this second for this many.
    pause: Option<(u64, u64)>,
    /// The width of a plotted bucket.
    bucket: Duration,
}

const SCENARIOS: [Scenario; 3] = [
    Scenario {
        title: "1000/s, 4 nodes, 3x skewed overload",
        quota: "1000/s",
        load: &[2100.0, 300.0, 300.0, 300.0],
        seconds: 8,
        pause: None,
        bucket: Duration::from_millis(100),
    },
    Scenario {
        title: "10/s, 3 saturated nodes",
        quota: "10/s",
        load: &[10.0, 10.0, 10.0],
        seconds: 12,
        pause: None,
        bucket: Duration::from_secs(1),
    },
    Scenario {
        title: "200/s, 3 nodes, Redis paused (SIGSTOP) from 3 s to 8 s",
        quota: "200/s",
        load: &[200.0, 150.0, 100.0],
        seconds: 14,
        pause: Some((3, 5)),
        bucket: Duration::from_millis(250),
    },
];

/// Runs a scenario in one mode; returns the admissions per bucket, all nodes together.
async fn run(
    server: &LocalRedis,
    scenario: &Scenario,
    index: usize,
    mode: SyncMode,
) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let quota: Quota = scenario.quota.parse()?;
    let mut nodes: Vec<(SyncedLimiter<String>, SyncHandle)> = Vec::new();
    for _ in scenario.load {
        let sync = RedisSync::new(&server.url())
            .mode(mode)
            .prefix(&format!("sim-{index}-{mode:?}"))
            .allow_shared_prefix(true);
        nodes.push(RateLimiter::builder(quota).build_synced(sync)?);
    }
    let length = Duration::from_secs(scenario.seconds);
    let mut trace = vec![0u64; (length.as_millis() / scenario.bucket.as_millis()) as usize];
    let mut owed = vec![0.0; nodes.len()];
    let mut paused = false;
    let start = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed() < length {
        ticker.tick().await;
        let elapsed = start.elapsed();
        if let Some((from, pause)) = scenario.pause {
            let during = (from..from + pause).contains(&elapsed.as_secs());
            if during != paused {
                if during {
                    server.pause()?;
                } else {
                    server.resume()?;
                }
                paused = during;
            }
        }
        let bucket = (elapsed.as_millis() / scenario.bucket.as_millis()) as usize;
        for (node, (limiter, _)) in nodes.iter().enumerate() {
            owed[node] += scenario.load[node] / 1_000.0;
            while owed[node] >= 1.0 {
                owed[node] -= 1.0;
                if limiter.check("api").is_allowed() {
                    if let Some(count) = trace.get_mut(bucket) {
                        *count += 1;
                    }
                }
            }
        }
    }
    if paused {
        server.resume()?;
    }
    for (_, handle) in nodes {
        handle.shutdown().await;
    }
    Ok(trace)
}

/// Each mode's admissions per bucket, by the mode's name.
type Traces = Vec<(&'static str, Vec<u64>)>;

/// The rate a bucket's count stands for, per second.
fn rate(count: u64, bucket: Duration) -> f64 {
    count as f64 / bucket.as_secs_f64()
}

fn plot(results: &[(&Scenario, Traces)]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new("docs/sync_sim.svg", (900, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((results.len(), 1));
    for (panel, (scenario, traces)) in panels.iter().zip(results) {
        let quota: Quota = scenario.quota.parse()?;
        let limit = quota.limit() as f64 / quota.period().as_secs_f64();
        let seconds = scenario.seconds as f64;
        let highest = traces
            .iter()
            .flat_map(|(_, t)| t.iter().map(|&c| rate(c, scenario.bucket)))
            .fold(limit * 2.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(scenario.title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..seconds, 0.0..highest * 1.1)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc("admitted per second")
            .draw()?;
        if let Some((from, length)) = scenario.pause {
            chart.draw_series([Rectangle::new(
                [(from as f64, 0.0), ((from + length) as f64, highest * 1.1)],
                RGBColor(230, 230, 230).filled(),
            )])?;
        }
        for ((name, trace), colour) in traces.iter().zip([BLUE, RED]) {
            let step = scenario.bucket.as_secs_f64();
            let points = trace
                .iter()
                .enumerate()
                .map(|(i, &c)| (i as f64 * step, rate(c, scenario.bucket)));
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
                .label(*name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
        chart
            .draw_series(LineSeries::new(
                [(0.0, limit), (seconds, limit)],
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
    }
    root.present()?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = LocalRedis::start()?;
    let mut csv = String::from("scenario,mode,bucket_start_ms,admitted\n");
    let mut results = Vec::new();
    for (index, scenario) in SCENARIOS.iter().enumerate() {
        let mut traces = Vec::new();
        for (mode, name) in [
            (SyncMode::Reconcile, "reconcile"),
            (SyncMode::Lease, "lease"),
        ] {
            let trace = run(&server, scenario, index, mode).await?;
            let per_second = (1_000 / scenario.bucket.as_millis()) as usize;
            let seconds: Vec<u64> = trace.chunks(per_second).map(|c| c.iter().sum()).collect();
            println!(
                "{} — {name}: admitted per second {seconds:?}",
                scenario.title
            );
            for (i, count) in trace.iter().enumerate() {
                writeln!(
                    csv,
                    "{index},{name},{},{count}",
                    i as u128 * scenario.bucket.as_millis()
                )?;
            }
            traces.push((name, trace));
        }
        results.push((scenario, traces));
    }
    std::fs::create_dir_all("docs")?;
    std::fs::write("docs/sync_sim.csv", csv)?;
    plot(&results)?;
    println!("\nwrote docs/sync_sim.csv and docs/sync_sim.svg");
    Ok(())
}
