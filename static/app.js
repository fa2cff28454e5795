// The flashsale dashboard. One EventSource brings a snapshot per second (stats, lock
// state) and the output of a running load test; everything else is plain fetch calls
// to the JSON API. Text is always set with textContent, never parsed as HTML.
// charts.js (uPlot and bar charts) and history.js (the load-test history) load first.
"use strict";

const state = {
  strategies: [],        // from /api/strategies
  latestRun: new Map(),  // strategy -> run of the newest report
  lastTotal: null,       // { orders, at } of the previous snapshot, for orders/s
  rate: { t: [], v: [] },  // orders/s over the last minute
  lastSnapshotAt: 0,
  strategyPicked: false, // the menu holds a choice not yet switched to
  charts: {},
  timing: null,          // { lease, wait, work } in ms, as the replica reports them
  walkthrough: null,     // the timings of a pause this page armed, until a buy starts its clock
  walkthroughClock: 0,   // the interval of that clock
  replicas: new Map(),   // replica id -> what the page knows of it (see trackReplicas)
  replicasAt: 0,         // the time of the snapshot the replica table shows
  // The live feed: its EventSource, the next reconnection's wait (s), the status shown.
  feed: { source: null, retryIn: 1, retryTimer: 0, openedAt: 0, down: false, diagnosing: false, diagnosedAt: 0 },
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

// "13.5 s", "50 ms": a duration in milliseconds, as a person reads it.
function span(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const seconds = ms / 1000;
  return `${Number.isInteger(seconds) ? seconds : seconds.toFixed(1)} s`;
}

// ---- the paused-holder walkthrough -----------------------------------------------

/** The longest pause `POST /api/admin/faults` takes. */
const MAX_PAUSE_MS = 120000;
const roundUp = (ms, step) => Math.ceil(ms / step) * step;

// When the walkthrough's steps must happen, counted from the first shopper's buy, from
// the replica's lease, lock wait and work (ms). The page used to assume demo.sh's 3 s
// lease; with the service's 10 s default a second shopper sent "a second later" gave up
// waiting for the lock (503 lock_timeout) long before the lease ran out.
// - The paused holder stops renewing its lease once its work is done, so the lease
//   ends at most `lease + work` after the buy. A second shopper waits `wait` for the
//   lock: it must come after `lease + work - wait`, or its wait ends first.
// - The pause outlasts the lease and the second shopper's sale, with room for a
//   person's click: the second sells while the first still sleeps, as the story goes.
function walkthroughTimings({ lease, wait, work }) {
  const margin = 1000;
  const leaseEnds = lease + work;
  const earliest = roundUp(Math.max(margin, leaseEnds - wait + margin), 500);
  const secondSold = Math.max(earliest, leaseEnds) + work;
  const pause = Math.min(MAX_PAUSE_MS, roundUp(secondSold + 3 * margin, 500));
  const latest = pause - margin;
  return { pause, earliest, latest, feasible: latest > earliest && pause > leaseEnds };
}

// The line under the fault buttons: the walkthrough's timings for this replica. Set
// only when it changes, since snapshots come every second.
function renderWalkthrough(timing) {
  const node = document.getElementById("walkthrough");
  let text;
  if (!timing.lease) {
    text = "This replica does not report its lease (an older version): the pause takes the " +
      "service's default, 1.5 leases + 0.5 s; send the second shopper once the lease has run out.";
  } else {
    const t = walkthroughTimings(timing);
    const settings = `lease ${span(timing.lease)}, lock wait ${span(timing.wait)}, work ${span(timing.work)}`;
    text = t.feasible
      ? `Paused-holder walkthrough, timed for this replica (${settings}): the pause lasts ${span(t.pause)}. ` +
        `Reset the stock to 1, press Pause, let 1 shopper buy, then 1 more between ${span(t.earliest)} and ` +
        `${span(t.latest)} later. Sooner, its ${span(timing.wait)} lock wait ends before the lease does ` +
        "(503 lock_timeout); later, the paused holder has woken."
      : `This replica's lease (${span(timing.lease)}) is too long for the walkthrough: a pause may last ` +
        `${span(MAX_PAUSE_MS)} at most. Start the replicas with a shorter FLASHSALE_LOCK_LEASE_MS (demo.sh uses 3 s).`;
  }
  if (node.textContent !== text) node.textContent = text;
}

// After the first buy of a walkthrough, counts down to the second shopper's window and
// through it. A ticker: deliberately not a live region (see index.html).
function startWalkthroughClock(timings) {
  const started = Date.now();
  const node = document.getElementById("walkthrough-clock");
  clearInterval(state.walkthroughClock);
  const tick = () => {
    const elapsed = Date.now() - started;
    if (elapsed < timings.earliest) {
      node.textContent = `Second shopper: wait ${span(roundUp(timings.earliest - elapsed, 100))}…`;
    } else if (elapsed < timings.latest) {
      node.textContent = `Second shopper: buy now (${span(roundUp(timings.latest - elapsed, 100))} left).`;
    } else {
      node.textContent = "";
      clearInterval(state.walkthroughClock);
    }
  };
  tick();
  state.walkthroughClock = setInterval(tick, 200);
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
    // The first buy after this page armed a pause starts the walkthrough's clock.
    if (state.walkthrough) {
      startWalkthroughClock(state.walkthrough);
      state.walkthrough = null;
    }
    // The server plays the crowd: a browser could send only five orders at once.
    try {
      const double_click = document.getElementById("buy-double-click").checked;
      const idempotency_key = document.getElementById("buy-key").checked;
      const done = await api("POST", "/api/admin/crowd", { sku, shoppers, double_click, idempotency_key });
      const how = [double_click ? "double-clicking" : "", idempotency_key ? "with keys" : ""].filter(Boolean).join(", ");
      say(`${shoppers} shopper(s) on ${sku}${how ? ` (${how})` : ""}, at once over ${done.replicas.length} replica(s): ` +
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

  const switchCohort = async (enabled, combine) => {
    const toggle = document.getElementById("cohort-toggle");
    try {
      await api("PUT", "/api/admin/cohort", { enabled, combine: enabled ? combine : 1 });
      say(!enabled
        ? "Cohort off: every order takes the lock from the lock service and gives it back."
        : combine > 1
          ? `Cohort on, combining ${combine}: a lock holder sells up to ${combine} orders queued for its SKU in its replica in one critical section.`
          : "Cohort on: a replica's requests for a SKU queue locally and the holder hands the lock to the next one, up to 8 in a row, instead of releasing it.");
    } catch (error) {
      toggle.checked = !enabled;
      say(`Could not switch the cohort layer: ${error.message}`, true);
    }
  };
  document.getElementById("cohort-toggle").addEventListener("change", (event) =>
    switchCohort(event.target.checked, Number(document.getElementById("combine").value) || 1));
  document.getElementById("combine").addEventListener("change", (event) => {
    const combine = Math.min(64, Math.max(1, Math.round(Number(event.target.value)) || 1));
    event.target.value = combine;
    if (combine > 1) document.getElementById("cohort-toggle").checked = true;
    switchCohort(document.getElementById("cohort-toggle").checked, combine);
  });

  document.getElementById("fault-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const at = document.getElementById("pause-at").value;
      // Timed from the replica's lease; without it, the service's default pause.
      const timings = state.timing && state.timing.lease ? walkthroughTimings(state.timing) : null;
      const body = timings && timings.feasible ? { at, pause_holder_ms: timings.pause } : { at };
      const armed = await api("POST", "/api/admin/faults", body);
      const where = document.getElementById("pause-at").selectedOptions[0].textContent;
      state.walkthrough = body.pause_holder_ms ? { ...timings, armedAt: Date.now() } : null;
      say(`The next lock holder will pause ${span(armed.pause_holder_ms)} ${where}` +
        (state.walkthrough
          ? ` (its lease: ${span(state.timing.lease)}). Now let 1 shopper buy, and a second one ` +
            `${span(timings.earliest)} to ${span(timings.latest)} after it.`
          : "."));
    } catch (error) {
      say(`Could not arm the fault: ${error.message}`, true);
    }
  });

  document.getElementById("failover-redis").addEventListener("click", async () => {
    const sku = document.getElementById("buy-sku").value.trim();
    try {
      const armed = await api("POST", "/api/admin/faults", { failover_redis: { sku } });
      const plan = armed.failover_redis;
      say(`${plan.promoted} no longer receives ${plan.primary}'s writes (ACL SETUSER default -psync, CLIENT KILL TYPE master). ` +
        `The next holder of ${sku}'s redis-lock pauses ${span(armed.pause_holder_ms)} (less than its lease); ` +
        "meanwhile Sentinel promotes the replica, which never got the lock. Now let 1 shopper buy, " +
        "and a second one a second later.");
    } catch (error) {
      say(`Could not arm the failover: ${error.message}`, true);
    }
  });

  document.getElementById("kill-holder").addEventListener("click", async () => {
    const sku = document.getElementById("buy-sku").value.trim();
    try {
      const killed = await api("POST", "/api/admin/faults/kill-holder", { sku });
      noteKilled(killed.replica, killed.pid);
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
      double_click_share: Number(document.getElementById("lt-double-click").value) || 0,
      no_idempotency_key: document.getElementById("lt-no-key").checked,
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

const FAMILIES = [
  ["none", "No coordination"],
  ["database", "Database-native: the database is the lock"],
  ["lock-service", "Lock services: a lock held elsewhere"],
  ["lock-free", "Lock-free: one atomic step decides"],
];

function costLine(cost) {
  if (!cost) return "Cost: not measured by scripts/bench.sh.";
  // Each figure says the commit it was measured at: the sections may be other runs'.
  const rt = cost.round_trips;
  const trips = rt
    ? ` ${rt.total} round trips per order (Redis ${rt.redis}, MySQL ${rt.mysql}, ` +
      `ZooKeeper ${rt.zookeeper}, etcd ${rt.etcd}; at ${rt.commit});`
    : "";
  const recovery = cost.recovery_ms == null ? ""
    : ` after kill -9 of the holder, the next order sold ${fmt(cost.recovery_ms)} ms later ` +
      `(at ${cost.recovery_commit});`;
  const line = `Cost: ${fmt(cost.orders_per_s)} orders/s on one hot SKU, ${cost.vs_base}× the ` +
    `bare critical section (none, one connection; at ${cost.commit} on ${cost.measured_on});` +
    `${trips}${recovery}`;
  return line.replace(/;$/, ".");
}

/** Whether a strategy's sections are attempts without a lock (optimistic, redis-atomic):
 *  they may overlap by design. none's overlaps stay the race it shows. */
function isAttempt(name) {
  const family = (state.strategies || []).find((s) => s.name === name)?.family;
  return name === "optimistic" || family === "lock-free";
}

// A run's duplicates from the records (`docs/report.md`); reports older than the count
// have none to say.
function duplicatesSaid(d) {
  if (!d) return "duplicates not counted";
  const parts = [d.repeat_orders > 0 ? `${d.repeat_orders} duplicate(s)` : "0 duplicates"];
  if (d.orders_sharing_key > 0) parts.push(`${d.orders_sharing_key} sharing a key`);
  if (d.units_over_limit > 0) parts.push(`${d.units_over_limit} over the limit`);
  return parts.join(", ");
}

function renderLearnCards() {
  const card = (s) => {
    const run = state.latestRun.get(s.name);
    const figures = run
      ? el("p", { class: "muted" },
          `Latest run here: ${fmt(run.orders_per_s)} orders/s, p99 ${fmt(run.latency_ms.p99)} ms, `,
          run.oversold > 0 ? el("strong", { class: "bad" }, `${run.oversold} oversold`) : "0 oversold",
          ", ", duplicatesSaid(run.duplicates), `, ${run.busy} busy.`)
      : el("p", { class: "muted" }, "No load-test run here yet.");
    return el("article", { class: "card", dataset: { strategy: s.name, family: s.family } },
      el("h4", {}, `${s.title} `, el("code", {}, s.name)),
      el("p", {}, s.summary),
      el("p", { class: "adds" }, el("strong", {}, "This lab adds: "), s.adds),
      el("p", { class: "cost" }, costLine(s.cost)),
      el("p", { class: "fails" }, el("strong", {}, "How it fails: "), s.failure_mode),
      el("details", { class: "commands" },
        el("summary", {}, "Exactly what it sends"),
        el("ul", {}, s.commands.map((c) => el("li", {}, el("code", {}, c))))),
      figures);
  };
  const groups = FAMILIES.map(([family, title]) => {
    const members = state.strategies.filter((s) => s.family === family);
    return members.length
      ? el("div", { class: "family", dataset: { family } }, el("h3", {}, title),
          el("div", { class: "cards wide" }, members.map(card)))
      : null;
  }).filter(Boolean);
  document.getElementById("strategy-cards").replaceChildren(...groups);
}

// ---- live snapshot --------------------------------------------------------------

function onSnapshot(snapshot) {
  state.lastSnapshotAt = Date.now();
  const stats = snapshot.stats;
  state.timing = { lease: stats.lock_lease_ms || 0, wait: stats.lock_wait_ms || 0, work: stats.work_ms || 0 };
  renderWalkthrough(state.timing);
  // A pause claimed (or withdrawn) before this page's next buy is no walkthrough's. A
  // snapshot may be a second old when it arrives: one just after the arming proves nothing.
  if (!stats.pause_armed_ms && state.walkthrough && Date.now() - state.walkthrough.armedAt > 2500) {
    state.walkthrough = null;
  }
  document.getElementById("active-strategy").textContent = stats.strategy;
  const select = document.getElementById("strategy-select");
  if (!state.strategyPicked && document.activeElement !== select) select.value = stats.strategy;
  const fencing = document.getElementById("fencing-toggle");
  if (document.activeElement !== fencing) fencing.checked = stats.fencing;
  document.getElementById("fencing-state").textContent = stats.fencing ? "on: MySQL refuses stale holders" : "off";
  // A replica older than the switch leaves it out: the box is left as it was.
  if (typeof stats.cohort === "boolean") {
    const cohort = document.getElementById("cohort-toggle");
    if (document.activeElement !== cohort) cohort.checked = stats.cohort;
    const combine = document.getElementById("combine");
    if (typeof stats.combine === "number" && document.activeElement !== combine) combine.value = stats.combine;
    document.getElementById("cohort-state").textContent = !stats.cohort
      ? "off: every order asks the lock service"
      : (stats.combine || 1) > 1
        ? `on, combining up to ${stats.combine} orders per critical section`
        : "on: local requests queue, the lock is handed on (up to 8 in a row)";
  }
  document.getElementById("fault-state").textContent = stats.pause_armed_ms
    ? `armed: the next holder stalls ${span(stats.pause_armed_ms)} (${(stats.pause_armed_at || "before_commit").replace("_", " ")})` : "";
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
    renderRace(timeline.sku, timeline.sections.slice(-RACE_SECTIONS), timeline.failover);
  } catch (error) {
    document.getElementById("race-legend").textContent = `No timeline: ${error.message}`;
  }
}

function renderRace(sku, sections, failover) {
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
  const overlaps_ = (a, b) => a !== b && a.start_ms < b.end_ms && b.start_ms < a.end_ms;
  const overlapping = sections.map((a) => sections.some((b) => overlaps_(a, b)));
  // Under a lock, a sale that began while another holder was still inside means that
  // holder's lock had gone (a paused holder, woken past its lease): the earlier one is
  // the stale holder, and its write is the oversell.
  // optimistic and redis-atomic hold no lock: their sections are attempts, which may
  // overlap by design (MySQL's guarded write decides), never stale holders.
  const attempt = sections.map((s) => isAttempt(s.strategy));
  const stale = sections.map((a, i) => !attempt[i] && a.strategy !== "none" && a.outcome === "created" &&
    sections.some((b) => b !== a && b.outcome === "created" && b.start_ms > a.start_ms && b.start_ms < a.end_ms));
  // A stale holder whose section spans the Redis failover lost its lock to it: the
  // promoted replica never had the lock (the failover fault), not a lease run out.
  const promotedAt = failover && failover.promoted_at_ms;
  const lostToFailover = sections.map((a, i) => stale[i] && promotedAt > a.start_ms && promotedAt < a.end_ms);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const defs = document.createElementNS(ns, "defs");
  defs.innerHTML = '<pattern id="stale-stripes" width="6" height="6" patternUnits="userSpaceOnUse" ' +
    'patternTransform="rotate(45)"><rect width="6" height="6" fill="#2da44e"/>' +
    '<rect width="3" height="6" fill="#cf222e"/></pattern>';
  svg.appendChild(defs);
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
      class: `${known}${attempt[i] ? " attempt" : overlapping[i] ? " overlap" : ""}${stale[i] ? " stale" : ""}` +
        (s.handed_over ? " handed" : ""),
    });
    const title = document.createElementNS(ns, "title");
    title.textContent = `${s.replica} ${s.strategy}: ${s.outcome}, ${(s.end_ms - s.start_ms).toFixed(1)} ms` +
      (lostToFailover[i] ? ", lock lost to the Redis failover" : "") +
      (s.fence === null ? "" : `, token ${s.fence}`) + (s.order_id === null ? "" : `, order ${s.order_id}`) +
      (s.handed_over ? ", lock handed over by the replica's previous holder" : "") +
      ((s.orders || 1) > 1 ? `, ${s.orders} orders combined in this one section` : "");
    bar.appendChild(title);
  });
  if (promotedAt >= t0 && promotedAt <= t1) {
    add("line", { x1: x(promotedAt), x2: x(promotedAt), y1: 0, y2: height - 18, class: "failover-mark" });
    add("text", { x: x(promotedAt) + 3, y: height - 20, class: "failover-mark" },
      failover.lock_lost ? "Redis failover: lock lost" : "Redis failover: lock kept");
  }
  add("text", { x: label, y: height - 6 }, `${span.toFixed(0)} ms from the first section shown to the last`);
  chart.replaceChildren(svg);
  const overlaps = overlapping.filter(Boolean).length;
  const staleSales = stale.filter(Boolean).length;
  const attempts = attempt.filter(Boolean).length;
  const handed = sections.filter((s) => s.handed_over).length;
  const combined = sections.filter((s) => (s.orders || 1) > 1);
  document.getElementById("race-legend").textContent =
    `${overlaps} of ${sections.length} sections overlap another · green: sold · grey: sold out · red: refused (lock lost or fenced)` +
    (attempts ? ` · dashed: ${attempts} attempt(s) without a lock (optimistic, redis-atomic), which may overlap` : "") +
    (handed ? ` · pale: ${handed} section(s) whose lock was handed over within the replica (cohort), not acquired` : "") +
    (combined.length
      ? ` · ${combined.length} section(s) sold ${combined.reduce((n, s) => n + s.orders, 0)} orders combined (hover for each one's count)`
      : "") +
    (staleSales ? ` · striped: ${staleSales} stale holder(s) sold after their lock had gone` : "") +
    (lostToFailover.some(Boolean)
      ? ` · ${lostToFailover.filter(Boolean).length} of them lost the lock to the Redis failover (the promoted replica never had it)`
      : "");
}

