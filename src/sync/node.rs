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

use redis::Value;
use redis::cluster_routing::Slot;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Display;
use std::hash::Hash;
use std::sync::atomic::Ordering;

use super::SyncStats;
use super::agree::{self, Disagreement, Terms};
use super::books::Books;
use super::cell::{Cold, NEW, NOTED, OutageMode, SyncCell, SyncPolicy, WANT_HOT};
use super::config::{FailMode, RedisSync, Settings, SyncMode};
use super::driver::{Driver, Health, MAX_BACKOFF, RoundSize, Timing, micros, millis, nanos};
use super::key::{self, Need, NodeParams};
use super::protocol::{Params, Request, Shape, SharedQuota, WEIGHT_ONE};
use super::round::{self, Call, Selection};
use super::wire::{
    self, Command, HotCall, HotReply, RoundCall, RoundReply, SettingsCall, SettingsReply,
};
use crate::algorithm::Algorithm;
use crate::error::ConfigError;
use crate::quota::Quota;
use crate::redis::keys::{KeyHasher, write_key};
use crate::store::Store;

/// How many rounds a shutdown may run to flush every key.
const SHUTDOWN_ROUNDS: usize = 1_000;
/// Keys each shard's eviction hand looks at per round: untouched ones are dropped, so
/// that memory follows the keys in use without a pass over every key.
const SWEEP_STEPS: usize = 256;

/// Everything a node's rounds run by, derived once from a validated configuration.
#[derive(Clone, Debug)]
pub(crate) struct NodeConfig {
    /// The node id it heartbeats under (shown as 16 hex digits).
    pub(crate) id: u64,
    /// The limiter's algorithm (a key's own quota is for it).
    pub(crate) algorithm: Algorithm,
    pub(crate) fail_mode: FailMode,
    /// What every round tells Redis.
    pub(crate) params: Params,
    /// What the node side of every key's round uses.
    pub(crate) node_params: NodeParams,
    /// The schedule.
    pub(crate) timing: Timing,
    /// How long (ns) a round waits for its replies.
    pub(crate) timeout_ns: u64,
    /// How long (ms) a node stays in the registry without a heartbeat.
    pub(crate) registry_ttl_ms: u64,
    /// The registry's Redis key, and the prefix of every limiter key's.
    pub(crate) registry: Vec<u8>,
    pub(crate) key_prefix: Vec<u8>,
    /// Keys are written to Redis as this digest, when set.
    pub(crate) hasher: Option<KeyHasher>,
    /// Redis Cluster: a call's keys share a slot.
    pub(crate) cluster: bool,
    pub(crate) batch_size: usize,
    pub(crate) round_keys: usize,
    /// The cold tier, if on.
    pub(crate) cold: Option<ColdTier>,
    /// What every node of the prefix must sync by, and the prefix's hash of them.
    pub(crate) terms: Terms,
    pub(crate) terms_key: Vec<u8>,
}

/// The cold tier's settings (see [`RedisSync::cold_keys`]).
#[derive(Clone, Debug)]
pub(crate) struct ColdTier {
    /// The announcements of keys turned hot: a sorted set, `{prefix}:sync:tag:hot`.
    pub(crate) key: Vec<u8>,
    /// How long (ms) an announcement lasts unless renewed; a node renews the
    /// announcement of a key it keeps hot once half of it is left.
    pub(crate) lifetime_ms: u64,
    /// How long (ns) after it last read the announcements a node may admit on its cold
    /// keys: `share_ttl` (at least the staleness), as its reserved share in the fallback.
    pub(crate) valid_ns: u64,
    /// A window counter's cold share is half a burst and half the rate.
    pub(crate) windowed: bool,
}

