// Drives the dashboard in Debian's headless chromium against a running replica:
// switch the strategy, reset a SKU, place orders, make `none` oversell, and check that
// the page's numbers follow. Usage: node dashboard.mjs BASE_URL SCREENSHOT.png
import { chromium } from "playwright-core";

const [base, screenshot] = process.argv.slice(2);
if (!base || !screenshot) {
  console.error("usage: node dashboard.mjs BASE_URL SCREENSHOT.png");
  process.exit(2);
}

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
const problems = [];
page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
page.on("console", (message) => { if (message.type() === "error") problems.push(`console: ${message.text()}`); });

const step = (what) => console.log(`- ${what}`);
const card = (sku, field) => page.locator(`#sku-cards [data-sku="${sku}"] .${field}`);
// `text` as a string must be the element's whole text ("0" does not match "10"); a
// RegExp may match part of it.
const expectText = async (locator, text, what) => {
  const pattern = typeof text === "string"
    ? new RegExp(`^\\s*${text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}\\s*$`) : text;
  await locator.filter({ hasText: pattern }).first().waitFor({ timeout: 10000 })
    .catch(async () => { throw new Error(`${what}: expected ${pattern}, page shows "${await locator.first().textContent().catch(() => "nothing")}"`); });
};
const shot = async (selector, file) => {
  await page.locator(selector).screenshot({ path: screenshot.replace(/dashboard\.png$/, file) });
};

try {
  step("open the page and wait for the live feed");
  await page.goto(base);
  await page.locator("#strategy-select option").first().waitFor({ state: "attached" });
  await expectText(page.locator("#connection"), /live/, "live feed");

  step("the replica list shows the replica's restarts (tests/integration/dashboard.rs says 2)");
  await expectText(page.locator("#replicas [data-replica=replica-1] td.restarts"), /^restarted 2× · up \d+ s$/,
    "restarts");

  step("switch to redis-lock");
  await page.selectOption("#strategy-select", "redis-lock");
  // A live snapshot (one a second) arrives before the click: it must not undo the
  // choice, as it once did.
  await page.waitForTimeout(1500);
  await page.click("#switch-strategy");
  await expectText(page.locator("#active-strategy"), "redis-lock", "active strategy");
  const active = await (await fetch(`${base}/api/admin/strategy`)).json();
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

  step("the race under redis-lock: sections one after another");
  await expectText(page.locator("#race-legend"), /^0 of 3 sections overlap/, "no overlap under a lock");
  await shot("#race", "race-locked.png");
  await expectText(page.locator("#lock-views [data-sku=browser] h3"), "browser", "lock view");

  step("switch to none, restock 5, twenty shoppers at once: oversold");
  await page.selectOption("#strategy-select", "none");
  await page.click("#switch-strategy");
  await expectText(page.locator("#active-strategy"), "none", "active strategy");
  await page.fill("#reset-stock", "5");
  await page.click("#reset-button");
  await expectText(card("browser", "orders"), "0", "orders after reset");
  await page.fill("#buy-count", "20");
  await page.click("#buy-button");
  await expectText(card("browser", "oversold"), /OVERSOLD by/, "oversold verdict");

  step("the race under none: sections of the crowd overlap");
  await expectText(page.locator("#race-legend"), /^[1-9]\d* of \d+ sections overlap/, "overlap under none");
  await shot("#race", "race-none.png");

  step("learning cards and history are there");
  const strategies = await (await fetch(`${base}/api/strategies`)).json();
  const cards = await page.locator("#strategy-cards .card").count();
  if (cards !== strategies.length) throw new Error(`${cards} strategy cards for ${strategies.length} strategies`);
  // A run in the history shows as a row of its own (not the "No load test yet." row).
  const report = {
    generated_at: new Date().toISOString(),
    config: { targets: [base], users: 1, stock: 5, skus: 1, max_seconds: 1, grace_ms: 0,
              strategies: ["redlock"], fault: null, fencing: false },
    runs: [{ strategy: "redlock", requests: 6, orders: 5, orders_acknowledged: 5, sold_out: 1,
             busy: 0, errors: 0, duration_s: 1.0, sell_out_s: 0.5, rps: 6.0, orders_per_s: 10.0,
             latency_ms: { p50: 1.0, p90: 2.0, p99: 3.0, max: 4.0 }, initial_stock: 5, oversold: 0,
             stock_redis: 0, stock_mysql: 0, consistent: true }],
  };
  const saved = await fetch(`${base}/api/runs`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(report),
  });
  if (!saved.ok) throw new Error(`POST /api/runs: ${saved.status}`);
  await page.reload();
  await expectText(page.locator("#history-table tbody td"), "redlock", "the run in the history");

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
