//! A background worker throttled with `until_ready`: it drains a queue of jobs at the
//! partner API's limit instead of failing the jobs above it, and gives up on an urgent
//! job rather than wait longer than its deadline.
//!
//! ```text
//! cargo run --example worker --features tokio
//! ```

use std::time::{Duration, Instant};

use tollgate::{AcquireError, RateLimiter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The partner allows 10 calls a second, 3 at once.
    let limiter: RateLimiter<String> = RateLimiter::new("10/s burst 3".parse()?);
    let start = Instant::now();
    for job in 1..=8 {
        // Waits exactly until the call is admitted: no polling, no rejected job.
        limiter.until_ready("partner-api").await;
        println!("{:>6.3} s  job {job} sent", start.elapsed().as_secs_f64());
    }

    // An urgent job must go out within 20 ms or be handed to another path.
    match limiter
        .acquire_timeout("partner-api", 1, Duration::from_millis(20))
        .await
    {
        Ok(_) => println!("urgent job sent"),
        Err(AcquireError::Timeout { needed, .. }) => {
            println!("urgent job rerouted: it would wait {needed:?}, nothing consumed")
        }
        Err(e) => return Err(e.into()),
    }
    let stats = limiter.stats();
    println!(
        "{} calls admitted; {} checks answered \"not yet\" (each followed by one exact sleep)",
        stats.allowed, stats.denied
    );
    Ok(())
}
