//! The local engine: the limiter, its store and algorithms, reconfiguration, waiting and
//! configuration files, with no process and no socket.
//!
//! One test binary per tier (`./scripts/test.sh --layer ...` runs one alone): the
//! modules share one build and one link.

// Not built for the loom models (`--cfg tollgate_loom`), whose tables are not `Sync`
// outside a model and whose dev-dependencies are not there.
#![cfg(not(tollgate_loom))]

#[path = "../common/mod.rs"]
mod common;

mod architecture;
mod calendar;
mod compound;
mod concurrency;
mod config_file;
mod conformance;
mod eviction;
mod expected_keys;
mod governor_equivalence;
mod in_flight;
mod limiter;
mod penalty;
mod plans;
mod properties;
mod quota;
mod reconfigure;
mod settle;
mod waiting;
