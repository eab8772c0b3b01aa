//! The server side of a sync round, `serve`: the specification that the round script
//! (`redis/lua/sync_round.lua`) implements step by step. Compiled for tests only: the deterministic
//! simulation runs it as its Redis, and the differential test checks the script against
//! it on a real redis-server. See [`super::protocol`] for the arithmetic it follows.

use std::collections::{BTreeMap, HashMap};

use redis::Value;

use super::protocol::{Answer, MAX_DEMAND, Params, Request, Shape, SharedQuota, WEIGHT_ONE, scale};
use super::wire::{
    Args, Command, HotCall, HotReply, RoundCall, RoundReply, Script, SettingsCall, SettingsReply,
    WireError, parse_id,
};

impl Shape {
    /// What the global state holds at most, in ticks.
    pub(crate) fn capacity_ticks(self) -> u64 {
        match self {
            Self::TokenBucket { t, tau } => tau + t,
            Self::SlidingWindow { limit, .. } | Self::FixedWindow { limit, .. } => {
                limit * self.ticks_per_token()
            }
        }
    }
}

/// A node's own debt is repaid at `1 / REPAY_PACE` of its share's pace: the rest of its
/// share it still leases, so that the rate after a partition heals stays near the limit.
const REPAY_PACE: u64 = 8;
/// The most a quota change carries over, in µs of the new quota (71 years).
const AHEAD: u64 = 1 << 51;
/// Credit accrues over at most this many µs (the cap is reached long before).
const MAX_ELAPSED: u64 = 1 << 32;

/// The global state of one key. The token bucket uses `tat`; the sliding window the
/// window number `window`, and the counts of the previous and current windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Global {
    /// The GCRA theoretical arrival time (µs); 0 for a key Redis does not hold.
    pub(crate) tat: u64,
    /// The sliding window's current window number, if Redis holds one.
    pub(crate) window: Option<u64>,
    pub(crate) prev: u64,
    pub(crate) cur: u64,
    /// The key's own quota (the default's, version 0, unless one was set).
    pub(crate) quota: SharedQuota,
}

/// What Redis keeps for one node of one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// The last sequence number applied.
    pub(crate) seq: u64,
    /// What the node's floor and lease add up to: charged to the global state.
    pub(crate) reserved: u64,
    /// Ticks the node may still lease (its fair share, accrued).
    pub(crate) credit: u64,
    pub(crate) credit_at: u64,
    /// The node's demand (a weight) and when it reported it.
    pub(crate) demand: u64,
    pub(crate) demand_at: u64,
    /// The sliding window in which the node's reservation was last changed.
    pub(crate) window: u64,
    /// Which of the node's books for the key the record belongs to (a key dropped and
    /// seen again on a node starts new books, counting from 0).
    pub(crate) epoch: u64,
    /// What the node asked for beyond its grant in its last round: whether it still
    /// wants tokens.
    pub(crate) unmet: u64,
    /// The overdraft the node was last handed (reconcile mode): the other nodes' rooms
    /// leave it out, so that overdrafts outstanding never add up past one room.
    pub(crate) overdraft: u64,
    /// The share of the rate (a weight) reserved for the node, and until when (µs), should
    /// it fall silent: an even split among the registry's nodes, out of what the other
    /// nodes' unexpired reservations leave (so that they never add up past the rate).
    pub(crate) share: u64,
    pub(crate) until: u64,
    /// Up to when (µs) the silent node's share has been charged on its behalf, and the
    /// ticks charged so since its last round.
    pub(crate) charged_to: u64,
    pub(crate) prepaid: u64,
    /// Of `prepaid`, the ticks that took capacity from the present when charged (the
    /// token bucket's `tat` went past `now` by them): what of the prepaid the node did
    /// not use goes back up to this, never more (a charge that fell into the past took
    /// nothing from anyone).
    pub(crate) landed: u64,
    /// Where `tat` stood after the last charge on the node's behalf: only what of that
    /// charge is still ahead of `now` can go back (capacity past cannot be returned).
    pub(crate) landed_end: u64,
    /// Ticks the node's fallback admitted after its share ran out: its own debt, repaid
    /// at an eighth of its share's pace.
    pub(crate) owes: u64,
    /// 1 if the node's last round reported tokens its local fallback handed out (so its
    /// answers are not reaching it, or were not until that round): Redis then charges its
    /// reserved share as it does a silent node's, and does not extend it.
    pub(crate) fallback: u64,
}

/// One key as Redis holds it: the global state and each node's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyState {
    pub(crate) global: Global,
    /// Each node's record, by node id.
    pub(crate) nodes: BTreeMap<u64, Record>,
}

/// Max-min fair shares of the rate among `demands`: the water level `L` is the largest
/// with `Σ min(d, L) ≤ WEIGHT_ONE`, and a node gets `min(d, L)`; when every demand fits,
/// the spare is split evenly on top.
///
/// Every node gets at least the equal share `WEIGHT_ONE / n` (the level is never below
/// it): a node whose demand is underestimated still gets an even split, and a node that
/// does not use it strands nothing, since a node that wants nothing binds no one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shares {
    level: u64,
    /// Every demand fits: each gets its demand plus `spare`.
    fits: bool,
    spare: u64,
    equal: u64,
}

impl Shares {
    pub(crate) fn new(demands: &[u64]) -> Self {
        Self::of_total(demands, WEIGHT_ONE)
    }

    /// The shares of `total` (a weight: what silent nodes' reserved shares leave).
    pub(crate) fn of_total(demands: &[u64], total: u64) -> Self {
        let mut sorted: Vec<u64> = demands.to_vec();
        sorted.sort_unstable();
        let equal = total / (sorted.len() as u64).max(1);
        let mut remaining = total;
        let mut left = sorted.len() as u64;
        for &d in &sorted {
            let level = remaining / left;
            if d > level {
                return Self {
                    level,
                    fits: false,
                    spare: 0,
                    equal,
                };
            }
            remaining -= d;
            left -= 1;
        }
        Self {
            level: 0,
            fits: true,
            spare: remaining / (sorted.len() as u64).max(1),
            equal,
        }
    }

