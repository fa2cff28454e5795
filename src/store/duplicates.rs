//! Orders that repeat an earlier one (`Duplicates` in `GET /api/stats`), counted from
//! the orders table: the load test's report and the dashboard show them beside
//! oversold, so the lesson of the idempotency key is read from the records, not from
//! what the shoppers counted.

use std::collections::BTreeMap;

use flashsale_wire::stats::{Duplicates, UserOrders};
use sqlx::Row;

use super::{Records, StoreError};
use crate::model::Sku;

impl Records {
    /// Each SKU's duplicates, by SKU (SKUs without any are left out); all SKUs, or
    /// only `sku`. Only users with more than one order, or beyond their SKU's limit,
    /// are read: the others add nothing.
    pub async fn duplicates(
        &self,
        sku: Option<&Sku>,
    ) -> Result<BTreeMap<String, Duplicates>, StoreError> {
        let rows = sqlx::query(
            "SELECT o.sku, MAX(p.limit_per_user) AS limit_per_user, COUNT(*) AS orders,
                    CAST(SUM(o.quantity) AS SIGNED) AS units,
                    COUNT(o.idempotency_key) AS keyed,
                    COUNT(DISTINCT o.idempotency_key) AS distinct_keys
             FROM orders o JOIN products p ON p.sku = o.sku
             WHERE (? IS NULL OR o.sku = ?)
             GROUP BY o.sku, o.user_id
             HAVING COUNT(*) > 1 OR SUM(o.quantity) > COALESCE(MAX(p.limit_per_user), SUM(o.quantity))",
        )
        .bind(sku.map(Sku::as_str))
        .bind(sku.map(Sku::as_str))
        .fetch_all(self.pool())
        .await?;
        let mut users: BTreeMap<String, (Option<i64>, Vec<UserOrders>)> = BTreeMap::new();
        for row in rows {
            let entry = users
                .entry(row.try_get("sku")?)
                .or_insert_with(|| (None, Vec::new()));
            entry.0 = row.try_get("limit_per_user")?;
            entry.1.push(UserOrders {
                orders: row.try_get("orders")?,
                units: row.try_get("units")?,
                keyed: row.try_get("keyed")?,
                keys: row.try_get("distinct_keys")?,
            });
        }
        Ok(users
            .into_iter()
            .map(|(sku, (limit, users))| (sku, Duplicates::count(users, limit)))
            .collect())
    }
}
