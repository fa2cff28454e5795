# Sourced by scripts/bench/cost.sh: backing services of the benchmark's own, on other
# ports than scripts/stack.sh's, in a scratch folder, for counting what an order costs
# them. The stack's services are shared (tests, demos, other benchmarks use them at the
# same time) and their counters are whole-server counters: measured there, a sale of
# 200 orders drowned in a few thousand requests of someone else's.
#
#   services_up DIR     start Redis x3, MariaDB, ZooKeeper and etcd under DIR; sets
#                       FLASHSALE_* to them (exported) and SERVICE_PIDS
#   services_down       stop them (by the PIDs started here)

SERVICE_REDIS_PORTS=(6490 6491 6492)
SERVICE_MARIADB_PORT=3490
SERVICE_ZK_PORT=2290
SERVICE_ETCD_PORT=2490
SERVICE_PIDS=()

# service_wait NAME COMMAND...: poll up to 60 s.
service_wait() {
  local name=$1 i
  shift
  for i in $(seq 1 240); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.25
  done
  die "the benchmark's $name did not start"
}

service_port_free() {
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
    die "port $1 is taken; the benchmark's own services need it"
  fi
}

zk_srvr() {
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$SERVICE_ZK_PORT" || return 1
  printf 'srvr' >&3
  reply=$(timeout 2 cat <&3 || true)
  exec 3>&-
  grep -q 'Mode: standalone' <<<"$reply"
}

services_up() {
  local dir=$1 port
  mkdir -p "$dir"
  for port in "${SERVICE_REDIS_PORTS[@]}" "$SERVICE_MARIADB_PORT" "$SERVICE_ZK_PORT" \
    "$SERVICE_ETCD_PORT" $((SERVICE_ETCD_PORT + 1)); do
    service_port_free "$port"
  done
  for port in "${SERVICE_REDIS_PORTS[@]}"; do
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
      --logfile "$dir/redis-$port.log" >/dev/null 2>&1 &
    SERVICE_PIDS+=($!)
    service_wait "redis:$port" redis-cli -p "$port" ping
  done

  # --force: no look-up of the host's name, as in stack.sh.
  mariadb-install-db --no-defaults --datadir="$dir/mariadb" --user="$(id -un)" --force \
    --auth-root-authentication-method=normal >"$dir/mariadb-install.log" 2>&1 ||
    die "mariadb-install-db failed (see $dir/mariadb-install.log)"
  /usr/sbin/mariadbd --no-defaults --datadir="$dir/mariadb" --user="$(id -un)" \
    --bind-address=127.0.0.1 --port="$SERVICE_MARIADB_PORT" --socket="$dir/mariadb.sock" \
    --log-error="$dir/mariadb.log" --max-connections=500 --skip-name-resolve \
    >/dev/null 2>&1 &
  SERVICE_PIDS+=($!)
  service_wait mariadb mariadb --no-defaults -h127.0.0.1 -P"$SERVICE_MARIADB_PORT" -uroot -e 'select 1'
  mariadb --no-defaults -h127.0.0.1 -P"$SERVICE_MARIADB_PORT" -uroot -e "
    CREATE DATABASE flashsale;
    CREATE USER 'flashsale'@'127.0.0.1' IDENTIFIED BY 'flashsale';
    GRANT ALL PRIVILEGES ON \`flashsale%\`.* TO 'flashsale'@'127.0.0.1';"

  cat >"$dir/zoo.cfg" <<CFG
tickTime=500
dataDir=$dir/zookeeper
clientPort=$SERVICE_ZK_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=0
minSessionTimeout=1000
maxSessionTimeout=60000
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,mntr
CFG
  java -Xmx256m -cp /usr/share/java/zookeeper.jar:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar \
    -Dzookeeper.log.dir="$dir" org.apache.zookeeper.server.ZooKeeperServerMain "$dir/zoo.cfg" \
    >"$dir/zookeeper.log" 2>&1 &
  SERVICE_PIDS+=($!)
  service_wait zookeeper zk_srvr

  local peer="http://127.0.0.1:$((SERVICE_ETCD_PORT + 1))"
  etcd --name bench --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$SERVICE_ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$SERVICE_ETCD_PORT" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "bench=$peer" \
    --auto-compaction-mode periodic --auto-compaction-retention 5s >"$dir/etcd.log" 2>&1 &
  SERVICE_PIDS+=($!)
  service_wait etcd env ETCDCTL_API=3 etcdctl --endpoints="127.0.0.1:$SERVICE_ETCD_PORT" endpoint health

  export FLASHSALE_REDIS_URL=redis://127.0.0.1:${SERVICE_REDIS_PORTS[0]}
  export FLASHSALE_REDLOCK_URLS=redis://127.0.0.1:${SERVICE_REDIS_PORTS[0]},redis://127.0.0.1:${SERVICE_REDIS_PORTS[1]},redis://127.0.0.1:${SERVICE_REDIS_PORTS[2]}
  export FLASHSALE_DATABASE_URL=mysql://flashsale:flashsale@127.0.0.1:$SERVICE_MARIADB_PORT/flashsale
  export FLASHSALE_ZOOKEEPER=127.0.0.1:$SERVICE_ZK_PORT
  export FLASHSALE_ETCD=http://127.0.0.1:$SERVICE_ETCD_PORT
}

services_down() {
  local pid
  for pid in "${SERVICE_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${SERVICE_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  SERVICE_PIDS=()
}
