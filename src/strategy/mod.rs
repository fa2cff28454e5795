//! The coordination strategies, one module each, behind one trait.
//!
//! A strategy decides how replicas coordinate around the shared order flow in
//! `flow.rs`. A lock strategy is data: a lock primitive (`crate::lock`) and its
//! explanation, served by the one `LockStrategy`; adding one means a module with its
//! `explanation()` and one entry in `registry()`. Strategies with flows of their own
//! (`none`, `optimistic`, `db-for-update`, `redis-atomic`) implement `Strategy`. The
//! HTTP layer, the stats and the dashboard pick them up from the registry.

mod combine;
mod cost;
mod db_for_update;
mod db_unique;
#[cfg(test)]
mod docs_honest;
mod etcd;
mod flow;
mod locked;
mod none;
mod optimistic;
mod redis_atomic;
mod redis_lock;
mod redlock;
mod registry;
mod zookeeper;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

pub use crate::lock::LockView;
pub use cost::{Cost, RoundTrips, cost};
pub use flow::{SaleFlow, ensure_in_stock};
pub use locked::LockStrategy;
pub use registry::{Registry, UnknownStrategy};

use crate::lock::LockError;
use crate::lock::cohort::Cohort;
use crate::lock::etcd::EtcdLock;
use crate::lock::fence_floor::{FenceFloor, MySqlFenceFloor};
use crate::lock::redis::RedisLock;
use crate::lock::redlock::Redlock;
use crate::lock::table::TableLock;
use crate::lock::zookeeper::ZooKeeperLock;
use crate::model::{NewOrder, Order, PausePoint, Sku};
use crate::store::StoreError;

pub use crate::store::DEFAULT_STRATEGY;

#[async_trait]
pub trait Strategy: Send + Sync {
    /// The name from `docs/order-flow.md`, used verbatim in the API, reports and dashboard.
    fn name(&self) -> &'static str;

    /// How the mechanism works, for `/api/strategies` and the dashboard.
    fn explanation(&self) -> Explanation;

    /// Places one order under this strategy's coordination.
    async fn place_order(
        &self,
        flow: &SaleFlow,
        order: &NewOrder,
        options: OrderOptions,
    ) -> Result<Order, OrderError>;

    /// What this strategy's coordination for `sku` looks like right now.
    async fn inspect(&self, _flow: &SaleFlow, _sku: &Sku) -> Result<LockView, OrderError> {
        Ok(LockView::default())
    }
}

/// Cluster-wide switches that apply to one order, read with the active strategy, and
/// the order's link to its shopper.
#[derive(Debug, Clone, Default)]
pub struct OrderOptions {
    /// Lock holders register their token and their write must still carry the fence.
    pub fencing: bool,
    /// Lock holders go through the cohort layer (`lock::cohort`): a replica's requests
    /// queue locally and a holder hands the lock to the next.
    pub cohort: bool,
    /// With the cohort layer on: how many orders for its SKU queued in the replica a
    /// lock holder sells in its one critical section (`combine`; 1: none).
    pub combine: u16,
    /// The sale epoch the order started under; its commit requires it unchanged.
    pub epoch: u64,
    /// Where an armed paused-holder fault stalls the next holder to claim it.
    pub pause: Option<PausePoint>,
    /// Cancelled when the shopper's request ends early (hang-up, timeout). An order
    /// that gets its lock after that gives it back without selling: nobody is there
    /// to receive the answer. Once the critical section has begun it runs to its end.
    pub client_gone: CancellationToken,
}

/// A strategy described for people: the idea, what this lab adds to it, the exact
/// commands, how it fails. `docs_honest` checks that every command named is one the
/// strategy's code sends.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Explanation {
    #[schema(value_type = crate::model::StrategyName)]
    pub name: &'static str,
    pub title: &'static str,
    pub family: Family,
    /// The idea, in two or three lines.
    pub summary: &'static str,
    /// What this lab adds to the textbook recipe.
    pub adds: &'static str,
    pub commands: Vec<&'static str>,
    pub failure_mode: &'static str,
}

/// Where a strategy's coordination lives: the dashboard groups its cards by this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// No coordination at all: the baseline that oversells.
    None,
    /// The database's own concurrency control (a version, a row lock, a unique key).
    Database,
    /// A lock held in a lock service (Redis, ZooKeeper, etcd).
    LockService,
    /// No lock: one atomic step decides who gets a unit.
    LockFree,
}

