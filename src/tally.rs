//! Exact counts of a limiter's decisions, kept without a shared atomic per check: each
//! thread counts into a stripe of its own, and readers sum the stripes.
//!
//! ```text
//! Tally ─► Stripes { stripes: [Stripe; 64], free, overflow }   summed by totals()
//!                     ▲ claimed by a (thread, limiter), given back when the thread exits
//! thread-local: (tally id, stripe index) of the limiter used last   read by count()
//! ```
//!
//! A claimed stripe has one writer, its thread, which bumps a counter with a plain load
//! and store (no read-modify-write, so no bus lock). When the thread exits, its stripes go
//! back to their limiters' free lists with their counts, and the next thread that claims
//! one adds to them (the free list's mutex orders the two threads' writes). While more
//! than 64 threads at once decide on one limiter, the others count into shared atomic
//! counters: still exact, a little slower.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

/// Threads per limiter that get a stripe of their own.
const STRIPES: usize = 64;

/// One thread's counts for one limiter.
#[derive(Default)]
struct Stripe {
    allowed: AtomicU64,
    denied: AtomicU64,
}

/// Allowed and denied totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) allowed: u64,
    pub(crate) denied: u64,
}

/// The decision counts of one limiter.
pub(crate) struct Tally {
    /// Whether decisions are counted at all.
    enabled: bool,
    id: u64,
    /// Kept here, not behind `shared`, so a count makes one load fewer.
    stripes: Box<[CachePadded<Stripe>]>,
    shared: Arc<Stripes>,
}

/// What the threads that hold stripes of one limiter share with it (weakly).
struct Stripes {
    /// Stripes never claimed yet start here.
    next: AtomicUsize,
    /// Stripes given back by threads that exited.
    free: Mutex<Vec<usize>>,
    /// The counts of threads without a stripe, shared and updated atomically.
    overflow: CachePadded<Stripe>,
}

/// A claim that means "no stripe: count into the overflow".
const OVERFLOW: usize = usize::MAX;

/// This thread's stripes; given back when the thread exits.
struct Claims(Vec<(u64, usize, Weak<Stripes>)>);

impl Drop for Claims {
    fn drop(&mut self) {
        // From now on this thread counts into the overflow.
        let _ = LAST.try_with(|last| last.set((u64::MAX, OVERFLOW)));
        for (_, index, stripes) in self.0.drain(..) {
            if let (Some(stripes), true) = (stripes.upgrade(), index != OVERFLOW) {
                stripes.free.lock().push(index);
            }
        }
    }
}

thread_local! {
    /// The tally this thread counted into last, and its stripe there.
    static LAST: Cell<(u64, usize)> = const { Cell::new((u64::MAX, OVERFLOW)) };
    /// Every stripe this thread holds.
    static CLAIMS: RefCell<Claims> = const { RefCell::new(Claims(Vec::new())) };
}

