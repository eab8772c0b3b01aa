//! Allocation and memory, counted by the allocator: a check on an existing key allocates
//! nothing (including `&str` lookups on a `String`-keyed limiter, denies, peeks and every
//! algorithm), and a flood of new keys against `max_keys` holds the heap to the
//! documented bound.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{Algorithm, Quota, RateLimiter, WhenFull};
use tollgate_testing::CountingAllocator;

/// Peeks at `keys` (uncounted, consuming nothing, retiring nothing): this thread claims
/// its record (its first guard's one allocation) and frees anything the test's inserts
/// retired, so that what is measured is the steady state.
fn settle(limiter: &RateLimiter<String, ManualClock>, keys: &[String]) {
    for key in keys {
        limiter.peek(key.as_str());
    }
}

/// `n` keys of 24 bytes, the same for every test here.
fn user_keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i:019}")).collect()
}

/// How many allocations `f` made on this thread.
fn allocations_in(f: impl FnOnce()) -> usize {
    CountingAllocator::count_allocations(f)
}

/// Set in the child process of [`a_built_limiter_leaves_parking_nothing_to_allocate`].
const CHILD: &str = "TOLLGATE_ALLOC_CHILD";

/// Once a limiter is built, a first wait on a parking_lot lock allocates nothing.
/// parking_lot allocates its table of parked threads at the first wait or wake in the
/// process; on a check that helped a migration and woke an insert waiting for the writer
/// mutex, that was 2 allocations on the check's path (a loaded CI run). Building a shard
/// creates the table. The test runs in a child process of its own, where nothing has
/// waited on a parking_lot lock before the limiter is built.
#[test]
fn a_built_limiter_leaves_parking_nothing_to_allocate() {
    super::alone();
    let name = "alloc::a_built_limiter_leaves_parking_nothing_to_allocate";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads", "1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    // The counter sees a first wait's allocations: this process has not parked yet.
    let _limiter = RateLimiter::<u64>::builder(Quota::per_second(50).unwrap())
        .build()
        .unwrap();
    let mutex = parking_lot::Mutex::new(());
    let allocations = allocations_in(|| {
        let _ = parking_lot::Condvar::new().wait_for(&mut mutex.lock(), Duration::ZERO);
    });
    assert_eq!(allocations, 0, "a first wait after building a limiter");
}

#[test]
fn checks_on_existing_keys_do_not_allocate() {
    super::alone();
    for algorithm in Algorithm::ALL {
        // A manual clock, moved 1 ms a round: a real one lets a stalled test (a loaded
        // machine, a paused VM) leave the keys untouched long enough for an insert's
        // sweep to drop them (four periods and a second: 5 s at 50/s, measured), and the
        // measured checks would then insert them again, as new keys, which allocate. The
        // buckets refill a little each round, so both admits and denies are measured.
        let clock = ManualClock::new();
        let limiter = RateLimiter::<String, _>::builder(Quota::per_second(50).unwrap())
            .algorithm(algorithm)
            .clock(clock.clone())
            .build()
            .unwrap();
        let keys = user_keys(1000);
        for key in &keys {
            limiter.check(key.as_str());
        }

        // The counter really counts: inserting new keys allocates their Strings.
        let inserting = allocations_in(|| {
            for i in 0..10 {
                limiter.check(format!("new-{i}").as_str());
            }
        });
        assert!(
            inserting >= 10,
            "{algorithm:?}: counted only {inserting} allocations"
        );

        settle(&limiter, &keys);
        let (mut allowed, mut denied) = (0, 0);
        let n = allocations_in(|| {
            for _ in 0..100 {
                clock.advance(Duration::from_millis(1));
                for key in &keys {
                    let d = limiter.check(key.as_str());
                    allowed += usize::from(d.is_allowed());
                    denied += usize::from(!d.is_allowed());
                    let _ = d.retry_after();
                }
            }
            for key in &keys {
                limiter.peek(key.as_str());
                limiter.check_n(key.as_str(), 2).unwrap();
                // Settlements where the algorithm takes them; a typed error otherwise,
                // which allocates nothing either.
                let _ = limiter.charge(key.as_str(), 3);
                let _ = limiter.refund(key.as_str(), 2);
            }
        });
        assert_eq!(
            n, 0,
            "{algorithm:?}: {n} allocations in 102,000 checks and 2,000 settlements on existing keys"
        );
        assert!(denied > 0, "{algorithm:?}: the deny path was not exercised");
        assert!(
            allowed > keys.len(),
            "{algorithm:?}: the admit path was not exercised"
        );
        assert_eq!(limiter.stats().evicted_untouched, 0, "{algorithm:?}");
    }
}

