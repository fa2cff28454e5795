"""The locks people use instead of ours, measured the way `lockbench` measures ours.

A goal such as "redis-lock at least 1.5x python-redis-lock" only means something if
both are measured on the same machine in the same run, so `scripts/bench.sh` runs
this beside `lockbench`: the same shape (separate contender processes, one lock name,
an empty critical section, a window every contender shares), the same report (one
JSON line that `lockbench --table` reads), violations counted in shared memory
independently of the lock under test.

    peers.py run LIB --contenders N --seconds S [--lease-ms MS] [--zk-session-ms MS]
        LIB: python-redis-lock | redis-py-lock | kazoo | python-etcd3
        backends from FLASHSALE_REDIS_URL, FLASHSALE_ZOOKEEPER, FLASHSALE_ETCD
    peers.py goals REPORTS.jsonl
        the issue's goals as a markdown table, from lockbench's and this script's lines

Runs in the virtualenv `scripts/bench.sh` makes (the libraries are not needed for
`goals`).
"""

import argparse
import json
import math
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time
import urllib.parse
import uuid

LIBS = ("python-redis-lock", "redis-py-lock", "kazoo", "python-etcd3")
# The same backends and defaults as lockbench (`src/bench/locks.rs`).
BACKENDS = {
    "FLASHSALE_REDIS_URL": "redis://127.0.0.1:6390",
    "FLASHSALE_ZOOKEEPER": "127.0.0.1:2190",
    "FLASHSALE_ETCD": "http://127.0.0.1:2390",
}
# How long contenders may take to connect and warm up, and to hand their holds back.
READY_TIMEOUT_S = 30
# redis-py's Lock polls; 1 ms is the tightest interval people configure.
REDIS_PY_POLL_S = 0.001


def backend(variable):
    return os.environ.get(variable) or BACKENDS[variable]


