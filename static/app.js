// The flashsale dashboard. One EventSource brings a snapshot per second (stats, lock
// state) and the output of a running load test; everything else is plain fetch calls
// to the JSON API. Text is always set with textContent, never parsed as HTML.
"use strict";

const state = {
  strategies: [],        // from /api/strategies
  latestRun: new Map(),  // strategy -> run of the newest report
  lastTotal: null,       // { orders, at } of the previous snapshot, for orders/s
  lastRequests: new Map(), // replica id -> { requests, at }
  rate: { t: [], v: [] },  // orders/s over the last minute
  lastSnapshotAt: 0,
  strategyPicked: false, // the menu holds a choice not yet switched to
  charts: {},
};

// ---- small helpers ------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Admin calls carry the admin token when the service has one; the page asks for it
// on the first 401/403 and keeps it for this browser tab only.
function isAdminCall(method, path) {
  return path.startsWith("/api/admin/") || (method === "POST" && (path === "/api/loadtests" || path === "/api/runs"));
}

async function api(method, path, body, retried = false) {
  const options = { method, headers: {} };
  const token = sessionStorage.getItem("flashsale-admin-token");
  if (token && isAdminCall(method, path)) options.headers.authorization = `Bearer ${token}`;
  if (body !== undefined) {
    options.headers["content-type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if ((response.status === 401 || response.status === 403) && !retried) {
    const entered = window.prompt("This service needs its admin token for that (FLASHSALE_ADMIN_TOKEN):");
    if (entered) {
      sessionStorage.setItem("flashsale-admin-token", entered.trim());
      return api(method, path, body, true);
    }
  }
  if (!response.ok) {
    const message = data && data.message ? data.message : `${response.status}`;
    throw Object.assign(new Error(message), { status: response.status, data });
  }
  return data;
}

function say(message, isError = false) {
  const node = document.getElementById("control-message");
  node.textContent = message;
  node.classList.toggle("error", isError);
}

function fmt(n, digits = 0) {
  return n === null || n === undefined ? "–" : Number(n).toFixed(digits);
}

// "42 s", "17 min", "5 h": how long something has been up.
function duration(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  return s < 120 ? `${s} s` : s < 7200 ? `${Math.floor(s / 60)} min` : `${Math.floor(s / 3600)} h`;
}

// ---- controls -----------------------------------------------------------------

function setUpControls() {
  // A strategy picked but not yet switched to stays picked: live snapshots only show
  // the active strategy in the menu while the user has not touched it.
  const strategySelect = document.getElementById("strategy-select");
  strategySelect.addEventListener("change", () => { state.strategyPicked = true; });
  document.getElementById("strategy-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const strategy = strategySelect.value;
    state.strategyPicked = false;
    try {
      await api("PUT", "/api/admin/strategy", { strategy });
      document.getElementById("active-strategy").textContent = strategy;
      say(`All replicas now use ${strategy}.`);
    } catch (error) {
      say(`Could not switch: ${error.message}`, true);
    }
  });

  document.getElementById("reset-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const sku = document.getElementById("reset-sku").value.trim();
    const stock = Number(document.getElementById("reset-stock").value);
    try {
      await api("POST", "/api/admin/reset", { sku, stock });
      document.getElementById("buy-sku").value = sku;
      say(`${sku} restocked with ${stock}; its orders were cleared.`);
    } catch (error) {
      say(`Could not reset: ${error.message}`, true);
    }
  });

  document.getElementById("buy-count").addEventListener("input", (event) => {
    const n = Number(event.target.value) || 1;
    document.getElementById("buy-button").textContent = n === 1 ? "Buy 1 each" : `${n} shoppers buy 1 each, at once`;
  });

  document.getElementById("buy-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const sku = document.getElementById("buy-sku").value.trim();
    const shoppers = Math.min(500, Math.max(1, Number(document.getElementById("buy-count").value) || 1));
    // The server plays the crowd: a browser could send only five orders at once.
    try {
      const done = await api("POST", "/api/admin/crowd", { sku, shoppers });
      say(`${shoppers} shopper(s) on ${sku}, at once over ${done.replicas.length} replica(s): ` +
        Object.entries(done.outcomes).map(([code, n]) => `${n} ${code}`).join(", "));
    } catch (error) {
      say(`The crowd could not buy: ${error.message}`, true);
    }
  });

  document.getElementById("fencing-toggle").addEventListener("change", async (event) => {
    const enabled = event.target.checked;
    try {
      await api("PUT", "/api/admin/fencing", { enabled });
      say(enabled ? "Fencing on: stale lock holders' writes will be refused." : "Fencing off.");
    } catch (error) {
      event.target.checked = !enabled;
      say(`Could not switch fencing: ${error.message}`, true);
    }
  });

  document.getElementById("fault-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const at = document.getElementById("pause-at").value;
      const armed = await api("POST", "/api/admin/faults", { at });
      const where = document.getElementById("pause-at").selectedOptions[0].textContent;
      say(`The next lock holder will pause ${armed.pause_holder_ms} ms ${where}.`);
    } catch (error) {
      say(`Could not arm the fault: ${error.message}`, true);
    }
  });

  document.getElementById("kill-holder").addEventListener("click", async () => {
    const sku = document.getElementById("buy-sku").value.trim();
    try {
      const killed = await api("POST", "/api/admin/faults/kill-holder", { sku });
      say(`kill -9 sent to ${killed.replica} (pid ${killed.pid}), which held ${sku}'s lock. ` +
        "Its lock frees itself when the lease (or session) runs out; the supervisor restarts it.");
    } catch (error) {
      say(`Could not kill the holder: ${error.message}`, true);
    }
  });

  document.getElementById("loadtest-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const strategies = [...document.querySelectorAll("#lt-strategies input:checked")].map((box) => box.value);
    const body = {
      users: Number(document.getElementById("lt-users").value),
      stock: Number(document.getElementById("lt-stock").value),
      skus: Number(document.getElementById("lt-skus").value),
      strategies: strategies.length === state.strategies.length ? [] : strategies,
      fault: document.getElementById("lt-fault").checked ? "pause-holder" : null,
    };
    try {
      const started = await api("POST", "/api/loadtests", body);
      document.getElementById("loadtest-log").textContent = "";
      appendLog(`targets: ${started.targets.join(", ")}`);
      refreshLoadTestStatus();
    } catch (error) {
      appendLog(`not started: ${error.message}`);
    }
  });
}

