//! `none`: no coordination at all. Every replica runs the critical section
//! concurrently, so under load several read the same stock and oversell. This is the
//! baseline that shows why the other strategies exist.

use async_trait::async_trait;

use super::{Explanation, Family, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::model::{NewOrder, Order, Sku};

pub struct NoCoordination;

#[async_trait]
impl Strategy for NoCoordination {
    fn name(&self) -> &'static str {
        "none"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "No coordination",
            family: Family::None,
            summary: "Each replica reads the stock from Redis, checks it, does its work, then \
                      writes back stock minus quantity. Nothing stops two replicas from reading \
                      the same value, so both sell the same unit.",
            adds: "The baseline: the same critical section every lock strategy runs, without \
                   the lock. The write is an absolute stock, as in the naive code this lab \
                   starts from; the sale epoch still keeps an order of another strategy out.",
            commands: vec![
                "GET <ns>:stock:<sku>",
                "BEGIN; SELECT e.value, p.limit_per_user FROM cluster_settings e \
                 LEFT JOIN products p ON p.sku = ? WHERE e.name = 'epoch'; \
                 UPDATE products p SET p.stock = <read - q>, p.version = p.version + 1 \
                 WHERE p.sku = ? AND p.epoch <= <epoch>; INSERT INTO orders (...) VALUES (...); COMMIT",
                "Lua: if version > cached version then SET <ns>:stock:<sku> <read - q>, \
                 SET <ns>:stock-version:<sku> <version>",
            ],
            failure_mode: "Lost update: concurrent buyers all read stock = N and all write N-1, \
                           so far more orders are recorded than there were units (oversold).",
        }
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let critical = flow.sell(order, self.name(), None, &options);
        flow.section(order, self.name(), None, critical).await
    }

    async fn inspect(&self, _flow: &SaleFlow, _sku: &Sku) -> Result<LockView, OrderError> {
        Ok(LockView {
            state: vec!["no lock: every replica runs the critical section at the same time".into()],
            ..LockView::default()
        })
    }
}
