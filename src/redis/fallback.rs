//! What [`RedisLimiter`](super::RedisLimiter) decides when Redis cannot: the fail modes,
//! and the in-process limiters of [`FailMode::Local`] and [`FailMode::LocalShare`].

use std::sync::Arc;

use parking_lot::RwLock;

use crate::algorithm::Algorithm;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
pub use crate::fail_mode::FailMode;
use crate::limiter::RateLimiter;
use crate::quota::Quota;

/// `quota`'s share for one of `nodes` nodes (see [`FailMode::LocalShare`]).
pub(crate) fn share(quota: Quota, nodes: u64) -> Option<Quota> {
    let nodes = nodes.max(1);
    let (limit, burst) = (quota.limit(), quota.burst());
    let shared = if let Some(calendar) = quota.calendar() {
        // A calendar's periods cannot be stretched: at least one unit each.
        Quota::per_calendar((limit / nodes).max(1), calendar)
    } else if limit >= nodes {
        Quota::new(limit / nodes, quota.period())
    } else {
        let period = quota.period().checked_mul(u32::try_from(nodes).ok()?)?;
        Quota::new(limit, period)
    };
    shared
        .and_then(|q| q.with_burst((burst / nodes).max(1)))
        .ok()
}

/// The time source of the local limiters: the Redis limiter's caller clock, or a
/// monotonic one.
#[derive(Clone)]
pub(crate) enum LocalClock {
    Monotonic(MonotonicClock),
    Caller(Arc<dyn Clock>),
}

impl Clock for LocalClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        match self {
            Self::Monotonic(clock) => clock.now_ns(),
            Self::Caller(clock) => clock.now_ns(),
        }
    }

    fn unix_origin_ns(&self) -> u64 {
        match self {
            Self::Monotonic(clock) => clock.unix_origin_ns(),
            Self::Caller(clock) => clock.unix_origin_ns(),
        }
    }
}

type Local = RateLimiter<String, LocalClock>;

/// The in-process limiters of [`FailMode::Local`] and [`FailMode::LocalShare`], one per
/// set of quotas asked for, built on first use (an outage's first check), kept for the
/// next outage.
pub(crate) struct Fallbacks {
    algorithm: Algorithm,
    clock: LocalClock,
    name: Arc<str>,
    limiters: RwLock<Vec<(Vec<Quota>, Arc<Local>)>>,
}

impl Fallbacks {
    pub(crate) fn new(algorithm: Algorithm, clock: LocalClock, name: Arc<str>) -> Self {
        Self {
            algorithm,
            clock,
            name,
            limiters: RwLock::new(Vec::new()),
        }
    }

    /// The decision `mode` gives a request of cost `n` for `key` when Redis cannot
    /// decide. `quotas` are the Redis limiter's (its own, then its `also` quotas),
    /// `capacity` and `interval_ns` its capacity and emission interval, and `nodes` the
    /// live limiters last counted.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decide(
        &self,
        mode: FailMode,
        key: &str,
        n: u64,
        quotas: &[Quota],
        capacity: u64,
        interval_ns: u64,
        nodes: u64,
    ) -> Decision {
        let local = match mode {
            FailMode::Open => return Decision::allow(capacity, 0, 0),
            FailMode::Closed => return Decision::deny(capacity, 0, 0, interval_ns.max(1)),
            FailMode::Local(quota) => Some(vec![quota]),
            FailMode::LocalShare => quotas.iter().map(|&q| share(q, nodes)).collect(),
        };
        match local {
            Some(quotas) => match self.limiter(&quotas) {
                Some(local) => local.check_n(key, n).unwrap_or_else(|e| {
                    // The cost fits the Redis quota but not the insurance one: it can never
                    // pass locally, so deny it until Redis is back (one interval).
                    Decision::capacity_deny(e.capacity, interval_ns.max(1))
                }),
                None => Decision::deny(capacity, 0, 0, interval_ns.max(1)),
            },
            None => Decision::deny(capacity, 0, 0, interval_ns.max(1)),
        }
    }

    /// The local limiter for `quotas` (one or more), built if new; `None` only if the
    /// algorithm cannot hold them (then the caller denies, as `Closed`).
    fn limiter(&self, quotas: &[Quota]) -> Option<Arc<Local>> {
        if let Some((_, l)) = self.limiters.read().iter().find(|(q, _)| q == quotas) {
            return Some(Arc::clone(l));
        }
        let mut limiters = self.limiters.write();
        if let Some((_, l)) = limiters.iter().find(|(q, _)| q == quotas) {
            return Some(Arc::clone(l));
        }
        let (&first, also) = quotas.split_first()?;
        let mut builder = RateLimiter::builder(first)
            .algorithm(self.algorithm)
            .name(&format!("{}-local", self.name))
            .clock(self.clock.clone());
        for &quota in also {
            builder = builder.also(quota);
        }
        let built = Arc::new(builder.build().ok()?);
        limiters.push((quotas.to_vec(), Arc::clone(&built)));
        Some(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_to_at_most_the_quota() {
        let q = |s: &str| s.parse::<Quota>().unwrap();
        assert_eq!(share(q("100/s"), 4), Some(q("25/s")));
        assert_eq!(share(q("100/s burst 10"), 4), Some(q("25/s burst 2")));
        assert_eq!(share(q("10/s"), 3), Some(q("3/s")));
        // Below one unit per node and period: the period stretches instead.
        assert_eq!(
            share(q("1/s"), 16),
            Some(Quota::new(1, std::time::Duration::from_secs(16)).unwrap())
        );
        assert_eq!(share(q("100000/s"), 16), Some(q("6250/s")));
        assert_eq!(share(q("7/min"), 1), Some(q("7/min")));
        assert_eq!(
            share(q("7/min"), 0),
            Some(q("7/min")),
            "never divided by zero"
        );
        for (quota, nodes) in [
            ("1/s", 2u64),
            ("1/s", 16),
            ("100000/s", 2),
            ("100000/s", 16),
            ("5/s burst 3", 4),
        ] {
            let whole = q(quota);
            let part = share(whole, nodes).unwrap();
            // N shares' rate is at most the quota's.
            let rate = |x: Quota| x.limit() as f64 / x.period().as_secs_f64();
            assert!(
                nodes as f64 * rate(part) <= rate(whole) + 1e-9,
                "{quota} / {nodes}"
            );
            assert!(
                nodes * part.burst() <= whole.burst().max(nodes),
                "{quota} / {nodes}"
            );
        }
    }
}