/// Why an order was not placed, in domain terms (the HTTP layer maps these).
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("unknown SKU {0}")]
    UnknownSku(String),
    /// MySQL knows the SKU but Redis lost its stock: reconcile before selling on.
    #[error("no stock in Redis for {0}")]
    StockUnavailable(String),
    #[error("sold out")]
    SoldOut { available: i64, requested: i64 },
    /// The user would pass the sale's limit per user; nothing was written.
    #[error("the limit per user is reached")]
    LimitReached,
    /// MySQL holds an order with the order's idempotency key already, or the key's
    /// claim was taken over from this order (it outlived its hold); nothing was
    /// written (the HTTP layer answers with what the key has).
    #[error("an order with this idempotency key is recorded already")]
    DuplicateKey,
    /// The strategy could not get exclusive access in time (lock wait, or optimistic
    /// retries exhausted): worth retrying later.
    #[error("{0}")]
    Busy(String),
    /// The lock was lost before the order was committed; nothing was written.
    #[error("{0}")]
    LockLost(String),
    /// MySQL refused the write: a holder with a newer fencing token began since.
    #[error("fencing token {token} was overtaken by a newer lock holder")]
    Fenced { token: u64 },
    /// MySQL refused the write: the stock it was computed from is no longer MySQL's.
    #[error("the stock read is no longer MySQL's")]
    StaleRead,
    /// An admin changed the sale (strategy, fencing or cohort switch, reset, reconcile,
    /// fence reset) while the order was under way; nothing was written, and a retry
    /// runs under the new settings.
    #[error("the sale changed while the order was under way")]
    SaleChanged,
    /// optimistic: every attempt conflicted with another writer.
    #[error("{0}")]
    GaveUp(String),
    /// The shopper's request ended before the order was placed; nothing was written
    /// (a lock wait left, or optimistic's retries stopped).
    #[error("the shopper left before the order was placed; nothing was written")]
    Abandoned,
    #[error("{backend}: {detail}")]
    LockBackend {
        backend: &'static str,
        detail: String,
    },
    #[error(transparent)]
    Store(StoreError),
}

/// How an order ended, named once: the API answers these codes, the metrics count
/// orders by them, and the dashboard's timeline colours sections by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Created,
    SoldOut,
    /// The user would pass the sale's limit per user.
    LimitReached,
    /// An order with the same idempotency key is recorded; nothing was written (the
    /// shopper is answered with that order).
    Duplicate,
    /// The lock was not free in time.
    LockTimeout,
    /// optimistic: every attempt conflicted.
    TooManyConflicts,
    /// The lock was lost, or MySQL fenced the write off: nothing was written.
    LockLost,
    /// An admin changed the sale meanwhile: nothing was written, retry.
    SaleChanged,
    NotFound,
    /// Redis lost the SKU's stock; an admin must reconcile.
    Unavailable,
    BackendUnavailable,
    /// The shopper was gone before the order was placed (nobody receives this answer).
    Abandoned,
    Internal,
}

impl Outcome {
    pub fn code(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::SoldOut => "sold_out",
            Outcome::LimitReached => "limit_reached",
            Outcome::Duplicate => "duplicate",
            Outcome::LockTimeout => "lock_timeout",
            Outcome::TooManyConflicts => "too_many_conflicts",
            Outcome::LockLost => "lock_lost",
            Outcome::SaleChanged => "sale_changed",
            Outcome::NotFound => "not_found",
            Outcome::Unavailable => "unavailable",
            Outcome::BackendUnavailable => "backend_unavailable",
            Outcome::Abandoned => "abandoned",
            Outcome::Internal => "internal",
        }
    }
}

impl OrderError {
    pub fn outcome(&self) -> Outcome {
        match self {
            OrderError::UnknownSku(_) => Outcome::NotFound,
            OrderError::StockUnavailable(_) => Outcome::Unavailable,
            OrderError::SoldOut { .. } => Outcome::SoldOut,
            OrderError::LimitReached => Outcome::LimitReached,
            OrderError::DuplicateKey => Outcome::Duplicate,
            OrderError::Busy(_) => Outcome::LockTimeout,
            OrderError::GaveUp(_) => Outcome::TooManyConflicts,
            OrderError::LockLost(_) | OrderError::Fenced { .. } | OrderError::StaleRead => {
                Outcome::LockLost
            }
            OrderError::SaleChanged => Outcome::SaleChanged,
            OrderError::Abandoned => Outcome::Abandoned,
            OrderError::LockBackend { .. } => Outcome::BackendUnavailable,
            OrderError::Store(error) => match error.unavailable_backend() {
                Some(_) => Outcome::BackendUnavailable,
                None => Outcome::Internal,
            },
        }
    }
}

