//! The Redis tier against the common Lua script, on one server and on a cluster, and the
//! HTTP layer in front of Redis.

use super::*;

/// The peer for the plain path: a minimal GCRA that a user would write, with the
/// server's `TIME`, one `GET`, and a `SET` with a TTL on admission (exact integers, as
/// tollgate's script keeps them), returning only whether it admitted.
#[cfg(feature = "redis")]
pub(crate) const BARE_GCRA: &str = r"
local t, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local tat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now)
local new = tat + t
if new - now > tau + t then
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', string.format('%.0f', math.ceil((new - now) / 1000)))
return 1
";

/// The way a Redis token bucket is usually written, as the baseline for ours: the client
/// passes its clock in seconds, tokens are floats in a hash, every call writes.
#[cfg(feature = "redis")]
pub(crate) const COMMON_LUA_TOKEN_BUCKET: &str = r"
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local requested = tonumber(ARGV[4])
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'last_updated')
local tokens = tonumber(bucket[1]) or capacity
local last = tonumber(bucket[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - last) * rate)
local allowed = 0
if tokens >= requested then
  tokens = tokens - requested
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'last_updated', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate))
return {allowed, math.floor(tokens)}
";

/// A throwaway redis-server and a tokio runtime with `workers` threads, or `None` (with a
/// message naming `group`) when redis-server is not installed.
#[cfg(feature = "redis")]
pub(crate) fn redis_and_runtime(
    group: &str,
    workers: usize,
) -> Option<(tollgate_testing::LocalRedis, tokio::runtime::Runtime)> {
    let server = tollgate_testing::LocalRedis::start()
        .map_err(|e| eprintln!("{group} skipped: {e}"))
        .ok()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    Some((server, runtime))
}

/// 10^6 per second per key with an equal burst: checks pass, and the interval is a whole
/// microsecond, as the Redis scripts need.
#[cfg(feature = "redis")]
pub(crate) fn redis_quota() -> Quota {
    Quota::per_second(1_000_000)
        .and_then(|q| q.with_burst(1_000_000))
        .expect("valid quota")
}

