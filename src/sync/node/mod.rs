//! The sync's node: every decision one node makes, as a state machine with no I/O, in the
//! manner of quinn-proto. Time is an argument (ns of the limiter's clock); the node never
//! reads a clock, never awaits, and never touches a socket. The tokio task (`task`) only
//! sleeps until [`Node::poll_timeout`], sends what [`Node::poll_transmit`] gives and feeds
//! the replies back; the deterministic simulation (`sim`) drives this same object against
//! its model of Redis.
//!
//! ```text
//!   handle_timeout(now) ─┐                      ┌─► poll_transmit(now) ─► Transmit ─► Redis
//!   wake(now) ───────────┼─► (round due?) ──────┤
//!   close(now) ──────────┘                      └─► poll_event() ─► metrics, events, stats
//!   handle_replies(now, id, replies) ◄──────────────────────────────────── Redis
//! ```
//!
//! A round, from the node's side:
//! 1. **What changed.** The store notes the keys that need a look (first seen, a cold
//!    share spent, a quota set); the node turns the cold ones that must turn hot, and
//!    adds every hot one to the keys it syncs. Only when the store could not note them
//!    all, or another node announced a key new to this one, does it look at every key.
//! 2. **Selection.** Of the keys it syncs, the ones that need the round (a lease, a
//!    report, a release, a return to cold), most urgent first, at most the round's size.
//! 3. **Announcements.** Keys whose demand keeps them hot renew their announcement; it
//!    goes first, with the read of everyone's, so that a node reading it later turns the
//!    key hot while the others' cold shares are still counted.
//! 4. **The calls.** One script call per batch of keys (per cluster slot), with the
//!    heartbeat, pipelined; the read of the announcements beside them.
//! 5. **The replies.** Each key's answer settles its books; the heartbeat tells the node
//!    count and Redis's clock; the read tells which keys are hot elsewhere.
//!
//! Between rounds the node keeps its health (the [`Driver`]): the fail mode applies once
//! no round has succeeded for the staleness, and the local fallback refills each
//! interval.
//!
//! # Inside a node
//!
//! Every decision a node makes — which keys a round carries, turning keys hot and cold,
//! the heartbeat and its node count, clock offsets, lease deadlines, settling, quota
//! adoption, shares, entering and leaving the fallback, the terms check — is made by one
//! I/O-free state machine, `node::Node`, with time as an argument: `poll_transmit` gives
//! the encoded commands of the next round, `handle_replies` takes what came back (a
//! timeout or an error is a reply too), `handle_timeout` and `poll_timeout` run its
//! timers, and `poll_event` says what to log and count. The tokio task only sleeps until
//! the node's deadline, sends each pipeline within it over one connection, and feeds the
//! replies back; the deterministic simulation drives the same `Node`, over a model of
//! the scripts that the Lua is tested against, so the bounds it asserts are the code's.
//! Commands and replies are encoded and decoded in one place (`wire`), used by the node,
//! the model and the differential test.
//!
//! A round costs what changed, not every key held: a check that changes what a key
//! needs from Redis (it ran out, turned hot, got a quota of its own) notes the key on a
//! list of its store, and a round reads only the notes and the keys it already carries
//! (leases to renew, reports to acknowledge). Idle keys are swept a few at a time (256
//! per shard and round), so releasing them costs nothing per key held either. With the
//! cold tier on, 1M cold keys in use and 1,000 hot ones sync at the configured interval.

mod cold;
mod config;
mod round;
#[cfg(test)]
mod tests;

use redis::Value;
use std::collections::{HashSet, VecDeque};
use std::fmt::Display;
use std::hash::Hash;

use super::SyncStats;
use super::agree::Disagreement;
use super::cell::{OutageMode, SyncCell, SyncPolicy};
use super::config::FailMode;
use super::driver::{Driver, Health, RoundSize};
use super::key::{self};
use super::wire::{self, Command, HotCall, HotReply};
use crate::store::Store;

use cold::HotView;
pub(crate) use config::NodeConfig;
use round::{Flight, Round, Stage};

/// How many rounds a shutdown may run to flush every key.
const SHUTDOWN_ROUNDS: usize = 1_000;
/// Keys each shard's eviction hand looks at per round: untouched ones are dropped, so
/// that memory follows the keys in use without a pass over every key.
const SWEEP_STEPS: usize = 256;

/// Why a call failed, as [`SyncStats::last_error`] names it, and what it said (with no
/// secret in it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    pub(crate) kind: &'static str,
    pub(crate) message: String,
}

