//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        summary: "Each acquisition grants a lease and keeps it alive, then queues a key on it \
                  under the SKU's lock prefix. Contenders are served in the order their keys \
                  were created: each waits until every key queued before its own is deleted, \
                  as one watch per replica reports them. The key lives on the lease: if the \
                  replica dies, the lease expires and the next one proceeds.",
        commands: vec![
            "once per replica: Watch(/flashsale/<ns>/locks/, prefix, deletions only, from now)",
            "LeaseGrant(ttl, id chosen by the replica) → lease; LeaseKeepAlive(lease) every ttl/3",
            "Txn: if <prefix>/<replica>-<slot> is absent, PUT it on the lease; GET <prefix> keys → held if no other key",
            "else: held once the watch reported every other key deleted (own key deleted first: lost)",
            "before commit: LeaseTimeToLive(lease, keys) > 0 and lists the lock key",
            "release: LeaseRevoke(lease), which deletes the lock key",
            "fencing token: the revision at which no key was before it any more (the join's read or the last deletion; grows in hold order)",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window, fencing closes it when \
                       it covers the read (the revision registered before the stock is read).",
    }
}
