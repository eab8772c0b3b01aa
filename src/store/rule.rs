//! What a [`WordStore`](super::word::WordStore) runs on a key's state word: one quota's
//! policy ([`WordPolicy`], a `u64` state), or two quotas decided together ([`PairPolicy`],
//! two states in one 16-byte word that a check changes with one compare-and-swap).
//!
//! A pair decides a request as a chain of two single-quota stores does (see
//! [`compound`](super::compound)), all or nothing, but against both states at one
//! instant: an admission writes both, a deny writes neither, so it needs no refund, and
//! the key's two states sit in one slot, read by one probe.

use super::epoch_table::{Atom, AtomicPair, STATE_MAX, Two};
use super::{Sweep, fits};
use crate::algorithm::{BucketPair, Outcome, Policy, Settle, UNTOUCHED, WordPolicy};
use crate::decision::Decision;
use crate::error::InsufficientCapacity;

#[cfg(not(tollgate_loom))]
use std::sync::atomic::AtomicU64;

#[cfg(tollgate_loom)]
use loom::sync::atomic::AtomicU64;

/// What a write does to a key's state word.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// A check of `cost`; an admission delayed more than `max_delay` ns is refused, as a
    /// deny whose `retry_after` is the excess.
    Check { cost: u64, max_delay: u64 },
    /// A charge or refund after the fact: always written; the decision is what a unit
    /// request would get right after it.
    Settle(Settle),
}

impl Op {
    /// A check's cost; `None` for a settlement.
    #[inline(always)]
    pub(crate) fn check_cost(self) -> Option<u64> {
        match self {
            Op::Check { cost, .. } => Some(cost),
            Op::Settle(_) => None,
        }
    }
}

/// A sweep's verdict on a live key ([`Rule::judge`]).
pub(crate) struct Verdict {
    /// ns from the sweep's `since` until the key is untouched for good: 0 when it can go.
    pub(crate) wait: u64,
    /// The soonest instant a rebuild's sweep could drop the key if it stays (as
    /// [`Rule::droppable_from`] bounds it), when `wait > 0`.
    pub(crate) droppable_at: u64,
}

/// The state of a key under a rule.
pub(crate) type StateOf<R> = <<R as Rule>::Atom as Atom>::Value;

/// The policies a word store holds a key to, over the state word they share.
pub(crate) trait Rule: Copy + PartialEq + Send + Sync + std::fmt::Debug + 'static {
    /// The slot's word.
    type Atom: Atom;
    /// The state of a key never seen (or dropped): full under every quota.
    const UNTOUCHED: StateOf<Self>;

    /// What `op` makes of `state` at `now`: an admission's (or settlement's) new state
    /// and decision, or a deny, which writes nothing. Inlined with a constant `op` on the
    /// check path.
    fn outcome(&self, op: Op, state: StateOf<Self>, now: u64) -> Outcome<StateOf<Self>>;
    /// `Err` for a cost one of the quotas can never admit (the first such, in order).
    fn fits(&self, cost: u64) -> Result<(), InsufficientCapacity>;
    /// The largest cost every quota can admit.
    fn capacity(&self) -> u64;
    /// The decision a request of `cost` would get at `now`, consuming nothing.
    fn peek(&self, state: StateOf<Self>, now: u64, cost: u64) -> Decision;
    /// Whether a sweep may drop a key of `state`: untouched under every quota.
    fn judge(&self, state: StateOf<Self>, now: u64, sweep: &Sweep) -> Verdict;
    /// The soonest instant (clock ns) at which a rebuild's sweep could drop a key whose
    /// state is `state` at `now`: 0 if it is untouched already, else the instant `u` from
    /// which it is untouched plus its quota's period (for a pair, the later of its
    /// quotas'). A rebuild's sweep at `t` drops only keys untouched since an instant at
    /// most `t − period` ([`Sweep`]), and a key's `u` only moves later as checks and
    /// charges write it, so the bound holds until the key's quota changes (which resets
    /// it). A refund can move `u` back to its own instant: the key is then kept until a
    /// sweep runs for another reason, which changes no decision (a kept key is exact)
    /// and costs only its slot meanwhile.
    fn droppable_from(&self, state: StateOf<Self>, now: u64) -> u64;
    /// What evicting a key of `state` loses: units consumed, then ns to reset.
    fn eviction_cost(&self, state: StateOf<Self>, now: u64) -> (u64, u64);
    /// The wait a refused new key is told when no better one is known.
    fn fallback_retry_ns(&self) -> u64;
    /// This rule's state for a key whose state was `state` under `from`.
    fn convert(&self, state: StateOf<Self>, now: u64, from: &Self) -> StateOf<Self>;
    /// The limiter's own quota's policy (the one key quotas and quota changes replace).
    fn first(&self) -> WordPolicy;
    /// This rule with `first` for the limiter's own quota.
    fn with_first(&self, first: WordPolicy) -> Self;
}

