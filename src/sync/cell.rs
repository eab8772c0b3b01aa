//! A synced key's local state: a lease and an overdraft counted down by checks (one CAS,
//! no clock, no lock), and the books only the sync task reads. A **cold** key (see
//! [`Cold`]) admits from a local GCRA at this node's share instead, and costs Redis
//! nothing until it runs out.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::algorithm::{Divisor, Policy};
use crate::decision::Decision;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::store::state::State;

use super::books::Books;
use super::protocol::{Shape, SharedQuota};
use crate::algorithm::{Algorithm, Settle};
use parking_lot::Mutex;

/// Set in [`SyncCell::flags`] by a denied check: the key ran out.
pub(crate) const WANTED: u64 = 1;
/// Set in [`SyncCell::flags`] by a cold check that found the key's cold share spent:
/// the key turns hot at the next round.
pub(crate) const WANT_HOT: u64 = 2;
/// Set in [`SyncCell::flags`] for a key the sync task has not looked at yet: a cold one
/// it checks against the keys hot elsewhere, a hot one it adds to the keys it syncs.
pub(crate) const NEW: u64 = 4;
/// Set in [`SyncCell::flags`] when the key's quota changed on this node: its next round
/// carries the change, whether or not the key is in use here (cleared once a round is
/// answered).
pub(crate) const QUOTA: u64 = 8;
/// Set in [`SyncCell::flags`] by a charge ([`SyncCell::settle`]): what the next round
/// reports was consumed now, not over the time since the last round, so Redis charges
/// it at once rather than spreading it back (cleared by the round that carries it).
pub(crate) const CHARGED: u64 = 16;
/// Set in [`SyncCell::flags`] once the store noted the key for the sync task (see
/// [`State::take_note`]): cleared when the task looks at it.
pub(crate) const NOTED: u64 = 32;
/// The flags that make the store note a key for the sync task.
const NOTE_WORTHY: u64 = NEW | WANT_HOT | QUOTA;
/// [`SyncCell::cold_tat`] of a hot key: coordinated through Redis.
pub(crate) const HOT: u64 = u64::MAX;

/// The cold tier: a key no node has turned hot admits at this node's even share of the
/// quota, locally, with no Redis round trip (a GCRA of `t_ns` per token and `burst`
/// tokens at once). The nodes' shares add up to at most the quota, so keys nowhere near
/// their limit need no coordination at all. A key whose cold share runs out turns hot:
/// it is announced to the other nodes, which turn it hot too, and is synced from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cold {
    /// ns per token at this node's share of the rate.
    pub(crate) t_ns: u64,
    /// The GCRA tolerance, `(burst − 1)·t_ns`.
    pub(crate) tau_ns: u64,
    /// Until when (limiter clock, ns) this node may admit on its cold keys: it has read
    /// the keys hot elsewhere recently enough (see `node::cold`). After that a cold
    /// key may spend only what its share held then (its budget), and gets no refill.
    pub(crate) until: u64,
    /// Whether keys first seen start cold (else hot, under the fallback).
    pub(crate) new_keys: bool,
    /// `t_ns` (at least 1) as a multiply-and-shift divisor: a cold check's remaining
    /// tokens divide by it.
    per_t: Divisor,
}

impl Cold {
    /// The cold share of a quota of `capacity` at `ticks` µs per token among `nodes`
    /// nodes, vouched for until `until`; `None` when a node's share of the burst is
    /// under one token. A window counter's share is half a burst and half the rate, so
    /// that no window of the period admits more than its share.
    pub(crate) fn share(
        capacity: u64,
        ticks: u64,
        nodes: u64,
        windowed: bool,
        until: u64,
    ) -> Option<Self> {
        let nodes = nodes.max(1);
        let burst = capacity / (nodes * if windowed { 2 } else { 1 });
        let t_ns = Self::t_ns(ticks, nodes, windowed);
        (burst >= 1).then(|| Self::new(t_ns, burst, until))
    }

    /// A share of `burst` tokens (at least 1) at `t_ns` a token, vouched for until
    /// `until`, for new keys too.
    pub(crate) fn new(t_ns: u64, burst: u64, until: u64) -> Self {
        Self {
            t_ns,
            tau_ns: burst.max(1).saturating_sub(1).saturating_mul(t_ns),
            until,
            new_keys: true,
            per_t: Divisor::new(t_ns.max(1)),
        }
    }

    /// This share, with keys first seen starting cold (`true`) or hot.
    pub(crate) fn for_new_keys(self, new_keys: bool) -> Self {
        Self { new_keys, ..self }
    }

    /// The cold tier of a node that has not read the keys turned hot yet (it starts):
    /// new keys start cold, but nothing is admitted on them until it has.
    pub(crate) fn unvouched() -> Self {
        Self::new(u64::MAX, 1, 0)
    }

    /// The ns per token of a node's cold share among `nodes` nodes, at `ticks` µs per
    /// token of the whole rate (half the node's share of the rate for the window
    /// counters).
    pub(crate) fn t_ns(ticks: u64, nodes: u64, windowed: bool) -> u64 {
        ticks
            .saturating_mul(if windowed { 2_000 } else { 1_000 })
            .saturating_mul(nodes.max(1))
    }

    /// The tokens the share holds at once.
    pub(crate) fn burst(&self) -> u64 {
        self.tau_ns / self.t_ns.max(1) + 1
    }

