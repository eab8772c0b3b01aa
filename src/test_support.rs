//! Real Redis processes for tests (cargo feature `test-support`, not part of the API
//! that semver covers): [`LocalRedis`] starts a `redis-server` on an ephemeral port and
//! stops it on drop, and [`LocalCluster`] a local Redis Cluster. tollgate's own tests,
//! benches and examples use them; so can yours.

pub use crate::redis::local_cluster::{ClusterNode, LocalCluster};
pub use crate::redis::server::LocalRedis;