/// A check through the Redis tier against the common Lua token bucket and a bare GCRA
/// script (EVALSHA over the same kind of connection), with 1, 16 and 64 requests in
/// flight, every check admitted, and a local check for scale. Needs `redis-server` (./scripts/test.sh installs it).
#[cfg(feature = "redis")]
pub(crate) fn redis_tier(c: &mut Criterion) {
    use std::sync::Arc;
    use tollgate::redis::RedisLimiter;

    let Some((server, runtime)) = redis_and_runtime("redis_tier", 2) else {
        return;
    };
    let quota = redis_quota();
    let ours = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    // The same quota and a second one (`also`, 864M a day: T = 100 µs), decided in the
    // same script call; every check is admitted by both.
    let two_quotas = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .also("864000000/day".parse().expect("valid quota"))
                .prefix("two")
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    let connection = runtime
        .block_on(async {
            let client = redis::Client::open(server.url())?;
            redis::aio::ConnectionManager::new(client).await
        })
        .expect("connect");
    let baseline = Arc::new(redis::Script::new(COMMON_LUA_TOKEN_BUCKET));
    let bare = Arc::new(redis::Script::new(BARE_GCRA));
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());
    let order = Arc::new(key_sequence(0xbeef, KEYS));
    let start = Instant::now();

    // One call of each kind, on the i-th key of the shared sequence.
    let call_ours = {
        let (ours, names, order) = (ours.clone(), names.clone(), order.clone());
        move |i: usize| {
            let (ours, names, order) = (ours.clone(), names.clone(), order.clone());
            async move {
                let key = &names[order[i & (SEQUENCE - 1)] as usize];
                ours.check(key).await.expect("redis check").is_allowed()
            }
        }
    };
    let call_two = {
        let (two_quotas, names, order) = (two_quotas.clone(), names.clone(), order.clone());
        move |i: usize| {
            let (two_quotas, names, order) = (two_quotas.clone(), names.clone(), order.clone());
            async move {
                let key = &names[order[i & (SEQUENCE - 1)] as usize];
                two_quotas
                    .check(key)
                    .await
                    .expect("redis check")
                    .is_allowed()
            }
        }
    };
    let call_baseline = {
        let (connection, baseline, names, order) = (
            connection.clone(),
            baseline.clone(),
            names.clone(),
            order.clone(),
        );
        move |i: usize| {
            let (mut connection, baseline, names, order) = (
                connection.clone(),
                baseline.clone(),
                names.clone(),
                order.clone(),
            );
            async move {
                let key = format!("common:{}", names[order[i & (SEQUENCE - 1)] as usize]);
                let reply: Vec<i64> = baseline
                    .key(key)
                    .arg(1_000_000)
                    .arg(1_000_000)
                    .arg(start.elapsed().as_secs_f64())
                    .arg(1)
                    .invoke_async(&mut connection)
                    .await
                    .expect("baseline script");
                reply[0] == 1
            }
        }
    };

    // The bare GCRA at the same quota: T and tau in µs.
    let t_us = (quota.emission_interval().as_nanos() / 1_000).max(1) as u64;
    let tau_us = t_us * (quota.burst() - 1);
    let call_bare = {
        let (connection, bare, names, order) = (
            connection.clone(),
            bare.clone(),
            names.clone(),
            order.clone(),
        );
        move |i: usize| {
            let (mut connection, bare, names, order) = (
                connection.clone(),
                bare.clone(),
                names.clone(),
                order.clone(),
            );
            async move {
                let key = format!("bare:{}", names[order[i & (SEQUENCE - 1)] as usize]);
                let reply: i64 = bare
                    .key(key)
                    .arg(t_us)
                    .arg(tau_us)
                    .invoke_async(&mut connection)
                    .await
                    .expect("bare script");
                reply == 1
            }
        }
    };

    let mut group = c.benchmark_group("redis_tier");
    group.sample_size(20);
    for in_flight in [1usize, 16, 64] {
        let id = |name: &str| BenchmarkId::new(name, format!("{in_flight}_in_flight"));
        group.bench_function(id("tollgate_script"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_ours.clone()))
            })
        });
        group.bench_function(id("tollgate_two_quotas"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_two.clone()))
            })
        });
        group.bench_function(id("common_lua_baseline"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_baseline.clone()))
            })
        });
        group.bench_function(id("bare_gcra"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(run_in_flight(iters, in_flight, call_bare.clone()))
            })
        });
    }
    // What each script costs the server itself, from Redis's own accounting.
    let mut admin = connection.clone();
    type BoxedCall =
        Box<dyn Fn(usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>>>;
    let (ours_call, two_call, baseline_call, bare_call) = (
        call_ours.clone(),
        call_two.clone(),
        call_baseline.clone(),
        call_bare.clone(),
    );
    let calls: [(&str, BoxedCall); 4] = [
        ("tollgate_script", Box::new(move |i| Box::pin(ours_call(i)))),
        (
            "tollgate_two_quotas",
            Box::new(move |i| Box::pin(two_call(i))),
        ),
        (
            "common_lua_baseline",
            Box::new(move |i| Box::pin(baseline_call(i))),
        ),
        ("bare_gcra", Box::new(move |i| Box::pin(bare_call(i)))),
    ];
    for (name, call) in calls {
        let calls = 20_000;
        let per_call = runtime.block_on(async {
            evalsha_usec_per_call(&mut admin).await;
            for i in 0..calls {
                black_box(call(i).await);
            }
            evalsha_usec_per_call(&mut admin).await
        });
        println!(
            "redis_tier/server_cost/{name}: {per_call:.2} µs of server time per call (INFO commandstats, {calls} calls)"
        );
    }
    alternating_rounds(
        &runtime,
        &mut admin,
        ("tollgate", &call_ours),
        ("bare", &call_bare),
    );
    alternating_rounds(
        &runtime,
        &mut admin,
        ("two_quotas", &call_two),
        ("one_quota", &call_ours),
    );
    let local = tollgate(Algorithm::TokenBucket, quota);
    group.bench_function(BenchmarkId::new("local_rate_limiter", "1_thread"), |b| {
        b.iter_custom(|iters| {
            let t0 = Instant::now();
            for i in 0..iters as usize {
                black_box(local.check(&order[i & (SEQUENCE - 1)]));
            }
            t0.elapsed()
        })
    });
    group.finish();
}

/// The keys `user-0` to `user-<KEYS − 1>`, and a sequence of them drawn from `seed`.
#[cfg(feature = "redis")]
type KeyOrder = (std::sync::Arc<Vec<String>>, std::sync::Arc<Vec<u64>>);

#[cfg(feature = "redis")]
fn key_order(seed: u64) -> KeyOrder {
    let names = (0..KEYS).map(|i| format!("user-{i}")).collect();
    (
        std::sync::Arc::new(names),
        std::sync::Arc::new(key_sequence(seed, KEYS)),
    )
}

