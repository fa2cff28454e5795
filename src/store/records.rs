//! The MySQL system of record: products (stock per SKU) and orders.
//!
//! Every statement uses bound parameters. The order write is one transaction, so an
//! order row never exists without its stock write and vice versa.

use std::time::Duration;

use chrono::{DateTime, SubsecRound, Utc};
use sqlx::mysql::MySqlPool;
use sqlx::{MySql, Row, Transaction};

use super::{Refusal, StoreError};
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
    /// The SKU's limit per user in this sale, if any.
    pub limit_per_user: Option<i64>,
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
    /// Units one user may buy in this sale; `None`: no limit.
    pub limit_per_user: Option<i64>,
}

impl Records {
    pub fn pool_use(&self) -> super::PoolUse {
        let idle = self.pool.num_idle();
        super::PoolUse {
            pool: "mysql",
            in_use: usize::try_from(self.pool.size())
                .unwrap_or(0)
                .saturating_sub(idle),
            idle,
            waiting: None,
        }
    }

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
                "SELECT p.stock, p.version, e.value, p.epoch, p.limit_per_user FROM products p
                 JOIN cluster_settings e ON e.name = 'epoch' WHERE p.sku = ?",
            )
            .bind(sku.as_str())
            .fetch_optional(&self.pool)
        };
        type Row = (i64, i64, String, u64, Option<i64>);
        let row: Option<Row> = on_live_connection(&self.pool, read).await?;
        Ok(
            row.map(|(stock, version, epoch, sku_epoch, limit)| OptimisticRow {
                stock,
                version,
                limit_per_user: limit,
                epoch: epoch.parse().unwrap_or(0),
                sku_epoch,
            }),
        )
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
            "SELECT p.sku, p.initial_stock, p.stock, p.updated_at, p.limit_per_user,
                    COUNT(o.id) AS orders, CAST(COALESCE(SUM(o.quantity), 0) AS SIGNED) AS ordered
             FROM products p LEFT JOIN orders o ON o.sku = p.sku
             WHERE (? IS NULL OR p.sku = ?)
             GROUP BY p.sku, p.initial_stock, p.stock, p.updated_at, p.limit_per_user
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
                    limit_per_user: row.try_get("limit_per_user")?,
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

    /// Up to `limit` reports older than `before` (all: `None`), newest first, with
    /// their ids.
    pub async fn reports(
        &self,
        limit: u32,
        before: Option<u64>,
    ) -> Result<Vec<(i64, LoadReport)>, StoreError> {
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, report FROM load_test_runs WHERE id < ? ORDER BY id DESC LIMIT ?",
        )
        .bind(before.unwrap_or(u64::MAX))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(id, json)| Ok((id, parse_report(&json)?)))
            .collect()
    }

    /// The report kept under `id`, if any.
    pub async fn report(&self, id: i64) -> Result<Option<LoadReport>, StoreError> {
        let json: Option<String> =
            sqlx::query_scalar("SELECT report FROM load_test_runs WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        json.as_deref().map(parse_report).transpose()
    }
}

fn parse_report(json: &str) -> Result<LoadReport, StoreError> {
    serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
        what: "load_test_runs.report",
        detail: e.to_string(),
    })
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

/// Inserts the order row inside the caller's transaction and returns it as recorded;
/// `Ok(Err(Duplicate))` when an order with the same idempotency key exists (the unique
/// key refused the row; the caller rolls back).
pub(crate) async fn insert_order(
    tx: &mut Transaction<'_, MySql>,
    order: &NewOrder,
    strategy: &str,
    replica: &str,
) -> Result<Result<Order, Refusal>, StoreError> {
    let created_at = Utc::now().trunc_subsecs(6);
    let (key, fingerprint) = idempotency_columns(order);
    let inserted = sqlx::query(
        "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at,
                             idempotency_key, fingerprint)
         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(order.sku.as_str())
    .bind(&order.user_id)
    .bind(order.quantity)
    .bind(strategy)
    .bind(replica)
    .bind(created_at)
    .bind(key)
    .bind(fingerprint)
    .execute(&mut **tx)
    .await;
    let result = match inserted {
        Err(error) if is_duplicate_key(&error) => return Ok(Err(Refusal::Duplicate)),
        inserted => inserted?,
    };
    Ok(Ok(Order {
        id: result.last_insert_id(),
        sku: order.sku.clone(),
        user_id: order.user_id.clone(),
        quantity: order.quantity,
        strategy: strategy.to_owned(),
        replica: replica.to_owned(),
        created_at,
        idempotency_key: key.map(str::to_owned),
    }))
}

/// The order's idempotency key and fingerprint, as bound to the `orders` columns.
fn idempotency_columns(order: &NewOrder) -> (Option<&str>, Option<&str>) {
    match &order.idempotency {
        Some(idempotency) => (
            Some(idempotency.key.as_str()),
            Some(idempotency.fingerprint.as_str()),
        ),
        None => (None, None),
    }
}

/// MySQL's "duplicate entry" for a unique key.
pub(crate) fn is_duplicate_key(error: &sqlx::Error) -> bool {
    super::order_commit::mysql_error_number(error) == Some(DUPLICATE_KEY)
}

const DUPLICATE_KEY: u16 = 1062;

