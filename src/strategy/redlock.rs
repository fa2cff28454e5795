//! `redlock`: the order flow under the Redlock algorithm (`lock::redlock`).

use super::{Explanation, Family};

/// What the dashboard and `/api/strategies` say about it; the strategy itself is the
/// shared `LockStrategy` around its lock (see `registry`).
pub fn explanation() -> Explanation {
    Explanation {
        name: "redlock",
        title: "Redlock over independent Redis nodes",
        family: Family::LockService,
        summary: "The same key and random token are SET NX PX on every independent Redis \
                  node. The lock is held if a majority granted it with more than half the \
                  lease left (time spent + a clock-drift allowance < lease/2); otherwise it \
                  is released on every node and tried again after a random delay, or at \
                  once when another replica announces a release (the cohort layer's \
                  notice, on by default).",
        adds: "Held only with more than half the lease left (elapsed + drift < lease/2, \
               drift = 1% of the lease + 2 ms; elapsed counts the fencing rounds too), so \
               that the watchdog's first renewal, a third of a lease in, finds the keys; a \
               watchdog renewing on every node and counting a majority; a fencing counter \
               on a majority of nodes (two more rounds, only when fencing is on).",
        commands: vec![
            "on each node (50 ms timeout): SET <ns>:redlock:<sku> <token> NX PX <lease>",
            "else on every node: if GET key == token then DEL key (Lua); wait a random \
             delay (from 5 ms, doubling up to 250 ms) or a release notice; retry",
            "watchdog and check before commit: compare-and-PEXPIRE on every node, majority",
            "fencing token: GET <ns>:redlock-fence:<sku> on a majority of the granting nodes, \
             SET the largest + 1 on a majority (Lua, while still holding there)",
            "release: if GET key == token then DEL key (Lua) on every node",
        ],
        failure_mode: "Timing: a holder paused past the validity, a node that restarts without \
                       persistence, or a clock that jumps can give two holders the lock at \
                       once. Redlock has no fencing token of its own; the counter this lab \
                       keeps on a majority of nodes can go back when a node loses its data, \
                       and it rests on holders not overlapping, the very case fencing exists \
                       for: a safe token needs consensus (Kleppmann). With fencing on, what \
                       still refuses a double sale is MySQL comparing the stock read. \
                       Kleppmann's critique is why Redisson deprecated its RedLock; prefer \
                       one node with fencing, or a consensus store.",
    }
}
