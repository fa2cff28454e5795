//! `POST /api/orders`: validate the shopper's request, pick the strategy, place it.

use axum::Extension;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use utoipa::ToSchema;

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use super::limits::InFlight;
use crate::model::{NewOrder, Order, Sku, integer_in_range, parse_user_id};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::strategy::{OrderError, OrderOptions, Outcome};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderBody {
    #[schema(value_type = Sku)]
    sku: String,
    /// Who buys: 1-64 characters, none of them a control character.
    #[schema(
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,64}$",
        min_length = 1,
        max_length = 64
    )]
    user_id: String,
    /// Units to buy; the document states this replica's `--max-quantity`.
    #[schema(value_type = i64, minimum = 1, maximum = 10)]
    quantity: serde_json::Number,
}

/// Orders take no query parameters. The former `?strategy=` override let any shopper
/// switch the lock off for their own order; it is refused rather than ignored, so a
/// client that relied on it learns why.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderQuery {}

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

/// Places one order under the cluster's active strategy. Under a lock strategy the
/// replica takes the SKU's lock, checks the stock, writes the order and the new stock
/// to MySQL and Redis, and releases.
///
/// The order runs in a task of its own: once started it completes or rolls back even
/// if the client hangs up or the request times out (a dropped handler only stops
/// waiting for it). Otherwise a hang-up would stop the order wherever it was, e.g.
/// between the COMMIT and the Redis write. Only the wait for a lock ends with the
/// shopper: the order leaves the queue (each lock undoes a dropped acquisition).
#[utoipa::path(post, path = "/api/orders", tag = "orders",
    request_body = OrderBody,
    responses(
        (status = 201, description = "The order, recorded", body = Order),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 409, description = "`sold_out`: not enough stock left; `lock_lost`: the \
            lock was lost or fenced before the commit, nothing was written", body = ErrorBody),
        (status = 422, description = "`invalid_value`: a value is out of range, or the \
            strategy is unknown", body = ErrorBody),
        (status = 503, description = "`lock_timeout`: the lock was not free in time; \
            `too_many_conflicts`: optimistic retries ran out; \
            `sale_changed`: an admin switched or reset the sale meanwhile, nothing written; \
            `unavailable`: Redis lost the SKU's stock until an admin reconciles; \
            `backend_unavailable`, `overloaded`, `timeout`: try again after Retry-After",
            body = ErrorBody),
    ))]
pub async fn place_order(
    State(state): State<AppState>,
    in_flight: Option<Extension<InFlight>>,
    query: Result<Query<OrderQuery>, axum::extract::rejection::QueryRejection>,
    ApiJson(body): ApiJson<OrderBody>,
) -> Result<(StatusCode, ApiJson<Order>), AppError> {
    let Query(OrderQuery {}) = query.map_err(|_| {
        AppError::Malformed(
            "orders take no query parameters; the ?strategy= override was withdrawn: \
             orders run under the active strategy"
                .into(),
        )
    })?;
    let order = body.validate(state.max_quantity)?;
    let (settings, strategy) = state.settings_and_strategy().await?;
    // Dropped with this handler (hang-up, timeout): tells the order its shopper left.
    let client_gone = CancellationToken::new();
    let _leaving = client_gone.clone().drop_guard();
    let options = OrderOptions {
        fencing: settings.fencing,
        cohort: settings.cohort,
        epoch: settings.epoch,
        pause: settings.pause.map(|p| p.at),
        client_gone,
    };
    let flow = state.flow.clone();
    let running = strategy.clone();
    let placed = state
        .orders_in_flight
        .spawn(
            async move {
                // Counted in flight until the order ends, even if its shopper left.
                let _in_flight = in_flight;
                if options.client_gone.is_cancelled() {
                    return Err(OrderError::Abandoned);
                }
                running.place_order(&flow, &order, options).await
            }
            // The task logs under the request's span (its id) like the handler.
            .instrument(tracing::Span::current()),
        )
        .await
        .map_err(|error| {
            tracing::error!(%error, "an order task failed");
            AppError::Internal
        })?;
    let outcome = match &placed {
        Ok(_) => Outcome::Created,
        Err(error) => error.outcome(),
    };
    metrics::counter!("flashsale_orders_total", "strategy" => strategy.name(), "outcome" => outcome.code())
        .increment(1);
    let placed = placed?;
    Ok((StatusCode::CREATED, ApiJson(placed)))
}
