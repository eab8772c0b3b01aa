//! One key's side of a round: what the node reads from a key's cell and books to build
//! its [`Request`], and how it applies the [`Answer`]; how a key turns hot, returns cold,
//! and runs on the local fallback. No clock, no Redis: time is an argument, and the
//! [node](super::node) that both the task and the simulation drive calls these.
//!
//! The books count, per key, everything the node admitted since it first saw the key
//! (`spent`). A round reports `floor = spent + keep`, where `keep` is the part of the lease
//! the node goes on holding; the rest goes back. Checks spend the lease and the overdraft
//! by CAS; the books infer what they spent from what the task last left in each pool.

use std::sync::atomic::Ordering;

use super::books::Books;
use super::cell::{CHARGED, Cold, HOT, NEW, QUOTA, SyncCell, SyncPolicy, WANT_HOT, WANTED};
use super::protocol::{Answer, MAX_DEMAND, Request, SharedQuota, WEIGHT_ONE, scale};

/// What the node side of every key's round shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeParams {
    /// Ticks (µs) one token costs; the rate is one token per `ticks` µs.
    pub(crate) ticks: u64,
    /// The quota's capacity: no key asks for more.
    pub(crate) capacity: u64,
    /// The sync interval, in ns of the limiter's clock.
    pub(crate) interval_ns: u64,
    /// The holding horizon, in µs: a key asks for its demand over this long.
    pub(crate) hold_us: u64,
    /// A key unused for this long (ns) gives its lease back and is dropped.
    pub(crate) idle_ns: u64,
    /// Reconcile mode: overdrafts.
    pub(crate) reconcile: bool,
    /// The time constant of the demand average, in µs: the quota's period, from 1 s to
    /// 60 s.
    pub(crate) demand_tau_us: u64,
    /// How long a round waits for its answer (ns; 0: for ever).
    pub(crate) timeout_ns: u64,
    /// The time constant of the key's use (µs; see [`average_use`]): the demand's, or
    /// longer, so that it spans 20 tokens of this node's even share.
    pub(crate) use_tau_us: u64,
}

/// The node side's parameters for a key of `policy`: `p`, with the key's own quota's
/// rate and capacity if it has one.
pub(crate) fn key_params(p: &NodeParams, policy: &SyncPolicy) -> NodeParams {
    if policy.shared.is_default() {
        return *p;
    }
    NodeParams {
        ticks: policy.ticks,
        capacity: policy.capacity,
        ..*p
    }
}