/// A migration in progress when the measuring starts does not make the checks and
/// settlements that end it allocate. Checks that meet a migration help it along and may
/// end it, leaving the old table for the next writer to retire; that writer may be a
/// settlement on an existing key, and retiring (or freeing what was retired) must not
/// allocate either. Each round inserts one key (uncounted), then checks the existing
/// keys until any migration it started has ended, then settles: over thousands of
/// inserts into one shard, the migrations of its growth are caught in progress.
#[test]
fn ending_a_migration_on_existing_keys_does_not_allocate() {
    super::alone();
    let limiter = RateLimiter::<String, _>::builder(Quota::per_second(50).unwrap())
        .algorithm(Algorithm::TokenBucket)
        .clock(ManualClock::new())
        .shards(1)
        .build()
        .unwrap();
    let keys = user_keys(1500);
    limiter.check(keys[0].as_str());
    settle(&limiter, &keys[..1]);
    let mut caught = 0;
    for n in 1..keys.len() {
        let before = limiter.stats().resizes;
        limiter.check(keys[n].as_str());
        // `resizes` counts migrations begun: this insert began one, which its checks
        // then end by their help (a help every `HELP_EVERY` = 64 checks that meet it, 16
        // slots each: about 7 rounds over the keys), and which a settlement, a writer,
        // then retires.
        let migrating = limiter.stats().resizes > before;
        caught += usize::from(migrating);
        let rounds = if migrating { 16 } else { 1 };
        let allocations = allocations_in(|| {
            for _ in 0..rounds {
                for key in &keys[..n] {
                    limiter.check(key.as_str());
                }
            }
            let _ = limiter.charge(keys[0].as_str(), 1);
            let _ = limiter.refund(keys[0].as_str(), 1);
        });
        assert_eq!(
            allocations, 0,
            "{allocations} allocations in checks and settlements on {n} existing keys \
             (an insert had just begun a migration: {migrating})"
        );
    }
    assert!(
        caught >= 4,
        "only {caught} migrations were in progress when a round began"
    );
}

/// Checks on existing keys allocate nothing while another thread grows the table under
/// them: their keys are frozen and moved, they read through migrations and help them,
/// and they collect the old tables (off the fast path, while garbage is pending, which a
/// check in flight on the other thread makes common). The inserting thread allocates
/// its new keys; only the checking thread is counted. A first pass, not counted, grows
/// the reclamation's lists to what such a run keeps pending; four passes are counted.
/// (Before the reclamation kept its lists' capacity, about one pass in five allocated.
/// Before building a limiter created parking_lot's table of parked threads, a loaded
/// run allocated it on the checking thread at the first contention of the writer mutex,
/// in a counted pass: see `a_built_limiter_leaves_parking_nothing_to_allocate`.)
#[test]
fn checks_allocate_nothing_while_another_thread_grows_the_table() {
    super::alone();
    for pass in 0..5 {
        let limiter = RateLimiter::<String, _>::builder(Quota::per_second(50).unwrap())
            .clock(ManualClock::new())
            .shards(2)
            .build()
            .unwrap();
        let keys = user_keys(2_000);
        for key in &keys {
            limiter.check(key.as_str());
        }
        let before = limiter.stats().resizes;
        let done = std::sync::atomic::AtomicBool::new(false);
        let (allocations, checks) = std::thread::scope(|s| {
            let checker = s.spawn(|| {
                // A thread's first check of a limiter claims its stripe of the decision
                // counts (one allocation per thread and limiter, not per check).
                limiter.check(keys[0].as_str());
                settle(&limiter, &keys);
                let mut checks = 0u64;
                let allocations = allocations_in(|| {
                    while !done.load(std::sync::atomic::Ordering::Acquire) {
                        for key in &keys {
                            limiter.check(key.as_str());
                            limiter.peek(key.as_str());
                        }
                        checks += keys.len() as u64;
                    }
                });
                (allocations, checks)
            });
            for i in 0..300_000 {
                limiter.check(format!("new-{i}").as_str());
            }
            done.store(true, std::sync::atomic::Ordering::Release);
            checker.join().unwrap()
        });
        let resizes = limiter.stats().resizes - before;
        assert!(resizes >= 8, "pass {pass}: only {resizes} resizes");
        assert!(checks > 0, "pass {pass}");
        if pass > 0 {
            assert_eq!(
                allocations, 0,
                "pass {pass}: {allocations} allocations in {checks} checks and peeks of \
                 existing keys during {resizes} resizes on another thread"
            );
        }
    }
}

