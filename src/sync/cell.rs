//! A synced key's local state: a lease and an overdraft counted down by checks (one CAS,
//! no clock, no lock), and the books only the sync task reads.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::algorithm::Policy;
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::store::state::State;

use super::node::Books;
use parking_lot::Mutex;

/// Set in [`SyncCell::flags`] by a denied check: the key ran out.
pub(crate) const WANTED: u64 = 1;

/// What checks do while Redis has been unreachable for longer than the staleness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Override {
    /// Normal operation: spend the allowance.
    None,
    /// Admit everything (consumption is still counted and reported later).
    AllowAll,
    /// Deny everything.
    DenyAll,
}

/// The local policy of a synced limiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SyncPolicy {
    pub(crate) quota: Quota,
    pub(crate) capacity: u64,
    /// The allowance a key starts with on this node.
    pub(crate) fresh: u64,
    /// When a denied key may hope for more allowance: one sync interval, in ns.
    pub(crate) interval_ns: u64,
    pub(crate) override_: Override,
}

impl SyncPolicy {
    pub(crate) fn new(quota: Quota, capacity: u64, fresh: u64, interval_ns: u64) -> Self {
        Self {
            quota,
            capacity,
            fresh,
            interval_ns,
            override_: Override::None,
        }
    }
}

impl Policy for SyncPolicy {
    fn quota(&self) -> Quota {
        self.quota
    }

    fn with_quota(&self, quota: Quota) -> Result<Self, ConfigError> {
        if quota == self.quota {
            return Ok(*self);
        }
        Err(ConfigError::Unsupported(
            "a synced limiter's quota is global: restart every node with the new quota",
        ))
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }
}

/// A synced key on this node: tokens leased from the global state, an overdraft beyond
/// them (reconcile mode), until when the lease may be spent, and the books the sync task
/// keeps for the key. Checks touch only the first five fields.
#[derive(Debug, Default)]
pub(crate) struct SyncCell {
    /// Leased tokens: already reserved in the global state.
    pub(crate) allowance: AtomicU64,
    /// Tokens that may be admitted beyond the lease (reconcile mode, and the local
    /// fallback): reported in the next round's floor.
    pub(crate) overdraft: AtomicU64,
    /// The [`WANTED`] flag, and when (limiter clock, ns) it was set: how long the key's
    /// allowance lasted tells its demand.
    pub(crate) flags: AtomicU64,
    pub(crate) ran_out_at: AtomicU64,
    /// Units admitted with no allowance at all, under [`Override::AllowAll`].
    pub(crate) overdrawn: AtomicU64,
    /// The limiter-clock instant (ns) after which the lease is void: the end of Redis's
    /// window, for a sliding-window lease in lease mode; never otherwise.
    pub(crate) expires: AtomicU64,
    /// The sync task's books: only the task takes this lock.
    pub(crate) books: Mutex<Books>,
}

impl SyncCell {
    /// Whether the task released the key (its last round returned everything and
    /// reported everything) and no check has touched it since.
    pub(crate) fn is_released(&self) -> bool {
        self.allowance.load(Ordering::Acquire) == 0
            && self.overdraft.load(Ordering::Acquire) == 0
            && self.overdrawn.load(Ordering::Acquire) == 0
            && self.flags.load(Ordering::Acquire) & WANTED == 0
            && self.books.try_lock().is_some_and(|b| b.released)
    }

    fn decision(policy: &SyncPolicy, allowed: bool, remaining: u64) -> Decision {
        if allowed {
            Decision::allow(policy.capacity, remaining, policy.interval_ns)
        } else {
            Decision::deny(
                policy.capacity,
                remaining,
                policy.interval_ns,
                policy.interval_ns,
            )
        }
    }

