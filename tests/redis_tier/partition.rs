//! One node cut off from Redis alone, on real processes: three synced limiters share one
//! key on a real redis-server, and the first reaches it through a TCP proxy that stops
//! forwarding (both ways, holding what was sent, as a blackholed link does) for a while.
//!
//! `TOLLGATE_PARTITION_FIGURES=1` runs the whole grid (10/s, 100/s and 1000/s;
//! 10 s and 30 s; both modes) and prints each second; the default run checks 100/s for
//! 10 s in both modes.
#![cfg(feature = "redis")]

use crate::common;
use crate::sync::{INTERVAL, settings};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::excess_over_rate;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tollgate::sync::{RedisSync, SyncHandle, SyncMode, SyncedLimiter};
use tollgate::{Quota, RateLimiter};
use tollgate_testing::LocalRedis;

/// A TCP proxy to `upstream` whose links can be cut: while cut it neither reads nor
/// writes, in either direction, on any connection (new ones are accepted and held), so
/// what is sent waits in the sockets' buffers and arrives when the link heals.
struct Proxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, watching) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let watching = watching.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        pump(client_read, server_write, watching.clone()),
                        pump(server_read, client_write, watching),
                    );
                });
            }
        });
        Self { addr, cut }
    }

    fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// Copies `from` to `to`, waiting while the link is cut before each read and each write.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if cut.wait_for(|c| !c).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.wait_for(|c| !c).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// `count` nodes holding keys to `quota` under `prefix`, node 0 reaching Redis through
/// `proxy` and the others directly, with `tweak` applied to each node's sync settings.
fn nodes_behind(
    proxy: &Proxy,
    server: &LocalRedis,
    count: usize,
    quota: Quota,
    mode: SyncMode,
    prefix: &str,
    tweak: impl Fn(RedisSync) -> RedisSync,
) -> Vec<(SyncedLimiter<String>, SyncHandle)> {
    (0..count)
        .map(|i| {
            let url = if i == 0 { proxy.url() } else { server.url() };
            RateLimiter::builder(quota)
                .build_synced(tweak(settings(&url, mode, prefix)))
                .unwrap()
        })
        .collect()
}

/// One run: `rate`/s with a burst of `rate`, three nodes offered 5× the rate split
/// 70/15/15, node 0 through the proxy; 3 s of warm-up, the cut for `cut` (node 0 calling
/// `sync_now` every ms of it), then 4 s.
/// Returns each node's admission instants (µs from the start), and when the cut began
/// and ended.
async fn run(
    server: &LocalRedis,
    mode: SyncMode,
    rate: u64,
    cut: Duration,
) -> (Vec<Vec<u64>>, u64, u64) {
    let upstream: SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let quota = Quota::per_second(rate).unwrap();
    let prefix = format!("partition-{mode:?}-{rate}-{}", cut.as_secs());
    let nodes = nodes_behind(&proxy, server, 3, quota, mode, &prefix, |sync| sync);
    let offered = [0.7, 0.15, 0.15].map(|s| s * 5.0 * rate as f64);
    let mut owed = [0.0f64; 3];
    let mut admitted = vec![Vec::new(); 3];
    let start = Instant::now();
    let cut_at = Duration::from_secs(3);
    let heal_at = cut_at + cut;
    let end = heal_at + Duration::from_secs(4);
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    let mut state = 0;
    while start.elapsed() < end {
        ticker.tick().await;
        let now = start.elapsed();
        if state == 0 && now >= cut_at {
            proxy.set_cut(true);
            state = 1;
        } else if state == 1 && now >= heal_at {
            proxy.set_cut(false);
            state = 2;
        }
        if state == 1 {
            // The cut node also asks for a round every ms: a round that cannot run must
            // not add to what its fallback admits.
            nodes[0].1.sync_now();
        }
        for (i, (limiter, _)) in nodes.iter().enumerate() {
            owed[i] += offered[i] / 1_000.0;
            while owed[i] >= 1.0 {
                owed[i] -= 1.0;
                if limiter.check("k").is_allowed() {
                    admitted[i].push(start.elapsed().as_micros() as u64);
                }
            }
        }
    }
    for (_, handle) in nodes {
        handle.shutdown().await;
    }
    (
        admitted,
        cut_at.as_micros() as u64,
        heal_at.as_micros() as u64,
    )
}