/// The HTTP layer adds no allocation to an admitted request: the same requests through
/// the bare service and through the layer allocate the same, whether keyed by a header
/// (borrowed) or by the peer address (written on the stack), with both header styles.
#[cfg(feature = "tower")]
#[test]
fn the_http_layer_adds_no_allocation_to_an_admitted_request() {
    use std::convert::Infallible;
    use std::future::Future;
    use std::net::SocketAddr;
    use std::task::{Context, Poll, Waker};

    use bytes::Bytes;
    use http_body_util::Full;
    use tollgate::http::{KeyExtractor, RateLimitLayer};
    use tower::{Layer, Service};

    super::alone();

    /// Calls `service` once with `req` and polls the response out (every future here is
    /// ready at once).
    fn call<S>(service: &mut S, req: http::Request<()>) -> http::HeaderMap
    where
        S: Service<http::Request<()>, Error = Infallible>,
        S::Response: Into<http::HeaderMap>,
    {
        let mut cx = Context::from_waker(Waker::noop());
        assert!(service.poll_ready(&mut cx).is_ready());
        let mut future = std::pin::pin!(service.call(req));
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(response)) => response.into(),
            _ => panic!("the response is ready at once"),
        }
    }

    type Reply = Result<http::Response<Full<Bytes>>, Infallible>;

    /// The inner service: a response with a content type, as real handlers give.
    fn inner() -> impl Service<
        http::Request<()>,
        Response = http::Response<Full<Bytes>>,
        Error = Infallible,
        Future = std::future::Ready<Reply>,
    > + Clone {
        tower::service_fn(|_req: http::Request<()>| {
            let mut response = http::Response::new(Full::new(Bytes::from_static(b"ok")));
            response
                .headers_mut()
                .insert("content-type", http::HeaderValue::from_static("text/plain"));
            std::future::ready(Ok(response))
        })
    }

    /// Headers of a response, whatever its body.
    struct Head(http::HeaderMap);
    impl<B> From<http::Response<B>> for Head {
        fn from(r: http::Response<B>) -> Self {
            Head(r.into_parts().0.headers)
        }
    }
    impl From<Head> for http::HeaderMap {
        fn from(h: Head) -> Self {
            h.0
        }
    }

    fn request(i: usize) -> http::Request<()> {
        let mut req = http::Request::new(());
        req.headers_mut().insert(
            "x-api-key",
            http::HeaderValue::from_static(["key-a", "key-b", "key-c"][i % 3]),
        );
        req.extensions_mut()
            .insert(SocketAddr::from(([10, 0, 0, (i % 3) as u8], 4000)));
        req
    }

    // Header numbers below 4,096 are shared values; larger remainders would allocate one.
    let quota = Quota::per_second(1_000).unwrap().with_burst(1_000).unwrap();
    for key in [
        KeyExtractor::header("x-api-key").unwrap(),
        KeyExtractor::peer_ip(),
    ] {
        let clock = tollgate::clock::ManualClock::new();
        let limiter = RateLimiter::<String>::builder(quota)
            .clock(clock.clone())
            .build()
            .unwrap();
        let mut bare = tower::util::MapResponse::new(inner(), Head::from);
        let layered = RateLimitLayer::new(limiter).key(key.clone()).layer(inner());
        let mut layered = tower::util::MapResponse::new(layered, Head::from);
        // Warm up: the keys, and the layer's header values for every remainder the
        // measured requests will see (each is made once, then shared). Then let the
        // buckets refill, so those requests see the same remainders.
        for i in 0..300 {
            let headers = call(&mut layered, request(i));
            assert!(headers.contains_key("ratelimit-remaining"));
            call(&mut bare, request(i));
        }
        clock.advance(std::time::Duration::from_secs(1));
        let requests: Vec<_> = (0..300).map(request).collect();
        let mut more = requests.clone_requests();
        let bare_allocations = allocations_in(|| {
            for req in requests {
                call(&mut bare, req);
            }
        });
        let layered_allocations = allocations_in(|| {
            for req in more.drain(..) {
                let headers = call(&mut layered, req);
                assert_eq!(headers["ratelimit-limit"], "1000");
            }
        });
        assert!(
            bare_allocations > 0,
            "the counter counts the inner service's work"
        );
        assert_eq!(
            layered_allocations,
            bare_allocations,
            "{key:?}: the layer allocated {} times in 300 admitted requests",
            layered_allocations as i64 - bare_allocations as i64
        );
    }
}

