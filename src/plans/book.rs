//! The plan book: which plan each key is on, as an operator assigned it or as the plan
//! resolver answered (kept for a while, so that the resolver runs once per key and not
//! once per check).

use std::borrow::Borrow;
use std::hash::Hash;

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::RwLock;

/// The book's shard count: a lookup read-locks one shard, so two threads rarely meet.
const SHARDS: usize = 64;

/// What the book knows of a key's plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    /// The plan's index.
    plan: u32,
    /// When the resolver answered (clock ns), or [`ASSIGNED`]: an operator's assignment,
    /// which never expires and is never dropped to make room.
    at: u64,
}

/// [`Entry::at`] of an assignment.
const ASSIGNED: u64 = u64::MAX;

impl Entry {
    fn assigned(&self) -> bool {
        self.at == ASSIGNED
    }

    /// Whether the resolver's answer is still to be trusted at `now`.
    fn fresh(&self, now: u64, keep_ns: u64) -> bool {
        self.assigned() || now.saturating_sub(self.at) < keep_ns
    }
}

/// One shard of the book: its entries, each placed by the key's hash, and how many
/// of them are answers.
struct Shard<K> {
    table: HashTable<(K, Entry)>,
    answers: usize,
}

impl<K: Hash + Eq> Shard<K> {
    fn get<Q>(&self, hash: u64, key: &Q) -> Option<Entry>
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.table
            .find(hash, |(k, _)| k.borrow() == key)
            .map(|&(_, e)| e)
    }

    /// Inserts `entry` for `key`, keeping the count of answers; returns the entry it
    /// replaced, if any.
    fn insert(
        &mut self,
        hash: u64,
        key: K,
        entry: Entry,
        rehash: impl Fn(&K) -> u64,
    ) -> Option<Entry> {
        let before = match self.table.find_mut(hash, |(k, _)| *k == key) {
            Some((_, held)) => Some(std::mem::replace(held, entry)),
            None => {
                self.table
                    .insert_unique(hash, (key, entry), |(k, _)| rehash(k));
                None
            }
        };
        self.answers += usize::from(!entry.assigned());
        self.answers -= usize::from(before.is_some_and(|e| !e.assigned()));
        before
    }

    /// Removes `key`'s entry if `which` says so, keeping the count of answers.
    fn remove<Q>(&mut self, hash: u64, key: &Q, which: impl Fn(&Entry) -> bool) -> Option<Entry>
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        let found = self
            .table
            .find_entry(hash, |(k, _)| k.borrow() == key)
            .ok()?;
        if !which(&found.get().1) {
            return None;
        }
        let ((_, removed), _) = found.remove();
        self.answers -= usize::from(!removed.assigned());
        Some(removed)
    }

    /// Keeps the entries `keep` says to keep, and the count of answers.
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        self.table.retain(|(_, e)| keep(e));
        self.answers = self.table.iter().filter(|(_, e)| !e.assigned()).count();
    }
}

/// The keys' plans: assignments, and the resolver's answers kept for `keep_ns`, at most
/// `per_shard` of them in each shard.
pub(crate) struct Book<K> {
    shards: Box<[CachePadded<RwLock<Shard<K>>>]>,
    hasher: ahash::RandomState,
    /// How long a resolver's answer is kept, in ns.
    keep_ns: u64,
    /// The resolver's answers a shard keeps (assignments are not counted against it).
    per_shard: usize,
}

/// Where a key's plan comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// An operator's assignment.
    Assigned(u32),
    /// The resolver's answer, still fresh.
    Resolved(u32),
    /// Nothing fresh: ask the resolver.
    Unknown,
}

