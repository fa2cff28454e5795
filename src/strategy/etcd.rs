//! `etcd`: the order flow under an etcd lease and lock (`lock::etcd`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::lock::etcd::EtcdLock;
use crate::model::{NewOrder, Order, Sku};

pub struct EtcdStrategy {
    pub lock: EtcdLock,
}

#[async_trait]
impl Strategy for EtcdStrategy {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
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
        let (keys, ttl) = self.lock.inspect(sku.as_str()).await?;
        let mut state = vec![format!(
            "get --prefix {}/ ({} key(s), by create revision)",
            self.lock.lock_name(sku.as_str()),
            keys.len()
        )];
        state.extend(keys.iter().enumerate().map(|(i, (key, revision, lease))| {
            let role = if i == 0 { "holds" } else { "waits" };
            format!("{key}  [create revision {revision}, lease {lease:x}, {role}]")
        }));
        Ok(LockView {
            held: !keys.is_empty(),
            holder: keys.first().map(|(_, _, lease)| format!("lease {lease:x}")),
            lease_left_ms: ttl.map(|seconds| seconds * 1000),
            state,
        })
    }
}