// ---- strategies and learning cards ----------------------------------------------

async function loadStrategies() {
  state.strategies = await api("GET", "/api/strategies");
  const select = document.getElementById("strategy-select");
  const boxes = document.getElementById("lt-strategies");
  select.replaceChildren(...state.strategies.map((s) => el("option", { value: s.name }, s.name)));
  boxes.replaceChildren(el("legend", {}, "strategies"), ...state.strategies.map((s) =>
    el("label", {}, el("input", { type: "checkbox", value: s.name, checked: "" }), ` ${s.name}`)));
  renderLearnCards();
}

function renderLearnCards() {
  const cards = state.strategies.map((s) => {
    const run = state.latestRun.get(s.name);
    const figures = run
      ? el("p", { class: "muted" },
          `Latest run: ${fmt(run.orders_per_s)} orders/s, p99 ${fmt(run.latency_ms.p99)} ms, `,
          run.oversold > 0 ? el("strong", { class: "bad" }, `${run.oversold} oversold`) : "0 oversold",
          `, ${run.busy} busy.`)
      : el("p", { class: "muted" }, "No load-test run yet.");
    return el("article", { class: "card", dataset: { strategy: s.name } },
      el("h3", {}, `${s.title} `, el("code", {}, s.name)),
      el("p", {}, s.summary),
      el("h4", {}, "Exactly what it runs"),
      el("ul", { class: "commands" }, s.commands.map((c) => el("li", {}, el("code", {}, c)))),
      el("h4", {}, "How it fails"),
      el("p", { class: "fails" }, s.failure_mode),
      figures);
  });
  document.getElementById("strategy-cards").replaceChildren(...cards);
}

// ---- live snapshot --------------------------------------------------------------

function onSnapshot(snapshot) {
  state.lastSnapshotAt = Date.now();
  const stats = snapshot.stats;
  document.getElementById("active-strategy").textContent = stats.strategy;
  const select = document.getElementById("strategy-select");
  if (!state.strategyPicked && document.activeElement !== select) select.value = stats.strategy;
  const fencing = document.getElementById("fencing-toggle");
  if (document.activeElement !== fencing) fencing.checked = stats.fencing;
  document.getElementById("fencing-state").textContent = stats.fencing ? "on: MySQL refuses stale holders" : "off";
  document.getElementById("fault-state").textContent = stats.pause_armed_ms
    ? `armed: the next holder stalls ${stats.pause_armed_ms} ms (${(stats.pause_armed_at || "before_commit").replace("_", " ")})` : "";
  renderSkus(stats.skus);
  renderRate(stats.skus, snapshot.at);
  renderReplicas(stats.replicas, snapshot.at);
  renderLocks(stats.strategy, snapshot.locks, stats.replicas);
  const busiest = [...stats.skus].sort((a, b) => Date.parse(b.updated_at) - Date.parse(a.updated_at))[0];
  if (busiest) refreshRace(busiest.sku);
}

