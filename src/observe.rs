//! What tollgate reports to the `metrics` facade (cargo feature `metrics`), under these
//! names, in Prometheus conventions:
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `tollgate_decisions_total` | counter | `limiter`, `outcome` (`allowed`, `denied`) |
//! | `tollgate_keys` | gauge | `limiter` |
//! | `tollgate_evictions_total` | counter | `limiter`, `reason` (`untouched`, `active`, `refused`) |
//! | `tollgate_sync_rounds_total` | counter | `limiter`, `result` (`ok`, `error`) |
//! | `tollgate_sync_round_duration_seconds` | histogram | `limiter` |
//! | `tollgate_sync_fallback` | gauge (0 or 1) | `limiter` |
//! | `tollgate_sync_nodes` | gauge | `limiter` |
//! | `tollgate_redis_errors_total` | counter | `limiter`, `kind` ([`RedisError::kind`](crate::redis::RedisError::kind)) |
//!
//! A limiter's counters are exact totals, published (as absolute values) whenever
//! [`RateLimiter::stats`](crate::RateLimiter::stats) runs and, with the `tokio` feature
//! when the limiter is built inside a runtime, every second by a task that ends with the
//! limiter. Without the `metrics` feature every function here does nothing.

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

/// Publishes one sync round: how it ended, how long it took, and the node's state after
/// it.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn sync_round(
    name: &str,
    ok: bool,
    took: std::time::Duration,
    fallback: bool,
    nodes: u64,
) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        let result = if ok { "ok" } else { "error" };
        counter!("tollgate_sync_rounds_total", "limiter" => limiter.clone(), "result" => result)
            .increment(1);
        metrics::histogram!("tollgate_sync_round_duration_seconds", "limiter" => limiter.clone())
            .record(took.as_secs_f64());
        sync_state(name, fallback, nodes);
    }
}

/// Publishes whether a synced limiter is in fallback, and how many nodes it sees.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn sync_state(name: &str, fallback: bool, nodes: u64) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        gauge!("tollgate_sync_fallback", "limiter" => limiter.clone()).set(if fallback {
            1.0
        } else {
            0.0
        });
        gauge!("tollgate_sync_nodes", "limiter" => limiter).set(nodes as f64);
    }
}

/// Counts an error of the Redis tier.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn redis_error(name: &str, error: &crate::redis::RedisError) {
    #[cfg(feature = "metrics")]
    counter!("tollgate_redis_errors_total", "limiter" => name.to_owned(), "kind" => error.kind())
        .increment(1);
}
