# Sourced by scripts/bench.sh (uses its WORK, REPEAT, COMMIT, CORES, CPU, MEMORY, log,
# die and replace_section): the whole order path under each strategy, measured from
# outside by wrk and counted in MySQL; around each run, where its time went (the
# replicas' `flashsale_order_step_seconds`) and its CPU (every process's, from /proc).

ORDER_SECONDS=${BENCH_ORDER_SECONDS:-5}
CONNECTIONS=${BENCH_CONNECTIONS:-10}
PORT=${BENCH_PORT:-8181}
read -r -a STRATEGIES <<<"${BENCH_STRATEGIES:-none redis-lock db-unique optimistic zookeeper db-for-update etcd redlock redis-atomic}"
# The lock strategies' modes (see modes_of): any of "cohort classic combined".
MODES=${BENCH_MODES:-cohort classic combined}
# How many queued orders a holder sells in one critical section in the "combined" mode.
COMBINE=${BENCH_COMBINE:-16}
# Strategies measured once more with an Idempotency-Key on every order (labelled
# "STRATEGY keyed", the cohort layer on): what the key costs.
read -r -a KEYED <<<"${BENCH_KEYED_STRATEGIES-none redis-lock redis-atomic}"
RUN_STAMP=$(date +%s%N)
# Another build to measure (e.g. an older commit's, for a before/after in one run).
BINARY=${BENCH_BINARY:-target/release/flashsale}
SKU=bench-hot
# Enough that nothing sells out within a run.
STOCK=10000000

admin() {
  curl -sf -X "$1" -H 'content-type: application/json' "http://127.0.0.1:$PORT$2" -d "$3" >/dev/null
}

# The SKUs `measure` buys and counts: $SKU, or the comma list $SKUS when a section
# sets it (`local SKUS=a,b`: bash's locals reach the functions the section calls).
orders_of_sku() {
  curl -sf "http://127.0.0.1:$PORT/api/stats" | python3 -c '
import json, sys
stats = json.load(sys.stdin)
wanted = sys.argv[1].split(",")
print(sum(s["orders"] for s in stats["skus"] if s["sku"] in wanted))' "${SKUS:-$SKU}"
}

# measure CONNECTIONS SECONDS LABEL REPEAT PORT...: wrk against every PORT at once;
# prints one JSON line: orders/s counted in MySQL, non-2xx answers/s counted by wrk.
measure() {
  local connections=$1 seconds=$2 label=$3 repeat=$4
  shift 4
  local before after port pids=() non2xx=0 n
  before=$(orders_of_sku)
  for port in "$@"; do
    BENCH_SKU=$SKU BENCH_SKUS=${SKUS:-} BENCH_WORKER="${label// /-}-$repeat-$port" BENCH_RUN=$RUN_STAMP \
      BENCH_KEYED=$([[ $label == *" keyed" ]] && echo 1 || echo 0) timeout $((seconds + 30)) \
      wrk -t1 -c"$connections" -d"${seconds}s" -s scripts/bench/order.lua \
      "http://127.0.0.1:$port" >"$WORK/wrk-$port.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}" || true
  after=$(orders_of_sku)
  for port in "$@"; do
    n=$(sed -n 's/^ *Non-2xx or 3xx responses: *//p' "$WORK/wrk-$port.txt")
    non2xx=$((non2xx + ${n:-0}))
  done
  python3 -c '
import json, sys
label, repeat, before, after, seconds, refused = sys.argv[1:]
print(json.dumps({"strategy": label, "repeat": int(repeat),
                  "orders_per_s": (int(after) - int(before)) / float(seconds),
                  "non_2xx_per_s": int(refused) / float(seconds)}))' \
    "$label" "$repeat" "$before" "$after" "$seconds" "$non2xx"
}

