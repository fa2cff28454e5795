//! `redis-lock`: the order flow under a Redis lease lock (`lock::redis`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "redis-lock",
        title: "Redis lease lock (Redisson-style)",
        family: Family::LockService,
        summary: "A replica takes the SKU's key with SET NX PX and a token unique to this \
                  acquisition, runs the order, and deletes the key only if it still holds \
                  its token. A watchdog renews the lease while the holder works.",
        adds: "A fencing counter incremented in the acquiring script (restarting above \
               MySQL's fence if Redis lost it); an acquisition cancelled mid-SET undone on \
               the same connection; waiters woken by the release's message, with the \
               key's TTL as the fallback for a holder that crashed.",
        commands: vec![
            "acquire (Lua): SET <ns>:lock:<sku> <token> NX PX <lease>; if set, INCR <ns>:fence:<sku> \
             (the fencing token); else PTTL, the longest a waiter waits before trying again",
            "watchdog (Lua, every lease/3) and the check before commit: if GET key == token then \
             PEXPIRE key <lease>; 0 means the lock was lost",
            "release (Lua): if GET key == token then DEL key; PUBLISH <ns>:lock-channel:<sku> <token>",
            "waiters: SUBSCRIBE <ns>:lock-channel:<sku> (one pub/sub connection per replica), then \
             try again; on a message or once the PTTL ran out, try again",
            "with --redis-lock-wait-replicas N (off by default): WAIT N <timeout> after the SET; \
             fewer acknowledgements, and the key is released (compare-and-DEL) and the try counts \
             as refused",
        ],
        failure_mode: "A holder that stalls longer than the lease (GC or VM pause, a stopped \
                       watchdog) loses the lock while still believing it holds it; another \
                       replica takes it and both write. Checking before commit narrows the \
                       window. With fencing on, the token is registered in MySQL before the \
                       stock is read, and the write lands only while the stock read is still \
                       MySQL's (which alone refuses the double sale) and the token is still the \
                       SKU's newest (so the newest holder wins). A Redis failover loses a \
                       lock not yet replicated (asynchronous replication): the promoted replica \
                       never had it, and another replica takes it while the first holds \
                       (the dashboard's failover fault: the replica's link cut, then \
                       SENTINEL FAILOVER). WAIT keeps the lock through the failover of a \
                       replica that acknowledged it, not through the election of one that did \
                       not (Redisson issue 5256); fencing refuses the stale write either way.",
    }
}
