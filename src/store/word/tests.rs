use super::*;
use crate::algorithm::AnyPolicy;
use std::time::Duration;

fn limits(shards: usize, max_keys: usize) -> Limits {
    Limits {
        shards,
        max_keys,
        when_full: WhenFull::DenyNewKeys,
        sweep: false,
        expected_keys: 0,
    }
}

fn store(shards: usize, max_keys: usize) -> WordStore<String> {
    let quota = Quota::new(1, Duration::from_nanos(100)).unwrap();
    WordStore::new(limits(shards, max_keys), WordPolicy::token_bucket(quota))
}

#[test]
fn borrowed_lookups_find_owned_keys() {
    let store = store(4, usize::MAX);
    assert!(store.check("a", || 0, 1, u64::MAX).unwrap().is_allowed());
    assert!(!store.check("a", || 0, 1, u64::MAX).unwrap().is_allowed());
    assert!(store.peek("b", 0, 1).unwrap().is_allowed());
    assert_eq!(store.len(), 1);
    assert!(store.remove("a", || 0));
    assert!(!store.remove("a", || 0));
    assert_eq!(store.len(), 0);
}

#[test]
fn keys_spread_over_all_shards() {
    let store = store(8, usize::MAX);
    for i in 0..8000 {
        store
            .check(format!("k{i}").as_str(), || 0, 1, u64::MAX)
            .unwrap();
    }
    for len in store.shard_lens() {
        assert!((800..1200).contains(&len), "{len} keys in one shard of 8");
    }
}

#[test]
fn a_full_store_evicts_only_untouched_keys_and_says_when_to_retry() {
    // One shard so the hand sees every key; T = 100ns, burst 1.
    let store = store(1, 2);
    store.check("old", || 0, 1, u64::MAX).unwrap();
    store.check("busy", || 50, 1, u64::MAX).unwrap();
    // At 120, "old" is untouched (full since 100) and "busy" is full at 150.
    assert!(
        store
            .check("new", || 120, 1, u64::MAX)
            .unwrap()
            .is_allowed()
    );
    assert_eq!(store.stats().evicted_untouched, 1);
    let d = store.check("other", || 120, 1, u64::MAX).unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(30)));
    assert_eq!(store.len(), 2);
    assert_eq!(store.stats().refused_new_keys, 1);
    assert!(
        store
            .check("other", || 150, 1, u64::MAX)
            .unwrap()
            .is_allowed()
    );
}

#[test]
fn cached_denies_are_exact_and_invalidated_by_admin_changes() {
    let store = store(2, usize::MAX);
    store.check("k", || 0, 1, u64::MAX).unwrap();
    let first = store.check("k", || 10, 1, u64::MAX).unwrap();
    // Served from the cache: the same instants, seen from a later now.
    let cached = store.check("k", || 30, 1, u64::MAX).unwrap();
    assert_eq!(cached.retry_after(), Some(Duration::from_nanos(70)));
    assert_eq!(
        cached.reset_after(),
        first.reset_after() - Duration::from_nanos(20)
    );
    assert_eq!(cached, store.peek("k", 30, 1).unwrap());
    // At the retry instant the store answers again, and admits.
    assert!(store.check("k", || 100, 1, u64::MAX).unwrap().is_allowed());
    // A reset must not leave a stale deny behind.
    assert!(!store.check("k", || 110, 1, u64::MAX).unwrap().is_allowed());
    store.remove("k", || 0);
    assert!(store.check("k", || 111, 1, u64::MAX).unwrap().is_allowed());
}

#[test]
fn a_quota_change_converts_state_in_the_migration() {
    let Ok(AnyPolicy::Word(policy)) =
        AnyPolicy::new(crate::Algorithm::TokenBucket, "10/s".parse().unwrap(), 0)
    else {
        panic!("word policy")
    };
    let store: WordStore<String> = WordStore::new(limits(2, usize::MAX), policy);
    for _ in 0..5 {
        store.check("k", || 0, 1, u64::MAX).unwrap();
    }
    store
        .set_default_quota("100/s".parse().unwrap(), || 0)
        .unwrap();
    assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 95);
    store.set_key_quota("k".to_owned(), Some(policy), || 0);
    assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 5);
    assert_eq!(store.policy_of("k").quota().limit(), 10);
    assert_eq!(store.policy_of("j").quota().limit(), 100);
    // Back to the default: the key's 5 consumed units carry over.
    store.set_key_quota("k".to_owned(), None, || 0);
    assert_eq!(store.peek("k", 0, 1).unwrap().remaining(), 95);
    assert_eq!(store.policy_of("k").quota().limit(), 100);
}