impl Failure {
    /// A reply the node cannot read.
    fn reply(e: &wire::WireError) -> Self {
        Self {
            kind: "reply",
            message: e.to_string(),
        }
    }

    /// No reply within the round's timeout.
    pub(crate) fn timeout() -> Self {
        Self {
            kind: "timeout",
            message: "sync round timed out".to_owned(),
        }
    }
}

/// What one pipeline of a [`Transmit`] got back: each command's reply, or the failure of
/// the whole pipeline.
pub(crate) type Replies = Vec<Result<Vec<Value>, Failure>>;

/// What the node wants sent now: pipelines to send side by side, each one round trip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Transmit {
    /// Names the replies ([`Node::handle_replies`]).
    pub(crate) id: u64,
    /// When (ns) the sender stops waiting: a pipeline with no reply by then is fed back
    /// as a [`Failure::timeout`], and the replies that came are applied. (Should the
    /// replies never be fed back, the node gives up on the transmit a timeout later.)
    pub(crate) deadline: u64,
    pub(crate) pipelines: Vec<Vec<Command>>,
}

/// What the task publishes: metrics, `tracing` events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A round ended, `took_ns` after it was sent.
    Round {
        ok: bool,
        took_ns: u64,
        fallback: bool,
        nodes: u64,
    },
    /// A round failed; `changed` when its kind differs from the last failure's.
    Error {
        kind: &'static str,
        message: String,
        changed: bool,
    },
    /// The fail mode applies from now (`true`), or no longer.
    Fallback { entered: bool, nodes: u64 },
    /// `keys` keys got their one-time budget in an outage; 0: the cold tier lapsed.
    Budget { keys: u64 },
    /// Another node of the prefix syncs by other terms (see [`super::agree`]).
    Disagreement(Disagreement),
}

/// A stopping node: its last rounds report everything and return every lease, then it
/// leaves the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closing {
    Flushing { rounds_left: usize },
    Leaving { id: u64, deadline: u64 },
    Closed,
}

/// The keys this node syncs through Redis: listed, with the cold tier (a few, turned hot
/// by demand), or every key the store holds without it.
enum Synced<K> {
    All,
    Listed(HashSet<K>),
}

/// One node of a synced limiter, for keys of type `K`, on the store its checks use.
pub(crate) struct Node<K> {
    config: NodeConfig,
    driver: Driver,
    size: RoundSize,
    seq: u64,
    next_id: u64,
    /// Live nodes as the last heartbeat told (0 before the first).
    nodes: u64,
    /// Redis's clock minus the limiter's (ns), measured at the last round's midpoint.
    redis_offset_ns: Option<i64>,
    /// The node registry as the last heartbeat read it: each node's last heartbeat (ms
    /// of Redis's clock), which tells Redis which silent nodes are alive.
    heard: Vec<(u64, u64)>,
    hot: HotView,
    synced: Synced<K>,
    /// The hashes the store noted since the last round.
    noted: Vec<u64>,
    /// A round is due (its timer fired, or one was asked for).
    due: bool,
    flight: Option<Flight<K>>,
    closing: Option<Closing>,
    /// When (ns) the node last sent its terms (see [`super::agree`]).
    terms_sent: Option<u64>,
    stats: SyncStats,
    events: VecDeque<Event>,
    settled: bool,
}

