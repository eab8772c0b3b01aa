#!/usr/bin/env bash
# Installs what the test suite needs when it is missing, then runs every test.
# Usage: ./scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
# The Redis tier's tests (and benches) start their own redis-server, their own cluster
# with redis-cli, and their own sentinels (`redis-server <conf> --sentinel`: the same
# binary, so the redis-sentinel package and its service are not needed); the TLS test
# makes its certificates with openssl.
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# The lock-free table's stress test also runs under valgrind's memcheck.
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "test.sh: installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
    # Debian starts the packaged service; the tests run their own servers instead.
    if [[ " ${need_apt[*]} " == *" redis-server "* ]]; then
        service redis-server stop >/dev/null 2>&1 || true
    fi
fi

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "test.sh: installing Debian's cargo (no rustup toolchain found)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cargo
    fi
fi

# With arguments, they go to one plain `cargo test --workspace --all-features` and nothing
# else runs.
if [ $# -gt 0 ] && [ "$1" != "--layer" ]; then
    exec cargo test --workspace --all-features "$@"
fi
# `--layer engine|sim|http|redis` runs one layer's binaries alone:
# - engine: the local limiter, its store, algorithms and waiting (no process, no socket);
# - sim: the library's own tests, the sync's deterministic simulation among them;
# - http: the tower layer, axum, hyper and tonic over real sockets, the example server,
#   metrics and tracing;
# - redis: every test against a real redis-server or cluster (the test helpers' own among
#   them), and the Lua differential.
# Without it, every layer runs, then the loom models and the stress test under valgrind.
layer=all
if [ "${1:-}" = "--layer" ]; then
    layer="${2:?--layer needs engine, sim, http or redis}"
fi
# Each layer's tests share one binary (tests/engine/, tests/redis_tier/, and
# http-tests/tests/http_tier/ in a package of its own, unoptimised).
# The tests that need a process to themselves share tests/isolated/, which runs once per
# module, each run a process of its own: a counting allocator (alloc, sync_flood), the
# default key prefix (secrets), the process-wide reclamation of retired tables
# (reclamation: another test's check in flight holds them back). The stress test that
# valgrind runs has its own binary.
layer_of() {
    case "$1" in
        tollgate) echo sim ;;
        http_tier) echo http ;;
        redis_tier | secrets | sync_flood | tollgate_testing) echo redis ;;
        *) echo engine ;;
    esac
}
# The Redis tier's tests run 4 at a time: they wait on real time (a pause, a failover, a
# sync interval) far more than they compute. The other binaries keep libtest's default
# (one test per CPU, or RUST_TEST_THREADS).
threads_of() {
    case "$1" in
        redis_tier) echo "--test-threads 4" ;;
    esac
}

# Build every test binary first, then run them side by side: most of the real-process
# tests wait on real time (a pause, a failover, a sync interval), so they overlap with
# the simulation's CPU-bound properties. Each binary's output goes to a log of its own,
# shown whole when it fails.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
built=$SECONDS
# The library's and the test binaries, then the one example a test runs (the server),
# from the same artefacts: the other examples and the benches are compiled by clippy's
# check of every target, not twice. Every cargo command here names the whole workspace:
# another set of packages would resolve other features and compile the dependencies
# again.
{
    cargo test --workspace --all-features --lib --tests --no-run --message-format=json &&
        cargo build --workspace --profile test --all-features --example server --quiet
} 2>"$logs/build.err" >"$logs/build.json" || {
    cat "$logs/build.err" >&2
    exit 1
}
echo "test.sh: built the tests in $((SECONDS - built)) s"
# "<target name> <package dir> <executable>" for every test harness built.
grep '"test":true' "$logs/build.json" | grep '"executable":"/' |
    sed -n 's/.*"manifest_path":"\([^"]*\)\/Cargo.toml".*"target":{"kind":\["[a-z-]*"\].*"name":"\([^"]*\)".*"executable":"\([^"]*\)".*/\2 \1 \3/p' \
    >"$logs/binaries"

# "<label> <package dir> <executable> [filter]": one job per binary, and one per module of
# tests/isolated/ (its label the module's, its filter `<module>::`), the modules as the
# binary lists its tests.
while read -r name dir exe; do
    if [ "$name" = isolated ]; then
        "$exe" --list --format terse </dev/null | sed -n 's/^\([a-z_]*\)::.*: test$/\1/p' | sort -u |
            while read -r module; do
                echo "$module $dir $exe $module::"
            done
    else
        echo "$name $dir $exe"
    fi