/// One shard growing to 250,000 keys in use (2M keys over the 8 shards of 2 CPUs):
/// 4× while the table is under 2¹⁴ slots, then 1.25×, so 16 rebuilds in all, and the
/// table ends at least 68% full (0.86 / 1.25).
#[test]
fn growth_takes_few_rebuilds_and_keeps_the_table_full() {
    let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
    let limits = Limits {
        sweep: true,
        ..limits(1, usize::MAX)
    };
    let store: WordStore<u64> = WordStore::new(limits, WordPolicy::token_bucket(quota));
    for key in 0..250_000u64 {
        assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
    }
    let stats = store.stats();
    assert_eq!(stats.keys, 250_000);
    assert!(stats.resizes <= 16, "{stats:?}");
    let capacity = with_guard(|g| store.shards[0].read(g).capacity());
    assert!(
        capacity * 68 <= 250_000 * 100,
        "{capacity} slots for 250,000 keys"
    );
}

/// A table growing with keys all in use skips every rebuild's sweep (none could drop
/// a key: each would read the whole table under the writer mutex for nothing), and
/// sweeps again, dropping the idle keys, once they can go.
#[test]
fn a_growing_table_skips_sweeps_that_could_drop_nothing() {
    let hour = 3_600_000_000_000u64;
    let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
    let limits = Limits {
        sweep: true,
        ..limits(1, usize::MAX)
    };
    let store: WordStore<u64> = WordStore::new(limits, WordPolicy::token_bucket(quota));
    let hand = |f: fn(&mut Hand) -> usize| f(store.shards[0].write().state());
    for key in 0..100_000u64 {
        assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
    }
    let resizes = store.stats().resizes;
    assert!(resizes >= 8, "{resizes} rebuilds");
    assert_eq!(hand(|h| h.full_sweeps), 0);
    assert_eq!(hand(|h| h.skipped_sweeps) as u64, resizes);
    // Three hours later every key has been idle for two periods: the next rebuild
    // sweeps (keys untouched since the previous rebuild go, and that was before their
    // last period), and the one after it drops them all.
    let later = 3 * hour;
    let mut key = 100_000u64;
    while hand(|h| h.full_sweeps) < 2 {
        assert!(
            store
                .check(&key, || later, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        );
        key += 1;
        assert!(key < 400_000, "no sweep in {} inserts", key - 100_000);
    }
    assert!(store.len() < 100_000, "{} keys left", store.len());
    assert!(
        store.stats().evicted_untouched >= 100_000,
        "{:?}",
        store.stats()
    );
    assert_eq!(hand(|h| h.missed), 0);
}

/// Over generated timelines (every algorithm, periods from 1 µs to 10 ms, checks
/// and charges on new and existing keys, quota changes, clock jumps), a rebuild that
/// skips its sweep never keeps a key the sweep would have dropped.
#[test]
fn a_skipped_sweep_never_keeps_a_droppable_key() {
    use crate::Algorithm;
    let algorithms = [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ];
    let mut rng = XorShift::new(0x5eed);
    let (mut skipped, mut swept) = (0, 0);
    for scenario in 0..64u64 {
        let period = 1_000 + rng.next_u64() % 10_000_000;
        // A period its count divides into whole nanoseconds.
        let quota = |rng: &mut XorShift| {
            let count = 1 + rng.next_u64() % 20;
            let interval = ((period / 2 + rng.next_u64() % period) / count).max(1);
            Quota::new(count, Duration::from_nanos(interval * count)).unwrap()
        };
        let algorithm = algorithms[scenario as usize % algorithms.len()];
        let Ok(AnyPolicy::Word(policy)) = AnyPolicy::new(algorithm, quota(&mut rng), 0) else {
            panic!("{algorithm:?} is a word algorithm");
        };
        let limits = Limits {
            sweep: true,
            ..limits(2, usize::MAX)
        };
        let store: WordStore<u64> = WordStore::new(limits, policy);
        // Steps from a hundredth to a hundred-thousandth of a period, and jumps of one
        // to eight periods in 1 in 1,000 or 10,000 steps or none: timelines where keys
        // go idle all the time, and others where a growing set stays in use.
        let (steps, jumps) = [(100, 10), (3_000, 1), (100_000, 0)][scenario as usize % 3];
        let mut now = 0u64;
        let mut next_key = 0u64;
        for _ in 0..20_000 {
            now += match rng.next_u64() % 10_000 {
                draw if draw < jumps => period * (1 + rng.next_u64() % 8),
                draw if draw < 10 * jumps => rng.next_u64() % period,
                _ => rng.next_u64() % (period / steps + 1),
            };
            // New keys, recent ones (a moving set in use) and any older one.
            let key = match rng.next_u64() % 6 {
                _ if next_key == 0 => 0,
                0 | 1 => next_key,
                2..=4 => next_key - 1 - rng.next_u64() % next_key.min(64),
                _ => rng.next_u64() % next_key,
            };
            next_key = next_key.max(key + 1);
            match rng.next_u64() % 1_000 {
                0 => store.set_default_quota(quota(&mut rng), || now).unwrap(),
                1..=50 => {
                    let n = rng.next_u64() % 4;
                    store.settle(&key, now, Settle::Charge(n));
                }
                _ => {
                    let _ = store.check(&key, || now, 1, u64::MAX).unwrap();
                }
            }
        }
        for shard in store.shards.iter() {
            let mut writer = shard.write();
            let hand = writer.state();
            assert_eq!(hand.missed, 0, "scenario {scenario}");
            skipped += hand.skipped_sweeps;
            swept += hand.full_sweeps;
        }
    }
    // Both branches ran.
    assert!(
        skipped > 200 && swept > 200,
        "{skipped} skipped, {swept} swept"
    );
}

/// A store of one shard and no key cap, at 1 an hour with a burst of 1: a key
/// admitted once is denied for the rest of the test.
fn one_shard_hourly() -> WordStore<u64> {
    let quota = Quota::new(1, Duration::from_secs(3600)).unwrap();
    WordStore::new(limits(1, usize::MAX), WordPolicy::token_bucket(quota))
}

/// A growing shard prepares its next table in the last inserts before it is full,
/// and the growth takes it: after the growth no spare is left, and while the table
/// fills far from full none is made.
#[test]
fn a_growing_table_prepares_its_next_one_ahead() {
    let store = one_shard_hourly();
    let shard = &store.shards[0];
    let (mut prepared, mut taken) = (0, 0);
    let mut had_spare = false;
    for key in 0..200_000u64 {
        let before = with_guard(|g| shard.read(g).capacity());
        assert!(store.check(&key, || key, 1, u64::MAX).unwrap().is_allowed());
        let (capacity, spare) = with_guard(|g| {
            let writer = shard.write();
            (writer.target(g).capacity(), writer.has_spare())
        });
        if spare && !had_spare {
            prepared += 1;
            // Only near full: within `capacity / PREPARE_AHEAD` inserts of it.
            let used = store.len();
            assert!(
                used * 50 + before * 50 / PREPARE_AHEAD >= before * 43 - 50,
                "a spare at {used} keys of {before} slots"
            );
        }
        if had_spare && !spare && capacity > before {
            taken += 1;
        }
        had_spare = spare;
    }
    // Growths beyond the first few tables take a prepared table each.
    assert!(
        prepared >= 10 && taken >= 10,
        "{prepared} made, {taken} taken"
    );
    assert!(taken + 1 >= prepared, "{prepared} made, {taken} taken");
}

/// A check that takes the writer path for a key that exists (it met the key in the
/// middle of its move, or another thread inserted it first) decides on it and does
/// none of an insert's work: it does not write ahead the growth's next table (that
/// allocates megabytes, and a check on an existing key allocates nothing), nor move
/// a migration's slots, and does not count as a writer (its collect is then a
/// check's, which never waits); a new key's insert does.
#[test]
fn an_existing_key_on_the_writer_path_does_none_of_an_inserts_work() {
    let store = one_shard_hourly();
    let shard = &store.shards[0];
    let unit = Op::Check {
        cost: 1,
        max_delay: u64::MAX,
    };
    // Keys until the next insert would write ahead the growth's table, and not fill
    // the table too.
    let mut keys = 0u64;
    while !with_guard(|g| {
        let mut writer = shard.write();
        let ahead = writer.table(g).capacity() / PREPARE_AHEAD;
        ahead > 1
            && writer.state().growing
            && !writer.migrating(g)
            && !writer.has_spare()
            && writer.nearly_full(g, ahead)
    }) {
        assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
        keys += 1;
        assert!(keys < 1_000_000, "no growth came near");
    }
    let existing = keys / 2;
    let hash = store.hash(&existing);
    let mut wrote = false;
    let decision = with_guard(|g| store.insert(shard, g, hash, &existing, 0, unit, &mut wrote));
    // Admitted once at 0 with a burst of 1: denied, by its own state.
    assert!(!decision.unwrap().unwrap().is_allowed());
    // No writer's work, so its collect is a check's.
    assert!(!wrote, "a check of an existing key counted as a writer's");
    assert!(
        !shard.write().has_spare(),
        "a check wrote the next table ahead"
    );
    // An insert there writes it ahead.
    assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
    assert!(shard.write().has_spare());

    // While a migration is under way, enough such checks to move all its slots at an
    // insert's step each leave it under way.
    let (store, keys, capacity) = store_migrating_after_inserts();
    let shard = &store.shards[0];
    let existing = keys / 2;
    let hash = store.hash(&existing);
    for _ in 0..capacity / STEP_PER_INSERT as u64 + 1 {
        let mut wrote = false;
        let decision = with_guard(|g| store.insert(shard, g, hash, &existing, 0, unit, &mut wrote));
        assert!(!decision.unwrap().unwrap().is_allowed());
        assert!(!wrote);
    }
    assert!(
        migrating(&store),
        "checks on an existing key moved the migration's slots"
    );
    // A new key's insert does a writer's work (here a step of the migration).
    let mut wrote = false;
    let hash = store.hash(&keys);
    let decision = with_guard(|g| store.insert(shard, g, hash, &keys, 0, unit, &mut wrote));
    assert!(decision.unwrap().unwrap().is_allowed());
    assert!(wrote, "an insert did not count as a writer's");
}

/// A one-shard store (1 an hour, burst 1) given at least 20,000 keys, each admitted
/// once, and then until a migration is under way; with its number of keys and its
/// table's capacity.
fn store_migrating_after_inserts() -> (WordStore<u64>, u64, u64) {
    let store = one_shard_hourly();
    let mut keys = 0u64;
    while keys < 20_000 || !migrating(&store) {
        assert!(store.check(&keys, || 0, 1, u64::MAX).unwrap().is_allowed());
        keys += 1;
    }
    let capacity = with_guard(|g| store.shards[0].read(g).capacity()) as u64;
    (store, keys, capacity)
}

fn migrating(store: &WordStore<u64>) -> bool {
    with_guard(|g| store.shards[0].read(g).next().is_some())
}

/// The `i`-th check of a spread over the `keys` keys of
/// [`store_migrating_after_inserts`]: each was admitted once, so each is denied.
fn check_a_spent_key(store: &WordStore<u64>, keys: u64, i: u64) {
    let key = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % keys;
    assert!(!store.check(&key, || 1, 1, u64::MAX).unwrap().is_allowed());
}

/// A migration that inserts began and then stopped feeding ends through checks on
/// existing keys alone, moved or not: one in `HELP_EVERY` helps with
/// `STEP_PER_INSERT` slots, so about `HELP_EVERY / STEP_PER_INSERT` checks a slot.
/// And the keys keep their state through it.
#[test]
fn checks_alone_finish_a_migration_that_inserts_began() {
    let (store, keys, capacity) = store_migrating_after_inserts();
    let per_slot = u64::from(HELP_EVERY) / STEP_PER_INSERT as u64;
    let mut checks = 0u64;
    while migrating(&store) {
        check_a_spent_key(&store, keys, checks);
        checks += 1;
        assert!(
            checks <= 2 * per_slot * capacity,
            "{checks} checks, and the migration of {capacity} slots runs on"
        );
    }
    assert!(
        checks >= capacity / STEP_PER_INSERT as u64,
        "{checks} checks"
    );
    assert_eq!(store.len(), keys as usize);
}

/// While an operator's path drives migrations (counted in `driving`, as a quota
/// change is), checks leave a migration under way alone however many meet it; once
/// the path ends, they help it to its end again.
#[test]
fn checks_do_not_help_while_an_operator_drives() {
    let (store, keys, capacity) = store_migrating_after_inserts();
    let per_slot = u64::from(HELP_EVERY) / STEP_PER_INSERT as u64;
    {
        let _driving = Driving::new(&store.driving);
        // Three times what finishes it when checks help.
        for i in 0..6 * per_slot * capacity {
            check_a_spent_key(&store, keys, i);
        }
        assert!(migrating(&store), "checks helped while an operator drove");
    }
    let mut checks = 0u64;
    while migrating(&store) {
        check_a_spent_key(&store, keys, checks);
        checks += 1;
        assert!(checks <= 2 * per_slot * capacity, "{checks} checks");
    }
    assert_eq!(store.len(), keys as usize);
}

#[test]
fn a_table_emptied_after_a_flood_shrinks_and_keeps_the_rest() {
    let store = store(1, usize::MAX);
    for i in 0..10_000 {
        store
            .check(format!("k{i}").as_str(), || 0, 1, u64::MAX)
            .unwrap();
    }
    let grown = store.stats().resizes;
    for i in 10..10_000 {
        assert!(store.remove(format!("k{i}").as_str(), || 0));
    }
    assert!(store.stats().resizes > grown, "no shrink");
    let capacity = with_guard(|g| store.shards[0].read(g).capacity());
    assert!(capacity <= 64, "{capacity} slots for 10 keys");
    for i in 0..10 {
        assert!(
            !store
                .check(format!("k{i}").as_str(), || 1, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        );
    }
}
