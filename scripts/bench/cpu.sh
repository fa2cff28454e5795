#!/usr/bin/env bash
# Where each strategy's cost lands: CPU time per order spent by each process (the
# replicas, Redis, MariaDB, ZooKeeper, etcd, and the rest: wrk, the kernel's share of
# other processes), read from /proc over one wrk run per strategy. Orders/s says how
# fast; this says which backend pays, which is what bounds a contended lock on a
# machine whose cores everything shares. Prints a markdown table.
#
#   scripts/bench/cpu.sh [ROUNDS]
#
# Uses scripts/bench/orders.sh's settings (BENCH_*) and strategies (BENCH_STRATEGIES),
# and the services the FLASHSALE_* variables point at (eval "$(scripts/stack.sh env)").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
rounds=${1:-1}
WORK=$(mktemp -d)
log() { printf '[cpu] %s\n' "$*" >&2; }
die() { printf '[cpu] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=orders.sh
source scripts/bench/orders.sh
trap 'stop_replicas; rm -rf "$WORK"' EXIT

# One JSON object: CPU ticks by process group, and the whole machine's busy and total.
ticks() {
  python3 - <<'PY'
import json, os
groups = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        comm = open(f'/proc/{pid}/comm').read().strip()
        cmdline = open(f'/proc/{pid}/cmdline').read().split('\0')
        fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    except OSError:
        continue
    if comm == 'java' and any('ZooKeeperServerMain' in arg for arg in cmdline):
        group = 'zookeeper'
    elif comm.startswith('redis-server'):
        group = 'redis'
    elif comm in ('mariadbd', 'mysqld'):
        group = 'mariadb'
    elif comm == 'etcd':
        group = 'etcd'
    elif comm == 'flashsale' and 'serve' in cmdline:
        group = 'replicas'
    else:
        continue
    # utime and stime, the 14th and 15th fields of stat.
    groups[group] = groups.get(group, 0) + int(fields[11]) + int(fields[12])
cpu = list(map(int, open('/proc/stat').readline().split()[1:9]))
groups['_busy'] = sum(cpu) - cpu[3] - cpu[4]
groups['_total'] = sum(cpu)
print(json.dumps(groups))
PY
}

start_replicas
admin PUT /api/admin/fencing '{"enabled":false}'
ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
results="$WORK/cpu.jsonl"
: >"$results"
for round in $(seq 1 "$rounds"); do
  for strategy in "${STRATEGIES[@]}"; do
    log "round $round of $rounds: $strategy"
    admin PUT /api/admin/strategy "{\"strategy\":\"$strategy\"}"
    admin POST /api/admin/reset "{\"sku\":\"$SKU\",\"stock\":$STOCK}"
    measure "$CONNECTIONS" 1 warm "$round" "${ports[@]}" >/dev/null
    before=$(ticks)
    orders_before=$(orders_of_sku)
    measure "$CONNECTIONS" "$ORDER_SECONDS" "$strategy" "$round" "${ports[@]}" >/dev/null
    after=$(ticks)
    orders_after=$(orders_of_sku)
    printf '{"strategy":"%s","orders":%d,"before":%s,"after":%s}\n' "$strategy" \
      $((orders_after - orders_before)) "$before" "$after" >>"$results"
  done
done

python3 - "$results" "$ORDER_SECONDS" <<'PY'
import json, os, statistics, sys
hz = os.sysconf('SC_CLK_TCK')
seconds = float(sys.argv[2])
groups = ['replicas', 'redis', 'mariadb', 'zookeeper', 'etcd']
rows = {}
for line in open(sys.argv[1]):
    run = json.loads(line)
    n = max(run['orders'], 1)
    delta = {k: run['after'].get(k, 0) - run['before'].get(k, 0) for k in run['after']}
    per_order = {g: delta.get(g, 0) / hz * 1000 / n for g in groups}
    per_order['rest'] = (delta['_busy'] - sum(delta.get(g, 0) for g in groups)) / hz * 1000 / n
    per_order['total'] = delta['_busy'] / hz * 1000 / n
    per_order['orders/s'] = run['orders'] / seconds
    per_order['busy %'] = 100 * delta['_busy'] / max(delta['_total'], 1)
    rows.setdefault(run['strategy'], []).append(per_order)
columns = ['orders/s', 'busy %'] + groups + ['rest', 'total']
print('| strategy | ' + ' | '.join(columns) + ' |')
print('|---' * (len(columns) + 1) + '|')
for strategy, runs in rows.items():
    cells = []
    for column in columns:
        value = statistics.median(run[column] for run in runs)
        cells.append(f'{value:.0f}' if column in ('orders/s', 'busy %') else f'{value:.2f}')
    print(f'| {strategy} | ' + ' | '.join(cells) + ' |')
PY
