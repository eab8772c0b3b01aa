//! Waiting instead of rejecting: throttling (cargo feature `tokio`).
//!
//! A rate limiter rejects; a throttle paces the work. These calls wait — asynchronously,
//! on tokio's timer — until a request can be admitted, then admit it. For the
//! [`LeakyBucket`](crate::Algorithm::LeakyBucket) they also wait for the admitted
//! request's slot, so callers leave at a constant rate (nginx `burst` without
//! `nodelay`).
//!
//! Time is read from the limiter's clock and slept on tokio's timer, so use
//! [`MonotonicClock`](crate::clock::MonotonicClock) in production and
//! [`TokioClock`](crate::clock::TokioClock) in tests under `tokio::time::pause()`, where
//! waits complete instantly in virtual time. A [`ManualClock`](crate::clock::ManualClock)
//! only moves when told to, so a waiter on it waits for whoever moves it.

use std::borrow::Borrow;
use std::cell::Cell;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::time::Duration;

use crate::clock::Clock;
use crate::clock::nanos;
use crate::decision::Decision;
use crate::error::{ConfigError, InsufficientCapacity};
use crate::limiter::RateLimiter;
use crate::rng::XorShift;

/// A random extra wait added to every retry, so that many waiters do not wake in
/// lockstep.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollgate::{Jitter, RateLimiter};
///
/// let limiter: RateLimiter<u64> = RateLimiter::new("100/s".parse()?);
/// // Each retry waits its exact retry-after plus up to 5 ms more, at random.
/// let decision = limiter
///     .until_ready_with_jitter(&7, 1, Jitter::up_to(Duration::from_millis(5)))
///     .await?;
/// assert!(decision.is_allowed());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Jitter {
    min: Duration,
    max: Duration,
}

impl Jitter {
    /// No jitter.
    pub const NONE: Jitter = Jitter {
        min: Duration::ZERO,
        max: Duration::ZERO,
    };

    /// A uniformly random extra wait between zero and `max`.
    pub fn up_to(max: Duration) -> Self {
        Self {
            min: Duration::ZERO,
            max,
        }
    }

    /// A uniformly random extra wait between `min` and `max`, inclusive.
    ///
    /// # Errors
    /// [`ConfigError::InvalidJitter`] when `min > max`.
    pub fn between(min: Duration, max: Duration) -> Result<Self, ConfigError> {
        if min > max {
            return Err(ConfigError::InvalidJitter { min, max });
        }
        Ok(Self { min, max })
    }

    /// One random draw.
    pub fn sample(&self) -> Duration {
        let span = (self.max - self.min).as_nanos();
        if span == 0 {
            return self.min;
        }
        let draw = u128::from(random_u64()) % (span + 1);
        self.min + Duration::from_nanos(u64::try_from(draw).unwrap_or(u64::MAX))
    }
}

/// A draw of a per-thread generator, seeded from std's randomly keyed hasher.
fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<XorShift> = Cell::new(XorShift::new(
            std::collections::hash_map::RandomState::new().hash_one(std::thread::current().id()),
        ));
    }
    STATE.with(|state| {
        let mut rng = state.get();
        let x = rng.next_u64();
        state.set(rng);
        x
    })
}

/// Why [`RateLimiter::acquire_timeout`] gave up. Nothing was consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireError {
    /// The cost exceeds what the quota can ever admit at once.
    InsufficientCapacity(InsufficientCapacity),
    /// Admission (and, for the leaky bucket, the request's slot) is further away than
    /// the caller would wait.
    Timeout {
        /// How long the request would have had to wait.
        needed: Duration,
        /// How long the caller would wait.
        max_wait: Duration,
    },
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InsufficientCapacity(e) => e.fmt(f),
            Self::Timeout { needed, max_wait } => write!(
                f,
                "rate limited: admission needs a wait of {needed:?}, more than the {max_wait:?} allowed"
            ),
        }
    }
}

impl std::error::Error for AcquireError {}

impl From<InsufficientCapacity> for AcquireError {
    fn from(e: InsufficientCapacity) -> Self {
        Self::InsufficientCapacity(e)
    }
}

