"""What an order costs the backing services, and how long a lock stays taken after its
holder is killed: the helpers of scripts/bench/cost.sh.

  cost.py roundtrips LABEL SKU ORDERS CONCURRENCY DATABASE_URL PORT...
      one JSON line: the servers' own request counters over an idle window and over a
      sale of ORDERS orders (one unit each, CONCURRENCY at a time, spread over the
      PORTs) of the same length, and the orders MySQL holds for SKU before and after
  cost.py roundtrips-table RUNS
      the round trips per order per backend (sale less idle, over the orders sold)
  cost.py recovery-table RUNS
      milliseconds from the kill to the next order sold: median (min-max) per lock

The servers are the stack's (FLASHSALE_* variables, as `scripts/stack.sh env` prints):
Redis, every node of FLASHSALE_REDLOCK_URLS (INFO commandstats calls, the harness's own
INFO left out), MariaDB (`Questions`), ZooKeeper (`mntr`'s zk_packets_received) and
etcd (/metrics, grpc_server_msg_received_total: unary calls and each message on a
stream, such as a lease keep-alive). The counters are the whole server's: whatever else
uses the stack meanwhile is counted too, which the idle window estimates.
"""
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

BACKENDS = ["redis", "mysql", "zookeeper", "etcd"]
# After the last answer, work a replica does once it has answered (a release, the
# cache write of an order already answered) still belongs to the sale.
SETTLE_S = 0.5


def redis_calls(url):
    u = urllib.parse.urlparse(url)
    with socket.create_connection((u.hostname, u.port or 6379), timeout=5) as s:
        s.sendall(b"INFO commandstats\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            # A bulk reply: $LEN\r\n then LEN bytes and \r\n.
            header, _, body = data.partition(b"\r\n")
            if header.startswith(b"$") and len(body) >= int(header[1:]) + 2:
                break
    calls = 0
    for line in data.decode().splitlines():
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info:"):
            calls += int(line.split("calls=")[1].split(",")[0])
    return calls


def mysql(url, query):
    u = urllib.parse.urlparse(url)
    out = subprocess.run(
        ["mariadb", "--no-defaults", "-N", "-B", "-h", u.hostname, "-P", str(u.port or 3306),
         "-u", u.username, f"-p{u.password}", u.path.lstrip("/"), "-e", query],
        check=True, capture_output=True, text=True, timeout=30).stdout
    return out.split()[-1]


def zookeeper_packets(address):
    host, port = address.split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"mntr")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    for line in data.decode().splitlines():
        if line.startswith("zk_packets_received"):
            return int(line.split()[1])
    raise SystemExit("ZooKeeper's mntr has no zk_packets_received (is mntr whitelisted?)")


def etcd_messages(url):
    with urllib.request.urlopen(url.split(",")[0].rstrip("/") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("grpc_server_msg_received_total")))


def counters():
    env = os.environ
    return {
        "redis": sum(redis_calls(url) for url in env["FLASHSALE_REDLOCK_URLS"].split(",")),
        "mysql": int(mysql(env["FLASHSALE_DATABASE_URL"], "SHOW GLOBAL STATUS LIKE 'Questions'")),
        "zookeeper": zookeeper_packets(env["FLASHSALE_ZOOKEEPER"]),
        "etcd": etcd_messages(env["FLASHSALE_ETCD"]),
    }


def delta(before, after):
    return {k: after[k] - before[k] for k in BACKENDS}


def order(port, sku, user):
    body = json.dumps({"sku": sku, "user_id": user, "quantity": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/orders", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return "error"


def roundtrips(label, sku, orders, concurrency, database, ports):
    orders, concurrency = int(orders), int(concurrency)
    count = f"SELECT COUNT(*) FROM orders WHERE sku = '{sku}'"
    sold_before = int(mysql(database, count))
    # The sale first, so its length sets the idle window's.
    before = counters()
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(
            lambda i: order(ports[i % len(ports)], sku, f"rt-{label}-{started}-{i}"),
            range(orders)))
    time.sleep(SETTLE_S)
    window = time.monotonic() - started
    sale = delta(before, counters())
    before = counters()
    time.sleep(window)
    idle = delta(before, counters())
    sold = int(mysql(database, count)) - sold_before
    statuses = {str(s): answers.count(s) for s in set(answers)}
    print(json.dumps({"strategy": label, "sale": sale, "idle": idle, "sold": sold,
                      "answers": statuses, "seconds": window}))


def spread(values, digits):
    if not values:
        return "—"
    fmt = f"{{:.{digits}f}}"
    # Rounded first, and + 0.0, so a count that cancels out prints 0.0, not -0.0.
    values = [round(v, digits) + 0.0 for v in values]
    med = fmt.format(statistics.median(values))
    if len(values) == 1 or fmt.format(min(values)) == fmt.format(max(values)):
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def load(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def roundtrips_table(path):
    runs = load(path)
    names = list(dict.fromkeys(r["strategy"] for r in runs))
    print("| strategy | " + " | ".join(BACKENDS) + " | total | idle per order | orders sold | other answers |")
    print("|---" * (len(BACKENDS) + 5) + "|")
    for name in names:
        mine = [r for r in runs if r["strategy"] == name and r["sold"] > 0]
        per = {k: [(r["sale"][k] - r["idle"][k]) / r["sold"] for r in mine] for k in BACKENDS}
        totals = [sum(per[k][i] for k in BACKENDS) for i in range(len(mine))]
        idle = [sum(r["idle"].values()) / r["sold"] for r in mine]
        sold = [r["sold"] for r in mine]
        refused = [sum(n for s, n in r["answers"].items() if s != "201") for r in mine]
        cells = [spread(per[k], 1) for k in BACKENDS]
        cells += [spread(totals, 1), spread(idle, 1), spread(sold, 0), spread(refused, 0)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def recovery_table(path):
    runs = load(path)
    print("| strategy | recovery ms | runs | failed runs |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == name]
        times = [r["ms"] for r in mine if r.get("ms") is not None]
        print(f"| {name} | {spread(times, 0)} | {len(times)} | {len(mine) - len(times)} |")


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "roundtrips":
        roundtrips(*args[:5], [int(p) for p in args[5:]])
    elif mode == "roundtrips-table":
        roundtrips_table(args[0])
    elif mode == "recovery-table":
        recovery_table(args[0])
    else:
        sys.exit(f"unknown mode {mode!r}; see the module's docstring")
