//! Background sync (cargo feature `redis`): a local limiter, [`SyncedLimiter`] (made by
//! [`Builder::build_synced`](crate::Builder::build_synced)), that approximates — or, with
//! [`SyncMode::Lease`], never exceeds — one global limit shared by many nodes through
//! Redis. Its algorithm is the token bucket, the leaky bucket, the sliding window or the
//! fixed window (the sliding log is a build error: its per-request timestamps cannot be
//! leased out as counts); its default quota is the same on every node, set when it is
//! built. A key's own quota ([`SyncedLimiter::set_quota`]) is set on one node and
//! travels with the key's rounds: Redis adopts the latest (by the setting node's clock),
//! converting the key's state so that what was used stays used (a change never hands
//! out a fresh burst), and every other node learns it from its next answer on the key.
//!
//! The leaky bucket admits what the token bucket admits for the same quota (its Redis
//! state is the token bucket's, under keys of its own), and shapes: each node queues
//! its admissions at its even share of the rate, so [`Decision::delay`](crate::Decision::delay)
//! is the wait for the slot, and the fleet's outflow never exceeds the rate. The fixed
//! window is the sliding window's state with the previous window weighing nothing.
//!
//! Checks stay local. A synced key holds, on each node, tokens **leased** from the global
//! state and, in reconcile mode, an **overdraft**; a check spends them by CAS — no await,
//! no I/O, no lock shared with the sync task. About every `interval` (jittered by ±25%)
//! one tokio task per limiter sends, for the keys that need it only (at most
//! [`RedisSync::round_keys`]: keys that ran out first, then keys with something to
//! report, then idle keys to release), one script call per
//! [`RedisSync::batch_size`] keys, pipelined in one round trip with the node's heartbeat.
//! Sync traffic is O(keys near their limit) with the cold tier (below), O(active keys)
//! without it, and never O(requests).
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
//!
//! # A round
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
//!
//! # Bounds
//!
//! Let `B` be the capacity (the burst for the token and leaky buckets, the limit for the
//! window counters), `r` the rate, `N` the number of nodes, `I` the interval, `H = 2·I` the
//! holding horizon and `Δ` the round timeout. In any interval of length `t`, all nodes
//! together admit at most `x + r·t`, with
//!
//! ```text
//! lease:      x = B + (r·H + 2·N)                                  (token bucket)
//! reconcile:  x = B + (r·H + 2·N) + (B + r·H + N) + r·(I + Δ)      (token bucket)
//! ```
//!
//! (the leases held when the interval starts; the overdrafts outstanding; the overdraft
//! units admitted before the round that charges them). Over the long run the rate is the
//! limit: the simulation checks it within ±3% over 50 s, plus `N + 2` tokens, against
//! what one exact limiter admits on the same requests (which is less than `r` only when
//! the burst is too small to absorb the arrivals' jitter). The leaky bucket's bounds are
//! the token bucket's. For the window counters: at most the limit per window of Redis's
//! clock in lease mode (a lease is void when the window it was granted in ends: what a
//! node kept of it goes back to that window at its first round in the next, and the node
//! drops it); at most `B + 2·(B + B·H/period + N)` per window in reconcile mode, plus
//! `B·H/period + 2·N` for the fixed window (leases carried from the window before, which
//! weighs nothing).
//!
//! A strict lease moves at most the burst per round and node: lease mode admits the full
//! rate only when `B ≥ r·H + 1`, and rides out a round that times out only when `B ≥
//! r·(H + Δ) + 1`. Reconcile mode has no such limit.
//!
//! # Outages and partitions
//!
//! The check path never touches Redis, so an outage cannot block it. When no round has
//! succeeded for [`RedisSync::staleness`] (3 intervals or 500 ms by default), the
//! [`FailMode`] applies. Redis cannot tell a node cut off alone from a Redis everyone
//! lost, so the default, [`FailMode::LocalShare`], is built for both (Doorman's leases
//! work this way):
//!
//! - **A reserved share for a duration.** Every answer reserves for the node, on the key,
//!   a share of the rate (an even split among the registry's `N` nodes, out of what the
//!   others' unexpired reservations leave) until [`RedisSync::share_ttl`] (10 s by
//!   default) after the round. Once the node is **silent** (neither a round on the key nor
//!   a heartbeat for the staleness and one round timeout), or reports tokens from its
//!   fallback (its requests reach Redis but its answers do not: an asymmetric partition),
//!   every other node's round charges the global state with the node's share up to now,
//!   so the others share only the rest. Meanwhile the node's fallback admits at exactly
//!   that share, up to its share of the capacity at once.
//! - **Then a one-time budget.** When the reservation ends (the node knows when, a round
//!   trip early), the key gets `⌊B / N⌋` (at least 1) for the rest of the outage, and
//!   nothing more ([`FailMode::Closed`] denies instead). A node that still owes for a
//!   budget gets no new one, however often its link flaps.
//! - **Debt stays with the node that made it.** When the node is heard again, what it
//!   admitted comes first out of what was charged on its behalf (the unused part goes back,
//!   as far as it still lies ahead of now); what its budget admitted beyond that is the
//!   node's own debt, repaid out of its own credit at an eighth of its share's pace while
//!   it keeps leasing with the rest: the healthy nodes' shares are untouched, and the
//!   rate right after the heal stays near the limit. Credit does not accrue while a
//!   node's share is charged on its behalf.
//! - **A dead node** costs the others at most `share_ttl` of its share. A node that
//!   shuts down cleanly reserves nothing.
//!
//! So **one node, or `k` of the `N`, cut off from Redis for any length of time** add at
//! most `2·(B + N)` to the bounds above (each cut node's budget, what it holds when cut,
//! and the part of its share admitted in the staleness before Redis starts charging it),
//! and this term **does not grow with the partition's length**. The simulation asserts
//! it at every instant over 1,000 generated partitions (one node, `k` of `N`, blackholed,
//! replies lost while requests apply, flapping; 10 s and 30 s; 2 to 16 nodes; `share_ttl`
//! of 0, 5, 10 and 30 s), and `tests/redis_tier/partition.rs` confirms it on real processes behind
//! a TCP proxy. A restart that empties Redis adds `3·B + 2·N` (the fresh state starts
//! full).
//!
//! A whole-Redis outage longer than `share_ttl` leaves each node its budget and then
//! nothing until Redis answers (it cannot know that the others are cut off too): set
//! `share_ttl` to the longest outage to ride at the share rate. When Redis answers again,
//! what was admitted is charged, spread back over the outage (rounds queued in a paused
//! Redis all spread from the last acknowledged round; an on-time round after one whose
//! answer was lost, no further back than that one); if Redis lost the key's state (an
//! empty restart, a failover), what the local fallback admitted is forgiven — it was the
//! share of a refill no state recorded — and everything else is charged. The task
//! retries at the next interval, then backs off up to 500 ms. The simulation checks that
//! 2 s after Redis answers again the rate is back within ±10%, and that each of the 3 s
//! after a partition heals admits at least 70% of the limit.
//!
//! If the task dies (a bug), [`SyncStats::task_died`] says so and the configured
//! fallback applies from then on.
//!
//! # Costs settled after the fact
//!
//! [`SyncedLimiter::charge`] and [`SyncedLimiter::refund`] move the floor the node
//! reports: a charge of `n` spends what the node holds of the key (its lease, then its
//! overdraft) and raises the next floor by `n` in all, a refund lowers it by `n` (by at
//! most what the node reported spent on the key: units reserved on another node are
//! refunded there). Neither waits for Redis. At the key's next round Redis charges the
//! global state with the difference, into debt however deep (charged from the round's
//! instant, not spread back over the time since the node's last round), or gives the
//! units back, never beyond full; while the state is in debt beyond what refills by a
//! node's next round, no node is granted a lease or an overdraft on the key. So a
//! charge's debt is repaid at the quota's rate before the fleet admits more, less what
//! the nodes held when it landed (their leases and overdrafts, and grants on their
//! way). A cold key settles on its node's share at once, and a charge that leaves its
//! share in debt turns it hot, its first round reporting the debt. The window counters
//! refund (Redis lowers the count of the window the node's units were counted in) but
//! cannot be charged, as in process.
//!
//! The simulation checks this over 1,000 generated runs (1 to 16 nodes, 1/s to
//! 100,000/s, both modes, sparse to 10× load, charges up to four bursts at once): Redis
//! grants nothing in debt, and every admission leaves what was consumed (admitted, plus
//! charged, less refunded) within the bound plus `r·H + 2·N`, the leases held around a
//! charge; the Lua differential covers floors raised into debt and lowered by refunds.
//! Not covered there: a node in its fallback (its rounds failing) admits its budget
//! whatever the global state's debt, as in any outage, and the other nodes of a cold key
//! admit at their shares until it has turned hot on them.
//! On real processes, a charge and a refund made while one node is cut off alone, or
//! while Redis is paused, reach Redis exactly once the link heals (the test
//! `settlements_made_while_cut_off_reach_redis_once_it_heals`). Across an empty
//! restart of Redis a settlement is not exact: one that spent a lease reserved in the
//! lost state was seen lost with it (a charge of 4 and a refund of 2 left a debt of 1,
//! not 2), as an empty restart loses any consumption Redis held.
//!
//! # Several quotas
//!
//! A limiter built with [`Builder::also`](crate::Builder::also) quotas holds each key to
//! every quota, as in process: a check admits only if every quota admits, and consumes
//! from all or from none. Each quota is synced by a task of its own, under Redis keys of
//! its own (`<tag>+<i>` after the algorithm's tag for the `i`th `also` quota), each with
//! its own leases, overdrafts, cold shares and fallback; the [`SyncHandle`] stands for
//! them all (its [`stats`](SyncHandle::stats) sum them,
//! [`quota_stats`](SyncHandle::quota_stats) has each). So each quota keeps its own
//! bound above, whatever the others do: the fleet never admits more than any single
//! quota's bound.
//!
//! A check goes through the quotas in order, spending each that admits; when one
//! denies, the ones before it get their units back. A cold key's share takes them back
//! at once; a hot key's come back as a refund with its next round (this node's lease
//! does not grow before Redis has them). So for up to one interval after a deny, the
//! quotas before the one that denied may hold back units of the key on this node:
//! requests may be denied that would otherwise have passed, never the reverse. A
//! deny's `retry_after` is one interval, as for any synced deny; with several quotas the
//! decision is the one with the fewest units left. [`charge`](SyncedLimiter::charge)
//! and [`refund`](SyncedLimiter::refund) settle every quota.
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
//!
//! # Nodes
//!
//! Each node heartbeats a sorted set in Redis every round; a node whose heartbeat is
//! older than [`RedisSync::node_ttl`] (3 intervals or 1 s by default) drops out of `N`.
//! Until its first round tells `N`, a node gives new keys nothing to spend before their
//! first lease; then, in reconcile mode, a new key may spend `⌊B / N⌋` before it.
//! Each key's state is its own Redis hash, `prefix:sync:algorithm:{key}` (one Cluster
//! slot per key), holding the global state and one record per node.
//!
//! Nodes of one prefix share its keys' state, so they must sync by the same terms: the
//! algorithm, the mode, the cold tier and the default quota. Each node writes its terms
//! to `{prefix}:sync:settings` with its first round and every 10 s, and reads the
//! others': a build with [`RedisSync::require_connection`] fails with
//! [`ConfigError::SyncSettingsDiffer`](crate::ConfigError::SyncSettingsDiffer), and a
//! running node says so ([`SyncStats::settings_differ`], a `warn` event).
//! A node that was shut down, or whose limiter its users all dropped, has given its
//! leases back and left: its limiter denies every check from then on.
//!
//! # Redis Cluster
//!
//! With [`RedisSync::cluster`], a script call's keys must share a slot: a round sends
//! each slot's keys in calls of their own (at most [`RedisSync::batch_size`] keys each),
//! all at once over the cluster connection, and the heartbeat as one more call. Answers
//! that arrive are applied even when another call of the round failed (a master in
//! failover), so a key's books always match Redis; the round counts as failed, and the
//! staleness (so the fallback) runs, until every call succeeds. Each key's state uses
//! the clock of the master that holds it.
//!
//! Replication is asynchronous: a failover can lose the last writes of the dead master,
//! the leases granted just before it died among them. Lease mode's bound then grows by
//! one burst `B` (leases the new master does not know of), besides the fallback's
//! `2·(B + N)` while the key's master is missing.
//!
//! # Redis Sentinel
//!
//! With [`RedisSync::sentinel`], the task connects to the primary the sentinels name,
//! and a round that fails for want of a server (or meets a demoted primary's
//! `READONLY`) makes it ask them again (see
//! [`RedisOptions::sentinel`](crate::redis::RedisOptions::sentinel)). A failover is an
//! outage of every key at once, as a dead master is for its slots on a Cluster, and the
//! same bound holds: the fallback's `2·(B + N)` while no primary answers, and in lease
//! mode one burst `B` of leases the promoted replica never heard of.
//!
//! # Clocks
//!
//! Global state uses Redis's `TIME` only, so a node whose clock is skewed or jumps cannot
//! mint tokens. Each round measures Redis's clock against the limiter's (to express
//! deadlines and outage starts in Redis's time) and against the wall clock
//! ([`SyncStats::clock_offset`]).
//!
//! Redis's `TIME` is its host's wall clock, so the limit moves with it: a step forward by
//! `d` refills `min(r·d, B)` at once, and a step back withholds `r·d`. Run Redis's host
//! with a slewing clock (chrony, ntpd), not a stepping one.

