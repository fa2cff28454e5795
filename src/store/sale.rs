//! Admin changes of the sale (switch the strategy or fencing, reset a SKU, reconcile
//! the cache) and the settings every order reads.
//!
//! Each change is one MySQL transaction that first moves the sale epoch forward. Its
//! exclusive lock on the epoch row waits for the order commits in flight (they hold it
//! shared, see `order_commit.rs`), and every order of an older epoch that has not
//! committed yet will find its commit refused. Then:
//!
//! - the products' row versions move forward too, and the Redis stock is rewritten from
//!   MySQL with those versions. A cache write of an order that committed before the
//!   change but writes Redis after it carries an older version and is ignored; so a new
//!   strategy never starts from a stock the old one had not yet written;
//! - the settings are published to Redis with their epoch, only if newer, so two
//!   concurrent changes cannot leave Redis behind MySQL.
//!
//! The stock rewrite and the publication are one Lua script: no order can read or take
//! (both check the epoch, `stock_cache.rs`) between a rewrite and the epoch it belongs
//! to. Published separately, a redis-atomic order of the old epoch could take a unit
//! from the rewritten stock after the switch, and a lock holder of the new strategy
//! would then sell from the stock that take lowered: a unit lost.
//!
//! MySQL holds the durable copy: if Redis loses the settings, they are published again
//! from it on the next read.

use std::sync::LazyLock;

use deadpool_redis::redis::Script;

use super::cluster_state::fencing_value;
use super::{ClusterSettings, Store, StoreError};
use crate::model::Sku;
use crate::store::order_commit::{DEADLOCK, mysql_error_number};
use crate::store::records::Records;

/// One admin change of the sale.
#[derive(Debug, Clone)]
pub enum SaleChange {
    Strategy(String),
    Fencing(bool),
    /// New stock for a SKU (created if new); its orders and fences are cleared.
    Reset {
        sku: Sku,
        stock: i64,
    },
    /// Rewrite every SKU's Redis stock from MySQL: repairs missing and stale values.
    Reconcile,
}

/// The cluster-wide settings as MySQL holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaleSettings {
    pub strategy: String,
    pub fencing: bool,
    pub epoch: u64,
}

/// A product's stock as MySQL holds it, with the row version that orders the cache
/// writes.
#[derive(Debug, Clone)]
pub struct StockAt {
    pub sku: Sku,
    pub stock: i64,
    pub version: i64,
}

/// Rewrites stocks and publishes the settings in one step. KEYS: strategy, fencing,
/// epoch, then stock, version and pending keys per SKU; ARGV: strategy, fencing, epoch,
/// the mode, the epoch the caller saw in Redis, then stock and version per SKU.
/// Returns the indexes of the SKUs whose value changed.
///
/// Either everything is written or nothing: a publication carries MySQL's stock of
/// every SKU at its epoch, so the epoch never reaches Redis without its stocks, and an
/// older publication arriving late changes nothing (not even a stock: it would
/// clear a pending mark a newer holder depends on).
///
/// - `newer` (an admin change): only over an older epoch or its own, so of two
///   concurrent changes the later one wins. Its own: a resync may have published the
///   change's epoch first (with settings only, after Redis lost its data), and the
///   change must still write its stocks; at the same epoch only newer versions land.
/// - `replace` (a resync: MySQL is the authority and Redis disagreed): only if Redis
///   still has the epoch the caller saw, so two resyncs and a change cannot undo each
///   other.
///
/// A publication that moves the epoch overwrites every stock it carries: nothing
/// cached under another epoch is trusted (no order of that epoch can commit any more,
/// and MySQL may have been restored or replaced under a running cache). One that
/// keeps the epoch writes a stock only over an older version.
static PUBLISH_SALE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local seen = redis.call('GET', KEYS[3])
local cached = tonumber(seen or '-1')
local epoch = tonumber(ARGV[3])
if ARGV[4] == 'newer' then
  if epoch < cached then return {} end
else
  if (seen or '') ~= ARGV[5] then return {} end
