//! The one place an order is written to MySQL, for every strategy (redis-atomic's
//! batches too: `group_commit.rs` runs `decrement` once per SKU of a batch, and any
//! order it cannot commit with its batch through `commit_order`).
//!
//! An order's transaction updates the product row and inserts the order. What the
//! update may assume differs per strategy (`StockWrite`), but every variant is one
//! conditional `UPDATE` of the product row, with two conditions that make the
//! guarantees:
//!
//! - the SKU's epoch (`products.epoch`, the sale epoch of the last change that
//!   concerned the SKU): the order only commits while its SKU has not changed since
//!   the sale epoch it started under. A change writes the epoch of the SKUs it concerns
//!   under their row locks, so it waits for their commits in flight, and every later
//!   commit of an order from before a change of its SKU (a reset or reconcile of it,
//!   or a switch, which concerns every SKU) finds zero rows. A change of another SKU
//!   refuses nothing. Before the `UPDATE`, a plain read of the sale epoch
//!   (`cluster_settings.epoch`) refuses an order of an epoch MySQL never reached
//!   (Redis ahead of a restored MySQL). It takes no lock: the sale epoch only grows,
//!   so what it lets through stays true. (The `UPDATE` used to join the epoch row,
//!   which locked it shared, but InnoDB locks the updated row first: an order then
//!   held its product row while it waited for the epoch row behind a change, which
//!   held the epoch row while it waited for product rows, and InnoDB killed one of
//!   them as a deadlock, a whole group commit batch with it.);
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

use sqlx::mysql::{MySqlDatabaseError, MySqlQueryResult};
use sqlx::{MySql, Transaction};

