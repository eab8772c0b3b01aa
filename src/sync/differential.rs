//! The Lua script against its specification: random key states, records and rounds are
//! written to a real redis-server, the script runs one round, and the state it leaves and
//! the answer it gives must equal what `protocol::serve` computes at the same instant.

use proptest::prelude::*;
use redis::Commands;

use super::model::{self, Global, KeyState, Record};
use super::protocol::{Params, Request, Shape, SharedQuota};
use super::wire::{RoundCall, RoundReply, parse_id};
use tollgate_testing::LocalRedis;

const KEY: &str = "diff:{k}";
const REGISTRY: &str = "{diff}:nodes";
const NODES: [u64; 4] = [0xa, 0xb, 0xc, 0xd];

fn record(now: u64) -> impl Strategy<Value = Record> {
    (
        (1u64..50, 0u64..5_000, 0u64..3_000_000, 0u64..3_000_000),
        (
            0u64..(1 << 25),
            // Heard from recently, or silent for up to 2 s (its share reserved or not).
            0u64..2_000_000,
            0u64..3,
            1u64..4,
            0u64..30,
            0u64..30,
        ),
        (
            0u64..=(1 << 20),
            0u64..3_000_000,
            0u64..2_000_000,
            0u64..400_000,
            0u64..400_000,
            0u64..600_000,
            0u64..20,
            0u64..2,
        ),
    )
        .prop_map(
            move |(
                (seq, reserved, credit, credit_ago),
                (demand, demand_ago, w, epoch, unmet, overdraft),
                (share, until_after, charged_after, prepaid, landed, landed_ahead, owes, fallback),
            )| {
                let demand_at = now.saturating_sub(demand_ago);
                Record {
                    seq,
                    reserved,
                    credit,
                    credit_at: now.saturating_sub(credit_ago),
                    demand,
                    demand_at,
                    window: w,
                    epoch,
                    unmet,
                    overdraft,
                    share,
                    until: demand_at + until_after,
                    charged_to: if charged_after == 0 {
                        0
                    } else {
                        demand_at + charged_after
                    },
                    prepaid,
                    landed: landed.min(prepaid),
                    landed_end: if landed_ahead == 0 {
                        0
                    } else {
                        now + landed_ahead - 300_000
                    },
                    owes,
                    fallback,
                }
            },
        )
}

#[derive(Clone, Debug)]
struct Case {
    params: Params,
    global: Global,
    records: Vec<Option<Record>>,
    node: usize,
    request: Request,
    /// Each node's last heartbeat, µs ago (none: not in the registry).
    heard_ago: Vec<Option<u64>>,
}

/// A key's quota from generated numbers: the default (never changed, or changed back at a
/// version: half the cases), or one of the shape's kind; versions are few, so that ties
/// happen.
fn key_quota((kind, version, x, y): (u64, u64, u64, u64), shape: Shape) -> SharedQuota {
    let quota = match (kind, shape) {
        (0..=2, _) => return SharedQuota::default(),
        (3, _) => return SharedQuota::default_at(version),
        (_, Shape::TokenBucket { .. }) => SharedQuota {
            version,
            limit: y + 1,
            period: (y + 1) * x * 20 + y,
            burst: x % 100 + 1,
        },
        _ => SharedQuota {
            version,
            limit: x,
            period: (y % 3 + 1) * 1_000_000,
            burst: x,
        },
    };
    assert!(quota.fits(shape));
    quota
}

