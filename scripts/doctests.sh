#!/usr/bin/env bash
# Runs every doctest, then checks what the docs promise a newcomer (issue 31): a README
# of at most 160 lines, at least 60 doctests in the library, none of them `ignore`, and a
# compiled example on the page of every entry point below. ./scripts/test.sh runs it as
# its `doctests` job.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --workspace --all-features --doc

failed=0
fail() {
    echo "doctests.sh: $*" >&2
    failed=1
}

lines=$(wc -l <README.md)
[ "$lines" -le 160 ] || fail "README.md has $lines lines; keep it to 160 and move detail to src/guide/"

# The count takes the listing's whole lines; the entry points below are looked for in all
# of it. A listing that fails says why (cargo's own words), not only that the count is 0.
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if ! raw=$(cargo test -p tollgate --all-features --doc -- --list 2>"$errors"); then
    cat "$errors" >&2
    echo "doctests.sh: could not list the doctests (cargo's output is above)" >&2
    exit 1
fi
list=$(printf '%s\n' "$raw" | grep ': test$' || true)
count=$(printf '%s\n' "$list" | grep -c . || true)
[ "$count" -ge 60 ] || fail "the library has $count doctests; the docs promise at least 60"

# An `ignore` block is never compiled: code that needs Redis is `no_run` instead.
if grep -rnE '```[a-z_,]*ignore' README.md src/ testing/src/; then
    fail "the blocks above are ignore; make them compile (no_run for code that needs a server)"
fi

# The entry points, each with at least one example in its own rustdoc.
for item in \
    'limiter::RateLimiter ' 'limiter::Builder ' 'quota::Quota ' 'decision::Decision ' \
    'redis::limiter::RedisLimiter ' 'fail_mode::FailMode ' 'redis::breaker::CircuitBreaker ' \
    'sync::limiter::SyncedLimiter ' 'sync::config::RedisSync ' \
    'sync::SyncHandle ' 'http::layer::RateLimitLayer ' 'http::key::KeyExtractor ' \
    'config::LimiterConfig ' 'wait::RateLimiter<K,C>::until_ready ' \
    'concurrency ' 'concurrency::ConcurrencyBuilder ' \
    'concurrency::ConcurrencyLimiter<K>::try_acquire_with ' \
    'redis::concurrency::RedisConcurrencyLimiter ' 'guide::concurrency ' \
    'calendar::CalendarPeriod ' 'guide::plans ' 'limiter::Builder<K,C>::block_for ' \
    'limiter::RateLimiter<K,C>::block ' 'clock::ManualClock::at_unix ' 'plans ' \
    'limiter::RateLimiter<K,C>::set_quotas ' 'config::LimiterConfig::build_plans ' \
    'http::layer::RateLimitLayer<K,E>::plan_from ' 'redis::limiter::builder::RedisBuilder::block_for ' \
    'redis::limiter::boxed::RedisLimiter::block ' 'redis::limiter::builder::RedisBuilder::plan ' \
    'sync::plans::SyncedPlans ' \
    'guide::algorithms ' 'guide::configuration ' 'guide::waiting ' 'guide::http ' \
    'guide::grpc ' 'guide::redis ' 'guide::sync ' 'guide::observability ' 'guide::testing '; do
    # Not `printf | grep -q` under pipefail: grep quits at its first match, bash's printf
    # then writes the rest of the listing into a closed pipe and dies of SIGPIPE, and the
    # pipeline fails although the item was found. That race missed `guide::waiting` in the
    # project's CI run of 3ee7755, and most likely `config::LimiterConfig` at 9bf5d7f, both
    # early in the listing, whose first 4 KiB printf writes at once (under strace, 24 of
    # 50 runs failed so; a here-string, 0 of 50).
    grep -qF -- "- $item(line" <<<"$raw" || fail "no doctest on the page of $item"
done

[ "$failed" -eq 0 ] || exit 1
echo "doctests.sh: $count doctests in the library, README $lines lines, every entry point with an example"
