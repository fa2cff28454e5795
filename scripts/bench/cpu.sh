#!/usr/bin/env bash
# Where each strategy's cost lands: CPU time per order spent by each process (this
# benchmark's replicas, the stack's Redis nodes, MariaDB, ZooKeeper and etcd, and the
# rest: wrk, the kernel, anything else), read from /proc over one wrk run per strategy. Orders/s says how
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

# One JSON object: CPU ticks of each counted process, keyed by group, pid and start
# time (a process that exits or a pid reused between two snapshots is not compared),
# and the whole machine's busy and total ticks. Counted: the stack's services by their
# pidfiles and this benchmark's replicas (the children of its cluster), nothing else
# that happens to run here.
ticks() {
  local replicas
  replicas=$(pgrep -P "$CLUSTER_PID" | tr '\n' ' ' || true)
  STACK_DIR=.stack REPLICAS="$replicas" python3 - <<'PY'
import glob, json, os
pids = {}
for pidfile in glob.glob(os.path.join(os.environ['STACK_DIR'], '*', '*.pid')):
    service = os.path.basename(os.path.dirname(pidfile)).split('-')[0]
    try:
        pids[open(pidfile).read().strip()] = service
    except OSError:
        pass
for pid in os.environ['REPLICAS'].split():
    pids[pid] = 'replicas'
processes = {}
for pid, group in pids.items():
    try:
        fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    except OSError:
        continue
    # utime, stime and starttime: fields 14, 15 and 22 of stat.
    processes[f'{group}/{pid}/{fields[19]}'] = int(fields[11]) + int(fields[12])
# user nice system idle iowait irq softirq; steal (another VM's) is left out.
cpu = list(map(int, open('/proc/stat').readline().split()[1:8]))
print(json.dumps({'processes': processes, 'busy': sum(cpu) - cpu[3] - cpu[4],
                  'total': sum(cpu)}))
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
    measured=$(measure "$CONNECTIONS" "$ORDER_SECONDS" "$strategy" "$round" "${ports[@]}")
    after=$(ticks)
    printf '{"measured":%s,"before":%s,"after":%s}\n' "$measured" "$before" "$after" >>"$results"
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
    # Orders counted in MySQL by `measure`, over the run the snapshots bracket.
    orders = run['measured']['orders_per_s'] * seconds
    n = max(orders, 1)
    before, after = run['before'], run['after']
    spent = dict.fromkeys(groups, 0)
    for process, ticks in after['processes'].items():
        if process in before['processes']:
            group = process.split('/')[0]
            spent[group] = spent.get(group, 0) + ticks - before['processes'][process]
    busy = after['busy'] - before['busy']
    per_order = {g: spent[g] / hz * 1000 / n for g in groups}
    per_order['rest'] = (busy - sum(spent.values())) / hz * 1000 / n
    per_order['total'] = busy / hz * 1000 / n
    per_order['orders/s'] = orders / seconds
    per_order['busy %'] = 100 * busy / max(after['total'] - before['total'], 1)
    rows.setdefault(run['measured']['strategy'], []).append(per_order)
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
