//! The MySQL system of record: products (stock per SKU) and orders.
//!
//! Every statement uses bound parameters. The order write is one transaction, so an
//! order row never exists without its stock write and vice versa.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{MySql, Row, Transaction};

use super::StoreError;
use crate::model::{NewOrder, Order, Sku};
use crate::report::LoadReport;

#[derive(Clone)]
pub struct Records {
    pool: MySqlPool,
}

/// A product row joined with what its orders add up to.
#[derive(Debug, Clone)]
pub struct ProductRecord {
    pub sku: Sku,
    pub initial_stock: i64,
    pub stock: i64,
    pub orders: i64,
    pub ordered_quantity: i64,
    /// When the product row last changed (a reset or a sale).
    pub updated_at: DateTime<Utc>,
}

impl Records {
    /// Connects, retrying until `patience` runs out (the database may still be
    /// starting, as under docker-compose), then applies the migrations.
    pub async fn connect(url: &str, pool_size: u32, patience: Duration) -> anyhow::Result<Self> {
        let started = tokio::time::Instant::now();
        let pool = loop {
            let attempt = MySqlPoolOptions::new()
                .max_connections(pool_size)
                .acquire_timeout(Duration::from_secs(3))
                .connect(url)
                .await;
            match attempt {
                Ok(pool) => break pool,
                Err(error) if started.elapsed() < patience => {
                    tracing::warn!(%error, "database not reachable yet, retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(error) => return Err(error.into()),
            }
        };
        migrate(&pool).await?;
        Ok(Records { pool })
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Creates or restocks the product and clears its orders, in one transaction.
    pub async fn reset(&self, sku: &Sku, stock: i64) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO products (sku, stock, initial_stock, version) VALUES (?, ?, ?, 0)
             ON DUPLICATE KEY UPDATE stock = VALUES(stock),
                 initial_stock = VALUES(initial_stock), version = 0",
        )
        .bind(sku.as_str())
        .bind(stock)
        .bind(stock)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM orders WHERE sku = ?")
            .bind(sku.as_str())
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM product_fences WHERE sku = ?")
            .bind(sku.as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The lock strategies' write: set the product's stock to `new_stock` (an absolute
    /// value computed from what the caller read, which is exactly what loses updates
    /// without a lock) and insert the order, in one transaction.
    ///
    /// With a fencing token, the transaction first moves the SKU's fence for this lock
    /// service forward, and only if the token is greater than the last one written:
    /// `None` means a newer holder already wrote, and nothing was written.
    pub async fn commit_order(
        &self,
        order: &NewOrder,
        new_stock: i64,
        fence: Option<u64>,
        strategy: &str,
        replica: &str,
    ) -> Result<Option<Order>, StoreError> {
        let mut tx = self.pool.begin().await?;
        if let Some(token) = fence {
            sqlx::query(
                "INSERT IGNORE INTO product_fences (sku, lock_service, fence) VALUES (?, ?, 0)",
            )
            .bind(order.sku.as_str())
            .bind(strategy)
            .execute(&mut *tx)
            .await?;
            let advanced = sqlx::query(
                "UPDATE product_fences SET fence = ? WHERE sku = ? AND lock_service = ? AND fence < ?",
            )
            .bind(token)
            .bind(order.sku.as_str())
            .bind(strategy)
            .bind(token)
            .execute(&mut *tx)
            .await?;
            if advanced.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(None);
            }
        }
        sqlx::query("UPDATE products SET stock = ?, version = version + 1 WHERE sku = ?")
            .bind(new_stock)
            .bind(order.sku.as_str())
            .execute(&mut *tx)
            .await?;
        let recorded = insert_order(&mut tx, order, strategy, replica).await?;
        tx.commit()
            .await
            .map_err(StoreError::CommitOutcomeUnknown)?;
        Ok(Some(recorded))
    }

    /// The product's stock and row version, as the optimistic strategy reads them.
    pub async fn stock_and_version(&self, sku: &Sku) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT stock, version FROM products WHERE sku = ?")
                .bind(sku.as_str())
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// Decrements the stock and inserts the order in one transaction. With `version`
    /// (the optimistic write) only if the row is still at that version and has the
    /// stock: `None` means another writer got there first and nothing was written.
    /// Without it (redis-atomic, whose Lua script already took the units) always.
    pub async fn commit_decrement(
        &self,
        order: &NewOrder,
        version: Option<i64>,
        strategy: &str,
        replica: &str,
    ) -> Result<Option<Order>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query(
            "UPDATE products SET stock = stock - ?, version = version + 1
             WHERE sku = ? AND (? IS NULL OR (version = ? AND stock >= ?))",
        )
        .bind(order.quantity)
        .bind(order.sku.as_str())
        .bind(version)
        .bind(version)
        .bind(order.quantity)
        .execute(&mut *tx)
        .await?;
        if updated.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(None);
        }
        let recorded = insert_order(&mut tx, order, strategy, replica).await?;
        tx.commit().await?;
        Ok(Some(recorded))
    }

    /// Starts a transaction holding the product's row lock (`SELECT … FOR UPDATE`, by
    /// the primary key, so one row is locked). Waits at most `wait` (whole seconds:
    /// InnoDB's granularity) for the row. `None` for an unknown SKU.
    pub async fn lock_product(
        &self,
        sku: &Sku,
        wait: Duration,
    ) -> Result<Option<LockedProduct>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let seconds = wait.as_secs().max(1) + u64::from(wait.subsec_nanos() > 0);
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(seconds)
            .execute(&mut *tx)
            .await?;
        let row: Option<(i64, i64)> =
            match sqlx::query_as("SELECT stock, version FROM products WHERE sku = ? FOR UPDATE")
                .bind(sku.as_str())
                .fetch_optional(&mut *tx)
                .await
            {
                Err(sqlx::Error::Database(error))
                    if error
                        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|e| e.number() == LOCK_WAIT_TIMEOUT) =>
                {
                    return Err(StoreError::RowLockTimeout);
                }
                other => other?,
            };
        Ok(row.map(|(stock, version)| LockedProduct { tx, stock, version }))
    }

    /// The durable copy of a cluster setting.
    pub async fn setting(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT value FROM cluster_settings WHERE name = ?")
                .bind(name)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    pub async fn save_setting(&self, name: &str, value: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO cluster_settings (name, value) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE value = VALUES(value)",
        )
        .bind(name)
        .bind(value)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Products with their order totals; all of them, or only `sku`.
    pub async fn products(&self, sku: Option<&Sku>) -> Result<Vec<ProductRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT p.sku, p.initial_stock, p.stock, p.updated_at,
                    COUNT(o.id) AS orders, CAST(COALESCE(SUM(o.quantity), 0) AS SIGNED) AS ordered
             FROM products p LEFT JOIN orders o ON o.sku = p.sku
             WHERE (? IS NULL OR p.sku = ?)
             GROUP BY p.sku, p.initial_stock, p.stock, p.updated_at
             ORDER BY p.sku",
        )
        .bind(sku.map(Sku::as_str))
        .bind(sku.map(Sku::as_str))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|row| {
                let raw_sku: String = row.try_get("sku")?;
                let sku = Sku::parse(&raw_sku).map_err(|detail| StoreError::Corrupt {
                    what: "products.sku",
                    detail,
                })?;
                Ok(ProductRecord {
                    sku,
                    initial_stock: row.try_get("initial_stock")?,
                    stock: row.try_get("stock")?,
                    orders: row.try_get("orders")?,
                    ordered_quantity: row.try_get("ordered")?,
                    updated_at: row.try_get("updated_at")?,
                })
            })
            .collect()
    }
}

