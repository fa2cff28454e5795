//! The one place an order is written to MySQL, for every strategy.
//!
//! An order's transaction updates the product row and inserts the order. What the
//! update may assume differs per strategy (`StockWrite`), but every variant is one
//! conditional `UPDATE` that also joins two rows which make the guarantees:
//!
//! - the sale epoch (`cluster_settings.epoch`): the order only commits while the epoch
//!   it started under is current. The join takes a shared lock on that row, so an
//!   admin change (switch, reset, reconcile) waits for commits in flight and every
//!   later commit of an older epoch finds zero rows;
//! - with fencing, the lock service's fence (`product_fences`): the holder registered
//!   its token when it took the lock, and its write only lands while the fence is still
//!   its token (no newer holder has begun) *and* the stock is still the one it read. A
//!   fence checked only against the last write would let a holder whose read predates
//!   a newer holder's commit write a stale stock; comparing the read closes that.
//!
//! When the update matches nothing, one diagnostic read in the same transaction says
//! why (`Refusal`), so callers can answer precisely and repair the cache.
//!
//! The row's new version comes back through `LAST_INSERT_ID(expr)`, which MySQL
//! reports with the statement's result: no extra round trip.

use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{MySql, Transaction};

use super::StoreError;
use super::records::{Records, insert_order};
use crate::model::{NewOrder, Order, Sku};

/// How an order changes the product's stock.
#[derive(Debug, Clone, Copy)]
pub enum StockWrite {
    /// Lock strategies: write the absolute value computed from the stock they read.
    /// Without a fence this is exactly the write that loses updates when the lock
    /// fails; with one it lands only if the read is still MySQL's.
    Set {
        new_stock: i64,
        fence: Option<Fence>,
    },
    /// optimistic: decrement, only if the row is still at the version read.
    DecrementAtVersion { version: i64 },
    /// redis-atomic and db-for-update: decrement, only if the stock covers it.
    Decrement,
}

/// A lock holder's fencing token and the stock its write was computed from.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    pub token: u64,
    pub read_stock: i64,
}

/// Why an order's write matched no row; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    UnknownSku,
    /// The sale epoch moved on (a strategy switch, reset or reconcile): retry.
    SaleChanged,
    /// A holder with a newer token registered since this one took the lock.
    Fenced {
        token: u64,
    },
    /// The stock this holder read is no longer MySQL's (a newer write landed before
    /// its cache write, or its read was stale). MySQL's stock and version are given so
    /// the caller can repair the cache.
    StaleRead {
        stock: i64,
        version: i64,
    },
    /// optimistic: another writer changed the row first.
    VersionChanged,
    NotEnough {
        stock: i64,
    },
}

/// An order recorded, with the product row's version after it (for the cache write,
/// which only lands if no newer version is cached).
#[derive(Debug, Clone)]
pub struct Committed {
    pub order: Order,
    pub version: i64,
}

/// MySQL's "deadlock found": the statement was rolled back and may be retried.
pub(crate) const DEADLOCK: u16 = 1213;
/// MySQL's "lock wait timeout exceeded".
const LOCK_WAIT_TIMEOUT: u16 = 1205;

pub(crate) fn mysql_error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(e) => e
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Registers a lock holder's token as the SKU's fence for its lock service, as soon as
/// it holds the lock and before it reads anything. The fence only moves forward; a
/// holder whose token is already overtaken finds out at its commit.
impl Records {
    pub async fn register_fence(
        &self,
        sku: &Sku,
        lock_service: &str,
        token: u64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO product_fences (sku, lock_service, fence) VALUES (?, ?, ?)
         ON DUPLICATE KEY UPDATE fence = GREATEST(fence, VALUES(fence))",
        )
        .bind(sku.as_str())
        .bind(lock_service)
        .bind(token)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Writes the order in one transaction: the conditional stock update, then the order
    /// row. `Ok(Err(refusal))` when the update's conditions did not hold.
    pub async fn commit_order(
        &self,
        order: &NewOrder,
        write: StockWrite,
        epoch: u64,
        strategy: &str,
        replica: &str,
    ) -> Result<Result<Committed, Refusal>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let written = write_order(&mut tx, order, write, epoch, strategy, replica).await?;
        match written {
            Ok(committed) => {
                tx.commit()
                    .await
                    .map_err(StoreError::CommitOutcomeUnknown)?;
                Ok(Ok(committed))
            }
            Err(refusal) => {
                tx.rollback().await?;
                Ok(Err(refusal))
            }
        }
    }

    /// Starts a transaction holding the product's row lock (`SELECT … FOR UPDATE`, by the
    /// primary key, so one row is locked). The wait for the row is bounded by
    /// `innodb_lock_wait_timeout` for this one statement (`SET STATEMENT … FOR`), so the
    /// setting never stays on the pooled connection. InnoDB counts it in whole seconds.
    /// `None` for an unknown SKU.
    pub async fn lock_product(
        &self,
        sku: &Sku,
        wait: Duration,
    ) -> Result<Option<LockedProduct>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let seconds = wait.as_secs().max(1) + u64::from(wait.subsec_nanos() > 0);
        // The number is ours, not input; MariaDB takes no placeholder in SET STATEMENT.
        let statement = format!(
            "SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR
         SELECT stock FROM products WHERE sku = ? FOR UPDATE"
        );
        let row: Option<i64> = match sqlx::query_scalar(sqlx::AssertSqlSafe(statement))
            .bind(sku.as_str())
            .fetch_optional(&mut *tx)
            .await
        {
            Err(error) if mysql_error_number(&error) == Some(LOCK_WAIT_TIMEOUT) => {
                return Err(StoreError::RowLockTimeout);
            }
            other => other?,
        };
        Ok(row.map(|stock| LockedProduct { tx, stock }))
    }
}