    /// The share (a weight) of a node with demand `d`.
    pub(crate) fn of(&self, d: u64) -> u64 {
        if self.fits {
            (d + self.spare).max(self.equal)
        } else {
            d.max(self.equal).min(self.level)
        }
    }
}

/// The credit cap (ticks) of a node with share `weight`: its share of what the global
/// state can hold (or of the holding horizon, if that is more), and at least one token.
/// Credit accrues at the rate in total and under contention no node takes more than its
/// credit, so while the caps add up to no more than the global state holds, every token
/// of credit is backed by one in the global state: a node with credit never finds it
/// empty because others were quicker.
fn credit_cap(weight: u64, capacity_ticks: u64, hold: u64, ticks: u64) -> u64 {
    ticks.max(scale(capacity_ticks.max(hold), weight))
}

/// A record's credit accrued to `now` at `weight`, capped.
fn accrued(record: &Record, weight: u64, cap: u64, now: u64) -> u64 {
    let since = now.saturating_sub(record.credit_at).min(MAX_ELAPSED);
    cap.min(record.credit + scale(since, weight))
}

/// Whole tokens the global state holds at `now` (0 in debt).
fn available(shape: Shape, g: &Global, now: u64, elapsed: u64) -> u64 {
    match shape {
        Shape::TokenBucket { t, tau } => {
            let tat = g.tat.max(now);
            let left = tau + t;
            if tat - now >= left {
                0
            } else {
                (left - (tat - now)) / t
            }
        }
        Shape::SlidingWindow { limit, period } => {
            let weighted = (g.prev * (period - elapsed)).div_ceil(period);
            limit.saturating_sub(g.cur + weighted)
        }
        Shape::FixedWindow { limit, .. } => limit.saturating_sub(g.cur),
    }
}

/// Whole tokens the global state holds at `now` plus what it refills over `horizon` µs,
/// less any debt (0 if the debt is larger).
fn room(shape: Shape, g: &Global, now: u64, elapsed: u64, horizon: u64) -> u64 {
    match shape {
        Shape::TokenBucket { t, tau } => {
            let ahead = g.tat.max(now) - now;
            (tau + t + horizon).saturating_sub(ahead) / t
        }
        Shape::SlidingWindow { limit, period } => {
            available(shape, g, now, elapsed) + limit * horizon.min(period) / period
        }
        // The fixed window refills only when the next one starts: nothing is counted
        // on it.
        Shape::FixedWindow { .. } => available(shape, g, now, elapsed),
    }
}

