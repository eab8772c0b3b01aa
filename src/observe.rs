//! What tollgate reports to the `metrics` facade (cargo feature `metrics`), under these
//! names, in Prometheus conventions:
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `tollgate_decisions_total` | counter | `limiter`, `outcome` (`allowed`, `denied`; the HTTP layer's `rejected` and `shadow_denied`) |
//! | `tollgate_keys` | gauge | `limiter` |
//! | `tollgate_in_flight` | gauge: slots held (concurrency limiters) | `limiter` |
//! | `tollgate_waiting` | gauge: callers in a key's line (concurrency limiters) | `limiter` |
//! | `tollgate_acquire_timeouts_total` | counter (concurrency limiters) | `limiter` |
//! | `tollgate_evictions_total` | counter | `limiter`, `reason` (`untouched`, `active`, `refused`) |
//! | `tollgate_sync_rounds_total` | counter | `limiter`, `result` (`ok`, `error`) |
//! | `tollgate_sync_round_duration_seconds` | histogram | `limiter` |
//! | `tollgate_sync_fallback` | gauge (0 or 1) | `limiter` |
//! | `tollgate_sync_nodes` | gauge | `limiter` |
//! | `tollgate_redis_errors_total` | counter | `limiter`, `kind` ([`RedisError::kind`](crate::redis::RedisError::kind)) |
//! | `tollgate_redis_calls_total` | counter | `limiter` |
//! | `tollgate_redis_cached_denies_total` | counter | `limiter` |
//! | `tollgate_redis_cached_keys` | gauge | `limiter` |
//! | `tollgate_redis_short_circuited_total` | counter | `limiter` |
//! | `tollgate_redis_fail_mode_decisions_total` | counter | `limiter` |
//! | `tollgate_redis_breaker_open` | gauge (0 closed, 1 open or half-open) | `limiter` |
//! | `tollgate_redis_breaker_opened_total` | counter | `limiter` |
//! | `tollgate_redis_leases_lost_total` | counter (Redis concurrency limiters) | `limiter` |
//!
//! A limiter's counters are exact totals, published (as absolute values) whenever
//! [`RateLimiter::stats`](crate::RateLimiter::stats) (or `RedisLimiter::stats`) runs
//! and, with the `tokio` feature when the limiter is built inside a runtime, every second
//! by a task that ends with the limiter. The breaker gauge also changes the moment the
//! breaker opens or closes. Without the `metrics` feature every function here does nothing.

#[cfg(feature = "metrics")]
use metrics::{counter, gauge};

use crate::store::StoreStats;

/// Publishes a limiter's totals.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn limiter(name: &str, stats: &StoreStats) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        for (outcome, total) in [("allowed", stats.allowed), ("denied", stats.denied)] {
            counter!("tollgate_decisions_total", "limiter" => limiter.clone(), "outcome" => outcome)
                .absolute(total);
        }
        gauge!("tollgate_keys", "limiter" => limiter.clone()).set(stats.keys as f64);
        for (reason, total) in [
            ("untouched", stats.evicted_untouched),
            ("active", stats.evicted_active),
            ("refused", stats.refused_new_keys),
        ] {
            counter!("tollgate_evictions_total", "limiter" => limiter.clone(), "reason" => reason)
                .absolute(total);
        }
    }
}

/// Inside a tokio runtime, runs `publish` on the value behind `weak` every second until
/// it is dropped (the task holds it weakly); outside one, does nothing.
#[cfg(all(feature = "metrics", feature = "tokio"))]
pub(crate) fn every_second<T: Send + Sync + 'static>(
    weak: std::sync::Weak<T>,
    publish: impl Fn(std::sync::Arc<T>) + Send + 'static,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut ticker = tokio::time::interval(std::time::Duration::from_secs(1));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let Some(value) = weak.upgrade() else {
                return;
            };
            publish(value);
        }
    });
}

/// Logs a deny (`debug`, target `tollgate`): the limiter's name and a short hash of the
/// key — never the key, which may be an API key or personal data. Costs one check of
/// the enabled level when no subscriber wants it, and nothing at all (no call on the
/// check path) without the `tracing` feature.
#[inline(always)]
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn denied<Q: std::hash::Hash + ?Sized>(
    name: &str,
    key: &Q,
    decision: &crate::decision::Decision,
) {
    #[cfg(feature = "tracing")]
    denied_event(name, key, decision);
}

#[cfg(feature = "tracing")]
#[cold]
#[inline(never)]
fn denied_event<Q: std::hash::Hash + ?Sized>(
    name: &str,
    key: &Q,
    decision: &crate::decision::Decision,
) {
    if tracing::enabled!(target: "tollgate", tracing::Level::DEBUG) {
        tracing::debug!(
            target: "tollgate",
            limiter = name,
            key_hash = %format_args!("{:08x}", short_hash(key)),
            retry_after_ms = decision.retry_after().map_or(0, |d| d.as_millis() as u64),
            "request denied"
        );
    }
}

/// Logs (`warn`, target `tollgate`) a plan resolver's answer that names no plan of the
/// limiter `name`: the default plan decided instead.
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn unknown_plan(name: &str, plan: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        limiter = name,
        plan,
        "the plan resolver named a plan the limiter does not have: the default plan decides"
    );
}

/// 32 bits of a fixed-seed hash: the same key gets the same hash on every node and run,
/// so log lines of one client can be matched, but the key cannot be read back.
#[cfg(feature = "tracing")]
pub(crate) fn short_hash<Q: std::hash::Hash + ?Sized>(key: &Q) -> u32 {
    const SEEDS: (u64, u64, u64, u64) = (
        0x243f_6a88_85a3_08d3,
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
    );
    let hash = ahash::RandomState::with_seeds(SEEDS.0, SEEDS.1, SEEDS.2, SEEDS.3).hash_one(key);
    (hash >> 32) as u32
}
