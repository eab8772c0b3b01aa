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

/// How to build the example server the tests run.
const BUILD_SERVER: &str = "cargo build --workspace --profile test --all-features --example server \
     (./scripts/test.sh does)";

/// The example server (`server/examples/server`), built beside the calling test's binary:
/// tests live in `target/<profile>/deps`, examples in `target/<profile>/examples`.
/// `./scripts/test.sh` builds it (`cargo build --profile test --example server`).
///
/// # Panics
/// When it is not built, or was built before the last change to its sources or the
/// library's (a test would run an old server), saying how to build it.
pub fn example_server() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("a test binary lives in target/<profile>/deps");
    let path = dir.join("examples").join("server");
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} is missing: build it with {BUILD_SERVER}",
                path.display()
            )
        });
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace holds the testing package");
    let sources = ["src", "server", "Cargo.toml", "Cargo.lock"].map(|p| root.join(p));
    if let Some((changed, at)) = sources
        .iter()
        .filter_map(|p| newest(p))
        .max_by_key(|(_, at)| *at)
    {
        assert!(
            at <= built,
            "{} is older than {}: build it again with {BUILD_SERVER}",
            path.display(),
            changed.display()
        );
    }
    path
}

/// The most recently modified file under `path` (itself, if a file), and when.
fn newest(path: &std::path::Path) -> Option<(std::path::PathBuf, std::time::SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return Some((path.to_path_buf(), meta.modified().ok()?));
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|entry| newest(&entry.path()))
        .max_by_key(|(_, at)| *at)
}
