//! `redis-atomic`: no lock at all. One Lua script checks and decrements the stock in
//! Redis atomically (Redis runs scripts one at a time), then the order is recorded in
//! MySQL, together with the other orders this replica took units for at the same
//! moment: one transaction per batch (`store::group_commit`), answered after its
//! COMMIT. If the write is refused or fails, the units are given back. The ceiling the
//! lock strategies are measured against.

use std::sync::OnceLock;

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
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
            summary: "The check and the decrement are one Lua script, and Redis runs scripts \
                      one at a time, so two buyers can never take the same unit. The order is \
                      then recorded in MySQL with a relative decrement, together with every \
                      order this replica took units for meanwhile: one transaction per batch \
                      (group commit), one fsync for all of them, and each shopper answered only \
                      after that COMMIT. If the write is refused or fails, the units are given \
                      back. Nothing waits for a lock: this is the fastest safe design, and the \
                      ceiling the locks are measured against.",
            commands: vec![
                "Lua: if GET <ns>:stock-epoch:<sku> <= <epoch> and GET <ns>:stock:<sku> >= q \
                 then DECRBY <ns>:stock:<sku> q",
                "queue the order to this replica's committer, which takes every order queued \
                 (at most 64; no waiting: an order alone is committed at once)",
                "BEGIN; SELECT value FROM cluster_settings WHERE name = 'epoch'; per SKU: \
                 UPDATE products p SET p.stock = p.stock - <its orders' units>, \
                 p.version = p.version + 1 WHERE p.sku = ? AND p.epoch <= <epoch> \
                 AND p.stock >= <its orders' units>; \
                 INSERT INTO orders ... VALUES (...), (...), ... RETURNING id, ...; COMMIT",
                "a SKU whose UPDATE matched nothing: its orders one by one, each in its own \
                 BEGIN; UPDATE ... p.stock >= q; INSERT; COMMIT, so each is refused precisely",
                "refused or failed before COMMIT: INCRBY <ns>:stock:<sku> q (Lua, only if the stock \
                 was not rewritten from MySQL since the take)",
                "COMMIT outcome unknown: DEL <ns>:stock:<sku> for every SKU of the batch until an \
                 admin reconciles",
            ],
            failure_mode: "Redis is the authority for the stock: if Redis loses writes (a \
                           failover before replication, a restart without persistence), units \
                           can be sold twice or vanish until Redis is rebuilt from MySQL \
                           (reconcile). A crash between the Lua script and the MySQL commit \
                           loses the units taken (undersell) until an admin reconciles, which \
                           rewrites the stock from MySQL: with group commit, the units of every \
                           order queued or in the batch being written.",
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
