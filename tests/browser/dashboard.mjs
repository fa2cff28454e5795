// Drives the dashboard in Debian's headless chromium against a running replica:
// switch the cohort layer off and on, switch the strategy, reset a SKU, place orders, play the paused-holder walkthrough
// with the timings the page derives from the replica's settings, make `none` oversell,
// lose and regain the live feed, compare strategies after a run, and lay the page out
// on a phone. Screenshots go beside SCREENSHOT.png (race-locked.png, race-none.png,
// comparison.png, phone.png). Usage: node dashboard.mjs BASE_URL SCREENSHOT.png
import { eventually, expectText, getJson, openBrowser, postJson, step } from "./lib.mjs";

const [base, screenshot] = process.argv.slice(2);
if (!base || !screenshot) {
  console.error("usage: node dashboard.mjs BASE_URL SCREENSHOT.png");
  process.exit(2);
}

const { browser, page, problems, errors } = await openBrowser();
const card = (sku, field) => page.locator(`#sku-cards [data-sku="${sku}"] .${field}`);
const shot = async (selector, file) => {
  await page.locator(selector).screenshot({ path: screenshot.replace(/dashboard\.png$/, file) });
};

// Reads "6.5 s" or "50 ms" back into milliseconds.
const ms = (text) => (text.endsWith("ms") ? Number.parseFloat(text) : Number.parseFloat(text) * 1000);

