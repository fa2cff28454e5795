//! Where the sale's data lives: the Redis stock cache, the MySQL records, and the
//! small pieces of cluster-wide state (active strategy, live replicas) in Redis.
//!
//! Everything here speaks in domain terms (`stock`, `commit_order`); the Redis
//! commands and SQL stay inside this folder.

mod cluster_state;
mod records;
mod stock_cache;

pub use cluster_state::{ClusterSettings, ClusterState, ReplicaInfo};
pub use records::{LockedProduct, ProductRecord, Records};
pub use stock_cache::{StockCache, Taken};

use deadpool_redis::redis::RedisError;

/// The stores one replica uses, with their connection pools.
#[derive(Clone)]
pub struct Store {
    pub cache: StockCache,
    pub records: Records,
    pub cluster: ClusterState,
}

const STRATEGY_SETTING: &str = "strategy";
const FENCING_SETTING: &str = "fencing";

impl Store {
    /// The cluster-wide settings: one Redis round trip on the order path. If Redis
    /// lost them (a restart), they are read from MySQL's durable copy and put back,
    /// rather than silently falling back to the default strategy.
    pub async fn settings(&self) -> Result<ClusterSettings, StoreError> {
        let cached = self.cluster.cached_settings().await?;
        if let (Some(strategy), Some(fencing)) = (&cached.strategy, cached.fencing) {
            return Ok(ClusterSettings {
                strategy: Some(strategy.clone()),
                fencing,
                pause_holder_ms: cached.pause_holder_ms,
            });
        }
        let strategy = self.records.setting(STRATEGY_SETTING).await?;
        let fencing = self.records.setting(FENCING_SETTING).await?.as_deref() == Some("on");
        if let Some(strategy) = &strategy {
            self.cluster.restore_settings(strategy, fencing).await?;
        }
        Ok(ClusterSettings {
            strategy,
            fencing,
            pause_holder_ms: cached.pause_holder_ms,
        })
    }

    /// Switches the strategy: the durable copy first, then the one orders read.
    pub async fn set_active_strategy(&self, name: &str) -> Result<(), StoreError> {
        self.records.save_setting(STRATEGY_SETTING, name).await?;
        self.cluster.set_active_strategy(name).await
    }

    pub async fn set_fencing(&self, enabled: bool) -> Result<(), StoreError> {
        let value = if enabled { "on" } else { "off" };
        self.records.save_setting(FENCING_SETTING, value).await?;
        self.cluster.set_fencing(enabled).await
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
    #[error("redis pool: {0}")]
    RedisPool(#[from] deadpool_redis::PoolError),
    #[error("mysql: {0}")]
    Mysql(#[from] sqlx::Error),
    /// COMMIT failed: MySQL may or may not have committed (the connection dropped).
    #[error("mysql: commit outcome unknown: {0}")]
    CommitOutcomeUnknown(sqlx::Error),
    /// A row lock (`SELECT … FOR UPDATE`) was not granted within the wait.
    #[error("row lock not granted in time")]
    RowLockTimeout,
    #[error("unexpected data in {what}: {detail}")]
    Corrupt { what: &'static str, detail: String },
}

impl StoreError {
    /// The backend's name when the error means "could not reach it in time" (worth a
    /// 503 and a retry), `None` when it is a bug or bad data.
    pub fn unavailable_backend(&self) -> Option<&'static str> {
        match self {
            StoreError::Redis(e)
                if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() =>
            {
                Some("redis")
            }
            StoreError::RedisPool(_) => Some("redis"),
            StoreError::CommitOutcomeUnknown(_) => Some("mysql"),
            StoreError::Mysql(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed,
            ) => Some("mysql"),
            _ => None,
        }
    }
}
