//! Admin calls shared by all replicas: the active strategy and stock resets.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiJson, StrategyName};
use crate::app::AppState;
use crate::error::{AppError, ErrorBody};
use crate::model::{Sku, integer_in_range};

/// Largest stock a reset may set.
pub const MAX_STOCK: i64 = 10_000_000;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct StrategyBody {
    #[schema(value_type = StrategyName)]
    strategy: String,
}

/// The strategy every replica uses for orders that do not name one.
#[utoipa::path(get, path = "/api/admin/strategy", tag = "admin",
    responses((status = 200, description = "The active strategy", body = StrategyBody)))]
pub async fn active_strategy(
    State(state): State<AppState>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let (_, strategy) = state.settings_and_strategy(None).await?;
    Ok(ApiJson(StrategyBody {
        strategy: strategy.name().to_owned(),
    }))
}

/// Switches every replica to a strategy; orders already under way finish under theirs.
#[utoipa::path(put, path = "/api/admin/strategy", tag = "admin",
    request_body = StrategyBody,
    responses(
        (status = 200, description = "The strategy now active", body = StrategyBody),
        (status = 422, description = "`invalid_value`: unknown strategy", body = ErrorBody),
    ))]
pub async fn set_strategy(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<StrategyBody>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let strategy = state.named_strategy(&body.strategy)?;
    state
        .flow
        .store
        .set_active_strategy(strategy.name())
        .await?;
    tracing::info!(strategy = strategy.name(), "active strategy switched");
    Ok(ApiJson(body))
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct ResetBody {
    #[schema(value_type = Sku)]
    sku: String,
    #[schema(value_type = i64, minimum = 0, maximum = 10_000_000)]
    stock: serde_json::Number,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResetDone {
    sku: Sku,
    stock: i64,
}

/// Restocks a SKU in MySQL (clearing its orders) and then in Redis. MySQL goes first:
/// if Redis then fails, the stats show the mismatch and a retried reset repairs it.
#[utoipa::path(post, path = "/api/admin/reset", tag = "admin",
    request_body = ResetBody,
    responses(
        (status = 200, description = "The SKU's new stock; its orders are gone", body = ResetDone),
        (status = 422, description = "`invalid_value`: bad SKU or stock", body = ErrorBody),
    ))]
pub async fn reset(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<ResetBody>,
) -> Result<ApiJson<ResetDone>, AppError> {
    let sku = Sku::parse(&body.sku).map_err(AppError::Invalid)?;
    let stock = integer_in_range("stock", &body.stock, 0, MAX_STOCK).map_err(AppError::Invalid)?;
    let store = &state.flow.store;
    store.records.reset(&sku, stock).await?;
    store.cache.reset(&sku, stock).await?;
    tracing::info!(%sku, stock, "stock reset");
    Ok(ApiJson(ResetDone { sku, stock }))
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct FencingBody {
    enabled: bool,
}

/// Whether MySQL refuses writes of lock holders whose fencing token is stale.
#[utoipa::path(get, path = "/api/admin/fencing", tag = "admin",
    responses((status = 200, description = "The fencing switch", body = FencingBody)))]
pub async fn fencing(State(state): State<AppState>) -> Result<ApiJson<FencingBody>, AppError> {
    let (settings, _) = state.settings_and_strategy(None).await?;
    Ok(ApiJson(FencingBody {
        enabled: settings.fencing,
    }))
}

/// Fencing is cluster-wide: every replica reads the switch with each order.
#[utoipa::path(put, path = "/api/admin/fencing", tag = "admin",
    request_body = FencingBody,
    responses((status = 200, description = "The fencing switch as now set", body = FencingBody)))]
pub async fn set_fencing(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FencingBody>,
) -> Result<ApiJson<FencingBody>, AppError> {
    state.flow.store.set_fencing(body.enabled).await?;
    tracing::info!(enabled = body.enabled, "fencing switched");
    Ok(ApiJson(body))
}

/// Longest pause the fault may ask for.
pub const MAX_PAUSE_MS: i64 = 120_000;

#[derive(Debug, Deserialize, ToSchema)]
pub struct FaultBody {
    /// Milliseconds the next lock holder stalls; by default 1.5 leases plus 0.5 s, so
    /// the lease surely runs out.
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 120_000)]
    pause_holder_ms: Option<serde_json::Number>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FaultArmed {
    pause_holder_ms: u64,
}

/// Arms the paused-holder fault for the next lock holder in the cluster.
#[utoipa::path(post, path = "/api/admin/faults", tag = "admin",
    request_body = FaultBody,
    responses(
        (status = 200, description = "The fault is armed", body = FaultArmed),
        (status = 422, description = "`invalid_value`: pause out of range", body = ErrorBody),
    ))]
pub async fn arm_fault(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FaultBody>,
) -> Result<ApiJson<FaultArmed>, AppError> {
    let ms =
        match &body.pause_holder_ms {
            Some(ms) => integer_in_range("pause_holder_ms", ms, 1, MAX_PAUSE_MS)
                .map_err(AppError::Invalid)?,
            None => i64::try_from(state.flow.lock_lease.as_millis() * 3 / 2 + 500)
                .unwrap_or(MAX_PAUSE_MS),
        };
    let ms = u64::try_from(ms).unwrap_or(0);
    state.flow.store.cluster.arm_pause(ms).await?;
    tracing::warn!(ms, "fault armed: the next lock holder will pause");
    Ok(ApiJson(FaultArmed {
        pause_holder_ms: ms,
    }))
}

/// Withdraws an armed fault that no lock holder claimed.
#[utoipa::path(delete, path = "/api/admin/faults", tag = "admin",
    responses((status = 204, description = "No fault is armed any more")))]
pub async fn disarm_fault(State(state): State<AppState>) -> Result<StatusCode, AppError> {
    state.flow.store.cluster.disarm_pause().await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Reconciled {
    /// SKUs whose Redis stock was missing and was rebuilt from MySQL.
    skus: Vec<ResetDone>,
}

/// Rebuilds the Redis stock of every SKU Redis has lost (after a restart without
/// persistence) from MySQL's products rows, the system of record. A stock Redis
/// still has is left alone: sales may be writing it right now, and overwriting it
/// with a value read from MySQL a moment earlier would undo one of them. To repair a
/// stale cache, reset the SKU. Orders are not touched.
#[utoipa::path(post, path = "/api/admin/reconcile", tag = "admin",
    responses((status = 200, description = "The SKUs rebuilt", body = Reconciled)))]
pub async fn reconcile(State(state): State<AppState>) -> Result<ApiJson<Reconciled>, AppError> {
    let store = &state.flow.store;
    let mut skus = Vec::new();
    for product in store.records.products(None).await? {
        if store.cache.restore(&product.sku, product.stock).await? {
            skus.push(ResetDone {
                sku: product.sku,
                stock: product.stock,
            });
        }
    }
    tracing::warn!(skus = skus.len(), "Redis stock rebuilt from MySQL");
    Ok(ApiJson(Reconciled { skus }))
}
