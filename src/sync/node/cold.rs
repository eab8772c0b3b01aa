//! The cold tier, from the node's side: which keys other nodes announced hot, which of
//! this node's keys must turn hot (or may return cold), and the cold share the
//! limiter's checks admit at.

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
