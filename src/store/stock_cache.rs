//! The stock copy in Redis that request handlers read first.
//!
//! One string key per SKU, `<namespace>:stock:<sku>`, holding the units left, and
//! beside it `<namespace>:stock-version:<sku>`, the MySQL row version that value
//! comes from. MySQL stays the system of record; this copy is what makes the race
//! visible, because the naive flow reads it, thinks, and writes back.
//!
//! Every write after a commit carries the row's version and lands only if it is newer
//! than the cached one, so writes that arrive late or out of order (a paused holder, a
//! slow replica, an order of the previous strategy) can never put an older stock back.

use std::sync::LazyLock;

use deadpool_redis::Pool;
use deadpool_redis::redis::{AsyncCommands, Script};

use super::{StockAt, StoreError};
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
/// stock left), else the stock after taking; and the cached version, which tells a
/// later give-back whether the stock has been rewritten since.
static TAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local stock = tonumber(redis.call('GET', KEYS[1]))
local version = redis.call('GET', KEYS[2]) or ''
if stock == nil then return {-2, 0, version} end
local quantity = tonumber(ARGV[1])
if stock < quantity then return {-1, stock, version} end
return {0, redis.call('DECRBY', KEYS[1], quantity), version}
",
    )
});

/// Gives units back only if the stock was not rewritten from MySQL since they were
/// taken (a rewrite already counts them as not sold), nor dropped (a dropped stock
/// waits for a reconcile; it is not recreated from one order's units).
static GIVE_BACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('EXISTS', KEYS[1]) == 1 and (redis.call('GET', KEYS[2]) or '') == ARGV[2] then
  redis.call('INCRBY', KEYS[1], ARGV[1])
  return 1
end
return 0
",
    )
});

/// What an atomic take found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// Taken; this much is left. `generation` is the cached version at the take.
    Done {
        left: i64,
        generation: String,
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

    /// A reset's stock. Versioned like every other write: the reset's version is newer
    /// than any write from before it, and a write of an order after it (a newer
    /// version) that landed first must not be put back.
    pub async fn reset(&self, at: &StockAt) -> Result<(), StoreError> {
        self.set_stock_if_newer(&at.sku, at.stock, at.version)
            .await
            .map(drop)
    }

    /// Drops a stock that can no longer be trusted: the SKU then answers
    /// `stock_unavailable` until reconciled from MySQL.
    pub async fn forget(&self, sku: &Sku) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(self.key(sku)).await?;
        Ok(())
    }

    /// Rewrites the stocks from MySQL (after an admin change moved every version
    /// forward), each only if newer than what is cached. Returns those whose value
    /// was missing or different.
    pub async fn refresh(&self, stocks: &[StockAt]) -> Result<Vec<StockAt>, StoreError> {
        if stocks.is_empty() {
            return Ok(Vec::new());
        }
        let skus: Vec<Sku> = stocks.iter().map(|s| s.sku.clone()).collect();
        let before = self.stocks(&skus).await?;
        let mut pipe = deadpool_redis::redis::pipe();
        for at in stocks {
            pipe.invoke_script(
                SET_IF_NEWER
                    .key(self.key(&at.sku))
                    .key(self.version_key(&at.sku))
                    .arg(at.stock)
                    .arg(at.version),
            );
        }
        let mut conn = self.pool.get().await?;
        // A pipeline sends EVALSHA only: make sure the script is loaded first.
        let _: String = SET_IF_NEWER.load_async(&mut conn).await?;
        let written: Vec<i64> = pipe.query_async(&mut conn).await?;
        Ok(stocks
            .iter()
            .zip(before)
            .zip(written)
            .filter(|((at, before), written)| *written == 1 && *before != Some(at.stock))
            .map(|((at, _), _)| at.clone())
            .collect())
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
        let (outcome, value, generation): (i64, i64, String) = TAKE
            .key(self.key(sku))
            .key(self.version_key(sku))
            .arg(quantity)
            .invoke_async(&mut conn)
            .await?;
        Ok(match outcome {
            -2 => Taken::UnknownSku,
            -1 => Taken::NotEnough { available: value },
            _ => Taken::Done {
                left: value,
                generation,
            },
        })
    }

    /// Gives units back after a take whose order provably was not recorded, unless the
    /// stock has been rewritten from MySQL since (then they are already counted).
    pub async fn give_back(
        &self,
        sku: &Sku,
        quantity: i64,
        generation: &str,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        let given: i64 = GIVE_BACK
            .key(self.key(sku))
            .key(self.version_key(sku))
            .arg(quantity)
            .arg(generation)
            .invoke_async(&mut conn)
            .await?;
        Ok(given == 1)
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
