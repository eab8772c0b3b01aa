//! The permit of a Redis concurrency limit: a lease renewed while it is held, given back
//! by [`RedisPermit::release`] (or, dropped, in the background), and the error of an
//! acquire.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::Inner;
use crate::clock::Clock;
use crate::concurrency::{ConcurrencyError, Permit};
use crate::decision::Decision;
use crate::redis::RedisError;

/// Why a Redis concurrency limiter gave no permit.
#[derive(Debug)]
#[non_exhaustive]
pub enum PermitError {
    /// Redis (or the deny cache, or the fail mode's local limit) refused: the key is
    /// full, the weight never fits, or the rate decided with it denied.
    Refused(ConcurrencyError),
    /// Redis failed, under [`FailMode::Closed`](crate::FailMode::Closed).
    Redis(RedisError),
}

impl PermitError {
    /// The refusal, when the limit (not Redis) said no.
    pub fn refusal(&self) -> Option<&ConcurrencyError> {
        match self {
            Self::Refused(refusal) => Some(refusal),
            Self::Redis(_) => None,
        }
    }
}

impl fmt::Display for PermitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(refusal) => refusal.fmt(f),
            Self::Redis(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for PermitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Refused(refusal) => Some(refusal),
            Self::Redis(e) => Some(e),
        }
    }
}

impl From<RedisError> for PermitError {
    fn from(e: RedisError) -> Self {
        Self::Redis(e)
    }
}

/// Slots of one key held across the fleet, as a lease in Redis that the limiter renews
/// while the permit is held and its limiter lives.
///
/// Give it back with [`release`](Self::release) (one script call). Dropped without it,
/// the permit stops its renewal and sends the release in the background (on the tokio
/// runtime it is dropped in, if any); if that cannot reach Redis, the slots come back
/// when the lease expires.
#[must_use = "a permit gives its slots back when it is released or dropped"]
pub struct RedisPermit {
    kind: Kind,
    decision: Option<Decision>,
}

pub(super) enum Kind {
    Lease(Lease),
    /// The fail mode's in-process slot.
    Local(Permit),
    /// The fail mode `Open`: nothing held.
    Unlimited(u32),
    /// A weight of 0.
    Empty,
}

pub(super) struct Lease {
    pub(super) limiter: Arc<Inner>,
    pub(super) id: u64,
    pub(super) weight: u32,
    pub(super) state: Arc<LeaseState>,
    pub(super) released: bool,
}

/// A lease as the renewal task sees it.
pub(crate) struct LeaseState {
    pub(super) leases: Vec<u8>,
    pub(super) weights: Vec<u8>,
    pub(super) member: String,
    /// Monotonic ns until which the lease is surely held (counted from before the call
    /// that set it).
    until: AtomicU64,
    lost: AtomicBool,
}

impl LeaseState {
    pub(super) fn new(leases: Vec<u8>, weights: Vec<u8>, member: String, until: u64) -> Self {
        Self {
            leases,
            weights,
            member,
            until: AtomicU64::new(until),
            lost: AtomicBool::new(false),
        }
    }

    pub(super) fn renewed(&self, until: u64) {
        self.until.fetch_max(until, Ordering::Relaxed);
    }

    pub(super) fn lose(&self) {
        self.lost.store(true, Ordering::Relaxed);
    }
}

impl RedisPermit {
    pub(super) fn new(kind: Kind, decision: Option<Decision>) -> Self {
        Self { kind, decision }
    }

    /// The slots it holds.
    pub fn weight(&self) -> u32 {
        match &self.kind {
            Kind::Lease(lease) => lease.weight,
            Kind::Local(permit) => permit.weight(),
            Kind::Unlimited(weight) => *weight,
            Kind::Empty => 0,
        }
    }

    /// The rate's decision, for a limiter with a [`rate`](super::RedisConcurrencyBuilder::rate)
    /// (for the rate-limit headers).
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// Whether the slots are held in Redis (not by the fail mode in process, or not at
    /// all).
    pub fn is_lease(&self) -> bool {
        matches!(self.kind, Kind::Lease(_))
    }

    /// Whether the lease may have expired: a renewal found it gone, or none succeeded
    /// within the lease (Redis unreachable, or the limiter dropped). Its slots may be
    /// another's now; a holder that must not overrun its slot stops its work.
    pub fn is_lost(&self) -> bool {
        match &self.kind {
            Kind::Lease(lease) => {
                let state = &lease.state;
                state.lost.load(Ordering::Relaxed)
                    || lease.limiter.monotonic.now_ns() >= state.until.load(Ordering::Relaxed)
            }
            _ => false,
        }
    }

    /// Gives the slots back now: one script call for a lease.
    ///
    /// # Errors
    /// [`PermitError::Redis`] when the call fails: the lease is no longer renewed, and
    /// its slots come back when it expires.
    pub async fn release(mut self) -> Result<(), PermitError> {
        let Kind::Lease(lease) = &mut self.kind else {
            return Ok(());
        };
        lease.released = true;
        let limiter = Arc::clone(&lease.limiter);
        let state = Arc::clone(&lease.state);
        limiter.leases.lock().remove(&lease.id);
        release_lease(&limiter, &state)
            .await
            .map_err(PermitError::Redis)
    }
}

/// Gives back `state`'s slots.
async fn release_lease(limiter: &Arc<Inner>, state: &LeaseState) -> Result<(), RedisError> {
    if let Some(cache) = &limiter.deny_cache {
        cache.forget(&state.leases);
    }
    let held = limiter
        .release_or_renew((&state.leases, &state.weights), None, &[&state.member])
        .await?;
    if held.first() == Some(&false) {
        state.lose();
    }
    Ok(())
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.limiter.leases.lock().remove(&self.id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (limiter, state) = (Arc::clone(&self.limiter), Arc::clone(&self.state));
            runtime.spawn(async move {
                let _ = release_lease(&limiter, &state).await;
            });
        }
    }
}

impl fmt::Debug for RedisPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("weight", &self.weight())
            .field("lease", &self.is_lease())
            .finish()
    }
}