use super::StoreError;
use super::idempotency::settle_in_order;
use super::records::{Records, insert_order};
use crate::model::{NewOrder, Order, Sku};
use crate::mysql_pool::on_live_connection;

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
    /// optimistic: decrement, only if the row is still at the version read. The SKU's
    /// limit per user comes with that read (`Records::optimistic_read`).
    DecrementAtVersion {
        version: i64,
        limit_per_user: Option<i64>,
    },
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
    /// The sale changed since the order began, in a way that concerns its SKU (a
    /// switch, a reset or reconcile of the SKU), or Redis is ahead of MySQL: retry.
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
    /// optimistic: the row is no longer at the version read (another writer came
    /// first, or the sale moved on, or too little is left: its next read tells).
    VersionChanged,
    NotEnough {
        stock: i64,
    },
    /// The user would pass the SKU's limit per user with this order.
    LimitReached,
    /// An order with the same idempotency key is recorded already, or the key's
    /// claim is no longer this order's (`idempotency::settle_in_order`).
    Duplicate,
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
///
/// Only while the SKU has not changed since the holder's `epoch` (a locking read of the
/// product row, so it waits for a reset in progress): a reset clears the SKU's fences
/// so that a wiped lock service can fence again, and a holder from before the reset
/// must not put its old, high token back afterwards. Such a holder registers nothing;
/// its commit is refused for the epoch anyway. (Only the product row is locked: a
/// change locks the epoch row first, then the product rows, so also asking for the
/// epoch row here could deadlock with it.)
impl Records {
    pub async fn register_fence(
        &self,
        sku: &Sku,
        lock_service: &str,
        token: u64,
        epoch: u64,
    ) -> Result<(), StoreError> {
        // Idempotent (the fence only moves up to `token`): safe to send again.
        let register = || {
            sqlx::query(
                "INSERT INTO product_fences (sku, lock_service, fence)
                 SELECT sku, ?, ? FROM products
                 WHERE sku = ? AND epoch <= ? LOCK IN SHARE MODE
                 ON DUPLICATE KEY UPDATE fence = GREATEST(fence, VALUES(fence))",
            )
            .bind(lock_service)
            .bind(token)
            .bind(sku.as_str())
            .bind(epoch)
            .execute(self.pool())
        };
        on_live_connection(self.pool(), register).await?;
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
        let mut tx = self.begin().await?;
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
    /// primary key, so one row is locked), for an order of sale epoch `epoch`.
    ///
    /// The sale epoch is read without a lock (see the module comment) and the product
    /// row is the only lock the order takes: an admin change locks the epoch row, then
    /// the product rows it concerns, so it waits for the holder and the holder waits
    /// for nothing the change holds. (Taking the product row first and the epoch row
    /// at the commit's `UPDATE … JOIN` deadlocked against any change; taking the epoch
    /// row shared first made a reset of one SKU wait for every row lock holder of the
    /// others.)
    ///
    /// Each wait is bounded by `innodb_lock_wait_timeout` for that one statement (`SET
    /// STATEMENT … FOR`), so the setting never stays on the pooled connection. InnoDB
    /// counts it in whole seconds.
    pub async fn lock_product(
        &self,
        sku: &Sku,
        epoch: u64,
        wait: Duration,
    ) -> Result<Result<LockedProduct, Refusal>, StoreError> {
        let mut tx = self.begin().await?;
        let seconds = innodb_wait_seconds(wait);
        // The number is ours, not input; MariaDB takes no placeholder in SET STATEMENT.
        let bounded = |statement: &str| {
            sqlx::AssertSqlSafe(format!(
                "SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR {statement}"
            ))
        };
        let sale_epoch = sale_epoch(&mut tx).await?;
        if sale_epoch < epoch {
            return Ok(Err(Refusal::SaleChanged));
        }
        let row: Option<(i64, u64)> = sqlx::query_as(bounded(
            "SELECT stock, epoch FROM products WHERE sku = ? FOR UPDATE",
        ))
        .bind(sku.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(row_lock_error)?;
        match row {
            None => Ok(Err(Refusal::UnknownSku)),
            Some((_, sku_epoch)) if !is_current(epoch, sale_epoch, sku_epoch) => {
                Ok(Err(Refusal::SaleChanged))
            }
            Some((stock, _)) => Ok(Ok(LockedProduct { tx, stock })),
        }
    }
}

/// `innodb_lock_wait_timeout` for a wait: InnoDB counts whole seconds, at least one, so
/// the wait is rounded up and a shopper is never refused before it has passed.
fn innodb_wait_seconds(wait: Duration) -> u64 {
    let whole = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    whole.max(1)
}

/// A lock wait that ran out is its own error (the order answers `lock_timeout`).
fn row_lock_error(error: sqlx::Error) -> StoreError {
    if mysql_error_number(&error) == Some(LOCK_WAIT_TIMEOUT) {
        StoreError::RowLockTimeout
    } else {
        error.into()
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
    let sku = order.sku.as_str();
    // optimistic read the sale epoch with its row just before (`is_current_for`), and
    // the sale epoch only grows: a second read would only widen the window between
    // its read and this write, in which rivals make it conflict (the hot-row test
    // took 14 s instead of 8).
    // The SKU's limit per user is read with the sale epoch (no extra round trip), from
    // the transaction's snapshot: a reset that changes it moves the SKU's epoch, so an
    // order that began before the reset is refused by the `UPDATE` below, and one that
    // began after it sees it.
    let limit_per_user = match write {
        StockWrite::DecrementAtVersion { limit_per_user, .. } => limit_per_user,
        _ => {
            let (sale_epoch, limit_per_user) = sale_epoch_and_limit(tx, sku).await?;
            if sale_epoch < epoch {
                return Ok(Err(Refusal::SaleChanged));
            }
            limit_per_user
        }
    };
    let updated = match write {
        StockWrite::Set { new_stock, fence } => {
            set_stock(tx, sku, new_stock, fence, epoch, strategy).await?
        }
        StockWrite::DecrementAtVersion { version, .. } => {
            sqlx::query(
                "UPDATE products p
                 SET p.stock = p.stock - ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND p.epoch <= ? AND p.version = ? AND p.stock >= ?",
            )
            .bind(order.quantity)
            .bind(sku)
            .bind(epoch)
            .bind(version)
            .bind(order.quantity)
            .execute(&mut **tx)
            .await?
        }
        StockWrite::Decrement => decrement(tx, sku, order.quantity, epoch, Limits::Checked).await?,
    };
    if updated.rows_affected() == 0 {
        // The refused UPDATE holds the product row's lock until the rollback, and on
        // a hot row optimistic losers are many: it re-reads the row before its next
        // attempt anyway, so it gets its answer without the diagnostic read.
        if let StockWrite::DecrementAtVersion { .. } = write {
            return Ok(Err(Refusal::VersionChanged));
        }
        return Ok(Err(diagnose(tx, order, write, epoch, strategy).await?));
    }
    let version = i64::try_from(updated.last_insert_id()).unwrap_or(i64::MAX);
    // The order row before the limit: an order with the key recorded already is the
    // answer (`Duplicate`), not `limit_reached` (the user's units count that order).
    // Refused: the caller rolls back, the update with it.
    let recorded = match insert_order(tx, order, strategy, replica).await? {
        Ok(recorded) => recorded,
        Err(refusal) => return Ok(Err(refusal)),
    };
    if let Some(limit) = limit_per_user
        && bought(tx, order).await? > limit
    {
        return Ok(Err(Refusal::LimitReached));
    }
    // The key's answer is this order, written with it; a claim taken over meanwhile
    // (this holder outlived its hold) refuses the order: the key is the new holder's.
    if !settle_in_order(tx, &[&recorded], &[order.idempotency.as_ref()]).await? {
        return Ok(Err(Refusal::Duplicate));
    }
    Ok(Ok(Committed {
        order: recorded,
        version,
    }))
}

/// `StockWrite::Set`'s statement: the stock a lock holder computed, written while the
/// SKU has not changed since `epoch`, and with a fence only while the fence is still
/// the holder's token and the stock still the one it read. A combined batch
/// (`batch_commit.rs`) runs it once with the stock after all its orders.
pub(super) async fn set_stock(
    tx: &mut Transaction<'static, MySql>,
    sku: &str,
    new_stock: i64,
    fence: Option<Fence>,
    epoch: u64,
    strategy: &str,
) -> Result<MySqlQueryResult, StoreError> {
    let updated =
        match fence {
            None => {
                sqlx::query(
                    "UPDATE products p
                 SET p.stock = ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND p.epoch <= ?",
                )
                .bind(new_stock)
                .bind(sku)
                .bind(epoch)
                .execute(&mut **tx)
                .await?
            }
            Some(fence) => sqlx::query(
                "UPDATE products p JOIN product_fences f ON f.sku = p.sku AND f.lock_service = ?
                 SET p.stock = ?, p.version = LAST_INSERT_ID(p.version + 1)
                 WHERE p.sku = ? AND p.epoch <= ? AND f.fence = ? AND p.stock = ?",
            )
            .bind(strategy)
            .bind(new_stock)
            .bind(sku)
            .bind(epoch)
            .bind(fence.token)
            .bind(fence.read_stock)
            .execute(&mut **tx)
            .await?,
        };
    Ok(updated)
}

/// `StockWrite::Decrement`'s statement: the stock falls by `quantity` only while the
/// SKU has not changed since `epoch` and the stock covers it. The caller has checked
/// that the sale reached `epoch` (`sale_epoch`). A group commit (`group_commit.rs`) runs
/// it once per SKU with the quantity of all its orders together.
///
/// It waits for the product row at most `DECREMENT_ROW_WAIT_SECONDS`. The group
/// committer records one replica's orders one batch at a time, so a batch waiting on a
/// row another transaction holds (an admin's change, a db-for-update holder around a
/// strategy switch, someone's manual transaction) holds up every order queued behind
/// it: InnoDB's default would be 50 s. Past the bound the statement fails before
/// COMMIT (`StoreError::RowLockTimeout`): nothing was written, the orders give their
/// units back and answer 503 busy. db-for-update already holds its row, so the bound
/// never applies there.
///
/// A group commit's `UPDATE` (`Limits::Unlimited`) also matches nothing for a SKU with
/// a limit per user: its orders are then recorded one by one, each checked by
/// `write_order`, at no extra round trip for the SKUs without a limit.
pub(super) async fn decrement(
    tx: &mut Transaction<'static, MySql>,
    sku: &str,
    quantity: i64,
    epoch: u64,
    limits: Limits,
) -> Result<MySqlQueryResult, StoreError> {
    let unlimited = match limits {
        Limits::Checked => "",
        Limits::Unlimited => " AND p.limit_per_user IS NULL",
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        // The number and the condition are constants; MariaDB takes no placeholder in
        // SET STATEMENT.
        "SET STATEMENT innodb_lock_wait_timeout = {DECREMENT_ROW_WAIT_SECONDS} FOR
         UPDATE products p
         SET p.stock = p.stock - ?, p.version = LAST_INSERT_ID(p.version + 1)
         WHERE p.sku = ? AND p.epoch <= ? AND p.stock >= ?{unlimited}"
    )))
    .bind(quantity)
    .bind(sku)
    .bind(epoch)
    .bind(quantity)
    .execute(&mut **tx)
    .await
    .map_err(row_lock_error)
}

/// The sale epoch and the SKU's limit per user, in one plain read inside the caller's
/// transaction (see `sale_epoch` and `write_order`).
pub(super) async fn sale_epoch_and_limit(
    tx: &mut Transaction<'static, MySql>,
    sku: &str,
) -> Result<(u64, Option<i64>), StoreError> {
    let row: Option<(String, Option<i64>)> = sqlx::query_as(
        "SELECT e.value, p.limit_per_user FROM cluster_settings e
           LEFT JOIN products p ON p.sku = ?
         WHERE e.name = 'epoch'",
    )
    .bind(sku)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map_or((0, None), |(epoch, limit)| {
        (epoch.parse().unwrap_or(0), limit)
    }))
}