mod agree;
mod books;
mod build;
mod cell;
mod config;
#[cfg(test)]
mod differential;
mod driver;
mod key;
mod limiter;
#[cfg(test)]
mod model;
mod node;
mod observe;
mod protocol;

#[cfg(test)]
mod sim;
mod task;
mod transport;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use config::{FailMode, RedisSync, SyncMode};
pub use limiter::SyncedLimiter;

/// A snapshot of a sync task's health.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SyncStats {
    /// Time since the last successful round, if there was one.
    pub last_success_age: Option<Duration>,
    /// Successful rounds.
    pub syncs: u64,
    /// Failed rounds.
    pub errors: u64,
    /// Keys sent in the last successful round.
    pub keys_last_round: usize,
    /// Whether the fallback policy is in force.
    pub fallback_active: bool,
    /// Live nodes, as last seen in Redis (0 before the first successful round).
    pub nodes: u64,
    /// Redis's clock minus this machine's wall clock, in nanoseconds, estimated at the
    /// midpoint of the last successful round trip (0 before the first).
    pub clock_offset: i64,
    /// Keys that needed a round but did not fit in the last one (see
    /// [`RedisSync::round_keys`]); they go in the next rounds.
    pub keys_waiting: usize,
    /// Answers Redis marked stale (a round older than one it had applied); they change
    /// nothing.
    pub stale_answers: u64,
    /// Synced keys released (lease returned) and dropped after going idle; while rounds
    /// are saturated, an idle key with nothing to report is released without a round
    /// (its lease given up, not returned: Redis charged it when it granted it).
    pub keys_released: u64,
    /// The sync task died (a bug): checks apply the configured [`FailMode`] from then on.
    pub task_died: bool,
    /// Why the last round failed, while rounds fail (`None` once one succeeds):
    /// `authentication` (a wrong password or user: fix the URL; retrying will not help),
    /// `timeout`, `unavailable` (refused, dropped, or a cluster slot without a master),
    /// `script` (Redis refused the round's script), `reply` (an answer the task cannot
    /// read), `unknown_master` (no sentinel monitors the master name given to
    /// [`RedisSync::sentinel`]) or `redis` (any other error reply).
    pub last_error: Option<&'static str>,
    /// Whether this node admits on cold keys now (see [`RedisSync::cold_keys`]): on
    /// once it has read the keys turned hot, off once it has not for `share_ttl`.
    pub cold_tier: bool,
    /// Keys announced as hot, as this node last read them.
    pub hot_keys: usize,
    /// Keys this node turned from cold to hot (its own share ran out, or another node
    /// announced them).
    pub keys_turned_hot: u64,
    /// Keys this node returned from hot to cold (no node announced them any more, and
    /// their demand here was below this node's even share).
    pub keys_cooled: u64,
    /// Keys whose reserved share ran out during an outage, so that they got the
    /// fallback's one-time budget (counted each time; each is a `warn` event).
    pub keys_on_budget: u64,
    /// The first setting on which another node of this prefix differs, as last read
    /// (`algorithm`, `mode`, `cold_keys` or `quota`; a `warn` event says whose value):
    /// nodes that share a prefix share its keys' state, and must agree on them, or the
    /// bound does not hold. `None` while they agree.
    pub settings_differ: Option<&'static str>,
}

