//! A check on an existing key allocates nothing, including `&str` lookups on a
//! `String`-keyed limiter, denies, peeks and both algorithms.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use tollgate::{Algorithm, Quota, RateLimiter};

/// Counts the allocations made by threads that have switched counting on.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn note_allocation() {
    // `try_with`: the thread-local may be gone while a thread is being torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees are ours; counting touches only an atomic and a const-initialised
// thread-local, neither of which allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// How many allocations `f` made on this thread.
fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

#[test]
fn checks_on_existing_keys_do_not_allocate() {
    for algorithm in Algorithm::ALL {
        let limiter: RateLimiter<String> = RateLimiter::builder(Quota::per_second(50).unwrap())
            .algorithm(algorithm)
            .build()
            .unwrap();
        let keys: Vec<String> = (0..1000).map(|i| format!("user-{i:019}")).collect();
        for key in &keys {
            limiter.check(key.as_str());
        }

        // The counter really counts: inserting new keys allocates their Strings.
        let inserting = allocations_in(|| {
            for i in 0..10 {
                limiter.check(format!("new-{i}").as_str());
            }
        });
        assert!(
            inserting >= 10,
            "{algorithm:?}: counted only {inserting} allocations"
        );

        let mut denied = 0;
        let n = allocations_in(|| {
            for _ in 0..100 {
                for key in &keys {
                    let d = limiter.check(key.as_str());
                    denied += usize::from(!d.is_allowed());
                    let _ = d.retry_after();
                }
            }
            for key in &keys {
                limiter.peek(key.as_str());
                limiter.check_n(key.as_str(), 2).unwrap();
            }
        });
        assert_eq!(
            n, 0,
            "{algorithm:?}: {n} allocations in 102,000 checks on existing keys"
        );
        assert!(denied > 0, "{algorithm:?}: the deny path was not exercised");
    }
}
