//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        family: Family::LockService,
        summary: "Each contender puts a key on its lease under the SKU's lock prefix; keys \
                  are served in the order they were created, each waiter watching only the \
                  key before its own. If the holder dies, its lease expires and its key goes.",
        adds: "One lease per replica (its session, one keep-alive stream); the replica's \
               requests take turns behind one key, handed along without a call to etcd (at \
               most 8 in a row); a fencing token from the revision of the read that found \
               the turn (× 65536, plus the place in the run).",
        commands: vec![
            "once per replica: LeaseGrant(ttl) → the session's lease; LeaseKeepAlive(lease) every ttl/3",
            "Txn: if <prefix>/<lease> is absent, PUT it on the lease; GET <prefix> newest 2 by create revision → held if no key before it",
            "else: Watch the key just before; if anything was written in etcd since the read, GET it again; wait for its DELETE, look again",
            "before commit: GET <prefix>/<lease> (still there: same create revision, same lease)",
            "release: Txn: if <prefix>/<lease> still has its create revision, DELETE it, unless handed to the replica's next request",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window. With fencing on, MySQL \
                       refuses the late write: the token is registered before the stock is \
                       read, and the write needs the stock read to be MySQL's and the token \
                       to be the SKU's newest.",
    }
}