impl SyncStats {
    /// This snapshot and `other`'s together (see [`SyncHandle::stats`]).
    fn with(self, other: &SyncStats) -> SyncStats {
        SyncStats {
            last_success_age: match (self.last_success_age, other.last_success_age) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            },
            syncs: self.syncs + other.syncs,
            errors: self.errors + other.errors,
            keys_last_round: self.keys_last_round + other.keys_last_round,
            fallback_active: self.fallback_active || other.fallback_active,
            nodes: self.nodes.min(other.nodes),
            clock_offset: self.clock_offset,
            keys_waiting: self.keys_waiting + other.keys_waiting,
            stale_answers: self.stale_answers + other.stale_answers,
            keys_released: self.keys_released + other.keys_released,
            task_died: self.task_died || other.task_died,
            last_error: self.last_error.or(other.last_error),
            cold_tier: self.cold_tier && other.cold_tier,
            hot_keys: self.hot_keys + other.hot_keys,
            keys_turned_hot: self.keys_turned_hot + other.keys_turned_hot,
            keys_cooled: self.keys_cooled + other.keys_cooled,
            keys_on_budget: self.keys_on_budget + other.keys_on_budget,
            settings_differ: self.settings_differ.or(other.settings_differ),
        }
    }
}

/// The state a sync task shares with its handle.
#[derive(Debug, Default)]
pub(crate) struct TaskShared {
    pub(crate) stats: Mutex<StatsCell>,
    pub(crate) wake: tokio::sync::Notify,
    pub(crate) stop: tokio::sync::Notify,
    /// Whether checks decide as they will from now on (see [`SyncHandle::ready`]).
    settled: std::sync::atomic::AtomicBool,
    /// Wakes [`SyncHandle::ready`] when `settled` turns true.
    settled_now: tokio::sync::Notify,
    /// Makes the task panic at its next wake-up, to test the supervisor.
    #[cfg(test)]
    pub(crate) poison: std::sync::atomic::AtomicBool,
}

