//! The one module of tollgate with `unsafe` code: an open-addressing table of
//! `{state word, key}` slots whose readers take no lock and write no shared word, kept
//! alive by an epoch scheme of its own ([`reclaim`]) and resized by freezing slots.
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

mod atom;
pub(crate) mod reclaim;

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
