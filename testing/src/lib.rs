//! Real Redis processes for tollgate's tests, benches and tools (unpublished).
//!
//! [`LocalRedis`] starts a `redis-server` on an ephemeral loopback port and stops it on
//! drop; [`LocalCluster`] starts a local Redis Cluster the same way, and
//! [`LocalSentinel`] a primary with replicas behind Redis Sentinel. They need
//! `redis-server` (and, for the cluster, `redis-cli`) on `PATH`; `./scripts/test.sh`
//! installs both. None depends on tollgate: they manage processes and hand out URLs
//! (and, for a test's own commands, a redis-rs connection). [`example_server`] finds the
//! example server's binary that the tests run.
// `unsafe` only in `alloc`, the counting allocator.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod alloc;
mod local_cluster;
mod local_redis;
mod local_sentinel;

pub use alloc::CountingAllocator;
pub use local_cluster::{ClusterNode, LocalCluster};
pub use local_redis::{INSPECT_TIMEOUT, LocalRedis};
pub use local_sentinel::{LocalSentinel, MASTER_NAME, TlsFiles};

/// The example server (`server/examples/server`), built beside the calling test's binary:
/// tests live in `target/<profile>/deps`, examples in `target/<profile>/examples`.
/// `./scripts/test.sh` builds it (`cargo build --profile test --example server`).
///
/// # Panics
/// When it is not built, saying how to build it.
pub fn example_server() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("a test binary lives in target/<profile>/deps");
    let path = dir.join("examples").join("server");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --profile test --example server` \
         (./scripts/test.sh does)",
        path.display()
    );
    path
}