impl TaskShared {
    /// Marks the sync settled (once): the first round has been answered and, with the
    /// cold tier, the keys turned hot elsewhere have been read; or the fail mode applies;
    /// or the task has stopped.
    pub(crate) fn settle(&self) {
        if !self.settled.swap(true, std::sync::atomic::Ordering::AcqRel) {
            self.settled_now.notify_waiters();
        }
    }

    pub(crate) fn is_settled(&self) -> bool {
        self.settled.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The task's counters; ages are computed when read.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    pub(crate) last_success: Option<std::time::Instant>,
    pub(crate) stats: SyncStats,
}

/// The running sync task of one limiter, for its [`stats`](Self::stats) and an explicit
/// [`shutdown`](Self::shutdown).
///
/// **Dropping the handle leaves the sync running for the limiter's life:** once every
/// clone of the limiter has been dropped too, the task runs a last round that reports
/// what was admitted and returns every lease (as `shutdown` does), then stops, within a
/// second or one interval. `shutdown` stops it now, and returns once that round is done.
///
/// ```no_run
/// use tollgate::sync::RedisSync;
/// use tollgate::RateLimiter;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (limiter, handle) = RateLimiter::<u64>::builder("10/s".parse()?)
///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
/// limiter.check(&1);
/// let stats = handle.stats();
/// if stats.fallback_active {
///     eprintln!("Redis unreachable: {:?}", stats.last_error);
/// }
/// handle.shutdown().await; // reports what this node admitted, returns its leases
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "dropping the handle leaves the sync running until the limiter is dropped; \
              keep it for `stats()` and a flushing `shutdown().await`"]
