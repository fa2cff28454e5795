#!/usr/bin/env bash
# The fault explorer's long run: the local services and three replicas as
# `scripts/demo.sh up` starts them (lease 3 s, restarted on the new build), then
# `loadtest explore` over them, its figures also read from MySQL directly.
#
#   scripts/explore.sh [EXPLORE ARGS]   e.g. --seed 7 --rounds 500, or --seed 7 --round 42
#
# 200 rounds by default, the seed from the clock (printed). Backend restarts only with
# --disruptive and commands you give, e.g.
#   scripts/explore.sh --disruptive --restart-redis-cmd 'scripts/stack.sh restart redis'
#   scripts/explore.sh --disruptive --failover-redis-cmd 'scripts/stack.sh failover'
# (they take Redis away from everything using this stack). The summary goes to
# target/flashsale/explore.json; the exit status is non-zero on any violation.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

export FLASHSALE_LOCK_LEASE_MS="${FLASHSALE_LOCK_LEASE_MS:-3000}"
./scripts/demo.sh up
eval "$(./scripts/stack.sh env)"
# The checker's own MySQL reads (--database-url) need the explorer built with a driver.
cargo build --release --quiet -p loadtest --features mysql

rounds=(--rounds 200)
for arg in "$@"; do
  case "$arg" in --rounds | --rounds=* | --round | --round=*) rounds=() ;; esac
done
exec ./target/release/loadtest explore \
  --targets http://127.0.0.1:8081,http://127.0.0.1:8082,http://127.0.0.1:8083 \
  --lease-ms "$FLASHSALE_LOCK_LEASE_MS" --database-url "$FLASHSALE_DATABASE_URL" \
  ${rounds[@]+"${rounds[@]}"} "$@"