impl Records {
    /// Keeps a load-test report; returns its id.
    pub async fn save_report(&self, report: &LoadReport) -> Result<u64, StoreError> {
        let json = serde_json::to_string(report).map_err(|e| StoreError::Corrupt {
            what: "load report",
            detail: e.to_string(),
        })?;
        let result = sqlx::query("INSERT INTO load_test_runs (report) VALUES (?)")
            .bind(json)
            .execute(&self.pool)
            .await?;
        Ok(result.last_insert_id())
    }

    /// The latest `limit` reports, newest first, with their ids.
    pub async fn reports(&self, limit: u32) -> Result<Vec<(i64, LoadReport)>, StoreError> {
        let rows: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, report FROM load_test_runs ORDER BY id DESC LIMIT ?")
                .bind(limit)
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter()
            .map(|(id, json)| {
                serde_json::from_str(&json)
                    .map(|report| (id, report))
                    .map_err(|e| StoreError::Corrupt {
                        what: "load_test_runs.report",
                        detail: e.to_string(),
                    })
            })
            .collect()
    }
}

/// MySQL's "Lock wait timeout exceeded".
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// A product row locked `FOR UPDATE` inside an open transaction. Dropping it rolls
/// the transaction back and frees the row.
pub struct LockedProduct {
    tx: Transaction<'static, MySql>,
    pub stock: i64,
    pub version: i64,
}