/// Requests cannot be cloned; rebuild them.
#[cfg(feature = "tower")]
trait CloneRequests {
    fn clone_requests(&self) -> Vec<http::Request<()>>;
}

#[cfg(feature = "tower")]
impl CloneRequests for Vec<http::Request<()>> {
    fn clone_requests(&self) -> Vec<http::Request<()>> {
        self.iter()
            .map(|r| {
                let mut req = http::Request::new(());
                *req.headers_mut() = r.headers().clone();
                *req.extensions_mut() = r.extensions().clone();
                req
            })
            .collect()
    }
}

/// The bytes a flood may add to the heap with `max_keys` keys held (`u64` keys): each
/// key's 16-byte slot in a table at least 60% full (a table grows when its keys fill 72%
/// of it, by 1.25× at this size), twice over, since a migration holds the table it
/// replaces until its last slot has moved and the checks in flight then are done.
fn flood_heap_bound(max_keys: u64) -> u64 {
    const SLOT: u64 = 16;
    2 * max_keys * SLOT * 5 / 3
}

/// Two million distinct keys against `max_keys = 100_000` while one client is being
/// limited: the cap holds, the heap never holds more than [`flood_heap_bound`] beyond
/// what the empty limiter held, and the limited client's decisions are exactly those of
/// a limiter that never saw the flood.
#[test]
fn a_flood_of_new_keys_is_contained() {
    super::alone();
    const MAX_KEYS: usize = 100_000;
    const FLOOD: u64 = 2_000_000;
    for when_full in [WhenFull::EvictLeastActive, WhenFull::DenyNewKeys] {
        let clock = ManualClock::new();
        let reference: RateLimiter<u64, ManualClock> =
            RateLimiter::builder("10/s burst 20".parse().unwrap())
                .clock(clock.clone())
                .build()
                .unwrap();
        let flooded: RateLimiter<u64, ManualClock> =
            RateLimiter::builder("10/s burst 20".parse().unwrap())
                .clock(clock.clone())
                .max_keys(MAX_KEYS)
                .when_full(when_full)
                .build()
                .unwrap();
        const HOT: u64 = u64::MAX;
        // The hot key in both, so that its entry is not part of the flood's bytes.
        let (a, b) = (flooded.check(&HOT), reference.check(&HOT));
        assert_eq!(a, b);
        let mut hot_admitted = u64::from(a.is_allowed());
        let before = CountingAllocator::live_bytes();
        let mut peak = 0u64;
        for key in 0..FLOOD {
            // 10 s in all.
            clock.advance(Duration::from_micros(5));
            flooded.check(&key);
            if key % 100 == 99 {
                let (a, b) = (flooded.check(&HOT), reference.check(&HOT));
                assert_eq!(
                    a, b,
                    "{when_full:?}: the hot key diverged after {key} flood keys"
                );
                hot_admitted += u64::from(a.is_allowed());
            }
            if key % 10_000 == 0 {
                assert!(
                    flooded.len() <= MAX_KEYS,
                    "{when_full:?}: {} keys",
                    flooded.len()
                );
                peak = peak.max(CountingAllocator::live_bytes().saturating_sub(before) as u64);
            }
        }
        let bound = flood_heap_bound(MAX_KEYS as u64);
        assert!(
            peak <= bound,
            "{when_full:?}: the heap grew {peak} bytes, over {bound}"
        );
        // Checked at 0 and every 500 µs to 10 s, both included: the burst of 20, then one
        // every 100 ms (100 ms to 10 s).
        assert_eq!(hot_admitted, 20 + 100, "{when_full:?}");
        let stats = flooded.stats();
        assert!(stats.keys <= MAX_KEYS);
        match when_full {
            WhenFull::EvictLeastActive => assert_eq!(stats.refused_new_keys, 0, "{stats:?}"),
            WhenFull::DenyNewKeys => assert!(stats.refused_new_keys > 0, "{stats:?}"),
        }
        // Every key is accounted for: held now, evicted since, or refused.
        let accounted = stats.keys as u64
            + stats.evicted_untouched
            + stats.evicted_active
            + stats.refused_new_keys;
        assert_eq!(accounted, FLOOD + 1, "{when_full:?}: {stats:?}");
    }
}
