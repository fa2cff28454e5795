"""Turns scripts/bench.sh's order runs (JSON lines from `measure_costs`) into
BENCHMARKS.md's tables, each cell the median over the repeats:

  orders_table.py ratios RUNS   orders/s (from MySQL) and its ratio to `none` with one
                                connection measured in the same repeat, min-max too,
                                against the goals
  orders_table.py time RUNS     where a lock strategy's time per order goes: the
                                steps of its critical section, the handoff, and what
                                the goal leaves the lock
  orders_table.py cpu RUNS N S  CPU time per order by process over runs of S seconds,
                                and the most orders/s N cores could give at that cost
"""
import json
import os
import statistics
import sys

GOALS = {
    "redis-lock": 0.8, "optimistic": 0.8, "db-for-update": 1.0, "db-unique": 0.6,
    "zookeeper": 0.5, "etcd": 0.5, "redlock": 0.4, "redis-atomic": 4.0,
}
STEPS = ["read", "check", "commit", "cache_write", "release"]
GROUPS = ["replicas", "redis", "mariadb", "zookeeper", "etcd"]
BASE = "none, 1 connection (the base)"


def spread(values, digits):
    if not values:
        return "—"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def median(values, digits):
    return f"{statistics.median(values):.{digits}f}" if values else "—"


def load(path):
    runs = []
    for line in open(path):
        if line.strip():
            run = json.loads(line)
            run.update(run.pop("measured"))
            runs.append(run)
    return runs


def names(runs):
    order = []
    for run in runs:
        if run["strategy"] != "baseline" and run["strategy"] not in order:
            order.append(run["strategy"])
    return order


def base_rates(runs):
    return {r["repeat"]: r["orders_per_s"] for r in runs if r["strategy"] == "baseline"}


def ratios(runs):
    baseline = base_rates(runs)
    print("| strategy | orders/s | ÷ none, 1 connection | goal | non-2xx answers/s |")
    print("|---|---|---|---|---|")
    print(f"| {BASE} | {spread(list(baseline.values()), 0)} | 1.00 | — | — |")
    for name in names(runs):
        mine = [r for r in runs if r["strategy"] == name]
        rates = [r["orders_per_s"] for r in mine]
        shares = [r["orders_per_s"] / baseline[r["repeat"]] for r in mine if baseline.get(r["repeat"])]
        refused = [r["non_2xx_per_s"] for r in mine]
        goal = f"≥ {GOALS[name]:.1f}" if name in GOALS else "—"
        print(f"| {name} | {spread(rates, 0)} | {spread(shares, 2)} | {goal} | {spread(refused, 0)} |")


def steps_ms(run, strategy):
    """Mean milliseconds of each step over the run; None where the run has no such step."""
    means = {}
    for step in STEPS:
        key = f"{strategy}/{step}"
        before = run["before"]["steps"].get(key, [0.0, 0.0])
        after = run["after"]["steps"].get(key, [0.0, 0.0])
        count = after[1] - before[1]
        means[step] = 1000 * (after[0] - before[0]) / count if count > 0 else None
    return means


def time(runs):
    baseline = base_rates(runs)
    columns = ["ms per order", "read", "last check", "commit", "cache write", "release",
               "handoff", "the lock's part", "ms per order at the goal", "the lock's part at the goal"]
    print("| strategy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in ["baseline"] + names(runs):
        cells = {column: [] for column in columns}
        for run in (r for r in runs if r["strategy"] == name):
            means = steps_ms(run, "none" if name == "baseline" else name)
            if means["commit"] is None or run["orders_per_s"] <= 0:
                continue
            locked = means["check"] is not None and means["release"] is not None
            if name != "baseline" and not locked:
                continue
            cycle = 1000 / run["orders_per_s"]
            spent = sum(v for v in means.values() if v is not None)
            store = means["read"] + means["commit"] + means["cache_write"]
            cells["ms per order"].append(cycle)
            for column, step in zip(columns[1:6], STEPS):
                if means[step] is not None:
                    cells[column].append(means[step])
            if locked:
                cells["handoff"].append(cycle - spent)
                cells["the lock's part"].append(cycle - store)
                if name in GOALS and baseline.get(run["repeat"]):
                    goal_cycle = 1000 / (GOALS[name] * baseline[run["repeat"]])
                    cells["ms per order at the goal"].append(goal_cycle)
                    cells["the lock's part at the goal"].append(goal_cycle - store)
        if not cells["ms per order"]:
            continue
        label = BASE if name == "baseline" else name
        print(f"| {label} | " + " | ".join(median(cells[c], 2) for c in columns) + " |")


def cpu(runs, cores, seconds):
    hz = os.sysconf("SC_CLK_TCK")
    baseline = base_rates(runs)
    rows = {}
    for run in runs:
        before, after = run["before"], run["after"]
        busy = after["busy"] - before["busy"]
        # The orders MySQL counted during the run.
        orders = max(run["orders_per_s"] * seconds, 1)
        spent = dict.fromkeys(GROUPS, 0)
        for process, ticks in after["processes"].items():
            if process in before["processes"]:
                group = process.split("/")[0]
                spent[group] = spent.get(group, 0) + ticks - before["processes"][process]
        per_order = {g: spent[g] / hz * 1000 / orders for g in GROUPS}
        per_order["rest"] = (busy - sum(spent.values())) / hz * 1000 / orders
        per_order["total"] = busy / hz * 1000 / orders
        per_order["orders/s"] = run["orders_per_s"]
        per_order["busy %"] = 100 * busy / max(after["total"] - before["total"], 1)
        # All cores busy with nothing but these orders, at this cost each.
        per_order["at most"] = cores * 1000 / max(per_order["total"], 1e-9)
        if baseline.get(run["repeat"]):
            per_order["÷ base"] = per_order["at most"] / baseline[run["repeat"]]
        rows.setdefault(run["strategy"], []).append(per_order)
    columns = ["orders/s", "busy %"] + GROUPS + ["rest", "total", "at most", "÷ base"]
    print("| strategy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for strategy, measured in rows.items():
        cells = []
        for column in columns:
            values = [run[column] for run in measured if column in run]
            digits = 0 if column in ("orders/s", "busy %", "at most") else 2
            cells.append(median(values, digits))
        label = BASE if strategy == "baseline" else strategy
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    runs = load(path)
    if mode == "ratios":
        ratios(runs)
    elif mode == "time":
        time(runs)
    elif mode == "cpu":
        cpu(runs, int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit(f"unknown table {mode!r}; see the module's docstring")
