use super::reclaim::{Domain, InPieces};
use super::*;
use loom::sync::Arc;
use loom::sync::atomic::AtomicBool;
use loom::thread;

type Shard = EpochTable<u64, u64, ()>;

/// Runs `f` under loom with every interleaving of up to `LOOM_MAX_PREEMPTIONS` (default 2)
/// preemptions per thread, as loom recommends for models of this size.
fn model(f: impl Fn() + Sync + Send + 'static) {
    check_with(|set| set.unwrap_or(2), f);
}

/// [`model`] with at most `preemptions` per thread whatever `LOOM_MAX_PREEMPTIONS`
/// says: for a model of three threads, whose interleavings grow much faster.
fn model_within(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    check_with(|set| set.map_or(preemptions, |set| set.min(preemptions)), f);
}

/// Runs `f` under loom with the preemption bound `bound` makes of the one
/// `LOOM_MAX_PREEMPTIONS` sets, if any.
fn check_with(bound: impl FnOnce(Option<usize>) -> usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound(builder.preemption_bound));
    builder.check(f);
}

/// A shard, and the domain its tables are retired to.
fn setup() -> (Arc<Shard>, Arc<Domain>) {
    (Arc::new(EpochTable::new(4, 0, ())), Arc::new(Domain::new()))
}

/// Runs `f` on a new loom thread, with the shard and the domain.
fn spawn<T: Send + 'static>(
    shard: &Arc<Shard>,
    domain: &Arc<Domain>,
    f: impl FnOnce(&Shard, &Domain) -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let (shard, domain) = (Arc::clone(shard), Arc::clone(domain));
    thread::spawn(move || f(&shard, &domain))
}

/// A check as the store runs it: locate the key (reading through a migration), add
/// `by` to its state by CAS, looking again if it froze meanwhile and waiting for the
/// writer if it is in the middle of its move; `false` if the key is absent or was
/// removed.
fn add(shard: &Shard, domain: &Domain, key: u64, by: u64) -> bool {
    change(shard, domain, key, |state| state + by)
}

/// [`add`], of any change to a word of any width.
fn change<A: Atom>(
    shard: &EpochTable<u64, u64, (), A>,
    domain: &Domain,
    key: u64,
    by: impl Fn(A::Value) -> A::Value,
) -> bool {
    let handle = domain.register();
    loop {
        let guard = handle.pin();
        let (slot, mut word) = match shard.read(&guard).locate(key, |k| *k == key) {
            Located::Found { slot, raw, .. } => (slot, Word::from_raw::<A>(raw)),
            Located::Absent { .. } => return false,
            Located::Moving => {
                drop(guard);
                shard.wait_for_writer();
                continue;
            }
        };
        loop {
            match word {
                Word::Live(state) => match slot.update(state, by(state)) {
                    Ok(()) => return true,
                    Err(actual) => word = Word::from_raw::<A>(actual),
                },
                Word::Removed => return false,
                Word::Frozen => break,
            }
        }
    }
}

fn state_of<A: Atom>(
    shard: &EpochTable<u64, u64, (), A>,
    domain: &Domain,
    key: u64,
) -> Option<A::Value> {
    let handle = domain.register();
    let guard = handle.pin();
    match shard.read(&guard).locate(key, |k| *k == key) {
        Located::Found { raw, .. } => Some(raw),
        Located::Absent { .. } => None,
        Located::Moving => panic!("a key half moved after every thread joined"),
    }
}

fn insert(shard: &Shard, domain: &Domain, key: u64) {
    insert_with(shard, domain, key, 0);
}

fn insert_with<A: Atom>(
    shard: &EpochTable<u64, u64, (), A>,
    domain: &Domain,
    key: u64,
    state: A::Value,
) {
    let handle = domain.register();
    let guard = handle.pin();
    shard.write().insert(&guard, key, key, state).ok().unwrap();
}

/// A whole migration, as an operator's path runs it: begun, then moved a slot at a
/// time, each under its own hold of the writer mutex and its own guard, with a
/// collect after the last.
fn migrate<A: Atom>(
    shard: &EpochTable<u64, u64, (), A>,
    domain: &Domain,
    capacity: usize,
    meta: u64,
) where
    u64: Carry<u64, A::Value>,
{
    let handle = domain.register();
    {
        let guard = handle.pin();
        let live = 1;
        shard
            .write()
            .begin_migration(&guard, capacity, live, meta, |k| *k, 0);
    }
    loop {
        let guard = handle.pin();
        if shard.write().step(&guard, 1, |k| *k, 0) {
            break;
        }
    }
    domain.collect();
}

/// A check races a migration (and a check after it): no admission is lost, and
/// each lands exactly once.
#[test]
fn loom_checks_racing_a_migration_lose_no_update() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 1);
        let check = spawn(&shard, &domain, |shard, domain| {
            assert!(add(shard, domain, 1, 10));
            // A check's own collect (it retired nothing), racing the writer's.
            domain.collect_once();
        });
        migrate(&shard, &domain, 8, 1);
        assert!(add(&shard, &domain, 1, 1));
        check.join().unwrap();
        assert_eq!(state_of(&shard, &domain, 1), Some(11));
        let handle = domain.register();
        assert_eq!(shard.read(&handle.pin()).meta, 1);
    });
}