try {
  step("open the page and wait for the live feed");
  await page.goto(base);
  await page.locator("#strategy-select option").first().waitFor({ state: "attached" });
  await expectText(page.locator("#connection"), "live", "live feed");

  step("only the calm status is a live region, not the ticker beside it");
  const live = await page.locator("[aria-live]").evaluateAll((nodes) => nodes.map((n) => n.id));
  if (live.includes("connection-age") || live.includes("loadtest-log") || !live.includes("connection")) {
    throw new Error(`live regions: ${live.join(", ")}`);
  }

  step("the replica list shows the replica's restarts (tests/integration/dashboard.rs says 2)");
  await expectText(page.locator("#replicas [data-replica=replica-1] td.restarts"), /^restarted 2× · up \d+ s$/,
    "restarts");

  step("the walkthrough's timings come from the replica's settings (10 s lease by default)");
  const stats = await getJson(`${base}/api/stats`);
  if (stats.lock_lease_ms !== 10000 || stats.lock_wait_ms !== 5000 || stats.work_ms !== 50) {
    throw new Error(`GET /api/stats timing: ${stats.lock_lease_ms}, ${stats.lock_wait_ms}, ${stats.work_ms}`);
  }
  await expectText(page.locator("#walkthrough"), /\(lease 10 s, lock wait 5 s, work 50 ms\)/, "timings shown");
  const text = await page.locator("#walkthrough").textContent();
  const [, pause] = text.match(/the pause lasts ([\d.]+ m?s)/);
  const [, earliest, latest] = text.match(/between ([\d.]+ m?s) and ([\d.]+ m?s) later/);
  // The second shopper's lock wait must reach past the lease's end, and the pause past
  // the lease and the window.
  if (!(ms(earliest) + stats.lock_wait_ms > stats.lock_lease_ms + stats.work_ms) ||
      !(ms(pause) > ms(latest) && ms(latest) > ms(earliest) && ms(earliest) > stats.lock_lease_ms + stats.work_ms - stats.lock_wait_ms)) {
    throw new Error(`walkthrough timings do not fit the settings: ${text}`);
  }

  step("the cohort switch is on by default; the page switches it off and on again for the cluster");
  const cohortBox = page.locator("#cohort-toggle");
  await expectText(page.locator("#cohort-state"), /^on: /, "cohort on by default");
  if (!(await cohortBox.isChecked())) throw new Error("the cohort box is not checked while the layer is on");
  await cohortBox.uncheck();
  await eventually(async () => (await getJson(`${base}/api/admin/cohort`)).enabled === false, "cohort off in the API");
  await expectText(page.locator("#cohort-state"), /^off: /, "cohort off shown");
  await expectText(page.locator("#control-message"), /^Cohort off: /, "the page says what it did");
  await cohortBox.check();
  await eventually(async () => (await getJson(`${base}/api/admin/cohort`)).enabled === true, "cohort on again in the API");
  await expectText(page.locator("#cohort-state"), /^on: /, "cohort on shown");

  step("switch to redis-lock");
  await page.selectOption("#strategy-select", "redis-lock");
  // A live snapshot (one a second) arrives before the click: it must not undo the
  // choice, as it once did.
  await page.waitForTimeout(1500);
  await page.click("#switch-strategy");
  await expectText(page.locator("#active-strategy"), "redis-lock", "active strategy");
  const active = await getJson(`${base}/api/admin/strategy`);
  if (active.strategy !== "redis-lock") throw new Error(`API says ${active.strategy}`);

  step("reset SKU browser to 5 units");
  await page.fill("#reset-sku", "browser");
  await page.fill("#reset-stock", "5");
  await page.click("#reset-button");
  await expectText(card("browser", "stock-redis"), "5", "Redis stock after reset");
  await expectText(card("browser", "orders"), "0", "orders after reset");

  step("three shoppers buy at once under redis-lock");
  await page.fill("#buy-sku", "browser");
  await page.fill("#buy-count", "3");
  await page.click("#buy-button");
  await expectText(card("browser", "orders"), "3", "orders");
  await expectText(card("browser", "stock-redis"), "2", "Redis stock");
  await expectText(card("browser", "stock-mysql"), "2", "MySQL stock");
  await expectText(card("browser", "oversold"), /Not oversold/, "verdict");
  await expectText(card("browser", "duplicates"), /No duplicate orders/, "no duplicates");

  step("double clicks: three shoppers buy twice without a key, once with one");
  await page.fill("#reset-sku", "clicks");
  await page.fill("#reset-stock", "20");
  await page.click("#reset-button");
  await expectText(card("clicks", "orders"), "0", "clicks restocked");
  await page.fill("#buy-sku", "clicks");
  await page.check("#buy-double-click");
  await page.click("#buy-button");
  await expectText(card("clicks", "orders"), "6", "two orders per shopper");
  await expectText(card("clicks", "duplicates"), /3 repeat order\(s\)/, "the duplicates, from the records");
  await page.click("#reset-button");
  await expectText(card("clicks", "orders"), "0", "clicks restocked again");
  await page.check("#buy-key");
  await page.click("#buy-button");
  await expectText(page.locator("#control-message"), /double-clicking, with keys/, "the crowd said how it bought");
  await expectText(card("clicks", "orders"), "3", "one order per shopper");
  await expectText(card("clicks", "duplicates"), /No duplicate orders/, "no duplicates with keys");
  await page.uncheck("#buy-double-click");
  await page.uncheck("#buy-key");
  await page.fill("#buy-sku", "browser");
  await expectText(page.locator("#key-card"), /a UNIQUE column,\s+in the same\s+transaction as the\s+stock\s+decrement/,
    "the card on the key");

  step("the race under redis-lock: sections one after another");
  await expectText(page.locator("#race-legend"), /^0 of 3 sections overlap/, "no overlap under a lock");
  await shot("#race", "race-locked.png");
  await expectText(page.locator("#lock-views [data-sku=browser] h3"), "browser", "lock view");

  step("the paused-holder walkthrough with the 10 s lease: the second shopper sells, the unit is sold twice");
  await page.fill("#reset-sku", "walk");
  await page.fill("#reset-stock", "1");
  await page.click("#reset-button");
  await expectText(card("walk", "stock-redis"), "1", "walk restocked");
  await page.fill("#buy-count", "1");
  await page.click("#pause-holder");
  await expectText(page.locator("#control-message"), new RegExp(`will pause ${pause.replace(".", "\\.")} after its last lock check`),
    "the pause the page computed");
  const armed = await getJson(`${base}/api/stats`);
  if (!(armed.pause_armed_ms > armed.lock_lease_ms)) throw new Error(`armed ${armed.pause_armed_ms} ms, not past the lease`);
  await page.click("#buy-button");  // the first shopper: it takes the lock and stalls
  await expectText(page.locator("#walkthrough-clock"), /^Second shopper: wait/, "the clock counts down");
  // The window opens `earliest` after the first buy (6.5 s here).
  await expectText(page.locator("#walkthrough-clock"), /^Second shopper: buy now/, "the window opens", ms(earliest) + 3000);
  await page.click("#buy-button");  // the second: it waits for the lock past the lease's end
  await expectText(card("walk", "oversold"), /OVERSOLD by 1/, "the stale holder's late write", ms(pause) + 10000);
  const walked = (await getJson(`${base}/api/stats?sku=walk`)).skus[0];
  if (walked.orders !== 2) throw new Error(`walk: ${JSON.stringify(walked)}`);
  step("the timeline marks the stale holder: its section runs past the next holder's start");
  await expectText(page.locator("#race-legend"), /striped: 1 stale holder\(s\) sold after their lock had gone/,
    "the stale holder on the timeline");
  await shot("#race", "race-stale.png");

  step("switch to none, restock 5, twenty shoppers at once: oversold");
  await page.selectOption("#strategy-select", "none");
  await page.click("#switch-strategy");
  await expectText(page.locator("#active-strategy"), "none", "active strategy");
  await page.fill("#reset-sku", "browser");
  await page.fill("#reset-stock", "5");
  await page.click("#reset-button");
  await expectText(card("browser", "orders"), "0", "orders after reset");
  await page.fill("#buy-count", "20");
  await page.click("#buy-button");
  await expectText(card("browser", "oversold"), /OVERSOLD by/, "oversold verdict");

  step("the race under none: sections of the crowd overlap");
  await expectText(page.locator("#race-legend"), /^[1-9]\d* of \d+ sections overlap/, "overlap under none");
  await shot("#race", "race-none.png");

  step("the live feed fails: the page says why (the replica's /healthz), then comes back by itself");
  // The feed is refused and /healthz reports Redis down, as a replica that lost Redis
  // would; the browser logs those failed loads, which are expected here.
  errors.expected = /Failed to load resource|EventSource/;
  await page.route("**/api/events", (route) => route.abort("connectionrefused"));
  await page.route("**/healthz", (route) => route.fulfill({
    status: 503, contentType: "application/json",
    body: JSON.stringify({ status: "degraded", replica: "replica-1", backends: [
      { name: "redis", ok: false, latency_ms: 1000.0, error: "no answer within 1s" },
      { name: "mysql", ok: true, latency_ms: 1.0, error: null }] }),
  }));
  await page.reload();
  await expectText(page.locator("#connection"), /^down: replica replica-1 up but Redis failing \(no answer within 1s\)/,
    "the reason the feed is down");
  await page.unrouteAll();
  await expectText(page.locator("#connection"), "live", "the feed back", 20000);
  errors.expected = null;

  step("learning cards");
  const strategies = await getJson(`${base}/api/strategies`);
  const cards = await page.locator("#strategy-cards .card").count();
  if (cards !== strategies.length) throw new Error(`${cards} strategy cards for ${strategies.length} strategies`);

  step("two runs in the history: the latest compared strategy by strategy, both as trends");
  const run = (strategy, ordersPerS, p50, p99, oversold, repeat = 1, stock = 200, repeats = 0) => ({
    strategy, repeat, requests: 260, orders: 200 + oversold, orders_acknowledged: 200 + oversold, sold_out: 60,
    busy: 0, errors: 0, duration_s: 1.5, sell_out_s: 1.0, rps: 170.0, orders_per_s: ordersPerS,
    latency_ms: { p50, p90: p99 * 0.8, p99, max: p99 * 1.2 }, initial_stock: stock, oversold,
    stock_redis: 0, stock_mysql: 0, consistent: oversold === 0,
    duplicates: { orders_sharing_key: 0, repeat_orders: repeats, units_over_limit: 0 },
  });
  const report = (minutesAgo, config, runs) => ({
    generated_at: new Date(Date.now() - minutesAgo * 60000).toISOString(),
    config: { targets: [base], max_seconds: 30, grace_ms: 1000, strategies: runs.map((r) => r.strategy), ...config },
    runs,
  });
  await postJson(`${base}/api/runs`, report(30, { users: 20, stock: 200, skus: 1, fault: null, fencing: false },
    [run("none", 900, 2.0, 9.0, 35), run("redis-lock", 400, 8.0, 40.0, 0), run("redlock", 250, 12.0, 70.0, 0, 1, 400)]));
  // The latest ran each strategy twice (`--repeat 2`): a strategy's bars show its
  // median and range, its oversold the worse run.
  await postJson(`${base}/api/runs`, report(1, { users: 60, stock: 200, skus: 1, fault: "pause-holder", fencing: true, repeat: 2 },
    [run("none", 1200, 1.5, 6.0, 140), run("redis-lock", 850, 10.0, 55.0, 0), run("redlock", 300, 20.0, 120.0, 0),
     run("db-for-update", 500, 15.0, 80.0, 0),
     run("none", 1100, 1.5, 6.0, 120, 2, 200, 7), run("redis-lock", 750, 10.0, 55.0, 0, 2), run("redlock", 300, 20.0, 100.0, 0, 2),
     run("db-for-update", 500, 15.0, 80.0, 0, 2)]));
  await page.reload();
  await expectText(page.locator("#comparison-settings"),
    // A report without the keys' fields was made by a load test that sent none.
    /: 60 shoppers · 200 units × 1 SKU · each strategy 2× · fencing on · fault: pause-holder · no keys\.$/,
    "the latest run's settings");
  const bars = (chart) => page.locator(`#compare-${chart} .bar-group`);
  if (await bars("orders").count() !== 4) throw new Error(`${await bars("orders").count()} strategies compared, not 4`);
  await expectText(page.locator("#compare-orders [data-strategy=redis-lock] .bar-value"), "800 (750–850)", "orders/s of redis-lock");
  await expectText(page.locator("#compare-latency [data-strategy=redlock] .bar-value"), "110.0 (100.0–120.0) p99", "p99 of redlock");
  await expectText(page.locator("#compare-oversold [data-strategy=none] .bar-value"), "140 OVERSOLD", "none oversold");
  await expectText(page.locator("#compare-oversold [data-strategy=redis-lock] .bar-value"), "0 ✓", "redis-lock not oversold");
  await expectText(page.locator("#compare-duplicates [data-strategy=none] .bar-value"), "7 DUPLICATE",
    "none's duplicates, its worse run's");
  await expectText(page.locator("#compare-duplicates [data-strategy=redis-lock] .bar-value"), "0 ✓", "redis-lock's none");
  // The bars are drawn to scale: a bar fills the share of its track that its value is
  // of the chart's largest (redis-lock's median 800 orders/s against none's 1150).
  const share = (chart, strategy, nth = 0) => page.locator(`#compare-${chart} [data-strategy=${strategy}] .bar`).nth(nth)
    .evaluate((bar) => bar.getBoundingClientRect().width / bar.parentElement.clientWidth);
  const orderShare = await share("orders", "redis-lock");
  if (Math.abs(orderShare - 800 / 1150) > 0.02) throw new Error(`redis-lock's orders/s bar fills ${orderShare}`);
  if (Math.abs((await share("latency", "redlock", 1)) - 1) > 0.02) throw new Error("redlock's p99 is not the longest latency bar");
  if (Math.abs((await share("latency", "redlock", 0)) - 20 / 110) > 0.02) throw new Error("redlock's p50 bar out of scale");
  // The trends: one chart per figure, a run per tick, every run listed with its settings.
  if (await page.locator("#trends").isHidden()) throw new Error("trends hidden with two runs");
  if (await page.locator("#trends canvas").count() < 3) throw new Error("no trend charts");
  await expectText(page.locator("#run-labels li").first(), /^#\d+ 20 shoppers · 200 units × 1 SKU \(redlock: 400\) · fencing off · no fault · no keys: none, redis-lock, redlock$/,
    "the older run's settings, redlock's stock from its record (--stock-for)");
  await expectText(page.locator("#run-labels li").nth(1), /^#\d+ 60 shoppers .* fault: pause-holder · no keys: none, redis-lock, redlock, db-for-update$/,
    "the newer run's settings");
  await expectText(page.locator("#history-table tbody tr td:nth-child(2)").first(), /^60 shoppers/, "settings in the table");
  await expectText(page.locator("#history-table tbody tr td:nth-child(3)").first(), "none (1 of 2)", "a repeated run in the table");
  await page.locator("#history").scrollIntoViewIfNeeded();
  await page.waitForTimeout(300);  // the charts' ResizeObserver settles
  await shot("#history", "comparison.png");

  step("a phone, 390×844: charts follow the width, nothing but the tables scrolls sideways");
  // The live rate chart is drawn from the second snapshot after the reload on.
  await page.locator("#rate-chart .uplot").waitFor();
  const rateWidth = () => page.locator("#rate-chart .uplot").evaluate((chart) => chart.getBoundingClientRect().width);
  const wide = await rateWidth();
  await page.setViewportSize({ width: 390, height: 844 });
  await eventually(() => page.evaluate(() => [...document.querySelectorAll(".uplot")]
    .every((chart) => chart.getBoundingClientRect().width <= chart.parentElement.clientWidth + 1)),
    "charts resized to their boxes");
  const narrow = await rateWidth();
  if (!(wide > 1000 && narrow < 390)) throw new Error(`the rate chart is ${wide} px wide, then ${narrow} px on the phone`);
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth);
  if (overflow > 390) throw new Error(`the page is ${overflow} px wide on a 390 px phone`);
  await page.evaluate(() => window.scrollTo(0, 0));
  await expectText(page.locator("#connection"), "live", "still live");
  await page.screenshot({ path: screenshot.replace(/dashboard\.png$/, "phone.png") });
  await page.setViewportSize({ width: 1400, height: 1000 });

  if (problems.length) throw new Error(problems.join("\n"));
  await page.screenshot({ path: screenshot, fullPage: true });
  console.log(`dashboard test passed; screenshot ${screenshot}`);
} catch (error) {
  await page.screenshot({ path: screenshot, fullPage: true }).catch(() => {});
  console.error(`dashboard test FAILED: ${error.message}\n(screenshot ${screenshot})`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