impl<K: Hash + Eq> Book<K> {
    /// An empty book keeping answers for `keep_ns` ns, at most about `most` of them.
    pub(crate) fn new(keep_ns: u64, most: usize) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    CachePadded::new(RwLock::new(Shard {
                        table: HashTable::new(),
                        answers: 0,
                    }))
                })
                .collect(),
            hasher: ahash::RandomState::new(),
            keep_ns,
            per_shard: (most / SHARDS).max(16),
        }
    }

    /// `key`'s hash, and its shard (chosen by the top bits: the table places entries by
    /// the low ones).
    #[inline]
    fn locate<Q: Hash + ?Sized>(&self, key: &Q) -> (u64, &RwLock<Shard<K>>) {
        let hash = self.hasher.hash_one(key);
        (hash, &self.shards[(hash >> 58) as usize % SHARDS])
    }

    fn rehash(&self) -> impl Fn(&K) -> u64 + '_ {
        |k| self.hasher.hash_one(k)
    }

    /// What the book knows of `key`'s plan at `now` (a clock read only for an answer
    /// that can expire).
    #[inline]
    pub(crate) fn find<Q>(&self, key: &Q, now: impl FnOnce() -> u64) -> Found
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        let entry = shard.read().get(hash, key);
        match entry {
            Some(e) if e.assigned() => Found::Assigned(e.plan),
            Some(e) if self.keep_ns == u64::MAX || e.fresh(now(), self.keep_ns) => {
                Found::Resolved(e.plan)
            }
            _ => Found::Unknown,
        }
    }

    /// Assigns `key` to `plan`; returns the plan it was assigned to before, if any.
    pub(crate) fn assign(&self, key: K, plan: u32) -> Option<u32> {
        let entry = Entry { plan, at: ASSIGNED };
        let (hash, shard) = self.locate(&key);
        let before = shard.write().insert(hash, key, entry, self.rehash());
        before.filter(Entry::assigned).map(|e| e.plan)
    }

    /// Takes `key`'s assignment away (and any answer kept for it); returns the plan it
    /// was assigned to, if any.
    pub(crate) fn unassign<Q>(&self, key: &Q) -> Option<u32>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        let removed = shard.write().remove(hash, key, |_| true);
        removed.filter(Entry::assigned).map(|e| e.plan)
    }

    /// Keeps the resolver's answer `plan` for `key`, given at `now`, unless an operator
    /// assigned the key meanwhile (the assignment wins). A full shard drops one answer
    /// first: a stale one among the first it meets, else the first.
    pub(crate) fn remember(&self, key: K, plan: u32, now: u64) {
        let (hash, shard) = self.locate(&key);
        let mut shard = shard.write();
        let held = shard.get(hash, &key);
        if held.is_some_and(|e| e.assigned()) {
            return;
        }
        if shard.answers >= self.per_shard && held.is_none() {
            let keep_ns = self.keep_ns;
            let mut looked = 0;
            // The iterator stops at the first entry it takes, keeping the rest.
            let dropped = shard
                .table
                .extract_if(|(_, e)| {
                    looked += 1;
                    !e.assigned() && (!e.fresh(now, keep_ns) || looked > 8)
                })
                .next();
            shard.answers -= usize::from(dropped.is_some());
        }
        let _ = shard.insert(hash, key, Entry { plan, at: now }, self.rehash());
    }

    /// Forgets every answer the resolver gave (assignments stay): the next check of
    /// each key asks it again.
    pub(crate) fn forget_answers(&self) {
        for shard in self.shards.iter() {
            shard.write().retain(Entry::assigned);
        }
    }

    /// Forgets the resolver's answer for `key`, if the book keeps one.
    pub(crate) fn forget<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (hash, shard) = self.locate(key);
        shard.write().remove(hash, key, |e| !e.assigned());
    }

    /// The keys assigned to `plan`.
    pub(crate) fn assigned_to(&self, plan: u32) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.read()
                    .table
                    .iter()
                    .filter(|(_, e)| e.assigned() && e.plan == plan)
                    .count()
            })
            .sum()
    }

    /// Entries held: (assignments, kept answers).
    pub(crate) fn counts(&self) -> (usize, usize) {
        self.shards.iter().fold((0, 0), |(a, r), s| {
            let shard = s.read();
            (a + shard.table.len() - shard.answers, r + shard.answers)
        })
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn assignments_win_over_answers_and_never_expire() {
        let book: Book<u64> = Book::new(100, 1_000);
        book.remember(1, 2, 0);
        assert_eq!(book.find(&1, || 50), Found::Resolved(2));
        assert_eq!(book.find(&1, || 100), Found::Unknown, "an answer expires");
        assert_eq!(book.assign(1, 0), None, "an answer is not an assignment");
        book.remember(1, 2, 200);
        assert_eq!(book.find(&1, || u64::MAX - 1), Found::Assigned(0));
        assert_eq!(book.assign(1, 1), Some(0));
        assert_eq!(book.unassign(&1), Some(1));
        assert_eq!(book.find(&1, || 0), Found::Unknown);
    }

    #[test]
    fn a_full_book_drops_answers_not_assignments() {
        // 16 answers a shard at most: 64 × 16 = 1,024 in all.
        let book: Book<u64> = Book::new(u64::MAX, 0);
        for key in 0..5_000 {
            book.assign(key, 1);
        }
        for key in 5_000..50_000 {
            book.remember(key, 2, 0);
        }
        let (assigned, answers) = book.counts();
        assert_eq!(assigned, 5_000);
        assert!(answers <= SHARDS * 16, "{answers} answers kept");
        assert!(answers >= SHARDS * 15, "{answers} answers kept");
        assert!((0..5_000).all(|k| book.find(&k, || 0) == Found::Assigned(1)));
        assert_eq!(book.assigned_to(1), 5_000);
        book.forget_answers();
        assert_eq!(book.counts(), (5_000, 0));
    }
}
