//! The rate-limiting algorithms, as pure functions over per-key state.
//!
//! Four algorithms keep one packed `u64` per key and turn `(state, now, cost)` into an
//! [`Outcome`]: a [`Decision`] and, when the request is admitted, the state to store. The
//! sliding log keeps a ring of timestamps instead. Nothing here touches a map, a clock or a
//! thread, so every formula is tested directly.
//!
//! Word state `0` ([`UNTOUCHED`]) means "never seen / back to full" for every word
//! algorithm, so a new key needs no initialisation.

mod fixed_window;
mod leaky_bucket;
mod sliding_log;
mod sliding_window;
mod token_bucket;
mod windows;

pub use fixed_window::FIXED_WINDOW_MAX_LIMIT;
pub use sliding_log::SLIDING_LOG_MAX_LIMIT;
pub use sliding_window::SLIDING_WINDOW_MAX_LIMIT;

pub(crate) use sliding_log::{Log, SlidingLog};

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;
use fixed_window::FixedWindow;
use leaky_bucket::LeakyBucket;
use sliding_window::SlidingWindow;
use token_bucket::Gcra;

/// The state word of a key that has never been seen, or whose history no longer matters.
pub(crate) const UNTOUCHED: u64 = 0;

/// Which rate-limiting algorithm a limiter runs.
///
/// `T = ⌊period / limit⌋`. Every guarantee below is asserted by a proptest over arbitrary
/// request timelines.
///
/// | algorithm | state per key | burst | guarantee |
/// |---|---|---|---|
/// | [`TokenBucket`](Self::TokenBucket) | one `u64` | up to `burst` at once | at most `burst + ⌊t / T⌋` in any interval of length `t` |
/// | [`LeakyBucket`](Self::LeakyBucket) | one `u64` | queues up to `burst`, served one per `T` | as the token bucket; admitted requests' slots are `≥ cost·T` apart |
/// | [`FixedWindow`](Self::FixedWindow) | one `u64` | `limit` per aligned window; `2·limit` across a boundary | at most `limit` per aligned window |
/// | [`SlidingWindow`](Self::SlidingWindow) | one `u64` | `limit` per aligned window, decaying | at most `limit` per aligned window; fewer than `2·limit` in any interval of length `period` |
/// | [`SlidingLog`](Self::SlidingLog) | `limit` timestamps | none beyond `limit` | at most `limit` in any interval of length `period` |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// The token bucket, run as GCRA: capacity `burst`, refilled continuously at
    /// `limit / period`. Its decisions equal governor's for the same quota and timeline.
    #[default]
    TokenBucket,
    /// The sliding window counter: the weighted estimate
    /// `prev·(period − elapsed)/period + current` over windows aligned to multiples of
    /// `period`. The quota's burst is not used. Limits above
    /// [`SLIDING_WINDOW_MAX_LIMIT`] are refused.
    SlidingWindow,
    /// One counter per aligned window of `period`. Cheapest, but admits up to `2·limit`
    /// across a window boundary. The quota's burst is not used. Limits above
    /// [`FIXED_WINDOW_MAX_LIMIT`] are refused.
    FixedWindow,
    /// Exact: at most `limit` in any interval of length `period`, keeping one timestamp
    /// per admitted unit (`8·limit` bytes per key). The quota's burst is not used. Limits
    /// above [`SLIDING_LOG_MAX_LIMIT`] are refused.
    SlidingLog,
    /// A meter with constant outflow (nginx `limit_req`): requests are spaced one every
    /// `T`, with a queue of depth `burst`. `check` denies when the queue is full and
    /// reports each admitted request's slot as [`Decision::delay`]; the waiting API sleeps
    /// until that slot.
    LeakyBucket,
}

impl Algorithm {
    /// Every algorithm, in the order of this enum.
    pub const ALL: [Algorithm; 5] = [
        Self::TokenBucket,
        Self::SlidingWindow,
        Self::FixedWindow,
        Self::SlidingLog,
        Self::LeakyBucket,
    ];

    /// The algorithm's name, as the example server's `--algorithm` flag spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::TokenBucket => "token-bucket",
            Self::SlidingWindow => "sliding-window",
            Self::FixedWindow => "fixed-window",
            Self::SlidingLog => "sliding-log",
            Self::LeakyBucket => "leaky-bucket",
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = ConfigError;

