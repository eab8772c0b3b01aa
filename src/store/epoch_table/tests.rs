use super::reclaim::Domain;
use super::*;
use std::collections::HashMap;

fn h(key: &u64) -> u64 {
    ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(key)
}

/// A migration done in one go, as the store's operator paths end theirs.
fn migrate<K: Send + Sync + 'static, M: Carry<K> + Send + Sync + 'static>(
    writer: &mut Writer<'_, K, M, ()>,
    guard: &Guard<'_>,
    capacity: usize,
    live: usize,
    meta: M,
    rehash: impl Fn(&K) -> u64,
) {
    writer.begin_migration(guard, capacity, live, meta, &rehash, 0);
    assert!(writer.step(guard, usize::MAX, &rehash, 0));
}

/// Inserts, updates and removals against a `HashMap`, with migrations that move a
/// few slots per operation (lookups read through them), as the store runs them.
#[test]
fn matches_a_hashmap_through_inserts_removals_and_incremental_migrations() {
    let table: EpochTable<u64, (), ()> = EpochTable::new(2, (), ());
    let guard = reclaim::pin();
    let mut model: HashMap<u64, u64> = HashMap::new();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut migrations = 0;
    for step in 0..100_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = x % 3_000;
        let mut writer = table.write();
        writer.step(&guard, 3, h, 0);
        let found = match writer.table(&guard).locate(h(&key), |k| *k == key) {
            Located::Found { slot, raw, .. } => Some((slot, Word::from_raw::<AtomicU64>(raw))),
            Located::Absent { .. } => None,
            Located::Moving => panic!("a key half moved under the writer"),
        };
        if x % 3 < 2 {
            match found {
                Some((slot, Word::Live(state))) => {
                    slot.update(state, step).unwrap();
                    model.insert(key, step);
                }
                Some((_, word)) => panic!("{word:?} under the writer"),
                None => {
                    if let Err(key) = writer.insert(&guard, h(&key), key, step) {
                        let live = model.len();
                        writer.begin_migration(&guard, live * 2, live, (), h, 0);
                        migrations += 1;
                        assert!(writer.insert(&guard, h(&key), key, step).is_ok());
                    }
                    model.insert(key, step);
                }
            }
        } else {
            let removed = found.and_then(|(slot, _)| writer.remove(slot));
            assert_eq!(removed, model.remove(&key), "step {step}");
        }
        drop(writer);
        if step % 1_000 == 0 {
            let current = table.read(&guard);
            for (k, v) in &model {
                match current.locate(h(k), |x| x == k) {
                    Located::Found { raw, .. } => assert_eq!(raw, *v),
                    _ => panic!("step {step}: key {k} lost"),
                }
            }
        }
    }
    assert!(migrations > 10, "{migrations} migrations");
}

/// A table with no empty slot left (which the load limit and the migrations' sizing
/// rule out) fails `place` with a panic that says so, where it probed forever with
/// the writer mutex held; the keys already placed stay readable.
#[test]
fn placing_into_a_full_table_panics_instead_of_probing_forever() {
    let table: EpochTable<String, (), ()> = EpochTable::new(2, (), ());
    let guard = reclaim::pin();
    let writer = table.write();
    let target = writer.target(&guard);
    let capacity = target.capacity() as u64;
    for i in 0..capacity {
        // SAFETY: this writer holds the mutex and `target` is the insert target.
        unsafe { target.place(i, i.to_string(), i) };
    }
    let full = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: as above.
        unsafe { target.place(99, "one too many".into(), 0) };
    }));
    let message = full.expect_err("a key placed in a full table");
    let message = message
        .downcast_ref::<String>()
        .expect("a formatted panic message");
    assert!(message.contains("no empty slot"), "{message}");
    for i in 0..capacity {
        let found = target.find(i, |k| *k == i.to_string());
        assert_eq!(found.map(|(_, word)| word), Some(Word::Live(i)));
    }
    drop(writer);
}

