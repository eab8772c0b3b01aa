//! The node against the model of Redis, and alone.

use std::time::Duration;

use super::*;
use crate::RateLimiter;
use crate::algorithm::Algorithm;
use crate::quota::Quota;
use crate::sync::config::{RedisSync, SyncMode};
use crate::sync::protocol::Shape;

const MS: u64 = 1_000_000;

/// A node of `config` for a limiter of `quota`, on a store as the limiter builds it.
fn node(config: RedisSync, quota: Quota) -> (Node<String>, Store<String, SyncCell>) {
    node_of(Algorithm::TokenBucket, config, quota)
}

/// [`node`] for the limiter's `algorithm`.
fn node_of(
    algorithm: Algorithm,
    config: RedisSync,
    quota: Quota,
) -> (Node<String>, Store<String, SyncCell>) {
    let settings = config.validate(quota.period_ns()).unwrap();
    let (shape, capacity) = Shape::with_capacity(algorithm, quota).unwrap();
    let node_config = NodeConfig::new(7, &config, &settings, algorithm, quota, capacity).unwrap();
    let mut policy = SyncPolicy::new(quota, capacity, 0, node_config.timing.interval_ns);
    policy.ticks = shape.ticks_per_token();
    let (_, limits, _) = RateLimiter::<String>::builder(quota).into_parts().unwrap();
    let store = Store::new(limits, node_config.initial_policy(policy));
    (Node::new(node_config, 1, 0), store)
}

/// Runs the node to `until` (ns) with every transmit failing at once (Redis refuses
/// the connection), waking it at each of its timeouts.
fn refused(node: &mut Node<String>, store: &Store<String, SyncCell>, from: u64, until: u64) {
    let mut now = from;
    while now < until {
        if let Some(t) = node.poll_transmit(now, store) {
            let failure = Failure {
                kind: "unavailable",
                message: "refused".into(),
            };
            node.handle_replies(now, store, t.id, vec![Err(failure); t.pipelines.len()]);
            continue;
        }
        now = node.poll_timeout().max(now + 1).min(until);
        node.handle_timeout(now, store);
    }
}

/// Runs the node to `until` (ns) against the model of Redis, every reply coming at
/// once.
fn served(
    node: &mut Node<String>,
    store: &Store<String, SyncCell>,
    redis: &mut crate::sync::model::Server,
    from: u64,
    until: u64,
) {
    served_after(node, store, redis, 0, from, until);
}

/// Runs the node to `until` (ns), or until it closes, against the model of Redis, which
/// runs each transmit when it is sent; its replies come `round_trip` ns later.
fn served_after(
    node: &mut Node<String>,
    store: &Store<String, SyncCell>,
    redis: &mut crate::sync::model::Server,
    round_trip: u64,
    from: u64,
    until: u64,
) {
    let mut now = from;
    while now < until && !node.is_closed() {
        if let Some(t) = node.poll_transmit(now, store) {
            let replies = t
                .pipelines
                .iter()
                .map(|p| {
                    Ok(p.iter()
                        .map(|c| redis.run(c, now / 1_000).unwrap())
                        .collect())
                })
                .collect();
            now += round_trip;
            node.handle_replies(now, store, t.id, replies);
            continue;
        }
        now = node.poll_timeout().max(now + 1).min(until);
        node.handle_timeout(now, store);
    }
}

