#!/usr/bin/env bash
# Regenerates the measured sections of BENCHMARKS.md from this checkout, so the
# document never drifts from the code: each section sits between markers
# (<!-- NAME:begin --> ... <!-- NAME:end -->) and is rewritten whole, with the commit,
# the machine and the settings it was measured with. Never edit between the markers.
#
#   scripts/bench.sh              services up (scripts/stack.sh), release build, measure
#   scripts/bench.sh --no-stack   use the services the FLASHSALE_* variables point at
#                                 (e.g. after `eval "$(path/to/stack.sh env)"`)
#
# Sections:
#   lockbench   each lock primitive alone (target/release/lockbench), every lock
#               repeated, median and min-max; beside them, in the same runs, the
#               libraries people use instead (scripts/bench/peers.py, in a virtualenv
#               under target/ from PyPI) and the goals against them
#   orders      orders/s per strategy on one hot SKU, measured by wrk (an independent
#               generator) against three replicas and counted in MySQL, as a ratio to
#               `none` with one connection in the same repeat; from the same runs,
#               where a lock strategy's time per order goes (the replicas' step
#               histograms) and each process's CPU time per order (/proc)
#   latency     per strategy (a lock with the cohort layer on), its capacity measured
#               as in `orders` (wrk, counted in MySQL), then at 80 % of it an open
#               model (`loadtest --rate`) on the same hot SKU: p50, p99 and p99.9
#               from when each order was due (scripts/bench/latency.sh)
#   skus        the `orders` runs again with every request buying the next of 16
#               SKUs, as a ratio to `none` on the same SKUs with the same connections
#               in the same repeat (scripts/bench/skus.sh)
#   roundtrips  requests per order sold to each backing service (Redis, MariaDB,
#               ZooKeeper, etcd), from the servers' own counters, per strategy, each
#               lock with the cohort layer on and off (scripts/bench/cost.sh)
#   recovery    per lock strategy, from `kill -9` of the replica holding the lock to
#               the next order another replica sells, with the README demo's lease
#
#   scripts/bench.sh [--no-stack] lockbench|orders|latency|skus|roundtrips|recovery
#                                 only those
#
# Settings, from the environment:
#   BENCH_CONTENDERS (8), BENCH_SECONDS (3), BENCH_REPEAT (5),
#   BENCH_LOCKS (redis-lock,db-unique,zookeeper,db-for-update,etcd,redlock,none),
#   BENCH_PEERS (python-redis-lock,redis-py-lock,kazoo,python-etcd3; empty: none),
#   FLASHSALE_LOCK_LEASE_MS and FLASHSALE_ZK_SESSION_MS as for `flashsale serve`;
#   BENCH_ORDER_SECONDS (5), BENCH_CONNECTIONS (10 per replica), BENCH_PORT (8181,
#   the first of the three replicas this script starts and stops), BENCH_STRATEGIES
#   (space-separated, default all), BENCH_MODES ("cohort classic": each lock strategy
#   with the cohort layer on and off; "cohort": on only), BENCH_BIN_DIR (default target/release: the
#   binaries measured; any other folder is used as it is, without a build: scripts/test.sh
#   points it at the debug build its tests made, so the workspace is not built twice),
#   BENCH_LATENCY_SECONDS (10: each open model's arrivals), BENCH_LATENCY_LOAD (0.8:
#   the share of the capacity offered), BENCH_LOADTEST (default BIN_DIR/loadtest),
#   BENCH_SKU_COUNT (16), BENCH_RT_ORDERS (200), BENCH_RT_CONCURRENCY (30), BENCH_RT_REPEAT (3),
#   BENCH_RECOVERY_REPEAT (3), BENCH_RECOVERY_LOCKS (the six lock strategies),
#   BENCH_STACK_DIR (the services' pidfiles, for the CPU table; default .stack);
#   BENCH_DOC, the document written (default BENCHMARKS.md; scripts/test.sh runs a
#   small lockbench section into a scratch file, so the pipeline cannot rot).
# Every run is bounded in time; the whole default run takes about thirty-eight
# minutes after the build (four for lockbench and the peers, five for the orders,
# fifteen for the latency (per strategy and repeat: 1 s warm-up, 5 s of capacity, 10 s
# of open model, about 3 s around them; a strategy whose orders time out adds the
# load test's 15 s timeout), eight for the 16 SKUs (five with BENCH_MODES=cohort),
# three and a half for the round trips, two for the recovery). Five repeats,
# because three left a goal's verdict to one noisy round.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DOC=${BENCH_DOC:-$ROOT/BENCHMARKS.md}

