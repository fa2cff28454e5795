//! The system of record read with plain SQL (`--database-url`), beside the service's
//! own account in `/api/stats`.
//!
//! The checker must not trust any party to the sale: not the shoppers' counting, and
//! not the service's summary of its records either (a bug there could hide an
//! oversell). The products and orders tables are the sale's truth.

use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

pub struct Records {
    pool: MySqlPool,
}

/// One SKU as MySQL holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkuRecord {
    pub initial_stock: i64,
    pub stock: i64,
    pub orders: i64,
    pub ordered_quantity: i64,
}

impl Records {
    pub async fn connect(url: &str) -> anyhow::Result<Records> {
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .context("connecting to --database-url")?;
        Ok(Records { pool })
    }

    pub async fn sku(&self, sku: &str) -> anyhow::Result<SkuRecord> {
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
        Ok(SkuRecord {
            initial_stock,
            stock,
            orders,
            ordered_quantity,
        })
    }
}
