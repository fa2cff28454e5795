-- wrk script for scripts/bench.sh: every request buys one unit of $BENCH_SKU as a new
-- shopper. $BENCH_WORKER tells the wrk processes apart (each runs one thread).
local sku = os.getenv("BENCH_SKU") or "bench-hot"
local worker = os.getenv("BENCH_WORKER") or "0"
local counter = 0

function request()
  counter = counter + 1
  local body = string.format('{"sku":"%s","user_id":"w%s-%d","quantity":1}', sku, worker, counter)
  return wrk.format("POST", "/api/orders", { ["Content-Type"] = "application/json" }, body)
end
