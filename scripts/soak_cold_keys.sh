#!/usr/bin/env bash
# Issue 27's figure for the cold tier: one synced example server (reconcile, 10/s per key,
# 50 ms interval) behind which wrk (16 connections) rotates through 1,000,000 API keys,
# each far under its quota, for MINUTES minutes (10 by default). Prints, each minute, the
# server's resident memory, the keys it holds and Redis's commands; at the end, wrk's
# totals (every non-2xx answer is a false 429: no key goes over its quota).
#
# Usage: ./scripts/soak_cold_keys.sh [MINUTES]   (installs wrk, redis-server and curl if
# missing)
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
for tool in wrk redis-server curl; do
    command -v "$tool" >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null
done
cargo build --release --all-features --example server >/dev/null 2>&1
work=$(mktemp -d)
redis_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
http_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
redis_pid=$!
server_pid=
wrk_pid=
cleanup() {
    for pid in $wrk_pid $server_pid $redis_pid; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
until redis-cli -p "$redis_port" ping >/dev/null 2>&1; do sleep 0.1; done
target/release/examples/server --listen "127.0.0.1:$http_port" --quota 10/s \
    --key header:x-api-key --redis "redis://127.0.0.1:$redis_port/" --sync reconcile \
    >"$work/server.log" 2>&1 &
server_pid=$!
until curl -fs "http://127.0.0.1:$http_port/healthz" >/dev/null 2>&1; do sleep 0.1; done
cat >"$work/rotate.lua" <<'LUA'
-- Each thread walks its own stretch of the 1,000,000 keys, one key after the other.
local threads = 0
function setup(thread)
    thread:set("id", threads)
    threads = threads + 1
end
function init(args)
    n = id * 250000
end
function request()
    n = (n + 1) % 1000000
    return wrk.format("GET", "/", { ["x-api-key"] = "api-key-" .. n })
end
LUA
commands() {
    redis-cli -p "$redis_port" info commandstats |
        awk -F'calls=' '/calls=/ { split($2, a, ","); sum += a[1] } END { print sum + 0 }'
}
wrk -t4 -c16 -d"${minutes}m" --latency -s "$work/rotate.lua" "http://127.0.0.1:$http_port/" >"$work/wrk.txt" 2>&1 &
wrk_pid=$!
echo "| minute | server RSS (MiB) | Redis commands in the minute |"
echo "|---|---|---|"
before=$(commands)
for minute in $(seq 1 "$minutes"); do
    sleep 60
    now=$(commands)
    rss=$(awk '/VmRSS/ { printf "%.0f", $2 / 1024 }' "/proc/$server_pid/status")
    echo "| $minute | $rss | $((now - before)) |"
    before=$now
done
wait "$wrk_pid" || true
wrk_pid=
cat "$work/wrk.txt"
curl -fs "http://127.0.0.1:$http_port/metrics" | grep -E '^tollgate_(decisions|keys)' | head -20 || true
