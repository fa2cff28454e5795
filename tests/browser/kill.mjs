// The kill button in Debian's headless chromium: a pause (timed by the page from the
// replica's lease) keeps a lock holder holding, `#kill-holder` sends it kill -9, and the
// replica list shows it gone, then back under a new pid, restarted once by its
// supervisor. PAGE_URL serves the page; HOLDER_URL is the replica run by
// `flashsale cluster` (tests/integration/dashboard.rs starts both).
// Usage: node kill.mjs PAGE_URL HOLDER_URL SCREENSHOT.png
import { expectText, getJson, openBrowser, step } from "./lib.mjs";

const [base, holderUrl, screenshot] = process.argv.slice(2);
if (!base || !holderUrl || !screenshot) {
  console.error("usage: node kill.mjs PAGE_URL HOLDER_URL SCREENSHOT.png");
  process.exit(2);
}

const SKU = "doomed";
const { browser, page, problems } = await openBrowser();
const row = (replica) => page.locator(`#replicas tr[data-replica="${replica}"]`);
const pidOf = async (replica) => (await getJson(`${base}/api/stats`)).replicas.find((r) => r.id === replica)?.pid;

try {
  step("open the page: both replicas alive, the walkthrough timed for the 4 s lease");
  await page.goto(base);
  await expectText(page.locator("#connection"), "live", "live feed");
  await expectText(row("replica-1").locator("td.restarts"), /^up \d+ s$/, "replica-1 up");
  await expectText(row("replica-2").locator("td.restarts"), /^up \d+ s$/, "replica-2 up", 15000);
  // The holder runs with the page replica's settings, so the page's timings hold for it.
  const holderStats = await getJson(`${holderUrl}/api/stats`);
  if (holderStats.lock_lease_ms !== 4000) throw new Error(`the holder's lease is ${holderStats.lock_lease_ms} ms`);
  await expectText(page.locator("#walkthrough"), /\(lease 4 s, lock wait 5 s, work 50 ms\): the pause lasts 7\.5 s/,
    "timings shown");

  step("redis-lock (its lock names the holder), SKU doomed restocked");
  await page.selectOption("#strategy-select", "redis-lock");
  await page.click("#switch-strategy");
  await expectText(page.locator("#active-strategy"), "redis-lock", "active strategy");
  await page.fill("#reset-sku", SKU);
  await page.fill("#reset-stock", "5");
  await page.click("#reset-button");
  await expectText(page.locator(`#sku-cards [data-sku="${SKU}"] .stock-redis`), "5", "restocked");

  step("arm the pause, and one shopper buys from the supervised replica: it holds the lock");
  await page.click("#pause-holder");
  await expectText(page.locator("#control-message"), /will pause 7\.5 s after its last lock check/, "armed");
  // The order never gets an answer: its replica dies holding the lock.
  fetch(`${holderUrl}/api/orders`, {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ sku: SKU, user_id: "doomed-shopper", quantity: 1 }), signal: AbortSignal.timeout(30000),
  }).catch(() => {});
  await expectText(page.locator(`#lock-views [data-sku="${SKU}"] dd`).first(), "replica-2", "replica-2 holds the lock");
  const doomedPid = await pidOf("replica-2");

  step("kill the holder: replica-2 shows as killed, then back, restarted once");
  await page.click("#kill-holder");
  await expectText(page.locator("#control-message"), new RegExp(`^kill -9 sent to replica-2 \\(pid ${doomedPid}\\)`),
    "the kill");
  await expectText(page.locator(`#replicas tr.gone[data-replica="replica-2"] td.restarts`),
    new RegExp(`^killed \\(pid ${doomedPid}\\), waiting for its supervisor`), "replica-2 gone");
  await expectText(page.locator(`#replicas tr:not(.gone)[data-replica="replica-2"] td.restarts`),
    /^restarted 1× · up \d+ s$/, "replica-2 back", 20000);
  const newPid = await pidOf("replica-2");
  if (!newPid || newPid === doomedPid) throw new Error(`replica-2's pid: ${doomedPid} before, ${newPid} after`);
  await expectText(page.locator("#replica-events li").first(),
    new RegExp(`replica-2 is back as pid ${newPid}, restarted 1×, [\\d.]+ m?s after the kill\\.$`), "the event");
  await expectText(row("replica-1").locator("td.restarts"), /^up \d+ s$/, "replica-1 served on");

  if (problems.length) throw new Error(problems.join("\n"));
  // From the buttons to the list of events: the kill, its message and the return.
  // (Bounding boxes are relative to the viewport, a full-page clip to the page.)
  const scrolled = await page.evaluate(() => window.scrollY);
  const top = await page.locator("#controls").boundingBox();
  const bottom = await page.locator("#replica-events").boundingBox();
  await page.screenshot({
    path: screenshot, fullPage: true,
    clip: { x: 0, y: top.y + scrolled, width: 1400, height: bottom.y + bottom.height - top.y + 16 },
  });
  console.log(`kill test passed; screenshot ${screenshot}`);
} catch (error) {
  await page.screenshot({ path: screenshot, fullPage: true }).catch(() => {});
  console.error(`kill test FAILED: ${error.message}\n(screenshot ${screenshot})`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
