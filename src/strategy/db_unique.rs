//! `db-unique`: the order flow under a lock-table row (`lock::table`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "db-unique",
        title: "Database unique-key lock table",
        summary: "The lock is a row in distributed_locks, whose unique key on lock_name \
                  lets only one INSERT per SKU succeed. The holder extends its expiry \
                  while it works; its last check before the commit reads the row (still \
                  its own, with a third of the lease left by MySQL's clock, or else it \
                  renews), and it deletes its row (by name and owner) when done, then \
                  publishes a release notice on Redis. A row left by a crashed holder is \
                  taken over once expired, by deleting exactly that row by its id. Within \
                  a replica, requests for one SKU queue locally and only the first sends \
                  INSERTs; it retries when a notice arrives, and polls every 25-50 ms in \
                  case one was lost. The replicas whose heads wait queue in Redis in the \
                  order they began: a release names the first in its notice and the \
                  others hold back 5 ms, so replicas are served in turn rather than by \
                  who wins the race between their heads (one named at three releases \
                  without being served goes to the back). A holder whose own replica \
                  has requests queued hands the row to the next of them with one UPDATE \
                  of the owner instead of \
                  deleting it (one statement where a release and an INSERT took two), at \
                  most 8 times in a row; then it releases the row to every replica.",
        commands: vec![
            "INSERT INTO distributed_locks (lock_name, owner, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
            "on 1062/1213, when the row may be old: SELECT id, owner, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE lock_name = ?; \
             if expired: DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)",
            "renew (every lease/3): UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
            "last check before the commit: SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE id = ? AND owner = ? (renew if under lease/3)",
            "waiting head, after each failed INSERT and each poll, one script: ZADD <ns>:lock-row-waiting:<sku> NX <Redis TIME> <replica>; PEXPIRE; ZRANGE … 0 0 (who is first)",
            "release: DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?; then one script: ZREM <ns>:lock-row-waiting:<sku> <replica>; a miss for the replica the last release named if another (taken off at the third); ZRANGE … 0 0 (the first); HSET <ns>:lock-row-named:<sku> named <it>; PUBLISH <ns>:lock-row-released:<sku> '<owner>\\n<that replica>'",
            "hand over to this replica's next request (at most 8 in a row): UPDATE distributed_locks SET owner = ?, acquired_at = UTC_TIMESTAMP(6), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
        ],
        failure_mode: "A crashed holder's row blocks everyone until it expires. The release \
                       notice is only a hint: a lost one costs a waiter a poll (at most 50 ms). \
                       Like every lease lock, a holder paused past its expiry can be overtaken \
                       and write after the next holder; fencing (the row id and its place in a run \
                       of handovers, registered before \
                       the read, and the stock read compared at commit) refuses it.",
    }
}
