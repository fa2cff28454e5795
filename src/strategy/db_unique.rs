//! `db-unique`: the order flow under a lock-table row (`lock::table`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "db-unique",
        title: "Database unique-key lock table",
        family: Family::Database,
        summary: "The lock is a row in distributed_locks: the unique key on lock_name lets \
                  one INSERT per SKU succeed. The holder extends its expiry while it works \
                  and deletes its row when done; an expired row is taken over by its id.",
        adds: "A release notice on Redis instead of polling alone (a poll every 25-50 ms \
               stays as the fallback); replicas served in the order they began waiting (a \
               Redis sorted set, the release names the next); a row handed to the same \
               replica's next request with one UPDATE, at most 8 times in a row.",
        commands: vec![
            "INSERT INTO distributed_locks (lock_name, owner, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
            "on 1062/1213, when the row may be old: SELECT id, owner, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE lock_name = ?; \
             if expired: DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)",
            "renew (every lease/3): UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
            "last check before the commit: SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE id = ? AND owner = ? (renew if under lease/3)",
            "waiting head, after each failed INSERT and each poll (Lua): ZADD <ns>:lock-row-waiting:<sku> NX <Redis TIME> <replica>; PEXPIRE; ZRANGE … 0 0 (who is first)",
            "release: DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?; then (Lua) ZREM <ns>:lock-row-waiting:<sku> <replica>; ZRANGE … 0 0 (the first); HSET <ns>:lock-row-named:<sku> named <it>; PUBLISH <ns>:lock-row-released:<sku> '<owner>\\n<that replica>'",
            "hand over to this replica's next request: UPDATE distributed_locks SET owner = ?, acquired_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
        ],
        failure_mode: "A crashed holder's row blocks everyone until it expires. The release \
                       notice is only a hint: a lost one costs a waiter a poll (at most 50 ms). \
                       Like every lease lock, a holder paused past its expiry can be overtaken \
                       and write after the next holder; fencing (the row id and its place in a run \
                       of handovers, registered before \
                       the read, and the stock read compared at commit) refuses it.",
    }
}