fn case(now: u64) -> impl Strategy<Value = Case> {
    let shape = prop_oneof![
        (1u64..200_000, 0u64..100).prop_map(|(t, burst)| Shape::TokenBucket { t, tau: t * burst }),
        (1u64..10_000, 1u64..4).prop_map(|(limit, s)| Shape::SlidingWindow {
            limit,
            period: s * 1_000_000,
        }),
        (1u64..10_000, 1u64..4).prop_map(|(limit, s)| Shape::FixedWindow {
            limit,
            period: s * 1_000_000,
        }),
    ];
    (
        shape,
        (
            0u64..2,
            1_000u64..400_000,
            1_000u64..300_000,
            0u64..3_000_000,
        ),
        (0u64..6_000_000, 0u64..3, 0u64..20_000, 0u64..20_000),
        prop::collection::vec(prop::option::of(record(now)), 4),
        (
            0usize..4,
            prop::collection::vec(prop::option::of(0u64..2_000_000), 4),
        ),
        (
            (1u64..60, 1u64..4, 0u64..6_000, 0u64..50, 0u64..6_000),
            (
                0u64..(1 << 25),
                0u64..200,
                0u64..3_000_000,
                0u64..400_000,
                0u64..20,
                0u64..20,
            ),
        ),
        (
            (0u64..6, 1u64..4, 1u64..10_000, 0u64..4),
            (0u64..6, 1u64..4, 1u64..10_000, 0u64..4),
        ),
    )
        .prop_map(
            move |(
                shape,
                (reconcile, hold, demand_ttl, share_ttl),
                (ago, w, prev, cur),
                records,
                (node, heard_ago),
                (
                    (seq, epoch, floor, keep, known),
                    (demand, want, anchor_ago, deadline_in, local, beyond),
                ),
                (stored_quota, node_quota),
            )| {
                let window = shape
                    .period()
                    .and_then(|period| (w < 2).then(|| (now / period).saturating_sub(w)));
                Case {
                    params: Params {
                        shape,
                        overdraft_horizon: reconcile * hold / 2,
                        hold,
                        demand_ttl,
                        retain_ms: 2_000,
                        share_ttl,
                        silent_after: demand_ttl * 2,
                    },
                    global: Global {
                        tat: (now + 3_000_000).saturating_sub(ago),
                        window,
                        prev,
                        cur,
                        quota: key_quota(stored_quota, shape),
                    },
                    records,
                    node,
                    heard_ago,
                    request: Request {
                        seq,
                        epoch,
                        floor,
                        keep: keep.min(floor),
                        known,
                        demand,
                        want,
                        anchor: if anchor_ago == 0 {
                            0
                        } else {
                            now.saturating_sub(anchor_ago)
                        },
                        // Up to 1 s past (a late round) or 3 s ahead.
                        deadline: if deadline_in == 0 {
                            0
                        } else {
                            (now + deadline_in * 10 - 1_000_000).max(1)
                        },
                        local,
                        beyond: beyond.min(local),
                        quota: key_quota(node_quota, shape),
                    },
                }
            },
        )
}

/// A record as the script stores it: its 18 numbers as little-endian doubles.
fn encode(r: &Record) -> Vec<u8> {
    [
        r.seq,
        r.reserved,
        r.credit,
        r.credit_at,
        r.demand,
        r.demand_at,
        r.window,
        r.epoch,
        r.unmet,
        r.overdraft,
        r.share,
        r.until,
        r.charged_to,
        r.prepaid,
        r.landed,
        r.landed_end,
        r.owes,
        r.fallback,
    ]
    .iter()
    .flat_map(|&n| {
        assert!(n < 1 << 53, "exact in a double");
        (n as f64).to_le_bytes()
    })
    .collect()
}

fn decode(v: &[u8]) -> Record {
    assert_eq!(v.len(), 144, "a record is 18 doubles");
    let n: Vec<u64> = v
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as u64)
        .collect();
    Record {
        seq: n[0],
        reserved: n[1],
        credit: n[2],
        credit_at: n[3],
        demand: n[4],
        demand_at: n[5],
        window: n[6],
        epoch: n[7],
        unmet: n[8],
        overdraft: n[9],
        share: n[10],
        until: n[11],
        charged_to: n[12],
        prepaid: n[13],
        landed: n[14],
        landed_end: n[15],
        owes: n[16],
        fallback: n[17],
    }
}