/// Tally ids: unique for the process's life (`u64::MAX` is never one).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Tally {
    /// A tally that counts, or (`enabled == false`) one that ignores every decision.
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            stripes: if enabled {
                (0..STRIPES).map(|_| CachePadded::default()).collect()
            } else {
                Box::default()
            },
            shared: Arc::new(Stripes {
                next: AtomicUsize::new(0),
                free: Mutex::new(Vec::new()),
                overflow: CachePadded::default(),
            }),
        }
    }

    /// Counts one decision.
    #[inline]
    pub(crate) fn count(&self, allowed: bool) {
        if !self.enabled {
            return;
        }
        let (id, index) = LAST.try_with(Cell::get).unwrap_or((u64::MAX, OVERFLOW));
        let index = if id == self.id { index } else { self.claim() };
        match self.stripes.get(index) {
            Some(stripe) => {
                let counter = if allowed {
                    &stripe.allowed
                } else {
                    &stripe.denied
                };
                // This thread is the stripe's only writer.
                counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            }
            None => {
                let overflow = &self.shared.overflow;
                let counter = if allowed {
                    &overflow.allowed
                } else {
                    &overflow.denied
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// This thread's stripe of this tally (claiming one the first time), remembered as
    /// the last used; `OVERFLOW` when all are taken.
    #[cold]
    #[inline(never)]
    fn claim(&self) -> usize {
        let held = CLAIMS.try_with(|claims| {
            let mut claims = claims.try_borrow_mut().ok()?;
            // Forget the claims of limiters that are gone.
            claims
                .0
                .retain(|(_, _, stripes)| stripes.strong_count() > 0);
            if let Some(&(_, index, _)) = claims.0.iter().find(|(id, _, _)| *id == self.id) {
                return Some(index);
            }
            let shared = &*self.shared;
            let index = shared.free.lock().pop().unwrap_or_else(|| {
                let index = shared.next.fetch_add(1, Ordering::Relaxed);
                if index < self.stripes.len() {
                    index
                } else {
                    OVERFLOW
                }
            });
            claims
                .0
                .push((self.id, index, Arc::downgrade(&self.shared)));
            Some(index)
        });
        match held {
            Ok(Some(index)) => {
                let _ = LAST.try_with(|last| last.set((self.id, index)));
                index
            }
            // Thread teardown or a nested call: count into the overflow.
            _ => OVERFLOW,
        }
    }

    /// The totals so far: every decision counted before this call started is in them.
    pub(crate) fn totals(&self) -> Totals {
        let shared = &*self.shared;
        let mut totals = Totals {
            allowed: shared.overflow.allowed.load(Ordering::Relaxed),
            denied: shared.overflow.denied.load(Ordering::Relaxed),
        };
        for stripe in self.stripes.iter() {
            totals.allowed += stripe.allowed.load(Ordering::Relaxed);
            totals.denied += stripe.denied.load(Ordering::Relaxed);
        }
        totals
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_are_exact_and_survive_the_threads() {
        let tally = Tally::new(true);
        let other = Tally::new(true);
        // More threads at once than stripes: the last ones share the overflow counters.
        let start = std::sync::Barrier::new(STRIPES + 16);
        std::thread::scope(|s| {
            for t in 0..(STRIPES as u64 + 16) {
                let (tally, other, start) = (&tally, &other, &start);
                s.spawn(move || {
                    // i = 0, before all start: every thread holds a stripe or the overflow.
                    tally.count(t % 4 != 0);
                    other.count(true);
                    start.wait();
                    for i in 1..5_000u64 {
                        tally.count(i % 4 != t % 4);
                        // Interleave another limiter, so the thread switches stripes.
                        if i % 1000 == 0 {
                            other.count(true);
                        }
                    }
                });
            }
        });
        let threads = STRIPES as u64 + 16;
        let totals = tally.totals();
        assert_eq!(totals.allowed + totals.denied, threads * 5_000);
        assert_eq!(totals.denied, threads * 1_250);
        assert!(tally.shared.overflow.allowed.load(Ordering::Relaxed) > 0);
        // The threads gave their stripes back (their thread-locals are dropped just after
        // `scope` sees them finish): new threads reuse them, adding to them.
        let all_back = || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while tally.shared.free.lock().len() < STRIPES {
                assert!(
                    std::time::Instant::now() < deadline,
                    "stripes not given back"
                );
                std::thread::yield_now();
            }
        };
        all_back();
        for _ in 0..(2 * STRIPES) {
            std::thread::scope(|s| {
                s.spawn(|| tally.count(true));
            });
            all_back();
        }
        assert_eq!(tally.shared.next.load(Ordering::Relaxed), STRIPES + 16);
        assert_eq!(tally.totals().allowed, totals.allowed + 2 * STRIPES as u64);
        assert_eq!(other.totals().allowed, threads * 5);
        // The current thread counts too.
        tally.count(false);
        assert_eq!(tally.totals().denied, threads * 1_250 + 1);
        let off = Tally::new(false);
        off.count(true);
        assert_eq!(off.totals(), Totals::default());
    }
}
