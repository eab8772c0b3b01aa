//! A per-thread cache of recent denies, so that a client hammering a key it is denied
//! costs no shared memory traffic at all.
//!
//! When a unit request is denied, no unit request for that key can pass before the
//! deny's retry instant, by anyone (that is what `retry_after` means), so its state
//! cannot change until then. The only ways it can change sooner are administrative
//! — `reset`, a quota change, or evicting the key while it is live — and each of those
//! bumps the store's generation, which invalidates every cached deny. Until its retry
//! instant, a cached deny is therefore exactly the decision the store would give: the same
//! limit, `remaining` 0, and the same absolute reset and retry instants.
//!
//! Entries are found by the key's 64-bit hash and confirmed by a second, independent
//! 64-bit hash, so a wrong hit needs a 128-bit collision.

use std::cell::RefCell;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::decision::Decision;

/// Hands out store identities for the deny cache (0 means "no store").
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

/// One store's side of the cache: its identity, its generation and the hash that
/// confirms hits.
pub(crate) struct Denies {
    id: u64,
    /// Bumped by everything that can admit a cached-denied key early.
    generation: AtomicU64,
    /// Whether any deny was ever cached (until then the cache is not consulted).
    live: AtomicBool,
    /// An independent hash confirming hits.
    checker: ahash::RandomState,
}

impl Denies {
    pub(crate) fn new() -> Self {
        Self {
            id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
            generation: AtomicU64::new(0),
            live: AtomicBool::new(false),
            checker: ahash::RandomState::new(),
        }
    }

    /// Invalidates every cached deny of this store.
    pub(crate) fn invalidate(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether a request of `cost` with `max_delay`, for a state whose denies are
    /// `stable`, may use the cache: only unit requests with no delay bound.
    #[inline(always)]
    pub(crate) fn applies(stable: bool, cost: u64, max_delay: u64) -> bool {
        stable && cost == 1 && max_delay == u64::MAX
    }

    /// The generation to pass to [`lookup`](Self::lookup) and
    /// [`remember`](Self::remember): read before deciding, so that a reset racing with
    /// the check invalidates the deny it may cache.
    #[inline(always)]
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// This thread's cached deny for the key, if it is still live at `now`.
    #[inline(always)]
    pub(crate) fn lookup<Q: Hash + ?Sized>(
        &self,
        generation: u64,
        hash: u64,
        key: &Q,
        now: u64,
    ) -> Option<Decision> {
        if !self.live.load(Ordering::Relaxed) {
            return None;
        }
        lookup(
            self.id,
            generation,
            hash,
            || self.checker.hash_one(key),
            now,
        )
    }

    /// Caches `decision` if it is a quota deny.
    #[inline(always)]
    pub(crate) fn remember<Q: Hash + ?Sized>(
        &self,
        generation: u64,
        hash: u64,
        key: &Q,
        now: u64,
        decision: &Decision,
    ) {
        if !decision.is_allowed() && !decision.is_capacity_deny() {
            // Fields by value: a reference to the decision would keep it in memory on
            // every check, not only on this cold path.
            let entry = Cached {
                store: self.id,
                generation,
                hash,
                check: self.checker.hash_one(key),
                limit: decision.limit(),
                retry_at: now.saturating_add(decision.retry_after_ns()),
                reset_at: now.saturating_add(decision.reset_after_ns()),
                policy: decision.policy(),
            };
            self.insert(entry);
        }
    }

    #[cold]
    #[inline(never)]
    fn insert(&self, entry: Cached) {
        // A thread being torn down has no cache: nothing to remember then.
        let _ = CACHE.try_with(|cache| cache.borrow_mut()[way(entry.hash)] = entry);
        if !self.live.load(Ordering::Relaxed) {
            self.live.store(true, Ordering::Relaxed);
        }
    }

    /// Answers a unit request from this thread's cache if it holds a live deny for the
    /// key; otherwise runs `decide` and caches the deny it returns.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check<Q: Hash + ?Sized, E>(
        &self,
        hash: u64,
        key: &Q,
        now: u64,
        cost: u64,
        max_delay: u64,
        stable: bool,
        decide: impl FnOnce() -> Result<Decision, E>,
    ) -> Result<Decision, E> {
        if !Self::applies(stable, cost, max_delay) {
            return decide();
        }
        let generation = self.generation();
        if let Some(d) = self.lookup(generation, hash, key, now) {
            return Ok(d);
        }
        let decision = decide()?;
        self.remember(generation, hash, key, now, &decision);
        Ok(decision)
    }
}

/// Entries per thread (a power of two); 64 × 64 bytes.
const WAYS: usize = 64;

#[derive(Clone, Copy)]
struct Cached {
    store: u64,
    generation: u64,
    hash: u64,
    check: u64,
    limit: u64,
    retry_at: u64,
    reset_at: u64,
    /// Which of the limiter's quotas denied ([`Decision::policy`]).
    policy: usize,
}

const EMPTY: Cached = Cached {
    store: 0,
    generation: 0,
    hash: 0,
    check: 0,
    limit: 0,
    retry_at: 0,
    reset_at: 0,
    policy: 0,
};

thread_local! {
    static CACHE: RefCell<[Cached; WAYS]> = const { RefCell::new([EMPTY; WAYS]) };
}

/// The way of a key's hash: low bits, with the high half folded in (the word store's
/// integer hashes are strong only in their high bits).
fn way(hash: u64) -> usize {
    (super::hash::spread(hash) as usize) & (WAYS - 1)
}

/// A deny cached for this key of `store` at `generation` whose retry instant is still
/// after `now`; `check` computes the key's second hash, only on a hit.
#[inline]
fn lookup(
    store: u64,
    generation: u64,
    hash: u64,
    check: impl FnOnce() -> u64,
    now: u64,
) -> Option<Decision> {
    let hit = CACHE
        .try_with(|cache| {
            let c = cache.borrow()[way(hash)];
            (c.store == store && c.hash == hash && c.generation == generation && now < c.retry_at)
                .then_some(c)
        })
        .ok()
        .flatten()?;
    (check() == hit.check).then(|| {
        Decision::deny(
            hit.limit,
            0,
            hit.reset_at.saturating_sub(now),
            hit.retry_at - now,
        )
        .for_policy(hit.policy)
    })
}