/// One quota's outcome of `op`, as a single-quota store writes it.
#[inline(always)]
fn word_outcome(policy: &WordPolicy, op: Op, state: u64, now: u64) -> Outcome {
    match op {
        Op::Check { cost, max_delay } => match policy.evaluate(state, now, cost) {
            Outcome::Allow { decision, .. } if decision.delay_ns() > max_delay => {
                Outcome::Deny(Decision::deny(
                    decision.limit(),
                    decision.remaining(),
                    decision.reset_after_ns(),
                    decision.delay_ns() - max_delay,
                ))
            }
            outcome => outcome,
        },
        Op::Settle(settle) => {
            let state = policy.settle(state, now, settle).min(STATE_MAX);
            Outcome::Allow {
                decision: policy.unit_view(state, now),
                state,
            }
        }
    }
}

/// The instant a sweep's judgement of `state` under `policy` says: its wait, and the
/// instant from which a rebuild could drop it.
fn word_judge(policy: &WordPolicy, state: u64, now: u64, sweep: &Sweep) -> Verdict {
    let period = policy.quota().period_ns();
    let since = sweep.since(period);
    let wait = policy.untouched_wait(state, now, since);
    Verdict {
        wait,
        droppable_at: since.saturating_add(wait).saturating_add(period),
    }
}

impl Rule for WordPolicy {
    type Atom = AtomicU64;
    const UNTOUCHED: u64 = UNTOUCHED;

    #[inline(always)]
    fn outcome(&self, op: Op, state: u64, now: u64) -> Outcome {
        word_outcome(self, op, state, now)
    }

    #[inline]
    fn fits(&self, cost: u64) -> Result<(), InsufficientCapacity> {
        fits(self, cost)
    }

    #[inline]
    fn capacity(&self) -> u64 {
        Policy::capacity(self)
    }

    fn peek(&self, state: u64, now: u64, cost: u64) -> Decision {
        WordPolicy::peek(self, state, now, cost)
    }

    fn judge(&self, state: u64, now: u64, sweep: &Sweep) -> Verdict {
        word_judge(self, state, now, sweep)
    }

    fn droppable_from(&self, state: u64, now: u64) -> u64 {
        match self.untouched_wait(state, now, now) {
            0 => 0,
            wait => now
                .saturating_add(wait)
                .saturating_add(self.quota().period_ns()),
        }
    }

    fn eviction_cost(&self, state: u64, now: u64) -> (u64, u64) {
        let snapshot = WordPolicy::peek(self, state, now, 0);
        (
            snapshot.limit() - snapshot.remaining(),
            snapshot.reset_after_ns(),
        )
    }

    fn fallback_retry_ns(&self) -> u64 {
        self.quota().emission_interval_ns()
    }

    fn convert(&self, state: u64, now: u64, from: &Self) -> u64 {
        WordPolicy::convert(self, state, now, from)
    }

    fn first(&self) -> WordPolicy {
        *self
    }

    fn with_first(&self, first: WordPolicy) -> Self {
        first
    }
}

/// Two quotas of one key, decided together over an [`AtomicPair`]: the limiter's own
/// quota (index 0 in decisions) and its first `also` quota (index 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PairPolicy {
    policies: [WordPolicy; 2],
    /// Both quotas' buckets when both are token buckets (the common case), decided in
    /// one pass without a match on the two policies' kinds.
    buckets: Option<BucketPair>,
}

