//! `POST /api/orders`: validate the shopper's request, pick the strategy, place it;
//! with an `Idempotency-Key`, at most once per key (`store::idempotency`). And the
//! order's lookups: `GET /api/orders/{id}`, `GET /api/orders?idempotency_key=K`.

use std::future::Future;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

use super::ApiJson;
use super::AppState;
use super::error::{AppError, ErrorBody};
use super::limits::InFlight;
use crate::model::{Idempotency, NewOrder, Order, Sku, integer_in_range, parse_user_id};
use crate::store::{Claim, Records};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::strategy::{OrderError, OrderOptions, Outcome, SaleFlow, Strategy};

/// The header of the IETF httpapi draft "The Idempotency-Key HTTP Header Field".
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

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
            idempotency: None,
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
///
/// With an `Idempotency-Key` the task also claims the key before the order and
/// settles the claim after it (`place_keyed`), so a hang-up at any await leaves the
/// claim answered or given back, never held; only a replica that dies leaves it held,
/// until its deadline (`--idempotency-hold-ms`).
#[utoipa::path(post, path = "/api/orders", tag = "orders",
    request_body = OrderBody,
    params(("Idempotency-Key" = Option<String>, Header, pattern = "^[!-~]{1,255}$",
        description = "1-255 visible ASCII characters (no spaces). The order is placed at most \
            once per key, cluster-wide: the same key with the same body answers what \
            the first request answered (201 with the same order, or the same \
            `sold_out`, `limit_reached` or `not_found`), 409 `in_progress` while it \
            runs; with another body 422 `idempotency_key_reused`. Kept 24 hours.")),
    responses(
        (status = 201, description = "The order, recorded (or, for a key already \
            answered, the order it was answered with: `Idempotent-Replayed: true`)",
            body = Order,
            headers(("Location" = String, description = "/api/orders/{id}"))),
        (status = 404, description = "`not_found`: unknown SKU", body = ErrorBody),
        (status = 409, description = "`sold_out`: not enough stock left; `limit_reached`: \
            the shopper has bought the sale's limit per user; `lock_lost`: the \
            lock was lost or fenced before the commit, nothing was written; \
            `in_progress`: a request with this Idempotency-Key is running, ask again \
            after Retry-After", body = ErrorBody),
        (status = 422, description = "`invalid_value`: a value is out of range, or the \
            Idempotency-Key header is not 1-255 visible ASCII characters; \
            `idempotency_key_reused`: the key was sent with another order", body = ErrorBody),
        (status = 503, description = "`lock_timeout`: the lock was not free in time; \
            `too_many_conflicts`: optimistic retries ran out; \
            `sale_changed`: an admin switched or reset the sale meanwhile, nothing written; \
            `unavailable`: Redis lost the SKU's stock until an admin reconciles; \
            `backend_unavailable`, `overloaded`, `timeout`: try again after Retry-After \
            (with the same Idempotency-Key, safely)",
            body = ErrorBody),
    ))]
pub async fn place_order(
    State(state): State<AppState>,
    in_flight: Option<Extension<InFlight>>,
    headers: HeaderMap,
    query: Result<Query<OrderQuery>, axum::extract::rejection::QueryRejection>,
    ApiJson(body): ApiJson<OrderBody>,
) -> Result<Response, AppError> {
    let Query(OrderQuery {}) = query.map_err(|_| {
        AppError::Malformed(
            "orders take no query parameters; the ?strategy= override was withdrawn: \
             orders run under the active strategy"
                .into(),
        )
    })?;
    let mut order = body.validate(state.max_quantity)?;
    if let Some(raw) = headers.get(IDEMPOTENCY_KEY) {
        let key = Idempotency::for_order(raw.as_bytes(), &order).map_err(AppError::Invalid)?;
        order.idempotency = Some(key);
    }
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
    let records = state.store.records.clone();
    let hold = state.idempotency_hold;
    let answer = state
        .orders_in_flight
        .spawn(
            async move {
                // Counted in flight until the order ends, even if its shopper left.
                let _in_flight = in_flight;
                match order.idempotency.clone() {
                    None => run(strategy, flow, order, options)
                        .await
                        .map(Answer::Placed),
                    Some(key) => {
                        let placing = run(strategy, flow, order, options);
                        place_keyed(&records, &key, hold, placing).await
                    }
                }
            }
            // The task logs under the request's span (its id) like the handler.
            .instrument(tracing::Span::current()),
        )
        .await
        .map_err(|error| {
            tracing::error!(%error, "an order task failed");
            AppError::Internal
        })??;
    Ok(answer.into_response())
}

/// One order under `strategy`, counted in the metrics by how it ended (whether or not
/// its shopper is still there).
async fn run(
    strategy: Arc<dyn Strategy>,
    flow: Arc<SaleFlow>,
    order: NewOrder,
    options: OrderOptions,
) -> Result<Order, AppError> {
    let placed = if options.client_gone.is_cancelled() {
        Err(OrderError::Abandoned)
    } else {
        strategy.place_order(&flow, &order, options).await
    };
    let outcome = match &placed {
        Ok(_) => Outcome::Created,
        Err(error) => error.outcome(),
    };
    metrics::counter!("flashsale_orders_total", "strategy" => strategy.name(), "outcome" => outcome.code())
        .increment(1);
    match placed {
        Ok(order) => Ok(order),
        Err(error) => Err(error.into()),
    }
}

