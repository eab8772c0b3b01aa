//! The cold tier, from the node's side: which keys other nodes announced hot, which of
//! this node's keys must turn hot (or may return cold), and the cold share the
//! limiter's checks admit at.
//!
//! # Cold keys
//!
//! Most keys are nowhere near their limit and need no coordination. With
//! [`RedisSync::cold_keys`] (on by default in reconcile mode), a key starts **cold** on
//! every node: each node admits on it at its even share of the quota, locally — a GCRA of
//! `⌊B / N⌋` at once and `r / N` after (half of each for the window counters, so that no
//! window admits more than `B / N`) — with no Redis round trip and nothing to report.
//! The nodes' shares add up to at most the quota, so **while a key is cold everywhere,
//! the global limit holds exactly**, whatever the number of keys. An idle cold key
//! (its share whole again for a second) is dropped, so memory follows the keys in use.
//!
//! A key turns **hot** on a node when its share there runs out (that check is denied:
//! the node's share is spent). The node announces it — a sorted set
//! `{prefix}:sync:algorithm:hot`, each member a key's Redis key, renewed while the key is
//! synced — and its first round reports as admitted what its cold share still has in use
//! (how far its GCRA stands ahead of now), so the key's global state starts where the
//! node's share left off. Every node reads the announcements with each round (one more
//! small call) and turns the key hot at its next round, reporting its own share's use
//! the same way; a node that sees the key for the first time after the announcement
//! turns it hot at its next round too. From then on the key is synced as above. Keys
//! turn hot one by one, so the 1,000 hottest keys cost what 1,000 synced keys cost, and
//! the rest nothing.
//!
//! A hot key **returns cold** once it is in light use everywhere. Each node averages the
//! key's use (what it admitted, over `τ`: the quota's period within 1 to 60 s, or 20
//! tokens of the even share if that is longer) and renews the announcement only while
//! that use is at least 3/4 of its even share `r / N` (or the key has a quota of its
//! own). Once no node renews it, the announcement lapses after its lifetime `L` (four
//! times `max(share_ttl, staleness)`, at least 10 s); each node then returns the key
//! cold at its next round, if its own use is still light: that round reports everything
//! and gives the lease back, and from its answer the key admits at the node's cold
//! share again, with no round. So a key whose demand falls under half its even share on
//! every node costs Redis nothing again within `5·τ + L + 2` rounds (the simulation
//! asserts it over 1,000 runs). A key throttled to its fair share under contention uses
//! its share, and stays hot.
//!
//! While a key turns hot, the other nodes go on admitting at their shares until they
//! have turned it hot (at most two rounds: `2.5·I + 2·Δ`), and the global state refills at
//! the whole rate meanwhile: the bounds below grow by **`r·(2.5·I + 2·Δ)`** in lease
//! and reconcile mode alike, once per turn (which is why the tier is off by default in
//! lease mode). A node that first sees the key after it turned hot elsewhere may admit
//! up to its cold share's burst, `⌊B / N⌋`, before its next round turns it hot; that is
//! charged at that round. The simulation asserts the bound at every instant over 1,000
//! generated turns (one node, several or all at once; 1 to 16 nodes; the others idle or
//! just under their shares; with and without lost and late rounds).
//!
//! A node may admit on its cold keys only while it has read the announcements within
//! `share_ttl` (at least the staleness): the share it spends is then the one the others
//! left it. Past that (it is cut off from Redis), a cold key spends only what its share
//! held then, with no refill (the fallback's one-time budget), and new keys start hot
//! under the [`FailMode`]; a `warn` event says so. So that a node that drops out of the registry does
//! not hand its share to the others while it may still spend it, the node count a share
//! divides by is the largest seen in that time. A node cut off from Redis may miss a key
//! turning hot and go on at its share on it until its reads lapse: at most `⌊B / N⌋ +
//! r·share_ttl / N` per such key and cut-off node, a fixed term. Until a node has first
//! read the announcements (with its first round), its new keys start cold and wait for
//! it, as a new key waits for its first lease without the tier.
//! A cold key's state lives on its node only: a node that restarts, or evicts a cold key
//! from a full store, forgets what its share had in use, and may admit its share's burst
//! again — at most `⌊B / N⌋` more per key and restart (or eviction). A shutdown flushes
//! only the hot keys.
//! The tier is off when a node's share of the burst is under one token (`B < N`; `B <
//! 2·N` for the sliding window). [`SyncStats`] tells whether it is on, how many keys are
//! hot and how many this node turned hot.

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::Hash;
use std::sync::atomic::Ordering;

