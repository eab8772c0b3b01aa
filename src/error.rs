//! Error types returned by tollgate's constructors and checks.

use std::fmt;

/// A limiter or quota was configured with values tollgate cannot honour.
///
/// Every variant's message says what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The quota's limit was zero: a limit must admit at least one request per period.
    ZeroLimit,
    /// The quota's period was zero.
    ZeroPeriod,
    /// The quota's period does not fit in 64-bit nanoseconds (about 584 years).
    PeriodTooLong,
    /// The quota's burst was zero.
    ZeroBurst,
    /// `period / limit` cannot be held in whole nanoseconds without changing the rate by
    /// more than one part in 10,000 (for example 10^12 per second).
    RateNotRepresentable {
        /// The quota's limit.
        limit: u64,
        /// The quota's period in nanoseconds.
        period_ns: u64,
    },
    /// `burst × (period / limit)` does not fit in 64-bit nanoseconds.
    BurstTooLarge {
        /// The burst that was asked for.
        burst: u64,
        /// The largest burst this rate allows.
        max: u64,
    },
    /// The algorithm cannot hold a limit this large in its per-key state.
    LimitTooLarge {
        /// The algorithm's name.
        algorithm: &'static str,
        /// The limit that was asked for.
        limit: u64,
        /// The largest limit the algorithm supports.
        max: u64,
    },
    /// The shard count was zero, not a power of two, or above
    /// [`MAX_SHARDS`](crate::MAX_SHARDS).
    InvalidShards(usize),
    /// `max_keys` was zero.
    ZeroMaxKeys,
    /// [`Builder::expected_keys`](crate::Builder::expected_keys) asked for more keys than
    /// the tables can be sized for up front.
    ExpectedKeysTooMany {
        /// The keys asked for.
        expected: usize,
        /// Why: more than `max_keys`, than the key tables can hold, or than fit in this
        /// machine's memory.
        why: &'static str,
    },
    /// A jitter whose minimum exceeds its maximum.
    InvalidJitter {
        /// The minimum asked for.
        min: std::time::Duration,
        /// The maximum asked for.
        max: std::time::Duration,
    },
    /// The Redis tier works in whole microseconds, and this period is not one.
    PeriodNotWholeMicroseconds(u64),
    /// The quota's numbers would not be exact in the Redis scripts' arithmetic.
    ExceedsRedisPrecision(&'static str),
    /// A Redis key prefix may not contain `{` or `}` (they delimit the hash tag).
    InvalidPrefix(String),
    /// The operation is not available in this configuration (the message says why).
    Unsupported(&'static str),
    /// The operation needs to run inside a tokio runtime.
    NoRuntime,
    /// A network in CIDR notation that could not be parsed.
    InvalidCidr(String),
    /// A string that is not a valid HTTP header name.
    InvalidHeaderName(String),
    /// An algorithm name that is not one of [`Algorithm::name`](crate::Algorithm::name)'s.
    UnknownAlgorithm(String),
    /// A setting of the background sync is out of range.
    InvalidSyncSetting {
        /// The setting's name (the `RedisSync` method).
        setting: &'static str,
        /// The value given.
        value: String,
        /// The values it accepts.
        expected: &'static str,
    },
    /// A setting of the Redis tier (`RedisBuilder`) is out of range.
    InvalidRedisSetting {
        /// The setting's name (the `RedisBuilder` method).
        setting: &'static str,
        /// The value given.
        value: String,
        /// The values it accepts.
        expected: &'static str,
    },
    /// A Redis URL that cannot be parsed (any password in it is redacted).
    InvalidRedisUrl {
        /// The URL, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Redis could not be reached at start, and the configuration requires it.
    RedisUnreachable {
        /// The URL, password redacted.
        url: String,
        /// The error (which never contains the password).
        reason: String,
    },
    /// The sentinels answered, and none monitors a primary by this master name.
    UnknownSentinelMaster(String),
    /// Another synced limiter of this process already uses this prefix and algorithm.
    PrefixInUse(String),
    /// Another node of this synced limiter's prefix syncs by other terms (seen in Redis
    /// at build, with [`RedisSync::require_connection`](crate::sync::RedisSync::require_connection)):
    /// nodes that share a prefix share its keys' state, and must agree on the algorithm,
    /// the mode, the cold tier and the default quota.
    SyncSettingsDiffer {
        /// `algorithm`, `mode`, `cold_keys` or `quota`.
        setting: &'static str,
        /// This limiter's value.
        ours: String,
        /// The other node's.
        theirs: String,
    },
    /// A quota string such as `"100/s burst 200"` could not be parsed.
    InvalidQuotaString {
        /// The string as given.
        input: String,
        /// Which part is wrong, and how to write it.
        reason: String,
    },
    /// A key in a configuration's per-key quotas is not a key of the limiter's type.
    InvalidKey(String),
    /// A time zone name the calendar cannot use.
    UnknownTimeZone {
        /// The name as given.
        zone: String,
        /// Why: not in the bundled database, or the `calendar` feature is off.
        why: &'static str,
    },
    /// A calendar anchor day outside 1 to 31, or on a unit other than the month.
    InvalidAnchor {
        /// The calendar unit it was given for.
        unit: &'static str,
        /// The day asked for.
        day: u64,
    },
    /// A penalty (`block_for`, `block_after`) that blocks nothing.
    InvalidPenalty(&'static str),
    /// A calendar period with an algorithm or tier that has no windows to align.
    CalendarUnsupported {
        /// The algorithm or tier.
        by: &'static str,
    },
    /// A change of a limiter's quotas ([`RateLimiter::set_quotas`](crate::RateLimiter::set_quotas),
    /// a plan's redefinition) that does not give one quota for each it holds.
    QuotaCount {
        /// The quotas the limiter holds.
        held: usize,
        /// The quotas given.
        given: usize,
    },
    /// A plan name that no plan of the limiter has.
    UnknownPlan(String),
    /// A plan defined twice, or with no quota, or an invalid set of plans (the reason
    /// says which).
    InvalidPlan {
        /// The plan's name.
        plan: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroLimit => f.write_str("quota limit is 0: allow at least 1 request per period"),
            Self::ZeroPeriod => f.write_str("quota period is 0: use a period of at least 1ns"),
            Self::PeriodTooLong => {
                f.write_str("quota period is longer than u64 nanoseconds (~584 years): shorten it")
            }
            Self::ZeroBurst => f.write_str("quota burst is 0: allow a burst of at least 1"),
            Self::RateNotRepresentable { limit, period_ns } => write!(
                f,
                "rate {limit} per {period_ns}ns cannot be held as a whole-nanosecond interval \
                 within 0.01%: lower the limit or lengthen the period"
            ),
            Self::BurstTooLarge { burst, max } => write!(
                f,
                "burst {burst} is too large for this rate: use a burst of at most {max}"
            ),
            Self::LimitTooLarge {
                algorithm,
                limit,
                max,
            } => write!(
                f,
                "limit {limit} is too large for {algorithm}: use at most {max} per period, \
                 or another algorithm"
            ),
            Self::InvalidShards(n) => write!(
                f,
                "shard count {n} is invalid: use a power of two from 1 to 65,536 (for example 16)"
            ),
            Self::ZeroMaxKeys => f.write_str("max_keys is 0: allow at least 1 key"),
            Self::ExpectedKeysTooMany { expected, why } => write!(
                f,
                "expected_keys {expected} cannot be sized for up front: {why}"
            ),
            Self::InvalidJitter { min, max } => write!(
                f,
                "jitter minimum {min:?} exceeds its maximum {max:?}: swap them"
            ),
            Self::PeriodNotWholeMicroseconds(ns) => write!(
                f,
                "period {ns}ns is not a whole number of microseconds, which the Redis tier needs: \
                 round the period to whole microseconds (for example \"100/1ms\", not \"100/1500ns\")"
            ),
            Self::ExceedsRedisPrecision(what) => {
                write!(
                    f,
                    "quota too large for the Redis tier: {what}; lower the limit or the burst, \
                     or use the local or synced limiter"
                )
            }
            Self::InvalidPrefix(prefix) => write!(
                f,
                "redis key prefix {prefix:?} contains a brace: remove {{ and }} from it"
            ),
            Self::Unsupported(why) => write!(f, "not supported: {why}"),
            Self::NoRuntime => f.write_str(
                "no tokio runtime: start the sync from within a tokio runtime (e.g. #[tokio::main])",
            ),
            Self::InvalidCidr(what) => {
                write!(f, "invalid network {what}: write it as 10.0.0.0/8 or 2001:db8::/32")
            }
            Self::InvalidHeaderName(name) => write!(
                f,
                "invalid header name {name:?}: use letters, digits and dashes (for example x-api-key)"
            ),
            Self::UnknownAlgorithm(name) => write!(
                f,
                "unknown algorithm {name:?}: use token-bucket, sliding-window, fixed-window, \
                 sliding-log or leaky-bucket"
            ),
            Self::InvalidQuotaString { input, reason } => {
                write!(f, "invalid quota string {input:?}: {reason}")
            }
            Self::UnknownTimeZone { zone, why } => {
                write!(f, "unknown time zone {zone:?}: {why}")
            }
            Self::InvalidAnchor { unit, day } if *unit == "month" => write!(
                f,
                "anchor day {day} is not a day of a month: use 1 to 31 (a month shorter \
                 than the anchor starts on its last day)"
            ),
            Self::InvalidAnchor { unit, .. } => write!(
                f,
                "an anchor day applies to calendar months, not {unit}s: remove it, or use \
                 \"/month calendar anchor <day>\""
            ),
            Self::InvalidPenalty(why) => write!(f, "invalid penalty: {why}"),
            Self::QuotaCount { held, given } => write!(
                f,
                "{given} quotas given for a limiter that holds {held}: a live change keeps \
                 the number of quotas (build a new limiter, or define a new plan, for \
                 another number)"
            ),
            Self::UnknownPlan(plan) => write!(f, "no plan is named {plan:?}"),
            Self::InvalidPlan { plan, why } => write!(f, "plan {plan:?}: {why}"),
            Self::CalendarUnsupported { by } => write!(
                f,
                "calendar periods are windows, and {by} has none: use \
                 Algorithm::FixedWindow or Algorithm::SlidingWindow, or a rolling period \
                 such as \"1000/d\""
            ),
            Self::InvalidKey(key) => write!(
                f,
                "the per-key quota's key {key:?} is not a key of this limiter's type: write it \
                 as that type parses it (for example a number for a RateLimiter<u64>), or build \
                 the limiter with another key type"
            ),
            Self::InvalidSyncSetting {
                setting,
                value,
                expected,
            } => write!(f, "sync {setting} {value} is out of range: use {expected}"),
            Self::InvalidRedisSetting {
                setting,
                value,
                expected,
            } => write!(f, "redis {setting} {value} is out of range: use {expected}"),
            Self::InvalidRedisUrl { url, reason } => write!(
                f,
                "invalid Redis URL {url:?} ({reason}): write it as redis://[user:password@]host:port/[db]"
            ),
            Self::RedisUnreachable { url, reason } => write!(
                f,
                "cannot reach Redis at {url} ({reason}): start it, fix the URL, or drop \
                 require_connection to serve by the fallback until it answers"
            ),
            Self::UnknownSentinelMaster(master) => write!(
                f,
                "no sentinel monitors a primary named {master:?}: check the master name"
            ),
            Self::SyncSettingsDiffer {
                setting,
                ours,
                theirs,
            } => write!(
                f,
                "another node of this prefix syncs with {setting} {theirs}, this one with \
                 {ours}: every node sharing a prefix must use the same algorithm, mode, \
                 cold_keys and default quota (or give this limiter a prefix of its own)"
            ),
            Self::PrefixInUse(what) => write!(
                f,
                "another synced limiter in this process already uses {what}: give each \
                 limiter its own prefix (or allow_shared_prefix(true) to run several nodes \
                 in one process)"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A `check_n` asked for more than the quota could ever admit at once.
///
/// Waiting does not help: the request must be split or the quota raised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsufficientCapacity {
    /// The cost that was asked for.
    pub requested: u64,
    /// The most the quota can admit at once (the burst for the token bucket, the limit for
    /// window algorithms).
    pub capacity: u64,
}

impl fmt::Display for InsufficientCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cost {} exceeds {}, the most this quota can ever admit at once: \
             split the request or raise the quota",
            self.requested, self.capacity
        )
    }
}

impl std::error::Error for InsufficientCapacity {}

/// A [`charge`](crate::RateLimiter::charge) or [`refund`](crate::RateLimiter::refund)
/// that was not recorded: nothing changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettleError {
    /// The algorithm cannot carry it. A charge beyond what is available needs a state
    /// that can hold a debt: the token and leaky buckets have one (their state is an
    /// instant, which can lie any distance ahead); the window counters' counts cannot
    /// exceed their limit within a window, and the sliding log keeps one timestamp per
    /// admitted unit, at most `limit` of them. The sliding log cannot refund either.
    Unsupported {
        /// The limiter's algorithm.
        algorithm: crate::Algorithm,
        /// `"charge"` or `"refund"`.
        operation: &'static str,
    },
    /// The key is new, and the limiter holds [`max_keys`](crate::Builder::max_keys) keys
    /// with [`WhenFull::DenyNewKeys`](crate::WhenFull::DenyNewKeys) and none could make
    /// room: the charge was not recorded.
    NoRoom {
        /// When a key is expected to make room (an estimate, as for a capacity deny).
        retry_after: std::time::Duration,
    },
}

impl fmt::Display for SettleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unsupported {
                algorithm,
                operation: "charge",
            } => write!(
                f,
                "the {algorithm} cannot charge beyond what is available (it cannot hold a \
                 debt): use the token-bucket or leaky-bucket algorithm, or reserve with \
                 check_n and refund what was not used"
            ),
            Self::Unsupported {
                algorithm,
                operation,
            } => write!(
                f,
                "the {algorithm} cannot {operation}: use the token-bucket, leaky-bucket, \
                 fixed-window or sliding-window algorithm"
            ),
            Self::NoRoom { retry_after } => write!(
                f,
                "the charge was not recorded: the limiter is at max_keys and denies new keys \
                 (retry in {retry_after:?}, or raise max_keys)"
            ),
        }
    }
}

impl std::error::Error for SettleError {}
