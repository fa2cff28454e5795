//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        family: Family::LockService,
        summary: "Each replica grants a lease (its session) and keeps it alive; each \
                  contender puts a key on it under the SKU's lock prefix; the key with the lowest create revision holds, and \
                  each waiter watches only the key created just before its own (etcd's \
                  concurrency.Mutex). If the holder's replica dies, its lease expires and its keys go.",
        adds: "A fencing token from the revision of the read that found the turn (not the \
               key's create revision); the watch taken without a start revision, so a \
               waiter hears the release as etcd applies it, not at etcd's 100 ms catch-up \
               of past-revision watches; the key read back before the commit; a lease \
               whose keep-alive fails known lost; a cut acquisition's key deleted once its put \
               answered (a key left unknown revokes the session).",
        commands: vec![
            "LeaseGrant(ttl) → the replica's session lease, once per session (again after one is lost); LeaseKeepAlive(lease) every ttl/3 while the replica lives",
            "Txn: if <prefix>/<lease>-<n> is absent, PUT it on the lease; GET <prefix> newest 2 by create revision → held if no key before ours",
            "else: Watch the key just before ours until deleted; Txn: if our key is still there, GET the key just before it again",
            "before commit: GET <prefix>/<lease>-<n> (the session still kept alive, and the key still there with the same create revision)",
            "release: Txn: if our key is still there, DELETE it, which wakes the next waiter",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window. With fencing on, MySQL \
                       refuses the late write: the token is registered before the stock is \
                       read, and the write needs the stock read to be MySQL's and the token \
                       to be the SKU's newest.",
    }
}
