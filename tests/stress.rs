//! The lock-free store under stress: threads check, remove and flood keys of tiny tables
//! that resize, shrink, compact and migrate (per-key quota changes) all the time, and
//! every decision is compared with a reference model of the token bucket. Also for a key
//! held to two quotas, whose two states share one 16-byte word.
//!
//! Time moves in phases: all threads work at one instant, then wait while it advances.
//! Within a phase the sweep that drops untouched keys changes no decision, so the model is
//! exact; with `max_keys`, live keys are evicted too, and a decision may then be that of a
//! fresh key — accepted only as often as the store counts active evictions.
//!
//! `TOLLGATE_STRESS_PHASES` scales the run (`scripts/test.sh` runs it under valgrind with
//! a small value).

// Not built for the loom models (`--cfg tollgate_loom`), whose tables are not `Sync`
// outside a model and whose dev-dependencies are not there.
#![cfg(not(tollgate_loom))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use tollgate::clock::{Clock, ManualClock};
use tollgate::{Decision, Quota, RateLimiter, WhenFull};

/// The token bucket as governor defines it, written independently of tollgate's.
#[derive(Clone, Copy)]
struct Reference {
    t: u64,
    tau: u64,
}

/// What the reference decides: allowed, remaining, reset after, retry after, next TAT.
type Expected = (bool, u64, u64, Option<u64>, u64);

impl Reference {
    fn new(quota: Quota) -> Self {
        let t = quota.period().as_nanos() as u64 / quota.limit();
        Self {
            t,
            tau: t * (quota.burst() - 1),
        }
    }

    fn remaining(&self, tat: u64, now: u64) -> u64 {
        (self.tau + self.t).saturating_sub(tat.saturating_sub(now)) / self.t
    }

    fn decide(&self, tat: u64, now: u64, cost: u64) -> Expected {
        let earliest = (tat + self.t * (cost - 1)).saturating_sub(self.tau);
        if now < earliest {
            return (
                false,
                self.remaining(tat, now),
                tat.saturating_sub(now),
                Some(earliest - now),
                tat,
            );
        }
        let next = tat.max(now) + self.t * cost;
        (true, self.remaining(next, now), next - now, None, next)
    }
}

/// A limiter's quotas, decided all or nothing as `Builder::also` promises: admitted if
/// every quota admits, then the tightest admission (fewest left, then the longest reset,
/// the first on a tie); else the first quota that denies, or a later one that waits
/// longer, with the fewest units any quota has left. What the reference decides, with
/// every quota's next TAT.
#[derive(Clone)]
struct Quotas(Vec<Reference>);

impl Quotas {
    fn decide(&self, tats: &[u64], now: u64, cost: u64) -> (Expected, Vec<u64>) {
        let each: Vec<Expected> = self
            .0
            .iter()
            .zip(tats)
            .map(|(r, &tat)| r.decide(tat, now, cost))
            .collect();
        let nexts = each.iter().map(|e| e.4).collect();
        let mut pick = each[0];
        if each.iter().all(|e| e.0) {
            for e in &each[1..] {
                if (e.1, std::cmp::Reverse(e.2)) < (pick.1, std::cmp::Reverse(pick.2)) {
                    pick = *e;
                }
            }
            return (pick, nexts);
        }
        let first = each.iter().position(|e| !e.0).expect("one denies");
        pick = each[first];
        for e in &each[first + 1..] {
            if !e.0 && e.3 > pick.3 {
                pick = *e;
            }
        }
        // Nothing consumed: each quota's units as they stand.
        let fewest = self
            .0
            .iter()
            .zip(tats)
            .map(|(r, &tat)| r.remaining(tat, now))
            .min()
            .expect("one quota");
        ((false, fewest, pick.2, pick.3, pick.4), nexts)
    }

    /// What a peek of one unit says: admitted, or the longest wait of those that deny.
    fn peek(&self, tats: &[u64], now: u64) -> (bool, Option<u64>) {
        let each = self
            .0
            .iter()
            .zip(tats)
            .map(|(r, &tat)| r.decide(tat, now, 1));
        let retry = each.filter(|e| !e.0).filter_map(|e| e.3).max();
        (retry.is_none(), retry)
    }
}