/// Runs one node's round for one key at Redis time `now` (µs), updating `state`.
///
/// The steps, in order (the script follows them one for one):
/// 1. drop the records of nodes gone for the retention time;
/// 2. ignore a round at or below the node's last;
/// 3. (the windows) roll the windows forward to `now`;
/// 4. charge the shares reserved for silent nodes, up to `now` (or their end);
/// 5. charge the floor beyond the node's reservation and what was charged on its behalf
///    (its fallback's tokens past its share: to its own debt), or refund what it
///    returned;
/// 6. share what the silent nodes' reservations leave max-min fairly among the demands
///    of the live nodes, accrue the node's credit at its share, and repay its debt;
/// 7. lease: while another node wants tokens and has credit for one, by credit, out of
///    what the global state holds beyond what the nodes ahead of this one (in credit per
///    share) need to catch up; else whatever the global state holds (work-conserving);
///    nothing while the node owes;
/// 8. (reconcile) hand out an overdraft;
/// 9. reserve the node's share until `now + share_ttl` (if it holds or wants anything).
///
/// `heard` is the node registry as the caller last read it: each node's last heartbeat,
/// in ms of Redis's clock.
pub(crate) fn serve(
    params: &Params,
    state: &mut KeyState,
    node: u64,
    request: &Request,
    now: u64,
    heard: &impl Heard,
) -> Answer {
    // 1.
    prune(state, now.saturating_sub(params.retain_ms * 1_000));
    // 2.
    let stored = state.nodes.get(&node).copied();
    if let Some(record) = stored {
        if request.seq <= record.seq {
            return Answer {
                reserved: record.reserved,
                stale: true,
                ..Answer::default()
            };
        }
    }
    // The key's quota: the higher of Redis's and the node's.
    let quota = state.global.quota.max(request.quota);
    if quota != state.global.quota {
        let from = state.global.quota.shape(params.shape);
        convert(state, from, quota.shape(params.shape), params.hold, now);
        state.global.quota = quota;
    }
    let shape = quota.shape(params.shape);
    let ticks = shape.ticks_per_token();
    let stored = state.nodes.get(&node).copied();
    let existing = stored.filter(|r| r.epoch == request.epoch);
    // 3.
    let mut elapsed = 0;
    let mut window = 0;
    if let Some(period) = shape.period() {
        window = now / period;
        elapsed = now - window * period;
        let g = &mut state.global;
        match g.window {
            Some(w) if w == window => {}
            Some(w) if w + 1 == window => (g.prev, g.cur) = (g.cur, 0),
            Some(w) if w > window => elapsed = 0,
            _ => (g.prev, g.cur) = (0, 0),
        }
        if g.window.is_none_or(|w| w < window) {
            g.window = Some(window);
        }
        window = g.window.unwrap_or(window);
    }
    // 4.
    let cutoff = now.saturating_sub(params.demand_ttl);
    let silent = now.saturating_sub(params.silent_after);
    let last_heard = |id: u64, r: &Record| {
        r.demand_at
            .max(heard.last_ms(id).map_or(0, |ms| ms.saturating_mul(1_000)))
    };
    for (id, r) in state.nodes.iter_mut() {
        let last = last_heard(*id, r);
        let quiet = last < silent;
        if *id == node || !(quiet || r.fallback == 1) {
            continue;
        }
        // A silent node's share is charged from when it fell silent; the share of a node
        // in its fallback (heard, but not hearing), from its last round.
        let from = if quiet {
            r.charged_to.max(last + params.silent_after)
        } else {
            r.charged_to
        };
        let to = now.min(r.until);
        if to <= from || r.share == 0 {
            continue;
        }
        let charge = scale(to - from, r.share);
        let g = &mut state.global;
        match shape {
            Shape::TokenBucket { .. } => {
                let before = g.tat.max(now);
                g.tat = g.tat.max(from) + charge;
                r.landed += g.tat.saturating_sub(before);
                r.landed_end = g.tat;
            }
            Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => {
                g.cur += (r.prepaid + charge) / ticks - r.prepaid / ticks;
            }
        }
        r.prepaid += charge;
        r.charged_to = to;
    }
    // A node back from silence (neither a round on the key nor a heartbeat for the
    // silence), or whose share was charged on its behalf since its last round (it fell
    // silent, or was in its fallback), accrued no credit meanwhile: its share of that
    // time was charged, or the others' to take (and taken, by a work-conserving lease).
    let away = existing.is_some_and(|r| last_heard(node, &r) < silent);
    let returning = away || existing.is_some_and(|r| r.charged_to > r.demand_at);
    let mut record = existing.unwrap_or(Record {
        reserved: request.known
            + request
                .local
                .min(request.floor.saturating_sub(request.known)),
        window,
        epoch: request.epoch,
        ..Record::default()
    });
    // 5. What the node reports beyond its reservation comes first out of what was
    // charged on its behalf; its fallback's tokens past its share are its own debt; the
    // rest is charged. A round it gave up on (late: queued in a paused Redis) reports
    // what it had admitted when it was sent, so what is left of the prepaid stays for its
    // later rounds; an on-time round ends the outage, and the rest is dropped.
    // A window counter's lease (lease mode) is void once its window ends: what the node
    // kept of a lease reserved in an earlier window goes back to that window (as a
    // refund), the node drops it (the answer says so), and it may ask for as much anew.
    let void = if params.overdraft_horizon == 0
        && shape.period().is_some()
        && existing.is_some_and(|r| r.window < window)
    {
        request.keep
    } else {
        0
    };
    let floor = request.floor - void;
    let keep = request.keep - void;
    let want = request.want + void;
    let g = &mut state.global;
    let late = request.deadline != 0 && now > request.deadline;
    let mut charged = 0;
    if floor > record.reserved {
        let extra = floor - record.reserved;
        let prepaid = extra.min(record.prepaid / ticks);
        record.prepaid -= prepaid * ticks;
        let rest = extra - prepaid;
        let own = rest.min(request.beyond);
        record.owes = record.owes.saturating_add(own.saturating_mul(ticks));
        charged = rest - own;
        match shape {
            Shape::TokenBucket { t, .. } => {
                // Spread back from the last acknowledged round: rounds queued in a paused
                // Redis (late) all do; an on-time round that follows one Redis applied
                // but whose answer was lost reports only what was admitted since that
                // one, so no further back than it.
                let mut from = if request.anchor == 0 {
                    now
                } else {
                    request.anchor.min(now)
                };
                if !late {
                    from = from.max(existing.map_or(0, |r| r.demand_at).min(now));
                }
                if charged > 0 {
                    g.tat = g.tat.max(from) + charged * t;
                }
            }
            Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => g.cur += charged,
        }
    } else if floor < record.reserved {
        // What the node gives back of its lease. (What was charged on its behalf and
        // not used is not refunded: it was capacity reserved, and may have served no
        // one since; refunding it now could hand it out twice.)
        let refund = record.reserved - floor;
        match shape {
            // Into a full bucket a refund has nowhere to go; a past `tat` (room for
            // charges spread back) is left as it is.
            Shape::TokenBucket { t, .. } => {
                if g.tat > now {
                    g.tat = g.tat.saturating_sub(refund * t).max(now);
                }
            }
            Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => {
                if record.window == window {
                    g.cur = g.cur.saturating_sub(refund);
                } else if record.window + 1 == window {
                    g.prev = g.prev.saturating_sub(refund);
                }
            }
        }
    }
    if !late {
        // What the node did not use of its prepaid share goes back, as far as it took
        // capacity from the present.
        let unused = record
            .prepaid
            .min(record.landed)
            .min(record.landed_end.saturating_sub(now));
        if unused > 0 && g.tat > now {
            g.tat = g.tat.saturating_sub(unused).max(now);
        }
        record.prepaid = 0;
        record.landed = 0;
        record.landed_end = 0;
    }
    record.charged_to = now;
    // 6.
    record.demand = request.demand.min(MAX_DEMAND);
    record.demand_at = now;
    let others: Vec<&Record> = state
        .nodes
        .iter()
        .filter(|(id, r)| **id != node && r.demand_at >= cutoff)
        .map(|(_, r)| r)
        .collect();
    let reserved_shares: u64 = state
        .nodes
        .iter()
        .filter(|(id, r)| {
            **id != node
                && r.demand_at < cutoff
                && (last_heard(**id, r) < silent || r.fallback == 1)
                && r.until > now
        })
        .map(|(_, r)| r.share)
        .sum();
    let mut demands: Vec<u64> = others.iter().map(|r| r.demand).collect();
    demands.push(record.demand);
    let shares = Shares::of_total(&demands, WEIGHT_ONE.saturating_sub(reserved_shares));
    let weight = shares.of(record.demand);
    let capacity = shape.capacity_ticks();
    let cap = credit_cap(weight, capacity, params.hold, ticks);
    if returning {
        record.credit_at = now;
    }
    let since = now.saturating_sub(record.credit_at).min(MAX_ELAPSED);
    // A node new to the key starts with one token of credit, like any other.
    record.credit = if existing.is_none() {
        ticks
    } else {
        accrued(&record, weight, cap, now)
    };
    // What the node admitted beyond its reservation (its overdraft) was its credit's.
    record.credit = record.credit.saturating_sub(charged.saturating_mul(ticks));
    record.credit_at = now;
    // Its debt is repaid out of its own credit, at an eighth of its share's pace (it
    // still leases with the rest), and charged to the global state as it is: the
    // others' shares are untouched, the rate right after a partition heals stays near
    // the limit (at least 7/8 of it), and the long-run rate still converges to it.
    let repaid = record.owes.min(scale(since, weight) / REPAY_PACE);
    if repaid > 0 {
        let whole = |owes: u64| owes.div_ceil(ticks);
        let tokens = whole(record.owes) - whole(record.owes - repaid);
        record.owes -= repaid;
        record.credit = record.credit.saturating_sub(repaid);
        let g = &mut state.global;
        match shape {
            Shape::TokenBucket { .. } => g.tat = g.tat.max(now) + repaid,
            Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => g.cur += tokens,
        }
    }
    // 7. Under contention (another node wants tokens and has credit for one) a node
    // leases by its credit, out of what the global state holds beyond what the wanting
    // nodes ahead of it in credit per share need to catch up. (Each gap is floored to
    // whole ticks from a double, as the script computes it, so that the sum does not
    // depend on the order.)
    let mut contended = false;
    let mut owed = 0u64;
    for r in &others {
        let w = shares.of(r.demand);
        let credit = accrued(r, w, credit_cap(w, capacity, params.hold, ticks), now);
        if r.unmet > 0 && credit >= ticks {
            contended = true;
            let level = (record.credit as f64 * w as f64 / weight.max(1) as f64).floor() as u64;
            owed += credit.saturating_sub(level);
        }
    }
    let g = &mut state.global;
    let avail = available(shape, g, now, elapsed);
    // A node holds at most its share of the holding horizon, plus one token to spend
    // while it waits for the next.
    let hold_cap = 2 + scale(params.hold, weight) / ticks;
    let by_credit = if contended {
        (record.credit / ticks).min(avail.saturating_sub(owed / ticks))
    } else {
        avail
    };
    let grant = if late {
        0
    } else {
        want.min(avail)
            .min(by_credit)
            .min(hold_cap.saturating_sub(keep))
    };
    record.credit = record.credit.saturating_sub(grant * ticks);
    record.unmet = want - grant;
    if grant > 0 {
        match shape {
            Shape::TokenBucket { t, .. } => g.tat = g.tat.max(now) + grant * t,
            Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => g.cur += grant,
        }
    }
    // 8.
    let overdraft = if params.overdraft_horizon > 0 && !late {
        // What the global state holds after the lease, plus its refill until the node's
        // next round (in debt, the refill first repays it), in whole tokens, shared with
        // the overdrafts already out; under contention at least the node's share of it
        // (so that a scarce room still reaches every node), and no more than the node's
        // credit will cover by then (each node's credit caps its own). (Each node's
        // whole room, added up over the nodes, overdraws the global state: the nodes
        // then all stand idle while the debt is repaid, and the rate swings.)
        let room = room(shape, g, now, elapsed, params.overdraft_horizon);
        let lent: u64 = others.iter().map(|r| r.overdraft).sum();
        let left = room.saturating_sub(lent);
        if contended {
            let by_then = record.credit + scale(params.overdraft_horizon, weight);
            left.max(scale(room, weight)).min(by_then / ticks)
        } else {
            left
        }
    } else {
        0
    };
    // 9. The reservation is an even split of the rate among the registry's nodes, out
    // of what the others' unexpired reservations leave: reservations never add up past
    // the rate, so what silent nodes admit on theirs never adds up past it either.
    let holds = request.demand > 0 || keep > 0 || grant > 0;
    // A node in its fallback goes by the share and end of the last answer it received:
    // its reservation is neither renewed nor changed until a round reports no fallback.
    let fallback = request.local > 0 && existing.is_some();
    record.fallback = u64::from(request.local > 0);
    let others_reserved: u64 = state
        .nodes
        .iter()
        .filter(|(id, r)| **id != node && r.until > now)
        .map(|(_, r)| r.share)
        .sum();
    let nodes = (heard.live() as u64).max(1);
    if !fallback {
        record.share = if holds {
            (WEIGHT_ONE / nodes).min(WEIGHT_ONE.saturating_sub(others_reserved))
        } else {
            0
        };
        record.until = if holds {
            now.saturating_add(params.share_ttl)
        } else {
            now
        };
    }
    record.overdraft = overdraft;
    record.seq = request.seq;
    record.reserved = floor + grant;
    record.window = window;
    state.nodes.insert(node, record);
    Answer {
        grant,
        overdraft,
        reserved: record.reserved,
        stale: false,
        share: record.share,
        until: record.until,
        owes: record.owes.div_ceil(ticks),
        void,
        quota,
    }
}