// The SKUs most recently active first; a long tail of old SKUs is summarised.
const SKU_CARDS = 12;

function renderSkus(allSkus) {
  const skus = [...allSkus].sort((a, b) => Date.parse(b.updated_at) - Date.parse(a.updated_at)).slice(0, SKU_CARDS);
  const cards = skus.map((s) => {
    const verdict = s.oversold > 0
      ? el("p", { class: "verdict bad oversold" }, `⚠ OVERSOLD by ${s.oversold}: ${s.orders} orders for ${s.initial_stock} units`)
      : el("p", { class: "verdict ok oversold" }, "✓ Not oversold");
    const d = s.duplicates || {};
    const repeats = d.repeat_orders || 0;
    const broken = (d.orders_sharing_key || 0) + (d.units_over_limit || 0);
    // Counted by the service from MySQL's orders; the crowd's shoppers each mean one order.
    const duplicates = repeats + broken > 0
      ? el("p", { class: "verdict bad duplicates" },
          `⚠ ${repeats} repeat order(s): a user's orders beyond their first` +
          (d.orders_sharing_key ? `; ${d.orders_sharing_key} sharing a key` : "") +
          (d.units_over_limit ? `; ${d.units_over_limit} unit(s) over the limit` : ""))
      : el("p", { class: "verdict ok duplicates" }, "✓ No duplicate orders");
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
      verdict, duplicates, consistency);
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

// ---- replicas: alive, gone and back -----------------------------------------------

// A replica beats once a second; one not heard from for this long is probably down
// (the registry forgets it after 5 s).
const SILENT_AFTER_MS = 3000;
// A replica gone from the registry stays in the table, marked gone, this long.
const GONE_KEPT_MS = 120000;
const REPLICA_EVENTS = 8;

function renderReplicas(replicas, at) {
  const now = Date.parse(at);
  trackReplicas(replicas, now);
  state.replicasAt = now;
  drawReplicas();
}

// Compares a snapshot's replicas with what the page knew: one listed with a new start
// time was restarted (by its supervisor), one no longer listed is gone. (Process ids
// are shown only where the replica shows them: with an admin token set, it does not.) Each change goes to
// the list of events under the table, so a restart quicker than a snapshot still shows.
function trackReplicas(replicas, now) {
  const listed = new Set(replicas.map((r) => r.id));
  for (const r of replicas) {
    const known = state.replicas.get(r.id);
    const sameProcess = Boolean(known) && known.info.started_at === r.started_at;
    if (known && !sameProcess) {
      const sinceKill = known.killed ? `, ${span(Date.now() - known.killed.at)} after the kill` : "";
      logReplicaEvent(`${r.id} is back` + (r.pid ? ` as pid ${r.pid}` : "") +
        (r.restarts ? `, restarted ${r.restarts}×` : "") + `${sinceKill}.`);
    } else if (known && known.goneSince) {
      logReplicaEvent(`${r.id}${pidText(r.pid)} is heard from again.`);
    }
    state.replicas.set(r.id, {
      info: r,
      at: now,
      // A new process starts counting its requests from zero: no rate for it yet.
      rate: sameProcess && now > known.at ? (r.requests - known.info.requests) / ((now - known.at) / 1000) : null,
      killed: sameProcess ? known.killed : null,
      goneSince: null,
    });
  }
  for (const [id, known] of state.replicas) {
    if (listed.has(id)) continue;
    if (!known.goneSince) {
      known.goneSince = now;
      logReplicaEvent(`${id}${pidText(known.info.pid)} is gone: no heartbeat for 5 s.`);
    } else if (now - known.goneSince > GONE_KEPT_MS) {
      state.replicas.delete(id);
    }
  }
}

// " (pid N)", or nothing where the replica does not show its process id.
function pidText(pid) {
  return pid ? ` (pid ${pid})` : "";
}

// The kill button hit `id`: the table says so at once, until a snapshot shows the
// replica back as a new process (or gone from the registry).
function noteKilled(id, pid) {
  const known = state.replicas.get(id);
  if (known && (!known.info.pid || known.info.pid === pid)) known.killed = { pid, at: Date.now() };
  logReplicaEvent(`${id} (pid ${pid}) was sent kill -9 from this page.`);
  drawReplicas();
}

function drawReplicas() {
  const now = state.replicasAt;
  const rows = [...state.replicas.entries()]
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([id, known]) => replicaRow(id, known, now));
  document.querySelector("#replicas tbody").replaceChildren(...rows);
}

function replicaRow(id, known, now) {
  const r = known.info;
  const status = replicaStatus(known, now);
  return el("tr", { dataset: { replica: id }, class: status.down ? "gone" : "" },
    el("td", {}, id), el("td", {}, r.address),
    el("td", {}, status.down ? "–" : fmt(known.rate)),
    el("td", {}, status.down ? "–" : r.lock_waiters), el("td", {}, r.requests),
    el("td", { class: status.bad ? "restarts bad" : "restarts" }, status.text));
}

// What the last column says of a replica: up, and how often its supervisor restarted
// it; or why it is not up.
function replicaStatus(known, now) {
  const r = known.info;
  const silence = now - Date.parse(r.last_seen);
  const heard = `last heartbeat ${duration(silence / 1000)} ago`;
  if (known.goneSince) {
    const why = [r.pid ? `pid ${r.pid}` : "", known.killed ? "killed from this page" : ""].filter(Boolean);
    return { down: true, bad: true, text: `gone${why.length ? ` (${why.join(", ")})` : ""} · ${heard}` };
  }
  if (known.killed) return { down: true, bad: true, text: `killed (pid ${known.killed.pid}), waiting for its supervisor · ${heard}` };
  if (silence > SILENT_AFTER_MS) return { down: true, bad: true, text: `silent, down? · ${heard}` };
  const up = `up ${duration((now - Date.parse(r.started_at)) / 1000)}`;
  return { down: false, bad: r.restarts > 0, text: r.restarts ? `restarted ${r.restarts}× · ${up}` : up };
}

function logReplicaEvent(text) {
  const list = document.getElementById("replica-events");
  list.querySelectorAll("li.muted").forEach((placeholder) => placeholder.remove());
  list.prepend(el("li", {}, el("time", {}, new Date().toLocaleTimeString()), ` ${text}`));
  while (list.children.length > REPLICA_EVENTS) list.lastElementChild.remove();
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
    // A live region: set only when the words change, so it is announced once.
    const words = status.running ? "A load test is running; its progress streams below." : "Runs the built load test against every replica alive.";
    if (text.textContent !== words) text.textContent = words;
  }
  const log = document.getElementById("loadtest-log");
  if (!log.textContent && status.recent.length) log.textContent = status.recent.join("\n") + "\n";
}