    /// Whole tokens a cold key whose GCRA stands at `tat` has at `now`.
    #[inline]
    fn left(&self, tat: u64, now: u64) -> u64 {
        let room = self.tau_ns.saturating_add(self.t_ns);
        self.per_t.div(room.saturating_sub(tat.saturating_sub(now)))
    }
}

/// What checks do while Redis has been unreachable for longer than the staleness: as
/// usual, or as the fail modes [`FailMode::Open`](super::FailMode::Open) and
/// [`FailMode::Closed`](super::FailMode::Closed) say (the `Local` fail mode runs on the
/// books, with no outage state of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutageMode {
    /// Normal operation: spend the allowance.
    Normal,
    /// Admit everything (consumption is still counted and reported later).
    Open,
    /// Deny everything.
    Closed,
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
    pub(crate) outage: OutageMode,
    /// The cold tier's share, while this node may admit on cold keys; a key first seen
    /// while it is `None` starts hot.
    pub(crate) cold: Option<Cold>,
    /// The leaky bucket's pace on this node (ns per token: its even share of the rate);
    /// 0 for the other algorithms. Each admission is given the slot at which this node's
    /// queue reaches it, so the nodes' outflows add up to at most the rate.
    pub(crate) pace_ns: u64,
    /// µs of refill one token of this quota costs (see `protocol::Shape`).
    pub(crate) ticks: u64,
    /// How many nodes share the limit, as the last round told (1 until then).
    pub(crate) nodes: u64,
    /// The key's own quota as it travels with its rounds (the default's, version 0, for
    /// the limiter's policy).
    pub(crate) shared: SharedQuota,
}

impl SyncPolicy {
    pub(crate) fn new(quota: Quota, capacity: u64, fresh: u64, interval_ns: u64) -> Self {
        Self {
            quota,
            capacity,
            fresh,
            interval_ns,
            outage: OutageMode::Normal,
            cold: None,
            pace_ns: 0,
            ticks: 1,
            nodes: 1,
            shared: SharedQuota::default(),
        }
    }

    /// A key's own policy under this default: `quota` for a limiter of `algorithm`, as
    /// set at `version` (see [`SharedQuota`]).
    ///
    /// # Errors
    /// As [`Shape::with_capacity`], and [`ConfigError::ExceedsRedisPrecision`] for a
    /// quota whose conversion would not be exact in the round script.
    pub(crate) fn for_key(
        &self,
        algorithm: Algorithm,
        quota: Quota,
        version: u64,
    ) -> Result<Self, ConfigError> {
        let (shape, capacity) = Shape::with_capacity(algorithm, quota)?;
        let shared = SharedQuota::new(version, quota);
        if !shared.fits(shape) {
            return Err(ConfigError::ExceedsRedisPrecision(
                "a key's quota: period (µs) × burst must stay below 2^52 (token bucket), \
                 limit × period below 2^53 (windows)",
            ));
        }
        Ok(self.with_shared(quota, capacity, shape.ticks_per_token(), shared))
    }

    /// A key's mark under this default: back to the default quota at `version`, kept
    /// until Redis has it.
    pub(crate) fn back_to_default(&self, version: u64) -> Self {
        self.with_shared(
            self.quota,
            self.capacity,
            self.ticks,
            SharedQuota::default_at(version),
        )
    }

    fn with_shared(&self, quota: Quota, capacity: u64, ticks: u64, shared: SharedQuota) -> Self {
        Self {
            quota,
            capacity,
            ticks,
            shared,
            ..*self
        }
        .rebase(self)
    }

    /// Whether a key first seen under this policy starts cold: not one with a quota of
    /// its own (nor one just returned to the default), whose rounds carry its quota.
    fn starts_cold(&self) -> bool {
        self.shared.version == 0 && self.cold.is_some_and(|c| c.new_keys)
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

    /// A key's own policy keeps its quota and takes everything else from the default: the
    /// outage mode, the interval and the cold tier as they are, and the fresh overdraft
    /// and the leaky bucket's pace for its own quota among the default's node count.
    fn rebase(&self, default: &Self) -> Self {
        if self.shared.version == 0 {
            return *default;
        }
        let fresh = if default.fresh == 0 {
            0
        } else {
            self.capacity / default.nodes.max(1)
        };
        let pace_ns = if default.pace_ns == 0 {
            0
        } else {
            Cold::t_ns(self.ticks, default.nodes, false)
        };
        Self {
            quota: self.quota,
            capacity: self.capacity,
            ticks: self.ticks,
            shared: self.shared,
            fresh,
            pace_ns,
            ..*default
        }
    }
}

/// A synced key on this node: a cold key's GCRA inline, and (in a box of its own, `hot`)
/// the tokens leased from the global state, an overdraft beyond them (reconcile mode),
/// until when the lease may be spent, and the books the sync task keeps for the key.
///
/// A cold key's check touches only `cold_tat`: with a `u64` key a table entry is 24
/// bytes, so 10k cold keys' entries (240 KB) stay in a 512 KiB L2 beside the index, as a
/// plain limiter's 16-byte slots do. A hot key's check follows the box, a second line:
/// with the cold tier on, a key turns hot on its own demand, so hot keys are few and
/// their boxes in cache; with it off, every key is hot and pays that line (about 20%
/// more at 10k keys checked uniformly: `sync_check/sync_on_hot_keys`). With everything
/// inline an entry was 64 bytes, one cache line per key, and 10k keys' lines overflowed
/// L2.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct SyncCell {
    /// A cold key's GCRA (limiter clock, ns); [`HOT`] once the key is synced.
    pub(crate) cold_tat: AtomicU64,
    /// What a hot key's checks and the sync task use.
    pub(crate) hot: Box<Hot>,
}