    /// Parses a name as [`Algorithm::name`] writes it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| ConfigError::UnknownAlgorithm(s.to_owned()))
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What an algorithm decided about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome<S = u64> {
    /// Admitted; `state` must be stored (it equals the old state when nothing changed).
    Allow { decision: Decision, state: S },
    /// Denied; the state must not be written.
    Deny(Decision),
}

impl<S> Outcome<S> {
    pub(crate) fn decision(&self) -> Decision {
        match *self {
            Self::Allow { decision, .. } | Self::Deny(decision) => decision,
        }
    }
}

/// A settlement of units after the fact: [`RateLimiter::charge`](crate::RateLimiter::charge)
/// and [`RateLimiter::refund`](crate::RateLimiter::refund).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Consume this many units, even beyond what is available (the key goes into debt).
    Charge(u64),
    /// Give back up to this many units, never beyond a full quota.
    Refund(u64),
}

impl Settle {
    /// The error of a limiter of `algorithm` that cannot carry this settlement (see
    /// [`WordPolicy::settles`]).
    pub(crate) fn unsupported(self, algorithm: Algorithm) -> crate::error::SettleError {
        crate::error::SettleError::Unsupported {
            algorithm,
            operation: match self {
                Settle::Charge(_) => "charge",
                Settle::Refund(_) => "refund",
            },
        }
    }

    /// Applies this settlement to each of `parts` (a key's quotas) in order, all or
    /// nothing: returns the most constraining decision (each marked with its part's
    /// index), or the first part's refusal, after the parts before it gave a charge back
    /// (a refund of the same units undoes a charge exactly; a refund needs no undoing,
    /// since none of it went through before the refusal but what stays given back).
    pub(crate) fn all<P, E>(
        self,
        parts: impl Iterator<Item = P> + Clone,
        mut apply: impl FnMut(P, Settle) -> Result<Decision, E>,
    ) -> Result<Decision, E> {
        let mut tightest: Option<Decision> = None;
        for (i, part) in parts.clone().enumerate() {
            match apply(part, self) {
                Ok(decision) => {
                    let decision = decision.for_policy(i);
                    tightest = Some(tightest.map_or(decision, |t| t.tighter(decision)));
                }
                Err(refused) => {
                    if let Settle::Charge(n) = self {
                        for before in parts.take(i) {
                            let _ = apply(before, Settle::Refund(n));
                        }
                    }
                    return Err(refused);
                }
            }
        }
        Ok(tightest.unwrap_or_else(|| Decision::allow(0, 0, 0)))
    }

    /// Whether a deny of the key cached before this settlement may now be wrong, judged
    /// from `after`, the unit request's decision right after it. A cached deny is exact
    /// until its retry instant, so one that is still live means the key denied a unit
    /// request right before the settlement (`remaining` 0). A charge only lowers
    /// `remaining`, so after a charge that still admits, none was live. A refund of `n`
    /// raises `remaining` by at most `n`, so after one that leaves more than `n`, none
    /// was live either. Otherwise: maybe.
    pub(crate) fn may_outdate(self, after: &Decision) -> bool {
        match self {
            Settle::Charge(_) => !after.is_allowed(),
            Settle::Refund(n) => after.remaining() <= n,
        }
    }
}

/// A quota's limits, precomputed for one algorithm.
pub(crate) trait Policy: Copy + Send + Sync + 'static {
    /// The quota this policy enforces.
    fn quota(&self) -> Quota;
    /// The same algorithm for another quota.
    fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError>;
    /// The largest cost a single request may ever have.
    fn capacity(&self) -> u64;
    /// A key's own policy once the default became `default`: unchanged, unless the
    /// policy carries settings that follow the default's (a synced limiter's).
    fn rebase(&self, _default: &Self) -> Self {
        *self
    }
}

/// The word algorithms with their constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WordKind {
    TokenBucket(Gcra),
    LeakyBucket(LeakyBucket),
    FixedWindow(FixedWindow),
    SlidingWindow(SlidingWindow),
}

/// A policy for the algorithms whose per-key state is one `u64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WordPolicy {
    quota: Quota,
    kind: WordKind,
    /// The Unix instant of the limiter's clock's origin, for calendar periods.
    unix_origin: u64,
}

/// Two token buckets, a pair's first and second quota, kept apart from their policies
/// so that a pair's check finds them without matching on two kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketPair {
    buckets: [Gcra; 2],
    /// [`Gcra::looser_bounds`] of the two buckets.
    looser_below: [u64; 2],
}

