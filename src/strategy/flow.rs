//! The critical section every lock strategy runs (SPEC §4), written once so that the
//! only thing that differs between lock strategies is how they coordinate:
//!
//! ```text
//! stock = GET stock in Redis
//! if stock < quantity: sold out
//! optional work (simulated validation)
//! MySQL transaction: write stock - quantity, insert the order
//! SET stock - quantity in Redis
//! ```
//!
//! Without a lock around it, two replicas read the same stock and both write back
//! `stock - 1`: the lost update that oversells.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::OrderError;
use crate::lock::{DistributedLock, HeldLock};
use crate::model::{NewOrder, Order};
use crate::store::Store;

/// What one replica needs to run the order flow.
pub struct SaleFlow {
    pub store: Store,
    /// Simulated work inside the critical section (FLASHSALE_WORK_MS).
    pub work: Duration,
    pub replica_id: String,
    /// How long a lock strategy waits for its lock before answering 503.
    pub lock_wait: Duration,
    /// Orders of this replica waiting for a lock right now (for the dashboard).
    pub lock_waiters: AtomicU64,
}

impl SaleFlow {
    /// The whole flow of a lock strategy: acquire the SKU's lock, run the critical
    /// section, release. The lock is released on every path, including errors.
    pub async fn sell_locked<L: DistributedLock>(
        &self,
        lock: &L,
        order: &NewOrder,
        strategy: &str,
    ) -> Result<Order, OrderError> {
        self.lock_waiters.fetch_add(1, Ordering::Relaxed);
        let acquired = lock.acquire(order.sku.as_str(), self.lock_wait).await;
        self.lock_waiters.fetch_sub(1, Ordering::Relaxed);
        let guard = match acquired {
            Ok(guard) => guard,
            Err(error) => {
                self.store.cluster.count(strategy, "lock_timeouts").await;
                return Err(error.into());
            }
        };
        let sold = self.sell(order, strategy, Some(&guard)).await;
        if let Err(error) = guard.release().await {
            tracing::warn!(%error, sku = %order.sku, strategy, "lock release failed");
        }
        if let Err(OrderError::LockLost(_)) = &sold {
            self.store.cluster.count(strategy, "locks_lost").await;
        }
        sold
    }

    /// Runs the read-check-write critical section. The caller holds `hold`, its
    /// strategy's lock, or nothing (`none`); a lost lock aborts before the commit.
    pub async fn sell(
        &self,
        order: &NewOrder,
        strategy: &str,
        hold: Option<&dyn HeldLock>,
    ) -> Result<Order, OrderError> {
        let stock = self
            .store
            .cache
            .stock(&order.sku)
            .await?
            .ok_or_else(|| OrderError::UnknownSku(order.sku.to_string()))?;
        if stock < order.quantity {
            return Err(OrderError::SoldOut {
                available: stock.max(0),
                requested: order.quantity,
            });
        }
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        // The last moment to notice a lost lock. A lease can still run out between
        // this check and the commit; closing that gap takes a fencing token checked
        // by MySQL itself.
        if let Some(hold) = hold {
            hold.ensure_held().await?;
        }
        let new_stock = stock - order.quantity;
        let recorded = self
            .store
            .records
            .commit_order(order, new_stock, strategy, &self.replica_id)
            .await?;
        // The order is committed: if the cache write fails now, the order still stands
        // and /api/stats reports the cache as inconsistent until the next reset.
        if let Err(error) = self.store.cache.set_stock(&order.sku, new_stock).await {
            tracing::error!(%error, sku = %order.sku, "order committed but Redis stock not updated");
        }
        Ok(recorded)
    }
}