/// A check of a key held to two quotas (both states in one 16-byte word) races a
/// migration and another check: both halves of each check land together and once,
/// and the migration freezes and moves them together.
#[test]
fn loom_a_pair_check_racing_a_migration_lands_both_halves_once() {
    model(|| {
        let shard: Arc<EpochTable<u64, u64, (), AtomicPair>> = Arc::new(EpochTable::new(4, 0, ()));
        let domain = Arc::new(Domain::new());
        insert_with(&shard, &domain, 1, [0, 0]);
        let check = {
            let (shard, domain) = (Arc::clone(&shard), Arc::clone(&domain));
            thread::spawn(move || {
                assert!(change(&shard, &domain, 1, |[a, b]| [a + 10, b + 20]));
            })
        };
        migrate(&shard, &domain, 8, 1);
        assert!(change(&shard, &domain, 1, |[a, b]| [a + 1, b + 2]));
        check.join().unwrap();
        assert_eq!(state_of(&shard, &domain, 1), Some([11, 22]));
    });
}

/// A check races a migration moving one slot at a time, during which a key is
/// inserted (into the new table) and checked (read through the old one): the check
/// lands once, in whichever table holds the key then, and nothing is lost.
#[test]
fn loom_a_check_racing_an_incremental_migration_lands_once() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 1);
        let check = spawn(&shard, &domain, |shard, domain| {
            assert!(add(shard, domain, 1, 10));
        });
        let handle = domain.register();
        {
            let guard = handle.pin();
            let mut writer = shard.write();
            writer.begin_migration(&guard, 8, 1, 1, |k| *k, 0);
            writer.insert(&guard, 2, 2, 5).ok().unwrap();
        }
        assert!(add(&shard, &domain, 2, 1));
        loop {
            let guard = handle.pin();
            if shard.write().step(&guard, 1, |k| *k, 0) {
                break;
            }
        }
        drop(handle);
        domain.collect();
        check.join().unwrap();
        assert_eq!(state_of(&shard, &domain, 1), Some(10));
        assert_eq!(state_of(&shard, &domain, 2), Some(6));
    });
}

/// A reader probing while the writer inserts the key finds it complete or not at
/// all, never half-written (loom checks the key bytes' accesses).
#[test]
fn loom_an_insert_is_published_whole() {
    model(|| {
        let (shard, domain) = setup();
        let reader = spawn(&shard, &domain, |shard, domain| {
            let handle = domain.register();
            let guard = handle.pin();
            let table = shard.read(&guard);
            if let Some((slot, word)) = table.find(5, |k| *k == 5) {
                assert_eq!(word, Word::Live(0));
                assert_eq!(slot.with_key(|k| *k), Some(5));
            }
        });
        insert(&shard, &domain, 5);
        reader.join().unwrap();
        assert_eq!(state_of(&shard, &domain, 5), Some(0));
    });
}

/// A check racing a removal either lands before it or sees the key removed.
#[test]
fn loom_a_check_racing_a_removal_sees_it() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 2);
        let check = spawn(&shard, &domain, |shard, domain| add(shard, domain, 2, 1));
        let handle = domain.register();
        let guard = handle.pin();
        let before = {
            let mut writer = shard.write();
            let Located::Found { slot, .. } = writer.table(&guard).locate(2, |k| *k == 2) else {
                panic!("the key is there")
            };
            writer.remove(slot).unwrap()
        };
        drop(guard);
        let admitted = check.join().unwrap();
        // Admitted before the removal, or found it removed: never both, never neither.
        assert_eq!(admitted, before == 1);
        assert_eq!(state_of(&shard, &domain, 2), None);
    });
}

/// A reader's borrow of the current table: under a guard, finds `key` and reads it
/// in its slot, then drops the guard and gives its record back.
fn read_through_a_guard(shard: &Shard, domain: &Domain, key: u64) {
    let handle = domain.register();
    let guard = handle.pin();
    let table = shard.read(&guard);
    let (slot, _) = table.find(key, |k| *k == key).unwrap();
    assert_eq!(slot.with_key(|k| *k), Some(key));
}

/// Two migrations, each followed by a collect, while a reader holds the first table:
/// the reader's borrowed table and keys stay valid until its guard drops (the
/// canary and the key cells tell loom of any table freed early), and its check lands
/// in the newest table.
#[test]
fn loom_a_reader_outlives_two_migrations() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 3);
        let reader = spawn(&shard, &domain, |shard, domain| {
            read_through_a_guard(shard, domain, 3);
            assert!(add(shard, domain, 3, 4));
        });
        migrate(&shard, &domain, 4, 1);
        migrate(&shard, &domain, 16, 2);
        reader.join().unwrap();
        assert_eq!(state_of(&shard, &domain, 3), Some(4));
        // Every reader is done: the last collect frees both retired tables.
        domain.collect();
        assert_eq!(shard.retired_unfreed(), 0);
    });
}

