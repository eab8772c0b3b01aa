//! What a concurrency limiter reports: its counters through the `metrics` facade
//! (names in [`crate::observe`]'s table) and a `tracing` event per refusal. Without the
//! `metrics` and `tracing` features these do nothing.

#[cfg(feature = "metrics")]
use metrics::{counter, gauge};

use super::{ConcurrencyError, ConcurrencyStats};

/// Publishes a concurrency limiter's totals and gauges.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(super) fn publish(name: &str, stats: &ConcurrencyStats) {
    #[cfg(feature = "metrics")]
    {
        let limiter = name.to_owned();
        for (outcome, total) in [("allowed", stats.acquired), ("denied", stats.denied)] {
            counter!("tollgate_decisions_total", "limiter" => limiter.clone(), "outcome" => outcome)
                .absolute(total);
        }
        counter!("tollgate_acquire_timeouts_total", "limiter" => limiter.clone())
            .absolute(stats.timed_out);
        gauge!("tollgate_keys", "limiter" => limiter.clone()).set(stats.keys as f64);
        gauge!("tollgate_in_flight", "limiter" => limiter.clone()).set(stats.in_flight as f64);
        gauge!("tollgate_waiting", "limiter" => limiter).set(stats.waiting as f64);
    }
}

/// Logs a refused permit (`debug`, target `tollgate`), as the rate limiters do a deny: the
/// limiter's name, a short hash of the key (never the key) and why.
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(super) fn refused<Q: std::hash::Hash + ?Sized>(name: &str, key: &Q, error: &ConcurrencyError) {
    #[cfg(feature = "tracing")]
    if tracing::enabled!(target: "tollgate", tracing::Level::DEBUG) {
        tracing::debug!(
            target: "tollgate",
            limiter = name,
            key_hash = %format_args!("{:08x}", crate::observe::short_hash(key)),
            reason = %error,
            "permit refused"
        );
    }
}
