//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "etcd",
        title: "etcd lease and lock (revision order)",
        summary: "Each replica holds one lease, its session, kept alive by one stream \
                  (etcd's concurrency.Session; a new one if it is lost), and its requests for one SKU take \
                  turns. The one whose turn it is queues a key named after the session's \
                  lease under the SKU's lock prefix. Contenders are served in the order \
                  their keys were created: each watches only the key queued just before \
                  its own and looks again once it is deleted. The key lives on the lease: \
                  if the replica dies, the lease expires and the next one proceeds. Each \
                  released key stays in etcd's index until the history is compacted, and \
                  every look at the queue walks past them: a busy lock needs a short \
                  history (the stack keeps 5 s). A holder whose replica has more requests \
                  waiting hands them its key without a call to etcd, at most 8 times in a \
                  row, then deletes it and the replica queues again behind the others.",
        commands: vec![
            "once per replica: LeaseGrant(ttl, id chosen by the replica) → session lease; LeaseKeepAlive(lease) every ttl/3",
            "Txn: if <prefix>/<lease> is absent, PUT it on the lease; GET <prefix> newest 2 by create revision → held if no key before it",
            "else: Watch the key just before (from now); if anything was written in etcd since the read, GET it again; wait for its DELETE, look again",
            "before commit: GET <prefix>/<lease> (still there: same create revision, same lease)",
            "release: Txn: if <prefix>/<lease> still has its create revision, DELETE it (a dropped request's key likewise, before the replica's next request for the SKU queues; if that cannot be confirmed, the session is given up and the key expires with its lease)",
            "or, with requests of the same replica waiting (at most 8 in a row): nothing, the next of them holds the key",
            "fencing token: the store revision of the read that found no key before it, × 65536, plus \
             the hold's place in a run of handovers within the replica (grows in hold order)",
        ],
        failure_mode: "Lease expiry: a holder cut off from etcd, or paused, longer than the \
                       lease TTL loses the lock while it may still be working; checking the \
                       lease before committing narrows the window. With fencing on, MySQL \
                       refuses the late write: the token is registered before the stock is \
                       read, and the write needs the stock read to be MySQL's and the token \
                       to be the SKU's newest.",
    }
}
