//! A quota in the scripts' units, and the scripts' arguments: the one place that encodes
//! them, for the Redis tier and the sync.

use super::RedisError;
use crate::algorithm::Algorithm;
use crate::error::ConfigError;
use crate::quota::Quota;

/// Integers in Lua's doubles are exact below this.
const LUA_EXACT: u64 = 1 << 53;

/// A quota in the scripts' units: integer microseconds.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ScriptQuota {
    TokenBucket { t: u64, tau: u64, burst: u64 },
    Window { limit: u64, period: u64 },
}

impl ScriptQuota {
    pub(crate) fn new(algorithm: Algorithm, quota: Quota) -> Result<Self, RedisError> {
        crate::algorithm::windows_only(algorithm, quota)?;
        if quota.calendar().is_some() {
            return Err(ConfigError::Unsupported(
                "calendar periods in the Redis tier and the sync: they run in the process \
                 (RateLimiter) for now; use a rolling period such as \"1000/d\" here",
            )
            .into());
        }
        let period_ns = quota.period_ns();
        if period_ns % 1_000 != 0 {
            return Err(ConfigError::PeriodNotWholeMicroseconds(period_ns).into());
        }
        let period = period_ns / 1_000;
        let limit = quota.limit();
        match algorithm {
            Algorithm::TokenBucket => {
                let t = period / limit;
                let lost = u128::from(period % limit);
                if t == 0 || lost * 10_000 > u128::from(limit) * u128::from(t) {
                    return Err(ConfigError::RateNotRepresentable { limit, period_ns }.into());
                }
                let tau = t
                    .checked_mul(quota.burst() - 1)
                    .filter(|&tau| tau < LUA_EXACT / 2);
                let Some(tau) = tau else {
                    return Err(ConfigError::ExceedsRedisPrecision(
                        "burst × (period / limit) must stay below 2^52 µs",
                    )
                    .into());
                };
                Ok(Self::TokenBucket {
                    t,
                    tau,
                    burst: quota.burst(),
                })
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                if u128::from(limit) * u128::from(period) >= u128::from(LUA_EXACT) {
                    return Err(ConfigError::ExceedsRedisPrecision(
                        "limit × period (µs) must stay below 2^53",
                    )
                    .into());
                }
                Ok(Self::Window { limit, period })
            }
            other => Err(RedisError::UnsupportedAlgorithm(other)),
        }
    }

    /// The quota's two script arguments: `[T, tau]` for the token bucket, `[limit,
    /// period]` for the windows.
    pub(crate) fn args(&self) -> [u64; 2] {
        match *self {
            Self::TokenBucket { t, tau, .. } => [t, tau],
            Self::Window { limit, period } => [limit, period],
        }
    }

    /// τ = (burst − 1)·T in µs for the token bucket; 0 for the windows.
    pub(crate) fn tau(&self) -> u64 {
        match *self {
            Self::TokenBucket { tau, .. } => tau,
            Self::Window { .. } => 0,
        }
    }
}

/// The most one request can cost under `quota`: the burst for the token bucket, the
/// limit for the windows.
pub(crate) fn capacity_of(algorithm: Algorithm, quota: Quota) -> u64 {
    match algorithm {
        Algorithm::TokenBucket => quota.burst(),
        _ => quota.limit(),
    }
}

/// The quota arguments the scripts take for `algorithm`, in microseconds:
/// `[T, tau, burst]` for the token bucket, `[limit, period, 0]` for the windows.
pub(crate) fn script_args(algorithm: Algorithm, quota: Quota) -> Result<[u64; 3], RedisError> {
    Ok(match ScriptQuota::new(algorithm, quota)? {
        ScriptQuota::TokenBucket { t, tau, burst } => [t, tau, burst],
        ScriptQuota::Window { limit, period } => [limit, period, 0],
    })
}

/// The algorithm's part of the Redis key: `tb`, `sw` or `fw`.
pub(crate) fn short_name(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::SlidingWindow => "sw",
        _ => "fw",
    }
}