impl<K> Node<K>
where
    K: Hash + Eq + Clone + Display,
{
    /// A node started at `now`: its first round is due at once (it tells the number of
    /// nodes, and so a new key's share). `seed` is its jitter's (the node id's hash).
    pub(crate) fn new(config: NodeConfig, seed: u64, now: u64) -> Self {
        Self {
            driver: Driver::new(config.timing, seed, now),
            size: RoundSize::new(config.round_keys),
            synced: match config.cold {
                Some(_) => Synced::Listed(HashSet::new()),
                None => Synced::All,
            },
            config,
            seq: 0,
            next_id: 0,
            nodes: 0,
            redis_offset_ns: None,
            heard: Vec::new(),
            hot: HotView::default(),
            noted: Vec::new(),
            due: false,
            flight: None,
            closing: None,
            terms_sent: None,
            stats: SyncStats::default(),
            events: VecDeque::new(),
            settled: false,
        }
    }

    pub(crate) fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The node's counters (`last_success_age` and `clock_offset` are the task's).
    pub(crate) fn stats(&self) -> SyncStats {
        self.stats
    }

    /// Redis's clock minus the limiter's (ns), as last measured.
    pub(crate) fn redis_offset_ns(&self) -> Option<i64> {
        self.redis_offset_ns
    }

    /// Whether checks decide as they will from now on: the first round has been
    /// answered and, with the cold tier, the keys turned hot elsewhere have been read;
    /// or the fail mode applies; or the node has stopped.
    pub(crate) fn is_settled(&self) -> bool {
        self.settled
    }

    /// When (ns) the node gives up on a transmit of deadline `deadline` whose replies
    /// never came back (a sender that does not feed them back: a bug).
    fn give_up(&self, deadline: u64) -> u64 {
        deadline.saturating_add(self.config.timeout_ns)
    }

    /// The transmit whose replies the node waits for, if any.
    pub(crate) fn awaiting(&self) -> Option<u64> {
        match (&self.flight, self.closing) {
            (Some(f), _) if f.stage != Stage::Announced => Some(f.id),
            (_, Some(Closing::Leaving { id, .. })) => Some(id),
            _ => None,
        }
    }

    /// Whether the node has stopped (after [`close`](Self::close)).
    pub(crate) fn is_closed(&self) -> bool {
        self.closing == Some(Closing::Closed)
    }

    /// The next event to publish.
    pub(crate) fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When (ns) the node next needs [`handle_timeout`](Self::handle_timeout): its next
    /// round, or when it gives up on what is in flight.
    pub(crate) fn poll_timeout(&self) -> u64 {
        let flight = self
            .flight
            .as_ref()
            .map_or(u64::MAX, |f| self.give_up(f.deadline));
        let leaving = match self.closing {
            Some(Closing::Leaving { deadline, .. }) => self.give_up(deadline),
            _ => u64::MAX,
        };
        self.driver.poll_timeout().min(flight).min(leaving)
    }

    /// The timers due at `now`: a round, a round's timeout, and once per timer turn the
    /// health and the local fallback.
    pub(crate) fn handle_timeout(&mut self, now: u64, store: &Store<K, SyncCell>) {
        let grace = self.config.timeout_ns;
        if let Some(f) = self
            .flight
            .take_if(|f| now >= f.deadline.saturating_add(grace))
        {
            self.round_failed(now, now.saturating_sub(f.sent), Failure::timeout());
            if f.round.stopping {
                self.flushed(false);
            }
        }
        if let Some(Closing::Leaving { deadline, .. }) = self.closing {
            if now >= self.give_up(deadline) {
                self.stopped(store);
            }
        }
        // The schedule's timer (not a round's deadline) turns the local fallback.
        let timer = now >= self.driver.poll_timeout();
        if timer && self.driver.handle_timeout(now) {
            self.due = true;
        }
        self.after(now, store, timer);
    }

    /// A round asked for now (a key waits, `sync_now`): unless the rounds back off.
    pub(crate) fn wake(&mut self, now: u64, store: &Store<K, SyncCell>) {
        if self.driver.may_run(now) {
            self.due = true;
        }
        self.after(now, store, false);
    }

    /// Stops the node: its last rounds report everything, return every lease and leave
    /// the registry (the limiter gets no leases after them).
    pub(crate) fn close(&mut self, _now: u64) {
        if self.closing.is_none() {
            self.closing = Some(Closing::Flushing {
                rounds_left: SHUTDOWN_ROUNDS,
            });
        }
    }

    /// What to send now, if anything: the next round (its announcements first), or the
    /// next stage of the round in flight.
    pub(crate) fn poll_transmit(
        &mut self,
        now: u64,
        store: &Store<K, SyncCell>,
    ) -> Option<Transmit> {
        if let Some(f) = &mut self.flight {
            if f.stage != Stage::Announced {
                return None;
            }
            f.stage = Stage::Calling;
            let id = self.next_id;
            self.next_id += 1;
            f.id = id;
            f.sent = now;
            f.deadline = now.saturating_add(self.config.timeout_ns);
            return Some(Transmit {
                id,
                deadline: f.deadline,
                pipelines: f.round.commands.clone(),
            });
        }
        let stopping = match self.closing {
            None => false,
            Some(Closing::Flushing { rounds_left }) if rounds_left > 0 => true,
            Some(Closing::Flushing { .. }) => return self.leave(now, store),
            Some(_) => return None,
        };
        // A round due while another was in flight waits for it, and for the backoff.
        let due = std::mem::take(&mut self.due) && self.driver.may_run(now);
        if !stopping && !due {
            return None;
        }
        let round = self.start_round(now, store, stopping);
        let id = self.next_id;
        self.next_id += 1;
        let deadline = now.saturating_add(self.config.timeout_ns);
        let (stage, pipelines) = match (&self.config.cold, round.announce.is_empty()) {
            (Some(tier), false) => {
                let announce = round
                    .announce
                    .iter()
                    .map(|&i| round.keys[i].clone())
                    .collect();
                let call = HotCall {
                    lifetime_ms: tier.lifetime_ms,
                    from_ms: self.hot.from_ms,
                    announce,
                };
                (
                    Stage::Announcing,
                    vec![vec![wire::hot_command(&tier.key, &call)]],
                )
            }
            _ => (Stage::Calling, round.commands.clone()),
        };
        self.flight = Some(Flight {
            id,
            sent: now,
            deadline,
            stage,
            round: Round {
                hot_sent: now,
                ..round
            },
        });
        Some(Transmit {
            id,
            deadline,
            pipelines,
        })
    }

    /// Feeds back what the pipelines of transmit `id` got, in their order.
    pub(crate) fn handle_replies(
        &mut self,
        now: u64,
        store: &Store<K, SyncCell>,
        id: u64,
        replies: Replies,
    ) {
        if let Some(Closing::Leaving { id: leaving, .. }) = self.closing {
            if leaving == id {
                self.stopped(store);
                return;
            }
        }
        let Some(flight) = self.flight.take_if(|f| f.id == id) else {
            return;
        };
        match flight.stage {
            Stage::Announcing => self.announced(now, flight, replies),
            Stage::Calling => self.finish_round(now, store, flight, replies),
            Stage::Announced => self.flight = Some(flight),
        }
        self.after(now, store, false);
    }

    /// The announcing stage answered: on success the calls go next.
    fn announced(&mut self, now: u64, mut flight: Flight<K>, replies: Replies) {
        let read = match replies.into_iter().next() {
            Some(Ok(values)) => match values.first().map(HotReply::decode) {
                Some(Ok(read)) => Ok(read),
                Some(Err(e)) => Err(Failure::reply(&e)),
                None => Err(Failure::reply(&wire::WireError::invalid(
                    "hot-key reply: none",
                ))),
            },
            Some(Err(failure)) => Err(failure),
            None => Err(Failure::reply(&wire::WireError::invalid(
                "hot-key reply: none",
            ))),
        };
        match read {
            Ok(read) => {
                flight.round.hot_read = Some(read);
                flight.stage = Stage::Announced;
                self.flight = Some(flight);
            }
            Err(failure) => {
                self.round_failed(now, now.saturating_sub(flight.sent), failure);
                if flight.round.stopping {
                    self.flushed(false);
                }
            }
        }
    }

    /// After every input: the cold tier's state, the health (the fail mode), the local
    /// fallback once per timer turn, and whether the node is settled.
    fn after(&mut self, now: u64, store: &Store<K, SyncCell>, timer: bool) {
        self.update_cold(now, store);
        let (silent, health) = self.driver.poll_health(now);
        if health == Health::Fell {
            self.stats.fallback_active = true;
            self.events.push_back(Event::Fallback {
                entered: true,
                nodes: self.nodes,
            });
            self.apply_fail_mode(store);
        }
        // Once per timer turn: a round asked for early (`sync_now`) would otherwise add
        // another interval's credit to every reserved share.
        if silent && timer && self.config.fail_mode == FailMode::LocalShare {
            self.refill_locally(now, store);
        }
        if !self.settled {
            let vouched = self.config.cold.is_none() || self.hot.read_at.is_some();
            if (self.stats.syncs > 0 && vouched) || self.driver.in_fallback() {
                self.settled = true;
            }
        }
    }

    /// The command that leaves the registry, once the flush is done (if Redis was ever
    /// heard: otherwise there is nothing to leave).
    fn leave(&mut self, now: u64, store: &Store<K, SyncCell>) -> Option<Transmit> {
        if self.stats.syncs == 0 {
            self.stopped(store);
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        let deadline = now.saturating_add(self.config.timeout_ns);
        self.closing = Some(Closing::Leaving { id, deadline });
        Some(Transmit {
            id,
            deadline,
            pipelines: vec![vec![wire::leave_command(
                &self.config.registry,
                self.config.id,
            )]],
        })
    }

    /// The node has stopped: its leases are returned and no round will report what a
    /// check admits, so every check is denied from now on (a new key's fresh overdraft, a
    /// cold key's share, would be admitted uncharged, and the share of a node that left
    /// the registry is the others' again).
    fn stopped(&mut self, store: &Store<K, SyncCell>) {
        self.closing = Some(Closing::Closed);
        self.settled = true;
        set_outage(store, OutageMode::Closed);
    }

    /// A flush round ended: another follows while it succeeded and keys remain.
    fn flushed(&mut self, more: bool) {
        if let Some(Closing::Flushing { rounds_left }) = &mut self.closing {
            *rounds_left = if more { *rounds_left - 1 } else { 0 };
        }
    }

    /// A round failed: counted, shown in the stats, and published (`warn` for the first
    /// failure of a run or a new kind, `debug` after); the rounds back off.
    fn round_failed(&mut self, now: u64, took_ns: u64, failure: Failure) {
        self.events.push_back(Event::Round {
            ok: false,
            took_ns,
            fallback: self.driver.in_fallback(),
            nodes: self.nodes,
        });
        let changed = self.stats.last_error != Some(failure.kind);
        self.stats.last_error = Some(failure.kind);
        if failure.kind == "timeout" {
            self.size.timed_out();
        }
        self.events.push_back(Event::Error {
            kind: failure.kind,
            message: failure.message,
            changed,
        });
        self.driver.on_failure(now);
        self.stats.errors += 1;
    }

    // ---- The fail mode ----

    /// Puts the checks in the configured fail mode: `Open` and `Closed` set every key's
    /// outage mode; `LocalShare` runs on the books ([`refill_locally`](Self::refill_locally)).
    fn apply_fail_mode(&self, store: &Store<K, SyncCell>) {
        apply_fail_mode(self.config.fail_mode, store);
    }

    fn set_outage(&self, store: &Store<K, SyncCell>, outage: OutageMode) {
        set_outage(store, outage);
    }

    /// [`FailMode::LocalShare`], once per interval. A node that never read the keys turned
    /// hot (Redis was unreachable from its start) turns its cold keys hot, so that the
    /// fallback serves them: they admitted nothing. Otherwise a cold key spends its
    /// share by itself.
    fn refill_locally(&mut self, now: u64, store: &Store<K, SyncCell>) {
        let never_read = self.hot.read_at.is_none();
        let t_ns = self.config.cold_t_ns(self.hot.nodes);
        let p = self.config.node_params;
        let nodes = self.nodes;
        let mut budgets = 0;
        let mut turned = Vec::new();
        let mut refill = |key: &K, cell: &SyncCell, policy: &SyncPolicy| {
            if key::is_cold(cell) && !never_read {
                return;
            }
            let mut books = cell.hot.aside.books.lock();
            if key::turn_hot(cell, &mut books, t_ns, now) {
                turned.push(key.clone());
            }
            budgets += u64::from(key::refill_locally(
                cell,
                &mut books,
                &key::key_params(&p, policy),
                nodes,
                now,
            ));
        };
        match &self.synced {
            Synced::Listed(keys) if !never_read => {
                for key in keys {
                    store.with_state_policy(key, |cell, policy| refill(key, cell, policy));
                }
            }
            _ => store.for_each(|key, cell, policy| refill(key, cell, policy)),
        }
        if let Synced::Listed(keys) = &mut self.synced {
            keys.extend(turned);
        }
        if budgets > 0 {
            self.stats.keys_on_budget += budgets;
            self.events.push_back(Event::Budget { keys: budgets });
        }
    }
}

