use super::*;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize as Counter;

static DROPS: Counter = Counter::new(0);

unsafe fn count_drop(ptr: *mut ()) -> bool {
    // SAFETY: made by `Box::into_raw` in `retire_one`.
    drop(unsafe { Box::from_raw(ptr.cast::<u64>()) });
    DROPS.fetch_add(1, Ordering::Relaxed);
    true
}

fn retire_one(guard: &Guard<'_>) {
    let ptr = Box::into_raw(Box::new(7u64)).cast::<()>();
    // SAFETY: never linked anywhere; `count_drop` frees a `Box<u64>`.
    unsafe { guard.retire(ptr, count_drop) };
}

/// A thread holding a guard (a check in flight), from [`hold_a_guard`].
struct Held(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>);

impl Held {
    /// Drops the guard and waits for its thread to end.
    fn release(self) {
        self.0.send(()).unwrap();
        self.1.join().unwrap();
    }
}

/// A thread that holds a guard of `domain` (a check in flight) until
/// [`Held::release`]; returns once the guard is in force.
fn hold_a_guard(domain: &'static Domain) -> Held {
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let record = domain.claim();
        let guard = Guard::enter(domain, record, false);
        held_tx.send(()).unwrap();
        hold_rx.recv().unwrap();
        drop(guard);
        record.claimed.store(false, Ordering::Release);
    });
    held_rx.recv().unwrap();
    Held(hold_tx, holder)
}

/// Retires one object while a guard on another thread is in force: no collect frees
/// it until that guard drops, and then one does.
fn retire_while_held(domain: &'static Domain, me: &Record) {
    let held = hold_a_guard(domain);
    retire_one(&Guard::enter(domain, me, false));
    assert_eq!(domain.collect(), 0);
    assert_eq!(domain.unfreed(), 1);
    held.release();
    assert_eq!(domain.collect(), 1);
}

/// A domain of its own (leaked: guards borrow it for `'static`).
fn domain(membarrier: bool) -> &'static Domain {
    Box::leak(Box::new(Domain::with_barrier(membarrier)))
}

/// Retires `count` objects of `pieces` pieces each, counting their pieces in the
/// returned counter (which they hold: one strong count each until destroyed).
fn retire_in_pieces(domain: &Domain, me: &Record, count: usize, pieces: usize) -> Arc<Counter> {
    let counter = Arc::new(Counter::new(0));
    let guard = Guard::enter(domain, me, false);
    for _ in 0..count {
        InPieces::retire(&guard, pieces, &counter);
    }
    counter
}

/// `decide_barrier` (a store's construction) makes the decision that the first claim
/// of a record would otherwise make (registering for `membarrier`: a wait for an
/// RCU grace period in a process of several threads), and a claim then keeps it.
#[test]
fn the_barrier_is_decided_before_the_first_guard() {
    for allowed in [false, true] {
        let domain = domain(allowed);
        assert!(domain.membarrier.1.get().is_none());
        domain.decide_barrier();
        let decided = *domain.membarrier.1.get().expect("decided");
        assert!(allowed || !decided);
        let record = domain.claim();
        assert_eq!(record.light, decided);
        drop(Guard::enter(domain, record, false));
        assert_eq!(domain.membarrier.1.get(), Some(&decided));
        record.claimed.store(false, Ordering::Release);
    }
}

/// An object destroyed in pieces takes one piece per collect, stays counted as
/// unfreed (so that collects keep coming) until its last, and is destroyed once.
#[test]
fn an_object_destroyed_in_pieces_takes_one_piece_per_collect() {
    let domain = domain(true);
    let me = domain.claim();
    let pieces = retire_in_pieces(domain, me, 1, 3);
    for done in 1..3 {
        assert_eq!(domain.collect(), 0, "piece {done}");
        assert_eq!(pieces.load(Ordering::Relaxed), done);
        assert_eq!(domain.unfreed(), 1);
    }
    assert_eq!(domain.collect(), 1);
    assert_eq!(pieces.load(Ordering::Relaxed), 3);
    assert_eq!(domain.unfreed(), 0);
    assert_eq!(Arc::strong_count(&pieces), 1, "destroyed");
    // Nothing left: a collect calls no destructor.
    assert_eq!(domain.collect_once(), 0);
    assert_eq!(pieces.load(Ordering::Relaxed), 3);
}

/// With nothing parked, `release_parked` (which every operator's drive calls) returns
/// without taking the parking's mutex: here held by this thread, the call on another
/// returns at once.
#[test]
fn release_parked_with_nothing_parked_takes_no_lock() {
    let domain = domain(false);
    let held = sync::lock(&domain.parked);
    let (returned_tx, returned) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        domain.release_parked();
        returned_tx.send(()).unwrap();
    });
    let returned = returned.recv_timeout(std::time::Duration::from_secs(5));
    drop(held);
    caller.join().unwrap();
    assert!(
        returned.is_ok(),
        "release_parked waited for the parking's mutex with nothing parked"
    );
}

