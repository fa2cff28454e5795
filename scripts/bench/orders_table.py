"""Turns scripts/bench.sh's order runs (JSON lines) into BENCHMARKS.md's table: per
strategy, orders/s (from MySQL) and its ratio to `none` with one connection measured in
the same repeat, median and min-max over the repeats, against the goals."""
import json
import statistics
import sys

GOALS = {
    "redis-lock": "≥ 0.8", "optimistic": "≥ 0.8", "db-for-update": "≥ 1.0",
    "db-unique": "≥ 0.6", "zookeeper": "≥ 0.5", "etcd": "≥ 0.5", "redlock": "≥ 0.4",
    "redis-atomic": "≥ 4.0", "none": "—",
}


def spread(values, digits):
    if not values:
        return "—"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
baseline = {r["repeat"]: r["orders_per_s"] for r in runs if r["strategy"] == "baseline"}
order = []
for r in runs:
    if r["strategy"] != "baseline" and r["strategy"] not in order:
        order.append(r["strategy"])
print("| strategy | orders/s | ÷ none, 1 connection | goal | non-2xx answers/s |")
print("|---|---|---|---|---|")
base = [v for v in baseline.values()]
print(f"| none, 1 connection (the base) | {spread(base, 0)} | 1.00 | — | — |")
for name in order:
    mine = [r for r in runs if r["strategy"] == name]
    rates = [r["orders_per_s"] for r in mine]
    ratios = [r["orders_per_s"] / baseline[r["repeat"]] for r in mine if baseline.get(r["repeat"])]
    refused = [r["non_2xx_per_s"] for r in mine]
    print(f"| {name} | {spread(rates, 0)} | {spread(ratios, 2)} | {GOALS.get(name, '—')} | {spread(refused, 0)} |")
