//! `zookeeper`: the order flow under a ZooKeeper lock (`lock::zookeeper`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "zookeeper",
        title: "ZooKeeper ephemeral sequential nodes (Curator InterProcessMutex)",
        family: Family::LockService,
        summary: "Each contender creates an ephemeral sequential znode under the SKU's lock \
                  path; the lowest sequence holds the lock, and every other contender watches \
                  only the node just before its own. The nodes live as long as the session.",
        adds: "A fencing token from the node's sequence (plus one, so that the first \
               node's token is above an empty fence); one session per replica, opened in \
               the background and again after it expired; a node left by a cancelled \
               request found by its _c_ prefix and deleted.",
        commands: vec![
            "create -e -s /flashsale/<ns>/locks/<sku>/_c_<random>-lock-   (ancestors created if missing)",
            "getChildren /flashsale/<ns>/locks/<sku>; lowest sequence holds",
            "otherwise: exists + watch on the predecessor only; on its deletion, getChildren again",
            "before commit: session connected and exists <own node> with our session as owner",
            "release: delete <own node>",
        ],
        failure_mode: "Session expiry: the session is a lease. A holder cut off from \
                       ZooKeeper, or paused (a GC or VM pause stops its heartbeats too), \
                       longer than the session timeout loses its node while it may still be \
                       working. It checks its session before committing, but a pause after \
                       the check can still overlap the next holder. With fencing on, MySQL \
                       refuses the late write (its token comes from the node's sequence). The lab's \
                       paused-holder fault cannot stop the client library's heartbeats, so it \
                       cannot show this here.",
    }
}