// ---- the race: critical sections per replica ------------------------------------

const RACE_SECTIONS = 60;

async function refreshRace(sku) {
  try {
    const timeline = await api("GET", `/api/timeline?sku=${encodeURIComponent(sku)}`);
    renderRace(timeline.sku, timeline.sections.slice(-RACE_SECTIONS));
  } catch (error) {
    document.getElementById("race-legend").textContent = `No timeline: ${error.message}`;
  }
}

function renderRace(sku, sections) {
  document.getElementById("race-sku").textContent = `(${sku}, last ${sections.length} orders)`;
  const chart = document.getElementById("race-chart");
  if (!sections.length) {
    chart.replaceChildren(el("p", { class: "muted" }, "No order yet for this SKU."));
    return;
  }
  const replicas = [...new Set(sections.map((s) => s.replica))].sort();
  // Overlapping sections of one replica go to lanes of their own, so the race shows
  // as bars stacked over each other instead of hidden behind one another.
  const MAX_LANES = 12;
  const lanes = new Map(replicas.map((r) => [r, []]));
  const laneOf = new Map();
  [...sections].sort((a, b) => a.start_ms - b.start_ms).forEach((s) => {
    const ends = lanes.get(s.replica);
    let lane = ends.findIndex((end) => end <= s.start_ms);
    if (lane === -1) lane = Math.min(ends.length, MAX_LANES - 1);
    ends[lane] = Math.max(ends[lane] || 0, s.end_ms);
    laneOf.set(s, lane);
  });
  const laneHeight = 14;
  const rowTop = new Map();
  let top = 4;
  replicas.forEach((r) => { rowTop.set(r, top); top += Math.max(lanes.get(r).length, 1) * laneHeight + 10; });
  const t0 = Math.min(...sections.map((s) => s.start_ms));
  const t1 = Math.max(...sections.map((s) => s.end_ms));
  const span = Math.max(t1 - t0, 1);
  const [width, label] = [1000, 110];
  const height = top + 18;
  const x = (t) => label + ((t - t0) / span) * (width - label - 10);
  const overlapping = sections.map((a, i) => sections.some((b, j) => i !== j && a.start_ms < b.end_ms && b.start_ms < a.end_ms));
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.appendChild(node);
    return node;
  };
  replicas.forEach((replica) => add("text", { x: 4, y: rowTop.get(replica) + 11 }, replica));
  sections.forEach((s, i) => {
    const known = ["created", "sold_out", "lock_lost"].includes(s.outcome) ? s.outcome : "other";
    const bar = add("rect", {
      x: x(s.start_ms), y: rowTop.get(s.replica) + laneOf.get(s) * laneHeight,
      width: Math.max(x(s.end_ms) - x(s.start_ms), 2), height: laneHeight - 3,
      class: `${known}${overlapping[i] ? " overlap" : ""}`,
    });
    const title = document.createElementNS(ns, "title");
    title.textContent = `${s.replica} ${s.strategy}: ${s.outcome}, ${(s.end_ms - s.start_ms).toFixed(1)} ms` +
      (s.fence === null ? "" : `, token ${s.fence}`) + (s.order_id === null ? "" : `, order ${s.order_id}`);
    bar.appendChild(title);
  });
  add("text", { x: label, y: height - 6 }, `${span.toFixed(0)} ms from the first section shown to the last`);
  chart.replaceChildren(svg);
  const overlaps = overlapping.filter(Boolean).length;
  document.getElementById("race-legend").textContent =
    `${overlaps} of ${sections.length} sections overlap another · green: sold · grey: sold out · red: refused (lock lost or fenced)`;
}

// The SKUs most recently active first; a long tail of old SKUs is summarised.
const SKU_CARDS = 12;