/// Converts a key's state from quota `from` to quota `to` at `now`, never handing out
/// capacity: the token bucket keeps the whole tokens it had in use (rounded up; they
/// include the leases the nodes hold, which stay spendable); a window counter keeps its
/// counts, and when the period changes counts both windows' in the current one
/// (renumbered). The records' debt is kept in whole tokens (rounded up), their credit
/// too (rounded down, at most the new capacity or holding horizon), and what was
/// prepaid on their behalf is dropped (what they admitted meanwhile is charged again).
/// Whole tokens are capped at [`AHEAD`] µs of the new quota, so that the script's
/// doubles stay exact.
fn convert(state: &mut KeyState, from: Shape, to: Shape, hold: u64, now: u64) {
    if from == to {
        return;
    }
    let g = &mut state.global;
    if let (Shape::TokenBucket { t, .. }, Shape::TokenBucket { t: t2, .. }) = (from, to) {
        if g.tat > now {
            g.tat = now + (g.tat - now).div_ceil(t).min(AHEAD / t2) * t2;
        }
    }
    let renumbered = from.period() != to.period();
    if let (true, Some(period), Some(_)) = (renumbered, to.period(), g.window) {
        g.window = Some(now / period);
        g.cur += g.prev;
        g.prev = 0;
    }
    let (old, new) = (from.ticks_per_token(), to.ticks_per_token());
    let most = to.capacity_ticks().max(hold) / new;
    for r in state.nodes.values_mut() {
        if renumbered {
            r.window = g.window.unwrap_or(0);
        }
        r.credit = (r.credit / old).min(most) * new;
        r.owes = r.owes.div_ceil(old).min(AHEAD / new) * new;
        r.prepaid = 0;
        r.landed = 0;
        r.landed_end = 0;
    }
}

