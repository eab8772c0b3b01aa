//! The one module of tollgate with `unsafe` code, all in this one file: an open-addressing
//! table of `{state word, key}` slots whose readers take no lock and write no shared word,
//! kept alive by an epoch scheme of its own (the inline module [`reclaim`]) and resized by
//! freezing slots; a slot's word is one `u64` or a pair of them (the inline module
//! [`atom`]). Nothing outside this file may write `unsafe` (`#![deny(unsafe_code)]` at the
//! crate root; only this module is allowed it).
//!
//! ```text
//! EpochTable ── current ──► Table { meta, slots: [ Slot { word: AtomicU64, key: K } … ] }
//!               writer: Mutex<W>          │ linear probing from the hash's home slot
//!                                         ▼
//!                   word: EMPTY │ live state (≤ STATE_MAX) │ REMOVED │ FROZEN
//! ```
//!
//! A check loads the current table, probes for its key and changes the key's state word
//! by CAS. For `u64` keys a slot is 16 bytes, so the key and its state share one cache
//! line. A key held to two quotas has a 16-byte word of two states instead, changed by
//! one 16-byte CAS (32-byte slots; see [`atom`]): the protocol below reads only its
//! first state, the head, and moves the second with it. Everything else — inserting,
//! removing, resizing, changing the table's `meta` — happens under the writer mutex.
//!
//! # The invariant
//!
//! A slot's `word` moves only along
//!
//! ```text
//! EMPTY ──insert──► live ──CAS──► live …
//!                    │ ├──remove──► REMOVED
//!                    │ └──freeze──► FROZEN        (never back, within one table)
//! ```
//!
//! and its key bytes are:
//! - **unwritten** while the word is `EMPTY`; only the writer, holding the mutex, writes
//!   them, and only into an `EMPTY` slot of the current table, before storing the word
//!   with `Release`;
//! - **owned by the table** while the word is live or `REMOVED` (the table drops them when
//!   it is destroyed);
//! - **owned by the next table** once `FROZEN`: the migration that froze the slot moved
//!   the key there bit for bit. The bytes stay readable, because that next table keeps
//!   the value alive and is destroyed only after this one.
//!
//! Readers read key bytes only after an `Acquire` load of a word other than `EMPTY`, so
//! they never race with the write; nothing writes key bytes after that. A table is
//! destroyed only through [`reclaim`] (retired when it is unlinked, freed once every
//! guard that was in force then has dropped) or when the `EpochTable` itself is dropped,
//! so no reader holding a guard ever sees freed memory.
//!
//! # Resizing without losing an update, a few slots at a time
//!
//! A migration links the new table from the current one (`next`, set before any slot
//! freezes) and then moves slots in batches, each under the writer mutex: the inserts
//! move [`STEP_PER_INSERT`] slots each, a check that meets the migration helps with as
//! many if the mutex is free (the word store has one such check in 64 per thread help),
//! and an operator's path (a quota change) drives it to its end. No one pays for the whole table. A move freezes the slot with a CAS
//! (`state → FROZEN`), copies the state it replaced into the new table and leaves the key
//! bytes in place for readers. A check whose CAS raced with the freeze fails and sees
//! `FROZEN`, so no check can update a copy that has already been taken: every admission
//! lands either before the freeze (and is in the copy) or in the new table. A check that
//! meets `FROZEN`, or misses its key, looks in the next table ([`Table::locate`]); a key
//! frozen and not there yet is in the middle of its move (nanoseconds, under the writer
//! mutex): the check waits for the mutex. (A check that sees a migration under way asks
//! for its key's home in the next table first, [`Table::prefetch`], so that a probe of
//! both tables waits for about one miss, not two.) New keys go to the new table. Once
//! the last slot has moved, the new table is published and the old one retired (by a
//! writer: a check that ends a migration leaves the retire, which may allocate, to the
//! next one).
//!
//! A growing shard's next table is written ahead, a few pages per insert in the last
//! inserts before the growth ([`Writer::prepare`]), before any reader can reach it: the
//! migration then takes no page fault. Other new tables come zeroed from the allocator
//! (a slot stores its word inverted, so zero is `EMPTY`): the kernel maps their pages on
//! first write, which the migration does ahead of the moves ([`Writer::prefault`]), so
//! creating a large table costs no pass.
//!
//! The loom models at the bottom of this file check these steps and the reclamation of
//! retired tables; `tests/stress.rs` checks every decision against a reference model while
//! tiny tables resize, also under valgrind.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::Arc;

pub(crate) use atom::{Atom, AtomicPair, Two};
pub(crate) use reclaim::Guard;
use sync::{AtomicU8, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering, UnsafeCell};

/// The std and parking_lot primitives, or loom's under `--cfg tollgate_loom`.
#[cfg(not(tollgate_loom))]
mod sync {
    pub(super) use parking_lot::{Mutex, MutexGuard};
    pub(super) use std::hint::spin_loop;
    pub(super) use std::sync::atomic::{
        AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering, compiler_fence, fence,
    };

    /// `std::cell::UnsafeCell` with loom's closure API, so one code path serves both.
    pub(super) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(super) fn new(value: T) -> Self {
            Self(std::cell::UnsafeCell::new(value))
        }

        #[inline]
        pub(super) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        #[inline]
        pub(super) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock()
    }

    pub(super) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
        mutex.try_lock()
    }

    /// Makes parking_lot's table of parked threads exist, once per process. parking_lot
    /// allocates it (about 1 KiB) at the first wait on any of its locks, or at the first
    /// unlock that wakes a waiter, whichever comes first. That can be a check on an
    /// existing key: one that helps a migration unlocks the writer mutex an insert waits
    /// on, and the first such contention in the process then allocated on the check's
    /// path (a loaded CI run of the allocation tests caught it; the backtrace went
    /// through `RawMutex::unlock_slow`). A wait of zero on a condition variable parks
    /// this thread and times out at once, which creates the table here, where a shard is
    /// built, instead. (parking_lot also grows the table when more threads than it was
    /// sized for first park: on that thread, once.)
    pub(super) fn prepare_parking() {
        static PREPARED: std::sync::Once = std::sync::Once::new();
        PREPARED.call_once(|| {
            let mutex = Mutex::new(());
            let _ =
                parking_lot::Condvar::new().wait_for(&mut mutex.lock(), std::time::Duration::ZERO);
        });
    }
}

/// The std and parking_lot primitives, or loom's under `--cfg tollgate_loom`.
#[cfg(tollgate_loom)]
mod sync {
    pub(super) use loom::cell::UnsafeCell;
    pub(super) use loom::hint::spin_loop;
    pub(super) use loom::sync::atomic::{
        AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering, fence,
    };
    pub(super) use loom::sync::{Mutex, MutexGuard};
    pub(super) use std::sync::atomic::compiler_fence;

    pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
        match mutex.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Nothing to prepare: loom's mutexes do not park.
    pub(super) fn prepare_parking() {}
}

/// The largest state a slot holds. Larger values are clamped to it; the word
/// algorithms never produce one, except the token bucket's TAT saturating at the end of
/// `u64` time, 3 ns later.
pub(crate) const STATE_MAX: u64 = u64::MAX - 3;
const FROZEN: u64 = u64::MAX - 2;
const REMOVED: u64 = u64::MAX - 1;
const EMPTY: u64 = u64::MAX;

/// The capacity of a migration's new table asked for `capacity` slots, from a table of
/// `old` slots holding `live` keys: at least 2 and at most 2³², and enough for the keys
/// and for every insert that can come before the last slot has moved (inserts move
/// [`STEP_PER_INSERT`] slots each) within the load limit.
fn migration_capacity(old: usize, capacity: usize, live: usize) -> usize {
    let inserts = old / STEP_PER_INSERT + 1;
    let mut capacity = capacity.clamp(2, MAX_CAPACITY);
    while !fits(live + inserts + 1, capacity) && capacity < MAX_CAPACITY {
        capacity = (capacity + capacity / 4 + 1).min(MAX_CAPACITY);
    }
    capacity
}

/// A table is resized before `used / capacity` passes `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 43;
const MAX_LOAD_DEN: usize = 50;
/// The home slot is the high 32 bits of the hash scaled to the capacity, so a table has
/// at most 2³² slots.
const MAX_CAPACITY: usize = u32::MAX as usize;

/// What a slot's word says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Word<V = u64> {
    /// The key's state.
    Live(V),
    /// The key was removed: look it up again.
    Removed,
    /// The key is being moved to a new table: wait for the writer, then look again.
    Frozen,
}

impl<V: Copy> Word<V> {
    /// What the raw value of a word of type `A` says (see [`Atom::head`]).
    #[inline]
    pub(crate) fn from_raw<A: Atom<Value = V>>(raw: V) -> Self {
        match A::head(raw) {
            FROZEN => Self::Frozen,
            REMOVED | EMPTY => Self::Removed,
            _ => Self::Live(raw),
        }
    }
}

/// One key and its state word (a `u64`, or a pair of them: see [`atom`]). A slot stores
/// its word's head inverted, so that an all-zero slot is `EMPTY` and a table's slots come
/// from a zeroed allocation: a new table costs no pass over its slots, which for a large
/// table would be the one step of a migration that is not incremental.
pub(crate) struct Slot<K, A = AtomicU64> {
    word: A,
    key: UnsafeCell<MaybeUninit<K>>,
}

// SAFETY: a `Slot` shared between threads hands out `&K` to all of them (so `K: Sync`)
// and a migration or a table's destruction may move or drop the key on any thread (so
// `K: Send`). Its key bytes are written only under the module invariant (by the writer,
// into an `EMPTY` slot, before a `Release` store), so shared access never races a write.
unsafe impl<K: Send + Sync, A: Atom> Sync for Slot<K, A> {}

impl<K, A: Atom> Slot<K, A> {
    fn empty() -> Self {
        Self {
            word: A::empty(),
            key: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// The slot's word.
    #[inline]
    pub(crate) fn load(&self) -> Word<A::Value> {
        Word::from_raw::<A>(self.load_raw())
    }

    /// The slot's word, raw: a live state is at most [`STATE_MAX`] in each part.
    #[inline(always)]
    pub(crate) fn load_raw(&self) -> A::Value {
        self.word.load(Ordering::Acquire)
    }

    /// Replaces the live state `current` with `next` (clamped to [`STATE_MAX`]); on
    /// failure, returns the raw word it holds instead (see [`Word::from_raw`]).
    #[inline(always)]
    pub(crate) fn update(&self, current: A::Value, next: A::Value) -> Result<(), A::Value> {
        self.word
            .compare_exchange_weak(current, A::clamp(next), Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
    }

    /// Runs `f` on the slot's key; `None` if the slot never held one.
    #[inline]
    pub(crate) fn with_key<R>(&self, f: impl FnOnce(&K) -> R) -> Option<R> {
        if A::head(self.load_raw()) == EMPTY {
            return None;
        }
        // SAFETY: the word was not EMPTY when loaded with Acquire, so the key bytes were
        // written before it (and are never written again); they are alive because the
        // table owning them is destroyed only after every reference into this table is
        // gone (the caller reached `self` through a guard or through `&mut`).
        Some(self.key.with(|key| f(unsafe { (*key).assume_init_ref() })))
    }

    /// Marks a live slot removed and returns the state it had. The key stays in place
    /// (readers may be comparing it) until the table is destroyed.
    fn remove(&self) -> Option<A::Value> {
        self.end(REMOVED)
    }

    /// Freezes a live slot and returns the state it had; `None` if it was not live.
    fn freeze(&self) -> Option<A::Value> {
        self.end(FROZEN)
    }

    /// Replaces a live state, whatever it is, with the final word `to` (REMOVED or
    /// FROZEN); returns the state it replaced, or `None` if the slot was not live.
    fn end(&self, to: u64) -> Option<A::Value> {
        let mut raw = self.load_raw();
        loop {
            if A::head(raw) > STATE_MAX {
                return None;
            }
            match self.word.compare_exchange_weak(
                raw,
                A::marker(to),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(raw),
                Err(actual) => raw = actual,
            }
        }
    }
}

/// The home slot of a hash: its high 32 bits scaled to the capacity (so the capacity
/// need not be a power of two). The store passes hashes whose high bits are their
/// strongest (see `store::hash`).
#[inline]
fn home(hash: u64, capacity: usize) -> usize {
    (((hash >> 32) * capacity as u64) >> 32) as usize
}

/// The tag of a hash: its bits 16‥24, apart from the home slot's.
#[inline]
fn tag(hash: u64) -> u8 {
    (hash >> 16) as u8
}

/// Whether `used` slots fit a table of `capacity` within the load limit.
fn fits(used: usize, capacity: usize) -> bool {
    used * MAX_LOAD_DEN <= capacity * MAX_LOAD_NUM
}

/// The smallest capacity that holds `keys` keys within the load limit with room for
/// `capacity / ahead` more: a table sized ahead for `keys` keys, which neither grows nor
/// starts making its successor ready (which the word store does in a table's last
/// `capacity / ahead` inserts) before they are all in. `None` if no table (at most 2³²
/// slots) does.
pub(crate) fn capacity_holding(keys: usize, ahead: usize) -> Option<usize> {
    if keys >= MAX_CAPACITY {
        return None;
    }
    let holds = |capacity: usize| {
        fits(
            keys.saturating_add(1)
                .saturating_add(capacity / ahead.max(1)),
            capacity,
        )
    };
    let mut capacity = keys
        .saturating_add(1)
        .saturating_mul(MAX_LOAD_DEN)
        .div_ceil(MAX_LOAD_NUM)
        .clamp(2, MAX_CAPACITY);
    while !holds(capacity) {
        if capacity == MAX_CAPACITY {
            return None;
        }
        capacity = capacity.saturating_add(capacity / 64 + 1).min(MAX_CAPACITY);
    }
    Some(capacity)
}

/// The bytes a table spends per slot for keys `K` and words `A`: the slot, and its tag
/// where the keys keep tags.
pub(crate) const fn slot_bytes<K, A: Atom>() -> usize {
    std::mem::size_of::<Slot<K, A>>() + if tagged::<K>() { 1 } else { 0 }
}

/// Slots of one fixed capacity, with the `meta` checks read alongside them.
pub(crate) struct Table<K, M, A: Atom = AtomicU64> {
    slots: Box<[Slot<K, A>]>,
    /// For keys whose comparison reads the heap (`String`, `Arc<str>`: types that need
    /// drop), a tag of each slot's hash, so that a probe reads a key only when its tag
    /// matches (1 in 256 false candidates). Empty for the others (`u64`, `IpAddr`), whose
    /// comparison costs no more than the tag's. Written before the slot's word.
    tags: Box<[AtomicU8]>,
    /// Slots that are not `EMPTY`; changed only by the writer.
    used: AtomicUsize,
    /// Read by checks with the slots; replaced only by publishing a new table.
    pub(crate) meta: M,
    /// While a migration moves this table's keys: the table they move to (null
    /// otherwise). Set before the first slot is frozen, never changed after.
    next: sync::AtomicPtr<Table<K, M, A>>,
    /// The tables of this table's shard not yet destroyed (this one among them).
    alive: Arc<std::sync::atomic::AtomicUsize>,
    /// Once retired and unreachable: how many slots, from the first, had their keys
    /// dropped and their pages handed back ([`release_piece`](Self::release_piece)).
    released: usize,
    /// Read by every probe and written by the destructor, so that loom reports a table
    /// destroyed while a reader may still probe it.
    #[cfg(tollgate_loom)]
    canary: UnsafeCell<()>,
}

impl<K, M, A: Atom> Table<K, M, A> {
    /// Whether this key type keeps tags.
    const TAGGED: bool = tagged::<K>();

    fn new(capacity: usize, meta: M, alive: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        let tags = if Self::TAGGED { capacity } else { 0 };
        Self::with(zeroed(capacity), zeroed(tags), meta, alive)
    }

    /// A table of empty `slots` (and `tags`, one per slot for keys that keep them),
    /// counted among the shard's tables by `alive`.
    fn with(
        slots: Box<[Slot<K, A>]>,
        tags: Box<[AtomicU8]>,
        meta: M,
        alive: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        alive.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            slots,
            tags,
            used: AtomicUsize::new(0),
            meta,
            next: sync::AtomicPtr::new(std::ptr::null_mut()),
            alive: Arc::clone(alive),
            released: 0,
            #[cfg(tollgate_loom)]
            canary: UnsafeCell::new(()),
        }
    }

    /// Destroys a table made by `Box::into_raw` (the retired tables' destructor), or,
    /// for a table of more than two [`RELEASE_PIECE`]s of slots, the next piece of it:
    /// true once it is gone (see [`reclaim::Destroy`]). Freeing a table of millions of
    /// slots at once hands its pages back to the kernel in one call, hundreds of
    /// microseconds on the request whose collect does it, and longer the larger it is.
    ///
    /// # Safety
    /// `ptr` came from `Box::<Table<K, M, A>>::into_raw`, and nothing uses the table any
    /// more; it is not called again after it returned true.
    unsafe fn destroy(ptr: *mut ()) -> bool {
        // SAFETY: by this function's contract: the table is alive and this is the only
        // reference to it.
        let table = unsafe { &mut *ptr.cast::<Self>() };
        if !table.release_piece() {
            return false;
        }
        // SAFETY: by this function's contract.
        drop(unsafe { Box::from_raw(ptr.cast::<Self>()) });
        true
    }

    /// Drops the keys of the next [`RELEASE_PIECE`] of slots of an unreachable table and
    /// hands their whole pages back to the kernel ([`discard`]). True once nothing is
    /// left for its drop but the allocations, at once for a table of at most two pieces.
    fn release_piece(&mut self) -> bool {
        let per_piece = (RELEASE_PIECE / std::mem::size_of::<Slot<K, A>>()).max(1);
        let len = self.slots.len();
        if self.released == 0 && len <= 2 * per_piece {
            return true;
        }
        let (start, end) = (self.released, (self.released + per_piece).min(len));
        // Counted before the keys drop: one whose drop panics leaks the rest of the piece
        // (and the table), and no key is dropped twice.
        self.released = end;
        let piece = &mut self.slots[start..end];
        drop_keys(piece);
        discard(piece);
        end == len
    }

    /// The number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The table this one's keys are moving to, while a migration runs.
    #[inline]
    pub(crate) fn next(&self) -> Option<&Table<K, M, A>> {
        let next = self.next.load(Ordering::Acquire);
        // SAFETY: a non-null `next` was made by `Box::into_raw` and set before any slot
        // of `self` froze. It is the current table of the shard or becomes it, and it is
        // retired only by a later migration, after `self` was: whoever borrows `self`
        // under a guard holds a guard that was in force when `next` was retired, and the
        // domain frees it only after that guard drops (see `reclaim`). Unpublished, it is
        // freed with the shard, which no borrow of `self` outlives.
        (!next.is_null()).then(|| unsafe { &*next })
    }

    /// The last table of the chain from this one: where new keys go.
    pub(crate) fn newest(&self) -> &Table<K, M, A> {
        let mut table = self;
        while let Some(next) = table.next() {
            table = next;
        }
        table
    }

    /// Where the key matching `eq` is, following the migration chain: in this table, or,
    /// if it is absent or frozen here, in the one it moves to. A key frozen here and
    /// absent from the next table is being moved right now, or was removed after its move:
    /// [`Located::Moving`] says so, and the writer mutex tells which (under it, no move is
    /// half done).
    #[inline]
    pub(crate) fn locate(&self, hash: u64, mut eq: impl FnMut(&K) -> bool) -> Located<'_, K, M, A> {
        let mut table = self;
        let mut moving = false;
        loop {
            match table.find_raw(hash, &mut eq) {
                Some((slot, raw)) if A::head(raw) != FROZEN => {
                    return Located::Found { table, slot, raw };
                }
                found => {
                    moving |= found.is_some();
                    match table.next() {
                        Some(next) => table = next,
                        None if moving => return Located::Moving,
                        None => return Located::Absent { table },
                    }
                }
            }
        }
    }

    /// Asks the processor to start loading the home slot of `hash` (and its tag) into the
    /// cache, and returns at once. A lookup that will probe this table after another
    /// one (the table a migration moves to, after the current one) issues this first, so
    /// that the two tables' cache misses overlap instead of following each other.
    ///
    /// Out of line and cold: only a check that meets a migration calls it, and inlined
    /// into the check's fast path it cost every check 9 instructions (callgrind), against
    /// 3 for the call behind its branch.
    #[cold]
    #[inline(never)]
    pub(crate) fn prefetch(&self, hash: u64) {
        #[cfg(all(target_arch = "x86_64", not(tollgate_loom)))]
        {
            use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let index = home(hash, self.slots.len());
            if let Some(slot) = self.slots.get(index) {
                let slot: *const Slot<K, A> = slot;
                // SAFETY: a prefetch is a hint: it reads no value the program sees, writes
                // nothing and never faults, whatever its address. (This one is a slot of a
                // table the caller borrows, so it is mapped anyway.)
                unsafe { _mm_prefetch::<_MM_HINT_T0>(slot.cast()) };
            }
            if let Some(tag) = self.tags.get(index) {
                let tag: *const AtomicU8 = tag;
                // SAFETY: as above.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(tag.cast()) };
            }
        }
        #[cfg(not(all(target_arch = "x86_64", not(tollgate_loom))))]
        let _ = hash;
    }

    /// The slot at `index` (`< capacity`), for the eviction hand and sampling.
    pub(crate) fn slot(&self, index: usize) -> &Slot<K, A> {
        &self.slots[index]
    }

    /// The slot of this table whose key matches `eq`, with its word; `None` when absent.
    /// Skips removed slots; stops at the first empty one. (The store uses
    /// [`locate`](Self::locate), which follows a migration.)
    #[cfg(test)]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&K) -> bool) -> Option<Found<'_, K, A>> {
        self.find_raw(hash, eq)
            .map(|(slot, raw)| (slot, Word::from_raw::<A>(raw)))
    }

