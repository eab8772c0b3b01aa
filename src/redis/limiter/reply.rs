//! The scripts' calls and replies: arguments written, replies read into decisions.

use super::*;

/// `EVAL <source>`, or `EVALSHA` of `script` (the same source), on `first` and `rest`
/// (the first quota's key, then the `also` quotas'), before the script's arguments.
pub(super) fn script_call(
    eval: bool,
    source: &str,
    script: &redis::Script,
    first: &[u8],
    rest: &[Vec<u8>],
) -> redis::Cmd {
    // Room for everything, so that building the call grows neither buffer: the command,
    // the digest, the key count, the keys, then at most four numbers and two per extra
    // quota (each at most 20 digits, or a settlement's letter and 20 digits).
    let keys = first.len() + rest.iter().map(Vec::len).sum::<usize>();
    let numbers = 4 + 2 * rest.len();
    let args = 3 + 1 + rest.len() + numbers;
    let mut cmd = redis::Cmd::with_capacity(args, 7 + 40 + 3 + keys + 21 * numbers);
    if eval {
        cmd.arg("EVAL").arg(source);
    } else {
        cmd.arg("EVALSHA").arg(script.get_hash());
    }
    cmd.arg(1 + rest.len()).arg(first);
    for key in rest {
        cmd.arg(key);
    }
    cmd
}

/// A script's last arguments: `now` (µs) with a caller's clock, else the server's
/// `TIME` (an absent `now` where the script takes one, `absent`, and nothing follows;
/// otherwise an empty one); then each `also` quota's two arguments.
pub(super) fn now_and_also(
    cmd: &mut redis::Cmd,
    now_us: Option<u64>,
    absent: bool,
    also: &[Also],
    time: impl Fn() -> ScriptTime,
) {
    match now_us {
        Some(us) => {
            cmd.arg(us);
        }
        None if absent && also.is_empty() => {}
        None => {
            cmd.arg("");
        }
    }
    for a in also {
        a.rule.push_args(cmd, &time);
    }
}

/// A check script's reply with the penalty box: the key's block (the µs to its end),
/// or the algorithm's reply `T`.
#[derive(Debug)]
pub(super) enum Boxed<T> {
    Blocked(u64),
    Decided(T),
}

impl<T: redis::FromRedisValue> redis::FromRedisValue for Boxed<T> {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let block = match &v {
            redis::Value::SimpleString(s) => s.strip_prefix("BLOCKED "),
            _ => None,
        };
        match block.map(str::parse::<u64>) {
            None => T::from_redis_value(v).map(Self::Decided),
            Some(Ok(us)) if us > 0 => Ok(Self::Blocked(us)),
            Some(_) => Err(format!("a block of {v:?}").into()),
        }
    }
}

/// The decision of a key blocked for `us` more µs under `rule`: denied, nothing left,
/// retry and reset at the block's end.
pub(super) fn blocked_decision(rule: ScriptQuota, us: u64) -> Decision {
    let ns = us.saturating_mul(1_000);
    Decision::deny(rule.limit(), 0, ns, ns)
}

/// Reads the token bucket's one-integer reply to a request of `cost` under the rule
/// `t`, `tau`, `burst` it was called with: the µs until the bucket is full again, negated
/// for a deny. The rest follows from the rule: remaining `⌊(τ + T − reset) / T⌋`, and a
/// deny's retry-after `reset + T·(cost − 1) − τ`, which is at least 1 µs (a deny came
/// from `now < tat + T·(cost − 1) − τ`).
pub(crate) fn gcra_decision(
    reply: i64,
    t: u64,
    tau: u64,
    burst: u64,
    cost: u64,
) -> Result<Decision, RedisError> {
    let unexpected = || RedisError::UnexpectedReply(format!("{reply} to a request of {cost}"));
    let reset_us = reply.unsigned_abs();
    let remaining = (tau + t).saturating_sub(reset_us) / t.max(1);
    let reset = reset_us.saturating_mul(1_000);
    if reply >= 0 {
        return Ok(Decision::allow(burst, remaining, reset));
    }
    let retry_us = reset_us
        .checked_add(t.saturating_mul(cost.saturating_sub(1)))
        .and_then(|us| us.checked_sub(tau))
        .filter(|&us| cost > 0 && us > 0)
        .ok_or_else(unexpected)?;
    Ok(Decision::deny(
        burst,
        remaining,
        reset,
        retry_us.saturating_mul(1_000),
    ))
}

/// Reads the window scripts' `{allowed, limit, remaining, reset_after_us,
/// retry_after_us}`.
pub(super) fn decision_from(reply: &[i64]) -> Result<Decision, RedisError> {
    let &[allowed, limit, remaining, reset_us, retry_us] = reply else {
        return Err(RedisError::UnexpectedReply(format!("{reply:?}")));
    };
    let unsigned =
        |v: i64| u64::try_from(v).map_err(|_| RedisError::UnexpectedReply(format!("{reply:?}")));
    let ns = |v: i64| unsigned(v).map(|us| us.saturating_mul(1_000));
    let (limit, remaining, reset) = (unsigned(limit)?, unsigned(remaining)?, ns(reset_us)?);
    Ok(if allowed == 1 {
        Decision::allow(limit, remaining, reset)
    } else {
        Decision::deny(limit, remaining, reset, ns(retry_us)?)
    })
}