/// The words of a [`SyncCell`] that only a hot key's check touches, and the books.
#[derive(Debug, Default)]
pub(crate) struct Hot {
    /// The limiter-clock instant (ns) after which the lease is void: the end of Redis's
    /// window, for a window counter's lease in lease mode; never otherwise.
    pub(crate) expires: AtomicU64,
    /// Leased tokens: already reserved in the global state.
    pub(crate) allowance: AtomicU64,
    /// Tokens that may be admitted beyond the lease (reconcile mode, and the local
    /// fallback): reported in the next round's floor.
    pub(crate) overdraft: AtomicU64,
    /// The [`WANTED`] flag (the time it was set is [`Aside::ran_out_at`]).
    pub(crate) flags: AtomicU64,
    /// The leaky bucket: when (limiter clock, ns) this node's queue for the key is empty.
    pub(crate) drain_at: AtomicU64,
    /// What checks seldom touch.
    pub(crate) aside: Aside,
}

/// The part of a [`SyncCell`] a check touches only when it denies, or under an outage:
/// the sync task's books and two counters.
#[derive(Debug, Default)]
pub(crate) struct Aside {
    /// When (limiter clock, ns) [`WANTED`] or [`WANT_HOT`] was set: how long the key's
    /// allowance lasted tells its demand.
    pub(crate) ran_out_at: AtomicU64,
    /// Units consumed with no allowance at all: admitted under [`OutageMode::Open`], or
    /// charged ([`SyncCell::settle`]) beyond the lease and the overdraft. Reported in the
    /// next round's floor.
    pub(crate) overdrawn: AtomicU64,
    /// Units refunded ([`SyncCell::settle`]) since the task last looked: the next round's
    /// floor is lowered by as many (at most what the node reported as spent), and Redis
    /// gives them back to the global state, never beyond full.
    pub(crate) refunded: AtomicU64,
    /// The sync task's books: only the task takes this lock.
    pub(crate) books: Mutex<Books>,
}

impl Aside {
    fn with_books(books: Books) -> Self {
        Self {
            books: Mutex::new(books),
            ..Self::default()
        }
    }
}

impl Default for SyncCell {
    /// A hot key with nothing leased.
    fn default() -> Self {
        Self {
            cold_tat: AtomicU64::new(HOT),
            hot: Box::default(),
        }
    }
}

impl SyncCell {
    /// Whether the task released the key (its last round returned everything and
    /// reported everything) and no check has touched it since.
    pub(crate) fn is_released(&self) -> bool {
        self.cold_tat.load(Ordering::Acquire) == HOT
            && self.hot.allowance.load(Ordering::Acquire) == 0
            && self.hot.overdraft.load(Ordering::Acquire) == 0
            && self.hot.aside.overdrawn.load(Ordering::Acquire) == 0
            && self.hot.aside.refunded.load(Ordering::Acquire) == 0
            && self.hot.flags.load(Ordering::Acquire) & (WANTED | QUOTA) == 0
            && self.hot.aside.books.try_lock().is_some_and(|b| b.released)
    }

