//! The table's memory: zeroed allocations, pages written ahead of a migration, and
//! pages handed back to the kernel.

use super::*;

/// `len` values of `T` whose all-zero bytes are a valid value, from a zeroed allocation
/// (untouched pages of a large one are mapped on first use, so it costs no pass).
#[cfg(not(tollgate_loom))]
pub(super) fn zeroed<T: Zeroable>(len: usize) -> Box<[T]> {
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
pub(super) fn zeroed<T: Zeroable>(len: usize) -> Box<[T]> {
    (0..len).map(|_| T::zero()).collect()
}

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// All-zero bytes must be a valid value of the type (equal to `zero()`).
pub(super) unsafe trait Zeroable {
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

/// A retired table of more than two of these, in bytes of slots, is released a piece at
/// a time, one per collect (16 pages of 4 KiB: a few microseconds each on a VM, where
/// freeing a table of 250,000 keys at once took 130 µs on average and up to 400 µs).
pub(super) const RELEASE_PIECE: usize = 64 << 10;

/// Hands the whole pages that `slots` cover back to the kernel (`madvise(2)`'s
/// `MADV_DONTNEED`): the slots stay allocated and read as zero bytes (empty slots) if
/// read again, which nothing does. Best effort: a failure keeps the pages until the
/// table is freed.
#[cfg(all(target_os = "linux", not(tollgate_loom)))]
pub(super) fn discard<K, A: Atom>(slots: &mut [Slot<K, A>]) {
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
pub(super) fn discard<K, A: Atom>(_: &mut [Slot<K, A>]) {}

/// The kernel's page size, 0 if unknown.
#[cfg(all(target_os = "linux", not(tollgate_loom)))]
pub(super) fn page_size() -> usize {
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

/// A table's slots (and tags), written a batch at a time before the table is made.
pub(super) struct Spare<K, A: Atom> {
    pub(super) slots: Partial<Slot<K, A>>,
    pub(super) tags: Partial<AtomicU8>,
}

impl<K, A: Atom> Spare<K, A> {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            slots: Partial::new(capacity),
            tags: Partial::new(if tagged::<K>() { capacity } else { 0 }),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        self.slots.values.len()
    }

    /// Writes up to `pages` more pages' worth of slots (and their tags); true once all
    /// are written.
    pub(super) fn fill(&mut self, pages: usize) -> bool {
        let count = pages.saturating_mul(slots_per_page::<K, A>());
        let slots = self.slots.fill(count);
        let tags = self.tags.fill(count);
        slots && tags
    }

    /// The table of these slots, the rest of them written now.
    pub(super) fn into_table<M>(
        self,
        meta: M,
        alive: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Table<K, M, A> {
        Table::with(self.slots.finish(), self.tags.finish(), meta, alive)
    }
}

/// `len` values of `T`, written a few at a time from the start.
pub(super) struct Partial<T> {
    pub(super) values: Box<[MaybeUninit<T>]>,
    /// How many values (a prefix) are written.
    pub(super) ready: usize,
}

impl<T: Zeroable> Partial<T> {
    /// Nothing written yet: the allocation is not zeroed either (on memory the allocator
    /// reuses, zeroing would be a pass over all of it at once).
    pub(super) fn new(len: usize) -> Self {
        Self {
            values: Box::new_uninit_slice(len),
            ready: 0,
        }
    }

    /// Writes up to `count` more values; true once all are written.
    pub(super) fn fill(&mut self, count: usize) -> bool {
        let end = self.ready.saturating_add(count).min(self.values.len());
        for value in &mut self.values[self.ready..end] {
            value.write(T::zero());
        }
        self.ready = end;
        self.ready == self.values.len()
    }

    /// All the values, those not yet written written now.
    pub(super) fn finish(mut self) -> Box<[T]> {
        self.fill(usize::MAX);
        // SAFETY: `fill` has written every value (`ready == len`), each once, in order
        // from the start.
        unsafe { self.values.assume_init() }
    }
}

/// Slots per 4 KiB page.
pub(super) fn slots_per_page<K, A>() -> usize {
    (4096 / std::mem::size_of::<Slot<K, A>>()).max(1)
}

/// Whether a table of keys `K` keeps tags (see [`Table`]'s `tags`).
pub(super) const fn tagged<K>() -> bool {
    std::mem::needs_drop::<K>()
}

/// Writes `slot`'s word without changing it, so that the kernel maps its page for
/// writing. An atomic add of a constant 0 would not do: the compiler may turn an add of
/// 0 into a fenced load (LLVM does, on x86), which maps the shared zero page instead, and
/// the first real write then takes a second fault, a copy, and a TLB shootdown of the
/// other threads. [`Atom::touch`] adds an opaque 0, which keeps it a write.
#[inline]
pub(super) fn touch<K, A: Atom>(slot: &Slot<K, A>) {
    slot.word.touch();
}
