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
mod tests;