    #[inline]
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
        if self.hot.flags.load(Ordering::Relaxed) & WANTED == 0 {
            self.hot.aside.ran_out_at.store(now, Ordering::Relaxed);
            self.hot.flags.fetch_or(WANTED, Ordering::Release);
        }
    }

    /// Marks a cold key as wanting to turn hot, at `now` (once).
    pub(crate) fn want_hot(&self, now: u64) {
        if self.hot.flags.load(Ordering::Relaxed) & WANT_HOT == 0 {
            self.hot.aside.ran_out_at.store(now, Ordering::Relaxed);
            self.hot.flags.fetch_or(WANT_HOT, Ordering::Release);
        }
    }

    /// A cold key's check: the local GCRA at this node's share, by CAS on `cold_tat`.
    /// `None` if the key turned hot meanwhile (the check then spends its lease). Once
    /// this node may no longer vouch for its share (it has not read the keys turned hot
    /// for too long: the share may be another node's by now), the key spends only what
    /// its share held then, with no refill: the fallback's one-time budget.
    #[inline(always)]
    fn check_cold(
        &self,
        policy: &SyncPolicy,
        mut tat: u64,
        now: u64,
        cost: u64,
        max_delay: u64,
    ) -> Option<Decision> {
        let Some(cold) = policy.cold.filter(|c| c.until > 0) else {
            return Some(Self::decision(policy, false, 0));
        };
        let vouched = now < cold.until;
        let at = now.min(cold.until);
        loop {
            let next = tat.max(at).saturating_add(cost.saturating_mul(cold.t_ns));
            if next - at > cold.tau_ns.saturating_add(cold.t_ns) {
                if vouched {
                    self.want_hot(now);
                }
                return Some(Self::decision(policy, false, cold.left(tat, at)));
            }
            // The leaky bucket: the cold GCRA is this node's queue at its share, and an
            // admission waits until the queue is empty.
            let delay = if policy.pace_ns > 0 {
                tat.saturating_sub(now)
            } else {
                0
            };
            if delay > max_delay {
                return Some(Self::late(policy, cold.left(tat, at), delay - max_delay));
            }
            match self.cold_tat.compare_exchange_weak(
                tat,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(
                        Decision::allow(
                            policy.capacity,
                            cold.left(next, at),
                            next.saturating_sub(now),
                        )
                        .with_delay(delay),
                    );
                }
                Err(HOT) => return None,
                Err(actual) => tat = actual,
            }
        }
    }

    /// A leaky-bucket admission refused because its slot is `excess` ns later than the
    /// caller would wait: a deny that consumed nothing.
    fn late(policy: &SyncPolicy, remaining: u64, excess: u64) -> Decision {
        Decision::deny(policy.capacity, remaining, excess, excess)
    }

    /// The leaky bucket: joins this node's queue for `cost` tokens at `now`, returning
    /// the wait until its slot; `Err(wait)` (and nothing joined) when the wait would be
    /// longer than `max_delay`.
    fn join_queue(&self, pace_ns: u64, now: u64, cost: u64, max_delay: u64) -> Result<u64, u64> {
        let mut wait = 0;
        self.hot
            .drain_at
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |empty_at| {
                wait = empty_at.saturating_sub(now);
                (wait <= max_delay).then(|| {
                    empty_at
                        .max(now)
                        .saturating_add(cost.saturating_mul(pace_ns))
                })
            })
            .map(|_| wait)
            .map_err(|_| wait)
    }

    /// Leaves the queue joined by an admission that was then denied.
    fn leave_queue(&self, pace_ns: u64, cost: u64) {
        let _ = self
            .hot
            .drain_at
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |empty_at| {
                Some(empty_at.saturating_sub(cost.saturating_mul(pace_ns)))
            });
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

impl SyncCell {
    /// Spends `cost` of the lease, else of the overdraft, by one CAS; a deny writes only
    /// the [`WANTED`] flag, once per round.
    #[inline]
    fn spend_lease(&self, policy: &SyncPolicy, now: u64, cost: u64) -> Decision {
        if now < self.hot.expires.load(Ordering::Acquire) {
            if let Some(left) = Self::spend(&self.hot.allowance, cost) {
                return Self::decision(
                    policy,
                    true,
                    left + self.hot.overdraft.load(Ordering::Relaxed),
                );
            }
        }
        if let Some(left) = Self::spend(&self.hot.overdraft, cost) {
            return Self::decision(policy, true, left);
        }
        self.want(now);
        Self::decision(policy, false, 0)
    }
}

impl SyncCell {
    /// Settles a cost known after the fact at `now` (see
    /// [`SyncedLimiter::charge`](super::SyncedLimiter::charge)): no I/O, the next round
    /// carries it.
    ///
    /// A cold key settles on its share's GCRA (a charge moves it `n` tokens on, however
    /// far, and a key left in debt turns hot, its first round reporting the debt as in
    /// use; a refund moves it `n` tokens back, not before now). A hot key's charge
    /// spends its lease, then its overdraft, and counts the rest as
    /// [`overdrawn`](Aside::overdrawn): the next floor reports all of it, and the
    /// global state goes into debt, so that no lease is granted until it is repaid. A
    /// hot key's refund is counted in [`refunded`](Aside::refunded), for the next floor.
    pub(crate) fn settle(&self, policy: &SyncPolicy, now: u64, op: Settle) {
        self.settle_then_peek(policy, now, op);
    }

    /// [`settle`](Self::settle), returning what a unit request would get right after.
    pub(crate) fn settle_then_peek(&self, policy: &SyncPolicy, now: u64, op: Settle) -> Decision {
        let mut tat = self.cold_tat.load(Ordering::Acquire);
        while tat != HOT {
            let Some(cold) = policy.cold.filter(|c| c.until > 0) else {
                // No share to settle on: a charge turns the key hot and is reported
                // with its first round; a refund has nothing this node admitted here.
                if let Settle::Charge(n) = op {
                    self.hot.aside.overdrawn.fetch_add(n, Ordering::AcqRel);
                    self.want_hot(now);
                }
                return self.peek(policy, now, 1);
            };
            let at = now.min(cold.until);
            // The decision a unit request gets at the key's share standing at `tat`, as
            // `peek` gives it.
            let after = |tat: u64| {
                if policy.outage != OutageMode::Normal {
                    return self.peek(policy, now, 1);
                }
                let left = cold.left(tat, at);
                Self::decision(policy, left >= 1, left)
            };
            let next = match op {
                // (Below `HOT`, which marks a key synced.)
                Settle::Charge(n) => tat
                    .max(at)
                    .saturating_add(n.saturating_mul(cold.t_ns))
                    .min(HOT - 1),
                Settle::Refund(_) if tat <= at => return after(tat),
                Settle::Refund(n) => tat.saturating_sub(n.saturating_mul(cold.t_ns)).max(at),
            };
            match self.cold_tat.compare_exchange_weak(
                tat,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let in_debt = next - at > cold.tau_ns.saturating_add(cold.t_ns);
                    if matches!(op, Settle::Charge(_)) && in_debt && now < cold.until {
                        self.want_hot(now);
                    }
                    return after(next);
                }
                Err(actual) => tat = actual,
            }
        }
        match op {
            Settle::Charge(n) => {
                let mut rest = n;
                let lease_valid = now < self.hot.expires.load(Ordering::Acquire);
                for (pool, valid) in [
                    (&self.hot.allowance, lease_valid),
                    (&self.hot.overdraft, true),
                ] {
                    if !valid || rest == 0 {
                        continue;
                    }
                    let mut took = 0;
                    let _ = pool.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                        took = left.min(rest);
                        Some(left - took)
                    });
                    rest -= took;
                }
                if rest > 0 {
                    self.hot.aside.overdrawn.fetch_add(rest, Ordering::AcqRel);
                }
                self.hot.flags.fetch_or(CHARGED, Ordering::AcqRel);
            }
            Settle::Refund(n) => {
                self.hot.aside.refunded.fetch_add(n, Ordering::AcqRel);
            }
        }
        self.peek(policy, now, 1)
    }
}