/// What a round grants ends, on the node, no later than Redis ends it, whatever the
/// round trip: the share Redis reserves for the node (the answer's `until`, by Redis's
/// clock when the round ran, which the node hears a round trip later at most), and a
/// window counter's lease in lease mode (its window ends by Redis's clock).
#[test]
fn what_a_round_grants_ends_before_redis_ends_it() {
    let quota = Quota::per_second(100).unwrap();
    for (algorithm, mode) in [
        (Algorithm::TokenBucket, SyncMode::Reconcile),
        (Algorithm::SlidingWindow, SyncMode::Lease),
    ] {
        let config = RedisSync::new("redis://127.0.0.1:1/")
            .mode(mode)
            .cold_keys(false)
            .share_ttl(Duration::from_secs(2));
        let (mut node, store) = node_of(algorithm, config, quota);
        let key = node.config().redis_key(&"k".to_string());
        let mut redis = crate::sync::model::Server::default();
        let round_trip = 30 * MS;
        served_after(&mut node, &store, &mut redis, round_trip, 0, 400 * MS);
        for at in [400, 930, 1_970] {
            let now = at * MS;
            assert!(store.check("k", || now, 1, u64::MAX).is_ok());
            served_after(
                &mut node,
                &store,
                &mut redis,
                round_trip,
                now,
                now + 150 * MS,
            );
            let (share_until, expires) = store
                .with_state(&"k".to_string(), |cell| {
                    (
                        cell.hot.aside.books.lock().share_until,
                        cell.hot.expires.load(std::sync::atomic::Ordering::Acquire),
                    )
                })
                .unwrap();
            let record = redis.key(&key).unwrap().nodes[&7];
            assert!(
                record.until > 0,
                "{algorithm:?} at {at} ms: a share reserved"
            );
            // (Redis's clock is in whole µs: the node's end may fall within its last µs.)
            assert!(
                share_until < (record.until + 1) * 1_000,
                "{algorithm:?} at {at} ms: share until {share_until}, Redis {}",
                record.until * 1_000
            );
            if mode == SyncMode::Lease {
                assert!(
                    expires < u64::MAX,
                    "{algorithm:?} at {at} ms: a lease that ends"
                );
                let window_end = (record.window + 1) * 1_000_000_000;
                assert!(
                    expires < window_end + 1_000,
                    "{algorithm:?} at {at} ms: lease until {expires}, window until {window_end}"
                );
            }
        }
    }
}

/// In the fallback a reserved share refills once per turn of the schedule's timer:
/// neither rounds asked for early (a key that is denied wakes the node) nor rounds that
/// time out add to it, so a node cut off from Redis (refused, or blackholed) admits at
/// its share's rate and no faster.
#[test]
fn the_fallback_refills_a_share_once_an_interval() {
    let quota = Quota::per_second(100).unwrap();
    for blackholed in [false, true] {
        let config = RedisSync::new("redis://127.0.0.1:1/")
            .cold_keys(false)
            .share_ttl(Duration::from_secs(30));
        let (mut node, store) = node(config, quota);
        let mut redis = crate::sync::model::Server::default();
        served(&mut node, &store, &mut redis, 0, 1_000 * MS);
        assert!(store.check("k", || 1_000 * MS, 1, u64::MAX).is_ok());
        served(&mut node, &store, &mut redis, 1_000 * MS, 1_500 * MS);
        // Cut off from now on; a check every ms, a wake at each deny.
        let mut admitted = [0u64; 6];
        let mut now = 1_500 * MS;
        while now < 6_000 * MS {
            if let Some(t) = node.poll_transmit(now, &store) {
                if !blackholed {
                    let failure = Failure {
                        kind: "unavailable",
                        message: "refused".into(),
                    };
                    let replies = vec![Err(failure); t.pipelines.len()];
                    node.handle_replies(now, &store, t.id, replies);
                }
                continue;
            }
            if now >= node.poll_timeout() {
                node.handle_timeout(now, &store);
            }
            if store.check("k", || now, 1, u64::MAX).unwrap().is_allowed() {
                admitted[(now / 1_000 / MS) as usize] += 1;
            } else {
                node.wake(now, &store);
            }
            now += MS;
        }
        assert!(node.stats().fallback_active, "blackholed {blackholed}");
        // One node: its share is the whole rate, 5 tokens a turn of the 50 ms timer:
        // over 3 s, 60 turns, give or take one at each end.
        let total: u64 = admitted[3..6].iter().sum();
        assert!(
            (295..=305).contains(&total),
            "blackholed {blackholed}: {admitted:?}"
        );
    }
}

/// After its last rounds, a stopped node denies every check: a new key's fresh
/// overdraft (reconcile mode), or a cold key's share, would be admitted with no
/// round to report it.
#[test]
fn a_stopped_node_denies_every_check() {
    let quota = Quota::per_second(100).unwrap();
    for cold in [false, true] {
        let config = RedisSync::new("redis://127.0.0.1:1/").cold_keys(cold);
        let (mut node, store) = node(config, quota);
        let mut redis = crate::sync::model::Server::default();
        served(&mut node, &store, &mut redis, 0, 500 * MS);
        let check = |key: &str, now: u64| store.check(key, || now, 1, u64::MAX).unwrap();
        assert!(check("before", 500 * MS).is_allowed(), "cold {cold}");
        node.close(500 * MS);
        served(&mut node, &store, &mut redis, 500 * MS, 600 * MS);
        assert!(node.is_closed() && node.is_settled());
        for key in ["before", "new"] {
            let decision = check(key, 700 * MS);
            assert!(!decision.is_allowed(), "cold {cold}, {key}: {decision:?}");
        }
    }
}

