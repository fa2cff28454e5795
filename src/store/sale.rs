//! Admin changes of the sale (switch the strategy, fencing or the cohort layer, reset
//! a SKU, reconcile the cache, reset fences) and the settings every order reads.
//!
//! Each change is one MySQL transaction that first moves the sale epoch forward (its
//! exclusive lock on the epoch row serialises the changes; orders never lock that
//! row). Then it gives the new epoch to the SKUs it concerns (`products.epoch`): every
//! SKU for a strategy, fencing or cohort switch and a reconcile or fence reset of
//! everything, one SKU for a reset, a reconcile or a fence reset of that SKU. Writing
//! a product row waits for that SKU's order commits in flight (they hold the row, see
//! `order_commit.rs`), and every order that began before the change and concerns one
//! of those SKUs will find its commit refused; the orders of the other SKUs go on.
//! Then:
//!
//! - the row versions of the SKUs it concerns move forward too, and their Redis stock
//!   is rewritten from MySQL with those versions. A cache write of an order that
//!   committed before the change but writes Redis after it carries an older version
//!   and is ignored; so a new strategy never starts from a stock the old one had not
//!   yet written;
//! - the settings are published to Redis with their epoch, only if newer, so two
//!   concurrent changes cannot leave Redis behind MySQL.
//!
//! Every publication carries every SKU's stock, version and epoch as MySQL has them,
//! and a SKU's stock is rewritten only where its epoch moved: so a publication that
//! overtakes an earlier one (or follows one that was lost) brings the SKUs that one
//! changed as well, and never touches a SKU whose orders go on (under redis-atomic,
//! Redis is ahead of MySQL by the units taken and not yet committed: a rewrite would
//! put them back).
//!
//! The stock rewrite and the publication are one Lua script: no order can read or take
//! (both check the SKU's epoch, `stock_cache.rs`) between a rewrite and the epoch it
//! belongs to. Published separately, a redis-atomic order of the old epoch could take
//! a unit from the rewritten stock after the switch, and a lock holder of the new
//! strategy would then sell from the stock that take lowered: a unit lost.
//!
//! MySQL holds the durable copy: if Redis loses the settings, they are published again
//! from it on the next read.

use std::sync::LazyLock;

use deadpool_redis::redis::Script;

use super::cluster_state::{CohortSetting, switch_value};
use super::{ClusterSettings, Store, StoreError};
use crate::model::Sku;
use crate::store::order_commit::{DEADLOCK, mysql_error_number};
use crate::store::records::Records;

/// One admin change of the sale.
#[derive(Debug, Clone)]
pub enum SaleChange {
    Strategy(String),
    Fencing(bool),
    /// The cohort layer on or off, and its combining: orders begun under the other
    /// mode are refused.
    Cohort(CohortSetting),
    /// New stock for a SKU (created if new); its orders and fences are cleared, so a
    /// limit per user (`None`: none) counts each user's units afresh.
    Reset {
        sku: Sku,
        stock: i64,
        limit_per_user: Option<i64>,
    },
    /// Rewrite the Redis stock of `sku`, or of every SKU, from MySQL: repairs missing
    /// and stale values. Only the orders of the SKUs rewritten are fenced off.
    Reconcile {
        sku: Option<Sku>,
    },
    /// Forget the fences of `sku`, or of every SKU, for every lock service: the next
    /// holder's token becomes the fence, however low the lock service's tokens went.
    /// Orders and stock are kept; the Redis stock is rewritten from MySQL as by a
    /// reconcile (the change concerns the SKU: its orders in flight are refused).
    ResetFences {
        sku: Option<Sku>,
    },
}

impl SaleChange {
    /// The one SKU the change concerns, or `None` when it concerns every SKU.
    fn only_sku(&self) -> Option<&Sku> {
        match self {
            SaleChange::Strategy(_) | SaleChange::Fencing(_) | SaleChange::Cohort(_) => None,
            SaleChange::Reset { sku, .. } => Some(sku),
            SaleChange::Reconcile { sku } | SaleChange::ResetFences { sku } => sku.as_ref(),
        }
    }
}

/// The cluster-wide settings as MySQL holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaleSettings {
    pub strategy: String,
    pub fencing: bool,
    /// On unless switched off: MySQL has no row for it until the first switch.
    pub cohort: CohortSetting,
    pub epoch: u64,
}

/// A product's stock as MySQL holds it, with the row version that orders the cache
/// writes and the SKU's epoch (the sale epoch of the last change that concerned it).
#[derive(Debug, Clone)]
pub struct StockAt {
    pub sku: Sku,
    pub stock: i64,
    pub version: i64,
    pub epoch: u64,
}

