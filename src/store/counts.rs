//! What a store counts: the keys it holds against `max_keys`, why keys left or were
//! refused, and how often its tables were rebuilt. Shared by both stores, so that a new
//! key takes its place, and a full store makes room, by the same rule in each.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use super::{Room, StoreStats};
use crate::decision::Decision;

/// A store's key count and counters.
pub(crate) struct Counts {
    len: CachePadded<AtomicUsize>,
    max_keys: usize,
    evicted_untouched: AtomicU64,
    evicted_active: AtomicU64,
    refused: AtomicU64,
    resizes: AtomicU64,
}

impl Counts {
    pub(crate) fn new(max_keys: usize) -> Self {
        Self {
            len: CachePadded::new(AtomicUsize::new(0)),
            max_keys,
            evicted_untouched: AtomicU64::new(0),
            evicted_active: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            resizes: AtomicU64::new(0),
        }
    }

    /// How many keys hold state.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Takes a place for a new key. When the store is full, `make_room` (run under the
    /// shard's writer lock) drops a key first; `on_active` runs if that key was live.
    /// `Err(retry_after_ns)` when no place could be had: nothing fit, or another shard
    /// took the freed place first.
    pub(crate) fn take_place(
        &self,
        make_room: impl FnOnce() -> Room,
        on_active: impl FnOnce(),
    ) -> Result<(), u64> {
        if self.reserve() {
            return Ok(());
        }
        match make_room() {
            Room::Untouched => self.left(1, &self.evicted_untouched),
            Room::Active => {
                self.left(1, &self.evicted_active);
                on_active();
            }
            Room::None { retry_after_ns } => return Err(retry_after_ns),
        }
        if self.reserve() { Ok(()) } else { Err(1) }
    }

    /// Gives back a place taken for a key that could not be stored after all.
    pub(crate) fn give_back(&self) {
        self.len.fetch_sub(1, Ordering::AcqRel);
    }

    /// Records that a key was removed (a reset).
    pub(crate) fn removed(&self) {
        self.len.fetch_sub(1, Ordering::AcqRel);
    }

    /// Records that `dropped` keys back to untouched were swept away.
    pub(crate) fn swept(&self, dropped: usize) {
        self.left(dropped, &self.evicted_untouched);
    }

    /// A deny for a new key that found no room, counted.
    pub(crate) fn refusal(&self, capacity: u64, retry_after_ns: u64) -> Decision {
        self.refused.fetch_add(1, Ordering::Relaxed);
        Decision::capacity_deny(capacity, retry_after_ns)
    }

    /// Records that a shard's table was rebuilt.
    pub(crate) fn resized(&self) {
        self.resizes.fetch_add(1, Ordering::Relaxed);
    }

    /// How many table rebuilds so far.
    pub(crate) fn resizes(&self) -> u64 {
        self.resizes.load(Ordering::Relaxed)
    }

    /// The store's counters (the limiter adds its decision counts).
    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats {
            allowed: 0,
            denied: 0,
            keys: self.len(),
            evicted_untouched: self.evicted_untouched.load(Ordering::Relaxed),
            evicted_active: self.evicted_active.load(Ordering::Relaxed),
            refused_new_keys: self.refused.load(Ordering::Relaxed),
            resizes: self.resizes(),
            retired_tables: 0,
        }
    }

    /// Takes a place if the store has one; false when it is full.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Records that `dropped` keys left, counting them in `counter`.
    fn left(&self, dropped: usize, counter: &AtomicU64) {
        if dropped > 0 {
            self.len.fetch_sub(dropped, Ordering::AcqRel);
            counter.fetch_add(dropped as u64, Ordering::Relaxed);
        }
    }
}
