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
use crate::store::{Claim, ClaimToken, Records};
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
    // Two keys would name two requests, or none: refused rather than one picked.
    if headers.get_all(IDEMPOTENCY_KEY).iter().nth(1).is_some() {
        return Err(AppError::Malformed(
            "send at most one Idempotency-Key header".into(),
        ));
    }
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
        combine: settings.combine,
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
                        let placing = |order| run(strategy, flow, order, options);
                        place_keyed(&records, &key, hold, order, placing).await
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
    let started = std::time::Instant::now();
    let placed = if options.client_gone.is_cancelled() {
        Err(OrderError::Abandoned)
    } else {
        strategy.place_order(&flow, &order, options).await
    };
    let outcome = match &placed {
        Ok(_) => Outcome::Created,
        Err(error) => error.outcome(),
    };
    let (name, code) = (strategy.name(), outcome.code());
    metrics::counter!("flashsale_orders_total", "strategy" => name, "outcome" => code).increment(1);
    metrics::histogram!("flashsale_order_seconds", "strategy" => name, "outcome" => code)
        .record(started.elapsed().as_secs_f64());
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

/// An order with an idempotency key: claimed first, then placed (`placing`, with the
/// claim's token in the order) only if this request holds the key, then the claim
/// settled. A 201's answer is stored by the order's own transaction, which commits
/// only while this request still holds the claim (`store::idempotency`). A refusal a
/// retry would get again (`sold_out`, `limit_reached`, `not_found`) is stored after
/// checking MySQL (`definitive`); anything else gives the claim back, so a retry
/// tries again.
///
/// Every await here runs in the order's task, which outlives its shopper: a hang-up
/// or timeout anywhere leaves the claim settled by the task, and an error or a panic
/// gives it back (`HeldClaim`). A crash leaves it held until `hold` has passed; the
/// next request with the key then finds the order, if it committed, or runs it.
async fn place_keyed<F, Fut>(
    records: &Records,
    key: &Idempotency,
    hold: std::time::Duration,
    mut order: NewOrder,
    placing: F,
) -> Result<Answer, AppError>
where
    F: FnOnce(NewOrder) -> Fut,
    Fut: Future<Output = Result<Order, AppError>>,
{
    // Armed before the claim: a claim that landed while its statement failed (the
    // answer lost) is given back too; fenced by the token, the give-back is harmless
    // when nothing landed.
    let token = ClaimToken::draw();
    let held = HeldClaim {
        records: records.clone(),
        key: key.key.clone(),
        token: Some(token),
    };
    match records.claim_key(key, token, hold).await? {
        Claim::Mine(_) => {}
        claim => {
            held.disarm();
            return answer_from(claim);
        }
    }
    order.idempotency = Some(Idempotency {
        claim: Some(token.value()),
        ..key.clone()
    });
    let sku = order.sku.clone();
    let placed = placing(order).await;
    let settled = settle(records, key, &sku, token, placed).await;
    match settled {
        // Settled (stored, or given back by `settle`): nothing left to give back.
        Ok(_) => held.disarm(),
        // A store error on the way: the guard gives the claim back.
        Err(_) => drop(held),
    }
    settled
}

/// A claim answered by someone else, as this request's answer.
fn answer_from(claim: Claim) -> Result<Answer, AppError> {
    match claim {
        Claim::Answered { status, body } => {
            metrics::counter!("flashsale_idempotent_replays_total").increment(1);
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::CREATED);
            Ok(Answer::Replayed { status, body })
        }
        Claim::OtherRequest => Err(AppError::KeyReused),
        Claim::InProgress | Claim::Mine(_) => Err(AppError::InProgress),
    }
}

/// Settles the claim `token` holds after its order was `placed`: the answer the
/// request gets. An `Err` is a store error, with the claim not settled.
async fn settle(
    records: &Records,
    key: &Idempotency,
    sku: &Sku,
    token: ClaimToken,
    placed: Result<Order, AppError>,
) -> Result<Answer, AppError> {
    let refusal = match placed {
        // Stored by the order's transaction.
        Ok(order) => return Ok(Answer::Placed(order)),
        Err(error) => error,
    };
    // The order row is the truth: a key with an order is answered with it, whatever
    // this attempt ran into (a retry after an unknown COMMIT or after the purge may be
    // refused before MySQL's unique key is reached). Read for refusals only: a
    // transient answer is not stored, and the next attempt reads it anyway.
    let definitive = stored_refusal(&refusal);
    if (matches!(refusal, AppError::Order(OrderError::DuplicateKey)) || definitive.is_some())
        && let Some((order, fingerprint)) = records.order_by_key(&key.key).await?
    {
        if fingerprint != key.fingerprint {
            records.release_key(&key.key, token).await?;
            return Err(AppError::KeyReused);
        }
        let body = serde_json::to_string(&order).map_err(|error| {
            tracing::error!(%error, "an order could not be written as JSON");
            AppError::Internal
        })?;
        // Not recorded (a reset deleted the claim with the order meanwhile, or another
        // request settled it): what the key has now, never an order that is gone.
        if !records.answer_key(&key.key, token, 201, &body).await? {
            return answer_from(records.key_now(key).await?);
        }
        return Ok(Answer::Placed(order));
    }
    if let AppError::Order(OrderError::DuplicateKey) = refusal {
        // No order has the key: the claim was taken over from this request, which
        // outlived its hold; the key is the new holder's.
        return answer_from(records.key_now(key).await?);
    }
    let stored = match definitive {
        Some((status, body)) if definitive_in_mysql(records, sku, &refusal).await? => {
            records.answer_key(&key.key, token, status, &body).await?
        }
        _ => {
            records.release_key(&key.key, token).await?;
            return Err(refusal);
        }
    };
    if stored {
        Err(refusal)
    } else {
        // Taken over meanwhile: the key's answer is the new holder's.
        answer_from(records.key_now(key).await?)
    }
}

/// Whether MySQL agrees with a definitive refusal. `sold_out` may come from Redis
/// alone: under redis-atomic, units taken by orders still in flight are missing from
/// Redis, and a MySQL failure gives them back; stored, the refusal would be replayed
/// for 24 hours while the units come back. MySQL's stock counts only orders committed
/// (they never come back within the sale): below the quantity, sold out is the truth.
async fn definitive_in_mysql(
    records: &Records,
    sku: &Sku,
    refusal: &AppError,
) -> Result<bool, AppError> {
    let AppError::Order(OrderError::SoldOut { requested, .. }) = refusal else {
        return Ok(true);
    };
    let stock = records.stock_and_version(sku).await?;
    Ok(stock.is_none_or(|(stock, _)| stock < *requested))
}

/// Gives a claim back when dropped armed: a store error or a panic between the claim
/// and its settlement must not leave the key in progress until its hold runs out.
struct HeldClaim {
    records: Records,
    key: String,
    token: Option<ClaimToken>,
}

impl HeldClaim {
    fn disarm(mut self) {
        self.token = None;
    }
}

impl Drop for HeldClaim {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        let (records, key) = (self.records.clone(), std::mem::take(&mut self.key));
        // Fenced by the token: a claim settled or taken over meanwhile is left alone.
        tokio::spawn(async move {
            if let Err(error) = records.release_key(&key, token).await {
                tracing::warn!(%error, key, "an idempotency key's claim could not be given back");
            }
        });
    }
}

/// The answer to keep for a key's refusal: one a retry would get again.
fn stored_refusal(error: &AppError) -> Option<(u16, String)> {
    match error {
        AppError::Order(order_error)
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
