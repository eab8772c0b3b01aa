//! The answer to a check.

use std::time::Duration;

/// The outcome of a check: whether it passed, and what the caller needs to tell the client.
///
/// All durations are exact integer nanoseconds from the instant of the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    allowed: bool,
    limit: u64,
    remaining: u64,
    reset_after_ns: u64,
    retry_after_ns: u64,
    delay_ns: u64,
}

impl Decision {
    /// An admitting decision.
    pub(crate) fn allow(limit: u64, remaining: u64, reset_after_ns: u64) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after_ns,
            retry_after_ns: 0,
            delay_ns: 0,
        }
    }

    /// The same decision, admitted into a slot `delay_ns` from now.
    pub(crate) fn with_delay(self, delay_ns: u64) -> Self {
        Self { delay_ns, ..self }
    }

    /// A denying decision; `retry_after_ns` is raised to at least 1ns.
    pub(crate) fn deny(
        limit: u64,
        remaining: u64,
        reset_after_ns: u64,
        retry_after_ns: u64,
    ) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after_ns,
            retry_after_ns: retry_after_ns.max(1),
            delay_ns: 0,
        }
    }

    /// For an admitted request of the [`LeakyBucket`](crate::Algorithm::LeakyBucket): how
    /// long it should wait for its slot in the queue before being served (the waiting API
    /// sleeps this long). Zero for every other algorithm, and for denies.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns)
    }

    /// `delay` in nanoseconds.
    pub(crate) fn delay_ns(&self) -> u64 {
        self.delay_ns
    }

    /// `reset_after` in nanoseconds.
    pub(crate) fn reset_after_ns(&self) -> u64 {
        self.reset_after_ns
    }

    /// Whether the request was admitted (and, for a check, consumed quota).
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The most the key can be admitted at once: the burst for the token bucket, the
    /// quota's limit for window algorithms.
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
        (!self.allowed).then(|| Duration::from_nanos(self.retry_after_ns))
    }
}
