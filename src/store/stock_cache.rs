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
//!
//! A lock holder's commit and its cache write are two steps; a holder killed between
//! them leaves a stock one order too high, and the next holder would sell from it (two
//! orders, one decrement) even though the lock never failed. So a lock holder marks
//! the stock *pending* (`<namespace>:stock-pending:<sku>`) when it reads it to sell,
//! and its cache write clears the mark. The next holder that finds a mark nobody
//! cleared cannot trust the value: it rebuilds it from MySQL first.
//!
//! Every read or take made to sell also checks the SKU's epoch, which `sale.rs`
//! publishes with the stock (`<namespace>:stock-epoch:<sku>`, the sale epoch of the
//! last change that concerned the SKU; missing reads as 0, "not changed since the
//! SKU epochs were introduced", as MySQL's rows of then say): an order that began
//! before a change of its SKU (a switch, a reset or reconcile of the SKU) can neither
//! take units from the stock that change rewrote nor repair it, while a change of
//! another SKU leaves it alone.

use std::sync::LazyLock;

use crate::redis_pool::Pool;
use deadpool_redis::redis::{AsyncCommands, Script};

use super::StoreError;
use crate::model::Sku;

/// Writes the stock of a MySQL row version and clears the writer's pending mark.
/// `newer` (a committer's write) lands only over an older version. `repair` (a holder
/// that read MySQL because the cache was suspect or stale) also over the same version,
/// but only while the SKU has not changed since the repairer's epoch (an order of a
/// strategy switched off must not rewrite a stock the new one is taking from). Neither recreates
/// a stock that is not there: a dropped stock, or one Redis lost with its data, waits
/// for a reconcile. (A holder paused across a Redis restart would otherwise put back
/// the stock of its own old commit, and the next holders would sell from it.)
static WRITE_STOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local cached = tonumber(redis.call('GET', KEYS[2]) or '-1')
local version = tonumber(ARGV[2])
local allowed = version > cached
if ARGV[4] == 'repair' then
  local changed = tonumber(redis.call('GET', KEYS[4]) or '0')
  allowed = version >= cached and changed <= tonumber(ARGV[5])
end
allowed = allowed and redis.call('EXISTS', KEYS[1]) == 1
local written = 0
if allowed then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
  written = 1
end
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) == ARGV[3] then
  redis.call('DEL', KEYS[3])
end
return written
",
    )
});

/// A lock holder's read: refuses a read of a SKU changed since the order's epoch,
/// reports a dropped stock (it
/// waits for a reconcile, whatever marks are left), then a pending mark nobody
/// cleared, else returns the stock and, if it covers the order, marks it pending.
static READ_TO_SELL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if tonumber(redis.call('GET', KEYS[3]) or '0') > tonumber(ARGV[3]) then
  return {'epoch', 0, ''}
end
local stock = tonumber(redis.call('GET', KEYS[1]))
if stock == nil then return {'missing', 0, ''} end
local pending = redis.call('GET', KEYS[2])
if pending then return {'suspect', 0, pending} end
if stock >= tonumber(ARGV[1]) then redis.call('SET', KEYS[2], ARGV[2]) end
return {'stock', stock, ''}
",
    )
});

/// Checks and takes units in one step: `-3` the SKU changed since the order's epoch, `-2`
/// unknown SKU, `-1` not enough (with the stock left), else the stock after taking;
/// and the cached version, which tells a later give-back whether the stock has been
/// rewritten since.
static TAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if tonumber(redis.call('GET', KEYS[3]) or '0') > tonumber(ARGV[2]) then
  return {-3, 0, ''}
end
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

/// Deletes a pending mark if it is still the given one (a compare-and-delete).
static CLEAR_MARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
",
    )
});