    /// [`find`](Self::find), with the slot's word raw (a live state is at most
    /// [`STATE_MAX`]), for the check's hot path: an enum there made the compiler pass the
    /// state through the stack on its way to the CAS.
    #[inline(always)]
    pub(crate) fn find_raw(
        &self,
        hash: u64,
        mut eq: impl FnMut(&K) -> bool,
    ) -> Option<(&Slot<K, A>, A::Value)> {
        #[cfg(tollgate_loom)]
        self.canary.with(|_| ());
        let capacity = self.slots.len();
        let mut index = home(hash, capacity);
        let tag = tag(hash);
        loop {
            let slot = &self.slots[index];
            let raw = slot.load_raw();
            let head = A::head(raw);
            if head == EMPTY {
                return None;
            }
            if head != REMOVED && (!Self::TAGGED || self.tags[index].load(Ordering::Relaxed) == tag)
            {
                // SAFETY: as in `Slot::with_key`: the word was not EMPTY when loaded with
                // Acquire, so the key was written before and is alive while `&self` is.
                let equal = slot.key.with(|key| eq(unsafe { (*key).assume_init_ref() }));
                if equal {
                    return Some((slot, raw));
                }
            }
            index += 1;
            if index == capacity {
                index = 0;
            }
        }
    }

    /// Writes `key` with `state` into the first empty slot from `hash`'s home.
    ///
    /// # Safety
    /// The caller has exclusive write access to the table's empty slots: it holds the
    /// writer mutex and the table is current, or the table is not yet published.
    ///
    /// # Panics
    /// If the table has no empty slot, which the load limit and the migrations' sizing
    /// rule out: a bug, which fails here rather than probing forever with the writer
    /// mutex held (a migration's move, which must not unwind, then aborts).
    unsafe fn place(&self, hash: u64, key: K, state: A::Value) -> &Slot<K, A> {
        let capacity = self.slots.len();
        let mut index = home(hash, capacity);
        let mut probed = 1;
        while A::head(self.slots[index].word.load(Ordering::Relaxed)) != EMPTY {
            assert!(
                probed < capacity,
                "tollgate: a table of {capacity} slots has no empty slot to place a key in"
            );
            probed += 1;
            index += 1;
            if index == capacity {
                index = 0;
            }
        }
        let slot = &self.slots[index];
        // SAFETY: the slot is EMPTY, so no reader reads its key bytes (they read them only
        // after seeing another word), and by this function's contract no other writer
        // touches it.
        slot.key.with_mut(|bytes| unsafe { (*bytes).write(key) });
        if Self::TAGGED {
            self.tags[index].store(tag(hash), Ordering::Relaxed);
        }
        self.used.fetch_add(1, Ordering::Relaxed);
        slot.word.store(A::clamp(state), Ordering::Release);
        slot
    }
}

/// A slot [`Table::find`] found, with its word.
#[cfg(test)]
pub(crate) type Found<'a, K, A> = (&'a Slot<K, A>, Word<<A as Atom>::Value>);

/// Where [`Table::locate`] found a key.
pub(crate) enum Located<'a, K, M, A: Atom = AtomicU64> {
    /// In `table`'s `slot`, whose raw word was `raw` (live when loaded).
    Found {
        table: &'a Table<K, M, A>,
        slot: &'a Slot<K, A>,
        raw: A::Value,
    },
    /// Frozen in one table and absent from the next: being moved by the writer right
    /// now, or removed after its move. Under the writer mutex, absent.
    Moving,
    /// Nowhere; `table` is the newest of the chain, where it would be inserted.
    Absent { table: &'a Table<K, M, A> },
}

/// `len` values of `T` whose all-zero bytes are a valid value, from a zeroed allocation
/// (untouched pages of a large one are mapped on first use, so it costs no pass).
#[cfg(not(tollgate_loom))]
fn zeroed<T: Zeroable>(len: usize) -> Box<[T]> {
    if len == 0 || std::mem::size_of::<T>() == 0 {
        return (0..len).map(|_| T::zero()).collect();
    }
    let layout = std::alloc::Layout::array::<T>(len).unwrap_or_else(|_| {
        // At most 2³² slots of a few words: never on a 64-bit target.
        panic!("a table of {len} slots does not fit the address space")
    });
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `ptr` is a live allocation of `layout`, the layout of `[T; len]`, from the
    // global allocator (which a `Box<[T]>` frees with), zeroed, and all-zero bytes are a
    // valid `T` (`T: Zeroable`), so it holds `len` initialised values.
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) }
}

/// Under loom, whose atomics are not plain memory: built one by one.
#[cfg(tollgate_loom)]
fn zeroed<T: Zeroable>(len: usize) -> Box<[T]> {
    (0..len).map(|_| T::zero()).collect()
}

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// All-zero bytes must be a valid value of the type (equal to `zero()`).
unsafe trait Zeroable {
    fn zero() -> Self;
}

// SAFETY: a slot is an `Atom` (all-zero bytes are valid and `EMPTY`, by its contract) and
// key bytes that are `MaybeUninit` (any bytes are valid).
unsafe impl<K, A: Atom> Zeroable for Slot<K, A> {
    fn zero() -> Self {
        Slot::empty()
    }
}

// SAFETY: an `AtomicU8` of 0.
unsafe impl Zeroable for AtomicU8 {
    fn zero() -> Self {
        AtomicU8::new(0)
    }
}

impl<K, M, A: Atom> Drop for Table<K, M, A> {
    fn drop(&mut self) {
        // The slots before `released` dropped their keys already.
        drop_keys(&mut self.slots[self.released..]);
        #[cfg(tollgate_loom)]
        self.canary.with_mut(|_| ());
        self.alive
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Drops the keys `slots` own: those of live and REMOVED words (a FROZEN one was moved
/// out, an EMPTY one never written). Called once per slot, by the table's drop or a
/// piece of its release, so each key is dropped exactly once.
fn drop_keys<K, A: Atom>(slots: &mut [Slot<K, A>]) {
    // Keys that need no drop need no pass over the slots either.
    if !std::mem::needs_drop::<K>() {
        return;
    }
    for slot in slots.iter_mut() {
        let head = A::head(slot.word.load(Ordering::Relaxed));
        if head != EMPTY && head != FROZEN {
            // SAFETY: `&mut`: no reader is left. A live or REMOVED word means the key was
            // written and is still owned by this table, and this is its one drop.
            slot.key
                .with_mut(|key| unsafe { (*key).assume_init_drop() });
        }
    }
}

/// A retired table of more than two of these, in bytes of slots, is released a piece at
/// a time, one per collect (16 pages of 4 KiB: a few microseconds each on a VM, where
/// freeing a table of 250,000 keys at once took 130 µs on average and up to 400 µs).
const RELEASE_PIECE: usize = 64 << 10;

/// Hands the whole pages that `slots` cover back to the kernel (`madvise(2)`'s
/// `MADV_DONTNEED`): the slots stay allocated and read as zero bytes (empty slots) if
/// read again, which nothing does. Best effort: a failure keeps the pages until the
/// table is freed.
#[cfg(all(target_os = "linux", not(tollgate_loom)))]
fn discard<K, A: Atom>(slots: &mut [Slot<K, A>]) {
    let page = page_size();
    if page == 0 {
        return;
    }
    let begin = slots.as_mut_ptr() as usize;
    let end = begin + std::mem::size_of_val(slots);
    let (first, last) = (begin.div_ceil(page) * page, end / page * page);
    if first < last {
        // SAFETY: [first, last) is whole pages (of the kernel's size) within `slots`, to
        // which the caller has exclusive access: the kernel replaces their bytes with
        // zeros, which is what writing zeros through the `&mut` would do, and all-zero
        // bytes are a valid slot (`Zeroable`: an EMPTY word and key bytes that are
        // `MaybeUninit`). It touches no memory outside the range.
        let _ = unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_DONTNEED,
            )
        };
    }
}

/// Elsewhere the pages go when the table is freed.
#[cfg(not(all(target_os = "linux", not(tollgate_loom))))]
fn discard<K, A: Atom>(_: &mut [Slot<K, A>]) {}

/// The kernel's page size, 0 if unknown.
#[cfg(all(target_os = "linux", not(tollgate_loom)))]
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: `sysconf` reads no memory of ours.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size).unwrap_or(0)
    })
}

/// The machine's physical memory in bytes, where the kernel says (Linux): what tables
/// written up front for expected keys must fit in.
#[cfg(all(target_os = "linux", not(tollgate_loom)))]
pub(crate) fn physical_memory() -> Option<usize> {
    // SAFETY: `sysconf` reads no memory of ours.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    usize::try_from(pages)
        .ok()
        .filter(|&pages| pages > 0)?
        .checked_mul(page_size())
        .filter(|&bytes| bytes > 0)
}

/// Elsewhere unknown.
#[cfg(not(all(target_os = "linux", not(tollgate_loom))))]
pub(crate) fn physical_memory() -> Option<usize> {
    None
}

/// What a migration does with each key it moves to a table of new `meta`, whose states
/// are `V`.
pub(crate) trait Carry<K, V = u64> {
    /// The state for `self`'s table of a key (of `hash`) whose state was `state` under
    /// `from`'s, at `now`.
    fn carry(&self, from: &Self, key: &K, hash: u64, state: V, now: u64) -> V;
}

/// The current table of one shard, and the mutex its writers take.
pub(crate) struct EpochTable<K, M, W, A: Atom = AtomicU64> {
    /// Never null: a table made by `Box::into_raw`.
    current: sync::AtomicPtr<Table<K, M, A>>,
    writer: Mutex<Locked<K, W, A>>,
    /// This shard's tables not yet destroyed: the current one, the one a migration
    /// moves to, and the retired ones.
    alive: Arc<std::sync::atomic::AtomicUsize>,
    /// 1 while a migration runs (its table is alive but not retired), else 0.
    migrating: std::sync::atomic::AtomicUsize,
    /// A table a check's help unlinked but did not retire (retiring may allocate, and a
    /// check on an existing key does not): the next writer retires it. Null otherwise.
    /// Changed only under the writer mutex.
    unretired: sync::AtomicPtr<Table<K, M, A>>,
    _owns: PhantomData<Table<K, M, A>>,
}

/// What the writer mutex guards: the writers' own state, how far the migration in
/// progress (if any) has come, and the slots made ready for the next one.
struct Locked<K, W, A: Atom> {
    user: W,
    /// The next slot of the current table to move.
    cursor: usize,
    /// The slots of the new table whose pages the migration has touched (see
    /// [`Writer::prefault`]).
    faulted: usize,
    /// The slots of the next migration's table, written ahead of it a batch at a time
    /// (see [`Writer::prepare`]); no reader can reach them yet.
    spare: Option<Spare<K, A>>,
}

/// A table's slots (and tags), written a batch at a time before the table is made.
struct Spare<K, A: Atom> {
    slots: Partial<Slot<K, A>>,
    tags: Partial<AtomicU8>,
}

impl<K, A: Atom> Spare<K, A> {
    fn new(capacity: usize) -> Self {
        Self {
            slots: Partial::new(capacity),
            tags: Partial::new(if tagged::<K>() { capacity } else { 0 }),
        }
    }

    fn capacity(&self) -> usize {
        self.slots.values.len()
    }

    /// Writes up to `pages` more pages' worth of slots (and their tags); true once all
    /// are written.
    fn fill(&mut self, pages: usize) -> bool {
        let count = pages.saturating_mul(slots_per_page::<K, A>());
        let slots = self.slots.fill(count);
        let tags = self.tags.fill(count);
        slots && tags
    }

    /// The table of these slots, the rest of them written now.
    fn into_table<M>(self, meta: M, alive: &Arc<std::sync::atomic::AtomicUsize>) -> Table<K, M, A> {
        Table::with(self.slots.finish(), self.tags.finish(), meta, alive)
    }
}

/// `len` values of `T`, written a few at a time from the start.
struct Partial<T> {
    values: Box<[MaybeUninit<T>]>,
    /// How many values (a prefix) are written.
    ready: usize,
}

impl<T: Zeroable> Partial<T> {
    /// Nothing written yet: the allocation is not zeroed either (on memory the allocator
    /// reuses, zeroing would be a pass over all of it at once).
    fn new(len: usize) -> Self {
        Self {
            values: Box::new_uninit_slice(len),
            ready: 0,
        }
    }

    /// Writes up to `count` more values; true once all are written.
    fn fill(&mut self, count: usize) -> bool {
        let end = self.ready.saturating_add(count).min(self.values.len());
        for value in &mut self.values[self.ready..end] {
            value.write(T::zero());
        }
        self.ready = end;
        self.ready == self.values.len()
    }

    /// All the values, those not yet written written now.
    fn finish(mut self) -> Box<[T]> {
        self.fill(usize::MAX);
        // SAFETY: `fill` has written every value (`ready == len`), each once, in order
        // from the start.
        unsafe { self.values.assume_init() }
    }
}

/// Slots per 4 KiB page.
fn slots_per_page<K, A>() -> usize {
    (4096 / std::mem::size_of::<Slot<K, A>>()).max(1)
}

/// Whether a table of keys `K` keeps tags (see [`Table`]'s `tags`).
const fn tagged<K>() -> bool {
    std::mem::needs_drop::<K>()
}

/// Writes `slot`'s word without changing it, so that the kernel maps its page for
/// writing. An atomic add of a constant 0 would not do: the compiler may turn an add of
/// 0 into a fenced load (LLVM does, on x86), which maps the shared zero page instead, and
/// the first real write then takes a second fault, a copy, and a TLB shootdown of the
/// other threads. [`Atom::touch`] adds an opaque 0, which keeps it a write.
#[inline]
fn touch<K, A: Atom>(slot: &Slot<K, A>) {
    slot.word.touch();
}