impl NodeConfig {
    /// The node `id` of a limiter of `algorithm` and `quota` (of capacity `capacity`),
    /// synced by `config` (validated into `settings`).
    ///
    /// # Errors
    /// [`ConfigError::Unsupported`] for the sliding log, and the Redis tier's quota
    /// errors.
    pub(crate) fn new(
        id: u64,
        config: &RedisSync,
        settings: &Settings,
        algorithm: Algorithm,
        quota: Quota,
        capacity: u64,
    ) -> Result<Self, ConfigError> {
        let shape = Shape::new(algorithm, quota)?;
        // The leaky bucket's global state is the token bucket's, under keys of its own.
        let tag = match algorithm {
            Algorithm::LeakyBucket => "lb",
            _ => shape.script_args().0,
        };
        // An `also` quota's keys: `<tag>+<i>`, beside the limiter's own.
        let tag = match config.quota_index {
            0 => tag.to_owned(),
            i => format!("{tag}+{i}"),
        };
        let prefix = &config.options.prefix;
        let interval_us = micros(config.interval);
        let hold = interval_us * 2;
        let reconcile = config.mode == SyncMode::Reconcile;
        let valid = settings.share_ttl.max(settings.staleness);
        let cold = config.cold_keys.unwrap_or(reconcile).then(|| ColdTier {
            key: format!("{{{prefix}}}:sync:{tag}:hot").into_bytes(),
            lifetime_ms: millis(valid.saturating_mul(4)).max(10_000),
            valid_ns: nanos(valid),
            windowed: shape.period().is_some(),
        });
        Ok(Self {
            id,
            algorithm,
            fail_mode: config.fail_mode,
            params: Params {
                shape,
                overdraft_horizon: if reconcile { hold } else { 0 },
                hold,
                demand_ttl: interval_us * 3,
                retain_ms: millis(settings.idle_ttl) * 2 + 10_000,
                share_ttl: micros(settings.share_ttl),
                // The staleness and one round's timeout: a node that lost one round is
                // not silent (what its fallback admits meanwhile is charged when it
                // reports).
                silent_after: micros(settings.staleness).saturating_add(micros(settings.timeout)),
            },
            node_params: NodeParams {
                ticks: shape.ticks_per_token(),
                capacity,
                interval_ns: interval_us * 1_000,
                hold_us: hold,
                idle_ns: nanos(settings.idle_ttl),
                reconcile,
                demand_tau_us: (quota.period_ns() / 1_000).clamp(1_000_000, 60_000_000),
                timeout_ns: nanos(settings.timeout),
                // Set per round, by the node count (see `Node::start_round`).
                use_tau_us: 0,
            },
            timing: Timing {
                interval_ns: nanos(config.interval),
                staleness_ns: nanos(settings.staleness),
                max_backoff_ns: nanos(MAX_BACKOFF),
            },
            timeout_ns: nanos(settings.timeout),
            registry_ttl_ms: millis(settings.node_ttl).max(1),
            registry: format!("{{{prefix}}}:sync:{tag}:nodes").into_bytes(),
            key_prefix: format!("{prefix}:sync:{tag}:").into_bytes(),
            hasher: config.options.hasher.clone(),
            cluster: config.options.target.is_cluster(),
            batch_size: config.batch_size,
            round_keys: config.round_keys,
            cold,
            terms: Terms::new(config, algorithm, quota),
            terms_key: format!("{{{prefix}}}:sync:settings").into_bytes(),
        })
    }

    /// The Redis key of `key`'s state: `prefix:sync:tag:{key}`, or its digest.
    pub(crate) fn redis_key<K: Display>(&self, key: &K) -> Vec<u8> {
        let key = key.to_string();
        let mut out = Vec::with_capacity(self.key_prefix.len() + key.len().max(34) + 2);
        out.extend_from_slice(&self.key_prefix);
        out.push(b'{');
        write_key(self.hasher.as_ref(), key.as_bytes(), &mut out);
        out.push(b'}');
        out
    }

    /// The cold share's ns per token among `nodes` nodes (the rate's, when unknown).
    fn cold_t_ns(&self, nodes: u64) -> u64 {
        let windowed = self.cold.as_ref().is_some_and(|c| c.windowed);
        Cold::t_ns(self.node_params.ticks, nodes, windowed)
    }

