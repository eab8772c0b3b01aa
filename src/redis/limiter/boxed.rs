//! The penalty box in Redis: the settings a check's script call carries, and an
//! operator's blocks, unblocks and reads of a key's box.

use super::*;
use crate::penalty::Penalty;

/// The largest µs the scripts take (below 2⁵², exact in Lua's doubles with room to add).
const MAX_US: u64 = (1 << 52) - 1;

/// Whole µs of `ns`, rounded up (a block never ends before its time), at most
/// [`MAX_US`].
fn ceil_us(ns: u64) -> u64 {
    ns.div_ceil(1_000).min(MAX_US)
}

/// How a limiter's checks use the penalty box.
#[derive(Debug)]
pub(super) struct BoxSettings {
    /// `<prefix>:<algorithm>:box:`, the start of a key's box (its hash tag follows).
    pub(super) prefix: String,
    /// The checks' last argument: `p<block µs>,<denies>,<within µs>` (see
    /// penalty_open.lua); a block of 0 only reads manual blocks.
    pub(super) arg: String,
    /// Whether a check's deny counts toward a block.
    pub(super) counts_denies: bool,
    /// The manual side's script ([`scripts::PENALTY_BOX`]).
    script: redis::Script,
}

impl BoxSettings {
    /// The box of the limiter whose keys start with `prefix`, blocking as `penalty`
    /// says (only by hand if `None`).
    pub(super) fn new(prefix: &str, penalty: Option<Penalty>) -> Self {
        let arg = match penalty {
            // One deny blocks: the window is not read.
            Some(p) if p.denies() == 1 => format!("p{},1,0", ceil_us(p.block_ns()).max(1)),
            Some(p) => format!(
                "p{},{},{}",
                ceil_us(p.block_ns()).max(1),
                p.denies(),
                ceil_us(p.within_ns()).max(1)
            ),
            None => "p0,1,0".to_owned(),
        };
        Self {
            prefix: format!("{prefix}box:"),
            arg,
            counts_denies: penalty.is_some(),
            script: redis::Script::new(scripts::PENALTY_BOX),
        }
    }
}

/// What an operator does to a key's box.
#[derive(Clone, Copy, Debug)]
enum BoxOp {
    Block(Duration),
    Unblock,
    Read,
}

impl RedisLimiter {
    /// Blocks `key` for `duration` on every node whose checks read the penalty box:
    /// each check of it is denied, consuming nothing, with its retry at the block's end.
    /// A block that ends later stays; [`unblock`](Self::unblock) ends it early. This
    /// node's deny cache holds the block at once; every other node's cache is emptied
    /// (one `PUBLISH`, as [`reset`](Self::reset) does), so that a deny or an earlier
    /// block it held gives way to this block from its next call for the key. As
    /// [`RateLimiter::block`](crate::RateLimiter::block) in process. One script call, on
    /// the script's clock (the caller's, or the server's).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::redis::RedisLimiter;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let api = RedisLimiter::builder("redis://127.0.0.1/", "100/s".parse()?)
    ///     .penalty_box(true)
    ///     .build()
    ///     .await?;
    /// api.block("scraper", Duration::from_secs(600)).await?;
    /// assert!(!api.check("scraper").await?.is_allowed());
    /// assert!(api.unblock("scraper").await?);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`RedisError::Config`] ([`ConfigError::InvalidPenalty`]) for a limiter whose
    /// checks do not read the box (built without [`RedisBuilder::block_for`] or
    /// [`RedisBuilder::penalty_box`]) or a block of zero, before any I/O; otherwise as
    /// [`check`](Self::check).
    pub async fn block(&self, key: &str, duration: Duration) -> Result<(), RedisError> {
        if duration.is_zero() {
            return Err(ConfigError::InvalidPenalty(
                "block(key, 0) blocks nothing: give a duration of at least 1µs",
            )
            .into());
        }
        let inner = &*self.inner;
        let generation = inner.cache.as_ref().map(DenyCache::generation);
        let now_us = inner.now_us();
        let left = self.box_call(key, BoxOp::Block(duration)).await?;
        if let (Some(cache), Some(generation), true) = (&inner.cache, generation, left > 0) {
            let end = now_us.saturating_add(left);
            let rule = inner.current.read().rule;
            let until = Until {
                retry_at: end,
                reset_at: end,
                limit: rule.limit(),
                policy: 0,
                block: true,
            };
            cache.learn(key, generation, now_us, Lesson::Denied(until));
        }
        if inner.cache.is_some() {
            self.empty_every_cache().await;
        }
        Ok(())
    }

    /// Ends `key`'s block, if it has one, and forgets the denies counted toward one, on
    /// every node: this node's deny cache forgets the key, and every node's cache is
    /// emptied (one `PUBLISH`, as [`reset`](Self::reset) does). Whether the key was
    /// blocked.
    ///
    /// # Errors
    /// As [`block`](Self::block); this node's cache forgets the key even then.
    pub async fn unblock(&self, key: &str) -> Result<bool, RedisError> {
        let inner = &*self.inner;
        let left = self.box_call(key, BoxOp::Unblock).await;
        if let Some(cache) = &inner.cache {
            cache.forget(key);
            if left.is_ok() {
                self.empty_every_cache().await;
            }
        }
        left.map(|us| us > 0)
    }

    /// How long `key` stays blocked, if it is: read from Redis.
    ///
    /// # Errors
    /// As [`block`](Self::block).
    pub async fn blocked_for(&self, key: &str) -> Result<Option<Duration>, RedisError> {
        let left = self.box_call(key, BoxOp::Read).await?;
        Ok((left > 0).then(|| Duration::from_micros(left)))
    }

    /// One call of the box's script on `key`'s box: the µs left of its block (before
    /// an unblock). Counted, bounded by the timeout, and told to the breaker as a
    /// check's call is.
    async fn box_call(&self, key: &str, op: BoxOp) -> Result<u64, RedisError> {
        let inner = &*self.inner;
        let Some(settings) = &inner.penalty else {
            return Err(ConfigError::InvalidPenalty(
                "this limiter's checks do not read the penalty box: build every node with \
                 RedisBuilder::block_for or penalty_box(true)",
            )
            .into());
        };
        let op = match op {
            BoxOp::Block(d) => format!("b{}", ceil_us(crate::clock::nanos(d)).max(1)),
            BoxOp::Unblock => "u".to_owned(),
            BoxOp::Read => "r".to_owned(),
        };
        self.through_breaker()?;
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let script_now = inner.clock.as_ref().map(|_| inner.now_us());
        let box_key = self.state_key(&settings.prefix, key);
        let call = |eval: bool| {
            let source = scripts::PENALTY_BOX;
            let mut cmd = script_call(eval, source, &settings.script, &box_key, &[]);
            // head.lua reads the time from ARGV[4].
            cmd.arg(&op).arg("").arg("");
            match script_now {
                Some(us) => cmd.arg(us),
                None => cmd.arg(""),
            };
            cmd
        };
        inner.calls.fetch_add(1, Ordering::Relaxed);
        let mut connection = inner.connection.get();
        let left = self
            .bounded(deadline, &box_key, eval::<i64>(&mut connection, call))
            .await
            .and_then(|us| {
                u64::try_from(us).map_err(|_| RedisError::UnexpectedReply(us.to_string()))
            });
        match &left {
            Ok(_) => self.answered(),
            Err(e) => self.failed(e, false),
        }
        left
    }
}
