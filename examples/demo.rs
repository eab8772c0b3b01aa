//! Drives the same traffic through a token bucket and a sliding window counter, both at
//! "20/s burst 10", and prints what each admitted per 100ms.
//!
//! Run with: `cargo run --release --example demo`

use std::thread;
use std::time::{Duration, Instant};

use tollgate::{Algorithm, Quota, RateLimiter};

/// How many requests per second the client offers at `t` seconds into the run.
fn offered_rate(t: f64) -> u32 {
    match t {
        t if t < 1.0 => 10, // under the limit
        t if t < 1.5 => 80, // a spike: 4× the limit
        t if t < 2.5 => 0,  // quiet: both refill
        _ => 40,            // sustained overload: 2× the limit
    }
}

const TICK: Duration = Duration::from_millis(100);
const RUN: Duration = Duration::from_millis(3500);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quota: Quota = "20/s burst 10".parse()?;
    let limiters: Vec<RateLimiter<String>> = [Algorithm::TokenBucket, Algorithm::SlidingWindow]
        .into_iter()
        .map(|algorithm| RateLimiter::builder(quota).algorithm(algorithm).build())
        .collect::<Result<_, _>>()?;

    println!("quota {quota}: the token bucket uses the burst, the sliding window ignores it\n");
    println!(
        "{:>6} {:>8} | {:^20} | {:^20}",
        "t(ms)", "offered", "token-bucket", "sliding-window"
    );
    println!(
        "{:>6} {:>8} | {:>9} {:>10} | {:>9} {:>10}",
        "", "", "allowed", "denied", "allowed", "denied"
    );

    let start = Instant::now();
    let mut next_request = start;
    let mut totals = [[0u32; 2]; 2];
    let mut tick_end = start + TICK;
    let mut tick = [[0u32; 2]; 2];
    let mut offered = 0;
    while tick_end <= start + RUN {
        let now = Instant::now();
        if now >= tick_end {
            println!(
                "{:>6} {:>8} | {:>9} {:>10} | {:>9} {:>10}",
                (tick_end - start).as_millis(),
                offered,
                tick[0][0],
                tick[0][1],
                tick[1][0],
                tick[1][1]
            );
            for (total, counts) in totals.iter_mut().zip(tick) {
                total[0] += counts[0];
                total[1] += counts[1];
            }
            tick = [[0; 2]; 2];
            offered = 0;
            tick_end += TICK;
            continue;
        }
        let rate = offered_rate((now - start).as_secs_f64());
        if rate == 0 {
            next_request = now + Duration::from_millis(10);
        } else if now >= next_request {
            offered += 1;
            for (limiter, counts) in limiters.iter().zip(tick.iter_mut()) {
                let d = limiter.check("client-42");
                counts[usize::from(!d.is_allowed())] += 1;
            }
            next_request += Duration::from_secs(1) / rate;
        }
        thread::sleep(
            next_request
                .min(tick_end)
                .saturating_duration_since(Instant::now()),
        );
    }
    println!(
        "\n{:>15} | {:>9} {:>10} | {:>9} {:>10}",
        "total", totals[0][0], totals[0][1], totals[1][0], totals[1][1]
    );
    Ok(())
}
