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
use std::time::{Duration, Instant};

use super::{OrderError, OrderOptions};
use crate::lock::{DistributedLock, HeldLock};
use crate::model::{NewOrder, Order};
use crate::store::{Store, StoreError};

/// What one replica needs to run the order flow.
pub struct SaleFlow {
    pub store: Store,
    /// Simulated work inside the critical section (FLASHSALE_WORK_MS).
    pub work: Duration,
    pub replica_id: String,
    /// How long a lock strategy waits for its lock before answering 503.
    pub lock_wait: Duration,
    /// The lease of this replica's lease locks (for the paused-holder fault's default).
    pub lock_lease: Duration,
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
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let acquire = async {
            let acquired = lock.acquire(order.sku.as_str(), self.lock_wait).await;
            acquired.map_err(OrderError::from)
        };
        let guard = self.wait_for_lock(strategy, acquire).await?;
        let holding = Instant::now();
        let sold = self.sell(order, strategy, Some(&guard), options).await;
        if let Err(error) = guard.release().await {
            tracing::warn!(%error, sku = %order.sku, strategy, "lock release failed");
        }
        metrics::histogram!("flashsale_lock_hold_seconds", "strategy" => strategy.to_owned())
            .record(holding.elapsed().as_secs_f64());
        match &sold {
            Err(OrderError::LockLost(_)) => self.store.cluster.count(strategy, "locks_lost").await,
            Err(OrderError::Fenced { .. }) => {
                self.store
                    .cluster
                    .count(strategy, "fencing_rejections")
                    .await;
            }
            _ => {}
        }
        sold
    }

    /// Waits for a lock (`acquire`, whatever the mechanism): counts the order among
    /// this replica's waiters while it waits, even if the request is dropped mid-wait,
    /// times the wait, and counts a wait that timed out.
    pub async fn wait_for_lock<T>(
        &self,
        strategy: &str,
        acquire: impl Future<Output = Result<T, OrderError>>,
    ) -> Result<T, OrderError> {
        /// Takes the order off the waiters when dropped, however the wait ends.
        struct Waiting<'a>(&'a AtomicU64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.lock_waiters.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self.lock_waiters);
        let started = Instant::now();
        let acquired = acquire.await;
        drop(waiting);
        metrics::histogram!("flashsale_lock_acquire_seconds", "strategy" => strategy.to_owned())
            .record(started.elapsed().as_secs_f64());
        if let Err(OrderError::Busy(_)) = &acquired {
            self.store.cluster.count(strategy, "lock_timeouts").await;
        }
        acquired
    }

    /// Runs the read-check-write critical section. The caller holds `hold`, its
    /// strategy's lock, or nothing (`none`); a lost lock aborts before the commit.
    pub async fn sell(
        &self,
        order: &NewOrder,
        strategy: &str,
        hold: Option<&dyn HeldLock>,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let Some(stock) = self.store.cache.stock(&order.sku).await? else {
            return Err(self.missing_stock(order).await);
        };
        ensure_in_stock(stock, order)?;
        self.simulate_work().await;
        // The last moment to notice a lost lock. A lease can still run out between
        // this check and the commit; closing that gap takes a fencing token checked
        // by MySQL itself.
        if let Some(hold) = hold {
            hold.ensure_held().await?;
            if options.pause_armed {
                self.pause_if_claimed(hold, strategy).await?;
            }
        }
        let new_stock = stock - order.quantity;
        let fence = hold
            .filter(|_| options.fencing)
            .and_then(|h| h.fencing_token());
        let committed = self
            .store
            .records
            .commit_order(order, new_stock, fence, strategy, &self.replica_id)
            .await;
        let recorded = match committed {
            Ok(Some(recorded)) => recorded,
            Ok(None) => {
                return Err(OrderError::Fenced {
                    token: fence.unwrap_or(0),
                });
            }
            Err(error) => {
                if matches!(error, StoreError::CommitOutcomeUnknown(_)) {
                    self.forget_stock(order).await;
                }
                return Err(error.into());
            }
        };
        // The order is committed: if the cache write fails now, the cache is stale;
        // forget it rather than let the next holder sell from it.
        if let Err(error) = self.store.cache.set_stock(&order.sku, new_stock).await {
            tracing::error!(%error, sku = %order.sku, "order committed but Redis stock not updated");
            self.forget_stock(order).await;
        }
        Ok(recorded)
    }

    /// Why Redis has no stock for the order's SKU: never stocked (404), or the cache
    /// lost it (a Redis restart without persistence) and it must be reconciled from
    /// MySQL before selling goes on (503).
    pub async fn missing_stock(&self, order: &NewOrder) -> OrderError {
        match self.store.records.stock_and_version(&order.sku).await {
            Ok(Some(_)) => OrderError::StockUnavailable(order.sku.to_string()),
            Ok(None) => OrderError::UnknownSku(order.sku.to_string()),
            Err(error) => error.into(),
        }
    }

    /// After a MySQL write whose outcome is unknown (the connection dropped during
    /// COMMIT: MySQL may have committed) the Redis stock can no longer be trusted:
    /// selling on from it could sell a unit twice. Deleting it makes the SKU answer
    /// `stock_unavailable` until it is rebuilt from MySQL (reconcile), the truth.
    async fn forget_stock(&self, order: &NewOrder) {
        match self.store.cache.forget(&order.sku).await {
            Ok(()) => tracing::warn!(sku = %order.sku,
                "MySQL write failed: Redis stock dropped until reconciled from MySQL"),
            Err(error) => tracing::error!(%error, sku = %order.sku,
                "MySQL write failed and the Redis stock could not be dropped; reconcile it"),
        }
    }

    /// The simulated validation inside the critical section (FLASHSALE_WORK_MS).
    pub async fn simulate_work(&self) {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
    }

    /// The paused-holder fault (Kleppmann's scenario): if this holder claims the armed
    /// pause, it stops renewing its lock and stalls after its last check, as a GC or VM
    /// pause can, so its lease runs out and another replica takes the lock while this
    /// one still means to write.
    async fn pause_if_claimed(
        &self,
        hold: &dyn HeldLock,
        strategy: &str,
    ) -> Result<(), OrderError> {
        let Some(ms) = self.store.cluster.take_pause().await? else {
            return Ok(());
        };
        tracing::warn!(
            strategy,
            ms,
            "fault: lock holder pausing with its renewal suspended"
        );
        hold.suspend_renewal();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        self.store.cluster.count(strategy, "paused_holders").await;
        Ok(())
    }
}

/// `SoldOut` when `stock` cannot cover the order.
pub fn ensure_in_stock(stock: i64, order: &NewOrder) -> Result<(), OrderError> {
    if stock < order.quantity {
        return Err(OrderError::SoldOut {
            available: stock.max(0),
            requested: order.quantity,
        });
    }
    Ok(())
}
