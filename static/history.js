// The load-test history (`GET /api/runs`, newest first): the latest run's strategies
// side by side, each strategy's trend across runs, and the table of every run. A run
// is always shown with its settings, since figures of runs with different crowds,
// stocks or faults do not compare. Loaded before app.js, whose helpers it uses.
"use strict";

// "60 shoppers · 200 units × 1 SKU · fencing off · no fault": what a run was run with
// (the report's `config`, and the runs' own stock, see stockSaid). Fields a report
// may lack (older or newer load tests) are said only when present: an open model's
// arrival rate, repeated runs, the work time.
function runSettings(report) {
  const config = report.config;
  const crowd = config.rate
    ? `${config.rate} orders/s arriving`
    : `${config.users} shopper${config.users === 1 ? "" : "s"}`;
  const parts = [crowd, stockSaid(report)];
  if (config.repeat > 1) parts.push(`each strategy ${config.repeat}×`);
  if (config.work_ms !== undefined && config.work_ms !== null) parts.push(`work ${config.work_ms} ms`);
  parts.push(`fencing ${config.fencing ? "on" : "off"}`);
  if (typeof config.cohort === "boolean") parts.push(`cohort ${config.cohort ? "on" : "off"}`);
  parts.push(config.fault ? `fault: ${config.fault}` : "no fault");
  // The service reads a report made before the keys as one that sent none, which it did.
  if (config.idempotency_keys !== undefined) {
    parts.push(config.idempotency_keys ? "keys" : "no keys");
    if (config.double_click_share) parts.push(`${Math.round(config.double_click_share * 100)} % double-click`);
    if (config.retry_share) parts.push(`${Math.round(config.retry_share * 100)} % retry`);
    if (config.limit_per_user) parts.push(`limit ${config.limit_per_user}/user`);
  }
  return parts.join(" · ");
}

// "200 units × 1 SKU": the units per SKU from the runs' records rather than the
// config, since `--stock-for` gives some strategies another stock; the stock most
// strategies sold first, the others after it (as report.md says it).
function stockSaid(report) {
  const skus = Math.max(report.config.skus, 1);
  const stocks = new Map();
  for (const run of report.runs) {
    // Whole units, as report.md says them.
    if (!stocks.has(run.strategy)) stocks.set(run.strategy, Math.trunc(run.initial_stock / skus));
  }
  const all = [...stocks.values()];
  const count = (n) => all.filter((m) => m === n).length;
  const base = all.length ? all.reduce((best, n) => (count(n) > count(best) ? n : best)) : report.config.stock;
  const others = [...stocks].filter(([, n]) => n !== base).map(([strategy, n]) => `${strategy}: ${n}`);
  return `${base} unit${base === 1 ? "" : "s"} × ${skus} SKU${skus === 1 ? "" : "s"}` +
    (others.length ? ` (${others.join(", ")})` : "");
}

// A report's runs, one entry per strategy: a strategy run several times (`--repeat`)
// is shown by its median and range, its oversold by the worst run, since one oversell
// is one too many.
function byStrategy(report) {
  const runs = new Map();
  for (const run of report.runs) runs.set(run.strategy, [...(runs.get(run.strategy) || []), run]);
  return [...runs].map(([strategy, all]) => ({
    strategy,
    repeats: all.length,
    orders_per_s: spread(all.map((r) => r.orders_per_s)),
    p50: spread(all.map((r) => r.latency_ms.p50)),
    p99: spread(all.map((r) => r.latency_ms.p99)),
    oversold: Math.max(...all.map((r) => r.oversold)),
    duplicates: Math.max(...all.map((r) => (r.duplicates ? r.duplicates.repeat_orders : 0))),
  }));
}

function spread(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  const median = sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
  return { median, min: sorted[0], max: sorted[sorted.length - 1] };
}

// "850", or "850 (800–900)" for a strategy run several times.
function spreadText(s, digits = 0) {
  return s.min === s.max ? fmt(s.median, digits) : `${fmt(s.median, digits)} (${fmt(s.min, digits)}–${fmt(s.max, digits)})`;
}

// A report's name on the page: its id in the history (stable across reloads).
function runName(report) {
  return `#${report.id}`;
}

async function loadHistory() {
  const reports = await api("GET", "/api/runs?limit=50");
  state.latestRun = new Map((reports[0] ? reports[0].runs : []).map((run) => [run.strategy, run]));
  renderLearnCards();
  renderComparison(reports[0]);
  renderTrends([...reports].reverse());
  renderHistoryTable(reports);
}

