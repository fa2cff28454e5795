//! `POST /api/orders`: validate the shopper's request, pick the strategy, place it.

use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde::Deserialize;

use super::ApiJson;
use crate::app::AppState;
use crate::error::AppError;
use crate::model::{NewOrder, Order, Sku, integer_in_range, parse_user_id};
use crate::strategy::{OrderError, OrderOptions};

#[derive(Debug, Deserialize)]
pub struct OrderBody {
    sku: String,
    user_id: String,
    quantity: serde_json::Number,
}

#[derive(Debug, Deserialize)]
pub struct OrderQuery {
    strategy: Option<String>,
}

impl OrderBody {
    fn validate(self, max_quantity: i64) -> Result<NewOrder, AppError> {
        Ok(NewOrder {
            sku: Sku::parse(&self.sku).map_err(AppError::Invalid)?,
            user_id: parse_user_id(&self.user_id).map_err(AppError::Invalid)?,
            quantity: integer_in_range("quantity", &self.quantity, 1, max_quantity)
                .map_err(AppError::Invalid)?,
        })
    }
}

pub async fn place_order(
    State(state): State<AppState>,
    query: Result<Query<OrderQuery>, axum::extract::rejection::QueryRejection>,
    ApiJson(body): ApiJson<OrderBody>,
) -> Result<(StatusCode, ApiJson<Order>), AppError> {
    let Query(query) = query?;
    let order = body.validate(state.max_quantity)?;
    let (settings, strategy) = state
        .settings_and_strategy(query.strategy.as_deref())
        .await?;
    let options = OrderOptions {
        fencing: settings.fencing,
        pause_armed: settings.pause_holder_ms.is_some(),
    };
    let placed = strategy.place_order(&state.flow, &order, options).await;
    let outcome = match &placed {
        Ok(_) => "created",
        Err(OrderError::SoldOut { .. }) => "sold_out",
        Err(OrderError::Busy(_)) => "busy",
        Err(OrderError::LockLost(_) | OrderError::Fenced { .. }) => "lock_lost",
        Err(OrderError::UnknownSku(_)) => "unknown_sku",
        Err(OrderError::StockUnavailable(_)) => "stock_unavailable",
        Err(OrderError::LockBackend { .. } | OrderError::Store(_)) => "error",
    };
    metrics::counter!("flashsale_orders_total", "strategy" => strategy.name(), "outcome" => outcome)
        .increment(1);
    let placed = placed?;
    Ok((StatusCode::CREATED, ApiJson(placed)))
}
