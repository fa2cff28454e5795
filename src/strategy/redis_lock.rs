//! `redis-lock`: the order flow under a Redis lease lock (`lock::redis`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "redis-lock",
        title: "Redis lease lock (Redisson-style)",
        summary: "A replica takes the SKU's lock with SET NX PX and a token unique to this \
                  acquisition, runs the order flow, and releases with a Lua \
                  compare-and-delete so it can never delete someone else's lock. A \
                  watchdog renews the lease every ttl/3 while the holder works. Waiters \
                  sleep until the release is published (one waiter per replica wakes), \
                  or until the lock's TTL runs out if the holder crashed.",
        commands: vec![
            "SET <ns>:lock:<sku> <token> NX PX <lease>   (else PTTL to know when to retry)",
            "watchdog: if GET key == token then PEXPIRE key <lease>   (Lua, every lease/3)",
            "before commit: the same compare-and-PEXPIRE; 0 means the lock was lost",
            "release: if GET key == token then DEL key; PUBLISH <ns>:lock-released:<sku>   (Lua)",
            "waiters: PSUBSCRIBE <ns>:lock-released:*",
        ],
        failure_mode: "A holder that stalls longer than the lease (GC or VM pause, a stopped \
                       watchdog) loses the lock while still believing it holds it; another \
                       replica takes it and both write. Checking before commit narrows the \
                       window; only a fencing token closes it, and only if it covers the \
                       read: registered in MySQL before the stock is read, and the write \
                       lands only while it is still the fence and the stock read is MySQL's. A Redis failover can also \
                       lose a lock that was not yet replicated.",
    }
}
