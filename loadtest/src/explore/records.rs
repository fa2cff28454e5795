//! The system of record read with plain SQL (`--database-url`), beside the service's
//! own account in `/api/stats`.
//!
//! The checker must not trust any party to the sale: not the shoppers' counting, and
//! not the service's summary of its records either (a bug there could hide an
//! oversell). The products and orders tables are the sale's truth.
//!
//! The SQL needs a database driver, which the load test otherwise does without: it is
//! built only with `--features mysql` (`scripts/explore.sh` builds it so).

use serde::Serialize;

pub struct Records {
    #[cfg(feature = "mysql")]
    pool: sqlx::mysql::MySqlPool,
    /// Without the driver there are no records to read: none can be made.
    #[cfg(not(feature = "mysql"))]
    none: std::convert::Infallible,
}

/// One SKU as MySQL holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkuRecord {
    pub initial_stock: i64,
    pub stock: i64,
    pub orders: i64,
    pub ordered_quantity: i64,
    /// Orders beyond the first under one idempotency key.
    pub sharing_key: i64,
    /// Units beyond the SKU's limit per user, summed over users (0 without a limit).
    pub over_limit: i64,
}

#[cfg(not(feature = "mysql"))]
impl Records {
    pub async fn connect(_url: &str) -> anyhow::Result<Records> {
        anyhow::bail!(
            "--database-url needs the explorer built with MySQL: \
             cargo build --release -p loadtest --features mysql"
        )
    }

    pub async fn sku(&self, _sku: &str) -> anyhow::Result<SkuRecord> {
        match self.none {}
    }
}

#[cfg(feature = "mysql")]
impl Records {
    pub async fn connect(url: &str) -> anyhow::Result<Records> {
        use anyhow::Context;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect(url)
            .await
            .context("connecting to --database-url")?;
        Ok(Records { pool })
    }

    pub async fn sku(&self, sku: &str) -> anyhow::Result<SkuRecord> {
        use anyhow::Context;
        let (stock, initial_stock): (i64, i64) =
            sqlx::query_as("SELECT stock, initial_stock FROM products WHERE sku = ?")
                .bind(sku)
                .fetch_optional(&self.pool)
                .await?
                .with_context(|| format!("no product row for {sku}"))?;
        let (orders, ordered_quantity): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*), CAST(COALESCE(SUM(quantity), 0) AS SIGNED) FROM orders WHERE sku = ?",
        )
        .bind(sku)
        .fetch_one(&self.pool)
        .await?;
        // Counted here by statements of their own, not by the service's
        // (`src/store/duplicates.rs`), so a bug there cannot hide a duplicate.
        let sharing_key: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(n - 1), 0) AS SIGNED) FROM (
                 SELECT COUNT(*) AS n FROM orders
                 WHERE sku = ? AND idempotency_key IS NOT NULL GROUP BY idempotency_key) k",
        )
        .bind(sku)
        .fetch_one(&self.pool)
        .await?;
        let over_limit: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(GREATEST(u.units - p.limit_per_user, 0)), 0) AS SIGNED)
             FROM (SELECT SUM(quantity) AS units FROM orders WHERE sku = ? GROUP BY user_id) u
             JOIN products p ON p.sku = ? AND p.limit_per_user IS NOT NULL",
        )
        .bind(sku)
        .bind(sku)
        .fetch_one(&self.pool)
        .await?;
        Ok(SkuRecord {
            initial_stock,
            stock,
            orders,
            ordered_quantity,
            sharing_key,
            over_limit,
        })
    }
}
