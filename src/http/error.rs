//! The one error type every handler returns.
//!
//! Each variant knows its HTTP status and its stable `error` code, so a client gets
//! `{"error": "<code>", "message": "<sentence>"}` and never a bare 500 for bad input.
//! Backend failures are logged with their detail here and answered with a generic
//! sentence, so internals (SQL, URLs) never leak into responses.

use axum::Json;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::store::StoreError;
use crate::strategy::{OrderError, Outcome, UnknownStrategy};

/// The body of every error answer.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// A stable code a program can branch on, such as `sold_out` or `lock_timeout`.
    #[schema(example = "sold_out")]
    pub error: String,
    /// What went wrong, as a sentence for people.
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The request could not be read as JSON at all (syntax, an empty body, not an
    /// object), or its query string does not fit.
    #[error("{0}")]
    Malformed(String),
    /// The body is a JSON object, but not one the route takes: a field missing or of
    /// the wrong type, or a value out of range or not allowed.
    #[error("{0}")]
    Invalid(String),
    /// The body has a field the route does not know; the message names it.
    #[error("{0}")]
    UnknownField(String),
    #[error("{0}")]
    NotFound(String),
    #[error("this route does not take that HTTP method")]
    MethodNotAllowed,
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("this admin call needs Authorization: Bearer <admin token>")]
    Unauthorized,
    #[error("the admin token is not valid")]
    Forbidden,
    /// The request conflicts with what is going on (e.g. a load test already runs).
    #[error("{0}")]
    Conflict(String),
    /// Another request with the same Idempotency-Key is running.
    #[error(
        "an order with this Idempotency-Key is under way; ask again after Retry-After \
         for its answer"
    )]
    InProgress,
    /// The Idempotency-Key was sent before with another order.
    #[error(
        "this Idempotency-Key was sent with another order (SKU, user or quantity); a key \
         names one order: use a new key for a new order"
    )]
    KeyReused,
    /// A feature this replica cannot offer right now; the message says why.
    #[error("{0}")]
    Unavailable(String),
    /// Too many requests in flight on this replica.
    #[error("this replica is at its limit of requests in flight; try again")]
    Overloaded,
    /// The request took longer than the replica allows. An order it had not begun
    /// never begins; one already in its critical section runs to its end (committed or
    /// rolled back), so check the orders before buying again.
    #[error(
        "the request took longer than {0:?}; an order already under way finishes on its own, \
         one not yet begun never begins: sent with an Idempotency-Key K, send it again with \
         the same key (it is placed at most once) or look for it with \
         GET /api/orders?idempotency_key=K"
    )]
    TimedOut(std::time::Duration),
    /// An order that was not placed; its outcome names the code (`Outcome`).
    #[error("{}", order_message(.0))]
    Order(OrderError),
    /// Redis or MySQL could not be reached in time.
    #[error("{backend} is unavailable; try again shortly")]
    BackendUnavailable { backend: &'static str },
    /// A bug or an unexpected backend answer; the detail is in the log only.
    #[error("internal error")]
    Internal,
}

impl AppError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            AppError::Malformed(_) => (StatusCode::BAD_REQUEST, "malformed_request"),
            AppError::Invalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_value"),
            AppError::UnknownField(_) => (StatusCode::UNPROCESSABLE_ENTITY, "unknown_field"),
            AppError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            AppError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            AppError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            AppError::UnsupportedMediaType(_) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            AppError::Order(error) => {
                let outcome = error.outcome();
                (order_status(outcome), outcome.code())
            }
            AppError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            AppError::Forbidden => (StatusCode::FORBIDDEN, "forbidden"),
            AppError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            AppError::InProgress => (StatusCode::CONFLICT, "in_progress"),
            AppError::KeyReused => (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
            AppError::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
            AppError::TimedOut(_) => (StatusCode::SERVICE_UNAVAILABLE, "timeout"),
            AppError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            AppError::BackendUnavailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "backend_unavailable")
            }
            AppError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl AppError {
    /// The status and the body this error answers with.
    pub fn status_and_body(&self) -> (StatusCode, ErrorBody) {
        let (status, code) = self.status_and_code();
        let body = ErrorBody {
            error: code.to_owned(),
            message: self.to_string(),
        };
        (status, body)
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, body) = self.status_and_body();
        let mut response = (status, Json(body)).into_response();
        let retry_after = match &self {
            AppError::Order(error)
                if order_status(error.outcome()) == StatusCode::SERVICE_UNAVAILABLE =>
            {
                Some("1")
            }
            AppError::BackendUnavailable { .. }
            | AppError::Overloaded
            | AppError::TimedOut(_)
            | AppError::InProgress => Some("1"),
            _ => None,
        };
        if matches!(self, AppError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(seconds));
        }
        response
    }
}

