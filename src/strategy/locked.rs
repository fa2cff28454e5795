//! Every strategy that is "take this lock, then run the shared critical section":
//! redis-lock, db-unique, zookeeper, etcd and redlock. The lock is the only thing that
//! differs between them, so one implementation serves all five and each of them is
//! data: its explanation and its lock (see `registry`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::lock::DistributedLock;
use crate::lock::cohort::Cohort;
use crate::model::{NewOrder, Order, Sku};

/// What the cohort layer adds to every lock, said on each lock's card.
const COHORT: &str = "Around the lock, the cohort layer (on unless switched off): a \
                      replica's requests for a SKU queue locally, and a holder hands the \
                      lock to the next of them instead of releasing it, up to 8 in a row; for \
                      db-unique and Redlock a release is announced on Redis and each \
                      replica's first waiter asks again at once. With combining switched on \
                      (combine N), a holder also sells up to N orders queued for the SKU in \
                      its replica in its one critical section: one read, one transaction.";

pub struct LockStrategy<L: DistributedLock> {
    explanation: Explanation,
    /// The lock, with the cohort layer around it (on or off per order).
    lock: Cohort<L>,
}

impl<L: DistributedLock> LockStrategy<L> {
    /// `lock` with the layer around it; its card says what the layer adds. (The card
    /// is made once per replica: its text is kept for the process's life.)
    pub fn new(mut explanation: Explanation, lock: Cohort<L>) -> Self {
        explanation.adds = format!("{} {COHORT}", explanation.adds).leak();
        LockStrategy { explanation, lock }
    }
}

#[async_trait]
impl<L: DistributedLock> Strategy for LockStrategy<L> {
    fn name(&self) -> &'static str {
        self.explanation.name
    }

    fn explanation(&self) -> Explanation {
        self.explanation.clone()
    }

    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError> {
        let lock = self.lock.with(options.cohort);
        flow.sell_locked(&lock, order, self.name(), options).await
    }

    async fn inspect(&self, _flow: &SaleFlow, sku: &Sku) -> Result<LockView, OrderError> {
        Ok(self.lock.lock().view(sku.as_str()).await?)
    }
}
