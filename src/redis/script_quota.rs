//! A quota in the scripts' units, and the scripts' arguments: the one place that encodes
//! them, for the Redis tier and the sync.

use super::RedisError;
use crate::algorithm::Algorithm;
use crate::calendar::{CalendarPeriod, CalendarUnit};
use crate::error::ConfigError;
use crate::quota::Quota;

/// Integers in Lua's doubles are exact below this.
const LUA_EXACT: u64 = 1 << 53;

/// A quota in the scripts' units: integer microseconds.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ScriptQuota {
    TokenBucket {
        t: u64,
        tau: u64,
        burst: u64,
    },
    Window {
        limit: u64,
        period: u64,
    },
    /// A window counter on calendar periods, whose bounds travel with each call.
    Calendar {
        limit: u64,
        calendar: CalendarPeriod,
    },
}

/// The time a call's calendar bounds are computed for: the caller's wall time, and the
/// Unix instant of the script's time 0 (0 when the script reads the server's `TIME`;
/// the caller clock's origin when the caller passes its own time).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScriptTime {
    pub(crate) wall_ns: u64,
    pub(crate) base_ns: u64,
}

impl ScriptQuota {
    pub(crate) fn new(algorithm: Algorithm, quota: Quota) -> Result<Self, RedisError> {
        crate::algorithm::windows_only(algorithm, quota)?;
        if let Some(calendar) = quota.calendar() {
            return Self::calendar(algorithm, quota.limit(), calendar);
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

    /// A window counter of `limit` per period of `calendar`. The sliding window's
    /// products (`limit × a period's µs`) must stay exact in Lua's doubles for the
    /// longest period of the unit (a day of 25 hours, a month of 31 days and an hour).
    fn calendar(
        algorithm: Algorithm,
        limit: u64,
        calendar: CalendarPeriod,
    ) -> Result<Self, RedisError> {
        const HOUR_US: u64 = 3_600_000_000;
        const DAY_US: u64 = 24 * HOUR_US;
        let longest = match calendar.unit() {
            CalendarUnit::Day => DAY_US + HOUR_US,
            CalendarUnit::Week => 7 * DAY_US + HOUR_US,
            CalendarUnit::Month => 31 * DAY_US + HOUR_US,
            CalendarUnit::Year => 366 * DAY_US + HOUR_US,
        };
        if algorithm == Algorithm::SlidingWindow
            && u128::from(limit) * u128::from(longest) >= u128::from(LUA_EXACT)
        {
            return Err(ConfigError::ExceedsRedisPrecision(
                "limit × the calendar period's longest length (µs) must stay below 2^53 for \
                 the sliding window (about 3,300 a month, 100,000 a day); use the fixed window",
            )
            .into());
        }
        if limit >= LUA_EXACT {
            return Err(
                ConfigError::ExceedsRedisPrecision("the limit must stay below 2^53").into(),
            );
        }
        Ok(Self::Calendar { limit, calendar })
    }

    /// Appends the quota's two script arguments: `T, tau` for the token bucket, `limit,
    /// period` for the windows, `limit, c<id>,<index>,<starts…>` on calendar periods
    /// (see window_args.lua), computed at `time()`.
    pub(crate) fn push_args(&self, cmd: &mut redis::Cmd, time: impl FnOnce() -> ScriptTime) {
        match *self {
            Self::TokenBucket { t, tau, .. } => cmd.arg(t).arg(tau),
            Self::Window { limit, period } => cmd.arg(limit).arg(period),
            Self::Calendar { limit, calendar } => {
                cmd.arg(limit).arg(calendar_arg(calendar, time()))
            }
        };
    }

    /// The most a key may hold: the burst, or the window's limit (a decision's
    /// `limit`).
    pub(crate) fn limit(&self) -> u64 {
        match *self {
            Self::TokenBucket { burst, .. } => burst,
            Self::Window { limit, .. } | Self::Calendar { limit, .. } => limit,
        }
    }

    /// τ = (burst − 1)·T in µs for the token bucket; 0 for the windows.
    pub(crate) fn tau(&self) -> u64 {
        match *self {
            Self::TokenBucket { tau, .. } => tau,
            Self::Window { .. } | Self::Calendar { .. } => 0,
        }
    }
}

/// A calendar quota's period argument at `time`: the calendar's id (stored where a
/// rolling quota stores its period, so that a change of calendar starts its windows
/// afresh), the index of the period holding the wall time, and the starts of the periods
/// from the one before it to three after, in µs of the script's time.
pub(crate) fn calendar_arg(calendar: CalendarPeriod, time: ScriptTime) -> String {
    let index = calendar.span_at(time.wall_ns).index;
    let start = |k: u64| {
        (calendar
            .start_of((index + k).saturating_sub(1))
            .saturating_sub(time.base_ns))
            / 1_000
    };
    format!(
        "c-{},{index},{},{},{},{},{}",
        calendar_id(calendar),
        start(0),
        start(1),
        start(2),
        start(3),
        start(4)
    )
}

/// A calendar's id in Redis: the FNV-1a hash of its description, below 2^52 and above
/// 0 (so that Lua holds it exactly), the same in every process.
fn calendar_id(calendar: CalendarPeriod) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in calendar.to_string().bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash % (1 << 52) + 1
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
        ScriptQuota::Calendar { .. } => {
            return Err(ConfigError::Unsupported(
                "calendar periods in the sync: use the Redis tier (RedisLimiter) or the \
                 process (RateLimiter) for calendar quotas, or a rolling period here",
            )
            .into());
        }
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
