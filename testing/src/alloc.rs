//! [`CountingAllocator`]: the system allocator, counting what a test asks of it.
//!
//! The crate's only `unsafe`: a global allocator cannot be written without it.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting two things: the bytes handed out and not yet freed,
/// in the whole process ([`live_bytes`](Self::live_bytes): what the process holds,
/// whatever the C allocator keeps for reuse), and the allocations made by a thread inside
/// [`count_allocations`](Self::count_allocations) (each thread its own count, so
/// tests on parallel threads do not see each other's).
///
/// ```
/// #[global_allocator]
/// static ALLOCATOR: tollgate_testing::CountingAllocator = tollgate_testing::CountingAllocator;
///
/// fn main() {
///     let allocations = tollgate_testing::CountingAllocator::count_allocations(|| {
///         std::hint::black_box(vec![1u8; 16]);
///     });
///     assert_eq!(allocations, 1);
/// }
/// ```
pub struct CountingAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

impl CountingAllocator {
    /// Bytes allocated and not freed, in this whole process.
    pub fn live_bytes() -> usize {
        LIVE.load(Ordering::Relaxed)
    }

    /// How many allocations (`realloc`s included) this thread makes while running `f`.
    pub fn count_allocations(f: impl FnOnce()) -> usize {
        let before = ALLOCATIONS.with(Cell::get);
        COUNTING.with(|c| c.set(true));
        f();
        COUNTING.with(|c| c.set(false));
        ALLOCATIONS.with(Cell::get) - before
    }
}

fn note(added: usize) {
    LIVE.fetch_add(added, Ordering::Relaxed);
    // `try_with`: the thread-locals may be gone while a thread is being torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees are ours; the counting touches an atomic and const-initialised
// thread-locals, neither of which allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size());
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}