impl From<StoreError> for OrderError {
    fn from(error: StoreError) -> Self {
        match error.cause() {
            StoreError::RowLockTimeout => {
                OrderError::Busy("the row lock was not granted in time; try again".into())
            }
            _ => OrderError::Store(error),
        }
    }
}

impl From<LockError> for OrderError {
    fn from(error: LockError) -> Self {
        match error {
            LockError::Timeout { waited } => OrderError::Busy(format!(
                "the lock was not free within {waited:?}; try again"
            )),
            LockError::Lost(detail) => OrderError::LockLost(detail),
            LockError::Backend { backend, detail } => OrderError::LockBackend { backend, detail },
        }
    }
}

/// What one replica's strategies are built from: its own clients and pools (never
/// opened per request) and the lock settings.
pub struct Backends {
    pub redis_client: crate::redis_pool::Source,
    pub redis_pool: crate::redis_pool::Pool,
    pub mysql: sqlx::MySqlPool,
    pub namespace: String,
    pub replica_id: String,
    /// Lease of the lease locks (Redis, lock table); renewed every third of it.
    pub lease: Duration,
    pub zookeeper: String,
    pub zookeeper_session_timeout: Duration,
    /// One pool per independent Redis node of the Redlock strategy.
    pub redlock_nodes: Vec<crate::redis_pool::Pool>,
    /// etcd endpoints, comma-separated.
    pub etcd: String,
    pub optimistic_attempts: u32,
    /// redis-lock's `WAIT`: replicas that must acknowledge the lock's `SET` (0: none),
    /// and for how long.
    pub redis_lock_wait: (u32, Duration),
}

/// Where a Redis-backed fencing counter that Redis lost restarts: above the largest
/// token this strategy ever registered in MySQL for the lock's SKU.
fn fence_floor(backends: &Backends, strategy: &'static str) -> Arc<dyn FenceFloor> {
    Arc::new(MySqlFenceFloor::new(backends.mysql.clone(), strategy))
}

/// Every strategy this build knows, in the order the report and dashboard show them.
pub fn registry(backends: &Backends) -> Registry {
    let owner = &backends.replica_id;
    Registry::new(vec![
        Arc::new(none::NoCoordination),
        Arc::new(LockStrategy::new(
            redis_lock::explanation(),
            Cohort::new(
                RedisLock::new(
                    backends.redis_client.clone(),
                    backends.redis_pool.clone(),
                    &backends.namespace,
                    owner,
                    backends.lease,
                )
                .with_fence_floor(fence_floor(backends, "redis-lock"))
                .with_wait_replicas(backends.redis_lock_wait.0, backends.redis_lock_wait.1),
            ),
        )),
        Arc::new(LockStrategy::new(
            db_unique::explanation(),
            Cohort::new(TableLock::new(
                backends.mysql.clone(),
                owner,
                backends.lease,
            ))
            .with_notices(
                backends.redis_client.clone(),
                backends.redis_pool.clone(),
                &backends.namespace,
            ),
        )),
        Arc::new(optimistic::OptimisticStrategy::new(
            backends.optimistic_attempts,
        )),
        Arc::new(LockStrategy::new(
            zookeeper::explanation(),
            Cohort::new(ZooKeeperLock::new(
                &backends.zookeeper,
                backends.zookeeper_session_timeout,
                &backends.namespace,
                owner,
            )),
        )),
        Arc::new(db_for_update::DbForUpdateStrategy::default()),
        Arc::new(LockStrategy::new(
            etcd::explanation(),
            Cohort::new(EtcdLock::new(
                &backends.etcd,
                &backends.namespace,
                backends.lease,
            )),
        )),
        Arc::new(LockStrategy::new(
            redlock::explanation(),
            Cohort::new(
                Redlock::new(
                    backends.redlock_nodes.clone(),
                    &backends.namespace,
                    owner,
                    backends.lease,
                )
                .with_fence_floor(fence_floor(backends, "redlock")),
            )
            .with_notices(
                backends.redis_client.clone(),
                backends.redis_pool.clone(),
                &backends.namespace,
            ),
        )),
        Arc::new(redis_atomic::RedisAtomicStrategy::default()),
    ])
}