/// Nodes of one prefix that sync by other terms find out from what Redis holds: the
/// first setting that differs is in the stats and an event, and goes once they agree.
#[test]
fn nodes_that_differ_in_their_terms_say_so() {
    let quota = Quota::per_second(100).unwrap();
    let config = RedisSync::new("redis://127.0.0.1:1/");
    let mut redis = crate::sync::model::Server::default();
    let (mut a, store_a) = node(config.clone(), quota);
    served(&mut a, &store_a, &mut redis, 0, 100 * MS);
    assert_eq!(a.stats().settings_differ, None);
    for (other, setting) in [
        (config.clone().cold_keys(false), "cold_keys"),
        (config.clone().mode(SyncMode::Lease), "mode"),
    ] {
        let (mut b, store_b) = node(other, quota);
        b.config.id = 8;
        served(&mut b, &store_b, &mut redis, 100 * MS, 200 * MS);
        assert_eq!(b.stats().settings_differ, Some(setting));
        let events: Vec<Event> = std::iter::from_fn(|| b.poll_event()).collect();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, Event::Disagreement(d) if d.setting == setting)),
            "{events:?}"
        );
    }
    // Node A sees them too at its next write of its terms (every 10 s).
    served(&mut a, &store_a, &mut redis, 100 * MS, 10_200 * MS);
    assert!(a.stats().settings_differ.is_some());
    // Once they have gone stale (30 s), it agrees again.
    served(&mut a, &store_a, &mut redis, 10_200 * MS, 45_000 * MS);
    assert_eq!(a.stats().settings_differ, None);
}

/// A first round whose read of the announcements comes back while its heartbeat is
/// lost tells no node count: the node admits nothing on its cold keys until one
/// does (a share "of no node" would be the whole quota).
#[test]
fn a_read_without_a_node_count_vouches_for_no_share() {
    let quota = Quota::per_second(100).unwrap();
    let (mut node, store) = node(RedisSync::new("redis://127.0.0.1:1/"), quota);
    let mut redis = crate::sync::model::Server::default();
    node.handle_timeout(1, &store);
    let t = node.poll_transmit(1, &store).unwrap();
    // The round's calls (the heartbeat) time out; the read of the announcements (and
    // of the terms) comes back.
    let replies = t
        .pipelines
        .iter()
        .map(|p| {
            if p.iter().any(|c| c.script == wire::Script::Round) {
                Err(Failure::timeout())
            } else {
                Ok(p.iter().map(|c| redis.run(c, 0).unwrap()).collect())
            }
        })
        .collect();
    node.handle_replies(2 * MS, &store, t.id, replies);
    let admitted = (0..100)
        .filter(|_| {
            store
                .check("k", || 3 * MS, 1, u64::MAX)
                .unwrap()
                .is_allowed()
        })
        .count();
    assert_eq!(admitted, 0);
    assert!(!node.stats().cold_tier, "{:?}", node.stats());
}

#[test]
fn a_node_that_never_reached_redis_serves_its_keys_from_the_fallback() {
    let quota = Quota::per_second(100).unwrap();
    let config = RedisSync::new("redis://127.0.0.1:1/")
        .interval(Duration::from_millis(10))
        .timeout(Duration::from_millis(20));
    let (mut node, store) = node(config, quota);
    let check = |key: &str, now: u64| store.check(key, || now, 1, u64::MAX).unwrap().is_allowed();
    assert!(
        !check("a", 0) && !check("b", 0),
        "nothing before the first round"
    );
    refused(&mut node, &store, 0, 100 * MS);
    assert!(node.stats().fallback_active);
    // Keys seen after the fallback began start hot, and get their budget at the
    // next refill: `⌊100 / 1⌋` each (no node count known), then nothing more.
    let _ = (check("a", 100 * MS), check("b", 100 * MS));
    refused(&mut node, &store, 100 * MS, 200 * MS);
    let admitted = (0..150).filter(|_| check("a", 200 * MS)).count();
    assert_eq!(admitted, 100);
    assert!(check("b", 200 * MS));
    assert_eq!(node.stats().keys_on_budget, 2, "{:?}", node.stats());
    refused(&mut node, &store, 200 * MS, 2_000 * MS);
    assert!(!check("a", 2_000 * MS), "one budget per outage");
}
