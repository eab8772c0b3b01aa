//! A round, from the node's side: what changed since the last (the keys the store
//! noted), which keys go (the most urgent first, at most the round's size), their
//! requests, the calls that carry them (by cluster slot, in batches), and how their
//! answers settle each key.
//!
//! # What a round carries, and how Redis shares the rate
//!
//! A node reports, per key, its **floor**: everything it admitted on the key since it
//! first saw it, plus the lease it keeps (the rest goes back). Floors are cumulative and
//! rounds are numbered, so a round applied twice, late or never charges exactly once:
//! Redis charges (or refunds) the difference from the reservation it holds for the node,
//! and ignores a round number it has seen. A round that runs after the node stopped
//! waiting for it (it queued in a paused Redis) only charges.
//!
//! Redis shares the rate **max-min fairly** by the nodes' demands (Doorman's FairShare):
//! each node reports its demand (a running average of what it used, raised at once when
//! it ran out), the demands of the nodes heard from in the last 3 intervals are
//! water-filled (every node is given at least an even split), and each node's
//! **credit** accrues at its share, up to its share of the burst. While another node
//! that wants tokens has credit, a node leases by its own credit, out of what the global
//! state holds beyond what nodes ahead of it need to catch up; otherwise it may take what
//! the global state holds (nothing is left unused). A key in use keeps a standing lease
//! of at least one token, so that a key used rarely is admitted at once; a key idle for
//! [`RedisSync::idle_ttl`] gives its lease back and is dropped (while rounds are
//! saturated, one with nothing to report gives its lease up without a round).
//!
//! In reconcile mode a node may also admit an **overdraft** beyond its lease: its share
//! of what the global state holds plus what it refills over two intervals (in debt, the
//! refill repays the debt first, and nothing is handed out), charged at its next round.
//! The overdrafts out are shared: a node is handed what the others' leave of that room,
//! or under contention at least its share of it (so the fleet overdraws by at most one
//! room, and the admitted rate stays near the limit second by second instead of
//! swinging between bursts and repaid debt).
//! Debt is enforced: leases and overdrafts stop until it is repaid, so the long-run rate
//! converges to the limit.

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::Hash;

use redis::Value;
use redis::cluster_routing::Slot;

use super::super::agree;
use super::super::cell::OutageMode;
use super::super::cell::{Cold, SyncCell, SyncPolicy};
use super::super::driver::Health;
use super::super::driver::nanos;
use super::super::key::{self, Need, NodeParams};
use super::super::protocol::{Request, SharedQuota};
use super::super::wire::{
    self, Command, HotCall, HotReply, RoundCall, RoundReply, SettingsCall, SettingsReply,
};
use super::cold::{Cooler, Visit};
use super::{Event, Failure, Node, Replies, SWEEP_STEPS, Synced};
use crate::store::Store;

/// One key in a round.
pub(super) struct Item<K> {
    pub(super) key: K,
    pub(super) request: Request,
    pub(super) params: NodeParams,
    /// The key returns cold once this round is answered.
    pub(super) cooling: bool,
}

/// A round on its way.
pub(super) struct Round<K> {
    pub(super) stopping: bool,
    pub(super) items: Vec<Item<K>>,
    /// Each item's Redis key.
    pub(super) keys: Vec<Vec<u8>>,
    /// The items whose announcement this round makes or renews.
    pub(super) announce: Vec<usize>,
    /// The script calls, by pipeline.
    pub(super) plan: Vec<Vec<Call>>,
    /// Each call's encoded command, by pipeline.
    pub(super) commands: Vec<Vec<Command>>,
    /// The settings went along, in the last pipeline.
    pub(super) settings_along: bool,
    /// Keys that needed a round and did not fit.
    pub(super) waiting: usize,
    /// When the read of the announcements was sent, and what it read (the announcing
    /// stage's).
    pub(super) hot_sent: u64,
    pub(super) hot_read: Option<HotReply>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// The announcements (and the read) go first.
    Announcing,
    /// Announced: the calls go next.
    Announced,
    /// The calls (and, without announcements, the read) are out.
    Calling,
}

