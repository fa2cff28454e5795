//! The HTTP surface of one replica (`docs/api.md`): routes, the JSON extractor whose
//! rejections become our JSON errors, and the layers around them.
//!
//! Handlers translate between HTTP and the domain; they never talk to Redis or MySQL
//! directly but through `store` and `strategy`.

mod admin;
mod assets;
mod auth;
mod cors;
mod crowd;
mod error;
mod events;
mod health;
mod json;
pub mod limits;
mod loadtests;
mod metrics;
mod openapi;
mod orders;
mod runs;
mod state;
pub mod stats;
mod strategies;
mod timeline;

use std::path::Path;
use std::sync::atomic::Ordering;

use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::Uri;
use axum::http::header::HeaderName;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Router};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::services::ServeDir;
use tower_http::trace::{DefaultOnFailure, TraceLayer};
use tracing::Level;

pub use error::{AppError, ErrorBody};
pub use events::{Snapshots, spawn_snapshots};
pub use json::ApiJson;
pub use state::AppState;

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Request bodies larger than this are refused with 413 before they are parsed.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// Load-test reports are larger than orders; they get a limit of their own.
pub const MAX_REPORT_BYTES: usize = 256 * 1024;

pub fn router(
    state: AppState,
    static_dir: Option<&Path>,
    limits: limits::Limits,
    cors_origins: &[String],
) -> Router {
    // Calls that change the sale or start load: behind the admin token when one is set.
    let admin = Router::new()
        .route(
            "/api/admin/strategy",
            get(admin::active_strategy).put(admin::set_strategy),
        )
        .route("/api/admin/reset", post(admin::reset))
        .route("/api/admin/reconcile", post(admin::reconcile))
        .route("/api/admin/crowd", post(crowd::crowd))
        .route(
            "/api/admin/fencing",
            get(admin::fencing).put(admin::set_fencing),
        )
        .route(
            "/api/admin/cohort",
            get(admin::cohort).put(admin::set_cohort),
        )
        .route("/api/admin/fences/reset", post(admin::reset_fences))
        .route(
            "/api/admin/faults",
            post(admin::arm_fault).delete(admin::disarm_fault),
        )
        .route("/api/admin/faults/kill-holder", post(admin::kill_holder))
        .route("/api/loadtests", post(loadtests::start))
        .route(
            "/api/runs",
            post(runs::save).layer(DefaultBodyLimit::max(MAX_REPORT_BYTES)),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin,
        ));

    let public = Router::new()
        .route(
            "/api/orders",
            post(orders::place_order).get(orders::order_by_key),
        )
        .route("/api/orders/{id}", get(orders::order))
        .route("/api/strategies", get(strategies::list))
        .route("/api/stats", get(stats::stats))
        .route("/api/timeline", get(timeline::timeline))
        .route("/api/loadtests", get(loadtests::status))
        .route("/api/runs", get(runs::list))
        .route("/api/runs/{id}", get(runs::one))
        .route("/api", axum::routing::any(unknown_api_route))
        .route("/api/", axum::routing::any(unknown_api_route))
        .route("/api/{*rest}", axum::routing::any(unknown_api_route));

    // Long-lived or must answer even when the replica is saturated: outside the limits.
    let unlimited = Router::new()
        .route("/livez", get(health::livez))
        .route("/readyz", get(health::readyz))
        .route("/healthz", get(health::healthz))
        .route("/metrics", get(metrics::render))
        .route("/api/events", get(events::events))
        .route("/api/openapi.json", get(openapi::openapi_json));

    // The admin calls have places of their own, so an operator can still switch,
    // reset or reconcile while shoppers fill every place of the replica.
    let admin_limits = limits::Limits::new(limits.timeout, limits::ADMIN_IN_FLIGHT);
    let routes = within(admin, admin_limits)
        .merge(within(public, limits))
        .merge(unlimited)
        // A route layer, so it runs after routing and sees the route template.
        .route_layer(middleware::from_fn(metrics::observe))
        .method_not_allowed_fallback(method_not_allowed);
    let routes = match static_dir {
        Some(dir) => routes.fallback_service(ServeDir::new(dir)),
        None => routes.fallback(assets::serve),
    };
    let router = routes
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        // A bug that panics in a handler answers the usual JSON 500 instead of
        // dropping the connection; the panic is logged.
        .layer(CatchPanicLayer::custom(answer_panic))
        // tower-http logs every 5xx as an error; here most are expected answers (503
        // lock_timeout under contention). Real failures are logged where they happen,
        // with their detail (`error.rs`, `limits.rs`), and every status is counted in
        // /metrics.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_failure(DefaultOnFailure::new().level(Level::DEBUG)),
        )
        // Every request gets an id (or keeps the caller's), echoed in the answer and
        // carried by every log line written while it is served.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state);
    // Outermost, so a browser's preflight is answered before auth and limits.
    match cors::layer(cors_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    }
}

/// `routes` behind `limits`: a place among those in flight, and the request timeout.
fn within(routes: Router<AppState>, limits: limits::Limits) -> Router<AppState> {
    let timeout = limits.timeout;
    routes.route_layer(
        ServiceBuilder::new()
            .layer(middleware::from_fn_with_state(limits, limits::take_place))
            .layer(HandleErrorLayer::new(move |uri: Uri, error: BoxError| {
                limits::refused(uri, error, timeout)
            }))
            .timeout(timeout),
    )
}

/// The span every log line of a request is written in: its id, method and path.
fn request_span(request: &Request) -> tracing::Span {
    let id = request
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    tracing::info_span!("request", id, method = %request.method(), path = request.uri().path())
}

fn answer_panic(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let message = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    tracing::error!(panic = message, "a handler panicked");
    AppError::Internal.into_response()
}

async fn method_not_allowed() -> AppError {
    AppError::MethodNotAllowed
}

async fn unknown_api_route() -> AppError {
    AppError::NotFound("no such API route".into())
}

/// Counts requests for the replica registry's "requests served".
async fn count_requests(State(state): State<AppState>, request: Request, next: Next) -> Response {
    state.requests.fetch_add(1, Ordering::Relaxed);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_answered_with_the_json_500() {
        let response = answer_panic(Box::new("index out of bounds"));
        assert_eq!(
            response.status(),
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            response
                .headers()
                .get(axum::http::header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
            Some(&b"application/json"[..])
        );
    }
}