/// The hash by which nodes name a hot key to each other: of its Redis key (which is
/// what the announcement holds, so no key appears in Redis in any other form), FNV-1a,
/// the same on every node and every build.
pub(crate) fn fleet_hash(redis_key: &[u8]) -> u64 {
    redis_key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether the key is cold.
pub(crate) fn is_cold(cell: &SyncCell) -> bool {
    cell.cold_tat.load(Ordering::Acquire) != HOT
}

/// Turns a cold key hot at `now` (limiter clock, ns), with `t_ns` the cold share's ns
/// per token: it is synced from now on. Its first round reports as admitted what its
/// cold share still has in use (the tokens its GCRA stands ahead of `now`, rounded up:
/// what it admitted beyond its share's refill), charged to the global state at once, so
/// that the key's global state starts where this node's share left off. Returns false
/// if the key was hot already.
pub(crate) fn turn_hot(cell: &SyncCell, books: &mut Books, t_ns: u64, now: u64) -> bool {
    let tat = cell.cold_tat.swap(HOT, Ordering::AcqRel);
    if tat == HOT {
        return false;
    }
    let in_use = tat.saturating_sub(now).div_ceil(t_ns.max(1));
    let flags = cell
        .hot
        .flags
        .fetch_and(!(NEW | WANT_HOT), Ordering::AcqRel);
    if flags & WANT_HOT == 0 {
        // Turned hot because another node did: it wants a lease all the same.
        cell.hot.aside.ran_out_at.store(now, Ordering::Relaxed);
    }
    cell.hot.flags.fetch_or(WANTED, Ordering::Release);
    *books = Books {
        spent: in_use,
        last_active: now,
        fleet: books.fleet,
        // Its own demand turned it hot: its first round announces it to the others.
        announce: flags & WANT_HOT != 0,
        ..Books::fresh(0)
    };
    true
}

/// Whether a hot key has nothing this node must report beyond its books: no deny
/// waiting for a lease, no quota change, no charge or refund not yet reported.
pub(crate) fn has_nothing_pending(cell: &SyncCell) -> bool {
    cell.hot.flags.load(Ordering::Acquire) & (WANTED | QUOTA | CHARGED) == 0
        && cell.hot.aside.overdrawn.load(Ordering::Acquire) == 0
        && cell.hot.aside.refunded.load(Ordering::Acquire) == 0
}

/// Returns a hot key cold at `now`, once the round that reported everything it admitted
/// was answered (see the cooling in [`super::node`]): from now on it admits at its cold
/// share `cold`, with no round. The share starts with what the key holds of its lease
/// (at most the share's burst: the cooling round asks for that much), which Redis
/// charged when it granted it; the rest of the burst, and whatever was admitted on the
/// overdraft since the round or charged beyond, are in use, as a cold key's charges
/// are: should the key turn hot again, its first round reports them. A released key, one
/// with something to report, or one holding no token (its share would start empty, and
/// the next request turn it hot again) stays hot. Returns whether the key returned cold.
pub(crate) fn turn_cold(cell: &SyncCell, books: &mut Books, cold: &Cold, now: u64) -> bool {
    if is_cold(cell) || books.pending || books.released || !has_nothing_pending(cell) {
        return false;
    }
    let held = if now < cell.hot.expires.load(Ordering::Acquire) {
        cell.hot.allowance.load(Ordering::Acquire)
    } else {
        0
    };
    if held == 0 {
        return false;
    }
    let left = cell.hot.allowance.swap(0, Ordering::AcqRel);
    let overdraft = cell.hot.overdraft.swap(0, Ordering::AcqRel);
    let unreported = books.overdraft_base.saturating_sub(overdraft)
        + cell.hot.aside.overdrawn.swap(0, Ordering::AcqRel);
    let burst = cold.burst();
    let in_use = burst - left.min(burst) + unreported;
    cell.hot
        .flags
        .fetch_and(!(WANTED | CHARGED), Ordering::AcqRel);
    cell.hot.expires.store(u64::MAX, Ordering::Release);
    *books = Books {
        released: true,
        fleet: books.fleet,
        ..Books::fresh(0)
    };
    // Below `HOT`, which marks a key synced.
    let tat = now
        .saturating_add(in_use.saturating_mul(cold.t_ns))
        .min(HOT - 1);
    cell.cold_tat.store(tat, Ordering::Release);
    true
}

/// What a key first seen on a node may admit before its first round: in reconcile mode
/// its share `⌊capacity / nodes⌋` of a fresh key's capacity (rounded down, so that the
/// nodes together never hand out more than the capacity), nothing in lease mode.
pub(crate) fn fresh_overdraft(capacity: u64, nodes: u64, reconcile: bool) -> u64 {
    if reconcile {
        capacity / nodes.max(1)
    } else {
        0
    }
}

/// How urgently a key needs a round. Lower goes first when a round is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Need {
    /// It ran out, or its lease is below half what it wants.
    Lease,
    /// It used something, or a report is unacknowledged.
    Report,
    /// It has been idle for the idle TTL: its lease goes back and it is dropped.
    Release,
}

/// What a round observed of a key's demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Observed {
    /// Tokens admitted since the last round.
    pub(crate) used: u64,
    /// µs since the last round.
    pub(crate) elapsed_us: u64,
    /// If the key ran out: µs from the last round until it did.
    pub(crate) ran_out_after_us: Option<u64>,
}

/// Updates the key's demand estimate (a weight: a fraction of one token per `ticks` µs),
/// an exponentially weighted average over about `tau_us`. The rate observed is what was
/// used over the time it lasted: a key that ran out part-way was wanting at least that
/// rate all along (one that ran out with nothing at all doubles its estimate). Returns the
/// demand to report: a thirty-second above the average, a margin for a node whose average
/// lags its arrivals that strands little of the rate when the node does not use it.
pub(crate) fn estimate(average: &mut u64, seen: Observed, ticks: u64, tau_us: u64) -> u64 {
    let weight = |units: f64, us: u64| units * ticks as f64 * WEIGHT_ONE as f64 / us.max(1) as f64;
    let elapsed = seen.elapsed_us.max(1);
    let alpha = 1.0 - (-(elapsed as f64) / tau_us.max(1) as f64).exp();
    let observed = match seen.ran_out_after_us {
        Some(lasted) if seen.used > 0 => weight(seen.used as f64, lasted.clamp(1, elapsed)),
        _ => weight(seen.used as f64, elapsed),
    };
    let mut next = *average as f64 + alpha * (observed - *average as f64);
    if seen.ran_out_after_us.is_some() {
        next = next.max(observed);
        if seen.used == 0 {
            next = next.max(*average as f64 * 2.0).max(weight(1.0, elapsed));
        }
    }
    *average = next.clamp(0.0, MAX_DEMAND as f64) as u64;
    (*average).saturating_add(*average / 32).min(MAX_DEMAND)
}