#[test]
fn states_are_clamped_below_the_reserved_words() {
    let table: EpochTable<u64, (), ()> = EpochTable::new(8, (), ());
    let guard = reclaim::pin();
    let slot = table.write().insert(&guard, 7, 7, u64::MAX).ok().unwrap();
    assert_eq!(slot.load(), Word::Live(STATE_MAX));
    slot.update(STATE_MAX, u64::MAX - 1).unwrap();
    assert_eq!(slot.load(), Word::Live(STATE_MAX));
}

#[test]
fn a_prefetch_takes_any_hash_and_changes_nothing() {
    let guard = reclaim::pin();
    for capacity in [1, 8, 1000] {
        let numbers: EpochTable<u64, (), ()> = EpochTable::new(capacity, (), ());
        let words: EpochTable<String, (), ()> = EpochTable::new(capacity, (), ());
        numbers.write().insert(&guard, h(&7), 7, 70).ok().unwrap();
        words
            .write()
            .insert(&guard, 9, "seven".into(), 80)
            .ok()
            .unwrap();
        for hash in [0, 1, h(&7), 9, u64::MAX / 2, u64::MAX] {
            numbers.read(&guard).prefetch(hash);
            words.read(&guard).prefetch(hash);
        }
        let number = numbers.read(&guard).find(h(&7), |k| *k == 7);
        assert_eq!(number.map(|(_, word)| word), Some(Word::Live(70)));
        let word = words.read(&guard).find(9, |k| k == "seven");
        assert_eq!(word.map(|(_, word)| word), Some(Word::Live(80)));
    }
}

#[test]
fn keys_are_dropped_once_whether_moved_removed_or_kept() {
    // A private domain: what it retired is destroyed by its collects, whatever the
    // other tests' threads (on the global one) are doing.
    let counter = Arc::new(());
    let domain = Domain::new();
    let handle = domain.register();
    {
        let table: EpochTable<Arc<()>, (), ()> = EpochTable::new(4, (), ());
        let guard = handle.pin();
        let mut writer = table.write();
        for i in 0..3u64 {
            writer
                .insert(&guard, i * 0x1234_5678, Arc::clone(&counter), 0)
                .ok()
                .unwrap();
        }
        assert_eq!(Arc::strong_count(&counter), 4);
        let slot = writer.table(&guard).find(0, |_| true).unwrap().0;
        writer.remove(slot);
        migrate(&mut writer, &guard, 16, 2, (), |k| Arc::as_ptr(k) as u64);
        // Two keys moved to the new table, one left behind, removed, in the retired
        // one: nothing dropped yet, and the guard in force holds the retired table.
        assert_eq!(Arc::strong_count(&counter), 4);
        drop(writer);
        assert_eq!(domain.collect(), 0);
        assert_eq!(table.retired_unfreed(), 1);
        drop(guard);
        // No guard in force: the retired table goes, with the removed key.
        assert_eq!(domain.collect(), 1);
        assert_eq!(table.retired_unfreed(), 0);
        assert_eq!(Arc::strong_count(&counter), 3);
    }
    // The current table dropped its two keys.
    assert_eq!(Arc::strong_count(&counter), 1);
    drop(handle);
}