/// Puts the checks of `store` in `fail_mode`: `Open` and `Closed` set every key's outage
/// mode; `LocalShare` runs on the books, with nothing to set (`Local(quota)` is refused
/// at build).
pub(crate) fn apply_fail_mode<K: Hash + Eq>(fail_mode: FailMode, store: &Store<K, SyncCell>) {
    match fail_mode {
        FailMode::Open => set_outage(store, OutageMode::Open),
        FailMode::Closed => set_outage(store, OutageMode::Closed),
        FailMode::LocalShare | FailMode::Local(_) => {}
    }
}

fn set_outage<K: Hash + Eq>(store: &Store<K, SyncCell>, outage: OutageMode) {
    let policy = store.default_policy();
    store.set_policy(SyncPolicy { outage, ..policy }, 0);
}

/// The local fallback of a node whose task died: [`FailMode::LocalShare`]'s refill of every
/// hot key, once per interval (cold keys spend their share by themselves).
pub(crate) fn refill_dead<K: Hash + Eq>(
    config: &NodeConfig,
    store: &Store<K, SyncCell>,
    nodes: u64,
    now: u64,
) {
    let p = config.node_params;
    store.for_each(|_, cell, policy| {
        if key::is_cold(cell) {
            return;
        }
        let mut books = cell.hot.aside.books.lock();
        key::refill_locally(cell, &mut books, &key::key_params(&p, policy), nodes, now);
    });
}
