"""Turns scripts/bench.sh's order runs (JSON lines from `measure_costs`) into
BENCHMARKS.md's tables: the ratios as the median of the repeats (min-max), the time
and CPU per order pooled over the repeats (all their seconds over all their orders),
so that a row adds up:

  orders_table.py ratios RUNS   orders/s (from MySQL) and its ratio to `none` with one
                                connection measured in the same repeat, min-max too,
                                against the goals
  orders_table.py time RUNS     where a lock strategy's time per order goes: the
                                steps of its critical section, the time between
                                them (mostly the handoff), and what the goal leaves
                                the lock
  orders_table.py cpu RUNS N S [BASE]
                                CPU time per order by process over runs of S seconds,
                                and the most orders/s N cores could give at that cost,
                                as a ratio to BASE's orders/s in the same repeat (the
                                strategy measured as the base; default the one-
                                connection `none` of the per-order table)
  orders_table.py latency RUNS  the open model at a share of each strategy's capacity
                                (scripts/bench/latency.sh): rates, p50/p99/p99.9
                                against the goal, the cores' use
  orders_table.py skus RUNS     orders/s on many SKUs and the ratio to `none` on the
                                same SKUs in the same repeat

"""
import json
import os
import statistics
import sys

GOALS = {
    "redis-lock": 0.8, "optimistic": 0.8, "db-for-update": 1.0, "db-unique": 0.6,
    "zookeeper": 0.5, "etcd": 0.5, "redlock": 0.4, "redis-atomic": 5.5,
    # Issue 42: a lock with combining against the bare critical section.
    **{f"{lock} combined": 3.0
       for lock in ["redis-lock", "db-unique", "zookeeper", "etcd", "redlock"]},
}
STEPS = ["read", "check", "commit", "cache_write", "release"]
GROUPS = ["replicas", "redis", "mariadb", "zookeeper", "etcd"]
BASE = "none, 1 connection (the base)"
# The open model's goal (issue 42), every strategy alike.
GOAL_P99_MS = 25
# On many SKUs (issue 42): every strategy against `none` with the same connections.
GOAL_SKUS = 0.8


def spread(values, digits):
    if not values:
        return "—"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


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


def base_rates(runs, base="baseline"):
    return {r["repeat"]: r["orders_per_s"] for r in runs if r["strategy"] == base}


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


def step_totals(run, strategy):
    """Seconds and count of each step over the run, summed over the replicas; None if the
    run's two snapshots do not compare (a replica answered only one of them, or its
    counters went back: it restarted)."""
    before, after = run["before"]["steps"], run["after"]["steps"]
    if set(before) != set(after):
        return None
    totals = {}
    for step in STEPS:
        key = f"{strategy}/{step}"
        spent = count = 0.0
        for port in after:
            was, now = before[port].get(key, [0.0, 0.0]), after[port].get(key, [0.0, 0.0])
            if now[0] < was[0] or now[1] < was[1]:
                return None
            spent, count = spent + now[0] - was[0], count + now[1] - was[1]
        totals[step] = (spent, count)
    return totals