    /// The limiter's policy for a node that has not heard Redis yet: with the cold tier,
    /// new keys start cold and wait for the first read of the keys turned hot (as a new
    /// key waits for its first lease without it).
    pub(crate) fn initial_policy(&self, policy: SyncPolicy) -> SyncPolicy {
        match self.cold {
            Some(_) => SyncPolicy {
                cold: Some(Cold::unvouched()),
                ..policy
            },
            None => policy,
        }
    }
}

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

/// What this node knows of the keys turned hot, and of its cold tier.
#[derive(Debug, Default)]
struct HotView {
    /// Each announced key's [`key::fleet_hash`], and until when (Redis ms) it is hot.
    keys: HashMap<u64, u64>,
    /// The next read returns the announcements from this score on (ms).
    from_ms: u64,
    /// Another node announced a key new to `keys`: every cold key is looked up at the
    /// next round.
    rescan: bool,
    /// When (limiter clock, ns) the last successful read was sent.
    read_at: Option<u64>,
    /// Redis's clock (ms) at the last read.
    server_ms: u64,
    /// The node count the cold shares divide by: the largest seen within the validity
    /// (a node that dropped out of the registry may still admit on its cold keys until
    /// its own validity ends), and when (limiter clock, ns) it was last seen.
    nodes: u64,
    nodes_at: u64,
    /// Keys turned hot, and returned cold, since the start.
    turned: u64,
    cooled: u64,
}

/// One key in a round.
struct Item<K> {
    key: K,
    request: Request,
    params: NodeParams,
    /// The key returns cold once this round is answered.
    cooling: bool,
}

/// A round on its way.
struct Round<K> {
    stopping: bool,
    items: Vec<Item<K>>,
    /// Each item's Redis key.
    keys: Vec<Vec<u8>>,
    /// The items whose announcement this round makes or renews.
    announce: Vec<usize>,
    /// The script calls, by pipeline.
    plan: Vec<Vec<Call>>,
    /// Each call's encoded command, by pipeline.
    commands: Vec<Vec<Command>>,
    /// The settings went along, in the last pipeline.
    settings_along: bool,
    /// Keys that needed a round and did not fit.
    waiting: usize,
    /// When the read of the announcements was sent, and what it read (the announcing
    /// stage's).
    hot_sent: u64,
    hot_read: Option<HotReply>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The announcements (and the read) go first.
    Announcing,
    /// Announced: the calls go next.
    Announced,
    /// The calls (and, without announcements, the read) are out.
    Calling,
}

struct Flight<K> {
    id: u64,
    sent: u64,
    deadline: u64,
    stage: Stage,
    round: Round<K>,
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
        if silent && timer && self.config.fail_mode == FailMode::Local {
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

    // ---- What changed, and the selection ----

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

    /// Whether keys may return cold at this round, and by what rule (see [`Cooler`]).
    fn cooler(&self, now: u64, stopping: bool) -> Option<Cooler<'_>> {
        let tier = self.config.cold.as_ref()?;
        let vouched = self
            .hot
            .read_at
            .is_some_and(|at| now < at.saturating_add(tier.valid_ns));
        (vouched && !stopping && !self.driver.in_fallback()).then(|| Cooler {
            announced: &self.hot.keys,
            server_ms: self.hot.server_ms,
            nodes: self.even_share_divisor(),
        })
    }

    /// A node's even share of the rate is `WEIGHT_ONE` divided by this: the node count
    /// the cold shares divide by (twice it for a window counter, whose cold share is
    /// half the rate).
    fn even_share_divisor(&self) -> u64 {
        let windowed = self.config.cold.as_ref().is_some_and(|c| c.windowed);
        self.hot.nodes.max(1) * if windowed { 2 } else { 1 }
    }

    // ---- A round ----

