#!/usr/bin/env bash
# The local backing services for flashsale, as plain processes on loopback.
#
#   scripts/stack.sh up       install what is missing, start everything, wait until ready
#                             (Redis 6390 with its replica 6393 and Sentinel 26390)
#   scripts/stack.sh tools    install only what building needs (gcc, protoc, ...), so
#                             that a fresh machine can build while the services install
#   scripts/stack.sh down     stop what `up` started (by the PIDs it recorded)
#   scripts/stack.sh status   one line per service
#   scripts/stack.sh env      the FLASHSALE_* variables pointing at this stack
#   scripts/stack.sh restart redis|mariadb|zookeeper|etcd
#                             kill -9 one service and start it again (fault injection)
#   scripts/stack.sh failover Sentinel fails the Redis pair over (fault injection)
#
# Ports are not the defaults so a system Redis/MySQL does not clash. Data, logs and
# pidfiles live under .stack/ (git-ignored). `up` is idempotent, and restarts a
# service that an older checkout started with other settings.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK="$ROOT/.stack"
REDIS_PORTS=(6390 6391 6392) # 6390 holds the stock; all three are RedLock's nodes
# 6390 is also the primary of a high-availability pair: 6393 replicates it and one
# Sentinel watches both, so that a failover (the dashboard's failover fault) can lose a
# lock the replica never received. One Sentinel with quorum 1 is enough for a lab: it
# only fails over when asked (down-after is a minute, far above any stall here).
REDIS_REPLICA_PORT=6393
SENTINEL_PORT=26390
SENTINEL_MASTER=flashsale
MARIADB_PORT=3390
ZK_PORT=2190
ETCD_PORT=2390
ETCD_PEER_PORT=2391
DB_NAME=flashsale
DB_USER=flashsale
DB_PASSWORD=flashsale

log() { printf '[stack] %s\n' "$*" >&2; }
die() { printf '[stack] ERROR: %s\n' "$*" >&2; exit 1; }

# --- helpers -----------------------------------------------------------------