/// Inserts several orders with one statement inside the caller's transaction and
/// returns them as recorded, in the order given, each with its own id.
///
/// The ids come back with the statement (MariaDB's `INSERT … RETURNING`), so this
/// costs the one round trip of the insert and relies on no property of the
/// auto-increment: consecutive ids for a multi-row insert hold only for some
/// `innodb_autoinc_lock_mode`s and `auto_increment_increment`s, which a server may
/// change. Each returned row is matched to an order by its content (SKU, user,
/// quantity, idempotency key: the shopper learns the id of the row that holds its
/// key; the strategy, replica and time are the same for every row), so not even
/// the order of the returned rows matters: orders with the same content are the same
/// row for every purpose, so which of them gets which id is immaterial. A returned
/// row that matches no order is an error before COMMIT: nothing is recorded.
///
/// Every row gets the same `created_at` (the orders are recorded by one transaction),
/// cut to the microseconds the column keeps, so the returned orders are exactly the
/// rows.
///
/// An idempotency key that an order already holds fails the whole statement
/// (`is_duplicate_key`); the caller then records the batch's orders one by one, where
/// the duplicate is refused alone. The limit per user is not checked here: the group
/// committer records the orders of a SKU with a limit one by one (`write_order`).
pub(crate) async fn insert_orders(
    tx: &mut Transaction<'_, MySql>,
    orders: &[&NewOrder],
    strategy: &str,
    replica: &str,
) -> Result<Vec<Order>, StoreError> {
    use std::collections::HashMap;

    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let created_at = Utc::now().trunc_subsecs(6);
    let rows = vec!["(?, ?, ?, ?, ?, ?, ?, ?)"; orders.len()].join(", ");
    // Built from constant pieces and the number of rows only; the values are bound.
    let statement = sqlx::AssertSqlSafe(format!(
        "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at,
                             idempotency_key, fingerprint)
         VALUES {rows} RETURNING id, sku, user_id, quantity, idempotency_key"
    ));
    let mut insert = sqlx::query_as::<_, (i64, String, String, i64, Option<String>)>(statement);
    for order in orders {
        let (key, fingerprint) = idempotency_columns(order);
        insert = insert
            .bind(order.sku.as_str())
            .bind(&order.user_id)
            .bind(order.quantity)
            .bind(strategy)
            .bind(replica)
            .bind(created_at)
            .bind(key)
            .bind(fingerprint);
    }
    let returned = insert.fetch_all(&mut **tx).await?;

    // Positions of the orders by content; each returned row takes one.
    type Content = (String, String, i64, Option<String>);
    let mut unmatched: HashMap<Content, Vec<usize>> = HashMap::new();
    for (position, order) in orders.iter().enumerate().rev() {
        let key = (
            order.sku.as_str().to_owned(),
            order.user_id.clone(),
            order.quantity,
            idempotency_columns(order).0.map(str::to_owned),
        );
        unmatched.entry(key).or_default().push(position);
    }
    let mut ids: Vec<Option<u64>> = vec![None; orders.len()];
    for (id, sku, user_id, quantity, key) in returned {
        let position = unmatched
            .get_mut(&(sku, user_id, quantity, key))
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
                idempotency_key: idempotency_columns(order).0.map(str::to_owned),
            })
        })
        .collect()
}

type OrderRow = (
    i64,
    String,
    String,
    i64,
    String,
    String,
    DateTime<Utc>,
    Option<String>,
    Option<String>,
);

/// An order row and the fingerprint of the request it was placed with.
fn order_from_row(row: OrderRow) -> Result<(Order, Option<String>), StoreError> {
    let (id, sku, user_id, quantity, strategy, replica, created_at, key, fingerprint) = row;
    let sku = Sku::parse(&sku).map_err(|detail| StoreError::Corrupt {
        what: "orders.sku",
        detail,
    })?;
    let id = u64::try_from(id).map_err(|e| StoreError::Corrupt {
        what: "orders.id",
        detail: e.to_string(),
    })?;
    let order = Order {
        id,
        sku,
        user_id,
        quantity,
        strategy,
        replica,
        created_at,
        idempotency_key: key,
    };
    Ok((order, fingerprint))
}

impl Records {
    /// The order with this id, if recorded.
    pub async fn order(&self, id: u64) -> Result<Option<Order>, StoreError> {
        let read = || {
            sqlx::query_as::<_, OrderRow>(
                "SELECT id, sku, user_id, quantity, strategy, replica, created_at,
                        idempotency_key, fingerprint
                 FROM orders WHERE id = ?",
            )
            .bind(id)
            .fetch_optional(&self.pool)
        };
        let row = on_live_connection(&self.pool, read).await?;
        Ok(row.map(order_from_row).transpose()?.map(|(order, _)| order))
    }

    /// The order recorded with this idempotency key, with its request's fingerprint.
    pub async fn order_by_key(&self, key: &str) -> Result<Option<(Order, String)>, StoreError> {
        let read = || {
            sqlx::query_as::<_, OrderRow>(
                "SELECT id, sku, user_id, quantity, strategy, replica, created_at,
                        idempotency_key, fingerprint
                 FROM orders WHERE idempotency_key = ?",
            )
            .bind(key)
            .fetch_optional(&self.pool)
        };
        let row = on_live_connection(&self.pool, read).await?;
        Ok(row
            .map(order_from_row)
            .transpose()?
            .map(|(order, fingerprint)| (order, fingerprint.unwrap_or_default())))
    }
}
