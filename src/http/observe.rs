//! The HTTP layer's own metrics and events: requests rejected before a decision, and
//! denies that shadow mode let through. Without the `metrics` and `tracing` features
//! these do nothing.

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

/// Counts a deny that shadow mode let through, as
/// `tollgate_decisions_total{outcome="shadow_denied"}`. The limiter still counts it as
/// `denied` (it decided so), so `denied − shadow_denied` is what was enforced.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn shadow_denied(name: &str) {
    #[cfg(feature = "metrics")]
    counter!(
        "tollgate_decisions_total",
        "limiter" => name.to_owned(),
        "outcome" => "shadow_denied"
    )
    .increment(1);
    #[cfg(feature = "tracing")]
    tracing::debug!(target: "tollgate", limiter = name, "http: shadow mode let a denied request through");
}