pub(super) struct Flight<K> {
    pub(super) id: u64,
    pub(super) sent: u64,
    pub(super) deadline: u64,
    pub(super) stage: Stage,
    pub(super) round: Round<K>,
}

impl<K> Node<K>
where
    K: Hash + Eq + Clone + Display,
{
    /// Looks at the keys the store noted (or at every key, when it could not note them
    /// all or another node announced a key new to this one): cold keys that must turn
    /// hot do, and every hot one joins the keys this node syncs.
    fn look_at_changes(&mut self, now: u64, store: &Store<K, SyncCell>) {
        self.noted.clear();
        let overflowed = store.take_notes(&mut self.noted);
        let every = overflowed || std::mem::take(&mut self.hot.rescan);
        let cold_t_ns = self.config.cold_t_ns(self.hot.nodes);
        let mut visit = Visit {
            config: &self.config,
            hot: &mut self.hot,
            synced: &mut self.synced,
            now,
            cold_t_ns,
            every,
        };
        if every {
            store.for_each(|key, cell, _| visit.key(key, cell));
        } else {
            for &hash in &self.noted {
                store.with_hashed(hash, |key, cell, _| visit.key(key, cell));
            }
        }
    }

    /// The keys this round sends, most urgent first, at most the round's size (all that
    /// are not released yet when stopping), whether each returns cold with it; how many
    /// more wait; and how many idle keys that did not fit were released without a round
    /// (see [`key::release_locally`]), and dropped.
    fn select(
        &mut self,
        now: u64,
        store: &Store<K, SyncCell>,
        stopping: bool,
    ) -> (Vec<(K, bool)>, usize, u64) {
        self.look_at_changes(now, store);
        let mut selection = Selection::new(self.size.keys());
        let mut released = Vec::new();
        let mut gone = Vec::new();
        let cooler = self.cooler(now, stopping);
        let config = &self.config;
        let node_params = &self.config.node_params;
        // Whether the key is still a hot one (a key dropped and seen again starts cold).
        let offer = |key: &K, cell: &SyncCell, policy: &SyncPolicy| -> bool {
            if key::is_cold(cell) {
                return false;
            }
            let mut books = cell.hot.aside.books.lock();
            // (A key the fallback turned hot before the node first read the
            // announcements was never named to them.)
            if cooler.is_some() && books.fleet == 0 {
                books.fleet = key::fleet_hash(&config.redis_key(key));
            }
            let cools = cooler.is_some_and(|c| c.cools(cell, &books, policy));
            let need = if stopping && !books.released {
                Some(Need::Release)
            } else if cools {
                Some(Need::Report)
            } else {
                key::need(cell, &books, &key::key_params(node_params, policy), now)
            };
            let Some(need) = need else { return true };
            if let Err((key, _)) = selection.offer((key.clone(), cools), need) {
                if need == Need::Release && key::release_locally(cell, &mut books) {
                    released.push(key);
                } else {
                    selection.wait();
                }
            }
            true
        };
        {
            let mut offer = offer;
            match &self.synced {
                Synced::All => store.for_each(|key, cell, policy| {
                    offer(key, cell, policy);
                }),
                Synced::Listed(keys) => {
                    for key in keys {
                        let hot =
                            store.with_state_policy(key, |cell, policy| offer(key, cell, policy));
                        if hot != Some(true) {
                            gone.push(key.clone());
                        }
                    }
                }
            }
        }
        let (chosen, waiting) = selection.finish();
        let dropped = released
            .iter()
            .filter(|key| store.remove_if(*key, SyncCell::is_released))
            .count() as u64;
        if let Synced::Listed(keys) = &mut self.synced {
            for key in gone.iter().chain(&released) {
                keys.remove(key);
            }
        }
        store.sweep_some(now, SWEEP_STEPS);
        (chosen, waiting, dropped)
    }

    /// Chooses the round's keys, collects their requests, and encodes the calls.
    pub(super) fn start_round(
        &mut self,
        now: u64,
        store: &Store<K, SyncCell>,
        stopping: bool,
    ) -> Round<K> {
        let (chosen, waiting, released_locally) = self.select(now, store, stopping);
        // Counted now: they were dropped whatever becomes of this round.
        self.stats.keys_released += released_locally;
        self.seq += 1;
        // Keys whose announcement as hot this node makes or renews: made before the
        // key's round, so that every node that reads it later turns the key hot while
        // the others' cold shares are still accounted for.
        let renew_by = self.hot.server_ms.saturating_add(
            self.config
                .cold
                .as_ref()
                .map_or(0, |tier| tier.lifetime_ms / 2),
        );
        let even = self.even_share_divisor();
        let mut items = Vec::with_capacity(chosen.len());
        let mut announce = Vec::new();
        for (key, cooling) in chosen {
            let collected = store.with_state_policy(&key, |cell, policy| {
                let params = key::key_params(&self.config.node_params, policy);
                // The key's use is averaged over at least 20 tokens of the even share, so
                // that a light key's few requests do not make it look heavy.
                let params = NodeParams {
                    use_tau_us: params
                        .demand_tau_us
                        .max(params.ticks.saturating_mul(even).saturating_mul(20)),
                    ..params
                };
                let mut books = cell.hot.aside.books.lock();
                // A key returning cold asks for its cold share's burst: the share starts
                // with what it holds (see `key::turn_cold`).
                let at_least = if cooling {
                    policy.cold.map_or(0, |c| c.burst())
                } else {
                    0
                };
                let request = Request {
                    quota: policy.shared,
                    ..key::collect(
                        cell,
                        &mut books,
                        &params,
                        self.seq,
                        now,
                        stopping,
                        at_least,
                        self.redis_offset_ns,
                    )
                };
                let holds = request.demand > 0 || request.keep > 0 || request.want > 0;
                // A key stays hot while its use here is near this node's even share or
                // above (see `Cooler`), or it has a quota of its own; the round that
                // turned it hot by its own demand announces it whatever its use.
                let wants = books.announce
                    || (holds
                        && (!policy.shared.is_default() || !Cooler::light(books.usage, even)));
                (
                    request,
                    params,
                    wants && !cooling && books.announced_until <= renew_by,
                )
            });
            if let Some((request, params, renew)) = collected {
                if renew && self.config.cold.is_some() && !stopping {
                    announce.push(items.len());
                }
                items.push(Item {
                    key,
                    request,
                    params,
                    cooling,
                });
            }
        }
        let keys: Vec<Vec<u8>> = items
            .iter()
            .map(|i| self.config.redis_key(&i.key))
            .collect();
        let plan = batches(
            &keys,
            self.config.batch_size,
            self.config
                .cluster
                .then_some(|key: &[u8]| Slot::for_key(key)),
        );
        let mut commands: Vec<Vec<Command>> = plan
            .iter()
            .map(|pipeline| {
                pipeline
                    .iter()
                    .map(|call| self.command(call, &items, &keys))
                    .collect()
            })
            .collect();
        // Without announcements, the read goes along, in a pipeline of its own.
        if let (Some(tier), true) = (&self.config.cold, announce.is_empty()) {
            let call = HotCall {
                lifetime_ms: tier.lifetime_ms,
                from_ms: self.hot.from_ms,
                announce: Vec::new(),
            };
            commands.push(vec![wire::hot_command(&tier.key, &call)]);
        }
        // The terms go with the first round, then every `agree::EVERY`.
        let settings_along = !stopping
            && self
                .terms_sent
                .is_none_or(|at| now >= at.saturating_add(nanos(agree::EVERY)));
        if settings_along {
            let call = SettingsCall {
                field: self.config.terms.field(self.config.id),
                terms: self.config.terms.encode(),
                stale_ms: agree::STALE_MS,
            };
            commands.push(vec![wire::settings_command(&self.config.terms_key, &call)]);
        }
        Round {
            stopping,
            items,
            keys,
            announce,
            plan,
            commands,
            settings_along,
            waiting,
            hot_sent: now,
            hot_read: None,
        }
    }

    /// The command of one script call: the registry's TTL for a heartbeat, 0 otherwise;
    /// the clock 0 (Redis's own, the one every node's rounds share).
    fn command(&self, call: &Call, items: &[Item<K>], keys: &[Vec<u8>]) -> Command {
        let encoded = RoundCall {
            node: self.config.id,
            registry_ttl_ms: if call.registry {
                self.config.registry_ttl_ms
            } else {
                0
            },
            params: self.config.params,
            heard: self.heard.clone(),
            seq: self.seq,
            clock_us: 0,
            requests: call.items.iter().map(|&i| items[i].request).collect(),
        };
        wire::round_command(
            call.registry.then_some(&self.config.registry[..]),
            call.items.iter().map(|&i| keys[i].clone()).collect(),
            &encoded,
        )
    }

    /// The calls answered: every answer that arrived is applied (even when another call
    /// failed: a cluster master in failover), then the round counts as a success or a
    /// failure.
    pub(super) fn finish_round(
        &mut self,
        now: u64,
        store: &Store<K, SyncCell>,
        flight: Flight<K>,
        replies: Replies,
    ) {
        let round = flight.round;
        let round_trip = now.saturating_sub(flight.sent);
        let mut failure = None;
        let calls = round.plan.len();
        // The read of the announcements: the announcing stage's, or the last pipeline.
        let mut replies = replies.into_iter();
        let mut by_pipeline: Vec<Result<Vec<Value>, Failure>> =
            replies.by_ref().take(calls).collect();
        by_pipeline.resize_with(calls, || {
            Err(Failure::reply(&wire::WireError::invalid(
                "a pipeline's reply: none",
            )))
        });
        let hot_read = match round.hot_read {
            Some(read) => Some(Ok(read)),
            None if self.config.cold.is_some() => Some(match replies.next() {
                Some(Ok(values)) => values
                    .first()
                    .ok_or_else(|| wire::WireError::invalid("hot-key reply: none"))
                    .and_then(HotReply::decode)
                    .map_err(|e| Failure::reply(&e)),
                Some(Err(f)) => Err(f),
                None => Err(Failure::reply(&wire::WireError::invalid(
                    "hot-key reply: none",
                ))),
            }),
            None => None,
        };
        match hot_read {
            Some(Ok(read)) => {
                let until = read.now_ms + self.config.cold.as_ref().map_or(0, |t| t.lifetime_ms);
                let announced: Vec<u64> = round
                    .announce
                    .iter()
                    .map(|&i| key::fleet_hash(&round.keys[i]))
                    .collect();
                self.heard_hot(read, round.hot_sent, &announced);
                for &i in &round.announce {
                    store.with_state(&round.items[i].key, |cell| {
                        let mut books = cell.hot.aside.books.lock();
                        books.announced_until = until;
                        books.announce = false;
                    });
                }
            }
            Some(Err(f)) => failure = Some(f),
            None => {}
        }
        // The others' terms (a failed read is tried again at the next round).
        if round.settings_along {
            let read = replies.next().and_then(Result::ok);
            if let Some(Ok(read)) = read
                .as_ref()
                .and_then(|v| v.first())
                .map(SettingsReply::decode)
            {
                self.terms_sent = Some(now);
                self.heard_terms(&read);
            }
        }
        // What each call answered: the number of nodes and the clock from the heartbeat,
        // and each key's answer with the clock of the server that holds it.
        let mut nodes = None;
        let mut heartbeat_us = None;
        let mut answers = vec![None; round.items.len()];
        for (pipeline, result) in round.plan.iter().zip(by_pipeline) {
            let values = match result {
                Ok(values) if values.len() == pipeline.len() => values,
                Ok(_) => {
                    failure = Some(Failure::reply(&wire::WireError::invalid(
                        "a pipeline's replies: count",
                    )));
                    continue;
                }
                Err(f) => {
                    failure = Some(f);
                    continue;
                }
            };
            for (call, value) in pipeline.iter().zip(&values) {
                let reply = match RoundReply::decode(value, call.items.len()) {
                    Ok(reply) => reply,
                    Err(e) => {
                        failure = Some(Failure::reply(&e));
                        continue;
                    }
                };
                if call.registry {
                    nodes = Some(reply.nodes.max(1));
                    heartbeat_us = Some(reply.server_us);
                    self.heard = reply.registry;
                }
                for (&i, answer) in call.items.iter().zip(reply.answers) {
                    answers[i] = Some((answer, reply.server_us));
                }
            }
        }
        if let Some(server_us) = heartbeat_us {
            let midpoint = i128::from(now) - i128::from(round_trip / 2);
            if let Ok(offset) = i64::try_from(i128::from(server_us) * 1_000 - midpoint) {
                self.redis_offset_ns = Some(offset);
            }
            // Every round that heartbeats schedules the renewal round of the next window
            // (lease mode's window counters), whether or not it carried keys.
            if let (_, Some(renew_in)) = self.lease_deadline(
                self.config.params.shape.period(),
                server_us,
                round_trip,
                now,
            ) {
                self.driver.round_at(Some(now.saturating_add(renew_in)));
            }
        }
        let mut stale = 0;
        let mut released = 0;
        for (item, answer) in round.items.iter().zip(&answers) {
            let Some((answer, server_us)) = answer else {
                continue;
            };
            // A key's lease ends with the window (of its own quota) of the clock of the
            // server that holds it.
            let period = answer.quota.shape(self.config.params.shape).period();
            let (expires, _) = self.lease_deadline(period, *server_us, round_trip, now);
            // Its share stays reserved until `until` of that server's clock: here, a
            // whole round trip earlier, so that the offset's error cannot carry a local
            // admission past it.
            let share_until = now
                .saturating_add(
                    answer
                        .until
                        .saturating_sub(*server_us)
                        .saturating_mul(1_000),
                )
                .saturating_sub(round_trip);
            let done = store.with_state_policy(&item.key, |cell, policy| {
                let mut books = cell.hot.aside.books.lock();
                let ok = key::settle(
                    cell,
                    &mut books,
                    &item.params,
                    &item.request,
                    answer,
                    expires,
                    share_until,
                );
                // (An idle key released by this round is dropped instead.)
                let cooled = ok
                    && item.cooling
                    && !books.released
                    && policy
                        .cold
                        .is_some_and(|cold| key::turn_cold(cell, &mut books, &cold, now));
                (ok, books.released, cooled)
            });
            if done.is_some_and(|(ok, ..)| ok) {
                self.adopt_quota(now, store, &item.key, answer.quota);
            }
            match done {
                Some((false, ..)) => stale += 1,
                Some((true, _, true)) => {
                    self.hot.cooled += 1;
                    if let Synced::Listed(keys) = &mut self.synced {
                        keys.remove(&item.key);
                    }
                }
                Some((true, true, _)) if store.remove_if(&item.key, SyncCell::is_released) => {
                    released += 1;
                    if let Synced::Listed(keys) = &mut self.synced {
                        keys.remove(&item.key);
                    }
                }
                _ => {}
            }
        }
        let failure = failure.or_else(|| {
            (nodes.is_none() || heartbeat_us.is_none())
                .then(|| Failure::reply(&wire::WireError::invalid("round: no heartbeat")))
        });
        match failure {
            Some(f) => {
                self.round_failed(now, round_trip, f);
                if round.stopping {
                    self.flushed(false);
                }
            }
            None => {
                let nodes = nodes.unwrap_or(1);
                self.events.push_back(Event::Round {
                    ok: true,
                    took_ns: round_trip,
                    fallback: false,
                    nodes,
                });
                if nodes != self.nodes {
                    self.nodes = nodes;
                    self.set_shares(store);
                }
                self.size.succeeded();
                if self.driver.on_success(now) == Health::Recovered {
                    self.set_outage(store, OutageMode::Normal);
                    self.events.push_back(Event::Fallback {
                        entered: false,
                        nodes,
                    });
                }
                let s = &mut self.stats;
                s.syncs += 1;
                s.keys_last_round = round.items.len();
                s.keys_waiting = round.waiting;
                s.stale_answers += stale;
                s.keys_released += released;
                s.nodes = nodes;
                s.fallback_active = false;
                s.last_error = None;
                if round.stopping {
                    self.flushed(!round.items.is_empty() || round.waiting > 0);
                }
            }
        }
    }

    /// Until when (limiter clock, ns) what a round leases may be spent: for ever, but in
    /// lease mode for the window counters only until Redis's current window ends, brought
    /// forward by a whole round trip so that the clock offset's error cannot carry a
    /// token into the next window; and how long (ns) from now the round that renews
    /// leases just after the next window starts is due.
    fn lease_deadline(
        &self,
        period: Option<u64>,
        server_us: u64,
        round_trip: u64,
        now: u64,
    ) -> (u64, Option<u64>) {
        let Some(period) = period else {
            return (u64::MAX, None);
        };
        if self.config.params.overdraft_horizon > 0 {
            return (u64::MAX, None);
        }
        let to_end = (period - server_us % period).saturating_mul(1_000);
        let end = now.saturating_add(to_end);
        (
            end.saturating_sub(round_trip),
            Some(to_end + round_trip / 2),
        )
    }

    /// Takes in the quota Redis holds for `key` (see [`SharedQuota`]): a higher one than
    /// this node's becomes the key's own here (or returns it to the default); a return to
    /// the default that Redis has taken needs no mark any more.
    fn adopt_quota(&self, now: u64, store: &Store<K, SyncCell>, key: &K, held: SharedQuota) {
        let mine = store.policy_of(key);
        if held > mine.shared {
            let policy = if held.is_default() {
                None
            } else {
                // (Redis holds only what a node's `set_quota` accepted.)
                let Some(quota) = held.quota() else { return };
                let Ok(policy) =
                    store
                        .default_policy()
                        .for_key(self.config.algorithm, quota, held.version)
                else {
                    return;
                };
                Some(policy)
            };
            store.set_key_quota(key.clone(), policy, || now);
        } else if mine.shared.is_default()
            && mine.shared.version > 0
            && held.version >= mine.shared.version
        {
            store.set_key_quota(key.clone(), None, || now);
        }
    }

    /// What this node's share among the nodes sets: a key first seen on this node may
    /// overdraft its share of the capacity until its first round (reconcile mode; in
    /// lease mode it waits for a lease), and the leaky bucket paces its queue at its share
    /// of the rate.
    fn set_shares(&self, store: &Store<K, SyncCell>) {
        let policy = store.default_policy();
        let p = &self.config.node_params;
        let fresh = key::fresh_overdraft(p.capacity, self.nodes, p.reconcile);
        let pace_ns = if policy.pace_ns == 0 {
            0
        } else {
            Cold::t_ns(policy.ticks, self.nodes, false)
        };
        let nodes = self.nodes.max(1);
        if policy.fresh != fresh || policy.pace_ns != pace_ns || policy.nodes != nodes {
            store.set_policy(
                SyncPolicy {
                    fresh,
                    pace_ns,
                    nodes,
                    ..policy
                },
                0,
            );
        }
    }

    /// Takes in the terms the prefix's nodes sync by: the first that differs from this
    /// node's is published (once, until it changes) and shown in the stats.
    fn heard_terms(&mut self, read: &SettingsReply) {
        let found = self.config.terms.differ(self.config.id, &read.entries);
        let setting = found.as_ref().map(|d| d.setting);
        if setting != self.stats.settings_differ {
            if let Some(d) = found {
                self.events.push_back(Event::Disagreement(d));
            }
        }
        self.stats.settings_differ = setting;
    }
}

