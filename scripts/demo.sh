#!/usr/bin/env bash
# The main job: the local services, a release build, three replicas on 8081-8083.
#
#   scripts/demo.sh up     start everything and leave the replicas running
#   scripts/demo.sh stop   stop the replicas (scripts/stack.sh down stops the services)
#
# The full run (the load test over every strategy) arrives with the load-test crate.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RUN="$ROOT/.stack/cluster"
PIDFILE="$RUN/cluster.pid"
REPLICAS=3
BASE_PORT=8081

log() { printf '[demo] %s\n' "$*" >&2; }

pid_alive() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || return 1
  [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

replicas_up() {
  local port
  for port in $(seq "$BASE_PORT" $((BASE_PORT + REPLICAS - 1))); do
    curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || return 1
  done
}

cmd_stop() {
  [ -f "$PIDFILE" ] || { log "no replicas running"; return 0; }
  local pid i
  pid=$(cat "$PIDFILE")
  if pid_alive "$pid"; then
    kill -TERM "$pid"
    for i in $(seq 1 80); do pid_alive "$pid" || break; sleep 0.25; done
    pid_alive "$pid" && kill -KILL "$pid"
    log "replicas stopped"
  fi
  rm -f "$PIDFILE"
}

cmd_up() {
  ./scripts/stack.sh up
  eval "$(./scripts/stack.sh env)"
  log "building (release)"
  cargo build --release --quiet
  mkdir -p "$RUN"
  if [ -f "$PIDFILE" ] && pid_alive "$(cat "$PIDFILE")"; then
    log "replicas already running (pid $(cat "$PIDFILE")); restarting them on the new build"
    cmd_stop
  fi
  FLASHSALE_STATIC_DIR="$ROOT/static" nohup ./target/release/flashsale cluster \
    --replicas "$REPLICAS" --base-port "$BASE_PORT" >"$RUN/cluster.log" 2>&1 &
  echo $! >"$PIDFILE"
  local i
  for i in $(seq 1 240); do
    replicas_up && break
    pid_alive "$(cat "$PIDFILE")" || { tail -n 30 "$RUN/cluster.log" >&2; log "replicas failed to start"; exit 1; }
    sleep 0.25
  done
  replicas_up || { tail -n 30 "$RUN/cluster.log" >&2; log "replicas did not answer"; exit 1; }
  log "$REPLICAS replicas on ports $BASE_PORT-$((BASE_PORT + REPLICAS - 1)), logs in $RUN/cluster.log"
  log "dashboard: http://127.0.0.1:$BASE_PORT/"
}

case "${1:-up}" in
  up) cmd_up ;;
  stop) cmd_stop ;;
  *) echo "usage: $0 up|stop" >&2; exit 2 ;;
esac
