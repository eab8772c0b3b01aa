//! The one module of tollgate with `unsafe` code: an open-addressing table of
//! `{state word, key}` slots whose readers take no lock and write no shared word, kept
//! alive by an epoch scheme of its own ([`reclaim`]) and resized by freezing slots; a
//! slot's word is one `u64` or a pair of them ([`atom`]). Nothing outside this module may
//! write `unsafe` (`#![deny(unsafe_code)]` at the crate root; `store/mod.rs` allows it for
//! this module alone, and `.ci/run` checks that no other module is allowed it).
//!
//! One file per job: this one, the shard's table and its writers (the protocol below);
//! `table.rs`, the slots and how a check probes them; `memory.rs`, zeroed allocations,
//! pages written ahead and handed back; `atom.rs`, the state word; `reclaim.rs`, when a
//! retired table may be freed; `tests.rs` and `loom_models.rs`.
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
//! The loom models (`loom_models.rs`) check these steps and the reclamation of
//! retired tables; `tests/stress.rs` checks every decision against a reference model while
//! tiny tables resize, also under valgrind.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::Arc;

pub(crate) use atom::{Atom, AtomicPair, Two};
pub(crate) use memory::physical_memory;
use memory::*;
pub(crate) use reclaim::Guard;
use sync::{AtomicU8, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering, UnsafeCell};
pub(crate) use table::*;

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

mod atom;
mod memory;

pub(crate) mod reclaim;
mod table;

#[cfg(all(test, not(tollgate_loom)))]
mod tests;

/// Loom models of the publish, freeze, migrate and reclaim protocol. Run with
/// `RUSTFLAGS="--cfg tollgate_loom" cargo test --release --lib loom_` (the test script
/// does). Each model has a domain of its own, whose barriers are `SeqCst` fences (loom
/// models those; it cannot model `membarrier`, which stands in for the readers' fence).
/// A table carries a canary cell under loom that every probe reads and its destruction
/// writes, so a table freed while a reader can still probe it is a race loom reports.
#[cfg(all(test, tollgate_loom))]
mod loom_models;