/// Checks the `i`-th key of `keys`' sequence on `limiter`; whether it was admitted.
#[cfg(feature = "redis")]
async fn check_nth(
    limiter: tollgate::redis::RedisLimiter,
    (names, order): KeyOrder,
    i: usize,
) -> bool {
    let key = &names[order[i & (SEQUENCE - 1)] as usize];
    limiter.check(key).await.expect("redis check").is_allowed()
}

/// What the penalty box and plans cost a Redis check, in alternating rounds against the
/// plain check (see [`alternating_rounds`]): a limiter whose checks read the box
/// (`block_for`, no key ever denied) and a limiter of plans whose keys are on a plan of
/// the same quota (found by a resolver, kept in the plan book), each against the plain
/// limiter on the same calls. Needs `redis-server`.
#[cfg(feature = "redis")]
pub(crate) fn redis_box_and_plans_alternating() {
    use tollgate::redis::RedisLimiter;

    let Some((server, runtime)) = redis_and_runtime("redis_box", 2) else {
        return;
    };
    let quota = redis_quota();
    let build = |builder: tollgate::redis::RedisBuilder| {
        runtime
            .block_on(builder.timeout(Duration::from_secs(5)).build())
            .expect("connect")
    };
    let plain = build(RedisLimiter::builder(&server.url(), quota).prefix("plain"));
    let boxed = build(
        RedisLimiter::builder(&server.url(), quota)
            .prefix("boxed")
            .block_for(Duration::from_secs(3_600)),
    );
    let planned = build(
        RedisLimiter::builder(&server.url(), "1/s".parse().expect("valid quota"))
            .prefix("planned")
            .plan("pro", [quota])
            .plan_resolver(|_| Some("pro".to_owned())),
    );
    let keys = key_order(0xb0c5);
    let caller = |limiter: RedisLimiter| {
        let keys = keys.clone();
        move |i| check_nth(limiter.clone(), keys.clone(), i)
    };
    let (call_plain, call_boxed, call_planned) = (caller(plain), caller(boxed), caller(planned));
    let mut admin = runtime
        .block_on(async {
            let client = redis::Client::open(server.url())?;
            redis::aio::ConnectionManager::new(client).await
        })
        .expect("connect");
    alternating_rounds(
        &runtime,
        &mut admin,
        ("penalty_box", &call_boxed),
        ("plain", &call_plain),
    );
    alternating_rounds(
        &runtime,
        &mut admin,
        ("plan", &call_planned),
        ("plain", &call_plain),
    );
}

#[cfg(not(feature = "redis"))]
pub(crate) fn redis_box_and_plans_alternating() {}