/// A retired table of more than two pieces is destroyed a piece per collect, each
/// key it still owns (removed ones; moved ones belong to the next table) dropped
/// once, in the piece that holds it; `release_parked` (an operator's path) ends the
/// rest at once.
#[test]
fn a_large_retired_table_is_destroyed_a_piece_per_collect() {
    type Key = (u64, Arc<()>);
    let per_piece = RELEASE_PIECE / std::mem::size_of::<Slot<Key>>();
    let (capacity, keys, removed) = (5 * per_piece / 2, 2 * per_piece, 600u64);
    let counter = Arc::new(());
    let domain = Domain::new();
    let handle = domain.register();
    let hash = |key: &Key| h(&key.0);
    for operator in [false, true] {
        let table: EpochTable<Key, (), ()> = EpochTable::new(capacity, (), ());
        let guard = handle.pin();
        let mut writer = table.write();
        for i in 0..keys as u64 {
            let key = (i, Arc::clone(&counter));
            assert!(writer.insert(&guard, hash(&key), key, 0).is_ok());
        }
        for i in 0..removed {
            let slot = writer.table(&guard).find(h(&i), |k| k.0 == i).unwrap().0;
            writer.remove(slot);
        }
        migrate(&mut writer, &guard, 2 * capacity, keys, (), hash);
        drop(writer);
        drop(guard);
        let owned = |c: &Arc<()>| Arc::strong_count(c) - 1;
        assert_eq!(owned(&counter), keys);
        // The first piece goes at the first collect, the table stays counted.
        assert_eq!(domain.collect(), 0);
        assert_eq!(table.retired_unfreed(), 1);
        assert_eq!(domain.unfreed(), 1);
        if operator {
            domain.release_parked();
        } else {
            let mut collects = 1;
            let mut last = owned(&counter);
            while domain.collect() == 0 {
                collects += 1;
                assert!(owned(&counter) <= last, "a piece drops keys, never adds");
                last = owned(&counter);
                assert!(collects <= 3, "more collects than pieces");
            }
            assert_eq!(collects + 1, 3, "one collect per piece");
        }
        assert_eq!(table.retired_unfreed(), 0);
        assert_eq!(domain.unfreed(), 0);
        assert_eq!(
            owned(&counter),
            keys - removed as usize,
            "removed keys dropped once"
        );
        drop(table);
        assert_eq!(owned(&counter), 0);
    }
    drop(handle);
}

/// Slots prepared ahead of a migration become its table, written a batch at a time
/// and counted nowhere until then; prepared slots of another size are dropped. With
/// `String` keys, so that the tags are prepared too (a tag left unwritten would hide
/// keys from lookups).
#[test]
fn prepared_slots_become_the_next_migrations_table() {
    let key = |i: u64| format!("key-{i}");
    let hash = |k: &String| ahash::RandomState::with_seeds(1, 2, 3, 4).hash_one(k);
    let table: EpochTable<String, (), ()> = EpochTable::new(64, (), ());
    let guard = reclaim::pin();
    let mut writer = table.write();
    for i in 0..40 {
        writer
            .insert(&guard, hash(&key(i)), key(i), i)
            .ok()
            .unwrap();
    }
    // 32-byte slots (a word and a `String`), 128 a page: 2,048 slots are 16 pages,
    // 2 a call.
    let batches = (1..=20)
        .find(|_| writer.prepare(&guard, 2048, 40, 2))
        .unwrap();
    assert_eq!(batches, 8);
    assert!(writer.has_spare());
    assert_eq!(table.retired_unfreed(), 0, "a spare is not a retired table");
    let prepared = writer.state.spare.as_ref().unwrap().slots.values.as_ptr();
    assert_eq!(writer.begin_migration(&guard, 2048, 40, (), hash, 0), 2048);
    assert!(!writer.has_spare());
    assert_eq!(
        writer.target(&guard).slots.as_ptr().cast(),
        prepared,
        "the migration made a table of its own"
    );
    for i in 40..60 {
        writer
            .insert(&guard, hash(&key(i)), key(i), i)
            .ok()
            .unwrap();
    }
    assert!(writer.step(&guard, usize::MAX, hash, 0));
    for i in 0..60 {
        let found = writer.table(&guard).find(hash(&key(i)), |k| *k == key(i));
        assert_eq!(found.map(|(_, w)| w), Some(Word::Live(i)), "key {i}");
    }
    // Half prepared, then a migration of another size: dropped, a table made.
    assert!(!writer.prepare(&guard, 8192, 60, 1));
    assert_eq!(writer.begin_migration(&guard, 1024, 60, (), hash, 0), 1024);
    assert!(!writer.has_spare());
    assert!(writer.step(&guard, usize::MAX, hash, 0));
    assert_eq!(writer.table(&guard).capacity(), 1024);
    for i in 0..60 {
        assert!(
            writer
                .table(&guard)
                .find(hash(&key(i)), |k| *k == key(i))
                .is_some()
        );
    }
}