/// Reads a script's reply per quota of `rules` (the first quota's, then the `also`
/// quotas'): one integer for the token bucket, read by `bucket(reply, t, tau, burst)`,
/// five for the windows; each decision tagged with its quota's index.
pub(super) fn per_quota(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
    bucket: impl Fn(i64, u64, u64, u64) -> Result<Decision, RedisError>,
) -> Result<Vec<Decision>, RedisError> {
    let unexpected = || RedisError::UnexpectedReply(format!("{replies:?}"));
    let mut decisions = Vec::new();
    let mut at = 0;
    for (i, rule) in rules.enumerate() {
        let decision = match rule {
            ScriptQuota::TokenBucket { t, tau, burst } => {
                let &reply = replies.get(at).ok_or_else(unexpected)?;
                at += 1;
                bucket(reply, t, tau, burst)?
            }
            ScriptQuota::Window { .. } | ScriptQuota::Calendar { .. } => {
                let reply = replies.get(at..at + 5).ok_or_else(unexpected)?;
                at += 5;
                decision_from(reply)?
            }
        };
        decisions.push(decision.for_policy(i));
    }
    if at != replies.len() || decisions.is_empty() {
        return Err(unexpected());
    }
    Ok(decisions)
}

/// The decision of a request of `cost` from the check script's reply under `rules`, as
/// [`Decision::all_of`] makes it in process.
pub(super) fn all_of(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
    cost: u64,
) -> Result<Decision, RedisError> {
    let decisions = per_quota(replies, rules, |reply, t, tau, burst| {
        gcra_decision(reply, t, tau, burst, cost)
    })?;
    Decision::all_of(decisions).ok_or_else(|| RedisError::UnexpectedReply(format!("{replies:?}")))
}

/// The decision a unit request would get right after a settlement, from its reply under
/// `rules`: the token bucket's settlement script gives the µs until each bucket is full
/// again, the window scripts their unit request's decision. The tightest of every
/// quota's ([`Decision::tighter`]), as in process.
pub(super) fn settled(
    replies: &[i64],
    rules: impl Iterator<Item = ScriptQuota>,
) -> Result<Decision, RedisError> {
    let decisions = per_quota(replies, rules, |reset_us, t, tau, burst| {
        // Denied while the TAT lies beyond tau.
        let reply = if reset_us > tau as i64 {
            -reset_us
        } else {
            reset_us
        };
        gcra_decision(reply, t, tau, burst, 1)
    })?;
    let unexpected = || RedisError::UnexpectedReply(format!("{replies:?}"));
    decisions
        .into_iter()
        .reduce(Decision::tighter)
        .ok_or_else(unexpected)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1/s, burst 3, in µs: T = 10⁶, τ = 2·10⁶.
    const T: u64 = 1_000_000;
    const TAU: u64 = 2 * T;

    #[test]
    fn an_admission_reads_remaining_and_reset_from_the_reset_alone() {
        let full = gcra_decision(0, T, TAU, 3, 0).unwrap();
        assert!(full.is_allowed());
        assert_eq!(
            (
                full.limit(),
                full.remaining(),
                full.reset_after().as_nanos()
            ),
            (3, 3, 0)
        );
        // The first unit of a full bucket: full again in one T, two left.
        let first = gcra_decision(1_000_000, T, TAU, 3, 1).unwrap();
        assert_eq!(
            (first.remaining(), first.reset_after().as_nanos()),
            (2, 1_000_000_000)
        );
        // The last unit: full again in τ + T, none left; a µs later, still none whole.
        assert_eq!(
            gcra_decision(3_000_000, T, TAU, 3, 1).unwrap().remaining(),
            0
        );
        assert_eq!(
            gcra_decision(2_000_001, T, TAU, 3, 1).unwrap().remaining(),
            0
        );
        assert_eq!(
            gcra_decision(2_000_000, T, TAU, 3, 1).unwrap().remaining(),
            1
        );
    }

    #[test]
    fn a_deny_retries_when_its_cost_fits_and_never_after_zero() {
        // Empty for 2.5 s more: a unit fits in 0.5 s, three units in 2.5 s.
        let one = gcra_decision(-2_500_000, T, TAU, 3, 1).unwrap();
        assert!(!one.is_allowed());
        assert_eq!(
            (one.remaining(), one.reset_after().as_nanos()),
            (0, 2_500_000_000)
        );
        assert_eq!(one.retry_after(), Some(Duration::from_millis(500)));
        let three = gcra_decision(-2_500_000, T, TAU, 3, 3).unwrap();
        assert_eq!(three.retry_after(), Some(Duration::from_millis(2_500)));
        // A reply no deny can give: a deny of nothing, or one whose retry would be 0.
        for (reply, cost) in [(-1, 0), (-2_000_000, 1), (-1, 1)] {
            assert!(matches!(
                gcra_decision(reply, T, TAU, 3, cost),
                Err(RedisError::UnexpectedReply(_))
            ));
        }
    }
}
