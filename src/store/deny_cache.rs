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

use crate::decision::Decision;

/// Entries per thread (a power of two); 64 × 56 bytes.
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
}

const EMPTY: Cached = Cached {
    store: 0,
    generation: 0,
    hash: 0,
    check: 0,
    limit: 0,
    retry_at: 0,
    reset_at: 0,
};

thread_local! {
    static CACHE: RefCell<[Cached; WAYS]> = const { RefCell::new([EMPTY; WAYS]) };
}

fn way(hash: u64) -> usize {
    (hash as usize) & (WAYS - 1)
}

/// A deny cached for this key of `store` at `generation` whose retry instant is still
/// after `now`; `check` computes the key's second hash, only on a hit.
#[inline]
pub(crate) fn lookup(
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
    })
}

/// Remembers that a unit request for this key was denied at `now` with `decision`.
pub(crate) fn insert(
    store: u64,
    generation: u64,
    hash: u64,
    check: u64,
    now: u64,
    decision: &Decision,
) {
    let Some(retry) = decision.retry_after() else {
        return;
    };
    let entry = Cached {
        store,
        generation,
        hash,
        check,
        limit: decision.limit(),
        retry_at: now.saturating_add(u64::try_from(retry.as_nanos()).unwrap_or(u64::MAX)),
        reset_at: now.saturating_add(decision.reset_after_ns()),
    };
    // A thread being torn down has no cache: nothing to remember then.
    let _ = CACHE.try_with(|cache| cache.borrow_mut()[way(hash)] = entry);
}
