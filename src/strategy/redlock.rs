//! `redlock`: the order flow under the Redlock algorithm (`lock::redlock`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy, token_owner};
use crate::lock::redlock::Redlock;
use crate::model::{NewOrder, Order, Sku};

pub struct RedlockStrategy {
    pub lock: Redlock,
}

#[async_trait]
impl Strategy for RedlockStrategy {
    fn name(&self) -> &'static str {
        "redlock"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
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
                "fencing token: read <ns>:redlock-fence:<sku> on the granting nodes, write the largest + 1 to a majority (while still holding there)",
            ],
            failure_mode: "Timing: a holder paused past the validity, a node that restarts without \
                           persistence, or a clock that jumps can give two holders the lock at \
                           once, and Redlock has no natural fencing token: this lab derives one \
                           from counters on a majority of nodes. Kleppmann's critique (no \
                           fencing, timing assumptions) is why Redisson deprecated its \
                           RedLock; prefer one node with fencing, or a consensus store.",
        }
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        flow.sell_locked(&self.lock, order, self.name(), options)
            .await
    }

    async fn inspect(&self, _flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        let key = self.lock.key(sku.as_str());
        let nodes = self.lock.inspect(sku.as_str()).await;
        let mut state = Vec::new();
        let mut holders = Vec::new();
        for (index, node) in nodes.iter().enumerate() {
            state.push(match node {
                Ok(Some((token, ttl))) => {
                    holders.push((token.clone(), *ttl));
                    format!("node {}: GET {key} → \"{token}\" (PTTL {ttl})", index + 1)
                }
                Ok(None) => format!("node {}: GET {key} → (nil)", index + 1),
                Err(error) => format!("node {}: unreachable ({error})", index + 1),
            });
        }
        let quorum = nodes.len() / 2 + 1;
        let majority = holders
            .iter()
            .find(|(token, _)| holders.iter().filter(|(t, _)| t == token).count() >= quorum);
        Ok(LockView {
            held: majority.is_some(),
            holder: majority.map(|(token, _)| token_owner(token)),
            lease_left_ms: majority.map(|(_, ttl)| *ttl),
            state,
        })
    }
}
