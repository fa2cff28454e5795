//! What every handler of one replica shares, and the parts a handler can take alone
//! (`State<Store>`, `State<Registry>`, ...) through `FromRef`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::extract::FromRef;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::task::TaskTracker;

use super::Snapshots;
use super::error::AppError;
use crate::config::AdminToken;
use crate::loadtests::LoadTests;
use crate::store::{ClusterSettings, Store};
use crate::strategy::{Registry, SaleFlow, Strategy};

#[derive(Clone, FromRef)]
pub struct AppState {
    pub flow: Arc<SaleFlow>,
    /// The same stores as `flow`'s, for handlers that only read or administer them.
    pub store: Store,
    pub strategies: Registry,
    /// Largest quantity one order may ask for.
    pub max_quantity: i64,
    /// How long an order holds its idempotency key's claim (`store::idempotency`).
    pub idempotency_hold: std::time::Duration,
    /// Requests served by this replica, announced in its heartbeat.
    pub requests: Arc<AtomicU64>,
    /// The dashboard's live snapshot, rebuilt while anyone listens.
    pub snapshots: Arc<Snapshots>,
    pub loadtests: Arc<LoadTests>,
    /// Admin calls need this token when set.
    pub admin_token: Option<AdminToken>,
    pub metrics: PrometheusHandle,
    /// Orders run in tasks of their own (see `orders.rs`); shutdown waits for them.
    pub orders_in_flight: TaskTracker,
    /// When the records were last read for the per-SKU gauges (`metrics.rs`).
    pub stock_audit: Arc<super::metrics::StockAudit>,
}

impl AppState {
    /// The cluster's settings (one Redis round trip) and the active strategy. Orders
    /// always run under it: nobody outside the admin API can choose another.
    pub async fn settings_and_strategy(
        &self,
    ) -> Result<(ClusterSettings, Arc<dyn Strategy>), AppError> {
        let settings = self.store.settings().await?;
        match self.strategies.named(&settings.strategy) {
            Ok(active) => Ok((settings, active)),
            Err(unknown) => {
                tracing::error!(%unknown, "the cluster's active strategy is unknown to this replica");
                Err(AppError::Internal)
            }
        }
    }
}
