//! Tables replaced by resizes and quota changes are freed whatever the threads that are
//! not checking do: a thread that checked once and then blocks holds none of them back,
//! a thread stuck inside a check holds back only what was retired meanwhile and only
//! until it finishes, and tollgate never holds back crossbeam-epoch's global collector.
//!
//! Each test counts exactly (`StoreStats::retired_tables`), so each has the process to itself
//! (`super::alone` checks it): no other thread of the process is inside a check while they count.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tollgate::{Quota, RateLimiter};

/// A thread that makes one check on `limiter`, then blocks until the returned sender is
/// dropped: a parked worker, as far as tollgate can tell.
fn idle_thread<K, F>(check_once: F) -> (mpsc::Sender<()>, JoinHandle<()>)
where
    F: FnOnce() -> K + Send + 'static,
    K: Send + 'static,
{
    let (ready_tx, ready_rx) = mpsc::channel();
    let (wake_tx, wake_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let _ = check_once();
        ready_tx.send(()).unwrap();
        let _ = wake_rx.recv();
    });
    ready_rx.recv().unwrap();
    (wake_tx, thread)
}

/// A `u64` limiter at 1,000/s with 8 shards.
fn eight_shards() -> RateLimiter<u64> {
    RateLimiter::builder("1000/s".parse().unwrap())
        .shards(8)
        .build()
        .unwrap()
}

/// The experiment, counted instead of measured in RSS: 200,000 keys, one thread
/// that checked once and then blocks, and 400 default-quota changes (each migrates every
/// shard) with 2,000 checks between them. Before the fix, every table retired after the
/// idle thread's check stayed allocated (8 shards × 400 changes here).
#[test]
fn an_idle_thread_holds_back_no_table_across_400_quota_changes() {
    super::alone();
    let limiter = eight_shards();
    for key in 0..200_000u64 {
        limiter.check(&key);
    }
    let idle = limiter.clone();
    let (wake, thread) = idle_thread(move || idle.check(&1));
    let quotas: [Quota; 2] = ["1000/s".parse().unwrap(), "2000/s".parse().unwrap()];
    let resizes = limiter.stats().resizes;
    for change in 0..400u64 {
        limiter
            .set_default_quota(quotas[(change % 2) as usize])
            .unwrap();
        for i in 0..2_000u64 {
            limiter.check(&((change * 2_000 + i) % 200_000));
        }
        let stats = limiter.stats();
        assert_eq!(
            stats.retired_tables, 0,
            "after change {change}: {stats:?} (the idle thread holds them back)"
        );
    }
    assert_eq!(limiter.stats().resizes - resizes, 400 * 8);
    drop(wake);
    thread.join().unwrap();
}

/// Ten cycles of growing to 200,000 keys (a dozen or more resizes per shard) and removing every
/// key again (shrinks), with an idle thread throughout: after every cycle no retired
/// table is left, and the tables are back to their smallest.
#[test]
fn an_idle_thread_holds_back_nothing_across_grow_and_shrink_cycles() {
    super::alone();
    let limiter = eight_shards();
    let idle = limiter.clone();
    let (wake, thread) = idle_thread(move || idle.check(&u64::MAX));
    limiter.reset(&u64::MAX);
    for cycle in 0..10 {
        let before = limiter.stats().resizes;
        for key in 0..200_000u64 {
            limiter.check(&key);
        }
        for key in 0..200_000u64 {
            limiter.reset(&key);
        }
        let stats = limiter.stats();
        assert_eq!(stats.keys, 0, "cycle {cycle}: {stats:?}");
        assert!(
            stats.resizes - before > 8 * 12,
            "cycle {cycle}: too few resizes to test anything: {stats:?}"
        );
        assert_eq!(stats.retired_tables, 0, "cycle {cycle}: {stats:?}");
    }
    drop(wake);
    thread.join().unwrap();
}

/// Set while a thread should block inside its check (in the key's `Eq`).
static BLOCK: AtomicBool = AtomicBool::new(false);

/// What a blocking comparison tells and waits on.
struct Gate {
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
}

/// A key whose comparison, while [`BLOCK`] is set, says so and blocks the checking thread
/// until released: a check stuck in flight (a preempted thread, in the extreme).
#[derive(Clone)]
struct Stuck {
    id: u64,
    gate: Option<Arc<Mutex<Gate>>>,
}

impl PartialEq for Stuck {
    fn eq(&self, other: &Self) -> bool {
        for gate in [&self.gate, &other.gate].into_iter().flatten() {
            if BLOCK.load(Ordering::Acquire) {
                let gate = gate.lock().unwrap();
                gate.entered.send(()).unwrap();
                let _ = gate.release.recv();
            }
        }
        self.id == other.id
    }
}

impl Eq for Stuck {}

impl Hash for Stuck {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

/// A check in flight holds back exactly the tables retired while it runs, and only until
/// it finishes: the next write path frees them.
#[test]
fn a_check_in_flight_holds_back_what_is_retired_meanwhile_and_only_until_it_ends() {
    super::alone();
    let limiter: RateLimiter<Stuck> = RateLimiter::builder("1000/s".parse().unwrap())
        .shards(1)
        .build()
        .unwrap();
    let plain = |id| Stuck { id, gate: None };
    for id in 0..100 {
        limiter.check(&plain(id));
    }
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let key = Stuck {
        id: 7,
        gate: Some(Arc::new(Mutex::new(Gate {
            entered: entered_tx,
            release: release_rx,
        }))),
    };
    BLOCK.store(true, Ordering::Release);
    let stuck = {
        let limiter = limiter.clone();
        std::thread::spawn(move || limiter.check(&key).is_allowed())
    };
    // The thread is inside its check: its probe compares keys, and blocks there.
    entered.recv().unwrap();
    BLOCK.store(false, Ordering::Release);
    // Two migrations while the check is stuck: both retired tables are held.
    limiter
        .set_default_quota("2000/s".parse().unwrap())
        .unwrap();
    limiter
        .set_default_quota("3000/s".parse().unwrap())
        .unwrap();
    assert_eq!(limiter.stats().retired_tables, 2);
    release.send(()).unwrap();
    assert!(
        stuck.join().unwrap(),
        "the stuck check is admitted once it goes on"
    );
    // Any write path collects (the stuck check's own retry did already): here a new
    // key's insert.
    limiter.check(&plain(1_000));
    assert_eq!(limiter.stats().retired_tables, 0);
}

/// Garbage that other code defers on crossbeam-epoch's global collector is collected
/// while a thread that checked once idles: tollgate holds no crossbeam-epoch guard. (It
/// did: a pinned guard cached per thread between checks stalled the global epoch.)
#[test]
fn crossbeam_epochs_global_collector_is_not_held_back_by_an_idle_checker() {
    super::alone();
    let limiter: RateLimiter<u64> = RateLimiter::new("10/s".parse().unwrap());
    let idle = limiter.clone();
    let (wake, thread) = idle_thread(move || idle.check(&1));
    let collected = Arc::new(AtomicBool::new(false));
    {
        let guard = crossbeam_epoch::pin();
        let flag = Arc::clone(&collected);
        guard.defer(move || flag.store(true, Ordering::Release));
        guard.flush();
    }
    for _ in 0..10_000 {
        if collected.load(Ordering::Acquire) {
            break;
        }
        crossbeam_epoch::pin().flush();
    }
    assert!(
        collected.load(Ordering::Acquire),
        "the deferred function never ran: a thread holds the global epoch back"
    );
    drop(wake);
    thread.join().unwrap();
}