// ---- live feed ------------------------------------------------------------------

// Snapshots come once a second: after this long without one, the page asks the
// replica why (GET /healthz) and says so.
const STALE_AFTER_MS = 3000;
// A feed silent this long while the replica and its backends are fine is reopened.
const STALLED_AFTER_MS = 10000;
const MAX_RETRY_S = 15;

// Opens the feed. The browser reconnects a dropped stream by itself, but gives up for
// good when an answer is not an event stream (a 502 from a proxy, a replica that
// answered 503): then the page reopens it, waiting longer each time, up to 15 s.
function connect() {
  const feed = state.feed;
  if (feed.source) feed.source.close();
  const source = new EventSource("/api/events");
  feed.source = source;
  source.addEventListener("open", () => {
    if (!state.lastSnapshotAt) setFeedState("connected, waiting for the first update…", false);
  });
  source.addEventListener("snapshot", (event) => {
    feed.retryIn = 1;
    setFeedState("live", false);
    onSnapshot(JSON.parse(event.data));
  });
  source.addEventListener("loadtest", (event) => appendLog(event.data));
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) reconnectLater();
    diagnose();
  });
}

function reconnectLater() {
  const feed = state.feed;
  clearTimeout(feed.retryTimer);
  feed.retryTimer = setTimeout(connect, feed.retryIn * 1000);
  feed.retryIn = Math.min(feed.retryIn * 2, MAX_RETRY_S);
}

