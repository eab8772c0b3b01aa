//! The synced limiter's check and the HTTP layer against tower_governor.

use super::*;

/// The check path of a limiter with background sync (reconcile mode, syncing every 50 ms
/// to a local redis-server) against the same limiter without, in the same run: 10k keys,
/// 1 thread. The keys stay cold (far from their limit), except in `sync_on_hot_keys`,
/// whose limiter has the cold tier off.
#[cfg(feature = "redis")]
pub(crate) fn sync_check(c: &mut Criterion) {
    use tollgate::sync::RedisSync;

    let Some((server, runtime)) = redis_and_runtime("sync_check", 1) else {
        return;
    };
    let quota = redis_quota();
    let plain = tollgate(Algorithm::TokenBucket, quota);
    let (synced, handle) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota).build_synced(RedisSync::new(&server.url()))
        })
        .expect("synced limiter");
    // The same quota twice over (issue 32's several quotas on the synced limiter): each
    // check decides both, all admitted.
    let (synced_two, handle_two) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota)
                .also(quota)
                .build_synced(RedisSync::new(&server.url()).prefix("bench-two-quotas"))
        })
        .expect("synced limiter with two quotas");
    // Every key hot (the cold tier off): a check spends its lease, which it reaches
    // through the cell's box, where a cold key's check reads only its 24-byte entry.
    let (synced_hot, handle_hot) = runtime
        .block_on(async {
            RateLimiter::<u64>::builder(quota).build_synced(
                RedisSync::new(&server.url())
                    .cold_keys(false)
                    .prefix("bench-hot-keys"),
            )
        })
        .expect("synced limiter without the cold tier");
    let keys = key_sequence(0x5ca1e, KEYS);
    let mut group = c.benchmark_group("sync_check");
    let mut allowed = Vec::new();
    let mut run = |name: &str, check: &dyn Fn(&u64) -> bool| {
        // The closure is called through `dyn`, but `check` itself is inlined into it, so
        // both limiters pay the same call.
        for key in 0..KEYS {
            check(&key);
        }
        group.bench_function(BenchmarkId::new(name, "1_thread"), |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for i in 0..iters as usize {
                    black_box(check(&keys[i & (SEQUENCE - 1)]));
                }
                t0.elapsed()
            })
        });
        let admitted = (0..1_000_000)
            .filter(|i| check(&keys[i & (SEQUENCE - 1)]))
            .count();
        allowed.push(format!(
            "sync_check/{name}: {admitted} of 1000000 checks allowed right after the run"
        ));
    };
    run("sync_off", &|key| plain.check(key).is_allowed());
    run("sync_on", &|key| synced.check(key).is_allowed());
    run("sync_on_hot_keys", &|key| {
        synced_hot.check(key).is_allowed()
    });
    run("sync_on_two_quotas", &|key| {
        synced_two.check(key).is_allowed()
    });
    // Settlements on the synced limiter against its own `check_n` (issue 32: no more
    // than `check_n` in the same run); the quota is generous enough (10^6/s a key) that
    // no key goes into debt over the run.
    run("sync_on_check_n", &|key| {
        synced.check_n(key, 1).is_ok_and(|d| d.is_allowed())
    });
    run("sync_on_charge", &|key| {
        synced.charge(key, 1).is_ok_and(|d| d.is_allowed())
    });
    run("sync_on_refund", &|key| {
        synced.refund(key, 1).is_ok_and(|d| d.is_allowed())
    });
    group.finish();
    for line in allowed {
        println!("{line}");
    }
    println!("sync_check/stats: {:?}", handle.stats());
    println!("sync_check/stats, hot keys: {:?}", handle_hot.stats());
    runtime.block_on(handle.shutdown());
    runtime.block_on(handle_two.shutdown());
    runtime.block_on(handle_hot.shutdown());
}

#[cfg(not(feature = "redis"))]
pub(crate) fn sync_check(_: &mut Criterion) {}

/// A request through the HTTP layer (keyed by peer address, 10k addresses, quota high
/// enough to admit) against the same tower service without a limiter, and with
/// tower_governor's layer keyed the same way, in-process and in the same run.
#[cfg(feature = "tower")]
pub(crate) fn http_layer(c: &mut Criterion) {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    use std::sync::Arc;

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use tower::{Layer, Service, ServiceExt};

    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let handler = tower::service_fn(|_req: http::Request<Body>| async {
        let mut response = http::Response::new(Body::from("hello"));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain"),
        );
        Ok::<_, std::convert::Infallible>(response)
    });
    // 1,000/s with a burst of 1,000 per address: realistic header values, and over a
    // run no address comes near its limit (10k addresses share the requests).
    let quota = Quota::per_second(1_000)
        .and_then(|q| q.with_burst(1_000))
        .expect("valid quota");
    let ours =
        tollgate::http::RateLimitLayer::new(RateLimiter::<String>::new(quota)).layer(handler);
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .per_millisecond(1)
        .burst_size(1_000)
        .key_extractor(tower_governor::key_extractor::PeerIpKeyExtractor)
        .use_headers()
        .finish()
        .expect("a valid tower_governor config");
    let theirs = tower_governor::GovernorLayer::new(Arc::new(config)).layer(handler);
    let peers: Vec<SocketAddr> = key_sequence(0x4777, KEYS)
        .into_iter()
        .map(|k| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + k as u32)), 443))
        .collect();
    let mut group = c.benchmark_group("http_layer");
    fn run<S, B>(
        runtime: &tokio::runtime::Runtime,
        service: &S,
        peers: &[SocketAddr],
        iters: u64,
    ) -> Duration
    where
        S: Service<http::Request<Body>, Response = http::Response<B>> + Clone,
        S::Error: std::fmt::Debug,
    {
        runtime.block_on(async {
            let mut service = service.clone();
            let t0 = Instant::now();
            for i in 0..iters as usize {
                let mut request = http::Request::new(Body::empty());
                request
                    .extensions_mut()
                    .insert(ConnectInfo(peers[i & (SEQUENCE - 1)]));
                let ready = service.ready().await.expect("ready");
                let response = ready.call(request).await.expect("response");
                assert_eq!(response.status(), 200, "the quota admits every request");
                black_box(response);
            }
            t0.elapsed()
        })
    }
    group.bench_function(BenchmarkId::new("without_layer", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &handler, &peers, iters))
    });
    group.bench_function(BenchmarkId::new("with_layer", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &ours, &peers, iters))
    });
    group.bench_function(BenchmarkId::new("tower_governor", "1_thread"), |b| {
        b.iter_custom(|iters| run(&runtime, &theirs, &peers, iters))
    });
    group.finish();
}

#[cfg(not(feature = "tower"))]
pub(crate) fn http_layer(_: &mut Criterion) {}
