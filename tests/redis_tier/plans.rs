//! Plans in the Redis tier: each key's plan found as in process (assignment, resolver,
//! default), its quotas sent with every script call, one exact limit per key and plan
//! across sixteen nodes, and typed errors.

use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::plans::Plans;
use tollgate::redis::{FailMode, RedisBuilder, RedisError, RedisLimiter};
use tollgate::{Algorithm, ConfigError};

use crate::redis::{Keeper, assert_same, server};

/// The plans of these tests: the default "free" is compound.
const FREE: [&str; 2] = ["5/min", "20/hour"];
const PRO: &str = "100000/s";
const TINY: &str = "1/s";

fn resolve(key: &str) -> Option<&'static str> {
    match key.split('-').next() {
        Some("pro") => Some("pro"),
        Some("tiny") => Some("tiny"),
        Some("ghost") => Some("no-such-plan"),
        _ => None,
    }
}

fn redis_plans(url: &str, algorithm: Algorithm) -> RedisBuilder {
    RedisLimiter::builder(url, FREE[0].parse().unwrap())
        .also(FREE[1].parse().unwrap())
        .algorithm(algorithm)
        .timeout(Duration::from_secs(2))
        .default_plan("free")
        .plan("pro", [PRO.parse().unwrap()])
        .plan("tiny", [TINY.parse().unwrap()])
        .plan_resolver(|key| resolve(key).map(str::to_owned))
}

/// Random timelines through Redis (two nodes, one caller clock) and through the
/// in-process `Plans` with the same plans and resolver give the same decisions for
/// keys on each plan (a resolver's answer naming no plan decides by the default): each
/// algorithm, the compound default, 1/s and 100,000/s plans, unit and full costs, and
/// `check_in` naming a plan.
#[tokio::test]
async fn plans_decide_as_in_process() {
    let server = server();
    let mut x = 0x5851_f42d_4c95_7f2du64;
    let (mut steps, mut expired) = (0, 0);
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
    ] {
        let clock = ManualClock::new();
        let node = || {
            redis_plans(&server.url(), algorithm)
                .prefix(algorithm.name())
                .caller_clock(clock.clone())
                .build()
        };
        let nodes = [node().await.unwrap(), node().await.unwrap()];
        let local: Plans<String, ManualClock> = Plans::builder("free")
            .plan("free", FREE.map(|q| q.parse().unwrap()))
            .plan("pro", [PRO.parse().unwrap()])
            .plan("tiny", [TINY.parse().unwrap()])
            .algorithm(algorithm)
            .resolver(|key: &String| resolve(key))
            .clock(clock.clone())
            .build()
            .unwrap();
        let keys: Vec<String> = ["free-a", "pro-b", "tiny-c", "ghost-d", "free-e"]
            .iter()
            .map(|k| format!("{k}-{}", algorithm.name()))
            .collect();
        let watched: Vec<Vec<u8>> = keys.iter().flat_map(|k| nodes[0].redis_keys(k)).collect();
        let mut keeper = Keeper::new(&server).await;
        for step in 0..300 {
            crate::common::xorshift(&mut x);
            let advance = [0, 1, 10, 250_000, 1_000_000, 13_000_000][(x % 6) as usize];
            clock.advance(Duration::from_micros(advance));
            let key = &keys[((x >> 8) % keys.len() as u64) as usize];
            let remote = &nodes[((x >> 12) % 2) as usize];
            let plan = remote.plan_of(key);
            assert_eq!(plan, local.plan_of(key.as_str()), "{key}");
            let context = format!("{algorithm:?} {key} on {plan} step {step}");
            let capacity = remote
                .quotas_of(&plan)
                .unwrap()
                .iter()
                .fold(u64::MAX, |c, q| {
                    c.min(match algorithm {
                        Algorithm::TokenBucket => q.burst(),
                        _ => q.limit(),
                    })
                });
            let named = (x >> 20) % 9 == 0;
            let n = if !named && (x >> 16) % 7 == 0 {
                capacity
            } else {
                1
            };
            let (r, l) = if named {
                // The caller names the plan: the key's own.
                (
                    remote.check_in(&plan, key).await.unwrap(),
                    local.check_in(&plan, key.as_str()),
                )
            } else {
                (
                    remote.check_n(key, n).await.unwrap(),
                    local.check_n(key.as_str(), n).unwrap(),
                )
            };
            assert_same(&r, &l, &format!("n={n} {context}: redis {r:?} local {l:?}"));
            steps += 1;
            let gone = keeper.persist(&watched).await;
            if !gone.is_empty() {
                // A TTL of a millisecond (100,000/s) ended in real time before the keeper
                // removed it: both sides start the keys afresh.
                expired += gone.len();
                for k in &keys {
                    for node in &nodes {
                        node.reset(k).await.unwrap();
                    }
                    local.reset(k.as_str());
                }
            }
        }
        assert_eq!(nodes[0].plan_names().len(), 3);
    }
    assert_eq!(steps, 900);
    assert!(expired < 30, "{expired} keys expired in real time");
}