/// The key's use (a weight: a fraction of the rate), an exponentially weighted average
/// over about `tau_us` of what it admitted: unlike its demand, a round that ran out
/// early (its lease was late: a round lost) does not raise it. It tells whether the key
/// still needs the fleet's coordination (see the cooling in [`super::node`]).
pub(crate) fn average_use(usage: u64, seen: Observed, ticks: u64, tau_us: u64) -> u64 {
    let elapsed = seen.elapsed_us.max(1);
    let alpha = 1.0 - (-(elapsed as f64) / tau_us.max(1) as f64).exp();
    let observed = seen.used as f64 * ticks as f64 * WEIGHT_ONE as f64 / elapsed as f64;
    let next = usage as f64 + alpha * (observed - usage as f64);
    next.clamp(0.0, MAX_DEMAND as f64) as u64
}

/// The tokens a key with `average` demand wants to hold: a quarter more than its demand
/// over the horizon (arrivals are not smooth), at least 1, at most the capacity.
pub(crate) fn target(average: u64, p: &NodeParams) -> u64 {
    let demand = u128::from(average) * 5 / 4;
    let tokens =
        (demand * u128::from(p.hold_us)).div_ceil(u128::from(WEIGHT_ONE) * u128::from(p.ticks));
    u64::try_from(tokens)
        .unwrap_or(u64::MAX)
        .clamp(1, p.capacity.max(1))
}

/// What the key's cell has used since the task last left it.
fn used(cell: &SyncCell, books: &Books) -> u64 {
    books
        .lease_base
        .saturating_sub(cell.hot.allowance.load(Ordering::Acquire))
        + books
            .overdraft_base
            .saturating_sub(cell.hot.overdraft.load(Ordering::Acquire))
        + cell.hot.aside.overdrawn.load(Ordering::Acquire)
}

/// What the key needs from the next round at `now`, without changing anything; `None`
/// if nothing.
pub(crate) fn need(cell: &SyncCell, books: &Books, p: &NodeParams, now: u64) -> Option<Need> {
    if is_cold(cell) {
        return None;
    }
    let flags = cell.hot.flags.load(Ordering::Acquire);
    let used = used(cell, books);
    if flags & WANTED != 0 {
        return Some(Need::Lease);
    }
    if flags & QUOTA != 0 || cell.hot.aside.refunded.load(Ordering::Acquire) > 0 {
        return Some(Need::Report);
    }
    let idle = now.saturating_sub(books.last_active) >= p.idle_ns;
    let left = if now < cell.hot.expires.load(Ordering::Acquire) {
        cell.hot.allowance.load(Ordering::Acquire)
    } else {
        0
    };
    // A key in use keeps asking while it holds less than it wants: its credit may have
    // grown since the last answer (this also keeps its demand fresh in Redis).
    if !idle && books.last_active != 0 && left < target(books.average, p).clamp(1, 2) {
        return Some(Need::Lease);
    }
    if used > 0 && left * 2 < target(books.average, p) {
        return Some(Need::Lease);
    }
    if used > 0 || books.pending {
        return Some(Need::Report);
    }
    (idle && !books.released).then_some(Need::Release)
}