impl SyncCell {
    /// Gives back `cost` units a check of this key admitted at `now` for a request that
    /// another quota of the limiter then denied (see [`crate::store::check_all`]). A cold
    /// key's share takes them back at once; a hot key's are [`refunded`](Aside::refunded)
    /// with its next round (this node's lease does not grow before Redis has them back),
    /// and a leaky bucket's admission leaves this node's queue.
    pub(crate) fn give_back(&self, policy: &SyncPolicy, now: u64, cost: u64) {
        if self.cold_tat.load(Ordering::Acquire) == HOT && policy.pace_ns > 0 {
            self.leave_queue(policy.pace_ns, cost);
        }
        self.settle(policy, now, Settle::Refund(cost));
    }
}

impl State for SyncCell {
    type Policy = SyncPolicy;

    /// The sync task grants allowance at any moment, so a deny is not cached.
    const DENIES_ARE_STABLE: bool = false;

    /// A policy change leaves allowances as they are.
    const CONVERTS: bool = false;

    /// The keys the sync task learns of each round without visiting every key: keys
    /// first seen, cold keys whose share ran out, keys given a quota.
    const NOTES: usize = 1 << 16;

    fn take_note(&self) -> bool {
        let flags = self.hot.flags.load(Ordering::Acquire);
        flags & NOTE_WORTHY != 0
            && flags & NOTED == 0
            && self.hot.flags.fetch_or(NOTED, Ordering::AcqRel) & NOTED == 0
    }

    /// A key first seen on this node may overdraft `fresh` (its share of a fresh key's
    /// capacity in reconcile mode, nothing in lease mode) until its first round.
    fn fresh(policy: &SyncPolicy) -> Self {
        if policy.starts_cold() {
            return Self {
                cold_tat: AtomicU64::new(0),
                hot: Box::new(Hot {
                    expires: AtomicU64::new(u64::MAX),
                    flags: AtomicU64::new(NEW),
                    aside: Aside::with_books(Books {
                        released: true,
                        ..Books::fresh(0)
                    }),
                    ..Hot::default()
                }),
            };
        }
        Self {
            cold_tat: AtomicU64::new(HOT),
            hot: Box::new(Hot {
                overdraft: AtomicU64::new(policy.fresh),
                expires: AtomicU64::new(u64::MAX),
                flags: AtomicU64::new(NEW),
                aside: Aside::with_books(Books::fresh(policy.fresh)),
                ..Hot::default()
            }),
        }
    }

    /// Spends `cost` of the lease, else of the overdraft, by one CAS. A deny writes only
    /// the [`WANTED`] flag, once per round.
    ///
    /// The leaky bucket first joins this node's queue (refusing, consuming nothing, a
    /// slot more than `max_delay` away), and leaves it again if the key has nothing to
    /// spend.
    #[inline(always)]
    fn check(&self, policy: &SyncPolicy, now: u64, cost: u64, max_delay: u64) -> Decision {
        match policy.outage {
            OutageMode::Open => {
                self.hot.aside.overdrawn.fetch_add(cost, Ordering::Relaxed);
                return Self::decision(policy, true, 0);
            }
            OutageMode::Closed => return Self::decision(policy, false, 0),
            OutageMode::Normal => {}
        }
        let tat = self.cold_tat.load(Ordering::Acquire);
        if tat != HOT {
            if let Some(decision) = self.check_cold(policy, tat, now, cost, max_delay) {
                return decision;
            }
        }
        if policy.pace_ns == 0 {
            return self.spend_lease(policy, now, cost);
        }
        let delay = match self.join_queue(policy.pace_ns, now, cost, max_delay) {
            Ok(delay) => delay,
            Err(wait) => return Self::late(policy, 0, wait - max_delay),
        };
        let decision = self.spend_lease(policy, now, cost);
        if decision.is_allowed() {
            decision.with_delay(delay)
        } else {
            self.leave_queue(policy.pace_ns, cost);
            decision
        }
    }

