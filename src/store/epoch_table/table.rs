//! The table: slots of `{state word, key}`, probed without a lock, and their words' states.

use super::*;

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
    pub(super) word: A,
    pub(super) key: UnsafeCell<MaybeUninit<K>>,
}

// SAFETY: a `Slot` shared between threads hands out `&K` to all of them (so `K: Sync`)
// and a migration or a table's destruction may move or drop the key on any thread (so
// `K: Send`). Its key bytes are written only under the module invariant (by the writer,
// into an `EMPTY` slot, before a `Release` store), so shared access never races a write.
unsafe impl<K: Send + Sync, A: Atom> Sync for Slot<K, A> {}

impl<K, A: Atom> Slot<K, A> {
    pub(super) fn empty() -> Self {
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
    pub(super) fn remove(&self) -> Option<A::Value> {
        self.end(REMOVED)
    }

    /// Freezes a live slot and returns the state it had; `None` if it was not live.
    pub(super) fn freeze(&self) -> Option<A::Value> {
        self.end(FROZEN)
    }

    /// Replaces a live state, whatever it is, with the final word `to` (REMOVED or
    /// FROZEN); returns the state it replaced, or `None` if the slot was not live.
    pub(super) fn end(&self, to: u64) -> Option<A::Value> {
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
pub(super) fn home(hash: u64, capacity: usize) -> usize {
    (((hash >> 32) * capacity as u64) >> 32) as usize
}

/// The tag of a hash: its bits 16‥24, apart from the home slot's.
#[inline]
pub(super) fn tag(hash: u64) -> u8 {
    (hash >> 16) as u8
}

/// Whether `used` slots fit a table of `capacity` within the load limit.
pub(super) fn fits(used: usize, capacity: usize) -> bool {
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
    pub(super) slots: Box<[Slot<K, A>]>,
    /// For keys whose comparison reads the heap (`String`, `Arc<str>`: types that need
    /// drop), a tag of each slot's hash, so that a probe reads a key only when its tag
    /// matches (1 in 256 false candidates). Empty for the others (`u64`, `IpAddr`), whose
    /// comparison costs no more than the tag's. Written before the slot's word.
    pub(super) tags: Box<[AtomicU8]>,
    /// Slots that are not `EMPTY`; changed only by the writer.
    pub(super) used: AtomicUsize,
    /// Read by checks with the slots; replaced only by publishing a new table.
    pub(crate) meta: M,
    /// While a migration moves this table's keys: the table they move to (null
    /// otherwise). Set before the first slot is frozen, never changed after.
    pub(super) next: sync::AtomicPtr<Table<K, M, A>>,
    /// The tables of this table's shard not yet destroyed (this one among them).
    pub(super) alive: Arc<std::sync::atomic::AtomicUsize>,
    /// Once retired and unreachable: how many slots, from the first, had their keys
    /// dropped and their pages handed back ([`release_piece`](Self::release_piece)).
    pub(super) released: usize,
    /// Read by every probe and written by the destructor, so that loom reports a table
    /// destroyed while a reader may still probe it.
    #[cfg(tollgate_loom)]
    pub(super) canary: UnsafeCell<()>,
}

impl<K, M, A: Atom> Table<K, M, A> {
    /// Whether this key type keeps tags.
    pub(super) const TAGGED: bool = tagged::<K>();

    pub(super) fn new(
        capacity: usize,
        meta: M,
        alive: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        let tags = if Self::TAGGED { capacity } else { 0 };
        Self::with(zeroed(capacity), zeroed(tags), meta, alive)
    }

    /// A table of empty `slots` (and `tags`, one per slot for keys that keep them),
    /// counted among the shard's tables by `alive`.
    pub(super) fn with(
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
    pub(super) unsafe fn destroy(ptr: *mut ()) -> bool {
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
    pub(super) fn release_piece(&mut self) -> bool {
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
    pub(super) unsafe fn place(&self, hash: u64, key: K, state: A::Value) -> &Slot<K, A> {
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
pub(super) fn drop_keys<K, A: Atom>(slots: &mut [Slot<K, A>]) {
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
