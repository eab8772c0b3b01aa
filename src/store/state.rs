//! Per-key state: what a store keeps for each key, and how it applies a policy.
//!
//! The word algorithms keep one state word in the lock-free table of
//! [`WordStore`](super::WordStore) and need no `State`. The sliding log keeps its ring of
//! timestamps behind a per-key mutex; a synced key keeps its lease and books.

use parking_lot::Mutex;

use crate::algorithm::{Log, LogPolicy, Policy};
use crate::decision::Decision;

/// The state a store keeps for one key, for the policy type `Policy`.
pub(crate) trait State: Send + Sync + Sized + 'static {
    /// The policy this state is decided by.
    type Policy: Policy;

    /// Whether a unit deny stays true until its retry instant unless an administrative
    /// change (reset, quota change, eviction) intervenes, so that it may be cached per
    /// thread. False where something else grants allowance (the background sync).
    const DENIES_ARE_STABLE: bool = true;

    /// The state of a key first seen under `policy`. May allocate (once per key).
    fn fresh(policy: &Self::Policy) -> Self;

    /// Decides a request of cost `1..=capacity` at `now`, recording it if admitted. An
    /// admission whose [`Decision::delay`] would exceed `max_delay` ns is not recorded and
    /// comes back as a deny with `retry_after` = the excess.
    fn check(&self, policy: &Self::Policy, now: u64, cost: u64, max_delay: u64) -> Decision;

    /// The decision a request of `cost` would get at `now`, consuming nothing; an
    /// admitting decision reports `remaining` and `reset_after` as the state stands. A
    /// cost of 0 reports the state.
    fn peek(&self, policy: &Self::Policy, now: u64, cost: u64) -> Decision;

    /// [`peek`](Self::peek) for a key that holds no state. Never allocates.
    fn peek_vacant(policy: &Self::Policy, now: u64, cost: u64) -> Decision;

    /// Nanoseconds until the state is back to untouched; 0 when dropping it changes no
    /// decision.
    fn reset_after_ns(&self, policy: &Self::Policy, now: u64) -> u64;

    /// Re-expresses the state, made under `from`, for `to`. Called with the key's shard
    /// write lock held, so no check runs on this key meanwhile.
    fn convert(&self, now: u64, from: &Self::Policy, to: &Self::Policy);

    /// Whether evicting the state to make room loses nothing but the state itself
    /// (called with the key's shard write lock held). A synced key with consumption not
    /// yet reported is not: dropping it would leave that consumption uncharged.
    fn evictable(&self) -> bool {
        true
    }

    /// Whether [`convert`](Self::convert) changes anything: a store whose states never
    /// convert leaves them alone when its default policy changes.
    const CONVERTS: bool = true;

    /// How many keys a store notes for its owner between two looks (0: it notes none;
    /// see [`take_note`](Self::take_note)).
    const NOTES: usize = 0;

    /// Whether the store must note this key for its owner, which has not been told of
    /// it since it last looked (the sync task: a key first seen, a cold key whose share
    /// ran out, a key quota set). The store asks after an insert, a denied check and a
    /// settlement, and keeps the key's hash for
    /// [`Store::take_notes`](super::Store::take_notes), so that an owner that keeps a
    /// work list learns what changed without visiting every key. It must answer true
    /// once per change, until the owner has looked.
    fn take_note(&self) -> bool {
        false
    }
}

/// The sliding log's per-key state: a ring of timestamps behind a mutex.
#[derive(Debug, Default)]
pub(crate) struct LogCell(Mutex<Log>);

impl LogCell {
    fn peek_log(log: &mut Log, policy: &LogPolicy, now: u64, cost: u64) -> Decision {
        let decision = policy.log.decide(log, now, cost, false);
        if decision.is_allowed() && cost > 0 {
            let state = policy.log.decide(log, now, 0, false);
            Decision::allow(state.limit(), state.remaining(), state.reset_after_ns())
        } else {
            decision
        }
    }
}

impl State for LogCell {
    type Policy = LogPolicy;

    fn fresh(policy: &LogPolicy) -> Self {
        LogCell(Mutex::new(Log::with_capacity(policy.capacity())))
    }

    fn check(&self, policy: &LogPolicy, now: u64, cost: u64, _max_delay: u64) -> Decision {
        // The sliding log never delays an admission.
        policy.log.decide(&mut self.0.lock(), now, cost, true)
    }

    fn peek(&self, policy: &LogPolicy, now: u64, cost: u64) -> Decision {
        Self::peek_log(&mut self.0.lock(), policy, now, cost)
    }

    fn peek_vacant(policy: &LogPolicy, now: u64, cost: u64) -> Decision {
        Self::peek_log(&mut Log::default(), policy, now, cost)
    }

    fn reset_after_ns(&self, policy: &LogPolicy, now: u64) -> u64 {
        policy.log.reset_after(&self.0.lock(), now)
    }

    fn convert(&self, _now: u64, from: &LogPolicy, to: &LogPolicy) {
        // Timestamps are absolute, so only the ring's size depends on the quota.
        if from.capacity() != to.capacity() {
            self.0.lock().resize(to.capacity());
        }
    }
}
