//! `optimistic`: no lock. Read the stock and the row's version, then write only if the
//! version is unchanged; on a conflict, back off and retry, a bounded number of times.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::{
    Explanation, Family, LockView, OrderError, OrderOptions, SaleFlow, Strategy, ensure_in_stock,
};
use crate::lock::jittered_backoff;
use crate::model::{NewOrder, Order, Sku};
use crate::store::{ClusterEvent, Refusal, StockWrite};

/// The first wait after a conflict, per buyer of this replica contending for the SKU:
/// a loser should come back about when the others have had their turn, and a turn is
/// one winner's read-to-commit time, about 1 ms here. A replica sees only its own
/// buyers, so the 3 ms assumes the cluster's three replicas sell alike; where that is
/// wrong, the doubling after each further conflict corrects it. A fixed first wait is
/// too short when many contend, so they conflict again and the database spends a
/// read, an update and a rollback on each, and too long for a buyer alone. At 30
/// connections (10 a replica) 3 ms per contender sold 1.11× the orders of a fixed
/// 8 ms and halved the conflicts (docs/benchmarks-notes.md, item 21).
const BACKOFF_PER_CONTENDER: Duration = Duration::from_millis(3);
const BACKOFF_CAP: Duration = Duration::from_millis(100);

pub struct OptimisticStrategy {
    /// Attempts before answering 503 (the first try included).
    max_attempts: u32,
    /// This replica's buyers trying to buy, per SKU: what a conflict's backoff scales with.
    contenders: Contenders,
}

#[async_trait]
impl Strategy for OptimisticStrategy {
    fn name(&self) -> &'static str {
        "optimistic"
    }

    fn explanation(&self) -> Explanation {
        Explanation {
            name: self.name(),
            title: "Optimistic concurrency (version column)",
            family: Family::Database,
            summary: "No lock is taken. The replica reads the product's stock and version, \
                      works, then updates the row only if the version is still the one it \
                      read; if another writer came first, it backs off and tries again.",
            adds: "A backoff that grows with this replica's buyers contending for the \
                   product (3 ms each, doubling per conflict, at most 100 ms); an immediate \
                   ROLLBACK of a refused UPDATE, which holds the hot row; Redis written \
                   only with a newer version.",
            commands: vec![
                "SELECT p.stock, p.version, e.value, p.epoch FROM products p \
                 JOIN cluster_settings e ON e.name = 'epoch' WHERE p.sku = ?",
                "BEGIN; UPDATE products p SET p.stock = p.stock - ?, p.version = p.version + 1 \
                 WHERE p.sku = ? AND p.epoch <= <epoch> AND p.version = ? AND p.stock >= ?; \
                 INSERT INTO orders ...; COMMIT",
                "0 rows updated: ROLLBACK at once (the refused UPDATE holds the row's lock), \
                 sleep (jittered; 3 ms per buyer of this replica contending, doubling with \
                 each conflict, at most 100 ms), read again, retry",
                "Lua: if version > cached version then SET <ns>:stock:<sku>, SET <ns>:stock-version:<sku>",
            ],
            failure_mode: "Retry storm: under heavy contention on one row most attempts conflict, \
                           so work is wasted and latency grows; buyers can give up (503) while \
                           stock is left (503 too_many_conflicts). Great when conflicts are \
                           rare, poor for one hot SKU.",
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
        let row = flow.store.records.stock_and_version(sku).await?;
        let state = match row {
            Some((stock, version)) => {
                format!("no lock: products row sku='{sku}' stock={stock} version={version}")
            }
            None => format!("no products row for sku='{sku}'"),
        };
        Ok(LockView {
            state: vec![state],
            ..LockView::default()
        })
    }
}

impl OptimisticStrategy {
    pub fn new(max_attempts: u32) -> Self {
        debug_assert!(max_attempts > 0, "the configuration allows 1 to 1000");
        Self {
            max_attempts,
            contenders: Contenders::default(),
        }
    }