end
local moves = cached ~= epoch
local rewritten = {}
for i = 0, (#KEYS - 3) / 3 - 1 do
  local k, a = 4 + 3 * i, 6 + 2 * i
  local version = tonumber(redis.call('GET', KEYS[k + 1]) or '-1')
  if moves or tonumber(ARGV[a + 1]) > version then
    if redis.call('GET', KEYS[k]) ~= ARGV[a] then table.insert(rewritten, i) end
    redis.call('SET', KEYS[k], ARGV[a])
    redis.call('SET', KEYS[k + 1], ARGV[a + 1])
    redis.call('DEL', KEYS[k + 2])
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
return rewritten
",
    )
});

/// When `publish` replaces what Redis has.
#[derive(Debug, Clone, Copy)]
enum Publish {
    /// An admin change: only over an older epoch.
    IfNewer,
    /// A resync: only if Redis still has this epoch (`None`: none at all).
    IfStill(Option<u64>),
}

/// How often a change is retried after InnoDB chose it as a deadlock victim (against
/// an order holding its product row and waiting for the epoch row).
const DEADLOCK_RETRIES: u32 = 5;

impl Store {
    /// Applies an admin change; returns the SKUs whose Redis stock it rewrote with a
    /// different value (for reconcile's answer).
    ///
    /// The change runs in a task of its own: an admin who hangs up, or a request
    /// timeout, must not stop it between its MySQL commit and its publication (Redis
    /// would keep the old epoch's stock and refuse a restock as sold out). If the
    /// publication fails all the same (Redis down), every replica's heartbeat
    /// republishes (`resync_settings`).
    pub async fn change_sale(&self, change: SaleChange) -> Result<Vec<StockAt>, StoreError> {
        let store = self.clone();
        // Never cancelled, so the only failure is a panic, passed on as one.
        tokio::spawn(async move {
            let applied = store.apply_and_publish(change).await;
            if let Err(error) = &applied {
                // Logged here: the caller may be gone.
                tracing::warn!(%error, "an admin change failed");
            }
            applied
        })
        .await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
    }

    async fn apply_and_publish(&self, change: SaleChange) -> Result<Vec<StockAt>, StoreError> {
        let (settings, stocks) = self.records.apply_change(&change).await?;
        let rewritten = self.publish(&settings, &stocks, Publish::IfNewer).await?;
        if let SaleChange::Reset { sku, .. } = &change {
            self.timeline.clear(sku).await?;
            return Ok(stocks.into_iter().filter(|at| at.sku == *sku).collect());
        }
        Ok(rewritten)
    }

    /// Rewrites `stocks` in Redis and publishes `settings`, in one script (see
    /// `PUBLISH_SALE`). Returns the stocks whose cached value changed.
    async fn publish(
        &self,
        settings: &SaleSettings,
        stocks: &[StockAt],
        mode: Publish,
    ) -> Result<Vec<StockAt>, StoreError> {
        let mut script = PUBLISH_SALE.prepare_invoke();
        for key in self.cluster.settings_keys() {
            script.key(key);
        }
        script
            .arg(&settings.strategy)
            .arg(fencing_value(settings.fencing))
            .arg(settings.epoch)
            .arg(match mode {
                Publish::IfNewer => "newer",
                Publish::IfStill(_) => "replace",
            })
            .arg(match mode {
                Publish::IfStill(Some(seen)) => seen.to_string(),
                _ => String::new(),
            });
        for at in stocks {
            for key in self.cache.keys(&at.sku) {
                script.key(key);
            }
            script.arg(at.stock).arg(at.version);
        }
        let mut conn = self.cache.connection().await?;
        let rewritten: Vec<usize> = script.invoke_async(&mut conn).await?;
        Ok(rewritten
            .into_iter()
            .filter_map(|i| stocks.get(i).cloned())
            .collect())
    }

