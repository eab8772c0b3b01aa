//! The tests that need a process to themselves, one at a time:
//! - `alloc`: allocations counted by this binary's allocator;
//! - `reclamation`: exact counts of retired tables, which any other check in flight in
//!   the process would hold back;
//! - `secrets`: synced limiters under the default key prefix, which a process lends to
//!   one limiter at a time;
//! - `sync_flood`: the bytes a flood of keys leaves behind, counted for the whole process.
//!
//! One binary for the four (one build and one link instead of four). cargo-nextest
//! (./scripts/test.sh) runs each test in a process of its own; every test first checks
//! that it has one ([`alone`]).

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

/// Checks that the calling test has this process to itself, as every test of this
/// binary needs: cargo-nextest runs each test in a process of its own (./scripts/test.sh
/// runs it); libtest does only with one thread (`cargo test --test isolated --
/// --test-threads=1`). Anything else would count other tests' allocations, tables or
/// limiters: the test fails at once, saying so, rather than measuring the wrong process.
fn alone() {
    let nextest = std::env::var("NEXTEST_EXECUTION_MODE").is_ok_and(|m| m == "process-per-test");
    let args: Vec<String> = std::env::args().collect();
    let one_thread = std::env::var("RUST_TEST_THREADS").is_ok_and(|n| n == "1")
        || args.iter().any(|a| a == "--test-threads=1")
        || args
            .windows(2)
            .any(|w| w[0] == "--test-threads" && w[1] == "1");
    assert!(
        nextest || one_thread,
        "the isolated tests need a process each: run them with cargo nextest, or with \
         `-- --test-threads=1`"
    );
}