/// The keys one round carries: at most `max`, the most urgent first (a lease before a
/// report before a release).
pub(crate) struct Selection<K> {
    max: usize,
    /// The keys taken, by [`Need`].
    classes: [Vec<K>; 3],
    /// Keys that needed a round and did not get into this one.
    waiting: usize,
}

impl<K> Selection<K> {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            classes: [Vec::new(), Vec::new(), Vec::new()],
            waiting: 0,
        }
    }

    /// Offers `key`, which needs `need`. It is taken while the keys taken of its class
    /// and the more urgent ones leave room (a more urgent key offered later may still
    /// push it out); otherwise it is given back, for the caller to release locally or to
    /// count as [`waiting`](Self::wait).
    pub(crate) fn offer(&mut self, key: K, need: Need) -> Result<(), K> {
        let class = need as usize;
        let ahead: usize = self.classes[..class].iter().map(Vec::len).sum();
        if self.classes[class].len() < self.max.saturating_sub(ahead) {
            self.classes[class].push(key);
            Ok(())
        } else {
            Err(key)
        }
    }

    /// Counts a key given back by [`offer`](Self::offer) that waits for a later round.
    pub(crate) fn wait(&mut self) {
        self.waiting += 1;
    }

    /// The round's keys, most urgent first, and how many keys wait for a later round.
    pub(crate) fn finish(self) -> (Vec<K>, usize) {
        let [mut chosen, report, release] = self.classes;
        chosen.extend(report);
        chosen.extend(release);
        let waiting = self.waiting + chosen.len().saturating_sub(self.max);
        chosen.truncate(self.max);
        (chosen, waiting)
    }
}