/// The units `order`'s user bought of its SKU in this sale, this order included: its
/// units added to the user's row of `units_per_user` (created at the first order), in
/// the caller's transaction. One statement, which locks that one row by its primary
/// key until the COMMIT: it serialises only this user's orders of this SKU (the
/// caller holds the product row anyway), and takes no gap lock on `orders`, so orders
/// of other SKUs never wait for it (migration 0011 says why that matters).
///
/// The total comes back through `LAST_INSERT_ID(expr)` when the row existed (two rows
/// affected: MySQL's count for an upsert that updated); a new row holds the order's
/// quantity.
async fn bought(tx: &mut Transaction<'static, MySql>, order: &NewOrder) -> Result<i64, StoreError> {
    let added = sqlx::query(
        "INSERT INTO units_per_user (sku, user_id, units) VALUES (?, ?, ?)
         ON DUPLICATE KEY UPDATE units = LAST_INSERT_ID(units + VALUES(units))",
    )
    .bind(order.sku.as_str())
    .bind(&order.user_id)
    .bind(order.quantity)
    .execute(&mut **tx)
    .await?;
    Ok(match added.rows_affected() {
        1 => order.quantity,
        _ => i64::try_from(added.last_insert_id()).unwrap_or(i64::MAX),
    })
}

/// Whether the orders a decrement is for have their limit per user checked.
#[derive(Debug, Clone, Copy)]
pub(super) enum Limits {
    /// Each order's transaction checks it (`write_order`).
    Checked,
    /// A group commit's multi-row insert, which does not: the SKU must have no limit.
    Unlimited,
}