    /// Chooses the round's keys, collects their requests, and encodes the calls.
    fn start_round(&mut self, now: u64, store: &Store<K, SyncCell>, stopping: bool) -> Round<K> {
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
        let plan = round::batches(
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
    fn finish_round(
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

    // ---- The cold tier ----

    /// Takes in a read of the announcements sent at `sent` (limiter clock, ns), whose
    /// round announced the keys of fleet hashes `announced` itself.
    fn heard_hot(&mut self, read: HotReply, sent: u64, announced: &[u64]) {
        let h = &mut self.hot;
        for (member, until) in read.read {
            let fleet = key::fleet_hash(&member);
            if h.keys.insert(fleet, until).is_none() && !announced.contains(&fleet) {
                h.rescan = true;
            }
            // Scores only grow with the time they were written at; a second back
            // covers a failover to a server whose clock is a little behind.
            h.from_ms = h.from_ms.max(until.saturating_sub(1_000));
        }
        h.keys.retain(|_, until| *until > read.now_ms);
        h.server_ms = read.now_ms;
        h.read_at = Some(sent);
    }

    /// Keeps the limiter's cold share in step with what this node knows: on once a read
    /// of the announcements has succeeded, vouched for until the validity after the last
    /// read, divided by the node count; unvouched before the first read (new keys start
    /// cold and wait for it); off (new keys start hot, and the fallback applies to them)
    /// once the node is in its fallback without a valid read.
    fn update_cold(&mut self, now: u64, store: &Store<K, SyncCell>) {
        let Some(tier) = &self.config.cold else {
            return;
        };
        let h = &mut self.hot;
        // (Before the first heartbeat both are 0: see `want` below for what that means.)
        if self.nodes >= h.nodes || now.saturating_sub(h.nodes_at) >= tier.valid_ns {
            h.nodes = self.nodes;
            h.nodes_at = now;
        }
        let p = &self.config.node_params;
        let want = match h.read_at {
            // Not before the node has read the announcements and the node count (a read
            // whose round's heartbeat failed tells no count: a share of 0 nodes would be
            // the whole quota).
            None => Some(Cold::unvouched().for_new_keys(!self.driver.in_fallback())),
            Some(_) if h.nodes == 0 => {
                Some(Cold::unvouched().for_new_keys(!self.driver.in_fallback()))
            }
            Some(at) => {
                let until = at.saturating_add(tier.valid_ns);
                Cold::share(p.capacity, p.ticks, h.nodes, tier.windowed, until)
                    .map(|c| c.for_new_keys(now < until))
            }
        };
        let policy = store.default_policy();
        let same = match (policy.cold, want) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.t_ns == b.t_ns
                    && a.tau_ns == b.tau_ns
                    && a.new_keys == b.new_keys
                    && b.until < a.until + tier.valid_ns / 4
            }
            _ => false,
        };
        if !same {
            store.set_policy(
                SyncPolicy {
                    cold: want,
                    ..policy
                },
                0,
            );
        }
        let vouched = want.is_some_and(|c| now < c.until);
        if self.stats.cold_tier && !vouched {
            self.events.push_back(Event::Budget { keys: 0 });
        }
        self.stats.cold_tier = vouched;
        self.stats.hot_keys = h.keys.len();
        self.stats.keys_turned_hot = h.turned;
        self.stats.keys_cooled = h.cooled;
    }

    // ---- The fail mode ----

    /// Puts the checks in the configured fail mode: `Open` and `Closed` set every key's
    /// outage mode; `Local` runs on the books ([`refill_locally`](Self::refill_locally)).
    fn apply_fail_mode(&self, store: &Store<K, SyncCell>) {
        apply_fail_mode(self.config.fail_mode, store);
    }

    fn set_outage(&self, store: &Store<K, SyncCell>, outage: OutageMode) {
        set_outage(store, outage);
    }

    /// [`FailMode::Local`], once per interval. A node that never read the keys turned
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

/// Looks at one key that changed (see [`Node::look_at_changes`]).
struct Visit<'a, K> {
    config: &'a NodeConfig,
    hot: &'a mut HotView,
    synced: &'a mut Synced<K>,
    now: u64,
    cold_t_ns: u64,
    /// Every key is looked at: cold ones are checked against the announcements too.
    every: bool,
}

impl<K: Hash + Eq + Clone + Display> Visit<'_, K> {
    fn key(&mut self, key: &K, cell: &SyncCell) {
        // Cleared first: a change after this is noted again.
        let flags = cell.hot.flags.fetch_and(!NOTED, Ordering::AcqRel);
        if !key::is_cold(cell) {
            if flags & NEW != 0 {
                if self.config.cold.is_some() {
                    cell.hot.aside.books.lock().fleet =
                        key::fleet_hash(&self.config.redis_key(key));
                }
                cell.hot.flags.fetch_and(!NEW, Ordering::AcqRel);
            }
            if let Synced::Listed(keys) = self.synced {
                if !keys.contains(key) {
                    keys.insert(key.clone());
                }
            }
            return;
        }
        if flags & (NEW | WANT_HOT) == 0 && !self.every {
            return;
        }
        if flags & NEW != 0 {
            cell.hot.flags.fetch_and(!NEW, Ordering::AcqRel);
        }
        // With no key announced, none is hot elsewhere: the key's name is hashed when
        // one is (a key first seen is, and every key when another node announces one).
        if flags & WANT_HOT == 0 && self.hot.keys.is_empty() {
            return;
        }
        let mut books = cell.hot.aside.books.lock();
        if books.fleet == 0 {
            books.fleet = key::fleet_hash(&self.config.redis_key(key));
        }
        let elsewhere = self.hot.keys.contains_key(&books.fleet);
        if flags & WANT_HOT == 0 && !elsewhere {
            return;
        }
        if key::turn_hot(cell, &mut books, self.cold_t_ns, self.now) {
            self.hot.turned += 1;
            if let Synced::Listed(keys) = self.synced {
                keys.insert(key.clone());
            }
        }
    }
}