/// What a lock holder's read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadToSell {
    /// The stock; marked pending with the reader's mark if it covers the order.
    Stock(i64),
    /// Never stocked, or lost by Redis.
    Missing,
    /// A holder marked the stock pending and never cleared it (killed between its
    /// commit and its cache write, or it gave up): rebuild it from MySQL first.
    Suspect { mark: String },
    /// The SKU changed (a switch, a reset or reconcile of it) since the order began.
    SaleChanged,
}

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
    /// The SKU changed since the order began: nothing taken.
    SaleChanged,
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

    fn pending_key(&self, sku: &Sku) -> String {
        format!("{}:stock-pending:{}", self.namespace, sku)
    }

    /// The sale epoch of the last change that concerned the SKU, as published.
    fn epoch_key(&self, sku: &Sku) -> String {
        format!("{}:stock-epoch:{}", self.namespace, sku)
    }

    /// A SKU's stock, version, pending and epoch keys, in that order (for `sale.rs`,
    /// which rewrites them with the settings in one script).
    pub(super) fn keys(&self, sku: &Sku) -> [String; 4] {
        [
            self.key(sku),
            self.version_key(sku),
            self.pending_key(sku),
            self.epoch_key(sku),
        ]
    }

    pub(super) async fn connection(&self) -> Result<crate::redis_pool::Connection, StoreError> {
        Ok(self.pool.get().await?)
    }

    /// Units left, or `None` when the SKU was never stocked.
    pub async fn stock(&self, sku: &Sku) -> Result<Option<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get(self.key(sku)).await?)
    }

    /// Drops a stock that can no longer be trusted: the SKU then answers
    /// `stock_unavailable` until reconciled from MySQL.
    pub async fn forget(&self, sku: &Sku) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let () = conn.del(self.key(sku)).await?;
        Ok(())
    }

    /// A lock holder's read of the stock it means to sell (see the module comment).
    pub async fn read_to_sell(
        &self,
        sku: &Sku,
        quantity: i64,
        mark: &str,
        epoch: u64,
    ) -> Result<ReadToSell, StoreError> {
        let mut conn = self.pool.get().await?;
        let (found, stock, pending): (String, i64, String) = READ_TO_SELL
            .key(self.key(sku))
            .key(self.pending_key(sku))
            .key(self.epoch_key(sku))
            .arg(quantity)
            .arg(mark)
            .arg(epoch)
            .invoke_async(&mut conn)
            .await?;
        Ok(match found.as_str() {
            "stock" => ReadToSell::Stock(stock),
            "suspect" => ReadToSell::Suspect { mark: pending },
            "epoch" => ReadToSell::SaleChanged,
            _ => ReadToSell::Missing,
        })
    }

    /// Sets the stock as of MySQL row version `version`, unless a newer one is cached,
    /// and clears the writer's pending mark (`mark`, empty for none).
    pub async fn set_stock_if_newer(
        &self,
        sku: &Sku,
        stock: i64,
        version: i64,
        mark: &str,
    ) -> Result<bool, StoreError> {
        self.write_stock(sku, stock, version, mark, None).await
    }

    /// Rewrites the stock from what MySQL holds (`stock` at `version`, read after the
    /// cache was found suspect or stale) unless a newer version is cached, while the
    /// SKU has not changed since `epoch`; clears the pending mark `mark` if it is
    /// still there.
    pub async fn repair(
        &self,
        sku: &Sku,
        stock: i64,
        version: i64,
        mark: &str,
        epoch: u64,
    ) -> Result<bool, StoreError> {
        self.write_stock(sku, stock, version, mark, Some(epoch))
            .await
    }

    async fn write_stock(
        &self,
        sku: &Sku,
        stock: i64,
        version: i64,
        mark: &str,
        repair_at: Option<u64>,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool.get().await?;
        let written: i64 = WRITE_STOCK
            .key(self.key(sku))
            .key(self.version_key(sku))
            .key(self.pending_key(sku))
            .key(self.epoch_key(sku))
            .arg(stock)
            .arg(version)
            .arg(mark)
            .arg(if repair_at.is_some() {
                "repair"
            } else {
                "newer"
            })
            .arg(repair_at.unwrap_or_default())
            .invoke_async(&mut conn)
            .await?;
        Ok(written == 1)
    }

    /// Clears a lock holder's own pending mark (`mark`) without writing the stock: its
    /// MySQL transaction rolled back, so the stock it marked is still MySQL's. Another
    /// holder's mark is left alone.
    pub async fn clear_mark(&self, sku: &Sku, mark: &str) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let _: i64 = CLEAR_MARK
            .key(self.pending_key(sku))
            .arg(mark)
            .invoke_async(&mut conn)
            .await?;
        Ok(())
    }

    /// The redis-atomic check-and-decrement, as one Lua script, for an order of sale
    /// epoch `epoch`.
    pub async fn take(&self, sku: &Sku, quantity: i64, epoch: u64) -> Result<Taken, StoreError> {
        let mut conn = self.pool.get().await?;
        let (outcome, value, generation): (i64, i64, String) = TAKE
            .key(self.key(sku))
            .key(self.version_key(sku))
            .key(self.epoch_key(sku))
            .arg(quantity)
            .arg(epoch)
            .invoke_async(&mut conn)
            .await?;
        Ok(match outcome {
            -3 => Taken::SaleChanged,
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

    pub fn pool_use(&self) -> super::PoolUse {
        let status = self.pool.status();
        super::PoolUse {
            pool: "redis",
            in_use: status.size.saturating_sub(status.available),
            idle: status.available,
            waiting: Some(status.waiting),
        }
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        let _: String = deadpool_redis::redis::cmd("PING")
            .query_async(&mut conn)
            .await?;
        Ok(())
    }
}