impl<K, M, W, A: Atom> EpochTable<K, M, W, A>
where
    K: Send + Sync + 'static,
    M: Send + Sync + 'static,
{
    /// An empty table of `capacity` slots (at least 2) with `meta`; `writer` is the state
    /// the writers keep.
    pub(crate) fn new(capacity: usize, meta: M, writer: W) -> Self {
        Self::with_table(writer, |alive| {
            Table::new(capacity.clamp(2, MAX_CAPACITY), meta, alive)
        })
    }

    /// [`new`](Self::new), with a table whose every slot is written now, and so every
    /// page mapped: for a table sized ahead for the keys a limiter expects, whose
    /// inserts then take no page fault (a few microseconds each on a VM). The cost is
    /// paid here instead, about 2 µs a 4 KiB page on this project's VM.
    pub(crate) fn written(capacity: usize, meta: M, writer: W) -> Self {
        Self::with_table(writer, |alive| {
            Spare::new(capacity.clamp(2, MAX_CAPACITY)).into_table(meta, alive)
        })
    }

    /// The shard around the table `table` makes, counted among its tables by the
    /// counter it is given.
    fn with_table(
        writer: W,
        table: impl FnOnce(&Arc<std::sync::atomic::AtomicUsize>) -> Table<K, M, A>,
    ) -> Self {
        sync::prepare_parking();
        let alive = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let table = table(&alive);
        Self {
            current: sync::AtomicPtr::new(Box::into_raw(Box::new(table))),
            writer: Mutex::new(Locked {
                user: writer,
                cursor: 0,
                faulted: 0,
                spare: None,
            }),
            alive,
            migrating: std::sync::atomic::AtomicUsize::new(0),
            unretired: sync::AtomicPtr::new(std::ptr::null_mut()),
            _owns: PhantomData,
        }
    }

    /// The current table, for as long as both `self` and `guard` are borrowed.
    #[inline(always)]
    pub(crate) fn read<'a>(&'a self, _guard: &'a Guard<'_>) -> &'a Table<K, M, A> {
        let table = self.current.load(Ordering::Acquire);
        // SAFETY: `current` is never null (set in `new`, replaced only by non-null tables
        // in `step`). A table it pointed to while `guard` was in force is destroyed
        // only by the domain after every guard in force when it was retired has dropped
        // (see `reclaim`), or by `drop(&mut self)`, which no `&self` borrow outlives.
        unsafe { &*table }
    }

    /// How many of this shard's retired tables are not destroyed yet.
    pub(crate) fn retired_unfreed(&self) -> usize {
        let ordering = std::sync::atomic::Ordering::Relaxed;
        self.alive
            .load(ordering)
            .saturating_sub(1 + self.migrating.load(ordering))
    }

    /// Waits until no writer holds the mutex (after a check met a key being moved: the
    /// writer that froze it has placed it in the next table by then).
    #[cfg(all(test, tollgate_loom))]
    pub(crate) fn wait_for_writer(&self) {
        drop(sync::lock(&self.writer));
    }

    /// Takes the writer mutex.
    pub(crate) fn write(&self) -> Writer<'_, K, M, W, A> {
        Writer {
            owner: self,
            state: sync::lock(&self.writer),
        }
    }

    /// Takes the writer mutex if no one holds it.
    pub(crate) fn try_write(&self) -> Option<Writer<'_, K, M, W, A>> {
        sync::try_lock(&self.writer).map(|state| Writer { owner: self, state })
    }
}

impl<K, M, W, A: Atom> Drop for EpochTable<K, M, W, A> {
    fn drop(&mut self) {
        let current = self.current.load(Ordering::Relaxed);
        // SAFETY: `&mut self`: no borrow of the current table is left (`read` ties it to
        // `&self`), and no other thread can reach it (a retired table never points back
        // here). It was made by `Box::into_raw`.
        let current = unsafe { Box::from_raw(current) };
        let next = current.next.load(Ordering::Relaxed);
        drop(current);
        let unretired = self.unretired.load(Ordering::Relaxed);
        if !unretired.is_null() {
            // SAFETY: a table unlinked by a check's help and never retired: made by
            // `Box::into_raw`, reachable from nothing but this pointer, and, with
            // `&mut self`, borrowed by no reader.
            drop(unsafe { Box::from_raw(unretired) });
        }
        if !next.is_null() {
            // SAFETY: the table of a migration that did not finish: made by
            // `Box::into_raw`, reachable only through the current table, dropped above.
            // It owns the keys moved so far (the current table skipped them, FROZEN).
            drop(unsafe { Box::from_raw(next) });
        }
    }
}

/// The writer mutex of one [`EpochTable`], held: the only way to insert, remove or
/// migrate.
pub(crate) struct Writer<'a, K, M, W, A: Atom = AtomicU64> {
    owner: &'a EpochTable<K, M, W, A>,
    state: MutexGuard<'a, Locked<K, W, A>>,
}

impl<'a, K, M, W, A: Atom> Writer<'a, K, M, W, A>
where
    K: Send + Sync + 'static,
    M: Send + Sync + 'static,
{
    /// The state the writers keep.
    pub(crate) fn state(&mut self) -> &mut W {
        &mut self.state.user
    }

    /// The current table. While this writer lives, no one else publishes another.
    pub(crate) fn table<'g>(&self, guard: &'g Guard<'_>) -> &'g Table<K, M, A>
    where
        'a: 'g,
    {
        self.owner.read(guard)
    }

    /// Where new keys go: the table a migration moves to, else the current one.
    pub(crate) fn target<'g>(&self, guard: &'g Guard<'_>) -> &'g Table<K, M, A>
    where
        'a: 'g,
    {
        let table = self.table(guard);
        table.next().unwrap_or(table)
    }

    /// Whether a migration is under way.
    pub(crate) fn migrating(&self, guard: &Guard<'_>) -> bool {
        self.table(guard).next().is_some()
    }

    /// Inserts `key`, known to be absent (from both tables while a migration runs), with
    /// `state` into the [`target`](Self::target); gives the key back when that table has
    /// no room within its load limit (then [`begin_migration`](Self::begin_migration)).
    pub(crate) fn insert<'g>(
        &mut self,
        guard: &'g Guard<'_>,
        hash: u64,
        key: K,
        state: A::Value,
    ) -> Result<&'g Slot<K, A>, K>
    where
        'a: 'g,
    {
        let table = self.target(guard);
        if !fits(table.used.load(Ordering::Relaxed) + 1, table.capacity()) {
            return Err(key);
        }
        // SAFETY: this writer holds the mutex and `table` is the insert target (only
        // mutex holders publish or start migrations), so no one else writes its empty
        // slots. (The load limit is below 1, so an empty slot remains: `place` finds it.)
        Ok(unsafe { table.place(hash, key, state) })
    }

    /// Marks `slot` (of any table) removed; returns the state it had, or `None` if it was
    /// not live.
    pub(crate) fn remove(&mut self, slot: &Slot<K, A>) -> Option<A::Value> {
        slot.remove()
    }

    /// Marks `slot` removed if its word is still the live state `state`; false if a check
    /// changed it meanwhile (or it was not live).
    pub(crate) fn remove_unchanged(&mut self, slot: &Slot<K, A>, state: A::Value) -> bool {
        A::head(state) <= STATE_MAX
            && slot
                .word
                .compare_exchange(
                    state,
                    A::marker(REMOVED),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Whether one more key fits the insert target within its load limit.
    pub(crate) fn has_room(&self, guard: &Guard<'_>) -> bool {
        let table = self.target(guard);
        fits(table.used.load(Ordering::Relaxed) + 1, table.capacity())
    }

    /// Starts moving every live key into a new table of at least `capacity` slots (more
    /// if `live` keys, plus what inserts may add before the move ends, need them; at most
    /// 2³²) carrying `meta`. A migration already under way is finished first. Nothing
    /// moves yet: [`step`](Self::step) moves slots, and publishes the new table once all
    /// have moved. New keys go to the new table from now on. Returns its capacity.
    pub(crate) fn begin_migration(
        &mut self,
        guard: &Guard<'_>,
        capacity: usize,
        live: usize,
        meta: M,
        rehash: impl Fn(&K) -> u64,
        now: u64,
    ) -> usize
    where
        M: Carry<K, A::Value>,
    {
        self.step(guard, usize::MAX, &rehash, now);
        self.retire_unretired(guard);
        let old = self.table(guard);
        let capacity = migration_capacity(old.capacity(), capacity, live);
        // The spare, if it has this size: its pages are written (the rest of them now),
        // so neither the moves nor the readers take a fault on it.
        let spare = self.state.spare.take();
        let new = match spare.filter(|s| s.capacity() == capacity) {
            Some(spare) => {
                self.state.faulted = capacity;
                spare.into_table(meta, &self.owner.alive)
            }
            None => {
                self.state.faulted = 0;
                Table::new(capacity, meta, &self.owner.alive)
            }
        };
        let new = Box::into_raw(Box::new(new));
        self.owner
            .migrating
            .store(1, std::sync::atomic::Ordering::Relaxed);
        self.state.cursor = 0;
        old.next.store(new, Ordering::Release);
        capacity
    }

    /// Makes ready the slots of the next migration's table, to `capacity` slots (as
    /// [`begin_migration`](Self::begin_migration) would size it for `live` keys), `pages`
    /// pages' worth at a time, before any reader can reach them. A table made at once
    /// costs its whole size in one insert: zeroed by the allocator where it reuses
    /// memory, or mapped page by page on first access where it does not, and there each
    /// first write to a page a reader had read first (mapping the shared zero page) takes
    /// a second fault and a TLB shootdown of the other threads, microseconds each. The
    /// next migration of this size takes the slots (writing any left); one of another
    /// size drops them. Returns true once every slot is written.
    pub(crate) fn prepare(
        &mut self,
        guard: &Guard<'_>,
        capacity: usize,
        live: usize,
        pages: usize,
    ) -> bool {
        let capacity = migration_capacity(self.table(guard).capacity(), capacity, live);
        let spare = match self.state.spare.take() {
            Some(spare) if spare.capacity() == capacity => spare,
            _ => Spare::new(capacity),
        };
        self.state.spare.insert(spare).fill(pages)
    }

    /// Whether the current table is within `inserts` keys of its load limit.
    pub(crate) fn nearly_full(&self, guard: &Guard<'_>, inserts: usize) -> bool {
        let table = self.table(guard);
        !fits(
            table.used.load(Ordering::Relaxed) + 1 + inserts,
            table.capacity(),
        )
    }

    /// Whether a table is made ready for the next migration (see [`prepare`](Self::prepare)).
    #[cfg(test)]
    pub(crate) fn has_spare(&self) -> bool {
        self.state.spare.is_some()
    }

    /// Moves up to `budget` slots of the current table to the table a migration moves
    /// to, each state through [`Carry::carry`] at `now`; once the last has moved,
    /// publishes the new table and retires the old one. Returns true if it published.
    /// Removed keys are left behind.
    ///
    /// `rehash` (the key's `Hash`, user code) runs on a key before it freezes, so a
    /// panicking `Hash` leaves the slot as it was. Between the freeze and the key's
    /// placement in the new table a panic (a `Hash` that panics on its second call only,
    /// or a panicking `Eq` in `carry`) would strand a frozen key: there it aborts.
    pub(crate) fn step(
        &mut self,
        guard: &Guard<'_>,
        budget: usize,
        rehash: impl Fn(&K) -> u64,
        now: u64,
    ) -> bool
    where
        M: Carry<K, A::Value>,
    {
        self.step_inner(guard, budget, rehash, now, false)
    }

    /// [`step`](Self::step) for a check that helps: a table it unlinks is not retired
    /// (that may allocate) but left for the next writer to retire.
    pub(crate) fn help(
        &mut self,
        guard: &Guard<'_>,
        budget: usize,
        rehash: impl Fn(&K) -> u64,
        now: u64,
    ) -> bool
    where
        M: Carry<K, A::Value>,
    {
        self.step_inner(guard, budget, rehash, now, true)
    }

    /// Retires the table a check's help unlinked, if any.
    pub(crate) fn retire_unretired(&mut self, guard: &Guard<'_>) {
        // Every insert passes here: a load, not a swap, when nothing is pending.
        if self.owner.unretired.load(Ordering::Relaxed).is_null() {
            return;
        }
        let old = self
            .owner
            .unretired
            .swap(std::ptr::null_mut(), Ordering::Relaxed);
        if !old.is_null() {
            // SAFETY: as in `step_inner`: unlinked from `current` before this writer took
            // the mutex (so only guards in force now can hold it), made by `Box::into_raw`,
            // and retired once, here (the swap took the only pointer to it).
            unsafe { guard.retire(old.cast(), Table::<K, M, A>::destroy) };
        }
    }

    fn step_inner(
        &mut self,
        guard: &Guard<'_>,
        budget: usize,
        rehash: impl Fn(&K) -> u64,
        now: u64,
        defer_retire: bool,
    ) -> bool
    where
        M: Carry<K, A::Value>,
    {
        if !defer_retire {
            self.retire_unretired(guard);
        }
        let old = self.table(guard);
        let Some(new) = old.next() else {
            return false;
        };
        let end = old.capacity();
        let stop = self.state.cursor.saturating_add(budget).min(end);
        self.prefault(new, stop, end);
        for index in self.state.cursor..stop {
            let slot = &old.slots[index];
            let Some(hash) = slot.with_key(&rehash) else {
                continue;
            };
            let no_unwind = AbortOnUnwind;
            if let Some(state) = slot.freeze() {
                // SAFETY: this writer froze the slot, so it alone moves the key out: the old
                // table's `Drop` skips FROZEN slots, and readers only read the bytes (which
                // stay valid: `new` keeps the value alive and outlives `old`).
                let key = slot.key.with(|key| unsafe { (*key).assume_init_read() });
                let state = new.meta.carry(&old.meta, &key, hash, state, now);
                // SAFETY: this writer holds the mutex and `new` is the insert target. (It
                // was sized in `begin_migration` for every live key and every insert that
                // can come before the last slot moves, within the load limit, so `place`
                // finds an empty slot.)
                unsafe { new.place(hash, key, state) };
            }
            std::mem::forget(no_unwind);
        }
        self.state.cursor = stop;
        if stop < end {
            return false;
        }
        let new = old.next.load(Ordering::Relaxed);
        let old = self.owner.current.swap(new, Ordering::AcqRel);
        self.owner
            .migrating
            .store(0, std::sync::atomic::Ordering::Relaxed);
        self.state.cursor = 0;
        if defer_retire {
            // Left for the next writer: no table is pending (each writer path retires the
            // pending one first, and a migration spans at least one writer path: its
            // `begin_migration`).
            self.owner.unretired.store(old, Ordering::Relaxed);
            return true;
        }
        // SAFETY: `old` (made by `Box::into_raw`, in `new` or an earlier migration) is no
        // longer reachable from `current`, so only guards in force now can hold it, and
        // the domain destroys it after they have all dropped; it is retired once, here.
        // Its keys and meta are `Send + 'static`, so destroying it later on another thread
        // is sound. (Its `next`, the new current table, is not its to drop.)
        unsafe { guard.retire(old.cast(), Table::<K, M, A>::destroy) };
        true
    }
}

/// The tests' metas carry every state over as it is.
#[cfg(test)]
impl<K> Carry<K> for () {
    fn carry(&self, _: &Self, _: &K, _: u64, state: u64, _: u64) -> u64 {
        state
    }
}

#[cfg(test)]
impl<K> Carry<K> for u64 {
    fn carry(&self, _: &Self, _: &K, _: u64, state: u64, _: u64) -> u64 {
        state
    }
}

#[cfg(test)]
impl<K> Carry<K, Two> for u64 {
    fn carry(&self, _: &Self, _: &K, _: u64, state: Two, _: u64) -> Two {
        state
    }
}

/// How many slots an insert moves while a migration is under way: enough for the
/// migration to end long before the new table fills, few enough to take microseconds.
pub(crate) const STEP_PER_INSERT: usize = 16;

impl<K, M, W, A: Atom> Writer<'_, K, M, W, A> {
    /// Touches the pages of the migration's new table ahead of the keys moving in: its
    /// slots come from a zeroed allocation whose pages the kernel maps on first write,
    /// and keys land at random, so without this each move of the first steps would take
    /// a page fault of its own. Pages are touched in order, four times as fast as the
    /// migration moves (all of them by a quarter of the way), a word each, by a write
    /// that changes nothing ([`touch`]: the writer alone writes the new table's slots,
    /// and readers see the same word). A migration that took a [`prepare`](Self::prepare)d
    /// table has nothing left to touch; readers may have mapped the pages of any other
    /// before they are touched (see `prepare`).
    fn prefault(&mut self, new: &Table<K, M, A>, moved: usize, of: usize) {
        if cfg!(tollgate_loom) {
            return;
        }
        let per_page = slots_per_page::<K, A>();
        let capacity = new.capacity();
        let target = (moved.saturating_mul(4).saturating_mul(capacity) / of.max(1))
            .saturating_add(per_page)
            .min(capacity);
        while self.state.faulted < target {
            touch(&new.slots[self.state.faulted]);
            self.state.faulted += per_page;
        }
    }
}

/// Aborts the process if dropped: held across a section that must not unwind.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        std::process::abort();
    }
}

mod atom {
    //! A slot's state word: one `u64` ([`AtomicU64`]), or two `u64` states changed together by
    //! one 16-byte compare-and-swap ([`AtomicPair`]), for a key held to two quotas at once.
    //!
    //! The table's protocol (see the [parent module](super)) reads only a value's
    //! [`head`](Atom::head): the `u64` that is `EMPTY`, `REMOVED`, `FROZEN` or a live state.
    //! A pair's head is its first state; its second state rides along, written and read in
    //! the same atomic operations, so every step of the protocol holds for the pair exactly as
    //! for one word.

    use super::sync::{AtomicU64, Ordering};
    use super::{EMPTY, STATE_MAX};

    /// A slot's atomic state word.
    ///
    /// # Safety
    /// All-zero bytes are a valid value of the implementing type, equal to
    /// [`empty`](Atom::empty): its head is `EMPTY` (a table's slots come from a zeroed
    /// allocation).
    pub(crate) unsafe trait Atom: Send + Sync + 'static {
        /// A state, or a marker in the head.
        type Value: Copy + Eq + std::fmt::Debug + Send + Sync + 'static;

