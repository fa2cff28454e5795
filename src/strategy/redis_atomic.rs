//! `redis-atomic`: no lock at all. One Lua script checks and decrements the stock in
//! Redis atomically (Redis runs scripts one at a time), then the order is recorded in
//! MySQL. If that write fails, the units are given back. The ceiling the lock
//! strategies are measured against.

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::model::{NewOrder, Order, Sku};
use crate::store::Taken;

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
                "Lua: stock = GET <ns>:stock:<sku>; if stock >= q then DECRBY <ns>:stock:<sku> q",
                "BEGIN; UPDATE products SET stock = stock - ?, version = version + 1 WHERE sku = ?; \
                 INSERT INTO orders ...; COMMIT",
                "if MySQL fails: INCRBY <ns>:stock:<sku> q",
            ],
            failure_mode: "Redis is the authority for the stock: if Redis loses writes (a \
                           failover before replication, a restart without persistence), units \
                           can be sold twice or vanish until Redis is rebuilt from MySQL. And a \
                           crash between the Lua script and the MySQL commit loses the units \
                           taken (undersell), unless reconciled.",
        }
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        _options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let store = &flow.store;
        match store.cache.take(&order.sku, order.quantity).await? {
            Taken::UnknownSku => return Err(flow.missing_stock(order).await),
            Taken::NotEnough { available } => {
                return Err(OrderError::SoldOut {
                    available: available.max(0),
                    requested: order.quantity,
                });
            }
            Taken::Done { .. } => {}
        }
        flow.simulate_work().await;
        let recorded = store
            .records
            .commit_decrement(order, None, self.name(), &flow.replica_id)
            .await;
        match recorded {
            Ok(Some(recorded)) => Ok(recorded),
            Ok(None) => {
                // The product row is gone (a reset deleted it?): give the units back.
                store.cache.give_back(&order.sku, order.quantity).await?;
                Err(OrderError::UnknownSku(order.sku.to_string()))
            }
            Err(error) => {
                if let Err(give_back) = store.cache.give_back(&order.sku, order.quantity).await {
                    tracing::error!(%give_back, sku = %order.sku, quantity = order.quantity,
                        "units taken in Redis could not be given back; reset or reconcile the SKU");
                }
                Err(error.into())
            }
        }
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