/// Where the parking is full, the object beyond it is destroyed whole by the collect
/// that finds it; an operator's `release_parked` destroys the parked ones to their
/// end. Every object's pieces are all destroyed, each once.
#[test]
fn a_full_parking_destroys_the_rest_whole_and_release_parked_ends_them_all() {
    let domain = domain(true);
    let me = domain.claim();
    let pieces = retire_in_pieces(domain, me, PARKED + 1, 3);
    // One first piece each, and the whole of the one that found no room.
    assert_eq!(domain.collect(), 1);
    assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 3);
    assert_eq!(domain.unfreed(), PARKED);
    // A check's collect takes no piece; a writer's takes one (of one parked object).
    assert_eq!(domain.collect_once(), 0);
    assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 3);
    assert_eq!(domain.collect(), 0);
    assert_eq!(pieces.load(Ordering::Relaxed), PARKED + 4);
    domain.release_parked();
    assert_eq!(domain.unfreed(), 0);
    assert_eq!(pieces.load(Ordering::Relaxed), 3 * (PARKED + 1));
    assert_eq!(Arc::strong_count(&pieces), 1, "all destroyed");
}

#[test]
fn garbage_waits_for_guards_in_force_and_not_for_idle_threads() {
    for asymmetric in [false, true] {
        let domain = domain(asymmetric);
        // A thread that took a guard once and now blocks: it holds nothing back.
        let (idle_tx, idle_rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let idle = std::thread::spawn(move || {
            let record = domain.claim();
            drop(Guard::enter(domain, record, false));
            ready_tx.send(()).unwrap();
            idle_rx.recv().unwrap();
            record.claimed.store(false, Ordering::Release);
        });
        ready_rx.recv().unwrap();
        let me = domain.claim();
        let before = DROPS.load(Ordering::Relaxed);
        {
            let guard = Guard::enter(domain, me, false);
            retire_one(&guard);
            // Held back by this thread's own guard.
            assert_eq!(domain.collect(), 0);
            assert_eq!(domain.unfreed(), 1);
        }
        assert_eq!(domain.collect(), 1);
        assert_eq!(domain.unfreed(), 0);
        assert!(DROPS.load(Ordering::Relaxed) > before);

        // A guard in force on another thread holds back what is retired meanwhile,
        // and only until it drops.
        retire_while_held(domain, me);
        idle_tx.send(()).unwrap();
        idle.join().unwrap();
    }
}

/// While a guard in force on another thread holds the garbage (a check preempted
/// in flight), collects pass no heavy barrier, however many run; once it drops, one
/// `collect_once` (a single read of the records) frees the garbage.
#[test]
fn collects_pass_no_barrier_while_a_guard_holds_the_garbage() {
    for asymmetric in [false, true] {
        let domain = domain(asymmetric);
        let me = domain.claim();
        let held = hold_a_guard(domain);
        retire_one(&Guard::enter(domain, me, false));
        let before = domain.barriers.load(Ordering::Relaxed);
        for _ in 0..100 {
            assert_eq!(domain.collect_once(), 0);
        }
        assert_eq!(domain.collect(), 0);
        assert_eq!(domain.unfreed(), 1);
        assert_eq!(
            domain.barriers.load(Ordering::Relaxed),
            before,
            "a collect passed the heavy barrier while a guard held the garbage"
        );
        held.release();
        assert_eq!(domain.collect_once(), 1);
        assert_eq!(domain.unfreed(), 0);
        assert_eq!(domain.barriers.load(Ordering::Relaxed), before + 1);
        // With nothing retired, no barrier either.
        assert_eq!(domain.collect_once(), 0);
        assert_eq!(domain.barriers.load(Ordering::Relaxed), before + 1);
        me.claimed.store(false, Ordering::Release);
    }
}

/// The garbage list's buffer, as an address (0 while it has none).
fn buffer(domain: &Domain) -> usize {
    let garbage = sync::lock(&domain.garbage);
    if garbage.list.capacity() == 0 {
        0
    } else {
        garbage.list.as_ptr() as usize
    }
}

/// Once the garbage list has grown, retiring and collecting reuse its buffer: no
/// collect allocates, whether it frees everything, nothing (a guard in force holds
/// the garbage) or a part. The same buffer, by address, over hundreds of rounds.
#[test]
fn retires_and_collects_reuse_the_garbage_list() {
    let domain = domain(true);
    let me = domain.claim();
    // Grown once: room for the 8 objects the rounds keep pending.
    let held = hold_a_guard(domain);
    for _ in 0..8 {
        retire_one(&Guard::enter(domain, me, false));
    }
    assert_eq!(domain.collect(), 0);
    held.release();
    assert_eq!(domain.collect(), 8);
    let grown = buffer(domain);
    assert_ne!(grown, 0);
    let before = DROPS.load(Ordering::Relaxed);
    for round in 0..300 {
        match round % 3 {
            // Freed at once.
            0 => {
                retire_one(&Guard::enter(domain, me, false));
                assert_eq!(domain.collect_once(), 1);
            }
            // Held back, then freed.
            1 => retire_while_held(domain, me),
            // A part freed: what was retired before a guard was taken goes, what
            // came after stays until it drops.
            _ => {
                retire_one(&Guard::enter(domain, me, false));
                let held = hold_a_guard(domain);
                retire_one(&Guard::enter(domain, me, false));
                assert_eq!(domain.collect(), 1);
                assert_eq!(domain.unfreed(), 1);
                held.release();
                assert_eq!(domain.collect(), 1);
            }
        }
        assert_eq!(
            buffer(domain),
            grown,
            "round {round}: the list's buffer changed (an allocation)"
        );
    }
    assert_eq!(domain.unfreed(), 0);
    assert!(DROPS.load(Ordering::Relaxed) >= before + 400);
    me.claimed.store(false, Ordering::Release);
}

thread_local! {
    /// Where [`retire_two_on_drop`] retires: a domain and this thread's record in it.
    static NESTED: Cell<Option<(&'static Domain, &'static Record)>> =
        const { Cell::new(None) };
    /// The garbage list's buffer right after [`retire_two_on_drop`] retired.
    static AFTER: Cell<usize> = const { Cell::new(0) };
}

/// A destructor that retires two more objects (what a retire on another thread
/// does while a collect runs), then notes the list's buffer.
unsafe fn retire_two_on_drop(ptr: *mut ()) -> bool {
    // SAFETY: as for `count_drop`: made by `Box::into_raw` in the test.
    unsafe { count_drop(ptr) };
    let (domain, me) = NESTED.get().expect("set by the test");
    let guard = Guard::enter(domain, me, false);
    retire_one(&guard);
    retire_one(&guard);
    drop(guard);
    AFTER.set(buffer(domain));
    true
}

/// A retire while a collect runs never makes the collect allocate: after the collect
/// the list's buffer is the one the retire left. One object is free to go, and its
/// destructor retires two more; seven others are held by a guard in force, so the
/// collect keeps them. Collects that took the list out put those seven back onto
/// the list the retire had just started (4 slots), and that outgrew it: a new buffer,
/// allocated by the collect, on a check's path too (`collect_once`).
#[test]
fn a_retire_while_a_collect_runs_leaves_the_collect_nothing_to_allocate() {
    for collect in [Domain::collect_once, Domain::collect] {
        let domain = domain(true);
        let me = domain.claim();
        NESTED.set(Some((domain, me)));
        let first = Box::into_raw(Box::new(7u64)).cast::<()>();
        // SAFETY: never linked anywhere; `retire_two_on_drop` frees a `Box<u64>`.
        unsafe { Guard::enter(domain, me, false).retire(first, retire_two_on_drop) };
        let held = hold_a_guard(domain);
        for _ in 0..7 {
            retire_one(&Guard::enter(domain, me, false));
        }
        assert_eq!(collect(domain), 1);
        assert_eq!(domain.unfreed(), 9);
        assert_eq!(
            buffer(domain),
            AFTER.get(),
            "the collect put a list back and allocated"
        );
        held.release();
        assert_eq!(domain.collect(), 9);
        assert_eq!(domain.unfreed(), 0);
        NESTED.set(None);
        me.claimed.store(false, Ordering::Release);
    }
}

#[test]
fn nested_guards_keep_the_outer_mark_and_records_are_reused() {
    let domain = domain(true);
    let record = domain.claim();
    let outer = Guard::enter(domain, record, false);
    let mark = record.state.load(Ordering::Relaxed);
    assert_ne!(mark, QUIESCENT);
    {
        let inner = Guard::enter(domain, record, false);
        retire_one(&inner);
    }
    // The inner guard did not clear the outer one's mark.
    assert_eq!(record.state.load(Ordering::Relaxed), mark);
    assert_eq!(domain.collect(), 0);
    drop(outer);
    assert_eq!(record.state.load(Ordering::Relaxed), QUIESCENT);
    assert_eq!(domain.collect(), 1);
    // A record given back is claimed again rather than a new one made.
    record.claimed.store(false, Ordering::Release);
    assert!(ptr::eq(domain.claim(), record));
    assert_eq!(records(domain), 1);
}

fn records(domain: &Domain) -> usize {
    let mut count = 0;
    let mut at = domain.head.load(Ordering::Acquire).cast_const();
    while !at.is_null() {
        count += 1;
        // SAFETY: as in `Domain::claim`.
        at = unsafe { (*at).next };
    }
    count
}

#[test]
fn threads_give_their_records_back_when_they_exit() {
    let before = records(global());
    for _ in 0..200 {
        std::thread::spawn(|| drop(pin())).join().unwrap();
    }
    // Other tests' threads may claim records meanwhile, but far fewer than 200.
    let grown = records(global()) - before;
    assert!(
        grown < 100,
        "{grown} records for 200 threads run one after another"
    );
}
