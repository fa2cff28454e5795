//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        summary: "Each acquisition grants a lease and keeps it alive, then queues a key named \
                  after the lease under the SKU's lock prefix. Contenders are served in the \
                  order their keys were created: each watches only the key queued just \
                  before its own and looks again once it is deleted. The key lives on the \
                  lease: if the replica dies, the lease expires and the next one proceeds. \
                  Each released key stays in etcd's index until the history is compacted, \
                  and every look at the queue walks past them: a busy lock needs a short \
                  history (the stack keeps 5 s).",
        commands: vec![
            "LeaseGrant(ttl, id chosen by the replica) → lease; LeaseKeepAlive(lease) every ttl/3 from the grant (an order done sooner sends none)",
            "Txn: if <prefix>/<lease> is absent, PUT it on the lease; GET <prefix> newest 2 by create revision → held if no key before it",
            "else: Watch the key just before (from now), GET it again, wait for its DELETE, look again",
            "before commit: GET <prefix>/<lease> (still there: same create revision, same lease)",
            "release: LeaseRevoke(lease), which deletes the lock key",
            "fencing token: the revision of the read that found no key before it (grows in hold order)",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window, fencing closes it when \
                       it covers the read (the revision registered before the stock is read).",
    }
}
