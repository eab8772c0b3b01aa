//! Real Redis processes for tollgate's tests, benches and tools (unpublished).
//!
//! [`LocalRedis`] starts a `redis-server` on an ephemeral loopback port and stops it on
//! drop; [`LocalCluster`] starts a local Redis Cluster the same way. They need
//! `redis-server` (and, for the cluster, `redis-cli`) on `PATH`; `./scripts/test.sh`
//! installs both. Neither depends on tollgate: they manage processes and hand out URLs
//! (and, for a test's own commands, a redis-rs connection).
// `unsafe` only in `alloc`, the counting allocator.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod alloc;
mod local_cluster;
mod local_redis;

pub use alloc::CountingAllocator;
pub use local_cluster::{ClusterNode, LocalCluster};
pub use local_redis::LocalRedis;
