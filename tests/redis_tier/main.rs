//! The Redis tiers on real processes: the exact tier on one server and on a cluster, the
//! local first tier, the sync against a real redis-server, and one node cut off alone.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link.

#[path = "../common/mod.rs"]
mod common;

mod cluster;
mod partition;
mod redis;
mod redis_first_tier;
mod sync;