# A PID counts as running unless it is gone or a zombie (killed children linger).
pid_alive() {
  local pid=$1 state
  [ -n "$pid" ] || return 1
  state=$(ps -o stat= -p "$pid" 2>/dev/null | tr -d ' ') || return 1
  [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

pidfile_alive() { [ -f "$1" ] && pid_alive "$(cat "$1")"; }

# wait_for NAME LOGFILE CHECK-COMMAND...: poll up to 60 s, then show the log tail.
wait_for() {
  local name=$1 logfile=$2; shift 2
  local i
  for i in $(seq 1 240); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  log "$name did not become ready; last lines of $logfile:"
  tail -n 30 "$logfile" >&2 || true
  die "$name failed to start"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Refuse to start NAME on PORT when something we did not start already listens there:
# talking to a stranger's server would make every figure a lie.
ensure_port_free() {
  local name=$1 port=$2
  if port_busy "$port"; then
    die "port $port (for $name) is taken by a process this stack did not start; stop it first"
  fi
}

# already_up NAME DIR PIDFILE SETTINGS READY-COMMAND...: whether NAME runs, answers,
# and was started with SETTINGS (its command line and configuration, saved in
# DIR/settings by `started`). One started with other settings, by an older checkout
# of this script, is stopped: `up` never leaves a service set up otherwise than here.
already_up() {
  local name=$1 dir=$2 pidfile=$3 settings=$4; shift 4
  { pidfile_alive "$pidfile" && "$@" >/dev/null 2>&1; } || return 1
  [ "$(cat "$dir/settings" 2>/dev/null)" = "$settings" ] && return 0
  log "$name runs with other settings than this script's; restarting it"
  stop_pidfile "$name" "$pidfile"
  return 1
}

started() { printf '%s' "$2" >"$1/settings"; }


apt_install() {
  [ $# -eq 0 ] && return 0
  log "installing: $*"
  "$ROOT/scripts/apt-install.sh" "$@"
}

# What building and the scripts need that a minimal Debian lacks (not services): the
# etcd client crate generates its gRPC code with protoc and protoc's own .proto files;
# ring compiles C and rustc links with cc (gcc, and the C library's headers and startup
# files); cargo, pip and npm check the registries' certificates; demo.sh and the bench
# use curl, and the scripts find their processes with ps and pgrep (procps).
install_tools() {
  local missing=()
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  [ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
  command -v cc >/dev/null || missing+=(gcc)
  [ -f /usr/include/stdio.h ] || missing+=(libc6-dev)
  [ -f /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
  command -v curl >/dev/null || missing+=(curl)
  command -v ps >/dev/null || missing+=(procps)
  apt_install ${missing[@]+"${missing[@]}"}
}

install_services() {
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  { [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db && command -v mariadb; } >/dev/null || missing+=(mariadb-server)
  [ -f /usr/share/java/zookeeper.jar ] || missing+=(zookeeper)
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v etcdctl >/dev/null || missing+=(etcd-client)
  command -v java >/dev/null || missing+=(default-jre-headless)
  apt_install ${missing[@]+"${missing[@]}"}
}

# --- Redis -------------------------------------------------------------------

redis_ready() { [ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" = PONG ]; }

# redis_up PORT [EXTRA ARGS...]
redis_up() {
  local port=$1 dir="$STACK/redis-$1"; shift
  mkdir -p "$dir"
  local args=(--port "$port" --bind 127.0.0.1 --save '' --appendonly no
    --daemonize yes --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" "$@")
  already_up "redis:$port" "$dir" "$dir/redis.pid" "${args[*]}" redis_ready "$port" && return 0
  ensure_port_free redis "$port"
  redis-server "${args[@]}"
  started "$dir" "${args[*]}"
  wait_for "redis:$port" "$dir/redis.log" redis_ready "$port"
}

# The pair's nodes send a resync at once rather than after 5 s (diskless replication
# waits for more replicas by default): after a failover the old primary follows the
# new one within a moment.
HA_ARGS=(--repl-diskless-sync-delay 0)

sentinel_cli() { redis-cli -h 127.0.0.1 -p "$SENTINEL_PORT" "$@"; }

# The primary's port as Sentinel names it.
sentinel_primary_port() {
  sentinel_cli sentinel get-master-addr-by-name "$SENTINEL_MASTER" 2>/dev/null | tail -n 1
}

# Sentinel answers and knows the primary.
sentinel_answers() { [ -n "$(sentinel_primary_port)" ]; }

# The pair is healthy: Sentinel sees the replica's link to the primary up. For some
# seconds after a failover it is not (the old primary is reconfigured, then resyncs).
pair_healthy() {
  sentinel_answers && sentinel_cli sentinel replicas "$SENTINEL_MASTER" 2>/dev/null | grep -qx ok
}

# Sentinel is `redis-server --sentinel` (the redis-server package; Debian's
# redis-sentinel package is the same binary with a system service we do not want).
# It rewrites its configuration file with what it learns, so the settings compared
# by already_up are the configuration we wrote, not the file.
sentinel_up() {
  local dir="$STACK/sentinel-$SENTINEL_PORT"
  mkdir -p "$dir"
  local config
  config=$(cat <<CFG
port $SENTINEL_PORT
bind 127.0.0.1
daemonize yes
dir $dir
pidfile $dir/sentinel.pid
logfile $dir/sentinel.log
sentinel monitor $SENTINEL_MASTER 127.0.0.1 ${REDIS_PORTS[0]} 1
sentinel down-after-milliseconds $SENTINEL_MASTER 60000
sentinel failover-timeout $SENTINEL_MASTER 10000
CFG
)
  already_up "sentinel:$SENTINEL_PORT" "$dir" "$dir/sentinel.pid" "$config" sentinel_answers && return 0
  ensure_port_free sentinel "$SENTINEL_PORT"
  printf '%s\n' "$config" >"$dir/sentinel.conf"
  redis-server "$dir/sentinel.conf" --sentinel
  started "$dir" "$config"
  wait_for "sentinel:$SENTINEL_PORT" "$dir/sentinel.log" sentinel_answers
}

# After a failover fault 6393 is the primary; whatever reads FLASHSALE_REDIS_URL
# (6390) expects the primary there: fail back through Sentinel.
redis_failback() {
  local i port log="$STACK/sentinel-$SENTINEL_PORT/sentinel.log"
  # A failover fault whose replica died halfway may have left replication cut (its
  # task gives it back otherwise): the pair may sync again.
  for port in "${REDIS_PORTS[0]}" "$REDIS_REPLICA_PORT"; do
    redis-cli -p "$port" ACL SETUSER default +psync +sync >/dev/null 2>&1 || true
  done
  wait_for "the Redis pair" "$log" pair_healthy
  [ "$(sentinel_primary_port)" = "${REDIS_PORTS[0]}" ] && return 0
  log "Sentinel names $(sentinel_primary_port) the primary; failing back to ${REDIS_PORTS[0]}"
  sentinel_cli sentinel failover "$SENTINEL_MASTER" >/dev/null
  for i in $(seq 1 240); do
    [ "$(sentinel_primary_port)" = "${REDIS_PORTS[0]}" ] && break
    sleep 0.25
  done
  [ "$(sentinel_primary_port)" = "${REDIS_PORTS[0]}" ] || die "Sentinel did not fail back to ${REDIS_PORTS[0]}"
  wait_for "the Redis pair" "$log" replica_follows
}

# The replica follows the primary, as the replica itself reports (Sentinel's view of a
# node it has just demoted lags by up to 10 s).
replica_follows() { follows "$REDIS_REPLICA_PORT"; }

# --- MariaDB -----------------------------------------------------------------

mariadb_client() {
  mariadb --no-defaults --protocol=socket --socket="$STACK/mariadb/mariadb.sock" -uroot "$@"
}

mariadb_ready() {
  mariadb --no-defaults -h127.0.0.1 -P"$MARIADB_PORT" -u"$DB_USER" -p"$DB_PASSWORD" \
    "$DB_NAME" -e 'select 1'
}

mariadb_up() {
  local dir="$STACK/mariadb"
  mkdir -p "$dir"
  # max_connections: every test starts several replicas, each with its own pool.
  # innodb_lock_wait_timeout stays at its default; strategies bound their own waits.
  local args=(--no-defaults --datadir="$dir/data" --user="$(id -un)"
    --bind-address=127.0.0.1 --port="$MARIADB_PORT" --socket="$dir/mariadb.sock"
    --pid-file="$dir/mariadb.pid" --log-error="$dir/mariadb.log"
    --max-connections=2000 --skip-name-resolve --innodb-buffer-pool-size=256M)
  already_up mariadb "$dir" "$dir/mariadb.pid" "${args[*]}" mariadb_ready && return 0
  ensure_port_free mariadb "$MARIADB_PORT"
  if [ ! -d "$dir/data/mysql" ]; then
    log "initialising MariaDB datadir"
    # --force skips its look-up of the host's name, which fails where `localhost` does
    # not resolve (a minimal Debian without /etc/hosts); the server resolves no names.
    mariadb-install-db --no-defaults --datadir="$dir/data" --user="$(id -un)" \
      --force --auth-root-authentication-method=socket >"$dir/install.log" 2>&1 \
      || { tail -n 20 "$dir/install.log" >&2; die "mariadb-install-db failed"; }
  fi
  nohup /usr/sbin/mariadbd "${args[@]}" >/dev/null 2>&1 &
  echo $! >"$dir/mariadb.pid"
  started "$dir" "${args[*]}"
  wait_for "mariadb" "$dir/mariadb.log" mariadb_client -e 'select 1'
  # The service's user may create the per-test databases flashsale_* as well.
  mariadb_client <<SQL
CREATE DATABASE IF NOT EXISTS \`$DB_NAME\`;
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
GRANT ALL PRIVILEGES ON \`flashsale%\`.* TO '$DB_USER'@'127.0.0.1';
GRANT ALL PRIVILEGES ON \`flashsale%\`.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
SQL
  wait_for "mariadb (tcp)" "$dir/mariadb.log" mariadb_ready
}

# --- ZooKeeper ---------------------------------------------------------------

zk_ready() {
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$ZK_PORT" || return 1
  printf 'srvr' >&3
  reply=$(timeout 2 cat <&3 || true)
  exec 3>&-
  grep -q 'Mode: standalone' <<<"$reply"
}

zookeeper_up() {
  local dir="$STACK/zookeeper"
  mkdir -p "$dir/data"
  local config
  config=$(cat <<CFG
tickTime=500
dataDir=$dir/data
clientPort=$ZK_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=0
minSessionTimeout=1000
maxSessionTimeout=60000
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr,cons
CFG
)
  local cp=/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar
  local args=(-Xmx256m -cp "$cp" -Dlog4j.configuration="file:$dir/log4j.properties"
    -Dzookeeper.log.dir="$dir" org.apache.zookeeper.server.ZooKeeperServerMain "$dir/zoo.cfg")
  already_up zookeeper "$dir" "$dir/zookeeper.pid" "${args[*]} $config" zk_ready && return 0
  ensure_port_free zookeeper "$ZK_PORT"
  printf '%s\n' "$config" >"$dir/zoo.cfg"
  cat >"$dir/log4j.properties" <<CFG
log4j.rootLogger=INFO, FILE
log4j.appender.FILE=org.apache.log4j.FileAppender
log4j.appender.FILE.File=$dir/zookeeper.log
log4j.appender.FILE.layout=org.apache.log4j.PatternLayout
log4j.appender.FILE.layout.ConversionPattern=%d{ISO8601} [%t] %-5p %c{1} - %m%n
CFG
  nohup java "${args[@]}" >"$dir/stdout.log" 2>&1 &
  echo $! >"$dir/zookeeper.pid"
  started "$dir" "${args[*]} $config"
  wait_for "zookeeper" "$dir/zookeeper.log" zk_ready
}

# --- etcd --------------------------------------------------------------------

etcd_ready() { ETCDCTL_API=3 etcdctl --endpoints="127.0.0.1:$ETCD_PORT" endpoint health; }

# Every lock acquisition writes and deletes a key of its own, and etcd keeps deleted
# keys in its index until the history is compacted: every read of a busy lock's queue
# walks them (0.2 ms to 1.2 ms per read seen here), so the etcd strategy slowed run
# after run (245 to 140-164 orders/s over six 5 s runs, 261 again after a compaction).
# The lock needs no history (its watches start now, its reads are at the current
# revision), so keep 5 s of it, compacted every 5 s. Revision-based retention is
# compacted only every 5 minutes whatever the retention.
etcd_up() {
  local dir="$STACK/etcd"
  mkdir -p "$dir"
  local args=(--name flashsale --data-dir "$dir/data"
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT"
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT"
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT"
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT"
    --initial-cluster "flashsale=http://127.0.0.1:$ETCD_PEER_PORT"
    --auto-compaction-mode periodic --auto-compaction-retention 5s)
  already_up etcd "$dir" "$dir/etcd.pid" "${args[*]}" etcd_ready && return 0
  ensure_port_free etcd "$ETCD_PORT"
  nohup etcd "${args[@]}" >"$dir/etcd.log" 2>&1 &
  echo $! >"$dir/etcd.pid"
  started "$dir" "${args[*]}"
  wait_for "etcd" "$dir/etcd.log" etcd_ready
}

# --- commands ----------------------------------------------------------------

stop_pidfile() {
  local name=$1 pidfile=$2 pid i
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if pid_alive "$pid"; then
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 60); do pid_alive "$pid" || break; sleep 0.25; done
    pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
    log "stopped $name (pid $pid)"
  fi
  rm -f "$pidfile"
}

cmd_up() {
  install_tools
  install_services
  mkdir -p "$STACK"
  redis_up "${REDIS_PORTS[0]}" "${HA_ARGS[@]}"
  for port in "${REDIS_PORTS[@]:1}"; do redis_up "$port"; done
  redis_up "$REDIS_REPLICA_PORT" "${HA_ARGS[@]}" --replicaof 127.0.0.1 "${REDIS_PORTS[0]}"
  sentinel_up
  redis_failback
  mariadb_up
  zookeeper_up
  etcd_up
  log "all services ready"
}

cmd_down() {
  stop_pidfile "sentinel:$SENTINEL_PORT" "$STACK/sentinel-$SENTINEL_PORT/sentinel.pid"
  stop_pidfile "redis:$REDIS_REPLICA_PORT" "$STACK/redis-$REDIS_REPLICA_PORT/redis.pid"
  for port in "${REDIS_PORTS[@]}"; do stop_pidfile "redis:$port" "$STACK/redis-$port/redis.pid"; done
  stop_pidfile mariadb "$STACK/mariadb/mariadb.pid"
  stop_pidfile zookeeper "$STACK/zookeeper/zookeeper.pid"
  stop_pidfile etcd "$STACK/etcd/etcd.pid"
}

# kill -9 one service and start it again: a backend restarted mid-sale, for the fault
# explorer (`loadtest explore --disruptive --restart-redis-cmd
# 'scripts/stack.sh restart redis'`). Redis comes back empty (no persistence): the sale
# needs a reconcile, as after a real one.
cmd_restart() {
  local pidfile port i
  # After a failover 6390 is a replica: fail back first, so the restart takes the
  # primary away, as it says.
  [ "${1:-}" = redis ] && redis_failback
  case "${1:-}" in
    redis) pidfile="$STACK/redis-${REDIS_PORTS[0]}/redis.pid" port=${REDIS_PORTS[0]} ;;
    mariadb) pidfile="$STACK/mariadb/mariadb.pid" port=$MARIADB_PORT ;;
    zookeeper) pidfile="$STACK/zookeeper/zookeeper.pid" port=$ZK_PORT ;;
    etcd) pidfile="$STACK/etcd/etcd.pid" port=$ETCD_PORT ;;
    *) echo "usage: $0 restart redis|mariadb|zookeeper|etcd" >&2; exit 2 ;;
  esac
  if [ -f "$pidfile" ] && pid_alive "$(cat "$pidfile")"; then
    kill -9 "$(cat "$pidfile")"
    log "killed $1 (pid $(cat "$pidfile"))"
    while pid_alive "$(cat "$pidfile")"; do sleep 0.05; done
    rm -f "$pidfile"
    # The dying process's listening socket can outlive it for a moment.
    for i in $(seq 1 100); do port_busy "$port" || break; sleep 0.1; done
  fi
  case "$1" in
    redis) redis_up "${REDIS_PORTS[0]}" "${HA_ARGS[@]}" ;;
    mariadb) mariadb_up ;;
    zookeeper) zookeeper_up ;;
    etcd) etcd_up ;;
  esac
}

# Sentinel fails the Redis pair over (6390 <-> 6393) and this waits until the new
# primary is named and the old one follows it: a failover mid-sale, for the fault
# explorer (`loadtest explore --disruptive --failover-redis-cmd 'scripts/stack.sh
# failover'`). Writes not yet replicated are lost, as in a real one.
cmd_failover() {
  local before i log="$STACK/sentinel-$SENTINEL_PORT/sentinel.log"
  wait_for "the Redis pair" "$log" pair_healthy
  before=$(sentinel_primary_port)
  sentinel_cli sentinel failover "$SENTINEL_MASTER" >/dev/null
  for i in $(seq 1 240); do
    [ "$(sentinel_primary_port)" != "$before" ] && break
    sleep 0.25
  done
  [ "$(sentinel_primary_port)" != "$before" ] || die "Sentinel did not fail over"
  log "Redis failed over: $before -> $(sentinel_primary_port)"
  # Sentinel turns the old primary, still up, into a replica only at its next look
  # (up to 10 s): until then it takes writes the new primary never sees. The
  # replicas leave it at once (they listen for Sentinel's announcement); waiting
  # here keeps the split brain inside the fault, not in whatever runs next.
  wait_for "the old primary $before following the new one" "$log" follows "$before"
}

# Whether the Redis on port $1 is a replica whose link to its primary is up.
follows() {
  redis-cli -p "$1" info replication 2>/dev/null | tr -d '\r' | grep -qx 'master_link_status:up'
}

status_line() {
  local name=$1 pidfile=$2; shift 2
  if pidfile_alive "$pidfile" && "$@" >/dev/null 2>&1; then
    printf '%-16s up    pid %s\n' "$name" "$(cat "$pidfile")"
  else
    printf '%-16s down\n' "$name"; return 1
  fi
}

cmd_status() {
  local rc=0
  for port in "${REDIS_PORTS[@]}"; do
    status_line "redis:$port" "$STACK/redis-$port/redis.pid" redis_ready "$port" || rc=1
  done
  status_line "redis:$REDIS_REPLICA_PORT" "$STACK/redis-$REDIS_REPLICA_PORT/redis.pid" \
    redis_ready "$REDIS_REPLICA_PORT" || rc=1
  status_line "sentinel:$SENTINEL_PORT" "$STACK/sentinel-$SENTINEL_PORT/sentinel.pid" \
    pair_healthy || rc=1
  status_line "mariadb:$MARIADB_PORT" "$STACK/mariadb/mariadb.pid" mariadb_ready || rc=1
  status_line "zookeeper:$ZK_PORT" "$STACK/zookeeper/zookeeper.pid" zk_ready || rc=1
  status_line "etcd:$ETCD_PORT" "$STACK/etcd/etcd.pid" etcd_ready || rc=1
  return $rc
}

cmd_env() {
  cat <<ENV
export FLASHSALE_REDIS_URL=redis://127.0.0.1:${REDIS_PORTS[0]}
export FLASHSALE_REDIS_SENTINEL=127.0.0.1:$SENTINEL_PORT
export FLASHSALE_REDIS_SENTINEL_MASTER=$SENTINEL_MASTER
export FLASHSALE_REDLOCK_URLS=redis://127.0.0.1:${REDIS_PORTS[0]},redis://127.0.0.1:${REDIS_PORTS[1]},redis://127.0.0.1:${REDIS_PORTS[2]}
export FLASHSALE_DATABASE_URL=mysql://$DB_USER:$DB_PASSWORD@127.0.0.1:$MARIADB_PORT/$DB_NAME
export FLASHSALE_ZOOKEEPER=127.0.0.1:$ZK_PORT
export FLASHSALE_ETCD=http://127.0.0.1:$ETCD_PORT
ENV
}

case "${1:-}" in
  up) cmd_up ;;
  tools) install_tools ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  restart) cmd_restart "${2:-}" ;;
  failover) cmd_failover ;;
  *) echo "usage: $0 up|tools|down|status|env|restart SERVICE|failover" >&2; exit 2 ;;
esac