log() { printf '[bench] %s\n' "$*" >&2; }
die() { printf '[bench] ERROR: %s\n' "$*" >&2; exit 1; }

use_stack=1
sections=()
for arg in "$@"; do
  case "$arg" in
    --no-stack) use_stack=0 ;;
    lockbench | orders | latency | skus | roundtrips | recovery) sections+=("$arg") ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

CONTENDERS=${BENCH_CONTENDERS:-8}
SECONDS_PER_RUN=${BENCH_SECONDS:-3}
REPEAT=${BENCH_REPEAT:-5}
LOCKS=${BENCH_LOCKS:-redis-lock,db-unique,zookeeper,db-for-update,etcd,redlock,none}
[[ "$CONTENDERS" =~ ^[0-9]+$ ]] || die "BENCH_CONTENDERS must be a whole number"
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "BENCH_REPEAT must be a whole number above 0"
[[ "$SECONDS_PER_RUN" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "BENCH_SECONDS must be a number"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ "$use_stack" = 1 ]; then
  ./scripts/stack.sh up
  eval "$(./scripts/stack.sh env)"
fi

# What the figures were measured on, taken before anything is built or written.
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no -- . ":!BENCHMARKS.md" 2>/dev/null)" ]; then
  COMMIT="$COMMIT plus uncommitted changes"
fi
CORES=$(nproc)
CPU=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1)
MEMORY=$(free -g | awk '/^Mem:/ {print $2}')
version() { command -v "$1" >/dev/null && "$@" 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1; }
REDIS_VERSION=$(version redis-server --version || true)
MARIADB_VERSION=$(version mariadb --version || true)
ETCD_VERSION=$(version etcd --version || true)
ZK_VERSION=$(ls /usr/share/java/zookeeper-[0-9]*.jar 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1 || true)

BIN_DIR=${BENCH_BIN_DIR:-target/release}
if [ "$BIN_DIR" = target/release ]; then
  log "building (release)"
  cargo build --release --workspace --quiet
fi
[ -x "$BIN_DIR/lockbench" ] && [ -x "$BIN_DIR/flashsale" ] || die "no lockbench and flashsale in $BIN_DIR"
export BENCH_BINARY=$BIN_DIR/flashsale

# Replaces the block between <!-- $1:begin --> and <!-- $1:end -->
# in the document ($DOC) with the file $2 (markers included in it), or appends it if
# the markers are missing.
replace_section() {
  local name=$1 file=$2 begin="<!-- $1:begin -->" end="<!-- $1:end -->"
  if grep -qF "$begin" "$DOC" && grep -qF "$end" "$DOC"; then
    awk -v begin="$begin" -v end="$end" -v file="$file" '
      $0 == begin { while ((getline line < file) > 0) print line; skipping = 1; next }
      $0 == end { skipping = 0; next }
      !skipping { print }
    ' "$DOC" >"$WORK/doc"
  else
    { cat "$DOC"; echo; cat "$file"; } >"$WORK/doc"
  fi
  cat "$WORK/doc" >"$DOC"
  log "$DOC: section $name rewritten"
}

PEERS=${BENCH_PEERS-python-redis-lock,redis-py-lock,kazoo,python-etcd3}
PEERS_VENV="$ROOT/target/bench-peers"

# The peers' virtualenv, made (again, if a half-made one has no pip) or brought up to
# the pinned versions; false when it cannot be (no python3-venv, PyPI unreachable).
peers_ready() {
  if [ ! -x "$PEERS_VENV/bin/pip" ]; then
    rm -rf "$PEERS_VENV"
    python3 -m venv "$PEERS_VENV" || return 1
  fi
  "$PEERS_VENV/bin/pip" install -q --disable-pip-version-check \
    -r scripts/bench/peers-requirements.txt >&2
}