        /// A word whose head is `EMPTY`.
        fn empty() -> Self;
        /// The `u64` the protocol reads: `EMPTY`, `REMOVED`, `FROZEN` or a live state.
        fn head(value: Self::Value) -> u64;
        /// A value whose head is `marker` (the rest zero).
        fn marker(marker: u64) -> Self::Value;
        /// Every state of `value` clamped to [`STATE_MAX`], so a live value never reads as
        /// a marker.
        fn clamp(value: Self::Value) -> Self::Value;
        fn load(&self, order: Ordering) -> Self::Value;
        fn store(&self, value: Self::Value, order: Ordering);
        fn compare_exchange(
            &self,
            current: Self::Value,
            new: Self::Value,
            success: Ordering,
            failure: Ordering,
        ) -> Result<Self::Value, Self::Value>;
        /// [`compare_exchange`](Self::compare_exchange), allowed to fail spuriously (which
        /// costs a loop nothing, and saves one on machines with load-linked stores).
        fn compare_exchange_weak(
            &self,
            current: Self::Value,
            new: Self::Value,
            success: Ordering,
            failure: Ordering,
        ) -> Result<Self::Value, Self::Value> {
            self.compare_exchange(current, new, success, failure)
        }
        /// Writes the word without changing it, so the kernel maps its page for writing
        /// (see the parent module's `touch`).
        fn touch(&self);
    }

    /// A word is stored inverted, so that all-zero bytes are `EMPTY` (`u64::MAX`).
    #[inline(always)]
    const fn stored(word: u64) -> u64 {
        !word
    }

    // SAFETY: an `AtomicU64` of 0 is a valid value, and stores `!0 = EMPTY`.
    unsafe impl Atom for AtomicU64 {
        type Value = u64;

        fn empty() -> Self {
            AtomicU64::new(stored(EMPTY))
        }

        #[inline(always)]
        fn head(value: u64) -> u64 {
            value
        }

        #[inline(always)]
        fn marker(marker: u64) -> u64 {
            marker
        }

        #[inline(always)]
        fn clamp(value: u64) -> u64 {
            value.min(STATE_MAX)
        }

        #[inline(always)]
        fn load(&self, order: Ordering) -> u64 {
            stored(AtomicU64::load(self, order))
        }

        #[inline(always)]
        fn store(&self, value: u64, order: Ordering) {
            AtomicU64::store(self, stored(value), order);
        }

        #[inline(always)]
        fn compare_exchange(
            &self,
            current: u64,
            new: u64,
            success: Ordering,
            failure: Ordering,
        ) -> Result<u64, u64> {
            AtomicU64::compare_exchange(self, stored(current), stored(new), success, failure)
                .map(stored)
                .map_err(stored)
        }

        #[inline(always)]
        fn compare_exchange_weak(
            &self,
            current: u64,
            new: u64,
            success: Ordering,
            failure: Ordering,
        ) -> Result<u64, u64> {
            AtomicU64::compare_exchange_weak(self, stored(current), stored(new), success, failure)
                .map(stored)
                .map_err(stored)
        }

        fn touch(&self) {
            // An opaque 0: an add of a constant 0 may compile to a fenced load, which maps
            // the shared zero page instead of writing.
            self.fetch_add(std::hint::black_box(0), Ordering::Relaxed);
        }
    }

    /// Two states, the head first, as one value.
    pub(crate) type Two = [u64; 2];

    /// The 16-byte word of a key held to two quotas: both states change in one
    /// compare-and-swap, so a check decides the pair all or nothing with no refund, and a
    /// migration freezes both at once.
    ///
    /// On x86-64, `lock cmpxchg16b` and `vmovdqa` (atomic for an aligned 16 bytes on every
    /// CPU with AVX, by Intel's and AMD's manuals), inline: a check makes no call for its
    /// word. Elsewhere, portable-atomic's `AtomicU128` (also on x86-64 under `--cfg
    /// tollgate_portable_pair`, which ./scripts/test.sh runs the store's and the engine's
    /// tests under, so that this path is tested here too). Usable only where
    /// [`lock_free`](Self::lock_free) says so; [`PairPolicy`](crate::store::rule::PairPolicy)s,
    /// the only users, are made only then.
    #[repr(C, align(16))]
    pub(crate) struct AtomicPair(Bits);

    #[cfg(all(
        target_arch = "x86_64",
        not(tollgate_portable_pair),
        not(tollgate_loom)
    ))]
    type Bits = std::cell::UnsafeCell<u128>;

    #[cfg(all(
        any(not(target_arch = "x86_64"), tollgate_portable_pair),
        not(tollgate_loom)
    ))]
    type Bits = portable_atomic::AtomicU128;

    /// Under loom, whose atomics stop at 64 bits: a loom mutex over the value, which loom
    /// explores as one atomic step.
    #[cfg(tollgate_loom)]
    type Bits = super::sync::Mutex<u128>;

    #[cfg(all(
        target_arch = "x86_64",
        not(tollgate_portable_pair),
        not(tollgate_loom)
    ))]
    // SAFETY: every access to the bits goes through the atomic instructions below (an
    // aligned `vmovdqa` load or store, `lock cmpxchg16b`), so sharing them between threads is
    // sound. (portable-atomic's `AtomicU128` and loom's mutex are `Sync` themselves.)
    unsafe impl Sync for AtomicPair {}

    impl AtomicPair {
        /// The bits stored for `value`: the head inverted (so zero is `EMPTY`), the second
        /// state as it is.
        #[inline(always)]
        fn pack(value: Two) -> u128 {
            u128::from(stored(value[0])) | u128::from(value[1]) << 64
        }

        #[inline(always)]
        fn unpack(bits: u128) -> Two {
            [stored(bits as u64), (bits >> 64) as u64]
        }
    }

    #[cfg(all(
        target_arch = "x86_64",
        not(tollgate_portable_pair),
        not(tollgate_loom)
    ))]
    impl AtomicPair {
        /// Whether this CPU has `cmpxchg16b` and AVX (detected once, then a cached flag).
        pub(crate) fn lock_free() -> bool {
            std::arch::is_x86_feature_detected!("cmpxchg16b")
                && std::arch::is_x86_feature_detected!("avx")
        }

        fn with_bits(bits: u128) -> Self {
            Self(std::cell::UnsafeCell::new(bits))
        }

        /// An atomic 16-byte load. Ordered as an x86 load (acquire), and a compiler barrier.
        #[inline(always)]
        fn load_bits(&self) -> u128 {
            let (lo, hi): (u64, u64);
            // SAFETY: the pointer is to 16 aligned bytes (`align(16)`) alive for `&self`.
            // `vmovdqa` of an aligned 16 bytes is one atomic access on the CPUs with AVX,
            // which `lock_free` requires before any pair exists (a CPU without it would
            // raise #UD: the process dies of SIGILL, touching nothing). The block may read
            // and write memory as far as the compiler knows, so nothing moves across it.
            unsafe {
                std::arch::asm!(
                    "vmovdqa {x}, xmmword ptr [{p}]",
                    "vmovq {lo}, {x}",
                    "vpextrq {hi}, {x}, 1",
                    p = in(reg) self.0.get(),
                    x = out(xmm_reg) _,
                    lo = out(reg) lo,
                    hi = out(reg) hi,
                    options(nostack, preserves_flags),
                );
            }
            u128::from(lo) | u128::from(hi) << 64
        }

        /// An atomic 16-byte store (release, as every x86 store).
        #[inline(always)]
        fn store_bits(&self, bits: u128) {
            // SAFETY: as in `load_bits`: an aligned `vmovdqa` store is one atomic access on
            // the CPUs `lock_free` admits.
            unsafe {
                std::arch::asm!(
                    "vmovq {x}, {lo}",
                    "vpinsrq {x}, {x}, {hi}, 1",
                    "vmovdqa xmmword ptr [{p}], {x}",
                    p = in(reg) self.0.get(),
                    x = out(xmm_reg) _,
                    lo = in(reg) bits as u64,
                    hi = in(reg) (bits >> 64) as u64,
                    options(nostack, preserves_flags),
                );
            }
        }

        /// `lock cmpxchg16b`: replaces `current` with `new`; the bits it held either way.
        /// A full barrier. It writes the line even when it fails, with the bits it read.
        #[inline(always)]
        fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
            let (lo, hi): (u64, u64);
            let swapped: u8;
            // SAFETY: the pointer is to 16 aligned bytes alive for `&self`, and
            // `cmpxchg16b` exists on every CPU `lock_free` admits. `rbx`, which the
            // instruction reads and LLVM reserves, is swapped in from a scratch register and
            // restored before the block ends; the pointer is pinned to `rdi`, so it is never
            // allocated to `rbx`.
            unsafe {
                std::arch::asm!(
                    "xchg {new_lo}, rbx",
                    "lock cmpxchg16b xmmword ptr [rdi]",
                    "sete {swapped}",
                    "mov rbx, {new_lo}",
                    in("rdi") self.0.get(),
                    new_lo = inout(reg) new as u64 => _,
                    swapped = out(reg_byte) swapped,
                    in("rcx") (new >> 64) as u64,
                    inout("rax") current as u64 => lo,
                    inout("rdx") (current >> 64) as u64 => hi,
                    options(nostack),
                );
            }
            let held = u128::from(lo) | u128::from(hi) << 64;
            if swapped != 0 { Ok(held) } else { Err(held) }
        }
    }

    #[cfg(all(
        any(not(target_arch = "x86_64"), tollgate_portable_pair),
        not(tollgate_loom)
    ))]
    impl AtomicPair {
        /// Whether this machine has lock-free 16-byte atomics (portable-atomic detects it).
        pub(crate) fn lock_free() -> bool {
            portable_atomic::AtomicU128::is_lock_free()
        }

        fn with_bits(bits: u128) -> Self {
            Self(portable_atomic::AtomicU128::new(bits))
        }

        #[inline(always)]
        fn load_bits(&self) -> u128 {
            self.0.load(Ordering::Acquire)
        }

        #[inline(always)]
        fn store_bits(&self, bits: u128) {
            self.0.store(bits, Ordering::Release);
        }

        #[inline(always)]
        fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
            self.0
                .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
        }
    }

    #[cfg(tollgate_loom)]
    impl AtomicPair {
        pub(crate) fn lock_free() -> bool {
            true
        }

        fn with_bits(bits: u128) -> Self {
            Self(super::sync::Mutex::new(bits))
        }

        fn load_bits(&self) -> u128 {
            *super::sync::lock(&self.0)
        }

        fn store_bits(&self, bits: u128) {
            *super::sync::lock(&self.0) = bits;
        }

        fn cas_bits(&self, current: u128, new: u128) -> Result<u128, u128> {
            let mut bits = super::sync::lock(&self.0);
            if *bits == current {
                *bits = new;
                Ok(current)
            } else {
                Err(*bits)
            }
        }
    }

    // SAFETY: `AtomicPair` is 16 bytes of `u128` (in an `UnsafeCell`, or portable-atomic's
    // `AtomicU128`, itself a `u128` in an `UnsafeCell`): zero is a valid value, and zero bits
    // unpack to a head of `!0 = EMPTY`. (Under loom, tables are built value by value from
    // `empty`, never from zeroed bytes.)
    unsafe impl Atom for AtomicPair {
        type Value = Two;

        fn empty() -> Self {
            Self::with_bits(Self::pack([EMPTY, 0]))
        }

        #[inline(always)]
        fn head(value: Two) -> u64 {
            value[0]
        }

        #[inline(always)]
        fn marker(marker: u64) -> Two {
            [marker, 0]
        }

        #[inline(always)]
        fn clamp(value: Two) -> Two {
            [value[0].min(STATE_MAX), value[1].min(STATE_MAX)]
        }

        /// Every access is as strong as x86's (acquire loads, release stores, sequentially
        /// consistent compare-and-swaps), whatever `order` asks.
        #[inline(always)]
        fn load(&self, _order: Ordering) -> Two {
            Self::unpack(self.load_bits())
        }

        #[inline(always)]
        fn store(&self, value: Two, _order: Ordering) {
            self.store_bits(Self::pack(value));
        }

        #[inline(always)]
        fn compare_exchange(
            &self,
            current: Two,
            new: Two,
            _: Ordering,
            _: Ordering,
        ) -> Result<Two, Two> {
            self.cas_bits(Self::pack(current), Self::pack(new))
                .map(Self::unpack)
                .map_err(Self::unpack)
        }

        /// A compare-and-swap of 0 for 0: it changes nothing (the bits are 0 and stay so, or
        /// are not 0 and are written back as they were), but a locked instruction always
        /// writes, which maps the page for writing. Never a load and a store: checks may be
        /// changing the word meanwhile.
        fn touch(&self) {
            let _ = self.cas_bits(0, 0);
        }
    }

    #[cfg(all(test, not(tollgate_loom)))]
    mod tests {
        use super::*;

        #[test]
        fn a_zeroed_pair_is_empty_and_values_round_trip() {
            assert!(
                AtomicPair::lock_free(),
                "this machine has cmpxchg16b and AVX"
            );
            // SAFETY: `Atom`'s contract: all-zero bytes are a valid `AtomicPair`.
            let zero: AtomicPair = unsafe { std::mem::zeroed() };
            assert_eq!(AtomicPair::head(zero.load(Ordering::Acquire)), EMPTY);
            let pair = AtomicPair::empty();
            assert_eq!(pair.load(Ordering::Acquire), [EMPTY, 0]);
            pair.store([5, u64::MAX], Ordering::Release);
            assert_eq!(pair.load(Ordering::Acquire), [5, u64::MAX]);
            // A failed swap changes nothing and says what the word holds.
            assert_eq!(
                pair.compare_exchange([5, 0], [6, 6], Ordering::AcqRel, Ordering::Acquire),
                Err([5, u64::MAX])
            );
            assert_eq!(
                pair.compare_exchange([0, u64::MAX], [6, 6], Ordering::AcqRel, Ordering::Acquire),
                Err([5, u64::MAX])
            );
            assert_eq!(
                pair.compare_exchange([5, u64::MAX], [6, 7], Ordering::AcqRel, Ordering::Acquire),
                Ok([5, u64::MAX])
            );
            assert_eq!(pair.load(Ordering::Acquire), [6, 7]);
            // Touching writes the value back as it is, zero or not.
            pair.touch();
            assert_eq!(pair.load(Ordering::Acquire), [6, 7]);
            zero.touch();
            assert_eq!(AtomicPair::head(zero.load(Ordering::Acquire)), EMPTY);
            assert_eq!(
                AtomicPair::clamp([u64::MAX, u64::MAX]),
                [STATE_MAX, STATE_MAX]
            );
        }

        /// Two threads move both halves of one word together, each by compare-and-swap,
        /// while a third loads it: every load sees halves that belong together (never half
        /// of one write and half of another), and no increment is lost.
        #[test]
        fn both_halves_change_together_under_contention() {
            const ROUNDS: u64 = 200_000;
            let pair = AtomicPair::empty();
            pair.store([0, 0], Ordering::Release);
            let done = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| {
                        for _ in 0..ROUNDS {
                            let mut seen = pair.load(Ordering::Acquire);
                            loop {
                                let next = [seen[0] + 1, seen[1].wrapping_sub(1)];
                                match pair.compare_exchange_weak(
                                    seen,
                                    next,
                                    Ordering::AcqRel,
                                    Ordering::Acquire,
                                ) {
                                    Ok(_) => break,
                                    Err(actual) => seen = actual,
                                }
                            }
                        }
                    });
                }
                s.spawn(|| {
                    let mut loads = 0u64;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) || loads == 0 {
                        let [up, down] = pair.load(Ordering::Acquire);
                        assert_eq!(up.wrapping_add(down), 0, "a torn load: {up}, {down}");
                        loads += 1;
                    }
                });
                // The loader stops once both writers are done.
                while pair.load(Ordering::Acquire)[0] < 2 * ROUNDS {
                    std::hint::spin_loop();
                }
                done.store(true, std::sync::atomic::Ordering::Relaxed);
            });
            assert_eq!(
                pair.load(Ordering::Acquire),
                [2 * ROUNDS, (2 * ROUNDS).wrapping_neg()]
            );
        }
    }
}

pub(crate) mod reclaim {
    //! When a retired table may be freed: an epoch scheme private to tollgate, whose readers
    //! write only a word of their own and hold nothing between checks.
    //!
    //! ```text
    //! Domain { epoch, registry: Record → Record → …, garbage: [(epoch, table)…] }
    //!            │             each Record: state = 0 (quiescent) | the epoch its thread read
    //!            └─ a retire bumps it and tags the unlinked table with the new value
    //! ```
    //!
    //! # The protocol
    //!
    //! A reader (a check) takes a [`Guard`] on its thread's [`Record`]: it stores the domain's
    //! epoch into its state word, passes a *light barrier*, and loads the table pointer; when
    //! the guard drops it stores 0 (quiescent). A thread that is not inside a check, however
    //! long it sleeps, is quiescent: it holds nothing back.
    //!
    //! A writer unlinks a table (the pointer swap), then [`retire`](Guard::retire)s it: the
    //! epoch is bumped, and the table tagged with the new value `t`. [`Domain::collect`] then
    //! passes a *heavy barrier* and reads every record: a table tagged `t` is freed once every
    //! record reads 0 or an epoch ≥ `t`.
    //!
    //! - A record at an epoch ≥ `t` read the epoch after the bump (`Acquire` on the bump's
    //!   `Release`), so after the swap: its load of the pointer returns the new table.
    //! - A record read as 0 after the heavy barrier: the barriers pair as two `SeqCst` fences
    //!   (the store-buffering pattern). Either the reader's store of its epoch is visible to
    //!   the scan — then the scan does not read that 0 — or the swap is visible to the
    //!   reader's load of the pointer after its barrier, which then returns the new table. A
    //!   0 stored when an earlier guard dropped is a `Release` store, read with `Acquire`:
    //!   everything that guard did happened before the table is freed.
    //! - A record at an epoch < `t` may hold the table: it is kept, and a later collect frees
    //!   it once that check is over.
    //!
    //! So a table is freed at the first collect after every check that was in flight when it
    //! was retired has finished, and threads that are idle, parked or blocked for hours never
    //! delay it. Collects run after every retire (the writer waits a few microseconds there
    //! for checks in flight), on the store's other write paths while garbage is pending, and,
    //! once and without waiting ([`Domain::collect_once`]), after a check that went off the
    //! fast path (one that read through a migration) while garbage is pending. A collect
    //! passes the heavy barrier only when a read of the records without it shows that the
    //! oldest garbage may be free.
    //!
    //! An object may be destroyed in pieces ([`Destroy`]): a large table's first piece goes
    //! when it would have been freed whole, and the rest a piece per writer's collect (or
    //! all at once on an operator's path, [`Domain::release_parked`]), so that no request
    //! pays for handing megabytes of pages back at once. Nothing reaches it meanwhile: the
    //! pieces change only when the memory goes, not when it may.
    //!
    //! # The barriers
    //!
    //! On Linux, when the process can register for `membarrier(2)`'s
    //! `MEMBARRIER_CMD_PRIVATE_EXPEDITED` (Linux 4.14 and later), the light barrier is a
    //! compiler fence and the heavy one is that system call: it makes every running thread of
    //! the process execute a full memory barrier before it returns (a thread not running has
    //! passed one in its context switch), as liburcu's "memb" flavour and folly's asymmetric
    //! fences do. A check then pays two plain stores and no fence; the writer pays the
    //! system call, once per retire. Elsewhere, or if registration fails, both barriers are
    //! `SeqCst` fences. The loom models run the `SeqCst` form.
    //!
    //! Nothing here touches crossbeam-epoch's global collector, so tollgate never delays
    //! another library's reclamation, nor theirs ours.