// The one unit test that needs a redis-server: `cargo test --lib` runs without one, and
// `./scripts/test.sh` runs this with `--ignored`.
#[test]
#[ignore = "needs redis-server: ./scripts/test.sh runs it (cargo test --lib -- --ignored)"]
fn the_script_computes_exactly_what_serve_computes() {
    let server =
        LocalRedis::start().expect("this test needs redis-server (./scripts/test.sh installs it)");
    let con = std::cell::RefCell::new(
        redis::Client::open(server.url())
            .and_then(|c| c.get_connection())
            .expect("connected"),
    );
    let script = redis::Script::new(crate::redis::scripts::SYNC_ROUND);
    // Every case runs at this instant (2026-01-01, µs), which the script takes as its
    // clock instead of the server's: the cases, and so the kinds they exercise, are the
    // same in every run, however fast it goes.
    let base_now = 1_767_225_600_000_000;
    let config = ProptestConfig {
        cases: 3_000,
        rng_seed: proptest::test_runner::RngSeed::Fixed(7),
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    // What the cases exercised: grants, overdrafts, stale rounds, refunds, late rounds,
    // silent nodes' shares charged, debts, and charges beyond what the global state holds
    // (`SyncedLimiter::charge`: the key in debt; `seen[3]` counts the refunds).
    let seen = std::cell::RefCell::new([0u32; 11]);
    runner
        .run(&case(base_now), |c| {
            let mut con = con.borrow_mut();
            let con = &mut *con;
            // Write the state.
            let _: () = con.del(KEY).expect("DEL");
            let mut fields: Vec<(String, Vec<u8>)> = Vec::new();
            let text = |n: u64| n.to_string().into_bytes();
            match c.params.shape {
                Shape::TokenBucket { .. } => fields.push(("t".into(), text(c.global.tat))),
                Shape::SlidingWindow { .. } | Shape::FixedWindow { .. } => {
                    if let Some(w) = c.global.window {
                        fields.push(("w".into(), text(w)));
                        fields.push(("p".into(), text(c.global.prev)));
                        fields.push(("c".into(), text(c.global.cur)));
                    }
                }
            }
            let q = c.global.quota;
            if q.version > 0 {
                fields.push((
                    "q".into(),
                    format!("{}:{}:{}:{}", q.version, q.limit, q.period, q.burst).into_bytes(),
                ));
            }
            let mut state = KeyState {
                global: c.global,
                nodes: Default::default(),
            };
            if let Shape::TokenBucket { .. } = c.params.shape {
                state.global.window = None;
            }
            for (i, r) in c.records.iter().enumerate() {
                if let Some(r) = r {
                    fields.push((format!("{:016x}", NODES[i]), encode(r)));
                    state.nodes.insert(NODES[i], *r);
                }
            }
            if !fields.is_empty() {
                let _: () = con.hset_multiple(KEY, &fields).expect("HSET");
            }
            // Run the script, with the arguments the task sends.
            let r = &c.request;
            let heard: std::collections::BTreeMap<u64, u64> = c
                .heard_ago
                .iter()
                .enumerate()
                .filter_map(|(i, ago)| {
                    ago.map(|ago| (NODES[i], base_now.saturating_sub(ago) / 1_000))
                })
                .collect();
            // The call as a node encodes it, and the reply as a node decodes it.
            let call = RoundCall {
                node: NODES[c.node],
                registry_ttl_ms: 1_000,
                params: c.params,
                heard: heard.iter().map(|(&node, &ms)| (node, ms)).collect(),
                seq: r.seq,
                clock_us: base_now,
                requests: vec![*r],
            };
            let reply: redis::Value = script
                .key(REGISTRY)
                .key(KEY)
                .arg(call.encode())
                .invoke(con)
                .map_err(|e| TestCaseError::fail(format!("script: {e}")))?;
            let reply = RoundReply::decode(&reply, 1)
                .map_err(|e| TestCaseError::fail(format!("reply: {e}")))?;
            let now = reply.server_us;
            assert_eq!(now, base_now, "the script runs on the clock it was given");
            // The registry the reply lists holds this node's heartbeat.
            assert!(reply.registry.iter().any(|&(node, _)| node == call.node));
            // The specification at the same instant.
            let reserved_before = state.nodes.get(&NODES[c.node]).map(|r| r.reserved);
            let prepaid_before: u64 = state.nodes.values().map(|r| r.prepaid).sum();
            // Another node in its fallback (heard, not hearing) with its share unexpired.
            let others_in_fallback = state
                .nodes
                .iter()
                .any(|(&id, o)| id != NODES[c.node] && o.fallback == 1 && o.until > now);
            let answer = model::serve(&c.params, &mut state, NODES[c.node], r, now, &heard);
            let prepaid_after: u64 = state.nodes.values().map(|r| r.prepaid).sum();
            {
                let mut seen = seen.borrow_mut();
                seen[0] += u32::from(answer.grant > 0);
                seen[1] += u32::from(answer.overdraft > 0);
                seen[2] += u32::from(answer.stale);
                seen[3] += u32::from(!answer.stale && reserved_before.is_some_and(|b| r.floor < b));
                seen[4] += u32::from(r.deadline != 0 && now > r.deadline);
                seen[5] += u32::from(prepaid_after > prepaid_before);
                seen[6] += u32::from(state.nodes.get(&NODES[c.node]).is_some_and(|r| r.owes > 0));
                seen[7] += u32::from(others_in_fallback && prepaid_after > prepaid_before);
                seen[8] += u32::from(answer.void > 0);
                // A floor raised past what the global state holds (a charge beyond what
                // is available: `SyncedLimiter::charge`): the key goes into debt.
                let in_debt = match c.params.shape {
                    Shape::TokenBucket { t, tau } => state.global.tat > now + tau + t,
                    _ => false,
                };
                seen[10] += u32::from(
                    !answer.stale && reserved_before.is_some_and(|b| r.floor > b) && in_debt,
                );
                seen[9] += u32::from(
                    c.global.quota.shape(c.params.shape) != answer.quota.shape(c.params.shape)
                        && !answer.stale,
                );
            }
            prop_assert_eq!(
                reply.answers[0],
                answer,
                "answer differs at {}: {:?}",
                now,
                c
            );
            // The state left behind.
            let stored: Vec<(String, Vec<u8>)> = con.hgetall(KEY).expect("HGETALL");
            let mut left = KeyState::default();
            for (f, v) in stored {
                let text = || String::from_utf8(v.clone()).expect("a number");
                let number = || text().parse::<u64>().expect("a number");
                match f.as_str() {
                    "t" => left.global.tat = number(),
                    "w" => left.global.window = Some(number()),
                    "p" => left.global.prev = number(),
                    "c" => left.global.cur = number(),
                    "q" => {
                        let n: Vec<u64> =
                            text().split(':').map(|x| x.parse().expect("q")).collect();
                        left.global.quota = SharedQuota {
                            version: n[0],
                            limit: n[1],
                            period: n[2],
                            burst: n[3],
                        };
                    }
                    _ => {
                        left.nodes
                            .insert(parse_id(f.as_bytes()).expect("a node id"), decode(&v));
                    }
                }
            }
            if answer.stale {
                return Ok(());
            }
            let mut expected = state.clone();
            if let Shape::TokenBucket { .. } = c.params.shape {
                expected.global.window = None;
                expected.global.prev = 0;
                expected.global.cur = 0;
            } else {
                expected.global.tat = 0;
            }
            prop_assert_eq!(left, expected, "state differs at {}: {:?}", now, c);
            Ok(())
        })
        .expect("the script and serve agree");
    let seen = seen.into_inner();
    println!("cases of each kind: {seen:?}");
    assert!(
        seen.iter().all(|&n| n >= 50),
        "too few cases of each kind: {seen:?}"
    );
}
