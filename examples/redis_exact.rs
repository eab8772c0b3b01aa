//! The exact Redis tier with `FailMode::Local`: one limit held exactly across nodes while
//! Redis answers, and a per-node local limit while it does not.
//!
//! ```text
//! cargo run --example redis_exact --features redis                                # starts its own redis-server
//! cargo run --example redis_exact --features redis -- redis://127.0.0.1:6379/     # or uses yours
//! ```
//!
//! With no URL it starts a `redis-server` on a free port (it must be installed:
//! `./scripts/test.sh` installs it), and stops it halfway to show the fail mode.

#[path = "support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use tollgate::redis::{FailMode, RedisLimiter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let given = std::env::args().nth(1);
    let mut own = match given {
        Some(_) => None,
        None => Some(redis_server::RedisServer::start()?),
    };
    let url = given.unwrap_or_else(|| own.as_ref().map(|r| r.url()).unwrap_or_default());

    // 5 per second per key across every node; 2 per second per key on each node while
    // Redis is away (the quota divided by, say, 3 nodes, rounded up).
    let limiter = RedisLimiter::builder(&url, "5/s".parse()?)
        .prefix("example")
        .timeout(Duration::from_millis(50))
        .build()
        .await?;
    let on_failure = FailMode::Local("2/s".parse()?);
    limiter.reset("user-1").await?;

    let mut answers = Vec::new();
    for _ in 0..7 {
        let exact = limiter.check("user-1").await?; // a typed RedisError if Redis fails
        answers.push(if exact.is_allowed() { "ok" } else { "429" });
    }
    println!("Redis up, exact:       {}", answers.join(" "));

    let Some(redis) = own.as_mut() else {
        println!("(stop your Redis and run again with it down to see the fail mode)");
        return Ok(());
    };
    redis.stop();
    let mut answers = Vec::new();
    for _ in 0..5 {
        let local = limiter.check_or("user-2", on_failure).await; // never an error
        answers.push(if local.is_allowed() { "ok" } else { "429" });
    }
    println!("Redis down, local 2/s: {}", answers.join(" "));
    match limiter.check("user-2").await {
        Ok(_) => println!("unexpected: Redis answered"),
        Err(e) => println!("check without a fail mode: {e}"),
    }
    let stats = limiter.stats();
    println!(
        "calls {}, errors {}, answered by the fail mode {}, short-circuited {}, breaker {:?}",
        stats.calls, stats.errors, stats.fail_mode_decisions, stats.short_circuited, stats.breaker
    );
    Ok(())
}
