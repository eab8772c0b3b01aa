//! Nothing: this package is its tests (`tests/http_tier/`) and its example
//! (`examples/tonic_greeter.rs`).