/// The update and the insert inside the caller's transaction.
async fn write_order(
    tx: &mut Transaction<'static, MySql>,
    order: &NewOrder,
    write: StockWrite,
    epoch: u64,
    strategy: &str,
    replica: &str,
) -> Result<Result<Committed, Refusal>, StoreError> {
    let epoch_text = epoch.to_string();
    let sku = order.sku.as_str();
    let updated = match write {
        StockWrite::Set {
            new_stock,
            fence: None,
        } => {
            sqlx::query(
                "UPDATE products p JOIN cluster_settings e ON e.name = 'epoch'
                 SET p.stock = ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND e.value = ?",
            )
            .bind(new_stock)
            .bind(sku)
            .bind(&epoch_text)
            .execute(&mut **tx)
            .await?
        }
        StockWrite::Set {
            new_stock,
            fence: Some(fence),
        } => {
            sqlx::query(
                "UPDATE products p JOIN cluster_settings e ON e.name = 'epoch'
                   JOIN product_fences f ON f.sku = p.sku AND f.lock_service = ?
                 SET p.stock = ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND e.value = ? AND f.fence = ? AND p.stock = ?",
            )
            .bind(strategy)
            .bind(new_stock)
            .bind(sku)
            .bind(&epoch_text)
            .bind(fence.token)
            .bind(fence.read_stock)
            .execute(&mut **tx)
            .await?
        }
        StockWrite::DecrementAtVersion { version } => {
            sqlx::query(
                "UPDATE products p JOIN cluster_settings e ON e.name = 'epoch'
                 SET p.stock = p.stock - ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND e.value = ? AND p.version = ? AND p.stock >= ?",
            )
            .bind(order.quantity)
            .bind(sku)
            .bind(&epoch_text)
            .bind(version)
            .bind(order.quantity)
            .execute(&mut **tx)
            .await?
        }
        StockWrite::Decrement => {
            sqlx::query(
                "UPDATE products p JOIN cluster_settings e ON e.name = 'epoch'
                 SET p.stock = p.stock - ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND e.value = ? AND p.stock >= ?",
            )
            .bind(order.quantity)
            .bind(sku)
            .bind(&epoch_text)
            .bind(order.quantity)
            .execute(&mut **tx)
            .await?
        }
    };
    if updated.rows_affected() == 0 {
        return Ok(Err(diagnose(tx, order, write, &epoch_text, strategy).await?));
    }
    let version = i64::try_from(updated.last_insert_id()).unwrap_or(i64::MAX);
    let recorded = insert_order(tx, order, strategy, replica).await?;
    Ok(Ok(Committed {
        order: recorded,
        version,
    }))
}

/// Why the update matched nothing, read inside the same transaction.
async fn diagnose(
    tx: &mut Transaction<'static, MySql>,
    order: &NewOrder,
    write: StockWrite,
    epoch: &str,
    strategy: &str,
) -> Result<Refusal, StoreError> {
    let row: Option<(i64, i64, String, Option<u64>)> = sqlx::query_as(
        "SELECT p.stock, p.version, e.value, f.fence
         FROM products p JOIN cluster_settings e ON e.name = 'epoch'
           LEFT JOIN product_fences f ON f.sku = p.sku AND f.lock_service = ?
         WHERE p.sku = ?",
    )
    .bind(strategy)
    .bind(order.sku.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    let Some((stock, version, current_epoch, fence)) = row else {
        return Ok(Refusal::UnknownSku);
    };
    if current_epoch != epoch {
        return Ok(Refusal::SaleChanged);
    }
    Ok(match write {
        StockWrite::Set {
            fence: Some(mine), ..
        } if fence != Some(mine.token) => Refusal::Fenced { token: mine.token },
        StockWrite::Set { .. } => Refusal::StaleRead { stock, version },
        StockWrite::DecrementAtVersion { version: read } if read != version => {
            Refusal::VersionChanged
        }
        StockWrite::DecrementAtVersion { .. } | StockWrite::Decrement => {
            Refusal::NotEnough { stock }
        }
    })
}

/// A product row locked `FOR UPDATE` inside an open transaction (db-for-update).
/// Dropping it rolls the transaction back and frees the row.
pub struct LockedProduct {
    tx: Transaction<'static, MySql>,
    pub stock: i64,
}

impl LockedProduct {
    /// Decrements the stock and inserts the order, then commits, releasing the row.
    pub async fn commit_order(
        mut self,
        order: &NewOrder,
        epoch: u64,
        strategy: &str,
        replica: &str,
    ) -> Result<Result<Committed, Refusal>, StoreError> {
        let written = write_order(
            &mut self.tx,
            order,
            StockWrite::Decrement,
            epoch,
            strategy,
            replica,
        )
        .await?;
        match written {
            Ok(committed) => {
                self.tx
                    .commit()
                    .await
                    .map_err(StoreError::CommitOutcomeUnknown)?;
                Ok(Ok(committed))
            }
            Err(refusal) => {
                self.tx.rollback().await?;
                Ok(Err(refusal))
            }
        }
    }
}