    #[cfg(not(tollgate_loom))]
    use std::cell::Cell;
    use std::marker::PhantomData;
    use std::ptr;

    use crossbeam_utils::CachePadded;

    use super::sync::{self, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Mutex, Ordering};
    #[cfg(all(test, tollgate_loom))]
    use loom::sync::Arc as TestArc;
    #[cfg(all(test, not(tollgate_loom)))]
    use std::sync::Arc as TestArc;

    /// A record's state while its thread holds no guard.
    const QUIESCENT: u64 = 0;
    /// How many times a collect reads the records again, a few hundred nanoseconds apart,
    /// when a check in flight holds back what it retired (once under loom, where each spin
    /// is a branch of the model).
    #[cfg(not(tollgate_loom))]
    const RESCANS: u32 = 16;
    #[cfg(tollgate_loom)]
    const RESCANS: u32 = 2;
    /// How many objects a collect takes out of the garbage list per hold of its mutex (into
    /// an array on its stack, to destroy them outside it).
    const FREED_PER_LOCK: usize = 16;
    /// How many objects released in pieces a domain holds between collects (in an array:
    /// parking one allocates nothing); one more is destroyed whole where it is found.
    const PARKED: usize = 16;
    /// Spins between two reads of the records.
    #[cfg(not(tollgate_loom))]
    const SPINS: u32 = 64;
    #[cfg(tollgate_loom)]
    const SPINS: u32 = 1;

    /// One thread's word: [`QUIESCENT`], or the epoch it read when it took its outermost
    /// guard. Records are never freed while their domain lives; a thread that exits gives
    /// its record back, and the next new thread reuses it.
    pub(crate) struct Record {
        state: CachePadded<AtomicU64>,
        claimed: AtomicBool,
        /// Whether this record's guards may pass the light barrier as a compiler fence (the
        /// domain's heavy barrier is `membarrier`).
        light: bool,
        /// The next record of the registry; written before the record is published.
        next: *const Record,
    }

    // SAFETY: every thread reads every record (the collect's scan) while its owner writes
    // it: its state and claim are atomics, `light` is never written after the record is
    // made, and `next` is written once, before the record is published (`Release` on the
    // registry's head), and never after.
    unsafe impl Sync for Record {}

    /// Destroys a retired object, or the next piece of it: true once it is gone. An object
    /// destroyed in pieces (a large table: see `Table::destroy`) is called again at later
    /// collects, one piece each, so that no collect pays for all of it.
    pub(crate) type Destroy = unsafe fn(*mut ()) -> bool;

    /// A table (or anything) unlinked at `epoch`, and how to destroy it.
    struct Retired {
        epoch: u64,
        ptr: *mut (),
        destroy: Destroy,
    }

    // SAFETY: a `Retired` is only ever created by `Guard::retire`, whose contract requires the
    // object behind `ptr` to be safe to destroy on any thread (`Send + 'static`).
    unsafe impl Send for Retired {}

    /// The garbage waiting for readers. A collect frees in place and never allocates (see
    /// [`Domain::collect_within`]); a retire's push allocates only while the list grows to
    /// the most garbage the stores have kept pending at once (a few tables).
    struct Garbage {
        list: Vec<Retired>,
    }

    impl Garbage {
        const EMPTY: Self = Self { list: Vec::new() };
    }

    /// Objects that no guard can reach any more and that are destroyed a piece per collect.
    struct Parked {
        list: [Option<(*mut (), Destroy)>; PARKED],
    }

    // SAFETY: as for `Retired`: each object was retired as safe to destroy on any thread.
    unsafe impl Send for Parked {}

    impl Parked {
        const EMPTY: Self = Self {
            list: [None; PARKED],
        };
    }

    /// The epoch, the registry of records, and the garbage waiting for readers.
    pub(crate) struct Domain {
        epoch: CachePadded<AtomicU64>,
        head: AtomicPtr<Record>,
        garbage: Mutex<Garbage>,
        /// Objects out of `garbage`, destroyed in pieces.
        parked: Mutex<Parked>,
        /// How many `parked` holds.
        parked_len: AtomicUsize,
        /// Retired and not yet freed (whole: parked objects count until their last piece).
        unfreed: AtomicUsize,
        /// Whether the heavy barrier may be `membarrier`, and whether it is (decided when
        /// the first record is claimed: registering is a system call).
        #[cfg(not(tollgate_loom))]
        membarrier: (bool, std::sync::OnceLock<bool>),
        /// Heavy barriers passed, for the tests.
        #[cfg(all(test, not(tollgate_loom)))]
        barriers: std::sync::atomic::AtomicUsize,
    }

    impl Domain {
        /// A domain of its own, for tests: with `SeqCst` fences on both sides under loom,
        /// else as the global one.
        #[cfg(tollgate_loom)]
        pub(crate) fn new() -> Self {
            Self {
                epoch: CachePadded::new(AtomicU64::new(1)),
                head: AtomicPtr::new(ptr::null_mut()),
                garbage: Mutex::new(Garbage::EMPTY),
                parked: Mutex::new(Parked::EMPTY),
                parked_len: AtomicUsize::new(0),
                unfreed: AtomicUsize::new(0),
            }
        }

        /// A domain whose heavy barrier is `membarrier` if `membarrier` and the process can
        /// register for it, else a `SeqCst` fence.
        #[cfg(not(tollgate_loom))]
        const fn with_barrier(membarrier: bool) -> Self {
            Self {
                epoch: CachePadded::new(AtomicU64::new(1)),
                head: AtomicPtr::new(ptr::null_mut()),
                garbage: Mutex::new(Garbage::EMPTY),
                parked: Mutex::new(Parked::EMPTY),
                parked_len: AtomicUsize::new(0),
                unfreed: AtomicUsize::new(0),
                membarrier: (membarrier, std::sync::OnceLock::new()),
                #[cfg(all(test, not(tollgate_loom)))]
                barriers: std::sync::atomic::AtomicUsize::new(0),
            }
        }

        /// A domain of its own, for tests: with `SeqCst` fences on both sides under loom,
        /// else as the global one.
        #[cfg(all(test, not(tollgate_loom)))]
        pub(crate) fn new() -> Self {
            Self::with_barrier(true)
        }

        /// Whether the heavy barrier is `membarrier` (so records may pass the light one as
        /// a compiler fence). Decided once per domain.
        fn asymmetric(&self) -> bool {
            #[cfg(not(tollgate_loom))]
            {
                let (allowed, decided) = &self.membarrier;
                *decided.get_or_init(|| *allowed && membarrier::register())
            }
            #[cfg(tollgate_loom)]
            false
        }

        /// Decides the heavy barrier now (see [`asymmetric`](Self::asymmetric)), if not
        /// yet: for a store's construction. Registering for `membarrier` waits for an RCU
        /// grace period in a process of several threads (20 ms measured on a 2-vCPU VM), and
        /// the first guard of the process would otherwise pay it: a server's first request.
        pub(crate) fn decide_barrier(&self) {
            self.asymmetric();
        }

        /// Claims a record for the calling thread: a released one, else a new one.
        fn claim(&self) -> &Record {
            let mut at = self.head.load(Ordering::Acquire).cast_const();
            while !at.is_null() {
                // SAFETY: records reached from `head` are published whole (`Release` on `head`,
                // `Acquire` above) and live as long as the domain.
                let record = unsafe { &*at };
                if !record.claimed.load(Ordering::Relaxed)
                    && record
                        .claimed
                        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    return record;
                }
                at = record.next;
            }
            let record = Box::into_raw(Box::new(Record {
                state: CachePadded::new(AtomicU64::new(QUIESCENT)),
                claimed: AtomicBool::new(true),
                light: self.asymmetric(),
                next: ptr::null(),
            }));
            let mut head = self.head.load(Ordering::Relaxed);
            loop {
                // SAFETY: `record` is not published yet: this thread alone writes it.
                unsafe { (*record).next = head };
                match self.head.compare_exchange_weak(
                    head,
                    record,
                    Ordering::Release,
                    Ordering::Relaxed,
                ) {
                    // SAFETY: published, never freed while the domain lives.
                    Ok(_) => return unsafe { &*record },
                    Err(actual) => head = actual,
                }
            }
        }