    fn peek(&self, policy: &SyncPolicy, now: u64, cost: u64) -> Decision {
        let tat = self.cold_tat.load(Ordering::Acquire);
        if tat != HOT && policy.outage == OutageMode::Normal {
            let left = policy
                .cold
                .filter(|c| c.until > 0)
                .map_or(0, |c| c.left(tat, now.min(c.until)));
            return Self::decision(policy, left >= cost, left);
        }
        let lease = if now < self.hot.expires.load(Ordering::Acquire) {
            self.hot.allowance.load(Ordering::Acquire)
        } else {
            0
        };
        let left = lease + self.hot.overdraft.load(Ordering::Acquire);
        let allowed = policy.outage == OutageMode::Open
            || (policy.outage == OutageMode::Normal && left >= cost);
        Self::decision(policy, allowed, left)
    }

    fn peek_vacant(policy: &SyncPolicy, now: u64, cost: u64) -> Decision {
        let left = match policy.cold {
            Some(cold) if policy.starts_cold() && now < cold.until => cold.left(0, now),
            Some(_) if policy.starts_cold() => 0,
            _ => policy.fresh,
        };
        let allowed = policy.outage == OutageMode::Open
            || (policy.outage == OutageMode::Normal && left >= cost);
        Self::decision(policy, allowed, left)
    }

    /// A synced key may be dropped only once the sync task has released it: it owes no
    /// report and holds no lease. The task drops released keys itself.
    fn reset_after_ns(&self, policy: &SyncPolicy, now: u64) -> u64 {
        let tat = self.cold_tat.load(Ordering::Acquire);
        if tat != HOT {
            // A cold key reports nothing: it is untouched once its share is whole again
            // (one whose share ran out waits for the round that turns it hot).
            if self.hot.flags.load(Ordering::Acquire) & WANT_HOT != 0 {
                return policy.interval_ns.max(1);
            }
            return tat.saturating_sub(now);
        }
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
        // A cold key owes Redis nothing: like a local limiter's key, evicting it loses at
        // most its share's burst.
        if self.cold_tat.load(Ordering::Acquire) != HOT {
            return true;
        }
        let Some(books) = self.hot.aside.books.try_lock() else {
            return false;
        };
        !books.pending
            && self.hot.aside.overdrawn.load(Ordering::Acquire) == 0
            && self.hot.aside.refunded.load(Ordering::Acquire) == 0
            && self.hot.allowance.load(Ordering::Acquire) >= books.lease_base
            && self.hot.overdraft.load(Ordering::Acquire) >= books.overdraft_base
    }

    /// Allowances are counts granted by the sync task: a policy change leaves them as
    /// they are.
    fn convert(&self, _now: u64, _from: &SyncPolicy, _to: &SyncPolicy) {}
}

