//! The answer to a check.

use std::time::Duration;

use crate::error::InsufficientCapacity;

/// What kind of answer a [`Decision`] is, and for which of the limiter's quotas: the
/// verdict in the low byte, the quota's index above it.
///
/// One word as wide as the other fields, so a `Decision` has no padding: copies of it
/// (and of the `Result`s wrapping it) move whole words, and reading the verdict back never
/// waits on a store of a different width (a store-forwarding stall).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Verdict(u64);

impl Verdict {
    /// Admitted; `wait_ns` is the slot delay (leaky bucket), else 0.
    const ALLOWED: u64 = 0;
    /// Denied by the key's quota; `wait_ns` is the retry-after.
    const DENIED: u64 = 1;
    /// Denied because the store was full; `wait_ns` is the retry-after.
    const NO_ROOM: u64 = 2;

    #[inline(always)]
    fn kind(self) -> u64 {
        self.0 & 0xff
    }

    #[inline(always)]
    fn policy(self) -> usize {
        (self.0 >> 8) as usize
    }
}

impl std::fmt::Debug for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind() {
            Self::ALLOWED => "Allowed",
            Self::DENIED => "Denied",
            _ => "NoRoom",
        };
        match self.policy() {
            0 => f.write_str(kind),
            policy => write!(f, "{kind} (policy {policy})"),
        }
    }
}

/// The outcome of a check: whether it passed, and what the caller needs to tell the client.
///
/// All durations are exact integer nanoseconds from the instant of the check.
// `repr(C)` with the verdict last: the check path stores a new decision as two 16-byte
// pairs and the verdict word, and copies it the same way. With the verdict first (Rust's
// order), the copy's 16-byte loads would each straddle two stores and stall on store
// forwarding.
///
/// ```
/// use tollgate::RateLimiter;
///
/// let limiter: RateLimiter<u64> = RateLimiter::new("1/s".parse()?);
/// let first = limiter.check(&1);
/// assert!(first.is_allowed());
/// assert_eq!((first.limit(), first.remaining()), (1, 0));
/// let second = limiter.check(&1);
/// let wait = second.retry_after().expect("a deny says when to retry");
/// assert!(wait > std::time::Duration::ZERO); // never "retry after 0"
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Decision {
    limit: u64,
    remaining: u64,
    reset_after_ns: u64,
    /// The retry-after of a deny, or the slot delay of an admission.
    wait_ns: u64,
    verdict: Verdict,
}

impl Decision {
    /// An admitting decision.
    pub(crate) fn allow(limit: u64, remaining: u64, reset_after_ns: u64) -> Self {
        Self {
            verdict: Verdict(Verdict::ALLOWED),
            limit,
            remaining,
            reset_after_ns,
            wait_ns: 0,
        }
    }

    /// A denying decision; `retry_after_ns` is raised to at least 1ns.
    pub(crate) fn deny(
        limit: u64,
        remaining: u64,
        reset_after_ns: u64,
        retry_after_ns: u64,
    ) -> Self {
        Self {
            verdict: Verdict(Verdict::DENIED),
            limit,
            remaining,
            reset_after_ns,
            wait_ns: retry_after_ns.max(1),
        }
    }

    /// A unit request's decision whose earliest admission is `wait_ns` away: admitted
    /// when `wait_ns` is 0, else denied with that retry-after. One constructor for both
    /// outcomes, so a caller that picks between them builds the decision once, in
    /// registers, rather than through a branch per outcome (a settlement's answer: see
    /// `Gcra::unit_view`).
    #[inline(always)]
    pub(crate) fn waiting(limit: u64, remaining: u64, reset_after_ns: u64, wait_ns: u64) -> Self {
        Self {
            verdict: Verdict(u64::from(wait_ns != 0) * Verdict::DENIED),
            limit,
            remaining,
            reset_after_ns,
            wait_ns,
        }
    }

    /// A deny because the limiter holds `max_keys` keys and none could make room for this
    /// new one.
    pub(crate) fn capacity_deny(limit: u64, retry_after_ns: u64) -> Self {
        Self {
            verdict: Verdict(Verdict::NO_ROOM),
            ..Self::deny(limit, 0, 0, retry_after_ns)
        }
    }

    /// The same admission, into a slot `delay_ns` from now.
    pub(crate) fn with_delay(self, delay_ns: u64) -> Self {
        if self.is_allowed() {
            Self {
                wait_ns: delay_ns,
                ..self
            }
        } else {
            self
        }
    }

    /// The same decision, about the limiter's quota number `policy` (see
    /// [`policy`](Self::policy)).
    pub(crate) fn for_policy(self, policy: usize) -> Self {
        Self {
            verdict: Verdict(self.verdict.kind() | (policy as u64) << 8),
            ..self
        }
    }

    /// Of this decision and `other`, about the same request under different quotas,
    /// the more constraining: a deny before an admission; of two denies, the longer
    /// wait (this one on a tie); of two admissions, the fewer units left, then the
    /// longer time to full, with the later of both delays (the leaky bucket's slot).
    #[inline]
    pub(crate) fn tighter(self, other: Self) -> Self {
        match (self.is_allowed(), other.is_allowed()) {
            (true, false) => other,
            (false, true) => self,
            (false, false) if other.retry_after_ns() > self.retry_after_ns() => other,
            (false, false) => self,
            (true, true) => {
                let delay = self.delay_ns().max(other.delay_ns());
                let key = |d: &Self| (d.remaining, std::cmp::Reverse(d.reset_after_ns));
                let pick = if key(&other) < key(&self) {
                    other
                } else {
                    self
                };
                pick.with_delay(delay)
            }
        }
    }

