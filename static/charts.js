// The dashboard's charts: uPlot line charts that follow their box's width, and plain
// HTML/CSS bar charts (a bar per value, its figure written beside it, so the numbers
// are there for screen readers and on a phone too). Loaded before app.js, whose
// `state` and `el` these functions use when called.
"use strict";

const CHART_HEIGHT = 200;
const PALETTE = ["#a40e26", "#0550ae", "#116329", "#8250df", "#bc4c00", "#1b7c83", "#6e7781", "#cf222e", "#953800"];

// One ResizeObserver for every uPlot chart: uPlot draws on a canvas of a fixed size,
// so a chart must be told when its box changes (a window resized, a phone turned).
const chartResizer = new ResizeObserver((entries) => {
  for (const entry of entries) {
    const chart = Object.values(state.charts).find((c) => c.root.parentElement === entry.target);
    const width = chartWidth(entry.target);
    if (chart && Math.abs(chart.width - width) >= 1) chart.setSize({ width, height: CHART_HEIGHT });
  }
});

function chartWidth(container) {
  return Math.max(160, Math.floor(container.clientWidth));
}

// Draws (or updates) the uPlot chart `key` in `containerId`. `options` may give the x
// axis a label, its values and where its ticks fall.
function drawChart(key, containerId, data, series, options = {}) {
  const container = document.getElementById(containerId);
  const existing = state.charts[key];
  if (existing && existing.series.length === series.length + 1 && !options.rebuild) {
    existing.setData(data);
    return;
  }
  if (existing) existing.destroy();
  const isTime = key === "rate";
  state.charts[key] = new uPlot({
    width: chartWidth(container), height: CHART_HEIGHT,
    scales: { x: { time: isTime, ...(options.xRange ? { range: options.xRange } : {}) } },
    axes: [{ label: options.xLabel || "", ...(options.xAxis || {}) }, {}],
    series: [options.xSeries || {}, ...series.map((s) => ({ width: 2, points: { show: !isTime, size: 7 }, ...s }))],
  }, data, container);
  chartResizer.observe(container);
}

// A bar chart of `rows` (one per strategy) in the element `id`. Each measure is one
// bar per row: { pick(row) -> number, format(row) -> text, class, tone(n) -> class }.
// All bars of a chart share one scale, from zero to the largest value.
function drawBars(id, rows, measures) {
  const values = rows.flatMap((row) => measures.map((m) => m.pick(row)));
  const largest = Math.max(...values.filter(Number.isFinite), 0);
  const groups = rows.map((row) => {
    const name = el("span", { class: "bar-name" }, row.strategy);
    name.style.gridRow = `span ${measures.length}`;  // beside all of its bars
    return el("div", { class: "bar-group", role: "listitem", dataset: { strategy: row.strategy } },
      name, ...measures.map((m) => barLine(m, m.pick(row), m.format(row), largest)));
  });
  const box = document.getElementById(id);
  box.setAttribute("role", "list");
  box.replaceChildren(...groups);
}

function barLine(measure, value, text, largest) {
  const bar = el("span", { class: `bar ${measure.class || ""} ${measure.tone ? measure.tone(value) : ""}` });
  // Set through the CSSOM, not a style attribute: the share of the largest value.
  bar.style.width = `${largest > 0 && Number.isFinite(value) ? (value / largest) * 100 : 0}%`;
  return el("span", { class: "bar-line" },
    el("span", { class: "bar-track" }, bar),
    el("span", { class: "bar-value" }, text));
}
