#!/usr/bin/env bash
# Installs what the test suite needs when it is missing, then runs every test.
# Usage: ./scripts/test.sh                  the whole suite
#        ./scripts/test.sh --layer L        one layer: engine, sim, http or redis
#        ./scripts/test.sh <nextest args>   `cargo nextest run` over the workspace, as given
# TOLLGATE_SIM_CASES sets the scenarios per simulated property (100 here; .ci/run runs 600).
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-server and redis-cli for the real Redis servers, clusters and sentinels the tests
# start; openssl for the TLS test's certificates; valgrind for the stress test.
need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
command -v cargo >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/cargo" ] || need_apt+=(cargo)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "test.sh: installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
    # Debian starts the packaged service; the tests run their own servers instead.
    service redis-server stop >/dev/null 2>&1 || true
fi
export PATH="$HOME/.cargo/bin:$PATH"
# cargo-nextest runs each test in a process of its own (see .config/nextest.toml).
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "test.sh: installing cargo-nextest"
    cargo install --locked cargo-nextest
fi

export TOLLGATE_SIM_CASES="${TOLLGATE_SIM_CASES:-100}"
# Every cargo command names the whole workspace with every feature: another set would
# resolve other features and compile the dependencies again.
all=(--workspace --all-features)
if [ $# -gt 0 ] && [ "$1" != "--layer" ]; then
    exec cargo nextest run "${all[@]}" "$@"
fi
layer="all"
[ "${1:-}" = "--layer" ] && layer="${2:?--layer needs engine, sim, http or redis}"
case "$layer" in
    # The local limiter, its store, algorithms and waiting: no process, no socket.
    engine) filter='binary(engine) | binary(stress) | (binary(isolated) & test(/^(alloc|reclamation)::/))' ;;
    # The library's own tests, the sync's deterministic simulation among them.
    sim) filter='package(tollgate) & kind(lib) & not test(/differential/)' ;;
    # The tower layer, axum, hyper and tonic over real sockets, the example server.
    http) filter='package(tollgate-http-tests)' ;;
    # Every test against a real redis-server, cluster or sentinel, and the Lua differential.
    redis) filter='binary(redis_tier) | package(tollgate-testing) | test(/differential/) | (binary(isolated) & test(/^(secrets|sync_flood)::/))' ;;
    all) filter='all()' ;;
    *) echo "test.sh: --layer needs engine, sim, http or redis, not $layer" >&2 && exit 2 ;;
esac

# The tests run the example server, built from the same artefacts.
cargo build "${all[@]}" --profile test --example server --quiet
started=$SECONDS
status=0
# `--run-ignored all`: the Lua differential needs a redis-server, so a plain `cargo test`
# leaves it out.
cargo nextest run "${all[@]}" --run-ignored all -E "$filter" || status=1
echo "test.sh: the tests took $((SECONDS - started)) s"
if [ "$layer" != all ]; then
    exit "$status"
fi

# Then, side by side (each a build, then one thread): the doctests; the loom models of the
# table's publish, freeze, migrate and reclaim protocol; the stress test (every decision
# against a reference model while tiny tables resize) under valgrind's memcheck; and the
# two-quota word as other architectures get it (portable-atomic's `AtomicU128` in place of
# the x86-64 `cmpxchg16b` of src/store/epoch_table/atom.rs). Each has its own log, shown
# whole when it fails, and loom and the portable pair their own target folders.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run() {
    local name=$1 start=$SECONDS
    shift
    if "$@" >"$logs/$name.log" 2>&1; then
        echo "test.sh: $name ok in $((SECONDS - start)) s"
    else
        echo "test.sh: $name FAILED after $((SECONDS - start)) s; its output:"
        cat "$logs/$name.log"
        return 1
    fi
}
stress=$(cargo nextest list "${all[@]}" -E 'binary(stress)' --message-format json |
    grep -o '"binary-path":"[^"]*stress-[^"]*"' | head -n 1 | cut -d'"' -f4)
[ -n "$stress" ] || { echo "test.sh: could not find the stress test binary" >&2 && exit 1; }
run doctests ./scripts/doctests.sh &
jobs=($!)
run loom env LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" RUSTFLAGS="--cfg tollgate_loom" \
    cargo test -p tollgate --lib --release --target-dir target/loom loom_ -- --test-threads=1 &
jobs+=($!)
run valgrind env TOLLGATE_STRESS_PHASES="${TOLLGATE_STRESS_PHASES_VALGRIND:-2000}" \
    valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite --quiet "$stress" --test-threads=1 &
jobs+=($!)
run portable env RUSTFLAGS="--cfg tollgate_portable_pair" \
    cargo test -p tollgate --release --target-dir target/portable --lib --test engine &
jobs+=($!)
for job in "${jobs[@]}"; do
    wait "$job" || status=1
done
[ "$status" -eq 0 ] || echo "test.sh: some tests failed (above)" >&2
exit "$status"
