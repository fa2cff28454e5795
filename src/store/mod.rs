//! Where the sale's data lives: the Redis stock cache, the MySQL records, and the
//! small pieces of cluster-wide state (active strategy, live replicas) in Redis.
//!
//! Everything here speaks in domain terms (`stock`, `commit_order`); the Redis
//! commands and SQL stay inside this folder.

mod batch_commit;
mod cluster_state;
mod duplicates;
mod group_commit;
mod idempotency;
mod order_commit;
mod records;
mod sale;
mod stock_cache;
mod timeline;

pub use batch_commit::BatchWritten;
pub use cluster_state::{
    ClusterEvent, ClusterSettings, ClusterState, CohortSetting, PauseFault, ReplicaInfo,
};
pub use group_commit::{GroupCommit, MAX_BATCH, PendingOrder, Recorded, TakenOrder};
pub use idempotency::{Claim, ClaimToken, KEY_RETENTION};
pub use order_commit::{Committed, Fence, LockedProduct, Refusal, StockWrite};
pub use records::{ProductRecord, Records};
pub use sale::{SaleChange, SaleSettings, StockAt};
pub use stock_cache::{ReadToSell, StockCache, Taken};
pub use timeline::{Section, Timeline};

use std::sync::Arc;

use deadpool_redis::redis::RedisError;

/// The strategy used when nobody has chosen one (the migrations also store it).
pub const DEFAULT_STRATEGY: &str = "none";

/// The stores one replica uses, with their connection pools.
#[derive(Clone)]
pub struct Store {
    pub cache: StockCache,
    pub records: Records,
    pub cluster: ClusterState,
    pub timeline: Timeline,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
    #[error("redis pool: {0}")]
    RedisPool(#[from] crate::redis_pool::PoolError),
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
    /// One failure of a group commit, shared by every order of the batch it hit.
    #[error(transparent)]
    Shared(Arc<StoreError>),
    /// The group committer failed (a bug: it panicked) with the order in its batch:
    /// whether the order was recorded is unknown.
    #[error("the order's group commit failed; whether it was recorded is unknown")]
    GroupCommitLost,
}

/// How busy a connection pool is, for `/metrics`: connections lent out, idle, and
/// callers waiting for one (a pool that makes callers wait is a bottleneck of its own).
pub struct PoolUse {
    pub pool: &'static str,
    pub in_use: usize,
    pub idle: usize,
    /// None where the pool does not count them (sqlx).
    pub waiting: Option<usize>,
}

impl Store {
    pub fn pool_use(&self) -> [PoolUse; 2] {
        [self.cache.pool_use(), self.records.pool_use()]
    }
}

impl StoreError {
    /// The failure itself, looked at through the sharing of a group commit: a batch's
    /// orders must answer as one order alone with that failure would.
    pub fn cause(&self) -> &StoreError {
        match self {
            StoreError::Shared(error) => error.cause(),
            other => other,
        }
    }

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
            StoreError::Shared(error) => error.unavailable_backend(),
            StoreError::Mysql(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed,
            ) => Some("mysql"),
            // InnoDB rolled the statement back to break a deadlock (an order against
            // an admin change): nothing was written, a retry goes through.
            StoreError::Mysql(error)
                if order_commit::mysql_error_number(error) == Some(order_commit::DEADLOCK) =>
            {
                Some("mysql")
            }
            _ => None,
        }
    }
}