// The calm status (a live region): changed only when the feed's state changes.
function setFeedState(text, down) {
  const node = document.getElementById("connection");
  if (node.textContent !== text) node.textContent = text;
  node.classList.toggle("down", down);
  state.feed.down = down;
}

// Why no update comes, in words: the replica does not answer, or it answers but a
// backend fails (its /healthz names which, and the error), or all is well and the
// stream itself stalled (then it is reopened).
async function diagnose() {
  const feed = state.feed;
  if (feed.diagnosing) return;
  feed.diagnosing = true;
  feed.diagnosedAt = Date.now();
  try {
    const { text, healthy } = await healthReason();
    // A snapshot that arrived meanwhile has the last word.
    if (Date.now() - state.lastSnapshotAt < STALE_AFTER_MS) return;
    setFeedState(text, true);
    // All is well but nothing comes: the stream itself stalled, so open a new one.
    const silence = Date.now() - (state.lastSnapshotAt || feed.openedAt);
    if (healthy && silence > STALLED_AFTER_MS && feed.source.readyState !== EventSource.CONNECTING) connect();
  } finally {
    feed.diagnosing = false;
  }
}

const BACKEND_NAMES = { redis: "Redis", mysql: "MySQL" };

async function healthReason() {
  let response;
  try {
    response = await fetch("/healthz", { cache: "no-store", signal: AbortSignal.timeout(3000) });
  } catch {
    return { text: `down: the replica at ${location.host} does not answer; retrying…`, healthy: false };
  }
  const health = await response.json().catch(() => null);
  if (!health || !Array.isArray(health.backends)) {
    return { text: `down: the replica answers ${response.status} without a health report; retrying…`, healthy: false };
  }
  const failing = health.backends.filter((backend) => !backend.ok);
  if (!failing.length) {
    return { text: `reconnecting: replica ${health.replica} and its backends are up, but no update came`, healthy: true };
  }
  const what = failing.map((b) => `${BACKEND_NAMES[b.name] || b.name} failing (${b.error || "no answer"})`).join(", ");
  return { text: `down: replica ${health.replica} up but ${what}; retrying…`, healthy: false };
}

// The ticker beside the status (not a live region): how old the page's figures are.
// A stale feed is diagnosed again every few seconds until it recovers.
function watchFeed() {
  const age = document.getElementById("connection-age");
  setInterval(() => {
    const silence = Date.now() - (state.lastSnapshotAt || state.feed.openedAt);
    if (state.lastSnapshotAt) {
      age.textContent = state.feed.down ? `last update ${duration(silence / 1000)} ago` : `updated ${(silence / 1000).toFixed(1)} s ago`;
    }
    if (silence > STALE_AFTER_MS && Date.now() - (state.feed.diagnosedAt || 0) > STALE_AFTER_MS) diagnose();
  }, 500);
}

async function main() {
  setUpControls();
  state.feed.openedAt = Date.now();
  connect();
  watchFeed();
  await loadStrategies().catch((error) => say(`Cannot load strategies: ${error.message}`, true));
  await Promise.all([loadHistory(), refreshLoadTestStatus()]).catch((error) => say(error.message, true));
}

main();