/// Drops the records of nodes not heard from since `cutoff` (µs), as the scripts do.
pub(crate) fn prune(state: &mut KeyState, cutoff: u64) {
    state
        .nodes
        .retain(|_, r| r.demand_at.max(r.credit_at) >= cutoff);
}

/// The node registry as a node read it (the hash the scripts read): which nodes were live
/// and when each last heartbeat.
pub(crate) trait Heard {
    /// When node `id` last heartbeat (ms of Redis's clock), if the registry holds it.
    fn last_ms(&self, id: u64) -> Option<u64>;
    /// How many nodes the registry holds.
    fn live(&self) -> usize;
}

/// The registry as a round call carries it: node ids and their ms, sorted by id.
struct Listed<'a>(&'a [(u64, u64)]);

impl Heard for Listed<'_> {
    fn last_ms(&self, id: u64) -> Option<u64> {
        let at = self.0.binary_search_by_key(&id, |&(id, _)| id).ok()?;
        Some(self.0[at].1)
    }

    fn live(&self) -> usize {
        self.0.len()
    }
}

/// The registry as the scripts return it: node id to ms.
impl Heard for BTreeMap<u64, u64> {
    fn last_ms(&self, id: u64) -> Option<u64> {
        self.get(&id).copied()
    }

    fn live(&self) -> usize {
        self.len()
    }
}

/// The numbers the scripts keep exact (their doubles' integers).
const EXACT: u64 = 1 << 53;

/// Redis as the sync's scripts use it, as one model: the node registries, the
/// announcements of keys turned hot, and each limiter key's state. It runs the
/// [`Command`]s a node sends, decoding them with [`wire`](super::wire) as the scripts read
/// them, and answers as the scripts do, encoded with `wire` too; the deterministic
/// simulation runs it as its Redis, and the differential test runs the real scripts
/// beside it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Server {
    /// Each registry (a sorted set): node id to its last heartbeat (ms).
    registries: HashMap<Vec<u8>, BTreeMap<u64, u64>>,
    /// Each set of announcements (a sorted set): member to until when it lasts (ms).
    announcements: HashMap<Vec<u8>, BTreeMap<Vec<u8>, u64>>,
    /// Each limiter key's state (a hash).
    keys: HashMap<Vec<u8>, KeyState>,
    /// Each prefix's settings (a hash).
    settings: HashMap<Vec<u8>, Terms>,
}

/// A prefix's settings hash: each field with when it was written (ms) and its terms.
type Terms = BTreeMap<Vec<u8>, (u64, Vec<u8>)>;

impl Server {
    /// Runs `command` at `now` (µs of Redis's clock): its reply, or the error reply the
    /// script gives for arguments it refuses.
    pub(crate) fn run(&mut self, command: &Command, now: u64) -> Result<Value, WireError> {
        match command.script {
            Script::Round => self.round(&command.keys, &command.args, now),
            Script::HotKeys => self.hot_keys(&command.keys, &command.args, now),
            Script::Settings => self.settings(&command.keys, &command.args, now),
            Script::Leave => {
                let invalid = || WireError::invalid("ZREM's arguments");
                let [registry] = &command.keys[..] else {
                    return Err(invalid());
                };
                let node = command
                    .args
                    .iter()
                    .next()
                    .and_then(parse_id)
                    .ok_or_else(invalid)?;
                let removed = self
                    .registries
                    .get_mut(registry)
                    .and_then(|r| r.remove(&node));
                Ok(Value::Int(i64::from(removed.is_some())))
            }
        }
    }

    /// The state Redis holds for the limiter key `key`.
    pub(crate) fn key(&self, key: &[u8]) -> Option<&KeyState> {
        self.keys.get(key)
    }

    /// `sync_round.lua`.
    fn round(&mut self, keys: &[Vec<u8>], args: &Args, now: u64) -> Result<Value, WireError> {
        let invalid = || WireError::invalid("TOLLGATE invalid sync arguments");
        let call = RoundCall::decode(args).map_err(|_| invalid())?;
        let first = usize::from(call.registry_ttl_ms > 0);
        let p = &call.params;
        let (_, a, b) = p.shape.script_args();
        let numbers = [
            call.registry_ttl_ms,
            a,
            b,
            p.overdraft_horizon,
            p.hold,
            p.demand_ttl,
            p.retain_ms,
            p.share_ttl,
            p.silent_after,
            call.seq,
            call.clock_us,
        ];
        if numbers.iter().any(|&n| n >= EXACT) || keys.len() != first + call.requests.len() {
            return Err(invalid());
        }
        for r in &call.requests {
            let q = r.quota;
            let all = [
                r.epoch, r.floor, r.keep, r.known, r.demand, r.want, r.anchor, r.deadline, r.local,
                r.beyond, q.version, q.limit, q.period, q.burst,
            ];
            if all.iter().any(|&n| n >= EXACT)
                || r.keep > r.floor
                || (q.version == 0 && q.limit + q.period + q.burst != 0)
                || !q.fits(p.shape)
            {
                return Err(WireError::invalid("TOLLGATE invalid sync counts"));
            }
        }
        let now = if call.clock_us == 0 {
            now
        } else {
            call.clock_us
        };
        let now_ms = now / 1_000;
        let mut reply = RoundReply {
            server_us: now,
            ..RoundReply::default()
        };
        if first == 1 {
            if !self.registries.contains_key(&keys[0]) {
                self.registries.insert(keys[0].clone(), BTreeMap::new());
            }
            let registry = self.registries.get_mut(&keys[0]).expect("inserted");
            registry.insert(call.node, now_ms);
            registry.retain(|_, &mut ms| ms.saturating_add(call.registry_ttl_ms) > now_ms);
            reply.nodes = registry.len() as u64;
            // In the script's order: by score, then by member (16 hex digits sort as the
            // ids do).
            let mut listed: Vec<(u64, u64)> = registry.iter().map(|(&id, &ms)| (id, ms)).collect();
            listed.sort_by_key(|&(id, ms)| (ms, id));
            reply.registry = listed;
        }
        let mut heard = call.heard.clone();
        heard.sort_unstable();
        let heard = Listed(&heard);
        for (key, request) in keys[first..].iter().zip(&call.requests) {
            if !self.keys.contains_key(key) {
                self.keys.insert(key.clone(), KeyState::default());
            }
            let state = self.keys.get_mut(key).expect("inserted");
            reply
                .answers
                .push(serve(p, state, call.node, request, now, &heard));
        }
        Ok(reply.encode())
    }