#[cfg(test)]
impl SyncCell {
    /// `count` unit checks at `now`, as many single checks would decide them, in one
    /// go for a hot key (the simulation offers thousands at an instant): its lease
    /// first, then its overdraft; a shortfall marks the key wanted. Returns how many
    /// were admitted.
    pub(crate) fn check_many(&self, policy: &SyncPolicy, now: u64, count: u64) -> u64 {
        let check = || self.check(policy, now, 1, u64::MAX).is_allowed();
        if self.cold_tat.load(Ordering::Acquire) != HOT {
            // At one instant, a cold key's first deny is followed by denies only.
            return (0..count).take_while(|_| check()).count() as u64;
        }
        if count <= 4 || policy.outage != OutageMode::Normal || policy.pace_ns > 0 {
            return (0..count).filter(|_| check()).count() as u64;
        }
        let lease_valid = now < self.hot.expires.load(Ordering::Acquire);
        let mut admitted = 0;
        for (pool, valid) in [
            (&self.hot.allowance, lease_valid),
            (&self.hot.overdraft, true),
        ] {
            if !valid {
                continue;
            }
            let mut took = 0;
            let _ = pool.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                took = left.min(count - admitted);
                Some(left - took)
            });
            admitted += took;
        }
        if admitted < count {
            self.want(now);
        }
        admitted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::books::Books;
    use crate::sync::key;

    const SECOND: u64 = 1_000_000_000;

    /// 100/s burst 100 shared by `nodes`, vouched for 10 s.
    fn policy(nodes: u64, windowed: bool) -> SyncPolicy {
        let mut policy = SyncPolicy::new(Quota::per_second(100).unwrap(), 100, 0, SECOND / 20);
        policy.cold = Cold::share(100, 10_000, nodes, windowed, 10 * SECOND);
        policy
    }

    fn admitted(cell: &SyncCell, policy: &SyncPolicy, now: u64, tries: u64) -> u64 {
        (0..tries)
            .filter(|_| cell.check(policy, now, 1, 0).is_allowed())
            .count() as u64
    }

    /// A cold share's remaining tokens, divided by multiply and shift, are the plain
    /// quotient, at the smallest and largest ns per token and bursts.
    #[test]
    fn a_cold_share_counts_its_tokens_by_plain_division() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for t_ns in [
            1,
            3,
            1_000,
            10_000_000,
            (1 << 40) + 7,
            u64::MAX / 3,
            u64::MAX,
        ] {
            for burst in [1, 2, 100_000, u64::MAX] {
                let cold = Cold::new(t_ns, burst, u64::MAX);
                for _ in 0..1_000 {
                    let (tat, now) = (next() >> (next() % 64), next() >> (next() % 64));
                    let room = cold.tau_ns.saturating_add(cold.t_ns);
                    let expected = room.saturating_sub(tat.saturating_sub(now)) / t_ns;
                    assert_eq!(cold.left(tat, now), expected, "{t_ns} {burst} {tat} {now}");
                }
            }
        }
    }

    /// A `u64` key and the word a cold key's check touches fill a 24-byte table entry,
    /// key first, with the hot key's words and the books out of line: 10k cold keys'
    /// entries take 240 KB, where one 64-byte line per key took 640 KB (more than this
    /// machine's 512 KiB L2 per core).
    #[test]
    fn a_cold_check_touches_one_entry_of_24_bytes() {
        use crate::store::table::Entry;
        assert_eq!(std::mem::size_of::<Entry<u64, SyncCell>>(), 24);
        let entry = Entry {
            key: 0_u64,
            state: SyncCell::default(),
        };
        let base = std::ptr::from_ref(&entry) as usize;
        let cold_tat = std::ptr::from_ref(&entry.state.cold_tat) as usize - base;
        assert_eq!(cold_tat, 8, "the cold GCRA right after the key");
    }

    /// A cold key admits its node's share of the burst at once, then its share of the
    /// rate; the first deny asks to turn hot.
    #[test]
    fn a_cold_key_admits_its_share_then_asks_to_turn_hot() {
        for nodes in [1, 3, 16, 100] {
            let policy = policy(nodes, false);
            let cell = SyncCell::fresh(&policy);
            assert!(key::is_cold(&cell));
            let now = SECOND;
            assert_eq!(admitted(&cell, &policy, now, 1_000), 100 / nodes, "{nodes}");
            assert_ne!(cell.hot.flags.load(Ordering::Acquire) & WANT_HOT, 0);
            // A second later: its share of a second's refill, no more.
            assert_eq!(
                admitted(&cell, &policy, now + SECOND, 1_000),
                100 / nodes,
                "{nodes}"
            );
        }
        // Under one token of burst per node there is no cold share.
        assert_eq!(Cold::share(100, 10_000, 101, false, SECOND), None);
        assert_eq!(
            Cold::share(1, 1_000_000, 1, false, SECOND).map(|c| c.tau_ns),
            Some(0)
        );
    }

    /// The sliding window's share admits at most the node's share of the limit in any
    /// window: half at once, half over the period.
    #[test]
    fn a_sliding_windows_cold_share_never_exceeds_its_share_of_a_window() {
        let nodes = 4;
        let policy = policy(nodes, true);
        let cell = SyncCell::fresh(&policy);
        let mut admitted_at = Vec::new();
        let mut now = SECOND;
        while now < 5 * SECOND {
            if cell.check(&policy, now, 1, 0).is_allowed() {
                admitted_at.push(now);
            }
            now += SECOND / 1_000;
        }
        for (i, &at) in admitted_at.iter().enumerate() {
            let in_window = admitted_at[i..]
                .iter()
                .take_while(|&&t| t < at + SECOND)
                .count() as u64;
            assert!(in_window <= 100 / nodes, "{in_window} at {at}");
        }
    }

    /// A node that has not read the keys turned hot for its validity spends on a cold key
    /// only what its share held then (its budget), with no refill; a node that never read
    /// them admits nothing on cold keys. A key first seen after the lapse starts hot.
    #[test]
    fn a_lapsed_cold_share_is_a_one_time_budget() {
        let policy = policy(2, false);
        let cell = SyncCell::fresh(&policy);
        assert_eq!(admitted(&cell, &policy, SECOND, 10), 10);
        // At the lapse (10 s) the share held its whole burst (50) again: that, once.
        assert_eq!(admitted(&cell, &policy, 11 * SECOND, 1_000), 50);
        assert_eq!(admitted(&cell, &policy, 60 * SECOND, 1_000), 0);
        assert_eq!(cell.hot.flags.load(Ordering::Acquire) & WANT_HOT, 0);
        let lapsed = SyncPolicy {
            cold: policy.cold.map(|c| c.for_new_keys(false)),
            ..policy
        };
        assert!(!key::is_cold(&SyncCell::fresh(&lapsed)));
        let unvouched = SyncPolicy {
            cold: Some(Cold::unvouched()),
            ..policy
        };
        let cell = SyncCell::fresh(&unvouched);
        assert!(key::is_cold(&cell));
        assert_eq!(admitted(&cell, &unvouched, SECOND, 10), 0);
        assert!(!SyncCell::peek_vacant(&unvouched, SECOND, 1).is_allowed());
    }

    /// Turning hot reports, as admitted, what the cold share still had in use, rounded
    /// up; a check racing with it spends the lease instead, so nothing goes uncounted.
    #[test]
    fn turning_hot_reports_what_the_cold_share_has_in_use() {
        let policy = policy(4, false);
        let cold = policy.cold.unwrap();
        let cell = SyncCell::fresh(&policy);
        assert_eq!(admitted(&cell, &policy, SECOND, 10), 10);
        let mut books = Books::default();
        // 10 tokens at 40 ms each, 15 ms later: 9.625 in use, reported as 10.
        assert!(key::turn_hot(
            &cell,
            &mut books,
            cold.t_ns,
            SECOND + 15_000_000
        ));
        assert_eq!(books.spent, 10);
        assert!(!key::turn_hot(&cell, &mut books, cold.t_ns, SECOND));
        assert!(!key::is_cold(&cell));
        assert_ne!(cell.hot.flags.load(Ordering::Acquire) & WANTED, 0);
        // Hot with nothing leased: denied until a round grants a lease.
        assert!(!cell.check(&policy, SECOND, 1, 0).is_allowed());
        cell.hot.allowance.store(1, Ordering::Release);
        assert!(cell.check(&policy, SECOND, 1, 0).is_allowed());
    }

    /// Concurrent checks on a cold key admit exactly the share's burst between them.
    #[test]
    fn concurrent_cold_checks_admit_exactly_the_burst() {
        let policy = policy(1, false);
        let cell = SyncCell::fresh(&policy);
        let total: u64 = std::thread::scope(|s| {
            let workers: Vec<_> = (0..4)
                .map(|_| s.spawn(|| admitted(&cell, &policy, SECOND, 1_000)))
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(total, 100);
    }

    /// The leaky bucket, hot: admissions leave this node's queue one pace apart (its
    /// share of the rate); one whose slot is further than the caller waits is refused and
    /// consumes nothing, and one the lease cannot cover leaves the queue as it was.
    #[test]
    fn a_hot_leaky_bucket_paces_admissions_at_the_nodes_share() {
        // 100/s among 4 nodes: a token every 40 ms on this node.
        let mut policy = SyncPolicy::new(Quota::per_second(100).unwrap(), 100, 0, SECOND / 20);
        policy.pace_ns = Cold::t_ns(10_000, 4, false);
        assert_eq!(policy.pace_ns, 40_000_000);
        let cell = SyncCell::default();
        cell.hot.expires.store(u64::MAX, Ordering::Release);
        cell.hot.allowance.store(3, Ordering::Release);
        let now = SECOND;
        let delays: Vec<u64> = (0..2)
            .map(|_| cell.check(&policy, now, 1, u64::MAX).delay_ns())
            .collect();
        assert_eq!(delays, [0, 40_000_000]);
        // The next slot is 80 ms away: refused by a caller who waits 50 ms at most, by
        // the 30 ms it is short, and nothing is spent.
        let refused = cell.check(&policy, now, 1, 50_000_000);
        assert!(!refused.is_allowed());
        assert_eq!(refused.retry_after_ns(), 30_000_000);
        assert_eq!(cell.hot.allowance.load(Ordering::Acquire), 1);
        assert_eq!(cell.hot.drain_at.load(Ordering::Acquire), now + 80_000_000);
        // A cost of 2 the lease cannot cover is denied and leaves the queue as it was.
        assert!(!cell.check(&policy, now, 2, u64::MAX).is_allowed());
        assert_eq!(cell.hot.drain_at.load(Ordering::Acquire), now + 80_000_000);
        assert_eq!(cell.check(&policy, now, 1, u64::MAX).delay_ns(), 80_000_000);
        // Later the queue has drained: no wait.
        cell.hot.allowance.store(1, Ordering::Release);
        assert_eq!(cell.check(&policy, 2 * SECOND, 1, u64::MAX).delay_ns(), 0);
    }

    /// The leaky bucket, cold: the cold share's GCRA is this node's queue, so each
    /// admission waits for its slot, one share's pace apart after the share's burst.
    #[test]
    fn a_cold_leaky_bucket_waits_for_its_slot() {
        let mut policy = policy(4, false);
        policy.pace_ns = Cold::t_ns(10_000, 4, false);
        let cell = SyncCell::fresh(&policy);
        let now = SECOND;
        let delays: Vec<u64> = (0..25)
            .map(|_| cell.check(&policy, now, 1, u64::MAX))
            .filter(Decision::is_allowed)
            .map(|d| d.delay_ns())
            .collect();
        // The share's burst (25) at once: the k-th waits k·40 ms.
        assert_eq!(delays.len(), 25);
        assert!(
            delays.windows(2).all(|w| w[1] == w[0] + 40_000_000),
            "{delays:?}"
        );
        assert_eq!(delays[24], 24 * 40_000_000);
        assert!(!cell.check(&policy, now, 1, u64::MAX).is_allowed());
    }

    /// A key's own policy keeps its quota and follows the default for the rest: the
    /// outage mode and the cold tier as they are, the fresh overdraft and the leaky
    /// bucket's pace for its own quota; and its keys start hot.
    #[test]
    fn a_keys_own_policy_follows_the_default() {
        let mut default = policy(4, false);
        default.nodes = 4;
        default.fresh = 25;
        default.pace_ns = Cold::t_ns(10_000, 4, false);
        let ten = Quota::per_second(10).unwrap();
        let shared = SharedQuota::new(7, ten);
        let own = default.for_key(Algorithm::TokenBucket, ten, 7).unwrap();
        assert_eq!((own.quota, own.capacity, own.shared), (ten, 10, shared));
        assert_eq!((own.fresh, own.pace_ns), (10 / 4, 400_000_000));
        assert!(!SyncCell::fresh(&own).hot.aside.books.lock().released);
        assert!(!key::is_cold(&SyncCell::fresh(&own)));
        assert!(key::is_cold(&SyncCell::fresh(&default)));
        let closed = SyncPolicy {
            outage: OutageMode::Closed,
            ..default
        };
        let rebased = own.rebase(&closed);
        assert_eq!(rebased.outage, OutageMode::Closed);
        assert_eq!((rebased.quota, rebased.shared), (ten, shared));
        // The default's own policy is the default.
        assert_eq!(default.rebase(&closed), closed);
    }
}
