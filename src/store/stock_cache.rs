//! The stock copy in Redis that request handlers read first.
//!
//! One string key per SKU, `<namespace>:stock:<sku>`, holding the units left. MySQL
//! stays the system of record; this copy is what makes the race visible, because the
//! naive flow reads it, thinks, and writes back.

use std::sync::LazyLock;

use deadpool_redis::Pool;
use deadpool_redis::redis::{AsyncCommands, Script};

use super::StoreError;
use crate::model::Sku;

/// Writes the stock only if it comes from a newer MySQL version than the one cached,
/// so a slow writer can never put back an older value.
static SET_IF_NEWER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local cached = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[2]) > cached then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
  return 1
end
return 0
",
    )
});

/// Checks and takes units in one step: `-2` unknown SKU, `-1` not enough (with the
/// stock left), else the stock after taking.
static TAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local stock = tonumber(redis.call('GET', KEYS[1]))
if stock == nil then return {-2, 0} end
local quantity = tonumber(ARGV[1])
if stock < quantity then return {-1, stock} end
return {0, redis.call('DECRBY', KEYS[1], quantity)}
",
    )
});

/// What an atomic take found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Taken; this much is left.
    Done {
        left: i64,
    },
    NotEnough {
        available: i64,
    },
    UnknownSku,
}

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

    fn version_key(&self, sku: &Sku) -> String {
        format!("{}:stock-version:{}", self.namespace, sku)
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

    /// A fresh stock after a reset: the value, and no version yet.
    pub async fn reset(&self, sku: &Sku, stock: i64) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = deadpool_redis::redis::pipe()
            .atomic()
            .set(self.key(sku), stock)
            .ignore()
            .del(self.version_key(sku))
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Drops a stock that can no longer be trusted (see `restore`).
    pub async fn forget(&self, sku: &Sku) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(self.key(sku)).await?;
        Ok(())
    }

    /// Rebuilds a lost stock: sets it only if Redis has none. A key that exists was
    /// written by a sale after the loss and is newer than any value read from MySQL
    /// before it, so it must not be overwritten. Returns whether it was set.
    pub async fn restore(&self, sku: &Sku, stock: i64) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.set_nx(self.key(sku), stock).await?)
    }

    /// Sets the stock as of MySQL row version `version`, unless a newer one is cached.
    pub async fn set_stock_if_newer(
        &self,
        sku: &Sku,
        stock: i64,
        version: i64,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        let written: i64 = SET_IF_NEWER
            .key(self.key(sku))
            .key(self.version_key(sku))
            .arg(stock)
            .arg(version)
            .invoke_async(&mut conn)
            .await?;
        Ok(written == 1)
    }

    /// The redis-atomic check-and-decrement, as one Lua script.
    pub async fn take(&self, sku: &Sku, quantity: i64) -> Result<Taken, StoreError> {
        let mut conn = self.pool.get().await?;
        let (outcome, value): (i64, i64) = TAKE
            .key(self.key(sku))
            .arg(quantity)
            .invoke_async(&mut conn)
            .await?;
        Ok(match outcome {
            -2 => Taken::UnknownSku,
            -1 => Taken::NotEnough { available: value },
            _ => Taken::Done { left: value },
        })
    }

    /// Gives units back after a take whose order could not be recorded.
    pub async fn give_back(&self, sku: &Sku, quantity: i64) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let _: i64 = conn.incr(self.key(sku), quantity).await?;
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