impl<K: crate::Key, C: Clock> RateLimiter<K, C> {
    /// Waits until one request for `key` can be admitted, then admits it. For the leaky
    /// bucket, also waits for the request's slot.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate::RateLimiter;
    ///
    /// // A worker that may send 50 emails a second, 10 at once.
    /// let limiter: RateLimiter<String> = RateLimiter::new("50/s burst 10".parse()?);
    /// for _ in 0..12 {
    ///     limiter.until_ready("smtp").await; // sleeps only once the burst is spent
    ///     // send one email
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn until_ready<Q>(&self, key: &Q) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        loop {
            // Every quota admits a cost of 1, so this returns on its first pass.
            if let Ok(decision) = self.until_ready_n(key, 1).await {
                return decision;
            }
        }
    }

    /// Waits until a request of cost `n` for `key` can be admitted, then admits it.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] at once, when no wait would let `n` pass.
    pub async fn until_ready_n<Q>(&self, key: &Q, n: u64) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.until_ready_with_jitter(key, n, Jitter::NONE).await
    }

    /// [`until_ready_n`](Self::until_ready_n), adding a random `jitter` to every retry so
    /// that many waiters spread out.
    ///
    /// # Errors
    /// [`InsufficientCapacity`] at once, when no wait would let `n` pass.
    pub async fn until_ready_with_jitter<Q>(
        &self,
        key: &Q,
        n: u64,
        jitter: Jitter,
    ) -> Result<Decision, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        loop {
            match self.acquire(key, n, None, jitter).await {
                Ok(decision) => return Ok(decision),
                Err(AcquireError::InsufficientCapacity(e)) => return Err(e),
                // Only a deadline times out, and none was set: this never loops.
                Err(AcquireError::Timeout { .. }) => continue,
            }
        }
    }

    /// Waits at most `max_wait` for a request of cost `n` for `key` to be admitted (and,
    /// for the leaky bucket, for its slot). Gives up at once, consuming nothing, when the
    /// wait is known to exceed `max_wait`.
    ///
    /// # Errors
    /// [`AcquireError::Timeout`] with the wait that would have been needed, or
    /// [`AcquireError::InsufficientCapacity`].
    pub async fn acquire_timeout<Q>(
        &self,
        key: &Q,
        n: u64,
        max_wait: Duration,
    ) -> Result<Decision, AcquireError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.acquire(key, n, Some(max_wait), Jitter::NONE).await
    }

    async fn acquire<Q>(
        &self,
        key: &Q,
        n: u64,
        max_wait: Option<Duration>,
        jitter: Jitter,
    ) -> Result<Decision, AcquireError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let deadline = max_wait.map(|w| self.clock().now_ns().saturating_add(nanos(w)));
        loop {
            let max_delay = match (deadline, max_wait) {
                (Some(deadline), Some(max_wait)) => {
                    let now = self.clock().now_ns();
                    let budget = deadline.saturating_sub(now);
                    let needed = self.wait_needed(key, n, now)?;
                    if needed > budget {
                        return Err(AcquireError::Timeout {
                            needed: Duration::from_nanos(needed),
                            max_wait,
                        });
                    }
                    budget
                }
                _ => u64::MAX,
            };
            let decision = self.check_within(key, n, max_delay)?;
            if decision.is_allowed() {
                tokio::time::sleep(decision.delay()).await;
                return Ok(decision);
            }
            let retry = decision.retry_after().unwrap_or_default();
            tokio::time::sleep(retry + jitter.sample()).await;
        }
    }

    /// How long a request of cost `n` would wait from `now` until admitted and, for the
    /// leaky bucket, served, if nothing else consumes.
    fn wait_needed<Q>(&self, key: &Q, n: u64, now: u64) -> Result<u64, InsufficientCapacity>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let mut at = now;
        // Each retry-after is exact, so the second look always admits; the bound only
        // guards against a clock at the end of time.
        for _ in 0..4 {
            let decision = self.peek_at(key, n, at)?;
            match decision.retry_after() {
                None => return Ok((at - now).saturating_add(decision.delay_ns())),
                Some(retry) => at = at.saturating_add(nanos(retry)),
            }
        }
        Ok(at - now)
    }
}