function renderSkus(allSkus) {
  const skus = [...allSkus].sort((a, b) => Date.parse(b.updated_at) - Date.parse(a.updated_at)).slice(0, SKU_CARDS);
  const cards = skus.map((s) => {
    const verdict = s.oversold > 0
      ? el("p", { class: "verdict bad oversold" }, `⚠ OVERSOLD by ${s.oversold}: ${s.orders} orders for ${s.initial_stock} units`)
      : el("p", { class: "verdict ok oversold" }, "✓ Not oversold");
    const consistency = s.consistent
      ? el("p", { class: "verdict ok" }, "✓ Redis, MySQL and orders agree")
      : el("p", { class: "verdict bad" }, "✗ Inconsistent: Redis, MySQL and orders disagree");
    return el("article", { class: "card sku", dataset: { sku: s.sku } },
      el("h3", {}, s.sku),
      el("dl", { class: "figures" },
        el("dt", {}, "initial stock"), el("dd", { class: "initial" }, s.initial_stock),
        el("dt", {}, "stock in Redis"), el("dd", { class: "stock-redis" }, s.stock_redis ?? "missing"),
        el("dt", {}, "stock in MySQL"), el("dd", { class: "stock-mysql" }, s.stock_mysql),
        el("dt", {}, "orders"), el("dd", { class: "orders" }, s.orders)),
      verdict, consistency);
  });
  if (allSkus.length > skus.length) {
    cards.push(el("p", { class: "muted" }, `${allSkus.length - skus.length} older SKU(s) not shown.`));
  }
  document.getElementById("sku-cards").replaceChildren(
    ...(cards.length ? cards : [el("p", { class: "muted" }, "No SKU yet: reset one above.")]));
}

function renderRate(skus, at) {
  const now = Date.parse(at) / 1000;
  const total = skus.reduce((sum, s) => sum + s.orders, 0);
  if (state.lastTotal && now > state.lastTotal.at) {
    const rate = Math.max(0, (total - state.lastTotal.orders) / (now - state.lastTotal.at));
    state.rate.t.push(now);
    state.rate.v.push(rate);
    while (state.rate.t.length && state.rate.t[0] < now - 60) {
      state.rate.t.shift();
      state.rate.v.shift();
    }
    drawChart("rate", "rate-chart", [state.rate.t, state.rate.v], [{ label: "orders/s", stroke: "#0550ae" }]);
  }
  state.lastTotal = { orders: total, at: now };
}

function renderReplicas(replicas, at) {
  const now = Date.parse(at) / 1000;
  const rows = replicas.map((r) => {
    const previous = state.lastRequests.get(r.id);
    const rate = previous && now > previous.at ? (r.requests - previous.requests) / (now - previous.at) : null;
    state.lastRequests.set(r.id, { requests: r.requests, at: now });
    // The supervisor restarts a replica that died; the count and the new uptime say so.
    const up = `up ${duration(now - Date.parse(r.started_at) / 1000)}`;
    return el("tr", { dataset: { replica: r.id } },
      el("td", {}, r.id), el("td", {}, r.address), el("td", {}, fmt(rate)),
      el("td", {}, r.lock_waiters), el("td", {}, r.requests),
      el("td", { class: r.restarts ? "restarts bad" : "restarts" },
        r.restarts ? `restarted ${r.restarts}× · ${up}` : up));
  });
  document.querySelector("#replicas tbody").replaceChildren(...rows);
}

function renderLocks(strategy, locks, replicas) {
  document.getElementById("lock-strategy").textContent = `(${strategy})`;
  const waiting = replicas.reduce((sum, r) => sum + r.lock_waiters, 0);
  const views = locks.map(({ sku, view }) => el("article", { class: "card lock", dataset: { sku } },
    el("h3", {}, sku),
    el("dl", { class: "figures" },
      el("dt", {}, "held by"), el("dd", {}, view.held ? (view.holder || "someone") : "nobody"),
      el("dt", {}, "lease left"), el("dd", {}, view.lease_left_ms === null ? "–" : `${view.lease_left_ms} ms`),
      el("dt", {}, "orders waiting, all SKUs"), el("dd", {}, waiting)),
    el("pre", { class: "state" }, view.state.join("\n"))));
  document.getElementById("lock-views").replaceChildren(
    ...(views.length ? views : [el("p", { class: "muted" }, "No SKU to show.")]));
}

// ---- load test ------------------------------------------------------------------

function appendLog(line) {
  const log = document.getElementById("loadtest-log");
  log.textContent += line + "\n";
  log.scrollTop = log.scrollHeight;
  if (line.startsWith("done:")) {
    refreshLoadTestStatus();
    loadHistory();
  }
}