impl BucketPair {
    /// The admission of a request of `cost` (within both capacities) under both buckets
    /// at once: the tighter decision (marked with its index) and both new states. `None`
    /// if either denies, or for a cost of 0: then the caller evaluates each.
    #[inline(always)]
    pub(crate) fn admit(
        &self,
        states: [u64; 2],
        now: u64,
        cost: u64,
    ) -> Option<(Decision, [u64; 2])> {
        if cost == 0 {
            return None;
        }
        let [a, b] = &self.buckets;
        Gcra::admit_both([a, b], self.looser_below, states, now, cost)
    }
}

/// A policy for the sliding log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LogPolicy {
    quota: Quota,
    pub(crate) log: SlidingLog,
}

/// What a limiter for one algorithm is built from.
pub(crate) enum AnyPolicy {
    Word(WordPolicy),
    Log(LogPolicy),
}

impl AnyPolicy {
    /// Precomputes `algorithm` for `quota`, on a clock whose origin is the Unix instant
    /// `unix_origin` (read by calendar periods only).
    ///
    /// # Errors
    /// [`ConfigError::LimitTooLarge`] when the algorithm cannot hold the quota's limit,
    /// [`ConfigError::CalendarUnsupported`] for a calendar quota with an algorithm that
    /// has no windows.
    pub(crate) fn new(
        algorithm: Algorithm,
        quota: Quota,
        unix_origin: u64,
    ) -> Result<Self, ConfigError> {
        windows_only(algorithm, quota)?;
        let word = |kind| {
            Ok(Self::Word(WordPolicy {
                quota,
                kind,
                unix_origin,
            }))
        };
        match algorithm {
            Algorithm::TokenBucket => word(WordKind::TokenBucket(Gcra::new(quota))),
            Algorithm::LeakyBucket => word(WordKind::LeakyBucket(LeakyBucket::new(quota))),
            Algorithm::FixedWindow => {
                word(WordKind::FixedWindow(FixedWindow::new(quota, unix_origin)?))
            }
            Algorithm::SlidingWindow => word(WordKind::SlidingWindow(SlidingWindow::new(
                quota,
                unix_origin,
            )?)),
            Algorithm::SlidingLog => Ok(Self::Log(LogPolicy {
                quota,
                log: SlidingLog::new(quota)?,
            })),
        }
    }
}

/// `Ok` unless `quota` is a calendar quota and `algorithm` has no windows to align.
pub(crate) fn windows_only(algorithm: Algorithm, quota: Quota) -> Result<(), ConfigError> {
    let by = match algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindow => return Ok(()),
        Algorithm::TokenBucket => "the token bucket",
        Algorithm::LeakyBucket => "the leaky bucket",
        Algorithm::SlidingLog => "the sliding log",
    };
    match quota.calendar() {
        Some(_) => Err(ConfigError::CalendarUnsupported { by }),
        None => Ok(()),
    }
}

impl WordPolicy {
    /// The token bucket for `quota` (a rolling quota: every one is valid).
    pub(crate) fn token_bucket(quota: Quota) -> Self {
        Self {
            quota,
            kind: WordKind::TokenBucket(Gcra::new(quota)),
            unix_origin: 0,
        }
    }

    /// Decides a request of `cost` (at most [`Policy::capacity`]) at `now`.
    #[inline(always)]
    pub(crate) fn evaluate(&self, state: u64, now: u64, cost: u64) -> Outcome {
        match &self.kind {
            WordKind::TokenBucket(g) => g.evaluate(state, now, cost),
            WordKind::LeakyBucket(l) => l.evaluate(state, now, cost),
            WordKind::FixedWindow(f) => f.evaluate(state, now, cost),
            WordKind::SlidingWindow(w) => w.evaluate(state, now, cost),
        }
    }

    /// Both policies' buckets, if both are token buckets: what a pair's check of them
    /// decides in one pass ([`BucketPair::admit`]).
    pub(crate) fn bucket_pair(pair: [&Self; 2]) -> Option<BucketPair> {
        match (&pair[0].kind, &pair[1].kind) {
            (WordKind::TokenBucket(a), WordKind::TokenBucket(b)) => Some(BucketPair {
                buckets: [*a, *b],
                looser_below: Gcra::looser_bounds([a, b]),
            }),
            _ => None,
        }
    }

    /// The state as it stands at `now`, as an admitting decision of cost 0.
    pub(crate) fn snapshot(&self, state: u64, now: u64) -> Decision {
        self.evaluate(state, now, 0).decision()
    }