/// Rewrites stocks and publishes the settings in one step. KEYS: strategy, fencing,
/// epoch, cohort, then stock, version, pending and epoch keys per SKU; ARGV: strategy,
/// fencing, epoch, the mode, the epoch the caller saw in Redis, cohort, then stock,
/// version and epoch per SKU. Returns the indexes of the SKUs whose value changed.
///
/// One script, so the sale's epoch never reaches Redis without the stocks of the SKUs
/// it changed. A SKU's stock, version and epoch are written together, and only where
/// the SKU's epoch moves (its pending mark is cleared then too; a publication that
/// leaves a SKU alone must not clear a mark a holder depends on):
///
/// - `newer` (an admin change): a SKU whose published epoch is newer than Redis's, so
///   of two concurrent changes of a SKU the later one wins whichever lands first; the
///   settings only over an older sale epoch or its own. A SKU Redis has no epoch for
///   reads as 0 (never changed since SKU epochs exist, or lost with Redis's data: then
///   a SKU changed since is rewritten, one never changed waits for a reconcile).
/// - `replace` (a resync: MySQL is the authority and Redis disagreed): only if Redis
///   still has the sale epoch the caller saw, so two resyncs and a change cannot undo
///   each other; then every SKU whose epoch differs either way (MySQL may have been
///   restored or replaced under a running cache) and the settings.
///
/// A SKU whose epoch moves has its stock overwritten whatever its version: nothing
/// cached before the change is trusted (no order from before it can commit any more).
/// A SKU whose epoch stays is never rewritten: its orders go on, and under
/// redis-atomic Redis is ahead of MySQL by the units taken and not yet committed.
static PUBLISH_SALE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local seen = redis.call('GET', KEYS[3])
local newer = ARGV[4] == 'newer'
if not newer and (seen or '') ~= ARGV[5] then return {} end
local rewritten = {}
for i = 0, (#KEYS - 4) / 4 - 1 do
  local k, a = 5 + 4 * i, 7 + 3 * i
  local cached = tonumber(redis.call('GET', KEYS[k + 3]) or '0')
  local published = tonumber(ARGV[a + 2])
  -- A missing stock (Redis lost it) is left missing unless this change concerns the
  -- SKU: rewriting it here would not fence off the orders that took from it before
  -- the loss, and they would commit under the rewritten stock.
  local concerned = redis.call('EXISTS', KEYS[k]) == 1 or published == tonumber(ARGV[3])
  if (newer and published > cached and concerned) or (not newer and published ~= cached) then
    if redis.call('GET', KEYS[k]) ~= ARGV[a] then table.insert(rewritten, i) end
    redis.call('SET', KEYS[k], ARGV[a])
    redis.call('SET', KEYS[k + 1], ARGV[a + 1])
    redis.call('DEL', KEYS[k + 2])
    redis.call('SET', KEYS[k + 3], ARGV[a + 2])
  end
end
if not newer or tonumber(ARGV[3]) >= tonumber(seen or '-1') then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
  redis.call('SET', KEYS[3], ARGV[3])
  redis.call('SET', KEYS[4], ARGV[6])
end
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

/// How often a change is retried after InnoDB chose it as a deadlock victim (orders
/// take only product rows, in SKU order like a change, but someone's manual
/// transaction may not).
const DEADLOCK_RETRIES: u32 = 5;

impl Store {
    /// Applies an admin change; returns the SKUs whose Redis stock it rewrote with a
    /// different value (for reconcile's answer), for a reset the SKU reset, for a
    /// fence reset the SKUs whose fences were reset.
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
        match &change {
            SaleChange::Reset { sku, .. } => {
                self.timeline.clear(sku).await?;
                Ok(stocks.into_iter().filter(|at| at.sku == *sku).collect())
            }
            SaleChange::ResetFences { sku } => Ok(stocks
                .into_iter()
                .filter(|at| sku.as_ref().is_none_or(|sku| at.sku == *sku))
                .collect()),
            _ => Ok(rewritten),
        }
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
            .arg(switch_value(settings.fencing))
            .arg(settings.epoch)
            .arg(match mode {
                Publish::IfNewer => "newer",
                Publish::IfStill(_) => "replace",
            })
            .arg(match mode {
                Publish::IfStill(Some(seen)) => seen.to_string(),
                _ => String::new(),
            })
            .arg(settings.cohort.encode());
        for at in stocks {
            for key in self.cache.keys(&at.sku) {
                script.key(key);
            }
            script.arg(at.stock).arg(at.version).arg(at.epoch);
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
    /// The stocks of the SKUs whose epoch differs are rewritten from the same MySQL
    /// snapshot in the same script: publishing an epoch before its rewrite would let
    /// its orders read a cache the change meant to replace.
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
        if let (Some(strategy), Some(fencing), Some(cohort), Some(epoch)) =
            (cached.strategy, cached.fencing, cached.cohort, cached.epoch)
        {
            return Ok(ClusterSettings {
                strategy,
                fencing,
                cohort: cohort.enabled,
                combine: cohort.combine,
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
                // Same epoch: its stocks are in Redis already (the script would leave
                // them alone anyway: no SKU's epoch differs).
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
            cohort: durable.cohort.enabled,
            combine: durable.cohort.combine,
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
        let rows: Vec<(String, i64, i64, u64)> = sqlx::query_as(STOCKS).fetch_all(&mut *tx).await?;
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
                    .bind(switch_value(*enabled))
                    .execute(&mut *tx)
                    .await?;
            }
            SaleChange::Cohort(cohort) => {
                sqlx::query(save)
                    .bind("cohort")
                    .bind(cohort.encode())
                    .execute(&mut *tx)
                    .await?;
            }
            SaleChange::Reset {
                sku,
                stock,
                limit_per_user,
            } => {
                // The version keeps growing across resets (and is moved to this
                // epoch's range below).
                sqlx::query(
                    "INSERT INTO products (sku, stock, initial_stock, version, limit_per_user)
                     VALUES (?, ?, ?, 1, ?)
                     ON DUPLICATE KEY UPDATE stock = VALUES(stock),
                         initial_stock = VALUES(initial_stock), version = version + 1,
                         limit_per_user = VALUES(limit_per_user)",
                )
                .bind(sku.as_str())
                .bind(stock)
                .bind(stock)
                .bind(limit_per_user)
                .execute(&mut *tx)
                .await?;
                // The keys answered with the SKU's orders go with them: a replay must
                // not name an order that no longer exists. Such a key buys again in
                // the new sale; refusals stored for keys stay (24 h, like every key).
                sqlx::query(
                    "DELETE k FROM idempotency_keys k
                     JOIN orders o ON o.idempotency_key = k.idem_key WHERE o.sku = ?",
                )
                .bind(sku.as_str())
                .execute(&mut *tx)
                .await?;
                sqlx::query("DELETE FROM orders WHERE sku = ?")
                    .bind(sku.as_str())
                    .execute(&mut *tx)
                    .await?;
                // The limit per user counts each sale afresh.
                sqlx::query("DELETE FROM units_per_user WHERE sku = ?")
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
            // The fences go once the product rows are locked, below.
            SaleChange::Reconcile { .. } | SaleChange::ResetFences { .. } => {}
        }
        // The SKUs the change concerns get its epoch: their orders from before it are
        // refused from now on, those of the other SKUs go on. A switch concerns every
        // SKU: a publication that rewrote only some would leave the others showing
        // what the old strategy had done to them (a unit taken by a redis-atomic order
        // that will never commit), and the new strategy would sell from that.
        //
        // Versions written by a change of epoch E start at E << 32 (orders add 1
        // each), so they never go backwards across changes, not even for a row deleted
        // and created again: a cache write from before the change can never pass for
        // a newer one.
        let covered = "UPDATE products SET
                 epoch = (SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch'),
                 version = GREATEST(version + 1,
                     (SELECT CAST(value AS UNSIGNED) FROM cluster_settings WHERE name = 'epoch') << 32)";
        match change.only_sku() {
            Some(sku) => {
                sqlx::query(sqlx::AssertSqlSafe(format!("{covered} WHERE sku = ?")))
                    .bind(sku.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
            None => {
                sqlx::query(covered).execute(&mut *tx).await?;
            }
        }
        // After the product rows, in the order a holder's registration takes them
        // (product row shared, then the fence): a holder that began before this
        // change either registered already, and its fence goes now, or waits for the
        // product row, finds the new epoch and registers nothing. Its commit is refused
        // for the epoch either way: no holder from before writes under the lowered
        // fence, and none can put its old token back.
        if let SaleChange::ResetFences { sku } = change {
            match sku {
                Some(sku) => {
                    sqlx::query("DELETE FROM product_fences WHERE sku = ?")
                        .bind(sku.as_str())
                        .execute(&mut *tx)
                        .await?;
                }
                None => {
                    sqlx::query("DELETE FROM product_fences")
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        // Every SKU's: the script rewrites those whose epoch moved, here or in an
        // earlier change whose publication this one overtakes (or that was lost).
        let rows: Vec<(String, i64, i64, u64)> = sqlx::query_as(STOCKS).fetch_all(&mut *tx).await?;
        // Read inside the transaction: what is published is what this change made.
        let settings: Vec<(String, String)> = sqlx::query_as(SETTINGS).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let stocks = stocks_at(rows)?;
        Ok((parse_settings(&settings)?, stocks))
    }
}

const SETTINGS: &str = "SELECT name, value FROM cluster_settings
     WHERE name IN ('strategy', 'fencing', 'cohort', 'epoch')";

const STOCKS: &str = "SELECT sku, stock, version, epoch FROM products ORDER BY sku";

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
        cohort: value("cohort").map_or(CohortSetting::ON, CohortSetting::decode),
        epoch,
    })
}

fn stocks_at(rows: Vec<(String, i64, i64, u64)>) -> Result<Vec<StockAt>, StoreError> {
    rows.into_iter()
        .map(|(sku, stock, version, epoch)| {
            let sku = Sku::parse(&sku).map_err(|detail| StoreError::Corrupt {
                what: "products.sku",
                detail,
            })?;
            Ok(StockAt {
                sku,
                stock,
                version,
                epoch,
            })
        })
        .collect()
}