use super::super::books::Books;
use super::super::cell::{Cold, NEW, NOTED, SyncCell, SyncPolicy, WANT_HOT};
use super::super::key;
use super::super::protocol::{SharedQuota, WEIGHT_ONE};
use super::super::wire::HotReply;
use super::{Event, Node, NodeConfig, Synced};
use crate::store::Store;

/// What this node knows of the keys turned hot, and of its cold tier.
#[derive(Debug, Default)]
pub(super) struct HotView {
    /// Each announced key's [`key::fleet_hash`], and until when (Redis ms) it is hot.
    pub(super) keys: HashMap<u64, u64>,
    /// The next read returns the announcements from this score on (ms).
    pub(super) from_ms: u64,
    /// Another node announced a key new to `keys`: every cold key is looked up at the
    /// next round.
    pub(super) rescan: bool,
    /// When (limiter clock, ns) the last successful read was sent.
    pub(super) read_at: Option<u64>,
    /// Redis's clock (ms) at the last read.
    pub(super) server_ms: u64,
    /// The node count the cold shares divide by: the largest seen within the validity
    /// (a node that dropped out of the registry may still admit on its cold keys until
    /// its own validity ends), and when (limiter clock, ns) it was last seen.
    pub(super) nodes: u64,
    pub(super) nodes_at: u64,
    /// Keys turned hot, and returned cold, since the start.
    pub(super) turned: u64,
    pub(super) cooled: u64,
}

impl<K> Node<K>
where
    K: Hash + Eq + Clone + Display,
{
    /// Whether keys may return cold at this round, and by what rule (see [`Cooler`]).
    pub(super) fn cooler(&self, now: u64, stopping: bool) -> Option<Cooler<'_>> {
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
    pub(super) fn even_share_divisor(&self) -> u64 {
        let windowed = self.config.cold.as_ref().is_some_and(|c| c.windowed);
        self.hot.nodes.max(1) * if windowed { 2 } else { 1 }
    }

    /// Takes in a read of the announcements sent at `sent` (limiter clock, ns), whose
    /// round announced the keys of fleet hashes `announced` itself.
    pub(super) fn heard_hot(&mut self, read: HotReply, sent: u64, announced: &[u64]) {
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
    pub(super) fn update_cold(&mut self, now: u64, store: &Store<K, SyncCell>) {
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
}

/// Looks at one key that changed (see [`Node::look_at_changes`]).
pub(super) struct Visit<'a, K> {
    pub(super) config: &'a NodeConfig,
    pub(super) hot: &'a mut HotView,
    pub(super) synced: &'a mut Synced<K>,
    pub(super) now: u64,
    pub(super) cold_t_ns: u64,
    /// Every key is looked at: cold ones are checked against the announcements too.
    pub(super) every: bool,
}

impl<K: Hash + Eq + Clone + Display> Visit<'_, K> {
    pub(super) fn key(&mut self, key: &K, cell: &SyncCell) {
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
pub(super) struct Cooler<'a> {
    pub(super) announced: &'a HashMap<u64, u64>,
    pub(super) server_ms: u64,
    /// The even share's divisor: the node count (twice it for a window counter, whose
    /// cold share is half the rate).
    pub(super) nodes: u64,
}

impl Cooler<'_> {
    pub(super) fn cools(&self, cell: &SyncCell, books: &Books, policy: &SyncPolicy) -> bool {
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
    pub(super) fn light(usage: u64, even: u64) -> bool {
        usage.saturating_mul(even).saturating_mul(4) < WEIGHT_ONE * 3
    }
}
