#!/usr/bin/env bash
# Installs what the test suite needs when it is missing, then runs every test.
# Usage: ./scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
# The Redis tier's tests (and benches) start their own redis-server, and their own
# cluster with redis-cli; the TLS test makes its certificates with openssl.
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

cargo test --all-features "$@"
# The library's one unit test that needs a redis-server (the round script against the
# protocol's model), which plain `cargo test --lib` leaves out.
cargo test --all-features --lib -- --ignored

# The loom models of the lock-free table's publish/freeze/migrate protocol: every
# interleaving with up to LOOM_MAX_PREEMPTIONS preemptions per thread. crossbeam-epoch
# and the table switch to loom's atomics under this cfg; a separate target directory keeps
# the main build's artefacts.
echo "test.sh: loom models"
LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" RUSTFLAGS="--cfg tollgate_loom" \
    cargo test -p tollgate --lib --release --target-dir target/loom loom_ -- --test-threads=1

# The stress test (every decision against a reference model while tiny tables resize)
# under valgrind's memcheck: any invalid read, write or free fails the run.
echo "test.sh: stress test under valgrind"
stress_bin=$(cargo test --all-features --test stress --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
if [ -z "$stress_bin" ]; then
    echo "test.sh: could not find the stress test binary" >&2
    exit 1
fi
TOLLGATE_STRESS_PHASES="${TOLLGATE_STRESS_PHASES_VALGRIND:-2000}" \
    valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite --quiet "$stress_bin" --test-threads=1