fn observed(d: &Decision) -> (bool, u64, u64, Option<u64>) {
    (
        d.is_allowed(),
        d.remaining(),
        d.reset_after().as_nanos() as u64,
        d.retry_after().map(|r| r.as_nanos() as u64),
    )
}

/// One thread's keys and their reference states (one TAT per quota).
struct Model {
    reference: Quotas,
    tats: HashMap<u64, Vec<u64>>,
    /// Decisions accepted as those of a fresh key after an active eviction.
    resets: u64,
}

impl Model {
    /// Checks that the store's decision for `key` is the reference's, or (if `lossy`) a
    /// fresh key's; updates the reference.
    fn expect(&mut self, key: u64, now: u64, cost: u64, got: &Decision, lossy: bool, what: &str) {
        let untouched = vec![0; self.reference.0.len()];
        let tat = self
            .tats
            .get(&key)
            .cloned()
            .unwrap_or_else(|| untouched.clone());
        let ((allowed, remaining, reset, retry, _), next) = self.reference.decide(&tat, now, cost);
        if observed(got) == (allowed, remaining, reset, retry) {
            if allowed {
                self.tats.insert(key, next);
            }
            return;
        }
        let (fresh, fresh_next) = self.reference.decide(&untouched, now, cost);
        let refused = lossy && got.is_capacity_deny();
        assert!(
            lossy && (refused || observed(got) == (fresh.0, fresh.1, fresh.2, fresh.3)),
            "{what} of key {key} at {now}: got {got:?}, expected allowed={allowed} \
             remaining={remaining} reset={reset} retry={retry:?} (state {tat:?})"
        );
        self.resets += 1;
        if refused {
            self.tats.remove(&key);
        } else if fresh.0 {
            self.tats.insert(key, fresh_next);
        } else {
            self.tats.remove(&key);
        }
    }
}

/// Xorshift64.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

struct Scale {
    phases: u64,
    ops: u64,
}

fn scale() -> Scale {
    let phases = std::env::var("TOLLGATE_STRESS_PHASES")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(4_000);
    Scale { phases, ops: 60 }
}

