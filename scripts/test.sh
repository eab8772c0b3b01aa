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
