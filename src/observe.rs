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
//! | `tollgate_redis_calls_total` | counter | `limiter` |
//! | `tollgate_redis_cached_denies_total` | counter | `limiter` |
//! | `tollgate_redis_cached_keys` | gauge | `limiter` |
//! | `tollgate_redis_short_circuited_total` | counter | `limiter` |
//! | `tollgate_redis_fail_mode_decisions_total` | counter | `limiter` |
//! | `tollgate_redis_breaker_open` | gauge (0 closed, 1 open or half-open) | `limiter` |
//! | `tollgate_redis_breaker_opened_total` | counter | `limiter` |
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

/// Counts a request the HTTP layer rejected before deciding (no key, or a key it
/// refuses), as `tollgate_decisions_total{outcome="rejected", reason}`.
#[cfg(feature = "tower")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn http_rejected(name: &str, why: crate::http::KeyRejection) {
    #[cfg(feature = "metrics")]
    counter!(
        "tollgate_decisions_total",
        "limiter" => name.to_owned(),
        "outcome" => "rejected",
        "reason" => why.reason()
    )
    .increment(1);
    #[cfg(feature = "tracing")]
    tracing::debug!(target: "tollgate", limiter = name, reason = why.reason(), "http: request rejected before a decision");
}

/// Counts an error of the Redis tier.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn redis_error(name: &str, error: &crate::redis::RedisError) {
    #[cfg(feature = "metrics")]
    counter!("tollgate_redis_errors_total", "limiter" => name.to_owned(), "kind" => error.kind())
        .increment(1);
}

/// Publishes a Redis limiter's totals.
#[cfg(feature = "redis")]
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

#[cfg(all(feature = "redis", feature = "metrics"))]
fn redis_breaker_gauge(name: &str, state: crate::redis::BreakerState) {
    let open = if state == crate::redis::BreakerState::Closed {
        0.0
    } else {
        1.0
    };
    gauge!("tollgate_redis_breaker_open", "limiter" => name.to_owned()).set(open);
}

/// The Redis tier's circuit breaker opened (`warn`) or closed (`info`).
#[cfg(feature = "redis")]
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

/// 32 bits of a fixed-seed hash: the same key gets the same hash on every node and run,
/// so log lines of one client can be matched, but the key cannot be read back.
#[cfg(feature = "tracing")]
fn short_hash<Q: std::hash::Hash + ?Sized>(key: &Q) -> u32 {
    const SEEDS: (u64, u64, u64, u64) = (
        0x243f_6a88_85a3_08d3,
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
    );
    let hash = ahash::RandomState::with_seeds(SEEDS.0, SEEDS.1, SEEDS.2, SEEDS.3).hash_one(key);
    (hash >> 32) as u32
}

/// A synced limiter's sync task died (`error`): the fallback applies from now on.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn sync_died(name: &str, policy: &dyn std::fmt::Debug) {
    #[cfg(feature = "tracing")]
    tracing::error!(
        target: "tollgate",
        limiter = name,
        fallback = ?policy,
        "sync: the sync task died (a bug); applying the fallback for the limiter's life"
    );
}

/// A sync round failed with an error of `kind` (`message` has no password in it):
/// `warn` when the kind is new (the first failure of a run, or another cause), `debug`
/// after.
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn sync_error(name: &str, kind: &str, message: &str, changed: bool) {
    #[cfg(feature = "tracing")]
    if changed {
        tracing::warn!(target: "tollgate", limiter = name, kind, error = message, "sync: a round failed");
    } else {
        tracing::debug!(target: "tollgate", limiter = name, kind, error = message, "sync: a round failed");
    }
}

/// A synced limiter's node went past its reserved shares in an outage: `keys` keys got
/// their one-time budget this interval (`warn`); or its cold tier lapsed (`keys` 0:
/// cold keys spend only what their share held) (`warn`).
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn sync_budget(name: &str, keys: u64) {
    #[cfg(feature = "tracing")]
    if keys > 0 {
        tracing::warn!(
            target: "tollgate",
            limiter = name,
            keys,
            "sync: Redis no longer reserves these keys' shares; each gets its one-time budget, then nothing until Redis answers"
        );
    } else {
        tracing::warn!(
            target: "tollgate",
            limiter = name,
            "sync: the keys turned hot were not read for share_ttl; cold keys spend what their share held, then nothing until Redis answers"
        );
    }
}

/// A synced limiter's node fell back (`warn`) or came back (`info`).
#[cfg(feature = "redis")]
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn sync_fallback(name: &str, entered: bool, policy: &dyn std::fmt::Debug) {
    #[cfg(feature = "tracing")]
    if entered {
        tracing::warn!(
            target: "tollgate",
            limiter = name,
            fallback = ?policy,
            "sync: Redis has not answered for the staleness bound; applying the fallback"
        );
    } else {
        tracing::info!(target: "tollgate", limiter = name, "sync: Redis answers again; fallback over");
    }
}

/// The Redis tier failed (`warn` for the first failure of a run, `debug` after) or
/// answered again after failing (`info`).
#[cfg(feature = "redis")]
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
