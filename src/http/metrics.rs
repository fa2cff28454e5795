//! `GET /metrics` in the Prometheus text format, and the middleware that counts and
//! times every request by its route template (never the raw path, whose variety
//! would blow up the label set).

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::{AppError, ErrorBody};
use super::stats;

pub async fn observe(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_owned(), |path| path.as_str().to_owned());
    let method = request.method().to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("flashsale_http_requests_total",
        "route" => route.clone(), "method" => method, "status" => status)
    .increment(1);
    metrics::histogram!("flashsale_http_request_duration_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Refreshes the stock gauges from the records, then renders everything.
#[utoipa::path(get, path = "/metrics", tag = "service",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain",
            body = String),
        (status = 503, description = "`backend_unavailable`: the records cannot be read",
            body = ErrorBody),
    ))]
pub async fn render(State(state): State<AppState>) -> Result<Response, AppError> {
    let stats = stats::collect(&state, None).await?;
    for sku in &stats.skus {
        let name = sku.sku.to_string();
        metrics::gauge!("flashsale_stock", "sku" => name.clone(), "store" => "mysql")
            .set(sku.stock_mysql as f64);
        if let Some(redis) = sku.stock_redis {
            metrics::gauge!("flashsale_stock", "sku" => name.clone(), "store" => "redis")
                .set(redis as f64);
        }
        metrics::gauge!("flashsale_oversold", "sku" => name).set(sku.oversold as f64);
    }
    let body = state.metrics.render();
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response())
}
