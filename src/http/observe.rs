//! The HTTP layer's own metric and event: requests rejected before a decision. Without
//! the `metrics` and `tracing` features these do nothing.

#[cfg(feature = "metrics")]
use metrics::counter;

/// Counts a request the HTTP layer rejected before deciding (no key, or a key it
/// refuses), as `tollgate_decisions_total{outcome="rejected", reason}`.
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
