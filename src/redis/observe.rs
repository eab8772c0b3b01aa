//! The Redis tier's metrics and events (`tollgate_redis_*`; see [`crate::observe`] for
//! how they are published). Without the `metrics` and `tracing` features these do nothing.

#[cfg(feature = "metrics")]
use metrics::{counter, gauge};

/// Counts an error of the Redis tier.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn redis_error(name: &str, error: &crate::redis::RedisError) {
    #[cfg(feature = "metrics")]
    counter!("tollgate_redis_errors_total", "limiter" => name.to_owned(), "kind" => error.kind())
        .increment(1);
}

/// Publishes a Redis limiter's totals.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn redis_limiter(name: &str, stats: &crate::redis::RedisStats) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        for (metric, total) in [
            ("tollgate_redis_calls_total", stats.calls),
            ("tollgate_redis_cached_denies_total", stats.cached_denies),
            (
                "tollgate_redis_short_circuited_total",
                stats.short_circuited,
            ),
            (
                "tollgate_redis_fail_mode_decisions_total",
                stats.fail_mode_decisions,
            ),
            ("tollgate_redis_breaker_opened_total", stats.breaker_opened),
        ] {
            counter!(metric, "limiter" => limiter.clone()).absolute(total);
        }
        gauge!("tollgate_redis_cached_keys", "limiter" => limiter.clone())
            .set(stats.cached_keys as f64);
        redis_breaker_gauge(name, stats.breaker);
    }
}

/// Publishes a Redis concurrency limiter's totals: its permits and refusals as
/// decisions, its calls and fail-mode decisions as the Redis tier's, the leases it holds
/// as the slots in flight.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn redis_concurrency(name: &str, stats: &crate::redis::RedisConcurrencyStats) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        for (outcome, total) in [("allowed", stats.acquired), ("denied", stats.refused)] {
            counter!("tollgate_decisions_total", "limiter" => limiter.clone(), "outcome" => outcome)
                .absolute(total);
        }
        for (metric, total) in [
            ("tollgate_redis_calls_total", stats.calls),
            ("tollgate_redis_cached_denies_total", stats.cached_denies),
            (
                "tollgate_redis_fail_mode_decisions_total",
                stats.fail_mode_decisions,
            ),
            ("tollgate_redis_leases_lost_total", stats.leases_lost),
        ] {
            counter!(metric, "limiter" => limiter.clone()).absolute(total);
        }
        gauge!("tollgate_in_flight", "limiter" => limiter).set(stats.leases as f64);
        redis_breaker_gauge(name, stats.breaker);
    }
}

#[cfg(feature = "metrics")]
fn redis_breaker_gauge(name: &str, state: crate::redis::BreakerState) {
    let open = if state == crate::redis::BreakerState::Closed {
        0.0
    } else {
        1.0
    };
    gauge!("tollgate_redis_breaker_open", "limiter" => name.to_owned()).set(open);
}

/// The Redis tier's circuit breaker opened (`warn`) or closed (`info`).
#[cfg_attr(
    not(any(feature = "metrics", feature = "tracing")),
    allow(unused_variables)
)]
pub(crate) fn redis_breaker(name: &str, state: crate::redis::BreakerState) {
    #[cfg(feature = "metrics")]
    redis_breaker_gauge(name, state);
    #[cfg(feature = "tracing")]
    if state == crate::redis::BreakerState::Closed {
        tracing::info!(target: "tollgate", limiter = name, "redis tier: circuit breaker closed");
    } else {
        tracing::warn!(
            target: "tollgate",
            limiter = name,
            "redis tier: circuit breaker open; checks answer by their fail mode"
        );
    }
}

/// The Redis tier failed (`warn` for the first failure of a run, `debug` after) or
/// answered again after failing (`info`).
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn redis_health(name: &str, error: Option<&crate::redis::RedisError>, changed: bool) {
    #[cfg(feature = "tracing")]
    match (error, changed) {
        (Some(e), true) => tracing::warn!(
            target: "tollgate",
            limiter = name,
            kind = e.kind(),
            error = %e,
            "redis tier: a check failed"
        ),
        (Some(e), false) => tracing::debug!(
            target: "tollgate",
            limiter = name,
            kind = e.kind(),
            error = %e,
            "redis tier: a check failed again"
        ),
        (None, _) => {
            tracing::info!(target: "tollgate", limiter = name, "redis tier: answering again")
        }
    }
}