# costs before|after PORT...: one JSON object, what the runs between a `before` and an
# `after` cost:
# - the CPU ticks of each counted process: the stack's services by their pidfiles
#   (BENCH_STACK_DIR, default .stack), the replicas as the children of this script's
#   cluster; keyed by group, pid and start time, so a process that exits or a reused
#   pid is not compared;
# - the ticks of this shell and the children it waited for: wrk and the benchmark's
#   own curl and Python, the "harness";
# - the machine's busy and total ticks;
# - per PORT that answered, the sum and count of each strategy's steps.
# `before` scrapes the replicas before reading the ticks and `after` after, so the
# scrapes' own work stays outside the window.
costs() {
  local replicas
  replicas=$(pgrep -P "$CLUSTER_PID" | tr '\n' ' ' || true)
  STACK_DIR=${BENCH_STACK_DIR:-.stack} REPLICAS="$replicas" HARNESS=$$ python3 - "$@" <<'PY'
import glob, json, os, re, sys, urllib.request

def stat(pid):
    # Fields after the command name; utime, stime, cutime, cstime and starttime are
    # fields 14, 15, 16, 17 and 22 of stat.
    return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()

def ticks():
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
            fields = stat(pid)
        except OSError:
            continue
        processes[f'{group}/{pid}/{fields[19]}'] = int(fields[11]) + int(fields[12])
    shell = stat(os.environ['HARNESS'])
    # This script's own CPU so far: the shell counts all of it once it has exited,
    # but only what it spends from now on falls inside the window.
    mine = os.times()
    harness = sum(int(shell[i]) for i in (11, 12, 13, 14)) + round(
        (mine.user + mine.system) * os.sysconf('SC_CLK_TCK'))
    # user nice system idle iowait irq softirq; steal (another VM's) is left out.
    cpu = list(map(int, open('/proc/stat').readline().split()[1:8]))
    return {'processes': processes, 'harness': harness,
            'busy': sum(cpu) - cpu[3] - cpu[4], 'total': sum(cpu)}

def steps():
    found_steps = {}
    sample = re.compile(r'flashsale_order_step_seconds_(sum|count)\{(.*)\} (\S+)$')
    for port in sys.argv[2:]:
        try:
            text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read()
        except OSError:
            continue
        mine = found_steps.setdefault(port, {})
        for line in text.decode().splitlines():
            found = sample.match(line)
            if found:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', found[2]))
                key = f"{labels.get('strategy')}/{labels.get('step')}"
                totals = mine.setdefault(key, [0.0, 0.0])
                totals[0 if found[1] == 'sum' else 1] += float(found[3])
    return found_steps

if sys.argv[1] == 'before':
    scraped = steps()
    snapshot = ticks()
else:
    snapshot = ticks()
    scraped = steps()
snapshot['steps'] = scraped
print(json.dumps(snapshot))
PY
}

# measure_costs CONNECTIONS SECONDS LABEL REPEAT PORT...: `measure`, with what the
# run cost (`costs` before and after it) in one JSON line.
measure_costs() {
  local ports=("${@:5}") before measured after
  before=$(costs before "${ports[@]}")
  measured=$(measure "$@")
  after=$(costs after "${ports[@]}")
  printf '{"measured":%s,"before":%s,"after":%s}\n' "$measured" "$before" "$after"
}

# modes_of STRATEGY: the modes it is measured in: a lock strategy with the cohort layer
# on ("cohort") and, if BENCH_MODES asks for them, off ("classic": the lock as the
# articles teach it) and on with combining ("combined"); the others have no layer.
modes_of() {
  case "$1" in
    redis-lock | db-unique | zookeeper | etcd | redlock) echo "$MODES" ;;
    *) echo cohort ;;
  esac
}

# label_of STRATEGY MODE: a row's name, the strategy with its mode unless "cohort".
label_of() {
  if [ "$2" = cohort ]; then echo "$1"; else echo "$1 $2"; fi
}

# set_up STRATEGY MODE STOCK: the cluster switched to MODE and STRATEGY, and the SKUs
# measured ($SKUS, or $SKU) restocked to STOCK.
set_up() {
  local sku skus=${SKUS:-$SKU}
  admin PUT /api/admin/cohort "$(cohort_body "$2")"
  admin PUT /api/admin/strategy "{\"strategy\":\"$1\"}"
  for sku in ${skus//,/ }; do
    admin POST /api/admin/reset "{\"sku\":\"$sku\",\"stock\":$3}"
  done
}

# cohort_body MODE: the cohort switch's body for a mode of modes_of.
cohort_body() {
  case "$1" in
    classic) echo '{"enabled":false}' ;;
    combined) echo "{\"enabled\":true,\"combine\":$COMBINE}" ;;
    *) echo '{"enabled":true,"combine":1}' ;;
  esac
}

