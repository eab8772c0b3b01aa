//! The penalty box in the Redis tier: blocks decided by the check's own script call, the
//! same as in process at every instant, shared by every node, and held by the first
//! tier's deny cache until they end, with no Redis call.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::redis::{RedisError, RedisLimiter};
use tollgate::{Algorithm, ConfigError, RateLimiter};

use crate::redis::{Keeper, assert_same, server};
use crate::redis_first_tier::script_calls;

/// A penalty: the block, and the denies within a window that start one.
#[derive(Clone, Copy, Debug)]
struct Penalty {
    block: Duration,
    after: Option<(u32, Duration)>,
}

/// Random timelines through Redis (two nodes on one caller clock, with their deny
/// caches) and through the in-process limiter with the same penalty give the same
/// decisions at every step: each algorithm, 1/s to 100,000/s, a block after one deny and
/// after three within 30 s, unit and full-capacity costs, and an operator's blocks and
/// unblocks between checks. The blocks are at least the quotas' periods, so that a
/// block's retry and reset are its end on both sides.
#[tokio::test]
async fn blocks_decide_as_in_process_on_every_node() {
    let server = server();
    let penalties = [
        Penalty {
            block: Duration::from_secs(600),
            after: None,
        },
        Penalty {
            block: Duration::from_secs(120),
            after: Some((3, Duration::from_secs(30))),
        },
    ];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let (mut blocked, mut steps, mut expired) = (0, 0, 0);
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
    ] {
        for quota in ["1/s", "100000/s", "5/min"] {
            for penalty in penalties {
                let clock = ManualClock::new();
                let node = |clock: ManualClock| {
                    let mut builder = RedisLimiter::builder(&server.url(), quota.parse().unwrap())
                        .algorithm(algorithm)
                        .timeout(Duration::from_secs(2))
                        .caller_clock(clock)
                        .block_for(penalty.block);
                    if let Some((denies, within)) = penalty.after {
                        builder = builder.block_after(denies, within);
                    }
                    builder.build()
                };
                let nodes = [
                    node(clock.clone()).await.unwrap(),
                    node(clock.clone()).await.unwrap(),
                ];
                let mut local = RateLimiter::builder(quota.parse().unwrap())
                    .algorithm(algorithm)
                    .clock(clock.clone())
                    .block_for(penalty.block);
                if let Some((denies, within)) = penalty.after {
                    local = local.block_after(denies, within);
                }
                let local: RateLimiter<String, ManualClock> = local.build().unwrap();
                let capacity = nodes[0].capacity();
                let prefix = format!("{}-{quota}-{:?}", algorithm.name(), penalty.after);
                let keys: Vec<String> = (0..2).map(|k| format!("{prefix}-{k}")).collect();
                let watched: Vec<Vec<u8>> = keys
                    .iter()
                    .flat_map(|k| {
                        let mut names = nodes[0].redis_keys(k);
                        names.push(nodes[0].penalty_box_key(k).unwrap());
                        names
                    })
                    .collect();
                let mut keeper = Keeper::new(&server).await;
                for step in 0..250 {
                    crate::common::xorshift(&mut x);
                    let advance = [0, 1, 10, 300_000, 1_000_000, 7_000_000, 31_000_000]
                        [(x % 7) as usize]
                        + if x % 53 == 0 { 600_000_000 } else { 0 };
                    clock.advance(Duration::from_micros(advance));
                    let key = &keys[((x >> 8) % 2) as usize];
                    let remote = &nodes[((x >> 9) % 2) as usize];
                    let context = format!("{algorithm:?} {quota} {penalty:?} step {step}");
                    match (x >> 12) % 40 {
                        0 => {
                            let d = Duration::from_secs(90 + (x >> 20) % 900);
                            remote.block(key, d).await.unwrap();
                            local.block(key.as_str(), d);
                            // The other node's cache is emptied by a message, which may
                            // come after its next check: it blocks the key too (the
                            // same end, on the same clock).
                            for node in &nodes {
                                node.block(key, d).await.unwrap();
                            }
                        }
                        1 => {
                            let r = remote.unblock(key).await.unwrap();
                            let l = local.unblock(key.as_str());
                            assert_eq!(r, l, "unblock: {context}");
                            // The other node's cache hears of it by a message, which
                            // may come after its next check: it forgets the key too.
                            for node in &nodes {
                                node.unblock(key).await.unwrap();
                            }
                        }
                        _ => {}
                    }
                    let n = if (x >> 16) % 5 == 0 { capacity } else { 1 };
                    let r = remote.check_n(key, n).await.unwrap();
                    let l = local.check_n(key.as_str(), n).unwrap();
                    assert_same(&r, &l, &format!("n={n} {context}: redis {r:?} local {l:?}"));
                    let b = remote.blocked_for(key).await.unwrap();
                    assert_eq!(b, local.blocked_for(key.as_str()), "blocked_for: {context}");
                    blocked += usize::from(b.is_some());
                    steps += 1;
                    let gone = keeper.persist(&watched).await;
                    if !gone.is_empty() {
                        // A TTL of a millisecond ended in real time before the keeper
                        // removed it: both sides start the keys afresh.
                        expired += gone.len();
                        for k in &keys {
                            for node in &nodes {
                                node.reset(k).await.unwrap();
                                node.unblock(k).await.unwrap();
                            }
                            local.reset(k.as_str());
                            local.unblock(k.as_str());
                        }
                    }
                }
            }
        }
    }
    assert!(blocked > steps / 5, "{blocked} of {steps} steps blocked");
    assert!(
        expired < steps / 50,
        "{expired} keys expired in {steps} steps"
    );
}