    /// The decision a request of `cost` would get, with `remaining` and `reset_after` as
    /// the state stands (nothing consumed).
    pub(crate) fn peek(&self, state: u64, now: u64, cost: u64) -> Decision {
        match self.evaluate(state, now, cost) {
            Outcome::Deny(decision) => decision,
            Outcome::Allow { decision, .. } => {
                let snapshot = self.snapshot(state, now);
                Decision::allow(
                    snapshot.limit(),
                    snapshot.remaining(),
                    snapshot.reset_after_ns(),
                )
                .with_delay(decision.delay_ns())
            }
        }
    }

    /// Whether this algorithm can carry `op`: refunds always; a charge beyond what is
    /// available only for the buckets, whose state is an instant that can lie any distance
    /// ahead (a debt repaid at the quota's rate). The window counters' counts are capped
    /// at the limit within one window, so they cannot hold a debt.
    pub(crate) fn settles(algorithm: Algorithm, op: Settle) -> bool {
        match op {
            Settle::Refund(_) => algorithm != Algorithm::SlidingLog,
            Settle::Charge(_) => {
                matches!(algorithm, Algorithm::TokenBucket | Algorithm::LeakyBucket)
            }
        }
    }

    /// The state after `op` at `now` (only the ops [`settles`](Self::settles) allows:
    /// a window counter's state is returned unchanged by a charge).
    #[inline(always)]
    pub(crate) fn settle(&self, state: u64, now: u64, op: Settle) -> u64 {
        match (&self.kind, op) {
            (WordKind::TokenBucket(g) | WordKind::LeakyBucket(LeakyBucket(g)), op) => {
                g.settle(state, now, op)
            }
            (WordKind::FixedWindow(f), Settle::Refund(n)) => f.refund(state, now, n),
            (WordKind::SlidingWindow(w), Settle::Refund(n)) => w.refund(state, now, n),
            (WordKind::FixedWindow(_) | WordKind::SlidingWindow(_), Settle::Charge(_)) => state,
        }
    }

    /// The decision a unit request would get at `now` with `state`, consuming nothing:
    /// [`peek`](Self::peek) of cost 1, computed once rather than twice for the token
    /// bucket (the settlements' answer).
    #[inline]
    pub(crate) fn unit_view(&self, state: u64, now: u64) -> Decision {
        match &self.kind {
            WordKind::TokenBucket(g) => g.unit_view(state, now),
            _ => self.peek(state, now, 1),
        }
    }

    /// Nanoseconds from `now` until `state` is back to untouched; 0 when it carries no
    /// information, so that dropping it changes no decision.
    pub(crate) fn reset_after_ns(&self, state: u64, now: u64) -> u64 {
        self.snapshot(state, now).reset_after_ns()
    }

    /// Nanoseconds from `since` until `state` is untouched for good, judged at `now` (at
    /// or after the state's last write): 0 when it has been untouched since `since` at
    /// least, so that a key untouched since then can go. Exact for the buckets, whose
    /// states are instants; for the windows, read against `now`'s window, so a key
    /// written after `since` never passes for untouched at `since`.
    pub(crate) fn untouched_wait(&self, state: u64, now: u64, since: u64) -> u64 {
        match &self.kind {
            WordKind::TokenBucket(_) | WordKind::LeakyBucket(_) => {
                self.reset_after_ns(state, since)
            }
            WordKind::FixedWindow(f) => f.untouched_from(state, now).saturating_sub(since),
            WordKind::SlidingWindow(w) => w.untouched_from(state, now).saturating_sub(since),
        }
    }

    /// This policy's state for a key whose state was `state` under `from` (the same
    /// algorithm with another quota). Consumed units carry over, capped at this quota's
    /// capacity: a change never refills a key. See each algorithm for the details.
    pub(crate) fn convert(&self, state: u64, now: u64, from: &WordPolicy) -> u64 {
        match (&self.kind, &from.kind) {
            (WordKind::TokenBucket(to), WordKind::TokenBucket(from))
            | (WordKind::LeakyBucket(LeakyBucket(to)), WordKind::LeakyBucket(LeakyBucket(from))) => {
                to.convert_from(state, now, from)
            }
            (WordKind::FixedWindow(to), WordKind::FixedWindow(from)) => {
                to.convert_from(state, now, from)
            }
            (WordKind::SlidingWindow(to), WordKind::SlidingWindow(from)) => {
                to.convert_from(state, now, from)
            }
            // A limiter's algorithm never changes, so the kinds always match.
            _ => state,
        }
    }
}

