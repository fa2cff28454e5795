// What the browser tests share: Debian's headless chromium driven by playwright-core,
// a page that collects its errors, and waits that always end (every wait here is
// bounded, so a broken page fails the test instead of hanging it).
import { chromium } from "playwright-core";

const WAIT_MS = 10000;

export async function openBrowser(viewport = { width: 1400, height: 1000 }) {
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run"],
  });
  const page = await browser.newPage({ viewport });
  // Errors the page reports; a test that provokes some on purpose sets `expected`.
  const problems = [];
  const errors = { expected: null };
  page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
  page.on("console", (message) => {
    if (message.type() !== "error") return;
    if (errors.expected && errors.expected.test(message.text())) return;
    problems.push(`console: ${message.text()}`);
  });
  return { browser, page, problems, errors };
}

export const step = (what) => console.log(`- ${what}`);

// Waits until `locator` shows `text`. A string must be the element's whole text ("0"
// does not match "10"); a RegExp may match part of it.
export async function expectText(locator, text, what, timeout = WAIT_MS) {
  const pattern = typeof text === "string"
    ? new RegExp(`^\\s*${text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}\\s*$`) : text;
  await locator.filter({ hasText: pattern }).first().waitFor({ timeout })
    .catch(async () => {
      const shown = await locator.first().textContent({ timeout: 1000 }).catch(() => "nothing");
      throw new Error(`${what}: expected ${pattern}, page shows "${shown}"`);
    });
}

// Polls `check` (an async function returning a truthy value when done) every 100 ms for
// at most `timeout` ms; returns its last value or throws with `what`.
export async function eventually(check, what, timeout = WAIT_MS) {
  const deadline = Date.now() + timeout;
  let last;
  while (Date.now() < deadline) {
    last = await check();
    if (last) return last;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  throw new Error(`${what}: not within ${timeout} ms (last: ${JSON.stringify(last)})`);
}

export async function getJson(url) {
  const response = await fetch(url, { signal: AbortSignal.timeout(WAIT_MS) });
  if (!response.ok) throw new Error(`GET ${url}: ${response.status}`);
  return response.json();
}

export async function postJson(url, body) {
  const response = await fetch(url, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
    signal: AbortSignal.timeout(WAIT_MS),
  });
  if (!response.ok) throw new Error(`POST ${url}: ${response.status} ${await response.text()}`);
  return response.status === 204 ? null : response.json();
}
