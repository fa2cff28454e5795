//! `redlock`: the order flow under the Redlock algorithm (`lock::redlock`).

use super::Explanation;

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "redlock",
        title: "Redlock over independent Redis nodes",
        summary: "The same key and random token are SET NX PX on every independent Redis \
                  node, each call with a short timeout. The lock is held if a majority \
                  granted it and time is left of the lease after subtracting the time spent \
                  and a clock-drift allowance; otherwise it is released on all nodes and \
                  retried after a random delay. It rests on timing assumptions: bounded \
                  network delays, bounded process pauses, and clocks that drift less than \
                  the allowance.",
        commands: vec![
            "on each node (50 ms timeout): SET <ns>:redlock:<sku> <token> NX PX <lease>",
            "held if granted on ≥ N/2+1 nodes and lease − elapsed − (1% lease + 2 ms) > 0",
            "else on every node: if GET key == token then DEL key (Lua); random delay; retry",
            "watchdog and check before commit: compare-and-PEXPIRE on every node, majority",
            "fencing token: read <ns>:redlock-fence:<sku> on a majority of the granting nodes, write the largest + 1 to a majority (while still holding there)",
        ],
        failure_mode: "Timing: a holder paused past the validity, a node that restarts without \
                       persistence, or a clock that jumps can give two holders the lock at \
                       once, and Redlock has no natural fencing token: this lab derives one \
                       from counters on a majority of nodes. Kleppmann's critique (no \
                       fencing, timing assumptions) is why Redisson deprecated its \
                       RedLock; prefer one node with fencing, or a consensus store.",
    }
}
