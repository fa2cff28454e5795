# Sourced by scripts/bench.sh after scripts/bench/orders.sh (uses their WORK, REPEAT,
# COMMIT, CORES, CPU, MEMORY, BIN_DIR, PORT, CONNECTIONS, ORDER_SECONDS, STRATEGIES,
# BINARY, log, die, admin, measure, modes_of, label_of, set_up, costs, start_replicas, stop_replicas and
# replace_section): each strategy's latency in an open model at a share of its
# capacity, the capacity measured in the same repeat just before.

LATENCY_SECONDS=${BENCH_LATENCY_SECONDS:-10}
LATENCY_LOAD=${BENCH_LATENCY_LOAD:-0.8}
# The load test's own SKU (`loadtest --skus 1`); the capacity is measured on it too, so
# the open model finds it as warm as the closed loop left it.
LATENCY_SKU=sale-1
# `loadtest --stock` takes at most this, enough for 10 s at 100,000 orders/s.
LATENCY_STOCK=1000000
# The lock strategies' modes here (see modes_of): with combining, a lock's capacity is
# several times larger, and so is the load at 80 % of it.
LATENCY_MODES=${BENCH_LATENCY_MODES:-cohort combined}

section_latency() {
  local results="$WORK/latency.jsonl" ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
  local loadtest=${BENCH_LOADTEST:-$BIN_DIR/loadtest}
  local repeat strategy mode label load capacity rate out before after status targets
  # measure, orders_of_sku and the resets below buy and count the load test's SKU.
  local SKU=$LATENCY_SKU
  [[ "$LATENCY_SECONDS" =~ ^[1-9][0-9]*$ ]] || die "BENCH_LATENCY_SECONDS must be a whole number above 0"
  python3 -c 'import sys; assert 0 < float(sys.argv[1]) <= 1' "$LATENCY_LOAD" 2>/dev/null ||
    die "BENCH_LATENCY_LOAD must be a share of the capacity, above 0 and at most 1"
  [ -x "$loadtest" ] || die "no loadtest in $BIN_DIR (set BENCH_LOADTEST)"
  targets=$(printf 'http://127.0.0.1:%s,' "${ports[@]}")
  targets=${targets%,}
  start_replicas
  trap 'stop_replicas; rm -rf "$WORK"' EXIT
  admin PUT /api/admin/fencing '{"enabled":false}'
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  : >"$results"
  for repeat in $(seq 1 "$REPEAT"); do
    for strategy in "${STRATEGIES[@]}"; do
      for mode in $(MODES=$LATENCY_MODES modes_of "$strategy"); do
        label=$(label_of "$strategy" "$mode")
        log "latency: repeat $repeat of $REPEAT, $label: its capacity"
        set_up "$strategy" "$mode" "$LATENCY_STOCK"
        measure "$CONNECTIONS" 1 warm "$repeat" "${ports[@]}" >/dev/null
        capacity=$(measure "$CONNECTIONS" "$ORDER_SECONDS" "$label" "$repeat" "${ports[@]}" |
          python3 -c 'import json, sys; print(json.load(sys.stdin)["orders_per_s"])')
        rate=$(python3 -c 'import sys; print(f"{float(sys.argv[1]) * float(sys.argv[2]):.1f}")' \
          "$capacity" "$LATENCY_LOAD")
        if ! python3 -c 'import sys; sys.exit(float(sys.argv[1]) < 0.1)' "$rate"; then
          log "latency: $label sold nothing in the closed loop; repeat left out"
          printf '{"strategy":"%s","repeat":%d,"capacity":%s,"failed":true}\n' \
            "$label" "$repeat" "$capacity" >>"$results"
          continue
        fi
        log "latency: repeat $repeat of $REPEAT, $label: $rate orders/s for $LATENCY_SECONDS s"
        out="$WORK/latency-$repeat-${label// /-}"
        before=$(costs before "${ports[@]}")
        # Run here, not in a subshell, so its CPU is the harness's in `costs`. No keys:
        # the capacity was measured without them. The load test switches and restocks the
        # SKU itself; it exits 1 when `none` ends inconsistent, which is the lesson.
        status=0
        timeout $((LATENCY_SECONDS + 90)) "$loadtest" --targets "$targets" \
          --strategies "$strategy" --rate "$rate" --skus 1 --stock "$LATENCY_STOCK" \
          --max-seconds "$LATENCY_SECONDS" --grace-ms 0 --no-idempotency-key --no-history \
          --out "$out" >"$out.log" 2>&1 || status=$?
        after=$(costs after "${ports[@]}")
        if [ "$status" -gt 1 ] || [ ! -s "$out/report.json" ]; then
          log "latency: the load test of $label failed (status $status, see its log below); repeat left out"
          tail -n 5 "$out.log" >&2
          printf '{"strategy":"%s","repeat":%d,"capacity":%s,"rate":%s,"failed":true}\n' \
            "$label" "$repeat" "$capacity" "$rate" >>"$results"
          continue
        fi
        python3 -c '
import json, sys
strategy, repeat, capacity, rate, path, before, after = sys.argv[1:]
run = json.load(open(path))["runs"][0]
print(json.dumps({"strategy": strategy, "repeat": int(repeat), "capacity": float(capacity),
                  "rate": float(rate), "run": run,
                  "before": json.loads(before), "after": json.loads(after)}))
said = (strategy, run["orders_per_s"], run["latency_ms"]["p99"], run["busy"], run["errors"], run["sold_out"])
print("[bench] latency: %s sold %.0f/s, p99 %.2f ms, busy %d, errors %d, sold out %d" % said,
      file=sys.stderr)' \
          "$label" "$repeat" "$capacity" "$rate" "$out/report.json" "$before" "$after" >>"$results"
      done
    done
  done
  stop_replicas

  local share
  share=$(python3 -c 'import sys; print(f"{100 * float(sys.argv[1]):.0f}")' "$LATENCY_LOAD")
  {
    echo '<!-- latency:begin -->'
    echo "## Latency at $share % of capacity: the open model"
    echo
    echo "_Generated by \`scripts/bench.sh\` on $(date -u +%Y-%m-%d); do not edit by hand._"
    echo
    echo "Throughput says how many orders a strategy sells when the shoppers wait for each"
    echo "other; a sale's shoppers do not wait, they arrive. For each strategy, in the same"
    echo "repeat: first its **capacity**, the closed loop of the per-order table (wrk, three"
    echo "replicas, $CONNECTIONS connections each, $ORDER_SECONDS s after a 1 s warm-up, orders"
    echo "counted in MySQL); then an open model at $share % of that (\`loadtest --rate\`, the"
    echo "arrivals spread over the three replicas, $LATENCY_SECONDS s, without an"
    echo "Idempotency-Key, like the closed loop), every order timed from when it was due, so a strategy that"
    echo "falls behind shows it in its latency instead of slowing the arrivals down. One hot"
    echo "SKU with $LATENCY_STOCK units (nothing sells out), no simulated work, fencing off,"
    echo "a lock strategy with the cohort layer on (the service's default); its \`combined\`"
    echo "row adds combining (up to $COMBINE orders per critical section), so its capacity,"
    echo "and the load at $share % of it, are higher. Every strategy is measured $REPEAT times,"
    echo "the repeats interleaved."
    echo
    echo "    loadtest --targets PORTS --strategies NAME --rate R --skus 1 --stock $LATENCY_STOCK --max-seconds $LATENCY_SECONDS --grace-ms 0 --no-idempotency-key"
    echo
    echo "- Commit \`$COMMIT\`, binaries from \`$(dirname "$BINARY")\`, the load test \`$loadtest\`; $CORES cores (${CPU:-unknown CPU}), $MEMORY GiB;"
    echo "  load average $load as the runs began. The load test, the replicas and every"
    echo "  service share the cores."
    echo
    echo "Each cell: median of the repeats (min–max)."
    echo
    python3 scripts/bench/orders_table.py latency "$results"
    echo
    echo "**sold**: orders/s counted in MySQL during the open model; below **offered**, the"
    echo "strategy fell behind. **p50**, **p99**, **p99.9**: milliseconds from when each order"
    echo "was due to its answer (the load test's \`latency_ms\`, docs/report.md). **busy**:"
    echo "orders refused over the run (503 \`lock_timeout\`, optimistic giving up);"
    echo "**errors**: every other answer that is not an order (sold out included; none"
    echo "should be). **cores busy %**: all $CORES cores over the open model's window; **load test ms/order**: the load"
    echo "generator's CPU per order sold, for comparing with wrk's in the per-order table's"
    echo "CPU table: the capacity was measured with wrk's cost beside it, the open model"
    echo "with this one's."
    echo '<!-- latency:end -->'
  } >"$WORK/latency.md"
  replace_section latency "$WORK/latency.md"
}