/// The rule by which a hot key returns cold at a round (the cold tier's cooling): no node
/// announces it any more (each renews its announcement only while the key's use there is
/// near its even share or above, or the key has a quota of its own), this node's own
/// announcement has lapsed, and its use here is light. The round reports everything;
/// once it is answered the key admits at its cold share again (see [`key::turn_cold`]).
#[derive(Clone, Copy)]
struct Cooler<'a> {
    announced: &'a HashMap<u64, u64>,
    server_ms: u64,
    /// The even share's divisor: the node count (twice it for a window counter, whose
    /// cold share is half the rate).
    nodes: u64,
}

impl Cooler<'_> {
    fn cools(&self, cell: &SyncCell, books: &Books, policy: &SyncPolicy) -> bool {
        books.fleet != 0
            && !books.pending
            && !books.announce
            && books.announced_until <= self.server_ms
            && !self.announced.contains_key(&books.fleet)
            && policy.shared == SharedQuota::default()
            && policy.cold.is_some()
            && Self::light(books.usage, self.nodes)
            && key::has_nothing_pending(cell)
    }

    /// Whether a key that admits `usage` (a weight) here is light enough to return cold:
    /// under 3/4 of this node's even share, `WEIGHT_ONE / even` (a key throttled to its
    /// fair share under contention admits its share, and stays hot).
    fn light(usage: u64, even: u64) -> bool {
        usage.saturating_mul(even).saturating_mul(4) < WEIGHT_ONE * 3
    }
}

/// Puts the checks of `store` in `fail_mode`: `Open` and `Closed` set every key's outage
/// mode; `Local` runs on the books, with nothing to set.
pub(crate) fn apply_fail_mode<K: Hash + Eq>(fail_mode: FailMode, store: &Store<K, SyncCell>) {
    match fail_mode {
        FailMode::Open => set_outage(store, OutageMode::Open),
        FailMode::Closed => set_outage(store, OutageMode::Closed),
        FailMode::Local => {}
    }
}

fn set_outage<K: Hash + Eq>(store: &Store<K, SyncCell>, outage: OutageMode) {
    let policy = store.default_policy();
    store.set_policy(SyncPolicy { outage, ..policy }, 0);
}