done <"$logs/binaries" >"$logs/jobs"
# The longest first, so that the pool ends together.
order="redis_tier tollgate sync_flood stress http_tier"
jobs=()
for name in $order; do
    line=$(grep "^$name " "$logs/jobs" || true)
    [ -n "$line" ] && jobs+=("$line")
done
while read -r name rest; do
    case " $order " in *" $name "*) continue ;; esac
    jobs+=("$name $rest")
done <"$logs/jobs"

failed=0
running=0
parallel="${TOLLGATE_TEST_JOBS:-4}"
finish_one() {
    local status=0
    wait -n || status=$?
    running=$((running - 1))
    [ "$status" -eq 0 ] || failed=1
}
run_job() {
    # run_job <label> <dir> <command...>: runs in the background, logs to <label>.log.
    local label=$1 dir=$2
    shift 2
    (
        start=$SECONDS
        if (cd "$dir" && "$@") >"$logs/$label.log" 2>&1; then
            echo "test.sh: $label ok in $((SECONDS - start)) s: $(grep '^test result' "$logs/$label.log" | tail -n 1)"
        else
            echo "test.sh: $label FAILED after $((SECONDS - start)) s; its output:"
            cat "$logs/$label.log"
            exit 1
        fi
    ) &
    running=$((running + 1))
    if [ "$running" -ge "$parallel" ]; then
        finish_one
    fi
}

# wait_for_jobs <message>: waits for every running job; if any failed, says <message>
# and exits.
wait_for_jobs() {
    while [ "$running" -gt 0 ]; do
        finish_one
    done
    if [ "$failed" -ne 0 ]; then
        echo "test.sh: $1" >&2
        exit 1
    fi
}

for job in "${jobs[@]}"; do
    read -r name dir exe filter <<<"$job"
    target_layer=$(layer_of "$name")
    if [ "$layer" = all ] || [ "$layer" = "$target_layer" ]; then
        # shellcheck disable=SC2046,SC2086 # no flag, or the flag and its value as two words
        run_job "$name" "$dir" "$exe" $filter $(threads_of "$name")
    fi
done
if [ "$layer" = all ] || [ "$layer" = redis ]; then
    # The library's one unit test that needs a redis-server: the round script against
    # the protocol's model (the Lua differential), which the plain run leaves out.
    lib=$(grep '^tollgate ' "$logs/binaries" | cut -d' ' -f3)
    run_job differential "$PWD" "$lib" --ignored
fi
if [ "$layer" = all ] || [ "$layer" = engine ]; then
    run_job doctests "$PWD" ./scripts/doctests.sh
fi
wait_for_jobs "some tests failed (their output is above)"
if [ "$layer" != all ]; then
    exit 0
fi

# After the pool, three jobs side by side: the loom models (a build, then one thread),
# the stress test under valgrind (one thread) and the two-quota word as other
# architectures get it (a build, then seconds). In the pool they would only slow the
# simulation, which is CPU-bound, by as much as they save.
#
# The loom models of the lock-free table's publish/freeze/migrate protocol: every
# interleaving with up to LOOM_MAX_PREEMPTIONS preemptions per thread. crossbeam-epoch
# and the table switch to loom's atomics under this cfg; a separate target directory keeps
# the main build's artefacts.
run_job loom "$PWD" env LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    RUSTFLAGS="--cfg tollgate_loom" \
    cargo test -p tollgate --lib --release --target-dir target/loom loom_ -- --test-threads=1
# The stress test (every decision against a reference model while tiny tables resize)
# under valgrind's memcheck: any invalid read, write or free fails the run.
stress=$(grep '^stress ' "$logs/binaries" | cut -d' ' -f3)
if [ -z "$stress" ]; then
    echo "test.sh: could not find the stress test binary" >&2
    exit 1
fi
run_job valgrind "$PWD" env TOLLGATE_STRESS_PHASES="${TOLLGATE_STRESS_PHASES_VALGRIND:-2000}" \
    valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite --quiet "$stress" --test-threads=1
# The word of a key held to two quotas as other architectures get it: portable-atomic's
# `AtomicU128` in place of our x86-64 `cmpxchg16b` and `vmovdqa`
# (src/store/epoch_table.rs, module `atom`), under the store's unit tests and the engine's tests
# (among them a pair against a chain of two stores, and the model of 2–3 quotas). A
# separate target directory, as for loom.
run_job portable "$PWD" env RUSTFLAGS="--cfg tollgate_portable_pair" \
    cargo test -p tollgate --release --target-dir target/portable --lib --test engine
wait_for_jobs "the loom models, the stress test under valgrind or the portable pair's tests failed (above)"
