-- wrk script for scripts/bench.sh: every request buys one unit as a new shopper, of
-- $BENCH_SKU, or with $BENCH_SKUS (a comma list) of the next SKU of the list in turn,
-- so a run's orders spread evenly over them. $BENCH_WORKER tells the wrk processes
-- apart (each runs one thread). With BENCH_KEYED=1 each request carries an
-- Idempotency-Key of its own ($BENCH_RUN keeps keys of an earlier run, still stored,
-- from being replayed).
local skus = {}
for sku in string.gmatch(os.getenv("BENCH_SKUS") or "", "[^,]+") do
  skus[#skus + 1] = sku
end
if #skus == 0 then
  skus[1] = os.getenv("BENCH_SKU") or "bench-hot"
end
local worker = os.getenv("BENCH_WORKER") or "0"
local keyed = os.getenv("BENCH_KEYED") == "1"
local run = os.getenv("BENCH_RUN") or "0"
local counter = 0

function request()
  counter = counter + 1
  local sku = skus[(counter - 1) % #skus + 1]
  local body = string.format('{"sku":"%s","user_id":"w%s-%d","quantity":1}', sku, worker, counter)
  local headers = { ["Content-Type"] = "application/json" }
  if keyed then
    headers["Idempotency-Key"] = string.format("%s-w%s-%d", run, worker, counter)
  end
  return wrk.format("POST", "/api/orders", headers, body)
end