impl PairPolicy {
    /// The pair of `policies`, if this machine has the lock-free 16-byte atomics a
    /// pair's word needs ([`AtomicPair::lock_free`]): no pair's table exists without.
    pub(crate) fn new(policies: [WordPolicy; 2]) -> Option<Self> {
        Self::available().then(|| Self::of(policies))
    }

    /// Whether this machine has a pair's atomics, so that [`new`](Self::new) makes one.
    pub(crate) fn available() -> bool {
        AtomicPair::lock_free()
    }

    fn of(policies: [WordPolicy; 2]) -> Self {
        let [first, second] = &policies;
        Self {
            policies,
            buckets: WordPolicy::bucket_pair([first, second]),
        }
    }

    /// Both policies, the limiter's own first.
    pub(crate) fn policies(&self) -> [WordPolicy; 2] {
        self.policies
    }

    /// The same pair with `policies` (a pair exists only where its atomics do).
    pub(crate) fn with_policies(&self, policies: [WordPolicy; 2]) -> Self {
        Self::of(policies)
    }
}

impl Rule for PairPolicy {
    type Atom = AtomicPair;
    const UNTOUCHED: Two = [UNTOUCHED, UNTOUCHED];

    /// Both quotas' outcomes against the same state. Admitted only if both admit (then
    /// both states are written); a deny is the one a chain of the two stores gives: the
    /// first denying quota's, with the second's if it denies too and waits longer, and the
    /// fewest units either has left (see `compound::denied`).
    #[inline(always)]
    fn outcome(&self, op: Op, state: Two, now: u64) -> Outcome<Two> {
        let [first, second] = &self.policies;
        // The common case (two token buckets admitting a check) in one pass.
        if let (
            Op::Check {
                cost,
                max_delay: u64::MAX,
            },
            Some(buckets),
        ) = (op, &self.buckets)
        {
            if let Some((decision, state)) = buckets.admit(state, now, cost) {
                return Outcome::Allow { decision, state };
            }
        }
        match word_outcome(first, op, state[0], now) {
            Outcome::Allow {
                decision: d0,
                state: s0,
            } => match word_outcome(second, op, state[1], now) {
                Outcome::Allow {
                    decision: d1,
                    state: s1,
                } => {
                    let (d0, d1) = (d0.for_policy(0), d1.for_policy(1));
                    Outcome::Allow {
                        decision: match op {
                            // Two admissions: field by field, in registers.
                            Op::Check { .. } => d0.tighter_admission(d1),
                            // A settlement's answers may deny (a unit request after it).
                            Op::Settle(_) => d0.tighter(d1),
                        },
                        state: [s0, s1],
                    }
                }
                Outcome::Deny(d1) => Outcome::Deny(second_denied(
                    first,
                    op.check_cost().unwrap_or(0),
                    s0,
                    now,
                    d1,
                )),
            },
            Outcome::Deny(d0) => Outcome::Deny(first_denied(
                second,
                op.check_cost().unwrap_or(1),
                state[1],
                now,
                d0,
            )),
        }
    }

    #[inline]
    fn fits(&self, cost: u64) -> Result<(), InsufficientCapacity> {
        fits(&self.policies[0], cost)?;
        fits(&self.policies[1], cost)
    }

    #[inline]
    fn capacity(&self) -> u64 {
        Policy::capacity(&self.policies[0]).min(Policy::capacity(&self.policies[1]))
    }

    fn peek(&self, state: Two, now: u64, cost: u64) -> Decision {
        let [first, second] = &self.policies;
        let decisions = [
            first.peek(state[0], now, cost).for_policy(0),
            second.peek(state[1], now, cost).for_policy(1),
        ];
        // Two decisions: `all_of` returns one.
        Decision::all_of(decisions).unwrap_or(decisions[0])
    }

    fn judge(&self, state: Two, now: u64, sweep: &Sweep) -> Verdict {
        let [a, b] = [
            word_judge(&self.policies[0], state[0], now, sweep),
            word_judge(&self.policies[1], state[1], now, sweep),
        ];
        Verdict {
            wait: a.wait.max(b.wait),
            droppable_at: a.droppable_at.max(b.droppable_at),
        }
    }