section_lockbench() {
  local results="$WORK/lockbench.jsonl" lock run out bound load peers=""
  bound=$((${SECONDS_PER_RUN%.*} + 60))
  local no_peers=""
  if [ -z "$PEERS" ]; then
    no_peers="were left out of this run (\`BENCH_PEERS\` was empty)"
  elif peers_ready; then
    peers=${PEERS//,/ }
  else
    no_peers="were not measured in this run: their virtualenv could not be made or
installed from PyPI"
    log "the peers' libraries could not be installed; measuring ours alone"
  fi
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  : >"$results"
  # Run-major (every lock, then every lock again), so a slow spell of the machine
  # spreads over ours and the peers alike instead of spoiling one.
  for run in $(seq 1 "$REPEAT"); do
    for lock in ${LOCKS//,/ } $peers; do
      log "lockbench $lock, run $run of $REPEAT"
      case " $peers " in
        *" $lock "*)
          out=$(timeout "$bound" "$PEERS_VENV/bin/python" scripts/bench/peers.py run "$lock" \
            --contenders "$CONTENDERS" --seconds "$SECONDS_PER_RUN" \
            --lease-ms "${FLASHSALE_LOCK_LEASE_MS:-10000}" \
            --zk-session-ms "${FLASHSALE_ZK_SESSION_MS:-4000}") || out="" ;;
        *)
          out=$(timeout "$bound" "$BIN_DIR/lockbench" --lock "$lock" \
            --contenders "$CONTENDERS" --seconds "$SECONDS_PER_RUN") || out="" ;;
      esac
      # Both exit non-zero when a run failed, which empties out.
      if [ -n "$out" ]; then
        tail -n1 <<<"$out" >>"$results"
      else
        log "lockbench $lock failed; counted as a failed run"
        printf '{"lock":"%s","failed":true}\n' "$lock" >>"$results"
      fi
    done
  done
  "$BIN_DIR/lockbench" --table "$results" >"$WORK/lockbench-table.md"
  local against
  if [ -n "$peers" ]; then
    against="The libraries people use instead are the rows below ours, measured in the
same runs and the same shape by \`scripts/bench/peers.py\` (versions pinned in
\`scripts/bench/peers-requirements.txt\`): python-redis-lock (waiters block on a
list the release pushes to), redis-py's \`Lock\` polling every 1 ms, kazoo's
\`Lock\` (ZooKeeper's recipe) and python-etcd3's \`Lock\` (a lease per attempt,
every waiter watching the one key; its protobuf 3.20 runs in pure Python). Python
is slower than Rust at the client end, so the ratios below credit part of the gap
to the language, not to the recipe. A round is every lock once, ours then theirs;
each ratio is taken round by round.

The goals, from the runs above:

$(python3 scripts/bench/peers.py goals "$results")"
  else
    against="The libraries people use instead (python-redis-lock, redis-py's \`Lock\`,
kazoo, python-etcd3) $no_peers; figures from another run would not compare."
  fi

  cat >"$WORK/lockbench.md" <<EOF
<!-- lockbench:begin -->
## The lock alone: \`lockbench\`

_Generated by \`scripts/bench.sh\` on $(date -u +%Y-%m-%d); do not edit by hand._

Each lock primitive with nothing around it: $CONTENDERS contenders, each a separate
process with its own connections (like replicas), loop *acquire, empty critical
section, release* on one lock name for $SECONDS_PER_RUN s; every lock run $REPEAT times.

    target/release/lockbench --lock NAME --contenders $CONTENDERS --seconds $SECONDS_PER_RUN

- Commit \`$COMMIT\`, binaries from \`$BIN_DIR\`.
- Machine: $CORES cores (${CPU:-unknown CPU}), $MEMORY GiB memory; load average
  $load as the runs began. Contenders, services and whatever else runs share
  the cores: compare the locks with each other, not with other machines.
- Services: Redis ${REDIS_VERSION:-?} (redlock: 3 nodes), MariaDB ${MARIADB_VERSION:-?},
  ZooKeeper ${ZK_VERSION:-?}, etcd ${ETCD_VERSION:-?}, all on loopback. Lease
  ${FLASHSALE_LOCK_LEASE_MS:-10000} ms, ZooKeeper session ${FLASHSALE_ZK_SESSION_MS:-4000} ms.

Each cell: median of the runs (min–max).

$(cat "$WORK/lockbench-table.md")

- **cycles/s**: acquisitions in the window, all contenders together.
- **handoff**: from a holder starting its release to the next, *different*
  contender holding: what a waiter sees. A holder that takes the lock straight back
  is no handoff; it shows in the next column.
- **contender max/min**: the busiest contender's cycles over the idlest's (1.00 is
  perfectly fair; ∞: a contender never got the lock).
- **violations**: times a contender took the lock while another held it, counted in
  shared memory by the contenders themselves, independently of the lock; \`none\` (no
  lock at all) is the control that shows the count works.
- **errors**: acquires or releases that failed for another reason than the window
  ending.

$against
<!-- lockbench:end -->
EOF
  replace_section lockbench "$WORK/lockbench.md"
}

source scripts/bench/orders.sh
source scripts/bench/latency.sh
source scripts/bench/skus.sh
source scripts/bench/services.sh
source scripts/bench/cost.sh

[ ${#sections[@]} -gt 0 ] || sections=(lockbench orders latency skus roundtrips recovery)
for section in "${sections[@]}"; do
  "section_$section"
done
