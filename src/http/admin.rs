//! Admin calls shared by all replicas: the active strategy and stock resets.

use axum::extract::State;
use serde::{Deserialize, Serialize};

use super::ApiJson;
use crate::app::AppState;
use crate::error::AppError;
use crate::model::{Sku, integer_in_range};

/// Largest stock a reset may set.
pub const MAX_STOCK: i64 = 10_000_000;

#[derive(Debug, Deserialize, Serialize)]
pub struct StrategyBody {
    strategy: String,
}

pub async fn active_strategy(
    State(state): State<AppState>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let strategy = state.strategy(None).await?;
    Ok(ApiJson(StrategyBody {
        strategy: strategy.name().to_owned(),
    }))
}

pub async fn set_strategy(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<StrategyBody>,
) -> Result<ApiJson<StrategyBody>, AppError> {
    let strategy = state.strategy(Some(&body.strategy)).await?;
    state
        .flow
        .store
        .cluster
        .set_active_strategy(strategy.name())
        .await?;
    tracing::info!(strategy = strategy.name(), "active strategy switched");
    Ok(ApiJson(body))
}

#[derive(Debug, Deserialize)]
pub struct ResetBody {
    sku: String,
    stock: serde_json::Number,
}

#[derive(Debug, Serialize)]
pub struct ResetDone {
    sku: Sku,
    stock: i64,
}

/// Restocks a SKU in MySQL (clearing its orders) and then in Redis. MySQL goes first:
/// if Redis then fails, the stats show the mismatch and a retried reset repairs it.
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