async function refreshLoadTestStatus() {
  const status = await api("GET", "/api/loadtests");
  const button = document.getElementById("loadtest-start");
  const text = document.getElementById("loadtest-status");
  if (!status.available) {
    button.disabled = true;
    button.textContent = "Load test not built";
    text.textContent = `The load-test binary is not built. Build it with: ${status.hint}`;
  } else {
    button.disabled = status.running;
    button.textContent = status.running ? "Load test running…" : "Start load test";
    text.textContent = status.running ? "A load test is running; its progress streams below." : "Runs the built load test against every replica alive.";
  }
  const log = document.getElementById("loadtest-log");
  if (!log.textContent && status.recent.length) log.textContent = status.recent.join("\n") + "\n";
}

// ---- history --------------------------------------------------------------------

async function loadHistory() {
  const reports = await api("GET", "/api/runs");
  state.latestRun = new Map((reports[0] ? reports[0].runs : []).map((run) => [run.strategy, run]));
  renderLearnCards();

  const rows = [];
  reports.forEach((report, index) => {
    const when = new Date(report.generated_at).toLocaleString();
    for (const run of report.runs) {
      rows.push(el("tr", {},
        el("td", {}, `#${reports.length - index} ${when}`), el("td", {}, run.strategy),
        el("td", {}, run.orders),
        el("td", { class: run.oversold > 0 ? "bad" : "" }, run.oversold > 0 ? `${run.oversold} OVERSOLD` : "0"),
        el("td", {}, fmt(run.orders_per_s)), el("td", {}, fmt(run.latency_ms.p50)),
        el("td", {}, fmt(run.latency_ms.p99)), el("td", {}, run.busy),
        el("td", {}, run.consistent ? "yes" : "NO")));
    }
  });
  document.querySelector("#history-table tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "9" }, "No load test yet."))]));

  // One series per strategy over the runs, oldest first (x = run number).
  const chronological = [...reports].reverse();
  const x = chronological.map((_, i) => i + 1);
  const names = [...new Set(chronological.flatMap((r) => r.runs.map((run) => run.strategy)))];
  const palette = ["#a40e26", "#0550ae", "#116329", "#8250df", "#bc4c00", "#1b7c83", "#6e7781", "#cf222e", "#953800"];
  const series = names.map((name, i) => ({ label: name, stroke: palette[i % palette.length], spanGaps: true }));
  const column = (pick) => names.map((name) => chronological.map((r) => {
    const run = r.runs.find((candidate) => candidate.strategy === name);
    return run ? pick(run) : null;
  }));
  drawChart("orders", "history-orders", [x, ...column((r) => r.orders_per_s)], series);
  drawChart("p99", "history-p99", [x, ...column((r) => r.latency_ms.p99)], series);
  drawChart("oversold", "history-oversold", [x, ...column((r) => r.oversold)], series);
}

function drawChart(key, containerId, data, series) {
  const container = document.getElementById(containerId);
  const width = Math.max(300, container.clientWidth || 400);
  const existing = state.charts[key];
  if (existing && existing.series.length === series.length + 1) {
    existing.setData(data);
    return;
  }
  if (existing) existing.destroy();
  const isTime = key === "rate";
  state.charts[key] = new uPlot({
    width, height: 200,
    scales: { x: { time: isTime } },
    axes: [{ label: isTime ? "" : "run" }, {}],
    series: [{}, ...series.map((s) => ({ width: 2, points: { show: !isTime }, ...s }))],
  }, data, container);
}

// ---- live feed ------------------------------------------------------------------

function connect() {
  const status = document.getElementById("connection");
  const events = new EventSource("/api/events");
  events.addEventListener("snapshot", (event) => onSnapshot(JSON.parse(event.data)));
  events.addEventListener("loadtest", (event) => appendLog(event.data));
  events.onerror = () => { status.textContent = "disconnected, retrying…"; status.classList.add("down"); };
  setInterval(() => {
    if (!state.lastSnapshotAt) return;
    const age = (Date.now() - state.lastSnapshotAt) / 1000;
    status.classList.toggle("down", age > 5);
    status.textContent = age > 5 ? `no update for ${age.toFixed(0)} s` : `live · updated ${age.toFixed(1)} s ago`;
  }, 500);
}

async function main() {
  setUpControls();
  connect();
  await loadStrategies().catch((error) => say(`Cannot load strategies: ${error.message}`, true));
  await Promise.all([loadHistory(), refreshLoadTestStatus()]).catch((error) => say(error.message, true));
}

main();
