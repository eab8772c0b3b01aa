//! One calendar period as instants, and the lock-free cache of the current one.

use std::sync::atomic::{AtomicU64, Ordering, fence};

/// A calendar period: its index (consecutive periods have consecutive indexes) and its
/// bounds in Unix nanoseconds, with the next period's end (the sliding window counter
/// weighs the next window by its own length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) index: u64,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) next_end: u64,
}

/// The last period computed, behind a sequence lock: a writer makes `seq` odd, writes,
/// and makes it even again; a reader that saw the same even `seq` before and after its
/// reads read one writer's words. Readers never wait: a reader that meets a writer
/// computes the period itself. Writers are rare (once per period, or when limiters on
/// clocks far apart share the calendar) and never wait either: one that finds another
/// writing leaves the cache as it is.
#[derive(Default)]
pub(super) struct SpanCache {
    seq: AtomicU64,
    index: AtomicU64,
    start: AtomicU64,
    /// 0 while empty, so that no instant falls inside.
    end: AtomicU64,
    next_end: AtomicU64,
}

impl SpanCache {
    /// The cached period, if it holds `wall_ns` and no writer overlapped the read.
    #[inline(always)]
    pub(super) fn get(&self, wall_ns: u64) -> Option<Span> {
        let before = self.seq.load(Ordering::Acquire);
        let span = Span {
            index: self.index.load(Ordering::Relaxed),
            start: self.start.load(Ordering::Relaxed),
            end: self.end.load(Ordering::Relaxed),
            next_end: self.next_end.load(Ordering::Relaxed),
        };
        // Orders the reads above before the check of `seq` below.
        fence(Ordering::Acquire);
        let after = self.seq.load(Ordering::Relaxed);
        let whole = before == after && before % 2 == 0;
        (whole && span.start <= wall_ns && wall_ns < span.end).then_some(span)
    }

    /// Caches `span`, unless another writer is at work.
    pub(super) fn put(&self, span: Span) {
        let seq = self.seq.load(Ordering::Relaxed);
        if seq % 2 == 1
            || self
                .seq
                .compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        // Orders the odd `seq` before the writes below, for a reader that sees them.
        fence(Ordering::Release);
        self.index.store(span.index, Ordering::Relaxed);
        self.start.store(span.start, Ordering::Relaxed);
        self.end.store(span.end, Ordering::Relaxed);
        self.next_end.store(span.next_end, Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Two writers publish two spans whose fields all differ, 20,000 times each, while a
    /// reader checks that every span it gets is one of the two whole, never a mix; once
    /// the writers are done, the cache holds one of them.
    #[test]
    fn readers_never_see_a_torn_span() {
        let cache = Arc::new(SpanCache::default());
        let spans = [
            Span {
                index: 1,
                start: 0,
                end: 100,
                next_end: 200,
            },
            Span {
                index: 2,
                start: 10,
                end: 110,
                next_end: 210,
            },
        ];
        let writers: Vec<_> = spans
            .into_iter()
            .map(|span| {
                let cache = Arc::clone(&cache);
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        cache.put(span);
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        let mut reads = 0u64;
        while !writers.iter().all(|w| w.is_finished()) {
            if let Some(span) = cache.get(50) {
                assert!(spans.contains(&span), "a torn span: {span:?}");
                reads += 1;
            }
        }
        writers.into_iter().for_each(|w| w.join().unwrap());
        let last = cache.get(50).expect("no writer left: the read succeeds");
        assert!(spans.contains(&last));
        assert_eq!(cache.get(110), None, "an instant past both ends");
        println!("{reads} whole reads while writing");
    }
}