/// µs of server time per `EVALSHA` since the previous call (Redis's own accounting, `INFO
/// commandstats`), which it then resets (`CONFIG RESETSTAT`); NaN if Redis counted none.
#[cfg(feature = "redis")]
async fn evalsha_usec_per_call(admin: &mut redis::aio::ConnectionManager) -> f64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("info");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .expect("resetstat");
    stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec_per_call=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Two kinds of call (`ours` against `theirs`, each with its name; tollgate's script
/// against the bare GCRA, or two quotas against one) in alternating rounds at 1, 16 and
/// 64 in flight: on this VM a criterion group runs one contender for seconds and then
/// the other, and the machine's load moves between them by more than the gap measured,
/// so the ratio is also taken round by round, each round timing the same calls of both
/// back to back. Prints the median of the rounds' throughput ratios (their time / our
/// time) and of each script's server time per call (`INFO commandstats`, reset before
/// each half).
#[cfg(feature = "redis")]
pub(crate) fn alternating_rounds<O, OF, B, BF>(
    runtime: &tokio::runtime::Runtime,
    admin: &mut redis::aio::ConnectionManager,
    (ours_name, ours): (&str, &O),
    (bare_name, bare): (&str, &B),
) where
    O: Fn(usize) -> OF + Clone + Send + 'static,
    OF: std::future::Future<Output = bool> + Send + 'static,
    B: Fn(usize) -> BF + Clone + Send + 'static,
    BF: std::future::Future<Output = bool> + Send + 'static,
{
    let quick = std::env::args().any(|a| a == "--test");
    let rounds = if quick { 1 } else { 10 };
    let mut server_time = || runtime.block_on(evalsha_usec_per_call(admin));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for in_flight in [1usize, 16, 64] {
        let calls = if quick {
            64
        } else if in_flight == 1 {
            3_000
        } else {
            30_000
        } as u64;
        let (mut ratios, mut ours_us, mut bare_us) = (Vec::new(), Vec::new(), Vec::new());
        server_time();
        for _ in 0..rounds {
            let ours_time = runtime.block_on(run_in_flight(calls, in_flight, ours.clone()));
            ours_us.push(server_time());
            let bare_time = runtime.block_on(run_in_flight(calls, in_flight, bare.clone()));
            bare_us.push(server_time());
            ratios.push(bare_time.as_secs_f64() / ours_time.as_secs_f64());
        }
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let (ours_us, bare_us) = (median(ours_us), median(bare_us));
        println!(
            "redis_tier/alternating/{in_flight}_in_flight: throughput {ours_name} / {bare_name} {:.3} (median of {rounds} rounds, {lo:.3}–{hi:.3}); server µs per call {ours_us:.2} vs {bare_us:.2} ({:.3}×)",
            median(ratios),
            ours_us / bare_us
        );
    }
}

/// `RedisLimiter` checks per second on a 3-master Redis Cluster (no replicas) against one
/// Redis, in the same run, with 1 and 50 checks in flight, on 10,000 keys. Needs
/// `redis-server` and `redis-cli`.
#[cfg(feature = "redis")]
pub(crate) fn redis_cluster(c: &mut Criterion) {
    use tollgate::redis::RedisLimiter;
    use tollgate_testing::LocalCluster;

    let Some((server, runtime)) = redis_and_runtime("redis_cluster", 2) else {
        return;
    };
    let cluster = match LocalCluster::start(3, 0, Duration::from_secs(2)) {
        Ok(cluster) => cluster,
        Err(e) => return eprintln!("redis_cluster skipped: {e}"),
    };
    let quota = redis_quota();
    let seeds = cluster.urls();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let single = runtime
        .block_on(
            RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect");
    let clustered = runtime
        .block_on(
            RedisLimiter::cluster_builder(&seeds, quota)
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .expect("connect to the cluster");
    let keys = key_order(0xc1);
    let call = |limiter: RedisLimiter| {
        let keys = keys.clone();
        move |i| check_nth(limiter.clone(), keys.clone(), i)
    };
    let mut group = c.benchmark_group("redis_cluster");
    group.sample_size(20);
    for in_flight in [1usize, 50] {
        let id = |name: &str| BenchmarkId::new(name, format!("{in_flight}_in_flight"));
        let (one, three) = (call(single.clone()), call(clustered.clone()));
        group.bench_function(id("single_redis"), |b| {
            b.iter_custom(|iters| runtime.block_on(run_in_flight(iters, in_flight, one.clone())))
        });
        group.bench_function(id("cluster_3_masters"), |b| {
            b.iter_custom(|iters| runtime.block_on(run_in_flight(iters, in_flight, three.clone())))
        });
    }
    group.finish();
}

/// Makes `iters` calls with `in_flight` of them outstanding at any time; returns the
/// elapsed time (so the figure is the time per call at that concurrency).
#[cfg(feature = "redis")]
async fn run_in_flight<F, Fut>(iters: u64, in_flight: usize, call: F) -> Duration
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..in_flight {
        let call = call.clone();
        let share = iters as usize / in_flight + usize::from(lane < iters as usize % in_flight);
        tasks.spawn(async move {
            for j in 0..share {
                black_box(call(j * in_flight + lane).await);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    t0.elapsed()
}

/// Throughput through the HTTP layer over real sockets while one client floods: 16
/// keep-alive HTTP/1.1 connections from 127.0.0.1 (one key, 100/s burst 100, so nearly
/// every request is a 429), against the Redis backend with the deny cache, without it,
/// and the local limiter for scale — client and server in the same 2-thread runtime,
/// in the same run. The figure is the time per request (its inverse, the req/s).
#[cfg(all(feature = "redis", feature = "axum"))]
pub(crate) fn redis_layer_flood(c: &mut Criterion) {
    use std::net::SocketAddr;

    use http_body_util::{BodyExt, Empty};
    use hyper::body::Bytes;
    use tollgate::http::RateLimitLayer;
    use tollgate::redis::{FailMode, RedisLimiter};

    const CONNECTIONS: usize = 16;
    let Some((server, runtime)) = redis_and_runtime("redis_layer_flood", 2) else {
        return;
    };
    let quota = Quota::per_second(100)
        .and_then(|q| q.with_burst(100))
        .expect("valid quota");
    let serve = |layer: RateLimitLayer| {
        runtime.block_on(async {
            let app = axum::Router::new()
                .route("/", axum::routing::get(|| async { "ok" }))
                .layer(layer);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("address");
            tokio::spawn(async move {
                let app = app.into_make_service_with_connect_info::<SocketAddr>();
                axum::serve(listener, app).await.expect("serve");
            });
            addr
        })
    };
    let redis_layer = |cached: bool| {
        let limiter = runtime
            .block_on(
                RedisLimiter::builder(&server.url(), quota)
                    .prefix(if cached {
                        "flood-cached"
                    } else {
                        "flood-uncached"
                    })
                    .local_deny_cache(cached)
                    .timeout(Duration::from_secs(2))
                    .build(),
            )
            .expect("connect");
        RateLimitLayer::redis(limiter, FailMode::Closed)
    };
    let targets = [
        ("redis_deny_cache", serve(redis_layer(true))),
        ("redis_no_cache", serve(redis_layer(false))),
        (
            "local_limiter",
            serve(RateLimitLayer::new(RateLimiter::<String>::new(quota))),
        ),
    ];
    let flood = |addr: SocketAddr, iters: u64| -> Duration {
        runtime.block_on(async move {
            let mut senders = Vec::new();
            for _ in 0..CONNECTIONS {
                let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
                let (sender, connection) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                        .await
                        .expect("handshake");
                tokio::spawn(connection);
                senders.push(sender);
            }
            let t0 = Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for (lane, mut sender) in senders.into_iter().enumerate() {
                let share =
                    iters as usize / CONNECTIONS + usize::from(lane < iters as usize % CONNECTIONS);
                tasks.spawn(async move {
                    for _ in 0..share {
                        let request = http::Request::get("/")
                            .header("host", "bench")
                            .body(Empty::<Bytes>::new())
                            .expect("request");
                        sender.ready().await.expect("ready");
                        let response = sender.send_request(request).await.expect("response");
                        let status = response.status();
                        assert!(status == 200 || status == 429, "{status}");
                        black_box(response.into_body().collect().await.expect("body"));
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            t0.elapsed()
        })
    };
    let mut group = c.benchmark_group("redis_layer_flood");
    group.sample_size(20);
    for (name, addr) in targets {
        group.bench_function(
            BenchmarkId::new(name, format!("{CONNECTIONS}_connections")),
            |b| b.iter_custom(|iters| flood(addr, iters)),
        );
    }
    group.finish();
}

#[cfg(not(all(feature = "redis", feature = "axum")))]
pub(crate) fn redis_layer_flood(_: &mut Criterion) {}

/// What a denied check costs when the deny cache answers it (no round trip), from 1 task
/// and from 2 tasks on 2 worker threads, against the local limiter's hot denied key.
#[cfg(feature = "redis")]
pub(crate) fn redis_cached_deny(c: &mut Criterion) {
    use tollgate::redis::RedisLimiter;

    let Some((server, runtime)) = redis_and_runtime("redis_cached_deny", 2) else {
        return;
    };
    let quota = Quota::per_minute(1).expect("valid quota");
    let limiter = runtime
        .block_on(async {
            let limiter = RedisLimiter::builder(&server.url(), quota)
                .timeout(Duration::from_secs(2))
                .build()
                .await?;
            // Admitted, then denied for a minute: cached from here on.
            limiter.check("hot").await?;
            limiter.check("hot").await?;
            Ok::<_, tollgate::redis::RedisError>(limiter)
        })
        .expect("connect");
    let calls = limiter.stats().calls;
    let local = RateLimiter::<String>::new(quota);
    local.check("hot");
    let mut group = c.benchmark_group("redis_cached_deny");
    for tasks in [1usize, 2] {
        let id = |name: &str| BenchmarkId::new(name, format!("{tasks}_thread"));
        group.bench_function(id("redis_limiter_cached"), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let t0 = Instant::now();
                    let mut set = tokio::task::JoinSet::new();
                    for _ in 0..tasks {
                        let limiter = limiter.clone();
                        set.spawn(async move {
                            for _ in 0..iters {
                                let d = limiter.check("hot").await.expect("cached");
                                assert!(!d.is_allowed());
                                black_box(d);
                            }
                        });
                    }
                    while set.join_next().await.is_some() {}
                    t0.elapsed()
                })
            })
        });
        group.bench_function(id("local_limiter"), |b| {
            b.iter_custom(|iters| {
                run_threads(tasks, iters, &|_, _| local.check("hot").is_allowed())
            })
        });
    }
    group.finish();
    assert_eq!(
        limiter.stats().calls,
        calls,
        "every deny came from the cache"
    );
}

#[cfg(not(feature = "redis"))]
pub(crate) fn redis_cached_deny(_: &mut Criterion) {}

#[cfg(not(feature = "redis"))]
pub(crate) fn redis_tier(_: &mut Criterion) {
    eprintln!(
        "redis_tier skipped: run `cargo bench -p tollgate-benches --all-features` to measure the Redis tier"
    );
}

#[cfg(not(feature = "redis"))]
pub(crate) fn redis_cluster(_: &mut Criterion) {}
