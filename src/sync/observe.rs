//! The sync's metrics and events (`tollgate_sync_*`; see [`crate::observe`] for how they
//! are published). Without the `metrics` and `tracing` features these do nothing.

#[cfg(feature = "metrics")]
use metrics::{counter, gauge};

/// Publishes one sync round: how it ended, how long it took, and the node's state after
/// it.
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

/// A synced limiter's sync task died (`error`): the fallback applies from now on.
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

/// Another node of a synced limiter's prefix syncs by other terms (`warn`): which setting,
/// and both values.
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
pub(crate) fn sync_disagreement(name: &str, setting: &str, ours: &str, theirs: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        limiter = name,
        setting,
        ours,
        theirs,
        "sync: another node of this prefix syncs by other terms; every node of a prefix must agree, or the bound does not hold"
    );
}