/// A blocked key costs no Redis call behind the first tier, on the node that blocked it
/// and, after one call, on another: its checks of every cost are denied in process until
/// the block ends (counted by Redis itself, `INFO commandstats`), even while Redis is
/// paused. An operator's unblock empties every node's cache, after which Redis decides
/// again.
#[tokio::test]
async fn a_blocked_key_costs_no_redis_call() {
    let server = server();
    let node = || {
        RedisLimiter::builder(&server.url(), "2/s".parse().unwrap())
            .prefix("penalty-calls")
            .timeout(Duration::from_millis(300))
            .block_for(Duration::from_secs(30))
            .build()
    };
    let (a, b) = (node().await.unwrap(), node().await.unwrap());
    assert!(a.check("k").await.unwrap().is_allowed());
    assert!(a.check("k").await.unwrap().is_allowed());
    let denied = a.check("k").await.unwrap();
    assert!(!denied.is_allowed());
    let retry = denied.retry_after().unwrap();
    assert!(
        retry > Duration::from_secs(29) && retry <= Duration::from_secs(30),
        "{retry:?}"
    );
    // The other node learns the block from one call.
    assert!(!b.check("k").await.unwrap().is_allowed());
    let before = script_calls(&server).await;
    for n in [1, 2, 1, 2] {
        for node in [&a, &b] {
            for _ in 0..250 {
                let d = node.check_n("k", n).await.unwrap();
                assert!(!d.is_allowed());
                assert!(d.retry_after().unwrap() > Duration::from_secs(28));
            }
        }
    }
    // A cost beyond capacity is an error, blocked or not, before any call.
    assert!(matches!(
        a.check_n("k", 3).await,
        Err(RedisError::InsufficientCapacity(_))
    ));
    assert_eq!(
        script_calls(&server).await,
        before,
        "a blocked key called Redis"
    );
    assert_eq!(a.stats().cached_denies + b.stats().cached_denies, 2_000);
    // While Redis is paused, the blocked key is still answered at once, and an
    // unblocked one fails within its timeout.
    server.pause().unwrap();
    for node in [&a, &b] {
        assert!(!node.check("k").await.unwrap().is_allowed());
    }
    assert!(matches!(
        a.check("other").await,
        Err(RedisError::Timeout(_))
    ));
    server.resume().unwrap();

    assert!(a.unblock("k").await.unwrap());
    // b's cache empties when the message arrives; its checks then reach Redis, which
    // admits once the 2/s has refilled (a deny before that would block again).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        if b.check("k").await.unwrap().is_allowed() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b never heard the unblock"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(a.blocked_for("k").await.unwrap(), None);
}