impl Policy for WordPolicy {
    fn quota(&self) -> Quota {
        self.quota
    }

    fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError> {
        let origin = self.unix_origin;
        let kind = match self.kind {
            WordKind::TokenBucket(_) => {
                windows_only(Algorithm::TokenBucket, quota)?;
                WordKind::TokenBucket(Gcra::new(quota))
            }
            WordKind::LeakyBucket(_) => {
                windows_only(Algorithm::LeakyBucket, quota)?;
                WordKind::LeakyBucket(LeakyBucket::new(quota))
            }
            WordKind::FixedWindow(_) => WordKind::FixedWindow(FixedWindow::new(quota, origin)?),
            WordKind::SlidingWindow(_) => {
                WordKind::SlidingWindow(SlidingWindow::new(quota, origin)?)
            }
        };
        Ok(Self {
            quota,
            kind,
            unix_origin: origin,
        })
    }

    fn capacity(&self) -> u64 {
        match &self.kind {
            WordKind::TokenBucket(g) | WordKind::LeakyBucket(LeakyBucket(g)) => g.capacity(),
            WordKind::FixedWindow(f) => f.capacity(),
            WordKind::SlidingWindow(w) => w.capacity(),
        }
    }
}

impl Policy for LogPolicy {
    fn quota(&self) -> Quota {
        self.quota
    }

    fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError> {
        windows_only(Algorithm::SlidingLog, quota)?;
        Ok(Self {
            quota,
            log: SlidingLog::new(quota)?,
        })
    }

    fn capacity(&self) -> u64 {
        self.log.capacity()
    }
}

/// The quota's limit, if `algorithm` can hold it (at most `max`).
fn capped_limit(quota: Quota, max: u64, algorithm: &'static str) -> Result<u64, ConfigError> {
    let limit = quota.limit();
    if limit > max {
        return Err(ConfigError::LimitTooLarge {
            algorithm,
            limit,
            max,
        });
    }
    Ok(limit)
}

/// A divisor fixed when a policy is built, divided by with a multiply and a shift instead
/// of a hardware division (tens of cycles) on the check path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Divisor(strength_reduce::StrengthReducedU64);

impl Divisor {
    /// `divisor` must not be zero.
    pub(crate) fn new(divisor: u64) -> Self {
        Self(strength_reduce::StrengthReducedU64::new(divisor))
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.get()
    }

    /// `⌊n / divisor⌋`.
    #[inline(always)]
    pub(crate) fn div(&self, n: u64) -> u64 {
        n / self.0
    }

    /// `⌈n / divisor⌉` for a 128-bit `n`, fast while `n` fits 64 bits.
    #[inline]
    pub(crate) fn div_ceil_wide(&self, n: u128) -> u128 {
        match u64::try_from(n) {
            Ok(n) => {
                let (q, r) = strength_reduce::StrengthReducedU64::div_rem(n, self.0);
                u128::from(q + u64::from(r != 0))
            }
            Err(_) => n.div_ceil(u128::from(self.get())),
        }
    }
}

impl PartialEq for Divisor {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for Divisor {}

/// The absolute window of a window counter's `tag` (the window's low bits, `mask`
/// wide), judged from `now_window`: the latest window at or before it with that tag, or
/// `None` if the tag lies ahead of it (within half the tag's range: a later clock's) or
/// more than half the range behind (ancient, but ambiguous: kept).
fn window_of(tag: u64, now_window: u64, mask: u64) -> Option<u64> {
    let behind = now_window.wrapping_sub(tag) & mask;
    if behind > mask / 2 {
        return None;
    }
    Some(now_window.saturating_sub(behind))
}

/// Clamps a `u128` nanosecond count to `u64`.
fn clamp_ns(ns: u128) -> u64 {
    u64::try_from(ns).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The divisor's quotient is the hardware division's, for every divisor kind: 1,
    /// powers of two, their neighbours (where the magic number's rounding is tightest),
    /// the largest divisors, and random ones, each against numerators at the edges
    /// (0, the divisor's neighbours, its multiples, `u64::MAX`) and random ones; the
    /// rounded-up wide division too.
    #[test]
    fn the_divisor_divides_exactly() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut divisors = vec![1, 2, 3, 5, 7, 10, 1_000_000_007, u64::MAX, u64::MAX - 1];
        for k in 1..64 {
            let p = 1u64 << k;
            divisors.extend([p - 1, p, p + 1, p | (p >> 1)]);
        }
        for _ in 0..2_000 {
            let bits = next() % 64;
            divisors.push((next() >> bits).max(1));
        }
        for &d in &divisors {
            let divisor = Divisor::new(d);
            assert_eq!(divisor.get(), d);
            let mut numerators = vec![0, 1, d - 1, d, d.saturating_add(1), u64::MAX, u64::MAX - 1];
            numerators.extend([2, 3, u64::MAX / d].map(|m| d.saturating_mul(m)));
            numerators.extend([2, 3, u64::MAX / d].map(|m| d.saturating_mul(m) - 1));
            for _ in 0..200 {
                let bits = next() % 64;
                numerators.push(next() >> bits);
            }
            for n in numerators {
                assert_eq!(divisor.div(n), n / d, "{n} / {d}");
                assert_eq!(
                    divisor.div_ceil_wide(u128::from(n)),
                    u128::from(n.div_ceil(d)),
                    "⌈{n} / {d}⌉"
                );
            }
            let wide = u128::from(u64::MAX) * 3 + 1;
            assert_eq!(divisor.div_ceil_wide(wide), wide.div_ceil(u128::from(d)));
        }
    }