/// Sixteen nodes on one server, one caller clock that stands still: each key admits
/// exactly its plan's limit in total, whichever nodes check it, for keys on every plan
/// (the resolver's and an operator's, assigned on every node), and an upgrade moves a
/// key to its new plan's limit with what it used carried over by position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_nodes_hold_each_plans_limit_exactly() {
    let server = server();
    let clock = ManualClock::new();
    let mut nodes = Vec::new();
    for _ in 0..16 {
        let node = RedisLimiter::builder(&server.url(), "10/min".parse().unwrap())
            .algorithm(Algorithm::FixedWindow)
            .prefix("plans16")
            .caller_clock(clock.clone())
            .timeout(Duration::from_secs(2))
            .default_plan("free")
            .plan("pro", ["30/min".parse().unwrap()])
            .plan_resolver(|key| key.starts_with("pro").then(|| "pro".to_owned()))
            .build()
            .await
            .unwrap();
        node.assign("vip", "pro").unwrap();
        nodes.push(node);
    }
    let keys = ["free-1", "free-2", "pro-1", "pro-2", "vip"];
    let mut admitted = [0u64; 5];
    for round in 0..6 {
        for (i, key) in keys.iter().enumerate() {
            for node in &nodes {
                admitted[i] += u64::from(node.check(key).await.unwrap().is_allowed());
            }
            assert!(round < 2 || admitted[i] == [10, 10, 30, 30, 30][i], "{key}");
        }
    }
    assert_eq!(admitted, [10, 10, 30, 30, 30]);
    // An upgrade, on every node: the 10 used of the minute count toward the 30.
    for node in &nodes {
        node.assign("free-1", "pro").unwrap();
    }
    let mut upgraded = 0;
    for node in nodes.iter().cycle().take(64) {
        upgraded += u64::from(node.check("free-1").await.unwrap().is_allowed());
    }
    assert_eq!(upgraded, 20);
    assert_eq!(nodes[3].unassign("free-1").as_deref(), Some("pro"));
    assert_eq!(nodes[3].plan_of("free-1").as_ref(), "free");
    // The next minute, each plan's limit afresh.
    clock.advance(Duration::from_secs(60));
    let d = nodes[7].check("pro-1").await.unwrap();
    assert!(d.is_allowed());
    assert_eq!((d.limit(), d.remaining()), (30, 29));
}

/// Unknown plans and bad definitions are typed errors, before any I/O; a fail mode
/// decides by the key's plan's quotas while Redis is paused.
#[tokio::test]
async fn plan_errors_are_typed_and_fail_modes_follow_the_plan() {
    let server = server();
    let limiter = redis_plans(&server.url(), Algorithm::SlidingWindow)
        .prefix("plan-errors")
        .timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    let unknown = |r: Result<_, RedisError>| matches!(r, Err(RedisError::Config(ConfigError::UnknownPlan(ref p))) if p == "gold");
    assert!(unknown(limiter.check_in("gold", "k").await.map(drop)));
    assert!(unknown(limiter.assign("k", "gold")));
    assert!(unknown(limiter.quotas_of("gold").map(drop)));
    assert_eq!(
        limiter.quotas_of("free").unwrap(),
        FREE.map(|q| q.parse().unwrap())
    );
    let invalid = |builder: RedisBuilder| async move {
        match builder.build().await {
            Err(RedisError::Config(ConfigError::InvalidPlan { plan, why })) => (plan, why),
            other => panic!("{other:?}"),
        }
    };
    let base = || RedisLimiter::builder(&server.url(), "1/s".parse().unwrap());
    assert_eq!(
        invalid(base().plan("pro", ["1/s".parse().unwrap()]).plan("pro", [])).await,
        (
            "pro".to_owned(),
            "defined twice (or named as the default plan)"
        )
    );
    assert_eq!(
        invalid(base().plan("default", ["1/s".parse().unwrap()]))
            .await
            .0,
        "default"
    );
    assert_eq!(
        invalid(base().plan("empty", [])).await.1,
        "a plan needs at least one quota"
    );
    assert_eq!(
        invalid(base().plan("", ["1/s".parse().unwrap()])).await.1,
        "a plan needs a name"
    );
    // A calendar quota in a token bucket plan: the scripts' own error.
    assert!(matches!(
        base()
            .plan("monthly", ["100/month calendar".parse().unwrap()])
            .build()
            .await,
        Err(RedisError::Config(ConfigError::CalendarUnsupported { .. }))
    ));

    server.pause().unwrap();
    let pro = limiter.check_or("pro-x", FailMode::LocalShare).await;
    let free = limiter.check_or("free-x", FailMode::LocalShare).await;
    server.resume().unwrap();
    assert_eq!((pro.limit(), free.limit()), (100_000, 5));
    assert!(pro.is_allowed() && free.is_allowed());
}