/// Releases a key without a round, when the round it needs (a release) cannot be sent
/// soon (rounds are saturated, or the node is stopping): only a key with nothing to
/// report (nothing used since its last acknowledged round, no round pending) qualifies.
/// Its lease is given up here rather than returned: Redis charged it when it granted
/// it, so the limit is never exceeded; at worst those few tokens (at most the key's
/// holding cap) serve no one until the global state refills. Returns whether the key
/// was released; a check racing with it keeps the key in use.
pub(crate) fn release_locally(cell: &SyncCell, books: &mut Books) -> bool {
    if books.pending
        || books.released
        || used(cell, books) > 0
        || cell_wants(cell)
        || cell.hot.aside.refunded.load(Ordering::Acquire) > 0
    {
        return false;
    }
    let take = |pool: &std::sync::atomic::AtomicU64, base: u64| {
        pool.compare_exchange(base, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    };
    if !take(&cell.hot.allowance, books.lease_base) {
        return false;
    }
    if !take(&cell.hot.overdraft, books.overdraft_base) {
        cell.hot
            .allowance
            .fetch_add(books.lease_base, Ordering::AcqRel);
        return false;
    }
    books.lease_base = 0;
    books.overdraft_base = 0;
    books.released = true;
    true
}

/// Builds the key's request for round `seq` at `now` (limiter clock, ns), shrinking its
/// lease to what it keeps. A key idle for the idle TTL keeps nothing, nor does any key
/// when `release` (at shutdown); one in use holds what its demand wants, at least
/// `hold_at_least` (a key returning cold: its cold share's burst). `redis_offset_ns` is
/// Redis's clock (ns) minus the limiter's, as last measured (`None` before the first
/// round: then the request has no deadline and no anchor).
#[allow(clippy::too_many_arguments)]
pub(crate) fn collect(
    cell: &SyncCell,
    books: &mut Books,
    p: &NodeParams,
    seq: u64,
    now: u64,
    release: bool,
    hold_at_least: u64,
    redis_offset_ns: Option<i64>,
) -> Request {
    let timeout_ns = p.timeout_ns;
    // The round carries the key's quota (a round that fails stays pending: the next
    // one carries it again).
    let flags = cell
        .hot
        .flags
        .fetch_and(!(WANTED | QUOTA | CHARGED), Ordering::AcqRel);
    let ran_out = flags & WANTED != 0;
    if books.epoch == 0 {
        books.epoch = seq;
    }
    let elapsed_us = if books.last_round == 0 {
        p.interval_ns / 1_000
    } else {
        now.saturating_sub(books.last_round) / 1_000
    };
    let used_now = used(cell, books);
    if used_now > 0 || ran_out || books.last_active == 0 {
        books.last_active = now;
    }
    let idle = release || now.saturating_sub(books.last_active) >= p.idle_ns;
    let expired = now >= cell.hot.expires.load(Ordering::Acquire);
    let (demand, hold) = if idle {
        (0, 0)
    } else {
        let ran_out_after_us = ran_out.then(|| {
            cell.hot
                .aside
                .ran_out_at
                .load(Ordering::Acquire)
                .saturating_sub(books.last_round)
                / 1_000
        });
        let seen = Observed {
            used: used_now,
            elapsed_us,
            ran_out_after_us,
        };
        let demand = estimate(&mut books.average, seen, p.ticks, p.demand_tau_us);
        books.usage = average_use(books.usage, seen, p.ticks, p.use_tau_us);
        (demand, target(books.average, p).max(hold_at_least))
    };
    // Shrink the lease to what the key keeps: the rest goes back with this round.
    let mut left = 0;
    let _ = cell
        .hot
        .allowance
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
            left = l;
            Some(if expired { 0 } else { l.min(hold) })
        });
    let keep = if expired { 0 } else { left.min(hold) };
    // What goes back is the fallback's tokens first (the budget's before the share's):
    // they were never reserved.
    books.local = books.local.saturating_sub(left - keep);
    books.beyond = books.beyond.saturating_sub(left - keep).min(books.local);
    // The overdraft stays usable while the round is in flight (the answer replaces it);
    // an idle key gives it up now.
    let overdraft = if idle {
        cell.hot.overdraft.swap(0, Ordering::AcqRel)
    } else {
        cell.hot.overdraft.load(Ordering::Acquire)
    };
    books.spent += books.lease_base.saturating_sub(left)
        + books.overdraft_base.saturating_sub(overdraft)
        + cell.hot.aside.overdrawn.swap(0, Ordering::AcqRel);
    // Refunds lower the floor: by at most what this node reported as spent on the key
    // (units admitted on another node are refunded there; what the cap leaves out is
    // never given back, so nothing is ever minted).
    let refunded = cell.hot.aside.refunded.swap(0, Ordering::AcqRel);
    books.spent -= refunded.min(books.spent);
    books.lease_base = keep;
    books.overdraft_base = overdraft;
    books.demand = demand;
    books.last_round = now;
    books.pending = true;
    books.released = false;
    // What the floor adds beyond the reservation was admitted since the last
    // acknowledged round was collected: Redis spreads the charge back over that time.
    let in_redis = |local_ns: u64| {
        redis_offset_ns.map_or(0, |offset| {
            u64::try_from((i128::from(local_ns) + i128::from(offset)) / 1_000).unwrap_or(0)
        })
    };
    // A charge was consumed when it was made, not over the time since the last round:
    // with one in the floor, Redis charges from now (the anchor 0), spreading nothing
    // back (the units admitted since the last round with it are charged from now too,
    // later than they were: the global state never gains by it).
    let anchor = if books.last_ok == 0 || flags & CHARGED != 0 {
        0
    } else {
        in_redis(books.last_ok)
    };
    let deadline = if timeout_ns == 0 {
        0
    } else {
        in_redis(now.saturating_add(timeout_ns))
    };
    Request {
        seq,
        epoch: books.epoch,
        floor: books.spent + keep,
        keep,
        known: books.known,
        demand,
        want: hold - keep,
        anchor,
        deadline,
        local: books.local,
        beyond: books.beyond,
        // The caller sets the key's quota.
        quota: SharedQuota::default(),
    }
}

