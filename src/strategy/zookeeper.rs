//! `zookeeper`: the order flow under a ZooKeeper lock (`lock::zookeeper`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::lock::zookeeper::ZooKeeperLock;
use crate::model::{NewOrder, Order, Sku};

pub struct ZooKeeperStrategy {
    pub lock: ZooKeeperLock,
}

#[async_trait]
impl Strategy for ZooKeeperStrategy {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "ZooKeeper ephemeral sequential nodes (Curator InterProcessMutex)",
            summary: "Each contender creates an ephemeral sequential znode under the SKU's \
                      lock path; the lowest sequence holds the lock. Every other contender \
                      watches only the node just before its own, so a release wakes one \
                      waiter. The nodes live as long as the replica's session: if the replica \
                      dies, ZooKeeper deletes its node when the session times out.",
            commands: vec![
                "create -e -s /flashsale/<ns>/locks/<sku>/_c_<uuid>-lock-   (ancestors created if missing)",
                "getChildren /flashsale/<ns>/locks/<sku>; lowest sequence holds",
                "otherwise: exists/getData + watch on the predecessor only",
                "before commit: session connected and exists <own node> with our session as owner",
                "release: delete <own node>",
            ],
            failure_mode: "Session expiry: a holder cut off from ZooKeeper longer than the session \
                           timeout loses its node while it may still be working. It must check its \
                           session before committing, and a pause after the check can still \
                           overlap the next holder.",
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
        let nodes = self.lock.inspect(sku.as_str()).await?;
        let dir = self.lock.lock_dir(sku.as_str());
        let mut state = vec![format!(
            "ls {dir} ({} node(s), in sequence order)",
            nodes.len()
        )];
        state.extend(nodes.iter().enumerate().map(|(i, (node, owner))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{node}  [{owner}, {role}]")
        }));
        Ok(LockView {
            held: !nodes.is_empty(),
            holder: nodes.first().map(|(_, owner)| owner.clone()),
            lease_left_ms: None,
            state,
        })
    }
}
