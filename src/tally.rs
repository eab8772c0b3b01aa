//! Exact counts of a limiter's decisions, kept without a shared atomic per check: each
//! thread counts into a stripe of its own, and readers sum the stripes.
//!
//! ```text
//! Tally { stripes: [Stripe; 64], overflow }        summed by totals()
//!            ▲ claimed once per (thread, limiter), never given back
//! thread-local: (tally id, stripe index) of the limiter used last   read by count()
//! ```
//!
//! A claimed stripe has one writer, its thread, which bumps a counter with a plain load
//! and store (no read-modify-write, so no bus lock). A stripe outlives its thread, so
//! nothing is lost when threads exit. The 65th thread to decide on one limiter, and any
//! after it, count into shared atomic counters instead: still exact, a little slower.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

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
    stripes: Box<[CachePadded<Stripe>]>,
    /// Stripes claimed so far (may pass `STRIPES`: those threads use `overflow`).
    claimed: AtomicUsize,
    /// The counts of threads without a stripe, shared and updated atomically.
    overflow: CachePadded<Stripe>,
}

/// A claim that means "no stripe: count into the overflow".
const OVERFLOW: usize = usize::MAX;

thread_local! {
    /// The tally this thread counted into last, and its stripe there.
    static LAST: Cell<(u64, usize)> = const { Cell::new((u64::MAX, OVERFLOW)) };
    /// Every stripe this thread holds.
    static CLAIMS: RefCell<Vec<(u64, usize)>> = const { RefCell::new(Vec::new()) };
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
            claimed: AtomicUsize::new(0),
            overflow: CachePadded::default(),
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
                let counter = if allowed {
                    &self.overflow.allowed
                } else {
                    &self.overflow.denied
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
            if let Some(&(_, index)) = claims.iter().find(|(id, _)| *id == self.id) {
                return Some(index);
            }
            let index = self.claimed.fetch_add(1, Ordering::Relaxed);
            let index = if index < self.stripes.len() {
                index
            } else {
                OVERFLOW
            };
            claims.push((self.id, index));
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
        let mut totals = Totals {
            allowed: self.overflow.allowed.load(Ordering::Relaxed),
            denied: self.overflow.denied.load(Ordering::Relaxed),
        };
        for stripe in self.stripes.iter() {
            totals.allowed += stripe.allowed.load(Ordering::Relaxed);
            totals.denied += stripe.denied.load(Ordering::Relaxed);
        }
        totals
    }
}

#[cfg(all(test, not(crossbeam_loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_are_exact_and_survive_the_threads() {
        let tally = Tally::new(true);
        let other = Tally::new(true);
        // More threads than stripes: the last ones share the overflow counters.
        std::thread::scope(|s| {
            for t in 0..(STRIPES as u64 + 16) {
                let (tally, other) = (&tally, &other);
                s.spawn(move || {
                    for i in 0..5_000u64 {
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
        assert!(tally.overflow.allowed.load(Ordering::Relaxed) > 0);
        assert_eq!(other.totals().allowed, threads * 5);
        // The current thread counts too.
        tally.count(false);
        assert_eq!(tally.totals().denied, threads * 1_250 + 1);
        let off = Tally::new(false);
        off.count(true);
        assert_eq!(off.totals(), Totals::default());
    }
}