def time(runs):
    """Pooled over the repeats (every second of every run, every order), so that a
    row adds up; ms per order also gives the runs' min-max."""
    baseline = base_rates(runs)
    base = statistics.mean(baseline.values()) if baseline else None
    columns = ["ms per order", "read", "last check", "commit", "cache write", "release",
               "between steps", "the lock's part", "ms per order at the goal",
               "the lock's part at the goal", "runs"]
    print("| strategy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in ["baseline"] + names(runs):
        # The base is `none` in the replicas' step histograms.
        # "redis-lock classic" is redis-lock with the cohort layer off: the same metrics.
        strategy = "none" if name == "baseline" else name.split(" ")[0]
        measured = [r for r in runs if r["strategy"] == name and r["orders_per_s"] > 0]
        pooled = dict.fromkeys(STEPS, (0.0, 0.0))
        counted = []
        for run in measured:
            totals = step_totals(run, strategy)
            if totals is None or totals["commit"][1] == 0:
                continue
            counted.append(run)
            for step in STEPS:
                pooled[step] = tuple(a + b for a, b in zip(pooled[step], totals[step]))
        if not counted:
            continue
        means = {step: 1000 * spent / count if count else None
                 for step, (spent, count) in pooled.items()}
        locked = means["check"] is not None and means["release"] is not None
        if name != "baseline" and not locked:
            continue
        cycles = [1000 / r["orders_per_s"] for r in counted]
        cycle = 1000 * len(counted) / sum(r["orders_per_s"] for r in counted)
        cells = [f"{cycle:.2f} ({min(cycles):.2f}–{max(cycles):.2f})" if len(cycles) > 1
                 else f"{cycle:.2f}"]
        cells += [f"{means[step]:.2f}" if means[step] is not None else "—" for step in STEPS]
        store = means["read"] + means["commit"] + means["cache_write"]
        if locked:
            cells.append(f"{cycle - sum(means.values()):.2f}")
            cells.append(f"{cycle - store:.2f}")
        else:
            cells += ["—", "—"]
        if locked and name in GOALS and base:
            goal_cycle = 1000 / (GOALS[name] * base)
            cells += [f"{goal_cycle:.2f}", f"{goal_cycle - store:.2f}"]
        else:
            cells += ["—", "—"]
        cells.append(str(len(counted)))
        label = BASE if name == "baseline" else name
        print(f"| {label} | " + " | ".join(cells) + " |")


def cpu(runs, cores, seconds, base="baseline"):
    """Pooled over the repeats: every tick of every run over every order."""
    hz = os.sysconf("SC_CLK_TCK")
    baseline = base_rates(runs, base)
    pooled = {}
    for run in runs:
        before, after = run["before"], run["after"]
        spent = dict.fromkeys(GROUPS + ["other"], 0)
        for process, ticks in after["processes"].items():
            if process in before["processes"]:
                group = process.split("/")[0]
                group = group if group in GROUPS else "other"
                spent[group] += ticks - before["processes"][process]
        spent["wrk and harness"] = after["harness"] - before["harness"]
        spent["busy"] = after["busy"] - before["busy"]
        spent["window"] = after["total"] - before["total"]
        # The orders MySQL counted during the run.
        spent["orders"] = run["orders_per_s"] * seconds
        totals = pooled.setdefault(run["strategy"], {"ceilings": [], "runs": 0})
        totals["runs"] += 1
        for key, value in spent.items():
            totals[key] = totals.get(key, 0) + value
        # What these cores could sell at this run's cost per order, the load generator
        # and the benchmark's own scripts left out.
        served = (spent["busy"] - spent["wrk and harness"]) / hz * 1000 / max(spent["orders"], 1)
        if baseline.get(run["repeat"]) and served > 0:
            totals["ceilings"].append(cores * 1000 / served / baseline[run["repeat"]])
    groups = GROUPS + ["other", "wrk and harness"]
    columns = ["orders/s", "busy %"] + groups + ["rest", "total", "at most", "÷ base"]
    print("| strategy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for strategy, totals in pooled.items():
        orders = max(totals["orders"], 1)
        per_order = {g: totals[g] / hz * 1000 / orders for g in groups}
        per_order["total"] = totals["busy"] / hz * 1000 / orders
        per_order["rest"] = per_order["total"] - sum(per_order[g] for g in groups)
        served = per_order["total"] - per_order["wrk and harness"]
        cells = [f"{totals['orders'] / seconds / totals['runs']:.0f}",
                 f"{100 * totals['busy'] / max(totals['window'], 1):.0f}"]
        cells += [f"{per_order[c]:.2f}" for c in groups + ["rest", "total"]]
        cells.append(f"{cores * 1000 / served:.0f}" if served > 0 else "—")
        cells.append(spread(totals["ceilings"], 2))
        label = BASE if strategy == "baseline" else strategy
        print(f"| {label} | " + " | ".join(cells) + " |")


def lines(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def latency(path):
    """One row per strategy: its capacity and the open model's rates, latency and
    cost, each the median (min-max) of the repeats that ran."""
    hz = os.sysconf("SC_CLK_TCK")
    runs = lines(path)
    print("| strategy | capacity orders/s | offered orders/s | sold orders/s | p50 ms | p99 ms"
          " | p99.9 ms | goal | busy | errors | cores busy % | load test ms/order | runs |")
    print("|---" * 13 + "|")
    for name in names(runs):
        mine = [r for r in runs if r["strategy"] == name]
        done = [r for r in mine if not r.get("failed")]
        figures = {key: [] for key in ("sold", "p50", "p99", "p999", "refused", "errors", "busy", "cpu")}
        for r in done:
            run, before, after = r["run"], r["before"], r["after"]
            figures["sold"].append(run["orders_per_s"])
            for key in ("p50", "p99", "p999"):
                if run["latency_ms"].get(key) is not None:
                    figures[key].append(run["latency_ms"][key])
            figures["refused"].append(run["busy"])
            figures["errors"].append(run["errors"] + run["sold_out"])
            window = after["total"] - before["total"]
            if window > 0:
                figures["busy"].append(100 * (after["busy"] - before["busy"]) / window)
            if run["orders"] > 0:
                figures["cpu"].append((after["harness"] - before["harness"]) / hz * 1000 / run["orders"])
        cells = [spread([r["capacity"] for r in mine], 0),
                 spread([r["rate"] for r in mine if "rate" in r], 0),
                 spread(figures["sold"], 0), spread(figures["p50"], 2),
                 spread(figures["p99"], 2), spread(figures["p999"], 2),
                 f"p99 ≤ {GOAL_P99_MS} ms", spread(figures["refused"], 0),
                 spread(figures["errors"], 0),
                 spread(figures["busy"], 0), spread(figures["cpu"], 2),
                 f"{len(done)}/{len(mine)}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def skus(runs):
    """Orders/s per strategy and its ratio to `none` in the same repeat."""
    measure = {r["repeat"]: r["orders_per_s"] for r in runs if r["strategy"] == "none"}
    print("| strategy | orders/s | ÷ none, same connections and SKUs | goal | non-2xx answers/s |")
    print("|---|---|---|---|---|")
    for name in names(runs):
        mine = [r for r in runs if r["strategy"] == name]
        shares = [r["orders_per_s"] / measure[r["repeat"]] for r in mine if measure.get(r["repeat"])]
        judged = name != "none" and not name.endswith(" classic")
        goal = f"≥ {GOAL_SKUS:.1f}" if judged else "—"
        print(f"| {name} | {spread([r['orders_per_s'] for r in mine], 0)} | {spread(shares, 2)}"
              f" | {goal} | {spread([r['non_2xx_per_s'] for r in mine], 0)} |")


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "latency":
        latency(path)
        sys.exit()
    runs = load(path)
    if mode == "skus":
        skus(runs)
        sys.exit()
    if mode == "ratios":
        ratios(runs)
    elif mode == "time":
        time(runs)
    elif mode == "cpu":
        cpu(runs, int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:6])
    else:
        sys.exit(f"unknown table {mode!r}; see the module's docstring")