impl From<JsonRejection> for AppError {
    fn from(rejection: JsonRejection) -> Self {
        let message = rejection.body_text();
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => AppError::PayloadTooLarge(message),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => AppError::UnsupportedMediaType(
                "expected a JSON body with Content-Type: application/json".into(),
            ),
            _ => AppError::Malformed(message),
        }
    }
}

impl From<QueryRejection> for AppError {
    fn from(rejection: QueryRejection) -> Self {
        AppError::Malformed(rejection.body_text())
    }
}

impl From<StoreError> for AppError {
    fn from(error: StoreError) -> Self {
        match error.unavailable_backend() {
            Some(backend) => {
                tracing::warn!(%error, backend, "backend unavailable");
                AppError::BackendUnavailable { backend }
            }
            None => {
                tracing::error!(%error, "backend error");
                AppError::Internal
            }
        }
    }
}

impl From<UnknownStrategy> for AppError {
    fn from(unknown: UnknownStrategy) -> Self {
        AppError::Invalid(unknown.to_string())
    }
}

impl From<OrderError> for AppError {
    fn from(error: OrderError) -> Self {
        match &error {
            OrderError::LockBackend { backend, detail } => {
                tracing::warn!(backend, %detail, "lock backend failed");
            }
            OrderError::Store(store) => match store.unavailable_backend() {
                Some(backend) => tracing::warn!(%store, backend, "backend unavailable"),
                None => tracing::error!(%store, "backend error"),
            },
            _ => {}
        }
        AppError::Order(error)
    }
}

/// The HTTP status of each way an order can end.
fn order_status(outcome: Outcome) -> StatusCode {
    match outcome {
        Outcome::Created => StatusCode::CREATED,
        // A duplicate is answered with the order under its key (`http::orders`); were
        // it ever sent as an error, it is a conflict with that order.
        Outcome::SoldOut | Outcome::LockLost | Outcome::LimitReached | Outcome::Duplicate => {
            StatusCode::CONFLICT
        }
        Outcome::NotFound => StatusCode::NOT_FOUND,
        Outcome::LockTimeout
        | Outcome::TooManyConflicts
        | Outcome::SaleChanged
        | Outcome::Unavailable
        | Outcome::BackendUnavailable
        | Outcome::Abandoned => StatusCode::SERVICE_UNAVAILABLE,
        Outcome::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The sentence an order's error answers with; backend details stay in the log.
fn order_message(error: &OrderError) -> String {
    match error {
        OrderError::UnknownSku(sku) => format!("unknown SKU '{sku}'"),
        OrderError::StockUnavailable(sku) => format!(
            "Redis holds no stock for '{sku}' (restarted, or dropped after a write whose \
             outcome is unknown); an admin must rebuild it from MySQL with \
             POST /api/admin/reconcile"
        ),
        OrderError::SoldOut {
            available,
            requested,
        } => format!("sold out: {available} left, {requested} requested"),
        OrderError::LimitReached => "this shopper has bought as many units of this SKU as \
             the sale allows per user (limit_per_user); nothing was written"
            .into(),
        OrderError::DuplicateKey => "an order with this Idempotency-Key is recorded already".into(),
        OrderError::Busy(message) | OrderError::GaveUp(message) => message.clone(),
        OrderError::LockLost(detail) => format!(
            "the lock was lost before the order was committed; nothing was written ({detail})"
        ),
        OrderError::Fenced { token } => format!(
            "MySQL refused fencing token {token}: a newer lock holder began since; nothing \
             was written (if every order is refused so, the lock service's tokens went \
             back below the fence: an admin resets it with POST /api/admin/fences/reset)"
        ),
        OrderError::StaleRead => "MySQL refused the write: the stock it was computed from \
             had changed; nothing was written"
            .into(),
        OrderError::SaleChanged => "the sale changed (strategy, fencing or cohort \
             switch, reset, reconcile or fence reset) while the order was under way; \
             nothing was written, try again"
            .into(),
        OrderError::Abandoned => {
            "the shopper left before the order was placed; nothing was written".into()
        }
        OrderError::LockBackend { backend, .. } => {
            format!("{backend} is unavailable; try again shortly")
        }
        OrderError::Store(store) => match store.unavailable_backend() {
            Some(backend) => format!("{backend} is unavailable; try again shortly"),
            None => "internal error".into(),
        },
    }
}
