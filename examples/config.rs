//! Limiters from a TOML file (cargo feature `serde`).
//!
//! ```text
//! cargo run --example config                      # examples/limiters.toml
//! cargo run --example config -- my-limiters.toml
//! ```
//!
//! Each `[limiters.NAME]` table is a `tollgate::config::LimiterConfig`; a mistake is
//! reported with the field it is in, and the program exits with status 2.

use std::collections::BTreeMap;
use std::process::ExitCode;

use serde::Deserialize;
use tollgate::RateLimiter;
use tollgate::config::LimiterConfig;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    limiters: BTreeMap<String, LimiterConfig>,
}

fn main() -> ExitCode {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limiters.toml").to_owned()
    });
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("error: cannot read {path}: {e}");
            return ExitCode::from(2);
        }
    };
    let file: File = match toml::from_str(&text) {
        Ok(file) => file,
        Err(e) => {
            eprintln!("error: {path}: {e}");
            return ExitCode::from(2);
        }
    };
    for (name, mut config) in file.limiters {
        // The table's name names the limiter (for metrics and logs).
        config.name = name;
        let limiter: RateLimiter<String> = match config.build() {
            Ok(limiter) => limiter,
            Err(e) => {
                eprintln!("error: {path}: limiter {:?}: {e}", config.name);
                return ExitCode::from(2);
            }
        };
        let first = limiter.check("someone");
        println!(
            "{}: {} ({}), {} own quotas; a first check: allowed={} remaining={}",
            limiter.name(),
            limiter.quota(),
            limiter.algorithm(),
            config.quotas.len(),
            first.is_allowed(),
            first.remaining(),
        );
    }
    ExitCode::SUCCESS
}