start_replicas() {
  # A database and Redis namespace of their own (BENCH_DATABASE, default
  # flashsale_bench), so a demo running beside keeps its strategy and stock, and two
  # builds with different migrations (before-after.sh) each keep theirs.
  local name=${BENCH_DATABASE:-flashsale_bench}
  [[ "$name" =~ ^flashsale_[a-z0-9_]+$ ]] || die "BENCH_DATABASE must look like flashsale_name"
  local base=${FLASHSALE_DATABASE_URL:-mysql://flashsale:flashsale@127.0.0.1:3390/flashsale}
  local url="${base%/*}/$name"
  python3 - "$url" "$name" <<'PY' || die "could not create the benchmark's database"
import subprocess, sys, urllib.parse
u = urllib.parse.urlparse(sys.argv[1])
subprocess.run(["mariadb", "--no-defaults", "-h", u.hostname, "-P", str(u.port or 3306),
                "-u", u.username, f"-p{u.password}", "-e",
                f"CREATE DATABASE IF NOT EXISTS {sys.argv[2]}"], check=True)
PY
  # Replicas already answering on these ports (a demo, a forgotten run) would be
  # measured in place of this build's, under their own settings.
  local port
  for port in "$PORT" $((PORT + 1)) $((PORT + 2)); do
    if curl -s -o /dev/null "http://127.0.0.1:$port/healthz"; then
      die "something already answers on port $port; stop it or set BENCH_PORT"
    fi
  done
  # No simulated work: the figures are the strategies' cost.
  FLASHSALE_WORK_MS=0 FLASHSALE_DATABASE_URL="$url" FLASHSALE_NAMESPACE="${name//_/-}" \
    "$BINARY" cluster --replicas 3 --base-port "$PORT" \
    >"$WORK/cluster.log" 2>&1 &
  CLUSTER_PID=$!
  local i
  for i in $(seq 1 120); do
    kill -0 "$CLUSTER_PID" 2>/dev/null || die "the benchmark's replicas exited (see $WORK/cluster.log)"
    curl -sf "http://127.0.0.1:$((PORT + 2))/healthz" >/dev/null && return 0
    sleep 0.5
  done
  die "the benchmark's replicas did not start (see $WORK/cluster.log)"
}

stop_replicas() {
  [ -n "${CLUSTER_PID:-}" ] || return 0
  kill -TERM "$CLUSTER_PID" 2>/dev/null || true
  wait "$CLUSTER_PID" 2>/dev/null || true
  CLUSTER_PID=
}

section_orders() {
  if ! command -v wrk >/dev/null; then
    log "installing wrk"
    scripts/apt-install.sh wrk
  fi
  local results="$WORK/orders.jsonl" ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
  local repeat strategy load
  start_replicas
  trap 'stop_replicas; rm -rf "$WORK"' EXIT
  admin PUT /api/admin/fencing '{"enabled":false}'
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  : >"$results"
  for repeat in $(seq 1 "$REPEAT"); do
    log "orders: repeat $repeat of $REPEAT, the base (none, one connection)"
    admin PUT /api/admin/strategy '{"strategy":"none"}'
    admin POST /api/admin/reset "{\"sku\":\"$SKU\",\"stock\":$STOCK}"
    measure 1 1 warm "$repeat" "$PORT" >/dev/null
    measure_costs 1 "$ORDER_SECONDS" baseline "$repeat" "$PORT" >>"$results"
    for strategy in "${STRATEGIES[@]}"; do
      for mode in $(modes_of "$strategy"); do
        local label
        label=$(label_of "$strategy" "$mode")
        log "orders: repeat $repeat of $REPEAT, $label"
        set_up "$strategy" "$mode" "$STOCK"
        measure "$CONNECTIONS" 1 warm "$repeat" "${ports[@]}" >/dev/null
        measure_costs "$CONNECTIONS" "$ORDER_SECONDS" "$label" "$repeat" "${ports[@]}" >>"$results"
      done
    done
    for strategy in ${KEYED[@]+"${KEYED[@]}"}; do
      log "orders: repeat $repeat of $REPEAT, $strategy keyed"
      set_up "$strategy" cohort "$STOCK"
      measure "$CONNECTIONS" 1 "warm keyed" "$repeat" "${ports[@]}" >/dev/null
      measure_costs "$CONNECTIONS" "$ORDER_SECONDS" "$strategy keyed" "$repeat" "${ports[@]}" >>"$results"
    done
  done
  stop_replicas

  {
    echo '<!-- orders:begin -->'
    echo '## Per order: each strategy against the bare critical section'
    echo
    echo "_Generated by \`scripts/bench.sh\` on $(date -u +%Y-%m-%d); do not edit by hand._"
    echo
    echo "One hot SKU, no simulated work (\`FLASHSALE_WORK_MS=0\`), fencing off, three"
    echo "replicas (\`flashsale cluster\`). For each strategy, wrk (an independent generator:"
    echo "one process per replica, $CONNECTIONS connections each) buys one unit per request"
    echo "for $ORDER_SECONDS s after a 1 s warm-up; orders are counted in MySQL (\`/api/stats\`),"
    echo "not by the client. The base is \`none\` with ONE connection to one replica, measured"
    echo "in the same repeat: the critical section with no lock and no contention. Every"
    echo "strategy is measured $REPEAT times, the repeats interleaved. A lock strategy's"
    echo "row is its lock with the cohort layer (docs/cohort.md), the service's default;"
    echo "its \`classic\` row is the same lock with the layer off, as the articles teach it:"
    echo "reported, not judged; its \`combined\` row is the layer with combining: a holder"
    echo "sells up to $COMBINE orders queued for the SKU in its replica in one critical"
    echo "section, one transaction (\`{\"combine\": $COMBINE}\`, docs/cohort.md). A \`keyed\` row is the strategy again with an"
    echo "\`Idempotency-Key\` of its own on every order (\`BENCH_KEYED=1\`): the key is claimed"
    echo "in MySQL before the order and recorded with it, so the row is what a shopper's"
    echo "protection against double clicks costs (docs/order-flow.md, guarantee 8)."
    echo
    echo "    wrk -t1 -c$CONNECTIONS -d${ORDER_SECONDS}s -s scripts/bench/order.lua http://127.0.0.1:PORT   # per replica"
    echo
    echo "- Commit \`$COMMIT\`, binaries from \`$(dirname "$BINARY")\`; $CORES cores (${CPU:-unknown CPU}), $MEMORY GiB;"
    echo "  load average $load as the runs began. wrk, the replicas and every service"
    echo "  share the cores."
    echo "- Lease ${FLASHSALE_LOCK_LEASE_MS:-10000} ms, lock wait 5 s, 16 MySQL connections per replica."
    echo
    echo "Each cell: median of the repeats (min–max)."
    echo
    python3 scripts/bench/orders_table.py ratios "$results"
    echo
    echo "**non-2xx answers/s**: refusals (503 \`lock_timeout\`, optimistic giving up); with"
    echo "$STOCK units in stock nothing sells out."
    echo
    echo "### Where a lock strategy's time per order goes"
    echo
    echo "On one hot SKU a lock sells one order at a time, so its time per order (1000 ÷"
    echo "orders/s) is one holder's critical section and then the passing of the lock to the"
    echo "next. The steps are the replicas' own means over the same runs"
    echo "(\`flashsale_order_step_seconds\` in \`/metrics\`): **read** the stock (a holder also"
    echo "marks it pending), the lock's **last check**, the MySQL **commit** (BEGIN, UPDATE,"
    echo "INSERT, COMMIT), the **cache write**, the lock's **release**. **between steps** is"
    echo "the time per order they leave: mostly the handoff, from one holder's release"
    echo "returning to the next holder's acquisition returning, plus the bookkeeping"
    echo "between steps. A release can overlap the next acquisition, so this is less than"
    echo "the handoff \`lockbench\` measures (from the release's start). **the lock's part**"
    echo "is the time per order less read, commit and cache write. **at the goal**: the time"
    echo "per order the goal's ratio allows against the base, and what that leaves the lock"
    echo "if the store's steps stay as measured. The base's row is \`none\` on one"
    echo "connection, whose time between steps is the HTTP round trip and the settings read."
    echo "Milliseconds, pooled over the repeats (all their seconds over all their orders, so"
    echo "a row adds up), with the repeats' min–max of the time per order; **runs**: the"
    echo "repeats counted (one whose replicas' counters cannot be compared is left out)."
    echo
    python3 scripts/bench/orders_table.py time "$results"
    echo
    echo "### Where each order's CPU goes"
    echo
    echo "CPU time per order by process over the same runs, in milliseconds, read from"
    echo "\`/proc\`: this run's replicas, the stack's services by their pidfiles (**other**:"
    echo "pidfiles of anything else there), and **wrk and harness**, the load generator with"
    echo "the benchmark's own curl and Python. **rest** is the machine's other busy time (the"
    echo "kernel's interrupts, anything else running; a few hundredths below zero are two"
    echo "counters sampled apart). **busy %** is all $CORES cores"
    echo "together over each run's window, a little longer than the $ORDER_SECONDS s of load."
    echo "**at most** is the orders/s the cores could give if they did nothing but these"
    echo "orders at this cost each, wrk and harness left out ($CORES × 1000 ÷ (total − wrk and"
    echo "harness)), and **÷ base** that ceiling as a ratio to the same repeat's base, median"
    echo "(min–max) of the repeats: a goal above it cannot be met on this machine at this CPU"
    echo "per order. Pooled over the repeats."
    echo
    python3 scripts/bench/orders_table.py cpu "$results" "$CORES" "$ORDER_SECONDS"
    echo '<!-- orders:end -->'
  } >"$WORK/orders.md"
  replace_section orders "$WORK/orders.md"
}
