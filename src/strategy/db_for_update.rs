//! `db-for-update`: a pessimistic row lock. The whole order is one MySQL transaction
//! that starts by locking the product's row with `SELECT … FOR UPDATE`; every other
//! buyer of that SKU queues on the row until the transaction commits.

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy, ensure_in_stock};
use crate::model::{NewOrder, Order, Sku};

pub struct DbForUpdateStrategy;

#[async_trait]
impl Strategy for DbForUpdateStrategy {
    fn name(&self) -> &'static str {
        "db-for-update"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "Pessimistic row lock (SELECT … FOR UPDATE)",
            summary: "The order is one transaction. It locks the product's row by its primary \
                      key, so concurrent buyers of the same SKU wait for the row; then it checks \
                      the stock, works, writes the stock and the order, and commits, which frees \
                      the row. The database is both the lock and the record, so a holder cannot \
                      lose its lock and still write. The wait is bounded per session.",
            commands: vec![
                "BEGIN; SET SESSION innodb_lock_wait_timeout = <wait s>",
                "SELECT stock, version FROM products WHERE sku = ? FOR UPDATE",
                "UPDATE products SET stock = stock - ?, version = version + 1 WHERE sku = ?",
                "INSERT INTO orders (...) VALUES (...); COMMIT",
                "Lua: if version > cached version then SET <ns>:stock:<sku>",
            ],
            failure_mode: "Connections and row locks are held for the whole critical section: a \
                           slow holder blocks every buyer of the SKU and ties up a database \
                           connection each; waits past innodb_lock_wait_timeout (error 1205) \
                           answer 503. Locking rows in different orders across SKUs can deadlock.",
        }
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        _options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let store = &flow.store;
        let acquire = async {
            let locked = store.records.lock_product(&order.sku, flow.lock_wait).await;
            locked.map_err(OrderError::from)
        };
        let locked = flow
            .wait_for_lock(self.name(), acquire)
            .await?
            .ok_or_else(|| OrderError::UnknownSku(order.sku.to_string()))?;
        ensure_in_stock(locked.stock, order)?;
        flow.simulate_work().await;
        let new_stock = locked.stock - order.quantity;
        let (recorded, version) = locked
            .commit_order(order, self.name(), &flow.replica_id)
            .await?;
        if let Err(error) = store
            .cache
            .set_stock_if_newer(&order.sku, new_stock, version)
            .await
        {
            tracing::error!(%error, sku = %order.sku, "order committed but Redis stock not updated");
        }
        Ok(recorded)
    }

    async fn inspect(&self, flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        let row = flow.store.records.stock_and_version(sku).await?;
        let row = row.map_or("no products row".into(), |(stock, version)| {
            format!("products row sku='{sku}': stock={stock} version={version}")
        });
        Ok(LockView {
            state: vec![
                "the lock is the row itself, held by an open transaction (SELECT … FOR UPDATE)"
                    .into(),
                row,
            ],
            ..LockView::default()
        })
    }
}
