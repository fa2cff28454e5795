#!/usr/bin/env bash
# Two builds of the service measured alternately, same machine, same minutes: the way
# to tell what a change did to the order path when the machine's noise is larger than
# the change. Prints one JSON line per measurement, prefixed with the build's label.
#
#   scripts/bench/before-after.sh BEFORE_BINARY AFTER_BINARY [ROUNDS]
#
# e.g. build the older commit in a worktree with CARGO_TARGET_DIR=target (only the
# workspace crates rebuild), copy its target/release/flashsale aside, rebuild HEAD.
# Uses scripts/bench/orders.sh's settings (BENCH_*) and strategies (BENCH_STRATEGIES).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 2 ] || { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 2; }
builds=("$1" "$2")
rounds=${3:-3}
WORK=$(mktemp -d)
log() { printf '[before-after] %s\n' "$*" >&2; }
die() { printf '[before-after] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=orders.sh
source scripts/bench/orders.sh
trap 'stop_replicas; rm -rf "$WORK"' EXIT
for round in $(seq 1 "$rounds"); do
  for label in before after; do
    if [ "$label" = before ]; then BINARY=${builds[0]}; else BINARY=${builds[1]}; fi
    # Each build its own database and Redis namespace: an older build refuses a
    # database that a newer one has migrated further.
    BENCH_DATABASE=flashsale_bench_$label
    log "round $round of $rounds: $label ($BINARY)"
    start_replicas
    admin PUT /api/admin/fencing '{"enabled":false}'
    ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
    admin PUT /api/admin/strategy '{"strategy":"none"}'
    admin POST /api/admin/reset "{\"sku\":\"$SKU\",\"stock\":$STOCK}"
    measure 1 1 warm "$round" "$PORT" >/dev/null
    echo "$label $(measure 1 "$ORDER_SECONDS" baseline "$round" "$PORT")"
    for strategy in "${STRATEGIES[@]}"; do
      [ "$strategy" = none ] && continue
      admin PUT /api/admin/strategy "{\"strategy\":\"$strategy\"}"
      admin POST /api/admin/reset "{\"sku\":\"$SKU\",\"stock\":$STOCK}"
      measure "$CONNECTIONS" 1 warm "$round" "${ports[@]}" >/dev/null
      echo "$label $(measure "$CONNECTIONS" "$ORDER_SECONDS" "$strategy" "$round" "${ports[@]}")"
    done
    stop_replicas
  done
done