pub struct SyncHandle {
    name: String,
    shared: Arc<TaskShared>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// The tasks of the limiter's [`also`](crate::Builder::also) quotas, in order.
    also: Vec<SyncHandle>,
}

impl SyncHandle {
    /// The task's name: `tollgate-sync-<node id>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node id this limiter heartbeats under.
    pub fn node_id(&self) -> &str {
        self.name.trim_start_matches("tollgate-sync-")
    }

    /// The handle of the limiter's own quota's task, standing for the tasks of its
    /// [`also`](crate::Builder::also) quotas too.
    pub(crate) fn with_also(self, also: Vec<SyncHandle>) -> Self {
        Self { also, ..self }
    }

    /// A snapshot of the task's health. With [`also`](crate::Builder::also) quotas (a
    /// task each), the tasks' snapshots together: the counters summed, the fault flags
    /// (`fallback_active`, `task_died`) set if any task's is, `cold_tier` only if every
    /// task's is, the oldest success (none until every task has had one), the fewest
    /// nodes seen, the first task's clock offset, and the first error;
    /// [`quota_stats`](Self::quota_stats) has each.
    pub fn stats(&self) -> SyncStats {
        self.also
            .iter()
            .fold(self.own_stats(), |all, also| all.with(&also.own_stats()))
    }