/// Applies the answer to the key's round; `expires` is when (limiter clock, ns) the lease
/// becomes void, `share_until` when (limiter clock, ns, a round trip early) Redis stops
/// reserving the key's share. Returns false for a stale answer, which changes nothing
/// (the report stays pending).
pub(crate) fn settle(
    cell: &SyncCell,
    books: &mut Books,
    p: &NodeParams,
    request: &Request,
    answer: &Answer,
    expires: u64,
    share_until: u64,
) -> bool {
    if answer.stale {
        return false;
    }
    books.share = answer.share;
    books.share_until = share_until;
    // A node that still owes for its last budget gets no new one until it has repaid
    // it: however often its link flaps, at most one budget is outstanding.
    books.budget_spent = answer.owes > 0;
    // What the round reported is accounted for (charged, or forgiven); what the
    // fallback handed out after its collection goes into the next floor.
    books.beyond = books.beyond.saturating_sub(request.beyond);
    if answer.void > 0 {
        // Redis gave the lease kept back to the window it was reserved in (it ended):
        // what is left of it is void here too. What was spent of it meanwhile goes into
        // the next floor, charged to the new window.
        let left = cell.hot.allowance.swap(0, Ordering::AcqRel);
        books.lease_base = books.lease_base.saturating_sub(left);
        books.local = books.local.saturating_sub(left);
        books.beyond = books.beyond.min(books.local);
    }
    cell.hot.expires.store(expires, Ordering::Release);
    cell.hot.allowance.fetch_add(answer.grant, Ordering::AcqRel);
    books.lease_base += answer.grant;
    books.known = answer.reserved;
    // An idle key's round (no demand, nothing kept or wanted) releases it.
    let released = request.demand == 0 && request.keep == 0 && request.want == 0;
    // The new overdraft replaces the old; what was spent of the old one in flight is
    // reported next round. A released key holds none.
    let overdraft = if p.reconcile && !released {
        answer.overdraft
    } else {
        0
    };
    let before = cell.hot.overdraft.swap(overdraft, Ordering::AcqRel);
    books.spent += books.overdraft_base.saturating_sub(before);
    books.overdraft_base = overdraft;
    books.pending = false;
    books.local = books.local.saturating_sub(request.local);
    // Everything admitted after this round's collection goes into the next floor.
    books.last_ok = books.last_round;
    books.released = released && cell.hot.allowance.load(Ordering::Acquire) == 0 && before == 0;
    true
}

/// The local fallback, once per interval. While Redis reserves the key's share for this
/// node (until `share_until`), the key may admit at that share of the rate (fractions
/// carried), up to its share of the capacity (at least 1) at once: Redis charges the
/// global state for it meanwhile. After that, or for a key that never had a share, the
/// key gets a one-time budget of `⌊capacity / nodes⌋` (at least 1) for the rest of the
/// outage, and nothing more: so what a node cut off from Redis admits beyond its
/// reserved share is bounded whatever the outage's length. What the fallback admits is
/// reported when Redis answers again: set against what was charged on the node's
/// behalf; the budget's excess is the node's own debt; all of it forgiven if Redis lost
/// the key's state. Returns whether the key got its budget now.
pub(crate) fn refill_locally(
    cell: &SyncCell,
    books: &mut Books,
    p: &NodeParams,
    nodes: u64,
    now: u64,
) -> bool {
    let nodes = nodes.max(1);
    // A cold key admits at its share by itself.
    if is_cold(cell) {
        return false;
    }
    if now.saturating_sub(books.last_active) >= p.idle_ns && !cell_wants(cell) {
        return false;
    }
    cell.hot.expires.store(u64::MAX, Ordering::Release);
    let (pool, base) = if p.reconcile {
        (&cell.hot.overdraft, &mut books.overdraft_base)
    } else {
        (&cell.hot.allowance, &mut books.lease_base)
    };
    let reserved = now < books.share_until && books.share > 0;
    let (tokens, cap) = if reserved {
        books.local_credit += scale(p.interval_ns / 1_000, books.share);
        let tokens = books.local_credit / p.ticks;
        books.local_credit %= p.ticks;
        (tokens, scale(p.capacity, books.share).max(1))
    } else if !books.budget_spent {
        books.budget_spent = true;
        let budget = (p.capacity / nodes).max(1);
        (budget, budget)
    } else {
        return false;
    };
    let mut added = 0;
    let _ = pool.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
        added = cap.saturating_sub(left).min(tokens);
        (added > 0).then_some(left + added)
    });
    *base += added;
    books.local += added;
    if !reserved {
        books.beyond += added;
    }
    if added > 0 {
        books.released = false;
    }
    !reserved
}

