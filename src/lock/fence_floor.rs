//! Where a Redis-backed fencing counter restarts after Redis lost it.
//!
//! The Redis lock and Redlock count their fencing tokens in Redis. A Redis restart
//! without persistence loses the counter, and a counter that restarts at 1 hands out
//! tokens below those already written: with fencing on, every order would be refused
//! until the counter caught up. The storage that checks the fence knows the largest
//! token it has seen, so a counter found missing restarts above that.
//!
//! A lock primitive knows nothing about products: it asks a [`FenceFloor`] for the
//! floor of a lock name, and whoever builds the lock supplies one. [`MySqlFenceFloor`]
//! reads the fence the order flow keeps per SKU and lock service in MySQL.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::MySqlPool;
use tokio::time::Instant;

use super::LockError;
use super::local_queue::acquisition_of;

/// Bound on asking for a floor: the lock is held meanwhile.
pub const FLOOR_TIMEOUT: Duration = Duration::from_secs(2);

/// `floor`'s answer for `name`, bounded by `FLOOR_TIMEOUT` and by `deadline`, the end of
/// the caller's wait for the lock (a floor stalled in MySQL stretched a 200 ms wait to
/// 1.5 s, and the lock was then granted).
pub async fn bounded_floor(
    floor: &dyn FenceFloor,
    name: &str,
    deadline: Instant,
) -> Result<u64, LockError> {
    let bound = deadline.min(Instant::now() + FLOOR_TIMEOUT);
    tokio::time::timeout_at(bound, floor.floor(name))
        .await
        .map_err(|_| LockError::backend("fence floor", "no answer in time"))?
}

/// The largest fencing token already used for a lock name, wherever it is recorded.
#[async_trait]
pub trait FenceFloor: Send + Sync {
    async fn floor(&self, name: &str) -> Result<u64, LockError>;
}

/// The fence MySQL holds for a lock named after a SKU (`product_fences`), for one
/// lock service (the strategy's name, as the order flow records it).
pub struct MySqlFenceFloor {
    pool: MySqlPool,
    lock_service: &'static str,
}

impl MySqlFenceFloor {
    pub fn new(pool: MySqlPool, lock_service: &'static str) -> MySqlFenceFloor {
        MySqlFenceFloor { pool, lock_service }
    }
}

#[async_trait]
impl FenceFloor for MySqlFenceFloor {
    async fn floor(&self, name: &str) -> Result<u64, LockError> {
        let fence: Option<u64> = sqlx::query_scalar(
            "SELECT fence FROM product_fences WHERE sku = ? AND lock_service = ?",
        )
        .bind(name)
        .bind(self.lock_service)
        .fetch_optional(&self.pool)
        .await
        .map_err(|error| LockError::backend("mysql", error))?;
        // The fence is a hold's token: the counter's value with the hold's place in its
        // run (`cohort`).
        Ok(fence.map_or(0, acquisition_of))
    }
}