/// Runs `checkers` threads on 24 keys each, a flood thread cycling through 3,000 keys
/// (inserting and removing them) and an admin thread changing one key's quota (which
/// migrates its shard), for `scale.phases` phases. Returns (operations, resizes,
/// accepted resets, active evictions).
fn run(
    limiter: &RateLimiter<u64, ManualClock>,
    lossy: bool,
    scale: &Scale,
) -> (u64, u64, u64, u64) {
    const CHECKERS: u64 = 3;
    let quota = limiter.quota();
    let quotas = limiter.quotas();
    let reference = Quotas(quotas.iter().map(|&q| Reference::new(q)).collect());
    let period = reference.0[0].t;
    let start = Barrier::new(CHECKERS as usize + 3);
    let done = Barrier::new(CHECKERS as usize + 3);
    let ops = AtomicU64::new(0);
    let resets = AtomicU64::new(0);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // Checkers (0..CHECKERS) and the flood thread (CHECKERS).
        for thread in 0..=CHECKERS {
            let (start, done, ops, resets) = (&start, &done, &ops, &resets);
            let (failure, failed) = (&failure, &failed);
            let reference = reference.clone();
            s.spawn(move || {
                let flood = thread == CHECKERS;
                let mut model = Model {
                    reference: reference.clone(),
                    tats: HashMap::new(),
                    resets: 0,
                };
                let mut x = 0x2545_f491_4f6c_dd1d ^ ((thread + 1) * 0x9e37_79b9);
                let base = thread * 100_000;
                let span = if flood { 3_000 } else { 24 };
                for _ in 0..scale.phases {
                    start.wait();
                    let now = limiter.clock().now_ns();
                    // A failed assertion is recorded and the thread stops working but
                    // keeps meeting the barriers, so the test fails rather than hangs.
                    if failed.load(Ordering::Relaxed) {
                        done.wait();
                        continue;
                    }
                    let phase = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        for _ in 0..scale.ops {
                            let r = next(&mut x);
                            let key = base + r % span;
                            match (r >> 32) % 10 {
                                0 => {
                                    limiter.reset(&key);
                                    model.tats.remove(&key);
                                }
                                1 => {
                                    let d = limiter.check_n(&key, 2).expect("burst 3");
                                    model.expect(key, now, 2, &d, lossy, "check_n");
                                }
                                2 => {
                                    let d = limiter.peek(&key);
                                    let untouched = vec![0; reference.0.len()];
                                    let tat = model.tats.get(&key).unwrap_or(&untouched);
                                    // With evictions the key may have been reset meanwhile.
                                    if !lossy {
                                        // A peek consumes nothing: compare verdict and retry.
                                        assert_eq!(
                                            (
                                                d.is_allowed(),
                                                d.retry_after().map(|r| r.as_nanos() as u64)
                                            ),
                                            reference.peek(tat, now),
                                            "peek of key {key} at {now}"
                                        );
                                    }
                                }
                                _ => {
                                    let d = limiter.check(&key);
                                    model.expect(key, now, 1, &d, lossy, "check");
                                }
                            }
                            if flood && r % 3 == 0 {
                                // Remove what was just inserted most of the time: the table
                                // grows, fills with removed slots, compacts and shrinks.
                                limiter.reset(&key);
                                model.tats.remove(&key);
                            }
                        }
                    }));
                    if let Err(panic) = phase {
                        let message = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|m| m.to_string()))
                            .unwrap_or_default();
                        failure.lock().unwrap().get_or_insert(message);
                        failed.store(true, Ordering::Relaxed);
                    }
                    ops.fetch_add(scale.ops, Ordering::Relaxed);
                    done.wait();
                }
                resets.fetch_add(model.resets, Ordering::Relaxed);
            });
        }
        // The admin thread: gives one key its own quota and takes it back, migrating the
        // key's shard each time, while the others check.
        {
            let (start, done, failure) = (&start, &done, &failure);
            s.spawn(move || {
                let own: Quota = "7/s burst 3".parse().expect("valid quota");
                let key = 999_999u64;
                for phase in 0..scale.phases {
                    start.wait();
                    let expected = if phase % 2 == 0 {
                        limiter.set_quota(&key, own).expect("same algorithm");
                        own
                    } else {
                        limiter.remove_quota(&key);
                        quota
                    };
                    if limiter.quota_for(&key) != expected || limiter.quota_for(&(key + 1)) != quota
                    {
                        *failure.lock().unwrap() = Some(format!("phase {phase}: quotas mixed up"));
                    }
                    done.wait();
                }
            });
        }
        // The clock: moves between phases, by up to two emission intervals.
        let mut x = 0x1234_5678_9abc_def1u64;
        for _ in 0..scale.phases {
            start.wait();
            done.wait();
            limiter
                .clock()
                .advance(Duration::from_nanos(next(&mut x) % (2 * period)));
        }
    });
    if let Some(failure) = failure.into_inner().unwrap() {
        panic!("{failure}");
    }
    let stats = limiter.stats();
    (
        ops.into_inner(),
        stats.resizes,
        resets.into_inner(),
        stats.evicted_active,
    )
}

fn limiter(shards: usize) -> tollgate::Builder<u64, ManualClock> {
    RateLimiter::builder("5/s burst 3".parse().expect("valid quota"))
        .clock(ManualClock::new())
        .shards(shards)
}

#[test]
fn every_decision_matches_the_model_while_tiny_tables_resize() {
    let scale = scale();
    for shards in [1, 2] {
        let limiter = limiter(shards).build().unwrap();
        let (ops, resizes, resets, _) = run(&limiter, false, &scale);
        assert_eq!(resets, 0);
        // Tables migrate on quota changes alone once per phase.
        assert!(resizes >= scale.phases, "{resizes} resizes");
        println!(
            "stress: {shards} shard(s), 5 threads, {ops} operations, {resizes} resizes, \
             {} keys at the end",
            limiter.len()
        );
    }
}