        /// A handle on a record of this domain for the calling thread (the tests' threads
        /// register explicitly; the store's threads through [`pin`]).
        #[cfg(test)]
        pub(crate) fn register(&self) -> Handle<'_> {
            Handle {
                domain: self,
                record: self.claim(),
            }
        }

        /// The oldest epoch a guard in force read; `u64::MAX` if no thread holds a guard.
        fn oldest_active(&self) -> u64 {
            let mut oldest = u64::MAX;
            let mut at = self.head.load(Ordering::Acquire).cast_const();
            while !at.is_null() {
                // SAFETY: as in `claim`.
                let record = unsafe { &*at };
                let state = record.state.load(Ordering::Acquire);
                if state != QUIESCENT {
                    oldest = oldest.min(state);
                }
                at = record.next;
            }
            oldest
        }

        /// Hands an unlinked object to the domain: it is destroyed once no guard can still
        /// hold it.
        fn retire(&self, ptr: *mut (), destroy: Destroy) {
            let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
            self.unfreed.fetch_add(1, Ordering::Relaxed);
            sync::lock(&self.garbage).list.push(Retired {
                epoch,
                ptr,
                destroy,
            });
        }

        /// How many retired objects are not freed yet.
        pub(crate) fn unfreed(&self) -> usize {
            self.unfreed.load(Ordering::Relaxed)
        }

        /// Frees every retired object that no guard in force can hold; if a check in flight
        /// holds some back, reads the records again a few times (checks take nanoseconds)
        /// before leaving them for a later collect. Returns how many were freed. The
        /// writers' collect, after a retire.
        ///
        /// A thread's own guard in force holds back what was retired since it was taken, so
        /// writers collect after dropping theirs.
        ///
        /// First, it destroys the next piece of an object destroyed in pieces, if one is
        /// parked ([`release_piece`](Self::release_piece)): writers pay for those, a piece
        /// each, not checks.
        pub(crate) fn collect(&self) -> usize {
            let released = self.release_piece();
            self.unfreed.fetch_sub(released, Ordering::Relaxed);
            released + self.collect_within(RESCANS)
        }

        /// [`collect`](Self::collect) with one read of the records and no wait: the collect
        /// of a check that retired nothing itself, so that garbage a writer could not free
        /// goes once the check in flight that held it is over, even if no writer comes.
        /// While a guard in force visibly holds the garbage it costs one read of the
        /// records; a check never spins here (a wait of a few microseconds on every check
        /// that reads through a migration was a tail of its own). It destroys no parked
        /// piece: done by checks, those raised the checks' p99.99 by a quarter while tables
        /// grew (only the first piece of an object it frees, as any collect does).
        pub(crate) fn collect_once(&self) -> usize {
            self.collect_within(1)
        }

        /// Frees what no guard in force can hold, reading the records up to `reads` times,
        /// [`SPINS`] apart. The heavy barrier is passed only once a read without it shows
        /// that a guard in force does not hold the oldest object: a barrier is a system
        /// call that interrupts every running thread of the process (an inter-processor
        /// interrupt each, tens of microseconds on a VM), and while a check that was in
        /// flight at a retire is preempted, every collect would pass one for nothing.
        /// Skipping it on a read without it is safe, stale or not: skipping only keeps the
        /// garbage for a later collect, and freeing still needs the barrier and a read
        /// after it.
        ///
        /// Frees in place and **allocates nothing, whatever runs beside it**: it takes the
        /// objects it frees out of the list [`FREED_PER_LOCK`] at a time, into an array on
        /// its stack, and never takes the list out or puts one back. (It took the list out
        /// and put back what it could not free, while a retire meanwhile filled the spare
        /// list left in its place: the two together could outgrow that list, an allocation
        /// on a check's path too.)
        ///
        /// Only objects retired before it first reads the list may go: those tagged at most
        /// the newest tag it saw there, `last`. Each was unlinked before its tag was drawn,
        /// and the tags are drawn in order by one read-modify-write, so every such unlink
        /// happened before that read, and so before the heavy barrier, as the protocol needs
        /// (module docs). One retired after the read (tagged above `last`) may pass the
        /// records, read while no guard was in force, and still be held by a guard taken
        /// since.
        fn collect_within(&self, reads: u32) -> usize {
            // The oldest and the newest tag the list holds now.
            let (first, last) = {
                let garbage = sync::lock(&self.garbage);
                let mut tags = garbage.list.iter().map(|retired| retired.epoch);
                let Some(tag) = tags.next() else {
                    return 0;
                };
                tags.fold((tag, tag), |(first, last), tag| {
                    (first.min(tag), last.max(tag))
                })
            };
            let mut freed = 0;
            if self.worth_a_barrier(first, reads) && self.heavy_barrier() {
                for rescan in 0..reads {
                    let (now_freed, held) = self.free_up_to(self.oldest_active().min(last), last);
                    freed += now_freed;
                    if !held || rescan + 1 == reads {
                        break;
                    }
                    for _ in 0..SPINS {
                        sync::spin_loop();
                    }
                }
            }
            self.unfreed.fetch_sub(freed, Ordering::Relaxed);
            freed
        }

        /// Destroys every object of the list tagged at most `up_to` (at most `last`, read
        /// after the heavy barrier as [`collect_within`](Self::collect_within) does): taken
        /// out of the list under the mutex, [`FREED_PER_LOCK`] at a time, and destroyed
        /// outside it. How many it destroyed, and whether the list still holds one tagged at
        /// most `last`.
        fn free_up_to(&self, up_to: u64, last: u64) -> (usize, bool) {
            let mut freed = 0;
            loop {
                let mut batch = [const { None::<Retired> }; FREED_PER_LOCK];
                let (mut taken, mut held) = (0, false);
                {
                    let mut garbage = sync::lock(&self.garbage);
                    let mut at = 0;
                    while at < garbage.list.len() && taken < FREED_PER_LOCK {
                        let tag = garbage.list[at].epoch;
                        if tag <= up_to {
                            batch[taken] = Some(garbage.list.swap_remove(at));
                            taken += 1;
                        } else {
                            held |= tag <= last;
                            at += 1;
                        }
                    }
                }
                // Out of the list before they are destroyed: a destructor that panics leaks
                // the rest of the batch, never destroys anything twice.
                for retired in batch.into_iter().flatten() {
                    // SAFETY: tagged at most `up_to` ≤ `last`, so unlinked before the heavy
                    // barrier (see `collect_within`), after which every record read quiescent
                    // or at an epoch at least `up_to`, so at least its tag: no guard can
                    // still reach it (module docs). It was retired once and has just left
                    // the list, under the mutex, so it is destroyed once (its later pieces
                    // by `release_piece`, which takes it out of `parked` first).
                    if unsafe { (retired.destroy)(retired.ptr) } {
                        freed += 1;
                    } else {
                        freed += self.park(retired.ptr, retired.destroy);
                    }
                }
                if taken < FREED_PER_LOCK {
                    return (freed, held);
                }
            }
        }

        /// Keeps an object whose first piece was destroyed for the next collects; where
        /// `parked` is full, destroys the rest of it now. Returns 1 if it did, else 0.
        fn park(&self, ptr: *mut (), destroy: Destroy) -> usize {
            let mut parked = sync::lock(&self.parked);
            if let Some(free) = parked.list.iter_mut().find(|entry| entry.is_none()) {
                *free = Some((ptr, destroy));
                self.parked_len.fetch_add(1, Ordering::Relaxed);
                return 0;
            }
            drop(parked);
            // SAFETY: as for its first piece (`free_up_to`): no guard can reach it, and it is
            // in no list, so this thread alone destroys it.
            while !unsafe { destroy(ptr) } {}
            1
        }

        /// Destroys the next piece of a parked object, out of `parked` meanwhile (a
        /// concurrent collect takes another, and parking waits for no piece). Skips if
        /// another collect holds `parked`'s mutex for a moment. Returns 1 if that was its
        /// last piece (or the rest went whole: see [`park`](Self::park)), else 0.
        fn release_piece(&self) -> usize {
            if self.parked_len.load(Ordering::Relaxed) == 0 {
                return 0;
            }
            let Some(taken) = sync::try_lock(&self.parked)
                .and_then(|mut parked| parked.list.iter_mut().find_map(Option::take))
            else {
                return 0;
            };
            self.parked_len.fetch_sub(1, Ordering::Relaxed);
            let (ptr, destroy) = taken;
            // SAFETY: parked by `park` once no guard could reach it, and taken out of
            // `parked` under its mutex: this thread alone destroys it, and a destructor that
            // panics leaks it, never destroys a piece twice.
            if unsafe { destroy(ptr) } {
                return 1;
            }
            self.park(ptr, destroy)
        }

        /// Destroys every parked object to its end, one at a time out of `parked`: for an
        /// operator's path (a quota change retires every shard's table at once, and would
        /// otherwise leave their pieces to later writes), and for a domain's drop. With
        /// nothing parked (as nearly always) it takes no lock: the count is this thread's
        /// own parking if it parked any, and a parking that races with this call is left to
        /// later collects, as it would be had it come just after.
        pub(crate) fn release_parked(&self) {
            while self.parked_len.load(Ordering::Relaxed) > 0 {
                let taken = sync::lock(&self.parked)
                    .list
                    .iter_mut()
                    .find_map(Option::take);
                let Some((ptr, destroy)) = taken else {
                    return;
                };
                self.parked_len.fetch_sub(1, Ordering::Relaxed);
                // SAFETY: as in `release_piece`.
                while !unsafe { destroy(ptr) } {}
                self.unfreed.fetch_sub(1, Ordering::Relaxed);
            }
        }

        /// Whether a guard in force may have dropped the hold on the oldest garbage, tagged
        /// `first`: read without the heavy barrier, up to `reads` times, [`SPINS`] apart.
        fn worth_a_barrier(&self, first: u64, reads: u32) -> bool {
            for read in 0..reads {
                if first <= self.oldest_active() {
                    return true;
                }
                if read + 1 < reads {
                    for _ in 0..SPINS {
                        sync::spin_loop();
                    }
                }
            }
            false
        }

        /// Makes every reader's epoch store before its light barrier visible to this thread,
        /// or this thread's earlier stores visible to every reader after its light barrier.
        /// False if that could not be ensured (then nothing may be freed).
        fn heavy_barrier(&self) -> bool {
            #[cfg(all(test, not(tollgate_loom)))]
            self.barriers.fetch_add(1, Ordering::Relaxed);
            if self.asymmetric() {
                membarrier::private_expedited()
            } else {
                sync::fence(Ordering::SeqCst);
                true
            }
        }
    }

    impl Drop for Domain {
        fn drop(&mut self) {
            for retired in std::mem::take(&mut sync::lock(&self.garbage).list) {
                // SAFETY: `&mut self`: no guard of this domain is left (guards borrow it).
                while !unsafe { (retired.destroy)(retired.ptr) } {}
            }
            self.release_parked();
            let mut at = self.head.load(Ordering::Relaxed);
            while !at.is_null() {
                // SAFETY: every record was made by `Box::into_raw` in `claim` and is freed only
                // here, once; no handle is left (handles borrow the domain).
                let record = unsafe { Box::from_raw(at) };
                at = record.next.cast_mut();
            }
        }
    }

    /// A thread's claim on a record (the tests' threads hold one each; the store's threads
    /// keep theirs in a thread-local). Gives the record back when dropped.
    #[cfg(test)]
    pub(crate) struct Handle<'d> {
        domain: &'d Domain,
        record: &'d Record,
    }

    #[cfg(test)]
    impl<'d> Handle<'d> {
        /// Takes a guard on this handle's record.
        pub(crate) fn pin(&self) -> Guard<'d> {
            Guard::enter(self.domain, self.record, false)
        }
    }

    #[cfg(test)]
    impl Drop for Handle<'_> {
        fn drop(&mut self) {
            self.record.claimed.store(false, Ordering::Release);
        }
    }

    /// While a guard lives, no table its thread loaded is freed. Not `Send`: it marks its
    /// thread's record.
    pub(crate) struct Guard<'d> {
        domain: &'d Domain,
        record: &'d Record,
        /// Whether this guard marked the record (the thread's outermost guard): it clears
        /// the mark when dropped.
        outer: bool,
        /// Whether the record was claimed for this guard alone (a check during the thread's
        /// teardown): given back when the guard drops.
        borrowed: bool,
        _not_send: PhantomData<*const ()>,
    }

    impl<'d> Guard<'d> {
        /// Marks `record` with the domain's epoch (unless an outer guard of this thread did),
        /// then passes the light barrier.
        #[inline(always)]
        fn enter(domain: &'d Domain, record: &'d Record, borrowed: bool) -> Self {
            let outer = record.state.load(Ordering::Relaxed) == QUIESCENT;
            if outer {
                let epoch = domain.epoch.load(Ordering::Acquire);
                record.state.store(epoch, Ordering::Release);
                if record.light {
                    sync::compiler_fence(Ordering::SeqCst);
                } else {
                    sync::fence(Ordering::SeqCst);
                }
            }
            Self {
                domain,
                record,
                outer,
                borrowed,
                _not_send: PhantomData,
            }
        }

        /// Hands `ptr`, already unlinked from everything a reader could load from now on, to
        /// the domain; `destroy(ptr)` runs once no guard can hold it, and again, one call per
        /// collect, until it returns true (see [`Destroy`]).
        ///
        /// # Safety
        /// `ptr` is unlinked and retired once; `destroy(ptr)` is sound to call, on any thread,
        /// at any later time (the object is `Send + 'static`), until it returns true, and not
        /// after.
        pub(crate) unsafe fn retire(&self, ptr: *mut (), destroy: Destroy) {
            self.domain.retire(ptr, destroy);
        }
    }

    impl Drop for Guard<'_> {
        #[inline(always)]
        fn drop(&mut self) {
            if self.outer {
                self.record.state.store(QUIESCENT, Ordering::Release);
            }
            if self.borrowed {
                self.record.claimed.store(false, Ordering::Release);
            }
        }
    }

    /// The domain of every store of the process.
    #[cfg(not(tollgate_loom))]
    static GLOBAL: Domain = Domain::with_barrier(true);

    /// The domain of every store of the process.
    #[cfg(not(tollgate_loom))]
    pub(crate) fn global() -> &'static Domain {
        &GLOBAL
    }

    /// The record this thread claimed in the global domain, given back when it exits.
    #[cfg(not(tollgate_loom))]
    struct Local {
        record: Cell<Option<&'static Record>>,
    }

    #[cfg(not(tollgate_loom))]
    impl Drop for Local {
        fn drop(&mut self) {
            if let Some(record) = self.record.get() {
                record.claimed.store(false, Ordering::Release);
            }
        }
    }

    #[cfg(not(tollgate_loom))]
    thread_local! {
        static LOCAL: Local = const {
            Local {
                record: Cell::new(None),
            }
        };
    }

    /// A guard of the global domain on this thread's record. The first guard of a thread
    /// claims its record; a guard taken during the thread's teardown claims one for itself.
    #[cfg(not(tollgate_loom))]
    #[inline(always)]
    pub(crate) fn pin() -> Guard<'static> {
        match LOCAL.try_with(|local| local.record.get()) {
            Ok(Some(record)) => Guard::enter(&GLOBAL, record, false),
            _ => pin_slow(),
        }
    }

    #[cfg(not(tollgate_loom))]
    #[cold]
    #[inline(never)]
    fn pin_slow() -> Guard<'static> {
        let domain = &GLOBAL;
        match LOCAL.try_with(|local| {
            let record = domain.claim();
            local.record.set(Some(record));
            record
        }) {
            Ok(record) => Guard::enter(domain, record, false),
            Err(_) => Guard::enter(domain, domain.claim(), true),
        }
    }

    #[cfg(tollgate_loom)]
    loom::lazy_static! {
        static ref GLOBAL: Domain = Domain::new();
    }

    /// The domain of every store of the process (under loom, the store compiles but only
    /// the models below run: they make domains of their own).
    #[cfg(tollgate_loom)]
    pub(crate) fn global() -> &'static Domain {
        &GLOBAL
    }

    /// A guard of the global domain on a record claimed for it alone (under loom, whose
    /// models register their threads explicitly).
    #[cfg(tollgate_loom)]
    pub(crate) fn pin() -> Guard<'static> {
        let domain = global();
        Guard::enter(domain, domain.claim(), true)
    }

    /// `membarrier(2)`, on Linux.
    #[cfg(all(target_os = "linux", not(tollgate_loom)))]
    mod membarrier {
        const CMD_QUERY: libc::c_long = 0;
        const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
        const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

        fn call(cmd: libc::c_long) -> libc::c_long {
            // SAFETY: `membarrier(cmd, flags = 0)` reads and writes no memory of ours; an
            // unknown command or a kernel without it returns -1 (EINVAL, ENOSYS), and a
            // seccomp filter that forbids it returns -1 (EPERM) or kills the process, as it
            // would for any system call it forbids.
            unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long) }
        }

        /// Registers the process for the private expedited command; false if the kernel
        /// lacks it or refuses.
        pub(super) fn register() -> bool {
            let supported = call(CMD_QUERY);
            supported >= 0
                && supported & CMD_PRIVATE_EXPEDITED != 0
                && supported & CMD_REGISTER_PRIVATE_EXPEDITED != 0
                && call(CMD_REGISTER_PRIVATE_EXPEDITED) == 0
        }

        /// A full memory barrier on every running thread of the process.
        pub(super) fn private_expedited() -> bool {
            call(CMD_PRIVATE_EXPEDITED) == 0
        }
    }

    /// No `membarrier` here: both barriers are fences.
    #[cfg(any(not(target_os = "linux"), tollgate_loom))]
    mod membarrier {
        #[cfg(not(tollgate_loom))]
        pub(super) fn register() -> bool {
            false
        }

        pub(super) fn private_expedited() -> bool {
            false
        }
    }

    /// An object the domain destroys in pieces, for the unit tests and the loom models:
    /// each piece writes `left` (so loom reports two pieces destroyed at once) and counts
    /// itself in `pieces`; the last frees the object.
    #[cfg(test)]
    pub(super) struct InPieces {
        left: sync::UnsafeCell<usize>,
        pieces: TestArc<AtomicUsize>,
    }

    #[cfg(test)]
    impl InPieces {
        /// Retires through `guard` an object of `left` pieces (at least 1), never linked
        /// anywhere, that counts its pieces in `pieces`.
        pub(super) fn retire(guard: &Guard<'_>, left: usize, pieces: &TestArc<AtomicUsize>) {
            let object = Box::new(Self {
                left: sync::UnsafeCell::new(left),
                pieces: TestArc::clone(pieces),
            });
            // SAFETY: never linked anywhere and retired once; `destroy` destroys an
            // `InPieces` made by `Box::into_raw`, and the object is `Send + 'static`.
            unsafe { guard.retire(Box::into_raw(object).cast(), Self::destroy) };
        }

        /// Destroys the next piece, and the object with its last.
        ///
        /// # Safety
        /// `ptr` is from `Box::into_raw` in [`retire`](Self::retire), and this is not called
        /// again once it returned true.
        unsafe fn destroy(ptr: *mut ()) -> bool {
            // SAFETY: the caller's contract: the object is alive.
            let object = unsafe { &*ptr.cast::<Self>() };
            object.pieces.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the domain destroys a piece on one thread at a time (loom checks it).
            let left = object.left.with_mut(|left| unsafe {
                *left -= 1;
                *left
            });
            if left > 0 {
                return false;
            }
            // SAFETY: the caller's contract; this was its last piece.
            drop(unsafe { Box::from_raw(ptr.cast::<Self>()) });
            true
        }
    }

    #[cfg(all(test, not(tollgate_loom)))]
    mod tests {
        use super::*;
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize as Counter;

        static DROPS: Counter = Counter::new(0);

        unsafe fn count_drop(ptr: *mut ()) -> bool {
            // SAFETY: made by `Box::into_raw` in `retire_one`.
            drop(unsafe { Box::from_raw(ptr.cast::<u64>()) });
            DROPS.fetch_add(1, Ordering::Relaxed);
            true
        }

        fn retire_one(guard: &Guard<'_>) {
            let ptr = Box::into_raw(Box::new(7u64)).cast::<()>();
            // SAFETY: never linked anywhere; `count_drop` frees a `Box<u64>`.
            unsafe { guard.retire(ptr, count_drop) };
        }

        /// A thread holding a guard (a check in flight), from [`hold_a_guard`].
        struct Held(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>);

        impl Held {
            /// Drops the guard and waits for its thread to end.
            fn release(self) {
                self.0.send(()).unwrap();
                self.1.join().unwrap();
            }
        }

        /// A thread that holds a guard of `domain` (a check in flight) until
        /// [`Held::release`]; returns once the guard is in force.
        fn hold_a_guard(domain: &'static Domain) -> Held {
            let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
            let (held_tx, held_rx) = std::sync::mpsc::channel();
            let holder = std::thread::spawn(move || {
                let record = domain.claim();
                let guard = Guard::enter(domain, record, false);
                held_tx.send(()).unwrap();
                hold_rx.recv().unwrap();
                drop(guard);
                record.claimed.store(false, Ordering::Release);
            });
            held_rx.recv().unwrap();
            Held(hold_tx, holder)
        }

        /// Retires one object while a guard on another thread is in force: no collect frees
        /// it until that guard drops, and then one does.
        fn retire_while_held(domain: &'static Domain, me: &Record) {
            let held = hold_a_guard(domain);
            retire_one(&Guard::enter(domain, me, false));
            assert_eq!(domain.collect(), 0);
            assert_eq!(domain.unfreed(), 1);
            held.release();
            assert_eq!(domain.collect(), 1);
        }

        /// A domain of its own (leaked: guards borrow it for `'static`).
        fn domain(membarrier: bool) -> &'static Domain {
            Box::leak(Box::new(Domain::with_barrier(membarrier)))
        }

        /// Retires `count` objects of `pieces` pieces each, counting their pieces in the
        /// returned counter (which they hold: one strong count each until destroyed).
        fn retire_in_pieces(
            domain: &Domain,
            me: &Record,
            count: usize,
            pieces: usize,
        ) -> Arc<Counter> {
            let counter = Arc::new(Counter::new(0));
            let guard = Guard::enter(domain, me, false);
            for _ in 0..count {
                InPieces::retire(&guard, pieces, &counter);
            }
            counter
        }

        /// `decide_barrier` (a store's construction) makes the decision that the first claim
        /// of a record would otherwise make (registering for `membarrier`: a wait for an
        /// RCU grace period in a process of several threads), and a claim then keeps it.
        #[test]
        fn the_barrier_is_decided_before_the_first_guard() {
            for allowed in [false, true] {
                let domain = domain(allowed);
                assert!(domain.membarrier.1.get().is_none());
                domain.decide_barrier();
                let decided = *domain.membarrier.1.get().expect("decided");
                assert!(allowed || !decided);
                let record = domain.claim();
                assert_eq!(record.light, decided);
                drop(Guard::enter(domain, record, false));
                assert_eq!(domain.membarrier.1.get(), Some(&decided));
                record.claimed.store(false, Ordering::Release);
            }
        }

        /// An object destroyed in pieces takes one piece per collect, stays counted as
        /// unfreed (so that collects keep coming) until its last, and is destroyed once.
        #[test]
        fn an_object_destroyed_in_pieces_takes_one_piece_per_collect() {
            let domain = domain(true);
            let me = domain.claim();
            let pieces = retire_in_pieces(domain, me, 1, 3);
            for done in 1..3 {
                assert_eq!(domain.collect(), 0, "piece {done}");
                assert_eq!(pieces.load(Ordering::Relaxed), done);
                assert_eq!(domain.unfreed(), 1);
            }
            assert_eq!(domain.collect(), 1);
            assert_eq!(pieces.load(Ordering::Relaxed), 3);
            assert_eq!(domain.unfreed(), 0);
            assert_eq!(Arc::strong_count(&pieces), 1, "destroyed");
            // Nothing left: a collect calls no destructor.
            assert_eq!(domain.collect_once(), 0);
            assert_eq!(pieces.load(Ordering::Relaxed), 3);
        }

        /// With nothing parked, `release_parked` (which every operator's drive calls) returns
        /// without taking the parking's mutex: here held by this thread, the call on another
        /// returns at once.
        #[test]
        fn release_parked_with_nothing_parked_takes_no_lock() {
            let domain = domain(false);
            let held = sync::lock(&domain.parked);
            let (returned_tx, returned) = std::sync::mpsc::channel();
            let caller = std::thread::spawn(move || {
                domain.release_parked();
                returned_tx.send(()).unwrap();
            });
            let returned = returned.recv_timeout(std::time::Duration::from_secs(5));
            drop(held);
            caller.join().unwrap();
            assert!(
                returned.is_ok(),
                "release_parked waited for the parking's mutex with nothing parked"
            );
        }

        /// Where the parking is full, the object beyond it is destroyed whole by the collect
        /// that finds it; an operator's `release_parked` destroys the parked ones to their
        /// end. Every object's pieces are all destroyed, each once.
        #[test]
        fn a_full_parking_destroys_the_rest_whole_and_release_parked_ends_them_all() {
            let domain = domain(true);
            let me = domain.claim();
            let pieces = retire_in_pieces(domain, me, PARKED + 1, 3);
            // One first piece each, and the whole of the one that found no room.
            assert_eq!(domain.collect(), 1);
            assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 3);
            assert_eq!(domain.unfreed(), PARKED);
            // A check's collect takes no piece; a writer's takes one (of one parked object).
            assert_eq!(domain.collect_once(), 0);
            assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 3);
            assert_eq!(domain.collect(), 0);
            assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 4);
            domain.release_parked();
            assert_eq!(domain.unfreed(), 0);
            assert_eq!(pieces.load(Ordering::Relaxed), 3 * (PARKED + 1));
            assert_eq!(Arc::strong_count(&pieces), 1, "all destroyed");
        }

        #[test]
        fn garbage_waits_for_guards_in_force_and_not_for_idle_threads() {
            for asymmetric in [false, true] {
                let domain = domain(asymmetric);
                // A thread that took a guard once and now blocks: it holds nothing back.
                let (idle_tx, idle_rx) = std::sync::mpsc::channel::<()>();
                let (ready_tx, ready_rx) = std::sync::mpsc::channel();
                let idle = std::thread::spawn(move || {
                    let record = domain.claim();
                    drop(Guard::enter(domain, record, false));
                    ready_tx.send(()).unwrap();
                    idle_rx.recv().unwrap();
                    record.claimed.store(false, Ordering::Release);
                });
                ready_rx.recv().unwrap();
                let me = domain.claim();
                let before = DROPS.load(Ordering::Relaxed);
                {
                    let guard = Guard::enter(domain, me, false);
                    retire_one(&guard);
                    // Held back by this thread's own guard.
                    assert_eq!(domain.collect(), 0);
                    assert_eq!(domain.unfreed(), 1);
                }
                assert_eq!(domain.collect(), 1);
                assert_eq!(domain.unfreed(), 0);
                assert!(DROPS.load(Ordering::Relaxed) > before);

                // A guard in force on another thread holds back what is retired meanwhile,
                // and only until it drops.
                retire_while_held(domain, me);
                idle_tx.send(()).unwrap();
                idle.join().unwrap();
            }
        }

        /// While a guard in force on another thread holds the garbage (a check preempted
        /// in flight), collects pass no heavy barrier, however many run; once it drops, one
        /// `collect_once` (a single read of the records) frees the garbage.
        #[test]
        fn collects_pass_no_barrier_while_a_guard_holds_the_garbage() {
            for asymmetric in [false, true] {
                let domain = domain(asymmetric);
                let me = domain.claim();
                let held = hold_a_guard(domain);
                retire_one(&Guard::enter(domain, me, false));
                let before = domain.barriers.load(Ordering::Relaxed);
                for _ in 0..100 {
                    assert_eq!(domain.collect_once(), 0);
                }
                assert_eq!(domain.collect(), 0);
                assert_eq!(domain.unfreed(), 1);
                assert_eq!(
                    domain.barriers.load(Ordering::Relaxed),
                    before,
                    "a collect passed the heavy barrier while a guard held the garbage"
                );
                held.release();
                assert_eq!(domain.collect_once(), 1);
                assert_eq!(domain.unfreed(), 0);
                assert_eq!(domain.barriers.load(Ordering::Relaxed), before + 1);
                // With nothing retired, no barrier either.
                assert_eq!(domain.collect_once(), 0);
                assert_eq!(domain.barriers.load(Ordering::Relaxed), before + 1);
                me.claimed.store(false, Ordering::Release);
            }
        }

        /// The garbage list's buffer, as an address (0 while it has none).
        fn buffer(domain: &Domain) -> usize {
            let garbage = sync::lock(&domain.garbage);
            if garbage.list.capacity() == 0 {
                0
            } else {
                garbage.list.as_ptr() as usize
            }
        }

        /// Once the garbage list has grown, retiring and collecting reuse its buffer: no
        /// collect allocates, whether it frees everything, nothing (a guard in force holds
        /// the garbage) or a part. The same buffer, by address, over hundreds of rounds.
        #[test]
        fn retires_and_collects_reuse_the_garbage_list() {
            let domain = domain(true);
            let me = domain.claim();
            // Grown once: room for the 8 objects the rounds keep pending.
            let held = hold_a_guard(domain);
            for _ in 0..8 {
                retire_one(&Guard::enter(domain, me, false));
            }
            assert_eq!(domain.collect(), 0);
            held.release();
            assert_eq!(domain.collect(), 8);
            let grown = buffer(domain);
            assert_ne!(grown, 0);
            let before = DROPS.load(Ordering::Relaxed);
            for round in 0..300 {
                match round % 3 {
                    // Freed at once.
                    0 => {
                        retire_one(&Guard::enter(domain, me, false));
                        assert_eq!(domain.collect_once(), 1);
                    }
                    // Held back, then freed.
                    1 => retire_while_held(domain, me),
                    // A part freed: what was retired before a guard was taken goes, what
                    // came after stays until it drops.
                    _ => {
                        retire_one(&Guard::enter(domain, me, false));
                        let held = hold_a_guard(domain);
                        retire_one(&Guard::enter(domain, me, false));
                        assert_eq!(domain.collect(), 1);
                        assert_eq!(domain.unfreed(), 1);
                        held.release();
                        assert_eq!(domain.collect(), 1);
                    }
                }
                assert_eq!(
                    buffer(domain),
                    grown,
                    "round {round}: the list's buffer changed (an allocation)"
                );
            }
            assert_eq!(domain.unfreed(), 0);
            assert!(DROPS.load(Ordering::Relaxed) >= before + 400);
            me.claimed.store(false, Ordering::Release);
        }

        thread_local! {
            /// Where [`retire_two_on_drop`] retires: a domain and this thread's record in it.
            static NESTED: Cell<Option<(&'static Domain, &'static Record)>> =
                const { Cell::new(None) };
            /// The garbage list's buffer right after [`retire_two_on_drop`] retired.
            static AFTER: Cell<usize> = const { Cell::new(0) };
        }

        /// A destructor that retires two more objects (what a retire on another thread
        /// does while a collect runs), then notes the list's buffer.
        unsafe fn retire_two_on_drop(ptr: *mut ()) -> bool {
            // SAFETY: as for `count_drop`: made by `Box::into_raw` in the test.
            unsafe { count_drop(ptr) };
            let (domain, me) = NESTED.get().expect("set by the test");
            let guard = Guard::enter(domain, me, false);
            retire_one(&guard);
            retire_one(&guard);
            drop(guard);
            AFTER.set(buffer(domain));
            true
        }

        /// A retire while a collect runs never makes the collect allocate: after the collect
        /// the list's buffer is the one the retire left. One object is free to go, and its
        /// destructor retires two more; seven others are held by a guard in force, so the
        /// collect keeps them. Collects that took the list out put those seven back onto
        /// the list the retire had just started (4 slots), and that outgrew it: a new buffer,
        /// allocated by the collect, on a check's path too (`collect_once`).
        #[test]
        fn a_retire_while_a_collect_runs_leaves_the_collect_nothing_to_allocate() {
            for collect in [Domain::collect_once, Domain::collect] {
                let domain = domain(true);
                let me = domain.claim();
                NESTED.set(Some((domain, me)));
                let first = Box::into_raw(Box::new(7u64)).cast::<()>();
                // SAFETY: never linked anywhere; `retire_two_on_drop` frees a `Box<u64>`.
                unsafe { Guard::enter(domain, me, false).retire(first, retire_two_on_drop) };
                let held = hold_a_guard(domain);
                for _ in 0..7 {
                    retire_one(&Guard::enter(domain, me, false));
                }
                assert_eq!(collect(domain), 1);
                assert_eq!(domain.unfreed(), 9);
                assert_eq!(
                    buffer(domain),
                    AFTER.get(),
                    "the collect put a list back and allocated"
                );
                held.release();
                assert_eq!(domain.collect(), 9);
                assert_eq!(domain.unfreed(), 0);
                NESTED.set(None);
                me.claimed.store(false, Ordering::Release);
            }
        }

        #[test]
        fn nested_guards_keep_the_outer_mark_and_records_are_reused() {
            let domain = domain(true);
            let record = domain.claim();
            let outer = Guard::enter(domain, record, false);
            let mark = record.state.load(Ordering::Relaxed);
            assert_ne!(mark, QUIESCENT);
            {
                let inner = Guard::enter(domain, record, false);
                retire_one(&inner);
            }
            // The inner guard did not clear the outer one's mark.
            assert_eq!(record.state.load(Ordering::Relaxed), mark);
            assert_eq!(domain.collect(), 0);
            drop(outer);
            assert_eq!(record.state.load(Ordering::Relaxed), QUIESCENT);
            assert_eq!(domain.collect(), 1);
            // A record given back is claimed again rather than a new one made.
            record.claimed.store(false, Ordering::Release);
            assert!(ptr::eq(domain.claim(), record));
            assert_eq!(records(domain), 1);
        }

        fn records(domain: &Domain) -> usize {
            let mut count = 0;
            let mut at = domain.head.load(Ordering::Acquire).cast_const();
            while !at.is_null() {
                count += 1;
                // SAFETY: as in `Domain::claim`.
                at = unsafe { (*at).next };
            }
            count
        }

        #[test]
        fn threads_give_their_records_back_when_they_exit() {
            let before = records(global());
            for _ in 0..200 {
                std::thread::spawn(|| drop(pin())).join().unwrap();
            }
            // Other tests' threads may claim records meanwhile, but far fewer than 200.
            let grown = records(global()) - before;
            assert!(
                grown < 100,
                "{grown} records for 200 threads run one after another"
            );
        }
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::reclaim::Domain;
    use super::*;
    use std::collections::HashMap;

    fn h(key: &u64) -> u64 {
        ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(key)
    }

    /// A migration done in one go, as the store's operator paths end theirs.
    fn migrate<K: Send + Sync + 'static, M: Carry<K> + Send + Sync + 'static>(
        writer: &mut Writer<'_, K, M, ()>,
        guard: &Guard<'_>,
        capacity: usize,
        live: usize,
        meta: M,
        rehash: impl Fn(&K) -> u64,
    ) {
        writer.begin_migration(guard, capacity, live, meta, &rehash, 0);
        assert!(writer.step(guard, usize::MAX, &rehash, 0));
    }

    /// Inserts, updates and removals against a `HashMap`, with migrations that move a
    /// few slots per operation (lookups read through them), as the store runs them.
    #[test]
    fn matches_a_hashmap_through_inserts_removals_and_incremental_migrations() {
        let table: EpochTable<u64, (), ()> = EpochTable::new(2, (), ());
        let guard = reclaim::pin();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut migrations = 0;
        for step in 0..100_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 3_000;
            let mut writer = table.write();
            writer.step(&guard, 3, h, 0);
            let found = match writer.table(&guard).locate(h(&key), |k| *k == key) {
                Located::Found { slot, raw, .. } => Some((slot, Word::from_raw::<AtomicU64>(raw))),
                Located::Absent { .. } => None,
                Located::Moving => panic!("a key half moved under the writer"),
            };
            if x % 3 < 2 {
                match found {
                    Some((slot, Word::Live(state))) => {
                        slot.update(state, step).unwrap();
                        model.insert(key, step);
                    }
                    Some((_, word)) => panic!("{word:?} under the writer"),
                    None => {
                        if let Err(key) = writer.insert(&guard, h(&key), key, step) {
                            let live = model.len();
                            writer.begin_migration(&guard, live * 2, live, (), h, 0);
                            migrations += 1;
                            assert!(writer.insert(&guard, h(&key), key, step).is_ok());
                        }
                        model.insert(key, step);
                    }
                }
            } else {
                let removed = found.and_then(|(slot, _)| writer.remove(slot));
                assert_eq!(removed, model.remove(&key), "step {step}");
            }
            drop(writer);
            if step % 1_000 == 0 {
                let current = table.read(&guard);
                for (k, v) in &model {
                    match current.locate(h(k), |x| x == k) {
                        Located::Found { raw, .. } => assert_eq!(raw, *v),
                        _ => panic!("step {step}: key {k} lost"),
                    }
                }
            }
        }
        assert!(migrations > 10, "{migrations} migrations");
    }

    /// A table with no empty slot left (which the load limit and the migrations' sizing
    /// rule out) fails `place` with a panic that says so, where it probed forever with
    /// the writer mutex held; the keys already placed stay readable.
    #[test]
    fn placing_into_a_full_table_panics_instead_of_probing_forever() {
        let table: EpochTable<String, (), ()> = EpochTable::new(2, (), ());
        let guard = reclaim::pin();
        let writer = table.write();
        let target = writer.target(&guard);
        let capacity = target.capacity() as u64;
        for i in 0..capacity {
            // SAFETY: this writer holds the mutex and `target` is the insert target.
            unsafe { target.place(i, i.to_string(), i) };
        }
        let full = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: as above.
            unsafe { target.place(99, "one too many".into(), 0) };
        }));
        let message = full.expect_err("a key placed in a full table");
        let message = message
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(message.contains("no empty slot"), "{message}");
        for i in 0..capacity {
            let found = target.find(i, |k| *k == i.to_string());
            assert_eq!(found.map(|(_, word)| word), Some(Word::Live(i)));
        }
        drop(writer);
    }

    #[test]
    fn states_are_clamped_below_the_reserved_words() {
        let table: EpochTable<u64, (), ()> = EpochTable::new(8, (), ());
        let guard = reclaim::pin();
        let slot = table.write().insert(&guard, 7, 7, u64::MAX).ok().unwrap();
        assert_eq!(slot.load(), Word::Live(STATE_MAX));
        slot.update(STATE_MAX, u64::MAX - 1).unwrap();
        assert_eq!(slot.load(), Word::Live(STATE_MAX));
    }

    #[test]
    fn a_prefetch_takes_any_hash_and_changes_nothing() {
        let guard = reclaim::pin();
        for capacity in [1, 8, 1000] {
            let numbers: EpochTable<u64, (), ()> = EpochTable::new(capacity, (), ());
            let words: EpochTable<String, (), ()> = EpochTable::new(capacity, (), ());
            numbers.write().insert(&guard, h(&7), 7, 70).ok().unwrap();
            words
                .write()
                .insert(&guard, 9, "seven".into(), 80)
                .ok()
                .unwrap();
            for hash in [0, 1, h(&7), 9, u64::MAX / 2, u64::MAX] {
                numbers.read(&guard).prefetch(hash);
                words.read(&guard).prefetch(hash);
            }
            let number = numbers.read(&guard).find(h(&7), |k| *k == 7);
            assert_eq!(number.map(|(_, word)| word), Some(Word::Live(70)));
            let word = words.read(&guard).find(9, |k| k == "seven");
            assert_eq!(word.map(|(_, word)| word), Some(Word::Live(80)));
        }
    }

    #[test]
    fn keys_are_dropped_once_whether_moved_removed_or_kept() {
        // A private domain: what it retired is destroyed by its collects, whatever the
        // other tests' threads (on the global one) are doing.
        let counter = Arc::new(());
        let domain = Domain::new();
        let handle = domain.register();
        {
            let table: EpochTable<Arc<()>, (), ()> = EpochTable::new(4, (), ());
            let guard = handle.pin();
            let mut writer = table.write();
            for i in 0..3u64 {
                writer
                    .insert(&guard, i * 0x1234_5678, Arc::clone(&counter), 0)
                    .ok()
                    .unwrap();
            }
            assert_eq!(Arc::strong_count(&counter), 4);
            let slot = writer.table(&guard).find(0, |_| true).unwrap().0;
            writer.remove(slot);
            migrate(&mut writer, &guard, 16, 2, (), |k| Arc::as_ptr(k) as u64);
            // Two keys moved to the new table, one left behind, removed, in the retired
            // one: nothing dropped yet, and the guard in force holds the retired table.
            assert_eq!(Arc::strong_count(&counter), 4);
            drop(writer);
            assert_eq!(domain.collect(), 0);
            assert_eq!(table.retired_unfreed(), 1);
            drop(guard);
            // No guard in force: the retired table goes, with the removed key.
            assert_eq!(domain.collect(), 1);
            assert_eq!(table.retired_unfreed(), 0);
            assert_eq!(Arc::strong_count(&counter), 3);
        }
        // The current table dropped its two keys.
        assert_eq!(Arc::strong_count(&counter), 1);
        drop(handle);
    }

    /// A retired table of more than two pieces is destroyed a piece per collect, each
    /// key it still owns (removed ones; moved ones belong to the next table) dropped
    /// once, in the piece that holds it; `release_parked` (an operator's path) ends the
    /// rest at once.
    #[test]
    fn a_large_retired_table_is_destroyed_a_piece_per_collect() {
        type Key = (u64, Arc<()>);
        let per_piece = RELEASE_PIECE / std::mem::size_of::<Slot<Key>>();
        let (capacity, keys, removed) = (5 * per_piece / 2, 2 * per_piece, 600u64);
        let counter = Arc::new(());
        let domain = Domain::new();
        let handle = domain.register();
        let hash = |key: &Key| h(&key.0);
        for operator in [false, true] {
            let table: EpochTable<Key, (), ()> = EpochTable::new(capacity, (), ());
            let guard = handle.pin();
            let mut writer = table.write();
            for i in 0..keys as u64 {
                let key = (i, Arc::clone(&counter));
                assert!(writer.insert(&guard, hash(&key), key, 0).is_ok());
            }
            for i in 0..removed {
                let slot = writer.table(&guard).find(h(&i), |k| k.0 == i).unwrap().0;
                writer.remove(slot);
            }
            migrate(&mut writer, &guard, 2 * capacity, keys, (), hash);
            drop(writer);
            drop(guard);
            let owned = |c: &Arc<()>| Arc::strong_count(c) - 1;
            assert_eq!(owned(&counter), keys);
            // The first piece goes at the first collect, the table stays counted.
            assert_eq!(domain.collect(), 0);
            assert_eq!(table.retired_unfreed(), 1);
            assert_eq!(domain.unfreed(), 1);
            if operator {
                domain.release_parked();
            } else {
                let mut collects = 1;
                let mut last = owned(&counter);
                while domain.collect() == 0 {
                    collects += 1;
                    assert!(owned(&counter) <= last, "a piece drops keys, never adds");
                    last = owned(&counter);
                    assert!(collects <= 3, "more collects than pieces");
                }
                assert_eq!(collects + 1, 3, "one collect per piece");
            }
            assert_eq!(table.retired_unfreed(), 0);
            assert_eq!(domain.unfreed(), 0);
            assert_eq!(
                owned(&counter),
                keys - removed as usize,
                "removed keys dropped once"
            );
            drop(table);
            assert_eq!(owned(&counter), 0);
        }
        drop(handle);
    }

    /// Slots prepared ahead of a migration become its table, written a batch at a time
    /// and counted nowhere until then; prepared slots of another size are dropped. With
    /// `String` keys, so that the tags are prepared too (a tag left unwritten would hide
    /// keys from lookups).
    #[test]
    fn prepared_slots_become_the_next_migrations_table() {
        let key = |i: u64| format!("key-{i}");
        let hash = |k: &String| ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(k);
        let table: EpochTable<String, (), ()> = EpochTable::new(64, (), ());
        let guard = reclaim::pin();
        let mut writer = table.write();
        for i in 0..40 {
            writer
                .insert(&guard, hash(&key(i)), key(i), i)
                .ok()
                .unwrap();
        }
        // 32-byte slots (a word and a `String`), 128 a page: 2,048 slots are 16 pages,
        // 2 a call.
        let batches = (1..=20)
            .find(|_| writer.prepare(&guard, 2048, 40, 2))
            .unwrap();
        assert_eq!(batches, 8);
        assert!(writer.has_spare());
        assert_eq!(table.retired_unfreed(), 0, "a spare is not a retired table");
        let prepared = writer.state.spare.as_ref().unwrap().slots.values.as_ptr();
        assert_eq!(writer.begin_migration(&guard, 2048, 40, (), hash, 0), 2048);
        assert!(!writer.has_spare());
        assert_eq!(
            writer.target(&guard).slots.as_ptr().cast(),
            prepared,
            "the migration made a table of its own"
        );
        for i in 40..60 {
            writer
                .insert(&guard, hash(&key(i)), key(i), i)
                .ok()
                .unwrap();
        }
        assert!(writer.step(&guard, usize::MAX, hash, 0));
        for i in 0..60 {
            let found = writer.table(&guard).find(hash(&key(i)), |k| *k == key(i));
            assert_eq!(found.map(|(_, w)| w), Some(Word::Live(i)), "key {i}");
        }
        // Half prepared, then a migration of another size: dropped, a table made.
        assert!(!writer.prepare(&guard, 8192, 60, 1));
        assert_eq!(writer.begin_migration(&guard, 1024, 60, (), hash, 0), 1024);
        assert!(!writer.has_spare());
        assert!(writer.step(&guard, usize::MAX, hash, 0));
        assert_eq!(writer.table(&guard).capacity(), 1024);
        for i in 0..60 {
            assert!(
                writer
                    .table(&guard)
                    .find(hash(&key(i)), |k| *k == key(i))
                    .is_some()
            );
        }
    }
}