    /// Marks the key as run out, at `now`: written once per round (the first deny), so
    /// that repeated denies write nothing.
    pub(crate) fn want(&self, now: u64) {
        if self.flags.load(Ordering::Relaxed) & WANTED == 0 {
            self.ran_out_at.store(now, Ordering::Relaxed);
            self.flags.fetch_or(WANTED, Ordering::Release);
        }
    }

    /// Takes `cost` from `pool` if it holds that much.
    fn spend(pool: &AtomicU64, cost: u64) -> Option<u64> {
        pool.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            left.checked_sub(cost)
        })
        .ok()
        .map(|left| left - cost)
    }
}

impl State for SyncCell {
    type Policy = SyncPolicy;

    /// The sync task grants allowance at any moment, so a deny is not cached.
    const DENIES_ARE_STABLE: bool = false;

    /// A key first seen on this node may overdraft `fresh` (its share of a fresh key's
    /// capacity in reconcile mode, nothing in lease mode) until its first round.
    fn fresh(policy: &SyncPolicy) -> Self {
        Self {
            overdraft: AtomicU64::new(policy.fresh),
            expires: AtomicU64::new(u64::MAX),
            books: Mutex::new(Books::fresh(policy.fresh)),
            ..Self::default()
        }
    }

    /// Spends `cost` of the lease, else of the overdraft, by one CAS. A deny writes only
    /// the [`WANTED`] flag, once per round.
    #[inline]
    fn check(&self, policy: &SyncPolicy, now: u64, cost: u64, _max_delay: u64) -> Decision {
        match policy.override_ {
            Override::AllowAll => {
                self.overdrawn.fetch_add(cost, Ordering::Relaxed);
                return Self::decision(policy, true, 0);
            }
            Override::DenyAll => return Self::decision(policy, false, 0),
            Override::None => {}
        }
        if now < self.expires.load(Ordering::Acquire) {
            if let Some(left) = Self::spend(&self.allowance, cost) {
                return Self::decision(policy, true, left + self.overdraft.load(Ordering::Relaxed));
            }
        }
        if let Some(left) = Self::spend(&self.overdraft, cost) {
            return Self::decision(policy, true, left);
        }
        self.want(now);
        Self::decision(policy, false, 0)
    }

    fn peek(&self, policy: &SyncPolicy, now: u64, cost: u64) -> Decision {
        let lease = if now < self.expires.load(Ordering::Acquire) {
            self.allowance.load(Ordering::Acquire)
        } else {
            0
        };
        let left = lease + self.overdraft.load(Ordering::Acquire);
        let allowed = policy.override_ == Override::AllowAll
            || (policy.override_ == Override::None && left >= cost);
        Self::decision(policy, allowed, left)
    }

    fn peek_vacant(policy: &SyncPolicy, _now: u64, cost: u64) -> Decision {
        let allowed = policy.override_ == Override::AllowAll
            || (policy.override_ == Override::None && policy.fresh >= cost);
        Self::decision(policy, allowed, policy.fresh)
    }

    /// A synced key may be dropped only once the sync task has released it: it owes no
    /// report and holds no lease. The task drops released keys itself.
    fn reset_after_ns(&self, policy: &SyncPolicy, _now: u64) -> u64 {
        if self.is_released() {
            0
        } else {
            policy.interval_ns.max(1)
        }
    }

    /// Evictable only with nothing to report: no units admitted since the task last
    /// looked (beyond what its books hold), no report pending, and the books not in the
    /// task's hands. An unspent lease may go: it is only given back late.
    fn evictable(&self) -> bool {
        let Some(books) = self.books.try_lock() else {
            return false;
        };
        !books.pending
            && self.overdrawn.load(Ordering::Acquire) == 0
            && self.allowance.load(Ordering::Acquire) >= books.lease_base
            && self.overdraft.load(Ordering::Acquire) >= books.overdraft_base
    }

    /// Allowances are counts granted by the sync task: a policy change leaves them as
    /// they are.
    fn convert(&self, _now: u64, _from: &SyncPolicy, _to: &SyncPolicy) {}
}
