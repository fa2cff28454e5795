//! `db-for-update`: a pessimistic row lock. The whole order is one MySQL transaction
//! that starts by locking the product's row with `SELECT … FOR UPDATE`; every other
//! buyer of that SKU queues on the row until the transaction commits.

use async_trait::async_trait;

use super::flow::{Placed, epoch_ms};
use super::{
    Explanation, Family, LockView, OrderError, OrderOptions, SaleFlow, Strategy, ensure_in_stock,
};
use crate::lock::local_queue::LocalQueues;
use crate::model::{NewOrder, Order, Sku};
use crate::store::{Committed, LockedProduct};

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
            family: Family::Database,
            summary: "The order is one transaction that locks the product's row, checks the \
                      stock, works, writes and commits, which frees the row. The database is \
                      both the lock and the record, so a holder cannot lose its lock and still write.",
            adds: "Within a replica, buyers of one SKU queue locally, so only one of them ties \
                   up a pooled connection waiting for the row; that wait is bounded per \
                   statement.",
            commands: vec![
                "BEGIN; SELECT value FROM cluster_settings WHERE name = 'epoch' \
                 (no lock: an order of an epoch MySQL never reached is refused)",
                "SET STATEMENT innodb_lock_wait_timeout = <wait s> FOR \
                 SELECT stock, epoch FROM products WHERE sku = ? FOR UPDATE",
                "SELECT e.value, p.limit_per_user FROM cluster_settings e \
                 LEFT JOIN products p ON p.sku = ? WHERE e.name = 'epoch'",
                "UPDATE products p SET p.stock = p.stock - ?, p.version = p.version + 1 \
                 WHERE p.sku = ? AND p.epoch <= <epoch> AND p.stock >= ?",
                "INSERT INTO orders (...) VALUES (...); COMMIT",
                "Lua: if version > cached version then SET <ns>:stock:<sku>",
            ],
            failure_mode: "Connections and row locks are held for the whole critical section: a \
                           slow holder blocks every buyer of the SKU and ties up a database \
                           connection each; waits past innodb_lock_wait_timeout (error 1205) \
                           answer 503. Row-lock waits cannot form a cycle: an order locks one \
                           product row, and admin changes lock the epoch row first; a per-user \
                           limit adds the user's counter row, locked by its primary key (no gap \
                           lock), so it cannot form one either.",
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
        let stock = locked.stock;
        // The section ends at COMMIT, which frees the row for the next holder; the
        // cache write comes after it, outside the lock, as in every other strategy
        // whose writes MySQL orders (the version decides which cache write lands).
        let critical = self.sell_locked_row(flow, order, &options, locked);
        let sold = flow.section(order, self.name(), None, critical).await?;
        flow.write_cache(order, stock - order.quantity, sold.committed.version, "")
            .await;
        Ok(sold.committed.order)
    }

    async fn inspect(&self, flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        inspect_row(flow, sku).await
    }
}

impl DbForUpdateStrategy {
    /// The critical section, holding the row until its COMMIT.
    async fn sell_locked_row(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: &OrderOptions,
        locked: LockedProduct,
    ) -> Result<RowSold, OrderError> {
        ensure_in_stock(locked.stock, order)?;
        flow.simulate_work().await;
        let mut commit_sent_ms = 0.0;
        let committed = locked
            .commit_order(order, options.epoch, self.name(), &flow.replica_id, || {
                commit_sent_ms = epoch_ms();
            })
            .await;
        match committed {
            Ok(Ok(committed)) => Ok(RowSold {
                committed,
                commit_sent_ms,
            }),
            Ok(Err(refusal)) => Err(flow.refused(order, refusal).await),
            Err(error) => Err(flow.commit_failed(order, error).await),
        }
    }
}

/// An order committed under the row lock, and when its COMMIT was sent: its section
/// on the timeline ends there. The COMMIT frees the row, so the next holder's section
/// (from its grant) begins after it; ending at the COMMIT's answer instead, which can
/// arrive after the next grant, drew holders of different replicas as overlapping.
struct RowSold {
    committed: Committed,
    commit_sent_ms: f64,
}

impl Placed for RowSold {
    fn order_id(&self) -> u64 {
        self.committed.order.id
    }

    fn ended_ms(&self) -> Option<f64> {
        Some(self.commit_sent_ms)
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