    /// `sync_settings.lua`.
    fn settings(&mut self, keys: &[Vec<u8>], args: &Args, now: u64) -> Result<Value, WireError> {
        let invalid = || WireError::invalid("TOLLGATE invalid settings arguments");
        let ([key], Ok(call)) = (keys, SettingsCall::decode(args)) else {
            return Err(invalid());
        };
        if call.stale_ms == 0 {
            return Err(invalid());
        }
        let now_ms = now / 1_000;
        let hash = self.settings.entry(key.clone()).or_default();
        if !call.terms.is_empty() {
            hash.insert(call.field.into_bytes(), (now_ms, call.terms.into_bytes()));
        }
        hash.retain(|_, (at, _)| now_ms - (*at).min(now_ms) <= call.stale_ms);
        let entries = hash
            .iter()
            .map(|(field, (_, terms))| (field.clone(), terms.clone()))
            .collect();
        Ok(SettingsReply { entries }.encode())
    }

    /// `sync_hot_keys.lua`.
    fn hot_keys(&mut self, keys: &[Vec<u8>], args: &Args, now: u64) -> Result<Value, WireError> {
        let invalid = || WireError::invalid("TOLLGATE invalid hot-key arguments");
        let ([key], Ok(call)) = (keys, HotCall::decode(args)) else {
            return Err(invalid());
        };
        if call.lifetime_ms == 0 || call.lifetime_ms >= EXACT || call.from_ms >= EXACT {
            return Err(invalid());
        }
        let now_ms = now / 1_000;
        let set = self.announcements.entry(key.clone()).or_default();
        for member in &call.announce {
            set.insert(member.clone(), now_ms + call.lifetime_ms);
        }
        set.retain(|_, &mut until| until > now_ms);
        let from = call.from_ms.max(now_ms + 1);
        let mut read: Vec<(Vec<u8>, u64)> = set
            .iter()
            .filter(|&(_, &until)| until >= from)
            .map(|(member, &until)| (member.clone(), until))
            .collect();
        read.sort_by(|x, y| (x.1, &x.0).cmp(&(y.1, &y.0)));
        Ok(HotReply { now_ms, read }.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round with no node registry: every other node is known by its rounds only.
    fn serve(p: &Params, state: &mut KeyState, node: u64, request: &Request, now: u64) -> Answer {
        super::serve(p, state, node, request, now, &BTreeMap::new())
    }

    const TB: Shape = Shape::TokenBucket {
        t: 10_000,
        tau: 10_000 * 99,
    };

    fn params(reconcile: bool) -> Params {
        Params {
            shape: TB,
            overdraft_horizon: if reconcile { 10_000 } else { 0 },
            hold: 100_000,
            demand_ttl: 150_000,
            retain_ms: 60_000,
            share_ttl: 0,
            silent_after: 500_000,
        }
    }

    fn request(seq: u64, floor: u64, keep: u64, want: u64) -> Request {
        Request {
            seq,
            floor,
            keep,
            want,
            demand: WEIGHT_ONE,
            ..Request::default()
        }
    }

    #[test]
    fn shares_are_max_min_fair() {
        let one = WEIGHT_ONE;
        let share = |demands: &[u64], mine: u64| Shares::new(demands).of(mine);
        // Everyone saturating: equal shares.
        assert_eq!(share(&[one, one, one, one], one), one / 4);
        // A light node gets its demand, but never less than an even split; the rest
        // split what is left.
        let light = one / 10;
        let demands = [light, one, one];
        assert_eq!(share(&demands, light), one / 3);
        assert_eq!(share(&demands, one), (one - light) / 2);
        // Everything fits: the spare is split evenly on top of each demand.
        assert_eq!(share(&[light, light], light), light + (one - 2 * light) / 2);
        assert_eq!(share(&[0], 0), one);
    }

    /// A key's quota set on one node reaches Redis with its round and every other node
    /// with its answer, and a change hands out no fresh burst: what was used of the old
    /// burst stays used under the new one. A lower version never wins back.
    #[test]
    fn a_key_quota_travels_with_its_rounds_and_hands_out_no_fresh_burst() {
        let p = Params {
            hold: 10_000_000,
            ..params(false)
        };
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        // Node a takes 60 of the default burst of 100.
        let a = serve(&p, &mut state, 0xa, &request(1, 0, 0, 60), now);
        assert_eq!(a.grant, 60);
        assert_eq!(a.quota, SharedQuota::default());
        // Node b sets the key's quota to a burst of 80 at the same rate: 20 are left, not
        // 80.
        let eighty = SharedQuota {
            version: 7,
            limit: 100,
            period: 1_000_000,
            burst: 80,
        };
        let b = serve(
            &p,
            &mut state,
            0xb,
            &Request {
                quota: eighty,
                ..request(1, 0, 0, 1_000)
            },
            now,
        );
        assert_eq!((b.grant, b.quota), (20, eighty));
        // Node a, which does not know it yet, is told.
        let a = serve(&p, &mut state, 0xa, &request(2, 60, 60, 1_000), now);
        assert_eq!((a.grant, a.quota), (0, eighty));
        // An older version (a node that set another quota earlier) does not win back.
        let older = SharedQuota {
            version: 3,
            limit: 1_000,
            period: 1_000_000,
            burst: 1_000,
        };
        let c = serve(
            &p,
            &mut state,
            0xc,
            &Request {
                quota: older,
                ..request(1, 0, 0, 1_000)
            },
            now,
        );
        assert_eq!((c.grant, c.quota), (0, eighty));
        // Back to the default, at a later version: the 80 in use stay in use.
        let back = SharedQuota::default_at(9);
        let c = serve(
            &p,
            &mut state,
            0xc,
            &Request {
                quota: back,
                ..request(2, 0, 0, 1_000)
            },
            now,
        );
        assert_eq!((c.grant, c.quota), (20, back));
    }

    #[test]
    fn a_round_applied_twice_charges_once() {
        let p = params(false);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        let first = serve(&p, &mut state, 0xa, &request(1, 0, 0, 5), now);
        assert_eq!(first.grant, 5);
        let before = state.clone();
        // The same sequence number again (a retry after a lost reply): nothing changes.
        let again = serve(&p, &mut state, 0xa, &request(1, 0, 0, 5), now + 10);
        assert!(again.stale);
        assert_eq!(state, before);
        // The next round reports 3 spent and keeps 2: nothing is charged twice.
        let next = serve(&p, &mut state, 0xa, &request(2, 5, 2, 3), now + 20);
        assert_eq!(next.reserved, 5 + next.grant);
        assert_eq!(state.global.tat, now + (5 + next.grant) * 10_000);
    }

    #[test]
    fn a_round_past_its_deadline_only_charges() {
        let p = params(true);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        let late = Request {
            deadline: now - 1,
            ..request(1, 3, 0, 5)
        };
        let a = serve(&p, &mut state, 0xa, &late, now);
        assert_eq!((a.grant, a.overdraft, a.reserved), (0, 0, 3));
        assert_eq!(state.global.tat, now + 3 * 10_000);
    }

    #[test]
    fn a_lost_answer_is_returned_by_the_next_floor() {
        let p = params(false);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        // The node never saw this grant: its next floor is what it spent (0).
        serve(&p, &mut state, 0xa, &request(1, 0, 0, 5), now);
        let next = serve(&p, &mut state, 0xa, &request(2, 0, 0, 0), now);
        assert_eq!(next.reserved, 0);
        assert_eq!(state.global.tat, now, "the 5 tokens went back");
    }

    #[test]
    fn debt_blocks_leases_and_overdrafts_until_repaid() {
        let p = params(true);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        // 300 admitted beyond any lease: 200 tokens of debt past the burst of 100.
        let a = serve(&p, &mut state, 0xa, &request(1, 300, 0, 10), now);
        assert_eq!((a.grant, a.overdraft), (0, 0));
        let later = now + 2_000_000 - 10_000;
        let b = serve(&p, &mut state, 0xa, &request(2, 300, 0, 10), later);
        assert_eq!((b.grant, b.overdraft), (0, 0), "still 1 token in debt");
        let c = serve(&p, &mut state, 0xa, &request(3, 300, 0, 10), later + 20_000);
        assert_eq!(c.grant, 1);
    }

    #[test]
    fn a_record_lost_by_redis_charges_only_what_is_new() {
        let p = params(false);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        // Redis restarted empty; the node last knew a reservation of 50 and has spent
        // 7 more since (it reports floor 57 with nothing kept).
        let a = serve(
            &p,
            &mut state,
            0xa,
            &Request {
                known: 50,
                ..request(9, 57, 0, 0)
            },
            now,
        );
        assert_eq!(a.reserved, 57);
        assert_eq!(state.global.tat, now + 7 * 10_000);
    }

    #[test]
    fn local_tokens_are_forgiven_only_when_redis_lost_the_record() {
        let p = params(false);
        let now = 1_000_000_000;
        let round = |seq, floor, local| Request {
            local,
            ..request(seq, floor, 0, 0)
        };
        // Redis knows the node (reserved 10): 5 more, all local, are charged.
        let mut state = KeyState::default();
        serve(&p, &mut state, 0xa, &round(1, 10, 0), now);
        let before = state.global.tat;
        serve(&p, &mut state, 0xa, &round(2, 15, 5), now);
        assert_eq!(state.global.tat, before + 5 * 10_000);
        // Redis restarted empty: the 5 local ones are forgiven, the other 2 charged.
        let mut state = KeyState::default();
        let lost = Request {
            known: 10,
            ..round(3, 17, 5)
        };
        let a = serve(&p, &mut state, 0xa, &lost, now);
        assert_eq!(state.global.tat, now + 2 * 10_000);
        assert_eq!(a.reserved, 17);
    }

    #[test]
    fn an_outage_charge_is_spread_back_over_its_span() {
        let p = params(false);
        let mut state = KeyState::default();
        let now = 1_000_000_000;
        // 100 tokens admitted over the last second at the rate: no debt remains; the
        // same in two rounds applied together (queued in a paused Redis).
        let anchor = now - 1_000_000;
        serve(
            &p,
            &mut state,
            0xa,
            &Request {
                anchor,
                ..request(1, 100, 0, 0)
            },
            now,
        );
        assert_eq!(state.global.tat, now);
        let mut state = KeyState::default();
        // Queued rounds run after the node stopped waiting for them (late); an on-time
        // round spreads no further back than the node's last round Redis applied.
        for (seq, floor) in [(1, 40), (2, 100)] {
            let r = Request {
                anchor,
                deadline: now - 1,
                ..request(seq, floor, 0, 0)
            };
            serve(&p, &mut state, 0xa, &r, now);
        }
        assert_eq!(state.global.tat, now);
    }

    /// Reservations for 10 s; silent after 0.7 s.
    fn reserving() -> Params {
        Params {
            share_ttl: 10_000_000,
            silent_after: 700_000,
            ..params(false)
        }
    }

    /// The registry: each of `ids` last heard at `at` (µs).
    fn heard(ids: &[u64], at: u64) -> BTreeMap<u64, u64> {
        ids.iter().map(|&id| (id, at / 1_000)).collect()
    }

    /// A node cut off from Redis alone (silent: no round, no heartbeat) keeps its share
    /// reserved until its `until`: the others' rounds charge it on its behalf, and share
    /// only the rest. When it comes back, what it admitted comes out of that charge, and
    /// what its fallback's budget admitted beyond it is its own debt, repaid at an eighth
    /// of its share's pace while it still leases.
    #[test]
    fn a_silent_node_keeps_its_share_and_its_debt() {
        let p = reserving();
        let mut state = KeyState::default();
        let t0 = 1_000_000_000;
        let both = heard(&[0xa, 0xb], t0);
        let a = super::serve(&p, &mut state, 0xa, &request(1, 0, 0, 1), t0, &both);
        let b = super::serve(&p, &mut state, 0xb, &request(1, 0, 0, 1), t0, &both);
        assert_eq!((a.share, b.until), (WEIGHT_ONE / 2, t0 + 10_000_000));
        // 5 s later b has been silent for 4.3 s: a's round charges b's half of the rate
        // from 0.7 s on, and a leases at most from the other half.
        let t1 = t0 + 5_000_000;
        super::serve(
            &p,
            &mut state,
            0xa,
            &request(2, 1, 0, 0),
            t1,
            &heard(&[0xa], t1),
        );
        assert_eq!(state.nodes[&0xb].prepaid, (5_000_000 - 700_000) / 2);
        // b comes back at 12 s, reporting 500 tokens from its fallback, 20 of them from
        // its budget after its share's end: 465 were charged on its behalf (its half of
        // the 9.3 s from its silence to its `until`); of the other 35, the 20 from the
        // budget are its debt, and 15 are charged now.
        let t2 = t0 + 12_000_000;
        let back = Request {
            local: 500,
            beyond: 20,
            ..request(2, 1 + 500, 0, 5)
        };
        super::serve(
            &p,
            &mut state,
            0xa,
            &request(3, 1, 0, 0),
            t2 - 1,
            &heard(&[0xa], t2),
        );
        let tat_before = state.global.tat;
        let answer = super::serve(&p, &mut state, 0xb, &back, t2, &heard(&[0xa, 0xb], t2));
        assert_eq!(answer.owes, 20);
        assert!(answer.grant > 0, "owing does not stop leases");
        // The 465 are not charged again, nor the debt at once.
        assert!(state.global.tat <= tat_before.max(t2) + (15 + answer.grant) * 10_000);
        // One second later (a has reported no demand since: b's share is the whole
        // rate), an eighth of that second's refill (12.5 tokens) is repaid.
        let t3 = t2 + 1_000_000;
        let floor = 501 + answer.grant;
        let next = super::serve(
            &p,
            &mut state,
            0xb,
            &request(3, floor, 0, 0),
            t3,
            &heard(&[0xa, 0xb], t3),
        );
        assert_eq!(next.owes, 8);
    }

    /// A node whose requests reach Redis but whose answers do not (an asymmetric
    /// partition) reports its fallback's tokens: Redis then charges its share as it
    /// goes, as for a silent node, and leaves its reservation as the node last knew it.
    #[test]
    fn a_node_in_its_fallback_is_charged_its_share() {
        let p = reserving();
        let mut state = KeyState::default();
        let t0 = 1_000_000_000;
        let all = heard(&[0xa, 0xb], t0);
        super::serve(&p, &mut state, 0xa, &request(1, 0, 0, 1), t0, &all);
        super::serve(&p, &mut state, 0xb, &request(1, 0, 0, 1), t0, &all);
        let until = state.nodes[&0xb].until;
        // b's round reports 3 tokens from its fallback: its reservation stays as it was.
        let t1 = t0 + 1_000_000;
        let fallback = Request {
            local: 3,
            ..request(2, 3, 0, 5)
        };
        super::serve(&p, &mut state, 0xb, &fallback, t1, &all);
        assert_eq!(
            (state.nodes[&0xb].fallback, state.nodes[&0xb].until),
            (1, until)
        );
        // a's round 1 s later (b still heartbeats) charges b's half of that second.
        let t2 = t1 + 1_000_000;
        super::serve(
            &p,
            &mut state,
            0xa,
            &request(2, 1, 0, 0),
            t2,
            &heard(&[0xa, 0xb], t2),
        );
        assert_eq!(state.nodes[&0xb].prepaid, 500_000);
        // b's next round without fallback tokens renews its reservation.
        let t3 = t2 + 100_000;
        super::serve(&p, &mut state, 0xb, &request(3, 3, 0, 0), t3, &all);
        assert_eq!(
            (state.nodes[&0xb].fallback, state.nodes[&0xb].until),
            (0, t3 + 10_000_000)
        );
    }

    #[test]
    fn a_scarce_limit_is_shared_by_credit() {
        // A burst of 2: the global state never holds more than two tokens, so credit
        // decides who gets them. Two nodes asking for everything every 5 ms, for 2 s.
        let p = Params {
            shape: Shape::TokenBucket {
                t: 10_000,
                tau: 10_000,
            },
            ..params(false)
        };
        let mut state = KeyState::default();
        let start = 1_000_000_000;
        let mut got = [0u64; 2];
        let mut reserved = [0u64; 2];
        for step in 0..400u64 {
            let node = (step % 2) as usize;
            let now = start + step * 5_000 / 2 * 2 + node as u64 * 1_000;
            // Everything leased is spent at once: the floor is the reservation.
            let a = serve(
                &p,
                &mut state,
                [0xa, 0xb][node],
                &request(step / 2 + 1, reserved[node], 0, 100),
                now,
            );
            got[node] += a.grant;
            reserved[node] = a.reserved;
        }
        // 2 s at 100/s plus the burst, split evenly.
        let total = got[0] + got[1];
        assert!((200..=203).contains(&total), "{got:?}");
        assert!(got[0].abs_diff(got[1]) <= 3, "{got:?}");
    }

    #[test]
    fn the_sliding_window_refunds_into_the_window_it_reserved_in() {
        let p = Params {
            shape: Shape::SlidingWindow {
                limit: 100,
                period: 1_000_000,
            },
            ..params(false)
        };
        let mut state = KeyState::default();
        let now = 5_000_000;
        let a = serve(&p, &mut state, 0xa, &request(1, 0, 0, 10), now + 10);
        assert_eq!(a.grant, 10);
        assert_eq!(state.global.cur, 10);
        // Next window: the 10 move to `prev`; returning 4 of them takes them off `prev`.
        serve(&p, &mut state, 0xa, &request(2, 6, 0, 0), now + 1_000_010);
        assert_eq!((state.global.prev, state.global.cur), (6, 0));
    }
}
