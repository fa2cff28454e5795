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
                  one INSERT per SKU succeed, and the others poll. The holder extends its \
                  expiry while it works and deletes its row when done; an expired row is \
                  taken over by its id.",
        adds: "A watchdog renewing the row every lease/3; the row id as a fencing token; \
               an INSERT whose request hung up undone on its own connection; statements \
               retried after a deadlock, or on another connection after a MariaDB \
               restart; the check before the commit reads the lease left instead of \
               renewing it.",
        commands: vec![
            "INSERT INTO distributed_locks (lock_name, owner, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
            "on 1062/1213, first and once the row seen may have expired: SELECT id, owner, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE lock_name = ?; \
             if expired: DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6); then INSERT again",
            "otherwise INSERT again after a jittered backoff (2 ms, doubling up to 250 ms)",
            "renew (every lease/3): UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
            "last check before the commit: SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM distributed_locks WHERE id = ? AND owner = ? (renew if under lease/3)",
            "release, or undo of an INSERT whose request hung up (on that INSERT's connection): DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?",
        ],
        failure_mode: "A crashed holder's row blocks everyone until it expires. Waiters poll: \
                       each failed INSERT is a statement on the MariaDB the holder needs; \
                       with the cohort layer off, the next holder finds the row gone up to a \
                       backoff (250 ms) after the release, with it on (the default) each \
                       replica's first waiter is woken by a release notice. Who gets it is \
                       luck, not order of arrival. Like every lease \
                       lock, a holder paused past its expiry can be overtaken and write after \
                       the next holder; fencing (the row id, registered before the read, and \
                       the stock read compared at commit) refuses it.",
    }
}
