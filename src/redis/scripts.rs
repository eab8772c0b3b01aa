//! The Lua scripts, as sent to Redis: all of them, the Redis tier's (one per algorithm)
//! and the background sync's, kept together in `src/redis/lua/`. Public so that tests and
//! operators can inspect or `EVAL` them directly.

/// The Redis tier's token bucket (GCRA in integer microseconds): the scripts' head
/// (the clock), the token bucket's prelude (its arguments), then the check.
pub const TOKEN_BUCKET: &str = concat!(
    include_str!("lua/head.lua"),
    include_str!("lua/token_bucket_args.lua"),
    include_str!("lua/token_bucket.lua")
);
/// The Redis tier's token bucket settlements: `charge` and `refund` of a cost known
/// after the fact, on the check's keys: the same head and prelude, then the settlement.
pub const TOKEN_BUCKET_SETTLE: &str = concat!(
    include_str!("lua/head.lua"),
    include_str!("lua/token_bucket_args.lua"),
    include_str!("lua/token_bucket_settle.lua")
);
/// The Redis tier's sliding window counter: the scripts' head (the clock),
/// the window counters' prelude (their arguments), then its own part.
pub const SLIDING_WINDOW: &str = concat!(
    include_str!("lua/head.lua"),
    include_str!("lua/window_args.lua"),
    include_str!("lua/sliding_window.lua")
);
/// The Redis tier's fixed window counter: the scripts' head, the window counters'
/// prelude, then its own part.
pub const FIXED_WINDOW: &str = concat!(
    include_str!("lua/head.lua"),
    include_str!("lua/window_args.lua"),
    include_str!("lua/fixed_window.lua")
);
/// The concurrency limit's acquire (`RedisConcurrencyLimiter`): expired leases given
/// back, then a slot taken as a lease, with the token bucket of a rate on the same key
/// decided all or nothing when the limiter has one.
pub const CONCURRENCY_ACQUIRE: &str = include_str!("lua/concurrency_acquire.lua");
/// The concurrency limit's release and lease renewal.
pub const CONCURRENCY_RELEASE: &str = include_str!("lua/concurrency_release.lua");
/// The background sync's round: a node's heartbeat, reports and lease requests for a
/// batch of keys of one slot (see [`crate::sync`]).
pub const SYNC_ROUND: &str = include_str!("lua/sync_round.lua");
/// The background sync's cold tier: announces and reads the keys turned hot.
pub const SYNC_HOT_KEYS: &str = include_str!("lua/sync_hot_keys.lua");
/// The background sync's settings: each node writes its own and reads every node's.
pub const SYNC_SETTINGS: &str = include_str!("lua/sync_settings.lua");

#[cfg(test)]
mod tests {
    /// Every script writes, so every one declares it (`#!lua`, Redis 7+): a replica,
    /// or a primary that Sentinel demoted, refuses it before it runs instead of
    /// failing at its first write (or, for a script that reads first, answering from
    /// a stale copy).
    #[test]
    fn every_script_declares_that_it_writes() {
        for (name, script) in [
            ("TOKEN_BUCKET", super::TOKEN_BUCKET),
            ("TOKEN_BUCKET_SETTLE", super::TOKEN_BUCKET_SETTLE),
            ("SLIDING_WINDOW", super::SLIDING_WINDOW),
            ("FIXED_WINDOW", super::FIXED_WINDOW),
            ("SYNC_ROUND", super::SYNC_ROUND),
            ("CONCURRENCY_ACQUIRE", super::CONCURRENCY_ACQUIRE),
            ("CONCURRENCY_RELEASE", super::CONCURRENCY_RELEASE),
            ("SYNC_HOT_KEYS", super::SYNC_HOT_KEYS),
            ("SYNC_SETTINGS", super::SYNC_SETTINGS),
        ] {
            let first = script.lines().next().unwrap_or_default();
            assert_eq!(first, "#!lua", "{name}");
            assert!(!script.contains("no-writes"), "{name}");
        }
    }
}
