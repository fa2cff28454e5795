//! `db-unique`: the order flow under a lock-table row (`lock::table`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy, token_owner};
use crate::lock::table::TableLock;
use crate::model::{NewOrder, Order, Sku};

pub struct DbUniqueStrategy {
    pub lock: TableLock,
}

#[async_trait]
impl Strategy for DbUniqueStrategy {
    fn name(&self) -> &'static str {
        "db-unique"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "Database unique-key lock table",
            summary: "The lock is a row in distributed_locks, whose unique key on lock_name \
                      lets only one INSERT per SKU succeed. The holder extends its expiry \
                      while it works and deletes its row (by name and owner) when done. A row \
                      left by a crashed holder is taken over once expired, by deleting \
                      exactly that row by its id. Waiters poll with jittered backoff.",
            commands: vec![
                "INSERT INTO distributed_locks (lock_name, owner, expires_at) VALUES (?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
                "on 1062/1213: SELECT id FROM distributed_locks WHERE lock_name = ? AND expires_at < UTC_TIMESTAMP(6); \
                 DELETE FROM distributed_locks WHERE id = ? AND expires_at < UTC_TIMESTAMP(6)",
                "renew: UPDATE distributed_locks SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id = ? AND owner = ?",
                "release: DELETE FROM distributed_locks WHERE lock_name = ? AND owner = ?",
            ],
            failure_mode: "A crashed holder's row blocks everyone until it expires. Polling \
                           puts load on the database and is unfair under contention. Like every \
                           lease lock, a holder paused past its expiry can be overtaken and \
                           write after the next holder; fencing (the row id, registered before \
                           the read, and the stock read compared at commit) refuses it.",
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
        Ok(match self.lock.inspect(sku.as_str()).await? {
            Some((id, owner, left_ms)) => LockView {
                held: left_ms > 0,
                holder: Some(token_owner(&owner)),
                lease_left_ms: Some(left_ms),
                state: vec![format!(
                    "distributed_locks row id={id} lock_name='{sku}' owner='{owner}' expires in {left_ms} ms"
                )],
            },
            None => LockView {
                state: vec![format!("no row for lock_name='{sku}': free")],
                ..LockView::default()
            },
        })
    }
}