/// Manual blocks on a limiter that only reads the box (`penalty_box(true)`): a deny
/// blocks nothing, an operator's block denies every node, and a limiter that does not
/// read the box refuses blocks with a typed error, as do bad penalties.
#[tokio::test]
async fn operators_block_and_bad_penalties_are_typed_errors() {
    let server = server();
    let reader = RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
        .prefix("penalty-manual")
        .penalty_box(true)
        .build()
        .await
        .unwrap();
    assert!(reader.check("k").await.unwrap().is_allowed());
    let denied = reader.check("k").await.unwrap();
    assert!(!denied.is_allowed());
    assert!(denied.retry_after().unwrap() <= Duration::from_secs(60));
    assert_eq!(
        reader.blocked_for("k").await.unwrap(),
        None,
        "no automatic block"
    );
    reader.block("k", Duration::from_secs(3_600)).await.unwrap();
    let blocked = reader.check("k").await.unwrap();
    assert!(blocked.retry_after().unwrap() > Duration::from_secs(3_500));
    // A shorter block leaves the longer one.
    reader.block("k", Duration::from_secs(5)).await.unwrap();
    assert!(reader.blocked_for("k").await.unwrap().unwrap() > Duration::from_secs(3_500));

    let plain = RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
        .prefix("penalty-manual")
        .build()
        .await
        .unwrap();
    for refused in [
        plain.block("k", Duration::from_secs(1)).await,
        reader.block("k", Duration::ZERO).await,
    ] {
        assert!(
            matches!(
                refused,
                Err(RedisError::Config(ConfigError::InvalidPenalty(_)))
            ),
            "{refused:?}"
        );
    }
    assert!(matches!(
        plain.unblock("k").await,
        Err(RedisError::Config(ConfigError::InvalidPenalty(_)))
    ));
    let bad = |builder: tollgate::redis::RedisBuilder| async move {
        match builder.build().await {
            Err(RedisError::Config(ConfigError::InvalidPenalty(why))) => why,
            other => panic!("{other:?}"),
        }
    };
    let quota = || "1/s".parse().unwrap();
    assert!(
        bad(RedisLimiter::builder(&server.url(), quota()).block_for(Duration::ZERO))
            .await
            .contains("block_for(0)")
    );
    assert!(
        bad(RedisLimiter::builder(&server.url(), quota()).block_after(2, Duration::from_secs(1)))
            .await
            .contains("without block_for")
    );
    assert!(
        bad(RedisLimiter::builder(&server.url(), quota())
            .block_for(Duration::from_secs(1))
            .block_after(0, Duration::from_secs(1)))
        .await
        .contains("at least 1 deny")
    );
    // The box of a key that is a secret carries its digest, as the state does.
    let hashed = RedisLimiter::builder(&server.url(), quota())
        .hash_keys(b"pepper")
        .penalty_box(true)
        .build()
        .await
        .unwrap();
    let name = hashed.penalty_box_key("sk_live_123").unwrap();
    assert!(
        !String::from_utf8_lossy(&name).contains("sk_live"),
        "{name:?}"
    );
}

/// Denies are counted in Redis across sixteen nodes: with `block_after(16, 1 min)`, a
/// used 1/min key is blocked at its sixteenth deny whichever nodes denied it, and every
/// node then denies it to the block's end; at 100,000/s, sixteen nodes checking a key
/// below its quota never block it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_nodes_count_denies_toward_one_block() {
    let server = server();
    let clock = ManualClock::new();
    let mut nodes = Vec::new();
    for _ in 0..16 {
        let node = RedisLimiter::builder(&server.url(), "1/min".parse().unwrap())
            .prefix("box16")
            .caller_clock(clock.clone())
            .timeout(Duration::from_secs(2))
            .block_for(Duration::from_secs(600))
            .block_after(16, Duration::from_secs(60))
            .build()
            .await
            .unwrap();
        nodes.push(node);
    }
    assert!(nodes[0].check("k").await.unwrap().is_allowed());
    for (i, node) in nodes.iter().enumerate().take(15) {
        let denied = node.check("k").await.unwrap();
        let retry = denied.retry_after().unwrap();
        assert!(retry <= Duration::from_secs(60), "deny {i}: {retry:?}");
    }
    assert_eq!(nodes[9].blocked_for("k").await.unwrap(), None);
    let sixteenth = nodes[15].check("k").await.unwrap();
    assert_eq!(sixteenth.retry_after(), Some(Duration::from_secs(600)));
    for node in &nodes {
        assert_eq!(
            node.check("k").await.unwrap().retry_after(),
            Some(Duration::from_secs(600))
        );
    }
    clock.advance(Duration::from_secs(601));
    assert!(nodes[3].check("k").await.unwrap().is_allowed());

    let mut fast = Vec::new();
    for _ in 0..16 {
        let node = RedisLimiter::builder(&server.url(), "100000/s".parse().unwrap())
            .prefix("box16-fast")
            .caller_clock(clock.clone())
            .timeout(Duration::from_secs(2))
            .block_for(Duration::from_secs(600))
            .build()
            .await
            .unwrap();
        fast.push(node);
    }
    for _ in 0..200 {
        for node in &fast {
            assert!(node.check("hot").await.unwrap().is_allowed());
        }
    }
    assert_eq!(fast[0].blocked_for("hot").await.unwrap(), None);
}