/// One call of the round script: with the heartbeat (the registry as its first key) or
/// not, and the indices of the round's keys it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) registry: bool,
    pub(crate) items: Vec<usize>,
}

/// Splits a round's `keys` into pipelines of script calls of at most `batch` keys each.
///
/// On one server (`slot_of` is `None`) one pipeline carries every key, each call with
/// the registry (an empty round is the heartbeat alone). On a cluster every call's keys
/// share a slot (`slot_of`): the heartbeat goes alone, in its own pipeline, and each
/// slot's keys in one more, in the order each slot first appears.
pub(crate) fn batches<S: Hash + Eq>(
    keys: &[Vec<u8>],
    batch: usize,
    slot_of: Option<impl Fn(&[u8]) -> S>,
) -> Vec<Vec<Call>> {
    let batch = batch.max(1);
    let chunks = |indices: &[usize], registry: bool| -> Vec<Call> {
        indices
            .chunks(batch)
            .map(|items| Call {
                registry,
                items: items.to_vec(),
            })
            .collect()
    };
    let heartbeat = || Call {
        registry: true,
        items: Vec::new(),
    };
    let Some(slot_of) = slot_of else {
        if keys.is_empty() {
            return vec![vec![heartbeat()]];
        }
        let all: Vec<usize> = (0..keys.len()).collect();
        return vec![chunks(&all, true)];
    };
    let mut slots: HashMap<S, usize> = HashMap::new();
    let mut by_slot: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let next = by_slot.len();
        let at = *slots.entry(slot_of(key)).or_insert(next);
        if at == next {
            by_slot.push(Vec::new());
        }
        by_slot[at].push(i);
    }
    let mut plan = vec![vec![heartbeat()]];
    plan.extend(by_slot.iter().map(|indices| chunks(indices, false)));
    plan
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn need(n: u8) -> Need {
        match n % 3 {
            0 => Need::Lease,
            1 => Need::Report,
            _ => Need::Release,
        }
    }

    #[test]
    fn a_full_round_takes_leases_before_reports_before_releases() {
        let mut s = Selection::new(3);
        for (key, n) in [
            ("r1", Need::Release),
            ("p1", Need::Report),
            ("r2", Need::Release),
        ] {
            assert!(s.offer(key, n).is_ok());
        }
        assert_eq!(s.offer("r3", Need::Release), Err("r3"));
        s.wait();
        assert!(s.offer("l1", Need::Lease).is_ok());
        assert!(s.offer("l2", Need::Lease).is_ok());
        let (chosen, waiting) = s.finish();
        assert_eq!(chosen, ["l1", "l2", "p1"]);
        // r3 waited; r1 and r2 were pushed out by the later leases.
        assert_eq!(waiting, 3);
    }

    #[test]
    fn a_round_of_no_room_takes_nothing() {
        let mut s = Selection::new(0);
        assert_eq!(s.offer(1, Need::Lease), Err(1));
        s.wait();
        assert_eq!(s.finish(), (Vec::new(), 1));
    }

    proptest! {
        /// Whatever the order keys come in: at most `max` are chosen, most urgent first;
        /// no chosen key is less urgent than a key left out; each offered key is chosen,
        /// given back or counted waiting, once.
        #[test]
        fn the_most_urgent_keys_fill_the_round(
            needs in prop::collection::vec(any::<u8>(), 0..200),
            max in 0usize..50,
        ) {
            let mut s = Selection::new(max);
            let mut given_back = Vec::new();
            for (key, &n) in needs.iter().enumerate() {
                if let Err(key) = s.offer(key, need(n)) {
                    given_back.push(key);
                    s.wait();
                }
            }
            let (chosen, waiting) = s.finish();
            prop_assert!(chosen.len() <= max);
            prop_assert_eq!(chosen.len() + waiting, needs.len());
            let urgency = |key: &usize| need(needs[*key]) as usize;
            prop_assert!(chosen.windows(2).all(|w| urgency(&w[0]) <= urgency(&w[1])));
            let worst_chosen = chosen.iter().map(urgency).max();
            let mut left_out: Vec<usize> =
                (0..needs.len()).filter(|k| !chosen.contains(k)).collect();
            left_out.sort_by_key(urgency);
            if let (Some(worst), Some(best_left)) = (worst_chosen, left_out.first().map(urgency)) {
                prop_assert!(worst <= best_left, "a less urgent key went before a more urgent one");
            }
            // The round is full whenever a key was left out.
            prop_assert!(left_out.is_empty() || chosen.len() == max);
        }

        /// Every key goes in exactly one call, no call carries more than `batch` keys; on
        /// one server every call carries the registry, on a cluster exactly one call
        /// does (the heartbeat, alone) and every other call's keys share a slot.
        #[test]
        fn every_key_goes_once_in_calls_of_one_slot(
            keys in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..4), 0..300),
            batch in 0usize..40,
            slots in 1u8..20,
            cluster: bool,
        ) {
            let slot_of = |key: &[u8]| key.iter().fold(0u8, |a, b| a.wrapping_add(*b)) % slots;
            let plan = batches(&keys, batch, cluster.then_some(slot_of));
            let calls: Vec<&Call> = plan.iter().flatten().collect();
            let registry = calls.iter().filter(|c| c.registry).count();
            prop_assert_eq!(registry, if cluster { 1 } else { calls.len() });
            let mut seen = vec![0u32; keys.len()];
            for call in &calls {
                prop_assert!(call.items.len() <= batch.max(1));
                prop_assert!(call.registry || !call.items.is_empty());
                for &i in &call.items {
                    seen[i] += 1;
                }
                if cluster {
                    prop_assert!(!call.registry || call.items.is_empty());
                    let first = call.items.first().map(|&i| slot_of(&keys[i]));
                    prop_assert!(call.items.iter().all(|&i| Some(slot_of(&keys[i])) == first));
                } else {
                    prop_assert_eq!(plan.len(), 1);
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
        }
    }
}