#[test]
fn evictions_under_max_keys_reset_only_what_they_count() {
    let scale = scale();
    for when_full in [WhenFull::EvictLeastActive, WhenFull::DenyNewKeys] {
        let limiter = limiter(2)
            .max_keys(60)
            .when_full(when_full)
            .build()
            .unwrap();
        let (ops, resizes, resets, evicted) = run(&limiter, true, &scale);
        assert!(limiter.len() <= 60);
        let stats = limiter.stats();
        // A fresh-key decision is accepted only after an active eviction or a refusal.
        assert!(
            resets <= evicted + stats.refused_new_keys,
            "{resets} resets, {stats:?}"
        );
        if when_full == WhenFull::EvictLeastActive {
            assert!(evicted > 0, "{stats:?}");
        }
        println!(
            "stress ({when_full:?}): 5 threads, {ops} operations, {resizes} resizes, \
             {evicted} active evictions, {resets} decisions of a fresh key"
        );
    }
}

/// The same with every key held to two quotas, whose states share one 16-byte word
/// (`cmpxchg16b`): the second quota (2 per second, burst 2) binds at other moments than
/// the first, so a lost, torn or half-migrated update of either state shows up as a wrong
/// decision.
#[test]
fn two_quotas_in_one_word_match_the_model_while_tiny_tables_resize() {
    let scale = scale();
    for shards in [1, 2] {
        let limiter = limiter(shards)
            .also("2/s burst 2".parse().expect("valid quota"))
            .build()
            .unwrap();
        let (ops, resizes, resets, _) = run(&limiter, false, &scale);
        assert_eq!(resets, 0);
        assert!(resizes >= scale.phases, "{resizes} resizes");
        println!(
            "stress, two quotas: {shards} shard(s), 5 threads, {ops} operations, {resizes} \
             resizes, {} keys at the end",
            limiter.len()
        );
    }
}

/// Tables large enough to be destroyed a piece per collect once retired (more than two
/// 64 KiB pieces of slots), with `String` keys, whose drops those pieces run: one thread
/// grows a shard past 12,000 keys, then resets every other key (the growth and shrink
/// migrations retire tables that later collects destroy in pieces), while another checks
/// each key already inserted a second time. Every decision is the reference's; under
/// valgrind, no key is read after its drop, dropped twice or leaked.
#[test]
fn tables_destroyed_in_pieces_keep_every_decision() {
    const KEYS: u64 = 12_000;
    let limiter = RateLimiter::<String, _>::builder("5/s burst 3".parse().expect("valid quota"))
        .clock(ManualClock::new())
        .shards(1)
        .build()
        .unwrap();
    let reference = Reference::new(limiter.quota());
    let now = limiter.clock().now_ns();
    let key = |i: u64| format!("key-{i}");
    // The decisions of a key's first, second and third unit check at `now`.
    let mut expected = Vec::new();
    let mut tat = 0;
    for _ in 0..3 {
        let (allowed, remaining, reset, retry, next) = reference.decide(tat, now, 1);
        expected.push((allowed, remaining, reset, retry));
        tat = next;
    }
    let inserted = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..KEYS {
                assert_eq!(observed(&limiter.check(&key(i))), expected[0], "key {i}");
                inserted.store(i + 1, Ordering::Release);
            }
            for i in (0..KEYS).step_by(2) {
                limiter.reset(&key(i));
            }
        });
        s.spawn(|| {
            let mut i = 1;
            while i < KEYS {
                if i < inserted.load(Ordering::Acquire) {
                    assert_eq!(observed(&limiter.check(&key(i))), expected[1], "key {i}");
                    i += 2;
                } else {
                    std::thread::yield_now();
                }
            }
        });
    });
    for i in 0..KEYS {
        let third = if i % 2 == 1 { expected[2] } else { expected[0] };
        assert_eq!(observed(&limiter.check(&key(i))), third, "key {i}");
    }
    let stats = limiter.stats();
    assert!(stats.resizes >= 2, "{stats:?}");
    println!(
        "stress, pieces: {KEYS} String keys, {} resizes, {} keys at the end",
        stats.resizes,
        limiter.len()
    );
}
