//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        summary: "Each acquisition grants a lease and keeps it alive, then asks etcd's Lock \
                  service for the SKU's lock with that lease. etcd creates a key under the \
                  lock's prefix and makes the caller wait until every key with a lower create \
                  revision is gone, so contenders are served in order. The key lives on the \
                  lease: if the replica dies, the lease expires and the next one proceeds.",
        commands: vec![
            "LeaseGrant(ttl, id chosen by the replica) → lease; LeaseKeepAlive(lease) every ttl/3",
            "Lock(name=/flashsale/<ns>/locks/<sku>, lease) → key (waits in revision order)",
            "before commit: LeaseTimeToLive(lease) > 0",
            "release: LeaseRevoke(lease), which deletes the lock key",
            "fencing token: the revision at which the lock was granted",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window, fencing closes it when \
                       it covers the read (the revision registered before the stock is read).",
    }
}
