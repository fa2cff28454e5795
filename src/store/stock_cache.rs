//! The stock copy in Redis that request handlers read first.
//!
//! One string key per SKU, `<namespace>:stock:<sku>`, holding the units left. MySQL
//! stays the system of record; this copy is what makes the race visible, because the
//! naive flow reads it, thinks, and writes back.

use deadpool_redis::Pool;
use deadpool_redis::redis::AsyncCommands;

use super::StoreError;
use crate::model::Sku;

#[derive(Clone)]
pub struct StockCache {
    pool: Pool,
    namespace: String,
}

impl StockCache {
    pub fn new(pool: Pool, namespace: String) -> Self {
        StockCache { pool, namespace }
    }

    fn key(&self, sku: &Sku) -> String {
        format!("{}:stock:{}", self.namespace, sku)
    }

    /// Units left, or `None` when the SKU was never stocked.
    pub async fn stock(&self, sku: &Sku) -> Result<Option<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get(self.key(sku)).await?)
    }

    pub async fn set_stock(&self, sku: &Sku, stock: i64) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.set(self.key(sku), stock).await?;
        Ok(())
    }

    /// The stock of several SKUs in one round trip, in the same order.
    pub async fn stocks(&self, skus: &[Sku]) -> Result<Vec<Option<i64>>, StoreError> {
        if skus.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = skus.iter().map(|sku| self.key(sku)).collect();
        let mut conn = self.pool.get().await?;
        Ok(conn.mget(keys).await?)
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let _: String = deadpool_redis::redis::cmd("PING")
            .query_async(&mut conn)
            .await?;
        Ok(())
    }
}