fn cell_wants(cell: &SyncCell) -> bool {
    cell.hot.flags.load(Ordering::Acquire) & (WANTED | QUOTA) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> NodeParams {
        NodeParams {
            ticks: 10_000,
            capacity: 100,
            interval_ns: 50_000_000,
            hold_us: 100_000,
            idle_ns: 15_000_000_000,
            reconcile: false,
            demand_tau_us: 1_000_000,
            timeout_ns: 0,
            use_tau_us: 1_000_000,
        }
    }

    #[test]
    fn demand_is_what_was_used_over_the_time_it_lasted() {
        let tau = 1_000_000;
        let seen = |used, ran_out_after_us| Observed {
            used,
            elapsed_us: 50_000,
            ran_out_after_us,
        };
        // 5 tokens every 50 ms at 10 ms per token is the whole rate: the average
        // converges to it, and the report is a thirty-second above.
        let mut average = 0;
        let mut reported = 0;
        for _ in 0..200 {
            reported = estimate(&mut average, seen(5, None), 10_000, tau);
        }
        assert!(average.abs_diff(WEIGHT_ONE) < WEIGHT_ONE / 100, "{average}");
        assert_eq!(reported, average + average / 32);
        // The same 5 spent in the first 10 ms, then denies: five times the rate.
        let mut short = average;
        estimate(&mut short, seen(5, Some(10_000)), 10_000, tau);
        assert_eq!(short, 5 * WEIGHT_ONE);
        // Run out with nothing at all: doubled.
        let mut empty = average;
        estimate(&mut empty, seen(0, Some(0)), 10_000, tau);
        assert_eq!(empty, 2 * average);
        // Idle: decays slowly.
        let mut idle = average;
        estimate(&mut idle, seen(0, None), 10_000, tau);
        assert!(idle < average && idle > average * 9 / 10, "{idle}");
        let mut capped = MAX_DEMAND;
        assert_eq!(estimate(&mut capped, seen(0, Some(0)), 1, tau), MAX_DEMAND);
    }

    /// A cell whose lease never expires.
    fn cell() -> SyncCell {
        let cell = SyncCell::default();
        cell.hot.expires.store(u64::MAX, Ordering::Release);
        cell
    }

    #[test]
    fn a_round_reports_what_was_spent_and_keeps_its_target() {
        let p = params();
        let cell = cell();
        let mut books = Books::default();
        cell.hot.allowance.store(10, Ordering::Release);
        books.lease_base = 10;
        books.average = WEIGHT_ONE / 2; // 5 tokens over the 100 ms horizon
        // 4 admitted.
        cell.hot.allowance.store(6, Ordering::Release);
        let r = collect(&cell, &mut books, &p, 1, 50_000_000, false, 0, Some(0));
        assert_eq!(books.spent, 4);
        assert_eq!(r.keep, cell.hot.allowance.load(Ordering::Acquire));
        assert_eq!(r.floor, 4 + r.keep);
        // Two more admitted while the round is in flight; the answer grants 3.
        cell.hot.allowance.fetch_sub(2, Ordering::AcqRel);
        let answer = Answer {
            grant: 3,
            reserved: r.floor + 3,
            ..Answer::default()
        };
        assert!(settle(&cell, &mut books, &p, &r, &answer, u64::MAX, 0));
        assert_eq!(cell.hot.allowance.load(Ordering::Acquire), r.keep - 2 + 3);
        let r2 = collect(&cell, &mut books, &p, 2, 100_000_000, false, 0, Some(0));
        assert_eq!(books.spent, 6);
        assert_eq!(r2.floor, 6 + r2.keep);
    }

    /// `charge` spends the lease, then the overdraft, and reports the rest as consumed
    /// beyond (the floor rises by the whole charge); `refund` lowers the next floor by
    /// as many, but never by more than the node reported spent; either makes the key
    /// need a round, and keeps it from being released or evicted until then.
    #[test]
    fn settlements_move_the_floor_by_exactly_their_units() {
        use crate::algorithm::Settle;
        use crate::store::state::State;
        let p = params();
        let policy = SyncPolicy::new(crate::Quota::per_second(100).unwrap(), 100, 0, 50_000_000);
        let cell = cell();
        let mut books = Books::default();
        cell.hot.allowance.store(10, Ordering::Release);
        cell.hot.overdraft.store(3, Ordering::Release);
        books.lease_base = 10;
        books.overdraft_base = 3;
        books.average = WEIGHT_ONE / 2;
        // 4 admitted, then a charge of 25: the 6 leased and 3 overdrawn left, 16 beyond.
        cell.hot.allowance.store(6, Ordering::Release);
        cell.settle(&policy, 1, Settle::Charge(25));
        assert_eq!(cell.hot.allowance.load(Ordering::Acquire), 0);
        assert_eq!(cell.hot.overdraft.load(Ordering::Acquire), 0);
        assert_eq!(cell.hot.aside.overdrawn.load(Ordering::Acquire), 16);
        assert!(!cell.check(&policy, 1, 1, u64::MAX).is_allowed());
        assert!(!cell.evictable() && !cell.is_released());
        assert_eq!(need(&cell, &books, &p, 2), Some(Need::Lease));
        let r = collect(&cell, &mut books, &p, 1, 50_000_000, false, 0, Some(0));
        assert_eq!(r.floor, 4 + 25);
        assert_eq!(r.keep, 0);
        let answer = Answer {
            reserved: r.floor,
            ..Answer::default()
        };
        assert!(settle(&cell, &mut books, &p, &r, &answer, u64::MAX, 0));
        // A refund of 10 lowers the next floor by 10 and makes the key report.
        assert!(!cell.is_released());
        cell.settle(&policy, 2, Settle::Refund(10));
        assert!(!cell.evictable());
        assert_eq!(need(&cell, &books, &p, 3), Some(Need::Report));
        let r = collect(&cell, &mut books, &p, 2, 100_000_000, false, 0, Some(0));
        assert_eq!(r.floor, 29 - 10);
        let answer = Answer {
            reserved: r.floor,
            ..Answer::default()
        };
        assert!(settle(&cell, &mut books, &p, &r, &answer, u64::MAX, 0));
        // Beyond what the node spent, a refund stops at zero: nothing is minted.
        cell.settle(&policy, 3, Settle::Refund(1_000));
        let r = collect(&cell, &mut books, &p, 3, 150_000_000, false, 0, Some(0));
        assert_eq!(r.floor, 0);
    }

    /// A cold key settles on its share's GCRA: a refund gives units back at once (not
    /// beyond a whole share), a charge beyond it leaves the key in debt and wanting to
    /// turn hot, and turning hot reports the debt as in use.
    #[test]
    fn a_cold_key_settles_on_its_share_and_reports_its_debt_when_hot() {
        use crate::algorithm::Settle;
        use crate::store::state::State;
        const SECOND: u64 = 1_000_000_000;
        // 100/s shared by 2 nodes: 50 at once and one per 20 ms here.
        let mut policy =
            SyncPolicy::new(crate::Quota::per_second(100).unwrap(), 100, 0, SECOND / 20);
        policy.cold = super::super::cell::Cold::share(100, 10_000, 2, false, 10 * SECOND);
        let cell = SyncCell::fresh(&policy);
        let t_ns = 20_000_000;
        let now = SECOND;
        for _ in 0..50 {
            assert!(cell.check(&policy, now, 1, u64::MAX).is_allowed());
        }
        assert!(!cell.check(&policy, now, 1, u64::MAX).is_allowed());
        cell.hot.flags.fetch_and(!WANT_HOT, Ordering::AcqRel);
        cell.settle(&policy, now, Settle::Refund(5));
        for _ in 0..5 {
            assert!(cell.check(&policy, now, 1, u64::MAX).is_allowed());
        }
        assert!(!cell.check(&policy, now, 1, u64::MAX).is_allowed());
        cell.settle(&policy, now, Settle::Refund(1_000));
        assert_eq!(cell.peek(&policy, now, 1).remaining(), 50);
        cell.hot.flags.fetch_and(!WANT_HOT, Ordering::AcqRel);
        // 50 whole, a charge of 80: 30 in debt.
        cell.settle(&policy, now, Settle::Charge(80));
        assert_ne!(cell.hot.flags.load(Ordering::Acquire) & WANT_HOT, 0);
        let mut books = Books::default();
        assert!(turn_hot(&cell, &mut books, t_ns, now));
        assert_eq!(books.spent, 80);
    }

    /// A key returning cold starts its share with what it holds of its lease: the rest of
    /// the share's burst, and what it admitted on its overdraft since the round, are in
    /// use (its GCRA stands that many tokens ahead). One holding no token stays hot.
    #[test]
    fn a_key_returns_cold_with_its_lease_as_its_share() {
        use crate::store::state::State;
        const SECOND: u64 = 1_000_000_000;
        // 100/s shared by 2 nodes: 50 at once and one per 20 ms here.
        let mut policy =
            SyncPolicy::new(crate::Quota::per_second(100).unwrap(), 100, 0, SECOND / 20);
        policy.cold = super::super::cell::Cold::share(100, 10_000, 2, false, 10 * SECOND);
        let cold = policy.cold.unwrap();
        let cell = cell();
        let mut books = Books::default();
        let now = SECOND;
        assert!(
            !turn_cold(&cell, &mut books, &cold, now),
            "it holds nothing"
        );
        // 20 of the lease held; 3 admitted on the overdraft since the round.
        cell.hot.allowance.store(20, Ordering::Release);
        books.overdraft_base = 4;
        cell.hot.overdraft.store(1, Ordering::Release);
        assert!(turn_cold(&cell, &mut books, &cold, now));
        assert!(is_cold(&cell));
        assert_eq!(
            cell.cold_tat.load(Ordering::Acquire),
            now + (50 - 20 + 3) * 20_000_000
        );
        for _ in 0..17 {
            assert!(cell.check(&policy, now, 1, u64::MAX).is_allowed());
        }
        assert!(!cell.check(&policy, now, 1, u64::MAX).is_allowed());
    }

    /// The fallback: at the key's share while Redis reserves it, then a one-time budget,
    /// then nothing; a budget handed out while a round was in flight is not lost when its
    /// answer comes (it goes into the next floor, as the node's own debt); and while the
    /// node still owes, a new outage gets no new budget.
    #[test]
    fn the_fallback_spends_its_share_then_one_budget() {
        let p = NodeParams {
            interval_ns: 100_000_000,
            ..params()
        };
        let cell = cell();
        let mut books = cell.hot.aside.books.lock();
        books.share = WEIGHT_ONE / 2;
        books.share_until = 1_000_000_000;
        // 100/s at half the rate: 5 tokens per 100 ms interval.
        refill_locally(&cell, &mut books, &p, 2, 500_000_000);
        assert_eq!((books.local, books.beyond), (5, 0));
        // Past the share's end: the budget (⌊100 / 2⌋) once, then nothing.
        cell.hot.allowance.store(0, Ordering::Release);
        refill_locally(&cell, &mut books, &p, 2, 1_000_000_000);
        assert_eq!((books.local, books.beyond), (55, 50));
        refill_locally(&cell, &mut books, &p, 2, 1_100_000_000);
        assert_eq!(books.local, 55);
        // A round collected now reports them; the answer comes after 10 more were
        // handed out (by a budget of a later outage, say): they stay on the books.
        cell.hot.allowance.store(0, Ordering::Release);
        let r = collect(&cell, &mut books, &p, 1, 1_200_000_000, false, 0, Some(0));
        assert_eq!((r.local, r.beyond), (55, 50));
        books.local += 10;
        books.beyond += 10;
        let answer = Answer {
            reserved: r.floor,
            owes: 50,
            ..Answer::default()
        };
        assert!(settle(
            &cell,
            &mut books,
            &p,
            &r,
            &answer,
            u64::MAX,
            2_000_000_000
        ));
        assert_eq!((books.local, books.beyond), (10, 10));
        // Still owing: once the share ends again, no new budget.
        assert!(books.budget_spent);
        refill_locally(&cell, &mut books, &p, 2, 3_000_000_000);
        assert_eq!(books.local, 10);
    }

    /// A key released without a round gives up its lease, but only with nothing to
    /// report: a token spent since the last round (even one racing with the release)
    /// keeps it in use.
    #[test]
    fn a_key_is_released_locally_only_with_nothing_to_report() {
        let cell = cell();
        let mut books = cell.hot.aside.books.lock();
        cell.hot.allowance.store(3, Ordering::Release);
        books.lease_base = 3;
        cell.hot.overdraft.store(2, Ordering::Release);
        books.overdraft_base = 2;
        // One token spent since the last round: it must be reported first.
        cell.hot.allowance.store(2, Ordering::Release);
        assert!(!release_locally(&cell, &mut books));
        assert_eq!(cell.hot.allowance.load(Ordering::Acquire), 2);
        // A round pending: its answer must be applied first.
        cell.hot.allowance.store(3, Ordering::Release);
        books.pending = true;
        assert!(!release_locally(&cell, &mut books));
        books.pending = false;
        assert!(release_locally(&cell, &mut books));
        assert_eq!(cell.hot.allowance.load(Ordering::Acquire), 0);
        assert_eq!(cell.hot.overdraft.load(Ordering::Acquire), 0);
        assert!(books.released);
        drop(books);
        assert!(cell.is_released());
    }

    #[test]
    fn before_redis_is_measured_a_round_has_no_deadline_nor_anchor() {
        let p = NodeParams {
            timeout_ns: 200_000_000,
            ..params()
        };
        let cell = cell();
        let mut books = Books {
            last_ok: 5,
            ..Books::default()
        };
        let r = collect(&cell, &mut books, &p, 1, 1_000, false, 0, None);
        assert_eq!((r.deadline, r.anchor), (0, 0));
        // Once measured, both are in Redis's clock.
        let r = collect(
            &cell,
            &mut books,
            &p,
            2,
            1_000,
            false,
            0,
            Some(1_000_000_000),
        );
        assert_eq!(r.deadline, (1_000 + 200_000_000 + 1_000_000_000) / 1_000);
        assert_eq!(r.anchor, (5 + 1_000_000_000) / 1_000);
    }

    #[test]
    fn an_idle_key_gives_everything_back_and_is_released() {
        let p = params();
        let cell = cell();
        let mut books = cell.hot.aside.books.lock();
        cell.hot.allowance.store(3, Ordering::Release);
        books.lease_base = 3;
        books.last_active = 1;
        books.demand = WEIGHT_ONE;
        let now = p.idle_ns + 10;
        assert_eq!(need(&cell, &books, &p, now), Some(Need::Release));
        let r = collect(&cell, &mut books, &p, 7, now, false, 0, Some(0));
        assert_eq!((r.floor, r.keep, r.want), (0, 0, 0));
        let answer = Answer {
            reserved: 0,
            ..Answer::default()
        };
        assert!(settle(&cell, &mut books, &p, &r, &answer, u64::MAX, 0));
        assert_eq!(need(&cell, &books, &p, now), None);
        drop(books);
        assert!(cell.is_released());
        // A check after the release makes it a key in use again.
        cell.want(now);
        assert!(!cell.is_released());
    }
}