    /// The order itself; `place_order` records it on the timeline.
    async fn buy(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let store = &flow.store;
        let contending = self.contenders.enter(&order.sku);
        let mut attempts = 0;
        loop {
            // Read first, also after the last conflict: a write refused because the
            // sale moved on or sold out answers that, not "too many conflicts".
            let row = store
                .records
                .optimistic_read(&order.sku)
                .await?
                .ok_or_else(|| OrderError::UnknownSku(order.sku.to_string()))?;
            if !row.is_current_for(options.epoch) {
                return Err(flow.refused(order, Refusal::SaleChanged).await);
            }
            ensure_in_stock(row.stock, order)?;
            if attempts == self.max_attempts {
                break;
            }
            flow.simulate_work().await;
            let write = StockWrite::DecrementAtVersion {
                version: row.version,
                limit_per_user: row.limit_per_user,
            };
            let committed = store
                .records
                .commit_order(order, write, options.epoch, self.name(), &flow.replica_id)
                .await;
            match committed {
                Ok(Ok(committed)) => {
                    drop(contending);
                    flow.write_cache(order, row.stock - order.quantity, committed.version, "")
                        .await;
                    return Ok(committed.order);
                }
                // The row moved on (another writer, a reset...): the next read says how.
                Ok(Err(Refusal::VersionChanged)) => {}
                Ok(Err(refusal)) => return Err(flow.refused(order, refusal).await),
                Err(error) => return Err(flow.commit_failed(order, error).await),
            }
            store
                .cluster
                .count(self.name(), ClusterEvent::OptimisticConflict)
                .await;
            // After the last attempt only the read that finds the answer is left.
            if attempts + 1 < self.max_attempts {
                let wait = conflict_wait(attempts, contending.count());
                tokio::select! {
                    // A shopper who left wins over a sleep that ended too.
                    biased;
                    // Nothing is held between attempts, so a shopper who left (hung
                    // up, timed out) leaves nothing behind and is not retried for.
                    () = options.client_gone.cancelled() => return Err(OrderError::Abandoned),
                    () = tokio::time::sleep(wait) => {}
                }
            }
            attempts += 1;
        }
        store
            .cluster
            .count(self.name(), ClusterEvent::OptimisticGaveUp)
            .await;
        Err(OrderError::GaveUp(format!(
            "{} optimistic attempts all conflicted with other writers; try again",
            self.max_attempts
        )))
    }
}

/// The sleep after conflict number `attempt` (from 0) among `contenders` buyers of the
/// replica (the one backing off included).
fn conflict_wait(attempt: u32, contenders: usize) -> Duration {
    let contenders = u32::try_from(contenders.max(1)).unwrap_or(u32::MAX);
    let base = BACKOFF_PER_CONTENDER.saturating_mul(contenders);
    jittered_backoff(attempt, base, BACKOFF_CAP)
}

/// How many of this replica's buyers are contending for each SKU. Only a hint for
/// the backoff: nobody waits for anybody here, so optimistic stays lock-free.
#[derive(Default)]
struct Contenders {
    by_sku: Mutex<HashMap<Sku, usize>>,
}

/// One buyer counted among its SKU's contenders until dropped: when it has bought,
/// been refused, given up or left, or when its order's task is cut.
struct Contending<'a> {
    contenders: &'a Contenders,
    sku: &'a Sku,
}

impl Contenders {
    fn enter<'a>(&'a self, sku: &'a Sku) -> Contending<'a> {
        *self.counts().entry(sku.clone()).or_insert(0) += 1;
        Contending {
            contenders: self,
            sku,
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Sku, usize>> {
        self.by_sku.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Contending<'_> {
    fn count(&self) -> usize {
        let count = self.contenders.counts().get(self.sku).copied();
        debug_assert!(count.is_some(), "a contender is counted until dropped");
        count.unwrap_or(1)
    }
}

impl Drop for Contending<'_> {
    fn drop(&mut self) {
        let mut counts = self.contenders.counts();
        let Some(count) = counts.get_mut(self.sku) else {
            debug_assert!(false, "a contender is counted until dropped");
            return;
        };
        *count -= 1;
        if *count == 0 {
            counts.remove(self.sku);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Waker};

    use super::*;

    fn sku(name: &str) -> Sku {
        Sku::try_from(name.to_owned()).unwrap()
    }

    #[test]
    fn contenders_are_counted_per_sku_until_they_leave() {
        let contenders = Contenders::default();
        let (hot, cold) = (sku("hot"), sku("cold"));
        let first = contenders.enter(&hot);
        let second = contenders.enter(&hot);
        let other = contenders.enter(&cold);
        assert_eq!((first.count(), other.count()), (2, 1));
        drop(second);
        assert_eq!(first.count(), 1);
        drop((first, other));
        assert!(
            contenders.counts().is_empty(),
            "no SKU is kept once nobody contends"
        );
    }

    #[test]
    fn a_buyer_cut_while_backing_off_stops_counting() {
        let contenders = Contenders::default();
        let hot = sku("hot");
        let mut backing_off = Box::pin(async {
            let _contending = contenders.enter(&hot);
            std::future::pending::<()>().await;
        });
        let mut context = Context::from_waker(Waker::noop());
        assert!(backing_off.as_mut().poll(&mut context).is_pending());
        assert_eq!(contenders.counts().get(&hot), Some(&1));
        drop(backing_off);
        assert!(contenders.counts().is_empty());
    }

    #[test]
    fn the_wait_grows_with_the_contenders_and_the_conflicts_up_to_the_cap() {
        let within = |attempt, contenders, low, high| {
            for _ in 0..100 {
                let wait = conflict_wait(attempt, contenders);
                assert!(
                    (ms(low)..=ms(high)).contains(&wait),
                    "conflict {attempt}, {contenders} contenders: {wait:?}"
                );
            }
        };
        within(0, 0, 1, 3);
        within(0, 1, 1, 3);
        within(0, 10, 15, 30);
        within(1, 10, 30, 60);
        within(2, 10, 50, 100);
        within(0, 40, 50, 100);
        // Past u32's contenders the base saturates rather than wrapping to nothing.
        within(0, (u32::MAX as usize).saturating_add(1), 50, 100);
    }

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }
}