fn count(times: &[u64], from: u64, to: u64) -> u64 {
    times.iter().filter(|&&t| (from..to).contains(&t)).count() as u64
}

/// The documented bound's `x` (see the `sync` module docs): with `B = r` and `H = 2·I`,
/// lease `B + r·H + 2·N`; reconcile adds `B + r·H + N` and `r·(I + Δ)`; a partition adds
/// `2·(B + N)`.
fn bound(mode: SyncMode, rate: u64) -> f64 {
    let (b, r, n) = (rate as f64, rate as f64, 3.0);
    let hold = r * 2.0 * INTERVAL.as_secs_f64();
    let lease = b + hold + 2.0 * n;
    let reconcile = (b + hold + n) + r * (INTERVAL.as_secs_f64() + 0.2);
    let partition = 2.0 * (b + n);
    match mode {
        SyncMode::Lease => lease + partition,
        _ => lease + reconcile + partition,
    }
}

/// Checks one run against the figures; returns what it measured.
fn judge(mode: SyncMode, rate: u64, cut: Duration, run: &(Vec<Vec<u64>>, u64, u64)) -> String {
    let (admitted, cut_at, heal_at) = run;
    let r = rate as f64;
    // Every window, from just before the cut to the end: at most `x + r·t`.
    let mut all: Vec<u64> = admitted
        .iter()
        .flatten()
        .copied()
        .filter(|&t| t >= cut_at - 1_000_000)
        .collect();
    all.sort_unstable();
    let excess = excess_over_rate(&all, r / 1e6);
    let x = bound(mode, rate);
    assert!(
        excess <= x,
        "{mode:?} {rate}/s {cut:?}: excess {excess:.1} over r·t > bound {x:.1}"
    );
    // Each of the 3 s after the heal, at least 70% of r in total.
    let after: Vec<u64> = (0..3)
        .map(|s| {
            let from = heal_at + s * 1_000_000;
            admitted
                .iter()
                .map(|a| count(a, from, from + 1_000_000))
                .sum()
        })
        .collect();
    for (s, &n) in after.iter().enumerate() {
        assert!(
            n as f64 >= 0.7 * r,
            "{mode:?} {rate}/s {cut:?}: second {s} after the heal admitted {n} < 70% of {r}"
        );
    }
    // The healthy nodes, from 2 s into the cut to the heal: each its max-min fair share
    // (±20%) of what the cut node's reservation leaves (its third of the rate, for as
    // long as it is reserved: 10 s by default), and never less than 90% of it.
    let from = cut_at + 2_000_000;
    let reserved_to = (cut_at + 10_000_000).min(*heal_at);
    let secs = |a: u64, b: u64| (b - a) as f64 / 1e6;
    let mut shares = Vec::new();
    for (i, a) in admitted.iter().enumerate().skip(1) {
        let got = count(a, from, reserved_to) as f64 / secs(from, reserved_to);
        let fair = r * (2.0 / 3.0) / 2.0;
        shares.push(got / fair);
        if r >= 100.0 {
            assert!(
                (0.8..=1.2).contains(&(got / fair)),
                "{mode:?} {rate}/s {cut:?}: healthy node {i} got {got:.1}/s of a fair {fair:.1}/s"
            );
        }
    }
    let per_second: Vec<u64> = (0..(heal_at / 1_000_000 + 4))
        .map(|s| {
            let f = s * 1_000_000;
            admitted.iter().map(|a| count(a, f, f + 1_000_000)).sum()
        })
        .collect();
    format!(
        "{mode:?} {rate}/s cut {}s: excess {excess:.1} of bound {x:.1} ({:.2}); \
         3 s after the heal {after:?} ({:.0}% of r at worst); healthy shares {shares:.2?} \
         of fair; per second {per_second:?}",
        cut.as_secs(),
        excess / x,
        after.iter().min().copied().unwrap_or(0) as f64 / r * 100.0,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_cut_off_alone_stays_within_the_bound() {
    let server =
        LocalRedis::start().expect("these tests need redis-server (./scripts/test.sh installs it)");
    let figures = std::env::var_os("TOLLGATE_PARTITION_FIGURES").is_some();
    let grid: Vec<(u64, u64)> = if figures {
        [10, 100, 1000]
            .into_iter()
            .flat_map(|r| [(r, 10), (r, 30)])
            .collect()
    } else {
        vec![(100, 10)]
    };
    for (rate, secs) in grid {
        for mode in [SyncMode::Lease, SyncMode::Reconcile] {
            let cut = Duration::from_secs(secs);
            let measured = run(&server, mode, rate, cut).await;
            println!("{}", judge(mode, rate, cut, &measured));
        }
    }
}

/// Settlements are never lost to an outage: a node makes a charge and a refund while
/// Redis is unreachable to it — the node alone cut off (the proxy), or Redis paused
/// (SIGSTOP) for every node — and once the link heals, its rounds bring them to Redis
/// exactly: after every node has shut down (returning its leases), the key's state owes
/// what was consumed, 1 + 4 − 2 tokens, less the little refilled since (10 a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_made_while_cut_off_reach_redis_once_it_heals() {
    let server = LocalRedis::start().unwrap();
    let upstream: SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let quota = Quota::per_minute(10).unwrap();
    for (outage, mode) in [
        ("cut", SyncMode::Lease),
        ("cut", SyncMode::Reconcile),
        ("pause", SyncMode::Lease),
        ("pause", SyncMode::Reconcile),
    ] {
        let proxy = Proxy::start(upstream).await;
        let prefix = format!("settle-{outage}-{mode:?}");
        let hot = |sync: RedisSync| sync.cold_keys(false);
        let nodes = nodes_behind(&proxy, &server, 2, quota, mode, &prefix, hot);
        for (_, handle) in &nodes {
            handle.ready().await;
        }
        let started = Instant::now();
        while !nodes[0].0.check("k").is_allowed() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{outage}: no lease"
            );
            // Real time: the first lease comes with a round through the real Redis.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let first_admitted = Instant::now();
        // The admission reaches Redis before the outage.
        two_more(&nodes[0].1, |s| s.syncs, "round").await;
        match outage {
            "cut" => proxy.set_cut(true),
            _ => server.pause().unwrap(),
        }
        nodes[0].0.charge("k", 4).unwrap();
        nodes[0].0.refund("k", 2).unwrap();
        // Rounds fail meanwhile.
        two_more(&nodes[0].1, |s| s.errors, "failed round").await;
        match outage {
            "cut" => proxy.set_cut(false),
            _ => server.resume().unwrap(),
        }
        two_more(&nodes[0].1, |s| s.syncs, "round after the outage").await;
        for (_, handle) in nodes {
            handle.shutdown().await;
        }
        let mut con = server.connection().await.unwrap();
        let tat: u64 = redis::cmd("HGET")
            .arg(format!("{prefix}:sync:tb:{{k}}"))
            .arg("t")
            .query_async(&mut con)
            .await
            .unwrap();
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
        let owed = tat.saturating_sub(secs * 1_000_000 + micros) as f64 / 6e6;
        // 10/60 of a token a second refilled since the first admission (and 100 ms for
        // the reads, and a reconcile floor spread back over up to one interval).
        let refilled = (first_admitted.elapsed().as_secs_f64() + 0.1) / 6.0;
        assert!(
            (3.0 - refilled..=3.0).contains(&owed),
            "{outage} {mode:?}: owes {owed} tokens, not 3"
        );
    }
}

/// Asks `handle`'s task for rounds until `count` of its stats has grown by two (for at
/// most 10 s).
async fn two_more(handle: &SyncHandle, count: fn(&tollgate::sync::SyncStats) -> u64, what: &str) {
    let before = count(&handle.stats());
    let started = Instant::now();
    while count(&handle.stats()) < before + 2 {
        assert!(started.elapsed() < Duration::from_secs(10), "no {what}");
        handle.sync_now();
        // Real time: rounds through the real Redis process (or timing out against it).
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