/// Loom models of the publish, freeze, migrate and reclaim protocol. Run with
/// `RUSTFLAGS="--cfg tollgate_loom" cargo test --release --lib loom_` (the test script
/// does). Each model has a domain of its own, whose barriers are `SeqCst` fences (loom
/// models those; it cannot model `membarrier`, which stands in for the readers' fence).
/// A table carries a canary cell under loom that every probe reads and its destruction
/// writes, so a table freed while a reader can still probe it is a race loom reports.
#[cfg(all(test, tollgate_loom))]
mod loom_models {
    use super::reclaim::{Domain, InPieces};
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    type Shard = EpochTable<u64, u64, ()>;

    /// Runs `f` under loom with every interleaving of up to `LOOM_MAX_PREEMPTIONS` (default 2)
    /// preemptions per thread, as loom recommends for models of this size.
    fn model(f: impl Fn() + Sync + Send + 'static) {
        check_with(|set| set.unwrap_or(2), f);
    }

    /// [`model`] with at most `preemptions` per thread whatever `LOOM_MAX_PREEMPTIONS`
    /// says: for a model of three threads, whose interleavings grow much faster.
    fn model_within(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
        check_with(|set| set.map_or(preemptions, |set| set.min(preemptions)), f);
    }

    /// Runs `f` under loom with the preemption bound `bound` makes of the one
    /// `LOOM_MAX_PREEMPTIONS` sets, if any.
    fn check_with(
        bound: impl FnOnce(Option<usize>) -> usize,
        f: impl Fn() + Sync + Send + 'static,
    ) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(bound(builder.preemption_bound));
        builder.check(f);
    }

    /// A shard, and the domain its tables are retired to.
    fn setup() -> (Arc<Shard>, Arc<Domain>) {
        (Arc::new(EpochTable::new(4, 0, ())), Arc::new(Domain::new()))
    }

    /// Runs `f` on a new loom thread, with the shard and the domain.
    fn spawn<T: Send + 'static>(
        shard: &Arc<Shard>,
        domain: &Arc<Domain>,
        f: impl FnOnce(&Shard, &Domain) -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        let (shard, domain) = (Arc::clone(shard), Arc::clone(domain));
        thread::spawn(move || f(&shard, &domain))
    }

    /// A check as the store runs it: locate the key (reading through a migration), add
    /// `by` to its state by CAS, looking again if it froze meanwhile and waiting for the
    /// writer if it is in the middle of its move; `false` if the key is absent or was
    /// removed.
    fn add(shard: &Shard, domain: &Domain, key: u64, by: u64) -> bool {
        change(shard, domain, key, |state| state + by)
    }

    /// [`add`], of any change to a word of any width.
    fn change<A: Atom>(
        shard: &EpochTable<u64, u64, (), A>,
        domain: &Domain,
        key: u64,
        by: impl Fn(A::Value) -> A::Value,
    ) -> bool {
        let handle = domain.register();
        loop {
            let guard = handle.pin();
            let (slot, mut word) = match shard.read(&guard).locate(key, |k| *k == key) {
                Located::Found { slot, raw, .. } => (slot, Word::from_raw::<A>(raw)),
                Located::Absent { .. } => return false,
                Located::Moving => {
                    drop(guard);
                    shard.wait_for_writer();
                    continue;
                }
            };
            loop {
                match word {
                    Word::Live(state) => match slot.update(state, by(state)) {
                        Ok(()) => return true,
                        Err(actual) => word = Word::from_raw::<A>(actual),
                    },
                    Word::Removed => return false,
                    Word::Frozen => break,
                }
            }
        }
    }

    fn state_of<A: Atom>(
        shard: &EpochTable<u64, u64, (), A>,
        domain: &Domain,
        key: u64,
    ) -> Option<A::Value> {
        let handle = domain.register();
        let guard = handle.pin();
        match shard.read(&guard).locate(key, |k| *k == key) {
            Located::Found { raw, .. } => Some(raw),
            Located::Absent { .. } => None,
            Located::Moving => panic!("a key half moved after every thread joined"),
        }
    }

    fn insert(shard: &Shard, domain: &Domain, key: u64) {
        insert_with(shard, domain, key, 0);
    }

    fn insert_with<A: Atom>(
        shard: &EpochTable<u64, u64, (), A>,
        domain: &Domain,
        key: u64,
        state: A::Value,
    ) {
        let handle = domain.register();
        let guard = handle.pin();
        shard.write().insert(&guard, key, key, state).ok().unwrap();
    }

    /// A whole migration, as an operator's path runs it: begun, then moved a slot at a
    /// time, each under its own hold of the writer mutex and its own guard, with a
    /// collect after the last.
    fn migrate<A: Atom>(
        shard: &EpochTable<u64, u64, (), A>,
        domain: &Domain,
        capacity: usize,
        meta: u64,
    ) where
        u64: Carry<u64, A::Value>,
    {
        let handle = domain.register();
        {
            let guard = handle.pin();
            let live = 1;
            shard
                .write()
                .begin_migration(&guard, capacity, live, meta, |k| *k, 0);
        }
        loop {
            let guard = handle.pin();
            if shard.write().step(&guard, 1, |k| *k, 0) {
                break;
            }
        }
        domain.collect();
    }

    /// A check races a migration (and a check after it): no admission is lost, and
    /// each lands exactly once.
    #[test]
    fn loom_checks_racing_a_migration_lose_no_update() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 1);
            let check = spawn(&shard, &domain, |shard, domain| {
                assert!(add(shard, domain, 1, 10));
                // A check's own collect (it retired nothing), racing the writer's.
                domain.collect_once();
            });
            migrate(&shard, &domain, 8, 1);
            assert!(add(&shard, &domain, 1, 1));
            check.join().unwrap();
            assert_eq!(state_of(&shard, &domain, 1), Some(11));
            let handle = domain.register();
            assert_eq!(shard.read(&handle.pin()).meta, 1);
        });
    }

    /// A check of a key held to two quotas (both states in one 16-byte word) races a
    /// migration and another check: both halves of each check land together and once,
    /// and the migration freezes and moves them together.
    #[test]
    fn loom_a_pair_check_racing_a_migration_lands_both_halves_once() {
        model(|| {
            let shard: Arc<EpochTable<u64, u64, (), AtomicPair>> =
                Arc::new(EpochTable::new(4, 0, ()));
            let domain = Arc::new(Domain::new());
            insert_with(&shard, &domain, 1, [0, 0]);
            let check = {
                let (shard, domain) = (Arc::clone(&shard), Arc::clone(&domain));
                thread::spawn(move || {
                    assert!(change(&shard, &domain, 1, |[a, b]| [a + 10, b + 20]));
                })
            };
            migrate(&shard, &domain, 8, 1);
            assert!(change(&shard, &domain, 1, |[a, b]| [a + 1, b + 2]));
            check.join().unwrap();
            assert_eq!(state_of(&shard, &domain, 1), Some([11, 22]));
        });
    }

    /// A check races a migration moving one slot at a time, during which a key is
    /// inserted (into the new table) and checked (read through the old one): the check
    /// lands once, in whichever table holds the key then, and nothing is lost.
    #[test]
    fn loom_a_check_racing_an_incremental_migration_lands_once() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 1);
            let check = spawn(&shard, &domain, |shard, domain| {
                assert!(add(shard, domain, 1, 10));
            });
            let handle = domain.register();
            {
                let guard = handle.pin();
                let mut writer = shard.write();
                writer.begin_migration(&guard, 8, 1, 1, |k| *k, 0);
                writer.insert(&guard, 2, 2, 5).ok().unwrap();
            }
            assert!(add(&shard, &domain, 2, 1));
            loop {
                let guard = handle.pin();
                if shard.write().step(&guard, 1, |k| *k, 0) {
                    break;
                }
            }
            drop(handle);
            domain.collect();
            check.join().unwrap();
            assert_eq!(state_of(&shard, &domain, 1), Some(10));
            assert_eq!(state_of(&shard, &domain, 2), Some(6));
        });
    }

    /// A reader probing while the writer inserts the key finds it complete or not at
    /// all, never half-written (loom checks the key bytes' accesses).
    #[test]
    fn loom_an_insert_is_published_whole() {
        model(|| {
            let (shard, domain) = setup();
            let reader = spawn(&shard, &domain, |shard, domain| {
                let handle = domain.register();
                let guard = handle.pin();
                let table = shard.read(&guard);
                if let Some((slot, word)) = table.find(5, |k| *k == 5) {
                    assert_eq!(word, Word::Live(0));
                    assert_eq!(slot.with_key(|k| *k), Some(5));
                }
            });
            insert(&shard, &domain, 5);
            reader.join().unwrap();
            assert_eq!(state_of(&shard, &domain, 5), Some(0));
        });
    }

    /// A check racing a removal either lands before it or sees the key removed.
    #[test]
    fn loom_a_check_racing_a_removal_sees_it() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 2);
            let check = spawn(&shard, &domain, |shard, domain| add(shard, domain, 2, 1));
            let handle = domain.register();
            let guard = handle.pin();
            let before = {
                let mut writer = shard.write();
                let Located::Found { slot, .. } = writer.table(&guard).locate(2, |k| *k == 2)
                else {
                    panic!("the key is there")
                };
                writer.remove(slot).unwrap()
            };
            drop(guard);
            let admitted = check.join().unwrap();
            // Admitted before the removal, or found it removed: never both, never neither.
            assert_eq!(admitted, before == 1);
            assert_eq!(state_of(&shard, &domain, 2), None);
        });
    }

    /// A reader's borrow of the current table: under a guard, finds `key` and reads it
    /// in its slot, then drops the guard and gives its record back.
    fn read_through_a_guard(shard: &Shard, domain: &Domain, key: u64) {
        let handle = domain.register();
        let guard = handle.pin();
        let table = shard.read(&guard);
        let (slot, _) = table.find(key, |k| *k == key).unwrap();
        assert_eq!(slot.with_key(|k| *k), Some(key));
    }

    /// Two migrations, each followed by a collect, while a reader holds the first table:
    /// the reader's borrowed table and keys stay valid until its guard drops (the
    /// canary and the key cells tell loom of any table freed early), and its check lands
    /// in the newest table.
    #[test]
    fn loom_a_reader_outlives_two_migrations() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 3);
            let reader = spawn(&shard, &domain, |shard, domain| {
                read_through_a_guard(shard, domain, 3);
                assert!(add(shard, domain, 3, 4));
            });
            migrate(&shard, &domain, 4, 1);
            migrate(&shard, &domain, 16, 2);
            reader.join().unwrap();
            assert_eq!(state_of(&shard, &domain, 3), Some(4));
            // Every reader is done: the last collect frees both retired tables.
            domain.collect();
            assert_eq!(shard.retired_unfreed(), 0);
        });
    }

    /// A reader holds a table that a migration retires while checks' collects
    /// (`collect_once`, which frees in place) run on both threads, beside the writer's
    /// own: none frees the table while the reader's guard is in force (the canary and
    /// the key cells tell loom), and once the reader is done a check's collect frees it.
    #[test]
    fn loom_a_checks_collect_frees_only_what_no_reader_holds() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 3);
            let reader = spawn(&shard, &domain, |shard, domain| {
                read_through_a_guard(shard, domain, 3);
                domain.collect_once();
            });
            migrate(&shard, &domain, 8, 1);
            domain.collect_once();
            reader.join().unwrap();
            domain.collect_once();
            assert_eq!(shard.retired_unfreed(), 0);
        });
    }

    /// Frees the `Box<u64>` that [`loom_a_collect_frees_nothing_retired_after_it_read_the_list`]
    /// retires.
    ///
    /// # Safety
    /// `ptr` is from `Box::into_raw` of a `Box<u64>`, freed once.
    unsafe fn free_a_u64(ptr: *mut ()) -> bool {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(ptr.cast::<u64>()) });
        true
    }

    /// A collect frees only what was retired before it read the garbage list, whatever
    /// its later read of the records says: a check's collect reads the list (pending
    /// garbage), passes the barrier and reads the records while a reader has not yet
    /// taken its guard; the reader then borrows the table, which a migration unlinks and
    /// retires. The records the collect read said no guard was in force, but the table
    /// retired after its read of the list is held, and stays until a later collect (the
    /// canary and the key cells tell loom of a table freed early). This is the collect's
    /// cap at the newest tag it read: without it (`free_up_to(oldest_active, last)`)
    /// this model fails and every other passes. Three threads, so at most 2 preemptions
    /// each (14 s; 200 s with 3).
    #[test]
    fn loom_a_collect_frees_nothing_retired_after_it_read_the_list() {
        model_within(2, || {
            let (shard, domain) = setup();
            insert(&shard, &domain, 3);
            {
                // Garbage pending before the threads start, so that the collect below
                // reads a list that is not empty, and goes on to the records.
                let handle = domain.register();
                let guard = handle.pin();
                let ptr = Box::into_raw(Box::new(7u64)).cast::<()>();
                // SAFETY: never linked anywhere, retired once; `free_a_u64` frees a
                // `Box<u64>`.
                unsafe { guard.retire(ptr, free_a_u64) };
            }
            let collector = spawn(&shard, &domain, |_, domain| {
                domain.collect_once();
            });
            let reader = spawn(&shard, &domain, |shard, domain| {
                read_through_a_guard(shard, domain, 3);
            });
            migrate(&shard, &domain, 8, 1);
            collector.join().unwrap();
            reader.join().unwrap();
            domain.collect();
            assert_eq!(shard.retired_unfreed(), 0);
            assert_eq!(domain.unfreed(), 0);
        });
    }

    /// Collects that run at once never destroy a piece of a parked object together, nor
    /// one after its last: two threads collect while the main one does, and an
    /// operator's `release_parked` ends what is left. The object's three pieces are three
    /// calls in every interleaving, and the domain counts nothing unfreed after.
    #[test]
    fn loom_concurrent_collects_destroy_each_piece_once() {
        model(|| {
            let (shard, domain) = setup();
            let calls = Arc::new(AtomicUsize::new(0));
            {
                let handle = domain.register();
                let guard = handle.pin();
                InPieces::retire(&guard, 3, &calls);
            }
            let collectors: Vec<_> = (0..2)
                .map(|_| {
                    spawn(&shard, &domain, |_, domain| {
                        domain.collect();
                    })
                })
                .collect();
            domain.collect();
            for collector in collectors {
                collector.join().unwrap();
            }
            domain.release_parked();
            assert_eq!(calls.load(Ordering::Relaxed), 3);
            assert_eq!(domain.unfreed(), 0);
        });
    }

    /// A thread that took a guard once and then idles, holding its record, never holds
    /// back a table retired after its guard dropped: the collect right after the
    /// migration frees it, in every interleaving.
    #[test]
    fn loom_an_idle_thread_holds_nothing_back() {
        model(|| {
            let (shard, domain) = setup();
            insert(&shard, &domain, 6);
            let idle = Arc::new(AtomicBool::new(false));
            let stop = Arc::new(AtomicBool::new(false));
            let reader = {
                let (idle, stop) = (Arc::clone(&idle), Arc::clone(&stop));
                spawn(&shard, &domain, move |shard, domain| {
                    let handle = domain.register();
                    {
                        let guard = handle.pin();
                        assert!(shard.read(&guard).find(6, |k| *k == 6).is_some());
                    }
                    idle.store(true, Ordering::Release);
                    // Idle, with the record still claimed, until told to stop.
                    while !stop.load(Ordering::Acquire) {
                        thread::yield_now();
                    }
                })
            };
            while !idle.load(Ordering::Acquire) {
                thread::yield_now();
            }
            migrate(&shard, &domain, 8, 1);
            assert_eq!(shard.retired_unfreed(), 0);
            stop.store(true, Ordering::Release);
            reader.join().unwrap();
        });
    }
}
