//! The MySQL system of record: products (stock per SKU) and orders.
//!
//! Every statement uses bound parameters. The order write is one transaction, so an
//! order row never exists without its stock write and vice versa.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::mysql::MySqlPool;
use sqlx::{MySql, Row, Transaction};

use super::StoreError;
use crate::model::{NewOrder, Order, Sku};
use crate::mysql_pool::{self, on_live_connection};
use crate::report::LoadReport;

#[derive(Clone)]
pub struct Records {
    pool: MySqlPool,
}

/// A product's stock, version and epoch, and the sale epoch, read together.
#[derive(Debug, Clone, Copy)]
pub struct OptimisticRow {
    pub stock: i64,
    pub version: i64,
    pub epoch: u64,
    /// The sale epoch of the last change that concerned the SKU.
    pub sku_epoch: u64,
}

impl OptimisticRow {
    /// Whether an order that began at sale epoch `epoch` may still sell from this row
    /// (`order_commit::is_current`).
    pub fn is_current_for(&self, epoch: u64) -> bool {
        super::order_commit::is_current(epoch, self.epoch, self.sku_epoch)
    }
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
            match mysql_pool::connect(url, pool_size).await {
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

    /// Starts a transaction, on a live connection (`on_live_connection`).
    pub async fn begin(&self) -> Result<Transaction<'static, MySql>, sqlx::Error> {
        on_live_connection(&self.pool, || self.pool.begin()).await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// What the optimistic strategy reads before each attempt: the product's stock
    /// and row version, its epoch and the sale's, in one statement.
    pub async fn optimistic_read(&self, sku: &Sku) -> Result<Option<OptimisticRow>, StoreError> {
        let read = || {
            sqlx::query_as(
                "SELECT p.stock, p.version, e.value, p.epoch FROM products p
                 JOIN cluster_settings e ON e.name = 'epoch' WHERE p.sku = ?",
            )
            .bind(sku.as_str())
            .fetch_optional(&self.pool)
        };
        let row: Option<(i64, i64, String, u64)> = on_live_connection(&self.pool, read).await?;
        Ok(row.map(|(stock, version, epoch, sku_epoch)| OptimisticRow {
            stock,
            version,
            epoch: epoch.parse().unwrap_or(0),
            sku_epoch,
        }))
    }

    /// The product's stock and row version.
    pub async fn stock_and_version(&self, sku: &Sku) -> Result<Option<(i64, i64)>, StoreError> {
        let read = || {
            sqlx::query_as("SELECT stock, version FROM products WHERE sku = ?")
                .bind(sku.as_str())
                .fetch_optional(&self.pool)
        };
        Ok(on_live_connection(&self.pool, read).await?)
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

/// Inserts several orders with one statement inside the caller's transaction and
/// returns them as recorded, in the order given, each with its own id.
///
/// The ids come back with the statement (MariaDB's `INSERT … RETURNING`), so this
/// costs the one round trip of the insert and relies on no property of the
/// auto-increment: consecutive ids for a multi-row insert hold only for some
/// `innodb_autoinc_lock_mode`s and `auto_increment_increment`s, which a server may
/// change. Each returned row is matched to an order by its content (SKU, user,
/// quantity; the strategy, replica and time are the same for every row), so not even
/// the order of the returned rows matters: orders with the same content are the same
/// row for every purpose, so which of them gets which id is immaterial. A returned
/// row that matches no order is an error before COMMIT: nothing is recorded.
///
/// Every row gets the same `created_at` (the orders are recorded by one transaction),
/// cut to the microseconds the column keeps, so the returned orders are exactly the
/// rows.
pub(crate) async fn insert_orders(
    tx: &mut Transaction<'_, MySql>,
    orders: &[&NewOrder],
    strategy: &str,
    replica: &str,
) -> Result<Vec<Order>, StoreError> {
    use chrono::SubsecRound;
    use std::collections::HashMap;

    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let created_at = Utc::now().trunc_subsecs(6);
    let rows = vec!["(?, ?, ?, ?, ?, ?)"; orders.len()].join(", ");
    // Built from constant pieces and the number of rows only; the values are bound.
    let statement = sqlx::AssertSqlSafe(format!(
        "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at)
         VALUES {rows} RETURNING id, sku, user_id, quantity"
    ));
    let mut insert = sqlx::query_as::<_, (i64, String, String, i64)>(statement);
    for order in orders {
        insert = insert
            .bind(order.sku.as_str())
            .bind(&order.user_id)
            .bind(order.quantity)
            .bind(strategy)
            .bind(replica)
            .bind(created_at);
    }
    let returned = insert.fetch_all(&mut **tx).await?;

    // Positions of the orders by content; each returned row takes one.
    let mut unmatched: HashMap<(String, String, i64), Vec<usize>> = HashMap::new();
    for (position, order) in orders.iter().enumerate().rev() {
        let key = (
            order.sku.as_str().to_owned(),
            order.user_id.clone(),
            order.quantity,
        );
        unmatched.entry(key).or_default().push(position);
    }
    let mut ids: Vec<Option<u64>> = vec![None; orders.len()];
    for (id, sku, user_id, quantity) in returned {
        let position = unmatched
            .get_mut(&(sku, user_id, quantity))
            .and_then(Vec::pop);
        let (Some(position), Ok(id)) = (position, u64::try_from(id)) else {
            return Err(StoreError::Corrupt {
                what: "orders (INSERT … RETURNING)",
                detail: format!("a returned row (id {id}) matches no order inserted"),
            });
        };
        ids[position] = Some(id);
    }
    orders
        .iter()
        .zip(ids)
        .map(|(order, id)| {
            let id = id.ok_or_else(|| StoreError::Corrupt {
                what: "orders (INSERT … RETURNING)",
                detail: format!("no row returned for {}'s order", order.user_id),
            })?;
            Ok(Order {
                id,
                sku: order.sku.clone(),
                user_id: order.user_id.clone(),
                quantity: order.quantity,
                strategy: strategy.to_owned(),
                replica: replica.to_owned(),
                created_at,
            })
        })
        .collect()
}
