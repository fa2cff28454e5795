//! `redis-atomic`: no lock at all. One Lua script checks and decrements the stock in
//! Redis atomically (Redis runs scripts one at a time), then the order is recorded in
//! MySQL, together with the other orders this replica took units for at the same
//! moment: one transaction per batch (`store::group_commit`), answered after its
//! COMMIT. If the write is refused or fails, the units are given back. The ceiling the
//! lock strategies are measured against.

use std::sync::OnceLock;

use async_trait::async_trait;

use super::{Explanation, Family, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::model::{NewOrder, Order, Sku};
use crate::store::{GroupCommit, Refusal, StoreError, Taken, TakenOrder};

#[derive(Default)]
pub struct RedisAtomicStrategy {
    /// Records the orders this replica takes units for, in batches
    /// (`store::group_commit`).
    committer: OnceLock<GroupCommit>,
}

#[async_trait]
impl Strategy for RedisAtomicStrategy {
    fn name(&self) -> &'static str {
        "redis-atomic"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "Atomic decrement in Redis (Lua), no lock",
            family: Family::LockFree,
            summary: "One Lua script checks and decrements the stock, and Redis runs scripts \
                      one at a time, so two buyers never take the same unit. MySQL then \
                      records the order with a decrement guarded by stock >= units.",
            adds: "Group commit: the orders a replica took units for meanwhile (up to 64) \
                   are recorded in one transaction, each shopper answered after its COMMIT; \
                   units given back when the write is refused; the sale epoch checked in \
                   the script.",
            commands: vec![
                "Lua: if GET <ns>:stock-epoch:<sku> <= <epoch> and GET <ns>:stock:<sku> >= q \
                 then DECRBY <ns>:stock:<sku> q",
                "BEGIN; SELECT value FROM cluster_settings WHERE name = 'epoch'; per SKU: \
                 UPDATE products p SET p.stock = p.stock - <its orders' units>, \
                 p.version = p.version + 1 WHERE p.sku = ? AND p.epoch <= <epoch> \
                 AND p.stock >= <its orders' units>; \
                 INSERT INTO orders ... VALUES (...), (...), ... RETURNING id, ...; COMMIT",
                "a SKU whose UPDATE matched nothing: its orders one by one, each in its own \
                 BEGIN; UPDATE ... p.stock >= q; INSERT; COMMIT",
                "refused or failed before COMMIT: INCRBY <ns>:stock:<sku> q (Lua, only if the stock \
                 was not rewritten from MySQL since the take)",
                "COMMIT outcome unknown: DEL <ns>:stock:<sku> for every SKU of the batch until an \
                 admin reconciles",
            ],
            failure_mode: "Redis decides who gets a unit, MySQL still records the sale: every \
                           MySQL write is guarded by stock >= units, so a unit is never sold \
                           twice. If Redis loses writes (a failover before replication, a \
                           restart without persistence), it shows more stock than MySQL: \
                           buyers it lets through are refused by MySQL until an admin \
                           reconciles, which rewrites Redis from MySQL. A crash between the Lua \
                           script and the MySQL commit leaves units taken and unsold \
                           (undersell) until that reconcile: with group commit, the units of \
                           every order queued or in the batch being written.",
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
    /// This replica's group committer, started with the first order sold here.
    fn committer(&self, flow: &SaleFlow) -> &GroupCommit {
        self.committer.get_or_init(|| {
            GroupCommit::start(
                flow.store.records.clone(),
                flow.store.cache.clone(),
                self.name(),
                flow.replica_id.clone(),
            )
        })
    }

    /// The order itself; `place_order` records it on the timeline.
    ///
    /// The simulated work comes before the take, so that between the take's answer
    /// and the queue there is no await: a dropped order future (the order runs in a
    /// task of its own, so a hang-up does not drop it; a runtime shutting down would)
    /// cannot leave units taken that nobody records or gives back. Once queued, the
    /// committer settles the order whether or not anyone waits for its answer.
    async fn buy(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        flow.simulate_work().await;
        let generation = match flow
            .store
            .cache
            .take(&order.sku, order.quantity, options.epoch)
            .await?
        {
            Taken::UnknownSku => return Err(flow.missing_stock(order).await),
            // Its SKU changed since the order began; `refused` republishes MySQL's
            // settings if Redis disagrees with them.
            Taken::SaleChanged => return Err(flow.refused(order, Refusal::SaleChanged).await),
            Taken::NotEnough { available } => {
                return Err(OrderError::SoldOut {
                    available: available.max(0),
                    requested: order.quantity,
                });
            }
            Taken::Done { generation, .. } => generation,
        };
        let pending = self.committer(flow).submit(TakenOrder {
            order: order.clone(),
            epoch: options.epoch,
            generation,
        });
        // Answered after the batch's COMMIT, with the units already settled: given
        // back if refused or failed before COMMIT, kept (and the SKU's stock dropped)
        // if COMMIT's outcome is unknown. A committer that ended without settling the
        // order (`GroupCommitLost`) leaves its units unknown: the stock is dropped here.
        // Dropping it again for a settled failure could undo a reconcile made since.
        match pending.recorded().await {
            Ok(Ok(committed)) => Ok(committed.order),
            Ok(Err(refusal)) => Err(flow.refused(order, refusal).await),
            Err(error @ StoreError::GroupCommitLost) => Err(flow.commit_failed(order, error).await),
            Err(error) => Err(error.into()),
        }
    }
}
