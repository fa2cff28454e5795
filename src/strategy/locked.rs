//! Every strategy that is "take this lock, then run the shared critical section":
//! redis-lock, db-unique, zookeeper, etcd and redlock. The lock is the only thing that
//! differs between them, so one implementation serves all five and each of them is
//! data: its explanation and its lock (see `registry`).

use async_trait::async_trait;

use super::{Explanation, LockView, OrderError, OrderOptions, SaleFlow, Strategy};
use crate::lock::DistributedLock;
use crate::lock::cohort::Cohort;
use crate::model::{NewOrder, Order, Sku};

pub struct LockStrategy<L: DistributedLock> {
    pub explanation: Explanation,
    /// The lock, with the cohort layer around it (on or off per order).
    pub lock: Cohort<L>,
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
