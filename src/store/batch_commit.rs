//! Combining's write (`strategy::combine`): the orders a lock holder sells in its one
//! critical section, recorded by one transaction under its one lock.
//!
//! ```text
//! BEGIN
//! SELECT <sale epoch>, <the SKU's limit per user>           -- as for one order
//! UPDATE products … SET stock = <read − the batch's units>  -- `set_stock`, fenced or not
//! INSERT INTO orders VALUES (…), (…), … RETURNING id, …
//! (the orders' idempotency claims settled)
//! COMMIT
//! ```
//!
//! What one order's write decides, the batch decides for all its orders: the SKU's
//! epoch, the fence and the stock read. What only one order can be refused for (an
//! idempotency key recorded already, a user past the SKU's limit) is left to one-order
//! transactions: a batch holding such an order, or for a SKU with a limit per user,
//! writes nothing (`BatchWritten::OneByOne`) and the holder records its orders one by
//! one, still under its lock (`Records::commit_order`).

use super::StoreError;
use super::idempotency::settle_in_order;
use super::order_commit::{Fence, diagnose, sale_epoch_and_limit, set_stock};
use super::records::{Records, insert_orders, is_duplicate_key};
use super::{Committed, Refusal, StockWrite};
use crate::model::NewOrder;

/// What became of a batch's write.
#[derive(Debug)]
pub enum BatchWritten {
    /// Every order recorded, in the order given.
    All(Vec<Committed>),
    /// Refused for every order alike (the sale changed, the fence moved, the read is
    /// stale): nothing was written.
    Refused(Refusal),
    /// An order of the batch must be judged alone: nothing was written.
    OneByOne,
}

impl Records {
    /// Records `orders` (one SKU, in arrival order, all covered by the stock the holder
    /// read) in one transaction that sets the stock to `new_stock`, with the holder's
    /// `fence` if fencing is on. The orders are the holder's, of sale epoch `epoch`.
    pub async fn commit_batch(
        &self,
        orders: &[&NewOrder],
        new_stock: i64,
        fence: Option<Fence>,
        epoch: u64,
        strategy: &str,
        replica: &str,
    ) -> Result<BatchWritten, StoreError> {
        let Some(first) = orders.first() else {
            return Ok(BatchWritten::All(Vec::new()));
        };
        let sku = first.sku.as_str();
        let mut tx = self.begin().await?;
        let (sale_epoch, limit_per_user) = sale_epoch_and_limit(&mut tx, sku).await?;
        if sale_epoch < epoch {
            tx.rollback().await?;
            return Ok(BatchWritten::Refused(Refusal::SaleChanged));
        }
        // Each order's units count against its user's limit: `write_order` checks that.
        if limit_per_user.is_some() {
            tx.rollback().await?;
            return Ok(BatchWritten::OneByOne);
        }
        let updated = set_stock(&mut tx, sku, new_stock, fence, epoch, strategy).await?;
        if updated.rows_affected() == 0 {
            let write = StockWrite::Set { new_stock, fence };
            let refusal = diagnose(&mut tx, first, write, epoch, strategy).await?;
            tx.rollback().await?;
            return Ok(BatchWritten::Refused(refusal));
        }
        let version = i64::try_from(updated.last_insert_id()).unwrap_or(i64::MAX);
        // Refused by an order alone: rolled back at once, so that the product row is
        // free for the one-order transactions that follow.
        let recorded = match insert_orders(&mut tx, orders, strategy, replica).await {
            Err(StoreError::Mysql(error)) if is_duplicate_key(&error) => {
                tx.rollback().await?;
                return Ok(BatchWritten::OneByOne);
            }
            recorded => recorded?,
        };
        let keys: Vec<_> = orders.iter().map(|o| o.idempotency.as_ref()).collect();
        if !settle_in_order(&mut tx, &recorded.iter().collect::<Vec<_>>(), &keys).await? {
            tx.rollback().await?;
            return Ok(BatchWritten::OneByOne);
        }
        tx.commit()
            .await
            .map_err(StoreError::CommitOutcomeUnknown)?;
        Ok(BatchWritten::All(
            recorded
                .into_iter()
                .map(|order| Committed { order, version })
                .collect(),
        ))
    }
}