    fn droppable_from(&self, state: Two, now: u64) -> u64 {
        let a = Rule::droppable_from(&self.policies[0], state[0], now);
        let b = Rule::droppable_from(&self.policies[1], state[1], now);
        // Droppable once both are (0: now).
        a.max(b)
    }

    fn eviction_cost(&self, state: Two, now: u64) -> (u64, u64) {
        let (a, b) = (
            self.policies[0].eviction_cost(state[0], now),
            self.policies[1].eviction_cost(state[1], now),
        );
        (a.0.max(b.0), a.1.max(b.1))
    }

    fn fallback_retry_ns(&self) -> u64 {
        self.policies[0].fallback_retry_ns()
    }

    /// Converts each quota whose policy changed (only the first ever does: key quotas
    /// and quota changes act on the limiter's own quota).
    fn convert(&self, state: Two, now: u64, from: &Self) -> Two {
        let convert = |i: usize| {
            if self.policies[i] == from.policies[i] {
                state[i]
            } else {
                self.policies[i].convert(state[i], now, &from.policies[i])
            }
        };
        [convert(0), convert(1)]
    }

    fn first(&self) -> WordPolicy {
        self.policies[0]
    }

    fn with_first(&self, first: WordPolicy) -> Self {
        Self::of([first, self.policies[1]])
    }
}

/// The deny of a request the first quota denied (`deny`): the second quota is asked
/// without consuming, for `cost` units (1 for a settlement's unit view); the longer wait
/// if it denies too, and the fewest units left.
///
/// The cold helpers take the op's cost, not the op: an `Op` argument goes by pointer to a
/// copy in the caller's frame, written on every check (see `WordStore::check_slow`).
#[cold]
fn first_denied(second: &WordPolicy, cost: u64, state: u64, now: u64, deny: Decision) -> Decision {
    let later = second.peek(state, now, cost);
    let mut decision = deny.for_policy(0);
    if !later.is_allowed() {
        decision = decision.tighter(later.for_policy(1));
    }
    decision.with_fewest(deny.remaining().min(later.remaining()))
}

/// The deny of a check of `cost` units the first quota admitted (its state `after` the
/// admission) and the second denied (`deny`): the units the first has left once given
/// back, as a chain's refund would leave them, count among the fewest. A cost of 0 (also
/// a settlement's) consumed nothing there.
#[cold]
fn second_denied(first: &WordPolicy, cost: u64, after: u64, now: u64, deny: Decision) -> Decision {
    let left = if cost == 0 {
        u64::MAX
    } else {
        let refunded = first
            .settle(after, now, Settle::Refund(cost))
            .min(STATE_MAX);
        first.unit_view(refunded, now).remaining()
    };
    deny.for_policy(1).with_fewest(left.min(deny.remaining()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Quota;

    fn policy(quota: &str) -> WordPolicy {
        WordPolicy::token_bucket(quota.parse::<Quota>().unwrap())
    }

    /// A pair admits only what both quotas admit, writes both states on an admission
    /// and says which quota denied.
    #[test]
    fn a_pair_admits_what_both_quotas_admit() {
        let pair = PairPolicy::new([policy("10/s"), policy("3/h")]).expect("cmpxchg16b and AVX");
        let mut state = PairPolicy::UNTOUCHED;
        let now = 1_000_000_000;
        let check = Op::Check {
            cost: 1,
            max_delay: u64::MAX,
        };
        for expected in [2, 1, 0] {
            match pair.outcome(check, state, now) {
                Outcome::Allow { decision, state: s } => {
                    assert_eq!((decision.remaining(), decision.policy()), (expected, 1));
                    state = s;
                }
                Outcome::Deny(d) => panic!("denied {d:?}"),
            }
        }
        let Outcome::Deny(deny) = pair.outcome(check, state, now) else {
            panic!("admitted a fourth request of 3/h");
        };
        assert_eq!(deny.policy(), 1);
        assert_eq!(deny.retry_after_ns(), 1_200_000_000_000);
        assert_eq!(pair.peek(state, now, 1).remaining(), 0);
        assert!(matches!(pair.fits(4), Err(e) if e.capacity == 3));
    }
}