def make_lock(lib, name, lease_s, zk_session_s):
    """A fresh client of `lib` and a function returning its lock object for `name`.
    Leases the libraries take in whole seconds are rounded up, never to 0."""
    whole_seconds = max(1, int(-(-lease_s // 1)))
    if lib in ("python-redis-lock", "redis-py-lock"):
        import redis

        client = redis.Redis.from_url(backend("FLASHSALE_REDIS_URL"))
        if lib == "python-redis-lock":
            import redis_lock

            return lambda n: redis_lock.Lock(client, n, expire=whole_seconds)
        return lambda n: client.lock(n, timeout=lease_s, sleep=REDIS_PY_POLL_S)
    if lib == "kazoo":
        from kazoo.client import KazooClient

        client = KazooClient(hosts=backend("FLASHSALE_ZOOKEEPER"), timeout=zk_session_s)
        client.start(timeout=READY_TIMEOUT_S)
        return lambda n: client.Lock(f"/lockbench-peers/{n}")
    if lib == "python-etcd3":
        import etcd3

        url = urllib.parse.urlparse(backend("FLASHSALE_ETCD").split(",")[0])
        client = etcd3.client(host=url.hostname, port=url.port or 2379)
        return lambda n: client.lock(n, ttl=whole_seconds)
    raise ValueError(f"unknown library {lib}")


def acquire(lib, lock, wait_s, lease_s):
    """One attempt bounded by `wait_s`; True if held. Each library spells it its way."""
    if lib == "python-redis-lock":
        # It takes whole seconds (0 would mean no limit) and no more than its lease.
        whole = max(1, math.ceil(wait_s))
        return lock.acquire(blocking=True, timeout=min(whole, max(1, math.ceil(lease_s))))
    if lib == "redis-py-lock":
        return lock.acquire(blocking=True, blocking_timeout=wait_s)
    if lib == "kazoo":
        from kazoo.exceptions import LockTimeout

        try:
            return lock.acquire(timeout=wait_s)
        except LockTimeout:  # its way of saying the wait ran out
            return False
    return lock.acquire(timeout=wait_s)


def contender(lib, who, name, lease_s, zk_session_s, board, barriers, out):
    """One process: warm up on a lock of its own, wait for the window, then loop."""
    holders, violations, window = board
    ready, go = barriers
    errors = 0
    try:
        lock_for = make_lock(lib, name, lease_s, zk_session_s)
        warm = lock_for(f"{name}-warm-{who}")
        if not acquire(lib, warm, READY_TIMEOUT_S, lease_s):
            raise RuntimeError("could not take its own warm-up lock")
        warm.release()
    except Exception as error:  # reported by the parent, which then fails the run
        out.put((who, 0, [], 1, f"warming up: {error!r}"))
        ready.abort()
        return
    try:
        ready.wait(READY_TIMEOUT_S)
        go.wait(READY_TIMEOUT_S)  # the parent writes the window in between
    except threading.BrokenBarrierError:
        out.put((who, 0, [], 1, "another contender failed to warm up"))
        return
    start, end = window[0], window[1]
    time.sleep(max(0, start - time.monotonic_ns()) / 1e9)
    lock = lock_for(name)
    holds, cycles, first_error = [], 0, None
    while True:
        now = time.monotonic_ns()
        if now >= end:
            break
        try:
            if not acquire(lib, lock, (end - now) / 1e9, lease_s):
                continue
        except Exception as error:
            errors += 1
            first_error = first_error or repr(error)
            time.sleep(0.01)  # a failing backend must not turn the loop into a spin
            continue
        with holders.get_lock():
            holders.value += 1
            inside = holders.value
        acquired_ns = time.monotonic_ns()
        if inside > 1:
            with violations.get_lock():
                violations.value += 1
        released_ns = time.monotonic_ns()
        with holders.get_lock():
            holders.value -= 1
        try:
            lock.release()
        except Exception as error:
            errors += 1
            first_error = first_error or repr(error)
        if lib == "kazoo":
            # A fresh Lock per acquisition: a reused one first looks for a node it may
            # have left behind (one get_children more per acquisition).
            lock = lock_for(name)
        if acquired_ns < end:
            cycles += 1
            holds.append((acquired_ns, released_ns, who))
    out.put((who, cycles, holds, errors, first_error))


def quantile(sorted_values, q):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run(args):
    ctx = multiprocessing.get_context("fork")
    board = (ctx.Value("i", 0), ctx.Value("i", 0), ctx.RawArray("q", 2))
    # Like lockbench: the window is set only once every contender has connected and
    # warmed up, so no library's start-up time comes out of its window.
    barriers = (ctx.Barrier(args.contenders + 1), ctx.Barrier(args.contenders + 1))
    out = ctx.Queue()
    name = f"lockbench-peers-{uuid.uuid4().hex[:12]}"
    lease_s, zk_session_s = args.lease_ms / 1000, args.zk_session_ms / 1000
    processes = [
        ctx.Process(
            target=contender,
            args=(args.lib, who, name, lease_s, zk_session_s, board, barriers, out),
            daemon=True,
        )
        for who in range(args.contenders)
    ]
    for process in processes:
        process.start()
    try:
        barriers[0].wait(READY_TIMEOUT_S)
        start = time.monotonic_ns() + 100_000_000
        board[2][0], board[2][1] = start, start + int(args.seconds * 1e9)
        barriers[1].wait(READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        barriers[1].abort()
    try:
        reports = [out.get(timeout=args.seconds + READY_TIMEOUT_S) for _ in processes]
    except queue.Empty:  # a contender died without reporting
        reports = None
    for process in processes:
        process.join(READY_TIMEOUT_S)
        if process.is_alive():
            process.terminate()
    if reports is None:
        print(f"{args.lib}: a contender ended without reporting", file=sys.stderr)
        print(json.dumps({"lock": args.lib, "failed": True}))
        return 1
    reports.sort()
    first_errors = sorted({r[4] for r in reports if r[4]})
    if first_errors:
        print(f"{args.lib}: errors, the first of each kind: {first_errors[:3]}", file=sys.stderr)
    failed = [r[4] for r in reports if r[4] and r[1] == 0]
    if len(failed) == len(reports):
        print(f"{args.lib}: {failed[0]}", file=sys.stderr)
        print(json.dumps({"lock": args.lib, "failed": True}))
        return 1
    holds = sorted(h for r in reports for h in r[2])
    gaps = sorted(
        nxt[0] - prev[1]
        for prev, nxt in zip(holds, holds[1:])
        if prev[2] != nxt[2] and nxt[0] >= prev[1]
    )
    cycles = sum(r[1] for r in reports)
    ms = lambda ns: None if ns is None else max(ns, 1) / 1e6  # noqa: E731
    print(
        json.dumps(
            {
                "lock": args.lib,
                "contenders": args.contenders,
                "seconds": args.seconds,
                "cycles": cycles,
                "cycles_per_s": cycles / args.seconds,
                "per_contender": [r[1] for r in reports],
                "handoff_ms": {"p50": ms(quantile(gaps, 0.5)), "p99": ms(quantile(gaps, 0.99))},
                "violations": board[1].value,
                "handoffs": len(gaps),
                "errors": sum(r[3] for r in reports),
            }
        )
    )
    return 0


# (ours, theirs, how many times theirs our cycles/s must be at least)
THROUGHPUT_GOALS = (
    ("redis-lock", "python-redis-lock", 1.5),
    ("zookeeper", "kazoo", 2.0),
    ("etcd", "python-etcd3", 2.0),
)
HANDOFF_GOAL = ("redis-lock", 0.25)  # handoff p50 at most this many ms
FAIRNESS_GOAL = 2.0  # the busiest contender's cycles over the idlest's


def goals(args):
    # Every lock's reports in run order, None for a failed run, so that run k of ours
    # pairs with run k of theirs (bench.sh runs them one after the other).
    attempts = {}
    with open(args.reports) as lines:
        for line in lines:
            if line.strip():
                report = json.loads(line)
                attempts.setdefault(report["lock"], []).append(
                    None if report.get("failed") else report
                )
    runs = {lock: [r for r in rs if r] for lock, rs in attempts.items()}
    median = lambda lock, figure: (  # noqa: E731
        statistics.median(figure(r) for r in runs[lock]) if runs.get(lock) else None
    )
    rows = [
        "| goal | ours | theirs | ours ÷ theirs: median (min–max) of the rounds | met |",
        "|---|---|---|---|---|",
    ]
    for ours, theirs, times in THROUGHPUT_GOALS:
        a, b = (median(lock, lambda r: r["cycles_per_s"]) for lock in (ours, theirs))
        if a is None or b is None:
            rows.append(f"| {ours} ≥ {times}× {theirs} (cycles/s) | – | – | not measured | – |")
            continue
        # Round k of ours over round k of theirs: the same spell of the machine.
        paired = [
            x["cycles_per_s"] / y["cycles_per_s"]
            for x, y in zip(attempts[ours], attempts[theirs])
            if x and y and y["cycles_per_s"] > 0
        ]
        ratio = statistics.median(paired) if paired else a / b
        spread = f" ({min(paired):.2f}–{max(paired):.2f})" if paired else ""
        rows.append(
            f"| {ours} ≥ {times}× {theirs} (cycles/s) | {a:.0f} | {b:.0f} | "
            f"{ratio:.2f}{spread} | {'yes' if ratio >= times else '**no**'} |"
        )
    lock, limit = HANDOFF_GOAL
    # A run without a single handoff (one contender kept the lock) has no p50: it fails.
    p50 = median(lock, lambda r: r["handoff_ms"]["p50"] or float("inf"))
    if p50 is not None:
        rows.append(
            f"| {lock} handoff p50 ≤ {limit} ms | {p50:.3f} ms | – | – | "
            f"{'yes' if p50 <= limit else '**no**'} |"
        )
    # Fairness and violations are goals for our locks; the peers' show in the table.
    ours_only = {lock: rs for lock, rs in runs.items() if lock != "none" and lock not in LIBS}
    unfair = []
    for lock, reports in ours_only.items():
        spread = statistics.median(
            max(r["per_contender"]) / min(r["per_contender"])
            if min(r["per_contender"]) > 0
            else float("inf")
            for r in reports
        )
        if spread > FAIRNESS_GOAL:
            unfair.append(f"{lock} {spread:.2f}")
    rows.append(
        f"| every contender within {FAIRNESS_GOAL:.0f}× of the others (median max/min) | "
        f"{', '.join(unfair) or 'all'} | – | – | {'**no**' if unfair else 'yes'} |"
    )
    violations = sum(r["violations"] for rs in ours_only.values() for r in rs)
    rows.append(
        f"| no violation (our locks; `none` is the control) | {violations} | – | – | "
        f"{'yes' if violations == 0 else '**no**'} |"
    )
    print("\n".join(rows))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="measure one library, print one JSON line")
    one.add_argument("lib", choices=LIBS)
    one.add_argument("--contenders", type=int, default=8)
    one.add_argument("--seconds", type=float, default=3.0)
    one.add_argument("--lease-ms", type=int, default=10000)
    one.add_argument("--zk-session-ms", type=int, default=4000)
    table = commands.add_parser("goals", help="the goals table from collected lines")
    table.add_argument("reports")
    args = parser.parse_args()
    if args.command == "run" and (args.contenders < 1 or args.seconds <= 0):
        parser.error("--contenders and --seconds must be above 0")
    return run(args) if args.command == "run" else goals(args)


if __name__ == "__main__":
    sys.exit(main())