/// A reader holds a table that a migration retires while checks' collects
/// (`collect_once`, which frees in place) run on both threads, beside the writer's
/// own: none frees the table while the reader's guard is in force (the canary and
/// the key cells tell loom), and once the reader is done a check's collect frees it.
#[test]
fn loom_a_checks_collect_frees_only_what_no_reader_holds() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 3);
        let reader = spawn(&shard, &domain, |shard, domain| {
            read_through_a_guard(shard, domain, 3);
            domain.collect_once();
        });
        migrate(&shard, &domain, 8, 1);
        domain.collect_once();
        reader.join().unwrap();
        domain.collect_once();
        assert_eq!(shard.retired_unfreed(), 0);
    });
}

/// Frees the `Box<u64>` that [`loom_a_collect_frees_nothing_retired_after_it_read_the_list`]
/// retires.
///
/// # Safety
/// `ptr` is from `Box::into_raw` of a `Box<u64>`, freed once.
unsafe fn free_a_u64(ptr: *mut ()) -> bool {
    // SAFETY: the caller's contract.
    drop(unsafe { Box::from_raw(ptr.cast::<u64>()) });
    true
}

/// A collect frees only what was retired before it read the garbage list, whatever
/// its later read of the records says: a check's collect reads the list (pending
/// garbage), passes the barrier and reads the records while a reader has not yet
/// taken its guard; the reader then borrows the table, which a migration unlinks and
/// retires. The records the collect read said no guard was in force, but the table
/// retired after its read of the list is held, and stays until a later collect (the
/// canary and the key cells tell loom of a table freed early). This is the collect's
/// cap at the newest tag it read: without it (`free_up_to(oldest_active, last)`)
/// this model fails and every other passes. Three threads, so at most 2 preemptions
/// each (14 s; 200 s with 3).
#[test]
fn loom_a_collect_frees_nothing_retired_after_it_read_the_list() {
    model_within(2, || {
        let (shard, domain) = setup();
        insert(&shard, &domain, 3);
        {
            // Garbage pending before the threads start, so that the collect below
            // reads a list that is not empty, and goes on to the records.
            let handle = domain.register();
            let guard = handle.pin();
            let ptr = Box::into_raw(Box::new(7u64)).cast::<()>();
            // SAFETY: never linked anywhere, retired once; `free_a_u64` frees a
            // `Box<u64>`.
            unsafe { guard.retire(ptr, free_a_u64) };
        }
        let collector = spawn(&shard, &domain, |_, domain| {
            domain.collect_once();
        });
        let reader = spawn(&shard, &domain, |shard, domain| {
            read_through_a_guard(shard, domain, 3);
        });
        migrate(&shard, &domain, 8, 1);
        collector.join().unwrap();
        reader.join().unwrap();
        domain.collect();
        assert_eq!(shard.retired_unfreed(), 0);
        assert_eq!(domain.unfreed(), 0);
    });
}

/// Collects that run at once never destroy a piece of a parked object together, nor
/// one after its last: two threads collect while the main one does, and an
/// operator's `release_parked` ends what is left. The object's three pieces are three
/// calls in every interleaving, and the domain counts nothing unfreed after.
#[test]
fn loom_concurrent_collects_destroy_each_piece_once() {
    model(|| {
        let (shard, domain) = setup();
        let calls = Arc::new(AtomicUsize::new(0));
        {
            let handle = domain.register();
            let guard = handle.pin();
            InPieces::retire(&guard, 3, &calls);
        }
        let collectors: Vec<_> = (0..2)
            .map(|_| {
                spawn(&shard, &domain, |_, domain| {
                    domain.collect();
                })
            })
            .collect();
        domain.collect();
        for collector in collectors {
            collector.join().unwrap();
        }
        domain.release_parked();
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        assert_eq!(domain.unfreed(), 0);
    });
}

/// A thread that took a guard once and then idles, holding its record, never holds
/// back a table retired after its guard dropped: the collect right after the
/// migration frees it, in every interleaving.
#[test]
fn loom_an_idle_thread_holds_nothing_back() {
    model(|| {
        let (shard, domain) = setup();
        insert(&shard, &domain, 6);
        let idle = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (idle, stop) = (Arc::clone(&idle), Arc::clone(&stop));
            spawn(&shard, &domain, move |shard, domain| {
                let handle = domain.register();
                {
                    let guard = handle.pin();
                    assert!(shard.read(&guard).find(6, |k| *k == 6).is_some());
                }
                idle.store(true, Ordering::Release);
                // Idle, with the record still claimed, until told to stop.
                while !stop.load(Ordering::Acquire) {
                    thread::yield_now();
                }
            })
        };
        while !idle.load(Ordering::Acquire) {
            thread::yield_now();
        }
        migrate(&shard, &domain, 8, 1);
        assert_eq!(shard.retired_unfreed(), 0);
        stop.store(true, Ordering::Release);
        reader.join().unwrap();
    });
}
