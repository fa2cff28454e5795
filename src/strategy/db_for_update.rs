//! `db-for-update`: a pessimistic row lock. The whole order is one MySQL transaction
//! that starts by locking the product's row with `SELECT … FOR UPDATE`; every other
//! buyer of that SKU queues on the row until the transaction commits.

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy, ensure_in_stock};
use crate::lock::local_queue::LocalQueues;
use crate::model::{NewOrder, Order, Sku};
use crate::store::LockedProduct;

#[derive(Default)]
pub struct DbForUpdateStrategy {
    /// This replica's buyers of one SKU queue here, so only one of them holds a
    /// pooled connection while waiting for the row.
    pub queues: LocalQueues,
}

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
                      lose its lock and still write. Within a replica, buyers of one SKU queue \
                      locally so only one of them ties up a connection waiting for the row; \
                      that wait is bounded for the one statement.",
            commands: vec![
                "this replica's buyers of the SKU queue locally; the head of the queue:",
                "BEGIN; SELECT value FROM cluster_settings WHERE name = 'epoch' \
                 (no lock: an order of an epoch MySQL never reached is refused)",
                "SET STATEMENT innodb_lock_wait_timeout = <wait s> FOR \
                 SELECT stock, epoch FROM products WHERE sku = ? FOR UPDATE",
                "UPDATE products p SET p.stock = p.stock - ?, p.version = p.version + 1 \
                 WHERE p.sku = ? AND p.epoch <= <epoch>",
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
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let store = &flow.store;
        let acquire = async {
            // Wait this replica's turn for the SKU first, holding no connection: only
            // the head of the local queue waits on the row, with one connection.
            // A shopper who leaves while queued here leaves the queue: nothing is held
            // yet, so there is nothing to finish.
            let deadline = tokio::time::Instant::now() + flow.lock_wait;
            let turn = tokio::select! {
                turn = self.queues.turn(order.sku.as_str(), deadline) => turn,
                () = options.client_gone.cancelled() => return Err(OrderError::Abandoned),
            };
            let Some(turn) = turn else {
                return Err(OrderError::Busy(format!(
                    "the row lock was not granted within {:?}; try again",
                    flow.lock_wait
                )));
            };
            let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
            let locked = store
                .records
                .lock_product(&order.sku, options.epoch, wait)
                .await;
            Ok((turn, locked.map_err(OrderError::from)?))
        };
        let (_turn, locked) = flow.wait_for_lock(self.name(), &options, acquire).await?;
        let locked = match locked {
            Ok(locked) => locked,
            Err(refusal) => return Err(flow.refused(order, refusal).await),
        };
        let critical = self.sell_locked_row(flow, order, &options, locked);
        flow.section(order, self.name(), None, critical).await
    }

    async fn inspect(&self, flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        inspect_row(flow, sku).await
    }
}

impl DbForUpdateStrategy {
    /// The critical section, holding the row.
    async fn sell_locked_row(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: &OrderOptions,
        locked: LockedProduct,
    ) -> Result<Order, OrderError> {
        ensure_in_stock(locked.stock, order)?;
        flow.simulate_work().await;
        let new_stock = locked.stock - order.quantity;
        let committed = locked
            .commit_order(order, options.epoch, self.name(), &flow.replica_id)
            .await;
        let committed = match committed {
            Ok(Ok(committed)) => committed,
            Ok(Err(refusal)) => return Err(flow.refused(order, refusal).await),
            Err(error) => return Err(flow.commit_failed(order, error).await),
        };
        flow.write_cache(order, new_stock, committed.version, "")
            .await;
        Ok(committed.order)
    }
}

/// The row lock as the dashboard shows it.
async fn inspect_row(flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
    let row = flow.store.records.stock_and_version(sku).await?;
    let row = row.map_or("no products row".into(), |(stock, version)| {
        format!("products row sku='{sku}': stock={stock} version={version}")
    });
    Ok(LockView {
        state: vec![
            "the lock is the row itself, held by an open transaction (SELECT … FOR UPDATE)".into(),
            row,
        ],
        ..LockView::default()
    })
}