/// The local fallback of a node whose task died: [`FailMode::Local`]'s refill of every
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::RateLimiter;

    const MS: u64 = 1_000_000;

    /// A node of `config` for a limiter of `quota`, on a store as the limiter builds it.
    fn node(config: RedisSync, quota: Quota) -> (Node<String>, Store<String, SyncCell>) {
        let settings = config.validate(quota.period_ns()).unwrap();
        let (shape, capacity) = Shape::with_capacity(Algorithm::TokenBucket, quota).unwrap();
        let node_config = NodeConfig::new(
            7,
            &config,
            &settings,
            Algorithm::TokenBucket,
            quota,
            capacity,
        )
        .unwrap();
        let mut policy = SyncPolicy::new(quota, capacity, 0, node_config.timing.interval_ns);
        policy.ticks = shape.ticks_per_token();
        let (_, limits, _) = RateLimiter::<String>::builder(quota).into_parts().unwrap();
        let store = Store::new(limits, node_config.initial_policy(policy));
        (Node::new(node_config, 1, 0), store)
    }

    /// Runs the node to `until` (ns) with every transmit failing at once (Redis refuses
    /// the connection), waking it at each of its timeouts.
    fn refused(node: &mut Node<String>, store: &Store<String, SyncCell>, from: u64, until: u64) {
        let mut now = from;
        while now < until {
            if let Some(t) = node.poll_transmit(now, store) {
                let failure = Failure {
                    kind: "unavailable",
                    message: "refused".into(),
                };
                node.handle_replies(now, store, t.id, vec![Err(failure); t.pipelines.len()]);
                continue;
            }
            now = node.poll_timeout().max(now + 1).min(until);
            node.handle_timeout(now, store);
        }
    }

    /// Runs the node to `until` (ns) against the model of Redis, every reply coming at
    /// once.
    fn served(
        node: &mut Node<String>,
        store: &Store<String, SyncCell>,
        redis: &mut crate::sync::model::Server,
        from: u64,
        until: u64,
    ) {
        let mut now = from;
        while now < until && !node.is_closed() {
            if let Some(t) = node.poll_transmit(now, store) {
                let replies = t
                    .pipelines
                    .iter()
                    .map(|p| {
                        Ok(p.iter()
                            .map(|c| redis.run(c, now / 1_000).unwrap())
                            .collect())
                    })
                    .collect();
                node.handle_replies(now, store, t.id, replies);
                continue;
            }
            now = node.poll_timeout().max(now + 1).min(until);
            node.handle_timeout(now, store);
        }
    }

    /// After its last rounds, a stopped node denies every check: a new key's fresh
    /// overdraft (reconcile mode), or a cold key's share, would be admitted with no
    /// round to report it.
    #[test]
    fn a_stopped_node_denies_every_check() {
        let quota = Quota::per_second(100).unwrap();
        for cold in [false, true] {
            let config = RedisSync::new("redis://127.0.0.1:1/").cold_keys(cold);
            let (mut node, store) = node(config, quota);
            let mut redis = crate::sync::model::Server::default();
            served(&mut node, &store, &mut redis, 0, 500 * MS);
            let check = |key: &str, now: u64| store.check(key, || now, 1, u64::MAX).unwrap();
            assert!(check("before", 500 * MS).is_allowed(), "cold {cold}");
            node.close(500 * MS);
            served(&mut node, &store, &mut redis, 500 * MS, 600 * MS);
            assert!(node.is_closed() && node.is_settled());
            for key in ["before", "new"] {
                let decision = check(key, 700 * MS);
                assert!(!decision.is_allowed(), "cold {cold}, {key}: {decision:?}");
            }
        }
    }

    /// Nodes of one prefix that sync by other terms find out from what Redis holds: the
    /// first setting that differs is in the stats and an event, and goes once they agree.
    #[test]
    fn nodes_that_differ_in_their_terms_say_so() {
        let quota = Quota::per_second(100).unwrap();
        let config = RedisSync::new("redis://127.0.0.1:1/");
        let mut redis = crate::sync::model::Server::default();
        let (mut a, store_a) = node(config.clone(), quota);
        served(&mut a, &store_a, &mut redis, 0, 100 * MS);
        assert_eq!(a.stats().settings_differ, None);
        for (other, setting) in [
            (config.clone().cold_keys(false), "cold_keys"),
            (config.clone().mode(SyncMode::Lease), "mode"),
        ] {
            let (mut b, store_b) = node(other, quota);
            b.config.id = 8;
            served(&mut b, &store_b, &mut redis, 100 * MS, 200 * MS);
            assert_eq!(b.stats().settings_differ, Some(setting));
            let events: Vec<Event> = std::iter::from_fn(|| b.poll_event()).collect();
            assert!(
                events
                    .iter()
                    .any(|e| matches!(e, Event::Disagreement(d) if d.setting == setting)),
                "{events:?}"
            );
        }
        // Node A sees them too at its next write of its terms (every 10 s).
        served(&mut a, &store_a, &mut redis, 100 * MS, 10_200 * MS);
        assert!(a.stats().settings_differ.is_some());
        // Once they have gone stale (30 s), it agrees again.
        served(&mut a, &store_a, &mut redis, 10_200 * MS, 45_000 * MS);
        assert_eq!(a.stats().settings_differ, None);
    }

    /// A first round whose read of the announcements comes back while its heartbeat is
    /// lost tells no node count: the node admits nothing on its cold keys until one
    /// does (a share "of no node" would be the whole quota).
    #[test]
    fn a_read_without_a_node_count_vouches_for_no_share() {
        let quota = Quota::per_second(100).unwrap();
        let (mut node, store) = node(RedisSync::new("redis://127.0.0.1:1/"), quota);
        let mut redis = crate::sync::model::Server::default();
        node.handle_timeout(1, &store);
        let t = node.poll_transmit(1, &store).unwrap();
        // The round's calls (the heartbeat) time out; the read of the announcements (and
        // of the terms) comes back.
        let replies = t
            .pipelines
            .iter()
            .map(|p| {
                if p.iter().any(|c| c.script == wire::Script::Round) {
                    Err(Failure::timeout())
                } else {
                    Ok(p.iter().map(|c| redis.run(c, 0).unwrap()).collect())
                }
            })
            .collect();
        node.handle_replies(2 * MS, &store, t.id, replies);
        let admitted = (0..100)
            .filter(|_| {
                store
                    .check("k", || 3 * MS, 1, u64::MAX)
                    .unwrap()
                    .is_allowed()
            })
            .count();
        assert_eq!(admitted, 0);
        assert!(!node.stats().cold_tier, "{:?}", node.stats());
    }

    #[test]
    fn a_node_that_never_reached_redis_serves_its_keys_from_the_fallback() {
        let quota = Quota::per_second(100).unwrap();
        let config = RedisSync::new("redis://127.0.0.1:1/")
            .interval(Duration::from_millis(10))
            .timeout(Duration::from_millis(20));
        let (mut node, store) = node(config, quota);
        let check =
            |key: &str, now: u64| store.check(key, || now, 1, u64::MAX).unwrap().is_allowed();
        assert!(
            !check("a", 0) && !check("b", 0),
            "nothing before the first round"
        );
        refused(&mut node, &store, 0, 100 * MS);
        assert!(node.stats().fallback_active);
        // Keys seen after the fallback began start hot, and get their budget at the
        // next refill: `⌊100 / 1⌋` each (no node count known), then nothing more.
        let _ = (check("a", 100 * MS), check("b", 100 * MS));
        refused(&mut node, &store, 100 * MS, 200 * MS);
        let admitted = (0..150).filter(|_| check("a", 200 * MS)).count();
        assert_eq!(admitted, 100);
        assert!(check("b", 200 * MS));
        assert_eq!(node.stats().keys_on_budget, 2, "{:?}", node.stats());
        refused(&mut node, &store, 200 * MS, 2_000 * MS);
        assert!(!check("a", 2_000 * MS), "one budget per outage");
    }
}