    /// [`tighter`](Self::tighter) of two admissions, field by field: each field a scalar
    /// select, so a caller's decision stays in registers (a select of whole decisions
    /// went through the stack, and reading it back stalled on store forwarding).
    #[inline(always)]
    pub(crate) fn tighter_admission(self, other: Self) -> Self {
        let take = (other.remaining, std::cmp::Reverse(other.reset_after_ns))
            < (self.remaining, std::cmp::Reverse(self.reset_after_ns));
        let pick = |a: u64, b: u64| if take { b } else { a };
        Self {
            limit: pick(self.limit, other.limit),
            remaining: pick(self.remaining, other.remaining),
            reset_after_ns: pick(self.reset_after_ns, other.reset_after_ns),
            wait_ns: self.wait_ns.max(other.wait_ns),
            verdict: Verdict(pick(self.verdict.0, other.verdict.0)),
        }
    }

    /// This deny, reporting `remaining` units left if that is fewer (the fewest left
    /// among every quota of a limiter with several).
    pub(crate) fn with_fewest(self, remaining: u64) -> Self {
        if remaining >= self.remaining {
            return self;
        }
        Self { remaining, ..self }
    }

    /// The decision of a request under several quotas, given each quota's own decision
    /// of it (tagged with [`for_policy`](Self::for_policy)), every one taken against the
    /// same state: when all admit, the tightest admission ([`tighter`](Self::tighter));
    /// otherwise the denying quota with the longest wait (the first on a tie), with the
    /// fewest units left of all. `None` for no quota.
    pub(crate) fn all_of(decisions: impl IntoIterator<Item = Self>) -> Option<Self> {
        let mut admitted: Option<Self> = None;
        let mut denied: Option<Self> = None;
        let mut fewest = u64::MAX;
        for decision in decisions {
            fewest = fewest.min(decision.remaining);
            let tightest = if decision.is_allowed() {
                &mut admitted
            } else {
                &mut denied
            };
            *tightest = Some(tightest.map_or(decision, |t| t.tighter(decision)));
        }
        match denied {
            Some(deny) => Some(deny.with_fewest(fewest)),
            None => admitted,
        }
    }

    /// Whether the request was admitted (and, for a check, consumed quota).
    #[inline(always)]
    pub fn is_allowed(&self) -> bool {
        self.verdict.kind() == Verdict::ALLOWED
    }

    /// Whether this deny came from the key cap ([`Builder::max_keys`](crate::Builder::max_keys))
    /// rather than from the key's quota: the key holds no state yet.
    pub fn is_capacity_deny(&self) -> bool {
        self.verdict.kind() == Verdict::NO_ROOM
    }

    /// Which of the limiter's quotas this decision describes: 0 for the quota the
    /// limiter was built with, 1 for the first [`also`](crate::Builder::also) quota, and
    /// so on. A limiter with several quotas reports the most constraining one: for an
    /// admission, the quota with the fewest units left; for a deny, the denying quota
    /// with the longest wait. Always 0 for a limiter with one quota.
    ///
    /// ```
    /// use tollgate::RateLimiter;
    ///
    /// let limiter: RateLimiter<u64> = RateLimiter::builder("5/s".parse()?)
    ///     .also("2/min".parse()?)
    ///     .build()?;
    /// assert_eq!(limiter.check(&1).policy(), 1); // 4 of 5/s left, 1 of 2/min
    /// limiter.check(&1);
    /// let denied = limiter.check(&1);
    /// assert_eq!((denied.is_allowed(), denied.policy(), denied.limit()), (false, 1, 2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn policy(&self) -> usize {
        self.verdict.policy()
    }

    /// The most the key can be admitted at once: the burst for the token and leaky
    /// buckets, the quota's limit for the window algorithms.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// How many unit-cost requests would still be admitted right after this decision.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The time until the key is back to its full, untouched state if nothing else consumes.
    pub fn reset_after(&self) -> Duration {
        Duration::from_nanos(self.reset_after_ns)
    }

    /// `None` when allowed. When denied, the exact time after which the same request would
    /// be allowed if nothing else consumes: rounded up to whole nanoseconds, never zero.
    pub fn retry_after(&self) -> Option<Duration> {
        (!self.is_allowed()).then(|| Duration::from_nanos(self.wait_ns))
    }

    /// For an admitted request of the [`LeakyBucket`](crate::Algorithm::LeakyBucket): how
    /// long it should wait for its slot in the queue before being served (the waiting API
    /// sleeps this long). Zero for every other algorithm, and for denies.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns())
    }

    /// `delay` in nanoseconds.
    pub(crate) fn delay_ns(&self) -> u64 {
        if self.is_allowed() { self.wait_ns } else { 0 }
    }

    /// `reset_after` in nanoseconds.
    pub(crate) fn reset_after_ns(&self) -> u64 {
        self.reset_after_ns
    }

    /// `retry_after` in nanoseconds for a deny (never 0); 0 for an admission.
    pub(crate) fn retry_after_ns(&self) -> u64 {
        if self.is_allowed() { 0 } else { self.wait_ns }
    }
}

/// The decision of a unit request: every quota admits at least one unit at once, so a
/// cost of 1 always fits, and the error is never met (were it ever, it would be a deny
/// that never passes, not a panic).
#[inline(always)]
pub(crate) fn unit(decided: Result<Decision, InsufficientCapacity>) -> Decision {
    decided.unwrap_or_else(|e| Decision::deny(e.capacity, 0, 0, u64::MAX))
}
