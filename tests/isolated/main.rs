//! The tests that need a process to themselves, one at a time:
//! - `alloc`: allocations counted by this binary's allocator;
//! - `reclamation`: exact counts of retired tables, which any other check in flight in
//!   the process would hold back;
//! - `secrets`: synced limiters under the default key prefix, which a process lends to
//!   one limiter at a time;
//! - `sync_flood`: the bytes a flood of keys leaves behind, counted for the whole process.
//!
//! One binary for the four (one build and one link instead of four): every test holds
//! [`alone`] for its whole run, so that `cargo test --test isolated` runs them one after
//! another, and `./scripts/test.sh` runs each module in a process of its own, side by side
//! (`isolated alloc::`, `isolated secrets::`, ...).

// Not built for the loom models (`--cfg tollgate_loom`), whose tables are not `Sync`
// outside a model and whose dev-dependencies are not there.
#![cfg(not(tollgate_loom))]

#[path = "../common/mod.rs"]
mod common;

mod alloc;
mod reclamation;
mod secrets;
mod sync_flood;

use tollgate_testing::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Held by every test of this binary for its whole run. tokio's mutex, so that the async
/// tests hold it across their awaits; it is not poisoned by a test that panics.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This process to the calling (synchronous) test alone until the guard drops.
fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    ALONE.blocking_lock()
}

/// This process to the calling async test alone until the guard drops.
#[cfg(feature = "redis")]
async fn alone_async() -> tokio::sync::MutexGuard<'static, ()> {
    ALONE.lock().await
}
