//! The single criterion entry point: tollgate and its peers on the same workloads, in the
//! same run. Figures are nanoseconds per check per thread; see benches/README.md.
//!
//! Run as `TOLLGATE_MEMORY_PROBE=<name>:<keys> <bench binary>`, the binary measures one
//! contender's resident memory per key in a fresh process instead.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group};
use governor::clock::DefaultClock;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use tollgate::{Algorithm, Quota, RateLimiter};

#[path = "../support/reference.rs"]
mod reference;

mod calendar;
mod common;
mod in_flight;
mod local;
mod memory;
mod plans;
mod redis_tier;
mod tails;
mod tiers;

use calendar::*;
use common::*;
use in_flight::*;
use local::*;
use memory::*;
use plans::*;
use redis_tier::*;
use tails::*;
use tiers::*;

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = keyed_10k, in_flight_10k, calendar_10k, plans_1m, by_key_count, settle_10k, also_10k, churn_1k, reference_10k, counters, hot_key_denied, string_keys, config_read, redis_tier, redis_cluster, sync_check, http_layer, redis_layer_flood, redis_cached_deny
}

fn main() {
    if let Ok(spec) = std::env::var(PROBE) {
        memory_probe(&spec);
        return;
    }
    if let Ok(spec) = std::env::var(RECLAIM_PROBE) {
        reclaim_probe(&spec);
        return;
    }
    if let Ok(spec) = std::env::var(GROWTH_PROBE) {
        growth_probe(&spec);
        return;
    }
    benches();
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    // `TOLLGATE_PROBES=growth,quota_change` runs only those of the probes below.
    let only = std::env::var(PROBES).ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    if wanted("memory") {
        memory_per_key(quick);
    }
    if wanted("reclamation") {
        reclamation_memory(quick);
    }
    if wanted("growth") {
        growth_tail(quick);
    }
    if wanted("quota_change") {
        quota_change_tail(quick);
    }
    if wanted("also") {
        two_quotas_alternating(quick);
    }
    if wanted("in_flight") {
        in_flight_alternating(quick);
    }
    if wanted("calendar") {
        calendar_alternating(quick);
    }
    if wanted("plans") {
        plans_alternating(quick);
    }
    if wanted("redis_box") {
        redis_box_and_plans_alternating();
    }
    Criterion::default().configure_from_args().final_summary();
}