impl LockedProduct {
    /// Writes the stock and the order and commits, releasing the row lock. Returns the
    /// order and the row's new version.
    pub async fn commit_order(
        mut self,
        order: &NewOrder,
        strategy: &str,
        replica: &str,
    ) -> Result<(Order, i64), StoreError> {
        sqlx::query("UPDATE products SET stock = stock - ?, version = version + 1 WHERE sku = ?")
            .bind(order.quantity)
            .bind(order.sku.as_str())
            .execute(&mut *self.tx)
            .await?;
        let recorded = insert_order(&mut self.tx, order, strategy, replica).await?;
        self.tx.commit().await?;
        Ok((recorded, self.version + 1))
    }
}

/// Applies the migrations, one replica at a time. sqlx takes a lock too, but with
/// `GET_LOCK(name, -1)` and without checking the answer, and replicas starting together
/// on MariaDB were seen applying the same migration twice. So: our own lock, with a
/// bounded wait and a checked result, on the connection that migrates.
async fn migrate(pool: &MySqlPool) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    let locked: Option<i64> =
        sqlx::query_scalar("SELECT GET_LOCK(CONCAT('flashsale-migrations-', DATABASE()), 60)")
            .fetch_one(&mut *conn)
            .await?;
    if locked != Some(1) {
        anyhow::bail!("another replica held the migration lock for 60 s");
    }
    let migrated = sqlx::migrate!("./migrations").run(&mut *conn).await;
    sqlx::query("SELECT RELEASE_LOCK(CONCAT('flashsale-migrations-', DATABASE()))")
        .execute(&mut *conn)
        .await?;
    Ok(migrated?)
}

/// Inserts the order row inside the caller's transaction and returns it as recorded.
pub(crate) async fn insert_order(
    tx: &mut Transaction<'_, MySql>,
    order: &NewOrder,
    strategy: &str,
    replica: &str,
) -> Result<Order, StoreError> {
    let created_at = Utc::now();
    let result = sqlx::query(
        "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at)
         VALUES (?, ?, ?, ?, ?, ?)",
    )
    .bind(order.sku.as_str())
    .bind(&order.user_id)
    .bind(order.quantity)
    .bind(strategy)
    .bind(replica)
    .bind(created_at)
    .execute(&mut **tx)
    .await?;
    Ok(Order {
        id: result.last_insert_id(),
        sku: order.sku.clone(),
        user_id: order.user_id.clone(),
        quantity: order.quantity,
        strategy: strategy.to_owned(),
        replica: replica.to_owned(),
        created_at,
    })
}
