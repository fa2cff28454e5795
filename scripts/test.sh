#!/usr/bin/env bash
# Every test, against the real services: starts the stack (installing what is
# missing), clears what earlier test runs left behind, then runs the workspace's tests.
# Extra arguments go to `cargo test` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

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

# docker-compose.yml cannot run here (no Docker engine), but it must stay valid.
if ! command -v docker-compose >/dev/null; then
  echo "[test] installing docker-compose to validate docker-compose.yml" >&2
  if [ "$(id -u)" = 0 ]; then sudo_cmd=(); else sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
fi
docker-compose --profile loadtest config -q
echo "[test] docker-compose.yml is valid" >&2

cargo test --workspace "$@"