    /// A settlement of several quotas: the most constraining decision, marked with its
    /// quota; on a refusal, a charge is given back to the quotas before it (and only to
    /// them), a refund is not undone.
    #[test]
    fn a_settlement_of_several_quotas_is_all_or_nothing() {
        let remaining = [7u64, 3, 5];
        let run = |settle: Settle, refuse_at: Option<usize>| {
            let mut calls = Vec::new();
            let result = settle.all(0..remaining.len(), |part, op| {
                calls.push((part, op));
                if Some(part) == refuse_at && op == settle {
                    return Err(part);
                }
                Ok(Decision::allow(10, remaining[part], 0))
            });
            (result, calls)
        };
        let (result, calls) = run(Settle::Charge(2), None);
        let tightest = result.unwrap();
        assert_eq!((tightest.remaining(), tightest.policy()), (3, 1));
        assert_eq!(calls.len(), 3);
        let (result, calls) = run(Settle::Charge(2), Some(2));
        assert_eq!(result.unwrap_err(), 2);
        assert_eq!(
            calls,
            [
                (0, Settle::Charge(2)),
                (1, Settle::Charge(2)),
                (2, Settle::Charge(2)),
                (0, Settle::Refund(2)),
                (1, Settle::Refund(2)),
            ]
        );
        let (result, calls) = run(Settle::Refund(2), Some(1));
        assert_eq!(result.unwrap_err(), 1);
        assert_eq!(calls, [(0, Settle::Refund(2)), (1, Settle::Refund(2))]);
    }

    /// A window counter written after an instant never passes for untouched at it, even
    /// many windows earlier, or when a later clock wrote it ahead of `now`'s window (the
    /// tag is read against `now`, not against the earlier instant); the buckets' states
    /// are instants and judge any instant exactly.
    #[test]
    fn a_state_written_later_is_never_untouched_earlier() {
        const SEC: u64 = 1_000_000_000;
        for algorithm in [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
        ] {
            let Ok(AnyPolicy::Word(p)) =
                AnyPolicy::new(algorithm, Quota::per_second(5).unwrap(), 0)
            else {
                panic!("{algorithm:?} is a word algorithm")
            };
            let written_at = 100 * SEC + SEC / 2;
            let Outcome::Allow { state, .. } = p.evaluate(UNTOUCHED, written_at, 1) else {
                panic!("{algorithm:?}: a fresh key admits one unit")
            };
            for since in [0, 10 * SEC, 98 * SEC, 99 * SEC + 1, written_at - 1] {
                for now in [written_at, written_at + SEC / 4, written_at - SEC / 2] {
                    assert!(
                        p.untouched_wait(state, now, since) > 0,
                        "{algorithm:?}: written at {written_at}, untouched at {since} (now {now})"
                    );
                }
            }
            // Long after, it is untouched, and was from its reset on.
            let later = 200 * SEC;
            let reset = written_at + p.reset_after_ns(state, written_at);
            assert_eq!(
                p.untouched_wait(state, later, reset + SEC),
                0,
                "{algorithm:?}"
            );
            assert_eq!(
                p.untouched_wait(state, later, later - SEC),
                0,
                "{algorithm:?}"
            );
            assert_eq!(p.untouched_wait(UNTOUCHED, later, 0), 0, "{algorithm:?}");
        }
    }
}