    /// Publishes MySQL's settings to Redis when Redis's epoch differs: an order
    /// refused for an epoch it never saw calls this, and so does every heartbeat, so a
    /// change whose publication failed (Redis down after the MySQL commit) cannot stall
    /// the sale, nor can a Redis that is ahead of MySQL (MySQL restored under a running
    /// cache).
    ///
    /// The stock is rewritten from the same MySQL snapshot in the same script:
    /// publishing an epoch before its rewrite would let its orders read a cache the
    /// change meant to replace.
    pub async fn resync_settings(&self) -> Result<(), StoreError> {
        let cached = self.cluster.cached_settings().await?;
        // Redis that lost its data entirely (restarted empty) is `settings`' case: the
        // stocks stay missing until an admin reconciles, because a holder from before
        // the loss may still commit, and its pending mark is gone.
        let Some(cached_epoch) = cached.epoch else {
            return Ok(());
        };
        // Cheap first: most refused orders find Redis already caught up.
        if cached_epoch == self.records.sale_settings().await?.epoch {
            return Ok(());
        }
        let (durable, stocks) = self.records.settings_and_stocks().await?;
        tracing::warn!(redis = ?cached.epoch, mysql = durable.epoch,
            "Redis had another sale epoch than MySQL: republishing MySQL's");
        self.publish(&durable, &stocks, Publish::IfStill(cached.epoch))
            .await
            .map(drop)
    }

    /// The settings an order needs: one Redis round trip. If Redis lost them (a
    /// restart), they are read from MySQL's durable copy and published again rather
    /// than silently falling back to a default.
    pub async fn settings(&self) -> Result<ClusterSettings, StoreError> {
        let cached = self.cluster.cached_settings().await?;
        if let (Some(strategy), Some(fencing), Some(epoch)) =
            (cached.strategy, cached.fencing, cached.epoch)
        {
            return Ok(ClusterSettings {
                strategy,
                fencing,
                epoch,
                pause: cached.pause,
            });
        }
        // Redis restarted empty: the settings only. The stocks stay missing (orders
        // answer 503 `unavailable`) until an admin reconciles once the holders from
        // before the loss are done: their pending marks went with the data, so a stock
        // rebuilt now could miss a commit still under way. If only some settings went
        // missing under another epoch than MySQL's, they come back with the stocks of
        // the same snapshot, so an epoch never reaches Redis without its stocks.
        let (durable, stocks) = match cached.epoch {
            None => (self.records.sale_settings().await?, Vec::new()),
            Some(epoch) => {
                let (durable, stocks) = self.records.settings_and_stocks().await?;
                // Same epoch: its stocks are in Redis already (rewriting them from
                // MySQL would put back units redis-atomic has taken and not yet
                // committed).
                let stocks = if durable.epoch == epoch {
                    Vec::new()
                } else {
                    stocks
                };
                (durable, stocks)
            }
        };
        self.publish(&durable, &stocks, Publish::IfStill(cached.epoch))
            .await?;
        Ok(ClusterSettings {
            strategy: durable.strategy,
            fencing: durable.fencing,
            epoch: durable.epoch,
            pause: cached.pause,
        })
    }
}

impl Records {
    /// The settings' durable copy.
    pub async fn sale_settings(&self) -> Result<SaleSettings, StoreError> {
        let rows = sqlx::query_as(SETTINGS).fetch_all(self.pool()).await?;
        parse_settings(&rows)
    }