/// The sale epoch, read inside the caller's transaction without a lock: it only grows,
/// so an order of an epoch it has reached may go on (see the module comment).
pub(super) async fn sale_epoch(tx: &mut Transaction<'static, MySql>) -> Result<u64, StoreError> {
    let value: Option<String> =
        sqlx::query_scalar("SELECT value FROM cluster_settings WHERE name = 'epoch'")
            .fetch_optional(&mut **tx)
            .await?;
    Ok(value.and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// How long a decrement waits for its product row (InnoDB counts whole seconds).
pub(crate) const DECREMENT_ROW_WAIT_SECONDS: u64 = 5;

/// Why the update matched nothing, read inside the same transaction.
pub(super) async fn diagnose(
    tx: &mut Transaction<'static, MySql>,
    order: &NewOrder,
    write: StockWrite,
    epoch: u64,
    strategy: &str,
) -> Result<Refusal, StoreError> {
    // The product row by a locking read: the transaction's snapshot was fixed by its
    // first read, before the `UPDATE` may have waited for the row, so a plain read
    // would judge the row as it was then (a refusal for lack of stock diagnosed as a
    // change of the sale). The transaction already holds the row, so this waits for
    // nothing. The sale epoch and the fence are read from the snapshot: the epoch only
    // grows, and locking the fence row could deadlock with a holder registering its
    // token (fence row, then product row).
    let product: Option<(i64, i64, u64)> = sqlx::query_as(
        "SELECT stock, version, epoch FROM products WHERE sku = ? LOCK IN SHARE MODE",
    )
    .bind(order.sku.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    let Some((stock, version, sku_epoch)) = product else {
        return Ok(Refusal::UnknownSku);
    };
    let (sale_epoch, fence): (String, Option<u64>) = sqlx::query_as(
        "SELECT e.value, f.fence FROM cluster_settings e
           LEFT JOIN product_fences f ON f.sku = ? AND f.lock_service = ?
         WHERE e.name = 'epoch'",
    )
    .bind(order.sku.as_str())
    .bind(strategy)
    .fetch_one(&mut **tx)
    .await?;
    let row = ProductRow {
        stock,
        version,
        epoch: sale_epoch.parse().unwrap_or(0),
        sku_epoch,
        fence,
    };
    // The row cannot have changed since the update (the transaction holds it); if the
    // rules would now let the write through, the epoch moved in between.
    Ok(judge(write, order.quantity, epoch, &row)
        .err()
        .unwrap_or(Refusal::SaleChanged))
}

/// What MySQL holds for a product, as an order's write sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProductRow {
    pub stock: i64,
    pub version: i64,
    /// The sale epoch now.
    pub epoch: u64,
    /// The sale epoch of the last change that concerned the SKU.
    pub sku_epoch: u64,
    /// The SKU's fence for the order's lock service, if one was ever registered.
    pub fence: Option<u64>,
}

/// Whether an order that began at sale epoch `epoch` may still commit, with the sale
/// now at `sale_epoch` and its SKU last changed at `sku_epoch`: no change concerned its
/// SKU since it began, and the sale has reached its epoch (an epoch only Redis had,
/// ahead of MySQL, is refused). `write_order` says the same with a read of the sale
/// epoch and the `UPDATE`'s `p.epoch <= <epoch>`.
pub fn is_current(epoch: u64, sale_epoch: u64, sku_epoch: u64) -> bool {
    sku_epoch <= epoch && epoch <= sale_epoch
}

/// The rules of an order's write, in one place: the conditions of the `UPDATE`s in
/// `write_order` say the same in SQL, and `diagnose` asks this function which of them
/// failed. `Ok` is the stock after the order.
pub fn judge(
    write: StockWrite,
    quantity: i64,
    epoch: u64,
    row: &ProductRow,
) -> Result<i64, Refusal> {
    if !is_current(epoch, row.epoch, row.sku_epoch) {
        return Err(Refusal::SaleChanged);
    }
    match write {
        // Unfenced: the absolute write lands whatever happened since the read. With a
        // lock that held, nothing did; with one that was lost, this is the lost update.
        StockWrite::Set {
            new_stock,
            fence: None,
        } => Ok(new_stock),
        StockWrite::Set {
            new_stock,
            fence: Some(fence),
        } => {
            if row.fence != Some(fence.token) {
                Err(Refusal::Fenced { token: fence.token })
            } else if row.stock != fence.read_stock {
                Err(Refusal::StaleRead {
                    stock: row.stock,
                    version: row.version,
                })
            } else {
                Ok(new_stock)
            }
        }
        StockWrite::DecrementAtVersion { version, .. } if version != row.version => {
            Err(Refusal::VersionChanged)
        }
        StockWrite::DecrementAtVersion { .. } | StockWrite::Decrement => {
            if row.stock < quantity {
                Err(Refusal::NotEnough { stock: row.stock })
            } else {
                Ok(row.stock - quantity)
            }
        }
    }
}

/// A product row locked `FOR UPDATE` inside an open transaction (db-for-update).
/// Dropping it rolls the transaction back and frees the row.
pub struct LockedProduct {
    tx: Transaction<'static, MySql>,
    pub stock: i64,
}

impl LockedProduct {
    /// Decrements the stock and inserts the order, then commits, releasing the row.
    /// `releasing` is called just before the COMMIT (or ROLLBACK) is sent: the last
    /// moment the caller still surely holds the row.
    pub async fn commit_order(
        mut self,
        order: &NewOrder,
        epoch: u64,
        strategy: &str,
        replica: &str,
        releasing: impl FnOnce() + Send,
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
        releasing();
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

#[cfg(test)]
mod tests {
    //! The fence rules against an in-memory product row: registration moves the fence
    //! forward only, a commit goes through `judge`. Each test is one interleaving of
    //! two holders; the real-service versions are `tests/integration/fenced_reads.rs`.

    use super::*;

    /// MySQL as the rules see it: one product row and its fence.
    struct Mysql {
        row: ProductRow,
        orders: i64,
    }

    impl Mysql {
        fn new(stock: i64) -> Mysql {
            Mysql {
                row: ProductRow {
                    stock,
                    version: 1,
                    epoch: 1,
                    sku_epoch: 1,
                    fence: None,
                },
                orders: 0,
            }
        }

        fn register(&mut self, token: u64) {
            self.row.fence = Some(self.row.fence.map_or(token, |f| f.max(token)));
        }

        fn commit(&mut self, token: u64, read_stock: i64) -> Result<(), Refusal> {
            let write = StockWrite::Set {
                new_stock: read_stock - 1,
                fence: Some(Fence { token, read_stock }),
            };
            self.row.stock = judge(write, 1, 1, &self.row)?;
            self.row.version += 1;
            self.orders += 1;
            Ok(())
        }
    }

    #[test]
    fn the_stale_holder_waking_first_is_refused() {
        let mut mysql = Mysql::new(1);
        mysql.register(1);
        let stale_read = mysql.row.stock; // then paused past its lease
        mysql.register(2);
        let rival_read = mysql.row.stock;
        assert_eq!(
            mysql.commit(1, stale_read),
            Err(Refusal::Fenced { token: 1 })
        );
        assert_eq!(mysql.commit(2, rival_read), Ok(()));
        assert_eq!((mysql.orders, mysql.row.stock), (1, 0));
    }

    #[test]
    fn the_stale_holder_waking_last_is_refused() {
        let mut mysql = Mysql::new(1);
        mysql.register(1);
        let stale_read = mysql.row.stock;
        mysql.register(2);
        let rival_read = mysql.row.stock;
        assert_eq!(mysql.commit(2, rival_read), Ok(()));
        assert_eq!(
            mysql.commit(1, stale_read),
            Err(Refusal::Fenced { token: 1 })
        );
        assert_eq!((mysql.orders, mysql.row.stock), (1, 0));
    }

    #[test]
    fn a_read_from_a_cache_behind_mysql_is_refused() {
        // Holder 1 committed but stalled before writing the cache; holder 2 reads the
        // cache's old value. Its token is newer, so only the stock comparison stops it.
        let mut mysql = Mysql::new(2);
        mysql.register(1);
        let cached = mysql.row.stock;
        assert_eq!(mysql.commit(1, cached), Ok(()));
        mysql.register(2);
        assert_eq!(
            mysql.commit(2, cached),
            Err(Refusal::StaleRead {
                stock: 1,
                version: 2
            })
        );
        assert_eq!((mysql.orders, mysql.row.stock), (1, 1));
    }

    #[test]
    fn a_fence_checked_only_against_the_last_write_oversells() {
        // What fencing did before it covered the read: the token need only be newer
        // than the last one *written*. Both holders read 1; both writes land.
        let (mut last_written, mut orders, mut stock) = (0, 0, 1);
        let (stale_read, rival_read) = (stock, stock);
        for (token, read) in [(1, stale_read), (2, rival_read)] {
            if token > last_written {
                last_written = token;
                stock = read - 1;
                orders += 1;
            }
        }
        assert_eq!((orders, stock), (2, 0), "two orders for one unit");
    }

    #[test]
    fn an_order_from_before_a_change_of_its_sku_is_refused() {
        // The SKU was last changed at 8: an order that began at 7 is refused.
        let row = ProductRow {
            stock: 5,
            version: 3,
            epoch: 8,
            sku_epoch: 8,
            fence: None,
        };
        assert_eq!(
            judge(StockWrite::Decrement, 1, 7, &row),
            Err(Refusal::SaleChanged)
        );
        assert_eq!(judge(StockWrite::Decrement, 1, 8, &row), Ok(4));
    }

    #[test]
    fn a_change_of_another_sku_refuses_nothing_and_a_future_epoch_is_refused() {
        // The sale moved to 9 with a change of another SKU; this one last changed at 4.
        let row = ProductRow {
            stock: 5,
            version: 3,
            epoch: 9,
            sku_epoch: 4,
            fence: None,
        };
        assert_eq!(judge(StockWrite::Decrement, 1, 7, &row), Ok(4));
        assert_eq!(judge(StockWrite::Decrement, 1, 4, &row), Ok(4));
        assert_eq!(
            judge(StockWrite::Decrement, 1, 3, &row),
            Err(Refusal::SaleChanged)
        );
        // An epoch MySQL never reached (Redis ahead of a restored MySQL).
        assert_eq!(
            judge(StockWrite::Decrement, 1, 10, &row),
            Err(Refusal::SaleChanged)
        );
    }

    #[test]
    fn decrements_never_go_below_zero_and_optimistic_needs_its_version() {
        let row = ProductRow {
            stock: 1,
            version: 3,
            epoch: 1,
            sku_epoch: 1,
            fence: None,
        };
        assert_eq!(
            judge(StockWrite::Decrement, 2, 1, &row),
            Err(Refusal::NotEnough { stock: 1 })
        );
        assert_eq!(
            judge(
                StockWrite::DecrementAtVersion {
                    version: 2,
                    limit_per_user: None
                },
                1,
                1,
                &row
            ),
            Err(Refusal::VersionChanged)
        );
        assert_eq!(
            judge(
                StockWrite::DecrementAtVersion {
                    version: 3,
                    limit_per_user: None
                },
                1,
                1,
                &row
            ),
            Ok(0)
        );
    }

    /// Found by cargo-mutants (TESTING.md): a wait rounded down (1.5 s becoming 1 s)
    /// survived the whole suite. Sub-second waits were rounded to 2 s before.
    #[test]
    fn row_lock_waits_round_up_to_whole_seconds() {
        let cases = [(0, 1), (200, 1), (1000, 1), (1001, 2), (1500, 2), (3000, 3)];
        for (millis, seconds) in cases {
            assert_eq!(
                innodb_wait_seconds(Duration::from_millis(millis)),
                seconds,
                "{millis} ms"
            );
        }
    }
}
