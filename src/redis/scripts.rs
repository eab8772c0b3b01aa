//! The Lua scripts, as sent to Redis: all of them, the Redis tier's (one per algorithm)
//! and the background sync's, kept together in `src/redis/lua/`. Public so that tests and
//! operators can inspect or `EVAL` them directly.
//!
//! Every script starts with the shebang `#!lua` (Redis 7+), which declares a script
//! that writes: a replica refuses it before it runs, with MOVED in a cluster, even on a
//! READONLY connection, so a client whose slot map is stale after a failover is
//! redirected instead of failing on the first write.

/// The first line of the Redis tier's scripts (head.lua, which follows it, has none, so
/// that the penalty box's opening can come between them).
macro_rules! tier_script {
    ($($part:expr),+ $(,)?) => {
        concat!("#!lua\n", $($part),+)
    };
}

/// A Redis tier check script with the penalty box around it: the box and the penalty
/// taken off the keys and arguments, the clock, a blocked key's deny, then the
/// algorithm's prelude and check as the body of a function, whose reply the box's end
/// reads (`stride`: see penalty_close.lua).
macro_rules! penalized {
    ($stride:literal, $args:literal, $check:literal) => {
        tier_script!(
            include_str!("lua/penalty_open.lua"),
            include_str!("lua/head.lua"),
            include_str!("lua/penalty_check.lua"),
            include_str!($args),
            include_str!($check),
            "\nend\nlocal stride = ",
            $stride,
            "\n",
            include_str!("lua/penalty_close.lua"),
        )
    };
}

/// The Redis tier's token bucket (GCRA in integer microseconds): the scripts' head
/// (the clock), the token bucket's prelude (its arguments), then the check.
pub const TOKEN_BUCKET: &str = tier_script!(
    include_str!("lua/head.lua"),
    include_str!("lua/token_bucket_args.lua"),
    include_str!("lua/token_bucket.lua")
);
/// The Redis tier's token bucket settlements: `charge` and `refund` of a cost known
/// after the fact, on the check's keys: the same head and prelude, then the settlement.
pub const TOKEN_BUCKET_SETTLE: &str = tier_script!(
    include_str!("lua/head.lua"),
    include_str!("lua/token_bucket_args.lua"),
    include_str!("lua/token_bucket_settle.lua")
);
/// The Redis tier's sliding window counter: the scripts' head (the clock),
/// the window counters' prelude (their arguments), then its own part.
pub const SLIDING_WINDOW: &str = tier_script!(
    include_str!("lua/head.lua"),
    include_str!("lua/window_args.lua"),
    include_str!("lua/sliding_window.lua")
);
/// The Redis tier's fixed window counter: the scripts' head, the window counters'
/// prelude, then its own part.
pub const FIXED_WINDOW: &str = tier_script!(
    include_str!("lua/head.lua"),
    include_str!("lua/window_args.lua"),
    include_str!("lua/fixed_window.lua")
);
/// [`TOKEN_BUCKET`] with the penalty box ([`RedisBuilder::block_for`]): the box and
/// the penalty are the last key and argument.
///
/// [`RedisBuilder::block_for`]: crate::redis::RedisBuilder::block_for
pub const TOKEN_BUCKET_PENALIZED: &str =
    penalized!("0", "lua/token_bucket_args.lua", "lua/token_bucket.lua");
/// [`SLIDING_WINDOW`] with the penalty box.
pub const SLIDING_WINDOW_PENALIZED: &str =
    penalized!("5", "lua/window_args.lua", "lua/sliding_window.lua");
/// [`FIXED_WINDOW`] with the penalty box.
pub const FIXED_WINDOW_PENALIZED: &str =
    penalized!("5", "lua/window_args.lua", "lua/fixed_window.lua");
/// The penalty box's manual blocks, unblocks and reads ([`RedisLimiter::block`]).
///
/// [`RedisLimiter::block`]: crate::redis::RedisLimiter::block
pub const PENALTY_BOX: &str = tier_script!(
    include_str!("lua/head.lua"),
    include_str!("lua/penalty_box.lua")
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
            ("TOKEN_BUCKET_PENALIZED", super::TOKEN_BUCKET_PENALIZED),
            ("SLIDING_WINDOW_PENALIZED", super::SLIDING_WINDOW_PENALIZED),
            ("FIXED_WINDOW_PENALIZED", super::FIXED_WINDOW_PENALIZED),
            ("PENALTY_BOX", super::PENALTY_BOX),
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