    /// Each quota's task's snapshot: the limiter's own quota first, then each
    /// [`also`](crate::Builder::also) quota in the order they were added.
    ///
    /// ```no_run
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (_limiter, handle) = RateLimiter::<u64>::builder("10/s".parse()?)
    ///     .also("1000/day".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// for (quota, stats) in handle.quota_stats().iter().enumerate() {
    ///     if stats.fallback_active {
    ///         eprintln!("quota {quota}: Redis unreachable: {:?}", stats.last_error);
    ///     }
    /// }
    /// handle.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn quota_stats(&self) -> Vec<SyncStats> {
        std::iter::once(self)
            .chain(&self.also)
            .map(SyncHandle::own_stats)
            .collect()
    }

    fn own_stats(&self) -> SyncStats {
        let cell = self.shared.stats.lock();
        SyncStats {
            last_success_age: cell.last_success.map(|t| t.elapsed()),
            ..cell.stats
        }
    }

    /// Waits until the limiter's checks decide as they will from now on: until the first
    /// round has been answered and, with the cold tier (`RedisSync::cold_keys`), this node
    /// has read which keys are hot elsewhere. Until then a new key's check is denied
    /// (with a `retry_after` of one interval), since this node cannot yet vouch for its
    /// share. If Redis does not answer, it returns once the fail mode applies (at the
    /// first failed round of a node that has never heard Redis, else after the
    /// staleness); it also returns if the task has stopped.
    ///
    /// Await it before serving when the first requests matter, or bound it with
    /// `tokio::time::timeout`.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::sync::RedisSync;
    /// use tollgate::RateLimiter;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (limiter, handle) = RateLimiter::<String>::builder("100/s".parse()?)
    ///     .build_synced(RedisSync::new("redis://127.0.0.1:6379/"))?;
    /// tokio::time::timeout(Duration::from_secs(2), handle.ready()).await?;
    /// assert!(limiter.check("first-request").is_allowed());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn ready(&self) {
        for also in &self.also {
            also.ready_own().await;
        }
        self.ready_own().await;
    }

    async fn ready_own(&self) {
        loop {
            let notified = self.shared.settled_now.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a settle in between still wakes it.
            notified.as_mut().enable();
            if self.shared.is_settled() {
                return;
            }
            notified.await;
        }
    }

    /// Asks for a round now (the task also runs one every interval).
    pub fn sync_now(&self) {
        self.shared.wake.notify_one();
        for also in &self.also {
            also.sync_now();
        }
    }

    /// Stops the task after a last round that reports all pending consumption, returns
    /// every leased token and leaves the node registry. The limiter denies every check
    /// after it (with no round to report them, its admissions would go uncharged, and its
    /// share is the other nodes' again): shut down when the node is about to stop
    /// serving.
    pub async fn shutdown(mut self) {
        for also in &self.also {
            also.shared.stop.notify_one();
        }
        self.shared.stop.notify_one();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        for also in std::mem::take(&mut self.also) {
            Box::pin(also.shutdown()).await;
        }
    }
}