function renderComparison(report) {
  const settings = document.getElementById("comparison-settings");
  if (!report) {
    settings.textContent = "No load test yet.";
    for (const id of ["compare-orders", "compare-latency", "compare-oversold", "compare-duplicates"]) document.getElementById(id).replaceChildren();
    return;
  }
  settings.textContent = `Run ${runName(report)}, ${new Date(report.generated_at).toLocaleString()}: ` +
    `${runSettings(report)}.`;
  const strategies = byStrategy(report);
  drawBars("compare-orders", strategies, [
    { pick: (s) => s.orders_per_s.median, format: (s) => spreadText(s.orders_per_s), class: "orders" }]);
  drawBars("compare-latency", strategies, [
    { pick: (s) => s.p50.median, format: (s) => `${spreadText(s.p50, 1)} p50`, class: "p50" },
    { pick: (s) => s.p99.median, format: (s) => `${spreadText(s.p99, 1)} p99`, class: "p99" },
  ]);
  drawBars("compare-oversold", strategies, [{
    pick: (s) => s.oversold,
    format: (s) => (s.oversold > 0 ? `${s.oversold} OVERSOLD` : "0 ✓"),
    tone: (n) => (n > 0 ? "bad" : "ok"),
  }]);
  // Counted from the records: a user's orders beyond their first, each user being one
  // intent of the crowd. Without keys they are the lesson; with keys, a bug.
  drawBars("compare-duplicates", strategies, [{
    pick: (s) => s.duplicates,
    format: (s) => (s.duplicates > 0 ? `${s.duplicates} DUPLICATE` : "0 ✓"),
    tone: (n) => (n > 0 ? "bad" : "ok"),
  }]);
}

// One line per strategy over the runs, oldest first. The x axis is the run's place in
// the history, labelled with its name; hovering a run shows its settings, and the list
// under the charts gives every run's settings.
function renderTrends(chronological) {
  const note = document.getElementById("trends-note");
  const trends = document.getElementById("trends");
  const labels = document.getElementById("run-labels");
  labels.replaceChildren(...chronological.map((report) =>
    el("li", { dataset: { run: report.id } }, el("strong", {}, runName(report)), ` ${runSettings(report)}: `,
      byStrategy(report).map((s) => s.strategy).join(", "))));
  if (chronological.length < 2) {
    // One run has no trend; the comparison above shows it.
    note.textContent = chronological.length ? "Trends appear from the second run on." : "";
    trends.hidden = true;
    return;
  }
  note.textContent = "Hover a run to see its settings; they are listed under the charts too.";
  trends.hidden = false;
  const x = chronological.map((_, i) => i);
  const names = [...new Set(chronological.flatMap((r) => r.runs.map((run) => run.strategy)))];
  const series = names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], spanGaps: true }));
  // A strategy run several times in one report is drawn at its median (worst oversold).
  const summaries = chronological.map((report) => new Map(byStrategy(report).map((s) => [s.strategy, s])));
  const column = (pick) => names.map((name) => summaries.map((strategies) => {
    const summary = strategies.get(name);
    return summary ? pick(summary) : null;
  }));
  const nameAt = (i) => (chronological[i] ? runName(chronological[i]) : "");
  const options = {
    rebuild: true,  // the runs (and so the x axis) change with each new report
    xLabel: "run",
    xRange: [-0.5, chronological.length - 0.5],
    xAxis: {
      // A tick per run (every few runs when there are many), named like the list below.
      splits: () => x.filter((i) => i % Math.ceil(chronological.length / 12) === 0),
      values: (_, splits) => splits.map(nameAt),
    },
    xSeries: { label: "run", value: (_, i) => (i === null || !chronological[i] ? "–" : `${nameAt(i)}: ${runSettings(chronological[i])}`) },
  };
  drawChart("orders", "history-orders", [x, ...column((s) => s.orders_per_s.median)], series, options);
  drawChart("p99", "history-p99", [x, ...column((s) => s.p99.median)], series, options);
  drawChart("oversold", "history-oversold", [x, ...column((s) => s.oversold)], series, options);
}

function renderHistoryTable(reports) {
  const rows = reports.flatMap((report) => {
    const when = new Date(report.generated_at).toLocaleString();
    const settings = runSettings(report);
    const repeated = report.config.repeat > 1;
    return report.runs.map((run) => el("tr", { dataset: { run: report.id } },
      el("td", {}, `${runName(report)} ${when}`), el("td", {}, settings),
      el("td", {}, repeated && run.repeat ? `${run.strategy} (${run.repeat} of ${report.config.repeat})` : run.strategy),
      el("td", {}, run.orders),
      el("td", { class: run.oversold > 0 ? "bad" : "" }, run.oversold > 0 ? `${run.oversold} OVERSOLD` : "0"),
      el("td", { class: run.duplicates && run.duplicates.repeat_orders > 0 ? "bad" : "" },
        run.duplicates ? duplicatesSaid(run.duplicates) : "–"),
      el("td", {}, fmt(run.orders_per_s)), el("td", {}, fmt(run.latency_ms.p50)),
      el("td", {}, fmt(run.latency_ms.p99)), el("td", {}, run.busy),
      el("td", {}, run.consistent ? "yes" : "NO")));
  });
  document.querySelector("#history-table tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "11" }, "No load test yet."))]));
}
