-- wrk script for scripts/bench.sh: every request buys one unit of $BENCH_SKU as a new
-- shopper. $BENCH_WORKER tells the wrk processes apart (each runs one thread). With
-- BENCH_KEYED=1 each request carries an Idempotency-Key of its own ($BENCH_RUN keeps
-- keys of an earlier run, still stored, from being replayed).
local sku = os.getenv("BENCH_SKU") or "bench-hot"
local worker = os.getenv("BENCH_WORKER") or "0"
local keyed = os.getenv("BENCH_KEYED") == "1"
local run = os.getenv("BENCH_RUN") or "0"
local counter = 0

function request()
  counter = counter + 1
  local body = string.format('{"sku":"%s","user_id":"w%s-%d","quantity":1}', sku, worker, counter)
  local headers = { ["Content-Type"] = "application/json" }
  if keyed then
    headers["Idempotency-Key"] = string.format("%s-w%s-%d", run, worker, counter)
  end
  return wrk.format("POST", "/api/orders", headers, body)
end