/// What an order request is answered with.
pub enum Answer {
    /// The order recorded (by this request, or under its key before).
    Placed(Order),
    /// A key's stored answer, sent again as it was.
    Replayed { status: StatusCode, body: String },
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        match self {
            Answer::Placed(order) => {
                let location = order_location(order.id);
                let mut response = (StatusCode::CREATED, ApiJson(order)).into_response();
                if let Ok(value) = HeaderValue::from_str(&location) {
                    response.headers_mut().insert(header::LOCATION, value);
                }
                response
            }
            Answer::Replayed { status, body } => {
                let location = (status == StatusCode::CREATED)
                    .then(|| serde_json::from_str::<serde_json::Value>(&body).ok())
                    .flatten()
                    .and_then(|order| order["id"].as_u64())
                    .map(order_location);
                let mut response = (status, body).into_response();
                let headers = response.headers_mut();
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
                if let Some(value) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
                    headers.insert(header::LOCATION, value);
                }
                response
            }
        }
    }
}

fn order_location(id: u64) -> String {
    format!("/api/orders/{id}")
}

/// An order with an idempotency key: claimed first, then placed (`placing`) only if
/// this request holds the key, then the claim settled: the definitive answer stored
/// (201, `sold_out`, `limit_reached`, `not_found`), a transient one given back.
///
/// Every await here runs in the order's task, which outlives its shopper: a hang-up
/// or timeout anywhere leaves the claim settled by the task. A crash leaves it held
/// until `hold` has passed; the next request with the key then finds the order, if it
/// committed, or runs it.
async fn place_keyed(
    records: &Records,
    key: &Idempotency,
    hold: std::time::Duration,
    placing: impl Future<Output = Result<Order, AppError>>,
) -> Result<Answer, AppError> {
    let token = match records.claim_key(key, hold).await? {
        Claim::Mine(token) => token,
        Claim::Answered { status, body } => {
            metrics::counter!("flashsale_idempotent_replays_total").increment(1);
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::CREATED);
            return Ok(Answer::Replayed { status, body });
        }
        Claim::InProgress => return Err(AppError::InProgress),
        Claim::OtherRequest => return Err(AppError::KeyReused),
    };
    let answer = match placing.await {
        Ok(order) => Ok(Answer::Placed(order)),
        // MySQL holds an order with the key: a holder presumed dead committed after
        // all, or the claim had been purged. That order is the answer.
        Err(AppError::Order(OrderError::DuplicateKey)) => {
            match records.order_by_key(&key.key).await? {
                Some((order, fingerprint)) if fingerprint == key.fingerprint => {
                    Ok(Answer::Placed(order))
                }
                Some(_) => Err(AppError::KeyReused),
                // Deleted since (a reset of its SKU): nothing to answer with yet.
                None => Err(AppError::InProgress),
            }
        }
        Err(error) => Err(error),
    };
    let settled = match stored_answer(&answer) {
        Some((status, body)) => records.answer_key(&key.key, token, status, &body).await,
        None => records.release_key(&key.key, token).await,
    };
    if let Err(error) = settled {
        // The claim stays until its deadline; the order row stays the truth.
        tracing::warn!(%error, key = %key.key, "an idempotency key's claim could not be settled");
    }
    answer
}

/// The answer to keep for a key: the order, or a refusal a retry would get again.
fn stored_answer(answer: &Result<Answer, AppError>) -> Option<(u16, String)> {
    match answer {
        Ok(Answer::Placed(order)) => serde_json::to_string(order).ok().map(|body| (201, body)),
        Err(error @ AppError::Order(order_error))
            if matches!(
                order_error.outcome(),
                Outcome::SoldOut | Outcome::LimitReached | Outcome::NotFound
            ) =>
        {
            let (status, body) = error.status_and_body();
            serde_json::to_string(&body)
                .ok()
                .map(|body| (status.as_u16(), body))
        }
        _ => None,
    }
}

/// `GET /api/orders?idempotency_key=K`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OrderLookup {
    /// The Idempotency-Key the order was placed with.
    #[param(pattern = "^[!-~]{1,255}$")]
    idempotency_key: String,
}

/// The order recorded with an idempotency key: what a shopper whose answer was lost
/// (a 503 `timeout`, a hang-up) checks before buying again.
#[utoipa::path(get, path = "/api/orders", tag = "orders",
    params(OrderLookup),
    responses(
        (status = 200, description = "The order placed with the key", body = Order),
        (status = 404, description = "`not_found`: no order has this key (none was \
            recorded, or it is still running)", body = ErrorBody),
        (status = 422, description = "`invalid_value`: not an idempotency key (1-255 \
            visible ASCII characters)", body = ErrorBody),
    ))]
pub async fn order_by_key(
    State(state): State<AppState>,
    query: Result<Query<OrderLookup>, axum::extract::rejection::QueryRejection>,
) -> Result<ApiJson<Order>, AppError> {
    let Query(lookup) = query?;
    let key = crate::model::idempotency_key(lookup.idempotency_key.as_bytes())
        .map_err(|rule| AppError::Invalid(format!("idempotency_key {rule}")))?;
    let found = state.store.records.order_by_key(&key).await?;
    found
        .map(|(order, _)| ApiJson(order))
        .ok_or_else(|| AppError::NotFound("no order was recorded with this idempotency key".into()))
}

/// One order, by the id its 201 gave (its `Location`).
#[utoipa::path(get, path = "/api/orders/{id}", tag = "orders",
    params(("id" = i64, Path, minimum = 0, description = "The order's id")),
    responses(
        (status = 200, description = "The order", body = Order),
        (status = 404, description = "`not_found`: no such order", body = ErrorBody),
        (status = 422, description = "`invalid_value`: the id is not a whole number",
            body = ErrorBody),
    ))]
pub async fn order(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<ApiJson<Order>, AppError> {
    let id: u64 = id.parse().map_err(|_| {
        AppError::Invalid(format!("an order id is a whole number from 0, not '{id}'"))
    })?;
    let found = state.store.records.order(id).await?;
    found
        .map(ApiJson)
        .ok_or_else(|| AppError::NotFound(format!("no order {id}")))
}
