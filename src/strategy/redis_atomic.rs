//! `redis-atomic`: no lock at all. One Lua script checks and decrements the stock in
//! Redis atomically (Redis runs scripts one at a time), then the order is recorded in
//! MySQL. If that write fails, the units are given back. The ceiling the lock
//! strategies are measured against.

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::model::{NewOrder, Order, Sku};
use crate::store::{Refusal, StockWrite, StoreError, Taken};

pub struct RedisAtomicStrategy;

#[async_trait]
impl Strategy for RedisAtomicStrategy {
    fn name(&self) -> &'static str {
        "redis-atomic"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "Atomic decrement in Redis (Lua), no lock",
            summary: "The check and the decrement are one Lua script, and Redis runs scripts \
                      one at a time, so two buyers can never take the same unit. The order is \
                      then recorded in MySQL with a relative decrement; if that fails, the \
                      units are given back with INCRBY. Nothing waits for anything: this is the \
                      fastest safe design, and the ceiling the locks are measured against.",
            commands: vec![
                "Lua: if GET <ns>:epoch == <epoch> and GET <ns>:stock:<sku> >= q then DECRBY <ns>:stock:<sku> q",
                "BEGIN; UPDATE products p JOIN cluster_settings e ON e.name = 'epoch' \
                 SET p.stock = p.stock - ?, p.version = p.version + 1 \
                 WHERE p.sku = ? AND e.value = <epoch> AND p.stock >= ?; INSERT INTO orders ...; COMMIT",
                "refused or failed before COMMIT: INCRBY <ns>:stock:<sku> q (Lua, only if the stock \
                 was not rewritten from MySQL since the take)",
                "COMMIT outcome unknown: DEL <ns>:stock:<sku> until an admin reconciles",
            ],
            failure_mode: "Redis is the authority for the stock: if Redis loses writes (a \
                           failover before replication, a restart without persistence), units \
                           can be sold twice or vanish until Redis is rebuilt from MySQL \
                           (reconcile). A crash between the Lua script and the MySQL commit \
                           loses the units taken (undersell) until an admin reconciles, which \
                           rewrites the stock from MySQL.",
        }
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let critical = self.buy(flow, order, options);
        flow.section(order, self.name(), None, critical).await
    }

    async fn inspect(&self, flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        let stock = flow.store.cache.stock(sku).await?;
        Ok(LockView {
            state: vec![
                "no lock: the Lua script is atomic".into(),
                format!(
                    "GET <ns>:stock:{sku} → {}",
                    stock.map_or("(nil)".into(), |s| s.to_string())
                ),
            ],
            ..LockView::default()
        })
    }
}

impl RedisAtomicStrategy {
    /// Returns units taken for an order that was provably not recorded, unless the
    /// stock was rewritten from MySQL since (then they are counted already).
    async fn give_back(&self, flow: &SaleFlow, order: &NewOrder, generation: &str) {
        let given = flow
            .store
            .cache
            .give_back(&order.sku, order.quantity, generation)
            .await;
        if let Err(error) = given {
            tracing::error!(%error, sku = %order.sku, quantity = order.quantity,
                "units taken in Redis could not be given back; reconcile the SKU");
            flow.forget_stock(order).await;
        }
    }
}

impl RedisAtomicStrategy {
    /// The order itself; `place_order` records it on the timeline.
    async fn buy(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let store = &flow.store;
        let generation = match store
            .cache
            .take(&order.sku, order.quantity, options.epoch)
            .await?
        {
            Taken::UnknownSku => return Err(flow.missing_stock(order).await),
            Taken::SaleChanged => return Err(OrderError::SaleChanged),
            Taken::NotEnough { available } => {
                return Err(OrderError::SoldOut {
                    available: available.max(0),
                    requested: order.quantity,
                });
            }
            Taken::Done { generation, .. } => generation,
        };
        flow.simulate_work().await;
        let committed = store
            .records
            .commit_order(
                order,
                StockWrite::Decrement,
                options.epoch,
                self.name(),
                &flow.replica_id,
            )
            .await;
        match committed {
            Ok(Ok(committed)) => Ok(committed.order),
            // Refused: the transaction was rolled back, so the units were provably not
            // sold and go back.
            Ok(Err(refusal)) => {
                if let Refusal::NotEnough { stock } = refusal {
                    tracing::error!(sku = %order.sku, mysql_stock = stock,
                        "Redis had units MySQL has not: the cache is ahead of the records; reconcile");
                }
                self.give_back(flow, order, &generation).await;
                Err(flow.refused(order, refusal).await)
            }
            // The COMMIT's outcome is unknown: the units may be sold. They stay taken
            // and the SKU's stock is dropped until reconciled from MySQL.
            Err(error @ StoreError::CommitOutcomeUnknown(_)) => {
                Err(flow.commit_failed(order, error).await)
            }
            // Failed before COMMIT: nothing was written.
            Err(error) => {
                self.give_back(flow, order, &generation).await;
                Err(error.into())
            }
        }
    }
}