    /// The settings and every product's stock, read in one snapshot.
    async fn settings_and_stocks(&self) -> Result<(SaleSettings, Vec<StockAt>), StoreError> {
        let mut tx = self.begin().await?;
        let settings: Vec<(String, String)> = sqlx::query_as(SETTINGS).fetch_all(&mut *tx).await?;
        let rows: Vec<(String, i64, i64)> =
            sqlx::query_as("SELECT sku, stock, version FROM products ORDER BY sku")
                .fetch_all(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok((parse_settings(&settings)?, stocks_at(rows)?))
    }

    /// The change's transaction, retried when InnoDB picks it as a deadlock victim.
    /// Returns the settings after it and the stocks the cache must now show.
    async fn apply_change(
        &self,
        change: &SaleChange,
    ) -> Result<(SaleSettings, Vec<StockAt>), StoreError> {
        let mut attempt = 0;
        loop {
            match self.try_apply_change(change).await {
                Err(StoreError::Mysql(error))
                    if attempt < DEADLOCK_RETRIES
                        && mysql_error_number(&error) == Some(DEADLOCK) =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn try_apply_change(
        &self,
        change: &SaleChange,
    ) -> Result<(SaleSettings, Vec<StockAt>), StoreError> {
        let mut tx = self.begin().await?;
        // First, so that from here on no order of the old epoch can commit.
        sqlx::query(
            "UPDATE cluster_settings SET value = CAST(value AS UNSIGNED) + 1 WHERE name = 'epoch'",
        )
        .execute(&mut *tx)
        .await?;
        let save = "INSERT INTO cluster_settings (name, value) VALUES (?, ?)
                    ON DUPLICATE KEY UPDATE value = VALUES(value)";
        match change {
            SaleChange::Strategy(name) => {
                sqlx::query(save)
                    .bind("strategy")
                    .bind(name)
                    .execute(&mut *tx)
                    .await?;
            }
            SaleChange::Fencing(enabled) => {
                sqlx::query(save)
                    .bind("fencing")
                    .bind(if *enabled { "on" } else { "off" })
                    .execute(&mut *tx)
                    .await?;
            }
            SaleChange::Reset { sku, stock } => {
                // The version keeps growing across resets (and is moved to this
                // epoch's range below).
                sqlx::query(
                    "INSERT INTO products (sku, stock, initial_stock, version) VALUES (?, ?, ?, 1)
                     ON DUPLICATE KEY UPDATE stock = VALUES(stock),
                         initial_stock = VALUES(initial_stock), version = version + 1",
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
                // A lock service whose data was wiped restarts its tokens low; a reset
                // is the way to let it fence again.
                sqlx::query("DELETE FROM product_fences WHERE sku = ?")
                    .bind(sku.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
            SaleChange::Reconcile => {}
        }
        // Every change publishes every SKU's stock with its epoch, newer than anything
        // cached: a publication that rewrote only some would leave the others showing
        // what the old strategy had done to them (a unit taken by a redis-atomic order
        // that will never commit), and the new strategy would sell from that.
        //
        // Versions of epoch E start at E << 32 (orders add 1 each), so they never go
        // backwards across changes, not even for a row deleted and created again: a
        // cache write from before the change can never pass for a newer one.
        sqlx::query(
            "UPDATE products SET version = GREATEST(version + 1,
                 (SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch') << 32)",
        )
        .execute(&mut *tx)
        .await?;
        let rows: Vec<(String, i64, i64)> =
            sqlx::query_as("SELECT sku, stock, version FROM products ORDER BY sku")
                .fetch_all(&mut *tx)
                .await?;
        // Read inside the transaction: what is published is what this change made.
        let settings: Vec<(String, String)> = sqlx::query_as(SETTINGS).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let stocks = stocks_at(rows)?;
        Ok((parse_settings(&settings)?, stocks))
    }
}

const SETTINGS: &str =
    "SELECT name, value FROM cluster_settings WHERE name IN ('strategy', 'fencing', 'epoch')";

fn parse_settings(rows: &[(String, String)]) -> Result<SaleSettings, StoreError> {
    let value = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let epoch = value("epoch")
        .and_then(|e| e.parse().ok())
        .ok_or_else(|| StoreError::Corrupt {
            what: "cluster_settings.epoch",
            detail: format!("{:?}", value("epoch")),
        })?;
    Ok(SaleSettings {
        strategy: value("strategy")
            .unwrap_or(super::DEFAULT_STRATEGY)
            .to_owned(),
        fencing: value("fencing") == Some("on"),
        epoch,
    })
}

fn stocks_at(rows: Vec<(String, i64, i64)>) -> Result<Vec<StockAt>, StoreError> {
    rows.into_iter()
        .map(|(sku, stock, version)| {
            let sku = Sku::parse(&sku).map_err(|detail| StoreError::Corrupt {
                what: "products.sku",
                detail,
            })?;
            Ok(StockAt {
                sku,
                stock,
                version,
            })
        })
        .collect()
}
